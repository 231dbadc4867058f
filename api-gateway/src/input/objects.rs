//! Inputs named by `s3://bucket/key`, read through the `object_store` crate from AWS S3 or an
//! S3-compatible server (SeaweedFS, MinIO, Ceph), and by `https://host/path` from the hosts
//! the operator listed ([`super::web`]).
//!
//! Only the buckets the operator listed (`s3.buckets`) and the hosts (`input.http.hosts`) can
//! be named: one client per bucket and per host is built at start-up, and an event naming any
//! other is refused before a request is made. A fetch is two requests: a HEAD, whose size is checked against
//! `max_input_bytes` before a byte of the body is read (and reserved from `max_held_bytes` by
//! the caller), then a GET of that version of the object (`If-Match` its ETag), whose body is
//! counted as it streams in and cut off one byte past the limit. Each request has a timeout;
//! those worth retrying (5xx, 429, 408, a refused or reset connection, a timeout) are retried
//! by `object_store` with exponential backoff, within `max_retries` and
//! `retry_timeout_seconds`; the rest fail at once. Every failure names the object as the event
//! gave it, never a credential.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, ObjectStore, ObjectStoreExt};

use super::{shown, web, FetchError};
use crate::config::{HttpInputConfig, S3Config};
use crate::storage::buckets::Buckets;

/// The buckets and hosts events may name, each with its client.
#[derive(Debug, Clone)]
pub struct ObjectInputs {
    buckets: HashMap<String, Arc<dyn ObjectStore>>,
    /// Bounds one whole read of an object (HEAD, GET and every retry of either): a backstop
    /// past `object_store`'s own per-request timeout and retry budget.
    deadline: Duration,
    web: Option<web::WebInputs>,
}

/// An object found by its HEAD: the size is known and within the limit.
#[derive(Debug)]
pub struct Located {
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    e_tag: Option<String>,
    pub size: u64,
    pub shown: String,
    deadline: Duration,
}

/// An object named by an event, not yet asked for.
#[derive(Debug)]
pub struct Named {
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    pub shown: String,
    /// Bounds its whole read (HEAD and GET, every retry included).
    deadline: Duration,
}


impl ObjectInputs {
    /// The clients of the buckets events may name (`s3.buckets`) and of the hosts
    /// (`input.http.hosts`); `None` when neither lists any.
    pub fn new(config: &S3Config, http: &HttpInputConfig, clients: &Buckets) -> anyhow::Result<Option<Self>> {
        if config.buckets.is_empty() && http.hosts.is_empty() {
            return Ok(None);
        }
        let mut buckets = HashMap::new();
        for bucket in &config.buckets {
            let client = clients.get(bucket).ok_or_else(|| anyhow::anyhow!("s3: no client for bucket '{bucket}'"))?;
            buckets.insert(bucket.clone(), client.clone());
        }
        let web = (!http.hosts.is_empty()).then(|| web::WebInputs::new(http)).transpose()?;
        Ok(Some(ObjectInputs { buckets, deadline: clients.deadline(), web }))
    }

    /// Whether `uri` is one of the schemes read here.
    pub fn reads(uri: &str) -> bool {
        ["s3://", "https://", "http://"].iter().any(|scheme| uri.starts_with(scheme))
    }

    /// The bucket and key of an `s3://` URI, checked without a request: the bucket must be
    /// listed and the key a valid object path.
    pub fn name(&self, uri: &str) -> Result<Named, FetchError> {
        let Some(rest) = uri.strip_prefix("s3://") else {
            return match &self.web {
                Some(web) => web.name(uri).map(|t| Named { store: t.store, path: t.path, shown: shown(uri), deadline: t.deadline }),
                None => Err(FetchError::UnsupportedScheme(shown(uri))),
            };
        };
        if self.buckets.is_empty() {
            return Err(FetchError::UnsupportedScheme(shown(uri)));
        }
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        let store = self.buckets.get(bucket).ok_or_else(|| FetchError::BucketNotListed(shown(bucket)))?;
        if key.is_empty() {
            return Err(FetchError::BadKey { uri: shown(uri), reason: "the key is empty".into() });
        }
        let path = ObjectPath::parse(key).map_err(|e| FetchError::BadKey { uri: shown(uri), reason: shown(&e.to_string()) })?;
        Ok(Named { store: store.clone(), path, shown: shown(uri), deadline: self.deadline })
    }

