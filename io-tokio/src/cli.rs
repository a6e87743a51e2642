//! The `tutti` command line (the binary is a thin wrapper so test crates can ship the same
//! program).
//!
//! `tutti`: the command-line client of `tuttid`, plus offline tools.
//!
//! Live (through the HTTP API): `sessions`, `show ID`, `watch ID`, `submit ID TEXT`,
//! `cancel ID [TURN]`, `status`. Offline: `replay [--db FILE|postgres://...] SCENARIO.jsonl`, `snapshot --db FILE`,
//! `replay-native --provider codex|claude|acp FILE`.

use crate::config::data_dir;
use crate::render::{escape, render};
use clap::{Parser, Subcommand};
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use tutti_core::model::{Session, Turn};
use tutti_core::scenario;
use tutti_core::store::MemoryStore;

#[derive(Parser)]
#[command(
    name = "tutti",
    about = "tutti client: sessions, trees, submit, cancel, replay"
)]
struct Cli {
    /// Daemon address.
    #[arg(long, default_value = "127.0.0.1:7420", global = true)]
    addr: String,
    /// Bearer token file (default: the daemon's default).
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    /// Workspace.
    #[arg(long, default_value = "default", global = true)]
    workspace: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create a root session.
    New {
        /// Provider name.
        provider: String,
        /// Title.
        #[arg(long)]
        title: Option<String>,
    },
    /// List root sessions.
    Sessions,
    /// Show a session tree: each child lane under the tool call that spawned it.
    Show { id: String },
    /// Follow a session tree live from the event stream.
    Watch { id: String },
    /// Send a message to a root session.
    Submit { id: String, text: String },
    /// Cancel a turn (default: the session's active turn).
    Cancel { id: String, turn: Option<String> },
    /// One-screen summary of the daemon from `/healthz` and `/metrics` (version, uptime,
    /// database, live trees, waiting roots, processes, follower lag).
    Status {
        /// Read the metrics from this URL without auth (a `--metrics-listen` listener) instead
        /// of the API's `/metrics`.
        #[arg(long)]
        metrics_url: Option<String>,
    },
    /// Run a scenario file through the engine and a store (memory; an SQLite file with
    /// `--db FILE`; PostgreSQL with `--db postgres://...`); print the final trees (with `--db`,
    /// as read back from the store).
    Replay {
        #[arg(long)]
        db: Option<String>,
        file: PathBuf,
    },
    /// Print every tree stored in a database file.
    Snapshot {
        #[arg(long)]
        db: PathBuf,
    },
    /// Print the API's OpenAPI 3.1 document (offline: the one `GET /v1/openapi.json` serves).
    Openapi,
    /// Replay a captured native transcript through the adapter and the engine.
    ReplayNative {
        #[arg(long)]
        provider: String,
        file: PathBuf,
    },
}

/// Writes to stdout. A closed pipe (`tutti ... | head`) ends the program quietly with status 0,
/// as Unix tools do; any other write error ends it with a message and status 1.
fn out(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let r = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
    match r {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("tutti: cannot write to stdout: {e}");
            std::process::exit(1);
        }
    }
}

macro_rules! outln {
    ($($t:tt)*) => { out(&format!("{}\n", format_args!($($t)*))) };
}

/// Runs `tutti` with the process arguments.
pub fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(&cli) {
        eprintln!("tutti: {}", escape(&e));
        std::process::exit(1);
    }
}

/// The `tutti sessions` listing of a `GET .../agent-sessions` answer: one line per session
/// (id, provider, `idle` or `active TURN`, title), every field escaped as `tutti show` does,
/// the title quoted as there.
fn sessions_lines(v: &Value) -> String {
    let field = |s: &Value, k: &str| escape(s[k].as_str().unwrap_or(""));
    let mut text = String::new();
    for s in v["sessions"].as_array().into_iter().flatten() {
        let state = s["activeTurnId"]
            .as_str()
            .map_or("idle".to_string(), |t| format!("active {}", escape(t)));
        text.push_str(&format!(
            "{}  {}  {state}  \"{}\"\n",
            field(s, "id"),
            field(s, "provider"),
            field(s, "title"),
        ));
    }
    text
}

