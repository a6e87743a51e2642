//! The provider registry: which adapter and which command line serve a provider name.
//!
//! Built-in names: `demo` (the bundled demo ACP agent with subagents) and `plain` (the bundled
//! root-only ACP agent). The config file adds or overrides any name (kinds `acp`, `codex`,
//! `claude`).

use crate::acp_transport::spawn_acp_process;
use crate::config::{ConfigError, ConfigFile, ProviderConfig, ProviderKind};
use crate::daemon::{LaunchError, ProviderFactory};
use crate::runtime::{spawn_line_process, ProcessSpec, Transport};
use std::collections::BTreeMap;
use std::path::PathBuf;
use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
use tutti_core::adapters::claude::{ClaudeAdapter, ClaudeConfig};
use tutti_core::adapters::codex::{CodexAdapter, CodexConfig};
use tutti_core::adapters::Adapter;
use tutti_core::model::{Capabilities, Id};

/// Providers by name.
#[derive(Debug, Clone)]
pub struct Registry {
    providers: BTreeMap<String, ProviderConfig>,
    cancel_timeout_ms: i64,
}

/// The command that runs a bundled agent (`demo-agent` or `plain-agent`): `tuttid <sub>` when this
/// process is `tuttid`, else a sibling `tutti-demo-agent` / `tutti-plain-agent` binary (for tests).
pub fn bundled_agent(sub: &str) -> Vec<String> {
    let env = if sub == "demo-agent" {
        "TUTTI_DEMO_AGENT"
    } else {
        "TUTTI_PLAIN_AGENT"
    };
    if let Ok(p) = std::env::var(env) {
        return vec![p];
    }
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("tuttid"));
    let is_tuttid = exe
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("tuttid"));
    if is_tuttid {
        return vec![exe.to_string_lossy().into_owned(), sub.to_string()];
    }
    let name = format!("tutti-{sub}");
    let mut dir = exe.parent().map(PathBuf::from);
    while let Some(d) = dir {
        let candidate = d.join(&name);
        if candidate.exists() {
            return vec![candidate.to_string_lossy().into_owned()];
        }
        let tuttid = d.join("tuttid");
        if tuttid.exists() {
            return vec![tuttid.to_string_lossy().into_owned(), sub.to_string()];
        }
        dir = d.parent().map(PathBuf::from);
    }
    vec![name]
}

impl Registry {
    /// The built-in providers plus the config file's.
    pub fn with_builtins(config: ConfigFile) -> Result<Registry, ConfigError> {
        let mut providers = BTreeMap::new();
        for (name, sub) in [("demo", "demo-agent"), ("plain", "plain-agent")] {
            providers.insert(
                name.to_string(),
                ProviderConfig {
                    kind: ProviderKind::Acp,
                    command: bundled_agent(sub),
                    env: BTreeMap::new(),
                    guide_while_children_only: None,
                    options: None,
                },
            );
        }
        for (name, p) in config.providers {
            if p.command.is_empty() {
                return Err(ConfigError::EmptyCommand(name));
            }
            providers.insert(name, p);
        }
        Ok(Registry {
            providers,
            cancel_timeout_ms: config.cancel_timeout_ms.unwrap_or(10_000),
        })
    }

    /// Gives the bundled `demo` agent a directory for its sessions' state (`TUTTI_DEMO_STATE_DIR`)
    /// so that a relaunched agent can `session/load` them. Leaves a `demo` provider from the
    /// config file, or a directory named in the daemon's own environment, as they are.
    pub fn set_demo_state_dir(&mut self, dir: PathBuf) {
        if std::env::var_os("TUTTI_DEMO_STATE_DIR").is_some() {
            return;
        }
        let bundled = bundled_agent("demo-agent");
        if let Some(p) = self.providers.get_mut("demo") {
            if p.command == bundled {
                p.env
                    .entry("TUTTI_DEMO_STATE_DIR".into())
                    .or_insert_with(|| dir.to_string_lossy().into_owned());
            }
        }
    }

    /// Adds or replaces one provider.
    pub fn insert(&mut self, name: &str, p: ProviderConfig) {
        self.providers.insert(name.to_string(), p);
    }

