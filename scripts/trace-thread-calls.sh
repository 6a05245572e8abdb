#!/usr/bin/env bash
# The system calls each kind of supervisor thread makes, for the allow lists in
# cube-supervisor/src/confinement/thread_filters.rs: runs cube-core test binaries
# (the arguments, default the VM tests) with every supervisor under `strace -f`, and
# prints, per thread name (digits dropped: vcpu0, vcpu1 -> vcpu), the calls it made,
# ioctls, futexes and a few others with their request or operation. Run it after a
# change to the VMM or its devices, and compare with the lists: a call a list lacks
# kills the supervisor where the list is in force (calls made before a thread applies
# its list, at thread start and in the confinement signal handler, show up too).
#
# Needs root, strace, /dev/kvm and the guest kernels the tests use; builds the
# release supervisor and agent as the README's test command does.
#   scripts/trace-thread-calls.sh                        # the VM tests
#   scripts/trace-thread-calls.sh linux_vm_scenario      # one test binary
set -euo pipefail

cd "$(dirname "$0")/.."
command -v strace >/dev/null || { echo "strace is not installed" >&2; exit 1; }
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
    tests=(lifecycle linux_vm_lifecycle linux_vm_sandbox linux_vm_scenario snapshot_safety)
fi

work="$(mktemp -d /tmp/cube-trace.XXXXXX)"
trap 'rm -rf "$work"' EXIT
cargo build --release --locked -p cube-supervisor --bins
bash scripts/build-static.sh --musl cube-agent cube-agent --release --locked >/dev/null

# Reads `strace -f` lines ("TID call(args) = ret"); remembers each thread's name
# (PR_SET_NAME) and the calls it made; prints "name<TAB>call" at the end.
cat >"$work/collect.awk" <<'EOF'
{
  tid = $1
  rest = substr($0, length($1) + 2)
  if (rest ~ /^<\.\.\./ || rest ~ /^\+\+\+/ || rest ~ /^---/) next
  p = index(rest, "(")
  if (p == 0) next
  name = substr(rest, 1, p - 1)
  if (name !~ /^[a-z0-9_]+$/) next
  key = name
  if (name ~ /^(ioctl|fcntl|futex|socket|prctl|clone|clone3)$/) {
    split(substr(rest, p + 1), a, ", ")
    arg = (name ~ /^(ioctl|fcntl|futex|clone)$/) ? a[2] : a[1]
    sub(/[),].*/, "", arg); sub(/ <unfinished.*/, "", arg)
    key = name " " arg
  }
  if (name == "prctl" && rest ~ /PR_SET_NAME/) {
    match(rest, /"[^"]*"/); tname[tid] = substr(rest, RSTART + 1, RLENGTH - 2)
  }
  seen[tid SUBSEP key] = 1
}
END {
  for (k in seen) {
    split(k, b, SUBSEP)
    n = (b[1] in tname) ? tname[b[1]] : "main"
    sub(/[0-9]+$/, "", n)
    print n "\t" b[2]
  }
}
EOF

# The library waits for the supervisor's launcher to exit (the supervisor detaches),
# so strace runs in the background and the wrapper returns at once.
cat >"$work/supervisor" <<EOF
#!/bin/sh
strace -f -qq -s 32 -o "|awk -f $work/collect.awk >> $work/calls" "$PWD/target/release/cube-supervisor" "\$@" &
exit 0
EOF
chmod +x "$work/supervisor"

args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
# Tests that compare a supervisor's executable with $CUBE_SUPERVISOR fail under the
# wrapper; their supervisors' calls are collected all the same.
CUBE_SUPERVISOR="$work/supervisor" CUBE_AGENT="$PWD/target/static/release/cube-agent" \
    cargo test --release --locked -p cube-core "${args[@]}" -- --test-threads=1 || true
# Each strace writes its threads' calls when its supervisor ends.
sleep 3
sort -u "$work/calls" | awk -F'\t' '
    { calls[$1] = calls[$1] (calls[$1] == "" ? "" : "; ") $2 }
    END { for (t in calls) print t ":\n  " calls[t] "\n" }'
