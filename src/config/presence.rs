//! `[presence]`: the fleet API's records of devices (docs/fleet.md): who is online where, for
//! how long a pod counts as alive without a beat, how long records are kept, and how long a
//! connect or disconnect must last before the fleet event stream reports it.

use std::time::Duration;

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::raw::RawPresence;
use super::value::{duration, serialize_duration};

/// Longest `presence.ttl`: a dead pod's devices must not look online for long.
const MAX_TTL: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PresenceConfig {
    /// Whether the pod records presence and takes part in takeover and fleet events.
    pub enabled: bool,
    /// The name this pod gives itself in device records; empty: the host name.
    pub pod_name: String,
    /// A pod that has not beaten for this long is dead: its devices show offline.
    #[serde(serialize_with = "serialize_duration")]
    pub ttl: Duration,
    /// Records of devices not seen for this long are forgotten (404).
    #[serde(serialize_with = "serialize_duration")]
    pub retention: Duration,
    /// A connect or disconnect undone within this long produces no fleet event.
    #[serde(serialize_with = "serialize_duration")]
    pub debounce: Duration,
}

impl PresenceConfig {
    /// The pod name of device records: `pod_name`, else the host name.
    pub fn effective_pod_name(&self) -> String {
        if !self.pod_name.is_empty() {
            return self.pod_name.clone();
        }
        std::env::var("HOSTNAME")
            .ok()
            .filter(|name| !name.is_empty())
            .or_else(|| {
                std::fs::read_to_string("/etc/hostname")
                    .ok()
                    .map(|name| name.trim().to_owned())
                    .filter(|name| !name.is_empty())
            })
            .unwrap_or_else(|| "posthorn".to_owned())
    }
}

impl TryFrom<RawPresence> for PresenceConfig {
    type Error = ConfigError;

    fn try_from(raw: RawPresence) -> Result<Self, ConfigError> {
        let ttl = duration("presence.ttl", &raw.ttl)?;
        if ttl < Duration::from_secs(1) || ttl > MAX_TTL {
            return Err(invalid(
                "presence.ttl",
                "must be between 1s and 10m: a pod beats every third of it",
            ));
        }
        let retention = duration("presence.retention", &raw.retention)?;
        if retention < ttl {
            return Err(invalid(
                "presence.retention",
                "must be at least presence.ttl",
            ));
        }
        let debounce = duration("presence.debounce", &raw.debounce)?;
        if debounce > Duration::from_secs(3600) {
            return Err(invalid("presence.debounce", "must be at most 1h"));
        }
        if raw.pod_name.len() > 128 || raw.pod_name.chars().any(char::is_control) {
            return Err(invalid(
                "presence.pod_name",
                "must be at most 128 characters, none of them control characters",
            ));
        }
        Ok(PresenceConfig {
            enabled: raw.enabled,
            pod_name: raw.pod_name,
            ttl,
            retention,
            debounce,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        let c = PresenceConfig::try_from(RawPresence::default()).expect("defaults");
        assert_eq!(
            (c.ttl, c.retention, c.debounce),
            (
                Duration::from_secs(30),
                Duration::from_secs(7 * 86_400),
                Duration::from_secs(5)
            )
        );
        for (raw, key) in [
            (
                RawPresence {
                    ttl: "500ms".into(),
                    ..RawPresence::default()
                },
                "presence.ttl: ",
            ),
            (
                RawPresence {
                    retention: "10s".into(),
                    ..RawPresence::default()
                },
                "presence.retention: ",
            ),
            (
                RawPresence {
                    debounce: "2h".into(),
                    ..RawPresence::default()
                },
                "presence.debounce: ",
            ),
            (
                RawPresence {
                    pod_name: "a\nb".into(),
                    ..RawPresence::default()
                },
                "presence.pod_name: ",
            ),
        ] {
            let error = PresenceConfig::try_from(raw)
                .expect_err("out of range")
                .to_string();
            assert!(error.starts_with(key), "{error}");
        }
    }
}
