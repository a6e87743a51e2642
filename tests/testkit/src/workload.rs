//! A generator of plausible engine inputs, shared by the equivalence proptest, the crash loop
//! binary and the benchmark.
//!
//! Abstract [`Op`]s name sessions by index; a [`Driver`] resolves them against what it created so
//! far and the engine's current state, feeds the input to the engine and returns the step.
//! Everything is deterministic: the same ops on a fresh engine give the same steps.

use serde_json::json;
use tutti_core::input::{Command, Input, NormalizedEvent, RuntimeAnswer, TimerId};
use tutti_core::model::{Id, Outcome, ProviderAliases, Target};
use tutti_core::{Engine, Step};

/// splitmix64: tiny, deterministic, good enough for workloads.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    // Not an iterator: an endless draw, named as every generator in the tests names it.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    pub fn idx(&mut self) -> u16 {
        (self.next() & 0xffff) as u16
    }
}

/// An abstract input. Indexes pick among the sessions/operations created so far (modulo).
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    CreateRoot {
        workspace: u8,
    },
    Submit {
        root: u16,
    },
    ProviderStarted {
        root: u16,
    },
    ProviderCompleted {
        root: u16,
        outcome: u8,
    },
    ChildCreated {
        parent: u16,
    },
    ChildUpdated {
        child: u16,
    },
    TurnStarted {
        child: u16,
    },
    TurnWaiting {
        child: u16,
    },
    TurnTerminal {
        child: u16,
        outcome: u8,
    },
    Message {
        session: u16,
        len: u16,
    },
    ToolCall {
        session: u16,
        call: u8,
    },
    InteractionRequested {
        session: u16,
    },
    InteractionResolved {
        interaction: u16,
    },
    Respond {
        interaction: u16,
        with_response: bool,
    },
    Cancel {
        session: u16,
    },
    CancelResult {
        op: u16,
        mask: u8,
    },
    CancelFailed {
        op: u16,
    },
    CancelDeadline {
        op: u16,
    },
    Metadata {
        session: u16,
        null_goal: bool,
    },
    GuideFailed {
        root: u16,
    },
    ProviderExited {
        root: u16,
    },
    Delete {
        session: u16,
    },
}

/// Relative weights of the op kinds, in the order of [`Op`]'s variants.
#[derive(Debug, Clone, Copy)]
pub struct Mix(pub [u32; 22]);

impl Mix {
    /// Everything, evenly-ish: for equivalence and crash tests.
    pub const ALL: Mix = Mix([
        4, 6, 5, 5, 8, 2, 5, 2, 6, 10, 4, 3, 2, 2, 3, 3, 1, 1, 2, 1, 1, 2,
    ]);
    /// A busy daemon: mostly transcript, with sessions, children and terminals.
    pub const BENCH: Mix = Mix([
        1, 4, 4, 4, 4, 1, 4, 1, 4, 40, 6, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 1,
    ]);
}

impl Op {
    pub fn random(rng: &mut Rng, mix: Mix) -> Op {
        let total: u64 = mix.0.iter().map(|&w| u64::from(w)).sum();
        let mut pick = rng.below(total);
        let mut kind = 0;
        for (i, &w) in mix.0.iter().enumerate() {
            if pick < u64::from(w) {
                kind = i;
                break;
            }
            pick -= u64::from(w);
        }
        let a = rng.idx();
        let b = rng.next();
        match kind {
            0 => Op::CreateRoot {
                workspace: (b % 3) as u8,
            },
            1 => Op::Submit { root: a },
            2 => Op::ProviderStarted { root: a },
            3 => Op::ProviderCompleted {
                root: a,
                outcome: b as u8,
            },
            4 => Op::ChildCreated { parent: a },
            5 => Op::ChildUpdated { child: a },
            6 => Op::TurnStarted { child: a },
            7 => Op::TurnWaiting { child: a },
            8 => Op::TurnTerminal {
                child: a,
                outcome: b as u8,
            },
            9 => Op::Message {
                session: a,
                len: (b % 600) as u16,
            },
            10 => Op::ToolCall {
                session: a,
                call: (b % 4) as u8,
            },
            11 => Op::InteractionRequested { session: a },
            12 => Op::InteractionResolved { interaction: a },
            13 => Op::Respond {
                interaction: a,
                with_response: b.is_multiple_of(2),
            },
            14 => Op::Cancel { session: a },
            15 => Op::CancelResult {
                op: a,
                mask: b as u8,
            },
            16 => Op::CancelFailed { op: a },
            17 => Op::CancelDeadline { op: a },
            18 => Op::Metadata {
                session: a,
                null_goal: b.is_multiple_of(5),
            },
            19 => Op::GuideFailed { root: a },
            20 => Op::ProviderExited { root: a },
            _ => Op::Delete { session: a },
        }
    }
}

