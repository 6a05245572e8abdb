//! The control plane, as E2B's SDKs call it: create, list, inspect, kill, timeouts,
//! pause and connect (resume), fork, snapshots, metrics, network; plus Cube's own
//! additions (rollback, hibernate, wake, engine choice). Every route needs a configured
//! API key in `X-API-KEY`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use cube_core::network::{NetworkOptions, NetworkPolicy};
use cube_core::CreateOptions;
use cube_core::EngineChoice;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::ids;
use crate::lock::lock;
use crate::record::{OnTimeout, PauseKind, Record};
use crate::service::{new_token, now_ms, Entry, Service};

/// The envd version create answers report. The SDKs gate features on it; this is the
/// newest whose features Cube serves (octet-stream uploads, closing stdin), so newer
/// ones (file metadata, watch entries) fail in the SDK with its own clear message.
pub const ENVD_VERSION: &str = "0.5.7";

/// The `clientID` every sandbox reports.
const CLIENT_ID: &str = "cube";

/// Forks one request may ask for.
const MAX_FORKS: u64 = 20;

type Svc = State<Arc<Service>>;

/// The control plane's routes.
pub fn router(service: Arc<Service>) -> Router {
    Router::new()
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/{id}", get(get_info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/snapshots", post(create_snapshot))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/network", put(update_network))
        .route("/sandboxes/{id}/rollback", post(rollback))
        .route("/sandboxes/{id}/hibernate", post(hibernate))
        .route("/sandboxes/{id}/wake", post(wake))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/{id}", delete(delete_snapshot))
        .fallback(not_found)
        .with_state(service)
}

async fn not_found() -> ApiError {
    ApiError::not_found("No such route")
}

/// Reads a JSON body into `T`, with E2B-shaped errors (an empty body is `{}`).
fn body<T: serde::de::DeserializeOwned>(bytes: &Bytes) -> Result<T, ApiError> {
    let data: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    serde_json::from_slice(data)
        .map_err(|e| ApiError::bad_request(format!("Bad request body: {e}")))
}

fn iso(ms: u64) -> String {
    crate::envd::json::rfc3339((ms / 1000) as i64, ((ms % 1000) * 1_000_000) as u32)
}

fn host_memory_mib() -> u64 {
    // SAFETY: sysinfo fills the struct it is given; zeroed is a valid start.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid, writable sysinfo struct.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return 0;
    }
    (info.totalram as u64).saturating_mul(u64::from(info.mem_unit)) >> 20
}

fn cpu_count() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// What create, connect and fork answer (E2B's `Sandbox`).
fn sandbox_json(service: &Service, r: &Record) -> Value {
    json!({
        "templateID": r.template,
        "sandboxID": ids::to_e2b(&r.id),
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": r.envd_token,
        "trafficAccessToken": r.traffic_token,
        "domain": service.config.domain,
        "alias": r.template,
    })
}

fn state_name(r: &Record) -> &'static str {
    if r.paused.is_some() {
        "paused"
    } else {
        "running"
    }
}

/// A listed sandbox (E2B's `ListedSandbox`).
fn listed_json(r: &Record) -> Value {
    json!({
        "templateID": r.template,
        "alias": r.template,
        "sandboxID": ids::to_e2b(&r.id),
        "clientID": CLIENT_ID,
        "startedAt": iso(r.started_ms),
        "endAt": iso(r.end_ms),
        "cpuCount": cpu_count(),
        "memoryMB": if r.memory_mib > 0 { r.memory_mib } else { host_memory_mib() },
        "diskSizeMB": 0,
        "state": state_name(r),
        "envdVersion": ENVD_VERSION,
        "metadata": r.metadata,
    })
}

