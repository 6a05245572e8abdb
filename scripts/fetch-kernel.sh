#!/usr/bin/env bash
# Fetches Debian's cloud kernel package from the Debian archive and unpacks an
# uncompressed ELF vmlinux (PVH entry) into the store, never into the host's /boot.
# Usage: fetch-kernel.sh [DEST_DIR]   (default: /var/lib/cube/kernels/debian-cloud)
set -euo pipefail
dest=${1:-/var/lib/cube/kernels/debian-cloud}
if [ -s "$dest/vmlinux" ]; then
    echo "fetch-kernel: $dest/vmlinux already present"
    exit 0
fi
for tool in lz4 xz zstd python3 dpkg-deb; do
    command -v "$tool" >/dev/null || { echo "fetch-kernel: $tool is missing" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# The newest cloud kernel image the configured archive offers.
pkg=$(apt-cache search --names-only '^linux-image-[0-9.-]+-cloud-amd64-unsigned$' \
    | awk '{print $1}' | sort -V | tail -n 1)
if [ -z "$pkg" ]; then
    echo "fetch-kernel: no linux-image-*-cloud-amd64-unsigned package found (run apt-get update)" >&2
    exit 1
fi
apt-get download "$pkg" >/dev/null 2>&1
dpkg-deb -x ./*.deb unpacked
bzimage=$(ls unpacked/boot/vmlinuz-*)
# The bzImage's setup header says where the compressed kernel starts and how long it is.
python3 - "$bzimage" payload <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
setup_sects = data[0x1f1] or 4
offset, length = struct.unpack_from("<II", data, 0x248)
start = (setup_sects + 1) * 512 + offset
open(sys.argv[2], "wb").write(data[start:start + length])
PY
magic=$(head -c 4 payload | od -An -tx1 | tr -d ' \n')
# The payload ends with the kernel's uncompressed size, which the decompressors call
# trailing garbage: their exit status is not the verdict, the ELF header below is.
case "$magic" in
    02214c18) lz4 -dc payload > vmlinux 2>/dev/null || true ;;
    28b52ffd) zstd -dcq payload > vmlinux 2>/dev/null || true ;;
    fd377a58) xz -dc payload > vmlinux 2>/dev/null || true ;;
    1f8b*) gzip -dc payload > vmlinux 2>/dev/null || true ;;
    *) echo "fetch-kernel: unknown compression (magic $magic)" >&2; exit 1 ;;
esac
if [ "$(head -c 4 vmlinux | od -An -tx1 | tr -d ' \n')" != "7f454c46" ]; then
    echo "fetch-kernel: decompressing $bzimage did not give an ELF vmlinux" >&2
    exit 1
fi
mkdir -p "$dest"
install -m 0644 vmlinux "$dest/vmlinux"
echo "${pkg}" > "$dest/package"
echo "fetch-kernel: $pkg -> $dest/vmlinux"
