//! Daemon configuration: where the database lives, where to listen, and the command line of
//! every provider (TOML).
//!
//! ```toml
//! [providers.my-acp-agent]
//! kind = "acp"                       # acp | codex | claude
//! command = ["/usr/local/bin/agent", "--stdio"]
//! env = { RUST_LOG = "info" }
//! guide_while_children_only = false  # optional: narrows what the adapter declares
//! options = { }                      # adapter-specific (codex config overrides, claude query options)
//!
//! [retention]                        # optional; defaults shown (see `tutti_tokio::retention`)
//! resident_trees = 64                # quiescent trees kept in memory (0: evict at once)
//! outbox_keep_rows = 100000          # newest outbox rows kept (0: no count limit)
//! outbox_keep_secs = 604800          # outbox rows younger than this are kept (0: no age limit)
//! prune_interval_secs = 60           # time between retention passes (0: never prune)
//!
//! [http]                             # optional; defaults shown (see `tutti_tokio::connections`)
//! header_timeout_secs = 10           # a request head must be complete within this
//! body_timeout_secs = 30             # a request body must be read within this from its head
//! idle_timeout_secs = 60             # close a keep-alive connection idle this long
//! max_connections = 1024             # concurrent connections (at most (RLIMIT_NOFILE - 128) / 2)
//! ```
//!
//! Top-level settings:
//!
//! ```toml
//! cancel_timeout_ms = 10000   # bound of a provider cancel
//! idle_timeout_secs = 300     # stop a provider whose tree is quiescent after this long; 0 = never
//! lease_secs = 10             # PostgreSQL: how long a tree lease lasts unless renewed
//! durability = "full"         # SQLite: "full" (default) or "normal", see `Durability`
//! max_providers = 47          # provider processes at once; unset: sized to the machine
//! ```

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Which adapter drives a provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// An ACP agent over stdio.
    Acp,
    /// The Codex app-server.
    Codex,
    /// The Claude Agent SDK through the project's Node sidecar.
    Claude,
}

/// One provider's command line.
#[derive(Debug, Clone, Deserialize)]
pub struct ProviderConfig {
    /// Adapter.
    pub kind: ProviderKind,
    /// Program and arguments.
    #[serde(default)]
    pub command: Vec<String>,
    /// Extra environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// `false` turns off guidance while only children run for this provider; `true` or unset
    /// keeps what the adapter type declares (its `CAPABILITIES`): a config cannot grant what
    /// the adapter cannot do.
    #[serde(default)]
    pub guide_while_children_only: Option<bool>,
    /// Adapter-specific options.
    #[serde(default)]
    pub options: Option<serde_json::Value>,
}

/// The config file.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ConfigFile {
    /// Providers by name (the `provider` of `createSession`).
    #[serde(default)]
    pub providers: BTreeMap<String, ProviderConfig>,
    /// Cancel timeout (ms) for provider cancels.
    #[serde(default)]
    pub cancel_timeout_ms: Option<i64>,
    /// Seconds a provider process whose tree is quiescent (no active turn, no prepared cancel, no
    /// pending interaction) stays up before it is stopped; the next submit starts it again and
    /// resumes the provider conversation. `0` never stops an idle provider. Default 300
    /// ([`crate::daemon::DEFAULT_IDLE_TIMEOUT`]); `tuttid serve --idle-timeout-secs` overrides it.
    #[serde(default)]
    pub idle_timeout_secs: Option<u64>,
    /// PostgreSQL only (issue 21): seconds a daemon's lease of a tree lasts unless renewed (it
    /// is renewed every third of that while the tree's provider runs; another daemon takes a
    /// tree over only after its lease expired). Default 10
    /// ([`crate::postgres::DEFAULT_LEASE`]); `0` is taken as 1.
    #[serde(default)]
    pub lease_secs: Option<u64>,
    /// Resident trees and outbox retention.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// SQLite: how durable an acknowledged commit is. Default [`Durability::Full`].
    #[serde(default)]
    pub durability: Durability,
    /// HTTP connection limits (`[http]`, see [`crate::connections::HttpConfig`]).
    #[serde(default)]
    pub http: crate::connections::HttpConfig,
    /// The most provider processes running at once (issue 36); unset: sized to the machine
    /// ([`crate::daemon::default_max_providers`]); 0 is taken as 1. See
    /// [`crate::daemon::DaemonOptions::max_providers`].
    #[serde(default)]
    pub max_providers: Option<usize>,
}

pub use crate::durability::Durability;

