//! `[replay]`: resumes: how many run at once, and what they share.

use serde::Serialize;

use super::error::ConfigError;
use super::raw::RawReplay;
use super::value::int_in;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplayConfig {
    /// Replays running at once per pod; the others wait with their stream open, in order.
    pub max_concurrent: usize,
    /// Stream entries kept in memory, over all shards, while replays of their shard run, so
    /// that resumes of one shard read the backend once.
    pub cache_entries: usize,
}

impl TryFrom<RawReplay> for ReplayConfig {
    type Error = ConfigError;

    fn try_from(raw: RawReplay) -> Result<Self, ConfigError> {
        Ok(ReplayConfig {
            max_concurrent: int_in("replay.max_concurrent", raw.max_concurrent, 1, 1_000_000)?,
            cache_entries: int_in("replay.cache_entries", raw.cache_entries, 0, 100_000_000)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At least one replay runs; the shared cache may be off (0) but not negative.
    #[test]
    fn ranges() {
        let c = ReplayConfig::try_from(RawReplay {
            max_concurrent: 2,
            cache_entries: 0,
        })
        .expect("valid");
        assert_eq!((c.max_concurrent, c.cache_entries), (2, 0));
        for (raw, key) in [
            (
                RawReplay {
                    max_concurrent: 0,
                    ..RawReplay::default()
                },
                "replay.max_concurrent: ",
            ),
            (
                RawReplay {
                    cache_entries: -1,
                    ..RawReplay::default()
                },
                "replay.cache_entries: ",
            ),
        ] {
            let error = ReplayConfig::try_from(raw)
                .expect_err("out of range")
                .to_string();
            assert!(error.starts_with(key), "{error}");
        }
    }
}
