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

use super::error::ApiError;
use crate::{
    config::{AuthConfig, AuthMode},
    model::DeviceId,
};

const LEEWAY_SECONDS: u64 = 30;

/// What a request wants to do.
#[derive(Debug, Clone, Copy)]
pub enum Access<'a> {
    Stream(&'a DeviceId),
    Publish,
    Admin,
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
}

impl Authenticator {
    /// Loads the key once at start-up; the error names the configuration key at fault.
    pub fn new(config: &AuthConfig) -> Result<Self, String> {
        if config.mode == AuthMode::None {
            return Ok(Self { verifier: None });
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
        })
    }

    pub fn is_enabled(&self) -> bool {
        self.verifier.is_some()
    }

    /// Ok when the request may do `access`; always Ok when auth is off (the caller applies the
    /// loopback rule for admin endpoints then).
    pub fn check(&self, request: &HttpRequest, access: Access<'_>) -> Result<(), ApiError> {
        let Some((key, validation)) = &self.verifier else {
            return Ok(());
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
            Access::Stream(device) => claims.sub.as_deref() == Some(device.as_str()),
            Access::Publish => claims.scope.contains("publish"),
            Access::Admin => claims.scope.contains("admin"),
        };
        if allowed {
            return Ok(());
        }
        Err(ApiError::Forbidden(match access {
            Access::Stream(device) => format!("the token is not for device {device}"),
            Access::Publish => "the token lacks the publish scope".into(),
            Access::Admin => "the token lacks the admin scope".into(),
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
