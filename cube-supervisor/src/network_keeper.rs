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
//! can ask the keeper for one thing only: the release of the device.
//!
//! The library's network requests (the report, the egress policy, exposed ports)
//! go to the keeper directly, never through the supervisor, which a guest may have
//! taken over: the keeper serves them on a socket of its sandbox's directory
//! ([`cube_storage::SandboxDir::network_keeper_socket`], bound before it is
//! confined), in the supervisor protocol's frames ([`KeeperCall`], answered with a
//! [`Response`]), and answers only a peer of its own uid (root), asking about its
//! own sandbox. A supervisor, which runs as a uid of its own and owns that
//! directory, can neither ask (the peer check), nor answer in the keeper's place
//! (the library checks its peer is root, [`ask_keeper`]), nor turn the library's
//! request to another sandbox's keeper (a link to another keeper's socket names
//! the wrong sandbox, which that keeper refuses); removing the socket makes the
//! library's request fail, and only its own sandbox's.
//!
//! The keeper releases the device when asked, when the supervisor's end of the pair
//! closes (the supervisor ended or was killed), and on any error in that exchange;
//! it then removes its socket and exits.
//!
//! [`Profile::NetworkKeeper`]: crate::confinement::Profile::NetworkKeeper
//! [`Profile::Vm`]: crate::confinement::Profile::Vm

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde::{Deserialize, Serialize};

use crate::backend::dispatch_network;
use crate::client::ClientError;
use crate::confinement::{confine, Profile};
use crate::error_report::chain as error_chain;
use crate::jail_network::{network_failure, JailNetwork};
use crate::network::NetworkOptions;
use crate::protocol::{
    read_frame, write_frame, ErrorKind, Failure, ProtocolError, Request, Response,
};

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

/// How long the keeper waits for a library connection's request before it drops it
/// (it serves one connection at a time, and watches its supervisor between them).
const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A library request to the keeper of the sandbox in directory `sandbox`.
#[derive(Debug, Serialize, Deserialize)]
pub struct KeeperCall {
    /// The sandbox directory of the keeper meant: one that holds another's device
    /// refuses.
    pub sandbox: PathBuf,
    /// [`Request::NetworkStatus`], [`Request::SetPolicy`], [`Request::Expose`] or
    /// [`Request::Unexpose`].
    pub request: Request,
}

/// What the supervisor may ask of its keeper: nothing that changes its network but
/// its release.
#[derive(Debug, Serialize, Deserialize)]
enum KeeperRequest {
    /// Attach a TAP for the NIC with MAC `guest_mac`, with `options` in force, and
    /// record it in sandbox directory `dir`. The first request, before the supervisor
    /// runs its guest, and only then.
    Attach {
        guest_mac: [u8; 6],
        options: NetworkOptions,
        dir: PathBuf,
    },
    /// Release the device and end.
    Release,
}

/// What the keeper answers its supervisor.
#[derive(Debug, Serialize, Deserialize)]
enum KeeperReply {
    /// The TAP is attached under this name.
    Attached(String),
    /// Done.
    Done,
}

