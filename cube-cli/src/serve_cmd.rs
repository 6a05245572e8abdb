//! `cube serve`: the E2B-compatible sandbox service (the `cube-server` crate).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use cube_server::config::{CliOverrides, ServeConfig, TlsFiles};

use crate::cli_error::CliError;

/// Options of `cube serve`.
#[derive(clap::Args)]
#[command(after_help = "Example:
  CUBE_API_KEY=$(openssl rand -hex 24) cube serve --listen 127.0.0.1:3000 --admin-listen 127.0.0.1:3001
  E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000 E2B_API_KEY=$CUBE_API_KEY python3 agent.py")]
pub struct ServeArgs {
    /// Where to serve the API and sandbox traffic.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Where to serve Prometheus metrics and the dashboard.
    #[arg(long)]
    admin_listen: Option<SocketAddr>,
    /// An accepted API key (E2B's X-API-KEY; at least 16 characters; repeatable).
    #[arg(long = "api-key", env = "CUBE_API_KEY", hide_env_values = true)]
    api_keys: Vec<String>,
    /// A file of API keys, one a line.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// The config file (TOML: domain, templates, limits, pause mode, TLS).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The domain of sandbox host names (<port>-<sandboxID>.<domain>).
    #[arg(long)]
    domain: Option<String>,
    /// A PEM certificate chain: serve HTTPS (with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's PEM private key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve HTTPS here too, beside the plain --listen (repeatable; needs --tls-cert).
    #[arg(long, requires = "tls_cert")]
    tls_listen: Vec<SocketAddr>,
}

/// Runs the service until Ctrl-C or SIGTERM; sandboxes keep running afterwards.
pub fn run(store: Option<&Path>, args: &ServeArgs) -> Result<u8, CliError> {
    let overrides = CliOverrides {
        listen: args.listen,
        admin_listen: args.admin_listen,
        api_keys: args.api_keys.clone(),
        api_key_file: args.api_key_file.clone(),
        domain: args.domain.clone(),
        store: store.map(Path::to_path_buf),
        tls: match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => None,
        },
        tls_listen: args.tls_listen.clone(),
    };
    let config = ServeConfig::load(args.config.as_deref(), overrides)
        .map_err(|e| CliError::usage(cube_server::error::error_chain(&e)))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("cube-serve")
        .build()
        .map_err(|e| CliError::failed(format!("Starting the async runtime: {e}")))?;
    runtime
        .block_on(cube_server::serve_with(
            config,
            shutdown_signal(),
            |bound| {
                eprintln!("cube serve: API on {}", bound.main);
                if let Some(admin) = bound.admin {
                    eprintln!("cube serve: metrics and dashboard on http://{admin}/");
                }
            },
        ))
        .map_err(|e| CliError::failed(cube_server::error::error_chain(&e)))?;
    Ok(0)
}

/// Completes at Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
