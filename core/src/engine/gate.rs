//! The root gate: "the root turn settles when the root provider turn is terminal and no nested
//! child turn is active, in whichever order those facts arrive", and the shared turn settlement.

use super::provider_turns::ProviderTurns;
use super::tree::{Tree, Tx};
use crate::error::Rejected;
use crate::keyed::{hash_id, same, Hint};
use crate::model::{Id, InteractionStatus, Outcome, Phase, ProviderPhase, RootProviderTurn, Turn};
use crate::step::Ignored;
use std::sync::Arc;

/// Settles one turn: phase settled, outcome, error only where allowed ("a canonical canceled turn
/// must not retain a transport error"), clears the session's active turn, drops it from its root's
/// active-children set, and supersedes its pending interactions. `hint`: where the caller found
/// the turn in `tree.turns`, if it did (checked, see [`Hint`]).
pub(crate) fn settle_turn(
    tree: &mut Tree,
    tx: &mut Tx,
    (turn_id, hint): (&Id, Hint),
    outcome: Outcome,
    error: Option<String>,
) {
    // Positions, so that the step is built without looking the turn and session up again.
    let Some((pos, turn)) = tree.turns.get_mut_hinted(turn_id, hint) else {
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
    tx.turn(turn_id, Hint::at(pos), true);
    tree.inflight.remove(turn_id);
    if let Some((session_pos, s)) = tree.sessions.get_mut_hinted(&session_id, Hint::NONE) {
        if s.active_turn_id.as_ref().is_some_and(|a| same(a, turn_id)) {
            Arc::make_mut(s).active_turn_id = None;
            tx.session(&session_id, Hint::at(session_pos), true);
        }
        if let Some(rt) = s.root_turn_id().cloned() {
            if let Some(m) = tree.active_children.get_mut(&rt) {
                m.remove(turn_id);
            }
        }
    }
    close_open_tool_calls(tree, tx, turn_id, &session_id);
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

/// Issue 23: "When a turn settles, its still-open tool calls get a terminal status (choose the
/// wire value, document it, keep it distinct from a real completion)." Every tool call of the
/// settling turn whose status is not terminal ([`crate::model::tool_call_status_is_terminal`])
/// becomes [`crate::model::TOOL_CALL_INTERRUPTED`], whatever the turn's outcome, in the same
/// step as the turn (its row is persisted and published with the turn's). Only the turn's own
/// open tool calls are visited ([`super::tree::Tree::open_tool_calls`]), never the tree's.
fn close_open_tool_calls(tree: &mut Tree, tx: &mut Tx, turn_id: &Id, session_id: &Id) {
    let Some(calls) = tree.open_tool_calls.remove(turn_id) else {
        return;
    };
    for call in calls {
        if let Some(c) = tree.tool_calls.get_mut(session_id, &call) {
            if !crate::model::tool_call_status_is_terminal(&c.status) {
                Arc::make_mut(c).status = crate::model::TOOL_CALL_INTERRUPTED.into();
                tx.tool_call(session_id, &call);
            }
        }
    }
}

/// Derives the root turn's visible phase from the provider lifecycle and its children; publishes
/// the root turn only if the phase changed. `hint`: where the caller found the root turn in
/// `tree.turns`, if it did (checked).
pub(crate) fn refresh_root_phase(tree: &mut Tree, tx: &mut Tx, (root_turn, hint): (&Id, Hint)) {
    // Hashed once for both maps keyed by root turn.
    let hash = hash_id(root_turn);
    let children = tree.active_child_count_hashed(hash, root_turn);
    let inflight = tree.inflight.contains_key_hashed(hash, root_turn);
    let Some((pos, turn)) = tree.turns.get_mut_hinted(root_turn, hint) else {
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
        tx.turn(root_turn, Hint::at(pos), true);
    }
}

/// Applies the retained root provider outcome when the gate allows: the provider turn is terminal
/// (and no guidance reservation holds it), no nested child turn is active, and no cancel of the
/// root is in flight (then the cancel decides). Otherwise refreshes the root's phase. `hint`:
/// where the caller found the root turn in `tree.turns`, if it did (checked).
pub(crate) fn evaluate_root(tree: &mut Tree, tx: &mut Tx, (root_turn, hint): (&Id, Hint)) {
    let Some((pos, turn)) = tree.turns.get_hinted(root_turn, hint) else {
        return;
    };
    let hash = hash_id(root_turn);
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
        settle_turn(tree, tx, (root_turn, Hint::at(pos)), outcome, error);
    } else {
        refresh_root_phase(tree, tx, (root_turn, Hint::at(pos)));
    }
}

/// Resolves the canonical root turn a root provider event is about. "Root provider facts belong
/// to the provider turn they name": a provider turn id already recorded on a root turn resolves
/// to that turn, whatever turn is active now (the tree's provider turn index, no scan). Only a
/// provider turn id never seen before may bind to the session's active turn; with no active
/// turn it belongs to no turn (`Ok(None)`: the event is ignored — a late fact of a provider turn
/// whose start never arrived names its `turnId`, as every adapter's events do). An event with no
/// provider turn id at all keeps the old fallback: the active turn, else the most recent one.
///
/// When the event names its `turnId` and the provider turn id is recorded on another root turn,
/// the event is rejected ([`Rejected::ProviderTurnOfAnotherTurn`]). Choice: one exception, a
/// provider turn id reused by a *new* provider turn. Claude's `claude-N`/`synthetic-N` and
/// ACP's `prompt-<rpc id>` restart with the provider process, so the active root turn may
/// name an id that a settled root turn recorded before the restart; that event is the active
/// turn's. A disagreement in any other shape (the named turn settled, or the owner still
/// active) is rejected.
pub(crate) fn resolve_root_turn<'t>(
    tree: &'t Tree,
    session: &Id,
    given: Option<&Id>,
    provider_turn_id: Option<&str>,
) -> Result<Option<(Id, &'t Turn)>, Rejected> {
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
    let owner = provider_turn_id.and_then(|p| Some((p, tree.provider_turns.owner(p)?)));
    let id = match (given, owner) {
        (Some(g), Some((p, o))) if !same(g, o) => {
            let g_active = s.active_turn_id.as_ref().is_some_and(|a| same(a, g));
            let o_settled = tree.turns.get(o).is_none_or(|t| !t.is_active());
            if !(g_active && o_settled) {
                return Err(Rejected::ProviderTurnOfAnotherTurn {
                    provider_turn_id: p.to_string(),
                    turn: g.clone(),
                    owner: o.clone(),
                });
            }
            g.clone()
        }
        (Some(g), _) => g.clone(),
        (None, Some((_, o))) => o.clone(),
        (None, None) => match (&s.active_turn_id, provider_turn_id) {
            (Some(active), _) => active.clone(),
            // A provider turn never seen, no `turnId`, and no active root turn: it can belong
            // to no root turn the engine could name (only the active one may adopt it).
            (None, Some(_)) => return Ok(None),
            (None, None) => s.last_turn_id.clone().ok_or(Rejected::Invalid(
                "root provider event before any root turn",
            ))?,
        },
    };
    match tree.turns.get(&id) {
        Some(t) if same(&t.agent_session_id, session) => Ok(Some((id, t))),
        _ => Err(Rejected::UnknownTurn {
            session: session.clone(),
            turn: id,
        }),
    }
}

