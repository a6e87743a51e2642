//! The checks shared by the fuzz targets and the simulation: the engine's invariant checker,
//! "stored state equals engine state", and the [`History`] rules that need a run's past.

use std::collections::{BTreeMap, BTreeSet};
use tutti_core::model::{CancelState, Id, InteractionStatus, Outcome, Phase, SessionKind};
use tutti_core::store::Store;
use tutti_core::{Engine, TreeSnapshot};

/// Rules that need the history of a run, not just its current state. The simulation and every
/// fuzz target feed it each state they observe.
///
/// - "a canceled root never reopens", generalized: a settled turn stays settled with the same
///   outcome (also across reloads);
/// - "no child exists that was first revealed after its root's cancel was prepared": the child
///   sessions of a root turn are frozen the first time a root cancel operation of it is seen;
/// - a tombstoned session stays tombstoned;
/// - "every outbox sequence is gap-free": outbox rows are numbered 1, 2, 3, ... without holes.
#[derive(Debug, Default, Clone)]
pub struct History {
    settled: BTreeMap<Id, Outcome>,
    frozen: BTreeMap<Id, BTreeSet<Id>>,
    tombstoned: BTreeSet<Id>,
    outbox_seen: u64,
}

impl History {
    /// A history with nothing seen.
    pub fn new() -> History {
        History::default()
    }

    /// Checks one tree's state against what was seen before, then remembers it.
    pub fn observe_tree(&mut self, t: &TreeSnapshot) -> Result<(), String> {
        for turn in &t.turns {
            match (self.settled.get(&turn.id), turn.phase(), turn.outcome()) {
                (Some(o), Phase::Settled, Some(now)) if *o != now => {
                    return Err(format!(
                        "turn {} settled {o:?} and later shows outcome {now:?}",
                        turn.id
                    ))
                }
                (Some(o), phase, _) if phase != Phase::Settled => {
                    return Err(format!(
                        "turn {} settled {o:?} and reopened as {phase:?} (a canceled root never reopens)",
                        turn.id
                    ))
                }
                (None, Phase::Settled, Some(o)) => {
                    self.settled.insert(turn.id.clone(), o);
                }
                _ => {}
            }
        }
        for op in t.cancel_operations.iter().filter(|o| o.includes_root) {
            let children: BTreeSet<Id> = t
                .sessions
                .iter()
                .filter(|s| s.kind() == SessionKind::Child && s.root_turn_id() == Some(&op.turn_id))
                .map(|s| s.id.clone())
                .collect();
            match self.frozen.get(&op.turn_id) {
                None => {
                    self.frozen.insert(op.turn_id.clone(), children);
                }
                Some(before) => {
                    if let Some(late) = children.difference(before).next() {
                        return Err(format!(
                            "child {late} was first revealed after the cancel of its root turn {} was prepared",
                            op.turn_id
                        ));
                    }
                }
            }
        }
        for s in &t.sessions {
            if s.deleted_at.is_some() {
                self.tombstoned.insert(s.id.clone());
            } else if self.tombstoned.contains(&s.id) {
                return Err(format!("deleted session {} came back", s.id));
            }
        }
        Ok(())
    }

    /// Checks that the outbox rows written since the last call continue the sequence without a
    /// gap.
    pub fn observe_outbox<S: Store>(&mut self, store: &S) -> Result<(), String> {
        let rows = store
            .outbox_after(self.outbox_seen, usize::MAX)
            .map_err(|e| format!("outbox read failed: {e}"))?;
        for r in rows {
            if r.seq != self.outbox_seen + 1 {
                return Err(format!(
                    "outbox sequence has a gap: {} follows {}",
                    r.seq, self.outbox_seen
                ));
            }
            self.outbox_seen = r.seq;
        }
        Ok(())
    }

    /// The last outbox sequence number seen.
    pub fn outbox_seen(&self) -> u64 {
        self.outbox_seen
    }
}

/// Every check after a step: the engine's invariant checker on every loaded tree (and the
/// engine's own indexes), "the stored state equals the engine's state" (so the stored trees pass
/// the checker too; the same checks as [`scenario::invariants`](tutti_core::scenario::invariants)),
/// and the [`History`] rules.
pub fn check_all<S: Store>(
    engine: &Engine,
    store: &S,
    history: &mut History,
) -> Result<(), String> {
    // What `scenario::invariants` checks, with one snapshot per tree: the checker on the engine
    // (its trees and its own indexes), then stored == engine, so the stored tree passes too.
    let v = engine.check_invariants();
    if !v.is_empty() {
        return Err(format!("invariants (engine): {v:?}"));
    }
    for root in engine.roots() {
        let Some(mem) = engine.snapshot(&root) else {
            continue;
        };
        let stored = store
            .load_tree(&root)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("tree {root} missing from the store"))?;
        if mem != stored {
            return Err(format!("store and engine differ for tree {root}"));
        }
        history.observe_tree(&mem)?;
    }
    history.observe_outbox(store)
}

/// The per-step checks for one tree (cheaper than [`check_all`] when several trees are loaded
/// and only one changed): the engine's state of `root` equals the stored one, the invariant
/// checker holds on it, and the [`History`] rules. The engine's own index checks
/// ([`Engine::check_invariants`]) and the outbox are left to [`check_all`].
pub fn check_one<S: Store>(
    engine: &Engine,
    store: &S,
    history: &mut History,
    root: &str,
) -> Result<(), String> {
    let Some(mem) = engine.snapshot(root) else {
        return Ok(());
    };
    let stored = store
        .load_tree(root)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("tree {root} missing from the store"))?;
    if mem != stored {
        return Err(format!("store and engine differ for tree {root}"));
    }
    let v = tutti_core::invariants::check_tree(&mem);
    if !v.is_empty() {
        return Err(format!("invariants: {v:?}"));
    }
    history.observe_tree(&mem)
}

/// Settled turns and prepared cancels of a state, for callers that check liveness.
pub fn unsettled(snap: &TreeSnapshot) -> Vec<String> {
    let mut v: Vec<String> = snap
        .turns
        .iter()
        .filter(|t| t.is_active())
        .map(|t| format!("turn {} is {:?}", t.id, t.phase()))
        .collect();
    v.extend(
        snap.cancel_operations
            .iter()
            .filter(|o| o.state == CancelState::Prepared)
            .map(|o| format!("cancel {} is still prepared", o.id)),
    );
    v.extend(
        snap.interactions
            .iter()
            .filter(|i| i.status == InteractionStatus::Pending)
            .map(|i| format!("interaction {} is still pending", i.request_id)),
    );
    v
}
