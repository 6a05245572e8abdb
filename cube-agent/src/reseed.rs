//! Reseeding the guest kernel's random generator after a VM clone.
//!
//! Two VMs restored from one snapshot start with the same kernel CRNG state, so they
//! would hand out the same "random" bytes. Cube's virtio-rng device keeps a
//! generation counter as its configuration space and moves it to a new random value
//! every time a VM is restored as a clone (Cube's stand-in for a VM generation ID).
//! The agent, PID 1 of the VM, polls that counter; when it changes it mixes fresh
//! host entropy (read from the virtio-rng device through `/dev/hwrng`) and the new
//! generation into the kernel's pool (`RNDADDENTROPY`) and forces a reseed
//! (`RNDRESEEDCRNG`).
//!
//! The counter is found through sysfs (the virtio device whose id is 4, entropy) and
//! `/proc/iomem` (its MMIO window), and read through `/dev/mem`. Kernels built with
//! `CONFIG_IO_STRICT_DEVMEM` refuse that read while the driver owns the window; the
//! watcher then says so once and stops (the vsock transport reset that every restore
//! sends is the other signal a later version can use).

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The virtio device id of an entropy source.
const VIRTIO_ID_RNG: u32 = 4;
/// Offset of the configuration space in a virtio-mmio window.
const MMIO_CONFIG_OFFSET: u64 = 0x100;
/// How often the watcher reads the counter.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Host entropy bytes mixed in per reseed.
const ENTROPY_BYTES: usize = 64;

/// `_IOW('R', 0x03, int[2])`: add entropy (with credit) to the input pool.
const RNDADDENTROPY: libc::Ioctl = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the CRNG from the input pool now.
const RNDRESEEDCRNG: libc::Ioctl = 0x5207;

