//! envd, E2B's in-sandbox daemon (port 49983), served from the host on Cube's agent:
//! the Connect RPC services `process.Process` and `filesystem.Filesystem`, and the
//! HTTP routes `/files` and `/health`.

pub mod connect;
pub mod files;
pub mod filesystem;
pub mod json;
pub mod process;
pub mod proto;
pub mod watch;
pub mod watchers;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::Response;
use futures_util::StreamExt as _;

use connect::{Code, RpcError};
use proto::{
    Empty, EntryResponse, ListDirRequest, ListDirResponse, ListResponse, MoveRequest, PathRequest,
    SelectorRequest, SendInputRequest, SendSignalRequest, StartRequest, StreamInputEvent,
    StreamInputRequest, UpdateRequest, WatchDirResponse, WatchEvent, WatchRequest, WatcherId,
};

use crate::service::{Entry, Service};

pub use filesystem::HOME;

/// The port envd listens on in E2B sandboxes.
pub const ENVD_PORT: u16 = 49983;

/// How often a client asked for keepalive messages on its streams (seconds, from the
/// `Keepalive-Ping-Interval` header).
fn keepalive(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
}

/// Serves one Connect call, `/<service>/<method>`.
pub async fn rpc(
    service: Arc<Service>,
    entry: Arc<Entry>,
    path: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let shape = match connect::call_shape(&headers) {
        Ok(s) => s,
        Err(e) => return connect::unary_error(&e),
    };
    let codec = shape.codec;
    let fail = |e: RpcError| {
        if shape.streaming {
            connect::stream_error(codec, &e)
        } else {
            connect::unary_error(&e)
        }
    };
    // A client stream carries several messages; every other call exactly one.
    if path == "/process.Process/StreamInput" {
        return match stream_input(&service, &entry, &shape, &body).await {
            Ok(()) => connect::stream_response(
                codec,
                futures_util::stream::iter([Ok::<Empty, RpcError>(Empty {})]),
            ),
            Err(e) => fail(e),
        };
    }
    let message = match connect::request_message(&shape, &body) {
        Ok(m) => m,
        Err(e) => return fail(e),
    };
    macro_rules! decode {
        ($t:ty) => {
            match connect::decode::<$t>(codec, &message) {
                Ok(m) => m,
                Err(e) => return fail(e),
            }
        };
    }
    macro_rules! unary {
        ($result:expr) => {{
            let result = $result;
            connect::unary_response(codec, result)
        }};
    }
    match path {
        "/process.Process/Start" => {
            let req = decode!(StartRequest);
            let client = match service.agent(&entry).await {
                Ok(c) => c,
                Err(e) => return fail(process::rpc_from_api(&e)),
            };
            match process::start(&entry.processes, client, req).await {
                Ok((pid, rx)) => connect::stream_response(
                    codec,
                    process::event_stream(pid, rx, keepalive(&headers), shape.timeout),
                ),
                Err(e) => fail(e),
            }
        }
        "/process.Process/Connect" => {
            let req = decode!(SelectorRequest);
            match entry
                .processes
                .find(req.process.as_ref().and_then(|p| p.selector.as_ref()))
            {
                Ok(proc) => {
                    let rx = proc.subscribe();
                    connect::stream_response(
                        codec,
                        process::event_stream(proc.pid, rx, keepalive(&headers), shape.timeout),
                    )
                }
                Err(e) => fail(e),
            }
        }
        "/process.Process/List" => unary!(Ok::<_, RpcError>(ListResponse {
            processes: entry.processes.list()
        })),
        "/process.Process/SendSignal" => {
            let req = decode!(SendSignalRequest);
            let result = match entry
                .processes
                .find(req.process.as_ref().and_then(|p| p.selector.as_ref()))
            {
                Ok(proc) => process::signal(proc, req.signal).await.map(|()| Empty {}),
                Err(e) => Err(e),
            };
            unary!(result)
        }
        "/process.Process/SendInput" => {
            let req = decode!(SendInputRequest);
            let result = async {
                let proc = entry
                    .processes
                    .find(req.process.as_ref().and_then(|p| p.selector.as_ref()))?;
                let (data, pty) = input_bytes(req.input)?;
                process::write_input(proc, data, pty)
                    .await
                    .map(|()| Empty {})
            }
            .await;
            unary!(result)
        }
        "/process.Process/CloseStdin" => {
            let req = decode!(SelectorRequest);
            let result = match entry
                .processes
                .find(req.process.as_ref().and_then(|p| p.selector.as_ref()))
            {
                Ok(proc) => process::close_stdin(proc).await.map(|()| Empty {}),
                Err(e) => Err(e),
            };
            unary!(result)
        }
        "/process.Process/Update" => {
            let req = decode!(UpdateRequest);
            let result = match entry
                .processes
                .find(req.process.as_ref().and_then(|p| p.selector.as_ref()))
            {
                Ok(proc) => process::resize(proc, req.pty.as_ref())
                    .await
                    .map(|()| Empty {}),
                Err(e) => Err(e),
            };
            unary!(result)
        }
        "/filesystem.Filesystem/Stat" => {
            let req = decode!(PathRequest);
            unary!(stat(&service, &entry, &req.path).await)
        }
        "/filesystem.Filesystem/MakeDir" => {
            let req = decode!(PathRequest);
            unary!(make_dir(&service, &entry, &req.path).await)
        }
        "/filesystem.Filesystem/Move" => {
            let req = decode!(MoveRequest);
            unary!(move_path(&service, &entry, &req).await)
        }
        "/filesystem.Filesystem/ListDir" => {
            let req = decode!(ListDirRequest);
            unary!(list_dir(&service, &entry, &req).await)
        }
        "/filesystem.Filesystem/Remove" => {
            let req = decode!(PathRequest);
            unary!(remove(&service, &entry, &req.path).await)
        }
        "/filesystem.Filesystem/CreateWatcher" => {
            let req = decode!(WatchRequest);
            let result = async {
                let dir = filesystem::resolve(&req.path)?;
                let id = watch::create(&service, &entry, dir, req.recursive).await?;
                Ok(WatcherId { watcher_id: id })
            }
            .await;
            unary!(result)
        }
        "/filesystem.Filesystem/GetWatcherEvents" => {
            let req = decode!(WatcherId);
            unary!(watch::take(&entry, &req.watcher_id)
                .map(|events| proto::GetWatcherEventsResponse { events }))
        }
        "/filesystem.Filesystem/RemoveWatcher" => {
            let req = decode!(WatcherId);
            unary!(watch::remove(&entry, &req.watcher_id).map(|()| Empty {}))
        }
        "/filesystem.Filesystem/WatchDir" => {
            let req = decode!(WatchRequest);
            match watch_dir(service, entry, req, keepalive(&headers)).await {
                Ok(stream) => connect::stream_response(codec, stream),
                Err(e) => fail(e),
            }
        }
        other => fail(RpcError::new(
            Code::Unimplemented,
            format!("{other} is not a method of envd's services"),
        )),
    }
}

