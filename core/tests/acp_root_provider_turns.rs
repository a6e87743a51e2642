//! The ACP adapter and the engine together: "root provider facts belong to the provider turn
//! they name". Every root provider event the adapter emits names its canonical turn and its
//! provider turn (`prompt-<rpc id>`), so a prompt that answers `cancelled` after the user's next
//! turn was submitted closes its own turn's provider lifecycle and never settles the next one.
//!
//! The rig is a host of the real [`Driver`] (a `MemoryStore`, the clock) with a real
//! `AcpAdapter`: the driver does the wiring the daemon relies on, and the invariant checker runs
//! after every host call.

use serde_json::{json, Value};
use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
use tutti_core::adapters::{AdapterOutput, AdapterTimer};
use tutti_core::driver::{DriverInput, Record, Testkit};
use tutti_core::model::{Outcome, Phase, ProviderPhase, RootProviderTurn};
use tutti_core::store::MemoryStore;
use tutti_core::{Driver, Input, NormalizedEvent};

/// A [`Driver`] host (a `MemoryStore`, the clock) and what passed between adapter and engine.
struct Rig {
    d: Driver,
    store: MemoryStore,
    now: i64,
    native: Vec<Value>,
    timers: Vec<AdapterTimer>,
    events: Vec<NormalizedEvent>,
    rejected: Vec<String>,
    /// `(turn, role, text)` of every `messageAppended` the engine recorded.
    recorded: Vec<(String, String, String)>,
}

impl Rig {
    /// Root session R, the agent initialized and its session created.
    fn new() -> Rig {
        let mut d = Driver::new();
        d.set_recording(true);
        let mut r = Rig {
            d,
            store: MemoryStore::new(),
            now: 0,
            native: Vec::new(),
            timers: Vec::new(),
            events: Vec::new(),
            rejected: Vec::new(),
            recorded: Vec::new(),
        };
        r.input(
            json!({"type":"createSession","agentSessionId":"R","workspaceId":"W","provider":"acp"}),
        );
        r.now += 1;
        let adapter = AcpAdapter::new("R".into(), AcpConfig::default());
        let _ = r.d.handle(
            DriverInput::Attach {
                now: r.now,
                root: "R".into(),
                adapter: Box::new(adapter),
            },
            &r.store,
        );
        r.settle();
        r.answer(
            "initialize",
            json!({"protocolVersion": 1, "agentCapabilities": {}}),
        );
        r.answer("session/new", json!({"sessionId": "acp-session"}));
        r
    }

    /// A host command through the driver.
    fn input(&mut self, v: Value) {
        let input: Input = serde_json::from_value(v).expect("valid input");
        self.now += 1;
        let _ = self.d.handle(
            DriverInput::Host {
                now: self.now,
                input,
                reply: None,
            },
            &self.store,
        );
        self.settle();
    }

    /// Commits what the driver decided, checks the invariants, and notes what passed between
    /// the adapter and the engine; returns the adapter outputs, in order.
    fn settle(&mut self) -> Vec<AdapterOutput> {
        self.d.commit_pending(&mut self.store);
        let v = self.d.engine().check_invariants();
        assert!(v.is_empty(), "invariants: {v:?}");
        let mut outs = Vec::new();
        for r in self.d.take_records() {
            match r {
                Record::Adapter { output, .. } => {
                    self.native.extend(output.native.iter().cloned());
                    self.timers.extend(output.timers.iter().cloned());
                    self.events.extend(output.events.iter().cloned());
                    outs.push(output);
                }
                Record::Decided {
                    input:
                        Input::Event(NormalizedEvent::MessageAppended {
                            turn_id,
                            role,
                            text,
                            ..
                        }),
                    outcome: Ok(None),
                } => self
                    .recorded
                    .push((turn_id.to_string(), role.to_string(), text.to_string())),
                Record::Decided {
                    outcome: Err(e), ..
                } => self.rejected.push(format!("{e}")),
                _ => {}
            }
        }
        outs
    }

