//! `tuttid serve --db postgres://...` (issue 21, daemon side): real `tuttid` processes on a real
//! PostgreSQL server (started in a temporary directory by [`tutti_tests::postgres::Server`]),
//! driving the real demo ACP agent.

use serde_json::Value;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::sync::mpsc;
use std::time::Duration;
use tutti_tests::daemon::{providers_of, request, seqs, signal, tree, turn_of, TestDaemon};
use tutti_tests::postgres::Server;

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const WS: &str = "w1";

/// Step 1: the daemon picks PostgreSQL by URL; a settled tree reads back the same after a
/// restart, the live one settles interrupted (restart recovery as with SQLite), the event
/// stream is gap-free and resumes by `Last-Event-ID` across the restart.
#[test]
fn postgres_daemon_survives_a_restart_with_the_same_tree_and_stream() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("database");
    let mut d = TestDaemon::start_with_db(EXE, Some(&url), None, &[("TUTTI_DEMO_SPEED", "2")]);
    // Nothing was written to a SQLite file: the rows are in PostgreSQL.
    let done = d.create(WS, "demo");
    d.submit(WS, &done, "children=2 permission=0 fail=0 late=0");
    let settled = d.wait_for(WS, &done, 60, "tree settled", |v| {
        turn_of(v, &done).is_some_and(|t| t["outcome"] == "completed")
            && v["childSessions"].as_array().is_some_and(|c| c.len() == 2)
            && v["session"].get("activeTurnId").is_none()
    });
    let live = d.create(WS, "demo");
    d.submit(WS, &live, "children=2 hang=1,2 permission=0 fail=0 late=0");
    d.wait_for(WS, &live, 60, "children running", |v| {
        v["childSessions"].as_array().is_some_and(|a| a.len() == 2)
    });
    assert!(
        !d.db().exists(),
        "a PostgreSQL daemon writes no SQLite file"
    );
    let before = d.events(Some(0), None, usize::MAX, 1);
    assert!(before.len() > 10, "rows were published: {}", before.len());

    d.restart();

    assert_eq!(
        tree(d.detail(WS, &done)),
        tree(settled),
        "the settled tree reads back the same"
    );
    let end = d.detail(WS, &live);
    assert!(
        end["session"].get("activeTurnId").is_none(),
        "no turn stays active"
    );
    assert_eq!(
        turn_of(&end, &live).expect("root turn")["outcome"],
        "interrupted"
    );
    for c in end["childSessions"].as_array().expect("children") {
        let ct = turn_of(&end, c["id"].as_str().expect("id")).expect("child turn");
        assert_eq!(ct["outcome"], "interrupted", "{ct}");
    }
    let after = d.events(Some(0), None, usize::MAX, 1);
    let all = seqs(&after);
    assert_eq!(
        all,
        (1..=all.len() as u64).collect::<Vec<_>>(),
        "gap-free from 1"
    );
    let kept: BTreeSet<u64> = all.iter().copied().collect();
    assert!(
        seqs(&before).iter().all(|s| kept.contains(s)),
        "no row lost"
    );
    assert!(
        all.len() > before.len(),
        "the recovery published the settled turns"
    );
    // Resume by Last-Event-ID: the rows after the position, each once, in order.
    let from = before.len() as u64;
    let rest = d.events(None, Some(from), all.len() - before.len(), 10);
    assert_eq!(seqs(&rest), all[before.len()..].to_vec());
    assert_eq!(
        rest.as_slice(),
        &after[before.len()..],
        "same rows as a full read"
    );
    // The daemon works after the restart.
    let (reply, _) = d.submit(WS, &live, "children=1 permission=0 fail=0 late=0");
    assert_eq!(reply, "started");
    d.wait_for(WS, &live, 60, "new turn settled", |v| {
        turn_of(v, &live).is_some_and(|t| t["outcome"] == "completed")
    });
}

/// A real server and two daemons on one database of it (demo provider at `speed`, the
/// daemons' `config`): the server, the database URL, A and B.
fn two_daemons(speed: &str, config: Option<&str>) -> (Server, String, TestDaemon, TestDaemon) {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("database");
    let env = [("TUTTI_DEMO_SPEED", speed)];
    let a = TestDaemon::start_with_db(EXE, Some(&url), config, &env);
    let b = TestDaemon::start_with_db(EXE, Some(&url), config, &env);
    (server, url, a, b)
}

/// Reads `GET /v1/events?after=0` of `d` on a thread; sends each event's JSON.
fn follow(d: &TestDaemon) -> mpsc::Receiver<Value> {
    let (tx, rx) = mpsc::channel();
    let url = format!("http://{}/v1/events?after=0", d.addr);
    let auth = format!("Bearer {}", d.token);
    std::thread::spawn(move || {
        let resp = ureq::get(&url)
            .set("authorization", &auth)
            .timeout(Duration::from_secs(300))
            .call()
            .expect("event stream");
        for line in BufReader::new(resp.into_reader()).lines() {
            let Ok(line) = line else { return };
            if let Some(data) = line.strip_prefix("data:") {
                if let Ok(v) = serde_json::from_str::<Value>(data.trim()) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
            }
        }
    });
    rx
}

/// The first `n` rows of a stream from [`follow`]; fails if the stream stops short (waiting up
/// to a minute for each row).
fn rows_of(rx: &mpsc::Receiver<Value>, n: usize, name: &str) -> Vec<Value> {
    let mut got = Vec::new();
    while got.len() < n {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(v) => got.push(v),
            Err(_) => panic!(
                "{name}'s stream stopped after {} of {n} rows: {:?}",
                got.len(),
                seqs(&got)
            ),
        }
    }
    got
}

/// Step 2, issue 21: "`GET /v1/events` on any daemon streams rows committed by any daemon, in
/// sequence order". Two daemons on one database: a tree created and driven on A is readable on
/// B, and an event stream opened on B before A commits anything (so only the cross-daemon wake
/// can bring the rows) yields each of A's rows once, in order, the same as A's own stream.
#[test]
fn a_follower_on_another_daemon_sees_each_row_once_in_order() {
    let (_server, _url, a, b) = two_daemons("4", None);
    let on_b = follow(&b);
    let id = a.create(WS, "demo");
    a.submit(WS, &id, "children=2 permission=0 fail=0 late=0");
    let settled = a.wait_for(WS, &id, 60, "tree settled", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"] == "completed")
            && v["childSessions"].as_array().is_some_and(|c| c.len() == 2)
            && v["session"].get("activeTurnId").is_none()
    });
    assert_eq!(tree(b.detail(WS, &id)), tree(settled), "B reads A's tree");
    let on_a = a.events(Some(0), None, usize::MAX, 1);
    assert!(on_a.len() > 10, "rows were published: {}", on_a.len());
    let got = rows_of(&on_b, on_a.len(), "B");
    assert_eq!(seqs(&got), seqs(&on_a), "each row once, in order");
    assert_eq!(got, on_a, "the same rows on both daemons");
}

