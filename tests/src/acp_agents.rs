//! Installers for the third-party ACP agents the end-to-end tests drive offline (issue 23):
//! `@zed-industries/claude-code-acp` (an ACP agent on the Claude Agent SDK, run with `node`) and
//! `@zed-industries/codex-acp` (an ACP agent built on Codex, a static binary shipped in the
//! platform package `@zed-industries/codex-acp-<os>-<arch>`).
//!
//! Both are installed with `npm install` at the pinned versions below into
//! `<workspace>/.providers/<name>` on first use and reused afterwards (see
//! [`crate::providers::ensure_npm_package`] for the locking and atomic rename), so CI pays for the
//! download once per machine. A failed install is an error; tests fail on it, never skip.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::providers::ensure_npm_package;

/// The pinned `@zed-industries/claude-code-acp` version (the one issue 23 names).
pub const CLAUDE_CODE_ACP_VERSION: &str = "0.16.2";
/// The Agent SDK version `claude-code-acp` 0.16.2 depends on exactly (it ships the Claude Code
/// CLI as `cli.js`, run by `node`; no native binary).
pub const CLAUDE_CODE_ACP_SDK_VERSION: &str = "0.2.44";
/// The agent's entry point inside its install prefix (run as `node <path>`).
pub const CLAUDE_CODE_ACP_ENTRY: &str =
    "node_modules/@zed-industries/claude-code-acp/dist/index.js";

/// The pinned `@zed-industries/codex-acp` version.
pub const CODEX_ACP_VERSION: &str = "0.16.0";
/// The static `codex-acp` binary inside its install prefix (linux x64).
pub const CODEX_ACP_BIN: &str = "node_modules/@zed-industries/codex-acp-linux-x64/bin/codex-acp";

/// The environment `claude-code-acp` needs to run offline against a scripted Anthropic Messages
/// server at `base_url`, with `home` as its `HOME` (where the Claude CLI keeps its sessions).
pub fn claude_code_acp_env(base_url: &str, home: &str) -> Vec<(String, String)> {
    [
        ("HOME", home),
        ("ANTHROPIC_BASE_URL", base_url),
        ("ANTHROPIC_API_KEY", "dummy"),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
        ("DISABLE_TELEMETRY", "1"),
        ("DISABLE_ERROR_REPORTING", "1"),
        ("DISABLE_AUTOUPDATER", "1"),
        ("NO_PROXY", "127.0.0.1"),
        // As root, claude-code-acp passes `--allow-dangerously-skip-permissions` to the Claude
        // CLI whenever `IS_SANDBOX` is set, and the CLI then refuses to start as root (its
        // `session/new` fails). Empty means unset for the agent.
        ("IS_SANDBOX", ""),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// Returns the path of `claude-code-acp`'s `dist/index.js` (npm
/// `@zed-industries/claude-code-acp` at [`CLAUDE_CODE_ACP_VERSION`]), installing it when missing.
///
/// The error message always starts with "could not install claude-code-acp".
pub fn ensure_claude_code_acp() -> Result<PathBuf, String> {
    static CACHE: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut cached = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = cached.as_ref() {
        return Ok(p.clone());
    }
    let prefix = ensure_npm_package(
        "claude-code-acp",
        &format!("@zed-industries/claude-code-acp@{CLAUDE_CODE_ACP_VERSION}"),
        &[
            ("@zed-industries/claude-code-acp", CLAUDE_CODE_ACP_VERSION),
            ("@anthropic-ai/claude-agent-sdk", CLAUDE_CODE_ACP_SDK_VERSION),
        ],
        &[
            CLAUDE_CODE_ACP_ENTRY,
            "node_modules/@anthropic-ai/claude-agent-sdk/cli.js",
        ],
    )
    .map_err(|e| {
        format!(
            "could not install claude-code-acp (npm @zed-industries/claude-code-acp@{CLAUDE_CODE_ACP_VERSION}): {e}"
        )
    })?;
    let entry = prefix.join(CLAUDE_CODE_ACP_ENTRY);
    *cached = Some(entry.clone());
    Ok(entry)
}

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
