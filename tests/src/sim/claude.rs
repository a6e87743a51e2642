//! A simulated Claude Agent SDK sidecar (`io-tokio/sidecar/claude`), in the shapes of the
//! captured `core/tests/data/claude/*.jsonl` logs: it reads the adapter's commands (`start`,
//! `input`, `interrupt`, `stopTask`, `permission`, each acknowledged with `ack`) and writes
//! `message` lines (SDKMessages: `system/init`, `assistant` with `text` and `Agent` `tool_use`
//! blocks, `user` with `tool_result` blocks, `system/task_started`, `system/task_updated`,
//! `system/task_notification`, `result`), `canUseTool` permission callbacks (with `agentID`
//! inside a subagent) and `hook` lines.
//!
//! The SDK runs one root turn at a time (queued `input`s become later turns); children
//! (subagents launched by an `Agent` tool use, foreground or `run_in_background`) run
//! concurrently, may ask for permission, launch a nested subagent, fail, or hang until stopped.
//! A foreground child holds its root turn until it ends (then the launch's `tool_result`); a
//! background one is acknowledged at once (`async_launched`) and, when it ends after its root
//! turn, the SDK runs a continuation root turn (`result.origin.kind = task-notification`).
//! `interrupt` ends the running root turn (`error_during_execution`, `aborted_streaming`) and
//! stops every task (`killed` / `stopped`); `stopTask` stops one task. Faults: a `PreToolUse`
//! hook before the assistant message that carries the same `Agent` tool use (an earlier
//! revelation), a repeated `task_started`.

use super::{Provider, Rng};
use serde_json::{json, Value};
use std::collections::VecDeque;
use tutti_core::adapters::claude::{ClaudeAdapter, ClaudeConfig};
use tutti_core::adapters::Adapter;
use tutti_core::model::{Id, Millis};

/// The real adapter for a root.
pub fn adapter(root: &Id) -> Box<dyn Adapter> {
    Box::new(ClaudeAdapter::new(root.clone(), ClaudeConfig::default()))
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Init,
    Talk,
    Spawn,
    Ask,
    WaitChildren,
    Finish,
}

#[derive(Debug, Clone)]
struct RootTurn {
    continuation: bool,
    steps: VecDeque<Step>,
    /// Waiting for a permission answer.
    waiting: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum TaskState {
    Starting,
    Running,
    Waiting(String),
    Done,
}

#[derive(Debug, Clone)]
struct Task {
    tool_use: String,
    task_id: String,
    /// The launching scope: `None` for the root, else the parent task's tool use id.
    parent: Option<String>,
    background: bool,
    state: TaskState,
    steps: usize,
    ask: bool,
    nested: usize,
    fail: bool,
    hang: bool,
}

/// See the module docs.
#[derive(Debug)]
pub struct ClaudeSidecar {
    tag: String,
    session: String,
    started: bool,
    turns: VecDeque<RootTurn>,
    tasks: Vec<Task>,
    seq: u32,
    calm: bool,
    /// Background tasks that ended while no root turn ran: each gets a continuation.
    notify: usize,
}

fn msg(m: Value) -> Value {
    json!({"kind": "message", "message": m})
}

impl ClaudeSidecar {
    /// A fresh sidecar process.
    pub fn new(tag: String, _rng: &mut Rng) -> ClaudeSidecar {
        let session = format!("{tag}-session");
        ClaudeSidecar {
            tag,
            session,
            started: false,
            turns: VecDeque::new(),
            tasks: Vec::new(),
            seq: 0,
            calm: false,
            notify: 0,
        }
    }

    fn id(&mut self, what: &str) -> String {
        self.seq += 1;
        format!("{}-{what}{}", self.tag, self.seq)
    }

