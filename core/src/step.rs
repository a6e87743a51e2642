//! What comes out of the engine: one [`Step`] per accepted input, pure data for the drivers.

use crate::input::TimerId;
use crate::model::{
    CancelOperation, Id, Interaction, Message, Millis, Session, Target, ToolCall, Turn,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use smallvec::SmallVec;
use std::sync::Arc;

/// The result of one accepted input. The driver commits `persist` as one transaction, then runs
/// `provider` requests in order, arms `timers`, publishes the outbox, and returns `reply`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    /// Rows, guards and outbox rows: one atomic unit.
    pub persist: PersistBatch,
    /// Provider requests, in order, to run after the commit.
    pub provider: Vec<ProviderRequest>,
    /// Timers to arm.
    pub timers: Vec<TimerRequest>,
    /// The command's reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply: Option<Reply>,
    /// Why an accepted input changed nothing (late or duplicate facts), for diagnostics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignored: Option<Ignored>,
}

impl Step {
    /// Whether the step does nothing at all.
    pub fn is_empty(&self) -> bool {
        self.persist.is_empty()
            && self.provider.is_empty()
            && self.timers.is_empty()
            && self.reply.is_none()
    }

    /// Ids of the turns whose rows this step publishes to the outbox.
    pub fn outbox_turns(&self) -> impl Iterator<Item = &Id> + '_ {
        self.persist.published().filter_map(|row| match row {
            Row::Turn(t) => Some(&t.id),
            _ => None,
        })
    }
}

/// One atomic persistence unit.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PersistBatch {
    /// The root tree this batch belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_agent_session_id: Option<Id>,
    /// The workspace of that tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_id: Option<Id>,
    /// Conditions the batch was decided under, checked inside the transaction. (A step that
    /// changes a turn or a session carries one or two: stored inline, so such a step allocates
    /// nothing for them.)
    pub guards: SmallVec<[Guard; 2]>,
    /// Rows to write, in order. (Most steps write one row: it is stored inline, so such a step
    /// allocates nothing for its rows.)
    pub rows: SmallVec<[Row; 1]>,
    /// Indexes into `rows` of the rows published to the outbox (one outbox row each, carrying the
    /// row's entity in its wire form), in order.
    pub outbox: SmallVec<[u32; 2]>,
}

impl PersistBatch {
    /// Nothing to write.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rows published to the outbox, in order.
    pub fn published(&self) -> impl Iterator<Item = &Row> + '_ {
        self.outbox
            .iter()
            .filter_map(|&i| self.rows.get(i as usize))
    }
}

/// A row write. Upserts carry the full new entity with its new `version`; a row already stored at
/// that version or newer is left alone, which makes every batch idempotent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "row", rename_all = "camelCase")]
pub enum Row {
    /// Upsert a session (a tombstone is a session with `deletedAt`). Shared with the engine's
    /// own copy: publishing a session costs one reference count, not a deep copy (the engine
    /// copies its session on write only while a step still holds it), and the row stays small
    /// (a session is twice the size of any other row, and most rows are messages and turns).
    Session(Arc<Session>),
    /// Upsert a turn (shared with the engine's own copy, as a session is).
    Turn(Arc<Turn>),
    /// Upsert an interaction (shared with the engine's own copy).
    Interaction(Arc<Interaction>),
    /// Insert a message (keyed by session and `seq`).
    Message(Message),
    /// Upsert a tool call (shared with the engine's own copy).
    ToolCall(Arc<ToolCall>),
    /// Upsert a cancel operation (shared with the engine's own copy).
    CancelOperation(Arc<CancelOperation>),
    /// Remove every turn, interaction, message and tool call of a (tombstoned) session, and
    /// redact its outbox rows still kept: each row of that session (a `session` row whose `id`
    /// it is, or a row whose payload's `agentSessionId` it is; its `sessionDeleted` row stays)
    /// keeps its seq, root and workspace, and becomes kind [`REDACTED`] with the payload
    /// `{"agentSessionId": ID, "kind": OLD_KIND}`: ids only, and the sequence stays gap-free for
    /// followers. Retention removes these rows like any other.
    PurgeSession {
        /// The session.
        agent_session_id: Id,
    },
}

