//! `tutti status`: a one-screen summary of a running daemon from `/healthz` and `/metrics`
//! (issue 22: "version, uptime, database, live trees, waiting roots, processes, follower lag").

use crate::render::escape;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write;

/// One sample of the exposition: metric name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name (with its `_total`, `_bucket`, ... suffix).
    pub name: String,
    /// Labels in the order written.
    pub labels: Vec<(String, String)>,
    /// Value.
    pub value: f64,
}

/// Why an exposition line is not a sample.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {why}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub why: &'static str,
}

/// Parses the samples of a text exposition (comments skipped). Label values are unescaped
/// (`\\`, `\"`, `\n`).
pub fn parse(text: &str) -> Result<Vec<Sample>, ParseError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let err = |why| ParseError { line: i + 1, why };
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).ok_or_else(|| err("no value"))?;
        let name = &line[..name_end];
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        {
            return Err(err("bad metric name"));
        }
        let mut rest = &line[name_end..];
        let mut labels = Vec::new();
        if let Some(r) = rest.strip_prefix('{') {
            rest = r;
            loop {
                if let Some(r) = rest.strip_prefix('}') {
                    rest = r;
                    break;
                }
                let eq = rest.find('=').ok_or_else(|| err("label without ="))?;
                let key = rest[..eq].trim_start_matches(',').to_string();
                let r = rest[eq + 1..]
                    .strip_prefix('"')
                    .ok_or_else(|| err("label value not quoted"))?;
                let mut value = String::new();
                let mut chars = r.char_indices();
                let end = loop {
                    match chars.next() {
                        None => return Err(err("unterminated label value")),
                        Some((j, '"')) => break j,
                        Some((_, '\\')) => match chars.next() {
                            Some((_, 'n')) => value.push('\n'),
                            Some((_, c)) => value.push(c),
                            None => return Err(err("unterminated escape")),
                        },
                        Some((_, c)) => value.push(c),
                    }
                };
                labels.push((key, value));
                rest = r[end + 1..].trim_start_matches(',');
            }
        }
        let value = rest
            .trim()
            .split(' ')
            .next()
            .ok_or_else(|| err("no value"))?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse::<f64>().map_err(|_| err("bad value"))?,
        };
        out.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    Ok(out)
}

/// The sum of a metric's samples whose labels include every `(key, value)` of `with`.
pub fn value(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            with.iter()
                .all(|(k, v)| s.labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|s| s.value)
        .sum::<f64>()
        // An empty sum is -0.0; shown as "0", not "-0".
        + 0.0
}

/// Values of one label of a metric's samples.
fn by_label(samples: &[Sample], name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    for s in samples.iter().filter(|s| s.name == name) {
        if let Some((_, v)) = s.labels.iter().find(|(k, _)| k == label) {
            *m.entry(v.clone()).or_default() += s.value;
        }
    }
    m
}

