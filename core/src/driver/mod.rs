//! [`Driver`]: the engine, one adapter per live root and every timer, as one sans-I/O machine.
//!
//! A host (the daemon, a replay, an embedding application) feeds the driver what happened and
//! carries out what the driver asks for, through one input enum and one output enum (as str0m's
//! `Input` and `Output`):
//!
//! - [`Driver::handle`] takes a [`DriverInput`]: a provider's native message or line, a host
//!   command (`submit`, `cancelTurn`, ...) with an optional [`ReplyTo`] token, a provider
//!   attached or gone, a failed write, the clock reaching [`Driver::poll_timeout`], and what
//!   became of each batch ([`DriverInput::Committed`] / [`DriverInput::NotCommitted`]). Time
//!   comes in the inputs that carry it; the driver never reads a clock.
//! - [`Driver::poll_output`] gives an [`Output`]: [`Output::Persist`] a batch to make durable
//!   (read it with [`Driver::batch`]; the host may gather several and commit them as one
//!   group), then what committed batches released: [`Output::Launch`] a provider process,
//!   [`Output::Transmit`] native messages to it, [`Output::Publish`] committed outbox rows,
//!   [`Output::Reply`] to a host command, [`Output::Diagnostic`] something to log;
//! - [`Driver::poll_timeout`]: the next deadline.
//!
//! Errors: [`DriverError`] is the one error a host matches on. Bad input
//! ([`DriverError::Rejected`], [`DriverError::Adapter`]), a conflict with another writer
//! ([`DriverError::Refused`]), an unreachable store ([`DriverError::Unavailable`]) and any
//! other store failure ([`DriverError::Storage`]) stay distinct, so a daemon can answer them
//! 4xx, 409, 503 and 500.
//!
//! Test rigs get more hooks (recording what passed between the adapters and the engine,
//! direct adapter access, a store-only host loop) from `Testkit`, behind the `testkit`
//! feature.
//!
//! ## The host loop
//!
//! ```
//! use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
//! use tutti_core::driver::{CommitFailure, Driver, DriverInput, Output};
//! use tutti_core::store::{HostStore, MemoryStore, Store};
//! use tutti_core::{Command, Input};
//!
//! let (mut driver, mut store, mut now) = (Driver::new(), MemoryStore::new(), 1_000);
//! let create = Command::CreateSession { agent_session_id: "root".into(), workspace_id: "W".into(),
//!     provider: "acp".into(), title: None, capabilities: None };
//! let submit = Command::Submit { agent_session_id: "root".into(), turn_id: "t1".into(), text: "hi".into() };
//! let host = |input, reply| DriverInput::Host { now, input: Input::Command(input), reply };
//! driver.handle(host(create, None), &store).ok();
//! driver.handle(host(submit, Some(1)), &store).ok(); // 1: our reply token
//! let (mut written, mut replies) = (Vec::new(), Vec::new());
//! loop {
//!     // 1. Carry out what the driver asks for, in order; gather the batches to make durable.
//!     let mut persist = Vec::new();
//!     while let Some(out) = driver.poll_output() {
//!         match out {
//!             Output::Persist(id) => persist.push(id),
//!             Output::Launch(spec) => { // start the provider process here, then:
//!                 let adapter = Box::new(AcpAdapter::new(spec.root.clone(), AcpConfig::default()));
//!                 driver.handle(DriverInput::Attach { now, root: spec.root, adapter }, &store).ok();
//!             }
//!             Output::Transmit(t) => written.extend(t.messages), // write to t.root's provider
//!             Output::Publish(p) => { /* hand p.rows to outbox followers */ }
//!             Output::Reply { to, result } => replies.push((to, result.is_ok())),
//!             Output::Diagnostic(d) => { /* log it: ids and kinds only */ let _ = d; }
//!         }
//!     }
//!     // 2. Make the gathered batches durable as one group, then report each.
//!     if !persist.is_empty() {
//!         let batches: Vec<_> = persist.iter().filter_map(|id| driver.batch(*id)).collect();
//!         let results: Vec<DriverInput> = match store.apply_group(&batches, true) {
//!             Ok(rows) => persist.into_iter().zip(rows)
//!                 .map(|(batch, published)| DriverInput::Committed { batch, published }).collect(),
//!             Err(e) => persist.into_iter()
//!                 .map(|batch| DriverInput::NotCommitted { batch, why: CommitFailure::Failed(e.to_string()) })
//!                 .collect(),
//!         };
//!         for r in results { driver.handle(r, &store).ok(); }
//!         continue;
//!     }
//!     // 3. Wait for a provider line, a command, an exit or the deadline; here: only the
//!     //    deadline, and stop once idle.
//!     match driver.poll_timeout() {
//!         Some(at) if !driver.is_busy() && at < now + 60_000 => {
//!             now = at;
//!             driver.handle(DriverInput::Timeout(now), &store).ok();
//!         }
//!         _ => break,
//!     }
//! }
//! assert_eq!(replies, [(1, true)]);
//! assert_eq!(written[0]["method"], "initialize"); // the ACP handshake went out
//! assert!(store.session("root").unwrap().is_some());
//! ```
//!
//! ## What the driver guarantees
//!
//! - **Nothing caused by a batch leaves the driver before that batch is acknowledged**: the
//!   provider requests of a step (and the adapter calls they make), its timers, its outbox rows
//!   and its reply are held in decision order until every batch decided before them is
//!   acknowledged. A step without rows waits behind the batches decided before it.
//! - An adapter's events reach the engine before its answers (`cancelResult`, ...).
//! - An `interactionRequested` the engine did not take (rejected, ignored, or its batch was not
//!   committed) goes back to the adapter that emitted it ([`Adapter::on_dropped`]), so the
//!   provider never hangs.
//! - Engine requests go to the adapter of their tree; a `Start` for a root without a live
//!   adapter launches one ([`Output::Launch`]); a `cancel` or `guide` for a root without one is
//!   answered `cancelFailed` / `guideFailed` ("no live provider runtime").
//! - Before a `cancelTurn`, the root's adapter flushes the text it buffered
//!   ([`Adapter::flush_text`], issue 23: "Flush buffered text before the cancel settles the
//!   turn").
//! - A failed commit drops that tree from memory and reloads it from the store; later batches of
//!   the same tree that were decided on the lost state are not committed (they answer
//!   [`DriverError::Storage`]).
//! - An evicted tree is loaded on demand ([`Trees`]) when an input names one of its sessions or
//!   cancel operations; [`Driver::root_of`] maps any session (child or root) to its root.
//!
//! ## What the host still owns
//!
//! The clock (`now` on every call), the store (commits, and [`Trees`] to read trees back), the
//! provider processes (start on [`Output::Launch`], write [`Output::Transmit`], report lines,
//! write failures and exits), publishing outbox rows, and its own policies (when to evict a
//! quiescent tree with [`Driver::evict`], when to stop an idle provider with [`Driver::detach`]).
//!
//! Design choice (issue 19: "give the driver a way to get the tree"): the host passes a
//! [`Trees`] reader (every [`HostStore`] is one) to the calls that may need to load a tree, so
//! an input is decided at once and in order, instead of parking it behind a "load tree" output.

