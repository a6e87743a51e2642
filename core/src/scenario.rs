//! Scenario files: the engine's executable contract (`design.md`, "Scenario files").
//!
//! A scenario is JSON lines: `{"at": ms, "input": {...}}` feeds an input; `{"expect": {...}}`
//! checks a stored entity; `{"expectLast": {...}}` checks the previous input's step;
//! `{"expectInvariants": true}` runs the invariant checker. The runner is pure: it takes the
//! file's text and any [`Store`], so the same scenario runs in memory and against SQLite.
//!
//! Beyond the design's `turn` and `session` expectations, `expect` also accepts
//! `{"interaction": REQUEST_ID, "turnId": T, ...}`, `{"cancelOperation": ID, ...}`,
//! `{"messages": SESSION_ID, "texts": [...]}` (exact texts in order) and
//! `{"detail": SESSION_ID, "childSessions": [IDS]}` (the set of nested child ids).

use crate::engine::Engine;
use crate::input::Input;
use crate::invariants::check_tree;
use crate::model::Millis;
use crate::step::Step;
use crate::store::Store;
use serde_json::{Map, Value};

/// What happened to the previous input.
#[derive(Debug, Clone)]
enum Last {
    None,
    Accepted(Box<Step>),
    Rejected(String),
}

/// Runs a scenario through an engine and a store. Returns the number of checks passed, or a
/// message naming the failing line.
pub fn run<S: Store>(text: &str, engine: &mut Engine, store: &mut S) -> Result<usize, String> {
    let mut last = Last::None;
    let mut checks = 0;
    for (n, line) in text.lines().enumerate() {
        let line_no = n + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with("//") || line.starts_with('#') {
            continue;
        }
        let v: Value =
            serde_json::from_str(line).map_err(|e| format!("line {line_no}: not JSON: {e}"))?;
        let fail = |msg: String| format!("line {line_no}: {msg}");
        if let Some(input) = v.get("input") {
            let at: Millis = v.get("at").and_then(Value::as_i64).unwrap_or(0);
            let input: Input = serde_json::from_value(input.clone())
                .map_err(|e| fail(format!("bad input: {e}")))?;
            last = match engine.handle(at, &input) {
                Ok(step) => {
                    if let Err(e) = store.apply(&step.persist) {
                        return Err(fail(format!("store refused the step: {e}")));
                    }
                    Last::Accepted(Box::new(step))
                }
                Err(e) => Last::Rejected(e.to_string()),
            };
        } else if let Some(exp) = v.get("expect") {
            expect(exp, store).map_err(fail)?;
            checks += 1;
        } else if let Some(exp) = v.get("expectLast") {
            expect_last(exp, &last).map_err(fail)?;
            checks += 1;
        } else if v.get("expectInvariants").is_some() {
            invariants(engine, store).map_err(fail)?;
            checks += 1;
        } else {
            return Err(fail("unknown line kind".into()));
        }
    }
    Ok(checks)
}

/// Checks the invariants on the engine, on every stored tree, and that the store holds exactly
/// the engine's state.
pub fn invariants<S: Store>(engine: &Engine, store: &S) -> Result<(), String> {
    let v = engine.check_invariants();
    if !v.is_empty() {
        return Err(format!("invariants (engine): {v:?}"));
    }
    for root in engine.roots() {
        let stored = store
            .load_tree(&root)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("tree {root} missing from the store"))?;
        let v = check_tree(&stored);
        if !v.is_empty() {
            return Err(format!("invariants (store): {v:?}"));
        }
        let mem = engine.snapshot(&root);
        if mem.as_ref() != Some(&stored) {
            return Err(format!("store and engine differ for tree {root}"));
        }
    }
    Ok(())
}

fn to<T: serde::Serialize>(x: Option<T>) -> Option<Value> {
    x.map(|x| serde_json::to_value(x).unwrap_or(Value::Null))
}

fn id_of<'a>(exp: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    exp.get(key).and_then(Value::as_str)
}

