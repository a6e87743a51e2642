//! A provider that writes normalized events and runtime answers straight to the engine (no
//! adapter): the engine's contract without any protocol. Its concurrent tasks (root provider
//! runs and children) interleave freely; the only order it keeps is causality (a child is created
//! by a running parent turn, its events follow its creation, a root provider run's terminal follows
//! its own spawns, a child's next turn starts while the root provider run is still going).
//! Faults: idempotent events sent again later (creations, messages, terminals, root provider
//! terminals), failed cancels, failed guidance, unconfirmed cancel targets.

use super::{Provider, Rng};
use serde_json::{json, Value};
use tutti_core::model::{Id, Millis};

#[derive(Debug, Clone)]
struct Run {
    turn: Id,
    provider_turn: String,
    started: bool,
    spawns: usize,
    messages: usize,
    stopped: bool,
    done: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Created,
    Running,
    Waiting(String),
    Done,
}

#[derive(Debug, Clone)]
struct Child {
    session: Id,
    turn: Id,
    turn_no: u32,
    run: usize,
    state: State,
    steps: usize,
    outcome: &'static str,
    ask: bool,
    nested: usize,
    guidance: bool,
    hang: bool,
}

/// See the module docs.
#[derive(Debug)]
pub struct DirectProvider {
    root: Id,
    tag: String,
    runs: Vec<Run>,
    children: Vec<Child>,
    sent: Vec<Value>,
    seq: u32,
    calm: bool,
}

const OUTCOMES: [&str; 4] = ["completed", "completed", "failed", "interrupted"];

impl DirectProvider {
    /// A provider process for root `root`; `tag` makes its ids unique per incarnation.
    pub fn new(root: Id, tag: String, _rng: &mut Rng) -> DirectProvider {
        DirectProvider {
            root,
            tag,
            runs: Vec::new(),
            children: Vec::new(),
            sent: Vec::new(),
            seq: 0,
            calm: false,
        }
    }

    fn id(&mut self, what: &str) -> String {
        self.seq += 1;
        format!("{}-{what}{}", self.tag, self.seq)
    }

    fn keep(&mut self, v: Value) -> Value {
        self.sent.push(v.clone());
        v
    }

    fn new_child(&mut self, run: usize, parent: (Id, Id), rng: &mut Rng) -> Vec<Value> {
        let session: Id = self.id("c").into();
        let turn: Id = format!("{session}/t1").into();
        let call = self.id("call");
        let root_turn = self.runs[run].turn.clone();
        let mut out = Vec::new();
        let tool = rng.chance(500);
        if tool {
            out.push(json!({"type":"toolCallUpdated","agentSessionId":parent.0,"turnId":parent.1,"toolCallId":call,"name":"spawn","status":"started"}));
        }
        out.push(self.keep(
            json!({"type":"childSessionCreated","agentSessionId":session,"turnId":turn,
            "parentAgentSessionId":parent.0,"parentTurnId":parent.1,"parentToolCallId":call,
            "rootAgentSessionId":self.root,"rootTurnId":root_turn,"title":"helper",
            "providerSessionId":format!("{session}-native")}),
        ));
        if tool {
            out.push(json!({"type":"toolCallUpdated","agentSessionId":parent.0,"turnId":parent.1,"toolCallId":call,"name":"spawn","status":"completed"}));
        }
        let depth_ok = parent.0 == self.root || rng.chance(500);
        self.children.push(Child {
            session,
            turn,
            turn_no: 1,
            run,
            state: State::Created,
            steps: rng.range(0, 3),
            outcome: OUTCOMES[rng.below(OUTCOMES.len())],
            ask: rng.chance(300),
            nested: if depth_ok && rng.chance(250) { 1 } else { 0 },
            guidance: rng.chance(150),
            hang: !self.calm && rng.chance(80),
        });
        out
    }

    fn run_ready(&self, r: usize) -> bool {
        let run = &self.runs[r];
        if run.done {
            return false;
        }
        if !run.started || run.stopped || run.spawns > 0 || run.messages > 0 {
            return true;
        }
        // The run ends after its children's planned guidance turns were opened.
        !self.children.iter().any(|c| c.run == r && c.guidance)
    }

