//! The root gate: "the root turn settles when the root provider turn is terminal and no nested
//! child turn is active, in whichever order those facts arrive", and the shared turn settlement.

use super::tree::{Tree, Tx};
use crate::error::Rejected;
use crate::keyed::{hash_id, same};
use crate::model::{Id, InteractionStatus, Outcome, Phase, ProviderPhase, Turn};
use crate::step::Ignored;
use std::sync::Arc;

/// Settles one turn: phase settled, outcome, error only where allowed ("a canonical canceled turn
/// must not retain a transport error"), clears the session's active turn, drops it from its root's
/// active-children set, and supersedes its pending interactions.
pub(crate) fn settle_turn(
    tree: &mut Tree,
    tx: &mut Tx,
    turn_id: &Id,
    outcome: Outcome,
    error: Option<String>,
) {
    if let Some(pos) = tree.turns.position(turn_id) {
        settle_turn_at(tree, tx, turn_id, pos, outcome, error);
    }
}

/// [`settle_turn`] for the turn at `pos` in `tree.turns` (nothing happens if another turn is
/// there).
pub(crate) fn settle_turn_at(
    tree: &mut Tree,
    tx: &mut Tx,
    turn_id: &Id,
    pos: u32,
    outcome: Outcome,
    error: Option<String>,
) {
    // Positions, so that the step is built without looking the turn and session up again.
    let Some(turn) = tree.turns.at_id_mut(pos, turn_id) else {
        return;
    };
    if !turn.is_active() {
        return;
    }
    let turn = Arc::make_mut(turn);
    turn.phase = Phase::Settled;
    turn.outcome = Some(outcome);
    turn.error = if outcome.allows_error() { error } else { None };
    let session_id = turn.agent_session_id.clone();
    tx.turn_at(turn_id, pos, true);
    tree.inflight.remove(turn_id);
    let session_pos = tree.sessions.position(&session_id).unwrap_or(u32::MAX);
    if let Some(s) = tree.sessions.at_mut(session_pos) {
        if s.active_turn_id.as_ref().is_some_and(|a| same(a, turn_id)) {
            Arc::make_mut(s).active_turn_id = None;
            tx.session_at(&session_id, session_pos, true);
        }
        if s.is_child() {
            if let Some(rt) = s.root_turn_id.clone() {
                if let Some(m) = tree.active_children.get_mut(&rt) {
                    m.remove(turn_id);
                }
            }
        }
    }
    if let Some(reqs) = tree.pending.remove(turn_id) {
        for req in reqs {
            if let Some(i) = tree.interactions.get_mut(turn_id, &req) {
                if i.status == InteractionStatus::Pending {
                    Arc::make_mut(i).status = InteractionStatus::Superseded;
                    tx.interaction(turn_id, &req);
                }
            }
        }
    }
}

/// A root turn found once: its id, the id's [`hash_id`] (it is also looked up in the maps keyed
/// by root turn) and its position in `tree.turns`.
#[derive(Clone, Copy)]
pub(crate) struct RootTurn<'a> {
    pub id: &'a Id,
    pub hash: u64,
    pub pos: u32,
}

