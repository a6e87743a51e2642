//! Child sessions and child turns: "child creation is one atomic session-and-initial-turn state
//! transition"; progress, waiting and terminal use the same vocabulary as root turns.

use super::gate::{evaluate_root, evaluate_root_at, settle_turn_at, RootTurn};
use super::tree::{at_hint, Tree, Tx};
use crate::error::Rejected;
use crate::keyed::same;
use crate::model::{
    ChildOf, Id, Outcome, Phase, ProviderAliases, Relation, Session, Trigger, Turn,
};
use crate::step::{Guard, Ignored};
use std::sync::Arc;

/// The fields of a `childSessionCreated` event.
pub(crate) struct NewChild<'a> {
    pub agent_session_id: &'a Id,
    pub turn_id: &'a Id,
    pub parent_agent_session_id: &'a Id,
    pub parent_turn_id: &'a Id,
    pub parent_tool_call_id: Option<&'a Id>,
    pub root_agent_session_id: &'a Id,
    pub root_turn_id: &'a Id,
    pub title: Option<&'a String>,
    pub provider_session_id: Option<&'a String>,
    pub provider_aliases: Option<&'a ProviderAliases>,
}

/// Creates a child session and its submitted initial turn. An identical repeat is a no-op; a
/// repeat with another relation is rejected; creation after the root settled or after a root
/// cancel closed child creation is rejected. Also returns the new session's position in
/// `tree.sessions` (none for a repeat).
pub(crate) fn create(
    tree: &mut Tree,
    now: i64,
    c: NewChild<'_>,
) -> Result<(Tx, Option<u32>), Rejected> {
    if let Some(existing) = tree.sessions.get(c.agent_session_id) {
        let same = existing.is_child()
            && existing.parent_agent_session_id() == Some(c.parent_agent_session_id)
            && existing.parent_turn_id() == Some(c.parent_turn_id)
            && existing.root_agent_session_id() == Some(c.root_agent_session_id)
            && existing.root_turn_id() == Some(c.root_turn_id)
            && (c.parent_tool_call_id.is_none()
                || existing.parent_tool_call_id() == c.parent_tool_call_id)
            && tree
                .turns
                .get(c.turn_id)
                .is_some_and(|t| t.agent_session_id == *c.agent_session_id);
        return if same {
            Ok((Tx::ignore(now, Ignored::Duplicate), None))
        } else {
            Err(Rejected::ConflictingChild(c.agent_session_id.clone()))
        };
    }
    if tree.turns.contains_key(c.turn_id) {
        return Err(Rejected::TurnExists(c.turn_id.clone()));
    }
    let inconsistent = |reason| Rejected::InconsistentRelation {
        child: c.agent_session_id.clone(),
        reason,
    };
    if *c.root_agent_session_id != tree.root_id {
        return Err(inconsistent("rootAgentSessionId is not the parent's root"));
    }
    let parent = tree
        .sessions
        .get(c.parent_agent_session_id)
        .ok_or_else(|| Rejected::UnknownSession(c.parent_agent_session_id.clone()))?;
    if parent.deleted_at.is_some() {
        return Err(Rejected::SessionDeleted(parent.id.clone()));
    }
    match tree.turns.get(c.parent_turn_id) {
        Some(t) if t.agent_session_id == parent.id => {}
        _ => {
            return Err(Rejected::UnknownTurn {
                session: parent.id.clone(),
                turn: c.parent_turn_id.clone(),
            })
        }
    }
    let expected_root_turn = parent.root_turn_id().unwrap_or(c.parent_turn_id);
    if expected_root_turn != c.root_turn_id {
        return Err(inconsistent("rootTurnId is not the parent's root turn"));
    }
    // The root turn is found once: its position serves every later use in this step.
    let root =
        RootTurn::find(tree, c.root_turn_id).ok_or_else(|| inconsistent("root turn unknown"))?;
    let (_, root_turn) = tree
        .turns
        .at(root.pos)
        .ok_or_else(|| inconsistent("root turn unknown"))?;
    if !root_turn.is_active() {
        return Err(Rejected::RootTurnSettled(c.root_turn_id.clone()));
    }
    if root_turn.child_creation_closed {
        return Err(Rejected::ChildCreationClosed(c.root_turn_id.clone()));
    }
    let workspace_id = parent.workspace_id.clone();
    let provider = parent.provider.clone();

    let mut tx = Tx::new(now);
    let id = c.agent_session_id.clone();
    let relation = Relation::Child(ChildOf {
        parent_agent_session_id: c.parent_agent_session_id.clone(),
        parent_turn_id: c.parent_turn_id.clone(),
        parent_tool_call_id: c.parent_tool_call_id.cloned(),
        root_agent_session_id: c.root_agent_session_id.clone(),
        root_turn_id: c.root_turn_id.clone(),
    });
    let mut session = Session::new(id.clone(), workspace_id, relation, provider, now);
    session.provider_session_id = c.provider_session_id.cloned();
    session.provider_aliases = c.provider_aliases.cloned().unwrap_or_default();
    session.title = c.title.cloned();
    session.active_turn_id = Some(c.turn_id.clone());
    session.last_turn_id = Some(c.turn_id.clone());
    let turn = new_turn(c.turn_id, &id, Trigger::Delegation, Phase::Submitted, now);
    let pos = tree.sessions.insert(id.clone(), Arc::new(session));
    let turn_pos = tree.insert_turn(pos, turn);
    tree.children
        .get_or_insert_with(c.parent_agent_session_id, Default::default)
        .push(id.clone());
    tree.active_children
        .get_or_insert_with(c.root_turn_id, Default::default)
        .insert(c.turn_id.clone(), id.clone());
    if let Some(rt) = tree
        .turns
        .at_id_mut(root.pos, c.root_turn_id)
        .map(Arc::make_mut)
    {
        rt.child_session_count += 1;
    }
    tx.guard(Guard::ChildCreationOpen {
        root_turn_id: c.root_turn_id.clone(),
        child_agent_session_id: id.clone(),
    });
    tx.session_at(&id, pos, true);
    tx.turn_at(c.turn_id, turn_pos, true);
    tx.turn_at(c.root_turn_id, root.pos, false);
    evaluate_root_at(tree, &mut tx, root);
    Ok((tx, Some(pos)))
}

