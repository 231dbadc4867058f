//! Reading Prometheus text exposition: a scrape, its samples, and sums over a metric family
//! filtered by labels.

use std::collections::BTreeMap;

pub use vramgate_shared::prom_text::{parse, Sample};

/// The text of one scrape.
#[derive(Debug, Clone)]
pub struct Scrape {
    pub text: String,
}

impl Scrape {
    /// Every sample of the scrape.
    pub fn samples(&self) -> Vec<Sample> {
        parse(&self.text)
    }

    /// The sum of the samples named exactly `name` whose labels include every `(key, value)` of
    /// `labels`; 0 when there are none.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        sum(&self.text, name, labels)
    }

    /// Whether any sample is named exactly `name` (to tell a missing metric from a zero).
    pub fn has(&self, name: &str) -> bool {
        parse(&self.text).iter().any(|s| s.name == name)
    }

    /// The samples named `name`, as `labels → value`, for printing.
    pub fn family(&self, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
        parse(&self.text).into_iter().filter(|s| s.name == name).map(|s| (s.labels, s.value)).collect()
    }
}

/// GETs `url` (a full metrics URL, e.g. `http://127.0.0.1:9464/metrics`).
pub async fn scrape(http: &reqwest::Client, url: &str) -> anyhow::Result<Scrape> {
    let text =
        http.get(url).timeout(std::time::Duration::from_secs(10)).send().await?.error_for_status()?.text().await?;
    Ok(Scrape { text })
}

/// See [`Scrape::sum`].
pub fn sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    vramgate_shared::prom_text::sum(&parse(text), name, labels)
}

