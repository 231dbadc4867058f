//! A real S3-compatible server (SeaweedFS) for the object-storage tests, started and stopped
//! through `scripts/object-store` on a port of the test's own, and a client that puts the
//! samples the events name.

use std::sync::Arc;

use anyhow::Context;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::run_script;

/// A running server; stopped when dropped.
pub struct ObjectServer {
    pub port: u16,
    /// What `scripts/object-store env` exports: endpoint and credentials.
    pub env: Vec<(String, String)>,
}

impl ObjectServer {
    /// Starts the server with its S3 API on `port` and buckets `samples`, `outputs` and
    /// `forbidden` (which the test identity may not read).
    pub fn start(port: u16) -> anyhow::Result<Self> {
        let mut server = ObjectServer { port, env: Vec::new() };
        server.script("start")?;
        let exports = server.script("env")?;
        server.env = exports
            .lines()
            .filter_map(|line| line.strip_prefix("export ")?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.trim_matches(|c| c == '\'' || c == '"').to_string()))
            .collect();
        anyhow::ensure!(server.var("AWS_ACCESS_KEY_ID").is_some(), "scripts/object-store env gave no credentials: {exports}");
        Ok(server)
    }

    /// A value `scripts/object-store env` exported.
    pub fn var(&self, name: &str) -> Option<&str> {
        self.env.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A gateway's `[s3]` section for this server (plain HTTP, 30 s a request).
    pub fn gateway_section(&self) -> String {
        format!("[s3]\nendpoint = \"{}\"\nallow_http = true\nrequest_timeout_seconds = 30.0\n\n", self.endpoint())
    }

    /// The test identity's credentials as a gateway takes them from its configuration's
    /// environment form (`s3.access_key_id`, `s3.secret_access_key`), not the AWS chain.
    pub fn gateway_keys(&self) -> [(&'static str, String); 2] {
        [
            ("S3__ACCESS_KEY_ID", self.var("AWS_ACCESS_KEY_ID").unwrap_or_default().to_string()),
            ("S3__SECRET_ACCESS_KEY", self.var("AWS_SECRET_ACCESS_KEY").unwrap_or_default().to_string()),
        ]
    }

    /// Overrides that point a gateway running config/products.toml (seed 004's segmentor) at
    /// this server (its endpoint and the test identity), `worker_url`, the input `root`, a
    /// fresh group and `topics` for its task `products`: the file as it ships, deployed here.
    pub fn products_gateway(&self, worker_url: &str, root: &std::path::Path, topics: &crate::TaskTopics) -> Vec<(&'static str, String)> {
        let mut overrides = self.gateway_keys().to_vec();
        overrides.extend([
            ("KAFKA__GROUP_ID", crate::unique("products-gw")),
            ("WORKER__URL", worker_url.to_string()),
            ("INPUT__FILE_ROOT", root.display().to_string()),
            ("S3__ENDPOINT", self.endpoint()),
            ("TASKS__PRODUCTS__REQUESTS_TOPIC", topics.requests.clone()),
            ("TASKS__PRODUCTS__RESULTS_TOPIC", topics.results.clone()),
            ("TASKS__PRODUCTS__DLQ_TOPIC", topics.dlq.clone()),
        ]);
        overrides
    }

    /// Starts it again after [`stop`](Self::stop), on the same port and data.
    pub fn restart(&self) -> anyhow::Result<()> {
        self.script("start").map(drop)
    }

    pub fn stop(&self) -> anyhow::Result<()> {
        self.script("stop").map(drop)
    }

    /// A client of `bucket` with the test identity's credentials.
    pub fn bucket(&self, bucket: &str) -> anyhow::Result<Arc<dyn ObjectStore>> {
        let store = AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_endpoint(self.endpoint())
            .with_region("us-east-1")
            .with_allow_http(true)
            .with_access_key_id(self.var("AWS_ACCESS_KEY_ID").unwrap_or_default())
            .with_secret_access_key(self.var("AWS_SECRET_ACCESS_KEY").unwrap_or_default())
            .build()?;
        Ok(Arc::new(store))
    }

    /// Writes `bytes` at `bucket/key`.
    pub async fn put(&self, bucket: &str, key: &str, bytes: Vec<u8>) -> anyhow::Result<()> {
        let store = self.bucket(bucket)?;
        store.put(&ObjectPath::parse(key)?, PutPayload::from(bytes)).await.with_context(|| format!("putting {bucket}/{key}"))?;
        Ok(())
    }

    /// The bytes at `bucket/key`.
    pub async fn get(&self, bucket: &str, key: &str) -> anyhow::Result<Vec<u8>> {
        let store = self.bucket(bucket)?;
        let got = store.get(&ObjectPath::parse(key)?).await.with_context(|| format!("getting {bucket}/{key}"))?;
        Ok(got.bytes().await?.to_vec())
    }

    fn script(&self, action: &str) -> anyhow::Result<String> {
        run_script("object-store", &[action, "--port", &self.port.to_string()])
    }
}

impl Drop for ObjectServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
