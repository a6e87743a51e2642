//! A seeded simulation of the whole stack: simulated providers that emit plausible native
//! traffic, the real adapters and engine, a real store (SQLite for every
//! [`SQLITE_EVERY`]-th seed, the reference [`MemoryStore`] otherwise), crashes at random commit
//! boundaries, and user commands at random moments. Run by `tests/tests/simulation.rs`.
//!
//! # One seed
//!
//! 1 to 3 root trees, each served by one simulated provider: a direct provider of normalized
//! events ([`direct`]), an ACP agent behind the real [`AcpAdapter`] ([`acp`]), a Codex app-server
//! behind the real `CodexAdapter` ([`codex`]) or a Claude SDK sidecar behind the real
//! `ClaudeAdapter` ([`claude`]). A scheduler picks one enabled action at a time:
//! deliver the next line of a pipe (runtime -> provider or provider -> runtime; each pipe is FIFO,
//! as a stdio pipe is, so the *interleaving* between pipes, trees, engine requests and user
//! commands is what varies), let a provider make progress on one of its concurrent tasks
//! (children run concurrently, so their traffic interleaves), fire due timers, jump the clock to
//! the next timer, or act as the user (submit, cancel the root, cancel one child, answer an
//! interaction, delete a session).
//!
//! Two phases per seed:
//! - **safety** (faults on): duplicates and late lines each protocol allows (repeated state
//!   snapshots, repeated spawn edges, repeated terminals, late output after a prompt answered),
//!   failed cancel writes, failed guidance, provider processes that exit, and two kinds of crash
//!   at random commit boundaries: a *daemon crash* (everything in memory is dropped, the provider
//!   processes die with it, the SQLite file is reopened, live trees are reloaded and settled with
//!   `providerExited`, as `tuttid` does on start; a crash may also hit after the engine decided a
//!   step and before it was committed, which loses that step) and an *engine restart* (engine and
//!   store connection dropped and reloaded while the provider runtimes survive; prepared cancels
//!   are replayed to them and their deadlines re-armed);
//! - **liveness** (faults off): the user only answers interactions; every root turn must settle
//!   within [`LIVENESS_STEPS`] scheduler steps, nothing stays active, prepared or pending.
//!
//! After every engine step the shared checks run ([`check_all`]: the engine's invariant checker
//! on memory and on the stored trees, stored state == engine state, and the [`History`] rules:
//! settled turns never reopen, no child revealed after its root's cancel was prepared, tombstones
//! stay, the outbox is gap-free). After every reload the reloaded engine state must equal the
//! stored state.
//!
//! # Choices, replay and shrinking
//!
//! Every random choice is drawn from a [`Rng`] that records it on a tape. A failing seed is
//! replayed from its tape; the tape is then shrunk (chunks deleted, values zeroed; a missing or
//! zero draw always means the plainest choice: deliver the next line, no fault) while the run
//! still fails, and the shortest failing run is replayed once more to print its trace: every
//! engine input as a scenario line (`{"at":..,"input":..}`) with crashes, native lines and
//! rejections as `#` comments.

pub mod acp;
pub mod claude;
pub mod codex;
pub mod direct;
pub mod roundtrip;

/// `tutti_core::fuzzing`, included by source so this crate needs no feature of tutti-core: the
/// module only names `super::` items, which the glob import below provides.
#[allow(dead_code)]
#[path = "../../../core/src/fuzzing.rs"]
pub mod fuzzing;
#[allow(unused_imports)]
use tutti_core::*;

use fuzzing::{check_all, check_one, unsettled, History};

use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
use tutti_core::adapters::{take_due, Adapter, AdapterOutput, AdapterTimer};
use tutti_core::input::{Command, Input, NormalizedEvent, RuntimeAnswer, TimerId};
use tutti_core::model::{
    CancelOperation, Id, Interaction, Message, Millis, Session, SessionKind, Turn,
};
use tutti_core::projection::SessionDetail;
use tutti_core::step::{PersistBatch, ProviderRequest, TimerRequest};
use tutti_core::store::{MemoryStore, OutboxRow, Store};
use tutti_core::{Engine, EngineConfig, TreeSnapshot};
use tutti_sqlite::SqliteStore;

/// Every this many seeds (seed % N == 0) runs against a real SQLite file instead of the
/// reference store. SQLite costs about 10x per step in a debug build; the reference store is
/// checked equal to SQLite by `tutti-sqlite`'s own equivalence tests and by `store_roundtrip`.
pub const SQLITE_EVERY: u64 = 8;
/// Scheduler steps the liveness phase may take before a seed fails as stuck.
pub const LIVENESS_STEPS: usize = 4_000;

// ----- randomness with a tape ------------------------------------------------------------------

/// splitmix64 that records every draw, or replays a recorded tape (zeros past its end).
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
    replay: Option<Vec<u64>>,
    pos: usize,
    /// Every draw so far.
    pub tape: Vec<u64>,
}

