//! `[drain]`: how a pod that stops hands its streams back: the deadline, how long it stays
//! unready first, the `retry:` range it sends, and how fast it closes streams.

use std::time::Duration;

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::raw::RawDrain;
use super::value::{duration, format_duration, int_in, serialize_duration};

/// Longest `drain.retry_min` / `drain.retry_max`.
const MAX_DRAIN_RETRY: Duration = Duration::from_secs(3600);

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DrainConfig {
    #[serde(serialize_with = "serialize_duration")]
    pub grace: Duration,
    #[serde(serialize_with = "serialize_duration")]
    pub readiness_delay: Duration,
    #[serde(serialize_with = "serialize_duration")]
    pub retry_min: Duration,
    #[serde(serialize_with = "serialize_duration")]
    pub retry_max: Duration,
    pub close_rate: u32,
}

impl TryFrom<RawDrain> for DrainConfig {
    type Error = ConfigError;

    fn try_from(raw: RawDrain) -> Result<Self, ConfigError> {
        let drain = DrainConfig {
            grace: duration("drain.grace", &raw.grace)?,
            readiness_delay: duration("drain.readiness_delay", &raw.readiness_delay)?,
            retry_min: duration("drain.retry_min", &raw.retry_min)?,
            retry_max: duration("drain.retry_max", &raw.retry_max)?,
            close_rate: int_in("drain.close_rate", raw.close_rate, 1, i64::from(u32::MAX))?,
        };
        if drain.grace.is_zero() {
            return Err(invalid("drain.grace", "must be greater than 0s (got 0s)"));
        }
        // The drain keeps min(grace / 10, 2 s) in reserve; at least a second must remain to spread
        // the closes, or every connection would be closed in the first slice: a reconnect storm.
        let margin = (drain.grace / 10).min(Duration::from_secs(2));
        if drain.readiness_delay + margin + Duration::from_secs(1) > drain.grace {
            return Err(invalid(
                "drain.readiness_delay",
                format!(
                    "must leave at least 1s to spread the closes before drain.grace ({}) minus its margin ({}) (got {})",
                    format_duration(drain.grace),
                    format_duration(margin),
                    format_duration(drain.readiness_delay)
                ),
            ));
        }
        // `retry:` is sent in milliseconds as a u32; past an hour a client waiting that long is a
        // mistake, not a plan.
        for (key, value) in [
            ("drain.retry_min", drain.retry_min),
            ("drain.retry_max", drain.retry_max),
        ] {
            if value > MAX_DRAIN_RETRY {
                return Err(invalid(
                    key,
                    format!(
                        "must be at most {} (got {})",
                        format_duration(MAX_DRAIN_RETRY),
                        format_duration(value)
                    ),
                ));
            }
        }
        if drain.retry_min > drain.retry_max {
            return Err(invalid(
                "drain.retry_min",
                format!(
                    "must not exceed drain.retry_max ({}) (got {})",
                    format_duration(drain.retry_max),
                    format_duration(drain.retry_min)
                ),
            ));
        }
        Ok(drain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(raw: RawDrain) -> Result<DrainConfig, String> {
        DrainConfig::try_from(raw).map_err(|error| error.to_string())
    }

    /// retry_min above retry_max is rejected, naming drain.retry_min.
    #[test]
    fn retry_min_above_max() {
        let error = drain(RawDrain {
            retry_min: "2m".into(),
            retry_max: "1m".into(),
            ..RawDrain::default()
        })
        .expect_err("min above max");
        assert_eq!(
            error,
            "drain.retry_min: must not exceed drain.retry_max (1m) (got 2m)"
        );
    }

    /// Bug pinned: a retry past an hour wrapped as a u32 of milliseconds.
    #[test]
    fn retry_at_most_an_hour() {
        let error = drain(RawDrain {
            retry_max: "2000h".into(),
            ..RawDrain::default()
        })
        .expect_err("too long");
        assert_eq!(error, "drain.retry_max: must be at most 1h (got 2000h)");
    }

    /// A zero grace, or a readiness delay that leaves no second to spread the closes, is refused.
    #[test]
    fn grace_leaves_time_to_close() {
        let error = drain(RawDrain {
            grace: "0s".into(),
            ..RawDrain::default()
        })
        .expect_err("zero grace");
        assert_eq!(error, "drain.grace: must be greater than 0s (got 0s)");
        // 30s grace keeps 2s in reserve: a delay of 27s leaves exactly 1s, 28s leaves none.
        let ok = drain(RawDrain {
            readiness_delay: "27s".into(),
            ..RawDrain::default()
        });
        assert!(ok.is_ok(), "{ok:?}");
        let error = drain(RawDrain {
            readiness_delay: "28s".into(),
            ..RawDrain::default()
        })
        .expect_err("no time left");
        assert!(error.starts_with("drain.readiness_delay: "), "{error}");
    }
}
