//! `[redis]`: Redis Streams as the event log: one instance (`url`), several (`urls`), or a
//! Redis Cluster (`cluster`, `groups` hash-tag groups).

use std::time::Duration;

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::raw::RawRedis;
use super::secret::{redact_url, RedactedUrl};
use super::value::{
    duration, format_duration, int_in, name_chars, serialize_duration, shards, MAX_SHARDS,
};

/// Longest `redis.block`.
const MAX_REDIS_BLOCK: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RedisConfig {
    pub url: RedactedUrl,
    pub urls: Vec<RedactedUrl>,
    pub cluster: bool,
    pub groups: u32,
    pub shards: u32,
    pub prefix: String,
    #[serde(serialize_with = "serialize_duration")]
    pub block: Duration,
    pub count: usize,
    #[serde(serialize_with = "serialize_duration")]
    pub retention: Duration,
    pub max_len: usize,
}

impl RedisConfig {
    /// Whether any URL asks for TLS (`rediss://`).
    pub fn wants_tls(&self) -> bool {
        std::iter::once(&self.url)
            .chain(&self.urls)
            .any(|url| url.as_str().starts_with("rediss://"))
    }
}

impl TryFrom<RawRedis> for RedisConfig {
    type Error = ConfigError;

    fn try_from(raw: RawRedis) -> Result<Self, ConfigError> {
        let groups = int_in("redis.groups", raw.groups, 1, i64::from(MAX_SHARDS))?;
        let shards = shards("redis.shards", raw.shards)?;
        let block = duration("redis.block", &raw.block)?;
        let count = int_in("redis.count", raw.count, 1, i64::MAX)?;
        let retention = duration("redis.retention", &raw.retention)?;
        let max_len = int_in("redis.max_len", raw.max_len, 1, i64::MAX)?;
        // Redis reads BLOCK 0 as "block forever", past every timeout of the tail's connection.
        if block.is_zero() || block > MAX_REDIS_BLOCK {
            return Err(invalid(
                "redis.block",
                format!(
                    "must be greater than 0s and at most {} (got {})",
                    format_duration(MAX_REDIS_BLOCK),
                    format_duration(block)
                ),
            ));
        }
        redis_url("redis.url", &raw.url)?;
        for url in &raw.urls {
            redis_url("redis.urls", url)?;
        }
        if raw.cluster && !raw.urls.is_empty() {
            return Err(invalid(
                "redis.cluster",
                format!(
                    "cannot be true together with a non-empty redis.urls (got {} urls)",
                    raw.urls.len()
                ),
            ));
        }
        if groups > shards {
            return Err(invalid(
                "redis.groups",
                format!("must not exceed redis.shards ({shards}) (got {groups})"),
            ));
        }
        name_chars("redis.prefix", &raw.prefix, "A-Za-z0-9._:-", |c| {
            c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')
        })?;
        Ok(RedisConfig {
            url: RedactedUrl::new(raw.url),
            urls: raw.urls.into_iter().map(RedactedUrl::new).collect(),
            cluster: raw.cluster,
            groups,
            shards,
            prefix: raw.prefix,
            block,
            count,
            retention,
            max_len,
        })
    }
}

fn redis_url(key: &str, url: &str) -> Result<(), ConfigError> {
    if url.starts_with("redis://") || url.starts_with("rediss://") {
        Ok(())
    } else {
        Err(invalid(
            key,
            format!(
                "must start with redis:// or rediss:// (got {:?})",
                redact_url(url)
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redis(raw: RawRedis) -> Result<RedisConfig, String> {
        RedisConfig::try_from(raw).map_err(|error| error.to_string())
    }

    /// Each rule of the section produces an error naming its key.
    #[test]
    fn rules_name_their_key() {
        let cases = [
            (
                RawRedis {
                    cluster: true,
                    urls: vec!["redis://a:6379".into()],
                    ..RawRedis::default()
                },
                "redis.cluster: ",
            ),
            (
                RawRedis {
                    urls: vec!["http://a".into()],
                    ..RawRedis::default()
                },
                "redis.urls: ",
            ),
            (
                RawRedis {
                    url: "tcp://a".into(),
                    ..RawRedis::default()
                },
                "redis.url: ",
            ),
            (
                RawRedis {
                    groups: 65,
                    ..RawRedis::default()
                },
                "redis.groups: ",
            ),
            (
                RawRedis {
                    prefix: "a b".into(),
                    ..RawRedis::default()
                },
                "redis.prefix: ",
            ),
            (
                RawRedis {
                    shards: 16_385,
                    ..RawRedis::default()
                },
                "redis.shards: ",
            ),
            (
                RawRedis {
                    count: 0,
                    ..RawRedis::default()
                },
                "redis.count: ",
            ),
        ];
        for (raw, prefix) in cases {
            let error = redis(raw).expect_err("invalid");
            assert!(error.starts_with(prefix), "{error}");
        }
    }

    /// Bug pinned (issue 19.11): `block = 0s` means "block forever" to Redis, past every client
    /// timeout; it and a block over ten minutes are refused.
    #[test]
    fn block_is_bounded() {
        for (block, got) in [("0s", "0s"), ("11m", "11m")] {
            let error = redis(RawRedis {
                block: block.into(),
                ..RawRedis::default()
            })
            .expect_err("out of range");
            assert_eq!(
                error,
                format!("redis.block: must be greater than 0s and at most 10m (got {got})")
            );
        }
    }

    /// A URL with the wrong scheme is refused without echoing its password; `rediss://` is a
    /// valid configuration that asks for TLS.
    #[test]
    fn url_errors_hide_the_password() {
        let error = redis(RawRedis {
            url: "tcp://:hunter2@a:6379".into(),
            ..RawRedis::default()
        })
        .expect_err("scheme");
        assert!(!error.contains("hunter2"), "{error}");
        let tls = redis(RawRedis {
            urls: vec!["redis://a:6379".into(), "rediss://b:6380".into()],
            ..RawRedis::default()
        })
        .expect("valid");
        assert!(tls.wants_tls());
        assert!(!redis(RawRedis::default()).expect("valid").wants_tls());
    }
}
