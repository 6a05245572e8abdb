//! The kubelet's path: a CRI client (k8s-cri's gRPC stubs) against the test's own
//! containerd, runtime handler `cube`: RunPodSandbox -> CreateContainer ->
//! StartContainer -> ExecSync -> StopPodSandbox -> RemovePodSandbox, the pod's process
//! inside a Cube sandbox (PID 1 is Cube's agent), in host-network pods. Then pod
//! start (RunPodSandbox + CreateContainer + StartContainer) timed for `cube` against
//! `runc` on the same containerd, p50/p95, printed. A pod
//! annotated `io.cubesandbox.engine: vm` is one VM whose guest runs every container.
//! Pods of the jail and VM engines stand on the pod's network: a CNI bridge of the
//! test's own on this host, traffic only between the node's side of it and the pod.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{skip, Containerd, CRI_NAMESPACE, IMAGE};
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, ExecSyncRequest, ImageSpec,
    LinuxContainerConfig, LinuxContainerResources, LinuxContainerSecurityContext,
    LinuxPodSandboxConfig, LinuxSandboxSecurityContext, Mount, NamespaceMode, NamespaceOption,
    PodSandboxConfig, PodSandboxMetadata, PodSandboxStatusRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StartContainerRequest, StopPodSandboxRequest,
    UpdateContainerResourcesRequest,
};
use tonic::transport::{Channel, Endpoint, Uri};

async fn connect(socket: PathBuf) -> RuntimeServiceClient<Channel> {
    let channel = Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .unwrap();
    RuntimeServiceClient::new(channel)
}

fn host_network() -> Option<NamespaceOption> {
    Some(NamespaceOption {
        network: NamespaceMode::Node as i32,
        ..Default::default()
    })
}

/// Namespace options of a pod (or its containers) on the pod network CNI sets up.
fn pod_network() -> Option<NamespaceOption> {
    Some(NamespaceOption {
        network: NamespaceMode::Pod as i32,
        ..Default::default()
    })
}

/// `config` with its namespace options `options`.
fn with_namespaces(
    mut config: ContainerConfig,
    options: Option<NamespaceOption>,
) -> ContainerConfig {
    if let Some(context) = config
        .linux
        .as_mut()
        .and_then(|l| l.security_context.as_mut())
    {
        context.namespace_options = options;
    }
    config
}

/// `config` with the pod network CNI sets up.
fn on_the_pods_network(mut config: PodSandboxConfig) -> PodSandboxConfig {
    if let Some(context) = config
        .linux
        .as_mut()
        .and_then(|l| l.security_context.as_mut())
    {
        context.namespace_options = pod_network();
    }
    config
}

/// Checks that `container` of `pod` is the pod on its network (`gateway`, the node's
/// side of it, is this host's): CNI's address and default route are its own, the
/// node reaches an HTTP server in it at the pod's address, and it reaches one on the
/// node at the gateway. Traffic stays on this host.
async fn assert_on_the_pods_network(
    client: &mut RuntimeServiceClient<Channel>,
    pod: &str,
    container: &str,
    gateway: std::net::Ipv4Addr,
) {
    let pod_ip: std::net::Ipv4Addr = client
        .pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: pod.into(),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .and_then(|s| s.network)
        .map(|n| n.ip)
        .unwrap_or_default()
        .parse()
        .unwrap_or_else(|e| panic!("the pod has no IPv4 address from CNI: {e}"));
    let (code, out, err) = exec_sync(
        client,
        container,
        // The server serves the pod's /etc (a jail pod's processes may not write
        // the image's root): its hostname file, which the CRI wrote.
        "ip -4 -o addr show dev eth0; ip -4 route show default; httpd -p 7777 -h /etc",
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("inet {pod_ip}/24")),
        "the pod's address {pod_ip} is not its own: {out}{err}"
    );
    assert!(
        out.contains(&format!("default via {gateway} dev eth0")),
        "the pod's route is not its own: {out}{err}"
    );
    let (code, hostname, err) = exec_sync(client, container, "cat /etc/hostname").await;
    assert!(code == 0 && !hostname.is_empty(), "{err}");
    let from_pod = http_get(std::net::SocketAddr::from((pod_ip, 7777)), "/hostname");
    assert_eq!(
        from_pod, hostname,
        "the node did not get the pod's hostname from the pod's address"
    );
    let node = std::net::TcpListener::bind((gateway, 0)).unwrap();
    let port = node.local_addr().unwrap().port();
    let server = std::thread::spawn(move || serve_one(&node, "from the node\n"));
    let (code, out, err) = exec_sync(
        client,
        container,
        &format!("wget -q -O - http://{gateway}:{port}/"),
    )
    .await;
    server.join().unwrap();
    assert_eq!(
        (code, out.as_str()),
        (0, "from the node\n"),
        "the pod did not reach the node: {err}"
    );
}

