//! `[limits]`: the largest event, batch and request body, the most streams a pod holds, and
//! the most groups a device may be a member of.

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::raw::RawLimits;
use super::value::int_in;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LimitsConfig {
    pub max_event_bytes: usize,
    pub max_batch: usize,
    /// 0 means no limit.
    pub max_connections: usize,
    pub max_body_bytes: usize,
    /// Groups per stream, from the token's `groups` claim or `?groups=`: beyond it, 400.
    pub max_groups_per_device: usize,
}

impl TryFrom<RawLimits> for LimitsConfig {
    type Error = ConfigError;

    fn try_from(raw: RawLimits) -> Result<Self, ConfigError> {
        let limits = LimitsConfig {
            max_event_bytes: int_in("limits.max_event_bytes", raw.max_event_bytes, 1, i64::MAX)?,
            max_batch: int_in("limits.max_batch", raw.max_batch, 1, i64::MAX)?,
            max_connections: int_in("limits.max_connections", raw.max_connections, 0, i64::MAX)?,
            max_body_bytes: int_in("limits.max_body_bytes", raw.max_body_bytes, 1, i64::MAX)?,
            // Each group a connection is in costs the Router an index entry: a bound keeps a
            // token's claim from making one stream as costly as a thousand.
            max_groups_per_device: int_in(
                "limits.max_groups_per_device",
                raw.max_groups_per_device,
                0,
                1024,
            )?,
        };
        if limits.max_body_bytes < limits.max_event_bytes {
            return Err(invalid(
                "limits.max_body_bytes",
                format!(
                    "must be at least limits.max_event_bytes ({}) (got {})",
                    limits.max_event_bytes, limits.max_body_bytes
                ),
            ));
        }
        Ok(limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body must hold at least one event of the largest size.
    #[test]
    fn body_holds_an_event() {
        let error = LimitsConfig::try_from(RawLimits {
            max_body_bytes: 10,
            ..RawLimits::default()
        })
        .expect_err("body smaller than an event");
        assert_eq!(
            error.to_string(),
            "limits.max_body_bytes: must be at least limits.max_event_bytes (65536) (got 10)"
        );
        let equal = LimitsConfig::try_from(RawLimits {
            max_event_bytes: 10,
            max_body_bytes: 10,
            ..RawLimits::default()
        });
        assert!(equal.is_ok(), "{equal:?}");
    }

    /// Zero connections means no limit; a zero batch is refused.
    #[test]
    fn zero() {
        let c = LimitsConfig::try_from(RawLimits::default()).expect("valid");
        assert_eq!(c.max_connections, 0);
        let error = LimitsConfig::try_from(RawLimits {
            max_batch: 0,
            ..RawLimits::default()
        })
        .expect_err("zero batch");
        assert_eq!(
            error.to_string(),
            "limits.max_batch: must be at least 1 (got 0)"
        );
    }
}
