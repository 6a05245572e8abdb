//! `cube-supervisor`: the per-sandbox process. Started by the library, never by hand.

use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (fd, scratch) = match args.as_slice() {
        [_, flag, fd] if flag == "--control-fd" => (fd.parse::<i32>().ok(), None),
        [_, flag, fd, scratch_flag, dir]
            if flag == "--control-fd" && scratch_flag == "--scratch" =>
        {
            (fd.parse::<i32>().ok(), Some(std::path::PathBuf::from(dir)))
        }
        _ => (None, None),
    };
    let Some(fd) = fd.filter(|fd| *fd >= 3) else {
        eprintln!(
            "usage: cube-supervisor --control-fd N [--scratch DIR] (started by the cube library)"
        );
        std::process::exit(2);
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CUBE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    // SAFETY: the spawner passed us this descriptor (a connected unix stream) as `fd`
    // and nothing else in this process owns it.
    let control = unsafe { UnixStream::from_raw_fd(fd) };
    if let Err(e) = cube_core::supervisor::server::run(control, scratch.as_deref()) {
        tracing::error!("supervisor: {e}");
        std::process::exit(1);
    }
}
