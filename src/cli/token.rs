//! `posthorn token`: mint a JWT with the configured HS256 secret, for testing and for tools.
//! Production tokens come from your identity provider (RS256/ES256 with `auth.jwt_public_key_file`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{EncodingKey, Header};
use serde_json::json;

use super::{CliError, ConfigArg};

#[derive(Debug, clap::Args)]
pub struct TokenArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// A device token: `sub` = this device id (for its event stream).
    #[arg(long, required_unless_present = "scope")]
    pub device: Option<String>,
    /// Scopes, space-separated: `publish`, `admin`.
    #[arg(long)]
    pub scope: Option<String>,
    /// Lifetime of the token.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    pub ttl: Duration,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    crate::config::parse_duration(text)
        .ok_or_else(|| format!("invalid duration {text:?} (e.g. 30m, 24h)"))
}

pub fn run(args: TokenArgs) -> Result<(), CliError> {
    let config = args.config.load()?;
    if config.auth.jwt_secret.is_empty() {
        return Err(CliError::Usage(
            "posthorn token signs with auth.jwt_secret (HS256), which is not set; tokens for RS256/ES256 \
             keys come from your identity provider"
                .into(),
        ));
    }
    if let Some(device) = &args.device {
        crate::model::DeviceId::parse(device)
            .map_err(|error| CliError::Usage(format!("invalid device id {device:?}: {error}")))?;
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut claims = json!({ "iat": now, "exp": now + args.ttl.as_secs() });
    if let Some(device) = args.device {
        claims["sub"] = json!(device);
    }
    if let Some(scope) = args.scope {
        claims["scope"] = json!(scope);
    }
    let key = EncodingKey::from_secret(config.auth.jwt_secret.expose().as_bytes())
        .map_err(|error| CliError::Usage(format!("auth.jwt_secret: {error}")))?;
    let token = jsonwebtoken::encode(&Header::default(), &claims, &key)
        .map_err(|error| CliError::Failed(format!("cannot sign the token: {error}")))?;
    println!("{token}");
    Ok(())
}
