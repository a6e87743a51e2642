//! Replaying a captured app-server transcript (`tutti replay-native --provider codex FILE`)
//! through the adapter and the engine, purely.
//!
//! A transcript has one message a line: `<< {...}` received from the app-server, `>> {...}` sent
//! by the client that captured it (a line without a prefix counts as received). The replay
//! creates the root session [`REPLAY_ROOT`], opens the adapter, submits the root turn
//! [`REPLAY_TURN`], then feeds every received line to the adapter, every normalized event and
//! runtime answer to the engine, and every provider request of the engine back to the adapter.
//!
//! Request ids: the adapter allocates its own. A `>>` request of the transcript is matched to the
//! oldest unanswered adapter request with the same method (and thread), and the transcript's
//! response to it is renumbered to the adapter's id; a response to a request the adapter never
//! made (`thread/loaded/list`, `thread/read`, ...) is skipped with a diagnostic. The root thread
//! comes from the `thread/start` response so matched, or, if none, from a root `thread/started`.
//!
//! With [`ReplayOptions::mirror_client`] the client's own actions become engine commands, so the
//! engine decides them as it would live: `turn/interrupt` a `cancelTurn` of that thread's active
//! turn, `turn/steer` (and a `turn/start` the adapter did not send) a `submit` to the root, and an
//! answer to a server request a `respondInteraction` of the pending interaction with that
//! request id. Otherwise `>>` lines only teach request ids.
//!
//! The replay is a host of [`Driver`] like any other (issue 19: "every loop uses it"): the driver
//! owns the engine and the adapter, every decided batch is committed to a [`MemoryStore`] before
//! anything it caused happens, and the driver's [`Record`]s say what passed between the adapter
//! and the engine.
//!
//! Time is a counter (one tick per transcript line or host action); timers still armed when the
//! transcript ends fire then, earliest first (an adapter's cancel timer answers with the subset
//! acknowledged by the transcript). Nothing panics: garbage lines, adapter errors and engine
//! rejections become diagnostics, and the invariant checker runs after every line (its findings
//! are `violations`).

use crate::adapters::codex::id_key as protocol_id_key;
use crate::adapters::codex::{CodexAdapter, CodexConfig};
use crate::adapters::parse_line;
use crate::driver::{Driver, DriverInput, Output, Record, Testkit};
use crate::input::{Command, Input, NormalizedEvent, RuntimeAnswer};
use crate::model::{Id, Millis};
use crate::snapshot::TreeSnapshot;
use crate::store::MemoryStore;
use crate::Engine;
use serde::Serialize;
use serde_json::{json, Value};
use std::any::Any;
use std::collections::BTreeMap;

/// The root session a replay creates.
pub const REPLAY_ROOT: &str = "root";
/// The root turn a replay submits.
pub const REPLAY_TURN: &str = "turn-1";

/// Timer rounds [`CodexReplay::finish`] fires at most (a timer may arm another).
const FINISH_ROUNDS: usize = 64;

/// How to replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Turn the capturing client's actions (`>>` interrupt, steer, start, answers) into engine
    /// commands.
    pub mirror_client: bool,
}

/// What a replay produced.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplayOutput {
    /// Every normalized event the adapter produced, in order (including any the engine refused).
    pub events: Vec<NormalizedEvent>,
    /// Every runtime answer the adapter produced (`cancelResult`, `guideFailed`), in order.
    pub answers: Vec<RuntimeAnswer>,
    /// Every native message the adapter would have written, in order.
    pub native: Vec<Value>,
    /// The root tree at the end.
    pub snapshot: TreeSnapshot,
    /// Adapter diagnostics, adapter errors, engine rejections and skipped lines.
    pub diagnostics: Vec<String>,
    /// Invariant violations found after any line (empty when all is well).
    pub violations: Vec<String>,
}

/// A replay in progress, one line at a time (tests inspect the engine between lines).
#[derive(Debug)]
pub struct CodexReplay {
    driver: Driver,
    store: MemoryStore,
    options: ReplayOptions,
    now: Millis,
    out: ReplayOutput,
    /// Adapter requests not yet matched to a transcript request: (id, method, threadId).
    unanswered: Vec<(i64, String, Option<String>)>,
    /// Transcript request id (JSON text) -> adapter request id.
    ids: BTreeMap<String, i64>,
    lines: usize,
    received: usize,
    turns: u32,
    ops: u32,
}

