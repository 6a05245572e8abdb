#!/usr/bin/env bash
# Builds the microVM initramfs from the Debian cloud kernel package that
# scripts/fetch-kernel.sh recorded: the virtio modules that kernel needs (virtio_mmio,
# virtio_blk, vsock + vmw_vsock_virtio_transport, virtio_net, virtio-rng, with their
# dependencies, in load order) and a static cube-agent as /init. With no arguments
# and PID 1, the agent mounts /proc, /sys and /dev, loads the modules listed in
# /lib/modules/cube/modules.order and serves the host on vsock port 1024.
# Also installs the package's bzImage beside the vmlinux.
# Usage: build-initramfs.sh [KERNEL_DIR]   (default: /var/lib/cube/kernels/debian-cloud)
# Output: KERNEL_DIR/initramfs-cube.cpio.gz and KERNEL_DIR/bzImage
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-/var/lib/cube/kernels/debian-cloud}
if [ ! -s "$dest/package" ]; then
    echo "build-initramfs: $dest/package is missing: run scripts/fetch-kernel.sh first" >&2
    exit 1
fi
for tool in dpkg-deb apt-get python3 gzip cargo; do
    command -v "$tool" >/dev/null || { echo "build-initramfs: $tool is missing" >&2; exit 1; }
done
pkg=$(cat "$dest/package")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "build-initramfs: downloading $pkg"
(cd "$work" && apt-get download "$pkg" >/dev/null 2>&1) || {
    echo "build-initramfs: apt-get download $pkg failed (run apt-get update)" >&2
    exit 1
}
dpkg-deb -x "$work"/*.deb "$work/unpacked"
moddir=$(ls -d "$work"/unpacked/lib/modules/*)

echo "build-initramfs: a static cube-agent"
# The same static agent setup.sh installs (musl where its target is installed): built
# once, here a no-op when setup has just built it.
bash scripts/build-static.sh --musl cube-agent cube-agent --release --locked
agent=target/static/release/cube-agent

python3 - "$moddir" "$agent" "$work/initramfs.cpio" <<'PY'
import lzma, os, struct, sys

moddir, agent, out = sys.argv[1:4]
WANTED = ["virtio_mmio", "virtio_blk", "vsock", "vmw_vsock_virtio_transport",
          "virtio_net", "virtio-rng"]

# Every module file of the package, by module name (dashes and underscores alike).
files = {}
for root, _, names in os.walk(moddir):
    for n in names:
        for ext in (".ko", ".ko.xz"):
            if n.endswith(ext):
                files[n[: -len(ext)].replace("-", "_")] = os.path.join(root, n)

def module_bytes(path):
    data = open(path, "rb").read()
    return lzma.decompress(data) if path.endswith(".xz") else data

def modinfo_depends(elf):
    """The depends= field of the ELF .modinfo section."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise SystemExit("not a 64-bit ELF module")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    def section(i):
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        return name, off, size
    _, stroff, _ = section(shstrndx)
    for i in range(shnum):
        name, off, size = section(i)
        end = elf.index(b"\0", stroff + name)
        if elf[stroff + name:end] == b".modinfo":
            for field in elf[off:off + size].split(b"\0"):
                if field.startswith(b"depends="):
                    deps = field[len(b"depends="):].decode()
                    return [d.replace("-", "_") for d in deps.split(",") if d]
            return []
    return []

order, seen = [], set()
def visit(name):
    name = name.replace("-", "_")
    if name in seen:
        return
    seen.add(name)
    if name not in files:
        raise SystemExit(f"module {name} is not in the kernel package")
    for dep in modinfo_depends(module_bytes(files[name])):
        visit(dep)
    order.append(name)
for m in WANTED:
    visit(m)

entries = []  # (path, mode, data, rdev)
for d in ["dev", "proc", "sys", "tmp", "run", "lib", "lib/modules", "lib/modules/cube"]:
    entries.append((d, 0o040755, b"", (0, 0)))
entries.append(("dev/console", 0o020600, b"", (5, 1)))
entries.append(("init", 0o100755, open(agent, "rb").read(), (0, 0)))
for name in order:
    entries.append((f"lib/modules/cube/{name}.ko", 0o100644, module_bytes(files[name]), (0, 0)))
entries.append(("lib/modules/cube/modules.order", 0o100644,
                "".join(f"{n}.ko\n" for n in order).encode(), (0, 0)))

with open(out, "wb") as f:
    def put(name, mode, data, rdev, ino):
        name_b = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name_b), 0))
        f.write(hdr.encode() + name_b)
        f.write(b"\0" * (-(110 + len(name_b)) % 4))
        f.write(data)
        f.write(b"\0" * (-len(data) % 4))
    for ino, (name, mode, data, rdev) in enumerate(entries, start=1):
        put(name, mode, data, rdev, ino)
    put("TRAILER!!!", 0, b"", (0, 0), 0)
print("build-initramfs: modules in load order: " + " ".join(order))
PY

mkdir -p "$dest"
gzip -9n < "$work/initramfs.cpio" > "$work/initramfs-cube.cpio.gz"
install -m 0644 "$work/initramfs-cube.cpio.gz" "$dest/initramfs-cube.cpio.gz"
install -m 0644 "$(ls "$work"/unpacked/boot/vmlinuz-*)" "$dest/bzImage"
echo "build-initramfs: $dest/initramfs-cube.cpio.gz ($(stat -c %s "$dest/initramfs-cube.cpio.gz") bytes), $dest/bzImage"
