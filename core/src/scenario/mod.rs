//! Scenario files: the engine's executable contract (`design.md`, "Scenario files").
//!
//! A scenario is JSON lines: `{"at": ms, "input": {...}}` feeds an input; `{"expect": {...}}`
//! checks a stored entity; `{"expectLast": {...}}` checks the previous input's step;
//! `{"expectInvariants": true}` runs the invariant checker. The runner is pure: it takes the
//! file's text, a [`Driver`] and any [`HostStore`], so the same scenario runs in memory and
//! against SQLite or PostgreSQL.
//!
//! ## The runner is a host of the [`Driver`]
//!
//! Each input line becomes a [`DriverInput::Host`](crate::driver::DriverInput::Host) (`now`:
//! the line's `at`; a reply token). The runner commits every batch the driver hands out
//! ([`Output::Persist`](crate::driver::Output::Persist)) to the store, one at a time, reports it
//! committed or not committed (a failed guard or a fence as refused), and carries out what the
//! commits release until the driver is idle. A batch the store does not commit fails the
//! scenario at that input with the driver's answer (`store refused the step: ...`).
//! `expectLast` checks what the driver released for the input, not the engine's step: `reply`
//! is the name of the reply in its [`Output::Reply`](crate::driver::Output::Reply), `rejected`
//! whether that reply is the engine's rejection, `outboxTurns` and `outboxToolCalls` the rows of
//! its [`Output::Publish`](crate::driver::Output::Publish) (the payloads the store wrote), and
//! `providerRequests` the requests the driver routed to the roots' adapters. The runner also
//! fails an input whose reply or provider requests leave the driver before its batch was
//! committed (the driver's first guarantee; `core/tests/scenarios.rs`,
//! `a_reply_is_released_only_after_its_batch_commits`, checks the refused case).
//!
//! Design choice: the provider side stays scripted by the scenario's own input lines. Every
//! root gets a passive scenario adapter (`host::ScenarioAdapter`: it records the requests it is
//! given and emits nothing), attached before each input to every root the engine holds and to
//! a root the driver asks to launch. So a `cancel` or `guide` reaches an adapter instead of
//! being answered "no live provider runtime" by the driver, a `start` launches nothing, no
//! timer fires unless a line feeds `timerFired`, and a scenario means what it meant when the
//! runner fed the engine directly. The runner never feeds native messages, exits or timeouts.
//! `expectInvariants` checks the driver's engine ([`Driver::engine`]) and the store.
//!
//! Beyond the design's `turn` and `session` expectations, `expect` also accepts
//! `{"interaction": REQUEST_ID, "turnId": T, ...}`, `{"cancelOperation": ID, ...}`,
//! `{"messages": SESSION_ID, "texts": [...]}` (exact texts in order),
//! `{"toolCall": TOOL_CALL_ID, "agentSessionId": SESSION_ID, ...}` (fields of the stored tool
//! call) and
//! `{"detail": SESSION_ID, "childSessions": [IDS]}` (the set of nested child ids).
//!
//! The runner is strict about the format, so that a typo fails instead of passing silently: a
//! key an expectation does not know (a field the entity does not have, a key of `expectLast`
//! other than `rejected`, `reply`, `providerRequests`, `outboxTurns`, `outboxToolCalls`
//! (`[{"toolCallId", "status"}]`: the tool call rows the step published)), a value of the wrong type
//! (`"rejected": "yes"`), an expectation that names nothing to check (`{"turn": "T"}` alone:
//! write `"exists": true` to check only existence; `{"messages": S}` without `texts` or
//! `count`; an empty `expectLast`), `expectInvariants` other than `true`, or a key of an input
//! line other than `at` and `input` is a format error of that file, reported with its line.

mod host;

use crate::driver::Driver;
use crate::engine::Engine;
use crate::input::Input;
use crate::invariants::check_tree;
use crate::model::{CancelOperation, Interaction, Millis, Session, ToolCall, Turn};
use crate::store::{HostStore, MemoryStore, Store};
use host::{Last, Released};
use serde_json::{Map, Value};

