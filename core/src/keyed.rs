//! Maps keyed by ids that keep each key's hash beside it.
//!
//! Every id is a separate allocation. A map that stores only the ids has to re-read every id
//! string when it grows (one cache miss per entry), and it grows as a tree gains sessions, turns
//! and tool calls. These maps store the hash with the key: growing never touches an id, a probe
//! compares strings only when the full 64-bit hashes are equal, and a lookup by `&str` or `&Id`
//! hashes the probe once and clones nothing.

use crate::hash::{FxHasher, PassThrough};
use crate::model::Id;
use hashbrown::hash_map::EntryRef;
use hashbrown::{Equivalent, HashMap};
use std::hash::{BuildHasherDefault, Hash, Hasher};

/// The deterministic hash of one id (the same as hashing the `str` with [`FxHasher`]).
#[inline]
pub fn hash_id(id: &str) -> u64 {
    let mut h = FxHasher::default();
    id.hash(&mut h);
    h.finish()
}

/// The deterministic hash of a pair of ids.
#[inline]
pub fn hash_pair(a: &str, b: &str) -> u64 {
    let mut h = FxHasher::default();
    a.hash(&mut h);
    b.hash(&mut h);
    h.finish()
}

/// A stored key: the id(s) and their hash.
#[derive(Debug, Clone)]
pub struct Keyed<K> {
    hash: u64,
    key: K,
}

impl<K> Hash for Keyed<K> {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}
impl<K: PartialEq> PartialEq for Keyed<K> {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.key == other.key
    }
}
impl<K: Eq> Eq for Keyed<K> {}

/// A lookup key borrowed from the caller: its hash and a reference to the id(s).
struct Probe<Q> {
    hash: u64,
    key: Q,
}

impl<Q> Hash for Probe<Q> {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// Equal strings, without reading them when both are the same bytes in memory (a probe made
/// from the stored id itself, as the engine does with the canonical id of a session).
///
/// Ids are short (a few to a few dozen bytes): they are compared a machine word at a time
/// inline, instead of through a call to the C library's `memcmp`, which costs more than the
/// comparison itself at these lengths. Longer strings still go to `memcmp`.
#[inline]
pub(crate) fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if std::ptr::eq(a.as_ptr(), b.as_ptr()) {
        return true;
    }
    match n {
        0 => true,
        // Positions 0, n/2 and n-1 are every position of a string of 1 to 3 bytes.
        1..=3 => {
            a.first() == b.first() && a.get(n / 2) == b.get(n / 2) && a.get(n - 1) == b.get(n - 1)
        }
        4..=7 => {
            chunk::<4>(a, 0) == chunk::<4>(b, 0) && chunk::<4>(a, n - 4) == chunk::<4>(b, n - 4)
        }
        8..=64 => {
            let mut i = 0;
            while i + 8 < n {
                if chunk::<8>(a, i) != chunk::<8>(b, i) {
                    return false;
                }
                i += 8;
            }
            // The last chunk overlaps the previous one unless `n` is a multiple of 8.
            chunk::<8>(a, n - 8) == chunk::<8>(b, n - 8)
        }
        _ => a == b,
    }
}

/// The `N` bytes of `s` at `at` (the caller keeps `at + N` within `s`), as an array: comparing
/// two of them is one machine-word comparison for `N` of 4 or 8.
#[inline(always)]
fn chunk<const N: usize>(s: &[u8], at: usize) -> [u8; N] {
    let mut w = [0u8; N];
    if let Some(src) = s.get(at..at + N) {
        w.copy_from_slice(src);
    }
    w
}

impl Equivalent<Keyed<Id>> for Probe<&str> {
    #[inline]
    fn equivalent(&self, k: &Keyed<Id>) -> bool {
        self.hash == k.hash && same(self.key, &k.key)
    }
}

impl Equivalent<Keyed<(Id, Id)>> for Probe<(&str, &str)> {
    #[inline]
    fn equivalent(&self, k: &Keyed<(Id, Id)>) -> bool {
        self.hash == k.hash && same(self.key.0, &k.key.0) && same(self.key.1, &k.key.1)
    }
}

type Inner<K, V> = HashMap<Keyed<K>, V, BuildHasherDefault<PassThrough>>;

/// A map from id to `V`.
#[derive(Debug, Clone)]
pub struct IdMap<V>(Inner<Id, V>);