pub(crate) fn new_turn(id: &Id, session: &Id, trigger: Trigger, phase: Phase, now: i64) -> Turn {
    Turn {
        id: id.clone(),
        agent_session_id: session.clone(),
        trigger,
        phase,
        outcome: None,
        error: None,
        root_provider_turn: None,
        provider_turn_id: None,
        child_creation_closed: false,
        child_session_count: 0,
        cancel_operation_id: None,
        created_at: now,
        updated_at: now,
        version: 0,
    }
}

/// A live child session and its links to its parent and root.
type LiveChild<'t> = (&'t Session, &'t ChildOf);

/// Looks up a child session, rejecting root sessions with `what`.
fn child<'t>(tree: &'t Tree, session: &Id, what: &'static str) -> Result<LiveChild<'t>, Rejected> {
    let s = tree
        .sessions
        .get(session)
        .ok_or_else(|| Rejected::UnknownSession(session.clone()))?;
    live_child(s, session, what)
}

/// [`child`] for the session at `pos` in `tree.sessions` (its canonical id is `session`): no
/// index probe.
fn child_at<'t>(
    tree: &'t Tree,
    pos: u32,
    session: &Id,
    what: &'static str,
) -> Result<LiveChild<'t>, Rejected> {
    match tree.sessions.at(pos) {
        Some((id, s)) if same(id, session) => live_child(s, session, what),
        _ => child(tree, session, what),
    }
}

