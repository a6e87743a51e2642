//! Connections that survive the database going away (issue 34: "Every PostgreSQL connection
//! ... notices a broken connection and reconnects with bounded backoff, without a daemon
//! restart"), with bounded waits on the server and short TCP keepalives.
//!
//! Every connection the store opens ([`crate::PostgresStore`], [`crate::OutboxListener`]):
//! - is configured with TCP keepalives ([`KEEPALIVE_IDLE`], [`KEEPALIVE_INTERVAL`],
//!   [`KEEPALIVE_RETRIES`]: a silent peer is noticed in about 11 s instead of the kernel's
//!   hours) and a [`CONNECT_TIMEOUT`];
//! - sets, right after connecting, `lock_timeout` ([`LOCK_TIMEOUT`]), `statement_timeout`
//!   ([`STATEMENT_TIMEOUT`]) and `idle_in_transaction_session_timeout`
//!   ([`IDLE_IN_TRANSACTION_TIMEOUT`]), so that a stuck or paused daemon holding row locks
//!   (the outbox counter, a lease) stalls the others for seconds, not until its TCP connection
//!   dies. These are constants, not configuration (a choice: they bound how long one daemon can
//!   stall another, which is a property of the cluster, not of one daemon); they override the
//!   same settings given in the URL's `options`.
//! - is replaced when it is found closed: the next use reconnects. A failed reconnect is not
//!   retried before a backoff that starts at [`BACKOFF_MIN`] and doubles up to [`BACKOFF_MAX`]
//!   (reset by a success); calls meanwhile fail at once with
//!   [`PgError::Unavailable`], so a caller (the daemon's engine
//!   thread) never blocks for long on a database that is down.
//!
//! [`Health`] is shared by the connections of one daemon: it says whether the database was
//! reachable at the last use, since when it is not, how many reconnects happened and how long
//! the database has been unreachable in total (the daemon's `/healthz`, `/readyz` and metrics).

use crate::error::PgError;
use crate::Cache;
use postgres::{Client, NoTls};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `lock_timeout` of every connection: a statement waits at most this long for a row lock.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(2);
/// `statement_timeout` of every connection.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);
/// `idle_in_transaction_session_timeout` of every connection: a connection that holds a
/// transaction open without a statement this long is ended by the server (its locks freed).
pub const IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(5);
/// TCP keepalive: idle time before the first probe.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
/// TCP keepalive: time between probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// TCP keepalive: unanswered probes before the connection is dropped.
pub const KEEPALIVE_RETRIES: u32 = 3;
/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// The first reconnect backoff.
pub const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// The longest reconnect backoff.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// How long a commit whose connection broke after `COMMIT` was sent keeps trying to read its
/// outcome back before it reports it unknown (see [`crate::PgError::OutcomeUnknown`]).
pub const RESOLVE_WAIT: Duration = Duration::from_secs(5);

/// Whether the database is reachable, as the connections sharing this value last saw it (see
/// the module docs). Cheap to share (`Arc<Health>`).
#[derive(Debug, Default)]
pub struct Health {
    inner: Mutex<HealthInner>,
}

#[derive(Debug, Default)]
struct HealthInner {
    down_since: Option<Instant>,
    down_total: Duration,
    reconnects: u64,
    outages: u64,
}

impl Health {
    /// A new value: reachable.
    pub fn new() -> Arc<Health> {
        Arc::new(Health::default())
    }

    fn with<T>(&self, f: impl FnOnce(&mut HealthInner) -> T) -> T {
        match self.inner.lock() {
            Ok(mut g) => f(&mut g),
            Err(p) => f(&mut p.into_inner()),
        }
    }

    /// Whether the last use of a connection found the database reachable.
    pub fn is_up(&self) -> bool {
        self.with(|h| h.down_since.is_none())
    }

    /// Since when the database is unreachable (`None`: it is reachable).
    pub fn down_since(&self) -> Option<Instant> {
        self.with(|h| h.down_since)
    }

