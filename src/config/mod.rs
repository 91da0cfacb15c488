//! Typed, validated configuration: the `Config` tree every other module reads,
//! how it is loaded (file, then `POSTHORN_<SECTION>__<KEY>` environment
//! overlay) and the single validation pass that turns the raw values into it.
//!
//! Validation happens once, at start-up; after that no caller needs to
//! re-check a value. Every error names the offending key and carries the
//! offending value, and a bad configuration exits with
//! [`ConfigError::EXIT_CODE`].

pub mod env;
pub mod raw;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::{Table, Value};

pub use env::{EnvSource, ProcessEnv};
use raw::RawConfig;

/// Largest shard count any backend accepts.
pub const MAX_SHARDS: u32 = 16_384;
/// Longest `drain.retry_min` / `drain.retry_max`.
const MAX_DRAIN_RETRY: Duration = Duration::from_secs(3600);
/// Longest `redis.block`.
const MAX_REDIS_BLOCK: Duration = Duration::from_secs(600);

/// Where a key came from, for the unknown-key message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyOrigin {
    /// A configuration file (path or other label).
    File(String),
    /// An environment variable (its full name).
    Env(String),
}

impl fmt::Display for KeyOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyOrigin::File(path) => write!(f, "in {path}"),
            KeyOrigin::Env(name) => write!(f, "(from environment variable {name})"),
        }
    }
}

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read configuration file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid toml in {origin}: {message}")]
    Syntax { origin: String, message: String },
    #[error("unknown configuration key {key} {origin}")]
    UnknownKey { key: String, origin: KeyOrigin },
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
}

impl ConfigError {
    /// Process exit code for a bad configuration (EX_USAGE from sysexits.h).
    pub const EXIT_CODE: i32 = 64;

    /// Same as [`ConfigError::EXIT_CODE`], for callers holding an error value.
    pub fn exit_code(&self) -> i32 {
        Self::EXIT_CODE
    }

    /// The dotted key the error is about, if it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::UnknownKey { key, .. } | ConfigError::Invalid { key, .. } => Some(key),
            ConfigError::Io { .. } | ConfigError::Syntax { .. } => None,
        }
    }
}

fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: message.into(),
    }
}

/// Which event log backs the hub.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Memory,
    Redis,
    Nats,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Memory => "memory",
            BackendKind::Redis => "redis",
            BackendKind::Nats => "nats",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How clients authenticate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuthMode {
    None,
    Jwt,
}

impl AuthMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMode::None => "none",
            AuthMode::Jwt => "jwt",
        }
    }
}

impl fmt::Display for AuthMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub server: ServerConfig,
    pub backend: BackendConfig,
    pub memory: MemoryConfig,
    pub redis: RedisConfig,
    pub nats: NatsConfig,
    pub sse: SseConfig,
    pub drain: DrainConfig,
    pub auth: AuthConfig,
    pub publish: PublishConfig,
    pub limits: LimitsConfig,
    pub replay: ReplayConfig,
}

