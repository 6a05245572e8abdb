//! `cube bench --report DIR`: the JSON reports of earlier `cube bench --json` runs (the
//! vm and jail lifecycle benches, `--scaling` runs) drawn as one HTML page,
//! `DIR/index.html`: latency and throughput against concurrency, snapshot time and
//! source-paused time against dirty size, memory against sandbox count, and the jail
//! engine's lifecycle beside the VM engine's. The charts are SVG drawn by `plotters`
//! and inlined, so the page opens offline, with no script; each has a table of its
//! numbers under it.
//!
//! Each chart is a `<figure class="chart" id=...>`; a chart whose inputs hold no data
//! says so in words instead of drawing empty axes.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

use crate::cli_error::CliError;

/// Chart size in pixels.
const SIZE: (u32, u32) = (720, 420);
/// Series colours, in order (colour-blind friendly).
const COLOURS: &[RGBColor] = &[
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
];

/// One named line of (x, y) points.
#[derive(Debug, Clone, PartialEq)]
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    /// Drawn dashed-looking (thinner, hollow points): p95 beside a p50, say.
    secondary: bool,
}

/// One chart of the page.
struct Chart {
    id: &'static str,
    title: &'static str,
    what: &'static str,
    svg: Option<String>,
    /// Header and rows of its table.
    table: (Vec<String>, Vec<Vec<String>>),
    /// Why there is no chart, when there is none.
    missing: &'static str,
}

/// The reports read, by what they are.
#[derive(Default)]
struct Inputs {
    /// Lifecycle reports (vm or jail) by engine.
    lifecycle: BTreeMap<String, Value>,
    /// Scaling reports by engine.
    scaling: BTreeMap<String, Value>,
    files: Vec<PathBuf>,
}

/// Reads the reports (`inputs`, else every `*.json` in `dir`) and writes
/// `dir/index.html`. Every input is read and checked before `dir` is made, so bad
/// input leaves nothing behind.
pub fn run(dir: &Path, inputs: &[PathBuf]) -> Result<(), CliError> {
    let files = report_files(dir, inputs)?;
    let mut read = Inputs::default();
    for file in &files {
        let text = std::fs::read_to_string(file)
            .map_err(|e| CliError::failed(format!("reading {}: {e}", file.display())))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| CliError::failed(format!("{} is no JSON report: {e}", file.display())))?;
        read.add(file, value);
    }
    if read.files.is_empty() {
        return Err(CliError::failed(format!(
            "nothing to draw: none of {} is a lifecycle or scaling report \
             (`cube bench --json`, `cube bench --scaling --json`)",
            files_named(&files)
        )));
    }
    let html = render(&read);
    std::fs::create_dir_all(dir)
        .map_err(|e| CliError::failed(format!("creating {}: {e}", dir.display())))?;
    let out = dir.join("index.html");
    std::fs::write(&out, html)
        .map_err(|e| CliError::failed(format!("writing {}: {e}", out.display())))?;
    println!("{}", out.display());
    Ok(())
}