    fn child_ready(&self, c: &Child) -> bool {
        match c.state {
            State::Created => true,
            State::Running => !c.hang || self.calm,
            State::Waiting(_) => false,
            State::Done => c.guidance && !self.runs[c.run].done && !self.runs[c.run].stopped,
        }
    }

    fn step_run(&mut self, r: usize, rng: &mut Rng) -> Vec<Value> {
        let root = self.root.clone();
        let run = self.runs[r].clone();
        if !run.started {
            self.runs[r].started = true;
            return vec![self.keep(json!({"type":"rootProviderTurnStarted","agentSessionId":root,"turnId":run.turn,"providerTurnId":run.provider_turn}))];
        }
        if run.stopped || (run.spawns == 0 && run.messages == 0) {
            self.runs[r].done = true;
            let (outcome, error) = if run.stopped {
                ("interrupted", Some("stopped"))
            } else {
                let o = OUTCOMES[rng.below(OUTCOMES.len())];
                (o, (o != "completed").then_some("the model failed"))
            };
            return vec![self.keep(
                json!({"type":"rootProviderTurnCompleted","agentSessionId":root,"turnId":run.turn,
                "providerTurnId":run.provider_turn,"outcome":outcome,"error":error}),
            )];
        }
        if run.messages > 0 && (run.spawns == 0 || rng.chance(500)) {
            self.runs[r].messages -= 1;
            let m = self.id("m");
            return vec![self.keep(json!({"type":"messageAppended","agentSessionId":root,"turnId":run.turn,"messageId":m,"role":"assistant","text":"working"}))];
        }
        self.runs[r].spawns -= 1;
        self.new_child(r, (root, run.turn), rng)
    }

    fn step_child(&mut self, i: usize, rng: &mut Rng) -> Vec<Value> {
        let c = self.children[i].clone();
        let (s, t) = (c.session.clone(), c.turn.clone());
        match c.state {
            State::Created => {
                self.children[i].state = State::Running;
                vec![
                    json!({"type":"turnStarted","agentSessionId":s,"turnId":t,"providerTurnId":format!("{t}-native")}),
                ]
            }
            State::Done => {
                // Guidance into the child: its next turn.
                let n = c.turn_no + 1;
                let turn: Id = format!("{s}/t{n}").into();
                let ch = &mut self.children[i];
                ch.turn_no = n;
                ch.turn = turn.clone();
                ch.state = State::Running;
                ch.guidance = false;
                ch.steps = rng.range(0, 2);
                vec![json!({"type":"turnStarted","agentSessionId":s,"turnId":turn})]
            }
            State::Running if c.ask => {
                let req = self.id("q");
                let ch = &mut self.children[i];
                ch.ask = false;
                ch.state = State::Waiting(req.clone());
                vec![
                    json!({"type":"interactionRequested","agentSessionId":s,"turnId":t,"requestId":req,
                        "providerTurnId":format!("{t}-native"),"kind":"approval","payload":{"command":"ls"}}),
                    json!({"type":"turnWaiting","agentSessionId":s,"turnId":t}),
                ]
            }
            State::Running if c.nested > 0 => {
                self.children[i].nested -= 1;
                self.new_child(c.run, (s, t), rng)
            }
            State::Running if c.steps > 0 => {
                self.children[i].steps -= 1;
                if rng.chance(300) {
                    let call = self.id("tool");
                    vec![
                        json!({"type":"toolCallUpdated","agentSessionId":s,"turnId":t,"toolCallId":call,"name":"shell","status":"completed"}),
                    ]
                } else {
                    let m = self.id("m");
                    vec![self.keep(json!({"type":"messageAppended","agentSessionId":s,"turnId":t,"messageId":m,"role":"assistant","text":"progress"}))]
                }
            }
            State::Running => {
                self.children[i].state = State::Done;
                let error = matches!(c.outcome, "failed" | "interrupted").then_some("child failed");
                vec![self.keep(json!({"type":"turnTerminal","agentSessionId":s,"turnId":t,"outcome":c.outcome,"error":error}))]
            }
            State::Waiting(_) => Vec::new(),
        }
    }
}

