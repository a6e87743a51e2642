//! Issue 31: the OpenAPI document against the server. A real `tuttid` (real SQLite file, the
//! real demo ACP agent over pipes) serves the document; every route of the document is served
//! and every other method of its paths is 405; answers recorded from a real run (sessions with
//! child sessions, messages, an interaction answered, a cancel, a delete, the typed errors) and
//! the event stream's rows (each row kind and the `reset` event) validate against the
//! document's schemas with a JSON Schema validator.

use serde_json::{json, Value};
use std::collections::BTreeSet;
use tutti_tests::daemon::{turn_of, TestDaemon};
use tutti_tests::openapi::{read_events, Doc};

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const CLI: &str = env!("CARGO_BIN_EXE_tutti-test");
const WS: &str = "w1";
const SESSIONS: &str = "/v1/workspaces/{ws}/agent-sessions";
const SESSION: &str = "/v1/workspaces/{ws}/agent-sessions/{id}";

/// A request with any method and optional raw body; (status, JSON body or null).
fn send(d: &TestDaemon, method: &str, path: &str, body: Option<&str>, auth: bool) -> (u16, Value) {
    let url = format!("http://{}{}", d.addr, path);
    let mut req = ureq::request(method, &url);
    if auth {
        req = req.set("authorization", &format!("Bearer {}", d.token));
    }
    let r = match body {
        Some(b) => req.set("content-type", "application/json").send_string(b),
        None => req.call(),
    };
    match r {
        Ok(r) => {
            let st = r.status();
            (st, r.into_json().unwrap_or(Value::Null))
        }
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap_or(Value::Null)),
        Err(e) => panic!("{method} {path}: {e}"),
    }
}

/// A concrete path for a template (placeholder ids).
fn concrete(template: &str) -> String {
    template
        .replace("{ws}", WS)
        .replace("{id}", "s_none")
        .replace("{turn}", "t_none")
        .replace("{request}", "r_none")
}

#[test]
fn the_document_is_served_offline_and_lists_exactly_the_served_routes() {
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let (st, served) = send(&d, "GET", "/v1/openapi.json", None, true);
    assert_eq!(st, 200);
    assert_eq!(served, tutti_tokio::openapi::document());
    assert_eq!(served["openapi"], "3.1.0");
    assert_eq!(served["info"]["version"], env!("CARGO_PKG_VERSION"));
    let (st, v) = send(&d, "GET", "/v1/openapi.json", None, false);
    assert_eq!(st, 401, "same auth as the rest of /v1: {v}");
    let out = std::process::Command::new(CLI)
        .arg("openapi")
        .output()
        .expect("run tutti openapi");
    assert!(out.status.success());
    let printed: Value = serde_json::from_slice(&out.stdout).expect("tutti openapi prints JSON");
    assert_eq!(printed, served, "the CLI prints the served document");

    let doc = Doc::new(served);
    let paths = doc.doc["paths"].as_object().expect("paths").clone();
    let mut documented = BTreeSet::new();
    for (path, item) in &paths {
        let methods: Vec<&String> = item.as_object().expect("item").keys().collect();
        for m in ["get", "post", "delete", "put", "patch"] {
            let url = concrete(path);
            let body = (m != "get" && m != "delete").then_some("{}");
            let (st, v) = send(&d, &m.to_ascii_uppercase(), &url, body, true);
            if methods.iter().any(|x| *x == m) {
                documented.insert((m.to_string(), path.clone()));
                assert_ne!(st, 405, "{m} {path} is documented but not served: {v}");
                assert!(
                    !(st == 404 && v["error"]["message"] == "route not found"),
                    "{m} {path} is documented but not routed: {v}"
                );
                if v.is_object() && st >= 400 {
                    doc.validate_answer(m, path, st, &v).unwrap();
                }
            } else {
                assert_eq!(st, 405, "{m} {path} is served but not documented: {v}");
                assert_eq!(v["error"]["code"], "method_not_allowed");
            }
        }
    }
    let table: BTreeSet<_> = tutti_tokio::openapi::ROUTES
        .iter()
        .map(|r| (r.method.as_str().to_string(), r.path.to_string()))
        .collect();
    assert_eq!(documented, table);
    // Neighbours of the documented paths are not served (the router is the table).
    for p in [
        "/v1",
        "/v1/workspaces",
        "/v1/workspaces/w1",
        "/v1/openapi",
        "/v1/events/x",
    ] {
        let (st, v) = send(&d, "GET", p, None, true);
        assert_eq!(st, 404, "{p}: {v}");
        assert_eq!(v["error"]["message"], "route not found");
    }
}

