//! Issue 34 item 5: a seeded, replayable fault-injection harness in the spirit of Jepsen.
//!
//! Three real `tuttid` processes on one real PostgreSQL server; each daemon reaches the database
//! through its own [`FaultProxy`] (and names itself there with `application_name=fault-dN`).
//! For a while (`TUTTI_FAULT_SECS`, default 45 s) a nemesis applies one fault at a time on a
//! schedule drawn from a seeded RNG: proxy pause (partition), drop-all, refuse, latency,
//! `kill -9` + restart of a daemon, `SIGSTOP`/`SIGCONT` of a daemon (one variant waits until
//! the daemon has a transaction open first), `pg_ctl restart -m fast`, and
//! `pg_terminate_backend` of one daemon's connections. Before them, one aimed fault per seed
//! opens the per-batch fencing window (`Run::stale_lines`: only one daemon's engine thread is
//! stalled, by pausing in the proxy the one connection found waiting on a row lock the harness
//! holds, while the others take its tree over). Meanwhile two clients send creates,
//! submits, cancels and permission answers to random daemons (choices from the same seed) and
//! record every request and answer (ids, kinds and statuses only: never prompt or message
//! text), and one SSE follower per daemon reads `/v1/events`, reconnecting with
//! `Last-Event-ID`.
//!
//! After the faults: everything is healed, the clients stop, the trees are driven to rest
//! (pending permissions answered; nothing is cancelled), then the checker asserts:
//!
//! 1. every 2xx-acknowledged command's effect is in the final state (a created session, a
//!    started turn, a completed cancel operation, an answered interaction);
//! 2. no session (root or child) stays active;
//! 3. the outbox seq is gap-free from 1, and every follower saw each row once, in order;
//! 4. fencing held: every outbox row was inserted by the daemon that held the tree's lease at
//!    that moment (a trigger installed by the harness records, per inserted row, the writing
//!    daemon's `application_name` and the lease row as the inserting transaction sees it);
//! 5. no provider process is left running for a tree its daemon no longer owns (each daemon
//!    ends with no more providers than trees it holds a live lease on, and the providers of a
//!    killed daemon are gone);
//! 6. every daemon reads every tree the same;
//! 7. the outbox tells one story: per entity, versions only grow in seq order, a settled turn
//!    keeps its outcome, and no message of a root turn comes in a transaction after the one
//!    that settled the turn (child turns take late messages by design).
//!
//! `fault harness seed: N` is printed; `TUTTI_FAULT_SEED=N` replays that seed (the same
//! schedule and client choices; the machine's timing still differs), `TUTTI_FAULT_SEEDS=K`
//! runs K seeds, `TUTTI_FAULT_SECS=S` makes each run S seconds long. Measured figures
//! (unavailability after `pg_ctl restart`, takeover after a kill or partition, the longest
//! stall of the other daemons while one is frozen) are printed, never asserted.

use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tutti_tests::daemon::{providers_of, signal, tree, try_request, TestDaemon};
use tutti_tests::fault_proxy::{FaultProxy, Mode};
use tutti_tests::postgres::Server;

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const WS: &str = "w1";
const DAEMONS: usize = 3;
const CLIENTS: usize = 2;
/// Lease 3 s (renewal every second); a provider of a quiescent tree stops after 2 s.
const CONFIG: &str = "lease_secs = 3\nidle_timeout_secs = 2\n";
/// The lease of [`CONFIG`].
const LEASE_MS: i64 = 3000;
const ENV: [(&str, &str); 1] = [("TUTTI_DEMO_SPEED", "2")];
/// The seeds `cargo test` runs.
const CI_SEEDS: [u64; 2] = [0x5eed_0001, 0x5eed_0002];

/// splitmix64: small, seedable, good enough for schedules.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> Option<&'a T> {
        if v.is_empty() {
            None
        } else {
            v.get(usize::try_from(self.below(v.len() as u64)).unwrap_or(0))
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| {
        let v = v.trim();
        v.strip_prefix("0x")
            .map_or_else(|| v.parse().ok(), |h| u64::from_str_radix(h, 16).ok())
    })
}

/// One daemon's current address and token (the address changes when it is restarted).
#[derive(Clone)]
struct Endpoint {
    addr: String,
    token: String,
}

/// One request a client sent and what came back.
#[derive(Debug, Clone)]
struct Record {
    client: usize,
    daemon: usize,
    op: &'static str,
    /// Session, turn, cancel operation or interaction the request names or created.
    ids: Vec<String>,
    /// `None`: no answer (transport error or timeout).
    status: Option<u16>,
    error_code: Option<String>,
    start_ms: i64,
    took_ms: i64,
}

/// A fault the nemesis applied: kind, daemon (if one), window.
#[derive(Debug, Clone)]
struct Fault {
    kind: &'static str,
    daemon: Option<usize>,
    start_ms: i64,
    end_ms: i64,
    note: String,
}

struct Shared {
    endpoints: RwLock<Vec<Endpoint>>,
    sessions: Mutex<Vec<String>>,
    records: Mutex<Vec<Record>>,
    stop_clients: AtomicBool,
    stop_followers: AtomicBool,
}

impl Shared {
    fn endpoint(&self, i: usize) -> Endpoint {
        self.endpoints.read().expect("endpoints")[i].clone()
    }
}

fn call(
    ep: &Endpoint,
    method: &str,
    path: &str,
    body: Option<Value>,
    secs: u64,
) -> Result<(u16, Value), String> {
    let auth = format!("Bearer {}", ep.token);
    try_request(
        &ep.addr,
        method,
        path,
        &[("authorization", &auth)],
        body,
        Duration::from_secs(secs),
    )
    .map(|(s, _, v)| (s, v))
}

/// Creates a demo session through `ep`, waiting at most `secs`.
fn create_call(ep: &Endpoint, title: &str, secs: u64) -> Result<(u16, Value), String> {
    call(
        ep,
        "POST",
        &sessions_path(),
        Some(json!({"provider": "demo", "title": title})),
        secs,
    )
}

/// The id of the session a create answered 201 for.
fn created_id(r: &Result<(u16, Value), String>) -> Option<String> {
    r.as_ref()
        .ok()
        .filter(|(s, _)| *s == 201)
        .and_then(|(_, v)| v["session"]["id"].as_str().map(str::to_string))
}

fn sessions_path() -> String {
    format!("/v1/workspaces/{WS}/agent-sessions")
}

fn detail_path(id: &str) -> String {
    format!("/v1/workspaces/{WS}/agent-sessions/{id}")
}

/// A demo prompt (only counts and child numbers: no text of note).
fn prompt(rng: &mut Rng) -> String {
    let children = rng.range(0, 2);
    let permission = if children > 0 && rng.below(3) == 0 {
        "1"
    } else {
        "0"
    };
    let fail = if children > 1 && rng.below(4) == 0 {
        "2"
    } else {
        "0"
    };
    format!("children={children} permission={permission} fail={fail} late=0")
}

