//! Property: random trees and random causal interleavings of their facts reach the same final
//! state, and the invariant checker holds after every step. proptest prints the failing case
//! (tree shape and both interleaving seeds); `PROPTEST_CASES` raises the count.
//!
//! The generated facts cover: nested spawns (a grandchild may be created after the root
//! provider's terminal, while its parent still runs), children waiting for input and asking for
//! an interaction that nobody answers (superseded when the turn settles), guidance into a settled
//! child (a second turn of the same child, started while the root provider still runs), and
//! duplicate deliveries of facts a provider may repeat (creations, messages, terminals, the root
//! provider's start and terminal, interaction requests), each of which must change nothing.

mod common;
use common::H;
use proptest::prelude::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use tutti_core::model::Outcome;
use tutti_core::store::Store;

/// A generated tree: for each child, the index of its parent (0 = root, i = child i), its
/// outcome and what else it does; plus the root provider outcome.
#[derive(Debug, Clone)]
struct Shape {
    parents: Vec<usize>,
    outcomes: Vec<&'static str>,
    /// Per child: waits for input and requests an interaction during its first turn.
    waits: Vec<bool>,
    /// Per child: gets guidance (a second turn) after its first turn settled.
    guided: Vec<bool>,
    /// Per fact (cycled): deliver it twice.
    dup_mask: u64,
    root_outcome: &'static str,
}

fn shape() -> impl Strategy<Value = Shape> {
    (1usize..10)
        .prop_flat_map(|n| {
            let parents: Vec<BoxedStrategy<usize>> = (0..n).map(|i| (0..=i).boxed()).collect();
            (
                parents,
                proptest::collection::vec(
                    prop_oneof![Just("completed"), Just("failed"), Just("interrupted")],
                    n,
                ),
                proptest::collection::vec(any::<bool>(), n),
                proptest::collection::vec(prop::bool::weighted(0.3), n),
                any::<u64>(),
                prop_oneof![Just("completed"), Just("failed")],
            )
        })
        .prop_map(
            |(parents, outcomes, waits, guided, dup_mask, root_outcome)| Shape {
                parents,
                outcomes,
                waits,
                guided,
                dup_mask,
                root_outcome,
            },
        )
}

/// One fact with its causal predecessors (indexes into the fact list).
struct Fact {
    input: Value,
    after: Vec<usize>,
    /// A second delivery of an earlier fact (it must change nothing).
    duplicate: bool,
}

fn fact(f: &mut Vec<Fact>, input: Value, after: Vec<usize>) -> usize {
    f.push(Fact {
        input,
        after,
        duplicate: false,
    });
    f.len() - 1
}

