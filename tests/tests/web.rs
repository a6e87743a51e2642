//! The web view (issue 20) in a real headless Chromium over WebDriver, against a real `tuttid`
//! running the real demo ACP agent: lanes nested under their delegation cards, the root waiting
//! for its children, answering a child's permission, cancel, catch-up after a daemon restart,
//! and the cookie login. Screenshots (PNG) go to `$CARGO_TARGET_TMPDIR/web-screenshots/`.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;
use tutti_tests::browser::{Browser, ENTER, TAB};
use tutti_tests::daemon::{children, turn_of, TestDaemon};

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const WS: &str = "web";

fn screenshots() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("web-screenshots")
}

fn daemon() -> TestDaemon {
    TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "4")])
}

/// Signs the browser in through a fresh one-time link (issued with the bearer token) and waits
/// for the sessions page.
fn sign_in(b: &Browser, d: &TestDaemon) {
    let (st, v) = d.call("POST", "/v1/login-links", Some(json!({})));
    assert_eq!(st, 200, "{v}");
    let path = v["path"].as_str().expect("path");
    b.goto(&format!("http://{}{path}&ws={WS}", d.addr));
    b.wait(
        "the sessions page after login",
        20,
        "const h = document.querySelector('h1'); return h && h.textContent === arguments[0]",
        vec![json!(format!("Sessions in {WS}"))],
    );
}

fn open(b: &Browser, d: &TestDaemon, id: &str) {
    b.goto(&format!("http://{}/#/w/{WS}/s/{id}", d.addr));
    b.wait(
        "the session page",
        20,
        "const t = document.getElementById('transcript'); return t && t.querySelector('ol.transcript')",
        vec![],
    );
}

/// `data-state` of the lane of child session `id` (null when no such lane).
const LANE_STATE: &str = "const l = [...document.querySelectorAll('details.lane')]
    .find(e => e.dataset.sessionId === arguments[0]); return l ? l.dataset.state : null";

/// The `data-state` of every lane, by session id, and how often each lane appears.
const LANES: &str = "const out = {}; for (const l of document.querySelectorAll('details.lane')) {
    const o = out[l.dataset.sessionId] || {state: l.dataset.state, count: 0}; o.count += 1;
    out[l.dataset.sessionId] = o; } return out";

fn child_by_title<'a>(detail: &'a Value, title: &str) -> &'a Value {
    detail["childSessions"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["title"] == title))
        .unwrap_or_else(|| panic!("no child {title}: {detail:#}"))
}

fn messages(d: &TestDaemon, id: &str) -> Vec<Value> {
    let (st, v) = d.call(
        "GET",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/messages?limit=1000"),
        None,
    );
    assert_eq!(st, 200, "{v}");
    v["messages"].as_array().cloned().unwrap_or_default()
}

/// Message seqs rendered in the transcript of session `id` (its own rows only, not those of
/// lanes nested in it).
fn rendered_seqs(b: &Browser, id: &str) -> Vec<u64> {
    let v = b.js(
        "const ol = [...document.querySelectorAll('ol.transcript')]
            .find(e => e.dataset.sessionId === arguments[0]);
         if (!ol) return null;
         return [...ol.querySelectorAll('.msg')].filter(m => m.closest('ol.transcript') === ol)
            .map(m => Number(m.dataset.messageSeq))",
        vec![json!(id)],
    );
    v.as_array()
        .unwrap_or_else(|| panic!("no transcript for {id}"))
        .iter()
        .filter_map(Value::as_u64)
        .collect()
}

