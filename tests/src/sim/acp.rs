//! A simulated ACP agent (JSON-RPC 2.0 over one stdio pipe) with standard ACP v1 subagent
//! sessions, in both shapes real agents send: the demo agent's (`io-tokio/src/agents/demo.rs`: a
//! delegation `tool_call` linked to the child by a `session` content) and claude-agent-acp's (no
//! tool call: the delegating `session_message` pair whose `messageId` is the tool-use id, a
//! `<id>:reply` message after a foreground child's `idle`). Some incarnations send no
//! `subagent_update` at all (then it stays root-only). Besides: `initialize`, `session/new`,
//! `session/prompt` answered with a stop reason, `session/update` notifications
//! (`agent_message_chunk`, `tool_call`, `tool_call_update`, `subagent_update` announcements and
//! `state` snapshots on the parent stream), `session/request_permission` requests for child
//! tool calls, `session/cancel` for the root (live subagents report `cancelled`, descendants
//! first, then the prompt answers `cancelled`; a claude-style background child keeps running, as
//! the real agent's do, until it is cancelled itself) or for one child that advertised
//! `capabilities.cancel`.
//!
//! Children run concurrently (their traffic interleaves), may be foreground (the delegation tool
//! call completes after the child's terminal) or background (it completes at once; the child may
//! outlive the prompt), may ask for permission, spawn a nested child, fail, hang until canceled,
//! or be reused by a later prompt (a `running` snapshot after `idle` opens its next turn).
//! Faults the protocol allows: a state snapshot repeated, a root chunk after the prompt answered.

use super::{Provider, Rng};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use tutti_core::model::Millis;

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Announce,
    Starting,
    Running,
    Waiting(String),
    Done(&'static str),
}

#[derive(Debug, Clone)]
struct Child {
    native: String,
    parent: String,
    call: String,
    background: bool,
    state: State,
    steps: usize,
    ask: bool,
    nested: usize,
    fail: bool,
    hang: bool,
    can_cancel: bool,
    /// claude-agent-acp's shape (session messages, no delegation tool call).
    claude: bool,
}

#[derive(Debug, Clone)]
struct Prompt {
    id: Value,
    chunks: usize,
    spawns: usize,
    tools: usize,
}

/// See the module docs.
#[derive(Debug)]
pub struct AcpAgent {
    tag: String,
    subagents: bool,
    session: Option<String>,
    prompt: Option<Prompt>,
    /// The last prompt answered (for late chunks).
    answered: bool,
    children: Vec<Child>,
    /// Permission request id -> child index.
    permissions: BTreeMap<String, usize>,
    seq: u32,
    calm: bool,
}

fn update(session: &str, update: Value) -> Value {
    json!({"jsonrpc":"2.0","method":"session/update","params":{"sessionId":session,"update":update}})
}

fn chunk(session: &str, text: &str) -> Value {
    update(
        session,
        json!({"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":text}}),
    )
}

fn state_of(s: &State) -> Value {
    match s {
        State::Done("cancelled") => json!({"state":"idle","stopReason":"cancelled"}),
        State::Done("error") => {
            json!({"state":"idle","stopReason":"error","error":{"code":-32603,"message":"subagent failed"}})
        }
        State::Done(_) => json!({"state":"idle","stopReason":"end_turn"}),
        State::Waiting(_) => json!({"state":"requires_action"}),
        _ => json!({"state":"running"}),
    }
}

impl AcpAgent {
    /// A fresh agent process; `tag` makes its session ids unique per incarnation.
    pub fn new(tag: String, rng: &mut Rng) -> AcpAgent {
        AcpAgent {
            tag,
            subagents: !rng.chance(100),
            session: None,
            prompt: None,
            answered: false,
            children: Vec::new(),
            permissions: BTreeMap::new(),
            seq: 0,
            calm: false,
        }
    }

    fn id(&mut self, what: &str) -> String {
        self.seq += 1;
        format!("{}-{what}{}", self.tag, self.seq)
    }

    fn root(&self) -> String {
        self.session.clone().unwrap_or_default()
    }

    fn snapshot(&self, i: usize) -> Value {
        let c = &self.children[i];
        update(
            &c.parent,
            json!({"sessionUpdate":"subagent_update","sessionId":c.native,"state":state_of(&c.state)}),
        )
    }

    fn spawn(&mut self, parent: String, rng: &mut Rng) {
        let native = self.id("child");
        let call = self.id("delegate");
        let top = parent == self.root();
        self.children.push(Child {
            native,
            parent,
            call,
            background: top && rng.chance(250),
            state: State::Announce,
            steps: rng.range(0, 3),
            ask: rng.chance(300),
            nested: usize::from(top && rng.chance(250)),
            fail: rng.chance(150),
            hang: !self.calm && rng.chance(80),
            can_cancel: rng.chance(700),
            claude: rng.chance(500),
        });
    }

