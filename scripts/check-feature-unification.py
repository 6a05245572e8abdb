#!/usr/bin/env python3
"""Checks that every cargo selection CI and the set-up build resolves external crates
with the features the whole workspace's test build uses, so no selection rebuilds them.

Why: cargo resolves features per selection. Without the workspace-hack crate
(workspace-hack/, kept by `cargo hakari generate && cargo hakari manage-deps`),
`cargo rustc -p cube-cli` (the static `cube`), maturin's `-p cube-py` and
`cargo test --workspace` each enabled other features of a few shared crates (syn,
serde_core, tower, log...), and every crate above them was compiled again: the set-up
built most of the workspace three times over. A dependency change that forgets to
regenerate the hack shows up here, in seconds, instead of as a slower CI.

Usage: check-feature-unification.py  (from anywhere; exits 1 naming what differs)
"""

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# The selections scripts/setup.sh, scripts/build-wheel.sh and .ci/run build.
SELECTIONS = {
    "cargo build --workspace --bins": ["--workspace", "-e", "normal,build"],
    "the static cube (cargo rustc -p cube-cli)": ["-p", "cube-cli", "-e", "normal,build"],
    "the wheel (maturin, -p cube-py)": ["-p", "cube-py", "-e", "normal,build"],
    "the shim (-p cube-shim)": ["-p", "cube-shim", "-e", "normal,build"],
    "the wheel's supervisor (build-wheel.sh)":
        ["-p", "cube-supervisor", "-p", "cube-workspace-hack", "-e", "normal,build"],
}
REFERENCE = ["--workspace", "-e", "normal,build,dev"]


def features(args: list[str]) -> dict[str, set[str]]:
    """Each external package version, with the feature lists it is built with."""
    run = subprocess.run(
        ["cargo", "tree", "--locked", "--offline", "--prefix", "none", "-f", "{p} {f}", *args],
        cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"feature-unification: cargo tree {' '.join(args)} failed:\n{run.stderr}")
    out = run.stdout
    found: dict[str, set[str]] = {}
    for line in out.splitlines():
        parts = line.replace(" (*)", "").split()
        # Workspace members carry their path: their features are ours to choose.
        if len(parts) < 2 or any(p.startswith("(/") for p in parts[2:]):
            continue
        feats = parts[2] if len(parts) > 2 and not parts[2].startswith("(") else ""
        found.setdefault(f"{parts[0]} {parts[1]}", set()).add(feats)
    return found


def main() -> int:
    reference = features(REFERENCE)
    problems = 0
    for name, args in SELECTIONS.items():
        for package, feats in sorted(features(args).items()):
            extra = feats - reference.get(package, set())
            if extra:
                problems += 1
                print(f"feature-unification: {name} builds {package} with features "
                      f"{sorted(extra)}, which the workspace test build does not",
                      file=sys.stderr)
    if problems:
        print("feature-unification: run `cargo hakari generate && cargo hakari manage-deps`"
              " (cargo install cargo-hakari)", file=sys.stderr)
        return 1
    print(f"check-feature-unification: {len(SELECTIONS)} selections build external crates "
          f"as the workspace does ({len(reference)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
