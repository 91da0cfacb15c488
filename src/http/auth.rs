//! Authentication at the HTTP edge (docs/http-api.md, `auth.mode = "jwt"`).
//!
//! A token comes as `Authorization: Bearer <jwt>` or `?token=<jwt>` (browsers' EventSource cannot
//! set headers). It is verified with the HS256 secret or the RS256/ES256 public key, `exp` is
//! required (30 s leeway). Streams need `sub` = the device; publishing needs the `publish` scope
//! and `/admin/*` the `admin` scope (`scope` is a space-separated string or an array). Missing,
//! invalid or expired → 401; valid but not allowed → 403. Tokens are never logged: the hub logs
//! no request lines or query strings.

use actix_web::HttpRequest;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

use super::{browser::BrowserGuard, error::ApiError};
use crate::{
    config::{AuthConfig, AuthMode, ServerConfig},
    model::DeviceId,
};

const LEEWAY_SECONDS: u64 = 30;

/// What a request wants to do.
#[derive(Debug, Clone, Copy)]
pub enum Access<'a> {
    Stream(&'a DeviceId),
    Publish,
    Admin,
    /// The fleet API's reads (presence, fleet events, the not-acknowledged query).
    Fleet,
    /// A device acknowledging what it processed: its own token, as for its stream.
    Ack(&'a DeviceId),
}

#[derive(Debug, Deserialize)]
struct Claims {
    sub: Option<String>,
    #[serde(default)]
    scope: Scope,
}

#[derive(Debug, Default, Deserialize)]
#[serde(untagged)]
enum Scope {
    #[default]
    Missing,
    Text(String),
    List(Vec<String>),
}

impl Scope {
    fn contains(&self, wanted: &str) -> bool {
        match self {
            Scope::Missing => false,
            Scope::Text(text) => text.split_whitespace().any(|scope| scope == wanted),
            Scope::List(list) => list.iter().any(|scope| scope == wanted),
        }
    }
}

pub struct Authenticator {
    /// None with `auth.mode = "none"`.
    verifier: Option<(DecodingKey, Validation)>,
    /// What stands in for a token with `auth.mode = "none"`.
    browser: BrowserGuard,
}

impl Authenticator {
    /// Loads the key once at start-up; the error names the configuration key at fault.
    pub fn new(config: &AuthConfig, server: &ServerConfig) -> Result<Self, String> {
        let browser = BrowserGuard::new(server);
        if config.mode == AuthMode::None {
            return Ok(Self {
                verifier: None,
                browser,
            });
        }
        let (key, algorithm) = match &config.jwt_public_key_file {
            Some(path) => {
                let pem = std::fs::read(path).map_err(|error| {
                    format!(
                        "auth.jwt_public_key_file: cannot read {}: {error}",
                        path.display()
                    )
                })?;
                if let Ok(key) = DecodingKey::from_rsa_pem(&pem) {
                    (key, Algorithm::RS256)
                } else if let Ok(key) = DecodingKey::from_ec_pem(&pem) {
                    (key, Algorithm::ES256)
                } else {
                    return Err(format!("auth.jwt_public_key_file: {} is neither an RSA nor an EC public key in PEM", path.display()));
                }
            }
            None => (
                DecodingKey::from_secret(config.jwt_secret.expose().as_bytes())
                    .map_err(|error| format!("auth.jwt_secret: {error}"))?,
                Algorithm::HS256,
            ),
        };
        let mut validation = Validation::new(algorithm);
        validation.leeway = LEEWAY_SECONDS;
        validation.validate_aud = false;
        Ok(Self {
            verifier: Some((key, validation)),
            browser,
        })
    }

    pub fn is_enabled(&self) -> bool {
        self.verifier.is_some()
    }

    /// Ok when the request may do `access`. With auth off, only requests a browser could have
    /// sent for another site are refused (`browser.rs`; the caller applies the loopback rule for
    /// admin endpoints).
    pub fn check(&self, request: &HttpRequest, access: Access<'_>) -> Result<(), ApiError> {
        let Some((key, validation)) = &self.verifier else {
            return self.browser.check(request, access);
        };
        let token = bearer(request).ok_or_else(|| {
            ApiError::Unauthorized(
                "a token is required: Authorization: Bearer <jwt> or ?token=<jwt>".into(),
            )
        })?;
        let claims = jsonwebtoken::decode::<Claims>(&token, key, validation)
            .map_err(|error| ApiError::Unauthorized(format!("invalid token: {error}")))?
            .claims;
        let allowed = match access {
            Access::Stream(device) | Access::Ack(device) => {
                claims.sub.as_deref() == Some(device.as_str())
            }
            Access::Publish => claims.scope.contains("publish"),
            Access::Admin => claims.scope.contains("admin"),
            Access::Fleet => claims.scope.contains("fleet"),
        };
        if allowed {
            return Ok(());
        }
        Err(ApiError::Forbidden(match access {
            Access::Stream(device) | Access::Ack(device) => {
                format!("the token is not for device {device}")
            }
            Access::Publish => "the token lacks the publish scope".into(),
            Access::Admin => "the token lacks the admin scope".into(),
            Access::Fleet => "the token lacks the fleet scope".into(),
        }))
    }
}

fn bearer(request: &HttpRequest) -> Option<String> {
    if let Some(value) = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
    {
        let (scheme, token) = value.trim().split_once(' ')?;
        return scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| token.trim().to_string());
    }
    #[derive(Deserialize)]
    struct TokenQuery {
        token: Option<String>,
    }
    actix_web::web::Query::<TokenQuery>::from_query(request.query_string())
        .ok()?
        .into_inner()
        .token
}

