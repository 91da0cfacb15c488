//! `[redis]`: Redis Streams as the event log: one instance (`url`), several (`urls`), or a
//! Redis Cluster (`cluster`, `groups` hash-tag groups); TLS (`rediss://` with `tls_*` files) and
//! an ACL user (`username`, `password_file`).
//!
//! Only the combinations are checked here; the files are read where the backend is built, once
//! at start-up (`backend::redis::setup`), so that the configuration stays a value without secrets.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::raw::RawRedis;
use super::secret::{redact_url, refuse_placeholder, RedactedUrl};
use super::value::{
    duration, format_duration, int_in, name_chars, optional_path, serialize_duration,
    serialize_optional_path, shards, MAX_SHARDS,
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
    /// CA certificates (PEM) that sign the servers' certificates; `None`: the system's roots.
    #[serde(serialize_with = "serialize_optional_path")]
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificate and key (PEM) for mutual TLS: both or neither.
    #[serde(serialize_with = "serialize_optional_path")]
    pub tls_cert_file: Option<PathBuf>,
    #[serde(serialize_with = "serialize_optional_path")]
    pub tls_key_file: Option<PathBuf>,
    /// ACL user; empty: the user of the URL, or `default`.
    pub username: String,
    /// File holding the password (the file is shown, never what it holds).
    #[serde(serialize_with = "serialize_optional_path")]
    pub password_file: Option<PathBuf>,
}

impl RedisConfig {
    /// The URLs the backend connects to: `urls` when set, else `url` (one instance or a
    /// cluster's seed).
    pub fn urls_in_use(&self) -> Vec<&RedactedUrl> {
        if self.urls.is_empty() {
            vec![&self.url]
        } else {
            self.urls.iter().collect()
        }
    }

    /// Whether any URL in use asks for TLS (`rediss://`).
    pub fn wants_tls(&self) -> bool {
        self.urls_in_use()
            .iter()
            .any(|url| url.as_str().starts_with("rediss://"))
    }

    /// The `tls_*` keys that are set, by name, for the checks that they are not ignored.
    fn tls_keys_set(&self) -> Vec<&'static str> {
        [
            ("redis.tls_ca_file", &self.tls_ca_file),
            ("redis.tls_cert_file", &self.tls_cert_file),
            ("redis.tls_key_file", &self.tls_key_file),
        ]
        .into_iter()
        .filter(|(_, path)| path.is_some())
        .map(|(key, _)| key)
        .collect()
    }

    /// Rules between keys: each credential and TLS setting has one source and is never ignored.
    fn check_combinations(&self) -> Result<(), ConfigError> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(_), None) => return Err(invalid(
                "redis.tls_key_file",
                "must be set when redis.tls_cert_file is (the client certificate's private key)",
            )),
            (None, Some(_)) => {
                return Err(invalid(
                    "redis.tls_cert_file",
                    "must be set when redis.tls_key_file is (the certificate of that key)",
                ))
            }
            _ => {}
        }
        if let Some(key) = self.tls_keys_set().first() {
            if !self.wants_tls() {
                return Err(invalid(
                    key,
                    "is set, but no Redis URL in use is rediss:// (redis.url, or redis.urls when \
                     it is not empty), so it would be ignored",
                ));
            }
        }
        let in_url = |part: fn(&str) -> bool| {
            self.urls_in_use()
                .into_iter()
                .find(|url| part(url.as_str()))
                .map(RedactedUrl::redacted)
        };
        if self.password_file.is_some() {
            if let Some(url) = in_url(|url| url_user_info(url).1.is_some()) {
                return Err(invalid(
                    "redis.password_file",
                    format!("cannot be used together with a password in the URL (got {url})"),
                ));
            }
        }
        if !self.username.is_empty() {
            if let Some(url) = in_url(|url| url_user_info(url).0.is_some()) {
                return Err(invalid(
                    "redis.username",
                    format!("cannot be used together with a user in the URL (got {url})"),
                ));
            }
            let url_password = in_url(|url| url_user_info(url).1.is_some()).is_some();
            if self.password_file.is_none() && !url_password {
                return Err(invalid(
                    "redis.username",
                    "needs a password: set redis.password_file (or put the password in the URL)",
                ));
            }
        }
        Ok(())
    }
}

