//! Operator metrics of `tuttid` in the Prometheus text exposition format (issue 22: "Operators
//! can see inside the daemon").
//!
//! Every metric is named `tutti_*` with base units (`_seconds`, counters `_total`) and carries
//! only bounded labels: input kinds, results and reasons, provider names of the config, turn
//! phases. Never an id, a prompt or any other content.
//!
//! Two kinds of figures:
//! - **State gauges** (live trees, root turns by phase, roots waiting only on children, active
//!   child turns, provider processes, pending interactions) are computed at scrape time from the
//!   engine state (the engine thread answers one [`StateGauges`] per scrape), so they cannot drift
//!   from the truth as inc/dec bookkeeping could. Followers, outbox head and lag are read from
//!   the daemon's live positions at scrape time too.
//! - **Counters and histograms** are recorded at a few hook points of the engine thread
//!   ([`crate::daemon`]): one call each into [`Metrics`].
//!
//! Choices where the issue is open:
//! - Inputs by kind and result count the inputs that have a caller (API commands): native
//!   provider events are decided inside the driver, which reports no per-event result.
//! - Provider requests by kind count the requests of those decided inputs' steps (start, guide,
//!   cancel, respond).
//! - "Provider line → committed" is measured from the moment the engine thread took the round
//!   holding the provider's message to the commit of that round.
//! - Root waiting time runs from the commit of the root turn's `waiting` row to the commit of its
//!   next row in another phase; cancel time to settle from the operation's `createdAt` to its
//!   `updatedAt` when it reaches a terminal state (the rows' own clock).

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tutti_core::model::{CancelOperation, CancelState, Id, Phase, Turn};
use tutti_core::step::{Ignored, PersistBatch, ProviderRequest, Row};
use tutti_core::Step;

/// One label: `kind`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// A bounded kind name.
    pub kind: String,
}

/// Labels of a decided input.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InputLabels {
    /// The input's wire kind (`submit`, `cancelTurn`, ...).
    pub kind: String,
    /// `applied`, `ignored` or `rejected`.
    pub result: String,
    /// The ignored reason or the rejection code; empty when applied.
    pub reason: String,
}

/// One label: `result`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `confirmed`, `partially_confirmed`, `failed` or `timed_out`.
    pub result: String,
}

/// One label: `provider` (a provider name of the config).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderLabel {
    /// Provider name.
    pub provider: String,
}

/// One label: `stage` (see [`Stage`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabel {
    /// `parse`, `decide`, `commit`, `publish` or `stream`.
    pub stage: String,
}

/// Where the daemon spends its time on the path provider line → committed → streamed (issue 33:
/// the per-stage share).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The transports' readers parsing provider lines into native messages, on the runtime's
    /// workers ([`crate::runtime::ParseClock`]). The ACP transport's reader parses every line;
    /// the few it hands to the `agent-client-protocol` crate (answers, the agent's requests,
    /// not the `session/update`s) the crate parses once more inside, untimed.
    Parse,
    /// The engine thread deciding inputs: the adapters reading native messages and the engine
    /// deciding the steps (the `Driver`'s `handle_*` calls).
    Decide,
    /// The group commits (`apply_group`).
    Commit,
    /// Announcing commits to the live followers (the engine thread).
    Publish,
    /// The event streams turning rows into SSE events (every follower's time, summed).
    Stream,
}

impl Stage {
    /// Every stage, in path order.
    pub const ALL: [Stage; 5] = [
        Stage::Parse,
        Stage::Decide,
        Stage::Commit,
        Stage::Publish,
        Stage::Stream,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Parse => "parse",
            Stage::Decide => "decide",
            Stage::Commit => "commit",
            Stage::Publish => "publish",
            Stage::Stream => "stream",
        }
    }
}

/// One stage's counter, shared with the registry (see [`Metrics::stage_counter`]).
#[derive(Clone, Debug)]
pub struct StageCounter(Counter<f64, std::sync::atomic::AtomicU64>);

impl StageCounter {
    /// Counts `took` against the stage.
    pub fn add(&self, took: Duration) {
        self.0.inc_by(took.as_secs_f64());
    }
}

/// One label: `phase`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// `submitted`, `running`, `waiting` or `settling`.
    pub phase: String,
}

