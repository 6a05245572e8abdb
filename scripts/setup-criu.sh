#!/usr/bin/env bash
# Provides a working CRIU (>= 4) at /usr/local/sbin/criu for the jail engine's
# full-process-state snapshots. Debian 12's criu 3.17 fails `criu check` on recent kernels
# (the vDSO `[vvar_vclock]` area), so this builds Debian trixie's CRIU source package.
# The source comes from the Debian archive through apt with a private sources list, so
# the host's apt configuration is untouched, and is checked against the SHA-256 in the
# signed Sources index. Two patches are applied: criu-rlimit-fallback.patch (read another
# task's rlimits from /proc/PID/limits where prlimit() is refused because root lacks
# CAP_SYS_RESOURCE, as in these hosts' containers) and
# criu-external-netns-conntrack.patch (no conntrack dump for a network namespace dumped
# as external, which Cube's jails are: the dump walked the host's whole conntrack table,
# a fifth of a jail dump's CPU time). CRIU is built without what Cube never uses (TLS
# page server, nftables network lock and ruleset, BPF maps, SELinux, the amdgpu plugin):
# their shared libraries made every criu start map and relocate 26 libraries, ~5 ms of
# CPU here, against ~1.8 ms for the 9 left, and a jail snapshot or restore starts criu
# once. Idempotent; run as root.
set -euo pipefail

CRIU_BIN=/usr/local/sbin/criu
# Cube's patches to CRIU; the stamp records which were built in, so a changed patch set
# rebuilds even where a working criu is installed.
here="$(cd "$(dirname "$0")" && pwd)"
PATCHES=("$here/criu-rlimit-fallback.patch" "$here/criu-external-netns-conntrack.patch")
CRIU_STAMP=/usr/local/lib/cube/criu.stamp
CRIU_SUITE="${CUBE_CRIU_SUITE:-trixie}"
CRIU_MIRROR="${CUBE_CRIU_MIRROR:-http://deb.debian.org/debian}"

if [ "$(id -u)" -ne 0 ]; then
    echo "setup-criu: run as root (installs packages and $CRIU_BIN)" >&2
    exit 1
fi

# What the build leaves out (part of the stamp: a change rebuilds).
LEAVE_OUT="NO_GNUTLS=1 libnftables libbpf libselinux libdrm"
stamp="$( (cat "${PATCHES[@]}"; echo "$LEAVE_OUT") | sha256sum | cut -d' ' -f1)"

# True when $CRIU_BIN is version >= 4 with this patch set and passes `criu check`.
criu_works() {
    [ -x "$CRIU_BIN" ] || return 1
    [ "$(cat "$CRIU_STAMP" 2>/dev/null)" = "$stamp" ] || return 1
    local version major
    version="$("$CRIU_BIN" --version 2>/dev/null | sed -n 's/^Version: *//p')"
    major="${version%%.*}"
    [ -n "$major" ] && [ "$major" -ge 4 ] 2>/dev/null || return 1
    "$CRIU_BIN" check >/dev/null 2>&1
}

if criu_works; then
    echo "setup-criu: $("$CRIU_BIN" --version | head -n1) already installed and 'criu check' passes"
    exit 0
fi

echo "setup-criu: build dependencies"
export DEBIAN_FRONTEND=noninteractive
deps=(build-essential patch pkgconf xz-utils libbsd-dev libcap-dev libgnutls28-dev libnet1-dev
    libnftables-dev libnl-3-dev libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler
    protobuf-compiler uuid-dev python3 iproute2 iptables)
need=()
for pkg in "${deps[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

work="$(mktemp -d /tmp/cube-criu-build.XXXXXX)"
trap 'rm -rf "$work"' EXIT

echo "setup-criu: fetching the criu source from $CRIU_MIRROR $CRIU_SUITE"
mkdir -p "$work/apt/lists/partial" "$work/src"
echo "deb-src $CRIU_MIRROR $CRIU_SUITE main" >"$work/apt/sources.list"
apt_private=(-o "Dir::Etc::SourceList=$work/apt/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$work/apt/lists"
    -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
    -o "APT::Sandbox::User=root")
# `apt-get update` checks the suite's InRelease signature against the Debian archive
# keyring, so the Sources index and the checksums it lists can be trusted.
apt-get "${apt_private[@]}" update -qq
srcinfo="$(apt-cache "${apt_private[@]}" showsrc criu)"
version="$(sed -n 's/^Version: //p' <<<"$srcinfo" | head -n1)"
directory="$(sed -n 's/^Directory: //p' <<<"$srcinfo" | head -n1)"
# The upstream tarball and its SHA-256 from the Checksums-Sha256 section. Only the
# tarball is used: the registry here serves it but not always the .dsc/.debian.tar.xz,
# and Debian's patches to criu are packaging-only.
read -r sha256 _ orig < <(sed -n '/^Checksums-Sha256:/,/^[A-Z]/p' <<<"$srcinfo" |
    grep -E ' criu_[^ ]+\.orig\.tar\.(xz|gz|bz2)$' | head -n1)
if [ -z "${version:-}" ] || [ -z "${orig:-}" ] || [ -z "${sha256:-}" ]; then
    echo "setup-criu: the $CRIU_SUITE Sources index has no criu source package" >&2
    exit 1
fi
echo "setup-criu: criu $version, $orig"
# apt-helper refuses a download whose SHA-256 differs from the signed index's.
/usr/lib/apt/apt-helper download-file "$CRIU_MIRROR/$directory/$orig" "$work/src/$orig" \
    "SHA256:$sha256" >/dev/null
tar -xf "$work/src/$orig" -C "$work/src"
srcdir="$(find "$work/src" -mindepth 1 -maxdepth 1 -type d -name 'criu-*' | head -n1)"
[ -n "$srcdir" ] || {
    echo "setup-criu: $orig holds no criu-* directory" >&2
    exit 1
}

cd "$srcdir"
for p in "${PATCHES[@]}"; do
    echo "setup-criu: applying $(basename "$p")"
    patch -p1 --quiet <"$p"
done
echo "setup-criu: building criu with $(nproc) jobs"
# CRIU finds its optional libraries through pkg-config: this one denies the left-out ones.
printf '%s\n' '#!/bin/sh' 'for arg in "$@"; do' \
    '    case "$arg" in libnftables | libbpf | gnutls | libselinux | libdrm) exit 1 ;; esac' \
    'done' 'exec pkg-config "$@"' >"$work/pkg-config"
chmod +x "$work/pkg-config"
# Only the criu binary is built (no docs, no python tools, no libcriu). WERROR=0: newer compilers warn where the release did not expect it.
make -j"$(nproc)" WERROR=0 NO_GNUTLS=1 PKG_CONFIG="$work/pkg-config" criu >"$work/build.log" 2>&1 || {
    tail -n 40 "$work/build.log" >&2
    echo "setup-criu: build failed" >&2
    exit 1
}
# Into place by rename: criu processes may be running the old binary.
install -D -m 0755 criu/criu "$CRIU_BIN.new"
mv -f "$CRIU_BIN.new" "$CRIU_BIN"
install -d /usr/local/lib/cube
echo "$stamp" >"$CRIU_STAMP"

echo "setup-criu: $("$CRIU_BIN" --version | head -n1)"
if "$CRIU_BIN" check; then
    echo "setup-criu: 'criu check' passes"
else
    echo "setup-criu: 'criu check' fails on this kernel: full-state snapshots stay unavailable" >&2
    exit 1
fi