mod record;
mod testkit;
mod timers;

pub use record::Record;
#[cfg(not(feature = "testkit"))]
pub(crate) use testkit::Testkit;
#[cfg(feature = "testkit")]
pub use testkit::Testkit;
pub use timers::Timer;

use crate::adapters::{parse_line, Adapter, AdapterError, AdapterOutput};
use crate::engine::{Engine, EngineConfig};
use crate::error::Rejected;
use crate::hash::FxMap;
use crate::input::{Command, Input, NormalizedEvent, RuntimeAnswer};
use crate::model::{Id, Millis};
use crate::snapshot::TreeSnapshot;
use crate::step::{PersistBatch, ProviderRequest, Step};
use crate::store::{HostStore, Published};
use serde_json::Value;
use std::collections::VecDeque;
use thiserror::Error;
use timers::TimerQueue;

/// A host's token for the reply to one input (echoed in [`Output::Reply`]).
pub type ReplyTo = u64;

/// Identifies one batch handed out as [`Output::Persist`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(u64);

/// Everything a host tells the driver, as one enum (as str0m's `Input`): what happened at the
/// time each variant carries, and what became of the batches it was handed
/// ([`Output::Persist`]). See [`Driver::handle`].
#[allow(clippy::large_enum_variant)] // moved in once per input; boxing would allocate per command
pub enum DriverInput<'a> {
    /// A root's provider process is ready: its adapter (after [`Output::Launch`], or before the
    /// root's first turn). Opens it (its handshake becomes a [`Transmit`]) and hands it the
    /// requests that waited for it.
    Attach {
        /// The time.
        now: Millis,
        /// The root.
        root: Id,
        /// Its adapter.
        adapter: Box<dyn Adapter>,
    },
    /// One native message from a root's provider. A message the adapter cannot use is a typed
    /// error and changes nothing.
    Native {
        /// The time.
        now: Millis,
        /// The root whose provider sent it.
        root: &'a str,
        /// The message.
        message: &'a Value,
    },
    /// One line of a line-based provider ([`DriverInput::Native`] after [`parse_line`]).
    Line {
        /// The time.
        now: Millis,
        /// The root whose provider wrote it.
        root: &'a str,
        /// The line.
        line: &'a str,
    },
    /// A host command (or any engine input). Its [`Output::Reply`] (when `reply` is given)
    /// comes once its batch is committed.
    Host {
        /// The time.
        now: Millis,
        /// The input.
        input: Input,
        /// The host's token for the reply.
        reply: Option<ReplyTo>,
    },
    /// A root's provider process is gone (or could not be started): its adapter and timers are
    /// dropped and the engine is told (`providerExited`).
    Exit {
        /// The time.
        now: Millis,
        /// The root.
        root: &'a str,
        /// Why (ids and kinds only).
        error: &'a str,
    },
    /// Writing a [`Transmit`] that carried `failure` failed.
    WriteFailed {
        /// The time.
        now: Millis,
        /// What the write carried.
        failure: WriteFailure,
        /// Why.
        error: &'a str,
    },
    /// The clock reached this time (see [`Driver::poll_timeout`]): every engine and adapter
    /// timer due fires, earliest first.
    Timeout(Millis),
    /// A batch is durable; `published` are the outbox rows the store wrote for it.
    Committed {
        /// The batch.
        batch: BatchId,
        /// Its outbox rows.
        published: Vec<Published>,
    },
    /// A batch was not committed: its tree is dropped from memory and reloaded from the store,
    /// and the later batches of that tree (decided on the lost state) are not to be committed.
    NotCommitted {
        /// The batch.
        batch: BatchId,
        /// Why: what its caller (and the callers of the tree's later batches) are answered.
        why: CommitFailure,
    },
    /// Calls the adapter of a live root with something outside the [`Adapter`] trait (for
    /// example the Codex adapter's `attach_root_thread`) and carries out the output it returns
    /// like any other adapter output. `Err(NoAdapter)` when the root has no live adapter.
    Call {
        /// The time.
        now: Millis,
        /// The root.
        root: &'a str,
        /// The call.
        call: AdapterCall<'a>,
    },
}

/// A call into one adapter ([`DriverInput::Call`]).
pub type AdapterCall<'a> = Box<dyn FnOnce(&mut dyn Adapter, Millis) -> AdapterOutput + 'a>;