/// The reports to read: `inputs`, else the `*.json` files already in `dir`.
fn report_files(dir: &Path, inputs: &[PathBuf]) -> Result<Vec<PathBuf>, CliError> {
    if !inputs.is_empty() {
        return Ok(inputs.to_vec());
    }
    let no_reports = || {
        CliError::failed(format!(
            "no reports: give --input FILE or put `cube bench --json` output in {}",
            dir.display()
        ))
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(no_reports()),
        Err(e) => return Err(CliError::failed(format!("reading {}: {e}", dir.display()))),
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    if found.is_empty() {
        return Err(no_reports());
    }
    found.sort();
    Ok(found)
}

/// `a.json, b.json` for an error message.
fn files_named(files: &[PathBuf]) -> String {
    files
        .iter()
        .map(|f| f.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Inputs {
    fn add(&mut self, file: &Path, value: Value) {
        let engine = value["engine"].as_str().unwrap_or("vm").to_string();
        if value["kind"].as_str() == Some("scaling") {
            self.scaling.insert(engine, value);
        } else if value.get("create_from_template").is_some() {
            self.lifecycle.insert(engine, value);
        } else {
            // Other reports (--network) draw nothing here.
            return;
        }
        self.files.push(file.to_path_buf());
    }
}

/// The number at `key` of `v`, if any.
fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

/// Rows of the array at `key`.
fn rows<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

fn engine_name(engine: &str) -> &'static str {
    if engine == "jail" {
        "jail"
    } else {
        "VM (test guest)"
    }
}

/// The page.
fn render(inputs: &Inputs) -> String {
    let charts = vec![
        create_latency(inputs),
        create_throughput(inputs),
        snapshot_vs_dirty(inputs),
        memory_vs_count(inputs),
        jail_vs_vm(inputs),
    ];
    let mut html = String::from(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>Cube benchmark report</title><style>\
         body{font-family:sans-serif;max-width:800px;margin:2em auto;color:#222}\
         figure{margin:1em 0}table{border-collapse:collapse;font-size:13px}\
         td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}\
         .missing{color:#a00}</style></head><body>\n<h1>Cube benchmark report</h1>\n",
    );
    let _ = writeln!(html, "<p>From {}.</p>", files_list(&inputs.files));
    for c in &charts {
        let _ = writeln!(html, "<section><h2>{}</h2><p>{}</p>", c.title, c.what);
        match &c.svg {
            Some(svg) => {
                let _ = writeln!(
                    html,
                    "<figure class=\"chart\" id=\"{}\">{svg}</figure>",
                    c.id
                );
            }
            None => {
                let _ = writeln!(
                    html,
                    "<figure class=\"chart missing\" id=\"{}\"><p class=\"missing\">No data: {}</p></figure>",
                    c.id, c.missing
                );
            }
        }
        html.push_str(&table_html(&c.table.0, &c.table.1));
        html.push_str("</section>\n");
    }
    html.push_str("</body></html>\n");
    html
}

fn files_list(files: &[PathBuf]) -> String {
    files
        .iter()
        .map(|f| {
            format!(
                "<code>{}</code>",
                escape(&f.file_name().unwrap_or_default().to_string_lossy())
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn table_html(header: &[String], rows: &[Vec<String>]) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let mut t = String::from("<table><tr>");
    for h in header {
        let _ = write!(t, "<th>{}</th>", escape(h));
    }
    t.push_str("</tr>");
    for r in rows {
        t.push_str("<tr>");
        for c in r {
            let _ = write!(t, "<td>{}</td>", escape(c));
        }
        t.push_str("</tr>");
    }
    t.push_str("</table>\n");
    t
}

/// The create rows of an engine: its scaling report's, else its lifecycle report's
/// (concurrency 0 marks the jail bench's create without a pool, left out).
fn create_rows<'a>(inputs: &'a Inputs, engine: &str) -> &'a [Value] {
    inputs
        .scaling
        .get(engine)
        .or_else(|| inputs.lifecycle.get(engine))
        .map(|r| rows(r, "create_from_template"))
        .unwrap_or(&[])
}

fn engines(inputs: &Inputs) -> Vec<String> {
    let mut e: Vec<String> = inputs
        .scaling
        .keys()
        .chain(inputs.lifecycle.keys())
        .cloned()
        .collect();
    e.sort();
    e.dedup();
    e
}

fn fmt(x: f64) -> String {
    format!("{}", (x * 100.0).round() / 100.0)
}

fn create_latency(inputs: &Inputs) -> Chart {
    let mut series = Vec::new();
    let mut table = Vec::new();
    for engine in engines(inputs) {
        let mut p50 = Vec::new();
        let mut p95 = Vec::new();
        for r in create_rows(inputs, &engine) {
            let (Some(c), Some(a), Some(b)) =
                (num(r, "concurrency"), num(r, "p50_ms"), num(r, "p95_ms"))
            else {
                continue;
            };
            if c < 1.0 {
                continue;
            }
            p50.push((c, a));
            p95.push((c, b));
            table.push(vec![
                engine_name(&engine).to_string(),
                fmt(c),
                fmt(a),
                fmt(b),
                num(r, "throughput_per_s").map(fmt).unwrap_or_default(),
            ]);
        }
        push_pair(&mut series, engine_name(&engine), p50, p95);
    }
    Chart {
        id: "create-latency",
        title: "Create latency against concurrency",
        what: "Create from template, p50 (solid) and p95 (thin), milliseconds, \
               against how many creates run at once (CubeSandbox's §3.2).",
        svg: line_chart("create latency", "concurrency", "ms", &series, true, true),
        table: (
            ["engine", "concurrency", "p50 ms", "p95 ms", "throughput /s"]
                .map(String::from)
                .to_vec(),
            table,
        ),
        missing: "run `cube bench --scaling --json` (or `cube bench --json`) for an engine",
    }
}

/// Adds a p50 and a p95 series named after `label`, when they hold points.
fn push_pair(series: &mut Vec<Series>, label: &str, p50: Vec<(f64, f64)>, p95: Vec<(f64, f64)>) {
    if !p50.is_empty() {
        series.push(Series {
            name: format!("{label} p50"),
            points: p50,
            secondary: false,
        });
        series.push(Series {
            name: format!("{label} p95"),
            points: p95,
            secondary: true,
        });
    }
}

fn create_throughput(inputs: &Inputs) -> Chart {
    let mut series = Vec::new();
    for engine in engines(inputs) {
        let points: Vec<(f64, f64)> = create_rows(inputs, &engine)
            .iter()
            .filter_map(|r| Some((num(r, "concurrency")?, num(r, "throughput_per_s")?)))
            .filter(|(c, _)| *c >= 1.0)
            .collect();
        if !points.is_empty() {
            series.push(Series {
                name: engine_name(&engine).to_string(),
                points,
                secondary: false,
            });
        }
    }
    Chart {
        id: "create-throughput",
        title: "Create throughput against concurrency",
        what: "Sandboxes created (and destroyed) per second at each concurrency.",
        svg: line_chart(
            "create throughput",
            "concurrency",
            "creates / s",
            &series,
            true,
            false,
        ),
        table: (Vec::new(), Vec::new()),
        missing: "run `cube bench --scaling --json` for an engine",
    }
}

fn snapshot_vs_dirty(inputs: &Inputs) -> Chart {
    let mut series = Vec::new();
    let mut table = Vec::new();
    for (engine, report) in &inputs.lifecycle {
        let mut total = Vec::new();
        let mut paused = Vec::new();
        for r in rows(report, "snapshot_vs_dirty") {
            let (Some(d), Some(s)) = (num(r, "dirty_mib"), num(r, "snapshot_ms")) else {
                continue;
            };
            total.push((d, s));
            let p = num(r, "source_paused_ms");
            if let Some(p) = p {
                paused.push((d, p));
            }
            table.push(vec![
                engine_name(engine).to_string(),
                fmt(d),
                fmt(s),
                p.map(fmt).unwrap_or_else(|| "-".into()),
            ]);
        }
        let name = engine_name(engine);
        if !total.is_empty() {
            series.push(Series {
                name: format!("{name} snapshot"),
                points: total,
                secondary: false,
            });
        }
        if !paused.is_empty() {
            series.push(Series {
                name: format!("{name} source paused"),
                points: paused,
                secondary: true,
            });
        }
    }
    let means: Vec<String> = inputs
        .lifecycle
        .iter()
        .filter_map(|(e, r)| {
            Some(format!(
                "{}: {}",
                engine_name(e),
                r.get("source_paused_means")?.as_str()?
            ))
        })
        .collect();
    Chart {
        id: "snapshot-vs-dirty",
        title: "Snapshot time and source-paused time against dirty size",
        what: if means.is_empty() {
            "Snapshot wall time (solid) and how long the sandbox was stopped for it (thin)."
        } else {
            "Snapshot wall time (solid) and how long the sandbox was stopped for it (thin); \
             see the table for what each engine's paused time counts."
        },
        svg: line_chart(
            "snapshot against dirty size",
            "MiB dirtied before the snapshot",
            "ms",
            &series,
            false,
            false,
        ),
        table: (
            ["engine", "dirty MiB", "snapshot ms", "source paused ms"]
                .map(String::from)
                .to_vec(),
            table
                .into_iter()
                .chain(
                    means
                        .into_iter()
                        .map(|m| vec![m, String::new(), String::new(), String::new()]),
                )
                .collect(),
        ),
        missing: "run `cube bench --json` (vm) or `cube bench --engine jail --json`",
    }
}

fn memory_vs_count(inputs: &Inputs) -> Chart {
    let mut series = Vec::new();
    let mut table = Vec::new();
    for engine in engines(inputs) {
        let mut points = Vec::new();
        if let Some(r) = inputs.scaling.get(&engine) {
            for d in rows(r, "density") {
                let (Some(n), Some(used)) = (num(d, "sandboxes"), num(d, "used_mib")) else {
                    continue;
                };
                points.push((n, used));
                table.push(vec![
                    engine_name(&engine).to_string(),
                    fmt(n),
                    fmt(used),
                    num(d, "used_mib_per_sandbox").map(fmt).unwrap_or_default(),
                    num(d, "pss_mib_per_sandbox").map(fmt).unwrap_or_default(),
                    num(d, "fit_in_host").map(fmt).unwrap_or_default(),
                ]);
            }
        }
        if let Some(r) = inputs.lifecycle.get(&engine) {
            if let (Some(n), Some(per)) = (
                num(r, "memory_overhead_sandboxes"),
                num(r, "memory_overhead_mib_per_sandbox"),
            ) {
                points.push((n, n * per));
                table.push(vec![
                    engine_name(&engine).to_string(),
                    fmt(n),
                    fmt(n * per),
                    fmt(per),
                    num(r, "memory_pss_mib_per_sandbox")
                        .map(fmt)
                        .unwrap_or_default(),
                    String::new(),
                ]);
            }
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        if !points.is_empty() {
            // The origin: no sandbox, no memory of theirs.
            points.insert(0, (0.0, 0.0));
            series.push(Series {
                name: engine_name(&engine).to_string(),
                points,
                secondary: false,
            });
        }
    }
    Chart {
        id: "memory-vs-count",
        title: "Memory against sandbox count",
        what: "Host memory in use (no cache counted) grown by that many idle sandboxes, \
               MiB (CubeSandbox's §3.3).",
        svg: line_chart(
            "memory of idle sandboxes",
            "sandboxes",
            "MiB used",
            &series,
            false,
            false,
        ),
        table: (
            [
                "engine",
                "sandboxes",
                "used MiB",
                "MiB / sandbox",
                "PSS MiB / sandbox",
                "fit in host",
            ]
            .map(String::from)
            .to_vec(),
            table,
        ),
        missing: "run `cube bench --scaling --json` for an engine",
    }
}

/// The p50 of each lifecycle operation of a lifecycle report.
fn lifecycle_ops(engine: &str, r: &Value) -> Vec<(&'static str, Option<f64>)> {
    let first = |key: &str, field: &str| rows(r, key).first().and_then(|x| num(x, field));
    let create = rows(r, "create_from_template")
        .iter()
        .find(|x| num(x, "concurrency") == Some(1.0))
        .and_then(|x| num(x, "p50_ms"));
    if engine == "jail" {
        let full = |op: &str| r.get("full_state").and_then(|f| num(&f[op], "p50_ms"));
        vec![
            ("create", create),
            (
                "snapshot",
                full("snapshot").or(first("snapshot_vs_dirty", "snapshot_ms")),
            ),
            ("rollback", full("rollback").or(num(r, "rollback_ms"))),
            ("clone", full("clone").or(first("clone", "per_clone_ms"))),
            ("pause", num(r, "pause_ms")),
            ("resume", num(r, "resume_ms")),
            ("hibernate", full("hibernate").or(num(r, "hibernate_ms"))),
            ("wake", full("wake").or(num(r, "wake_ms"))),
        ]
    } else {
        vec![
            ("create", create),
            ("snapshot", first("snapshot_vs_dirty", "snapshot_ms")),
            ("rollback", num(r, "rollback_ms")),
            ("clone", first("clone", "per_clone_ms")),
            ("pause", num(r, "pause_ms")),
            ("resume", num(r, "resume_ms")),
            ("hibernate", num(r, "hibernate_ms")),
            ("wake", num(r, "wake_ms")),
        ]
    }
}

fn jail_vs_vm(inputs: &Inputs) -> Chart {
    let ops: Vec<&'static str> = vec![
        "create",
        "snapshot",
        "rollback",
        "clone",
        "pause",
        "resume",
        "hibernate",
        "wake",
    ];
    let mut bars: Vec<(String, Vec<Option<f64>>)> = Vec::new();
    for (engine, r) in &inputs.lifecycle {
        let values = lifecycle_ops(engine, r);
        bars.push((
            engine_name(engine).to_string(),
            ops.iter()
                .map(|op| values.iter().find(|(o, _)| o == op).and_then(|(_, v)| *v))
                .collect(),
        ));
    }
    let table: Vec<Vec<String>> = ops
        .iter()
        .enumerate()
        .map(|(i, op)| {
            std::iter::once(op.to_string())
                .chain(
                    bars.iter()
                        .map(|(_, v)| v[i].map(fmt).unwrap_or_else(|| "-".into())),
                )
                .collect()
        })
        .collect();
    let header = std::iter::once("operation (p50 ms)".to_string())
        .chain(bars.iter().map(|(n, _)| n.clone()))
        .collect();
    Chart {
        id: "jail-vs-vm",
        title: "Jail engine against VM engine",
        what: "p50 of each lifecycle operation, milliseconds, log scale (the jail's \
               snapshot, rollback, clone, hibernate and wake are its full-state ones, a \
               Python context holding a variable, read back after each).",
        svg: bar_chart("lifecycle p50", &ops, &bars),
        table: (header, table),
        missing: "run `cube bench --json` and `cube bench --engine jail --json`",
    }
}

/// A line chart of `series` (None when no series has a point).
fn line_chart(
    caption: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    x_log: bool,
    y_log: bool,
) -> Option<String> {
    let points: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.clone()).collect();
    if points.is_empty() {
        return None;
    }
    let (x0, x1) = span(points.iter().map(|p| p.0), x_log);
    let (y0, y1) = span(points.iter().map(|p| p.1), y_log);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        let drawn = match (x_log, y_log) {
            (true, true) => draw_lines(
                &root,
                caption,
                x_label,
                y_label,
                series,
                (x0..x1).log_scale(),
                (y0..y1).log_scale(),
            ),
            (true, false) => draw_lines(
                &root,
                caption,
                x_label,
                y_label,
                series,
                (x0..x1).log_scale(),
                y0..y1,
            ),
            (false, true) => draw_lines(
                &root,
                caption,
                x_label,
                y_label,
                series,
                x0..x1,
                (y0..y1).log_scale(),
            ),
            (false, false) => draw_lines(&root, caption, x_label, y_label, series, x0..x1, y0..y1),
        };
        drawn.ok()?;
        root.present().ok()?;
    }
    Some(svg)
}

/// The axis range over `values`: from 0 (or, on a log axis, a little under the
/// least) to a little over the largest.
fn span(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let v: Vec<f64> = values.filter(|x| x.is_finite()).collect();
    let max = v.iter().copied().fold(f64::MIN, f64::max).max(1e-3);
    if log {
        let min = v
            .iter()
            .copied()
            .filter(|x| *x > 0.0)
            .fold(f64::MAX, f64::min)
            .min(max);
        (min / 1.5, max * 1.5)
    } else {
        (0.0, max * 1.1)
    }
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// Draws the series' names, top left.
fn legend<'a, X, Y>(chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>) -> DrawResult
where
    X: plotters::coord::ranged1d::Ranged,
    Y: plotters::coord::ranged1d::Ranged,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    Ok(())
}

fn draw_lines<X, Y>(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    x: X,
    y: Y,
) -> DrawResult
where
    X: plotters::coord::ranged1d::AsRangedCoord<Value = f64>,
    Y: plotters::coord::ranged1d::AsRangedCoord<Value = f64>,
    X::CoordDescType: plotters::coord::ranged1d::ValueFormatter<f64>,
    Y::CoordDescType: plotters::coord::ranged1d::ValueFormatter<f64>,
{
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .max_light_lines(2)
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()?;
    for (i, s) in series.iter().enumerate() {
        // A secondary series (a p95, a paused time) takes its primary's colour.
        let primaries = series[..=i].iter().filter(|p| !p.secondary).count();
        let colour = COLOURS[primaries.saturating_sub(1) % COLOURS.len()];
        let width = if s.secondary { 1 } else { 2 };
        let style = colour.stroke_width(width);
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), style))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
        let fill = if s.secondary {
            colour.stroke_width(1)
        } else {
            colour.filled()
        };
        chart.draw_series(s.points.iter().map(|p| Circle::new(*p, 3, fill)))?;
    }
    legend(&mut chart)
}

