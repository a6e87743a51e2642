//! Helpers behind the cargo-fuzz targets (`fuzz/`), compiled with the `fuzzing` feature. The same
//! functions run on stable as `tests/tests/fuzz_corpus.rs` over the checked-in seed corpus
//! (`fuzz/seeds/<target>/*`), and the seeded simulation (`tests/src/sim`) reuses [`History`] and
//! [`check_all`].
//!
//! Every target takes raw bytes and either returns `Ok` or describes the broken rule; the
//! `fuzz_target!` wrappers panic on `Err`, so libFuzzer records the input as a crash. A panic
//! inside the engine or an adapter is a crash too.
//!
//! - [`engine_orderings`]: a tree decoded from the bytes ([`Bytes`], a tiny byte-driven decoder;
//!   an exhausted input reads as zeros, which always means "the simplest choice"), its provider
//!   facts in two causal interleavings (with idempotent duplicates) that must reach the same final
//!   state, then the facts again interleaved with commands (submit, cancel root, cancel child,
//!   cancel results, respond, delete, guide failures, provider exits, reloads from the store).
//!   After every step: [`check_all`].
//! - [`acp_native`], [`codex_native`], [`claude_native`]: native lines through the real adapter
//!   and the engine ([`LineDriver`]): no panic, garbage is a typed error, [`check_all`] after
//!   every engine step.
//!
//! This file only names items through `super::` (the crate root) so that a crate that cannot
//! turn the `fuzzing` feature on may include it with `#[path]` under a module that glob-imports
//! `tutti_core::*` (see `tests/tests/fuzz_corpus.rs`).

use super::adapters::{parse_line, take_due, Adapter, AdapterOutput, AdapterTimer};
use super::input::{Command, Input, NormalizedEvent, RuntimeAnswer, TimerId};
use super::model::{CancelState, Id, InteractionStatus, Millis, Outcome, Phase, SessionKind};
use super::snapshot::TreeSnapshot;
use super::step::{ProviderRequest, Step, TimerRequest};
use super::store::{MemoryStore, Store};
use super::Engine;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

// ----- the byte decoder ------------------------------------------------------------------------

/// A tiny byte-driven decoder. Reading past the end yields zeros, so every input decodes, and a
/// shorter input means simpler choices (choice 0 is always the plainest one).
#[derive(Debug, Clone)]
pub struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    /// A decoder over `data`.
    pub fn new(data: &'a [u8]) -> Bytes<'a> {
        Bytes { data, pos: 0 }
    }

    /// The next byte (0 past the end).
    pub fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos = self.pos.saturating_add(1);
        b
    }

    /// A number in `0..n` (0 when `n <= 1`).
    pub fn below(&mut self, n: usize) -> usize {
        match n {
            0 | 1 => 0,
            2..=256 => self.byte() as usize % n,
            _ => (usize::from(self.byte()) << 8 | usize::from(self.byte())) % n,
        }
    }

    /// True with probability `p / 256`.
    pub fn chance(&mut self, p: u8) -> bool {
        // An exhausted input reads 0, which is "no": faults and extras stop.
        let b = self.byte();
        b != 0 && b <= p
    }

    /// Whether every byte was read.
    pub fn exhausted(&self) -> bool {
        self.pos >= self.data.len()
    }
}

// ----- shared checks ---------------------------------------------------------------------------

/// Rules that need the history of a run, not just its current state. The simulation and every
/// fuzz target feed it each state they observe.
///
/// - "a canceled root never reopens", generalized: a settled turn stays settled with the same
///   outcome (also across reloads);
/// - "no child exists that was first revealed after its root's cancel was prepared": the child
///   sessions of a root turn are frozen the first time a root cancel operation of it is seen;
/// - a tombstoned session stays tombstoned;
/// - "every outbox sequence is gap-free": outbox rows are numbered 1, 2, 3, ... without holes.
#[derive(Debug, Default, Clone)]
pub struct History {
    settled: BTreeMap<Id, Outcome>,
    frozen: BTreeMap<Id, BTreeSet<Id>>,
    tombstoned: BTreeSet<Id>,
    outbox_seen: u64,
}

impl History {
    /// A history with nothing seen.
    pub fn new() -> History {
        History::default()
    }

