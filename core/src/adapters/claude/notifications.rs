//! The task-notification ledger: which background-child notifications the SDK still owes a
//! follow-up root turn for.
//!
//! "The Claude continuation produced after a background child notification belongs to the same
//! canonical root turn." When several background children finish close together, the SDK answers
//! their notifications with *several* automatic follow-up turns (each a `result` with
//! `origin.kind == "task-notification"`), or with an empty one (`num_turns: 0`, no model call)
//! followed by a real one. Settling the root on the first of them loses the others' output, so
//! the adapter keeps the root provider lifecycle reserved until every notification it expects for
//! that canonical root turn has been answered.
//!
//! # The rule (from the SDK's types and the captured transcripts)
//!
//! - **Expected.** A notification is expected when a delegated background child reaches a task
//!   terminal (`task_updated` with a terminal status, or `task_notification`) that is not a
//!   user-initiated stop ("a user-initiated stop needs no model follow-up"), while the query runs
//!   and its root turn is not canceled. It is counted at the first of those two messages (the SDK
//!   sends `task_updated` first), once per child, so a follow-up can never be matched before its
//!   notification was counted.
//! - **Answered.** `sdk.d.ts` documents `origin.runId` of a `task-notification` follow-up as "the
//!   run_id its task_* events carried", so a follow-up names the run whose notification started it.
//!   The SDK answers notifications first in, first out, and a real follow-up consumes everything
//!   queued before it: in the captures (`core/tests/data/claude/bg_two_*.jsonl`, SDK 0.3.332)
//!   either follow-up 1 names run A and follow-up 2 names run B, or an empty follow-up naming A
//!   is followed by exactly one real follow-up naming B and no third one. So a non-empty
//!   follow-up naming run `X` answers `X` and every notification of that root turn expected
//!   before it. A follow-up without `runId` (older CLIs) answers the oldest. A follow-up naming a
//!   run the ledger never counted (a stopped task's) answers nothing.
//! - **Also during a root turn.** A notification delivered while a root provider turn runs its
//!   last model call is answered by a follow-up after that turn's `result` (capture
//!   `bg_two_during_guidance`), so any root `result` that leaves a notification outstanding keeps
//!   the reservation, not only a follow-up's. But when that running turn then completes a tool
//!   round (a root `user` message with a `tool_result`), its next model call carries the queued
//!   notifications and no follow-up comes (capture `bg_two_during_tool_round`: both
//!   `<task-notification>` blocks in the model request after the `Bash` round, no follow-up in
//!   the 4 s after the `result`). Such notifications are *folded*: that turn's `result` answers
//!   them.
//! - **Empty follow-ups.** A follow-up with `num_turns: 0` made no model call: its notification
//!   was consumed by another turn. It "counts as an answer only when no other notification is
//!   outstanding" (then it answers that last one); otherwise the real follow-up still comes.

use crate::model::Id;
use serde_json::Value;

/// One expected notification.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expected {
    /// The child key (its launching tool-use id, or task id).
    child: String,
    /// The task run id (`task_started.run_id`), when known.
    run_id: Option<String>,
    /// The canonical root turn whose follow-up it is.
    root_turn: Id,
    /// The root provider turn that was running (its model call in flight) when it was counted.
    during: Option<String>,
    /// That turn completed a tool round since: its next model call carries the notification.
    folded: bool,
}

/// What a follow-up `result` did to the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Answer {
    /// How many expected notifications it answered.
    pub(super) answered: usize,
    /// How many remain outstanding for the same canonical root turn.
    pub(super) outstanding: usize,
    /// It made no model call (`num_turns: 0`).
    pub(super) empty: bool,
}

/// The ledger of expected task notifications, in the order they were counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct NotificationLedger {
    expected: Vec<Expected>,
}