/// Runs a scenario through a driver (a new one, without adapters: the runner attaches its own)
/// and a store. Returns the number of checks passed, or a message naming the failing line.
pub fn run<S: HostStore>(text: &str, driver: &mut Driver, store: &mut S) -> Result<usize, String> {
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
            only_keys(&v, &["at", "input"]).map_err(fail)?;
            let at: Millis = match v.get("at") {
                None => 0,
                Some(at) => at
                    .as_i64()
                    .ok_or_else(|| fail(format!("`at` must be an integer, got {at}")))?,
            };
            let input: Input = serde_json::from_value(input.clone())
                .map_err(|e| fail(format!("bad input: {e}")))?;
            last = host::feed(driver, store, at, input).map_err(fail)?;
        } else if let Some(exp) = v.get("expect") {
            only_keys(&v, &["expect"]).map_err(fail)?;
            expect(exp, store).map_err(fail)?;
            checks += 1;
        } else if let Some(exp) = v.get("expectLast") {
            only_keys(&v, &["expectLast"]).map_err(fail)?;
            expect_last(exp, &last).map_err(fail)?;
            checks += 1;
        } else if let Some(flag) = v.get("expectInvariants") {
            only_keys(&v, &["expectInvariants"]).map_err(fail)?;
            if *flag != Value::Bool(true) {
                return Err(fail(format!("`expectInvariants` must be true, got {flag}")));
            }
            invariants(driver.engine(), store).map_err(fail)?;
            checks += 1;
        } else {
            return Err(fail("unknown line kind".into()));
        }
    }
    Ok(checks)
}

/// The outcome of one scenario file in [`run_all`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileOutcome {
    /// The file's name, as given.
    pub name: String,
    /// The number of checks it passed, or why it failed.
    pub result: Result<usize, String>,
}

/// Runs scenario files, given as (name, text), each through a fresh [`Driver`] and
/// [`MemoryStore`]: the one loop of both scenario test runners (`tutti-core`'s and
/// `tutti-tests`'), which only list and read the files. A file that checks nothing fails
/// ("the scenario checks nothing"): a contract file must assert something.
pub fn run_all<'a>(files: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<FileOutcome> {
    files
        .into_iter()
        .map(|(name, text)| {
            let result = match run(text, &mut Driver::new(), &mut MemoryStore::new()) {
                Ok(0) => Err("the scenario checks nothing".to_string()),
                other => other,
            };
            FileOutcome {
                name: name.to_string(),
                result,
            }
        })
        .collect()
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

/// A format error unless every key of the line's object is one of `allowed`.
fn only_keys(v: &Value, allowed: &[&str]) -> Result<(), String> {
    let Some(obj) = v.as_object() else {
        return Err("a line must be a JSON object".into());
    };
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(format!("unknown key `{k}` (allowed here: {allowed:?})")),
        None => Ok(()),
    }
}

/// The wire names of the fields of `T` (what `#[derive(Deserialize)]` of a struct declares), so
/// that an expectation naming a field the entity does not have is a format error rather than a
/// comparison with an absent field that passes for `null`.
fn field_names<'de, T: serde::Deserialize<'de>>() -> &'static [&'static str] {
    struct Fields(Option<&'static [&'static str]>);
    #[derive(Debug)]
    struct Stop;
    impl std::fmt::Display for Stop {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("field names read")
        }
    }
    impl std::error::Error for Stop {}
    impl serde::de::Error for Stop {
        fn custom<M: std::fmt::Display>(_: M) -> Self {
            Stop
        }
    }
    impl<'de> serde::Deserializer<'de> for &mut Fields {
        type Error = Stop;
        fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
            Err(Stop)
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Stop> {
            self.0 = Some(fields);
            Err(Stop)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut f = Fields(None);
    let _ = T::deserialize(&mut f);
    f.0.unwrap_or(&[])
}

fn id_of<'a>(exp: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    exp.get(key).and_then(Value::as_str)
}

