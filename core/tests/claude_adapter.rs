//! The Claude adapter (`tutti_core::adapters::claude`): one test per rule of the spec's "Claude
//! Code SDK Mapping" and "Cancellation" sections, plus golden tests that drive the engine with the
//! adapter's output for the captured SDK transcripts in `tests/data/claude/` (copied from the
//! shared captures; never read from `../shared` at run time).
//!
//! Every engine step is followed by `engine.check_invariants()`; an engine rejection of an adapter
//! event fails the test unless the test expects it.

use serde_json::{json, Value};
use std::any::Any;
use tutti_core::adapters::claude::{sidecar_line, ClaudeAdapter, ClaudeConfig};
use tutti_core::adapters::{child_ids, Adapter, AdapterError, AdapterOutput, AdapterTimer};
use tutti_core::driver::{DriverError, DriverInput, Output, Record, Testkit};
use tutti_core::invariants::check_tree;
use tutti_core::model::{Id, InteractionStatus, Outcome, Phase, ProviderPhase, Turn};
use tutti_core::replay::claude::replay_transcript;
use tutti_core::store::MemoryStore;
use tutti_core::{Driver, Engine, Input, NormalizedEvent, ProviderRequest, RuntimeAnswer, Step};

const R: &str = "R";
const T1: &str = "turn-1";

// ----- harness ---------------------------------------------------------------------------------

/// A [`Driver`] host (a `MemoryStore`, the clock) with the real adapter, and everything that
/// passed between the adapter and the engine (from the driver's records). The driver does the
/// daemon's wiring: engine requests to the adapter, events before answers, an
/// `interactionRequested` the engine did not take (rejected or ignored) back to `on_dropped`.
/// The driver's replies to host inputs (token, committed step or why not).
type Replies = Vec<(u64, Result<Step, DriverError>)>;

struct Rig {
    d: Driver,
    store: MemoryStore,
    now: i64,
    native: Vec<Value>,
    events: Vec<NormalizedEvent>,
    answers: Vec<RuntimeAnswer>,
    timers: Vec<AdapterTimer>,
    rejections: Vec<String>,
    /// `interactionRequested` events the engine did not take (given to `on_dropped`).
    dropped: Vec<NormalizedEvent>,
    /// Every input the engine took but ignored (kind and reason), e.g. a message on a settled
    /// turn.
    ignored: Vec<String>,
    /// Every adapter diagnostic.
    diagnostics: Vec<String>,
    uuid: u64,
}

impl Rig {
    fn new() -> Rig {
        Rig::with(ClaudeConfig::default())
    }

    fn with(config: ClaudeConfig) -> Rig {
        let mut d = Driver::new();
        d.set_recording(true);
        let mut rig = Rig {
            d,
            store: MemoryStore::new(),
            now: 1_000,
            native: Vec::new(),
            events: Vec::new(),
            answers: Vec::new(),
            timers: Vec::new(),
            rejections: Vec::new(),
            dropped: Vec::new(),
            ignored: Vec::new(),
            diagnostics: Vec::new(),
            uuid: 0,
        };
        rig.cmd(json!({"type":"createSession","agentSessionId":R,"workspaceId":"W","provider":"claude"}));
        let adapter = ClaudeAdapter::new(R.into(), config);
        let _ = rig.d.handle(
            DriverInput::Attach {
                now: rig.now,
                root: R.into(),
                adapter: Box::new(adapter),
            },
            &rig.store,
        );
        rig.settle();
        rig
    }

    fn engine(&self) -> &Engine {
        self.d.engine()
    }

    /// The adapter (reads).
    fn adapter(&self) -> &ClaudeAdapter {
        let a: &dyn Any = self.d.adapter(R).expect("the root's adapter is live");
        a.downcast_ref().expect("a ClaudeAdapter")
    }

    /// An adapter unit check: one call on the adapter itself, its output looked at in isolation
    /// (not carried out).
    fn unit<T>(&mut self, f: impl FnOnce(&mut ClaudeAdapter, i64) -> T) -> T {
        let now = self.now;
        let a: &mut dyn Any = self.d.adapter_mut(R).expect("the root's adapter is live");
        f(a.downcast_mut().expect("a ClaudeAdapter"), now)
    }

    /// A call outside the `Adapter` trait (`set_goal`, ...) through the driver, which carries
    /// its output out; returns that output.
    fn call(&mut self, f: impl FnOnce(&mut ClaudeAdapter, i64) -> AdapterOutput) -> AdapterOutput {
        self.d
            .handle(
                DriverInput::Call {
                    now: self.now,
                    root: R,
                    call: Box::new(|a, now| {
                        let a: &mut dyn Any = a;
                        f(a.downcast_mut().expect("a ClaudeAdapter"), now)
                    }),
                },
                &self.store,
            )
            .expect("the root's adapter is live");
        self.settle().0.into_iter().next().unwrap_or_default()
    }

    /// Commits what the driver decided, checks the invariants, notes the records; returns the
    /// adapter outputs in order and the replies.
    fn settle(&mut self) -> (Vec<AdapterOutput>, Replies) {
        let mut replies = Vec::new();
        for o in self.d.commit_pending(&mut self.store) {
            if let Output::Reply { to, result } = o {
                replies.push((to, result));
            }
        }
        let v = self.engine().check_invariants();
        assert!(v.is_empty(), "invariants: {v:?}");
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
                Record::Decided { input, outcome } => match outcome {
                    Ok(None) => {}
                    Ok(Some(why)) => self.ignored.push(format!("{}: {why:?}", input.kind())),
                    Err(e) => self.rejections.push(format!("{}: {e}", input.kind())),
                },
                Record::Dropped { event, .. } => self.dropped.push(event),
            }
        }
        (outs, replies)
    }

    /// One host input through the driver; its committed step, or `None` if rejected.
    fn input(&mut self, input: Input) -> Option<Step> {
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

    fn cmd(&mut self, v: Value) -> Step {
        let input: Input = serde_json::from_value(v.clone()).expect("a valid command");
        self.input(input)
            .unwrap_or_else(|| panic!("command rejected: {v} {:?}", self.rejections))
    }

    /// One sidecar line through the driver; the adapter's output for it, or its typed error.
    fn try_line(&mut self, v: &Value) -> Result<AdapterOutput, AdapterError> {
        self.now += 1;
        match self.d.handle(
            DriverInput::Native {
                now: self.now,
                root: R,
                message: v,
            },
            &self.store,
        ) {
            Ok(()) => {}
            Err(DriverError::Adapter(e)) => return Err(e),
            Err(e) => panic!("driver refused {v}: {e}"),
        }
        Ok(self.settle().0.into_iter().next().unwrap_or_default())
    }

    /// One sidecar line; returns what the adapter produced for it.
    fn line(&mut self, v: Value) -> AdapterOutput {
        self.try_line(&v)
            .unwrap_or_else(|e| panic!("line refused: {e}: {v}"))
    }

    fn msg(&mut self, m: Value) -> AdapterOutput {
        self.line(json!({"kind": "message", "message": m}))
    }

    /// Fires one adapter timer through the driver at `at` (or now, if later).
    fn timer(&mut self, id: &str, at: i64) -> AdapterOutput {
        self.now = self.now.max(at);
        self.call(|a, now| a.on_timer(now, id))
    }

    fn submit(&mut self, turn: &str) -> Step {
        self.cmd(json!({"type":"submit","agentSessionId":R,"turnId":turn,"text":"do it"}))
    }

    /// The last native command with this `op`.
    fn last_native(&self, op: &str) -> Value {
        self.native
            .iter()
            .rev()
            .find(|c| c["op"] == op)
            .cloned()
            .unwrap_or_else(|| panic!("no {op} command in {:?}", self.native))
    }

    /// Acknowledges the last native command with this `op`.
    fn ack(&mut self, op: &str, ok: bool) -> AdapterOutput {
        let cmd = self.last_native(op);
        let mut a = json!({"kind":"ack","op":op,"ok":ok,"id":cmd["id"]});
        if !ok {
            a["error"] = json!("refused");
        }
        self.line(a)
    }

    /// Submits turn-1, acknowledges `start`, and feeds `init`.
    fn started(&mut self) {
        self.submit(T1);
        self.ack("start", true);
        self.msg(init());
    }

    fn turn(&self, session: &str, turn: &str) -> Turn {
        self.engine()
            .turn(session, turn)
            .unwrap_or_else(|| panic!("no turn {turn}"))
            .clone()
    }

    fn root(&self) -> Turn {
        self.turn(R, T1)
    }

    fn next_uuid(&mut self) -> String {
        self.uuid += 1;
        format!("u-{}", self.uuid)
    }

    fn assert_clean(&self) {
        assert!(
            self.rejections.is_empty(),
            "engine rejections: {:?}",
            self.rejections
        );
        let v = self.engine().check_invariants();
        assert!(v.is_empty(), "{v:?}");
    }
}

fn child(tool_use: &str) -> (String, String) {
    let (s, t) = child_ids(&Id::from(R), "task", tool_use, 1);
    (s.to_string(), t.to_string())
}

fn count(events: &[NormalizedEvent], kind: &str) -> usize {
    events.iter().filter(|e| e.kind() == kind).count()
}

fn position(events: &[NormalizedEvent], pred: impl Fn(&NormalizedEvent) -> bool) -> usize {
    events
        .iter()
        .position(pred)
        .unwrap_or_else(|| panic!("event not found in {events:?}"))
}

// ----- SDK message builders --------------------------------------------------------------------

fn init() -> Value {
    json!({"type":"system","subtype":"init","session_id":"sdk-session","uuid":"init"})
}

fn ptu(v: &mut Value, parent: Option<&str>) {
    v["parent_tool_use_id"] = match parent {
        Some(p) => json!(p),
        None => Value::Null,
    };
}

impl Rig {
    fn text(&mut self, parent: Option<&str>, text: &str) -> AdapterOutput {
        let mut m = json!({"type":"assistant","uuid":self.next_uuid(),
            "message":{"role":"assistant","content":[{"type":"text","text":text}]}});
        ptu(&mut m, parent);
        self.msg(m)
    }

    fn tool_use(
        &mut self,
        parent: Option<&str>,
        id: &str,
        name: &str,
        input: Value,
    ) -> AdapterOutput {
        let mut m = json!({"type":"assistant","uuid":self.next_uuid(),
            "message":{"role":"assistant","content":[{"type":"tool_use","id":id,"name":name,"input":input}]}});
        ptu(&mut m, parent);
        self.msg(m)
    }

    fn agent(&mut self, parent: Option<&str>, id: &str, background: bool) -> AdapterOutput {
        self.tool_use(
            parent,
            id,
            "Agent",
            json!({"description":format!("job {id}"),"prompt":"work","run_in_background":background}),
        )
    }

    fn tool_result(
        &mut self,
        parent: Option<&str>,
        id: &str,
        is_error: bool,
        meta: Value,
    ) -> AdapterOutput {
        let mut m = json!({"type":"user","uuid":self.next_uuid(),
            "message":{"role":"user","content":[{"type":"tool_result","tool_use_id":id,"is_error":is_error,"content":"done"}]},
            "tool_use_result": meta});
        ptu(&mut m, parent);
        self.msg(m)
    }

    fn task_started(&mut self, task: &str, tool_use: &str, background: bool) -> AdapterOutput {
        let uuid = self.next_uuid();
        self.msg(json!({"type":"system","subtype":"task_started","task_id":task,"tool_use_id":tool_use,
            "description":format!("job {tool_use}"),"is_backgrounded":background,"task_type":"local_agent",
            "subagent_type":"general-purpose","run_id":format!("run-{task}"),"uuid":uuid}))
    }

    fn notification(&mut self, task: &str, tool_use: &str, status: &str) -> AdapterOutput {
        let uuid = self.next_uuid();
        self.msg(json!({"type":"system","subtype":"task_notification","task_id":task,"tool_use_id":tool_use,
            "status":status,"summary":"s","output_file":"/tmp/x","uuid":uuid}))
    }

    fn result(&mut self) -> AdapterOutput {
        let uuid = self.next_uuid();
        self.msg(
            json!({"type":"result","subtype":"success","is_error":false,"result":"ok","uuid":uuid}),
        )
    }

    fn result_with_origin(&mut self) -> AdapterOutput {
        let uuid = self.next_uuid();
        self.msg(
            json!({"type":"result","subtype":"success","is_error":false,"result":"ok",
            "origin":{"kind":"task-notification"},"uuid":uuid}),
        )
    }

    /// A background child launched by the root: tool use, task_started, async tool result.
    fn background_child(&mut self, tool_use: &str, task: &str) {
        self.agent(None, tool_use, true);
        self.task_started(task, tool_use, true);
        self.tool_result(
            None,
            tool_use,
            false,
            json!({"isAsync":true,"status":"async_launched","agentId":task}),
        );
    }

    /// Root turn-1 with one background child whose root provider turn already completed.
    fn waiting_on_background_child(&mut self) -> (String, String) {
        self.started();
        self.background_child("tu-1", "task-1");
        self.text(None, "launched");
        self.result();
        assert_eq!(self.root().phase(), Phase::Waiting);
        child("tu-1")
    }
}

fn transcript(name: &str) -> Vec<Value> {
    let text = match name {
        "fg_fwd" => include_str!("data/claude/fg_fwd.jsonl"),
        "fg_partial" => include_str!("data/claude/fg_partial.jsonl"),
        "fg_childtool" => include_str!("data/claude/fg_childtool.jsonl"),
        "bg_oneshot" => include_str!("data/claude/bg_oneshot.jsonl"),
        "bg_stream_stop" => include_str!("data/claude/bg_stream_stop.jsonl"),
        "bg_stream_interrupt" => include_str!("data/claude/bg_stream_interrupt.jsonl"),
        other => panic!("unknown transcript {other}"),
    };
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| {
            let v: Value = serde_json::from_str(l).expect("captured line is JSON");
            sidecar_line(&v, n + 1).expect("a captured Claude row")
        })
        .collect()
}

fn raw_transcript(name: &str) -> &'static str {
    match name {
        "bg_two_together" => include_str!("data/claude/bg_two_together.jsonl"),
        "bg_two_together_empty" => include_str!("data/claude/bg_two_together_empty.jsonl"),
        "bg_two_together_guided" => include_str!("data/claude/bg_two_together_guided.jsonl"),
        "bg_two_together_guided_empty" => {
            include_str!("data/claude/bg_two_together_guided_empty.jsonl")
        }
        "bg_two_during_guidance" => include_str!("data/claude/bg_two_during_guidance.jsonl"),
        "bg_two_during_tool_round" => include_str!("data/claude/bg_two_during_tool_round.jsonl"),
        "fg_fwd" => include_str!("data/claude/fg_fwd.jsonl"),
        "fg_partial" => include_str!("data/claude/fg_partial.jsonl"),
        "fg_childtool" => include_str!("data/claude/fg_childtool.jsonl"),
        "bg_oneshot" => include_str!("data/claude/bg_oneshot.jsonl"),
        "bg_stream_stop" => include_str!("data/claude/bg_stream_stop.jsonl"),
        "bg_stream_interrupt" => include_str!("data/claude/bg_stream_interrupt.jsonl"),
        other => panic!("unknown transcript {other}"),
    }
}