/// Resumes (`[replay]`): how many run at once, and what they share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayConfig {
    /// Replays running at once per pod; the others wait with their stream open, in order.
    pub max_concurrent: usize,
    /// Stream entries kept in memory, over all shards, while replays of their shard run, so
    /// that resumes of one shard read the backend once.
    pub cache_entries: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// As configured; 0 means one per core, see [`Config::effective_workers`].
    pub workers: usize,
    pub insecure: bool,
    pub cors_origins: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendConfig {
    pub kind: BackendKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryConfig {
    pub retention: Duration,
    pub max_len: usize,
    pub shards: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    pub url: String,
    pub urls: Vec<String>,
    pub cluster: bool,
    pub groups: u32,
    pub shards: u32,
    pub prefix: String,
    pub block: Duration,
    pub count: usize,
    pub retention: Duration,
    pub max_len: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsConfig {
    pub url: String,
    pub stream: String,
    pub subject_prefix: String,
    pub retention: Duration,
    pub shards: u32,
    /// Replicas of the stream when the hub creates it (in a JetStream cluster: 3 or 5).
    pub replicas: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseConfig {
    pub queue_limit: usize,
    pub heartbeat: Duration,
    /// A client whose queued events waited this long without being written is evicted; zero
    /// leaves only the queue limit.
    pub stall_timeout: Duration,
    /// Socket send buffer in bytes; 0 leaves the OS default.
    pub send_buffer: usize,
    pub retry_ms: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainConfig {
    pub grace: Duration,
    pub readiness_delay: Duration,
    pub retry_min: Duration,
    pub retry_max: Duration,
    pub close_rate: u32,
}

#[derive(Clone, PartialEq, Eq)]
pub struct AuthConfig {
    pub mode: AuthMode,
    pub jwt_secret: String,
    pub jwt_public_key_file: Option<PathBuf>,
}

// Hand-written so logging the config with `{:?}` cannot leak the secret.
impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthConfig")
            .field("mode", &self.mode)
            .field("jwt_secret", &secret_marker(&self.jwt_secret))
            .field("jwt_public_key_file", &self.jwt_public_key_file)
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishConfig {
    pub dedupe_window: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitsConfig {
    pub max_event_bytes: usize,
    pub max_batch: usize,
    /// 0 means no limit.
    pub max_connections: usize,
    pub max_body_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        // The built-in defaults are checked by `defaults_match_spec`; failing
        // here would be a bug in raw.rs, not a user error.
        Config::from_raw(RawConfig::default()).expect("built-in defaults are valid")
    }
}

impl Config {
    /// Load from `path` (or the defaults when `None`), then apply the
    /// environment overlay and validate.
    pub fn load(path: Option<&Path>, env: &dyn EnvSource) -> Result<Config, ConfigError> {
        match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
                log::debug!("loading configuration from {}", path.display());
                Config::from_toml_str(&text, &path.display().to_string(), env)
            }
            None => {
                log::debug!("no configuration file given, using defaults");
                Config::from_toml_str("", "built-in defaults", env)
            }
        }
    }

    /// Parse TOML `text` (`origin` labels it in errors), overlay the
    /// environment and validate.
    pub fn from_toml_str(
        text: &str,
        origin: &str,
        env: &dyn EnvSource,
    ) -> Result<Config, ConfigError> {
        let mut table: Table = toml::from_str(text).map_err(|err| ConfigError::Syntax {
            origin: origin.to_string(),
            message: syntax_message(text, &err),
        })?;
        let schema = raw::schema();
        check_against_schema(&table, &schema, origin)?;
        env::apply(&mut table, &schema, env)?;
        // The schema check above made every key and type match, so this only
        // fails if raw.rs and its own schema disagree.
        let raw =
            RawConfig::deserialize(Value::Table(table)).map_err(|err| ConfigError::Syntax {
                origin: origin.to_string(),
                message: err.message().to_string(),
            })?;
        Config::from_raw(raw)
    }

    /// Validate raw values and convert them to their typed form.
    pub fn from_raw(raw: RawConfig) -> Result<Config, ConfigError> {
        let server = ServerConfig {
            listen: raw.server.listen.trim().parse().map_err(|_| {
                invalid(
                    "server.listen",
                    format!(
                        "must be an ip:port socket address (got {:?})",
                        raw.server.listen
                    ),
                )
            })?,
            workers: int_in("server.workers", raw.server.workers, 0, i64::MAX)?,
            insecure: raw.server.insecure,
            cors_origins: raw.server.cors_origins,
        };
        for origin in &server.cors_origins {
            if origin != "*" && !origin.starts_with("http://") && !origin.starts_with("https://") {
                return Err(invalid(
                    "server.cors_origins",
                    format!("each origin must be \"*\" or start with http:// or https:// (got {origin:?})"),
                ));
            }
        }

        let backend = BackendConfig {
            kind: match raw.backend.kind.as_str() {
                "memory" => BackendKind::Memory,
                "redis" => BackendKind::Redis,
                "nats" => BackendKind::Nats,
                other => {
                    return Err(invalid(
                        "backend.kind",
                        format!("must be one of memory, redis, nats (got {other:?})"),
                    ))
                }
            },
        };

        let memory = MemoryConfig {
            retention: duration("memory.retention", &raw.memory.retention)?,
            max_len: int_in("memory.max_len", raw.memory.max_len, 1, i64::MAX)?,
            shards: shards("memory.shards", raw.memory.shards)?,
        };

        let redis = RedisConfig {
            url: raw.redis.url,
            urls: raw.redis.urls,
            cluster: raw.redis.cluster,
            groups: int_in("redis.groups", raw.redis.groups, 1, i64::from(MAX_SHARDS))?,
            shards: shards("redis.shards", raw.redis.shards)?,
            prefix: raw.redis.prefix,
            block: duration("redis.block", &raw.redis.block)?,
            count: int_in("redis.count", raw.redis.count, 1, i64::MAX)?,
            retention: duration("redis.retention", &raw.redis.retention)?,
            max_len: int_in("redis.max_len", raw.redis.max_len, 1, i64::MAX)?,
        };
        // Redis reads BLOCK 0 as "block forever", past every timeout of the tail's connection.
        if redis.block.is_zero() || redis.block > MAX_REDIS_BLOCK {
            return Err(invalid(
                "redis.block",
                format!(
                    "must be greater than 0s and at most {} (got {})",
                    format_duration(MAX_REDIS_BLOCK),
                    format_duration(redis.block)
                ),
            ));
        }
        redis_url("redis.url", &redis.url)?;
        for url in &redis.urls {
            redis_url("redis.urls", url)?;
        }
        if redis.cluster && !redis.urls.is_empty() {
            return Err(invalid(
                "redis.cluster",
                format!(
                    "cannot be true together with a non-empty redis.urls (got {} urls)",
                    redis.urls.len()
                ),
            ));
        }
        if redis.groups > redis.shards {
            return Err(invalid(
                "redis.groups",
                format!(
                    "must not exceed redis.shards ({}) (got {})",
                    redis.shards, redis.groups
                ),
            ));
        }
        name_chars("redis.prefix", &redis.prefix, "A-Za-z0-9._:-", |c| {
            c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')
        })?;

        let nats = NatsConfig {
            url: raw.nats.url,
            stream: raw.nats.stream,
            subject_prefix: raw.nats.subject_prefix,
            retention: duration("nats.retention", &raw.nats.retention)?,
            shards: shards("nats.shards", raw.nats.shards)?,
            replicas: int_in("nats.replicas", raw.nats.replicas, 1, 5)?,
        };
        if nats.url.split(',').any(|url| url.trim().is_empty()) {
            return Err(invalid(
                "nats.url",
                format!(
                    "must be one URL or several separated by commas (got {:?})",
                    nats.url
                ),
            ));
        }
        name_chars("nats.stream", &nats.stream, "A-Za-z0-9_-", |c| {
            c.is_ascii_alphanumeric() || matches!(c, '_' | '-')
        })?;
        subject_prefix("nats.subject_prefix", &nats.subject_prefix)?;

        let sse = SseConfig {
            queue_limit: int_in("sse.queue_limit", raw.sse.queue_limit, 1, i64::MAX)?,
            heartbeat: duration("sse.heartbeat", &raw.sse.heartbeat)?,
            stall_timeout: duration("sse.stall_timeout", &raw.sse.stall_timeout)?,
            // setsockopt takes a C int, hence the upper bound.
            send_buffer: int_in(
                "sse.send_buffer",
                raw.sse.send_buffer,
                0,
                i64::from(i32::MAX),
            )?,
            retry_ms: int_in("sse.retry_ms", raw.sse.retry_ms, 0, i64::from(u32::MAX))?,
        };
        if sse.heartbeat < Duration::from_millis(100) {
            return Err(invalid(
                "sse.heartbeat",
                format!(
                    "must be at least 100ms (got {})",
                    format_duration(sse.heartbeat)
                ),
            ));
        }
        if !sse.stall_timeout.is_zero() && sse.stall_timeout < Duration::from_secs(1) {
            return Err(invalid(
                "sse.stall_timeout",
                format!(
                    "must be 0s (off) or at least 1s (got {})",
                    format_duration(sse.stall_timeout)
                ),
            ));
        }
        if sse.send_buffer != 0 && sse.send_buffer < 4096 {
            return Err(invalid(
                "sse.send_buffer",
                format!(
                    "must be 0 (os default) or at least 4096 (got {})",
                    sse.send_buffer
                ),
            ));
        }

        let drain = DrainConfig {
            grace: duration("drain.grace", &raw.drain.grace)?,
            readiness_delay: duration("drain.readiness_delay", &raw.drain.readiness_delay)?,
            retry_min: duration("drain.retry_min", &raw.drain.retry_min)?,
            retry_max: duration("drain.retry_max", &raw.drain.retry_max)?,
            close_rate: int_in(
                "drain.close_rate",
                raw.drain.close_rate,
                1,
                i64::from(u32::MAX),
            )?,
        };
        if drain.grace.is_zero() {
            return Err(invalid("drain.grace", "must be greater than 0s (got 0s)"));
        }
        // The drain keeps min(grace / 10, 2 s) in reserve; at least a second must remain to spread
        // the closes, or every connection would be closed in the first slice: a reconnect storm.
        let margin = (drain.grace / 10).min(Duration::from_secs(2));
        if drain.readiness_delay + margin + Duration::from_secs(1) > drain.grace {
            return Err(invalid(
                "drain.readiness_delay",
                format!(
                    "must leave at least 1s to spread the closes before drain.grace ({}) minus its margin ({}) (got {})",
                    format_duration(drain.grace),
                    format_duration(margin),
                    format_duration(drain.readiness_delay)
                ),
            ));
        }
        // `retry:` is sent in milliseconds as a u32; past an hour a client waiting that long is a
        // mistake, not a plan.
        for (key, value) in [
            ("drain.retry_min", drain.retry_min),
            ("drain.retry_max", drain.retry_max),
        ] {
            if value > MAX_DRAIN_RETRY {
                return Err(invalid(
                    key,
                    format!(
                        "must be at most {} (got {})",
                        format_duration(MAX_DRAIN_RETRY),
                        format_duration(value)
                    ),
                ));
            }
        }
        if drain.retry_min > drain.retry_max {
            return Err(invalid(
                "drain.retry_min",
                format!(
                    "must not exceed drain.retry_max ({}) (got {})",
                    format_duration(drain.retry_max),
                    format_duration(drain.retry_min)
                ),
            ));
        }

        let auth = AuthConfig {
            mode: match raw.auth.mode.as_str() {
                "none" => AuthMode::None,
                "jwt" => AuthMode::Jwt,
                other => {
                    return Err(invalid(
                        "auth.mode",
                        format!("must be one of none, jwt (got {other:?})"),
                    ))
                }
            },
            jwt_secret: raw.auth.jwt_secret,
            jwt_public_key_file: (!raw.auth.jwt_public_key_file.is_empty())
                .then(|| PathBuf::from(raw.auth.jwt_public_key_file)),
        };
        if auth.mode == AuthMode::Jwt {
            let has_secret = !auth.jwt_secret.is_empty();
            let has_key = auth.jwt_public_key_file.is_some();
            if has_secret == has_key {
                // Never echo the secret itself; saying which are set is enough.
                let got = if has_secret { "both" } else { "neither" };
                return Err(invalid(
                    "auth.jwt_secret",
                    format!(
                        "exactly one of auth.jwt_secret and auth.jwt_public_key_file must be set when auth.mode is jwt (got {got})"
                    ),
                ));
            }
        }

        let publish = PublishConfig {
            dedupe_window: duration("publish.dedupe_window", &raw.publish.dedupe_window)?,
        };
        // JetStream refuses a duplicate window longer than the stream's max age.
        if backend.kind == BackendKind::Nats && publish.dedupe_window > nats.retention {
            return Err(invalid(
                "publish.dedupe_window",
                format!(
                    "must not exceed nats.retention ({}) with backend.kind = nats (got {})",
                    format_duration(nats.retention),
                    format_duration(publish.dedupe_window)
                ),
            ));
        }

        let limits = LimitsConfig {
            max_event_bytes: int_in(
                "limits.max_event_bytes",
                raw.limits.max_event_bytes,
                1,
                i64::MAX,
            )?,
            max_batch: int_in("limits.max_batch", raw.limits.max_batch, 1, i64::MAX)?,
            max_connections: int_in(
                "limits.max_connections",
                raw.limits.max_connections,
                0,
                i64::MAX,
            )?,
            max_body_bytes: int_in(
                "limits.max_body_bytes",
                raw.limits.max_body_bytes,
                1,
                i64::MAX,
            )?,
        };
        if limits.max_body_bytes < limits.max_event_bytes {
            return Err(invalid(
                "limits.max_body_bytes",
                format!(
                    "must be at least limits.max_event_bytes ({}) (got {})",
                    limits.max_event_bytes, limits.max_body_bytes
                ),
            ));
        }

        let replay = ReplayConfig {
            max_concurrent: int_in(
                "replay.max_concurrent",
                raw.replay.max_concurrent,
                1,
                1_000_000,
            )?,
            cache_entries: int_in(
                "replay.cache_entries",
                raw.replay.cache_entries,
                0,
                100_000_000,
            )?,
        };

        Ok(Config {
            server,
            backend,
            memory,
            redis,
            nats,
            sse,
            drain,
            auth,
            publish,
            limits,
            replay,
        })
    }

    /// Shard count of the selected backend.
    pub fn shards(&self) -> u32 {
        match self.backend.kind {
            BackendKind::Memory => self.memory.shards,
            BackendKind::Redis => self.redis.shards,
            BackendKind::Nats => self.nats.shards,
        }
    }

    /// HTTP worker threads: `server.workers`, or the core count when it is 0.
    pub fn effective_workers(&self) -> usize {
        if self.server.workers > 0 {
            return self.server.workers;
        }
        // The core count can be unknowable (restricted /proc, odd platforms);
        // one worker still serves.
        std::thread::available_parallelism()
            .map(std::num::NonZeroUsize::get)
            .unwrap_or(1)
    }

    /// Whether `server.listen` is a loopback address (for the caller's
    /// secure-by-default check).
    pub fn listen_is_loopback(&self) -> bool {
        self.server.listen.ip().is_loopback()
    }

    /// The whole configuration as JSON for /admin/status, with the JWT secret
    /// reduced to "(set)"/"(empty)" and passwords removed from URLs.
    pub fn summary(&self) -> serde_json::Value {
        let d = |v: Duration| serde_json::Value::String(format_duration(v));
        serde_json::json!({
            "server": {
                "listen": self.server.listen.to_string(),
                "workers": self.server.workers,
                "effective_workers": self.effective_workers(),
                "insecure": self.server.insecure,
                "cors_origins": self.server.cors_origins,
            },
            "backend": { "kind": self.backend.kind.as_str() },
            "memory": {
                "retention": d(self.memory.retention),
                "max_len": self.memory.max_len,
                "shards": self.memory.shards,
            },
            "redis": {
                "url": redact_url(&self.redis.url),
                "urls": self.redis.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(),
                "cluster": self.redis.cluster,
                "groups": self.redis.groups,
                "shards": self.redis.shards,
                "prefix": self.redis.prefix,
                "block": d(self.redis.block),
                "count": self.redis.count,
                "retention": d(self.redis.retention),
                "max_len": self.redis.max_len,
            },
            "nats": {
                "url": self.nats.url.split(',').map(redact_url).collect::<Vec<_>>().join(","),
                "stream": self.nats.stream,
                "subject_prefix": self.nats.subject_prefix,
                "retention": d(self.nats.retention),
                "shards": self.nats.shards,
                "replicas": self.nats.replicas,
            },
            "sse": {
                "queue_limit": self.sse.queue_limit,
                "heartbeat": d(self.sse.heartbeat),
                "stall_timeout": d(self.sse.stall_timeout),
                "send_buffer": self.sse.send_buffer,
                "retry_ms": self.sse.retry_ms,
            },
            "drain": {
                "grace": d(self.drain.grace),
                "readiness_delay": d(self.drain.readiness_delay),
                "retry_min": d(self.drain.retry_min),
                "retry_max": d(self.drain.retry_max),
                "close_rate": self.drain.close_rate,
            },
            "auth": {
                "mode": self.auth.mode.as_str(),
                "jwt_secret": secret_marker(&self.auth.jwt_secret),
                "jwt_public_key_file": self.auth.jwt_public_key_file
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
            },
            "publish": { "dedupe_window": d(self.publish.dedupe_window) },
            "limits": {
                "max_event_bytes": self.limits.max_event_bytes,
                "max_batch": self.limits.max_batch,
                "max_connections": self.limits.max_connections,
                "max_body_bytes": self.limits.max_body_bytes,
            },
            "replay": {
                "max_concurrent": self.replay.max_concurrent,
                "cache_entries": self.replay.cache_entries,
            },
        })
    }
}

/// "(set)" or "(empty)": what may be shown of a secret.
pub(crate) fn secret_marker(secret: &str) -> &'static str {
    if secret.is_empty() {
        "(empty)"
    } else {
        "(set)"
    }
}

/// Replace the user-info part of a URL (`redis://user:pass@host`) so that
/// status output never shows credentials.
fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rfind('@') {
        Some(at) => format!("{scheme}://(redacted)@{}{path}", &authority[at + 1..]),
        None => url.to_string(),
    }
}

