//! The bearer token: read from a file, or created there with owner-only permissions.
//!
//! Issue 17: "a token file readable by others or a token shorter than 32 bytes is refused with a
//! clear message". Choice: any permission bit for group or others (`mode & 0o077`) refuses the
//! file, not only the read bits: a file others may write lets them choose the token.
//!
//! Issue 36 (9): a token is printable ASCII only (bytes `0x21..=0x7E`: no space, no control
//! character, nothing beyond ASCII), and no `;` (it would end the web view's cookie). Such a
//! token is refused at start instead of being accepted and then failing every request. A file
//! that holds only whitespace is refused too (it was once meant to hold a token); a missing or
//! zero-byte file gets a fresh random token. Surrounding whitespace (a trailing newline) is
//! not part of the token.
//!
//! Also the other secrets' checks, in constant time (`constant_time_eq`): the cluster
//! secret of daemons sharing one database ([`Cluster`]) and the web view's codes and cookie.

use axum::http::HeaderMap;
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
    /// The file holds only whitespace.
    #[error(
        "{path} holds only whitespace, no token; write a token of at least {MIN_TOKEN_BYTES} \
         printable ASCII characters into it (or delete it to have a random one created)"
    )]
    Blank {
        /// The file.
        path: String,
    },
    /// The token holds a byte that is not printable ASCII (`0x21..=0x7E`), or a `;`.
    #[error(
        "the token in {path} has a byte that is not allowed at position {position}: a token is \
         printable ASCII only (no spaces, no control or non-ASCII characters) and no `;` \
         (delete the file to have a random one created)"
    )]
    BadByte {
        /// The file.
        path: String,
        /// Where the first such byte is, counting from 0 in the trimmed token (the byte itself
        /// is not shown: it is part of a secret).
        position: usize,
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

/// Whether `b` may appear in a token: printable ASCII (`0x21..=0x7E`) other than `;`.
pub fn is_token_byte(b: u8) -> bool {
    (0x21..=0x7e).contains(&b) && b != b';'
}

/// Reads the token, creating the file (mode 0600) with a fresh random token if it is missing or
/// empty (zero bytes). Refuses a file group or others can access, a file of whitespace only, a
/// token shorter than [`MIN_TOKEN_BYTES`] and a token with a byte [`is_token_byte`] refuses.
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
    // Bytes, not a string: a file that is not UTF-8 gets the same clear refusal as any other
    // byte outside printable ASCII.
    match std::fs::read(path) {
        Ok(raw) if !raw.is_empty() => {
            let t = raw.trim_ascii();
            if t.is_empty() {
                return Err(TokenError::Blank { path: shown });
            }
            if let Some(position) = t.iter().position(|&b| !is_token_byte(b)) {
                return Err(TokenError::BadByte {
                    path: shown,
                    position,
                });
            }
            if t.len() < MIN_TOKEN_BYTES {
                return Err(TokenError::TooShort {
                    path: shown,
                    len: t.len(),
                });
            }
            return Ok(String::from_utf8_lossy(t).into_owned());
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

#[cfg(test)]
mod tests {
    use super::{load_or_create_token, TokenError, MIN_TOKEN_BYTES};
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    /// A private token file in a folder of its own holding `content`.
    fn token_file(name: &str, content: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tutti-auth-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("token");
        std::fs::write(&path, content).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        path
    }

    fn good() -> String {
        "a".repeat(MIN_TOKEN_BYTES)
    }

    #[test]
    fn a_printable_ascii_token_is_read_without_its_newline() {
        let t = format!("{}!~#", good());
        let path = token_file("good", format!("{t}\n").as_bytes());
        assert_eq!(load_or_create_token(&path).expect("token"), t);
    }

    #[test]
    fn a_token_with_a_non_ascii_byte_is_refused_at_start() {
        let path = token_file("non-ascii", format!("{}é", good()).as_bytes());
        let err = load_or_create_token(&path).expect_err("refused");
        assert!(
            matches!(err, TokenError::BadByte { position, .. } if position == MIN_TOKEN_BYTES),
            "{err:?}"
        );
        assert!(err.to_string().contains("printable ASCII"), "{err}");
        // Refused, not replaced: the file is as it was.
        assert_eq!(
            std::fs::read(&path).expect("read"),
            format!("{}é", good()).as_bytes()
        );
    }

    #[test]
    fn a_token_that_is_not_utf8_is_refused_at_start() {
        let mut raw = good().into_bytes();
        raw.push(0xff);
        let path = token_file("not-utf8", &raw);
        assert!(matches!(
            load_or_create_token(&path),
            Err(TokenError::BadByte { .. })
        ));
    }

    #[test]
    fn a_token_with_a_semicolon_is_refused_at_start() {
        let path = token_file("semicolon", format!("{};x", good()).as_bytes());
        let err = load_or_create_token(&path).expect_err("refused");
        assert!(
            matches!(err, TokenError::BadByte { position, .. } if position == MIN_TOKEN_BYTES),
            "{err:?}"
        );
        assert!(err.to_string().contains("`;`"), "{err}");
    }

    #[test]
    fn a_token_with_an_inner_space_or_control_byte_is_refused_at_start() {
        for (name, inner) in [("space", " "), ("tab", "\t"), ("escape", "\u{1b}")] {
            let path = token_file(name, format!("{}{inner}{}", good(), good()).as_bytes());
            assert!(
                matches!(
                    load_or_create_token(&path),
                    Err(TokenError::BadByte { position, .. }) if position == MIN_TOKEN_BYTES
                ),
                "{name}"
            );
        }
    }

    #[test]
    fn a_token_file_of_whitespace_only_is_refused_not_overwritten() {
        let path = token_file("blank", b"   \n\t \n");
        let err = load_or_create_token(&path).expect_err("refused");
        assert!(matches!(err, TokenError::Blank { .. }), "{err:?}");
        assert!(err.to_string().contains("only whitespace"), "{err}");
        assert_eq!(std::fs::read(&path).expect("read"), b"   \n\t \n");
    }

    #[test]
    fn an_empty_token_file_gets_a_random_token() {
        let path = token_file("empty", b"");
        let t = load_or_create_token(&path).expect("created");
        assert_eq!(t.len(), 64);
        assert_eq!(
            std::fs::read_to_string(&path).expect("read"),
            format!("{t}\n")
        );
        // Read back as written.
        assert_eq!(load_or_create_token(&path).expect("again"), t);
    }
}

/// Compares two secrets without stopping at the first difference.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---- between daemons on one database (see `crate::forward`) ----

/// The header carrying the cluster secret on a forwarded request.
pub const CLUSTER_SECRET: &str = "x-tutti-cluster-secret";
/// The header marking a forwarded request (the forwarder's listen address): such a request is
/// authenticated by [`CLUSTER_SECRET`] and never forwarded again.
pub const FORWARDED_BY: &str = "x-tutti-forwarded-by";

/// This daemon's place among the daemons sharing one database.
#[derive(Debug)]
pub struct Cluster {
    pub(crate) secret: String,
    pub(crate) address: String,
}

impl Cluster {
    /// A daemon listening at `address` on a database whose cluster secret is `secret`.
    pub fn new(secret: String, address: String) -> Cluster {
        Cluster { secret, address }
    }

    /// Whether `headers` carry this database's cluster secret.
    pub fn accepts(&self, headers: &HeaderMap) -> bool {
        headers
            .get(CLUSTER_SECRET)
            .is_some_and(|v| constant_time_eq(v.as_bytes(), self.secret.as_bytes()))
    }
}

/// Whether a request was forwarded by another daemon (see [`FORWARDED_BY`]).
pub fn is_forwarded(headers: &HeaderMap) -> bool {
    headers.contains_key(FORWARDED_BY)
}
