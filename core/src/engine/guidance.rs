//! Root sessions, user submissions and guidance: "a new user message submitted while the root
//! turn is active is appended to the same in-flight work instead of creating a separate visible
//! turn".

use super::gate::{evaluate_root, ProviderTransition};
use super::tree::{Tree, Tx};
use crate::error::Rejected;
use crate::keyed::Hint;
use crate::model::{
    Capabilities, Id, Message, ProviderPhase, Relation, RootProviderTurn, Session, Turn, TurnState,
};
use crate::step::{GuideMode, Ignored, ProviderRequest, Reply};
use std::sync::Arc;

/// A new tree holding one root session.
pub(crate) fn create_root(
    now: i64,
    id: &Id,
    workspace_id: &Id,
    provider: &Id,
    title: Option<&String>,
    capabilities: Option<Capabilities>,
) -> (Tree, Tx) {
    let mut tree = Tree::new(id.clone(), workspace_id.clone());
    let relation = Relation::root(capabilities.unwrap_or_default());
    let mut root = Session::new(
        id.clone(),
        workspace_id.clone(),
        relation,
        provider.clone(),
        now,
    );
    root.title = title.cloned();
    tree.sessions.insert(id.clone(), Arc::new(root));
    let mut tx = Tx::new(now);
    tx.session(id, Hint::NONE, true);
    tx.reply = Some(Reply::Created {
        agent_session_id: id.clone(),
    });
    (tree, tx)
}

fn record_user_message(tree: &mut Tree, tx: &mut Tx, session: &Id, turn: &Id, text: &str) {
    let Some(ids) = tree.hot(session, Hint::NONE).map(|h| &mut h.message_ids) else {
        return;
    };
    // The id names the turn and the message's number; a provider message that took that id
    // already (ids are the provider's) gets a suffix, so the user's text is never lost and no
    // number is given twice.
    let number = ids.len();
    let mut message_id: Id = format!("user-{turn}-{number}").into();
    let mut again = 0;
    while ids.contains(&message_id) {
        again += 1;
        message_id = format!("user-{turn}-{number}.{again}").into();
    }
    let Some(seq) = ids.insert_numbered(&message_id) else {
        return;
    };
    tx.message(Message {
        agent_session_id: session.clone(),
        turn_id: turn.clone(),
        message_id,
        seq,
        role: "user".into(),
        text: text.into(),
        created_at: tx.now,
    });
}

/// `submit`: start a new root turn, or append to the active one (steer a running root provider
/// turn; start one on the root when only children run, reserving the provider lifecycle so the
/// gate cannot settle in between; or `pendingUnsupported` when the provider cannot).
pub(crate) fn submit(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    turn_id: &Id,
    text: &str,
) -> Result<Tx, Rejected> {
    let s = tree
        .sessions
        .get(session)
        .ok_or_else(|| Rejected::UnknownSession(session.clone()))?;
    if s.deleted_at.is_some() {
        return Err(Rejected::SessionDeleted(session.clone()));
    }
    if s.is_child() {
        return Err(Rejected::SubmitToChild(session.clone()));
    }
    let can_guide_children_only = s
        .capabilities()
        .is_some_and(|c| c.guide_while_children_only);
    let root = tree.root_id.clone();
    let mut tx = Tx::new(now);
    let Some(active) = s.active_turn_id.clone() else {
        if tree.turns.contains_key(turn_id) {
            return Err(Rejected::TurnExists(turn_id.clone()));
        }
        let turn = Turn::root(turn_id.clone(), session.clone(), TurnState::Submitted, now);
        tree.insert_turn((session, Hint::NONE), turn);
        if let Some(s) = tree.sessions.get_mut(session).map(Arc::make_mut) {
            s.active_turn_id = Some(turn_id.clone());
            s.last_turn_id = Some(turn_id.clone());
        }
        tx.session(session, Hint::NONE, true);
        tx.turn(turn_id, Hint::NONE, true);
        record_user_message(tree, &mut tx, session, turn_id, text);
        tx.provider.push(ProviderRequest::Start {
            root_agent_session_id: root,
            agent_session_id: session.clone(),
            turn_id: turn_id.clone(),
            text: text.to_string(),
        });
        tx.reply = Some(Reply::Started {
            turn_id: turn_id.clone(),
        });
        return Ok(tx);
    };
    if tree.inflight.contains_key(&active) {
        return Err(Rejected::CancelInProgress(active));
    }
    // The session's active turn is in its tree (restore and every handler keep it so); a tree
    // where it is not would get the user's message recorded on no turn.
    let rpt = tree
        .turns
        .get(&active)
        .ok_or_else(|| Rejected::Internal {
            what: "a session's activeTurnId names no turn of its tree",
            id: active.clone(),
        })?
        .root_provider_turn()
        .cloned()
        .unwrap_or_default();
    let mode = match rpt.phase() {
        ProviderPhase::Idle | ProviderPhase::Running => GuideMode::Steer,
        ProviderPhase::Completed if can_guide_children_only => GuideMode::StartOnRoot,
        ProviderPhase::Completed => {
            let mut tx = Tx::new(now);
            tx.reply = Some(Reply::PendingUnsupported { turn_id: active });
            return Ok(tx);
        }
    };
    if mode == GuideMode::StartOnRoot {
        if let Some(t) = tree.turns.get_mut(&active).map(Arc::make_mut) {
            if let Some(r) = t.root_provider_turn_mut() {
                ProviderTransition::Reserve.apply(r);
            }
        }
        tx.turn(&active, Hint::NONE, true);
        evaluate_root(tree, &mut tx, (&active, Hint::NONE));
    }
    record_user_message(tree, &mut tx, session, &active, text);
    tx.provider.push(ProviderRequest::Guide {
        root_agent_session_id: root,
        agent_session_id: session.clone(),
        turn_id: active.clone(),
        mode,
        provider_turn_id: match mode {
            GuideMode::Steer => rpt.provider_turn_id,
            GuideMode::StartOnRoot => None,
        },
        text: text.to_string(),
    });
    tx.reply = Some(Reply::Appended { turn_id: active });
    Ok(tx)
}

/// `guideFailed`: releases a guidance reservation; the gate may then settle the root.
pub(crate) fn guide_failed(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    turn: &Id,
) -> Result<Tx, Rejected> {
    let (_, t) = super::child::turn_of(tree, (session, Hint::NONE), turn)?;
    let reserved = t
        .root_provider_turn()
        .is_some_and(RootProviderTurn::reserved);
    if !t.is_active() || !reserved {
        return Ok(Tx::ignore(now, Ignored::Stale));
    }
    let mut tx = Tx::new(now);
    if let Some(t) = tree.turns.get_mut(turn).map(Arc::make_mut) {
        if let Some(r) = t.root_provider_turn_mut() {
            ProviderTransition::Release.apply(r);
        }
    }
    tx.turn(turn, Hint::NONE, true);
    evaluate_root(tree, &mut tx, (turn, Hint::NONE));
    Ok(tx)
}
