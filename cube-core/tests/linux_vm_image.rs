//! A Linux VM template built from a container image (an OCI layout the test writes:
//! static busybox, account files, and Env, WorkingDir and User in its config): its
//! sandboxes' commands start in the image's working directory with the image's
//! environment, as the image's user with its home, a variable or user an exec names
//! itself wins, what the file calls create belongs to that user, and the template's record keeps the image's defaults. An image whose
//! User it does not know fails to build, naming it. Skipped (with the reason) where
//! Cube's guest kernel or the static agent is missing.

#![allow(clippy::unwrap_used)] // helpers of this test file, not library code

mod common;

use std::time::Duration;

use cube_agent::protocol::{ExecRequest, UserSpec};
use cube_core::templates::{image_agent, MachineConfig, TreeSource, VmTemplateSpec};
use cube_core::testing::oci_image::{self, Compression::Plain, Entry};
use cube_core::{CreateOptions, Engine, Runtime, RuntimeConfig, Sandbox};
use cube_vmm::testing::cube_guest_kernel;

/// Runs `script` with the image's shell, the variables `env` and the user `user` set
/// by the exec itself; its standard output.
fn sh_with(
    sandbox: &Sandbox,
    script: &str,
    env: &[(&str, &str)],
    user: Option<UserSpec>,
) -> String {
    let request = ExecRequest {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        user,
        ..ExecRequest::default()
    };
    let out = sandbox.agent().unwrap().exec(request).unwrap();
    assert_eq!(out.exit.code, Some(0), "{script}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_vm_built_from_an_image_runs_commands_with_its_env_and_working_dir() {
    let Some(kernel) = cube_guest_kernel() else {
        return;
    };
    let agent = match image_agent::locate() {
        Ok(agent) => agent,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let layers = vec![oci_image::busybox_layer(&[
        Entry::Dir("app"),
        Entry::File("app/msg", b"from the image\n"),
        Entry::File(
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001:App:/home/app:/bin/sh\n",
        ),
        Entry::File("etc/group", b"root:x:0:\napp:x:1001:\nstaff:x:50:app\n"),
    ])
    .unwrap()];
    let config = oci_image::config(
        &["PATH=/bin", "GREETING=hello from the image", "EMPTY="],
        "/app",
        "app:staff",
        &layers,
    );
    let image = dir.path().join("image");
    oci_image::oci_layout(&image, &config, &layers, &[Plain]).unwrap();
    let rt = Runtime::open(RuntimeConfig {
        store_root: dir.path().join("store"),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some(common::supervisor()),
    })
    .unwrap();
    let spec = VmTemplateSpec {
        tree: TreeSource::Oci(image),
        kernel: Some(kernel),
        initrd: None,
        machine: MachineConfig {
            vcpus: 1,
            memory_bytes: 256 << 20,
            irqchip: true,
        },
        // A bound on a hung boot, not a timing assertion (emulated, it takes about
        // half a minute here).
        boot_timeout: Duration::from_secs(900),
        agent,
    };
    // The same image naming a user its /etc/passwd lacks: refused before any boot.
    let ghost_config = oci_image::config(&["PATH=/bin"], "/app", "ghost", &layers);
    let ghost_image = dir.path().join("ghost-image");
    oci_image::oci_layout(&ghost_image, &ghost_config, &layers, &[Plain]).unwrap();
    let ghost_spec = VmTemplateSpec {
        tree: TreeSource::Oci(ghost_image),
        ..spec.clone()
    };
    let err = rt
        .build_vm_template("ghost", &ghost_spec, &mut |_| {})
        .unwrap_err();
    let message = common::error_chain(&err);
    assert!(
        message.contains("user \"ghost\" is not in its /etc/passwd"),
        "{message}"
    );
    assert!(rt.templates().unwrap().iter().all(|t| t.name != "ghost"));

    let meta = rt.build_vm_template("app", &spec, &mut |_| {}).unwrap();
    assert_eq!(meta.engine, Engine::Vm);
    let process = meta.process.unwrap();
    assert_eq!(process.cwd.as_deref(), Some("/app"));
    assert!(process
        .env
        .contains(&("GREETING".into(), "hello from the image".into())));
    assert_eq!(process.user.as_deref(), Some("app:staff"));

    let sandbox = rt.create("app", CreateOptions::new(true)).unwrap();
    let script = "pwd; echo \"$GREETING\"; cat msg; echo \"[$EMPTY]\"";
    assert_eq!(
        common::workload::sh(&sandbox.agent().unwrap(), script),
        "/app\nhello from the image\nfrom the image\n[]\n"
    );
    let own = [("GREETING", "the exec's own")];
    assert_eq!(
        sh_with(&sandbox, "echo \"$GREETING\"", &own, None),
        "the exec's own\n"
    );
    // The image's user and group (named), its home from /etc/passwd.
    let who = "id -u; id -g; echo \"$HOME\"";
    assert_eq!(
        common::workload::sh(&sandbox.agent().unwrap(), who),
        "1000\n50\n/home/app\n"
    );
    let root = Some(UserSpec { uid: 0, gid: 0 });
    assert_eq!(sh_with(&sandbox, "id -u; id -g", &[], root), "0\n0\n");
    // What the file calls create is the image user's (the agent is root), so its
    // processes can change it: the new parent, the file, a directory made.
    let agent = sandbox.agent().unwrap();
    agent
        .write_file("/app/uploads/data.txt", &mut &b"uploaded\n"[..])
        .unwrap();
    agent.make_dir("/app/made", false).unwrap();
    let owners = "stat -c '%u:%g' /app/uploads /app/uploads/data.txt /app/made; \
                  echo more >> /app/uploads/data.txt && cat /app/uploads/data.txt";
    assert_eq!(
        common::workload::sh(&agent, owners),
        "1000:50\n1000:50\n1000:50\nuploaded\nmore\n"
    );
    sandbox.destroy().unwrap();
}
