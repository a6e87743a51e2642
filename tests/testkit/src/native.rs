//! The `*_native` fuzz targets: native lines through a real adapter, the engine and the
//! [`Driver`] that wires them ([`LineDriver`]): no panic, garbage is a typed error, [`check_all`]
//! after every line.

use crate::checks::{check_all, History};
use crate::harness::MAX_INPUTS;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use tutti_core::adapters::{parse_line, Adapter};
use tutti_core::driver::{Driver, DriverInput, LaunchSpec, Output, Record, Testkit};
use tutti_core::input::{Command, Input};
use tutti_core::model::{Id, Millis, SessionKind};
use tutti_core::store::MemoryStore;
use tutti_core::Engine;

/// Lines a [`LineDriver`] reads at most from one input.
pub const MAX_LINES: usize = 4_000;

/// Timer rounds `!timers` fires at most (a timer may arm another).
const TIMER_ROUNDS: usize = 64;

/// Makes a fresh adapter for the root (at the start, and after `!exit` when the engine asks to
/// start the provider again).
pub type MakeAdapter = fn() -> Box<dyn Adapter>;

/// Drives one real adapter and the engine from text lines through a [`Driver`] (the host's
/// side: a [`MemoryStore`] that commits every batch, the clock, the provider's lines):
///
/// - `{...}` or `<< {...}`: a native message from the provider (a line that is not a JSON object
///   gets the adapter's typed error from [`parse_line`]; an adapter error is a typed error too:
///   the line is dropped, nothing else happens);
/// - `>> {...}`: a message the capturing client sent; a request teaches which adapter request id
///   the transcript's id stands for, so captured responses reach the adapter's own requests;
/// - `!submit`, `!cancel`, `!cancel-child N`, `!respond N allow|deny`, `!delete N`, `!timers`,
///   `!tick MS`, `!reload`, `!exit`, `!ack`, `!nack`: the user, the clock, the runtime.
///
/// The wiring (events before answers, engine requests to the adapter, an `interactionRequested`
/// the engine did not take back to `on_dropped`, timers) is the driver's; after every line the
/// host commits what was decided and [`check_all`] runs. After `!exit` the driver launches a new
/// adapter (made by the [`MakeAdapter`]) when the engine starts the provider again.
pub struct LineDriver {
    driver: Driver,
    /// The reference store every batch is committed to.
    pub store: MemoryStore,
    /// What was seen so far.
    pub history: History,
    /// The clock.
    pub now: Millis,
    root: Id,
    convert: fn(&Value, usize) -> Option<Value>,
    /// JSON-RPC requests the adapter sent and the transcript has not named yet: (id, method).
    unanswered: Vec<(Value, String)>,
    /// Transcript request id (JSON text) -> the adapter's id.
    ids: BTreeMap<String, Value>,
    /// Sidecar commands (`op` + string `id`) not acknowledged yet.
    commands: VecDeque<Value>,
    turns: u32,
    ops: u32,
    lines: usize,
    /// Engine inputs decided so far.
    inputs: usize,
    /// Every native message the adapter wrote, in order (at most [`MAX_INPUTS`]).
    pub native: Vec<Value>,
}

fn identity(v: &Value, _: usize) -> Option<Value> {
    Some(v.clone())
}