impl Provider for DirectProvider {
    fn receive(&mut self, _now: Millis, msg: &Value, rng: &mut Rng) -> Vec<Value> {
        let ty = msg.get("type").and_then(Value::as_str).unwrap_or_default();
        let turn: Id = msg
            .get("turnId")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .into();
        match ty {
            "start" => {
                let provider_turn = self.id("p");
                self.runs.push(Run {
                    turn,
                    provider_turn,
                    started: false,
                    spawns: rng.range(0, 4),
                    messages: rng.range(0, 2),
                    stopped: false,
                    done: false,
                });
                Vec::new()
            }
            "guide" => {
                if !self.calm && rng.chance(60) {
                    return vec![
                        json!({"type":"guideFailed","agentSessionId":self.root,"turnId":turn,"error":"write failed"}),
                    ];
                }
                let steer = msg.get("mode").and_then(Value::as_str) == Some("steer");
                let live = self
                    .runs
                    .iter()
                    .rposition(|r| r.turn == turn && !r.done && !r.stopped);
                match (steer, live) {
                    (true, Some(r)) => self.runs[r].spawns += rng.below(2),
                    _ => {
                        let provider_turn = self.id("p");
                        self.runs.push(Run {
                            turn,
                            provider_turn,
                            started: false,
                            spawns: rng.below(2),
                            messages: 1,
                            stopped: false,
                            done: false,
                        });
                    }
                }
                Vec::new()
            }
            "cancel" => {
                let op = msg.get("operationId").cloned().unwrap_or(Value::Null);
                let targets = msg
                    .get("targets")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                // Every target is a closed cancellation target from now on, confirmed or not: the
                // runtime answers its pending and future callbacks "cancelled" (the provider never
                // waits on a request nobody can answer).
                for target in &targets {
                    let s = target
                        .get("agentSessionId")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    if let Some(c) = self.children.iter_mut().find(|c| &*c.session == s) {
                        c.ask = false;
                        c.hang = false;
                        if matches!(c.state, State::Waiting(_)) {
                            c.state = State::Running;
                        }
                    }
                }
                if !self.calm && rng.chance(80) {
                    return vec![
                        json!({"type":"cancelFailed","operationId":op,"error":"broken pipe"}),
                    ];
                }
                let mut acked = Vec::new();
                let mut terminals = Vec::new();
                for target in targets {
                    let s = target
                        .get("agentSessionId")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    let t = target
                        .get("turnId")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    if s == &*self.root {
                        for r in self.runs.iter_mut().filter(|r| &*r.turn == t && !r.done) {
                            r.stopped = true;
                        }
                        if self.calm || !rng.chance(100) {
                            acked.push(target.clone());
                        }
                        continue;
                    }
                    let Some(c) = self
                        .children
                        .iter_mut()
                        .find(|c| &*c.session == s && &*c.turn == t && c.state != State::Done)
                    else {
                        continue;
                    };
                    if self.calm || !rng.chance(150) {
                        c.state = State::Done;
                        c.guidance = false;
                        acked.push(target.clone());
                        terminals.push(json!({"type":"turnTerminal","agentSessionId":s,"turnId":t,"outcome":"canceled"}));
                    } else {
                        // Not confirmed: it simply goes on. A pending callback of a closed target
                        // is answered "cancelled" (the provider must never wait on a request
                        // nobody can answer), so a waiting child runs again.
                        c.hang = false;
                        if matches!(c.state, State::Waiting(_)) {
                            c.state = State::Running;
                        }
                    }
                }
                let answer = json!({"type":"cancelResult","operationId":op,"acked":acked});
                if rng.chance(500) {
                    terminals.insert(0, answer);
                } else {
                    terminals.push(answer);
                }
                terminals
            }
            "dropped" => {
                // The engine did not take one of our callbacks: answer it ourselves ("cancelled").
                let req = msg
                    .pointer("/event/requestId")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                if let Some(c) = self
                    .children
                    .iter_mut()
                    .find(|c| c.state == State::Waiting(req.to_string()))
                {
                    c.state = State::Running;
                }
                Vec::new()
            }
            "respondInteraction" => {
                let req = msg
                    .get("requestId")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let Some(c) = self
                    .children
                    .iter_mut()
                    .find(|c| c.state == State::Waiting(req.to_string()))
                else {
                    return Vec::new();
                };
                c.state = State::Running;
                vec![
                    json!({"type":"interactionResolved","agentSessionId":c.session,"turnId":c.turn,"requestId":req,"resolution":{"answered":true}}),
                    json!({"type":"turnStarted","agentSessionId":c.session,"turnId":c.turn}),
                ]
            }
            _ => Vec::new(),
        }
    }

