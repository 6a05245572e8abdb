//! `cube debug`: tools for looking inside the VMM.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use clap::Subcommand;
use cube_core::debug::{self, BootOptions, DebugError, LinuxBootConfig};
use cube_core::host::KernelMode;

use crate::cli_error::{chain, CliError};

#[derive(Subcommand)]
pub enum DebugCommand {
    /// Boot a Linux kernel in Cube's VMM and stream its serial console; exit 0 once the
    /// pattern appears.
    ///
    /// Example: cube debug boot --kernel vmlinux --until 'Linux version' --timeout 120
    Boot {
        /// An ELF vmlinux with a PVH entry point, or a bzImage.
        #[arg(long)]
        kernel: PathBuf,
        /// An initramfs.
        #[arg(long)]
        initrd: Option<PathBuf>,
        /// Kernel command line.
        #[arg(
            long,
            default_value = "console=ttyS0 earlyprintk=serial,ttyS0 reboot=k panic=-1 nokaslr"
        )]
        cmdline: String,
        /// Regular expression that ends the boot successfully when the console prints it.
        #[arg(long)]
        until: Option<String>,
        /// Seconds to wait for the pattern (or, without one, to stream).
        #[arg(long, default_value_t = 120)]
        timeout: u64,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 512)]
        memory_mib: u64,
        /// Also write the console to this file.
        #[arg(long)]
        log: Option<PathBuf>,
        /// Number of vCPUs.
        #[arg(long, default_value_t = 1)]
        vcpus: u8,
        /// Attach a virtio-blk disk backed by this image.
        #[arg(long)]
        disk: Option<PathBuf>,
        /// Attach a virtio-vsock device (guest CID 3) whose host side lives in this
        /// directory: connect to DIR/vsock.sock and send `CONNECT <port>`.
        #[arg(long)]
        vsock_dir: Option<PathBuf>,
        /// Attach a virtio-rng device.
        #[arg(long)]
        rng: bool,
        /// Also list the virtio devices as `virtio_mmio.device=` entries on the kernel
        /// command line (for kernels with CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES and no
        /// ACPI; the ACPI tables always list them).
        #[arg(long)]
        cmdline_devices: bool,
        /// How the kernel's own code runs: `auto` asks the host (emulated on PVM
        /// hosts, natively with VMX/SVM); `emulated` adds the CPUID masks,
        /// command-line switches and VMM assists a kernel that is not PVM-enabled
        /// needs on a PVM host.
        #[arg(long, value_enum, default_value_t = ModeArg::Auto)]
        kernel_mode: ModeArg,
        /// Prefix every console line with the seconds since the boot started (host
        /// clock): the boot timeline.
        #[arg(long)]
        timestamps: bool,
    },
}

/// `--kernel-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    /// As the host probe says.
    Auto,
    /// On the CPU.
    Native,
    /// In KVM's instruction emulator, with Cube's assists.
    Emulated,
}

/// The console: echoed to stdout (and a log), kept to be searched.
struct Console {
    text: Mutex<String>,
    changed: Condvar,
    log: Mutex<Option<std::fs::File>>,
    /// With `--timestamps`: when the boot started.
    started: Option<Instant>,
}

struct ConsoleWriter {
    console: Arc<Console>,
    /// The next byte starts a line (gets a timestamp).
    at_line_start: bool,
}

impl ConsoleWriter {
    /// `buf` as shown and logged: with a `[+seconds]` prefix on every line where
    /// timestamps are on.
    fn shown(&mut self, buf: &[u8]) -> Vec<u8> {
        let Some(started) = self.console.started else {
            return buf.to_vec();
        };
        let mut out = Vec::with_capacity(buf.len() + 16);
        for &b in buf {
            if self.at_line_start {
                let _ = write!(out, "[+{:9.3}] ", started.elapsed().as_secs_f64());
                self.at_line_start = false;
            }
            out.push(b);
            self.at_line_start = b == b'\n';
        }
        out
    }
}

impl Write for ConsoleWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let shown = self.shown(buf);
        let mut out = std::io::stdout();
        out.write_all(&shown)?;
        out.flush()?;
        if let Some(log) = self
            .console
            .log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            log.write_all(&shown)?;
        }
        self.console
            .text
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_str(&String::from_utf8_lossy(buf));
        self.console.changed.notify_all();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub fn run(command: DebugCommand) -> Result<(), CliError> {
    let DebugCommand::Boot {
        kernel,
        initrd,
        cmdline,
        until,
        timeout,
        memory_mib,
        log,
        vcpus,
        disk,
        vsock_dir,
        rng,
        cmdline_devices,
        kernel_mode,
        timestamps,
    } = command;
    let kernel_mode = match kernel_mode {
        ModeArg::Native => KernelMode::Native,
        ModeArg::Emulated => KernelMode::Emulated,
        ModeArg::Auto => KernelMode::of_this_host().ok_or_else(|| {
            CliError::unsupported("no usable /dev/kvm")
                .hint("`cube doctor` shows what this host can run")
        })?,
    };
    if kernel_mode == KernelMode::Emulated {
        eprintln!(
            "cube: the guest kernel runs emulated (KVM here is PVM and the kernel is not \
             PVM-enabled): every kernel instruction costs about a microsecond"
        );
    }
    let pattern = until
        .as_deref()
        .map(regex::Regex::new)
        .transpose()
        .map_err(|e| CliError::failed(format!("--until is not a valid regular expression: {e}")))?;
    let log = log
        .map(std::fs::File::create)
        .transpose()
        .map_err(|e| CliError::failed(format!("creating the log: {e}")))?;
    let console = Arc::new(Console {
        text: Mutex::new(String::new()),
        changed: Condvar::new(),
        log: Mutex::new(log),
        started: timestamps.then(Instant::now),
    });
    let options = BootOptions {
        config: LinuxBootConfig {
            kernel,
            initrd,
            cmdline,
            memory_bytes: memory_mib << 20,
            vcpus,
            cmdline_devices,
            kernel_mode,
        },
        disk,
        vsock_dir,
        rng,
    };
    let writer = ConsoleWriter {
        console: Arc::clone(&console),
        at_line_start: true,
    };
    let vm = debug::boot(&options, Box::new(writer)).map_err(|e| match e {
        DebugError::NoKvm(_) => CliError::of_kind(e.kind(), chain(&e))
            .hint("`cube doctor` shows what this host can run"),
        _ => CliError::of_kind(e.kind(), chain(&e)),
    })?;
    let booted = Instant::now();
    let deadline = booted + Duration::from_secs(timeout);
    let mut text = console.text.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(p) = &pattern {
            if p.is_match(&text) {
                let assists = vm.assists();
                eprintln!(
                    "\ncube: console matched {:?} after {:.1} s ({} int3, {} fwait finished by the VMM)",
                    p.as_str(),
                    booted.elapsed().as_secs_f64(),
                    assists.breakpoints,
                    assists.fwaits
                );
                return Ok(());
            }
        }
        if let Some(reason) = vm.fatal() {
            return Err(CliError::failed(format!(
                "VM error before the pattern appeared: {reason}"
            )));
        }
        let now = Instant::now();
        if now >= deadline {
            return match pattern {
                Some(p) => Err(CliError::failed(format!(
                    "timed out after {timeout} s without {:?} on the console",
                    p.as_str()
                ))),
                None => Ok(()),
            };
        }
        let wait = (deadline - now).min(Duration::from_millis(200));
        text = console
            .changed
            .wait_timeout(text, wait)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}