impl CodexReplay {
    /// Creates the root session, opens the adapter and submits [`REPLAY_TURN`].
    pub fn new(options: ReplayOptions) -> CodexReplay {
        let root: Id = REPLAY_ROOT.into();
        let mut driver = Driver::new();
        driver.set_recording(true);
        let mut r = CodexReplay {
            driver,
            store: MemoryStore::new(),
            options,
            now: 0,
            out: ReplayOutput::default(),
            unanswered: Vec::new(),
            ids: BTreeMap::new(),
            lines: 0,
            received: 0,
            turns: 1,
            ops: 0,
        };
        r.engine_input(Input::Command(Command::CreateSession {
            agent_session_id: root.clone(),
            workspace_id: "replay".into(),
            provider: "codex".into(),
            title: None,
            capabilities: None,
        }));
        r.now += 1;
        let adapter = CodexAdapter::new(root.clone(), CodexConfig::default());
        let _ = r.driver.handle(
            DriverInput::Attach {
                now: r.now,
                root: root.clone(),
                adapter: Box::new(adapter),
            },
            &r.store,
        );
        r.settle();
        r.engine_input(Input::Command(Command::Submit {
            agent_session_id: root,
            turn_id: REPLAY_TURN.into(),
            text: "replayed transcript".into(),
        }));
        r
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        self.driver.engine()
    }

    /// The adapter (`None` once the driver dropped it, which a replay never asks for).
    pub fn adapter(&self) -> Option<&CodexAdapter> {
        let a: &dyn Any = self.driver.adapter(REPLAY_ROOT)?;
        a.downcast_ref::<CodexAdapter>()
    }

    /// What was produced so far (the snapshot is filled in by [`CodexReplay::finish`]).
    pub fn output(&self) -> &ReplayOutput {
        &self.out
    }

    /// Feeds one transcript line.
    pub fn line(&mut self, line: &str) {
        self.lines += 1;
        let t = line.trim();
        if t.is_empty() {
            return;
        }
        if let Some(rest) = t.strip_prefix(">>") {
            self.sent(rest);
        } else if let Some(rest) = t.strip_prefix("<<") {
            self.receive(rest);
        } else {
            self.receive(t);
        }
    }

    /// Fires the timers still armed and returns the output with the final snapshot.
    pub fn finish(mut self) -> ReplayOutput {
        for _ in 0..FINISH_ROUNDS {
            let Some(at) = self.driver.poll_timeout() else {
                break;
            };
            self.now = self.now.max(at);
            let _ = self
                .driver
                .handle(DriverInput::Timeout(self.now), &self.store);
            self.settle();
        }
        self.out.snapshot = self.engine().snapshot(REPLAY_ROOT).unwrap_or_default();
        self.out
    }

    fn diag(&mut self, text: String) {
        let line = self.lines;
        self.out.diagnostics.push(format!("line {line}: {text}"));
    }

    /// Commits what the driver decided, then reports what passed between the adapter and the
    /// engine, and checks the invariants.
    fn settle(&mut self) {
        for o in self.driver.commit_pending(&mut self.store) {
            if let Output::Transmit(t) = o {
                for n in t.messages {
                    if let (Some(id), Some(method)) = (
                        n.get("id").and_then(Value::as_i64),
                        n.get("method").and_then(Value::as_str),
                    ) {
                        let thread = n
                            .pointer("/params/threadId")
                            .and_then(Value::as_str)
                            .map(str::to_string);
                        self.unanswered.push((id, method.to_string(), thread));
                    }
                    self.out.native.push(n);
                }
            }
        }
        absorb_records(&mut self.out, self.lines, &mut self.driver);
    }

    /// Hands a host command to the driver and settles.
    fn engine_input(&mut self, input: Input) {
        self.now += 1;
        let _ = self.driver.handle(
            DriverInput::Host {
                now: self.now,
                input,
                reply: None,
            },
            &self.store,
        );
        self.settle();
    }

