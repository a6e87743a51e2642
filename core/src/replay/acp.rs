//! Replaying a captured ACP transcript (`tutti replay-native --provider acp FILE`) through the
//! adapter and the engine, purely.
//!
//! The line format is the Codex one: `<< {...}` received from the agent, `>> {...}` sent by the
//! client that captured it (a line without a prefix counts as received). The replay creates the
//! root session [`REPLAY_ROOT`], attaches an [`AcpAdapter`] and submits the root turn
//! [`REPLAY_TURN`]; then every received line goes to the adapter, every normalized event and
//! runtime answer to the engine, and every provider request of the engine back to the adapter,
//! all through a [`Driver`] committing to a [`MemoryStore`].
//!
//! - **Request ids.** The adapter allocates its own. A `>>` request is matched to the oldest
//!   unanswered adapter request with the same method, and the transcript's response to it is
//!   renumbered to the adapter's id; a response to a request the adapter never made is skipped
//!   with a diagnostic. The agent's own requests (`session/request_permission`, ids from 0) keep
//!   their ids.
//! - **The client's actions** become the engine commands that cause them, so the engine decides
//!   them as it would live: a `>> session/cancel` of the root or of a child is a `cancelTurn` of
//!   that session's active turn (the adapter then sends its own `session/cancel`s); an answer to
//!   a permission request is a `respondInteraction` of the pending interaction with that request
//!   id; a `>> session/prompt` the adapter did not send is a `submit` of a new root turn.
//! - **Relaunch.** A transcript that holds a `>> session/load` is the capture of a relaunched
//!   agent: the adapter is configured to load that session, as the daemon does for a root with a
//!   recorded provider session.
//!
//! Time is a counter (one tick per line); timers still armed at the end fire then, earliest
//! first. Nothing panics: garbage lines, adapter errors and engine rejections become
//! diagnostics, and the invariant checker runs after every line.

use super::codex::{absorb_records, ReplayOutput};
use crate::adapters::acp::{AcpAdapter, AcpConfig};
use crate::adapters::parse_line;
use crate::driver::{Driver, DriverInput, Output, Testkit};
use crate::input::{Command, Input};
use crate::model::{Id, Millis};
use crate::store::MemoryStore;
use serde_json::{json, Value};
use std::any::Any;
use std::collections::BTreeMap;

/// The root session a replay creates.
pub const REPLAY_ROOT: &str = "root";
/// The root turn a replay submits.
pub const REPLAY_TURN: &str = "turn-1";

/// Timer rounds the end of a replay fires at most (a timer may arm another).
const FINISH_ROUNDS: usize = 64;

/// A replay in progress.
#[derive(Debug)]
struct AcpReplay {
    driver: Driver,
    store: MemoryStore,
    now: Millis,
    out: ReplayOutput,
    /// Adapter requests not yet matched to a transcript request: (id, method).
    unanswered: Vec<(u64, String)>,
    /// Transcript request id (JSON text) -> adapter request id.
    ids: BTreeMap<String, u64>,
    lines: usize,
    received: usize,
    turns: u32,
    ops: u32,
}

