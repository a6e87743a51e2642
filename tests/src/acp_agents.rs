//! Installers for the third-party ACP agents the end-to-end tests drive offline (issues 23, 35):
//! `@agentclientprotocol/claude-agent-acp` (an ACP agent on the Claude Agent SDK, run with `node`;
//! the successor of the deprecated `@zed-industries/claude-code-acp`) and
//! `@zed-industries/codex-acp` (an ACP agent built on Codex, a static binary shipped in the
//! platform package `@zed-industries/codex-acp-<os>-<arch>`).
//!
//! Both are installed with `npm install` at the pinned versions below into
//! `<workspace>/.providers/<name>` on first use and reused afterwards (see
//! [`crate::providers::ensure_npm_package`] for the locking and atomic rename), so CI pays for the
//! download once per machine. A failed install is an error; tests fail on it, never skip.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::providers::ensure_npm_package;

/// The pinned `@agentclientprotocol/claude-agent-acp` version (the one issue 35 names). It
/// declares `node >= 22` but runs on Node 20 (npm only warns `EBADENGINE`).
pub const CLAUDE_AGENT_ACP_VERSION: &str = "0.101.0";
/// The Agent SDK version `claude-agent-acp` 0.101.0 depends on exactly. The SDK's Claude Code
/// CLI is a native binary shipped in the optional platform package
/// `@anthropic-ai/claude-agent-sdk-<os>-<arch>` (npm installs the one of this machine); the
/// agent resolves it from there, so the install is only usable when that binary is present.
pub const CLAUDE_AGENT_SDK_VERSION: &str = "0.3.318";
/// The agent's entry point inside its install prefix (run as `node <path>`).
pub const CLAUDE_AGENT_ACP_ENTRY: &str =
    "node_modules/@agentclientprotocol/claude-agent-acp/dist/index.js";
/// The SDK's native Claude Code CLI inside the install prefix (linux x64, glibc).
pub const CLAUDE_AGENT_SDK_CLI: &str =
    "node_modules/@anthropic-ai/claude-agent-sdk-linux-x64/claude";

/// A local port nothing listens on (the discard port): the proxies of the agent's environment
/// point there, so any request that is not for the scripted model server fails at once instead
/// of reaching the network.
pub const DEAD_PROXY: &str = "http://127.0.0.1:9";

