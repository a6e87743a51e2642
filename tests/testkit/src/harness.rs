//! [`Harness`]: an engine, the reference store and a [`History`], checked after every input.

use crate::checks::{check_all, History};
use serde_json::Value;
use tutti_core::input::{Input, RuntimeAnswer};
use tutti_core::model::Millis;
use tutti_core::step::{PersistBatch, Step, TimerRequest};
use tutti_core::store::{MemoryStore, Store};
use tutti_core::Engine;

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
    pub batches: Vec<PersistBatch>,
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