/// One sandbox in detail (E2B's `SandboxDetail`).
fn detail_json(service: &Service, r: &Record) -> Value {
    let mut v = listed_json(r);
    v["envdAccessToken"] = json!(r.envd_token);
    v["domain"] = json!(service.config.domain);
    v["lifecycle"] = json!({
        "onTimeout": match r.on_timeout { OnTimeout::Kill => "kill", OnTimeout::Pause => "pause" },
        "autoResume": r.auto_resume,
    });
    v["allowInternetAccess"] = json!(r.networked);
    v
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct NetworkBody {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    #[serde(alias = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    auto_pause: Option<bool>,
    auto_resume: Option<AutoResume>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<NetworkBody>,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
    mcp: Option<Value>,
    volume_mounts: Option<Vec<Value>>,
    /// Cube's addition: `auto`, `jail` or `vm`.
    engine: Option<String>,
    /// Cube's addition: a memory limit, MiB.
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u64>,
    /// Cube's addition: a CPU limit in thousandths of a core.
    cpu_millis: Option<u32>,
}

/// Where a create starts from: a Cube template, or a snapshot.
enum Origin {
    Template(String),
    Snapshot(String),
}

fn resolve_template(service: &Service, name: &str) -> Origin {
    if name.starts_with("snap-") {
        return Origin::Snapshot(name.to_string());
    }
    // E2B names may carry a tag (`name:tag`); Cube templates have none.
    let base = name.split(':').next().unwrap_or(name);
    let mapped = service
        .config
        .templates
        .get(name)
        .or_else(|| service.config.templates.get(base))
        .cloned()
        .unwrap_or_else(|| base.to_string());
    Origin::Template(mapped)
}

fn network_options(
    allow_internet: Option<bool>,
    network: Option<&NetworkBody>,
) -> Option<NetworkOptions> {
    let asked = allow_internet == Some(true)
        || network.is_some_and(|n| n.allow_out.is_some() || n.deny_out.is_some());
    if !asked && allow_internet != Some(false) {
        return None;
    }
    if allow_internet == Some(false) && network.is_none() {
        // No internet asked for and nothing allowed: loopback only, no network at all.
        return None;
    }
    let policy = NetworkPolicy {
        internet: allow_internet.unwrap_or(true),
        allow_out: network
            .and_then(|n| n.allow_out.clone())
            .unwrap_or_default(),
        deny_out: network.and_then(|n| n.deny_out.clone()).unwrap_or_default(),
    };
    Some(NetworkOptions {
        policy,
        expose: Vec::new(),
    })
}

fn engine_choice(name: Option<&str>) -> Result<EngineChoice, ApiError> {
    match name.unwrap_or("auto") {
        "auto" => Ok(EngineChoice::Auto),
        "jail" => Ok(EngineChoice::Jail),
        "vm" => Ok(EngineChoice::Vm),
        other => Err(ApiError::bad_request(format!(
            "Unknown engine {other:?} (auto, jail, vm)"
        ))),
    }
}

/// What a new sandbox's record says besides its id, times and tokens.
struct NewRecord {
    template: String,
    on_timeout: OnTimeout,
    auto_resume: bool,
    metadata: BTreeMap<String, String>,
    memory_mib: u64,
    networked: bool,
}

impl NewRecord {
    /// The record of sandbox `id`, ending `timeout` from now, with fresh tokens.
    fn record(self, id: String, timeout: Duration) -> Result<Record, ApiError> {
        let now = now_ms();
        Ok(Record {
            id,
            template: self.template,
            started_ms: now,
            end_ms: now + timeout.as_millis() as u64,
            envd_token: new_token()?,
            traffic_token: new_token()?,
            on_timeout: self.on_timeout,
            auto_resume: self.auto_resume,
            paused: None,
            metadata: self.metadata,
            memory_mib: self.memory_mib,
            networked: self.networked,
            contexts: BTreeMap::new(),
        })
    }
}

async fn create(State(service): Svc, raw: Bytes) -> Result<Response, ApiError> {
    let req: NewSandbox = body(&raw)?;
    if req.mcp.as_ref().is_some_and(|m| !m.is_null()) {
        return Err(ApiError::bad_request(
            "MCP gateways are not supported by this server",
        ));
    }
    if req.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(ApiError::bad_request(
            "Volumes are not supported by this server",
        ));
    }
    let timeout = service.timeout(req.timeout)?;
    let _permit = service.create_permit(1)?;
    let options = CreateOptions {
        ephemeral: false,
        engine: engine_choice(req.engine.as_deref())?,
        env: req
            .env_vars
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect(),
        metadata: req.metadata.clone().unwrap_or_default(),
        memory_mib: req.memory_mb,
        cpu_millis: req.cpu_millis,
        network: network_options(req.allow_internet_access, req.network.as_ref()),
        ..CreateOptions::new(false)
    };
    let networked = options.network.is_some();
    let origin = resolve_template(&service, &req.template_id);
    let started = Instant::now();
    let result = service
        .blocking(move |rt| {
            let sb = match &origin {
                Origin::Template(t) => rt.create(t, options)?,
                Origin::Snapshot(s) => rt.create_from_snapshot(s, options)?,
            };
            Ok(sb.id().to_string())
        })
        .await;
    let id = match result {
        Ok(id) => id,
        Err(e) => {
            service.metrics.create_failed();
            return Err(e);
        }
    };
    service.metrics.create_done(started.elapsed());
    let record = NewRecord {
        template: req.template_id.clone(),
        on_timeout: if req.auto_pause == Some(true) {
            OnTimeout::Pause
        } else {
            OnTimeout::Kill
        },
        auto_resume: req.auto_resume.map(|a| a.enabled).unwrap_or(false),
        metadata: req.metadata.unwrap_or_default(),
        memory_mib: req.memory_mb.unwrap_or(0),
        networked,
    }
    .record(id, timeout)?;
    let entry = service.insert(record.clone());
    if let Err(e) = service.save(&entry) {
        destroy_quietly(&service, &entry).await;
        return Err(e);
    }
    tracing::info!(sandbox = %record.id, template = %record.template, "created");
    Ok((StatusCode::CREATED, Json(sandbox_json(&service, &record))).into_response())
}

