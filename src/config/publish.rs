//! `[publish]`: how long an event id is remembered to drop a retried publish.

use std::time::Duration;

use serde::Serialize;

use super::backend::BackendChoice;
use super::error::{invalid, ConfigError};
use super::raw::RawPublish;
use super::value::{duration, format_duration, serialize_duration};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PublishConfig {
    #[serde(serialize_with = "serialize_duration")]
    pub dedupe_window: Duration,
}

impl TryFrom<RawPublish> for PublishConfig {
    type Error = ConfigError;

    fn try_from(raw: RawPublish) -> Result<Self, ConfigError> {
        Ok(PublishConfig {
            dedupe_window: duration("publish.dedupe_window", &raw.dedupe_window)?,
        })
    }
}

impl PublishConfig {
    /// The rule that depends on the backend chosen: JetStream refuses a duplicate window longer
    /// than the stream's max age.
    pub(super) fn check_backend(&self, backend: BackendChoice<'_>) -> Result<(), ConfigError> {
        match backend {
            BackendChoice::Nats(nats) if self.dedupe_window > nats.retention => Err(invalid(
                "publish.dedupe_window",
                format!(
                    "must not exceed nats.retention ({}) with backend.kind = nats (got {})",
                    format_duration(nats.retention),
                    format_duration(self.dedupe_window)
                ),
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::backend::BackendKind;
    use crate::config::memory::MemoryConfig;
    use crate::config::nats::NatsConfig;
    use crate::config::raw::{RawMemory, RawNats, RawRedis};
    use crate::config::redis::RedisConfig;

    /// With NATS, the window may not outlast the stream's retention; other backends keep no
    /// such limit.
    #[test]
    fn window_within_nats_retention() {
        let memory = MemoryConfig::try_from(RawMemory::default()).expect("valid");
        let redis = RedisConfig::try_from(RawRedis::default()).expect("valid");
        let nats = NatsConfig::try_from(RawNats {
            retention: "5m".into(),
            ..RawNats::default()
        })
        .expect("valid");
        let publish = PublishConfig::try_from(RawPublish::default()).expect("valid");
        assert_eq!(publish.dedupe_window, Duration::from_secs(600));
        let choose = |kind| BackendChoice::select(kind, &memory, &redis, &nats);
        let error = publish
            .check_backend(choose(BackendKind::Nats))
            .expect_err("10m window, 5m retention");
        assert_eq!(
            error.to_string(),
            "publish.dedupe_window: must not exceed nats.retention (5m) with backend.kind = nats (got 10m)"
        );
        assert!(publish.check_backend(choose(BackendKind::Redis)).is_ok());
        assert!(publish.check_backend(choose(BackendKind::Memory)).is_ok());
    }
}
