//! The `engine_orderings` fuzz target: a tree decoded from the bytes, its provider facts in two
//! causal interleavings (with idempotent duplicates) that must reach the same final state, then
//! the facts again interleaved with commands (submit, cancel root, cancel child, cancel results,
//! respond, delete, guide failures, provider exits, reloads from the store). After every step:
//! [`check_all`](crate::checks::check_all) (through the [`Harness`]).

use crate::bytes::Bytes;
use crate::harness::Harness;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use tutti_core::input::{Command, Input, RuntimeAnswer, TimerId};
use tutti_core::model::Id;
use tutti_core::store::Store;
use tutti_core::TreeSnapshot;

const ROOT: &str = "R";
const ROOT_TURN: &str = "T";

#[derive(Debug, Clone)]
struct ChildSpec {
    /// 0 = the root, i = child i (1-based, always < this child's number).
    parent: usize,
    outcome: &'static str,
    messages: usize,
    /// 0: none, 1: requested and resolved, 2: requested only (superseded when the turn settles).
    interaction: usize,
    tool: bool,
    update: bool,
    /// A second (guidance) turn after the first one, with this outcome.
    second: Option<&'static str>,
}

#[derive(Debug, Clone)]
struct Shape {
    children: Vec<ChildSpec>,
    root_outcome: &'static str,
    root_messages: usize,
    goal: bool,
}

const CHILD_OUTCOMES: [&str; 4] = ["completed", "failed", "interrupted", "canceled"];
const ROOT_OUTCOMES: [&str; 3] = ["completed", "failed", "interrupted"];

fn shape(b: &mut Bytes<'_>) -> Shape {
    let n = 1 + b.below(8);
    let children = (1..=n)
        .map(|i| ChildSpec {
            parent: b.below(i),
            outcome: CHILD_OUTCOMES[b.below(CHILD_OUTCOMES.len())],
            messages: b.below(3),
            interaction: b.below(3),
            tool: b.chance(128),
            update: b.chance(64),
            second: b
                .chance(48)
                .then(|| CHILD_OUTCOMES[b.below(CHILD_OUTCOMES.len())]),
        })
        .collect();
    Shape {
        children,
        root_outcome: ROOT_OUTCOMES[b.below(ROOT_OUTCOMES.len())],
        root_messages: b.below(3),
        goal: b.chance(64),
    }
}

/// One provider fact with its causal predecessors (indexes into the fact list).
#[derive(Debug, Clone)]
struct Fact {
    input: Value,
    after: Vec<usize>,
    /// Delivering it twice must change nothing.
    idempotent: bool,
}

struct Facts {
    list: Vec<Fact>,
}

impl Facts {
    fn push(&mut self, input: Value, after: Vec<usize>, idempotent: bool) -> usize {
        self.list.push(Fact {
            input,
            after,
            idempotent,
        });
        self.list.len() - 1
    }

    fn add_after(&mut self, fact: usize, pred: usize) {
        if let Some(f) = self.list.get_mut(fact) {
            f.after.push(pred);
        }
    }
}

fn child_id(i: usize) -> String {
    format!("C{i}")
}

fn child_turn(i: usize, n: usize) -> String {
    format!("C{i}/t{n}")
}