/// Reject file keys and sections the schema does not know, and values whose
/// TOML type differs from the default's, naming `section.key` either way.
fn check_against_schema(table: &Table, schema: &Table, origin: &str) -> Result<(), ConfigError> {
    for (section, value) in table {
        let Some(schema_keys) = schema.get(section).and_then(Value::as_table) else {
            return Err(ConfigError::UnknownKey {
                key: section.clone(),
                origin: KeyOrigin::File(origin.to_string()),
            });
        };
        let Some(keys) = value.as_table() else {
            return Err(invalid(section, format!("expected a table (got {value})")));
        };
        for (key, value) in keys {
            let dotted = format!("{section}.{key}");
            let Some(default) = schema_keys.get(key) else {
                return Err(ConfigError::UnknownKey {
                    key: dotted,
                    origin: KeyOrigin::File(origin.to_string()),
                });
            };
            let same_type = match (default, value) {
                (Value::Array(_), Value::Array(items)) => items.iter().all(Value::is_str),
                (d, v) => d.type_str() == v.type_str(),
            };
            if !same_type {
                return Err(invalid(
                    &dotted,
                    format!("expected {} (got {value})", describe_type(default)),
                ));
            }
        }
    }
    Ok(())
}

fn describe_type(value: &Value) -> &'static str {
    match value {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Boolean(_) => "true or false",
        Value::Datetime(_) => "a datetime",
        Value::Array(_) => "a list of strings",
        Value::Table(_) => "a table",
    }
}