/// The first pending interaction of a detail: (session, turn, request id).
fn pending(detail: &Value) -> Option<(String, String, String)> {
    let i = detail["interactions"]
        .as_array()?
        .iter()
        .find(|i| i["status"] == "pending")?;
    Some((
        i["agentSessionId"].as_str()?.to_string(),
        i["turnId"].as_str()?.to_string(),
        i["requestId"].as_str()?.to_string(),
    ))
}

/// One client: random commands through random daemons until told to stop.
fn client(n: usize, seed: u64, shared: &Shared) {
    let mut rng = Rng(seed ^ (0xc11e_0000 + n as u64));
    while !shared.stop_clients.load(Ordering::SeqCst) {
        let daemon = usize::try_from(rng.below(DAEMONS as u64)).unwrap_or(0);
        let ep = shared.endpoint(daemon);
        let known = shared.sessions.lock().expect("sessions").clone();
        let roll = rng.below(100);
        let start_ms = now_ms();
        let t = Instant::now();
        let rec = |op: &'static str, ids: Vec<String>, r: &Result<(u16, Value), String>| {
            let (status, error_code) = match r {
                Ok((s, v)) => (Some(*s), v["error"]["code"].as_str().map(str::to_string)),
                Err(_) => (None, None),
            };
            shared.records.lock().expect("records").push(Record {
                client: n,
                daemon,
                op,
                ids,
                status,
                error_code,
                start_ms,
                took_ms: i64::try_from(t.elapsed().as_millis()).unwrap_or(i64::MAX),
            });
        };
        if known.is_empty() || roll < 20 {
            let r = create_call(&ep, "fault", 10);
            let id = created_id(&r);
            rec("create", id.iter().cloned().collect(), &r);
            if let Some(id) = id {
                shared.sessions.lock().expect("sessions").push(id);
            }
        } else if roll < 60 {
            let id = rng.pick(&known).cloned().unwrap_or_default();
            let text = prompt(&mut rng);
            let r = call(
                &ep,
                "POST",
                &format!("{}/submit", detail_path(&id)),
                Some(json!({ "text": text })),
                10,
            );
            let mut ids = vec![id];
            if let Ok((200, v)) = &r {
                if let Some(t) = v["turnId"].as_str().filter(|t| !t.is_empty()) {
                    ids.push(t.to_string());
                }
            }
            rec("submit", ids, &r);
        } else {
            // Cancel or answer: read the tree first (through the same daemon).
            let id = rng.pick(&known).cloned().unwrap_or_default();
            let want_cancel = roll < 75;
            let Ok((200, d)) = call(&ep, "GET", &detail_path(&id), None, 10) else {
                continue;
            };
            if want_cancel {
                let Some(turn) = d["session"]["activeTurnId"].as_str() else {
                    continue;
                };
                let r = call(
                    &ep,
                    "POST",
                    &format!("{}/turns/{turn}/cancel", detail_path(&id)),
                    None,
                    10,
                );
                let mut ids = vec![id.clone(), turn.to_string()];
                if let Ok((202, v)) = &r {
                    if let Some(op) = v["operationId"].as_str() {
                        ids.push(op.to_string());
                    }
                }
                rec("cancel", ids, &r);
            } else if let Some((owner, turn, req)) = pending(&d) {
                let response = if rng.below(4) == 0 { "reject" } else { "allow" };
                let r = call(
                    &ep,
                    "POST",
                    &format!("{}/turns/{turn}/interactions/{req}", detail_path(&owner)),
                    Some(json!({ "response": response })),
                    10,
                );
                rec("answer", vec![owner, turn, req], &r);
            }
        }
        std::thread::sleep(Duration::from_millis(rng.range(20, 200)));
    }
}

/// One SSE follower of daemon `i`: reads `/v1/events`, reconnecting (to the daemon's current
/// address) with `Last-Event-ID` after any error or end; returns every seq it received, in
/// the order received.
fn follower(i: usize, shared: &Shared, seen: &Mutex<Vec<u64>>) {
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(2))
        .timeout_read(Duration::from_secs(3))
        .build();
    while !shared.stop_followers.load(Ordering::SeqCst) {
        let ep = shared.endpoint(i);
        let last = seen.lock().expect("seen").last().copied();
        let mut req = agent
            .get(&format!("http://{}/v1/events", ep.addr))
            .set("authorization", &format!("Bearer {}", ep.token));
        req = match last {
            Some(l) => req.set("last-event-id", &l.to_string()),
            None => req.query("after", "0"),
        };
        let Ok(resp) = req.call() else {
            std::thread::sleep(Duration::from_millis(200));
            continue;
        };
        for line in BufReader::new(resp.into_reader()).lines() {
            let Ok(line) = line else { break };
            if let Some(data) = line.strip_prefix("data:") {
                if let Ok(v) = serde_json::from_str::<Value>(data.trim()) {
                    if let Some(s) = v["seq"].as_u64() {
                        seen.lock().expect("seen").push(s);
                    }
                }
            }
            if shared.stop_followers.load(Ordering::SeqCst) {
                return;
            }
        }
    }
}

/// A fresh connection of the harness's own (never through a proxy).
fn admin(url: &str) -> Option<postgres::Client> {
    postgres::Client::connect(url, postgres::NoTls).ok()
}

/// The fencing evidence: per inserted outbox row, the writing daemon (`application_name`) and
/// the tree's lease row as the inserting transaction sees it; per lease row change, the new
/// row and the time.
const EVIDENCE: &str = r#"
CREATE TABLE fault_batches (
    seq BIGINT, root TEXT, txid BIGINT, app TEXT,
    lease_owner TEXT, lease_epoch BIGINT, at_ms BIGINT);