/// The outbox kind of a row whose session was deleted (see [`Row::PurgeSession`]).
pub const REDACTED: &str = "redacted";

/// The payload of a redacted outbox row: ids only.
pub fn redacted_payload(agent_session_id: &str, kind: &str) -> Value {
    serde_json::json!({ "agentSessionId": agent_session_id, "kind": kind })
}

/// Whether an outbox row of `kind` with `payload` belongs to `session` and is redacted when that
/// session is purged (see [`Row::PurgeSession`]).
pub fn redacts(kind: &str, payload: &Value, session: &str) -> bool {
    let owner = match kind {
        "sessionDeleted" | "sessionPurged" | REDACTED => return false,
        "session" => &payload["id"],
        _ => &payload["agentSessionId"],
    };
    owner.as_str() == Some(session)
}

impl Row {
    /// The wire name of the entity kind, used as the outbox row's `kind`.
    pub fn kind(&self) -> &'static str {
        match self {
            Row::Session(s) if s.deleted_at.is_some() => "sessionDeleted",
            Row::Session(_) => "session",
            Row::Turn(_) => "turn",
            Row::Interaction(_) => "interaction",
            Row::Message(_) => "message",
            Row::ToolCall(_) => "toolCall",
            Row::CancelOperation(_) => "cancelOperation",
            Row::PurgeSession { .. } => "sessionPurged",
        }
    }

    /// The row's entity as wire JSON (the outbox payload).
    pub fn to_json(&self) -> Value {
        let r = match self {
            Row::Session(x) => serde_json::to_value(x),
            Row::Turn(x) => serde_json::to_value(x),
            Row::Interaction(x) => serde_json::to_value(x),
            Row::Message(x) => serde_json::to_value(x),
            Row::ToolCall(x) => serde_json::to_value(x),
            Row::CancelOperation(x) => serde_json::to_value(x),
            Row::PurgeSession { agent_session_id } => {
                Ok(serde_json::json!({ "agentSessionId": agent_session_id }))
            }
        };
        r.unwrap_or(Value::Null)
    }
}

/// A condition a batch was decided under. If one fails inside the transaction the whole batch is
/// rolled back ("rejected by persistence").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "guard",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum Guard {
    /// The session row is at `version` (0: absent) or already at `next` (this batch was applied).
    SessionVersion {
        /// Session.
        id: Id,
        /// Expected stored version.
        version: u64,
        /// The version this batch writes.
        next: u64,
    },
    /// The turn row is at `version` (0: absent) or already at `next`.
    TurnVersion {
        /// Turn.
        id: Id,
        /// Expected stored version.
        version: u64,
        /// The version this batch writes.
        next: u64,
    },
    /// The cancel operation row is at `version` (0: absent) or already at `next`.
    CancelVersion {
        /// Operation.
        id: Id,
        /// Expected stored version.
        version: u64,
        /// The version this batch writes.
        next: u64,
    },
    /// "Preparing the durable root cancel operation also closes child creation for that root
    /// turn": the root turn is stored with child creation open, unless the child already exists
    /// (a replay of this very batch).
    ChildCreationOpen {
        /// Root turn.
        root_turn_id: Id,
        /// The child being created.
        child_agent_session_id: Id,
    },
}

