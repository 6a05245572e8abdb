//! Helpers for tests and benchmarks that boot a real Linux guest, in one place for
//! every crate whose tests do (hidden: not part of the VMM's API).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::linux_vm::LinuxVm;

/// The command line test guests boot with: the serial console from the start, no
/// KASLR (so a restored clone's addresses match), and a reset instead of a reboot.
pub const TEST_CMDLINE: &str = "console=ttyS0 earlyprintk=serial,ttyS0 reboot=k panic=-1 nokaslr";

/// The kernel tests boot: `$CUBE_KERNEL`, else where `scripts/fetch-kernel.sh` unpacks
/// Debian's cloud kernel, in the store named by `$CUBE_HOME` or `/var/lib/cube`.
pub fn store_kernel() -> PathBuf {
    if let Some(kernel) = std::env::var_os("CUBE_KERNEL") {
        return PathBuf::from(kernel);
    }
    PathBuf::from(std::env::var_os("CUBE_HOME").unwrap_or_else(|| "/var/lib/cube".into()))
        .join("kernels/debian-cloud/vmlinux")
}

/// That kernel, where this host can boot it; None, after printing why, where
/// `/dev/kvm` or the kernel is missing.
pub fn linux_kernel() -> Option<PathBuf> {
    if !Path::new("/dev/kvm").exists() {
        println!("skipped: /dev/kvm not present");
        return None;
    }
    let path = store_kernel();
    if !path.is_file() {
        println!(
            "skipped: no guest kernel at {} (scripts/fetch-kernel.sh)",
            path.display()
        );
        return None;
    }
    Some(path)
}

/// Cube's own guest kernel, where this host can boot it: `$CUBE_GUEST_KERNEL`, else
/// where `scripts/build-guest-kernel.sh` links the latest build
/// (`kernels/cube-guest/vmlinux`) in the store named by `$CUBE_HOME`, else in
/// `/var/lib/cube`. None, after printing why, where `/dev/kvm` or the kernel is
/// missing.
pub fn cube_guest_kernel() -> Option<PathBuf> {
    if !Path::new("/dev/kvm").exists() {
        println!("skipped: /dev/kvm not present");
        return None;
    }
    let candidates: Vec<PathBuf> = match std::env::var_os("CUBE_GUEST_KERNEL") {
        Some(kernel) => vec![PathBuf::from(kernel)],
        None => std::env::var_os("CUBE_HOME")
            .map(PathBuf::from)
            .into_iter()
            .chain([PathBuf::from("/var/lib/cube")])
            .map(|root| root.join("kernels/cube-guest/vmlinux"))
            .collect(),
    };
    let found = candidates.iter().find(|p| p.is_file()).cloned();
    if found.is_none() {
        println!(
            "skipped: Cube's guest kernel is not built (looked at {}; scripts/build-guest-kernel.sh builds it)",
            candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    found
}

/// A serial console that keeps everything the guest printed.
#[derive(Clone, Default)]
pub struct Console(Arc<Mutex<String>>);

impl Console {
    /// Everything printed so far.
    pub fn text(&self) -> String {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether the guest printed `text`.
    pub fn contains(&self, text: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(text)
    }

    /// Whether the guest printed nothing yet.
    pub fn is_empty(&self) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }
}

impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_str(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits until `vm`'s `console` shows `text`; the error says whether the guest
/// stopped first or `limit` passed, with what it printed.
pub fn wait_for(
    vm: &LinuxVm,
    console: &Console,
    text: &str,
    limit: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    while !console.contains(text) {
        if let Some(reason) = vm.fatal() {
            return Err(format!(
                "VM stopped before {text:?}: {reason}\n{}",
                console.text()
            ));
        }
        if Instant::now() >= deadline {
            return Err(format!("no {text:?} within {limit:?}:\n{}", console.text()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
