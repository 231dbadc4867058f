//! Reading a request's input bytes: `file://` URIs confined to a configured root, inline
//! base64, or `s3://bucket/key` objects in the buckets the operator listed ([`objects`]).
//! Every failure is a [`FetchError`] that names the path (as the producer gave it,
//! truncated) or the limit, so the dead-letter record tells the producer what to fix.
//!
//! A file is opened once, by the kernel's own confinement: `openat2(root, path,
//! RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` refuses any path, `..` or symlink that leaves the
//! root, in one system call (no `canonicalize` walk per record). It is opened non-blocking, so
//! a FIFO cannot hang the open, and checked on the opened handle: only regular files are read
//! (a FIFO, a device or a directory is `unsupported_input`). The size bound is checked on the
//! handle's size and enforced again while reading (a file that grows is cut off), and the read
//! has a deadline. A missing file and one outside the root get the same kind and message, so
//! dead letters do not tell which paths exist; neither message names the root.
//!
//! Kernels before 5.6 (no `openat2`) fall back to resolving the path in user space first.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use vramgate_shared::events::{ErrorKind, InputRef};

pub mod objects;
mod web;
use objects::{Located, Named, ObjectInputs};

/// Longest path or URI echoed in an error message.
const SHOWN_CHARS: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "input uri '{0}' is not a uri this gateway reads (file://; s3:// for the buckets in s3.buckets; https:// for the hosts in input.http.hosts)"
    )]
    UnsupportedScheme(String),
    #[error("host '{0}' is not one this gateway reads from (input.http.hosts)")]
    HostNotListed(String),
    #[error("input url '{url}' is not read: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("bucket '{0}' is not one this gateway reads (s3.buckets)")]
    BucketNotListed(String),
    #[error("input uri '{uri}' does not name a valid object key: {reason}")]
    BadKey { uri: String, reason: String },
    #[error("object {0} was not found")]
    ObjectNotFound(String),
    #[error("object {uri} may not be read with the gateway's credentials: {reason}")]
    ObjectDenied { uri: String, reason: String },
    #[error("object {uri} could not be read (after the retries [s3] or [input.http] allow): {reason}")]
    ObjectFailed { uri: String, reason: String },
    #[error("input uri '{0}' has a host; use file:///absolute/path")]
    UriHasHost(String),
    #[error("input file {0} was not found under the gateway's input root")]
    NotFound(String),
    #[error("input {path} is a {what}, not a regular file")]
    NotRegular { path: String, what: &'static str },
    #[error("input file {path} could not be read: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("input {path} was not read within the {seconds} s it may take")]
    TimedOut { path: String, seconds: f64 },
    #[error("input is {size} bytes, more than the limit of {limit} bytes (input.max_input_bytes)")]
    TooLarge { size: u64, limit: u64 },
    #[error("input data_b64 is not valid base64 ({0}); expected standard base64 with padding")]
    BadBase64(base64::DecodeError),
    #[error("input uri '{0}' is not valid percent-encoding")]
    BadEscape(String),
    #[error("input.frames is a batch; each of its frames is opened on its own")]
    Batch,
}

impl FetchError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            FetchError::TooLarge { .. } => ErrorKind::InputTooLarge,
            FetchError::UnsupportedScheme(_)
            | FetchError::UriHasHost(_)
            | FetchError::NotRegular { .. }
            | FetchError::BucketNotListed(_)
            | FetchError::HostNotListed(_)
            | FetchError::BadUrl { .. }
            | FetchError::BadKey { .. }
            | FetchError::Batch => ErrorKind::UnsupportedInput,
            FetchError::NotFound(_) | FetchError::ObjectNotFound(_) => ErrorKind::InputNotFound,
            _ => ErrorKind::FetchFailed,
        }
    }
}

/// A string cut to [`SHOWN_CHARS`] characters for an error message.
fn shown(s: &str) -> String {
    match s.char_indices().nth(SHOWN_CHARS) {
        Some((cut, _)) => format!("{}… ({} bytes)", &s[..cut], s.len()),
        None => s.to_string(),
    }
}

