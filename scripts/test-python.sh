#!/usr/bin/env bash
# The Python package's test suite: builds the wheel (unless CUBE_WHEEL names one),
# installs it with pytest into a fresh virtualenv, and runs cube-py/tests against real
# sandboxes. Sandboxes need root; as another user the suite reports its tests skipped.
#
#   scripts/test-python.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"

wheel="${CUBE_WHEEL:-}"
if [ -z "$wheel" ]; then
    bash scripts/build-wheel.sh
    wheel=$(ls -1t "$target"/wheels/cubesandbox-*.whl | head -n 1)
fi

mkdir -p "$target"
venv="$(cd "$target" && pwd)/py-test-venv"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "pytest>=7" "$wheel"

# Run from outside the source tree so `import cubesandbox` is the installed wheel, not
# cube-py/python; each run gets a store of its own, removed afterwards.
store=$(mktemp -d /tmp/cube-py-store.XXXXXX)
cleanup() {
    # Whatever a failed or interrupted run left running goes before its store does.
    CUBE_HOME="$store" "$venv/bin/python" - <<'PY' || true
import cubesandbox
for info in cubesandbox.Sandbox.list():
    try:
        cubesandbox.Sandbox.connect(info.sandbox_id).kill()
    except cubesandbox.CubeError as e:
        print(f"test-python: could not kill {info.sandbox_id}: {e}")
PY
    # Pre-started supervisors tear their ready jails down once this process is gone,
    # asynchronously: wait for them so that the store can be removed.
    for _ in $(seq 200); do
        pgrep -f -- "--scratch $store/" >/dev/null || break
        sleep 0.1
    done
    rm -rf "$store" || echo "test-python: could not remove $store" >&2
}
trap cleanup EXIT
tests="$(pwd)/cube-py/tests"
set +e
(cd / && CUBE_HOME="$store" "$venv/bin/python" -m pytest -p no:cacheprovider "$tests" "$@")
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of this suite, not a pass.
if [ "$rc" -eq 5 ]; then
    echo "test-python: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