/// Why a batch was not committed ([`DriverInput::NotCommitted`]): the three kinds a host tells
/// apart, each answered as its own [`DriverError`] all the way to the host's callers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitFailure {
    /// Any other store error: the caller gets [`DriverError::Storage`].
    Failed(String),
    /// The store refused the batch by a guard or the fence (see
    /// [`HostStore::is_guard_failure`] and [`HostStore::is_fenced`]): the caller, and the
    /// callers of the tree's later batches, get [`DriverError::Refused`].
    Refused,
    /// The store could not be reached ([`HostStore::is_unavailable`]): the caller, and the
    /// callers of the tree's later batches, get [`DriverError::Unavailable`].
    Unavailable(String),
}

impl std::fmt::Debug for DriverInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Kinds and ids only: never a message's content.
        match self {
            DriverInput::Attach { root, .. } => write!(f, "Attach({root})"),
            DriverInput::Native { root, .. } => write!(f, "Native({root})"),
            DriverInput::Line { root, line, .. } => write!(f, "Line({root}, {} bytes)", line.len()),
            DriverInput::Host { input, .. } => write!(f, "Host({})", input.kind()),
            DriverInput::Exit { root, .. } => write!(f, "Exit({root})"),
            DriverInput::WriteFailed { failure, .. } => write!(f, "WriteFailed({failure:?})"),
            DriverInput::Timeout(at) => write!(f, "Timeout({at})"),
            DriverInput::Committed { batch, .. } => write!(f, "Committed({batch:?})"),
            DriverInput::NotCommitted { batch, why } => {
                write!(f, "NotCommitted({batch:?}, {why:?})")
            }
            DriverInput::Call { root, .. } => write!(f, "Call({root})"),
        }
    }
}

/// Why an input got no step.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DriverError {
    /// The engine refused the input; nothing changed.
    #[error(transparent)]
    Rejected(#[from] Rejected),
    /// The input's batch was not committed (nothing of it was written); its tree was reloaded.
    #[error("storage: {0}")]
    Storage(String),
    /// The store refused the input's batch because another writer changed the tree first (a
    /// version guard) or this host lost the tree (a fence); nothing of it was written, and the
    /// tree was reloaded. The input may be retried (see [`CommitFailure::Refused`]).
    #[error("the store refused the batch: the tree changed or this host no longer owns it")]
    Refused,
    /// The input's batch was not committed because the store could not be reached (nothing of
    /// it was written, or, for [`CommitFailure::Unavailable`] with an unknown outcome, the
    /// tree's state is whatever the store holds once reachable): retry later (see
    /// [`crate::store::HostStore::is_unavailable`]).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A native message the adapter cannot use (dropped; nothing changed).
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// A native message for a root without a live adapter (dropped).
    #[error("no live adapter for root {0}")]
    NoAdapter(Id),
}

/// Reads trees back from the store: to load an evicted tree on demand, and to reload a tree
/// after a failed commit. Every [`HostStore`] is one; a read error counts as "not found".
pub trait Trees {
    /// The root of the tree a session belongs to.
    fn root_of(&self, session: &str) -> Option<Id>;
    /// The root of the tree a cancel operation belongs to.
    fn root_of_operation(&self, operation: &str) -> Option<Id>;
    /// One whole tree.
    fn load_tree(&self, root: &str) -> Option<TreeSnapshot>;
}

impl<S: HostStore> Trees for S {
    fn root_of(&self, session: &str) -> Option<Id> {
        HostStore::root_of(self, session).ok().flatten()
    }
    fn root_of_operation(&self, operation: &str) -> Option<Id> {
        self.root_of_cancel_operation(operation).ok().flatten()
    }
    fn load_tree(&self, root: &str) -> Option<TreeSnapshot> {
        crate::store::Store::load_tree(self, root).ok().flatten()
    }
}

/// [`Trees`] of a host that never evicts a tree (a replay, a test): nothing to load.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTrees;

impl Trees for NoTrees {
    fn root_of(&self, _: &str) -> Option<Id> {
        None
    }
    fn root_of_operation(&self, _: &str) -> Option<Id> {
        None
    }
    fn load_tree(&self, _: &str) -> Option<TreeSnapshot> {
        None
    }
}

/// A provider process to start for a root (its adapter is attached with [`DriverInput::Attach`], or
/// was made by the driver's factory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchSpec {
    /// The root session.
    pub root: Id,
    /// Its provider name.
    pub provider: Id,
    /// The provider's own id of the root from an earlier runtime, to resume.
    pub provider_session_id: Option<String>,
}

/// What a failed write of a [`Transmit`] means for the engine ("a failed session/cancel
/// transport write is an operation failure").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteFailure {
    /// The write carried a cancel: the operation failed (`cancelFailed`).
    Cancel {
        /// Operation.
        operation_id: Id,
    },
    /// The write carried guidance: it was not delivered (`guideFailed`).
    Guide {
        /// Root session.
        agent_session_id: Id,
        /// Root turn.
        turn_id: Id,
    },
}

/// Native messages to write to one root's provider, in order (after every earlier
/// [`Transmit`] of that root).
#[derive(Debug, Clone, PartialEq)]
pub struct Transmit {
    /// The root whose provider receives them.
    pub root: Id,
    /// The messages.
    pub messages: Vec<Value>,
    /// What to report with [`DriverInput::WriteFailed`] if writing them fails.
    pub on_failure: Option<WriteFailure>,
}

/// One committed outbox row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedRow {
    /// Outbox sequence number.
    pub seq: u64,
    /// Entity kind (the outbox row's `kind`).
    pub kind: &'static str,
    /// The stored payload (as the store returned it).
    pub payload: String,
}

