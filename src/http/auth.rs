//! Authentication at the HTTP edge (docs/http-api.md, `auth.mode = "jwt"`; docs/security.md).
//!
//! A token comes as `Authorization: Bearer <jwt>` or `?token=<jwt>` (browsers' EventSource cannot
//! set headers). It is verified with the key its `kid` names in the identity provider's key set
//! (`auth.jwks_url`, [`KeySet`]), or with the static key (HS256 secret, RS256/ES256 public key
//! file) when it names no `kid` the set holds. `exp` is required (`auth.leeway` of slack);
//! `iss` and `aud` are checked when `auth.issuer` / `auth.audience` are set. A token of a device
//! that a revocation covers is refused ([`Revoked`]). Streams need `sub` = the device;
//! publishing needs the `publish` scope, `/admin/*` the `admin` scope (`scope` is a
//! space-separated string or an array). Missing, invalid, expired or revoked → 401; valid but
//! not allowed → 403; each refusal is counted by reason (`auth_rejections_total`). Tokens are
//! never logged: the hub logs no request lines or query strings.

use std::sync::Arc;

use actix_web::HttpRequest;
use jsonwebtoken::{errors::ErrorKind, Algorithm, DecodingKey, Validation};
use serde::Deserialize;

use super::{
    browser::BrowserGuard,
    error::ApiError,
    jwks::{KeySet, VerifyingKey},
};
use crate::{
    backend::revocation::Revoked,
    config::{AuthConfig, AuthMode, ServerConfig},
    metrics::{AuthRejection, Metrics},
    model::{Credential, DeviceId, GroupName, Groups},
};

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
    iat: Option<u64>,
    exp: Option<u64>,
    /// The device's groups, read (and checked) only when a stream opens: any JSON here, so
    /// that a token whose issuer uses `groups` for something else still publishes or reads the
    /// fleet, and is refused as a stream token with a clear error instead of as a forgery.
    #[serde(default)]
    groups: serde_json::Value,
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

/// How tokens are verified with `auth.mode = "jwt"`.
struct Verifier {
    /// The secret or public key file, when one is configured.
    static_key: Option<VerifyingKey>,
    /// The identity provider's keys, when `auth.jwks_url` is set.
    key_set: Option<Arc<KeySet>>,
    leeway_s: u64,
    issuer: Option<String>,
    audience: Option<String>,
}

pub struct Authenticator {
    /// None with `auth.mode = "none"`.
    verifier: Option<Verifier>,
    /// What stands in for a token with `auth.mode = "none"`.
    browser: BrowserGuard,
    revoked: Arc<Revoked>,
    metrics: Arc<Metrics>,
}

