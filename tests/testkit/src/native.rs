//! The `*_native` fuzz targets: native lines through a real adapter and the engine
//! ([`LineDriver`]): no panic, garbage is a typed error, [`check_all`] after every engine step.

use crate::checks::check_all;
use crate::harness::{Harness, MAX_INPUTS};
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use tutti_core::adapters::{parse_line, take_due, Adapter, AdapterOutput, AdapterTimer};
use tutti_core::input::{Command, Input, NormalizedEvent, RuntimeAnswer};
use tutti_core::model::{Id, Millis, SessionKind};
use tutti_core::step::{ProviderRequest, TimerRequest};

/// Lines a [`LineDriver`] reads at most from one input.
pub const MAX_LINES: usize = 4_000;

/// Drives one real adapter and the engine from text lines, as the runtime would:
///
/// - `{...}` or `<< {...}`: a native message from the provider (a line that is not a JSON object
///   gets the adapter's typed error from [`parse_line`]; an `Err` from `on_native` is a typed
///   error too: the line is dropped, nothing else happens);
/// - `>> {...}`: a message the capturing client sent; a request teaches which adapter request id
///   the transcript's id stands for, so captured responses reach the adapter's own requests;
/// - `!submit`, `!cancel`, `!cancel-child N`, `!respond N allow|deny`, `!delete N`, `!timers`,
///   `!tick MS`, `!reload`, `!exit`, `!ack`, `!nack`: the user, the clock, the runtime.
///
/// Every event and answer of the adapter goes to the engine, every provider request of the
/// engine back to the adapter, and (as the daemon does) every `interactionRequested` the engine
/// did not take back to the adapter's `on_dropped`; [`check_all`] runs after every engine step.
pub struct LineDriver<A: Adapter> {
    /// The engine side.
    pub h: Harness,
    /// The adapter.
    pub adapter: A,
    root: Id,
    convert: fn(&Value, usize) -> Option<Value>,
    timers: Vec<AdapterTimer>,
    /// JSON-RPC requests the adapter sent and the transcript has not named yet: (id, method).
    unanswered: Vec<(Value, String)>,
    /// Transcript request id (JSON text) -> the adapter's id.
    ids: BTreeMap<String, Value>,
    /// Sidecar commands (`op` + string `id`) not acknowledged yet.
    commands: VecDeque<Value>,
    turns: u32,
    ops: u32,
    lines: usize,
    /// Every native message the adapter wrote, in order (at most [`MAX_INPUTS`]).
    pub native: Vec<Value>,
}

fn identity(v: &Value, _: usize) -> Option<Value> {
    Some(v.clone())
}

impl<A: Adapter> LineDriver<A> {
    /// Creates root session `root` (provider `provider`), opens the adapter and submits `turn-1`.
    pub fn new(
        adapter: A,
        provider: &str,
        convert: Option<fn(&Value, usize) -> Option<Value>>,
    ) -> Result<Self, String> {
        let root: Id = "root".into();
        let mut d = LineDriver {
            h: Harness::new(),
            adapter,
            root: root.clone(),
            convert: convert.unwrap_or(identity),
            timers: Vec::new(),
            unanswered: Vec::new(),
            ids: BTreeMap::new(),
            commands: VecDeque::new(),
            turns: 1,
            ops: 0,
            lines: 0,
            native: Vec::new(),
        };
        let guide = d.adapter.guide_while_children_only();
        d.command(Command::CreateSession {
            agent_session_id: root.clone(),
            workspace_id: "W".into(),
            provider: provider.into(),
            title: None,
            capabilities: Some(tutti_core::model::Capabilities {
                guide_while_children_only: guide,
            }),
        })?;
        let out = d.adapter.open(d.h.now);
        d.absorb(out)?;
        d.command(Command::Submit {
            agent_session_id: root,
            turn_id: "turn-1".into(),
            text: "hello".into(),
        })?;
        Ok(d)
    }

    fn command(&mut self, c: Command) -> Result<(), String> {
        if let Some(step) = self.h.feed(&Input::Command(c))? {
            self.requests(step.provider)?;
        }
        Ok(())
    }

    fn requests(&mut self, reqs: Vec<ProviderRequest>) -> Result<(), String> {
        for r in reqs {
            let out = self.adapter.on_request(self.h.now, &r);
            self.absorb(out)?;
        }
        Ok(())
    }

    /// Feeds an adapter output to the engine and the engine's requests back, until quiet.
    fn absorb(&mut self, out: AdapterOutput) -> Result<(), String> {
        let mut queue = VecDeque::from([out]);
        while let Some(out) = queue.pop_front() {
            if self.native.len() < MAX_INPUTS {
                self.native.extend(out.native.iter().cloned());
            }
            for n in &out.native {
                match (
                    n.get("id"),
                    n.get("method").and_then(Value::as_str),
                    n.get("op"),
                ) {
                    (Some(id), Some(m), _) => self.unanswered.push((id.clone(), m.to_string())),
                    (Some(_), None, Some(_)) => self.commands.push_back(n.clone()),
                    _ => {}
                }
            }
            self.timers.extend(out.timers);
            let inputs = out
                .events
                .into_iter()
                .map(Input::Event)
                .chain(out.answers.into_iter().map(Input::Runtime));
            for input in inputs {
                let step = self.h.feed(&input)?;
                // As the daemon does: an interaction request the engine did not take (rejected,
                // or accepted as ignored) goes back to the adapter, which answers it natively.
                if let Input::Event(e @ NormalizedEvent::InteractionRequested { .. }) = &input {
                    if step.as_ref().is_none_or(|s| s.ignored.is_some()) {
                        queue.push_back(self.adapter.on_dropped(self.h.now, e));
                    }
                }
                if let Some(step) = step {
                    for r in step.provider {
                        queue.push_back(self.adapter.on_request(self.h.now, &r));
                    }
                }
            }
        }
        Ok(())
    }

