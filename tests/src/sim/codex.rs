//! A simulated Codex app-server (JSON-RPC over one stdio pipe, the shapes of the captured
//! `core/tests/data/codex/*.wire.jsonl` transcripts, codex 0.171): `initialize`, `thread/start`,
//! `turn/start` (answered with the turn, then `turn/started`), `turn/steer` (with
//! `expectedTurnId`), `turn/interrupt` (answered `{}`, then `turn/completed` with status
//! `interrupted`), `item/started` / `item/completed` (user and agent messages, `commandExecution`,
//! `collabAgentToolCall` spawnAgent with `receiverThreadIds`, or the v2 `subAgentActivity`
//! `started` edge), `thread/status/changed`, server requests
//! (`item/commandExecution/requestApproval`) answered by the client and followed by
//! `serverRequest/resolved`, and child threads with their own `turn/started` /
//! `turn/completed`.
//!
//! Children run concurrently, may ask for approval, spawn a nested child, fail, hang until
//! interrupted, or take a second turn (guidance into the child) while the root turn runs.
//! Faults the protocol shows in captures: a child's status/warning and even its `turn/started`
//! before the spawn item completes (early events), the same spawn edge reported twice (item
//! repeated, or both edge shapes).

use super::{Provider, Rng};
use serde_json::{json, Value};
use tutti_core::adapters::codex::{CodexAdapter, CodexConfig};
use tutti_core::adapters::Adapter;
use tutti_core::model::{Id, Millis};

/// The real adapter for a root.
pub fn adapter(root: &Id) -> Box<dyn Adapter> {
    Box::new(CodexAdapter::new(root.clone(), CodexConfig::default()))
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// Spawned; the edge is not reported yet.
    Spawning,
    Running,
    Waiting(i64),
    Idle,
}

#[derive(Debug, Clone)]
struct Thread {
    id: String,
    /// The thread whose turn spawned it (None for the root).
    parent: Option<usize>,
    /// The spawning tool call (on the parent thread).
    call: String,
    turn: Option<String>,
    phase: Phase,
    steps: usize,
    ask: bool,
    spawns: usize,
    fail: bool,
    hang: bool,
    v2: bool,
    /// Turns this child still takes after its first (guidance into the child).
    more_turns: usize,
    early: bool,
}

/// See the module docs.
#[derive(Debug)]
pub struct CodexServer {
    tag: String,
    seq: u32,
    request_seq: i64,
    /// Thread 0 is the root.
    threads: Vec<Thread>,
    /// Server request id -> thread index.
    requests: Vec<(i64, usize)>,
    calm: bool,
}

fn note(method: &str, params: Value) -> Value {
    json!({"method": method, "params": params})
}

impl CodexServer {
    /// A fresh app-server process.
    pub fn new(tag: String, _rng: &mut Rng) -> CodexServer {
        CodexServer {
            tag,
            seq: 0,
            request_seq: 0,
            threads: Vec::new(),
            requests: Vec::new(),
            calm: false,
        }
    }

    fn id(&mut self, what: &str) -> String {
        self.seq += 1;
        format!("{}-{what}{}", self.tag, self.seq)
    }

    fn item(&self, t: usize, done: bool, item: Value) -> Value {
        let th = &self.threads[t];
        note(
            if done {
                "item/completed"
            } else {
                "item/started"
            },
            json!({"item": item, "threadId": th.id, "turnId": th.turn}),
        )
    }

    fn turn_obj(id: &str, status: &str, error: Option<&str>) -> Value {
        json!({"id": id, "items": [], "itemsView": "notLoaded", "status": status, "error": error.map(|m| json!({"message": m}))})
    }

    fn start_turn(&mut self, t: usize) -> (String, Value) {
        let turn = self.id("turn");
        let th = &mut self.threads[t];
        th.turn = Some(turn.clone());
        th.phase = Phase::Running;
        let started = note(
            "turn/started",
            json!({"threadId": th.id, "turn": Self::turn_obj(&turn, "inProgress", None)}),
        );
        (turn, started)
    }

