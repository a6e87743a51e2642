//! A tiny harness for engine tests: an engine plus the reference store, with JSON inputs.

#![allow(dead_code)]

use serde_json::{json, Value};
use tutti_core::store::{MemoryStore, Store};
use tutti_core::{scenario, Engine, Input, Rejected, Step};

pub struct H {
    pub engine: Engine,
    pub store: MemoryStore,
    pub now: i64,
}

impl H {
    pub fn new() -> H {
        H {
            engine: Engine::new(),
            store: MemoryStore::new(),
            now: 0,
        }
    }

    /// Feeds one input given as wire JSON; commits the step to the store.
    pub fn try_feed(&mut self, v: Value) -> Result<Step, Rejected> {
        self.now += 1;
        let input: Input = serde_json::from_value(v).expect("test input is valid wire JSON");
        let step = self.engine.handle(self.now, &input)?;
        self.store
            .apply(&step.persist)
            .expect("store accepts the step");
        Ok(step)
    }

    pub fn feed(&mut self, v: Value) -> Step {
        let label = v.to_string();
        self.try_feed(v)
            .unwrap_or_else(|e| panic!("input rejected: {e}: {label}"))
    }

    /// Feeds an input that must be rejected, and checks that the engine changed nothing ("bad
    /// input gets a typed error and changes nothing"): every tree's snapshot and the set of
    /// roots are what they were before. (The store cannot change here: a rejected input has no
    /// step to apply.)
    pub fn reject(&mut self, v: Value) -> Rejected {
        let label = v.to_string();
        let before = self.engine_state();
        match self.try_feed(v) {
            Ok(_) => panic!("input accepted but should be rejected: {label}"),
            Err(e) => {
                assert!(
                    before == self.engine_state(),
                    "a rejected input changed the engine: {label}"
                );
                e
            }
        }
    }

    /// The engine's whole state: each root with its tree's snapshot.
    pub fn engine_state(&self) -> Vec<(String, Option<tutti_core::TreeSnapshot>)> {
        self.engine
            .roots()
            .into_iter()
            .map(|r| (r.to_string(), self.engine.snapshot(&r)))
            .collect()
    }

    pub fn turn(&self, id: &str) -> Value {
        serde_json::to_value(self.store.turn(id).unwrap().expect("turn exists")).unwrap()
    }

    pub fn session(&self, id: &str) -> Option<Value> {
        self.store
            .session(id)
            .unwrap()
            .map(|s| serde_json::to_value(s).unwrap())
    }

    pub fn phase(&self, turn: &str) -> String {
        self.turn(turn)["phase"].as_str().unwrap().to_string()
    }

    pub fn outcome(&self, turn: &str) -> Option<String> {
        self.turn(turn)["outcome"].as_str().map(String::from)
    }

    pub fn check(&self) {
        scenario::invariants(&self.engine, &self.store).expect("invariants hold");
    }

    // Shorthands for common inputs.
    pub fn root(&mut self, r: &str) {
        self.feed(
            json!({"type":"createSession","agentSessionId":r,"workspaceId":"W","provider":"test"}),
        );
    }
    pub fn submit(&mut self, r: &str, t: &str) -> Step {
        self.feed(json!({"type":"submit","agentSessionId":r,"turnId":t,"text":"hello"}))
    }
    pub fn started(&mut self, r: &str, p: &str) -> Step {
        self.feed(json!({"type":"rootProviderTurnStarted","agentSessionId":r,"providerTurnId":p}))
    }
    pub fn completed(&mut self, r: &str, p: &str, outcome: &str) -> Step {
        self.feed(json!({"type":"rootProviderTurnCompleted","agentSessionId":r,"providerTurnId":p,"outcome":outcome}))
    }
    pub fn child(
        &mut self,
        c: &str,
        ct: &str,
        parent: &str,
        pt: &str,
        root: &str,
        rt: &str,
    ) -> Step {
        self.feed(
            json!({"type":"childSessionCreated","agentSessionId":c,"turnId":ct,
            "parentAgentSessionId":parent,"parentTurnId":pt,"parentToolCallId":format!("call-{c}"),
            "rootAgentSessionId":root,"rootTurnId":rt}),
        )
    }
    pub fn terminal(&mut self, c: &str, ct: &str, outcome: &str) -> Step {
        self.feed(json!({"type":"turnTerminal","agentSessionId":c,"turnId":ct,"outcome":outcome}))
    }
    pub fn cancel(&mut self, op: &str, s: &str, t: &str) -> Step {
        self.feed(json!({"type":"cancelTurn","operationId":op,"agentSessionId":s,"turnId":t}))
    }
}

/// A root R with turn T, running provider turn p1, and children C1..=Cn (turns CT1..).
pub fn tree_with_children(n: usize) -> H {
    let mut h = H::new();
    h.root("R");
    h.submit("R", "T");
    h.started("R", "p1");
    for i in 1..=n {
        h.child(&format!("C{i}"), &format!("CT{i}"), "R", "T", "R", "T");
    }
    h
}

pub fn provider_requests(step: &Step) -> Vec<Value> {
    step.provider
        .iter()
        .map(|r| serde_json::to_value(r).unwrap())
        .collect()
}