impl AcpReplay {
    fn new(resume: Option<String>) -> AcpReplay {
        let root: Id = REPLAY_ROOT.into();
        let mut driver = Driver::new();
        driver.set_recording(true);
        let mut r = AcpReplay {
            driver,
            store: MemoryStore::new(),
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
            provider: "acp".into(),
            title: None,
            capabilities: None,
        }));
        r.now += 1;
        let adapter = AcpAdapter::new(
            root.clone(),
            AcpConfig {
                resume_session_id: resume,
                ..AcpConfig::default()
            },
        );
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

    fn adapter(&self) -> Option<&AcpAdapter> {
        let a: &dyn Any = self.driver.adapter(REPLAY_ROOT)?;
        a.downcast_ref::<AcpAdapter>()
    }

    fn line(&mut self, line: &str) {
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

    fn finish(mut self) -> ReplayOutput {
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
        self.out.snapshot = self
            .driver
            .engine()
            .snapshot(REPLAY_ROOT)
            .unwrap_or_default();
        self.out
    }

    fn diag(&mut self, text: String) {
        let line = self.lines;
        self.out.diagnostics.push(format!("line {line}: {text}"));
    }

    fn settle(&mut self) {
        for o in self.driver.commit_pending(&mut self.store) {
            if let Output::Transmit(t) = o {
                for n in t.messages {
                    if let (Some(id), Some(method)) = (
                        n.get("id").and_then(Value::as_u64),
                        n.get("method").and_then(Value::as_str),
                    ) {
                        self.unanswered.push((id, method.to_string()));
                    }
                    self.out.native.push(n);
                }
            }
        }
        absorb_records(&mut self.out, self.lines, &mut self.driver);
    }

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
        if msg.get("method").is_none() && msg.get("id").is_some() {
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

    fn sent(&mut self, text: &str) {
        let msg = match parse_line(text) {
            Ok(v) => v,
            Err(e) => {
                self.diag(format!("unreadable client line: {e}"));
                return;
            }
        };
        let method = msg.get("method").and_then(Value::as_str).map(String::from);
        let id = msg.get("id").filter(|v| !v.is_null()).cloned();
        match (method, id) {
            (Some(method), Some(id)) => {
                let find = |r: &AcpReplay| r.unanswered.iter().position(|(_, m)| *m == method);
                if find(self).is_none() && method == "session/prompt" {
                    self.mirror_prompt(&msg);
                }
                match find(self) {
                    Some(pos) => {
                        let (own, _) = self.unanswered.remove(pos);
                        self.ids.insert(id.to_string(), own);
                    }
                    None => self.diag(format!(
                        "client request {method} has no counterpart in the replay"
                    )),
                }
            }
            (Some(method), None) if method == "session/cancel" => {
                let sid = msg
                    .pointer("/params/sessionId")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                self.mirror_cancel(&sid);
            }
            (None, Some(id)) => {
                let response = msg.get("result").cloned();
                self.mirror_answer(&id, response);
            }
            _ => {}
        }
    }

    fn mirror_prompt(&mut self, msg: &Value) {
        let text = msg
            .pointer("/params/prompt")
            .and_then(Value::as_array)
            .map(|blocks| {
                blocks
                    .iter()
                    .filter_map(|b| b.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default();
        self.turns += 1;
        self.engine_input(Input::Command(Command::Submit {
            agent_session_id: REPLAY_ROOT.into(),
            turn_id: format!("turn-{}", self.turns).into(),
            text,
        }));
    }

    fn mirror_cancel(&mut self, native: &str) {
        let session: Option<Id> = match self.adapter() {
            Some(a) => match a.session_of_native(native) {
                Some(None) => Some(REPLAY_ROOT.into()),
                Some(Some(child)) => Some(child),
                None => None,
            },
            None => None,
        };
        let active = session.and_then(|s| {
            self.driver
                .engine()
                .session(&s)
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
            None => self.diag("client cancel of a session with no active turn".into()),
        }
    }

    fn mirror_answer(&mut self, id: &Value, response: Option<Value>) {
        let key = match id {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let Some(response) = response else {
            self.diag(format!(
                "client answered request {key} with an error: not mirrored"
            ));
            return;
        };
        let pending = self
            .driver
            .engine()
            .pending_interactions(REPLAY_ROOT)
            .into_iter()
            .find(|i| *i.request_id == *key);
        match pending {
            Some(i) => self.engine_input(Input::Command(Command::RespondInteraction {
                agent_session_id: i.agent_session_id,
                turn_id: i.turn_id,
                request_id: i.request_id,
                response,
            })),
            None => self.diag(format!(
                "client answered request {key}, which is not a pending interaction"
            )),
        }
    }
}

/// The session a transcript's `>> session/load` loads, if it has one.
fn loaded_session(lines: &str) -> Option<String> {
    lines.lines().find_map(|l| {
        let v = parse_line(l.trim().strip_prefix(">>")?).ok()?;
        if v.get("method")?.as_str()? != "session/load" {
            return None;
        }
        Some(v.pointer("/params/sessionId")?.as_str()?.to_string())
    })
}

/// Replays a captured ACP transcript (see the module docs). Errors only when the text holds no
/// received line at all.
pub fn replay_transcript(lines: &str) -> Result<ReplayOutput, String> {
    let mut r = AcpReplay::new(loaded_session(lines));
    for line in lines.lines() {
        r.line(line);
    }
    if r.received == 0 {
        return Err("the transcript holds no received (<<) line".into());
    }
    Ok(r.finish())
}