/// The Agent tool-use id of a captured transcript (its first `Agent` block at the root).
fn agent_tool_use(lines: &[Value]) -> String {
    lines
        .iter()
        .filter(|l| l["kind"] == "message" && l["message"]["type"] == "assistant")
        .flat_map(|l| {
            l["message"]["message"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .find(|b| b["type"] == "tool_use" && b["name"] == "Agent")
        .and_then(|b| b["id"].as_str().map(String::from))
        .expect("an Agent tool use")
}

fn task_id(lines: &[Value]) -> String {
    lines
        .iter()
        .find(|l| l["message"]["subtype"] == "task_started")
        .and_then(|l| l["message"]["task_id"].as_str().map(String::from))
        .expect("a task_started")
}

// ===== rule tests ================================================================================

#[test]
fn agent_tool_use_creates_child_and_submitted_turn_before_task_started_or_root_result() {
    let mut rig = Rig::new();
    rig.started();
    let out = rig.agent(None, "tu-1", false);
    let (cs, ct) = child("tu-1");
    // Written out, not derived with `child_ids`: a change in the id derivation fails here.
    assert_eq!(
        (cs.as_str(), ct.as_str()),
        ("R~task-tu-1", "R~task-tu-1~turn-1")
    );
    assert_eq!(count(&out.events, "childSessionCreated"), 1);
    let s = rig
        .engine()
        .session(&cs)
        .expect("child session exists")
        .clone();
    assert!(s.is_child());
    assert_eq!(s.parent_agent_session_id().map(|x| &**x), Some(R));
    assert_eq!(s.parent_turn_id().map(|x| &**x), Some(T1));
    assert_eq!(s.parent_tool_call_id().map(|x| &**x), Some("tu-1"));
    assert_eq!(s.root_turn_id().map(|x| &**x), Some(T1));
    assert_eq!(
        s.provider_aliases.parent_tool_use_id.as_deref(),
        Some("tu-1")
    );
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Submitted);
    // The root result may come before task_started: the child already gates the root.
    rig.result();
    assert_eq!(rig.root().phase(), Phase::Waiting);
    rig.assert_clean();
}

#[test]
fn earliest_partial_tool_event_creates_child_and_later_events_merge_title_and_identity() {
    let mut rig = Rig::new();
    rig.started();
    // The partial stream reveals only the generic tool name.
    let out = rig.msg(json!({"type":"stream_event","parent_tool_use_id":null,"uuid":"s1",
        "event":{"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"tu-1","name":"Agent","input":{}}}}));
    assert_eq!(count(&out.events, "childSessionCreated"), 1);
    let (cs, ct) = child("tu-1");
    assert_eq!(
        rig.engine().session(&cs).unwrap().title.as_deref(),
        Some("Agent")
    );
    // The full message carries the real description: a title update, never another child.
    let out = rig.agent(None, "tu-1", true);
    assert_eq!(count(&out.events, "childSessionCreated"), 0);
    assert_eq!(count(&out.events, "childSessionUpdated"), 1);
    assert_eq!(
        rig.engine().session(&cs).unwrap().title.as_deref(),
        Some("job tu-1")
    );
    // A hook and task_started repeat the identity: aliases bind to the same child.
    rig.line(json!({"kind":"hook","event":"PreToolUse","toolUseID":"tu-1",
        "input":{"hook_event_name":"PreToolUse","tool_name":"Agent","tool_use_id":"tu-1","tool_input":{"description":"job tu-1"}}}));
    rig.task_started("task-1", "tu-1", true);
    rig.line(json!({"kind":"hook","event":"SubagentStart","toolUseID":null,"input":{"agent_id":"task-1"}}));
    let s = rig.engine().session(&cs).unwrap().clone();
    assert_eq!(s.provider_aliases.task_id.as_deref(), Some("task-1"));
    assert_eq!(s.provider_aliases.agent_id.as_deref(), Some("task-1"));
    assert_eq!(
        s.provider_aliases.parent_tool_use_id.as_deref(),
        Some("tu-1")
    );
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Running);
    assert_eq!(count(&rig.events, "childSessionCreated"), 1);
    rig.assert_clean();
}

#[test]
fn parent_tool_call_stays_on_the_parent_turn() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", false);
    rig.task_started("task-1", "tu-1", false);
    let (cs, ct) = child("tu-1");
    rig.tool_use(
        Some("tu-1"),
        "child-tool",
        "Read",
        json!({"file_path":"/x"}),
    );
    rig.tool_result(Some("tu-1"), "child-tool", false, json!({}));
    rig.tool_result(
        None,
        "tu-1",
        false,
        json!({"status":"completed","agentId":"task-1"}),
    );
    let launch = rig
        .engine()
        .tool_call(R, "tu-1")
        .expect("launch tool call on the root")
        .clone();
    assert_eq!(launch.turn_id.as_ref(), T1);
    assert_eq!(&*launch.status, "completed");
    assert!(
        rig.engine().tool_call(&cs, "tu-1").is_none(),
        "never moved into the child"
    );
    let inner = rig
        .engine()
        .tool_call(&cs, "child-tool")
        .expect("child tool on the child")
        .clone();
    assert_eq!(inner.turn_id.as_ref(), ct);
    assert!(rig.engine().tool_call(R, "child-tool").is_none());
    rig.assert_clean();
}

#[test]
fn only_messages_whose_parent_tool_use_id_points_into_the_child_are_child_events() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", false);
    let (cs, ct) = child("tu-1");
    let out = rig.text(None, "root words");
    assert!(
        matches!(&out.events[0], NormalizedEvent::MessageAppended { agent_session_id, .. } if agent_session_id.as_ref() == R)
    );
    let out = rig.text(Some("tu-1"), "child words");
    let m = out
        .events
        .iter()
        .find(|e| e.kind() == "messageAppended")
        .expect("a child message");
    assert!(
        matches!(m, NormalizedEvent::MessageAppended { agent_session_id, turn_id, .. }
        if agent_session_id.as_ref() == cs && turn_id.as_ref() == ct)
    );
    // An unknown marker is never attributed to the root.
    let out = rig.text(Some("tu-unknown"), "whose?");
    assert!(out.events.is_empty(), "{:?}", out.events);
    rig.assert_clean();
}

#[test]
fn nested_task_creates_a_grandchild_whose_direct_parent_is_the_launching_child() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", false);
    rig.task_started("task-1", "tu-1", false);
    let out = rig.agent(Some("tu-1"), "tu-2", false);
    let (cs, ct) = child("tu-1");
    let (gs, gt) = child("tu-2");
    assert_eq!(count(&out.events, "childSessionCreated"), 1);
    let g = rig.engine().session(&gs).expect("grandchild").clone();
    assert_eq!(g.parent_agent_session_id().map(|x| &**x), Some(cs.as_str()));
    assert_eq!(g.parent_turn_id().map(|x| &**x), Some(ct.as_str()));
    assert_eq!(g.root_agent_session_id().map(|x| &**x), Some(R));
    assert_eq!(g.root_turn_id().map(|x| &**x), Some(T1));
    // The nested launch tool call stays on the launching child's turn.
    assert_eq!(
        rig.engine()
            .tool_call(&cs, "tu-2")
            .unwrap()
            .turn_id
            .as_ref(),
        ct
    );
    // Grandchild output is scoped by its own marker.
    rig.msg(json!({"type":"system","subtype":"task_started","task_id":"task-2","tool_use_id":"tu-2",
        "parent_task_id":"task-1","description":"job tu-2","is_backgrounded":false,"task_type":"local_agent"}));
    rig.text(Some("tu-2"), "deep");
    assert_eq!(rig.turn(&gs, &gt).phase(), Phase::Running);
    rig.tool_result(Some("tu-1"), "tu-2", false, json!({"status":"completed"}));
    assert_eq!(rig.turn(&gs, &gt).outcome(), Some(Outcome::Completed));
    assert!(rig.turn(&cs, &ct).phase().is_active());
    rig.assert_clean();
}

#[test]
fn task_and_agent_ids_bind_to_their_own_child_never_to_the_only_running_task() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-a", true);
    rig.agent(None, "tu-b", true);
    rig.task_started("task-a", "tu-a", true);
    let (a, _) = child("tu-a");
    let (b, _) = child("tu-b");
    assert_eq!(
        rig.engine()
            .session(&a)
            .unwrap()
            .provider_aliases
            .task_id
            .as_deref(),
        Some("task-a")
    );
    assert_eq!(
        rig.engine().session(&b).unwrap().provider_aliases.task_id,
        None
    );
    // An agent id nobody announced binds nothing, even though tu-b is the only unbound task.
    let out = rig.line(json!({"kind":"hook","event":"SubagentStart","toolUseID":null,"input":{"agent_id":"task-x"}}));
    assert!(out.events.is_empty());
    let out = rig.line(
        json!({"kind":"canUseTool","requestId":"p-1","toolName":"Bash","input":{},
        "toolUseID":null,"agentID":"task-x","options":{}}),
    );
    assert_eq!(count(&out.events, "interactionRequested"), 0);
    assert_eq!(
        out.native.len(),
        1,
        "the unowned callback is denied, not guessed"
    );
    assert_eq!(out.native[0]["behavior"], "deny");
    assert!(rig.engine().pending_interactions(R).is_empty());
    // A child message carrying its agent id binds that alias to its own child only.
    let mut m = json!({"type":"assistant","agent_id":"task-b","uuid":"m-b",
        "message":{"role":"assistant","content":[{"type":"text","text":"b"}]}});
    ptu(&mut m, Some("tu-b"));
    rig.msg(m);
    assert_eq!(
        rig.engine()
            .session(&b)
            .unwrap()
            .provider_aliases
            .agent_id
            .as_deref(),
        Some("task-b")
    );
    assert_eq!(
        rig.engine().session(&a).unwrap().provider_aliases.agent_id,
        None
    );
    rig.assert_clean();
}

#[test]
fn permission_with_agent_id_becomes_an_interaction_on_that_child_keeping_the_provider_turn_id() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", false);
    rig.task_started("task-1", "tu-1", false);
    rig.tool_use(Some("tu-1"), "w-1", "Write", json!({"file_path":"/x"}));
    let (cs, ct) = child("tu-1");
    rig.line(json!({"kind":"canUseTool","requestId":"req-9","toolName":"Write","input":{"file_path":"/x"},
        "toolUseID":"w-1","agentID":"task-1","options":{"toolUseID":"w-1","agentID":"task-1"}}));
    let pending = rig.engine().pending_interactions(R);
    assert_eq!(pending.len(), 1);
    let i = &pending[0];
    assert_eq!(i.agent_session_id.as_ref(), cs);
    assert_eq!(i.turn_id.as_ref(), ct);
    assert_eq!(i.request_id.as_ref(), "req-9");
    assert_eq!(
        i.provider_turn_id.as_deref(),
        Some("claude-1"),
        "the SDK callback's provider turn"
    );
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Waiting);
    assert!(rig.root().phase().is_active());
    // The user answers the canonical tuple; the sidecar gets its own request id back.
    let step = rig.cmd(
        json!({"type":"respondInteraction","agentSessionId":cs,"turnId":ct,"requestId":"req-9",
        "response":{"behavior":"deny","message":"not there"}}),
    );
    assert!(
        matches!(&step.provider[0], ProviderRequest::RespondInteraction { provider_turn_id: Some(p), .. } if p == "claude-1")
    );
    let cmd = rig.last_native("permission");
    assert_eq!(cmd["requestId"], "req-9");
    assert_eq!(cmd["behavior"], "deny");
    assert_eq!(cmd["message"], "not there");
    rig.ack("permission", true);
    let snap = rig.engine().snapshot(R).unwrap();
    assert_eq!(snap.interactions[0].status, InteractionStatus::Resolved);
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Running);
    rig.assert_clean();
}

