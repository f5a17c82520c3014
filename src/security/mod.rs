//! Who may talk to a torchft server, and over what: the shared secret and TLS settings of
//! every server and client in the core.
//!
//! - A **token** (shared secret), when configured, is required on every gRPC call of the
//!   lighthouse and manager servers and on every state-changing HTTP route; clients send it as
//!   `authorization: Bearer <token>`, servers compare it in constant time.
//! - **TLS** (rustls) is optional. A process with a certificate and key serves TLS; a process
//!   with a CA dials TLS and verifies the server against that CA, presenting its own
//!   certificate as a client certificate when it has one (mutual TLS, required by servers
//!   given a client CA).
//!
//! Every setting comes from [`Security::from_env`] unless a caller passes its own: the one
//! place the `TORCHFT_TOKEN*` and `TORCHFT_TLS_*` variables are read.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};

pub mod client;
pub mod server;

/// Environment variable holding the shared secret itself.
pub const ENV_TOKEN: &str = "TORCHFT_TOKEN";
/// Environment variable naming a file holding the shared secret (wins over `TORCHFT_TOKEN`).
pub const ENV_TOKEN_FILE: &str = "TORCHFT_TOKEN_FILE";
/// PEM certificate chain this process presents (as a server, and as a client for mutual TLS).
pub const ENV_TLS_CERT: &str = "TORCHFT_TLS_CERT";
/// PEM private key of `TORCHFT_TLS_CERT`.
pub const ENV_TLS_KEY: &str = "TORCHFT_TLS_KEY";
/// PEM CA bundle servers are verified against; setting it makes every client dial TLS.
pub const ENV_TLS_CA: &str = "TORCHFT_TLS_CA";
/// PEM CA bundle client certificates are verified against; setting it makes servers require
/// one (mutual TLS).
pub const ENV_TLS_CLIENT_CA: &str = "TORCHFT_TLS_CLIENT_CA";

/// Reads the file a setting names (`what`: "TLS CA", "the token file", …) with `read`; a
/// failure is an invalid argument naming the setting and the path.
pub(crate) fn read_named<T>(
    what: &str,
    path: &Path,
    read: impl FnOnce(&Path) -> std::io::Result<T>,
) -> Result<T> {
    read(path)
        .map_err(|e| Error::InvalidArgument(format!("cannot read {what} {}: {e}", path.display())))
}

/// Longest token accepted (it travels in a header on every call).
const MAX_TOKEN_BYTES: usize = 4096;

/// The shared secret. Its `Debug` output never shows the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Arc<str>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    /// Validates a token: non-empty, at most 4 KiB, visible ASCII only (it is sent in an
    /// HTTP header, and a stray newline from `echo` into a file is trimmed by
    /// [`Token::from_file`], not silently kept).
    pub fn new(value: &str) -> Result<Self> {
        if value.is_empty() {
            return Err(Error::InvalidArgument("the token must not be empty".into()));
        }
        if value.len() > MAX_TOKEN_BYTES {
            return Err(Error::InvalidArgument(format!(
                "the token is longer than {MAX_TOKEN_BYTES} bytes"
            )));
        }
        if !value.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::InvalidArgument(
                "the token must be visible ASCII characters only (no spaces or control \
                 characters)"
                    .into(),
            ));
        }
        Ok(Self(value.into()))
    }

    /// Reads a token from a file (surrounding whitespace, e.g. a trailing newline, is
    /// ignored; a Kubernetes Secret mounted as a file works as is).
    pub fn from_file(path: &Path) -> Result<Self> {
        let raw = read_named("the token file", path, |p| std::fs::read_to_string(p))?;
        Self::new(raw.trim()).map_err(|e| {
            Error::InvalidArgument(format!("token file {}: {}", path.display(), detail(&e)))
        })
    }

    /// The secret itself (to hand to Python's checkpoint transport).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The `authorization` header value clients send.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// True if `presented` is this token; takes the same time wherever the first difference
    /// is (the length of the token is not a secret worth hiding).
    pub fn matches(&self, presented: &[u8]) -> bool {
        constant_time_eq(self.0.as_bytes(), presented)
    }
}

/// Per-job tokens of a lighthouse serving many jobs (rooms): a request presenting job J's
/// token may act on J's room only; the lighthouse's own token acts on every room.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoomTokens(std::collections::BTreeMap<String, Token>);

