//! The `cube` binary's frontend as users and scripts meet it: help with examples and
//! exit codes, completions, usage errors (exit 2), unknown things (exit 3), and files
//! in and out of a jail sandbox with `cp`, `ls`, `cat`, with every `--json` parsed.

// Helpers outside #[test] functions may panic too: a failure there is a test failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const CUBE: &str = env!("CARGO_BIN_EXE_cube");

fn cube(store: &Path, args: &[&str]) -> Output {
    Command::new(CUBE)
        .arg("--store")
        .arg(store)
        .args(args)
        .env_remove("CUBE_HOME")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(store: &Path, args: &[&str]) -> String {
    let out = cube(store, args);
    assert!(
        out.status.success(),
        "cube {args:?} failed ({:?}): {}",
        out.status.code(),
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn json(store: &Path, args: &[&str]) -> serde_json::Value {
    let out = ok(store, args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("cube {args:?}: not JSON ({e}): {out}"))
}

/// Runs `cube` expecting exit `code`; returns its standard error.
fn fails(store: &Path, args: &[&str], code: i32) -> String {
    let out = cube(store, args);
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "cube {args:?}: stdout {} stderr {stderr}",
        text(&out.stdout)
    );
    stderr
}

fn jail_skip() -> bool {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: jails need root (namespaces, mounts, cgroups)");
        return true;
    }
    if !cube_core::testing::cgroups_readable() {
        println!("skipped: no cgroup hierarchy is readable");
        return true;
    }
    for bin in ["cube-agent", "cube-supervisor"] {
        let path: PathBuf = Path::new(CUBE).with_file_name(bin);
        assert!(
            path.is_file(),
            "{} is missing: run the tests with -p cube-agent -p cube-supervisor -p cube-cli",
            path.display()
        );
    }
    false
}

#[test]
fn help_documents_exit_codes_and_examples() {
    let store = tempfile::tempdir().unwrap();
    let help = ok(store.path(), &["--help"]);
    for needle in ["Exit codes:", "124", "130", "not found", "Examples:"] {
        assert!(
            help.contains(needle),
            "cube --help lacks {needle:?}: {help}"
        );
    }
    for cmd in [
        &["sandbox", "cp", "--help"][..],
        &["sandbox", "ls", "--help"],
        &["sandbox", "cat", "--help"],
        &["sandbox", "inspect", "--help"],
        &["completions", "--help"],
    ] {
        let help = ok(store.path(), cmd);
        assert!(
            help.contains("Example"),
            "cube {cmd:?} has no example: {help}"
        );
    }
}

#[test]
fn completions_are_generated_for_each_shell() {
    let store = tempfile::tempdir().unwrap();
    let bash = ok(store.path(), &["completions", "bash"]);
    assert!(
        bash.contains("complete") && bash.contains("sandbox"),
        "{bash}"
    );
    let zsh = ok(store.path(), &["completions", "zsh"]);
    assert!(zsh.starts_with("#compdef cube"), "{zsh}");
    let fish = ok(store.path(), &["completions", "fish"]);
    assert!(fish.contains("complete -c cube"), "{fish}");
    // bash itself accepts the script.
    if Path::new("/bin/bash").exists() {
        let mut child = Command::new("/bin/bash")
            .args(["-n"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(bash.as_bytes())
            .unwrap();
        assert!(
            child.wait().unwrap().success(),
            "bash -n rejects the script"
        );
    }
    let err = fails(store.path(), &["completions", "tcsh"], 2);
    assert!(err.contains("invalid value"), "{err}");
}

#[test]
fn usage_errors_exit_2() {
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    // Missing arguments.
    fails(s, &["sandbox", "exec"], 2);
    fails(s, &["sandbox", "cp", "only-one"], 2);
    fails(s, &["sandbox", "cat", "sb-0000000000000000"], 2);
    fails(s, &["sandbox", "rm"], 2);
    fails(s, &["sandbox", "rollback", "sb-0000000000000000"], 2);
    let err = fails(s, &["sandbox", "limits", "sb-0000000000000000"], 2);
    assert!(
        err.contains("--memory-mib") && err.contains("--pids-max"),
        "{err}"
    );
    fails(
        s,
        &[
            "sandbox",
            "limits",
            "sb-0000000000000000",
            "--pids-max",
            "0",
        ],
        2,
    );
    // Bad flag values.
    fails(
        s,
        &["sandbox", "ls", "sb-0000000000000000", "/", "--depth", "0"],
        2,
    );
    fails(s, &["sandbox", "ls", "--depth", "2"], 2);
    fails(s, &["sandbox", "create", "--engine", "qemu"], 2);
    fails(s, &["sandbox", "create", "--env", "NOEQUALS"], 2);
    fails(
        s,
        &["sandbox", "clone", "sb-0000000000000000", "-n", "many"],
        2,
    );
    let err = fails(
        s,
        &[
            "sandbox",
            "exec",
            "sb-0000000000000000",
            "--timeout",
            "-1",
            "--",
            "true",
        ],
        2,
    );
    assert!(err.contains("--timeout must be a positive"), "{err}");
    fails(s, &["run", "--timeout", "0", "--", "true"], 2);
    // Impossible copies.
    let err = fails(s, &["sandbox", "cp", "/tmp/a", "/tmp/b"], 2);
    assert!(
        err.contains("ID:/path") && err.contains("cube sandbox ls"),
        "{err}"
    );
    let err = fails(s, &["sandbox", "cp", "sb-1:relative", "/tmp/b"], 2);
    assert!(err.contains("must be absolute"), "{err}");
    fails(s, &["sandbox", "cp", "sb-1:/a", "sb-2:/b"], 2);
    fails(s, &["no-such-command"], 2);
    // A malformed id (here a path given where the id goes) names nothing.
    let err = fails(s, &["sandbox", "ls", "/tmp"], 2);
    assert!(
        err.contains("Invalid sandbox") && err.contains("cube sandbox ls"),
        "{err}"
    );
    fails(s, &["sandbox", "inspect", "../etc"], 2);
}

#[test]
fn unknown_things_exit_3_with_what_to_do() {
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    let unknown = "sb-0000000000000000";
    for args in [
        &["sandbox", "inspect", unknown][..],
        &["sandbox", "inspect", unknown, "--json"],
        &["sandbox", "snapshots", unknown],
        &["sandbox", "cat", unknown, "/etc/hostname"],
        &["sandbox", "ls", unknown, "/"],
        &["sandbox", "cp", "sb-0000000000000000:/etc/hostname", "-"],
        &["sandbox", "code", unknown, "1"],
        &["sandbox", "exec", unknown, "--", "true"],
        &["sandbox", "pause", unknown],
        &["sandbox", "limits", unknown, "--pids-max", "9"],
    ] {
        let err = fails(s, args, 3);
        assert!(err.contains(unknown), "cube {args:?}: {err}");
        assert!(
            err.contains("hint: list sandboxes with `cube sandbox ls`"),
            "{err}"
        );
    }
    let err = fails(s, &["sandbox", "create", "no-such-template"], 3);
    assert!(err.contains("cube template ls"), "{err}");
    let err = fails(s, &["template", "rm", "no-such-template"], 3);
    assert!(err.contains("no-such-template"), "{err}");
    // A missing local source is "not found" too.
    fails(
        s,
        &["sandbox", "cp", "/nonexistent/cube-test", "sb-1:/tmp/x"],
        3,
    );
    // A store that does not exist.
    let missing = s.join("no-store-here");
    let err = fails(&missing, &["store", "info"], 3);
    assert!(err.contains("cube store setup"), "{err}");
    // Empty listings are valid JSON.
    assert_eq!(json(s, &["sandbox", "ls", "--json"]), serde_json::json!([]));
    assert_eq!(
        json(s, &["sandbox", "snapshots", "--json"]),
        serde_json::json!([])
    );
    let table = ok(s, &["sandbox", "ls"]);
    assert!(table.starts_with("ID "), "{table}");
    let info = json(s, &["store", "info", "--json"]);
    assert_eq!(info["store"], s.to_str().unwrap());
    assert!(
        info["reflink"].is_boolean() && info["filesystem"].is_string(),
        "{info}"
    );
    let templates = json(s, &["template", "ls", "--json"]);
    assert!(
        templates
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "host"),
        "{templates}"
    );
}

/// Removes the sandbox even when an assertion fails half-way.
struct Cleanup<'a>(&'a Path, String);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let _ = cube(self.0, &["sandbox", "rm", &self.1]);
    }
}