    fn native(&mut self, v: Value) -> Result<(), String> {
        let Some(v) = (self.convert)(&v, self.lines) else {
            return Ok(());
        };
        if let Some(t) = v.get("__t").and_then(Value::as_i64) {
            self.h.now = self.h.now.max(t);
        }
        match self.adapter.on_native(self.h.now, &v) {
            Ok(out) => self.absorb(out),
            // A typed error: the line is dropped.
            Err(_) => Ok(()),
        }
    }

    fn nth_active_child(&self, n: usize) -> Option<(Id, Id)> {
        let snap = self.h.engine.snapshot(&self.root)?;
        let v: Vec<(Id, Id)> = snap
            .sessions
            .iter()
            .filter(|s| s.kind == SessionKind::Child)
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
                    .h
                    .engine
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
                let pending = self.h.engine.pending_interactions(&root);
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
                    .h
                    .engine
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
                self.h.now += n.min(1_000_000) as Millis;
                self.fire_due()?;
            }
            "!reload" => self.h.reload(&root)?,
            "!exit" => {
                let input = Input::Runtime(RuntimeAnswer::ProviderExited {
                    root_agent_session_id: root,
                    error: "killed".into(),
                });
                if let Some(step) = self.h.feed(&input)? {
                    self.requests(step.provider)?;
                }
            }
            "!ack" | "!nack" => {
                if let Some(c) = self.commands.pop_front() {
                    let ack = json!({"kind":"ack","id":c.get("id"),"ok":cmd == "!ack","error":(cmd == "!nack").then_some("refused")});
                    if let Ok(out) = self.adapter.on_native(self.h.now, &ack) {
                        self.absorb(out)?;
                    }
                } else if let Some((id, _)) =
                    (!self.unanswered.is_empty()).then(|| self.unanswered.remove(0))
                {
                    let msg = if cmd == "!ack" {
                        json!({"jsonrpc":"2.0","id":id,"result":{}})
                    } else {
                        json!({"jsonrpc":"2.0","id":id,"error":{"code":-32603,"message":"refused"}})
                    };
                    if let Ok(out) = self.adapter.on_native(self.h.now, &msg) {
                        self.absorb(out)?;
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn fire_due(&mut self) -> Result<(), String> {
        loop {
            let now = self.h.now;
            let Some(t) = take_due(&mut self.timers, now, |t| t.at) else {
                break;
            };
            let out = self.adapter.on_timer(now, &t.id);
            self.absorb(out)?;
        }
        let due: Vec<TimerRequest> = self
            .h
            .timers
            .iter()
            .filter(|t| t.at <= self.h.now)
            .cloned()
            .collect();
        self.h.timers.retain(|t| t.at > self.h.now);
        for t in due {
            if let Some(step) = self.h.feed(&Input::Runtime(RuntimeAnswer::TimerFired {
                timer: t.timer,
            }))? {
                self.requests(step.provider)?;
            }
        }
        Ok(())
    }

    /// Advances the clock past every armed timer (adapter and engine) and fires them.
    pub fn fire_all(&mut self) -> Result<(), String> {
        for _ in 0..16 {
            let latest = self
                .timers
                .iter()
                .map(|t| t.at)
                .chain(self.h.timers.iter().map(|t| t.at))
                .max();
            let Some(at) = latest else { break };
            self.h.now = self.h.now.max(at);
            self.fire_due()?;
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
        self.h.now += 1;
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
        check_all(&self.h.engine, &self.h.store, &mut self.h.history)?;
        Ok(self)
    }
}

/// Fuzz target `acp_native`: native ACP lines through [`tutti_core::adapters::acp::AcpAdapter`] and
/// the engine.
pub fn try_acp_native(data: &[u8]) -> Result<(), String> {
    let adapter = tutti_core::adapters::acp::AcpAdapter::new(
        "root".into(),
        tutti_core::adapters::acp::AcpConfig::default(),
    );
    LineDriver::new(adapter, "acp", None)?.run(data).map(|_| ())
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
    let adapter = tutti_core::adapters::codex::CodexAdapter::new(
        "root".into(),
        tutti_core::adapters::codex::CodexConfig::default(),
    );
    LineDriver::new(adapter, "codex", None)?
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
    let adapter = tutti_core::adapters::claude::ClaudeAdapter::new(
        "root".into(),
        tutti_core::adapters::claude::ClaudeConfig::default(),
    );
    LineDriver::new(
        adapter,
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