fn outcome(n: u8) -> Outcome {
    match n % 7 {
        0..=3 => Outcome::Completed,
        4 | 5 => Outcome::Failed,
        _ => Outcome::Interrupted,
    }
}

fn pick<T>(v: &[T], i: u16) -> Option<&T> {
    if v.is_empty() {
        None
    } else {
        v.get(usize::from(i) % v.len())
    }
}

const WORDS: &[&str] = &[
    "the",
    "child",
    "agent",
    "reads",
    "files",
    "and",
    "reports",
    "progress",
    "on",
    "its",
    "task",
    "while",
    "root",
    "turn",
    "waits",
    "for",
    "every",
    "nested",
    "delegation",
    "to",
    "settle",
];

fn text(len: usize, salt: u64) -> String {
    let mut s = String::with_capacity(len + 8);
    let mut i = salt as usize;
    while s.len() < len {
        s.push_str(WORDS[i % WORDS.len()]);
        s.push(' ');
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    s.truncate(len);
    s
}

/// Resolves ops to inputs and runs them through an engine.
#[derive(Debug, Default)]
pub struct Driver {
    pub now: i64,
    counter: u64,
    /// Root session ids.
    pub roots: Vec<Id>,
    /// Every session id (roots and children), in creation order.
    pub sessions: Vec<Id>,
    /// Child session ids.
    pub children: Vec<Id>,
    /// (session, turn, request) of every interaction requested.
    pub interactions: Vec<(Id, Id, Id)>,
    /// Cancel operation ids recorded.
    pub ops: Vec<Id>,
    /// When non-zero, message texts are at most this long (benchmark knob).
    pub text_max: u16,
    /// With `window > 0`, ops act only on the newest `window` root trees (a daemon's working
    /// set); 0 means every tree ever created.
    pub window: usize,
    /// Per root (same index as `roots`): its sessions, and its child sessions.
    trees: Vec<(Vec<Id>, Vec<Id>)>,
    root_index: std::collections::HashMap<Id, usize>,
    /// Ids recorded in the lists above (children and operations), for de-duplication.
    known: std::collections::HashSet<Id>,
    /// Inputs accepted / rejected.
    pub accepted: u64,
    pub rejected: u64,
}

impl Driver {
    pub fn new() -> Driver {
        Driver {
            now: 1_700_000_000_000,
            ..Driver::default()
        }
    }

    /// A driver whose ops act on the newest `window` trees only.
    pub fn windowed(window: usize) -> Driver {
        Driver {
            window,
            ..Driver::new()
        }
    }

    /// Which tree an index picks, in windowed mode.
    fn window_tree(&self, i: u16) -> Option<usize> {
        let n = self.roots.len();
        if n == 0 {
            return None;
        }
        let w = self.window.min(n);
        Some(n - 1 - usize::from(i) % w)
    }

    fn pick_root(&self, i: u16) -> Option<&Id> {
        if self.window == 0 {
            return pick(&self.roots, i);
        }
        self.roots.get(self.window_tree(i)?)
    }

    fn pick_session(&self, i: u16) -> Option<&Id> {
        if self.window == 0 {
            return pick(&self.sessions, i);
        }
        let t = &self.trees.get(self.window_tree(i)?)?.0;
        pick(t, i / self.window.max(1) as u16)
    }

    fn pick_child(&self, i: u16) -> Option<&Id> {
        if self.window == 0 {
            return pick(&self.children, i);
        }
        let t = &self.trees.get(self.window_tree(i)?)?.1;
        pick(t, i / self.window.max(1) as u16)
    }

    /// The ids an index may pick: all, or the newest ones in windowed mode.
    fn recent<'a, T>(&self, v: &'a [T]) -> &'a [T] {
        if self.window == 0 {
            v
        } else {
            &v[v.len().saturating_sub(4 * self.window)..]
        }
    }

    fn tick(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    fn fresh(&mut self, prefix: &str) -> Id {
        self.counter += 1;
        Id::from(format!("{prefix}{}", self.counter))
    }

    fn active_turn(engine: &Engine, session: &Id) -> Option<Id> {
        engine
            .session(session)
            .and_then(|s| s.active_turn_id.clone())
    }

    fn last_turn(engine: &Engine, session: &Id) -> Option<Id> {
        engine
            .session(session)
            .and_then(|s| s.active_turn_id.clone().or_else(|| s.last_turn_id.clone()))
    }

    /// The input for `op` in the current state, if the op makes sense at all.
    pub fn input(&mut self, engine: &Engine, op: &Op) -> Option<Input> {
        let input: Input = match op {
            Op::CreateRoot { workspace } => Command::CreateSession {
                agent_session_id: self.fresh("root-"),
                workspace_id: Id::from(format!("ws{workspace}")),
                provider: Id::from("codex"),
                title: Some(format!("conversation {}", self.counter)),
                capabilities: None,
            }
            .into(),
            Op::Submit { root } => {
                let root = self.pick_root(*root)?.clone();
                let turn_id = self.fresh("turn-");
                Command::Submit {
                    agent_session_id: root,
                    turn_id,
                    text: text(80, self.counter),
                }
                .into()
            }
            Op::ProviderStarted { root } => {
                let root = self.pick_root(*root)?.clone();
                let p = self.fresh("p-");
                NormalizedEvent::RootProviderTurnStarted {
                    agent_session_id: root.clone(),
                    turn_id: Self::active_turn(engine, &root),
                    provider_turn_id: Some(p.to_string()),
                }
                .into()
            }
            Op::ProviderCompleted { root, outcome: o } => {
                let root = self.pick_root(*root)?.clone();
                let s = engine.session(&root)?;
                let turn = s.active_turn_id.clone()?;
                let provider_turn_id = engine
                    .turn(&root, &turn)
                    .and_then(|t| t.root_provider_turn())
                    .and_then(|r| r.provider_turn_id.clone());
                let outcome = outcome(*o);
                NormalizedEvent::RootProviderTurnCompleted {
                    agent_session_id: root,
                    turn_id: Some(turn),
                    provider_turn_id,
                    outcome,
                    error: outcome
                        .allows_error()
                        .then(|| "provider said no".to_string()),
                }
                .into()
            }
            Op::ChildCreated { parent } => {
                let parent = self.pick_session(*parent)?.clone();
                let ps = engine.session(&parent)?;
                let (root, root_turn, parent_turn) = if ps.is_child() {
                    (
                        ps.root_agent_session_id()?.clone(),
                        ps.root_turn_id()?.clone(),
                        Self::last_turn(engine, &parent)?,
                    )
                } else {
                    let t = ps.active_turn_id.clone()?;
                    (parent.clone(), t.clone(), t)
                };
                let id = self.fresh("child-");
                let turn_id = self.fresh("cturn-");
                let call = self.fresh("call-");
                NormalizedEvent::ChildSessionCreated {
                    agent_session_id: id.clone(),
                    turn_id,
                    parent_agent_session_id: parent,
                    parent_turn_id: parent_turn,
                    parent_tool_call_id: Some(call),
                    root_agent_session_id: root,
                    root_turn_id: root_turn,
                    title: Some(format!("helper {}", self.counter)),
                    provider_session_id: Some(format!("thread-{}", self.counter)),
                    provider_aliases: Some(ProviderAliases {
                        thread_id: Some(format!("thread-{}", self.counter)),
                        ..ProviderAliases::default()
                    }),
                }
                .into()
            }
            Op::ChildUpdated { child } => {
                let child = self.pick_child(*child)?.clone();
                let n = self.fresh("");
                NormalizedEvent::ChildSessionUpdated {
                    agent_session_id: child,
                    title: Some(format!("better title {n}")),
                    provider_session_id: None,
                    provider_aliases: Some(ProviderAliases {
                        agent_id: Some(format!("agent-{n}")),
                        ..ProviderAliases::default()
                    }),
                }
                .into()
            }
            Op::TurnStarted { child } => {
                let child = self.pick_child(*child)?.clone();
                let turn = match Self::active_turn(engine, &child) {
                    Some(t) => t,
                    None => self.fresh("gturn-"),
                };
                let p = self.fresh("cp-");
                NormalizedEvent::TurnStarted {
                    agent_session_id: child,
                    turn_id: turn,
                    provider_turn_id: Some(p.to_string()),
                }
                .into()
            }
            Op::TurnWaiting { child } => {
                let child = self.pick_child(*child)?.clone();
                let turn = Self::active_turn(engine, &child)?;
                NormalizedEvent::TurnWaiting {
                    agent_session_id: child,
                    turn_id: turn,
                }
                .into()
            }
            Op::TurnTerminal { child, outcome: o } => {
                let child = self.pick_child(*child)?.clone();
                let turn = Self::last_turn(engine, &child)?;
                let outcome = outcome(*o);
                NormalizedEvent::TurnTerminal {
                    agent_session_id: child,
                    turn_id: turn,
                    outcome,
                    error: outcome.allows_error().then(|| "child failed".to_string()),
                }
                .into()
            }
            Op::Message { session, len } => {
                let session = self.pick_session(*session)?.clone();
                let turn = Self::last_turn(engine, &session)?;
                let id = self.fresh("msg-");
                NormalizedEvent::MessageAppended {
                    agent_session_id: session,
                    turn_id: turn,
                    message_id: id,
                    role: if len % 3 == 0 { "user" } else { "assistant" }.into(),
                    text: text(
                        usize::from(if self.text_max > 0 {
                            *len % self.text_max
                        } else {
                            *len
                        }),
                        self.counter,
                    )
                    .into(),
                }
                .into()
            }
            Op::ToolCall { session, call } => {
                let session = self.pick_session(*session)?.clone();
                let turn = Self::last_turn(engine, &session)?;
                let n = self.tick();
                NormalizedEvent::ToolCallUpdated {
                    agent_session_id: session,
                    turn_id: turn.clone(),
                    tool_call_id: Id::from(format!("tool-{turn}-{call}")),
                    name: Some("shell".into()),
                    status: if n.is_multiple_of(2) {
                        "completed"
                    } else {
                        "started"
                    }
                    .into(),
                    kind: match n % 3 {
                        0 => Some(json!("exec")),
                        // An explicit `null` kind is stored as Some(Null) and must round-trip.
                        1 => Some(serde_json::Value::Null),
                        _ => None,
                    },
                    payload: Some(std::sync::Arc::new(
                        json!({ "cmd": "ls", "n": n, "ratio": 0.1 + n as f64 / 7.0 }),
                    )),
                }
                .into()
            }
            Op::InteractionRequested { session } => {
                let session = self.pick_session(*session)?.clone();
                let turn = Self::active_turn(engine, &session)?;
                let req = self.fresh("req-");
                NormalizedEvent::InteractionRequested {
                    agent_session_id: session,
                    turn_id: turn,
                    request_id: req,
                    provider_turn_id: Some(format!("pt-{}", self.counter)),
                    kind: json!("approval"),
                    payload: json!({ "command": "rm -rf build", "n": self.counter }),
                }
                .into()
            }
            Op::InteractionResolved { interaction } => {
                let (s, t, r) = pick(self.recent(&self.interactions), *interaction)?.clone();
                NormalizedEvent::InteractionResolved {
                    agent_session_id: s,
                    turn_id: t,
                    request_id: r,
                    resolution: json!({ "decision": "approved" }),
                }
                .into()
            }
            Op::Respond {
                interaction,
                with_response,
            } => {
                let (s, t, r) = pick(self.recent(&self.interactions), *interaction)?.clone();
                Command::RespondInteraction {
                    agent_session_id: s,
                    turn_id: t,
                    request_id: r,
                    // No response at all is `null`: stored as Some(Null), which must round-trip.
                    response: if *with_response {
                        json!({ "decision": "approve" })
                    } else {
                        serde_json::Value::Null
                    },
                }
                .into()
            }
            Op::Cancel { session } => {
                let session = self.pick_session(*session)?.clone();
                let turn = Self::active_turn(engine, &session)?;
                let op = self.fresh("cancel-");
                Command::CancelTurn {
                    operation_id: op,
                    agent_session_id: session,
                    turn_id: turn,
                }
                .into()
            }
            Op::CancelResult { op, mask } => {
                let op = pick(self.recent(&self.ops), *op)?.clone();
                let o = engine.cancel_operation(&op)?;
                let acked: Vec<Target> = o
                    .targets
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << (i % 8)) != 0)
                    .map(|(_, t)| t.clone())
                    .collect();
                RuntimeAnswer::CancelResult {
                    operation_id: op,
                    acked,
                }
                .into()
            }
            Op::CancelFailed { op } => RuntimeAnswer::CancelFailed {
                operation_id: pick(self.recent(&self.ops), *op)?.clone(),
                error: "transport closed".to_string(),
            }
            .into(),
            Op::CancelDeadline { op } => RuntimeAnswer::TimerFired {
                timer: TimerId::CancelDeadline {
                    operation_id: pick(self.recent(&self.ops), *op)?.clone(),
                },
            }
            .into(),
            Op::Metadata { session, null_goal } => {
                let session = self.pick_session(*session)?.clone();
                let n = self.tick();
                NormalizedEvent::SessionMetadataUpdated {
                    agent_session_id: session,
                    goal: Some(if *null_goal {
                        serde_json::Value::Null
                    } else {
                        json!({ "status": if n.is_multiple_of(2) { "active" } else { "complete" } })
                    }),
                    title: None,
                    provider_session_id: None,
                    // Every third report carries token use (a cost on odd ticks), so stores
                    // round-trip it, floats included.
                    usage: n.is_multiple_of(3).then(|| tutti_core::model::TokenUsage {
                        total_tokens: Some(n),
                        context_tokens: Some(n / 2),
                        context_window: None,
                        cost: (n % 2 == 1).then(|| tutti_core::model::Cost {
                            amount: n as f64 / 7.0,
                            currency: "USD".into(),
                        }),
                    }),
                }
                .into()
            }
            Op::GuideFailed { root } => {
                let root = self.pick_root(*root)?.clone();
                let turn = Self::active_turn(engine, &root)?;
                RuntimeAnswer::GuideFailed {
                    agent_session_id: root,
                    turn_id: turn,
                    error: "steer refused".to_string(),
                }
                .into()
            }
            Op::ProviderExited { root } => RuntimeAnswer::ProviderExited {
                root_agent_session_id: self.pick_root(*root)?.clone(),
                error: "exit status 1".to_string(),
            }
            .into(),
            Op::Delete { session } => Command::DeleteSession {
                agent_session_id: self.pick_session(*session)?.clone(),
            }
            .into(),
        };
        Some(input)
    }

    /// Feeds one op; returns the step when the engine accepted the input.
    pub fn step(&mut self, engine: &mut Engine, op: &Op) -> Option<Step> {
        let input = self.input(engine, op)?;
        self.now += 1 + (self.counter % 5) as i64;
        match engine.handle(self.now, &input) {
            Ok(step) => {
                self.accepted += 1;
                self.record(&input);
                Some(step)
            }
            Err(_) => {
                self.rejected += 1;
                None
            }
        }
    }

    fn record(&mut self, input: &Input) {
        match input {
            Input::Command(Command::CreateSession {
                agent_session_id, ..
            }) => {
                self.root_index
                    .insert(agent_session_id.clone(), self.roots.len());
                self.trees
                    .push((vec![agent_session_id.clone()], Vec::new()));
                self.roots.push(agent_session_id.clone());
                self.sessions.push(agent_session_id.clone());
            }
            Input::Event(NormalizedEvent::ChildSessionCreated {
                agent_session_id,
                root_agent_session_id,
                ..
            }) if self.known.insert(agent_session_id.clone()) => {
                self.children.push(agent_session_id.clone());
                self.sessions.push(agent_session_id.clone());
                if let Some(t) = self
                    .root_index
                    .get(root_agent_session_id)
                    .and_then(|&i| self.trees.get_mut(i))
                {
                    t.0.push(agent_session_id.clone());
                    t.1.push(agent_session_id.clone());
                }
            }
            Input::Event(NormalizedEvent::InteractionRequested {
                agent_session_id,
                turn_id,
                request_id,
                ..
            }) => self.interactions.push((
                agent_session_id.clone(),
                turn_id.clone(),
                request_id.clone(),
            )),
            Input::Command(Command::CancelTurn { operation_id, .. })
                if self.known.insert(operation_id.clone()) =>
            {
                self.ops.push(operation_id.clone());
            }
            _ => {}
        }
    }
}

/// A deterministic stream of non-empty persist batches from a seed: what the crash loop writes
/// and what its checker recomputes.
pub struct Stream {
    pub rng: Rng,
    pub mix: Mix,
    pub engine: Engine,
    pub driver: Driver,
}

impl Stream {
    pub fn new(seed: u64, mix: Mix) -> Stream {
        Stream {
            rng: Rng(seed),
            mix,
            engine: Engine::new(),
            driver: Driver::new(),
        }
    }

    /// A stream whose ops act on the newest `window` trees: a daemon's working set.
    pub fn windowed(seed: u64, mix: Mix, window: usize) -> Stream {
        Stream {
            driver: Driver::windowed(window),
            ..Stream::new(seed, mix)
        }
    }

    /// The next accepted step with something to persist.
    pub fn next_step(&mut self) -> Step {
        loop {
            // Keep a few roots around so that everything else has something to act on.
            let op = if self.driver.roots.len() < 3 {
                Op::CreateRoot {
                    workspace: (self.rng.next() % 3) as u8,
                }
            } else {
                Op::random(&mut self.rng, self.mix)
            };
            if let Some(step) = self.driver.step(&mut self.engine, &op) {
                if !step.persist.is_empty() {
                    return step;
                }
            }
        }
    }
}