#[test]
fn a_jail_sandboxs_limits_change_while_it_runs() {
    if jail_skip() {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    let id = ok(s, &["sandbox", "create", "--pids-max", "64"])
        .trim()
        .to_string();
    let _cleanup = Cleanup(s, id.clone());
    let pids_max = || {
        let inspect = json(s, &["sandbox", "inspect", &id, "--json"]);
        let file = inspect["jail"]["cgroups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| Path::new(d.as_str().unwrap()).join("pids.max"))
            .find(|f| f.is_file());
        file.map(|f| std::fs::read_to_string(f).unwrap().trim().to_string())
    };
    if pids_max().is_none() {
        println!("skipped: no pids cgroup controller on this host");
        return;
    }
    assert_eq!(pids_max().as_deref(), Some("64"));
    ok(s, &["sandbox", "limits", &id, "--pids-max", "77"]);
    assert_eq!(pids_max().as_deref(), Some("77"));
    // The sandbox runs on, its other limits as they were.
    assert_eq!(
        ok(s, &["sandbox", "exec", &id, "--", "echo", "on"]).trim(),
        "on"
    );
}

#[test]
fn exec_tty_runs_a_command_on_a_terminal_of_the_sandboxs_own() {
    if jail_skip() {
        return;
    }
    if Command::new("script").arg("--version").output().is_err() {
        println!("skipped: util-linux's script is not installed (it makes the host terminal)");
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    let id = ok(s, &["sandbox", "create"]).trim().to_string();
    let _cleanup = Cleanup(s, id.clone());
    let settings = tempfile::tempdir().unwrap();
    let (before, after) = (
        settings.path().join("before"),
        settings.path().join("after"),
    );
    let cube_here = format!("{CUBE} --store {}", s.display());
    // In the sandbox: its terminal and size, a mark once the size is printed, then
    // wait for the resize, read a typed line, exit 5. On the host terminal (33 x 77,
    // made by script): once the mark is there, the window becomes 40 x 100.
    let inner = "tty; stty size; touch /tmp/sized; n=0; \
        while [ \"$(stty size)\" = '33 77' ] && [ $n -lt 200 ]; do n=$((n+1)); sleep 0.05; done; \
        stty size; read l; echo got:$l; exit 5";
    let line = format!(
        "stty rows 33 cols 77; stty -g > {before}; \
         (until {cube_here} sandbox cat {id} /tmp/sized >/dev/null 2>&1; do sleep 0.05; done; \
          stty rows 40 cols 100 < /dev/tty) & \
         {cube_here} sandbox exec --tty {id} -- sh -c \"{inner}\"; echo rc=$?; wait; \
         stty -g > {after}",
        before = before.display(),
        after = after.display(),
        inner = inner.replace('"', "\\\"").replace('$', "\\$"),
    );
    let mut script = Command::new("script")
        .args(["--quiet", "--command", &line, "/dev/null"])
        .env_remove("CUBE_HOME")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut typed = script.stdin.take().unwrap();
    typed.write_all(b"hi\n").unwrap();
    let out = script.wait_with_output().unwrap();
    drop(typed);
    let shown = text(&out.stdout);
    assert!(shown.contains("rc=5"), "{shown}");
    assert!(shown.contains("/dev/pts/"), "not on a terminal: {shown}");
    assert!(shown.contains("33 77"), "the host window's size: {shown}");
    assert!(
        shown.contains("40 100"),
        "the resize did not follow: {shown}"
    );
    assert!(shown.contains("got:hi"), "{shown}");
    assert_eq!(
        std::fs::read_to_string(&before).unwrap(),
        std::fs::read_to_string(&after).unwrap(),
        "the host terminal's settings were not put back"
    );
    // Without a terminal to drive it, --tty is a usage error that says so.
    let err = fails(s, &["sandbox", "exec", "--tty", &id, "--", "true"], 2);
    assert!(err.contains("--tty needs a terminal"), "{err}");
}

#[test]
fn files_go_in_and_out_of_a_jail_sandbox() {
    if jail_skip() {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    let id = ok(s, &["sandbox", "create", "--label", "suite=frontend"])
        .trim()
        .to_string();
    let _cleanup = Cleanup(s, id.clone());

    // Host → sandbox, a file larger than one agent chunk, into a directory.
    let local = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let src = local.path().join("blob.bin");
    std::fs::write(&src, &data).unwrap();
    ok(s, &["sandbox", "exec", &id, "--", "mkdir", "-p", "/tmp/in"]);
    ok(
        s,
        &[
            "sandbox",
            "cp",
            src.to_str().unwrap(),
            &format!("{id}:/tmp/in/"),
        ],
    );

    // ls with --json and --depth, and the table for people.
    let listed = json(s, &["sandbox", "ls", &id, "/tmp", "--depth", "2", "--json"]);
    let blob = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["path"] == "/tmp/in/blob.bin")
        .unwrap_or_else(|| panic!("no /tmp/in/blob.bin in {listed}"));
    assert_eq!(blob["kind"], "file");
    assert_eq!(blob["size"], data.len() as u64);
    let shallow = json(s, &["sandbox", "ls", &id, "/tmp", "--json"]);
    assert!(
        !shallow.to_string().contains("blob.bin"),
        "depth 1 went deeper: {shallow}"
    );
    let table = ok(s, &["sandbox", "ls", &id, "/tmp/in"]);
    assert!(
        table.contains("2.9 MiB") && table.contains("/tmp/in/blob.bin"),
        "{table}"
    );

    // Sandbox → host, into a directory and to a named file; cat and `cp ... -`.
    let back = tempfile::tempdir().unwrap();
    ok(
        s,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/tmp/in/blob.bin"),
            back.path().to_str().unwrap(),
        ],
    );
    assert!(std::fs::read(back.path().join("blob.bin")).unwrap() == data);
    let named = back.path().join("copy.bin");
    ok(
        s,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/tmp/in/blob.bin"),
            named.to_str().unwrap(),
        ],
    );
    assert!(std::fs::read(&named).unwrap() == data);
    let out = cube(s, &["sandbox", "cat", &id, "/tmp/in/blob.bin"]);
    assert!(out.status.success() && out.stdout == data);
    let out = cube(
        s,
        &["sandbox", "cp", &format!("{id}:/tmp/in/blob.bin"), "-"],
    );
    assert!(out.status.success() && out.stdout == data);

    // Standard input in.
    let mut child = Command::new(CUBE)
        .arg("--store")
        .arg(s)
        .args(["sandbox", "cp", "-", &format!("{id}:/tmp/from-stdin.txt")])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"piped\n").unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(
        ok(s, &["sandbox", "cat", &id, "/tmp/from-stdin.txt"]),
        "piped\n"
    );

    // Error paths inside a live sandbox.
    fails(s, &["sandbox", "cat", &id, "/tmp/no-such-file"], 3);
    let err = fails(
        s,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/tmp/in"),
            back.path().to_str().unwrap(),
        ],
        2,
    );
    assert!(err.contains("is a directory"), "{err}");
    fails(s, &["sandbox", "ls", &id, "/tmp/no-such-dir"], 3);
    // A failed download leaves no partial file behind.
    let partial = back.path().join("partial.bin");
    fails(
        s,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/tmp/nope"),
            partial.to_str().unwrap(),
        ],
        3,
    );
    assert!(!partial.exists());
    let leftovers: Vec<_> = std::fs::read_dir(back.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("cube-partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // inspect: JSON for scripts, a table for people; both name the labels.
    let inspect = json(s, &["sandbox", "inspect", &id, "--json"]);
    assert_eq!(inspect["id"], id.as_str());
    assert_eq!(inspect["engine"], "jail");
    assert_eq!(inspect["metadata"]["suite"], "frontend");
    assert!(inspect["created_unix"].as_u64().unwrap() > 0);
    let human = ok(s, &["sandbox", "inspect", &id]);
    assert!(
        human.contains("status") && human.contains("running") && human.contains("suite=frontend"),
        "{human}"
    );
    let listed = ok(s, &["sandbox", "ls"]);
    let row = listed.lines().find(|l| l.starts_with(&id)).unwrap();
    assert!(
        row.contains("running") && row.contains("suite=frontend"),
        "{listed}"
    );
    // Columns line up: every row's STATE starts where the header's does.
    let column = listed.lines().next().unwrap().find("STATE").unwrap();
    assert_eq!(&row[column..column + 7], "running", "{listed}");

    // Snapshots listed per sandbox, JSON parsed.
    let snap = json(s, &["sandbox", "snapshot", &id, "--json"]);
    let snaps = json(s, &["sandbox", "snapshots", &id, "--json"]);
    assert_eq!(snaps[0]["id"], snap["id"]);
    assert_eq!(snaps[0]["sandbox"], id.as_str());
    let table = ok(s, &["sandbox", "snapshots", &id]);
    assert!(
        table.contains(snap["id"].as_str().unwrap()) && table.contains("ago"),
        "{table}"
    );
}

/// Whether a link with this ifindex is on the host.
fn host_has_ifindex(index: u32) -> bool {
    std::fs::read_dir("/sys/class/net").unwrap().any(|e| {
        std::fs::read_to_string(e.unwrap().path().join("ifindex"))
            .is_ok_and(|i| i.trim() == index.to_string())
    })
}

/// An uplink for the test (198.51.100.1/24, its peer in a namespace of its own) and
/// the host's pool removed at the end when it was not there before.
struct NetLab {
    ns: String,
    uplink: String,
    pool_existed: bool,
}

impl Drop for NetLab {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.uplink])
            .status();
        if !self.pool_existed {
            if let Ok((pool, _lock)) = cube_core::testing::open_pool() {
                let _ = pool.destroy();
            }
        }
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(out.status.success(), "ip {args:?}: {}", text(&out.stderr));
}