/// The environment `claude-agent-acp` needs to run offline against a scripted Anthropic Messages
/// server at `base_url`, with `home` as its `HOME` (where the Claude CLI keeps its sessions) and
/// its temporary files under `home/tmp`:
/// - the v1 protocol (`CLAUDE_AGENT_ACP_PROTOCOL=v1`; the default `auto` would offer v2, where
///   subagents are baseline and not negotiated);
/// - no telemetry, error reports, auto-update or other non-essential traffic;
/// - every proxy variable pointed at [`DEAD_PROXY`], except for 127.0.0.1;
/// - `IS_SANDBOX` unset: as root, the agent offers `bypassPermissions` only when it is set, and
///   the CLI refuses `--allow-dangerously-skip-permissions` as root.
///
/// It also prepares `home`: creates `home/tmp` and writes `home/.claude/settings.json` with
/// `permissions.defaultMode = "default"`. Without that the agent starts every session in mode
/// `auto`, whose classifier (a model call of its own) blocks tool use offline; a client would
/// have to send `session/set_mode` first, which tutti does not.
pub fn claude_agent_acp_env(base_url: &str, home: &str) -> Vec<(String, String)> {
    let tmp = Path::new(home).join("tmp");
    let _ = fs::create_dir_all(&tmp);
    let config = Path::new(home).join(".claude");
    let _ = fs::create_dir_all(&config);
    let _ = fs::write(
        config.join("settings.json"),
        r#"{"permissions": {"defaultMode": "default"}}"#,
    );
    let tmp = tmp.to_string_lossy().to_string();
    [
        ("HOME", home),
        ("CLAUDE_AGENT_ACP_PROTOCOL", "v1"),
        ("ANTHROPIC_BASE_URL", base_url),
        ("ANTHROPIC_API_KEY", "dummy"),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
        ("DISABLE_TELEMETRY", "1"),
        ("DISABLE_ERROR_REPORTING", "1"),
        ("DISABLE_AUTOUPDATER", "1"),
        ("HTTP_PROXY", DEAD_PROXY),
        ("HTTPS_PROXY", DEAD_PROXY),
        ("http_proxy", DEAD_PROXY),
        ("https_proxy", DEAD_PROXY),
        ("NO_PROXY", "127.0.0.1"),
        ("no_proxy", "127.0.0.1"),
        ("CLAUDE_CODE_TMPDIR", &tmp),
        ("TMPDIR", &tmp),
        ("IS_SANDBOX", ""),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// Returns the path of `claude-agent-acp`'s `dist/index.js` (npm
/// `@agentclientprotocol/claude-agent-acp` at [`CLAUDE_AGENT_ACP_VERSION`], with the SDK's native
/// CLI for linux x64), installing it when missing.
///
/// The error message always starts with "could not install claude-agent-acp".
pub fn ensure_claude_agent_acp() -> Result<PathBuf, String> {
    static CACHE: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut cached = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = cached.as_ref() {
        return Ok(p.clone());
    }
    let fail = |e: String| {
        format!(
            "could not install claude-agent-acp (npm @agentclientprotocol/claude-agent-acp@{CLAUDE_AGENT_ACP_VERSION}): {e}"
        )
    };
    if !(cfg!(target_os = "linux") && cfg!(target_arch = "x86_64")) {
        return Err(fail(
            "only linux x86_64 is supported by this installer".into(),
        ));
    }
    let prefix = ensure_npm_package(
        "claude-agent-acp",
        &format!("@agentclientprotocol/claude-agent-acp@{CLAUDE_AGENT_ACP_VERSION}"),
        &[
            (
                "@agentclientprotocol/claude-agent-acp",
                CLAUDE_AGENT_ACP_VERSION,
            ),
            ("@anthropic-ai/claude-agent-sdk", CLAUDE_AGENT_SDK_VERSION),
            (
                "@anthropic-ai/claude-agent-sdk-linux-x64",
                CLAUDE_AGENT_SDK_VERSION,
            ),
        ],
        &[CLAUDE_AGENT_ACP_ENTRY, CLAUDE_AGENT_SDK_CLI],
    )
    .map_err(fail)?;
    let cli = prefix.join(CLAUDE_AGENT_SDK_CLI);
    let meta = fs::metadata(&cli).map_err(|e| fail(format!("{}: {e}", cli.display())))?;
    if meta.permissions().mode() & 0o111 == 0 {
        // npm may drop the executable bit on some setups; restore it.
        let mut perms = meta.permissions();
        perms.set_mode(0o755);
        fs::set_permissions(&cli, perms)
            .map_err(|e| fail(format!("chmod {}: {e}", cli.display())))?;
    }
    let entry = prefix.join(CLAUDE_AGENT_ACP_ENTRY);
    *cached = Some(entry.clone());
    Ok(entry)
}

/// The pinned `@zed-industries/codex-acp` version.
pub const CODEX_ACP_VERSION: &str = "0.16.0";
/// The static `codex-acp` binary inside its install prefix (linux x64).
pub const CODEX_ACP_BIN: &str = "node_modules/@zed-industries/codex-acp-linux-x64/bin/codex-acp";

/// Returns the path of the `codex-acp` binary (npm `@zed-industries/codex-acp` at
/// [`CODEX_ACP_VERSION`] with its linux x64 platform package), installing it when missing.
///
/// The error message always starts with "could not install codex-acp".
pub fn ensure_codex_acp() -> Result<PathBuf, String> {
    static CACHE: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut cached = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = cached.as_ref() {
        return Ok(p.clone());
    }
    let fail = |e: String| {
        format!(
            "could not install codex-acp (npm @zed-industries/codex-acp@{CODEX_ACP_VERSION}): {e}"
        )
    };
    if !(cfg!(target_os = "linux") && cfg!(target_arch = "x86_64")) {
        return Err(fail(
            "only linux x86_64 is supported by this installer".into(),
        ));
    }
    let prefix = ensure_npm_package(
        "codex-acp",
        &format!("@zed-industries/codex-acp@{CODEX_ACP_VERSION}"),
        &[
            ("@zed-industries/codex-acp", CODEX_ACP_VERSION),
            ("@zed-industries/codex-acp-linux-x64", CODEX_ACP_VERSION),
        ],
        &[CODEX_ACP_BIN],
    )
    .map_err(fail)?;
    let bin = prefix.join(CODEX_ACP_BIN);
    let meta = fs::metadata(&bin).map_err(|e| fail(format!("{}: {e}", bin.display())))?;
    if meta.permissions().mode() & 0o111 == 0 {
        // npm may drop the executable bit on some setups; restore it.
        let mut perms = meta.permissions();
        perms.set_mode(0o755);
        fs::set_permissions(&bin, perms)
            .map_err(|e| fail(format!("chmod {}: {e}", bin.display())))?;
    }
    *cached = Some(bin.clone());
    Ok(bin)
}