/// toml's own message plus the line it points at, on one line.
fn syntax_message(text: &str, err: &toml::de::Error) -> String {
    let message = err.message().trim().trim_end_matches('.').to_string();
    match err.span() {
        Some(span) => {
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            format!("line {line}: {message}")
        }
        None => message,
    }
}

fn int_in<T: TryFrom<i64>>(key: &str, value: i64, min: i64, max: i64) -> Result<T, ConfigError> {
    if value < min {
        return Err(invalid(
            key,
            format!("must be at least {min} (got {value})"),
        ));
    }
    if value > max {
        return Err(invalid(key, format!("must be at most {max} (got {value})")));
    }
    // Bounds are chosen to fit T; a platform where they do not (usize on a
    // 32-bit target) still gets a keyed error rather than a panic.
    T::try_from(value).map_err(|_| invalid(key, format!("is too large (got {value})")))
}

fn shards(key: &str, value: i64) -> Result<u32, ConfigError> {
    int_in(key, value, 1, i64::from(MAX_SHARDS))
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

fn name_chars(
    key: &str,
    value: &str,
    allowed: &str,
    ok: impl Fn(char) -> bool,
) -> Result<(), ConfigError> {
    if value.is_empty() {
        return Err(invalid(key, "must not be empty (got \"\")"));
    }
    if !value.chars().all(ok) {
        return Err(invalid(
            key,
            format!("may only contain the characters {allowed} (got {value:?})"),
        ));
    }
    Ok(())
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

/// Parse `250ms`, `20s`, `15m`, `1h`, or a bare `0`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    if text == "0" {
        return Some(Duration::ZERO);
    }
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(split);
    if digits.is_empty() {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => n.checked_mul(60).map(Duration::from_secs),
        "h" => n.checked_mul(3600).map(Duration::from_secs),
        _ => None,
    }
}