impl RoomTokens {
    /// Reads a directory holding one file per job, named after the job and holding its token
    /// (a Kubernetes Secret with one key per job, mounted as a volume, is exactly this; its
    /// hidden `..data` entries are skipped). Refused: an unreadable directory, a file name
    /// that is not a valid job name, an invalid token, no token at all, and one token shared
    /// by two jobs (it would act on both).
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let entries = std::fs::read_dir(dir).map_err(|e| {
            Error::InvalidArgument(format!(
                "cannot read the room token directory {}: {e}",
                dir.display()
            ))
        })?;
        let mut tokens = std::collections::BTreeMap::new();
        for entry in entries {
            let entry = entry.map_err(|e| {
                Error::InvalidArgument(format!(
                    "cannot read the room token directory {}: {e}",
                    dir.display()
                ))
            })?;
            let name = entry.file_name();
            let Some(job) = name.to_str() else {
                return Err(Error::InvalidArgument(format!(
                    "room token directory {}: {name:?} is not a job name",
                    dir.display()
                )));
            };
            if job.starts_with('.') || entry.path().is_dir() {
                continue;
            }
            crate::ids::validate_job(job).map_err(|e| {
                Error::InvalidArgument(format!(
                    "room token directory {}: {}",
                    dir.display(),
                    detail(&e)
                ))
            })?;
            tokens.insert(job.to_string(), Token::from_file(&entry.path())?);
        }
        if tokens.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "the room token directory {} holds no token (one file per job, named after it)",
                dir.display()
            )));
        }
        let mut seen: Vec<(&Token, &str)> = Vec::new();
        for (job, token) in &tokens {
            if let Some((_, other)) = seen.iter().find(|(t, _)| *t == token) {
                return Err(Error::InvalidArgument(format!(
                    "room token directory {}: jobs {other:?} and {job:?} have the same token",
                    dir.display()
                )));
            }
            seen.push((token, job));
        }
        Ok(Self(tokens))
    }

    /// A set of tokens from `(job, token)` pairs (tests and tools).
    pub fn from_pairs(pairs: impl IntoIterator<Item = (String, Token)>) -> Self {
        Self(pairs.into_iter().collect())
    }

    /// True when no job has a token of its own.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The token of `job`, if it has one.
    pub fn get(&self, job: &str) -> Option<&Token> {
        self.0.get(job)
    }

    /// The job whose token `presented` is (every token is compared, each in constant time).
    pub fn job_of(&self, presented: &[u8]) -> Option<&str> {
        let mut found = None;
        for (job, token) in &self.0 {
            if token.matches(presented) && found.is_none() {
                found = Some(job.as_str());
            }
        }
        found
    }
}

/// Compares two byte strings without an early exit on the first difference.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // `black_box` keeps the optimiser from turning the fold back into an early exit.
    std::hint::black_box(diff) == 0
}

fn detail(e: &Error) -> String {
    match e {
        Error::InvalidArgument(m) => m.clone(),
        other => other.to_string(),
    }
}

/// TLS files: what this process presents and whom it trusts. All PEM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain presented as a server (and as a client when dialing with a CA).
    pub cert: Option<PathBuf>,
    /// Private key of `cert`.
    pub key: Option<PathBuf>,
    /// CA bundle servers are verified against; clients dial TLS when it is set.
    pub ca: Option<PathBuf>,
    /// CA bundle client certificates are verified against; servers then require one.
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// True if this process serves TLS.
    pub fn serves_tls(&self) -> bool {
        self.cert.is_some()
    }

    /// True if this process dials TLS.
    pub fn dials_tls(&self) -> bool {
        self.ca.is_some()
    }

    /// Checks the combination is usable: a certificate needs its key (and the reverse), and
    /// requiring client certificates needs a certificate to serve TLS with.
    pub fn validate(&self) -> Result<()> {
        match (&self.cert, &self.key) {
            (Some(_), None) => {
                return Err(Error::InvalidArgument(
                    "a TLS certificate needs its private key (TORCHFT_TLS_KEY / --tls_key)".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(Error::InvalidArgument(
                    "a TLS private key needs its certificate (TORCHFT_TLS_CERT / --tls_cert)"
                        .into(),
                ))
            }
            _ => {}
        }
        if self.client_ca.is_some() && self.cert.is_none() {
            return Err(Error::InvalidArgument(
                "requiring client certificates (TORCHFT_TLS_CLIENT_CA / --tls_client_ca) needs \
                 a server certificate (TORCHFT_TLS_CERT / --tls_cert)"
                    .into(),
            ));
        }
        for path in [&self.cert, &self.key, &self.ca, &self.client_ca]
            .into_iter()
            .flatten()
        {
            if !path.is_file() {
                return Err(Error::InvalidArgument(format!(
                    "TLS file {} does not exist or is not a file",
                    path.display()
                )));
            }
        }
        Ok(())
    }
}

/// The token and TLS settings of one process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Security {
    /// The shared secret; `None` means no authentication.
    pub token: Option<Token>,
    /// TLS files; all `None` means plain TCP.
    pub tls: TlsFiles,
}

