//! What the agent does first when it is PID 1 of a microVM (started from an
//! initramfs): mount the kernel filesystems and load the kernel modules the VM's
//! devices need (virtio transport, disk, vsock, network, entropy), in the order a
//! file lists them, so the agent can then listen on vsock; and, where the VM has a NIC,
//! give it the address every Cube sandbox has (the host's pool datapath answers for
//! the gateway; see cube-net's addressing).

use std::ffi::CString;
use std::path::{Path, PathBuf};

/// Why the VM could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum VmInitError {
    /// A kernel filesystem could not be mounted.
    #[error("Mounting {target} ({fstype}) failed")]
    Mount {
        /// Where.
        target: String,
        /// Which filesystem.
        fstype: String,
        /// The error.
        #[source]
        source: nix::Error,
    },
    /// The module list could not be read.
    #[error("Reading the module list {0}")]
    List(PathBuf, #[source] std::io::Error),
    /// A module file could not be opened.
    #[error("Opening module {0}")]
    Open(PathBuf, #[source] std::io::Error),
    /// The kernel refused a module.
    #[error("Loading module {0}")]
    Load(PathBuf, #[source] std::io::Error),
    /// The network interface could not be configured.
    #[error("Configuring {interface}: {what}")]
    Network {
        /// The interface.
        interface: String,
        /// Which step.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// The guest's NIC as Linux names the first one.
pub const GUEST_NIC: &str = "eth0";
/// The guest's address on it (a /30 shared with the gateway).
pub const GUEST_ADDR: [u8; 4] = [169, 254, 0, 2];
/// The gateway the host's datapath answers for.
pub const GATEWAY_ADDR: [u8; 4] = [169, 254, 0, 1];
const PREFIX_MASK: [u8; 4] = [255, 255, 255, 252];

/// `struct rtentry` of linux/route.h (glibc's libc bindings lack it).
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

fn sockaddr_in(addr: [u8; 4]) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes of plain data; the kernel
    // reads a sockaddr as the sockaddr_in its family says it is.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// Brings `lo` up and, where the VM has a NIC (`eth0`), gives it 169.254.0.2/30, brings
/// it up and routes everything through 169.254.0.1, as a jail's veth is set up.
/// Returns whether there was a NIC.
pub fn configure_network() -> Result<bool, VmInitError> {
    set_up("lo", None)?;
    if !Path::new("/sys/class/net").join(GUEST_NIC).exists() {
        return Ok(false);
    }
    // The datapath carries IPv4 only: no router solicitations to drop.
    let _ = std::fs::write(
        format!("/proc/sys/net/ipv6/conf/{GUEST_NIC}/disable_ipv6"),
        "1",
    );
    set_up(GUEST_NIC, Some((GUEST_ADDR, PREFIX_MASK)))?;
    add_default_route(GUEST_NIC, GATEWAY_ADDR)?;
    Ok(true)
}

fn inet_socket(interface: &str) -> Result<std::os::fd::OwnedFd, VmInitError> {
    // SAFETY: socket(2) takes no pointers; the descriptor is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(VmInitError::Network {
            interface: interface.into(),
            what: "opening a socket",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

fn ifreq(interface: &str) -> Result<libc::ifreq, VmInitError> {
    if interface.is_empty() || interface.len() >= libc::IFNAMSIZ {
        return Err(VmInitError::Network {
            interface: interface.into(),
            what: "naming it",
            source: std::io::ErrorKind::InvalidInput.into(),
        });
    }
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(interface.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

/// libc's SIOC* constants as the C library's `ioctl` takes its request: an unsigned
/// long in glibc, an int in musl (the agent is built for either).
#[allow(clippy::unnecessary_cast)]
fn ioctl_request(request: libc::c_ulong) -> libc::Ioctl {
    // The SIOC* numbers fit in 16 bits.
    request as libc::Ioctl
}

/// Sets `interface`'s address and netmask (when given) and its IFF_UP flag.
fn set_up(interface: &str, address: Option<([u8; 4], [u8; 4])>) -> Result<(), VmInitError> {
    use std::os::fd::AsRawFd;
    let socket = inet_socket(interface)?;
    let ioctl = |request: libc::c_ulong, req: &mut libc::ifreq, what: &'static str| {
        // SAFETY: these SIOC* requests read (or fill) one ifreq, which `req` is,
        // alive for the call.
        if unsafe {
            libc::ioctl(
                socket.as_raw_fd(),
                ioctl_request(request),
                req as *mut libc::ifreq,
            )
        } < 0
        {
            return Err(VmInitError::Network {
                interface: interface.into(),
                what,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    };
    if let Some((addr, mask)) = address {
        let mut req = ifreq(interface)?;
        req.ifr_ifru.ifru_addr = sockaddr_in(addr);
        ioctl(libc::SIOCSIFADDR, &mut req, "setting its address")?;
        let mut req = ifreq(interface)?;
        req.ifr_ifru.ifru_netmask = sockaddr_in(mask);
        ioctl(libc::SIOCSIFNETMASK, &mut req, "setting its netmask")?;
    }
    let mut req = ifreq(interface)?;
    ioctl(libc::SIOCGIFFLAGS, &mut req, "reading its flags")?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    ioctl(libc::SIOCSIFFLAGS, &mut req, "bringing it up")
}

fn add_default_route(interface: &str, gateway: [u8; 4]) -> Result<(), VmInitError> {
    use std::os::fd::AsRawFd;
    let socket = inet_socket(interface)?;
    let mut device = CString::new(interface)
        .map_err(|_| VmInitError::Network {
            interface: interface.into(),
            what: "naming it",
            source: std::io::ErrorKind::InvalidInput.into(),
        })?
        .into_bytes_with_nul();
    let mut route = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_in([0; 4]),
        rt_gateway: sockaddr_in(gateway),
        rt_genmask: sockaddr_in([0; 4]),
        rt_flags: (libc::RTF_UP | libc::RTF_GATEWAY) as libc::c_ushort,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: device.as_mut_ptr().cast(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    // SAFETY: SIOCADDRT reads one rtentry, which `route` is; its rt_dev points at the
    // NUL-terminated `device`, alive for the call.
    let rc = unsafe {
        libc::ioctl(
            socket.as_raw_fd(),
            ioctl_request(libc::SIOCADDRT),
            &mut route as *mut RtEntry,
        )
    };
    if rc < 0 {
        let source = std::io::Error::last_os_error();
        // Already there: a template's guest configured it before its snapshot.
        if source.raw_os_error() != Some(libc::EEXIST) {
            return Err(VmInitError::Network {
                interface: interface.into(),
                what: "adding the default route",
                source,
            });
        }
    }
    Ok(())
}

/// Mounts /proc, /sys, /dev (devtmpfs) and /dev/pts where they are not mounted yet.
pub fn mount_kernel_filesystems() -> Result<(), VmInitError> {
    use nix::mount::{mount, MsFlags};
    for (fstype, target) in [("proc", "/proc"), ("sysfs", "/sys"), ("devtmpfs", "/dev")] {
        let _ = std::fs::create_dir_all(target);
        match mount(
            Some(fstype),
            target,
            Some(fstype),
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            None::<&str>,
        ) {
            Ok(()) | Err(nix::Error::EBUSY) => {}
            Err(source) => {
                return Err(VmInitError::Mount {
                    target: target.into(),
                    fstype: fstype.into(),
                    source,
                })
            }
        }
    }
    // Terminals for execs that ask for one: /dev/ptmx opens a terminal of the devpts
    // mounted beside it. Without it the VM still serves everything else, so a kernel
    // without terminals is said on the console, not a failed boot.
    let _ = std::fs::create_dir_all("/dev/pts");
    match mount(
        Some("devpts"),
        "/dev/pts",
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("ptmxmode=0666,mode=0620"),
    ) {
        Ok(()) | Err(nix::Error::EBUSY) => {}
        Err(e) => eprintln!("cube-agent: no terminals in this VM: mounting devpts: {e}"),
    }
    Ok(())
}

/// Loads every module `list` names (one path a line, relative to the list's
/// directory, dependencies first); modules the kernel already has are skipped.
/// Returns how many were loaded.
pub fn load_modules(list: &Path) -> Result<usize, VmInitError> {
    let text =
        std::fs::read_to_string(list).map_err(|e| VmInitError::List(list.to_path_buf(), e))?;
    let base = list.parent().unwrap_or(Path::new("/"));
    let mut loaded = 0;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let path = base.join(line);
        let file = std::fs::File::open(&path).map_err(|e| VmInitError::Open(path.clone(), e))?;
        let params = CString::default();
        // SAFETY: finit_module reads the module from an fd this function owns and a
        // NUL-terminated (empty) parameter string; it touches no other memory.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_finit_module,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                params.as_ptr(),
                0,
            )
        };
        if rc == 0 {
            loaded += 1;
            continue;
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EEXIST) {
            return Err(VmInitError::Load(path, err));
        }
    }
    Ok(loaded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nic_named_eth0_gets_the_sandbox_address_and_default_route() {
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: configuring interfaces needs root");
            return;
        }
        // A thread in a network namespace of its own, with a veth named eth0 in it.
        let result = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let ip = |args: &[&str]| {
                let out = std::process::Command::new("ip")
                    .args(args)
                    .output()
                    .unwrap();
                assert!(out.status.success(), "ip {args:?}");
                String::from_utf8_lossy(&out.stdout).into_owned()
            };
            ip(&[
                "link", "add", GUEST_NIC, "type", "veth", "peer", "name", "peer0",
            ]);
            ip(&["link", "set", "peer0", "up"]);
            // configure_network looks in /sys/class/net, which shows the namespace of
            // whoever mounted sysfs (the host's, here): its steps are called directly.
            set_up("lo", None).unwrap();
            set_up(GUEST_NIC, Some((GUEST_ADDR, PREFIX_MASK))).unwrap();
            add_default_route(GUEST_NIC, GATEWAY_ADDR).unwrap();
            // A second time (a restored template) is no error.
            add_default_route(GUEST_NIC, GATEWAY_ADDR).unwrap();
            (
                ip(&["-4", "-o", "addr", "show", "dev", GUEST_NIC]),
                ip(&["-4", "route", "show", "default"]),
                ip(&["-o", "link", "show", "lo"]),
            )
        })
        .join()
        .unwrap();
        let (addr, route, lo) = result;
        assert!(addr.contains("169.254.0.2/30"), "{addr}");
        assert!(
            route.contains("default via 169.254.0.1 dev eth0"),
            "{route}"
        );
        assert!(lo.contains("UP"), "{lo}");
        assert!(set_up("", None).is_err());
    }

    #[test]
    fn a_missing_list_or_module_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let list = dir.path().join("modules.order");
        assert!(matches!(load_modules(&list), Err(VmInitError::List(..))));
        std::fs::write(&list, "missing.ko\n").unwrap();
        match load_modules(&list) {
            Err(VmInitError::Open(path, _)) => assert!(path.ends_with("missing.ko")),
            other => panic!("{other:?}"),
        }
        // A file that is no module is refused by the kernel (or by the permission
        // check where the test does not run as root), never loaded.
        std::fs::write(dir.path().join("junk.ko"), b"not an ELF module").unwrap();
        std::fs::write(&list, "\njunk.ko\n").unwrap();
        assert!(matches!(load_modules(&list), Err(VmInitError::Load(..))));
        std::fs::write(&list, "\n\n").unwrap();
        assert_eq!(load_modules(&list).unwrap(), 0);
    }
}
