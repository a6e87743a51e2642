//! Child sessions and child turns: "child creation is one atomic session-and-initial-turn state
//! transition"; progress, waiting and terminal use the same vocabulary as root turns.

use super::gate::{evaluate_root, settle_turn};
use super::tree::{Tree, Tx};
use crate::error::Rejected;
use crate::keyed::Hint;
use crate::model::{
    ChildOf, ChildTrigger, Id, Outcome, ProviderAliases, Relation, Session, Turn, TurnState,
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
    // The root turn is the parent turn (checked above) or the parent's own root turn: missing,
    // it is the tree that is inconsistent, not the event.
    let missing_root_turn = || Rejected::Internal {
        what: "a child's root turn is not in its tree",
        id: c.root_turn_id.clone(),
    };
    // The root turn is found once: its position serves every later use in this step.
    let (root_pos, root_turn) = tree
        .turns
        .get_hinted(c.root_turn_id, Hint::NONE)
        .ok_or_else(missing_root_turn)?;
    let root = (c.root_turn_id, Hint::at(root_pos));
    if !root_turn.is_active() {
        return Err(Rejected::RootTurnSettled(c.root_turn_id.clone()));
    }
    if root_turn.child_creation_closed() {
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
    let turn = Turn::child(
        c.turn_id.clone(),
        id.clone(),
        ChildTrigger::Delegation,
        TurnState::Submitted,
        now,
    );
    let pos = tree.sessions.insert(id.clone(), Arc::new(session));
    let turn_pos = tree.insert_turn((&id, Hint::at(pos)), turn);
    tree.children
        .get_or_insert_with(c.parent_agent_session_id, Default::default)
        .push(id.clone());
    tree.active_children
        .get_or_insert_with(c.root_turn_id, Default::default)
        .insert(c.turn_id.clone(), id.clone());
    if let Some((_, rt)) = tree.turns.get_mut_hinted(root.0, root.1) {
        if let Some(r) = Arc::make_mut(rt).root_turn_mut() {
            r.child_session_count += 1;
        }
    }
    tx.guard(Guard::ChildCreationOpen {
        root_turn_id: c.root_turn_id.clone(),
        child_agent_session_id: id.clone(),
    });
    tx.session(&id, Hint::at(pos), true);
    tx.turn(c.turn_id, Hint::at(turn_pos), true);
    tx.turn(root.0, root.1, false);
    evaluate_root(tree, &mut tx, root);
    Ok((tx, Some(pos)))
}

/// A live child session and its links to its parent and root.
type LiveChild<'t> = (&'t Session, &'t ChildOf);

/// The live child session `session` (`hint`: its position, if known), rejecting root sessions
/// with `what`.
fn child<'t>(
    tree: &'t Tree,
    (session, hint): (&Id, Hint),
    what: &'static str,
) -> Result<LiveChild<'t>, Rejected> {
    let (_, s) = tree
        .sessions
        .get_hinted(session, hint)
        .ok_or_else(|| Rejected::UnknownSession(session.clone()))?;
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

/// The turn `turn` of exactly `session` (`hint`: the session's position, if known), and the
/// turn's position in `tree.turns`.
pub(crate) fn turn_of<'t>(
    tree: &'t Tree,
    session: (&Id, Hint),
    turn: &Id,
) -> Result<(u32, &'t Turn), Rejected> {
    tree.turn_of_session(session, turn)
        .ok_or_else(|| Rejected::UnknownTurn {
            session: session.0.clone(),
            turn: turn.clone(),
        })
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
    child(tree, (session, Hint::NONE), "childSessionUpdated")?;
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
    tx.session(session, Hint::NONE, true);
    Ok(tx)
}