    fn receive(&mut self, text: &str) {
        self.received += 1;
        let mut msg = match parse_line(text) {
            Ok(v) => v,
            Err(e) => {
                self.diag(format!("adapter error: {e}"));
                return;
            }
        };
        let is_response = msg.get("method").is_none() && msg.get("id").is_some();
        if is_response {
            let key = msg.get("id").map(Value::to_string).unwrap_or_default();
            match self.ids.remove(&key) {
                Some(own) => {
                    if let Some(obj) = msg.as_object_mut() {
                        obj.insert("id".into(), json!(own));
                    }
                }
                None => {
                    self.diag(format!(
                        "response {key} answers a request the replay did not make: skipped"
                    ));
                    return;
                }
            }
        }
        let root_thread_known = self.adapter().is_some_and(|a| a.root_thread_id().is_some());
        if !root_thread_known
            && msg.get("method").and_then(Value::as_str) == Some("thread/started")
            && msg
                .pointer("/params/thread/parentThreadId")
                .is_none_or(Value::is_null)
        {
            if let Some(thread) = msg.pointer("/params/thread/id").and_then(Value::as_str) {
                self.now += 1;
                let call = Box::new(|a: &mut dyn crate::adapters::Adapter, now| {
                    let a: &mut dyn Any = a;
                    a.downcast_mut::<CodexAdapter>()
                        .map(|c| c.attach_root_thread(now, thread))
                        .unwrap_or_default()
                });
                let input = DriverInput::Call {
                    now: self.now,
                    root: REPLAY_ROOT,
                    call,
                };
                let attached = self.driver.handle(input, &self.store);
                if let Err(e) = attached {
                    self.diag(format!("adapter error: {e}"));
                }
                self.settle();
            }
        }
        // The clock advances only for accepted lines: garbage changes nothing at all.
        match self.driver.handle(
            DriverInput::Native {
                now: self.now + 1,
                root: REPLAY_ROOT,
                message: &msg,
            },
            &self.store,
        ) {
            Ok(()) => {
                self.now += 1;
                self.settle();
            }
            Err(e) => self.diag(format!("adapter error: {e}")),
        }
    }

    fn find_unanswered(&self, method: &str, thread: Option<&str>) -> Option<usize> {
        self.unanswered.iter().position(|(_, m, t)| {
            m == method
                && match (thread, t.as_deref()) {
                    (Some(a), Some(b)) => a == b,
                    _ => true,
                }
        })
    }

    fn sent(&mut self, text: &str) {
        let msg = match parse_line(text) {
            Ok(v) => v,
            Err(e) => {
                self.diag(format!("unreadable client line: {e}"));
                return;
            }
        };
        let method = msg
            .get("method")
            .and_then(Value::as_str)
            .map(str::to_string);
        let id = msg.get("id").filter(|v| !v.is_null()).cloned();
        match (method, id) {
            (Some(method), Some(id)) => {
                let thread = msg
                    .pointer("/params/threadId")
                    .and_then(Value::as_str)
                    .map(str::to_string);
                if self.options.mirror_client
                    && self.find_unanswered(&method, thread.as_deref()).is_none()
                {
                    self.mirror(&method, thread.as_deref(), &msg);
                }
                match self.find_unanswered(&method, thread.as_deref()) {
                    Some(pos) => {
                        let (own, _, _) = self.unanswered.remove(pos);
                        self.ids.insert(id.to_string(), own);
                    }
                    None => self.diag(format!(
                        "client request {method} has no counterpart in the replay"
                    )),
                }
            }
            (None, Some(id)) if self.options.mirror_client => {
                let response = msg.get("result").cloned();
                self.mirror_answer(&id, response);
            }
            _ => {}
        }
    }

