//! A turn's lifecycle as types (issue 30: "a turn's state as one enum whose variants carry what
//! that state has (settled carries its outcome; root provider turn states as an enum),
//! root/child differences in the types").
//!
//! - [`TurnState`]: submitted, running, waiting, settling, or settled with its [`Settlement`]
//!   (outcome, and an error only where the outcome allows one). A settled turn without an
//!   outcome, an active turn with one, or a canceled turn with an error cannot be built.
//! - [`TurnRole`]: a root turn ([`RootTurn`]: its root provider turn, child creation closed, the
//!   child sessions it counts) or a child turn ([`ChildTurn`]: delegation or guidance, and the
//!   provider's native turn id). A child turn with a root provider lifecycle, or a root turn
//!   triggered by delegation, cannot be built.
//! - [`ProviderTurnState`]: the root provider turn's lifecycle (idle, running, reserved by
//!   guidance, completed), the reserved and completed states carrying the retained outcome.
//!
//! The wire form is unchanged: a turn is still written with `trigger`, `phase`, `outcome`,
//! `error`, `rootProviderTurn` (`phase`, `retainedOutcome`, `reserved`, ...) and the flat
//! root/child fields, in the same order (see `turn_wire.rs`); reading a row whose fields
//! contradict each other is a decode error.

use super::{Id, Millis, Outcome, Phase, ProviderPhase, Trigger};

/// How a turn ended: its outcome, and the error where the outcome allows one ("a canonical
/// canceled turn must not retain a transport error").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    outcome: Outcome,
    error: Option<String>,
}

impl Settlement {
    /// `outcome`, keeping `error` only if the outcome allows one ([`Outcome::allows_error`]).
    pub fn new(outcome: Outcome, error: Option<String>) -> Settlement {
        let error = if outcome.allows_error() { error } else { None };
        Settlement { outcome, error }
    }

    /// The outcome.
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// The error (failed or interrupted only).
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }
}

/// A turn's lifecycle state: the spec's phase, with the outcome carried by the settled state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnState {
    /// Accepted, not yet started by the provider.
    Submitted,
    /// The provider is working on it.
    Running,
    /// Waiting: for children (root) or for input (child).
    Waiting,
    /// Cancellation requested, awaiting the provider's answer.
    Settling,
    /// Terminal, with its outcome.
    Settled(Settlement),
}

impl TurnState {
    /// The wire phase.
    pub fn phase(&self) -> Phase {
        match self {
            TurnState::Submitted => Phase::Submitted,
            TurnState::Running => Phase::Running,
            TurnState::Waiting => Phase::Waiting,
            TurnState::Settling => Phase::Settling,
            TurnState::Settled(_) => Phase::Settled,
        }
    }

    /// The settlement, once settled.
    pub fn settlement(&self) -> Option<&Settlement> {
        match self {
            TurnState::Settled(s) => Some(s),
            _ => None,
        }
    }
}

/// The root provider turn's lifecycle (the provider's own turn, distinct from the canonical
/// root turn). Guidance reserves it only after a provider turn completed, so the reserved state
/// keeps the outcome retained before it (a failed guide releases it back to completed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProviderTurnState {
    /// No provider turn has started yet.
    Idle,
    /// A provider turn is running.
    Running,
    /// Guidance asked the provider to start a provider turn while only children ran; it counts
    /// as running until that provider turn starts or the guide fails.
    Reserved(Settlement),
    /// The provider turn reached a terminal; its outcome is retained until the gate applies it.
    Completed(Settlement),
}

/// The root provider turn on a root turn: its state and the provider turn ids it recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootProviderTurn {
    /// The lifecycle state.
    pub state: ProviderTurnState,
    /// The provider's own turn id (transport metadata; never a canonical turn id).
    pub provider_turn_id: Option<String>,
    /// Provider turn ids this root turn recorded before `provider_turn_id` (a guidance or
    /// continuation provider turn replaced them), oldest first. Kept so that "a provider turn
    /// id already recorded on a root turn always resolves to that turn" also after the tree is
    /// loaded from storage (transport metadata, like `provider_turn_id`).
    pub earlier_provider_turn_ids: Vec<String>,
}

