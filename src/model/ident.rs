//! Device ids and event types: 1–128 (resp. 1–64) characters from `[A-Za-z0-9._:-]`.
//!
//! The alphabet is what keeps ids safe everywhere they travel: SSE fields (no CR/LF can inject a
//! field), Redis keys, NATS headers and log lines. Validation happens once, at the edge.

use std::{fmt, sync::Arc};

use thiserror::Error;

pub const MAX_DEVICE_LEN: usize = 128;
pub const MAX_TYPE_LEN: usize = 64;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum IdentError {
    #[error("must not be empty")]
    Empty,
    #[error("is {len} characters long, at most {max} are allowed")]
    TooLong { len: usize, max: usize },
    #[error("contains {found:?}; only letters, digits and . _ : - are allowed")]
    BadChar { found: char },
    #[error("is reserved for the events the hub itself writes")]
    Reserved,
}

/// Event types the hub writes itself, without an `id:` (or, for `resync`, with the position to
/// continue from): a published event of one of these types would be taken by a client for the
/// hub's own word (a forged resync resets a terminal's cursor).
pub const RESERVED_TYPES: [&str; 3] = ["resync", "token_expired", "revoked"];

fn validate(text: &str, max: usize) -> Result<(), IdentError> {
    if text.is_empty() {
        return Err(IdentError::Empty);
    }
    if let Some(found) = text
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        return Err(IdentError::BadChar { found });
    }
    // All characters are ASCII here, so the byte length is the character count.
    if text.len() > max {
        return Err(IdentError::TooLong {
            len: text.len(),
            max,
        });
    }
    Ok(())
}

/// A validated device id. Cheap to clone: the Router and every Connection share one allocation.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId(Arc<str>);

impl DeviceId {
    pub fn parse(text: &str) -> Result<Self, IdentError> {
        validate(text, MAX_DEVICE_LEN)?;
        Ok(Self(Arc::from(text)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

/// Ordered as its text, so maps keyed by device id can be searched by text.
impl std::borrow::Borrow<str> for DeviceId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// As its text; a text that is not a valid device id does not deserialize.
impl serde::Serialize for DeviceId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for DeviceId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        DeviceId::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// A validated event type (`message` when a producer gives none).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct EventType(Arc<str>);

impl EventType {
    /// A name with the event types' characters and length (a supersede name, say).
    pub fn parse(text: &str) -> Result<Self, IdentError> {
        validate(text, MAX_TYPE_LEN)?;
        Ok(Self(Arc::from(text)))
    }

    /// The type of a stored or published event: a name, and none of [`RESERVED_TYPES`].
    pub fn parse_published(text: &str) -> Result<Self, IdentError> {
        if RESERVED_TYPES.contains(&text) {
            return Err(IdentError::Reserved);
        }
        Self::parse(text)
    }

    pub fn message() -> Self {
        Self(Arc::from("message"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

/// Who an entry is for: one device, or every device of the shard it was appended to (`dev=*`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Device(DeviceId),
    Broadcast,
}

impl Target {
    /// The `dev` field value as stored in the backends.
    pub fn as_field(&self) -> &str {
        match self {
            Target::Device(device) => device.as_str(),
            Target::Broadcast => "*",
        }
    }

    /// Parses a stored `dev` field; `*` is a broadcast copy.
    pub fn from_field(text: &str) -> Result<Self, IdentError> {
        if text == "*" {
            Ok(Target::Broadcast)
        } else {
            DeviceId::parse(text).map(Target::Device)
        }
    }

    /// Whether a connection of `device` must receive this entry.
    pub fn reaches(&self, device: &DeviceId) -> bool {
        match self {
            Target::Device(target) => target == device,
            Target::Broadcast => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device alphabet and length limits of docs/stream-format.md are enforced exactly.
    #[test]
    fn device_ids_follow_the_spec_alphabet() {
        assert!(DeviceId::parse("pos-17").is_ok());
        assert!(DeviceId::parse("Store_9:till.2-a").is_ok());
        assert!(DeviceId::parse(&"a".repeat(128)).is_ok());
        assert_eq!(
            DeviceId::parse(&"a".repeat(129)),
            Err(IdentError::TooLong { len: 129, max: 128 })
        );
        assert_eq!(DeviceId::parse(""), Err(IdentError::Empty));
        for bad in ["a b", "a/b", "*", "a\nb", "a\rb", "ké", "a\0b", "a%20"] {
            assert!(DeviceId::parse(bad).is_err(), "{bad:?} must be rejected");
        }
    }

    /// Event types have their own, shorter limit.
    #[test]
    fn event_types_are_limited_to_64_characters() {
        assert!(EventType::parse(&"t".repeat(64)).is_ok());
        assert!(EventType::parse(&"t".repeat(65)).is_err());
        assert!(EventType::parse("order.paid").is_ok());
        assert!(EventType::parse("order paid").is_err());
        for reserved in RESERVED_TYPES {
            assert_eq!(
                EventType::parse_published(reserved),
                Err(IdentError::Reserved)
            );
            assert!(
                EventType::parse(reserved).is_ok(),
                "a supersede name may be one"
            );
        }
        assert!(EventType::parse_published("resync.done").is_ok());
    }

    /// `*` is the broadcast marker in stored entries and never a valid device id.
    #[test]
    fn broadcast_marker_round_trips() {
        assert_eq!(Target::from_field("*"), Ok(Target::Broadcast));
        assert_eq!(Target::Broadcast.as_field(), "*");
        let device = DeviceId::parse("pos-1").unwrap();
        assert!(Target::Broadcast.reaches(&device));
        assert!(Target::Device(device.clone()).reaches(&device));
        assert!(!Target::Device(DeviceId::parse("pos-2").unwrap()).reaches(&device));
    }
}
