//! The Codex app-server adapter: one test per rule of the issue (named after it), golden tests
//! from captured transcripts of the real codex 0.171 app-server (`tests/data/codex/*.wire.jsonl`),
//! and garbage input. The engine's invariant checker runs after every engine step.

use serde_json::{json, Value};
use std::any::Any;
use tutti_core::adapters::codex::{CodexAdapter, CodexConfig, DROPPED_REQUEST, UNOWNED_REQUEST};
use tutti_core::adapters::{
    child_ids, parse_line, Adapter, AdapterError, AdapterOutput, AdapterTimer,
};
use tutti_core::driver::{DriverError, DriverInput, Output, Record, Testkit};
use tutti_core::model::{Outcome, Phase, ProviderPhase, Target};
use tutti_core::replay::codex::{
    replay_transcript, replay_transcript_with, CodexReplay, ReplayOptions,
};
use tutti_core::store::MemoryStore;
use tutti_core::{Driver, Engine, Input, NormalizedEvent, RuntimeAnswer, Step};

const ROOT: &str = "R";
const T1: &str = "T1";
const ROOT_THREAD: &str = "thr-root";
const N1: &str = "native-1";

/// The canonical child session of a thread under root `R` (deterministic, see `child_ids`).
fn child(thread: &str) -> String {
    child_ids(&ROOT.into(), "thread", thread, 1).0.to_string()
}

/// The canonical n-th turn of that child.
fn child_turn(thread: &str, n: u32) -> String {
    child_ids(&ROOT.into(), "thread", thread, n).1.to_string()
}

/// The same under the replay's root session.
fn replay_child(thread: &str) -> (String, String) {
    let (s, t) = child_ids(&"root".into(), "thread", thread, 1);
    (s.to_string(), t.to_string())
}

// ---- native message builders ---------------------------------------------------------------

fn turn_started(thread: &str, turn: &str) -> Value {
    json!({"method":"turn/started","params":{"threadId":thread,"turn":{"id":turn,"items":[],"status":"inProgress","error":null}}})
}

fn turn_completed(thread: &str, turn: &str, status: &str, error: Option<&str>) -> Value {
    let error = error.map(|m| json!({"message": m}));
    json!({"method":"turn/completed","params":{"threadId":thread,"turn":{"id":turn,"items":[],"status":status,"error":error}}})
}

fn item(thread: &str, turn: &str, done: bool, item: Value) -> Value {
    let method = if done {
        "item/completed"
    } else {
        "item/started"
    };
    json!({"method":method,"params":{"threadId":thread,"turnId":turn,"item":item}})
}

fn spawn_v1(thread: &str, turn: &str, call: &str, receivers: &[&str], done: bool) -> Value {
    let status = if done { "completed" } else { "inProgress" };
    item(
        thread,
        turn,
        done,
        json!({"type":"collabAgentToolCall","id":call,"tool":"spawnAgent","status":status,
               "senderThreadId":thread,"receiverThreadIds":receivers,"prompt":"do it","agentsStates":{}}),
    )
}

fn subagent(thread: &str, turn: &str, call: &str, kind: &str, agent: &str, done: bool) -> Value {
    item(
        thread,
        turn,
        done,
        json!({"type":"subAgentActivity","id":call,"kind":kind,"agentThreadId":agent,"agentPath":"/root/helper_one"}),
    )
}

fn agent_message(thread: &str, turn: &str, id: &str, text: &str) -> Value {
    item(
        thread,
        turn,
        true,
        json!({"type":"agentMessage","id":id,"text":text}),
    )
}

fn status(thread: &str, flags: &[&str]) -> Value {
    json!({"method":"thread/status/changed","params":{"threadId":thread,"status":{"type":"active","activeFlags":flags}}})
}

fn warning(thread: &str) -> Value {
    json!({"method":"warning","params":{"threadId":thread,"message":"model metadata not found"}})
}

fn server_request(id: Value, method: &str, thread: &str, turn: &str) -> Value {
    json!({"id":id,"method":method,"params":{"threadId":thread,"turnId":turn,"itemId":"call-x","command":"touch x","reason":"needs to write"}})
}

fn resolved(thread: &str, id: Value) -> Value {
    json!({"method":"serverRequest/resolved","params":{"threadId":thread,"requestId":id}})
}

// ---- the rig: a Driver host (MemoryStore, clock) with the real adapter ---------------------

/// The [`Driver`] does the wiring (the daemon's): engine requests to the adapter, adapter events
/// before answers into the engine, an interaction the engine did not take back to `on_dropped`.
/// Every host call commits what was decided and checks the invariants; the rig notes what passed
/// between the adapter and the engine from the driver's records.
/// The driver's replies to host inputs (token, committed step or why not).
type Replies = Vec<(u64, Result<Step, DriverError>)>;

struct Rig {
    d: Driver,
    store: MemoryStore,
    now: i64,
    native: Vec<Value>,
    answered: Vec<i64>,
    events: Vec<NormalizedEvent>,
    answers: Vec<RuntimeAnswer>,
    timers: Vec<AdapterTimer>,
    diagnostics: Vec<String>,
    rejected: Vec<String>,
    /// Events the engine did not take that went back through `on_dropped`.
    dropped: Vec<NormalizedEvent>,
}

impl Rig {
    /// Root session R, adapter opened, handshake answered, root thread `thr-root`.
    fn new(config: CodexConfig) -> Rig {
        let mut r = Rig::without_thread(config);
        r.respond("thread/start", json!({"thread":{"id":ROOT_THREAD}}));
        r
    }

    /// Root session R, adapter attached (opened); nothing answered yet.
    fn bare(config: CodexConfig) -> Rig {
        let mut d = Driver::new();
        d.set_recording(true);
        let mut r = Rig {
            d,
            store: MemoryStore::new(),
            now: 0,
            native: Vec::new(),
            answered: Vec::new(),
            events: Vec::new(),
            answers: Vec::new(),
            timers: Vec::new(),
            diagnostics: Vec::new(),
            rejected: Vec::new(),
            dropped: Vec::new(),
        };
        r.command(json!({"type":"createSession","agentSessionId":ROOT,"workspaceId":"W","provider":"codex"}));
        r.now += 1;
        let adapter = CodexAdapter::new(ROOT.into(), config);
        let _ = r.d.handle(
            DriverInput::Attach {
                now: r.now,
                root: ROOT.into(),
                adapter: Box::new(adapter),
            },
            &r.store,
        );
        r.settle();
        r
    }

    /// Root session R, adapter opened, `initialize` answered; `thread/start` not answered yet.
    fn without_thread(config: CodexConfig) -> Rig {
        let mut r = Rig::bare(config);
        r.respond("initialize", json!({"userAgent":"codex/0.171.0"}));
        r
    }

    /// [`Rig::new`] plus root turn T1 started as native turn `native-1`.
    fn running() -> Rig {
        let mut r = Rig::new(CodexConfig::default());
        r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":T1,"text":"hello"}));
        r.respond(
            "turn/start",
            json!({"turn":{"id":N1,"status":"inProgress"}}),
        );
        r.feed(turn_started(ROOT_THREAD, N1));
        r
    }

    /// [`Rig::running`] plus a v1 child on thread `thread` whose first turn runs as `cturn`.
    fn with_child(thread: &str, cturn: &str) -> Rig {
        let mut r = Rig::running();
        r.spawn(ROOT_THREAD, N1, &format!("call-{thread}"), thread);
        r.feed(turn_started(thread, cturn));
        r
    }

    fn spawn(&mut self, parent_thread: &str, parent_turn: &str, call: &str, thread: &str) {
        self.feed(spawn_v1(parent_thread, parent_turn, call, &[], false));
        self.feed(spawn_v1(parent_thread, parent_turn, call, &[thread], true));
    }

    fn engine(&self) -> &Engine {
        self.d.engine()
    }

    /// The adapter (reads).
    fn adapter(&self) -> &CodexAdapter {
        let a: &dyn Any = self.d.adapter(ROOT).expect("the root's adapter is live");
        a.downcast_ref().expect("a CodexAdapter")
    }

    /// An adapter unit check: one call on the adapter itself, its output looked at in isolation
    /// (not carried out).
    fn unit<T>(&mut self, f: impl FnOnce(&mut CodexAdapter, i64) -> T) -> T {
        let now = self.now;
        let a: &mut dyn Any = self
            .d
            .adapter_mut(ROOT)
            .expect("the root's adapter is live");
        f(a.downcast_mut().expect("a CodexAdapter"), now)
    }

    fn check(&self) {
        let v = self.engine().check_invariants();
        assert!(v.is_empty(), "invariants: {v:?}");
    }

    /// Commits what the driver decided, checks, notes the records; returns the adapter outputs.
    fn settle(&mut self) -> (Vec<AdapterOutput>, Replies) {
        let mut replies = Vec::new();
        for o in self.d.commit_pending(&mut self.store) {
            if let Output::Reply { to, result } = o {
                replies.push((to, result));
            }
        }
        self.check();
        let mut outs = Vec::new();
        for rec in self.d.take_records() {
            match rec {
                Record::Adapter { output, .. } => {
                    self.native.extend(output.native.iter().cloned());
                    self.timers.extend(output.timers.iter().cloned());
                    self.diagnostics.extend(output.diagnostics.iter().cloned());
                    self.events.extend(output.events.iter().cloned());
                    self.answers.extend(output.answers.iter().cloned());
                    outs.push(output);
                }
                Record::Decided {
                    input,
                    outcome: Err(e),
                } => {
                    let label = serde_json::to_string(&input).unwrap_or_default();
                    self.rejected.push(format!("{e}: {label}"));
                }
                Record::Dropped { event, .. } => self.dropped.push(event),
                Record::Decided { .. } => {}
            }
        }
        (outs, replies)
    }

    /// A host command through the driver; its committed step, or `None` if rejected.
    fn engine_input(&mut self, input: Input) -> Option<Step> {
        self.now += 1;
        let _ = self.d.handle(
            DriverInput::Host {
                now: self.now,
                input,
                reply: Some(1),
            },
            &self.store,
        );
        let (_, replies) = self.settle();
        replies
            .into_iter()
            .find(|(to, _)| *to == 1)
            .and_then(|(_, r)| r.ok())
    }

    fn command(&mut self, v: Value) -> Step {
        let label = v.to_string();
        let input: Input = serde_json::from_value(v).expect("valid command");
        self.engine_input(input)
            .unwrap_or_else(|| panic!("command rejected: {label}: {:?}", self.rejected))
    }

    /// One native message from the app-server; the adapter's output for it.
    fn try_feed(&mut self, v: &Value) -> Result<AdapterOutput, AdapterError> {
        self.now += 1;
        match self.d.handle(
            DriverInput::Native {
                now: self.now,
                root: ROOT,
                message: v,
            },
            &self.store,
        ) {
            Ok(()) => {}
            Err(DriverError::Adapter(e)) => return Err(e),
            Err(e) => panic!("driver refused {v}: {e}"),
        }
        let (outs, _) = self.settle();
        Ok(outs.into_iter().next().unwrap_or_default())
    }

