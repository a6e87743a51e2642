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

use tutti_testkit::{check_all, unsettled, History};

use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
use tutti_core::adapters::Adapter;
use tutti_core::driver::{BatchId, Driver, DriverInput, LaunchSpec, Output, Record, Testkit};
use tutti_core::input::{Command, Input};
use tutti_core::model::{
    CancelOperation, Id, Interaction, Message, Millis, Session, SessionKind, Turn,
};
use tutti_core::projection::SessionDetail;
use tutti_core::step::PersistBatch;
use tutti_core::store::{HostStore, MemoryStore, OutboxRow, Store};
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
    /// A line the runtime wrote (native JSON; for the direct provider a
    /// [`ProviderRequest`](tutti_core::step::ProviderRequest)).
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

/// One live provider process and its pipes (its adapter lives in the driver).
struct Link {
    provider: Box<dyn Provider>,
    /// Runtime -> provider.
    down: VecDeque<Value>,
    /// Provider -> runtime.
    up: VecDeque<Value>,
}

struct TreeSim {
    root: Id,
    kind: Kind,
    incarnation: u32,
    link: Option<Link>,
    turns: u32,
    ops: u32,
    created: bool,
    deleted: bool,
}

fn new_provider(kind: Kind, root: &Id, incarnation: u32, rng: &mut Rng) -> Box<dyn Provider> {
    let tag = format!("{root}i{incarnation}");
    match kind {
        Kind::Direct => Box::new(direct::DirectProvider::new(root.clone(), tag, rng)),
        Kind::Acp => Box::new(acp::AcpAgent::new(tag, rng)),
        Kind::Codex => Box::new(codex::CodexServer::new(tag, rng)),
        Kind::Claude => Box::new(claude::ClaudeSidecar::new(tag, rng)),
    }
}

/// The adapter of a provider kind: the driver's factory, as the daemon's.
fn new_adapter(kind: Kind, root: &Id) -> Box<dyn Adapter> {
    match kind {
        Kind::Direct => Box::new(direct::DirectAdapter),
        Kind::Acp => Box::new(AcpAdapter::new(root.clone(), AcpConfig::default())),
        Kind::Codex => codex::adapter(root),
        Kind::Claude => claude::adapter(root),
    }
}

fn kind_of(provider: &str) -> Option<Kind> {
    KINDS.iter().copied().find(|k| k.name() == provider)
}

/// A driver around `engine` that makes each launched root's adapter by provider kind and records
/// what it does (for the trace).
fn new_driver(engine: Engine) -> Driver {
    let mut d = Driver::with_engine(engine);
    d.set_recording(true);
    d.set_factory(Box::new(|spec: &LaunchSpec| {
        kind_of(&spec.provider).map(|k| new_adapter(k, &spec.root))
    }));
    d
}