/// A request to the provider runtime of one root tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum ProviderRequest {
    /// Start a root provider turn for a new canonical root turn.
    Start {
        /// Locates the live provider runtime.
        root_agent_session_id: Id,
        /// Root session.
        agent_session_id: Id,
        /// New root turn.
        turn_id: Id,
        /// The user's message.
        text: String,
    },
    /// Append guidance to the active root turn.
    Guide {
        /// Locates the live provider runtime.
        root_agent_session_id: Id,
        /// Root session (guidance always targets the root).
        agent_session_id: Id,
        /// The active root turn.
        turn_id: Id,
        /// Steer the running root provider turn, or start one on the root (only children run).
        mode: GuideMode,
        /// The running root provider turn, for `steer` (`expectedTurnId`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        provider_turn_id: Option<String>,
        /// The user's message.
        text: String,
    },
    /// Cancel exactly these targets.
    Cancel {
        /// Durable operation.
        operation_id: Id,
        /// Locates the live provider runtime; not itself a target.
        root_agent_session_id: Id,
        /// Exact targets.
        targets: Vec<Target>,
    },
    /// Send the user's answer to a pending provider callback.
    RespondInteraction {
        /// Locates the live provider runtime.
        root_agent_session_id: Id,
        /// Canonical owner session.
        agent_session_id: Id,
        /// Canonical owner turn.
        turn_id: Id,
        /// Request id.
        request_id: Id,
        /// The provider's original turn id, for correlation.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        provider_turn_id: Option<String>,
        /// Opaque answer.
        response: Value,
    },
}

impl ProviderRequest {
    /// The root session whose runtime carries the request.
    pub fn root_agent_session_id(&self) -> &Id {
        match self {
            ProviderRequest::Start {
                root_agent_session_id,
                ..
            }
            | ProviderRequest::Guide {
                root_agent_session_id,
                ..
            }
            | ProviderRequest::Cancel {
                root_agent_session_id,
                ..
            }
            | ProviderRequest::RespondInteraction {
                root_agent_session_id,
                ..
            } => root_agent_session_id,
        }
    }
}

/// How guidance reaches the root.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum GuideMode {
    /// A root provider turn is running: steer it.
    Steer,
    /// Only children run: start a root provider turn attached to the same canonical root turn.
    StartOnRoot,
}

/// A timer to arm.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TimerRequest {
    /// What fires.
    pub timer: TimerId,
    /// When (ms since the epoch, in the engine's time).
    pub at: Millis,
}

/// A command's reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "reply",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum Reply {
    /// `createSession`.
    Created {
        /// The new session.
        agent_session_id: Id,
    },
    /// `submit` started a new root turn.
    Started {
        /// The new root turn.
        turn_id: Id,
    },
    /// `submit` appended to the active root turn.
    Appended {
        /// The active root turn.
        turn_id: Id,
    },
    /// The provider cannot guide the root while only children run; nothing was sent.
    PendingUnsupported {
        /// The active root turn.
        turn_id: Id,
    },
    /// `cancelTurn` recorded (or already had) this operation.
    CancelAccepted {
        /// Operation.
        operation_id: Id,
    },
    /// `respondInteraction` was recorded and sent.
    Responded,
    /// `deleteSession` tombstoned this many sessions.
    Deleted {
        /// Sessions tombstoned.
        sessions: u32,
    },
}

impl Reply {
    /// The wire name of a submit reply (`started`, `appended`, `pendingUnsupported`), or of any reply.
    pub fn name(&self) -> &'static str {
        match self {
            Reply::Created { .. } => "created",
            Reply::Started { .. } => "started",
            Reply::Appended { .. } => "appended",
            Reply::PendingUnsupported { .. } => "pendingUnsupported",
            Reply::CancelAccepted { .. } => "cancelAccepted",
            Reply::Responded => "responded",
            Reply::Deleted { .. } => "deleted",
        }
    }
}

/// Why an accepted input changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Ignored {
    /// An identical repeat of something already recorded.
    Duplicate,
    /// A fact about a turn that already settled (late after cancel or completion).
    LateAfterSettled,
    /// A fact for a closed cancellation target: cancellation fallout, not progress.
    ClosedCancelTarget,
    /// A root provider start after the canonical root settled or while it is being canceled.
    UnownedProviderTurn,
    /// A provider terminal that does not match the running provider turn.
    StaleProviderTurn,
    /// A terminal for a turn whose cancel is in flight; the cancel decides its outcome.
    CancelInFlight,
    /// The runtime answer is for an operation or reservation that is already over.
    Stale,
}