/// A child turn's own stream: started, progress, interaction, terminal. Returns (started,
/// terminal).
fn turn_chain(
    f: &mut Facts,
    c: &ChildSpec,
    i: usize,
    n: usize,
    start_after: Vec<usize>,
    outcome: &str,
) -> (usize, usize) {
    let (s, t) = (child_id(i), child_turn(i, n));
    let started = f.push(
        json!({"type":"turnStarted","agentSessionId":s,"turnId":t,"providerTurnId":format!("p-{s}-{n}")}),
        start_after,
        false,
    );
    let mut last = started;
    for m in 0..c.messages {
        last = f.push(
            json!({"type":"messageAppended","agentSessionId":s,"turnId":t,
                "messageId":format!("m-{s}-{n}-{m}"),"role":"assistant","text":"progress"}),
            vec![last],
            true,
        );
    }
    if c.interaction > 0 {
        let req = format!("q-{s}-{n}");
        last = f.push(
            json!({"type":"interactionRequested","agentSessionId":s,"turnId":t,"requestId":req,
                "providerTurnId":format!("p-{s}-{n}"),"kind":"approval","payload":{"tool":"edit"}}),
            vec![last],
            true,
        );
        last = f.push(
            json!({"type":"turnWaiting","agentSessionId":s,"turnId":t}),
            vec![last],
            false,
        );
        if c.interaction == 1 {
            last = f.push(
                json!({"type":"interactionResolved","agentSessionId":s,"turnId":t,"requestId":req,
                    "resolution":{"decision":"accept"}}),
                vec![last],
                true,
            );
            last = f.push(
                json!({"type":"turnStarted","agentSessionId":s,"turnId":t}),
                vec![last],
                false,
            );
        }
    }
    let error = matches!(outcome, "failed" | "interrupted").then_some("boom");
    let terminal = f.push(
        json!({"type":"turnTerminal","agentSessionId":s,"turnId":t,"outcome":outcome,"error":error}),
        vec![last],
        true,
    );
    (started, terminal)
}

fn facts(s: &Shape) -> Facts {
    let mut f = Facts { list: Vec::new() };
    let start = f.push(
        json!({"type":"rootProviderTurnStarted","agentSessionId":ROOT,"providerTurnId":"p1"}),
        vec![],
        false,
    );
    // Everything the root provider terminal must follow ("creating a child session and its
    // initial child turn must be persisted before a later root provider terminal is applied").
    let mut before_root_end = vec![start];
    let mut last_root = start;
    for m in 0..s.root_messages {
        last_root = f.push(
            json!({"type":"messageAppended","agentSessionId":ROOT,"turnId":ROOT_TURN,
                "messageId":format!("m-root-{m}"),"role":"assistant","text":"working"}),
            vec![last_root],
            true,
        );
        before_root_end.push(last_root);
    }
    if s.goal {
        f.push(
            json!({"type":"sessionMetadataUpdated","agentSessionId":ROOT,
                "goal":{"status":"complete","value":"ship it"}}),
            vec![],
            true,
        );
    }
    // Per child: (creation fact, first-turn terminal fact).
    let mut created: Vec<usize> = vec![start];
    let mut terminals: Vec<Option<usize>> = vec![None];
    for (k, c) in s.children.iter().enumerate() {
        let i = k + 1;
        let (ps, pt) = if c.parent == 0 {
            (ROOT.to_string(), ROOT_TURN.to_string())
        } else {
            (child_id(c.parent), child_turn(c.parent, 1))
        };
        let call = format!("call-{i}");
        let mut after = vec![created[c.parent]];
        let tool_started = c.tool.then(|| {
            f.push(
                json!({"type":"toolCallUpdated","agentSessionId":ps,"turnId":pt,"toolCallId":call,
                    "name":"spawnAgent","status":"started"}),
                vec![created[c.parent]],
                false,
            )
        });
        after.extend(tool_started);
        let creation = f.push(
            json!({"type":"childSessionCreated","agentSessionId":child_id(i),"turnId":child_turn(i, 1),
                "parentAgentSessionId":ps,"parentTurnId":pt,"parentToolCallId":call,
                "rootAgentSessionId":ROOT,"rootTurnId":ROOT_TURN,"title":"worker",
                "providerSessionId":format!("thread-{i}")}),
            after,
            true,
        );
        before_root_end.push(creation);
        // A nested child is created by its parent's running turn.
        if let Some(Some(pt_end)) = terminals.get(c.parent) {
            f.add_after(*pt_end, creation);
        }
        if c.tool {
            let done = f.push(
                json!({"type":"toolCallUpdated","agentSessionId":ps,"turnId":pt,"toolCallId":call,
                    "name":"spawnAgent","status":"completed"}),
                vec![creation],
                false,
            );
            if c.parent == 0 {
                before_root_end.push(done);
            } else if let Some(Some(pt_end)) = terminals.get(c.parent) {
                f.add_after(*pt_end, done);
            }
        }
        if c.update {
            f.push(
                json!({"type":"childSessionUpdated","agentSessionId":child_id(i),"title":"explorer",
                    "providerAliases":{"agentId":format!("agent-{i}")}}),
                vec![creation],
                true,
            );
        }
        let (_, end) = turn_chain(&mut f, c, i, 1, vec![creation], c.outcome);
        if let Some(second) = c.second {
            // Guidance into the child opens its second turn; it must start while the root is
            // still active, so before the root provider terminal.
            let (started2, _) = turn_chain(&mut f, c, i, 2, vec![end], second);
            before_root_end.push(started2);
        }
        created.push(creation);
        terminals.push(Some(end));
    }
    f.push(
        json!({"type":"rootProviderTurnCompleted","agentSessionId":ROOT,"providerTurnId":"p1",
            "outcome":s.root_outcome,"error":(s.root_outcome != "completed").then_some("root failed")}),
        before_root_end,
        true,
    );
    f
}