    fn complete(&mut self, t: usize, status: &str, error: Option<&str>) -> Vec<Value> {
        let th = &mut self.threads[t];
        let Some(turn) = th.turn.clone() else {
            return Vec::new();
        };
        th.phase = Phase::Idle;
        let id = th.id.clone();
        self.requests.retain(|(_, x)| *x != t);
        vec![
            note(
                "thread/status/changed",
                json!({"threadId": id, "status": {"type": "idle"}}),
            ),
            note(
                "turn/completed",
                json!({"threadId": id, "turn": Self::turn_obj(&turn, status, error)}),
            ),
        ]
    }

    fn new_thread(&mut self, parent: Option<usize>, rng: &mut Rng) -> usize {
        let id = self.id("thread");
        let call = self.id("call");
        let root_level = parent == Some(0);
        self.threads.push(Thread {
            id,
            parent,
            call,
            turn: None,
            phase: if parent.is_some() {
                Phase::Spawning
            } else {
                Phase::Idle
            },
            steps: rng.range(0, 3),
            ask: parent.is_some() && rng.chance(250),
            spawns: if root_level && rng.chance(200) { 1 } else { 0 },
            fail: rng.chance(150),
            hang: parent.is_some() && !self.calm && rng.chance(80),
            v2: rng.chance(300),
            more_turns: usize::from(parent.is_some() && rng.chance(120)),
            early: rng.chance(300),
        });
        self.threads.len() - 1
    }

    fn busy_kids(&self, t: usize) -> bool {
        self.threads
            .iter()
            .any(|c| c.parent == Some(t) && c.phase != Phase::Idle)
    }

    fn ready(&self, t: usize) -> bool {
        let th = &self.threads[t];
        match th.phase {
            Phase::Spawning => true,
            Phase::Running => {
                if th.hang && !self.calm {
                    return false;
                }
                // The root turn completes after its spawns; a child after its own children.
                th.ask || th.spawns > 0 || th.steps > 0 || !self.busy_kids(t) || t == 0
            }
            Phase::Waiting(_) => false,
            // Guidance into a child: its next turn, while the root turn still runs.
            Phase::Idle => t != 0 && th.more_turns > 0 && self.threads[0].phase == Phase::Running,
        }
    }

    /// The spawn edge of child `c` on its parent's thread.
    fn spawn_edge(&self, c: usize) -> Vec<Value> {
        let th = &self.threads[c];
        let p = th.parent.unwrap_or(0);
        let sender = self.threads[p].id.clone();
        if th.v2 {
            vec![self.item(
                p,
                true,
                json!({"type": "subAgentActivity", "id": th.call, "kind": "started",
                "agentThreadId": th.id, "agentPath": format!("/root/helper_{}", c)}),
            )]
        } else {
            vec![self.item(p, true, json!({"type": "collabAgentToolCall", "id": th.call, "tool": "spawnAgent",
                "status": "completed", "senderThreadId": sender, "receiverThreadIds": [th.id], "prompt": "CHILD_TASK"}))]
        }
    }

