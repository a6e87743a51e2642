//! Daemon configuration: where the database lives, where to listen, and the command line of
//! every provider (TOML).
//!
//! ```toml
//! [providers.my-acp-agent]
//! kind = "acp"                       # acp | codex | claude
//! command = ["/usr/local/bin/agent", "--stdio"]
//! env = { RUST_LOG = "info" }
//! guide_while_children_only = true   # optional; the adapter's default otherwise
//! options = { }                      # adapter-specific (codex config overrides, claude query options)
//! ```
//!
//! Top-level settings:
//!
//! ```toml
//! cancel_timeout_ms = 10000   # bound of a provider cancel
//! idle_timeout_secs = 300     # stop a provider whose tree is quiescent after this long; 0 = never
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
    /// Overrides the adapter's declared guidance support.
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
}

impl ConfigFile {
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
