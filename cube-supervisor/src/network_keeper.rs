//! The privileged half of a networked VM's supervisor: a process of its own that
//! holds the VM's TAP from the host's pool, and with it what changing and releasing
//! that device takes (`net_admin`, `bpf`, `sys_admin`, the pool's lock file and bpffs
//! pins), so that the VM supervisor, which runs the device models a guest can attack,
//! keeps none of it.
//!
//! Privilege separation in the manner of OpenSSH's: before it is confined, the VM
//! supervisor starts its own binary again as the keeper (`--network-keeper-fd N`,
//! one end of a unix socket pair), which attaches the TAP and confines itself to the
//! [`Profile::NetworkKeeper`] profile. The supervisor opens the TAP by name for the
//! VM's NIC and then confines itself to the plain [`Profile::Vm`] profile: no
//! capability, no mount, namespace or `bpf` call, no file of the pool. Afterwards it
//! can ask the keeper only for what the library can ask of a sandbox's network
//! (its report, policy and port changes, and the release), in typed frames about
//! the one device the keeper holds.
//!
//! The keeper releases the device when asked, when the supervisor's end of the pair
//! closes (the supervisor ended or was killed), and on any error in the exchange;
//! it then exits. A supervisor taken over by its guest can still change its own
//! sandbox's egress policy through the keeper, as the library can: the policy is
//! the library's to set, and the supervisor relays it.
//!
//! [`Profile::NetworkKeeper`]: crate::confinement::Profile::NetworkKeeper
//! [`Profile::Vm`]: crate::confinement::Profile::Vm

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde::{Deserialize, Serialize};

use crate::backend::NetworkControl;
use crate::confinement::{confine, Profile};
use crate::error_report::chain as error_chain;
use crate::jail_network::{network_failure, JailNetwork};
use crate::network::{NetworkOptions, NetworkPolicy, NetworkReport, PortMapping};
use crate::protocol::{read_frame, write_frame, ErrorKind, Failure, ProtocolError};

/// The flag that makes `cube-supervisor` a network keeper on the descriptor after it.
pub const KEEPER_FLAG: &str = "--network-keeper-fd";