/// "A permission callback ... whose owner is closed or settled is denied at once": the root
/// permission callback of a timed-out continuation arrives after the canonical root turn settled.
/// The adapter cannot tell that from its own state (the root is not canceled), so it emits the
/// interaction; the engine does not take it (late after settled), and `on_dropped` answers the
/// SDK callback with deny so the SDK never waits forever.
#[test]
fn a_root_permission_the_engine_did_not_take_is_denied_so_the_sdk_never_waits() {
    let mut rig = Rig::with(ClaudeConfig {
        continuation_timeout_ms: 50,
        ..ClaudeConfig::default()
    });
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    rig.timer(&timer.id, timer.at);
    assert!(!rig.root().phase().is_active(), "the root settled");
    // The late continuation runs a tool that needs permission.
    rig.tool_use(None, "w-late", "Write", json!({"file_path":"/late"}));
    let before = rig.native.len();
    let out = rig.line(json!({"kind":"canUseTool","requestId":"req-late","toolName":"Write",
        "input":{"file_path":"/late"},"toolUseID":"w-late","agentID":null,"options":{"toolUseID":"w-late"}}));
    assert_eq!(count(&out.events, "interactionRequested"), 1);
    assert_eq!(rig.dropped.len(), 1, "the engine did not take it");
    assert!(
        matches!(&rig.dropped[0], NormalizedEvent::InteractionRequested { agent_session_id, turn_id, .. }
            if agent_session_id.as_ref() == R && turn_id.as_ref() == T1)
    );
    let sent: Vec<&Value> = rig.native[before..].iter().collect();
    assert_eq!(sent.len(), 1, "exactly one answer: {sent:?}");
    assert_eq!(sent[0]["op"], "permission");
    assert_eq!(sent[0]["requestId"], "req-late");
    assert_eq!(sent[0]["behavior"], "deny");
    assert!(sent[0]["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(rig.engine().pending_interactions(R).is_empty());
    // The sidecar's ack of the deny and the denied tool's result change nothing.
    let out = rig.ack("permission", true);
    assert!(out.events.is_empty(), "{:?}", out.events);
    rig.tool_result(None, "w-late", true, json!("denied"));
    assert!(!rig.root().phase().is_active(), "nothing reopens the root");
    assert_eq!(rig.root().outcome(), Some(Outcome::Interrupted));
    // The same drop again (or the SDK repeating the request) answers nothing twice.
    let again = rig.dropped[0].clone();
    let out = rig.unit(|a, now| a.on_dropped(now, &again));
    assert!(out.native.is_empty() && out.events.is_empty(), "{out:?}");
    rig.assert_clean();
}

/// `on_dropped` answers only a callback the adapter still holds for exactly that session/turn;
/// other events, other owners and answered requests are left alone. A child whose permission was
/// denied this way runs again when the SDK shows the denied tool's result.
#[test]
fn on_dropped_denies_only_a_held_callback_of_that_exact_owner() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", false);
    rig.task_started("task-1", "tu-1", false);
    rig.tool_use(Some("tu-1"), "w-1", "Write", json!({"file_path":"/x"}));
    let (cs, ct) = child("tu-1");
    let out = rig.line(json!({"kind":"canUseTool","requestId":"req-1","toolName":"Write","input":{"file_path":"/x"},
        "toolUseID":"w-1","agentID":"task-1","options":{"toolUseID":"w-1","agentID":"task-1"}}));
    let requested = out
        .events
        .iter()
        .find(|e| e.kind() == "interactionRequested")
        .cloned()
        .expect("an interaction on the child");
    assert!(rig.dropped.is_empty(), "the engine took it");
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Waiting);
    let now = rig.now;
    // Another event kind, another owner (the root turn), an unknown request: nothing.
    let other_kind = NormalizedEvent::TurnWaiting {
        agent_session_id: cs.as_str().into(),
        turn_id: ct.as_str().into(),
    };
    assert_eq!(
        rig.unit(|a, _now| a.on_dropped(now, &other_kind)),
        AdapterOutput::default()
    );
    let mut wrong_owner = requested.clone();
    let mut unknown = requested.clone();
    if let NormalizedEvent::InteractionRequested {
        agent_session_id,
        turn_id,
        ..
    } = &mut wrong_owner
    {
        *agent_session_id = R.into();
        *turn_id = T1.into();
    }
    if let NormalizedEvent::InteractionRequested { request_id, .. } = &mut unknown {
        *request_id = "req-unknown".into();
    }
    assert_eq!(
        rig.unit(|a, _now| a.on_dropped(now, &wrong_owner)),
        AdapterOutput::default()
    );
    assert_eq!(
        rig.unit(|a, _now| a.on_dropped(now, &unknown)),
        AdapterOutput::default()
    );
    // The exact held callback: denied once.
    let out = rig.unit(|a, _now| a.on_dropped(now, &requested));
    assert_eq!(out.native.len(), 1, "{out:?}");
    assert_eq!(out.native[0]["op"], "permission");
    assert_eq!(out.native[0]["requestId"], "req-1");
    assert_eq!(out.native[0]["behavior"], "deny");
    assert!(
        out.events.is_empty(),
        "sending the deny is not a resolution fact"
    );
    assert_eq!(
        rig.unit(|a, _now| a.on_dropped(now, &requested)),
        AdapterOutput::default()
    );
    // The SDK shows the denied tool's result inside the child: the child runs again.
    let out = rig.tool_result(Some("tu-1"), "w-1", true, json!("denied"));
    assert!(
        out.events.iter().any(
            |e| matches!(e, NormalizedEvent::TurnStarted { agent_session_id, turn_id, .. }
            if agent_session_id.as_ref() == cs && turn_id.as_ref() == ct)
        ),
        "{:?}",
        out.events
    );
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Running);
    // A callback answered through the engine is no longer held: a late drop denies nothing.
    rig.tool_use(Some("tu-1"), "w-2", "Write", json!({"file_path":"/y"}));
    let out = rig.line(json!({"kind":"canUseTool","requestId":"req-2","toolName":"Write","input":{"file_path":"/y"},
        "toolUseID":"w-2","agentID":"task-1","options":{"toolUseID":"w-2","agentID":"task-1"}}));
    let second = out
        .events
        .iter()
        .find(|e| e.kind() == "interactionRequested")
        .cloned()
        .expect("a second interaction");
    rig.cmd(json!({"type":"respondInteraction","agentSessionId":cs,"turnId":ct,"requestId":"req-2","response":"allow"}));
    rig.ack("permission", true);
    assert_eq!(
        rig.unit(|a, now| a.on_dropped(now, &second)),
        AdapterOutput::default()
    );
    rig.assert_clean();
}

#[test]
fn respond_interaction_maps_engine_answers_to_allow_or_deny() {
    let cases = [
        (json!("allow"), "allow"),
        (json!("approve"), "allow"),
        (json!(true), "allow"),
        (json!({"behavior":"allow","updatedInput":{"a":1}}), "allow"),
        (json!({"decision":"accept"}), "allow"),
        (json!({"approved":true}), "allow"),
        (json!("deny"), "deny"),
        (json!("decline"), "deny"),
        (json!(false), "deny"),
        (
            json!({"behavior":"deny","message":"no","interrupt":true}),
            "deny",
        ),
        (json!({"something":"else"}), "deny"),
        (json!(null), "deny"),
    ];
    for (response, want) in cases {
        let mut a = ClaudeAdapter::new(R.into(), ClaudeConfig::default());
        let out = a.on_request(
            0,
            &ProviderRequest::RespondInteraction {
                root_agent_session_id: R.into(),
                agent_session_id: R.into(),
                turn_id: T1.into(),
                request_id: "req-1".into(),
                provider_turn_id: Some("claude-1".into()),
                response: response.clone(),
            },
        );
        assert_eq!(out.native.len(), 1);
        let c = &out.native[0];
        assert_eq!(c["op"], "permission");
        assert_eq!(c["requestId"], "req-1");
        assert_eq!(c["behavior"], want, "{response}");
        if response.get("updatedInput").is_some() {
            assert_eq!(c["updatedInput"], json!({"a":1}));
        }
        if response.get("interrupt").is_some() {
            assert_eq!(c["interrupt"], true);
        }
    }
}

