//! The daemon on PostgreSQL (`tuttid serve --db postgres://...`), and the event stream across
//! daemons that share one database.
//!
//! [`start`] connects two [`PostgresStore`] handles (the engine thread's writer and the API's
//! reader), runs [`Daemon::start_on`] on them (restart recovery as with SQLite: every live tree
//! found at start settles interrupted), and starts a listener thread: one more connection that
//! `LISTEN`s on [`OUTBOX_CHANNEL`] and feeds the highest committed outbox seq into
//! [`Daemon::with_commits_from`], so `GET /v1/events` on this daemon streams the rows every
//! daemon on the database commits. Polling is only the fallback: when no notification came for
//! [`POLL`], the listener reads the counter row once (a notification lost with a dropped
//! connection delays a follower by at most that long; it loses nothing, since rows are always
//! read from the outbox table).
//!
//! Tree ownership ([`Leases`], issue 21): before a daemon launches a tree's provider it claims
//! the tree's lease (owner: a daemon id made at the first start and kept in a file, see [`Leases::daemon_id`]; owner address: its listen address;
//! expiry: now + [`Leases::ttl`]), renews its leases every third of that, and releases a lease
//! when the runtime stops. The claim fences the writer handle: every later batch for that tree
//! commits only while the lease epoch is still this daemon's, so a daemon that lost its lease
//! never commits for the tree again, and stops its runtime at the next renewal. At start, live
//! trees whose lease another daemon holds (unexpired) are not settled.
//!
//! Commands (create, submit, cancel, answer, delete) claim the tree's lease before the engine
//! sees them ([`Housekeeping::acquire`]), so every batch for a tree, its first (the create)
//! included, is fenced. A command for a tree whose lease another daemon holds, unexpired, is
//! forwarded to that daemon (see [`crate::forward`]; authenticated by the database's cluster
//! secret); an expired lease is claimed and the tree reloaded from the store (settled first,
//! as failover does, when its owner stopped renewing).
//!
//! Failover: at every renewal tick a daemon claims the trees whose lease expired without being
//! released (their owner died or was cut off) and settles them as a restart does.

use crate::daemon::{
    Acquired, Daemon, DaemonOptions, Housekeeping, Ownership, StartError, StoreCheckpoint,
};
use std::collections::BTreeMap;
use std::sync::atomic::AtomicI32;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tracing::info;
use tracing::{debug, warn};
use tutti_core::model::Id;
use tutti_core::step::PersistBatch;
use tutti_core::store::{GroupError, HostStore, Published};
use tutti_postgres::conn;
use tutti_postgres::lease::Claim;
use tutti_postgres::notify::{OutboxListener, Wake, OUTBOX_CHANNEL};
use tutti_postgres::{Health, PgError, PostgresStore};

/// How long the listener waits for a notification before it reads the counter row itself.
pub const POLL: Duration = Duration::from_secs(2);

/// The default lease time of a tree ([`Leases::ttl`]).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// This daemon's tree leases on PostgreSQL (see the module docs), with the store's checkpoint
/// housekeeping.
#[derive(Debug)]
pub struct Leases {
    /// This daemon's id (see [`Leases::daemon_id`]).
    pub owner: String,
    /// Where this daemon takes commands (its listen address).
    pub address: String,
    /// How long a lease lasts unless renewed.
    pub ttl: Duration,
    /// Each lease held.
    held: BTreeMap<Id, Held>,
    checkpoint: StoreCheckpoint,
    /// The writer's reconnect count last seen (see [`Housekeeping::reconnected`]).
    reconnects: u64,
}

/// A lease this daemon holds.
#[derive(Debug, Clone, Copy)]
struct Held {
    epoch: u64,
    /// Until when this daemon acts for the tree by its own clock (see
    /// [`crate::lease_watch`]): the start of the last successful claim or renewal plus the lease
    /// time minus [`crate::lease_watch::safety_margin`].
    good_until_ms: i64,
}

impl Leases {
    /// Leases of the daemon `owner` listening on `address`, each lasting `ttl`.
    pub fn new(owner: String, address: String, ttl: Duration) -> Leases {
        Leases {
            owner,
            address,
            ttl,
            held: BTreeMap::new(),
            checkpoint: StoreCheckpoint::default(),
            reconnects: 0,
        }
    }

