//! Issue 22: operators can see inside the daemon. A real `tuttid` process with a real SQLite
//! file and the real demo ACP agent: `/metrics` is scraped while a tree runs and after it
//! settles, its text is checked strictly, `X-Request-Id` is echoed, and `tutti status` prints
//! the figures.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::process::Command;
use tutti_tests::daemon::{turn_of, TestDaemon};
use tutti_tokio::status::{parse, value, Sample};

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const TUTTI: &str = env!("CARGO_BIN_EXE_tutti-test");
const WS: &str = "w1";
const PROMPT: &str = "children=2 hang=1,2 late=1,2 permission=0 fail=0";

/// `GET /metrics` with the token; the text.
fn scrape(d: &TestDaemon) -> String {
    let r = ureq::get(&format!("http://{}/metrics", d.addr))
        .set("authorization", &format!("Bearer {}", d.token))
        .call()
        .expect("metrics");
    assert!(
        r.content_type().contains("openmetrics-text"),
        "{}",
        r.content_type()
    );
    r.into_string().expect("metrics text")
}

/// A strict check of the OpenMetrics text exposition: every line is `# HELP`, `# TYPE`,
/// `# UNIT` or a sample of a declared family (by its type's suffixes), values are numbers,
/// and the text ends with `# EOF`. Returns the samples.
fn strict(text: &str) -> Vec<Sample> {
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.last(), Some(&"# EOF"), "ends with # EOF");
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    for line in &lines[..lines.len() - 1] {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (what, name) = (parts.next().unwrap(), parts.next().expect("a family name"));
            assert!(
                name.starts_with("tutti_"),
                "family {name} has the tutti_ prefix"
            );
            match what {
                "TYPE" => {
                    let t = parts.next().expect("a type").to_string();
                    assert!(
                        ["counter", "gauge", "histogram", "info"].contains(&t.as_str()),
                        "{line}"
                    );
                    assert!(types.insert(name.to_string(), t).is_none(), "{name} twice");
                }
                "HELP" | "UNIT" => assert!(parts.next().is_some_and(|h| !h.is_empty())),
                _ => panic!("unknown comment {line}"),
            }
            continue;
        }
        let one = parse(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        assert_eq!(one.len(), 1, "{line}");
        let name = &one[0].name;
        let family = types
            .iter()
            .find(|(f, t)| {
                let suffixes: &[&str] = match t.as_str() {
                    "counter" => &["_total", "_created"],
                    "histogram" => &["_bucket", "_count", "_sum", "_created"],
                    _ => &[""],
                };
                suffixes.iter().any(|s| *name == format!("{f}{s}"))
            })
            .unwrap_or_else(|| panic!("sample {name} of no declared family"));
        if family.1 == "counter" {
            assert!(name.ends_with("_total"), "counter {name} ends with _total");
        }
        assert!(one[0].value.is_finite() || name.ends_with("_bucket"));
    }
    parse(text).expect("parses")
}

fn v(s: &[Sample], name: &str, with: &[(&str, &str)]) -> f64 {
    value(s, name, with)
}

/// No label value carries an id or the prompt.
fn no_ids_or_content(samples: &[Sample], text: &str, forbidden: &[&str]) {
    for f in forbidden {
        assert!(!text.contains(f), "the exposition contains {f}");
    }
    for s in samples {
        for (k, val) in &s.labels {
            for f in forbidden {
                assert!(!val.contains(f), "{}{{{k}={val}}} contains {f}", s.name);
            }
        }
    }
}