impl KeeperReply {
    /// The failure of a request `what` that got this reply, not the one it calls for.
    fn unexpected_for(&self, what: &'static str) -> Failure {
        let got = match self {
            KeeperReply::Attached(_) => "an attached TAP",
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

impl Drop for NetworkKeeper {
    fn drop(&mut self) {
        self.release();
    }
}

/// The keeper's side, on `stream` (its end of the pair): attaches on the first
/// request, binds the library's socket, confines itself, then serves the library
/// until its supervisor asks it to release, or is gone. The device is released in
/// every case (dropping the network), and the socket removed.
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
    let socket = cube_storage::SandboxDir::new(&dir).network_keeper_socket();
    let attached = JailNetwork::attach_tap(guest_mac, &options, &dir)
        .map_err(network_failure)
        .and_then(|network| {
            // A keeper of this sandbox before this one (a wake's) may have left it.
            let _ = std::fs::remove_file(&socket);
            let listener = UnixListener::bind(&socket)
                .map_err(|e| Failure::from(format!("binding {}: {e}", socket.display())))?;
            confine(Profile::NetworkKeeper, &dir).map_err(|e| {
                Failure::from(format!("confining the network keeper: {}", error_chain(&e)))
            })?;
            let tap = network
                .tap_name()
                .ok_or_else(|| Failure::from("the pool gave the VM no TAP"))?
                .to_string();
            Ok((network, listener, tap))
        });
    let (mut network, listener, tap) = match attached {
        Ok(attached) => attached,
        Err(failure) => {
            let _ = std::fs::remove_file(&socket);
            let _ = write_frame(&mut stream, &Err::<KeeperReply, _>(failure.clone()));
            return Err(failure);
        }
    };
    let served = write_frame(&mut stream, &Ok::<_, Failure>(KeeperReply::Attached(tap)))
        .map_err(fail)
        .map(|()| serve_attached(&mut stream, &listener, &mut network, &dir));
    // The keeper's Landlock lets it remove files of its sandbox's directory.
    let _ = std::fs::remove_file(&socket);
    served
}

/// Serves the library on `listener` and the supervisor on `stream` until the
/// supervisor asks for the release or is gone.
fn serve_attached(
    stream: &mut UnixStream,
    listener: &UnixListener,
    network: &mut JailNetwork,
    dir: &Path,
) {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a live array of two pollfd, its length passed with it.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if ready < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::warn!("network keeper: {}", std::io::Error::last_os_error());
            return;
        }
        if fds[0].revents != 0 {
            // A closed or broken pair is the supervisor gone: the network goes with it.
            let Ok(request) = read_frame::<KeeperRequest>(stream) else {
                return;
            };
            let answer: Result<KeeperReply, Failure> = match request {
                KeeperRequest::Attach { .. } => Err(Failure::new(
                    ErrorKind::BadState,
                    "the keeper holds a device already",
                )),
                KeeperRequest::Release => {
                    network.disconnect();
                    let _ = write_frame(stream, &Ok::<_, Failure>(KeeperReply::Done));
                    return;
                }
            };
            if write_frame(stream, &answer).is_err() {
                return;
            }
        }
        if fds[1].revents != 0 {
            if let Ok((conn, _)) = listener.accept() {
                serve_library(conn, network, dir);
            }
        }
    }
}

/// Serves one library connection: one request from a peer of the keeper's own uid,
/// about the keeper's own sandbox. Anything else is dropped or refused.
fn serve_library(mut conn: UnixStream, network: &mut JailNetwork, dir: &Path) {
    if !peer_is_own_uid(&conn) {
        tracing::warn!("network keeper: a request from another uid refused");
        return;
    }
    if conn.set_read_timeout(Some(CALL_TIMEOUT)).is_err() {
        return;
    }
    let call: KeeperCall = match read_frame(&mut conn) {
        Ok(call) => call,
        Err(ProtocolError::Decode(e)) => {
            let malformed = Failure::invalid(format!("malformed network request: {e}"));
            let _ = write_frame(&mut conn, &Response::Error(malformed));
            return;
        }
        Err(_) => return,
    };
    let response = if call.sandbox != dir {
        Response::Error(Failure::invalid(format!(
            "this network keeper holds the device of {}, not of {}",
            dir.display(),
            call.sandbox.display()
        )))
    } else {
        let answer = dispatch_network(network, call.request);
        answer.unwrap_or_else(Response::Error)
    };
    let _ = write_frame(&mut conn, &response);
}

/// Whether the process at the other end of `conn` runs as this process's uid.
fn peer_is_own_uid(conn: &UnixStream) -> bool {
    nix::sys::socket::getsockopt(&conn.as_fd(), nix::sys::socket::sockopt::PeerCredentials)
        .is_ok_and(|peer| peer.uid() == nix::unistd::geteuid().as_raw())
}

/// The library's side: sends `request` (a network request) to the network keeper of
/// the VM sandbox in `sandbox_dir`, if it has one (`None`: no keeper socket there;
/// the sandbox's supervisor holds its network, a jail's, or it has none). Only a
/// keeper running as this process's uid is believed: a socket in the sandbox's
/// directory served by anything else (its supervisor, which owns the directory) is
/// an error.
pub fn ask_keeper(sandbox_dir: &Path, request: &Request) -> Result<Option<Response>, ClientError> {
    let socket = cube_storage::SandboxDir::new(sandbox_dir).network_keeper_socket();
    let path = socket.display().to_string();
    let mut conn = match UnixStream::connect(&socket) {
        Ok(conn) => conn,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ClientError::Connect(path, e)),
    };
    if !peer_is_own_uid(&conn) {
        return Err(ClientError::Connect(
            path,
            std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "served by another uid than the network keeper's",
            ),
        ));
    }
    let call = KeeperCall {
        sandbox: sandbox_dir.to_path_buf(),
        request: request.clone(),
    };
    write_frame(&mut conn, &call)?;
    match read_frame(&mut conn)? {
        Response::Error(failure) => Err(ClientError::Remote(failure)),
        other => Ok(Some(other)),
    }
}