#[test]
fn web_lanes_nest_under_their_delegation_cards_and_the_root_waits_for_its_children() {
    let d = daemon();
    let b = Browser::start(1200, 1000);
    sign_in(&b, &d);
    let root = d.create(WS, "demo");
    // Child 1 delegates to a grandchild; child 2 runs in the background until canceled, so the
    // root provider turn ends while a child still runs.
    d.submit(
        WS,
        &root,
        "children=2 nested=1 late=2 hang=2 permission=0 fail=0",
    );
    let detail = d.wait_for(WS, &root, 60, "root waiting on child 2", |v| {
        let kids = children(v);
        kids.len() == 3
            && turn_of(v, &root).is_some_and(|t| {
                t["phase"] == "waiting" && t["rootProviderTurn"]["phase"] == "completed"
            })
            && kids.iter().filter(|c| c["title"] != "tester").all(|c| {
                turn_of(v, c["id"].as_str().unwrap_or_default())
                    .is_some_and(|t| t["outcome"] == "completed")
            })
    });
    open(&b, &d, &root);
    let c1 = child_by_title(&detail, "explorer");
    let c2 = child_by_title(&detail, "tester");
    let gc = children(&detail)
        .into_iter()
        .find(|c| c["parentAgentSessionId"] == c1["id"])
        .expect("a grandchild under child 1");
    // The root shows why it is still active.
    let status = b.wait(
        "the root waiting on one child",
        30,
        "const s = document.getElementById('root-status');
         return s && s.dataset.state === 'waiting' ? s.textContent : null",
        vec![],
    );
    let status = status.as_str().unwrap_or_default();
    assert!(
        status.contains("root provider turn ended") && status.contains("1 child still running"),
        "{status}"
    );
    b.wait(
        "every lane rendered",
        20,
        "return document.querySelectorAll('details.lane').length === 3",
        vec![],
    );
    // Child 1's lane sits under its delegation card in the root transcript; the grandchild's
    // lane under the card of child 1's own delegation tool call, inside child 1's lane.
    let placement = b.js(
        "const lane = id => [...document.querySelectorAll('details.lane')]
            .find(e => e.dataset.sessionId === id);
         const where = id => { const l = lane(id); const card = l.parentElement.closest('section.card');
            const owner = card.closest('ol.transcript'); const outer = owner.closest('details.lane');
            return {card: card.dataset.toolCallId, transcript: owner.dataset.sessionId,
                    inLane: outer ? outer.dataset.sessionId : null}; };
         return {c1: where(arguments[0]), c2: where(arguments[1]), gc: where(arguments[2])}",
        vec![c1["id"].clone(), c2["id"].clone(), gc["id"].clone()],
    );
    assert_eq!(
        placement["c1"]["card"], c1["parentToolCallId"],
        "{placement}"
    );
    assert_eq!(placement["c1"]["transcript"], json!(root), "{placement}");
    assert_eq!(placement["c1"]["inLane"], Value::Null, "{placement}");
    assert_eq!(
        placement["c2"]["card"], c2["parentToolCallId"],
        "{placement}"
    );
    assert_eq!(placement["c2"]["transcript"], json!(root), "{placement}");
    assert_eq!(
        placement["gc"]["card"], gc["parentToolCallId"],
        "{placement}"
    );
    assert_eq!(placement["gc"]["transcript"], c1["id"], "{placement}");
    assert_eq!(placement["gc"]["inLane"], c1["id"], "{placement}");
    // Lane states come from each child's own turn; child 2's spawn tool call completed (the
    // background delegation was accepted) but its lane still runs.
    let spawn = detail["toolCalls"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["toolCallId"] == c2["parentToolCallId"]))
        .expect("child 2's spawn tool call");
    assert_eq!(spawn["status"], "completed", "{spawn}");
    assert_eq!(b.js(LANE_STATE, vec![c2["id"].clone()]), "running");
    assert_eq!(b.js(LANE_STATE, vec![c1["id"].clone()]), "completed");
    assert_eq!(b.js(LANE_STATE, vec![gc["id"].clone()]), "completed");
    // Root rows stay root-only; each lane holds its own session's messages.
    for id in [json!(root), c1["id"].clone(), gc["id"].clone()] {
        let id = id.as_str().unwrap_or_default().to_string();
        let want: Vec<u64> = messages(&d, &id)
            .iter()
            .filter_map(|m| m["seq"].as_u64())
            .collect();
        assert!(!want.is_empty(), "{id} has messages");
        b.wait(
            "the lane's messages",
            20,
            "const ol = [...document.querySelectorAll('ol.transcript')]
                .find(e => e.dataset.sessionId === arguments[0]);
             return ol && [...ol.querySelectorAll('.msg')]
                .filter(m => m.closest('ol.transcript') === ol).length === arguments[1]",
            vec![json!(id), json!(want.len())],
        );
        assert_eq!(rendered_seqs(&b, &id), want, "messages of {id}");
    }
    // The whole page in one picture: the window as tall as the document.
    let height = b
        .js("return document.documentElement.scrollHeight", vec![])
        .as_u64()
        .unwrap_or(1000);
    b.window(
        1200,
        u32::try_from(height.clamp(600, 4000)).unwrap_or(4000) + 120,
    );
    b.screenshot(&screenshots().join("session-nested-lanes.png"));
    b.window(1200, 1000);
    // The sessions page: the root is listed (its children are not) as waiting on one child.
    b.goto(&format!("http://{}/#/w/{WS}", d.addr));
    let row = b.wait(
        "the root listed as waiting",
        20,
        "const li = [...document.querySelectorAll('ul.sessions li')]
            .find(e => e.dataset.sessionId === arguments[0]);
         const s = li && li.querySelector('.state');
         return s && s.dataset.state === 'waiting' ? s.textContent : null",
        vec![json!(root)],
    );
    assert_eq!(row, "‖ waiting on 1 child");
    let listed = b.js(
        "return [...document.querySelectorAll('ul.sessions li')].map(e => e.dataset.sessionId)",
        vec![],
    );
    assert_eq!(listed, json!([root]), "roots only");
    b.screenshot(&screenshots().join("sessions.png"));
    // A submit while the root turn is active is guidance for the same turn, never a new turn.
    open(&b, &d, &root);
    b.wait(
        "the guidance composer",
        20,
        "const s = document.getElementById('send'); return s && s.textContent === 'Send guidance'",
        vec![],
    );
    b.keys("#composer-text", "please also check the tests");
    b.click("#send");
    let notice = b.wait(
        "the guidance notice",
        20,
        "const n = document.getElementById('notice'); return n && !n.hidden && n.textContent",
        vec![],
    );
    let notice = notice.as_str().unwrap_or_default();
    assert!(
        notice == "Appended to the running turn as guidance."
            || notice.starts_with("Pending: this provider cannot take guidance now"),
        "{notice}"
    );
    let after = d.detail(WS, &root);
    assert_eq!(
        after["session"]["lastTurnId"], detail["session"]["lastTurnId"],
        "no new root turn"
    );
}