/// The state gauges, computed by the engine thread at scrape time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateGauges {
    /// Trees loaded in the engine.
    pub resident_trees: u64,
    /// Loaded trees with an active turn, a prepared cancel or a pending interaction.
    pub live_trees: u64,
    /// Active root turns per phase name.
    pub root_turns_by_phase: BTreeMap<&'static str, u64>,
    /// Root turns in phase `waiting` (their provider turn ended) with active children.
    pub roots_waiting_on_children: u64,
    /// Active child turns, all trees.
    pub active_child_turns: u64,
    /// Pending interactions, all trees.
    pub pending_interactions: u64,
    /// Running provider processes per provider name.
    pub processes: BTreeMap<String, u64>,
}

/// The wire name of a phase (as the API spells it).
pub fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Submitted => "submitted",
        Phase::Running => "running",
        Phase::Waiting => "waiting",
        Phase::Settling => "settling",
        Phase::Settled => "settled",
    }
}

/// The label of a provider request.
fn request_kind(r: &ProviderRequest) -> &'static str {
    match r {
        ProviderRequest::Start { .. } => "start",
        ProviderRequest::Guide { .. } => "guide",
        ProviderRequest::Cancel { .. } => "cancel",
        ProviderRequest::RespondInteraction { .. } => "respondInteraction",
    }
}

/// The label of an ignored reason.
fn ignored_name(i: Ignored) -> String {
    serde_json::to_value(i)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| "other".into())
}

/// The result label of a terminal cancel operation: `confirmed` (every target acknowledged),
/// `partially_confirmed` (some), `timed_out` (the cancel deadline passed), `failed` (otherwise).
pub fn cancel_result(op: &CancelOperation) -> Option<&'static str> {
    match op.state {
        CancelState::Prepared => None,
        CancelState::Completed if op.acked.len() >= op.targets.len() => Some("confirmed"),
        CancelState::Completed => Some("partially_confirmed"),
        CancelState::Failed if op.error.as_deref() == Some("cancellation timed out") => {
            Some("timed_out")
        }
        CancelState::Failed if !op.acked.is_empty() => Some("partially_confirmed"),
        CancelState::Failed => Some("failed"),
    }
}

/// Timings the engine thread keeps between commits.
#[derive(Default)]
struct Pending {
    /// Root turns in `waiting`, since when.
    waiting: HashMap<Id, Instant>,
    /// Cancel operations seen prepared (a terminal row counts once).
    prepared: HashSet<Id>,
}

/// The registry and every metric of the daemon.
pub struct Metrics {
    registry: Registry,
    started: Instant,
    inputs: Family<InputLabels, Counter>,
    provider_requests: Family<KindLabel, Counter>,
    cancels: Family<ResultLabel, Counter>,
    process_starts: Family<ProviderLabel, Counter>,
    process_exits: Family<ProviderLabel, Counter>,
    process_restarts: Family<ProviderLabel, Counter>,
    commit_failures: Counter,
    guard_failures: Counter,
    commit_seconds: Histogram,
    commit_batches: Histogram,
    line_to_commit: Histogram,
    waiting_on_children: Histogram,
    cancel_settle: Histogram,
    /// Per [`Stage`], in [`Stage::ALL`] order (the family's series, looked up once).
    stages: [Counter<f64, std::sync::atomic::AtomicU64>; 5],
    // Gauges (set at scrape time).
    uptime: Gauge<f64, std::sync::atomic::AtomicU64>,
    resident_trees: Gauge,
    live_trees: Gauge,
    root_turns: Family<PhaseLabel, Gauge>,
    roots_waiting: Gauge,
    child_turns: Gauge,
    pending_interactions: Gauge,
    processes: Family<ProviderLabel, Gauge>,
    followers: Gauge,
    outbox_head: Gauge,
    follower_lag: Gauge,
    store_up: Gauge,
    store_reconnects: Counter,
    store_unavailable: Counter<f64, std::sync::atomic::AtomicU64>,
    /// The store figures already counted: (reconnects, unavailable seconds).
    store_seen: Mutex<(u64, f64)>,
    pending: Mutex<Pending>,
}

fn seconds_histogram() -> Histogram {
    // 100 µs .. ~105 s.
    Histogram::new(exponential_buckets(0.0001, 4.0, 11))
}