    /// Checks one tree's state against what was seen before, then remembers it.
    pub fn observe_tree(&mut self, t: &TreeSnapshot) -> Result<(), String> {
        for turn in &t.turns {
            match (self.settled.get(&turn.id), turn.phase, turn.outcome) {
                (Some(o), Phase::Settled, Some(now)) if *o != now => {
                    return Err(format!(
                        "turn {} settled {o:?} and later shows outcome {now:?}",
                        turn.id
                    ))
                }
                (Some(o), phase, _) if phase != Phase::Settled => {
                    return Err(format!(
                        "turn {} settled {o:?} and reopened as {phase:?} (a canceled root never reopens)",
                        turn.id
                    ))
                }
                (None, Phase::Settled, Some(o)) => {
                    self.settled.insert(turn.id.clone(), o);
                }
                _ => {}
            }
        }
        for op in t.cancel_operations.iter().filter(|o| o.includes_root) {
            let children: BTreeSet<Id> = t
                .sessions
                .iter()
                .filter(|s| s.kind() == SessionKind::Child && s.root_turn_id() == Some(&op.turn_id))
                .map(|s| s.id.clone())
                .collect();
            match self.frozen.get(&op.turn_id) {
                None => {
                    self.frozen.insert(op.turn_id.clone(), children);
                }
                Some(before) => {
                    if let Some(late) = children.difference(before).next() {
                        return Err(format!(
                            "child {late} was first revealed after the cancel of its root turn {} was prepared",
                            op.turn_id
                        ));
                    }
                }
            }
        }
        for s in &t.sessions {
            if s.deleted_at.is_some() {
                self.tombstoned.insert(s.id.clone());
            } else if self.tombstoned.contains(&s.id) {
                return Err(format!("deleted session {} came back", s.id));
            }
        }
        Ok(())
    }

    /// Checks that the outbox rows written since the last call continue the sequence without a
    /// gap.
    pub fn observe_outbox<S: Store>(&mut self, store: &S) -> Result<(), String> {
        let rows = store
            .outbox_after(self.outbox_seen, usize::MAX)
            .map_err(|e| format!("outbox read failed: {e}"))?;
        for r in rows {
            if r.seq != self.outbox_seen + 1 {
                return Err(format!(
                    "outbox sequence has a gap: {} follows {}",
                    r.seq, self.outbox_seen
                ));
            }
            self.outbox_seen = r.seq;
        }
        Ok(())
    }

    /// The last outbox sequence number seen.
    pub fn outbox_seen(&self) -> u64 {
        self.outbox_seen
    }
}

/// Every check after a step: the engine's invariant checker on every loaded tree (and the
/// engine's own indexes), "the stored state equals the engine's state" (so the stored trees pass
/// the checker too; the same checks as [`scenario::invariants`](super::scenario::invariants)),
/// and the [`History`] rules.
pub fn check_all<S: Store>(
    engine: &Engine,
    store: &S,
    history: &mut History,
) -> Result<(), String> {
    // What `scenario::invariants` checks, with one snapshot per tree: the checker on the engine
    // (its trees and its own indexes), then stored == engine, so the stored tree passes too.
    let v = engine.check_invariants();
    if !v.is_empty() {
        return Err(format!("invariants (engine): {v:?}"));
    }
    for root in engine.roots() {
        let Some(mem) = engine.snapshot(&root) else {
            continue;
        };
        let stored = store
            .load_tree(&root)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("tree {root} missing from the store"))?;
        if mem != stored {
            return Err(format!("store and engine differ for tree {root}"));
        }
        history.observe_tree(&mem)?;
    }
    history.observe_outbox(store)
}

/// The per-step checks for one tree (cheaper than [`check_all`] when several trees are loaded
/// and only one changed): the engine's state of `root` equals the stored one, the invariant
/// checker holds on it, and the [`History`] rules. The engine's own index checks
/// ([`Engine::check_invariants`]) and the outbox are left to [`check_all`].
pub fn check_one<S: Store>(
    engine: &Engine,
    store: &S,
    history: &mut History,
    root: &str,
) -> Result<(), String> {
    let Some(mem) = engine.snapshot(root) else {
        return Ok(());
    };
    let stored = store
        .load_tree(root)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("tree {root} missing from the store"))?;
    if mem != stored {
        return Err(format!("store and engine differ for tree {root}"));
    }
    let v = super::invariants::check_tree(&mem);
    if !v.is_empty() {
        return Err(format!("invariants: {v:?}"));
    }
    history.observe_tree(&mem)
}

/// An engine, the reference store and a history: feeds inputs, commits steps and checks after
/// every one.
#[derive(Debug, Default)]
pub struct Harness {
    /// The engine.
    pub engine: Engine,
    /// The reference store.
    pub store: MemoryStore,
    /// What was seen so far.
    pub history: History,
    /// The time of the last input.
    pub now: Millis,
    /// Engine timers armed and not yet fired.
    pub timers: Vec<TimerRequest>,
    /// Inputs fed so far (accepted or not).
    pub inputs: usize,
    /// Keep every committed batch in [`Harness::batches`].
    pub record: bool,
    /// The committed batches, in order (when [`Harness::record`] is set).
    pub batches: Vec<super::step::PersistBatch>,
}

/// Inputs a harness feeds at most (a fuzz input may not run forever).
pub const MAX_INPUTS: usize = 20_000;

impl Harness {
    /// An empty engine and store.
    pub fn new() -> Harness {
        Harness::default()
    }

