//! `[memory]`: the embedded event log of one node (`backend.kind = "memory"`).

use std::time::Duration;

use serde::Serialize;

use super::error::ConfigError;
use super::raw::RawMemory;
use super::value::{duration, int_in, serialize_duration, shards};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryConfig {
    #[serde(serialize_with = "serialize_duration")]
    pub retention: Duration,
    pub max_len: usize,
    pub shards: u32,
}

impl TryFrom<RawMemory> for MemoryConfig {
    type Error = ConfigError;

    fn try_from(raw: RawMemory) -> Result<Self, ConfigError> {
        Ok(MemoryConfig {
            retention: duration("memory.retention", &raw.retention)?,
            max_len: int_in("memory.max_len", raw.max_len, 1, i64::MAX)?,
            shards: shards("memory.shards", raw.shards)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shards run from 1 to 16,384 and a log holds at least one entry.
    #[test]
    fn ranges() {
        for (raw, message) in [
            (
                RawMemory {
                    shards: 0,
                    ..RawMemory::default()
                },
                "memory.shards: must be at least 1 (got 0)",
            ),
            (
                RawMemory {
                    shards: 16_385,
                    ..RawMemory::default()
                },
                "memory.shards: must be at most 16384 (got 16385)",
            ),
            (
                RawMemory {
                    max_len: 0,
                    ..RawMemory::default()
                },
                "memory.max_len: must be at least 1 (got 0)",
            ),
        ] {
            let error = MemoryConfig::try_from(raw).expect_err("out of range");
            assert_eq!(error.to_string(), message);
        }
    }
}