/// Where inputs may come from and how big they may be.
#[derive(Debug, Clone)]
pub struct InputSource {
    /// The root as configured and in canonical form: a URI's path may start with either.
    roots: Vec<PathBuf>,
    /// The root folder, opened once; files are opened beneath it.
    dir: Arc<OwnedFd>,
    max_bytes: u64,
    read_timeout: Duration,
    /// `s3://` inputs, when a bucket is listed.
    objects: Option<Arc<ObjectInputs>>,
}

/// An input ready to read: its size is known and was checked against the limit, so the
/// caller can reserve it before reading.
#[derive(Debug)]
pub enum Opened {
    Inline(String),
    File { file: File, size: u64, shown: String },
    /// An object named, its size not yet asked for: [`InputSource::locate`] asks.
    Named(Named),
    /// An object whose size was asked for and is within the limit.
    Object(Located),
}

impl Opened {
    /// How many bytes [`read`](Self::read) returns, at most.
    pub fn size(&self) -> u64 {
        match self {
            Opened::Inline(b64) => (b64.len() as u64).div_ceil(4) * 3,
            Opened::File { size, .. } => *size,
            Opened::Named(_) => 0,
            Opened::Object(located) => located.size,
        }
    }
}

impl InputSource {
    pub fn new(root: &Path, max_bytes: u64, read_timeout: Duration) -> std::io::Result<Self> {
        let canonical = root.canonicalize()?;
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(&canonical)?;
        let mut roots = vec![canonical];
        if root.is_absolute() && !roots.contains(&root.to_path_buf()) {
            roots.push(root.to_path_buf());
        }
        Ok(InputSource { roots, dir: Arc::new(dir.into()), max_bytes, read_timeout, objects: None })
    }

    /// Reads `s3://` inputs from these buckets too.
    pub fn with_objects(mut self, objects: Option<ObjectInputs>) -> Self {
        self.objects = objects.map(Arc::new);
        self
    }

    pub fn root(&self) -> &Path {
        &self.roots[0]
    }

    /// Opens the input and checks its size against the limit. Failures are those reading
    /// would give. Synchronous: a record's checks before its worker call run in one go
    /// ([`crate::record`]).
    pub fn open(&self, input: InputRef) -> Result<Opened, FetchError> {
        match input {
            InputRef::Frames { .. } => Err(FetchError::Batch),
            InputRef::Inline { data_b64 } => {
                // base64 is 4 characters per 3 bytes; check before allocating the decoded copy.
                let size = (data_b64.len() as u64 / 4) * 3;
                if size > self.max_bytes {
                    return Err(FetchError::TooLarge { size, limit: self.max_bytes });
                }
                Ok(Opened::Inline(data_b64))
            }
            InputRef::Uri { uri } if ObjectInputs::reads(&uri) => match &self.objects {
                Some(objects) => objects.name(&uri).map(Opened::Named),
                None => Err(FetchError::UnsupportedScheme(shown(&uri))),
            },
            InputRef::Uri { uri } => {
                // Opened on the calling thread: one openat2 and one fstat on a local file
                // system cost less than handing the work to tokio's blocking pool and back
                // (measured: the handoff halved the gateway's record rate). Reading, which can
                // be long, goes to the blocking pool under the read deadline.
                let relative = self.relative(&uri)?;
                self.open_file(&relative, shown(&uri))
            }
        }
    }

    /// Asks a named object's size (one request, with its retries) and checks it against the
    /// limit, so that its bytes can be reserved before they are downloaded; other inputs
    /// are already sized.
    pub async fn locate(&self, opened: Opened) -> Result<Opened, FetchError> {
        match (opened, &self.objects) {
            (Opened::Named(named), Some(objects)) => objects.locate(named, self.max_bytes).await.map(Opened::Object),
            (Opened::Named(named), None) => Err(FetchError::UnsupportedScheme(named.shown)),
            (opened, _) => Ok(opened),
        }
    }

