//! The `tuttid` command line (the binary is a thin wrapper, so test crates can ship the same
//! program as their own binary target).
//!
//! `tuttid`: the reference daemon.
//!
//! - `tuttid serve --db FILE|sqlite:FILE|postgres://... --listen 127.0.0.1:7420 --token-file FILE
//!   [--config FILE] [--allow-non-loopback] [--metrics-listen 127.0.0.1:9464]` (`GET /metrics`
//!   on its own listener without auth; otherwise on the API's, behind its token;
//!   `[--advertise HOST:PORT]`: on PostgreSQL, where the other daemons on the database reach
//!   this one)
//! - `tuttid demo`: the daemon on an embedded SQLite file with the demo ACP agent; submits a
//!   prompt, shows the root turn and its child lanes updating live, then leaves the API up.
//! - `tuttid demo-agent` / `tuttid plain-agent`: the bundled ACP agents (the `demo` and `plain`
//!   providers run these).
//!
//! Logs go to stderr. The filter is `TUTTI_LOG` if set, else `RUST_LOG`, else `info` (`warn`
//! for `tuttid demo`), in `tracing` `EnvFilter` syntax (`debug`, `tutti_tokio=trace,warn`, ...).
//! Colours only when stderr is a terminal. No level, `trace` included, carries prompt, message
//! or tool content: log lines carry ids, enum values, counts and lengths. Other crates are
//! capped at `info` whatever the filter says (the ACP library logs whole JSON-RPC messages at
//! `trace`).
//!
//! SIGINT (Ctrl-C) and SIGTERM stop the daemon: it stops accepting connections, ends every
//! open event stream, ends every provider's process group, stops the engine and exits, within
//! [`HTTP_SHUTDOWN_BOUND`] + [`ENGINE_SHUTDOWN_BOUND`] (under 2 s) even if a client does not go
//! away.

use crate::config::{data_dir, ConfigFile};
use crate::daemon::{Daemon, DaemonOptions};
use crate::providers::Registry;
use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tutti_core::EngineConfig;

/// How long a stopping daemon waits for its HTTP connections (event streams end at once on the
/// stop signal; this bounds a client that keeps its connection open anyway).
pub const HTTP_SHUTDOWN_BOUND: Duration = Duration::from_millis(500);
/// How long a stopping daemon then waits for its engine, which ends every provider process group
/// (`SIGTERM`, [`crate::runtime::STOP_GRACE`], `SIGKILL`) before it stops. Together with
/// [`HTTP_SHUTDOWN_BOUND`] under 2 s.
pub const ENGINE_SHUTDOWN_BOUND: Duration = Duration::from_millis(1300);

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
    /// Database: a SQLite file (a path, or `sqlite:PATH`; default: tutti.db in the user's data
    /// directory), or a PostgreSQL database (`postgres://user@host:port/db`; see
    /// `tutti_tokio::postgres`).
    #[arg(long)]
    db: Option<PathBuf>,
    /// Listen address: `IP:PORT`, `[IPv6]:PORT` or `localhost:PORT` (loopback by default).
    #[arg(long, default_value = "127.0.0.1:7420", value_parser = parse_listen)]
    listen: SocketAddr,
    /// Bearer token file (created with mode 0600 if missing).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Provider config (TOML).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Seconds an idle provider process (its session tree has no active turn, prepared cancel or
    /// pending interaction) stays up; the next submit starts it again and resumes the provider
    /// conversation. 0 keeps idle providers running. Overrides `idle_timeout_secs` of the config
    /// (default 300).
    #[arg(long)]
    idle_timeout_secs: Option<u64>,
    /// Allow a listen address other than loopback: the API (bearer token over plain HTTP)
    /// becomes reachable from other machines. Without it such an address is refused.
    #[arg(long)]
    allow_non_loopback: bool,
    /// Serve `GET /metrics` (Prometheus) without auth on this address of its own (loopback
    /// unless --allow-non-loopback). Without it `/metrics` is served on the API's listener,
    /// behind the API's bearer token.
    #[arg(long, value_parser = parse_listen)]
    metrics_listen: Option<SocketAddr>,
    /// PostgreSQL only: the address (`host:port`) at which the other daemons on the database
    /// reach this one (the owner address of its tree leases, where they forward commands).
    /// Default: the listen address with its bound port; required when listening on an
    /// unspecified address (`0.0.0.0`, `[::]`).
    #[arg(long)]
    advertise: Option<String>,
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

