//! `cargo bench -p tutti-postgres`: durable events per second through [`PostgresStore`] with
//! group commit, against raw `postgres` writing the same rows in the same transactions.
//!
//! Issue 21: "durable events/s through the store with group commit, and raw `postgres` writing
//! the same rows in the same transactions, with the ratio (goal: at least 50 % of raw)".
//!
//! A real server is started in a temporary directory with PostgreSQL's durable defaults (`fsync`
//! and `synchronous_commit` on). An engine decides a workload of root trees (sessions, turns, a
//! child, transcript messages, tool calls, terminals); each run applies the same batches, in
//! groups of `G`, to a fresh database:
//! - **store**: [`HostStore::apply_group`] (guards checked, outbox counter locked, conditional
//!   upserts);
//! - **raw**: one transaction per group; each row is a plain `INSERT` of its table's columns
//!   (an upsert where the engine rewrites a row), each published row an outbox `INSERT` with a
//!   seq counted by the client: no guards, no version checks, no counter row.
//!
//! Figures are printed; nothing is asserted (no timed assertions anywhere). Set
//! `TUTTI_BENCH_EVENTS` to change the workload size (default 20,000 events).

use serde_json::json;
use std::time::Instant;
use tutti_core::model::SessionKind;
use tutti_core::step::Row;
use tutti_core::store::HostStore;
use tutti_core::{Engine, PersistBatch};
use tutti_pg_server::Server;
use tutti_postgres::PostgresStore;

fn workload(events: usize) -> Vec<PersistBatch> {
    let mut engine = Engine::new();
    let mut out = Vec::with_capacity(events);
    let mut now = 0;
    let mut tree = 0;
    while out.len() < events {
        tree += 1;
        let r = format!("root-{tree}");
        let t = format!("turn-{tree}");
        let c = format!("child-{tree}");
        let ct = format!("child-turn-{tree}");
        let mut inputs = vec![
            json!({"type": "createSession", "agentSessionId": r, "workspaceId": "W", "provider": "codex"}),
            json!({"type": "submit", "agentSessionId": r, "turnId": t, "text": "go"}),
            json!({"type": "rootProviderTurnStarted", "agentSessionId": r, "providerTurnId": "p"}),
            json!({"type": "childSessionCreated", "agentSessionId": c, "turnId": ct, "parentAgentSessionId": r, "parentTurnId": t, "rootAgentSessionId": r, "rootTurnId": t}),
            json!({"type": "turnStarted", "agentSessionId": c, "turnId": ct}),
        ];
        for i in 0..40 {
            inputs.push(json!({"type": "messageAppended", "agentSessionId": c, "turnId": ct, "messageId": format!("m{i}"), "role": "assistant", "text": "a line of transcript of about sixty characters, as agents write"}));
            if i % 8 == 0 {
                inputs.push(json!({"type": "toolCallUpdated", "agentSessionId": c, "turnId": ct, "toolCallId": format!("call{i}"), "name": "Grep", "status": "completed"}));
            }
        }
        inputs.push(json!({"type": "turnTerminal", "agentSessionId": c, "turnId": ct, "outcome": "completed"}));
        inputs.push(json!({"type": "rootProviderTurnCompleted", "agentSessionId": r, "providerTurnId": "p", "outcome": "completed"}));
        for v in inputs {
            now += 1;
            let input = serde_json::from_value(v).expect("bench input");
            if let Ok(step) = engine.handle(now, &input) {
                out.push(step.persist);
            }
        }
    }
    out.truncate(events);
    out
}

fn store_run(url: &str, batches: &[PersistBatch], group: usize) -> f64 {
    let mut store = PostgresStore::connect(url).expect("connect");
    let start = Instant::now();
    for chunk in batches.chunks(group) {
        let refs: Vec<&PersistBatch> = chunk.iter().collect();
        store.apply_group(&refs, true).expect("group commit");
    }
    start.elapsed().as_secs_f64()
}

