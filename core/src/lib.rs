//! # tutti-core
//!
//! The pure, sans-I/O engine of tutti. It records every root and provider-native child agent as
//! a durable session with turns, keeps the user's root turn open while any nested child is still
//! working, cancels a whole tree exactly, and never loses or resurrects work, whatever order the
//! provider's events arrive in. It does no I/O, reads no clock, uses no randomness and starts no
//! threads: inputs go in, data describing what to do comes out.
//!
//! ## Embedding: the [`Driver`]
//!
//! A host runs the engine, the provider adapters and every timer through one sans-I/O
//! [`Driver`] ([`driver`]: inputs go in with `handle_*`, batches to commit and effects to carry
//! out come out with `poll_*`; the module docs show a complete host loop over [`MemoryStore`]
//! and list what the host still owns). The daemon (`tutti-tokio`) is that loop plus process
//! I/O, HTTP and a store.
//!
//! [`MemoryStore`]: store::MemoryStore
//!
//! ## The engine alone
//!
//! One input enum ([`Input`]: normalized provider events, host commands, runtime answers, timers)
//! and one output type ([`Step`]). Underneath the driver, the engine alone runs:
//!
//! ```no_run
//! # use tutti_core::{Engine, Input, Step, store::{MemoryStore, Store}};
//! # fn next_input() -> Option<(i64, Input)> { None }
//! # fn run_provider_requests(_: &Step) {}
//! let (mut engine, mut store) = (Engine::new(), MemoryStore::new());
//! while let Some((now, input)) = next_input() {          // provider line, API call, timer
//!     let Ok(step) = engine.handle(now, &input) else { continue }; // rejected: nothing changed
//!     if store.apply(&step.persist).is_err() {             // one transaction, guards checked
//!         let root = step.persist.root_agent_session_id.clone().unwrap_or_default();
//!         engine.evict(&root);                             // crash-only: reload from the file
//!         if let Ok(Some(t)) = store.load_tree(&root) { let _ = engine.restore(t); }
//!         continue;
//!     }
//!     run_provider_requests(&step); // then arm step.timers, publish outbox, send step.reply
//! }
//! ```
//!
//! Every step is committed before its provider requests run and before its outbox rows are
//! published. A rejected input ([`Rejected`]) changed nothing and persists nothing.
//!
//! ## Pieces
//! - [`model`]: sessions, turns, interactions, messages, tool calls, cancel operations (wire form).
//! - [`input`]: [`NormalizedEvent`], [`Command`], [`RuntimeAnswer`].
//! - [`step`]: [`Step`], [`PersistBatch`] (rows, guards, outbox), [`ProviderRequest`], [`Reply`].
//! - [`driver`]: [`Driver`], the engine with its adapters and timers, for hosts.
//! - [`Engine`]: one state machine per root tree: the root gate, cancellation, guidance,
//!   interactions, deletion.
//! - [`snapshot`]: [`TreeSnapshot`] for `restore` / `snapshot`.
//! - [`store`]: the storage contract and the in-memory reference store; [`projection`]: reads.
//! - [`invariants`]: the spec's safety rules as a checker; [`scenario`]: the scenario runner (a
//!   [`Driver`] host).
//!
//! Ids are chosen by the host (commands and adapters carry them), so the engine needs no id
//! source of its own and is a pure function of its inputs.

#![warn(missing_docs)]

pub mod adapters;
pub mod driver;
mod engine;
pub mod error;
mod hash;
pub mod input;
pub mod invariants;
mod keyed;
pub mod model;
pub mod projection;
pub mod replay;
pub mod scenario;
mod session_wire;
pub mod snapshot;
pub mod step;
pub mod store;
mod stored;
mod turn_wire;

pub use driver::Driver;
pub use engine::{Engine, EngineConfig, UNCONFIRMED};
pub use error::{Rejected, RestoreError};
pub use hash::{FxMap, FxSet};
pub use input::{Command, Input, NormalizedEvent, RuntimeAnswer, TimerId};
pub use snapshot::TreeSnapshot;
pub use step::{GuideMode, PersistBatch, ProviderRequest, Reply, Row, Step};
