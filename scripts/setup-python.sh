#!/usr/bin/env bash
# Set-up for the Python package (cube-py): a python3 that can make virtualenvs, and
# maturin from PyPI in a tools virtualenv (target/py-tools) for scripts/build-wheel.sh.
# Idempotent; called by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c "import ensurepip" >/dev/null 2>&1; then
    echo "setup-python: installing python3-venv"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3-venv >/dev/null
fi

target="${CARGO_TARGET_DIR:-target}"
tools="$target/py-tools"
if [ ! -x "$tools/bin/maturin" ]; then
    echo "setup-python: maturin into $tools"
    python3 -m venv "$tools"
    "$tools/bin/pip" install --quiet "maturin>=1.9,<2"
fi
"$tools/bin/maturin" --version