    fn step_thread(&mut self, t: usize, rng: &mut Rng) -> Vec<Value> {
        let th = self.threads[t].clone();
        match th.phase {
            Phase::Spawning => {
                // Early child events (before the edge), the edge, then the child's first turn.
                let p = th.parent.unwrap_or(0);
                let mut out = Vec::new();
                if !th.v2 {
                    let sender = self.threads[p].id.clone();
                    out.push(self.item(p, false, json!({"type": "collabAgentToolCall", "id": th.call, "tool": "spawnAgent",
                        "status": "inProgress", "senderThreadId": sender, "receiverThreadIds": [], "prompt": "CHILD_TASK"})));
                }
                if th.early {
                    out.push(note(
                        "thread/status/changed",
                        json!({"threadId": th.id, "status": {"type": "idle"}}),
                    ));
                    out.push(note(
                        "warning",
                        json!({"threadId": th.id, "message": "model metadata not found"}),
                    ));
                }
                let early_turn = th.early && rng.chance(400);
                let mut started = None;
                if early_turn {
                    let (_, s) = self.start_turn(t);
                    out.push(note(
                        "thread/status/changed",
                        json!({"threadId": th.id, "status": {"type": "active", "activeFlags": []}}),
                    ));
                    out.push(s);
                }
                out.extend(self.spawn_edge(t));
                if !early_turn {
                    let (_, s) = self.start_turn(t);
                    started = Some(s);
                }
                if let Some(s) = started {
                    out.push(note(
                        "thread/status/changed",
                        json!({"threadId": th.id, "status": {"type": "active", "activeFlags": []}}),
                    ));
                    out.push(s);
                }
                let user = self.id("user");
                out.push(self.item(t, true, json!({"type": "userMessage", "id": user, "content": [{"type": "text", "text": "CHILD_TASK"}]})));
                out
            }
            Phase::Idle => {
                // The child's next turn.
                self.threads[t].more_turns -= 1;
                self.threads[t].steps = rng.range(0, 2);
                self.threads[t].fail = false;
                let (_, s) = self.start_turn(t);
                vec![
                    note(
                        "thread/status/changed",
                        json!({"threadId": th.id, "status": {"type": "active", "activeFlags": []}}),
                    ),
                    s,
                ]
            }
            Phase::Running if th.ask => {
                self.threads[t].ask = false;
                let req = self.request_seq;
                self.request_seq += 1;
                self.threads[t].phase = Phase::Waiting(req);
                self.requests.push((req, t));
                let item = self.id("cmd");
                vec![
                    note(
                        "thread/status/changed",
                        json!({"threadId": th.id, "status": {"type": "active", "activeFlags": ["waitingOnApproval"]}}),
                    ),
                    json!({"method": "item/commandExecution/requestApproval", "id": req, "params": {"threadId": th.id, "turnId": th.turn,
                        "itemId": item, "command": "cargo test", "cwd": "/"}}),
                ]
            }
            Phase::Running if th.spawns > 0 => {
                self.threads[t].spawns -= 1;
                let c = self.new_thread(Some(t), rng);
                self.step_thread(c, rng)
            }
            Phase::Running if th.steps > 0 => {
                self.threads[t].steps -= 1;
                if rng.chance(300) {
                    let item = self.id("cmd");
                    vec![
                        self.item(t, false, json!({"type": "commandExecution", "id": item, "command": "ls", "status": "inProgress"})),
                        self.item(t, true, json!({"type": "commandExecution", "id": item, "command": "ls", "status": "completed"})),
                    ]
                } else {
                    let msg = self.id("msg");
                    vec![
                        self.item(
                            t,
                            false,
                            json!({"type": "agentMessage", "id": msg, "text": ""}),
                        ),
                        note(
                            "item/agentMessage/delta",
                            json!({"threadId": th.id, "turnId": th.turn, "itemId": msg, "delta": "working"}),
                        ),
                        self.item(
                            t,
                            true,
                            json!({"type": "agentMessage", "id": msg, "text": "working"}),
                        ),
                    ]
                }
            }
            Phase::Running => {
                if th.fail {
                    self.complete(t, "failed", Some("model error"))
                } else {
                    self.complete(t, "completed", None)
                }
            }
            Phase::Waiting(_) => Vec::new(),
        }
    }

    fn error(id: &Value, message: &str) -> Value {
        json!({"id": id, "error": {"code": -32600, "message": message}})
    }
}

