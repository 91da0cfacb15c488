//! `[nats]`: NATS JetStream as the event log: the servers, the stream and its subjects, and how
//! the hub proves who it is (TLS, one kind of credentials).
//!
//! Only file *paths* live in the configuration: the secrets are read from them when the backend
//! connects (`backend/nats/connect.rs`), so neither the raw nor the typed tree can show one.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use super::error::{invalid, ConfigError};
use super::raw::RawNats;
use super::secret::{redact_url, refuse_placeholder, RedactedUrl};
use super::value::{
    duration, int_in, name_chars, optional_path, serialize_duration, serialize_optional_path,
    shards,
};

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
    /// CA certificates (PEM) the server's certificate must chain to, instead of the system's.
    #[serde(serialize_with = "serialize_optional_path")]
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificate and key (PEM) for mutual TLS; both or neither.
    #[serde(serialize_with = "serialize_optional_path")]
    pub tls_cert_file: Option<PathBuf>,
    #[serde(serialize_with = "serialize_optional_path")]
    pub tls_key_file: Option<PathBuf>,
    /// Shown as the five keys of the file, paths and user name only.
    #[serde(flatten)]
    pub credentials: NatsCredentials,
}

/// How the hub authenticates to NATS: at most one kind, so that what it presents is what the
/// operator meant (given several, the client sends them all and the server checks whichever its
/// own configuration names, which hides a mistake).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum NatsCredentials {
    /// None configured, or a user and password (or token) inside `nats.url`.
    #[default]
    None,
    /// A `.creds` file: user JWT and nkey seed (operator / JWT mode).
    CredsFile(PathBuf),
    /// A file holding a user nkey seed (`SU...`).
    NkeySeedFile(PathBuf),
    /// A user name and a file holding its password.
    UserPassword {
        user: String,
        password_file: PathBuf,
    },
    /// A file holding an authorization token.
    TokenFile(PathBuf),
}

impl Serialize for NatsCredentials {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let shown = |path: Option<&Path>| path.map(|p| p.display().to_string()).unwrap_or_default();
        let (creds, nkey, user, password, token) = match self {
            NatsCredentials::None => (None, None, "", None, None),
            NatsCredentials::CredsFile(path) => (Some(path), None, "", None, None),
            NatsCredentials::NkeySeedFile(path) => (None, Some(path), "", None, None),
            NatsCredentials::UserPassword {
                user,
                password_file,
            } => (None, None, user.as_str(), Some(password_file), None),
            NatsCredentials::TokenFile(path) => (None, None, "", None, Some(path)),
        };
        let mut map = s.serialize_map(Some(5))?;
        map.serialize_entry("creds_file", &shown(creds.map(PathBuf::as_path)))?;
        map.serialize_entry("nkey_seed_file", &shown(nkey.map(PathBuf::as_path)))?;
        map.serialize_entry("user", user)?;
        map.serialize_entry("password_file", &shown(password.map(PathBuf::as_path)))?;
        map.serialize_entry("token_file", &shown(token.map(PathBuf::as_path)))?;
        map.end()
    }
}

impl NatsConfig {
    /// Whether the connection must be TLS: a `tls://` server, or a TLS file to use.
    pub fn wants_tls(&self) -> bool {
        self.url.iter().any(|url| {
            url.as_str()
                .trim()
                .get(..6)
                .is_some_and(|scheme| scheme.eq_ignore_ascii_case("tls://"))
        }) || self.tls_ca_file.is_some()
            || self.tls_cert_file.is_some()
    }