    /// The user's cancel as the daemon's API hands it over (the driver flushes the adapter's
    /// buffered text first: `Adapter::flush_text`, then `cancelTurn`).
    fn cancel(&mut self, op: &str, turn: &str) {
        self.input(
            json!({"type":"cancelTurn","operationId":op,"agentSessionId":"R","turnId":turn}),
        );
    }

    /// One `session/update` notification from the agent.
    fn update(&mut self, update: Value) {
        self.native_line(json!({"jsonrpc": "2.0", "method": "session/update",
                        "params": {"sessionId": "acp-session", "update": update}}));
    }

    /// One native message from the agent; returns the adapter's output for it.
    fn native_line(&mut self, v: Value) -> AdapterOutput {
        self.now += 1;
        self.d
            .handle(
                DriverInput::Native {
                    now: self.now,
                    root: "R",
                    message: &v,
                },
                &self.store,
            )
            .unwrap_or_else(|e| panic!("adapter refused {v}: {e}"));
        self.settle().into_iter().next().unwrap_or_default()
    }

    /// The clock reaches `at`: every timer due fires.
    fn advance(&mut self, at: i64) {
        self.now = self.now.max(at);
        let _ = self.d.handle(DriverInput::Timeout(self.now), &self.store);
        self.settle();
    }

    /// The rpc id of the last request with this method.
    fn last_request(&self, method: &str) -> u64 {
        self.native
            .iter()
            .rev()
            .find(|n| n["method"] == method && n.get("id").is_some())
            .and_then(|n| n["id"].as_u64())
            .unwrap_or_else(|| panic!("no {method} request in {:?}", self.native))
    }

    /// Answers the last request with this method; returns what the adapter produced.
    fn answer(&mut self, method: &str, result: Value) -> AdapterOutput {
        let id = self.last_request(method);
        self.answer_id(id, result)
    }

    fn answer_id(&mut self, id: u64, result: Value) -> AdapterOutput {
        self.native_line(json!({"jsonrpc": "2.0", "id": id, "result": result}))
    }

    fn root_turn(&self, turn: &str) -> (Phase, Option<Outcome>, RootProviderTurn) {
        let t = self.d.engine().turn("R", turn).expect("root turn exists");
        (
            t.phase(),
            t.outcome(),
            t.root_provider_turn().cloned().unwrap_or_default(),
        )
    }
}

