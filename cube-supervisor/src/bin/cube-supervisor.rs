//! `cube-supervisor`: the per-sandbox process. Started by the library, never by hand.

use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use cube_supervisor::server::WarmFor;

const USAGE: &str = "usage: cube-supervisor --control-fd N [--scratch DIR] [--warm any|vm|jail] \
                     [--network] (started by the cube library), or \
                     cube-supervisor --network-keeper-fd N (started by a VM's supervisor)";

fn usage_exit(message: &str) -> ! {
    eprintln!("{message}{USAGE}");
    std::process::exit(2);
}

fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CUBE_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("info,netlink_packet_route=error")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// A networked VM's keeper (see `cube_supervisor::network_keeper`): it stays in its
/// supervisor's session, and ends when the supervisor lets it go or is gone.
fn keep_network(fd: &str) -> ! {
    let Some(fd) = fd.parse::<i32>().ok().filter(|fd| *fd >= 3) else {
        usage_exit("");
    };
    init_logging();
    // SAFETY: the supervisor passed us this descriptor (its socket pair's other end)
    // as `fd`, and nothing else in this process owns it.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    match cube_supervisor::network_keeper::serve(stream) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            tracing::error!("network keeper: {e}");
            std::process::exit(1);
        }
    }
}

fn main() {
    let mut fd = None;
    let mut scratch: Option<PathBuf> = None;
    let mut warm_for = WarmFor::Any;
    let mut network = false;
    let mut args = std::env::args().skip(1);
    let first: Vec<String> = std::env::args().skip(1).take(2).collect();
    if let [flag, fd] = first.as_slice() {
        if flag == cube_supervisor::network_keeper::KEEPER_FLAG {
            keep_network(fd);
        }
    }
    while let Some(flag) = args.next() {
        if flag == "--network" {
            network = true;
            continue;
        }
        match (flag.as_str(), args.next()) {
            ("--control-fd", Some(v)) => fd = v.parse::<i32>().ok(),
            ("--scratch", Some(v)) => scratch = Some(PathBuf::from(v)),
            ("--warm", Some(v)) => match v.parse() {
                Ok(w) => warm_for = w,
                Err(e) => usage_exit(&format!("{e}\n")),
            },
            _ => usage_exit(""),
        }
    }
    let Some(fd) = fd.filter(|fd| *fd >= 3) else {
        usage_exit("");
    };
    // Detach before any thread exists: the launcher exits, the supervisor is
    // re-parented and lives in its own session, so Ctrl-C in the creator's terminal
    // does not reach it.
    // SAFETY: single-threaded here; the child only continues ordinary Rust code.
    match unsafe { libc::fork() } {
        -1 => {
            eprintln!(
                "cube-supervisor: fork failed: {}",
                std::io::Error::last_os_error()
            );
            std::process::exit(1);
        }
        0 => {}
        _ => std::process::exit(0),
    }
    // SAFETY: setsid has no memory-safety preconditions.
    unsafe { libc::setsid() };
    init_logging();
    // SAFETY: the spawner passed us this descriptor (a connected unix stream) as `fd`
    // and nothing else in this process owns it.
    let control = unsafe { UnixStream::from_raw_fd(fd) };
    if let Err(e) = cube_supervisor::server::run(control, scratch.as_deref(), warm_for, network) {
        tracing::error!("supervisor: {}", cube_supervisor::error_report::chain(&e));
        std::process::exit(1);
    }
}