    /// The child's terminal snapshot, then (foreground) its delegation tool call's completion.
    fn finish(&mut self, i: usize, reason: &'static str) -> Vec<Value> {
        self.children[i].state = State::Done(reason);
        self.permissions.retain(|_, c| *c != i);
        let c = self.children[i].clone();
        let mut out = vec![self.snapshot(i)];
        if c.claude {
            if !c.background && reason == "end_turn" {
                out.push(update(
                    &c.parent,
                    json!({"sessionUpdate":"session_message",
                    "messageId":format!("{}:reply", c.call),"senderSessionId":c.native,
                    "recipientSessionId":c.parent,"content":[{"type":"text","text":"done"}]}),
                ));
            }
        } else if !c.background {
            let (status, outcome) = match reason {
                "end_turn" => ("completed", "completed"),
                "cancelled" => ("failed", "cancelled"),
                _ => ("failed", "failed"),
            };
            out.push(update(&c.parent, json!({"sessionUpdate":"tool_call_update","toolCallId":c.call,"status":status,"rawOutput":{"outcome":outcome}})));
        }
        out
    }

    fn live(&self, i: usize) -> bool {
        !matches!(self.children[i].state, State::Done(_) | State::Announce)
    }

    fn descendants(&self, i: usize) -> Vec<usize> {
        let mut v = vec![i];
        let mut k = 0;
        while k < v.len() {
            let native = self.children[v[k]].native.clone();
            v.extend((0..self.children.len()).filter(|&j| self.children[j].parent == native));
            k += 1;
        }
        v
    }

    /// Cancels these children, descendants first.
    fn cancel(&mut self, set: Vec<usize>) -> Vec<Value> {
        let mut out = Vec::new();
        for i in set.into_iter().rev() {
            if self.live(i) {
                out.extend(self.finish(i, "cancelled"));
            } else if self.children[i].state == State::Announce {
                // Never announced: it simply never happens.
                self.children[i].state = State::Done("cancelled");
            }
        }
        out
    }

    fn prompt_ready(&self) -> bool {
        let Some(p) = &self.prompt else { return false };
        if p.chunks > 0 || p.spawns > 0 || p.tools > 0 {
            return true;
        }
        // The prompt answers once its foreground children are done.
        let root = self.root();
        !self
            .children
            .iter()
            .any(|c| c.parent == root && !c.background && !matches!(c.state, State::Done(_)))
    }

    fn child_ready(&self, i: usize) -> bool {
        let c = &self.children[i];
        match c.state {
            State::Announce | State::Starting => true,
            // A parent finishes after its nested children.
            State::Running => {
                (!c.hang || self.calm)
                    && (c.ask || c.nested > 0 || c.steps > 0 || !self.has_busy_kids(&c.native))
            }
            State::Waiting(_) | State::Done(_) => false,
        }
    }

    fn has_busy_kids(&self, native: &str) -> bool {
        self.children
            .iter()
            .any(|k| k.parent == native && !matches!(k.state, State::Done(_)))
    }

    fn step_prompt(&mut self, rng: &mut Rng) -> Vec<Value> {
        let root = self.root();
        let Some(p) = self.prompt.clone() else {
            return Vec::new();
        };
        let pick = rng.below(3);
        if p.chunks > 0 && (pick == 0 || (p.spawns == 0 && p.tools == 0)) {
            if let Some(p) = &mut self.prompt {
                p.chunks -= 1;
            }
            return vec![chunk(&root, "thinking about it. ")];
        }
        if p.tools > 0 && (pick == 1 || p.spawns == 0) {
            if let Some(p) = &mut self.prompt {
                p.tools -= 1;
            }
            // A tool named Task without subagent identity stays an ordinary tool call.
            let call = self.id("tool");
            return vec![
                update(
                    &root,
                    json!({"sessionUpdate":"tool_call","toolCallId":call,"title":"Task","kind":"other","status":"in_progress"}),
                ),
                update(
                    &root,
                    json!({"sessionUpdate":"tool_call_update","toolCallId":call,"status":"completed"}),
                ),
            ];
        }
        if p.spawns > 0 {
            if let Some(p) = &mut self.prompt {
                p.spawns -= 1;
            }
            if self.subagents {
                self.spawn(root, rng);
                let i = self.children.len() - 1;
                return self.step_child(i, rng);
            }
            return vec![chunk(&root, "(worked internally) ")];
        }
        self.prompt = None;
        self.answered = true;
        let stop = if rng.chance(50) {
            "refusal"
        } else {
            "end_turn"
        };
        vec![json!({"jsonrpc":"2.0","id":p.id,"result":{"stopReason":stop}})]
    }

