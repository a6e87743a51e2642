//! The durable entities of the spec, in their wire form (camelCase JSON).
//!
//! `WorkspaceAgentSession` ([`Session`]) is the identity and context boundary of one agent, root or
//! child; `WorkspaceAgentTurn` ([`Turn`]) is one turn inside it. Child lifecycle uses the same turn
//! phase and outcome vocabulary as root turns: "do not duplicate child lifecycle into a second
//! child-agent status field".

mod relation;
mod turn;
pub use relation::{ChildOf, Relation, RootOnly};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
pub use turn::{
    ChildTrigger, ChildTurn, ProviderTurnState, RootProviderTurn, RootTurn, Settlement, Turn,
    TurnRole, TurnState,
};

/// An identifier chosen by the host (session, turn, request, operation ids). Cheap to clone.
pub type Id = Arc<str>;

/// Shared, immutable text (a message's role and content): the input that carries it, the
/// engine's row and the driver all hold the same allocation, so passing a message through the
/// engine never copies its text. On the wire it is a plain JSON string.
pub type Text = Arc<str>;

/// A tool call's opaque JSON payload, shared like [`Text`]: the adapter's event, the engine's
/// tool call and its row hold the same allocation, so an update passes through the engine
/// without copying its JSON (a tool call's input and output can be large, and every update of
/// the call is a new row). On the wire it is the plain JSON value.
pub type Payload = Arc<serde_json::Value>;

/// Milliseconds since the Unix epoch, as given to [`crate::Engine::handle`]. The core never reads a clock.
pub type Millis = i64;

/// Root or child.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum SessionKind {
    /// A user-visible conversation.
    Root,
    /// A provider-native subordinate agent, hidden from ordinary navigation.
    Child,
}

/// Provider handles and aliases of a session ("threadId, taskId, agentId, and parentToolUseId").
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderAliases {
    /// Codex app-server thread id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_id: Option<String>,
    /// Claude SDK task id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// Claude SDK agent id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    /// Claude SDK launching tool-use id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_tool_use_id: Option<String>,
}

impl ProviderAliases {
    /// Fills every alias that `other` knows; known aliases are never erased.
    /// Returns whether anything changed.
    pub fn merge(&mut self, other: &ProviderAliases) -> bool {
        let mut changed = false;
        for (mine, theirs) in [
            (&mut self.thread_id, &other.thread_id),
            (&mut self.task_id, &other.task_id),
            (&mut self.agent_id, &other.agent_id),
            (&mut self.parent_tool_use_id, &other.parent_tool_use_id),
        ] {
            if theirs.is_some() && mine != theirs {
                *mine = theirs.clone();
                changed = true;
            }
        }
        changed
    }
}

/// The provider's latest report of a session's token use, where the provider reports one (ACP
/// `usage_update`, Codex `thread/tokenUsage/updated`). Display data: it never gates anything.
///
/// Each report updates the fields it carries and keeps the others ([`TokenUsage::merge`]): ACP
/// sends `cost` only on some updates, and a later update without it must not erase it.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenUsage {
    /// Tokens consumed over the session so far (Codex `total.totalTokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_tokens: Option<u64>,
    /// Tokens in the session's context window now (ACP `used`; Codex `last.totalTokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_tokens: Option<u64>,
    /// The size of the context window (ACP `size`; Codex `modelContextWindow`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u64>,
    /// The session's cumulative cost as the provider estimates it (ACP `cost`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<Cost>,
}

/// An amount of money in a currency (ACP `cost`).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cost {
    /// The amount.
    pub amount: f64,
    /// ISO 4217 currency code, as the provider sent it (for example `USD`).
    pub currency: String,
}

impl TokenUsage {
    /// Whether the report carries nothing.
    pub fn is_empty(&self) -> bool {
        *self == TokenUsage::default()
    }

