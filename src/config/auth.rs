//! `[auth]`: how clients authenticate: not at all, or with a JWT checked against a shared
//! secret (HS256), a public key file (RS256/ES256) and/or the key set of an identity provider
//! (JWKS, keys chosen by `kid`); how long a token outlives its `exp` (`leeway`), the issuer and
//! audience it must name, and how long revocations are kept.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::raw::RawAuth;
use super::secret::Secret;
use super::value::{duration, optional_path, serialize_duration, serialize_optional_path};

/// Longest `auth.leeway`: a token that ended five minutes ago is no token.
pub const MAX_LEEWAY: Duration = Duration::from_secs(300);
/// Shortest `auth.jwks_refresh`: the provider is asked at most this often on schedule (and at
/// most once per 10 s for an unknown `kid`).
pub const MIN_JWKS_REFRESH: Duration = Duration::from_secs(10);

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
    /// The identity provider's key set (`https://`, or `http://` to a loopback host); "" = none.
    pub jwks_url: String,
    /// Certificate authorities for `jwks_url`, in PEM; the system's when unset.
    #[serde(serialize_with = "serialize_optional_path")]
    pub jwks_ca_file: Option<PathBuf>,
    #[serde(serialize_with = "serialize_duration")]
    pub jwks_refresh: Duration,
    /// `iss` a token must carry; "" = not checked.
    pub issuer: String,
    /// An `aud` a token must carry; "" = not checked.
    pub audience: String,
    /// How long past its `exp` a token is still taken, and an open stream kept.
    #[serde(serialize_with = "serialize_duration")]
    pub leeway: Duration,
    #[serde(serialize_with = "serialize_duration")]
    pub revocation_retention: Duration,
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
        let jwks_url = raw.jwks_url.trim().to_owned();
        if !jwks_url.is_empty() {
            check_jwks_url(&jwks_url)?;
        }
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
            if set.len() > 1 || (set.is_empty() && jwks_url.is_empty()) {
                let got = if set.is_empty() {
                    "none".to_string()
                } else {
                    set.join(" and ")
                };
                return Err(invalid(
                    "auth.jwt_secret",
                    format!(
                        "with auth.mode jwt, set auth.jwks_url or one of auth.jwt_secret, auth.jwt_secret_file and auth.jwt_public_key_file, or both auth.jwks_url and one of them (got {got})"
                    ),
                ));
            }
        }
        let leeway = duration("auth.leeway", &raw.leeway)?;
        if leeway > MAX_LEEWAY {
            return Err(invalid(
                "auth.leeway",
                format!("must be at most 300s (got {})", raw.leeway),
            ));
        }
        let jwks_refresh = duration("auth.jwks_refresh", &raw.jwks_refresh)?;
        if jwks_refresh < MIN_JWKS_REFRESH {
            return Err(invalid(
                "auth.jwks_refresh",
                format!("must be at least 10s (got {})", raw.jwks_refresh),
            ));
        }
        let revocation_retention =
            duration("auth.revocation_retention", &raw.revocation_retention)?;
        if revocation_retention < Duration::from_secs(60) {
            return Err(invalid(
                "auth.revocation_retention",
                format!("must be at least 1m (got {})", raw.revocation_retention),
            ));
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
            jwks_url,
            jwks_ca_file: optional_path(raw.jwks_ca_file),
            jwks_refresh,
            issuer: raw.issuer.trim().to_owned(),
            audience: raw.audience.trim().to_owned(),
            leeway,
            revocation_retention,
        })
    }
}

impl AuthConfig {
    /// Whether a static key (secret or public key file) is configured, beside or instead of a
    /// JWKS.
    pub fn has_static_key(&self) -> bool {
        !self.jwt_secret.is_empty() || self.jwt_public_key_file.is_some()
    }
}

/// A key set is fetched over https; plain http only from this machine, where nobody on the
/// path can swap the keys.
fn check_jwks_url(url: &str) -> Result<(), ConfigError> {
    let bad = |why: &str| invalid("auth.jwks_url", format!("{why} (got {url:?})"));
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| bad("must be an https:// URL"))?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => host,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || authority.contains('@') {
        return Err(bad("must name a host (and no user name)"));
    }
    match scheme {
        "https" => Ok(()),
        "http" if is_loopback_host(host) => Ok(()),
        "http" => Err(bad(
            "must be https:// (plain http:// only to a loopback host)",
        )),
        _ => Err(bad("must be an https:// URL")),
    }
}

fn is_loopback_host(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|address| address.is_loopback())
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
            ..RawAuth::default()
        }
    }

    fn auth(mode: &str, secret: &str, key_file: &str) -> Result<AuthConfig, String> {
        AuthConfig::try_from(raw(mode, secret, "", key_file)).map_err(|error| error.to_string())
    }

    /// jwt mode needs one of secret, secret file and public key file (or a JWKS URL), never two,
    /// and the error never shows the secret.
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

    /// A JWKS URL alone is enough for jwt mode, and may stand beside one static key; it is
    /// https, or http to a loopback host only. The leeway is at most 300 s, the refresh at
    /// least 10 s, the revocation retention at least a minute: each error names its key.
    #[test]
    fn jwks_leeway_and_retention_are_checked() {
        let with = |jwks_url: &str, secret: &str| {
            AuthConfig::try_from(RawAuth {
                jwks_url: jwks_url.into(),
                ..raw("jwt", secret, "", "")
            })
            .map_err(|error| error.to_string())
        };
        let c = with("https://idp.example/keys", "").expect("jwks alone");
        assert_eq!(c.jwks_url, "https://idp.example/keys");
        assert!(!c.has_static_key());
        assert!(with("https://idp.example/keys", "s3cret")
            .expect("beside a secret")
            .has_static_key());
        for loopback in [
            "http://127.0.0.1:8081/jwks",
            "http://localhost/jwks",
            "http://[::1]:9/k",
        ] {
            assert!(with(loopback, "").is_ok(), "{loopback}");
        }
        for bad in [
            "http://idp.example/keys",
            "ftp://idp.example/keys",
            "idp.example/keys",
            "https://",
            "https://user@idp.example/",
        ] {
            let error = with(bad, "").expect_err(bad);
            assert!(error.starts_with("auth.jwks_url: "), "{error}");
        }
        let field = |set: fn(&mut RawAuth), key: &str| {
            let mut raw = raw("jwt", "s3cret", "", "");
            set(&mut raw);
            let error = AuthConfig::try_from(raw).expect_err(key).to_string();
            assert!(error.starts_with(&format!("{key}: ")), "{error}");
        };
        field(|raw| raw.leeway = "301s".into(), "auth.leeway");
        field(|raw| raw.leeway = "soon".into(), "auth.leeway");
        field(|raw| raw.jwks_refresh = "9s".into(), "auth.jwks_refresh");
        field(
            |raw| raw.revocation_retention = "59s".into(),
            "auth.revocation_retention",
        );
        let c = auth("jwt", "s3cret", "").expect("defaults");
        assert_eq!(c.leeway, Duration::from_secs(30));
        assert_eq!(c.jwks_refresh, Duration::from_secs(300));
        assert_eq!(c.revocation_retention, Duration::from_secs(30 * 86_400));
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
                "jwks_url": "",
                "jwks_ca_file": "",
                "jwks_refresh": "5m",
                "issuer": "",
                "audience": "",
                "leeway": "30s",
                "revocation_retention": "30d",
            })
        );
        let c = auth("jwt", "", "/etc/k.pem").expect("valid");
        assert_eq!(
            serde_json::to_value(&c).expect("json")["jwt_public_key_file"],
            "/etc/k.pem"
        );
    }
}