/// Issue 21: "`GET /v1/events` on any daemon streams rows committed by any daemon, in sequence
/// order", with both daemons committing at once: trees driven on A and on B together, so that
/// each daemon's own rows (live) and the other's (woken by `LISTEN/NOTIFY`, read from the
/// store) interleave; a stream on either yields every row of the database once, in order.
/// (Shown to fail when a daemon's listener drops every notification.)
#[test]
fn a_follower_sees_its_own_daemons_rows_and_anothers_interleaved_once_in_order() {
    let (_server, _url, a, b) = two_daemons("4", None);
    let on_b = follow(&b);
    let on_a = follow(&a);
    let ids: Vec<(&TestDaemon, String)> = (0..4)
        .map(|i| {
            let d = if i % 2 == 0 { &a } else { &b };
            (d, d.create(WS, "demo"))
        })
        .collect();
    for (d, id) in &ids {
        d.submit(WS, id, "children=2 permission=0 fail=0 late=0");
    }
    for (d, id) in &ids {
        d.wait_for(WS, id, 60, "tree settled", |v| {
            turn_of(v, id).is_some_and(|t| t["outcome"] == "completed")
                && v["session"].get("activeTurnId").is_none()
        });
    }
    let all = a.events(Some(0), None, usize::MAX, 1);
    assert!(all.len() > 40, "rows were published: {}", all.len());
    let (from_a, from_b) = {
        let owner = |v: &Value| v["rootAgentSessionId"].as_str().map(str::to_string);
        let on = |d: &TestDaemon| {
            all.iter()
                .filter(|v| {
                    ids.iter()
                        .any(|(o, id)| std::ptr::eq(*o, d) && owner(v).as_deref() == Some(id))
                })
                .count()
        };
        (on(&a), on(&b))
    };
    assert!(
        from_a > 10 && from_b > 10,
        "both daemons committed rows: {from_a} and {from_b}"
    );
    for (name, rx) in [("A", &on_a), ("B", &on_b)] {
        let got = rows_of(rx, all.len(), name);
        assert_eq!(seqs(&got), seqs(&all), "{name}: each row once, in order");
        assert_eq!(got, all, "{name}: the rows the database holds");
    }
}

/// Issue 21, tree ownership: "Exactly one daemon runs the provider process of a root tree at a
/// time: a lease row per live root (owner, epoch, expiry), claimed before the provider starts
/// and renewed while it runs", and failover: a daemon that starts does not settle a live tree
/// whose lease another running daemon holds. A drives a hanging tree; its lease names A's
/// address; B starts on the same database and leaves the tree's turns active (before leases, B
/// settled every live tree it found, interrupting A's turn); a command for the tree forwarded to
/// B (by some other daemon) is refused with 409 `owned_elsewhere` naming A's address, and
/// changes nothing (one hop at most).
#[test]
fn a_starting_daemon_leaves_a_tree_owned_by_another_running_daemon_alone() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("database");
    let env = [("TUTTI_DEMO_SPEED", "2")];
    let a = TestDaemon::start_with_db(EXE, Some(&url), None, &env);
    let live = a.create(WS, "demo");
    a.submit(WS, &live, "children=2 hang=1,2 permission=0 fail=0 late=0");
    a.wait_for(WS, &live, 60, "children running", |v| {
        v["childSessions"].as_array().is_some_and(|c| c.len() == 2)
    });
    let store = tutti_postgres::PostgresStore::connect(&url).expect("connect");
    let lease = store
        .lease(&live)
        .expect("lease read")
        .expect("a lease row");
    assert_eq!(
        lease.owner_address, a.addr,
        "the lease names the owner's address"
    );
    assert!(lease.epoch >= 1);

    let b = TestDaemon::start_with_db(EXE, Some(&url), None, &env);
    let seen = b.detail(WS, &live);
    assert!(
        seen["session"].get("activeTurnId").is_some(),
        "B did not settle A's live tree: {seen}"
    );
    let root_turn = turn_of(&seen, &live).expect("root turn");
    assert!(
        root_turn.get("outcome").is_none_or(Value::is_null),
        "{root_turn}"
    );
    let after = store
        .lease(&live)
        .expect("lease read")
        .expect("a lease row");
    assert_eq!(after.owner, lease.owner, "B took no lease");
    assert_eq!(after.epoch, lease.epoch);
    assert_eq!(
        tree(a.detail(WS, &live)),
        tree(seen.clone()),
        "A reads the same live tree"
    );
    // A command for the tree that reaches B as a forwarded request (so B may not forward it
    // again) is refused, naming the owner, and changes nothing: no second hop, no loop.
    let secret: String = postgres::Client::connect(&url, postgres::NoTls)
        .expect("connect")
        .query_one("SELECT secret FROM cluster_secret", &[])
        .expect("cluster secret")
        .get(0);
    let (status, _, body) = request(
        &b.addr,
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{live}/submit"),
        &[
            ("x-tutti-forwarded-by", "127.0.0.1:9"),
            ("x-tutti-cluster-secret", &secret),
        ],
        Some(serde_json::json!({ "text": "children=0 permission=0 fail=0 late=0" })),
    );
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "owned_elsewhere", "{body}");
    let message = body["error"]["message"].as_str().expect("message");
    assert!(message.contains(&a.addr), "the owner is named: {message}");
    assert_eq!(tree(b.detail(WS, &live)), tree(seen), "nothing changed");
}