impl Rng {
    /// Draws from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng {
            state: seed ^ 0x7475_7474_6953_494d,
            replay: None,
            pos: 0,
            tape: Vec::new(),
        }
    }

    /// Replays `tape` (zeros after its end).
    pub fn replay(tape: Vec<u64>) -> Rng {
        Rng {
            state: 0,
            replay: Some(tape),
            pos: 0,
            tape: Vec::new(),
        }
    }

    /// The next draw.
    pub fn draw(&mut self) -> u64 {
        let v = match &self.replay {
            Some(t) => t.get(self.pos).copied().unwrap_or(0),
            None => {
                self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = self.state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^ (z >> 31)
            }
        };
        self.pos += 1;
        self.tape.push(v);
        v
    }

    /// `0..n` (0 for a zero draw).
    pub fn below(&mut self, n: usize) -> usize {
        if n <= 1 {
            self.draw();
            0
        } else {
            (self.draw() % n as u64) as usize
        }
    }

    /// True with probability `permille / 1000`; a zero draw is false.
    pub fn chance(&mut self, permille: u64) -> bool {
        let v = self.draw() % 1000;
        permille > 0 && v >= 1000 - permille.min(1000)
    }

    /// `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }
}

// ----- the store -------------------------------------------------------------------------------

/// The store error of the simulation.
#[derive(Debug)]
pub struct SimStoreError(pub String);

impl std::fmt::Display for SimStoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SimStoreError {}

/// The reference store, or a real SQLite file that survives crashes.
#[derive(Debug)]
pub enum SimStore {
    /// In memory (survives "crashes": it stands for the file).
    Memory(MemoryStore),
    /// A file; reopened after every crash.
    Sqlite {
        /// The open connection (`None` between a crash and the reopen).
        db: Option<SqliteStore>,
        /// The file.
        path: PathBuf,
        /// Keeps the directory alive.
        _dir: tempfile::TempDir,
    },
}

fn e<E: std::fmt::Display>(x: E) -> SimStoreError {
    SimStoreError(x.to_string())
}

impl SimStore {
    fn sqlite() -> Result<SimStore, String> {
        let base = std::env::var_os("TUTTI_SIM_TMPDIR")
            .map(PathBuf::from)
            .or_else(|| Some(PathBuf::from("/dev/shm")).filter(|p| p.is_dir()))
            .unwrap_or_else(std::env::temp_dir);
        let dir = tempfile::Builder::new()
            .prefix("tutti-sim-")
            .tempdir_in(base)
            .or_else(|_| tempfile::tempdir())
            .map_err(|e| e.to_string())?;
        let path = dir.path().join("tutti.db");
        let db = SqliteStore::open(&path).map_err(|e| e.to_string())?;
        Ok(SimStore::Sqlite {
            db: Some(db),
            path,
            _dir: dir,
        })
    }

    /// "Drop everything in memory, reload from the file": closes and reopens the SQLite file.
    fn reopen(&mut self) -> Result<(), String> {
        if let SimStore::Sqlite { db, path, .. } = self {
            *db = None;
            let fresh =
                SqliteStore::open(&*path).map_err(|e| format!("reopen after crash: {e}"))?;
            if let Ok(problems) = fresh.integrity_check() {
                if !problems.is_empty() {
                    return Err(format!("integrity check after crash: {problems:?}"));
                }
            }
            *db = Some(fresh);
        }
        Ok(())
    }

    fn db(&self) -> Result<&SqliteStore, SimStoreError> {
        match self {
            SimStore::Sqlite { db: Some(d), .. } => Ok(d),
            _ => Err(SimStoreError("database closed".into())),
        }
    }

    /// Whether this is SQLite.
    pub fn is_sqlite(&self) -> bool {
        matches!(self, SimStore::Sqlite { .. })
    }
}

macro_rules! delegate {
    ($self:ident, $m:ident ( $($a:expr),* )) => {
        match $self {
            SimStore::Memory(m) => m.$m($($a),*).map_err(e),
            SimStore::Sqlite { .. } => $self.db()?.$m($($a),*).map_err(e),
        }
    };
}

impl Store for SimStore {
    type Error = SimStoreError;

