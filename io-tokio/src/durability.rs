//! How durable an acknowledged write is on SQLite: the one setting the daemon's store and the
//! config file share (a leaf, so the daemon does not depend on the config file's reader).

use serde::Deserialize;

/// How durable an acknowledged write is on SQLite (issue 36: "durability the operator
/// chooses"), the `durability` key of the config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// `synchronous=FULL` (the default): every commit is synced to disk before the daemon
    /// answers, so an acknowledged write survives a process crash, an OS crash and power loss.
    #[default]
    Full,
    /// `synchronous=NORMAL`: an acknowledged write survives a crash of the daemon, but the last
    /// acknowledged transactions may be lost (never half of one) on power loss or an OS crash;
    /// commits are faster (the WAL is synced only at checkpoints).
    Normal,
}

impl Durability {
    /// The SQLite mode.
    pub fn synchronous(self) -> tutti_sqlite::Synchronous {
        match self {
            Durability::Full => tutti_sqlite::Synchronous::Full,
            Durability::Normal => tutti_sqlite::Synchronous::Normal,
        }
    }
    /// The config value (`"full"`, `"normal"`), for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Full => "full",
            Durability::Normal => "normal",
        }
    }
}
