//! Escape attempts from inside a jail; each one must fail.

mod common;

use std::fs;
use std::os::unix::process::CommandExt;
use std::process::Command;

use cube_jail::{Jail, JailExit, Stdio};

#[test]
fn cannot_see_or_signal_host_processes() {
    if common::skip() {
        return;
    }
    let mut host_sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let host_pid = host_sleeper.id();
    let tmp = tempfile::tempdir().unwrap();
    let c = common::config(tmp.path(), "procs");
    let out = common::run_sh(
        &c,
        &format!(
            "ps -e -o pid= | wc -l; ls /proc | grep -c '^[0-9]'; \
             kill -9 {host_pid} && echo KILLED; kill -9 {me} && echo KILLED; \
             kill -9 -1; echo survived",
            me = std::process::id()
        ),
    );
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    // sh, ps and wc (and the pipe's subshell at most): nothing of the host.
    let ps_count: usize = lines[0].trim().parse().unwrap();
    assert!(
        ps_count <= 4,
        "ps sees {ps_count} processes: {}",
        out.stdout
    );
    let proc_count: usize = lines[1].trim().parse().unwrap();
    assert!(proc_count <= 4, "/proc lists {proc_count} processes");
    assert!(!out.stdout.contains("KILLED"), "{}", out.stdout);
    assert!(out.stdout.contains("survived"));
    assert!(out.stderr.contains("No such process"), "{}", out.stderr);
    assert!(
        host_sleeper.try_wait().unwrap().is_none(),
        "the host process was killed from inside the jail"
    );
    host_sleeper.kill().unwrap();
    host_sleeper.wait().unwrap();
}

#[test]
fn cannot_read_or_write_outside_the_sandbox() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // A host file the jail must neither read nor change (host /tmp is not the jail's).
    let secret = tmp.path().join("host-secret");
    fs::write(&secret, "secret").unwrap();
    let passwd_before = fs::read("/etc/passwd").unwrap();
    let c = common::config(tmp.path(), "fs");
    let probe = format!("/usr/cube-jail-probe-{}", std::process::id());
    let out = common::run_sh(
        &c,
        &format!(
            "cat {secret} && echo READ-SECRET; ls /root && echo SAW-ROOT; \
             cat /etc/shadow && echo READ-SHADOW; \
             echo x > {probe} && echo WROTE-USR; echo x >> /etc/passwd && echo WROTE-ETC; \
             echo x > /escape && echo WROTE-ROOT; \
             echo ok > /home/user/mine && echo ok > /tmp/mine && cat /home/user/mine /tmp/mine",
            secret = secret.display()
        ),
    );
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    for marker in [
        "READ-SECRET",
        "SAW-ROOT",
        "READ-SHADOW",
        "WROTE-USR",
        "WROTE-ETC",
        "WROTE-ROOT",
    ] {
        assert!(!out.stdout.contains(marker), "{marker}: {}", out.stdout);
    }
    assert_eq!(out.stdout, "ok\nok\n", "the writable layer works");
    assert_eq!(fs::read_to_string(&secret).unwrap(), "secret");
    assert_eq!(fs::read("/etc/passwd").unwrap(), passwd_before);
    assert!(!std::path::Path::new(&probe).exists());
    assert!(!std::path::Path::new("/escape").exists());
}

#[test]
fn module_loading_and_other_kernel_surface_fail_with_eperm() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    if common::skip_without_python() {
        return;
    }
    let c = common::config(tmp.path(), "sys");
    // Each call prints its errno. unshare(CLONE_NEWUSER) and keyctl are allowed to an
    // unprivileged process outside the jail, so EPERM there is the filter's doing.
    let script = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    print(name, r, ctypes.get_errno())