/// Issue 21, failover: a daemon killed (-9) mid-run stops renewing its lease; once it expired
/// the survivor claims the tree and settles it as a restart does (every active turn
/// interrupted, no root stays active), every acknowledged row is there, gap-free, and the
/// survivor then drives the tree (its next turn completes). "Every SSE follower (on any daemon)
/// sees each row once, in order": a follower on the survivor B, connected before the kill and
/// kept open through the takeover, and one on A, which loses its connection with A and resumes
/// on B with `Last-Event-ID`, each see every row exactly once, in seq order, the takeover's
/// settle rows included (duplicates would show: nothing is deduplicated). The time from the
/// kill to the settled takeover is printed, not asserted (no timed assertions; `cargo bench -p
/// tutti-postgres` measures it).
#[test]
fn a_survivor_takes_over_the_tree_of_a_killed_daemon_after_its_lease_expired() {
    let (_server, _url, mut a, b) = two_daemons("2", Some("lease_secs = 1\n"));
    let on_b = follow(&b);
    let on_a = follow(&a);
    let live = a.create(WS, "demo");
    a.submit(WS, &live, "children=2 hang=1,2 permission=0 fail=0 late=0");
    a.wait_for(WS, &live, 60, "children running", |v| {
        v["childSessions"].as_array().is_some_and(|c| c.len() == 2)
    });
    let acknowledged = seqs(&a.events(Some(0), None, usize::MAX, 1));
    let killed = std::time::Instant::now();
    a.kill9();

    let end = b.wait_for(WS, &live, 60, "taken over and settled", |v| {
        v["session"].get("activeTurnId").is_none()
    });
    println!(
        "takeover: settled on the survivor {:?} after the kill (lease 1 s, renewal tick 333 ms)",
        killed.elapsed()
    );
    assert_eq!(
        turn_of(&end, &live).expect("root turn")["outcome"],
        "interrupted",
        "{end}"
    );
    for c in end["childSessions"].as_array().expect("children") {
        let ct = turn_of(&end, c["id"].as_str().expect("id")).expect("child turn");
        assert_eq!(ct["outcome"], "interrupted", "{ct}");
    }
    let settled_rows = seqs(&b.events(Some(0), None, usize::MAX, 1));
    assert_eq!(
        settled_rows,
        (1..=settled_rows.len() as u64).collect::<Vec<_>>(),
        "gap-free from 1"
    );
    assert!(
        acknowledged.iter().all(|s| settled_rows.contains(s)),
        "every acknowledged row is there"
    );
    assert!(
        settled_rows.len() > acknowledged.len(),
        "the takeover published its settle rows"
    );
    let (reply, _) = b.submit(WS, &live, "children=1 permission=0 fail=0 late=0");
    assert_eq!(reply, "started");
    b.wait_for(WS, &live, 60, "new turn settled on the survivor", |v| {
        turn_of(v, &live).is_some_and(|t| t["outcome"] == "completed")
            && v["session"].get("activeTurnId").is_none()
    });
    let all = b.events(Some(0), None, usize::MAX, 1);

    // The follower on B: every row once, in order, through the takeover.
    let mut got = Vec::new();
    while got.len() < all.len() {
        match on_b.recv_timeout(Duration::from_secs(60)) {
            Ok(v) => got.push(v),
            Err(_) => panic!("B's follower stopped after {:?}", seqs(&got)),
        }
    }
    assert_eq!(
        seqs(&got),
        seqs(&all),
        "B's follower: each row once, in order"
    );
    assert_eq!(got, all);
    // The follower on A: what A streamed before it died, then the rest from B.
    let mut from_a = Vec::new();
    loop {
        match on_a.recv_timeout(Duration::from_secs(60)) {
            Ok(v) => from_a.push(v),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("A's stream did not end"),
        }
    }
    let last = from_a
        .last()
        .map(|v| v["seq"].as_u64().expect("seq"))
        .expect("A streamed rows before it died");
    let rest = b.events(None, Some(last), all.len() - from_a.len(), 10);
    from_a.extend(rest);
    assert_eq!(
        seqs(&from_a),
        seqs(&all),
        "A's follower resumed on B: each row once, in order"
    );
    assert_eq!(from_a, all);
}

fn bearer(d: &TestDaemon) -> String {
    format!("Bearer {}", d.token)
}

fn submit_path(id: &str) -> String {
    format!("/v1/workspaces/{WS}/agent-sessions/{id}/submit")
}

/// Issue 21: "A command (submit, cancel, answer, delete) that reaches a daemon which does not
/// own the tree is forwarded to the owner (its address is in the lease)". Three daemons on one
/// database: A runs a tree's provider; a cancel sent to B, a submit sent to C (with its
/// `X-Request-Id`), the answer to a child's permission request sent to C and a delete sent to B
/// are each carried out by A (answered as A answers,
/// the provider runs on A only, B and C start none). A new tree's first batch is committed
/// under a lease (the create left a released lease row: step 2, fencing from the first batch).
/// A request marked as forwarded must carry the database's cluster secret: missing or wrong,
/// the owner refuses it 401 even with its own bearer token.
#[test]
fn commands_sent_to_any_daemon_are_carried_out_by_the_tree_owner() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("database");
    let env = [("TUTTI_DEMO_SPEED", "2")];
    let a = TestDaemon::start_with_db(EXE, Some(&url), None, &env);
    let b = TestDaemon::start_with_db(EXE, Some(&url), None, &env);
    let c = TestDaemon::start_with_db(EXE, Some(&url), None, &env);
    let store = tutti_postgres::PostgresStore::connect(&url).expect("connect");

    let id = a.create(WS, "demo");
    // Released right after the create's round (its reply may come first).
    let created = tutti_tests::procs::poll(30, || {
        store
            .lease(&id)
            .expect("lease read")
            .filter(tutti_postgres::Lease::is_released)
    })
    .expect("the create claimed a lease, released after it");
    assert_eq!(created.epoch, 1);
    assert_eq!(created.owner_address, a.addr);

    let (reply, turn) = a.submit(WS, &id, "children=2 hang=1,2 permission=0 fail=0 late=0");
    assert_eq!(reply, "started");
    a.wait_for(WS, &id, 60, "children running", |v| {
        v["childSessions"].as_array().is_some_and(|c| c.len() == 2)
    });
    let lease = store.lease(&id).expect("lease read").expect("lease");
    assert_eq!(lease.owner_address, a.addr, "A owns the running tree");
    assert!(!providers_of(&a).is_empty(), "the provider runs on A");

    // Cancel through B: accepted as A accepts it, carried out on A.
    let (status, body) = b.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/{turn}/cancel"),
        None,
    );
    assert_eq!(status, 202, "cancel through B: {body}");
    assert!(body["operationId"].as_str().is_some(), "{body}");
    a.wait_for(WS, &id, 60, "cancelled on A", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"] == "canceled")
            && v["session"].get("activeTurnId").is_none()
    });

    // Submit through C, with a request id: the turn starts and runs on A's provider.
    let (status, _, body) = request(
        &c.addr,
        "POST",
        &submit_path(&id),
        &[
            ("authorization", &bearer(&c)),
            ("x-request-id", "fwd-req-1"),
        ],
        Some(serde_json::json!({ "text": "children=1 permission=0 fail=0 late=0" })),
    );
    assert_eq!(status, 200, "submit through C: {body}");
    assert_eq!(body["reply"], "started", "{body}");
    let new_turn = body["turnId"].as_str().expect("turn id").to_string();
    let done = a.wait_for(WS, &id, 60, "C's turn completed on A", |v| {
        turn_of(v, &id).is_some_and(|t| t["id"] == new_turn.as_str() && t["outcome"] == "completed")
    });
    assert_eq!(done["session"]["lastTurnId"], new_turn.as_str());
    let lease = store.lease(&id).expect("lease read").expect("lease");
    assert_eq!(lease.owner_address, a.addr, "A still owns the tree");
    assert!(providers_of(&b).is_empty(), "no provider ever ran on B");
    assert!(providers_of(&c).is_empty(), "no provider ever ran on C");

    // A permission request of a child on A, answered through C.
    a.submit(WS, &id, "children=1 permission=1 fail=0 late=0");
    let asked = a.wait_for(WS, &id, 60, "a pending permission", |v| {
        v["interactions"]
            .as_array()
            .is_some_and(|i| i.iter().any(|i| i["status"] == "pending"))
    });
    let pending = asked["interactions"]
        .as_array()
        .and_then(|i| i.iter().find(|i| i["status"] == "pending"))
        .expect("pending interaction")
        .clone();
    let (status, body) = c.call(
        "POST",
        &format!(
            "/v1/workspaces/{WS}/agent-sessions/{}/turns/{}/interactions/{}",
            pending["agentSessionId"].as_str().expect("owner"),
            pending["turnId"].as_str().expect("turn"),
            pending["requestId"].as_str().expect("request id"),
        ),
        Some(serde_json::json!({ "response": "allow" })),
    );
    assert_eq!(status, 200, "answer through C: {body}");
    a.wait_for(
        WS,
        &id,
        60,
        "the allowed child and the turn completed on A",
        |v| {
            turn_of(v, &id).is_some_and(|t| t["outcome"] == "completed")
                && v["session"].get("activeTurnId").is_none()
                && v["interactions"]
                    .as_array()
                    .is_some_and(|i| i.iter().all(|i| i["status"] != "pending"))
        },
    );
    assert!(providers_of(&c).is_empty(), "no provider ever ran on C");

    // Auth between daemons: the marker without the cluster secret is refused by the owner,
    // whatever bearer token comes with it; nothing changes.
    let text = serde_json::json!({ "text": "children=0 permission=0 fail=0 late=0" });
    let before = tree(a.detail(WS, &id));
    for secret in [None, Some("not-the-cluster-secret")] {
        let mut h = vec![
            ("authorization", bearer(&a)),
            ("x-tutti-forwarded-by", b.addr.clone()),
        ];
        if let Some(s) = secret {
            h.push(("x-tutti-cluster-secret", s.to_string()));
        }
        let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (status, _, body) = request(&a.addr, "POST", &submit_path(&id), &h, Some(text.clone()));
        assert_eq!(status, 401, "secret {secret:?}: {body}");
        assert_eq!(body["error"]["code"], "unauthorized");
    }
    assert_eq!(
        tree(a.detail(WS, &id)),
        before,
        "refused requests changed nothing"
    );
    // With the database's secret (and no bearer token) the owner takes it.
    let secret: String = postgres::Client::connect(&url, postgres::NoTls)
        .expect("connect")
        .query_one("SELECT secret FROM cluster_secret", &[])
        .expect("cluster secret")
        .get(0);
    let (status, _, body) = request(
        &a.addr,
        "POST",
        &submit_path(&id),
        &[
            ("x-tutti-forwarded-by", &b.addr),
            ("x-tutti-cluster-secret", &secret),
        ],
        Some(text),
    );
    assert_eq!(status, 200, "{body}");
    a.wait_for(WS, &id, 60, "third turn completed", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"] == "completed")
            && v["session"].get("activeTurnId").is_none()
    });

    // Delete through B: A deletes the tree and stops its provider.
    let (status, body) = b.call(
        "DELETE",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}"),
        None,
    );
    assert_eq!(status, 200, "delete through B: {body}");
    assert_eq!(body["deletedSessions"], 5, "{body}");
    assert!(
        tutti_tests::procs::poll(30, || providers_of(&a).is_empty().then_some(())).is_some(),
        "A stopped the deleted tree's provider"
    );
}