#[test]
fn web_approving_a_permission_in_a_child_lane_lets_that_child_finish() {
    let d = daemon();
    // 400 px wide, operated with the keyboard.
    let b = Browser::start(400, 900);
    sign_in(&b, &d);
    let root = d.create(WS, "demo");
    // Child 1 fails: its lane shows the error while the root still completes.
    d.submit(WS, &root, "children=2 permission=2 fail=1 late=0 nested=0");
    let detail = d.wait_for(WS, &root, 60, "child 2's permission request", |v| {
        v["interactions"]
            .as_array()
            .is_some_and(|a| a.iter().any(|i| i["status"] == "pending"))
    });
    let i = detail["interactions"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["status"] == "pending"))
        .expect("pending interaction")
        .clone();
    let c2 = child_by_title(&detail, "tester");
    assert_eq!(i["agentSessionId"], c2["id"]);
    open(&b, &d, &root);
    let routed = b.wait(
        "the permission buttons in child 2's lane",
        30,
        "const box = document.querySelector('.interaction');
         if (!box) return null;
         return {lane: box.closest('details.lane').dataset.sessionId,
                 session: box.dataset.sessionId, turn: box.dataset.turnId,
                 request: box.dataset.requestId,
                 options: [...box.querySelectorAll('button')].map(x => x.dataset.optionId)}",
        vec![],
    );
    assert_eq!(routed["lane"], c2["id"], "{routed}");
    assert_eq!(routed["session"], i["agentSessionId"], "{routed}");
    assert_eq!(routed["turn"], i["turnId"], "{routed}");
    assert_eq!(routed["request"], i["requestId"], "{routed}");
    assert_eq!(routed["options"], json!(["allow", "reject"]), "{routed}");
    assert_eq!(b.js(LANE_STATE, vec![c2["id"].clone()]), "waiting");
    // Nothing is wider than the 400 px window.
    assert_eq!(b.js("return window.innerWidth", vec![]), 400);
    let wide = b.js(
        "const w = document.documentElement.clientWidth;
         return [...document.querySelectorAll('body *')]
            .filter(e => e.getBoundingClientRect().right > w + 0.5)
            .map(e => `${e.tagName}.${e.className}#${e.id}`)",
        vec![],
    );
    assert_eq!(wide, json!([]), "elements wider than the 400 px window");
    b.js(
        "document.querySelector('.interaction').scrollIntoView({block: 'center'})",
        vec![],
    );
    b.screenshot(&screenshots().join("session-400px-permission.png"));
    b.keys(".interaction button[data-option-id='allow']", ENTER);
    b.wait(
        "child 2's lane completed",
        60,
        "const l = [...document.querySelectorAll('details.lane')]
            .find(e => e.dataset.sessionId === arguments[0]);
         return l && l.dataset.state === 'completed'",
        vec![c2["id"].clone()],
    );
    let end = d.wait_for(WS, &root, 60, "root settled", |v| {
        v["session"].get("activeTurnId").is_none()
    });
    let t2 = turn_of(&end, c2["id"].as_str().unwrap_or_default()).expect("child 2 turn");
    assert_eq!(t2["outcome"], "completed", "{t2}");
    let answered = end["interactions"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["requestId"] == i["requestId"]))
        .cloned()
        .unwrap_or(Value::Null);
    assert_ne!(answered["status"], "pending", "{answered}");
    b.wait(
        "the root idle",
        30,
        "const s = document.getElementById('root-status'); return s && s.dataset.state === 'idle'",
        vec![],
    );
    assert_eq!(
        turn_of(&end, &root).expect("root turn")["outcome"],
        "completed"
    );
    let c1 = child_by_title(&end, "explorer");
    let t1 = turn_of(&end, c1["id"].as_str().unwrap_or_default()).expect("child 1 turn");
    assert_eq!(t1["outcome"], "failed", "{t1}");
    let shown = b.js(
        "const l = [...document.querySelectorAll('details.lane')]
            .find(e => e.dataset.sessionId === arguments[0]);
         const e = l && l.querySelector('.lane-error');
         return l ? {state: l.dataset.state, error: e ? e.textContent : null} : null",
        vec![c1["id"].clone()],
    );
    assert_eq!(shown["state"], "failed", "{shown}");
    assert_eq!(
        shown["error"],
        json!(format!(
            "Error: {}",
            t1["error"].as_str().unwrap_or_default()
        )),
        "{shown}"
    );
    let root_status = b.js(
        "return document.getElementById('root-status').textContent",
        vec![],
    );
    assert_eq!(root_status, "Idle. The last turn completed.");
}