impl<V> Default for IdMap<V> {
    fn default() -> Self {
        IdMap(HashMap::default())
    }
}

fn probe(k: &str) -> Probe<&str> {
    Probe {
        hash: hash_id(k),
        key: k,
    }
}

/// Maps that are usually empty (turns being canceled, pending interactions) are checked
/// before the id is hashed: a lookup in an empty map costs one load.
impl<V> IdMap<V> {
    /// The value of `k`.
    #[inline]
    pub fn get(&self, k: &str) -> Option<&V> {
        if self.0.is_empty() {
            return None;
        }
        self.0.get(&probe(k))
    }
    /// The value of `k`, whose [`hash_id`] the caller already computed (an id looked up in
    /// several maps is hashed once).
    #[inline]
    pub fn get_hashed(&self, hash: u64, k: &str) -> Option<&V> {
        debug_assert_eq!(hash, hash_id(k));
        self.0.get(&Probe { hash, key: k })
    }
    /// The value of `k`, to change.
    #[inline]
    pub fn get_mut(&mut self, k: &str) -> Option<&mut V> {
        if self.0.is_empty() {
            return None;
        }
        self.0.get_mut(&probe(k))
    }
    /// Whether `k` (hashed by the caller) is present.
    #[inline]
    pub fn contains_key_hashed(&self, hash: u64, k: &str) -> bool {
        debug_assert_eq!(hash, hash_id(k));
        !self.0.is_empty() && self.0.contains_key(&Probe { hash, key: k })
    }
    /// The stored id equal to `k` (the canonical allocation) and its value.
    #[inline]
    pub fn get_key_value(&self, k: &str) -> Option<(&Id, &V)> {
        self.0.get_key_value(&probe(k)).map(|(k, v)| (&k.key, v))
    }
    /// Whether `k` is present.
    #[inline]
    pub fn contains_key(&self, k: &str) -> bool {
        !self.0.is_empty() && self.0.contains_key(&probe(k))
    }
    /// Inserts or replaces; returns the old value.
    pub fn insert(&mut self, k: Id, v: V) -> Option<V> {
        let hash = hash_id(&k);
        self.0.insert(Keyed { hash, key: k }, v)
    }
    /// Removes `k`; returns its value.
    pub fn remove(&mut self, k: &str) -> Option<V> {
        if self.0.is_empty() {
            return None;
        }
        self.0.remove(&probe(k))
    }
    /// The value of `k`, inserted by `make` if absent (the id is cloned only then): one lookup.
    pub fn get_or_insert_with(&mut self, k: &Id, make: impl FnOnce() -> V) -> &mut V {
        let hash = hash_id(k);
        match self.0.entry_ref(&Probe { hash, key: &**k }) {
            EntryRef::Occupied(o) => o.into_mut(),
            EntryRef::Vacant(v) => v.insert_with_key(
                Keyed {
                    hash,
                    key: k.clone(),
                },
                make(),
            ),
        }
    }
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// The ids.
    pub fn keys(&self) -> impl Iterator<Item = &Id> + '_ {
        self.0.keys().map(|k| &k.key)
    }
    /// The values.
    pub fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.0.values()
    }
    /// Every entry.
    pub fn iter(&self) -> impl Iterator<Item = (&Id, &V)> + '_ {
        self.0.iter().map(|(k, v)| (&k.key, v))
    }
    /// Keeps the entries for which `keep` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&Id, &mut V) -> bool) {
        self.0.retain(|k, v| keep(&k.key, v));
    }
}

/// A set of ids (a session's message ids).
///
/// Most sessions hold few messages, and every message is checked against its session's set:
/// up to [`IdSet::SMALL`] ids the set is a vector of hashed ids, searched by hash (an insert is
/// a push, and growing it rehashes nothing); past that it becomes a hash set, so a check never
/// scans more than `SMALL` entries, however long the session.
#[derive(Debug, Clone)]
pub enum IdSet {
    /// At most [`IdSet::SMALL`] ids, in insertion order.
    Small(Vec<Keyed<Id>>),
    /// More than [`IdSet::SMALL`] ids.
    Large(hashbrown::HashSet<Keyed<Id>, BuildHasherDefault<PassThrough>>),
}

impl Default for IdSet {
    fn default() -> Self {
        IdSet::Small(Vec::new())
    }
}