call("finit_module", 313, -1, b"", 0)
call("init_module", 175, None, 0, b"")
call("delete_module", 176, b"loop", 0)
call("unshare_user", 272, 0x10000000)
call("keyctl", 250, 0, -3, 0)
call("bpf", 321, 0, None, 0)
call("mount", 165, b"none", b"/tmp", b"tmpfs", 0, None)
call("x32_finit_module", 0x40000000 + 313, -1, b"", 0)
call("clone_newuser", 56, 0x10000000 | 17, None, None, None, None)
call("personality_no_aslr", 135, 0x0040000)
call("allowed_personality_query", 135, 0xffffffff)
"#;
    let mut jail = Jail::spawn(&c, &["/usr/bin/python3", "-c", script]).unwrap();
    let out = common::collect(&mut jail);
    jail.destroy().unwrap();
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    for line in out.stdout.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        if f[0].starts_with("allowed_") {
            assert_ne!(f[1], "-1", "{line}");
            continue;
        }
        let expected = if f[0].starts_with("x32") {
            libc::ENOSYS
        } else {
            libc::EPERM
        };
        assert_eq!(f[1], "-1", "{line}");
        assert_eq!(f[2], expected.to_string(), "{line}");
    }
    assert_eq!(out.stdout.lines().count(), 11, "{}", out.stdout);
}

#[test]
fn two_jails_cannot_see_each_others_files() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut a_cfg = common::config(tmp.path(), "a");
    a_cfg.stdout = Stdio::Null;
    a_cfg.stderr = Stdio::Null;
    let a = Jail::spawn(
        &a_cfg,
        &[
            "/bin/sh",
            "-c",
            "echo a > /home/user/a-secret; echo a > /tmp/a-secret; sleep 30",
        ],
    )
    .unwrap();
    let a_root = a.root_dir().unwrap().to_path_buf();
    // Wait until A has written (its home is a host directory).
    for _ in 0..500 {
        if a_root.join("home/user/a-secret").exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(a_root.join("home/user/a-secret").exists());
    let b_cfg = common::config(tmp.path(), "b");
    let out = common::run_sh(
        &b_cfg,
        &format!(
            "cat /home/user/a-secret && echo SAW; cat /tmp/a-secret && echo SAW; \
             cat {}/home/user/a-secret && echo SAW; ls /home/user | wc -l",
            a_root.display()
        ),
    );
    a.destroy().unwrap();
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    assert!(!out.stdout.contains("SAW"), "{}", out.stdout);
    assert_eq!(out.stdout.trim(), "0");
}

#[test]
fn network_is_loopback_only() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    if common::skip_without_python() {
        return;
    }
    let c = common::config(tmp.path(), "net");
    let script = r#"
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
c = socket.create_connection(s.getsockname(), timeout=2)
a, _ = s.accept(); c.sendall(b"ping"); print(a.recv(4).decode())
names = [l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]]
print(",".join(names))
try:
    socket.create_connection(("10.0.0.1", 80), timeout=2)
    print("REACHED")
except OSError as e:
    print("unreachable", e.errno)
"#;
    let mut jail = Jail::spawn(&c, &["/usr/bin/python3", "-c", script]).unwrap();
    let out = common::collect(&mut jail);
    jail.destroy().unwrap();
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines[0], "ping");
    assert_eq!(lines[1], "lo");
    assert_eq!(lines[2], format!("unreachable {}", libc::ENETUNREACH));
}

