//! A small deterministic hasher (FxHash) so that no map in the core depends on process randomness.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hash, Hasher};

/// The Fx hash function (as in rustc): fast and deterministic. Not DoS-resistant, which is fine
/// for ids of one daemon's own trees.
#[derive(Default, Clone, Copy)]
pub struct FxHasher {
    hash: u64,
}

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    /// A final avalanche (murmur3's fmix64). Plain Fx leaves the low bits (which pick the
    /// bucket) blind to the high input bytes, so ids that differ only near their ends (`m123`,
    /// `m124`, ...) would pile into a few buckets and make lookups grow with the map.
    #[inline]
    fn finish(&self) -> u64 {
        let mut h = self.hash;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

/// A `HashMap` with the deterministic Fx hasher.
pub type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;
/// A `HashSet` with the deterministic Fx hasher.
pub type FxSet<K> = HashSet<K, BuildHasherDefault<FxHasher>>;

/// A hasher for keys that carry their own (already mixed) hash: it passes that hash through.
#[derive(Default, Clone, Copy)]
pub struct PassThrough(u64);

impl Hasher for PassThrough {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `HashedId`; anything else still hashes deterministically.
        let mut h = FxHasher::default();
        h.write(bytes);
        self.0 = h.finish();
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0 = i;
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// An id with its hash computed once. Growing a set of them never re-reads the ids (each is a
/// separate allocation, so re-reading them is one cache miss per element), and a probe compares
/// the strings only when the hashes are equal.
#[derive(Debug, Clone)]
struct HashedId {
    hash: u64,
    id: crate::model::Id,
}

impl HashedId {
    fn new(id: crate::model::Id) -> HashedId {
        let mut h = FxHasher::default();
        id.hash(&mut h);
        HashedId {
            hash: h.finish(),
            id,
        }
    }
}

impl PartialEq for HashedId {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.id == other.id
    }
}
impl Eq for HashedId {}
impl Hash for HashedId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// A set of ids (a session's message ids) that keeps each id's hash beside it.
#[derive(Debug, Clone, Default)]
pub struct IdSet(HashSet<HashedId, BuildHasherDefault<PassThrough>>);

impl IdSet {
    /// Whether the set holds `id`.
    pub fn contains(&self, id: &crate::model::Id) -> bool {
        self.0.contains(&HashedId::new(id.clone()))
    }
    /// Adds `id`; false if it was there already.
    pub fn insert(&mut self, id: crate::model::Id) -> bool {
        self.0.insert(HashedId::new(id))
    }
    /// Number of ids.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// The ids, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &crate::model::Id> + '_ {
        self.0.iter().map(|h| &h.id)
    }
}

#[cfg(test)]
mod tests {
    use super::{FxHasher, IdSet};
    use crate::model::Id;
    use std::hash::{Hash, Hasher};

    #[test]
    fn an_id_set_is_an_exact_set() {
        let mut s = IdSet::default();
        for i in 0..5000 {
            assert!(s.insert(Id::from(format!("m{i}"))), "new id {i}");
        }
        for i in 0..5000 {
            assert!(s.contains(&Id::from(format!("m{i}"))));
            assert!(!s.insert(Id::from(format!("m{i}"))), "repeat {i}");
        }
        assert!(!s.contains(&Id::from("m5000")));
        assert_eq!(s.len(), 5000);
        let mut all: Vec<&Id> = s.iter().collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 5000);
    }

    /// "Per-event cost must not grow with the size of a tree": ids that differ only in their
    /// last bytes must spread over the buckets hashbrown picks from the low bits.
    #[test]
    fn ids_differing_in_their_last_bytes_spread_over_low_bits() {
        let mut buckets = std::collections::HashSet::new();
        for i in 0..4096u32 {
            let mut h = FxHasher::default();
            format!("message-{i:08}").as_str().hash(&mut h);
            buckets.insert(h.finish() & 0xfff);
        }
        // A uniform hash fills about 63% of 4096 buckets with 4096 keys.
        assert!(
            buckets.len() > 2300,
            "only {} of 4096 low-bit buckets used",
            buckets.len()
        );
    }
}