fn facts(s: &Shape) -> Vec<Fact> {
    let mut f = Vec::new();
    let root_start = fact(
        &mut f,
        json!({"type":"rootProviderTurnStarted","agentSessionId":"R","providerTurnId":"p1"}),
        vec![],
    );
    let mut created = vec![root_start]; // fact index that created session i (0 = root start)
    let mut first_terminal = vec![usize::MAX]; // fact index of child i's first terminal
    let mut direct_creations = Vec::new();
    let mut guidance_starts = Vec::new();
    for (i, &p) in s.parents.iter().enumerate() {
        let c = format!("C{}", i + 1);
        let ct = format!("CT{}", i + 1);
        let (ps, pt) = if p == 0 {
            ("R".to_string(), "T".to_string())
        } else {
            (format!("C{p}"), format!("CT{p}"))
        };
        let idx = fact(
            &mut f,
            json!({"type":"childSessionCreated","agentSessionId":c,"turnId":ct,
                "parentAgentSessionId":ps,"parentTurnId":pt,"parentToolCallId":format!("call{}", i + 1),
                "rootAgentSessionId":"R","rootTurnId":"T"}),
            vec![created[p]],
        );
        if p == 0 {
            direct_creations.push(idx);
        } else {
            // A nested child is spawned by its running parent turn: before the parent's terminal
            // (which comes later in the list, see below), but possibly after the root provider's.
            f[first_terminal[p]].after.push(idx);
        }
        created.push(idx);
        let mut last = fact(
            &mut f,
            json!({"type":"turnStarted","agentSessionId":c,"turnId":ct}),
            vec![idx],
        );
        if s.waits[i] {
            last = fact(
                &mut f,
                json!({"type":"turnWaiting","agentSessionId":c,"turnId":ct}),
                vec![last],
            );
            last = fact(
                &mut f,
                json!({"type":"interactionRequested","agentSessionId":c,"turnId":ct,
                    "requestId":format!("q{}", i + 1),"kind":"approval"}),
                vec![last],
            );
            last = fact(
                &mut f,
                json!({"type":"turnStarted","agentSessionId":c,"turnId":ct}),
                vec![last],
            );
        }
        let msg = fact(
            &mut f,
            json!({"type":"messageAppended","agentSessionId":c,"turnId":ct,
                "messageId":format!("m{}", i + 1),"role":"assistant","text":"progress"}),
            vec![last],
        );
        let term = fact(
            &mut f,
            json!({"type":"turnTerminal","agentSessionId":c,"turnId":ct,"outcome":s.outcomes[i]}),
            vec![msg],
        );
        first_terminal.push(term);
        if s.guided[i] {
            // Guidance from the root agent: a second turn of the same child, while the root
            // provider turn still runs.
            let gt = format!("CT{}g", i + 1);
            let start = fact(
                &mut f,
                json!({"type":"turnStarted","agentSessionId":c,"turnId":gt,"providerTurnId":format!("g{}", i + 1)}),
                vec![term],
            );
            guidance_starts.push(start);
            fact(
                &mut f,
                json!({"type":"turnTerminal","agentSessionId":c,"turnId":gt,"outcome":"completed"}),
                vec![start],
            );
        }
    }
    // "Creating a child session ... must be persisted before a later root provider terminal":
    // the root provider's own spawns (direct children) and its guidance come before its terminal.
    let mut after = direct_creations;
    after.extend(guidance_starts);
    after.push(root_start);
    fact(
        &mut f,
        json!({"type":"rootProviderTurnCompleted","agentSessionId":"R","providerTurnId":"p1","outcome":s.root_outcome}),
        after,
    );
    // Duplicate deliveries of the facts a provider may repeat, each after its original.
    let originals = f.len();
    for i in 0..originals {
        let kind = f[i].input["type"].as_str().unwrap_or_default();
        let repeatable = matches!(
            kind,
            "childSessionCreated"
                | "messageAppended"
                | "turnTerminal"
                | "rootProviderTurnStarted"
                | "rootProviderTurnCompleted"
                | "interactionRequested"
        );
        if repeatable && s.dup_mask >> (i % 64) & 1 == 1 {
            let input = f[i].input.clone();
            f.push(Fact {
                input,
                after: vec![i],
                duplicate: true,
            });
        }
    }
    f
}