impl IdSet {
    /// The most ids kept as a vector.
    pub const SMALL: usize = 16;

    /// Whether the set holds the id whose [`hash_id`] is `hash`.
    #[inline]
    pub fn contains_hashed(&self, hash: u64, id: &str) -> bool {
        match self {
            IdSet::Small(v) => v.iter().any(|k| k.hash == hash && same(&k.key, id)),
            IdSet::Large(set) => set.contains(&Probe { hash, key: id }),
        }
    }
    /// Whether the set holds `id`.
    #[inline]
    pub fn contains(&self, id: &str) -> bool {
        self.contains_hashed(hash_id(id), id)
    }
    /// Adds `id` if it is absent and returns its number: how many ids the set held before it.
    /// A session's messages are numbered this way (their dense `seq`), so the number is taken
    /// from the same search that proves the id new (one hash, one search): an id already
    /// present gets `None` and never a second number.
    #[inline]
    pub fn insert_numbered(&mut self, id: &Id) -> Option<u64> {
        let hash = hash_id(id);
        if self.contains_hashed(hash, id) {
            return None;
        }
        let number = self.len() as u64;
        self.push_absent(hash, id.clone());
        Some(number)
    }
    /// Adds `id`; false if it was there already.
    pub fn insert(&mut self, id: Id) -> bool {
        self.insert_numbered(&id).is_some()
    }
    /// Adds `id`, whose [`hash_id`] is `hash`, found absent by the caller in this same call.
    fn push_absent(&mut self, hash: u64, id: Id) {
        let key = Keyed { hash, key: id };
        match self {
            IdSet::Small(v) if v.len() < Self::SMALL => v.push(key),
            IdSet::Small(v) => {
                let mut set = hashbrown::HashSet::with_capacity_and_hasher(
                    2 * Self::SMALL,
                    BuildHasherDefault::default(),
                );
                set.extend(v.drain(..));
                set.insert(key);
                *self = IdSet::Large(set);
            }
            IdSet::Large(set) => {
                set.insert(key);
            }
        }
    }
    /// Number of ids.
    pub fn len(&self) -> usize {
        match self {
            IdSet::Small(v) => v.len(),
            IdSet::Large(set) => set.len(),
        }
    }
    /// The ids, in no particular order.
    pub fn iter(&self) -> Box<dyn Iterator<Item = &Id> + '_> {
        match self {
            IdSet::Small(v) => Box::new(v.iter().map(|k| &k.key)),
            IdSet::Large(set) => Box::new(set.iter().map(|k| &k.key)),
        }
    }
}

/// A map from a pair of ids (a session and a tool call, a turn and a request) to `V`.
#[derive(Debug, Clone)]
pub struct PairMap<V>(Inner<(Id, Id), V>);

impl<V> Default for PairMap<V> {
    fn default() -> Self {
        PairMap(HashMap::default())
    }
}

fn pair_probe<'a>(a: &'a str, b: &'a str) -> Probe<(&'a str, &'a str)> {
    Probe {
        hash: hash_pair(a, b),
        key: (a, b),
    }
}

impl<V> PairMap<V> {
    /// The value of `(a, b)`.
    #[inline]
    pub fn get(&self, a: &str, b: &str) -> Option<&V> {
        self.0.get(&pair_probe(a, b))
    }
    /// The value of `(a, b)`, to change.
    #[inline]
    pub fn get_mut(&mut self, a: &str, b: &str) -> Option<&mut V> {
        self.0.get_mut(&pair_probe(a, b))
    }
    /// Whether `(a, b)` is present.
    pub fn contains_key(&self, a: &str, b: &str) -> bool {
        self.0.contains_key(&pair_probe(a, b))
    }
    /// Inserts or replaces; returns the old value.
    pub fn insert(&mut self, a: Id, b: Id, v: V) -> Option<V> {
        let hash = hash_pair(&a, &b);
        self.0.insert(Keyed { hash, key: (a, b) }, v)
    }
    /// The value of `(a, b)`, inserted by `make` if absent (then `true`): one lookup; the ids
    /// are cloned only when inserting.
    pub fn slot(&mut self, a: &Id, b: &Id, make: impl FnOnce() -> V) -> (&mut V, bool) {
        let hash = hash_pair(a, b);
        match self.0.entry_ref(&Probe {
            hash,
            key: (&**a, &**b),
        }) {
            EntryRef::Occupied(o) => (o.into_mut(), false),
            EntryRef::Vacant(v) => {
                let key = Keyed {
                    hash,
                    key: (a.clone(), b.clone()),
                };
                (v.insert_with_key(key, make()), true)
            }
        }
    }
    /// The values.
    pub fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.0.values()
    }
    /// Keeps the entries for which `keep` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&(Id, Id), &mut V) -> bool) {
        self.0.retain(|k, v| keep(&k.key, v));
    }
}

