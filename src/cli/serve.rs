//! `posthorn serve`: load and check the configuration, then run the hub.

use std::net::SocketAddr;

use super::{CliError, ConfigArg};
use crate::{
    config::{BackendKind, Config},
    hub,
};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    #[command(flatten)]
    pub overrides: Overrides,
}

/// The flags of `serve` that override configuration keys; `config check` and `config show` take
/// them too, so that they judge what `serve` would run.
#[derive(Debug, Clone, clap::Args)]
pub struct Overrides {
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

impl Overrides {
    /// The configuration of `source` with these flags applied.
    pub fn load(&self, source: &ConfigArg) -> Result<Config, CliError> {
        let mut config = source.load()?;
        if let Some(listen) = self.listen {
            config.server.listen = listen;
        }
        if let Some(kind) = &self.backend {
            let kind = BackendKind::from_name(kind).ok_or_else(|| {
                CliError::Usage(format!(
                    "--backend: unknown backend {kind:?} (memory, redis, nats)"
                ))
            })?;
            config.select_backend(kind)?;
        }
        config.server.insecure |= self.insecure;
        Ok(config)
    }
}

pub fn run(args: ServeArgs) -> Result<(), CliError> {
    let config = args.overrides.load(&args.config)?;
    hub::serve(config)?;
    Ok(())
}
