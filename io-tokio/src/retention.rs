//! Bounded memory and disk for a daemon that runs for months (issue 17, item 3: "memory and
//! disk grow with every session ever created").
//!
//! - Memory: settled trees leave the engine. After every group commit, each tree a step touched
//!   is either quiescent ([`tutti_core::Engine::is_quiescent`]: no active turn, no prepared
//!   cancel, no pending interaction) and goes to the back of a least-recently-used list, or
//!   active and leaves it. While the list holds more than [`Retention::resident_trees`] trees,
//!   the least recently touched one is evicted. The next input naming an evicted tree loads it
//!   from the file (as after a failed commit), so reads and commands never see a difference; the
//!   API's reads come from the file anyway. Choice: a small LRU (default 64) rather than evicting
//!   at once, so that a provider's late events right after a turn settles do not reload the tree
//!   each time; `resident_trees = 0` evicts at once.
//! - Disk: outbox rows are pruned by [`tutti_core::store::RetentionPolicy`] (count and age) every
//!   [`Retention::prune_interval_ms`], at most [`Retention::prune_batch`] rows per write
//!   transaction so that the engine thread is never held up long; never a row a live follower
//!   (an open `GET /v1/events`) has not been sent: [`LivePositions`] holds every follower's
//!   position and the pass prunes at most up to the lowest.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tutti_core::model::Id;
use tutti_core::store::RetentionPolicy;

/// How much the daemon keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Quiescent trees kept in the engine (the least recently touched beyond it are evicted).
    pub resident_trees: usize,
    /// Outbox rows kept.
    pub outbox: RetentionPolicy,
    /// Time between two outbox retention passes (ms; 0: never prune).
    pub prune_interval_ms: u64,
    /// Rows one retention transaction deletes at most (a pass goes on in further transactions,
    /// between other inputs, until nothing expired is left).
    pub prune_batch: usize,
}

impl Default for Retention {
    /// 64 resident quiescent trees; outbox: 100,000 rows and 7 days, pruned every minute in
    /// transactions of at most 10,000 rows.
    fn default() -> Self {
        Retention {
            resident_trees: 64,
            outbox: RetentionPolicy::default(),
            prune_interval_ms: 60_000,
            prune_batch: 10_000,
        }
    }
}

/// Quiescent loaded trees, least recently touched first.
#[derive(Debug, Default)]
pub(crate) struct QuiescentTrees {
    tick: u64,
    by_tick: BTreeMap<u64, Id>,
    by_root: HashMap<Id, u64>,
}

impl QuiescentTrees {
    /// The tree was touched and is quiescent: it becomes the most recent.
    pub fn touch(&mut self, root: &Id) {
        self.forget(root);
        self.tick += 1;
        self.by_tick.insert(self.tick, root.clone());
        self.by_root.insert(root.clone(), self.tick);
    }

    /// The tree is active (or gone): it is not a candidate for eviction.
    pub fn forget(&mut self, root: &str) {
        if let Some(t) = self.by_root.remove(root) {
            self.by_tick.remove(&t);
        }
    }

    /// Removes and returns the least recently touched tree while more than `keep` are listed.
    pub fn over(&mut self, keep: usize) -> Option<Id> {
        if self.by_root.len() <= keep {
            return None;
        }
        let (_, root) = self.by_tick.pop_first()?;
        self.by_root.remove(&root);
        Some(root)
    }

    /// How many are listed.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_root.len()
    }
}

/// The positions of the live outbox followers: the last seq each has been given.
///
/// A follower moves its own position without the registry's lock ([`LivePosition::set`]: one
/// atomic store per write, issue 33: a hundred followers of every commit no longer take turns
/// on one lock); registering, leaving and [`LivePositions::lowest`] take the lock.
#[derive(Debug, Default)]
pub struct LivePositions {
    inner: Mutex<(u64, BTreeMap<u64, Arc<AtomicU64>>)>,
}

/// One follower's registered position (see [`LivePositions::register`]).
#[derive(Debug)]
pub struct LivePosition {
    key: u64,
    at: Arc<AtomicU64>,
}

impl LivePosition {
    /// Moves the follower's position (it has been given every row up to `position`).
    pub fn set(&self, position: u64) {
        self.at.store(position, Ordering::SeqCst);
    }

    /// This follower's key (for [`LivePositions::remove`]).
    pub fn key(&self) -> u64 {
        self.key
    }
}

impl LivePositions {
    /// Registers a follower at `position`. A poisoned lock registers nothing (and then
    /// [`LivePositions::lowest`] protects every row).
    pub fn register(&self, position: u64) -> LivePosition {
        let at = Arc::new(AtomicU64::new(position));
        let key = match self.inner.lock() {
            Ok(mut g) => {
                g.0 += 1;
                let key = g.0;
                g.1.insert(key, at.clone());
                key
            }
            Err(_) => 0,
        };
        LivePosition { key, at }
    }

    /// The follower is gone.
    pub fn remove(&self, key: u64) {
        if let Ok(mut g) = self.inner.lock() {
            g.1.remove(&key);
        }
    }

    /// How many followers are live.
    pub fn count(&self) -> usize {
        self.inner.lock().map_or(0, |g| g.1.len())
    }

    /// The lowest position of any live follower (`None`: nobody follows). Rows above it have
    /// not been given to that follower yet and must stay. A poisoned lock protects everything.
    pub fn lowest(&self) -> Option<u64> {
        match self.inner.lock() {
            Ok(g) => g.1.values().map(|p| p.load(Ordering::SeqCst)).min(),
            Err(_) => Some(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_touched_quiescent_tree_is_evicted_first() {
        let mut q = QuiescentTrees::default();
        for r in ["a", "b", "c"] {
            q.touch(&Id::from(r));
        }
        q.touch(&Id::from("a"));
        q.forget("c");
        assert_eq!(q.len(), 2);
        assert_eq!(q.over(1), Some(Id::from("b")));
        assert_eq!(q.over(1), None);
        assert_eq!(q.over(0), Some(Id::from("a")));
    }

    #[test]
    fn the_lowest_live_position_protects_rows() {
        let p = LivePositions::default();
        assert_eq!(p.lowest(), None);
        let a = p.register(5);
        let b = p.register(9);
        assert_ne!(a.key(), b.key());
        assert_eq!(p.lowest(), Some(5));
        a.set(12);
        assert_eq!(p.lowest(), Some(9));
        p.remove(b.key());
        assert_eq!(p.lowest(), Some(12));
    }
}