#[test]
fn foreground_task_settles_from_its_parent_tool_result() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", false);
    rig.task_started("task-1", "tu-1", false);
    let (cs, ct) = child("tu-1");
    rig.text(Some("tu-1"), "working");
    assert!(
        rig.turn(&cs, &ct).phase().is_active(),
        "assistant output is progress, not completion"
    );
    let out = rig.tool_result(
        None,
        "tu-1",
        false,
        json!({"status":"completed","agentId":"task-1"}),
    );
    assert_eq!(count(&out.events, "turnTerminal"), 1);
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Completed));
    // A late notification for the settled foreground task is a no-op.
    let out = rig.notification("task-1", "tu-1", "completed");
    assert_eq!(count(&out.events, "turnTerminal"), 0);
    rig.result();
    assert_eq!(rig.root().outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

#[test]
fn background_task_does_not_settle_from_launch_result_and_waits_for_its_task_terminal() {
    let mut rig = Rig::new();
    let (cs, ct) = rig.waiting_on_background_child();
    assert!(
        rig.turn(&cs, &ct).phase().is_active(),
        "the async launch result settles nothing"
    );
    assert_eq!(
        &*rig.engine().tool_call(R, "tu-1").unwrap().status,
        "completed",
        "delegation accepted"
    );
    rig.text(Some("tu-1"), "still going");
    assert!(rig.turn(&cs, &ct).phase().is_active());
    rig.notification("task-1", "tu-1", "completed");
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

#[test]
fn background_bash_is_not_a_child_never_gates_the_root_and_stays_stoppable() {
    let mut rig = Rig::new();
    rig.started();
    rig.tool_use(
        None,
        "bash-1",
        "Bash",
        json!({"command":"sleep 100","run_in_background":true}),
    );
    // An earlier task_started completes the launch with the provider task id.
    let out = rig.msg(
        json!({"type":"system","subtype":"task_started","task_id":"shell-1","tool_use_id":"bash-1",
        "description":"sleep","task_type":"local_bash","is_backgrounded":true}),
    );
    assert_eq!(count(&out.events, "childSessionCreated"), 0);
    let call = rig.engine().tool_call(R, "bash-1").unwrap().clone();
    assert_eq!(&*call.status, "completed");
    assert_eq!(call.payload.as_ref().unwrap()["taskId"], "shell-1");
    assert_eq!(rig.adapter().active_child_count(), 0);
    rig.result();
    assert_eq!(
        rig.root().outcome(),
        Some(Outcome::Completed),
        "the shell never gates the root"
    );
    // Its later task events project nothing and reserve no continuation.
    let out = rig.notification("shell-1", "bash-1", "completed");
    assert!(out.events.is_empty() && out.timers.is_empty(), "{out:?}");
    // Still stoppable while it runs (a second shell).
    rig.submit("turn-2");
    rig.tool_use(
        None,
        "bash-2",
        "Bash",
        json!({"command":"sleep 100","run_in_background":true}),
    );
    rig.msg(
        json!({"type":"system","subtype":"task_started","task_id":"shell-2","tool_use_id":"bash-2",
        "description":"sleep","task_type":"local_bash"}),
    );
    let stop = rig
        .unit(|a, now| a.stop_native_task(now, "bash-2"))
        .expect("stoppable by tool use id");
    assert_eq!(stop.native[0]["op"], "stopTask");
    assert_eq!(stop.native[0]["taskId"], "shell-2");
    assert!(
        rig.unit(|a, now| a.stop_native_task(now, "shell-1"))
            .is_none(),
        "already ended"
    );
    rig.assert_clean();
}

#[test]
fn successful_root_result_completes_the_background_launch_when_task_started_is_delayed() {
    let mut rig = Rig::new();
    rig.started();
    rig.tool_use(
        None,
        "bash-1",
        "Bash",
        json!({"command":"serve","run_in_background":true}),
    );
    assert_eq!(
        &*rig.engine().tool_call(R, "bash-1").unwrap().status,
        "started"
    );
    let out = rig.result();
    let tool = position(&out.events, |e| e.kind() == "toolCallUpdated");
    let done = position(&out.events, |e| e.kind() == "rootProviderTurnCompleted");
    assert!(
        tool < done,
        "the launch completes before the root provider terminal"
    );
    assert_eq!(
        &*rig.engine().tool_call(R, "bash-1").unwrap().status,
        "completed"
    );
    assert_eq!(rig.root().outcome(), Some(Outcome::Completed));
    // The delayed task_started now only records the task for stop routing.
    let out = rig.msg(
        json!({"type":"system","subtype":"task_started","task_id":"shell-1","tool_use_id":"bash-1",
        "description":"serve","task_type":"local_bash"}),
    );
    assert!(out.events.is_empty());
    assert!(rig
        .unit(|a, now| a.stop_native_task(now, "shell-1"))
        .is_some());
    rig.assert_clean();
}

#[test]
fn root_result_maps_to_root_provider_turn_completed_never_a_root_terminal() {
    let mut rig = Rig::new();
    rig.started();
    let out = rig.msg(json!({"type":"result","subtype":"error_during_execution","is_error":true,"errors":["boom"]}));
    assert_eq!(out.events.len(), 1);
    match &out.events[0] {
        NormalizedEvent::RootProviderTurnCompleted {
            agent_session_id,
            turn_id,
            provider_turn_id,
            outcome,
            error,
        } => {
            assert_eq!(agent_session_id.as_ref(), R);
            assert_eq!(turn_id.as_deref(), Some(T1));
            assert_eq!(provider_turn_id.as_deref(), Some("claude-1"));
            assert_eq!(*outcome, Outcome::Failed);
            assert!(error.as_deref().unwrap_or("").contains("boom"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(count(&rig.events, "turnTerminal"), 0);
    assert_eq!(rig.root().outcome(), Some(Outcome::Failed));
    rig.assert_clean();
}

#[test]
fn final_async_child_terminal_opens_synthetic_provider_turn_before_the_child_terminal() {
    let mut rig = Rig::new();
    let (cs, ct) = rig.waiting_on_background_child();
    let at = rig.now + 1;
    let out = rig.notification("task-1", "tu-1", "completed");
    let start = position(&out.events, |e| {
        matches!(e, NormalizedEvent::RootProviderTurnStarted { provider_turn_id: Some(p), turn_id: Some(t), .. }
            if p.starts_with("synthetic-") && t.as_ref() == T1)
    });
    let term = position(&out.events, |e| e.kind() == "turnTerminal");
    assert!(
        start < term,
        "synthetic turn opens before the child terminal"
    );
    assert_eq!(out.timers.len(), 1);
    assert_eq!(out.timers[0].at, at + 30_000);
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Completed));
    // The gate observes a running provider turn: the canonical root stays active.
    let root = rig.root();
    assert_eq!(root.phase(), Phase::Running);
    assert_eq!(
        root.root_provider_turn()
            .as_ref()
            .unwrap()
            .provider_turn_id
            .as_deref(),
        Some("synthetic-1")
    );
    // The SDK continuation belongs to the same canonical root turn; the root settles after it.
    rig.msg(init());
    rig.text(None, "the child reported back");
    assert!(rig.root().phase().is_active());
    rig.result_with_origin();
    let root = rig.root();
    assert_eq!(root.outcome(), Some(Outcome::Completed));
    assert_eq!(
        rig.engine().session(R).unwrap().last_turn_id.as_deref(),
        Some(T1)
    );
    rig.assert_clean();
}

#[test]
fn non_final_child_terminal_opens_no_continuation() {
    let mut rig = Rig::new();
    rig.started();
    rig.background_child("tu-1", "task-1");
    rig.background_child("tu-2", "task-2");
    rig.result();
    let out = rig.notification("task-1", "tu-1", "completed");
    assert_eq!(count(&out.events, "rootProviderTurnStarted"), 0);
    assert!(out.timers.is_empty());
    let out = rig.notification("task-2", "tu-2", "completed");
    assert_eq!(
        count(&out.events, "rootProviderTurnStarted"),
        1,
        "only the final async child"
    );
    rig.assert_clean();
}

#[test]
fn first_root_stream_or_assistant_event_disarms_the_continuation_timer() {
    let mut rig = Rig::new();
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    rig.msg(init()); // not a stream or assistant event
    rig.msg(json!({"type":"stream_event","parent_tool_use_id":null,"uuid":"s9","event":{"type":"message_start","message":{}}}));
    let out = rig.timer(&timer.id, timer.at);
    assert!(
        out.events.is_empty() && out.native.is_empty(),
        "disarmed: {out:?}"
    );
    assert!(
        rig.root().phase().is_active(),
        "the continuation follows its normal lifecycle"
    );
    rig.text(None, "reply");
    rig.result_with_origin();
    assert_eq!(rig.root().outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

#[test]
fn continuation_timeout_completes_the_reserved_turn_with_timeout_and_interrupts_it() {
    let mut rig = Rig::with(ClaudeConfig {
        continuation_timeout_ms: 50,
        ..ClaudeConfig::default()
    });
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    rig.msg(init()); // the continuation may have begun, but no stream/assistant output yet
    let out = rig.timer(&timer.id, timer.at);
    assert_eq!(out.events.len(), 1);
    match &out.events[0] {
        NormalizedEvent::RootProviderTurnCompleted {
            provider_turn_id,
            outcome,
            error,
            ..
        } => {
            assert_eq!(provider_turn_id.as_deref(), Some("synthetic-1"));
            assert_eq!(*outcome, Outcome::Interrupted);
            assert!(error.as_deref().unwrap_or("").contains("timeout"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(out.native.len(), 1);
    assert_eq!(out.native[0]["op"], "interrupt");
    let root = rig.root();
    assert!(
        !root.phase().is_active(),
        "the ordinary gate settles the root"
    );
    assert_eq!(
        root.root_provider_turn().unwrap().phase(),
        ProviderPhase::Completed
    );
    // Later output from the timed-out continuation is stale and dropped.
    for out in [rig.text(None, "too late"), rig.result_with_origin()] {
        assert!(out.events.is_empty(), "{:?}", out.events);
    }
    // A repeat of the timer does nothing.
    assert!(rig.timer(&timer.id, timer.at).events.is_empty());
    rig.assert_clean();
}

#[test]
fn stale_continuation_output_never_lands_on_a_later_canonical_turn() {
    let mut rig = Rig::with(ClaudeConfig {
        continuation_timeout_ms: 50,
        ..ClaudeConfig::default()
    });
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    rig.timer(&timer.id, timer.at);
    assert!(!rig.root().phase().is_active());
    // A later user submission starts a new canonical root turn (streamed with `input`).
    rig.submit("turn-2");
    assert_eq!(rig.last_native("input")["text"], "do it");
    // The late continuation runs first: all of it is dropped.
    let late = rig.text(None, "late continuation");
    assert!(late.events.is_empty());
    rig.result_with_origin();
    assert!(rig.turn(R, "turn-2").phase().is_active());
    // Then turn-2's own output lands on turn-2.
    let out = rig.text(None, "answer to turn 2");
    assert!(
        matches!(&out.events[0], NormalizedEvent::MessageAppended { turn_id, .. } if turn_id.as_ref() == "turn-2")
    );
    rig.result();
    assert_eq!(rig.turn(R, "turn-2").outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

#[test]
fn timed_out_continuation_that_never_ran_does_not_swallow_the_next_turn() {
    let mut rig = Rig::with(ClaudeConfig {
        continuation_timeout_ms: 50,
        ..ClaudeConfig::default()
    });
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    rig.timer(&timer.id, timer.at);
    rig.submit("turn-2");
    // No continuation ever runs: turn-2's output is buffered, then re-attributed by its result.
    rig.text(None, "answer to turn 2");
    rig.result();
    let t2 = rig.turn(R, "turn-2");
    assert_eq!(t2.outcome(), Some(Outcome::Completed));
    assert!(
        rig.events.iter().any(
            |e| matches!(e, NormalizedEvent::MessageAppended { turn_id, text, .. }
            if turn_id.as_ref() == "turn-2" && &**text == "answer to turn 2")
        ),
        "the buffered output was re-attributed to turn-2"
    );
    rig.assert_clean();
}

#[test]
fn stopped_task_terminal_needs_no_continuation() {
    let mut rig = Rig::new();
    let (cs, ct) = rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "stopped");
    assert_eq!(count(&out.events, "rootProviderTurnStarted"), 0);
    assert!(out.timers.is_empty());
    assert!(!rig.turn(&cs, &ct).phase().is_active());
    assert_eq!(
        rig.root().outcome(),
        Some(Outcome::Completed),
        "the gate resolves from ordinary state"
    );
    rig.assert_clean();
}

#[test]
fn guidance_during_the_wait_joins_the_reserved_turn_without_resetting_the_boundary() {
    let mut rig = Rig::with(ClaudeConfig {
        continuation_timeout_ms: 50,
        ..ClaudeConfig::default()
    });
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    let before = rig.events.len();
    let step = rig.submit("turn-x");
    assert!(
        matches!(&step.provider[0], ProviderRequest::Guide { mode: tutti_core::GuideMode::Steer, provider_turn_id: Some(p), .. } if p == "synthetic-1")
    );
    assert_eq!(rig.last_native("input")["text"], "do it");
    assert_eq!(
        count(&rig.events[before..], "rootProviderTurnStarted"),
        0,
        "same reserved turn"
    );
    assert_eq!(rig.timers.len(), 1, "no new or reset timer");
    assert!(
        rig.engine().turn(R, "turn-x").is_none(),
        "no new canonical turn"
    );
    // The original boundary still expires, interrupting the continuation with the guidance.
    let out = rig.timer(&timer.id, timer.at);
    assert_eq!(count(&out.events, "rootProviderTurnCompleted"), 1);
    assert_eq!(out.native[0]["op"], "interrupt");
    rig.assert_clean();
}

#[test]
fn guidance_while_only_children_run_opens_a_synthetic_provider_turn() {
    let mut rig = Rig::new();
    let (cs, ct) = rig.waiting_on_background_child();
    let before = rig.events.len();
    let step = rig.submit("turn-x");
    assert!(matches!(
        &step.provider[0],
        ProviderRequest::Guide {
            mode: tutti_core::GuideMode::StartOnRoot,
            ..
        }
    ));
    assert_eq!(rig.last_native("input")["op"], "input");
    assert!(
        matches!(&rig.events[before], NormalizedEvent::RootProviderTurnStarted { provider_turn_id: Some(p), turn_id: Some(t), .. }
        if p.starts_with("synthetic-") && t.as_ref() == T1)
    );
    let root = rig.root();
    assert_eq!(root.phase(), Phase::Running);
    assert!(
        !root.root_provider_turn().unwrap().reserved(),
        "the reservation is adopted"
    );
    assert!(
        rig.engine().turn(R, "turn-x").is_none(),
        "no new canonical turn"
    );
    rig.ack("input", true);
    // The child's terminal opens no second reservation: a root provider turn is live.
    let out = rig.notification("task-1", "tu-1", "completed");
    assert_eq!(count(&out.events, "rootProviderTurnStarted"), 0);
    assert!(out.timers.is_empty());
    assert!(!rig.turn(&cs, &ct).phase().is_active());
    rig.text(None, "about your guidance");
    // The guidance turn's result answers no notification: the SDK still owes the follow-up
    // (captured: `bg_two_during_guidance`), so the provider lifecycle stays reserved.
    rig.result();
    assert!(rig.root().phase().is_active());
    assert_eq!(rig.adapter().outstanding_notifications(), 1);
    rig.msg(init());
    rig.text(None, "the child reported back");
    rig.result_with_origin();
    assert_eq!(rig.root().outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

#[test]
fn refused_guidance_input_completes_its_synthetic_turn_and_answers_guide_failed() {
    let mut rig = Rig::new();
    let (cs, ct) = rig.waiting_on_background_child();
    rig.submit("turn-x");
    let out = rig.ack("input", false);
    assert!(
        matches!(&out.events[..], [NormalizedEvent::RootProviderTurnCompleted { outcome: Outcome::Failed, provider_turn_id: Some(p), .. }]
        if p.starts_with("synthetic-"))
    );
    assert!(matches!(
        &out.answers[..],
        [RuntimeAnswer::GuideFailed { .. }]
    ));
    let root = rig.root();
    assert_eq!(
        root.phase(),
        Phase::Waiting,
        "the child still gates the root"
    );
    assert_eq!(
        root.root_provider_turn().unwrap().phase(),
        ProviderPhase::Completed
    );
    rig.notification("task-1", "tu-1", "completed");
    assert!(!rig.turn(&cs, &ct).phase().is_active());
    rig.assert_clean();
}

#[test]
fn later_root_turns_stream_into_the_running_query_with_input() {
    let mut rig = Rig::new();
    rig.started();
    assert_eq!(rig.last_native("start")["prompt"], "do it");
    rig.result();
    rig.submit("turn-2");
    let input = rig.last_native("input");
    assert_eq!(input["text"], "do it");
    assert_eq!(rig.native.iter().filter(|c| c["op"] == "start").count(), 1);
    let t2 = rig.turn(R, "turn-2");
    assert_eq!(
        t2.root_provider_turn()
            .as_ref()
            .unwrap()
            .provider_turn_id
            .as_deref(),
        Some("claude-2")
    );
    rig.text(None, "second");
    rig.result();
    assert_eq!(rig.turn(R, "turn-2").outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

#[test]
fn start_options_are_passed_to_the_sidecar() {
    let mut rig = Rig::with(ClaudeConfig {
        options: json!({"cwd":"/w","model":"m","permissionMode":"default"}),
        ..ClaudeConfig::default()
    });
    rig.submit(T1);
    let start = rig.last_native("start");
    assert_eq!(
        start["options"],
        json!({"cwd":"/w","model":"m","permissionMode":"default"})
    );
    assert_eq!(start["requestId"], T1);
}

/// Issue 17: "the next submit to that root starts the provider again and continues the same
/// provider conversation: Claude Agent SDK `resume` with the recorded session id". A relaunched
/// adapter (recorded id in the config) resumes it; a query that ended in a live sidecar resumes
/// the session its init reported; options that name `resume` themselves win.
#[test]
fn a_start_resumes_the_recorded_sdk_session() {
    let mut rig = Rig::with(ClaudeConfig {
        options: json!({"cwd":"/w"}),
        resume_session_id: Some("recorded".into()),
        ..ClaudeConfig::default()
    });
    rig.submit(T1);
    assert_eq!(rig.last_native("start")["options"]["resume"], "recorded");

    let mut fresh = Rig::new();
    fresh.submit(T1);
    assert!(
        fresh.last_native("start")["options"]
            .get("resume")
            .is_none(),
        "nothing to resume on a first launch"
    );
    fresh.ack("start", true);
    fresh.msg(init());
    fresh.result();
    fresh.line(json!({"kind":"exited"}));
    fresh.submit("turn-2");
    assert_eq!(
        fresh.last_native("start")["options"]["resume"],
        "sdk-session"
    );

    let mut own = Rig::with(ClaudeConfig {
        options: json!({"resume":"mine"}),
        resume_session_id: Some("recorded".into()),
        ..ClaudeConfig::default()
    });
    own.submit(T1);
    assert_eq!(own.last_native("start")["options"]["resume"], "mine");
}

#[test]
fn failed_start_completes_the_root_provider_turn_failed_and_restarts_next_time() {
    let mut rig = Rig::new();
    rig.submit(T1);
    rig.ack("start", false);
    let root = rig.root();
    assert_eq!(root.outcome(), Some(Outcome::Failed));
    rig.submit("turn-2");
    assert_eq!(rig.native.iter().filter(|c| c["op"] == "start").count(), 2);
    rig.assert_clean();
}

#[test]
fn goal_completion_is_session_metadata_only() {
    let mut rig = Rig::new();
    rig.waiting_on_background_child();
    let out = rig.msg(json!({"type":"active_goal","value":null,"uuid":"g","session_id":"x"}));
    assert_eq!(out.events.len(), 1);
    assert_eq!(out.events[0].kind(), "sessionMetadataUpdated");
    assert_eq!(
        rig.engine().session(R).unwrap().goal.as_ref().unwrap()["status"],
        "complete"
    );
    assert_eq!(
        rig.root().phase(),
        Phase::Waiting,
        "goal complete never settles the root"
    );
    assert_eq!(
        rig.engine().session(R).unwrap().active_turn_id.as_deref(),
        Some(T1)
    );
    rig.assert_clean();
}

#[test]
fn goal_control_turn_emits_no_root_provider_facts() {
    let mut rig = Rig::new();
    rig.started();
    rig.result();
    let before = rig.events.len();
    let out = rig.call(|a, now| a.set_goal(now, "tests pass"));
    assert_eq!(out.native[0]["op"], "input");
    assert_eq!(out.native[0]["text"], "/goal tests pass");
    assert!(out.events.is_empty());
    rig.ack("input", true);
    rig.msg(init());
    rig.text(None, "goal set");
    rig.msg(json!({"type":"active_goal","value":{"condition":"tests pass","iterations":0,"set_at":1,"tokens_at_start":0}}));
    rig.result();
    let kinds: Vec<&str> = rig.events[before..].iter().map(|e| e.kind()).collect();
    assert_eq!(
        kinds,
        ["sessionMetadataUpdated"],
        "only the goal update flows"
    );
    assert_eq!(
        rig.engine().session(R).unwrap().goal.as_ref().unwrap()["status"],
        "active"
    );
    rig.assert_clean();
}

#[test]
fn root_cancel_records_closed_boundary_then_interrupts_and_acks_root_and_task_executions() {
    let mut rig = Rig::new();
    let (cs, ct) = rig.waiting_on_background_child();
    let step =
        rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":R,"turnId":T1}));
    assert!(
        matches!(&step.provider[0], ProviderRequest::Cancel { targets, .. } if targets.len() == 2)
    );
    let cmd = rig.last_native("interrupt");
    assert!(rig.answers.is_empty(), "sending cancel is not confirmation");
    // Fallout before the ack: the closed child emits nothing.
    let out = rig.msg(json!({"type":"system","subtype":"task_updated","task_id":"task-1","patch":{"status":"killed"}}));
    assert!(out.events.is_empty());
    let out = rig.line(json!({"kind":"ack","op":"interrupt","ok":true,"id":cmd["id"]}));
    match &out.answers[..] {
        [RuntimeAnswer::CancelResult {
            operation_id,
            acked,
        }] => {
            assert_eq!(operation_id.as_ref(), "op-1");
            let mut got: Vec<String> = acked.iter().map(|t| t.turn_id.to_string()).collect();
            got.sort();
            let mut want = vec![T1.to_string(), ct.clone()];
            want.sort();
            assert_eq!(got, want);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(rig.root().outcome(), Some(Outcome::Canceled));
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Canceled));
    for out in [
        rig.notification("task-1", "tu-1", "stopped"),
        rig.text(Some("tu-1"), "[Request interrupted by user]"),
    ] {
        assert!(out.events.is_empty(), "{:?}", out.events);
    }
    rig.assert_clean();
}

#[test]
fn root_cancel_during_the_notification_wait_cancels_the_reserved_turn() {
    let mut rig = Rig::new();
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":R,"turnId":T1}));
    let out = rig.ack("interrupt", true);
    assert!(
        matches!(&out.events[0], NormalizedEvent::RootProviderTurnCompleted { outcome: Outcome::Canceled, provider_turn_id: Some(p), .. } if p == "synthetic-1")
    );
    let root = rig.root();
    assert_eq!(root.outcome(), Some(Outcome::Canceled));
    assert_eq!(
        root.root_provider_turn().unwrap().phase(),
        ProviderPhase::Completed
    );
    // The disarmed timer and any late continuation change nothing.
    assert!(rig.timer(&timer.id, timer.at).events.is_empty());
    let out = rig.text(None, "late");
    assert!(out.events.is_empty());
    assert_eq!(
        out.native[0]["op"], "interrupt",
        "a server-initiated turn is interrupted, not adopted"
    );
    assert!(rig.result().events.is_empty());
    assert_eq!(rig.root().outcome(), Some(Outcome::Canceled));
    rig.assert_clean();
}

#[test]
fn root_cancel_while_the_root_provider_turn_runs_normalizes_its_terminal_as_canceled() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", false);
    rig.task_started("task-1", "tu-1", false);
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":R,"turnId":T1}));
    // The canceled root execution's output is dropped; a child revealed now is not created.
    let out = rig.text(None, "more");
    assert!(out.events.is_empty());
    let out = rig.agent(None, "tu-late", false);
    assert!(out.events.is_empty());
    let out = rig.task_started("task-late", "tu-late", false);
    assert!(out.events.is_empty());
    assert_eq!(out.native[0]["op"], "stopTask");
    assert_eq!(out.native[0]["taskId"], "task-late");
    rig.ack("interrupt", true);
    assert_eq!(rig.root().outcome(), Some(Outcome::Canceled));
    let out = rig.msg(
        json!({"type":"result","subtype":"error_during_execution","is_error":true,"errors":[]}),
    );
    assert!(matches!(
        &out.events[..],
        [NormalizedEvent::RootProviderTurnCompleted {
            outcome: Outcome::Canceled,
            ..
        }]
    ));
    assert_eq!(
        rig.root().root_provider_turn().unwrap().phase(),
        ProviderPhase::Completed
    );
    assert_eq!(rig.root().outcome(), Some(Outcome::Canceled));
    // A later explicit canonical turn clears the boundary.
    rig.submit("turn-2");
    let out = rig.text(None, "fresh");
    assert_eq!(out.events.len(), 1);
    rig.assert_clean();
}

#[test]
fn child_only_cancel_stops_each_child_and_leaves_root_and_siblings_running() {
    let mut rig = Rig::new();
    rig.started();
    rig.background_child("tu-a", "task-a");
    rig.background_child("tu-b", "task-b");
    let (a, at) = child("tu-a");
    let (b, bt) = child("tu-b");
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-a","agentSessionId":a,"turnId":at}));
    let stop = rig.last_native("stopTask");
    assert_eq!(stop["taskId"], "task-a");
    assert_eq!(
        rig.native.iter().filter(|c| c["op"] == "interrupt").count(),
        0,
        "no root interrupt"
    );
    let out = rig.ack("stopTask", true);
    assert!(
        matches!(&out.answers[..], [RuntimeAnswer::CancelResult { acked, .. }] if acked.len() == 1 && acked[0].turn_id.as_ref() == at)
    );
    assert_eq!(rig.turn(&a, &at).outcome(), Some(Outcome::Canceled));
    assert!(rig.turn(&b, &bt).phase().is_active());
    assert!(rig.root().phase().is_active());
    rig.assert_clean();
}

#[test]
fn child_only_cancel_of_an_unknown_or_terminal_task_is_not_confirmed_and_not_an_error() {
    // A child whose task already ended (the engine still had it active): no stopTask.
    let mut a = ClaudeAdapter::new(R.into(), ClaudeConfig::default());
    let (cs, ct) = child("tu-1");
    let out = a.on_request(
        0,
        &ProviderRequest::Cancel {
            operation_id: "op-x".into(),
            root_agent_session_id: R.into(),
            targets: vec![tutti_core::model::Target {
                agent_session_id: cs.as_str().into(),
                turn_id: ct.as_str().into(),
            }],
        },
    );
    assert!(out.native.is_empty());
    assert!(
        matches!(&out.answers[..], [RuntimeAnswer::CancelResult { acked, .. }] if acked.is_empty())
    );

    let mut rig = Rig::new();
    rig.started();
    rig.background_child("tu-1", "task-1");
    let (cs, ct) = child("tu-1");
    // The adapter saw the terminal; the engine's cancel races it.
    let out = rig.unit(|a, now| a.on_native(now, &json!({"kind":"message","message":{"type":"system","subtype":"task_notification","task_id":"task-1","tool_use_id":"tu-1","status":"completed"}})))
        .unwrap();
    assert!(out.events.iter().any(|e| e.kind() == "turnTerminal"));
    let out = rig.unit(|a, now| {
        a.on_request(
            now,
            &ProviderRequest::Cancel {
                operation_id: "op-y".into(),
                root_agent_session_id: R.into(),
                targets: vec![tutti_core::model::Target {
                    agent_session_id: cs.as_str().into(),
                    turn_id: ct.as_str().into(),
                }],
            },
        )
    });
    assert!(out.native.is_empty(), "terminal task: idempotent no-op");
    assert!(
        matches!(&out.answers[..], [RuntimeAnswer::CancelResult { acked, .. }] if acked.is_empty())
    );
}

#[test]
fn child_only_cancel_before_task_started_stops_as_soon_as_the_task_is_known() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", true);
    let (cs, ct) = child("tu-1");
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":cs,"turnId":ct}));
    assert_eq!(
        rig.native.iter().filter(|c| c["op"] == "stopTask").count(),
        0
    );
    let out = rig.task_started("task-1", "tu-1", true);
    assert!(out.events.is_empty(), "closed child");
    assert_eq!(out.native[0]["op"], "stopTask");
    assert_eq!(out.native[0]["taskId"], "task-1");
    rig.ack("stopTask", true);
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Canceled));
    rig.assert_clean();
}

#[test]
fn closed_child_fallout_emits_nothing() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", false);
    rig.task_started("task-1", "tu-1", false);
    let (cs, ct) = child("tu-1");
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":cs,"turnId":ct}));
    rig.ack("stopTask", true);
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Canceled));
    let fallout = [
        json!({"kind":"message","message":{"type":"system","subtype":"task_updated","task_id":"task-1","patch":{"status":"killed"}}}),
        json!({"kind":"message","message":{"type":"system","subtype":"task_notification","task_id":"task-1","tool_use_id":"tu-1","status":"stopped"}}),
        json!({"kind":"hook","event":"PostToolUseFailure","toolUseID":"tu-1","input":{"tool_name":"Agent","tool_use_id":"tu-1","error":"user_interrupt","is_interrupt":true}}),
        json!({"kind":"message","message":{"type":"user","parent_tool_use_id":null,"uuid":"r",
            "message":{"role":"user","content":[{"type":"tool_result","tool_use_id":"tu-1","is_error":true,"content":"interrupted"}]}}}),
        json!({"kind":"message","message":{"type":"user","parent_tool_use_id":"tu-1","agent_id":"task-1","uuid":"i",
            "message":{"role":"user","content":[{"type":"text","text":"[Request interrupted by user]"}]}}}),
        json!({"kind":"canUseTool","requestId":"late","toolName":"Bash","input":{},"toolUseID":null,"agentID":"task-1","options":{}}),
    ];
    for line in fallout {
        let out = rig.line(line.clone());
        assert!(out.events.is_empty(), "{line}: {:?}", out.events);
    }
    assert_eq!(
        rig.turn(&cs, &ct).outcome(),
        Some(Outcome::Canceled),
        "never relabeled failed"
    );
    assert!(rig.root().phase().is_active(), "the root keeps running");
    rig.assert_clean();
}

#[test]
fn sending_cancel_is_not_a_terminal_fact() {
    let mut rig = Rig::new();
    let (cs, ct) = rig.waiting_on_background_child();
    let before = rig.events.len();
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":R,"turnId":T1}));
    assert_eq!(rig.events.len(), before, "no event on send");
    assert!(rig.answers.is_empty());
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Settling);
    assert_eq!(rig.root().phase(), Phase::Settling);
    rig.assert_clean();
}

#[test]
fn refused_cancel_ack_is_not_confirmation() {
    // Root interrupt refused: nothing is confirmed.
    let mut rig = Rig::new();
    let (cs, ct) = rig.waiting_on_background_child();
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":R,"turnId":T1}));
    let out = rig.ack("interrupt", false);
    assert!(
        matches!(&out.answers[..], [RuntimeAnswer::CancelResult { acked, .. }] if acked.is_empty())
    );
    assert_eq!(
        rig.root().outcome(),
        Some(Outcome::Canceled),
        "the user's intent"
    );
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Interrupted));
    rig.assert_clean();

    // stopTask refused: the child is not confirmed.
    let mut rig = Rig::new();
    let (cs, ct) = rig.waiting_on_background_child();
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-2","agentSessionId":cs,"turnId":ct}));
    let out = rig.ack("stopTask", false);
    assert!(
        matches!(&out.answers[..], [RuntimeAnswer::CancelResult { acked, .. }] if acked.is_empty())
    );
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Interrupted));
    assert_eq!(
        rig.root().outcome(),
        Some(Outcome::Completed),
        "retained outcome applies"
    );
    rig.assert_clean();
}

#[test]
fn unanswered_cancel_times_out_with_the_acknowledged_subset() {
    let mut rig = Rig::with(ClaudeConfig {
        cancel_timeout_ms: 100,
        ..ClaudeConfig::default()
    });
    rig.started();
    rig.background_child("tu-a", "task-a");
    let (a, at) = child("tu-a");
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":a,"turnId":at}));
    let timer = rig
        .timers
        .iter()
        .find(|t| t.id.contains("op-1"))
        .cloned()
        .expect("cancel timer");
    let out = rig.timer(&timer.id, timer.at);
    assert!(
        matches!(&out.answers[..], [RuntimeAnswer::CancelResult { acked, .. }] if acked.is_empty())
    );
    assert_eq!(rig.turn(&a, &at).outcome(), Some(Outcome::Interrupted));
    // A late ack changes nothing.
    assert!(rig.ack("stopTask", true).answers.is_empty());
    rig.assert_clean();
}

#[test]
fn query_exit_closes_open_root_provider_turns_and_children() {
    let mut rig = Rig::new();
    rig.started();
    rig.background_child("tu-1", "task-1");
    let (cs, ct) = child("tu-1");
    let out = rig.line(json!({"kind":"exited","error":"boom"}));
    let term = position(&out.events, |e| e.kind() == "turnTerminal");
    let done = position(&out.events, |e| e.kind() == "rootProviderTurnCompleted");
    assert!(term < done);
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Interrupted));
    assert_eq!(rig.root().outcome(), Some(Outcome::Failed));
    assert!(
        out.timers.is_empty(),
        "no continuation after the query ended"
    );
    rig.submit("turn-2");
    assert_eq!(rig.native.iter().filter(|c| c["op"] == "start").count(), 2);
    rig.assert_clean();
}

#[test]
fn garbage_lines_are_adapter_errors_and_change_nothing() {
    let mut rig = Rig::new();
    rig.started();
    rig.background_child("tu-1", "task-1");
    let before = rig.adapter().clone();
    let snapshot = rig.engine().snapshot(R);
    let garbage = [
        json!(null),
        json!(42),
        json!("message"),
        json!([1, 2]),
        json!({}),
        json!({"kind": 7}),
        json!({"kind": "bogus"}),
        json!({"kind": "message"}),
        json!({"kind": "message", "message": "text"}),
        json!({"kind": "message", "message": {}}),
        json!({"kind": "message", "message": {"type": 1}}),
        json!({"kind": "message", "message": {"type": "system"}}),
        json!({"kind": "message", "message": {"type": "system", "subtype": "task_started"}}),
        json!({"kind": "message", "message": {"type": "system", "subtype": "task_notification", "task_id": "task-1"}}),
        json!({"kind": "message", "message": {"type": "system", "subtype": "task_updated"}}),
        json!({"kind": "message", "message": {"type": "assistant"}}),
        json!({"kind": "message", "message": {"type": "assistant", "message": {"content": 5}}}),
        json!({"kind": "message", "message": {"type": "user", "message": {"content": [], }, "parent_tool_use_id": 9}}),
        json!({"kind": "message", "message": {"type": "stream_event"}}),
        json!({"kind": "message", "message": {"type": "result"}}),
        json!({"kind": "message", "message": {"type": "active_goal"}}),
        json!({"kind": "canUseTool"}),
        json!({"kind": "canUseToolCancelled"}),
        json!({"kind": "hook"}),
        json!({"kind": "hook", "event": "PreToolUse", "input": "x"}),
        json!({"kind": "ack"}),
        json!({"kind": "ack", "ok": "yes"}),
    ];
    for g in garbage {
        let r = rig.unit(|a, now| a.on_native(now, &g));
        assert!(
            matches!(
                r,
                Err(AdapterError::Malformed(_) | AdapterError::MissingField { .. })
            ),
            "{g} -> {r:?}"
        );
        assert_eq!(*rig.adapter(), before, "state changed by {g}");
    }
    assert!(tutti_core::adapters::parse_line("{not json").is_err());
    assert_eq!(rig.engine().snapshot(R), snapshot);
    // Unknown but well-formed SDK messages are accepted and project nothing.
    let out = rig.msg(json!({"type":"rate_limit_event","uuid":"x"}));
    assert!(out.events.is_empty());
    rig.assert_clean();
}

// ===== golden tests from captured transcripts ===================================================

/// Drives the rig with a captured transcript: submits turn-1, acknowledges `start`, then feeds
/// lines `range`.
fn feed(rig: &mut Rig, lines: &[Value], range: std::ops::Range<usize>) {
    for l in &lines[range] {
        rig.line(l.clone());
    }
}

fn golden_start() -> Rig {
    let mut rig = Rig::new();
    rig.submit(T1);
    rig.ack("start", true);
    rig
}

fn assert_foreground_tree(rig: &Rig, tool_use: &str, task: &str) {
    let (cs, ct) = child(tool_use);
    assert_eq!(count(&rig.events, "childSessionCreated"), 1);
    let s = rig.engine().session(&cs).expect("child").clone();
    assert_eq!(s.title.as_deref(), Some("Mock child task"));
    assert_eq!(s.parent_agent_session_id().map(|x| &**x), Some(R));
    assert_eq!(s.parent_tool_call_id().map(|x| &**x), Some(tool_use));
    assert_eq!(s.provider_aliases.task_id.as_deref(), Some(task));
    assert_eq!(s.provider_aliases.agent_id.as_deref(), Some(task));
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Completed));
    let root = rig.root();
    assert_eq!(root.outcome(), Some(Outcome::Completed));
    assert_eq!(
        root.root_provider_turn()
            .as_ref()
            .unwrap()
            .provider_turn_id
            .as_deref(),
        Some("claude-1")
    );
    let launch = rig
        .engine()
        .tool_call(R, tool_use)
        .expect("launch on the root")
        .clone();
    assert_eq!(
        (launch.turn_id.as_ref(), &*launch.status),
        (T1, "completed")
    );
    let snap = rig.engine().snapshot(R).unwrap();
    assert!(
        snap.message_ids.iter().any(|(s, _)| s.as_ref() == cs),
        "child transcript on the child"
    );
    assert_eq!(
        snap.turns
            .iter()
            .filter(|t| t.agent_session_id.as_ref() == R)
            .count(),
        1
    );
    rig.assert_clean();
}