#[test]
fn host_wide_sockets_terminal_injection_and_peer_memory_are_refused() {
    if common::skip() || common::skip_without_python() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let c = common::config(tmp.path(), "surface");
    // Each line: name, result, errno. AF_VSOCK's port space and AF_ALG's crypto API
    // are host-wide kernel surface an unprivileged process outside a jail may use;
    // TIOCSTI works on one's own controlling terminal; the AIO, LDT and secret-memory
    // calls and another process's memory or descriptors (same uid) are allowed
    // outside. Inside, each must be refused by the filter.
    let script = r#"
import ctypes, os, fcntl, sys, termios
libc = ctypes.CDLL(None, use_errno=True)
def call(name, nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    print(name, r if r < 0 else 0, ctypes.get_errno())
def sock(name, family, kind, proto=0):
    ctypes.set_errno(0)
    fd = libc.socket(family, kind, proto)
    print(name, fd if fd < 0 else 0, ctypes.get_errno())
    if fd >= 0:
        os.close(fd)
sock("vsock", 40, 1)
sock("alg", 38, 5)
sock("netlink_audit", 16, 3, 9)
sock("netlink_generic", 16, 3, 16)
sock("allowed_unix", 1, 1)
sock("allowed_inet", 2, 2)
sock("allowed_netlink_route", 16, 3, 0)
buf = ctypes.create_string_buffer(16)
call("modify_ldt", 154, 0, buf, 16)
call("memfd_secret", 447, 0)
ctx = ctypes.c_ulong(0)
call("io_setup", 206, 1, ctypes.byref(ctx))
# TIOCSTI/TIOCLINUX on a terminal of the sandbox's own, made its controlling one.
master, slave = os.openpty()
sys.stdout.flush()
pid = os.fork()
if pid == 0:
    os.setsid()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    def ioctl(req, arg):
        ctypes.set_errno(0)
        r = libc.ioctl(slave, req, arg)
        return ctypes.get_errno() if r < 0 else 0
    a = ioctl(termios.TIOCSTI, b"x")
    b = ioctl(0x541C, b"\x00")
    print("tiocsti", -1 if a else 0, a, flush=True)
    print("tioclinux", -1 if b else 0, b, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
# Another process of the sandbox (here its parent): its memory and its descriptors.
parent = os.getpid()
r, w = os.pipe()
sys.stdout.flush()
pid = os.fork()
if pid == 0:
    os.close(r)
    local = ctypes.create_string_buffer(8)
    class iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    mine = iovec(ctypes.cast(local, ctypes.c_void_p), 8)
    theirs = iovec(ctypes.cast(buf, ctypes.c_void_p), 8)
    ctypes.set_errno(0)
    n = libc.syscall(310, parent, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
    e1 = ctypes.get_errno() if n < 0 else 0
    pidfd = os.pidfd_open(parent)
    ctypes.set_errno(0)
    n = libc.syscall(438, pidfd, 0, 0)
    e2 = ctypes.get_errno() if n < 0 else 0
    os.write(w, f"{e1} {e2}".encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
e1, e2 = os.read(r, 64).decode().split()
print("process_vm_readv", -1 if int(e1) else 0, e1)
print("pidfd_getfd", -1 if int(e2) else 0, e2)
"#;
    let mut jail = Jail::spawn(&c, &["/usr/bin/python3", "-c", script]).unwrap();
    let out = common::collect(&mut jail);
    jail.destroy().unwrap();
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    for line in out.stdout.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        if f[0].starts_with("allowed_") {
            assert_eq!(f[1], "0", "{line}");
            continue;
        }
        let expected = match f[0] {
            "vsock" | "alg" | "netlink_audit" | "netlink_generic" => libc::EAFNOSUPPORT,
            _ => libc::EPERM,
        };
        assert_eq!(f[1], "-1", "{line}");
        assert_eq!(f[2], expected.to_string(), "{line}");
    }
    assert_eq!(out.stdout.lines().count(), 14, "{}", out.stdout);
}

#[test]
fn per_user_kernel_limits_are_not_shared_with_other_sandboxes_or_the_hosts_nobody() {
    if common::skip() || common::skip_without_python() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // A takes every inotify instance its uid may have (fs.inotify.max_user_instances),
    // then holds them.
    let mut a_cfg = common::config(tmp.path(), "inotify-a");
    a_cfg.stderr = Stdio::Null;
    let hog = r#"
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < 100000:
    fd = libc.inotify_init()
    if fd < 0:
        break
    fds.append(fd)
print(len(fds), ctypes.get_errno(), flush=True)
time.sleep(30)
"#;
    let mut a = Jail::spawn(&a_cfg, &["/usr/bin/python3", "-c", hog]).unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(a.take_stdout().unwrap()),
        &mut line,
    )
    .unwrap();
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        fields[1],
        libc::EMFILE.to_string(),
        "A never ran out: {line}"
    );
    let one = "import ctypes; libc = ctypes.CDLL(None, use_errno=True); \
               fd = libc.inotify_init(); print(fd >= 0, ctypes.get_errno())";
    // B, another sandbox, still gets one.
    let b_cfg = common::config(tmp.path(), "inotify-b");
    let mut b = Jail::spawn(&b_cfg, &["/usr/bin/python3", "-c", one]).unwrap();
    let out = common::collect(&mut b);
    b.destroy().unwrap();
    // So does a host process running as nobody.
    let host = Command::new("/usr/bin/python3")
        .args(["-c", one])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    a.destroy().unwrap();
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    assert_eq!(out.stdout.trim(), "True 0", "sandbox B was refused");
    assert_eq!(
        String::from_utf8_lossy(&host.stdout).trim(),
        "True 0",
        "the host's nobody was refused: {}",
        String::from_utf8_lossy(&host.stderr)
    );
}