/// `turnStarted` on a child: the turn runs; a new turn id opens the child's next (guidance) turn
/// under the same root relation.
pub(crate) fn turn_started(
    tree: &mut Tree,
    now: i64,
    at: (&Id, Hint),
    turn: &Id,
    provider_turn_id: Option<&String>,
) -> Result<Tx, Rejected> {
    let session = at.0;
    let (s, links) = child(tree, at, "turnStarted (use rootProviderTurnStarted)")?;
    let root_turn = links.root_turn_id.clone();
    let mut tx = Tx::new(now);
    let found = match tree.turn_of_session(at, turn) {
        Some(found) => Some(found),
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
            if t.state == TurnState::Running
                && (provider_turn_id.is_none()
                    || t.provider_turn_id() == provider_turn_id.map(String::as_str))
            {
                return Ok(Tx::ignore(now, Ignored::Duplicate));
            }
            let Some((p, t)) = tree.turns.get_mut_hinted(turn, Hint::at(p)) else {
                return Err(Rejected::TurnNotActive(turn.clone()));
            };
            let t = Arc::make_mut(t);
            t.state = TurnState::Running;
            if let (Some(p), Some(c)) = (provider_turn_id, t.child_turn_mut()) {
                c.provider_turn_id = Some(p.clone());
            }
            tx.turn(turn, Hint::at(p), true);
        }
        None => {
            if let Some(active) = &s.active_turn_id {
                let _ = active;
                return Err(Rejected::ChildTurnActive(session.clone()));
            }
            let rt = tree
                .turns
                .get(&root_turn)
                .ok_or_else(|| Rejected::Internal {
                    what: "a child's root turn is not in its tree",
                    id: root_turn.clone(),
                })?;
            if !rt.is_active() {
                return Err(Rejected::RootTurnSettled(root_turn));
            }
            if rt.child_creation_closed() {
                return Err(Rejected::ChildCreationClosed(root_turn));
            }
            let mut t = Turn::child(
                turn.clone(),
                session.clone(),
                ChildTrigger::Guidance,
                TurnState::Running,
                now,
            );
            if let Some(c) = t.child_turn_mut() {
                c.provider_turn_id = provider_turn_id.cloned();
            }
            let p = tree.insert_turn(at, t);
            if let Some((_, s)) = tree.sessions.get_mut_hinted(session, at.1) {
                let s = Arc::make_mut(s);
                s.active_turn_id = Some(turn.clone());
                s.last_turn_id = Some(turn.clone());
            }
            tree.active_children
                .get_or_insert_with(&root_turn, Default::default)
                .insert(turn.clone(), session.clone());
            tx.session(session, at.1, true);
            tx.turn(turn, Hint::at(p), true);
            evaluate_root(tree, &mut tx, (&root_turn, Hint::NONE));
        }
    }
    Ok(tx)
}

/// `turnWaiting` on a child turn.
pub(crate) fn turn_waiting(
    tree: &mut Tree,
    now: i64,
    at: (&Id, Hint),
    turn: &Id,
) -> Result<Tx, Rejected> {
    child(tree, at, "turnWaiting")?;
    let (p, t) = turn_of(tree, at, turn)?;
    if !t.is_active() {
        return Ok(Tx::ignore(now, Ignored::LateAfterSettled));
    }
    if tree.inflight.contains_key(turn) {
        return Ok(Tx::ignore(now, Ignored::CancelInFlight));
    }
    if t.state == TurnState::Waiting {
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    let mut tx = Tx::new(now);
    if let Some((_, t)) = tree.turns.get_mut_hinted(turn, Hint::at(p)) {
        Arc::make_mut(t).state = TurnState::Waiting;
    }
    tx.turn(turn, Hint::at(p), true);
    Ok(tx)
}

/// `turnTerminal`: "a child terminal event settles only the exact child turn"; the same step then
/// re-evaluates the root gate. Rejected on a root turn: only the gate settles roots.
pub(crate) fn turn_terminal(
    tree: &mut Tree,
    now: i64,
    at: (&Id, Hint),
    turn: &Id,
    outcome: Outcome,
    error: Option<String>,
) -> Result<Tx, Rejected> {
    let (_, links) = child(tree, at, "turnTerminal (only the root gate settles roots)")?;
    let root_turn = links.root_turn_id.clone();
    let (p, t) = turn_of(tree, at, turn)?;
    if !t.is_active() {
        return Ok(Tx::ignore(now, Ignored::LateAfterSettled));
    }
    if tree.inflight.contains_key(turn) {
        // The cancel operation decides this target's outcome.
        return Ok(Tx::ignore(now, Ignored::CancelInFlight));
    }
    let mut tx = Tx::new(now);
    settle_turn(tree, &mut tx, (turn, Hint::at(p)), outcome, error);
    evaluate_root(tree, &mut tx, (&root_turn, Hint::NONE));
    Ok(tx)
}
