#!/usr/bin/env bash
# Long fuzzing: every cargo-fuzz target in fuzz/ for SECONDS each (first argument,
# required), one after another, through scripts/fuzz-smoke.sh (same build, flags and
# failure handling). The corpus grows in fuzz/corpus/<target>/ (ignored by git) and is
# reused by the next run; seeds stay in fuzz/seeds/. Prints executions per target.
# `--runs N` instead runs each target for N executions (e.g. --runs 10000000).
# FUZZ_TARGETS="a b" limits the run (and the smoke run) to some targets.
set -euo pipefail

seconds="${1:-}"
if [ "$seconds" = "--runs" ]; then
    export FUZZ_RUNS="${2:-}"
    seconds=1
    if ! [[ "$FUZZ_RUNS" =~ ^[0-9]+$ ]] || [ "$FUZZ_RUNS" -eq 0 ]; then
        echo "usage: $0 SECONDS (per target) | --runs N (executions per target)" >&2
        exit 2
    fi
fi
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
    echo "usage: $0 SECONDS (per target) | --runs N (executions per target)" >&2
    exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
export FUZZ_CORPUS="$here/../fuzz/corpus"
mkdir -p "$FUZZ_CORPUS"
exec "$here/fuzz-smoke.sh" "$seconds"