impl LineDriver {
    /// Creates root session `root` (provider `provider`), attaches an adapter made by `make`
    /// (which opens it) and submits `turn-1`.
    pub fn new(
        make: MakeAdapter,
        provider: &str,
        convert: Option<fn(&Value, usize) -> Option<Value>>,
    ) -> Result<Self, String> {
        let root: Id = "root".into();
        let mut driver = Driver::new();
        driver.set_recording(true);
        driver.set_factory(Box::new(move |_: &LaunchSpec| Some(make())));
        let adapter = make();
        let mut d = LineDriver {
            driver,
            store: MemoryStore::new(),
            history: History::new(),
            now: 0,
            root: root.clone(),
            convert: convert.unwrap_or(identity),
            unanswered: Vec::new(),
            ids: BTreeMap::new(),
            commands: VecDeque::new(),
            turns: 1,
            ops: 0,
            lines: 0,
            inputs: 0,
            native: Vec::new(),
        };
        // What the adapter type declares (as the daemon's registry passes it).
        let declared = match provider {
            "codex" => tutti_core::adapters::codex::CodexAdapter::CAPABILITIES,
            "claude" => tutti_core::adapters::claude::ClaudeAdapter::CAPABILITIES,
            _ => tutti_core::adapters::acp::AcpAdapter::CAPABILITIES,
        };
        d.command(Command::CreateSession {
            agent_session_id: root.clone(),
            workspace_id: "W".into(),
            provider: provider.into(),
            title: None,
            capabilities: Some(declared),
        })?;
        let _ = d.driver.handle(
            DriverInput::Attach {
                now: d.now,
                root: root.clone(),
                adapter,
            },
            &d.store,
        );
        d.settle()?;
        d.command(Command::Submit {
            agent_session_id: root,
            turn_id: "turn-1".into(),
            text: "hello".into(),
        })?;
        Ok(d)
    }

    /// The engine (read-only: every change goes through the driver).
    pub fn engine(&self) -> &Engine {
        self.driver.engine()
    }

    /// Commits what the driver decided to the store, notes what the adapter wrote, and checks.
    fn settle(&mut self) -> Result<(), String> {
        for o in self.driver.commit_pending(&mut self.store) {
            let Output::Transmit(t) = o else { continue };
            for n in t.messages {
                match (
                    n.get("id"),
                    n.get("method").and_then(Value::as_str),
                    n.get("op"),
                ) {
                    (Some(id), Some(m), _) => self.unanswered.push((id.clone(), m.to_string())),
                    (Some(_), None, Some(_)) => self.commands.push_back(n.clone()),
                    _ => {}
                }
                if self.native.len() < MAX_INPUTS {
                    self.native.push(n);
                }
            }
        }
        for r in self.driver.take_records() {
            if let Record::Decided { input, .. } = r {
                self.inputs += 1;
                if self.inputs > MAX_INPUTS {
                    return Err(format!(
                        "more than {MAX_INPUTS} inputs (last {}): a loop between adapter and engine?",
                        input.kind()
                    ));
                }
            }
        }
        check_all(self.driver.engine(), &self.store, &mut self.history)
    }

    fn command(&mut self, c: Command) -> Result<(), String> {
        let _ = self.driver.handle(
            DriverInput::Host {
                now: self.now,
                input: Input::Command(c),
                reply: None,
            },
            &self.store,
        );
        self.settle()
    }

    fn native(&mut self, v: Value) -> Result<(), String> {
        let Some(v) = (self.convert)(&v, self.lines) else {
            return Ok(());
        };
        if let Some(t) = v.get("__t").and_then(Value::as_i64) {
            self.now = self.now.max(t);
        }
        let root = self.root.clone();
        match self.driver.handle(
            DriverInput::Native {
                now: self.now,
                root: &root,
                message: &v,
            },
            &self.store,
        ) {
            Ok(()) => self.settle(),
            // A typed error: the line is dropped.
            Err(_) => Ok(()),
        }
    }

    fn nth_active_child(&self, n: usize) -> Option<(Id, Id)> {
        let snap = self.engine().snapshot(&self.root)?;
        let v: Vec<(Id, Id)> = snap
            .sessions
            .iter()
            .filter(|s| s.kind() == SessionKind::Child)
            .filter_map(|s| s.active_turn_id.clone().map(|t| (s.id.clone(), t)))
            .collect();
        v.get(n % v.len().max(1)).cloned()
    }