impl Default for RootProviderTurn {
    fn default() -> Self {
        RootProviderTurn {
            state: ProviderTurnState::Idle,
            provider_turn_id: None,
            earlier_provider_turn_ids: Vec::new(),
        }
    }
}

impl RootProviderTurn {
    /// The wire phase: a reservation reads as running.
    pub fn phase(&self) -> ProviderPhase {
        match self.state {
            ProviderTurnState::Idle => ProviderPhase::Idle,
            ProviderTurnState::Running | ProviderTurnState::Reserved(_) => ProviderPhase::Running,
            ProviderTurnState::Completed(_) => ProviderPhase::Completed,
        }
    }

    /// Whether guidance reserved the lifecycle.
    pub fn reserved(&self) -> bool {
        matches!(self.state, ProviderTurnState::Reserved(_))
    }

    /// The outcome retained from the last provider terminal (completed or reserved).
    pub fn retained(&self) -> Option<&Settlement> {
        match &self.state {
            ProviderTurnState::Reserved(s) | ProviderTurnState::Completed(s) => Some(s),
            ProviderTurnState::Idle | ProviderTurnState::Running => None,
        }
    }

    /// The retained outcome, if any.
    pub fn retained_outcome(&self) -> Option<Outcome> {
        self.retained().map(Settlement::outcome)
    }

    /// The retained error, if any.
    pub fn retained_error(&self) -> Option<&str> {
        self.retained().and_then(Settlement::error)
    }

    /// Every provider turn id this root turn recorded: the earlier ones, then the current one.
    pub fn provider_turn_ids(&self) -> impl Iterator<Item = &str> + '_ {
        self.earlier_provider_turn_ids
            .iter()
            .map(String::as_str)
            .chain(self.provider_turn_id.as_deref())
    }

    /// Whether this root turn recorded `provider_turn_id` (now or earlier).
    pub fn records(&self, provider_turn_id: &str) -> bool {
        self.provider_turn_ids().any(|p| p == provider_turn_id)
    }
}

/// What only a root turn has.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RootTurn {
    /// The root provider turn's lifecycle.
    pub provider: RootProviderTurn,
    /// A root cancel operation was prepared; no child may be created any more.
    pub child_creation_closed: bool,
    /// Child sessions created under this root turn (any depth).
    pub child_session_count: u32,
}

/// What started a child turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildTrigger {
    /// Delegation from a parent turn (a child's initial turn).
    Delegation,
    /// Later guidance sent to the child session.
    Guidance,
}

/// What only a child turn has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildTurn {
    /// Delegation or guidance.
    pub trigger: ChildTrigger,
    /// The provider's native turn id (an alias, not a canonical id).
    pub provider_turn_id: Option<String>,
}

/// Root or child turn, with the fields of that kind only. A root turn is always triggered by a
/// user submission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnRole {
    /// A turn of a root session.
    Root(RootTurn),
    /// A turn of a child session.
    Child(ChildTurn),
}

/// `WorkspaceAgentTurn`: one turn of one session, root or child.
///
/// Its role (root or child) is set when it is built ([`Turn::root`], [`Turn::child`]) and does
/// not change; its state moves through [`TurnState`]. The wire form is the spec's flat one
/// (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// Canonical turn id.
    pub id: Id,
    /// Owning session.
    pub agent_session_id: Id,
    /// Lifecycle state (with the outcome once settled).
    pub state: TurnState,
    /// Root or child (immutable: read it through [`Turn::role`]).
    role: TurnRole,
    /// The cancel operation that targeted this turn (a closed cancellation target).
    pub cancel_operation_id: Option<Id>,
    /// Creation time.
    pub created_at: Millis,
    /// Last change.
    pub updated_at: Millis,
    /// Row version.
    pub version: u64,
}

