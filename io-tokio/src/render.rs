//! Text rendering of a session tree: each child lane under the tool call that spawned it, with
//! its current turn's phase and outcome. Identifiers, titles and states only, never message
//! content.

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

/// Renders a session and its nested children from a store.
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
    Ok(render(&d.session, &d.child_sessions, &turns))
}

/// Renders a session, its nested children (flat, any order) and their latest turns.
pub fn render(root: &Session, children: &[Session], turns: &[Turn]) -> String {
    let turn_of = |x: &Session| -> Option<&Turn> {
        let id = x.last_turn_id.as_ref()?;
        turns.iter().find(|t| &t.id == id)
    };
    let mut out = String::new();
    line(&mut out, 0, root, turn_of(root));
    let mut stack: Vec<(usize, &Session)> = children
        .iter()
        .filter(|c| c.parent_agent_session_id() == Some(&root.id))
        .rev()
        .map(|c| (1, c))
        .collect();
    while let Some((depth, c)) = stack.pop() {
        line(&mut out, depth, c, turn_of(c));
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

fn line(out: &mut String, depth: usize, s: &Session, t: Option<&Turn>) {
    let indent = "    ".repeat(depth);
    let state = match t {
        Some(t) => match (&t.outcome, &t.error) {
            (Some(o), Some(e)) => {
                format!(
                    "settled {} (error, {} chars)",
                    format!("{o:?}").to_lowercase(),
                    e.len()
                )
            }
            (Some(o), None) => format!("settled {}", format!("{o:?}").to_lowercase()),
            (None, _) => format!("{:?}", t.phase).to_lowercase(),
        },
        None => "idle".into(),
    };
    let title = escape(s.title.as_deref().unwrap_or_default());
    let via = s
        .parent_tool_call_id()
        .map(|c| format!(" <- tool call {}", escape(c)))
        .unwrap_or_default();
    let provider = t
        .and_then(|t| t.root_provider_turn.as_ref())
        .map(|r| {
            format!(
                " [root provider {}]",
                format!("{:?}", r.phase).to_lowercase()
            )
        })
        .unwrap_or_default();
    let kind = if s.is_child() { "child" } else { "root" };
    out.push_str(&format!(
        "{indent}{kind} {} \"{title}\"{via}: {state}{provider}\n",
        escape(&s.id)
    ));
}