    /// The client certificate and key for mutual TLS, when configured.
    pub fn client_cert(&self) -> Option<(&Path, &Path)> {
        Some((
            self.tls_cert_file.as_deref()?,
            self.tls_key_file.as_deref()?,
        ))
    }
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
                    redact_url(&raw.url)
                ),
            ));
        }
        refuse_placeholder("nats.url", &raw.url)?;
        name_chars("nats.stream", &raw.stream, "A-Za-z0-9_-", |c| {
            c.is_ascii_alphanumeric() || matches!(c, '_' | '-')
        })?;
        subject_prefix("nats.subject_prefix", &raw.subject_prefix)?;
        let url: Vec<RedactedUrl> = raw.url.split(',').map(RedactedUrl::new).collect();
        let path = |value: &str| optional_path(value.to_string());
        let (tls_cert_file, tls_key_file) = (path(&raw.tls_cert_file), path(&raw.tls_key_file));
        if tls_cert_file.is_some() != tls_key_file.is_some() {
            let (set, unset) = if tls_cert_file.is_some() {
                ("nats.tls_cert_file", "nats.tls_key_file")
            } else {
                ("nats.tls_key_file", "nats.tls_cert_file")
            };
            return Err(invalid(
                unset,
                format!("must be set with {set}: a client certificate needs its key (got \"\")"),
            ));
        }
        let credentials = credentials(&raw)?;
        if credentials != NatsCredentials::None {
            if let Some(with_user) = url.iter().find(|url| url.has_user_info()) {
                return Err(invalid(
                    "nats.url",
                    format!(
                        "{:?} carries a user or token, and {} is set too: give the credentials \
                         one way",
                        with_user.redacted().trim(),
                        credentials_key(&credentials)
                    ),
                ));
            }
        }
        Ok(NatsConfig {
            url,
            stream: raw.stream,
            subject_prefix: raw.subject_prefix,
            retention,
            shards,
            replicas,
            tls_ca_file: path(&raw.tls_ca_file),
            tls_cert_file,
            tls_key_file,
            credentials,
        })
    }
}

/// The one kind of credentials the section sets: two kinds, or half of a user and password, is
/// an error naming the keys.
fn credentials(raw: &RawNats) -> Result<NatsCredentials, ConfigError> {
    let path = |value: &str| optional_path(value.to_string());
    let user_password = match (raw.user.is_empty(), path(&raw.password_file)) {
        (true, None) => None,
        (false, Some(password_file)) => Some(NatsCredentials::UserPassword {
            user: raw.user.clone(),
            password_file,
        }),
        (false, None) => {
            return Err(invalid(
                "nats.password_file",
                format!(
                    "must be set with nats.user (got \"\" for user {:?})",
                    raw.user
                ),
            ))
        }
        (true, Some(_)) => {
            return Err(invalid(
                "nats.user",
                "must be set with nats.password_file (got \"\")",
            ))
        }
    };
    let kinds: Vec<NatsCredentials> = [
        path(&raw.creds_file).map(NatsCredentials::CredsFile),
        path(&raw.nkey_seed_file).map(NatsCredentials::NkeySeedFile),
        user_password,
        path(&raw.token_file).map(NatsCredentials::TokenFile),
    ]
    .into_iter()
    .flatten()
    .collect();
    match kinds.as_slice() {
        [] => Ok(NatsCredentials::None),
        [one] => Ok(one.clone()),
        [first, second, ..] => Err(invalid(
            credentials_key(first),
            format!(
                "cannot be used together with {}: set one kind of NATS credentials",
                credentials_key(second)
            ),
        )),
    }
}