#[test]
fn web_cancel_settles_every_lane() {
    let d = daemon();
    let b = Browser::start(1000, 900);
    sign_in(&b, &d);
    let root = d.create(WS, "demo");
    d.submit(
        WS,
        &root,
        "children=2 hang=1,2 nested=1 permission=0 fail=0 late=0",
    );
    d.wait_for(WS, &root, 60, "three children running", |v| {
        children(v).len() == 3
    });
    open(&b, &d, &root);
    b.wait(
        "three running lanes",
        30,
        "const l = [...document.querySelectorAll('details.lane')];
         return l.length === 3 && l.every(e => e.dataset.state === 'running')",
        vec![],
    );
    b.click("#cancel");
    let lanes = b.wait(
        "every lane settled",
        60,
        "const l = [...document.querySelectorAll('details.lane')];
         const s = document.getElementById('root-status');
         if (s.dataset.state !== 'idle') return null;
         if (!l.every(e => e.dataset.state === 'canceled' || e.dataset.state === 'interrupted'))
            return null;
         return l.map(e => [e.dataset.sessionId, e.dataset.state])",
        vec![],
    );
    let end = d.detail(WS, &root);
    let kids = children(&end);
    assert_eq!(lanes.as_array().map(Vec::len), Some(kids.len()));
    for pair in lanes.as_array().into_iter().flatten() {
        let t = turn_of(&end, pair[0].as_str().unwrap_or_default()).expect("child turn");
        assert_eq!(
            t["outcome"], pair[1],
            "lane shows the child turn's outcome: {t}"
        );
    }
    assert_eq!(
        turn_of(&end, &root).expect("root turn")["outcome"],
        "canceled"
    );
    // A settled session can be deleted (with its children) from the page.
    b.click("#delete");
    // The confirmation replaces the button at the page's next render, not within the click.
    b.wait(
        "the delete confirmation",
        20,
        "return document.getElementById('delete-confirm') !== null",
        vec![],
    );
    b.click("#delete-confirm");
    b.wait(
        "the sessions page without the deleted root",
        20,
        "return document.getElementById('sessions')
            && ![...document.querySelectorAll('ul.sessions li')]
                .some(e => e.dataset.sessionId === arguments[0])",
        vec![json!(root)],
    );
    let (st, v) = d.call(
        "GET",
        &format!("/v1/workspaces/{WS}/agent-sessions/{root}"),
        None,
    );
    assert_eq!(st, 404, "{v}");
}

#[test]
fn web_catches_up_after_a_daemon_restart_without_duplicates() {
    let mut d = daemon();
    let b = Browser::start(1000, 900);
    sign_in(&b, &d);
    let root = d.create(WS, "demo");
    d.submit(WS, &root, "children=2 hang=1,2 permission=0 fail=0 late=0");
    d.wait_for(WS, &root, 60, "two children running", |v| {
        children(v).len() == 2
    });
    open(&b, &d, &root);
    b.wait(
        "two running lanes, stream live",
        30,
        "const l = [...document.querySelectorAll('details.lane')];
         return document.getElementById('conn').dataset.state === 'live'
            && l.length === 2 && l.every(e => e.dataset.state === 'running')",
        vec![],
    );
    // A page reload would lose this.
    b.js("window.__sameDocument = 'yes'", vec![]);
    let connects = || {
        b.js(
            "return Number(document.getElementById('conn').dataset.connects)",
            vec![],
        )
        .as_u64()
        .unwrap_or(0)
    };
    let before = connects();
    d.restart_same_port();
    // The restart interrupts the running turns; the page learns it from the resumed stream.
    b.wait(
        "the page caught up: lanes interrupted, root idle",
        60,
        "const l = [...document.querySelectorAll('details.lane')];
         return document.getElementById('conn').dataset.state === 'live'
            && document.getElementById('root-status').dataset.state === 'idle'
            && l.length === 2 && l.every(e => e.dataset.state === 'interrupted')",
        vec![],
    );
    assert_eq!(
        b.js("return window.__sameDocument", vec![]),
        "yes",
        "no reload"
    );
    assert!(connects() > before, "the event stream was opened again");
    // Live after the restart: a new turn started from the page shows its new lane.
    b.keys(
        "#composer-text",
        "children=1 permission=0 fail=0 late=0 nested=0",
    );
    b.click("#send");
    b.wait(
        "the new turn's lane completed and the root idle",
        60,
        "const l = [...document.querySelectorAll('details.lane')];
         return document.getElementById('root-status').dataset.state === 'idle'
            && l.length === 3 && l.filter(e => e.dataset.state === 'completed').length === 1",
        vec![],
    );
    assert_eq!(
        b.js("return window.__sameDocument", vec![]),
        "yes",
        "no reload"
    );
    // No duplicates: each lane once, each message once, exactly the API's.
    let end = d.detail(WS, &root);
    let lanes = b.js(LANES, vec![]);
    let kids = children(&end);
    assert_eq!(
        lanes.as_object().map(|o| o.len()),
        Some(kids.len()),
        "{lanes}"
    );
    for c in &kids {
        let id = c["id"].as_str().unwrap_or_default();
        assert_eq!(lanes[id]["count"], 1, "lane {id} shown once: {lanes}");
        let t = turn_of(&end, id).expect("child turn");
        assert_eq!(lanes[id]["state"], t["outcome"], "lane {id}: {t}");
    }
    for id in std::iter::once(root.clone()).chain(
        kids.iter()
            .map(|c| c["id"].as_str().unwrap_or_default().to_string()),
    ) {
        let want: Vec<u64> = messages(&d, &id)
            .iter()
            .filter_map(|m| m["seq"].as_u64())
            .collect();
        assert_eq!(rendered_seqs(&b, &id), want, "messages of {id}, each once");
    }
}

