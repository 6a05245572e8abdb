//! What the shim's tests share: a private containerd (Debian's package, its own root,
//! state, sockets and config, the shim on its PATH), and a busybox image built here
//! from `busybox-static` and imported as an OCI layout tarball the test writes; and,
//! for pods with a network of their own, a CNI network of the test's own (a bridge on
//! this host and Debian's CNI plugins).

#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// The app image: busybox, `sh` by default.
pub const IMAGE: &str = "docker.io/cube/busybox:1";
/// The pod sandbox (pause) image: the same layer, sleeping.
pub const PAUSE_IMAGE: &str = "docker.io/cube/pause:1";
/// The containerd namespace `ctr` tests use.
pub const NAMESPACE: &str = "cube-test";
/// The CRI plugin's namespace.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// The runtime type of the shim under test.
pub const RUNTIME: &str = "io.containerd.cubesandbox.v2";
const SHIM: &str = env!("CARGO_BIN_EXE_containerd-shim-cubesandbox-v2");

/// True (after saying why) where these tests cannot run.
pub fn skip() -> bool {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: containerd and jails need root");
        return true;
    }
    for tool in ["/usr/bin/containerd", "/usr/bin/ctr", "/bin/busybox"] {
        if !Path::new(tool).exists() {
            println!("skipped: {tool} is missing (scripts/setup.sh installs containerd and busybox-static)");
            return true;
        }
    }
    let bins = Path::new(SHIM).parent().unwrap();
    if !bins.join("cube-supervisor").exists() {
        println!(
            "skipped: {} is not built (cargo build --workspace)",
            bins.join("cube-supervisor").display()
        );
        return true;
    }
    if static_agent().is_none() {
        println!("skipped: no statically linked cube-agent (scripts/build-static.sh --musl cube-agent cube-agent --release)");
        return true;
    }
    false
}

/// The agent bound into container roots, which carry no C library of the host's: the
/// statically linked build (`scripts/build-static.sh`, run by the set-up).
pub fn static_agent() -> Option<PathBuf> {
    let bins = Path::new(SHIM).parent()?;
    let profile = bins.file_name()?;
    let built = bins
        .parent()?
        .join("static")
        .join(profile)
        .join("cube-agent");
    built.exists().then_some(built)
}

/// Runs `command` with `input` written to its standard input (a pipe, closed after
/// it unless `hold_open`, then closed once the command has ended); its output.
fn output_with_input(mut command: Command, input: &[u8], hold_open: bool) -> Output {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_vec();
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        let _ = stdin.write_all(&input);
        hold_open.then_some(stdin)
    });
    let out = child.wait_with_output().unwrap();
    drop(writer.join().unwrap());
    out
}

/// Where Debian's `containernetworking-plugins` puts the CNI plugins.
const CNI_PLUGINS: &str = "/usr/lib/cni";

/// A CNI network of the test's own: a bridge on this host holding the gateway
/// address (the host owns it; the plugins neither forward nor NAT beyond it: no
/// `isGateway`, no `ipMasq`), and Debian's `bridge` and `host-local` plugins giving
/// each pod an address in its /24 and a default route through the gateway. Traffic
/// to and from pods stays on this host. The bridge goes on drop.
pub struct PodNetwork {
    /// The bridge's name.
    pub bridge: String,
    /// The bridge's address, every pod's gateway.
    pub gateway: std::net::Ipv4Addr,
}