/// An `InvalidArgument` naming the variable (and its value, a path) that carries a bad setting.
fn env_error(name: &str, path: &Path, e: &Error) -> Error {
    Error::InvalidArgument(format!(
        "env {name}={:?}: {}",
        path.display().to_string(),
        detail(e)
    ))
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

impl Security {
    /// No token, no TLS.
    pub fn none() -> Self {
        Self::default()
    }

    /// Reads the settings from the environment: `TORCHFT_TOKEN_FILE` (else `TORCHFT_TOKEN`),
    /// `TORCHFT_TLS_CERT`, `TORCHFT_TLS_KEY`, `TORCHFT_TLS_CA`, `TORCHFT_TLS_CLIENT_CA`.
    /// Empty variables count as unset. Fails with a clear message naming the variable on an
    /// unreadable token file, a malformed token, a missing TLS file or an incomplete TLS
    /// combination (`InvalidArgument`: `ValueError` in Python, like every other setting).
    pub fn from_env() -> Result<Self> {
        let token =
            match (env_path(ENV_TOKEN_FILE), std::env::var(ENV_TOKEN).ok()) {
                (Some(path), _) => Some(
                    Token::from_file(&path).map_err(|e| env_error(ENV_TOKEN_FILE, &path, &e))?,
                ),
                // The token itself is never echoed back, only the variable's name.
                (None, Some(v)) if !v.is_empty() => Some(Token::new(&v).map_err(|e| {
                    Error::InvalidArgument(format!("env {ENV_TOKEN}: {}", detail(&e)))
                })?),
                _ => None,
            };
        let read = |name: &str| -> Result<Option<PathBuf>> {
            match env_path(name) {
                Some(path) if !path.is_file() => Err(Error::InvalidArgument(format!(
                    "env {name}={:?}: no such file (a PEM file is expected)",
                    path.display().to_string()
                ))),
                other => Ok(other),
            }
        };
        let security = Self {
            token,
            tls: TlsFiles {
                cert: read(ENV_TLS_CERT)?,
                key: read(ENV_TLS_KEY)?,
                ca: read(ENV_TLS_CA)?,
                client_ca: read(ENV_TLS_CLIENT_CA)?,
            },
        };
        security.tls.validate()?;
        Ok(security)
    }

    /// The environment's settings ([`Security::from_env`]) with explicit options winning over
    /// their variables: a token file, and each TLS file that is `Some` in `tls`.
    pub fn from_env_and(token_file: Option<&Path>, tls: &TlsFiles) -> Result<Self> {
        let mut security = Self::from_env()?;
        if let Some(path) = token_file {
            security.token = Some(Token::from_file(path)?);
        }
        let mine = &mut security.tls;
        for (given, slot) in [
            (&tls.cert, &mut mine.cert),
            (&tls.key, &mut mine.key),
            (&tls.ca, &mut mine.ca),
            (&tls.client_ca, &mut mine.client_ca),
        ] {
            if given.is_some() {
                slot.clone_from(given);
            }
        }
        security.tls.validate()?;
        Ok(security)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_validated_and_compared_exactly() {
        let t = Token::new("s3cret-token_1").unwrap();
        assert!(t.matches(b"s3cret-token_1"));
        assert!(!t.matches(b"s3cret-token_2"));
        assert!(!t.matches(b"s3cret-token_1x"));
        assert!(!t.matches(b""));
        assert_eq!(t.bearer(), "Bearer s3cret-token_1");
        assert_eq!(format!("{t:?}"), "Token(<redacted>)");
        for bad in ["", "has space", "new\nline", "tab\t", "é"] {
            assert!(Token::new(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Token::new(&"x".repeat(MAX_TOKEN_BYTES + 1)).is_err());
    }

    #[test]
    fn token_file_is_trimmed_and_errors_name_the_file() {
        let dir = std::env::temp_dir().join(format!("torchft-token-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "abc123\n").unwrap();
        assert!(Token::from_file(&path).unwrap().matches(b"abc123"));
        std::fs::write(&path, "\n").unwrap();
        let err = Token::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("token") && err.contains("empty"), "{err}");
        let missing = dir.join("missing");
        let err = Token::from_file(&missing).unwrap_err().to_string();
        assert!(err.contains("missing"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tls_combinations_are_checked() {
        let certs = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/certs");
        let ok = TlsFiles {
            cert: Some(certs.join("server.pem")),
            key: Some(certs.join("server.key")),
            ca: Some(certs.join("ca.pem")),
            client_ca: Some(certs.join("ca.pem")),
        };
        ok.validate().unwrap();
        assert!(ok.serves_tls() && ok.dials_tls());
        for bad in [
            TlsFiles {
                key: None,
                ..ok.clone()
            },
            TlsFiles {
                cert: None,
                ..ok.clone()
            },
            TlsFiles {
                cert: None,
                key: None,
                ..ok.clone()
            },
            TlsFiles {
                ca: Some(certs.join("nope.pem")),
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?} accepted");
        }
        TlsFiles::default().validate().unwrap();
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
