//! The daemon core: one engine thread that owns a [`Driver`] (the engine, the adapters of the live
//! roots and every timer) and the store's writer, and one provider runtime task per root session
//! that only moves native messages between the provider process and the driver.
//!
//! The engine thread loops: receive (API calls, provider messages, exits, timer ticks) →
//! `driver.handle_*` → take the decided batches and group-commit them in one transaction →
//! acknowledge them → carry out the driver's outputs (launch a provider, write to it, publish to
//! followers, reply to callers) → arm the next deadline. If a group commit fails, its batches are
//! retried one by one; a batch that still fails is reported to the driver, which evicts and
//! reloads its tree (crash-only), and the inputs whose steps did not land get an error.
//!
//! On SQLite ([`Daemon::start`]) the group commits run on a commit thread with a writer handle
//! of its own (issue 33, see `Pipeline`): the engine thread hands a group over, goes on
//! deciding, and acknowledges the group when the commit thread wakes it (`Msg::Written`); the
//! next group is everything decided meanwhile. The commit thread announces the group's rows to
//! the live followers itself, as soon as they are durable. On PostgreSQL (leases, fences)
//! commits stay on the engine thread.

use crate::clock::now_ms;
use crate::metrics::{phase_name, Metrics, Stage, StateGauges};
use crate::outbox::{LiveBatch, LiveRow, LiveRows, LIVE_CAPACITY};
use crate::pipeline::{BatchOutcome, GroupOutcome, Pipeline};
use crate::reads::Reads;
use crate::retention::{LivePositions, QuiescentTrees, Retention};
use crate::runtime::{start_runtime, FromRuntime, RuntimeHandle, ToDaemon, Transport};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tracing::{debug, error, info, warn};
use tutti_core::adapters::Adapter;
use tutti_core::driver::{
    BatchId, CommitFailure, Diagnostic, Driver, DriverError, DriverInput, LaunchSpec, Output,
    Publication,
};
use tutti_core::model::{Capabilities, Id};
use tutti_core::step::PersistBatch;
use tutti_core::store::{GroupError, HostStore};
use tutti_core::{Command, Engine, EngineConfig, Input, Rejected, RuntimeAnswer, Step};
use tutti_sqlite::{
    CheckpointEvent, CheckpointMode, CheckpointPolicy, Checkpointer, OpenOptions, SqliteStore,
};

/// Inputs (and batches) one group commit takes at most (as the SQLite store's bound).
const MAX_GROUP: usize = tutti_sqlite::MAX_GROUP;

/// Starts provider runtimes for root sessions.
pub trait ProviderFactory: Send + Sync {
    /// The capabilities of a known provider name, or `None` if the name is unknown.
    fn capabilities(&self, provider: &str) -> Option<Capabilities>;
    /// Starts the provider process of one root session and its adapter. `provider_session_id`
    /// is the provider's own id of the root session from an earlier runtime (for example a Codex
    /// thread to resume after the previous process died), if any.
    fn launch(
        &self,
        provider: &str,
        root: &Id,
        cwd: Option<&str>,
        provider_session_id: Option<&str>,
    ) -> Result<(Box<dyn Adapter>, Transport), LaunchError>;
    /// Names of the known providers.
    fn names(&self) -> Vec<String>;
}

/// Why a provider runtime could not be started.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LaunchError {
    /// No provider of that name is configured.
    #[error("unknown provider {0}")]
    UnknownProvider(String),
    /// The provider process could not be started.
    #[error("cannot start {provider}: {error}")]
    Spawn {
        /// Provider name.
        provider: String,
        /// Why.
        error: String,
    },
}

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The SQLite database could not be opened.
    #[error("database: {0}")]
    Database(#[from] tutti_sqlite::SqliteError),
    /// The store could not be read.
    #[error("store: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The recovery commit (settling the turns whose provider died with the previous daemon)
    /// failed.
    #[error("recovery commit failed: {0}")]
    Recovery(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A thread could not be started.
    #[error("cannot start a thread: {0}")]
    Thread(#[from] std::io::Error),
}

impl StartError {
    pub(crate) fn store<E: std::error::Error + Send + Sync + 'static>(e: E) -> StartError {
        StartError::Store(Box::new(e))
    }
}

/// What a store needs done by the engine thread besides commits (for SQLite: WAL checkpoints,
/// see [`SqliteCheckpoints`]).
pub trait Housekeeping<S>: Send {
    /// A commit went through.
    fn committed(&mut self) {}
    /// The engine thread finished one round of inputs and commits.
    fn after_round(&mut self, store: &mut S);
    /// Tree ownership (issue 21: "Exactly one daemon runs the provider process of a root tree at
    /// a time: a lease row per live root (owner, epoch, expiry), claimed before the provider
    /// starts and renewed while it runs"). Called before `root`'s provider is launched and
    /// before a tree found live at start is settled. The default (a store only this daemon
    /// writes, e.g. SQLite): always owned.
    fn claim(&mut self, _store: &mut S, _root: &Id, _now_ms: i64) -> Ownership {
        Ownership::Owned
    }
    /// Renews every lease this daemon holds; returns the roots whose lease was taken over (their
    /// runtimes are stopped: the store's fence refuses their commits anyway).
    fn renew(&mut self, _store: &mut S, _now_ms: i64) -> Vec<Id> {
        Vec::new()
    }
    /// Failover: claims the trees whose owner stopped renewing their leases (expired, not
    /// released) and returns them; the engine thread settles each as a restart does
    /// (interrupted), then releases it.
    fn orphaned(&mut self, _store: &mut S, _now_ms: i64) -> Vec<Id> {
        Vec::new()
    }
    /// Gives up the lease of `root` (its runtime stopped).
    fn release(&mut self, _store: &mut S, _root: &Id) {}
    /// Gives up the leases of `roots` ([`Housekeeping::release`] for each; a store with leases
    /// releases them together, so that a round that stopped many runtimes, or a shutdown, does
    /// not hold the engine thread for one write per tree).
    fn release_all(&mut self, store: &mut S, roots: &[Id]) {
        for root in roots {
            self.release(store, root);
        }
    }
    /// Issue 21: "Every batch a daemon commits for a tree carries a fencing guard on the lease
    /// epoch". Called before a command on `root` (create, submit, cancel, answer, delete) is
    /// handed to the engine, so that the command's batch, a new tree's first batch included, is
    /// committed under this daemon's lease. The default (a store only this daemon writes):
    /// [`Acquired::Held`].
    fn acquire(&mut self, _store: &mut S, _root: &Id, _now_ms: i64) -> Acquired {
        Acquired::Held
    }
    /// Issue 34: whether the store's writer reconnected since the last call (its connection
    /// broke and was replaced). The engine thread then renews every lease at once
    /// ([`Housekeeping::renew`]: the trees lost meanwhile stop) and drops the quiescent trees it
    /// keeps from memory, so that they are loaded from the store on their next use. The
    /// default (a store without a connection): never.
    fn reconnected(&mut self, _store: &mut S) -> bool {
        false
    }
    /// How often [`Housekeeping::renew`] runs; `None`: never (no leases).
    fn renew_every(&self) -> Option<std::time::Duration> {
        None
    }
    /// Issue 34, the lease rule on the daemon's own clock (see [`crate::lease_watch`]): until
    /// when (wall-clock milliseconds) this daemon may act for `root`, its lease not renewed
    /// meanwhile. `None`: no lease bounds it (the default: a store only this daemon writes).
    fn good_until(&self, _root: &Id) -> Option<i64> {
        None
    }
    /// Drops `root`'s lease from this daemon's books without releasing it in the store (its
    /// provider was stopped because the lease was not renewed in time: the tree is settled by
    /// whoever claims it next, this daemon included).
    fn forget(&mut self, _root: &Id) {}
    /// How often the lease watchdog looks ([`crate::lease_watch::LeaseWatch::spawn`]); `None`
    /// (the default: no leases): no watchdog.
    fn watch_period(&self) -> Option<std::time::Duration> {
        None
    }
    /// Issue 34, per-batch fencing: the lease epoch this daemon holds `root` at now, read when
    /// the engine thread takes a batch the driver decided (so a batch carries the epoch it was
    /// decided under down to its commit, see [`Housekeeping::commit_group`]). The default (no
    /// leases): `None`.
    fn epoch(&self, _root: &Id) -> Option<u64> {
        None
    }
    /// Issue 34, per-batch fencing: the epoch a batch of `root` decided now is fenced by (see
    /// `Core::tag_decided`). The default: [`Housekeeping::epoch`].
    fn decided_epoch(&self, _store: &S, root: &Id) -> Option<u64> {
        self.epoch(root)
    }
    /// Commits a group of batches, `decided[i]` being the epoch batch `i` was decided under
    /// ([`Housekeeping::epoch`]): a store with leases refuses a batch whose epoch is no longer
    /// the tree's (fenced), even when this daemon holds the tree again at a newer epoch. The
    /// default: [`HostStore::apply_group`] (the epochs are `None` anyway).
    fn commit_group(
        &mut self,
        store: &mut S,
        batches: &[&PersistBatch],
        _decided: &[Option<u64>],
        payloads: bool,
    ) -> Result<Vec<Vec<tutti_core::store::Published>>, tutti_core::store::GroupError<S::Error>>
    where
        S: HostStore,
    {
        store.apply_group(batches, payloads)
    }
}

/// What [`Housekeeping::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ownership {
    /// This daemon owns the tree now.
    Owned,
    /// Another daemon holds an unexpired lease of the tree; it takes commands at this address.
    Elsewhere(String),
    /// The lease could not be read or written (the error, for logs: no content).
    Unknown(String),
}

/// What [`Housekeeping::acquire`] found before a command on a tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// This daemon already held the tree's lease (or the store has no leases): its loaded copy
    /// of the tree is current.
    Held,
    /// This daemon claimed the tree's lease just now. Its loaded copy may be stale (another
    /// daemon may have driven the tree since): the tree is reloaded from the store first.
    /// `orphaned`: the previous owner stopped renewing without releasing (it died or was cut
    /// off), so the tree is settled as at a restart (failover) before the command.
    Claimed {
        /// The previous owner's lease expired unreleased.
        orphaned: bool,
    },
    /// Another daemon holds the tree's unexpired lease.
    Elsewhere {
        /// Where the owner takes commands.
        owner_address: String,
        /// When the owner's lease expires (wall-clock milliseconds).
        expires_at_ms: i64,
    },
    /// The lease could not be read or written (the error, for logs: no content).
    Unknown(String),
    /// The lease could not be read or written because the store is unreachable (issue 34:
    /// answered `503 unavailable`, not a conflict).
    Unavailable(String),
}

/// The housekeeping of a store without its own: [`HostStore::checkpoint`] after rounds with
/// commits.
#[derive(Debug, Default)]
pub struct StoreCheckpoint {
    dirty: bool,
}

impl<S: HostStore> Housekeeping<S> for StoreCheckpoint {
    fn committed(&mut self) {
        self.dirty = true;
    }
    fn after_round(&mut self, store: &mut S) {
        if std::mem::take(&mut self.dirty) {
            if let Err(e) = store.checkpoint() {
                warn!(error = %e, "store checkpoint failed");
            }
        }
    }
}

