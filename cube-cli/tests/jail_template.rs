//! `cube template build` for the jail engine: a standalone Debian tree (debootstrap)
//! whose python3 and pip a sandbox runs instead of the host's; `template rm` refusing
//! a template in use; a directory template; the built-in host template unchanged.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const CUBE: &str = env!("CARGO_BIN_EXE_cube");

fn skip_jail() -> bool {
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

fn cube(store: &Path, args: &[&str]) -> Output {
    cube_command(store, args).output().unwrap()
}

/// `cube --store STORE ARGS`, standard input empty, not yet run.
fn cube_command(store: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(CUBE);
    command
        .arg("--store")
        .arg(store)
        .args(args)
        .stdin(Stdio::null());
    command
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(store: &Path, args: &[&str]) -> String {
    let out = cube(store, args);
    assert!(
        out.status.success(),
        "cube {args:?} failed: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Removes a sandbox when dropped, so a failing assertion leaves no jail behind.
struct Created<'a> {
    store: &'a Path,
    id: String,
}

impl<'a> Created<'a> {
    fn new(store: &'a Path, template: &str) -> Created<'a> {
        let id = ok(store, &["sandbox", "create", template])
            .trim()
            .to_string();
        Created { store, id }
    }
}

impl Drop for Created<'_> {
    fn drop(&mut self) {
        let _ = cube(self.store, &["sandbox", "rm", &self.id]);
    }
}

/// Whether the Debian mirror answers (the build downloads from it).
fn mirror_reachable() -> bool {
    use std::net::ToSocketAddrs;
    let Ok(mut addrs) = ("deb.debian.org", 80).to_socket_addrs() else {
        return false;
    };
    addrs.any(|a| {
        std::net::TcpStream::connect_timeout(&a, std::time::Duration::from_secs(5)).is_ok()
    })
}

#[test]
fn a_debian_template_runs_its_own_python_and_pip() {
    if skip_jail() {
        return;
    }
    if !Path::new("/usr/sbin/debootstrap").is_file() {
        println!("skipped: debootstrap is not installed (apt-get install debootstrap)");
        return;
    }
    if !mirror_reachable() {
        println!("skipped: the Debian mirror deb.debian.org is unreachable");
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    let built = ok(s, &["template", "build", "py"]);
    assert_eq!(built.trim(), "py");
    let listed: serde_json::Value =
        serde_json::from_str(&ok(s, &["template", "ls", "--json"])).unwrap();
    let py = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "py")
        .unwrap()
        .clone();
    assert_eq!(py["engine"], "jail", "{listed}");
    let tree = s.join("templates/py/rootfs");
    assert!(tree.join("usr/bin/python3").exists());
    // A marker only the template's tree has: the sandbox must see the template, not
    // the host.
    std::fs::write(tree.join("etc/cube-template-marker"), "py-template\n").unwrap();

    let sandbox = Created::new(s, "py");
    let id = sandbox.id.clone();
    let prefix = ok(
        s,
        &[
            "sandbox",
            "exec",
            &id,
            "--",
            "python3",
            "-c",
            "import sys; print(sys.prefix); print(open('/etc/cube-template-marker').read())",
        ],
    );
    assert!(
        prefix.contains("/usr") && prefix.contains("py-template"),
        "{prefix}"
    );
    let pip = ok(s, &["sandbox", "exec", &id, "--", "pip", "--version"]);
    // Debian's pip in the template names its own site-packages under /usr/lib.
    assert!(
        pip.starts_with("pip ") && pip.contains("/usr/lib/python3"),
        "{pip}"
    );
    // Writes land in the sandbox's layer, never in the template.
    let home = ok(
        s,
        &[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "echo x > \"$HOME/written-here\" && cat \"$HOME/written-here\" && echo \"$HOME\"",
        ],
    );
    let mut lines = home.lines();
    assert_eq!(lines.next(), Some("x"), "{home}");
    let home_dir = lines.next().unwrap().trim_start_matches('/').to_string();
    assert!(!tree.join(&home_dir).join("written-here").exists());

    // In use: rm refuses and names the sandbox; the template stays intact.
    let refused = cube(s, &["template", "rm", "py"]);
    assert!(!refused.status.success());
    let why = text(&refused.stderr);
    assert!(why.contains("in use") && why.contains(&id), "{why}");
    assert!(tree.join("usr/bin/python3").exists());

    drop(sandbox);
    ok(s, &["template", "rm", "py"]);
    assert!(!s.join("templates/py").exists());
    // The built-in host template keeps working next to built ones.
    let host = ok(s, &["run", "--", "python3", "-c", "print(6*7)"]);
    assert_eq!(host.trim(), "42");
}

#[test]
fn a_directory_template_and_failed_builds_leave_nothing() {
    if skip_jail() {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    // A failing Debian build (a mirror nothing listens on) leaves no template and no
    // scratch behind.
    if Path::new("/usr/sbin/debootstrap").is_file() {
        let out = cube(
            s,
            &[
                "template",
                "build",
                "broken",
                "--mirror",
                "http://127.0.0.1:9/debian",
            ],
        );
        assert!(!out.status.success());
        assert!(!s.join("templates/broken").exists());
        assert_eq!(std::fs::read_dir(s.join("tmp")).unwrap().count(), 0);
    }
    let bad = cube(s, &["template", "build", "x", "--packages", "--evil"]);
    assert!(!bad.status.success());
    assert!(!s.join("templates/x").exists());

    // A tree the agent cannot start in is refused at build time, not at create. The
    // agent is the workspace's own, beside `cube`, linked dynamically: an empty tree
    // has no C library for it. (A statically linked one, which `CUBE_AGENT` may name,
    // starts anywhere.)
    let empty = tempfile::tempdir().unwrap();
    let refused = cube_command(
        s,
        &[
            "template",
            "build",
            "empty",
            "--from",
            empty.path().to_str().unwrap(),
        ],
    )
    .env_remove("CUBE_AGENT")
    .output()
    .unwrap();
    assert!(!refused.status.success());
    assert!(
        text(&refused.stderr).contains("cannot start"),
        "{}",
        text(&refused.stderr)
    );
    assert!(!s.join("templates/empty").exists());

    // A minimal tree: a shell and the C library the agent and the shell need (the
    // agent itself is bound in by the jail), plus a marker only this tree has.
    let src = tempfile::tempdir().unwrap();
    let root = src.path();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/marker"), "from-dir\n").unwrap();
    let agent = Path::new(CUBE).with_file_name("cube-agent");
    let ldd = Command::new("ldd")
        .arg(&agent)
        .arg("/bin/dash")
        .output()
        .unwrap();
    let mut files: Vec<String> = vec!["/bin/dash".into()];
    for word in text(&ldd.stdout).split_whitespace() {
        if word.starts_with('/') && Path::new(word).is_file() {
            files.push(word.to_string());
        }
    }
    for f in &files {
        let real = std::fs::canonicalize(f).unwrap();
        let dest = root.join(f.trim_start_matches('/'));
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(&real, &dest).unwrap();
    }
    std::os::unix::fs::symlink("dash", root.join("bin/sh")).unwrap();
    ok(
        s,
        &["template", "build", "dir", "--from", root.to_str().unwrap()],
    );
    let sandbox = Created::new(s, "dir");
    let id = sandbox.id.clone();
    let out = ok(
        s,
        &[
            "sandbox",
            "exec",
            &id,
            "--",
            "/bin/sh",
            "-c",
            "read line < /etc/marker; echo \"$line\"",
        ],
    );
    assert_eq!(out.trim(), "from-dir");

    // A clone runs on the same template tree, with the source's layer: it sees both
    // the template's marker and the file written before the clone, and it keeps the
    // template in use on its own.
    ok(
        s,
        &[
            "sandbox",
            "exec",
            &id,
            "--",
            "/bin/sh",
            "-c",
            "echo kept > \"$HOME/note\"",
        ],
    );
    let clone = Created {
        store: s,
        id: ok(s, &["sandbox", "clone", &id]).trim().to_string(),
    };
    let seen = ok(
        s,
        &[
            "sandbox",
            "exec",
            &clone.id,
            "--",
            "/bin/sh",
            "-c",
            "read a < /etc/marker; read b < \"$HOME/note\"; echo \"$a $b\"",
        ],
    );
    assert_eq!(seen.trim(), "from-dir kept");
    drop(sandbox);
    let refused = cube(s, &["template", "rm", "dir"]);
    assert!(
        text(&refused.stderr).contains(&clone.id),
        "{}",
        text(&refused.stderr)
    );
    drop(clone);
    ok(s, &["template", "rm", "dir"]);
    let host = cube(s, &["template", "rm", "host"]);
    assert!(!host.status.success());
}

#[test]
fn an_interrupted_debian_build_leaves_nothing() {
    use std::os::unix::process::CommandExt;
    if skip_jail() {
        return;
    }
    if !Path::new("/usr/sbin/debootstrap").is_file() {
        println!("skipped: debootstrap is not installed (apt-get install debootstrap)");
        return;
    }
    if !mirror_reachable() {
        println!("skipped: the Debian mirror deb.debian.org is unreachable");
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    // Its own process group, interrupted as a terminal's Ctrl-C does: every process of
    // the group (cube and debootstrap) gets SIGINT.
    let child = Command::new(CUBE)
        .arg("--store")
        .arg(s)
        .args(["template", "build", "x"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    // Until debootstrap has started writing its tree.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let building = || {
        std::fs::read_dir(s.join("tmp"))
            .map(|d| d.count() > 0)
            .unwrap_or(false)
    };
    while !building() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_secs(2));
    let pgid = i32::try_from(child.id()).unwrap();
    // SAFETY: signalling the process group this test created.
    unsafe { libc::kill(-pgid, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let why = text(&out.stderr);
    assert!(
        why.contains("interrupted") && why.contains("nothing was kept"),
        "{why}"
    );
    assert!(!s.join("templates/x").exists());
    assert_eq!(std::fs::read_dir(s.join("tmp")).unwrap().count(), 0);
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(s.to_str().unwrap()), "{mounts}");
}

#[test]
fn a_template_from_a_docker_save_archive_keeps_the_images_env_and_workdir() {
    if skip_jail() {
        return;
    }
    let Some(agent) = cube_core::testing::static_agent() else {
        println!("skipped: no statically linked cube-agent (scripts/build-static.sh --musl cube-agent cube-agent --release)");
        return;
    };
    if !Path::new("/bin/busybox").is_file() {
        println!("skipped: /bin/busybox is missing (scripts/setup.sh installs busybox-static)");
        return;
    }
    use cube_core::testing::oci_image::{self, Compression::Plain, Entry};
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    let files = tempfile::tempdir().unwrap();
    let layers = vec![
        oci_image::busybox_layer(&[Entry::File("etc/msg", b"base")]).unwrap(),
        oci_image::layer(&[Entry::File("etc/msg", b"top")]).unwrap(),
    ];
    let config = oci_image::config(&["PATH=/bin", "GREETING=hi"], "/app", "", &layers);
    let saved = files.path().join("saved.tar");
    oci_image::docker_save(&saved, &config, &layers).unwrap();
    let run = |args: &[&str]| {
        Command::new(CUBE)
            .env("CUBE_AGENT", &agent)
            .arg("--store")
            .arg(s)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };

    let out = run(&[
        "template",
        "build",
        "img",
        "--from-oci",
        saved.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "img");
    let out = run(&["sandbox", "create", "img"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let id = text(&out.stdout).trim().to_string();
    let out = run(&[
        "sandbox",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "pwd; echo $GREETING; cat /etc/msg",
    ]);
    let _ = run(&["sandbox", "rm", &id]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "/app\nhi\ntop");

    // An image whose layer is not what its digest says: refused as bad input (exit 2),
    // nothing kept.
    let layout = files.path().join("layout");
    let digests = oci_image::oci_layout(&layout, &config, &layers, &[Plain, Plain]).unwrap();
    let blob = layout
        .join("blobs/sha256")
        .join(digests[1].trim_start_matches("sha256:"));
    let mut data = std::fs::read(&blob).unwrap();
    data[520] ^= 1;
    std::fs::write(&blob, data).unwrap();
    let out = run(&[
        "template",
        "build",
        "bad",
        "--from-oci",
        layout.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("does not match its digest"),
        "{}",
        text(&out.stderr)
    );
    assert!(!s.join("templates/bad").exists());
    ok(s, &["template", "rm", "img"]);
}