fn pod_config(name: &str) -> PodSandboxConfig {
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.into(),
            uid: format!("uid-{name}"),
            namespace: "default".into(),
            attempt: 0,
        }),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: host_network(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A host directory bound at `/shared`.
fn shared(host: &std::path::Path, readonly: bool) -> Vec<Mount> {
    vec![Mount {
        container_path: "/shared".into(),
        host_path: host.display().to_string(),
        readonly,
        ..Default::default()
    }]
}

/// Runs a pod of `config` with runtime handler `handler`; its id.
async fn run_pod(
    client: &mut RuntimeServiceClient<Channel>,
    config: &PodSandboxConfig,
    handler: &str,
) -> Result<String, String> {
    Ok(client
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.into(),
        })
        .await
        .map_err(|e| format!("RunPodSandbox ({handler}): {}", e.message()))?
        .into_inner()
        .pod_sandbox_id)
}

/// Runs a pod with one `sleep` container; returns (pod id, container id).
async fn start_pod(
    client: &mut RuntimeServiceClient<Channel>,
    name: &str,
    handler: &str,
    mounts: Vec<Mount>,
) -> Result<(String, String), String> {
    let config = pod_config(name);
    let pod = run_pod(client, &config, handler).await?;
    let container = start_container(client, &pod, &config, "main", &["sleep", "1000"], mounts)
        .await
        .map_err(|e| format!("{e} ({handler})"))?;
    Ok((pod, container))
}

/// Container `name` of the test image running `command` with `mounts`.
fn container_config(name: &str, command: &[&str], mounts: Vec<Mount>) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: IMAGE.into(),
            ..Default::default()
        }),
        command: command.iter().map(|a| a.to_string()).collect(),
        mounts,
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                namespace_options: host_network(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Creates and starts container `name` running `command` in `pod`; returns its id.
async fn start_container(
    client: &mut RuntimeServiceClient<Channel>,
    pod: &str,
    pod_config: &PodSandboxConfig,
    name: &str,
    command: &[&str],
    mounts: Vec<Mount>,
) -> Result<String, String> {
    start_container_with(
        client,
        pod,
        pod_config,
        container_config(name, command, mounts),
    )
    .await
}

/// Creates and starts the container `config` describes in `pod`; returns its id.
async fn start_container_with(
    client: &mut RuntimeServiceClient<Channel>,
    pod: &str,
    pod_config: &PodSandboxConfig,
    config: ContainerConfig,
) -> Result<String, String> {
    let container = client
        .create_container(CreateContainerRequest {
            pod_sandbox_id: pod.into(),
            config: Some(config),
            sandbox_config: Some(pod_config.clone()),
        })
        .await
        .map_err(|e| format!("CreateContainer: {}", e.message()))?
        .into_inner()
        .container_id;
    client
        .start_container(StartContainerRequest {
            container_id: container.clone(),
        })
        .await
        .map_err(|e| format!("StartContainer: {}", e.message()))?;
    Ok(container)
}

/// Runs `script` in `container` through ExecSync; (exit code, stdout, stderr).
async fn exec_sync(
    client: &mut RuntimeServiceClient<Channel>,
    container: &str,
    script: &str,
) -> (i32, String, String) {
    let exec = client
        .exec_sync(ExecSyncRequest {
            container_id: container.into(),
            cmd: vec!["sh".into(), "-c".into(), script.into()],
            timeout: 30,
        })
        .await
        .unwrap()
        .into_inner();
    (
        exec.exit_code,
        String::from_utf8_lossy(&exec.stdout).into_owned(),
        String::from_utf8_lossy(&exec.stderr).into_owned(),
    )
}

async fn remove_pod(client: &mut RuntimeServiceClient<Channel>, pod: &str) {
    client
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: pod.into(),
        })
        .await
        .unwrap();
    client
        .remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: pod.into(),
        })
        .await
        .unwrap();
}

/// Waits for the CRI plugin to know the imported images (it learns of them through
/// events): a probe pod is started and removed.
async fn wait_for_cri(client: &mut RuntimeServiceClient<Channel>, c: &Containerd) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match run_pod(client, &pod_config("probe"), "cube").await {
            Ok(pod) => {
                remove_pod(client, &pod).await;
                return;
            }
            Err(e) if Instant::now() < deadline => {
                eprintln!("waiting for the CRI plugin: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("{e}\n{}", c.log()),
        }
    }
}

