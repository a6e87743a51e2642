//! The `json` column: an entity's wire form, decoded back to exactly the entity that was stored
//! ([`tutti_core::store::decode_stored`], shared by every store).

use crate::error::PgError;

pub(crate) use tutti_core::store::StoredEntity as Decode;

/// Decodes one stored row.
pub(crate) fn decode<T: Decode>(table: &'static str, json: &str) -> Result<T, PgError> {
    tutti_core::store::decode_stored(json).map_err(|source| PgError::BadRow {
        table,
        key: key_hint(json),
        source,
    })
}

/// A short, content-free hint for error messages (the row's length only: never content).
fn key_hint(json: &str) -> String {
    format!("({} bytes)", json.len())
}