impl PodNetwork {
    /// Makes the bridge (a name and /24 no other test on this host uses) and writes
    /// the network's CNI configuration into `conf_dir`; `None` (said) where Debian's
    /// CNI plugins are not installed.
    fn create(conf_dir: &Path, ipam_dir: &Path) -> Option<PodNetwork> {
        if !Path::new(CNI_PLUGINS).join("bridge").exists() {
            println!(
                "skipped: no CNI plugins in {CNI_PLUGINS} (scripts/setup.sh installs containernetworking-plugins)"
            );
            return None;
        }
        let ip = |args: &[&str]| Command::new("ip").args(args).output().unwrap();
        let first = std::process::id() as usize % 250;
        for n in (0..250).map(|k| (first + k) % 250 + 1) {
            let bridge = format!("cubecni{n}");
            let gateway = std::net::Ipv4Addr::new(10, 234, n as u8, 1);
            // Taken by another test run: the next one.
            if !ip(&["link", "add", "name", &bridge, "type", "bridge"])
                .status
                .success()
            {
                continue;
            }
            let network = PodNetwork { bridge, gateway };
            assert!(ip(&[
                "addr",
                "add",
                &format!("{gateway}/24"),
                "dev",
                &network.bridge
            ])
            .status
            .success());
            assert!(ip(&["link", "set", &network.bridge, "up"]).status.success());
            let conf = format!(
                r#"{{"cniVersion": "0.4.0", "name": "cube-test-{n}", "plugins": [{{
  "type": "bridge", "bridge": "{bridge}", "isGateway": false, "ipMasq": false,
  "ipam": {{"type": "host-local", "dataDir": "{ipam}",
    "ranges": [[{{"subnet": "10.234.{n}.0/24", "gateway": "{gateway}"}}]],
    "routes": [{{"dst": "0.0.0.0/0", "gw": "{gateway}"}}]}}}}]}}"#,
                bridge = network.bridge,
                ipam = ipam_dir.display()
            );
            std::fs::write(conf_dir.join("10-cube-test.conflist"), conf).unwrap();
            return Some(network);
        }
        panic!("no free cubecniN bridge name on this host");
    }
}

impl Drop for PodNetwork {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}