    fn apply(&mut self, batch: &PersistBatch) -> Result<Vec<u64>, SimStoreError> {
        match self {
            SimStore::Memory(m) => m.apply(batch).map_err(e),
            SimStore::Sqlite { db: Some(d), .. } => d.apply(batch).map_err(e),
            SimStore::Sqlite { db: None, .. } => Err(SimStoreError("database closed".into())),
        }
    }
    fn load_tree(&self, root: &str) -> Result<Option<TreeSnapshot>, SimStoreError> {
        delegate!(self, load_tree(root))
    }
    fn load_live_trees(&self) -> Result<Vec<TreeSnapshot>, SimStoreError> {
        delegate!(self, load_live_trees())
    }
    fn session(&self, id: &str) -> Result<Option<Session>, SimStoreError> {
        delegate!(self, session(id))
    }
    fn turn(&self, id: &str) -> Result<Option<Turn>, SimStoreError> {
        delegate!(self, turn(id))
    }
    fn session_detail(&self, id: &str) -> Result<Option<SessionDetail>, SimStoreError> {
        delegate!(self, session_detail(id))
    }
    fn messages(
        &self,
        s: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Message>, SimStoreError> {
        delegate!(self, messages(s, after, limit))
    }
    fn interaction(&self, turn: &str, request: &str) -> Result<Option<Interaction>, SimStoreError> {
        delegate!(self, interaction(turn, request))
    }
    fn cancel_operation(&self, id: &str) -> Result<Option<CancelOperation>, SimStoreError> {
        delegate!(self, cancel_operation(id))
    }
    fn outbox_after(&self, after: u64, limit: usize) -> Result<Vec<OutboxRow>, SimStoreError> {
        delegate!(self, outbox_after(after, limit))
    }
}

// ----- simulated providers ---------------------------------------------------------------------

/// A simulated provider process. It reads what the runtime writes to it and writes lines back;
/// its internal work (a root turn, concurrent children) advances one task per [`Provider::step`].
pub trait Provider {
    /// A line the runtime wrote (native JSON; for the direct provider a [`ProviderRequest`]).
    fn receive(&mut self, now: Millis, msg: &Value, rng: &mut Rng) -> Vec<Value>;
    /// One step of one ready task; the lines it writes, in order.
    fn step(&mut self, now: Millis, rng: &mut Rng, faults: bool) -> Vec<Value>;
    /// Whether [`Provider::step`] has anything to do.
    fn busy(&self) -> bool;
    /// The liveness phase begins: no more hanging work, no more faults.
    fn calm(&mut self);
}

/// Which provider serves a tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Normalized events straight into the engine.
    Direct,
    /// An ACP agent behind the real ACP adapter.
    Acp,
    /// A Codex app-server behind the real Codex adapter.
    Codex,
    /// A Claude SDK sidecar behind the real Claude adapter.
    Claude,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Direct => "direct",
            Kind::Acp => "acp",
            Kind::Codex => "codex",
            Kind::Claude => "claude",
        }
    }
}

/// The kinds a seed may use (all four).
pub const KINDS: [Kind; 4] = [Kind::Direct, Kind::Acp, Kind::Codex, Kind::Claude];

/// One live provider process with its adapter and pipes.
struct Link {
    adapter: Option<Box<dyn Adapter>>,
    provider: Box<dyn Provider>,
    /// Runtime -> provider.
    down: VecDeque<Value>,
    /// Provider -> runtime.
    up: VecDeque<Value>,
    timers: Vec<AdapterTimer>,
    /// Engine -> runtime, not yet handed to the adapter (requests and dropped events, in order).
    requests: VecDeque<ToRuntime>,
}

/// What the daemon sends a runtime (`io-tokio`'s `RuntimeMsg`).
#[derive(Debug, Clone)]
enum ToRuntime {
    /// A provider request the engine decided.
    Request(ProviderRequest),
    /// An `interactionRequested` the engine did not take: the adapter answers it natively.
    Dropped(NormalizedEvent),
}

struct TreeSim {
    root: Id,
    kind: Kind,
    incarnation: u32,
    link: Option<Link>,
    turns: u32,
    ops: u32,
    deleted: bool,
    /// Requests that arrived while no provider process runs.
    link_less: VecDeque<ProviderRequest>,
}

fn new_link(kind: Kind, root: &Id, incarnation: u32, rng: &mut Rng) -> Link {
    let tag = format!("{root}i{incarnation}");
    let (adapter, provider): (Option<Box<dyn Adapter>>, Box<dyn Provider>) = match kind {
        Kind::Direct => (
            None,
            Box::new(direct::DirectProvider::new(root.clone(), tag, rng)),
        ),
        Kind::Acp => (
            Some(Box::new(AcpAdapter::new(
                root.clone(),
                AcpConfig::default(),
            ))),
            Box::new(acp::AcpAgent::new(tag, rng)),
        ),
        Kind::Codex => (
            Some(codex::adapter(root)),
            Box::new(codex::CodexServer::new(tag, rng)),
        ),
        Kind::Claude => (
            Some(claude::adapter(root)),
            Box::new(claude::ClaudeSidecar::new(tag, rng)),
        ),
    };
    Link {
        adapter,
        provider,
        down: VecDeque::new(),
        up: VecDeque::new(),
        timers: Vec::new(),
        requests: VecDeque::new(),
    }
}

// ----- the world -------------------------------------------------------------------------------

/// Why a seed failed.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The broken rule.
    pub message: String,
    /// The draws of the failing run.
    pub tape: Vec<u64>,
}

/// Counters of one seed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    /// Engine inputs fed.
    pub inputs: usize,
    /// Scheduler steps.
    pub steps: usize,
    /// Crashes (both kinds).
    pub crashes: usize,
    /// Whether the seed ran against SQLite.
    pub sqlite: bool,
}

struct World {
    rng: Rng,
    now: Millis,
    engine: Engine,
    store: SimStore,
    history: History,
    trees: Vec<TreeSim>,
    tree_of: BTreeMap<Id, usize>,
    timers: Vec<TimerRequest>,
    faults: bool,
    stats: Stats,
    trace: Option<Vec<String>>,
}

type R<T = ()> = Result<T, String>;