    /// Takes every field `other` carries; fields it lacks stay. Returns whether anything changed.
    pub fn merge(&mut self, other: &TokenUsage) -> bool {
        let before = self.clone();
        for (mine, theirs) in [
            (&mut self.total_tokens, other.total_tokens),
            (&mut self.context_tokens, other.context_tokens),
            (&mut self.context_window, other.context_window),
        ] {
            if theirs.is_some() {
                *mine = theirs;
            }
        }
        if other.cost.is_some() {
            self.cost.clone_from(&other.cost);
        }
        *self != before
    }
}

/// What a provider declared it can do. "Provider adapters must expose whether root-turn guidance
/// is supported while only child agents are running": each adapter type states it once, as its
/// `CAPABILITIES` constant (for example [`CodexAdapter::CAPABILITIES`](crate::adapters::codex::CodexAdapter::CAPABILITIES)),
/// known before any provider process runs; a host passes it (or a narrower value from its
/// configuration) with `createSession`, and the engine asks only the root session's copy.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Capabilities {
    /// "Provider adapters must expose whether root-turn guidance is supported while only child
    /// agents are running."
    #[serde(default = "yes")]
    pub guide_while_children_only: bool,
}

fn yes() -> bool {
    true
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            guide_while_children_only: true,
        }
    }
}

/// `WorkspaceAgentSession`.
///
/// Its [`Relation`] (root or child, with the fields of that kind only) is set when the session is
/// built and cannot change afterwards; read it through [`Session::relation`] and the accessors
/// below. The wire form (camelCase JSON) is the flat one of the spec: `kind`, then the child's
/// link fields when it is a child, and `capabilities` (a child's are written as the default and
/// ignored when read: only a root's capabilities are consulted).
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// Canonical session id.
    pub id: Id,
    /// Owning workspace.
    pub workspace_id: Id,
    /// Root or child, with the fields of that kind only (immutable).
    relation: Relation,
    /// Provider name (`codex`, `claude`, `acp`, `demo`, ...).
    pub provider: Id,
    /// The provider's own id of this session (Codex thread id, ACP session id, ...).
    pub provider_session_id: Option<String>,
    /// Provider aliases.
    pub provider_aliases: ProviderAliases,
    /// Display title.
    pub title: Option<String>,
    /// The session's active turn, if any.
    pub active_turn_id: Option<Id>,
    /// The session's most recent turn (active or settled).
    pub last_turn_id: Option<Id>,
    /// Tombstone time.
    pub deleted_at: Option<Millis>,
    /// Provider-native workflow metadata (for example a Claude goal). Opaque; never gates anything.
    pub goal: Option<serde_json::Value>,
    /// The provider's latest token-use report for this session, if it sent one.
    pub usage: Option<TokenUsage>,
    /// Creation time.
    pub created_at: Millis,
    /// Last change.
    pub updated_at: Millis,
    /// Row version, incremented by every persisted change.
    pub version: u64,
}

impl Session {
    /// A new session created at `now` (version 0, no turns, no provider handles yet).
    pub fn new(id: Id, workspace_id: Id, relation: Relation, provider: Id, now: Millis) -> Session {
        Session {
            id,
            workspace_id,
            relation,
            provider,
            provider_session_id: None,
            provider_aliases: ProviderAliases::default(),
            title: None,
            active_turn_id: None,
            last_turn_id: None,
            deleted_at: None,
            goal: None,
            usage: None,
            created_at: now,
            updated_at: now,
            version: 0,
        }
    }

    /// Root or child, with the fields of that kind only.
    pub fn relation(&self) -> &Relation {
        &self.relation
    }

    /// `root` or `child`.
    pub fn kind(&self) -> SessionKind {
        self.relation.kind()
    }

    /// Whether this is a child session.
    pub fn is_child(&self) -> bool {
        matches!(self.relation, Relation::Child(_))
    }

    /// Whether this is a root session.
    pub fn is_root(&self) -> bool {
        matches!(self.relation, Relation::Root(_))
    }

    /// A child's links to its parent and root; `None` for a root.
    pub fn child_of(&self) -> Option<&ChildOf> {
        self.relation.child()
    }

    /// Child only: the session whose turn delegated this child.
    pub fn parent_agent_session_id(&self) -> Option<&Id> {
        self.child_of().map(|c| &c.parent_agent_session_id)
    }