impl Metrics {
    /// A registry with every metric registered at zero; `database` (the database file) is a
    /// label of `tutti_info`, with the version (one series, a constant).
    pub fn new(database: &str) -> Metrics {
        let mut r = Registry::default();
        let m = Metrics {
            registry: Registry::default(),
            started: Instant::now(),
            inputs: Family::default(),
            provider_requests: Family::default(),
            cancels: Family::default(),
            process_starts: Family::default(),
            process_exits: Family::default(),
            process_restarts: Family::default(),
            commit_failures: Counter::default(),
            guard_failures: Counter::default(),
            commit_seconds: seconds_histogram(),
            commit_batches: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
            line_to_commit: seconds_histogram(),
            waiting_on_children: seconds_histogram(),
            cancel_settle: seconds_histogram(),
            stages: Default::default(),
            uptime: Gauge::default(),
            resident_trees: Gauge::default(),
            live_trees: Gauge::default(),
            root_turns: Family::default(),
            roots_waiting: Gauge::default(),
            child_turns: Gauge::default(),
            pending_interactions: Gauge::default(),
            processes: Family::default(),
            followers: Gauge::default(),
            outbox_head: Gauge::default(),
            follower_lag: Gauge::default(),
            store_up: Gauge::default(),
            store_reconnects: Counter::default(),
            store_unavailable: Counter::default(),
            store_seen: Mutex::new((0, 0.0)),
            pending: Mutex::new(Pending::default()),
        };
        m.store_up.set(1);
        r.register(
            "tutti_store_up",
            "1 while the store's database is reachable, 0 while it is not (issue 34)",
            m.store_up.clone(),
        );
        r.register(
            "tutti_store_reconnects",
            "Connections to the store's database replaced after they broke",
            m.store_reconnects.clone(),
        );
        r.register_with_unit(
            "tutti_store_unavailable",
            "Seconds the store's database was unreachable",
            Unit::Seconds,
            m.store_unavailable.clone(),
        );
        let info = Family::<Vec<(String, String)>, Gauge>::default();
        info.get_or_create(&vec![
            ("version".to_string(), env!("CARGO_PKG_VERSION").to_string()),
            ("database".to_string(), database.to_string()),
        ])
        .set(1);
        r.register(
            "tutti_info",
            "Daemon information (labels version and database)",
            info,
        );
        r.register_with_unit(
            "tutti_uptime",
            "Seconds since the daemon started",
            Unit::Seconds,
            m.uptime.clone(),
        );
        r.register(
            "tutti_resident_trees",
            "Agent trees loaded in the engine",
            m.resident_trees.clone(),
        );
        r.register(
            "tutti_live_trees",
            "Trees with an active turn, a prepared cancel or a pending interaction",
            m.live_trees.clone(),
        );
        r.register(
            "tutti_active_root_turns",
            "Active root turns by phase",
            m.root_turns.clone(),
        );
        r.register(
            "tutti_root_turns_waiting_on_children",
            "Root turns whose provider turn ended and that wait only on child turns",
            m.roots_waiting.clone(),
        );
        r.register(
            "tutti_active_child_turns",
            "Active child turns",
            m.child_turns.clone(),
        );
        r.register(
            "tutti_pending_interactions",
            "Pending interactions (permission or input requests)",
            m.pending_interactions.clone(),
        );
        r.register(
            "tutti_provider_processes",
            "Running provider processes by provider",
            m.processes.clone(),
        );
        r.register(
            "tutti_sse_followers",
            "Connected event-stream followers",
            m.followers.clone(),
        );
        r.register(
            "tutti_outbox_head_seq",
            "Newest committed outbox sequence number",
            m.outbox_head.clone(),
        );
        r.register(
            "tutti_follower_lag_rows",
            "Outbox rows the slowest event-stream follower is behind the head",
            m.follower_lag.clone(),
        );
        r.register(
            "tutti_inputs",
            "Inputs decided by kind and result (applied, ignored with reason, rejected with code)",
            m.inputs.clone(),
        );
        r.register(
            "tutti_provider_requests",
            "Provider requests by kind",
            m.provider_requests.clone(),
        );
        r.register(
            "tutti_cancel_operations",
            "Settled cancel operations by result",
            m.cancels.clone(),
        );
        r.register(
            "tutti_provider_process_starts",
            "Provider processes started",
            m.process_starts.clone(),
        );
        r.register(
            "tutti_provider_process_exits",
            "Provider processes that exited on their own",
            m.process_exits.clone(),
        );
        r.register(
            "tutti_provider_process_restarts",
            "Provider processes started for a root that had one before",
            m.process_restarts.clone(),
        );
        r.register(
            "tutti_commit_failures",
            "Commits that failed",
            m.commit_failures.clone(),
        );
        r.register(
            "tutti_guard_failures",
            "Commits refused by a guard (a concurrent change)",
            m.guard_failures.clone(),
        );
        r.register_with_unit(
            "tutti_group_commit",
            "Group commit latency",
            Unit::Seconds,
            m.commit_seconds.clone(),
        );
        r.register(
            "tutti_group_commit_batches",
            "Batches per group commit",
            m.commit_batches.clone(),
        );
        r.register_with_unit(
            "tutti_provider_line_to_commit",
            "From the engine taking a provider message to its commit",
            Unit::Seconds,
            m.line_to_commit.clone(),
        );
        r.register_with_unit(
            "tutti_root_waiting_on_children",
            "Time a root turn waited on children after its provider turn ended",
            Unit::Seconds,
            m.waiting_on_children.clone(),
        );
        r.register_with_unit(
            "tutti_cancel_settle",
            "Cancel operation time from prepared to settled",
            Unit::Seconds,
            m.cancel_settle.clone(),
        );
        let stages: Family<StageLabel, Counter<f64, std::sync::atomic::AtomicU64>> =
            Family::default();
        let mut m = m;
        for (i, s) in Stage::ALL.iter().enumerate() {
            m.stages[i] = stages
                .get_or_create(&StageLabel {
                    stage: s.name().into(),
                })
                .clone();
        }
        r.register_with_unit(
            "tutti_stage",
            "Time spent per stage of provider line to committed to streamed (parse, decide, commit, publish, stream)",
            Unit::Seconds,
            stages,
        );
        m.registry = r;
        m
    }