/// SQLite's housekeeping: commits never checkpoint; the [`Checkpointer`] thread does passive
/// checkpoints (and its fsync) so that they never hold up the engine thread, and asks the engine
/// thread for a WAL restart when the log grew, which is done without waiting for readers.
pub struct SqliteCheckpoints(pub Checkpointer);

impl Housekeeping<SqliteStore> for SqliteCheckpoints {
    fn committed(&mut self) {
        self.0.committed();
    }
    fn after_round(&mut self, store: &mut SqliteStore) {
        if !self.0.restart_wanted() {
            return;
        }
        let t = std::time::Instant::now();
        // Never wait here: a reader in the way makes it `busy`, and the checkpoint thread asks
        // again after its next pass.
        match SqliteStore::checkpoint(store, CheckpointMode::RestartNoWait) {
            Ok(c) => debug!(
                wal_frames = c.wal_frames,
                busy = c.busy,
                micros = t.elapsed().as_micros() as u64,
                "WAL restart"
            ),
            Err(e) => warn!(error = %e, "WAL restart failed"),
        }
        self.0.restarted();
    }
}

/// Why a daemon call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DaemonError {
    /// The engine refused the input (nothing changed).
    #[error(transparent)]
    Rejected(#[from] Rejected),
    /// The step could not be committed (nothing changed); retry.
    #[error("storage: {0}")]
    Storage(String),
    /// The daemon is shutting down.
    #[error("the daemon is not running")]
    Stopped,
    /// Issue 34: the store could not be reached (its connection broke, the database is
    /// restarting or down, or a lock or statement wait ran out). Nothing of the command was
    /// written (or, when the connection broke after the commit was sent and the outcome could
    /// not be read back in time, the store's state once reachable is the truth); answered `503
    /// unavailable` with `Retry-After`.
    #[error("the store is unavailable; retry later ({0})")]
    Unavailable(String),
    /// Issue 34, bounded requests: the engine took the command but its commit did not finish
    /// within [`COMMAND_DEADLINE`] (the store hangs); the command may still take effect.
    /// Answered `504 outcome_unknown`.
    #[error("the command was taken but its commit did not finish in time; read the session to see whether it took effect")]
    OutcomeUnknown,
    /// Issue 21: a command (submit, cancel, answer, delete) for a tree whose lease another
    /// daemon holds, unexpired: that daemon runs the tree's provider and takes the command at
    /// `owner_address`. Nothing changed here; the API forwards the request there (see
    /// [`crate::forward`]), or answers 409 `owned_elsewhere` when the request was itself
    /// forwarded (no second hop).
    #[error("the tree is owned by the daemon at {owner_address}")]
    OwnedElsewhere {
        /// The owning daemon's listen address.
        owner_address: String,
        /// When the owner's lease expires unless renewed (wall-clock milliseconds).
        expires_at_ms: i64,
    },
    /// Issue 21: the command's batch was refused by the store because another writer changed
    /// the tree first (a version guard), or because this daemon lost the tree's lease (the
    /// fence). Nothing of the command was written; this daemon dropped its copy of the tree
    /// and reloaded it from the store (answered 409 `commit_conflict`; the command may be
    /// retried).
    #[error("the tree changed in the store before this command could commit; retry")]
    Conflict,
    /// Issue 36: a submit needed a provider process started, `limit` providers already run
    /// ([`DaemonOptions::max_providers`]) and none of them is idle, so none could be stopped
    /// to make room. Nothing changed (answered 503 `provider_limit`; retry once a tree settles).
    #[error("{limit} provider processes are running (the max_providers limit) and none is idle; retry when a session settles")]
    ProviderLimit {
        /// The cap.
        limit: usize,
    },
    /// The driver could not carry out a call for a reason that is neither the caller's input
    /// nor the store: a provider adapter failed on it, or the root had no live adapter.
    /// Answered 500 `internal` (never 409: retrying the same request does not help).
    #[error("internal: {0}")]
    Internal(String),
}

/// A follower's narrow view of the daemon (see [`crate::follow`]).
impl crate::follow::OutboxSource for Daemon {
    fn subscribe(&self) -> broadcast::Receiver<LiveBatch> {
        self.live()
    }

    fn commits(&self) -> watch::Receiver<u64> {
        self.commits_watch()
    }

    fn positions(&self) -> &LivePositions {
        &self.positions
    }

    fn read_outbox(
        &self,
        after: u64,
        check_head: bool,
    ) -> Result<crate::follow::OutboxPage, crate::follow::FollowError> {
        use crate::follow::FollowError;
        match self.read(|r| crate::follow::read_page(r, after, check_head)) {
            Ok(page) => Ok(page?),
            Err(DaemonError::Unavailable(m)) => Err(FollowError::Unavailable(m)),
            Err(e) => Err(FollowError::Read(e.to_string())),
        }
    }

    fn stream_time(&self, spent: std::time::Duration) {
        self.metrics.stage(Stage::Stream, spent);
    }
}

impl From<crate::reads::ReadError> for DaemonError {
    fn from(e: crate::reads::ReadError) -> DaemonError {
        if e.is_unavailable() {
            DaemonError::Unavailable(e.0)
        } else {
            DaemonError::Storage(e.to_string())
        }
    }
}

impl From<DriverError> for DaemonError {
    fn from(e: DriverError) -> DaemonError {
        match e {
            DriverError::Rejected(r) => DaemonError::Rejected(r),
            DriverError::Refused => DaemonError::Conflict,
            DriverError::Unavailable(m) => DaemonError::Unavailable(m),
            DriverError::Storage(m) => DaemonError::Storage(m),
            e @ (DriverError::Adapter(_) | DriverError::NoAdapter(_)) => {
                DaemonError::Internal(e.to_string())
            }
        }
    }
}

#[allow(clippy::large_enum_variant)] // one message per input; boxing would add an allocation each
enum Msg {
    Input(
        Input,
        Option<oneshot::Sender<Result<Step, DaemonError>>>,
        Option<Arc<Ticket>>,
    ),
    /// What the runtime of a root (at a generation: an earlier runtime's messages are stale)
    /// reported.
    Runtime(Id, u64, FromRuntime),
    /// The deadline armed for the driver's timers (or a later one) was reached.
    Tick,
    SetCwd(Id, String),
    /// The idle timer of a root's provider runtime, armed at the given generation.
    IdleCheck(Id, u64),
    /// Run an outbox retention pass (see [`crate::retention`]).
    Prune,
    /// Renew this daemon's tree leases (see [`Housekeeping::renew`]).
    RenewLeases,
    /// The root ids of the trees loaded in the engine.
    Resident(oneshot::Sender<Vec<Id>>),
    /// The state gauges of a metrics scrape.
    Gauges(oneshot::Sender<StateGauges>),
    Shutdown(oneshot::Sender<()>),
    /// The commit thread wrote a group (see [`Pipeline`]).
    Written,
}

/// A handle to a running daemon core (cheap to clone).
#[derive(Clone)]
pub struct Daemon {
    tx: mpsc::UnboundedSender<Msg>,
    reader: Arc<Mutex<Box<dyn Reads>>>,
    outbox: watch::Receiver<u64>,
    live: broadcast::WeakSender<LiveBatch>,
    providers: Arc<dyn ProviderFactory>,
    db: PathBuf,
    positions: Arc<LivePositions>,
    /// The highest outbox seq known to be committed by another writer of the database (see
    /// [`Daemon::with_commits_from`]); never changes for a store that only this daemon writes.
    commits: watch::Receiver<u64>,
    metrics: Arc<Metrics>,
    /// The daemons sharing this daemon's database (see [`crate::forward`]); `None` for a store
    /// only this daemon writes.
    cluster: Option<Arc<crate::auth::Cluster>>,
    /// Whether the store's server is reachable (issue 34; `None`: a local file, always).
    store_health: Option<Arc<tutti_postgres::Health>>,
}

/// Options of the daemon core.
pub struct DaemonOptions {
    /// Database file.
    pub db: PathBuf,
    /// Provider runtimes.
    pub providers: Arc<dyn ProviderFactory>,
    /// Engine settings.
    pub engine: EngineConfig,
    /// How long a provider runtime whose tree is quiescent (no active turn, no prepared cancel, no
    /// pending interaction) stays up before it is stopped; `None` keeps it until the tree is
    /// deleted or the daemon stops.
    pub idle_timeout: Option<std::time::Duration>,
    /// Resident trees and outbox retention (see [`crate::retention`]).
    pub retention: Retention,
    /// SQLite commit durability (only [`Daemon::start`] opens the file; other stores ignore it).
    pub durability: crate::durability::Durability,
    /// Issue 36: "A cap on live provider processes (config; default sized to the machine)":
    /// at most this many provider runtimes run at once (`None`: [`default_max_providers`]; 0
    /// is taken as 1). A submit that needs a provider started while the cap is reached first
    /// stops the least recently used idle one (quiescent tree, as for the idle timeout); when
    /// every running provider is busy the submit is refused with
    /// [`DaemonError::ProviderLimit`] and nothing changes (no turn is started that would then
    /// be interrupted).
    pub max_providers: Option<usize>,
}

/// Provider processes one runtime needs in the daemon's descriptor budget: its stdin, stdout
/// and stderr pipes, with room for the process's own bookkeeping.
const FDS_PER_PROVIDER: u64 = 8;
/// The memory one provider process is budgeted (real agents are Node or native programs of
/// about 100 to 300 MB).
const MEMORY_PER_PROVIDER: u64 = 256 << 20;

/// The default cap on live provider processes, sized to the machine: the smaller of three
/// quarters of the soft `RLIMIT_NOFILE` at 8 descriptors a provider (the rest is for HTTP
/// connections, event streams and the database) and half the physical memory at 256 MiB a
/// provider; at least 2, at most 1,024. (A 1,024-descriptor limit allows 96.)
pub fn default_max_providers() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limit into the struct it is given.
    let nofile = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        1024
    };
    let by_fds = nofile.saturating_mul(3) / 4 / FDS_PER_PROVIDER;
    // SAFETY: sysconf only reads system configuration values.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let memory = match (u64::try_from(pages), u64::try_from(page)) {
        (Ok(n), Ok(p)) if n > 0 && p > 0 => n.saturating_mul(p),
        _ => 8 << 30,
    };
    let by_memory = memory / 2 / MEMORY_PER_PROVIDER;
    usize::try_from(by_fds.min(by_memory).clamp(2, 1024)).unwrap_or(2)
}

/// The default of [`DaemonOptions::idle_timeout`]: five minutes.
pub const DEFAULT_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// How long daemon shutdown waits for the provider runtimes to end their process groups.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_millis(1100);