async fn destroy_quietly(service: &Arc<Service>, entry: &Arc<Entry>) {
    let id = entry.id.clone();
    let _ = service
        .blocking(move |rt| Ok(rt.attach(&id).and_then(|sb| sb.destroy())))
        .await;
    service.forget(&entry.id);
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
    order: Option<String>,
    started_after: Option<String>,
    template: Option<String>,
}

/// Parses E2B's metadata filter: `k=v&k2=v2`, each part percent-encoded.
fn metadata_filter(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            Some((crate::query::decode(k), crate::query::decode(v)))
        })
        .collect()
}

fn filtered(service: &Service, q: &ListQuery) -> Result<Vec<Record>, ApiError> {
    let want_meta = q
        .metadata
        .as_deref()
        .map(metadata_filter)
        .unwrap_or_default();
    let states: Vec<String> = q
        .state
        .as_deref()
        .map(|s| s.split(',').map(|x| x.trim().to_string()).collect())
        .unwrap_or_else(|| vec!["running".into(), "paused".into()]);
    let after_ms = match q.started_after.as_deref() {
        Some(s) => Some(
            crate::envd::json::parse_rfc3339(s)
                .map(|(secs, nanos)| secs as u64 * 1000 + u64::from(nanos / 1_000_000))
                .ok_or_else(|| ApiError::bad_request(format!("Bad startedAfter {s:?}")))?,
        ),
        None => None,
    };
    let mut records: Vec<Record> = service
        .all()
        .iter()
        .map(|e| e.snapshot())
        .filter(|r| states.iter().any(|s| s == state_name(r)))
        .filter(|r| want_meta.iter().all(|(k, v)| r.metadata.get(k) == Some(v)))
        .filter(|r| after_ms.is_none_or(|a| r.started_ms > a))
        .filter(|r| q.template.as_ref().is_none_or(|t| &r.template == t))
        .collect();
    records.sort_by(|a, b| (a.started_ms, &a.id).cmp(&(b.started_ms, &b.id)));
    match q.order.as_deref() {
        None | Some("asc") => {}
        Some("desc") => records.reverse(),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "Bad order {other:?} (asc, desc)"
            )))
        }
    }
    Ok(records)
}

async fn list_v2(State(service): Svc, Query(q): Query<ListQuery>) -> Result<Response, ApiError> {
    let records = filtered(&service, &q)?;
    // The next token is the E2B id of the first sandbox of the next page.
    let start = match &q.next_token {
        Some(token) => records
            .iter()
            .position(|r| ids::to_e2b(&r.id) == *token)
            .ok_or_else(|| ApiError::bad_request("Unknown nextToken"))?,
        None => 0,
    };
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let page: Vec<Value> = records
        .iter()
        .skip(start)
        .take(limit)
        .map(listed_json)
        .collect();
    let mut resp = Json(page).into_response();
    if let Some(next) = records.get(start + limit) {
        if let Ok(v) = HeaderValue::from_str(&ids::to_e2b(&next.id)) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(resp)
}

async fn list_v1(State(service): Svc, Query(q): Query<ListQuery>) -> Result<Response, ApiError> {
    let q = ListQuery {
        state: Some("running".into()),
        ..q
    };
    let page: Vec<Value> = filtered(&service, &q)?.iter().map(listed_json).collect();
    Ok(Json(page).into_response())
}

async fn get_info(State(service): Svc, Path(id): Path<String>) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    Ok(Json(detail_json(&service, &entry.snapshot())).into_response())
}