#[test]
fn web_login_cookie_works_and_requests_without_it_are_refused() {
    let d = daemon();
    let b = Browser::start(1000, 800);
    let (_, v) = d.call("POST", "/v1/login-links", Some(json!({})));
    let path = v["path"].as_str().expect("path").to_string();
    b.goto(&format!("http://{}{path}&ws={WS}", d.addr));
    b.wait(
        "the sessions page",
        20,
        "const h = document.querySelector('h1'); return h && h.textContent.startsWith('Sessions in')",
        vec![],
    );
    // The code left the URL; the page cannot read the cookie; it is HttpOnly and Strict.
    let url = b.url();
    assert!(!url.contains("login="), "{url}");
    assert!(!url.contains(&d.token), "{url}");
    let page_cookies = b.js("return document.cookie", vec![]);
    assert!(
        !page_cookies.as_str().unwrap_or_default().contains(&d.token),
        "{page_cookies}"
    );
    let cookies = b.cookies();
    let c = cookies
        .iter()
        .find(|c| {
            c["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("tutti_token"))
        })
        .unwrap_or_else(|| panic!("login cookie: {cookies:?}"))
        .clone();
    assert_eq!(c["httpOnly"], true, "{c}");
    assert_eq!(c["sameSite"], "Strict", "{c}");
    // The cookie works for the page: create a session from the form.
    b.keys("#title", "from the page");
    b.click("#create");
    b.wait(
        "the new session's page",
        20,
        "return location.hash.includes('/s/') && document.getElementById('session-title')
            && document.getElementById('session-title').textContent === 'from the page'",
        vec![],
    );
    let cookie = format!(
        "{}={}",
        c["name"].as_str().unwrap_or_default(),
        c["value"].as_str().unwrap_or_default()
    );
    let base = format!("http://{}/v1/workspaces/{WS}/agent-sessions", d.addr);
    let count = || {
        let (_, v) = d.call("GET", &format!("/v1/workspaces/{WS}/agent-sessions"), None);
        v["sessions"].as_array().map_or(0, Vec::len)
    };
    assert_eq!(count(), 1);
    let post = |origin: Option<&str>, with_cookie: bool| -> u16 {
        let mut r = ureq::post(&base).timeout(Duration::from_secs(10));
        if with_cookie {
            r = r.set("cookie", &cookie);
        }
        if let Some(o) = origin {
            r = r.set("origin", o);
        }
        match r.send_json(json!({"provider": "demo"})) {
            Ok(r) => r.status(),
            Err(ureq::Error::Status(code, _)) => code,
            Err(e) => panic!("{e}"),
        }
    };
    let own = format!("http://{}", d.addr);
    // Cross-site (or Origin-less) state changes with the cookie are refused and change nothing.
    assert_eq!(post(Some("http://evil.example"), true), 403);
    assert_eq!(post(None, true), 403);
    assert_eq!(count(), 1, "nothing was created");
    // Without the cookie (and without the bearer) even a same-origin request is refused.
    assert_eq!(post(Some(&own), false), 401);
    assert_eq!(count(), 1, "nothing was created");
    assert_eq!(post(Some(&own), true), 201);
    // A page without the cookie is refused, and the used link does not sign it in again.
    b.delete_cookies();
    b.goto(&format!("http://{}/#/w/{WS}", d.addr));
    b.js("location.reload()", vec![]);
    b.wait(
        "the signed-out page",
        20,
        "const h = document.querySelector('h1'); return h && h.textContent === 'Not signed in'",
        vec![],
    );
    b.goto(&format!("http://{}{path}&ws={WS}", d.addr));
    b.wait(
        "the used link refused",
        20,
        "const p = document.getElementById('signed-out');
         return p && p.textContent.includes('already used')",
        vec![],
    );
    assert!(b.cookies().is_empty(), "no cookie from a used code");
}

/// `tuttid` prints a one-time login link; it works once.
#[test]
fn web_tuttid_prints_a_one_time_login_link() {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port");
    let addr = format!("127.0.0.1:{port}");
    let mut child = Command::new(EXE)
        .arg("serve")
        .arg("--db")
        .arg(dir.path().join("t.db"))
        .arg("--listen")
        .arg(&addr)
        .arg("--token-file")
        .arg(dir.path().join("token"))
        .env("TUTTI_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tuttid");
    let stderr = child.stderr.take().expect("stderr");
    let mut link = None;
    for line in BufReader::new(stderr).lines() {
        let Ok(line) = line else { break };
        if let Some(i) = line.find("one-time login link): ") {
            link = Some(
                line[i + "one-time login link): ".len()..]
                    .trim()
                    .to_string(),
            );
            break;
        }
    }
    let link = link.expect("a login link on stderr");
    assert!(
        link.starts_with(&format!("http://{addr}/#login=")),
        "{link}"
    );
    let code = link.rsplit("login=").next().unwrap_or_default().to_string();
    let token = std::fs::read_to_string(dir.path().join("token")).expect("token");
    assert!(
        !link.contains(token.trim()),
        "the link does not carry the token"
    );
    // (status, Set-Cookie) of one login with the printed code.
    let login = || -> (u16, String) {
        let r = ureq::post(&format!("http://{addr}/login"))
            .set("origin", &format!("http://{addr}"))
            .timeout(Duration::from_secs(10))
            .send_json(json!({ "code": code }));
        match r {
            Ok(r) => (
                r.status(),
                r.header("set-cookie").unwrap_or_default().to_string(),
            ),
            Err(ureq::Error::Status(code, _)) => (code, String::new()),
            Err(e) => panic!("login: {e}"),
        }
    };
    let (status, set) = login();
    assert_eq!(status, 204, "the printed code signs in");
    assert!(set.contains("HttpOnly"), "{set}");
    assert!(set.contains("SameSite=Strict"), "{set}");
    assert!(set.contains(token.trim()), "{set}");
    assert_eq!(login().0, 401, "a used code is refused");
    let _ = child.kill();
    let _ = child.wait();
}

/// The page loads nothing from elsewhere (no external fonts, scripts or CDNs).
#[test]
fn web_assets_load_nothing_from_elsewhere() {
    let d = daemon();
    for (path, kind) in [
        ("/", "text/html"),
        ("/assets/app.js", "text/javascript"),
        ("/assets/app.css", "text/css"),
    ] {
        let r = ureq::get(&format!("http://{}{path}", d.addr))
            .call()
            .expect(path);
        assert!(
            r.content_type().starts_with(kind),
            "{path}: {}",
            r.content_type()
        );
        let csp = r
            .header("content-security-policy")
            .unwrap_or_default()
            .to_string();
        assert!(csp.contains("default-src 'self'"), "{csp}");
        let body = r.into_string().expect("body");
        for bad in ["http://", "https://", "//cdn", "@import", "url("] {
            assert!(!body.contains(bad), "{path} refers to {bad}");
        }
    }
}

// ---- issue 32: a page people keep open ------------------------------------------------------

/// Every `/v1` request the page made so far (resource timing), the event stream excluded.
const API_REQUESTS: &str = "return performance.getEntriesByType('resource')
    .filter(e => e.name.includes('/v1/') && !e.name.includes('/v1/events')).length";

fn lane_of(id: &Value) -> String {
    format!(
        "details.lane[data-session-id='{}']",
        id.as_str().unwrap_or_default()
    )
}

/// Issue 32: "a normal 300 ms press on 'Allow' while other lanes update was lost"; "focus
/// jumps to `<body>` on each update". With seven lanes working, the focused Allow button of the
/// eighth stays the same element and keeps focus while the others change, and a 300 ms press
/// on it answers the request.
#[test]
fn web_a_held_click_while_other_lanes_update_is_not_lost_and_focus_stays() {
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "1")]);
    let b = Browser::start(1200, 1000);
    sign_in(&b, &d);
    let root = d.create(WS, "demo");
    open(&b, &d, &root);
    d.submit(WS, &root, "children=8 permission=1 fail=0 late=0 nested=0");
    b.wait(
        "the Allow button of child 1",
        60,
        "return document.querySelector(\".interaction button[data-option-id='allow']\")",
        vec![],
    );
    // Mark the button and focus it; count what changes in the other lanes from now on.
    b.js(
        "const btn = document.querySelector(\".interaction button[data-option-id='allow']\");
         btn.__marked = true; btn.focus();
         window.__changes = 0;
         const own = btn.closest('details.lane');
         new MutationObserver(ms => { for (const m of ms) if (!own.contains(m.target)) window.__changes += 1; })
           .observe(document.getElementById('transcript'), {subtree: true, childList: true, characterData: true, attributes: true});",
        vec![],
    );
    b.wait(
        "other lanes updating",
        30,
        "return window.__changes >= 5",
        vec![],
    );
    let focus = b.js(
        "const a = document.activeElement; return {marked: Boolean(a && a.__marked), option: a && a.dataset.optionId}",
        vec![],
    );
    assert_eq!(
        focus["marked"], true,
        "focus stayed on the same button: {focus}"
    );
    let before = b
        .js("return window.__changes", vec![])
        .as_u64()
        .unwrap_or(0);
    b.hold_click(".interaction button[data-option-id='allow']", 300);
    let after = b
        .js("return window.__changes", vec![])
        .as_u64()
        .unwrap_or(0);
    let answered = d.wait_for(WS, &root, 30, "the permission answered", |v| {
        v["interactions"]
            .as_array()
            .is_some_and(|a| !a.is_empty() && a.iter().all(|i| i["status"] != "pending"))
    });
    let i = &answered["interactions"][0];
    assert_eq!(i["status"], "answered", "{i}");
    eprintln!(
        "held click: {} changes in other lanes while the page ran, {} during the 300 ms press",
        before,
        after.saturating_sub(before)
    );
    b.screenshot(&screenshots().join("held-click.png"));
}