/// Picks the next fact among the ready ones.
fn pick_ready(f: &Facts, done: &[bool], b: &mut Bytes<'_>) -> Option<usize> {
    let ready: Vec<usize> = (0..f.list.len())
        .filter(|&i| !done[i] && f.list[i].after.iter().all(|&a| done[a]))
        .collect();
    if ready.is_empty() {
        return None;
    }
    Some(ready[b.below(ready.len())])
}

/// A causal interleaving of the facts, with idempotent facts sometimes delivered twice.
fn interleave(f: &Facts, b: &mut Bytes<'_>) -> Vec<usize> {
    let mut done = vec![false; f.list.len()];
    let mut order = Vec::new();
    while let Some(i) = pick_ready(f, &done, b) {
        done[i] = true;
        order.push(i);
        if f.list[i].idempotent && b.chance(24) {
            // A duplicate, delivered now or a little later.
            let at = order.len() - b.below(2).min(order.len() - 1);
            order.insert(at, i);
        }
    }
    order
}

fn begin(h: &mut Harness, guide: bool) -> Result<(), String> {
    h.feed_json(
        json!({"type":"createSession","agentSessionId":ROOT,"workspaceId":"W","provider":"fuzz",
        "capabilities":{"guideWhileChildrenOnly":guide}}),
    )?;
    h.feed_json(json!({"type":"submit","agentSessionId":ROOT,"turnId":ROOT_TURN,"text":"hello"}))?;
    Ok(())
}

/// The order-independent meaning of a final state: relations, phases, outcomes, errors, the root
/// provider lifecycle, interaction and tool call statuses, and message ids, without versions,
/// timestamps or sequence numbers.
pub fn meaning(snap: &TreeSnapshot) -> BTreeMap<String, Value> {
    let mut m = BTreeMap::new();
    for s in &snap.sessions {
        m.insert(
            format!("session {}", s.id),
            json!([
                s.kind(),
                s.parent_agent_session_id(),
                s.parent_turn_id(),
                s.parent_tool_call_id(),
                s.root_turn_id(),
                s.active_turn_id,
                s.title,
                s.provider_aliases,
                s.deleted_at.is_some(),
                s.goal
            ]),
        );
    }
    for t in &snap.turns {
        m.insert(
            format!("turn {}", t.id),
            json!([
                t.agent_session_id,
                t.phase(),
                t.outcome(),
                t.error(),
                t.child_session_count(),
                t.child_creation_closed(),
                t.root_provider_turn().map(|r| json!([
                    r.phase(),
                    r.retained_outcome(),
                    r.retained_error(),
                    r.reserved()
                ]))
            ]),
        );
    }
    for i in &snap.interactions {
        m.insert(
            format!("interaction {}/{}", i.turn_id, i.request_id),
            json!(i.status),
        );
    }
    for c in &snap.tool_calls {
        m.insert(
            format!("tool {}/{}", c.agent_session_id, c.tool_call_id),
            json!([c.turn_id, c.status]),
        );
    }
    for (s, id) in &snap.message_ids {
        m.insert(format!("message {s}/{id}"), Value::Null);
    }
    m
}

