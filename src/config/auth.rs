//! `[auth]`: how clients authenticate: not at all, or with a JWT checked against a shared
//! secret (HS256) or a public key file (RS256/ES256).

use std::fmt;
use std::path::PathBuf;

use serde::{Serialize, Serializer};

use super::error::{invalid, ConfigError};
use super::raw::RawAuth;
use super::secret::Secret;

/// How clients authenticate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
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

/// `Debug` and `Serialize` show the secret only as "(set)" or "(empty)" (see [`Secret`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AuthConfig {
    pub mode: AuthMode,
    pub jwt_secret: Secret,
    /// Shown as "" when unset, as it is written in the file.
    #[serde(serialize_with = "path_or_empty")]
    pub jwt_public_key_file: Option<PathBuf>,
}

impl TryFrom<RawAuth> for AuthConfig {
    type Error = ConfigError;

    fn try_from(raw: RawAuth) -> Result<Self, ConfigError> {
        let mode = match raw.mode.as_str() {
            "none" => AuthMode::None,
            "jwt" => AuthMode::Jwt,
            other => {
                return Err(invalid(
                    "auth.mode",
                    format!("must be one of none, jwt (got {other:?})"),
                ))
            }
        };
        let auth = AuthConfig {
            mode,
            jwt_secret: Secret::new(raw.jwt_secret),
            jwt_public_key_file: (!raw.jwt_public_key_file.is_empty())
                .then(|| PathBuf::from(raw.jwt_public_key_file)),
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
        Ok(auth)
    }
}

fn path_or_empty<S: Serializer>(path: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
    match path {
        Some(path) => s.collect_str(&path.display()),
        None => s.serialize_str(""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(mode: &str, secret: &str, key_file: &str) -> Result<AuthConfig, String> {
        AuthConfig::try_from(RawAuth {
            mode: mode.into(),
            jwt_secret: secret.into(),
            jwt_public_key_file: key_file.into(),
        })
        .map_err(|error| error.to_string())
    }

    /// jwt mode needs exactly one of secret and public key file, and the error never shows the
    /// secret.
    #[test]
    fn jwt_needs_one_credential() {
        let error = auth("jwt", "", "").expect_err("neither");
        assert!(error.starts_with("auth.jwt_secret: "), "{error}");
        assert!(error.ends_with("(got neither)"), "{error}");
        let error = auth("jwt", "s3cret", "/k.pem").expect_err("both");
        assert!(error.starts_with("auth.jwt_secret: "), "{error}");
        assert!(!error.contains("s3cret"), "{error}");
        let c = auth("jwt", "", "/k.pem").expect("valid");
        assert_eq!(c.mode, AuthMode::Jwt);
        assert_eq!(c.jwt_public_key_file, Some(PathBuf::from("/k.pem")));
        assert!(auth("none", "s3cret", "/k.pem").is_ok());
        let error = auth("basic", "", "").expect_err("unknown mode");
        assert_eq!(error, "auth.mode: must be one of none, jwt (got \"basic\")");
    }

    /// The section shows the mode, whether the secret is set, and the key file or "".
    #[test]
    fn shown_without_the_secret() {
        let c = auth("jwt", "s3cret", "").expect("valid");
        assert!(!format!("{c:?}").contains("s3cret"));
        assert_eq!(
            serde_json::to_value(&c).expect("json"),
            serde_json::json!({ "mode": "jwt", "jwt_secret": "(set)", "jwt_public_key_file": "" })
        );
        let c = auth("jwt", "", "/etc/k.pem").expect("valid");
        assert_eq!(
            serde_json::to_value(&c).expect("json")["jwt_public_key_file"],
            "/etc/k.pem"
        );
    }
}
