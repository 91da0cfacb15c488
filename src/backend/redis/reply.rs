//! Reading Redis replies (RESP2, the protocol our clients speak) into entries and positions.
//!
//! Entries come from producers we do not control. An entry without exactly one of `dev` and
//! `grp`, without `data`, with an invalid device id or group name, event type or supersede name (`sup`), an `exp` that is not a decimal
//! number of Unix ms, or a payload that is not UTF-8 text is skipped and counted; it never stops
//! a tail or a replay.

use std::sync::Arc;

use fred::types::Value;

use crate::{
    backend::{parse_exp, StoredEvent},
    model::{Epoch, EventType, Position, Target},
};

pub fn text(value: &Value) -> Option<&str> {
    match value {
        Value::String(text) => Some(text),
        Value::Bytes(bytes) => std::str::from_utf8(bytes).ok(),
        _ => None,
    }
}

pub fn position(value: &Value) -> Option<Position> {
    text(value)?.parse().ok()
}

/// The elements of an array reply (nothing for a nil reply).
pub fn items(value: &Value) -> &[Value] {
    match value {
        Value::Array(items) => items,
        _ => &[],
    }
}

/// Entries as read by XRANGE or one stream of an XREAD reply: `[[id, [field, value, ...]], ...]`.
pub struct Entries {
    pub events: Vec<StoredEvent>,
    /// Of every entry, deliverable or not, in order.
    pub positions: Vec<Position>,
    pub skipped: u64,
    /// Position of the last entry, skipped or not: reading continues after it.
    pub last: Option<Position>,
}

/// The entries of `shard` in a reply, read in life `epoch`.
pub fn entries(shard: u32, epoch: &Epoch, reply: &Value) -> Entries {
    let mut parsed = Entries {
        events: Vec::new(),
        positions: Vec::new(),
        skipped: 0,
        last: None,
    };
    for entry in items(reply) {
        let parts = items(entry);
        let Some(position) = parts.first().and_then(position) else {
            parsed.skipped += 1;
            continue;
        };
        parsed.last = Some(position);
        parsed.positions.push(position);
        match parts
            .get(1)
            .and_then(|fields| event(shard, epoch, position, fields))
        {
            Some(event) => parsed.events.push(event),
            None => parsed.skipped += 1,
        }
    }
    parsed
}

fn event(shard: u32, epoch: &Epoch, position: Position, fields: &Value) -> Option<StoredEvent> {
    let (mut dev, mut group, mut event_type, mut data) = (None, None, None, None);
    let (mut expires_ms, mut supersede) = (None, None);
    for pair in items(fields).chunks(2) {
        let [name, value] = pair else { continue };
        match text(name) {
            Some("dev") => dev = Some(text(value)?),
            Some("grp") => group = Some(text(value)?),
            Some("type") => event_type = Some(text(value)?),
            Some("data") => data = Some(text(value)?),
            Some("exp") => expires_ms = Some(parse_exp(text(value)?)?),
            Some("sup") => supersede = Some(EventType::parse(text(value)?).ok()?),
            _ => {}
        }
    }
    Some(StoredEvent {
        shard,
        epoch: epoch.clone(),
        position,
        appended_ms: position.ms,
        target: Target::from_fields(dev, group)?,
        event_type: match event_type {
            None => EventType::message(),
            Some(text) => EventType::parse_published(text).ok()?,
        },
        data: Arc::from(data?),
        expires_ms,
        supersede,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(text: &str) -> Value {
        Value::String(text.into())
    }

    fn entry(id: &str, fields: &[&str]) -> Value {
        Value::Array(vec![
            s(id),
            Value::Array(fields.iter().map(|f| s(f)).collect()),
        ])
    }

    /// Valid entries become events (type defaults to `message`); bad ones are skipped and
    /// counted, and reading still moves past them.
    #[test]
    fn entries_skip_what_they_cannot_deliver() {
        let reply = Value::Array(vec![
            entry("1-0", &["dev", "pos-1", "data", "a"]),
            entry("1-1", &["dev", "*", "type", "t", "data", "b", "extra", "x"]),
            entry("1-2", &["data", "no device"]),
            entry("1-3", &["dev", "pos-1"]),
            entry("1-4", &["dev", "bad device", "data", "x"]),
            entry("1-5", &["dev", "pos-1", "type", "bad type", "data", "x"]),
            Value::Array(vec![
                s("1-6"),
                Value::Array(vec![
                    s("dev"),
                    s("pos-1"),
                    s("data"),
                    Value::Bytes(vec![0xff, 0xfe].into()),
                ]),
            ]),
            entry("1-7", &["grp", "store-17", "data", "c"]),
            entry("1-8", &["dev", "pos-1", "grp", "store-17", "data", "both"]),
            entry("1-9", &["grp", "store 17", "data", "bad group"]),
        ]);
        let parsed = entries(3, &Epoch::new("e").unwrap(), &reply);
        assert_eq!(parsed.events.len(), 3);
        assert_eq!(parsed.skipped, 7);
        assert_eq!(parsed.last, Some(Position::new(1, 9)));
        assert_eq!(
            parsed.events[2].target,
            Target::Group(crate::model::GroupName::parse("store-17").unwrap())
        );
        assert_eq!(parsed.events[0].event_type.as_str(), "message");
        assert_eq!(parsed.events[1].target, Target::Broadcast);
        assert_eq!(&*parsed.events[1].data, "b");
        assert_eq!(parsed.events[0].expires_ms, None);
        assert_eq!(parsed.events[0].supersede, None);
    }

    /// `exp` and `sup` are read when valid; an entry with a bad one is skipped (and counted), so
    /// a malformed expiry never makes an event immortal by accident.
    #[test]
    fn expiry_and_supersede_fields() {
        let reply = Value::Array(vec![
            entry(
                "2-0",
                &[
                    "dev",
                    "pos-1",
                    "data",
                    "a",
                    "exp",
                    "1700000000000",
                    "sup",
                    "prices",
                ],
            ),
            entry("2-1", &["dev", "pos-1", "data", "b", "exp", "soon"]),
            entry("2-2", &["dev", "pos-1", "data", "c", "exp", "-5"]),
            entry("2-3", &["dev", "pos-1", "data", "d", "sup", "two words"]),
            entry("2-4", &["dev", "pos-1", "data", "e", "exp", ""]),
        ]);
        let parsed = entries(0, &Epoch::new("e").unwrap(), &reply);
        assert_eq!(parsed.events.len(), 1);
        assert_eq!(parsed.skipped, 4);
        let event = &parsed.events[0];
        assert_eq!(event.expires_ms, Some(1_700_000_000_000));
        assert_eq!(event.supersede.as_ref().unwrap().as_str(), "prices");
        assert!(event.expired_at(1_700_000_000_000));
        assert!(!event.expired_at(1_699_999_999_999));
    }
}