fn status(d: &TestDaemon) -> String {
    let out = Command::new(TUTTI)
        .args(["--addr", &d.addr, "--token-file"])
        .arg(d.dir.path().join("token"))
        .arg("status")
        .output()
        .expect("tutti status");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Opens `GET /v1/events` and keeps it open (a live follower) once its headers arrived.
fn follower(d: &TestDaemon) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(&d.addr).expect("connect");
    write!(
        s,
        "GET /v1/events HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\n\r\n",
        d.addr, d.token
    )
    .expect("request");
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut b).expect("response head");
        head.push(b[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s
}

#[test]
fn metrics_move_with_a_running_tree_and_count_its_cancel_by_result() {
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "4")]);
    let before = strict(&scrape(&d));
    assert_eq!(v(&before, "tutti_live_trees", &[]), 0.0);
    assert_eq!(v(&before, "tutti_active_child_turns", &[]), 0.0);
    assert_eq!(v(&before, "tutti_cancel_operations_total", &[]), 0.0);

    let id = d.create(WS, "demo");
    let (_, turn) = d.submit(WS, &id, PROMPT);
    // The root's provider turn answers while both children keep working (background, hanging).
    let running = d.wait_for(WS, &id, 60, "root waiting on two children", |v| {
        v["childSessions"].as_array().is_some_and(|a| a.len() == 2)
            && turn_of(v, &id).is_some_and(|t| t["phase"] == "waiting")
            && v["childSessions"].as_array().unwrap().iter().all(|c| {
                turn_of(v, c["id"].as_str().unwrap()).is_some_and(|t| t["phase"] == "running")
            })
    });
    let stream = follower(&d);
    let text = scrape(&d);
    let m = strict(&text);
    assert_eq!(v(&m, "tutti_live_trees", &[]), 1.0, "{text}");
    assert_eq!(v(&m, "tutti_active_child_turns", &[]), 2.0, "{text}");
    assert_eq!(v(&m, "tutti_root_turns_waiting_on_children", &[]), 1.0);
    assert_eq!(
        v(&m, "tutti_active_root_turns", &[("phase", "waiting")]),
        1.0
    );
    assert_eq!(
        v(&m, "tutti_provider_processes", &[("provider", "demo")]),
        1.0
    );
    assert_eq!(
        v(
            &m,
            "tutti_provider_process_starts_total",
            &[("provider", "demo")]
        ),
        1.0
    );
    assert_eq!(v(&m, "tutti_sse_followers", &[]), 1.0, "{text}");
    assert!(v(&m, "tutti_outbox_head_seq", &[]) > 0.0);
    assert_eq!(
        v(
            &m,
            "tutti_inputs_total",
            &[("kind", "submit"), ("result", "applied")]
        ),
        1.0
    );
    assert_eq!(
        v(&m, "tutti_provider_requests_total", &[("kind", "start")]),
        1.0
    );
    assert!(v(&m, "tutti_group_commit_seconds_count", &[]) > 0.0);
    assert!(v(&m, "tutti_provider_line_to_commit_seconds_count", &[]) > 0.0);
    // Issue 33, "where the time goes": every stage of the provider line's path has a series,
    // and the demo agent's lines (ACP `session/update`s, read by the transport's line reader)
    // were timed as parsed, decided and committed.
    for stage in ["parse", "decide", "commit"] {
        assert!(
            v(&m, "tutti_stage_seconds_total", &[("stage", stage)]) > 0.0,
            "stage {stage}: {text}"
        );
    }
    for stage in ["publish", "stream"] {
        assert!(
            text.contains(&format!("tutti_stage_seconds_total{{stage=\"{stage}\"}}")),
            "stage {stage}: {text}"
        );
    }
    let mut forbidden: Vec<String> = vec![id.clone(), turn.clone(), "hang=".into()];
    for c in running["childSessions"].as_array().unwrap() {
        forbidden.push(c["id"].as_str().unwrap().to_string());
    }
    let forbidden: Vec<&str> = forbidden.iter().map(String::as_str).collect();
    no_ids_or_content(&m, &text, &forbidden);

    let shown = status(&d);
    assert!(shown.contains("live trees      1 "), "{shown}");
    assert!(shown.contains("waiting roots   1 "), "{shown}");
    assert!(shown.contains("processes       demo 1"), "{shown}");
    assert!(shown.contains(&d.db().display().to_string()), "{shown}");
    assert!(shown.contains("followers       1;"), "{shown}");

    // A wrong kind of input is counted as rejected with its code.
    let (st, _) = d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/t_nope/cancel"),
        Some(serde_json::json!({})),
    );
    assert_eq!(st, 404);
    let (st, body) = d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/{turn}/cancel"),
        Some(serde_json::json!({})),
    );
    assert!(st < 300, "cancel: {body}");
    d.wait_for(WS, &id, 60, "tree settled", |v| {
        v["session"].get("activeTurnId").is_none()
            && v["childSessions"].as_array().unwrap().iter().all(|c| {
                turn_of(v, c["id"].as_str().unwrap()).is_some_and(|t| t["phase"] == "settled")
            })
    });
    drop(stream);
    let text = scrape(&d);
    let m = strict(&text);
    assert_eq!(v(&m, "tutti_live_trees", &[]), 0.0, "{text}");
    assert_eq!(v(&m, "tutti_active_child_turns", &[]), 0.0, "{text}");
    assert_eq!(v(&m, "tutti_root_turns_waiting_on_children", &[]), 0.0);
    assert_eq!(v(&m, "tutti_active_root_turns", &[]), 0.0);
    assert_eq!(
        v(
            &m,
            "tutti_cancel_operations_total",
            &[("result", "confirmed")]
        ),
        1.0,
        "{text}"
    );
    assert_eq!(v(&m, "tutti_cancel_operations_total", &[]), 1.0);
    assert_eq!(v(&m, "tutti_cancel_settle_seconds_count", &[]), 1.0);
    assert_eq!(
        v(&m, "tutti_root_waiting_on_children_seconds_count", &[]),
        1.0
    );
    assert_eq!(
        v(
            &m,
            "tutti_inputs_total",
            &[("kind", "cancelTurn"), ("result", "applied")]
        ),
        1.0
    );
    assert_eq!(
        v(
            &m,
            "tutti_inputs_total",
            &[
                ("kind", "cancelTurn"),
                ("result", "rejected"),
                ("reason", "not_found")
            ]
        ),
        1.0,
        "{text}"
    );
    assert_eq!(v(&m, "tutti_commit_failures_total", &[]), 0.0);
    no_ids_or_content(&m, &text, &forbidden);
    let shown = status(&d);
    assert!(shown.contains("live trees      0 "), "{shown}");
    assert!(shown.contains("cancels         confirmed 1"), "{shown}");
}