fn raw_run(url: &str, batches: &[PersistBatch], group: usize) -> f64 {
    let mut client = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    // The same tables (the store's migration creates them).
    drop(PostgresStore::connect(url).expect("migrate"));
    let session = client
        .prepare(
            "INSERT INTO sessions (id, workspace_id, kind, root_agent_session_id, \
             active_turn_id, created_at, deleted_at, version, json) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (id) DO UPDATE SET \
             active_turn_id = excluded.active_turn_id, deleted_at = excluded.deleted_at, \
             version = excluded.version, json = excluded.json",
        )
        .expect("prepare");
    let turn = client
        .prepare(
            "INSERT INTO turns (id, agent_session_id, child_creation_closed, created_at, \
             version, json) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (id) DO UPDATE SET \
             child_creation_closed = excluded.child_creation_closed, \
             version = excluded.version, json = excluded.json",
        )
        .expect("prepare");
    let message = client
        .prepare(
            "INSERT INTO messages (agent_session_id, seq, message_id, json) \
             VALUES ($1, $2, $3, $4)",
        )
        .expect("prepare");
    let tool = client
        .prepare(
            "INSERT INTO tool_calls (agent_session_id, tool_call_id, version, json) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (agent_session_id, tool_call_id) DO UPDATE \
             SET version = excluded.version, json = excluded.json",
        )
        .expect("prepare");
    let outbox = client
        .prepare(
            "INSERT INTO outbox (seq, kind, root_agent_session_id, workspace_id, payload) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .expect("prepare");
    let mut seq: i64 = 0;
    let start = Instant::now();
    for chunk in batches.chunks(group) {
        let mut tx = client.transaction().expect("begin");
        for b in chunk {
            let mut json = Vec::with_capacity(b.rows.len());
            for row in &b.rows {
                let j = match row {
                    Row::Session(s) => {
                        let j = serde_json::to_string(&**s).expect("encode");
                        let kind = if s.kind() == SessionKind::Root {
                            "root"
                        } else {
                            "child"
                        };
                        tx.execute(
                            &session,
                            &[
                                &&*s.id,
                                &&*s.workspace_id,
                                &kind,
                                &s.root_agent_session_id().map(|r| &**r),
                                &s.active_turn_id.as_deref(),
                                &s.created_at,
                                &s.deleted_at,
                                &(s.version as i64),
                                &j,
                            ],
                        )
                        .expect("session");
                        j
                    }
                    Row::Turn(t) => {
                        let j = serde_json::to_string(&**t).expect("encode");
                        tx.execute(
                            &turn,
                            &[
                                &&*t.id,
                                &&*t.agent_session_id,
                                &t.child_creation_closed(),
                                &t.created_at,
                                &(t.version as i64),
                                &j,
                            ],
                        )
                        .expect("turn");
                        j
                    }
                    Row::Message(m) => {
                        let j = serde_json::to_string(m).expect("encode");
                        tx.execute(
                            &message,
                            &[&&*m.agent_session_id, &(m.seq as i64), &&*m.message_id, &j],
                        )
                        .expect("message");
                        j
                    }
                    Row::ToolCall(c) => {
                        let j = serde_json::to_string(&**c).expect("encode");
                        tx.execute(
                            &tool,
                            &[
                                &&*c.agent_session_id,
                                &&*c.tool_call_id,
                                &(c.version as i64),
                                &j,
                            ],
                        )
                        .expect("tool call");
                        j
                    }
                    other => panic!("the bench workload has no {} rows", other.kind()),
                };
                json.push(j);
            }
            let (Some(root), Some(ws)) = (&b.root_agent_session_id, &b.workspace_id) else {
                continue;
            };
            for &i in &b.outbox {
                seq += 1;
                let row = &b.rows[i as usize];
                tx.execute(
                    &outbox,
                    &[&seq, &row.kind(), &&**root, &&**ws, &json[i as usize]],
                )
                .expect("outbox");
            }
        }
        tx.commit().expect("commit");
    }
    start.elapsed().as_secs_f64()
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this with a tiny workload.
    let quick = !std::env::args().any(|a| a == "--bench");
    let events: usize = std::env::var("TUTTI_BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 500 } else { 20_000 });
    let server = match Server::start() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tutti-postgres bench: no PostgreSQL server: {e}");
            return;
        }
    };
    let batches = workload(events);
    let rows: usize = batches.iter().map(|b| b.rows.len()).sum();
    println!(
        "tutti-postgres: {} events ({rows} rows), durable server (fsync on)",
        batches.len()
    );
    for group in [1, 64, 512] {
        if quick && group == 1 {
            continue;
        }
        let db = |tag: &str| server.create_database_named(&format!("{tag}_{group}"));
        let raw = raw_run(&db("raw").expect("db"), &batches, group);
        let store = store_run(&db("store").expect("db"), &batches, group);
        let n = batches.len() as f64;
        println!(
            "group {group:>4}: store {:>9.0} events/s   raw postgres {:>9.0} events/s   ratio {:>5.1} %",
            n / store,
            n / raw,
            100.0 * raw / store
        );
    }
}
