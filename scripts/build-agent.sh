#!/usr/bin/env bash
# Builds cube-agent as a static executable: `build-agent.sh [cargo flags...]`, e.g.
# `--release --locked`. The agent is bound into every sandbox, whose root may carry
# another C library than the host's (a template built from other packages, or none),
# so it must not depend on the host's dynamic loader; without one it also starts
# faster, and it starts once per sandbox. Only the binary is linked differently
# (`cargo rustc` passes the flag to the final crate alone): the libraries stay as
# `cargo build` made them, and a later `cargo build` relinks it dynamically.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo rustc "$@" -p cube-agent --bin cube-agent -- -C target-feature=+crt-static
profile=debug
for flag in "$@"; do
    [ "$flag" = --release ] && profile=release
done
agent="${CARGO_TARGET_DIR:-target}/$profile/cube-agent"
# A dynamically linked executable names its loader in a PT_INTERP header.
if readelf -lW "$agent" | grep -q 'INTERP'; then
    echo "build-agent: $agent is not statically linked (it has a program interpreter)" >&2
    exit 1
fi