    /// Child only: the turn that delegated this child.
    pub fn parent_turn_id(&self) -> Option<&Id> {
        self.child_of().map(|c| &c.parent_turn_id)
    }

    /// Child only: the delegation tool call, when known.
    pub fn parent_tool_call_id(&self) -> Option<&Id> {
        self.child_of().and_then(|c| c.parent_tool_call_id.as_ref())
    }

    /// Child only: the root session of the tree (the wire field `rootAgentSessionId`, absent on
    /// a root; see [`Session::tree_root_id`] for the root of any session).
    pub fn root_agent_session_id(&self) -> Option<&Id> {
        self.child_of().map(|c| &c.root_agent_session_id)
    }

    /// Child only: the root turn that owns this child.
    pub fn root_turn_id(&self) -> Option<&Id> {
        self.child_of().map(|c| &c.root_turn_id)
    }

    /// The root session of this session's tree: its own id for a root.
    pub fn tree_root_id(&self) -> &Id {
        match &self.relation {
            Relation::Root(_) => &self.id,
            Relation::Child(c) => &c.root_agent_session_id,
        }
    }

    /// Root only: the provider's capabilities.
    pub fn capabilities(&self) -> Option<&Capabilities> {
        self.relation.root_only().map(|r| &r.capabilities)
    }
}

/// What initiated a turn.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Trigger {
    /// A user submission (root turns only).
    User,
    /// Delegation from a parent turn (a child's initial turn).
    Delegation,
    /// Later guidance sent to a child session.
    Guidance,
}

/// Turn phase (closed vocabulary).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Phase {
    /// Accepted, not yet started by the provider.
    Submitted,
    /// The provider is working on it.
    Running,
    /// Waiting: for children (root) or for input (child).
    Waiting,
    /// Cancellation requested, awaiting the provider's answer.
    Settling,
    /// Terminal; `outcome` is set.
    Settled,
}

impl Phase {
    /// Submitted, running, waiting or settling.
    pub fn is_active(self) -> bool {
        self != Phase::Settled
    }
}

/// Terminal outcome.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Outcome {
    /// Finished normally.
    Completed,
    /// Finished with an error.
    Failed,
    /// Canceled by the user (and confirmed, or the root of a cancel).
    Canceled,
    /// Stopped without confirmation (cancel not acknowledged, provider exited).
    Interrupted,
}

impl Outcome {
    /// "The activity event contract permits turn errors only for failed or interrupted."
    pub fn allows_error(self) -> bool {
        matches!(self, Outcome::Failed | Outcome::Interrupted)
    }
}

/// Phase of the root provider turn (the provider's own lifecycle, distinct from the canonical root turn).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProviderPhase {
    /// No provider turn has started yet.
    Idle,
    /// A root provider turn is running (or reserved by guidance).
    Running,
    /// The root provider turn reached a terminal; its outcome is retained.
    Completed,
}

/// Status of an interaction (approval, prompt).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum InteractionStatus {
    /// Waiting for the user.
    Pending,
    /// The user answered; the answer was sent to the provider.
    Answered,
    /// The provider reported it resolved.
    Resolved,
    /// Its turn settled (for example by cancel) before it was resolved.
    Superseded,
}

/// A canonical interaction, keyed by (`agentSessionId`, `turnId`, `requestId`).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Interaction {
    /// Owning session (the exact child session for a child approval).
    pub agent_session_id: Id,
    /// Owning turn (the exact canonical child turn).
    pub turn_id: Id,
    /// Provider request id.
    pub request_id: Id,
    /// Provider turn id, kept only to route the answer back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_turn_id: Option<String>,
    /// Opaque kind.
    #[serde(default)]
    pub kind: serde_json::Value,
    /// Opaque payload.
    #[serde(default)]
    pub payload: serde_json::Value,
    /// Status.
    pub status: InteractionStatus,
    /// The user's answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<serde_json::Value>,
    /// The provider's resolution.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolution: Option<serde_json::Value>,
    /// Creation time.
    pub created_at: Millis,
    /// Last change.
    pub updated_at: Millis,
    /// Row version.
    pub version: u64,
}

