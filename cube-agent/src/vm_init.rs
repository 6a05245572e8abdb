//! What the agent does first when it is PID 1 of a microVM (started from an
//! initramfs): mount the kernel filesystems and load the kernel modules the VM's
//! devices need (virtio transport, disk, vsock, network, entropy), in the order a
//! file lists them, so the agent can then listen on vsock; and, where the VM has a NIC,
//! give it the address every Cube sandbox has (the host's pool datapath answers for
//! the gateway; see cube-net's addressing). A VM put on a pod's network has its NIC
//! given the pod's identity afterwards ([`configure_nic`], asked by the host).

use std::ffi::CString;
use std::path::{Path, PathBuf};

use crate::protocol::NicSettings;

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

/// One SIOC* request on `interface` through `socket`, which reads (or fills) `req`;
/// `what` names the step in the error.
fn interface_ioctl(
    socket: &std::os::fd::OwnedFd,
    interface: &str,
    request: libc::c_ulong,
    req: &mut libc::ifreq,
    what: &'static str,
) -> Result<(), VmInitError> {
    use std::os::fd::AsRawFd;
    // SAFETY: these SIOC* requests read (or fill) one ifreq, which `req` is, alive for
    // the call.
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
}

/// Sets `interface`'s address and netmask (when given) and its IFF_UP flag.
fn set_up(interface: &str, address: Option<([u8; 4], [u8; 4])>) -> Result<(), VmInitError> {
    let socket = inet_socket(interface)?;
    let ioctl = |request, req: &mut libc::ifreq, what| {
        interface_ioctl(&socket, interface, request, req, what)
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
    match add_route(
        interface,
        ([0; 4], [0; 4]),
        Some(gateway),
        "adding the default route",
    ) {
        // Already there: a template's guest configured it before its snapshot.
        Err(VmInitError::Network { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {
            Ok(())
        }
        other => other,
    }
}

/// Adds the IPv4 route to `destination` (address, mask) on `interface`, through
/// `gateway` where given (else on the link).
fn add_route(
    interface: &str,
    destination: ([u8; 4], [u8; 4]),
    gateway: Option<[u8; 4]>,
    what: &'static str,
) -> Result<(), VmInitError> {
    use std::os::fd::AsRawFd;
    let socket = inet_socket(interface)?;
    let mut device = CString::new(interface)
        .map_err(|_| VmInitError::Network {
            interface: interface.into(),
            what: "naming it",
            source: std::io::ErrorKind::InvalidInput.into(),
        })?
        .into_bytes_with_nul();
    let mut flags = libc::RTF_UP;
    if gateway.is_some() {
        flags |= libc::RTF_GATEWAY;
    }
    if destination.1 == [255; 4] {
        flags |= libc::RTF_HOST;
    }
    let mut route = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_in(destination.0),
        rt_gateway: sockaddr_in(gateway.unwrap_or([0; 4])),
        rt_genmask: sockaddr_in(destination.1),
        rt_flags: flags as libc::c_ushort,
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
        return Err(VmInitError::Network {
            interface: interface.into(),
            what,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Why a [`NicSettings`] cannot be applied as it is.
fn check_nic_settings(settings: &NicSettings) -> Result<(), &'static str> {
    if settings.prefix_len > 32 {
        return Err("a prefix length is 0 to 32");
    }
    if !(68..=65535).contains(&settings.mtu) {
        return Err("an IPv4 MTU is 68 to 65535");
    }
    if settings.mac[0] & 1 == 1 || settings.mac == [0; 6] {
        return Err("a NIC's MAC is a unicast address, not zero");
    }
    if settings.address == [0; 4] || settings.address[0] >= 224 {
        return Err("the address is not a unicast IPv4 address");
    }
    Ok(())
}

fn mask_of(prefix_len: u8) -> [u8; 4] {
    let bits = u32::MAX
        .checked_shl(32 - u32::from(prefix_len))
        .unwrap_or(0);
    bits.to_be_bytes()
}

/// Gives the VM's NIC the identity of the network it was bridged into (a
/// Kubernetes pod's: see cube-net's `pod_netns`): its MAC (taken while the link is
/// down), MTU, address and, in place of the route every Cube VM starts with, a default
/// route through `gateway` (with a route to the gateway on the link first, where it is
/// outside the address's subnet, as some CNI plugins give a /32 and a link-local
/// gateway).
pub fn configure_nic(settings: &NicSettings) -> Result<(), VmInitError> {
    let invalid = |what: &'static str| VmInitError::Network {
        interface: GUEST_NIC.into(),
        what,
        source: std::io::ErrorKind::InvalidInput.into(),
    };
    check_nic_settings(settings).map_err(invalid)?;
    if !Path::new("/sys/class/net").join(GUEST_NIC).exists() {
        return Err(VmInitError::Network {
            interface: GUEST_NIC.into(),
            what: "finding it",
            source: std::io::ErrorKind::NotFound.into(),
        });
    }
    apply_nic_settings(settings)
}

/// [`configure_nic`]'s steps, on `eth0` of the calling thread's namespace.
fn apply_nic_settings(settings: &NicSettings) -> Result<(), VmInitError> {
    let socket = inet_socket(GUEST_NIC)?;
    let ioctl = |request, req: &mut libc::ifreq, what| {
        interface_ioctl(&socket, GUEST_NIC, request, req, what)
    };
    // Down first: the MAC changes only on a link that is down (and the routes through
    // the old address go with it).
    let mut req = ifreq(GUEST_NIC)?;
    ioctl(libc::SIOCGIFFLAGS, &mut req, "reading its flags")?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags & !(libc::IFF_UP as libc::c_short);
    ioctl(libc::SIOCSIFFLAGS, &mut req, "taking it down")?;

    let mut req = ifreq(GUEST_NIC)?;
    // SAFETY: sockaddr is plain data; all zeroes is a valid value.
    let mut hwaddr: libc::sockaddr = unsafe { std::mem::zeroed() };
    hwaddr.sa_family = libc::ARPHRD_ETHER;
    for (dst, src) in hwaddr.sa_data.iter_mut().zip(settings.mac) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_hwaddr = hwaddr;
    ioctl(libc::SIOCSIFHWADDR, &mut req, "setting its MAC")?;

    let mut req = ifreq(GUEST_NIC)?;
    req.ifr_ifru.ifru_mtu = settings.mtu as libc::c_int;
    ioctl(libc::SIOCSIFMTU, &mut req, "setting its MTU")?;

    set_up(
        GUEST_NIC,
        Some((settings.address, mask_of(settings.prefix_len))),
    )?;
    if let Some(gateway) = settings.gateway {
        let mask = u32::from_be_bytes(mask_of(settings.prefix_len));
        let on_link =
            u32::from_be_bytes(gateway) & mask == u32::from_be_bytes(settings.address) & mask;
        if !on_link {
            add_route(
                GUEST_NIC,
                (gateway, [255; 4]),
                None,
                "adding the route to its gateway",
            )?;
        }
        add_default_route(GUEST_NIC, gateway)?;
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

    /// Runs `test` in a thread in a network namespace of its own, with a veth named
    /// eth0 in it (its peer up); `test` gets `ip` (iproute2), which returns stdout.
    fn with_an_eth0<T: Send + 'static>(
        test: impl FnOnce(&dyn Fn(&[&str]) -> String) -> T + Send + 'static,
    ) -> T {
        std::thread::spawn(|| {
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
            test(&ip)
        })
        .join()
        .unwrap()
    }

    #[test]
    fn a_nic_named_eth0_gets_the_sandbox_address_and_default_route() {
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: configuring interfaces needs root");
            return;
        }
        let result = with_an_eth0(|ip| {
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
        });
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
    fn a_nic_takes_the_pods_mac_mtu_address_and_gateway_in_place_of_the_sandbox_ones() {
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: configuring interfaces needs root");
            return;
        }
        let result = with_an_eth0(|ip| {
            // As a template's guest left it.
            set_up(GUEST_NIC, Some((GUEST_ADDR, PREFIX_MASK))).unwrap();
            add_default_route(GUEST_NIC, GATEWAY_ADDR).unwrap();
            let pod = NicSettings {
                mac: [0x0a, 0x58, 10, 40, 0, 7],
                mtu: 1400,
                address: [10, 40, 0, 7],
                prefix_len: 24,
                gateway: Some([10, 40, 0, 1]),
            };
            apply_nic_settings(&pod).unwrap();
            let first = (
                ip(&["-4", "-o", "addr", "show", "dev", GUEST_NIC]),
                ip(&["-4", "route", "show"]),
                ip(&["-o", "link", "show", GUEST_NIC]),
            );
            // A /32 with its gateway outside it (as Calico does): a route to the
            // gateway on the link comes first.
            let calico = NicSettings {
                prefix_len: 32,
                gateway: Some([169, 254, 1, 1]),
                ..pod
            };
            apply_nic_settings(&calico).unwrap();
            (first, ip(&["-4", "route", "show"]))
        });
        let ((addr, routes, link), calico_routes) = result;
        assert!(addr.contains("10.40.0.7/24"), "{addr}");
        assert!(!addr.contains("169.254.0.2"), "{addr}");
        assert!(
            routes.contains("default via 10.40.0.1 dev eth0"),
            "{routes}"
        );
        assert!(!routes.contains("169.254.0.1"), "{routes}");
        assert!(link.contains("mtu 1400"), "{link}");
        assert!(link.contains("link/ether 0a:58:0a:28:00:07"), "{link}");
        assert!(
            calico_routes.contains("default via 169.254.1.1 dev eth0"),
            "{calico_routes}"
        );
        assert!(
            calico_routes.contains("169.254.1.1 dev eth0"),
            "{calico_routes}"
        );
    }

    #[test]
    fn nic_settings_that_cannot_be_a_nics_are_refused() {
        let good = NicSettings {
            mac: [2, 0, 0, 0, 0, 1],
            mtu: 1500,
            address: [10, 0, 0, 2],
            prefix_len: 24,
            gateway: None,
        };
        assert_eq!(check_nic_settings(&good), Ok(()));
        for bad in [
            NicSettings {
                prefix_len: 33,
                ..good
            },
            NicSettings { mtu: 67, ..good },
            NicSettings {
                mac: [1, 0, 0, 0, 0, 1],
                ..good
            },
            NicSettings {
                mac: [0; 6],
                ..good
            },
            NicSettings {
                address: [0; 4],
                ..good
            },
            NicSettings {
                address: [224, 0, 0, 1],
                ..good
            },
        ] {
            assert!(check_nic_settings(&bad).is_err(), "{bad:?}");
        }
        assert_eq!(mask_of(0), [0; 4]);
        assert_eq!(mask_of(24), [255, 255, 255, 0]);
        assert_eq!(mask_of(32), [255; 4]);
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
