//! The S3-compatible object store (`[s3]`): one client per bucket the gateway reads inputs from
//! (`s3.buckets`) or writes outputs to (`[[outputs]]` rows with `store`), built at start-up;
//! and the writing of stored outputs (the claim check: an output too big for a Kafka record is
//! written to `<prefix><task>/<id>/<output>.<ext>`, and the result carries its reference).
//!
//! Keys are deterministic, so a record processed again (after a crash, at least once) writes
//! the same objects again. A write that fails for a reason worth retrying is retried by
//! `object_store` within `s3.max_retries` and `s3.retry_timeout_seconds`; after that the record
//! is a dead letter (`store_failed`) naming the object. The clients are [`buckets`]'s.


use object_store::path::Path as ObjectPath;
use serde_json::Value;
use sha2::{Digest, Sha256};

pub mod buckets;

/// Longest id or task name kept whole in an object key; past it the part is cut and its
/// SHA-256 appended, so two long ids never share a key.
const MAX_KEY_PART_BYTES: usize = 200;

/// Where a row's outputs go: `s3://bucket/prefix/`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct StoreTarget {
    pub bucket: String,
    /// Empty, or ending in `/`.
    pub prefix: String,
}

impl TryFrom<String> for StoreTarget {
    type Error = String;

    fn try_from(uri: String) -> Result<Self, String> {
        let rest = uri.strip_prefix("s3://").ok_or_else(|| format!("store '{uri}' must be s3://bucket/prefix/"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if !valid_bucket(bucket) {
            return Err(format!("store '{uri}': '{bucket}' is not a valid bucket name (3-63 of a-z, 0-9, '.', '-')"));
        }
        if !prefix.is_empty() && !prefix.ends_with('/') {
            return Err(format!("store '{uri}': the prefix must end with '/'"));
        }
        if prefix.len() > 512 || (!prefix.is_empty() && ObjectPath::parse(prefix.trim_end_matches('/')).is_err()) {
            return Err(format!("store '{uri}': the prefix is not a valid key prefix (at most 512 bytes, no empty or '..' parts)"));
        }
        Ok(StoreTarget { bucket: bucket.to_string(), prefix: prefix.to_string() })
    }
}

impl From<StoreTarget> for String {
    fn from(target: StoreTarget) -> String {
        format!("s3://{}/{}", target.bucket, target.prefix)
    }
}

/// S3's bucket naming rule: 3 to 63 of a-z, 0-9, '.', '-', starting and ending alphanumeric.
pub fn valid_bucket(bucket: &str) -> bool {
    (3..=63).contains(&bucket.len())
        && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
        && bucket.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// An output rendered for storage, to be written before its result is produced.
#[derive(Debug)]
pub struct StoredOutput {
    /// The row's output name: the result's `outputs.<name>`, and the object's file name.
    pub output: String,
    pub target: StoreTarget,
    /// `npy`, `png` or `json`.
    pub ext: &'static str,
    pub bytes: Vec<u8>,
    /// What the result says of it: `bytes`, `sha256`, `shape`, `datatype`; `uri` is added
    /// once it is written.
    pub reference: Value,
}

impl StoredOutput {
    pub fn new(output: &str, target: &StoreTarget, ext: &'static str, bytes: Vec<u8>, shape: &[usize], datatype: &str) -> Self {
        let sha256 = hex(&Sha256::digest(&bytes));
        let reference = serde_json::json!({
            "bytes": bytes.len(),
            "sha256": sha256,
            "shape": shape,
            "datatype": datatype,
        });
        StoredOutput { output: output.to_string(), target: target.clone(), ext, bytes, reference }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A task name, id or output name as one part of an object key: ASCII letters, digits, '.',
/// '_' and '-' as they are, every other byte as `%XX`; "." and ".." (which S3 clients treat
/// as path steps) escaped too. A part longer than [`MAX_KEY_PART_BYTES`] is cut and its
/// SHA-256 appended.
pub fn key_part(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-') || (b == b'.' && s != "." && s != "..") {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.is_empty() {
        out.push_str("%00");
    }
    if out.len() > MAX_KEY_PART_BYTES {
        let digest = hex(&Sha256::digest(s.as_bytes()));
        out.truncate(MAX_KEY_PART_BYTES - 65);
        // Never cut through a %XX escape.
        while out.ends_with('%') || out[..out.len().saturating_sub(1)].ends_with('%') {
            out.pop();
        }
        out.push('-');
        out.push_str(&digest);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_parts_are_safe_and_stable() {
        assert_eq!(key_part("req-1.a_b"), "req-1.a_b");
        assert_eq!(key_part("a/b c"), "a%2Fb%20c");
        assert_eq!(key_part(".."), "%2E%2E");
        assert_eq!(key_part(""), "%00");
        let long = "x/".repeat(500);
        let part = key_part(&long);
        assert!(part.len() <= MAX_KEY_PART_BYTES, "{}", part.len());
        assert_eq!(part, key_part(&long), "deterministic");
        assert_ne!(part, key_part(&"x/".repeat(501)), "two long ids differ");
        assert!(ObjectPath::parse(format!("p/{part}/y.npy")).is_ok());
    }

    #[test]
    fn store_targets_parse() {
        let t = StoreTarget::try_from("s3://outputs/masks/".to_string()).expect("parses");
        assert_eq!((t.bucket.as_str(), t.prefix.as_str()), ("outputs", "masks/"));
        assert_eq!(StoreTarget::try_from("s3://outputs".to_string()).expect("no prefix").prefix, "");
        for bad in ["outputs/x/", "s3://Bad_Bucket/", "s3://outputs/no-slash", "s3://outputs/a//b/", "s3://outputs/../"] {
            assert!(StoreTarget::try_from(bad.to_string()).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_stored_output_names_its_digest() {
        let target = StoreTarget::try_from("s3://outputs/".to_string()).expect("parses");
        let stored = StoredOutput::new("mask", &target, "png", b"abc".to_vec(), &[1, 2], "FP32");
        assert_eq!(stored.reference["sha256"], "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(stored.reference["bytes"], 3);
    }
}