CREATE FUNCTION fault_batch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO fault_batches
  SELECT NEW.seq, NEW.root_agent_session_id, txid_current(), current_setting('application_name'),
         (SELECT owner FROM tree_leases WHERE root_agent_session_id = NEW.root_agent_session_id),
         (SELECT epoch FROM tree_leases WHERE root_agent_session_id = NEW.root_agent_session_id),
         (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
  RETURN NEW;
END $$;
CREATE TRIGGER fault_batch AFTER INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION fault_batch();
CREATE TABLE fault_leases (
    root TEXT, owner TEXT, epoch BIGINT, expires_at_ms BIGINT, app TEXT, at_ms BIGINT);
CREATE FUNCTION fault_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO fault_leases VALUES (NEW.root_agent_session_id, NEW.owner, NEW.epoch,
         NEW.expires_at_ms, current_setting('application_name'),
         (extract(epoch FROM clock_timestamp()) * 1000)::bigint);
  RETURN NEW;
END $$;
CREATE TRIGGER fault_lease AFTER INSERT OR UPDATE ON tree_leases
    FOR EACH ROW EXECUTE FUNCTION fault_lease();
"#;

/// Everything one run needs.
struct Run {
    seed: u64,
    server: Server,
    url: String,
    proxies: Vec<FaultProxy>,
    daemons: Vec<TestDaemon>,
    /// Daemon id (lease owner) → daemon index.
    ids: HashMap<String, usize>,
    shared: Arc<Shared>,
    faults: Vec<Fault>,
    /// Provider processes of killed daemons (must be gone at the end).
    orphans: Vec<u32>,
    /// Daemons currently stopped (SIGSTOP).
    stopped: BTreeSet<usize>,
    log: Vec<String>,
    t0: Instant,
}

impl Run {
    fn say(&mut self, line: String) {
        let line = format!("[{:>6.1}s] {line}", self.t0.elapsed().as_secs_f64());
        println!("{line}");
        self.log.push(line);
    }

    fn set_endpoint(&self, i: usize) {
        self.shared.endpoints.write().expect("endpoints")[i] = Endpoint {
            addr: self.daemons[i].addr.clone(),
            token: self.daemons[i].token.clone(),
        };
    }

    fn app(i: usize) -> String {
        format!("fault-d{i}")
    }

    /// The first 2xx create through daemon `i` after `from`, polled (bounded by `secs`);
    /// returns the milliseconds from `from`. The created session joins the load.
    fn first_create(&self, i: usize, from: i64, secs: u64) -> Option<i64> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline {
            let ep = self.shared.endpoint(i);
            let r = self.recorded(i, "create", || create_call(&ep, "probe", 5));
            if let Some(id) = created_id(&r) {
                self.shared.sessions.lock().expect("sessions").push(id);
                return Some(now_ms() - from);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Applies one fault drawn from `rng`, holds it, heals it.
    fn fault(&mut self, rng: &mut Rng) {
        let i = usize::try_from(rng.below(DAEMONS as u64)).unwrap_or(0);
        let hold = rng.range(500, 5000);
        let start_ms = now_ms();
        let (kind, note): (&'static str, String) =
            match rng.below(100) {
                0..=14 => {
                    self.proxies[i].set_mode(Mode::Pause);
                    std::thread::sleep(Duration::from_millis(hold));
                    self.proxies[i].heal();
                    ("partition", format!("{hold} ms"))
                }
                15..=24 => {
                    let n = self.proxies[i].drop_all();
                    ("drop-all", format!("{n} connections"))
                }
                25..=32 => {
                    self.proxies[i].set_mode(Mode::Refuse);
                    let n = self.proxies[i].drop_all();
                    std::thread::sleep(Duration::from_millis(hold));
                    self.proxies[i].heal();
                    ("refuse", format!("{hold} ms, {n} dropped"))
                }
                33..=40 => {
                    let ms = rng.range(20, 300);
                    self.proxies[i].set_latency(ms);
                    std::thread::sleep(Duration::from_millis(hold));
                    self.proxies[i].heal();
                    ("latency", format!("{ms} ms for {hold} ms"))
                }
                41..=54 => {
                    let providers = providers_of(&self.daemons[i]);
                    self.daemons[i].kill9();
                    self.orphans.extend(providers.iter().copied());
                    std::thread::sleep(Duration::from_millis(hold));
                    self.daemons[i].restart();
                    self.set_endpoint(i);
                    (
                        "kill-9",
                        format!("down {hold} ms, {} providers", providers.len()),
                    )
                }
                55..=66 => {
                    signal(&self.daemons[i], libc::SIGSTOP);
                    self.stopped.insert(i);
                    std::thread::sleep(Duration::from_millis(hold));
                    signal(&self.daemons[i], libc::SIGCONT);
                    self.stopped.remove(&i);
                    ("sigstop", format!("{hold} ms"))
                }
                67..=78 => {
                    // Wait (bounded) until the daemon has a transaction open, then freeze it.
                    let in_tx = self.wait_in_transaction(i, Duration::from_secs(3));
                    signal(&self.daemons[i], libc::SIGSTOP);
                    self.stopped.insert(i);
                    std::thread::sleep(Duration::from_millis(hold));
                    signal(&self.daemons[i], libc::SIGCONT);
                    self.stopped.remove(&i);
                    (
                        "sigstop-in-tx",
                        format!("{hold} ms, transaction open: {in_tx}"),
                    )
                }
                79..=88 => {
                    let t = Instant::now();
                    let restarted = self.server.restart();
                    let took = t.elapsed().as_millis();
                    let back: Vec<String> = (0..DAEMONS)
                        .map(|d| {
                            self.first_create(d, start_ms, 30)
                                .map_or_else(|| "never".to_string(), |ms| format!("{ms}"))
                        })
                        .collect();
                    (
                        "pg-restart",
                        format!(
                        "{} in {took} ms; first create per daemon after (ms from the start): {}",
                        if restarted.is_ok() { "restarted" } else { "FAILED" },
                        back.join("/")
                    ),
                    )
                }
                _ => {
                    let n = admin(&self.url).map_or(-1, |mut c| {
                        c.query(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                         WHERE application_name = $1",
                            &[&Run::app(i)],
                        )
                        .map_or(-1, |r| i64::try_from(r.len()).unwrap_or(-1))
                    });
                    ("terminate-backends", format!("{n} backends"))
                }
            };
        let daemon = (!matches!(kind, "pg-restart")).then_some(i);
        self.faults.push(Fault {
            kind,
            daemon,
            start_ms,
            end_ms: now_ms(),
            note: note.clone(),
        });
        let on = daemon.map_or_else(String::new, |d| format!(" d{d}"));
        self.say(format!("fault {kind}{on}: {note}"));
    }

    /// A create (and, with `prompt`, a submit) through daemon `i`, recorded like the clients'
    /// commands; the session id.
    fn create_through(&self, i: usize, prompt: Option<&str>) -> Option<String> {
        let ep = self.shared.endpoint(i);
        let r = self.recorded(i, "create", || create_call(&ep, "aimed", 10));
        let id = created_id(&r)?;
        if let Some(text) = prompt {
            let _ = self.submit_through(i, &id, text);
        }
        Some(id)
    }

    /// A submit through daemon `i`, recorded; its answer.
    fn submit_through(&self, i: usize, id: &str, text: &str) -> Result<(u16, Value), String> {
        let ep = self.shared.endpoint(i);
        self.recorded(i, "submit", || {
            call(
                &ep,
                "POST",
                &format!("{}/submit", detail_path(id)),
                Some(json!({ "text": text })),
                20,
            )
        })
    }

    /// Runs one request of the harness itself and records it as the clients record theirs
    /// (a create's or submit's ids taken from the answer).
    fn recorded(
        &self,
        i: usize,
        op: &'static str,
        send: impl FnOnce() -> Result<(u16, Value), String>,
    ) -> Result<(u16, Value), String> {
        let start_ms = now_ms();
        let t = Instant::now();
        let r = send();
        let mut ids = Vec::new();
        if let Ok((s, v)) = &r {
            if *s == 201 {
                ids.extend(v["session"]["id"].as_str().map(str::to_string));
            }
            if *s == 200 {
                ids.extend(v["agentSessionId"].as_str().map(str::to_string));
                ids.extend(v["turnId"].as_str().map(str::to_string));
            }
        }
        self.shared.records.lock().expect("records").push(Record {
            client: usize::MAX,
            daemon: i,
            op,
            ids,
            status: r.as_ref().ok().map(|(s, _)| *s),
            error_code: r
                .as_ref()
                .ok()
                .and_then(|(_, v)| v["error"]["code"].as_str().map(str::to_string)),
            start_ms,
            took_ms: i64::try_from(t.elapsed().as_millis()).unwrap_or(i64::MAX),
        });
        r
    }

    /// Issue 34, per-batch fencing, aimed at its window (once per seed, before the random
    /// faults). The window: a daemon's engine thread decides a provider's lines under its
    /// lease, and a later input of the same round claims the tree again at a newer epoch
    /// (after another daemon took it over, settled and released it) before those lines'
    /// batches commit. To open it, only daemon `i`'s engine thread is stalled, not the daemon:
    /// - tree T gets a turn through `i`; once the provider is talking (T has a message of its
    ///   own) and right after `i` renewed T's lease (so the provider's lines of the next second
    ///   queue ahead of the engine's next renewal tick),
    /// - a command for another tree U of `i` waits on U's lease row, locked by the harness;
    ///   that backend's connection (found in `pg_stat_activity`) is paused in the proxy, so
    ///   the engine thread waits while the runtime tasks queue T's lines and the HTTP side
    ///   takes requests;
    /// - T's lease expires; another daemon takes T over, settles its turn and releases it;
    /// - a submit for T is sent to `i` (it queues behind T's lines), then the pause ends.
    ///
    /// The engine thread then decides T's queued lines (under the lost epoch), renews (T was
    /// lost: its runtime stops), and claims T again for the submit at a new epoch. The lines'
    /// batches must be refused; committed under the new epoch, they add messages to a root
    /// turn after the transaction that settled it (checker item 7; seen with the per-batch
    /// epoch removed, and with the epoch read when the batch was handed over instead of when
    /// it was decided). Nothing is asserted here: the note says what happened (a late submit
    /// answered 409 means T's stale lines were refused and the submit with them).
    ///
    /// The fault also found a liveness bug, fixed in `Core::acquire`: a command claiming a
    /// tree whose lapsed provider was still registered had its claim dropped by the later
    /// handling of the watchdog's stop, and the tree reloaded over the command's batch.
    fn stale_lines(&mut self, rng: &mut Rng) {
        let i = usize::try_from(rng.below(DAEMONS as u64)).unwrap_or(0);
        let start_ms = now_ms();
        let me = self
            .ids
            .iter()
            .find(|(_, &d)| d == i)
            .map(|(id, _)| id.clone())
            .unwrap_or_default();
        let note = self.stale_lines_on(i, &me);
        self.faults.push(Fault {
            kind: "stale-lines",
            daemon: Some(i),
            start_ms,
            end_ms: now_ms(),
            note: note.clone(),
        });
        self.say(format!("fault stale-lines d{i}: {note}"));
    }

    /// [`Run::stale_lines`] on daemon `i` (lease owner `me`); what happened, in a line.
    fn stale_lines_on(&mut self, i: usize, me: &str) -> String {
        let (Some(mut locker), Some(mut watch)) = (admin(&self.url), admin(&self.url)) else {
            return "no admin connection".into();
        };
        let Some(u) = self.create_through(i, None) else {
            return "no blocker session created".into();
        };
        let Some(t) = self.create_through(i, Some("children=2 permission=0 fail=0 late=0")) else {
            return "no session created".into();
        };
        // The provider is talking once T has a root message of its own (not the prompt).
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let talking = watch
                .query_opt(
                    "SELECT 1 FROM messages WHERE agent_session_id = $1 \
                     AND json NOT LIKE '%\"role\":\"user\"%'",
                    &[&t],
                )
                .is_ok_and(|r| r.is_some());
            if talking {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let Ok(mut lock) = locker.transaction() else {
            return "no locking transaction".into();
        };
        if lock
            .query(
                "SELECT 1 FROM tree_leases WHERE root_agent_session_id = $1 FOR UPDATE",
                &[&u],
            )
            .is_err()
        {
            return "the blocker's lease row not locked".into();
        }
        // The stall starts right after daemon `i` renewed T's lease, so that the provider's
        // lines of the next second queue ahead of the engine's next renewal tick (which,
        // handled first, would find T lost and drop them).
        let renewed = |c: &mut postgres::Client| -> i64 {
            c.query_one(
                "SELECT coalesce(max(at_ms), 0) FROM fault_leases WHERE root = $1 AND owner = $2",
                &[&t, &me],
            )
            .map_or(0, |r| r.get(0))
        };
        let before = renewed(&mut watch);
        let deadline = Instant::now() + Duration::from_secs(2);
        while renewed(&mut watch) == before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let this = &*self;
        let note = std::thread::scope(|scope| {
            let blocked = scope.spawn(|| this.submit_through(i, &u, "children=0"));
            // The engine thread's backend, waiting on the lock (bounded well inside the
            // server's 2 s lock timeout).
            let mut port = None;
            let deadline = Instant::now() + Duration::from_millis(1500);
            while port.is_none() && Instant::now() < deadline {
                port = watch
                    .query_opt(
                        "SELECT client_port FROM pg_stat_activity WHERE application_name = $1 \
                         AND wait_event_type = 'Lock'",
                        &[&Run::app(i)],
                    )
                    .ok()
                    .flatten()
                    .and_then(|r| r.get::<_, Option<i32>>(0))
                    .and_then(|p| u16::try_from(p).ok());
            }
            let Some(port) = port.filter(|&p| this.proxies[i].pause_port(p)) else {
                drop(lock);
                let _ = blocked.join();
                return "the engine's backend was not found waiting".to_string();
            };
            // T taken over and released by another daemon (bounded inside the server's
            // idle-in-transaction timeout of the paused backend: 2 s lock wait + 5 s).
            let mut taken = None;
            let deadline = Instant::now() + Duration::from_millis(5500);
            while taken.is_none() && Instant::now() < deadline {
                taken = watch
                    .query_opt(
                        "SELECT owner FROM tree_leases WHERE root_agent_session_id = $1 \
                         AND owner <> $2 AND expires_at_ms < $3",
                        &[&t, &me, &now_ms()],
                    )
                    .ok()
                    .flatten()
                    .map(|_| ());
                std::thread::sleep(Duration::from_millis(20));
            }
            let late = scope.spawn(|| this.submit_through(i, &t, "children=0"));
            // The submit's read answers (that connection is not paused); then the engine goes on.
            std::thread::sleep(Duration::from_millis(300));
            this.proxies[i].heal();
            drop(lock);
            let blocked = blocked.join().ok();
            let late = late.join().ok();
            let status = |r: Option<Result<(u16, Value), String>>| match r {
                Some(Ok((s, v))) => format!("{s} {}", v["error"]["code"].as_str().unwrap_or("")),
                Some(Err(e)) => format!("no answer ({e})"),
                None => "lost".to_string(),
            };
            format!(
                "engine backend port {port} paused; T {} taken over and released; blocked \
                 submit {}; late submit {}",
                if taken.is_some() { "was" } else { "was NOT" },
                status(blocked),
                status(late)
            )
        });
        // Both join the load from now on.
        let mut known = self.shared.sessions.lock().expect("sessions");
        known.push(u);
        known.push(t);
        note
    }

    /// Polls `pg_stat_activity` until daemon `i` has a transaction open (bounded).
    fn wait_in_transaction(&self, i: usize, bound: Duration) -> bool {
        let Some(mut c) = admin(&self.url) else {
            return false;
        };
        let deadline = Instant::now() + bound;
        while Instant::now() < deadline {
            let open = c
                .query(
                    "SELECT 1 FROM pg_stat_activity WHERE application_name = $1 \
                     AND xact_start IS NOT NULL AND state <> 'idle'",
                    &[&Run::app(i)],
                )
                .map(|r| !r.is_empty())
                .unwrap_or(false);
            if open {
                return true;
            }
        }
        false
    }

    /// Heals everything: proxies pass, stopped daemons continue.
    fn heal(&mut self) {
        for p in &self.proxies {
            p.heal();
        }
        for i in std::mem::take(&mut self.stopped) {
            signal(&self.daemons[i], libc::SIGCONT);
        }
    }
}

/// Drives every tree to rest (answers pending permissions through random daemons; cancels
/// nothing), bounded by `secs`; returns the sessions still active.
fn drive_to_rest(run: &Run, rng: &mut Rng, secs: u64) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let active: Vec<(String, String)> = admin(&run.url)
            .and_then(|mut c| {
                c.query(
                    "SELECT id, COALESCE(root_agent_session_id, id) FROM sessions \
                     WHERE active_turn_id IS NOT NULL AND deleted_at IS NULL ORDER BY id",
                    &[],
                )
                .ok()
            })
            .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
            .unwrap_or_else(|| vec![("?".into(), "?".into())]);
        if active.is_empty() || Instant::now() > deadline {
            return active.into_iter().map(|(s, _)| s).collect();
        }
        let roots: BTreeSet<String> = active.into_iter().map(|(_, r)| r).collect();
        for root in roots {
            let d = usize::try_from(rng.below(DAEMONS as u64)).unwrap_or(0);
            let ep = run.shared.endpoint(d);
            if let Ok((200, detail)) = call(&ep, "GET", &detail_path(&root), None, 10) {
                if let Some((owner, turn, req)) = pending(&detail) {
                    let _ = call(
                        &ep,
                        "POST",
                        &format!("{}/turns/{turn}/interactions/{req}", detail_path(&owner)),
                        Some(json!({ "response": "allow" })),
                        10,
                    );
                }
            }
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// For sessions that stayed active: their tree's lease (owner, epoch, expiry relative to now)
/// and its last changes, and each daemon's provider count (ids and numbers only).
fn stuck_diagnosis(run: &Run, still: &[String]) -> Vec<String> {
    let Some(mut c) = admin(&run.url) else {
        return Vec::new();
    };
    let who = |owner: &str| {
        run.ids
            .get(owner)
            .map_or_else(|| owner.to_string(), |d| format!("d{d}"))
    };
    let now = now_ms();
    let mut out = Vec::new();
    let roots: BTreeSet<&str> = still
        .iter()
        .map(|s| s.split('~').next().unwrap_or(s))
        .collect();
    for root in roots {
        if let Ok(r) = c.query_one(
            "SELECT owner, epoch, expires_at_ms FROM tree_leases WHERE root_agent_session_id = $1",
            &[&root],
        ) {
            let (owner, epoch, expires): (String, i64, i64) = (r.get(0), r.get(1), r.get(2));
            let expiry = if expires == tutti_postgres::lease::RELEASED {
                "released".to_string()
            } else {
                format!("expires_at_ms - now = {}", expires.saturating_sub(now))
            };
            out.push(format!(
                "stuck tree {root}: lease of {} at epoch {epoch}, {expiry}",
                who(&owner)
            ));
        }
        let history: Vec<(String, i64, i64, String, i64)> = c
            .query(
                "SELECT owner, epoch, expires_at_ms, app, at_ms FROM fault_leases \
                 WHERE root = $1 ORDER BY at_ms DESC LIMIT 8",
                &[&root],
            )
            .map(|rows| {
                rows.iter()
                    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
                    .collect()
            })
            .unwrap_or_default();
        for (owner, epoch, expires, app, at) in history {
            out.push(format!(
                "  lease change {} s ago by {app}: {} epoch {epoch}, expires_at_ms - at = {}",
                (now - at) / 1000,
                who(&owner),
                expires.saturating_sub(at)
            ));
        }
        // The root's last outbox rows (ids, phases, versions and writers only: no text).
        let rows: Vec<OutboxTrace> = c
            .query(
                "SELECT o.seq, o.kind, o.payload, b.app, b.lease_epoch, b.txid FROM outbox o \
                 LEFT JOIN fault_batches b ON b.seq = o.seq \
                 WHERE o.root_agent_session_id = $1 AND o.kind IN ('session', 'turn') \
                 ORDER BY o.seq DESC LIMIT 12",
                &[&root],
            )
            .map(|rows| {
                rows.iter()
                    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
                    .collect()
            })
            .unwrap_or_default();
        for (seq, kind, payload, app, epoch, tx) in rows.into_iter().rev() {
            let v: Value = serde_json::from_str(&payload).unwrap_or(Value::Null);
            out.push(format!(
                "  seq {seq} tx {tx:?} by {app:?} at epoch {epoch:?}: {kind} {} v{} \
                 active {} phase {} outcome {}",
                v["id"], v["version"], v["activeTurnId"], v["phase"], v["outcome"]
            ));
        }
    }
    for (i, d) in run.daemons.iter().enumerate() {
        out.push(format!("d{i}: {} providers", providers_of(d).len()));
    }
    out
}

/// One outbox row of a stuck tree in the diagnosis: seq, kind, payload, writer's
/// `application_name`, lease epoch and transaction (the last three from `fault_batches`).
type OutboxTrace = (
    i64,
    String,
    String,
    Option<String>,
    Option<i64>,
    Option<i64>,
);

/// Milliseconds, as "min/median/max (n)".
fn spread(mut v: Vec<i64>) -> String {
    if v.is_empty() {
        return "none".into();
    }
    v.sort_unstable();
    format!(
        "{}/{}/{} ms (n={})",
        v[0],
        v[v.len() / 2],
        v[v.len() - 1],
        v.len()
    )
}

/// One seeded run; returns the checker's violations (empty: passed).
fn run_seed(seed: u64, secs: u64) -> Vec<String> {
    println!("fault harness seed: {seed} (replay: TUTTI_FAULT_SEED={seed}), {secs} s of faults");
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("database");
    // Migrate, then install the evidence triggers before any daemon writes.
    drop(tutti_postgres::PostgresStore::connect(&url).expect("migrate"));
    admin(&url)
        .expect("admin connection")
        .batch_execute(EVIDENCE)
        .expect("evidence triggers");
    let db = url.rsplit('/').next().expect("database name").to_string();
    let upstream: SocketAddr = format!("127.0.0.1:{}", server.port())
        .parse()
        .expect("server address");
    let proxies: Vec<FaultProxy> = (0..DAEMONS)
        .map(|_| FaultProxy::start(upstream).expect("proxy"))
        .collect();
    let daemons: Vec<TestDaemon> = proxies
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let u = format!(
                "postgres://tutti@{}/{db}?application_name={}",
                p.addr(),
                Run::app(i)
            );
            TestDaemon::start_with_db(EXE, Some(&u), Some(CONFIG), &ENV)
        })
        .collect();
    let ids: HashMap<String, usize> = daemons
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let id = std::fs::read_to_string(d.dir.path().join("postgres.daemon-id"))
                .expect("daemon id file");
            (id.trim().to_string(), i)
        })
        .collect();
    let shared = Arc::new(Shared {
        endpoints: RwLock::new(
            daemons
                .iter()
                .map(|d| Endpoint {
                    addr: d.addr.clone(),
                    token: d.token.clone(),
                })
                .collect(),
        ),
        sessions: Mutex::new(Vec::new()),
        records: Mutex::new(Vec::new()),
        stop_clients: AtomicBool::new(false),
        stop_followers: AtomicBool::new(false),
    });
    let mut run = Run {
        seed,
        server,
        url,
        proxies,
        daemons,
        ids,
        shared: shared.clone(),
        faults: Vec::new(),
        orphans: Vec::new(),
        stopped: BTreeSet::new(),
        log: Vec::new(),
        t0: Instant::now(),
    };
    let seen: Vec<Arc<Mutex<Vec<u64>>>> = (0..DAEMONS)
        .map(|_| Arc::new(Mutex::new(Vec::new())))
        .collect();
    let followers: Vec<_> = seen
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let (sh, s) = (shared.clone(), s.clone());
            std::thread::spawn(move || follower(i, &sh, &s))
        })
        .collect();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|n| {
            let sh = shared.clone();
            std::thread::spawn(move || client(n, seed, &sh))
        })
        .collect();

    let mut rng = Rng(seed);
    let until = Instant::now() + Duration::from_secs(secs);
    // Let the load start before the first fault.
    std::thread::sleep(Duration::from_millis(1500));
    run.stale_lines(&mut rng);
    while Instant::now() < until {
        run.fault(&mut rng);
        std::thread::sleep(Duration::from_millis(rng.range(300, 1500)));
    }

    // Heal and settle.
    run.heal();
    shared.stop_clients.store(true, Ordering::SeqCst);
    for c in clients {
        let _ = c.join();
    }
    run.say("healed; clients stopped".into());
    let mut violations = Vec::new();
    // One bound for all of them (not one per daemon).
    let deadline = Instant::now() + Duration::from_secs(60);
    for i in 0..DAEMONS {
        let ep = shared.endpoint(i);
        let healthy = loop {
            let ok = try_request(
                &ep.addr,
                "GET",
                "/healthz",
                &[],
                None,
                Duration::from_secs(5),
            )
            .is_ok_and(|r| r.0 == 200);
            if ok || Instant::now() > deadline {
                break ok;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if !healthy {
            violations.push(format!("d{i} not healthy within 60 s of healing"));
        }
    }
    let still = drive_to_rest(&run, &mut rng, 90);
    if !still.is_empty() {
        violations.push(format!(
            "{} sessions still active 90 s after healing: {:?}",
            still.len(),
            &still[..still.len().min(10)]
        ));
        for line in stuck_diagnosis(&run, &still) {
            run.say(line);
        }
    }
    run.say("settled".into());
    check(&run, &seen, &mut violations);
    shared.stop_followers.store(true, Ordering::SeqCst);
    for f in followers {
        let _ = f.join();
    }
    figures(&run);
    for p in &run.orphans {
        if let Ok(pid) = libc::pid_t::try_from(*p) {
            // SAFETY: kill(2) of a provider process this run's daemon started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    if !violations.is_empty() {
        println!("fault harness seed {}: the schedule was:", run.seed);
        for l in &run.log {
            println!("  {l}");
        }
    }
    violations
}

/// One row of `fault_batches`: seq, tree, writer's `application_name`, lease owner and epoch as
/// the inserting transaction saw them.
type Evidence = (i64, String, String, Option<String>, Option<i64>);

/// The checker (see the module docs); appends what it found to `violations`.
fn check(run: &Run, seen: &[Arc<Mutex<Vec<u64>>>], violations: &mut Vec<String>) {
    let Some(mut c) = admin(&run.url) else {
        violations.push("the checker cannot connect to the database".into());
        return;
    };
    let records = run.shared.records.lock().expect("records").clone();
    let acked = |r: &Record| r.status.is_some_and(|s| (200..300).contains(&s));
    let q = |c: &mut postgres::Client, sql: &str, id: &str| -> bool {
        c.query(sql, &[&id]).map(|r| !r.is_empty()).unwrap_or(false)
    };

    // 1. Every acknowledged command's effect.
    let mut count = BTreeMap::<&str, (usize, usize)>::new();
    for r in &records {
        let e = count.entry(r.op).or_default();
        e.0 += 1;
        if !acked(r) {
            continue;
        }
        e.1 += 1;
        let lost = match (r.op, r.ids.as_slice()) {
            ("create", [id, ..]) => !q(&mut c, "SELECT 1 FROM sessions WHERE id = $1", id),
            ("submit", [_, turn, ..]) => !q(&mut c, "SELECT 1 FROM turns WHERE id = $1", turn),
            ("cancel", [_, _, op, ..]) => !q(
                &mut c,
                "SELECT 1 FROM cancel_operations WHERE id = $1 AND state <> 'prepared'",
                op,
            ),
            ("answer", [_, turn, req]) => c
                .query(
                    "SELECT 1 FROM interactions WHERE turn_id = $1 AND request_id = $2 \
                     AND json::jsonb ->> 'status' <> 'pending'",
                    &[turn, req],
                )
                .map(|r| r.is_empty())
                .unwrap_or(true),
            _ => false,
        };
        if lost {
            violations.push(format!(
                "acknowledged {} ({}) by d{} (client {}) has no effect in the final state: {:?}",
                r.op,
                r.status.unwrap_or(0),
                r.daemon,
                r.client,
                r.ids
            ));
        }
    }
    let statuses: BTreeMap<String, usize> = records.iter().fold(BTreeMap::new(), |mut m, r| {
        let k = match (r.status, &r.error_code) {
            (Some(s), Some(code)) => format!("{s} {code}"),
            (Some(s), None) => s.to_string(),
            (None, _) => "no answer".into(),
        };
        *m.entry(k).or_default() += 1;
        m
    });
    println!("requests (sent, acknowledged): {count:?}; answers: {statuses:?}");

    // 2. No session stays active (checked by `drive_to_rest`); 3. the outbox.
    let outbox: Vec<u64> = c
        .query("SELECT seq FROM outbox ORDER BY seq", &[])
        .map(|rows| {
            rows.iter()
                .map(|r| u64::try_from(r.get::<_, i64>(0)).unwrap_or(0))
                .collect()
        })
        .unwrap_or_default();
    let n = outbox.len() as u64;
    if outbox != (1..=n).collect::<Vec<_>>() {
        let gaps: Vec<u64> = (1..=outbox.last().copied().unwrap_or(0))
            .filter(|s| outbox.binary_search(s).is_err())
            .take(10)
            .collect();
        violations.push(format!(
            "the outbox is not gap-free from 1: missing {gaps:?}"
        ));
    }
    let next: i64 = c
        .query_one("SELECT value FROM meta WHERE key = 'outbox_next_seq'", &[])
        .map(|r| r.get(0))
        .unwrap_or(0);
    if u64::try_from(next).ok() != Some(n + 1) {
        violations.push(format!("outbox counter {next} after {n} rows"));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for (i, s) in seen.iter().enumerate() {
        let got = loop {
            let v = s.lock().expect("seen").clone();
            if v.len() as u64 >= n || Instant::now() > deadline {
                break v;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if got != outbox {
            let dup = got.windows(2).find(|w| w[1] <= w[0]);
            let missing = outbox.iter().find(|x| !got.contains(x));
            violations.push(format!(
                "follower on d{i} saw {} rows of {n}, not each once in order \
                 (first out of order: {dup:?}, first missing: {missing:?})",
                got.len()
            ));
        }
    }

    // The stream tells one story: per entity, versions only grow in seq order, a settled turn
    // stays settled with the same outcome, and no message of a turn comes in a later
    // transaction than the one that settled it (a stale batch that slipped through would
    // publish an older version, reopen a turn or add to a settled root turn). Tool calls and
    // child turns' messages are left out: a subagent's tool call is completed after its child
    // turn settled, and a settled child turn takes late messages by design.
    let rows: Vec<(i64, String, String, Option<i64>)> = c
        .query(
            "SELECT o.seq, o.kind, o.payload, b.txid FROM outbox o \
             LEFT JOIN fault_batches b ON b.seq = o.seq \
             WHERE o.kind IN ('session', 'turn', 'interaction', 'cancelOperation', 'message') \
             ORDER BY o.seq",
            &[],
        )
        .map(|rows| {
            rows.iter()
                .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
                .collect()
        })
        .unwrap_or_default();
    let mut last: HashMap<(String, String), (u64, Value)> = HashMap::new();
    let mut story = Vec::new();
    let root_ids: BTreeSet<String> = c
        .query("SELECT id FROM sessions WHERE kind = 'root'", &[])
        .map(|rows| rows.iter().map(|r| r.get(0)).collect())
        .unwrap_or_default();
    // Turn id -> (seq, transaction) of its first settled row.
    let mut settled: HashMap<String, (i64, Option<i64>)> = HashMap::new();
    for (seq, kind, payload, txid) in &rows {
        let v: Value = serde_json::from_str(payload).unwrap_or(Value::Null);
        if kind == "message" {
            // Child turns take late messages by design (the engine's `drop_reason`).
            if !root_ids.contains(v["agentSessionId"].as_str().unwrap_or_default()) {
                continue;
            }
            let turn = v["turnId"].as_str().unwrap_or_default();
            if let Some((at, tx)) = settled.get(turn) {
                if tx != txid {
                    story.push(format!(
                        "seq {seq}: message of turn {turn}, settled at seq {at}"
                    ));
                }
            }
            continue;
        }
        if kind == "turn" && !v["outcome"].is_null() {
            if let Some(t) = v["id"].as_str() {
                settled.entry(t.to_string()).or_insert((*seq, *txid));
            }
        }
        let id = match kind.as_str() {
            "interaction" => format!("{}/{}", v["turnId"], v["requestId"]),
            _ => v["id"].as_str().unwrap_or_default().to_string(),
        };
        let version = v["version"].as_u64().unwrap_or(0);
        let outcome = v.get("outcome").cloned().unwrap_or(Value::Null);
        if let Some((before, was)) = last.get(&(kind.clone(), id.clone())) {
            if version <= *before {
                story.push(format!(
                    "seq {seq}: {kind} {id} version {version} after {before}"
                ));
            }
            if kind == "turn" && !was.is_null() && *was != outcome {
                story.push(format!(
                    "seq {seq}: turn {id} settled {was} became {outcome}"
                ));
            }
        }
        let keep = if kind == "turn" && outcome.is_null() {
            last.get(&(kind.clone(), id.clone()))
                .map_or(Value::Null, |(_, was)| was.clone())
        } else {
            outcome
        };
        last.insert((kind.clone(), id), (version, keep));
    }
    if !story.is_empty() {
        violations.push(format!(
            "the outbox contradicts itself {} times; first: {:?}",
            story.len(),
            &story[..story.len().min(5)]
        ));
    }

    // 4. Fencing: the writer of every outbox row held the tree's lease.
    let batches: Vec<Evidence> = c
        .query(
            "SELECT seq, root, app, lease_owner, lease_epoch FROM fault_batches ORDER BY seq",
            &[],
        )
        .map(|rows| {
            rows.iter()
                .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
                .collect()
        })
        .unwrap_or_default();
    let mut unfenced = Vec::new();
    for (seq, root, app, owner, epoch) in &batches {
        let writer = app
            .strip_prefix("fault-d")
            .and_then(|d| d.parse::<usize>().ok());
        let holder = owner.as_ref().and_then(|o| run.ids.get(o)).copied();
        if writer.is_none() || writer != holder {
            unfenced.push(format!(
                "seq {seq} of tree {root} written by {app} while the lease (epoch {epoch:?}) was {}",
                holder.map_or_else(|| format!("{owner:?}"), |h| format!("d{h}'s"))
            ));
        }
    }
    if batches.len() as u64 != n {
        violations.push(format!(
            "evidence for {} outbox rows, {n} in the outbox",
            batches.len()
        ));
    }
    if !unfenced.is_empty() {
        violations.push(format!(
            "fencing broken: {} outbox rows written by a daemon that did not hold the tree's lease; first: {:?}",
            unfenced.len(),
            &unfenced[..unfenced.len().min(5)]
        ));
    }

    // 5. Providers: none of a killed daemon, none for a tree not held.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let orphans: Vec<u32> = run
            .orphans
            .iter()
            .copied()
            .filter(|p| tutti_tests::procs::alive(*p))
            .collect();
        let now = now_ms();
        let mut over = Vec::new();
        for (i, d) in run.daemons.iter().enumerate() {
            let providers = providers_of(d).len();
            let held = run
                .ids
                .iter()
                .find(|(_, &v)| v == i)
                .and_then(|(owner, _)| {
                    c.query_one(
                        "SELECT count(*) FROM tree_leases WHERE owner = $1 AND expires_at_ms > $2",
                        &[owner, &now],
                    )
                    .ok()
                })
                .map_or(0, |r| r.get::<_, i64>(0));
            if i64::try_from(providers).unwrap_or(i64::MAX) > held {
                over.push(format!("d{i}: {providers} providers, {held} live leases"));
            }
        }
        if orphans.is_empty() && over.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            violations.push(format!(
                "providers left running 30 s after settling: of killed daemons {orphans:?}; \
                 beyond the leases held {over:?}"
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }

    // 6. Every daemon reads every tree the same.
    let roots: Vec<String> = c
        .query(
            "SELECT id FROM sessions WHERE kind = 'root' AND deleted_at IS NULL ORDER BY id",
            &[],
        )
        .map(|rows| rows.iter().map(|r| r.get(0)).collect())
        .unwrap_or_default();
    let mut differ = 0;
    for root in &roots {
        let views: Vec<Option<Value>> = (0..DAEMONS)
            .map(|i| {
                call(&run.shared.endpoint(i), "GET", &detail_path(root), None, 10)
                    .ok()
                    .filter(|(s, _)| *s == 200)
                    .map(|(_, v)| tree(v))
            })
            .collect();
        if views.iter().any(Option::is_none) || views.windows(2).any(|w| w[0] != w[1]) {
            differ += 1;
        }
    }
    if differ > 0 {
        violations.push(format!(
            "{differ} of {} trees read differently (or not at all) on the daemons",
            roots.len()
        ));
    }
    println!(
        "checked: {} requests, {} trees, {n} outbox rows, {} lease changes",
        records.len(),
        roots.len(),
        c.query_one("SELECT count(*) FROM fault_leases", &[])
            .map_or(0, |r| r.get::<_, i64>(0))
    );
}

/// Prints the measured costs of the faults (README, issue 34 item 6): takeover after a kill,
/// a partition or a stop (from the fault's start to the first claim of one of the daemon's
/// trees by another daemon), unavailability after `pg_ctl restart` (printed per fault), and
/// the longest acknowledged command on the other daemons while one was frozen or partitioned.
fn figures(run: &Run) {
    let Some(mut c) = admin(&run.url) else { return };
    let leases: Vec<(String, String, i64, i64, i64)> = c
        .query(
            "SELECT root, owner, epoch, expires_at_ms, at_ms FROM fault_leases ORDER BY at_ms",
            &[],
        )
        .map(|rows| {
            rows.iter()
                .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
                .collect()
        })
        .unwrap_or_default();
    let records = run.shared.records.lock().expect("records").clone();
    let mut takeover: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    let mut stall: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for f in &run.faults {
        let Some(d) = f.daemon else { continue };
        let Some(owner) = run
            .ids
            .iter()
            .find(|(_, &v)| v == d)
            .map(|(o, _)| o.clone())
        else {
            continue;
        };
        // Trees this daemon held a live (unreleased, unexpired) lease on when the fault began;
        // the first claim of any of them by another daemon is the fault's takeover.
        let mut last: HashMap<&str, (&str, i64, i64)> = HashMap::new();
        for (root, o, epoch, expires, at) in &leases {
            if *at < f.start_ms {
                last.insert(root, (o, *epoch, *expires));
            }
        }
        let first = last
            .into_iter()
            .filter(|(_, (o, _, expires))| *o == owner && *expires > f.start_ms)
            .filter_map(|(root, (_, epoch, _))| {
                leases
                    .iter()
                    .find(|(r, o2, e2, _, at)| {
                        r == root && *o2 != owner && *e2 > epoch && *at >= f.start_ms
                    })
                    // A claim more than one lease after the fault ended belongs to another.
                    .filter(|l| l.4 <= f.end_ms + LEASE_MS)
                    .map(|l| l.4 - f.start_ms)
            })
            .min();
        if let Some(ms) = first {
            takeover.entry(f.kind).or_default().push(ms);
        }
        if matches!(f.kind, "sigstop" | "sigstop-in-tx" | "partition") {
            let worst = records
                .iter()
                .filter(|r| {
                    r.daemon != d
                        && r.client != usize::MAX
                        && r.status.is_some_and(|s| (200..300).contains(&s))
                        && r.start_ms >= f.start_ms
                        && r.start_ms <= f.end_ms
                })
                .map(|r| r.took_ms)
                .max();
            if let Some(w) = worst {
                stall.entry(f.kind).or_default().push(w);
            }
        }
    }
    for (k, v) in takeover {
        println!(
            "figure: takeover after {k} (fault start to the first claim of one of its live trees by another daemon, per fault): {}",
            spread(v)
        );
    }
    for (k, v) in stall {
        println!(
            "figure: longest acknowledged command on the other daemons during {k}: {}",
            spread(v)
        );
    }
    for f in run.faults.iter().filter(|f| f.kind == "pg-restart") {
        println!("figure: pg_ctl restart -m fast: {}", f.note);
    }
}

/// Issue 34 item 5: the fault-injection harness (see the module docs). `cargo test` runs the
/// seeds in [`CI_SEEDS`]; `TUTTI_FAULT_SEED`, `TUTTI_FAULT_SEEDS` and `TUTTI_FAULT_SECS` replay
/// one seed or run more and longer.
#[test]
fn faults_leave_every_acknowledged_command_fenced_gap_free_and_settled() {
    let secs = env_u64("TUTTI_FAULT_SECS").unwrap_or(45);
    let seeds: Vec<u64> = match (env_u64("TUTTI_FAULT_SEED"), env_u64("TUTTI_FAULT_SEEDS")) {
        (Some(s), _) => vec![s],
        (None, Some(k)) => {
            let mut r = Rng(now_ms().unsigned_abs());
            CI_SEEDS
                .iter()
                .copied()
                .chain(std::iter::repeat_with(|| r.next() >> 16))
                .take(usize::try_from(k).unwrap_or(1))
                .collect()
        }
        (None, None) => CI_SEEDS.to_vec(),
    };
    let mut failed = Vec::new();
    for seed in seeds {
        let t = Instant::now();
        let v = run_seed(seed, secs);
        println!("fault harness seed {seed}: {:?} wall time", t.elapsed());
        if v.is_empty() {
            println!("fault harness seed {seed}: checker passed");
        } else {
            for line in &v {
                println!("CHECKER seed {seed}: {line}");
            }
            failed.push((seed, v));
        }
    }
    assert!(
        failed.is_empty(),
        "the checker failed for seeds {:?} (replay one with TUTTI_FAULT_SEED=N): {failed:#?}",
        failed.iter().map(|f| f.0).collect::<Vec<_>>()
    );
}
