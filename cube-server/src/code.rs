//! The code interpreter E2B's `e2b-code-interpreter` SDKs talk to (port 49999):
//! `POST /execute` answers with NDJSON lines (stdout, stderr, results with their text
//! and rich forms, the error, the execution count), `/contexts` creates, lists,
//! restarts and deletes contexts. Contexts are the agent's stateful interpreter
//! contexts; `run_code` without one uses a default context per language.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use cube_agent::client::ClientError;
use cube_agent::protocol::{CodeResult, ErrorCode, Language};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::lock::lock;
use crate::service::{now_ms, Entry, Service};

/// The port the code interpreter listens on in E2B sandboxes.
pub const PORT: u16 = 49999;

fn language(name: Option<&str>) -> Result<(Language, &'static str), ApiError> {
    match name.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") | Some("python") | Some("python3") => Ok((Language::Python, "python")),
        Some("bash") | Some("sh") => Ok((Language::Bash, "bash")),
        Some(other) => Err(ApiError::bad_request(format!(
            "Language {other:?} is not supported by Cube (python, bash)"
        ))),
    }
}

/// The default context of a language (made on first use).
fn default_context(lang: &str) -> String {
    format!("default-{lang}")
}

/// Runs a request of the code interpreter.
pub async fn handle(
    service: Arc<Service>,
    entry: Arc<Entry>,
    method: Method,
    path: &str,
    body: Bytes,
) -> Response {
    let result = match (method, path.trim_end_matches('/')) {
        (Method::POST, "/execute") => return execute(service, entry, body).await,
        (Method::POST, "/contexts") => create_context(&service, &entry, &body).await,
        (Method::GET, "/contexts") => list_contexts(&service, &entry).await,
        (Method::GET, "/health") => Ok(StatusCode::NO_CONTENT.into_response()),
        (m, p) => {
            let rest = p.strip_prefix("/contexts/").unwrap_or("");
            match (m, rest.split_once('/')) {
                (Method::DELETE, None) if !rest.is_empty() => {
                    delete_context(&service, &entry, rest).await
                }
                (Method::POST, Some((id, "restart"))) => {
                    restart_context(&service, &entry, id).await
                }
                _ => Err(ApiError::not_found(format!(
                    "No code interpreter route {p}"
                ))),
            }
        }
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Deserialize, Default)]
struct ContextBody {
    language: Option<String>,
    cwd: Option<String>,
}

async fn create_context(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    raw: &Bytes,
) -> Result<Response, ApiError> {
    let req: ContextBody = parse(raw)?;
    let (lang, lang_name) = language(req.language.as_deref())?;
    let cwd = req
        .cwd
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| crate::envd::HOME.to_string());
    let id = crate::service::new_token()?;
    let (name, dir) = (id.clone(), cwd.clone());
    service
        .with_agent(entry, move |c| c.create_context(&name, lang, Some(&dir)))
        .await?;
    lock(&entry.record)
        .contexts
        .insert(id.clone(), (lang_name.to_string(), cwd.clone()));
    service.save(entry)?;
    Ok(axum::Json(json!({ "id": id, "language": lang_name, "cwd": cwd })).into_response())
}

async fn list_contexts(service: &Arc<Service>, entry: &Arc<Entry>) -> Result<Response, ApiError> {
    let alive = service.with_agent(entry, |c| c.list_contexts()).await?;
    let known = lock(&entry.record).contexts.clone();
    let list: Vec<Value> = alive
        .iter()
        .map(|ctx| {
            let (lang, cwd) = known.get(&ctx.name).cloned().unwrap_or_else(|| {
                let lang = match ctx.language {
                    Language::Python => "python",
                    Language::Bash => "bash",
                };
                (lang.to_string(), crate::envd::HOME.to_string())
            });
            json!({ "id": ctx.name, "language": lang, "cwd": cwd })
        })
        .collect();
    Ok(axum::Json(list).into_response())
}

async fn delete_context(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    id: &str,
) -> Result<Response, ApiError> {
    let name = id.to_string();
    service
        .with_agent(entry, move |c| c.delete_context(&name))
        .await?;
    lock(&entry.record).contexts.remove(id);
    lock(&entry.executions).remove(id);
    service.save(entry)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn restart_context(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    id: &str,
) -> Result<Response, ApiError> {
    let (lang_name, cwd) = lock(&entry.record)
        .contexts
        .get(id)
        .cloned()
        .ok_or_else(|| ApiError::not_found(format!("No context {id}")))?;
    let (lang, _) = language(Some(&lang_name))?;
    let name = id.to_string();
    service
        .with_agent(entry, move |c| {
            match c.delete_context(&name) {
                Ok(()) | Err(ClientError::Agent(_)) => {}
                Err(e) => return Err(e),
            }
            c.create_context(&name, lang, Some(&cwd))
        })
        .await?;
    lock(&entry.executions).remove(id);
    Ok(StatusCode::NO_CONTENT.into_response())
}

fn parse<T: serde::de::DeserializeOwned + Default>(raw: &Bytes) -> Result<T, ApiError> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(raw).map_err(|e| ApiError::bad_request(format!("Bad request body: {e}")))
}