impl Provider for CodexServer {
    fn receive(&mut self, _now: Millis, msg: &Value, rng: &mut Rng) -> Vec<Value> {
        let id = msg.get("id").cloned();
        let method = msg.get("method").and_then(Value::as_str);
        let p = msg.get("params").cloned().unwrap_or(Value::Null);
        let thread_arg = p
            .get("threadId")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let find = |s: &CodexServer| s.threads.iter().position(|t| t.id == thread_arg);
        match (method, id) {
            (Some("initialize"), Some(id)) => vec![
                json!({"id": id, "result": {"userAgent": "sim/0.171.0", "platformOs": "linux"}}),
            ],
            (Some("thread/start"), Some(id)) => {
                if self.threads.is_empty() {
                    self.new_thread(None, rng);
                }
                let tid = self.threads[0].id.clone();
                vec![
                    json!({"id": id, "result": {"thread": {"id": tid, "status": {"type": "idle"}, "turns": []}, "model": "mock"}}),
                ]
            }
            (Some("turn/start"), Some(id)) => {
                if find(self) != Some(0) {
                    return vec![Self::error(&id, "unknown thread")];
                }
                if self.threads[0].phase == Phase::Running {
                    return vec![Self::error(&id, "a turn is already running")];
                }
                let (turn, started) = self.start_turn(0);
                let root = &mut self.threads[0];
                root.steps = rng.range(0, 2);
                root.spawns = rng.range(0, 3);
                root.ask = rng.chance(100);
                root.fail = rng.chance(80);
                let user = self.id("user");
                vec![
                    json!({"id": id, "result": {"turn": Self::turn_obj(&turn, "inProgress", None)}}),
                    note("thread/status/changed", json!({"threadId": self.threads[0].id, "status": {"type": "active", "activeFlags": []}})),
                    started,
                    self.item(0, true, json!({"type": "userMessage", "id": user, "content": [{"type": "text", "text": "go"}]})),
                ]
            }
            (Some("turn/steer"), Some(id)) => {
                let expected = p.get("expectedTurnId").and_then(Value::as_str);
                let root = &self.threads.first();
                match root {
                    Some(r) if r.phase == Phase::Running && r.turn.as_deref() == expected => {
                        let turn = r.turn.clone();
                        self.threads[0].spawns += rng.below(2);
                        vec![json!({"id": id, "result": {"turnId": turn}})]
                    }
                    _ => vec![Self::error(&id, "no active turn to steer")],
                }
            }
            (Some("turn/interrupt"), Some(id)) => {
                let turn = p.get("turnId").and_then(Value::as_str);
                let Some(t) = find(self) else {
                    return vec![Self::error(&id, "unknown thread")];
                };
                let th = &self.threads[t];
                let live = matches!(th.phase, Phase::Running | Phase::Waiting(_))
                    && th.turn.as_deref() == turn;
                if !live {
                    return vec![Self::error(&id, "no active turn")];
                }
                let mut out = vec![json!({"id": id, "result": {}})];
                self.threads[t].more_turns = 0;
                out.extend(self.complete(t, "interrupted", None));
                out
            }
            (Some(_), Some(id)) => vec![Self::error(&id, "method not found")],
            (Some(_), None) => Vec::new(), // initialized, ...
            (None, Some(id)) => {
                // The client's answer to a server request (a result, or an error: declined).
                let Some(req) = id.as_i64() else {
                    return Vec::new();
                };
                let Some(k) = self.requests.iter().position(|(r, _)| *r == req) else {
                    return Vec::new();
                };
                let (_, t) = self.requests.remove(k);
                if self.threads[t].phase != Phase::Waiting(req) {
                    return Vec::new();
                }
                self.threads[t].phase = Phase::Running;
                let tid = self.threads[t].id.clone();
                vec![
                    note(
                        "serverRequest/resolved",
                        json!({"threadId": tid, "requestId": req}),
                    ),
                    note(
                        "thread/status/changed",
                        json!({"threadId": tid, "status": {"type": "active", "activeFlags": []}}),
                    ),
                ]
            }
            (None, None) => Vec::new(),
        }
    }

    fn step(&mut self, _now: Millis, rng: &mut Rng, faults: bool) -> Vec<Value> {
        if faults && rng.chance(30) {
            // The same spawn edge reported again.
            let running =
                |t: usize| matches!(self.threads[t].phase, Phase::Running | Phase::Waiting(_));
            let spawned: Vec<usize> = (1..self.threads.len())
                .filter(|&c| {
                    self.threads[c].phase != Phase::Spawning
                        && running(self.threads[c].parent.unwrap_or(0))
                })
                .collect();
            if !spawned.is_empty() {
                let c = spawned[rng.below(spawned.len())];
                return self.spawn_edge(c);
            }
        }
        let ready: Vec<usize> = (0..self.threads.len()).filter(|&t| self.ready(t)).collect();
        if ready.is_empty() {
            return Vec::new();
        }
        let t = ready[rng.below(ready.len())];
        self.step_thread(t, rng)
    }

    fn busy(&self) -> bool {
        (0..self.threads.len()).any(|t| self.ready(t))
    }

    fn calm(&mut self) {
        self.calm = true;
        for t in &mut self.threads {
            t.hang = false;
        }
    }
}
