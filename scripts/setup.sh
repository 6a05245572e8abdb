#!/usr/bin/env bash
# Sets up a fresh Debian 12 host for Cube: system packages, a release build, the `cube`
# and `cube-supervisor` binaries on PATH, and a reflink-capable store. Idempotent; run
# as root.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
    echo "setup: run as root (KVM, loop devices and mounts need it)" >&2
    exit 1
fi

echo "setup: system packages"
export DEBIAN_FRONTEND=noninteractive
need=()
# debootstrap builds template root filesystems; bubblewrap is the peer `cube bench
# --engine jail` measures `cube run` against; chromium renders `cube bench --report`'s
# page in its check (scripts/check-report.sh). containerd (with runc) and busybox-static
# are what the containerd shim's tests run against (a private containerd, a busybox
# image built by the test); protobuf-compiler builds the CRI client those tests use;
# containernetworking-plugins (bridge, host-local) give their pods a network of the
# test's own, which iproute2's `ip` sets up.
for pkg in xfsprogs util-linux gcc make pkg-config python3 lz4 xz-utils zstd debootstrap bubblewrap \
    chromium containerd runc busybox-static protobuf-compiler containernetworking-plugins \
    iproute2; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
fi

echo "setup: CRIU (full-state jail snapshots)"
# Debian 12's CRIU 3.17 fails on current kernels; this builds 4.1.1 from Debian's source.
# Without it jail snapshots hold the file system only, and say so.
bash scripts/setup-criu.sh || echo "setup: full-state jail snapshots unavailable (see above)" >&2

echo "setup: networking (eBPF toolchain, bpffs)"
bash scripts/setup-net.sh  # clang + libbpf-dev for cube-net's eBPF datapath, bpffs

echo "setup: jail engine peers"
bash scripts/setup-jail.sh

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo not found: install rustup first (it then installs the toolchain rust-toolchain.toml pins)" >&2
    exit 1
fi

# rust-toolchain.toml pins the toolchain (with rustfmt, clippy and the musl target);
# install it here, once, rather than on the first cargo call of the build below. A host
# that cannot download toolchains but whose stable toolchain is that very release
# (these hosts: 1.95.0) gets it under the pinned name, as rustup would have named it.
if command -v rustup >/dev/null 2>&1 && ! rustup show active-toolchain >/dev/null 2>&1; then
    pinned=$(sed -n 's/^channel = "\(.*\)"$/\1/p' rust-toolchain.toml)
    echo "setup: Rust $pinned (rust-toolchain.toml)"
    if ! timeout 900 rustup toolchain install --no-self-update; then
        stable=$(rustc +stable --version 2>/dev/null | cut -d' ' -f2 || true)
        if [ "$stable" != "$pinned" ]; then
            echo "setup: Rust $pinned could not be installed, and the stable toolchain is ${stable:-missing}" >&2
            exit 1
        fi
        host=$(rustc +stable -vV | sed -n 's/^host: //p')
        ln -sfn "$(rustc +stable --print sysroot)" "${RUSTUP_HOME:-$HOME/.rustup}/toolchains/$pinned-$host"
        echo "setup: Rust $pinned is this host's stable toolchain; linked under the pinned name"
    fi
fi

# The agent starts once per sandbox; linked with musl it starts in ~0.43 ms instead of
# ~0.74 with static glibc, whose start-up CPUID probes these hosts emulate
# (scripts/build-static.sh). rust-toolchain.toml lists the target; this adds it where the
# pinned toolchain was installed without it. Best effort: without it the agent links
# static glibc.
if command -v rustup >/dev/null 2>&1 && [ "$(uname -m)" = x86_64 ]; then
    timeout 300 rustup target add x86_64-unknown-linux-musl ||
        echo "setup: note: the musl Rust target could not be added: the agent is linked with static glibc" >&2
fi

# Every crate the lock file names, dev-dependencies and other targets' included: the
# checks that run offline after this (cargo tree for feature unification, cargo-deny)
# read them all, and a fresh host's cargo has fetched none (the build below fetches only
# what the binaries need).
echo "setup: fetching the locked crates"
cargo fetch --locked
echo "setup: building (release)"
cargo build --release --workspace --bins --locked
bash scripts/build-static.sh --musl cube-agent cube-agent --release --locked
bash scripts/build-static.sh cube-cli cube --release --locked
install -m 0755 target/static/release/cube target/release/cube-supervisor target/static/release/cube-agent \
    target/release/containerd-shim-cubesandbox-v2 /usr/local/bin/

echo "setup: python package tools"
bash scripts/setup-python.sh

echo "setup: cargo-deny (licences, bans, duplicate versions)"
bash scripts/setup-deny.sh

echo "setup: cube serve's SDK suite (openssl, *.localhost names, chromium)"
bash scripts/setup-serve.sh

echo "setup: store"
# The store must reflink for fast snapshots; on ext4 (as here) it gets an XFS image
# on a loop device. `cube store setup` is a no-op where the store already reflinks.
cube store setup --size "${CUBE_STORE_SIZE:-16G}"

echo "setup: guest kernel"
# Debian's cloud kernel, for booting Linux in Cube's VMM (`cube debug boot`).
[ "${#need[@]}" -gt 0 ] || apt-get update -qq
bash scripts/fetch-kernel.sh "${CUBE_HOME:-/var/lib/cube}/kernels/debian-cloud"
bash scripts/build-initramfs.sh "${CUBE_HOME:-/var/lib/cube}/kernels/debian-cloud"

echo "setup: Cube's guest kernel"
# Built from Debian's linux-source package with guest-kernel/cube-guest.config and
# cached in the store by the hash of its inputs: a second set-up only re-links it.
# The first build takes about 13 min of CPU (11.4 min user + 1.8 min system measured
# here), 31.5 min of wall time on this shared 2-core host; Linux VM templates and
# the Linux VM tests need it (without it they skip, saying so).
# CUBE_SKIP_GUEST_KERNEL=1 skips it.
if [ "${CUBE_SKIP_GUEST_KERNEL:-0}" != 1 ]; then
    bash scripts/build-guest-kernel.sh
fi

if [ ! -e /dev/kvm ]; then
    echo "setup: note: /dev/kvm is missing: the vm engine is unavailable and KVM tests will skip" >&2
fi
cube doctor