fn expect<S: Store>(exp: &Value, store: &S) -> Result<(), String> {
    let exp = exp.as_object().ok_or("expect takes an object")?;
    let e = |r: Result<Option<Value>, S::Error>| r.map_err(|e| e.to_string());
    let (what, found, skip): (String, Option<Value>, &[&str]) = if let Some(id) = id_of(exp, "turn")
    {
        (format!("turn {id}"), e(store.turn(id).map(to))?, &["turn"])
    } else if let Some(id) = id_of(exp, "session") {
        (
            format!("session {id}"),
            e(store.session(id).map(to))?,
            &["session"],
        )
    } else if let Some(id) = id_of(exp, "interaction") {
        let turn = id_of(exp, "turnId").ok_or("interaction expectations need turnId")?;
        (
            format!("interaction {id}"),
            e(store.interaction(turn, id).map(to))?,
            &["interaction", "turnId"],
        )
    } else if let Some(id) = id_of(exp, "cancelOperation") {
        (
            format!("cancel operation {id}"),
            e(store.cancel_operation(id).map(to))?,
            &["cancelOperation"],
        )
    } else if let Some(id) = id_of(exp, "messages") {
        let msgs = store
            .messages(id, None, usize::MAX)
            .map_err(|e| e.to_string())?;
        let texts: Vec<Value> = msgs
            .iter()
            .map(|m| Value::String(m.text.to_string()))
            .collect();
        if let Some(want) = exp.get("texts") {
            if *want != Value::Array(texts.clone()) {
                return Err(format!("messages of {id}: want {want}, got {texts:?}"));
            }
        }
        if let Some(n) = exp.get("count").and_then(Value::as_u64) {
            if n as usize != msgs.len() {
                return Err(format!("messages of {id}: want {n}, got {}", msgs.len()));
            }
        }
        return Ok(());
    } else if let Some(id) = id_of(exp, "detail") {
        let d = store
            .session_detail(id)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("no session detail for {id}"))?;
        let mut got: Vec<String> = d.child_sessions.iter().map(|s| s.id.to_string()).collect();
        got.sort();
        if let Some(want) = exp.get("childSessions").and_then(Value::as_array) {
            let mut want: Vec<String> = want
                .iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect();
            want.sort();
            if want != got {
                return Err(format!(
                    "detail of {id}: want children {want:?}, got {got:?}"
                ));
            }
        }
        return Ok(());
    } else {
        return Err("expect names no entity (turn, session, interaction, ...)".into());
    };
    let exists = exp.get("exists").and_then(Value::as_bool).unwrap_or(true);
    match (exists, &found) {
        (false, None) => return Ok(()),
        (false, Some(_)) => return Err(format!("{what} exists")),
        (true, None) => return Err(format!("{what} does not exist")),
        (true, Some(_)) => {}
    }
    let found = found.unwrap_or(Value::Null);
    for (k, want) in exp {
        if skip.contains(&k.as_str()) || k == "exists" {
            continue;
        }
        let got = found.get(k).unwrap_or(&Value::Null);
        if !matches(want, got) {
            return Err(format!("{what}: field {k}: want {want}, got {got}"));
        }
    }
    Ok(())
}

/// Subset matching: objects match as subsets (recursively), arrays element by element with the
/// same length, `null` means absent.
pub fn matches(want: &Value, got: &Value) -> bool {
    match (want, got) {
        (Value::Null, g) => g.is_null(),
        (Value::Object(w), Value::Object(g)) => w
            .iter()
            .all(|(k, wv)| matches(wv, g.get(k).unwrap_or(&Value::Null))),
        (Value::Array(w), Value::Array(g)) => {
            w.len() == g.len() && w.iter().zip(g).all(|(a, b)| matches(a, b))
        }
        (w, g) => w == g,
    }
}

fn expect_last(exp: &Value, last: &Last) -> Result<(), String> {
    let exp = exp.as_object().ok_or("expectLast takes an object")?;
    if let Some(want) = exp.get("rejected").and_then(Value::as_bool) {
        let got = matches!(last, Last::Rejected(_));
        if want != got {
            return Err(match last {
                Last::Rejected(e) => format!("want accepted, was rejected: {e}"),
                _ => "want rejected, was accepted".to_string(),
            });
        }
    }
    let step = match last {
        Last::Accepted(s) => Some(s.as_ref()),
        _ => None,
    };
    if let Some(want) = exp.get("reply").and_then(Value::as_str) {
        let got = step.and_then(|s| s.reply.as_ref()).map(|r| r.name());
        if got != Some(want) {
            return Err(format!("reply: want {want}, got {got:?}"));
        }
    }
    if let Some(want) = exp.get("providerRequests").and_then(Value::as_array) {
        let got: Vec<Value> = step
            .map(|s| {
                s.provider
                    .iter()
                    .map(|r| serde_json::to_value(r).unwrap_or(Value::Null))
                    .collect()
            })
            .unwrap_or_default();
        if got.len() != want.len() || !assign(want, &got, &mut vec![false; got.len()]) {
            return Err(format!(
                "providerRequests: want {}, got {}",
                Value::Array(want.clone()),
                Value::Array(got)
            ));
        }
    }
    if let Some(want) = exp.get("outboxTurns").and_then(Value::as_array) {
        let mut want: Vec<String> = want
            .iter()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
        want.sort();
        let mut got: Vec<String> = step
            .map(|s| s.outbox_turns().map(|t| t.to_string()).collect())
            .unwrap_or_default();
        got.sort();
        got.dedup();
        if want != got {
            return Err(format!("outboxTurns: want {want:?}, got {got:?}"));
        }
    }
    Ok(())
}

/// Each wanted object subset-matches a distinct emitted one (backtracking; lists are short).
fn assign(want: &[Value], got: &[Value], used: &mut Vec<bool>) -> bool {
    let Some((first, rest)) = want.split_first() else {
        return true;
    };
    for i in 0..got.len() {
        if !used[i] && matches(first, &got[i]) {
            used[i] = true;
            if assign(rest, got, used) {
                return true;
            }
            used[i] = false;
        }
    }
    false
}
