//! The wire form of [`Turn`] and [`RootProviderTurn`]: the spec's flat fields, exactly as before
//! the turn's state and role became enums (same names, same order, same omissions), so stores,
//! the outbox and scenario files are unchanged.
//!
//! Reading checks that the fields agree; anything else is a decode error, so a store or snapshot
//! row cannot smuggle in a turn the types rule out:
//! - a `settled` turn has an `outcome`, an active one has none, and an `error` only comes with a
//!   failed or interrupted outcome;
//! - a `user` turn (root) has no `providerTurnId`; a `delegation`/`guidance` turn (child) has
//!   no `rootProviderTurn`, `childCreationClosed` or `childSessionCount`. A root turn written
//!   without `rootProviderTurn` reads as idle (and is written back with it);
//! - a root provider turn retains an outcome only when `completed` or `reserved`, and is
//!   `reserved` only while `running`. Choice: a `completed` or reserved lifecycle without a
//!   `retainedOutcome` reads as retaining `completed` (what the gate always applied for it); a
//!   `retainedError` the outcome does not allow is dropped, as when it was recorded.

use crate::model::{
    ChildTrigger, ChildTurn, Id, Millis, Outcome, Phase, ProviderPhase, ProviderTurnState,
    RootProviderTurn, RootTurn, Settlement, Trigger, Turn, TurnRole, TurnState,
};
use serde::{de::Error as _, Deserialize, Deserializer, Serialize, Serializer};

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The written form of a root provider turn, borrowing from it.
#[derive(Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", schemars(rename = "RootProviderTurn"))]
#[serde(rename_all = "camelCase")]
struct ProviderOut<'a> {
    phase: ProviderPhase,
    #[serde(skip_serializing_if = "Option::is_none")]
    provider_turn_id: Option<&'a String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retained_outcome: Option<Outcome>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retained_error: Option<&'a str>,
    #[serde(skip_serializing_if = "is_false")]
    reserved: bool,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    earlier_provider_turn_ids: &'a [String],
}

impl<'a> ProviderOut<'a> {
    fn of(r: &'a RootProviderTurn) -> ProviderOut<'a> {
        ProviderOut {
            phase: r.phase(),
            provider_turn_id: r.provider_turn_id.as_ref(),
            retained_outcome: r.retained_outcome(),
            retained_error: r.retained_error(),
            reserved: r.reserved(),
            earlier_provider_turn_ids: &r.earlier_provider_turn_ids,
        }
    }
}

/// The read form of a root provider turn.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ProviderIn {
    phase: ProviderPhase,
    #[serde(default)]
    provider_turn_id: Option<String>,
    #[serde(default)]
    retained_outcome: Option<Outcome>,
    #[serde(default)]
    retained_error: Option<String>,
    #[serde(default)]
    reserved: bool,
    #[serde(default)]
    earlier_provider_turn_ids: Vec<String>,
}

impl ProviderIn {
    fn into_typed(self) -> Result<RootProviderTurn, &'static str> {
        let retained = || {
            Settlement::new(
                self.retained_outcome.unwrap_or(Outcome::Completed),
                self.retained_error.clone(),
            )
        };
        let has_retained = self.retained_outcome.is_some() || self.retained_error.is_some();
        let state = match (self.phase, self.reserved) {
            (ProviderPhase::Idle, true) | (ProviderPhase::Completed, true) => {
                return Err("a root provider turn is reserved only while running")
            }
            (ProviderPhase::Idle | ProviderPhase::Running, false) if has_retained => {
                return Err("only a completed or reserved root provider turn retains an outcome")
            }
            (ProviderPhase::Idle, false) => ProviderTurnState::Idle,
            (ProviderPhase::Running, false) => ProviderTurnState::Running,
            (ProviderPhase::Running, true) => ProviderTurnState::Reserved(retained()),
            (ProviderPhase::Completed, false) => ProviderTurnState::Completed(retained()),
        };
        Ok(RootProviderTurn {
            state,
            provider_turn_id: self.provider_turn_id,
            earlier_provider_turn_ids: self.earlier_provider_turn_ids,
        })
    }
}

impl Serialize for RootProviderTurn {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        ProviderOut::of(self).serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for RootProviderTurn {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        ProviderIn::deserialize(deserializer)?
            .into_typed()
            .map_err(D::Error::custom)
    }
}

