#!/usr/bin/env bash
# E2B's official SDKs, unmodified, against `cube serve`: starts the server on loopback
# with a random port and API key, makes fresh virtualenvs with the newest Python SDKs
# and with e2b 2.21.0 (and the newest e2b-code-interpreter that accepts it), an npm
# project with the newest JavaScript SDKs, and runs tests/e2b-sdk/ with each. The SDKs
# find the server through their own settings:
#   newest Python, JavaScript: E2B_API_URL + E2B_SANDBOX_URL (plain HTTP)
#   Python 2.21.0:             E2B_API_URL + E2B_DOMAIN=cube.localhost: its code interpreter
#                              only speaks https://<port>-<id>.<domain>, so the server
#                              also serves TLS on 127.0.0.1:443 and [::1]:443 with a
#                              certificate of a CA made here (SSL_CERT_FILE), and
#                              *.localhost resolves to loopback (libnss-myhostname).
# The dashboard test opens the admin page in headless Chromium (playwright-core) when
# /usr/bin/chromium exists, and says it skipped otherwise.
#
#   scripts/test-e2b-sdks.sh [pytest args...]      # CUBE=path/to/cube to pick the binary,
#                                                  # E2B_SDKS="newest 2.21.0 js" to pick SDKs
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
target="${CARGO_TARGET_DIR:-target}"
cube="${CUBE:-$target/release/cube}"
[ -x "$cube" ] || { echo "test-e2b-sdks: $cube is missing (cargo build --release)" >&2; exit 1; }
cube=$(cd "$(dirname "$cube")" && pwd)/$(basename "$cube")
if [ "$(id -u)" -ne 0 ]; then
    echo "test-e2b-sdks: skipped: sandboxes need root"
    exit 0
fi

work=$(mktemp -d /tmp/cube-e2b-sdks.XXXXXX)
store="$work/store"
mkdir -p "$store"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then
        kill -TERM "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    # What a failed run left: every sandbox of this store goes before the store does.
    if [ -d "$store/sandboxes" ]; then
        for id in $(ls "$store/sandboxes" 2>/dev/null); do
            "$cube" --store "$store" sandbox rm "$id" >/dev/null 2>&1 || true
        done
    fi
    for _ in $(seq 100); do
        pgrep -f -- "--scratch $store/" >/dev/null || break
        sleep 0.1
    done
    rm -rf "$work" || echo "test-e2b-sdks: could not remove $work" >&2
}
trap cleanup EXIT

key="cube-test-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port)
admin=$(free_port)

# A CA and a certificate for *.cube.localhost (a wildcard needs two labels under it), for the HTTPS host names of the old SDK.
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=cube test CA" \
    -keyout "$work/ca.key" -out "$work/ca.pem" >/dev/null 2>&1
openssl req -newkey rsa:2048 -nodes -subj "/CN=*.cube.localhost" \
    -keyout "$work/tls.key" -out "$work/tls.csr" >/dev/null 2>&1
printf 'subjectAltName=DNS:*.cube.localhost\nbasicConstraints=CA:FALSE\n' > "$work/ext"
openssl x509 -req -in "$work/tls.csr" -CA "$work/ca.pem" -CAkey "$work/ca.key" \
    -CAcreateserial -days 2 -extfile "$work/ext" -out "$work/tls.pem" >/dev/null 2>&1
tls_args=()
https=1
for addr in 127.0.0.1:443 '[::1]:443'; do
    if python3 -c "import socket,sys; h,p='$addr'.rsplit(':',1); f=socket.AF_INET6 if h.startswith('[') else socket.AF_INET; s=socket.socket(f); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((h.strip('[]'),int(p)))" 2>/dev/null; then
        tls_args+=(--tls-listen "$addr")
    else
        https=0
    fi
done
[ "$https" = 1 ] || echo "test-e2b-sdks: port 443 is taken: the 2.21.0 code-interpreter tests will fail to connect" >&2

# Room for the 50 concurrent creates of the suite (the defaults allow 16 at once).
printf 'max_concurrent_creates = 64\nmax_sandboxes = 128\n' > "$work/serve.toml"
CUBE_LOG="${CUBE_LOG:-warn}" CUBE_API_KEY="$key" "$cube" --store "$store" serve --config "$work/serve.toml" \
    --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" --domain cube.localhost \
    --tls-cert "$work/tls.pem" --tls-key "$work/tls.key" "${tls_args[@]}" \
    > "$work/serve.log" 2>&1 &
server_pid=$!
for _ in $(seq 200); do
    curl -s -o /dev/null "http://127.0.0.1:$port/" && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
    sleep 0.1
done
echo "test-e2b-sdks: cube serve on 127.0.0.1:$port (admin $admin)"

export E2B_API_KEY="$key" E2B_API_URL="http://127.0.0.1:$port"
export PIP_DISABLE_PIP_VERSION_CHECK=1
tests="$root/tests/e2b-sdk"
rc=0

run_python() {
    local name=$1 spec=$2
    shift 2
    local venv="$work/venv-$name"
    python3 -m venv "$venv"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install --quiet $spec "pytest>=7" httpx
    echo "test-e2b-sdks: python $name: $("$venv/bin/pip" list 2>/dev/null | grep -E '^e2b' | tr -s ' ' | paste -sd, -)"
    set +e
    (cd "$work" && env "$@" "$venv/bin/python" -m pytest -p no:cacheprovider -q "$tests/test_python_sdk.py" "${PYTEST_ARGS[@]}")
    local r=$?
    set -e
    if [ "$r" -eq 5 ]; then
        echo "test-e2b-sdks: pytest collected no tests" >&2
        r=1
    fi
    [ "$r" -eq 0 ] || rc=1
}
PYTEST_ARGS=("$@")

# E2B_SDKS picks some of the three (default: all).
sdks=" ${E2B_SDKS:-newest 2.21.0 js} "
if [[ $sdks == *" newest "* ]]; then
    run_python newest "e2b e2b-code-interpreter" E2B_SANDBOX_URL="http://127.0.0.1:$port" CUBE_FIFTY=1
fi
if [[ $sdks == *" 2.21.0 "* ]]; then
    run_python 2.21.0 "e2b==2.21.0 e2b-code-interpreter" E2B_DOMAIN=cube.localhost SSL_CERT_FILE="$work/ca.pem"
fi
if [[ $sdks != *" js "* ]]; then
    exit "$rc"
fi

echo "test-e2b-sdks: javascript"
js="$work/js"
mkdir -p "$js"
cp "$tests/test_js_sdk.mjs" "$js/"
(cd "$js" && npm init -y >/dev/null && npm install --silent --no-audit --no-fund e2b @e2b/code-interpreter playwright-core >/dev/null)
echo "test-e2b-sdks: js: $(cd "$js" && npm ls --depth=0 2>/dev/null | grep -E 'e2b|playwright' | tr -s ' ' | paste -sd, -)"
set +e
(cd "$js" && E2B_SANDBOX_URL="http://127.0.0.1:$port" CUBE_ADMIN_URL="http://127.0.0.1:$admin" \
    node --test --test-reporter=spec test_js_sdk.mjs)
r=$?
set -e
[ "$r" -eq 0 ] || rc=1

if [ "$rc" -ne 0 ]; then
    echo "test-e2b-sdks: failures; the server's log:" >&2
    tail -n 50 "$work/serve.log" >&2
fi
exit "$rc"