/// `s` if it is a child session that is not deleted.
fn live_child<'t>(
    s: &'t Session,
    session: &Id,
    what: &'static str,
) -> Result<LiveChild<'t>, Rejected> {
    if s.deleted_at.is_some() {
        return Err(Rejected::SessionDeleted(session.clone()));
    }
    match s.child_of() {
        Some(links) => Ok((s, links)),
        None => Err(Rejected::WrongKind {
            what,
            kind: "root",
            session: session.clone(),
        }),
    }
}

/// A turn of exactly the session at `pos` (canonical id `session`), and the turn's position in
/// `tree.turns`.
pub(crate) fn turn_at<'t>(
    tree: &'t Tree,
    pos: u32,
    session: &Id,
    turn: &Id,
) -> Result<(u32, &'t Turn), Rejected> {
    tree.turn_position(pos, session, turn)
        .and_then(|p| Some((p, &**tree.turns.at(p)?.1)))
        .ok_or_else(|| Rejected::UnknownTurn {
            session: session.clone(),
            turn: turn.clone(),
        })
}

/// Looks up a turn of exactly this session.
pub(crate) fn turn_of<'t>(tree: &'t Tree, session: &Id, turn: &Id) -> Result<&'t Turn, Rejected> {
    match tree.turns.get(turn) {
        Some(t) if t.agent_session_id == *session => Ok(t),
        _ => Err(Rejected::UnknownTurn {
            session: session.clone(),
            turn: turn.clone(),
        }),
    }
}

