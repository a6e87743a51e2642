//! The outbox follower behind `GET /v1/events`: every committed row exactly once, in order,
//! whether it comes from the file (catching up, or after lagging behind the live channel) or
//! from memory right after its commit. Real daemon core, real SQLite file.

use std::sync::Arc;
use std::time::Duration;
use tutti_core::adapters::Adapter;
use tutti_core::model::{Capabilities, Id};
use tutti_core::store::OutboxRow;
use tutti_core::{Command, EngineConfig, Input};
use tutti_tokio::daemon::{Daemon, DaemonOptions, LaunchError, ProviderFactory};
use tutti_tokio::follow::{Followed, Follower};
use tutti_tokio::runtime::Transport;

/// Sessions only: no provider is ever launched.
struct NoProviders;
impl ProviderFactory for NoProviders {
    fn capabilities(&self, _: &str) -> Option<Capabilities> {
        None
    }
    fn launch(
        &self,
        _: &str,
        _: &Id,
        _: Option<&str>,
        _: Option<&str>,
    ) -> Result<(Box<dyn Adapter>, Transport), LaunchError> {
        Err(LaunchError::UnknownProvider(
            "no providers in this test".into(),
        ))
    }
    fn names(&self) -> Vec<String> {
        Vec::new()
    }
}

struct TempDir(std::path::PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn start(name: &str) -> (TempDir, Daemon) {
    let dir = std::env::temp_dir().join(format!("tutti-follow-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let daemon = Daemon::start(DaemonOptions {
        durability: Default::default(),
        max_providers: None,
        db: dir.join("t.db"),
        providers: Arc::new(NoProviders),
        engine: EngineConfig::default(),
        idle_timeout: None,
        retention: Default::default(),
    })
    .expect("start");
    (TempDir(dir), daemon)
}

async fn create(d: &Daemon, i: usize) {
    d.call(Input::Command(Command::CreateSession {
        agent_session_id: format!("s{i}").into(),
        workspace_id: "w".into(),
        provider: "none".into(),
        title: None,
        capabilities: None,
    }))
    .await
    .expect("create");
}

async fn collect(f: &mut Follower, n: usize) -> Vec<OutboxRow> {
    let mut out = Vec::new();
    while out.len() < n {
        let rows = tokio::time::timeout(Duration::from_secs(10), f.next())
            .await
            .expect("rows arrive")
            .expect("rows");
        assert!(!rows.is_empty(), "next never returns nothing");
        out.extend(rows);
    }
    out
}

fn file_rows(d: &Daemon) -> Vec<OutboxRow> {
    d.read(|r| r.outbox_after(0, 1_000_000))
        .expect("read")
        .expect("rows")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_keeps_up_gets_every_row_once_in_order() {
    let (_dir, d) = start("live");
    for i in 0..10 {
        create(&d, i).await;
    }
    // Starts behind (10 rows in the file), then follows live while more are committed.
    let mut f = Follower::new(&d, 0);
    let writer = {
        let d = d.clone();
        tokio::spawn(async move {
            for i in 10..400 {
                create(&d, i).await;
            }
        })
    };
    let got = collect(&mut f, 400).await;
    writer.await.expect("writer");
    let seqs: Vec<u64> = got.iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs,
        (1..=400).collect::<Vec<_>>(),
        "gap-free, in order, once"
    );
    assert_eq!(got, file_rows(&d), "the same rows the file holds");
    assert_eq!(f.cursor(), 400);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_falls_behind_the_live_channel_reads_the_file() {
    let (_dir, d) = start("lag");
    let mut f = Follower::new(&d, 0);
    // Far more commits than the live channel holds while nobody polls the follower.
    let n = tutti_tokio::follow::LIVE_CAPACITY * 2 + 50;
    for i in 0..n {
        create(&d, i).await;
    }
    let got = collect(&mut f, n).await;
    let seqs: Vec<u64> = got.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (1..=n as u64).collect::<Vec<_>>());
    assert_eq!(got, file_rows(&d));
    // And it goes on live afterwards.
    create(&d, n).await;
    let next = collect(&mut f, 1).await;
    assert_eq!(next[0].seq, n as u64 + 1);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_resumes_after_a_cursor_and_ends_when_the_daemon_stops() {
    let (_dir, d) = start("resume");
    for i in 0..30 {
        create(&d, i).await;
    }
    let mut f = Follower::new(&d, 17);
    let got = collect(&mut f, 13).await;
    assert_eq!(got.first().map(|r| r.seq), Some(18));
    assert_eq!(got.last().map(|r| r.seq), Some(30));
    d.shutdown().await;
    let end = tokio::time::timeout(Duration::from_secs(10), f.next())
        .await
        .expect("ends");
    assert!(end.is_err(), "a stopped daemon ends the stream");
}

/// Issue 36 item 8: a position beyond the newest row (a client coming back to a restored, older
/// database) is not accepted silently: the follower yields a reset to the newest row, then every
/// later row; a position equal to the newest row is simply caught up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_position_beyond_the_newest_row_is_a_reset_to_the_newest_row() {
    let (_dir, d) = start("beyond");
    for i in 0..5 {
        create(&d, i).await;
    }
    let mut f = Follower::new(&d, 50);
    let first = tokio::time::timeout(Duration::from_secs(10), f.next_event())
        .await
        .expect("answers")
        .expect("event");
    assert_eq!(
        first,
        Followed::Reset {
            requested_after: 50,
            pruned_through: 5
        }
    );
    assert_eq!(f.cursor(), 5);
    create(&d, 5).await;
    let next = collect(&mut f, 1).await;
    assert_eq!(next[0].seq, 6, "continues after the newest row");

    // At the head: no reset, the next row is the next committed one.
    let mut at_head = Follower::new(&d, 6);
    create(&d, 6).await;
    match tokio::time::timeout(Duration::from_secs(10), at_head.next_event())
        .await
        .expect("answers")
        .expect("event")
    {
        Followed::Rows(rows) => assert_eq!(rows[0].seq, 7),
        other => panic!("a caught-up position is no reset: {other:?}"),
    }
    d.shutdown().await;
}

/// One event of a stream as read off the wire: its `id:`, `event:` and `data:` lines, in the
/// order they came.
#[derive(Debug)]
struct WireEvent {
    lines: Vec<String>,
}

/// Issue 33 (events rendered once for all followers and written as pre-rendered frames): over
/// real HTTP, every row is one whole event, `id:` its seq, `event:` its kind and one `data:`
/// line holding its `OutboxRow` JSON, the same whether the row came from the file (written
/// before the client connected) or live from its commit; two clients get the same events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_writes_each_row_as_one_event_from_the_file_and_live() {
    use std::io::{BufRead, BufReader};
    let (_dir, d) = start("wire");
    for i in 0..5 {
        create(&d, i).await;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("listen");
    let addr = listener.local_addr().expect("address");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    const TOKEN: &str = "follow-wire-token-0123456789abcdef0123";
    let app = tutti_tokio::api::router_with_shutdown(d.clone(), TOKEN.into(), stop_rx.clone());
    let server = tokio::spawn(tutti_tokio::connections::serve(
        listener,
        app,
        tutti_tokio::connections::HttpLimits::default(),
        stop_rx,
    ));
    const N: usize = 40;
    let client = |n: usize| {
        tokio::task::spawn_blocking(move || {
            let resp = ureq::get(&format!("http://{addr}/v1/events"))
                .set("authorization", &format!("Bearer {TOKEN}"))
                .timeout(Duration::from_secs(20))
                .call()
                .expect("event stream");
            assert_eq!(resp.header("content-type"), Some("text/event-stream"));
            assert_eq!(resp.header("cache-control"), Some("no-cache"));
            let mut events = Vec::new();
            let mut lines = Vec::new();
            for line in BufReader::new(resp.into_reader()).lines() {
                let line = line.expect("line");
                if line.is_empty() {
                    events.push(WireEvent {
                        lines: std::mem::take(&mut lines),
                    });
                    if events.len() == n {
                        break;
                    }
                } else if !line.starts_with(':') {
                    lines.push(line);
                }
            }
            events
        })
    };
    let (a, b) = (client(N), client(N));
    // Both streams open and read the file's rows; the rest are committed while they follow.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 5..N {
        create(&d, i).await;
    }
    let (a, b) = (a.await.expect("client a"), b.await.expect("client b"));
    let rows = file_rows(&d);
    assert_eq!(rows.len(), N);
    for events in [&a, &b] {
        assert_eq!(events.len(), N);
        for (e, row) in events.iter().zip(&rows) {
            let [id, event, data] = e.lines.as_slice() else {
                panic!("one id, event and data line: {e:?}");
            };
            assert_eq!(id, &format!("id: {}", row.seq));
            assert_eq!(event, &format!("event: {}", row.kind));
            let data: serde_json::Value =
                serde_json::from_str(data.strip_prefix("data: ").expect("data line"))
                    .expect("JSON data");
            assert_eq!(data, serde_json::to_value(row).expect("row JSON"), "{e:?}");
        }
    }
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
    d.shutdown().await;
}

