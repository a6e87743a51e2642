//! `cargo bench -p tutti-core`: normalized events per second through `Engine::handle` for a mixed
//! workload, and the per-event cost with 10,000 active children divided by that with 10.
//!
//! Inputs are generated before timing; each measured call builds the full `Step` (rows, guards,
//! outbox indexes) exactly as a driver would receive it.

use serde_json::json;
use std::hint::black_box;
use std::time::Instant;
use tutti_core::{Engine, Input};

fn input(v: serde_json::Value) -> Input {
    serde_json::from_value(v).expect("valid input")
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Builds a tree with `children` active child turns and a mixed stream of `events` events that
/// keeps the active count constant (each terminal is paired with a new child).
fn workload(children: usize, events: usize, seed: u64) -> (Engine, Vec<Input>) {
    let mut e = Engine::new();
    let mut now = 0;
    let mut feed = |e: &mut Engine, i: Input| {
        now += 1;
        e.handle(now, &i).expect("setup input accepted");
    };
    feed(
        &mut e,
        input(
            json!({"type":"createSession","agentSessionId":"R","workspaceId":"W","provider":"bench"}),
        ),
    );
    feed(
        &mut e,
        input(json!({"type":"submit","agentSessionId":"R","turnId":"T","text":"go"})),
    );
    feed(
        &mut e,
        input(json!({"type":"rootProviderTurnStarted","agentSessionId":"R","providerTurnId":"p"})),
    );
    let mut active: Vec<usize> = Vec::new();
    let mut next_child = 0usize;
    let child = |i: usize| {
        input(
            json!({"type":"childSessionCreated","agentSessionId":format!("c{i}"),"turnId":format!("t{i}"),
            "parentAgentSessionId":"R","parentTurnId":"T","parentToolCallId":format!("k{i}"),
            "rootAgentSessionId":"R","rootTurnId":"T","title":"worker"}),
        )
    };
    for _ in 0..children {
        feed(&mut e, child(next_child));
        feed(
            &mut e,
            input(
                json!({"type":"turnStarted","agentSessionId":format!("c{next_child}"),"turnId":format!("t{next_child}")}),
            ),
        );
        active.push(next_child);
        next_child += 1;
    }
    let mut rng = Rng(seed);
    let mut out = Vec::with_capacity(events);
    let mut msg = 0u64;
    while out.len() < events {
        let slot = rng.below(active.len());
        let c = active[slot];
        let (s, t) = (format!("c{c}"), format!("t{c}"));
        // 60 % messages, 20 % tool calls, 5 % waits, 5 % starts, 10 % churn (terminal + new child).
        match rng.below(20) {
            0..=11 => {
                msg += 1;
                out.push(input(json!({"type":"messageAppended","agentSessionId":s,"turnId":t,
                    "messageId":format!("m{msg}"),"role":"assistant","text":"working on the delegated task, step by step"})));
            }
            12..=15 => out.push(input(json!({"type":"toolCallUpdated","agentSessionId":s,"turnId":t,
                "toolCallId":format!("x{}", rng.below(4)),"name":"shell","status": if rng.below(2) == 0 {"started"} else {"completed"}}))),
            16 => out.push(input(json!({"type":"turnWaiting","agentSessionId":s,"turnId":t}))),
            17 => out.push(input(json!({"type":"turnStarted","agentSessionId":s,"turnId":t}))),
            _ => {
                // Churn: one child ends, a new one starts; the active count stays the same.
                out.push(input(json!({"type":"turnTerminal","agentSessionId":s,"turnId":t,"outcome":"completed"})));
                out.push(child(next_child));
                active[slot] = next_child;
                next_child += 1;
            }
        }
    }
    out.truncate(events);
    (e, out)
}

/// One measured call (not inlined, so that a profiler can count exactly the measured work:
/// `valgrind --tool=callgrind --toggle-collect='*measured_handle*'`): the engine's decision and
/// dropping the step it returns. The step is looked at where `handle` returned it (a driver that
/// moved it elsewhere would pay for that move, which is the driver's cost, not the engine's).
#[inline(never)]
fn measured_handle(e: &mut Engine, now: i64, i: &Input) {
    let result = e.handle(now, i);
    let step = result.as_ref().expect("workload input accepted");
    black_box(step);
}

/// Runs the stream; returns nanoseconds per event.
fn measure(children: usize, events: usize) -> f64 {
    let (mut e, inputs) = workload(children, events, 0x2545_F491_4F6C_DD1D);
    let start = Instant::now();
    let mut now = 1_000_000;
    for i in &inputs {
        now += 1;
        measured_handle(&mut e, now, i);
    }
    start.elapsed().as_nanos() as f64 / inputs.len() as f64
}

fn main() {
    // `TUTTI_BENCH_EVENTS` and `TUTTI_BENCH_ONLY=<children>` narrow a run (for profilers).
    let events: usize = std::env::var("TUTTI_BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400_000);
    if let Some(children) = std::env::var("TUTTI_BENCH_ONLY")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        let ns = measure(children, events);
        println!("  {children} active children: {ns:>8.1} ns/event");
        return;
    }
    // Warm-up run (not reported).
    measure(10, events / 4);
    let mut small = f64::MAX;
    let mut large = f64::MAX;
    for _ in 0..3 {
        small = small.min(measure(10, events));
        large = large.min(measure(10_000, events));
    }
    println!("tutti-core engine benchmark: mixed workload (messages, tool calls, waits, starts, child churn)");
    println!(
        "  10 active children:     {:>8.1} ns/event  {:>10.0} events/s",
        small,
        1e9 / small
    );
    println!(
        "  10,000 active children: {:>8.1} ns/event  {:>10.0} events/s",
        large,
        1e9 / large
    );
    println!(
        "  per-event cost ratio (10,000 / 10 children): {:.3}",
        large / small
    );
}