impl tutti_core::driver::Trees for SimStore {
    fn root_of(&self, session: &str) -> Option<Id> {
        match self {
            SimStore::Memory(m) => HostStore::root_of(m, session).ok().flatten(),
            SimStore::Sqlite { db: Some(d), .. } => HostStore::root_of(d, session).ok().flatten(),
            SimStore::Sqlite { db: None, .. } => None,
        }
    }
    fn root_of_operation(&self, operation: &str) -> Option<Id> {
        match self {
            SimStore::Memory(m) => m.root_of_cancel_operation(operation).ok().flatten(),
            SimStore::Sqlite { db: Some(d), .. } => {
                d.root_of_cancel_operation(operation).ok().flatten()
            }
            SimStore::Sqlite { db: None, .. } => None,
        }
    }
    fn load_tree(&self, root: &str) -> Option<TreeSnapshot> {
        Store::load_tree(self, root).ok().flatten()
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

/// The daemon is the [`Driver`] plus what the simulation plays: the provider processes and
/// their pipes, the store (commits are a scheduler action of their own, so provider lines and
/// user commands reach the driver between a decision and its commit, as with the daemon's group
/// commits), the clock and the user.
struct World {
    rng: Rng,
    now: Millis,
    driver: Driver,
    /// Batches the driver handed out ([`Output::Persist`]) and not committed yet, in order.
    persist: VecDeque<BatchId>,
    store: SimStore,
    history: History,
    trees: Vec<TreeSim>,
    tree_of: BTreeMap<Id, usize>,
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

    /// A host input for the driver (decided now, committed by a later [`World::commit`]).
    fn feed(&mut self, input: Input) -> R {
        let _ = self.driver.handle(
            DriverInput::Host {
                now: self.now,
                input,
                reply: None,
            },
            &self.store,
        );
        self.after();
        Ok(())
    }

    /// Carries out what the driver released (a launch starts a provider process, a transmit
    /// goes down its pipe) and notes what it decided.
    fn after(&mut self) {
        while let Some(o) = self.driver.poll_output() {
            match o {
                Output::Persist(id) => self.persist.push_back(id),
                Output::Launch(spec) => {
                    let Some(&t) = self.tree_of.get(&spec.root) else {
                        continue;
                    };
                    let tree = &mut self.trees[t];
                    tree.incarnation += 1;
                    let mut provider =
                        new_provider(tree.kind, &tree.root, tree.incarnation, &mut self.rng);
                    if !self.faults {
                        // Launched during the liveness phase: no hanging work from the start.
                        provider.calm();
                    }
                    tree.link = Some(Link {
                        provider,
                        down: VecDeque::new(),
                        up: VecDeque::new(),
                    });
                    let n = self.trees[t].incarnation;
                    self.note(|| format!("runtime {t} starts provider incarnation {n}"));
                }
                Output::Transmit(tx) => {
                    let Some(&t) = self.tree_of.get(&tx.root) else {
                        continue;
                    };
                    if let Some(l) = &mut self.trees[t].link {
                        l.down.extend(tx.messages);
                    }
                }
                Output::Publish(_) | Output::Reply { .. } | Output::Diagnostic(_) => {}
            }
        }
        for r in self.driver.take_records() {
            match r {
                Record::Decided { input, outcome } => {
                    self.stats.inputs += 1;
                    if let Some(tr) = &mut self.trace {
                        tr.push(json!({"at": self.now, "input": input}).to_string());
                        if let Err(e) = outcome {
                            tr.push(format!("# rejected: {e}"));
                        }
                    }
                }
                Record::Dropped { root, event } => self.note(|| {
                    format!(
                        "runtime of {root} tells the adapter the engine dropped {}",
                        serde_json::to_string(&event).unwrap_or_default()
                    )
                }),
                Record::Adapter { .. } => {}
            }
        }
    }

    /// Commits every decided batch in order (each acknowledged, which releases what it caused),
    /// until none is left; then every check. With faults, the daemon may die before a commit,
    /// which loses every batch not committed yet.
    fn commit(&mut self, may_crash: bool) -> R {
        loop {
            self.after();
            let Some(id) = self.persist.pop_front() else {
                break;
            };
            if may_crash && self.faults && self.rng.chance(3) {
                self.note(|| "crash before a commit: the batches not committed are lost".into());
                return self.daemon_crash();
            }
            if let Some(batch) = self.driver.batch(id) {
                if let Err(err) = self.store.apply(batch) {
                    return Err(format!(
                        "the store refused a batch of its only writer: {err}"
                    ));
                }
                let committed = DriverInput::Committed {
                    batch: id,
                    published: Vec::new(),
                };
                let _ = self.driver.handle(committed, &self.store);
            }
        }
        check_all(self.driver.engine(), &self.store, &mut self.history)
            .map_err(|e| format!("after a commit: {e}"))?;
        for t in 0..self.trees.len() {
            let tree = &self.trees[t];
            if tree.created
                && !tree.deleted
                && self
                    .store
                    .session(&tree.root)
                    .map_err(|e| e.to_string())?
                    .is_none()
            {
                self.trees[t].deleted = true;
            }
        }
        Ok(())
    }

    // ----- crashes -----

    /// The daemon dies: driver (engine, adapters, timers, undecided work) and provider
    /// processes. On restart the file is reopened, live trees are reloaded and settled with
    /// `providerExited` (their processes are gone).
    fn daemon_crash(&mut self) -> R {
        self.stats.crashes += 1;
        self.note(|| {
            "daemon crash: driver, runtimes and providers dropped; reload from the store".into()
        });
        for tree in &mut self.trees {
            tree.link = None;
        }
        self.store.reopen()?;
        let (engine, live) = self.reload_live()?;
        self.driver = new_driver(engine);
        self.persist.clear();
        for root in live {
            let _ = self.driver.handle(
                DriverInput::Exit {
                    now: self.now,
                    root: &root,
                    error: "the daemon restarted; the provider process is gone",
                },
                &self.store,
            );
            self.after();
        }
        Ok(())
    }

    /// The driver's in-memory trees are dropped and reloaded from the store while the runtimes
    /// (adapters, timers, provider processes) survive (crash-only recovery of the engine state).
    /// Only with nothing waiting for a commit.
    fn engine_reload(&mut self) -> R {
        if self.driver.is_busy() {
            return Ok(());
        }
        self.stats.crashes += 1;
        self.note(|| "engine state reloaded from the store; runtimes kept".into());
        for root in self.driver.engine().roots() {
            if !self.driver.reload(&root, &self.store) {
                return Err(format!("stored tree {root} does not reload"));
            }
            let stored = Store::load_tree(&self.store, &root).map_err(|e| e.to_string())?;
            if self.driver.engine().snapshot(&root) != stored {
                return Err(format!("tree {root} reloaded differs from the stored one"));
            }
        }
        check_all(self.driver.engine(), &self.store, &mut self.history)
            .map_err(|e| format!("after reload: {e}"))
    }

    /// An engine with every live tree restored; checks that the reloaded state equals the stored
    /// state.
    fn reload_live(&mut self) -> R<(Engine, Vec<Id>)> {
        let live = self.store.load_live_trees().map_err(|e| e.to_string())?;
        let mut engine = Engine::with_config(EngineConfig::default());
        let mut roots = Vec::new();
        for snap in live {
            let root = snap
                .root()
                .map(|r| r.id.clone())
                .ok_or("a live tree without root")?;
            engine
                .restore(snap.clone())
                .map_err(|e| format!("live tree {root} does not restore: {e}"))?;
            if engine.snapshot(&root).as_ref() != Some(&snap) {
                return Err(format!("tree {root} reloaded differs from the stored one"));
            }
            roots.push(root);
        }
        check_all(&engine, &self.store, &mut self.history)
            .map_err(|e| format!("after reload: {e}"))?;
        Ok((engine, roots))
    }

    // ----- the user -----

    fn snapshot(&mut self, t: usize) -> R<Option<TreeSnapshot>> {
        let root = &self.trees[t].root;
        match self.driver.engine().snapshot(root) {
            Some(s) => Ok(Some(s)),
            None => Store::load_tree(&self.store, root).map_err(|e| e.to_string()),
        }
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
                self.feed(Input::Command(Command::Submit {
                    agent_session_id: root,
                    turn_id: turn.into(),
                    text: "continue".into(),
                }))
            }
            3 | 4 => {
                let Some(turn) = active else { return Ok(()) };
                self.trees[t].ops += 1;
                let op = format!("{root}-op{}", self.trees[t].ops);
                self.feed(Input::Command(Command::CancelTurn {
                    operation_id: op.into(),
                    agent_session_id: root,
                    turn_id: turn,
                }))
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
                self.feed(Input::Command(Command::CancelTurn {
                    operation_id: op.into(),
                    agent_session_id: s,
                    turn_id: turn,
                }))
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
                // A deleted root is marked once its deletion is committed (`commit`).
                let s = ids[self.rng.below(ids.len())].clone();
                self.feed(Input::Command(Command::DeleteSession {
                    agent_session_id: s,
                }))
            }
        }
    }