impl ConfigFile {
    /// The lease time of trees on PostgreSQL (see [`ConfigFile::lease_secs`]).
    pub fn lease(&self) -> std::time::Duration {
        match self.lease_secs {
            Some(s) => std::time::Duration::from_secs(s.max(1)),
            None => crate::postgres::DEFAULT_LEASE,
        }
    }
    /// The idle timeout of provider runtimes: the file's `idle_timeout_secs`, else the default;
    /// `None` (never) for `0`.
    pub fn idle_timeout(&self) -> Option<std::time::Duration> {
        match self.idle_timeout_secs {
            Some(0) => None,
            Some(s) => Some(std::time::Duration::from_secs(s)),
            None => Some(crate::daemon::DEFAULT_IDLE_TIMEOUT),
        }
    }
}

/// The `[retention]` table: what the daemon keeps in memory and in the outbox. Unset keys keep
/// the defaults of [`crate::retention::Retention`]; for the two outbox limits 0 disables the
/// limit (a row is pruned when either limit expires it, and never above a live follower).
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// Quiescent trees kept in memory.
    pub resident_trees: Option<usize>,
    /// Newest outbox rows kept (0: no count limit).
    pub outbox_keep_rows: Option<u64>,
    /// Outbox rows younger than this many seconds are kept (0: no age limit).
    pub outbox_keep_secs: Option<u64>,
    /// Seconds between retention passes (0: never prune).
    pub prune_interval_secs: Option<u64>,
}

impl RetentionConfig {
    /// The settings, defaults filled in.
    pub fn resolve(&self) -> crate::retention::Retention {
        let mut r = crate::retention::Retention::default();
        if let Some(n) = self.resident_trees {
            r.resident_trees = n;
        }
        if let Some(n) = self.outbox_keep_rows {
            r.outbox.keep_rows = (n > 0).then_some(n);
        }
        if let Some(s) = self.outbox_keep_secs {
            r.outbox.max_age_ms =
                (s > 0).then(|| i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX));
        }
        if let Some(s) = self.prune_interval_secs {
            r.prune_interval_ms = s.saturating_mul(1000);
        }
        r
    }
}

/// Errors reading the config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// File.
        path: PathBuf,
        /// Parser message.
        message: String,
    },
    /// A provider is configured without a command.
    #[error("provider {0}: empty command")]
    EmptyCommand(String),
}

impl ConfigFile {
    /// Reads a TOML config file.
    pub fn load(path: &Path) -> Result<ConfigFile, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }
}

/// The user's data directory for tutti (`$XDG_DATA_HOME/tutti` or `~/.local/share/tutti`).
pub fn data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME") {
        return PathBuf::from(d).join("tutti");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".local/share/tutti");
    }
    PathBuf::from(".tutti")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 36 item 13: an acknowledged write survives power loss unless the operator chose
    /// otherwise: no `durability` key is `full` (`synchronous=FULL`).
    #[test]
    fn durability_defaults_to_full_and_the_operator_may_choose_normal() {
        let none: ConfigFile = toml::from_str("").expect("empty config");
        assert_eq!(none.durability, Durability::Full);
        assert_eq!(
            none.durability.synchronous(),
            tutti_sqlite::Synchronous::Full
        );
        let normal: ConfigFile = toml::from_str("durability = \"normal\"").expect("normal");
        assert_eq!(
            normal.durability.synchronous(),
            tutti_sqlite::Synchronous::Normal
        );
        let full: ConfigFile = toml::from_str("durability = \"full\"").expect("full");
        assert_eq!(full.durability, Durability::Full);
        assert!(toml::from_str::<ConfigFile>("durability = \"off\"").is_err());
    }

    /// Issue 36 item 3: the provider cap is a config key; unset, it is sized to the machine
    /// (between 2 and 1,024, within three quarters of the descriptor limit at 8 a provider).
    #[test]
    fn max_providers_is_a_config_key_with_a_machine_sized_default() {
        let none: ConfigFile = toml::from_str("").expect("empty config");
        assert_eq!(none.max_providers, None);
        let two: ConfigFile = toml::from_str("max_providers = 2").expect("two");
        assert_eq!(two.max_providers, Some(2));
        assert!(toml::from_str::<ConfigFile>("max_providers = -1").is_err());
        let n = crate::daemon::default_max_providers();
        assert!((2..=1024).contains(&n), "{n}");
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the limit into the struct it is given.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert!(n as u64 <= (lim.rlim_cur * 3 / 4 / 8).max(2), "{n}");
    }
}