    fn step_child(&mut self, i: usize, rng: &mut Rng) -> Vec<Value> {
        let c = self.children[i].clone();
        match c.state {
            State::Announce if c.claude => {
                self.children[i].state = State::Starting;
                vec![
                    update(
                        &c.parent,
                        json!({"sessionUpdate":"subagent_update","sessionId":c.native,"title":"explorer","description":"general-purpose",
                        "capabilities": if c.can_cancel { json!({"cancel":{}}) } else { json!({}) },
                        "state":{"state":"running"}}),
                    ),
                    update(
                        &c.parent,
                        json!({"sessionUpdate":"session_message","messageId":c.call,"senderSessionId":c.parent,
                            "recipientSessionId":c.native,"recipientMessageId":c.call,"content":[{"type":"text","text":"go"}]}),
                    ),
                    update(
                        &c.native,
                        json!({"sessionUpdate":"session_message","messageId":c.call,"senderSessionId":c.parent,
                            "recipientSessionId":c.native,"senderMessageId":c.call,"content":[{"type":"text","text":"go"}]}),
                    ),
                ]
            }
            State::Announce => {
                self.children[i].state = State::Starting;
                let mut out = vec![
                    update(
                        &c.parent,
                        json!({"sessionUpdate":"tool_call","toolCallId":c.call,"title":"Delegate to explorer","status":"in_progress","rawInput":{"agent":"explorer","background":c.background}}),
                    ),
                    update(
                        &c.parent,
                        json!({"sessionUpdate":"subagent_update","sessionId":c.native,"title":"explorer","description":"a subtask",
                        "capabilities": if c.can_cancel { json!({"cancel":{}}) } else { json!({}) }}),
                    ),
                    update(
                        &c.parent,
                        json!({"sessionUpdate":"tool_call_update","toolCallId":c.call,"content":[{"type":"session","sessionId":c.native}]}),
                    ),
                ];
                if c.background {
                    out.push(update(&c.parent, json!({"sessionUpdate":"tool_call_update","toolCallId":c.call,"status":"completed","rawOutput":{"launched":true}})));
                }
                out
            }
            State::Starting => {
                self.children[i].state = State::Running;
                vec![self.snapshot(i)]
            }
            State::Running if c.ask => {
                let req = self.id("perm");
                let call = self.id("edit");
                self.children[i].ask = false;
                self.children[i].state = State::Waiting(req.clone());
                self.permissions.insert(req.clone(), i);
                vec![
                    update(
                        &c.native,
                        json!({"sessionUpdate":"tool_call","toolCallId":call,"title":"Edit src/lib.rs","kind":"edit"}),
                    ),
                    json!({"jsonrpc":"2.0","id":req,"method":"session/request_permission","params":{"sessionId":c.native,
                        "toolCall":{"toolCallId":call,"title":"Edit src/lib.rs","kind":"edit","status":"pending"},
                        "options":[{"optionId":"allow","name":"Allow","kind":"allow_once"},{"optionId":"reject","name":"Reject","kind":"reject_once"}]}}),
                    self.snapshot(i),
                ]
            }
            State::Running if c.nested > 0 => {
                self.children[i].nested -= 1;
                self.spawn(c.native.clone(), rng);
                let j = self.children.len() - 1;
                self.step_child(j, rng)
            }
            State::Running if c.steps > 0 => {
                self.children[i].steps -= 1;
                vec![chunk(&c.native, "explorer: working. ")]
            }
            State::Running => self.finish(i, if c.fail { "error" } else { "end_turn" }),
            State::Waiting(_) | State::Done(_) => Vec::new(),
        }
    }
}