fn list(m: &BTreeMap<String, f64>) -> String {
    if m.is_empty() {
        return "none".into();
    }
    m.iter()
        .map(|(k, v)| format!("{} {v}", escape(k)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn duration(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    if d > 0 {
        format!("{d}d {h}h {m:02}m")
    } else if h > 0 {
        format!("{h}h {m:02}m {s:02}s")
    } else {
        format!("{m}m {s:02}s")
    }
}

/// The summary text of `tutti status` for the daemon at `addr`. Every text that comes from the
/// daemon or the user (the address, the version, the database label, label values such as
/// provider names) has its control characters escaped (issue 36: "every CLI output escapes
/// control characters"; the escaping of `tutti show`, [`crate::render::escape`]), so the
/// summary cannot drive the terminal.
pub fn render(addr: &str, health: &Value, metrics: &str) -> String {
    let addr = escape(addr);
    let mut o = String::new();
    let samples = match parse(metrics) {
        Ok(s) => s,
        Err(e) => {
            let _ = writeln!(o, "tuttid at {addr}: the metrics do not parse ({e})");
            return o;
        }
    };
    let v = |name: &str| value(&samples, name, &[]);
    let version = escape(health["version"].as_str().unwrap_or("?"));
    let up = health["uptimeSeconds"].as_u64().unwrap_or(0);
    let ok = if health["ok"].as_bool() == Some(true) {
        "ok"
    } else {
        "NOT OK"
    };
    let db = samples
        .iter()
        .find(|s| s.name == "tutti_info")
        .and_then(|s| s.labels.iter().find(|(k, _)| k == "database"))
        .map_or("?".to_string(), |(_, v)| escape(v));
    let _ = writeln!(o, "tuttid {version} at {addr}: {ok}, up {}", duration(up));
    let _ = writeln!(o, "database        {db}");
    let _ = writeln!(
        o,
        "live trees      {} ({} loaded)",
        v("tutti_live_trees"),
        v("tutti_resident_trees")
    );
    let _ = writeln!(
        o,
        "root turns      {}",
        list(&by_label(&samples, "tutti_active_root_turns", "phase"))
    );
    let _ = writeln!(
        o,
        "waiting roots   {} (provider turn ended, children running)",
        v("tutti_root_turns_waiting_on_children")
    );
    let _ = writeln!(
        o,
        "child turns     {} active; {} pending interactions",
        v("tutti_active_child_turns"),
        v("tutti_pending_interactions")
    );
    let _ = writeln!(
        o,
        "processes       {}",
        list(&by_label(&samples, "tutti_provider_processes", "provider"))
    );
    let _ = writeln!(
        o,
        "followers       {}; outbox head {}; slowest lag {} rows",
        v("tutti_sse_followers"),
        v("tutti_outbox_head_seq"),
        v("tutti_follower_lag_rows")
    );
    let _ = writeln!(
        o,
        "cancels         {}",
        list(&by_label(
            &samples,
            "tutti_cancel_operations_total",
            "result"
        ))
    );
    let commits = v("tutti_group_commit_seconds_count");
    let mean_ms = if commits > 0.0 {
        v("tutti_group_commit_seconds_sum") / commits * 1000.0
    } else {
        0.0
    };
    let _ = writeln!(
        o,
        "commits         {commits} (mean {mean_ms:.2} ms); {} failed",
        v("tutti_commit_failures_total")
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_with_escapes_and_rejects_garbage() {
        let s = parse("# HELP x y\nx_total{a=\"1\\\"2\",b=\"\"} 3\ny 4.5\n# EOF\n").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].labels[0], ("a".to_string(), "1\"2".to_string()));
        assert_eq!(s[1].value, 4.5);
        assert!(parse("x{a=1} 2").is_err());
        assert!(parse("x 2z").is_err());
    }

    /// Issue 36: "every CLI output escapes control characters": a hostile version, database
    /// path, provider name or address reaches `tutti status`'s output only as visible escapes.
    #[test]
    fn status_escapes_control_characters_of_the_daemons_texts() {
        let hostile = "\u{1b}]0;owned\u{7}\u{1b}[2J\r";
        let health =
            serde_json::json!({"ok": true, "version": format!("1.0{hostile}"), "uptimeSeconds": 5});
        let metrics = "tutti_info{database=\"/tmp/a\u{1b}[2J\\nb.db\"} 1\n\
                       tutti_provider_processes{provider=\"evil\u{1b}]0;x\u{7}\"} 2\n\
                       tutti_active_root_turns{phase=\"run\rning\"} 1\n# EOF\n";
        let out = render(&format!("127.0.0.1:7420{hostile}"), &health, metrics);
        assert!(
            !out.chars().any(|c| c.is_control() && c != '\n'),
            "no control character but line ends: {out:?}"
        );
        assert_eq!(out.lines().count(), 10, "one line per field: {out:?}");
        assert!(out.contains("\\u{1b}]0;owned\\u{7}"), "{out}");
        assert!(out.contains("/tmp/a\\u{1b}[2J\\nb.db"), "{out}");
        assert!(out.contains("evil\\u{1b}]0;x\\u{7} 2"), "{out}");
        assert!(!out.contains("-0"), "absent metrics are 0: {out}");
    }
}
