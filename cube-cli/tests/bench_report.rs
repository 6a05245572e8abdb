//! `cube bench --report`: reports in the shapes the benches write become a page whose
//! five charts are all drawn, checked in the HTML itself and, where Chromium is
//! installed, as headless Chromium renders it (scripts/check-report.sh: screenshot
//! size, drawn elements per chart in the DOM).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use serde_json::json;

const CUBE: &str = env!("CARGO_BIN_EXE_cube");

/// A lifecycle report as `cube bench --json` (`engine` "vm") or `cube bench --engine
/// jail --json` writes it, the fields the page reads.
fn lifecycle(engine: &str, scale: f64) -> serde_json::Value {
    let mut r = json!({
        "engine": engine,
        "create_from_template": [
            {"concurrency": 1, "n": 10, "p50_ms": 3.0 * scale, "p95_ms": 6.0 * scale, "throughput_per_s": 90.0},
            {"concurrency": 2, "n": 10, "p50_ms": 4.0 * scale, "p95_ms": 9.0 * scale, "throughput_per_s": 140.0}
        ],
        "snapshot_vs_dirty": [
            {"dirty_mib": 0, "snapshot_ms": 5.0 * scale, "source_paused_ms": 5.0 * scale},
            {"dirty_mib": 100, "snapshot_ms": 60.0 * scale, "source_paused_ms": 58.0 * scale},
            {"dirty_mib": 1024, "snapshot_ms": 600.0 * scale, "source_paused_ms": 590.0 * scale}
        ],
        "source_paused_means": "stopped for the whole snapshot",
        "rollback_ms": 12.0 * scale,
        "clone": [{"n": 1, "concurrency": 1, "wall_ms": 20.0 * scale, "per_clone_ms": 20.0 * scale}],
        "pause_ms": 0.2,
        "resume_ms": 0.1,
        "hibernate_ms": 40.0 * scale,
        "wake_ms": 30.0 * scale,
        "memory_overhead_mib_per_sandbox": 6.5,
        "memory_overhead_sandboxes": 20,
        "memory_pss_mib_per_sandbox": 5.0
    });
    if engine == "jail" {
        r["full_state"] = json!({
            "snapshot": {"p50_ms": 45.0, "p95_ms": 60.0},
            "rollback": {"p50_ms": 50.0, "p95_ms": 70.0},
            "clone": {"p50_ms": 70.0, "p95_ms": 90.0},
            "hibernate": {"p50_ms": 40.0, "p95_ms": 50.0},
            "wake": {"p50_ms": 45.0, "p95_ms": 55.0}
        });
    }
    r
}

/// A `cube bench --scaling --json` report.
fn scaling(engine: &str) -> serde_json::Value {
    let rows: Vec<serde_json::Value> = [1, 2, 4, 8, 16, 32, 64]
        .iter()
        .map(|c| {
            json!({"concurrency": c, "n": 20.max(4 * c), "p50_ms": 3.0 + *c as f64,
                   "p95_ms": 6.0 + 2.0 * *c as f64, "throughput_per_s": 100.0 + *c as f64})
        })
        .collect();
    json!({
        "kind": "scaling",
        "engine": engine,
        "create_from_template": rows,
        "density": [
            {"sandboxes": 100, "used_mib": 900.0, "used_mib_per_sandbox": 9.0, "pss_mib_per_sandbox": 7.0, "fit_in_host": 2400},
            {"sandboxes": 500, "used_mib": 4600.0, "used_mib_per_sandbox": 9.2, "pss_mib_per_sandbox": 7.1, "fit_in_host": 2350}
        ]
    })
}

fn write(dir: &Path, name: &str, value: &serde_json::Value) {
    std::fs::write(dir.join(name), serde_json::to_vec_pretty(value).unwrap()).unwrap();
}

/// The figures of the page: (class, id, body).
fn figures(html: &str) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    let mut rest = html;
    while let Some(start) = rest.find("<figure class=\"") {
        let after = &rest[start + "<figure class=\"".len()..];
        let class_end = after.find('"').unwrap();
        let class = after[..class_end].to_string();
        let id_start = after.find("id=\"").unwrap() + 4;
        let id_end = id_start + after[id_start..].find('"').unwrap();
        let id = after[id_start..id_end].to_string();
        let open_end = after.find('>').unwrap() + 1;
        let end = after.find("</figure>").unwrap();
        out.push((class, id, after[open_end..end].to_string()));
        rest = &after[end..];
    }
    out
}

