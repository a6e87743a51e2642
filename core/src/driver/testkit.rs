//! [`Testkit`]: hooks for hosts that look inside the driver instead of carrying its outputs out
//! (test rigs, and the crate's own replays). Public with the `testkit` feature only, so a
//! daemon's view of the [`Driver`] is [`Driver::handle`] and the `poll_*` calls.

use super::{Driver, Output, Record};
use crate::adapters::Adapter;
use crate::store::HostStore;

/// Test hooks of a [`Driver`] (see the module docs).
// Without the feature only the crate's replays use it, and not every hook.
#[cfg_attr(not(feature = "testkit"), allow(dead_code))]
pub trait Testkit {
    /// Keeps a [`Record`] of every adapter output, engine decision and dropped interaction from
    /// now on (`true`), or stops (`false`). Hosts that report or assert on what passed between
    /// the adapters and the engine (replays, test rigs) turn it on; a daemon leaves it off.
    fn set_recording(&mut self, on: bool);

    /// The records kept since the last call, in the order things happened.
    fn take_records(&mut self) -> Vec<Record>;

    /// The adapter of a live root, mutably, for adapter unit checks that look at an adapter's
    /// answer to one call in isolation. Whatever such a call returns is NOT carried out (no
    /// native message, event or timer leaves the driver): a host drives adapters only through
    /// [`Driver::handle`] (and [`super::DriverInput::Call`]).
    fn adapter_mut(&mut self, root: &str) -> Option<&mut dyn Adapter>;

    /// The host loop of a host whose only I/O is the store (a replay, a test, a simulation):
    /// commits every decided batch to `store` one at a time (a failed one is reported as not
    /// committed, a storage error), acknowledges it, and returns every other output released,
    /// in order, until no batch is left. Native messages, launches and publications are the
    /// caller's to look at (or ignore).
    fn commit_pending<S: HostStore>(&mut self, store: &mut S) -> Vec<Output>;
}

impl Testkit for Driver {
    fn set_recording(&mut self, on: bool) {
        self.recording = on;
    }

    fn take_records(&mut self) -> Vec<Record> {
        std::mem::take(&mut self.records)
    }

    fn adapter_mut(&mut self, root: &str) -> Option<&mut dyn Adapter> {
        self.adapters
            .get_mut(root)
            .map(|a| &mut **a as &mut dyn Adapter)
    }

    fn commit_pending<S: HostStore>(&mut self, store: &mut S) -> Vec<Output> {
        let mut outputs = Vec::new();
        while let Some(out) = self.poll_output() {
            let Output::Persist(id) = out else {
                outputs.push(out);
                continue;
            };
            let result = match self.batch(id) {
                Some(batch) => store
                    .apply_group(&[batch], true)
                    .map(|mut published| published.pop().unwrap_or_default()),
                None => continue,
            };
            match result {
                Ok(published) => self.ack_commit(id, published, &*store),
                Err(e) => self.commit_failed(id, &e.to_string(), &*store),
            }
        }
        outputs
    }
}