/// Issue 21: a command for a tree whose owner died before its lease expired cannot be
/// forwarded (connection refused): `503 owner_unreachable` with `Retry-After` within the
/// lease time, nothing changed; once the lease expired the receiving daemon claims the tree
/// for the command (settling the dead owner's turn first, as failover does: the submit starts
/// a new turn instead of joining the dead one) and handles the command itself.
#[test]
fn a_command_for_a_dead_owner_waits_for_its_lease_then_the_receiver_claims_the_tree() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("database");
    let env = [("TUTTI_DEMO_SPEED", "2")];
    // A's lease is long enough that the command below reaches B before it expires. B's own
    // failover tick (a third of its lease: 20 s, the first at its start) does not come while
    // the test runs, so it is the command that makes B claim the tree.
    let mut a = TestDaemon::start_with_db(EXE, Some(&url), Some("lease_secs = 6\n"), &env);
    let b = TestDaemon::start_with_db(EXE, Some(&url), Some("lease_secs = 60\n"), &env);
    let id = a.create(WS, "demo");
    a.submit(WS, &id, "children=1 hang=1 permission=0 fail=0 late=0");
    a.wait_for(WS, &id, 60, "child running", |v| {
        v["childSessions"].as_array().is_some_and(|c| c.len() == 1)
    });
    let before = tree(b.detail(WS, &id));
    a.kill9();
    let text = serde_json::json!({ "text": "children=0 permission=0 fail=0 late=0" });
    let (status, retry, body) = request(
        &b.addr,
        "POST",
        &submit_path(&id),
        &[("authorization", &bearer(&b))],
        Some(text.clone()),
    );
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "owner_unreachable", "{body}");
    let retry: u64 = retry.expect("Retry-After").parse().expect("seconds");
    assert!(
        (1..=6).contains(&retry),
        "Retry-After within the lease: {retry}"
    );
    assert_eq!(tree(b.detail(WS, &id)), before, "nothing changed");

    let answer = tutti_tests::procs::poll(60, || {
        let (status, _, body) = request(
            &b.addr,
            "POST",
            &submit_path(&id),
            &[("authorization", &bearer(&b))],
            Some(text.clone()),
        );
        match status {
            503 => None,
            _ => Some((status, body)),
        }
    })
    .expect("B handles the command after the lease expired");
    assert_eq!(answer.0, 200, "{}", answer.1);
    assert_eq!(answer.1["reply"], "started", "{}", answer.1);
    let end = b.wait_for(WS, &id, 60, "B's turn completed", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"] == "completed")
    });
    let turns = end["turns"].as_array().expect("turns");
    assert!(
        turns.iter().any(|t| t["outcome"] == "interrupted"),
        "the dead owner's turn settled interrupted: {end}"
    );
    let lease = tutti_postgres::PostgresStore::connect(&url)
        .expect("connect")
        .lease(&id)
        .expect("lease read")
        .expect("lease");
    assert_eq!(lease.owner_address, b.addr, "B claimed the tree");
}