impl World {
    fn note(&mut self, f: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            t.push(format!("# {}", f()));
        }
    }

    /// Loads a tree that is not in memory (evicted, or not yet reloaded after a restart).
    fn ensure_loaded(&mut self, t: usize) -> R {
        let root = self.trees[t].root.clone();
        if self.engine.root_of(&root).is_some() {
            return Ok(());
        }
        if let Some(snap) = self.store.load_tree(&root).map_err(|e| e.to_string())? {
            self.engine
                .restore(snap)
                .map_err(|e| format!("stored tree {root} does not restore: {e}"))?;
        }
        Ok(())
    }

    /// Feeds one input for tree `t`: decide, maybe crash before the commit, commit, check.
    fn feed(&mut self, t: usize, input: Input) -> R {
        self.ensure_loaded(t)?;
        self.now += 1;
        self.stats.inputs += 1;
        if let Some(tr) = &mut self.trace {
            tr.push(json!({"at": self.now, "input": input}).to_string());
        }
        let step = match self.engine.handle(self.now, &input) {
            Ok(s) => s,
            Err(e) => {
                self.note(|| format!("rejected: {e}"));
                self.tell_dropped(t, &input);
                return Ok(());
            }
        };
        if step.ignored.is_some() {
            self.tell_dropped(t, &input);
        }
        if self.faults && !step.persist.is_empty() && self.rng.chance(3) {
            // The process dies after deciding the step and before committing it.
            self.note(|| "crash before the commit: the step above is lost".into());
            return self.daemon_crash();
        }
        if let Err(err) = self.store.apply(&step.persist) {
            return Err(format!(
                "the store refused a step of its only writer ({}): {err}",
                input.kind()
            ));
        }
        self.timers.extend(step.timers.iter().cloned());
        for r in step.provider {
            let root = r.root_agent_session_id().clone();
            let Some(&i) = self.tree_of.get(&root) else {
                return Err(format!("provider request for unknown root {root}"));
            };
            self.route_request(i, r);
        }
        let root = self.trees[t].root.clone();
        check_one(&self.engine, &self.store, &mut self.history, &root)
            .map_err(|e| format!("after {}: {e}", input.kind()))
    }

    /// As the daemon does: an interaction request the engine did not take (rejected, or accepted
    /// as ignored) goes back to the runtime of its tree, whose adapter answers it natively.
    fn tell_dropped(&mut self, t: usize, input: &Input) {
        if let Input::Event(e @ NormalizedEvent::InteractionRequested { .. }) = input {
            if let Some(l) = &mut self.trees[t].link {
                l.requests.push_back(ToRuntime::Dropped(e.clone()));
            }
        }
    }

    /// Hands a provider request to the runtime of its tree, starting a provider process for a
    /// `start` when none runs (the previous one died with a crash or exited).
    fn route_request(&mut self, t: usize, r: ProviderRequest) {
        if self.trees[t].link.is_none() && matches!(r, ProviderRequest::Start { .. }) {
            let tree = &mut self.trees[t];
            tree.incarnation += 1;
            let link = new_link(tree.kind, &tree.root, tree.incarnation, &mut self.rng);
            self.trees[t].link = Some(link);
            if let Some(l) = &mut self.trees[t].link {
                if let Some(a) = &mut l.adapter {
                    let out = a.open(self.now);
                    l.down.extend(out.native);
                    l.timers.extend(out.timers);
                }
            }
        }
        match &mut self.trees[t].link {
            Some(l) => l.requests.push_back(ToRuntime::Request(r)),
            None => self.trees[t].link_less.push_back(r),
        }
    }

    /// Feeds an adapter output: native lines to the provider, events and answers to the engine.
    fn absorb(&mut self, t: usize, out: AdapterOutput) -> R {
        if let Some(l) = &mut self.trees[t].link {
            l.down.extend(out.native);
            l.timers.extend(out.timers);
        }
        for ev in out.events {
            self.feed(t, Input::Event(ev))?;
        }
        for a in out.answers {
            self.feed(t, Input::Runtime(a))?;
        }
        Ok(())
    }

    // ----- crashes -----

    /// The daemon dies: engine, runtimes and provider processes. On restart the file is reopened,
    /// live trees are reloaded and settled with `providerExited` (their processes are gone).
    fn daemon_crash(&mut self) -> R {
        self.stats.crashes += 1;
        self.note(|| {
            "daemon crash: engine, runtimes and providers dropped; reload from the store".into()
        });
        for tree in &mut self.trees {
            tree.link = None;
            tree.link_less.clear();
        }
        self.timers.clear();
        self.engine = Engine::with_config(EngineConfig::default());
        self.store.reopen()?;
        let live = self.reload_live()?;
        for root in live {
            let Some(&t) = self.tree_of.get(&root) else {
                continue;
            };
            self.feed(
                t,
                Input::Runtime(RuntimeAnswer::ProviderExited {
                    root_agent_session_id: root.clone(),
                    error: "the daemon restarted; the provider process is gone".into(),
                }),
            )?;
        }
        Ok(())
    }

    /// The engine (and its store connection) restarts; provider runtimes survive. Prepared
    /// cancels are replayed to them and their deadlines re-armed.
    fn engine_restart(&mut self) -> R {
        self.stats.crashes += 1;
        self.note(|| "engine restart: engine dropped, store reopened, runtimes kept; prepared cancels replayed".into());
        self.timers.clear();
        self.engine = Engine::with_config(EngineConfig::default());
        self.store.reopen()?;
        self.reload_live()?;
        for op in self.engine.prepared_cancels() {
            self.timers.push(TimerRequest {
                timer: TimerId::CancelDeadline {
                    operation_id: op.id.clone(),
                },
                at: op.deadline,
            });
            let Some(&t) = self.tree_of.get(&op.root_agent_session_id) else {
                continue;
            };
            self.route_request(
                t,
                ProviderRequest::Cancel {
                    operation_id: op.id.clone(),
                    root_agent_session_id: op.root_agent_session_id.clone(),
                    targets: op.targets.clone(),
                },
            );
        }
        Ok(())
    }

    /// Restores every live tree; checks that the reloaded state equals the stored state.
    fn reload_live(&mut self) -> R<Vec<Id>> {
        let live = self.store.load_live_trees().map_err(|e| e.to_string())?;
        let mut roots = Vec::new();
        for snap in live {
            let root = snap
                .root()
                .map(|r| r.id.clone())
                .ok_or("a live tree without root")?;
            self.engine
                .restore(snap.clone())
                .map_err(|e| format!("live tree {root} does not restore: {e}"))?;
            if self.engine.snapshot(&root).as_ref() != Some(&snap) {
                return Err(format!("tree {root} reloaded differs from the stored one"));
            }
            roots.push(root);
        }
        check_all(&self.engine, &self.store, &mut self.history)
            .map_err(|e| format!("after reload: {e}"))?;
        Ok(roots)
    }

    // ----- the user -----

    fn snapshot(&mut self, t: usize) -> R<Option<TreeSnapshot>> {
        self.ensure_loaded(t)?;
        Ok(self.engine.snapshot(&self.trees[t].root))
    }

    fn user(&mut self, t: usize) -> R {
        if self.trees[t].deleted {
            return Ok(());
        }
        let Some(snap) = self.snapshot(t)? else {
            return Ok(());
        };
        let root = self.trees[t].root.clone();
        let active = snap.root().and_then(|r| r.active_turn_id.clone());
        match self.rng.below(10) {
            0..=2 => {
                self.trees[t].turns += 1;
                let turn = format!("{root}-t{}", self.trees[t].turns);
                self.feed(
                    t,
                    Input::Command(Command::Submit {
                        agent_session_id: root,
                        turn_id: turn.into(),
                        text: "continue".into(),
                    }),
                )
            }
            3 | 4 => {
                let Some(turn) = active else { return Ok(()) };
                self.trees[t].ops += 1;
                let op = format!("{root}-op{}", self.trees[t].ops);
                self.feed(
                    t,
                    Input::Command(Command::CancelTurn {
                        operation_id: op.into(),
                        agent_session_id: root,
                        turn_id: turn,
                    }),
                )
            }
            5 => {
                let kids: Vec<(Id, Id)> = snap
                    .sessions
                    .iter()
                    .filter(|s| s.kind() == SessionKind::Child)
                    .filter_map(|s| s.active_turn_id.clone().map(|t| (s.id.clone(), t)))
                    .collect();
                if kids.is_empty() {
                    return Ok(());
                }
                let (s, turn) = kids[self.rng.below(kids.len())].clone();
                self.trees[t].ops += 1;
                let op = format!("{root}-op{}", self.trees[t].ops);
                self.feed(
                    t,
                    Input::Command(Command::CancelTurn {
                        operation_id: op.into(),
                        agent_session_id: s,
                        turn_id: turn,
                    }),
                )
            }
            6..=8 => self.answer(t),
            _ => {
                let ids: Vec<Id> = snap
                    .sessions
                    .iter()
                    .filter(|s| s.deleted_at.is_none())
                    .map(|s| s.id.clone())
                    .collect();
                if ids.is_empty() {
                    return Ok(());
                }
                let s = ids[self.rng.below(ids.len())].clone();
                let is_root = s == root;
                let before = self.history.outbox_seen();
                self.feed(
                    t,
                    Input::Command(Command::DeleteSession {
                        agent_session_id: s.clone(),
                    }),
                )?;
                if is_root
                    && self.history.outbox_seen() > before
                    && self.store.session(&s).map_err(|e| e.to_string())?.is_none()
                {
                    self.trees[t].deleted = true;
                }
                Ok(())
            }
        }
    }

    fn answer(&mut self, t: usize) -> R {
        self.ensure_loaded(t)?;
        let pending = self.engine.pending_interactions(&self.trees[t].root);
        if pending.is_empty() {
            return Ok(());
        }
        let i = pending[self.rng.below(pending.len())].clone();
        let allow = !self.faults || !self.rng.chance(300);
        self.feed(
            t,
            Input::Command(Command::RespondInteraction {
                agent_session_id: i.agent_session_id,
                turn_id: i.turn_id,
                request_id: i.request_id,
                response: json!(if allow { "allow" } else { "deny" }),
            }),
        )
    }

    // ----- the scheduler -----

    /// The actions enabled now, as (tree, action) pairs.
    fn enabled(&self, users: bool) -> Vec<(usize, Action)> {
        let mut v = Vec::new();
        for (i, tree) in self.trees.iter().enumerate() {
            if !tree.link_less.is_empty() {
                v.push((i, Action::LinkLess));
            }
            if let Some(l) = &tree.link {
                if !l.up.is_empty() {
                    v.push((i, Action::Up));
                }
                if !l.down.is_empty() {
                    v.push((i, Action::Down));
                }
                if !l.requests.is_empty() {
                    v.push((i, Action::Request));
                }
                if l.provider.busy() {
                    v.push((i, Action::Work));
                }
                if l.timers.iter().any(|x| x.at <= self.now) {
                    v.push((i, Action::AdapterTimer));
                }
            }
            if users && !tree.deleted {
                v.push((i, Action::User));
            }
        }
        if self.timers.iter().any(|x| x.at <= self.now) {
            v.push((0, Action::EngineTimer));
        }
        v
    }

    fn next_timer(&self) -> Option<Millis> {
        self.trees
            .iter()
            .filter_map(|t| t.link.as_ref())
            .flat_map(|l| l.timers.iter().map(|x| x.at))
            .chain(self.timers.iter().map(|x| x.at))
            .min()
    }

    /// One scheduler step, then the engine's own index checks on every loaded tree and the outbox
    /// check. Returns false when nothing at all is left to do.
    fn step(&mut self, users: bool) -> R<bool> {
        let before = self.stats.inputs;
        let more = self.step_inner(users)?;
        if self.stats.inputs != before {
            // Per input, `feed` checked the changed tree against the store; here the engine's
            // own indexes on every loaded tree, and the outbox.
            let v = self.engine.check_invariants();
            if !v.is_empty() {
                return Err(format!("invariants (engine): {v:?}"));
            }
            self.history.observe_outbox(&self.store)?;
        }
        Ok(more)
    }

    fn step_inner(&mut self, users: bool) -> R<bool> {
        self.stats.steps += 1;
        self.now += self.rng.below(40) as Millis;
        if self.faults {
            // Rare faults at a commit boundary.
            // (A zero draw, which shrinking prefers, is "no fault".)
            match 999 - self.rng.below(1000) {
                0..=3 => return self.daemon_crash().map(|_| true),
                4..=7 => return self.engine_restart().map(|_| true),
                8..=10 => {
                    let t = self.rng.below(self.trees.len());
                    if self.trees[t].link.is_some() {
                        self.note(|| format!("provider of tree {t} exits"));
                        self.trees[t].link = None;
                        let root = self.trees[t].root.clone();
                        return self
                            .feed(
                                t,
                                Input::Runtime(RuntimeAnswer::ProviderExited {
                                    root_agent_session_id: root,
                                    error: "exit status 1".into(),
                                }),
                            )
                            .map(|_| true);
                    }
                }
                11..=30 => {
                    // Jump to the next timer even though other work is ready.
                    if let Some(at) = self.next_timer() {
                        self.now = self.now.max(at);
                    }
                }
                _ => {}
            }
        }
        let enabled = self.enabled(users);
        let busy: Vec<(usize, Action)> = enabled
            .iter()
            .copied()
            .filter(|(_, a)| *a != Action::User)
            .collect();
        let people: Vec<(usize, Action)> = enabled
            .iter()
            .copied()
            .filter(|(_, a)| *a == Action::User)
            .collect();
        let (t, action) = if busy.is_empty() {
            let timer = self.next_timer();
            if !people.is_empty() && (timer.is_none() || !self.rng.chance(300)) {
                people[self.rng.below(people.len())]
            } else if let Some(at) = timer {
                // Nothing ready: the clock jumps to the next timer.
                self.now = self.now.max(at);
                return Ok(true);
            } else {
                return Ok(false);
            }
        } else if !people.is_empty() && self.rng.chance(60) {
            people[self.rng.below(people.len())]
        } else {
            busy[self.rng.below(busy.len())]
        };
        self.act(t, action)?;
        Ok(true)
    }

    fn act(&mut self, t: usize, action: Action) -> R {
        let now = self.now;
        let faults = self.faults;
        match action {
            Action::User => self.user(t),
            Action::LinkLess => {
                // No provider process: the runtime answers what it cannot deliver.
                let Some(r) = self.trees[t].link_less.pop_front() else {
                    return Ok(());
                };
                match r {
                    ProviderRequest::Cancel { operation_id, .. } => self.feed(
                        t,
                        Input::Runtime(RuntimeAnswer::CancelFailed {
                            operation_id,
                            error: "no provider process".into(),
                        }),
                    ),
                    ProviderRequest::Guide {
                        agent_session_id,
                        turn_id,
                        ..
                    } => self.feed(
                        t,
                        Input::Runtime(RuntimeAnswer::GuideFailed {
                            agent_session_id,
                            turn_id,
                            error: "no provider process".into(),
                        }),
                    ),
                    _ => Ok(()),
                }
            }
            Action::Request => {
                let Some(l) = &mut self.trees[t].link else {
                    return Ok(());
                };
                let Some(msg) = l.requests.pop_front() else {
                    return Ok(());
                };
                if let Some(tr) = &mut self.trace {
                    let what = match &msg {
                        ToRuntime::Request(r) => {
                            format!("delivers {}", serde_json::to_string(r).unwrap_or_default())
                        }
                        ToRuntime::Dropped(e) => format!(
                            "tells the adapter the engine dropped {}",
                            serde_json::to_string(e).unwrap_or_default()
                        ),
                    };
                    tr.push(format!("# runtime {t} {what}"));
                }
                let Some(l) = &mut self.trees[t].link else {
                    return Ok(());
                };
                match (&mut l.adapter, msg) {
                    (Some(a), ToRuntime::Request(r)) => {
                        let out = a.on_request(now, &r);
                        self.absorb(t, out)
                    }
                    (Some(a), ToRuntime::Dropped(e)) => {
                        let out = a.on_dropped(now, &e);
                        self.absorb(t, out)
                    }
                    // The direct provider reads engine requests as they are, and answers a
                    // dropped callback itself.
                    (None, ToRuntime::Request(r)) => {
                        l.down
                            .push_back(serde_json::to_value(&r).map_err(|e| e.to_string())?);
                        Ok(())
                    }
                    (None, ToRuntime::Dropped(e)) => {
                        let v = serde_json::to_value(&e).map_err(|e| e.to_string())?;
                        l.down.push_back(json!({"type": "dropped", "event": v}));
                        Ok(())
                    }
                }
            }
            Action::Down => {
                let Some(l) = &mut self.trees[t].link else {
                    return Ok(());
                };
                let Some(msg) = l.down.pop_front() else {
                    return Ok(());
                };
                let lines = l.provider.receive(now, &msg, &mut self.rng);
                if let Some(tr) = &mut self.trace {
                    tr.push(format!("# {} {t} >> {msg}", self.trees[t].kind.name()));
                }
                if let Some(l) = &mut self.trees[t].link {
                    l.up.extend(lines);
                }
                Ok(())
            }
            Action::Work => {
                let Some(l) = &mut self.trees[t].link else {
                    return Ok(());
                };
                let lines = l.provider.step(now, &mut self.rng, faults);
                l.up.extend(lines);
                Ok(())
            }
            Action::Up => {
                let Some(l) = &mut self.trees[t].link else {
                    return Ok(());
                };
                let Some(msg) = l.up.pop_front() else {
                    return Ok(());
                };
                if let Some(tr) = &mut self.trace {
                    tr.push(format!("# {} {t} << {msg}", self.trees[t].kind.name()));
                }
                let Some(l) = &mut self.trees[t].link else {
                    return Ok(());
                };
                match &mut l.adapter {
                    Some(a) => match a.on_native(now, &msg) {
                        Ok(out) => self.absorb(t, out),
                        Err(err) => {
                            self.note(|| format!("adapter error (typed): {err}"));
                            Ok(())
                        }
                    },
                    None => {
                        let input: Input = serde_json::from_value(msg)
                            .map_err(|e| format!("direct provider wrote a bad input: {e}"))?;
                        self.feed(t, input)
                    }
                }
            }
            Action::AdapterTimer => {
                let Some(l) = &mut self.trees[t].link else {
                    return Ok(());
                };
                let Some(timer) = take_due(&mut l.timers, now, |x| x.at) else {
                    return Ok(());
                };
                let Some(a) = &mut l.adapter else {
                    return Ok(());
                };
                let out = a.on_timer(now, &timer.id);
                self.absorb(t, out)
            }
            Action::EngineTimer => {
                let Some(timer) = take_due(&mut self.timers, now, |x| x.at) else {
                    return Ok(());
                };
                let TimerId::CancelDeadline { operation_id } = &timer.timer;
                let root = self
                    .store
                    .cancel_operation(operation_id)
                    .map_err(|e| e.to_string())?
                    .map(|o| o.root_agent_session_id);
                let Some(t) = root.and_then(|r| self.tree_of.get(&r).copied()) else {
                    return Ok(());
                };
                self.feed(
                    t,
                    Input::Runtime(RuntimeAnswer::TimerFired { timer: timer.timer }),
                )
            }
        }
    }

    /// The liveness verdict: every stored tree settled, nothing prepared or pending.
    fn settled(&self) -> R {
        for tree in &self.trees {
            let Some(snap) = self
                .store
                .load_tree(&tree.root)
                .map_err(|e| e.to_string())?
            else {
                continue;
            };
            let open = unsettled(&snap);
            if !open.is_empty() {
                return Err(format!(
                    "liveness: tree {} did not settle: {open:?}",
                    tree.root
                ));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    User,
    LinkLess,
    Request,
    Down,
    Work,
    Up,
    AdapterTimer,
    EngineTimer,
}

/// Runs one seed (or replays a tape). `trace` records every engine input.
pub fn run(
    seed: u64,
    tape: Option<Vec<u64>>,
    trace: bool,
) -> (Result<Stats, String>, Vec<u64>, Vec<String>) {
    let rng = match tape {
        Some(t) => Rng::replay(t),
        None => Rng::new(seed),
    };
    let every = std::env::var("TUTTI_SIM_SQLITE_EVERY")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(SQLITE_EVERY)
        .max(1);
    let sqlite = seed.checked_rem(every) == Some(0);
    let store = if sqlite {
        match SimStore::sqlite() {
            Ok(s) => s,
            Err(e) => {
                return (
                    Err(format!("cannot create the database: {e}")),
                    Vec::new(),
                    Vec::new(),
                )
            }
        }
    } else {
        SimStore::Memory(MemoryStore::new())
    };
    let mut w = World {
        rng,
        now: 1_000,
        engine: Engine::new(),
        store,
        history: History::new(),
        trees: Vec::new(),
        tree_of: BTreeMap::new(),
        timers: Vec::new(),
        faults: true,
        stats: Stats {
            sqlite,
            ..Stats::default()
        },
        trace: trace.then(Vec::new),
    };
    let result = simulate(&mut w);
    let stats = w.stats;
    (
        result.map(|_| stats),
        w.rng.tape,
        w.trace.unwrap_or_default(),
    )
}

fn simulate(w: &mut World) -> R {
    let n = w.rng.range(1, 3);
    for i in 0..n {
        let kind = KINDS[w.rng.below(KINDS.len())];
        let guide = !w.rng.chance(200);
        let root: Id = format!("r{i}").into();
        w.tree_of.insert(root.clone(), i);
        w.trees.push(TreeSim {
            root: root.clone(),
            kind,
            incarnation: 0,
            link: None,
            turns: 1,
            ops: 0,
            deleted: false,
            link_less: VecDeque::new(),
        });
        w.feed(
            i,
            Input::Command(Command::CreateSession {
                agent_session_id: root.clone(),
                workspace_id: "w".into(),
                provider: kind.name().into(),
                title: None,
                capabilities: Some(tutti_core::model::Capabilities {
                    guide_while_children_only: guide,
                }),
            }),
        )?;
        w.feed(
            i,
            Input::Command(Command::Submit {
                agent_session_id: root.clone(),
                turn_id: format!("{root}-t1").into(),
                text: "go".into(),
            }),
        )?;
    }
    let safety = w.rng.range(40, 140);
    for _ in 0..safety {
        if !w.step(true)? {
            break;
        }
    }
    // Liveness: faults off, the user only answers interactions.
    w.faults = false;
    w.note(|| "liveness phase: faults off".into());
    for tree in &mut w.trees {
        if let Some(l) = &mut tree.link {
            l.provider.calm();
        }
    }
    for _ in 0..LIVENESS_STEPS {
        let mut progressed = w.step(false)?;
        // Answer every pending interaction (allow), one per step.
        for t in 0..w.trees.len() {
            if w.trees[t].deleted {
                continue;
            }
            let before = w.stats.inputs;
            w.answer(t)?;
            progressed |= w.stats.inputs > before;
        }
        if !progressed {
            return w.settled();
        }
    }
    w.settled()?;
    Err(format!("liveness: still busy after {LIVENESS_STEPS} steps"))
}

/// Runs a seed; on failure shrinks its tape and replays the shortest failing run with a trace.
pub fn check_seed(seed: u64) -> Result<Stats, (Failure, Vec<String>)> {
    let (r, tape, _) = run(seed, None, false);
    let Err(message) = r else {
        return Ok(r.unwrap_or_default());
    };
    let small = shrink(seed, tape, &message);
    let (r2, tape2, trace) = run(seed, Some(small.clone()), true);
    let message = r2.err().unwrap_or(message);
    Err((
        Failure {
            message,
            tape: tape2,
        },
        trace,
    ))
}

/// The rule a message names (its text before the first id-bearing detail), to keep shrinking on
/// the same failure.
fn rule_of(m: &str) -> String {
    m.split(|c: char| c.is_ascii_digit())
        .next()
        .unwrap_or(m)
        .to_string()
}

/// Deletes chunks of the tape and zeroes draws while the run still fails the same way.
pub fn shrink(seed: u64, mut tape: Vec<u64>, message: &str) -> Vec<u64> {
    let rule = rule_of(message);
    let secs = std::env::var("TUTTI_SIM_SHRINK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let fails = |t: &Vec<u64>| -> bool {
        let (r, _, _) = run(seed, Some(t.clone()), false);
        matches!(r, Err(m) if rule_of(&m) == rule)
    };
    let mut chunk = tape.len().max(1).next_power_of_two();
    while chunk >= 1 && std::time::Instant::now() < deadline {
        let mut i = 0;
        let mut improved = false;
        while i < tape.len() && std::time::Instant::now() < deadline {
            let mut cand = tape.clone();
            cand.drain(i..(i + chunk).min(cand.len()));
            if fails(&cand) {
                tape = cand;
                improved = true;
                continue;
            }
            let mut zeroed = tape.clone();
            let mut changed = false;
            for v in zeroed.iter_mut().skip(i).take(chunk) {
                changed |= *v != 0;
                *v = 0;
            }
            if changed && fails(&zeroed) {
                tape = zeroed;
                improved = true;
            }
            i += chunk;
        }
        if !improved {
            chunk /= 2;
        }
    }
    while tape.last() == Some(&0) {
        tape.pop();
    }
    tape
}
