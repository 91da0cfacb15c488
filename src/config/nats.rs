//! `[nats]`: NATS JetStream as the event log: the servers, the stream and its subjects.

use std::time::Duration;

use serde::{Serialize, Serializer};

use super::error::{invalid, ConfigError};
use super::raw::RawNats;
use super::secret::RedactedUrl;
use super::value::{duration, int_in, name_chars, serialize_duration, shards};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NatsConfig {
    /// The servers of `nats.url`, as written between its commas: one URL, or the nodes of one
    /// cluster (the client also learns the others from the first server it reaches). Shown as
    /// written: one string, commas included.
    #[serde(serialize_with = "comma_separated")]
    pub url: Vec<RedactedUrl>,
    pub stream: String,
    pub subject_prefix: String,
    #[serde(serialize_with = "serialize_duration")]
    pub retention: Duration,
    pub shards: u32,
    /// Replicas of the stream when the hub creates it (in a JetStream cluster: 3 or 5).
    pub replicas: usize,
}

impl TryFrom<RawNats> for NatsConfig {
    type Error = ConfigError;

    fn try_from(raw: RawNats) -> Result<Self, ConfigError> {
        let retention = duration("nats.retention", &raw.retention)?;
        let shards = shards("nats.shards", raw.shards)?;
        let replicas = int_in("nats.replicas", raw.replicas, 1, 5)?;
        if raw.url.split(',').any(|url| url.trim().is_empty()) {
            return Err(invalid(
                "nats.url",
                format!(
                    "must be one URL or several separated by commas (got {:?})",
                    raw.url
                ),
            ));
        }
        name_chars("nats.stream", &raw.stream, "A-Za-z0-9_-", |c| {
            c.is_ascii_alphanumeric() || matches!(c, '_' | '-')
        })?;
        subject_prefix("nats.subject_prefix", &raw.subject_prefix)?;
        Ok(NatsConfig {
            url: raw.url.split(',').map(RedactedUrl::new).collect(),
            stream: raw.stream,
            subject_prefix: raw.subject_prefix,
            retention,
            shards,
            replicas,
        })
    }
}

fn comma_separated<S: Serializer>(urls: &[RedactedUrl], s: S) -> Result<S::Ok, S::Error> {
    let shown: Vec<String> = urls.iter().map(RedactedUrl::redacted).collect();
    s.serialize_str(&shown.join(","))
}

/// A NATS subject prefix: dot-separated non-empty tokens without wildcards
/// or whitespace, since shard numbers are appended after another dot.
fn subject_prefix(key: &str, value: &str) -> Result<(), ConfigError> {
    if value.is_empty() {
        return Err(invalid(key, "must not be empty (got \"\")"));
    }
    let bad_char = value
        .chars()
        .any(|c| c.is_whitespace() || c == '*' || c == '>');
    let empty_token = value.split('.').any(str::is_empty);
    if bad_char || empty_token {
        return Err(invalid(
            key,
            format!("must be dot-separated tokens without spaces, * or > (got {value:?})"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nats(raw: RawNats) -> Result<NatsConfig, String> {
        NatsConfig::try_from(raw).map_err(|error| error.to_string())
    }

    /// `nats.url` may list cluster nodes, kept as written (blanks too, the client trims them),
    /// but no empty one; `replicas` is 1 to 5.
    #[test]
    fn cluster_keys() {
        let c = nats(RawNats {
            url: "nats://a:4222, nats://u:pw@b:4222".into(),
            replicas: 3,
            ..RawNats::default()
        })
        .expect("valid");
        assert_eq!(c.replicas, 3);
        let urls: Vec<&str> = c.url.iter().map(RedactedUrl::as_str).collect();
        assert_eq!(urls, ["nats://a:4222", " nats://u:pw@b:4222"]);
        let shown = serde_json::to_value(&c).expect("json");
        assert_eq!(shown["url"], "nats://a:4222, nats://(redacted)@b:4222");
        for url in [
            "nats://a:4222,",
            ",nats://a:4222",
            "",
            "nats://a:4222, ,nats://b:4222",
        ] {
            let error = nats(RawNats {
                url: url.into(),
                ..RawNats::default()
            })
            .expect_err("empty server");
            assert!(error.starts_with("nats.url: "), "{error}");
        }
        let error = nats(RawNats {
            replicas: 6,
            ..RawNats::default()
        })
        .expect_err("too many");
        assert_eq!(error, "nats.replicas: must be at most 5 (got 6)");
    }

    /// The stream name and the subject prefix must be usable as JetStream names and subjects.
    #[test]
    fn names() {
        for (raw, prefix) in [
            (
                RawNats {
                    stream: "a.b".into(),
                    ..RawNats::default()
                },
                "nats.stream: ",
            ),
            (
                RawNats {
                    subject_prefix: String::new(),
                    ..RawNats::default()
                },
                "nats.subject_prefix: ",
            ),
            (
                RawNats {
                    subject_prefix: "a..b".into(),
                    ..RawNats::default()
                },
                "nats.subject_prefix: ",
            ),
            (
                RawNats {
                    subject_prefix: "a.*".into(),
                    ..RawNats::default()
                },
                "nats.subject_prefix: ",
            ),
        ] {
            let error = nats(raw).expect_err("invalid");
            assert!(error.starts_with(prefix), "{error}");
        }
        assert!(nats(RawNats {
            stream: "EV_1-a".into(),
            subject_prefix: "pos.ev".into(),
            ..RawNats::default()
        })
        .is_ok());
    }
}