/// The outbox rows of one acknowledged batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publication {
    /// The tree.
    pub root_agent_session_id: Option<Id>,
    /// Its workspace.
    pub workspace_id: Option<Id>,
    /// Rows, in seq order.
    pub rows: Vec<PublishedRow>,
}

/// What the host carries out, in order.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // a reply moves its step to the host; boxing would allocate
pub enum Output {
    /// Make this batch durable (read its rows with [`Driver::batch`]), then report it with
    /// [`DriverInput::Committed`] or [`DriverInput::NotCommitted`]. The host may gather every
    /// `Persist` it polls and commit them as one group. Batches come before the other outputs
    /// (which their commits release).
    Persist(BatchId),
    /// Start the provider process of a root.
    Launch(LaunchSpec),
    /// Write native messages to a root's provider.
    Transmit(Transmit),
    /// Publish the outbox rows of a committed batch.
    Publish(Publication),
    /// The outcome of an input given a [`ReplyTo`] token: its committed step or why not.
    Reply {
        /// The host's token.
        to: ReplyTo,
        /// The step (committed) or the error.
        result: Result<Step, DriverError>,
    },
    /// Something the host should log; nothing for it to do.
    Diagnostic(Diagnostic),
}

/// What a host logs ([`Output::Diagnostic`]). Ids, kinds and counts only: adapters never put
/// prompt, message or tool content into their diagnostics.
#[derive(Debug, Clone, PartialEq)]
pub enum Diagnostic {
    /// An input without a caller (a provider event, a timer, a runtime answer) met an internal
    /// inconsistency of the engine ([`Rejected::Internal`]): nothing changed. Issue 19: an
    /// internal inconsistency is "a distinct internal error, logged"; an input with a caller gets
    /// it in its [`Output::Reply`] instead.
    Internal {
        /// The input's wire kind.
        input_kind: &'static str,
        /// The inconsistency.
        error: Rejected,
    },
    /// An adapter's diagnostics (unknown native methods, malformed or unexpected messages).
    Adapter {
        /// The tree whose adapter reported them.
        root: Id,
        /// One line each.
        lines: Vec<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing to commit.
    Ready,
    /// A batch not handed out yet.
    Decided,
    /// Handed out by `poll_batch`.
    Sent,
    /// Committed.
    Acked,
    /// Not committed (or superseded by a failed batch of its tree).
    Failed,
}

struct Entry {
    state: State,
    /// The tree whose state the outcome was decided on.
    root: Option<Id>,
    /// The root whose adapter emitted the input.
    source: Option<Id>,
    outcome: Result<Step, DriverError>,
    reply: Option<ReplyTo>,
    /// The input, when it was an `interactionRequested` (given back if not taken).
    interaction: Option<NormalizedEvent>,
    published: Vec<Published>,
}

/// Makes the adapter of a newly launched root from its [`LaunchSpec`] (`None`: the provider is
/// unknown; the launch fails).
pub type AdapterFactory = Box<dyn FnMut(&LaunchSpec) -> Option<Box<dyn Adapter>> + Send>;

/// The engine, the adapters of the live roots, and one timer queue, driven by a host (see the
/// module docs).
pub struct Driver {
    engine: Engine,
    adapters: FxMap<Id, Box<dyn Adapter>>,
    factory: Option<AdapterFactory>,
    /// Roots whose launch was asked for and whose adapter is not attached yet: their requests.
    launching: FxMap<Id, Vec<ProviderRequest>>,
    timers: TimerQueue,
    /// Decided inputs, in order; `front` is the number of the first.
    entries: VecDeque<Entry>,
    front: u64,
    /// How many of `entries` are of each root ([`Driver::is_waiting`] without a scan of every
    /// input in flight, which hosts ask for each provider line); kept by the two places that
    /// change `entries`, and checked against them in debug builds.
    waiting: FxMap<Id, usize>,
    unsent: VecDeque<u64>,
    outputs: VecDeque<Output>,
    /// Trees loaded on demand since [`Driver::take_loaded`].
    loaded: Vec<Id>,
    now: Millis,
    /// Whether [`Record`]s are kept (see [`Testkit::set_recording`]).
    recording: bool,
    records: Vec<Record>,
}

impl Default for Driver {
    fn default() -> Self {
        Driver::new()
    }
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("adapters", &self.adapters.len())
            .field("timers", &self.timers.len())
            .field("entries", &self.entries.len())
            .field("outputs", &self.outputs.len())
            .finish()
    }
}

impl Driver {
    /// A driver with a new engine and no factory (the host attaches adapters).
    pub fn new() -> Driver {
        Driver::with_engine(Engine::new())
    }

    /// A driver with an engine of these settings.
    pub fn with_config(config: EngineConfig) -> Driver {
        Driver::with_engine(Engine::with_config(config))
    }

    /// A driver around an engine (for example one with trees already restored).
    pub fn with_engine(engine: Engine) -> Driver {
        Driver {
            engine,
            adapters: FxMap::default(),
            factory: None,
            launching: FxMap::default(),
            timers: TimerQueue::default(),
            entries: VecDeque::new(),
            front: 0,
            waiting: FxMap::default(),
            unsent: VecDeque::new(),
            outputs: VecDeque::new(),
            loaded: Vec::new(),
            now: 0,
            recording: false,
            records: Vec::new(),
        }
    }

    /// Makes adapters for launched roots by provider (the driver then attaches them itself; the
    /// host still gets [`Output::Launch`] to start the process).
    pub fn set_factory(&mut self, factory: AdapterFactory) {
        self.factory = Some(factory);
    }

    /// The engine (read-only: every change goes through the driver).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The root of a session, loaded or not (no parsing of ids).
    pub fn root_of(&self, session: &str, trees: &dyn Trees) -> Option<Id> {
        self.engine
            .root_of(session)
            .cloned()
            .or_else(|| trees.root_of(session))
    }

