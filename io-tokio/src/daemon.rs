//! The daemon core: one engine thread that owns the [`Engine`] and the SQLite writer, carries out
//! every [`Step`] (commit first, then provider requests, timers, outbox publication, reply), and
//! a runtime manager with one provider runtime per root session.
//!
//! Inputs that arrive together are decided one after another and group-committed in one
//! transaction. If a commit fails, the trees involved are evicted and reloaded from the file
//! (crash-only), and the inputs whose steps did not land get an error.

use crate::clock::now_ms;
use crate::follow::{LiveBatch, LiveRow, LIVE_CAPACITY};
use crate::retention::{LivePositions, QuiescentTrees, Retention};
use crate::runtime::{start_runtime, RuntimeHandle, ToDaemon, Transport};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tracing::{debug, error, info, warn};
use tutti_core::adapters::Adapter;
use tutti_core::model::{Capabilities, Id};
use tutti_core::step::PersistBatch;
use tutti_core::store::Store;
use tutti_core::{Engine, EngineConfig, Input, ProviderRequest, Rejected, RuntimeAnswer, Step};
use tutti_sqlite::{
    CheckpointEvent, CheckpointMode, CheckpointPolicy, Checkpointer, OpenOptions, Published,
    SqliteStore,
};

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
    ) -> Result<(Box<dyn Adapter>, Transport), String>;
    /// Names of the known providers.
    fn names(&self) -> Vec<String>;
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
    /// An outbox follower asked for rows that retention already deleted (it continues after
    /// `pruned_through`; see [`crate::follow::Followed::Reset`]).
    #[error("outbox rows after {requested_after} through {pruned_through} were pruned")]
    OutboxPruned {
        /// The position asked for.
        requested_after: u64,
        /// Every row up to this seq is gone.
        pruned_through: u64,
    },
}

#[allow(clippy::large_enum_variant)] // one message per input; boxing would add an allocation each
enum Msg {
    Input(Input, Option<oneshot::Sender<Result<Step, DaemonError>>>),
    SetCwd(Id, String),
    /// The idle timer of a root's provider runtime, armed at the given generation.
    IdleCheck(Id, u64),
    /// Run an outbox retention pass (see [`crate::retention`]).
    Prune,
    /// The root ids of the trees loaded in the engine.
    Resident(oneshot::Sender<Vec<Id>>),
    Shutdown(oneshot::Sender<()>),
    /// Flush the buffered text of the provider runtime of this session's tree.
    Flush(Id, mpsc::UnboundedSender<()>),
}

/// A handle to a running daemon core (cheap to clone).
#[derive(Clone)]
pub struct Daemon {
    tx: mpsc::UnboundedSender<Msg>,
    reader: Arc<Mutex<SqliteStore>>,
    outbox: watch::Receiver<u64>,
    live: broadcast::WeakSender<LiveBatch>,
    providers: Arc<dyn ProviderFactory>,
    db: PathBuf,
    positions: Arc<LivePositions>,
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
}

/// The default of [`DaemonOptions::idle_timeout`]: five minutes.
pub const DEFAULT_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// How long a cancel waits for the provider runtime to flush its buffered text.
const FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long daemon shutdown waits for the provider runtimes to end their process groups.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_millis(1100);