    /// Successful reconnects so far (of every connection sharing this value).
    pub fn reconnects(&self) -> u64 {
        self.with(|h| h.reconnects)
    }

    /// How many times the database became unreachable.
    pub fn outages(&self) -> u64 {
        self.with(|h| h.outages)
    }

    /// Seconds the database was unreachable in total, the current outage included.
    pub fn unavailable_seconds(&self) -> f64 {
        self.with(|h| {
            let now = h.down_since.map_or(Duration::ZERO, |s| s.elapsed());
            (h.down_total + now).as_secs_f64()
        })
    }

    /// A connection found the database unreachable.
    pub fn mark_down(&self) {
        self.with(|h| {
            if h.down_since.is_none() {
                h.down_since = Some(Instant::now());
                h.outages += 1;
            }
        });
    }

    /// A connection found the database reachable.
    pub fn mark_up(&self) {
        self.with(|h| {
            if let Some(s) = h.down_since.take() {
                h.down_total += s.elapsed();
            }
        });
    }

    /// A connection was replaced by a working one.
    pub(crate) fn reconnected(&self) {
        self.with(|h| h.reconnects += 1);
        self.mark_up();
    }
}

/// The connection settings of every connection (see the module docs).
pub(crate) fn config(url: &str) -> Result<postgres::Config, PgError> {
    let mut c: postgres::Config = url.parse().map_err(PgError::Postgres)?;
    c.connect_timeout(CONNECT_TIMEOUT)
        .keepalives(true)
        .keepalives_idle(KEEPALIVE_IDLE)
        .keepalives_interval(KEEPALIVE_INTERVAL)
        .keepalives_retries(KEEPALIVE_RETRIES);
    Ok(c)
}

/// The session limits, set on every new connection.
pub(crate) fn limits_sql() -> String {
    format!(
        "SET lock_timeout = {}; SET statement_timeout = {}; \
         SET idle_in_transaction_session_timeout = {}",
        LOCK_TIMEOUT.as_millis(),
        STATEMENT_TIMEOUT.as_millis(),
        IDLE_IN_TRANSACTION_TIMEOUT.as_millis()
    )
}

/// The backend serving a connection: its process id and start time (as text), which together
/// name it even across server restarts (process ids are reused).
pub(crate) type Backend = (i32, String);

/// Connects with [`config`] and sets the limits; returns the client and its backend.
pub(crate) fn open(config: &postgres::Config) -> Result<(Client, Backend), PgError> {
    let mut client = config.connect(NoTls)?;
    client.batch_execute(&limits_sql())?;
    let r = client.query_one(
        "SELECT pg_backend_pid(), backend_start::text FROM pg_stat_activity \
         WHERE pid = pg_backend_pid()",
        &[],
    )?;
    let backend = (r.get(0), r.get(1));
    Ok((client, backend))
}

/// One reconnecting connection and its prepared statements.
pub(crate) struct Conn {
    config: postgres::Config,
    client: Option<Client>,
    cache: Cache,
    health: Arc<Health>,
    backoff: Duration,
    retry_at: Option<Instant>,
    backend: Option<Backend>,
    /// The process id of `backend` (0 while disconnected), shared with whoever asked for it
    /// ([`Conn::backend_pid`]).
    pid: Arc<AtomicI32>,
    reconnects: u64,
}

impl Drop for Conn {
    /// A `postgres::Client` blocks on its own runtime when dropped, which panics on a thread
    /// that drives async tasks (a daemon's last handle may be dropped there): the client is
    /// dropped on a thread of its own.
    fn drop(&mut self) {
        if let Some(c) = self.client.take() {
            let _ = std::thread::Builder::new()
                .name("tutti-pg-close".into())
                .spawn(move || drop(c));
        }
    }
}