    fn new_turn(&mut self, continuation: bool, rng: &mut Rng) -> RootTurn {
        let mut steps = VecDeque::from([Step::Init]);
        if rng.chance(600) {
            steps.push_back(Step::Talk);
        }
        if !continuation {
            for _ in 0..rng.range(0, 3) {
                steps.push_back(Step::Spawn);
            }
            if rng.chance(120) {
                steps.push_back(Step::Ask);
            }
        }
        steps.push_back(Step::WaitChildren);
        steps.push_back(Step::Finish);
        RootTurn {
            continuation,
            steps,
            waiting: None,
        }
    }

    fn assistant(&self, scope: Option<&str>, agent: Option<&str>, content: Value) -> Value {
        msg(
            json!({"type": "assistant", "message": {"id": format!("msg-{}", self.seq), "type": "message", "role": "assistant",
            "content": content}, "parent_tool_use_id": scope, "agent_id": agent, "session_id": self.session}),
        )
    }

    fn user(
        &self,
        scope: Option<&str>,
        agent: Option<&str>,
        content: Value,
        tool_use_result: Option<Value>,
    ) -> Value {
        msg(
            json!({"type": "user", "message": {"role": "user", "content": content}, "parent_tool_use_id": scope,
            "agent_id": agent, "tool_use_result": tool_use_result, "session_id": self.session}),
        )
    }

    fn system(&self, sub: &str, fields: Value) -> Value {
        let mut m = json!({"type": "system", "subtype": sub, "session_id": self.session});
        if let (Some(o), Value::Object(f)) = (m.as_object_mut(), fields) {
            o.extend(f);
        }
        msg(m)
    }

    /// An `Agent` tool use in scope `parent` (root or a task), then its `task_started`.
    fn spawn(&mut self, parent: Option<String>, rng: &mut Rng) -> Vec<Value> {
        let tool_use = self.id("toolu");
        let task_id = self.id("task");
        let background = parent.is_none() && rng.chance(350);
        let agent_of_parent = parent
            .as_ref()
            .and_then(|p| self.tasks.iter().find(|t| &t.tool_use == p))
            .map(|t| t.task_id.clone());
        let input = json!({"description": "Mock child task", "prompt": "CHILD_TASK", "subagent_type": "general-purpose", "run_in_background": background});
        let mut out = Vec::new();
        if rng.chance(250) {
            out.push(json!({"kind": "hook", "event": "PreToolUse", "toolUseID": tool_use,
                "input": {"hook_event_name": "PreToolUse", "tool_name": "Agent", "tool_input": input, "tool_use_id": tool_use}}));
        }
        out.push(self.assistant(
            parent.as_deref(),
            agent_of_parent.as_deref(),
            json!([{"type": "tool_use", "id": tool_use, "name": "Agent", "input": input}]),
        ));
        out.push(self.system("task_started", json!({"task_id": task_id, "tool_use_id": tool_use, "description": "Mock child task",
            "subagent_type": "general-purpose", "is_backgrounded": background, "task_type": "local_agent"})));
        if background {
            out.push(self.user(
                parent.as_deref(),
                agent_of_parent.as_deref(),
                json!([{"tool_use_id": tool_use, "type": "tool_result",
                "content": [{"type": "text", "text": "Async agent launched successfully."}]}]),
                Some(json!({"isAsync": true, "status": "async_launched", "agentId": task_id})),
            ));
        }
        let depth_ok = parent.is_none();
        self.tasks.push(Task {
            tool_use,
            task_id,
            parent,
            background,
            state: TaskState::Starting,
            steps: rng.range(0, 2),
            ask: rng.chance(200),
            nested: usize::from(depth_ok && rng.chance(150)),
            fail: rng.chance(120),
            hang: !self.calm && rng.chance(60),
        });
        out
    }

