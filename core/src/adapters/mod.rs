//! Provider adapters: pure state machines that turn native provider messages into
//! [`NormalizedEvent`]s and engine [`ProviderRequest`]s into native messages.
//!
//! "Provider transports report provider facts; they do not decide whether a root
//! WorkspaceAgentTurn is complete." All provider routing state (thread maps, early drops,
//! cancellation boundaries, closed projection boundaries, reservations and their timers) lives in
//! the adapters, never in the engine; the engine knows nothing of Codex, Claude or ACP.
//!
//! An adapter serves exactly one root session (one live provider runtime per root tree). The
//! [`crate::Driver`] owns the adapters of the live roots and makes every call: `open` when the
//! adapter is attached, `on_native` for each provider message, `on_request` for each engine
//! request once its batch is committed, `on_timer` from its one timer queue, `on_dropped` for an
//! `interactionRequested` the engine did not take, `flush_text` before a `cancelTurn`. Per call,
//! the output's native messages go to the provider in order, its timers are armed, and its
//! events and then its answers go to the engine.
//!
//! Canonical ids for children are derived deterministically from the root session id and the
//! provider's own ids (see [`child_ids`]), so a replayed transcript yields the same ids.

pub mod acp;
pub mod claude;
pub mod codex;
pub mod fields;
pub mod response;

use crate::input::{NormalizedEvent, RuntimeAnswer};
use crate::model::{Id, Millis};
use crate::step::ProviderRequest;
use serde_json::Value;
use thiserror::Error;

/// What an adapter wants done after one input.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct AdapterOutput {
    /// Normalized events for the engine, in order.
    pub events: Vec<NormalizedEvent>,
    /// Runtime answers for the engine (`cancelResult`, `cancelFailed`, `guideFailed`), in order
    /// after `events`.
    pub answers: Vec<RuntimeAnswer>,
    /// Native messages to write to the provider process, in order.
    pub native: Vec<Value>,
    /// Timers to arm (an id the adapter chooses, and when).
    pub timers: Vec<AdapterTimer>,
    /// Diagnostics: identifiers and counts only, never content.
    pub diagnostics: Vec<String>,
}

impl AdapterOutput {
    /// Appends another output.
    pub fn extend(&mut self, other: AdapterOutput) {
        self.events.extend(other.events);
        self.answers.extend(other.answers);
        self.native.extend(other.native);
        self.timers.extend(other.timers);
        self.diagnostics.extend(other.diagnostics);
    }
}

/// A timer an adapter asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterTimer {
    /// Opaque id, given back to [`Adapter::on_timer`].
    pub id: String,
    /// When, in the driver's time (ms).
    pub at: Millis,
}

/// A native message the adapter cannot use. The message is dropped; nothing else changes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AdapterError {
    /// Not JSON, or not the protocol's envelope.
    #[error("malformed native message: {0}")]
    Malformed(String),
    /// A field the protocol requires is missing or has the wrong type.
    #[error("native message {method} lacks {field}")]
    MissingField {
        /// The message's method or kind.
        method: String,
        /// The missing field.
        field: &'static str,
    },
}

/// One provider's adapter for one root session.
///
/// `Any`: a host reaches an adapter's own methods (outside this trait) through
/// [`Driver::adapter`](crate::driver::Driver::adapter) and
/// [`DriverInput::Call`](crate::driver::DriverInput::Call) by downcasting.
pub trait Adapter: std::any::Any + Send {
    /// Native messages to send when the process starts (handshake), if any.
    fn open(&mut self, now: Millis) -> AdapterOutput;
    /// A request decided by the engine (start, guide, cancel, respondInteraction).
    fn on_request(&mut self, now: Millis, request: &ProviderRequest) -> AdapterOutput;
    /// One native message from the provider process.
    fn on_native(&mut self, now: Millis, message: &Value) -> Result<AdapterOutput, AdapterError>;
    /// A timer the adapter asked for fired.
    fn on_timer(&mut self, now: Millis, id: &str) -> AdapterOutput;
    /// The engine did not accept an event this adapter emitted (late, closed, or unknown). For
    /// an `interactionRequested` the provider is still waiting for an answer: the adapter answers
    /// it natively (refuse / cancel) so the provider never hangs. Default: nothing.
    fn on_dropped(&mut self, _now: Millis, _event: &NormalizedEvent) -> AdapterOutput {
        AdapterOutput::default()
    }
    /// Text buffered from the provider but not yet emitted, emitted now as `messageAppended`
    /// on the turn that produced it. Drivers call it just before they hand the engine a
    /// `cancelTurn`, so that text streamed before the cancel is recorded on the turn while it is
    /// still active (issue 23: "Flush buffered text before the cancel settles the turn; it is
    /// the user's record of what happened"); once the cancel is prepared, output of the canceled
    /// execution is dropped ("output from the canceled root execution is dropped"). Default:
    /// nothing (adapters that do not buffer text).
    fn flush_text(&mut self, _now: Millis) -> AdapterOutput {
        AdapterOutput::default()
    }
}

/// Removes and returns the earliest timer due at `now` (`at(timer) <= now`), for drivers and
/// replays that keep their armed timers in a list.
pub fn take_due<T>(timers: &mut Vec<T>, now: Millis, at: impl Fn(&T) -> Millis) -> Option<T> {
    let i = timers
        .iter()
        .enumerate()
        .filter(|(_, t)| at(t) <= now)
        .min_by_key(|(_, t)| at(t))
        .map(|(i, _)| i)?;
    Some(timers.remove(i))
}

/// Parses one native line; a typed error for garbage.
pub fn parse_line(line: &str) -> Result<Value, AdapterError> {
    let v: Value = serde_json::from_str(line.trim())
        .map_err(|e| AdapterError::Malformed(format!("not JSON ({} bytes): {e}", line.len())))?;
    if !v.is_object() {
        return Err(AdapterError::Malformed("not a JSON object".into()));
    }
    Ok(v)
}

/// Deterministic canonical ids for a child known by a provider handle: the child session id is
/// `{root}~{kind}-{native}` and its n-th turn (from 1) is `{child}~turn-{n}`. Characters outside
/// `[A-Za-z0-9_.-]` in the native id become `_` (plus a short hash of the original, so two
/// different native ids never collide), which keeps ids usable as URL path segments.
pub fn child_ids(root: &Id, kind: &str, native: &str, turn_no: u32) -> (Id, Id) {
    let clean: String = native
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let native = if clean == native {
        clean
    } else {
        use std::hash::Hasher;
        let mut h = crate::hash::FxHasher::default();
        h.write(native.as_bytes());
        format!("{clean}-{:08x}", h.finish() as u32)
    };
    let session: Id = format!("{root}~{kind}-{native}").into();
    let turn: Id = format!("{session}~turn-{turn_no}").into();
    (session, turn)
}

#[cfg(test)]
mod tests {
    use super::take_due;

    #[test]
    fn take_due_returns_due_timers_earliest_first_and_leaves_the_rest() {
        let mut timers = vec![("c", 30), ("a", 10), ("late", 99), ("b", 20)];
        let mut fired = Vec::new();
        while let Some((name, _)) = take_due(&mut timers, 30, |t| t.1) {
            fired.push(name);
        }
        assert_eq!(fired, ["a", "b", "c"]);
        assert_eq!(timers, [("late", 99)]);
    }
}
