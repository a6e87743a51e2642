//! Looking fields up in provider messages.
//!
//! Provider messages arrive as [`serde_json::Value`]s. With serde_json's `preserve_order`
//! feature (which the ACP crate turns on for the whole build), an object is an `IndexMap` keyed
//! with the standard library's SipHash, so every `value.get("key")` hashes the key before it
//! probes the table: about a fifth of the instructions the ACP adapter and engine spend
//! deciding a provider line (callgrind, `cargo bench -p tutti-tokio --bench knee`,
//! `TUTTI_KNEE_ONLY=engine`). The objects of a protocol message have a handful of keys, and
//! comparing a handful of short strings is cheaper than hashing one. [`Fields::field`] scans an
//! object of at most [`SCAN_MAX`] keys and hashes only in larger ones, so a hostile message
//! with thousands of keys costs no more per lookup than before. Same answers as `get` (an
//! object's keys are unique), checked by the tests below. The ACP adapter looks its fields up
//! this way: deciding a line of the knee bench's mix took 11.9k instructions before, 9.3k after.

use serde_json::{Map, Value};

/// Objects with at most this many keys are scanned instead of hashed.
pub const SCAN_MAX: usize = 16;

/// Field lookups in JSON objects: the answers of `Value::get` and `Value::pointer` for keys.
pub trait Fields {
    /// The value of `key` when `self` is an object that has it.
    fn field(&self, key: &str) -> Option<&Value>;

    /// The value at a path of keys (`["params", "update"]` is the pointer
    /// `/params/update`): each step a [`Fields::field`] of the one before.
    fn at(&self, path: &[&str]) -> Option<&Value>;
}

fn in_map<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    if map.len() <= SCAN_MAX {
        map.iter().find_map(|(k, v)| (k == key).then_some(v))
    } else {
        map.get(key)
    }
}

impl Fields for Value {
    fn field(&self, key: &str) -> Option<&Value> {
        in_map(self.as_object()?, key)
    }

    fn at(&self, path: &[&str]) -> Option<&Value> {
        path.iter().try_fold(self, |v, key| v.field(key))
    }
}

/// An object's map: an empty path names no value here (the map is not a `Value`).
impl Fields for Map<String, Value> {
    fn field(&self, key: &str) -> Option<&Value> {
        in_map(self, key)
    }

    fn at(&self, path: &[&str]) -> Option<&Value> {
        let (first, rest) = path.split_first()?;
        self.field(first)?.at(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::{Fields, SCAN_MAX};
    use proptest::prelude::*;
    use serde_json::{json, Map, Value};

    #[test]
    fn fields_and_paths_answer_as_get_and_pointer() {
        let v = json!({"params": {"sessionId": "s", "update": {"sessionUpdate": "x", "n": 1}},
                       "method": "session/update", "list": [1, 2]});
        assert_eq!(v.field("method"), v.get("method"));
        assert_eq!(v.field("absent"), None);
        assert_eq!(
            v.at(&["params", "update", "sessionUpdate"]),
            v.pointer("/params/update/sessionUpdate")
        );
        assert_eq!(v.at(&["params", "nope", "x"]), None);
        assert_eq!(v.at(&["list", "0"]), None, "keys only, never array indexes");
        assert_eq!(v.at(&[]), Some(&v));
        assert_eq!(json!([1]).field("a"), None);
        assert_eq!(json!("s").field("a"), None);
        let map = v.as_object().expect("object");
        assert_eq!(map.field("method"), v.get("method"));
        assert_eq!(
            map.at(&["params", "sessionId"]),
            v.pointer("/params/sessionId")
        );
        assert_eq!(map.at(&[]), None);
    }

    proptest! {
        /// Small objects (scanned) and large ones (hashed) answer every key as `get` does.
        #[test]
        fn field_is_get(keys in proptest::collection::vec("[a-z]{0,3}", 0..(3 * SCAN_MAX)),
                        probe in "[a-z]{0,3}") {
            let map: Map<String, Value> =
                keys.iter().enumerate().map(|(i, k)| (k.clone(), json!(i))).collect();
            let v = Value::Object(map.clone());
            prop_assert_eq!(v.field(&probe), v.get(&probe));
            prop_assert_eq!(map.field(&probe), map.get(&probe));
            for k in &keys {
                prop_assert_eq!(v.field(k), v.get(k));
            }
        }
    }
}