    fn step(&mut self, _now: Millis, rng: &mut Rng, faults: bool) -> Vec<Value> {
        if faults && !self.sent.is_empty() && rng.chance(40) {
            // A transport may deliver a recent line twice (not an ancient one: a provider turn
            // start is only repeated while it is the latest root lifecycle fact).
            let recent = self.sent.len().saturating_sub(3);
            let i = recent + rng.below(self.sent.len() - recent);
            let dup = self.sent[i].clone();
            let start = dup.get("type").and_then(Value::as_str) == Some("rootProviderTurnStarted");
            let latest_root = self.sent.iter().rev().find(|v| {
                matches!(
                    v.get("type").and_then(Value::as_str),
                    Some("rootProviderTurnStarted" | "rootProviderTurnCompleted")
                )
            });
            let stale = start
                && latest_root.and_then(|v| v.get("providerTurnId")) != dup.get("providerTurnId");
            if !stale {
                return vec![dup];
            }
        }
        let runs: Vec<usize> = (0..self.runs.len())
            .filter(|&r| self.run_ready(r))
            .collect();
        let kids: Vec<usize> = (0..self.children.len())
            .filter(|&i| self.child_ready(&self.children[i]))
            .collect();
        let n = runs.len() + kids.len();
        if n == 0 {
            return Vec::new();
        }
        let k = rng.below(n);
        if k < runs.len() {
            self.step_run(runs[k], rng)
        } else {
            self.step_child(kids[k - runs.len()], rng)
        }
    }

    fn busy(&self) -> bool {
        (0..self.runs.len()).any(|r| self.run_ready(r))
            || self.children.iter().any(|c| self.child_ready(c))
    }

    fn calm(&mut self) {
        self.calm = true;
        for c in &mut self.children {
            c.hang = false;
        }
    }
}

/// The adapter of the direct provider, which speaks the engine's own vocabulary: an engine
/// request goes down as its wire JSON, a line from the provider is an input already (an event or
/// a runtime answer), and an `interactionRequested` the engine did not take goes down as
/// `{"type":"dropped","event":...}` (the provider answers it itself).
#[derive(Debug, Default, Clone, Copy)]
pub struct DirectAdapter;

impl tutti_core::adapters::Adapter for DirectAdapter {
    fn open(&mut self, _now: Millis) -> tutti_core::adapters::AdapterOutput {
        tutti_core::adapters::AdapterOutput::default()
    }

    fn on_request(
        &mut self,
        _now: Millis,
        request: &tutti_core::ProviderRequest,
    ) -> tutti_core::adapters::AdapterOutput {
        tutti_core::adapters::AdapterOutput {
            native: serde_json::to_value(request).into_iter().collect(),
            ..Default::default()
        }
    }

    fn on_native(
        &mut self,
        _now: Millis,
        message: &Value,
    ) -> Result<tutti_core::adapters::AdapterOutput, tutti_core::adapters::AdapterError> {
        use tutti_core::adapters::{AdapterError, AdapterOutput};
        let input: tutti_core::Input = serde_json::from_value(message.clone())
            .map_err(|e| AdapterError::Malformed(e.to_string()))?;
        match input {
            tutti_core::Input::Event(e) => Ok(AdapterOutput {
                events: vec![e],
                ..Default::default()
            }),
            tutti_core::Input::Runtime(a) => Ok(AdapterOutput {
                answers: vec![a],
                ..Default::default()
            }),
            tutti_core::Input::Command(_) => Err(AdapterError::Malformed(
                "a provider does not send commands".into(),
            )),
        }
    }

    fn on_timer(&mut self, _now: Millis, _id: &str) -> tutti_core::adapters::AdapterOutput {
        tutti_core::adapters::AdapterOutput::default()
    }

    fn on_dropped(
        &mut self,
        _now: Millis,
        event: &tutti_core::NormalizedEvent,
    ) -> tutti_core::adapters::AdapterOutput {
        let native = serde_json::to_value(event)
            .map(|v| json!({"type": "dropped", "event": v}))
            .into_iter()
            .collect();
        tutti_core::adapters::AdapterOutput {
            native,
            ..Default::default()
        }
    }
}