/// Checks that `cube`'s store holds one sandbox, labelled with `pod`.
fn assert_one_sandbox_for(cube: &cube_core::Runtime, pod: &str) {
    let sandboxes = cube.list().unwrap();
    assert_eq!(
        sandboxes.len(),
        1,
        "one Cube sandbox for the pod: {sandboxes:?}"
    );
    assert_eq!(
        sandboxes[0]
            .metadata
            .get("kubernetes.pod")
            .map(String::as_str),
        Some(pod)
    );
}

/// Runs `test` on a CRI client of `c`'s containerd, once its CRI plugin knows the
/// imported images.
fn with_cri_client(c: &Containerd, test: impl AsyncFnOnce(RuntimeServiceClient<Channel>)) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = connect(c.socket()).await;
        wait_for_cri(&mut client, c).await;
        test(client).await;
    });
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

#[test]
fn a_cri_pod_runs_in_a_cube_sandbox() {
    if skip() {
        return;
    }
    let c = Containerd::start();
    c.import_images(CRI_NAMESPACE);
    // A volume: a host directory any uid may write (as the kubelet makes emptyDir).
    let volume_dir = tempfile::tempdir().unwrap();
    let volume = volume_dir.path().to_path_buf();
    std::fs::set_permissions(&volume, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    with_cri_client(&c, async |mut client| {
        let (pod, container) = start_pod(&mut client, "first", "cube", shared(&volume, false))
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", c.log()));
        let (code, out, err) = exec_sync(
            &mut client,
            &container,
            "tr '\\0' ' ' < /proc/1/cmdline; echo; echo exec-sync-ok; exit 5",
        )
        .await;
        assert_eq!(code, 5, "{out}{err}");
        assert!(out.contains("exec-sync-ok"), "{out}");
        assert!(
            out.contains("cube-agent"),
            "PID 1 is not Cube's agent: {out}"
        );
        // A second container of the pod: processes in the same sandbox (the same PID
        // namespace: each sees the other's processes), each in its own root.
        let side = start_container(
            &mut client,
            &pod,
            &pod_config("first"),
            "side",
            &["sh", "-c", "echo side > /side-marker; exec sleep 4242"],
            shared(&volume, true),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", c.log()));
        let (code, out, err) = exec_sync(
            &mut client,
            &container,
            // Each process of the sandbox that runs sleep, by its command line.
            "sleepers() { for p in /proc/[0-9]*; do \
                 c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); \
                 case \"$c\" in sleep*) echo \"$c\";; esac; done; }; \
             for i in $(seq 50); do sleepers | grep -q 4242 && break; sleep 0.1; done; \
             sleepers; test -e /side-marker && echo side root shows; true",
        )
        .await;
        assert_eq!(code, 0, "{out}{err}");
        assert!(
            out.contains("sleep 4242") && out.contains("sleep 1000"),
            "the pod's containers are not in one sandbox: {out}"
        );
        assert!(!out.contains("side root shows"), "roots are shared: {out}");
        let (code, out, err) = exec_sync(&mut client, &side, "cat /side-marker; ls /").await;
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.starts_with("side\n"), "{out}{err}");
        assert!(
            !out.contains(".cube"),
            "the sandbox's own root shows: {out}"
        );
        // A container on a terminal (a pod spec's `tty: true`): a terminal of its own in
        // the pod's sandbox, which its root shows, of the default size (no client
        // attached to resize it); its output goes to the container's log.
        let logs = tempfile::tempdir().unwrap();
        let logged = PodSandboxConfig {
            log_directory: logs.path().display().to_string(),
            ..pod_config("first")
        };
        start_container_with(
            &mut client,
            &pod,
            &logged,
            ContainerConfig {
                tty: true,
                log_path: "tty.log".into(),
                ..container_config(
                    "tty",
                    &["sh", "-c", "tty; stty size; echo tty-done; exec sleep 4343"],
                    Vec::new(),
                )
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", c.log()));
        let log = logs.path().join("tty.log");
        common::wait_until(Duration::from_secs(10), || {
            std::fs::read_to_string(&log).is_ok_and(|l| l.contains("tty-done"))
        });
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(text.contains("/dev/pts/"), "no terminal: {text}");
        assert!(text.contains("24 80"), "{text}");
        // A container of a pod has no sandbox of its own to resize: the refusal says
        // why (so the resources reached the shim in a shape it reads).
        let refused = client
            .update_container_resources(UpdateContainerResourcesRequest {
                container_id: side.clone(),
                linux: Some(LinuxContainerResources {
                    memory_limit_in_bytes: 256 << 20,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(
            refused.message().contains("its sandbox is the pod's"),
            "{}",
            refused.message()
        );
        let cube = c.cube_store();
        assert_one_sandbox_for(&cube, &pod);
        remove_pod(&mut client, &pod).await;
        assert!(
            common::wait_until(Duration::from_secs(10), || cube.list().unwrap().is_empty()),
            "the pod's Cube sandbox outlived RemovePodSandbox"
        );
        // The containers' root filesystems were unmounted on the host too.
        c.assert_no_mounts_left();

        // Pod start, cube against runc on the same containerd.
        let rounds = 8;
        let mut times: Vec<(&str, Vec<Duration>)> =
            vec![("cube", Vec::new()), ("runc", Vec::new())];
        let mut runc_failure = None;
        for round in 0..rounds {
            for (handler, samples) in &mut times {
                if *handler == "runc" && runc_failure.is_some() {
                    continue;
                }
                let start = Instant::now();
                match start_pod(
                    &mut client,
                    &format!("{handler}-{round}"),
                    handler,
                    Vec::new(),
                )
                .await
                {
                    Ok((pod, _)) => {
                        samples.push(start.elapsed());
                        remove_pod(&mut client, &pod).await;
                    }
                    // The peer is measured where it works; Cube must.
                    Err(e) if *handler == "runc" => runc_failure = Some(e),
                    Err(e) => panic!("{e}\n{}", c.log()),
                }
            }
        }
        let mut line = String::from(
            "CRI pod start (RunPodSandbox + CreateContainer + StartContainer), host network:",
        );
        let mut p50s = Vec::new();
        for (handler, samples) in &mut times {
            if samples.is_empty() {
                continue;
            }
            samples.sort();
            let (p50, p95) = (percentile(samples, 0.5), percentile(samples, 0.95));
            p50s.push(p50);
            line += &format!(
                " {handler} p50 {p50:.1} ms p95 {p95:.1} ms (n={});",
                samples.len()
            );
        }
        match (&runc_failure, p50s.as_slice()) {
            (None, [cube, runc]) => println!("{line} cube/runc p50 {:.2}x", cube / runc),
            (Some(why), _) => println!("{line} runc pods fail on this host, no ratio: {why}"),
            _ => println!("{line}"),
        }
        // Every Cube sandbox of the measured pods is gone.
        assert!(common::wait_until(Duration::from_secs(10), || cube
            .list()
            .unwrap()
            .is_empty()));
    });
}

/// Starts container `main` (`sleep`) in `pod`, on the pod's network; its id.
async fn start_main_on_the_pods_network(
    client: &mut RuntimeServiceClient<Channel>,
    c: &Containerd,
    pod: &str,
    config: &PodSandboxConfig,
) -> String {
    start_container_with(
        client,
        pod,
        config,
        with_namespaces(
            container_config("main", &["sleep", "1000"], Vec::new()),
            pod_network(),
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", c.log()))
}

#[test]
fn a_jail_pod_stands_on_the_pods_network() {
    if skip() {
        return;
    }
    let Some(c) = Containerd::start_on_a_pod_network() else {
        return;
    };
    let gateway = c.pod_network.as_ref().unwrap().gateway;
    c.import_images(CRI_NAMESPACE);
    with_cri_client(&c, async |mut client| {
        let config = on_the_pods_network(PodSandboxConfig {
            annotations: [("io.cubesandbox.engine".to_string(), "jail".to_string())].into(),
            ..pod_config("jail-net")
        });
        let pod = run_pod(&mut client, &config, "cube")
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", c.log()));
        let main = start_main_on_the_pods_network(&mut client, &c, &pod, &config).await;
        assert_on_the_pods_network(&mut client, &pod, &main, gateway).await;
        remove_pod(&mut client, &pod).await;
        let cube = c.cube_store();
        assert!(common::wait_until(Duration::from_secs(10), || cube
            .list()
            .unwrap()
            .is_empty()));
        c.assert_no_mounts_left();
    });
}

#[test]
fn a_vm_pod_runs_its_containers_in_one_guest_on_the_pods_network() {
    let Some(c) = Containerd::start_for_vm_pods_on_a_network() else {
        return;
    };
    let gateway = c.pod_network.as_ref().unwrap().gateway;
    c.import_images(CRI_NAMESPACE);
    with_cri_client(&c, async |mut client| {
        let config = on_the_pods_network(PodSandboxConfig {
            annotations: [("io.cubesandbox.engine".to_string(), "vm".to_string())].into(),
            ..pod_config("vm")
        });
        let started = Instant::now();
        let pod = run_pod(&mut client, &config, "cube")
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", c.log()));
        println!(
            "RunPodSandbox of a VM pod (template built from the pause image, guest booted): {:.1} s",
            started.elapsed().as_secs_f64()
        );
        let started = Instant::now();
        let main = start_main_on_the_pods_network(&mut client, &c, &pod, &config).await;
        println!(
            "CreateContainer + StartContainer in the VM pod (root copied into the guest): {:.2} s",
            started.elapsed().as_secs_f64()
        );
        // The guest is the pod on the pod's network.
        assert_on_the_pods_network(&mut client, &pod, &main, gateway).await;
        for line in c.log().lines().filter(|l| l.contains("root archive")) {
            println!("shim: {line}");
        }
        let (code, out, err) = exec_sync(
            &mut client,
            &main,
            "echo init=$(tr '\\0' ' ' < /proc/1/cmdline); echo kernel=$(uname -r); \
             test -x /bin/busybox && echo image-root; ls -a /; exit 5",
        )
        .await;
        assert_eq!(code, 5, "{out}{err}");
        common::assert_ran_in_a_guest(&out);
        assert!(
            !out.lines().any(|l| l.starts_with(".cube")),
            "the guest's own root shows: {out}"
        );
        // A second container: another root in the same guest (one PID namespace), run
        // as runAsUser/runAsGroup, its binds copied in as they are at create: a volume
        // (a host directory with a file) and the files the CRI adds (resolv.conf,
        // hostname, which the image lacks). One container for all of it: each copy
        // takes tens of seconds where the guest kernel is emulated.
        let volume = tempfile::tempdir().unwrap();
        std::fs::write(volume.path().join("note"), "from the host\n").unwrap();
        let mut side = with_namespaces(
            container_config("side", &["sleep", "4242"], shared(volume.path(), true)),
            pod_network(),
        );
        if let Some(context) = side
            .linux
            .as_mut()
            .and_then(|l| l.security_context.as_mut())
        {
            context.run_as_user = Some(k8s_cri::v1::Int64Value { value: 1000 });
            context.run_as_group = Some(k8s_cri::v1::Int64Value { value: 1001 });
        }
        let side = start_container_with(&mut client, &pod, &config, side)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", c.log()));
        let (code, out, err) = exec_sync(
            &mut client,
            &main,
            "for i in $(seq 100); do grep -qs 4242 /proc/[0-9]*/cmdline && break; sleep 0.1; done; \
             grep -ls 4242 /proc/[0-9]*/cmdline >/dev/null && echo side runs here; \
             test -e /shared && echo side root shows; true",
        )
        .await;
        assert_eq!(code, 0, "{out}{err}");
        assert!(
            out.contains("side runs here"),
            "the pod's containers are not in one guest: {out}{err}"
        );
        assert!(!out.contains("side root shows"), "roots are shared: {out}");
        let (code, out, err) = exec_sync(
            &mut client,
            &side,
            "id -u; id -g; cat /shared/note; \
             test -f /etc/resolv.conf && test -s /etc/hostname && echo cri-files",
        )
        .await;
        assert_eq!(
            (code, out.as_str()),
            (0, "1000\n1001\nfrom the host\ncri-files\n"),
            "{err}"
        );
        let cube = c.cube_store();
        assert_one_sandbox_for(&cube, &pod);
        remove_pod(&mut client, &pod).await;
        // The pod's sandbox, its template and the host mounts of its roots are gone.
        assert!(
            common::wait_until(Duration::from_secs(10), || cube.list().unwrap().is_empty()
                && cube
                    .templates()
                    .unwrap()
                    .iter()
                    .all(|t| !t.name.starts_with("ctr-"))),
            "left: {:?} {:?}",
            cube.list().unwrap(),
            cube.templates().unwrap()
        );
        c.assert_no_mounts_left();
    });
}

/// GETs `path` from the HTTP server at `to` (retrying its connect for 60 s: the
/// server has just been started in a guest); returns the body.
fn http_get(to: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut stream = loop {
        match std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5)) {
            Ok(stream) => break stream,
            Err(e) if Instant::now() > deadline => panic!("connecting to {to}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or(answer)
}

/// Answers one HTTP request on `listener` with `body` (waiting 60 s at most).
fn serve_one(listener: &std::net::TcpListener, body: &str) {
    use std::io::{BufRead, BufReader, Write};
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (stream, _) = loop {
        match listener.accept() {
            Ok(accepted) => break accepted,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => panic!("no request from the guest: {e}"),
        }
    };
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut reader = BufReader::new(&stream);
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap() > 0 && line != "\r\n" {
        line.clear();
    }
    write!(
        &stream,
        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
}