/// An ACP prompt answers `cancelled` after the canceled turn settled (the cancel timed out) and
/// the user's next turn was submitted: its `rootProviderTurnCompleted` names the canceled turn
/// and `prompt-<id>`, completes that turn's provider lifecycle without changing its outcome,
/// and never settles the next turn, whose own prompt is sent only now and settles it.
#[test]
fn prompt_answering_cancelled_after_the_next_submit_settles_only_its_own_turn() {
    let mut r = Rig::new();
    r.input(json!({"type":"submit","agentSessionId":"R","turnId":"T1","text":"first"}));
    let p1 = r.last_request("session/prompt");
    let (phase, _, rpt) = r.root_turn("T1");
    assert_eq!(phase, Phase::Running);
    assert_eq!(rpt.provider_turn_id, Some(format!("prompt-{p1}")));

    r.input(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":"R","turnId":"T1"}));
    assert!(r
        .native
        .iter()
        .any(|n| n["method"] == "session/cancel" && n.get("id").is_none()));
    // The agent is slow to answer: the cancel's bound passes and the turn settles.
    let timer = r.timers.last().cloned().expect("cancel timer");
    r.advance(timer.at);
    let (phase, outcome, _) = r.root_turn("T1");
    assert_eq!(phase, Phase::Settled);
    let t1_outcome = outcome;

    // The user's next turn: its prompt waits for the running one to answer.
    r.input(json!({"type":"submit","agentSessionId":"R","turnId":"T2","text":"second"}));
    assert_eq!(r.last_request("session/prompt"), p1, "no second prompt yet");
    assert_eq!(r.root_turn("T2").0, Phase::Submitted);

    // The canceled prompt answers now.
    let out = r.answer_id(p1, json!({"stopReason": "cancelled"}));
    let completed: Vec<_> = out
        .events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::RootProviderTurnCompleted {
                turn_id,
                provider_turn_id,
                outcome,
                ..
            } => Some((turn_id.clone(), provider_turn_id.clone(), *outcome)),
            _ => None,
        })
        .collect();
    assert_eq!(
        completed,
        [(
            Some("T1".into()),
            Some(format!("prompt-{p1}")),
            Outcome::Interrupted
        )]
    );
    let (phase, outcome, rpt) = r.root_turn("T1");
    assert_eq!(
        (phase, outcome),
        (Phase::Settled, t1_outcome),
        "T1 unchanged"
    );
    assert_eq!(
        rpt.phase(),
        ProviderPhase::Completed,
        "no stale running phase"
    );
    assert_eq!(rpt.retained_outcome(), Some(Outcome::Interrupted));

    // Only now is T2's prompt sent; T2 runs its own provider turn.
    let p2 = r.last_request("session/prompt");
    assert_ne!(p2, p1);
    let (phase, outcome, rpt) = r.root_turn("T2");
    assert_eq!((phase, outcome), (Phase::Running, None));
    assert_eq!(rpt.phase(), ProviderPhase::Running);
    assert_eq!(rpt.provider_turn_id, Some(format!("prompt-{p2}")));

    // Every root provider event named its canonical turn and its provider turn.
    for e in &r.events {
        match e {
            NormalizedEvent::RootProviderTurnStarted {
                turn_id,
                provider_turn_id,
                ..
            }
            | NormalizedEvent::RootProviderTurnCompleted {
                turn_id,
                provider_turn_id,
                ..
            } => assert!(turn_id.is_some() && provider_turn_id.is_some(), "{e:?}"),
            _ => {}
        }
    }

    r.answer_id(p2, json!({"stopReason": "end_turn"}));
    let (phase, outcome, _) = r.root_turn("T2");
    assert_eq!((phase, outcome), (Phase::Settled, Some(Outcome::Completed)));
    let (_, outcome, _) = r.root_turn("T1");
    assert_eq!(outcome, t1_outcome);
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

/// Issue 23: "Text streamed before a cancel is lost ... Flush buffered text before the cancel
/// settles the turn; it is the user's record of what happened." The chunks the agent streamed
/// before the user's cancel are recorded as one assistant message on the canceled turn; a chunk
/// arriving after the cancel is output of the canceled execution and is dropped.
#[test]
fn text_streamed_before_a_cancel_is_recorded_on_the_canceled_turn() {
    let mut r = Rig::new();
    r.input(json!({"type":"submit","agentSessionId":"R","turnId":"T1","text":"first"}));
    let p1 = r.last_request("session/prompt");
    r.update(json!({"sessionUpdate": "agent_message_chunk",
                    "content": {"type": "text", "text": "Working "}}));
    r.update(json!({"sessionUpdate": "agent_message_chunk",
                    "content": {"type": "text", "text": "on it..."}}));
    assert!(r.recorded.is_empty(), "chunks are buffered until a flush");
    r.cancel("op1", "T1");
    r.update(json!({"sessionUpdate": "agent_message_chunk",
                    "content": {"type": "text", "text": " after the cancel"}}));
    r.answer_id(p1, json!({"stopReason": "cancelled"}));
    let (phase, outcome, _) = r.root_turn("T1");
    assert_eq!((phase, outcome), (Phase::Settled, Some(Outcome::Canceled)));
    assert_eq!(
        r.recorded,
        [(
            "T1".to_string(),
            "assistant".to_string(),
            "Working on it...".to_string()
        )]
    );
    assert!(r.rejected.is_empty(), "rejected: {:?}", r.rejected);
}
