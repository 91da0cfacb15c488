//! `[auth]`: how clients authenticate: not at all, or with a JWT checked against a shared
//! secret (HS256) or a public key file (RS256/ES256).

use std::fmt;
use std::path::PathBuf;

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::raw::RawAuth;
use super::secret::Secret;
use super::value::{optional_path, serialize_optional_path};

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
    /// From `auth.jwt_secret`, or read from `auth.jwt_secret_file` at start-up.
    pub jwt_secret: Secret,
    #[serde(serialize_with = "serialize_optional_path")]
    pub jwt_secret_file: Option<PathBuf>,
    /// Shown as "" when unset, as it is written in the file.
    #[serde(serialize_with = "serialize_optional_path")]
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
        let jwt_secret_file = optional_path(raw.jwt_secret_file);
        let jwt_public_key_file = optional_path(raw.jwt_public_key_file);
        if mode == AuthMode::Jwt {
            // Never echo the secret itself; naming the keys that are set is enough.
            let set: Vec<&str> = [
                ("auth.jwt_secret", !raw.jwt_secret.is_empty()),
                ("auth.jwt_secret_file", jwt_secret_file.is_some()),
                ("auth.jwt_public_key_file", jwt_public_key_file.is_some()),
            ]
            .into_iter()
            .filter_map(|(key, is_set)| is_set.then_some(key))
            .collect();
            if set.len() != 1 {
                let got = if set.is_empty() {
                    "none".to_string()
                } else {
                    set.join(" and ")
                };
                return Err(invalid(
                    "auth.jwt_secret",
                    format!(
                        "exactly one of auth.jwt_secret, auth.jwt_secret_file and auth.jwt_public_key_file must be set when auth.mode is jwt (got {got})"
                    ),
                ));
            }
        }
        let jwt_secret = match (&jwt_secret_file, mode) {
            (Some(path), AuthMode::Jwt) => Secret::from_file("auth.jwt_secret_file", path)?,
            _ => Secret::new(raw.jwt_secret),
        };
        Ok(AuthConfig {
            mode,
            jwt_secret,
            jwt_secret_file,
            jwt_public_key_file,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(mode: &str, secret: &str, secret_file: &str, key_file: &str) -> RawAuth {
        RawAuth {
            mode: mode.into(),
            jwt_secret: secret.into(),
            jwt_secret_file: secret_file.into(),
            jwt_public_key_file: key_file.into(),
        }
    }

    fn auth(mode: &str, secret: &str, key_file: &str) -> Result<AuthConfig, String> {
        AuthConfig::try_from(raw(mode, secret, "", key_file)).map_err(|error| error.to_string())
    }

    /// jwt mode needs exactly one of secret, secret file and public key file, and the error never
    /// shows the secret.
    #[test]
    fn jwt_needs_one_credential() {
        let error = auth("jwt", "", "").expect_err("neither");
        assert!(error.starts_with("auth.jwt_secret: "), "{error}");
        assert!(error.ends_with("(got none)"), "{error}");
        let error = auth("jwt", "s3cret", "/k.pem").expect_err("both");
        assert!(error.starts_with("auth.jwt_secret: "), "{error}");
        assert!(
            error.ends_with("(got auth.jwt_secret and auth.jwt_public_key_file)"),
            "{error}"
        );
        assert!(!error.contains("s3cret"), "{error}");
        let error = AuthConfig::try_from(raw("jwt", "s3cret", "/s", ""))
            .expect_err("secret twice")
            .to_string();
        assert!(
            error.ends_with("(got auth.jwt_secret and auth.jwt_secret_file)"),
            "{error}"
        );
        let c = auth("jwt", "", "/k.pem").expect("valid");
        assert_eq!(c.mode, AuthMode::Jwt);
        assert_eq!(c.jwt_public_key_file, Some(PathBuf::from("/k.pem")));
        assert!(auth("none", "s3cret", "/k.pem").is_ok());
        let error = auth("basic", "", "").expect_err("unknown mode");
        assert_eq!(error, "auth.mode: must be one of none, jwt (got \"basic\")");
    }

    /// The secret file is read at load, without its final line break; a missing or empty file
    /// stops start-up naming the key.
    #[test]
    fn secret_from_a_file() {
        let dir = std::env::temp_dir().join(format!("posthorn-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("jwt-secret");
        std::fs::write(&file, "from-a-file\n").unwrap();
        let c = AuthConfig::try_from(raw("jwt", "", file.to_str().unwrap(), "")).expect("valid");
        assert_eq!(c.jwt_secret.expose(), "from-a-file");
        let shown = serde_json::to_value(&c).expect("json");
        assert_eq!(shown["jwt_secret"], "(set)");
        assert_eq!(shown["jwt_secret_file"], file.to_str().unwrap());

        std::fs::write(&file, "\n").unwrap();
        let error = AuthConfig::try_from(raw("jwt", "", file.to_str().unwrap(), ""))
            .expect_err("empty")
            .to_string();
        assert!(
            error.starts_with("auth.jwt_secret_file: ") && error.ends_with("is empty"),
            "{error}"
        );
        let missing = dir.join("missing");
        let error = AuthConfig::try_from(raw("jwt", "", missing.to_str().unwrap(), ""))
            .expect_err("missing")
            .to_string();
        assert!(
            error.starts_with("auth.jwt_secret_file: cannot read ") && error.contains("missing"),
            "{error}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The section shows the mode, whether the secret is set, and the files or "".
    #[test]
    fn shown_without_the_secret() {
        let c = auth("jwt", "s3cret", "").expect("valid");
        assert!(!format!("{c:?}").contains("s3cret"));
        assert_eq!(
            serde_json::to_value(&c).expect("json"),
            serde_json::json!({
                "mode": "jwt",
                "jwt_secret": "(set)",
                "jwt_secret_file": "",
                "jwt_public_key_file": "",
            })
        );
        let c = auth("jwt", "", "/etc/k.pem").expect("valid");
        assert_eq!(
            serde_json::to_value(&c).expect("json")["jwt_public_key_file"],
            "/etc/k.pem"
        );
    }
}
