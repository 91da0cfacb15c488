//! `[backend]`: which event log backs the hub, and [`BackendChoice`], the selected backend with
//! its section: the one place that turns `backend.kind` into the settings of that backend.
//!
//! `[memory]`, `[redis]` and `[nats]` are all read and validated whatever the kind (a file may
//! set all three, and the status shows all three); only the chosen one is used.

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::memory::MemoryConfig;
use super::nats::NatsConfig;
use super::raw::RawBackend;
use super::redis::RedisConfig;

/// Which event log backs the hub.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Memory,
    Redis,
    Nats,
}

impl BackendKind {
    pub const ALL: [BackendKind; 3] = [BackendKind::Memory, BackendKind::Redis, BackendKind::Nats];

    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Memory => "memory",
            BackendKind::Redis => "redis",
            BackendKind::Nats => "nats",
        }
    }

    /// The kind named `name` (`backend.kind`, `serve --backend`), if there is one.
    pub fn from_name(name: &str) -> Option<BackendKind> {
        Self::ALL.into_iter().find(|kind| kind.as_str() == name)
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BackendConfig {
    pub kind: BackendKind,
}

impl TryFrom<RawBackend> for BackendConfig {
    type Error = ConfigError;

    fn try_from(raw: RawBackend) -> Result<Self, ConfigError> {
        let kind = BackendKind::from_name(&raw.kind).ok_or_else(|| {
            invalid(
                "backend.kind",
                format!("must be one of memory, redis, nats (got {:?})", raw.kind),
            )
        })?;
        Ok(BackendConfig { kind })
    }
}

/// The backend `backend.kind` selects, with its section: match on this, not on the kind, to
/// build a backend or read a setting every backend has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice<'a> {
    Memory(&'a MemoryConfig),
    Redis(&'a RedisConfig),
    Nats(&'a NatsConfig),
}

impl<'a> BackendChoice<'a> {
    /// The section of `kind` among the three.
    pub fn select(
        kind: BackendKind,
        memory: &'a MemoryConfig,
        redis: &'a RedisConfig,
        nats: &'a NatsConfig,
    ) -> Self {
        match kind {
            BackendKind::Memory => BackendChoice::Memory(memory),
            BackendKind::Redis => BackendChoice::Redis(redis),
            BackendKind::Nats => BackendChoice::Nats(nats),
        }
    }

    pub fn kind(self) -> BackendKind {
        match self {
            BackendChoice::Memory(_) => BackendKind::Memory,
            BackendChoice::Redis(_) => BackendKind::Redis,
            BackendChoice::Nats(_) => BackendKind::Nats,
        }
    }

    /// `<kind>.shards`.
    pub fn shards(self) -> u32 {
        match self {
            BackendChoice::Memory(memory) => memory.shards,
            BackendChoice::Redis(redis) => redis.shards,
            BackendChoice::Nats(nats) => nats.shards,
        }
    }

    /// `<kind>.retention`: how long the backend keeps an event.
    pub fn retention(self) -> Duration {
        match self {
            BackendChoice::Memory(memory) => memory.retention,
            BackendChoice::Redis(redis) => redis.retention,
            BackendChoice::Nats(nats) => nats.retention,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::raw::{RawMemory, RawNats, RawRedis};

    /// Every kind round-trips through its name; anything else is refused naming the key.
    #[test]
    fn kind_names() {
        for kind in BackendKind::ALL {
            assert_eq!(BackendKind::from_name(kind.as_str()), Some(kind));
            let raw = RawBackend {
                kind: kind.to_string(),
            };
            assert_eq!(BackendConfig::try_from(raw).expect("valid").kind, kind);
        }
        let error = BackendConfig::try_from(RawBackend {
            kind: "kafka".into(),
        })
        .expect_err("unknown");
        assert_eq!(
            error.to_string(),
            "backend.kind: must be one of memory, redis, nats (got \"kafka\")"
        );
        assert_eq!(BackendKind::from_name("Redis"), None);
    }

    /// The choice reads shards and retention from the selected section, not another.
    #[test]
    fn choice_reads_its_own_section() {
        let memory = MemoryConfig::try_from(RawMemory {
            shards: 1,
            retention: "1m".into(),
            ..RawMemory::default()
        })
        .expect("valid");
        let redis = RedisConfig::try_from(RawRedis {
            shards: 2,
            retention: "2m".into(),
            ..RawRedis::default()
        })
        .expect("valid");
        let nats = NatsConfig::try_from(RawNats {
            shards: 3,
            retention: "3m".into(),
            ..RawNats::default()
        })
        .expect("valid");
        for (kind, shards, minutes) in [
            (BackendKind::Memory, 1, 1),
            (BackendKind::Redis, 2, 2),
            (BackendKind::Nats, 3, 3),
        ] {
            let choice = BackendChoice::select(kind, &memory, &redis, &nats);
            assert_eq!(choice.kind(), kind);
            assert_eq!(choice.shards(), shards);
            assert_eq!(choice.retention(), Duration::from_secs(60 * minutes));
        }
    }
}