impl Turn {
    /// A new turn of `role` in `state`, created at `now` (version 0).
    pub fn new(
        id: Id,
        agent_session_id: Id,
        role: TurnRole,
        state: TurnState,
        now: Millis,
    ) -> Turn {
        Turn {
            id,
            agent_session_id,
            state,
            role,
            cancel_operation_id: None,
            created_at: now,
            updated_at: now,
            version: 0,
        }
    }

    /// A new root turn (a user submission) with an idle root provider turn.
    pub fn root(id: Id, agent_session_id: Id, state: TurnState, now: Millis) -> Turn {
        Turn::new(
            id,
            agent_session_id,
            TurnRole::Root(RootTurn::default()),
            state,
            now,
        )
    }

    /// A new child turn started by `trigger`.
    pub fn child(
        id: Id,
        agent_session_id: Id,
        trigger: ChildTrigger,
        state: TurnState,
        now: Millis,
    ) -> Turn {
        let role = TurnRole::Child(ChildTurn {
            trigger,
            provider_turn_id: None,
        });
        Turn::new(id, agent_session_id, role, state, now)
    }

    /// Root or child, with the fields of that kind only.
    pub fn role(&self) -> &TurnRole {
        &self.role
    }

    /// Whether the turn is not settled.
    pub fn is_active(&self) -> bool {
        !matches!(self.state, TurnState::Settled(_))
    }

    /// The wire phase.
    pub fn phase(&self) -> Phase {
        self.state.phase()
    }

    /// The outcome, once settled.
    pub fn outcome(&self) -> Option<Outcome> {
        self.state.settlement().map(Settlement::outcome)
    }

    /// The error, once settled failed or interrupted with one.
    pub fn error(&self) -> Option<&str> {
        self.state.settlement().and_then(Settlement::error)
    }

    /// What initiated it (the wire `trigger`): a user submission for every root turn.
    pub fn trigger(&self) -> Trigger {
        match &self.role {
            TurnRole::Root(_) => Trigger::User,
            TurnRole::Child(c) => match c.trigger {
                ChildTrigger::Delegation => Trigger::Delegation,
                ChildTrigger::Guidance => Trigger::Guidance,
            },
        }
    }

    /// Whether this is a child turn.
    pub fn is_child(&self) -> bool {
        matches!(self.role, TurnRole::Child(_))
    }

    /// Root only: its own fields.
    pub fn root_turn(&self) -> Option<&RootTurn> {
        match &self.role {
            TurnRole::Root(r) => Some(r),
            TurnRole::Child(_) => None,
        }
    }

    /// Root only: its own fields, to change.
    pub fn root_turn_mut(&mut self) -> Option<&mut RootTurn> {
        match &mut self.role {
            TurnRole::Root(r) => Some(r),
            TurnRole::Child(_) => None,
        }
    }

    /// Root only: the root provider turn's lifecycle.
    pub fn root_provider_turn(&self) -> Option<&RootProviderTurn> {
        self.root_turn().map(|r| &r.provider)
    }

    /// Root only: the root provider turn's lifecycle, to change.
    pub fn root_provider_turn_mut(&mut self) -> Option<&mut RootProviderTurn> {
        self.root_turn_mut().map(|r| &mut r.provider)
    }

    /// Child only: its own fields, to change.
    pub fn child_turn_mut(&mut self) -> Option<&mut ChildTurn> {
        match &mut self.role {
            TurnRole::Child(c) => Some(c),
            TurnRole::Root(_) => None,
        }
    }

    /// Child only: the provider's native turn id.
    pub fn provider_turn_id(&self) -> Option<&str> {
        match &self.role {
            TurnRole::Child(c) => c.provider_turn_id.as_deref(),
            TurnRole::Root(_) => None,
        }
    }

    /// Root only: whether a root cancel closed child creation (false for a child turn).
    pub fn child_creation_closed(&self) -> bool {
        self.root_turn().is_some_and(|r| r.child_creation_closed)
    }

    /// Root only: child sessions created under it (0 for a child turn).
    pub fn child_session_count(&self) -> u32 {
        self.root_turn().map_or(0, |r| r.child_session_count)
    }
}
