//! The `tuttid` command line (the binary is a thin wrapper, so test crates can ship the same
//! program as their own binary target).
//!
//! `tuttid`: the reference daemon.
//!
//! - `tuttid serve --db FILE --listen 127.0.0.1:7420 --token-file FILE [--config FILE]`
//! - `tuttid demo`: the daemon on an embedded SQLite file with the demo ACP agent; submits a
//!   prompt, shows the root turn and its child lanes updating live, then leaves the API up.
//! - `tuttid demo-agent` / `tuttid plain-agent`: the bundled ACP agents (the `demo` and `plain`
//!   providers run these).

use crate::config::{data_dir, ConfigFile};
use crate::daemon::{Daemon, DaemonOptions};
use crate::providers::Registry;
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use tutti_core::EngineConfig;

#[derive(Parser)]
#[command(
    name = "tuttid",
    about = "tutti reference daemon: provider-native subagents as durable sessions"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the HTTP API.
    Serve(ServeArgs),
    /// Run a live demo with the demo ACP agent, then keep serving.
    Demo(ServeArgs),
    /// Run the bundled demo ACP agent on stdio.
    DemoAgent,
    /// Run the bundled root-only ACP agent on stdio.
    PlainAgent,
}

#[derive(clap::Args, Clone)]
struct ServeArgs {
    /// Database file (default: tutti.db in the user's data directory).
    #[arg(long)]
    db: Option<PathBuf>,
    /// Listen address (loopback by default).
    #[arg(long, default_value = "127.0.0.1:7420")]
    listen: SocketAddr,
    /// Bearer token file (created with mode 0600 if missing).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Provider config (TOML).
    #[arg(long)]
    config: Option<PathBuf>,
}

/// Runs `tuttid` with the process arguments.
pub fn main() {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::DemoAgent => std::process::exit(exit_code(crate::agents::run_demo_agent())),
        Cmd::PlainAgent => std::process::exit(exit_code(crate::agents::run_plain_agent())),
        Cmd::Serve(a) => run(a, false),
        Cmd::Demo(a) => run(a, true),
    }
}

fn exit_code(c: std::process::ExitCode) -> i32 {
    if c == std::process::ExitCode::SUCCESS {
        0
    } else {
        1
    }
}

fn init_logs(demo: bool) {
    let default = if demo { "warn" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("TUTTI_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn run(args: ServeArgs, demo: bool) {
    init_logs(demo);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => fail(&format!("cannot start the async runtime: {e}")),
    };
    if let Err(e) = rt.block_on(serve(args, demo)) {
        fail(&e);
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("tuttid: {msg}");
    std::process::exit(1)
}

async fn serve(args: ServeArgs, demo: bool) -> Result<(), String> {
    let dir = data_dir();
    let db = match (&args.db, demo) {
        (Some(p), _) => p.clone(),
        (None, false) => dir.join("tutti.db"),
        (None, true) => dir.join("demo.db"),
    };
    if let Some(parent) = db.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    }
    let token_file = args.token_file.clone().unwrap_or_else(|| dir.join("token"));
    let token = crate::auth::load_or_create_token(&token_file)
        .map_err(|e| format!("token file {}: {e}", token_file.display()))?;
    let config = match &args.config {
        Some(p) => ConfigFile::load(p).map_err(|e| e.to_string())?,
        None => ConfigFile::default(),
    };
    let mut engine = EngineConfig::default();
    if let Some(ms) = config.cancel_timeout_ms {
        engine.cancel_timeout_ms = ms;
    }
    let retention = config.retention.resolve();
    let registry = Registry::with_builtins(config).map_err(|e| e.to_string())?;
    let daemon = Daemon::start(DaemonOptions {
        db: db.clone(),
        providers: Arc::new(registry),
        engine,
        retention,
    })?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let app = crate::api::router(daemon.clone(), token.clone());
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
    });
    eprintln!(
        "tuttid: listening on http://{addr} (db {}, token in {})",
        db.display(),
        token_file.display()
    );
    if demo {
        crate::demo::run(&daemon).await?;
        eprintln!(
            "tuttid: the API stays up at http://{addr}; token file {}; Ctrl-C to stop.\n  e.g. tutti --addr {addr} --token-file {} sessions",
            token_file.display(),
            token_file.display()
        );
    }
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("server: {e}")),
        Err(e) => return Err(format!("server task: {e}")),
    }
    daemon.shutdown().await;
    Ok(())
}