/// Why reseeding failed.
#[derive(Debug, thiserror::Error)]
pub enum ReseedError {
    /// No virtio entropy device was found.
    #[error("No virtio-rng device in {0}")]
    NoDevice(PathBuf),
    /// The device's MMIO window is not listed in /proc/iomem.
    #[error("No MMIO window named {0} in /proc/iomem")]
    NoWindow(String),
    /// A file could not be read.
    #[error("Reading {0}")]
    Read(PathBuf, #[source] std::io::Error),
    /// The kernel refused new entropy or the reseed.
    #[error("The kernel refused {0}")]
    Ioctl(&'static str, #[source] std::io::Error),
}

/// The guest-physical address of the virtio-rng device's generation counter: the
/// device whose `device` file under `virtio_devices` (normally
/// /sys/bus/virtio/devices) says 4, its platform parent's window in `iomem` (the
/// text of /proc/iomem), plus the configuration offset.
pub fn find_generation_address(virtio_devices: &Path, iomem: &str) -> Result<u64, ReseedError> {
    let read_err = |p: &Path| {
        let p = p.to_path_buf();
        move |e| ReseedError::Read(p, e)
    };
    let entries = std::fs::read_dir(virtio_devices).map_err(read_err(virtio_devices))?;
    for entry in entries.flatten() {
        let id_file = entry.path().join("device");
        let Ok(id) = std::fs::read_to_string(&id_file) else {
            continue;
        };
        let id = id.trim().trim_start_matches("0x");
        if u32::from_str_radix(id, 16).ok() != Some(VIRTIO_ID_RNG) {
            continue;
        }
        // The virtio device sits in its transport's platform device directory.
        let real = std::fs::canonicalize(entry.path()).map_err(read_err(&entry.path()))?;
        let parent = real
            .parent()
            .and_then(Path::file_name)
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| ReseedError::NoDevice(virtio_devices.to_path_buf()))?;
        let base = window_base(iomem, &parent).ok_or(ReseedError::NoWindow(parent))?;
        return Ok(base + MMIO_CONFIG_OFFSET);
    }
    Err(ReseedError::NoDevice(virtio_devices.to_path_buf()))
}

/// The start of the /proc/iomem region named `name`.
fn window_base(iomem: &str, name: &str) -> Option<u64> {
    iomem.lines().find_map(|line| {
        let (range, owner) = line.trim().split_once(" : ")?;
        if owner.trim() != name {
            return None;
        }
        let (start, _) = range.split_once('-')?;
        u64::from_str_radix(start, 16).ok()
    })
}

/// Reads the 8-byte generation at `address` of `memory` (/dev/mem in the guest) as two
/// 4-byte accesses, the width virtio-mmio configuration reads use.
pub fn read_generation(memory: &File, address: u64) -> std::io::Result<u64> {
    let mut low = [0u8; 4];
    let mut high = [0u8; 4];
    memory.read_exact_at(&mut low, address)?;
    memory.read_exact_at(&mut high, address + 4)?;
    Ok(u64::from(u32::from_le_bytes(low)) | (u64::from(u32::from_le_bytes(high)) << 32))
}

/// Mixes `entropy` into the kernel's input pool, credited at 8 bits a byte, and makes
/// the CRNG reseed from it now. Needs CAP_SYS_ADMIN (the agent is PID 1 of the VM).
pub fn reseed_kernel_crng(entropy: &[u8]) -> Result<(), ReseedError> {
    let urandom = File::options()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| ReseedError::Read("/dev/urandom".into(), e))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let words = entropy.len().div_ceil(4);
    let mut info: Vec<u32> = vec![0; 2 + words];
    let bits = i32::try_from(entropy.len() * 8).unwrap_or(i32::MAX);
    let len = i32::try_from(entropy.len()).unwrap_or(i32::MAX);
    info[0] = bits as u32;
    info[1] = len as u32;
    for (i, chunk) in entropy.chunks(4).enumerate() {
        let mut word = [0u8; 4];
        word[..chunk.len()].copy_from_slice(chunk);
        info[2 + i] = u32::from_ne_bytes(word);
    }
    // SAFETY: `info` is a rand_pool_info header followed by `buf_size` bytes of
    // buffer, alive for the call; the kernel only reads it.
    let r = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) };
    if r != 0 {
        return Err(ReseedError::Ioctl(
            "RNDADDENTROPY",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    let r = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG, 0) };
    if r != 0 {
        return Err(ReseedError::Ioctl(
            "RNDRESEEDCRNG",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// The error and its causes on one line, for a reply to the host.
pub fn describe(e: &ReseedError) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Fresh entropy for a reseed: bytes from the host through the virtio-rng device
/// (`hwrng`), else from the kernel, with `generation` mixed in so that clones differ
/// even if both sources repeat.
pub fn fresh_entropy(hwrng: &Path, generation: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; ENTROPY_BYTES];
    let from_host = File::open(hwrng).and_then(|mut f| f.read_exact(&mut bytes));
    if from_host.is_err() {
        // SAFETY: `bytes` is writable for its length.
        let _ = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    }
    for (b, g) in bytes.iter_mut().zip(generation.to_le_bytes()) {
        *b ^= g;
    }
    bytes
}

/// Starts the watcher thread of a VM's agent: polls the generation counter and
/// reseeds whenever it moves. Returns None (after logging why) where the counter
/// cannot be found or read.
pub fn spawn_watcher() -> Option<std::thread::JoinHandle<()>> {
    let iomem = std::fs::read_to_string("/proc/iomem").unwrap_or_default();
    let address = match find_generation_address(Path::new("/sys/bus/virtio/devices"), &iomem) {
        Ok(a) => a,
        Err(e) => {
            tracing::info!(error = %e, "no VM generation counter; clones are not reseeded");
            return None;
        }
    };
    let memory = match File::open("/dev/mem") {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "cannot open /dev/mem; clones are not reseeded");
            return None;
        }
    };
    let mut last = match read_generation(&memory, address) {
        Ok(g) => g,
        Err(e) => {
            tracing::warn!(error = %e, address, "the kernel refuses to read the VM generation counter (CONFIG_IO_STRICT_DEVMEM?); clones are not reseeded");
            return None;
        }
    };
    std::thread::Builder::new()
        .name("reseed".into())
        .spawn(move || loop {
            std::thread::sleep(POLL_INTERVAL);
            let Ok(now) = read_generation(&memory, address) else {
                continue;
            };
            if now == last {
                continue;
            }
            last = now;
            match reseed_kernel_crng(&fresh_entropy(Path::new("/dev/hwrng"), now)) {
                Ok(()) => tracing::info!(generation = now, "VM cloned: kernel CRNG reseeded"),
                Err(e) => tracing::warn!(error = %e, "reseeding the kernel CRNG"),
            }
        })
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const IOMEM: &str = "00000000-00000fff : Reserved
00100000-1fffffff : System RAM
d0000000-d00001ff : LNRO0005:00
  d0000000-d00001ff : LNRO0005:00
d0001000-d00011ff : LNRO0005:01
  d0001000-d00011ff : LNRO0005:01
";

    /// A sysfs-shaped tree: platform devices with a virtio child each, and the bus
    /// directory linking to them, as the kernel lays them out.
    fn sysfs(root: &Path, devices: &[(&str, &str, &str)]) -> PathBuf {
        let bus = root.join("bus/virtio/devices");
        std::fs::create_dir_all(&bus).unwrap();
        for (platform, virtio, id) in devices {
            let dev = root.join("devices/platform").join(platform).join(virtio);
            std::fs::create_dir_all(&dev).unwrap();
            std::fs::write(dev.join("device"), format!("{id}\n")).unwrap();
            std::os::unix::fs::symlink(&dev, bus.join(virtio)).unwrap();
        }
        bus
    }

    #[test]
    fn the_rng_window_is_found_by_device_id_and_iomem_name() {
        let dir = tempfile::tempdir().unwrap();
        let bus = sysfs(
            dir.path(),
            &[
                ("LNRO0005:00", "virtio0", "0x0002"),
                ("LNRO0005:01", "virtio1", "0x0004"),
            ],
        );
        assert_eq!(
            find_generation_address(&bus, IOMEM).unwrap(),
            0xd000_1000 + MMIO_CONFIG_OFFSET
        );
        // No rng, or a window missing from iomem: clear errors.
        let dir = tempfile::tempdir().unwrap();
        let bus = sysfs(dir.path(), &[("LNRO0005:00", "virtio0", "0x0002")]);
        assert!(matches!(
            find_generation_address(&bus, IOMEM),
            Err(ReseedError::NoDevice(_))
        ));
        let dir = tempfile::tempdir().unwrap();
        let bus = sysfs(dir.path(), &[("virtio-mmio.7", "virtio3", "0x0004")]);
        assert!(matches!(
            find_generation_address(&bus, IOMEM),
            Err(ReseedError::NoWindow(n)) if n == "virtio-mmio.7"
        ));
    }

    #[test]
    fn the_generation_is_read_as_two_little_endian_words() {
        let mut f = tempfile::tempfile().unwrap();
        let generation: u64 = 0x1122_3344_5566_7788;
        std::io::Write::write_all(&mut f, &[0u8; 0x100]).unwrap();
        std::io::Write::write_all(&mut f, &generation.to_le_bytes()).unwrap();
        assert_eq!(read_generation(&f, 0x100).unwrap(), generation);
        assert!(read_generation(&f, 0x104).is_err());
    }

    #[test]
    fn clones_get_different_entropy() {
        let a = fresh_entropy(Path::new("/nonexistent-hwrng"), 1);
        let b = fresh_entropy(Path::new("/nonexistent-hwrng"), 1);
        assert_eq!(a.len(), ENTROPY_BYTES);
        assert_ne!(a, b);
    }

    #[test]
    fn the_kernel_takes_the_entropy_and_reseeds() {
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: RNDADDENTROPY needs CAP_SYS_ADMIN");
            return;
        }
        // The host's own kernel: the same ioctls the agent makes in a guest.
        reseed_kernel_crng(&fresh_entropy(Path::new("/nonexistent-hwrng"), 7)).unwrap();
    }
}
