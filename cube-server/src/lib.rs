//! `cube serve`: an E2B-compatible sandbox service on the public cube-core API, so that
//! E2B's official SDKs (Python `e2b`, `e2b-code-interpreter`; JavaScript `e2b`,
//! `@e2b/code-interpreter`) drive Cube sandboxes unchanged, pointed at it with their
//! own settings (`E2B_API_URL`, `E2B_SANDBOX_URL`, `E2B_API_KEY`, or `E2B_DOMAIN`).
//!
//! One listener (HTTP/1.1 and HTTP/2, optionally TLS) serves the control plane
//! ([`control`]) and the sandbox plane ([`plane`]): envd's Connect services and file
//! routes ([`envd`]), the code interpreter ([`code`]) and any other port ([`proxy`]).
//! A second, optional listener serves Prometheus metrics and the dashboard ([`admin`]).
//! Sandboxes outlive the server: a restarted `cube serve` reattaches to them and keeps
//! their end times ([`record`], [`lifecycle`]).
//!
//! ```no_run
//! // no_run: sandboxes need root (namespaces, cgroups) and a built cube-supervisor.
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use cube_server::config::{CliOverrides, ServeConfig};
//! let config = ServeConfig::load(None, CliOverrides {
//!     listen: Some("127.0.0.1:3000".parse()?),
//!     api_keys: vec!["a-long-random-api-key".into()],
//!     ..CliOverrides::default()
//! })?;
//! cube_server::serve(config, std::future::pending()).await?;
//! # Ok(())
//! # }
//! ```

pub mod admin;
pub mod code;
pub mod config;
pub mod control;
pub mod envd;
pub mod error;
pub mod http_client;
pub mod ids;
pub mod lifecycle;
pub mod lock;
pub mod metrics;
pub mod plane;
pub mod proxy;
pub mod query;
pub mod record;
pub mod service;
pub mod tls;
pub mod usage;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

pub use config::ServeConfig;
pub use service::Service;

/// How long requests under way get to finish at shutdown.
const DRAIN: Duration = Duration::from_secs(10);

/// Why the server stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The service could not start.
    #[error("Starting the service")]
    Start(#[from] service::StartError),
    /// A listener could not be bound.
    #[error("Listening on {0}")]
    Bind(SocketAddr, #[source] std::io::Error),
    /// The TLS certificate or key is unusable.
    #[error("TLS")]
    Tls(#[from] tls::TlsError),
}

/// The addresses the server listens on, once bound.
#[derive(Clone, Copy, Debug)]
pub struct Bound {
    /// The API and sandbox traffic.
    pub main: SocketAddr,
    /// Metrics and dashboard.
    pub admin: Option<SocketAddr>,
}

/// Runs the service until `shutdown` completes; sandboxes keep running afterwards.
pub async fn serve(
    config: ServeConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    serve_with(config, shutdown, |_| {}).await
}

/// Like [`serve`], calling `on_bound` with the bound addresses (port 0 picks a free
/// one) before serving.
pub async fn serve_with(
    config: ServeConfig,
    shutdown: impl Future<Output = ()>,
    on_bound: impl FnOnce(Bound),
) -> Result<(), ServeError> {
    let tls = match &config.tls {
        Some(files) => Some(tls::acceptor(files)?),
        None => None,
    };
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| ServeError::Bind(config.listen, e))?;
    let admin_listener = match config.admin_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|e| ServeError::Bind(addr, e))?,
        ),
        None => None,
    };
    let mut extra_tls = Vec::new();
    for addr in &config.tls_listen {
        extra_tls.push(
            TcpListener::bind(addr)
                .await
                .map_err(|e| ServeError::Bind(*addr, e))?,
        );
    }
    let main_addr = listener
        .local_addr()
        .map_err(|e| ServeError::Bind(config.listen, e))?;
    let admin_addr = admin_listener.as_ref().and_then(|l| l.local_addr().ok());
    let service = tokio::task::spawn_blocking(move || Service::open(config))
        .await
        .map_err(|e| {
            ServeError::Start(service::StartError::Runtime(cube_core::SandboxError::Io(
                "starting the service".into(),
                std::io::Error::other(e.to_string()),
            )))
        })??;
    on_bound(Bound {
        main: main_addr,
        admin: admin_addr,
    });
    tracing::info!(listen = %main_addr, admin = ?admin_addr, tls = tls.is_some(), "cube serve ready");
    let reaper = tokio::spawn(lifecycle::reap(Arc::clone(&service)));
    let control = control::router(Arc::clone(&service));
    let main_svc: Main = {
        let service = Arc::clone(&service);
        tower::util::BoxCloneSyncService::new(tower::service_fn(
            move |req: Request<hyper::body::Incoming>| {
                let (service, control) = (Arc::clone(&service), control.clone());
                async move {
                    Ok::<_, std::convert::Infallible>(
                        plane::dispatch(service, control, req.map(Body::new)).await,
                    )
                }
            },
        ))
    };
    let admin_router = admin::router(Arc::clone(&service));
    let graceful = Arc::new(hyper_util::server::graceful::GracefulShutdown::new());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut acceptors = Vec::new();
    let main_kind = match &tls {
        Some(acceptor) if extra_tls.is_empty() => Kind::Tls(acceptor.clone()),
        _ => Kind::Plain,
    };
    acceptors.push(tokio::spawn(accept_loop(
        listener,
        main_kind,
        Handler::Main(main_svc.clone()),
        Arc::clone(&graceful),
        stop_rx.clone(),
    )));
    if let Some(acceptor) = &tls {
        for l in extra_tls {
            acceptors.push(tokio::spawn(accept_loop(
                l,
                Kind::Tls(acceptor.clone()),
                Handler::Main(main_svc.clone()),
                Arc::clone(&graceful),
                stop_rx.clone(),
            )));
        }
    }
    if let Some(l) = admin_listener {
        acceptors.push(tokio::spawn(accept_loop(
            l,
            Kind::Plain,
            Handler::<Main>::Admin(admin_router),
            Arc::clone(&graceful),
            stop_rx.clone(),
        )));
    }
    shutdown.await;
    let _ = stop_tx.send(true);
    for a in acceptors {
        let _ = a.await;
    }
    tracing::info!("shutting down: sandboxes keep running");
    reaper.abort();
    // Every accept loop has ended and dropped its handle.
    if let Ok(graceful) = Arc::try_unwrap(graceful) {
        if tokio::time::timeout(DRAIN, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("requests still under way after {DRAIN:?}; closing them");
        }
    }
    Ok(())
}

