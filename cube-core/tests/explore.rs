//! Temporary exploration.
mod common;
use common::*;
use std::time::Instant;

#[test]
fn explore() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let t = Instant::now();
    let tpl = env.template("t", NO_WORKING_SET);
    eprintln!("template {:?}", t.elapsed());
    let t = Instant::now();
    let mut sb = env.create(&tpl);
    eprintln!("create {:?} {:?}", t.elapsed(), sb.status().unwrap());
    let s1 = sb.snapshot().unwrap();
    eprintln!("s1 {:?}", s1.stats);
    sb.guest_dirty(8, 0x1000).unwrap();
    let s2 = sb.snapshot().unwrap();
    eprintln!("s2 {:?}", s2.stats);
    let a = std::fs::read(memory_file(&s1)).unwrap();
    let b = std::fs::read(memory_file(&s2)).unwrap();
    let d = differing_pages(&a, &b);
    let other: Vec<_> = d
        .iter()
        .filter(|p| !(16384..16384 + 2048).contains(*p))
        .map(|p| format!("{:#x}", p * 4096))
        .collect();
    eprintln!("differ {} other {:?}", d.len(), other);
    for p in &other {
        let _ = p;
    }
    let t = Instant::now();
    let ram = read_guest(&mut sb, 0, GUEST_MEMORY);
    eprintln!("read all {:?}", t.elapsed());
    let d = differing_pages(&ram, &b);
    eprintln!(
        "live vs s2: {:?}",
        d.iter()
            .map(|p| format!("{:#x}", p * 4096))
            .collect::<Vec<_>>()
    );
    sb.rollback(&s1.id).unwrap();
    sb.pause().unwrap();
    let ram = read_guest(&mut sb, 0, GUEST_MEMORY);
    let d = differing_pages(&ram, &a);
    eprintln!(
        "rolled vs s1: {:?}",
        d.iter()
            .map(|p| format!("{:#x}", p * 4096))
            .collect::<Vec<_>>()
    );
    for p in &d {
        let o = (*p * 4096) as usize;
        for w in 0..512 {
            let x = u64_at(&ram, (o + w * 8) as u64);
            let y = u64_at(&a, (o + w * 8) as u64);
            if x != y {
                eprintln!("  {:#x}+{:#x}: {:#x} vs {:#x}", o, w * 8, x, y);
            }
        }
    }
    // page tables diff s1 vs s2
    for p in [0x100u64, 0x101, 0x102] {
        let o = (p * 4096) as usize;
        for w in 0..512 {
            let x = u64_at(&b, (o + w * 8) as u64);
            let y = u64_at(&a, (o + w * 8) as u64);
            if x != y {
                eprintln!("  s2/s1 {:#x}+{:#x}: {:#x} vs {:#x}", o, w * 8, x, y);
            }
        }
    }
    let pid = env.track(&mut sb);
    drop(sb);
    eprintln!("ephemeral exit {}", wait_exit(pid, EXIT_WAIT));
    eprintln!("sandboxes {:?}", entries(&env.root().join("sandboxes")));
    eprintln!("snapshots {:?}", entries(&env.root().join("snapshots")));
}
