//! One timer queue for engine timers and adapter timers.

use crate::input::TimerId;
use crate::model::{Id, Millis};
use std::collections::BTreeMap;

/// Every timer a [`super::Driver`] keeps: the engine's and the adapters', one type.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Timer {
    /// A timer the engine asked for (fed back as `timerFired`).
    Engine(TimerId),
    /// A timer one root's adapter asked for (given back to that adapter's `on_timer`).
    Adapter {
        /// The root whose adapter armed it.
        root: Id,
        /// The adapter's own id.
        id: String,
    },
}

/// Armed timers, earliest first; timers due at the same instant fire in the order they were
/// armed.
#[derive(Debug, Default)]
pub(crate) struct TimerQueue {
    armed: BTreeMap<(Millis, u64), Timer>,
    next: u64,
}

impl TimerQueue {
    pub(crate) fn arm(&mut self, at: Millis, timer: Timer) {
        self.next += 1;
        self.armed.insert((at, self.next), timer);
    }

    /// The earliest deadline.
    pub(crate) fn next_deadline(&self) -> Option<Millis> {
        self.armed.keys().next().map(|(at, _)| *at)
    }

    /// Removes and returns the earliest timer due at `now`.
    pub(crate) fn pop_due(&mut self, now: Millis) -> Option<Timer> {
        let (&key, _) = self.armed.iter().next().filter(|((at, _), _)| *at <= now)?;
        self.armed.remove(&key)
    }

    /// Drops the adapter timers of one root (its adapter is gone).
    pub(crate) fn drop_root(&mut self, root: &str) {
        self.armed
            .retain(|_, t| !matches!(t, Timer::Adapter { root: r, .. } if &**r == root));
    }

    pub(crate) fn len(&self) -> usize {
        self.armed.len()
    }
}
