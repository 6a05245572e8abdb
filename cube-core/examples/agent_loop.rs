//! An agent loop on the `Sandbox` API: create a sandbox, run code cells, snapshot
//! before a risky step, roll back after it fails, then clone the sandbox to try three
//! alternatives in parallel and keep the best.
//!
//! Runs on the jail engine (the built-in `host` template), which needs root:
//!
//! ```text
//! cargo build -p cube-agent -p cube-core --bins --examples
//! sudo target/debug/examples/agent_loop
//! ```
//!
//! Without a working CRIU a jail's snapshots hold its files, not its processes: after
//! a rollback or in a clone the interpreter starts afresh, so the loop keeps its state
//! in files, as an agent that can be restarted should (with CRIU the interpreter comes
//! back too). They live under /home/user: /tmp is a private tmpfs, which only a full
//! snapshot holds.

use std::error::Error;
use std::time::{Duration, Instant};

use cube_agent::client::Client;
use cube_agent::protocol::{CodeResult, Language};
use cube_core::{CreateOptions, Runtime, RuntimeConfig, Sandbox, HOST_TEMPLATE};

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

/// Runs one Python cell in the sandbox's `main` context, making the context first
/// when the interpreter was restarted (new sandbox, rollback, clone).
fn cell(client: &Client, code: &str) -> Result<CodeResult> {
    if !client.list_contexts()?.iter().any(|c| c.name == "main") {
        client.create_context("main", Language::Python, Some("/home/user"))?;
    }
    Ok(client.run_code("main", code, Some(Duration::from_secs(30)))?)
}

fn show(step: &str, r: &CodeResult) {
    let out = r.stdout.trim_end();
    match (&r.error, &r.value) {
        (Some(e), _) => println!("{step}: raised {}: {}", e.name, e.value),
        (None, Some(v)) => println!(
            "{step}: {out}{}{v}",
            if out.is_empty() { "" } else { " / " }
        ),
        (None, None) => println!("{step}: {out}"),
    }
}

fn main() -> Result<()> {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipping: the jail engine needs root (namespaces, mounts, cgroups)");
        return Ok(());
    }
    // A throw-away store unless CUBE_HOME names one.
    let scratch = tempfile::tempdir()?;
    let store_root = std::env::var_os("CUBE_HOME")
        .map(Into::into)
        .unwrap_or_else(|| scratch.path().to_path_buf());
    let rt = Runtime::open(RuntimeConfig {
        store_root,
        pool_size: 0,
        network_pool_size: 0,
        supervisor: None,
    })?;

    let start = Instant::now();
    // Ephemeral: the sandbox ends with its handle, also if this program panics.
    let mut sb: Sandbox = rt.create(HOST_TEMPLATE, CreateOptions::new(true))?;
    println!(
        "created {} ({} engine) in {:?}",
        sb.id(),
        sb.engine(),
        start.elapsed()
    );

    // 1. Cells share a context: variables live from one cell to the next.
    let agent = sb.agent()?;
    show(
        "cell 1",
        &cell(
            &agent,
            "data = [5, 3, 8, 1]\nopen('/home/user/data.txt', 'w').write(repr(data))\nlen(data)",
        )?,
    );
    show("cell 2", &cell(&agent, "sum(data)")?);

    // 2. Snapshot before a step that may wreck the sandbox. (A full snapshot ends
    // agent connections: connect again.)
    drop(agent);
    let snap = sb.snapshot()?;
    println!("snapshot {} ({})", snap.id, snap.kind);
    let agent = sb.agent()?;
    let risky = cell(
        &agent,
        "import os\nos.remove('/home/user/data.txt')\nraise RuntimeError('the tool crashed half-way')",
    )?;
    show("risky step", &risky);
    drop(agent);

    // 3. It failed: roll back and find the file the step deleted.
    if risky.error.is_some() {
        sb.rollback(&snap.id)?;
        let agent = sb.agent()?;
        show(
            "after rollback",
            &cell(&agent, "import os\nos.path.exists('/home/user/data.txt'), open('/home/user/data.txt').read()")?,
        );
    }

    // 4. Clone three times and try an alternative in each, in parallel.
    let clone_start = Instant::now();
    let clones = rt.clone_sandbox(&mut sb, 3, 3, CreateOptions::new(true))?;
    println!(
        "cloned {} x{} in {:?}",
        sb.id(),
        clones.len(),
        clone_start.elapsed()
    );
    let strategies = [
        ("sorted()", "sorted(data)"),
        ("bubble sort", "xs = data[:]\nfor i in range(len(xs)):\n    for j in range(len(xs) - 1 - i):\n        if xs[j] > xs[j + 1]:\n            xs[j], xs[j + 1] = xs[j + 1], xs[j]\nxs"),
        ("wrong idea", "data.sort(key=str, reverse=True)\ndata"),
    ];
    let results: Vec<(String, &str, Result<CodeResult>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = clones
            .iter()
            .zip(strategies)
            .map(|(clone, (name, code))| {
                scope.spawn(move || {
                    let run = || -> Result<CodeResult> {
                        let agent = clone.agent()?;
                        // Each clone starts from the rolled-back files.
                        let load = cell(
                            &agent,
                            "import ast\ndata = ast.literal_eval(open('/home/user/data.txt').read())",
                        )?;
                        if let Some(e) = load.error {
                            return Err(format!("loading the data: {}: {}", e.name, e.value).into());
                        }
                        cell(&agent, code)
                    };
                    (clone.id().to_string(), name, run())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| ("?".into(), "?", Err("a worker panicked".into())))
            })
            .collect()
    });
    let expected = "[1, 3, 5, 8]";
    let mut winners = Vec::new();
    for (id, name, result) in &results {
        match result {
            Ok(r) => {
                show(&format!("{id} tried {name}"), r);
                if r.value.as_deref() == Some(expected) {
                    winners.push(*name);
                }
            }
            Err(e) => println!("{id} tried {name}: failed: {e}"),
        }
    }
    println!("strategies that sorted correctly: {winners:?}");
    for clone in clones {
        clone.destroy()?;
    }
    sb.destroy()?;
    println!("done in {:?}; all sandboxes destroyed", start.elapsed());
    if winners.len() != 2 {
        return Err(format!("expected two correct strategies, got {winners:?}").into());
    }
    Ok(())
}