impl Daemon {
    /// Opens the database, restores live trees, settles the turns whose provider process no
    /// longer exists (they cannot survive a daemon restart), and starts the engine thread.
    pub fn start(opts: DaemonOptions) -> Result<Daemon, String> {
        // Commits never checkpoint: the checkpoint (and its fsync) runs on a thread of its own so
        // that it never holds up the engine thread (see `checkpointer`).
        let mut store =
            SqliteStore::open_with(&opts.db, &OpenOptions::new().auto_checkpoint(false))
                .map_err(|e| e.to_string())?;
        let reader = SqliteStore::open(&opts.db).map_err(|e| e.to_string())?;
        let mut engine = Engine::with_config(opts.engine);
        // Without message ids: the settle step below appends no message, and every recovered
        // tree is evicted right after it (the next input loads the whole tree). Reading and
        // indexing every stored message id would dominate the start-up time.
        let live = store
            .load_live_trees_without_messages()
            .map_err(|e| e.to_string())?;
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
        for root in &recovered {
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
        for group in settle.chunks(tutti_sqlite::MAX_GROUP) {
            if let Err(e) = store.apply_many(group.iter()) {
                return Err(format!("recovery commit failed: {e}"));
            }
        }
        info!(trees = recovered.len(), "recovered live trees");
        // Loaded without their message ids: none may stay (see above).
        for root in &recovered {
            engine.evict(root);
        }
        let quiescent = QuiescentTrees::default();
        let last_seq = store.last_outbox_seq().map_err(|e| e.to_string())?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (seq_tx, seq_rx) = watch::channel(last_seq);
        let checkpoints =
            Checkpointer::start(&opts.db, CheckpointPolicy::default(), log_checkpoint)
                .map_err(|e| e.to_string())?;
        let (live, _) = broadcast::channel(LIVE_CAPACITY);
        let weak_live = live.downgrade();
        let rt = tokio::runtime::Handle::current();
        let positions = Arc::new(LivePositions::default());
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
        let core = Core {
            checkpoints,
            live,
            engine,
            store,
            rx,
            tx: tx.clone(),
            seq: seq_tx,
            runtimes: BTreeMap::new(),
            providers: opts.providers.clone(),
            idle: Idle {
                timeout: opts.idle_timeout,
                generation: 0,
                armed: BTreeMap::new(),
            },
            retention: opts.retention,
            quiescent,
            loaded: Vec::new(),
            positions: positions.clone(),
        };
        std::thread::Builder::new()
            .name("tutti-engine".into())
            .spawn(move || {
                let _guard = rt.enter();
                core.run();
            })
            .map_err(|e| e.to_string())?;
        Ok(Daemon {
            tx,
            reader: Arc::new(Mutex::new(reader)),
            outbox: seq_rx,
            live: weak_live,
            providers: opts.providers,
            db: opts.db,
            positions,
        })
    }

    /// Feeds one input and waits for its step (committed) or rejection.
    pub async fn call(&self, input: Input) -> Result<Step, DaemonError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Msg::Input(input, Some(tx)))
            .map_err(|_| DaemonError::Stopped)?;
        rx.await.map_err(|_| DaemonError::Stopped)?
    }

    /// Records the working directory of a root session's provider in the database (call before
    /// the session's `CreateSession`: inputs are handled in order, so the session's commit
    /// follows this write).
    pub fn set_cwd(&self, root: Id, cwd: String) {
        let _ = self.tx.send(Msg::SetCwd(root, cwd));
    }

    /// Runs a read against the read connection (blocking; call from `spawn_blocking`).
    pub fn read<T>(&self, f: impl FnOnce(&SqliteStore) -> T) -> Result<T, DaemonError> {
        let guard = self
            .reader
            .lock()
            .map_err(|_| DaemonError::Storage("reader poisoned".into()))?;
        // One read transaction per call: the reads inside see one committed state.
        guard
            .read_consistent(f)
            .map_err(|e| DaemonError::Storage(e.to_string()))
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

    /// Has the provider runtime of `session`'s tree emit the text it buffered, and waits until
    /// those events are queued for the engine: an input sent after this returns is handled
    /// after them. Used before `cancelTurn` (issue 23: "Flush buffered text before the cancel
    /// settles the turn; it is the user's record of what happened"). Returns at once when the
    /// tree has no running provider.
    pub async fn flush_provider_text(&self, session: &Id) -> Result<(), DaemonError> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.tx
            .send(Msg::Flush(session.clone(), tx))
            .map_err(|_| DaemonError::Stopped)?;
        // A closed channel means no runtime (or it ended): nothing was buffered to keep. A
        // runtime that does not answer in time (stuck writing to its process) must not hold the
        // cancel up: the cancel goes ahead and only that buffered text is lost.
        if tokio::time::timeout(FLUSH_WAIT, rx.recv()).await.is_err() {
            warn!(session = %session, "provider text flush timed out; canceling anyway");
        }
        Ok(())
    }

    /// The positions of the live outbox followers (retention never prunes above the lowest).
    pub fn live_positions(&self) -> &Arc<LivePositions> {
        &self.positions
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

struct Core {
    /// The checkpoint thread (commits never checkpoint; see [`Checkpointer`]).
    checkpoints: Checkpointer,
    live: broadcast::Sender<LiveBatch>,
    engine: Engine,
    store: SqliteStore,
    rx: mpsc::UnboundedReceiver<Msg>,
    tx: mpsc::UnboundedSender<Msg>,
    seq: watch::Sender<u64>,
    runtimes: BTreeMap<Id, RuntimeHandle>,
    providers: Arc<dyn ProviderFactory>,
    idle: Idle,
    retention: Retention,
    /// Loaded quiescent trees, least recently touched first (see [`crate::retention`]).
    quiescent: QuiescentTrees,
    /// Trees loaded on demand since the last residency check.
    loaded: Vec<Id>,
    positions: Arc<LivePositions>,
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

type Reply = Option<oneshot::Sender<Result<Step, DaemonError>>>;

impl Core {
    fn run(mut self) {
        while let Some(first) = self.rx.blocking_recv() {
            let mut batch = vec![first];
            while batch.len() < tutti_sqlite::MAX_GROUP {
                match self.rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            let now = now_ms();
            let mut decided: Vec<(Step, Reply)> = Vec::new();
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
                    Msg::Resident(r) => resident.push(r),
                    Msg::Flush(session, done) => self.flush_runtime(&session, done),
                    Msg::Shutdown(done) => shutdown = Some(done),
                    Msg::Input(input, reply) => match self.decide(now, &input) {
                        Ok(step) => {
                            if step.ignored.is_some() {
                                self.tell_dropped(&input);
                            }
                            decided.push((step, reply))
                        }
                        Err(e) => {
                            // An API caller's inconsistency is logged where it is answered.
                            if e.is_internal() && reply.is_none() {
                                error!(kind = input.kind(), error = %e, "engine inconsistency");
                            } else {
                                debug!(kind = input.kind(), error = %e, "input rejected");
                            }
                            self.tell_dropped(&input);
                            if let Some(r) = reply {
                                let _ = r.send(Err(e.into()));
                            }
                        }
                    },
                }
            }
            let committed = self.commit(decided);
            let mut touched = std::mem::take(&mut self.loaded);
            for (step, reply) in committed {
                self.effects(now, &step);
                if let Some(root) = &step.persist.root_agent_session_id {
                    if !touched.contains(root) {
                        touched.push(root.clone());
                    }
                }
                if let Some(r) = reply {
                    let _ = r.send(Ok(step));
                }
            }
            for root in &touched {
                self.review_runtime(root);
            }
            self.residency(touched);
            if prune {
                self.prune();
            }
            for r in resident {
                let _ = r.send(self.engine.roots());
            }
            if self.checkpoints.restart_wanted() {
                let t = std::time::Instant::now();
                // Never wait here: a reader in the way makes it `busy`, and the checkpoint
                // thread asks again after its next pass.
                match self.store.checkpoint(CheckpointMode::RestartNoWait) {
                    Ok(c) => debug!(
                        wal_frames = c.wal_frames,
                        busy = c.busy,
                        micros = t.elapsed().as_micros() as u64,
                        "WAL restart"
                    ),
                    Err(e) => warn!(error = %e, "WAL restart failed"),
                }
                self.checkpoints.restarted();
            }
            if let Some(done) = shutdown {
                self.stop_all_runtimes();
                let _ = done.send(());
                return;
            }
        }
    }

    /// [`Msg::Flush`]: the runtime of the session's root (if it runs) flushes and tells `done`;
    /// otherwise `done` is dropped.
    fn flush_runtime(&self, session: &Id, done: mpsc::UnboundedSender<()>) {
        let root = match self.engine.root_of(session) {
            Some(r) => r.clone(),
            None => return,
        };
        if let Some(r) = self.runtimes.get(&root) {
            r.flush(done);
        }
    }

    /// A provider's interaction request that the engine did not take still waits for an
    /// answer: its adapter answers it natively so the provider never hangs.
    fn tell_dropped(&self, input: &Input) {
        if let Input::Event(
            e @ tutti_core::NormalizedEvent::InteractionRequested {
                agent_session_id, ..
            },
        ) = input
        {
            let root = self
                .engine
                .root_of(agent_session_id)
                .cloned()
                .unwrap_or_else(|| {
                    // Adapter-made child ids start with their root's id (`{root}~...`).
                    agent_session_id
                        .split('~')
                        .next()
                        .unwrap_or_default()
                        .into()
                });
            if let Some(r) = self.runtimes.get(&root) {
                r.dropped(e.clone());
            }
        }
    }

    /// Handles one input, loading an evicted tree on demand.
    fn decide(&mut self, now: i64, input: &Input) -> Result<Step, Rejected> {
        match self.engine.handle(now, input) {
            Err(Rejected::UnknownSession(id)) => {
                if self.load_tree_of(&id) {
                    self.engine.handle(now, input)
                } else {
                    Err(Rejected::UnknownSession(id))
                }
            }
            other => other,
        }
    }

    fn load_tree_of(&mut self, session: &str) -> bool {
        let root = match self.store.root_of(session) {
            Ok(Some(r)) => r,
            _ => return false,
        };
        if self.engine.root_of(&root).is_some() {
            return false;
        }
        match self.store.load_tree(&root) {
            Ok(Some(t)) => {
                let ok = self.engine.restore(t).is_ok();
                if ok {
                    debug!(root = %root, "evicted tree reloaded");
                    self.loaded.push(root);
                }
                ok
            }
            _ => false,
        }
    }

    /// After a commit: the touched trees that are quiescent become the most recent eviction
    /// candidates, the others stop being candidates, and the least recently touched candidates
    /// beyond [`Retention::resident_trees`] leave the engine (reloaded on demand by
    /// [`Core::decide`]).
    fn residency(&mut self, touched: Vec<Id>) {
        for root in touched {
            if self.engine.root_of(&root).is_none() {
                self.quiescent.forget(&root);
            } else if self.engine.is_quiescent(&root) {
                self.quiescent.touch(&root);
            } else {
                self.quiescent.forget(&root);
            }
        }
        while let Some(root) = self.quiescent.over(self.retention.resident_trees) {
            if self.engine.is_quiescent(&root) {
                self.engine.evict(&root);
                // The handle of a runtime that has ended holds its channel's buffers (several
                // KB); a later `Start` launches a new one either way.
                if self.runtimes.get(&root).is_some_and(|r| !r.is_alive()) {
                    self.runtimes.remove(&root);
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

    fn commit(&mut self, decided: Vec<(Step, Reply)>) -> Vec<(Step, Reply)> {
        let batches: Vec<&PersistBatch> = decided
            .iter()
            .filter(|(s, _)| !s.persist.is_empty())
            .map(|(s, _)| &s.persist)
            .collect();
        if batches.is_empty() {
            return decided;
        }
        match self.store.apply_many_published(batches.iter().copied()) {
            Ok(published) => {
                self.checkpoints.committed();
                self.publish(&batches, published);
                decided
            }
            Err(e) => {
                warn!(error = %e, steps = batches.len(), "group commit failed; retrying one by one");
                let mut ok = Vec::new();
                for (step, reply) in decided {
                    if step.persist.is_empty() {
                        ok.push((step, reply));
                        continue;
                    }
                    match self
                        .store
                        .apply_many_published(std::iter::once(&step.persist))
                    {
                        Ok(published) => {
                            self.checkpoints.committed();
                            self.publish(&[&step.persist], published);
                            ok.push((step, reply));
                        }
                        Err(e) => {
                            error!(error = %e, "step not committed; reloading its tree");
                            if let Some(root) = &step.persist.root_agent_session_id {
                                self.engine.evict(root);
                                if let Ok(Some(t)) = self.store.load_tree(root) {
                                    let _ = self.engine.restore(t);
                                }
                            }
                            if let Some(r) = reply {
                                let _ = r.send(Err(DaemonError::Storage(e.to_string())));
                            }
                        }
                    }
                }
                ok
            }
        }
    }

    /// Announces a commit: the newest sequence number, and its rows to live followers.
    fn publish(&mut self, batches: &[&PersistBatch], published: Vec<Vec<Published>>) {
        let Some(max) = published.iter().flatten().map(|p| p.seq).max() else {
            return;
        };
        if self.live.receiver_count() > 0 {
            let mut rows = Vec::with_capacity(published.iter().map(Vec::len).sum());
            for (batch, published) in batches.iter().zip(published) {
                let (Some(root), Some(ws)) = (&batch.root_agent_session_id, &batch.workspace_id)
                else {
                    continue;
                };
                for p in published {
                    let Some(row) = batch.rows.get(p.row as usize) else {
                        continue;
                    };
                    rows.push(LiveRow {
                        seq: p.seq,
                        kind: row.kind(),
                        root_agent_session_id: root.clone(),
                        workspace_id: ws.clone(),
                        payload: p.payload,
                    });
                }
            }
            let _ = self.live.send(Arc::new(rows));
        }
        self.seq.send_replace(max);
    }

    fn effects(&mut self, now: i64, step: &Step) {
        for req in &step.provider {
            self.dispatch(req.clone());
        }
        for t in &step.timers {
            let tx = self.tx.clone();
            let timer = t.timer.clone();
            let wait = (t.at - now).max(0) as u64;
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
                let _ = tx.send(Msg::Input(
                    Input::Runtime(RuntimeAnswer::TimerFired { timer }),
                    None,
                ));
            });
        }
    }

    fn dispatch(&mut self, req: ProviderRequest) {
        let root = req.root_agent_session_id().clone();
        let alive = self.runtimes.get(&root).is_some_and(|r| r.is_alive());
        if !alive {
            if matches!(req, ProviderRequest::Start { .. }) {
                if let Err(e) = self.launch(&root) {
                    error!(root = %root, error = %e, "provider could not be started");
                    self.answer(RuntimeAnswer::ProviderExited {
                        root_agent_session_id: root,
                        error: format!("provider could not be started: {e}"),
                    });
                    return;
                }
            } else {
                // No live provider runtime: nothing can confirm anything.
                match &req {
                    ProviderRequest::Cancel { operation_id, .. } => {
                        self.answer(RuntimeAnswer::CancelFailed {
                            operation_id: operation_id.clone(),
                            error: "no live provider runtime".into(),
                        })
                    }
                    ProviderRequest::Guide {
                        agent_session_id,
                        turn_id,
                        ..
                    } => self.answer(RuntimeAnswer::GuideFailed {
                        agent_session_id: agent_session_id.clone(),
                        turn_id: turn_id.clone(),
                        error: "no live provider runtime".into(),
                    }),
                    _ => warn!(root = %root, "no live provider runtime for an interaction answer"),
                }
                return;
            }
        }
        if let Some(r) = self.runtimes.get(&root) {
            if !r.send(req) {
                warn!(root = %root, "provider runtime is gone");
            }
        }
    }

    /// Whether a root's provider runtime may be stopped: "no active turn, no prepared cancel, no
    /// pending interaction" in its tree. A tree that is not loaded has none of them.
    fn runtime_quiescent(&self, root: &Id) -> bool {
        self.engine.is_quiescent(root) && self.engine.pending_interactions(root).is_empty()
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
                self.idle.armed.remove(root);
                return;
            }
            Some(_) => {}
        }
        self.idle.generation += 1;
        let generation = self.idle.generation;
        self.idle.armed.insert(root.clone(), generation);
        if !self.runtime_quiescent(root) {
            return;
        }
        // A tombstoned root (deleted sessions stay loaded as tombstones); a tree that is merely
        // not loaded is not deleted.
        let deleted = self
            .engine
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

    fn idle_check(&mut self, root: &Id, generation: u64) {
        if self.idle.armed.get(root) != Some(&generation) || !self.runtime_quiescent(root) {
            return;
        }
        self.stop_runtime(root, "idle");
    }

    fn stop_runtime(&mut self, root: &Id, why: &'static str) {
        self.idle.armed.remove(root);
        if let Some(r) = self.runtimes.remove(root) {
            info!(root = %root, reason = why, "stopping the provider runtime");
            r.stop(None);
        }
    }

    /// Daemon shutdown: every runtime ends its provider's process group; waits for them (at most
    /// [`SHUTDOWN_WAIT`]) so that no provider process outlives the daemon.
    fn stop_all_runtimes(&mut self) {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let runtimes = std::mem::take(&mut self.runtimes);
        let n = runtimes.len();
        for r in runtimes.values() {
            r.stop(Some(done_tx.clone()));
        }
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

    fn answer(&self, a: RuntimeAnswer) {
        let _ = self.tx.send(Msg::Input(Input::Runtime(a), None));
    }

    fn launch(&mut self, root: &Id) -> Result<(), String> {
        let (provider, previous) = self
            .engine
            .session(root)
            .map(|s| (s.provider.to_string(), s.provider_session_id.clone()))
            .ok_or("unknown root session")?;
        let cwd = self.store.session_cwd(root).unwrap_or_else(|e| {
            warn!(root = %root, error = %e, "session cwd not readable; using the default");
            None
        });
        let (adapter, transport) =
            self.providers
                .launch(&provider, root, cwd.as_deref(), previous.as_deref())?;
        let tx = self.tx.clone();
        let to_daemon = ToDaemon::new(move |i| tx.send(Msg::Input(i, None)).is_ok());
        info!(root = %root, provider = %provider, "provider runtime started");
        let handle = start_runtime(root.clone(), adapter, transport, to_daemon);
        self.runtimes.insert(root.clone(), handle);
        Ok(())
    }
}
