//! The invariant checker: the spec's safety rules, checked over a whole tree's state. Used by
//! tests, the simulation and the fuzz targets after every step.

use crate::hash::{FxMap, FxSet};
use crate::model::{CancelState, Id, InteractionStatus, ProviderTurnState, Session, TurnState};
use crate::snapshot::TreeSnapshot;
use crate::Engine;

/// One broken rule, with the ids involved (never content).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which rule.
    pub rule: &'static str,
    /// The entity.
    pub id: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.rule, self.id)
    }
}

/// Checks one tree's state.
pub fn check_tree(t: &TreeSnapshot) -> Vec<Violation> {
    let mut v = Vec::new();
    let mut bad = |rule: &'static str, id: &Id| {
        v.push(Violation {
            rule,
            id: id.to_string(),
        })
    };
    let sessions: FxMap<&Id, &Session> = t.sessions.iter().map(|s| (&s.id, s)).collect();
    let turns: FxMap<&Id, &crate::model::Turn> = t.turns.iter().map(|x| (&x.id, x)).collect();
    let inflight: FxSet<&Id> = t
        .cancel_operations
        .iter()
        .filter(|o| o.state == CancelState::Prepared)
        .flat_map(|o| o.targets.iter().map(|x| &x.turn_id))
        .collect();

    for s in &t.sessions {
        if let Some(links) = s.child_of() {
            match sessions.get(&links.parent_agent_session_id) {
                None => bad("child without its parent session", &s.id),
                Some(p) => {
                    if s.deleted_at.is_none() && p.deleted_at.is_some() {
                        bad("no orphan after delete", &s.id);
                    }
                    if links.root_agent_session_id != *p.tree_root_id() {
                        bad("child root session is its parent's root", &s.id);
                    }
                    let expected_turn = p.root_turn_id().unwrap_or(&links.parent_turn_id);
                    if links.root_turn_id != *expected_turn {
                        bad("child root turn is its parent's root turn", &s.id);
                    }
                }
            }
        }
        if s.deleted_at.is_some() && s.active_turn_id.is_some() {
            bad("deleted session has no active turn", &s.id);
        }
        if let Some(a) = &s.active_turn_id {
            match turns.get(a) {
                Some(turn) if turn.agent_session_id == s.id && turn.is_active() => {}
                _ => bad("activeTurnId names an active turn of the session", &s.id),
            }
        }
    }

    let mut active_children: FxMap<Id, usize> = FxMap::default();
    let mut child_sessions: FxMap<Id, u32> = FxMap::default();
    for rt in t.sessions.iter().filter_map(Session::root_turn_id) {
        *child_sessions.entry(rt.clone()).or_default() += 1;
    }
    for turn in &t.turns {
        let Some(s) = sessions.get(&turn.agent_session_id) else {
            bad("turn of an unknown session", &turn.id);
            continue;
        };
        if turn.is_active() && s.active_turn_id.as_ref() != Some(&turn.id) {
            bad("an active turn is its session's activeTurnId", &turn.id);
        }
        // "Settled turn has an outcome", "only settled turns have an outcome" and "canceled
        // turns carry no error" hold by construction ([`crate::model::TurnState`]).
        if turn.state == TurnState::Settling && !inflight.contains(&turn.id) {
            bad("settling only while a cancel is in flight", &turn.id);
        }
        if let Some(rt) = s.root_turn_id().filter(|_| turn.is_active()) {
            *active_children.entry(rt.clone()).or_default() += 1;
            if !turns.get(rt).is_some_and(|r| r.is_active()) {
                bad("no root settles while a nested child is active", &turn.id);
            }
        }
    }
    for turn in t.turns.iter().filter(|x| !x.is_child()) {
        let children = active_children.get(&turn.id).copied().unwrap_or(0);
        let created = child_sessions.get(&turn.id).copied().unwrap_or(0);
        if created != turn.child_session_count() {
            bad("root turn counts its child sessions", &turn.id);
        }
        let Some(r) = turn.root_provider_turn() else {
            continue;
        };
        if turn.is_active()
            && matches!(r.state, ProviderTurnState::Completed(_))
            && children == 0
            && !inflight.contains(&turn.id)
        {
            bad(
                "root gate: settles once provider and children are terminal",
                &turn.id,
            );
        }
    }
    for o in &t.cancel_operations {
        if o.includes_root {
            if let Some(rt) = turns.get(&o.turn_id) {
                if rt.child_session_count() != o.child_sessions_at_prepare {
                    bad(
                        "no child is revealed after its root's cancel was prepared",
                        &o.id,
                    );
                }
                if !rt.child_creation_closed() {
                    bad("a root cancel closes child creation", &o.id);
                }
                if o.state != CancelState::Prepared
                    && rt.outcome() != Some(crate::model::Outcome::Canceled)
                {
                    bad("a canceled root stays canceled", &o.id);
                }
            }
        }
        if o.state != CancelState::Prepared {
            for target in &o.targets {
                if turns
                    .get(&target.turn_id)
                    .is_some_and(|x| x.is_active() && x.cancel_operation_id.as_ref() == Some(&o.id))
                {
                    bad("a finished cancel leaves no target active", &target.turn_id);
                }
            }
        }
    }
    for i in &t.interactions {
        if i.status == InteractionStatus::Pending
            && !turns.get(&i.turn_id).is_some_and(|x| x.is_active())
        {
            bad("pending interactions belong to active turns", &i.request_id);
        }
    }
    v
}