    /// Counts `took` against `stage` (see [`Stage`]).
    pub fn stage(&self, stage: Stage, took: Duration) {
        self.stage_series(stage).inc_by(took.as_secs_f64());
    }

    /// The counter of one stage, for a part of the daemon that counts it from another thread
    /// (a transport's [`crate::runtime::ParseClock`]).
    pub fn stage_counter(&self, stage: Stage) -> StageCounter {
        StageCounter(self.stage_series(stage).clone())
    }

    fn stage_series(&self, stage: Stage) -> &Counter<f64, std::sync::atomic::AtomicU64> {
        let i = Stage::ALL.iter().position(|s| *s == stage).unwrap_or(0);
        &self.stages[i]
    }

    /// Seconds spent so far per stage, in [`Stage::ALL`] order.
    pub fn stage_seconds(&self) -> Vec<(&'static str, f64)> {
        Stage::ALL
            .iter()
            .zip(self.stages.iter())
            .map(|(s, c)| (s.name(), c.get()))
            .collect()
    }

    /// Seconds since the metrics (the daemon) started.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// An input with a caller was decided.
    pub fn input_decided<E: InputError>(&self, kind: &str, result: &Result<Step, E>) {
        let (res, reason) = match result {
            Ok(step) => {
                for r in &step.provider {
                    self.provider_requests
                        .get_or_create(&KindLabel {
                            kind: request_kind(r).into(),
                        })
                        .inc();
                }
                match step.ignored {
                    Some(i) => ("ignored", ignored_name(i)),
                    None => ("applied", String::new()),
                }
            }
            Err(e) => ("rejected", e.code().to_string()),
        };
        self.inputs
            .get_or_create(&InputLabels {
                kind: kind.into(),
                result: res.into(),
                reason,
            })
            .inc();
    }

    /// A group commit of `batches` went through in `took`; `line_round` is when the engine took
    /// the round if it held provider messages.
    pub fn committed(
        &self,
        batches: &[&PersistBatch],
        took: Duration,
        line_round: Option<Instant>,
    ) {
        self.commit_seconds.observe(took.as_secs_f64());
        self.commit_batches.observe(batches.len() as f64);
        if let Some(t) = line_round {
            self.line_to_commit.observe(t.elapsed().as_secs_f64());
        }
        let Ok(mut p) = self.pending.lock() else {
            return;
        };
        for row in batches.iter().flat_map(|b| b.rows.iter()) {
            match row {
                Row::Turn(t) => self.turn_row(&mut p, t),
                Row::CancelOperation(op) => self.cancel_row(&mut p, op),
                _ => {}
            }
        }
    }