/// The inverse of [`parse_duration`]: the largest unit that divides exactly.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        "0s".to_string()
    } else if ms % 3_600_000 == 0 {
        format!("{}h", ms / 3_600_000)
    } else if ms % 60_000 == 0 {
        format!("{}m", ms / 60_000)
    } else if ms % 1_000 == 0 {
        format!("{}s", ms / 1_000)
    } else {
        format!("{ms}ms")
    }
}

fn duration(key: &str, text: &str) -> Result<Duration, ConfigError> {
    parse_duration(text).ok_or_else(|| {
        invalid(
            key,
            format!("invalid duration {text:?} (expected a whole number followed by ms, s, m or h, like 250ms, 20s, 15m, 1h)"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const REFERENCE: &str = include_str!("../../config/posthorn.toml");

    fn no_env() -> HashMap<String, String> {
        HashMap::new()
    }

    fn with_env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_toml_str(text, "test.toml", &with_env(env))
    }

    fn err_text(text: &str, env: &[(&str, &str)]) -> String {
        load(text, env).expect_err("should be rejected").to_string()
    }

    /// The built-in defaults are exactly the table in the product spec.
    #[test]
    fn defaults_match_spec() {
        let c = Config::default();
        assert_eq!(c.server.listen, "127.0.0.1:8080".parse().expect("addr"));
        assert_eq!(c.server.workers, 0);
        assert!(!c.server.insecure);
        assert!(c.server.cors_origins.is_empty());
        assert_eq!(c.backend.kind, BackendKind::Memory);
        assert_eq!(c.memory.retention, Duration::from_secs(15 * 60));
        assert_eq!(c.memory.max_len, 10_000);
        assert_eq!(c.memory.shards, 64);
        assert_eq!(c.redis.url, "redis://127.0.0.1:6379");
        assert!(c.redis.urls.is_empty());
        assert!(!c.redis.cluster);
        assert_eq!(c.redis.groups, 1);
        assert_eq!(c.redis.shards, 64);
        assert_eq!(c.redis.prefix, "pos-ev");
        assert_eq!(c.redis.block, Duration::from_secs(30));
        assert_eq!(c.redis.count, 500);
        assert_eq!(c.redis.retention, Duration::from_secs(15 * 60));
        assert_eq!(c.redis.max_len, 100_000);
        assert_eq!(c.nats.url, "nats://127.0.0.1:4222");
        assert_eq!(c.nats.stream, "POSTHORN");
        assert_eq!(c.nats.subject_prefix, "posthorn.ev");
        assert_eq!(c.nats.retention, Duration::from_secs(15 * 60));
        assert_eq!(c.nats.shards, 64);
        assert_eq!(c.nats.replicas, 1);
        assert_eq!(c.replay.max_concurrent, 256);
        assert_eq!(c.replay.cache_entries, 500_000);
        assert_eq!(c.sse.queue_limit, 256);
        assert_eq!(c.sse.heartbeat, Duration::from_secs(20));
        assert_eq!(c.sse.send_buffer, 32_768);
        assert_eq!(c.sse.retry_ms, 3_000);
        assert_eq!(c.drain.grace, Duration::from_secs(30));
        assert_eq!(c.drain.readiness_delay, Duration::ZERO);
        assert_eq!(c.drain.retry_min, Duration::from_secs(1));
        assert_eq!(c.drain.retry_max, Duration::from_secs(60));
        assert_eq!(c.drain.close_rate, 100);
        assert_eq!(c.auth.mode, AuthMode::None);
        assert!(c.auth.jwt_secret.is_empty());
        assert_eq!(c.auth.jwt_public_key_file, None);
        assert_eq!(c.publish.dedupe_window, Duration::from_secs(600));
        assert_eq!(c.limits.max_event_bytes, 65_536);
        assert_eq!(c.limits.max_batch, 1_000);
        assert_eq!(c.limits.max_connections, 0);
        assert_eq!(c.limits.max_body_bytes, 16_777_216);
        assert_eq!(c.shards(), 64);
        assert!(c.listen_is_loopback());
        assert!(c.effective_workers() >= 1);
    }

    /// No file and no environment gives the defaults.
    #[test]
    fn load_without_file_is_default() {
        let c = Config::load(None, &no_env()).expect("defaults load");
        assert_eq!(c, Config::default());
    }

    /// The reference file lists every key with exactly its default value, so
    /// it cannot drift from raw.rs.
    #[test]
    fn reference_file_is_complete_and_matches_defaults() {
        let table: Table = toml::from_str(REFERENCE).expect("reference file is valid toml");
        assert_eq!(
            table,
            raw::schema(),
            "reference file differs from the defaults"
        );
        let c = Config::from_toml_str(REFERENCE, "config/posthorn.toml", &no_env())
            .expect("reference file validates");
        assert_eq!(c, Config::default());
    }

    /// A file value replaces the default and the environment beats the file.
    #[test]
    fn env_overrides_file() {
        let c = load(
            "[sse]\nqueue_limit = 10\n",
            &[("POSTHORN_SSE__QUEUE_LIMIT", "100")],
        )
        .expect("valid");
        assert_eq!(c.sse.queue_limit, 100);
        let c = load("[sse]\nqueue_limit = 10\n", &[]).expect("valid");
        assert_eq!(c.sse.queue_limit, 10);
    }

    /// Environment overrides of a duration, a list, a bool and an enum.
    #[test]
    fn env_overrides_each_type() {
        let c = load(
            "",
            &[
                ("POSTHORN_SSE__HEARTBEAT", "250ms"),
                (
                    "POSTHORN_SERVER__CORS_ORIGINS",
                    "https://a.example,http://b.example",
                ),
                ("POSTHORN_SERVER__INSECURE", "true"),
                ("POSTHORN_BACKEND__KIND", "redis"),
                ("POSTHORN_REDIS__SHARDS", "8"),
                ("POSTHORN_LOG", "debug"),
            ],
        )
        .expect("valid");
        assert_eq!(c.sse.heartbeat, Duration::from_millis(250));
        assert_eq!(
            c.server.cors_origins,
            vec!["https://a.example", "http://b.example"]
        );
        assert!(c.server.insecure);
        assert_eq!(c.backend.kind, BackendKind::Redis);
        assert_eq!(c.shards(), 8);
    }

    /// An empty environment value for a list gives the empty list.
    #[test]
    fn env_empty_list() {
        let c = load(
            "[server]\ncors_origins = [\"*\"]\n",
            &[("POSTHORN_SERVER__CORS_ORIGINS", "")],
        )
        .expect("valid");
        assert!(c.server.cors_origins.is_empty());
    }

    /// An unknown POSTHORN_*__* variable is an error naming key and variable.
    #[test]
    fn unknown_env_key() {
        assert_eq!(
            err_text("", &[("POSTHORN_SSE__QUEU_LIMIT", "5")]),
            "unknown configuration key sse.queu_limit (from environment variable POSTHORN_SSE__QUEU_LIMIT)"
        );
    }

    /// An unknown key or section in the file names section.key and the file.
    #[test]
    fn unknown_file_key() {
        assert_eq!(
            err_text("[sse]\nfoo = 1\n", &[]),
            "unknown configuration key sse.foo in test.toml"
        );
        assert_eq!(
            err_text("[ssee]\nqueue_limit = 1\n", &[]),
            "unknown configuration key ssee in test.toml"
        );
    }

    /// A file value of the wrong type names the key and shows the value.
    #[test]
    fn wrong_type_in_file() {
        assert_eq!(
            err_text("[sse]\nqueue_limit = \"many\"\n", &[]),
            "sse.queue_limit: expected an integer (got \"many\")"
        );
        assert!(
            err_text("[server]\ncors_origins = [1]\n", &[]).starts_with("server.cors_origins: ")
        );
    }

    /// Invalid TOML syntax names the file and the line.
    #[test]
    fn syntax_error() {
        let text = err_text("[sse]\nqueue_limit = = 1\n", &[]);
        assert!(
            text.starts_with("invalid toml in test.toml: line 2: "),
            "{text}"
        );
    }

    /// An unparseable duration names the key and the value.
    #[test]
    fn invalid_duration() {
        let text = err_text("[sse]\nheartbeat = \"fast\"\n", &[]);
        assert!(
            text.starts_with("sse.heartbeat: invalid duration \"fast\""),
            "{text}"
        );
    }

    /// Duration syntax: whole numbers with ms/s/m/h, and a bare 0.
    #[test]
    fn duration_syntax() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("20s"), Some(Duration::from_secs(20)));
        assert_eq!(parse_duration("15m"), Some(Duration::from_secs(900)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0s"), Some(Duration::ZERO));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        for bad in [
            "",
            "5",
            "1.5s",
            "-1s",
            "s",
            "10 s",
            "1d",
            "fast",
            "99999999999999999999h",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
        for d in ["250ms", "20s", "15m", "1h", "0s", "1500ms"] {
            assert_eq!(format_duration(parse_duration(d).expect("valid")), d);
        }
    }

    /// queue_limit 0 is rejected with the spec's wording.
    #[test]
    fn queue_limit_zero() {
        assert_eq!(
            err_text("[sse]\nqueue_limit = 0\n", &[]),
            "sse.queue_limit: must be at least 1 (got 0)"
        );
    }

    /// retry_min above retry_max is rejected, naming drain.retry_min.
    #[test]
    fn retry_min_above_max() {
        let text = err_text("[drain]\nretry_min = \"2m\"\nretry_max = \"1m\"\n", &[]);
        assert!(text.starts_with("drain.retry_min: "), "{text}");
        assert!(text.contains("2m"), "{text}");
    }

    /// `[replay]` and `nats.replicas` take their ranges; `nats.url` may list cluster nodes but
    /// no empty one.
    #[test]
    fn replay_and_nats_cluster_keys() {
        let c = load(
            "[replay]\nmax_concurrent = 2\ncache_entries = 0\n[nats]\nreplicas = 3\n\
             url = \"nats://a:4222,nats://b:4222\"\n",
            &[],
        )
        .unwrap();
        assert_eq!((c.replay.max_concurrent, c.replay.cache_entries), (2, 0));
        assert_eq!(c.nats.replicas, 3);
        for (text, key) in [
            ("[replay]\nmax_concurrent = 0\n", "replay.max_concurrent"),
            ("[replay]\ncache_entries = -1\n", "replay.cache_entries"),
            ("[nats]\nreplicas = 6\n", "nats.replicas"),
            ("[nats]\nurl = \"nats://a:4222,\"\n", "nats.url"),
        ] {
            let error = err_text(text, &[]);
            assert!(error.starts_with(&format!("{key}: ")), "{error}");
        }
    }

    /// jwt mode needs exactly one of secret and public key file.
    #[test]
    fn jwt_needs_one_credential() {
        let text = err_text("[auth]\nmode = \"jwt\"\n", &[]);
        assert!(text.starts_with("auth.jwt_secret: "), "{text}");
        let text = err_text(
            "[auth]\nmode = \"jwt\"\njwt_secret = \"s3cret\"\njwt_public_key_file = \"/k.pem\"\n",
            &[],
        );
        assert!(text.starts_with("auth.jwt_secret: "), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        let c = load(
            "[auth]\nmode = \"jwt\"\njwt_public_key_file = \"/k.pem\"\n",
            &[],
        )
        .expect("valid");
        assert_eq!(c.auth.mode, AuthMode::Jwt);
        assert_eq!(c.auth.jwt_public_key_file, Some(PathBuf::from("/k.pem")));
    }

    /// Cross-key and format rules of the redis, nats, sse, server and limits
    /// sections each produce a keyed error.
    #[test]
    fn other_validation_rules() {
        let cases: &[(&str, &str)] = &[
            (
                "[redis]\ncluster = true\nurls = [\"redis://a:6379\"]\n",
                "redis.cluster: ",
            ),
            ("[redis]\nurls = [\"http://a\"]\n", "redis.urls: "),
            ("[redis]\nurl = \"tcp://a\"\n", "redis.url: "),
            ("[redis]\ngroups = 65\n", "redis.groups: "),
            ("[redis]\nprefix = \"a b\"\n", "redis.prefix: "),
            ("[redis]\nshards = 16385\n", "redis.shards: "),
            ("[memory]\nshards = 0\n", "memory.shards: "),
            ("[nats]\nstream = \"a.b\"\n", "nats.stream: "),
            ("[nats]\nsubject_prefix = \"\"\n", "nats.subject_prefix: "),
            ("[sse]\nheartbeat = \"50ms\"\n", "sse.heartbeat: "),
            ("[sse]\nsend_buffer = 100\n", "sse.send_buffer: "),
            ("[drain]\ngrace = \"0s\"\n", "drain.grace: "),
            ("[server]\nlisten = \"localhost\"\n", "server.listen: "),
            (
                "[server]\ncors_origins = [\"example.com\"]\n",
                "server.cors_origins: ",
            ),
            ("[server]\nworkers = -1\n", "server.workers: "),
            ("[backend]\nkind = \"kafka\"\n", "backend.kind: "),
            ("[limits]\nmax_body_bytes = 10\n", "limits.max_body_bytes: "),
            (
                "[backend]\nkind = \"nats\"\n[nats]\nretention = \"5m\"\n",
                "publish.dedupe_window: ",
            ),
        ];
        for (text, prefix) in cases {
            let got = err_text(text, &[]);
            assert!(got.starts_with(prefix), "{text:?} gave {got:?}");
        }
        let ok = load(
            "[sse]\nsend_buffer = 0\n[server]\ncors_origins = [\"*\"]\n",
            &[],
        );
        assert!(ok.is_ok(), "{ok:?}");
    }

    /// Status output hides the secret and URL passwords but shows the rest.
    #[test]
    fn summary_redacts_secrets() {
        let c = load(
            "[auth]\nmode = \"jwt\"\njwt_secret = \"s3cret\"\n[redis]\nurl = \"redis://:pw@h:6379/0\"\n",
            &[],
        )
        .expect("valid");
        let s = c.summary();
        let text = s.to_string();
        assert!(!text.contains("s3cret") && !text.contains("pw@"), "{text}");
        assert_eq!(s["auth"]["jwt_secret"], "(set)");
        assert_eq!(s["redis"]["url"], "redis://(redacted)@h:6379/0");
        assert_eq!(s["sse"]["heartbeat"], "20s");
        assert_eq!(Config::default().summary()["auth"]["jwt_secret"], "(empty)");
        assert!(!format!("{c:?}").contains("s3cret"));
    }

    /// A configuration that sets every key of every section away from its default, with a JWT
    /// secret and passwords in every URL.
    const EVERY_KEY_SET: &str = r#"
[server]
listen = "0.0.0.0:9090"
workers = 3
insecure = true
cors_origins = ["https://a.example", "*"]
[backend]
kind = "redis"
[memory]
retention = "5m"
max_len = 20
shards = 8
[redis]
url = "redis://user:pw1@r1:6379/2"
urls = ["redis://:pw2@r2:6379", "redis://r3:6379"]
cluster = false
groups = 2
shards = 32
prefix = "ev"
block = "1500ms"
count = 50
retention = "2h"
max_len = 300
[nats]
url = "nats://u:pw3@n1:4222,nats://n2:4222"
stream = "EV"
subject_prefix = "a.b"
retention = "30m"
shards = 16
replicas = 3
[sse]
queue_limit = 10
heartbeat = "250ms"
stall_timeout = "0s"
send_buffer = 0
retry_ms = 1500
[drain]
grace = "1m"
readiness_delay = "5s"
retry_min = "2s"
retry_max = "90s"
close_rate = 7
[auth]
mode = "jwt"
jwt_secret = "s3cret"
jwt_public_key_file = ""
[publish]
dedupe_window = "1h"
[limits]
max_event_bytes = 1000
max_batch = 5
max_connections = 100
max_body_bytes = 2000
[replay]
max_concurrent = 4
cache_entries = 0
"#;

    /// `/admin/status` shows the whole configuration in exactly this shape: every section and
    /// key, durations as written, the secret as "(set)"/"(empty)", URLs without their passwords.
    #[test]
    fn summary_of_every_key() {
        let c = load(EVERY_KEY_SET, &[]).expect("valid");
        let expected = serde_json::json!({
            "server": {
                "listen": "0.0.0.0:9090",
                "workers": 3,
                "effective_workers": 3,
                "insecure": true,
                "cors_origins": ["https://a.example", "*"],
            },
            "backend": { "kind": "redis" },
            "memory": { "retention": "5m", "max_len": 20, "shards": 8 },
            "redis": {
                "url": "redis://(redacted)@r1:6379/2",
                "urls": ["redis://(redacted)@r2:6379", "redis://r3:6379"],
                "cluster": false,
                "groups": 2,
                "shards": 32,
                "prefix": "ev",
                "block": "1500ms",
                "count": 50,
                "retention": "2h",
                "max_len": 300,
            },
            "nats": {
                "url": "nats://(redacted)@n1:4222,nats://n2:4222",
                "stream": "EV",
                "subject_prefix": "a.b",
                "retention": "30m",
                "shards": 16,
                "replicas": 3,
            },
            "sse": {
                "queue_limit": 10,
                "heartbeat": "250ms",
                "stall_timeout": "0s",
                "send_buffer": 0,
                "retry_ms": 1500,
            },
            "drain": {
                "grace": "1m",
                "readiness_delay": "5s",
                "retry_min": "2s",
                "retry_max": "90s",
                "close_rate": 7,
            },
            "auth": { "mode": "jwt", "jwt_secret": "(set)", "jwt_public_key_file": "" },
            "publish": { "dedupe_window": "1h" },
            "limits": {
                "max_event_bytes": 1000,
                "max_batch": 5,
                "max_connections": 100,
                "max_body_bytes": 2000,
            },
            "replay": { "max_concurrent": 4, "cache_entries": 0 },
        });
        assert_eq!(c.summary(), expected);
        // The text /admin/status writes, not only the value: same keys in the same order.
        assert_eq!(c.summary().to_string(), expected.to_string());

        let c = load(
            "[auth]\nmode = \"jwt\"\njwt_public_key_file = \"/etc/posthorn/k.pem\"\n",
            &[],
        )
        .expect("valid");
        assert_eq!(
            c.summary()["auth"],
            serde_json::json!({
                "mode": "jwt",
                "jwt_secret": "(empty)",
                "jwt_public_key_file": "/etc/posthorn/k.pem",
            })
        );
    }

    /// A missing file is an I/O error naming the path, with exit code 64.
    #[test]
    fn missing_file() {
        let err = Config::load(Some(Path::new("/nonexistent/posthorn.toml")), &no_env())
            .expect_err("missing");
        assert!(matches!(err, ConfigError::Io { .. }));
        assert!(err.to_string().contains("/nonexistent/posthorn.toml"));
        assert_eq!(err.exit_code(), 64);
    }
}
