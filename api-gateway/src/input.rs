//! Reading a request's input bytes: `file://` URIs confined to a configured root, or inline
//! base64. Every failure is a [`FetchError`] that names the path or the limit, so the
//! dead-letter record tells the producer what to fix.

use std::path::{Path, PathBuf};

use base64::Engine;
use vramgate_shared::events::{ErrorKind, InputRef};

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("input uri '{0}' is not a file:// uri")]
    UnsupportedScheme(String),
    #[error("input uri '{0}' has a host; use file:///absolute/path")]
    UriHasHost(String),
    #[error("input file {0} does not exist")]
    NotFound(PathBuf),
    #[error("input file {path} is outside the allowed root {root}")]
    OutsideRoot { path: PathBuf, root: PathBuf },
    #[error("input file {path} could not be read: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("input is {size} bytes, more than the limit of {limit} bytes")]
    TooLarge { size: u64, limit: u64 },
    #[error("input data_b64 is not valid base64: {0}")]
    BadBase64(base64::DecodeError),
    #[error("input uri '{0}' is not valid percent-encoding")]
    BadEscape(String),
}

impl FetchError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            FetchError::TooLarge { .. } => ErrorKind::InputTooLarge,
            FetchError::UnsupportedScheme(_) | FetchError::UriHasHost(_) => ErrorKind::UnsupportedInput,
            FetchError::NotFound(_) => ErrorKind::InputNotFound,
            FetchError::OutsideRoot { .. } => ErrorKind::InputOutsideRoot,
            _ => ErrorKind::FetchFailed,
        }
    }
}

/// Where inputs may come from and how big they may be.
#[derive(Debug, Clone)]
pub struct InputSource {
    /// Canonical (symlink-free) root; every file must canonicalise to a path under it.
    root: PathBuf,
    max_bytes: u64,
}

impl InputSource {
    pub fn new(root: &Path, max_bytes: u64) -> std::io::Result<Self> {
        Ok(InputSource { root: root.canonicalize()?, max_bytes })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// How many bytes [`fetch`](Self::fetch) will return, at most, checked against the limit:
    /// the caller reserves them before reading. Failures are those `fetch` would give.
    pub async fn size(&self, input: &InputRef) -> Result<u64, FetchError> {
        let size = match input {
            InputRef::Inline { data_b64 } => (data_b64.len() as u64).div_ceil(4) * 3,
            InputRef::Uri { uri } => {
                let path = self.resolve(uri)?;
                tokio::fs::metadata(&path).await.map_err(|source| FetchError::Io { path, source })?.len()
            }
        };
        if size > self.max_bytes {
            return Err(FetchError::TooLarge { size, limit: self.max_bytes });
        }
        Ok(size)
    }

    /// Reads the input's bytes. Async file IO, so the caller's runtime thread is not blocked.
    pub async fn fetch(&self, input: &InputRef) -> Result<Vec<u8>, FetchError> {
        match input {
            InputRef::Inline { data_b64 } => {
                // base64 is 4 characters per 3 bytes; check before allocating the decoded copy.
                let decoded_len = (data_b64.len() as u64 / 4) * 3;
                if decoded_len > self.max_bytes {
                    return Err(FetchError::TooLarge { size: decoded_len, limit: self.max_bytes });
                }
                base64::engine::general_purpose::STANDARD
                    .decode(data_b64.trim())
                    .map_err(FetchError::BadBase64)
            }
            InputRef::Uri { uri } => {
                let path = self.resolve(uri)?;
                let meta = tokio::fs::metadata(&path)
                    .await
                    .map_err(|source| FetchError::Io { path: path.clone(), source })?;
                if meta.len() > self.max_bytes {
                    return Err(FetchError::TooLarge { size: meta.len(), limit: self.max_bytes });
                }
                tokio::fs::read(&path).await.map_err(|source| FetchError::Io { path, source })
            }
        }
    }

    /// Turns a `file://` URI into a canonical path under the root.
    fn resolve(&self, uri: &str) -> Result<PathBuf, FetchError> {
        let rest = uri
            .strip_prefix("file://")
            .ok_or_else(|| FetchError::UnsupportedScheme(uri.to_string()))?;
        if !rest.starts_with('/') {
            return Err(FetchError::UriHasHost(uri.to_string()));
        }
        let decoded = percent_decode(rest).ok_or_else(|| FetchError::BadEscape(uri.to_string()))?;
        let requested = PathBuf::from(decoded);
        let canonical = match requested.canonicalize() {
            Ok(p) => p,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(FetchError::NotFound(requested))
            }
            Err(source) => return Err(FetchError::Io { path: requested, source }),
        };
        if !canonical.starts_with(&self.root) {
            return Err(FetchError::OutsideRoot { path: requested, root: self.root.clone() });
        }
        Ok(canonical)
    }
}

/// Decodes `%XX` escapes; `None` on a malformed escape or a result that is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(dir: &Path, max: u64) -> InputSource {
        InputSource::new(dir, max).expect("temp dir exists")
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vramgate-input-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        dir
    }

    #[tokio::test]
    async fn reads_files_under_root_and_inline_data() {
        let dir = temp_dir("ok");
        std::fs::write(dir.join("a b.wav"), b"RIFF").expect("write");
        let src = source(&dir, 1024);
        let uri = InputRef::Uri { uri: format!("file://{}/a%20b.wav", dir.display()) };
        assert_eq!(src.size(&uri).await.expect("stat"), 4);
        assert_eq!(src.fetch(&uri).await.expect("reads"), b"RIFF");
        let inline = InputRef::Inline { data_b64: "UklGRg==".into() };
        assert!(src.size(&inline).await.expect("size") >= 4);
        assert_eq!(src.fetch(&inline).await.expect("decodes"), b"RIFF");
    }

    #[tokio::test]
    async fn refuses_what_it_must() {
        let dir = temp_dir("bad");
        let inner = dir.join("inner");
        std::fs::create_dir_all(&inner).expect("mkdir");
        std::fs::write(dir.join("secret"), b"x").expect("write");
        std::fs::write(inner.join("big"), vec![0u8; 100]).expect("write");
        let src = source(&inner, 10);
        let check = |uri: String, kind: ErrorKind, needle: &'static str| {
            let src = src.clone();
            async move {
                let err = src.fetch(&InputRef::Uri { uri: uri.clone() }).await.expect_err(&uri);
                assert_eq!(err.kind(), kind, "{uri}: {err}");
                assert!(err.to_string().contains(needle), "{uri}: {err}");
            }
        };
        check(format!("file://{}/missing.wav", inner.display()), ErrorKind::InputNotFound, "does not exist").await;
        check(format!("file://{}/../secret", inner.display()), ErrorKind::InputOutsideRoot, "outside the allowed root").await;
        check(format!("file://{}/big", inner.display()), ErrorKind::InputTooLarge, "limit of 10").await;
        check("http://example.com/a.wav".into(), ErrorKind::UnsupportedInput, "not a file://").await;
        check("file://host/a.wav".into(), ErrorKind::UnsupportedInput, "has a host").await;
        let err = src.fetch(&InputRef::Inline { data_b64: "@@@@".into() }).await.expect_err("bad b64");
        assert_eq!(err.kind(), ErrorKind::FetchFailed);
        let big = InputRef::Inline { data_b64: "A".repeat(400) };
        assert_eq!(src.fetch(&big).await.expect_err("too big").kind(), ErrorKind::InputTooLarge);
    }
}