/// Whether an SDK `result` is an automatic follow-up to a task notification.
pub(super) fn is_follow_up(result: &Value) -> bool {
    result
        .get("origin")
        .and_then(|o| o.get("kind"))
        .and_then(Value::as_str)
        == Some("task-notification")
}

impl NotificationLedger {
    /// Counts the notification of `child` (idempotent per child); `during` is the root provider
    /// turn running at that moment, if any.
    pub(super) fn expect(
        &mut self,
        child: &str,
        run_id: Option<&str>,
        root_turn: &Id,
        during: Option<&str>,
    ) {
        if self.expected.iter().any(|e| e.child == child) {
            return;
        }
        self.expected.push(Expected {
            child: child.to_string(),
            run_id: run_id.map(str::to_string),
            root_turn: root_turn.clone(),
            during: during.map(str::to_string),
            folded: false,
        });
    }

    /// The running root provider turn `provider_turn` completed a tool round: the notifications
    /// delivered during it go into its next model call.
    pub(super) fn tool_round(&mut self, provider_turn: &str) {
        for e in &mut self.expected {
            if e.during.as_deref() == Some(provider_turn) {
                e.folded = true;
            }
        }
    }

    /// The `result` of `provider_turn`: the notifications folded into it are answered. Returns
    /// how many.
    pub(super) fn take_folded(&mut self, provider_turn: &str) -> usize {
        let before = self.expected.len();
        self.expected
            .retain(|e| !(e.folded && e.during.as_deref() == Some(provider_turn)));
        before - self.expected.len()
    }

    /// Notifications still owed a follow-up for this canonical root turn.
    pub(super) fn outstanding(&self, root_turn: &Id) -> usize {
        self.expected
            .iter()
            .filter(|e| &e.root_turn == root_turn)
            .count()
    }

    /// Every outstanding notification, whatever its root turn.
    pub(super) fn total(&self) -> usize {
        self.expected.len()
    }

    /// Forgets the notifications of one canonical root turn (canceled, or its reservation ended).
    pub(super) fn forget(&mut self, root_turn: &Id) -> usize {
        let before = self.expected.len();
        self.expected.retain(|e| &e.root_turn != root_turn);
        before - self.expected.len()
    }

    /// Forgets the notifications of every canonical root turn but `keep` (a new canonical root
    /// turn started: the earlier one has settled, and a late follow-up of it is only logged).
    pub(super) fn forget_others(&mut self, keep: &Id) -> usize {
        let before = self.expected.len();
        self.expected.retain(|e| &e.root_turn == keep);
        before - self.expected.len()
    }

    /// Forgets everything (the query ended: no follow-up can come).
    pub(super) fn clear(&mut self) {
        self.expected.clear();
    }