    /// Asks for the object's size (HEAD) and checks it against `limit` before any download.
    pub async fn locate(&self, named: Named, limit: u64) -> Result<Located, FetchError> {
        let Named { store, path, shown, deadline } = named;
        let head = tokio::time::timeout(deadline, store.head(&path))
            .await
            .map_err(|_| FetchError::TimedOut { path: shown.clone(), seconds: deadline.as_secs_f64() })?
            .map_err(|e| object_error(e, &shown))?;
        if head.size > limit {
            return Err(FetchError::TooLarge { size: head.size, limit });
        }
        Ok(Located { store, path, e_tag: head.e_tag, size: head.size, shown, deadline })
    }

    /// Downloads the located object, its body cut off one byte past `limit`.
    pub async fn read(&self, located: Located, limit: u64) -> Result<Vec<u8>, FetchError> {
        let Located { store, path, e_tag, size, shown, deadline } = located;
        let download = async {
            // The version the HEAD sized: an object replaced in between fails the precondition
            // instead of arriving at a size nobody reserved.
            let options = GetOptions { if_match: e_tag, ..GetOptions::default() };
            let got = store.get_opts(&path, options).await.map_err(|e| object_error(e, &shown))?;
            let mut bytes = Vec::with_capacity(size.min(limit) as usize);
            let mut body = got.into_stream();
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| object_error(e, &shown))?;
                if (bytes.len() + chunk.len()) as u64 > limit {
                    return Err(FetchError::TooLarge { size: (bytes.len() + chunk.len()) as u64, limit });
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(bytes)
        };
        tokio::time::timeout(deadline, download)
            .await
            .map_err(|_| FetchError::TimedOut { path: shown.clone(), seconds: deadline.as_secs_f64() })?
    }
}