impl Engine {
    /// Checks every loaded tree, plus the engine's own indexes against the state.
    pub fn check_invariants(&self) -> Vec<Violation> {
        let mut v = Vec::new();
        for tree in self.trees() {
            let snap = TreeSnapshot::from_tree(tree);
            v.extend(check_tree(&snap));
            for (rt, set) in tree.active_children.iter() {
                for turn in set.keys() {
                    if !tree.turns.get(turn).is_some_and(|t| t.is_active()) {
                        v.push(Violation {
                            rule: "gate index holds only active child turns",
                            id: format!("{rt}/{turn}"),
                        });
                    }
                }
            }
            // Issue 23: the open tool call index lists exactly the non-terminal tool calls of
            // active turns that it tracks, so settling a turn closes all of them.
            for c in tree.tool_calls.values() {
                let active = tree.turns.get(&c.turn_id).is_some_and(|t| t.is_active());
                let listed = tree
                    .open_tool_calls
                    .get(&c.turn_id)
                    .is_some_and(|l| l.contains(&c.tool_call_id));
                let open = !crate::model::tool_call_status_is_terminal(&c.status);
                if listed != (open && active) {
                    v.push(Violation {
                        rule: "open tool call index holds exactly the open tool calls of active turns",
                        id: format!("{}/{}", c.agent_session_id, c.tool_call_id),
                    });
                }
            }
            // The pending index lists exactly the pending interactions, each once: settling a
            // turn supersedes the interactions its list names, and the tree is quiescent only
            // when every list is empty.
            let mut pending = 0;
            for i in tree.interactions.values() {
                if i.status != InteractionStatus::Pending {
                    continue;
                }
                pending += 1;
                if !tree
                    .pending
                    .get(&i.turn_id)
                    .is_some_and(|l| l.contains(&i.request_id))
                {
                    v.push(Violation {
                        rule: "pending interaction index lists exactly the pending interactions",
                        id: format!("{}/{}", i.turn_id, i.request_id),
                    });
                }
            }
            if tree.pending.values().map(Vec::len).sum::<usize>() != pending {
                v.push(Violation {
                    rule: "pending interaction index lists exactly the pending interactions",
                    id: tree.root_id.to_string(),
                });
            }
            if !tree.provider_turns_consistent() {
                v.push(Violation {
                    rule: "provider turn index names the root turn each provider turn id is recorded on",
                    id: tree.root_id.to_string(),
                });
            }
            let indexed: usize = tree.active_children.values().map(|m| m.len()).sum();
            let actual = snap
                .turns
                .iter()
                .filter(|t| {
                    t.is_active()
                        && tree
                            .sessions
                            .get(&t.agent_session_id)
                            .is_some_and(|s| s.is_child())
                })
                .count();
            if indexed != actual {
                v.push(Violation {
                    rule: "gate index counts every active child turn",
                    id: tree.root_id.to_string(),
                });
            }
        }
        v
    }
}