    fn feed(&mut self, v: Value) -> AdapterOutput {
        self.try_feed(&v)
            .unwrap_or_else(|e| panic!("adapter error {e} for {v}"))
    }

    /// Fires one adapter timer through the driver.
    fn timer(&mut self, id: &str) {
        self.now += 1;
        self.d
            .handle(
                DriverInput::Call {
                    now: self.now,
                    root: ROOT,
                    call: Box::new(|a, now| a.on_timer(now, id)),
                },
                &self.store,
            )
            .expect("the root's adapter is live");
        self.settle();
    }

    /// Native requests with this method, in order.
    fn requests(&self, method: &str) -> Vec<Value> {
        self.native
            .iter()
            .filter(|n| n["method"] == method && n.get("id").is_some())
            .cloned()
            .collect()
    }

    /// Answers the oldest unanswered native request with this method.
    fn respond(&mut self, method: &str, result: Value) -> AdapterOutput {
        self.answer(method, Ok(result))
    }

    fn answer(&mut self, method: &str, answer: Result<Value, &str>) -> AdapterOutput {
        let id = self
            .requests(method)
            .iter()
            .filter_map(|n| n["id"].as_i64())
            .find(|id| !self.answered.contains(id))
            .unwrap_or_else(|| panic!("no unanswered {method} in {:?}", self.native));
        self.answered.push(id);
        let msg = match answer {
            Ok(result) => json!({"id": id, "result": result}),
            Err(message) => json!({"id": id, "error": {"code": -32600, "message": message}}),
        };
        self.feed(msg)
    }

    fn phase(&self, session: &str, turn: &str) -> Phase {
        self.engine()
            .turn(session, turn)
            .expect("turn exists")
            .phase()
    }

    fn outcome(&self, session: &str, turn: &str) -> Option<Outcome> {
        self.engine()
            .turn(session, turn)
            .expect("turn exists")
            .outcome()
    }

    fn root_provider(&self) -> (ProviderPhase, Option<String>) {
        let t = self.engine().turn(ROOT, T1).expect("root turn");
        let r = t.root_provider_turn().cloned().unwrap_or_default();
        (r.phase(), r.provider_turn_id)
    }
}

fn kinds(out: &AdapterOutput) -> Vec<&'static str> {
    out.events.iter().map(NormalizedEvent::kind).collect()
}

fn target(session: &str, turn: &str) -> Target {
    Target {
        agent_session_id: session.into(),
        turn_id: turn.into(),
    }
}

// ---- rule: root thread = the session's providerSessionId -----------------------------------