/// An `object_store` error as the dead letter says it: what happened to which object.
fn object_error(e: object_store::Error, shown_uri: &str) -> FetchError {
    let uri = shown_uri.to_string();
    match e {
        object_store::Error::NotFound { .. } => FetchError::ObjectNotFound(uri),
        object_store::Error::PermissionDenied { source, .. } | object_store::Error::Unauthenticated { source, .. } => {
            FetchError::ObjectDenied { uri, reason: shown(&source.to_string()) }
        }
        object_store::Error::Precondition { .. } => {
            FetchError::ObjectFailed { uri, reason: "the object changed while it was being read".into() }
        }
        other => FetchError::ObjectFailed { uri, reason: shown(&other.to_string()) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listed bucket on a port nothing listens on.
    fn unreachable(secret: &str) -> S3Config {
        S3Config {
            buckets: vec!["samples".into()],
            endpoint: "http://127.0.0.1:9".into(),
            allow_http: true,
            access_key_id: Some(vramgate_shared::config::Secret::new("id")),
            secret_access_key: Some(vramgate_shared::config::Secret::new(secret)),
            ..S3Config::default()
        }
    }

    fn inputs(config: &S3Config) -> ObjectInputs {
        ObjectInputs::new(config, &HttpInputConfig::default(), &Buckets::new(config, []).expect("clients"))
            .expect("builds")
            .expect("a bucket is listed")
    }

    #[tokio::test]
    async fn names_are_checked_before_any_request() {
        let objects = inputs(&unreachable("secret"));
        assert!(objects.name("s3://samples/a/b.wav").is_ok());
        let err = objects.name("s3://other/a.wav").expect_err("not listed");
        assert!(err.to_string().contains("'other'") && err.to_string().contains("s3.buckets"), "{err}");
        assert_eq!(err.kind(), vramgate_shared::events::ErrorKind::UnsupportedInput);
        for bad in ["s3://samples", "s3://samples/", "s3://samples/a//b", "s3://samples/../x"] {
            let err = objects.name(bad).expect_err(bad);
            assert!(err.to_string().contains("key"), "{bad}: {err}");
        }
        // A bucket name far past S3's 63 characters is shown cut, not echoed whole.
        let err = objects.name(&format!("s3://{}/k", "b".repeat(5000))).expect_err("long");
        assert!(err.to_string().len() < 600, "{err}");
    }

    #[tokio::test]
    async fn an_unreachable_server_is_a_bounded_failure_naming_the_object() {
        let config = S3Config { max_retries: 2, retry_timeout_seconds: 1.0, ..unreachable("do-not-print-me") };
        let objects = inputs(&config);
        let started = std::time::Instant::now();
        let err = objects.locate(objects.name("s3://samples/x.wav").expect("named"), 1 << 20).await.expect_err("no server");
        assert!(started.elapsed() < Duration::from_secs(30), "bounded: {:?}", started.elapsed());
        let text = err.to_string();
        assert!(text.contains("s3://samples/x.wav") && !text.contains("do-not-print-me"), "{text}");
        assert_eq!(err.kind(), vramgate_shared::events::ErrorKind::FetchFailed);
    }

    /// A server that answers HEAD with a size and stalls after the first bytes of every GET's
    /// body, for ever: the read is cut off by the request timeout, retried within the budget,
    /// then failed, naming the object; nothing waits past the bound.
    #[tokio::test]
    async fn a_server_that_stalls_mid_body_is_a_bounded_failure() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let gets = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = gets.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = listener.accept().await else { return };
                let gets = counted.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let headers = "Content-Length: 1000\r\nETag: \"e1\"\r\nLast-Modified: Thu, 26 Nov 2026 10:00:00 GMT\r\n";
                    if head.starts_with(b"HEAD") {
                        let _ = conn.write_all(format!("HTTP/1.1 200 OK\r\n{headers}\r\n").as_bytes()).await;
                        return;
                    }
                    gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    // A retry asks for the rest (`Range: bytes=N-`), as a real server answers it.
                    let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
                    let from: usize = text
                        .lines()
                        .find_map(|l| l.strip_prefix("range: bytes=")?.split('-').next()?.trim().parse().ok())
                        .unwrap_or(0);
                    let status = match from {
                        0 => format!("HTTP/1.1 200 OK\r\n{headers}\r\n"),
                        _ => format!(
                            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {from}-999/1000\r\n\
                             ETag: \"e1\"\r\nLast-Modified: Thu, 26 Nov 2026 10:00:00 GMT\r\n\r\n",
                            1000 - from
                        ),
                    };
                    let _ = conn.write_all(status.as_bytes()).await;
                    let _ = conn.write_all(&[7u8; 100]).await;
                    // ...and never the rest.
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                });
            }
        });
        let config = S3Config {
            endpoint: format!("http://127.0.0.1:{port}"),
            request_timeout_seconds: 1.0,
            max_retries: 2,
            retry_timeout_seconds: 2.0,
            ..unreachable("secret")
        };
        let objects = inputs(&config);
        let started = std::time::Instant::now();
        let located = objects.locate(objects.name("s3://samples/stall.wav").expect("named"), 1 << 20).await.expect("HEAD answers");
        assert_eq!(located.size, 1000);
        let err = objects.read(located, 1 << 20).await.expect_err("the body never ends");
        let took = started.elapsed();
        assert!(took < objects.deadline + Duration::from_secs(1), "bounded: {took:?}");
        assert!(err.to_string().contains("s3://samples/stall.wav"), "{err}");
        assert_eq!(err.kind(), vramgate_shared::events::ErrorKind::FetchFailed, "{err}");
        eprintln!("stalled body: failed after {took:.1?} and {} GETs: {err}", gets.load(std::sync::atomic::Ordering::SeqCst));
    }
}