fn run_facts(shape: &Shape, f: &Facts, order: &[usize]) -> Result<BTreeMap<String, Value>, String> {
    let mut h = Harness::new();
    begin(&mut h, true)?;
    for &i in order {
        h.feed_json(f.list[i].input.clone())
            .map_err(|e| format!("{e} (fact {})", f.list[i].input))?;
    }
    let snap = h
        .store
        .load_tree(ROOT)
        .map_err(|e| e.to_string())?
        .ok_or("no tree")?;
    let root = snap
        .turns
        .iter()
        .find(|t| &*t.id == ROOT_TURN)
        .ok_or("no root turn")?;
    let want = Some(shape.root_outcome);
    let got = root.outcome().map(|o| format!("{o:?}").to_lowercase());
    if got.as_deref() != want {
        return Err(format!(
            "every fact delivered, the root turn ended {got:?}, the root provider said {want:?}"
        ));
    }
    if let Some(active) = snap.turns.iter().find(|t| t.is_active()) {
        return Err(format!(
            "every fact delivered, turn {} is still {:?}",
            active.id,
            active.phase()
        ));
    }
    Ok(meaning(&snap))
}

/// Fuzz target `engine_orderings`: see the module docs. `Err` names the broken rule.
pub fn try_engine_orderings(data: &[u8]) -> Result<(), String> {
    let mut b = Bytes::new(data);
    let s = shape(&mut b);
    let f = facts(&s);
    let a = interleave(&f, &mut b);
    let c = interleave(&f, &mut b);
    let ma = run_facts(&s, &f, &a)?;
    let mc = run_facts(&s, &f, &c)?;
    if ma != mc {
        let diff: Vec<String> = ma
            .iter()
            .filter(|(k, v)| mc.get(*k) != Some(*v))
            .map(|(k, v)| format!("{k}: {v} vs {}", mc.get(k).unwrap_or(&Value::Null)))
            .chain(
                mc.keys()
                    .filter(|k| !ma.contains_key(*k))
                    .map(|k| format!("{k}: only in the second")),
            )
            .collect();
        return Err(format!(
            "the same facts in two orders reached different states: {diff:?}"
        ));
    }
    with_commands(&f, &mut b, false).map(|_| ())
}

/// The third part of [`engine_orderings`] alone (a tree, its facts interleaved with commands),
/// with every committed batch recorded: the workload of the `store_roundtrip` target. Returns the
/// harness (its reference store holds the final state) and the bytes not consumed.
pub fn engine_workload(data: &[u8]) -> Result<(Harness, &[u8]), String> {
    let mut b = Bytes::new(data);
    let s = shape(&mut b);
    let f = facts(&s);
    let h = with_commands(&f, &mut b, true)?;
    let rest = data.get(b.position()..).unwrap_or_default();
    Ok((h, rest))
}

/// Fuzz target `engine_orderings`; panics with the broken rule.
pub fn engine_orderings(data: &[u8]) {
    if let Err(e) = try_engine_orderings(data) {
        panic!("engine_orderings: {e}");
    }
}

/// The facts again, interleaved with commands and runtime answers decided by the bytes.
fn with_commands(f: &Facts, b: &mut Bytes<'_>, record: bool) -> Result<Harness, String> {
    let mut h = Harness::new();
    h.record = record;
    begin(&mut h, b.chance(200))?;
    let mut done = vec![false; f.list.len()];
    let mut delivered: Vec<usize> = Vec::new();
    let (mut ops, mut turns) = (0u32, 0u32);
    let mut extra = 0;
    loop {
        let command = b.chance(48);
        if !command {
            if let Some(i) = pick_ready(f, &done, b) {
                done[i] = true;
                delivered.push(i);
                h.feed_json(f.list[i].input.clone())?;
                continue;
            }
            if b.exhausted() || extra > 64 {
                break;
            }
        }
        extra += usize::from(done.iter().all(|d| *d));
        command_step(&mut h, f, &delivered, b, &mut ops, &mut turns)?;
        if b.exhausted() && done.iter().all(|d| *d) {
            break;
        }
    }
    // Let every armed timer fire: no cancel stays prepared past its deadline.
    h.fire_timers()?;
    if let Some(op) = h.engine.prepared_cancels().first() {
        return Err(format!(
            "cancel {} still prepared after its deadline fired",
            op.id
        ));
    }
    Ok(h)
}

fn sessions(h: &Harness) -> Vec<Id> {
    h.engine
        .snapshot(ROOT)
        .map(|s| s.sessions.into_iter().map(|s| s.id).collect())
        .unwrap_or_default()
}