#[test]
fn root_thread_is_the_sessions_provider_session_id() {
    let mut config = CodexConfig {
        cwd: Some("/work".into()),
        approval_policy: Some("on-request".into()),
        sandbox: Some("read-only".into()),
        ..CodexConfig::default()
    };
    config
        .config
        .insert("features.multi_agent".into(), json!(true));
    config.config.insert("agents.max_depth".into(), json!(2));
    assert_eq!(config.cancel_timeout_ms, 10_000);
    let mut a = CodexAdapter::new(ROOT.into(), config);
    let out = a.open(0);
    let methods: Vec<&str> = out
        .native
        .iter()
        .filter_map(|n| n["method"].as_str())
        .collect();
    assert_eq!(methods, ["initialize", "thread/start"]);
    assert_eq!(
        out.native[1]["params"],
        json!({"cwd":"/work","approvalPolicy":"on-request","sandbox":"read-only",
               "config":{"features.multi_agent":true,"agents.max_depth":2}})
    );
    // `initialized` only after the initialize response.
    let init_id = out.native[0]["id"].clone();
    let o = a
        .on_native(1, &json!({"id": init_id, "result": {}}))
        .unwrap();
    assert_eq!(o.native, vec![json!({"method":"initialized"})]);

    // Through the engine: a Start before the thread exists is queued, then sent on it.
    let mut r = Rig::bare(CodexConfig::default());
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":T1,"text":"hello"}));
    assert!(
        r.requests("turn/start").is_empty(),
        "queued until the thread exists"
    );
    r.respond("initialize", json!({}));
    let out = r.respond("thread/start", json!({"thread":{"id":ROOT_THREAD}}));
    assert_eq!(kinds(&out), ["sessionMetadataUpdated"]);
    assert_eq!(
        r.engine()
            .session(ROOT)
            .unwrap()
            .provider_session_id
            .as_deref(),
        Some(ROOT_THREAD)
    );
    assert_eq!(r.adapter().root_thread_id(), Some(ROOT_THREAD));
    let start = r.requests("turn/start");
    assert_eq!(start.len(), 1);
    assert_eq!(start[0]["params"]["threadId"], ROOT_THREAD);
    assert_eq!(start[0]["params"]["input"][0]["text"], "hello");
    // Root turn/started -> rootProviderTurnStarted for the canonical root turn.
    r.respond("turn/start", json!({"turn":{"id":N1}}));
    let out = r.feed(turn_started(ROOT_THREAD, N1));
    assert_eq!(kinds(&out), ["rootProviderTurnStarted"]);
    assert_eq!(
        r.root_provider(),
        (ProviderPhase::Running, Some(N1.to_string()))
    );
    assert_eq!(r.phase(ROOT, T1), Phase::Running);
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn resume_thread_id_opens_with_thread_resume() {
    let mut a = CodexAdapter::new(
        ROOT.into(),
        CodexConfig {
            resume_thread_id: Some("old-thread".into()),
            ..CodexConfig::default()
        },
    );
    let out = a.open(0);
    assert_eq!(out.native[1]["method"], "thread/resume");
    assert_eq!(out.native[1]["params"]["threadId"], "old-thread");
    let id = out.native[1]["id"].clone();
    let o = a
        .on_native(
            1,
            &json!({"id": id, "result": {"thread": {"id": "old-thread"}}}),
        )
        .unwrap();
    assert_eq!(kinds(&o), ["sessionMetadataUpdated"]);
    assert_eq!(a.root_thread_id(), Some("old-thread"));
}

// ---- rule: spawn edges in both shapes ------------------------------------------------------

#[test]
fn spawn_edge_collab_agent_tool_call_creates_completed_delegation_call_child_session_and_submitted_turn(
) {
    let mut r = Rig::running();
    let out = r.feed(spawn_v1(ROOT_THREAD, N1, "call-1", &[], false));
    assert_eq!(kinds(&out), ["toolCallUpdated"]);
    assert_eq!(
        &*r.engine().tool_call(ROOT, "call-1").unwrap().status,
        "started"
    );
    let out = r.feed(spawn_v1(ROOT_THREAD, N1, "call-1", &["c1"], true));
    assert_eq!(kinds(&out), ["toolCallUpdated", "childSessionCreated"]);
    let call = r.engine().tool_call(ROOT, "call-1").unwrap();
    assert_eq!(&*call.status, "completed", "delegation accepted");
    assert_eq!(*call.turn_id, *T1, "the call stays on the parent turn");
    // Written out, not derived with `child_ids`: a change in the id derivation (which would
    // orphan every stored child) fails here.
    assert_eq!(child("c1"), "R~thread-c1");
    assert_eq!(child_turn("c1", 1), "R~thread-c1~turn-1");
    let s = r.engine().session("R~thread-c1").expect("child session");
    assert!(s.is_child());
    assert!(
        r.engine()
            .turn("R~thread-c1", "R~thread-c1~turn-1")
            .is_some(),
        "its first turn"
    );
    assert_eq!(s.parent_agent_session_id().map(|x| &**x), Some(ROOT));
    assert_eq!(s.parent_turn_id().map(|x| &**x), Some(T1));
    assert_eq!(s.parent_tool_call_id().map(|x| &**x), Some("call-1"));
    assert_eq!(s.root_agent_session_id().map(|x| &**x), Some(ROOT));
    assert_eq!(s.root_turn_id().map(|x| &**x), Some(T1));
    assert_eq!(s.provider_session_id.as_deref(), Some("c1"));
    assert_eq!(s.provider_aliases.thread_id.as_deref(), Some("c1"));
    assert_eq!(
        r.phase(&child("c1"), &child_turn("c1", 1)),
        Phase::Submitted
    );
    assert_eq!(
        r.adapter().child_session_for_thread("c1").map(|s| &**s),
        Some(&*child("c1"))
    );
    assert_eq!(r.adapter().thread_for_session(&child("c1")), Some("c1"));
    // Repeats are idempotent: nothing emitted at all.
    let out = r.feed(spawn_v1(ROOT_THREAD, N1, "call-1", &["c1"], true));
    assert!(out.events.is_empty(), "{:?}", out.events);
    // Two receivers on one call: one child each.
    let out = r.feed(spawn_v1(ROOT_THREAD, N1, "call-2", &["c2", "c3"], true));
    assert_eq!(
        kinds(&out),
        [
            "toolCallUpdated",
            "childSessionCreated",
            "childSessionCreated"
        ]
    );
    assert_eq!(r.engine().active_child_turns(ROOT, T1), 3);
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn spawn_edge_sub_agent_activity_started_creates_completed_delegation_call_and_child() {
    let mut r = Rig::running();
    let out = r.feed(subagent(ROOT_THREAD, N1, "call-1", "started", "c1", false));
    assert_eq!(kinds(&out), ["toolCallUpdated", "childSessionCreated"]);
    let call = r.engine().tool_call(ROOT, "call-1").unwrap();
    assert_eq!(&*call.status, "completed");
    assert_eq!(call.name.as_deref(), Some("spawnAgent"));
    let s = r.engine().session(&child("c1")).unwrap();
    assert_eq!(s.parent_tool_call_id().map(|x| &**x), Some("call-1"));
    assert_eq!(s.title.as_deref(), Some("helper_one"));
    // The same item completing, and the v1 shape naming the same edge: idempotent.
    let out = r.feed(subagent(ROOT_THREAD, N1, "call-1", "started", "c1", true));
    assert!(out.events.is_empty());
    let out = r.feed(spawn_v1(ROOT_THREAD, N1, "call-1", &["c1"], true));
    assert!(kinds(&out).iter().all(|k| *k != "childSessionCreated"));
    // subAgentActivity completed is progress on the parent; the child's own turn/completed
    // settles the child.
    r.feed(turn_started("c1", "ct1"));
    let out = r.feed(subagent(
        ROOT_THREAD,
        N1,
        "sub-done",
        "completed",
        "c1",
        true,
    ));
    assert_eq!(kinds(&out), ["toolCallUpdated"]);
    assert_eq!(r.phase(&child("c1"), &child_turn("c1", 1)), Phase::Running);
    r.feed(turn_completed("c1", "ct1", "completed", None));
    assert_eq!(
        r.outcome(&child("c1"), &child_turn("c1", 1)),
        Some(Outcome::Completed)
    );
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn nested_spawn_from_child_thread_creates_grandchild_with_root_relation_kept() {
    let mut r = Rig::with_child("c1", "ct1");
    let out = r.feed(spawn_v1("c1", "ct1", "call-g", &["g1"], true));
    assert_eq!(kinds(&out), ["toolCallUpdated", "childSessionCreated"]);
    let call = r.engine().tool_call(&child("c1"), "call-g").unwrap();
    assert_eq!(
        *call.turn_id,
        *child_turn("c1", 1),
        "delegation call on the child turn"
    );
    let g = r.engine().session(&child("g1")).unwrap();
    assert_eq!(
        g.parent_agent_session_id().map(|x| &**x),
        Some(&*child("c1"))
    );
    assert_eq!(
        g.parent_turn_id().map(|x| &**x),
        Some(&*child_turn("c1", 1))
    );
    assert_eq!(g.root_agent_session_id().map(|x| &**x), Some(ROOT));
    assert_eq!(g.root_turn_id().map(|x| &**x), Some(T1));
    // v2 shape from a child too.
    r.feed(subagent("c1", "ct1", "call-g2", "started", "g2", false));
    assert_eq!(
        r.engine()
            .session(&child("g2"))
            .unwrap()
            .root_turn_id()
            .map(|x| &**x),
        Some(T1)
    );
    // The grandchild gates the root: root provider and child done, grandchildren still active.
    r.feed(turn_completed("c1", "ct1", "completed", None));
    r.feed(turn_completed(ROOT_THREAD, N1, "completed", None));
    assert_eq!(r.phase(ROOT, T1), Phase::Waiting);
    r.feed(turn_started("g1", "gt1"));
    r.feed(turn_completed("g1", "gt1", "completed", None));
    r.feed(turn_started("g2", "gt2"));
    r.feed(turn_completed("g2", "gt2", "failed", Some("boom")));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Completed));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

// ---- rule: foreign-thread events before registration ---------------------------------------

#[test]
fn early_child_events_before_registration_never_touch_the_root_and_reconcile_into_the_child() {
    let mut r = Rig::running();
    let before = r.engine().turn(ROOT, T1).cloned();
    // The real binary: thread/status/changed and warning before the spawn item completes; here
    // also the child's turn/started, a message and a request.
    let early = vec![
        r.feed(status("c1", &[])),
        r.feed(warning("c1")),
        r.feed(turn_started("c1", "ct1")),
        r.feed(agent_message("c1", "ct1", "m1", "early words")),
    ];
    for out in &early {
        assert!(
            out.events.is_empty(),
            "no event before registration: {:?}",
            out.events
        );
    }
    assert_eq!(
        r.engine().turn(ROOT, T1).cloned(),
        before,
        "root turn untouched"
    );
    assert_eq!(
        r.root_provider(),
        (ProviderPhase::Running, Some(N1.to_string())),
        "no second root provider turn"
    );
    assert_eq!(
        r.engine().session(ROOT).unwrap().active_turn_id.as_deref(),
        Some(T1)
    );
    assert_eq!(r.adapter().early_event_count("c1"), 4);
    // The edge registers: the early turn/started is replayed into the child.
    let out = r.feed(spawn_v1(ROOT_THREAD, N1, "call-1", &["c1"], true));
    assert_eq!(
        kinds(&out),
        [
            "toolCallUpdated",
            "childSessionCreated",
            "turnStarted",
            "messageAppended"
        ]
    );
    assert!(out
        .diagnostics
        .iter()
        .any(|d| d.contains("c1") && d.contains("4 early events")));
    let t = r.engine().turn(&child("c1"), &child_turn("c1", 1)).unwrap();
    assert_eq!(t.phase(), Phase::Running);
    assert_eq!(t.provider_turn_id(), Some("ct1"));
    assert_eq!(r.adapter().early_event_count("c1"), 0);
    // An early terminal is replayed too, so the child never gates the root forever.
    r.feed(turn_started("c2", "ct2"));
    r.feed(turn_completed("c2", "ct2", "completed", None));
    r.feed(spawn_v1(ROOT_THREAD, N1, "call-2", &["c2"], true));
    assert_eq!(
        r.outcome(&child("c2"), &child_turn("c2", 1)),
        Some(Outcome::Completed)
    );
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn late_root_output_of_an_earlier_root_turn_never_lands_on_a_newer_one() {
    let mut r = Rig::running();
    r.feed(turn_completed(ROOT_THREAD, N1, "completed", None));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Completed));
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T2","text":"next"}));
    r.respond("turn/start", json!({"turn":{"id":"native-2"}}));
    r.feed(turn_started(ROOT_THREAD, "native-2"));
    let out = r.feed(agent_message(ROOT_THREAD, N1, "late", "old words"));
    match &out.events[..] {
        [NormalizedEvent::MessageAppended { turn_id, .. }] => assert_eq!(&**turn_id, T1),
        other => panic!("{other:?}"),
    }
    let out = r.feed(turn_completed(ROOT_THREAD, N1, "completed", None));
    match &out.events[..] {
        [NormalizedEvent::RootProviderTurnCompleted { turn_id, .. }] => {
            assert_eq!(turn_id.as_deref(), Some(T1))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        r.phase(ROOT, "T2"),
        Phase::Running,
        "the new root turn is untouched"
    );
    let out = r.feed(agent_message(ROOT_THREAD, "native-2", "new", "new words"));
    match &out.events[..] {
        [NormalizedEvent::MessageAppended { turn_id, .. }] => assert_eq!(&**turn_id, "T2"),
        other => panic!("{other:?}"),
    }
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn early_event_tracking_is_bounded() {
    let mut r = Rig::running();
    for n in 0..300 {
        let out = r.feed(warning(&format!("t{n}")));
        assert!(out.events.is_empty());
    }
    assert_eq!(r.adapter().early_event_count("t0"), 1);
    assert_eq!(
        r.adapter().early_event_count("t299"),
        0,
        "beyond the bound: counted only in total"
    );
    for _ in 0..300 {
        r.feed(agent_message("t0", "x", "m", "y"));
    }
    let out = r.feed(spawn_v1(ROOT_THREAD, N1, "call-1", &["t0"], true));
    assert!(out.events.len() <= 2 + 256, "replay is bounded");
    assert_eq!(r.phase(ROOT, T1), Phase::Running);
}

#[test]
fn early_events_of_a_thread_that_never_registers_stay_diagnostics() {
    let mut r = Rig::running();
    r.feed(turn_started("ghost", "gt"));
    r.feed(turn_completed("ghost", "gt", "completed", None));
    assert_eq!(r.adapter().early_event_count("ghost"), 2);
    r.feed(turn_completed(ROOT_THREAD, N1, "completed", None));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Completed));
    assert!(r.engine().session(&child("ghost")).is_none());
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

// ---- rule: child turns, root terminal, statuses ---------------------------------------------

#[test]
fn child_turn_events_map_to_the_exact_child_turn_with_the_native_id_as_alias() {
    let mut r = Rig::running();
    r.spawn(ROOT_THREAD, N1, "call-1", "c1");
    let out = r.feed(turn_started("c1", "ct1"));
    assert_eq!(
        out.events,
        vec![NormalizedEvent::TurnStarted {
            agent_session_id: child("c1").into(),
            turn_id: child_turn("c1", 1).into(),
            provider_turn_id: Some("ct1".into()),
        }]
    );
    // Waiting on an approval and back.
    r.feed(status("c1", &["waitingOnApproval"]));
    assert_eq!(r.phase(&child("c1"), &child_turn("c1", 1)), Phase::Waiting);
    r.feed(status("c1", &[]));
    assert_eq!(r.phase(&child("c1"), &child_turn("c1", 1)), Phase::Running);
    let out = r.feed(agent_message("c1", "ct1", "m1", "child words"));
    assert_eq!(kinds(&out), ["messageAppended"]);
    let out = r.feed(turn_completed("c1", "ct1", "completed", None));
    assert_eq!(
        out.events,
        vec![NormalizedEvent::TurnTerminal {
            agent_session_id: child("c1").into(),
            turn_id: child_turn("c1", 1).into(),
            outcome: Outcome::Completed,
            error: None,
        }]
    );
    // A later native turn on the child is its next canonical turn, same root relation.
    let out = r.feed(turn_started("c1", "ct2"));
    assert_eq!(
        out.events,
        vec![NormalizedEvent::TurnStarted {
            agent_session_id: child("c1").into(),
            turn_id: child_turn("c1", 2).into(),
            provider_turn_id: Some("ct2".into()),
        }]
    );
    r.feed(turn_completed(ROOT_THREAD, N1, "completed", None));
    assert_eq!(
        r.phase(ROOT, T1),
        Phase::Waiting,
        "the child's second turn gates the root"
    );
    r.feed(turn_completed("c1", "ct2", "interrupted", Some("stopped")));
    let t2 = r.engine().turn(&child("c1"), &child_turn("c1", 2)).unwrap();
    assert_eq!(t2.outcome(), Some(Outcome::Interrupted));
    assert_eq!(t2.error(), Some("stopped"));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Completed));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn root_turn_completed_maps_to_root_provider_turn_completed_only() {
    let mut r = Rig::with_child("c1", "ct1");
    let out = r.feed(turn_completed(ROOT_THREAD, N1, "completed", None));
    assert_eq!(
        out.events,
        vec![NormalizedEvent::RootProviderTurnCompleted {
            agent_session_id: ROOT.into(),
            turn_id: Some(T1.into()),
            provider_turn_id: Some(N1.into()),
            outcome: Outcome::Completed,
            error: None,
        }]
    );
    assert_eq!(
        r.phase(ROOT, T1),
        Phase::Waiting,
        "not settled while the child runs"
    );
    r.feed(turn_completed("c1", "ct1", "completed", None));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Completed));
}

#[test]
fn status_values_completed_interrupted_failed_map_to_outcomes_with_error_for_failed_and_interrupted_only(
) {
    for (status, outcome, expect_error) in [
        ("completed", Outcome::Completed, None),
        ("interrupted", Outcome::Interrupted, Some("cut")),
        ("failed", Outcome::Failed, Some("cut")),
    ] {
        let mut r = Rig::running();
        let out = r.feed(turn_completed(ROOT_THREAD, N1, status, Some("cut")));
        match &out.events[..] {
            [NormalizedEvent::RootProviderTurnCompleted {
                outcome: o, error, ..
            }] => {
                assert_eq!(*o, outcome);
                assert_eq!(error.as_deref(), expect_error, "{status}");
            }
            other => panic!("{other:?}"),
        }
        let t = r.engine().turn(ROOT, T1).unwrap();
        assert_eq!(t.outcome(), Some(outcome));
        assert_eq!(t.error(), expect_error);
    }
    // inProgress is not a terminal status: garbage.
    let mut r = Rig::running();
    assert!(r
        .try_feed(&turn_completed(ROOT_THREAD, N1, "inProgress", None))
        .is_err());
}

// ---- rule: server requests -----------------------------------------------------------------

