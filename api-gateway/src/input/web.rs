//! `https://host/path` inputs (and `http://` where allowed), from the hosts the operator listed
//! (`input.http.hosts`) and no other: an event cannot make the gateway fetch an address inside
//! its network. The URL is checked before any request (scheme, listed host and port, no user
//! information, no query string, a path), and redirects are never followed, since a listed host
//! could otherwise send the fetch anywhere: a 3xx answer is a failure naming the URL. Each host
//! gets its own `object_store` HTTP client at start-up, so the fetch is the objects' own (HEAD
//! and its size check, a GET capped while it streams, retries, [`super::objects`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use object_store::client::{HttpClient, HttpConnector};
use object_store::http::HttpBuilder;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore};

use super::{shown, FetchError};
use crate::config::HttpInputConfig;
use crate::storage::buckets::retries;

/// What a URL names: its host's client, the path, and the bound of its whole read.
#[derive(Debug)]
pub struct Target {
    pub store: Arc<dyn ObjectStore>,
    pub path: ObjectPath,
    pub deadline: Duration,
}

/// One client per listed origin (`https://host:port`, and `http://` too when allowed).
#[derive(Debug, Clone)]
pub struct WebInputs {
    origins: HashMap<String, Arc<dyn ObjectStore>>,
    deadline: Duration,
}

/// `reqwest` with redirects refused: the one HTTP client `object_store` gets for these hosts.
#[derive(Debug)]
struct NoRedirects {
    timeout: Duration,
    connect_timeout: Duration,
}

impl HttpConnector for NoRedirects {
    fn connect(&self, _: &ClientOptions) -> object_store::Result<HttpClient> {
        let client = reqwest13::Client::builder()
            .redirect(reqwest13::redirect::Policy::none())
            .timeout(self.timeout)
            .connect_timeout(self.connect_timeout)
            .build()
            .map_err(|e| object_store::Error::Generic { store: "HTTP", source: Box::new(e) })?;
        Ok(HttpClient::new(client))
    }
}

impl WebInputs {
    pub fn new(config: &HttpInputConfig) -> anyhow::Result<Self> {
        let timeouts = config.timeouts();
        let retry = retries(config.max_retries, &timeouts);
        let schemes: &[&str] = if config.allow_http { &["https", "http"] } else { &["https"] };
        let mut origins = HashMap::new();
        for host in &config.hosts {
            for scheme in schemes {
                let origin = origin(scheme, &host.to_ascii_lowercase());
                let store = HttpBuilder::new()
                    .with_url(&origin)
                    .with_retry(retry.clone())
                    .with_http_connector(NoRedirects { timeout: timeouts.request, connect_timeout: timeouts.connect })
                    .build()
                    .map_err(|e| anyhow::anyhow!("input.http: the client for {origin}: {e}"))?;
                origins.insert(origin, Arc::new(store) as Arc<dyn ObjectStore>);
            }
        }
        Ok(WebInputs { origins, deadline: timeouts.deadline() })
    }

    /// The origin and path of a URL, checked without a request.
    pub fn name(&self, uri: &str) -> Result<Target, FetchError> {
        let bad = |reason: &str| FetchError::BadUrl { url: shown(uri), reason: reason.to_string() };
        let url = reqwest13::Url::parse(uri).map_err(|e| bad(&format!("not a URL ({e})")))?;
        let scheme = url.scheme();
        if scheme != "https" && scheme != "http" {
            return Err(FetchError::UnsupportedScheme(shown(uri)));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(bad("a URL with user information is not read"));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(bad("a URL with a query string or a fragment is not read"));
        }
        let Some(host) = url.host_str() else { return Err(bad("the URL has no host")) };
        // The host as the allow-list names it: with its port when the URL gives one.
        let named = match url.port() {
            Some(port) => format!("{host}:{port}"),
            None => host.to_string(),
        };
        let Some(store) = self.origins.get(&origin(scheme, &named)) else {
            return Err(match self.origins.keys().any(|o| o.ends_with(&format!("://{named}"))) {
                // A listed host by plain http:// while only https:// is allowed.
                true => bad("plain http:// is not allowed (input.http.allow_http)"),
                false => FetchError::HostNotListed(shown(&named)),
            });
        };
        let path = ObjectPath::from_url_path(url.path()).map_err(|e| bad(&format!("its path is not read ({e})")))?;
        if path.as_ref().is_empty() {
            return Err(bad("the URL names no file"));
        }
        Ok(Target { store: store.clone(), path, deadline: self.deadline })
    }
}

fn origin(scheme: &str, host: &str) -> String {
    format!("{scheme}://{host}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(allow_http: bool) -> WebInputs {
        let config = HttpInputConfig { hosts: vec!["media.example.com".into(), "127.0.0.1:8888".into()], allow_http, ..Default::default() };
        WebInputs::new(&config).expect("builds")
    }

    #[test]
    fn only_listed_hosts_and_plain_urls_are_named() {
        let web = inputs(false);
        assert!(web.name("https://media.example.com/a/b.jpg").is_ok());
        assert!(web.name("https://MEDIA.example.com/a%20b.jpg").is_ok(), "host names compare without case");
        let check = |uri: &str, needle: &str| {
            let err = web.name(uri).expect_err(uri);
            assert!(err.to_string().contains(needle), "{uri}: {err}");
            assert_eq!(err.kind(), vramgate_shared::events::ErrorKind::UnsupportedInput, "{uri}");
        };
        check("https://169.254.169.254/latest/meta-data", "'169.254.169.254' is not one this gateway reads");
        check("https://media.example.com:8443/a.jpg", "'media.example.com:8443'");
        check("https://127.0.0.1/a.jpg", "'127.0.0.1'");
        check("http://media.example.com/a.jpg", "allow_http");
        check("https://media.example.com/a.jpg?X-Amz-Signature=1", "query string");
        check("https://user:pw@media.example.com/a.jpg", "user information");
        check("https://media.example.com/", "names no file");
        check("https://media.example.com.evil.net/a.jpg", "not one this gateway reads");
        check("ftp://media.example.com/a.jpg", "not a uri this gateway reads");
        let long = format!("https://{}.com/a.jpg", "x".repeat(5000));
        assert!(web.name(&long).expect_err("long").to_string().len() < 700);
        assert!(inputs(true).name("http://127.0.0.1:8888/buckets/a.jpg").is_ok());
    }
}
