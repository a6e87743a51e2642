//! `tutti replay-native --provider claude FILE.jsonl`: replays a captured Claude message log
//! through the adapter and an engine, purely.

use crate::adapters::claude::{sidecar_line, ClaudeAdapter, ClaudeConfig};
use crate::driver::{Driver, DriverInput, Output, Record, Testkit};
use crate::input::{Command, Input, NormalizedEvent};
use crate::model::{Id, Millis};
use crate::snapshot::TreeSnapshot;
use crate::store::MemoryStore;
use serde::Serialize;
use serde_json::Value;

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

/// A replay: a [`Driver`] host whose only I/O is a [`MemoryStore`] (issue 19: "every loop uses
/// it"), reporting what passed between the adapter and the engine from the driver's
/// [`Record`]s.
struct Replay {
    driver: Driver,
    store: MemoryStore,
    out: ReplayOutput,
}

impl Replay {
    /// Commits what the driver decided; collects native commands, events, diagnostics and
    /// rejections. `Err` when the input given `reply` was rejected.
    fn settle(&mut self, reply: Option<u64>) -> Result<(), String> {
        let mut refused = None;
        for o in self.driver.commit_pending(&mut self.store) {
            match o {
                Output::Transmit(t) => self.out.native.extend(t.messages),
                Output::Reply { to, result: Err(e) } if Some(to) == reply => {
                    refused = Some(e.to_string());
                }
                _ => {}
            }
        }
        for r in self.driver.take_records() {
            match r {
                Record::Adapter { output, .. } => {
                    self.out.diagnostics.extend(output.diagnostics);
                    self.out.events.extend(output.events);
                }
                // A refused command is the replay's error (above), not a diagnostic.
                Record::Decided {
                    input,
                    outcome: Err(e),
                } if !matches!(input, Input::Command(_)) => {
                    self.out
                        .diagnostics
                        .push(format!("engine rejected {}: {e}", input.kind()));
                }
                _ => {}
            }
        }
        match refused {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn command(&mut self, now: Millis, c: Command) -> Result<(), String> {
        let kind = Input::Command(c.clone()).kind();
        let _ = self.driver.handle(
            DriverInput::Host {
                now,
                input: Input::Command(c),
                reply: Some(1),
            },
            &self.store,
        );
        self.settle(Some(1))
            .map_err(|e| format!("engine rejected {kind}: {e}"))
    }
}

/// Replays a captured Claude message log (one SDKMessage a line, plus `__hook` / `__canUseTool`
/// rows, or sidecar lines) as for Codex: creates an engine with a root session `root`, submits
/// root turn `turn-1` (whose `start` the adapter answers), feeds every line to a
/// [`ClaudeAdapter`], and the adapter's events and answers to the engine (all through a
/// [`Driver`], so an interaction the engine did not take is denied natively, as live). Time comes
/// from each row's `__t` (ms) when present; timers due by then fire first. Timers still armed
/// after the last line do not fire (the capture ends there). Rejections and refused lines become
/// diagnostics; only a line that is not JSON at all is an error.
pub fn replay_transcript(lines: &str) -> Result<ReplayOutput, String> {
    let root: Id = ROOT.into();
    let mut driver = Driver::new();
    driver.set_recording(true);
    let mut d = Replay {
        driver,
        store: MemoryStore::new(),
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
    let adapter = ClaudeAdapter::new(root.clone(), ClaudeConfig::default());
    let _ = d.driver.handle(
        DriverInput::Attach {
            now: 0,
            root: root.clone(),
            adapter: Box::new(adapter),
        },
        &d.store,
    );
    d.settle(None)?;
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
        if d.driver.poll_timeout().is_some_and(|at| at <= now) {
            let _ = d.driver.handle(DriverInput::Timeout(now), &d.store);
            d.settle(None)?;
        }
        let Some(sidecar) = sidecar_line(&v, n + 1) else {
            d.out
                .diagnostics
                .push(format!("line {}: not a captured Claude row", n + 1));
            continue;
        };
        match d.driver.handle(
            DriverInput::Native {
                now,
                root: ROOT,
                message: &sidecar,
            },
            &d.store,
        ) {
            Ok(()) => d.settle(None)?,
            Err(e) => d.out.diagnostics.push(format!("line {}: {e}", n + 1)),
        }
    }
    d.out.snapshot = d.driver.engine().snapshot(ROOT).unwrap_or_default();
    Ok(d.out)
}