struct Client {
    base: String,
    token: String,
    ws: String,
}

impl Client {
    fn new(cli: &Cli) -> Result<Client, String> {
        let path = cli
            .token_file
            .clone()
            .unwrap_or_else(|| data_dir().join("token"));
        let token = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read token file {}: {e}", path.display()))?;
        Ok(Client {
            base: format!("http://{}", cli.addr),
            token: token.trim().to_string(),
            ws: cli.workspace.clone(),
        })
    }
    fn url(&self, rest: &str) -> String {
        format!(
            "{}/v1/workspaces/{}/agent-sessions{rest}",
            self.base, self.ws
        )
    }
    fn call(&self, method: &str, url: &str, body: Option<Value>) -> Result<Value, String> {
        let req =
            ureq::request(method, url).set("authorization", &format!("Bearer {}", self.token));
        let resp = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match resp {
            Ok(r) => r.into_json::<Value>().map_err(|e| e.to_string()),
            Err(ureq::Error::Status(code, r)) => {
                let v: Value = r.into_json().unwrap_or(Value::Null);
                Err(format!(
                    "HTTP {code}: {}",
                    v["error"]["message"].as_str().unwrap_or("error")
                ))
            }
            Err(e) => Err(e.to_string()),
        }
    }
    fn show(&self, id: &str) -> Result<String, String> {
        Ok(self.read_tree(id)?.0)
    }

    /// The rendered tree of `id`, its root's id and the event-stream position the read reflects
    /// (`eventSeq`).
    fn read_tree(&self, id: &str) -> Result<(String, String, u64), String> {
        let d = self.call("GET", &self.url(&format!("/{id}")), None)?;
        let seq = d["eventSeq"].as_u64().unwrap_or(0);
        let tree_root = d["session"]["rootAgentSessionId"]
            .as_str()
            .unwrap_or(id)
            .to_string();
        Ok((Self::render_detail(&d)?, tree_root, seq))
    }

    fn render_detail(d: &Value) -> Result<String, String> {
        let root: Session =
            serde_json::from_value(d["session"].clone()).map_err(|e| e.to_string())?;
        let kids: Vec<Session> =
            serde_json::from_value(d["childSessions"].clone()).map_err(|e| e.to_string())?;
        let turns: Vec<Turn> = serde_json::from_value(d["turns"].clone()).unwrap_or_default();
        Ok(render(&root, &kids, &turns))
    }

    /// `tutti watch ID` (issue 36: "`tutti watch` starts from the session's current read
    /// (`eventSeq`) and redraws only for rows of that tree, in place"). Draws the tree, then
    /// follows `GET /v1/events?after=eventSeq` of that read, so nothing already drawn is
    /// fetched again; a row of another tree is skipped unparsed beyond its root id; a row of
    /// this tree (or a `reset`: rows were lost, reload) marks the view stale, and it is read and
    /// drawn again once the rows received so far are consumed (a burst of rows is one redraw;
    /// under a flood, at least every 256 events). On a terminal a redraw replaces the screen
    /// (cursor home, clear); elsewhere (a pipe, a file) redraws are separated by a `----` line.
    /// The position followed is said on stderr (`watching ID after event N`).
    fn watch(&self, id: &str) -> Result<(), String> {
        use std::io::IsTerminal;
        let tty = std::io::stdout().is_terminal();
        let draw = |text: &str, first: bool| {
            if tty {
                out(&format!("\u{1b}[H\u{1b}[2J{text}"));
            } else {
                if !first {
                    outln!("----");
                }
                out(text);
            }
        };
        let (text, tree_root, after) = self.read_tree(id)?;
        draw(&text, true);
        eprintln!("watching {} after event {after}", escape(id));
        let resp = ureq::get(&format!("{}/v1/events?after={after}", self.base))
            .set("authorization", &format!("Bearer {}", self.token))
            .call()
            .map_err(|e| e.to_string())?;
        let mut reader = std::io::BufReader::new(resp.into_reader());
        let mut stale = false;
        // Events since the view went stale.
        let mut waited = 0u32;
        let mut event = String::new();
        let mut line = String::new();
        loop {
            line.clear();
            let n = reader.read_line(&mut line).map_err(|e| e.to_string())?;
            if n == 0 {
                return Ok(());
            }
            let l = line.trim_end_matches(['\r', '\n']);
            if let Some(name) = l.strip_prefix("event:") {
                event = name.trim().to_string();
            } else if let Some(data) = l.strip_prefix("data:") {
                stale |= event == "reset" || row_root(data).as_deref() == Some(&*tree_root);
            } else if l.is_empty() {
                event.clear();
                if stale {
                    waited += 1;
                }
                // Redraw once the rows already received are handled.
                if stale && (reader.buffer().is_empty() || waited >= 256) {
                    stale = false;
                    waited = 0;
                    draw(&self.show(id)?, false);
                }
            }
        }
    }
}

