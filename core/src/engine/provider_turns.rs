//! The root session's provider turn index: "root provider facts belong to the provider turn they
//! name". A root provider event that names a provider turn id already recorded on a root turn
//! is about that root turn, whatever turn is active now; only an id never seen before may bind
//! to the active root turn.
//!
//! The index is derived state: it is exactly the function [`ProviderTurns::rebuild`] computes
//! from the root turns' lifecycle fields (`rootProviderTurn.providerTurnId` and
//! `earlierProviderTurnIds`), so a tree restored from a snapshot or the store has the same
//! index as the tree that wrote it. One tree holds one root session, so a tree's index is that
//! session's index.
//!
//! Choice (the issue assumes a provider turn id names one provider turn forever): Claude's
//! `claude-N`/`synthetic-N` counters and ACP's `prompt-<rpc id>` restart with the provider
//! process, so after a restart a later root turn may record an id an older, settled root turn
//! recorded too. The index then keeps the *first* owner, defined as the least
//! `(createdAt, turn id)` among the root turns recording the id: a pure function of the turns,
//! whatever order they are recorded or loaded in. Whether a later turn may record such an id
//! is decided by the gate (`resolve_root_turn`), not here.

use crate::keyed::IdMap;
use crate::model::{Id, Millis, Turn};

/// Provider turn id -> the root turn that owns it, with that turn's `createdAt` (the ordering
/// key of the first owner).
#[derive(Debug, Clone, Default)]
pub(crate) struct ProviderTurns {
    owners: IdMap<(Millis, Id)>,
}

impl ProviderTurns {
    /// The root turn that owns `provider_turn_id`, if it was ever recorded.
    #[inline]
    pub fn owner(&self, provider_turn_id: &str) -> Option<&Id> {
        self.owners.get(provider_turn_id).map(|(_, t)| t)
    }

    /// Records that the root turn `turn` (created at `created_at`) recorded `provider_turn_id`.
    /// The owner stays the least `(createdAt, turn id)` of the turns recording it: the minimum
    /// of the owner so far and this turn (on a tie, the same turn, the owner so far is kept).
    pub fn record(&mut self, provider_turn_id: &str, turn: &Id, created_at: Millis) {
        let key = Id::from(provider_turn_id);
        let slot = self
            .owners
            .get_or_insert_with(&key, || (created_at, turn.clone()));
        *slot = std::cmp::min(slot.clone(), (created_at, turn.clone()));
    }

    /// Records every provider turn id on a root turn (its current and earlier ones).
    pub fn record_turn(&mut self, turn: &Turn) {
        if let Some(r) = turn.root_provider_turn() {
            for p in r.provider_turn_ids() {
                self.record(p, &turn.id, turn.created_at);
            }
        }
    }

    /// The index of a set of turns (child turns carry no root provider lifecycle and are
    /// skipped).
    pub fn rebuild<'a>(turns: impl IntoIterator<Item = &'a Turn>) -> ProviderTurns {
        let mut index = ProviderTurns::default();
        for t in turns {
            index.record_turn(t);
        }
        index
    }

    /// Drops the ids whose owner is no longer a turn of the tree (after a deletion removed
    /// turns): rebuilt from the remaining turns, so the index stays the function of the turns.
    pub fn rebuild_from<'a>(&mut self, turns: impl IntoIterator<Item = &'a Turn>) {
        *self = ProviderTurns::rebuild(turns);
    }

    /// Whether this index is exactly the one derived from `turns` (the invariant the engine's
    /// checker verifies after every step).
    pub fn matches<'a>(&self, turns: impl IntoIterator<Item = &'a Turn>) -> bool {
        let want = ProviderTurns::rebuild(turns);
        want.owners.len() == self.owners.len()
            && want
                .owners
                .iter()
                .all(|(p, o)| self.owners.get(p).is_some_and(|mine| mine == o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Outcome, ProviderTurnState, RootProviderTurn, Settlement, TurnState};

    fn root_turn(id: &str, created_at: Millis, current: &str, earlier: &[&str]) -> Turn {
        let completed = || Settlement::new(Outcome::Completed, None);
        let mut t = Turn::root(
            Id::from(id),
            Id::from("root"),
            TurnState::Settled(completed()),
            created_at,
        );
        if let Some(r) = t.root_provider_turn_mut() {
            *r = RootProviderTurn {
                state: ProviderTurnState::Completed(completed()),
                provider_turn_id: Some(current.to_string()),
                earlier_provider_turn_ids: earlier.iter().map(|s| s.to_string()).collect(),
            };
        }
        t.version = 1;
        t
    }

    /// "A provider turn id already recorded on a root turn always resolves to that turn": the
    /// index names the first owner of a reused id whatever order the turns come in, so a
    /// restored tree resolves exactly as the tree that wrote it.
    #[test]
    fn reused_provider_turn_id_keeps_its_first_owner_in_any_order() {
        let a = root_turn("t1", 10, "p2", &["p1"]);
        let b = root_turn("t2", 20, "p1", &[]);
        let c = root_turn("t0", 20, "p3", &[]);
        let one = ProviderTurns::rebuild([&a, &b, &c]);
        let two = ProviderTurns::rebuild([&c, &b, &a]);
        assert_eq!(one.owner("p1").map(|t| &**t), Some("t1"));
        assert_eq!(two.owner("p1").map(|t| &**t), Some("t1"));
        assert_eq!(one.owner("p2").map(|t| &**t), Some("t1"));
        assert_eq!(one.owner("p3").map(|t| &**t), Some("t0"));
        assert_eq!(one.owner("p4"), None);
        assert!(one.matches([&b, &a, &c]));
        assert!(!ProviderTurns::rebuild([&b]).matches([&a, &b]));
        // An index holding more ids than the turns record does not match, even when every id the
        // turns record has its right owner.
        assert!(!ProviderTurns::rebuild([&a, &c]).matches([&c]));
    }
}