    /// Whether a root has a live adapter.
    pub fn has_adapter(&self, root: &str) -> bool {
        self.adapters.contains_key(root)
    }

    /// Roots with a live adapter.
    pub fn adapter_roots(&self) -> Vec<Id> {
        let mut v: Vec<Id> = self.adapters.keys().cloned().collect();
        v.sort();
        v
    }

    /// One input (see [`DriverInput`]). Only inputs about a provider's messages can fail
    /// ([`DriverInput::Native`], [`DriverInput::Line`], [`DriverInput::Call`]: a message the
    /// adapter cannot use, or no live adapter), and then nothing changed; every other input is
    /// answered through [`Output::Reply`] (or not at all) and returns `Ok`.
    pub fn handle(&mut self, input: DriverInput<'_>, trees: &dyn Trees) -> Result<(), DriverError> {
        match input {
            DriverInput::Attach { now, root, adapter } => self.attach(now, root, adapter, trees),
            DriverInput::Native { now, root, message } => {
                return self.handle_native(now, root, message, trees)
            }
            DriverInput::Line { now, root, line } => {
                return self.handle_line(now, root, line, trees)
            }
            DriverInput::Host { now, input, reply } => self.handle_input(now, input, reply, trees),
            DriverInput::Exit { now, root, error } => self.handle_exit(now, root, error, trees),
            DriverInput::WriteFailed {
                now,
                failure,
                error,
            } => self.handle_write_failed(now, failure, error, trees),
            DriverInput::Timeout(now) => self.handle_timeout(now, trees),
            DriverInput::Committed { batch, published } => self.ack_commit(batch, published, trees),
            DriverInput::NotCommitted { batch, why } => {
                let error = match why {
                    CommitFailure::Failed(e) => DriverError::Storage(e),
                    CommitFailure::Refused => DriverError::Refused,
                    CommitFailure::Unavailable(e) => DriverError::Unavailable(e),
                };
                self.not_committed(batch, error, trees)
            }
            DriverInput::Call { now, root, call } => {
                return self.call_adapter(now, root, call, trees)
            }
        }
        Ok(())
    }

    fn attach(&mut self, now: Millis, root: Id, mut adapter: Box<dyn Adapter>, trees: &dyn Trees) {
        self.tick(now);
        let out = adapter.open(self.now);
        self.adapters.insert(root.clone(), adapter);
        self.absorb(&root, out, None, trees);
        for req in self.launching.remove(&root).unwrap_or_default() {
            self.request(&req, trees);
        }
        self.pump(trees);
    }

    /// Removes a root's adapter and its timers without telling the engine (the host stopped an
    /// idle or deleted root's provider on purpose). A later `Start` launches a new one.
    pub fn detach(&mut self, root: &str) -> Option<Box<dyn Adapter>> {
        self.timers.drop_root(root);
        self.launching.remove(root);
        self.adapters.remove(root)
    }

    /// One native message from a root's provider. A message the adapter cannot use is a typed
    /// error and changes nothing.
    pub(crate) fn handle_native(
        &mut self,
        now: Millis,
        root: &str,
        message: &Value,
        trees: &dyn Trees,
    ) -> Result<(), DriverError> {
        self.tick(now);
        let Some(root) = self.adapters.get_key_value(root).map(|(k, _)| k.clone()) else {
            return Err(DriverError::NoAdapter(root.into()));
        };
        let Some(adapter) = self.adapters.get_mut(&root) else {
            return Err(DriverError::NoAdapter(root));
        };
        let out = adapter.on_native(self.now, message)?;
        self.absorb(&root, out, None, trees);
        self.pump(trees);
        Ok(())
    }

    /// One line of a line-based provider (a native message after [`parse_line`]).
    pub(crate) fn handle_line(
        &mut self,
        now: Millis,
        root: &str,
        line: &str,
        trees: &dyn Trees,
    ) -> Result<(), DriverError> {
        let message = parse_line(line)?;
        self.handle_native(now, root, &message, trees)
    }

    /// A host command (or any input). Its [`Output::Reply`] comes once its batch is committed.
    pub(crate) fn handle_input(
        &mut self,
        now: Millis,
        input: Input,
        reply: Option<ReplyTo>,
        trees: &dyn Trees,
    ) {
        self.tick(now);
        if let Input::Command(Command::CancelTurn {
            agent_session_id, ..
        }) = &input
        {
            // Issue 23: "Flush buffered text before the cancel settles the turn; it is the
            // user's record of what happened."
            if let Some(root) = self.root_of(agent_session_id, trees) {
                if let Some(adapter) = self.adapters.get_mut(&root) {
                    let out = adapter.flush_text(self.now);
                    self.absorb(&root, out, None, trees);
                }
            }
        }
        self.feed(input, None, reply, trees);
        self.pump(trees);
    }

    /// A root's provider process is gone (or could not be started): its adapter and timers are
    /// dropped and the engine is told (`providerExited`).
    pub(crate) fn handle_exit(&mut self, now: Millis, root: &str, error: &str, trees: &dyn Trees) {
        self.tick(now);
        self.detach(root);
        let input = Input::Runtime(RuntimeAnswer::ProviderExited {
            root_agent_session_id: root.into(),
            error: error.into(),
        });
        self.feed(input, None, None, trees);
        self.pump(trees);
    }

    /// Writing a [`Transmit`] that carried `failure` failed.
    pub(crate) fn handle_write_failed(
        &mut self,
        now: Millis,
        failure: WriteFailure,
        error: &str,
        trees: &dyn Trees,
    ) {
        self.tick(now);
        let answer = match failure {
            WriteFailure::Cancel { operation_id } => RuntimeAnswer::CancelFailed {
                operation_id,
                error: format!("cancel write failed: {error}"),
            },
            WriteFailure::Guide {
                agent_session_id,
                turn_id,
            } => RuntimeAnswer::GuideFailed {
                agent_session_id,
                turn_id,
                error: error.into(),
            },
        };
        self.feed(Input::Runtime(answer), None, None, trees);
        self.pump(trees);
    }