impl Provider for AcpAgent {
    fn receive(&mut self, _now: Millis, msg: &Value, rng: &mut Rng) -> Vec<Value> {
        let id = msg.get("id").cloned();
        let method = msg.get("method").and_then(Value::as_str);
        let params = msg.get("params").cloned().unwrap_or(Value::Null);
        match (method, id) {
            (Some("initialize"), Some(id)) => vec![
                json!({"jsonrpc":"2.0","id":id,"result":{"protocolVersion":1,
                "agentCapabilities":{"loadSession":false},"authMethods":[],
                "agentInfo":{"name":"sim-agent","version":"0.1.0"}}}),
            ],
            (Some("session/new"), Some(id)) => {
                let s = format!("{}-session", self.tag);
                self.session = Some(s.clone());
                vec![json!({"jsonrpc":"2.0","id":id,"result":{"sessionId":s}})]
            }
            (Some("session/prompt"), Some(id)) => {
                if self.prompt.is_some() {
                    return vec![
                        json!({"jsonrpc":"2.0","id":id,"error":{"code":-32000,"message":"a prompt is already running"}}),
                    ];
                }
                self.answered = false;
                self.prompt = Some(Prompt {
                    id,
                    chunks: rng.range(0, 2),
                    spawns: rng.range(0, 4),
                    tools: rng.below(2),
                });
                // A later prompt may reuse an idle child (its next turn).
                let reusable: Vec<usize> = (0..self.children.len())
                    .filter(|&i| {
                        matches!(self.children[i].state, State::Done("end_turn"))
                            && self.children[i].parent == self.root()
                    })
                    .collect();
                if !reusable.is_empty() && rng.chance(150) {
                    let i = reusable[rng.below(reusable.len())];
                    let c = &mut self.children[i];
                    c.state = State::Starting;
                    c.steps = rng.range(0, 2);
                    c.background = true;
                    c.fail = false;
                }
                Vec::new()
            }
            (Some("session/cancel"), None) => {
                let target = params
                    .get("sessionId")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                if target == self.root() {
                    // claude-agent-acp keeps background subagents running after a parent
                    // cancel: they end when they are cancelled themselves.
                    let all: Vec<usize> = (0..self.children.len())
                        .filter(|&i| !(self.children[i].claude && self.children[i].background))
                        .collect();
                    let mut out = self.cancel(all);
                    if let Some(p) = self.prompt.take() {
                        self.answered = true;
                        out.push(
                            json!({"jsonrpc":"2.0","id":p.id,"result":{"stopReason":"cancelled"}}),
                        );
                    }
                    out
                } else if let Some(i) = self
                    .children
                    .iter()
                    .position(|c| c.native == target && c.can_cancel)
                {
                    let set = self.descendants(i);
                    self.cancel(set)
                } else {
                    // Not ours (or a child revealed after the cancellation boundary): cancel it.
                    match self.children.iter().position(|c| c.native == target) {
                        Some(i) => {
                            let set = self.descendants(i);
                            self.cancel(set)
                        }
                        None => Vec::new(),
                    }
                }
            }
            (None, Some(id)) => {
                // The client's answer to a permission request.
                let key = id
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| id.to_string());
                let Some(i) = self.permissions.remove(&key) else {
                    return Vec::new();
                };
                if self.children[i].state != State::Waiting(key) {
                    return Vec::new();
                }
                let outcome = msg
                    .pointer("/result/outcome/outcome")
                    .and_then(Value::as_str)
                    .unwrap_or("cancelled");
                let option = msg
                    .pointer("/result/outcome/optionId")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                match (outcome, option) {
                    ("selected", "allow") => {
                        self.children[i].state = State::Running;
                        vec![self.snapshot(i)]
                    }
                    ("selected", _) => {
                        self.children[i].fail = true;
                        self.finish(i, "error")
                    }
                    _ => {
                        let set = self.descendants(i);
                        self.cancel(set)
                    }
                }
            }
            (Some(_), Some(id)) => vec![
                json!({"jsonrpc":"2.0","id":id,"error":{"code":-32601,"message":"method not found"}}),
            ],
            _ => Vec::new(),
        }
    }

    fn step(&mut self, _now: Millis, rng: &mut Rng, faults: bool) -> Vec<Value> {
        if faults && rng.chance(40) {
            // A repeated state snapshot of a child that already reported one.
            let seen: Vec<usize> = (0..self.children.len())
                .filter(|&i| !matches!(self.children[i].state, State::Announce | State::Starting))
                .collect();
            if !seen.is_empty() {
                return vec![self.snapshot(seen[rng.below(seen.len())])];
            }
        }
        if faults && self.answered && rng.chance(20) {
            self.answered = false;
            return vec![chunk(&self.root(), "a late word. ")];
        }
        let kids: Vec<usize> = (0..self.children.len())
            .filter(|&i| self.child_ready(i))
            .collect();
        let prompt = usize::from(self.prompt_ready());
        let n = kids.len() + prompt;
        if n == 0 {
            return Vec::new();
        }
        let k = rng.below(n);
        if k < prompt {
            self.step_prompt(rng)
        } else {
            self.step_child(kids[k - prompt], rng)
        }
    }

    fn busy(&self) -> bool {
        self.prompt_ready() || (0..self.children.len()).any(|i| self.child_ready(i))
    }

    fn calm(&mut self) {
        self.calm = true;
        for c in &mut self.children {
            c.hang = false;
        }
    }
}
