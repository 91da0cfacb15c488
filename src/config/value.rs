//! The value checks every section shares: durations written as text, integers in a range, names
//! from a character set. Each names its key in the error and shows the value it got.

use std::time::Duration;

use serde::Serializer;

use super::error::{invalid, ConfigError};

/// Largest shard count any backend accepts.
pub const MAX_SHARDS: u32 = 16_384;

/// The longest duration anything accepts (`36500d`, 100 years): every duration the hub reads, converted
/// to milliseconds, fits an `i64` and can be added to a Unix-ms clock without wrapping, so no
/// caller needs to guard its conversion (a publish `ttl` of `18446744073709552s` once wrapped to
/// an expiry 384 ms away).
pub const MAX_DURATION: Duration = Duration::from_secs(876_000 * 3600);

/// Parse `250ms`, `20s`, `15m`, `1h`, `30d`, or a bare `0`; at most [`MAX_DURATION`].
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
    let duration = match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => n.checked_mul(60).map(Duration::from_secs),
        "h" => n.checked_mul(3600).map(Duration::from_secs),
        "d" => n.checked_mul(86_400).map(Duration::from_secs),
        _ => None,
    }?;
    (duration <= MAX_DURATION).then_some(duration)
}

/// The inverse of [`parse_duration`]: the largest unit that divides exactly.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        "0s".to_string()
    } else if ms.is_multiple_of(86_400_000) {
        format!("{}d", ms / 86_400_000)
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
            format!("invalid duration {text:?} (expected a whole number followed by ms, s, m, h or d, like 250ms, 20s, 15m, 1h, 30d, at most 36500d)"),
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
        assert_eq!(
            parse_duration("30d"),
            Some(Duration::from_secs(30 * 86_400))
        );
        assert_eq!(parse_duration("0s"), Some(Duration::ZERO));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        for bad in [
            "",
            "5",
            "1.5s",
            "-1s",
            "s",
            "10 s",
            "1w",
            "fast",
            "99999999999999999999h",
            "18446744073709552s",
            "876001h",
            "36501d",
            "52560001m",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
        for d in ["250ms", "20s", "15m", "1h", "30d", "0s", "1500ms", "25h"] {
            assert_eq!(format_duration(parse_duration(d).expect("valid")), d);
        }
    }

    /// Whatever text comes in, a duration is refused or at most [`MAX_DURATION`], and every
    /// conversion the hub makes of one holds: milliseconds as `u64` and `i64`, added to a
    /// Unix-ms clock, and back to text. Seeded, so a failure replays.
    #[test]
    fn every_parsed_duration_converts_without_wrapping() {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(0x7474_6c5f);
        let units = ["ms", "s", "m", "h", "d", "", "x", " s"];
        let now_ms = crate::model::unix_ms();
        for round in 0..200_000u32 {
            let digits = rng.random_range(1..=22usize);
            let number: String = (0..digits)
                .map(|_| char::from(b'0' + rng.random_range(0..10u8)))
                .collect();
            let text = format!("{number}{}", units[round as usize % units.len()]);
            let Some(parsed) = parse_duration(&text) else {
                continue;
            };
            assert!(parsed <= MAX_DURATION, "{text:?} -> {parsed:?}");
            let ms = parsed.as_millis();
            assert_eq!(u128::from(ms as u64), ms, "{text:?}: ms as u64 wraps");
            assert!(i64::try_from(ms).is_ok(), "{text:?}: ms as i64 wraps");
            let expires = now_ms.checked_add(ms as u64).expect("now + ttl fits");
            assert!(expires >= now_ms, "{text:?}");
            assert_eq!(
                parse_duration(&format_duration(parsed)),
                Some(parsed),
                "{text:?}"
            );
        }
        assert_eq!(parse_duration("876000h"), Some(MAX_DURATION));
        assert_eq!(parse_duration("36500d"), Some(MAX_DURATION));
        assert_eq!(
            parse_duration(&format!("{}ms", MAX_DURATION.as_millis())),
            Some(MAX_DURATION)
        );
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