    /// Feeds one input at `now + 1`. `Ok(None)`: rejected (nothing changed). `Err`: a rule broke.
    pub fn feed(&mut self, input: &Input) -> Result<Option<Step>, String> {
        self.inputs += 1;
        if self.inputs > MAX_INPUTS {
            return Err(format!(
                "more than {MAX_INPUTS} inputs: a loop between adapter and engine?"
            ));
        }
        self.now += 1;
        let Ok(step) = self.engine.handle(self.now, input) else {
            return Ok(None);
        };
        if let Err(e) = self.store.apply(&step.persist) {
            return Err(format!(
                "the store refused a step of its only writer ({}): {e}",
                input.kind()
            ));
        }
        if self.record {
            self.batches.push(step.persist.clone());
        }
        self.timers.extend(step.timers.iter().cloned());
        check_all(&self.engine, &self.store, &mut self.history)
            .map_err(|e| format!("after {}: {e}", input.kind()))?;
        Ok(Some(step))
    }

    /// Feeds wire JSON (must be a valid input).
    pub fn feed_json(&mut self, v: Value) -> Result<Option<Step>, String> {
        let input: Input = serde_json::from_value(v).map_err(|e| format!("bad input: {e}"))?;
        self.feed(&input)
    }

    /// Drops a tree from memory and reloads it from the store ("crash-only"), then checks that
    /// the reloaded state equals the stored one.
    pub fn reload(&mut self, root: &str) -> Result<(), String> {
        self.engine.evict(root);
        let snap = self
            .store
            .load_tree(root)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("tree {root} missing from the store"))?;
        self.engine
            .restore(snap)
            .map_err(|e| format!("stored tree {root} does not restore: {e}"))?;
        check_all(&self.engine, &self.store, &mut self.history)
            .map_err(|e| format!("after reload: {e}"))
    }

    /// Fires every armed engine timer (earliest first) at its time.
    pub fn fire_timers(&mut self) -> Result<Vec<Step>, String> {
        let mut steps = Vec::new();
        let mut timers = std::mem::take(&mut self.timers);
        timers.sort_by_key(|t| t.at);
        for t in timers {
            self.now = self.now.max(t.at);
            if let Some(s) = self.feed(&Input::Runtime(RuntimeAnswer::TimerFired {
                timer: t.timer,
            }))? {
                steps.push(s);
            }
        }
        Ok(steps)
    }
}

// ----- engine_orderings ------------------------------------------------------------------------

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
                t.phase,
                t.outcome,
                t.error,
                t.child_session_count,
                t.child_creation_closed,
                t.root_provider_turn.as_ref().map(|r| json!([
                    r.phase,
                    r.retained_outcome,
                    r.retained_error,
                    r.reserved
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
    let got = root.outcome.map(|o| format!("{o:?}").to_lowercase());
    if got.as_deref() != want {
        return Err(format!(
            "every fact delivered, the root turn ended {got:?}, the root provider said {want:?}"
        ));
    }
    if let Some(active) = snap.turns.iter().find(|t| t.is_active()) {
        return Err(format!(
            "every fact delivered, turn {} is still {:?}",
            active.id, active.phase
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
    let rest = data.get(b.pos..).unwrap_or_default();
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

// ----- native lines through an adapter ---------------------------------------------------------

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
            capabilities: Some(super::model::Capabilities {
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

/// Fuzz target `acp_native`: native ACP lines through [`super::adapters::acp::AcpAdapter`] and
/// the engine.
pub fn try_acp_native(data: &[u8]) -> Result<(), String> {
    let adapter = super::adapters::acp::AcpAdapter::new(
        "root".into(),
        super::adapters::acp::AcpConfig::default(),
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
/// [`super::adapters::codex::CodexAdapter`] and the engine.
pub fn try_codex_native(data: &[u8]) -> Result<(), String> {
    let adapter = super::adapters::codex::CodexAdapter::new(
        "root".into(),
        super::adapters::codex::CodexConfig::default(),
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
/// sidecar lines through [`super::adapters::claude::ClaudeAdapter`] and the engine.
pub fn try_claude_native(data: &[u8]) -> Result<(), String> {
    let adapter = super::adapters::claude::ClaudeAdapter::new(
        "root".into(),
        super::adapters::claude::ClaudeConfig::default(),
    );
    LineDriver::new(
        adapter,
        "claude",
        Some(super::adapters::claude::sidecar_line),
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

/// Settled turns and prepared cancels of a state, for callers that check liveness.
pub fn unsettled(snap: &TreeSnapshot) -> Vec<String> {
    let mut v: Vec<String> = snap
        .turns
        .iter()
        .filter(|t| t.is_active())
        .map(|t| format!("turn {} is {:?}", t.id, t.phase))
        .collect();
    v.extend(
        snap.cancel_operations
            .iter()
            .filter(|o| o.state == CancelState::Prepared)
            .map(|o| format!("cancel {} is still prepared", o.id)),
    );
    v.extend(
        snap.interactions
            .iter()
            .filter(|i| i.status == InteractionStatus::Pending)
            .map(|i| format!("interaction {} is still pending", i.request_id)),
    );
    v
}
