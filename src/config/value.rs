//! The value checks every section shares: durations written as text, integers in a range, names
//! from a character set. Each names its key in the error and shows the value it got.

use std::time::Duration;

use serde::Serializer;

use super::error::{invalid, ConfigError};

/// Largest shard count any backend accepts.
pub const MAX_SHARDS: u32 = 16_384;

/// Parse `250ms`, `20s`, `15m`, `1h`, or a bare `0`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    if text == "0" {
        return Some(Duration::ZERO);
    }
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(split);
    if digits.is_empty() {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => n.checked_mul(60).map(Duration::from_secs),
        "h" => n.checked_mul(3600).map(Duration::from_secs),
        _ => None,
    }
}

/// The inverse of [`parse_duration`]: the largest unit that divides exactly.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        "0s".to_string()
    } else if ms.is_multiple_of(3_600_000) {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1_000) {
        format!("{}s", ms / 1_000)
    } else {
        format!("{ms}ms")
    }
}

/// `serialize_with` for a duration key: the text an operator writes (`15m`), not serde's
/// `{secs, nanos}`.
pub(crate) fn serialize_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_duration(*d))
}

/// The duration `text` of `key`.
pub(crate) fn duration(key: &str, text: &str) -> Result<Duration, ConfigError> {
    parse_duration(text).ok_or_else(|| {
        invalid(
            key,
            format!("invalid duration {text:?} (expected a whole number followed by ms, s, m or h, like 250ms, 20s, 15m, 1h)"),
        )
    })
}

/// The integer `value` of `key`, within `min..=max`, as the type its users read.
pub(crate) fn int_in<T: TryFrom<i64>>(
    key: &str,
    value: i64,
    min: i64,
    max: i64,
) -> Result<T, ConfigError> {
    if value < min {
        return Err(invalid(
            key,
            format!("must be at least {min} (got {value})"),
        ));
    }
    if value > max {
        return Err(invalid(key, format!("must be at most {max} (got {value})")));
    }
    // Bounds are chosen to fit T; a platform where they do not (usize on a
    // 32-bit target) still gets a keyed error rather than a panic.
    T::try_from(value).map_err(|_| invalid(key, format!("is too large (got {value})")))
}

/// A shard count: 1 to [`MAX_SHARDS`].
pub(crate) fn shards(key: &str, value: i64) -> Result<u32, ConfigError> {
    int_in(key, value, 1, i64::from(MAX_SHARDS))
}

/// A non-empty name whose characters all pass `ok` (`allowed` describes them in the error).
pub(crate) fn name_chars(
    key: &str,
    value: &str,
    allowed: &str,
    ok: impl Fn(char) -> bool,
) -> Result<(), ConfigError> {
    if value.is_empty() {
        return Err(invalid(key, "must not be empty (got \"\")"));
    }
    if !value.chars().all(ok) {
        return Err(invalid(
            key,
            format!("may only contain the characters {allowed} (got {value:?})"),
        ));
    }
    Ok(())
}

/// A file key as written: empty means unset.
pub(crate) fn optional_path(raw: String) -> Option<std::path::PathBuf> {
    (!raw.trim().is_empty()).then(|| std::path::PathBuf::from(raw.trim()))
}

/// An optional file key shown as it is written in the file: "" when unset.
pub(crate) fn serialize_optional_path<S: Serializer>(
    path: &Option<std::path::PathBuf>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match path {
        Some(path) => s.collect_str(&path.display()),
        None => s.serialize_str(""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Duration syntax: whole numbers with ms/s/m/h, and a bare 0.
    #[test]
    fn duration_syntax() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("20s"), Some(Duration::from_secs(20)));
        assert_eq!(parse_duration("15m"), Some(Duration::from_secs(900)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0s"), Some(Duration::ZERO));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        for bad in [
            "",
            "5",
            "1.5s",
            "-1s",
            "s",
            "10 s",
            "1d",
            "fast",
            "99999999999999999999h",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
        for d in ["250ms", "20s", "15m", "1h", "0s", "1500ms"] {
            assert_eq!(format_duration(parse_duration(d).expect("valid")), d);
        }
    }

    /// A duration key serializes as the text it was written in.
    #[test]
    fn duration_serializes_as_text() {
        #[derive(serde::Serialize)]
        struct Keyed {
            #[serde(serialize_with = "serialize_duration")]
            grace: Duration,
        }
        let json = serde_json::to_value(Keyed {
            grace: Duration::from_secs(90),
        })
        .expect("serializes");
        assert_eq!(json, serde_json::json!({ "grace": "90s" }));
    }

    /// Range errors name the key, the bound and the value.
    #[test]
    fn ranges_name_the_key() {
        let low = int_in::<usize>("sse.queue_limit", 0, 1, 10).expect_err("below");
        assert_eq!(
            low.to_string(),
            "sse.queue_limit: must be at least 1 (got 0)"
        );
        let high = int_in::<u32>("nats.replicas", 6, 1, 5).expect_err("above");
        assert_eq!(high.to_string(), "nats.replicas: must be at most 5 (got 6)");
        assert_eq!(shards("memory.shards", 16_384).expect("max"), MAX_SHARDS);
        let name = name_chars("x.y", "a b", "a-z", |c| c.is_ascii_lowercase()).expect_err("space");
        assert_eq!(
            name.to_string(),
            "x.y: may only contain the characters a-z (got \"a b\")"
        );
    }
}