    /// A task's terminal: `task_updated`, `task_notification`, and for a foreground one the
    /// launch's `tool_result` in the parent scope.
    fn end_task(&mut self, i: usize, status: &str) -> Vec<Value> {
        let t = self.tasks[i].clone();
        self.tasks[i].state = TaskState::Done;
        let mut out = vec![
            self.system("task_updated", json!({"task_id": t.task_id, "patch": {"status": if status == "stopped" { "killed" } else { status }}})),
            self.system("task_notification", json!({"task_id": t.task_id, "tool_use_id": t.tool_use, "status": status, "summary": "done"})),
        ];
        if status == "stopped" {
            out.push(self.user(
                Some(&t.tool_use),
                Some(&t.task_id),
                json!([{"type": "text", "text": "[Request interrupted by user]"}]),
                None,
            ));
        }
        if !t.background {
            let agent_of_parent = t
                .parent
                .as_ref()
                .and_then(|p| self.tasks.iter().find(|x| &x.tool_use == p))
                .map(|x| x.task_id.clone());
            out.push(self.user(t.parent.as_deref(), agent_of_parent.as_deref(), json!([{"tool_use_id": t.tool_use, "type": "tool_result",
                "is_error": status != "completed", "content": [{"type": "text", "text": "[Subagent hand-back]"}]}]),
                Some(json!({"status": status, "agentId": t.task_id}))));
        } else if !self.root_reads_notifications() {
            // The notification of a background task that ends while no root turn runs, or while
            // the running one has no model round left (only its `result` to come), starts a
            // continuation turn; otherwise the model reads it in that turn's next round (the
            // shapes of the captured `bg_two_*` transcripts).
            self.notify += 1;
        }
        out
    }

    /// Whether the running root turn still has a model round to come (anything before its
    /// `result`), in which the model reads a task notification delivered now.
    fn root_reads_notifications(&self) -> bool {
        self.turns
            .front()
            .is_some_and(|t| t.steps.iter().any(|s| *s != Step::Finish))
    }

    fn busy_children(&self, scope: Option<&str>) -> bool {
        self.tasks
            .iter()
            .any(|t| t.parent.as_deref() == scope && !t.background && t.state != TaskState::Done)
    }

    fn task_ready(&self, i: usize) -> bool {
        let t = &self.tasks[i];
        match t.state {
            TaskState::Starting => true,
            TaskState::Running => {
                (!t.hang || self.calm)
                    && (t.ask
                        || t.nested > 0
                        || t.steps > 0
                        || !self.busy_children(Some(&t.tool_use)))
            }
            TaskState::Waiting(_) | TaskState::Done => false,
        }
    }

    fn root_ready(&self) -> bool {
        match self.turns.front() {
            Some(t) if t.waiting.is_some() => false,
            Some(t) => t.steps.front() != Some(&Step::WaitChildren) || !self.busy_children(None),
            // A background task ended while no root turn ran: the SDK runs a continuation.
            None => self.notify > 0,
        }
    }

    fn step_root(&mut self, rng: &mut Rng) -> Vec<Value> {
        if self.turns.is_empty() {
            self.notify -= 1;
            let t = self.new_turn(true, rng);
            self.turns.push_back(t);
        }
        let Some(step) = self.turns.front_mut().and_then(|t| t.steps.pop_front()) else {
            return Vec::new();
        };
        match step {
            Step::Init => vec![self.system(
                "init",
                json!({"model": "claude-sonnet-4-5", "permissionMode": "default", "cwd": "/"}),
            )],
            Step::Talk => {
                vec![self.assistant(None, None, json!([{"type": "text", "text": "thinking"}]))]
            }
            Step::Spawn => self.spawn(None, rng),
            Step::Ask => {
                let req = self.id("perm");
                let tool = self.id("toolu");
                if let Some(t) = self.turns.front_mut() {
                    t.waiting = Some(req.clone());
                }
                vec![
                    self.assistant(None, None, json!([{"type": "tool_use", "id": tool, "name": "Bash", "input": {"command": "ls"}}])),
                    json!({"kind": "canUseTool", "requestId": req, "toolName": "Bash", "input": {"command": "ls"}, "toolUseID": tool, "agentID": null}),
                ]
            }
            Step::WaitChildren => Vec::new(),
            Step::Finish => {
                let t = self.turns.pop_front();
                let mut r = json!({"type": "result", "subtype": "success", "is_error": false, "stop_reason": "end_turn",
                    "terminal_reason": "completed", "result": "parent says: all done", "session_id": self.session});
                if rng.chance(60) {
                    r = json!({"type": "result", "subtype": "error_max_turns", "is_error": true, "errors": ["max turns"], "session_id": self.session});
                }
                if t.is_some_and(|t| t.continuation) {
                    r["origin"] = json!({"kind": "task-notification", "producer": "session-task"});
                }
                vec![
                    self.assistant(
                        None,
                        None,
                        json!([{"type": "text", "text": "parent says: all done"}]),
                    ),
                    msg(r),
                ]
            }
        }
    }

