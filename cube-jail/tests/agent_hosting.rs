//! What a jail needs to host an agent: read-only binds of host files, and a connected
//! socket passed in at a fixed descriptor number with nothing else leaking.

mod common;

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use cube_jail::{Jail, JailError, JailExit, ReadOnlyBind, Stdio};

#[test]
fn a_bound_host_file_is_visible_read_only() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let host = tmp.path().join("tool.sh");
    std::fs::write(&host, "#!/bin/sh\necho tool ran\n").unwrap();
    std::fs::set_permissions(&host, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut c = common::config(tmp.path(), "bind");
    c.binds.push(ReadOnlyBind {
        source: host.clone(),
        target: PathBuf::from("/.cube/tool.sh"),
    });
    let out = common::run_sh(
        &c,
        "/.cube/tool.sh; if echo x > /.cube/tool.sh; then echo WROTE; fi; \
         grep -c ' /.cube/tool.sh .*ro,' /proc/self/mountinfo",
    );
    assert_eq!(out.exit, JailExit::Exited(0), "{}", out.stderr);
    assert_eq!(out.stdout, "tool ran\n1\n", "{}", out.stderr);
    assert_eq!(
        std::fs::read_to_string(&host).unwrap(),
        "#!/bin/sh\necho tool ran\n"
    );
    assert!(!tmp.path().join("bind").exists());
}

#[test]
fn a_passed_socket_arrives_at_its_number_and_nothing_else_leaks() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // A descriptor without close-on-exec in the parent must still stay out.
    let leaky = std::fs::File::open("/dev/null").unwrap();
    let leaky_fd = std::os::fd::AsRawFd::as_raw_fd(&leaky);
    // SAFETY: clears FD_CLOEXEC on a descriptor this test owns.
    let cleared = unsafe { libc::fcntl(leaky_fd, libc::F_SETFD, 0) };
    assert_eq!(cleared, 0);
    let (mut ours, theirs) = UnixStream::pair().unwrap();
    let c = common::config(tmp.path(), "passfd");
    let script = "echo hello >&3; read line <&3; echo \"got $line\"; ls /proc/self/fd";
    let mut jail =
        Jail::spawn_with_fds(&c, &["/bin/sh", "-c", script], &[(theirs.as_fd(), 3)]).unwrap();
    drop(theirs);
    let mut buf = [0u8; 6];
    ours.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hello\n");
    ours.write_all(b"back\n").unwrap();
    let out = common::collect(&mut jail);
    jail.destroy().unwrap();
    assert_eq!(out.exit, JailExit::Exited(0), "{}", out.stderr);
    let mut lines = out.stdout.lines();
    assert_eq!(lines.next(), Some("got back"));
    // ls itself has 0-2, fd 3 and its own directory descriptor open; nothing else.
    let fds: Vec<u32> = lines.map(|l| l.parse().unwrap()).collect();
    assert!(fds.starts_with(&[0, 1, 2, 3]), "{fds:?}");
    assert!(
        fds.len() <= 5,
        "descriptors leaked into the sandbox: {fds:?}"
    );
    // The sandbox gone, our end sees EOF: no copy of its end lingers anywhere.
    let mut rest = Vec::new();
    assert_eq!(ours.read_to_end(&mut rest).unwrap(), 0);
    drop(leaky);
}

#[test]
fn passed_descriptor_numbers_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, _b) = UnixStream::pair().unwrap();
    let mut c = common::config(tmp.path(), "badfd");
    c.stdout = Stdio::Null;
    c.stderr = Stdio::Null;
    for fds in [vec![(a.as_fd(), 1)], vec![(a.as_fd(), 5), (a.as_fd(), 5)]] {
        assert!(matches!(
            Jail::spawn_with_fds(&c, &["/bin/true"], &fds),
            Err(JailError::InvalidPassedFd(_))
        ));
    }
    assert!(!tmp.path().join("badfd").exists());
}