/// Issue 32: "requests per event on a 16-lane tree stay bounded"; "a tree of 100 lanes updates
/// with a bounded number of requests per event (print the figure)". Seven turns of 8 children
/// and 8 grandchildren (112 lanes) run while the page is open: after its first reads the page
/// patches itself from the event rows, so the requests it makes do not grow with the events.
#[test]
fn web_requests_per_event_stay_bounded_on_a_tree_of_112_lanes() {
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "20")]);
    let b = Browser::start(1200, 1000);
    sign_in(&b, &d);
    let root = d.create(WS, "demo");
    open(&b, &d, &root);
    b.wait(
        "the stream live",
        20,
        "return document.getElementById('conn').dataset.state === 'live'",
        vec![],
    );
    b.js("performance.setResourceTimingBufferSize(100000)", vec![]);
    let start = b.js(API_REQUESTS, vec![]).as_u64().unwrap_or(0);
    let from = d.detail(WS, &root)["eventSeq"].as_u64().unwrap_or(0);
    for turn in 1..=7 {
        let (_, t) = d.submit(
            WS,
            &root,
            "children=8 nested=1,2,3,4,5,6,7,8 permission=0 fail=0 late=0",
        );
        d.wait_for(WS, &root, 120, &format!("turn {turn} settled"), |v| {
            turn_of(v, &root).is_some_and(|x| x["id"] == t.as_str() && x["outcome"].is_string())
        });
    }
    let lanes = b.wait(
        "112 lanes and the root idle",
        60,
        "const n = document.querySelectorAll('details.lane').length;
         return document.getElementById('root-status').dataset.state === 'idle' && n === 112 ? n : null",
        vec![],
    );
    assert_eq!(lanes, 112);
    let requests = b.js(API_REQUESTS, vec![]).as_u64().unwrap_or(0) - start;
    let events = d
        .events(Some(from), None, usize::MAX, 3)
        .into_iter()
        .filter(|e| e["rootAgentSessionId"] == root.as_str())
        .count();
    eprintln!(
        "112 lanes: the page made {requests} API requests for {events} event rows ({:.4} per row)",
        requests as f64 / events.max(1) as f64
    );
    assert!(events > 1000, "the tree produced rows: {events}");
    assert!(
        requests <= 6,
        "requests do not grow with the events: {requests} for {events} rows"
    );
    // Lanes of earlier turns start folded; the current turn's are open.
    let open = b.js(
        "return [...document.querySelectorAll('details.lane')].filter(l => l.open).length",
        vec![],
    );
    assert_eq!(open, 16, "only the latest turn's lanes are open");
}