    fn step_task(&mut self, i: usize, rng: &mut Rng) -> Vec<Value> {
        let t = self.tasks[i].clone();
        let scope = Some(t.tool_use.as_str());
        let agent = Some(t.task_id.as_str());
        match t.state {
            TaskState::Starting => {
                self.tasks[i].state = TaskState::Running;
                vec![self.user(
                    scope,
                    agent,
                    json!([{"type": "text", "text": "CHILD_TASK"}]),
                    None,
                )]
            }
            TaskState::Running if t.ask => {
                let req = self.id("perm");
                let tool = self.id("toolu");
                self.tasks[i].ask = false;
                self.tasks[i].state = TaskState::Waiting(req.clone());
                vec![
                    self.assistant(scope, agent, json!([{"type": "tool_use", "id": tool, "name": "Edit", "input": {"file_path": "x"}}])),
                    json!({"kind": "canUseTool", "requestId": req, "toolName": "Edit", "input": {"file_path": "x"}, "toolUseID": tool, "agentID": t.task_id}),
                ]
            }
            TaskState::Running if t.nested > 0 => {
                self.tasks[i].nested -= 1;
                self.spawn(Some(t.tool_use.clone()), rng)
            }
            TaskState::Running if t.steps > 0 => {
                self.tasks[i].steps -= 1;
                vec![self.assistant(
                    scope,
                    agent,
                    json!([{"type": "text", "text": "child says: working"}]),
                )]
            }
            TaskState::Running => {
                let status = if t.fail { "failed" } else { "completed" };
                let mut out = vec![self.assistant(
                    scope,
                    agent,
                    json!([{"type": "text", "text": "child says: subtask finished"}]),
                )];
                out.extend(self.end_task(i, status));
                out
            }
            TaskState::Waiting(_) | TaskState::Done => Vec::new(),
        }
    }