/// Destroys a served sandbox; a sandbox whose supervisor is already gone is cleaned up.
pub async fn kill_entry(service: &Arc<Service>, entry: &Arc<Entry>) -> Result<(), ApiError> {
    let _op = entry.op.lock().await;
    entry.drop_connections("the sandbox was killed");
    let id = entry.id.clone();
    let result = service
        .blocking(move |rt| match rt.attach(&id) {
            Ok(sb) => Ok(sb.destroy()?),
            Err(cube_core::SandboxError::UnknownSandbox(_)) => Ok(()),
            Err(_) => Ok(rt.remove_stale(&id)?),
        })
        .await;
    service.forget(&entry.id);
    tracing::info!(sandbox = %entry.id, "killed");
    result
}

async fn kill(State(service): Svc, Path(id): Path<String>) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    kill_entry(&service, &entry).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: u64,
}

async fn set_timeout(
    State(service): Svc,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    let req: TimeoutBody = body(&raw)?;
    let timeout = service.timeout(Some(req.timeout))?;
    lock(&entry.record).end_ms = now_ms() + timeout.as_millis() as u64;
    service.save(&entry)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize, Default)]
struct RefreshBody {
    duration: Option<u64>,
}

async fn refresh(
    State(service): Svc,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    let req: RefreshBody = body(&raw)?;
    let timeout = service.timeout(req.duration)?;
    {
        let mut r = lock(&entry.record);
        r.end_ms = r.end_ms.max(now_ms() + timeout.as_millis() as u64);
    }
    service.save(&entry)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Pauses a running sandbox the way this server pauses (see [`crate::config::PauseMode`]);
/// false when it was paused already.
pub async fn pause_entry(service: &Arc<Service>, entry: &Arc<Entry>) -> Result<bool, ApiError> {
    let _op = entry.op.lock().await;
    if entry.is_paused() {
        return Ok(false);
    }
    let kind = service.pause_kind();
    if kind == PauseKind::Hibernated {
        // Hibernation ends every process's connection to the host.
        entry.drop_connections("the sandbox was paused");
    }
    let id = entry.id.clone();
    service
        .blocking(move |rt| {
            let mut sb = rt.attach(&id)?;
            match kind {
                PauseKind::Hibernated => sb.hibernate()?,
                PauseKind::Frozen => sb.pause()?,
            }
            Ok(())
        })
        .await?;
    lock(&entry.record).paused = Some(kind);
    service.save(entry)?;
    tracing::info!(sandbox = %entry.id, ?kind, "paused");
    Ok(true)
}

/// Resumes a paused sandbox with a new end time; false when it was running.
pub async fn resume_entry(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    timeout: Duration,
) -> Result<bool, ApiError> {
    let _op = entry.op.lock().await;
    let Some(kind) = lock(&entry.record).paused else {
        return Ok(false);
    };
    let id = entry.id.clone();
    service
        .blocking(move |rt| {
            let mut sb = rt.attach(&id)?;
            match kind {
                PauseKind::Hibernated => sb.wake()?,
                PauseKind::Frozen => sb.resume()?,
            }
            Ok(())
        })
        .await?;
    {
        let mut r = lock(&entry.record);
        r.paused = None;
        r.end_ms = now_ms() + timeout.as_millis() as u64;
    }
    service.save(entry)?;
    tracing::info!(sandbox = %entry.id, "resumed");
    Ok(true)
}

async fn pause(State(service): Svc, Path(id): Path<String>) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    if pause_entry(&service, &entry).await? {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::conflict(format!(
            "Sandbox {id} is already paused"
        )))
    }
}

#[derive(Deserialize, Default)]
struct ConnectBody {
    timeout: Option<u64>,
}

async fn connect(
    State(service): Svc,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    let req: ConnectBody = body(&raw)?;
    let timeout = service.timeout(req.timeout)?;
    if resume_entry(&service, &entry, timeout).await? {
        let record = entry.snapshot();
        return Ok((StatusCode::CREATED, Json(sandbox_json(&service, &record))).into_response());
    }
    if req.timeout.is_some() {
        // A running sandbox's end only moves later.
        let mut r = lock(&entry.record);
        r.end_ms = r.end_ms.max(now_ms() + timeout.as_millis() as u64);
    }
    service.save(&entry)?;
    let record = entry.snapshot();
    Ok((StatusCode::OK, Json(sandbox_json(&service, &record))).into_response())
}