#[test]
fn golden_fg_fwd_foreground_child_settles_before_root_completes() {
    let lines = transcript("fg_fwd");
    let (tu, task) = (agent_tool_use(&lines), task_id(&lines));
    let mut rig = golden_start();
    // The child exists from the parent tool use (line 1), before task_started (line 3).
    feed(&mut rig, &lines, 0..2);
    let (cs, ct) = child(&tu);
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Submitted);
    feed(&mut rig, &lines, 2..lines.len());
    assert_foreground_tree(&rig, &tu, &task);
}

#[test]
fn golden_fg_partial_partial_stream_creates_child_then_title_merges() {
    let lines = transcript("fg_partial");
    let (tu, task) = (agent_tool_use(&lines), task_id(&lines));
    let mut rig = golden_start();
    // Line 3: the partial content_block_start of the Agent tool use.
    feed(&mut rig, &lines, 0..4);
    let (cs, ct) = child(&tu);
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Submitted);
    assert_eq!(
        rig.engine().session(&cs).unwrap().title.as_deref(),
        Some("Agent")
    );
    feed(&mut rig, &lines, 4..6);
    assert_eq!(
        rig.engine().session(&cs).unwrap().title.as_deref(),
        Some("Mock child task")
    );
    feed(&mut rig, &lines, 6..lines.len());
    assert_foreground_tree(&rig, &tu, &task);
}