/// The log filter: `TUTTI_LOG`, else `RUST_LOG`, else the default level.
fn log_filter(demo: bool) -> tracing_subscriber::EnvFilter {
    let default = if demo { "warn" } else { "info" };
    tracing_subscriber::EnvFilter::try_from_env("TUTTI_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_env("RUST_LOG"))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default))
}

/// Whether an event may be logged at all, whatever the filter asks for: our crates at any
/// level (their log lines carry ids, enum values, counts and lengths only), every other crate
/// at `info` and above. The ACP library logs each whole JSON-RPC message (prompts, replies,
/// tool input) at `trace`, and the HTTP stack's `trace` rejections can quote request values.
fn content_free(meta: &tracing::Metadata<'_>) -> bool {
    meta.target().starts_with("tutti") || *meta.level() <= tracing::Level::INFO
}

fn init_logs(demo: bool) {
    use tracing_subscriber::prelude::*;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(log_filter(demo))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .finish()
        .with(tracing_subscriber::filter::filter_fn(content_free))
        .try_init();
}

/// Waits for SIGINT or SIGTERM; returns the signal's name.
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = tokio::signal::ctrl_c() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            "SIGINT"
        }
    }
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
    let result = rt.block_on(serve(args, demo));
    // Blocking reads still running (a slow SQLite read of a stream that just ended) must not
    // hold the exit up.
    rt.shutdown_timeout(Duration::from_millis(200));
    if let Err(e) = result {
        fail(&e.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::{advertise_address, check_listen, parse_listen, pick_db, Db, ServeError};
    use std::path::{Path, PathBuf};

    #[test]
    fn localhost_is_accepted_as_a_loopback_listen_address() {
        for s in ["localhost:7420", "LocalHost:7420"] {
            let addr = parse_listen(s).expect(s);
            assert_eq!(addr, "127.0.0.1:7420".parse().expect("addr"));
            assert!(check_listen(addr, false).is_ok(), "{s}");
        }
        assert_eq!(
            parse_listen("localhost:0").expect("any port"),
            "127.0.0.1:0".parse().expect("addr")
        );
        assert!(parse_listen("localhost:70000").is_err());
        assert!(parse_listen("localhost").is_err());
        assert!(parse_listen("example.org:7420").is_err());
    }

    #[test]
    fn ipv4_mapped_loopback_is_a_loopback_listen_address() {
        let mapped = parse_listen("[::ffff:127.0.0.1]:7420").expect("mapped");
        assert!(check_listen(mapped, false).is_ok());
        let mapped_other = parse_listen("[::ffff:127.9.8.7]:7420").expect("mapped");
        assert!(check_listen(mapped_other, false).is_ok());
        // A mapped address that is not loopback is still refused, as are the others.
        for s in [
            "[::ffff:10.0.0.5]:7420",
            "10.0.0.5:7420",
            "0.0.0.0:7420",
            "[::]:7420",
        ] {
            let addr = parse_listen(s).expect(s);
            assert!(
                matches!(check_listen(addr, false), Err(ServeError::NonLoopback(_))),
                "{s}"
            );
        }
        assert!(check_listen(parse_listen("[::1]:7420").expect("v6"), false).is_ok());
    }

    /// The lease's owner address is where other daemons forward commands: an unspecified
    /// listen address on PostgreSQL is refused without `--advertise`.
    #[test]
    fn the_advertised_address_is_reachable_or_given() {
        let any = "0.0.0.0:7420".parse().expect("addr");
        let lo = "127.0.0.1:7420".parse().expect("addr");
        assert!(matches!(
            advertise_address(None, true, any),
            Err(ServeError::NoAdvertise(_))
        ));
        assert_eq!(
            advertise_address(Some("10.0.0.5:7420"), true, any).expect("given"),
            "10.0.0.5:7420"
        );
        assert_eq!(
            advertise_address(None, true, lo).expect("bound"),
            "127.0.0.1:7420"
        );
        // SQLite has no other daemons.
        assert_eq!(
            advertise_address(None, false, any).expect("unused"),
            "0.0.0.0:7420"
        );
    }

    #[test]
    fn db_is_picked_by_url() {
        assert_eq!(
            pick_db(Some(Path::new("postgres://u@127.0.0.1:5432/t")), false),
            Db::Postgres("postgres://u@127.0.0.1:5432/t".into())
        );
        assert_eq!(
            pick_db(Some(Path::new("postgresql://127.0.0.1/t")), false),
            Db::Postgres("postgresql://127.0.0.1/t".into())
        );
        assert_eq!(
            pick_db(Some(Path::new("sqlite:/tmp/a.db")), false),
            Db::Sqlite(PathBuf::from("/tmp/a.db"))
        );
        assert_eq!(
            pick_db(Some(Path::new("rel/a.db")), false),
            Db::Sqlite(PathBuf::from("rel/a.db"))
        );
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("tuttid: {msg}");
    std::process::exit(1)
}

/// Issue 17: "Listening on a non-loopback address is refused unless an explicit flag says so
/// (and then logged as a warning)".
/// The owner address of this daemon's tree leases (PostgreSQL; see `--advertise`): the given
/// one, else the bound listen address; an unspecified listen address (`0.0.0.0`, `[::]`) on
/// PostgreSQL needs `--advertise` (the other daemons could not reach it there).
fn advertise_address(
    given: Option<&str>,
    postgres: bool,
    bound: SocketAddr,
) -> Result<String, ServeError> {
    match given {
        Some(a) => Ok(a.to_string()),
        None if postgres && bound.ip().is_unspecified() => Err(ServeError::NoAdvertise(bound)),
        None => Ok(bound.to_string()),
    }
}

/// Issue 36 (10): a listen address (`--listen`, `--metrics-listen`): a socket address literal
/// (`127.0.0.1:7420`, `[::1]:7420`), or `localhost:PORT` (any case).
/// Choice: `localhost` resolves to `127.0.0.1` without asking the system resolver (RFC 6761: the
/// name is always loopback), so a hosts file that maps it elsewhere, or to `::1` only, cannot
/// turn it into another address; other host names are refused (name the address).
fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if let Some((host, port)) = s.rsplit_once(':') {
        if host.eq_ignore_ascii_case("localhost") {
            let port: u16 = port
                .parse()
                .map_err(|_| format!("{port:?} is not a port number (0..=65535)"))?;
            return Ok(SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port)));
        }
    }
    Err(format!(
        "{s:?} is not a listen address: use IP:PORT, [IPv6]:PORT or localhost:PORT"
    ))
}