#[test]
fn run_and_code_take_the_network_flags() {
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    // Checked before anything starts, root or not.
    let err = fails(s, &["run", "--allow-out", "10.0.0.1/8", "--", "true"], 2);
    assert!(err.contains("host bits"), "{err}");
    fails(s, &["run", "--expose", "0", "--", "true"], 2);
    fails(s, &["code", "--deny-out", "nowhere", "1"], 2);
    // A cell ends with its sandbox: nothing to serve a port from.
    fails(s, &["code", "--expose", "8000", "1"], 2);

    if jail_skip() {
        return;
    }
    if Command::new("ip").arg("-V").output().is_err() {
        println!("skipped: iproute2 (`ip`) is missing");
        return;
    }
    let pool = cube_core::testing::pool_name().unwrap();
    let pool_existed = cube_core::testing::pool_config(&pool)
        .bpffs
        .join("cube-net")
        .join(&pool)
        .exists();
    let tag = std::process::id() % 100_000;
    let lab = NetLab {
        ns: format!("cfout{tag}"),
        uplink: format!("cfu{tag}"),
        pool_existed,
    };
    ip(&["netns", "add", &lab.ns]);
    ip(&[
        "link",
        "add",
        &lab.uplink,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        &lab.ns,
    ]);
    ip(&["addr", "add", "198.51.100.1/24", "dev", &lab.uplink]);
    ip(&["link", "set", &lab.uplink, "up"]);
    ip(&["-n", &lab.ns, "link", "set", "eth0", "up"]);

    let names = "import socket; print(sorted(n for _, n in socket.if_nameindex()))";
    let out = cube(s, &["run", "--", "python3", "-c", names]);
    assert_eq!(text(&out.stdout).trim(), "['lo']", "{}", text(&out.stderr));
    let out = cube(s, &["run", "--network", "--", "python3", "-c", names]);
    if !out.status.success() && text(&out.stderr).contains("network pool") {
        println!(
            "skipped: the eBPF datapath cannot load here: {}",
            text(&out.stderr)
        );
        return;
    }
    assert_eq!(
        text(&out.stdout).trim(),
        "['eth0', 'lo']",
        "{}",
        text(&out.stderr)
    );
    // The sandbox's eth0 names its host end's ifindex (`eth0@ifN`); it goes with it.
    let link = ok(
        s,
        &["run", "--network", "--", "ip", "-o", "link", "show", "eth0"],
    );
    let host_end: u32 = link
        .split("@if")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{link}"));
    assert!(!host_has_ifindex(host_end), "{link}: host end left behind");
    let out = ok(
        s,
        &[
            "code",
            "--no-internet",
            "--deny-out",
            "203.0.113.0/24",
            "import socket; sorted(n for _, n in socket.if_nameindex())",
        ],
    );
    assert!(out.contains("['eth0', 'lo']"), "{out}");

    // A port exposed while the command runs, served on the host's uplink address.
    let port = 19000 + (tag % 900) as u16;
    let serve_one = "import socket\n\
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
        s.bind(('0.0.0.0', 8000)); s.listen(1)\n\
        c, _ = s.accept(); c.sendall(b'from the sandbox'); c.close()";
    let mut server = Command::new(CUBE)
        .arg("--store")
        .arg(s)
        .args(["run", "--timeout", "60", "--expose"])
        .arg(format!("{port}:8000"))
        .args(["--", "python3", "-c", serve_one])
        .env_remove("CUBE_HOME")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let answer = loop {
        use std::io::Read;
        let addr = std::net::SocketAddr::from(([198, 51, 100, 1], port));
        if let Ok(mut stream) =
            std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(500))
        {
            let mut answer = String::new();
            if stream.read_to_string(&mut answer).is_ok() && !answer.is_empty() {
                break answer;
            }
        }
        if std::time::Instant::now() > deadline {
            let _ = server.kill();
            let _ = server.wait();
            panic!("the exposed port was never served");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(answer, "from the sandbox");
    assert!(server.wait().unwrap().success());
    drop(lab);
}