impl Daemon {
    /// Opens the database, restores live trees, settles the turns whose provider process no
    /// longer exists (they cannot survive a daemon restart), and starts the engine thread.
    pub fn start(opts: DaemonOptions) -> Result<Daemon, StartError> {
        // Commits never checkpoint: the checkpoint (and its fsync) runs on a thread of its own so
        // that it never holds up the engine thread (see `checkpointer`).
        let writer = || {
            SqliteStore::open_with(
                &opts.db,
                &OpenOptions::new()
                    .auto_checkpoint(false)
                    .synchronous(opts.durability.synchronous()),
            )
        };
        let store = writer()?;
        tracing::info!(
            durability = opts.durability.as_str(),
            synchronous = ?store.synchronous().ok().flatten(),
            "database opened"
        );
        // Issue 33: group commits run on a thread of their own, on a second writer handle, while
        // the engine thread decides (see [`Pipeline`]).
        let committer = writer()?;
        let reader = SqliteStore::open(&opts.db)?;
        let checkpoints =
            Checkpointer::start(&opts.db, CheckpointPolicy::default(), log_checkpoint)?;
        Daemon::start_with(
            store,
            Some(committer),
            Box::new(reader),
            Box::new(SqliteCheckpoints(checkpoints)),
            opts,
        )
    }

