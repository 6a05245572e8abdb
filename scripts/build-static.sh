#!/usr/bin/env bash
# Links one of the workspace's executables statically:
# `build-static.sh [--musl] PACKAGE BINARY [cargo flags...]`, e.g.
# `build-static.sh --musl cube-agent cube-agent --release --locked`.
# The result is target/static/PROFILE/BINARY (apart from cargo's own outputs, which a
# later `cargo build` would put back).
#
# Why: cube-agent is bound into every sandbox, whose root may carry another C library
# than the host's (a template built from other packages, or none), so it must not
# need the host's dynamic loader; and the `cube` CLI, which starts once per `cube run`,
# starts about 0.45 ms sooner without one (`perf stat -r 100 cube --version` here:
# 1.94 -> 1.49 ms). Neither calls into NSS (no getpwnam, no getaddrinfo), which static
# glibc could not do reliably.
#
# --musl: link against musl where its Rust target is installed (setup.sh adds it),
# else fall back to static glibc, saying so. Static glibc probes the CPU's caches with
# CPUID at every start, which these PVM hosts emulate: a static glibc program takes
# ~0.74 ms from exec to exit here, a musl one ~0.43 ms (`perf stat -r 300 cube-agent
# --version`), and the agent starts once per sandbox. Only crates that build for musl
# can use it (the CLI does not: nix lacks some calls there).
#
# Only the binary is linked differently (`cargo rustc` passes the flag to the final
# crate alone): the libraries stay as `cargo build` made them. Proc-macro crates rule
# out the flag for the whole workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
musl=
if [ "${1:-}" = --musl ]; then
    musl=x86_64-unknown-linux-musl
    shift
fi
if [ $# -lt 2 ]; then
    echo "usage: build-static.sh [--musl] PACKAGE BINARY [cargo flags...]" >&2
    exit 2
fi
package=$1 binary=$2
shift 2
profile=debug
for flag in "$@"; do
    [ "$flag" = --release ] && profile=release
done
target_dir="${CARGO_TARGET_DIR:-target}"
if [ -n "$musl" ] && [ "$(uname -m)" = x86_64 ] && command -v rustup >/dev/null 2>&1 &&
    rustup target list --installed 2>/dev/null | grep -qx "$musl"; then
    cargo build "$@" --target "$musl" -p "$package" --bin "$binary"
    built="$target_dir/$musl/$profile/$binary"
    how=musl
else
    [ -n "$musl" ] && echo "build-static: the $musl Rust target is not installed: linking $binary with static glibc" >&2
    cargo rustc "$@" -p "$package" --bin "$binary" -- -C target-feature=+crt-static
    built="$target_dir/$profile/$binary"
    how="static glibc"
fi
# A dynamically linked executable names its loader in a PT_INTERP header.
if readelf -lW "$built" | grep -q 'INTERP'; then
    echo "build-static: $built is not statically linked (it has a program interpreter)" >&2
    exit 1
fi
out="$target_dir/static/$profile/$binary"
mkdir -p "$(dirname "$out")"
cp -f "$built" "$out.tmp"
mv -f "$out.tmp" "$out"
echo "build-static: $out ($how)"