#[test]
fn server_request_on_registered_child_is_owned_by_the_child_and_answered_with_original_ids() {
    let mut r = Rig::with_child("c1", "ct1");
    let out = r.feed(server_request(
        json!(7),
        "item/commandExecution/requestApproval",
        "c1",
        "ct1",
    ));
    assert_eq!(kinds(&out), ["interactionRequested"]);
    let pending = r.engine().pending_interactions(ROOT);
    assert_eq!(pending.len(), 1);
    let i = &pending[0];
    assert_eq!(*i.agent_session_id, *child("c1"));
    assert_eq!(*i.turn_id, *child_turn("c1", 1));
    assert_eq!(&*i.request_id, "7");
    assert_eq!(i.provider_turn_id.as_deref(), Some("ct1"));
    assert_eq!(i.kind, json!("item/commandExecution/requestApproval"));
    assert_eq!(i.payload["command"], "touch x");
    // The engine answers by the canonical tuple; the adapter answers the original JSON-RPC id.
    r.command(
        json!({"type":"respondInteraction","agentSessionId":child("c1"),
        "turnId":child_turn("c1", 1),"requestId":"7","response":"allow"}),
    );
    assert_eq!(
        r.native.last(),
        Some(&json!({"id": 7, "result": {"decision": "accept"}}))
    );
    // serverRequest/resolved reaches the interaction through the child.
    let out = r.feed(resolved("c1", json!(7)));
    match &out.events[..] {
        [NormalizedEvent::InteractionResolved {
            agent_session_id,
            turn_id,
            request_id,
            ..
        }] => {
            assert_eq!(**agent_session_id, *child("c1"));
            assert_eq!(**turn_id, *child_turn("c1", 1));
            assert_eq!(&**request_id, "7");
        }
        other => panic!("{other:?}"),
    }
    assert!(r.engine().pending_interactions(ROOT).is_empty());
    // A string request id is echoed as a string.
    r.feed(server_request(
        json!("req-a"),
        "item/fileChange/requestApproval",
        "c1",
        "ct1",
    ));
    r.command(json!({"type":"respondInteraction","agentSessionId":child("c1"),
        "turnId":child_turn("c1", 1),"requestId":"req-a","response":{"decision":"acceptForSession"}}));
    assert_eq!(
        r.native.last(),
        Some(&json!({"id": "req-a", "result": {"decision": "acceptForSession"}}))
    );
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn server_request_on_root_thread_belongs_to_the_root_turn() {
    let mut r = Rig::running();
    r.feed(server_request(
        json!(0),
        "item/tool/requestUserInput",
        ROOT_THREAD,
        N1,
    ));
    let i = &r.engine().pending_interactions(ROOT)[0];
    assert_eq!((&*i.agent_session_id, &*i.turn_id), (ROOT, T1));
    assert_eq!(i.provider_turn_id.as_deref(), Some(N1));
}

#[test]
fn server_request_on_unknown_non_root_thread_is_answered_with_an_error_never_attributed_to_the_root(
) {
    let mut r = Rig::running();
    let out = r.feed(server_request(
        json!(3),
        "item/commandExecution/requestApproval",
        "stranger",
        "st1",
    ));
    assert!(out.events.is_empty());
    assert_eq!(out.native.len(), 1);
    assert_eq!(out.native[0]["id"], 3);
    assert_eq!(out.native[0]["error"]["code"], UNOWNED_REQUEST);
    assert!(r.engine().pending_interactions(ROOT).is_empty());
    // Without any thread: also an error.
    let out = r.feed(
        json!({"id": 4, "method": "account/chatgptAuthTokens/refresh", "params": {"reason": "x"}}),
    );
    assert!(out.events.is_empty());
    assert_eq!(out.native[0]["error"]["code"], UNOWNED_REQUEST);
}

#[test]
fn interaction_answers_map_to_native_decisions() {
    let cases = [
        (
            "item/commandExecution/requestApproval",
            json!("allow"),
            json!({"decision":"accept"}),
        ),
        (
            "item/commandExecution/requestApproval",
            json!("accept"),
            json!({"decision":"accept"}),
        ),
        (
            "item/commandExecution/requestApproval",
            json!("deny"),
            json!({"decision":"decline"}),
        ),
        (
            "item/fileChange/requestApproval",
            json!("decline"),
            json!({"decision":"decline"}),
        ),
        (
            "item/fileChange/requestApproval",
            json!({"decision":"cancel"}),
            json!({"decision":"cancel"}),
        ),
        (
            "item/permissions/requestApproval",
            json!("deny"),
            json!({"permissions":{}}),
        ),
        (
            "execCommandApproval",
            json!("allow"),
            json!({"decision":"approved"}),
        ),
    ];
    for (n, (method, response, native)) in cases.into_iter().enumerate() {
        let mut r = Rig::with_child("c1", "ct1");
        r.feed(server_request(json!(n), method, "c1", "ct1"));
        r.command(
            json!({"type":"respondInteraction","agentSessionId":child("c1"),
            "turnId":child_turn("c1", 1),"requestId":n.to_string(),"response":response}),
        );
        assert_eq!(
            r.native.last(),
            Some(&json!({"id": n, "result": native})),
            "{method}"
        );
    }
}

// ---- rule: guidance ------------------------------------------------------------------------

#[test]
fn guidance_steers_the_active_root_provider_turn_with_expected_turn_id() {
    let mut r = Rig::running();
    let step =
        r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T2","text":"also X"}));
    assert_eq!(step.reply.as_ref().map(|x| x.name()), Some("appended"));
    let steer = r.requests("turn/steer");
    assert_eq!(steer.len(), 1);
    assert_eq!(steer[0]["params"]["threadId"], ROOT_THREAD);
    assert_eq!(steer[0]["params"]["expectedTurnId"], N1);
    assert_eq!(steer[0]["params"]["input"][0]["text"], "also X");
    assert!(r.engine().turn(ROOT, "T2").is_none(), "no new root turn");
    r.respond("turn/steer", json!({"turnId": N1}));
    assert!(r.answers.is_empty());
    // A refused steer is a guideFailed answer.
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T3","text":"and Y"}));
    r.answer("turn/steer", Err("no active turn"));
    assert!(matches!(
        r.answers.last(),
        Some(RuntimeAnswer::GuideFailed { turn_id, .. }) if &**turn_id == T1
    ));
}

#[test]
fn guidance_before_the_native_root_turn_id_is_known_is_sent_once_it_is() {
    let mut r = Rig::new(CodexConfig::default());
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":T1,"text":"hello"}));
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T2","text":"also"}));
    assert!(
        r.requests("turn/steer").is_empty(),
        "held: no expectedTurnId yet"
    );
    r.respond("turn/start", json!({"turn":{"id":N1}}));
    let steer = r.requests("turn/steer");
    assert_eq!(steer.len(), 1);
    assert_eq!(steer[0]["params"]["expectedTurnId"], N1);
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn guidance_while_only_children_run_starts_a_root_turn_attached_to_the_same_root_turn() {
    let mut r = Rig::with_child("c1", "ct1");
    r.feed(turn_completed(ROOT_THREAD, N1, "completed", None));
    assert_eq!(r.phase(ROOT, T1), Phase::Waiting);
    let step =
        r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T2","text":"more"}));
    assert_eq!(step.reply.as_ref().map(|x| x.name()), Some("appended"));
    let starts = r.requests("turn/start");
    assert_eq!(starts.len(), 2);
    assert_eq!(starts[1]["params"]["threadId"], ROOT_THREAD);
    assert_eq!(starts[1]["params"]["input"][0]["text"], "more");
    r.respond("turn/start", json!({"turn":{"id":"native-2"}}));
    let out = r.feed(turn_started(ROOT_THREAD, "native-2"));
    assert_eq!(
        out.events,
        vec![NormalizedEvent::RootProviderTurnStarted {
            agent_session_id: ROOT.into(),
            turn_id: Some(T1.into()),
            provider_turn_id: Some("native-2".into()),
        }]
    );
    assert!(r.engine().turn(ROOT, "T2").is_none(), "no new root turn");
    assert_eq!(r.phase(ROOT, T1), Phase::Running);
    // The child completing does not settle the root while the guided provider turn runs.
    r.feed(turn_completed("c1", "ct1", "completed", None));
    assert_eq!(r.phase(ROOT, T1), Phase::Running);
    r.feed(turn_completed(ROOT_THREAD, "native-2", "completed", None));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Completed));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn failed_guidance_start_returns_guide_failed_and_releases_the_reservation() {
    let mut r = Rig::with_child("c1", "ct1");
    r.feed(turn_completed(ROOT_THREAD, N1, "completed", None));
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T2","text":"more"}));
    r.answer("turn/start", Err("thread busy"));
    assert!(matches!(
        r.answers.last(),
        Some(RuntimeAnswer::GuideFailed { turn_id, error, .. }) if &**turn_id == T1 && error == "thread busy"
    ));
    assert_eq!(r.phase(ROOT, T1), Phase::Waiting);
    r.feed(turn_completed("c1", "ct1", "completed", None));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Completed));
}

#[test]
fn refused_root_turn_start_is_a_failed_root_provider_turn() {
    let mut r = Rig::new(CodexConfig::default());
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":T1,"text":"hello"}));
    r.answer("turn/start", Err("model unavailable"));
    let t = r.engine().turn(ROOT, T1).unwrap();
    assert_eq!(t.outcome(), Some(Outcome::Failed));
    assert_eq!(t.error(), Some("model unavailable"));
}

// ---- rule: cancel --------------------------------------------------------------------------

