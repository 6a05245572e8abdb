#!/usr/bin/env bash
# System packages cube-net needs: clang compiles its eBPF datapath at build time
# (with libbpf-dev's bpf_helpers.h), iproute2 builds the test and bench namespaces.
# Idempotent; run as root (scripts/setup.sh calls it).
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in clang llvm libbpf-dev iproute2; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
    echo "setup-net: installing ${need[*]}"
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
fi

# The datapath pins its maps and links in bpffs; mount it if nothing has.
if ! mount -t bpf | grep -q ' /sys/fs/bpf '; then
    mount -t bpf bpf /sys/fs/bpf
fi