/// The `rootAgentSessionId` of an event-stream row (`None`: not a row).
fn row_root(data: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Row {
        root_agent_session_id: String,
    }
    serde_json::from_str::<Row>(data.trim())
        .ok()
        .map(|r| r.root_agent_session_id)
}

/// Runs a scenario through a fresh driver and `store`; returns every tree, read back from the
/// store when `stored` (so that two stores can be compared), else the engine's.
fn replay<S: tutti_core::store::HostStore>(
    text: &str,
    store: &mut S,
    stored: bool,
) -> Result<Vec<tutti_core::TreeSnapshot>, String> {
    let mut driver = tutti_core::Driver::new();
    let checks = scenario::run(text, &mut driver, store)?;
    let engine = driver.engine();
    eprintln!("{checks} checks passed");
    let mut snaps = Vec::new();
    for r in engine.roots() {
        let snap = if stored {
            store.load_tree(&r).map_err(|e| e.to_string())?
        } else {
            engine.snapshot(&r)
        };
        snaps.extend(snap);
    }
    Ok(snaps)
}

/// Prints `v` as pretty JSON. The JSON writer escapes C0 controls but leaves DEL and C1 controls
/// raw inside strings; those are written as `\uXXXX` escapes too, so the output is still the same
/// JSON and nothing in it drives the terminal.
fn print(v: &Value) {
    outln!("{}", json_text(v));
}

fn json_text(v: &Value) -> String {
    let text = serde_json::to_string_pretty(v).unwrap_or_default();
    let mut safe = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() && c != '\n' {
            safe.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            safe.push(c);
        }
    }
    safe
}