/// `childSessionUpdated`: merge later identity and title facts into the existing child.
pub(crate) fn update(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    title: Option<&String>,
    provider_session_id: Option<&String>,
    aliases: Option<&ProviderAliases>,
) -> Result<Tx, Rejected> {
    child(tree, session, "childSessionUpdated")?;
    let Some(s) = tree.sessions.get_mut(session) else {
        return Err(Rejected::UnknownSession(session.clone()));
    };
    let mut changed = false;
    if let Some(t) = title {
        if s.title.as_ref() != Some(t) {
            Arc::make_mut(s).title = Some(t.clone());
            changed = true;
        }
    }
    if let Some(p) = provider_session_id {
        if s.provider_session_id.as_ref() != Some(p) {
            Arc::make_mut(s).provider_session_id = Some(p.clone());
            changed = true;
        }
    }
    if let Some(a) = aliases {
        // Merged into a copy first: an unchanged session is not copied on write.
        let mut merged = s.provider_aliases.clone();
        if merged.merge(a) {
            Arc::make_mut(s).provider_aliases = merged;
            changed = true;
        }
    }
    if !changed {
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    let mut tx = Tx::new(now);
    tx.session(session, true);
    Ok(tx)
}

/// `turnStarted` on a child: the turn runs; a new turn id opens the child's next (guidance) turn
/// under the same root relation.
pub(crate) fn turn_started(
    tree: &mut Tree,
    now: i64,
    (session, pos): (&Id, u32),
    turn: &Id,
    provider_turn_id: Option<&String>,
) -> Result<Tx, Rejected> {
    let (s, links) = child_at(
        tree,
        pos,
        session,
        "turnStarted (use rootProviderTurnStarted)",
    )?;
    let root_turn = links.root_turn_id.clone();
    let mut tx = Tx::new(now);
    let found = match tree.turn_position(pos, session, turn) {
        Some(p) => tree.turns.at(p).map(|(_, t)| (p, t)),
        // A turn of another session.
        None if tree.turns.contains_key(turn) => return Err(Rejected::TurnExists(turn.clone())),
        None => None,
    };
    match found {
        Some((p, t)) => {
            if !t.is_active() {
                return Ok(Tx::ignore(now, Ignored::LateAfterSettled));
            }
            if tree.inflight.contains_key(turn) {
                return Ok(Tx::ignore(now, Ignored::CancelInFlight));
            }
            if t.phase == Phase::Running
                && (provider_turn_id.is_none() || t.provider_turn_id.as_ref() == provider_turn_id)
            {
                return Ok(Tx::ignore(now, Ignored::Duplicate));
            }
            let Some(t) = tree.turns.at_mut(p).map(Arc::make_mut) else {
                return Err(Rejected::TurnNotActive(turn.clone()));
            };
            t.phase = Phase::Running;
            if let Some(p) = provider_turn_id {
                t.provider_turn_id = Some(p.clone());
            }
            tx.turn_at(turn, p, true);
        }
        None => {
            if let Some(active) = &s.active_turn_id {
                let _ = active;
                return Err(Rejected::ChildTurnActive(session.clone()));
            }
            let rt = tree
                .turns
                .get(&root_turn)
                .ok_or(Rejected::Invalid("root turn missing"))?;
            if !rt.is_active() {
                return Err(Rejected::RootTurnSettled(root_turn));
            }
            if rt.child_creation_closed {
                return Err(Rejected::ChildCreationClosed(root_turn));
            }
            let mut t = new_turn(turn, session, Trigger::Guidance, Phase::Running, now);
            t.provider_turn_id = provider_turn_id.cloned();
            let p = tree.insert_turn(pos, t);
            // Found at `pos` without an index lookup (looked up if it is not there).
            if let Some(s) = at_hint(&mut tree.sessions, pos, session).map(Arc::make_mut) {
                s.active_turn_id = Some(turn.clone());
                s.last_turn_id = Some(turn.clone());
            }
            tree.active_children
                .get_or_insert_with(&root_turn, Default::default)
                .insert(turn.clone(), session.clone());
            tx.session_at(session, pos, true);
            tx.turn_at(turn, p, true);
            evaluate_root(tree, &mut tx, &root_turn);
        }
    }
    Ok(tx)
}

/// `turnWaiting` on a child turn.
pub(crate) fn turn_waiting(
    tree: &mut Tree,
    now: i64,
    (session, pos): (&Id, u32),
    turn: &Id,
) -> Result<Tx, Rejected> {
    child_at(tree, pos, session, "turnWaiting")?;
    let (p, t) = turn_at(tree, pos, session, turn)?;
    if !t.is_active() {
        return Ok(Tx::ignore(now, Ignored::LateAfterSettled));
    }
    if tree.inflight.contains_key(turn) {
        return Ok(Tx::ignore(now, Ignored::CancelInFlight));
    }
    if t.phase == Phase::Waiting {
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    let mut tx = Tx::new(now);
    if let Some(t) = tree.turns.at_mut(p).map(Arc::make_mut) {
        t.phase = Phase::Waiting;
    }
    tx.turn_at(turn, p, true);
    Ok(tx)
}

/// `turnTerminal`: "a child terminal event settles only the exact child turn"; the same step then
/// re-evaluates the root gate. Rejected on a root turn: only the gate settles roots.
pub(crate) fn turn_terminal(
    tree: &mut Tree,
    now: i64,
    (session, pos): (&Id, u32),
    turn: &Id,
    outcome: Outcome,
    error: Option<String>,
) -> Result<Tx, Rejected> {
    let (_, links) = child_at(
        tree,
        pos,
        session,
        "turnTerminal (only the root gate settles roots)",
    )?;
    let root_turn = links.root_turn_id.clone();
    let (p, t) = turn_at(tree, pos, session, turn)?;
    if !t.is_active() {
        return Ok(Tx::ignore(now, Ignored::LateAfterSettled));
    }
    if tree.inflight.contains_key(turn) {
        // The cancel operation decides this target's outcome.
        return Ok(Tx::ignore(now, Ignored::CancelInFlight));
    }
    let mut tx = Tx::new(now);
    settle_turn_at(tree, &mut tx, turn, p, outcome, error);
    evaluate_root(tree, &mut tx, &root_turn);
    Ok(tx)
}