#[test]
fn golden_fg_childtool_child_permission_is_answered_through_the_engine() {
    let lines = transcript("fg_childtool");
    let (tu, task) = (agent_tool_use(&lines), task_id(&lines));
    let ask = lines
        .iter()
        .position(|l| l["kind"] == "canUseTool")
        .expect("a canUseTool row");
    let request = lines[ask]["requestId"].as_str().unwrap().to_string();
    let mut rig = golden_start();
    feed(&mut rig, &lines, 0..ask + 1);
    let (cs, ct) = child(&tu);
    let pending = rig.engine().pending_interactions(R);
    assert_eq!(pending.len(), 1);
    assert_eq!(
        (
            pending[0].agent_session_id.as_ref(),
            pending[0].turn_id.as_ref()
        ),
        (cs.as_str(), ct.as_str())
    );
    assert_eq!(pending[0].request_id.as_ref(), request);
    assert_eq!(pending[0].provider_turn_id.as_deref(), Some("claude-1"));
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Waiting);
    assert!(rig.root().phase().is_active());
    rig.cmd(json!({"type":"respondInteraction","agentSessionId":cs,"turnId":ct,"requestId":request,"response":"allow"}));
    let cmd = rig.last_native("permission");
    assert_eq!(cmd["requestId"], request.as_str());
    assert_eq!(cmd["behavior"], "allow");
    rig.ack("permission", true);
    assert_eq!(rig.turn(&cs, &ct).phase(), Phase::Running);
    feed(&mut rig, &lines, ask + 1..lines.len());
    assert_foreground_tree(&rig, &tu, &task);
    let snap = rig.engine().snapshot(R).unwrap();
    assert_eq!(snap.interactions[0].status, InteractionStatus::Resolved);
    let write = snap
        .tool_calls
        .iter()
        .find(|c| c.name.as_deref() == Some("Write"))
        .expect("child tool");
    assert_eq!(
        (write.agent_session_id.as_ref(), &*write.status),
        (cs.as_str(), "completed")
    );
}

#[test]
fn golden_bg_oneshot_background_child_outlives_root_result_and_root_waits() {
    let lines = transcript("bg_oneshot");
    let tu = agent_tool_use(&lines);
    let results: Vec<usize> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l["message"]["type"] == "result")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(results.len(), 2);
    let updated = lines
        .iter()
        .position(|l| l["message"]["subtype"] == "task_updated")
        .unwrap();
    let mut rig = golden_start();
    feed(&mut rig, &lines, 0..results[0] + 1);
    let (cs, ct) = child(&tu);
    let root = rig.root();
    assert_eq!(
        root.phase(),
        Phase::Waiting,
        "root provider done, child still running"
    );
    assert_eq!(
        root.root_provider_turn().unwrap().phase(),
        ProviderPhase::Completed
    );
    assert!(rig.turn(&cs, &ct).phase().is_active());
    feed(&mut rig, &lines, results[0] + 1..updated);
    let before = rig.events.len();
    feed(&mut rig, &lines, updated..updated + 1);
    let step = &rig.events[before..];
    let start = position(step, |e| e.kind() == "rootProviderTurnStarted");
    let term = position(step, |e| e.kind() == "turnTerminal");
    assert!(
        start < term,
        "the synthetic turn opens before the child terminal"
    );
    assert_eq!(
        rig.root().phase(),
        Phase::Running,
        "the gate keeps the root open"
    );
    let timer = rig.timers.last().cloned().expect("continuation timer");
    feed(&mut rig, &lines, updated + 1..results[1]);
    assert!(
        rig.root().phase().is_active(),
        "the automatic follow-up stays on the same root turn"
    );
    assert!(
        rig.timer(&timer.id, timer.at).events.is_empty(),
        "disarmed by root output"
    );
    feed(&mut rig, &lines, results[1]..lines.len());
    let root = rig.root();
    assert_eq!(root.outcome(), Some(Outcome::Completed));
    assert_eq!(
        root.root_provider_turn()
            .as_ref()
            .unwrap()
            .provider_turn_id
            .as_deref(),
        Some("synthetic-1")
    );
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Completed));
    let snap = rig.engine().snapshot(R).unwrap();
    assert_eq!(
        snap.turns
            .iter()
            .filter(|t| t.agent_session_id.as_ref() == R)
            .count(),
        1
    );
    rig.assert_clean();
}

#[test]
fn golden_bg_stream_stop_child_only_cancel_uses_stop_task() {
    let lines = transcript("bg_stream_stop");
    let (tu, task) = (agent_tool_use(&lines), task_id(&lines));
    let first_result = lines
        .iter()
        .position(|l| l["message"]["type"] == "result")
        .unwrap();
    let mut rig = golden_start();
    feed(&mut rig, &lines, 0..first_result + 1);
    let (cs, ct) = child(&tu);
    assert_eq!(rig.root().phase(), Phase::Waiting);
    let before = rig.events.len();
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-stop","agentSessionId":cs,"turnId":ct}));
    assert_eq!(
        rig.events.len(),
        before,
        "sending cancel is not a terminal fact"
    );
    let stop = rig.last_native("stopTask");
    assert_eq!(stop["taskId"], task.as_str());
    assert_eq!(
        rig.native.iter().filter(|c| c["op"] == "interrupt").count(),
        0
    );
    // task_updated(killed), then the stopTask ack, then the rest of the fallout.
    feed(&mut rig, &lines, first_result + 1..first_result + 2);
    rig.ack("stopTask", true);
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Canceled));
    assert_eq!(
        rig.root().outcome(),
        Some(Outcome::Completed),
        "settles from the retained outcome"
    );
    let op = rig.engine().cancel_operation("op-stop").unwrap().clone();
    assert_eq!(op.acked.len(), 1);
    let mark = rig.events.len();
    feed(&mut rig, &lines, first_result + 2..lines.len());
    assert!(
        rig.events[mark..]
            .iter()
            .all(|e| e.agent_session_id().as_ref() != cs),
        "no child fallout: {:?}",
        &rig.events[mark..]
    );
    assert_eq!(count(&rig.events[mark..], "turnTerminal"), 0);
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Canceled));
    assert_eq!(rig.root().outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

#[test]
fn golden_bg_stream_interrupt_root_cancel_uses_interrupt() {
    let lines = transcript("bg_stream_interrupt");
    let tu = agent_tool_use(&lines);
    let first_result = lines
        .iter()
        .position(|l| l["message"]["type"] == "result")
        .unwrap();
    let mut rig = golden_start();
    feed(&mut rig, &lines, 0..first_result + 1);
    let (cs, ct) = child(&tu);
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-int","agentSessionId":R,"turnId":T1}));
    assert_eq!(rig.last_native("interrupt")["op"], "interrupt");
    assert_eq!(
        rig.native.iter().filter(|c| c["op"] == "stopTask").count(),
        0
    );
    let mark = rig.events.len();
    feed(&mut rig, &lines, first_result + 1..lines.len() - 1);
    rig.ack("interrupt", true);
    feed(&mut rig, &lines, lines.len() - 1..lines.len());
    assert!(
        rig.events[mark..].is_empty(),
        "no fallout: {:?}",
        &rig.events[mark..]
    );
    assert_eq!(rig.root().outcome(), Some(Outcome::Canceled));
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Canceled));
    let op = rig.engine().cancel_operation("op-int").unwrap().clone();
    assert_eq!(
        op.acked.len(),
        2,
        "the interrupt covers the root and its Task executions"
    );
    rig.assert_clean();
}