impl<'a> RootTurn<'a> {
    /// Finds the turn `id` of `tree`.
    pub fn find(tree: &Tree, id: &'a Id) -> Option<RootTurn<'a>> {
        let hash = hash_id(id);
        let pos = tree.turns.position_hashed(hash, id)?;
        Some(RootTurn { id, hash, pos })
    }
}

/// Derives the root turn's visible phase from the provider lifecycle and its children; publishes
/// the root turn only if the phase changed.
pub(crate) fn refresh_root_phase(tree: &mut Tree, tx: &mut Tx, root_turn: &Id) {
    if let Some(root) = RootTurn::find(tree, root_turn) {
        refresh_root_phase_at(tree, tx, root);
    }
}

/// [`refresh_root_phase`] for a root turn already found.
fn refresh_root_phase_at(tree: &mut Tree, tx: &mut Tx, root: RootTurn<'_>) {
    let (hash, root_turn) = (root.hash, root.id);
    let children = tree.active_child_count_hashed(hash, root_turn);
    let inflight = tree.inflight.contains_key_hashed(hash, root_turn);
    let Some(turn) = tree.turns.at_id_mut(root.pos, root_turn) else {
        return;
    };
    if !turn.is_active() {
        return;
    }
    let provider = turn
        .root_provider_turn
        .as_ref()
        .map_or(ProviderPhase::Idle, |r| r.phase);
    let phase = if inflight {
        Phase::Settling
    } else {
        match provider {
            ProviderPhase::Running => Phase::Running,
            // With or without active children: the retained outcome waits for the gate (no
            // separate arm per case, which would only differ in a guard that changes nothing).
            ProviderPhase::Completed => Phase::Waiting,
            ProviderPhase::Idle if children > 0 => Phase::Running,
            ProviderPhase::Idle => Phase::Submitted,
        }
    };
    if turn.phase != phase {
        Arc::make_mut(turn).phase = phase;
        tx.turn_at(root_turn, root.pos, true);
    }
}

/// Applies the retained root provider outcome when the gate allows: the provider turn is terminal
/// (and no guidance reservation holds it), no nested child turn is active, and no cancel of the
/// root is in flight (then the cancel decides). Otherwise refreshes the root's phase.
pub(crate) fn evaluate_root(tree: &mut Tree, tx: &mut Tx, root_turn: &Id) {
    if let Some(root) = RootTurn::find(tree, root_turn) {
        evaluate_root_at(tree, tx, root);
    }
}

/// [`evaluate_root`] for a root turn already found: the id is hashed once for the maps keyed by
/// root turn, and the turn itself is reached by its position.
pub(crate) fn evaluate_root_at(tree: &mut Tree, tx: &mut Tx, root: RootTurn<'_>) {
    let (hash, root_turn) = (root.hash, root.id);
    let Some((_, turn)) = tree.turns.at(root.pos) else {
        return;
    };
    if !turn.is_active() {
        return;
    }
    let ready = turn
        .root_provider_turn
        .as_ref()
        .is_some_and(|r| r.phase == ProviderPhase::Completed && !r.reserved)
        && tree.active_child_count_hashed(hash, root_turn) == 0
        && !tree.inflight.contains_key_hashed(hash, root_turn);
    if ready {
        let (outcome, error) = turn
            .root_provider_turn
            .as_ref()
            .map(|r| {
                (
                    r.retained_outcome.unwrap_or(Outcome::Completed),
                    r.retained_error.clone(),
                )
            })
            .unwrap_or((Outcome::Completed, None));
        settle_turn_at(tree, tx, root_turn, root.pos, outcome, error);
    } else {
        refresh_root_phase_at(tree, tx, root);
    }
}

/// Resolves the canonical root turn a root provider event is about: the given one, else the
/// session's active turn, else its most recent turn (for late terminals after settlement).
pub(crate) fn resolve_root_turn<'t>(
    tree: &'t Tree,
    session: &Id,
    given: Option<&Id>,
) -> Result<(Id, &'t Turn), Rejected> {
    let s = tree
        .sessions
        .get(session)
        .ok_or_else(|| Rejected::UnknownSession(session.clone()))?;
    if s.is_child() {
        return Err(Rejected::WrongKind {
            what: "a root provider turn event",
            kind: "child",
            session: session.clone(),
        });
    }
    if s.deleted_at.is_some() {
        return Err(Rejected::SessionDeleted(session.clone()));
    }
    let id = match given {
        Some(t) => t.clone(),
        None => s
            .active_turn_id
            .clone()
            .or_else(|| s.last_turn_id.clone())
            .ok_or(Rejected::Invalid(
                "root provider event before any root turn",
            ))?,
    };
    match tree.turns.get(&id) {
        Some(t) if same(&t.agent_session_id, session) => Ok((id, t)),
        _ => Err(Rejected::UnknownTurn {
            session: session.clone(),
            turn: id,
        }),
    }
}