/// A counter of the daemon's `/metrics` (0 when absent).
fn metric(d: &TestDaemon, name: &str) -> f64 {
    let r = ureq::get(&format!("http://{}/metrics", d.addr))
        .set("authorization", &bearer(d))
        .timeout(Duration::from_secs(20))
        .call()
        .expect("metrics");
    let text = r.into_string().expect("metrics text");
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Issue 21: "Every batch a daemon commits for a tree carries a fencing guard on the lease
/// epoch, so a daemon that lost its lease (paused, partitioned) can never commit for that tree
/// again", with real processes. A drives a long turn (its provider keeps streaming); A is
/// paused (SIGSTOP, not dead); its lease expires and B takes the tree over (settles it); A is
/// resumed (SIGCONT) with the provider's output of the pause waiting in its pipe. Nothing A
/// would write appears: the tree and the whole outbox stay exactly as B left them (seq
/// gap-free, no duplicate), and A stops the tree's provider (its child process is gone). (A
/// may learn from its renewal that the lease is gone before it tries to commit; the next test
/// makes the refused commit certain.)
#[test]
fn a_paused_owner_that_lost_its_tree_commits_nothing_more_for_it() {
    // Slow: the turn streams for many seconds, so the provider writes while A is paused.
    let (_server, url, a, b) = two_daemons("0.3", Some("lease_secs = 1\n"));
    let store = tutti_postgres::PostgresStore::connect(&url).expect("connect");
    let id = a.create(WS, "demo");
    a.submit(WS, &id, "children=3 permission=0 fail=0 late=0");
    a.wait_for(WS, &id, 60, "a child running", |v| {
        v["childSessions"].as_array().is_some_and(|c| !c.is_empty())
    });
    let held = store.lease(&id).expect("lease read").expect("lease");
    assert_eq!(held.owner_address, a.addr);
    assert!(!providers_of(&a).is_empty(), "A runs the provider");
    let refused_before = metric(&a, "tutti_commit_failures");

    signal(&a, libc::SIGSTOP);
    let taken = tutti_tests::procs::poll(60, || {
        let l = store.lease(&id).ok()??;
        let settled = b.detail(WS, &id)["session"].get("activeTurnId").is_none();
        (l.epoch > held.epoch && settled).then_some(l)
    });
    let Some(taken) = taken else {
        signal(&a, libc::SIGCONT);
        panic!("B did not take the tree over");
    };
    assert_ne!(taken.owner, held.owner, "B took the lease");
    let left = tree(b.detail(WS, &id));
    let rows = b.events(Some(0), None, usize::MAX, 2);
    signal(&a, libc::SIGCONT);

    // A notices (renewal or a refused commit) and stops the tree's provider.
    assert!(
        tutti_tests::procs::poll(60, || providers_of(&a).is_empty().then_some(())).is_some(),
        "A stopped the provider of the tree it lost"
    );
    // Whether A committed (and was refused) before its renewal told it the lease was gone
    // depends on which it handled first after the pause; either way nothing of it lands.
    let refused = metric(&a, "tutti_commit_failures") - refused_before;
    println!("commits of the paused owner refused after it resumed: {refused}");
    assert_eq!(tree(b.detail(WS, &id)), left, "the tree is as B left it");
    assert_eq!(tree(a.detail(WS, &id)), left, "A reads the same");
    let after = b.events(Some(0), None, usize::MAX, 2);
    assert_eq!(after, rows, "no row of A's after the takeover");
    let all = seqs(&after);
    assert_eq!(
        all,
        (1..=all.len() as u64).collect::<Vec<_>>(),
        "gap-free, no duplicate"
    );
    let lease = store.lease(&id).expect("lease read").expect("lease");
    assert_eq!(lease.epoch, taken.epoch, "A took nothing back");
}

/// Issue 21, the fence itself at daemon level: a daemon whose lease was taken over while it
/// runs the tree (here the lease row is moved to another owner in the database, as a
/// takeover does, while A's next renewal is seconds away) has its very next commit for that
/// tree refused: A's commit failure counter rises, the tree and the outbox stay exactly as they
/// were at the takeover, and A stops the tree's provider at its next renewal.
#[test]
fn a_daemon_whose_lease_was_taken_over_has_its_next_commit_refused() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("database");
    let env = [("TUTTI_DEMO_SPEED", "0.3")];
    // Renewal every 10 s: the provider's next lines come long before it.
    let a = TestDaemon::start_with_db(EXE, Some(&url), Some("lease_secs = 30\n"), &env);
    let id = a.create(WS, "demo");
    a.submit(WS, &id, "children=3 permission=0 fail=0 late=0");
    a.wait_for(WS, &id, 60, "a child running", |v| {
        v["childSessions"].as_array().is_some_and(|c| !c.is_empty())
    });
    let refused_before = metric(&a, "tutti_commit_failures");
    let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
    let moved = c
        .execute(
            "UPDATE tree_leases SET owner = 'intruder', owner_address = '127.0.0.1:9', \
             epoch = epoch + 1, expires_at_ms = expires_at_ms + 600000 \
             WHERE root_agent_session_id = $1",
            &[&id],
        )
        .expect("take the lease over");
    assert_eq!(moved, 1);
    let left = tree(a.detail(WS, &id));
    let rows = a.events(Some(0), None, usize::MAX, 2);
    // A command A still believes it owns: its batch is refused by the fence, A reloads the
    // tree and answers 409 `commit_conflict` (or, had A's renewal just told it that the lease
    // is gone, A forwards to the new owner's address, which does not answer: 503).
    let (status, _, body) = request(
        &a.addr,
        "POST",
        &submit_path(&id),
        &[("authorization", &bearer(&a))],
        Some(serde_json::json!({ "text": "children=0 permission=0 fail=0 late=0" })),
    );
    match status {
        409 => assert_eq!(body["error"]["code"], "commit_conflict", "{body}"),
        503 => assert_eq!(body["error"]["code"], "owner_unreachable", "{body}"),
        _ => panic!("unexpected answer {status}: {body}"),
    }
    println!("command to the fenced owner: {status}");
    let refused = tutti_tests::procs::poll(60, || {
        let n = metric(&a, "tutti_commit_failures") - refused_before;
        (n >= 1.0).then_some(n)
    });
    assert!(
        refused.is_some(),
        "A's next commit for the tree was refused"
    );
    assert_eq!(
        tree(a.detail(WS, &id)),
        left,
        "nothing A decided after the takeover landed"
    );
    assert_eq!(
        a.events(Some(0), None, usize::MAX, 2),
        rows,
        "no outbox row either"
    );
    assert!(
        tutti_tests::procs::poll(60, || providers_of(&a).is_empty().then_some(())).is_some(),
        "A stopped the provider of the tree it lost"
    );
    assert_eq!(
        tree(a.detail(WS, &id)),
        left,
        "still nothing after the provider stopped"
    );
}

