//! A session's place in its tree: root or child, as one enum.
//!
//! The spec gives a child five immutable links ("`parentAgentSessionId`, `parentTurnId`,
//! `parentToolCallId` when known, `rootAgentSessionId` and `rootTurnId`") and a root the
//! provider's capabilities ("Provider adapters must expose whether root-turn guidance is
//! supported while only child agents are running"). [`Relation`] holds exactly one of the two
//! sets, so a child without a root turn or a root with a parent cannot be built, stored or
//! restored: reading such a row is a decode error.
//!
//! The wire form is unchanged: [`Session`](crate::model::Session) is still written with `kind`
//! and the flat optional fields, in the same order (see `session_wire.rs`).

use super::{Capabilities, Id, SessionKind};

/// Root or child, with the fields that belong to that kind only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Relation {
    /// A user-visible conversation: the root of its tree.
    Root(RootOnly),
    /// A provider-native subordinate agent, delegated by a turn of its parent.
    Child(ChildOf),
}

/// What only a root session has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RootOnly {
    /// Provider capabilities ("root only").
    pub capabilities: Capabilities,
}

/// A child's links to its parent and its root ("immutable" in the spec: a session's relation is
/// set when it is created and never changes, so [`Session`](crate::model::Session) offers no
/// way to change it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildOf {
    /// The session whose turn delegated this child.
    pub parent_agent_session_id: Id,
    /// The turn that delegated this child.
    pub parent_turn_id: Id,
    /// The delegation tool call, when known.
    pub parent_tool_call_id: Option<Id>,
    /// The root session of the tree.
    pub root_agent_session_id: Id,
    /// The root turn that owns this child.
    pub root_turn_id: Id,
}

impl Relation {
    /// A root with these capabilities.
    pub fn root(capabilities: Capabilities) -> Relation {
        Relation::Root(RootOnly { capabilities })
    }

    /// `root` or `child`.
    pub fn kind(&self) -> SessionKind {
        match self {
            Relation::Root(_) => SessionKind::Root,
            Relation::Child(_) => SessionKind::Child,
        }
    }

    /// The child's links; `None` for a root.
    pub fn child(&self) -> Option<&ChildOf> {
        match self {
            Relation::Child(c) => Some(c),
            Relation::Root(_) => None,
        }
    }

    /// The root's own fields; `None` for a child.
    pub fn root_only(&self) -> Option<&RootOnly> {
        match self {
            Relation::Root(r) => Some(r),
            Relation::Child(_) => None,
        }
    }
}
