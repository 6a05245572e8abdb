#!/usr/bin/env bash
# Fuzz smoke test: builds every cargo-fuzz target in fuzz/ (libFuzzer, AddressSanitizer,
# debug assertions) and runs each for N seconds (first argument, default 15) starting
# from its committed seeds in fuzz/seeds/<target>/. Fails if any target crashes,
# panics, leaks, hangs past 10 s (FUZZ_TIMEOUT) on one input, or fails to build.
#
# Mode: real coverage-guided fuzzing with cargo-fuzz. cargo-fuzz needs nightly-only
# flags (-Zsanitizer); on a stable toolchain this script sets RUSTC_BOOTSTRAP=1 for
# the fuzz build only (the fuzz crate is its own workspace, so the main build never
# sees it). cargo-fuzz is installed with `cargo install cargo-fuzz --locked` if missing
# (about a minute on 2 cores).
#
# New inputs go to a temporary corpus (or to $FUZZ_CORPUS/<target>, kept between runs:
# scripts/fuzz-long.sh uses fuzz/corpus), never into fuzz/seeds/. A crash is kept in
# fuzz/artifacts/<target>/; the script prints the command that reproduces it. The last
# lines list each target's executions. With FUZZ_RUNS=N each target stops after N
# executions instead, however long that takes (the seconds argument is then ignored).
# FUZZ_TIMEOUT=S sets the seconds one input may take (default 10); a long run on a
# shared machine may raise it, since time the fuzzer spends stopped or starved counts.
# FUZZ_BUILD=dev builds without optimisation (cargo fuzz --dev; still ASan, debug
# assertions and coverage): on 2 cores the build takes 4 min 43 s instead of 9 min
# 42 s, and each input runs 14 to 26 times slower, so a short smoke run (CI's) still
# replays every seed and explores a little. Long runs keep the default, an optimised
# build.
set -euo pipefail

seconds="${1:-15}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
    echo "usage: $0 [seconds per target, default 15]" >&2
    exit 2
fi
timeout="${FUZZ_TIMEOUT:-10}"
if ! [[ "$timeout" =~ ^[0-9]+$ ]] || [ "$timeout" -eq 0 ]; then
    echo "$0: FUZZ_TIMEOUT must be a whole number of seconds above 0, not '$timeout'" >&2
    exit 2
fi

profile=()
case "${FUZZ_BUILD:-release}" in
    release) ;;
    dev) profile=(--dev) ;;
    *)
        echo "$0: FUZZ_BUILD must be release or dev, not '${FUZZ_BUILD}'" >&2
        exit 2
        ;;
esac

cd "$(dirname "$0")/../fuzz"
start=$(date +%s)
log() { echo "fuzz-smoke: $* ($(( $(date +%s) - start )) s)"; }

if ! cargo fuzz --version >/dev/null 2>&1; then
    log "installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

if rustc --version | grep -q nightly; then
    log "mode: cargo-fuzz (libFuzzer + ASan) on nightly rustc"
else
    export RUSTC_BOOTSTRAP=1
    log "mode: cargo-fuzz (libFuzzer + ASan) on stable rustc with RUSTC_BOOTSTRAP=1"
fi

log "building all targets (${FUZZ_BUILD:-release})"
cargo fuzz build "${profile[@]}"
# cargo fuzz has no --locked: a lock file the build had to change is stale (the fuzz
# crate is its own workspace, so a dependency added to a crate shows up only here).
if git rev-parse --is-inside-work-tree >/dev/null 2>&1 && ! git diff --quiet -- Cargo.lock; then
    git --no-pager diff --stat -- Cargo.lock
    echo "fuzz-smoke: fuzz/Cargo.lock is out of date: commit the one this build wrote" >&2
    exit 1
fi

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
corpus="${FUZZ_CORPUS:-$logs}"

failed=()
summary=()
for target in ${FUZZ_TARGETS:-$(cargo fuzz list)}; do
    seeds="seeds/$target"
    mkdir -p "$corpus/$target"
    args=("$corpus/$target")
    if [ -d "$seeds" ]; then
        args+=("$seeds")
    else
        log "warning: $target has no seeds in fuzz/$seeds"
    fi
    if [ -n "${FUZZ_RUNS:-}" ]; then
        log "running $target for ${FUZZ_RUNS} executions"
        limit=(-runs="$FUZZ_RUNS")
    else
        log "running $target for ${seconds} s"
        limit=(-max_total_time="$seconds")
    fi
    out="$logs/$target.log"
    if cargo fuzz run "${profile[@]}" "$target" "${args[@]}" -- \
        "${limit[@]}" -timeout="$timeout" -print_final_stats=1 >"$out" 2>&1; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out")
        rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$out")
        cov=$(grep -Eo 'cov: [0-9]+' "$out" | tail -1)
        took=$(sed -n 's/^stat::.*//; s/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$out")
        log "$target: ok, ${runs:-?} runs, ${rate:-?} exec/s, $cov${took:+, ${took} s}"
        summary+=("$(printf '%-20s %12s runs %8s exec/s  %s' "$target" "${runs:-?}" "${rate:-?}" "$cov")")
    else
        tail -n 60 "$out"
        artifact=$(grep -Eo 'artifacts/[^ ]+' "$out" | tail -1 || true)
        log "$target: FAILED"
        if [ -n "$artifact" ]; then
            echo "reproduce: (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run ${profile[*]} $target $artifact)"
        fi
        failed+=("$target")
        summary+=("$(printf '%-20s FAILED' "$target")")
    fi
done

if [ -n "${FUZZ_RUNS:-}" ]; then each="${FUZZ_RUNS} runs"; else each="${seconds} s"; fi
log "executions per target (${each} each):"
printf '  %s\n' "${summary[@]}"

if [ "${#failed[@]}" -gt 0 ]; then
    log "failed: ${failed[*]}"
    exit 1
fi
log "all targets passed"
