//! Typed rejections. A rejected input changes nothing and persists nothing.

use crate::model::Id;
use thiserror::Error;

/// Why the engine refused an input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Rejected {
    /// The session is not loaded (the driver may load its tree and retry) or does not exist.
    #[error("unknown session {0}")]
    UnknownSession(Id),
    /// The session was deleted.
    #[error("session {0} is deleted")]
    SessionDeleted(Id),
    /// `createSession` for an id that exists.
    #[error("session {0} already exists")]
    SessionExists(Id),
    /// The turn does not exist or belongs to another session.
    #[error("unknown turn {turn} of session {session}")]
    UnknownTurn {
        /// Session.
        session: Id,
        /// Turn.
        turn: Id,
    },
    /// A new turn id that already exists.
    #[error("turn {0} already exists")]
    TurnExists(Id),
    /// The input is for the other kind of session (for example `turnTerminal` on a root turn:
    /// only the root gate settles roots).
    #[error("{what} is not allowed on a {kind} session {session}")]
    WrongKind {
        /// What was attempted.
        what: &'static str,
        /// `root` or `child`.
        kind: &'static str,
        /// Session.
        session: Id,
    },
    /// The turn is not active.
    #[error("turn {0} is not active")]
    TurnNotActive(Id),
    /// A child's next turn while its current one is active.
    #[error("child session {0} already has an active turn")]
    ChildTurnActive(Id),
    /// A repeat of a child creation with another parent or root relation.
    #[error("child session {0} exists with another parent relation")]
    ConflictingChild(Id),
    /// The child's relation fields do not describe one consistent tree.
    #[error("child session {child}: inconsistent relation ({reason})")]
    InconsistentRelation {
        /// Child.
        child: Id,
        /// Which field is wrong.
        reason: &'static str,
    },
    /// "A child discovered only after the root turn settled" is not resurrected.
    #[error("root turn {0} is settled; no child or child turn may join it")]
    RootTurnSettled(Id),
    /// A root cancel was prepared: child creation is closed for that root turn.
    #[error("child creation is closed for root turn {0} (cancel prepared)")]
    ChildCreationClosed(Id),
    /// A submit while the root turn is being canceled.
    #[error("root turn {0} is being canceled")]
    CancelInProgress(Id),
    /// Operation id reused for another turn.
    #[error("cancel operation {0} exists for another turn")]
    OperationExists(Id),
    /// Unknown cancel operation.
    #[error("unknown cancel operation {0}")]
    UnknownOperation(Id),
    /// No interaction with that exact (session, turn, request) tuple.
    #[error("no interaction {request} on turn {turn} of session {session}")]
    UnknownInteraction {
        /// Session.
        session: Id,
        /// Turn.
        turn: Id,
        /// Request.
        request: Id,
    },
    /// The interaction was already answered, resolved or superseded.
    #[error("interaction {0} is not pending")]
    InteractionNotPending(Id),
    /// Direct user targeting of one child agent is not supported.
    #[error("submit targets root sessions only; {0} is a child")]
    SubmitToChild(Id),
    /// Deleting a tree with an active turn: cancel first.
    #[error("session {session} has an active turn {turn}: cancel it first")]
    ActiveTurnBlocksDelete {
        /// Session with the active turn.
        session: Id,
        /// The active turn.
        turn: Id,
    },
    /// A root provider event names a canonical root turn that disagrees with the root turn its
    /// provider turn id is already recorded on ("root provider facts belong to the provider
    /// turn they name").
    #[error("provider turn {provider_turn_id} belongs to root turn {owner}, not {turn}")]
    ProviderTurnOfAnotherTurn {
        /// The provider's turn id (transport metadata).
        provider_turn_id: String,
        /// The root turn the event named.
        turn: Id,
        /// The root turn the provider turn id is recorded on.
        owner: Id,
    },
    /// A duplicate id on a conflicting entity (a message id, a request id).
    #[error("{0}")]
    Invalid(&'static str),
    /// The engine found its own state inconsistent: not a fault of the input but of the tree
    /// it was applied to (a bug, or a stored tree that violates an invariant the engine relies
    /// on). Nothing changed. Distinct from [`Rejected::Invalid`] so that a host logs it as its
    /// own error and answers a caller 500 (`internal`), never 400 (issue 19: "an internal
    /// inconsistency is not `Rejected::Invalid` answered to an API caller as 400").
    #[error("internal inconsistency: {what} ({id})")]
    Internal {
        /// Which invariant does not hold.
        what: &'static str,
        /// The entity it was found on (an id, never content).
        id: Id,
    },
}

impl Rejected {
    /// A short stable code for APIs (`not_found`, `conflict`, `invalid`, `internal`).
    pub fn code(&self) -> &'static str {
        match self {
            Rejected::Internal { .. } => "internal",
            Rejected::UnknownSession(_)
            | Rejected::SessionDeleted(_)
            | Rejected::UnknownTurn { .. }
            | Rejected::UnknownOperation(_)
            | Rejected::UnknownInteraction { .. } => "not_found",
            Rejected::Invalid(_)
            | Rejected::WrongKind { .. }
            | Rejected::InconsistentRelation { .. }
            | Rejected::SubmitToChild(_) => "invalid",
            _ => "conflict",
        }
    }

    /// Whether this is the engine's own inconsistency ([`Rejected::Internal`]) rather than a
    /// refusal of the input.
    pub fn is_internal(&self) -> bool {
        matches!(self, Rejected::Internal { .. })
    }
}

/// A snapshot that cannot be restored.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RestoreError {
    /// No root session in the snapshot.
    #[error("snapshot has no root session")]
    NoRoot,
    /// More than one root session.
    #[error("snapshot has more than one root session")]
    SeveralRoots,
    /// A row refers to something missing or of another tree.
    #[error("snapshot is inconsistent: {0}")]
    Inconsistent(&'static str),
}