    /// The daemon id stored in `file`, made (from the process id and the time) and stored there
    /// on the first start. Choice: the id is kept across restarts of a daemon on the same
    /// files, so a daemon restarted after a crash takes its own trees back at once (it claims
    /// its own unexpired leases) and settles them as a restart does; a second daemon must use
    /// files of its own.
    pub fn daemon_id(file: &std::path::Path) -> std::io::Result<String> {
        if let Ok(id) = std::fs::read_to_string(file) {
            let id = id.trim();
            if !id.is_empty() {
                return Ok(id.to_string());
            }
        }
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let id = format!("tuttid-{}-{started}", std::process::id());
        std::fs::write(file, &id)?;
        Ok(id)
    }

    fn ttl_ms(&self) -> i64 {
        i64::try_from(self.ttl.as_millis()).unwrap_or(i64::MAX)
    }

    /// A lease claimed or renewed by a statement started at `now_ms`.
    fn held_from(&self, epoch: u64, now_ms: i64) -> Held {
        let good_for = self
            .ttl
            .saturating_sub(crate::lease_watch::safety_margin(self.ttl));
        let good_for = i64::try_from(good_for.as_millis()).unwrap_or(i64::MAX);
        Held {
            epoch,
            good_until_ms: now_ms.saturating_add(good_for),
        }
    }
}

impl Housekeeping<PostgresStore> for Leases {
    fn committed(&mut self) {
        Housekeeping::<PostgresStore>::committed(&mut self.checkpoint);
    }
    fn after_round(&mut self, store: &mut PostgresStore) {
        self.checkpoint.after_round(store);
    }
    fn epoch(&self, root: &Id) -> Option<u64> {
        self.held.get(root).map(|h| h.epoch)
    }
    fn decided_epoch(&self, store: &PostgresStore, root: &Id) -> Option<u64> {
        self.epoch(root).or_else(|| store.fenced_at(root))
    }
    fn commit_group(
        &mut self,
        store: &mut PostgresStore,
        batches: &[&PersistBatch],
        decided: &[Option<u64>],
        payloads: bool,
    ) -> Result<Vec<Vec<Published>>, GroupError<PgError>> {
        store
            .group_decided(batches, decided, payloads)
            .map_err(|(index, e)| match index {
                Some(index) => GroupError::Batch { index, source: e },
                None => GroupError::Commit(e),
            })
    }
    fn claim(&mut self, store: &mut PostgresStore, root: &Id, now_ms: i64) -> Ownership {
        let ttl = self.ttl_ms();
        match store.claim_lease(root, &self.owner, &self.address, now_ms, ttl) {
            Ok(Claim::Owned(l)) => {
                debug!(root = %root, epoch = l.epoch, "tree lease claimed");
                let held = self.held_from(l.epoch, now_ms);
                self.held.insert(root.clone(), held);
                Ownership::Owned
            }
            Ok(Claim::HeldBy(l)) => Ownership::Elsewhere(l.owner_address),
            Err(e) => Ownership::Unknown(e.to_string()),
        }
    }
    fn renew(&mut self, store: &mut PostgresStore, now_ms: i64) -> Vec<Id> {
        let ttl = self.ttl_ms();
        let held: Vec<(&str, u64)> = self.held.iter().map(|(r, h)| (&**r, h.epoch)).collect();
        if held.is_empty() {
            return Vec::new();
        }
        // One statement for all of them (see `PostgresStore::renew_leases`).
        let renewed = match store.renew_leases(&self.owner, &held, now_ms, ttl) {
            Ok(r) => r,
            // The database is unreachable (logged once, see `start`): all wait for the next
            // tick.
            Err(e) if e.is_unavailable() => {
                debug!(error = %e, "tree leases not renewed: store unavailable");
                return Vec::new();
            }
            // None lost: the fence still refuses commits if another daemon took one over.
            Err(e) => {
                warn!(leases = held.len(), error = %e, "tree leases not renewed");
                return Vec::new();
            }
        };
        let renewed: std::collections::HashSet<Id> = renewed.into_iter().collect();
        let (kept, lost): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|(root, _)| renewed.contains(root));
        for (root, held) in kept {
            let held = self.held_from(held.epoch, now_ms);
            self.held.insert(root, held);
        }
        lost.into_iter().map(|(root, _)| root).collect()
    }
    fn orphaned(&mut self, store: &mut PostgresStore, now_ms: i64) -> Vec<Id> {
        let expired = match store.expired_leases(&self.owner, now_ms, 100) {
            Ok(e) => e,
            Err(e) => {
                if e.is_unavailable() {
                    debug!(error = %e, "expired tree leases not readable: store unavailable");
                } else {
                    warn!(error = %e, "expired tree leases not readable");
                }
                return Vec::new();
            }
        };
        expired
            .into_iter()
            .filter(|root| self.claim(store, root, now_ms) == Ownership::Owned)
            .collect()
    }
    fn release(&mut self, store: &mut PostgresStore, root: &Id) {
        Housekeeping::<PostgresStore>::release_all(self, store, std::slice::from_ref(root));
    }
    fn release_all(&mut self, store: &mut PostgresStore, roots: &[Id]) {
        let held: Vec<(Id, u64)> = roots
            .iter()
            .filter_map(|r| Some((r.clone(), self.held.remove(r)?.epoch)))
            .collect();
        if held.is_empty() {
            return;
        }
        let held: Vec<(&str, u64)> = held.iter().map(|(r, e)| (&**r, *e)).collect();
        // One statement for all of them (see `PostgresStore::release_leases`).
        if let Err(e) = store.release_leases(&self.owner, &held) {
            warn!(leases = held.len(), error = %e, "tree leases not released");
        }
    }
    fn acquire(&mut self, store: &mut PostgresStore, root: &Id, now_ms: i64) -> Acquired {
        match self.held.get(root) {
            Some(h) if now_ms < h.good_until_ms => return Acquired::Held,
            // Past its good-until instant (renewals failed): the lease no longer counts as
            // held; the command claims it again (503 while the store is unreachable), and the
            // claim of this daemon's own unreleased lease settles the tree first.
            Some(_) => {
                debug!(root = %root, "tree lease not renewed in time; claiming it again");
                self.held.remove(root);
            }
            None => {}
        }
        let ttl = self.ttl_ms();
        match store.claim_lease_after(root, &self.owner, &self.address, now_ms, ttl) {
            Ok((Claim::Owned(l), previous)) => {
                debug!(root = %root, epoch = l.epoch, "tree lease claimed");
                let held = self.held_from(l.epoch, now_ms);
                self.held.insert(root.clone(), held);
                Acquired::Claimed {
                    orphaned: previous.is_some_and(|p| !p.is_released()),
                }
            }
            Ok((Claim::HeldBy(l), _)) => Acquired::Elsewhere {
                owner_address: l.owner_address,
                expires_at_ms: l.expires_at_ms,
            },
            Err(e) if e.is_unavailable() => Acquired::Unavailable(e.to_string()),
            Err(e) => Acquired::Unknown(e.to_string()),
        }
    }
    fn reconnected(&mut self, store: &mut PostgresStore) -> bool {
        let n = store.reconnects();
        let changed = n != self.reconnects;
        self.reconnects = n;
        changed
    }
    fn renew_every(&self) -> Option<Duration> {
        Some((self.ttl / 3).max(Duration::from_millis(100)))
    }
    fn good_until(&self, root: &Id) -> Option<i64> {
        self.held.get(root).map(|h| h.good_until_ms)
    }
    fn forget(&mut self, root: &Id) {
        self.held.remove(root);
    }
    fn watch_period(&self) -> Option<Duration> {
        Some(crate::lease_watch::watch_period(self.ttl))
    }
}