#[test]
fn answers_and_event_rows_of_a_real_run_validate_against_the_document() {
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let doc = Doc::new(send(&d, "GET", "/v1/openapi.json", None, true).1);
    let mut checked = 0usize;
    let mut check = |method: &str, template: &str, (st, v): (u16, Value)| -> Value {
        doc.validate_answer(method, template, st, &v).unwrap();
        checked += 1;
        v
    };
    let base = format!("/v1/workspaces/{WS}/agent-sessions");
    let created = check(
        "post",
        SESSIONS,
        send(
            &d,
            "POST",
            &base,
            Some(r#"{"provider": "demo", "title": "t"}"#),
            true,
        ),
    );
    let id = created["session"]["id"].as_str().expect("id").to_string();
    let sub = check(
        "post",
        "/v1/workspaces/{ws}/agent-sessions/{id}/submit",
        send(
            &d,
            "POST",
            &format!("{base}/{id}/submit"),
            Some(r#"{"text": "children=2 permission=1 fail=1 late=0"}"#),
            true,
        ),
    );
    assert_eq!(sub["reply"], "started");
    // Answer the child's permission when it is pending, then wait for the root to settle.
    let pending = d.wait_for(WS, &id, 30, "a pending interaction", |v| {
        v["interactions"]
            .as_array()
            .is_some_and(|a| a.iter().any(|i| i["status"] == "pending"))
    });
    check("get", SESSION, (200, pending.clone()));
    let i = pending["interactions"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["status"] == "pending"))
        .expect("pending")
        .clone();
    let respond = "/v1/workspaces/{ws}/agent-sessions/{id}/turns/{turn}/interactions/{request}";
    let at = format!(
        "{base}/{}/turns/{}/interactions/{}",
        i["agentSessionId"].as_str().unwrap_or_default(),
        i["turnId"].as_str().unwrap_or_default(),
        i["requestId"].as_str().unwrap_or_default()
    );
    check(
        "post",
        respond,
        send(
            &d,
            "POST",
            &at,
            Some(r#"{"response": "no-such-option"}"#),
            true,
        ),
    );
    check(
        "post",
        respond,
        send(&d, "POST", &at, Some(r#"{"response": "allow"}"#), true),
    );
    let end = d.wait_for(WS, &id, 30, "root settled", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"].is_string())
    });
    let detail = check(
        "get",
        SESSION,
        send(&d, "GET", &format!("{base}/{id}"), None, true),
    );
    assert_eq!(detail, end);
    assert_eq!(detail["childSessions"].as_array().map(Vec::len), Some(2));
    assert!(detail["toolCalls"]
        .as_array()
        .is_some_and(|a| !a.is_empty()));
    let child = detail["childSessions"][0]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    check(
        "get",
        SESSION,
        send(&d, "GET", &format!("{base}/{child}"), None, true),
    );
    let msgs = check(
        "get",
        "/v1/workspaces/{ws}/agent-sessions/{id}/messages",
        send(
            &d,
            "GET",
            &format!("{base}/{id}/messages?limit=5"),
            None,
            true,
        ),
    );
    assert!(msgs["messages"].as_array().is_some_and(|a| !a.is_empty()));
    check(
        "get",
        SESSIONS,
        send(&d, "GET", &format!("{base}?limit=1"), None, true),
    );
    check(
        "get",
        "/v1/providers",
        send(&d, "GET", "/v1/providers", None, true),
    );
    check(
        "post",
        "/v1/login-links",
        send(&d, "POST", "/v1/login-links", None, true),
    );
    check("get", "/healthz", send(&d, "GET", "/healthz", None, false));
    // A second turn, canceled (202 with the operation), then the tree deleted.
    let (_, t2) = d.submit(WS, &id, "children=1 permission=0 fail=0 late=1");
    check(
        "post",
        "/v1/workspaces/{ws}/agent-sessions/{id}/turns/{turn}/cancel",
        send(
            &d,
            "POST",
            &format!("{base}/{id}/turns/{t2}/cancel"),
            Some("{}"),
            true,
        ),
    );
    d.wait_for(WS, &id, 30, "canceled", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"] == "canceled")
    });
    // The rows so far, read before the delete: a deletion rewrites the kept rows of the tree
    // to `redacted` ones (issue 36, "deleted means gone"), which are read again at the end.
    let (_, before) = send(&d, "GET", &base, None, true);
    let before_seq = before["eventSeq"].as_u64().expect("eventSeq");
    let early = read_events(&d.addr, &d.token, "?after=0", before_seq as usize, 20);
    assert!(
        early.len() as u64 >= before_seq,
        "{} of {before_seq} rows",
        early.len()
    );
    check(
        "delete",
        SESSION,
        send(&d, "DELETE", &format!("{base}/{id}"), None, true),
    );
    // Typed errors.
    check(
        "get",
        SESSION,
        send(&d, "GET", &format!("{base}/{id}"), None, true),
    );
    check(
        "get",
        SESSION,
        send(&d, "GET", &format!("{base}/a%20b%00"), None, true),
    );
    check(
        "post",
        SESSIONS,
        send(&d, "POST", &base, Some("{nope"), true),
    );
    check(
        "post",
        SESSIONS,
        send(&d, "POST", &base, Some(r#"{"provider": "demo"}"#), false),
    );
    check(
        "get",
        SESSIONS,
        send(&d, "GET", &format!("{base}?limit=-1"), None, true),
    );
    let big = format!(r#"{{"provider": "{}"}}"#, "x".repeat(300 * 1024));
    check("post", SESSIONS, send(&d, "POST", &base, Some(&big), true));
    let media = ureq::post(&format!("http://{}{base}", d.addr))
        .set("authorization", &format!("Bearer {}", d.token))
        .set("content-type", "text/plain")
        .send_string("{}");
    let (st, v) = match media {
        Err(ureq::Error::Status(c, r)) => (c, r.into_json().unwrap_or(Value::Null)),
        other => panic!("text/plain body accepted: {:?}", other.map(|r| r.status())),
    };
    assert_eq!(st, 415);
    check("post", SESSIONS, (st, v));
    assert!(checked >= 20, "{checked} answers checked");

    // Every row of the stream so far, then the reset event of a position beyond the newest.
    let (_, list) = send(&d, "GET", &base, None, true);
    let last = list["eventSeq"].as_u64().expect("eventSeq");
    let late = read_events(
        &d.addr,
        &d.token,
        &format!("?after={before_seq}"),
        (last - before_seq) as usize,
        20,
    );
    let redacted = read_events(&d.addr, &d.token, "?after=0", last as usize, 20);
    assert!(
        redacted.len() as u64 >= last,
        "{} of {last} rows",
        redacted.len()
    );
    let rows: Vec<_> = early.iter().chain(&late).chain(&redacted).collect();
    let mut kinds = BTreeSet::new();
    for &e in &rows {
        assert_eq!(
            e.data["kind"],
            e.event.as_str(),
            "event name is the row kind"
        );
        assert_eq!(
            e.data["seq"].as_u64().map(|s| s.to_string()),
            Some(e.id.clone())
        );
        doc.validate_component(&format!("OutboxRow_{}", e.event), &e.data)
            .unwrap_or_else(|err| panic!("row {}: {err}", e.data));
        doc.validate_component(
            &format!("Event_{}", e.event),
            &json!({"event": e.event, "id": e.id, "data": e.data.to_string()}),
        )
        .unwrap();
        kinds.insert(e.event.clone());
    }
    for k in [
        "session",
        "turn",
        "message",
        "interaction",
        "toolCall",
        "cancelOperation",
        "sessionDeleted",
        "redacted",
    ] {
        assert!(kinds.contains(k), "a {k} row was seen: {kinds:?}");
    }
    let reset = read_events(&d.addr, &d.token, "?after=999999999", 1, 10);
    assert_eq!(reset.len(), 1);
    assert_eq!(reset[0].event, "reset");
    doc.validate_component("ResetEvent", &reset[0].data)
        .unwrap();
    // A row whose payload lost a required field does not validate (the check has teeth).
    let mut broken = rows[0].data.clone();
    if let Some(p) = broken["payload"].as_object_mut() {
        p.remove("createdAt");
    }
    assert!(doc
        .validate_component(&format!("OutboxRow_{}", rows[0].event), &broken)
        .is_err());
}

/// The pinned API fuzzer (PyPI), installed into `.providers/schemathesis` on first use, with
/// the pinned OpenAPI 3.1 validator that checks the document first.
const SCHEMATHESIS: &str = "schemathesis==4.32.5";
const SPEC_VALIDATOR: &str = "openapi-spec-validator==0.7.2";

#[test]
fn schemathesis_finds_nothing_against_a_live_daemon_and_rejected_requests_write_nothing() {
    let venv =
        tutti_tests::providers::ensure_pip_venv("schemathesis", &[SCHEMATHESIS, SPEC_VALIDATOR])
            .expect("install schemathesis");
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let (_, doc) = send(&d, "GET", "/v1/openapi.json", None, true);
    let dir = d.dir.path();
    let doc_path = dir.join("openapi.json");
    std::fs::write(&doc_path, doc.to_string()).expect("write document");
    // The document is valid OpenAPI 3.1 (the validator's own copy of the 3.1 schema).
    let valid = std::process::Command::new(venv.join("bin/openapi-spec-validator"))
        .arg(&doc_path)
        .output()
        .expect("run openapi-spec-validator");
    assert!(
        valid.status.success(),
        "the document is not valid OpenAPI 3.1:\n{}{}",
        String::from_utf8_lossy(&valid.stdout),
        String::from_utf8_lossy(&valid.stderr)
    );
    let har = dir.join("run.har");
    // `events` is a stream that never ends while the client stays: a request/response fuzzer
    // cannot read it to the end (its rows are validated by the test above).
    let out = std::process::Command::new(venv.join("bin/st"))
        .arg("run")
        .arg(&doc_path)
        .args(["--url", &format!("http://{}", d.addr)])
        .args(["-H", &format!("Authorization: Bearer {}", d.token)])
        .args([
            "--checks",
            "not_a_server_error,response_schema_conformance,status_code_conformance",
            "--max-examples",
            "6",
            "--max-time",
            "40",
            "--request-timeout",
            "10",
            "--exclude-operation-id",
            "events",
            "--seed",
            "31",
            "--workers",
            "1",
            "--no-color",
            "--report",
            "har",
        ])
        .arg("--report-har-path")
        .arg(&har)
        .env("SCHEMATHESIS_TELEMETRY", "false")
        .current_dir(dir)
        .output()
        .expect("run schemathesis");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis found problems:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("13 selected"),
        "every operation but events ran:\n{stdout}"
    );

    // Every session in the store was created by a 2xx answer (a child: under a root that
    // was); every user turn by a 2xx submit. Nothing a rejected request sent was written.
    let har: Value =
        serde_json::from_str(&std::fs::read_to_string(&har).expect("HAR")).expect("HAR is JSON");
    let (mut created, mut submitted, mut rejected) = (BTreeSet::new(), BTreeSet::new(), 0usize);
    for e in har["log"]["entries"].as_array().expect("entries") {
        let status = e["response"]["status"].as_u64().unwrap_or(0);
        let body: Value = e["response"]["content"]["text"]
            .as_str()
            .and_then(|t| serde_json::from_str(t).ok())
            .unwrap_or(Value::Null);
        if !(200..300).contains(&status) {
            rejected += 1;
            continue;
        }
        if let Some(id) = body["session"]["id"].as_str() {
            created.insert(id.to_string());
        }
        if let Some(t) = body["turnId"].as_str() {
            submitted.insert(t.to_string());
        }
    }
    assert!(
        rejected > 100,
        "the fuzzer sent refused requests: {rejected}"
    );
    assert!(!created.is_empty(), "the fuzzer created sessions");
    let db = rusqlite::Connection::open(d.db()).expect("open db");
    let sessions: Vec<(String, String, Option<String>)> = db
        .prepare("SELECT id, kind, root_agent_session_id FROM sessions")
        .and_then(|mut s| {
            s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
                .collect()
        })
        .expect("sessions");
    for (id, kind, root) in &sessions {
        let owner = if kind == "root" {
            id
        } else {
            root.as_ref().expect("child root")
        };
        assert!(
            created.contains(owner),
            "session {id} ({kind}) was not created by a 2xx"
        );
    }
    let turns: Vec<String> = db
        .prepare("SELECT json FROM turns")
        .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
        .expect("turns");
    for t in turns {
        let t: Value = serde_json::from_str(&t).expect("turn json");
        if t["trigger"] == "user" {
            let id = t["id"].as_str().unwrap_or_default();
            assert!(
                submitted.contains(id),
                "user turn {id} was not submitted by a 2xx"
            );
        }
    }
}

/// The pinned TypeScript generator and compiler (npm), installed into `.providers/`.
const OPENAPI_TYPESCRIPT: &str = "7.13.0";
const TYPESCRIPT: &str = "5.9.3";

fn run_ok(cmd: &mut std::process::Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn a_typescript_client_generated_from_the_document_compiles_and_runs() {
    use tutti_tests::providers::ensure_npm_package;
    let gen = ensure_npm_package(
        "openapi-typescript",
        &format!("openapi-typescript@{OPENAPI_TYPESCRIPT}"),
        &[("openapi-typescript", OPENAPI_TYPESCRIPT)],
        &["node_modules/openapi-typescript/bin/cli.js"],
    )
    .expect("install openapi-typescript");
    let tsc = ensure_npm_package(
        "typescript",
        &format!("typescript@{TYPESCRIPT}"),
        &[("typescript", TYPESCRIPT)],
        &["node_modules/typescript/bin/tsc"],
    )
    .expect("install typescript");
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let (_, doc) = send(&d, "GET", "/v1/openapi.json", None, true);
    let dir = d.dir.path().join("ts");
    std::fs::create_dir_all(&dir).expect("ts dir");
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ts");
    for f in ["client.ts", "tsconfig.json"] {
        std::fs::copy(src.join(f), dir.join(f)).expect("copy client");
    }
    std::fs::write(dir.join("openapi.json"), doc.to_string()).expect("write document");
    run_ok(
        std::process::Command::new("node")
            .arg(gen.join("node_modules/openapi-typescript/bin/cli.js"))
            // A request field with a default is optional to the client (the generator's own
            // default makes it required, as for an answer).
            .args([
                "openapi.json",
                "-o",
                "api.ts",
                "--default-non-nullable=false",
            ])
            .current_dir(&dir),
        "openapi-typescript",
    );
    let api = std::fs::read_to_string(dir.join("api.ts")).expect("api.ts");
    assert!(
        api.contains("childSessions"),
        "the generated types know the detail"
    );
    run_ok(
        std::process::Command::new("node")
            .arg(tsc.join("node_modules/typescript/bin/tsc"))
            .args(["-p", ".", "--outDir", "out"])
            .current_dir(&dir),
        "tsc",
    );
    let stdout = run_ok(
        std::process::Command::new("node")
            .arg("out/client.js")
            .env("TUTTI_URL", format!("http://{}", d.addr))
            .env("TUTTI_TOKEN", &d.token)
            .current_dir(&dir),
        "node client",
    );
    let got: Value = serde_json::from_str(stdout.trim()).expect("the client prints JSON");
    let id = got["session"].as_str().expect("session id");
    assert_eq!(got["reply"], "started");
    assert_eq!(got["outcome"], "completed");
    let children = got["children"].as_array().expect("children");
    assert_eq!(children.len(), 2, "{got}");
    for c in children {
        assert_eq!(c["kind"], "child");
        assert_eq!(c["parent"], id);
    }
    let detail = d.detail("ts", id);
    assert_eq!(detail["childSessions"].as_array().map(Vec::len), Some(2));
    let rows = got["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 5);
    assert_eq!(rows[0]["seq"], 1);
    assert_eq!(rows[0]["kind"], "session");
    // The types have teeth: a client using a field the document does not have is refused.
    let bad = std::fs::read_to_string(dir.join("client.ts"))
        .expect("client")
        .replace("detail.childSessions.map", "detail.children.map");
    std::fs::write(dir.join("client.ts"), bad).expect("write");
    let out = std::process::Command::new("node")
        .arg(tsc.join("node_modules/typescript/bin/tsc"))
        .args(["-p", ".", "--noEmit"])
        .current_dir(&dir)
        .output()
        .expect("tsc");
    assert!(!out.status.success(), "tsc refuses an unknown field");
    assert!(String::from_utf8_lossy(&out.stdout).contains("children"));
}
