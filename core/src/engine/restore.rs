//! A [`TreeSnapshot`] from and into the engine's in-memory [`Tree`] (here rather than in
//! `snapshot.rs`, so the snapshot stays a leaf the engine depends on, not the other way round).

use super::Tree;
use crate::error::RestoreError;
use crate::keyed::Hint;
use crate::model::{CancelState, ChildOf, InteractionStatus, Session};
use crate::snapshot::TreeSnapshot;
use std::sync::Arc;

impl TreeSnapshot {
    pub(crate) fn from_tree(tree: &Tree) -> TreeSnapshot {
        let mut s = TreeSnapshot {
            sessions: tree.sessions.values().map(|s| (**s).clone()).collect(),
            turns: tree.turns.values().map(|t| (**t).clone()).collect(),
            interactions: tree.interactions.values().map(|i| (**i).clone()).collect(),
            tool_calls: tree.tool_calls.values().map(|c| (**c).clone()).collect(),
            cancel_operations: tree.ops.values().map(|o| (**o).clone()).collect(),
            message_ids: tree
                .message_ids()
                .map(|(s, m)| (s.clone(), m.clone()))
                .collect(),
        };
        s.canonicalize();
        s
    }

    pub(crate) fn into_tree(mut self) -> Result<Tree, RestoreError> {
        self.canonicalize();
        let mut roots = self.sessions.iter().filter(|s| s.is_root());
        let root = roots.next().ok_or(RestoreError::NoRoot)?.clone();
        if roots.next().is_some() {
            return Err(RestoreError::SeveralRoots);
        }
        let mut tree = Tree::new(root.id.clone(), root.workspace_id.clone());
        // Children in creation order (then id), so traversal order is deterministic.
        let mut kids: Vec<(&Session, &ChildOf)> = self
            .sessions
            .iter()
            .filter_map(|s| Some((s, s.child_of()?)))
            .collect();
        kids.sort_by(|(a, _), (b, _)| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        for (c, links) in kids {
            if links.root_agent_session_id != root.id {
                return Err(RestoreError::Inconsistent("child of another root"));
            }
            tree.children
                .get_or_insert_with(&links.parent_agent_session_id, Default::default)
                .push(c.id.clone());
        }
        for s in self.sessions {
            tree.sessions.insert(s.id.clone(), Arc::new(s));
        }
        for t in self.turns {
            let session = tree
                .sessions
                .get(&t.agent_session_id)
                .ok_or(RestoreError::Inconsistent("turn of an unknown session"))?;
            // Only root turns come from a user submission; the engine relies on it to tell a
            // child turn from a root turn without looking up the session.
            if session.is_child() != t.is_child() {
                return Err(RestoreError::Inconsistent(
                    "turn trigger does not match its session kind",
                ));
            }
            if let Some(rt) = session.root_turn_id().filter(|_| t.is_active()) {
                tree.active_children
                    .get_or_insert_with(rt, Default::default)
                    .insert(t.id.clone(), t.agent_session_id.clone());
            }
            tree.turns.insert(t.id.clone(), Arc::new(t));
        }
        for o in self.cancel_operations {
            tree.ops.insert(o.id.clone(), Arc::new(o));
        }
        for t in tree.turns.values() {
            if let Some(op) = &t.cancel_operation_id {
                let prepared = tree
                    .ops
                    .get(op)
                    .is_some_and(|o| o.state == CancelState::Prepared);
                if prepared && t.is_active() {
                    tree.inflight.insert(t.id.clone(), op.clone());
                }
            }
        }
        for i in self.interactions {
            if i.status == InteractionStatus::Pending {
                tree.pending
                    .get_or_insert_with(&i.turn_id, Default::default)
                    .push(i.request_id.clone());
            }
            tree.interactions
                .insert(i.turn_id.clone(), i.request_id.clone(), Arc::new(i));
        }
        for c in self.tool_calls {
            // Open tool calls of active turns are closed when their turn settles.
            if !crate::model::tool_call_status_is_terminal(&c.status)
                && tree.turns.get(&c.turn_id).is_some_and(|t| t.is_active())
            {
                tree.open_tool_calls
                    .get_or_insert_with(&c.turn_id, Default::default)
                    .push(c.tool_call_id.clone());
            }
            tree.tool_calls.insert(
                c.agent_session_id.clone(),
                c.tool_call_id.clone(),
                Arc::new(c),
            );
        }
        for (s, m) in self.message_ids {
            tree.hot(&s, Hint::NONE)
                .ok_or(RestoreError::Inconsistent(
                    "message id of an unknown session",
                ))?
                .message_ids
                .insert(m);
        }
        tree.rebuild_provider_turns();
        // Each session's latest turn, for the hot record.
        for pos in 0..tree.sessions.len() {
            let Some((id, s)) = tree.sessions.at(pos) else {
                continue;
            };
            let latest = s.last_turn_id.as_ref().and_then(|t| tree.turns.position(t));
            if let Some(turn) = latest {
                let id = id.clone();
                if let Some(hot) = tree.hot(&id, Hint::at(pos)) {
                    hot.turn = Hint::at(turn);
                }
            }
        }
        Ok(tree)
    }
}