#[derive(Deserialize, Default)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u64>,
}

async fn fork(
    State(service): Svc,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    let req: ForkBody = body(&raw)?;
    let count = req.count.unwrap_or(1);
    if !(1..=MAX_FORKS).contains(&count) {
        return Err(ApiError::bad_request(format!(
            "count must be between 1 and {MAX_FORKS}"
        )));
    }
    let timeout = service.timeout(req.timeout)?;
    let _permit = service.create_permit(count as usize)?;
    let source = entry.snapshot();
    let snapshot = {
        let _op = entry.op.lock().await;
        if entry.is_paused() {
            return Err(ApiError::conflict(format!("Sandbox {id} is paused")));
        }
        // A full-state snapshot ends the source's agent connections.
        entry.drop_connections("the sandbox was forked");
        let sid = entry.id.clone();
        service
            .blocking(move |rt| Ok(rt.attach(&sid)?.snapshot()?.id))
            .await?
    };
    let mut tasks = Vec::new();
    for _ in 0..count {
        let snap = snapshot.clone();
        let metadata = source.metadata.clone();
        tasks.push(service.blocking(move |rt| {
            let options = CreateOptions {
                metadata,
                ..CreateOptions::new(false)
            };
            Ok(rt.create_from_snapshot(&snap, options)?.id().to_string())
        }));
    }
    let mut results = Vec::new();
    for task in tasks {
        let started = Instant::now();
        match task.await {
            Ok(new_id) => {
                service.metrics.create_done(started.elapsed());
                let record = NewRecord {
                    template: source.template.clone(),
                    on_timeout: source.on_timeout,
                    auto_resume: source.auto_resume,
                    metadata: source.metadata.clone(),
                    memory_mib: source.memory_mib,
                    networked: false,
                }
                .record(new_id, timeout)?;
                let forked = service.insert(record.clone());
                service.save(&forked)?;
                results.push(json!({ "sandbox": sandbox_json(&service, &record) }));
            }
            Err(e) => {
                service.metrics.create_failed();
                results
                    .push(json!({ "error": { "code": e.status.as_u16(), "message": e.message } }));
            }
        }
    }
    Ok((StatusCode::CREATED, Json(results)).into_response())
}

#[derive(Deserialize, Default)]
struct SnapshotBody {
    name: Option<String>,
    memory: Option<bool>,
}

async fn create_snapshot(
    State(service): Svc,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    let req: SnapshotBody = body(&raw)?;
    let _op = entry.op.lock().await;
    if entry.is_paused() {
        return Err(ApiError::conflict(format!("Sandbox {id} is paused")));
    }
    entry.drop_connections("the sandbox was snapshotted");
    let sid = entry.id.clone();
    let snap = service
        .blocking(move |rt| Ok(rt.attach(&sid)?.snapshot()?))
        .await?;
    if req.memory == Some(true) && snap.kind != cube_core::SnapshotKind::Full {
        tracing::warn!(snapshot = %snap.id, reason = ?snap.fallback, "a full snapshot was asked for; it holds the files only");
    }
    let mut names = vec![snap.id.clone()];
    if let Some(name) = req.name.filter(|n| !n.is_empty()) {
        names.push(name);
    }
    Ok((
        StatusCode::CREATED,
        Json(json!({ "snapshotID": snap.id, "names": names })),
    )
        .into_response())
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct SnapshotQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    name: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
}