    /// Reads an opened input, within the size limit and the read timeout.
    pub async fn read(&self, opened: Opened) -> Result<Vec<u8>, FetchError> {
        match opened {
            // Not sized yet (a caller that reserves nothing): sized first, all the same.
            opened @ Opened::Named(_) => Box::pin(self.read(self.locate(opened).await?)).await,
            Opened::Object(located) => match &self.objects {
                Some(objects) => objects.read(located, self.max_bytes).await,
                None => Err(FetchError::UnsupportedScheme(located.shown)),
            },
            Opened::Inline(b64) => base64::engine::general_purpose::STANDARD.decode(b64.trim()).map_err(FetchError::BadBase64),
            Opened::File { file, size, shown } => {
                let limit = self.max_bytes;
                let path = shown.clone();
                let read = tokio::task::spawn_blocking(move || {
                    let mut bytes = Vec::with_capacity(size as usize);
                    // One byte past the limit tells a file that grew past it.
                    file.take(limit + 1).read_to_end(&mut bytes).map(|_| bytes)
                });
                let bytes = match tokio::time::timeout(self.read_timeout, read).await {
                    Err(_) => return Err(FetchError::TimedOut { path, seconds: self.read_timeout.as_secs_f64() }),
                    Ok(Err(e)) => return Err(FetchError::Io { path, source: std::io::Error::other(e) }),
                    Ok(Ok(read)) => read.map_err(|source| FetchError::Io { path: path.clone(), source })?,
                };
                if bytes.len() as u64 > limit {
                    return Err(FetchError::TooLarge { size: bytes.len() as u64, limit });
                }
                Ok(bytes)
            }
        }
    }

    /// Opens, then reads: for callers that reserve nothing in between.
    pub async fn fetch(&self, input: InputRef) -> Result<Vec<u8>, FetchError> {
        let opened = self.locate(self.open(input)?).await?;
        self.read(opened).await
    }

    /// The path of a `file://` URI relative to the root. Lexical only: the kernel checks
    /// the rest when opening.
    fn relative(&self, uri: &str) -> Result<PathBuf, FetchError> {
        let rest = uri.strip_prefix("file://").ok_or_else(|| FetchError::UnsupportedScheme(shown(uri)))?;
        if !rest.starts_with('/') {
            return Err(FetchError::UriHasHost(shown(uri)));
        }
        let decoded = percent_decode(rest).ok_or_else(|| FetchError::BadEscape(shown(uri)))?;
        let requested = Path::new(&decoded);
        let not_found = || FetchError::NotFound(shown(&decoded));
        let relative = self.roots.iter().find_map(|root| requested.strip_prefix(root).ok()).ok_or_else(not_found)?;
        if relative.as_os_str().is_empty() || relative.as_os_str().as_encoded_bytes().contains(&0) {
            return Err(not_found());
        }
        Ok(relative.to_path_buf())
    }

    fn open_file(&self, relative: &Path, shown_uri: String) -> Result<Opened, FetchError> {
        let shown_path = shown(&relative.display().to_string());
        let file = match open_beneath(&self.dir, relative) {
            Ok(file) => file,
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => self.open_resolved(relative)?,
            Err(e) => return Err(open_error(e, &shown_uri)),
        };
        let meta = file.metadata().map_err(|source| FetchError::Io { path: shown_uri.clone(), source })?;
        let kind = meta.file_type();
        let what = if kind.is_file() {
            None
        } else if kind.is_dir() {
            Some("directory")
        } else if kind.is_fifo() {
            Some("fifo")
        } else if kind.is_socket() {
            Some("socket")
        } else if kind.is_char_device() || kind.is_block_device() {
            Some("device")
        } else {
            Some("special file")
        };
        if let Some(what) = what {
            return Err(FetchError::NotRegular { path: shown_path, what });
        }
        if meta.len() > self.max_bytes {
            return Err(FetchError::TooLarge { size: meta.len(), limit: self.max_bytes });
        }
        Ok(Opened::File { file, size: meta.len(), shown: shown_uri })
    }