/// The written form of a turn, borrowing from it (no copy on the hot store path). With the
/// `schema` feature its JSON Schema is the schema of [`Turn`] (`WorkspaceAgentTurn`).
#[derive(Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", schemars(rename = "WorkspaceAgentTurn"))]
#[serde(rename_all = "camelCase")]
struct Out<'a> {
    id: &'a Id,
    agent_session_id: &'a Id,
    trigger: Trigger,
    phase: Phase,
    #[serde(skip_serializing_if = "Option::is_none")]
    outcome: Option<Outcome>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    root_provider_turn: Option<ProviderOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    provider_turn_id: Option<&'a str>,
    #[serde(skip_serializing_if = "is_false")]
    child_creation_closed: bool,
    #[serde(skip_serializing_if = "is_zero")]
    child_session_count: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    cancel_operation_id: Option<&'a Id>,
    created_at: Millis,
    updated_at: Millis,
    version: u64,
}

/// The read form of a turn.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct In {
    id: Id,
    agent_session_id: Id,
    trigger: Trigger,
    phase: Phase,
    #[serde(default)]
    outcome: Option<Outcome>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    root_provider_turn: Option<RootProviderTurn>,
    #[serde(default)]
    provider_turn_id: Option<String>,
    #[serde(default)]
    child_creation_closed: bool,
    #[serde(default)]
    child_session_count: u32,
    #[serde(default)]
    cancel_operation_id: Option<Id>,
    created_at: Millis,
    updated_at: Millis,
    version: u64,
}

impl Serialize for Turn {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        Out {
            id: &self.id,
            agent_session_id: &self.agent_session_id,
            trigger: self.trigger(),
            phase: self.phase(),
            outcome: self.outcome(),
            error: self.error(),
            root_provider_turn: self.root_provider_turn().map(ProviderOut::of),
            provider_turn_id: self.provider_turn_id(),
            child_creation_closed: self.child_creation_closed(),
            child_session_count: self.child_session_count(),
            cancel_operation_id: self.cancel_operation_id.as_ref(),
            created_at: self.created_at,
            updated_at: self.updated_at,
            version: self.version,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Turn {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let w = In::deserialize(deserializer)?;
        let bad = |what: &str| D::Error::custom(format_args!("turn {}: {what}", w.id));
        let state = match (w.phase, w.outcome) {
            (Phase::Settled, None) => return Err(bad("a settled turn has an outcome")),
            (Phase::Settled, Some(outcome)) => {
                if w.error.is_some() && !outcome.allows_error() {
                    return Err(bad("only a failed or interrupted turn carries an error"));
                }
                TurnState::Settled(Settlement::new(outcome, w.error.clone()))
            }
            (_, Some(_)) => return Err(bad("only a settled turn has an outcome")),
            (_, None) if w.error.is_some() => {
                return Err(bad("only a settled turn carries an error"))
            }
            (Phase::Submitted, None) => TurnState::Submitted,
            (Phase::Running, None) => TurnState::Running,
            (Phase::Waiting, None) => TurnState::Waiting,
            (Phase::Settling, None) => TurnState::Settling,
        };
        let child = |trigger| {
            if w.root_provider_turn.is_some() {
                return Err(bad("a child turn has the root-only field rootProviderTurn"));
            }
            if w.child_creation_closed || w.child_session_count != 0 {
                return Err(bad("a child turn has a root-only child count or closure"));
            }
            Ok(TurnRole::Child(ChildTurn {
                trigger,
                provider_turn_id: w.provider_turn_id.clone(),
            }))
        };
        let role = match w.trigger {
            Trigger::User => {
                if w.provider_turn_id.is_some() {
                    return Err(bad("a root turn has the child-only field providerTurnId"));
                }
                TurnRole::Root(RootTurn {
                    provider: w.root_provider_turn.clone().unwrap_or_default(),
                    child_creation_closed: w.child_creation_closed,
                    child_session_count: w.child_session_count,
                })
            }
            Trigger::Delegation => child(ChildTrigger::Delegation)?,
            Trigger::Guidance => child(ChildTrigger::Guidance)?,
        };
        let mut t = Turn::new(w.id, w.agent_session_id, role, state, w.created_at);
        t.cancel_operation_id = w.cancel_operation_id;
        t.updated_at = w.updated_at;
        t.version = w.version;
        Ok(t)
    }
}

/// The schema of the written form (`Out`): what the API, the outbox and the stores hold.
#[cfg(feature = "schema")]
impl schemars::JsonSchema for Turn {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "WorkspaceAgentTurn".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        <Out<'static> as schemars::JsonSchema>::json_schema(generator)
    }
}