/// Issue 21, commit races between daemons: commands for one idle tree (no provider running,
/// its lease released) sent to two daemons at the same moment. The lease decides who runs the
/// tree: one daemon claims it, the other forwards to it, and a daemon whose commit is refused
/// by a guard or the fence drops its copy of the tree, reloads it and answers `409
/// commit_conflict`. Every answer is a success or that typed conflict; every turn a success
/// announced is stored; and the stored tree is consistent: both daemons read the same tree,
/// which the store holds, with no turn left active.
#[test]
fn racing_commands_on_an_idle_tree_through_two_daemons_leave_one_consistent_tree() {
    use tutti_core::store::Store;
    // Providers stop 1 s after their tree went quiescent, releasing the lease.
    let (_server, url, a, b) = two_daemons("4", Some("idle_timeout_secs = 1\nlease_secs = 2\n"));
    let store = tutti_postgres::PostgresStore::connect(&url).expect("connect");
    let id = a.create(WS, "demo");
    let mut started = Vec::new();
    let mut conflicts = 0;
    for round in 0..3 {
        tutti_tests::procs::poll(60, || {
            store
                .lease(&id)
                .ok()?
                .filter(tutti_postgres::Lease::is_released)
        })
        .expect("the tree is idle, its lease released");
        let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
            let calls: Vec<_> = [&a, &b, &a, &b]
                .into_iter()
                .map(|d| {
                    let id = &id;
                    s.spawn(move || {
                        d.call(
                            "POST",
                            &submit_path(id),
                            Some(serde_json::json!({
                                "text": "children=1 permission=0 fail=0 late=0"
                            })),
                        )
                    })
                })
                .collect();
            calls
                .into_iter()
                .map(|c| c.join().expect("caller"))
                .collect()
        });
        for (status, body) in &answers {
            match status {
                200 => {
                    let reply = body["reply"].as_str().expect("reply");
                    assert!(
                        ["started", "appended", "pendingUnsupported"].contains(&reply),
                        "round {round}: {body}"
                    );
                    if reply == "started" {
                        started.push(body["turnId"].as_str().expect("turn").to_string());
                    }
                }
                409 => {
                    assert_eq!(
                        body["error"]["code"], "commit_conflict",
                        "round {round}: {body}"
                    );
                    conflicts += 1;
                }
                _ => panic!("round {round}: unexpected answer {status}: {body}"),
            }
        }
        a.wait_for(WS, &id, 60, "the round's turns settled", |v| {
            v["session"].get("activeTurnId").is_none()
                && turn_of(v, &id).is_some_and(|t| t.get("outcome").is_some_and(|o| !o.is_null()))
        });
    }
    println!(
        "started turns {}, commit conflicts {conflicts}",
        started.len()
    );
    // The lease serializes the daemons (the loser of a claim forwards), and a daemon that
    // claims a tree reloads it from the store first: no command was decided on a stale copy
    // (without the reload, the other daemon's stale copy is refused by the guards here).
    assert_eq!(
        conflicts, 0,
        "no command decided on a stale copy of the tree"
    );
    assert!(started.len() >= 3, "each round started a turn: {started:?}");
    for t in &started {
        let turn = store
            .turn(t)
            .expect("turn read")
            .expect("announced turn stored");
        assert!(!turn.phase().is_active(), "settled: {turn:?}");
    }
    let on_a = tree(a.detail(WS, &id));
    assert_eq!(on_a, tree(b.detail(WS, &id)), "both daemons read one tree");
    let stored = store.session(&id).expect("read").expect("root stored");
    assert!(stored.active_turn_id.is_none());
    assert_eq!(
        on_a["session"]["lastTurnId"].as_str(),
        stored.last_turn_id.as_deref(),
        "the daemons read what the store holds"
    );
}

