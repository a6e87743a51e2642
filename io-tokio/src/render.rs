//! Text rendering of a session tree for the user's own terminal: each child lane under the tool
//! call that spawned it, with its current turn's phase and outcome, and a failed turn's error
//! text (escaped, at most [`ERROR_CHARS`] characters). Identifiers, titles, states and errors;
//! never message content. (The privacy rule is for logs; this is the user's view of their own
//! tree.)

use tutti_core::model::{Session, Turn};

/// Why a tree could not be rendered.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RenderError {
    /// The store could not be read.
    #[error(transparent)]
    Read(#[from] crate::reads::ReadError),
    /// No such session.
    #[error("no such session")]
    NotFound,
}

/// Escapes `text` for a terminal: exactly the escaping `tutti show` applies to titles (Rust's
/// `Debug` form of a string, without the surrounding quotes), so control characters (ESC, BEL,
/// CR, LF, DEL, C1), quotes and backslashes come out as visible escapes (`\u{1b}`, `\r`, `\n`,
/// `\"`) and never reach the terminal. Every CLI output of provider- or user-supplied text
/// (titles, ids, errors) goes through it.
pub fn escape(text: &str) -> String {
    let quoted = format!("{text:?}");
    quoted[1..quoted.len() - 1].to_string()
}

/// How many characters of a turn's error a tree line shows (longer ones end with `…`).
pub const ERROR_CHARS: usize = 160;

/// How a tree is rendered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RenderOptions {
    /// Show each child by the shortest suffix of its id (split at `-` and `~`) that no other
    /// session of the tree ends with, after `…`, instead of the whole id (child ids carry the
    /// root's and the provider's ids and wrap every line). For a person watching; `tutti show`
    /// keeps whole ids, which the other commands take.
    pub short_ids: bool,
}

/// Renders a session and its nested children from a store, with short ids (`tuttid demo`).
pub fn render_tree(s: &dyn crate::reads::Reads, id: &str) -> Result<String, RenderError> {
    let d = s.session_detail(id)?.ok_or(RenderError::NotFound)?;
    let turns: Vec<Turn> = std::iter::once(&d.session)
        .chain(d.child_sessions.iter())
        .filter_map(|x| {
            x.last_turn_id
                .as_ref()
                .and_then(|t| s.turn(t).ok().flatten())
        })
        .collect();
    Ok(render_with(
        &d.session,
        &d.child_sessions,
        &turns,
        RenderOptions { short_ids: true },
    ))
}

/// Renders a session, its nested children (flat, any order) and their latest turns, with whole
/// ids.
pub fn render(root: &Session, children: &[Session], turns: &[Turn]) -> String {
    render_with(root, children, turns, RenderOptions::default())
}

/// The shortest suffix of `id` at a `-`/`~` boundary that no id of `others` ends with (`…`
/// before it), or the whole id.
fn short_id(id: &str, others: &[&str]) -> String {
    let cuts: Vec<usize> = id
        .char_indices()
        .filter(|(_, c)| *c == '-' || *c == '~')
        .map(|(i, c)| i + c.len_utf8())
        .rev()
        .collect();
    for cut in cuts {
        let suffix = &id[cut..];
        let clash = others.iter().any(|o| {
            *o != id
                && (o.ends_with(&format!("-{suffix}"))
                    || o.ends_with(&format!("~{suffix}"))
                    || *o == suffix)
        });
        if !suffix.is_empty() && !clash {
            return format!("…{suffix}");
        }
    }
    id.to_string()
}

/// [`render`] with options.
pub fn render_with(
    root: &Session,
    children: &[Session],
    turns: &[Turn],
    opts: RenderOptions,
) -> String {
    let ids: Vec<&str> = std::iter::once(&*root.id)
        .chain(children.iter().map(|c| &*c.id))
        .collect();
    let shown = |s: &Session| -> String {
        if opts.short_ids && s.is_child() {
            short_id(&s.id, &ids)
        } else {
            s.id.to_string()
        }
    };
    let turn_of = |x: &Session| -> Option<&Turn> {
        let id = x.last_turn_id.as_ref()?;
        turns.iter().find(|t| &t.id == id)
    };
    let mut out = String::new();
    line(&mut out, 0, root, &shown(root), turn_of(root));
    let mut stack: Vec<(usize, &Session)> = children
        .iter()
        .filter(|c| c.parent_agent_session_id() == Some(&root.id))
        .rev()
        .map(|c| (1, c))
        .collect();
    while let Some((depth, c)) = stack.pop() {
        line(&mut out, depth, c, &shown(c), turn_of(c));
        stack.extend(
            children
                .iter()
                .filter(|k| k.parent_agent_session_id() == Some(&c.id))
                .rev()
                .map(|k| (depth + 1, k)),
        );
    }
    out
}

