//! `store_roundtrip`: see `tests/src/sim/roundtrip.rs` (it needs SQLite, so it lives with the
//! cross-crate tests and is included here by source; `super::fuzzing` inside it names the
//! `tutti_core::fuzzing` imported below). Runs on stable as `tests/tests/fuzz_corpus.rs`.
#![no_main]

use tutti_core::fuzzing;

#[path = "../../tests/src/sim/roundtrip.rs"]
mod roundtrip;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = roundtrip::store_roundtrip(data) {
        panic!("store_roundtrip: {e}");
    }
});
