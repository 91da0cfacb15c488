//! `posthorn publish`: publish one event through a hub's HTTP API (`--url`, by default the
//! configured `server.listen`). The embedded memory log lives inside the hub process, so the hub
//! is the way in; direct appends arrive with the Redis and NATS backends.

use serde_json::{json, Value};

use super::{CliError, ConfigArg};

#[derive(Debug, clap::Args)]
pub struct PublishArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Base URL of a hub, e.g. http://127.0.0.1:8080 (default: http://<server.listen>).
    #[arg(long)]
    pub url: Option<String>,
    /// Device to publish to.
    #[arg(long, required_unless_present_any = ["broadcast", "group"], conflicts_with_all = ["broadcast", "group"])]
    pub device: Option<String>,
    /// Group to publish to: every device that is a member of it.
    #[arg(long, conflicts_with = "broadcast")]
    pub group: Option<String>,
    /// Publish to every device.
    #[arg(long)]
    pub broadcast: bool,
    /// Event type.
    #[arg(long = "type", default_value = "message")]
    pub event_type: String,
    /// Payload: JSON (sent compact), or any other text (sent as is).
    #[arg(long)]
    pub data: String,
    /// Idempotency key.
    #[arg(long)]
    pub key: Option<String>,
    /// Bearer token with the `publish` scope (jwt auth).
    #[arg(long)]
    pub token: Option<String>,
}

pub fn run(args: PublishArgs) -> Result<(), CliError> {
    let base = match args.url {
        Some(url) => url,
        None => format!("http://{}", args.config.load()?.server.listen),
    };
    let data = serde_json::from_str::<Value>(&args.data).unwrap_or(Value::String(args.data));
    let mut event = json!({ "type": args.event_type, "data": data });
    if args.broadcast {
        event["broadcast"] = json!(true);
    } else if let Some(group) = args.group {
        event["group"] = json!(group);
    } else if let Some(device) = args.device {
        event["device"] = json!(device);
    }
    if let Some(key) = args.key {
        event["key"] = json!(key);
    }
    let url = format!("{}/v1/events", base.trim_end_matches('/'));
    let token = args.token;
    actix_rt::System::new().block_on(async move {
        let client = awc::Client::default();
        let mut request = client.post(&url);
        if let Some(token) = &token {
            request = request.bearer_auth(token);
        }
        let mut response = request
            .send_json(&event)
            .await
            .map_err(|error| CliError::Failed(format!("cannot reach {url}: {error}")))?;
        let body = response.body().await.map_err(|error| {
            CliError::Failed(format!("cannot read the answer of {url}: {error}"))
        })?;
        let text = String::from_utf8_lossy(&body);
        if response.status().is_success() {
            println!("{text}");
            Ok(())
        } else {
            Err(CliError::Failed(format!("{} {}", response.status(), text)))
        }
    })
}
