//! Property: random trees and random causal interleavings of their facts reach the same final
//! state, and the invariant checker holds after every step. proptest prints the failing case
//! (tree shape and both interleaving seeds); `PROPTEST_CASES` raises the count.

mod common;
use common::H;
use proptest::prelude::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use tutti_core::store::Store;

/// A generated tree: for each child, the index of its parent (0 = root, i = child i) and its
/// outcome; plus the root provider outcome.
#[derive(Debug, Clone)]
struct Shape {
    parents: Vec<usize>,
    outcomes: Vec<&'static str>,
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
                prop_oneof![Just("completed"), Just("failed")],
            )
        })
        .prop_map(|(parents, outcomes, root_outcome)| Shape {
            parents,
            outcomes,
            root_outcome,
        })
}

/// One fact with its causal predecessors (indexes into the fact list).
struct Fact {
    input: Value,
    after: Vec<usize>,
}

fn facts(s: &Shape) -> Vec<Fact> {
    let mut f = vec![Fact {
        input: json!({"type":"rootProviderTurnStarted","agentSessionId":"R","providerTurnId":"p1"}),
        after: vec![],
    }];
    let mut created = vec![0usize]; // fact index that created session i (0 = root start)
    let mut creations = Vec::new();
    for (i, &p) in s.parents.iter().enumerate() {
        let c = format!("C{}", i + 1);
        let ct = format!("CT{}", i + 1);
        let (ps, pt) = if p == 0 {
            ("R".to_string(), "T".to_string())
        } else {
            (format!("C{p}"), format!("CT{p}"))
        };
        let idx = f.len();
        f.push(Fact {
            input: json!({"type":"childSessionCreated","agentSessionId":c,"turnId":ct,
                "parentAgentSessionId":ps,"parentTurnId":pt,"parentToolCallId":format!("call{}", i + 1),
                "rootAgentSessionId":"R","rootTurnId":"T"}),
            after: vec![created[p]],
        });
        created.push(idx);
        creations.push(idx);
        let started = f.len();
        f.push(Fact {
            input: json!({"type":"turnStarted","agentSessionId":c,"turnId":ct}),
            after: vec![idx],
        });
        let msg = f.len();
        f.push(Fact {
            input: json!({"type":"messageAppended","agentSessionId":c,"turnId":ct,
                "messageId":format!("m{}", i + 1),"role":"assistant","text":"progress"}),
            after: vec![started],
        });
        f.push(Fact {
            input: json!({"type":"turnTerminal","agentSessionId":c,"turnId":ct,"outcome":s.outcomes[i]}),
            after: vec![msg],
        });
    }
    // "Creating a child session ... must be persisted before a later root provider terminal."
    let mut after = creations;
    after.push(0);
    f.push(Fact {
        input: json!({"type":"rootProviderTurnCompleted","agentSessionId":"R","providerTurnId":"p1","outcome":s.root_outcome}),
        after,
    });
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
                s.kind,
                s.parent_agent_session_id,
                s.parent_turn_id,
                s.root_turn_id,
                s.active_turn_id,
                h.store.messages(&s.id, None, 1000).unwrap().len()
            ]),
        );
    }
    for t in &snap.turns {
        m.insert(
            format!("turn {}", t.id),
            json!([
                t.phase,
                t.outcome,
                t.error,
                t.root_provider_turn
                    .as_ref()
                    .map(|r| (r.phase, r.retained_outcome))
            ]),
        );
    }
    m
}

fn run(s: &Shape, seed: u64) -> H {
    let f = facts(s);
    let mut h = H::new();
    h.root("R");
    h.submit("R", "T");
    for i in interleave(&f, seed) {
        h.feed(f[i].input.clone());
        let v = h.engine.check_invariants();
        assert!(
            v.is_empty(),
            "seed {seed}: invariants broken after {}: {v:?}",
            f[i].input
        );
    }
    h.check();
    h
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn same_facts_in_any_causal_order_reach_the_same_final_state(
        s in shape(), seed_a in any::<u64>(), seed_b in any::<u64>()
    ) {
        let a = run(&s, seed_a);
        let b = run(&s, seed_b);
        prop_assert_eq!(meaning(&a), meaning(&b), "seeds {} and {}", seed_a, seed_b);
        // And the final state is the spec's: every child settled, the root settled with the
        // root provider's outcome (a failed child never fails the root).
        let t = a.store.turn("T").unwrap().unwrap();
        prop_assert_eq!(t.outcome.map(|o| format!("{o:?}").to_lowercase()), Some(s.root_outcome.to_string()));
        prop_assert_eq!(a.engine.active_child_turns("R", "T"), 0);
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
        let mut children_at_cancel = 0;
        for (pos, &i) in order.iter().enumerate() {
            if pos == cut {
                let r = h.try_feed(json!({"type":"cancelTurn","operationId":"op","agentSessionId":"R","turnId":"T"}));
                canceled = r.is_ok();
                children_at_cancel = h.store.session_detail("R").unwrap().unwrap().child_sessions.len();
            }
            let _ = h.try_feed(f[i].input.clone());
            let v = h.engine.check_invariants();
            prop_assert!(v.is_empty(), "seed {}: {:?}", seed, v);
        }
        if canceled {
            let op = h.store.cancel_operation("op").unwrap().unwrap();
            let acked: Vec<Value> = op.targets.iter().enumerate()
                .filter(|(i, _)| acks >> (i % 64) & 1 == 1)
                .map(|(_, t)| serde_json::to_value(t).unwrap())
                .collect();
            h.feed(json!({"type":"cancelResult","operationId":"op","acked":acked}));
            let t = h.store.turn("T").unwrap().unwrap();
            prop_assert_eq!(t.outcome, Some(tutti_core::model::Outcome::Canceled));
            prop_assert_eq!(
                h.store.session_detail("R").unwrap().unwrap().child_sessions.len(),
                children_at_cancel,
                "no child after the cancel was prepared"
            );
        } else {
            prop_assert!(h.store.turn("T").unwrap().unwrap().outcome.is_some());
        }
        prop_assert_eq!(h.engine.active_child_turns("R", "T"), 0);
        h.check();
    }
}
