//! `posthorn serve`: load and check the configuration, then run the hub.

use std::net::SocketAddr;

use super::{CliError, ConfigArg};
use crate::{config::BackendKind, hub};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Listen address (overrides server.listen).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Backend: memory, redis or nats (overrides backend.kind).
    #[arg(long, value_name = "KIND")]
    pub backend: Option<String>,
    /// Allow auth none on a non-loopback address (overrides server.insecure).
    #[arg(long)]
    pub insecure: bool,
}

pub fn run(args: ServeArgs) -> Result<(), CliError> {
    let mut config = args.config.load()?;
    if let Some(listen) = args.listen {
        config.server.listen = listen;
    }
    if let Some(kind) = args.backend {
        let kind = BackendKind::from_name(&kind).ok_or_else(|| {
            CliError::Usage(format!(
                "--backend: unknown backend {kind:?} (memory, redis, nats)"
            ))
        })?;
        config.select_backend(kind)?;
    }
    config.server.insecure |= args.insecure;
    hub::serve(config)?;
    Ok(())
}