/// Whether `--db` names a PostgreSQL database (`postgres://` or `postgresql://`).
pub fn is_url(db: &str) -> bool {
    PostgresStore::is_url(db)
}

/// `url` without its user information (user and password), for logs and messages.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "postgres".to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
        None => format!("{scheme}://{rest}"),
    }
}

/// Starts the daemon on the PostgreSQL database at `url` (see the module docs). `opts.db` is
/// only reported by [`Daemon::db`]. Call within a Tokio runtime (like [`Daemon::start_on`]);
/// from async code too: the blocking client (`postgres` runs its own runtime, which cannot be
/// started on a thread that drives async tasks) connects and recovers on a thread of its own.
pub fn start(url: &str, opts: DaemonOptions, leases: Leases) -> Result<Daemon, StartError> {
    let handle = tokio::runtime::Handle::current();
    std::thread::scope(|s| {
        s.spawn(|| {
            let _guard = handle.enter();
            start_here(url, opts, leases)
        })
        .join()
        .unwrap_or_else(|_| {
            Err(StartError::store(std::io::Error::other(
                "the PostgreSQL start-up thread panicked",
            )))
        })
    })
}

fn start_here(url: &str, opts: DaemonOptions, leases: Leases) -> Result<Daemon, StartError> {
    let health = Health::new();
    let mut writer = PostgresStore::connect_with(url, health.clone()).map_err(StartError::store)?;
    let candidate = crate::clock::random_hex(32)?;
    let secret = writer
        .cluster_secret(&candidate)
        .map_err(StartError::store)?;
    let cluster = crate::auth::Cluster::new(secret, leases.address.clone());
    let reader = PostgresStore::connect_with(url, health.clone()).map_err(StartError::store)?;
    // Issue 33: the writer's own commits reach this daemon's followers on the live channel;
    // their notifications would only send the followers to the database for the same rows.
    let own = writer.backend_pid_watch();
    let listener = OutboxListener::connect_with(url, health.clone())
        .map_err(StartError::store)?
        .skipping(own.clone());
    let last = reader.last_outbox_seq().map_err(StartError::store)?;
    let daemon = Daemon::start_on(writer, Box::new(reader), Box::new(leases), opts)?;
    let (tx, rx) = watch::channel(last);
    let url = url.to_string();
    let listen_health = health.clone();
    std::thread::Builder::new()
        .name("tutti-pg-listen".into())
        .spawn(move || listen(&url, listener, &own, &tx, &listen_health))?;
    tokio::runtime::Handle::current().spawn(watch_health(health.clone()));
    Ok(daemon
        .with_commits_from(rx)
        .with_cluster(cluster)
        .with_store_health(health))
}

