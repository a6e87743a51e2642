//! The root gate: "the root turn settles when the root provider turn is terminal and no nested
//! child turn is active, in whichever order those facts arrive", and the shared turn settlement.

use super::provider_turns::ProviderTurns;
use super::tree::{Tree, Tx};
use crate::error::Rejected;
use crate::keyed::{hash_id, same, Hint};
use crate::model::{
    Id, InteractionStatus, Outcome, ProviderTurnState, RootProviderTurn, Settlement, Turn,
    TurnState,
};
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
    turn.state = TurnState::Settled(Settlement::new(outcome, error));
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
    let provider = turn.root_provider_turn().map(|r| &r.state);
    let state = if inflight {
        TurnState::Settling
    } else {
        match provider {
            // A guidance reservation counts as running.
            Some(ProviderTurnState::Running | ProviderTurnState::Reserved(_)) => TurnState::Running,
            // With or without active children: the retained outcome waits for the gate (no
            // separate arm per case, which would only differ in a guard that changes nothing).
            Some(ProviderTurnState::Completed(_)) => TurnState::Waiting,
            Some(ProviderTurnState::Idle) | None if children > 0 => TurnState::Running,
            Some(ProviderTurnState::Idle) | None => TurnState::Submitted,
        }
    };
    if turn.state != state {
        Arc::make_mut(turn).state = state;
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
    let retained = match turn.root_provider_turn().map(|r| &r.state) {
        Some(ProviderTurnState::Completed(s)) => Some(s),
        _ => None,
    };
    let ready = retained.is_some()
        && tree.active_child_count_hashed(hash, root_turn) == 0
        && !tree.inflight.contains_key_hashed(hash, root_turn);
    if let Some(s) = retained.filter(|_| ready) {
        let (outcome, error) = (s.outcome(), s.error().map(str::to_string));
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

/// A transition of the root provider turn's lifecycle: the one place its flags are written.
#[derive(Debug, Clone)]
pub(super) enum ProviderTransition {
    /// A provider turn started: running, nothing retained.
    Start,
    /// The provider turn reached a terminal: completed, its outcome (and error) retained.
    Complete(Outcome, Option<String>),
    /// Guidance reserved the lifecycle for a provider turn it asked for.
    Reserve,
    /// The guide failed: the reservation is released back to completed (the outcome retained
    /// before it stays).
    Release,
}

impl ProviderTransition {
    /// Writes this transition into `r`. A reservation is taken only from completed (guidance
    /// reserves only after the provider turn completed) and released only from reserved; in any
    /// other state those two change nothing.
    pub(super) fn apply(self, r: &mut RootProviderTurn) {
        let state = std::mem::replace(&mut r.state, ProviderTurnState::Idle);
        r.state = match (self, state) {
            (ProviderTransition::Start, _) => ProviderTurnState::Running,
            (ProviderTransition::Complete(outcome, error), _) => {
                ProviderTurnState::Completed(Settlement::new(outcome, error))
            }
            (ProviderTransition::Reserve, ProviderTurnState::Completed(s)) => {
                ProviderTurnState::Reserved(s)
            }
            (ProviderTransition::Release, ProviderTurnState::Reserved(s)) => {
                ProviderTurnState::Completed(s)
            }
            (ProviderTransition::Reserve | ProviderTransition::Release, unchanged) => unchanged,
        };
    }
}

/// Applies `transition` to `root_turn`'s root provider turn and records `provider_turn_id` on it
/// (see [`record_provider_turn_id`]). False if the turn is gone.
fn transition(
    tree: &mut Tree,
    root_turn: &Id,
    transition: ProviderTransition,
    provider_turn_id: Option<String>,
) -> bool {
    let Some(t) = tree.turns.get_mut(root_turn).map(Arc::make_mut) else {
        return false;
    };
    let created_at = t.created_at;
    let Some(r) = t.root_provider_turn_mut() else {
        return false;
    };
    transition.apply(r);
    record_provider_turn_id(
        &mut tree.provider_turns,
        root_turn,
        created_at,
        r,
        provider_turn_id,
    );
    true
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
    let rpt = t.root_provider_turn().cloned().unwrap_or_default();
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
    // The provider turn recorded now (named, and the same).
    let current = provider_turn_id.is_some() && provider_turn_id == rpt.provider_turn_id;
    let repeat = match rpt.state {
        ProviderTurnState::Idle => false,
        // A repeated start of the running provider turn (or an unnamed one).
        ProviderTurnState::Running => provider_turn_id.is_none() || current,
        // A repeat of the start of the provider turn that completed (before the guidance
        // reservation, or for good).
        ProviderTurnState::Reserved(_) | ProviderTurnState::Completed(_) => current,
    };
    if repeat {
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    let mut tx = Tx::new(now);
    if !transition(
        tree,
        &root_turn,
        ProviderTransition::Start,
        provider_turn_id,
    ) {
        return Ok(tx);
    }
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
    let rpt = t.root_provider_turn().cloned().unwrap_or_default();
    let recorded = provider_turn_id.as_deref().is_some_and(|p| rpt.records(p));
    // Not a different provider turn than the one recorded (either may be unnamed).
    let same_id = match (&rpt.provider_turn_id, &provider_turn_id) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    };
    // The provider turn recorded now (named, and the same).
    let current = provider_turn_id.is_some() && provider_turn_id == rpt.provider_turn_id;
    let error = if outcome.allows_error() { error } else { None };
    if is_earlier(&rpt, provider_turn_id.as_deref()) {
        // A late or repeated terminal of a provider turn this root turn already moved past.
        return Ok(Tx::ignore(now, Ignored::StaleProviderTurn));
    }
    let root_active = t.is_active();
    use ProviderTurnState::{Completed, Idle, Reserved, Running};
    let ignored = match (&rpt.state, root_active) {
        // The settled root: only the provider turn still open on it may complete (its current
        // one, or under a guidance reservation the new one the reservation waited for).
        (Completed(_), false) if recorded => Some(Ignored::Duplicate),
        (Completed(_), false) => Some(Ignored::LateAfterSettled),
        (Reserved(_), false) if recorded => Some(Ignored::LateAfterSettled),
        (Idle | Running, false) if !same_id => Some(Ignored::LateAfterSettled),
        (_, false) => None,
        // A repeat of the completion that preceded the guidance reservation: it must not
        // release the reservation ("only when no ... reserved ... provider turn remains active").
        (Reserved(_), true) if current => Some(Ignored::Duplicate),
        (Completed(_), true) if same_id => Some(Ignored::Duplicate),
        (Completed(_), true) => Some(Ignored::StaleProviderTurn),
        (Running, true) if !same_id => Some(Ignored::StaleProviderTurn),
        (Idle | Running | Reserved(_), true) => None,
    };
    if let Some(why) = ignored {
        return Ok(Tx::ignore(now, why));
    }
    let mut tx = Tx::new(now);
    let complete = ProviderTransition::Complete(outcome, error);
    if !transition(tree, &root_turn, complete, provider_turn_id) {
        return Ok(tx);
    }
    tx.turn(&root_turn, Hint::NONE, root_active);
    if root_active {
        evaluate_root(tree, &mut tx, (&root_turn, Hint::NONE));
    } else {
        tx.ignored = Some(Ignored::LateAfterSettled);
    }
    Ok(tx)
}

#[cfg(test)]
mod tests {
    use super::ProviderTransition;
    use crate::model::{Outcome, ProviderTurnState, RootProviderTurn, Settlement};

    #[test]
    fn transitions_move_the_lifecycle_and_a_reservation_keeps_the_retained_outcome() {
        let failed = || Settlement::new(Outcome::Failed, Some("e".into()));
        let mut r = RootProviderTurn::default();
        assert_eq!(r.state, ProviderTurnState::Idle);
        // Nothing to reserve or release before a provider turn completed.
        ProviderTransition::Reserve.apply(&mut r);
        ProviderTransition::Release.apply(&mut r);
        assert_eq!(r.state, ProviderTurnState::Idle);
        ProviderTransition::Start.apply(&mut r);
        assert_eq!(r.state, ProviderTurnState::Running);
        ProviderTransition::Complete(Outcome::Failed, Some("e".into())).apply(&mut r);
        assert_eq!(r.state, ProviderTurnState::Completed(failed()));
        ProviderTransition::Reserve.apply(&mut r);
        assert_eq!(r.state, ProviderTurnState::Reserved(failed()));
        // A reservation reads as running on the wire.
        assert_eq!(r.phase(), crate::model::ProviderPhase::Running);
        ProviderTransition::Release.apply(&mut r);
        assert_eq!(r.state, ProviderTurnState::Completed(failed()));
        // A start clears what was retained.
        ProviderTransition::Start.apply(&mut r);
        assert_eq!(r.state, ProviderTurnState::Running);
        // "A canonical canceled turn must not retain a transport error."
        ProviderTransition::Complete(Outcome::Canceled, Some("e".into())).apply(&mut r);
        assert_eq!(r.retained_error(), None);
    }

    #[test]
    fn provider_transitions_write_the_persisted_flags_as_before() {
        let mut r = RootProviderTurn::default();
        ProviderTransition::Complete(Outcome::Failed, Some("e".into())).apply(&mut r);
        let json = |r: &RootProviderTurn| serde_json::to_value(r).unwrap_or_default();
        assert_eq!(
            json(&r),
            serde_json::json!({"phase": "completed", "retainedOutcome": "failed", "retainedError": "e"})
        );
        ProviderTransition::Reserve.apply(&mut r);
        assert_eq!(
            json(&r),
            serde_json::json!({"phase": "running", "retainedOutcome": "failed", "retainedError": "e", "reserved": true})
        );
        ProviderTransition::Start.apply(&mut r);
        assert_eq!(json(&r), serde_json::json!({"phase": "running"}));
    }
}
