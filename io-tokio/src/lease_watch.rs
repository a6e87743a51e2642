//! The lease rule on the daemon's own clock (issue 34: "A daemon that cannot renew stops acting
//! before its lease can expire by its own clock (stop the tree's provider, refuse commands) — the
//! classic lease rule, with a safety margin for clock drift").
//!
//! A lease this daemon holds is *good until* the time its last successful claim or renewal
//! started plus the lease time minus [`safety_margin`] (see
//! [`crate::daemon::Housekeeping::good_until`]). Past that instant another daemon may take the
//! tree over soon, so this daemon must have stopped the tree's provider.
//!
//! The engine thread could do that itself on its renewal tick, but the engine thread is the one
//! that blocks when the database is cut off (a statement waiting on a frozen connection). So a
//! watchdog thread of its own ([`LeaseWatch::spawn`]) holds the runtime handle and the good-until
//! instant of every tree with a live provider, and stops a runtime whose instant passed — without
//! the engine thread and without the store. It records what it stopped; the engine thread drains
//! that record on its next round ([`LeaseWatch::take_stopped`]) and settles those trees (the
//! provider is gone) once it holds their lease again, or leaves them to the daemon that took
//! them over.
//!
//! Refusing commands needs no watchdog: a command on a tree whose lease is past its good-until
//! instant does not count as held ([`crate::daemon::Acquired::Held`] is not returned), so it must
//! claim the lease first, which answers `503 unavailable` while the store is unreachable.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tracing::warn;
use tutti_core::model::Id;

use crate::runtime::RuntimeHandle;

/// The margin kept between the instant a daemon stops acting for a tree and the lease's expiry
/// by the daemon's own clock: a third of the lease time.
///
/// Choice: renewal runs every third of the lease time, so a lease is good for two renewal
/// periods after its last successful renewal (one missed or late renewal is tolerated), and the
/// last third (1 s of a 3 s lease, 3.3 s of the default 10 s) covers clock drift between
/// daemons, the watchdog's period and the time the provider's process group takes to end.
pub fn safety_margin(lease: Duration) -> Duration {
    lease / 3
}

/// How often the watchdog looks: a twentieth of the lease time, between 20 ms and 500 ms.
pub fn watch_period(lease: Duration) -> Duration {
    (lease / 20).clamp(Duration::from_millis(20), Duration::from_millis(500))
}

#[derive(Debug)]
struct Watched {
    handle: RuntimeHandle,
    /// Wall-clock milliseconds; `None`: no lease bounds this tree (a store without leases).
    good_until_ms: Option<i64>,
}

#[derive(Debug, Default)]
struct Inner {
    watched: BTreeMap<Id, Watched>,
    /// Each stopped root with its runtime's generation.
    stopped: Vec<(Id, u64)>,
}

/// The runtimes of trees whose lease bounds how long they may run (see the module docs).
#[derive(Debug, Default)]
pub struct LeaseWatch {
    inner: Mutex<Inner>,
}

impl LeaseWatch {
    /// An empty watch.
    pub fn new() -> Arc<LeaseWatch> {
        Arc::new(LeaseWatch::default())
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut g)
    }

    /// Starts the watchdog thread: every `period` it calls [`LeaseWatch::check`] with the wall
    /// clock. It ends when the last other reference to the watch is dropped (the daemon ended).
    pub fn spawn(self: &Arc<Self>, period: Duration) -> std::io::Result<()> {
        let weak: Weak<LeaseWatch> = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("tutti-lease-watch".into())
            .spawn(move || loop {
                std::thread::sleep(period);
                let Some(watch) = weak.upgrade() else {
                    return;
                };
                watch.check(crate::clock::now_ms());
            })
            .map(|_| ())
    }

    /// `root`'s provider runtime started (or was replaced): it is watched with `good_until_ms`.
    pub fn track(&self, root: &Id, handle: RuntimeHandle, good_until_ms: Option<i64>) {
        self.with(|i| {
            i.watched.insert(
                root.clone(),
                Watched {
                    handle,
                    good_until_ms,
                },
            )
        });
    }

    /// `root`'s lease was claimed or renewed (or given up: `None`).
    pub fn set_good_until(&self, root: &Id, good_until_ms: Option<i64>) {
        self.with(|i| {
            if let Some(w) = i.watched.get_mut(root) {
                w.good_until_ms = good_until_ms;
            }
        });
    }

    /// `root`'s runtime was stopped or ended: it is no longer watched.
    pub fn untrack(&self, root: &Id) {
        self.with(|i| i.watched.remove(root));
    }

    /// Stops every watched runtime whose lease is past its good-until instant at `now_ms`, and
    /// records its root for [`LeaseWatch::take_stopped`]; returns how many it stopped.
    pub fn check(&self, now_ms: i64) -> usize {
        self.with(|i| {
            let due: Vec<Id> = i
                .watched
                .iter()
                .filter(|(_, w)| w.good_until_ms.is_some_and(|t| t <= now_ms))
                .map(|(root, _)| root.clone())
                .collect();
            for root in &due {
                if let Some(w) = i.watched.remove(root) {
                    warn!(root = %root, "tree lease not renewed in time; stopping its provider");
                    w.handle.stop(None);
                    i.stopped.push((root.clone(), w.handle.generation()));
                }
            }
            due.len()
        })
    }

    /// The roots whose runtime the watchdog stopped since the last call, each with the
    /// generation of the runtime it stopped (a root launched again since is not affected).
    pub fn take_stopped(&self) -> Vec<(Id, u64)> {
        self.with(|i| std::mem::take(&mut i.stopped))
    }

    /// How many runtimes are watched.
    pub fn len(&self) -> usize {
        self.with(|i| i.watched.len())
    }

    /// Whether no runtime is watched.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