    fn answer(&mut self, t: usize) -> R {
        let pending = self
            .driver
            .engine()
            .pending_interactions(&self.trees[t].root);
        if pending.is_empty() {
            return Ok(());
        }
        let i = pending[self.rng.below(pending.len())].clone();
        let allow = !self.faults || !self.rng.chance(300);
        self.feed(Input::Command(Command::RespondInteraction {
            agent_session_id: i.agent_session_id,
            turn_id: i.turn_id,
            request_id: i.request_id,
            response: json!(if allow { "allow" } else { "deny" }),
        }))
    }

    // ----- the scheduler -----

    /// The actions enabled now, as (tree, action) pairs.
    fn enabled(&self, users: bool) -> Vec<(usize, Action)> {
        let mut v = Vec::new();
        for (i, tree) in self.trees.iter().enumerate() {
            if let Some(l) = &tree.link {
                if !l.up.is_empty() {
                    v.push((i, Action::Up));
                }
                if !l.down.is_empty() {
                    v.push((i, Action::Down));
                }
                if l.provider.busy() {
                    v.push((i, Action::Work));
                }
            }
            if users && !tree.deleted {
                v.push((i, Action::User));
            }
        }
        if self.driver.is_busy() {
            v.push((0, Action::Commit));
        }
        if self.driver.poll_timeout().is_some_and(|at| at <= self.now) {
            v.push((0, Action::Timer));
        }
        v
    }

