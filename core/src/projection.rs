//! Read projections: "childSessions contains every nested child session below the requested
//! session as a flat collection. Clients reconstruct the tree from each child's parent fields".

use crate::hash::FxMap;
use crate::model::{Id, Session};
use serde::{Deserialize, Serialize};

/// `WorkspaceAgentSessionDetailResponse`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionDetail {
    /// The requested session.
    pub session: Session,
    /// Every nested child below it (not deleted), flat, parents before children.
    pub child_sessions: Vec<Session>,
}

impl SessionDetail {
    /// Builds the detail of `session` from every child session of its tree (any order).
    pub fn build(session: Session, tree_children: Vec<Session>) -> SessionDetail {
        let mut by_parent: FxMap<Id, Vec<Session>> = FxMap::default();
        for s in tree_children {
            if s.deleted_at.is_some() {
                continue;
            }
            if let Some(p) = s.parent_agent_session_id().cloned() {
                by_parent.entry(p).or_default().push(s);
            }
        }
        for v in by_parent.values_mut() {
            v.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        }
        let mut out = Vec::new();
        let mut queue = vec![session.id.clone()];
        let mut i = 0;
        while i < queue.len() {
            if let Some(kids) = by_parent.remove(&queue[i]) {
                for k in kids {
                    queue.push(k.id.clone());
                    out.push(k);
                }
            }
            i += 1;
        }
        SessionDetail {
            session,
            child_sessions: out,
        }
    }
}
