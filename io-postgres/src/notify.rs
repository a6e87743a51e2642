//! Waking the event stream of every daemon on a database: `LISTEN/NOTIFY` on the outbox.
//!
//! Issue 21: "`GET /v1/events` on any daemon streams rows committed by any daemon, in sequence
//! order". Every transaction that publishes outbox rows sends `NOTIFY tutti_outbox, '<last
//! seq>'` inside itself (see `apply`), so PostgreSQL delivers it when, and only if, the rows are
//! committed, after every earlier commit's notification. The payload is `<schema>:<seq>` (the
//! channel is per database; a listener only takes its own schema's seqs). An [`OutboxListener`] is one connection
//! that listens on that channel; [`OutboxListener::wait`] returns the highest seq notified
//! since the last call. The notification is only a wake-up: the rows themselves are read from
//! the outbox table, so a lost notification (a dropped listener connection) delays a follower
//! until the next wake-up or poll and loses nothing.

use crate::conn::Health;
use crate::error::{to_u64, PgError};
use postgres::fallible_iterator::FallibleIterator;
use postgres::Client;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The notification channel of committed outbox rows (payload: the commit's last seq).
pub const OUTBOX_CHANNEL: &str = "tutti_outbox";

/// One listening connection on [`OUTBOX_CHANNEL`].
pub struct OutboxListener {
    client: Client,
    health: Arc<Health>,
    /// `<current schema>:`, the prefix of this store's payloads.
    prefix: String,
    /// The backend whose notifications are not wake-ups (see [`OutboxListener::skipping`]).
    own: Option<Arc<AtomicI32>>,
}

impl std::fmt::Debug for OutboxListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxListener").finish_non_exhaustive()
    }
}

/// What [`OutboxListener::wait`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Commits were notified; the highest last seq among them.
    Committed(u64),
    /// Nothing was notified within the timeout; the last seq in the counter row (the polling
    /// fallback: a caller compares it with what it has seen).
    Quiet(u64),
}

impl OutboxListener {
    /// Connects and starts listening (the same URL forms as [`crate::PostgresStore::connect`]).
    pub fn connect(url: &str) -> Result<OutboxListener, PgError> {
        OutboxListener::connect_with(url, Health::new())
    }

    /// [`OutboxListener::connect`] with the connection settings of [`crate::conn`], reporting
    /// reachability to `health`. A listener does not reconnect by itself: after an error,
    /// connect a new one (it `LISTEN`s again) and read [`OutboxListener::last_seq`] once, so that
    /// commits notified while no connection listened are not missed.
    pub fn connect_with(url: &str, health: Arc<Health>) -> Result<OutboxListener, PgError> {
        let r = OutboxListener::open(url, health.clone());
        match &r {
            Ok(_) => health.mark_up(),
            Err(e) if e.is_unavailable() => health.mark_down(),
            Err(_) => {}
        }
        r
    }

    fn open(url: &str, health: Arc<Health>) -> Result<OutboxListener, PgError> {
        let (mut client, _) = crate::conn::open(&crate::conn::config(url)?)?;
        client.batch_execute("LISTEN tutti_outbox")?;
        let schema: String = client
            .query_one("SELECT current_schema()::text", &[])?
            .get(0);
        Ok(OutboxListener {
            client,
            health,
            prefix: format!("{schema}:"),
            own: None,
        })
    }

    /// Issue 33: notifications sent by the backend whose process id `own` holds (a daemon's
    /// own writer, see [`crate::PostgresStore::backend_pid_watch`]; 0: none) are not wake-ups:
    /// [`OutboxListener::wait`] goes on waiting after them. A daemon hands its own commits'
    /// rows to its followers itself; woken by their notification, which may arrive before
    /// those rows do, every follower would read the rows from the database instead. A
    /// notification from the writer's previous backend (before a reconnect) still wakes, and
    /// the polling fallback ([`Wake::Quiet`]) still reports every commit.
    pub fn skipping(mut self, own: Arc<AtomicI32>) -> OutboxListener {
        self.own = Some(own);
        self
    }

    /// The last seq in the counter row (what every follower must catch up to).
    pub fn last_seq(&mut self) -> Result<u64, PgError> {
        let r = self.last_seq_inner();
        self.saw(&r);
        r
    }

    fn last_seq_inner(&mut self) -> Result<u64, PgError> {
        let v: i64 = self
            .client
            .query_one("SELECT value FROM meta WHERE key = 'outbox_next_seq'", &[])?
            .get(0);
        Ok(to_u64("outbox seq", v)?.saturating_sub(1))
    }

    fn saw<T>(&self, r: &Result<T, PgError>) {
        match r {
            Ok(_) => self.health.mark_up(),
            Err(e) if e.is_unavailable() => self.health.mark_down(),
            Err(_) => {}
        }
    }

    /// Waits up to `timeout` for notifications; returns the highest notified seq, or, when
    /// none came within `timeout` (or only other schemas', malformed or skipped ones, see
    /// [`OutboxListener::skipping`]), the last seq read from the database.
    pub fn wait(&mut self, timeout: Duration) -> Result<Wake, PgError> {
        let r = self.wait_inner(timeout);
        self.saw(&r);
        r
    }

    fn wait_inner(&mut self, timeout: Duration) -> Result<Wake, PgError> {
        let deadline = Instant::now() + timeout;
        let own = self
            .own
            .as_ref()
            .map(|p| p.load(Ordering::Relaxed))
            .filter(|p| *p != 0);
        let prefix = self.prefix.as_str();
        let mut n = self.client.notifications();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            // The first notification (or the timeout), then whatever else is already here.
            let Some(first) = n.timeout_iter(left).next()? else {
                break;
            };
            let mut best: Option<u64> = None;
            let mut take = |note: &postgres::Notification| {
                if own == Some(note.process_id()) {
                    return;
                }
                if let Some(seq) = note
                    .payload()
                    .strip_prefix(prefix)
                    .and_then(|s| s.parse::<u64>().ok())
                {
                    best = Some(best.map_or(seq, |b| b.max(seq)));
                }
            };
            take(&first);
            let mut rest = n.iter();
            while let Some(more) = rest.next()? {
                take(&more);
            }
            if let Some(seq) = best {
                return Ok(Wake::Committed(seq));
            }
        }
        drop(n);
        Ok(Wake::Quiet(self.last_seq_inner()?))
    }
}
