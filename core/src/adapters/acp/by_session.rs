//! A table of the ACP adapter keyed by (native session, key), looked up with borrowed `&str`s:
//! finding, updating or removing an entry allocates nothing (a `BTreeMap<(String, String), V>`
//! needs both key strings built for every look-up, and every provider line looks up a chunk or a
//! tool call). Only inserting a new entry allocates its keys.
//!
//! The sessions are few (a root and its children) and kept in order, so that
//! [`BySession::sessions`] is deterministic. The keys of one session are hashed
//! ([`IdMap`]): the tool calls of a running prompt all stay in the table until the prompt
//! answers, hundreds or thousands in a long one, and a look-up in an ordered map of them
//! compared about a dozen ids byte by byte on every tool line (a seventh of the engine
//! thread's time at the knee bench's rates). Nothing iterates the keys of a session, so their
//! order does not matter. The hash is the core's deterministic one ([`crate::hash`]), which
//! the engine's own tables already apply to the same provider ids.
//!
//! Invariant (checked in debug builds after every change): no session is kept without entries,
//! so [`BySession::sessions`] names exactly the sessions that have some.

use crate::keyed::IdMap;
use std::collections::BTreeMap;

/// Entries of type `V` by native session (in order), then by key (hashed).
#[derive(Debug)]
pub(super) struct BySession<V> {
    map: BTreeMap<String, IdMap<V>>,
}

impl<V> Default for BySession<V> {
    fn default() -> Self {
        BySession {
            map: BTreeMap::new(),
        }
    }
}

impl<V> BySession<V> {
    pub(super) fn contains(&self, session: &str, key: &str) -> bool {
        self.map.get(session).is_some_and(|m| m.contains_key(key))
    }

    /// Inserts an entry; whether it is new (an existing entry keeps its value).
    pub(super) fn insert_new(&mut self, session: &str, key: &str, value: V) -> bool {
        if self.contains(session, key) {
            return false;
        }
        self.inner(session).insert(key.into(), value);
        self.check();
        true
    }

    /// The entry, inserted with its default first if absent.
    pub(super) fn get_or_default(&mut self, session: &str, key: &str) -> &mut V
    where
        V: Default,
    {
        let inner = self.inner(session);
        if !inner.contains_key(key) {
            inner.insert(key.into(), V::default());
        }
        inner.get_mut(key).expect("inserted above")
    }

    pub(super) fn remove(&mut self, session: &str, key: &str) -> Option<V> {
        let inner = self.map.get_mut(session)?;
        let v = inner.remove(key);
        if inner.is_empty() {
            self.map.remove(session);
        }
        self.check();
        v
    }

    pub(super) fn clear(&mut self) {
        self.map.clear();
    }

    /// Keeps the entries of the sessions `keep` says yes to.
    pub(super) fn retain_sessions(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.map.retain(|s, _| keep(s));
    }

    /// The sessions with entries, in order.
    pub(super) fn sessions(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }

    fn inner(&mut self, session: &str) -> &mut IdMap<V> {
        if !self.map.contains_key(session) {
            self.map.insert(session.to_string(), IdMap::default());
        }
        self.map.get_mut(session).expect("inserted above")
    }

    fn check(&self) {
        debug_assert!(
            self.map.values().all(|m| !m.is_empty()),
            "a session without entries is kept"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::BySession;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn entries_are_found_by_borrowed_keys_and_empty_sessions_go() {
        let mut t: BySession<String> = BySession::default();
        assert!(t.insert_new("s", "a", "1".into()));
        assert!(!t.insert_new("s", "a", "2".into()));
        t.get_or_default("s", "b").push('x');
        t.get_or_default("r", "a").push('y');
        assert!(t.contains("s", "a") && t.contains("s", "b") && !t.contains("s", "c"));
        assert_eq!(t.sessions().collect::<Vec<_>>(), ["r", "s"]);
        assert_eq!(t.remove("s", "a").as_deref(), Some("1"));
        assert_eq!(t.remove("s", "b").as_deref(), Some("x"));
        assert_eq!(t.remove("s", "b"), None);
        assert_eq!(t.sessions().collect::<Vec<_>>(), ["r"]);
        t.retain_sessions(|s| s != "r");
        assert_eq!(t.sessions().count(), 0);
        t.get_or_default("q", "a");
        t.clear();
        assert!(!t.contains("q", "a"));
    }

    proptest! {
        /// Any sequence of changes leaves the table answering as an ordered map of
        /// (session, key) pairs, and naming exactly the sessions that have entries, in order.
        #[test]
        fn the_table_answers_as_an_ordered_map_of_pairs(
            ops in proptest::collection::vec((0u8..5, 0u8..3, 0u8..40), 0..300)
        ) {
            let mut t: BySession<String> = BySession::default();
            let mut model: BTreeMap<(String, String), String> = BTreeMap::new();
            for (op, s, k) in ops {
                let (s, k) = (format!("sess-{s}"), format!("call-000000{k}"));
                match op {
                    0 => {
                        let new = !model.contains_key(&(s.clone(), k.clone()));
                        prop_assert_eq!(t.insert_new(&s, &k, k.clone()), new);
                        model.entry((s, k.clone())).or_insert(k);
                    }
                    1 => {
                        t.get_or_default(&s, &k).push('x');
                        model.entry((s, k)).or_default().push('x');
                    }
                    2 => prop_assert_eq!(t.remove(&s, &k), model.remove(&(s, k))),
                    3 => {
                        t.retain_sessions(|x| x != s);
                        model.retain(|(x, _), _| *x != s);
                    }
                    _ => prop_assert_eq!(t.contains(&s, &k), model.contains_key(&(s, k))),
                }
                let mut sessions: Vec<&str> = model.keys().map(|(s, _)| s.as_str()).collect();
                sessions.dedup();
                prop_assert_eq!(t.sessions().collect::<Vec<_>>(), sessions);
            }
        }
    }
}