/// Grouped bars: for each category, one bar per series, on a log axis (None when
/// no bar has a value).
fn bar_chart(
    caption: &str,
    categories: &[&str],
    series: &[(String, Vec<Option<f64>>)],
) -> Option<String> {
    let values: Vec<f64> = series
        .iter()
        .flat_map(|(_, v)| v.iter().flatten().copied())
        .filter(|v| *v > 0.0)
        .collect();
    if values.is_empty() {
        return None;
    }
    let (y0, y1) = span(values.iter().copied(), true);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        draw_bars(&root, caption, categories, series, y0, y1).ok()?;
        root.present().ok()?;
    }
    Some(svg)
}

fn draw_bars(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    categories: &[&str],
    series: &[(String, Vec<Option<f64>>)],
    y0: f64,
    y1: f64,
) -> DrawResult {
    root.fill(&WHITE)?;
    let n = categories.len();
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n as f64, (y0..y1).log_scale())?;
    let names: Vec<String> = categories.iter().map(|c| c.to_string()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .max_light_lines(2)
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            // Labels sit at the middle of each category.
            if (x - i as f64 - 0.5).abs() < 0.01 {
                names.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("p50 ms")
        .draw()?;
    let groups = series.len().max(1) as f64;
    let width = 0.8 / groups;
    for (k, (name, values)) in series.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        chart
            .draw_series(values.iter().enumerate().filter_map(|(i, v)| {
                let v = (*v)?;
                let left = i as f64 + 0.1 + k as f64 * width;
                Some(Rectangle::new(
                    [(left, y0), (left + width, v)],
                    colour.filled(),
                ))
            }))?
            .label(name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
    }
    legend(&mut chart)
}