async fn list_snapshots(
    State(service): Svc,
    Query(q): Query<SnapshotQuery>,
) -> Result<Response, ApiError> {
    let owner = match &q.sandbox_id {
        Some(e2b) => Some(
            ids::to_cube(e2b)
                .ok_or_else(|| ApiError::not_found(format!("Sandbox {e2b} not found")))?,
        ),
        None => None,
    };
    let served: std::collections::HashSet<String> =
        service.all().iter().map(|e| e.id.clone()).collect();
    let mut snaps = service
        .blocking(move |rt| Ok(rt.snapshots(owner.as_deref())?))
        .await?;
    snaps.retain(|s| served.contains(&s.sandbox));
    if let Some(name) = &q.name {
        snaps.retain(|s| &s.id == name);
    }
    let start = match &q.next_token {
        Some(t) => snaps
            .iter()
            .position(|s| &s.id == t)
            .ok_or_else(|| ApiError::bad_request("Unknown nextToken"))?,
        None => 0,
    };
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let page: Vec<Value> = snaps
        .iter()
        .skip(start)
        .take(limit)
        .map(|s| json!({ "snapshotID": s.id, "names": [s.id], "sandboxID": ids::to_e2b(&s.sandbox) }))
        .collect();
    let mut resp = Json(page).into_response();
    if let Some(next) = snaps.get(start + limit) {
        if let Ok(v) = HeaderValue::from_str(&next.id) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(resp)
}

async fn delete_snapshot(
    State(service): Svc,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if !id.starts_with("snap-") {
        return Err(ApiError::not_found(format!(
            "Snapshot {id} not found (templates are managed with `cube template`)"
        )));
    }
    service
        .blocking(move |rt| Ok(rt.remove_snapshot(&id)?))
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn metrics(State(service): Svc, Path(id): Path<String>) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    let sample = crate::usage::sample(&service, &entry).await?;
    Ok(Json(vec![sample]).into_response())
}

async fn update_network(
    State(service): Svc,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    let req: NetworkBody = body(&raw)?;
    if !lock(&entry.record).networked {
        return Err(ApiError::conflict(format!(
            "Sandbox {id} was created without a network (create it with allow_internet_access or network rules)"
        )));
    }
    let policy = NetworkPolicy {
        internet: req.allow_internet_access.unwrap_or(true),
        allow_out: req.allow_out.unwrap_or_default(),
        deny_out: req.deny_out.unwrap_or_default(),
    };
    let sid = entry.id.clone();
    service
        .blocking(move |rt| Ok(rt.attach(&sid)?.set_policy(&policy)?))
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RollbackBody {
    #[serde(rename = "snapshotID")]
    snapshot_id: String,
}

/// Cube's addition: puts a sandbox back to one of its snapshots (same id).
async fn rollback(
    State(service): Svc,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    let req: RollbackBody = body(&raw)?;
    let _op = entry.op.lock().await;
    if entry.is_paused() {
        return Err(ApiError::conflict(format!("Sandbox {id} is paused")));
    }
    entry.drop_connections("the sandbox was rolled back");
    let sid = entry.id.clone();
    service
        .blocking(move |rt| Ok(rt.attach(&sid)?.rollback(&req.snapshot_id)?))
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Cube's addition: hibernates (state to disk, memory released) whatever the pause mode.
async fn hibernate(State(service): Svc, Path(id): Path<String>) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    let _op = entry.op.lock().await;
    if entry.is_paused() {
        return Err(ApiError::conflict(format!(
            "Sandbox {id} is already paused"
        )));
    }
    entry.drop_connections("the sandbox was hibernated");
    let sid = entry.id.clone();
    service
        .blocking(move |rt| Ok(rt.attach(&sid)?.hibernate()?))
        .await?;
    lock(&entry.record).paused = Some(PauseKind::Hibernated);
    service.save(&entry)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Cube's addition: wakes a hibernated (or paused) sandbox; the same as connect.
async fn wake(State(service): Svc, Path(id): Path<String>) -> Result<Response, ApiError> {
    let entry = service.get_e2b(&id)?;
    let timeout = service.timeout(None)?;
    if !resume_entry(&service, &entry, timeout).await? {
        return Err(ApiError::conflict(format!("Sandbox {id} is running")));
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The API key check for the control plane (E2B's `X-API-KEY`).
pub fn authorized(service: &Service, headers: &HeaderMap) -> Result<(), ApiError> {
    let key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if key.is_empty() || !service.key_ok(key) {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "Invalid API key (X-API-KEY)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filters_decode() {
        let m = metadata_filter("team%20a=x%3Dy&k=v");
        assert_eq!(m["team a"], "x=y");
        assert_eq!(m["k"], "v");
    }

    #[test]
    fn network_is_attached_only_when_asked() {
        assert!(network_options(None, None).is_none());
        assert!(network_options(Some(false), None).is_none());
        let n = network_options(Some(true), None).unwrap();
        assert!(n.policy.internet);
        let rules = NetworkBody {
            deny_out: Some(vec!["10.0.0.0/8".into()]),
            ..NetworkBody::default()
        };
        let n = network_options(None, Some(&rules)).unwrap();
        assert_eq!(n.policy.deny_out, ["10.0.0.0/8"]);
    }
}
