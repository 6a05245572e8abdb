//! One origin serves both planes. A request belongs to a sandbox when it names one (the
//! `E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers the SDKs send with `E2B_SANDBOX_URL`, or
//! a `<port>-<sandboxID>.<domain>` host name) or carries a sandbox token without an API
//! key (older code-interpreter SDKs send only `X-Access-Token`), unless it carries an API
//! key to a control-plane path (older SDKs send the sandbox headers on `connect`);
//! everything else is the control plane and needs an API key.
//!
//! Sandbox traffic must carry that sandbox's envd access token (`X-Access-Token`) or
//! its traffic token (`E2B-Traffic-Access-Token`), or, for `/files`, a URL signed with
//! the envd token; one sandbox's token never opens another.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use sha2::Digest as _;
use subtle::ConstantTimeEq as _;
use tower::ServiceExt as _;

use crate::error::ApiError;
use crate::lock::lock;
use crate::service::{Entry, Service};

/// Request bodies of the RPC and code routes are read whole, up to this.
const MAX_RPC_BODY: usize = 16 << 20;

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

fn query_map(query: Option<&str>) -> HashMap<String, String> {
    query
        .map(|q| {
            crate::query::pairs(q)
                .into_iter()
                .collect::<HashMap<String, String>>()
        })
        .unwrap_or_default()
}

/// Where a sandbox request goes.
struct Target {
    entry: Arc<Entry>,
    port: u16,
}

/// Answers for a sandbox the server does not (or no longer) serve, worded as E2B's
/// proxy words them so that the SDKs report the sandbox as not running.
fn gone(what: &str) -> Response {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!("The sandbox {what} was not found"),
    )
    .into_response()
}

/// Serves one request on the main listener.
pub async fn dispatch(
    service: Arc<Service>,
    control: axum::Router,
    req: Request<Body>,
) -> Response {
    let resp = route(service.clone(), control, req).await;
    service.metrics.request(resp.status().as_u16());
    resp
}

async fn route(service: Arc<Service>, control: axum::Router, req: Request<Body>) -> Response {
    let headers = req.headers();
    let by_header = header(headers, "e2b-sandbox-id").map(str::to_string);
    let by_host = header(headers, "host").and_then(crate::ids::parse_sandbox_host);
    let token = header(headers, "x-access-token")
        .or_else(|| header(headers, "e2b-traffic-access-token"))
        .map(str::to_string);
    let has_key = header(headers, "x-api-key").is_some();
    let signed =
        req.uri().path() == "/files" && req.uri().query().is_some_and(|q| q.contains("signature="));
    // Older SDKs send the sandbox headers on control-plane calls too (connect): a
    // request with an API key to a control-plane path is the control plane's.
    let p = req.uri().path();
    let control_path = ["/sandboxes", "/v2/", "/snapshots", "/templates"]
        .iter()
        .any(|prefix| p.starts_with(prefix));
    let sandbox_plane = !(has_key && control_path)
        && (by_header.is_some() || by_host.is_some() || (!has_key && (token.is_some() || signed)));
    if !sandbox_plane {
        if let Err(e) = crate::control::authorized(&service, headers) {
            return e.into_response();
        }
        return match control.oneshot(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
    }
    let path = req.uri().path().to_string();
    let explicit_port = header(headers, "e2b-sandbox-port").and_then(|p| p.parse::<u16>().ok());
    let inferred_port =
        if path == "/execute" || path == "/contexts" || path.starts_with("/contexts/") {
            crate::code::PORT
        } else {
            crate::envd::ENVD_PORT
        };
    let target = if let Some(id) = &by_header {
        match service.get_e2b(id) {
            Ok(entry) => Target {
                entry,
                port: explicit_port.unwrap_or(inferred_port),
            },
            Err(_) => return gone(id),
        }
    } else if let Some((port, cube_id)) = &by_host {
        match service.get(cube_id) {
            Some(entry) => Target { entry, port: *port },
            None => return gone(&crate::ids::to_e2b(cube_id)),
        }
    } else {
        match token.as_deref().and_then(|t| service.by_token(t)) {
            Some(entry) => Target {
                entry,
                port: explicit_port.unwrap_or(inferred_port),
            },
            None if signed => {
                return ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "A signed URL needs the E2b-Sandbox-Id header or a sandbox host name",
                )
                .into_response()
            }
            None => {
                return ApiError::new(StatusCode::UNAUTHORIZED, "Unknown sandbox access token")
                    .into_response()
            }
        }
    };
    if let Err(e) = check_token(&target.entry, headers, &req, token.as_deref()) {
        return e.into_response();
    }
    let entry = target.entry;
    if entry.is_paused() {
        let auto = lock(&entry.record).auto_resume;
        if !auto {
            return ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!(
                    "The sandbox {} is paused: connect to it to resume it",
                    crate::ids::to_e2b(&entry.id)
                ),
            )
            .into_response();
        }
        let timeout = service.config.default_timeout;
        if let Err(e) = crate::control::resume_entry(&service, &entry, timeout).await {
            return e.into_response();
        }
    }
    match target.port {
        crate::envd::ENVD_PORT => envd(service, entry, req).await,
        crate::code::PORT => {
            let (parts, body) = req.into_parts();
            let body = match crate::proxy::collect(body, MAX_RPC_BODY).await {
                Ok(b) => b,
                Err(e) => return e.into_response(),
            };
            crate::code::handle(service, entry, parts.method, parts.uri.path(), body).await
        }
        port => crate::proxy::forward(service, entry, port, req).await,
    }
}

