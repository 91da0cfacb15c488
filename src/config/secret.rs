//! Values that must not be shown as written: the JWT secret, and URLs that may carry a password.
//!
//! Redaction belongs to the type, not to the code that prints: `Debug` and `Serialize` (the
//! `/admin/status` summary) of these types never write the credential, so neither a `{:?}` in a
//! log line nor a new key in the summary can leak one. The value itself is read only through
//! [`Secret::expose`] and [`RedactedUrl::as_str`], where it is handed to a library.

use std::fmt;

use serde::{Serialize, Serializer};

/// "(set)" or "(empty)": all that may be shown of a secret.
pub(crate) fn marker(secret: &str) -> &'static str {
    if secret.is_empty() {
        "(empty)"
    } else {
        "(set)"
    }
}

/// A secret string (`auth.jwt_secret`): shown as "(set)" or "(empty)", never as its value.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the one place that signs or verifies with it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The secret in the file at `path`, read once at start-up: a secret kept in a mounted file
    /// (a Kubernetes Secret, a Vault agent's output) stays out of the environment that
    /// `/proc/<pid>/environ` and crash reports show. One trailing line break is not part of it:
    /// `echo secret > file` writes one. Every `*_file` key of a secret reads through here.
    pub fn read(path: &std::path::Path) -> Result<Self, SecretFileError> {
        let bytes = std::fs::read(path).map_err(SecretFileError::Read)?;
        let text = String::from_utf8(bytes).map_err(|_| SecretFileError::NotText)?;
        let value = text
            .strip_suffix('\n')
            .map(|rest| rest.strip_suffix('\r').unwrap_or(rest))
            .unwrap_or(&text);
        if value.is_empty() {
            return Err(SecretFileError::Empty);
        }
        Ok(Self(value.to_string()))
    }

    /// [`Secret::read`] for the configuration key `key`, its error naming key and path.
    pub fn from_file(key: &str, path: &std::path::Path) -> Result<Self, super::ConfigError> {
        Self::read(path).map_err(|error| {
            let message = match error {
                SecretFileError::Read(source) => {
                    format!("cannot read {}: {source}", path.display())
                }
                other => format!("{} {other}", path.display()),
            };
            super::error::invalid(key, message)
        })
    }
}

/// Why a secret file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    #[error("cannot be read: {0}")]
    Read(#[source] std::io::Error),
    #[error("is not UTF-8 text")]
    NotText,
    #[error("is empty")]
    Empty,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(marker(&self.0), f)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(marker(&self.0))
    }
}

/// Replace the user-info part of a URL (`redis://user:pass@host`) with "(redacted)". Written to
/// err on the side of hiding: a URL without a scheme (`user:pass@host:4222`, which the NATS client
/// accepts) is redacted too, and everything up to the *last* `@` counts as user-info, since a
/// password may hold a `/` or a `#` that a strict parser would take for the path.
pub(crate) fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), url),
    };
    match rest.rfind('@') {
        Some(at) => format!("{scheme}(redacted)@{}", &rest[at + 1..]),
        None => url.to_string(),
    }
}

/// Refuses a URL whose user-info is the placeholder that `posthorn config show` and
/// `/admin/status` print: loaded back, it would sign in as the user "(redacted)".
pub(crate) fn refuse_placeholder(key: &str, url: &str) -> Result<(), super::ConfigError> {
    if url.contains("(redacted)@") {
        return Err(super::error::invalid(
            key,
            "holds \"(redacted)\", the placeholder for credentials that posthorn config show \
             prints: put the real user and password back, or use the *_file keys",
        ));
    }
    Ok(())
}

/// A server URL as configured, which may carry a user and password: shown with the user-info
/// replaced by "(redacted)".
#[derive(Clone, PartialEq, Eq)]
pub struct RedactedUrl(String);

impl RedactedUrl {
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The URL as written, credentials included, for the client library that connects with it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The URL without its credentials, for messages and status output.
    pub fn redacted(&self) -> String {
        redact_url(&self.0)
    }

    /// Whether the URL carries a user, a password or a token.
    pub fn has_user_info(&self) -> bool {
        self.redacted() != self.0
    }
}

impl fmt::Debug for RedactedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.redacted(), f)
    }
}

impl Serialize for RedactedUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.redacted())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A secret shows only whether it is set, in `Debug` and in JSON.
    #[test]
    fn secret_shows_only_set_or_empty() {
        let secret = Secret::new("hunter2");
        assert_eq!(format!("{secret:?}"), "\"(set)\"");
        assert_eq!(serde_json::to_value(&secret).expect("json"), "(set)");
        assert_eq!(secret.expose(), "hunter2");
        let empty = Secret::default();
        assert_eq!(format!("{empty:?}"), "\"(empty)\"");
        assert_eq!(serde_json::to_value(&empty).expect("json"), "(empty)");
    }

    /// User-info is redacted wherever a URL is shown; a URL without one is shown as is.
    #[test]
    fn url_credentials_are_redacted() {
        let url = RedactedUrl::new("redis://user:p@ss@h:6379/0");
        assert_eq!(url.redacted(), "redis://(redacted)@h:6379/0");
        assert_eq!(format!("{url:?}"), "\"redis://(redacted)@h:6379/0\"");
        assert_eq!(
            serde_json::to_value(&url).expect("json"),
            "redis://(redacted)@h:6379/0"
        );
        assert_eq!(url.as_str(), "redis://user:p@ss@h:6379/0");
        // A '/' in a password, and a URL without a scheme (the NATS client takes one), are
        // redacted too; an '@' anywhere is taken for the end of user-info, hiding rather than
        // showing.
        assert_eq!(
            redact_url("redis://:ab/cd@h:6379"),
            "redis://(redacted)@h:6379"
        );
        assert_eq!(
            redact_url("posthorn:s3cret@nats:4222"),
            "(redacted)@nats:4222"
        );
        assert_eq!(redact_url("nats://h:4222"), "nats://h:4222");
        assert_eq!(redact_url("not a url"), "not a url");
        assert!(refuse_placeholder("redis.url", "redis://(redacted)@h:6379").is_err());
        assert!(refuse_placeholder("redis.url", "redis://u:p@h:6379").is_ok());
    }
}
