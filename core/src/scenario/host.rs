//! The scenario runner as a host of the [`Driver`]: one scenario input at a time, fed as
//! [`DriverInput::Host`], its batches committed to the scenario's store and acknowledged, and
//! what the driver released collected for `expectLast`.
//!
//! The provider side stays scripted by the scenario's own input lines: every root gets a
//! [`ScenarioAdapter`], a passive adapter that records the requests the driver routes to it and
//! emits nothing (no event, answer, native message or timer). It is attached to every root the
//! engine holds before each input, and to a root the driver asks to launch
//! ([`Output::Launch`], a root created and started by one input). Without it the driver would
//! answer a `cancel` or `guide` itself ("no live provider runtime") and change what the
//! scenarios describe.

use crate::adapters::{Adapter, AdapterError, AdapterOutput};
use crate::driver::{CommitFailure, Driver, DriverError, DriverInput, Output, ReplyTo, Testkit};
use crate::input::Input;
use crate::model::{Id, Millis};
use crate::step::ProviderRequest;
use crate::store::HostStore;
use serde_json::Value;
use std::any::Any;

/// What the driver released for the previous input.
#[derive(Debug, Clone)]
pub(super) enum Last {
    /// No input yet.
    None,
    /// The engine accepted the input and its batch (if any) was committed.
    Accepted(Box<Released>),
    /// The engine rejected the input (nothing changed).
    Rejected(String),
}

/// The effects of one accepted input, as the driver released them after its commit.
#[derive(Debug, Clone, Default)]
pub(super) struct Released {
    /// The name of the reply ([`crate::Reply::name`]), if the step had one.
    pub(super) reply: Option<&'static str>,
    /// The provider requests the driver routed to the roots' adapters.
    pub(super) provider: Vec<ProviderRequest>,
    /// The outbox rows published: each row's kind and stored payload.
    pub(super) published: Vec<(&'static str, Value)>,
}

/// The reply token of the input being run (one input at a time).
const TOKEN: ReplyTo = 1;

/// Feeds one scenario input through the driver and carries out everything it released until
/// the driver is idle. `Err`: the input's batch was not committed (a store failure: the
/// scenario fails at this input, as it did when the runner applied steps itself), or the
/// driver broke its ordering guarantee (a reply or a provider request before the batch was
/// committed).
pub(super) fn feed<S: HostStore>(
    driver: &mut Driver,
    store: &mut S,
    at: Millis,
    input: Input,
) -> Result<Last, String> {
    for root in driver.engine().roots() {
        if !driver.has_adapter(&root) {
            attach(driver, store, at, root)?;
        }
    }
    let host = DriverInput::Host {
        now: at,
        input,
        reply: Some(TOKEN),
    };
    driver.handle(host, &*store).map_err(|e| e.to_string())?;
    // Requests the adapters got while the input was decided, before any commit.
    let mut provider = take_requests(driver);
    let early = !provider.is_empty();
    let (mut committed, mut published, mut reply) = (0usize, Vec::new(), None);
    while let Some(out) = driver.poll_output() {
        match out {
            Output::Persist(id) => committed += commit(driver, store, id)?,
            Output::Launch(spec) => attach(driver, store, at, spec.root)?,
            Output::Publish(p) => published.extend(p.rows.into_iter().map(|r| {
                let payload = serde_json::from_str(&r.payload).unwrap_or(Value::Null);
                (r.kind, payload)
            })),
            Output::Reply { to, result } if to == TOKEN && reply.is_none() => {
                reply = Some((result, committed));
            }
            Output::Reply { to, .. } => return Err(format!("unexpected reply (token {to})")),
            // Passive adapters write nothing; diagnostics are for a log.
            Output::Transmit(_) | Output::Diagnostic(_) => {}
        }
    }
    provider.extend(take_requests(driver));
    let Some((result, committed_before_reply)) = reply else {
        return Err("the driver released no reply for the input".into());
    };
    match result {
        Ok(step) => {
            if !step.persist.is_empty() && committed_before_reply == 0 {
                return Err("the driver replied before the input's batch was committed".into());
            }
            if !step.persist.is_empty() && early {
                return Err(
                    "provider requests left the driver before the input's batch was committed"
                        .into(),
                );
            }
            Ok(Last::Accepted(Box::new(Released {
                reply: step.reply.as_ref().map(|r| r.name()),
                provider,
                published,
            })))
        }
        Err(DriverError::Rejected(e)) => Ok(Last::Rejected(e.to_string())),
        Err(e) => Err(format!("store refused the step: {e}")),
    }
}

/// Commits one batch to the store on its own and reports it to the driver; 1 when committed.
fn commit<S: HostStore>(
    driver: &mut Driver,
    store: &mut S,
    id: crate::driver::BatchId,
) -> Result<usize, String> {
    // `None`: superseded by a failed batch of its tree; not to be committed.
    let Some(batch) = driver.batch(id) else {
        return Ok(0);
    };
    let (report, n) = match store.apply_group(&[batch], true) {
        Ok(mut rows) => (
            DriverInput::Committed {
                batch: id,
                published: rows.pop().unwrap_or_default(),
            },
            1,
        ),
        Err(e) => {
            let source = e.source_error();
            let why = if S::is_guard_failure(source) || S::is_fenced(source) {
                CommitFailure::Refused
            } else if S::is_unavailable(source) {
                CommitFailure::Unavailable(source.to_string())
            } else {
                CommitFailure::Failed(source.to_string())
            };
            (DriverInput::NotCommitted { batch: id, why }, 0)
        }
    };
    driver.handle(report, &*store).map_err(|e| e.to_string())?;
    Ok(n)
}

fn attach<S: HostStore>(
    driver: &mut Driver,
    store: &S,
    now: Millis,
    root: Id,
) -> Result<(), String> {
    let adapter = Box::new(ScenarioAdapter::default());
    let attach = DriverInput::Attach { now, root, adapter };
    driver.handle(attach, store).map_err(|e| e.to_string())
}

/// The requests every [`ScenarioAdapter`] got since the last call.
fn take_requests(driver: &mut Driver) -> Vec<ProviderRequest> {
    let mut all = Vec::new();
    for root in driver.adapter_roots() {
        if let Some(adapter) = driver.adapter_mut(&root) {
            let adapter: &mut dyn Any = adapter;
            if let Some(a) = adapter.downcast_mut::<ScenarioAdapter>() {
                all.append(&mut a.requests);
            }
        }
    }
    all
}

/// A root's provider in a scenario: records the requests the driver routes to it and emits
/// nothing; the scenario's input lines play the provider.
#[derive(Debug, Default)]
struct ScenarioAdapter {
    requests: Vec<ProviderRequest>,
}

impl Adapter for ScenarioAdapter {
    fn open(&mut self, _now: Millis) -> AdapterOutput {
        AdapterOutput::default()
    }

    fn on_request(&mut self, _now: Millis, request: &ProviderRequest) -> AdapterOutput {
        self.requests.push(request.clone());
        AdapterOutput::default()
    }

    /// Never called: the runner feeds no native messages.
    fn on_native(&mut self, _now: Millis, _message: &Value) -> Result<AdapterOutput, AdapterError> {
        Ok(AdapterOutput::default())
    }

    fn on_timer(&mut self, _now: Millis, _id: &str) -> AdapterOutput {
        AdapterOutput::default()
    }
}