/// `rootProviderTurnStarted`: adopt the provider turn into the active canonical root turn, unless
/// the root settled or is being canceled ("a late root provider start is not adopted").
pub(crate) fn provider_started(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    turn: Option<&Id>,
    provider_turn_id: Option<String>,
) -> Result<Tx, Rejected> {
    let (root_turn, t) = resolve_root_turn(tree, session, turn)?;
    if !t.is_active() || tree.inflight.contains_key(&root_turn) {
        return Ok(Tx::ignore(now, Ignored::UnownedProviderTurn));
    }
    let rpt = t.root_provider_turn.clone().unwrap_or_default();
    if rpt.reserved && provider_turn_id.is_some() && provider_turn_id == rpt.provider_turn_id {
        // A repeat of the provider turn that completed before the guidance reservation.
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    if rpt.phase == ProviderPhase::Completed
        && provider_turn_id.is_some()
        && provider_turn_id == rpt.provider_turn_id
    {
        // A repeat of the start of the provider turn that already completed.
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    if rpt.phase == ProviderPhase::Running
        && !rpt.reserved
        && (provider_turn_id.is_none() || rpt.provider_turn_id == provider_turn_id)
    {
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    let mut tx = Tx::new(now);
    let Some(t) = tree.turns.get_mut(&root_turn).map(Arc::make_mut) else {
        return Ok(tx);
    };
    let r = t.root_provider_turn.get_or_insert_with(Default::default);
    r.phase = ProviderPhase::Running;
    r.reserved = false;
    r.retained_outcome = None;
    r.retained_error = None;
    if provider_turn_id.is_some() {
        r.provider_turn_id = provider_turn_id;
    }
    tx.turn(&root_turn, true);
    refresh_root_phase(tree, &mut tx, &root_turn);
    Ok(tx)
}

/// `rootProviderTurnCompleted`: retain the outcome and let the gate decide. After the canonical
/// root settled, "persist that late provider terminal into the root-provider lifecycle fields
/// without changing, republishing, or reopening the canonical root turn".
pub(crate) fn provider_completed(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    turn: Option<&Id>,
    provider_turn_id: Option<String>,
    outcome: Outcome,
    error: Option<String>,
) -> Result<Tx, Rejected> {
    let (root_turn, t) = resolve_root_turn(tree, session, turn)?;
    let rpt = t.root_provider_turn.clone().unwrap_or_default();
    let same_id = match (&rpt.provider_turn_id, &provider_turn_id) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    };
    let error = if outcome.allows_error() { error } else { None };
    if !t.is_active() {
        if rpt.phase == ProviderPhase::Completed || !same_id {
            return Ok(Tx::ignore(now, Ignored::LateAfterSettled));
        }
        let mut tx = Tx::new(now);
        let Some(t) = tree.turns.get_mut(&root_turn).map(Arc::make_mut) else {
            return Ok(tx);
        };
        let r = t.root_provider_turn.get_or_insert_with(Default::default);
        r.phase = ProviderPhase::Completed;
        r.retained_outcome = Some(outcome);
        r.retained_error = error;
        if provider_turn_id.is_some() {
            r.provider_turn_id = provider_turn_id;
        }
        tx.turn(&root_turn, false);
        tx.ignored = Some(Ignored::LateAfterSettled);
        return Ok(tx);
    }
    if rpt.reserved && provider_turn_id.is_some() && provider_turn_id == rpt.provider_turn_id {
        // A repeat of the completion that preceded the guidance reservation: it must not
        // release the reservation ("only when no ... reserved ... provider turn remains active").
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    match rpt.phase {
        ProviderPhase::Completed if same_id => return Ok(Tx::ignore(now, Ignored::Duplicate)),
        ProviderPhase::Completed => return Ok(Tx::ignore(now, Ignored::StaleProviderTurn)),
        ProviderPhase::Running if !rpt.reserved && !same_id => {
            return Ok(Tx::ignore(now, Ignored::StaleProviderTurn))
        }
        _ => {}
    }
    let mut tx = Tx::new(now);
    let Some(t) = tree.turns.get_mut(&root_turn).map(Arc::make_mut) else {
        return Ok(tx);
    };
    let r = t.root_provider_turn.get_or_insert_with(Default::default);
    r.phase = ProviderPhase::Completed;
    r.reserved = false;
    r.retained_outcome = Some(outcome);
    r.retained_error = error;
    if provider_turn_id.is_some() {
        r.provider_turn_id = provider_turn_id;
    }
    tx.turn(&root_turn, true);
    evaluate_root(tree, &mut tx, &root_turn);
    Ok(tx)
}
