//! Scraper and parser for the Prometheus text exposition format served on
//! `GET /metrics`, with label-subset lookups so tests need not spell out
//! every label a metric carries.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use super::http;

type Labels = Vec<(String, String)>;

/// One sample line: `name{label="value",...} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Labels,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn matches(&self, name: &str, labels: &[(&str, &str)]) -> bool {
        self.name == name && labels.iter().all(|(k, v)| self.label(k) == Some(*v))
    }
}

/// A parsed `/metrics` page.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    pub text: String,
    pub samples: Vec<Sample>,
    help: HashMap<String, String>,
    types: HashMap<String, String>,
}

/// `GET /metrics`, asserting 200.
pub async fn scrape(addr: SocketAddr) -> Scrape {
    let resp = http::get(addr, "/metrics").await;
    assert_eq!(
        resp.status,
        200,
        "GET /metrics answered {}: {}",
        resp.status,
        resp.text()
    );
    Scrape::parse(&resp.text())
}

/// Polls `GET /metrics` until the samples named `name` with `labels` add up to at least `value`;
/// panics after `timeout` with the last value and every sample of the same family (the name up
/// to its first `_`, e.g. all `sse_*`), which tells where what was waited for went.
pub async fn wait_for(
    addr: SocketAddr,
    name: &str,
    labels: &[(&str, &str)],
    value: f64,
    timeout: Duration,
) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let scrape = scrape(addr).await;
        let current = scrape.value_or_zero(name, labels);
        if current >= value {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            let family = name.split('_').next().unwrap_or(name);
            let related: Vec<String> = scrape
                .samples
                .iter()
                .filter(|sample| sample.name.starts_with(family))
                .map(|sample| format!("{}{:?} {}", sample.name, sample.labels, sample.value))
                .collect();
            panic!("{name}{labels:?} stayed at {current}, expected {value}; {related:#?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Scrape {
    /// Parses exposition text; panics on a malformed sample line, because
    /// the hub must never serve one.
    pub fn parse(text: &str) -> Scrape {
        let mut scrape = Scrape {
            text: text.to_string(),
            ..Scrape::default()
        };
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                let mut parts = comment.trim_start().splitn(3, ' ');
                let (kind, name, rest) = (parts.next(), parts.next(), parts.next());
                match (kind, name) {
                    (Some("HELP"), Some(name)) => {
                        scrape
                            .help
                            .insert(name.to_string(), rest.unwrap_or_default().to_string());
                    }
                    (Some("TYPE"), Some(name)) => {
                        scrape.types.insert(
                            name.to_string(),
                            rest.unwrap_or_default().trim().to_string(),
                        );
                    }
                    _ => {}
                }
                continue;
            }
            let sample =
                parse_sample(line).unwrap_or_else(|e| panic!("bad metrics line {line:?}: {e}"));
            scrape.samples.push(sample);
        }
        scrape
    }

    /// Sum of all samples named `name` whose labels include every given
    /// pair; `None` when no sample matches.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .filter(|s| s.matches(name, labels))
            .map(|s| s.value)
            .reduce(|a, b| a + b)
    }

    /// Like [`Scrape::value`] but treating "absent" as 0, as Prometheus does
    /// for counters that have not been touched yet.
    pub fn value_or_zero(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.value(name, labels).unwrap_or(0.0)
    }

    pub fn matching(&self, name: &str, labels: &[(&str, &str)]) -> Vec<&Sample> {
        self.samples
            .iter()
            .filter(|s| s.matches(name, labels))
            .collect()
    }

    pub fn has_help(&self, name: &str) -> bool {
        self.help.contains_key(name)
    }

    pub fn help(&self, name: &str) -> Option<&str> {
        self.help.get(name).map(String::as_str)
    }

    /// The `# TYPE` of a metric family (`counter`, `gauge`, `histogram`...).
    pub fn metric_type(&self, name: &str) -> Option<&str> {
        self.types.get(name).map(String::as_str)
    }
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or("no value")?;
    let name = line[..name_end].to_string();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(after_brace)?;
        labels = parsed;
        rest = after;
    }
    let value_text = rest.split_whitespace().next().ok_or("no value")?;
    // Rust's float parser accepts the format's `+Inf`, `-Inf` and `NaN`.
    let value = value_text
        .parse::<f64>()
        .map_err(|_| format!("bad value {value_text:?}"))?;
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// Parses `a="x",b="y\"z"}` (after the opening brace); returns the labels
/// and the text after the closing brace.
fn parse_labels(mut s: &str) -> Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches(|c: char| c == ',' || c.is_whitespace());
        if let Some(after) = s.strip_prefix('}') {
            return Ok((labels, after));
        }
        let eq = s.find('=').ok_or("label without '='")?;
        let name = s[..eq].trim().to_string();
        s = s[eq + 1..]
            .trim_start()
            .strip_prefix('"')
            .ok_or("label value not quoted")?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err("dangling escape".into()),
                },
                Some((_, c)) => value.push(c),
                None => return Err("unterminated label value".into()),
            }
        };
        s = &s[end + 1..];
        labels.push((name, value));
    }
}