/// Whether the request may drive this sandbox: its envd token, its traffic token, or
/// (for `/files`) a valid signature made with the envd token.
fn check_token(
    entry: &Entry,
    headers: &HeaderMap,
    req: &Request<Body>,
    _any: Option<&str>,
) -> Result<(), ApiError> {
    let record = lock(&entry.record);
    let matches = |name: &str, want: &str| {
        header(headers, name).is_some_and(|t| bool::from(t.as_bytes().ct_eq(want.as_bytes())))
    };
    if matches("x-access-token", &record.envd_token)
        || matches("e2b-traffic-access-token", &record.traffic_token)
    {
        return Ok(());
    }
    if req.uri().path() == "/files" {
        let q = query_map(req.uri().query());
        if let Some(sig) = q.get("signature") {
            let op = if req.method() == Method::GET {
                "read"
            } else {
                "write"
            };
            return check_signature(&q, sig, op, &record.envd_token);
        }
    }
    Err(ApiError::new(
        StatusCode::UNAUTHORIZED,
        "This sandbox's access token is required (X-Access-Token)",
    ))
}

/// E2B's v1 file URL signature: `v1_` and the unpadded base64 of
/// SHA-256(`path:operation:user:token[:expiration]`).
fn check_signature(
    q: &HashMap<String, String>,
    sig: &str,
    op: &str,
    token: &str,
) -> Result<(), ApiError> {
    let path = q.get("path").map(String::as_str).unwrap_or("");
    let user = q.get("username").map(String::as_str).unwrap_or("");
    let raw = match q.get("signature_expiration") {
        Some(exp) => {
            let when: u64 = exp
                .parse()
                .map_err(|_| ApiError::bad_request("Bad signature_expiration"))?;
            if when * 1000 < crate::service::now_ms() {
                return Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "The signed URL has expired",
                ));
            }
            format!("{path}:{op}:{user}:{token}:{exp}")
        }
        None => format!("{path}:{op}:{user}:{token}"),
    };
    let digest = sha2::Sha256::digest(raw.as_bytes());
    let want = format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    );
    if bool::from(want.as_bytes().ct_eq(sig.as_bytes())) {
        Ok(())
    } else {
        Err(ApiError::new(StatusCode::UNAUTHORIZED, "Bad signature"))
    }
}

/// envd's routes.
async fn envd(service: Arc<Service>, entry: Arc<Entry>, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let query = query_map(parts.uri.query());
    match (parts.method.clone(), path.as_str()) {
        (Method::GET, "/health") => StatusCode::NO_CONTENT.into_response(),
        (Method::GET, "/files") => {
            crate::envd::files::read(service, entry, query, &parts.headers).await
        }
        (Method::POST, "/files") => {
            crate::envd::files::write(service, entry, query, parts.headers, body).await
        }
        (Method::POST, p)
            if p.starts_with("/process.Process/") || p.starts_with("/filesystem.Filesystem/") =>
        {
            let body = match crate::proxy::collect(body, MAX_RPC_BODY).await {
                Ok(b) => b,
                Err(e) => {
                    return crate::envd::connect::unary_error(&crate::envd::process::rpc_from_api(
                        &e,
                    ))
                }
            };
            crate::envd::rpc(service, entry, p, parts.headers, body).await
        }
        (_, p) => ApiError::not_found(format!("No envd route {p}")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_match_the_sdks() {
        // sha256("/home/user/a.txt:read::tok"), as the SDKs' get_signature computes it.
        let raw = "/home/user/a.txt:read::tok";
        let digest = sha2::Sha256::digest(raw.as_bytes());
        let sig = format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
        );
        let q: HashMap<String, String> =
            [("path".to_string(), "/home/user/a.txt".to_string())].into();
        assert!(check_signature(&q, &sig, "read", "tok").is_ok());
        assert!(check_signature(&q, &sig, "write", "tok").is_err());
        assert!(check_signature(&q, &sig, "read", "other").is_err());
        let expired: HashMap<String, String> = [
            ("path".to_string(), "/a".to_string()),
            ("signature_expiration".to_string(), "1".to_string()),
        ]
        .into();
        assert_eq!(
            check_signature(&expired, "v1_x", "read", "tok")
                .unwrap_err()
                .status,
            StatusCode::UNAUTHORIZED
        );
    }

    #[test]
    fn queries_decode() {
        let q = query_map(Some("path=%2Fhome%2Fuser%2Fa+b.txt&username=user"));
        assert_eq!(q["path"], "/home/user/a b.txt");
        assert_eq!(q["username"], "user");
    }
}
