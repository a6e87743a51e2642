//! A root tree's durable state, as storage loads it and as the engine restores it.
//!
//! A leaf: the conversions from and to the engine's in-memory tree live with the engine
//! (`engine/restore.rs`), so this module imports nothing of the engine's.

use crate::model::{CancelOperation, Id, Interaction, Session, ToolCall, Turn};
use serde::{Deserialize, Serialize};

/// Everything the engine keeps about one root tree. Vectors are in canonical order (sorted by
/// key), so two snapshots of the same state compare equal.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TreeSnapshot {
    /// The root session and every nested child (tombstones included), sorted by id.
    pub sessions: Vec<Session>,
    /// Every turn of those sessions, sorted by id.
    pub turns: Vec<Turn>,
    /// Every interaction, sorted by (turn, request).
    pub interactions: Vec<Interaction>,
    /// Every tool call, sorted by (session, tool call).
    pub tool_calls: Vec<ToolCall>,
    /// Every cancel operation, sorted by id.
    pub cancel_operations: Vec<CancelOperation>,
    /// (session, message id) of every message, sorted.
    pub message_ids: Vec<(Id, Id)>,
}

impl TreeSnapshot {
    /// Sorts every vector into canonical order.
    pub fn canonicalize(&mut self) {
        self.sessions.sort_by(|a, b| a.id.cmp(&b.id));
        self.turns.sort_by(|a, b| a.id.cmp(&b.id));
        self.interactions
            .sort_by(|a, b| (&a.turn_id, &a.request_id).cmp(&(&b.turn_id, &b.request_id)));
        self.tool_calls.sort_by(|a, b| {
            (&a.agent_session_id, &a.tool_call_id).cmp(&(&b.agent_session_id, &b.tool_call_id))
        });
        self.cancel_operations.sort_by(|a, b| a.id.cmp(&b.id));
        self.message_ids.sort();
    }

    /// The root session.
    pub fn root(&self) -> Option<&Session> {
        self.sessions.iter().find(|s| s.is_root())
    }
}