    /// One scheduler step, then the engine's own index checks and the outbox check. Returns false
    /// when nothing at all is left to do.
    fn step(&mut self, users: bool) -> R<bool> {
        let before = self.stats.inputs;
        let more = self.step_inner(users)?;
        if self.stats.inputs != before {
            let v = self.driver.engine().check_invariants();
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
            // Rare faults. (A zero draw, which shrinking prefers, is "no fault".)
            match 999 - self.rng.below(1000) {
                0..=3 => return self.daemon_crash().map(|_| true),
                4..=7 => return self.engine_reload().map(|_| true),
                8..=10 => {
                    let t = self.rng.below(self.trees.len());
                    if self.trees[t].link.is_some() {
                        self.note(|| format!("provider of tree {t} exits"));
                        self.trees[t].link = None;
                        let root = self.trees[t].root.clone();
                        let _ = self.driver.handle(
                            DriverInput::Exit {
                                now: self.now,
                                root: &root,
                                error: "exit status 1",
                            },
                            &self.store,
                        );
                        self.after();
                        return Ok(true);
                    }
                }
                11..=30 => {
                    // Jump to the next timer even though other work is ready.
                    if let Some(at) = self.driver.poll_timeout() {
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
            let timer = self.driver.poll_timeout();
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
            Action::Commit => self.commit(true),
            Action::Timer => {
                let _ = self.driver.handle(DriverInput::Timeout(now), &self.store);
                self.after();
                Ok(())
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
                let root = self.trees[t].root.clone();
                match self.driver.handle(
                    DriverInput::Native {
                        now,
                        root: &root,
                        message: &msg,
                    },
                    &self.store,
                ) {
                    Ok(()) => {}
                    Err(err) => self.note(|| format!("adapter error (typed): {err}")),
                }
                self.after();
                Ok(())
            }
        }
    }

    /// The liveness verdict: every stored tree settled, nothing prepared or pending.
    fn settled(&self) -> R {
        for tree in &self.trees {
            let Some(snap) =
                Store::load_tree(&self.store, &tree.root).map_err(|e| e.to_string())?
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
    Commit,
    Timer,
    Down,
    Work,
    Up,
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
        driver: new_driver(Engine::new()),
        persist: VecDeque::new(),
        store,
        history: History::new(),
        trees: Vec::new(),
        tree_of: BTreeMap::new(),
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
            created: false,
            deleted: false,
        });
        w.feed(Input::Command(Command::CreateSession {
            agent_session_id: root.clone(),
            workspace_id: "w".into(),
            provider: kind.name().into(),
            title: None,
            capabilities: Some(tutti_core::model::Capabilities {
                guide_while_children_only: guide,
            }),
        }))?;
        w.feed(Input::Command(Command::Submit {
            agent_session_id: root.clone(),
            turn_id: format!("{root}-t1").into(),
            text: "go".into(),
        }))?;
    }
    w.commit(false)?;
    for tree in &mut w.trees {
        tree.created = true;
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
