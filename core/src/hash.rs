//! A small deterministic hasher (FxHash) so that no map in the core depends on process randomness.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

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

/// Up to 7 bytes as a little-endian word, in at most three loads (no `memcpy` call: ids are
/// short, so most of them end in such a tail).
#[inline]
fn tail(b: &[u8]) -> u64 {
    let n = b.len();
    let mut w = 0u64;
    let mut at = 0;
    if n & 4 != 0 {
        w = u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        at = 4;
    }
    if n & 2 != 0 {
        w |= u64::from(u16::from_le_bytes([b[at], b[at + 1]])) << (8 * at);
        at += 2;
    }
    if n & 1 != 0 {
        w |= u64::from(b[at]) << (8 * at);
    }
    w
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
            self.add(tail(rest));
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
        // Only `write_u64` is used by the keys of `crate::keyed`; anything else still hashes
        // deterministically.
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

#[cfg(test)]
mod tests {
    use super::{tail, FxHasher};
    use std::hash::{Hash, Hasher};

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

    #[test]
    fn a_tail_is_its_bytes_as_a_little_endian_word() {
        let bytes = [0x11u8, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77];
        for n in 0..=7 {
            let mut w = [0u8; 8];
            w[..n].copy_from_slice(&bytes[..n]);
            assert_eq!(tail(&bytes[..n]), u64::from_le_bytes(w), "{n} bytes");
        }
    }
}