/// How often [`watch_health`] looks at the store's reachability.
const HEALTH_EVERY: Duration = Duration::from_millis(250);

/// Logs each change of the database's reachability once (issue 34: "Recovery is logged once,
/// not per request"); ends with the daemon (once its connections and handles, which share
/// `health`, are gone).
async fn watch_health(health: Arc<Health>) {
    let mut up = true;
    let mut tick = tokio::time::interval(HEALTH_EVERY);
    loop {
        tick.tick().await;
        if Arc::strong_count(&health) <= 1 {
            return;
        }
        let now = health.is_up();
        if now == up {
            continue;
        }
        up = now;
        if up {
            info!(
                reconnects = health.reconnects(),
                unavailable_seconds = health.unavailable_seconds(),
                "database reachable again"
            );
        } else {
            warn!("database unreachable; commands and reads answer 503 until it is back");
        }
    }
}

/// Raises `tx` to `seq` (never lowers it).
fn raise(tx: &watch::Sender<u64>, seq: u64) {
    tx.send_if_modified(|v| {
        let raised = seq > *v;
        if raised {
            *v = seq;
        }
        raised
    });
}

/// The listener thread: raises `tx` to every notified (or polled) last seq, except the
/// notifications of this daemon's own writer (its backend's process id is `own`: see
/// [`OutboxListener::skipping`]); reconnects after an error (backoff from [`conn::BACKOFF_MIN`]
/// doubling to [`conn::BACKOFF_MAX`]), `LISTEN`s again and reads the counter row at once, so
/// followers catch up on the rows committed while nobody listened (they read rows from the
/// table after their last seq: nothing is missed); ends once no daemon handle holds the
/// receiver.
fn listen(
    url: &str,
    mut listener: OutboxListener,
    own: &Arc<AtomicI32>,
    tx: &watch::Sender<u64>,
    health: &Arc<Health>,
) {
    loop {
        while !tx.is_closed() {
            match listener.wait(POLL) {
                Ok(w) => {
                    let seq = match w {
                        Wake::Committed(s) | Wake::Quiet(s) => s,
                    };
                    raise(tx, seq);
                }
                Err(e) => {
                    debug!(channel = OUTBOX_CHANNEL, error = %e, "outbox listener failed; reconnecting");
                    break;
                }
            }
        }
        let mut backoff = conn::BACKOFF_MIN;
        loop {
            if tx.is_closed() {
                debug!("outbox listener stopped");
                return;
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(conn::BACKOFF_MAX);
            match OutboxListener::connect_with(url, health.clone()) {
                Ok(l) => {
                    let mut l = l.skipping(own.clone());
                    match l.last_seq() {
                        Ok(seq) => {
                            raise(tx, seq);
                            listener = l;
                            break;
                        }
                        Err(e) => debug!(error = %e, "outbox listener cannot read the counter"),
                    }
                }
                Err(e) => debug!(error = %e, "outbox listener cannot reconnect"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redact_drops_user_and_password() {
        assert_eq!(
            super::redact("postgres://u:secret@127.0.0.1:5432/db"),
            "postgres://127.0.0.1:5432/db"
        );
        assert_eq!(
            super::redact("postgresql://127.0.0.1/db"),
            "postgresql://127.0.0.1/db"
        );
    }
}