/// Whether a process here may lower its OOM score (which takes CAP_SYS_RESOURCE),
/// tried in a shell of its own. Where it may not, the peer runtime, runc, fails every
/// pod, as the CRI gives a pod's pause container -998 ("failed to update
/// /proc/self/oom_score_adj: Permission denied" in its log, "can't get final child's
/// PID from pipe" in containerd's): the test's containerd then keeps OOM scores at or
/// above its own (`restrict_oom_score_adj`, as rootless containerd does), and says so.
fn may_lower_oom_scores() -> bool {
    let may = Command::new("sh")
        .args(["-c", "echo -1 > /proc/self/oom_score_adj"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !may {
        println!(
            "this host withholds CAP_SYS_RESOURCE from root: the test's containerd restricts OOM score adjustments (restrict_oom_score_adj) so that runc can start pods"
        );
    }
    may
}

/// A containerd of the test's own; stopped and its directory removed on drop.
pub struct Containerd {
    pub dir: tempfile::TempDir,
    pub store: PathBuf,
    child: Child,
    /// The CNI network its pods with a network of their own get, if it has one.
    pub pod_network: Option<PodNetwork>,
}

impl Containerd {
    /// Waits (10 s at most) for every mount under the test's directory to be gone;
    /// fails naming those left.
    pub fn assert_no_mounts_left(&self) {
        let prefix = self.dir.path().display().to_string();
        assert!(
            wait_until(Duration::from_secs(10), || mounts_under(&prefix).is_empty()),
            "mounts left: {:?}",
            mounts_under(&prefix)
        );
    }

    /// Starts one for a test of the VM engine: None, having said why, where the
    /// test is skipped ([`skip`]), this host has no KVM or the store no Cube guest
    /// kernel.
    pub fn start_for_vms() -> Option<Containerd> {
        Self::start_for_vms_with(false)
    }

    /// [`Containerd::start_for_vms`], its CRI pods with a network of their own on a
    /// [`PodNetwork`].
    pub fn start_for_vm_pods_on_a_network() -> Option<Containerd> {
        Self::start_for_vms_with(true)
    }

    fn start_for_vms_with(pod_network: bool) -> Option<Containerd> {
        if skip() {
            return None;
        }
        if !Path::new("/dev/kvm").exists() {
            println!("skipped: no /dev/kvm (VM containers need KVM)");
            return None;
        }
        let c = Containerd::start_with(pod_network)?;
        if cube_core::templates::cube_guest_kernel(&c.store).is_none() {
            println!("skipped: no Cube guest kernel in the store or /var/lib/cube (scripts/setup.sh builds it)");
            return None;
        }
        Some(c)
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    /// [`Containerd::start`], its CRI pods with a network of their own on a
    /// [`PodNetwork`]; `None` (said) where this host has no CNI plugins.
    pub fn start_on_a_pod_network() -> Option<Containerd> {
        Self::start_with(true)
    }

    /// Starts containerd with a CRI runtime handler `cube` for the shim and `runc`.
    pub fn start() -> Containerd {
        Self::start_with(false).unwrap()
    }

    /// [`Containerd::start`], with a [`PodNetwork`] for its pods where asked (`None`,
    /// said, where this host has no CNI plugins).
    fn start_with(pod_network: bool) -> Option<Containerd> {
        let dir = tempfile::Builder::new()
            .prefix("cube-containerd-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let d = dir.path();
        let store = d.join("cube-store");
        for sub in ["root", "state", "cni-bin", "cni-conf", "opt", "cube-store"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        let network = match pod_network {
            true => Some(PodNetwork::create(
                &d.join("cni-conf"),
                &d.join("cni-ipam"),
            )?),
            false => None,
        };
        let cni_bin = match network {
            Some(_) => PathBuf::from(CNI_PLUGINS),
            None => d.join("cni-bin"),
        };
        let config = format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[debug]
  level = "info"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = {restrict_oom}
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{d}/cni-conf"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.cube]
      runtime_type = "{RUNTIME}"
      pod_annotations = ["io.cubesandbox.*"]
"#,
            d = d.display(),
            cni_bin = cni_bin.display(),
            restrict_oom = !may_lower_oom_scores()
        );
        std::fs::write(d.join("config.toml"), config).unwrap();
        let bins = Path::new(SHIM).parent().unwrap().to_path_buf();
        let path = format!(
            "{}:{}",
            bins.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let log = std::fs::File::create(d.join("containerd.log")).unwrap();
        let child = Command::new("/usr/bin/containerd")
            .arg("--config")
            .arg(d.join("config.toml"))
            .env("PATH", path)
            .env("CUBE_HOME", &store)
            .env("CUBE_AGENT", static_agent().unwrap())
            .env("CUBE_SUPERVISOR", bins.join("cube-supervisor"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let c = Containerd {
            dir,
            store,
            child,
            pod_network: network,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !c.ctr(&["version"]).status.success() {
            assert!(
                Instant::now() < deadline,
                "containerd did not start:\n{}",
                c.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(c)
    }

    /// The Cube store the shim uses, opened to look at (it starts no supervisor).
    pub fn cube_store(&self) -> cube_core::Runtime {
        cube_core::Runtime::open(cube_core::RuntimeConfig {
            store_root: self.store.clone(),
            pool_size: 0,
            network_pool_size: 0,
            supervisor: Some("/nonexistent".into()),
        })
        .unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    /// `ctr` against this containerd, in the test namespace.
    pub fn ctr(&self, args: &[&str]) -> Output {
        self.ctr_in(NAMESPACE, args)
    }

    pub fn ctr_in(&self, namespace: &str, args: &[&str]) -> Output {
        self.ctr_command(namespace, args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// `ctr` with `args` against this containerd, in `namespace`.
    fn ctr_command(&self, namespace: &str, args: &[&str]) -> Command {
        let mut ctr = Command::new("/usr/bin/ctr");
        ctr.arg("--address")
            .arg(self.socket())
            .arg("--namespace")
            .arg(namespace)
            .args(args);
        ctr
    }

    /// `ctr`, started with a pipe on its standard input for the test to write to.
    pub fn ctr_fed(&self, args: &[&str]) -> Child {
        self.ctr_command(NAMESPACE, args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// `ctr` with `input` on its standard input (a pipe).
    pub fn ctr_with_input(&self, args: &[&str], input: &[u8]) -> Output {
        output_with_input(self.ctr_command(NAMESPACE, args), input, false)
    }

    /// `ctr` on a terminal of `rows` x `cols` (util-linux `script` makes it), `typed`
    /// typed into that terminal; what the terminal showed, and ctr's exit status.
    pub fn ctr_on_terminal(&self, args: &[&str], rows: u16, cols: u16, typed: &[u8]) -> Output {
        let mut line = format!(
            "stty rows {rows} cols {cols}; exec /usr/bin/ctr --address {} --namespace {NAMESPACE}",
            self.socket().display()
        );
        for arg in args {
            line.push_str(" '");
            line.push_str(&arg.replace('\'', "'\\''"));
            line.push('\'');
        }
        let mut script = Command::new("script");
        script.args(["--quiet", "--return", "--command", &line, "/dev/null"]);
        // Held open until ctr is done: script ends the session at its input's end.
        output_with_input(script, typed, true)
    }

    /// `ctr`, which must succeed; its standard output.
    pub fn ctr_ok(&self, args: &[&str]) -> String {
        let out = self.ctr(args);
        assert!(
            out.status.success(),
            "ctr {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Builds the busybox images and imports them into `namespace`.
    pub fn import_images(&self, namespace: &str) {
        let archive = self.dir.path().join("images.tar");
        if !archive.exists() {
            write_images(&archive);
        }
        let out = self.ctr_in(namespace, &["image", "import", archive.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "ctr image import: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // SAFETY: kill on a child we own.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        // Snapshot mounts containerd left under its root.
        let root = self.dir.path().display().to_string();
        if let Ok(mounts) = std::fs::read_to_string("/proc/self/mountinfo") {
            let mut points: Vec<&str> = mounts
                .lines()
                .filter_map(|l| l.split(' ').nth(4))
                .filter(|p| p.starts_with(&root))
                .collect();
            points.sort_by_key(|p| std::cmp::Reverse(p.len()));
            for p in points {
                let c = std::ffi::CString::new(p).unwrap();
                // SAFETY: a live C string.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            }
        }
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A layer tar: /bin/busybox with a link per applet, and the usual directories.
pub fn busybox_layer() -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    let dir = |b: &mut tar::Builder<Vec<u8>>, path: &str| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        b.append_data(&mut h, path, std::io::empty()).unwrap();
    };
    for d in [
        "bin", "etc", "tmp", "proc", "dev", "sys", "root", "home", "var",
    ] {
        dir(&mut builder, d);
    }
    let busybox = std::fs::read("/bin/busybox").unwrap();
    let mut h = tar::Header::new_gnu();
    h.set_mode(0o755);
    h.set_size(busybox.len() as u64);
    builder
        .append_data(&mut h, "bin/busybox", busybox.as_slice())
        .unwrap();
    let list = Command::new("/bin/busybox").arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet == "busybox" || applet.contains('/') || applet.is_empty() {
            continue;
        }
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_mode(0o777);
        h.set_size(0);
        builder
            .append_link(&mut h, format!("bin/{applet}"), "busybox")
            .unwrap();
    }
    let mut h = tar::Header::new_gnu();
    let passwd = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/sh\n";
    h.set_mode(0o644);
    h.set_size(passwd.len() as u64);
    builder
        .append_data(&mut h, "etc/passwd", &passwd[..])
        .unwrap();
    builder.into_inner().unwrap()
}

/// Writes an OCI image layout tarball holding [`IMAGE`] and [`PAUSE_IMAGE`].
pub fn write_images(path: &Path) {
    let layer = busybox_layer();
    let layer_digest = format!("sha256:{}", sha256_hex(&layer));
    let mut blobs: Vec<(String, Vec<u8>)> = vec![(layer_digest.clone(), layer.clone())];
    let mut manifests = Vec::new();
    for (name, cmd) in [
        (IMAGE, serde_json::json!(["sh"])),
        (PAUSE_IMAGE, serde_json::json!(["sleep", "86400"])),
    ] {
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": cmd, "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }))
        .unwrap();
        let config_digest = format!("sha256:{}", sha256_hex(&config));
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer.len()}],
        }))
        .unwrap();
        let manifest_digest = format!("sha256:{}", sha256_hex(&manifest));
        manifests.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest.len(),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": name.rsplit(':').next().unwrap(),
            },
        }));
        blobs.push((config_digest, config));
        blobs.push((manifest_digest, manifest));
    }
    let index =
        serde_json::to_vec(&serde_json::json!({"schemaVersion": 2, "manifests": manifests}))
            .unwrap();
    let mut out = tar::Builder::new(std::fs::File::create(path).unwrap());
    let mut add = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        out.append_data(&mut h, name, data).unwrap();
    };
    add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
    add("index.json", &index);
    for (digest, data) in &blobs {
        add(
            &format!("blobs/sha256/{}", digest.trim_start_matches("sha256:")),
            data,
        );
    }
    out.into_inner().unwrap();
}

/// Every mount point under `prefix`.
pub fn mounts_under(prefix: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| p.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

/// Waits until `f` holds, for up to `timeout`.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

/// Checks the output of the probe VM tests run in a container (`echo init=...;
/// echo kernel=$(uname -r); test -x /bin/busybox && echo image-root`): PID 1 is
/// Cube's agent, the kernel is not the host's, the root is the image's.
pub fn assert_ran_in_a_guest(stdout: &str) {
    let value = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key).map(str::to_string))
            .unwrap_or_else(|| panic!("no {key} in {stdout}"))
    };
    assert!(
        value("init=").contains("cube-agent"),
        "PID 1 is not Cube's agent: {stdout}"
    );
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_ne!(
        value("kernel="),
        host_kernel.trim(),
        "the command ran on the host's kernel: {stdout}"
    );
    assert!(stdout.contains("image-root"), "{stdout}");
}