/// The key that sets `credentials`, for messages.
fn credentials_key(credentials: &NatsCredentials) -> &'static str {
    match credentials {
        NatsCredentials::None => "no credentials key",
        NatsCredentials::CredsFile(_) => "nats.creds_file",
        NatsCredentials::NkeySeedFile(_) => "nats.nkey_seed_file",
        NatsCredentials::UserPassword { .. } => "nats.user",
        NatsCredentials::TokenFile(_) => "nats.token_file",
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

    /// A client certificate needs its key and the other way round; a CA file, a certificate or a
    /// `tls://` server asks for TLS.
    #[test]
    fn tls_keys() {
        let error = nats(RawNats {
            tls_cert_file: "/c.pem".into(),
            ..RawNats::default()
        })
        .expect_err("no key");
        assert!(error.starts_with("nats.tls_key_file: "), "{error}");
        assert!(error.contains("nats.tls_cert_file"), "{error}");
        let error = nats(RawNats {
            tls_key_file: "/k.pem".into(),
            ..RawNats::default()
        })
        .expect_err("no cert");
        assert!(error.starts_with("nats.tls_cert_file: "), "{error}");
        let c = nats(RawNats {
            tls_cert_file: "/c.pem".into(),
            tls_key_file: "/k.pem".into(),
            ..RawNats::default()
        })
        .expect("valid");
        assert_eq!(
            c.client_cert(),
            Some((Path::new("/c.pem"), Path::new("/k.pem")))
        );
        assert!(c.wants_tls());
        let plain = nats(RawNats::default()).expect("valid");
        assert!(!plain.wants_tls() && plain.client_cert().is_none());
        for raw in [
            RawNats {
                url: "nats://a:4222,TLS://b:4222".into(),
                ..RawNats::default()
            },
            RawNats {
                tls_ca_file: "/ca.pem".into(),
                ..RawNats::default()
            },
        ] {
            assert!(nats(raw).expect("valid").wants_tls());
        }
    }

    fn with_credentials(keys: &[&str]) -> RawNats {
        let mut raw = RawNats::default();
        for key in keys {
            match *key {
                "creds_file" => raw.creds_file = "/n.creds".into(),
                "nkey_seed_file" => raw.nkey_seed_file = "/seed".into(),
                "user" => {
                    raw.user = "hub".into();
                    raw.password_file = "/pw".into();
                }
                "token_file" => raw.token_file = "/token".into(),
                other => unreachable!("{other}"),
            }
        }
        raw
    }

    /// One kind of credentials at most: any two kinds are refused with both keys named, and a
    /// user needs its password file (and the reverse).
    #[test]
    fn one_kind_of_credentials() {
        let kinds = ["creds_file", "nkey_seed_file", "user", "token_file"];
        for (i, first) in kinds.iter().enumerate() {
            for second in &kinds[i + 1..] {
                let error = nats(with_credentials(&[first, second])).expect_err("two kinds");
                assert!(error.starts_with(&format!("nats.{first}: ")), "{error}");
                assert!(error.contains(&format!("nats.{second}")), "{error}");
            }
        }
        assert_eq!(
            nats(with_credentials(&["token_file"]))
                .expect("valid")
                .credentials,
            NatsCredentials::TokenFile("/token".into())
        );
        assert_eq!(
            nats(with_credentials(&["user"]))
                .expect("valid")
                .credentials,
            NatsCredentials::UserPassword {
                user: "hub".into(),
                password_file: "/pw".into()
            }
        );
        let error = nats(RawNats {
            user: "hub".into(),
            ..RawNats::default()
        })
        .expect_err("no password");
        assert!(error.starts_with("nats.password_file: "), "{error}");
        assert!(error.contains("nats.user"), "{error}");
        let error = nats(RawNats {
            password_file: "/pw".into(),
            ..RawNats::default()
        })
        .expect_err("no user");
        assert!(error.starts_with("nats.user: "), "{error}");
        assert!(error.contains("nats.password_file"), "{error}");
    }

    /// A user and password in the URL still work alone, but not beside a credentials key; the
    /// message shows the URL without them.
    #[test]
    fn url_credentials_or_keys() {
        let in_url = RawNats {
            url: "nats://a:4222,nats://hub:pw9@b:4222".into(),
            ..RawNats::default()
        };
        assert!(nats(in_url.clone()).is_ok());
        let error = nats(RawNats {
            token_file: "/token".into(),
            ..in_url
        })
        .expect_err("two ways");
        assert!(error.starts_with("nats.url: "), "{error}");
        assert!(error.contains("nats.token_file"), "{error}");
        assert!(!error.contains("pw9"), "{error}");
    }

    /// The summary shows paths and the user name, "" for what is unset.
    #[test]
    fn credentials_shown_as_paths() {
        let c = nats(RawNats {
            tls_ca_file: "/ca.pem".into(),
            ..with_credentials(&["user"])
        })
        .expect("valid");
        let shown = serde_json::to_value(&c).expect("json");
        assert_eq!(shown["tls_ca_file"], "/ca.pem");
        assert_eq!(shown["tls_cert_file"], "");
        assert_eq!(shown["user"], "hub");
        assert_eq!(shown["password_file"], "/pw");
        assert_eq!(shown["creds_file"], "");
        assert_eq!(shown["token_file"], "");
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