fn command_step(
    h: &mut Harness,
    f: &Facts,
    delivered: &[usize],
    b: &mut Bytes<'_>,
    ops: &mut u32,
    turns: &mut u32,
) -> Result<(), String> {
    let all = sessions(h);
    let pick = |b: &mut Bytes<'_>, v: &[Id]| -> Id {
        v.get(b.below(v.len()))
            .cloned()
            .unwrap_or_else(|| ROOT.into())
    };
    let active_turn = |h: &Harness, s: &Id| -> Option<Id> {
        h.engine.session(s).and_then(|s| s.active_turn_id.clone())
    };
    let ids: Vec<Id> = h
        .engine
        .snapshot(ROOT)
        .map(|s| s.cancel_operations.into_iter().map(|o| o.id).collect())
        .unwrap_or_default();
    match b.below(12) {
        0 => {
            *turns += 1;
            h.feed_json(json!({"type":"submit","agentSessionId":ROOT,"turnId":format!("T{turns}"),"text":"more"}))?;
        }
        1 => {
            *ops += 1;
            let turn = active_turn(h, &ROOT.into()).unwrap_or_else(|| ROOT_TURN.into());
            h.feed_json(json!({"type":"cancelTurn","operationId":format!("op{ops}"),"agentSessionId":ROOT,"turnId":turn}))?;
        }
        2 => {
            *ops += 1;
            let s = pick(b, &all);
            let turn = active_turn(h, &s).unwrap_or_else(|| format!("{s}/t1").into());
            h.feed_json(json!({"type":"cancelTurn","operationId":format!("op{ops}"),"agentSessionId":s,"turnId":turn}))?;
        }
        3 => {
            let op = pick(b, &ids);
            let targets = h
                .engine
                .cancel_operation(&op)
                .map(|o| o.targets.clone())
                .unwrap_or_default();
            let mask = b.byte();
            let acked: Vec<_> = targets
                .iter()
                .enumerate()
                .filter(|(i, _)| mask >> (i % 8) & 1 == 1)
                .map(|(_, t)| t.clone())
                .collect();
            h.feed(&Input::Runtime(RuntimeAnswer::CancelResult {
                operation_id: op,
                acked,
            }))?;
        }
        4 => {
            let op = pick(b, &ids);
            h.feed(&Input::Runtime(RuntimeAnswer::CancelFailed {
                operation_id: op,
                error: "write failed".into(),
            }))?;
        }
        5 => {
            let op = pick(b, &ids);
            h.feed(&Input::Runtime(RuntimeAnswer::TimerFired {
                timer: TimerId::CancelDeadline { operation_id: op },
            }))?;
        }
        6 => {
            let pending = h.engine.pending_interactions(ROOT);
            if let Some(i) = pending.get(b.below(pending.len().max(1))) {
                let response = if b.chance(128) {
                    json!("allow")
                } else {
                    json!("deny")
                };
                h.feed(&Input::Command(Command::RespondInteraction {
                    agent_session_id: i.agent_session_id.clone(),
                    turn_id: i.turn_id.clone(),
                    request_id: i.request_id.clone(),
                    response,
                }))?;
            }
        }
        7 => {
            let s = pick(b, &all);
            h.feed(&Input::Command(Command::DeleteSession {
                agent_session_id: s,
            }))?;
        }
        8 => {
            let turn = active_turn(h, &ROOT.into()).unwrap_or_else(|| ROOT_TURN.into());
            h.feed(&Input::Runtime(RuntimeAnswer::GuideFailed {
                agent_session_id: ROOT.into(),
                turn_id: turn,
                error: "pipe closed".into(),
            }))?;
        }
        9 => {
            h.feed(&Input::Runtime(RuntimeAnswer::ProviderExited {
                root_agent_session_id: ROOT.into(),
                error: "killed".into(),
            }))?;
        }
        10 => h.reload(ROOT)?,
        _ => {
            // A late duplicate of any fact delivered so far (late output after settle, a
            // repeated terminal, a repeated creation, ...).
            if let Some(&i) = delivered.get(b.below(delivered.len().max(1))) {
                h.feed_json(f.list[i].input.clone())?;
            }
        }
    }
    Ok(())
}
