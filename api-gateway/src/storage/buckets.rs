//! The clients of the buckets (`[s3]`), and the writing of stored outputs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};
use serde_json::Value;

use super::{key_part, StoredOutput};
use crate::config::{S3Config, Timeouts};

/// `object_store`'s retries of one request: backoff from 0.1 s doubling to 5 s (jittered), at
/// most `max_retries`, none started past the retry timeout.
pub fn retries(max_retries: usize, timeouts: &Timeouts) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig { init_backoff: Duration::from_millis(100), max_backoff: Duration::from_secs(5), base: 2.0 },
        max_retries,
        retry_timeout: timeouts.retry,
    }
}

/// One client per bucket, with the `[s3]` settings.
#[derive(Debug, Clone, Default)]
pub struct Buckets {
    clients: HashMap<String, Arc<dyn ObjectStore>>,
    deadline: Duration,
}

impl Buckets {
    /// Clients for `s3.buckets` and every bucket in `more` (the outputs' stores).
    pub fn new(config: &S3Config, more: impl IntoIterator<Item = String>) -> anyhow::Result<Self> {
        let timeouts = config.timeouts();
        let options = ClientOptions::new()
            .with_timeout(timeouts.request)
            .with_connect_timeout(timeouts.connect)
            .with_allow_http(config.allow_http);
        let retry = retries(config.max_retries, &timeouts);
        let mut clients = HashMap::new();
        for bucket in config.buckets.iter().cloned().chain(more) {
            if clients.contains_key(&bucket) {
                continue;
            }
            let mut builder = AmazonS3Builder::from_env()
                .with_bucket_name(&bucket)
                .with_region(&config.region)
                .with_virtual_hosted_style_request(!config.path_style)
                .with_allow_http(config.allow_http)
                .with_client_options(options.clone())
                .with_retry(retry.clone());
            if !config.endpoint.is_empty() {
                builder = builder.with_endpoint(&config.endpoint);
            }
            if let (Some(id), Some(secret)) = (&config.access_key_id, &config.secret_access_key) {
                builder = builder.with_access_key_id(id.expose()).with_secret_access_key(secret.expose());
            }
            // The builder's errors name keys and URLs, never a secret's value.
            let store = builder.build().map_err(|e| anyhow::anyhow!("s3: the client for bucket '{bucket}': {e}"))?;
            clients.insert(bucket, Arc::new(store) as Arc<dyn ObjectStore>);
        }
        let deadline = timeouts.deadline();
        Ok(Buckets { clients, deadline })
    }

    pub fn get(&self, bucket: &str) -> Option<&Arc<dyn ObjectStore>> {
        self.clients.get(bucket)
    }

    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Writes `object` for request `id` of `task`; its reference for the result.
    pub async fn put(&self, task: &str, id: &str, object: StoredOutput) -> Result<Value, String> {
        let StoredOutput { output, target, ext, bytes, mut reference } = object;
        let key = format!("{}{}/{}/{}.{ext}", target.prefix, key_part(task), key_part(id), key_part(&output));
        let uri = format!("s3://{}/{key}", target.bucket);
        let Some(store) = self.get(&target.bucket) else {
            return Err(format!("no client for bucket '{}' (a bug: every store's bucket gets one at start-up)", target.bucket));
        };
        let path = ObjectPath::parse(&key).map_err(|e| format!("'{uri}' is not a valid object key: {e}"))?;
        let length = bytes.len();
        let written = tokio::time::timeout(self.deadline, store.put(&path, PutPayload::from(bytes))).await;
        match written {
            Err(_) => return Err(format!("writing {uri} ({length} bytes) took more than {:.0} s", self.deadline.as_secs_f64())),
            Ok(Err(e)) => {
                let reason = e.to_string();
                let cut: String = reason.chars().take(400).collect();
                return Err(format!("writing {uri} ({length} bytes) failed after the retries s3 allows: {cut}"));
            }
            Ok(Ok(_)) => {}
        }
        if let Value::Object(map) = &mut reference {
            map.insert("uri".into(), Value::String(uri));
        }
        Ok(reference)
    }
}

