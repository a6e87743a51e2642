//! What goes into the engine: normalized provider events, host commands, runtime answers, timers.
//!
//! Every input is one JSON object with a `type` tag (see `design.md`, "Scenario files").

use crate::model::{Capabilities, Id, Outcome, Payload, ProviderAliases, Target, Text};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A provider fact, normalized by an adapter. Adapters report facts; only the engine decides
/// whether a root turn is complete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum NormalizedEvent {
    /// `root_provider_turn_started`: the root provider turn (or a continuation of it) began.
    RootProviderTurnStarted {
        /// Root session.
        agent_session_id: Id,
        /// Canonical root turn, when the adapter knows it.
        #[serde(default)]
        turn_id: Option<Id>,
        /// Provider turn id (transport metadata).
        #[serde(default)]
        provider_turn_id: Option<String>,
    },
    /// `root_provider_turn_completed`: the current root provider turn reached a terminal. It never
    /// claims that the canonical root turn completed.
    RootProviderTurnCompleted {
        /// Root session.
        agent_session_id: Id,
        /// Canonical root turn, when the adapter knows it.
        #[serde(default)]
        turn_id: Option<Id>,
        /// Provider turn id.
        #[serde(default)]
        provider_turn_id: Option<String>,
        /// Outcome reported by the provider.
        outcome: Outcome,
        /// Error for failed/interrupted.
        #[serde(default)]
        error: Option<String>,
    },
    /// A child session and its submitted initial turn, created atomically.
    ChildSessionCreated {
        /// New child session.
        agent_session_id: Id,
        /// Its submitted initial turn.
        turn_id: Id,
        /// Direct parent session.
        parent_agent_session_id: Id,
        /// Direct parent turn.
        parent_turn_id: Id,
        /// Delegation tool call, when known.
        #[serde(default)]
        parent_tool_call_id: Option<Id>,
        /// Root session.
        root_agent_session_id: Id,
        /// Root turn.
        root_turn_id: Id,
        /// Title.
        #[serde(default)]
        title: Option<String>,
        /// Provider session id (for example the Codex child thread id).
        #[serde(default)]
        provider_session_id: Option<String>,
        /// Aliases known so far.
        #[serde(default)]
        provider_aliases: Option<ProviderAliases>,
    },
    /// Later identity or title facts for an existing child.
    ChildSessionUpdated {
        /// Child session.
        agent_session_id: Id,
        /// New title.
        #[serde(default)]
        title: Option<String>,
        /// Provider session id.
        #[serde(default)]
        provider_session_id: Option<String>,
        /// More aliases (merged; never erased).
        #[serde(default)]
        provider_aliases: Option<ProviderAliases>,
    },
    /// A child turn started running; a new turn id on a known child opens its next (guidance) turn.
    TurnStarted {
        /// Child session.
        agent_session_id: Id,
        /// Canonical child turn.
        turn_id: Id,
        /// Native turn id alias.
        #[serde(default)]
        provider_turn_id: Option<String>,
    },
    /// A child turn waits (for input, an approval, ...).
    TurnWaiting {
        /// Child session.
        agent_session_id: Id,
        /// Child turn.
        turn_id: Id,
    },
    /// A child turn reached a terminal. Settles only that exact child turn.
    TurnTerminal {
        /// Child session.
        agent_session_id: Id,
        /// Child turn.
        turn_id: Id,
        /// Outcome.
        outcome: Outcome,
        /// Error (kept for failed/interrupted only).
        #[serde(default)]
        error: Option<String>,
    },
    /// A transcript message of the exact session/turn.
    MessageAppended {
        /// Session.
        agent_session_id: Id,
        /// Turn.
        turn_id: Id,
        /// Message id (unique within the session; a repeat is a no-op).
        message_id: Id,
        /// Role.
        role: Text,
        /// Text.
        text: Text,
    },
    /// A tool call of the exact session/turn was created or changed.
    ToolCallUpdated {
        /// Session.
        agent_session_id: Id,
        /// Turn.
        turn_id: Id,
        /// Tool call id.
        tool_call_id: Id,
        /// Name.
        #[serde(default)]
        name: Option<Text>,
        /// Status.
        status: Text,
        /// Opaque kind.
        #[serde(default)]
        kind: Option<Value>,
        /// Opaque payload.
        #[serde(default)]
        payload: Option<Payload>,
    },
    /// The provider asks the user something; owned by the exact session/turn/request.
    InteractionRequested {
        /// Session.
        agent_session_id: Id,
        /// Turn.
        turn_id: Id,
        /// Request id.
        request_id: Id,
        /// Provider turn id for correlation.
        #[serde(default)]
        provider_turn_id: Option<String>,
        /// Opaque kind.
        #[serde(default)]
        kind: Value,
        /// Opaque payload.
        #[serde(default)]
        payload: Value,
    },
    /// The provider reports the interaction resolved.
    InteractionResolved {
        /// Session.
        agent_session_id: Id,
        /// Turn.
        turn_id: Id,
        /// Request id.
        request_id: Id,
        /// Opaque resolution.
        #[serde(default)]
        resolution: Value,
    },
    /// Provider-native session metadata (for example a Claude goal). Never settles or unlocks a root.
    SessionMetadataUpdated {
        /// Session.
        agent_session_id: Id,
        /// Opaque goal state.
        #[serde(default)]
        goal: Option<Value>,
        /// Title.
        #[serde(default)]
        title: Option<String>,
        /// The provider's own id of the session (for example the Codex root thread id).
        #[serde(default)]
        provider_session_id: Option<String>,
        /// A token-use report ([`TokenUsage`](crate::model::TokenUsage)), merged into the
        /// session's.
        #[serde(default)]
        usage: Option<crate::model::TokenUsage>,
    },
}

