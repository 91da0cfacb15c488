//! Typed, validated configuration: the `Config` tree every other module reads,
//! how it is loaded (file, then `POSTHORN_<SECTION>__<KEY>` environment
//! overlay) and the single validation pass that turns the raw values into it.
//!
//! One file per section: each turns its raw section (`raw.rs`) into its typed
//! form with `TryFrom`, checking its own rules; the one rule across sections
//! (`publish.dedupe_window` against the NATS retention) runs here, once the
//! backend is known. Validation happens once, at start-up; after that no
//! caller needs to re-check a value. Every error names the offending key and
//! carries the offending value, and a bad configuration exits with
//! [`ConfigError::EXIT_CODE`].
//!
//! The `/admin/status` summary is the tree itself, serialized: durations as
//! written (`15m`), the JWT secret as "(set)"/"(empty)" and URLs without their
//! passwords, because those types redact themselves (`secret.rs`).

pub mod auth;
pub mod backend;
pub mod drain;
pub mod env;
pub mod error;
pub mod limits;
pub mod memory;
pub mod nats;
pub mod presence;
pub mod publish;
pub mod raw;
pub mod redis;
pub mod replay;
pub mod secret;
pub mod server;
pub mod sse;
mod value;

use std::path::Path;

use serde::{Deserialize, Serialize};
use toml::{Table, Value};

pub use auth::{AuthConfig, AuthMode};
pub use backend::{BackendChoice, BackendConfig, BackendKind};
pub use drain::DrainConfig;
pub use env::{EnvSource, ProcessEnv};
use error::invalid;
pub use error::{ConfigError, KeyOrigin};
pub use limits::LimitsConfig;
pub use memory::MemoryConfig;
pub use nats::{NatsConfig, NatsCredentials};
pub use presence::PresenceConfig;
pub use publish::PublishConfig;
use raw::RawConfig;
pub use redis::RedisConfig;
pub use replay::ReplayConfig;
pub use secret::{RedactedUrl, Secret, SecretFileError};
pub use server::ServerConfig;
pub use sse::SseConfig;
pub use value::{format_duration, parse_duration, MAX_DURATION, MAX_SHARDS};

/// The whole configuration, one field per section. `Serialize` is the `/admin/status` summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
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
    pub presence: PresenceConfig,
}

impl Default for Config {
    fn default() -> Self {
        // The built-in defaults are checked by `defaults_match_spec`; failing
        // here would be a bug in raw.rs, not a user error.
        Config::from_raw(RawConfig::default()).expect("built-in defaults are valid")
    }
}