#[test]
fn every_chart_of_the_page_is_drawn() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "vm.json", &lifecycle("vm", 1.0));
    write(dir.path(), "jail.json", &lifecycle("jail", 3.0));
    write(dir.path(), "scaling-vm.json", &scaling("vm"));
    write(dir.path(), "scaling-jail.json", &scaling("jail"));
    let out = Command::new(CUBE)
        .args(["bench", "--report"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let html = std::fs::read_to_string(dir.path().join("index.html")).unwrap();
    // Offline: no script, no stylesheet or image to fetch.
    assert!(!html.contains("<script"), "the page needs no script");
    assert!(!html.contains("<link") && !html.contains("src="));
    let figs = figures(&html);
    let ids: Vec<&str> = figs.iter().map(|(_, id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "create-latency",
            "create-throughput",
            "snapshot-vs-dirty",
            "memory-vs-count",
            "jail-vs-vm"
        ]
    );
    for (class, id, body) in &figs {
        assert_eq!(class, "chart", "{id} has no data");
        assert!(body.starts_with("<svg"), "{id} is no inline SVG");
        let points = body.matches("<circle").count();
        let rects = body.matches("<rect").count();
        assert!(points + rects.saturating_sub(4) > 0, "{id}: nothing drawn");
    }
    // Both engines' seven levels are points: p50 and p95 each.
    assert_eq!(figs[0].2.matches("<circle").count(), 4 * 7);
    // The bars: eight operations for each of the two engines.
    assert!(figs[4].2.matches("<rect").count() >= 16);

    let check = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check-report.sh");
    let status = Command::new("bash")
        .arg(&check)
        .arg(dir.path())
        .status()
        .unwrap();
    match status.code() {
        Some(2) => println!("skipped: no chromium to render the page (apt-get install chromium)"),
        _ => assert!(status.success(), "headless Chromium check failed"),
    }
}

#[test]
fn a_chart_without_data_says_so_and_bad_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Scaling rows only, no density: the snapshot, memory and engine charts lack data.
    let mut only_scaling = scaling("jail");
    only_scaling["density"] = json!([]);
    write(dir.path(), "scaling-jail.json", &only_scaling);
    let out = Command::new(CUBE)
        .args(["bench", "--report"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    let html = std::fs::read_to_string(dir.path().join("index.html")).unwrap();
    let missing: Vec<String> = figures(&html)
        .into_iter()
        .filter(|(class, _, body)| class.contains("missing") && body.contains("No data: run"))
        .map(|(_, id, _)| id)
        .collect();
    assert_eq!(
        missing,
        ["snapshot-vs-dirty", "memory-vs-count", "jail-vs-vm"]
    );

    std::fs::write(dir.path().join("broken.json"), b"{ not json").unwrap();
    let out = Command::new(CUBE)
        .args(["bench", "--report"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("broken.json"));
}

#[test]
fn bad_input_is_refused_before_the_report_directory_is_made() {
    let inputs = tempfile::tempdir().unwrap();
    std::fs::write(inputs.path().join("broken.json"), b"{ not json").unwrap();
    // A --network report is JSON but draws nothing on the page.
    write(
        inputs.path(),
        "network.json",
        &json!({ "attach_veth_into_netns_ms": 1.0 }),
    );
    let cases: [(&[&str], &str); 4] = [
        (&["broken.json"], "broken.json is no JSON report"),
        (&["missing.json"], "missing.json"),
        (&["network.json"], "nothing to draw"),
        (&[], "no reports: give --input FILE"),
    ];
    for (given, expected) in cases {
        let dir = inputs.path().join("report");
        let mut cmd = Command::new(CUBE);
        cmd.args(["bench", "--report"]).arg(&dir);
        for name in given {
            cmd.arg("--input").arg(inputs.path().join(name));
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{given:?} was accepted");
        assert!(stderr.contains(expected), "{given:?}: {stderr}");
        assert!(!dir.exists(), "{given:?} left {} behind", dir.display());
    }
}
