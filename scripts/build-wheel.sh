#!/usr/bin/env bash
# Builds the `cubesandbox` wheel: first the helper programs a sandbox needs
# (cube-supervisor, cube-agent), copied into the package so that `pip install` alone is
# enough, then the abi3 extension with maturin. (A plain `maturin build` or
# `pip install ./cube-py` works too: cube-py's build script then builds the helpers in
# a target directory of its own; this script reuses the workspace's build instead.) The wheel lands in target/wheels/
# (under $CARGO_TARGET_DIR when that is set).
#
#   scripts/build-wheel.sh            # release build
#   CUBE_WHEEL_PROFILE=debug scripts/build-wheel.sh   # faster, for iterating
#
# maturin comes from PyPI into a tools virtualenv under target/ (set MATURIN to use
# another one).
set -euo pipefail
cd "$(dirname "$0")/.."

profile="${CUBE_WHEEL_PROFILE:-release}"
target="${CARGO_TARGET_DIR:-target}"
case "$profile" in
    release) cargo_flags=(--release); maturin_flags=(--release); bin_dir=$target/release ;;
    debug) cargo_flags=(); maturin_flags=(); bin_dir=$target/debug ;;
    *) echo "build-wheel: CUBE_WHEEL_PROFILE must be release or debug, not $profile" >&2; exit 2 ;;
esac
locked=()
[ -n "${CI:-}" ] && locked=(--locked)

echo "build-wheel: helper binaries ($profile)"
# With the workspace-hack in the selection, cargo reuses the workspace's build of every
# dependency instead of building the supervisor's with fewer features.
cargo build "${cargo_flags[@]}" "${locked[@]}" -p cube-supervisor -p cube-workspace-hack --bin cube-supervisor
bash scripts/build-static.sh --musl cube-agent cube-agent "${cargo_flags[@]}" "${locked[@]}"
pkg_bin=cube-py/python/cubesandbox/bin
mkdir -p "$pkg_bin"
strip_flag=()
[ "$profile" = release ] && strip_flag=(-s)  # as maturin strips the extension
install -m 0755 "${strip_flag[@]}" "$bin_dir/cube-supervisor" "$target/static/$profile/cube-agent" "$pkg_bin/"

maturin="${MATURIN:-}"
if [ -z "$maturin" ]; then
    tools=$target/py-tools
    if [ ! -x "$tools/bin/maturin" ]; then
        echo "build-wheel: installing maturin into $tools"
        python3 -m venv "$tools"
        "$tools/bin/pip" install --quiet "maturin>=1.9,<2"
    fi
    maturin="$tools/bin/maturin"
fi

echo "build-wheel: wheel"
rm -f "$target"/wheels/cubesandbox-*.whl
# The helpers are in place: cube-py's build script need not build them again.
CUBE_PY_HELPERS=prebuilt "$maturin" build "${maturin_flags[@]}" "${locked[@]}" -m cube-py/Cargo.toml --out "$target/wheels"
ls -1 "$target"/wheels/cubesandbox-*.whl