    fn control(&mut self, line: &str) -> Result<(), String> {
        let mut words = line.split_whitespace();
        let cmd = words.next().unwrap_or_default();
        let n: usize = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
        let root = self.root.clone();
        match cmd {
            "!submit" => {
                self.turns += 1;
                let turn = format!("turn-{}", self.turns);
                self.command(Command::Submit {
                    agent_session_id: root,
                    turn_id: turn.into(),
                    text: "more".into(),
                })?;
            }
            "!cancel" => {
                self.ops += 1;
                if let Some(turn) = self
                    .engine()
                    .session(&root)
                    .and_then(|s| s.active_turn_id.clone())
                {
                    self.command(Command::CancelTurn {
                        operation_id: format!("op{}", self.ops).into(),
                        agent_session_id: root,
                        turn_id: turn,
                    })?;
                }
            }
            "!cancel-child" => {
                self.ops += 1;
                if let Some((s, t)) = self.nth_active_child(n) {
                    self.command(Command::CancelTurn {
                        operation_id: format!("op{}", self.ops).into(),
                        agent_session_id: s,
                        turn_id: t,
                    })?;
                }
            }
            "!respond" => {
                let pending = self.engine().pending_interactions(&root);
                if let Some(i) = pending.get(n % pending.len().max(1)) {
                    let allow = !line.contains("deny");
                    self.command(Command::RespondInteraction {
                        agent_session_id: i.agent_session_id.clone(),
                        turn_id: i.turn_id.clone(),
                        request_id: i.request_id.clone(),
                        response: json!(if allow { "allow" } else { "deny" }),
                    })?;
                }
            }
            "!delete" => {
                let ids: Vec<Id> = self
                    .engine()
                    .snapshot(&root)
                    .map(|s| s.sessions.into_iter().map(|s| s.id).collect())
                    .unwrap_or_default();
                if let Some(s) = ids.get(n % ids.len().max(1)) {
                    self.command(Command::DeleteSession {
                        agent_session_id: s.clone(),
                    })?;
                }
            }
            "!timers" => self.fire_all()?,
            "!tick" => {
                self.now += n.min(1_000_000) as Millis;
                let _ = self
                    .driver
                    .handle(DriverInput::Timeout(self.now), &self.store);
                self.settle()?;
            }
            "!reload" => {
                if !self.driver.reload(&root, &self.store) {
                    return Err(format!("stored tree {root} does not reload"));
                }
                check_all(self.driver.engine(), &self.store, &mut self.history)
                    .map_err(|e| format!("after reload: {e}"))?;
            }
            "!exit" => {
                let _ = self.driver.handle(
                    DriverInput::Exit {
                        now: self.now,
                        root: &root,
                        error: "killed",
                    },
                    &self.store,
                );
                self.settle()?;
            }
            "!ack" | "!nack" => {
                let msg = if let Some(c) = self.commands.pop_front() {
                    Some(
                        json!({"kind":"ack","id":c.get("id"),"ok":cmd == "!ack","error":(cmd == "!nack").then_some("refused")}),
                    )
                } else if !self.unanswered.is_empty() {
                    let (id, _) = self.unanswered.remove(0);
                    Some(if cmd == "!ack" {
                        json!({"jsonrpc":"2.0","id":id,"result":{}})
                    } else {
                        json!({"jsonrpc":"2.0","id":id,"error":{"code":-32603,"message":"refused"}})
                    })
                } else {
                    None
                };
                if let Some(msg) = msg {
                    if self
                        .driver
                        .handle(
                            DriverInput::Native {
                                now: self.now,
                                root: &root,
                                message: &msg,
                            },
                            &self.store,
                        )
                        .is_ok()
                    {
                        self.settle()?;
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Advances the clock to every armed timer (adapter and engine), earliest first, and fires
    /// it.
    pub fn fire_all(&mut self) -> Result<(), String> {
        for _ in 0..TIMER_ROUNDS {
            let Some(at) = self.driver.poll_timeout() else {
                break;
            };
            self.now = self.now.max(at);
            let _ = self
                .driver
                .handle(DriverInput::Timeout(self.now), &self.store);
            self.settle()?;
        }
        Ok(())
    }

    /// Feeds one line (see the type docs).
    pub fn line(&mut self, raw: &str) -> Result<(), String> {
        self.lines += 1;
        let line = raw.trim();
        if line.is_empty() || self.lines > MAX_LINES {
            return Ok(());
        }
        self.now += 1;
        if line.starts_with('!') {
            return self.control(line);
        }
        if let Some(sent) = line.strip_prefix(">>") {
            // The capturing client's request: learn which adapter request it stands for.
            if let Ok(v) = serde_json::from_str::<Value>(sent.trim()) {
                if let (Some(id), Some(m)) = (v.get("id"), v.get("method").and_then(Value::as_str))
                {
                    if let Some(k) = self.unanswered.iter().position(|(_, um)| um == m) {
                        let (ours, _) = self.unanswered.remove(k);
                        self.ids.insert(id.to_string(), ours);
                    }
                }
            }
            return Ok(());
        }
        let text = line.strip_prefix("<<").unwrap_or(line).trim();
        let mut v = match parse_line(text) {
            Ok(v) => v,
            Err(_) => return Ok(()), // typed error: dropped
        };
        if v.get("method").is_none() {
            if let Some(ours) = v
                .get("id")
                .and_then(|id| self.ids.get(&id.to_string()))
                .cloned()
            {
                v["id"] = ours;
            }
        }
        if let Some(id) = v.get("id").filter(|_| v.get("method").is_none()) {
            self.unanswered.retain(|(u, _)| u != id);
        }
        self.native(v)
    }

    /// Feeds every line of `data` (invalid UTF-8 is replaced), then fires every timer and checks
    /// once more.
    pub fn run(mut self, data: &[u8]) -> Result<Self, String> {
        let text = String::from_utf8_lossy(data);
        for l in text.split('\n') {
            self.line(l)?;
        }
        self.fire_all()?;
        check_all(self.driver.engine(), &self.store, &mut self.history)?;
        Ok(self)
    }
}

/// Fuzz target `acp_native`: native ACP lines through [`tutti_core::adapters::acp::AcpAdapter`] and
/// the engine.
pub fn try_acp_native(data: &[u8]) -> Result<(), String> {
    LineDriver::new(
        || {
            Box::new(tutti_core::adapters::acp::AcpAdapter::new(
                "root".into(),
                tutti_core::adapters::acp::AcpConfig::default(),
            ))
        },
        "acp",
        None,
    )?
    .run(data)
    .map(|_| ())
}

/// Fuzz target `acp_native`; panics with the broken rule.
pub fn acp_native(data: &[u8]) {
    if let Err(e) = try_acp_native(data) {
        panic!("acp_native: {e}");
    }
}

/// Fuzz target `codex_native`: app-server lines (`<<` / `>>` transcripts as captured) through
/// [`tutti_core::adapters::codex::CodexAdapter`] and the engine.
pub fn try_codex_native(data: &[u8]) -> Result<(), String> {
    LineDriver::new(
        || {
            Box::new(tutti_core::adapters::codex::CodexAdapter::new(
                "root".into(),
                tutti_core::adapters::codex::CodexConfig::default(),
            ))
        },
        "codex",
        None,
    )?
    .run(data)
    .map(|_| ())
}

/// Fuzz target `codex_native`; panics with the broken rule.
pub fn codex_native(data: &[u8]) {
    if let Err(e) = try_codex_native(data) {
        panic!("codex_native: {e}");
    }
}

/// Fuzz target `claude_native`: captured Claude rows (SDK messages, `__hook`, `__canUseTool`) or
/// sidecar lines through [`tutti_core::adapters::claude::ClaudeAdapter`] and the engine.
pub fn try_claude_native(data: &[u8]) -> Result<(), String> {
    LineDriver::new(
        || {
            Box::new(tutti_core::adapters::claude::ClaudeAdapter::new(
                "root".into(),
                tutti_core::adapters::claude::ClaudeConfig::default(),
            ))
        },
        "claude",
        Some(tutti_core::adapters::claude::sidecar_line),
    )?
    .run(data)
    .map(|_| ())
}

/// Fuzz target `claude_native`; panics with the broken rule.
pub fn claude_native(data: &[u8]) {
    if let Err(e) = try_claude_native(data) {
        panic!("claude_native: {e}");
    }
}