/// Whether `ip` is a loopback address: `127.0.0.0/8`, `::1`, or an IPv4-mapped IPv6 loopback
/// (`::ffff:127.0.0.1`, which the kernel routes as IPv4 loopback).
fn is_loopback(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => v4.is_loopback(),
        std::net::IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

fn check_listen(addr: SocketAddr, allowed: bool) -> Result<(), ServeError> {
    if is_loopback(addr.ip()) {
        return Ok(());
    }
    if !allowed {
        return Err(ServeError::NonLoopback(addr));
    }
    tracing::warn!(%addr, "listening on a non-loopback address (--allow-non-loopback)");
    Ok(())
}

/// Why `tuttid serve` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// PostgreSQL on an unspecified listen address without `--advertise`: other daemons could
    /// not reach this one at its lease's owner address.
    #[error(
        "listening on {0} on PostgreSQL needs --advertise HOST:PORT: the other daemons on the \
         database forward commands to the address in this daemon's tree leases"
    )]
    NoAdvertise(SocketAddr),
    /// Listening on a non-loopback address without `--allow-non-loopback`.
    #[error(
        "refusing to listen on {0}: not a loopback address, so the API would be reachable from \
         other machines over plain HTTP; pass --allow-non-loopback to do it anyway"
    )]
    NonLoopback(SocketAddr),
    /// A file or directory could not be created or read.
    #[error("{what} {path}: {source}")]
    File {
        /// What it is.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The token file is not usable.
    #[error("token file {path}: {source}")]
    Token {
        /// Where.
        path: PathBuf,
        /// Why.
        source: crate::auth::TokenError,
    },
    /// The config file is not usable.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The daemon core did not start.
    #[error(transparent)]
    Start(#[from] crate::daemon::StartError),
    /// Another daemon serves this SQLite file (or its lock file is unusable).
    #[error(transparent)]
    DbLock(#[from] crate::db_lock::DbLockError),
    /// The listening socket.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// Address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The web view's one-time login code could not be made (no randomness).
    #[error("cannot make a login code: {0}")]
    LoginCode(std::io::Error),
    /// The server task panicked or was cancelled.
    #[error("server task: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The demo failed.
    #[error(transparent)]
    Demo(#[from] crate::demo::DemoError),
}

/// The store `--db` names: a `postgres://` (or `postgresql://`) URL is PostgreSQL; anything
/// else is a SQLite file path, with an optional `sqlite:` prefix (choice: `sqlite:` and
/// `sqlite://` are both stripped, so `sqlite:///abs/path` is `/abs/path`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Db {
    Sqlite(PathBuf),
    Postgres(String),
}

fn pick_db(arg: Option<&std::path::Path>, demo: bool) -> Db {
    let dir = data_dir();
    let Some(p) = arg else {
        return Db::Sqlite(dir.join(if demo { "demo.db" } else { "tutti.db" }));
    };
    match p.to_str() {
        Some(s) if crate::postgres::is_url(s) => Db::Postgres(s.to_string()),
        Some(s) => {
            let path = s
                .strip_prefix("sqlite://")
                .or_else(|| s.strip_prefix("sqlite:"))
                .unwrap_or(s);
            Db::Sqlite(PathBuf::from(path))
        }
        None => Db::Sqlite(p.to_path_buf()),
    }
}

async fn serve(args: ServeArgs, demo: bool) -> Result<(), ServeError> {
    let dir = data_dir();
    let choice = pick_db(args.db.as_deref(), demo);
    let db = match &choice {
        Db::Sqlite(p) => p.clone(),
        Db::Postgres(url) => PathBuf::from(crate::postgres::redact(url)),
    };
    // Issue 36 (1): one daemon per SQLite file. The lock is taken before anything opens the
    // database (start-up recovery settles running trees) and held until the process ends.
    let mut db_lock: Option<crate::db_lock::DbLock> = None;
    if let Db::Sqlite(db) = &choice {
        if let Some(parent) = db.parent() {
            std::fs::create_dir_all(parent).map_err(|source| ServeError::File {
                what: "cannot create",
                path: parent.to_path_buf(),
                source,
            })?;
        }
        db_lock = Some(crate::db_lock::DbLock::acquire(db)?);
    }
    let token_file = args.token_file.clone().unwrap_or_else(|| dir.join("token"));
    check_listen(args.listen, args.allow_non_loopback)?;
    if let Some(m) = args.metrics_listen {
        check_listen(m, args.allow_non_loopback)?;
    }
    let token =
        crate::auth::load_or_create_token(&token_file).map_err(|source| ServeError::Token {
            path: token_file.clone(),
            source,
        })?;
    let mut config = match &args.config {
        Some(p) => ConfigFile::load(p)?,
        None => ConfigFile::default(),
    };
    if let Some(secs) = args.idle_timeout_secs {
        config.idle_timeout_secs = Some(secs);
    }
    let idle_timeout = config.idle_timeout();
    let lease = config.lease();
    let mut engine = EngineConfig::default();
    if let Some(ms) = config.cancel_timeout_ms {
        engine.cancel_timeout_ms = ms;
    }
    let retention = config.retention.resolve();
    let durability = config.durability;
    let http = config.http.resolve();
    let max_providers = config.max_providers;
    let mut registry = Registry::with_builtins(config)?;
    // The demo agent's state lives next to the SQLite file; for PostgreSQL, next to the token
    // file (choice: the daemon's local files stay together).
    let mut demo_state = match &choice {
        Db::Sqlite(p) => p.clone().into_os_string(),
        Db::Postgres(_) => token_file
            .parent()
            .map(|p| p.join("postgres"))
            .unwrap_or_else(|| dir.join("postgres"))
            .into_os_string(),
    };
    let mut daemon_id = demo_state.clone();
    daemon_id.push(".daemon-id");
    demo_state.push(".demo-agent");
    registry.set_demo_state_dir(PathBuf::from(demo_state));
    let opts = DaemonOptions {
        db: db.clone(),
        providers: Arc::new(registry),
        engine,
        idle_timeout,
        retention,
        durability,
        max_providers,
    };
    let listen = |source| ServeError::Listen {
        addr: args.listen,
        source,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(listen)?;
    let addr = listener.local_addr().map_err(listen)?;
    if let Some(l) = &db_lock {
        l.write_holder(Some(&addr.to_string()))?;
    }
    let advertise = advertise_address(
        args.advertise.as_deref(),
        matches!(choice, Db::Postgres(_)),
        addr,
    )?;
    let daemon = match &choice {
        Db::Sqlite(_) => Daemon::start(opts)?,
        // The owner address of this daemon's tree leases is the address it listens on (bound
        // first, so that a port 0 is the real port).
        Db::Postgres(url) => crate::postgres::start(
            url,
            opts,
            crate::postgres::Leases::new(
                crate::postgres::Leases::daemon_id(std::path::Path::new(&daemon_id))
                    .map_err(crate::daemon::StartError::from)?,
                advertise,
                lease,
            ),
        )?,
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let web = crate::web::WebAuth::new(token.clone());
    let code = web.issue_code().map_err(ServeError::LoginCode)?;
    let ws = demo.then_some(crate::demo::DEMO_WORKSPACE);
    let login = format!("http://{addr}{}", crate::web::login_path(&code, ws));
    let app = crate::api::router_with_web(daemon.clone(), token.clone(), stop_rx.clone(), web);
    if let Some(maddr) = args.metrics_listen {
        let mlistener = tokio::net::TcpListener::bind(maddr)
            .await
            .map_err(|source| ServeError::Listen {
                addr: maddr,
                source,
            })?;
        let mapp = crate::api::metrics_router(daemon.clone());
        let mstop = stop_rx.clone();
        tokio::spawn(crate::connections::serve(mlistener, mapp, http, mstop));
        eprintln!("tuttid: metrics on http://{maddr}/metrics (no auth)");
    }
    let mut server = tokio::spawn(crate::connections::serve(
        listener,
        app,
        http,
        stop_rx.clone(),
    ));
    tokio::spawn(async move {
        let which = stop_signal().await;
        tracing::info!(signal = which, "stopping");
        let _ = stop_tx.send(true);
    });
    eprintln!(
        "tuttid: listening on http://{addr} (db {}, token in {})",
        db.display(),
        token_file.display()
    );
    // Issue 20: "`tuttid` prints a one-time login link".
    eprintln!("tuttid: web view (one-time login link): {login}");
    let mut stopping = stop_rx.clone();
    if demo {
        tokio::select! {
            r = crate::demo::run(&daemon, Some(&login)) => {
                r?;
                eprintln!(
                    "tuttid: the API stays up at http://{addr}; token file {}; Ctrl-C to stop.\n  e.g. {}\n  web view (one-time login link): {login}",
                    token_file.display(),
                    crate::demo::cli_example(&addr.to_string(), &token_file)
                );
            }
            _ = stopping.wait_for(|stop| *stop) => {}
        }
    }
    let served = tokio::select! {
        r = &mut server => Some(r),
        _ = stopping.wait_for(|stop| *stop) => {
            // Event streams end on the stop signal; a client that keeps its connection open
            // anyway does not hold the exit up past the bound.
            tokio::time::timeout(HTTP_SHUTDOWN_BOUND, &mut server).await.ok()
        }
    };
    match served {
        Some(Ok(())) | None => {}
        Some(Err(e)) => return Err(ServeError::Task(e)),
    }
    server.abort();
    if tokio::time::timeout(ENGINE_SHUTDOWN_BOUND, daemon.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("the engine did not stop in time; exiting anyway");
    }
    // Held until here: the engine no longer writes.
    drop(db_lock);
    Ok(())
}
