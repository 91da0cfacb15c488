//! `posthorn shard-key DEVICE`: where a device's events live under the active configuration.

use super::{CliError, ConfigArg};
use crate::backend::{nats, redis::layout_of};
use crate::{
    config::{BackendChoice, Config},
    model::{shard_of, DeviceId},
};

#[derive(Debug, clap::Args)]
pub struct ShardKeyArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Device id.
    pub device: String,
}

/// The Redis stream key of a shard (docs/stream-format.md), as the Redis backend writes it.
pub fn stream_key(config: &Config, shard: u32) -> String {
    layout_of(&config.redis).stream_key(shard)
}

pub fn run(args: ShardKeyArgs) -> Result<(), CliError> {
    let config = args.config.load()?;
    let device = DeviceId::parse(&args.device).map_err(|error| {
        CliError::Usage(format!("invalid device id {:?}: {error}", args.device))
    })?;
    // The memory backend has no key of its own: producers that prepare for Redis see theirs.
    if let BackendChoice::Nats(nats_config) = config.backend_choice() {
        let shard = shard_of(device.as_str(), nats_config.shards);
        let subject = nats::layout_of(nats_config).subject(shard);
        println!("shard={shard} subject={subject}");
        return Ok(());
    }
    let shard = shard_of(device.as_str(), config.redis.shards);
    let mut line = format!("shard={shard} key={}", stream_key(&config, shard));
    if !config.redis.urls.is_empty() {
        let group = layout_of(&config.redis).group_of(shard);
        line.push_str(&format!(" instance={}", config.redis.urls[group].as_str()));
    }
    println!("{line}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Standalone and cluster keys follow docs/stream-format.md, with contiguous group ranges.
    #[test]
    fn keys_follow_the_spec() {
        let mut config = Config::default();
        assert_eq!(stream_key(&config, 17), "pos-ev:17");
        config.redis.cluster = true;
        config.redis.groups = 4;
        assert_eq!(stream_key(&config, 0), "pos-ev:{g0}:0");
        assert_eq!(stream_key(&config, 15), "pos-ev:{g0}:15");
        assert_eq!(stream_key(&config, 16), "pos-ev:{g1}:16");
        assert_eq!(stream_key(&config, 63), "pos-ev:{g3}:63");
    }
}
