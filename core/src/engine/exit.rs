//! A provider process that exits unexpectedly: "every active turn of that tree settles
//! interrupted with an error naming the exit, in one step; nothing stays active". A root whose
//! cancel was in flight still settles canceled (the user's intent), and the operation fails.

use super::cancel::{resolve, Resolution};
use super::gate::{settle_turn, ProviderTransition};
use super::tree::{Tree, Tx};
use crate::error::Rejected;
use crate::keyed::Hint;
use crate::model::{CancelState, Id, Outcome, ProviderTurnState};
use crate::step::Ignored;
use std::sync::Arc;

/// `providerExited`.
pub(crate) fn provider_exited(tree: &mut Tree, now: i64, error: &str) -> Result<Tx, Rejected> {
    let root = tree.root_id.clone();
    let active = tree
        .sessions
        .get(&root)
        .and_then(|s| s.active_turn_id.clone());
    let mut prepared: Vec<Id> = tree
        .ops
        .values()
        .filter(|o| o.state == CancelState::Prepared)
        .map(|o| o.id.clone())
        .collect();
    prepared.sort();
    let Some(root_turn) = active else {
        if prepared.is_empty() {
            return Ok(Tx::ignore(now, Ignored::Stale));
        }
        let mut tx = Tx::new(now);
        for op in &prepared {
            let t = resolve(tree, now, op, Resolution::Failed(error.to_string()))?;
            tx = merge(tree, tx, t);
        }
        return Ok(tx);
    };
    let message = format!("provider exited: {error}");
    let mut tx = Tx::new(now);
    for op in &prepared {
        let t = resolve(tree, now, op, Resolution::Failed(message.clone()))?;
        tx = merge(tree, tx, t);
    }
    let mut children: Vec<Id> = tree
        .active_children
        .get(&root_turn)
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    children.sort();
    for c in &children {
        settle_turn(
            tree,
            &mut tx,
            (c, Hint::NONE),
            Outcome::Interrupted,
            Some(message.clone()),
        );
    }
    if let Some(t) = tree.turns.get_mut(&root_turn).map(Arc::make_mut) {
        if let Some(r) = t.root_provider_turn_mut() {
            if !matches!(r.state, ProviderTurnState::Completed(_)) {
                let interrupted = Some(message.clone());
                ProviderTransition::Complete(Outcome::Interrupted, interrupted).apply(r);
            }
        }
        tx.turn(&root_turn, Hint::NONE, true);
    }
    settle_turn(
        tree,
        &mut tx,
        (&root_turn, Hint::NONE),
        Outcome::Interrupted,
        Some(message),
    );
    Ok(tx)
}

/// Folds the effects of a nested transaction into `into` (both touch the same tree in one step).
fn merge(_tree: &mut Tree, mut into: Tx, other: Tx) -> Tx {
    into.absorb(other);
    into
}