    fn adapter(
        &self,
        p: &ProviderConfig,
        root: &Id,
        cwd: &str,
        previous: Option<&str>,
    ) -> Box<dyn Adapter> {
        let options = p.options.clone().unwrap_or(serde_json::Value::Null);
        match p.kind {
            ProviderKind::Acp => Box::new(AcpAdapter::new(
                root.clone(),
                AcpConfig {
                    cwd: cwd.to_string(),
                    cancel_timeout_ms: self.cancel_timeout_ms,
                    // A relaunched root loads its ACP session when the agent can.
                    resume_session_id: previous.map(String::from),
                },
            )),
            ProviderKind::Codex => {
                let mut cfg = CodexConfig {
                    cwd: Some(cwd.to_string()),
                    cancel_timeout_ms: self.cancel_timeout_ms,
                    // A root whose earlier codex process died continues its thread.
                    resume_thread_id: previous.map(String::from),
                    ..CodexConfig::default()
                };
                if let Some(policy) = options.get("approvalPolicy").and_then(|v| v.as_str()) {
                    cfg.approval_policy = Some(policy.to_string());
                }
                if let Some(sandbox) = options.get("sandbox").and_then(|v| v.as_str()) {
                    cfg.sandbox = Some(sandbox.to_string());
                }
                if let Some(c) = options.get("config").and_then(|v| v.as_object()) {
                    cfg.config = c.clone();
                }
                Box::new(CodexAdapter::new(root.clone(), cfg))
            }
            ProviderKind::Claude => {
                let mut cfg = ClaudeConfig::default();
                if let Some(o) = options.get("query").cloned() {
                    cfg.options = o;
                }
                if let Some(ms) = options
                    .get("continuationTimeoutMs")
                    .and_then(|v| v.as_i64())
                {
                    cfg.continuation_timeout_ms = ms;
                }
                cfg.cancel_timeout_ms = self.cancel_timeout_ms;
                // A relaunched root resumes its SDK session (`resume`).
                cfg.resume_session_id = previous.map(String::from);
                if !cfg.options.is_object() {
                    cfg.options = serde_json::json!({});
                }
                if let Some(obj) = cfg.options.as_object_mut() {
                    obj.entry("cwd").or_insert_with(|| serde_json::json!(cwd));
                    // "Child-session rows are lanes or nested progress sections": without this
                    // the SDK forwards only a foreground child's tool blocks, not its text.
                    obj.entry("forwardSubagentText")
                        .or_insert(serde_json::Value::Bool(true));
                }
                Box::new(ClaudeAdapter::new(root.clone(), cfg))
            }
        }
    }
}

impl ProviderFactory for Registry {
    fn capabilities(&self, provider: &str) -> Option<Capabilities> {
        let p = self.providers.get(provider)?;
        // The adapter type declares what it can do; the config may only say "cannot".
        let declared = match p.kind {
            ProviderKind::Acp => tutti_core::adapters::acp::AcpAdapter::CAPABILITIES,
            ProviderKind::Codex => tutti_core::adapters::codex::CodexAdapter::CAPABILITIES,
            ProviderKind::Claude => tutti_core::adapters::claude::ClaudeAdapter::CAPABILITIES,
        };
        Some(Capabilities {
            guide_while_children_only: declared.guide_while_children_only
                && p.guide_while_children_only.unwrap_or(true),
        })
    }

    fn launch(
        &self,
        provider: &str,
        root: &Id,
        cwd: Option<&str>,
        previous: Option<&str>,
    ) -> Result<(Box<dyn Adapter>, Transport), LaunchError> {
        let p = self
            .providers
            .get(provider)
            .ok_or_else(|| LaunchError::UnknownProvider(provider.to_string()))?;
        let cwd = cwd
            .map(String::from)
            .or_else(|| {
                std::env::current_dir()
                    .ok()
                    .map(|d| d.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "/".into());
        let adapter = self.adapter(p, root, &cwd, previous);
        let spec = ProcessSpec {
            command: p.command.clone(),
            env: p.env.clone(),
            cwd: Some(cwd),
        };
        let transport = match p.kind {
            ProviderKind::Acp => spawn_acp_process(&spec),
            ProviderKind::Codex | ProviderKind::Claude => spawn_line_process(&spec),
        }
        .map_err(|e| LaunchError::Spawn {
            provider: provider.to_string(),
            error: e.to_string(),
        })?;
        Ok((adapter, transport))
    }

    fn names(&self) -> Vec<String> {
        self.providers.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 30 item 4, "the provider capability lives in one place": what the registry
    /// passes with `createSession` is the adapter type's declaration, which a config can turn
    /// off but not on.
    #[test]
    fn capabilities_come_from_the_adapter_type_and_a_config_can_only_narrow_them() {
        let config: ConfigFile = toml::from_str(
            r#"
            [providers.codex]
            kind = "codex"
            command = ["codex", "app-server"]
            [providers.quiet]
            kind = "acp"
            command = ["agent"]
            guide_while_children_only = false
            "#,
        )
        .expect("config");
        let r = Registry::with_builtins(config).expect("registry");
        let guide = |name: &str| r.capabilities(name).map(|c| c.guide_while_children_only);
        assert_eq!(
            guide("codex"),
            Some(tutti_core::adapters::codex::CodexAdapter::CAPABILITIES.guide_while_children_only)
        );
        assert_eq!(
            guide("demo"),
            Some(tutti_core::adapters::acp::AcpAdapter::CAPABILITIES.guide_while_children_only)
        );
        assert_eq!(guide("quiet"), Some(false));
        assert_eq!(guide("nobody"), None);
    }
}
