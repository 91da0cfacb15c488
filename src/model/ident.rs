//! Device ids, group names and event types: 1–128 (resp. 1–64) characters from `[A-Za-z0-9._:-]`.
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

/// A validated group name (a store, a merchant, a region): the device-id characters, 1–128 long.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupName(Arc<str>);

impl GroupName {
    pub fn parse(text: &str) -> Result<Self, IdentError> {
        validate(text, MAX_DEVICE_LEN)?;
        Ok(Self(Arc::from(text)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for GroupName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for GroupName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

impl serde::Serialize for GroupName {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for GroupName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        GroupName::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// The groups a stream's device belongs to, sorted and without repeats. Empty costs no
/// allocation, which is what a fleet without groups keeps per connection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Groups(Box<[GroupName]>);

impl Groups {
    /// Sorted, repeats removed.
    pub fn new(mut names: Vec<GroupName>) -> Self {
        names.sort();
        names.dedup();
        Self(names.into_boxed_slice())
    }

    /// A comma-separated list (`?groups=a,b`); an empty text is no group.
    pub fn parse_list(text: &str) -> Result<Self, (String, IdentError)> {
        text.split(',')
            .filter(|name| !name.is_empty())
            .map(|name| GroupName::parse(name).map_err(|error| (name.to_owned(), error)))
            .collect::<Result<Vec<_>, _>>()
            .map(Self::new)
    }

    pub fn contains(&self, group: &GroupName) -> bool {
        self.0.binary_search(group).is_ok()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> std::slice::Iter<'_, GroupName> {
        self.0.iter()
    }

    /// The names joined by commas, as `parse_list` reads them.
    pub fn to_list(&self) -> String {
        self.iter()
            .map(GroupName::as_str)
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl serde::Serialize for Groups {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de> serde::Deserialize<'de> for Groups {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Vec::<GroupName>::deserialize(deserializer).map(Self::new)
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

/// Who an entry is for: one device, every device of the shard it was appended to (`dev=*`), or
/// the members of a group among them (`grp=<name>`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Device(DeviceId),
    Broadcast,
    Group(GroupName),
}

impl Target {
    /// What the target is known by in the backends' keys: the device id, `*`, or `@<group>`
    /// (no device id holds `*` or `@`, so the three never meet). Idempotency keys and supersede
    /// names are scoped to it.
    pub fn as_field(&self) -> std::borrow::Cow<'_, str> {
        match self {
            Target::Device(device) => device.as_str().into(),
            Target::Broadcast => "*".into(),
            Target::Group(group) => format!("@{group}").into(),
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

    /// The target of a stored entry from its device field (`dev`, `Posthorn-Dev`) and group
    /// field (`grp`, `Posthorn-Group`): exactly one of them. `None` for neither or both.
    pub fn from_fields(dev: Option<&str>, group: Option<&str>) -> Option<Self> {
        match (dev, group) {
            (Some(dev), None) => Self::from_field(dev).ok(),
            (None, Some(group)) => GroupName::parse(group).ok().map(Target::Group),
            _ => None,
        }
    }

    /// Whether it is stored once per shard (a broadcast, a group) rather than in its device's.
    pub fn is_per_shard(&self) -> bool {
        !matches!(self, Target::Device(_))
    }

    /// The shards an entry for it is appended to, of `shards`.
    pub fn shards(&self, shards: u32) -> std::ops::Range<u32> {
        match self {
            Target::Device(device) => {
                let shard = super::shard_of(device.as_str(), shards);
                shard..shard + 1
            }
            Target::Broadcast | Target::Group(_) => 0..shards,
        }
    }

    /// Whether a stream of `addressee` must receive this entry.
    pub fn reaches(&self, addressee: Addressee<'_>) -> bool {
        match self {
            Target::Device(target) => target == addressee.device,
            Target::Broadcast => true,
            // Sorted: see `Groups`.
            Target::Group(group) => addressee.groups.binary_search(group).is_ok(),
        }
    }
}

/// Who a stream is for: its device, and the groups the device is a member of.
#[derive(Clone, Copy, Debug)]
pub struct Addressee<'a> {
    pub device: &'a DeviceId,
    /// Sorted (a [`Groups`]).
    groups: &'a [GroupName],
}

impl<'a> Addressee<'a> {
    pub fn new(device: &'a DeviceId, groups: &'a Groups) -> Self {
        Self {
            device,
            groups: &groups.0,
        }
    }

    /// A device in no group.
    pub fn device(device: &'a DeviceId) -> Self {
        Self {
            device,
            groups: &[],
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
        let alone = Addressee::device(&device);
        assert!(Target::Broadcast.reaches(alone));
        assert!(Target::Device(device.clone()).reaches(alone));
        assert!(!Target::Device(DeviceId::parse("pos-2").unwrap()).reaches(alone));
    }

    /// A group event reaches the members of its group only; a stored entry names a device or a
    /// group, never both; the backends' key for a group cannot be a device's or `*`.
    #[test]
    fn groups_reach_their_members() {
        let device = DeviceId::parse("pos-1").unwrap();
        let groups = Groups::parse_list("store-17,merchant-9,store-17,").unwrap();
        assert_eq!(groups.len(), 2, "repeats and empty names are dropped");
        let member = Addressee::new(&device, &groups);
        let group = |name: &str| Target::Group(GroupName::parse(name).unwrap());
        assert!(group("store-17").reaches(member));
        assert!(group("merchant-9").reaches(member));
        assert!(!group("store-18").reaches(member));
        assert!(!group("store-17").reaches(Addressee::device(&device)));
        assert!(Target::Broadcast.reaches(member));
        assert_eq!(group("store-17").as_field(), "@store-17");
        assert_eq!(
            Target::from_fields(None, Some("store-17")),
            Some(group("store-17"))
        );
        assert_eq!(Target::from_fields(Some("pos-1"), Some("store-17")), None);
        assert_eq!(Target::from_fields(None, None), None);
        assert_eq!(Target::from_fields(None, Some("bad name")), None);
        assert_eq!(
            Groups::parse_list("ok,bad name").unwrap_err().0,
            "bad name".to_string()
        );
        assert_eq!(group("store-17").shards(8), 0..8);
    }
}
