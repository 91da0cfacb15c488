//! Tokens for a hub with jwt auth: one per device (`sub` = the device), and one with the
//! `publish` scope for the tool's own publishes, all made before the run so that signing (RSA
//! takes about a millisecond a token) never counts against the server. Signed with an HS256
//! secret (`--token-secret`) or a private key in PEM (`--token-key`: RSA for RS256, EC P-256 for
//! ES256, Ed25519 for EdDSA), naming `--token-kid` when given, as an identity provider's tokens
//! do for a hub with `auth.jwks_url`.

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::json;

use super::LoadtestError;

#[derive(Debug, Clone, Default, clap::Args)]
pub struct TokenArgs {
    /// Sign the clients' tokens with this HS256 secret (the hub's `auth.jwt_secret`).
    #[arg(long, conflicts_with = "token_key")]
    pub token_secret: Option<String>,
    /// Sign the clients' tokens with this private key in PEM (RSA: RS256, EC P-256: ES256,
    /// Ed25519: EdDSA), e.g. one whose public half the hub reads from `auth.jwks_url`.
    #[arg(long, value_name = "FILE")]
    pub token_key: Option<PathBuf>,
    /// The `kid` the tokens name.
    #[arg(long)]
    pub token_kid: Option<String>,
    /// Lifetime of the tokens.
    #[arg(long, default_value = "1h", value_parser = super::parse_duration)]
    pub token_ttl: Duration,
}

/// The tokens of a run: `Authorization` header values.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    /// Per device index.
    devices: Arc<Vec<String>>,
    publish: Option<Arc<str>>,
}

impl Tokens {
    /// No tokens without a secret or key; otherwise one per device and the publisher's.
    pub fn make(args: &TokenArgs, devices: &[String]) -> Result<Tokens, LoadtestError> {
        let usage = |why: String| LoadtestError::Usage(why);
        let (key, algorithm) = match (&args.token_secret, &args.token_key) {
            (None, None) => return Ok(Tokens::default()),
            (Some(secret), _) => (
                EncodingKey::from_secret(secret.as_bytes())
                    .map_err(|error| usage(format!("--token-secret: {error}")))?,
                Algorithm::HS256,
            ),
            (None, Some(path)) => {
                let pem = std::fs::read(path)
                    .map_err(|error| usage(format!("--token-key {}: {error}", path.display())))?;
                if let Ok(key) = EncodingKey::from_rsa_pem(&pem) {
                    (key, Algorithm::RS256)
                } else if let Ok(key) = EncodingKey::from_ec_pem(&pem) {
                    (key, Algorithm::ES256)
                } else if let Ok(key) = EncodingKey::from_ed_pem(&pem) {
                    (key, Algorithm::EdDSA)
                } else {
                    return Err(usage(format!(
                        "--token-key {}: not an RSA, EC or Ed25519 private key in PEM",
                        path.display()
                    )));
                }
            }
        };
        let mut header = Header::new(algorithm);
        header.kid = args.token_kid.clone();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|since| since.as_secs())
            .unwrap_or(0);
        let exp = now + args.token_ttl.as_secs();
        let sign = |claims: serde_json::Value| {
            jsonwebtoken::encode(&header, &claims, &key)
                .map(|token| format!("Bearer {token}"))
                .map_err(|error| LoadtestError::Failed(format!("cannot sign a token: {error}")))
        };
        let started = std::time::Instant::now();
        let tokens = devices
            .iter()
            .map(|device| sign(json!({ "sub": device, "iat": now, "exp": exp })))
            .collect::<Result<Vec<_>, _>>()?;
        let publish = sign(json!({ "scope": "publish", "iat": now, "exp": exp }))?;
        println!(
            "tokens: {} {algorithm:?} tokens made in {:.1} s (before the run)",
            tokens.len() + 1,
            started.elapsed().as_secs_f64()
        );
        Ok(Tokens {
            devices: Arc::new(tokens),
            publish: Some(Arc::from(publish)),
        })
    }

    /// The `Authorization` value of device `index`'s stream.
    pub fn device(&self, index: usize) -> Option<&str> {
        self.devices.get(index).map(String::as_str)
    }

    /// The `Authorization` value of the tool's publishes.
    pub fn publish(&self) -> Option<Arc<str>> {
        self.publish.clone()
    }
}