    /// [`Daemon::start`] on any store: `store` is the engine thread's writer, `reader` a second
    /// handle on the same data for the API's reads (it must see every commit of `store`), and
    /// `housekeeping` what the store needs between commits (see [`Housekeeping`]; for
    /// [`SqliteStore`], [`Daemon::start`] runs its checkpoint thread). `opts.db` is only reported
    /// by [`Daemon::db`].
    /// Commits run inline on the engine thread (see [`Daemon::start`] for the pipelined ones).
    pub fn start_on<S: HostStore + Send + 'static>(
        store: S,
        reader: Box<dyn Reads>,
        housekeeping: Box<dyn Housekeeping<S>>,
        opts: DaemonOptions,
    ) -> Result<Daemon, StartError> {
        Daemon::start_with(store, None, reader, housekeeping, opts)
    }

    /// [`Daemon::start_on`], with `committer` (a second writer handle on the same data, for a
    /// store without tree leases) writing the group commits on a thread of their own (see
    /// [`Pipeline`]).
    fn start_with<S: HostStore + Send + 'static>(
        mut store: S,
        committer: Option<S>,
        reader: Box<dyn Reads>,
        housekeeping: Box<dyn Housekeeping<S>>,
        opts: DaemonOptions,
    ) -> Result<Daemon, StartError> {
        let mut engine = Engine::with_config(opts.engine);
        // Without message ids: the settle step below appends no message, and every recovered
        // tree is evicted right after it (the next input loads the whole tree). Reading and
        // indexing every stored message id would dominate the start-up time.
        let live = store
            .load_live_trees_without_messages()
            .map_err(StartError::store)?;
        let mut recovered = Vec::new();
        for t in live {
            let root = t.root().map(|r| r.id.clone());
            if let Err(e) = engine.restore(t) {
                warn!(error = %e, "a stored tree could not be restored");
                continue;
            }
            if let Some(r) = root {
                recovered.push(r);
            }
        }
        let now = now_ms();
        let mut settle = Vec::with_capacity(recovered.len());
        let mut housekeeping = housekeeping;
        let mut claimed = Vec::with_capacity(recovered.len());
        for root in &recovered {
            // Issue 21: a daemon no longer settles live trees whose lease another daemon holds
            // (unexpired): their provider runs there. A tree whose lease cannot be read is left
            // alone too (choice: settling it could interrupt a turn another daemon drives).
            match housekeeping.claim(&mut store, root, now) {
                Ownership::Owned => claimed.push(root.clone()),
                Ownership::Elsewhere(_) => {
                    info!(root = %root, "live tree owned by another daemon; not settled");
                    continue;
                }
                Ownership::Unknown(e) => {
                    warn!(root = %root, error = %e, "tree lease unreadable; not settled");
                    continue;
                }
            }
            // The provider processes died with the previous daemon: prepared cancels replay as
            // unconfirmed, and every active turn settles interrupted, in one step per tree.
            let input = Input::Runtime(RuntimeAnswer::ProviderExited {
                root_agent_session_id: root.clone(),
                error: "the daemon restarted; the provider process is gone".into(),
            });
            match engine.handle(now, &input) {
                Ok(step) => settle.push(step.persist),
                Err(e) => warn!(root = %root, error = %e, "recovery step rejected"),
            }
        }
        // Group-committed like any other steps (one transaction per `MAX_GROUP` trees), so a
        // restart after a crash with many live trees is not one commit per tree.
        for group in settle.chunks(MAX_GROUP) {
            let refs: Vec<&PersistBatch> = group.iter().collect();
            let Err(e) = store.apply_group(&refs, false) else {
                continue;
            };
            if !S::is_guard_failure(e.source_error()) && !S::is_fenced(e.source_error()) {
                return Err(StartError::Recovery(Box::new(e)));
            }
            // A tree changed between the load above and its claim (on PostgreSQL, another
            // daemon settled or drove it meanwhile, e.g. while this one was down; found by the
            // fault harness: the start failed): the other trees commit one by one, and a
            // refused tree is settled again from the store's copy, never failing the start.
            for batch in group {
                recover_one(&mut store, &mut engine, now, batch)?;
            }
        }
        info!(
            trees = recovered.len(),
            settled = claimed.len(),
            "recovered live trees"
        );
        // Settled: no provider runs for them here, so their leases are given up at once.
        housekeeping.release_all(&mut store, &claimed);
        // Loaded without their message ids: none may stay (see above).
        for root in &recovered {
            engine.evict(root);
        }
        let quiescent = QuiescentTrees::default();
        let last_seq = store.last_outbox_seq().map_err(StartError::store)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (seq_tx, seq_rx) = watch::channel(last_seq);
        let (live, _) = broadcast::channel(LIVE_CAPACITY);
        let weak_live = live.downgrade();
        let rt = tokio::runtime::Handle::current();
        let positions = Arc::new(LivePositions::default());
        let metrics = Arc::new(Metrics::new(&opts.db.display().to_string()));
        if opts.retention.prune_interval_ms > 0 {
            let tx = tx.clone();
            let every = std::time::Duration::from_millis(opts.retention.prune_interval_ms);
            rt.spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    if tx.send(Msg::Prune).is_err() {
                        return;
                    }
                }
            });
        }
        let lease_watch = crate::lease_watch::LeaseWatch::new();
        if let Some(period) = housekeeping.watch_period() {
            lease_watch.spawn(period)?;
        }
        if let Some(every) = housekeeping.renew_every() {
            let tx = tx.clone();
            rt.spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    if tx.send(Msg::RenewLeases).is_err() {
                        return;
                    }
                }
            });
        }
        let pipeline = match committer {
            Some(c) => {
                let wake = tx.clone();
                Some(Pipeline::start(
                    c,
                    metrics.clone(),
                    live.downgrade(),
                    move || {
                        let _ = wake.send(Msg::Written);
                    },
                )?)
            }
            None => None,
        };
        let core = Core {
            housekeeping,
            to_release: Vec::new(),
            live,
            driver: Driver::with_engine(engine),
            store,
            rx,
            tx: tx.clone(),
            seq: seq_tx,
            runtimes: BTreeMap::new(),
            generation: 0,
            current: HashMap::new(),
            replies: HashMap::new(),
            next_reply: 0,
            deadline: None,
            providers: opts.providers.clone(),
            idle: Idle {
                timeout: opts.idle_timeout,
                generation: 0,
                armed: BTreeMap::new(),
            },
            retention: opts.retention,
            quiescent,
            positions: positions.clone(),
            metrics: metrics.clone(),
            ever_launched: std::collections::HashSet::new(),
            line_round: None,
            max_providers: opts
                .max_providers
                .unwrap_or_else(default_max_providers)
                .max(1),
            reserved: std::collections::HashSet::new(),
            round_io: std::time::Duration::ZERO,
            pending_live: Vec::new(),
            pending_seq: None,
            lease_watch: lease_watch.clone(),
            lapsed: std::collections::BTreeSet::new(),
            decided_under: std::collections::VecDeque::new(),
            tagged_through: None,
            fenced: Vec::new(),
            unreadable: Vec::new(),
            queued: std::collections::VecDeque::new(),
            pipeline,
            touched: Vec::new(),
        };
        std::thread::Builder::new()
            .name("tutti-engine".into())
            .spawn(move || {
                let _guard = rt.enter();
                core.run();
            })?;
        Ok(Daemon {
            tx,
            reader: Arc::new(Mutex::new(reader)),
            outbox: seq_rx,
            live: weak_live,
            providers: opts.providers,
            db: opts.db,
            positions,
            commits: watch::channel(last_seq).1,
            metrics,
            cluster: None,
            store_health: None,
        })
    }

    /// Issue 21: "`GET /v1/events` on any daemon streams rows committed by any daemon". `commits`
    /// carries the highest outbox seq committed to the database by the other writers (for
    /// PostgreSQL, woken by `LISTEN/NOTIFY`, see [`crate::postgres`]; it may include this
    /// daemon's own seqs, which its polling fallback reads from the counter, but need not:
    /// issue 33, its own rows reach its followers on the live channel, and a follower sent to
    /// the store for them would only read them twice); each time it rises above a follower's
    /// position the follower reads the store again, so rows another daemon committed are
    /// streamed in sequence order, once each, interleaved with this daemon's own.
    pub fn with_commits_from(mut self, commits: watch::Receiver<u64>) -> Daemon {
        self.commits = commits;
        self
    }

    /// Issue 21: this daemon shares its database with other daemons; commands for trees they own
    /// are forwarded to them, authenticated by `cluster` (see [`crate::forward`]).
    pub fn with_cluster(mut self, cluster: crate::auth::Cluster) -> Daemon {
        self.cluster = Some(Arc::new(cluster));
        self
    }

    /// Issue 34: the store is a server whose reachability `health` tracks; `/healthz` and
    /// `/readyz` answer 503 while it is unreachable, and the metrics count its outages.
    pub fn with_store_health(mut self, health: Arc<tutti_postgres::Health>) -> Daemon {
        self.store_health = Some(health);
        self
    }

    /// The store's reachability, for a store on a server (see [`Daemon::with_store_health`]).
    pub fn store_health(&self) -> Option<&Arc<tutti_postgres::Health>> {
        self.store_health.as_ref()
    }

    /// The daemons sharing this daemon's database, if any (see [`Daemon::with_cluster`]).
    pub fn cluster(&self) -> Option<&Arc<crate::auth::Cluster>> {
        self.cluster.as_ref()
    }

    /// The highest outbox seq committed by any writer (see [`Daemon::with_commits_from`]).
    pub fn commits_watch(&self) -> watch::Receiver<u64> {
        self.commits.clone()
    }

    /// Feeds one input and waits for its step (committed) or rejection, within bounds (issue
    /// 34: "every client request has a bounded deadline"):
    /// - an input the engine thread has not taken within [`QUEUE_DEADLINE`] (it is stuck on a
    ///   store that does not answer) is given up: the engine drops it when it gets to it, so it
    ///   is never carried out, and the caller gets [`DaemonError::Unavailable`] (503, retry);
    /// - an input the engine took is waited for until [`COMMAND_DEADLINE`] in all; past that the
    ///   caller gets [`DaemonError::OutcomeUnknown`] (504): its commit may still land.
    pub async fn call(&self, input: Input) -> Result<Step, DaemonError> {
        let (tx, mut rx) = oneshot::channel();
        let ticket = Arc::new(Ticket::default());
        self.tx
            .send(Msg::Input(input, Some(tx), Some(ticket.clone())))
            .map_err(|_| DaemonError::Stopped)?;
        match tokio::time::timeout(QUEUE_DEADLINE, &mut rx).await {
            Ok(r) => return r.map_err(|_| DaemonError::Stopped)?,
            Err(_) if ticket.give_up() => {
                warn!("command not taken by the engine within its deadline; given up");
                return Err(DaemonError::Unavailable(format!(
                    "the daemon did not take the command within {} s; nothing was done",
                    QUEUE_DEADLINE.as_secs()
                )));
            }
            Err(_) => {}
        }
        match tokio::time::timeout(COMMAND_DEADLINE.saturating_sub(QUEUE_DEADLINE), rx).await {
            Ok(r) => r.map_err(|_| DaemonError::Stopped)?,
            Err(_) => {
                warn!("command taken but not committed within its deadline");
                Err(DaemonError::OutcomeUnknown)
            }
        }
    }

    /// Records the working directory of a root session's provider in the database (call before
    /// the session's `CreateSession`: inputs are handled in order, so the session's commit
    /// follows this write).
    pub fn set_cwd(&self, root: Id, cwd: String) {
        let _ = self.tx.send(Msg::SetCwd(root, cwd));
    }

    /// Runs a read against the reader (blocking; call from `spawn_blocking`). The reads inside
    /// see one committed state.
    pub fn read<T>(&self, f: impl FnOnce(&dyn Reads) -> T) -> Result<T, DaemonError> {
        let guard = self
            .reader
            .lock()
            .map_err(|_| DaemonError::Storage("reader poisoned".into()))?;
        let mut f = Some(f);
        let mut out = None;
        guard
            .read_consistent_dyn(&mut |r| {
                if let Some(f) = f.take() {
                    out = Some(f(r));
                }
            })
            .map_err(DaemonError::from)?;
        out.ok_or_else(|| DaemonError::Storage("the read did not run".into()))
    }

    /// The newest published outbox sequence number (changes when new rows are committed).
    pub fn outbox_watch(&self) -> watch::Receiver<u64> {
        self.outbox.clone()
    }

    /// A receiver of every commit's outbox rows from now on (closed once the daemon stops).
    /// [`crate::follow::Follower`] combines it with the file.
    pub fn live(&self) -> broadcast::Receiver<LiveBatch> {
        match self.live.upgrade() {
            Some(tx) => tx.subscribe(),
            None => broadcast::channel(1).1,
        }
    }

    /// Provider runtimes.
    pub fn providers(&self) -> &Arc<dyn ProviderFactory> {
        &self.providers
    }

    /// The database file.
    pub fn db(&self) -> &PathBuf {
        &self.db
    }

    /// The root session ids of the trees currently loaded in the engine, sorted (for operators
    /// and tests: settled trees leave memory, see [`crate::retention`]).
    pub async fn resident_trees(&self) -> Result<Vec<Id>, DaemonError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Msg::Resident(tx))
            .map_err(|_| DaemonError::Stopped)?;
        rx.await.map_err(|_| DaemonError::Stopped)
    }

    /// The positions of the live outbox followers (retention never prunes above the lowest).
    pub fn live_positions(&self) -> &Arc<LivePositions> {
        &self.positions
    }

    /// The daemon's metrics (see [`crate::metrics`]).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The Prometheus exposition text: the engine thread computes the state gauges now.
    pub async fn metrics_text(&self) -> Result<String, DaemonError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Msg::Gauges(tx))
            .map_err(|_| DaemonError::Stopped)?;
        let state = rx.await.map_err(|_| DaemonError::Stopped)?;
        let head = *self.outbox.borrow();
        self.metrics.store(self.store_health.as_deref());
        Ok(self.metrics.render(
            &state,
            self.positions.count() as u64,
            head,
            self.positions.lowest(),
        ))
    }

    /// Stops the engine thread (after the inputs already queued).
    pub async fn shutdown(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Shutdown(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

/// The checkpoint thread's log lines (identifiers and counts only).
fn log_checkpoint(e: CheckpointEvent) {
    match e {
        CheckpointEvent::Pass { mode, result } => debug!(
            ?mode,
            wal_frames = result.wal_frames,
            checkpointed = result.checkpointed_frames,
            busy = result.busy,
            "checkpoint"
        ),
        CheckpointEvent::Failed { mode, error } => {
            warn!(?mode, error = %error, "checkpoint failed")
        }
        CheckpointEvent::RestartWanted { wal_frames } => {
            debug!(wal_frames, "WAL restart wanted")
        }
    }
}

/// Where the reply of an input goes.
type ReplyTo = oneshot::Sender<Result<Step, DaemonError>>;

/// How long a command may wait for the engine thread to take it (see [`Daemon::call`]).
pub const QUEUE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);
/// How long a command may take in all, commit included (see [`Daemon::call`]).
pub const COMMAND_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// Who decides a queued command's fate first: the engine thread taking it, or its caller giving
/// up at [`QUEUE_DEADLINE`]. Exactly one of [`Ticket::take`] and [`Ticket::give_up`] succeeds.
#[derive(Debug, Default)]
pub struct Ticket(std::sync::atomic::AtomicU8);

impl Ticket {
    const TAKEN: u8 = 1;
    const GIVEN_UP: u8 = 2;

    fn settle(&self, to: u8) -> bool {
        use std::sync::atomic::Ordering;
        self.0
            .compare_exchange(0, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The engine takes the command; `false`: its caller gave up first (drop it).
    pub fn take(&self) -> bool {
        self.settle(Self::TAKEN)
    }

    /// The caller gives up; `false`: the engine took the command first (wait for it).
    pub fn give_up(&self) -> bool {
        self.settle(Self::GIVEN_UP)
    }
}

struct Core<S> {
    /// What the store needs besides commits.
    housekeeping: Box<dyn Housekeeping<S>>,
    /// Roots whose runtime stopped: their leases are released after the round's commits (so
    /// the exit's own batch is still fenced).
    to_release: Vec<Id>,
    live: broadcast::Sender<LiveBatch>,
    /// Rows of commits announced in this pass of [`Core::settle`], sent to the live followers
    /// as one batch when the pass ends (see [`Core::flush_live`]).
    pending_live: Vec<LiveRow>,
    /// The newest seq of those commits.
    pending_seq: Option<u64>,
    /// The engine, the adapters of the live roots and their timers.
    driver: Driver,
    store: S,
    rx: mpsc::UnboundedReceiver<Msg>,
    tx: mpsc::UnboundedSender<Msg>,
    seq: watch::Sender<u64>,
    /// The provider runtime (process I/O) of each root with a live provider.
    runtimes: BTreeMap<Id, RuntimeHandle>,
    /// Launches so far (each runtime's generation).
    generation: u64,
    /// The generation of each root's current runtime, until it is stopped on purpose or its
    /// exit is handled (kept when an ended runtime's handle is dropped to free its buffers, so
    /// that its exit still counts).
    current: HashMap<Id, u64>,
    /// Callers waiting for the reply to their input, by the driver's reply token.
    replies: HashMap<u64, (ReplyTo, &'static str)>,
    next_reply: u64,
    /// The deadline a tick is armed for.
    deadline: Option<i64>,
    providers: Arc<dyn ProviderFactory>,
    idle: Idle,
    retention: Retention,
    /// Loaded quiescent trees, least recently touched first (see [`crate::retention`]).
    quiescent: QuiescentTrees,
    positions: Arc<LivePositions>,
    metrics: Arc<Metrics>,
    /// Roots that had a provider process (a later launch is a restart).
    ever_launched: std::collections::HashSet<Id>,
    /// When the engine took the current round, if it holds provider messages.
    line_round: Option<std::time::Instant>,
    /// The cap on live provider runtimes (see [`DaemonOptions::max_providers`]).
    max_providers: usize,
    /// Time this round spent committing and publishing (the rest of the round is deciding; see
    /// [`crate::metrics::Stage`]).
    round_io: std::time::Duration,
    /// Roots whose submit was let through this round for a provider start still to come: they
    /// count against the cap until launched (cleared after the round).
    reserved: std::collections::HashSet<Id>,
    /// The runtimes whose lease bounds how long they may run (see [`crate::lease_watch`]).
    lease_watch: Arc<crate::lease_watch::LeaseWatch>,
    /// Trees whose provider was stopped because their lease was not renewed in time, still to
    /// be settled: each is claimed again (and settled as after a failover) as soon as the store
    /// answers, or left to the daemon that took it over.
    lapsed: std::collections::BTreeSet<Id>,
    /// Issue 34, per-batch fencing: each batch the driver decided and the engine thread has not
    /// taken yet, with the lease epoch its tree was held at when it was decided (see
    /// [`Core::tag_decided`]), oldest first.
    decided_under: std::collections::VecDeque<(BatchId, Option<u64>)>,
    /// The newest batch in [`Core::decided_under`] so far.
    tagged_through: Option<BatchId>,
    /// Roots with a batch the fence refused in this pass of [`Core::settle`] (see
    /// [`Core::after_fenced`]).
    fenced: Vec<Id>,
    /// Roots with a batch not committed in this pass because the store was unreachable (see
    /// [`Core::after_unreadable`]).
    unreadable: Vec<Id>,
    /// Batches handed out by the driver and not yet committed (or handed to the commit
    /// thread), with the lease epoch each was decided under, oldest first.
    queued: std::collections::VecDeque<(BatchId, Option<u64>)>,
    /// Issue 33: the commit thread, when the store was opened for it (see [`Pipeline`]);
    /// `None`: commits run inline on the engine thread.
    pipeline: Option<Pipeline>,
    /// Roots whose trees a batch acknowledged this round touched, or that were loaded.
    touched: Vec<Id>,
}

/// Idle stop of provider runtimes (issue 17: "a runtime whose tree is quiescent (no active turn,
/// no prepared cancel, no pending interaction) is stopped after an idle timeout and at once on
/// DELETE").
///
/// After every committed step that touched a root with a live runtime, the root's generation is
/// bumped; if the tree is quiescent then, a timer is armed for that generation. The timer stops the
/// runtime only if nothing touched the root since (same generation) and the tree is still
/// quiescent. A deleted root is stopped at once, when quiescent. The next `Start` of the root
/// launches the provider again with the recorded provider session id (see
/// [`ProviderFactory::launch`]), which the adapters resume.
struct Idle {
    timeout: Option<std::time::Duration>,
    generation: u64,
    /// The generation armed per root.
    armed: BTreeMap<Id, u64>,
}

/// Commits one recovery step of [`Daemon::start_on`]; when a guard or the fence refuses it (the
/// tree changed since it was loaded), reloads the tree from the store and settles it again once
/// (if it is still live); a second refusal leaves the tree to whoever changed it (logged).
fn recover_one<S: HostStore>(
    store: &mut S,
    engine: &mut Engine,
    now: i64,
    batch: &PersistBatch,
) -> Result<(), StartError> {
    let refused = |e: &GroupError<S::Error>| {
        S::is_guard_failure(e.source_error()) || S::is_fenced(e.source_error())
    };
    match store.apply_group(&[batch], false) {
        Ok(_) => return Ok(()),
        Err(e) if !refused(&e) => return Err(StartError::Recovery(Box::new(e))),
        Err(_) => {}
    }
    let Some(root) = batch.root_agent_session_id.clone() else {
        return Ok(());
    };
    warn!(root = %root, "recovery step refused: the tree changed since it was loaded; settling it again from the store");
    engine.evict(&root);
    let tree = store.load_tree(&root).map_err(StartError::store)?;
    let Some(tree) = tree else {
        return Ok(());
    };
    if let Err(e) = engine.restore(tree) {
        warn!(root = %root, error = %e, "a stored tree could not be restored");
        return Ok(());
    }
    let input = Input::Runtime(RuntimeAnswer::ProviderExited {
        root_agent_session_id: root.clone(),
        error: "the daemon restarted; the provider process is gone".into(),
    });
    let step = match engine.handle(now, &input) {
        Ok(step) => step,
        Err(e) => {
            debug!(root = %root, error = %e, "nothing to settle in the reloaded tree");
            return Ok(());
        }
    };
    match store.apply_group(&[&step.persist], false) {
        Ok(_) => Ok(()),
        Err(e) if refused(&e) => {
            warn!(root = %root, error = %e, "recovery step refused again; the tree is left to its new owner");
            Ok(())
        }
        Err(e) => Err(StartError::Recovery(Box::new(e))),
    }
}

impl<S: HostStore + Send + 'static> Core<S> {
    fn run(mut self) {
        while let Some(first) = self.rx.blocking_recv() {
            let mut batch = vec![first];
            while batch.len() < MAX_GROUP {
                match self.rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            let now = now_ms();
            let round = std::time::Instant::now();
            self.line_round = None;
            let mut shutdown = None;
            let mut prune = false;
            let mut resident = Vec::new();
            for m in batch {
                match m {
                    Msg::SetCwd(root, cwd) => {
                        if let Err(e) = self.store.set_session_cwd(&root, &cwd) {
                            warn!(root = %root, error = %e, "session cwd not recorded");
                        }
                    }
                    Msg::IdleCheck(root, generation) => self.idle_check(&root, generation),
                    Msg::Prune => prune = true,
                    Msg::RenewLeases => {
                        for root in self.housekeeping.renew(&mut self.store, now) {
                            warn!(root = %root, "tree lease lost to another daemon");
                            self.stop_runtime(&root, "lease lost");
                        }
                        self.lapse(now);
                        for root in self.housekeeping.orphaned(&mut self.store, now) {
                            self.take_over(now, root);
                        }
                    }
                    Msg::Resident(r) => resident.push(r),
                    Msg::Gauges(r) => {
                        let _ = r.send(self.gauges());
                    }
                    Msg::Shutdown(done) => shutdown = Some(done),
                    Msg::Written => self.take_written(false),
                    Msg::Tick => {
                        self.deadline = None;
                        self.drive(DriverInput::Timeout(now));
                    }
                    Msg::Input(input, reply, ticket) => {
                        if ticket.is_some_and(|t| !t.take()) {
                            debug!(
                                kind = input.kind(),
                                "command given up by its caller; dropped"
                            );
                            continue;
                        }
                        if let Err(e) = self.acquire(now, &input) {
                            debug!(kind = input.kind(), "command not taken here");
                            if let Some(r) = reply {
                                let _ = r.send(Err(e));
                            }
                            continue;
                        }
                        if let Some(root) = self.start_needed(&input) {
                            if let Err(e) = self.make_room(&root) {
                                warn!(
                                    root = %root,
                                    limit = self.max_providers,
                                    "submit refused: provider limit reached, none idle"
                                );
                                if let Some(r) = reply {
                                    let _ = r.send(Err(e));
                                }
                                continue;
                            }
                            self.reserved.insert(root);
                        }
                        let token = reply.map(|r| {
                            self.next_reply += 1;
                            self.replies.insert(self.next_reply, (r, input.kind()));
                            self.next_reply
                        });
                        debug!(kind = input.kind(), "input");
                        self.drive(DriverInput::Host {
                            now,
                            input,
                            reply: token,
                        });
                    }
                    Msg::Runtime(root, generation, m) => {
                        if matches!(m, FromRuntime::Native(_)) {
                            self.line_round = Some(round);
                        }
                        self.runtime_said(now, root, generation, m)
                    }
                }
            }
            self.settle(now);
            let touched = std::mem::take(&mut self.touched);
            let io = std::mem::take(&mut self.round_io);
            self.metrics
                .stage(Stage::Decide, round.elapsed().saturating_sub(io));
            self.reserved.clear();
            for root in &touched {
                self.review_runtime(root);
            }
            self.residency(touched);
            let mut release = Vec::new();
            for root in std::mem::take(&mut self.to_release) {
                if self.current.contains_key(&root) {
                    continue;
                }
                // Without leases (SQLite) there is nothing to keep. A tree that is not in memory
                // and cannot be read now is not known to be quiescent: its lease is kept.
                let quiescent = self.housekeeping.epoch(&root).is_none()
                    || match self.ensure_loaded(&root) {
                        Some(true) => self.driver.engine().is_quiescent(&root),
                        Some(false) => true,
                        None => false,
                    };
                if quiescent {
                    release.push(root);
                    continue;
                }
                // Still live without a provider here: the step that was to settle it (a
                // takeover's, a lapsed lease's) did not commit. Released, its lease would leave
                // a live tree nobody settles (failover claims only expired, unreleased leases;
                // found by the fault harness). It stays unreleased and is settled again at
                // the next renewal tick ([`Core::lapse`]), or by whoever takes it over.
                warn!(root = %root, "tree still live without a provider; its lease is kept and it is settled again");
                self.housekeeping.forget(&root);
                self.lapsed.insert(root);
            }
            if !release.is_empty() {
                self.housekeeping.release_all(&mut self.store, &release);
            }
            if prune {
                self.prune();
            }
            for r in resident {
                let _ = r.send(self.driver.engine().roots());
            }
            if self.housekeeping.reconnected(&mut self.store) {
                self.recovered(now_ms());
            }
            self.housekeeping.after_round(&mut self.store);
            if let Some(done) = shutdown {
                self.drain_commits(now);
                self.stop_all_runtimes();
                let _ = done.send(());
                return;
            }
            self.arm_deadline(now);
        }
    }

    /// Issue 21: before a command on a tree (create, submit, cancel, answer, delete) reaches
    /// the engine, this daemon makes sure it owns the tree (see [`Housekeeping::acquire`]):
    /// - another daemon holds the tree's unexpired lease: [`DaemonError::OwnedElsewhere`]
    ///   (nothing changes; the API forwards the request to the owner);
    /// - the lease was free, released or expired: it is claimed now, the tree is reloaded from
    ///   the store (never a stale copy), a tree whose owner stopped renewing is settled first
    ///   as failover does, and the lease is released after the round unless a provider runs;
    ///   the command's batch, a new tree's first batch included, is fenced by the claim.
    fn acquire(&mut self, now: i64, input: &Input) -> Result<(), DaemonError> {
        let (session, create) = match input {
            Input::Command(Command::CreateSession {
                agent_session_id, ..
            }) => (agent_session_id, true),
            Input::Command(
                Command::Submit {
                    agent_session_id, ..
                }
                | Command::CancelTurn {
                    agent_session_id, ..
                }
                | Command::RespondInteraction {
                    agent_session_id, ..
                }
                | Command::DeleteSession {
                    agent_session_id, ..
                },
            ) => (agent_session_id, false),
            // Exhaustive on purpose (issue 30: a new command must decide here whether it needs
            // the tree's lease; a catch-all arm skipped it silently). Provider events and
            // runtime answers come from this daemon's own runtimes, for trees it holds.
            Input::Event(_) | Input::Runtime(_) => return Ok(()),
        };
        let root = if create {
            session.clone()
        } else {
            match self.store.root_of(session) {
                Ok(Some(root)) => root,
                // Unknown session: the engine answers it (not found).
                Ok(None) => return Ok(()),
                Err(e) if S::is_unavailable(&e) => {
                    debug!(error = %e, "root of a command's session not readable: store unavailable");
                    return Err(DaemonError::Unavailable(e.to_string()));
                }
                Err(e) => {
                    warn!(error = %e, "root of a command's session not readable");
                    return Err(DaemonError::Storage(
                        "the session's tree could not be read".into(),
                    ));
                }
            }
        };
        match self.housekeeping.acquire(&mut self.store, &root, now) {
            Acquired::Held => Ok(()),
            Acquired::Claimed { orphaned } => {
                debug!(root = %root, orphaned, "tree lease claimed for a command");
                // A provider still registered here ran under a lease this daemon no longer
                // held (its good-until instant passed; the watchdog stops it, or did, but the
                // engine has not handled that yet). It is stopped now, before the tree is
                // reloaded: handled later in the round, the watchdog's stop would drop the
                // claim just made and reload the tree again over the command's batch (found
                // by the fault harness: a turn left active with no provider and no lease).
                if self.runtimes.contains_key(&root) || self.current.contains_key(&root) {
                    self.stop_runtime(&root, "lease lapsed");
                }
                self.lapsed.remove(&root);
                self.lease_watch
                    .set_good_until(&root, self.housekeeping.good_until(&root));
                if !create {
                    self.driver.reload(&root, &self.store);
                    if orphaned {
                        self.settle_orphan(now, &root);
                    }
                }
                self.to_release.push(root);
                Ok(())
            }
            Acquired::Elsewhere {
                owner_address,
                expires_at_ms,
            } => Err(DaemonError::OwnedElsewhere {
                owner_address,
                expires_at_ms,
            }),
            Acquired::Unavailable(e) => {
                debug!(root = %root, error = %e, "tree lease not claimable: store unavailable");
                Err(DaemonError::Unavailable(e))
            }
            Acquired::Unknown(e) => {
                warn!(root = %root, error = %e, "tree lease not claimable");
                Err(DaemonError::Storage(
                    "the tree's lease could not be claimed".into(),
                ))
            }
        }
    }

    /// Issue 34: the store's writer reconnected. Its leases are renewed now (the trees another
    /// daemon took meanwhile stop here; a lease that expired unclaimed is this daemon's again at
    /// its epoch), and the quiescent trees it keeps leave memory (loaded from the store on their
    /// next use). Choice: trees with an active turn or inputs waiting stay loaded: every
    /// commit's outcome was read back, and a batch that did not commit reloaded its tree, so
    /// their copy is the store's.
    fn recovered(&mut self, now: i64) {
        let lost = self.housekeeping.renew(&mut self.store, now);
        info!(lost = lost.len(), "store reconnected; tree leases checked");
        for root in lost {
            warn!(root = %root, "tree lease lost while the store was unreachable");
            self.stop_runtime(&root, "lease lost");
        }
        for root in self.driver.engine().roots() {
            if self.driver.evict(&root) {
                self.quiescent.forget(&root);
                debug!(root = %root, "quiescent tree dropped after a reconnect");
            }
        }
        self.lapse(now);
    }

    /// Issue 34, the lease rule on the daemon's own clock (see [`crate::lease_watch`]): a
    /// provider whose lease was not renewed in time was stopped by the watchdog (or is stopped
    /// here, if the watchdog has not looked yet). Its tree leaves this daemon's books without
    /// its lease being released, and is settled as after a failover (interrupted: its provider
    /// is gone) by whoever claims it next: this daemon, as soon as the store answers (here, on
    /// each renewal round), or the daemon that took it over meanwhile.
    fn lapse(&mut self, now: i64) {
        // The watchdog learns how long each runtime's lease is good for now (renewed or not).
        for root in self.runtimes.keys() {
            self.lease_watch
                .set_good_until(root, self.housekeeping.good_until(root));
        }
        self.lease_watch.check(now);
        for (root, generation) in self.lease_watch.take_stopped() {
            if self.current.get(&root) != Some(&generation) {
                continue;
            }
            self.metrics.process_exited(&self.provider_of(&root));
            self.current.remove(&root);
            self.runtimes.remove(&root);
            self.idle.armed.remove(&root);
            self.driver.detach(&root);
            self.housekeeping.forget(&root);
            self.lapsed.insert(root);
        }
        let lapsed: Vec<Id> = self.lapsed.iter().cloned().collect();
        for root in lapsed {
            match self.housekeeping.acquire(&mut self.store, &root, now) {
                Acquired::Claimed { .. } => {
                    self.lapsed.remove(&root);
                    info!(root = %root, "settling a tree whose provider stopped with its lease");
                    self.driver.reload(&root, &self.store);
                    self.settle_orphan(now, &root);
                    self.to_release.push(root);
                }
                // A command claimed it again meanwhile (and settled it then).
                Acquired::Held => {
                    self.lapsed.remove(&root);
                }
                Acquired::Elsewhere { .. } => {
                    self.lapsed.remove(&root);
                    info!(root = %root, "a tree whose provider stopped with its lease is owned elsewhere now");
                    self.driver.reload(&root, &self.store);
                }
                Acquired::Unavailable(_) | Acquired::Unknown(_) => {}
            }
        }
    }

    /// Issue 21, failover: a tree whose owner died (its lease expired; this daemon claimed it)
    /// settles exactly as at a restart: reloaded from the store (another daemon drove it), then
    /// the provider's exit, in a fenced batch; the lease is released after the round.
    fn take_over(&mut self, now: i64, root: Id) {
        if self.runtimes.contains_key(&root) {
            return;
        }
        self.driver.reload(&root, &self.store);
        self.settle_orphan(now, &root);
        self.to_release.push(root);
    }

    /// The provider's exit of a tree (just reloaded) whose owner stopped renewing its lease:
    /// every active turn settles interrupted, as at a restart.
    fn settle_orphan(&mut self, now: i64, root: &Id) {
        info!(root = %root, "taking over a tree whose owner stopped renewing its lease");
        let input = Input::Runtime(RuntimeAnswer::ProviderExited {
            root_agent_session_id: root.clone(),
            error: "the daemon that ran the provider is gone".into(),
        });
        self.drive(DriverInput::Host {
            now,
            input,
            reply: None,
        });
    }

    /// The provider name of a root session (`unknown` when its tree is not loaded).
    fn provider_of(&self, root: &Id) -> String {
        self.driver
            .engine()
            .session(root)
            .map_or_else(|| "unknown".to_string(), |s| s.provider.to_string())
    }

    /// The state gauges of a metrics scrape, from the engine's loaded trees and the runtimes.
    /// Trees that are not loaded are quiescent (only quiescent trees are evicted), so they add
    /// nothing but to none of the gauges.
    fn gauges(&self) -> StateGauges {
        let engine = self.driver.engine();
        let mut g = StateGauges::default();
        for root in engine.roots() {
            g.resident_trees += 1;
            let pending = engine.pending_interactions(&root).len() as u64;
            g.pending_interactions += pending;
            if !engine.is_quiescent(&root) || pending > 0 {
                g.live_trees += 1;
            }
            let Some(turn) = engine
                .session(&root)
                .and_then(|s| s.active_turn_id.as_ref())
                .and_then(|t| engine.turn(&root, t))
            else {
                continue;
            };
            if !turn.phase().is_active() {
                continue;
            }
            *g.root_turns_by_phase
                .entry(phase_name(turn.phase()))
                .or_default() += 1;
            let children = engine.active_child_turns(&root, &turn.id) as u64;
            g.active_child_turns += children;
            if turn.phase() == tutti_core::model::Phase::Waiting && children > 0 {
                g.roots_waiting_on_children += 1;
            }
        }
        for (root, r) in &self.runtimes {
            if r.is_alive() {
                *g.processes.entry(self.provider_of(root)).or_default() += 1;
            }
        }
        g
    }

    /// A message of a root's runtime; one of an earlier (stopped) runtime of the root is stale.
    fn runtime_said(&mut self, now: i64, root: Id, generation: u64, m: FromRuntime) {
        if self.current.get(&root) != Some(&generation) {
            debug!(root = %root, generation, "message of a stopped runtime dropped");
            return;
        }
        match m {
            FromRuntime::Native(v) => {
                if let Err(e) = self.driver.handle(
                    DriverInput::Native {
                        now,
                        root: &root,
                        message: &v,
                    },
                    &self.store,
                ) {
                    warn!(root = %root, error = %e, "dropped a native message");
                }
                self.tag_decided();
            }
            FromRuntime::WriteFailed(failure, error) => self.drive(DriverInput::WriteFailed {
                now,
                failure,
                error: &error,
            }),
            FromRuntime::Exited(why) => {
                self.metrics.process_exited(&self.provider_of(&root));
                self.current.remove(&root);
                self.runtimes.remove(&root);
                self.lease_watch.untrack(&root);
                self.idle.armed.remove(&root);
                self.drive(DriverInput::Exit {
                    now,
                    root: &root,
                    error: &why,
                });
                self.to_release.push(root);
            }
        }
    }

    /// Hands one input to the driver. Only inputs about a provider's messages can fail (they
    /// are handed over where they are read, to log the root); any other error would be a
    /// driver bug, logged.
    fn drive(&mut self, input: DriverInput<'_>) {
        if let Err(e) = self.driver.handle(input, &self.store) {
            warn!(error = %e, "the driver refused an input");
        }
        self.tag_decided();
    }

    /// Issue 34, per-batch fencing: tags the batches the last input made the driver decide with
    /// the lease epoch their tree is held at now, before anything later in the round (a
    /// renewal, a lapse, a command's re-claim of the tree at a new epoch) can change it. The
    /// commit then refuses a batch decided under a lease that was lost since, even when this
    /// daemon holds the tree again ([`Housekeeping::commit_group`]). Choice: the tag is the
    /// epoch the store handle fences the tree at ([`Housekeeping::decided_epoch`]), so a batch
    /// decided after the lease lapsed here (a provider's exit after its lease was lost) is
    /// fenced by the lapsed epoch too, and refused once a re-claim moved the tree on.
    fn tag_decided(&mut self) {
        for id in self.driver.decided_after(self.tagged_through) {
            let epoch = self
                .driver
                .batch(id)
                .and_then(|b| b.root_agent_session_id.as_ref())
                .and_then(|root| self.housekeeping.decided_epoch(&self.store, root));
            self.decided_under.push_back((id, epoch));
            self.tagged_through = Some(id);
        }
    }

    /// The epoch batch `id` was decided under ([`Core::tag_decided`]); tags of batches handed
    /// out before it (or superseded and never handed out) are dropped.
    fn decided_epoch(&mut self, id: BatchId) -> Option<Option<u64>> {
        while let Some(&(front, epoch)) = self.decided_under.front() {
            if front > id {
                return None;
            }
            self.decided_under.pop_front();
            if front == id {
                return Some(epoch);
            }
        }
        None
    }

    /// Commits what the driver decided and carries out what it released, until it is quiet
    /// (with the [`Pipeline`]: until the group handed to the commit thread is the only thing
    /// left; its outcome comes back as [`Msg::Written`]). The roots whose trees a committed
    /// batch touched, or that were loaded, gather in [`Core::touched`].
    fn settle(&mut self, now: i64) {
        loop {
            // The driver hands out the batches to commit first, then what committed batches
            // released. Each batch is taken with the lease epoch it was decided under (issue
            // 34), tagged when it was decided ([`Core::tag_decided`]).
            let mut any = false;
            while let Some(out) = self.driver.poll_output() {
                let Output::Persist(id) = out else {
                    any = true;
                    self.carry_out(now, out);
                    continue;
                };
                let epoch = match self.decided_epoch(id) {
                    Some(epoch) => epoch,
                    // Not tagged (no input path should leave one so): the epoch held now.
                    None => self
                        .driver
                        .batch(id)
                        .and_then(|b| b.root_agent_session_id.as_ref())
                        .and_then(|root| self.housekeeping.epoch(root)),
                };
                self.queued.push_back((id, epoch));
            }
            // What the commits of the last pass released is out: their rows go to the live
            // followers before the next commit.
            self.flush_live();
            let committed = self.commit_queued();
            for root in std::mem::take(&mut self.fenced) {
                self.after_fenced(now, &root);
            }
            for root in std::mem::take(&mut self.unreadable) {
                self.after_unreadable(&root);
            }
            if !committed && !any {
                break;
            }
        }
        for root in self.driver.take_loaded() {
            if !self.touched.contains(&root) {
                self.touched.push(root);
            }
        }
    }

    /// Commits the queued batches: inline, in groups of [`MAX_GROUP`] (`true` if there were
    /// any); with the [`Pipeline`], hands them to the commit thread as one group unless one is
    /// in flight (`false`: nothing was acknowledged yet).
    fn commit_queued(&mut self) -> bool {
        // Batches the driver dropped since they were handed out (an earlier batch of their tree
        // failed) are not committed.
        self.queued
            .retain(|(id, _)| self.driver.batch(*id).is_some());
        if self.queued.is_empty() {
            return false;
        }
        let Some(pipeline) = &mut self.pipeline else {
            while !self.queued.is_empty() {
                let n = self.queued.len().min(MAX_GROUP);
                let group: Vec<_> = self.queued.drain(..n).collect();
                self.commit(group);
            }
            return true;
        };
        if pipeline.in_flight() {
            return false;
        }
        let n = self.queued.len().min(MAX_GROUP);
        let (group, batches): (Vec<_>, Vec<PersistBatch>) = self
            .queued
            .drain(..n)
            .filter_map(|(id, epoch)| Some(((id, epoch), self.driver.batch(id)?.clone())))
            .unzip();
        pipeline.send(group, batches, self.line_round);
        false
    }

    /// With the [`Pipeline`]: acknowledges the group the commit thread wrote, if it is done
    /// (`wait`: waits for it).
    fn take_written(&mut self, wait: bool) {
        if let Some(outcome) = self.pipeline.as_mut().and_then(|p| p.outcome(wait)) {
            self.acknowledge(outcome);
        }
    }

    /// Daemon shutdown with the [`Pipeline`]: every batch decided so far is written and
    /// acknowledged (their callers get their replies) before the engine thread ends.
    fn drain_commits(&mut self, now: i64) {
        while self.pipeline.as_ref().is_some_and(|p| p.in_flight()) {
            self.take_written(true);
            self.settle(now);
        }
    }

    /// Issue 34: the fence refused a batch of `root` (decided under a lease that was lost since,
    /// or this daemon lost the tree). If this daemon still runs the tree's provider, what that
    /// provider said under the lost lease is gone with the refused batch (the tree was reloaded
    /// from the store), so its later messages cannot be trusted to settle the turn (a refused
    /// "turn ended" would leave the tree active for good). The provider is stopped and the tree
    /// settled as after a failover (interrupted), by a batch decided now: it commits if this
    /// daemon holds the tree again, and is refused as well (nothing changes) if another daemon
    /// does, which settles it when it takes the tree over.
    fn after_fenced(&mut self, now: i64, root: &Id) {
        if !self.runtimes.contains_key(root) {
            return;
        }
        warn!(root = %root, "a batch decided under a lost lease was refused; stopping the tree's provider and settling the tree");
        self.stop_runtime(root, "fenced");
        if self.housekeeping.epoch(root).is_some() {
            self.settle_orphan(now, root);
        }
    }

    /// Issue 34: a batch of `root` was not committed because the store was unreachable, and the
    /// driver could not reload the tree (it is out of memory). Its provider's next messages
    /// would find no tree and be dropped (a turn's end among them: the turn would stay active
    /// for good, found by the fault harness). With leases, the provider is stopped and the tree
    /// handled as a lapsed one: claimed again as soon as the store answers and settled as after
    /// a failover (interrupted). Choice: without leases (SQLite, where the store being
    /// unreachable is a transient busy or I/O error) the provider goes on and the driver loads
    /// the tree on its next message.
    fn after_unreadable(&mut self, root: &Id) {
        if self.driver.engine().session(root).is_some()
            || !self.runtimes.contains_key(root)
            || self.housekeeping.epoch(root).is_none()
        {
            return;
        }
        warn!(root = %root, "a tree could not be reloaded while the store was unreachable; stopping its provider, to settle the tree when the store is back");
        self.stop_runtime(root, "store unreachable");
        self.housekeeping.forget(root);
        self.lapsed.insert(root.clone());
    }

    /// One inline group commit; on failure the batches one by one (see
    /// [`crate::pipeline::commit_group`]).
    fn commit(&mut self, mut decided: Vec<(BatchId, Option<u64>)>) {
        // A batch the driver dropped since it was queued (an earlier group failed a batch of
        // its tree) is not committed; the outcomes line up with the batches that are.
        decided.retain(|(id, _)| self.driver.batch(*id).is_some());
        let (batches, epochs): (Vec<_>, Vec<_>) = decided
            .iter()
            .filter_map(|(id, epoch)| self.driver.batch(*id).map(|b| (b, *epoch)))
            .unzip();
        let t = std::time::Instant::now();
        let (housekeeping, store) = (&mut self.housekeeping, &mut self.store);
        let (results, group_error) =
            crate::pipeline::commit_group::<S>(&batches, &epochs, &mut |b, e| {
                housekeeping.commit_group(store, b, e, true)
            });
        let took = t.elapsed();
        self.round_io += took;
        self.metrics.stage(Stage::Commit, took);
        self.acknowledge(GroupOutcome {
            ids: decided,
            results,
            group_error,
            took,
            line_round: self.line_round,
        });
    }

    /// Tells the driver what became of each batch of a group, in order (see
    /// [`crate::pipeline::GroupOutcome`]).
    fn acknowledge(&mut self, outcome: GroupOutcome) {
        let GroupOutcome {
            ids,
            results,
            group_error,
            took,
            line_round,
        } = outcome;
        for (id, _) in &ids {
            if let Some(root) = self
                .driver
                .batch(*id)
                .and_then(|b| b.root_agent_session_id.as_ref())
            {
                if !self.touched.contains(root) {
                    self.touched.push(root.clone());
                }
            }
        }
        if let Some(e) = &group_error {
            if e.unavailable {
                debug!(error = %e.message, steps = ids.len(), "group commit failed: store unavailable; retried one by one");
            } else {
                warn!(error = %e.message, steps = ids.len(), "group commit failed; retried one by one");
            }
        } else {
            let batches: Vec<&PersistBatch> = ids
                .iter()
                .filter_map(|(id, _)| self.driver.batch(*id))
                .collect();
            self.metrics.committed(&batches, took, line_round);
            self.housekeeping.committed();
        }
        for ((id, epoch), result) in ids.into_iter().zip(results) {
            let batch_root = self
                .driver
                .batch(id)
                .and_then(|b| b.root_agent_session_id.clone());
            match result {
                BatchOutcome::Committed(published) => {
                    if group_error.is_some() {
                        if let Some(batch) = self.driver.batch(id) {
                            self.metrics.committed(&[batch], took, line_round);
                        }
                        self.housekeeping.committed();
                    }
                    self.drive(DriverInput::Committed {
                        batch: id,
                        published,
                    });
                }
                // The driver dropped it with the earlier failed batch of its tree; if it did
                // not (nothing should leave one so), it is committed with the next group.
                BatchOutcome::Skipped => {
                    if self.driver.batch(id).is_some() {
                        self.queued.push_front((id, epoch));
                    }
                }
                BatchOutcome::Failed(e) => {
                    let refused = e.guard || e.fenced;
                    if let Some(root) = batch_root
                        .clone()
                        .filter(|r| e.fenced && !self.fenced.contains(r))
                    {
                        self.fenced.push(root);
                    }
                    self.metrics.commit_failed(e.guard);
                    if e.unavailable {
                        debug!(error = %e.message, "step not committed: store unavailable");
                    } else {
                        error!(error = %e.message, "step not committed; reloading its tree");
                    }
                    // Issue 21: a batch refused by a guard or the fence: the tree's copy is
                    // dropped and reloaded (the driver does), the caller gets
                    // `DaemonError::Conflict`.
                    let why = if refused {
                        CommitFailure::Refused
                    } else if e.unavailable {
                        // Issue 34: the caller gets 503 unavailable, not a conflict.
                        if let Some(root) = batch_root.filter(|r| !self.unreadable.contains(r)) {
                            self.unreadable.push(root);
                        }
                        CommitFailure::Unavailable(e.message)
                    } else {
                        CommitFailure::Failed(e.message)
                    };
                    self.drive(DriverInput::NotCommitted { batch: id, why });
                }
            }
        }
    }

    fn carry_out(&mut self, now: i64, out: Output) {
        match out {
            // `settle` takes the batches to commit before it carries anything out.
            Output::Persist(_) => {}
            Output::Launch(spec) => self.launch(now, spec),
            Output::Transmit(t) => match self.runtimes.get(&t.root) {
                Some(r) if r.write(t.messages, t.on_failure.clone()) => {}
                _ => {
                    warn!(root = %t.root, "provider runtime is gone");
                    if let Some(f) = t.on_failure {
                        self.drive(DriverInput::WriteFailed {
                            now,
                            failure: f,
                            error: "provider runtime is gone",
                        });
                    }
                }
            },
            Output::Publish(p) => self.publish(p),
            Output::Reply { to, result } => {
                // The rows of the commits before a reply are announced before it.
                self.flush_live();
                if let Some((r, kind)) = self.replies.remove(&to) {
                    self.metrics.input_decided(kind, &result);
                    if let Err(e) = &result {
                        debug!(error = %e, "input not applied");
                    }
                    let _ = r.send(result.map_err(DaemonError::from));
                }
            }
            Output::Diagnostic(Diagnostic::Internal { input_kind, error }) => {
                error!(kind = input_kind, error = %error, "engine inconsistency");
            }
            Output::Diagnostic(Diagnostic::Adapter { root, lines }) => {
                for line in &lines {
                    debug!(root = %root, diagnostic = %line, "adapter diagnostic");
                }
            }
        }
    }

    /// Announces a commit: the newest sequence number, and its rows to live followers.
    fn publish(&mut self, p: Publication) {
        let t = std::time::Instant::now();
        self.publish_rows(p);
        let took = t.elapsed();
        self.round_io += took;
        self.metrics.stage(Stage::Publish, took);
    }

    /// Takes a commit's rows into the pass's live batch: the commits released in one pass of
    /// [`Core::settle`] reach each live follower as one batch (one wake-up per follower per pass
    /// instead of one per commit). A batch stays gap-free: rows that do not follow the pending
    /// ones, or a commit whose rows are not sent live, first send what is pending. With the
    /// [`Pipeline`] the commit thread announced the rows already (see
    /// [`crate::pipeline::announce`]); only the committed seq moves here.
    fn publish_rows(&mut self, p: Publication) {
        let Some(max) = p.rows.iter().map(|r| r.seq).max() else {
            return;
        };
        if self.pipeline.is_some() {
            self.pending_seq = Some(self.pending_seq.map_or(max, |s| s.max(max)));
            return;
        }
        let live = match (p.root_agent_session_id, p.workspace_id) {
            (Some(root), Some(ws)) if self.live.receiver_count() > 0 => Some((root, ws)),
            _ => None,
        };
        let follows = match (self.pending_live.last(), p.rows.first()) {
            (Some(last), Some(first)) => first.seq == last.seq + 1,
            _ => true,
        };
        if live.is_none() || !follows {
            self.flush_live();
        }
        if let Some((root, ws)) = live {
            self.pending_live.extend(
                p.rows
                    .into_iter()
                    .map(|r| LiveRow::new(r.seq, r.kind, root.clone(), ws.clone(), r.payload)),
            );
        }
        self.pending_seq = Some(self.pending_seq.map_or(max, |s| s.max(max)));
    }

    /// Sends the pending live rows as one batch, then the newest seq.
    fn flush_live(&mut self) {
        if !self.pending_live.is_empty() {
            let t = std::time::Instant::now();
            let rows = std::mem::take(&mut self.pending_live);
            let _ = self.live.send(Arc::new(LiveRows::new(rows)));
            let took = t.elapsed();
            self.round_io += took;
            self.metrics.stage(Stage::Publish, took);
        }
        if let Some(max) = self.pending_seq.take() {
            self.seq.send_replace(max);
        }
    }

    /// Arms one tick for the driver's next deadline (unless one is armed at or before it).
    fn arm_deadline(&mut self, now: i64) {
        let Some(at) = self.driver.poll_timeout() else {
            return;
        };
        if self.deadline.is_some_and(|d| d <= at) {
            return;
        }
        self.deadline = Some(at);
        let tx = self.tx.clone();
        let wait = (at - now).max(0) as u64;
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
            let _ = tx.send(Msg::Tick);
        });
    }

    /// After a commit: the touched trees that are quiescent become the most recent eviction
    /// candidates, the others stop being candidates, and the least recently touched candidates
    /// beyond [`Retention::resident_trees`] leave the engine (reloaded on demand by the driver).
    fn residency(&mut self, touched: Vec<Id>) {
        let engine = self.driver.engine();
        for root in touched {
            if engine.root_of(&root).is_none() {
                self.quiescent.forget(&root);
            } else if engine.is_quiescent(&root) {
                self.quiescent.touch(&root);
            } else {
                self.quiescent.forget(&root);
            }
        }
        while let Some(root) = self.quiescent.over(self.retention.resident_trees) {
            if self.driver.evict(&root) {
                // The handle of a runtime that has ended holds its channel's buffers (several
                // KB); a later `Start` launches a new one either way.
                if self.runtimes.get(&root).is_some_and(|r| !r.is_alive()) {
                    self.runtimes.remove(&root);
                    self.lease_watch.untrack(&root);
                }
                debug!(root = %root, "quiescent tree evicted");
            }
        }
    }

    /// One outbox retention transaction; asks for another while expired rows remain.
    fn prune(&mut self) {
        let protect = self.positions.lowest();
        match self.store.prune_outbox(
            &self.retention.outbox,
            now_ms(),
            protect,
            self.retention.prune_batch,
        ) {
            Ok(o) => {
                if o.deleted > 0 {
                    info!(
                        deleted = o.deleted,
                        pruned_through = o.pruned_through,
                        "outbox rows pruned"
                    );
                }
                if o.more {
                    let _ = self.tx.send(Msg::Prune);
                }
            }
            Err(e) => warn!(error = %e, "outbox retention pass failed"),
        }
    }

    /// Whether a root's provider runtime may be stopped: "no active turn, no prepared cancel, no
    /// pending interaction" in its tree. A tree that is not in memory is not known to be
    /// quiescent (see [`Core::ensure_loaded`], which the callers that may load run first).
    /// With the [`Pipeline`], a tree whose batch is still being written is not quiescent yet:
    /// what that batch releases may be for its provider (the commit touches the tree again and
    /// its idle timer is armed anew).
    fn runtime_quiescent(&self, root: &Id) -> bool {
        let engine = self.driver.engine();
        engine.session(root).is_some()
            && !self.driver.is_waiting(root)
            && engine.is_quiescent(root)
            && engine.pending_interactions(root).is_empty()
    }

    /// Issue 34: puts `root`'s tree in memory if it is not (`Some(true)`: loaded). `Some(false)`:
    /// the store has no such tree (deleted and purged); `None`: the store could not be read.
    /// Before, a tree out of memory counted as quiescent; a reload that failed while the
    /// database was unreachable (after a commit's outcome was unavailable) left an active tree
    /// out of memory, so its provider was stopped as idle and its lease released with the turn
    /// still active in the store, and nobody settled it (found by the fault harness).
    fn ensure_loaded(&mut self, root: &Id) -> Option<bool> {
        if self.driver.engine().session(root).is_some() || self.driver.reload(root, &self.store) {
            return Some(true);
        }
        match tutti_core::store::Store::load_tree(&self.store, root) {
            Ok(None) => Some(false),
            _ => None,
        }
    }

    /// After a committed step of `root`: stops its runtime at once if the root is deleted and
    /// quiescent, else (re)arms the idle timer when quiescent (see [`Idle`]).
    fn review_runtime(&mut self, root: &Id) {
        match self.runtimes.get(root) {
            None => {
                self.idle.armed.remove(root);
                return;
            }
            Some(r) if !r.is_alive() => {
                self.runtimes.remove(root);
                self.lease_watch.untrack(root);
                self.idle.armed.remove(root);
                return;
            }
            Some(_) => {}
        }
        self.idle.generation += 1;
        let generation = self.idle.generation;
        self.idle.armed.insert(root.clone(), generation);
        let _ = self.ensure_loaded(root);
        if !self.runtime_quiescent(root) {
            return;
        }
        // A tombstoned root (deleted sessions stay loaded as tombstones); a tree that is merely
        // not loaded is not deleted.
        let deleted = self
            .driver
            .engine()
            .session(root)
            .is_some_and(|s| s.deleted_at.is_some());
        if deleted {
            self.stop_runtime(root, "deleted");
            return;
        }
        let Some(timeout) = self.idle.timeout else {
            return;
        };
        let tx = self.tx.clone();
        let root = root.clone();
        tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            let _ = tx.send(Msg::IdleCheck(root, generation));
        });
    }

    /// The root a submit will start a provider for: a submit to a live root session without a
    /// live runtime (a submit the engine will refuse anyway, to a child, a deleted or an
    /// unknown session, needs none).
    fn start_needed(&self, input: &Input) -> Option<Id> {
        let Input::Command(Command::Submit {
            agent_session_id, ..
        }) = input
        else {
            return None;
        };
        match self.driver.engine().session(agent_session_id) {
            Some(s) if !s.is_root() || s.deleted_at.is_some() => return None,
            Some(_) => {}
            // Not loaded: a live root of the store, or nothing the engine will take.
            None => match self.store.session(agent_session_id) {
                Ok(Some(s)) if s.is_root() => {}
                _ => return None,
            },
        }
        let live = self
            .runtimes
            .get(agent_session_id)
            .is_some_and(|r| r.is_alive());
        (!live && !self.reserved.contains(agent_session_id)).then(|| agent_session_id.clone())
    }

    /// Provider runtimes running or about to be started this round.
    fn live_providers(&self) -> usize {
        self.runtimes.values().filter(|r| r.is_alive()).count() + self.reserved.len()
    }

    /// Makes room under the provider cap for a start of `root`: stops the least recently used
    /// idle runtimes (quiescent trees, least recently touched by a committed step first) until
    /// one more fits; an error when every other running provider is busy.
    fn make_room(&mut self, root: &Id) -> Result<(), DaemonError> {
        if self.live_providers() >= self.max_providers {
            // A tree out of memory is not known to be quiescent until it is read (see
            // [`Core::ensure_loaded`]); the candidates' trees are read first.
            let others: Vec<Id> = self
                .runtimes
                .keys()
                .filter(|r| *r != root)
                .cloned()
                .collect();
            for r in &others {
                let _ = self.ensure_loaded(r);
            }
        }
        while self.live_providers() >= self.max_providers {
            let victim = self
                .runtimes
                .iter()
                .filter(|(r, h)| {
                    *r != root
                        && h.is_alive()
                        && !self.reserved.contains(*r)
                        && self.runtime_quiescent(r)
                })
                .min_by_key(|(r, _)| self.idle.armed.get(*r).copied().unwrap_or(0))
                .map(|(r, _)| r.clone());
            match victim {
                Some(v) => self.stop_runtime(&v, "provider limit: least recently used idle"),
                None => {
                    return Err(DaemonError::ProviderLimit {
                        limit: self.max_providers,
                    })
                }
            }
        }
        Ok(())
    }

    fn idle_check(&mut self, root: &Id, generation: u64) {
        if self.idle.armed.get(root) != Some(&generation) {
            return;
        }
        // A tree gone from the store has nothing left to run for.
        let gone = self.ensure_loaded(root) == Some(false);
        if !gone && !self.runtime_quiescent(root) {
            return;
        }
        self.stop_runtime(root, "idle");
    }

    fn stop_runtime(&mut self, root: &Id, why: &'static str) {
        self.idle.armed.remove(root);
        self.current.remove(root);
        self.driver.detach(root);
        self.lease_watch.untrack(root);
        if let Some(r) = self.runtimes.remove(root) {
            info!(root = %root, reason = why, "stopping the provider runtime");
            r.stop(None);
        }
        self.to_release.push(root.clone());
    }

    /// Daemon shutdown: every runtime ends its provider's process group; waits for them (at most
    /// [`SHUTDOWN_WAIT`]) so that no provider process outlives the daemon.
    fn stop_all_runtimes(&mut self) {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let runtimes = std::mem::take(&mut self.runtimes);
        let n = runtimes.len();
        for (root, r) in &runtimes {
            self.current.remove(root);
            self.lease_watch.untrack(root);
            self.driver.detach(root);
            r.stop(Some(done_tx.clone()));
        }
        let roots: Vec<Id> = runtimes.keys().cloned().collect();
        self.housekeeping.release_all(&mut self.store, &roots);
        drop(done_tx);
        let deadline = std::time::Instant::now() + SHUTDOWN_WAIT;
        let mut stopped = 0;
        while stopped < n {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match done_rx.recv_timeout(left) {
                Ok(()) => stopped += 1,
                Err(_) => break,
            }
        }
        info!(
            runtimes = n,
            stopped, "provider runtimes stopped for shutdown"
        );
        self.idle.armed.clear();
    }

    /// [`Output::Launch`]: starts the root's provider process and attaches its adapter to the
    /// driver; a provider that cannot be started is an exit of that root.
    fn launch(&mut self, now: i64, spec: LaunchSpec) {
        let root = spec.root.clone();
        // A runtime that ended without its exit being handled yet: it is replaced (its exit
        // is stale from now on).
        if let Some(old) = self.runtimes.remove(&root) {
            self.lease_watch.untrack(&root);
            old.stop(None);
        }
        self.current.remove(&root);
        // Issue 21: the tree's lease is claimed before its provider starts; a tree another
        // daemon owns is not launched here (the start fails like a provider that cannot start).
        match self.housekeeping.claim(&mut self.store, &root, now) {
            Ownership::Owned => {}
            Ownership::Elsewhere(_) | Ownership::Unknown(_) => {
                warn!(root = %root, "tree not owned by this daemon; provider not started");
                self.drive(DriverInput::Exit {
                    now,
                    root: &root,
                    error: "the tree is owned by another daemon",
                });
                return;
            }
        }
        // The cap (issue 36): a submit made room before it was taken; a start that still finds
        // none (every other provider busy) fails with the limit named, never silently.
        self.reserved.remove(&root);
        if let Err(e) = self.make_room(&root) {
            warn!(root = %root, limit = self.max_providers, "provider not started: provider limit reached");
            self.drive(DriverInput::Exit {
                now,
                root: &root,
                error: &format!("provider not started: {e}"),
            });
            return;
        }
        let cwd = self.store.session_cwd(&root).unwrap_or_else(|e| {
            warn!(root = %root, error = %e, "session cwd not readable; using the default");
            None
        });
        match self.providers.launch(
            &spec.provider,
            &root,
            cwd.as_deref(),
            spec.provider_session_id.as_deref(),
        ) {
            Ok((adapter, transport)) => {
                self.generation += 1;
                let generation = self.generation;
                let tx = self.tx.clone();
                let r = root.clone();
                let to_daemon =
                    ToDaemon::new(move |m| tx.send(Msg::Runtime(r.clone(), generation, m)).is_ok());
                info!(root = %root, provider = %spec.provider, "provider runtime started");
                let restart = !self.ever_launched.insert(root.clone());
                self.metrics.process_started(&spec.provider, restart);
                transport
                    .parse
                    .attach(self.metrics.stage_counter(Stage::Parse));
                let handle = start_runtime(root.clone(), generation, transport, to_daemon);
                let good_until = self.housekeeping.good_until(&root);
                self.lease_watch.track(&root, handle.clone(), good_until);
                self.runtimes.insert(root.clone(), handle);
                self.current.insert(root.clone(), generation);
                self.drive(DriverInput::Attach { now, root, adapter });
            }
            Err(e) => {
                error!(root = %root, error = %e, "provider could not be started");
                self.drive(DriverInput::Exit {
                    now,
                    root: &root,
                    error: &format!("provider could not be started: {e}"),
                });
            }
        }
    }
}