    /// The clock reached `now`: every engine and adapter timer due fires, earliest first.
    pub(crate) fn handle_timeout(&mut self, now: Millis, trees: &dyn Trees) {
        self.tick(now);
        while let Some(t) = self.timers.pop_due(self.now) {
            match t {
                Timer::Engine(timer) => self.feed(
                    Input::Runtime(RuntimeAnswer::TimerFired { timer }),
                    None,
                    None,
                    trees,
                ),
                Timer::Adapter { root, id } => {
                    if let Some(adapter) = self.adapters.get_mut(&root) {
                        let out = adapter.on_timer(self.now, &id);
                        self.absorb(&root, out, None, trees);
                    }
                }
            }
        }
        self.pump(trees);
    }

    /// The next deadline of an engine or adapter timer.
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.timers.next_deadline()
    }

    /// The next batch to make durable, in decision order.
    pub(crate) fn poll_batch(&mut self) -> Option<BatchId> {
        while let Some(n) = self.unsent.pop_front() {
            if let Some(e) = self.entry_mut(n) {
                if e.state == State::Decided {
                    e.state = State::Sent;
                    return Some(BatchId(n));
                }
            }
        }
        None
    }

    /// The rows of a batch handed out and not yet acknowledged; `None` once it is not to be
    /// committed (acknowledged, or superseded by a failed batch of its tree: skip it).
    pub fn batch(&self, id: BatchId) -> Option<&PersistBatch> {
        let e = self.entry(id.0)?;
        match (&e.state, &e.outcome) {
            (State::Sent | State::Decided, Ok(step)) => Some(&step.persist),
            _ => None,
        }
    }

    /// The batch is durable; `published` are the outbox rows the store wrote for it.
    pub(crate) fn ack_commit(&mut self, id: BatchId, published: Vec<Published>, trees: &dyn Trees) {
        if let Some(e) = self.entry_mut(id.0) {
            if matches!(e.state, State::Sent | State::Decided) {
                e.state = State::Acked;
                e.published = published;
            }
        }
        self.pump(trees);
    }

    /// The batch was not committed (a store error): see [`DriverInput::NotCommitted`].
    pub(crate) fn commit_failed(&mut self, id: BatchId, error: &str, trees: &dyn Trees) {
        self.not_committed(id, DriverError::Storage(error.into()), trees);
    }

    fn not_committed(&mut self, id: BatchId, error: DriverError, trees: &dyn Trees) {
        let Some(e) = self.entry_mut(id.0) else {
            return;
        };
        if !matches!(e.state, State::Sent | State::Decided) {
            return;
        }
        e.state = State::Failed;
        // The tree's later batches were decided on the state this batch left: their callers
        // get the same kind of answer (an unreachable store, a conflict to retry, or a failure).
        let later_error = match &error {
            DriverError::Unavailable(m) => DriverError::Unavailable(m.clone()),
            DriverError::Refused => DriverError::Refused,
            _ => DriverError::Storage("an earlier batch of this tree was not committed".into()),
        };
        e.outcome = Err(error);
        let root = e.root.clone();
        if let Some(root) = root {
            let later = (id.0 - self.front + 1) as usize;
            for e in self.entries.iter_mut().skip(later) {
                if e.root.as_ref() == Some(&root)
                    && e.outcome.is_ok()
                    && matches!(e.state, State::Ready | State::Decided | State::Sent)
                {
                    e.state = State::Failed;
                    e.outcome = Err(later_error.clone());
                }
            }
            self.engine.evict(&root);
            if let Some(t) = trees.load_tree(&root) {
                if self.engine.restore(t).is_ok() {
                    self.loaded.push(root);
                }
            }
        }
        self.pump(trees);
    }

    /// The next output to carry out: the batches to make durable first, then what committed
    /// batches released, in order.
    pub fn poll_output(&mut self) -> Option<Output> {
        if let Some(id) = self.poll_batch() {
            return Some(Output::Persist(id));
        }
        self.outputs.pop_front()
    }

    /// Whether inputs still wait for a commit or outputs for the host.
    pub fn is_busy(&self) -> bool {
        !self.entries.is_empty() || !self.outputs.is_empty()
    }

    /// Whether an input decided on `root`'s tree still waits for its commit (or for the
    /// commits decided before it). A host that commits while the driver decides (a commit
    /// thread) leaves such a tree's provider running until then.
    pub fn is_waiting(&self, root: &str) -> bool {
        let waiting = self.waiting.contains_key(root);
        debug_assert_eq!(
            waiting,
            self.entries.iter().any(|e| e.root.as_deref() == Some(root)),
            "the count of waiting inputs by root disagrees with the inputs"
        );
        waiting
    }

    /// Drops a quiescent tree from memory (loaded again on demand). Refused (`false`) while the
    /// tree is not quiescent or has inputs waiting for a commit.
    pub fn evict(&mut self, root: &str) -> bool {
        if self.is_waiting(root) || !self.engine.is_quiescent(root) {
            return false;
        }
        self.engine.evict(root);
        true
    }

    /// Replaces a tree by the store's copy (crash-only recovery; a replay's reload check).
    pub fn reload(&mut self, root: &str, trees: &dyn Trees) -> bool {
        self.engine.evict(root);
        match trees.load_tree(root) {
            Some(t) => self.engine.restore(t).is_ok(),
            None => false,
        }
    }

    /// The adapter of a live root (downcast it with `as &dyn Any` for adapter-specific reads).
    pub fn adapter(&self, root: &str) -> Option<&dyn Adapter> {
        self.adapters.get(root).map(|a| &**a as &dyn Adapter)
    }

    /// Calls the adapter of a live root with something outside the [`Adapter`] trait (for
    /// example the Codex adapter's `attach_root_thread`) and carries out the output it returns
    /// like any other adapter output. `Err(NoAdapter)` when the root has no live adapter.
    pub(crate) fn call_adapter(
        &mut self,
        now: Millis,
        root: &str,
        f: AdapterCall<'_>,
        trees: &dyn Trees,
    ) -> Result<(), DriverError> {
        self.tick(now);
        let Some(root) = self.adapters.get_key_value(root).map(|(k, _)| k.clone()) else {
            return Err(DriverError::NoAdapter(root.into()));
        };
        let Some(adapter) = self.adapters.get_mut(&root) else {
            return Err(DriverError::NoAdapter(root));
        };
        let out = f(&mut **adapter, self.now);
        self.absorb(&root, out, None, trees);
        self.pump(trees);
        Ok(())
    }

    fn record(&mut self, r: impl FnOnce() -> Record) {
        if self.recording {
            self.records.push(r());
        }
    }

    /// The batches decided and not yet handed out as [`Output::Persist`] whose number comes
    /// after `after` (all of them for `None`), oldest first. A host that must tag each batch
    /// with what held when it was decided (the daemon: the lease epoch of its tree, issue 34)
    /// calls it after each input, before anything can change what it tags.
    pub fn decided_after(&self, after: Option<BatchId>) -> Vec<BatchId> {
        let mut v: Vec<BatchId> = self
            .unsent
            .iter()
            .rev()
            .take_while(|&&n| after.is_none_or(|a| n > a.0))
            .map(|&n| BatchId(n))
            .collect();
        v.reverse();
        v
    }

    /// Trees loaded on demand (or reloaded after a failed commit) since the last call.
    pub fn take_loaded(&mut self) -> Vec<Id> {
        std::mem::take(&mut self.loaded)
    }

    fn tick(&mut self, now: Millis) {
        self.now = self.now.max(now);
    }

    fn entry(&self, n: u64) -> Option<&Entry> {
        self.entries.get(n.checked_sub(self.front)? as usize)
    }

    fn entry_mut(&mut self, n: u64) -> Option<&mut Entry> {
        self.entries.get_mut(n.checked_sub(self.front)? as usize)
    }

    /// Decides one input; its effects wait in order behind the batches decided before it.
    fn feed(
        &mut self,
        input: Input,
        source: Option<Id>,
        reply: Option<ReplyTo>,
        trees: &dyn Trees,
    ) {
        let outcome = self.decide(&input, trees).map_err(DriverError::from);
        if let (None, Err(DriverError::Rejected(r))) = (reply, &outcome) {
            if r.is_internal() {
                self.outputs
                    .push_back(Output::Diagnostic(Diagnostic::Internal {
                        input_kind: input.kind(),
                        error: r.clone(),
                    }));
            }
        }
        self.record(|| Record::Decided {
            input: input.clone(),
            outcome: match &outcome {
                Ok(step) => Ok(step.ignored),
                Err(DriverError::Rejected(r)) => Err(r.clone()),
                Err(_) => Ok(None),
            },
        });
        let root = match &outcome {
            Ok(step) => step.persist.root_agent_session_id.clone(),
            Err(_) => None,
        }
        .or_else(|| source.clone());
        let state = match &outcome {
            Ok(step) if !step.persist.is_empty() => State::Decided,
            _ => State::Ready,
        };
        let interaction = match input {
            Input::Event(e @ NormalizedEvent::InteractionRequested { .. }) => Some(e),
            _ => None,
        };
        if state == State::Decided {
            self.unsent
                .push_back(self.front + self.entries.len() as u64);
        }
        if let Some(root) = &root {
            *self.waiting.entry(root.clone()).or_default() += 1;
        }
        self.entries.push_back(Entry {
            state,
            root,
            source,
            outcome,
            reply,
            interaction,
            published: Vec::new(),
        });
    }

    /// `engine.handle`, loading an evicted tree on demand.
    fn decide(&mut self, input: &Input, trees: &dyn Trees) -> Result<Step, Rejected> {
        match self.engine.handle(self.now, input) {
            Err(Rejected::UnknownSession(id)) => {
                if self.load(trees.root_of(&id), trees) {
                    self.engine.handle(self.now, input)
                } else {
                    Err(Rejected::UnknownSession(id))
                }
            }
            Err(Rejected::UnknownOperation(id)) => {
                if self.load(trees.root_of_operation(&id), trees) {
                    self.engine.handle(self.now, input)
                } else {
                    Err(Rejected::UnknownOperation(id))
                }
            }
            other => other,
        }
    }

    fn load(&mut self, root: Option<Id>, trees: &dyn Trees) -> bool {
        let Some(root) = root else { return false };
        if self.engine.root_of(&root).is_some() {
            return false;
        }
        let restored = trees
            .load_tree(&root)
            .is_some_and(|t| self.engine.restore(t).is_ok());
        if restored {
            self.loaded.push(root);
        }
        restored
    }

    /// Carries out one adapter output: native messages out, timers armed, then its events and
    /// after them its answers into the engine.
    fn absorb(
        &mut self,
        root: &Id,
        out: AdapterOutput,
        failure: Option<WriteFailure>,
        trees: &dyn Trees,
    ) {
        self.record(|| Record::Adapter {
            root: root.clone(),
            output: out.clone(),
        });
        if !out.diagnostics.is_empty() {
            self.outputs
                .push_back(Output::Diagnostic(Diagnostic::Adapter {
                    root: root.clone(),
                    lines: out.diagnostics.clone(),
                }));
        }
        if !out.native.is_empty() {
            self.outputs.push_back(Output::Transmit(Transmit {
                root: root.clone(),
                messages: out.native,
                on_failure: failure,
            }));
        }
        for t in out.timers {
            self.timers.arm(
                t.at,
                Timer::Adapter {
                    root: root.clone(),
                    id: t.id,
                },
            );
        }
        for e in out.events {
            self.feed(Input::Event(e), Some(root.clone()), None, trees);
        }
        for a in out.answers {
            self.feed(Input::Runtime(a), Some(root.clone()), None, trees);
        }
    }

    /// Releases, in order, every decided input whose batch (and every batch before it) is
    /// acknowledged or failed.
    fn pump(&mut self, trees: &dyn Trees) {
        while self
            .entries
            .front()
            .is_some_and(|e| matches!(e.state, State::Ready | State::Acked | State::Failed))
        {
            let Some(e) = self.entries.pop_front() else {
                break;
            };
            self.front += 1;
            if let Some(root) = &e.root {
                if let Some(n) = self.waiting.get_mut(root) {
                    *n -= 1;
                    if *n == 0 {
                        self.waiting.remove(root);
                    }
                }
            }
            self.release(e, trees);
        }
    }

    fn release(&mut self, e: Entry, trees: &dyn Trees) {
        let Entry {
            outcome,
            reply,
            interaction,
            published,
            source,
            ..
        } = e;
        if !published.is_empty() {
            if let Ok(step) = &outcome {
                let p = &step.persist;
                let rows = published
                    .into_iter()
                    .filter_map(|x| {
                        p.rows.get(x.row as usize).map(|r| PublishedRow {
                            seq: x.seq,
                            kind: r.kind(),
                            payload: x.payload,
                        })
                    })
                    .collect();
                self.outputs.push_back(Output::Publish(Publication {
                    root_agent_session_id: p.root_agent_session_id.clone(),
                    workspace_id: p.workspace_id.clone(),
                    rows,
                }));
            }
        }
        if let Some(event) = interaction {
            let taken = outcome.as_ref().is_ok_and(|s| s.ignored.is_none());
            if !taken {
                // The provider still waits for an answer: its adapter answers it natively.
                if let Some(root) = source {
                    if self.adapters.contains_key(&root) {
                        self.record(|| Record::Dropped {
                            root: root.clone(),
                            event: event.clone(),
                        });
                    }
                    if let Some(adapter) = self.adapters.get_mut(&root) {
                        let out = adapter.on_dropped(self.now, &event);
                        self.absorb(&root, out, None, trees);
                    }
                }
            }
        }
        if let Ok(step) = &outcome {
            for t in &step.timers {
                self.timers.arm(t.at, Timer::Engine(t.timer.clone()));
            }
            for req in &step.provider {
                self.request(req, trees);
            }
        }
        if let Some(to) = reply {
            self.outputs.push_back(Output::Reply {
                to,
                result: outcome,
            });
        }
    }

    /// Routes one engine request to its tree's adapter.
    fn request(&mut self, req: &ProviderRequest, trees: &dyn Trees) {
        let root = req.root_agent_session_id().clone();
        if let Some(held) = self.launching.get_mut(&root) {
            held.push(req.clone());
            return;
        }
        if let Some(adapter) = self.adapters.get_mut(&root) {
            let failure = match req {
                ProviderRequest::Cancel { operation_id, .. } => Some(WriteFailure::Cancel {
                    operation_id: operation_id.clone(),
                }),
                ProviderRequest::Guide {
                    agent_session_id,
                    turn_id,
                    ..
                } => Some(WriteFailure::Guide {
                    agent_session_id: agent_session_id.clone(),
                    turn_id: turn_id.clone(),
                }),
                _ => None,
            };
            let out = adapter.on_request(self.now, req);
            self.absorb(&root, out, failure, trees);
            return;
        }
        // No live provider runtime: nothing can confirm anything.
        let answer = match req {
            ProviderRequest::Start { .. } => return self.launch(root, req, trees),
            ProviderRequest::Cancel { operation_id, .. } => RuntimeAnswer::CancelFailed {
                operation_id: operation_id.clone(),
                error: "no live provider runtime".into(),
            },
            ProviderRequest::Guide {
                agent_session_id,
                turn_id,
                ..
            } => RuntimeAnswer::GuideFailed {
                agent_session_id: agent_session_id.clone(),
                turn_id: turn_id.clone(),
                error: "no live provider runtime".into(),
            },
            // The pending interaction's provider is gone; its exit settles the turn.
            ProviderRequest::RespondInteraction { .. } => return,
        };
        self.feed(Input::Runtime(answer), None, None, trees);
    }

    fn launch(&mut self, root: Id, req: &ProviderRequest, trees: &dyn Trees) {
        let Some(session) = self.engine.session(&root) else {
            return;
        };
        let spec = LaunchSpec {
            root: root.clone(),
            provider: session.provider.clone(),
            provider_session_id: session.provider_session_id.clone(),
        };
        self.outputs.push_back(Output::Launch(spec.clone()));
        let made = self.factory.as_mut().map(|f| f(&spec));
        match made {
            // The host attaches the adapter.
            None => {
                self.launching.insert(root, vec![req.clone()]);
            }
            Some(Some(mut adapter)) => {
                let out = adapter.open(self.now);
                self.adapters.insert(root.clone(), adapter);
                self.absorb(&root, out, None, trees);
                self.request(req, trees);
            }
            Some(None) => {
                let input = Input::Runtime(RuntimeAnswer::ProviderExited {
                    root_agent_session_id: root,
                    error: format!("no adapter for provider {}", spec.provider),
                });
                self.feed(input, None, None, trees);
            }
        }
    }
}

#[cfg(test)]
mod tests;