/// Where an entity of a [`Table`] was seen before: a position a caller kept to skip the
/// index lookup next time (a session's position in its tree, a turn found earlier in the
/// same step).
///
/// A hint is never trusted. Every [`Table`] method that takes one compares the id stored at
/// that position with the id asked for (a pointer comparison when both are the canonical
/// allocation) and looks the id up in the index when they differ, so a stale or wrong hint
/// costs one lookup and never yields another entity. (A debug assertion would not do: a wrong
/// session position would number a message with another session's `seq`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hint(u32);

impl Hint {
    /// No hint: the id is looked up.
    pub const NONE: Hint = Hint(u32::MAX);

    /// The entity was at `pos`.
    #[inline]
    pub fn at(pos: u32) -> Hint {
        Hint(pos)
    }
}

/// A table of entities by id: the entities in one dense vector, an [`IdMap`] from id to
/// position. Growing the index moves 32-byte entries, never the entities themselves (sessions
/// and turns are hundreds of bytes), and iteration walks contiguous memory.
#[derive(Debug, Clone)]
pub struct Table<V> {
    index: IdMap<u32>,
    items: Vec<(Id, V)>,
}

impl<V> Default for Table<V> {
    fn default() -> Self {
        Table {
            index: IdMap::default(),
            items: Vec::new(),
        }
    }
}

impl<V> Table<V> {
    /// The entity with id `k`.
    #[inline]
    pub fn get(&self, k: &str) -> Option<&V> {
        let i = *self.index.get(k)? as usize;
        self.items.get(i).map(|(_, v)| v)
    }
    /// The entity with id `k`, to change.
    #[inline]
    pub fn get_mut(&mut self, k: &str) -> Option<&mut V> {
        let i = *self.index.get(k)? as usize;
        self.items.get_mut(i).map(|(_, v)| v)
    }
    /// Whether `k` is present.
    pub fn contains_key(&self, k: &str) -> bool {
        self.index.contains_key(k)
    }
    /// Number of entities (positions run from 0 to this, exclusive).
    pub fn len(&self) -> u32 {
        u32::try_from(self.items.len()).unwrap_or(u32::MAX)
    }
    /// The position of `k`: the hinted one if the entity stored there is `k` (no hashing, no
    /// probe), else the index's. Never the position of another entity (see [`Hint`]).
    #[inline]
    pub fn locate(&self, k: &str, hint: Hint) -> Option<u32> {
        match self.items.get(hint.0 as usize) {
            Some((id, _)) if same(id, k) => Some(hint.0),
            _ => self.position(k),
        }
    }
    /// The position and entity of `k`, found through `hint` when it is right.
    #[inline]
    pub fn get_hinted(&self, k: &str, hint: Hint) -> Option<(u32, &V)> {
        let pos = self.locate(k, hint)?;
        self.items.get(pos as usize).map(|(_, v)| (pos, v))
    }
    /// The position and entity of `k`, to change, found through `hint` when it is right.
    #[inline]
    pub fn get_mut_hinted(&mut self, k: &str, hint: Hint) -> Option<(u32, &mut V)> {
        let pos = self.locate(k, hint)?;
        self.items.get_mut(pos as usize).map(|(_, v)| (pos, v))
    }
    /// The id and entity at position `pos` (for a walk over every position; an entity looked
    /// for by id is found with [`Table::get_hinted`]).
    #[inline]
    pub fn at(&self, pos: u32) -> Option<(&Id, &V)> {
        self.items.get(pos as usize).map(|(k, v)| (k, v))
    }
    /// The position of `k`: its place in insertion order, stable until [`Table::retain`]
    /// removes something.
    #[inline]
    pub fn position(&self, k: &str) -> Option<u32> {
        self.index.get(k).copied()
    }
    /// Inserts or replaces; returns the entity's position. One index lookup: the id is hashed
    /// and probed once.
    pub fn insert(&mut self, k: Id, v: V) -> u32 {
        // A tree never holds 2^32 entities (a u32 position keeps index entries small).
        let next = u32::try_from(self.items.len()).unwrap_or(u32::MAX);
        let i = *self.index.get_or_insert_with(&k, || next);
        match self.items.get_mut(i as usize) {
            // Positions already taken are below `next`: an existing entity is replaced.
            Some(slot) if i != next => slot.1 = v,
            _ => self.items.push((k, v)),
        }
        i
    }
    /// Keeps the entities for which `keep` holds (positions of the others are reused).
    pub fn retain(&mut self, mut keep: impl FnMut(&Id, &mut V) -> bool) {
        let before = self.items.len();
        self.items.retain_mut(|(k, v)| keep(k, v));
        if self.items.len() != before {
            self.reindex();
        }
    }
    fn reindex(&mut self) {
        let mut index = IdMap::default();
        for (i, (k, _)) in self.items.iter().enumerate() {
            index.insert(k.clone(), u32::try_from(i).unwrap_or(u32::MAX));
        }
        self.index = index;
    }
    /// The ids, in insertion order.
    pub fn keys(&self) -> impl Iterator<Item = &Id> + '_ {
        self.items.iter().map(|(k, _)| k)
    }
    /// The entities, in insertion order.
    pub fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.items.iter().map(|(_, v)| v)
    }
}

