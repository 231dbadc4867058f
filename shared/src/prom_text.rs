//! Reading the Prometheus text exposition format (what both services serve at `/metrics`):
//! samples with their labels, and sums over a family filtered by labels. For clients of the
//! services (the load generator, the tests); neither service parses its own metrics.

use std::collections::BTreeMap;

/// One sample: metric name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// The sum of the samples named exactly `name` whose labels include every `(key, value)` of
/// `labels`; 0 when there are none.
pub fn sum(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).is_some_and(|got| got == v)))
        .map(|s| s.value)
        .sum::<f64>()
        // An empty sum is -0.0; print it as 0.
        + 0.0
}

/// The largest value of the samples named `name`, if there is one.
pub fn max(samples: &[Sample], name: &str) -> Option<f64> {
    samples.iter().filter(|s| s.name == name).map(|s| s.value).reduce(f64::max)
}

/// Parses the text format; lines it cannot read are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter(|l| !l.trim_start().starts_with('#')).filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    let name_end = line.find(['{', ' ', '\t'])?;
    let name = &line[..name_end];
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if rest.starts_with('{') {
        let (parsed, after) = parse_labels(&rest[1..])?;
        labels = parsed;
        rest = after;
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other.parse().ok()?,
    };
    Some(Sample { name: name.to_string(), labels, value })
}

/// Reads `key="value",…}` and returns the labels and the text after the closing brace.
fn parse_labels(mut s: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(after) = s.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim().to_string();
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                other => value.push(other),
            }
        };
        labels.insert(key, value);
        s = &s[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP vramgate_gateway_records_produced_total Records produced.
# TYPE vramgate_gateway_records_produced_total counter
vramgate_gateway_records_produced_total{task="voice",outcome="result"} 17
vramgate_gateway_records_produced_total{task="voice",outcome="dead_letter"} 3
vramgate_gateway_records_produced_total{outcome="result",task="image"} 5
vramgate_gateway_held_bytes 1.5e3
weird{a="x,y}\"z"} 2 1700000000
vramgate_gateway_records_produced_total_extra 100
"#;

    #[test]
    fn sums_a_family_filtered_by_labels() {
        let name = "vramgate_gateway_records_produced_total";
        assert_eq!(sum(&parse(TEXT), name, &[]), 25.0);
        assert_eq!(sum(&parse(TEXT), name, &[("task", "voice")]), 20.0);
        assert_eq!(sum(&parse(TEXT), name, &[("outcome", "result")]), 22.0);
        assert_eq!(sum(&parse(TEXT), name, &[("task", "image"), ("outcome", "result")]), 5.0);
        assert_eq!(sum(&parse(TEXT), name, &[("task", "audio")]), 0.0);
        assert_eq!(sum(&parse(TEXT), "vramgate_gateway_held_bytes", &[]), 1500.0);
        assert_eq!(sum(&parse(TEXT), "weird", &[("a", "x,y}\"z")]), 2.0);
        assert!(!parse(TEXT).iter().any(|s| s.name == "vramgate_gateway_missing"));
        assert_eq!(max(&parse(TEXT), name), Some(17.0));
    }
}