#[derive(Deserialize, Default)]
struct ExecuteBody {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<BTreeMap<String, String>>,
}

/// Python that sets (or, with `restore`, puts back) environment variables for a cell.
fn python_env(vars: &BTreeMap<String, String>, restore: bool) -> String {
    let pairs = serde_json::to_string(vars).unwrap_or_else(|_| "{}".into());
    if restore {
        "import os as __cube_os\nfor __k, __v in __cube_saved_env.items():\n    \
         __cube_os.environ.pop(__k, None) if __v is None else __cube_os.environ.__setitem__(__k, __v)\n\
         del __cube_saved_env, __cube_os"
            .to_string()
    } else {
        format!(
            "import os as __cube_os, json as __cube_json\n__cube_new = __cube_json.loads({pairs:?})\n\
             __cube_saved_env = {{k: __cube_os.environ.get(k) for k in __cube_new}}\n\
             __cube_os.environ.update(__cube_new)\ndel __cube_new, __cube_os, __cube_json"
        )
    }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// One NDJSON line.
fn line(v: Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

fn timestamp() -> String {
    let ms = now_ms();
    crate::envd::json::rfc3339((ms / 1000) as i64, ((ms % 1000) * 1_000_000) as u32)
}

/// The result lines of a cell: the value with its rich forms as the main result,
/// figures left open as further results.
fn result_lines(result: &CodeResult) -> Vec<Value> {
    let b64 = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
    let text_of = |d: &[u8]| String::from_utf8_lossy(d).into_owned();
    let mut main = json!({ "type": "result", "is_main_result": true });
    let mut extra = Vec::new();
    let mut has_main = false;
    if let Some(value) = &result.value {
        main["text"] = json!(value);
        has_main = true;
    }
    for rich in &result.rich {
        let (key, val) = match rich.mime.as_str() {
            "image/png" => ("png", json!(b64(&rich.data))),
            "image/jpeg" => ("jpeg", json!(b64(&rich.data))),
            "image/svg+xml" => ("svg", json!(text_of(&rich.data))),
            "text/html" => ("html", json!(text_of(&rich.data))),
            "text/markdown" => ("markdown", json!(text_of(&rich.data))),
            "text/latex" => ("latex", json!(text_of(&rich.data))),
            "application/json" => (
                "json",
                serde_json::from_slice(&rich.data).unwrap_or(Value::Null),
            ),
            "application/javascript" => ("javascript", json!(text_of(&rich.data))),
            "application/pdf" => ("pdf", json!(b64(&rich.data))),
            _ => continue,
        };
        if has_main && main.get(key).is_none() {
            main[key] = val;
        } else {
            // A form the value already has, or no value: a figure of its own.
            extra.push(json!({ "type": "result", "is_main_result": false, key: val }));
        }
    }
    let mut out = Vec::new();
    if has_main {
        out.push(main);
    }
    out.extend(extra);
    out
}

/// The NDJSON lines of a finished cell.
fn cell_lines(result: &CodeResult, lang: Language, count: u64) -> Vec<Bytes> {
    let mut lines = Vec::new();
    if !result.stdout.is_empty() {
        lines.push(line(
            json!({ "type": "stdout", "text": result.stdout, "timestamp": timestamp() }),
        ));
    }
    if !result.stderr.is_empty() {
        lines.push(line(
            json!({ "type": "stderr", "text": result.stderr, "timestamp": timestamp() }),
        ));
    }
    for r in result_lines(result) {
        lines.push(line(r));
    }
    if let Some(e) = &result.error {
        lines.push(line(json!({
            "type": "error", "name": e.name, "value": e.value, "traceback": e.traceback,
        })));
    } else if result.timed_out {
        lines.push(line(json!({
            "type": "error", "name": "TimeoutError", "value": "The cell was interrupted at its timeout", "traceback": "",
        })));
    } else if lang == Language::Bash {
        if let Some(status) = result.exit_status.filter(|s| *s != 0) {
            lines.push(line(json!({
                "type": "error", "name": "ExitError", "value": format!("exit status {status}"), "traceback": "",
            })));
        }
    }
    lines.push(line(
        json!({ "type": "number_of_executions", "execution_count": count }),
    ));
    lines.push(line(json!({ "type": "end_of_execution" })));
    lines
}

async fn execute(service: Arc<Service>, entry: Arc<Entry>, raw: Bytes) -> Response {
    let run = async {
        let req: ExecuteBody = parse(&raw)?;
        if req.context_id.is_some() && req.language.is_some() {
            return Err(ApiError::bad_request(
                "Give a context or a language, not both",
            ));
        }
        let (context, lang) = match &req.context_id {
            Some(id) => {
                let (lang_name, _) = lock(&entry.record)
                    .contexts
                    .get(id)
                    .cloned()
                    .ok_or_else(|| ApiError::not_found(format!("No context {id}")))?;
                (id.clone(), language(Some(&lang_name))?.0)
            }
            None => {
                let (lang, name) = language(req.language.as_deref())?;
                (default_context(name), lang)
            }
        };
        let env = req.env_vars.unwrap_or_default();
        let (code, ctx) = (req.code, context.clone());
        let result = service
            .with_agent(&entry, move |c| {
                let run = |cell: &str| match c.run_code(&ctx, cell, None) {
                    Err(ClientError::Agent(e)) if e.code == ErrorCode::NoSuchContext => {
                        c.create_context(&ctx, lang, Some(crate::envd::HOME))?;
                        c.run_code(&ctx, cell, None)
                    }
                    other => other,
                };
                if env.is_empty() {
                    return run(&code);
                }
                let (set, unset) = match lang {
                    Language::Python => (python_env(&env, false), python_env(&env, true)),
                    Language::Bash => (
                        env.iter()
                            .map(|(k, v)| format!("export {k}={}", shell_quote(v)))
                            .collect::<Vec<_>>()
                            .join("\n"),
                        format!(
                            "unset {}",
                            env.keys().cloned().collect::<Vec<_>>().join(" ")
                        ),
                    ),
                };
                run(&set)?;
                let result = run(&code);
                let _ = run(&unset);
                result
            })
            .await?;
        let count = {
            let mut counts = lock(&entry.executions);
            let n = counts.entry(context).or_insert(0);
            *n += 1;
            *n
        };
        Ok(cell_lines(&result, lang, count))
    };
    match run.await {
        Ok(lines) => {
            let stream = futures_util::stream::iter(
                lines.into_iter().map(Ok::<Bytes, std::convert::Infallible>),
            );
            let mut resp = Response::new(Body::from_stream(stream));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/x-ndjson"),
            );
            resp
        }
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cube_agent::protocol::{CodeError, RichOutput};

    #[test]
    fn a_cell_becomes_the_lines_the_sdks_parse() {
        let result = CodeResult {
            stdout: "hi\n".into(),
            value: Some("42".into()),
            rich: vec![
                RichOutput {
                    mime: "text/html".into(),
                    data: b"<b>42</b>".to_vec(),
                },
                RichOutput {
                    mime: "image/png".into(),
                    data: vec![1, 2, 3],
                },
            ],
            ..CodeResult::default()
        };
        let lines: Vec<Value> = cell_lines(&result, Language::Python, 3)
            .iter()
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        assert_eq!(lines[0]["type"], "stdout");
        assert_eq!(lines[1]["text"], "42");
        assert_eq!(lines[1]["html"], "<b>42</b>");
        assert_eq!(lines[1]["png"], "AQID");
        assert_eq!(lines[1]["is_main_result"], true);
        assert_eq!(lines[2]["execution_count"], 3);
        let failed = CodeResult {
            error: Some(CodeError {
                name: "ZeroDivisionError".into(),
                value: "division by zero".into(),
                traceback: "Traceback...".into(),
            }),
            ..CodeResult::default()
        };
        let lines = cell_lines(&failed, Language::Python, 1);
        let err: Value = serde_json::from_slice(&lines[0]).unwrap();
        assert_eq!(err["name"], "ZeroDivisionError");
    }

    #[test]
    fn figures_without_a_value_are_results_of_their_own() {
        let result = CodeResult {
            rich: vec![RichOutput {
                mime: "image/png".into(),
                data: vec![9],
            }],
            ..CodeResult::default()
        };
        let r = result_lines(&result);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0]["is_main_result"], false);
    }

    #[test]
    fn languages_map_to_agent_contexts() {
        assert!(matches!(language(None), Ok((Language::Python, "python"))));
        assert!(matches!(
            language(Some("bash")),
            Ok((Language::Bash, "bash"))
        ));
        assert_eq!(
            language(Some("r")).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }
}