    fn ack(id: &Value, ok: bool) -> Value {
        if ok {
            json!({"kind": "ack", "id": id, "ok": true})
        } else {
            json!({"kind": "ack", "id": id, "ok": false, "error": "not running"})
        }
    }
}

impl Provider for ClaudeSidecar {
    fn receive(&mut self, _now: Millis, m: &Value, rng: &mut Rng) -> Vec<Value> {
        let id = m.get("id").cloned().unwrap_or(Value::Null);
        match m.get("op").and_then(Value::as_str).unwrap_or_default() {
            "start" => {
                self.started = true;
                let t = self.new_turn(false, rng);
                self.turns.push_back(t);
                vec![Self::ack(&id, true)]
            }
            "input" => {
                if !self.started {
                    return vec![Self::ack(&id, false)];
                }
                // Streamed input joins the root turn in progress (the model reads it at its next
                // step); with no turn in progress it starts one. An input that reaches the SDK
                // just after the turn it was meant to steer answered therefore starts a turn of
                // its own (see the OPEN Claude regressions).
                if m.get("steer") == Some(&Value::Bool(true)) && self.turns.is_empty() {
                    // A sidecar that knows a steer may only join a running turn refuses it.
                    return vec![Self::ack(&id, false)];
                }
                match self.turns.front_mut() {
                    Some(t) if t.steps.contains(&Step::Finish) => {
                        let at = t.steps.len() - 1;
                        t.steps.insert(at, Step::Talk);
                    }
                    _ => {
                        let t = self.new_turn(false, rng);
                        self.turns.push_back(t);
                    }
                }
                vec![Self::ack(&id, true)]
            }
            "interrupt" => {
                let mut out = vec![Self::ack(&id, true)];
                // Every task stops, descendants first; the running root turn ends aborted; queued
                // input is dropped.
                for i in (0..self.tasks.len()).rev() {
                    if self.tasks[i].state != TaskState::Done {
                        self.tasks[i].background = true; // no hand-back into an aborted turn
                        out.extend(self.end_task(i, "stopped"));
                    }
                }
                self.notify = 0;
                if self.turns.pop_front().is_some() {
                    out.push(msg(json!({"type": "result", "subtype": "error_during_execution", "is_error": true,
                        "terminal_reason": "aborted_streaming", "session_id": self.session})));
                }
                self.turns.clear();
                out
            }
            "stopTask" => {
                let task = m.get("taskId").and_then(Value::as_str).unwrap_or_default();
                let Some(i) = self
                    .tasks
                    .iter()
                    .position(|t| t.task_id == task && t.state != TaskState::Done)
                else {
                    return vec![Self::ack(&id, false)];
                };
                let mut out = vec![Self::ack(&id, true)];
                let mut set = vec![i];
                let mut k = 0;
                while k < set.len() {
                    let tu = self.tasks[set[k]].tool_use.clone();
                    set.extend((0..self.tasks.len()).filter(|&j| {
                        self.tasks[j].parent.as_deref() == Some(tu.as_str())
                            && self.tasks[j].state != TaskState::Done
                    }));
                    k += 1;
                }
                for j in set.into_iter().rev() {
                    out.extend(self.end_task(j, "stopped"));
                }
                out
            }
            "permission" => {
                let req = m
                    .get("requestId")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                let mut out = vec![Self::ack(&id, true)];
                if let Some(t) = self
                    .turns
                    .front_mut()
                    .filter(|t| t.waiting.as_deref() == Some(req.as_str()))
                {
                    t.waiting = None;
                    return out;
                }
                if let Some(i) = self
                    .tasks
                    .iter()
                    .position(|t| t.state == TaskState::Waiting(req.clone()))
                {
                    self.tasks[i].state = TaskState::Running;
                    if m.get("behavior").and_then(Value::as_str) != Some("allow") {
                        out.push(self.user(
                            Some(&self.tasks[i].tool_use.clone()),
                            Some(&self.tasks[i].task_id.clone()),
                            json!([{"type": "text", "text": "permission denied"}]),
                            None,
                        ));
                    }
                }
                out
            }
            _ => vec![Self::ack(&id, false)],
        }
    }

    fn step(&mut self, _now: Millis, rng: &mut Rng, faults: bool) -> Vec<Value> {
        if faults && rng.chance(20) {
            // A repeated task_started for a running task.
            let live: Vec<usize> = (0..self.tasks.len())
                .filter(|&i| self.tasks[i].state == TaskState::Running)
                .collect();
            if !live.is_empty() {
                let t = self.tasks[live[rng.below(live.len())]].clone();
                return vec![self.system("task_started", json!({"task_id": t.task_id, "tool_use_id": t.tool_use,
                    "description": "Mock child task", "is_backgrounded": t.background, "task_type": "local_agent"}))];
            }
        }
        let tasks: Vec<usize> = (0..self.tasks.len())
            .filter(|&i| self.task_ready(i))
            .collect();
        let root = usize::from(self.root_ready());
        let n = tasks.len() + root;
        if n == 0 {
            return Vec::new();
        }
        let k = rng.below(n);
        if k < root {
            self.step_root(rng)
        } else {
            self.step_task(tasks[k - root], rng)
        }
    }

    fn busy(&self) -> bool {
        self.root_ready() || (0..self.tasks.len()).any(|i| self.task_ready(i))
    }

    fn calm(&mut self) {
        self.calm = true;
        for t in &mut self.tasks {
            t.hang = false;
        }
    }
}