fn expect<S: Store>(exp: &Value, store: &S) -> Result<(), String> {
    let exp = exp.as_object().ok_or("expect takes an object")?;
    let e = |r: Result<Option<Value>, S::Error>| r.map_err(|e| e.to_string());
    type Found = (
        String,
        Option<Value>,
        &'static [&'static str],
        &'static [&'static str],
    );
    let (what, found, skip, fields): Found = if let Some(id) = id_of(exp, "turn") {
        (
            format!("turn {id}"),
            e(store.turn(id).map(to))?,
            &["turn"],
            field_names::<Turn>(),
        )
    } else if let Some(id) = id_of(exp, "session") {
        (
            format!("session {id}"),
            e(store.session(id).map(to))?,
            &["session"],
            field_names::<Session>(),
        )
    } else if let Some(id) = id_of(exp, "interaction") {
        let turn = id_of(exp, "turnId").ok_or("interaction expectations need turnId")?;
        (
            format!("interaction {id}"),
            e(store.interaction(turn, id).map(to))?,
            &["interaction", "turnId"],
            field_names::<Interaction>(),
        )
    } else if let Some(id) = id_of(exp, "toolCall") {
        let session =
            id_of(exp, "agentSessionId").ok_or("tool call expectations need agentSessionId")?;
        (
            format!("tool call {id} of {session}"),
            to(tool_call_of(store, session, id)?),
            &["toolCall", "agentSessionId"],
            field_names::<ToolCall>(),
        )
    } else if let Some(id) = id_of(exp, "cancelOperation") {
        (
            format!("cancel operation {id}"),
            e(store.cancel_operation(id).map(to))?,
            &["cancelOperation"],
            field_names::<CancelOperation>(),
        )
    } else if let Some(id) = id_of(exp, "messages") {
        only_keys(&Value::Object(exp.clone()), &["messages", "texts", "count"])?;
        if !exp.contains_key("texts") && !exp.contains_key("count") {
            return Err(format!(
                "messages of {id}: names neither `texts` nor `count`"
            ));
        }
        let msgs = store
            .messages(id, None, usize::MAX)
            .map_err(|e| e.to_string())?;
        let texts: Vec<Value> = msgs
            .iter()
            .map(|m| Value::String(m.text.to_string()))
            .collect();
        if let Some(want) = exp.get("texts") {
            if !want
                .as_array()
                .is_some_and(|w| w.iter().all(Value::is_string))
            {
                return Err(format!("`texts` must be an array of strings, got {want}"));
            }
            if *want != Value::Array(texts.clone()) {
                return Err(format!("messages of {id}: want {want}, got {texts:?}"));
            }
        }
        if let Some(n) = exp.get("count") {
            let n = n
                .as_u64()
                .ok_or_else(|| format!("`count` must be a whole number, got {n}"))?;
            if n as usize != msgs.len() {
                return Err(format!("messages of {id}: want {n}, got {}", msgs.len()));
            }
        }
        return Ok(());
    } else if let Some(id) = id_of(exp, "detail") {
        only_keys(&Value::Object(exp.clone()), &["detail", "childSessions"])?;
        let d = store
            .session_detail(id)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("no session detail for {id}"))?;
        let mut got: Vec<String> = d.child_sessions.iter().map(|s| s.id.to_string()).collect();
        got.sort();
        let want = exp
            .get("childSessions")
            .ok_or_else(|| format!("detail of {id}: names no `childSessions`"))?;
        {
            let mut want: Vec<String> = want
                .as_array()
                .and_then(|w| w.iter().map(|v| v.as_str().map(String::from)).collect())
                .ok_or_else(|| format!("`childSessions` must be an array of ids, got {want}"))?;
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
    if let Some(k) = exp
        .keys()
        .find(|k| !skip.contains(&k.as_str()) && *k != "exists" && !fields.contains(&k.as_str()))
    {
        return Err(format!("{what}: unknown key `{k}` (not a field of it)"));
    }
    if exp.len() == skip.len() {
        return Err(format!(
            "{what}: names no field to check (write \"exists\": true to check existence)"
        ));
    }
    let exists = match exp.get("exists") {
        None => true,
        Some(b) => b
            .as_bool()
            .ok_or_else(|| format!("`exists` must be a boolean, got {b}"))?,
    };
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

/// The stored tool call `(session, call)`, read from its tree's snapshot (the store has no
/// tool call lookup of its own; scenarios are small).
fn tool_call_of<S: Store>(
    store: &S,
    session: &str,
    call: &str,
) -> Result<Option<ToolCall>, String> {
    let Some(s) = store.session(session).map_err(|e| e.to_string())? else {
        return Ok(None);
    };
    let root = s.tree_root_id().clone();
    let tree = store.load_tree(&root).map_err(|e| e.to_string())?;
    Ok(tree.and_then(|t| {
        t.tool_calls
            .into_iter()
            .find(|c| &*c.agent_session_id == session && &*c.tool_call_id == call)
    }))
}

fn expect_last(exp: &Value, last: &Last) -> Result<(), String> {
    let exp = exp.as_object().ok_or("expectLast takes an object")?;
    only_keys(
        &Value::Object(exp.clone()),
        &[
            "rejected",
            "reply",
            "providerRequests",
            "outboxTurns",
            "outboxToolCalls",
        ],
    )?;
    if exp.is_empty() {
        return Err("expectLast names nothing to check".into());
    }
    let typed = |k: &str, ok: fn(&Value) -> bool, what: &str| match exp.get(k) {
        Some(v) if !ok(v) => Err(format!("`{k}` must be {what}, got {v}")),
        _ => Ok(()),
    };
    typed("rejected", Value::is_boolean, "a boolean")?;
    typed("reply", Value::is_string, "a string")?;
    typed(
        "providerRequests",
        |v| v.as_array().is_some_and(|a| a.iter().all(Value::is_object)),
        "an array of objects",
    )?;
    typed(
        "outboxTurns",
        |v| v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
        "an array of turn ids",
    )?;
    if let Some(want) = exp.get("rejected").and_then(Value::as_bool) {
        let got = matches!(last, Last::Rejected(_));
        if want != got {
            return Err(match last {
                Last::Rejected(e) => format!("want accepted, was rejected: {e}"),
                _ => "want rejected, was accepted".to_string(),
            });
        }
    }
    // What the driver released for the input (nothing when it was rejected).
    let none = Released::default();
    let released = match last {
        Last::Accepted(r) => r.as_ref(),
        _ => &none,
    };
    if let Some(want) = exp.get("reply").and_then(Value::as_str) {
        let got = released.reply;
        if got != Some(want) {
            return Err(format!("reply: want {want}, got {got:?}"));
        }
    }
    if let Some(want) = exp.get("providerRequests").and_then(Value::as_array) {
        let got: Vec<Value> = released
            .provider
            .iter()
            .map(|r| serde_json::to_value(r).unwrap_or(Value::Null))
            .collect();
        if got.len() != want.len() || !assign(want, &got, &mut vec![false; got.len()]) {
            return Err(format!(
                "providerRequests: want {}, got {}",
                Value::Array(want.clone()),
                Value::Array(got)
            ));
        }
    }
    // The published rows of one kind, as the store wrote them.
    let published = |kind: &'static str| {
        released
            .published
            .iter()
            .filter(move |(k, _)| *k == kind)
            .map(|(_, payload)| payload)
    };
    let field = |payload: &Value, k: &str| payload.get(k).cloned().unwrap_or(Value::Null);
    if let Some(want) = exp.get("outboxToolCalls") {
        // `[{"toolCallId": ID, "status": S}, ...]`: exactly the tool call rows the step
        // published, in the order published.
        let want = want
            .as_array()
            .filter(|a| a.iter().all(Value::is_object))
            .ok_or_else(|| format!("`outboxToolCalls` must be an array of objects, got {want}"))?;
        let got: Vec<Value> = published("toolCall")
            .map(|c| {
                serde_json::json!({
                    "toolCallId": field(c, "toolCallId"),
                    "status": field(c, "status"),
                })
            })
            .collect();
        if !matches(&Value::Array(want.clone()), &Value::Array(got.clone())) {
            return Err(format!(
                "outboxToolCalls: want {}, got {}",
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
        let mut got: Vec<String> = published("turn")
            .map(|t| match field(t, "id") {
                Value::String(id) => id,
                other => other.to_string(),
            })
            .collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    const SETUP: &str = r#"{"input":{"type":"createSession","agentSessionId":"R","workspaceId":"W","provider":"test"}}
{"at":1,"input":{"type":"submit","agentSessionId":"R","turnId":"T","text":"hi"}}
"#;

    /// Runs `SETUP` then `line` (line 3) and returns the runner's answer.
    fn run_with(line: &str) -> Result<usize, String> {
        let text = format!("{SETUP}{line}\n");
        run(&text, &mut Driver::new(), &mut MemoryStore::new())
    }

    /// "a format error of that file (FAIL with the line), not a silent pass".
    fn assert_format_error(line: &str, needle: &str) {
        match run_with(line) {
            Ok(n) => panic!("{line}: passed with {n} checks, want a format error"),
            Err(e) => {
                assert!(
                    e.starts_with("line 3: "),
                    "{line}: error names no line: {e}"
                );
                assert!(e.contains(needle), "{line}: want {needle:?} in {e:?}");
            }
        }
    }

    #[test]
    fn run_all_fails_a_file_that_checks_nothing_and_reports_each_file() {
        let checked = format!("{SETUP}{{\"expect\":{{\"turn\":\"T\",\"phase\":\"submitted\"}}}}\n");
        let out = run_all([
            ("empty", SETUP),
            ("checked", checked.as_str()),
            ("bad", "nope"),
        ]);
        let names: Vec<&str> = out.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["empty", "checked", "bad"]);
        assert_eq!(
            out[0].result,
            Err("the scenario checks nothing".to_string())
        );
        assert_eq!(out[1].result, Ok(1));
        assert!(out[2]
            .result
            .as_ref()
            .is_err_and(|e| e.contains("not JSON")));
    }

    #[test]
    fn well_formed_expectations_pass_and_count_as_checks() {
        let ok = r#"{"expect":{"turn":"T","phase":"submitted","outcome":null}}"#;
        assert_eq!(run_with(ok), Ok(1));
        assert_eq!(run_with(r#"{"expect":{"turn":"T","exists":true}}"#), Ok(1));
        assert_eq!(run_with(r#"{"expect":{"turn":"X","exists":false}}"#), Ok(1));
        assert_eq!(run_with(r#"{"expectLast":{"rejected":false}}"#), Ok(1));
        assert_eq!(run_with(r#"{"expect":{"messages":"R","count":1}}"#), Ok(1));
        assert_eq!(
            run_with(r#"{"expect":{"detail":"R","childSessions":[]}}"#),
            Ok(1)
        );
        assert_eq!(run_with(r#"{"expectInvariants":true}"#), Ok(1));
    }

    #[test]
    fn a_wrong_value_still_fails_as_a_mismatch() {
        assert_format_error(
            r#"{"expect":{"turn":"T","phase":"running"}}"#,
            "field phase",
        );
        assert_format_error(r#"{"expectLast":{"rejected":true}}"#, "want rejected");
    }

    #[test]
    fn an_unknown_key_in_expect_is_a_format_error() {
        // A misspelt field compared with an absent one would pass for `null`.
        assert_format_error(
            r#"{"expect":{"turn":"T","outcom":null}}"#,
            "unknown key `outcom`",
        );
        assert_format_error(
            r#"{"expect":{"session":"R","phase":"running"}}"#,
            "unknown key `phase`",
        );
        assert_format_error(
            r#"{"expect":{"messages":"R","text":["a"]}}"#,
            "unknown key `text`",
        );
        assert_format_error(
            r#"{"expect":{"detail":"R","children":[]}}"#,
            "unknown key `children`",
        );
        assert_format_error(r#"{"expect":{"turn":"T","exists":"yes"}}"#, "`exists`");
        assert_format_error(
            r#"{"expect":{"turn":"T","exists":true},"x":1}"#,
            "unknown key `x`",
        );
    }

    #[test]
    fn an_unknown_key_or_wrong_type_in_expect_last_is_a_format_error() {
        assert_format_error(
            r#"{"expectLast":{"rejectd":true}}"#,
            "unknown key `rejectd`",
        );
        assert_format_error(r#"{"expectLast":{"rejected":"yes"}}"#, "`rejected` must be");
        assert_format_error(r#"{"expectLast":{"reply":1}}"#, "`reply` must be");
        assert_format_error(
            r#"{"expectLast":{"outboxTurns":"T"}}"#,
            "`outboxTurns` must be",
        );
        assert_format_error(
            r#"{"expectLast":{"providerRequests":["cancel"]}}"#,
            "`providerRequests` must be",
        );
    }

    #[test]
    fn an_expectation_that_names_nothing_to_check_is_a_format_error() {
        assert_format_error(r#"{"expect":{"turn":"T"}}"#, "names no field");
        assert_format_error(r#"{"expect":{"messages":"R"}}"#, "neither");
        assert_format_error(r#"{"expect":{"detail":"R"}}"#, "no `childSessions`");
        assert_format_error(r#"{"expectLast":{}}"#, "nothing to check");
        assert_format_error(r#"{"expect":{}}"#, "names no entity");
        assert_format_error(r#"{"expectInvariants":false}"#, "must be true");
    }

    #[test]
    fn a_malformed_input_line_is_a_format_error() {
        assert_format_error(
            r#"{"at":"soon","input":{"type":"createSession","agentSessionId":"Q","workspaceId":"W","provider":"test"}}"#,
            "`at` must be an integer",
        );
        assert_format_error(
            r#"{"at":2,"inptu":{},"input":{"type":"createSession","agentSessionId":"Q","workspaceId":"W","provider":"test"}}"#,
            "unknown key `inptu`",
        );
    }

    #[test]
    fn provider_requests_are_what_the_driver_routed_to_the_roots_scenario_adapter() {
        let text = format!(
            "{SETUP}{}\n{}\n{}\n",
            r#"{"expectLast":{"reply":"started","outboxTurns":["T"],"providerRequests":[{"type":"start","turnId":"T","text":"hi"}]}}"#,
            r#"{"at":2,"input":{"type":"cancelTurn","agentSessionId":"R","operationId":"C","turnId":"T"}}"#,
            r#"{"expectLast":{"reply":"cancelAccepted","providerRequests":[{"type":"cancel","operationId":"C"}]}}"#,
        );
        let mut driver = Driver::new();
        let mut store = MemoryStore::new();
        assert_eq!(run(&text, &mut driver, &mut store), Ok(2));
        // The root has the runner's passive adapter: the cancel reached it instead of being
        // answered "no live provider runtime" by the driver.
        assert!(driver.has_adapter("R"));
        let op = store.cancel_operation("C").ok().flatten();
        assert!(
            op.is_some_and(|op| op.error.is_none()),
            "the cancel did not fail"
        );
    }

    #[test]
    fn field_names_are_the_wire_names_of_the_entity() {
        let turn = field_names::<Turn>();
        assert!(turn.contains(&"phase") && turn.contains(&"rootProviderTurn"));
        assert!(!turn.contains(&"root_provider_turn"));
        assert!(field_names::<Session>().contains(&"parentAgentSessionId"));
    }
}