/// Makes `provider_turn_id` the root provider turn recorded on `root_turn` (created at
/// `created_at`): the id it replaces is kept in `earlierProviderTurnIds`, and the index learns
/// the new one.
fn record_provider_turn_id(
    index: &mut ProviderTurns,
    root_turn: &Id,
    created_at: i64,
    r: &mut RootProviderTurn,
    provider_turn_id: Option<String>,
) {
    let Some(p) = provider_turn_id else {
        return;
    };
    if r.provider_turn_id.as_deref() == Some(p.as_str()) {
        return;
    }
    index.record(&p, root_turn, created_at);
    if let Some(old) = r.provider_turn_id.replace(p) {
        if !r.earlier_provider_turn_ids.contains(&old) {
            r.earlier_provider_turn_ids.push(old);
        }
    }
}

/// Whether `provider_turn_id` is one this root turn already moved past (an earlier provider
/// turn replaced by a guidance or continuation provider turn).
fn is_earlier(rpt: &RootProviderTurn, provider_turn_id: Option<&str>) -> bool {
    provider_turn_id.is_some_and(|p| rpt.earlier_provider_turn_ids.iter().any(|e| e == p))
}

/// `rootProviderTurnStarted`: adopt the provider turn into the canonical root turn it belongs to
/// (see [`resolve_root_turn`]), unless that root settled or is being canceled ("a late root
/// provider start is not adopted"). A repeated start is a no-op, also after the root settled
/// and another root turn became active.
pub(crate) fn provider_started(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    turn: Option<&Id>,
    provider_turn_id: Option<String>,
) -> Result<Tx, Rejected> {
    let Some((root_turn, t)) = resolve_root_turn(tree, session, turn, provider_turn_id.as_deref())?
    else {
        return Ok(Tx::ignore(now, Ignored::UnownedProviderTurn));
    };
    let rpt = t.root_provider_turn.clone().unwrap_or_default();
    let recorded = provider_turn_id.as_deref().is_some_and(|p| rpt.records(p));
    if !t.is_active() || tree.inflight.contains_key(&root_turn) {
        let why = if recorded {
            Ignored::Duplicate
        } else {
            Ignored::UnownedProviderTurn
        };
        return Ok(Tx::ignore(now, why));
    }
    if is_earlier(&rpt, provider_turn_id.as_deref()) {
        // A repeat of a provider turn this root turn already moved past.
        return Ok(Tx::ignore(now, Ignored::StaleProviderTurn));
    }
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
    let created_at = t.created_at;
    let r = t.root_provider_turn.get_or_insert_with(Default::default);
    r.phase = ProviderPhase::Running;
    r.reserved = false;
    r.retained_outcome = None;
    r.retained_error = None;
    record_provider_turn_id(
        &mut tree.provider_turns,
        &root_turn,
        created_at,
        r,
        provider_turn_id,
    );
    tx.turn(&root_turn, Hint::NONE, true);
    refresh_root_phase(tree, &mut tx, (&root_turn, Hint::NONE));
    Ok(tx)
}