/// The bytes of an input message, and whether they are for a terminal (`pty`).
fn input_bytes(input: Option<proto::ProcessInput>) -> Result<(Vec<u8>, bool), RpcError> {
    match input.and_then(|i| i.input) {
        Some(proto::Input::Stdin(data)) => Ok((data, false)),
        Some(proto::Input::Pty(data)) => Ok((data, true)),
        None => Err(RpcError::new(Code::InvalidArgument, "No input")),
    }
}

/// `StreamInput`: a start message naming the process, then input messages.
async fn stream_input(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    shape: &connect::CallShape,
    body: &[u8],
) -> Result<(), RpcError> {
    let _ = service;
    let messages = connect::unenvelope(shape, body)?;
    let mut proc = None;
    for raw in messages {
        let msg: StreamInputRequest = connect::decode(shape.codec, &raw)?;
        match msg.event {
            Some(StreamInputEvent::Start(start)) => {
                proc = Some(
                    entry
                        .processes
                        .find(start.process.as_ref().and_then(|p| p.selector.as_ref()))?,
                );
            }
            Some(StreamInputEvent::Data(data)) => {
                let p = proc.clone().ok_or_else(|| {
                    RpcError::new(Code::InvalidArgument, "Input before the start message")
                })?;
                let (bytes, pty) = input_bytes(data.input)?;
                process::write_input(p, bytes, pty).await?;
            }
            Some(StreamInputEvent::Keepalive(_)) | None => {}
        }
    }
    Ok(())
}

