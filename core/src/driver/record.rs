//! What passed between the adapters and the engine, for hosts that report it or assert on it
//! (the native replays, the fuzz harness, the adapter test rigs). Off by default: a daemon pays
//! nothing for it.

use crate::adapters::AdapterOutput;
use crate::error::Rejected;
use crate::input::{Input, NormalizedEvent};
use crate::model::Id;
use crate::step::Ignored;

/// One thing the [`super::Driver`] did, in the order it did it (recorded only after
/// `Testkit::set_recording`).
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// An adapter output exactly as the adapter of `root` returned it (from `open`, `on_native`,
    /// `on_request`, `on_timer`, `on_dropped`, `flush_text` or [`super::DriverInput::Call`]),
    /// before the driver carried it out. Its `diagnostics` are only surfaced here.
    Adapter {
        /// The root whose adapter produced it.
        root: Id,
        /// The output.
        output: AdapterOutput,
    },
    /// The engine decided an input: `Ok(None)` accepted, `Ok(Some(why))` accepted as ignored,
    /// `Err` rejected (nothing changed). Recorded when decided, before its batch is committed.
    Decided {
        /// The input.
        input: Input,
        /// The decision.
        outcome: Result<Option<Ignored>, Rejected>,
    },
    /// An `interactionRequested` the engine did not take, given back to the adapter of `root`
    /// (`Adapter::on_dropped`); that call's output follows as a [`Record::Adapter`].
    Dropped {
        /// The root whose adapter emitted it.
        root: Id,
        /// The event.
        event: NormalizedEvent,
    },
}