    /// Applies a root `result` attributed to `root_turn`. `None` when it is not a follow-up.
    pub(super) fn answer(&mut self, root_turn: &Id, result: &Value) -> Option<Answer> {
        if !is_follow_up(result) {
            return None;
        }
        let empty = result.get("num_turns").and_then(Value::as_u64) == Some(0);
        let run_id = result
            .get("origin")
            .and_then(|o| o.get("runId"))
            .and_then(Value::as_str);
        let mine: Vec<usize> = self
            .expected
            .iter()
            .enumerate()
            .filter(|(_, e)| &e.root_turn == root_turn)
            .map(|(i, _)| i)
            .collect();
        let named = run_id.and_then(|r| {
            mine.iter()
                .position(|&i| self.expected[i].run_id.as_deref() == Some(r))
        });
        // How many of `mine` (a prefix) this follow-up answers.
        let prefix = if empty {
            // "An empty follow-up counts as an answer only when no other notification is
            // outstanding."
            let only = mine.len() == 1 && (run_id.is_none() || named == Some(0));
            usize::from(only)
        } else {
            match (run_id, named) {
                (_, Some(p)) => p + 1,
                (None, None) => usize::from(!mine.is_empty()),
                // A run the ledger never counted (a stopped task's follow-up).
                (Some(_), None) => 0,
            }
        };
        let remove: Vec<usize> = mine.iter().take(prefix).copied().collect();
        for i in remove.iter().rev() {
            self.expected.remove(*i);
        }
        Some(Answer {
            answered: remove.len(),
            outstanding: mine.len() - remove.len(),
            empty,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn follow_up(run: Option<&str>, turns: u64) -> Value {
        let mut origin = json!({"kind": "task-notification"});
        if let Some(r) = run {
            origin["runId"] = json!(r);
        }
        json!({"type": "result", "subtype": "success", "num_turns": turns, "origin": origin})
    }

    fn two() -> (NotificationLedger, Id) {
        let t: Id = "T".into();
        let mut l = NotificationLedger::default();
        l.expect("a", Some("run-a"), &t, None);
        l.expect("b", Some("run-b"), &t, None);
        l.expect("a", Some("run-a"), &t, None);
        (l, t)
    }

    #[test]
    fn a_non_follow_up_result_answers_nothing() {
        let (mut l, t) = two();
        assert_eq!(l.answer(&t, &json!({"type": "result"})), None);
        assert_eq!(l.outstanding(&t), 2);
    }

    #[test]
    fn each_follow_up_answers_its_own_run_in_order() {
        let (mut l, t) = two();
        let a = l.answer(&t, &follow_up(Some("run-a"), 1)).unwrap();
        assert_eq!((a.answered, a.outstanding), (1, 1));
        let b = l.answer(&t, &follow_up(Some("run-b"), 1)).unwrap();
        assert_eq!((b.answered, b.outstanding), (1, 0));
    }

    #[test]
    fn a_follow_up_naming_a_later_run_answers_everything_queued_before_it() {
        let (mut l, t) = two();
        let b = l.answer(&t, &follow_up(Some("run-b"), 1)).unwrap();
        assert_eq!((b.answered, b.outstanding), (2, 0));
    }

    #[test]
    fn an_empty_follow_up_counts_only_when_nothing_else_is_outstanding() {
        let (mut l, t) = two();
        let e = l.answer(&t, &follow_up(Some("run-a"), 0)).unwrap();
        assert_eq!((e.answered, e.outstanding, e.empty), (0, 2, true));
        l.answer(&t, &follow_up(Some("run-a"), 1)).unwrap();
        let e = l.answer(&t, &follow_up(Some("run-b"), 0)).unwrap();
        assert_eq!((e.answered, e.outstanding), (1, 0));
    }

    #[test]
    fn unknown_runs_answer_nothing_and_missing_run_ids_answer_the_oldest() {
        let (mut l, t) = two();
        let x = l.answer(&t, &follow_up(Some("run-stopped"), 1)).unwrap();
        assert_eq!((x.answered, x.outstanding), (0, 2));
        let y = l.answer(&t, &follow_up(None, 1)).unwrap();
        assert_eq!((y.answered, y.outstanding), (1, 1));
        assert_eq!(l.outstanding(&"other".into()), 0);
        assert_eq!(l.forget_others(&t), 0);
        assert_eq!(l.forget_others(&"other".into()), 1);
        l.expect("c", None, &t, None);
        assert_eq!(l.forget(&t), 1);
        assert_eq!(l.total(), 0);
    }

    #[test]
    fn notifications_delivered_before_a_tool_round_of_the_running_turn_are_folded_into_it() {
        let t: Id = "T".into();
        let mut l = NotificationLedger::default();
        l.expect("a", Some("run-a"), &t, Some("claude-1"));
        l.expect("b", Some("run-b"), &t, Some("claude-2"));
        l.tool_round("claude-1");
        assert_eq!(
            l.take_folded("claude-2"),
            0,
            "not folded: no tool round of claude-2"
        );
        assert_eq!(l.take_folded("claude-1"), 1);
        assert_eq!(l.outstanding(&t), 1);
    }
}
