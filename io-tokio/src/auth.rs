//! The bearer token: read from a file, or created there with owner-only permissions.
//!
//! Issue 17: "a token file readable by others or a token shorter than 32 bytes is refused with a
//! clear message". Choice: any permission bit for group or others (`mode & 0o077`) refuses the
//! file, not only the read bits: a file others may write lets them choose the token.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use thiserror::Error;

/// Shortest accepted token, in bytes (a created token has 64 hex characters).
pub const MIN_TOKEN_BYTES: usize = 32;

/// Why a token file was refused.
#[derive(Debug, Error)]
pub enum TokenError {
    /// Group or others have access to the file.
    #[error(
        "{path} is accessible by group or others (mode {mode:03o}); run `chmod 600 {path}` \
         (or delete it to have a new one created)"
    )]
    Permissions {
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// The token is too short to be a secret.
    #[error(
        "the token in {path} is {len} bytes; at least {MIN_TOKEN_BYTES} are required (delete \
         the file to have a random one created)"
    )]
    TooShort {
        /// The file.
        path: String,
        /// Its length (trimmed).
        len: usize,
    },
    /// Reading or writing the file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// Reads the token, creating the file (mode 0600) with a fresh random token if it is missing or
/// empty. Refuses a file group or others can access and a token shorter than
/// [`MIN_TOKEN_BYTES`].
pub fn load_or_create_token(path: &Path) -> Result<String, TokenError> {
    let shown = path.display().to_string();
    let io = |source| TokenError::Io {
        path: shown.clone(),
        source,
    };
    match std::fs::metadata(path) {
        Ok(m) => {
            let mode = m.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(TokenError::Permissions {
                    path: shown.clone(),
                    mode,
                });
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    match std::fs::read_to_string(path) {
        Ok(t) if !t.trim().is_empty() => {
            let t = t.trim();
            if t.len() < MIN_TOKEN_BYTES {
                return Err(TokenError::TooShort {
                    path: shown.clone(),
                    len: t.len(),
                });
            }
            return Ok(t.to_string());
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let token = crate::clock::random_hex(32).map_err(io)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    f.write_all(token.as_bytes()).map_err(io)?;
    f.write_all(b"\n").map_err(io)?;
    Ok(token)
}
