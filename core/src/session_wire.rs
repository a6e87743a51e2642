//! The wire form of [`Session`]: the spec's flat fields, exactly as before the relation became
//! one enum (same names, same order, same omissions), so stores, the outbox and scenario files
//! are unchanged.
//!
//! Reading checks the relation: a `child` must name its parent session, parent turn, root
//! session and root turn, and a `root` must name none of the child's links; anything else is a
//! decode error (so a store or snapshot row cannot smuggle in a half child). A child's
//! `capabilities` are written as the default, as they always were, and ignored when read.

use crate::model::{
    Capabilities, ChildOf, Id, Millis, ProviderAliases, Relation, Session, SessionKind, TokenUsage,
};
use serde::{de::Error as _, Deserialize, Deserializer, Serialize, Serializer};

/// What a child's `capabilities` field has always held.
const CHILD_CAPABILITIES: Capabilities = Capabilities {
    guide_while_children_only: true,
};

/// The written form, borrowing from the session (no copy on the hot store path). With the
/// `schema` feature its JSON Schema is the schema of [`Session`] (`WorkspaceAgentSession`).
#[derive(Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", schemars(rename = "WorkspaceAgentSession"))]
#[serde(rename_all = "camelCase")]
struct Out<'a> {
    id: &'a Id,
    workspace_id: &'a Id,
    kind: SessionKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent_agent_session_id: Option<&'a Id>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent_turn_id: Option<&'a Id>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent_tool_call_id: Option<&'a Id>,
    #[serde(skip_serializing_if = "Option::is_none")]
    root_agent_session_id: Option<&'a Id>,
    #[serde(skip_serializing_if = "Option::is_none")]
    root_turn_id: Option<&'a Id>,
    provider: &'a Id,
    #[serde(skip_serializing_if = "Option::is_none")]
    provider_session_id: Option<&'a String>,
    provider_aliases: &'a ProviderAliases,
    #[serde(skip_serializing_if = "Option::is_none")]
    title: Option<&'a String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    active_turn_id: Option<&'a Id>,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_turn_id: Option<&'a Id>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deleted_at: Option<Millis>,
    capabilities: &'a Capabilities,
    #[serde(skip_serializing_if = "Option::is_none")]
    goal: Option<&'a serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<&'a TokenUsage>,
    created_at: Millis,
    updated_at: Millis,
    version: u64,
}

/// The read form.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct In {
    id: Id,
    workspace_id: Id,
    kind: SessionKind,
    #[serde(default)]
    parent_agent_session_id: Option<Id>,
    #[serde(default)]
    parent_turn_id: Option<Id>,
    #[serde(default)]
    parent_tool_call_id: Option<Id>,
    #[serde(default)]
    root_agent_session_id: Option<Id>,
    #[serde(default)]
    root_turn_id: Option<Id>,
    provider: Id,
    #[serde(default)]
    provider_session_id: Option<String>,
    #[serde(default)]
    provider_aliases: ProviderAliases,
    #[serde(default)]
    title: Option<String>,
    #[serde(default)]
    active_turn_id: Option<Id>,
    #[serde(default)]
    last_turn_id: Option<Id>,
    #[serde(default)]
    deleted_at: Option<Millis>,
    #[serde(default)]
    capabilities: Capabilities,
    #[serde(default)]
    goal: Option<serde_json::Value>,
    #[serde(default)]
    usage: Option<TokenUsage>,
    created_at: Millis,
    updated_at: Millis,
    version: u64,
}

impl Serialize for Session {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let child = self.child_of();
        Out {
            id: &self.id,
            workspace_id: &self.workspace_id,
            kind: self.kind(),
            parent_agent_session_id: child.map(|c| &c.parent_agent_session_id),
            parent_turn_id: child.map(|c| &c.parent_turn_id),
            parent_tool_call_id: child.and_then(|c| c.parent_tool_call_id.as_ref()),
            root_agent_session_id: child.map(|c| &c.root_agent_session_id),
            root_turn_id: child.map(|c| &c.root_turn_id),
            provider: &self.provider,
            provider_session_id: self.provider_session_id.as_ref(),
            provider_aliases: &self.provider_aliases,
            title: self.title.as_ref(),
            active_turn_id: self.active_turn_id.as_ref(),
            last_turn_id: self.last_turn_id.as_ref(),
            deleted_at: self.deleted_at,
            capabilities: self.capabilities().unwrap_or(&CHILD_CAPABILITIES),
            goal: self.goal.as_ref(),
            usage: self.usage.as_ref(),
            created_at: self.created_at,
            updated_at: self.updated_at,
            version: self.version,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Session {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let w = In::deserialize(deserializer)?;
        let relation = match w.kind {
            SessionKind::Root => {
                let child_field = [
                    ("parentAgentSessionId", w.parent_agent_session_id.is_some()),
                    ("parentTurnId", w.parent_turn_id.is_some()),
                    ("parentToolCallId", w.parent_tool_call_id.is_some()),
                    ("rootAgentSessionId", w.root_agent_session_id.is_some()),
                    ("rootTurnId", w.root_turn_id.is_some()),
                ]
                .into_iter()
                .find_map(|(name, set)| set.then_some(name));
                if let Some(name) = child_field {
                    return Err(D::Error::custom(format_args!(
                        "root session {} has the child-only field {name}",
                        w.id
                    )));
                }
                Relation::root(w.capabilities)
            }
            SessionKind::Child => {
                let missing = |name: &'static str| {
                    D::Error::custom(format_args!("child session {} has no {name}", w.id))
                };
                Relation::Child(ChildOf {
                    parent_agent_session_id: w
                        .parent_agent_session_id
                        .ok_or_else(|| missing("parentAgentSessionId"))?,
                    parent_turn_id: w.parent_turn_id.ok_or_else(|| missing("parentTurnId"))?,
                    parent_tool_call_id: w.parent_tool_call_id,
                    root_agent_session_id: w
                        .root_agent_session_id
                        .ok_or_else(|| missing("rootAgentSessionId"))?,
                    root_turn_id: w.root_turn_id.ok_or_else(|| missing("rootTurnId"))?,
                })
            }
        };
        let mut s = Session::new(w.id, w.workspace_id, relation, w.provider, w.created_at);
        s.provider_session_id = w.provider_session_id;
        s.provider_aliases = w.provider_aliases;
        s.title = w.title;
        s.active_turn_id = w.active_turn_id;
        s.last_turn_id = w.last_turn_id;
        s.deleted_at = w.deleted_at;
        s.goal = w.goal;
        s.usage = w.usage;
        s.updated_at = w.updated_at;
        s.version = w.version;
        Ok(s)
    }
}

/// The schema of the written form (`Out`): what the API, the outbox and the stores hold.
#[cfg(feature = "schema")]
impl schemars::JsonSchema for Session {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "WorkspaceAgentSession".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        <Out<'static> as schemars::JsonSchema>::json_schema(generator)
    }
}