    /// For kernels without `openat2`: resolve symlinks in user space, check the result is under
    /// the root, then open it non-blocking.
    fn open_resolved(&self, relative: &Path) -> Result<File, FetchError> {
        let shown_path = shown(&relative.display().to_string());
        let path = self.roots[0].join(relative);
        let canonical = path.canonicalize().map_err(|e| open_error(e, &shown_path))?;
        if !canonical.starts_with(&self.roots[0]) {
            return Err(FetchError::NotFound(shown_path));
        }
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
            .open(&canonical)
            .map_err(|e| open_error(e, &shown_path))
    }
}

/// Outside the root, missing, or a path through a missing folder: one answer for all.
fn open_error(e: std::io::Error, shown_path: &str) -> FetchError {
    match e.raw_os_error() {
        Some(libc::ENOENT | libc::EXDEV | libc::ELOOP | libc::ENOTDIR) => FetchError::NotFound(shown_path.to_string()),
        _ => FetchError::Io { path: shown_path.to_string(), source: e },
    }
}

/// `openat2(dir, relative, O_RDONLY | O_NONBLOCK, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`:
/// the kernel refuses (`EXDEV`) any resolution that leaves `dir`. `O_NONBLOCK` keeps the open
/// of a FIFO from waiting for a writer; regular files ignore it.
fn open_beneath(dir: &OwnedFd, relative: &Path) -> std::io::Result<File> {
    use std::os::unix::ffi::OsStrExt;
    // Components are re-joined so a leading "./" or "//" cannot matter; ".." stays and the
    // kernel refuses it where it would leave the root.
    let mut joined = Vec::new();
    for c in relative.components() {
        match c {
            Component::Normal(part) => joined.extend_from_slice(part.as_bytes()),
            Component::ParentDir => joined.extend_from_slice(b".."),
            Component::CurDir => continue,
            Component::RootDir | Component::Prefix(_) => return Err(std::io::Error::from_raw_os_error(libc::EXDEV)),
        }
        joined.push(b'/');
    }
    joined.pop();
    let path = std::ffi::CString::new(joined).map_err(|_| std::io::Error::from_raw_os_error(libc::ENOENT))?;
    // SAFETY: open_how is plain integers; all zeroes is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY) as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: `path` is a valid C string and `how` a valid open_how for the duration of the
    // call; the returned descriptor, when non-negative, is a new one that we own.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us and nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd as i32) })
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
        InputSource::new(dir, max, Duration::from_secs(5)).expect("temp dir exists")
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
        std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
        std::fs::write(dir.join("sub/c.wav"), b"RIFF!").expect("write");
        let src = source(&dir, 1024);
        let uri = InputRef::Uri { uri: format!("file://{}/a%20b.wav", dir.display()) };
        assert_eq!(src.open(uri.clone()).expect("opens").size(), 4);
        assert_eq!(src.fetch(uri.clone()).await.expect("reads"), b"RIFF");
        let nested = InputRef::Uri { uri: format!("file://{}/./sub/../sub/c.wav", dir.display()) };
        assert_eq!(src.fetch(nested.clone()).await.expect("dots that stay inside are fine"), b"RIFF!");
        let inline = InputRef::Inline { data_b64: "UklGRg==".into() };
        assert!(src.open(inline.clone()).expect("size").size() >= 4);
        assert_eq!(src.fetch(inline.clone()).await.expect("decodes"), b"RIFF");
    }

    #[tokio::test]
    async fn refuses_what_it_must() {
        let dir = temp_dir("bad");
        let inner = dir.join("inner");
        std::fs::create_dir_all(&inner).expect("mkdir");
        std::fs::write(dir.join("secret"), b"x").expect("write");
        std::fs::write(inner.join("big"), vec![0u8; 100]).expect("write");
        let _ = std::fs::remove_file(inner.join("link"));
        std::os::unix::fs::symlink(dir.join("secret"), inner.join("link")).expect("symlink");
        let src = source(&inner, 10);
        let check = |uri: String, kind: ErrorKind, needle: &'static str| {
            let src = src.clone();
            async move {
                let err = src.fetch(InputRef::Uri { uri: uri.clone() }).await.expect_err(&uri);
                assert_eq!(err.kind(), kind, "{uri}: {err}");
                assert!(err.to_string().contains(needle), "{uri}: {err}");
                // The message shows what the producer sent, never the root they did not.
                let root = src.root().display().to_string();
                assert!(uri.contains(&root) || !err.to_string().contains(&root), "{err} names the root");
            }
        };
        check(format!("file://{}/missing.wav", inner.display()), ErrorKind::InputNotFound, "not found").await;
        // Outside the root, by "..", by a symlink or by not starting with it: the same answer
        // as a missing file, so dead letters do not tell which paths exist.
        check(format!("file://{}/../secret", inner.display()), ErrorKind::InputNotFound, "not found").await;
        check(format!("file://{}/link", inner.display()), ErrorKind::InputNotFound, "not found").await;
        check(format!("file://{}/secret", dir.display()), ErrorKind::InputNotFound, "not found").await;
        check("file:///etc/passwd".into(), ErrorKind::InputNotFound, "not found").await;
        check(format!("file://{}/big", inner.display()), ErrorKind::InputTooLarge, "limit of 10").await;
        check(format!("file://{}", inner.display()), ErrorKind::InputNotFound, "not found").await;
        check("http://example.com/a.wav".into(), ErrorKind::UnsupportedInput, "not a uri this gateway reads").await;
        check("s3://samples/a.wav".into(), ErrorKind::UnsupportedInput, "not a uri this gateway reads").await;
        check("file://host/a.wav".into(), ErrorKind::UnsupportedInput, "has a host").await;
        let err = src.fetch(InputRef::Inline { data_b64: "@@@@".into() }).await.expect_err("bad b64");
        assert_eq!(err.kind(), ErrorKind::FetchFailed);
        let big = InputRef::Inline { data_b64: "A".repeat(400) };
        assert_eq!(src.fetch(big.clone()).await.expect_err("too big").kind(), ErrorKind::InputTooLarge);
        let long = format!("file://{}/{}", inner.display(), "x".repeat(5000));
        let err = src.fetch(InputRef::Uri { uri: long }).await.expect_err("missing");
        assert!(err.to_string().len() < 600, "a long path is shown truncated: {} bytes", err.to_string().len());
    }

    #[tokio::test]
    async fn only_regular_files_are_read() {
        let dir = temp_dir("special");
        let fifo = dir.join("fifo");
        let _ = std::fs::remove_file(&fifo);
        let c = std::ffi::CString::new(fifo.display().to_string()).expect("path");
        // SAFETY: a valid C string path; mkfifo has no other preconditions.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
        std::fs::create_dir_all(dir.join("folder")).expect("mkdir");
        let src = source(&dir, 1 << 20);
        for (name, what) in [("fifo", "fifo"), ("folder", "directory")] {
            let uri = InputRef::Uri { uri: format!("file://{}/{name}", dir.display()) };
            // A FIFO with no writer would block a plain open and read for ever.
            let err = tokio::time::timeout(Duration::from_secs(10), src.fetch(uri.clone()))
                .await
                .expect("never hangs")
                .expect_err(name);
            assert_eq!(err.kind(), ErrorKind::UnsupportedInput, "{err}");
            assert!(err.to_string().contains(what), "{err}");
        }
        // A device under the root (a symlink to /dev/zero is refused as outside the root, so
        // bind the check to the handle: the file type, not the size, decides).
        let _ = std::fs::remove_file(dir.join("zero"));
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero")).expect("symlink");
        let uri = InputRef::Uri { uri: format!("file://{}/zero", dir.display()) };
        assert_eq!(src.fetch(uri.clone()).await.expect_err("outside").kind(), ErrorKind::InputNotFound);
    }
}