impl NormalizedEvent {
    /// A provider's token-use report for `session` as session metadata, or `None` when it
    /// carries no field (nothing to record). The one constructor every adapter uses.
    pub fn usage(session: Id, usage: crate::model::TokenUsage) -> Option<NormalizedEvent> {
        (!usage.is_empty()).then_some(NormalizedEvent::SessionMetadataUpdated {
            agent_session_id: session,
            goal: None,
            title: None,
            provider_session_id: None,
            usage: Some(usage),
        })
    }

    /// The session the event is about.
    pub fn agent_session_id(&self) -> &Id {
        use NormalizedEvent::*;
        match self {
            RootProviderTurnStarted {
                agent_session_id, ..
            }
            | RootProviderTurnCompleted {
                agent_session_id, ..
            }
            | ChildSessionUpdated {
                agent_session_id, ..
            }
            | TurnStarted {
                agent_session_id, ..
            }
            | TurnWaiting {
                agent_session_id, ..
            }
            | TurnTerminal {
                agent_session_id, ..
            }
            | MessageAppended {
                agent_session_id, ..
            }
            | ToolCallUpdated {
                agent_session_id, ..
            }
            | InteractionRequested {
                agent_session_id, ..
            }
            | InteractionResolved {
                agent_session_id, ..
            }
            | SessionMetadataUpdated {
                agent_session_id, ..
            } => agent_session_id,
            // A child is routed by its parent: the child itself is not known yet.
            ChildSessionCreated {
                parent_agent_session_id,
                ..
            } => parent_agent_session_id,
        }
    }

    /// The wire name of the event type (for logs).
    pub fn kind(&self) -> &'static str {
        use NormalizedEvent::*;
        match self {
            RootProviderTurnStarted { .. } => "rootProviderTurnStarted",
            RootProviderTurnCompleted { .. } => "rootProviderTurnCompleted",
            ChildSessionCreated { .. } => "childSessionCreated",
            ChildSessionUpdated { .. } => "childSessionUpdated",
            TurnStarted { .. } => "turnStarted",
            TurnWaiting { .. } => "turnWaiting",
            TurnTerminal { .. } => "turnTerminal",
            MessageAppended { .. } => "messageAppended",
            ToolCallUpdated { .. } => "toolCallUpdated",
            InteractionRequested { .. } => "interactionRequested",
            InteractionResolved { .. } => "interactionResolved",
            SessionMetadataUpdated { .. } => "sessionMetadataUpdated",
        }
    }
}

/// A host command (from the API or CLI). Ids are chosen by the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum Command {
    /// Create a root session.
    CreateSession {
        /// New session id.
        agent_session_id: Id,
        /// Workspace.
        workspace_id: Id,
        /// Provider name.
        provider: Id,
        /// Title.
        #[serde(default)]
        title: Option<String>,
        /// Provider capabilities.
        #[serde(default)]
        capabilities: Option<Capabilities>,
    },
    /// A user message to a root session.
    Submit {
        /// Root session.
        agent_session_id: Id,
        /// Turn id to use if a new root turn starts.
        turn_id: Id,
        /// The message.
        text: String,
    },
    /// Cancel a root turn (with its whole tree) or exactly one child turn.
    CancelTurn {
        /// Operation id.
        operation_id: Id,
        /// Session of the turn.
        agent_session_id: Id,
        /// Turn.
        turn_id: Id,
    },
    /// Answer a pending interaction by its exact canonical tuple.
    RespondInteraction {
        /// Session.
        agent_session_id: Id,
        /// Turn.
        turn_id: Id,
        /// Request id.
        request_id: Id,
        /// Opaque answer.
        #[serde(default)]
        response: Value,
    },
    /// Delete a session and every nested child.
    DeleteSession {
        /// Session.
        agent_session_id: Id,
    },
}