#[test]
fn metrics_need_the_token_and_request_ids_are_echoed() {
    let d = TestDaemon::start(EXE, None, &[]);
    match ureq::get(&format!("http://{}/metrics", d.addr)).call() {
        Err(ureq::Error::Status(401, _)) => {}
        other => panic!("metrics without the token: {other:?}"),
    }
    let r = ureq::get(&format!("http://{}/healthz", d.addr))
        .set("x-request-id", "ops-check-42")
        .call()
        .expect("healthz");
    assert_eq!(r.header("x-request-id"), Some("ops-check-42"));
    let health: serde_json::Value = r.into_json().expect("json");
    assert_eq!(health["version"], env!("CARGO_PKG_VERSION"));
    // Generated when absent, distinct per request, also on errors.
    let ids: Vec<String> = (0..2)
        .map(
            |_| match ureq::get(&format!("http://{}/v1/nothing", d.addr)).call() {
                Err(ureq::Error::Status(_, r)) => r.header("x-request-id").expect("id").to_string(),
                Ok(r) => r.header("x-request-id").expect("id").to_string(),
                Err(e) => panic!("{e}"),
            },
        )
        .collect();
    assert!(!ids[0].is_empty());
    assert_ne!(ids[0], ids[1]);
    // An unusable id (control characters) is replaced.
    let r = ureq::get(&format!("http://{}/healthz", d.addr))
        .set("x-request-id", "a b")
        .call()
        .expect("healthz");
    assert_ne!(r.header("x-request-id"), Some("a b"));
}

#[test]
fn metrics_listen_serves_without_auth_on_loopback_only() {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = |_: ()| {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("port")
    };
    let mut refused = Command::new(EXE)
        .args(["serve", "--listen", &format!("127.0.0.1:{}", port(()))])
        .args(["--metrics-listen", &format!("0.0.0.0:{}", port(()))])
        .arg("--db")
        .arg(dir.path().join("a.db"))
        .arg("--token-file")
        .arg(dir.path().join("token"))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("tuttid");
    // A daemon that does not refuse keeps serving: it is ended and the test fails.
    let mut exited = None;
    for _ in 0..400 {
        if let Ok(Some(st)) = refused.try_wait() {
            exited = Some(st);
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    if exited.is_none() {
        let _ = refused.kill();
        let _ = refused.wait();
    }
    let mut err = String::new();
    if let Some(mut e) = refused.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    assert!(
        exited.is_some_and(|s| !s.success()),
        "a non-loopback metrics address is refused: {err}"
    );
    assert!(err.contains("not a loopback address"), "{err}");

    let maddr = format!("127.0.0.1:{}", port(()));
    let mut child = Command::new(EXE)
        .args(["serve", "--listen", &format!("127.0.0.1:{}", port(()))])
        .args(["--metrics-listen", &maddr])
        .arg("--db")
        .arg(dir.path().join("b.db"))
        .arg("--token-file")
        .arg(dir.path().join("token"))
        .env("TUTTI_LOG", "warn")
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("tuttid");
    let mut text = None;
    for _ in 0..400 {
        if let Ok(r) = ureq::get(&format!("http://{maddr}/metrics")).call() {
            text = Some(r.into_string().expect("text"));
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    let text = text.expect("metrics on their own listener without auth");
    let m = strict(&text);
    assert_eq!(v(&m, "tutti_live_trees", &[]), 0.0);
}
