//! Deletion: "deleting a root or child session atomically tombstones that session and all of its
//! nested child sessions, then removes their turns and interactions. A child must never remain as
//! an orphan after its ancestor is deleted."
//!
//! Issue 36: "Deleted means gone: a deletion removes the subtree's content (messages, tool
//! calls, interaction payloads, titles) from the store and from the outbox rows still kept,
//! leaving a tombstone with ids only." The tombstone keeps the session's ids, provider, relation,
//! times and version; its title and goal are cleared here, so neither the stored row nor the
//! published `sessionDeleted` row carries them. The stores rewrite the session's outbox rows
//! (see [`crate::step::Row::PurgeSession`]).

use super::tree::{Tree, Tx};
use crate::error::Rejected;
use crate::keyed::Hint;
use crate::model::Id;
use crate::step::Reply;
use std::sync::Arc;

/// The session and every nested child (depth-first, parents before children).
pub(crate) fn subtree(tree: &Tree, session: &Id) -> Vec<Id> {
    let mut out = vec![session.clone()];
    let mut i = 0;
    while i < out.len() {
        if let Some(kids) = tree.children.get(&out[i]) {
            out.extend(kids.iter().cloned());
        }
        i += 1;
    }
    out
}

/// `deleteSession`. A subtree with an active turn is rejected: cancel first.
pub(crate) fn delete(tree: &mut Tree, now: i64, session: &Id) -> Result<Tx, Rejected> {
    let s = tree
        .sessions
        .get(session)
        .ok_or_else(|| Rejected::UnknownSession(session.clone()))?;
    if s.deleted_at.is_some() {
        return Err(Rejected::SessionDeleted(session.clone()));
    }
    let ids: Vec<Id> = subtree(tree, session)
        .into_iter()
        .filter(|id| {
            tree.sessions
                .get(id)
                .is_some_and(|s| s.deleted_at.is_none())
        })
        .collect();
    for id in &ids {
        if let Some(turn) = tree.sessions.get(id).and_then(|s| s.active_turn_id.clone()) {
            return Err(Rejected::ActiveTurnBlocksDelete {
                session: id.clone(),
                turn,
            });
        }
    }
    let mut tx = Tx::new(now);
    let doomed: crate::hash::FxSet<Id> = ids.iter().cloned().collect();
    tree.turns
        .retain(|_, t| !doomed.contains(&t.agent_session_id));
    tree.interactions
        .retain(|_, i| !doomed.contains(&i.agent_session_id));
    tree.tool_calls.retain(|(s, _), _| !doomed.contains(s));
    let turns = &tree.turns;
    tree.pending.retain(|turn, _| turns.contains_key(turn));
    tree.open_tool_calls
        .retain(|turn, _| turns.contains_key(turn));
    tree.rebuild_provider_turns();
    for id in &ids {
        if let Some(hot) = tree.hot(id, Hint::NONE) {
            *hot = Default::default();
        }
        if let Some(s) = tree.sessions.get_mut(id).map(Arc::make_mut) {
            s.deleted_at = Some(now);
            s.active_turn_id = None;
            s.title = None;
            s.goal = None;
            s.usage = None;
        }
        tx.session(id, Hint::NONE, true);
        tx.purge(id);
    }
    tx.reply = Some(Reply::Deleted {
        sessions: ids.len() as u32,
    });
    Ok(tx)
}