/// Answers of the runtime controller to provider requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum RuntimeAnswer {
    /// The bounded provider cancel returned; `acked` is the exact acknowledged subset.
    CancelResult {
        /// Operation.
        operation_id: Id,
        /// Acknowledged targets.
        #[serde(default)]
        acked: Vec<Target>,
    },
    /// The provider cancel failed (a failed write is not confirmation).
    CancelFailed {
        /// Operation.
        operation_id: Id,
        /// Failure text.
        error: String,
    },
    /// A guide request could not be delivered.
    GuideFailed {
        /// Root session.
        agent_session_id: Id,
        /// Root turn.
        turn_id: Id,
        /// Failure text.
        error: String,
    },
    /// The provider process of a tree exited unexpectedly.
    ProviderExited {
        /// Root session of the tree.
        root_agent_session_id: Id,
        /// What happened.
        error: String,
    },
    /// A timer the engine asked for fired.
    TimerFired {
        /// The timer.
        timer: TimerId,
    },
}

/// Timers the engine asks the driver to run.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(
    tag = "kind",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum TimerId {
    /// "Unconfirmed child turns use the generic interrupted timeout": if the provider cancel has
    /// not answered by then, the operation fails and its unconfirmed targets settle interrupted.
    CancelDeadline {
        /// Operation.
        operation_id: Id,
    },
}

/// Everything that goes into [`crate::Engine::handle`].
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A normalized provider event.
    Event(NormalizedEvent),
    /// A host command.
    Command(Command),
    /// A runtime answer.
    Runtime(RuntimeAnswer),
}

impl From<NormalizedEvent> for Input {
    fn from(e: NormalizedEvent) -> Self {
        Input::Event(e)
    }
}
impl From<Command> for Input {
    fn from(c: Command) -> Self {
        Input::Command(c)
    }
}
impl From<RuntimeAnswer> for Input {
    fn from(a: RuntimeAnswer) -> Self {
        Input::Runtime(a)
    }
}

const COMMANDS: &[&str] = &[
    "createSession",
    "submit",
    "cancelTurn",
    "respondInteraction",
    "deleteSession",
];
const ANSWERS: &[&str] = &[
    "cancelResult",
    "cancelFailed",
    "guideFailed",
    "providerExited",
    "timerFired",
];

impl Serialize for Input {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Input::Event(e) => e.serialize(s),
            Input::Command(c) => c.serialize(s),
            Input::Runtime(a) => a.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Input {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let v = Value::deserialize(d)?;
        let ty = v
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| D::Error::custom("input needs a string `type`"))?;
        if COMMANDS.contains(&ty) {
            Command::deserialize(v)
                .map(Input::Command)
                .map_err(D::Error::custom)
        } else if ANSWERS.contains(&ty) {
            RuntimeAnswer::deserialize(v)
                .map(Input::Runtime)
                .map_err(D::Error::custom)
        } else {
            NormalizedEvent::deserialize(v)
                .map(Input::Event)
                .map_err(D::Error::custom)
        }
    }
}

impl Input {
    /// The wire name of the input type (for logs).
    pub fn kind(&self) -> &'static str {
        match self {
            Input::Event(e) => e.kind(),
            Input::Command(c) => match c {
                Command::CreateSession { .. } => "createSession",
                Command::Submit { .. } => "submit",
                Command::CancelTurn { .. } => "cancelTurn",
                Command::RespondInteraction { .. } => "respondInteraction",
                Command::DeleteSession { .. } => "deleteSession",
            },
            Input::Runtime(a) => match a {
                RuntimeAnswer::CancelResult { .. } => "cancelResult",
                RuntimeAnswer::CancelFailed { .. } => "cancelFailed",
                RuntimeAnswer::GuideFailed { .. } => "guideFailed",
                RuntimeAnswer::ProviderExited { .. } => "providerExited",
                RuntimeAnswer::TimerFired { .. } => "timerFired",
            },
        }
    }
}