#[test]
fn cancel_interrupts_the_root_first_then_only_the_supplied_children_and_returns_the_acked_subset() {
    let mut r = Rig::with_child("c1", "ct1");
    r.spawn(ROOT_THREAD, N1, "call-c2", "c2");
    r.feed(turn_started("c2", "ct2"));
    r.spawn(ROOT_THREAD, N1, "call-c3", "c3");
    r.feed(turn_started("c3", "ct3"));
    // The adapter is given root + c1 + c3 (not c2): it must not enumerate its children.
    let targets = vec![
        target(ROOT, T1),
        target(&child("c1"), &child_turn("c1", 1)),
        target(&child("c3"), &child_turn("c3", 1)),
    ];
    let out = r.unit(|a, _now| {
        a.on_request(
            100,
            &tutti_core::ProviderRequest::Cancel {
                operation_id: "op".into(),
                root_agent_session_id: ROOT.into(),
                targets: targets.clone(),
            },
        )
    });
    let interrupts: Vec<(String, String)> = out
        .native
        .iter()
        .filter(|n| n["method"] == "turn/interrupt")
        .map(|n| {
            (
                n["params"]["threadId"].as_str().unwrap().to_string(),
                n["params"]["turnId"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        interrupts,
        [
            (ROOT_THREAD.to_string(), N1.to_string()),
            ("c1".to_string(), "ct1".to_string()),
            ("c3".to_string(), "ct3".to_string()),
        ],
        "root first, then the supplied children in order"
    );
    assert!(out.answers.is_empty(), "waits for the acknowledgements");
    assert_eq!(out.timers.len(), 1);
    assert_eq!(out.timers[0].at, 100 + 10_000);
    let ids: Vec<i64> = out
        .native
        .iter()
        .map(|n| n["id"].as_i64().unwrap())
        .collect();
    let mut acked = AdapterOutput::default();
    for (id, ok) in ids.iter().zip([true, false, true]) {
        let msg = if ok {
            json!({"id": id, "result": {}})
        } else {
            json!({"id": id, "error": {"code": -32600, "message": "no active turn"}})
        };
        acked = r.unit(|a, _now| a.on_native(101, &msg)).unwrap();
    }
    assert_eq!(
        acked.answers,
        vec![RuntimeAnswer::CancelResult {
            operation_id: "op".into(),
            acked: vec![target(ROOT, T1), target(&child("c3"), &child_turn("c3", 1))],
        }]
    );
}

#[test]
fn cancel_through_the_engine_settles_the_root_canceled() {
    let mut r = Rig::with_child("c1", "ct1");
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    assert_eq!(r.requests("turn/interrupt").len(), 2);
    r.respond("turn/interrupt", json!({}));
    r.respond("turn/interrupt", json!({}));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Canceled));
    assert_eq!(
        r.outcome(&child("c1"), &child_turn("c1", 1)),
        Some(Outcome::Canceled)
    );
    // The providers' terminals after the cancel: the root's is still normalized (lifecycle
    // closes), the closed child's is dropped.
    let out = r.feed(turn_completed("c1", "ct1", "interrupted", None));
    assert!(out.events.is_empty());
    let out = r.feed(turn_completed(ROOT_THREAD, N1, "interrupted", None));
    assert_eq!(kinds(&out), ["rootProviderTurnCompleted"]);
    assert_eq!(r.root_provider().0, ProviderPhase::Completed);
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Canceled));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn cancel_answers_with_the_subset_acked_so_far_when_the_cancel_timer_fires() {
    let mut r = Rig::with_child("c1", "ct1");
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    r.respond("turn/interrupt", json!({}));
    assert!(r.answers.is_empty());
    let timer = r.timers.last().cloned().expect("cancel timer");
    r.timer(&timer.id);
    assert_eq!(
        r.answers,
        vec![RuntimeAnswer::CancelResult {
            operation_id: "op1".into(),
            acked: vec![target(ROOT, T1)],
        }]
    );
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Canceled));
    assert_eq!(
        r.outcome(&child("c1"), &child_turn("c1", 1)),
        Some(Outcome::Interrupted),
        "unconfirmed child"
    );
    // The late acknowledgement changes nothing.
    let out = r.respond("turn/interrupt", json!({}));
    assert!(out.answers.is_empty());
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn cancel_with_nothing_to_interrupt_answers_at_once() {
    let mut r = Rig::with_child("c1", "ct1");
    r.feed(turn_completed(ROOT_THREAD, N1, "completed", None));
    r.feed(turn_completed("c1", "ct1", "completed", None));
    let out = r.unit(|a, _now| {
        a.on_request(
            50,
            &tutti_core::ProviderRequest::Cancel {
                operation_id: "op".into(),
                root_agent_session_id: ROOT.into(),
                targets: vec![
                    target(ROOT, T1),
                    target(&child("c1"), &child_turn("c1", 1)),
                    target(&child("unknown"), &child_turn("unknown", 1)),
                ],
            },
        )
    });
    assert!(out.native.is_empty());
    assert_eq!(
        out.answers,
        vec![RuntimeAnswer::CancelResult {
            operation_id: "op".into(),
            acked: vec![]
        }]
    );
}

#[test]
fn cancel_of_a_target_whose_native_turn_is_not_known_yet_interrupts_it_once_it_starts() {
    let mut r = Rig::running();
    r.spawn(ROOT_THREAD, N1, "call-1", "c1"); // registered, turn not started yet
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    assert_eq!(
        r.requests("turn/interrupt").len(),
        1,
        "root only, child deferred"
    );
    r.respond("turn/interrupt", json!({}));
    assert!(
        r.answers.is_empty(),
        "the deferred child is still outstanding"
    );
    let out = r.feed(turn_started("c1", "ct1"));
    assert!(
        out.events.is_empty(),
        "a closed target's start is not progress"
    );
    assert_eq!(out.native[0]["method"], "turn/interrupt");
    assert_eq!(
        out.native[0]["params"],
        json!({"threadId":"c1","turnId":"ct1"})
    );
    r.respond("turn/interrupt", json!({}));
    assert_eq!(
        r.answers,
        vec![RuntimeAnswer::CancelResult {
            operation_id: "op1".into(),
            acked: vec![target(ROOT, T1), target(&child("c1"), &child_turn("c1", 1))],
        }]
    );
    assert_eq!(
        r.outcome(&child("c1"), &child_turn("c1", 1)),
        Some(Outcome::Canceled)
    );
}

#[test]
fn cancellation_boundary_interrupts_a_later_root_turn_at_once_and_does_not_adopt_it() {
    let mut r = Rig::running();
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    r.respond("turn/interrupt", json!({}));
    assert!(r.adapter().cancellation_boundary_active());
    r.feed(turn_completed(ROOT_THREAD, N1, "interrupted", None));
    let out = r.feed(turn_started(ROOT_THREAD, "native-late"));
    assert!(out.events.is_empty(), "not adopted");
    assert_eq!(out.native.len(), 1);
    assert_eq!(out.native[0]["method"], "turn/interrupt");
    assert_eq!(
        out.native[0]["params"],
        json!({"threadId": ROOT_THREAD, "turnId": "native-late"})
    );
    // Its output and its terminal are dropped; the canonical root stays canceled.
    let out = r.feed(agent_message(
        ROOT_THREAD,
        "native-late",
        "m9",
        "late words",
    ));
    assert!(out.events.is_empty());
    let out = r.feed(server_request(
        json!(11),
        "item/commandExecution/requestApproval",
        ROOT_THREAD,
        "native-late",
    ));
    assert!(out.events.is_empty());
    assert_eq!(out.native[0]["error"]["code"], UNOWNED_REQUEST);
    let out = r.feed(turn_completed(
        ROOT_THREAD,
        "native-late",
        "interrupted",
        None,
    ));
    assert!(out.events.is_empty());
    let t = r.engine().turn(ROOT, T1).unwrap();
    assert_eq!(t.outcome(), Some(Outcome::Canceled));
    assert_eq!(
        t.root_provider_turn()
            .as_ref()
            .and_then(|p| p.provider_turn_id.as_deref()),
        Some(N1)
    );
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn cancellation_boundary_interrupts_a_child_revealed_by_a_late_spawn_and_never_registers_it() {
    let mut r = Rig::running();
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    r.respond("turn/interrupt", json!({}));
    // Child "late1" already started before its spawn item shows up: interrupted at reveal.
    r.feed(turn_started("late1", "lt1"));
    let out = r.feed(spawn_v1(ROOT_THREAD, N1, "call-9", &["late1"], true));
    assert!(out.events.is_empty(), "no child session/turn creation");
    assert_eq!(out.native.len(), 1);
    assert_eq!(
        out.native[0]["params"],
        json!({"threadId":"late1","turnId":"lt1"})
    );
    // Child "late2" revealed by a v2 spawn, starting afterwards: interrupted when it starts.
    let out = r.feed(subagent(
        ROOT_THREAD,
        N1,
        "call-10",
        "started",
        "late2",
        false,
    ));
    assert!(out.events.is_empty());
    assert!(out.native.is_empty());
    let out = r.feed(turn_started("late2", "lt2"));
    assert!(out.events.is_empty());
    assert_eq!(
        out.native[0]["params"],
        json!({"threadId":"late2","turnId":"lt2"})
    );
    // Their later output never registers them.
    let out = r.feed(agent_message("late2", "lt2", "m", "x"));
    assert!(out.events.is_empty());
    assert!(r.engine().session(&child("late1")).is_none());
    assert!(r.engine().session(&child("late2")).is_none());
    assert!(r.adapter().child_session_for_thread("late2").is_none());
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn cancellation_boundary_drops_canceled_root_output_but_normalizes_its_matching_terminal() {
    let mut r = Rig::with_child("c1", "ct1");
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    let out = r.feed(agent_message(ROOT_THREAD, N1, "m1", "still talking"));
    assert!(
        out.events.is_empty(),
        "root output of the canceled execution is dropped"
    );
    let out = r.feed(turn_completed(
        ROOT_THREAD,
        N1,
        "interrupted",
        Some("interrupted"),
    ));
    assert_eq!(kinds(&out), ["rootProviderTurnCompleted"]);
    r.respond("turn/interrupt", json!({}));
    r.respond("turn/interrupt", json!({}));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Canceled));
    assert_eq!(r.engine().turn(ROOT, T1).unwrap().error(), None);
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn a_new_explicit_root_turn_clears_the_cancellation_boundary() {
    let mut r = Rig::running();
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    r.respond("turn/interrupt", json!({}));
    r.feed(turn_completed(ROOT_THREAD, N1, "interrupted", None));
    assert!(r.adapter().cancellation_boundary_active());
    let step =
        r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T2","text":"again"}));
    assert_eq!(step.reply.as_ref().map(|x| x.name()), Some("started"));
    assert!(!r.adapter().cancellation_boundary_active());
    r.respond("turn/start", json!({"turn":{"id":"native-2"}}));
    let out = r.feed(turn_started(ROOT_THREAD, "native-2"));
    assert_eq!(kinds(&out), ["rootProviderTurnStarted"]);
    let out = r.feed(spawn_v1(ROOT_THREAD, "native-2", "call-n", &["n1"], true));
    assert_eq!(kinds(&out), ["toolCallUpdated", "childSessionCreated"]);
    assert_eq!(
        r.engine()
            .session(&child("n1"))
            .unwrap()
            .root_turn_id()
            .map(|x| &**x),
        Some("T2")
    );
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn cancel_while_the_root_turn_start_is_in_flight_interrupts_the_turn_once_known() {
    let mut r = Rig::new(CodexConfig::default());
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":T1,"text":"hello"}));
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    assert!(r.requests("turn/interrupt").is_empty());
    // The root target is deferred, not answered unconfirmed: the cancel is still in flight.
    assert_eq!(
        r.outcome(ROOT, T1),
        None,
        "answered before the start was known"
    );
    r.respond("turn/start", json!({"turn":{"id":N1}}));
    assert_eq!(
        r.outcome(ROOT, T1),
        None,
        "answered before the interrupt was"
    );
    let interrupts = r.requests("turn/interrupt");
    assert_eq!(interrupts.len(), 1);
    assert_eq!(interrupts[0]["params"]["turnId"], N1);
    let out = r.feed(turn_started(ROOT_THREAD, N1));
    assert!(out.events.is_empty() && out.native.is_empty());
    r.respond("turn/interrupt", json!({}));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Canceled));
    let out = r.feed(turn_completed(ROOT_THREAD, N1, "interrupted", None));
    assert_eq!(
        kinds(&out),
        ["rootProviderTurnCompleted"],
        "matching terminal normalized"
    );
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

/// Rule: a canceled root turn's work that is still waiting in the adapter is dropped with it.
/// A `turn/start` queued until the root thread exists belongs to the canceled canonical root
/// turn; it is never sent once the thread appears ("the adapter stops the root provider turn"
/// — there is none to stop yet, so none may start), while the next root turn's start is sent.
#[test]
fn cancel_drops_the_queued_start_of_the_canceled_root_turn() {
    let mut r = Rig::without_thread(CodexConfig::default());
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":T1,"text":"hello"}));
    assert!(r.requests("turn/start").is_empty(), "queued: no thread yet");
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    assert_eq!(
        r.answers,
        vec![RuntimeAnswer::CancelResult {
            operation_id: "op1".into(),
            acked: vec![],
        }],
        "nothing native to interrupt: answered at once"
    );
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Canceled));
    r.respond("thread/start", json!({"thread":{"id":ROOT_THREAD}}));
    assert!(
        r.requests("turn/start").is_empty(),
        "the canceled turn's queued start is never sent: {:?}",
        r.requests("turn/start")
    );
    // The next root turn starts normally.
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T2","text":"next"}));
    let starts = r.requests("turn/start");
    assert_eq!(starts.len(), 1);
    assert_eq!(starts[0]["params"]["input"][0]["text"], "next");
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

