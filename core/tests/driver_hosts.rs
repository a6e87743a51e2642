//! What the non-daemon hosts (replays, the fuzz harness, the simulation, the adapter test rigs)
//! use of the [`Driver`]: the record of what passed between adapter and engine, calls outside the
//! `Adapter` trait, adapter unit access, and the commit loop of a host whose only I/O is a store.
//! Each test fails if its rule breaks.

use serde_json::{json, Value};
use std::any::Any;
use tutti_core::adapters::{Adapter, AdapterError, AdapterOutput};
use tutti_core::driver::{DriverInput, Output, Record, Testkit};
use tutti_core::store::{MemoryStore, Store};
use tutti_core::{Command, Driver, Input, NormalizedEvent, ProviderRequest};

/// A real adapter of a tiny protocol: a native message `{"events": [...]}` becomes those
/// events; `{"say": X}` is written back as `X` when asked through `say` (outside the trait).
struct Echo;

impl Echo {
    fn say(&mut self, what: Value) -> AdapterOutput {
        AdapterOutput {
            native: vec![what],
            ..AdapterOutput::default()
        }
    }
}

impl Adapter for Echo {
    fn open(&mut self, _: i64) -> AdapterOutput {
        self.say(json!({"hello": true}))
    }
    fn on_request(&mut self, _: i64, r: &ProviderRequest) -> AdapterOutput {
        self.say(serde_json::to_value(r).unwrap_or_default())
    }
    fn on_native(&mut self, _: i64, m: &Value) -> Result<AdapterOutput, AdapterError> {
        let events = m
            .get("events")
            .cloned()
            .ok_or_else(|| AdapterError::Malformed("no events".into()))?;
        Ok(AdapterOutput {
            events: serde_json::from_value(events)
                .map_err(|e| AdapterError::Malformed(e.to_string()))?,
            diagnostics: vec!["echoed".into()],
            ..AdapterOutput::default()
        })
    }
    fn on_timer(&mut self, _: i64, _: &str) -> AdapterOutput {
        AdapterOutput::default()
    }
    fn on_dropped(&mut self, _: i64, e: &NormalizedEvent) -> AdapterOutput {
        self.say(json!({"denied": e.kind()}))
    }
}

fn create(driver: &mut Driver, store: &MemoryStore) {
    let create = Command::CreateSession {
        agent_session_id: "root".into(),
        workspace_id: "W".into(),
        provider: "echo".into(),
        title: None,
        capabilities: None,
    };
    let _ = driver.handle(
        DriverInput::Host {
            now: 1,
            input: Input::Command(create),
            reply: Some(1),
        },
        store,
    );
}

fn transmitted(outputs: &[Output]) -> Vec<Value> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Transmit(t) => Some(t.messages.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn recording_is_off_by_default_then_keeps_adapter_outputs_decisions_and_dropped_interactions() {
    let (mut d, mut store) = (Driver::new(), MemoryStore::new());
    create(&mut d, &store);
    d.commit_pending(&mut store);
    assert!(d.take_records().is_empty(), "nothing kept while off");

    d.set_recording(true);
    let _ = d.handle(
        DriverInput::Attach {
            now: 2,
            root: "root".into(),
            adapter: Box::new(Echo),
        },
        &store,
    );
    // An interaction on a turn that does not exist: the engine rejects it, and the adapter
    // that emitted it answers it natively.
    let ask = json!({"events": [{"type":"interactionRequested","agentSessionId":"root",
        "turnId":"nope","requestId":"q1","kind":"permission","payload":{}}]});
    d.handle(
        DriverInput::Native {
            now: 3,
            root: "root",
            message: &ask,
        },
        &store,
    )
    .expect("a valid line");
    let outputs = d.commit_pending(&mut store);
    let records = d.take_records();
    assert!(
        matches!(&records[0], Record::Adapter { root, output } if &**root == "root" && output.native == vec![json!({"hello": true})]),
        "open's output first: {records:?}"
    );
    assert!(
        records.iter().any(
            |r| matches!(r, Record::Adapter { output, .. } if output.diagnostics == ["echoed"])
        ),
        "diagnostics surface in the record: {records:?}"
    );
    let decided = records
        .iter()
        .position(|r| {
            matches!(
                r,
                Record::Decided {
                    outcome: Err(_),
                    input: Input::Event(_)
                }
            )
        })
        .expect("the rejection is recorded");
    let dropped = records
        .iter()
        .position(|r| matches!(r, Record::Dropped { root, .. } if &**root == "root"))
        .expect("the dropped interaction is recorded");
    assert!(decided < dropped, "decided, then given back: {records:?}");
    assert!(transmitted(&outputs).contains(&json!({"denied": "interactionRequested"})));
    assert!(d.take_records().is_empty(), "take_records drains");
}

#[test]
fn call_adapter_carries_its_output_out_and_adapter_mut_does_not() {
    let (mut d, mut store) = (Driver::new(), MemoryStore::new());
    create(&mut d, &store);
    let _ = d.handle(
        DriverInput::Attach {
            now: 2,
            root: "root".into(),
            adapter: Box::new(Echo),
        },
        &store,
    );
    d.commit_pending(&mut store);

    d.handle(
        DriverInput::Call {
            now: 3,
            root: "root",
            call: Box::new(|a, _| {
                let a: &mut dyn Any = a;
                a.downcast_mut::<Echo>()
                    .map(|e| e.say(json!("via driver")))
                    .unwrap_or_default()
            }),
        },
        &store,
    )
    .expect("a live adapter");
    assert_eq!(
        transmitted(&d.commit_pending(&mut store)),
        [json!("via driver")]
    );

    let a: &mut dyn Any = d.adapter_mut("root").expect("a live adapter");
    let out = a
        .downcast_mut::<Echo>()
        .expect("an Echo")
        .say(json!("unit"));
    assert_eq!(out.native, [json!("unit")]);
    assert!(
        d.commit_pending(&mut store).is_empty(),
        "a unit call's output stays with the caller"
    );
    assert!(d
        .handle(
            DriverInput::Call {
                now: 4,
                root: "other",
                call: Box::new(|_, _| AdapterOutput::default())
            },
            &store
        )
        .is_err());
}

#[test]
fn commit_pending_commits_each_batch_before_what_it_caused_is_released() {
    let (mut d, mut store) = (Driver::new(), MemoryStore::new());
    create(&mut d, &store);
    // Nothing is polled before the commit: the first output would be the batch itself
    // (`Output::Persist`), and the reply waits behind it.
    assert!(d.is_busy(), "the reply waits for the commit");
    assert!(store.session("root").expect("a read").is_none());
    let outputs = d.commit_pending(&mut store);
    assert!(
        store.session("root").expect("a read").is_some(),
        "committed"
    );
    assert!(
        outputs.iter().any(|o| matches!(
            o,
            Output::Reply {
                to: 1,
                result: Ok(_)
            }
        )),
        "released after the commit"
    );
    assert!(!d.is_busy(), "nothing left");
}