/// Why a keeper could not be started or asked.
#[derive(Debug, thiserror::Error)]
pub enum NetworkKeeperError {
    /// The socket pair could not be made.
    #[error("making the keeper's socket pair")]
    Pair(#[source] std::io::Error),
    /// The supervisor's own binary could not be started again.
    #[error("starting the network keeper")]
    Spawn(#[source] std::io::Error),
    /// A frame could not be exchanged with the keeper.
    #[error("talking to the network keeper")]
    Exchange(#[from] ProtocolError),
    /// The keeper answered something the request does not call for.
    #[error("the network keeper answered {0} to {1}")]
    Unexpected(&'static str, &'static str),
}

/// What the supervisor asks of its keeper.
#[derive(Debug, Serialize, Deserialize)]
enum KeeperRequest {
    /// Attach a TAP for the NIC with MAC `guest_mac`, with `options` in force, and
    /// record it in sandbox directory `dir`. The first request, and only then.
    Attach {
        guest_mac: [u8; 6],
        options: NetworkOptions,
        dir: PathBuf,
    },
    /// The device's report.
    Report,
    /// Replace the egress policy.
    SetPolicy(NetworkPolicy),
    /// Serve a sandbox port on the host.
    Expose(PortMapping),
    /// Withdraw a host port.
    Unexpose(u16),
    /// Release the device and end.
    Release,
}

/// What the keeper answers.
#[derive(Debug, Serialize, Deserialize)]
enum KeeperReply {
    /// The TAP is attached under this name.
    Attached(String),
    /// The device's report.
    Report(NetworkReport),
    /// Done.
    Done,
}

impl KeeperReply {
    /// The failure of a request `what` that got this reply, not the one it calls for.
    fn unexpected_for(&self, what: &'static str) -> Failure {
        let got = match self {
            KeeperReply::Attached(_) => "an attached TAP",
            KeeperReply::Report(_) => "a report",
            KeeperReply::Done => "done",
        };
        Failure::from(error_chain(&NetworkKeeperError::Unexpected(got, what)))
    }
}

/// The supervisor's handle on its keeper; dropping it releases the device.
pub struct NetworkKeeper {
    stream: UnixStream,
    child: Child,
    tap: String,
    released: bool,
}

impl NetworkKeeper {
    /// Starts a keeper (this process's binary run again) that attaches a TAP from the
    /// host's pool for the guest NIC with MAC `guest_mac`, with `options` in force,
    /// recorded in `dir`. Must run before this process is confined (it starts a
    /// process).
    pub fn attach_tap(
        guest_mac: [u8; 6],
        options: &NetworkOptions,
        dir: &Path,
    ) -> Result<NetworkKeeper, Failure> {
        let internal = |e: NetworkKeeperError| Failure::from(error_chain(&e));
        let (stream, theirs) = UnixStream::pair()
            .map_err(NetworkKeeperError::Pair)
            .map_err(internal)?;
        let fd = theirs.as_raw_fd();
        let mut command = Command::new("/proc/self/exe");
        command
            .arg(KEEPER_FLAG)
            .arg(fd.to_string())
            .stdin(Stdio::null());
        // SAFETY: the closure runs in the child between fork and exec and makes only
        // two system calls, both async-signal-safe, on descriptor numbers it was given.
        unsafe {
            command.pre_exec(move || {
                // Nothing of the supervisor's (its control socket, KVM, the guest's
                // memory) passes to the keeper but its end of the pair.
                libc::syscall(
                    libc::SYS_close_range,
                    3u32,
                    u32::MAX,
                    libc::CLOSE_RANGE_CLOEXEC,
                );
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .map_err(NetworkKeeperError::Spawn)
            .map_err(internal)?;
        drop(theirs);
        let mut keeper = NetworkKeeper {
            stream,
            child,
            tap: String::new(),
            released: false,
        };
        let request = KeeperRequest::Attach {
            guest_mac,
            options: options.clone(),
            dir: dir.to_path_buf(),
        };
        match keeper.ask(&request, "attach")? {
            KeeperReply::Attached(tap) => keeper.tap = tap,
            other => return Err(other.unexpected_for("attach")),
        }
        Ok(keeper)
    }

    /// The TAP the VM's NIC is to open.
    pub fn tap_name(&self) -> &str {
        &self.tap
    }

    fn ask(&mut self, request: &KeeperRequest, what: &'static str) -> Result<KeeperReply, Failure> {
        let exchanged = write_frame(&mut self.stream, request)
            .and_then(|()| read_frame::<Result<KeeperReply, Failure>>(&mut self.stream));
        match exchanged {
            Ok(answer) => answer,
            Err(e) => {
                let e = NetworkKeeperError::Exchange(e);
                Err(Failure::from(format!("{what}: {}", error_chain(&e))))
            }
        }
    }

    fn ask_done(&mut self, request: &KeeperRequest, what: &'static str) -> Result<(), Failure> {
        match self.ask(request, what)? {
            KeeperReply::Done => Ok(()),
            other => Err(other.unexpected_for(what)),
        }
    }

    /// Has the keeper release the device, and waits for it to end.
    pub fn release(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        if let Err(e) = self.ask_done(&KeeperRequest::Release, "release") {
            tracing::warn!("releasing the sandbox's network: {}", e.message);
        }
        // Closing our end ends a keeper that did not hear the request.
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Err(e) = self.child.wait() {
            tracing::warn!("waiting for the network keeper: {e}");
        }
    }
}

impl NetworkControl for NetworkKeeper {
    fn report(&mut self) -> Result<NetworkReport, Failure> {
        match self.ask(&KeeperRequest::Report, "report")? {
            KeeperReply::Report(report) => Ok(report),
            other => Err(other.unexpected_for("report")),
        }
    }

    fn set_policy(&mut self, policy: NetworkPolicy) -> Result<(), Failure> {
        self.ask_done(&KeeperRequest::SetPolicy(policy), "set policy")
    }

    fn expose(&mut self, port: PortMapping) -> Result<(), Failure> {
        self.ask_done(&KeeperRequest::Expose(port), "expose")
    }

    fn unexpose(&mut self, host_port: u16) -> Result<(), Failure> {
        self.ask_done(&KeeperRequest::Unexpose(host_port), "unexpose")
    }
}

impl Drop for NetworkKeeper {
    fn drop(&mut self) {
        self.release();
    }
}

/// The keeper's side, on `stream` (its end of the pair): attaches on the first
/// request, confines itself, then serves until it is asked to release, or its
/// supervisor is gone. The device is released in every case (dropping the network).
pub fn serve(mut stream: UnixStream) -> Result<(), Failure> {
    let fail = |e: ProtocolError| Failure::from(format!("the supervisor's request: {e}"));
    let (guest_mac, options, dir) = match read_frame::<KeeperRequest>(&mut stream).map_err(fail)? {
        KeeperRequest::Attach {
            guest_mac,
            options,
            dir,
        } => (guest_mac, options, dir),
        other => {
            return Err(Failure::invalid(format!(
                "a keeper attaches first; asked {other:?}"
            )))
        }
    };
    let attached = JailNetwork::attach_tap(guest_mac, &options, &dir)
        .map_err(network_failure)
        .and_then(|network| {
            confine(Profile::NetworkKeeper, &dir).map_err(|e| {
                Failure::from(format!("confining the network keeper: {}", error_chain(&e)))
            })?;
            let tap = network
                .tap_name()
                .ok_or_else(|| Failure::from("the pool gave the VM no TAP"))?
                .to_string();
            Ok((network, tap))
        });
    let (mut network, tap) = match attached {
        Ok(attached) => attached,
        Err(failure) => {
            let _ = write_frame(&mut stream, &Err::<KeeperReply, _>(failure.clone()));
            return Err(failure);
        }
    };
    write_frame(&mut stream, &Ok::<_, Failure>(KeeperReply::Attached(tap))).map_err(fail)?;
    loop {
        // A closed or broken pair is the supervisor gone: the network goes with it.
        let Ok(request) = read_frame::<KeeperRequest>(&mut stream) else {
            return Ok(());
        };
        let answer = match request {
            KeeperRequest::Attach { .. } => Err(Failure::new(
                ErrorKind::BadState,
                "the keeper holds a device already",
            )),
            KeeperRequest::Report => NetworkControl::report(&mut network).map(KeeperReply::Report),
            KeeperRequest::SetPolicy(policy) => {
                NetworkControl::set_policy(&mut network, policy).map(|()| KeeperReply::Done)
            }
            KeeperRequest::Expose(port) => {
                NetworkControl::expose(&mut network, port).map(|()| KeeperReply::Done)
            }
            KeeperRequest::Unexpose(port) => {
                NetworkControl::unexpose(&mut network, port).map(|()| KeeperReply::Done)
            }
            KeeperRequest::Release => {
                network.disconnect();
                let _ = write_frame(&mut stream, &Ok::<_, Failure>(KeeperReply::Done));
                return Ok(());
            }
        };
        if write_frame(&mut stream, &answer).is_err() {
            return Ok(());
        }
    }
}