use tower::ServiceExt as _;

/// The main listener's request handler.
type Main = tower::util::BoxCloneSyncService<
    Request<hyper::body::Incoming>,
    axum::response::Response,
    std::convert::Infallible,
>;

/// How a listener's connections start.
#[derive(Clone)]
enum Kind {
    Plain,
    Tls(tokio_rustls::TlsAcceptor),
}

/// What serves a listener's requests.
#[derive(Clone)]
enum Handler<S> {
    Main(S),
    Admin(axum::Router),
}

/// Accepts connections until `stop` turns true; each is served under `watcher`.
async fn accept_loop<S>(
    listener: TcpListener,
    kind: Kind,
    handler: Handler<S>,
    graceful: Arc<hyper_util::server::graceful::GracefulShutdown>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    S: tower::Service<
            Request<hyper::body::Incoming>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (kind, handler, watcher) = (kind.clone(), handler.clone(), graceful.watcher());
        tokio::spawn(async move {
            let result = match kind {
                Kind::Plain => serve_connection(TokioIo::new(stream), handler, watcher).await,
                Kind::Tls(acceptor) => match acceptor.accept(stream).await {
                    Ok(s) => serve_connection(TokioIo::new(s), handler, watcher).await,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                },
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended");
            }
        });
    }
}

async fn serve_connection<I, S>(
    io: I,
    handler: Handler<S>,
    watcher: hyper_util::server::graceful::Watcher,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: tower::Service<
            Request<hyper::body::Incoming>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let builder = auto::Builder::new(TokioExecutor::new());
    match handler {
        Handler::Main(svc) => {
            let svc = hyper_util::service::TowerToHyperService::new(svc);
            watcher
                .watch(builder.serve_connection_with_upgrades(io, svc).into_owned())
                .await
        }
        Handler::Admin(router) => {
            let svc = hyper_util::service::TowerToHyperService::new(
                router.map_request(|r: Request<hyper::body::Incoming>| r.map(Body::new)),
            );
            watcher
                .watch(builder.serve_connection_with_upgrades(io, svc).into_owned())
                .await
        }
    }
}
