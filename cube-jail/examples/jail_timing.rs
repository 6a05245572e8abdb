//! Measures jail spawn-to-exec, full lifecycle and pause/resume times on this host.
//!
//! `cargo run --release -p cube-jail --example jail_timing` (as root).

use std::time::{Duration, Instant};

use cube_jail::{Jail, JailConfig};

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tmp = std::env::temp_dir().join(format!("cube-jail-timing-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let runs = 20;
    let (mut spawn, mut wait, mut destroy) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..runs {
        let c = JailConfig::new(
            format!("timing-{}-{i}", std::process::id()),
            tmp.join(i.to_string()),
        );
        let t = Instant::now();
        let mut jail = Jail::spawn(&c, &["/bin/true"])?;
        spawn.push(t.elapsed());
        let t = Instant::now();
        jail.wait()?;
        wait.push(t.elapsed());
        let t = Instant::now();
        jail.destroy()?;
        destroy.push(t.elapsed());
    }
    println!(
        "spawn-to-exec of /bin/true, p50 over {runs}: {:?}",
        p50(spawn.clone())
    );
    println!(
        "  min {:?} max {:?}",
        spawn.iter().min().unwrap_or(&Duration::ZERO),
        spawn.iter().max().unwrap_or(&Duration::ZERO)
    );
    println!("exec-to-exit (wait), p50: {:?}", p50(wait));
    println!("destroy, p50: {:?}", p50(destroy));

    let c = JailConfig::new(
        format!("timing-{}-pause", std::process::id()),
        tmp.join("pause"),
    );
    let jail = Jail::spawn(&c, &["/bin/sh", "-c", "while :; do :; done"])?;
    let (mut pause, mut resume) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        jail.pause()?;
        pause.push(t.elapsed());
        let t = Instant::now();
        jail.resume()?;
        resume.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("freezer: {:?}", jail.cgroup().and_then(|c| c.freezer()));
    println!(
        "pause p50 over {runs}: {:?}, resume p50: {:?}",
        p50(pause),
        p50(resume)
    );
    jail.destroy()?;
    std::fs::remove_dir(&tmp)?;
    Ok(())
}
