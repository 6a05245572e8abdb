//! Measures CRIU dump and restore of a jail running Python on this host, against the
//! floor of spawning the same Python jail from scratch, in the same run.
//!
//! `cargo run --release -p cube-jail --example checkpoint_timing` (as root, with a
//! working CRIU: scripts/setup-criu.sh).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use cube_jail::checkpoint::{self, DumpOptions};
use cube_jail::{Criu, Jail, JailConfig};

/// Reads requests from fd 3 and answers on fd 4; "x" holds 20 MB so the dump has
/// something to write.
const REPL: &str = r#"
import os
x = bytearray(os.urandom(1 << 20)) * 20
requests = os.fdopen(3, "rb", buffering=0)
replies = os.fdopen(4, "wb", buffering=0)
replies.write(b"ready\n")
while True:
    line = requests.readline()
    if not line:
        break
    replies.write((repr(len(x)) + "\n").encode())
"#;

struct Ends {
    writer: File,
    reader: BufReader<File>,
    theirs: [OwnedFd; 2],
}

fn pipes() -> Result<Ends, Box<dyn std::error::Error>> {
    let (req_r, req_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (rep_r, rep_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok(Ends {
        writer: File::from(req_w),
        reader: BufReader::new(File::from(rep_r)),
        theirs: [req_r, rep_w],
    })
}

fn ask(ends: &mut Ends) -> Result<String, Box<dyn std::error::Error>> {
    ends.writer.write_all(b"len\n")?;
    let mut line = String::new();
    ends.reader.read_line(&mut line)?;
    Ok(line.trim().to_owned())
}

fn percentile(v: &[Duration], p: f64) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn report(what: &str, v: &[Duration], floor: Duration) {
    let (p50, p95) = (percentile(v, 0.5), percentile(v, 0.95));
    println!(
        "{what:<34} p50 {:>7.1} ms  p95 {:>7.1} ms  p50/spawn {:.2}",
        p50.as_secs_f64() * 1e3,
        p95.as_secs_f64() * 1e3,
        p50.as_secs_f64() / floor.as_secs_f64()
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let criu = Criu::probe()?;
    println!("{} (CRIU {})", criu.path().display(), criu.version());
    let tmp = std::env::temp_dir().join(format!("cube-ckpt-timing-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let runs = 12;
    let (mut spawn, mut dump_live, mut dump_kill, mut restore) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let options = |leave_running| DumpOptions {
        leave_running,
        passed_fds: vec![3, 4],
    };
    for i in 0..runs {
        let config = JailConfig::new(
            format!("ckpt-{}-{i}", std::process::id()),
            tmp.join(format!("s{i}")),
        );
        let mut ends = pipes()?;
        // Spawn to first answer: the floor a restore competes with.
        let t = Instant::now();
        let fds = [(ends.theirs[0].as_fd(), 3), (ends.theirs[1].as_fd(), 4)];
        let jail = Jail::spawn_with_fds(&config, &["/usr/bin/python3", "-c", REPL], &fds)?;
        let mut ready = String::new();
        ends.reader.read_line(&mut ready)?;
        spawn.push(t.elapsed());

        let t = Instant::now();
        checkpoint::dump(&criu, &jail, &tmp.join(format!("live{i}")), &options(true))?;
        dump_live.push(t.elapsed());
        let t = Instant::now();
        checkpoint::dump(&criu, &jail, &tmp.join(format!("img{i}")), &options(false))?;
        dump_kill.push(t.elapsed());
        jail.destroy()?;

        // Restore to first answer.
        let mut fresh = pipes()?;
        let clone = JailConfig::new(
            format!("ckpt-{}-{i}-r", std::process::id()),
            tmp.join(format!("r{i}")),
        );
        let t = Instant::now();
        let fds = [(fresh.theirs[0].as_fd(), 3), (fresh.theirs[1].as_fd(), 4)];
        let restored = checkpoint::restore(&criu, &tmp.join(format!("img{i}")), &clone, &fds)?;
        let answer = ask(&mut fresh)?;
        restore.push(t.elapsed());
        assert_eq!(answer, (20u32 << 20).to_string());
        restored.destroy()?;
        std::fs::remove_dir_all(tmp.join(format!("live{i}")))?;
        std::fs::remove_dir_all(tmp.join(format!("img{i}")))?;
    }
    std::fs::remove_dir_all(&tmp)?;
    let floor = percentile(&spawn, 0.5);
    println!("python3 holding 20 MiB, {runs} runs:");
    report("spawn to first answer (floor)", &spawn, floor);
    report("dump, leave running", &dump_live, floor);
    report("dump, then exit", &dump_kill, floor);
    report("restore to first answer", &restore, floor);
    Ok(())
}