    /// The capturing client's own action, as the engine command that causes it.
    fn mirror(&mut self, method: &str, thread: Option<&str>, msg: &Value) {
        let root: Id = REPLAY_ROOT.into();
        let adapter = self.adapter();
        let is_root = thread.is_some() && thread == adapter.and_then(CodexAdapter::root_thread_id);
        match method {
            "turn/interrupt" => {
                let session = if is_root {
                    Some(root)
                } else {
                    thread
                        .and_then(|t| adapter.and_then(|a| a.child_session_for_thread(t).cloned()))
                };
                let active = session.as_ref().and_then(|s| {
                    self.engine()
                        .session(s)
                        .and_then(|x| x.active_turn_id.clone())
                        .map(|t| (s.clone(), t))
                });
                match active {
                    Some((agent_session_id, turn_id)) => {
                        self.ops += 1;
                        self.engine_input(Input::Command(Command::CancelTurn {
                            operation_id: format!("replay-cancel-{}", self.ops).into(),
                            agent_session_id,
                            turn_id,
                        }));
                    }
                    None => self.diag("client interrupt of a thread with no active turn".into()),
                }
            }
            "turn/steer" | "turn/start" if is_root => {
                let text = msg
                    .pointer("/params/input")
                    .and_then(Value::as_array)
                    .map(|items| {
                        items
                            .iter()
                            .filter_map(|i| i.get("text").and_then(Value::as_str))
                            .collect::<Vec<_>>()
                            .join("\n")
                    })
                    .unwrap_or_default();
                self.turns += 1;
                self.engine_input(Input::Command(Command::Submit {
                    agent_session_id: root,
                    turn_id: format!("turn-{}", self.turns).into(),
                    text,
                }));
            }
            _ => {}
        }
    }

    /// The capturing client's answer to a server request, as `respondInteraction`.
    fn mirror_answer(&mut self, id: &Value, response: Option<Value>) {
        let Some(key) = protocol_id_key(id) else {
            return;
        };
        let Some(response) = response else {
            self.diag(format!(
                "client answered request {key} with an error: not mirrored"
            ));
            return;
        };
        let pending = self
            .engine()
            .pending_interactions(REPLAY_ROOT)
            .into_iter()
            .find(|i| *i.request_id == *key);
        match pending {
            Some(i) => {
                self.engine_input(Input::Command(Command::RespondInteraction {
                    agent_session_id: i.agent_session_id,
                    turn_id: i.turn_id,
                    request_id: i.request_id,
                    response,
                }));
            }
            None => self.diag(format!(
                "client answered request {key}, which is not a pending interaction"
            )),
        }
    }
}

/// What a line-by-line replay host keeps of the driver's records after a step: the adapter's
/// events, answers and diagnostics, the engine's refusals (as diagnostics of line `line`), and
/// the invariant checker's findings. Shared by the Codex and ACP replays.
pub(crate) fn absorb_records(out: &mut ReplayOutput, line: usize, driver: &mut Driver) {
    for r in driver.take_records() {
        match r {
            Record::Adapter { output, .. } => {
                for d in output.diagnostics {
                    out.diagnostics.push(format!("line {line}: adapter: {d}"));
                }
                out.events.extend(output.events);
                out.answers.extend(output.answers);
            }
            Record::Decided { input, outcome } => match outcome {
                Ok(None) => {}
                Ok(Some(why)) => out.diagnostics.push(format!(
                    "line {line}: engine ignored {}: {why:?}",
                    input.kind()
                )),
                Err(e) => out.diagnostics.push(format!(
                    "line {line}: engine rejected {}: {e}",
                    input.kind()
                )),
            },
            Record::Dropped { .. } => {}
        }
    }
    for v in driver.engine().check_invariants() {
        out.violations.push(format!("line {line}: {v}"));
    }
}

/// Replays the received (`<<`) lines of a captured transcript; `>>` lines only teach request
/// ids. Errors only when the text holds no received line at all.
pub fn replay_transcript(lines: &str) -> Result<ReplayOutput, String> {
    replay_transcript_with(lines, ReplayOptions::default())
}

/// [`replay_transcript`] with options.
pub fn replay_transcript_with(lines: &str, options: ReplayOptions) -> Result<ReplayOutput, String> {
    let mut r = CodexReplay::new(options);
    for line in lines.lines() {
        r.line(line);
    }
    if r.received == 0 {
        return Err("the transcript holds no received (<<) line".into());
    }
    Ok(r.finish())
}
