//! Helpers shared by the daemon-core tests: a temporary directory, the real provider registry
//! with the demo ACP agent, and the daemon calls and reads the tests make.
#![allow(dead_code)]

use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tutti_core::adapters::Adapter;
use tutti_core::model::{Capabilities, Id};
use tutti_core::{Command, EngineConfig, Input};
use tutti_tokio::config::{ConfigFile, ProviderConfig, ProviderKind};
use tutti_tokio::daemon::{Daemon, DaemonOptions, LaunchError, ProviderFactory};
use tutti_tokio::providers::Registry;
use tutti_tokio::retention::Retention;
use tutti_tokio::runtime::Transport;

/// A temporary directory, removed when dropped.
pub struct TempDir(std::path::PathBuf);
impl TempDir {
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn tempdir(name: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!("tutti-io-tokio-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    TempDir(dir)
}

pub const DEMO: &str = env!("CARGO_BIN_EXE_tutti-demo-agent");
pub const WS: &str = "w";

/// The real provider registry with the demo agent, recording the `cwd` of every launch.
pub struct Recording {
    pub inner: Registry,
    pub launches: Mutex<Vec<(Id, Option<String>)>>,
}

impl ProviderFactory for Recording {
    fn capabilities(&self, provider: &str) -> Option<Capabilities> {
        self.inner.capabilities(provider)
    }
    fn launch(
        &self,
        provider: &str,
        root: &Id,
        cwd: Option<&str>,
        previous: Option<&str>,
    ) -> Result<(Box<dyn Adapter>, Transport), LaunchError> {
        if let Ok(mut l) = self.launches.lock() {
            l.push((root.clone(), cwd.map(str::to_string)));
        }
        self.inner.launch(provider, root, cwd, previous)
    }
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
}

/// The real provider registry with the demo ACP agent as provider `agent`.
pub fn demo_registry() -> Registry {
    let mut providers = BTreeMap::new();
    providers.insert(
        "agent".to_string(),
        ProviderConfig {
            kind: ProviderKind::Acp,
            command: vec![DEMO.to_string()],
            env: BTreeMap::from([("TUTTI_DEMO_SPEED".to_string(), "16".to_string())]),
            guide_while_children_only: None,
            options: None,
        },
    );
    let config = ConfigFile {
        providers,
        ..ConfigFile::default()
    };
    Registry::with_builtins(config).expect("registry")
}

/// [`demo_registry`], recording the `cwd` of every launch.
pub fn registry() -> Arc<Recording> {
    Arc::new(Recording {
        inner: demo_registry(),
        launches: Mutex::new(Vec::new()),
    })
}

pub fn start(dir: &std::path::Path, providers: Arc<Recording>, retention: Retention) -> Daemon {
    Daemon::start(DaemonOptions {
        durability: Default::default(),
        max_providers: None,
        db: dir.join("t.db"),
        providers,
        engine: EngineConfig::default(),
        idle_timeout: None,
        retention,
    })
    .expect("start")
}

pub async fn create(d: &Daemon, id: &str) {
    let caps = d.providers().capabilities("agent");
    d.call(Input::Command(Command::CreateSession {
        agent_session_id: id.into(),
        workspace_id: WS.into(),
        provider: "agent".into(),
        title: None,
        capabilities: caps,
    }))
    .await
    .expect("create");
}

pub async fn submit(d: &Daemon, id: &str, turn: &str, text: &str) {
    d.call(Input::Command(Command::Submit {
        agent_session_id: id.into(),
        turn_id: turn.into(),
        text: text.into(),
    }))
    .await
    .expect("submit accepted");
}

/// The whole stored tree (sessions, turns, interactions, tool calls, cancel operations) with the
/// session detail folded in, and every message of every session of the tree.
pub fn reads(d: &Daemon, root: &str) -> (Value, Vec<Value>) {
    let root = root.to_string();
    d.read(move |r| {
        let tree = r.load_tree(&root).expect("tree").expect("exists");
        let mut detail = serde_json::to_value(&tree).expect("json");
        let sd = r.session_detail(&root).expect("detail").expect("exists");
        let sd = serde_json::to_value(&sd).expect("json");
        detail["session"] = sd["session"].clone();
        detail["childSessions"] = sd["childSessions"].clone();
        let mut ids = vec![root.clone()];
        if let Some(children) = detail["childSessions"].as_array() {
            ids.extend(
                children
                    .iter()
                    .filter_map(|c| c["id"].as_str().map(str::to_string)),
            );
        }
        let mut msgs = Vec::new();
        for id in ids {
            for m in r.messages(&id, None, 10_000).expect("messages") {
                msgs.push(serde_json::to_value(&m).expect("json"));
            }
        }
        (detail, msgs)
    })
    .expect("read")
}

/// Waits until the tree's root turn `turn` has an outcome and no session of the tree is active.
pub async fn settled(d: &Daemon, root: &str, turn: &str) -> (Value, Vec<Value>) {
    let start = Instant::now();
    loop {
        let (detail, msgs) = reads(d, root);
        let root_done = detail["turns"].as_array().is_some_and(|ts| {
            ts.iter()
                .any(|t| t["id"] == turn && t["outcome"].is_string())
        });
        let children_idle = detail["childSessions"]
            .as_array()
            .is_none_or(|cs| cs.iter().all(|c| c["activeTurnId"].is_null()));
        if root_done && children_idle && detail["session"]["activeTurnId"].is_null() {
            return (detail, msgs);
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the tree did not settle: {detail}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
