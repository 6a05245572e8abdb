#!/usr/bin/env bash
# The trust suites at full size (CI runs them reduced through `cargo test`):
#   faults  supervisor SIGKILLed at random points of snapshot, rollback, clone,
#           hibernate, wake and destroy, both engines (CUBE_FAULTS, default 200 per
#           operation and engine); the caller killed instead (CUBE_CALLER_FAULTS,
#           default 200); damaged snapshot files and a full store
#   cycles  pause/resume and hibernate/wake cycles (CUBE_CYCLES, default 100) and
#           snapshot -> rollback -> clone generations (CUBE_GENERATIONS, default 20)
#   churn   sandboxes created and destroyed or killed, then a leak census
#           (CUBE_CHURN, default 500)
#   all     the three, in that order (the default)
# Sizes may be set in the environment. CUBE_FAULT_SEED repeats a faults run's delays;
# CUBE_FAULT_OPS=snapshot,wake limits it to some operations. Needs root; a host without
# KVM or CRIU runs what it can and prints `skipped: <reason>` for the rest.
set -euo pipefail

what="${1:-all}"
case "$what" in
    faults | cycles | churn | all) ;;
    *)
        echo "usage: $0 [faults|cycles|churn|all]" >&2
        exit 2
        ;;
esac

cd "$(dirname "$0")/.."
export CUBE_FAULTS="${CUBE_FAULTS:-200}"
export CUBE_CALLER_FAULTS="${CUBE_CALLER_FAULTS:-200}"
export CUBE_CYCLES="${CUBE_CYCLES:-100}"
export CUBE_GENERATIONS="${CUBE_GENERATIONS:-20}"
export CUBE_CHURN="${CUBE_CHURN:-500}"

run() {
    local test="$1"
    local start
    start=$(date +%s)
    echo "fault-suite: $test"
    # --nocapture: the suites print their counts and times.
    cargo test -p cube-core --release --locked --test "$test" -- --nocapture --test-threads=1
    echo "fault-suite: $test done in $(( $(date +%s) - start )) s"
}

cargo build -p cube-supervisor -p cube-agent --release --locked
case "$what" in
    faults) run faults ;;
    cycles) run cycles ;;
    churn) run churn ;;
    all)
        run faults
        run cycles
        run churn
        ;;
esac
