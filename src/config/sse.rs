//! `[sse]`: one stream's queue, heartbeat and stall limit, its socket buffer, and the `retry:`
//! it tells clients.

use std::time::Duration;

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::raw::RawSse;
use super::value::{duration, format_duration, int_in, serialize_duration};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SseConfig {
    pub queue_limit: usize,
    #[serde(serialize_with = "serialize_duration")]
    pub heartbeat: Duration,
    /// A client whose queued events waited this long without being written is evicted; zero
    /// leaves only the queue limit.
    #[serde(serialize_with = "serialize_duration")]
    pub stall_timeout: Duration,
    /// Socket send buffer in bytes; 0 leaves the OS default.
    pub send_buffer: usize,
    pub retry_ms: u32,
}

impl TryFrom<RawSse> for SseConfig {
    type Error = ConfigError;

    fn try_from(raw: RawSse) -> Result<Self, ConfigError> {
        let sse = SseConfig {
            queue_limit: int_in("sse.queue_limit", raw.queue_limit, 1, i64::MAX)?,
            heartbeat: duration("sse.heartbeat", &raw.heartbeat)?,
            stall_timeout: duration("sse.stall_timeout", &raw.stall_timeout)?,
            // setsockopt takes a C int, hence the upper bound.
            send_buffer: int_in("sse.send_buffer", raw.send_buffer, 0, i64::from(i32::MAX))?,
            retry_ms: int_in("sse.retry_ms", raw.retry_ms, 0, i64::from(u32::MAX))?,
        };
        if sse.heartbeat < Duration::from_millis(100) {
            return Err(invalid(
                "sse.heartbeat",
                format!(
                    "must be at least 100ms (got {})",
                    format_duration(sse.heartbeat)
                ),
            ));
        }
        if !sse.stall_timeout.is_zero() && sse.stall_timeout < Duration::from_secs(1) {
            return Err(invalid(
                "sse.stall_timeout",
                format!(
                    "must be 0s (off) or at least 1s (got {})",
                    format_duration(sse.stall_timeout)
                ),
            ));
        }
        if sse.send_buffer != 0 && sse.send_buffer < 4096 {
            return Err(invalid(
                "sse.send_buffer",
                format!(
                    "must be 0 (os default) or at least 4096 (got {})",
                    sse.send_buffer
                ),
            ));
        }
        Ok(sse)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sse(raw: RawSse) -> Result<SseConfig, String> {
        SseConfig::try_from(raw).map_err(|error| error.to_string())
    }

    /// queue_limit 0 is rejected with the documented wording.
    #[test]
    fn queue_limit_zero() {
        let error = sse(RawSse {
            queue_limit: 0,
            ..RawSse::default()
        })
        .expect_err("zero");
        assert_eq!(error, "sse.queue_limit: must be at least 1 (got 0)");
    }

    /// The heartbeat, stall timeout and send buffer have floors; 0 turns the last two off.
    #[test]
    fn floors() {
        let cases = [
            (
                RawSse {
                    heartbeat: "50ms".into(),
                    ..RawSse::default()
                },
                "sse.heartbeat: must be at least 100ms (got 50ms)",
            ),
            (
                RawSse {
                    stall_timeout: "500ms".into(),
                    ..RawSse::default()
                },
                "sse.stall_timeout: must be 0s (off) or at least 1s (got 500ms)",
            ),
            (
                RawSse {
                    send_buffer: 100,
                    ..RawSse::default()
                },
                "sse.send_buffer: must be 0 (os default) or at least 4096 (got 100)",
            ),
        ];
        for (raw, message) in cases {
            assert_eq!(sse(raw).expect_err("below the floor"), message);
        }
        let off = sse(RawSse {
            stall_timeout: "0s".into(),
            send_buffer: 0,
            ..RawSse::default()
        })
        .expect("valid");
        assert_eq!((off.stall_timeout, off.send_buffer), (Duration::ZERO, 0));
    }

    /// An unparseable duration names the key and the value.
    #[test]
    fn invalid_duration() {
        let error = sse(RawSse {
            heartbeat: "fast".into(),
            ..RawSse::default()
        })
        .expect_err("not a duration");
        assert!(
            error.starts_with("sse.heartbeat: invalid duration \"fast\""),
            "{error}"
        );
    }
}
