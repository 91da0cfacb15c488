//! Reading stored JetStream messages into events (SPEC 3, NATS format).
//!
//! Messages come from producers we do not control. One without a `Posthorn-Dev` header, with an
//! invalid device id or event type, on a subject that is no shard, or with a body that is not
//! UTF-8 text is skipped and counted; it never stops a tail or a replay. Header names are matched
//! exactly as written here (NATS headers are case-sensitive).

use std::sync::Arc;

use async_nats::HeaderMap;

use super::layout::position;
use crate::{
    backend::StoredEvent,
    model::{EventType, Target},
};

/// Device id, or `*` for a broadcast copy.
pub const DEV_HEADER: &str = "Posthorn-Dev";
/// Event type; missing means `message`.
pub const TYPE_HEADER: &str = "Posthorn-Type";
/// JetStream's own deduplication header: carries the idempotency key.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// The event stored at `sequence` on `shard`, or `None` when it cannot be delivered.
pub fn event(
    shard: u32,
    sequence: u64,
    headers: Option<&HeaderMap>,
    payload: &[u8],
) -> Option<StoredEvent> {
    let headers = headers?;
    let target = Target::from_field(headers.get(DEV_HEADER)?.as_str()).ok()?;
    let event_type = match headers.get(TYPE_HEADER) {
        None => EventType::message(),
        Some(value) => EventType::parse(value.as_str()).ok()?,
    };
    Some(StoredEvent {
        shard,
        position: position(sequence),
        target,
        event_type,
        data: Arc::from(std::str::from_utf8(payload).ok()?),
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
        let unicast = event(3, 42, Some(&headers(&[(DEV_HEADER, "pos-1")])), b"a\nb").unwrap();
        assert_eq!(unicast.position, position(42));
        assert_eq!(unicast.shard, 3);
        assert_eq!(unicast.event_type.as_str(), "message");
        assert_eq!(&*unicast.data, "a\nb");
        let broadcast = event(
            0,
            7,
            Some(&headers(&[(DEV_HEADER, "*"), (TYPE_HEADER, "price.table")])),
            b"",
        )
        .unwrap();
        assert_eq!(broadcast.target, Target::Broadcast);
        assert_eq!(broadcast.event_type.as_str(), "price.table");
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
                event(1, 1, headers.as_ref(), payload).is_none(),
                "{headers:?} {payload:?}"
            );
        }
    }
}