/// The reference configuration file: every key with its default and what it means.
pub const REFERENCE_FILE: &str = include_str!("../../config/posthorn.toml");

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

    /// Validate raw values and convert them to their typed form, section by section in the
    /// order of the reference file, so that of several errors the first one there is reported.
    pub fn from_raw(raw: RawConfig) -> Result<Config, ConfigError> {
        let server = raw.server.try_into()?;
        let backend: BackendConfig = raw.backend.try_into()?;
        let memory = raw.memory.try_into()?;
        let redis = raw.redis.try_into()?;
        let nats = raw.nats.try_into()?;
        let sse = raw.sse.try_into()?;
        let drain = raw.drain.try_into()?;
        let auth = raw.auth.try_into()?;
        let publish: PublishConfig = raw.publish.try_into()?;
        publish.check_backend(BackendChoice::select(backend.kind, &memory, &redis, &nats))?;
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
            limits: raw.limits.try_into()?,
            replay: raw.replay.try_into()?,
            presence: raw.presence.try_into()?,
        })
    }

    /// The backend `backend.kind` selects, with its section.
    pub fn backend_choice(&self) -> BackendChoice<'_> {
        BackendChoice::select(self.backend.kind, &self.memory, &self.redis, &self.nats)
    }

    /// Switch to the backend `kind` (`serve --backend`), checking again the rule that depends
    /// on the backend, so that an override cannot skip validation.
    pub fn select_backend(&mut self, kind: BackendKind) -> Result<(), ConfigError> {
        let choice = BackendChoice::select(kind, &self.memory, &self.redis, &self.nats);
        self.publish.check_backend(choice)?;
        self.backend.kind = kind;
        Ok(())
    }

    /// Shard count of the selected backend.
    pub fn shards(&self) -> u32 {
        self.backend_choice().shards()
    }

    /// HTTP worker threads: `server.workers`, or the core count when it is 0.
    pub fn effective_workers(&self) -> usize {
        self.server.effective_workers
    }

    /// Whether `server.listen` is a loopback address (for the caller's
    /// secure-by-default check).
    pub fn listen_is_loopback(&self) -> bool {
        self.server.listen.ip().is_loopback()
    }

    /// The configuration as a configuration file would say it (`posthorn config show`): the
    /// keys of the reference file, in its sections, with the values of [`Config::summary`]
    /// (the user-info of URLs redacted); derived values are left out, and `auth.jwt_secret` is
    /// empty whatever it holds (a file that shows a placeholder would load it as the secret).
    pub fn as_file(&self) -> Table {
        let mut summary = self.summary();
        if let Some(secret) = summary.pointer_mut("/auth/jwt_secret") {
            *secret = serde_json::Value::from("");
        }
        let mut file = raw::schema();
        for (section, keys) in file.iter_mut() {
            let Some(keys) = keys.as_table_mut() else {
                continue;
            };
            for (key, value) in keys.iter_mut() {
                if let Some(shown) = summary.get(section).and_then(|values| values.get(key)) {
                    // Strings, integers, booleans and lists of strings, like the schema's.
                    if let Ok(shown) = Value::try_from(shown) {
                        *value = shown;
                    }
                }
            }
        }
        file
    }

    /// The whole configuration as JSON for /admin/status, with the JWT secret
    /// reduced to "(set)"/"(empty)" and passwords removed from URLs.
    pub fn summary(&self) -> serde_json::Value {
        // Every Serialize in the tree writes strings, numbers, bools and lists under string
        // keys, none of which can fail.
        serde_json::to_value(self).expect("the configuration serializes to json")
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::time::Duration;

    const REFERENCE: &str = REFERENCE_FILE;

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
        assert_eq!(c.redis.url.as_str(), "redis://127.0.0.1:6379");
        assert!(c.redis.urls.is_empty());
        assert!(!c.redis.cluster);
        assert_eq!(c.redis.groups, 1);
        assert_eq!(c.redis.shards, 64);
        assert_eq!(c.redis.prefix, "pos-ev");
        assert_eq!(c.redis.block, Duration::from_secs(30));
        assert_eq!(c.redis.count, 500);
        assert_eq!(c.redis.retention, Duration::from_secs(15 * 60));
        assert_eq!(c.redis.max_len, 100_000);
        assert_eq!(c.redis.tls_ca_file, None);
        assert_eq!(c.redis.tls_cert_file, None);
        assert_eq!(c.redis.tls_key_file, None);
        assert_eq!(c.redis.username, "");
        assert_eq!(c.redis.password_file, None);
        assert_eq!(c.nats.url, [RedactedUrl::new("nats://127.0.0.1:4222")]);
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

    /// Through the whole load (file, overlay, every section), a broken rule of any section is
    /// reported as "<section>.<key>: ...", and so is the rule across sections.
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
            (
                "[redis]\nurl = \"rediss://a\"\ntls_cert_file = \"/c.pem\"\n",
                "redis.tls_key_file: ",
            ),
            (
                "[redis]\ntls_ca_file = \"/ca.pem\"\n",
                "redis.tls_ca_file: ",
            ),
            (
                "[redis]\nurl = \"redis://:pw@a\"\npassword_file = \"/pw\"\n",
                "redis.password_file: ",
            ),
            ("[redis]\nusername = \"u\"\n", "redis.username: "),
            ("[memory]\nshards = 0\n", "memory.shards: "),
            ("[nats]\nstream = \"a.b\"\n", "nats.stream: "),
            ("[nats]\nsubject_prefix = \"\"\n", "nats.subject_prefix: "),
            (
                "[nats]\ntls_key_file = \"/k.pem\"\n",
                "nats.tls_cert_file: ",
            ),
            (
                "[nats]\ncreds_file = \"/a\"\ntoken_file = \"/b\"\n",
                "nats.creds_file: ",
            ),
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

    /// A configuration that sets every key of every section (all but `redis.cluster`,
    /// `auth.jwt_secret_file`, `auth.jwt_public_key_file`, the NATS credentials keys (the NATS URL
    /// carries a password, which no credentials key may join) and the TLS and ACL user keys of
    /// `[redis]` (`summary_of_redis_tls_and_user` has those) away from their defaults), with a JWT
    /// secret and passwords in the URLs.
    const EVERY_KEY_SET: &str = r#"
[server]
listen = "0.0.0.0:9090"
workers = 3
insecure = true
cors_origins = ["https://a.example", "*"]
allowed_hosts = ["hub.internal"]
tls_cert_file = "/etc/posthorn/tls/cert.pem"
tls_key_file = "/etc/posthorn/tls/key.pem"
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
tls_ca_file = ""
tls_cert_file = ""
tls_key_file = ""
username = ""
password_file = ""
[nats]
url = "nats://u:pw3@n1:4222,nats://n2:4222"
stream = "EV"
subject_prefix = "a.b"
retention = "30m"
shards = 16
replicas = 3
tls_ca_file = "/etc/posthorn/nats-ca.pem"
tls_cert_file = "/etc/posthorn/nats.pem"
tls_key_file = "/etc/posthorn/nats-key.pem"
creds_file = ""
nkey_seed_file = ""
user = ""
password_file = ""
token_file = ""
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
jwt_secret_file = ""
jwt_public_key_file = ""
jwks_url = "https://idp.example/.well-known/jwks.json"
jwks_ca_file = "/etc/posthorn/idp-ca.pem"
jwks_refresh = "10m"
issuer = "https://idp.example/"
audience = "posthorn"
leeway = "5s"
revocation_retention = "7d"
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
[presence]
enabled = false
pod_name = "pod-a"
ttl = "10s"
retention = "24h"
debounce = "0s"
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
                "allowed_hosts": ["hub.internal"],
                "tls_cert_file": "/etc/posthorn/tls/cert.pem",
                "tls_key_file": "/etc/posthorn/tls/key.pem",
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
                "tls_ca_file": "",
                "tls_cert_file": "",
                "tls_key_file": "",
                "username": "",
                "password_file": "",
            },
            "nats": {
                "url": "nats://(redacted)@n1:4222,nats://n2:4222",
                "stream": "EV",
                "subject_prefix": "a.b",
                "retention": "30m",
                "shards": 16,
                "replicas": 3,
                "tls_ca_file": "/etc/posthorn/nats-ca.pem",
                "tls_cert_file": "/etc/posthorn/nats.pem",
                "tls_key_file": "/etc/posthorn/nats-key.pem",
                "creds_file": "",
                "nkey_seed_file": "",
                "user": "",
                "password_file": "",
                "token_file": "",
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
            "auth": {
                "mode": "jwt",
                "jwt_secret": "(set)",
                "jwt_secret_file": "",
                "jwt_public_key_file": "",
                "jwks_url": "https://idp.example/.well-known/jwks.json",
                "jwks_ca_file": "/etc/posthorn/idp-ca.pem",
                "jwks_refresh": "10m",
                "issuer": "https://idp.example/",
                "audience": "posthorn",
                "leeway": "5s",
                "revocation_retention": "7d",
            },
            "publish": { "dedupe_window": "1h" },
            "limits": {
                "max_event_bytes": 1000,
                "max_batch": 5,
                "max_connections": 100,
                "max_body_bytes": 2000,
                "max_groups_per_device": 16,
            },
            "replay": { "max_concurrent": 4, "cache_entries": 0 },
            "presence": {
                "enabled": false,
                "pod_name": "pod-a",
                "ttl": "10s",
                "retention": "1d",
                "debounce": "0s",
            },
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
                "jwt_secret_file": "",
                "jwt_public_key_file": "/etc/posthorn/k.pem",
                "jwks_url": "",
                "jwks_ca_file": "",
                "jwks_refresh": "5m",
                "issuer": "",
                "audience": "",
                "leeway": "30s",
                "revocation_retention": "30d",
            })
        );
    }

    /// The TLS and ACL user keys of `[redis]` show their paths and the user, never a password.
    #[test]
    fn summary_of_redis_tls_and_user() {
        let c = load(
            "[redis]\nurl = \"rediss://r1:6380\"\ntls_ca_file = \"/etc/redis/ca.pem\"\n\
             tls_cert_file = \"/etc/redis/c.pem\"\ntls_key_file = \"/etc/redis/k.pem\"\n\
             username = \"posthorn\"\npassword_file = \"/run/secrets/redis\"\n",
            &[],
        )
        .expect("valid");
        let redis = &c.summary()["redis"];
        assert_eq!(redis["url"], "rediss://r1:6380");
        assert_eq!(redis["tls_ca_file"], "/etc/redis/ca.pem");
        assert_eq!(redis["tls_cert_file"], "/etc/redis/c.pem");
        assert_eq!(redis["tls_key_file"], "/etc/redis/k.pem");
        assert_eq!(redis["username"], "posthorn");
        assert_eq!(redis["password_file"], "/run/secrets/redis");
    }

    /// The summary has exactly the sections and keys of the file, plus the resolved
    /// `server.effective_workers`: a key added to raw.rs cannot be missing from /admin/status.
    #[test]
    fn summary_keys_are_the_file_keys() {
        use std::collections::BTreeSet;
        let summary = Config::default().summary();
        let summary = summary.as_object().expect("an object");
        let schema = raw::schema();
        let names = |keys: Vec<&String>| keys.into_iter().cloned().collect::<BTreeSet<_>>();
        assert_eq!(
            names(summary.keys().collect()),
            names(schema.keys().collect())
        );
        for (section, keys) in &schema {
            let mut expected = names(keys.as_table().expect("a table").keys().collect());
            if section == "server" {
                expected.insert("effective_workers".into());
            }
            let shown = summary[section]
                .as_object()
                .unwrap_or_else(|| panic!("{section} is not an object"));
            assert_eq!(names(shown.keys().collect()), expected, "[{section}]");
        }
    }

    /// `{:?}` of the whole tree, as a log line would write it, shows neither the JWT secret
    /// nor any URL password.
    #[test]
    fn debug_hides_every_credential() {
        let c = load(EVERY_KEY_SET, &[]).expect("valid");
        let text = format!("{c:?}");
        for credential in ["s3cret", "pw1", "pw2", "pw3"] {
            assert!(!text.contains(credential), "{credential} in {text}");
        }
        assert!(text.contains("redis://(redacted)@r1:6379/2"), "{text}");
    }

    /// Bug pinned: `serve --backend nats` set the kind after validation, so a
    /// `publish.dedupe_window` longer than `nats.retention` passed and JetStream refused the
    /// stream at start-up. Selecting a backend checks the rule that depends on it, and a
    /// refused switch leaves the configuration as it was.
    #[test]
    fn selecting_a_backend_checks_it() {
        let mut c = load("[nats]\nretention = \"5m\"\n", &[]).expect("valid with memory");
        let error = c
            .select_backend(BackendKind::Nats)
            .expect_err("10m window, 5m retention");
        assert!(
            error.to_string().starts_with("publish.dedupe_window: "),
            "{error}"
        );
        assert_eq!(c.backend.kind, BackendKind::Memory);
        c.select_backend(BackendKind::Redis)
            .expect("no rule for redis");
        assert_eq!(c.backend_choice().kind(), BackendKind::Redis);
        let mut c = load("[nats]\nretention = \"1h\"\n", &[]).expect("valid");
        c.select_backend(BackendKind::Nats)
            .expect("window within retention");
        assert_eq!(c.backend_choice().retention(), Duration::from_secs(3600));
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