#[test]
fn replay_transcript_replays_every_captured_log_without_rejections() {
    let expect = [
        ("fg_fwd", Outcome::Completed, "claude-1"),
        ("fg_partial", Outcome::Completed, "claude-1"),
        ("fg_childtool", Outcome::Completed, "claude-1"),
        ("bg_oneshot", Outcome::Completed, "synthetic-1"),
        ("bg_stream_stop", Outcome::Interrupted, "claude-1"),
        ("bg_stream_interrupt", Outcome::Interrupted, "claude-1"),
    ];
    for (name, child_outcome, provider_turn) in expect {
        let out = replay_transcript(raw_transcript(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            !out.diagnostics
                .iter()
                .any(|d| d.starts_with("engine rejected") || d.starts_with("line ")),
            "{name}: {:?}",
            out.diagnostics
        );
        let snap = &out.snapshot;
        assert!(
            check_tree(snap).is_empty(),
            "{name}: {:?}",
            check_tree(snap)
        );
        let root = snap
            .turns
            .iter()
            .find(|t| t.id.as_ref() == "turn-1")
            .expect("root turn");
        assert_eq!(root.outcome(), Some(Outcome::Completed), "{name}");
        assert_eq!(
            root.root_provider_turn()
                .as_ref()
                .unwrap()
                .provider_turn_id
                .as_deref(),
            Some(provider_turn),
            "{name}"
        );
        let children: Vec<_> = snap.sessions.iter().filter(|s| s.is_child()).collect();
        assert_eq!(children.len(), 1, "{name}");
        let ct = snap
            .turns
            .iter()
            .find(|t| t.agent_session_id == children[0].id)
            .expect("child turn");
        assert_eq!(ct.outcome(), Some(child_outcome), "{name}");
        assert_eq!(count(&out.events, "childSessionCreated"), 1, "{name}");
        assert_eq!(out.native[0]["op"], "start");
        // Serializable for the CLI.
        let v = serde_json::to_value(&out).unwrap();
        assert!(v["events"].is_array() && v["snapshot"]["turns"].is_array());
    }
}

#[test]
fn replay_transcript_reports_non_json_lines_and_records_refused_rows() {
    assert!(replay_transcript("{\"type\":\"system\"\nnot json").is_err());
    let out = replay_transcript("{\"type\":\"system\"}\n{\"foo\":1}\n").unwrap();
    assert!(out.diagnostics.iter().any(|d| d.starts_with("line 1")));
    assert!(out.diagnostics.iter().any(|d| d.starts_with("line 2")));
    let root = out
        .snapshot
        .turns
        .iter()
        .find(|t| t.id.as_ref() == "turn-1")
        .unwrap();
    assert!(root.phase().is_active());
}

#[test]
fn root_cancel_interrupt_also_covers_a_child_whose_own_cancel_is_still_in_flight() {
    let mut rig = Rig::new();
    rig.started();
    rig.background_child("tu-a", "task-a");
    rig.background_child("tu-b", "task-b");
    rig.result();
    let (a, at) = child("tu-a");
    let (b, bt) = child("tu-b");
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-a","agentSessionId":a,"turnId":at}));
    let stop = rig.last_native("stopTask");
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-root","agentSessionId":R,"turnId":T1}));
    let out = rig.ack("interrupt", true);
    match &out.answers[..] {
        [RuntimeAnswer::CancelResult {
            operation_id,
            acked,
        }] => {
            assert_eq!(operation_id.as_ref(), "op-root");
            assert_eq!(
                acked.len(),
                3,
                "root, the taken-over child and its sibling: {acked:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(rig.turn(&a, &at).outcome(), Some(Outcome::Canceled));
    assert_eq!(rig.turn(&b, &bt).outcome(), Some(Outcome::Canceled));
    assert_eq!(rig.root().outcome(), Some(Outcome::Canceled));
    // The earlier stopTask's late ack is harmless.
    rig.line(json!({"kind":"ack","op":"stopTask","ok":true,"id":stop["id"]}));
    assert_eq!(rig.root().outcome(), Some(Outcome::Canceled));
    rig.assert_clean();
}

#[test]
fn child_completion_also_comes_from_a_child_result_or_a_tool_failed_hook() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", false);
    rig.agent(None, "tu-2", false);
    let (c1, t1) = child("tu-1");
    let (c2, t2) = child("tu-2");
    let mut m = json!({"type":"result","subtype":"success","is_error":false,"uuid":"cr"});
    ptu(&mut m, Some("tu-1"));
    rig.msg(m);
    assert_eq!(rig.turn(&c1, &t1).outcome(), Some(Outcome::Completed));
    rig.line(
        json!({"kind":"hook","event":"PostToolUseFailure","toolUseID":"tu-2",
        "input":{"tool_name":"Agent","tool_use_id":"tu-2","error":"agent crashed"}}),
    );
    let t = rig.turn(&c2, &t2);
    assert_eq!(t.outcome(), Some(Outcome::Failed));
    assert_eq!(t.error(), Some("agent crashed"));
    assert_eq!(
        &*rig.engine().tool_call(R, "tu-2").unwrap().status,
        "failed"
    );
    // "A failed child turn does not automatically fail the root turn."
    rig.result();
    assert_eq!(rig.root().outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

/// Every captured line with one field removed or retyped (at the line, message and inner message
/// level): the adapter either refuses it or accepts it, never panics, and the engine's invariants
/// hold after every step.
#[test]
fn mutated_transcript_lines_never_panic_or_break_invariants() {
    fn variants(v: &Value) -> Vec<Value> {
        let mut out = Vec::new();
        let paths: [&[&str]; 3] = [&[], &["message"], &["message", "message"]];
        for path in paths {
            let mut node = v;
            for p in path {
                node = &node[*p];
            }
            let Some(obj) = node.as_object() else {
                continue;
            };
            for key in obj.keys() {
                for replacement in [
                    None,
                    Some(json!(null)),
                    Some(json!(7)),
                    Some(json!("x")),
                    Some(json!([])),
                ] {
                    let mut copy = v.clone();
                    let mut target = &mut copy;
                    for p in path {
                        target = &mut target[*p];
                    }
                    if let Some(o) = target.as_object_mut() {
                        match &replacement {
                            None => {
                                o.remove(key);
                            }
                            Some(r) => {
                                o.insert(key.clone(), r.clone());
                            }
                        }
                    }
                    out.push(copy);
                }
            }
        }
        out
    }
    for name in ["fg_childtool", "bg_oneshot", "bg_stream_stop"] {
        let lines = transcript(name);
        let mut rig = golden_start();
        for line in &lines {
            for v in variants(line) {
                // A variant the adapter refuses is a typed error and changes nothing.
                let _ = rig.try_line(&v);
            }
            let _ = rig.try_line(line);
        }
        let v = rig.engine().check_invariants();
        assert!(v.is_empty(), "{name}: {v:?}");
    }
}

// ----- root provider facts belong to the provider turn they name (issue 18) -----------------

/// "Root provider facts belong to the provider turn they name": after the user stops the last
/// child, Claude's own follow-up turn (the SDK reacting to the stop, not reserved by the
/// adapter) overlaps the user's next submit. Every root provider event names its canonical turn,
/// so the follow-up's start and terminal stay with the settled turn-1 and never settle turn-2,
/// which settles only from its own provider turn.
#[test]
fn claude_follow_up_after_a_stop_overlapping_the_next_submit_never_settles_the_next_turn() {
    let mut rig = Rig::new();
    let (c, ct) = rig.waiting_on_background_child();
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-c","agentSessionId":c,"turnId":ct}));
    rig.ack("stopTask", true);
    rig.notification("task-1", "tu-1", "stopped");
    assert_eq!(rig.turn(&c, &ct).outcome(), Some(Outcome::Canceled));
    assert_eq!(rig.root().outcome(), Some(Outcome::Completed));
    // The SDK's own follow-up turn begins: a provider turn of turn-1.
    let out = rig.text(None, "the task was stopped");
    let started: Vec<_> = out
        .events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::RootProviderTurnStarted {
                turn_id,
                provider_turn_id,
                ..
            } => Some((turn_id.clone(), provider_turn_id.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        started,
        [(Some(Id::from(T1)), Some("claude-2".to_string()))],
        "the follow-up names turn-1"
    );
    // The user's next submit overlaps it.
    rig.submit("turn-2");
    let t2 = rig.turn(R, "turn-2");
    assert_eq!(t2.phase(), Phase::Running);
    let rpt = t2.root_provider_turn().cloned().unwrap_or_default();
    assert_eq!(rpt.provider_turn_id.as_deref(), Some("claude-3"));
    // The follow-up's terminal completes the follow-up, on turn-1, not turn-2.
    let out = rig.result();
    assert!(
        out.events.iter().all(|e| match e {
            NormalizedEvent::RootProviderTurnCompleted {
                turn_id,
                provider_turn_id,
                ..
            } => turn_id.as_deref() == Some(T1) && provider_turn_id.as_deref() == Some("claude-2"),
            _ => true,
        }),
        "{:?}",
        out.events
    );
    let t2 = rig.turn(R, "turn-2");
    assert_eq!(t2.phase(), Phase::Running, "turn-2 keeps running");
    assert_eq!(t2.outcome(), None);
    assert_eq!(
        t2.root_provider_turn().map(|r| r.phase()),
        Some(ProviderPhase::Running)
    );
    assert_eq!(rig.root().outcome(), Some(Outcome::Completed));
    // turn-2's own provider turn settles it.
    rig.text(None, "second");
    rig.result();
    assert_eq!(rig.turn(R, "turn-2").outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

// ===== background children finishing together (real SDK 0.3.332 captures) ======================
//
// Captured with `tests/tests/claude_smoke.rs` in capture mode (see
// `capture_two_background_children_finishing_together`): the root launches two background
// `Agent` children whose replies take the same time, so both task notifications reach the SDK
// within a few ms. The SDK then answers with two real follow-ups (`bg_two_together*`), or with an
// empty one (`num_turns: 0`, no model call) followed by one real one (`*_empty`); `*_guided*`
// had a guidance `input` appended while the children ran, and `bg_two_during_guidance` had both
// notifications delivered while the guidance turn itself still ran.

/// A "children finish together" capture as sidecar lines; `{"kind":"__input"}` marks where the
/// guidance was sent.
fn together(name: &str) -> Vec<Value> {
    raw_transcript(name)
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| {
            let v: Value = serde_json::from_str(l).expect("captured line is JSON");
            if v.get("__input").is_some() {
                return json!({"kind": "__input"});
            }
            sidecar_line(&v, n + 1).expect("a captured Claude row")
        })
        .collect()
}

fn is_result(l: &Value) -> bool {
    l["kind"] == "message" && l["message"]["type"] == "result"
}

fn is_follow_up(l: &Value) -> bool {
    is_result(l) && l["message"]["origin"]["kind"] == "task-notification"
}

/// Root-scoped assistant texts of a capture (in order).
fn root_texts(lines: &[Value]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| {
            l["message"]["type"] == "assistant" && l["message"]["parent_tool_use_id"].is_null()
        })
        .flat_map(|l| {
            l["message"]["message"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|b| b["text"].as_str().map(String::from))
        .collect()
}

/// Feeds `lines[range]`; at an `__input` row submits guidance (`turn-x`) as the daemon would and
/// acknowledges its `input`.
fn feed_together(rig: &mut Rig, name: &str, lines: &[Value], range: std::ops::Range<usize>) {
    for l in &lines[range] {
        if l["kind"] == "__input" {
            let step = rig.submit("turn-x");
            assert!(
                matches!(step.provider.first(), Some(ProviderRequest::Guide { .. })),
                "{name}: the guidance is appended to the active root turn"
            );
            rig.ack("input", true);
            continue;
        }
        rig.line(l.clone());
    }
}

/// The whole capture; asserts the root stays active until the last `result` and settles
/// completed with it, with every follow-up reply a message of the one root turn.
fn assert_together(name: &str) -> Rig {
    let lines = together(name);
    let last = lines.iter().rposition(is_result).expect("a result");
    assert!(
        lines.iter().filter(|l| is_follow_up(l)).count() >= 2,
        "{name}: the SDK answered with more than one follow-up"
    );
    let mut rig = golden_start();
    for i in 0..lines.len() {
        feed_together(&mut rig, name, &lines, i..i + 1);
        if i < last {
            assert!(
                rig.root().phase().is_active(),
                "{name}: the root settled at line {i}, before the last follow-up's result\n{:#?}",
                rig.diagnostics
            );
        }
    }
    let root = rig.root();
    assert_eq!(root.outcome(), Some(Outcome::Completed), "{name}");
    assert_eq!(
        root.root_provider_turn().unwrap().phase(),
        ProviderPhase::Completed
    );
    // One canonical root turn; guidance never became another.
    let snap = rig.engine().snapshot(R).unwrap();
    assert_eq!(
        snap.turns
            .iter()
            .filter(|t| t.agent_session_id.as_ref() == R)
            .count(),
        1,
        "{name}"
    );
    assert!(rig.engine().turn(R, "turn-x").is_none(), "{name}");
    // Every follow-up reply is a message of that root turn, and the engine took each of them.
    let follow_texts: Vec<String> = root_texts(&lines)
        .into_iter()
        .filter(|t| t.starts_with("ROOT_FOLLOWUP"))
        .collect();
    assert!(!follow_texts.is_empty(), "{name}");
    for text in &follow_texts {
        assert!(
            rig.events.iter().any(|e| matches!(e,
                NormalizedEvent::MessageAppended { agent_session_id, turn_id, text: t, .. }
                if agent_session_id.as_ref() == R && turn_id.as_ref() == T1 && &**t == text)),
            "{name}: {text} is not a message of the root turn"
        );
    }
    assert!(
        !rig.ignored.iter().any(|i| i.starts_with("messageAppended")),
        "{name}: the engine ignored messages: {:?}",
        rig.ignored
    );
    // Both children completed on their own turns.
    let kids: Vec<_> = snap.sessions.iter().filter(|s| s.is_child()).collect();
    assert_eq!(kids.len(), 2, "{name}");
    for k in kids {
        let t = snap
            .turns
            .iter()
            .find(|t| t.agent_session_id == k.id)
            .unwrap();
        assert_eq!(t.outcome(), Some(Outcome::Completed), "{name}");
    }
    assert_eq!(rig.adapter().outstanding_notifications(), 0, "{name}");
    assert!(rig.adapter().live_provider_turn().is_none(), "{name}");
    rig.assert_clean();
    rig
}

#[test]
fn two_children_finishing_together_both_follow_ups_are_messages_of_the_one_root_turn() {
    let rig = assert_together("bg_two_together");
    // Both follow-ups joined one held root provider turn, completed once at the end.
    assert_eq!(
        count(&rig.events, "rootProviderTurnCompleted"),
        2,
        "launch + follow-ups"
    );
}

#[test]
fn two_children_finishing_together_an_empty_follow_up_does_not_settle_the_root() {
    let lines = together("bg_two_together_empty");
    let empty = lines
        .iter()
        .position(|l| is_follow_up(l) && l["message"]["num_turns"] == 0)
        .expect("the capture has an empty follow-up");
    assert!(
        lines[empty + 1..].iter().any(is_follow_up),
        "a real follow-up comes after the empty one"
    );
    assert_together("bg_two_together_empty");
}

#[test]
fn two_children_finishing_together_after_guidance_keep_both_follow_ups_on_the_root_turn() {
    for name in ["bg_two_together_guided", "bg_two_together_guided_empty"] {
        let rig = assert_together(name);
        assert!(
            rig.events.iter().any(|e| matches!(e,
                NormalizedEvent::MessageAppended { turn_id, text, .. }
                if turn_id.as_ref() == T1 && text.starts_with("ROOT_GUIDED"))),
            "{name}: the guidance reply is on the root turn"
        );
    }
}

#[test]
fn notifications_delivered_during_a_guidance_turn_hold_the_root_until_their_follow_up() {
    let name = "bg_two_during_guidance";
    let lines = together(name);
    let guided = lines
        .iter()
        .position(|l| {
            is_result(l)
                && !is_follow_up(l)
                && l["message"]["result"]
                    .as_str()
                    .is_some_and(|r| r.starts_with("ROOT_GUIDED"))
        })
        .expect("the guidance turn's result");
    let mut rig = golden_start();
    feed_together(&mut rig, name, &lines, 0..guided + 1);
    assert_eq!(
        rig.adapter().outstanding_notifications(),
        2,
        "both notifications were delivered while the guidance turn ran"
    );
    assert!(
        rig.root().phase().is_active(),
        "held after the guidance result"
    );
    assert_together(name);
}

#[test]
fn a_follow_up_that_never_comes_ends_the_reservation_naming_the_outstanding_count() {
    let name = "bg_two_together";
    let lines = together(name);
    let first = lines.iter().position(is_follow_up).unwrap();
    let mut rig = golden_start();
    feed_together(&mut rig, name, &lines, 0..first + 1);
    assert!(rig.root().phase().is_active());
    assert_eq!(rig.adapter().outstanding_notifications(), 1);
    // The hold armed the 30 s bound again (the first follow-up had disarmed the first one).
    let timer = rig.timers.last().cloned().expect("the bound is armed");
    let out = rig.timer(&timer.id, timer.at);
    let error = out
        .events
        .iter()
        .find_map(|e| match e {
            NormalizedEvent::RootProviderTurnCompleted { outcome, error, .. } => {
                assert_eq!(*outcome, Outcome::Interrupted);
                error.clone()
            }
            _ => None,
        })
        .expect("the reservation ends");
    assert!(
        error.contains("timeout") && error.contains("1 task notification(s) outstanding"),
        "{error}"
    );
    assert!(out
        .diagnostics
        .iter()
        .any(|d| d.contains("1 task notification(s) outstanding")));
    assert_eq!(out.native[0]["op"], "interrupt");
    assert!(!rig.root().phase().is_active(), "the gate settles the root");
    let outcome = rig.root().outcome();
    // The late follow-up is stale: dropped, but logged with ids and counts.
    let before = rig.diagnostics.len();
    feed_together(&mut rig, name, &lines, first + 1..lines.len());
    let logged = rig.diagnostics[before..]
        .iter()
        .find(|d| d.contains("timed-out continuation") && d.contains("ended"))
        .unwrap_or_else(|| panic!("{:?}", &rig.diagnostics[before..]));
    assert!(logged.contains(T1) && logged.contains("run "), "{logged}");
    assert_eq!(rig.root().outcome(), outcome, "nothing reopens the root");
    rig.assert_clean();
}

#[test]
fn a_follow_up_after_the_root_settled_is_logged_with_ids_and_counts() {
    let mut rig = Rig::with(ClaudeConfig {
        continuation_timeout_ms: 50,
        ..ClaudeConfig::default()
    });
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    rig.timer(&timer.id, timer.at);
    assert!(!rig.root().phase().is_active());
    assert_eq!(rig.adapter().outstanding_notifications(), 0, "forgotten");
    // The stale continuation ends, then one more follow-up nothing reserved.
    rig.result_with_origin();
    let before = rig.diagnostics.len();
    rig.msg(init());
    rig.text(None, "late reply");
    rig.result_with_origin();
    let logged = rig.diagnostics[before..]
        .iter()
        .find(|d| d.contains("unreserved follow-up"))
        .unwrap_or_else(|| panic!("{:?}", &rig.diagnostics[before..]));
    assert!(
        logged.contains(T1) && logged.contains("1 root message(s)"),
        "{logged}"
    );
    assert!(!rig.root().phase().is_active(), "never reopened");
    rig.assert_clean();
}

#[test]
fn root_cancel_while_held_closes_the_held_provider_turn_as_canceled_at_once() {
    let name = "bg_two_together";
    let lines = together(name);
    let first = lines.iter().position(is_follow_up).unwrap();
    let mut rig = golden_start();
    feed_together(&mut rig, name, &lines, 0..first + 1);
    assert!(rig.adapter().live_provider_turn().is_some());
    let before = rig.events.len();
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":R,"turnId":T1}));
    assert_eq!(rig.adapter().outstanding_notifications(), 0);
    // Its SDK turn already ended: nothing is left for the interrupt to confirm.
    assert!(
        rig.adapter().live_provider_turn().is_none(),
        "the held turn is closed"
    );
    assert!(rig.events[before..].iter().any(|e| matches!(
        e,
        NormalizedEvent::RootProviderTurnCompleted {
            outcome: Outcome::Canceled,
            ..
        }
    )));
    // The interrupt's ack comes only after the cancel's deadline (as in the simulation's seed
    // 7259): the cancel answers unconfirmed; the root settles canceled all the same.
    let deadline = rig
        .timers
        .iter()
        .rfind(|t| t.id.starts_with("claude:cancel:"))
        .cloned()
        .expect("the cancel deadline");
    rig.timer(&deadline.id, deadline.at);
    rig.ack("interrupt", true);
    let root = rig.root();
    assert_eq!(root.outcome(), Some(Outcome::Canceled));
    assert_eq!(
        root.root_provider_turn().unwrap().phase(),
        ProviderPhase::Completed
    );
    // The second follow-up is output of the canceled root execution: nothing lands.
    let before = rig.events.len();
    feed_together(&mut rig, name, &lines, first + 1..lines.len());
    assert_eq!(count(&rig.events[before..], "messageAppended"), 0);
    assert_eq!(rig.root().outcome(), Some(Outcome::Canceled));
    // A new canonical turn gets its own output; no held turn sits in front of it.
    rig.submit("turn-2");
    rig.msg(init());
    rig.text(None, "answer to turn 2");
    rig.result();
    let t2 = rig.turn(R, "turn-2");
    assert_eq!(t2.outcome(), Some(Outcome::Completed));
    assert!(rig.events.iter().any(|e| matches!(e,
        NormalizedEvent::MessageAppended { turn_id, text, .. }
        if turn_id.as_ref() == "turn-2" && &**text == "answer to turn 2")));
    rig.assert_clean();
}

#[test]
fn notifications_folded_into_a_tool_round_of_the_running_turn_are_answered_by_its_result() {
    // The root's turn runs a foreground `Bash` round while both children finish: the SDK puts
    // both notifications into that turn's next model call and sends no follow-up.
    let name = "bg_two_during_tool_round";
    let lines = together(name);
    assert!(
        !lines.iter().any(is_follow_up),
        "no follow-up in this capture"
    );
    let last = lines.iter().rposition(is_result).unwrap();
    let mut rig = golden_start();
    // (The Bash permission the capture allowed is resolved by the tool's own result.)
    for i in 0..lines.len() {
        feed_together(&mut rig, name, &lines, i..i + 1);
        if i < last {
            assert!(rig.root().phase().is_active(), "line {i}");
        }
    }
    assert_eq!(rig.adapter().outstanding_notifications(), 0);
    assert!(rig.adapter().live_provider_turn().is_none(), "nothing held");
    let root = rig.root();
    assert_eq!(root.outcome(), Some(Outcome::Completed));
    assert!(
        rig.diagnostics
            .iter()
            .any(|d| d.contains("2 task notification(s) folded")),
        "{:?}",
        rig.diagnostics
    );
    assert!(rig.events.iter().any(|e| matches!(e,
        NormalizedEvent::MessageAppended { turn_id, text, .. }
        if turn_id.as_ref() == T1 && text.starts_with("ROOT_FOLLOWUP"))));
    rig.assert_clean();
}

// --- mutants: the Claude adapter's cancel and continuation code (25c) ---

/// "An `exited` line (the SDK query ended) ... The next `Start` sends `start` again": an
/// acknowledgement of the ended query's own `start` that arrives after the `exited` line does not
/// bring that query back, so the next root turn still starts a new query (with `start`, not
/// `input` into a query that no longer exists).
#[test]
fn a_late_start_ack_after_the_query_exited_does_not_revive_it() {
    let mut rig = Rig::new();
    rig.submit(T1);
    let start = rig.last_native("start");
    rig.line(json!({"kind":"exited"}));
    assert_eq!(rig.root().outcome(), Some(Outcome::Interrupted));
    rig.line(json!({"kind":"ack","op":"start","ok":true,"id":start["id"]}));
    rig.submit("turn-2");
    let ops: Vec<&Value> = rig.native.iter().map(|c| &c["op"]).collect();
    assert_eq!(ops, [&json!("start"), &json!("start")], "{ops:?}");
    rig.assert_clean();
}

/// "A target whose task is unknown or already terminal is an idempotent no-op: it is simply not
/// confirmed." A child-only cancel that waits for the child's task id (its `stopTask` is owed
/// until `task_started`) is answered as soon as that child ends without one: the target is not
/// confirmed (the engine settles it `interrupted`), no `stopTask` is sent, and the answer does
/// not wait for the cancel deadline.
#[test]
fn child_only_cancel_of_a_child_that_ends_before_its_task_is_known_is_answered_at_once() {
    let mut rig = Rig::new();
    rig.started();
    rig.agent(None, "tu-1", true);
    let (cs, ct) = child("tu-1");
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":cs,"turnId":ct}));
    assert!(rig.answers.is_empty(), "the stopTask is still owed");
    // The child's task ends before any task_started named it.
    let out = rig.notification("task-1", "tu-1", "completed");
    assert!(out.events.is_empty(), "closed child: {:?}", out.events);
    match &out.answers[..] {
        [RuntimeAnswer::CancelResult {
            operation_id,
            acked,
        }] => {
            assert_eq!(operation_id.as_ref(), "op-1");
            assert!(acked.is_empty(), "{acked:?}");
        }
        other => panic!("answered at once: {other:?}"),
    }
    assert_eq!(
        rig.native.iter().filter(|c| c["op"] == "stopTask").count(),
        0
    );
    assert_eq!(rig.turn(&cs, &ct).outcome(), Some(Outcome::Interrupted));
    assert!(rig.root().phase().is_active(), "the root keeps running");
    rig.assert_clean();
}

/// "An `ack` with `ok: false` ... confirms nothing": a refused root interrupt does not close the
/// canceled root's provider turn that has produced no output yet, as an acknowledged one does
/// ("provider turns of canceled roots that never produced output will not produce any"). Only
/// that SDK turn's own `result` closes it, `canceled`, once.
#[test]
fn a_refused_root_interrupt_closes_no_provider_turn() {
    let completions = |events: &[NormalizedEvent]| -> Vec<(String, Outcome)> {
        events
            .iter()
            .filter_map(|e| match e {
                NormalizedEvent::RootProviderTurnCompleted {
                    provider_turn_id,
                    outcome,
                    ..
                } => Some((provider_turn_id.clone().unwrap_or_default(), *outcome)),
                _ => None,
            })
            .collect()
    };
    let mut rig = Rig::new();
    rig.submit(T1);
    rig.ack("start", true);
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":R,"turnId":T1}));
    let before = rig.events.len();
    let out = rig.ack("interrupt", false);
    assert!(
        matches!(&out.answers[..], [RuntimeAnswer::CancelResult { acked, .. }] if acked.is_empty())
    );
    assert_eq!(
        rig.root().outcome(),
        Some(Outcome::Canceled),
        "the user's intent"
    );
    assert_eq!(
        completions(&rig.events[before..]),
        [],
        "nothing confirmed it"
    );
    // The SDK turn runs on and ends: its own result closes it.
    rig.msg(init());
    rig.result();
    assert_eq!(
        completions(&rig.events[before..]),
        [("claude-1".to_string(), Outcome::Canceled)]
    );
    rig.assert_clean();
}

/// "It cancels the reserved synthetic provider turn, disarms its timeout": a root cancel during
/// the notification wait disarms the continuation timer at once, so the timer firing before the
/// interrupt is acknowledged neither completes the reserved turn as a timeout nor sends a second
/// interrupt; the acknowledged interrupt then closes it `canceled`.
#[test]
fn root_cancel_disarms_the_continuation_timer_before_the_interrupt_is_acknowledged() {
    let mut rig = Rig::new();
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":R,"turnId":T1}));
    let interrupts = rig.native.iter().filter(|c| c["op"] == "interrupt").count();
    let out = rig.timer(&timer.id, timer.at);
    assert!(
        out.events.is_empty() && out.native.is_empty(),
        "disarmed by the cancel: {out:?}"
    );
    assert_eq!(
        rig.native.iter().filter(|c| c["op"] == "interrupt").count(),
        interrupts
    );
    let out = rig.ack("interrupt", true);
    assert!(
        matches!(&out.events[0], NormalizedEvent::RootProviderTurnCompleted { outcome: Outcome::Canceled, provider_turn_id: Some(p), .. } if p == "synthetic-1"),
        "{:?}",
        out.events
    );
    assert_eq!(rig.root().outcome(), Some(Outcome::Canceled));
    rig.assert_clean();
}

/// "The adapter logs it with ids and counts (`unreserved follow-up`)" only for a follow-up that
/// nothing reserved: the follow-up that answers the notification its reservation was opened for
/// is not logged as unreserved.
#[test]
fn a_reserved_follow_up_is_not_logged_as_unreserved() {
    let mut rig = Rig::new();
    rig.waiting_on_background_child();
    rig.notification("task-1", "tu-1", "completed");
    rig.msg(init());
    rig.text(None, "the child reported back");
    rig.result_with_origin();
    assert_eq!(rig.root().outcome(), Some(Outcome::Completed));
    assert!(
        !rig.diagnostics
            .iter()
            .any(|d| d.contains("unreserved follow-up")),
        "{:?}",
        rig.diagnostics
    );
    rig.assert_clean();
}

// --- mutants: the last Claude adapter survivors (25e) ---

/// "The adapter logs it with ids and counts (`unreserved follow-up`)" only for a follow-up the
/// SDK started on its own (a server turn) that nothing reserved: a user turn whose result is
/// flagged as a task-notification follow-up with nothing outstanding is logged as a follow-up
/// result, never as an unreserved follow-up.
#[test]
fn a_follow_up_result_on_a_user_turn_is_not_logged_as_unreserved() {
    let mut rig = Rig::new();
    rig.started();
    assert_eq!(rig.adapter().outstanding_notifications(), 0);
    let out = rig.result_with_origin();
    assert!(
        out.diagnostics
            .iter()
            .any(|d| d.contains("follow-up result on") && d.contains("answered 0")),
        "{:?}",
        out.diagnostics
    );
    assert!(
        !out.diagnostics
            .iter()
            .any(|d| d.contains("unreserved follow-up")),
        "{:?}",
        out.diagnostics
    );
    assert_eq!(rig.root().outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

/// "A later assistant, stream, result, or synthetic start from that timed-out continuation is
/// stale and must be dropped": with no newer root turn queued behind the timed-out continuation,
/// its output is not even buffered (there is nothing it could belong to), and its `result`, even
/// one without a task-notification `origin`, ends it with "0 buffered" and nothing
/// re-attributed.
#[test]
fn stale_output_with_nothing_queued_behind_is_dropped_unbuffered() {
    let mut rig = Rig::with(ClaudeConfig {
        continuation_timeout_ms: 50,
        ..ClaudeConfig::default()
    });
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    rig.timer(&timer.id, timer.at);
    let outcome = rig.root().outcome();
    assert!(outcome.is_some(), "the gate settled the root");
    let before = (rig.events.len(), rig.diagnostics.len());
    rig.msg(init());
    rig.text(None, "late continuation");
    rig.result();
    assert_eq!(
        &rig.events[before.0..],
        &[],
        "nothing lands anywhere: {:?}",
        &rig.events[before.0..]
    );
    let diags = &rig.diagnostics[before.1..];
    let ended = diags
        .iter()
        .find(|d| d.contains("timed-out continuation") && d.contains("ended"))
        .unwrap_or_else(|| panic!("{diags:?}"));
    assert!(
        ended.contains("follow-up: false") && ended.contains("0 buffered"),
        "{ended}"
    );
    assert!(
        !diags.iter().any(|d| d.contains("re-attributed")),
        "{diags:?}"
    );
    assert_eq!(rig.root().outcome(), outcome, "nothing reopens the root");
    rig.assert_clean();
}

/// The stale buffer's cap (`STALE_BUFFER_MAX`, 512 lines): while a timed-out continuation that
/// may never run sits before the next queued root turn, that turn's output is kept, up to 512
/// lines, and re-attributed to it at its `result`; line 513 onwards is dropped. Choice: the cap
/// bounds memory against a sidecar that never sends the `result`; what passes it is lost (logged).
#[test]
fn the_stale_buffer_keeps_exactly_512_lines_for_the_next_turn() {
    let mut rig = Rig::with(ClaudeConfig {
        continuation_timeout_ms: 50,
        ..ClaudeConfig::default()
    });
    rig.waiting_on_background_child();
    let out = rig.notification("task-1", "tu-1", "completed");
    let timer = out.timers[0].clone();
    rig.timer(&timer.id, timer.at);
    rig.submit("turn-2");
    for i in 0..513 {
        rig.text(None, &format!("line {i}"));
    }
    let out = rig.result();
    assert!(
        out.diagnostics
            .iter()
            .any(|d| d.contains("re-attributed 512 buffered root messages")),
        "{:?}",
        out.diagnostics
    );
    let texts: Vec<&str> = rig
        .events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::MessageAppended { turn_id, text, .. }
                if turn_id.as_ref() == "turn-2" =>
            {
                Some(&**text)
            }
            _ => None,
        })
        .collect();
    assert_eq!(texts.len(), 512);
    assert_eq!(texts.first().copied(), Some("line 0"));
    assert_eq!(texts.last().copied(), Some("line 511"));
    assert_eq!(rig.turn(R, "turn-2").outcome(), Some(Outcome::Completed));
    rig.assert_clean();
}

/// "A target whose task is unknown or already terminal is an idempotent no-op: it is simply not
/// confirmed": a `stopTask` goes only into a running query. A child seen while `start` was still
/// unacknowledged outlives a refused `start` (the query never ran); cancelling it then sends
/// nothing and is answered at once, not confirmed.
#[test]
fn child_only_cancel_with_no_running_query_sends_no_stop_task_and_is_answered_at_once() {
    let mut rig = Rig::new();
    rig.submit(T1);
    rig.msg(init());
    rig.agent(None, "tu-1", true);
    rig.task_started("task-1", "tu-1", true);
    let (cs, ct) = child("tu-1");
    rig.ack("start", false);
    assert!(
        rig.turn(&cs, &ct).phase().is_active(),
        "{:?}",
        rig.turn(&cs, &ct)
    );
    let step =
        rig.cmd(json!({"type":"cancelTurn","operationId":"op-1","agentSessionId":cs,"turnId":ct}));
    assert_eq!(
        rig.native.iter().filter(|c| c["op"] == "stopTask").count(),
        0,
        "{:?} {step:?}",
        rig.native
    );
    assert!(
        rig.answers.iter().any(|a| matches!(a,
            RuntimeAnswer::CancelResult { operation_id, acked }
            if operation_id.as_ref() == "op-1" && acked.is_empty())),
        "{:?}",
        rig.answers
    );
    assert!(!rig.turn(&cs, &ct).phase().is_active());
    rig.assert_clean();
}

/// "Provider aliases bind to their own child": a child the adapter recreates from a
/// `task_started` it never saw launched carries its task id as an alias from its creation.
#[test]
fn a_child_recreated_from_task_started_carries_its_task_id_alias() {
    let mut rig = Rig::new();
    rig.started();
    rig.task_started("task-9", "tu-9", true);
    let (cs, _) = child("tu-9");
    let s = rig.engine().session(&cs).expect("recreated child");
    assert_eq!(s.provider_aliases.task_id.as_deref(), Some("task-9"));
    assert_eq!(
        s.provider_aliases.parent_tool_use_id.as_deref(),
        Some("tu-9")
    );
    rig.assert_clean();
}