/// The `groups` claim: absent (or null) is no group; otherwise a list of group names, each
/// checked. A token naming a group that cannot exist is a mistake of its issuer, said as such
/// (400), not taken for a forgery.
fn groups_of(claim: &serde_json::Value) -> Result<Groups, ApiError> {
    let names = match claim {
        serde_json::Value::Null => return Ok(Groups::default()),
        serde_json::Value::Array(names) => names,
        other => {
            return Err(ApiError::InvalidRequest(format!(
                "the token's groups claim must be a list of group names, not {other}"
            )))
        }
    };
    names
        .iter()
        .map(|name| {
            name.as_str()
                .ok_or_else(|| format!("{name} is not a text"))
                .and_then(|text| {
                    GroupName::parse(text).map_err(|error| format!("{text:?} {error}"))
                })
                .map_err(|error| {
                    ApiError::InvalidRequest(format!("the token's groups claim: {error}"))
                })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Groups::new)
}

/// A refusal: why (for the metric) and what the client is told.
struct Refusal(AuthRejection, ApiError);

fn unauthorized(reason: AuthRejection, message: impl Into<String>) -> Refusal {
    Refusal(reason, ApiError::Unauthorized(message.into()))
}

impl Authenticator {
    /// Loads the static key and fetches the key set once at start-up; the error names the
    /// configuration key at fault.
    pub async fn new(
        config: &AuthConfig,
        server: &ServerConfig,
        revoked: Arc<Revoked>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let browser = BrowserGuard::new(server);
        if config.mode == AuthMode::None {
            return Ok(Self {
                verifier: None,
                browser,
                revoked,
                metrics,
            });
        }
        super::signatures::install();
        let static_key = static_key(config)?;
        let key_set = KeySet::start(config, metrics.clone()).await?;
        Ok(Self {
            verifier: Some(Verifier {
                static_key,
                key_set,
                leeway_s: config.leeway.as_secs(),
                issuer: (!config.issuer.is_empty()).then(|| config.issuer.clone()),
                audience: (!config.audience.is_empty()).then(|| config.audience.clone()),
            }),
            browser,
            revoked,
            metrics,
        })
    }

    pub fn is_enabled(&self) -> bool {
        self.verifier.is_some()
    }

    /// The token's times when the request may do `access`. With auth off, only requests a
    /// browser could have sent for another site are refused (`browser.rs`; the caller applies
    /// the loopback rule for admin endpoints), and there are no times.
    pub async fn check(
        &self,
        request: &HttpRequest,
        access: Access<'_>,
    ) -> Result<Credential, ApiError> {
        let Some(verifier) = &self.verifier else {
            return self
                .browser
                .check(request, access)
                .map(|()| Credential::default());
        };
        self.verify(verifier, request, access)
            .await
            .map_err(|Refusal(reason, error)| {
                self.metrics.auth_rejected(reason);
                error
            })
    }

    async fn verify(
        &self,
        verifier: &Verifier,
        request: &HttpRequest,
        access: Access<'_>,
    ) -> Result<Credential, Refusal> {
        let token = bearer(request).ok_or_else(|| {
            unauthorized(
                AuthRejection::Missing,
                "a token is required: Authorization: Bearer <jwt> or ?token=<jwt>",
            )
        })?;
        let header = jsonwebtoken::decode_header(&token).map_err(|error| {
            unauthorized(AuthRejection::Malformed, format!("invalid token: {error}"))
        })?;
        let from_set = match (&header.kid, &verifier.key_set) {
            (Some(kid), Some(key_set)) => key_set.key(kid).await,
            _ => None,
        };
        let key: &VerifyingKey = match (&from_set, &verifier.static_key) {
            (Some(key), _) => key,
            // A `kid` the set does not hold still verifies with the static key (a token from
            // the hub's own `posthorn token` beside the provider's), when the algorithms agree.
            (None, Some(key)) if key.algorithm == header.alg => key,
            (None, _) => {
                return Err(match &header.kid {
                    Some(kid) => unauthorized(
                        AuthRejection::UnknownKid,
                        format!("invalid token: no key {kid:?} in the key set"),
                    ),
                    None => unauthorized(
                        AuthRejection::UnknownKid,
                        "invalid token: it names no kid, and no static key verifies it",
                    ),
                });
            }
        };
        let mut validation = Validation::new(key.algorithm);
        validation.leeway = verifier.leeway_s;
        let mut required = vec!["exp"];
        match &verifier.audience {
            Some(audience) => {
                validation.set_audience(&[audience]);
                required.push("aud");
            }
            None => validation.validate_aud = false,
        }
        if let Some(issuer) = &verifier.issuer {
            validation.set_issuer(&[issuer]);
            required.push("iss");
        }
        validation.set_required_spec_claims(&required);
        let claims = jsonwebtoken::decode::<Claims>(&token, &key.key, &validation)
            .map_err(|error| refusal_of(&error))?
            .claims;
        let mut credential = Credential {
            issued: claims.iat,
            expires: claims.exp,
            groups: Groups::default(),
        };
        if let Some(sub) = claims.sub.as_deref() {
            if self.revoked.refuses(sub, &credential) {
                return Err(Refusal(
                    AuthRejection::Revoked,
                    ApiError::TokenRevoked(format!(
                        "the tokens of {sub} issued until its revocation are refused: get a \
                         new one"
                    )),
                ));
            }
        }
        let allowed = match access {
            Access::Stream(device) | Access::Ack(device) => {
                claims.sub.as_deref() == Some(device.as_str())
            }
            Access::Publish => claims.scope.contains("publish"),
            Access::Admin => claims.scope.contains("admin"),
            Access::Fleet => claims.scope.contains("fleet"),
        };
        if allowed {
            // Checked last: a revoked token or another device's is refused as such first.
            if matches!(access, Access::Stream(_)) {
                credential.groups = groups_of(&claims.groups)
                    .map_err(|error| Refusal(AuthRejection::Malformed, error))?;
            }
            return Ok(credential);
        }
        Err(Refusal(
            AuthRejection::Forbidden,
            ApiError::Forbidden(match access {
                Access::Stream(device) | Access::Ack(device) => {
                    format!("the token is not for device {device}")
                }
                Access::Publish => "the token lacks the publish scope".into(),
                Access::Admin => "the token lacks the admin scope".into(),
                Access::Fleet => "the token lacks the fleet scope".into(),
            }),
        ))
    }
}

/// Reads the files `[auth]` names (the public key, the key set's CA file) as `serve` does,
/// keeping nothing; the error names the configuration key at fault.
pub fn check_files(config: &AuthConfig) -> Result<(), String> {
    if config.mode == AuthMode::None {
        return Ok(());
    }
    static_key(config)?;
    KeySet::check_files(config)
}

/// The secret or the public key file of `auth`, if one is set.
fn static_key(config: &AuthConfig) -> Result<Option<VerifyingKey>, String> {
    if let Some(path) = &config.jwt_public_key_file {
        let pem = std::fs::read(path).map_err(|error| {
            format!(
                "auth.jwt_public_key_file: cannot read {}: {error}",
                path.display()
            )
        })?;
        let key = if let Ok(key) = DecodingKey::from_rsa_pem(&pem) {
            VerifyingKey {
                key,
                algorithm: Algorithm::RS256,
            }
        } else if let Ok(key) = DecodingKey::from_ec_pem(&pem) {
            VerifyingKey {
                key,
                algorithm: Algorithm::ES256,
            }
        } else {
            return Err(format!(
                "auth.jwt_public_key_file: {} is neither an RSA nor an EC public key in PEM",
                path.display()
            ));
        };
        return Ok(Some(key));
    }
    if config.jwt_secret.is_empty() {
        return Ok(None);
    }
    Ok(Some(VerifyingKey {
        key: DecodingKey::from_secret(config.jwt_secret.expose().as_bytes())
            .map_err(|error| format!("auth.jwt_secret: {error}"))?,
        algorithm: Algorithm::HS256,
    }))
}

/// What a failed verification tells the client, by what failed; the message names the claim.
fn refusal_of(error: &jsonwebtoken::errors::Error) -> Refusal {
    let (reason, message) = match error.kind() {
        ErrorKind::ExpiredSignature => (AuthRejection::Expired, "the token has expired".into()),
        ErrorKind::InvalidIssuer => (
            AuthRejection::WrongIssuer,
            "the token's iss is not auth.issuer".into(),
        ),
        ErrorKind::InvalidAudience => (
            AuthRejection::WrongAudience,
            "the token's aud does not name auth.audience".into(),
        ),
        ErrorKind::MissingRequiredClaim(claim) if claim == "iss" => (
            AuthRejection::WrongIssuer,
            "the token has no iss (auth.issuer is set)".into(),
        ),
        ErrorKind::MissingRequiredClaim(claim) if claim == "aud" => (
            AuthRejection::WrongAudience,
            "the token has no aud (auth.audience is set)".into(),
        ),
        ErrorKind::InvalidSignature
        | ErrorKind::InvalidAlgorithm
        | ErrorKind::InvalidEcdsaKey
        | ErrorKind::InvalidEddsaKey
        | ErrorKind::InvalidRsaKey(_)
        | ErrorKind::InvalidKeyFormat => (
            AuthRejection::BadSignature,
            format!("invalid token: {error}"),
        ),
        _ => (AuthRejection::Malformed, format!("invalid token: {error}")),
    };
    unauthorized(reason, message)
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

    use futures_util::FutureExt;

    use super::*;
    use crate::config::Secret;

    const SECRET: &str = "a-test-secret-of-some-length";

    /// Without a key set nothing waits: a check is ready at once.
    trait CheckNow {
        fn check_now(&self, request: &HttpRequest, access: Access<'_>) -> Result<(), ApiError>;
    }

    impl CheckNow for Authenticator {
        fn check_now(&self, request: &HttpRequest, access: Access<'_>) -> Result<(), ApiError> {
            self.check(request, access)
                .now_or_never()
                .expect("no key set to wait for")
                .map(|_| ())
        }
    }

    fn authenticator(config: AuthConfig) -> Result<Authenticator, String> {
        Authenticator::new(
            &config,
            &crate::config::Config::default().server,
            Revoked::new(),
            Arc::new(Metrics::new(prometheus::Registry::new(), "memory")),
        )
        .now_or_never()
        .expect("no key set to fetch")
    }

    fn jwt() -> Authenticator {
        authenticator(AuthConfig {
            mode: AuthMode::Jwt,
            jwt_secret: Secret::new(SECRET),
            ..crate::config::Config::default().auth
        })
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
        let auth = authenticator(AuthConfig {
            mode: AuthMode::None,
            ..crate::config::Config::default().auth
        })
        .unwrap();
        assert!(!auth.is_enabled());
        let request = TestRequest::default().to_http_request();
        let pos = device("pos-1");
        for access in [Access::Stream(&pos), Access::Publish, Access::Admin] {
            assert!(auth.check_now(&request, access).is_ok(), "{access:?}");
        }
        let garbage = bearer_request("not-a-token");
        assert!(auth.check_now(&garbage, Access::Admin).is_ok());
    }

    #[test]
    fn a_missing_or_invalid_token_is_unauthorized() {
        let auth = jwt();
        assert!(auth.is_enabled());
        let pos = device("pos-1");
        let access = Access::Stream(&pos);
        let none = TestRequest::default().to_http_request();
        assert!(is_unauthorized(auth.check_now(&none, access)));
        assert!(is_unauthorized(
            auth.check_now(&bearer_request("not.a.token"), access)
        ));
        let basic = TestRequest::default()
            .insert_header(("Authorization", "Basic cG9zOnNlY3JldA=="))
            .to_http_request();
        assert!(is_unauthorized(auth.check_now(&basic, access)));
        let claims = json!({ "sub": "pos-1" });
        let other_key = token_with(claims.clone(), Header::default(), "another-secret");
        assert!(is_unauthorized(
            auth.check_now(&bearer_request(&other_key), access)
        ));
        // Signed with the right secret but another algorithm than the one configured.
        let hs384 = token_with(claims, Header::new(Algorithm::HS384), SECRET);
        assert!(is_unauthorized(
            auth.check_now(&bearer_request(&hs384), access)
        ));
    }

    #[test]
    fn exp_is_required_and_checked_with_30_s_of_leeway() {
        let auth = jwt();
        let pos = device("pos-1");
        let access = Access::Stream(&pos);
        let expired = token(json!({ "sub": "pos-1", "exp": now() - 120 }));
        assert!(is_unauthorized(
            auth.check_now(&bearer_request(&expired), access)
        ));
        let just_expired = token(json!({ "sub": "pos-1", "exp": now() - 10 }));
        assert!(auth
            .check_now(&bearer_request(&just_expired), access)
            .is_ok());
        let mut no_exp = json!({ "sub": "pos-1" });
        let no_exp = jsonwebtoken::encode(
            &Header::default(),
            &no_exp.take(),
            &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
        )
        .unwrap();
        assert!(is_unauthorized(
            auth.check_now(&bearer_request(&no_exp), access)
        ));
    }

    #[test]
    fn a_stream_needs_a_token_for_its_own_device() {
        let auth = jwt();
        let request = bearer_request(&token(json!({ "sub": "pos-1" })));
        assert!(auth
            .check_now(&request, Access::Stream(&device("pos-1")))
            .is_ok());
        assert!(is_forbidden(
            auth.check_now(&request, Access::Stream(&device("pos-2")))
        ));
        // A device token grants nothing else.
        assert!(is_forbidden(auth.check_now(&request, Access::Publish)));
        assert!(is_forbidden(auth.check_now(&request, Access::Admin)));
        // Nor does a scope-only token grant a stream.
        let publisher = bearer_request(&token(json!({ "scope": "publish admin" })));
        assert!(is_forbidden(
            auth.check_now(&publisher, Access::Stream(&device("pos-1")))
        ));
    }

    #[test]
    fn scopes_come_as_a_space_separated_string_or_an_array() {
        let auth = jwt();
        let allowed = |scope: Value| {
            let request = bearer_request(&token(json!({ "scope": scope })));
            (
                auth.check_now(&request, Access::Publish).is_ok(),
                auth.check_now(&request, Access::Admin).is_ok(),
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
        assert!(is_forbidden(auth.check_now(&without, Access::Publish)));
        assert!(is_forbidden(auth.check_now(&without, Access::Admin)));
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
            .check_now(&request, Access::Stream(&device("pos-1")))
            .is_ok());
        assert!(auth.check_now(&request, Access::Publish).is_ok());
        assert!(is_forbidden(auth.check_now(&request, Access::Admin)));

        let lowercase = TestRequest::default()
            .insert_header(("Authorization", format!("bearer  {device_token} ")))
            .to_http_request();
        assert!(auth.check_now(&lowercase, Access::Publish).is_ok());

        let header_wins = TestRequest::with_uri("/v1/events?token=garbage")
            .insert_header(("Authorization", format!("Bearer {device_token}")))
            .to_http_request();
        assert!(auth.check_now(&header_wins, Access::Publish).is_ok());
        let bad_header = TestRequest::with_uri(&format!("/v1/events?token={device_token}"))
            .insert_header(("Authorization", "Bearer garbage"))
            .to_http_request();
        assert!(is_unauthorized(
            auth.check_now(&bad_header, Access::Publish)
        ));
    }

    #[test]
    fn a_public_key_file_that_is_no_key_stops_start_up() {
        let config = |path: std::path::PathBuf| AuthConfig {
            mode: AuthMode::Jwt,
            jwt_public_key_file: Some(path),
            ..crate::config::Config::default().auth
        };
        let missing = std::env::temp_dir().join("posthorn-auth-test-no-such-key.pem");
        let error = authenticator(config(missing)).err().unwrap();
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
        let error = authenticator(config(path.clone())).err().unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(
            error.contains("neither an RSA nor an EC public key"),
            "{error}"
        );
    }

    /// `iss` and `aud` are checked when configured, each refusal naming the claim and counted
    /// under its reason; without the settings neither is looked at.
    #[test]
    fn issuer_and_audience_are_checked_when_set() {
        let auth = authenticator(AuthConfig {
            mode: AuthMode::Jwt,
            jwt_secret: Secret::new(SECRET),
            issuer: "https://idp.example/".into(),
            audience: "posthorn".into(),
            ..crate::config::Config::default().auth
        })
        .unwrap();
        let pos = device("pos-1");
        let check =
            |claims: Value| auth.check_now(&bearer_request(&token(claims)), Access::Stream(&pos));
        assert!(
            check(json!({ "sub": "pos-1", "iss": "https://idp.example/", "aud": "posthorn" }))
                .is_ok()
        );
        assert!(check(
            json!({ "sub": "pos-1", "iss": "https://idp.example/", "aud": ["a", "posthorn"] })
        )
        .is_ok());
        let message = |result: Result<(), ApiError>| match result {
            Err(ApiError::Unauthorized(message)) => message,
            other => panic!("not a 401: {other:?}"),
        };
        assert!(message(check(
            json!({ "sub": "pos-1", "iss": "https://evil/", "aud": "posthorn" })
        ))
        .contains("iss"));
        assert!(message(check(json!({ "sub": "pos-1", "aud": "posthorn" }))).contains("iss"));
        assert!(message(check(
            json!({ "sub": "pos-1", "iss": "https://idp.example/", "aud": "other" })
        ))
        .contains("aud"));
        assert!(message(check(
            json!({ "sub": "pos-1", "iss": "https://idp.example/" })
        ))
        .contains("aud"));
        let counted = |reason: &str| {
            auth.metrics
                .render()
                .lines()
                .find(|line| {
                    line.starts_with(&format!("auth_rejections_total{{reason=\"{reason}\"}}"))
                })
                .and_then(|line| line.rsplit(' ').next())
                .and_then(|value| value.parse::<u64>().ok())
        };
        assert_eq!(counted("wrong_issuer"), Some(2));
        assert_eq!(counted("wrong_audience"), Some(2));
        let plain = jwt();
        assert!(plain
            .check_now(
                &bearer_request(&token(json!({ "sub": "pos-1", "iss": "x", "aud": "y" }))),
                Access::Stream(&pos)
            )
            .is_ok());
    }

    /// A revocation refuses the device's tokens issued until its second (and those without
    /// `iat`) with `token_revoked`; a token issued later, or of another device, passes.
    #[test]
    fn a_revoked_devices_older_tokens_are_refused() {
        let auth = jwt();
        let at_ms = (now() as u64) * 1000;
        auth.revoked.note(&crate::backend::revocation::Revocation {
            device: device("pos-1"),
            at_ms,
        });
        let pos = device("pos-1");
        let check =
            |claims: Value| auth.check_now(&bearer_request(&token(claims)), Access::Stream(&pos));
        let revoked =
            |result: Result<(), ApiError>| matches!(result, Err(ApiError::TokenRevoked(_)));
        assert!(
            revoked(check(json!({ "sub": "pos-1" }))),
            "iat now: in the second"
        );
        assert!(revoked(check(json!({ "sub": "pos-1", "iat": now() - 60 }))));
        let mut no_iat = json!({ "sub": "pos-1", "exp": now() + 60 });
        let no_iat = jsonwebtoken::encode(
            &Header::default(),
            &no_iat.take(),
            &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
        )
        .unwrap();
        assert!(revoked(
            auth.check_now(&bearer_request(&no_iat), Access::Stream(&pos))
        ));
        assert!(check(json!({ "sub": "pos-1", "iat": now() + 1 })).is_ok());
        let other = device("pos-2");
        assert!(auth
            .check_now(
                &bearer_request(&token(json!({ "sub": "pos-2" }))),
                Access::Stream(&other)
            )
            .is_ok());
    }
}