impl Conn {
    /// Connects once; the error of a first connection is returned as is.
    pub(crate) fn open(config: postgres::Config, health: Arc<Health>) -> Result<Conn, PgError> {
        let (client, backend) = match open(&config) {
            Ok(c) => c,
            Err(e) => {
                if e.is_unavailable() {
                    health.mark_down();
                }
                return Err(e);
            }
        };
        health.mark_up();
        Ok(Conn {
            config,
            client: Some(client),
            cache: Cache::new(),
            health,
            backoff: BACKOFF_MIN,
            retry_at: None,
            pid: Arc::new(AtomicI32::new(backend.0)),
            backend: Some(backend),
            reconnects: 0,
        })
    }

    /// The health value this connection reports to.
    pub(crate) fn health(&self) -> &Arc<Health> {
        &self.health
    }

    /// The backend of the current connection (`None` while disconnected).
    pub(crate) fn backend(&self) -> Option<&Backend> {
        self.backend.as_ref()
    }

    /// The process id of the current connection's backend, kept current across reconnects (0
    /// while disconnected).
    pub(crate) fn backend_pid(&self) -> Arc<AtomicI32> {
        self.pid.clone()
    }

    /// Drops the current connection (the next use reconnects at once, backoff permitting).
    pub(crate) fn drop_connection(&mut self) {
        if self.client.take().is_some() {
            self.health.mark_down();
        }
        self.cache.clear();
        self.backend = None;
        self.pid.store(0, Ordering::Relaxed);
    }

    /// How many times this connection was replaced by a working one.
    pub(crate) fn reconnects(&self) -> u64 {
        self.reconnects
    }

    /// When the next reconnect may be tried (`None`: now).
    pub(crate) fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// The current client, if connected (never reconnects).
    pub(crate) fn current(&mut self) -> Option<&mut Client> {
        self.client.as_mut().filter(|c| !c.is_closed())
    }

    /// The working client (reconnecting first if it was found closed) and its statements.
    pub(crate) fn parts(&mut self) -> Result<(&mut Client, &mut Cache), PgError> {
        if self.client.as_ref().is_some_and(|c| c.is_closed()) {
            self.drop_connection();
        }
        if self.client.is_none() {
            self.reconnect()?;
        }
        match self.client.as_mut() {
            Some(c) => Ok((c, &mut self.cache)),
            None => Err(PgError::Unavailable {
                reason: "not connected".into(),
                lost: true,
            }),
        }
    }

    fn reconnect(&mut self) -> Result<(), PgError> {
        let now = Instant::now();
        if let Some(at) = self.retry_at.filter(|at| *at > now) {
            return Err(PgError::Unavailable {
                reason: format!(
                    "reconnecting in {} ms",
                    at.saturating_duration_since(now).as_millis()
                ),
                lost: false,
            });
        }
        match open(&self.config) {
            Ok((client, backend)) => {
                self.client = Some(client);
                self.pid.store(backend.0, Ordering::Relaxed);
                self.backend = Some(backend);
                self.cache.clear();
                self.backoff = BACKOFF_MIN;
                self.retry_at = None;
                self.reconnects += 1;
                self.health.reconnected();
                Ok(())
            }
            Err(e) => {
                self.health.mark_down();
                self.retry_at = Some(Instant::now() + self.backoff);
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                Err(match e {
                    PgError::Unavailable { reason, .. } => PgError::Unavailable {
                        reason,
                        lost: false,
                    },
                    other => other,
                })
            }
        }
    }

    /// A use of the connection succeeded: the database is reachable.
    pub(crate) fn saw_ok(&mut self) {
        self.health.mark_up();
    }

    /// A use of the connection failed with `e`: a connection that is gone is dropped (the next
    /// use reconnects); any other error came from a reachable server.
    pub(crate) fn saw_err(&mut self, e: &PgError) {
        match e {
            PgError::Unavailable { lost: true, .. } => self.drop_connection(),
            PgError::Unavailable { lost: false, .. } | PgError::OutcomeUnknown(_) => {}
            _ => self.health.mark_up(),
        }
    }
}