/// The schema of the written form (`ProviderOut`).
#[cfg(feature = "schema")]
impl schemars::JsonSchema for RootProviderTurn {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "RootProviderTurn".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        <ProviderOut<'static> as schemars::JsonSchema>::json_schema(generator)
    }
}

#[cfg(test)]
mod tests {
    use crate::model::{Outcome, ProviderTurnState, RootProviderTurn, Settlement, Turn, TurnState};
    use serde_json::json;

    fn turn(v: serde_json::Value) -> Result<Turn, String> {
        serde_json::from_value(v).map_err(|e| e.to_string())
    }

    fn base(trigger: &str, phase: &str) -> serde_json::Value {
        json!({"id": "T", "agentSessionId": "S", "trigger": trigger, "phase": phase,
               "createdAt": 1, "updatedAt": 2, "version": 3})
    }

    #[test]
    fn a_settled_turn_round_trips_in_the_flat_wire_form() {
        let mut v = base("user", "settled");
        v["outcome"] = json!("failed");
        v["error"] = json!("boom");
        v["rootProviderTurn"] = json!({"phase": "completed", "retainedOutcome": "failed",
                                       "retainedError": "boom", "providerTurnId": "p2",
                                       "earlierProviderTurnIds": ["p1"]});
        v["childCreationClosed"] = json!(true);
        v["childSessionCount"] = json!(2);
        v["cancelOperationId"] = json!("op");
        let t = turn(v.clone()).expect("valid");
        assert_eq!(
            t.state,
            TurnState::Settled(Settlement::new(Outcome::Failed, Some("boom".into())))
        );
        assert_eq!(t.child_session_count(), 2);
        assert_eq!(serde_json::to_value(&t).ok(), Some(v));
    }

    #[test]
    fn a_child_turn_round_trips_and_a_root_without_its_lifecycle_reads_idle() {
        let mut v = base("delegation", "running");
        v["providerTurnId"] = json!("native-1");
        let t = turn(v.clone()).expect("valid");
        assert!(t.is_child());
        assert_eq!(t.provider_turn_id(), Some("native-1"));
        assert_eq!(serde_json::to_value(&t).ok(), Some(v));
        let root = turn(base("user", "submitted")).expect("valid");
        assert_eq!(
            root.root_provider_turn().map(|r| &r.state),
            Some(&ProviderTurnState::Idle)
        );
    }

    #[test]
    fn rows_whose_fields_contradict_each_other_are_decode_errors() {
        let with = |mut v: serde_json::Value, k: &str, x: serde_json::Value| {
            v[k] = x;
            v
        };
        let cases = [
            (base("user", "settled"), "a settled turn has an outcome"),
            (
                with(base("user", "running"), "outcome", json!("completed")),
                "only a settled turn has an outcome",
            ),
            (
                with(base("user", "running"), "error", json!("e")),
                "only a settled turn carries an error",
            ),
            (
                with(
                    with(base("user", "settled"), "outcome", json!("canceled")),
                    "error",
                    json!("e"),
                ),
                "only a failed or interrupted turn carries an error",
            ),
            (
                with(base("user", "running"), "providerTurnId", json!("p")),
                "child-only field providerTurnId",
            ),
            (
                with(
                    base("delegation", "running"),
                    "rootProviderTurn",
                    json!({"phase": "idle"}),
                ),
                "root-only field rootProviderTurn",
            ),
            (
                with(base("guidance", "running"), "childSessionCount", json!(1)),
                "root-only child count",
            ),
            (
                with(
                    base("user", "running"),
                    "rootProviderTurn",
                    json!({"phase": "completed", "reserved": true}),
                ),
                "reserved only while running",
            ),
            (
                with(
                    base("user", "running"),
                    "rootProviderTurn",
                    json!({"phase": "running", "retainedOutcome": "failed"}),
                ),
                "retains an outcome",
            ),
        ];
        for (v, want) in cases {
            let e = turn(v.clone()).expect_err("a contradiction");
            assert!(e.contains(want), "{v}: {e}");
        }
    }

    #[test]
    fn a_reserved_lifecycle_keeps_the_outcome_retained_before_it() {
        let r: RootProviderTurn = serde_json::from_value(
            json!({"phase": "running", "reserved": true, "retainedOutcome": "failed"}),
        )
        .expect("valid");
        assert_eq!(
            r.state,
            ProviderTurnState::Reserved(Settlement::new(Outcome::Failed, None))
        );
        assert_eq!(
            serde_json::to_value(&r).ok(),
            Some(json!({"phase": "running", "retainedOutcome": "failed", "reserved": true}))
        );
    }
}