/// Issue 32: the overview's counts and jump links, per-child cancel, keyboard-only operation,
/// 400 px, and a child page with its breadcrumb and only a child's actions.
#[test]
fn web_overview_jumps_per_child_cancel_keyboard_and_child_pages() {
    let d = daemon();
    let b = Browser::start(400, 900);
    sign_in(&b, &d);
    let root = d.create(WS, "demo");
    d.submit(
        WS,
        &root,
        "children=3 permission=1 fail=2 hang=3 late=0 nested=0",
    );
    let detail = d.wait_for(WS, &root, 60, "asking, failed, hanging", |v| {
        let kids = children(v);
        kids.len() == 3
            && v["interactions"]
                .as_array()
                .is_some_and(|a| a.iter().any(|i| i["status"] == "pending"))
            && kids.iter().any(|c| {
                turn_of(v, c["id"].as_str().unwrap_or_default())
                    .is_some_and(|t| t["outcome"] == "failed")
            })
    });
    let asking = child_by_title(&detail, "explorer")["id"].clone();
    let failed = child_by_title(&detail, "tester")["id"].clone();
    let hanging = child_by_title(&detail, "reviewer")["id"].clone();
    open(&b, &d, &root);
    let counts = b.wait(
        "the overview's counts",
        30,
        "const c = document.getElementById('overview-counts');
         return c && c.dataset.input === '1' && c.dataset.failed === '1' && c.dataset.running === '1'
            ? c.textContent : null",
        vec![],
    );
    assert!(
        counts
            .as_str()
            .unwrap_or_default()
            .contains("1 waiting for you"),
        "{counts}"
    );
    let status = b.js(
        "const s = document.getElementById('root-status'); return [s.dataset.state, s.textContent]",
        vec![],
    );
    assert_eq!(status[0], "input", "{status}");
    assert!(
        status[1]
            .as_str()
            .unwrap_or_default()
            .starts_with("Waiting for your answer"),
        "{status}"
    );
    let jumps = b.js(
        "return [...document.querySelectorAll('#overview-jumps button')].map(x => [x.dataset.jump, x.textContent])",
        vec![],
    );
    assert_eq!(
        jumps,
        json!([
            [asking, "waiting for you: explorer"],
            [failed, "failed: tester"]
        ]),
        "{jumps}"
    );
    // Token usage where the provider reports it (the demo agent's ACP `usage_update` on each
    // child's own stream): the lane shows the child's usage as the API has it.
    let used = child_by_title(&detail, "tester")["usage"].clone();
    assert!(used["contextTokens"].as_u64().is_some(), "{detail}");
    let shown = b.wait(
        "the failed lane's token usage",
        20,
        "const u = document.querySelector(arguments[0] + ' .usage');
         return u && u.dataset.tokens ? [u.dataset.tokens, u.textContent] : null",
        vec![json!(lane_of(&failed))],
    );
    assert_eq!(
        shown[0],
        json!(used["contextTokens"].to_string()),
        "{shown} {used}"
    );
    let text = shown[1].as_str().unwrap_or_default();
    assert!(
        text.contains("context") && text.contains(used["cost"]["currency"].as_str().unwrap_or("?")),
        "{text}"
    );
    b.click(&format!(
        "#overview-jumps button[data-jump='{}']",
        asking.as_str().unwrap_or_default()
    ));
    let focused = b.js(
        "const a = document.activeElement; const l = a && a.closest('details.lane');
         return {lane: l && l.dataset.sessionId, option: a && a.dataset.optionId}",
        vec![],
    );
    assert_eq!(
        focused["lane"], asking,
        "the jump lands on the asking lane: {focused}"
    );
    // Per-child cancel: only the hanging child.
    b.click(&format!("{} .lane-cancel", lane_of(&hanging)));
    let end = d.wait_for(WS, &root, 60, "the hanging child canceled", |v| {
        turn_of(v, hanging.as_str().unwrap_or_default()).is_some_and(|t| t["outcome"] == "canceled")
    });
    assert!(
        turn_of(&end, &root).is_some_and(|t| t["outcome"].is_null()),
        "the root goes on"
    );
    b.wait(
        "the canceled lane",
        20,
        LANE_STATE_IS,
        vec![hanging.clone(), json!("canceled")],
    );
    // Keyboard only: Tab to the Allow button, Enter answers it.
    b.js("document.activeElement && document.activeElement.blur(); document.getElementById('main').focus()", vec![]);
    let mut reached = false;
    for _ in 0..200 {
        b.press(TAB);
        let on = b.js(
            "const a = document.activeElement; return a && a.dataset.optionId === 'allow'",
            vec![],
        );
        if on == true {
            reached = true;
            break;
        }
    }
    assert!(reached, "Tab reaches the Allow button");
    b.press(ENTER);
    d.wait_for(WS, &root, 60, "the root settled", |v| {
        turn_of(v, &root).is_some_and(|t| t["outcome"].is_string())
    });
    b.wait(
        "the root idle on the page",
        30,
        "return document.getElementById('root-status').dataset.state === 'idle'",
        vec![],
    );
    let wide = b.js(
        "const w = document.documentElement.clientWidth;
         return [...document.querySelectorAll('body *')]
            .filter(e => e.getBoundingClientRect().right > w + 0.5)
            .map(e => `${e.tagName}.${e.className}#${e.id}`)",
        vec![],
    );
    assert_eq!(wide, json!([]), "elements wider than the 400 px window");
    b.screenshot(&screenshots().join("overview-400px.png"));
    // A child page: its own turn, a way back, and no action the daemon refuses for a child.
    b.goto(&format!(
        "http://{}/#/w/{WS}/s/{}",
        d.addr,
        asking.as_str().unwrap_or_default()
    ));
    let page = b.wait(
        "the child page",
        20,
        "const h = document.getElementById('turn-heading');
         const r = document.getElementById('crumb-root');
         return h && r && h.textContent === \"This child's turn\" ? {
            root: r.getAttribute('href'), composer: document.getElementById('composer').hidden,
            delete: Boolean(document.getElementById('delete')),
            lane: document.querySelectorAll('details.lane').length} : null",
        vec![],
    );
    assert_eq!(page["root"], json!(format!("#/w/{WS}/s/{root}")), "{page}");
    assert_eq!(page["composer"], true, "no composer on a child: {page}");
    assert_eq!(page["delete"], false, "no delete on a child: {page}");
}

/// `data-state` of the lane of `arguments[0]` equals `arguments[1]`.
const LANE_STATE_IS: &str = "const l = [...document.querySelectorAll('details.lane')]
    .find(e => e.dataset.sessionId === arguments[0]); return Boolean(l && l.dataset.state === arguments[1])";