fn line(out: &mut String, depth: usize, s: &Session, id: &str, t: Option<&Turn>) {
    let indent = "    ".repeat(depth);
    let state = match t {
        Some(t) => match (&t.outcome(), &t.error()) {
            (Some(o), Some(e)) => {
                let mut shown: String = e.chars().take(ERROR_CHARS).collect();
                if e.chars().count() > ERROR_CHARS {
                    shown.push('…');
                }
                format!(
                    "settled {}: {}",
                    format!("{o:?}").to_lowercase(),
                    escape(&shown)
                )
            }
            (Some(o), None) => format!("settled {}", format!("{o:?}").to_lowercase()),
            (None, _) => format!("{:?}", t.phase()).to_lowercase(),
        },
        None => "idle".into(),
    };
    let title = escape(s.title.as_deref().unwrap_or_default());
    let via = s
        .parent_tool_call_id()
        .map(|c| format!(" <- tool call {}", escape(c)))
        .unwrap_or_default();
    let provider = t
        .and_then(|t| t.root_provider_turn())
        .map(|r| {
            format!(
                " [root provider {}]",
                format!("{:?}", r.phase()).to_lowercase()
            )
        })
        .unwrap_or_default();
    let kind = if s.is_child() { "child" } else { "root" };
    out.push_str(&format!(
        "{indent}{kind} {} \"{title}\"{via}: {state}{provider}\n",
        escape(id)
    ));
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn child(id: &str, parent: &str) -> Session {
        serde_json::from_value(json!({"id": id, "workspaceId": "w", "kind": "child",
            "parentAgentSessionId": parent, "parentTurnId": "t", "rootAgentSessionId": "s_1",
            "rootTurnId": "t", "provider": "demo", "providerAliases": {},
            "lastTurnId": format!("{id}~turn-1"), "createdAt": 0, "updatedAt": 0, "version": 1}))
        .expect("a child session")
    }

    fn turn(session: &str, outcome: &str, error: Option<&str>) -> Turn {
        serde_json::from_value(
            json!({"id": format!("{session}~turn-1"), "agentSessionId": session,
            "trigger": "delegation", "phase": "settled", "outcome": outcome, "error": error,
            "createdAt": 0, "updatedAt": 0, "version": 1}),
        )
        .expect("a turn")
    }

    /// Issue 30: "the demo's terminal tree shows short readable ids (a suffix or the title) and
    /// the child's error text" (escaped, capped); `tutti show` keeps whole ids.
    #[test]
    fn the_demo_tree_shows_short_unique_ids_and_the_error_text() {
        let root: Session = serde_json::from_value(json!({"id": "s_1", "workspaceId": "w",
            "kind": "root", "provider": "demo", "providerAliases": {}, "createdAt": 0,
            "updatedAt": 0, "version": 1}))
        .expect("a root");
        let a = "s_1~acp-demo-session-1a2-1-t1-child-1";
        let b = "s_1~acp-demo-session-1a2-1-t2-child-1";
        let g = "s_1~acp-demo-session-1a2-1-t1-child-1-child-1";
        let kids = vec![child(a, "s_1"), child(b, "s_1"), child(g, a)];
        let long = "x".repeat(ERROR_CHARS + 5);
        let turns = vec![
            turn(a, "failed", Some("subagent failed: boom\u{1b}[2J")),
            turn(b, "completed", None),
            turn(g, "interrupted", Some(&long)),
        ];
        let short = render_with(&root, &kids, &turns, RenderOptions { short_ids: true });
        assert!(short.contains("child …t1-child-1 "), "{short}");
        assert!(short.contains("child …t2-child-1 "), "{short}");
        assert!(short.contains("child …1-child-1 "), "{short}");
        assert!(!short.contains("acp-demo-session"), "{short}");
        assert!(
            short.contains("settled failed: subagent failed: boom\\u{1b}[2J"),
            "the error text, escaped: {short}"
        );
        assert!(short.contains(&format!("{}…", "x".repeat(ERROR_CHARS))));
        assert!(!short.contains(&"x".repeat(ERROR_CHARS + 1)));
        let whole = render(&root, &kids, &turns);
        assert!(whole.contains(&format!("child {a} ")), "{whole}");
    }
}