/// Polls `GET path` (no auth) until its status is `want` (at most `secs`); returns the last
/// (status, `Retry-After`, body).
fn until_status(d: &TestDaemon, path: &str, want: u16, secs: u64) -> (u16, Option<String>, Value) {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let r = request(&d.addr, "GET", path, &[], None);
        if r.0 == want || std::time::Instant::now() > deadline {
            return r;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Issue 34, done when: "`pg_ctl restart` under a running daemon: commands work again within a
/// few seconds of the database being back, with `503` (not `409`) and an unhealthy `/healthz`
/// in between; nothing acknowledged is lost". A tree is created and driven to completion (its
/// submit acknowledged); an event stream follows; the server is stopped (`pg_ctl stop -m
/// fast`): `/healthz` and `/readyz` answer 503 `{"ok": false, "reason": "database"}` with
/// `Retry-After` while `/livez` stays 200; a create, a submit and a read answer 503
/// `unavailable` with `Retry-After`, never 409. The server starts again: without restarting
/// the daemon, `/healthz` is 200 again, a create is 201 within a few seconds, the tree reads
/// back exactly as acknowledged, a new submit on it runs to completion (the lease is claimed
/// again), the metrics counted the reconnects and the unavailable time, the follower that
/// reconnects with `Last-Event-ID` gets every row once, in order, gap-free, and a `pg_ctl
/// restart -m fast` under a running turn is survived the same way.
#[test]
fn a_daemon_survives_its_database_restarting_with_503_meanwhile_and_nothing_lost() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("database");
    let d = TestDaemon::start_with_db(EXE, Some(&url), None, &[("TUTTI_DEMO_SPEED", "2")]);
    let auth = bearer(&d);
    let id = d.create(WS, "demo");
    let (reply, _) = d.submit(WS, &id, "children=1 permission=0 fail=0 late=0");
    assert_eq!(reply, "started");
    let settled = d.wait_for(WS, &id, 60, "tree settled", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"] == "completed")
            && v["session"].get("activeTurnId").is_none()
    });
    let before = seqs(&d.events(Some(0), None, usize::MAX, 1));
    assert!(!before.is_empty(), "rows were published");

    server.stop().expect("pg_ctl stop");

    let (status, retry, body) = until_status(&d, "/healthz", 503, 20);
    assert_eq!(status, 503, "unhealthy while the database is down: {body}");
    assert_eq!(body["ok"], false);
    assert_eq!(body["reason"], "database");
    assert!(retry.is_some(), "Retry-After on /healthz");
    assert_eq!(request(&d.addr, "GET", "/readyz", &[], None).0, 503);
    assert_eq!(request(&d.addr, "GET", "/livez", &[], None).0, 200);
    let create_path = format!("/v1/workspaces/{WS}/agent-sessions");
    let detail_path = format!("/v1/workspaces/{WS}/agent-sessions/{id}");
    let attempts = [
        (
            "POST",
            create_path.clone(),
            Some(serde_json::json!({"provider": "demo"})),
        ),
        (
            "POST",
            submit_path(&id),
            Some(serde_json::json!({"text": "children=0 permission=0 fail=0 late=0"})),
        ),
        ("GET", detail_path.clone(), None),
        ("GET", create_path.clone(), None),
    ];
    for (method, path, body) in &attempts {
        let (status, retry, out) = request(
            &d.addr,
            method,
            path,
            &[("authorization", &auth)],
            body.clone(),
        );
        assert_eq!(
            status, 503,
            "{method} {path} while the database is down: {out}"
        );
        assert_eq!(
            out["error"]["code"], "unavailable",
            "{method} {path}: {out}"
        );
        assert!(retry.is_some(), "{method} {path}: Retry-After");
    }

    server.start_again().expect("pg_ctl start");

    let (status, _, body) = until_status(&d, "/healthz", 200, 20);
    assert_eq!(status, 200, "healthy again: {body}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let fresh = loop {
        let (status, _, out) = request(
            &d.addr,
            "POST",
            &create_path,
            &[("authorization", &auth)],
            Some(serde_json::json!({"provider": "demo"})),
        );
        if status == 201 {
            break out["session"]["id"].as_str().expect("id").to_string();
        }
        assert_ne!(
            status, 409,
            "never a conflict for an unreachable store: {out}"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "commands work again after the database is back: {status} {out}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        tree(d.detail(WS, &id)),
        tree(settled),
        "the acknowledged tree reads back the same"
    );
    let (reply, _) = d.submit(WS, &id, "children=1 permission=0 fail=0 late=0");
    assert_eq!(reply, "started", "the tree is driven again");
    // A restart while a turn runs: the daemon recovers again.
    let (reply, _) = d.submit(WS, &fresh, "children=1 hang=1 permission=0 fail=0 late=0");
    assert_eq!(reply, "started");
    d.wait_for(WS, &id, 60, "second turn settled", |v| {
        v["session"].get("activeTurnId").is_none()
            && v["turns"].as_array().is_some_and(|t| t.len() >= 2)
    });
    server.restart().expect("pg_ctl restart");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (status, _, out) = request(
            &d.addr,
            "POST",
            &create_path,
            &[("authorization", &auth)],
            Some(serde_json::json!({"provider": "demo"})),
        );
        if status == 201 {
            break;
        }
        assert_ne!(
            status, 409,
            "never a conflict for an unreachable store: {out}"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "commands work again after pg_ctl restart: {status} {out}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        metric(&d, "tutti_store_reconnects_total") >= 2.0,
        "reconnects counted"
    );
    assert!(
        metric(&d, "tutti_store_unavailable_seconds_total") > 0.0,
        "unavailable time counted"
    );
    // A follower reconnecting with Last-Event-ID after the outage: every later row once, in
    // order; the whole stream gap-free from 1.
    let all = seqs(&d.events(Some(0), None, usize::MAX, 1));
    assert_eq!(
        all,
        (1..=all.len() as u64).collect::<Vec<_>>(),
        "gap-free from 1"
    );
    assert!(
        all.len() > before.len(),
        "rows were published after the outage"
    );
    assert_eq!(&all[..before.len()], before.as_slice(), "no row lost");
    let from = *before.last().expect("some row");
    let rest = seqs(&d.events(None, Some(from), all.len() - before.len(), 10));
    assert_eq!(
        rest,
        all[before.len()..].to_vec(),
        "resumed by Last-Event-ID"
    );
}

/// Issue 34 item 3: "a command forwarded to a stopped owner waits the 30 s answer timeout
/// although the lease expires within 3 s". With the owner paused (SIGSTOP: its socket accepts
/// the connection, nothing answers), the receiver waits at most the owner's remaining lease
/// time and answers `503 owner_unreachable` with `Retry-After` (the lease's remaining
/// seconds), well before the old fixed wait.
#[test]
fn a_command_forwarded_to_a_paused_owner_is_answered_within_its_lease() {
    let (_server, _url, a, b) = two_daemons("0.3", Some("lease_secs = 3\n"));
    let id = a.create(WS, "demo");
    let (_, turn) = a.submit(WS, &id, "children=1 hang=1 late=0");
    a.wait_for(WS, &id, 60, "a child running", |v| {
        v["childSessions"].as_array().is_some_and(|c| !c.is_empty())
    });
    signal(&a, libc::SIGSTOP);
    let cancel = format!(
        "http://{}/v1/workspaces/{WS}/agent-sessions/{id}/turns/{turn}/cancel",
        b.addr
    );
    // The client gives up well before the old fixed 30 s answer timeout.
    let send = || match ureq::post(&cancel)
        .set("authorization", &bearer(&b))
        .timeout(Duration::from_secs(20))
        .call()
    {
        Ok(r) | Err(ureq::Error::Status(_, r)) => Ok((
            r.status(),
            r.header("retry-after").map(str::to_string),
            r.into_json::<Value>().unwrap_or(Value::Null),
        )),
        Err(e) => Err(e.to_string()),
    };
    let first = send();
    let Ok((status, retry, body)) = first else {
        signal(&a, libc::SIGCONT);
        panic!("no answer from B within 20 s: {first:?}");
    };
    if status != 503 {
        signal(&a, libc::SIGCONT);
    }
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "owner_unreachable", "{body}");
    assert!(
        retry
            .as_deref()
            .and_then(|r| r.parse::<u64>().ok())
            .is_some_and(|secs| (1..=3).contains(&secs)),
        "Retry-After is the lease's remaining seconds: {retry:?}"
    );
    signal(&a, libc::SIGCONT);
}

/// The database server frozen: its postmaster and every backend `SIGSTOP`ped (connections stay
/// open and nothing answers, as in a network partition); `SIGCONT` on drop.
struct Frozen(Vec<u32>);

impl Frozen {
    fn new(server: &Server) -> Frozen {
        let pm = server.postmaster_pid().expect("postmaster pid");
        let mut pids = vec![pm];
        pids.extend(tutti_tests::procs::children_of(pm));
        for &p in &pids {
            let pid = libc::pid_t::try_from(p).expect("pid");
            // SAFETY: kill(2) of this test's own PostgreSQL server processes.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
        }
        Frozen(pids)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        for &p in &self.0 {
            if let Ok(pid) = libc::pid_t::try_from(p) {
                // SAFETY: as in `Frozen::new`.
                unsafe { libc::kill(pid, libc::SIGCONT) };
            }
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Issue 34: "A daemon that cannot renew stops acting before its lease can expire by its own
/// clock (stop the tree's provider, refuse commands)" and "every client request has a bounded
/// deadline". The database freezes under A (a partition: its connections stay open, nothing
/// answers, so A's engine thread blocks on its next statement). A's lease watchdog stops the
/// tree's provider before the lease (3 s, last renewed before the freeze) can have expired; a
/// create and a read sent meanwhile are answered `503 unavailable` at their deadlines instead
/// of hanging, and the create given up is never carried out. Once the database thaws, A claims
/// the tree again and settles it interrupted (its provider is gone), and it takes a new prompt.
#[test]
fn a_daemon_cut_off_from_its_database_stops_its_providers_before_its_lease_expires() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("database");
    let env = [("TUTTI_DEMO_SPEED", "1")];
    let lease_ms = 3000;
    let a = TestDaemon::start_with_db(EXE, Some(&url), Some("lease_secs = 3\n"), &env);
    let id = a.create(WS, "demo");
    let (_, turn) = a.submit(WS, &id, "children=2 hang=1,2 permission=0 fail=0 late=0");
    a.wait_for(WS, &id, 60, "children running", |v| {
        v["childSessions"].as_array().is_some_and(|c| c.len() == 2)
    });
    assert!(!providers_of(&a).is_empty(), "A runs the provider");

    let frozen = Frozen::new(&server);
    let t0 = now_ms();
    // The last renewal started before the freeze, so the lease expires by t0 + lease at the
    // latest: the provider must be gone by then.
    let gone = tutti_tests::procs::poll(30, || providers_of(&a).is_empty().then(now_ms));
    let Some(gone) = gone else {
        drop(frozen);
        panic!("A kept its provider through the freeze");
    };
    println!(
        "provider stopped {} ms into the freeze (lease {lease_ms} ms)",
        gone - t0
    );
    assert!(
        gone - t0 <= lease_ms,
        "the provider was stopped {} ms into the freeze, after the lease could expire",
        gone - t0
    );
    // Commands and reads are answered within their deadlines, not hung.
    let (st, v) = a.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions"),
        Some(serde_json::json!({"provider": "demo", "title": "during the freeze"})),
    );
    assert_eq!(st, 503, "a create while the store hangs: {v}");
    assert_eq!(v["error"]["code"], "unavailable", "{v}");
    let (st, v) = a.call(
        "GET",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}"),
        None,
    );
    assert_eq!(st, 503, "a read while the store hangs: {v}");
    assert_eq!(v["error"]["code"], "unavailable", "{v}");
    drop(frozen);

