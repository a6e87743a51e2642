//! `tutti replay-native --provider claude FILE.jsonl`: replays a captured Claude message log
//! through the adapter and an engine, purely.

use super::{ClaudeAdapter, ClaudeConfig};
use crate::adapters::{Adapter, AdapterOutput, AdapterTimer};
use crate::input::{Command, Input, NormalizedEvent};
use crate::model::{Id, Millis};
use crate::snapshot::TreeSnapshot;
use crate::Engine;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::VecDeque;

/// What a replay produced.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplayOutput {
    /// Every normalized event the adapter emitted, in order.
    pub events: Vec<NormalizedEvent>,
    /// The root tree after the last line.
    pub snapshot: TreeSnapshot,
    /// Sidecar commands the adapter would have written, in order.
    pub native: Vec<Value>,
    /// Adapter diagnostics, lines the adapter refused, and engine rejections (ids only).
    pub diagnostics: Vec<String>,
}

/// The root session and first root turn a replay creates.
const ROOT: &str = "root";
const TURN: &str = "turn-1";

/// Turns one captured row into the sidecar line the adapter reads: a raw SDKMessage becomes
/// `{"kind":"message","message":...}`, a `__hook` row a `hook` line, a `__canUseTool` row a
/// `canUseTool` line (its request id is `opts.requestId`, else `replay-perm-<seq>`). A row that is
/// already a sidecar line (it has `kind`) is returned as is. `None` for anything else.
pub fn sidecar_line(captured: &Value, seq: usize) -> Option<Value> {
    let o = captured.as_object()?;
    if o.contains_key("kind") {
        return Some(captured.clone());
    }
    if let Some(event) = o.get("__hook") {
        let input = o.get("input").cloned().unwrap_or(Value::Null);
        let tool_use = input.get("tool_use_id").cloned().unwrap_or(Value::Null);
        return Some(
            json!({"kind": "hook", "event": event, "input": input, "toolUseID": tool_use}),
        );
    }
    if let Some(tool) = o.get("__canUseTool") {
        let opts = o.get("opts").cloned().unwrap_or_else(|| json!({}));
        let request = opts
            .get("requestId")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| format!("replay-perm-{seq}"));
        return Some(json!({
            "kind": "canUseTool",
            "requestId": request,
            "toolName": tool,
            "input": o.get("input").cloned().unwrap_or(Value::Null),
            "toolUseID": opts.get("toolUseID").cloned().unwrap_or(Value::Null),
            "agentID": opts.get("agentID").cloned().unwrap_or(Value::Null),
            "options": opts,
        }));
    }
    if o.contains_key("type") {
        let mut m = o.clone();
        m.remove("__t");
        return Some(json!({"kind": "message", "message": Value::Object(m)}));
    }
    None
}

/// A minimal pure driver: the engine, the adapter, and the adapter's timers.
struct Driver {
    engine: Engine,
    adapter: ClaudeAdapter,
    timers: Vec<AdapterTimer>,
    out: ReplayOutput,
}

impl Driver {
    fn engine_input(&mut self, now: Millis, input: Input) -> Vec<crate::step::ProviderRequest> {
        let kind = input.kind();
        match self.engine.handle(now, &input) {
            Ok(step) => step.provider,
            Err(e) => {
                self.out
                    .diagnostics
                    .push(format!("engine rejected {kind}: {e}"));
                Vec::new()
            }
        }
    }

    /// Feeds an adapter output to the engine, and the engine's provider requests back to the
    /// adapter, until nothing is left.
    fn apply(&mut self, now: Millis, out: AdapterOutput) {
        let mut queue = VecDeque::from([out]);
        while let Some(out) = queue.pop_front() {
            self.out.native.extend(out.native);
            self.out.diagnostics.extend(out.diagnostics);
            self.timers.extend(out.timers);
            let mut requests = Vec::new();
            for e in out.events {
                self.out.events.push(e.clone());
                requests.extend(self.engine_input(now, Input::Event(e)));
            }
            for a in out.answers {
                requests.extend(self.engine_input(now, Input::Runtime(a)));
            }
            for r in requests {
                queue.push_back(self.adapter.on_request(now, &r));
            }
        }
    }

    fn command(&mut self, now: Millis, c: Command) -> Result<(), String> {
        let kind = Input::Command(c.clone()).kind();
        let step = self
            .engine
            .handle(now, &Input::Command(c))
            .map_err(|e| format!("engine rejected {kind}: {e}"))?;
        for r in step.provider {
            let out = self.adapter.on_request(now, &r);
            self.apply(now, out);
        }
        Ok(())
    }

    /// Fires the adapter timers due at `now`, earliest first.
    fn fire_due(&mut self, now: Millis) {
        loop {
            let Some(t) = crate::adapters::take_due(&mut self.timers, now, |t| t.at) else {
                return;
            };
            let out = self.adapter.on_timer(t.at, &t.id);
            self.apply(t.at, out);
        }
    }
}

/// Replays a captured Claude message log (one SDKMessage a line, plus `__hook` / `__canUseTool`
/// rows, or sidecar lines) as for Codex: creates an engine with a root session `root`, submits
/// root turn `turn-1` (whose `start` the adapter answers), feeds every line to a
/// [`ClaudeAdapter`], and the adapter's events and answers to the engine. Time comes from each
/// row's `__t` (ms) when present; adapter timers due by then fire first. Timers still armed after
/// the last line do not fire (the capture ends there). Rejections and refused lines become
/// diagnostics; only a line that is not JSON at all is an error.
pub fn replay_transcript(lines: &str) -> Result<ReplayOutput, String> {
    let root: Id = ROOT.into();
    let mut d = Driver {
        engine: Engine::new(),
        adapter: ClaudeAdapter::new(root.clone(), ClaudeConfig::default()),
        timers: Vec::new(),
        out: ReplayOutput::default(),
    };
    d.command(
        0,
        Command::CreateSession {
            agent_session_id: root.clone(),
            workspace_id: "replay".into(),
            provider: "claude".into(),
            title: None,
            capabilities: None,
        },
    )?;
    d.command(
        0,
        Command::Submit {
            agent_session_id: root.clone(),
            turn_id: TURN.into(),
            text: "(replayed prompt)".into(),
        },
    )?;
    let mut now: Millis = 0;
    for (n, line) in lines.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let v: Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: not JSON: {e}", n + 1))?;
        if let Some(t) = v.get("__t").and_then(Value::as_i64) {
            now = now.max(t);
        }
        d.fire_due(now);
        let Some(sidecar) = sidecar_line(&v, n + 1) else {
            d.out
                .diagnostics
                .push(format!("line {}: not a captured Claude row", n + 1));
            continue;
        };
        match d.adapter.on_native(now, &sidecar) {
            Ok(out) => d.apply(now, out),
            Err(e) => d.out.diagnostics.push(format!("line {}: {e}", n + 1)),
        }
    }
    d.out.snapshot = d.engine.snapshot(ROOT).unwrap_or_default();
    Ok(d.out)
}