/// A [`Table`] keyed by a pair of ids (a session and one of its tool calls).
#[derive(Debug, Clone)]
pub struct PairTable<V> {
    index: PairMap<u32>,
    items: Vec<((Id, Id), V)>,
}

impl<V> Default for PairTable<V> {
    fn default() -> Self {
        PairTable {
            index: PairMap::default(),
            items: Vec::new(),
        }
    }
}

impl<V> PairTable<V> {
    /// The entity of `(a, b)`.
    #[inline]
    pub fn get(&self, a: &str, b: &str) -> Option<&V> {
        let i = *self.index.get(a, b)? as usize;
        self.items.get(i).map(|(_, v)| v)
    }
    /// Inserts or replaces.
    pub fn insert(&mut self, a: Id, b: Id, v: V) {
        if let Some(&i) = self.index.get(&a, &b) {
            if let Some(slot) = self.items.get_mut(i as usize) {
                slot.1 = v;
                return;
            }
        }
        let i = u32::try_from(self.items.len()).unwrap_or(u32::MAX);
        self.index.insert(a.clone(), b.clone(), i);
        self.items.push(((a, b), v));
    }
    /// The entity of `(a, b)`, inserted by `make` if absent (then `true`): one index lookup.
    /// `None` only if the index and the entities were out of step (never, by construction).
    pub fn slot(&mut self, a: &Id, b: &Id, make: impl FnOnce() -> V) -> Option<(&mut V, bool)> {
        let next = u32::try_from(self.items.len()).unwrap_or(u32::MAX);
        let (&mut i, fresh) = self.index.slot(a, b, || next);
        if fresh {
            self.items.push(((a.clone(), b.clone()), make()));
        }
        self.items.get_mut(i as usize).map(|(_, v)| (v, fresh))
    }
    /// The entity of `(a, b)`, to change it.
    #[inline]
    pub fn get_mut(&mut self, a: &str, b: &str) -> Option<&mut V> {
        let i = *self.index.get(a, b)? as usize;
        self.items.get_mut(i).map(|(_, v)| v)
    }
    /// Keeps the entities for which `keep` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&(Id, Id), &mut V) -> bool) {
        let before = self.items.len();
        self.items.retain_mut(|(k, v)| keep(k, v));
        if self.items.len() != before {
            let mut index = PairMap::default();
            for (i, ((a, b), _)) in self.items.iter().enumerate() {
                index.insert(a.clone(), b.clone(), u32::try_from(i).unwrap_or(u32::MAX));
            }
            self.index = index;
        }
    }
    /// The entities, in insertion order.
    pub fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.items.iter().map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::{hash_id, same, Hint, IdMap, IdSet, PairMap, PairTable, Table};
    use crate::model::Id;

    fn id(s: &str) -> Id {
        Id::from(s)
    }

    #[test]
    fn an_id_map_is_an_exact_map_through_growth() {
        let mut m = IdMap::default();
        for i in 0..5000u32 {
            assert_eq!(m.insert(id(&format!("s{i}")), i), None);
        }
        for i in 0..5000u32 {
            assert_eq!(m.get(&format!("s{i}")), Some(&i));
        }
        assert_eq!(m.get("s5000"), None);
        assert_eq!(m.get_hashed(hash_id("s9"), "s9"), Some(&9));
        assert!(m.contains_key_hashed(hash_id("s9"), "s9"));
        assert!(!m.contains_key_hashed(hash_id("s5000"), "s5000"));
        assert!(!IdMap::<u32>::default().contains_key_hashed(hash_id("s9"), "s9"));
        assert_eq!(m.insert(id("s7"), 70), Some(7));
        *m.get_or_insert_with(&id("s7"), || 0) += 1;
        assert_eq!(m.get("s7"), Some(&71));
        assert_eq!(*m.get_or_insert_with(&id("new"), || 5), 5);
        assert_eq!(m.remove("s8"), Some(8));
        assert!(!m.contains_key("s8"));
        assert_eq!(m.len(), 5000);
        m.retain(|k, _| !k.starts_with("s1"));
        assert!(m.get("s1").is_none() && m.get("s2").is_some());
    }

    #[test]
    fn word_comparison_agrees_with_byte_comparison_at_every_length_and_position() {
        for n in 0..=80usize {
            let a: String = (0..n).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
            let b = a.clone();
            assert!(same(&a, &b), "equal, length {n}");
            for at in 0..n {
                let mut c = a.clone().into_bytes();
                c[at] = b'Z';
                let c = String::from_utf8(c).expect("ascii");
                assert!(!same(&a, &c), "length {n}, differs at {at}");
                assert!(!same(&c, &a), "length {n}, differs at {at} (swapped)");
            }
            if n > 0 {
                assert!(!same(&a, &a[..n - 1]), "length {n} vs {}", n - 1);
            }
        }
    }

    #[test]
    fn the_pointer_shortcut_never_changes_equality() {
        let a = id("session-1");
        let b = id("session-1");
        assert!(same(&a, &a), "the same allocation");
        assert!(same(&a, &b), "another allocation, same text");
        assert!(!same(&a[..7], &a), "same start, shorter");
        assert!(!same(&a, "session-2"));
        let mut m = IdMap::default();
        m.insert(a.clone(), 1);
        let (k, v) = m.get_key_value(&b).expect("found by text");
        assert!(
            std::sync::Arc::ptr_eq(k, &a),
            "the stored allocation comes back"
        );
        assert_eq!(*v, 1);
    }

    #[test]
    fn an_id_set_is_an_exact_set() {
        let mut s = IdSet::default();
        for i in 0..5000 {
            assert!(s.insert(id(&format!("m{i}"))), "new id {i}");
        }
        for i in 0..5000 {
            let m = format!("m{i}");
            assert!(s.contains_hashed(hash_id(&m), &m));
            assert!(!s.insert(id(&m)), "repeat {i}");
            assert_eq!(s.insert_numbered(&id(&m)), None, "numbered repeat {i}");
        }
        assert!(!s.contains_hashed(hash_id("m5000"), "m5000"));
        assert_eq!(s.insert_numbered(&id("m5000")), Some(5000));
        assert_eq!(s.len(), 5001);
        let mut all: Vec<&Id> = s.iter().collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 5001);
    }

    /// Through the switch from a vector to a hash set: at every size, every id added so far is
    /// found, a repeat is refused, and an absent id is not found.
    #[test]
    fn an_id_set_stays_exact_at_every_size_through_the_switch_to_a_hash_set() {
        let mut s = IdSet::default();
        for n in 0..(3 * IdSet::SMALL) {
            assert_eq!(s.len(), n);
            assert_eq!(matches!(s, IdSet::Small(_)), n <= IdSet::SMALL, "size {n}");
            for i in 0..n {
                let m = format!("message-{i}");
                assert!(s.contains_hashed(hash_id(&m), &m), "size {n}: {m} lost");
                assert!(!s.insert(id(&m)), "size {n}: {m} added twice");
            }
            let fresh = format!("message-{n}");
            assert!(!s.contains(&fresh));
            assert_eq!(
                s.insert_numbered(&id(&fresh)),
                Some(n as u64),
                "numbered by size"
            );
        }
        let mut all: Vec<&Id> = s.iter().collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 3 * IdSet::SMALL);
    }

    #[test]
    fn a_pair_map_tells_pairs_apart() {
        let mut m = PairMap::default();
        m.insert(id("a"), id("bc"), 1);
        m.insert(id("ab"), id("c"), 2);
        assert_eq!(m.get("a", "bc"), Some(&1));
        assert_eq!(m.get("ab", "c"), Some(&2));
        assert_eq!(m.get("b", "a"), None);
        let (v, fresh) = m.slot(&id("a"), &id("bc"), || 9);
        assert!(!fresh);
        *v = 3;
        assert_eq!(m.get("a", "bc"), Some(&3));
        let (_, fresh) = m.slot(&id("x"), &id("y"), || 9);
        assert!(fresh);
        assert_eq!(m.get("x", "y"), Some(&9));
    }

    #[test]
    fn tables_keep_their_index_in_step_with_their_entities() {
        let mut t = Table::default();
        for i in 0..1000u32 {
            assert_eq!(
                t.insert(id(&format!("t{i}")), i),
                i,
                "a new entity goes last"
            );
        }
        assert_eq!(
            t.insert(id("t5"), 55),
            5,
            "a replaced entity keeps its position"
        );
        assert_eq!(t.position("t5"), Some(5));
        assert_eq!(t.get("t5"), Some(&55));
        assert_eq!(t.locate("t5", Hint::at(5)), Some(5));
        assert_eq!(t.locate("t5", Hint::NONE), Some(5));
        assert_eq!(
            t.locate("t1000", Hint::at(5)),
            None,
            "absent, whatever the hint"
        );
        *t.get_mut_hinted("t7", Hint::at(7)).expect("present").1 = 77;
        assert_eq!(t.get("t7"), Some(&77));
        assert_eq!(t.get_hinted("t7", Hint::at(7)), Some((7, &77)));
        *t.get_mut("t7").expect("present") = 7;
        *t.get_mut("t6").expect("present") = 66;
        t.retain(|_, v| *v % 2 == 0);
        for i in 0..1000u32 {
            let want = match i {
                5 => None,
                6 => Some(66),
                i if i % 2 == 0 => Some(i),
                _ => None,
            };
            assert_eq!(t.get(&format!("t{i}")).copied(), want, "t{i}");
        }
        assert_eq!(t.keys().count(), t.values().count());

        let mut p = PairTable::default();
        for i in 0..100u32 {
            let (v, fresh) = p.slot(&id("s"), &id(&format!("c{i}")), || i).expect("slot");
            assert!(fresh);
            *v += 1;
        }
        let (v, fresh) = p.slot(&id("s"), &id("c3"), || 0).expect("slot");
        assert!(!fresh);
        assert_eq!(*v, 4);
        p.retain(|(_, c), _| c.as_ref() != "c3");
        assert_eq!(p.get("s", "c3"), None);
        assert_eq!(p.get("s", "c4"), Some(&5));
        p.insert(id("s"), id("c4"), 40);
        assert_eq!(p.get("s", "c4"), Some(&40));
        assert_eq!(p.values().count(), 99);
    }
    /// A wrong or stale hint is detected: the id stored at the hinted position is compared, and
    /// the id is looked up instead. Trusting the position would have handed back (and let the
    /// caller change) the entity of another id.
    #[test]
    fn a_wrong_hint_is_detected_and_falls_back_to_the_index() {
        let mut t = Table::default();
        for i in 0..10u32 {
            t.insert(id(&format!("s{i}")), i);
        }
        for wrong in [
            Hint::at(3),
            Hint::at(9),
            Hint::at(10),
            Hint::at(u32::MAX - 1),
            Hint::NONE,
        ] {
            assert_eq!(t.locate("s5", wrong), Some(5), "{wrong:?}");
            assert_eq!(t.get_hinted("s5", wrong), Some((5, &5)), "{wrong:?}");
        }
        let (pos, v) = t.get_mut_hinted("s5", Hint::at(3)).expect("found by id");
        assert_eq!(pos, 5);
        *v = 50;
        assert_eq!(t.get("s5"), Some(&50), "the entity of the id was changed");
        assert_eq!(
            t.get("s3"),
            Some(&3),
            "the entity at the wrong hint was not"
        );
        assert!(t.get_mut_hinted("nope", Hint::at(3)).is_none());
    }
}