/// A deterministic shuffle of the facts that respects causality (splitmix64 from `seed`).
fn interleave(f: &[Fact], mut seed: u64) -> Vec<usize> {
    let mut next = || {
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut done = vec![false; f.len()];
    let mut order = Vec::new();
    while order.len() < f.len() {
        let ready: Vec<usize> = (0..f.len())
            .filter(|&i| !done[i] && f[i].after.iter().all(|&a| done[a]))
            .collect();
        let pick = ready[(next() % ready.len() as u64) as usize];
        done[pick] = true;
        order.push(pick);
    }
    order
}

/// The order-independent meaning of the final state.
fn meaning(h: &H) -> BTreeMap<String, Value> {
    let snap = h.store.load_tree("R").unwrap().unwrap();
    let mut m = BTreeMap::new();
    for s in &snap.sessions {
        m.insert(
            format!("session {}", s.id),
            json!([
                s.kind(),
                s.parent_agent_session_id(),
                s.parent_turn_id(),
                s.root_turn_id(),
                s.active_turn_id,
                s.last_turn_id,
                h.store.messages(&s.id, None, 1000).unwrap().len()
            ]),
        );
    }
    for t in &snap.turns {
        m.insert(
            format!("turn {}", t.id),
            json!([
                t.phase(),
                t.outcome(),
                t.error(),
                t.root_provider_turn()
                    .as_ref()
                    .map(|r| (r.phase(), r.retained_outcome()))
            ]),
        );
    }
    for i in &snap.interactions {
        m.insert(
            format!("interaction {} {}", i.turn_id, i.request_id),
            json!(i.status),
        );
    }
    m
}

/// Feeds a duplicate delivery and checks that it changed nothing: rejected, or accepted with
/// nothing to persist, publish or run, and the engine's state as before.
fn feed_duplicate(h: &mut H, input: &Value, seed: u64) -> Result<(), TestCaseError> {
    let before = h.engine_state();
    let outbox = h.store.outbox().len();
    if let Ok(step) = h.try_feed(input.clone()) {
        prop_assert!(
            step.persist.is_empty() && step.provider.is_empty() && step.timers.is_empty(),
            "seed {}: a duplicate {} did something: {:?}",
            seed,
            input,
            step
        );
    }
    prop_assert!(
        h.engine_state() == before,
        "seed {}: a duplicate {} changed the engine",
        seed,
        input
    );
    prop_assert_eq!(h.store.outbox().len(), outbox);
    Ok(())
}

fn run(s: &Shape, seed: u64) -> Result<H, TestCaseError> {
    let f = facts(s);
    let mut h = H::new();
    h.root("R");
    h.submit("R", "T");
    for i in interleave(&f, seed) {
        if f[i].duplicate {
            feed_duplicate(&mut h, &f[i].input, seed)?;
        } else {
            let label = f[i].input.to_string();
            let r = h.try_feed(f[i].input.clone());
            prop_assert!(
                r.is_ok(),
                "seed {}: rejected {}: {:?}",
                seed,
                label,
                r.err()
            );
        }
        let v = h.engine.check_invariants();
        prop_assert!(
            v.is_empty(),
            "seed {}: invariants broken after {}: {:?}",
            seed,
            f[i].input,
            v
        );
    }
    h.check();
    Ok(h)
}

fn outcome_name(o: Option<Outcome>) -> Option<String> {
    o.map(|o| format!("{o:?}").to_lowercase())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn same_facts_in_any_causal_order_reach_the_same_final_state(
        s in shape(), seed_a in any::<u64>(), seed_b in any::<u64>()
    ) {
        let a = run(&s, seed_a)?;
        let b = run(&s, seed_b)?;
        prop_assert_eq!(meaning(&a), meaning(&b), "seeds {} and {}", seed_a, seed_b);
        // And the final state is the spec's: every child settled with its own outcome, the
        // root settled with the root provider's outcome (a failed child never fails the root),
        // every unanswered interaction superseded.
        let t = a.store.turn("T").unwrap().unwrap();
        prop_assert_eq!(outcome_name(t.outcome()), Some(s.root_outcome.to_string()));
        prop_assert_eq!(a.engine.active_child_turns("R", "T"), 0);
        for i in 0..s.parents.len() {
            let ct = a.store.turn(&format!("CT{}", i + 1)).unwrap().unwrap();
            prop_assert_eq!(outcome_name(ct.outcome()), Some(s.outcomes[i].to_string()));
            let c = a.session(&format!("C{}", i + 1)).unwrap();
            let last = if s.guided[i] { format!("CT{}g", i + 1) } else { format!("CT{}", i + 1) };
            prop_assert_eq!(&c["lastTurnId"], &json!(last));
            if s.guided[i] {
                let g = a.store.turn(&last).unwrap().unwrap();
                prop_assert_eq!(outcome_name(g.outcome()), Some("completed".to_string()));
            }
            if s.waits[i] {
                let q = a.store.interaction(&format!("CT{}", i + 1), &format!("q{}", i + 1)).unwrap().unwrap();
                prop_assert_eq!(q.status, tutti_core::model::InteractionStatus::Superseded);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A root cancel at a random point of a random interleaving, late facts after it, and a
    /// random acknowledged subset: invariants hold after every step, the root ends canceled (if
    /// it was still active), nothing stays active, and no child appears after the cancel.
    #[test]
    fn cancel_at_any_point_never_resurrects(
        s in shape(), seed in any::<u64>(), cut in any::<prop::sample::Index>(), acks in any::<u64>()
    ) {
        let f = facts(&s);
        let order = interleave(&f, seed);
        let cut = cut.index(order.len());
        let mut h = H::new();
        h.root("R");
        h.submit("R", "T");
        let mut canceled = false;
        let mut at_cancel: Option<BTreeMap<String, Value>> = None;
        for (pos, &i) in order.iter().enumerate() {
            if pos == cut {
                let r = h.try_feed(json!({"type":"cancelTurn","operationId":"op","agentSessionId":"R","turnId":"T"}));
                canceled = r.is_ok();
                at_cancel = Some(meaning(&h));
            }
            let input = &f[i].input;
            if f[i].duplicate {
                feed_duplicate(&mut h, input, seed)?;
            } else {
                let r = h.try_feed(input.clone());
                if canceled && input["type"] == "childSessionCreated" {
                    let known = at_cancel.as_ref().is_some_and(|m| {
                        m.contains_key(&format!("session {}", input["agentSessionId"].as_str().unwrap_or_default()))
                    });
                    // "Child creation closes for that root turn": a new child is refused.
                    prop_assert!(known || r.is_err(), "seed {}: a child was created after the cancel: {}", seed, input);
                }
                if !canceled {
                    // Before any cancel the facts are the same as in the first property.
                    prop_assert!(at_cancel.is_some() || r.is_ok(), "seed {}: rejected {}: {:?}", seed, input, r.err());
                }
            }
            let v = h.engine.check_invariants();
            prop_assert!(v.is_empty(), "seed {}: {:?}", seed, v);
        }
        if canceled {
            let at_cancel = at_cancel.unwrap_or_default();
            let op = h.store.cancel_operation("op").unwrap().unwrap();
            // The targets stay settling until the provider answers, whatever arrived meanwhile.
            for t in &op.targets {
                prop_assert_eq!(h.store.turn(&t.turn_id).unwrap().unwrap().phase(), tutti_core::model::Phase::Settling);
            }
            let acked: Vec<_> = op.targets.iter().enumerate()
                .filter(|(i, _)| acks >> (i % 64) & 1 == 1)
                .map(|(_, t)| t.clone())
                .collect();
            h.feed(json!({"type":"cancelResult","operationId":"op","acked":acked}));
            let t = h.store.turn("T").unwrap().unwrap();
            prop_assert_eq!(t.outcome(), Some(Outcome::Canceled));
            // Each child target: canceled if the provider confirmed it, interrupted otherwise.
            for target in op.targets.iter().filter(|t| &*t.turn_id != "T") {
                let ct = h.store.turn(&target.turn_id).unwrap().unwrap();
                let want = if acked.contains(target) { Outcome::Canceled } else { Outcome::Interrupted };
                prop_assert_eq!(ct.outcome(), Some(want), "seed {}: target {}", seed, target.turn_id);
            }
            // Nothing resurrects: no session, turn or interaction appeared after the cancel was
            // prepared, and every turn that had settled before it kept its outcome.
            let now = meaning(&h);
            for k in now.keys() {
                prop_assert!(at_cancel.contains_key(k), "seed {}: {} appeared after the cancel", seed, k);
            }
            for (k, v) in &at_cancel {
                if k.starts_with("turn ") && v[0] == json!("settled") {
                    prop_assert_eq!(now.get(k), Some(v), "seed {}: {} changed after the cancel", seed, k);
                }
            }
            prop_assert_eq!(h.store.session_detail("R").unwrap().unwrap().child_sessions.len() + 1,
                now.keys().filter(|k| k.starts_with("session ")).count());
        } else {
            prop_assert!(h.store.turn("T").unwrap().unwrap().outcome().is_some());
        }
        prop_assert_eq!(h.engine.active_child_turns("R", "T"), 0);
        let snap = h.store.load_tree("R").unwrap().unwrap();
        for t in &snap.turns {
            prop_assert!(t.outcome().is_some(), "seed {}: turn {} still active", seed, t.id);
        }
        h.check();
    }
}
