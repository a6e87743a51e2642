//! Replaying captured provider transcripts through the [`Driver`](crate::driver::Driver),
//! purely (`tutti replay-native --provider codex|claude|acp FILE`).
//!
//! Each replay is a host of the driver like any other: the driver owns the engine and the
//! adapter, every decided batch is committed to a [`MemoryStore`](crate::store::MemoryStore)
//! before anything it caused happens. The replays live here, above both the adapters and the
//! driver, so that neither imports back from the other (issue 30: no import circles).

pub mod acp;
pub mod claude;
pub mod codex;