fn run(cli: &Cli) -> Result<(), String> {
    match &cli.cmd {
        Cmd::New { provider, title } => {
            let c = Client::new(cli)?;
            print(&c.call(
                "POST",
                &c.url(""),
                Some(json!({"provider": provider, "title": title})),
            )?);
        }
        Cmd::Sessions => {
            let c = Client::new(cli)?;
            out(&sessions_lines(&c.call("GET", &c.url(""), None)?));
        }
        Cmd::Show { id } => out(&Client::new(cli)?.show(id)?),
        Cmd::Watch { id } => Client::new(cli)?.watch(id)?,
        Cmd::Submit { id, text } => {
            let c = Client::new(cli)?;
            print(&c.call(
                "POST",
                &c.url(&format!("/{id}/submit")),
                Some(json!({"text": text})),
            )?);
        }
        Cmd::Cancel { id, turn } => {
            let c = Client::new(cli)?;
            let turn = match turn {
                Some(t) => t.clone(),
                None => {
                    let d = c.call("GET", &c.url(&format!("/{id}")), None)?;
                    d["session"]["activeTurnId"]
                        .as_str()
                        .ok_or("the session has no active turn")?
                        .to_string()
                }
            };
            print(&c.call(
                "POST",
                &c.url(&format!("/{id}/turns/{turn}/cancel")),
                Some(json!({})),
            )?);
        }
        Cmd::Replay { db, file } => {
            let text =
                std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
            let snaps = match db.as_deref() {
                Some(url) if tutti_postgres::PostgresStore::is_url(url) => replay(
                    &text,
                    &mut tutti_postgres::PostgresStore::connect(url).map_err(|e| e.to_string())?,
                    true,
                )?,
                Some(path) => replay(
                    &text,
                    &mut tutti_sqlite::SqliteStore::open(path).map_err(|e| e.to_string())?,
                    true,
                )?,
                None => replay(&text, &mut MemoryStore::new(), false)?,
            };
            print(&serde_json::to_value(snaps).map_err(|e| e.to_string())?);
        }
        Cmd::Status { metrics_url } => {
            let c = Client::new(cli)?;
            let health: Value = ureq::get(&format!("{}/healthz", c.base))
                .call()
                .map_err(|e| format!("healthz: {e}"))?
                .into_json()
                .map_err(|e| format!("healthz: {e}"))?;
            let req = match metrics_url {
                Some(u) => ureq::get(u),
                None => ureq::get(&format!("{}/metrics", c.base))
                    .set("authorization", &format!("Bearer {}", c.token)),
            };
            let text = req
                .call()
                .map_err(|e| format!("metrics: {e}"))?
                .into_string()
                .map_err(|e| format!("metrics: {e}"))?;
            out(&crate::status::render(&cli.addr, &health, &text));
        }
        Cmd::Openapi => {
            let doc = crate::openapi::document();
            let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
            outln!("{text}");
        }
        Cmd::Snapshot { db } => {
            let store = tutti_sqlite::SqliteStore::open_with(
                db,
                &tutti_sqlite::OpenOptions::new().create(false),
            )
            .map_err(|e| e.to_string())?;
            let snaps = store.snapshot_all().map_err(|e| e.to_string())?;
            print(&serde_json::to_value(snaps).map_err(|e| e.to_string())?);
        }
        Cmd::ReplayNative { provider, file } => {
            let text =
                std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
            let out = match provider.as_str() {
                "codex" => {
                    serde_json::to_value(tutti_core::replay::codex::replay_transcript(&text)?)
                }
                "claude" => {
                    serde_json::to_value(tutti_core::replay::claude::replay_transcript(&text)?)
                }
                "acp" => serde_json::to_value(tutti_core::replay::acp::replay_transcript(&text)?),
                other => return Err(format!("unknown provider {other} (codex, claude, acp)")),
            };
            print(&out.map_err(|e| e.to_string())?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOSTILE: &str = "evil\u{1b}]0;x\u{7}\u{1b}[2J\r\nfake line\u{9b}";

    #[test]
    fn sessions_listing_escapes_titles_and_ids_like_show() {
        let v = json!({"sessions": [
            {"id": "s1", "provider": "demo", "title": HOSTILE},
            {"id": "s\u{1b}[2J", "provider": "p\r", "activeTurnId": "t\n1"},
        ]});
        let text = sessions_lines(&v);
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{text:?}"
        );
        assert_eq!(text.lines().count(), 2, "{text:?}");
        let first = text.lines().next().unwrap_or_default();
        assert_eq!(
            first,
            format!("s1  demo  idle  \"{}\"", escape(HOSTILE)),
            "the same escaping as `tutti show`"
        );
        assert!(
            first.contains("\\u{1b}]0;x\\u{7}\\u{1b}[2J\\r\\nfake line"),
            "{first}"
        );
        assert!(text.contains("s\\u{1b}[2J  p\\r  active t\\n1"), "{text}");
    }

    #[test]
    fn json_output_escapes_del_and_c1_controls_and_stays_json() {
        let v = json!({"title": HOSTILE, "x": "a\u{7f}b"});
        let text = json_text(&v);
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{text:?}"
        );
        let back: Value = serde_json::from_str(&text).expect("still JSON");
        assert_eq!(back, v);
    }
}