/// A commit's rows are on the live channel before the reply to the command that made them: a
/// client that got its reply and then reads the live channel finds them there, in order, with
/// the payloads the file holds (issue 33: the commit thread announces them as soon as they are
/// durable, the engine thread replies after it acknowledged the commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commits_rows_are_live_before_its_reply() {
    let (_dir, d) = start("before-reply");
    let mut live = d.live();
    let mut seen = Vec::new();
    for i in 0..50 {
        create(&d, i).await;
        let head = *d.outbox_watch().borrow();
        let mut got = Vec::new();
        while let Ok(batch) = live.try_recv() {
            got.extend(batch.iter().map(|r| {
                let payload: serde_json::Value =
                    serde_json::from_str(&r.payload).expect("a live payload is JSON");
                (r.seq, payload)
            }));
        }
        assert!(
            !got.is_empty(),
            "session {i}: its rows were not live when its reply came"
        );
        assert_eq!(
            got.last().map(|r| r.0),
            Some(head),
            "session {i}: the live rows reach the committed seq"
        );
        seen.extend(got);
    }
    let file: Vec<(u64, serde_json::Value)> = file_rows(&d)
        .into_iter()
        .map(|r| (r.seq, r.payload))
        .collect();
    assert_eq!(seen, file, "every row once, in order, as stored");
    d.shutdown().await;
}
