//! The raw serde layer of the configuration: one struct per TOML section,
//! holding values exactly as written (durations as strings, integers as
//! `i64`) together with the built-in defaults.
//!
//! Integers stay `i64` here on purpose: a negative or oversized number must
//! reach validation in its section's file (`server.rs`, `redis.rs`, ...),
//! which names the key in its error, instead of failing inside serde with a
//! message that does not. `RawConfig::default()` serialized to TOML is also
//! the schema the file check and the environment overlay work from, so every
//! key is listed exactly once: here.

use serde::{Deserialize, Serialize};

/// The whole file as written. Every section is optional.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    pub server: RawServer,
    pub backend: RawBackend,
    pub memory: RawMemory,
    pub redis: RawRedis,
    pub nats: RawNats,
    pub sse: RawSse,
    pub drain: RawDrain,
    pub auth: RawAuth,
    pub publish: RawPublish,
    pub limits: RawLimits,
    pub replay: RawReplay,
    pub presence: RawPresence,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawServer {
    pub listen: String,
    pub workers: i64,
    pub insecure: bool,
    pub cors_origins: Vec<String>,
    pub allowed_hosts: Vec<String>,
    pub tls_cert_file: String,
    pub tls_key_file: String,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            workers: 0,
            insecure: false,
            cors_origins: Vec::new(),
            allowed_hosts: Vec::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawBackend {
    pub kind: String,
}

impl Default for RawBackend {
    fn default() -> Self {
        Self {
            kind: "memory".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawMemory {
    pub retention: String,
    pub max_len: i64,
    pub shards: i64,
}

impl Default for RawMemory {
    fn default() -> Self {
        Self {
            retention: "15m".into(),
            max_len: 10_000,
            shards: 64,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawRedis {
    pub url: String,
    pub urls: Vec<String>,
    pub cluster: bool,
    pub groups: i64,
    pub shards: i64,
    pub prefix: String,
    pub block: String,
    pub count: i64,
    pub retention: String,
    pub max_len: i64,
    pub tls_ca_file: String,
    pub tls_cert_file: String,
    pub tls_key_file: String,
    pub username: String,
    pub password_file: String,
}

impl Default for RawRedis {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".into(),
            urls: Vec::new(),
            cluster: false,
            groups: 1,
            shards: 64,
            prefix: "pos-ev".into(),
            block: "30s".into(),
            count: 500,
            retention: "15m".into(),
            max_len: 100_000,
            tls_ca_file: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            username: String::new(),
            password_file: String::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawNats {
    pub url: String,
    pub stream: String,
    pub subject_prefix: String,
    pub retention: String,
    pub shards: i64,
    pub replicas: i64,
    pub tls_ca_file: String,
    pub tls_cert_file: String,
    pub tls_key_file: String,
    pub creds_file: String,
    pub nkey_seed_file: String,
    pub user: String,
    pub password_file: String,
    pub token_file: String,
}

impl Default for RawNats {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            stream: "POSTHORN".into(),
            subject_prefix: "posthorn.ev".into(),
            retention: "15m".into(),
            shards: 64,
            replicas: 1,
            tls_ca_file: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            creds_file: String::new(),
            nkey_seed_file: String::new(),
            user: String::new(),
            password_file: String::new(),
            token_file: String::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawSse {
    pub queue_limit: i64,
    pub heartbeat: String,
    pub stall_timeout: String,
    pub send_buffer: i64,
    pub retry_ms: i64,
}

impl Default for RawSse {
    fn default() -> Self {
        Self {
            queue_limit: 256,
            heartbeat: "20s".into(),
            stall_timeout: "10s".into(),
            send_buffer: 32_768,
            retry_ms: 3_000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawDrain {
    pub grace: String,
    pub readiness_delay: String,
    pub retry_min: String,
    pub retry_max: String,
    pub close_rate: i64,
}

impl Default for RawDrain {
    fn default() -> Self {
        Self {
            grace: "30s".into(),
            readiness_delay: "0s".into(),
            retry_min: "1s".into(),
            retry_max: "60s".into(),
            close_rate: 100,
        }
    }
}

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawAuth {
    pub mode: String,
    pub jwt_secret: String,
    pub jwt_secret_file: String,
    pub jwt_public_key_file: String,
    pub jwks_url: String,
    pub jwks_ca_file: String,
    pub jwks_refresh: String,
    pub issuer: String,
    pub audience: String,
    pub leeway: String,
    pub revocation_retention: String,
}

impl Default for RawAuth {
    fn default() -> Self {
        Self {
            mode: "none".into(),
            jwt_secret: String::new(),
            jwt_secret_file: String::new(),
            jwt_public_key_file: String::new(),
            jwks_url: String::new(),
            jwks_ca_file: String::new(),
            jwks_refresh: "5m".into(),
            issuer: String::new(),
            audience: String::new(),
            leeway: "30s".into(),
            revocation_retention: "30d".into(),
        }
    }
}

// Hand-written so a stray `{:?}` of the raw tree cannot leak the secret.
impl std::fmt::Debug for RawAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawAuth")
            .field("mode", &self.mode)
            .field("jwt_secret", &super::secret::marker(&self.jwt_secret))
            .field("jwt_secret_file", &self.jwt_secret_file)
            .field("jwt_public_key_file", &self.jwt_public_key_file)
            .field("jwks_url", &self.jwks_url)
            .field("jwks_ca_file", &self.jwks_ca_file)
            .field("jwks_refresh", &self.jwks_refresh)
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("leeway", &self.leeway)
            .field("revocation_retention", &self.revocation_retention)
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawPublish {
    pub dedupe_window: String,
}

impl Default for RawPublish {
    fn default() -> Self {
        Self {
            dedupe_window: "10m".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawLimits {
    pub max_event_bytes: i64,
    pub max_batch: i64,
    pub max_connections: i64,
    pub max_body_bytes: i64,
    pub max_groups_per_device: i64,
}

impl Default for RawLimits {
    fn default() -> Self {
        Self {
            max_event_bytes: 65_536,
            max_batch: 1_000,
            max_connections: 0,
            max_body_bytes: 16_777_216,
            max_groups_per_device: 16,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawReplay {
    pub max_concurrent: i64,
    pub cache_entries: i64,
}

impl Default for RawReplay {
    fn default() -> Self {
        Self {
            max_concurrent: 256,
            cache_entries: 500_000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawPresence {
    pub enabled: bool,
    pub pod_name: String,
    pub ttl: String,
    pub retention: String,
    pub debounce: String,
}

impl Default for RawPresence {
    fn default() -> Self {
        Self {
            enabled: true,
            pod_name: String::new(),
            ttl: "30s".into(),
            retention: "168h".into(),
            debounce: "5s".into(),
        }
    }
}

/// The defaults as a TOML table: section name → key → default value. The type
/// of each default value is the type the key accepts.
pub fn schema() -> toml::Table {
    // Serializing a tree of plain strings, integers, booleans and string lists
    // cannot fail; a failure would be a programming error in this file.
    toml::Table::try_from(RawConfig::default()).expect("default configuration serializes to toml")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every section of the schema is a table of plain values, which the file
    /// check and the environment overlay rely on.
    #[test]
    fn schema_is_sections_of_plain_values() {
        let schema = schema();
        assert_eq!(schema.len(), 12);
        for (section, table) in &schema {
            let table = table
                .as_table()
                .unwrap_or_else(|| panic!("{section} is not a table"));
            assert!(!table.is_empty(), "{section} has no keys");
            for (key, value) in table {
                assert!(
                    matches!(
                        value,
                        toml::Value::String(_)
                            | toml::Value::Integer(_)
                            | toml::Value::Boolean(_)
                            | toml::Value::Array(_)
                    ),
                    "{section}.{key} has an unsupported type"
                );
            }
        }
    }

    /// The raw Debug output never contains the JWT secret.
    #[test]
    fn debug_hides_secret() {
        let auth = RawAuth {
            jwt_secret: "hunter2".into(),
            ..RawAuth::default()
        };
        let text = format!("{auth:?}");
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("(set)"), "{text}");
    }
}