/// Rule: guidance held for a canceled root turn is dropped with it. A steer waiting for the
/// native turn id (`expectedTurnId`) of the canceled root turn is never sent, not even to the
/// next root turn's native turn once that is known.
#[test]
fn cancel_drops_the_held_steer_of_the_canceled_root_turn() {
    let mut r = Rig::new(CodexConfig::default());
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":T1,"text":"hello"}));
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T1b","text":"also"}));
    assert!(
        r.requests("turn/steer").is_empty(),
        "held: no expectedTurnId yet"
    );
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    r.respond("turn/start", json!({"turn":{"id":N1}}));
    assert_eq!(r.requests("turn/interrupt").len(), 1);
    assert!(
        r.requests("turn/steer").is_empty(),
        "not steered into the canceled turn"
    );
    r.respond("turn/interrupt", json!({}));
    r.feed(turn_completed(ROOT_THREAD, N1, "interrupted", None));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Canceled));

    // The next root turn: its native turn becomes known, and nothing is steered into it.
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T2","text":"next"}));
    assert_eq!(r.requests("turn/start").len(), 2);
    r.respond("turn/start", json!({"turn":{"id":"native-2"}}));
    r.feed(turn_started(ROOT_THREAD, "native-2"));
    assert!(
        r.requests("turn/steer").is_empty(),
        "the canceled turn's held steer is never sent: {:?}",
        r.requests("turn/steer")
    );
    assert_eq!(r.phase(ROOT, "T2"), Phase::Running);
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn child_only_cancel_closes_exactly_that_child_turn() {
    let mut r = Rig::with_child("c1", "ct1");
    r.spawn(ROOT_THREAD, N1, "call-c2", "c2");
    r.feed(turn_started("c2", "ct2"));
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":child("c1"),"turnId":child_turn("c1", 1)}));
    let interrupts = r.requests("turn/interrupt");
    assert_eq!(interrupts.len(), 1);
    assert_eq!(
        interrupts[0]["params"],
        json!({"threadId":"c1","turnId":"ct1"})
    );
    assert!(
        !r.adapter().cancellation_boundary_active(),
        "the root is not canceled"
    );
    r.respond("turn/interrupt", json!({}));
    assert_eq!(
        r.outcome(&child("c1"), &child_turn("c1", 1)),
        Some(Outcome::Canceled)
    );
    // Late output of the closed child turn is dropped; the sibling and root go on.
    let out = r.feed(agent_message("c1", "ct1", "mx", "late"));
    assert!(out.events.is_empty());
    let out = r.feed(agent_message("c2", "ct2", "my", "sibling"));
    assert_eq!(kinds(&out), ["messageAppended"]);
    assert_eq!(r.phase(ROOT, T1), Phase::Running);
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

// ---- rule: a dropped interaction request is answered natively ---------------------------------

/// A server request with a `questions` list (`item/tool/requestUserInput`).
fn user_input_request(id: Value, thread: &str, turn: &str) -> Value {
    json!({"id":id,"method":"item/tool/requestUserInput","params":{"threadId":thread,"turnId":turn,
        "itemId":"call-q","questions":[{"id":"q1","header":"Pick","question":"Which?","options":null}]}})
}

/// The answer the adapter wrote to server request `id`, if any.
fn answer_to(r: &Rig, id: Value) -> Option<Value> {
    r.native
        .iter()
        .find(|n| n["id"] == id && n.get("method").is_none())
        .cloned()
}

#[test]
fn root_approval_after_the_canonical_root_settled_is_declined_natively_so_codex_never_waits() {
    let mut r = Rig::running();
    r.feed(turn_completed(ROOT_THREAD, N1, "completed", None));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Completed));
    // Codex runs another root turn on its own (no canonical turn owns it) and asks to approve.
    r.feed(turn_started(ROOT_THREAD, "native-2"));
    let out = r.feed(server_request(
        json!(9),
        "item/commandExecution/requestApproval",
        ROOT_THREAD,
        "native-2",
    ));
    // The adapter reported it on the settled canonical root turn; the engine did not take it.
    assert_eq!(kinds(&out), ["interactionRequested"]);
    assert_eq!(r.dropped.len(), 1);
    assert!(r.engine().pending_interactions(ROOT).is_empty());
    assert_eq!(
        answer_to(&r, json!(9)),
        Some(json!({"id": 9, "result": {"decision": "decline"}}))
    );
    // Exactly once: the same drop again, or codex's resolution of it, sends and emits nothing.
    let again = r.dropped[0].clone();
    let out = r.unit(|a, now| a.on_dropped(now, &again));
    assert!(out.native.is_empty() && out.events.is_empty());
    assert_eq!(out.diagnostics.len(), 1);
    let out = r.feed(resolved(ROOT_THREAD, json!(9)));
    assert!(out.events.is_empty(), "{:?}", out.events);
    // Nothing reopened the canonical root turn.
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Completed));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn late_requests_on_a_settled_child_turn_get_their_methods_refusal_or_an_error() {
    let mut r = Rig::with_child("c1", "ct1");
    r.feed(turn_completed("c1", "ct1", "completed", None));
    assert_eq!(
        r.outcome(&child("c1"), &child_turn("c1", 1)),
        Some(Outcome::Completed)
    );
    let cases = [
        (
            server_request(json!(20), "item/fileChange/requestApproval", "c1", "ct1"),
            json!({"decision": "decline"}),
        ),
        (
            user_input_request(json!(21), "c1", "ct1"),
            json!({"answers": {}}),
        ),
        (
            server_request(json!(22), "execCommandApproval", "c1", "ct1"),
            json!({"decision": "denied"}),
        ),
        (
            server_request(json!(23), "applyPatchApproval", "c1", "ct1"),
            json!({"decision": "denied"}),
        ),
        (
            server_request(json!(24), "item/permissions/requestApproval", "c1", "ct1"),
            json!({"permissions": {}}),
        ),
        (
            server_request(json!(25), "mcpServer/elicitation/request", "c1", "ct1"),
            json!({"action": "decline", "content": null}),
        ),
    ];
    for (req, result) in cases {
        let id = req["id"].clone();
        r.feed(req);
        assert_eq!(
            answer_to(&r, id.clone()),
            Some(json!({"id": id, "result": result}))
        );
    }
    // A method without a refusal shape: a JSON-RPC error.
    r.feed(server_request(json!("d-1"), "item/tool/call", "c1", "ct1"));
    let a = answer_to(&r, json!("d-1")).expect("answered");
    assert_eq!(a["error"]["code"], DROPPED_REQUEST);
    assert!(a.get("result").is_none());
    assert_eq!(r.dropped.len(), 7);
    assert!(r.engine().pending_interactions(ROOT).is_empty());
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

#[test]
fn on_dropped_answers_only_the_exact_unanswered_request_it_names() {
    let mut r = Rig::with_child("c1", "ct1");
    r.feed(server_request(
        json!(7),
        "item/commandExecution/requestApproval",
        "c1",
        "ct1",
    ));
    assert_eq!(r.engine().pending_interactions(ROOT).len(), 1);
    assert!(r.dropped.is_empty(), "the engine took it");
    let taken = r
        .events
        .iter()
        .rev()
        .find(|e| matches!(e, NormalizedEvent::InteractionRequested { .. }))
        .cloned()
        .unwrap();
    // Another owner (the root turn) with the same request id: not this request.
    let NormalizedEvent::InteractionRequested {
        request_id,
        provider_turn_id,
        kind,
        payload,
        ..
    } = taken.clone()
    else {
        unreachable!()
    };
    let foreign = NormalizedEvent::InteractionRequested {
        agent_session_id: ROOT.into(),
        turn_id: T1.into(),
        request_id: request_id.clone(),
        provider_turn_id,
        kind,
        payload,
    };
    let out = r.unit(|a, now| a.on_dropped(now, &foreign));
    assert!(out.native.is_empty(), "{:?}", out.native);
    // An unknown request id, and an event that is not an interaction: nothing.
    let NormalizedEvent::InteractionRequested {
        agent_session_id,
        turn_id,
        provider_turn_id,
        kind,
        payload,
        ..
    } = taken.clone()
    else {
        unreachable!()
    };
    let unknown = NormalizedEvent::InteractionRequested {
        agent_session_id,
        turn_id,
        request_id: "404".into(),
        provider_turn_id,
        kind,
        payload,
    };
    assert!(r
        .unit(|a, now| a.on_dropped(now, &unknown))
        .native
        .is_empty());
    let other = r.events[0].clone();
    assert!(!matches!(
        other,
        NormalizedEvent::InteractionRequested { .. }
    ));
    assert_eq!(
        r.unit(|a, now| a.on_dropped(now, &other)),
        AdapterOutput::default()
    );
    // Answered through the engine: a later drop notice for it sends nothing either.
    r.command(
        json!({"type":"respondInteraction","agentSessionId":child("c1"),
        "turnId":child_turn("c1", 1),"requestId":"7","response":"allow"}),
    );
    let sent = r.native.len();
    assert!(r.unit(|a, now| a.on_dropped(now, &taken)).native.is_empty());
    assert_eq!(r.native.len(), sent);
    assert_eq!(
        r.native.last(),
        Some(&json!({"id": 7, "result": {"decision": "accept"}}))
    );
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

// ---- garbage --------------------------------------------------------------------------------

#[test]
fn garbage_lines_give_adapter_error_and_change_nothing() {
    let mut r = Rig::with_child("c1", "ct1");
    for line in ["not json", "[1,2]", "\"text\"", "", "{\"id\": "] {
        assert!(parse_line(line).is_err(), "{line}");
    }
    let garbage = [
        json!([1, 2]),
        json!("string"),
        json!({}),
        json!({"method": 5}),
        json!({"method": "turn/started", "params": "x"}),
        json!({"method": "turn/started", "params": {"threadId": "c1"}}),
        json!({"method": "turn/started", "params": {"threadId": "c1", "turn": {"status": "inProgress"}}}),
        json!({"method": "turn/completed", "params": {"threadId": ROOT_THREAD, "turn": {"id": N1, "status": "weird"}}}),
        json!({"method": "turn/completed", "params": {"turn": {"id": N1, "status": "completed"}}}),
        json!({"method": "item/completed", "params": {"threadId": ROOT_THREAD, "item": {"id": "x"}}}),
        json!({"method": "item/completed", "params": {"threadId": ROOT_THREAD, "item": {"type": "agentMessage"}}}),
        json!({"method": "item/completed", "params": {"threadId": ROOT_THREAD, "item": {"type": "collabAgentToolCall", "id": "c", "tool": "spawnAgent", "receiverThreadIds": [1]}}}),
        json!({"method": "item/completed", "params": {"threadId": ROOT_THREAD, "item": {"type": "subAgentActivity", "id": "c", "kind": "started"}}}),
        json!({"method": "serverRequest/resolved", "params": {"threadId": "c1"}}),
        json!({"id": {"x": 1}, "method": "item/commandExecution/requestApproval", "params": {}}),
        json!({"id": 1}),
        json!({"result": {}}),
    ];
    let before = r.adapter().clone();
    let snapshot = r.engine().snapshot(ROOT);
    for g in &garbage {
        assert!(r.try_feed(g).is_err(), "accepted garbage {g}");
        assert_eq!(*r.adapter(), before, "garbage changed the adapter: {g}");
    }
    assert_eq!(r.engine().snapshot(ROOT), snapshot);
    // A response to a known request with a garbage result: error, the request still pending.
    let mut r = Rig::new(CodexConfig::default());
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":T1,"text":"hello"}));
    let id = r.requests("turn/start")[0]["id"].clone();
    let before = r.adapter().clone();
    assert!(r
        .try_feed(&json!({"id": id, "result": {"turn": {}}}))
        .is_err());
    assert_eq!(*r.adapter(), before);
    let out = r.feed(json!({"id": id, "result": {"turn": {"id": N1}}}));
    assert!(out.diagnostics.is_empty(), "{:?}", out.diagnostics);
}

#[test]
/// Notifications the adapter does not use (Codex sends many, such as token usage) are dropped
/// without a diagnostic; a response to no request of ours and an unknown timer are dropped with
/// one diagnostic each.
fn unknown_methods_are_dropped_silently_unknown_response_ids_and_timers_with_a_diagnostic() {
    let mut r = Rig::running();
    let out =
        r.feed(json!({"method":"thread/tokenUsage/updated","params":{"threadId":ROOT_THREAD}}));
    assert!(out.events.is_empty() && out.native.is_empty());
    assert!(out.diagnostics.is_empty(), "{:?}", out.diagnostics);
    let out = r.feed(json!({"method":"brand/new","params":{}}));
    assert!(out.events.is_empty() && out.native.is_empty());
    assert!(out.diagnostics.is_empty(), "{:?}", out.diagnostics);
    let out = r.feed(json!({"id": 999, "result": {}}));
    assert!(out.events.is_empty());
    assert_eq!(out.diagnostics.len(), 1);
    let out = r.unit(|a, _now| a.on_timer(5, "nonsense"));
    assert_eq!(out.diagnostics.len(), 1);
}

// ---- golden tests from captured transcripts ---------------------------------------------------

fn transcript(name: &str) -> String {
    let path = format!(
        "{}/tests/data/codex/{name}.wire.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The transcript's root and child threads (from its own `<<` lines).
fn threads(text: &str) -> (String, Vec<String>) {
    let mut root = String::new();
    let mut children = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("<< ") else {
            continue;
        };
        let v: Value = serde_json::from_str(rest).unwrap();
        if root.is_empty() {
            if let Some(t) = v.pointer("/result/thread/id").and_then(Value::as_str) {
                root = t.to_string();
            }
        }
        for r in v
            .pointer("/params/item/receiverThreadIds")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .chain(v.pointer("/params/item/agentThreadId"))
        {
            let r = r.as_str().unwrap().to_string();
            let spawn = v["params"]["item"]["tool"] == "spawnAgent"
                || v["params"]["item"]["kind"] == "started";
            if spawn && !children.contains(&r) {
                children.push(r);
            }
        }
    }
    (root, children)
}

/// Replays line by line, checking the invariants after every line; returns the replay and, per
/// line, the phases of the root turn and of the first child turn.
/// Per transcript line: the line, the root turn's phase, the first child turn's phase.
type Trace = Vec<(String, Phase, Option<Phase>)>;

fn step_through(name: &str, mirror: bool) -> (CodexReplay, Trace, String) {
    let text = transcript(name);
    let (_, children) = threads(&text);
    let first_child = children.first().map(|c| replay_child(c));
    let mut r = CodexReplay::new(ReplayOptions {
        mirror_client: mirror,
    });
    let mut trace = Vec::new();
    for line in text.lines() {
        r.line(line);
        let v = r.engine().check_invariants();
        assert!(v.is_empty(), "{name}: invariants after {line}: {v:?}");
        let root = r
            .engine()
            .turn("root", "turn-1")
            .expect("root turn")
            .phase();
        let child = first_child
            .as_ref()
            .and_then(|(s, t)| r.engine().turn(s, t).map(|t| t.phase()));
        trace.push((line.chars().take(120).collect(), root, child));
    }
    assert!(
        r.output().violations.is_empty(),
        "{:?}",
        r.output().violations
    );
    let rejected: Vec<&String> = r
        .output()
        .diagnostics
        .iter()
        .filter(|d| d.contains("engine rejected") || d.contains("adapter error"))
        .collect();
    assert!(rejected.is_empty(), "{name}: {rejected:?}");
    (r, trace, text)
}

#[test]
fn golden_spawn1_v1_child_has_parent_and_root_relation_and_root_settles_after_provider_and_child_terminals(
) {
    let (r, trace, text) = step_through("spawn1", false);
    let (root_thread, children) = threads(&text);
    assert_eq!(children.len(), 1);
    let (c, ct) = replay_child(&children[0]);
    let e = r.engine();
    assert_eq!(
        e.session("root").unwrap().provider_session_id.as_deref(),
        Some(root_thread.as_str())
    );
    let s = e.session(&c).expect("child session");
    assert_eq!(s.parent_agent_session_id().map(|x| &**x), Some("root"));
    assert_eq!(s.parent_turn_id().map(|x| &**x), Some("turn-1"));
    assert_eq!(s.parent_tool_call_id().map(|x| &**x), Some("call-1"));
    assert_eq!(s.root_agent_session_id().map(|x| &**x), Some("root"));
    assert_eq!(s.root_turn_id().map(|x| &**x), Some("turn-1"));
    let child_turn = e.turn(&c, &ct).unwrap();
    assert_eq!(child_turn.outcome(), Some(Outcome::Completed));
    assert!(child_turn.provider_turn_id().is_some());
    assert_eq!(&*e.tool_call("root", "call-1").unwrap().status, "completed");
    assert_eq!(
        e.turn("root", "turn-1").unwrap().outcome(),
        Some(Outcome::Completed)
    );
    // Order: the child settles first while the root stays active; the root settles only on the
    // line of its own provider turn/completed, after both terminals.
    let child_done = trace
        .iter()
        .position(|(_, _, c)| *c == Some(Phase::Settled))
        .expect("child settles");
    let root_done = trace
        .iter()
        .position(|(_, p, _)| *p == Phase::Settled)
        .expect("root settles");
    assert!(child_done < root_done);
    assert_ne!(trace[child_done].1, Phase::Settled);
    assert!(
        trace[root_done].0.contains("turn/completed") && trace[root_done].0.contains(&root_thread)
    );
    // The child's early markers never touched the root.
    let created = trace.iter().position(|(_, _, c)| c.is_some()).unwrap();
    assert!(trace[..created]
        .iter()
        .all(|(_, p, _)| *p != Phase::Settled));
}

#[test]
fn golden_v2spawn_sub_agent_activity_creates_the_child_and_the_root_settles_completed() {
    let (r, _, text) = step_through("v2spawn", false);
    let (_, children) = threads(&text);
    let (c, ct) = replay_child(&children[0]);
    let e = r.engine();
    let s = e.session(&c).expect("child session");
    assert_eq!(s.parent_tool_call_id().map(|x| &**x), Some("call-1"));
    assert_eq!(s.root_turn_id().map(|x| &**x), Some("turn-1"));
    assert_eq!(s.title.as_deref(), Some("helper_one"));
    let call = e.tool_call("root", "call-1").unwrap();
    assert_eq!(&*call.status, "completed");
    assert_eq!(call.name.as_deref(), Some("spawnAgent"));
    assert_eq!(e.turn(&c, &ct).unwrap().outcome(), Some(Outcome::Completed));
    assert_eq!(
        e.turn("root", "turn-1").unwrap().outcome(),
        Some(Outcome::Completed)
    );
    let out = r.finish();
    assert_eq!(
        out.events
            .iter()
            .filter(|e| e.kind() == "childSessionCreated")
            .count(),
        1,
        "the repeated started item is idempotent"
    );
}

#[test]
fn golden_childexec_child_approval_is_owned_by_the_child_and_answered_with_the_original_request_id()
{
    let text = transcript("childexec");
    let (_, children) = threads(&text);
    let (c, ct) = replay_child(&children[0]);
    let mut r = CodexReplay::new(ReplayOptions {
        mirror_client: false,
    });
    let mut seen = false;
    for line in text.lines() {
        // Answer the approval through the engine the moment it is pending.
        r.line(line);
        assert!(r.engine().check_invariants().is_empty());
        if seen {
            continue;
        }
        let pending = r.engine().pending_interactions("root");
        if let Some(i) = pending.first() {
            seen = true;
            assert_eq!(*i.agent_session_id, *c, "owned by the child session");
            assert_eq!(*i.turn_id, *ct, "owned by the child turn");
            assert_eq!(&*i.request_id, "0");
            let native_turn = r
                .engine()
                .turn(&c, &ct)
                .unwrap()
                .provider_turn_id()
                .map(str::to_string);
            assert_eq!(
                i.provider_turn_id, native_turn,
                "the native turn id is kept"
            );
            assert_eq!(i.kind, json!("item/commandExecution/requestApproval"));
            assert_eq!(
                r.engine().turn("root", "turn-1").unwrap().phase(),
                Phase::Running
            );
        }
    }
    assert!(seen, "the approval was requested");
    // The same transcript with the client's own answer mirrored through the engine.
    let out = replay_transcript_with(
        &text,
        ReplayOptions {
            mirror_client: true,
        },
    )
    .unwrap();
    assert!(out.violations.is_empty(), "{:?}", out.violations);
    assert!(
        out.native
            .contains(&json!({"id": 0, "result": {"decision": "accept"}})),
        "{:?}",
        out.native
    );
    let i = out
        .snapshot
        .interactions
        .iter()
        .find(|i| &*i.request_id == "0")
        .unwrap();
    assert_eq!(*i.agent_session_id, *c);
    assert_eq!(*i.turn_id, *ct);
    assert_eq!(i.response, Some(json!({"decision": "accept"})));
    assert_eq!(
        serde_json::to_value(i.status).unwrap(),
        json!("resolved"),
        "serverRequest/resolved reached it through the child"
    );
    let root = out
        .snapshot
        .turns
        .iter()
        .find(|t| &*t.id == "turn-1")
        .unwrap();
    assert_eq!(root.outcome(), Some(Outcome::Completed));
}

#[test]
fn golden_interrupt_cancel_settles_the_root_canceled() {
    let (r, _, _) = step_through("interrupt", true);
    let e = r.engine();
    let t = e.turn("root", "turn-1").unwrap();
    assert_eq!(t.outcome(), Some(Outcome::Canceled));
    assert_eq!(t.error(), None);
    assert_eq!(
        t.root_provider_turn().map(|p| p.phase()),
        Some(ProviderPhase::Completed),
        "the provider lifecycle closed"
    );
    let out = r.finish();
    assert_eq!(
        out.answers,
        vec![RuntimeAnswer::CancelResult {
            operation_id: "replay-cancel-1".into(),
            acked: vec![target("root", "turn-1")],
        }]
    );
    // The mirrored steer went out with the running native turn as expectedTurnId.
    let steer = out
        .native
        .iter()
        .find(|n| n["method"] == "turn/steer")
        .unwrap();
    assert!(steer["params"]["expectedTurnId"].is_string());
    // Without the client's actions the provider's own terminal decides: interrupted.
    let out = replay_transcript(&transcript("interrupt")).unwrap();
    let t = out
        .snapshot
        .turns
        .iter()
        .find(|t| &*t.id == "turn-1")
        .unwrap();
    assert_eq!(t.outcome(), Some(Outcome::Interrupted));
}

#[test]
fn golden_fail_root_failed_with_the_provider_error() {
    let (r, _, _) = step_through("fail", false);
    let t = r.engine().turn("root", "turn-1").unwrap();
    assert_eq!(t.outcome(), Some(Outcome::Failed));
    assert!(t.error().is_some_and(|e| e.contains("mock bad request")));
}

#[test]
fn golden_every_captured_transcript_replays_without_violations_or_rejections() {
    for name in [
        "spawn1",
        "spawn2",
        "v2spawn",
        "childexec",
        "interrupt",
        "fail",
        "exec2",
        "ask2",
        "simple",
    ] {
        for mirror in [false, true] {
            let out = replay_transcript_with(
                &transcript(name),
                ReplayOptions {
                    mirror_client: mirror,
                },
            )
            .unwrap();
            assert!(out.violations.is_empty(), "{name}: {:?}", out.violations);
            assert!(
                !out.diagnostics
                    .iter()
                    .any(|d| d.contains("engine rejected") || d.contains("adapter error")),
                "{name}: {:?}",
                out.diagnostics
            );
            let root = out
                .snapshot
                .turns
                .iter()
                .find(|t| &*t.id == "turn-1")
                .unwrap();
            assert_eq!(root.phase(), Phase::Settled, "{name}");
            // The CLI prints this as JSON.
            let json = serde_json::to_value(&out).unwrap();
            assert!(json["events"].is_array() && json["snapshot"]["sessions"].is_array());
        }
    }
}

#[test]
fn replay_reports_garbage_in_diagnostics_and_changes_nothing() {
    let text = transcript("simple");
    let clean = replay_transcript(&text).unwrap();
    let mut noisy = String::new();
    for line in text.lines() {
        noisy.push_str(line);
        noisy.push('\n');
        noisy.push_str("<< this is not json\n<< {\"method\": 7}\n>> {broken\n");
    }
    let out = replay_transcript(&noisy).unwrap();
    assert_eq!(out.events, clean.events);
    assert_eq!(out.snapshot, clean.snapshot);
    assert!(out.diagnostics.iter().any(|d| d.contains("adapter error")));
    assert!(
        replay_transcript(">> {\"id\":1}\n").is_err(),
        "nothing received"
    );
}

// ---- rule: root provider facts belong to the provider turn they name (issue 18) ------------

/// "Root provider facts belong to the provider turn they name": the interrupted root turn's
/// `turn/completed` arrives after `turn/start` of the next canonical turn. It is normalized
/// under its own canonical turn, recorded on it (provider phase completed, canceled outcome
/// kept), and never settles the next one; a repeat of it changes nothing.
#[test]
fn interrupted_turn_completed_after_the_next_turn_start_settles_only_its_own_turn() {
    let mut r = Rig::running();
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    r.respond("turn/interrupt", json!({}));
    assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Canceled));
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T2","text":"again"}));
    r.respond("turn/start", json!({"turn":{"id":"native-2"}}));
    r.feed(turn_started(ROOT_THREAD, "native-2"));
    assert_eq!(r.phase(ROOT, "T2"), Phase::Running);
    for _ in 0..2 {
        let out = r.feed(turn_completed(
            ROOT_THREAD,
            N1,
            "interrupted",
            Some("interrupted"),
        ));
        match &out.events[..] {
            [NormalizedEvent::RootProviderTurnCompleted {
                turn_id,
                provider_turn_id,
                ..
            }] => {
                assert_eq!(turn_id.as_deref(), Some(T1));
                assert_eq!(provider_turn_id.as_deref(), Some(N1));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(r.phase(ROOT, "T2"), Phase::Running, "T2 is untouched");
        let t2 = r.engine().turn(ROOT, "T2").expect("T2").clone();
        let rpt = t2.root_provider_turn().cloned().unwrap_or_default();
        assert_eq!(rpt.phase(), ProviderPhase::Running);
        assert_eq!(rpt.provider_turn_id.as_deref(), Some("native-2"));
        assert_eq!(
            r.root_provider(),
            (ProviderPhase::Completed, Some(N1.into()))
        );
        assert_eq!(r.outcome(ROOT, T1), Some(Outcome::Canceled));
    }
    r.feed(turn_completed(ROOT_THREAD, "native-2", "completed", None));
    assert_eq!(r.outcome(ROOT, "T2"), Some(Outcome::Completed));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

/// A root turn canceled before its `turn/start` answered: the answer and the native turn's
/// `turn/started` arrive only after the next canonical turn started. That native turn is the
/// canceled turn's (its `turn/start` named it): reported under it and interrupted, never
/// adopted by the newer turn, whose own native turn settles it.
#[test]
fn late_start_of_a_canceled_turns_native_turn_is_not_adopted_by_the_next_turn() {
    let mut r = Rig::new(CodexConfig::default());
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":T1,"text":"hello"}));
    r.command(json!({"type":"cancelTurn","operationId":"op1","agentSessionId":ROOT,"turnId":T1}));
    let timer = r.timers.last().cloned().expect("cancel timer");
    r.timer(&timer.id);
    assert_eq!(r.phase(ROOT, T1), Phase::Settled);
    r.command(json!({"type":"submit","agentSessionId":ROOT,"turnId":"T2","text":"again"}));
    // T1's turn/start answers now, then T2's.
    r.respond("turn/start", json!({"turn":{"id":N1}}));
    r.respond("turn/start", json!({"turn":{"id":"native-2"}}));
    let interrupts = r.requests("turn/interrupt").len();
    let out = r.feed(turn_started(ROOT_THREAD, N1));
    match &out.events[..] {
        [NormalizedEvent::RootProviderTurnStarted {
            turn_id,
            provider_turn_id,
            ..
        }] => {
            assert_eq!(turn_id.as_deref(), Some(T1));
            assert_eq!(provider_turn_id.as_deref(), Some(N1));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        r.requests("turn/interrupt").len(),
        interrupts + 1,
        "the canceled turn's native turn is interrupted"
    );
    let t2 = r.engine().turn(ROOT, "T2").expect("T2").clone();
    assert_eq!(
        t2.root_provider_turn()
            .cloned()
            .unwrap_or_default()
            .provider_turn_id,
        None,
        "T2 did not adopt it"
    );
    r.feed(turn_started(ROOT_THREAD, "native-2"));
    let out = r.feed(turn_completed(ROOT_THREAD, N1, "interrupted", None));
    assert!(out.events.iter().all(|e| match e {
        NormalizedEvent::RootProviderTurnCompleted { turn_id, .. } =>
            turn_id.as_deref() == Some(T1),
        _ => true,
    }));
    assert_eq!(r.phase(ROOT, "T2"), Phase::Running);
    r.feed(turn_completed(ROOT_THREAD, "native-2", "completed", None));
    assert_eq!(r.outcome(ROOT, "T2"), Some(Outcome::Completed));
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
}

/// Issue 32, "token usage where the provider reports it": each thread's last
/// `thread/tokenUsage/updated` of the captured transcript becomes its session's `usage` (root
/// and child threads alike), with the cumulative total, the last request's tokens and the
/// context window.
#[test]
fn golden_each_threads_token_usage_is_its_sessions_usage() {
    let text = transcript("spawn2");
    let mut last: std::collections::BTreeMap<String, Value> = Default::default();
    for line in text.lines() {
        let Some(json) = line.strip_prefix("<< ") else {
            continue;
        };
        let Ok(msg) = serde_json::from_str::<Value>(json) else {
            continue;
        };
        if msg["method"] == "thread/tokenUsage/updated" {
            let thread = msg["params"]["threadId"].as_str().unwrap().to_string();
            last.insert(thread, msg["params"]["tokenUsage"].clone());
        }
    }
    assert!(last.len() >= 2, "the capture has root and child usage");
    let out = replay_transcript(&text).unwrap();
    for (thread, usage) in &last {
        let session = out
            .snapshot
            .sessions
            .iter()
            .find(|s| s.provider_session_id.as_deref() == Some(thread.as_str()))
            .unwrap_or_else(|| panic!("a session for thread {thread}"));
        let got = session.usage.as_ref().expect("usage recorded");
        assert_eq!(got.total_tokens, usage["total"]["totalTokens"].as_u64());
        assert_eq!(got.context_tokens, usage["last"]["totalTokens"].as_u64());
        assert_eq!(got.context_window, usage["modelContextWindow"].as_u64());
        assert_eq!(got.cost, None);
    }
}

/// A `thread/tokenUsage/updated` without counts records nothing, one with garbage counts keeps
/// only what is a count, and a later report keeps what it does not carry.
#[test]
fn token_usage_with_garbage_counts_records_only_the_counts() {
    let mut r = Rig::running();
    let out = r.feed(json!({"method":"thread/tokenUsage/updated","params":{"threadId":ROOT_THREAD,"tokenUsage":{"total":{"totalTokens":-3},"last":"x"}}}));
    assert!(out.events.is_empty(), "{:?}", out.events);
    assert_eq!(r.engine().session(ROOT).unwrap().usage, None);
    r.feed(json!({"method":"thread/tokenUsage/updated","params":{"threadId":ROOT_THREAD,"tokenUsage":{"total":{"totalTokens":9},"modelContextWindow":"big"}}}));
    let u = r.engine().session(ROOT).unwrap().usage.clone().unwrap();
    assert_eq!((u.total_tokens, u.context_window), (Some(9), None));
    r.feed(json!({"method":"thread/tokenUsage/updated","params":{"threadId":ROOT_THREAD,"tokenUsage":{"last":{"totalTokens":4},"modelContextWindow":100}}}));
    let u = r.engine().session(ROOT).unwrap().usage.clone().unwrap();
    assert_eq!(
        (u.total_tokens, u.context_tokens, u.context_window),
        (Some(9), Some(4), Some(100))
    );
    let turn = r.engine().session(ROOT).unwrap().active_turn_id.clone();
    assert_eq!(turn.as_deref(), Some(T1), "usage never settles the root");
}
