//! The admin listener: Prometheus metrics (`/metrics`, no key: meant for a scraper on a
//! private address) and a small dashboard (`/`, one static page served from the
//! binary) whose JSON API (`/api/...`) needs an API key in `X-API-KEY`: the page asks
//! for it once, or reads it from the URL fragment (`/#key=...`).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::error::ApiError;
use crate::lock::lock;
use crate::service::{now_ms, Service};

/// The dashboard page.
const DASHBOARD: &str = include_str!("dashboard.html");

type Svc = State<Arc<Service>>;

/// The admin listener's routes.
pub fn router(service: Arc<Service>) -> Router {
    Router::new()
        .route("/", get(|| async { Html(DASHBOARD) }))
        .route("/metrics", get(metrics))
        .route("/api/sandboxes", get(sandboxes))
        .route("/api/sandboxes/{id}/pause", post(pause))
        .route("/api/sandboxes/{id}/resume", post(resume))
        .route("/api/sandboxes/{id}/kill", post(kill))
        .fallback(|| async { ApiError::not_found("No such route") })
        .with_state(service)
}

async fn metrics(State(service): Svc) -> Response {
    let all = service.all();
    let paused = all.iter().filter(|e| e.is_paused()).count();
    let mut resp = service
        .metrics
        .render(all.len() - paused, paused)
        .into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    resp
}

async fn sandboxes(State(service): Svc, headers: HeaderMap) -> Result<Response, ApiError> {
    crate::control::authorized(&service, &headers)?;
    let entries = service.all();
    let snapshots = service
        .blocking(|rt| Ok(rt.snapshots(None)?))
        .await
        .unwrap_or_default();
    let mut rows = Vec::new();
    let now = now_ms();
    for entry in entries {
        let r = entry.snapshot();
        let usage = if r.paused.is_none() {
            crate::usage::sample(&service, &entry).await.ok()
        } else {
            None
        };
        let snaps: Vec<_> = snapshots
            .iter()
            .filter(|s| s.sandbox == r.id)
            .map(|s| json!({ "id": s.id, "kind": s.kind.to_string() }))
            .collect();
        rows.push(json!({
            "sandboxID": crate::ids::to_e2b(&r.id),
            "template": r.template,
            "state": if r.paused.is_some() { "paused" } else { "running" },
            "ageSecs": now.saturating_sub(r.started_ms) / 1000,
            "endsInSecs": r.end_ms.saturating_sub(now) / 1000,
            "memUsed": usage.as_ref().map(|u| u["memUsed"].clone()),
            "cpuUsedPct": usage.as_ref().map(|u| u["cpuUsedPct"].clone()),
            "metadata": r.metadata,
            "snapshots": snaps,
        }));
    }
    rows.sort_by_key(|r| r["ageSecs"].as_u64().map(std::cmp::Reverse));
    Ok(Json(rows).into_response())
}

async fn pause(
    State(service): Svc,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    crate::control::authorized(&service, &headers)?;
    let entry = service.get_e2b(&id)?;
    crate::control::pause_entry(&service, &entry).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn resume(
    State(service): Svc,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    crate::control::authorized(&service, &headers)?;
    let entry = service.get_e2b(&id)?;
    let timeout = service.config.default_timeout;
    crate::control::resume_entry(&service, &entry, timeout).await?;
    let _ = lock(&entry.record).end_ms;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn kill(
    State(service): Svc,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    crate::control::authorized(&service, &headers)?;
    let entry = service.get_e2b(&id)?;
    crate::control::kill_entry(&service, &entry).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
