//! Reading stored JetStream messages into events (docs/stream-format.md, NATS format).
//!
//! Messages come from producers we do not control. One without exactly one of the
//! `Posthorn-Dev` and `Posthorn-Group` headers, with an invalid device id or group name, event type or supersede name, a `Posthorn-Exp` that is not a decimal number
//! of Unix ms, on a subject that is no shard, or with a body that is not UTF-8 text is skipped
//! and counted; it never stops a tail or a replay. Header names are matched
//! exactly as written here (NATS headers are case-sensitive).

use std::sync::Arc;

use async_nats::HeaderMap;

use super::layout::position;
use crate::{
    backend::{parse_exp, StoredEvent},
    model::{Epoch, EventType, Target},
};

/// Device id, or `*` for a broadcast copy.
pub const DEV_HEADER: &str = "Posthorn-Dev";
/// Group name, for a group event's copy (instead of [`DEV_HEADER`]).
pub const GROUP_HEADER: &str = "Posthorn-Group";
/// Event type; missing means `message`.
pub const TYPE_HEADER: &str = "Posthorn-Type";
/// Absolute expiry, decimal Unix ms; missing means never.
pub const EXP_HEADER: &str = "Posthorn-Exp";
/// Supersede name; missing means none.
pub const SUPERSEDE_HEADER: &str = "Posthorn-Supersede";
/// JetStream's own deduplication header: carries the idempotency key (see [`message_id`]).
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// The `Nats-Msg-Id` of an item with idempotency key `key` as the hub publishes it: scoped to
/// the item's target, so the same key for another device, for a broadcast, or one that looks like
/// a derived id never collides. `d/<device>/<key>` for a device; `b/<shard>/<key>` for the copy
/// of a broadcast on `shard` (its copies need ids of their own: JetStream deduplicates per
/// stream), `g/<group>/<shard>/<key>` for a group event's. Device ids, group names and shard
/// numbers contain no `/`, so no two items share an id.
pub fn message_id(target: &Target, shard: u32, key: &str) -> String {
    match target {
        Target::Device(device) => format!("d/{device}/{key}"),
        Target::Broadcast => format!("b/{shard}/{key}"),
        Target::Group(group) => format!("g/{group}/{shard}/{key}"),
    }
}

/// The event stored at `sequence` on `shard` in life `epoch` at `published_ms`, or `None` when
/// it cannot be delivered.
pub fn event(
    shard: u32,
    epoch: &Epoch,
    sequence: u64,
    published_ms: u64,
    headers: Option<&HeaderMap>,
    payload: &[u8],
) -> Option<StoredEvent> {
    let headers = headers?;
    let target = Target::from_fields(
        headers.get(DEV_HEADER).map(|value| value.as_str()),
        headers.get(GROUP_HEADER).map(|value| value.as_str()),
    )?;
    let event_type = match headers.get(TYPE_HEADER) {
        None => EventType::message(),
        Some(value) => EventType::parse_published(value.as_str()).ok()?,
    };
    let expires_ms = match headers.get(EXP_HEADER) {
        None => None,
        Some(value) => Some(parse_exp(value.as_str())?),
    };
    let supersede = match headers.get(SUPERSEDE_HEADER) {
        None => None,
        Some(value) => Some(EventType::parse(value.as_str()).ok()?),
    };
    Some(StoredEvent {
        shard,
        epoch: epoch.clone(),
        position: position(sequence),
        appended_ms: published_ms,
        target,
        event_type,
        data: Arc::from(std::str::from_utf8(payload).ok()?),
        expires_ms,
        supersede,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, *value);
        }
        headers
    }

    /// A well-formed message becomes an event at its stream sequence; the type defaults to
    /// `message` and `*` is a broadcast copy.
    #[test]
    fn messages_become_events() {
        let unicast = event(
            3,
            &Epoch::new("e").unwrap(),
            42,
            1_700_000_000_000,
            Some(&headers(&[(DEV_HEADER, "pos-1")])),
            b"a\nb",
        )
        .unwrap();
        assert_eq!(unicast.position, position(42));
        assert_eq!(unicast.appended_ms, 1_700_000_000_000);
        assert_eq!(unicast.shard, 3);
        assert_eq!(unicast.event_type.as_str(), "message");
        assert_eq!(&*unicast.data, "a\nb");
        let broadcast = event(
            0,
            &Epoch::new("e").unwrap(),
            7,
            0,
            Some(&headers(&[(DEV_HEADER, "*"), (TYPE_HEADER, "price.table")])),
            b"",
        )
        .unwrap();
        assert_eq!(broadcast.target, Target::Broadcast);
        assert_eq!(broadcast.event_type.as_str(), "price.table");
    }

    /// `Posthorn-Exp` and `Posthorn-Supersede` are read when valid; a message with a bad one is
    /// refused (skipped and counted by the reader).
    #[test]
    fn expiry_and_supersede_headers() {
        let epoch = Epoch::new("e").unwrap();
        let read = |pairs: &[(&str, &str)]| event(0, &epoch, 1, 0, Some(&headers(pairs)), b"x");
        let event = read(&[
            (DEV_HEADER, "pos-1"),
            (EXP_HEADER, "1700000000000"),
            (SUPERSEDE_HEADER, "prices"),
        ])
        .unwrap();
        assert_eq!(event.expires_ms, Some(1_700_000_000_000));
        assert_eq!(event.supersede.unwrap().as_str(), "prices");
        let plain = read(&[(DEV_HEADER, "pos-1")]).unwrap();
        assert_eq!((plain.expires_ms, plain.supersede), (None, None));
        for bad in [
            (EXP_HEADER, "soon"),
            (EXP_HEADER, "+5"),
            (SUPERSEDE_HEADER, "two words"),
        ] {
            assert!(read(&[(DEV_HEADER, "pos-1"), bad]).is_none(), "{bad:?}");
        }
    }

    /// Message ids are scoped to the target: no key of one target can produce another's id.
    #[test]
    fn message_ids_are_scoped_to_the_target() {
        let device = Target::Device(crate::model::DeviceId::parse("pos-1").unwrap());
        assert_eq!(message_id(&device, 9, "k"), "d/pos-1/k");
        assert_eq!(message_id(&Target::Broadcast, 3, "k"), "b/3/k");
        assert_ne!(
            message_id(&Target::Broadcast, 3, "k"),
            message_id(&device, 3, "k:3")
        );
    }

    /// Messages that cannot be delivered are refused, never a panic.
    #[test]
    fn undeliverable_messages_are_refused() {
        let cases: [(Option<HeaderMap>, &[u8]); 6] = [
            (None, b"no headers"),
            (Some(headers(&[(TYPE_HEADER, "t")])), b"no device"),
            (Some(headers(&[("posthorn-dev", "pos-1")])), b"wrong case"),
            (Some(headers(&[(DEV_HEADER, "bad device")])), b"x"),
            (
                Some(headers(&[(DEV_HEADER, "pos-1"), (TYPE_HEADER, "bad type")])),
                b"x",
            ),
            (Some(headers(&[(DEV_HEADER, "pos-1")])), &[0xff, 0xfe]),
        ];
        for (headers, payload) in &cases {
            assert!(
                event(
                    1,
                    &Epoch::new("e").unwrap(),
                    1,
                    0,
                    headers.as_ref(),
                    payload
                )
                .is_none(),
                "{headers:?} {payload:?}"
            );
        }
    }
}
