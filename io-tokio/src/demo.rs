//! `tuttid demo`: submits a prompt to the demo ACP agent and shows the root turn and its child
//! lanes updating live, answering the child's permission request on the user's behalf.

use crate::clock::new_id;
use crate::daemon::Daemon;
use crate::render::render_tree;
use std::io::IsTerminal;
use std::time::Duration;
use tutti_core::model::{Id, InteractionStatus};
use tutti_core::{Command, Input};

/// The demo's prompt: directives the demo agent understands (see `agents::demo`).
pub const DEMO_PROMPT: &str =
    "Survey this project and report back. children=3 fail=1 permission=1 late=1 nested=1";

/// The workspace the demo session lives in.
pub const DEMO_WORKSPACE: &str = "demo";

/// A `tutti` command line that lists the demo's session as printed (issue 17: "`tuttid demo`
/// prints a CLI example that works as printed").
pub fn cli_example(addr: &str, token_file: &std::path::Path) -> String {
    format!(
        "tutti --addr {addr} --token-file {} --workspace {DEMO_WORKSPACE} sessions",
        token_file.display()
    )
}

/// Why the demo stopped.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The daemon refused or failed a call.
    #[error(transparent)]
    Daemon(#[from] crate::daemon::DaemonError),
    /// The root turn did not settle within 120 s.
    #[error("the demo did not settle within 120 s")]
    Unsettled,
    /// A read task failed.
    #[error("read task: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Runs the demo until the root turn settles. `login`, the web view's one-time login link, is
/// printed under the tree at every redraw (a terminal redraw clears what was printed before).
pub async fn run(d: &Daemon, login: Option<&str>) -> Result<(), DemoError> {
    let root: Id = new_id("s").into();
    d.call(Input::Command(Command::CreateSession {
        agent_session_id: root.clone(),
        workspace_id: DEMO_WORKSPACE.into(),
        provider: "demo".into(),
        title: Some("tutti demo".into()),
        capabilities: d.providers().capabilities("demo"),
    }))
    .await?;
    let turn: Id = new_id("t").into();
    d.call(Input::Command(Command::Submit {
        agent_session_id: root.clone(),
        turn_id: turn.clone(),
        text: DEMO_PROMPT.into(),
    }))
    .await?;
    let tty = std::io::stdout().is_terminal();
    let mut watch = d.outbox_watch();
    let mut last = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let r = root.clone();
        let (text, settled, pending) = {
            let d2 = d.clone();
            tokio::task::spawn_blocking(move || {
                d2.read(|s| {
                    let text = render_tree(s, &r).unwrap_or_else(|e| format!("(read failed: {e})"));
                    let settled = s
                        .session(&r)
                        .ok()
                        .flatten()
                        .is_some_and(|x| x.active_turn_id.is_none());
                    (text, settled, pending_interactions(s, &r))
                })
            })
            .await??
        };
        if text != last {
            if tty {
                print!("\x1b[2J\x1b[H");
            } else {
                println!("----");
            }
            println!("{text}");
            if let Some(link) = login {
                println!("web view: {link}");
            }
            last = text;
        }
        for (session, turn, request) in pending {
            println!("  -> answering permission {request} of {session} with allow");
            let _ = d
                .call(Input::Command(Command::RespondInteraction {
                    agent_session_id: session,
                    turn_id: turn,
                    request_id: request,
                    response: serde_json::json!("allow"),
                }))
                .await;
        }
        if settled {
            println!("root turn settled.");
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(DemoError::Unsettled);
        }
        let _ = tokio::time::timeout(Duration::from_millis(500), watch.changed()).await;
    }
}

fn pending_interactions(s: &dyn crate::reads::Reads, root: &Id) -> Vec<(Id, Id, Id)> {
    let Ok(Some(t)) = s.load_tree(root) else {
        return Vec::new();
    };
    t.interactions
        .into_iter()
        .filter(|i| i.status == InteractionStatus::Pending)
        .map(|i| (i.agent_session_id, i.turn_id, i.request_id))
        .collect()
}
