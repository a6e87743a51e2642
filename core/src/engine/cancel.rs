//! Cancellation: "cancel is a fan-out operation over one root turn". The exact target set is
//! decided and recorded before any provider I/O; the provider's answer settles the targets.

use super::gate::{evaluate_root, settle_turn};
use super::tree::{Tree, Tx};
use crate::error::Rejected;
use crate::input::TimerId;
use crate::keyed::Hint;
use crate::model::{CancelOperation, CancelState, Id, Outcome, Target, TurnState};
use crate::step::{Ignored, ProviderRequest, Reply, TimerRequest};
use std::sync::Arc;

/// Text recorded on a child target the provider did not confirm.
pub const UNCONFIRMED: &str = "cancellation was not confirmed by the provider";

/// `cancelTurn`. On a root turn: targets are the root and every active nested child turn, and
/// child creation closes for that root turn. On a child turn: exactly that child ("an exact
/// child-only cancel ... without adding the root as a cancel target").
pub(crate) fn cancel_turn(
    tree: &mut Tree,
    now: i64,
    timeout_ms: i64,
    operation_id: &Id,
    session: &Id,
    turn: &Id,
) -> Result<Tx, Rejected> {
    if let Some(op) = tree.ops.get(operation_id) {
        if op.agent_session_id == *session && op.turn_id == *turn {
            let mut tx = Tx::ignore(now, Ignored::Duplicate);
            tx.reply = Some(Reply::CancelAccepted {
                operation_id: operation_id.clone(),
            });
            return Ok(tx);
        }
        return Err(Rejected::OperationExists(operation_id.clone()));
    }
    let s = tree
        .sessions
        .get(session)
        .ok_or_else(|| Rejected::UnknownSession(session.clone()))?;
    if s.deleted_at.is_some() {
        return Err(Rejected::SessionDeleted(session.clone()));
    }
    let (_, t) = super::child::turn_of(tree, (session, Hint::NONE), turn)?;
    if !t.is_active() {
        return Err(Rejected::TurnNotActive(turn.clone()));
    }
    if let Some(existing) = tree.inflight.get(turn) {
        // Already being canceled: the same operation answers.
        let mut tx = Tx::ignore(now, Ignored::Duplicate);
        tx.reply = Some(Reply::CancelAccepted {
            operation_id: existing.clone(),
        });
        return Ok(tx);
    }
    let includes_root = s.is_root();
    let root_turn = s.root_turn_id().unwrap_or(turn).clone();
    let mut targets = vec![Target {
        agent_session_id: session.clone(),
        turn_id: turn.clone(),
    }];
    if includes_root {
        let mut children: Vec<Target> = tree
            .active_children
            .get(turn)
            .map(|m| {
                m.iter()
                    .map(|(t, s)| Target {
                        agent_session_id: s.clone(),
                        turn_id: t.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        children.sort();
        targets.extend(children);
    }

    let mut tx = Tx::new(now);
    if includes_root {
        if let Some(rt) = tree.turns.get_mut(turn).map(Arc::make_mut) {
            if let Some(r) = rt.root_turn_mut() {
                r.child_creation_closed = true;
            }
        }
    }
    for target in &targets {
        tree.inflight
            .insert(target.turn_id.clone(), operation_id.clone());
        if let Some(t) = tree.turns.get_mut(&target.turn_id).map(Arc::make_mut) {
            t.cancel_operation_id = Some(operation_id.clone());
            t.state = TurnState::Settling;
        }
        tx.turn(&target.turn_id, Hint::NONE, true);
    }
    let deadline = now.saturating_add(timeout_ms);
    let child_sessions_at_prepare = tree
        .turns
        .get(&root_turn)
        .map_or(0, |t| t.child_session_count());
    tree.ops.insert(
        operation_id.clone(),
        Arc::new(CancelOperation {
            id: operation_id.clone(),
            root_agent_session_id: tree.root_id.clone(),
            agent_session_id: session.clone(),
            turn_id: turn.clone(),
            includes_root,
            targets: targets.clone(),
            child_sessions_at_prepare,
            acked: Vec::new(),
            state: CancelState::Prepared,
            error: None,
            deadline,
            created_at: now,
            updated_at: now,
            version: 0,
        }),
    );
    tx.op(operation_id);
    tx.provider.push(ProviderRequest::Cancel {
        operation_id: operation_id.clone(),
        root_agent_session_id: tree.root_id.clone(),
        targets,
    });
    tx.timers.push(TimerRequest {
        timer: TimerId::CancelDeadline {
            operation_id: operation_id.clone(),
        },
        at: deadline,
    });
    tx.reply = Some(Reply::CancelAccepted {
        operation_id: operation_id.clone(),
    });
    // No root-phase refresh here: preparing a cancel changes none of the root phase's inputs
    // for a child-only cancel (the child target stays active until the cancel resolves, the
    // root is not in flight, its provider turn is untouched), and a root cancel has already set
    // the root `settling` above. The phase changes when the operation resolves.
    Ok(tx)
}

/// How a cancel operation ended.
pub(crate) enum Resolution<'a> {
    /// The provider answered with the acknowledged subset.
    Acked(&'a [Target]),
    /// The provider call failed, timed out, or the provider exited.
    Failed(String),
}

/// Settles every target still owned by the operation, all in one step: the root target is always
/// canceled ("to preserve the user's intent"); acknowledged child targets are canceled, the rest
/// interrupted. Then re-evaluates the root gate (a child-only cancel may let the root settle from
/// its retained outcome, "not relabel the root as canceled").
pub(crate) fn resolve(
    tree: &mut Tree,
    now: i64,
    operation_id: &Id,
    how: Resolution<'_>,
) -> Result<Tx, Rejected> {
    let op = tree
        .ops
        .get(operation_id)
        .ok_or_else(|| Rejected::UnknownOperation(operation_id.clone()))?;
    if op.state != CancelState::Prepared {
        return Ok(Tx::ignore(now, Ignored::Stale));
    }
    let mut tx = Tx::new(now);
    let targets = op.targets.clone();
    let root_target = op.includes_root.then(|| op.turn_id.clone());
    let (acked, error): (Vec<Target>, Option<String>) = match &how {
        Resolution::Acked(a) => (
            targets.iter().filter(|t| a.contains(t)).cloned().collect(),
            None,
        ),
        Resolution::Failed(e) => (Vec::new(), Some(e.clone())),
    };
    let mut root_turns: Vec<Id> = Vec::new();
    for target in &targets {
        match tree.inflight.get(&target.turn_id) {
            Some(owner) if owner == operation_id => {}
            // Taken over by a later operation (a root cancel after a child-only one): the
            // provider's confirmation of this exact target still counts ("maps acknowledged
            // child targets to canceled"); anything else is left to the later operation.
            Some(_) if acked.contains(target) => {}
            _ => continue, // settled meanwhile
        }
        let is_root = root_target.as_ref() == Some(&target.turn_id);
        let (outcome, err) = if is_root || acked.contains(target) {
            (Outcome::Canceled, None)
        } else {
            (
                Outcome::Interrupted,
                Some(error.clone().unwrap_or_else(|| UNCONFIRMED.to_string())),
            )
        };
        if let Some(t) = tree.turns.get(&target.turn_id) {
            if let Some(rt) = tree.root_turn_of(t) {
                if !root_turns.contains(&rt) {
                    root_turns.push(rt);
                }
            }
        }
        tree.inflight.remove(&target.turn_id);
        if is_root {
            // Children first, so the root settles last within the step.
            continue;
        }
        settle_turn(tree, &mut tx, (&target.turn_id, Hint::NONE), outcome, err);
    }
    if let Some(root) = &root_target {
        if tree.turns.get(root).is_some_and(|t| t.is_active()) {
            settle_turn(tree, &mut tx, (root, Hint::NONE), Outcome::Canceled, None);
        }
    }
    if let Some(op) = tree.ops.get_mut(operation_id).map(Arc::make_mut) {
        op.acked = acked;
        match how {
            Resolution::Acked(_) => op.state = CancelState::Completed,
            Resolution::Failed(e) => {
                op.state = CancelState::Failed;
                op.error = Some(e);
            }
        }
    }
    tx.op(operation_id);
    for rt in root_turns {
        evaluate_root(tree, &mut tx, (&rt, Hint::NONE));
    }
    Ok(tx)
}

/// `timerFired` for a cancel deadline: an unanswered cancel fails; unconfirmed children settle
/// interrupted ("unconfirmed child turns use the generic interrupted timeout").
pub(crate) fn deadline(tree: &mut Tree, now: i64, operation_id: &Id) -> Result<Tx, Rejected> {
    resolve(
        tree,
        now,
        operation_id,
        Resolution::Failed("cancellation timed out".to_string()),
    )
}
