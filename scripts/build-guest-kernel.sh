#!/usr/bin/env bash
# Builds Cube's guest kernel from Debian's linux-source package with the config
# fragment guest-kernel/cube-guest.config (applied on `make tinyconfig`, then
# `make olddefconfig`; every option the fragment sets must survive, or the build
# fails naming it) and the patches in guest-kernel/patches (in name order).
#
# Output, in the store (${CUBE_HOME:-/var/lib/cube}):
#   kernels/cube-guest/<hash>/vmlinux      the ELF kernel (PVH entry; Cube boots it)
#   kernels/cube-guest/<hash>/config       its full .config
#   kernels/cube-guest/<hash>/System.map   its symbols (no KASLR: RIPs map directly)
#   kernels/cube-guest/<hash>/source       the linux-source package and version
#   kernels/cube-guest/vmlinux             -> <hash>/vmlinux (what Cube boots)
# <hash> is the SHA-256 of the fragment, the patches, this script, the source
# package's version and the compiler's version: a second run with the same inputs only re-points the
# link and prints the path.
#
# Usage: build-guest-kernel.sh [--print-hash]
# Environment: CUBE_HOME (the store), CUBE_KERNEL_JOBS (make -j, default: all CPUs),
#              CUBE_KERNEL_SOURCE_PACKAGE (default: linux-source-6.1).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
fragment=$repo/guest-kernel/cube-guest.config
patches=("$repo"/guest-kernel/patches/*.patch)
[ -e "${patches[0]}" ] || patches=()
store=${CUBE_HOME:-/var/lib/cube}
dest=$store/kernels/cube-guest
package=${CUBE_KERNEL_SOURCE_PACKAGE:-linux-source-6.1}
jobs=${CUBE_KERNEL_JOBS:-$(nproc)}

log() { echo "build-guest-kernel: $*" >&2; }

# Build dependencies, installed only where missing (apt-get needs root).
need=()
for pkg in "$package" bc bison flex libelf-dev libssl-dev make gcc xz-utils patch python3; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
        need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${need[@]}" >/dev/null ||
        { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; }
fi

version=$(dpkg-query -W -f='${Version}' "$package")
tarball=$(dpkg -L "$package" | grep -E '/usr/src/linux-source-[0-9.]+\.tar\.xz$' | head -1)
[ -n "$tarball" ] && [ -f "$tarball" ] || { log "no source tarball in $package"; exit 1; }
hash=$( {
    cat "$fragment" "${patches[@]}" "$0"
    echo "$package $version"
    gcc --version | head -1
} | sha256sum | cut -c1-16)
if [ "${1:-}" = "--print-hash" ]; then
    echo "$hash"
    exit 0
fi

out=$dest/$hash
link() {
    ln -sfn "$hash/vmlinux" "$dest/.vmlinux.new"
    mv -T "$dest/.vmlinux.new" "$dest/vmlinux"
}
if [ -s "$out/vmlinux" ]; then
    link
    log "cached: $out/vmlinux"
    echo "$dest/vmlinux"
    exit 0
fi

mkdir -p "$dest"
# One build at a time per store: a second caller waits, then finds the cache.
exec 9>"$dest/.lock"
flock 9
if [ -s "$out/vmlinux" ]; then
    link
    echo "$dest/vmlinux"
    exit 0
fi

work=$(mktemp -d "$dest/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$(date +%s)
log "unpacking $tarball ($package $version)"
# Not needed and a good part of the tarball: the documentation (but its Kconfig,
# which the top Kconfig sources) and the device trees of other architectures
# (every architecture's Kconfig is still sourced, so the rest stays).
tar -xJf "$tarball" -C "$work" --exclude='*/Documentation/*/*' --exclude='*/arch/*/boot/dts'
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'linux-source-*' | head -1)
[ -n "$src" ] || { log "the tarball holds no linux-source-* directory"; exit 1; }
build=$work/build
make_kernel() { make -C "$src" O="$build" ARCH=x86_64 "$@"; }
for p in "${patches[@]}"; do
    log "applying $(basename "$p")"
    patch -d "$src" -p1 --quiet --forward <"$p"
done

log "configuring (tinyconfig + $(basename "$fragment"))"
make_kernel -s tinyconfig
"$src/scripts/kconfig/merge_config.sh" -m -O "$build" "$build/.config" "$fragment" >/dev/null
make_kernel -s olddefconfig
# Every option the fragment sets must be in the final config: olddefconfig silently
# drops an option whose dependencies are unmet.
python3 - "$fragment" "$build/.config" <<'PY'
import re, sys
wanted, final = (open(p).read().splitlines() for p in sys.argv[1:3])
have = {}
for line in final:
    m = re.match(r"(CONFIG_\w+)=(.*)", line)
    if m:
        have[m[1]] = m[2]
bad = []
for line in wanted:
    m = re.match(r"(CONFIG_\w+)=(.*)", line)
    if m and have.get(m[1], "n") != m[2]:
        bad.append(f"{m[1]}={m[2]} became {have.get(m[1], 'unset')}")
    m = re.match(r"# (CONFIG_\w+) is not set", line)
    if m and m[1] in have:
        bad.append(f"{m[1]} is forced to {have[m[1]]}")
if bad:
    sys.exit("build-guest-kernel: the config lost options:\n  " + "\n  ".join(bad))
PY

log "building vmlinux with $jobs jobs"
make_kernel -s -j"$jobs" KBUILD_BUILD_USER=cube KBUILD_BUILD_HOST=cube vmlinux

mkdir -p "$work/out"
cp "$build/vmlinux" "$work/out/vmlinux"
cp "$build/.config" "$work/out/config"
cp "$build/System.map" "$work/out/System.map"
echo "$package $version" >"$work/out/source"
echo $(($(date +%s) - started)) >"$work/out/build-seconds"
rm -rf "$out"
mv -T "$work/out" "$out"
link
log "built in $(cat "$out/build-seconds") s: $out/vmlinux ($(du -h "$out/vmlinux" | cut -f1))"
echo "$dest/vmlinux"