/// One message of one session turn.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Message {
    /// Owning session.
    pub agent_session_id: Id,
    /// Owning turn.
    pub turn_id: Id,
    /// Provider message id (unique within the session).
    pub message_id: Id,
    /// Position within the session, from 0.
    pub seq: u64,
    /// `user`, `assistant`, `thought`, ...
    pub role: Text,
    /// Content.
    pub text: Text,
    /// Creation time.
    pub created_at: Millis,
}

/// Status given to a tool call still open when its turn settles (issue 23: "When a turn
/// settles, its still-open tool calls get a terminal status (choose the wire value, document it,
/// keep it distinct from a real completion)"). Chosen: `interrupted`, for every turn outcome
/// (completed, failed, canceled, interrupted), root or child: the provider never reported the
/// call's end, so the record says it was cut off, neither `completed` nor `failed`.
pub const TOOL_CALL_INTERRUPTED: &str = "interrupted";

/// The tool call statuses that end a tool call: a tool call with any other status (`pending`,
/// `in_progress`, `inProgress`, `started`, or one the engine does not know) is open and is
/// closed as [`TOOL_CALL_INTERRUPTED`] when its turn settles.
pub const TERMINAL_TOOL_CALL_STATUSES: [&str; 9] = [
    "completed",
    "failed",
    "declined",
    "rejected",
    "error",
    "canceled",
    "cancelled",
    "stopped",
    TOOL_CALL_INTERRUPTED,
];

/// Whether a tool call status is terminal ([`TERMINAL_TOOL_CALL_STATUSES`]).
pub fn tool_call_status_is_terminal(status: &str) -> bool {
    TERMINAL_TOOL_CALL_STATUSES.contains(&status)
}

/// A tool call of a turn (for example the parent delegation call).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolCall {
    /// Owning session (the session whose turn launched the tool).
    pub agent_session_id: Id,
    /// Owning turn.
    pub turn_id: Id,
    /// Provider tool call id.
    pub tool_call_id: Id,
    /// Tool name. (Shared text, like the status: a row of it is made at every update, so
    /// copying it must not allocate.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<Text>,
    /// Status (`started`, `completed`, `failed`, ... as the adapter normalizes it).
    pub status: Text,
    /// Opaque kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<serde_json::Value>,
    /// Opaque payload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Payload>,
    /// Creation time.
    pub created_at: Millis,
    /// Last change.
    pub updated_at: Millis,
    /// Row version.
    pub version: u64,
}

/// An exact cancel target.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Target {
    /// Session.
    pub agent_session_id: Id,
    /// Turn.
    pub turn_id: Id,
}

/// State of a durable cancel operation.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum CancelState {
    /// Recorded; the provider cancel has been requested and may be replayed after a crash.
    Prepared,
    /// The provider answered; every target settled.
    Completed,
    /// The provider call failed (or timed out, or the provider exited); targets settled anyway.
    Failed,
}

/// A durable cancel operation with its exact target set.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CancelOperation {
    /// Operation id.
    pub id: Id,
    /// Root session of the tree (locates the live provider runtime).
    pub root_agent_session_id: Id,
    /// The turn the user asked to cancel (the root turn, or one child turn).
    pub agent_session_id: Id,
    /// The turn the user asked to cancel.
    pub turn_id: Id,
    /// Whether the root turn is a target (a root cancel) or not (an exact child-only cancel).
    pub includes_root: bool,
    /// The exact targets, decided before any provider I/O.
    pub targets: Vec<Target>,
    /// Root cancels: how many child sessions the root turn had when the target set was recorded
    /// (no child may join after that).
    #[serde(default)]
    pub child_sessions_at_prepare: u32,
    /// The subset the provider acknowledged.
    #[serde(default)]
    pub acked: Vec<Target>,
    /// State.
    pub state: CancelState,
    /// Failure text when failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Deadline after which unconfirmed targets settle interrupted.
    pub deadline: Millis,
    /// Creation time.
    pub created_at: Millis,
    /// Last change.
    pub updated_at: Millis,
    /// Row version.
    pub version: u64,
}