    fn turn_row(&self, p: &mut Pending, t: &Turn) {
        if t.root_provider_turn().is_none() {
            return;
        }
        if t.phase() == Phase::Waiting {
            p.waiting.entry(t.id.clone()).or_insert_with(Instant::now);
        } else if let Some(since) = p.waiting.remove(&t.id) {
            self.waiting_on_children
                .observe(since.elapsed().as_secs_f64());
        }
    }

    fn cancel_row(&self, p: &mut Pending, op: &CancelOperation) {
        match cancel_result(op) {
            None => {
                p.prepared.insert(op.id.clone());
            }
            Some(result) => {
                if !p.prepared.remove(&op.id) {
                    return;
                }
                self.cancels
                    .get_or_create(&ResultLabel {
                        result: result.into(),
                    })
                    .inc();
                let ms = op.updated_at.saturating_sub(op.created_at).max(0);
                self.cancel_settle.observe(ms as f64 / 1000.0);
            }
        }
    }

    /// A commit failed (`guard`: refused by a guard).
    pub fn commit_failed(&self, guard: bool) {
        self.commit_failures.inc();
        if guard {
            self.guard_failures.inc();
        }
    }

    /// A provider process was started (`restart`: its root had one before).
    pub fn process_started(&self, provider: &str, restart: bool) {
        let l = ProviderLabel {
            provider: provider.into(),
        };
        self.process_starts.get_or_create(&l).inc();
        if restart {
            self.process_restarts.get_or_create(&l).inc();
        }
    }

    /// A provider process exited on its own.
    pub fn process_exited(&self, provider: &str) {
        self.process_exits
            .get_or_create(&ProviderLabel {
                provider: provider.into(),
            })
            .inc();
    }

    /// Takes the store's reachability figures (issue 34) into the next [`Metrics::render`]; a
    /// store without a server (`None`) is always up.
    pub fn store(&self, health: Option<&tutti_postgres::Health>) {
        let Some(h) = health else {
            return;
        };
        self.store_up.set(i64::from(h.is_up()));
        let (reconnects, seconds) = (h.reconnects(), h.unavailable_seconds());
        let mut seen = match self.store_seen.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if reconnects > seen.0 {
            self.store_reconnects.inc_by(reconnects - seen.0);
        }
        if seconds > seen.1 {
            self.store_unavailable.inc_by(seconds - seen.1);
        }
        *seen = (reconnects.max(seen.0), seconds.max(seen.1));
    }

    /// The exposition text, with the state gauges set from `state` and the followers' figures.
    pub fn render(
        &self,
        state: &StateGauges,
        followers: u64,
        head: u64,
        lowest: Option<u64>,
    ) -> String {
        self.uptime.set(self.started.elapsed().as_secs_f64());
        self.resident_trees.set(state.resident_trees as i64);
        self.live_trees.set(state.live_trees as i64);
        for phase in ["submitted", "running", "waiting", "settling"] {
            let n = state.root_turns_by_phase.get(phase).copied().unwrap_or(0);
            self.root_turns
                .get_or_create(&PhaseLabel {
                    phase: phase.into(),
                })
                .set(n as i64);
        }
        self.roots_waiting
            .set(state.roots_waiting_on_children as i64);
        self.child_turns.set(state.active_child_turns as i64);
        self.pending_interactions
            .set(state.pending_interactions as i64);
        self.processes.clear();
        for (provider, n) in &state.processes {
            self.processes
                .get_or_create(&ProviderLabel {
                    provider: provider.clone(),
                })
                .set(*n as i64);
        }
        self.followers.set(followers as i64);
        self.outbox_head.set(head as i64);
        self.follower_lag
            .set(lowest.map_or(0, |l| head.saturating_sub(l)) as i64);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// A rejection with a stable code (the `reason` label of a rejected input).
pub trait InputError {
    /// The stable code.
    fn code(&self) -> &'static str;
}

impl InputError for tutti_core::driver::DriverError {
    fn code(&self) -> &'static str {
        match self {
            tutti_core::driver::DriverError::Rejected(r) => r.code(),
            tutti_core::driver::DriverError::Unavailable(_) => "unavailable",
            _ => "storage",
        }
    }
}