/// `rootProviderTurnCompleted`: retain the outcome and let the gate decide. The event "records
/// only that the current root provider turn reached a terminal": it is applied to the root turn
/// its provider turn belongs to (see [`resolve_root_turn`]), never to a later root turn.
///
/// After the canonical root settled, "persist that late provider terminal into the
/// root-provider lifecycle fields without changing, republishing, or reopening the canonical
/// root turn. A settled/canceled canonical root must not retain a stale
/// root_provider_turn_phase=running after that terminal is observed": the turn's
/// `rootProviderTurn` becomes completed with the provider's outcome kept, its phase, outcome and
/// error stay. Choice: that change is persisted as a turn row (version bumped, so the store and
/// a reload agree) with no outbox row — the canonical turn is not republished. A repeated
/// terminal is a no-op.
pub(crate) fn provider_completed(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    turn: Option<&Id>,
    provider_turn_id: Option<String>,
    outcome: Outcome,
    error: Option<String>,
) -> Result<Tx, Rejected> {
    let Some((root_turn, t)) = resolve_root_turn(tree, session, turn, provider_turn_id.as_deref())?
    else {
        return Ok(Tx::ignore(now, Ignored::UnownedProviderTurn));
    };
    let rpt = t.root_provider_turn.clone().unwrap_or_default();
    let recorded = provider_turn_id.as_deref().is_some_and(|p| rpt.records(p));
    let same_id = match (&rpt.provider_turn_id, &provider_turn_id) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    };
    let error = if outcome.allows_error() { error } else { None };
    if is_earlier(&rpt, provider_turn_id.as_deref()) {
        // A late or repeated terminal of a provider turn this root turn already moved past.
        return Ok(Tx::ignore(now, Ignored::StaleProviderTurn));
    }
    if !t.is_active() {
        // The provider turn still open on the settled root: its current one, or (under a
        // guidance reservation) the new one the reservation waited for.
        let open =
            rpt.phase != ProviderPhase::Completed && if rpt.reserved { !recorded } else { same_id };
        if !open {
            let why = if recorded && rpt.phase == ProviderPhase::Completed {
                Ignored::Duplicate
            } else {
                Ignored::LateAfterSettled
            };
            return Ok(Tx::ignore(now, why));
        }
        let mut tx = Tx::new(now);
        let Some(t) = tree.turns.get_mut(&root_turn).map(Arc::make_mut) else {
            return Ok(tx);
        };
        let created_at = t.created_at;
        let r = t.root_provider_turn.get_or_insert_with(Default::default);
        r.phase = ProviderPhase::Completed;
        r.reserved = false;
        r.retained_outcome = Some(outcome);
        r.retained_error = error;
        record_provider_turn_id(
            &mut tree.provider_turns,
            &root_turn,
            created_at,
            r,
            provider_turn_id,
        );
        tx.turn(&root_turn, Hint::NONE, false);
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
    let created_at = t.created_at;
    let r = t.root_provider_turn.get_or_insert_with(Default::default);
    r.phase = ProviderPhase::Completed;
    r.reserved = false;
    r.retained_outcome = Some(outcome);
    r.retained_error = error;
    record_provider_turn_id(
        &mut tree.provider_turns,
        &root_turn,
        created_at,
        r,
        provider_turn_id,
    );
    tx.turn(&root_turn, Hint::NONE, true);
    evaluate_root(tree, &mut tx, (&root_turn, Hint::NONE));
    Ok(tx)
}