async fn agent<T, F>(service: &Arc<Service>, entry: &Arc<Entry>, f: F) -> Result<T, RpcError>
where
    T: Send + 'static,
    F: Fn(&cube_agent::client::Client) -> Result<T, cube_agent::client::ClientError>
        + Send
        + Sync
        + 'static,
{
    service
        .with_agent(entry, f)
        .await
        .map_err(|e| process::rpc_from_api(&e))
}

async fn stat(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    path: &str,
) -> Result<EntryResponse, RpcError> {
    let p = filesystem::resolve(path)?;
    let info = agent(service, entry, move |c| c.stat(&p)).await?;
    Ok(EntryResponse {
        entry: Some(filesystem::entry_info(&info)),
    })
}

async fn make_dir(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    path: &str,
) -> Result<EntryResponse, RpcError> {
    let p = filesystem::resolve(path)?;
    let check = p.clone();
    if agent(service, entry, move |c| c.exists(&check)).await? {
        return Err(RpcError::new(
            Code::AlreadyExists,
            format!("{p} already exists"),
        ));
    }
    let made = p.clone();
    agent(service, entry, move |c| c.make_dir(&made, true)).await?;
    stat(service, entry, &p).await
}

async fn move_path(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    req: &MoveRequest,
) -> Result<EntryResponse, RpcError> {
    let from = filesystem::resolve(&req.source)?;
    let to = filesystem::resolve(&req.destination)?;
    let dest = to.clone();
    agent(service, entry, move |c| c.rename(&from, &to)).await?;
    stat(service, entry, &dest).await
}

async fn list_dir(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    req: &ListDirRequest,
) -> Result<ListDirResponse, RpcError> {
    let p = filesystem::resolve(&req.path)?;
    let depth = req.depth.max(1);
    let dir = p.clone();
    let info = agent(service, entry, move |c| c.stat(&dir)).await?;
    if info.kind != cube_agent::protocol::FileKind::Dir {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!("{p} is not a directory"),
        ));
    }
    let infos = agent(service, entry, move |c| c.list_dir(&p, depth)).await?;
    Ok(ListDirResponse {
        entries: infos.iter().map(filesystem::entry_info).collect(),
    })
}

async fn remove(service: &Arc<Service>, entry: &Arc<Entry>, path: &str) -> Result<Empty, RpcError> {
    let p = filesystem::resolve(path)?;
    agent(service, entry, move |c| c.remove(&p, true)).await?;
    Ok(Empty {})
}

/// `WatchDir`: a start event, then events as polling finds them, until the client
/// goes away.
async fn watch_dir(
    service: Arc<Service>,
    entry: Arc<Entry>,
    req: WatchRequest,
    keepalive: Option<Duration>,
) -> Result<impl futures_util::Stream<Item = Result<WatchDirResponse, RpcError>> + Send, RpcError> {
    let dir = filesystem::resolve(&req.path)?;
    let first = watch::list(&service, &entry, &dir, req.recursive).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<WatchDirResponse, RpcError>>(64);
    let _ = tx
        .send(Ok(WatchDirResponse {
            event: Some(WatchEvent::Start(Empty {})),
        }))
        .await;
    tokio::spawn(async move {
        let mut last = first;
        let mut quiet = Duration::ZERO;
        loop {
            tokio::time::sleep(watch::POLL).await;
            if tx.is_closed() {
                return;
            }
            let now = match watch::list(&service, &entry, &dir, req.recursive).await {
                Ok(now) => now,
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            let events = watch::diff(&last, &now);
            last = now;
            quiet = if events.is_empty() {
                quiet + watch::POLL
            } else {
                Duration::ZERO
            };
            for ev in events {
                let msg = WatchDirResponse {
                    event: Some(WatchEvent::Filesystem(ev)),
                };
                if tx.send(Ok(msg)).await.is_err() {
                    return;
                }
            }
            if keepalive.is_some_and(|k| quiet >= k) {
                quiet = Duration::ZERO;
                let msg = WatchDirResponse {
                    event: Some(WatchEvent::Keepalive(Empty {})),
                };
                if tx.send(Ok(msg)).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .boxed())
}
