#!/usr/bin/env bash
# The jail engine's extras: bubblewrap, the peer `cube bench --engine jail` measures
# `cube run -- true` against. Idempotent; run as root.
set -euo pipefail
if ! dpkg -s bubblewrap >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq bubblewrap >/dev/null
fi