    // Thawed: the tree is settled interrupted, by A, and takes a new prompt.
    let settled = a.wait_for(WS, &id, 60, "tree settled after the thaw", |v| {
        v["session"].get("activeTurnId").is_none()
            && v["childSessions"]
                .as_array()
                .is_some_and(|c| c.iter().all(|c| c.get("activeTurnId").is_none()))
    });
    let t = turn_of(&settled, &id).expect("root turn");
    assert_eq!(t["id"], turn.as_str(), "{settled}");
    assert_eq!(t["outcome"], "interrupted", "{settled}");
    let (st, v) = a.call("GET", &format!("/v1/workspaces/{WS}/agent-sessions"), None);
    assert_eq!(st, 200, "{v}");
    let titles: Vec<&str> = v["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .filter_map(|s| s["title"].as_str())
        .collect();
    assert!(
        !titles.contains(&"during the freeze"),
        "the create given up at its deadline was not carried out: {titles:?}"
    );
    let (reply, _) = a.submit(WS, &id, "children=1 permission=0 fail=0 late=0");
    assert_eq!(reply, "started");
    a.wait_for(WS, &id, 60, "the new prompt completed", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"] == "completed")
    });
}

/// Found by the fault harness (issue 34 item 5): a daemon restarted after `kill -9` loads the
/// live trees, then claims each and settles it interrupted; when another daemon changed a tree
/// between that load and the claim (it took the tree over and settled it while this one was
/// down), the recovery step was refused by a guard and the whole start failed ("recovery
/// commit failed"), so the daemon did not come up. Here the change is made inside the claim's
/// own transaction (a trigger on the lease row bumps the live root turn's version, as another
/// daemon's write would have), so it lands exactly in that window: the daemon still starts,
/// settles the tree from the store's copy (interrupted), and takes a new prompt.
#[test]
fn a_restarted_daemon_starts_when_a_tree_changed_between_its_load_and_its_claim() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("database");
    let env = [("TUTTI_DEMO_SPEED", "2")];
    let mut a = TestDaemon::start_with_db(EXE, Some(&url), Some("lease_secs = 3\n"), &env);
    let id = a.create(WS, "demo");
    let (_, turn) = a.submit(WS, &id, "children=1 hang=1 permission=0 fail=0 late=0");
    a.wait_for(WS, &id, 60, "child running", |v| {
        v["childSessions"].as_array().is_some_and(|c| c.len() == 1)
    });
    a.kill9();
    let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
    c.batch_execute(&format!(
        "CREATE TABLE test_fired (n INT);
         CREATE FUNCTION test_change_tree() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NOT EXISTS (SELECT 1 FROM test_fired) THEN
             INSERT INTO test_fired VALUES (1);
             UPDATE turns SET version = version + 1,
               json = jsonb_set(json::jsonb, '{{version}}', to_jsonb(version + 1))::text
               WHERE id = '{turn}';
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER test_change_tree AFTER UPDATE ON tree_leases FOR EACH ROW
           WHEN (NEW.root_agent_session_id = '{id}') EXECUTE FUNCTION test_change_tree();"
    ))
    .expect("trigger");
    a.restart();
    let fired: i64 = c
        .query_one("SELECT count(*) FROM test_fired", &[])
        .expect("fired")
        .get(0);
    assert_eq!(fired, 1, "the tree changed between the load and the claim");
    let end = a.wait_for(WS, &id, 60, "settled after the restart", |v| {
        v["session"].get("activeTurnId").is_none()
    });
    let t = turn_of(&end, &id).expect("root turn");
    assert_eq!(t["id"], turn.as_str(), "{end}");
    assert_eq!(t["outcome"], "interrupted", "{end}");
    let (reply, _) = a.submit(WS, &id, "children=0 permission=0 fail=0 late=0");
    assert_eq!(reply, "started");
}

/// Found by the fault harness (issue 34 item 5): a daemon that claims a tree whose owner
/// stopped renewing settles it (interrupted) and then releases the lease; when that settling
/// step did not commit (here: the store fails the turn's update once, through a trigger), the
/// lease was released all the same, leaving a live tree with a released lease, which no
/// failover ever claims (only expired, unreleased leases are): the tree stayed active forever.
/// Now the lease is kept (unreleased) and the tree is settled again at the next renewal tick.
#[test]
fn a_takeover_whose_settling_step_fails_settles_the_tree_later_instead_of_releasing_it() {
    let (_server, url, mut a, b) = two_daemons("2", Some("lease_secs = 1\n"));
    let id = a.create(WS, "demo");
    let (_, turn) = a.submit(WS, &id, "children=1 hang=1 permission=0 fail=0 late=0");
    a.wait_for(WS, &id, 60, "child running", |v| {
        v["childSessions"].as_array().is_some_and(|c| c.len() == 1)
    });
    let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
    // The first two updates of the root turn after A died fail (a sequence: not rolled back
    // with the failing transaction): the takeover's settling step fails in its group and when
    // retried alone.
    c.batch_execute(
        "CREATE SEQUENCE test_fail_once;
         CREATE FUNCTION test_fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF nextval('test_fail_once') <= 2 THEN
             RAISE EXCEPTION 'injected failure of the settling step';
           END IF;
           RETURN NEW;
         END $$;",
    )
    .expect("function");
    a.kill9();
    c.batch_execute(&format!(
        "CREATE TRIGGER test_fail_once BEFORE UPDATE ON turns FOR EACH ROW
           WHEN (OLD.id = '{turn}') EXECUTE FUNCTION test_fail_once();"
    ))
    .expect("trigger");
    let end = b.wait_for(WS, &id, 60, "taken over and settled", |v| {
        v["session"].get("activeTurnId").is_none()
    });
    let failed: i64 = c
        .query_one("SELECT last_value FROM test_fail_once", &[])
        .expect("sequence")
        .get(0);
    assert!(
        failed >= 3,
        "the first settling step failed, a later one passed"
    );
    let t = turn_of(&end, &id).expect("root turn");
    assert_eq!(t["id"], turn.as_str(), "{end}");
    assert_eq!(t["outcome"], "interrupted", "{end}");
}