#[cfg(test)]
mod tests {
    use std::time::{SystemTime, UNIX_EPOCH};

    use actix_web::test::TestRequest;
    use jsonwebtoken::{EncodingKey, Header};
    use serde_json::{json, Value};

    use super::*;
    use crate::config::Secret;

    const SECRET: &str = "a-test-secret-of-some-length";

    fn jwt() -> Authenticator {
        Authenticator::new(
            &AuthConfig {
                mode: AuthMode::Jwt,
                jwt_secret: Secret::new(SECRET),
                jwt_secret_file: None,
                jwt_public_key_file: None,
            },
            &crate::config::Config::default().server,
        )
        .unwrap()
    }

    fn now() -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    }

    /// A token as `posthorn token` mints it: HS256, `iat`, `exp`, and the given claims.
    fn token_with(claims: Value, header: Header, secret: &str) -> String {
        let mut all = json!({ "iat": now(), "exp": now() + 3600 });
        all.as_object_mut()
            .unwrap()
            .extend(claims.as_object().unwrap().clone());
        jsonwebtoken::encode(
            &header,
            &all,
            &EncodingKey::from_secret(secret.as_bytes()).unwrap(),
        )
        .unwrap()
    }

    fn token(claims: Value) -> String {
        token_with(claims, Header::default(), SECRET)
    }

    fn bearer_request(token: &str) -> actix_web::HttpRequest {
        TestRequest::default()
            .insert_header(("Authorization", format!("Bearer {token}")))
            .to_http_request()
    }

    fn device(id: &str) -> DeviceId {
        DeviceId::parse(id).unwrap()
    }

    fn is_unauthorized(result: Result<(), ApiError>) -> bool {
        matches!(result, Err(ApiError::Unauthorized(_)))
    }

    fn is_forbidden(result: Result<(), ApiError>) -> bool {
        matches!(result, Err(ApiError::Forbidden(_)))
    }

    /// With auth `none` no token is needed, and a garbage one is ignored (what a browser may send
    /// instead is checked in `browser.rs`).
    #[test]
    fn mode_none_needs_no_token() {
        let auth = Authenticator::new(
            &AuthConfig {
                mode: AuthMode::None,
                jwt_secret: Secret::default(),
                jwt_secret_file: None,
                jwt_public_key_file: None,
            },
            &crate::config::Config::default().server,
        )
        .unwrap();
        assert!(!auth.is_enabled());
        let request = TestRequest::default().to_http_request();
        let pos = device("pos-1");
        for access in [Access::Stream(&pos), Access::Publish, Access::Admin] {
            assert!(auth.check(&request, access).is_ok(), "{access:?}");
        }
        let garbage = bearer_request("not-a-token");
        assert!(auth.check(&garbage, Access::Admin).is_ok());
    }

    #[test]
    fn a_missing_or_invalid_token_is_unauthorized() {
        let auth = jwt();
        assert!(auth.is_enabled());
        let pos = device("pos-1");
        let access = Access::Stream(&pos);
        let none = TestRequest::default().to_http_request();
        assert!(is_unauthorized(auth.check(&none, access)));
        assert!(is_unauthorized(
            auth.check(&bearer_request("not.a.token"), access)
        ));
        let basic = TestRequest::default()
            .insert_header(("Authorization", "Basic cG9zOnNlY3JldA=="))
            .to_http_request();
        assert!(is_unauthorized(auth.check(&basic, access)));
        let claims = json!({ "sub": "pos-1" });
        let other_key = token_with(claims.clone(), Header::default(), "another-secret");
        assert!(is_unauthorized(
            auth.check(&bearer_request(&other_key), access)
        ));
        // Signed with the right secret but another algorithm than the one configured.
        let hs384 = token_with(claims, Header::new(Algorithm::HS384), SECRET);
        assert!(is_unauthorized(auth.check(&bearer_request(&hs384), access)));
    }

    #[test]
    fn exp_is_required_and_checked_with_30_s_of_leeway() {
        let auth = jwt();
        let pos = device("pos-1");
        let access = Access::Stream(&pos);
        let expired = token(json!({ "sub": "pos-1", "exp": now() - 120 }));
        assert!(is_unauthorized(
            auth.check(&bearer_request(&expired), access)
        ));
        let just_expired = token(json!({ "sub": "pos-1", "exp": now() - 10 }));
        assert!(auth.check(&bearer_request(&just_expired), access).is_ok());
        let mut no_exp = json!({ "sub": "pos-1" });
        let no_exp = jsonwebtoken::encode(
            &Header::default(),
            &no_exp.take(),
            &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
        )
        .unwrap();
        assert!(is_unauthorized(
            auth.check(&bearer_request(&no_exp), access)
        ));
    }

    #[test]
    fn a_stream_needs_a_token_for_its_own_device() {
        let auth = jwt();
        let request = bearer_request(&token(json!({ "sub": "pos-1" })));
        assert!(auth
            .check(&request, Access::Stream(&device("pos-1")))
            .is_ok());
        assert!(is_forbidden(
            auth.check(&request, Access::Stream(&device("pos-2")))
        ));
        // A device token grants nothing else.
        assert!(is_forbidden(auth.check(&request, Access::Publish)));
        assert!(is_forbidden(auth.check(&request, Access::Admin)));
        // Nor does a scope-only token grant a stream.
        let publisher = bearer_request(&token(json!({ "scope": "publish admin" })));
        assert!(is_forbidden(
            auth.check(&publisher, Access::Stream(&device("pos-1")))
        ));
    }

    #[test]
    fn scopes_come_as_a_space_separated_string_or_an_array() {
        let auth = jwt();
        let allowed = |scope: Value| {
            let request = bearer_request(&token(json!({ "scope": scope })));
            (
                auth.check(&request, Access::Publish).is_ok(),
                auth.check(&request, Access::Admin).is_ok(),
            )
        };
        assert_eq!(allowed(json!("publish")), (true, false));
        assert_eq!(allowed(json!("admin")), (false, true));
        assert_eq!(allowed(json!("read  publish\tadmin")), (true, true));
        assert_eq!(allowed(json!(["admin"])), (false, true));
        assert_eq!(allowed(json!(["publish", "admin"])), (true, true));
        // Whole words only.
        assert_eq!(allowed(json!("publisher administrator")), (false, false));
        assert_eq!(allowed(json!(["publish admin"])), (false, false));
        assert_eq!(allowed(json!("")), (false, false));
        let without = bearer_request(&token(json!({})));
        assert!(is_forbidden(auth.check(&without, Access::Publish)));
        assert!(is_forbidden(auth.check(&without, Access::Admin)));
    }

    /// `?token=` exists for EventSource, which cannot set headers; the code accepts it for every
    /// kind of access. A header, when present, is the one used.
    #[test]
    fn the_token_may_come_in_the_query_string() {
        let auth = jwt();
        let device_token = token(json!({ "sub": "pos-1", "scope": "publish" }));
        let request =
            TestRequest::with_uri(&format!("/v1/devices/pos-1/events?token={device_token}"))
                .to_http_request();
        assert!(auth
            .check(&request, Access::Stream(&device("pos-1")))
            .is_ok());
        assert!(auth.check(&request, Access::Publish).is_ok());
        assert!(is_forbidden(auth.check(&request, Access::Admin)));

        let lowercase = TestRequest::default()
            .insert_header(("Authorization", format!("bearer  {device_token} ")))
            .to_http_request();
        assert!(auth.check(&lowercase, Access::Publish).is_ok());

        let header_wins = TestRequest::with_uri("/v1/events?token=garbage")
            .insert_header(("Authorization", format!("Bearer {device_token}")))
            .to_http_request();
        assert!(auth.check(&header_wins, Access::Publish).is_ok());
        let bad_header = TestRequest::with_uri(&format!("/v1/events?token={device_token}"))
            .insert_header(("Authorization", "Bearer garbage"))
            .to_http_request();
        assert!(is_unauthorized(auth.check(&bad_header, Access::Publish)));
    }

    #[test]
    fn a_public_key_file_that_is_no_key_stops_start_up() {
        let config = |path: std::path::PathBuf| AuthConfig {
            mode: AuthMode::Jwt,
            jwt_secret: Secret::default(),
            jwt_secret_file: None,
            jwt_public_key_file: Some(path),
        };
        let missing = std::env::temp_dir().join("posthorn-auth-test-no-such-key.pem");
        let error = Authenticator::new(&config(missing), &crate::config::Config::default().server)
            .err()
            .unwrap();
        assert!(
            error.starts_with("auth.jwt_public_key_file: cannot read"),
            "{error}"
        );

        let path = std::env::temp_dir().join(format!(
            "posthorn-auth-test-{}-not-a-key.pem",
            std::process::id()
        ));
        std::fs::write(
            &path,
            "-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n",
        )
        .unwrap();
        let error = Authenticator::new(
            &config(path.clone()),
            &crate::config::Config::default().server,
        )
        .err()
        .unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(
            error.contains("neither an RSA nor an EC public key"),
            "{error}"
        );
    }
}
