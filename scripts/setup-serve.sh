#!/usr/bin/env bash
# Set-up for `cube serve`'s SDK suite (scripts/test-e2b-sdks.sh): openssl for its test
# certificates, libnss-myhostname so that *.localhost names resolve to loopback (the
# host names e2b 2.21.0's code interpreter connects to), Chromium for the dashboard test
# (Debian's package; playwright-core drives it, so no browser download). Node.js and
# npm come with the host. Idempotent; called by scripts/setup.sh.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in openssl curl libnss-myhostname chromium; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
    echo "setup-serve: installing ${need[*]}"
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
fi
# The package adds itself to nsswitch.conf; make sure it did.
if ! grep -qE '^hosts:.*myhostname' /etc/nsswitch.conf; then
    sed -i -E 's/^(hosts:\s+files)/\1 myhostname/' /etc/nsswitch.conf
fi
command -v node >/dev/null && command -v npm >/dev/null ||
    echo "setup-serve: note: node/npm missing: the JavaScript SDK tests cannot run" >&2
