//! What every Redis connection is opened with, read once at start-up: the URL, TLS
//! ([`super::tls`]), and the ACL user and password (`redis.username`, `redis.password_file`, or
//! the URL's user-info).
//!
//! The password of `redis.password_file` lives in a [`Secret`] until it is handed to fred, so no
//! `{:?}` of the hub's own values can print it.

use std::path::PathBuf;

use fred::{
    error::{Error as FredError, ErrorKind},
    prelude::Config,
    types::config::TlsConfig,
};
use thiserror::Error;

use crate::config::{RedactedUrl, RedisConfig, Secret};

/// A file of the `[redis]` section that cannot be used. Shown at start-up, where the hub stops.
#[derive(Debug, Error)]
pub enum SetupError {
    /// `redis.password_file` cannot be read, or is empty.
    #[error(transparent)]
    PasswordFile(#[from] crate::config::ConfigError),
    /// A TLS file that cannot be used (`crate::tls` says why and names the path).
    #[error("{key}")]
    File {
        key: &'static str,
        #[source]
        source: crate::tls::TlsError,
    },
    #[error(
        "redis.tls_cert_file: {} with redis.tls_key_file {} is no usable client certificate",
        cert.display(),
        key.display()
    )]
    ClientCert {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("cannot set up TLS to redis")]
    Tls(#[source] rustls::Error),
    #[error("cannot set up the verification of the redis servers' certificates")]
    Verifier(#[source] rustls::client::VerifierBuilderError),
}

impl SetupError {
    /// Names the key of a TLS file that cannot be used.
    pub(super) fn file(key: &'static str) -> impl FnOnce(crate::tls::TlsError) -> Self {
        move |source| Self::File { key, source }
    }
}

/// How to open each connection of the backend.
#[derive(Debug, Clone)]
pub struct ConnectionSetup {
    tls: Option<TlsConfig>,
    username: Option<String>,
    password: Option<Secret>,
}

impl ConnectionSetup {
    /// Reads the files of `[redis]` (CA, client certificate and key, password).
    pub fn read(redis: &RedisConfig) -> Result<Self, SetupError> {
        Ok(Self {
            tls: super::tls::client_tls(redis)?,
            username: (!redis.username.is_empty()).then(|| redis.username.clone()),
            password: redis
                .password_file
                .as_deref()
                .map(|path| Secret::from_file("redis.password_file", path))
                .transpose()?,
        })
    }

    /// fred's configuration for one instance, or for a cluster through its seed `url`.
    pub fn config(&self, url: &RedactedUrl, cluster: bool) -> Result<Config, FredError> {
        // fred would build its own TLS for rediss:// (system roots, no client certificate); the
        // URL is parsed as redis:// and this setup's TLS is put in its place.
        let plain = url
            .as_str()
            .strip_prefix("rediss://")
            .map(|rest| format!("redis://{rest}"));
        let text = plain.as_deref().unwrap_or(url.as_str());
        let mut config = if cluster {
            Config::from_url_clustered(text)?
        } else {
            Config::from_url_centralized(text)?
        };
        if plain.is_some() {
            let Some(tls) = &self.tls else {
                // `read` builds TLS whenever a URL in use is rediss://; never fall back to
                // plain text.
                return Err(FredError::new(
                    ErrorKind::Tls,
                    format!("no TLS settings for {}", url.redacted()),
                ));
            };
            config.tls = Some(tls.clone());
        }
        if let Some(username) = &self.username {
            config.username = Some(username.clone());
        }
        if let Some(password) = &self.password {
            config.password = Some(password.expose().to_string());
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn temp_file(name: &str, content: &[u8]) -> PathBuf {
        let path = std::env::temp_dir().join(format!("posthorn-{}-{name}", std::process::id()));
        std::fs::write(&path, content).expect("write");
        path
    }

    fn password(path: &Path) -> Result<Secret, crate::config::ConfigError> {
        Secret::from_file("redis.password_file", path)
    }

    /// The line end is trimmed, nothing else; an empty or missing file names key and path.
    #[test]
    fn password_files() {
        let path = temp_file("pw", b" s3cret \r\n");
        let read = password(&path).map(|secret| secret.expose().to_string());
        let _ = std::fs::remove_file(&path);
        assert_eq!(read.expect("read"), " s3cret ");
        let path = temp_file("pw-empty", b"\n");
        let error = password(&path).expect_err("empty").to_string();
        let _ = std::fs::remove_file(&path);
        assert!(error.starts_with("redis.password_file: ") && error.ends_with(" is empty"));
        let error = password(Path::new("/nonexistent/pw")).expect_err("missing");
        assert!(
            error
                .to_string()
                .starts_with("redis.password_file: cannot read /nonexistent/pw"),
            "{error}"
        );
    }

    /// The file's password and the configured user reach fred; a rediss:// URL gets this
    /// setup's TLS, a redis:// URL none.
    #[test]
    fn fred_gets_credentials_and_tls() {
        let mut redis = crate::config::Config::default().redis;
        redis.url = RedactedUrl::new("rediss://127.0.0.1:6380/2");
        let path = temp_file("pw-config", b"s3cret\n");
        let ca = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("ca");
        let ca_file = temp_file("ca.pem", ca.cert.pem().as_bytes());
        redis.password_file = Some(path.clone());
        redis.tls_ca_file = Some(ca_file.clone());
        redis.username = "posthorn".into();
        let setup = ConnectionSetup::read(&redis);
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(&ca_file);
        let setup = setup.expect("setup");
        assert!(!format!("{setup:?}").contains("s3cret"));
        let config = setup.config(&redis.url, false).expect("config");
        assert_eq!(config.password.as_deref(), Some("s3cret"));
        assert_eq!(config.username.as_deref(), Some("posthorn"));
        assert_eq!(config.database, Some(2));
        assert!(config.tls.is_some());
        let plain = setup
            .config(&RedactedUrl::new("redis://127.0.0.1:6379"), false)
            .expect("config");
        assert!(plain.tls.is_none());
    }
}