/// The user and password of a URL's user-info (`redis://user:pass@host`), each `None` when
/// absent or empty.
fn url_user_info(url: &str) -> (Option<&str>, Option<&str>) {
    let Some((_, rest)) = url.split_once("://") else {
        return (None, None);
    };
    let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
    let Some(at) = authority.rfind('@') else {
        return (None, None);
    };
    let (user, password) = match authority[..at].split_once(':') {
        Some((user, password)) => (user, Some(password)),
        None => (&authority[..at], None),
    };
    (
        Some(user).filter(|u| !u.is_empty()),
        password.filter(|p| !p.is_empty()),
    )
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
        let redis = RedisConfig {
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
            tls_ca_file: optional_path(raw.tls_ca_file),
            tls_cert_file: optional_path(raw.tls_cert_file),
            tls_key_file: optional_path(raw.tls_key_file),
            username: raw.username,
            password_file: optional_path(raw.password_file),
        };
        redis.check_combinations()?;
        Ok(redis)
    }
}

fn redis_url(key: &str, url: &str) -> Result<(), ConfigError> {
    if url.starts_with("redis://") || url.starts_with("rediss://") {
        refuse_placeholder(key, url)
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

    /// Keys of `[redis]` and their values, as written.
    type Keys<'a> = &'a [(&'a str, &'a str)];

    fn set(raw: RawRedis, keys: Keys<'_>) -> RawRedis {
        let mut raw = raw;
        for (key, value) in keys {
            let slot = match *key {
                "url" => &mut raw.url,
                "tls_ca_file" => &mut raw.tls_ca_file,
                "tls_cert_file" => &mut raw.tls_cert_file,
                "tls_key_file" => &mut raw.tls_key_file,
                "username" => &mut raw.username,
                "password_file" => &mut raw.password_file,
                other => panic!("no key {other}"),
            };
            *slot = value.to_string();
        }
        raw
    }

    /// Client certificate and key go together; TLS files need a rediss:// URL in use; a user
    /// and a password each come from one place, and a user needs a password. Every error names
    /// its key and none shows a password.
    #[test]
    fn tls_and_credential_rules() {
        let tls = RawRedis {
            url: "rediss://a:6380".into(),
            ..RawRedis::default()
        };
        let cases: &[(RawRedis, Keys<'_>, &str)] = &[
            (
                tls.clone(),
                &[("tls_cert_file", "/c.pem")],
                "redis.tls_key_file: must be set",
            ),
            (
                tls.clone(),
                &[("tls_key_file", "/k.pem")],
                "redis.tls_cert_file: must be set",
            ),
            (
                RawRedis::default(),
                &[("tls_ca_file", "/ca.pem")],
                "redis.tls_ca_file: is set, but no Redis URL in use is rediss://",
            ),
            (
                // The URL is not in use when `urls` is set.
                RawRedis {
                    urls: vec!["redis://b:6379".into()],
                    ..tls.clone()
                },
                &[("tls_cert_file", "/c.pem"), ("tls_key_file", "/k.pem")],
                "redis.tls_cert_file: is set, but no Redis URL in use is rediss://",
            ),
            (
                RawRedis::default(),
                &[("url", "redis://:hunter2@a"), ("password_file", "/pw")],
                "redis.password_file: cannot be used together with a password in the URL \
                 (got redis://(redacted)@a)",
            ),
            (
                RawRedis::default(),
                &[("url", "redis://me:hunter2@a"), ("username", "posthorn")],
                "redis.username: cannot be used together with a user in the URL",
            ),
            (
                RawRedis::default(),
                &[("username", "posthorn")],
                "redis.username: needs a password",
            ),
        ];
        for (raw, keys, expected) in cases {
            let error = redis(set(raw.clone(), keys)).expect_err(expected);
            assert!(error.starts_with(expected), "{error}");
            assert!(!error.contains("hunter2"), "{error}");
        }
        let ok: &[(RawRedis, Keys<'_>)] = &[
            (
                tls.clone(),
                &[
                    ("tls_ca_file", "/ca.pem"),
                    ("tls_cert_file", "/c.pem"),
                    ("tls_key_file", "/k.pem"),
                ],
            ),
            (
                RawRedis::default(),
                &[("username", "u"), ("password_file", "/pw")],
            ),
            (
                RawRedis::default(),
                &[("url", "redis://:pw@a"), ("username", "u")],
            ),
            (RawRedis::default(), &[("url", "redis://u:pw@a")]),
            (
                RawRedis {
                    urls: vec!["redis://a:6379".into(), "rediss://b:6380".into()],
                    ..RawRedis::default()
                },
                &[("tls_ca_file", "/ca.pem")],
            ),
        ];
        for (raw, keys) in ok {
            let config = redis(set(raw.clone(), keys));
            assert!(config.is_ok(), "{keys:?}: {config:?}");
        }
    }

    /// Bug pinned: `block = 0s` means "block forever" to Redis, past every client
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
