//! The supersede index of the NATS backend (docs/stream-format.md): a second stream,
//! `{stream}_SUP`, over `{subject_prefix}.sup.>`, that keeps the last message of each subject
//! (`max_msgs_per_subject` 1) for `nats.retention`.
//!
//! One subject per shard and supersede key: `{prefix}.sup.<shard>.<hex of "<dev>/<name>">` (hex,
//! because device ids may hold `:` and `..`, which a subject token cannot). Its payload is
//! `<epoch> <position>` of the newest event of that key the hub appended. JetStream has no
//! scripts, so it is written after the event's publish ack, newest-wins: read the subject's last
//! message, and publish only when ours is newer, with `Nats-Expected-Last-Subject-Sequence` so a
//! concurrent writer makes us read again. A write that fails leaves an older position there:
//! the replay then sends the versions after it, never less than the newest. Entries older than
//! retention expire with the events they name, so the index stays as large as what is stored.
//! Values of another epoch (the events' stream was re-created) are ignored.

use async_nats::jetstream::{
    self,
    context::PublishErrorKind,
    stream::{self, DiscardPolicy, RetentionPolicy, StorageType},
};
use bytes::Bytes;

use super::{found, layout::Layout, unavailable, NatsSettings};
use crate::{
    backend::{BackendError, BackendResult, SupersedeKey},
    model::{Epoch, Position},
};

/// Attempts of one newest-wins write against concurrent writers of the same key.
const WRITE_ATTEMPTS: usize = 3;

/// The index stream's name: the events' stream with `_SUP`.
pub fn stream_name(layout: &Layout) -> String {
    format!("{}_SUP", layout.stream)
}

/// Subject of `key` on `shard`.
pub fn subject(layout: &Layout, shard: u32, key: &SupersedeKey) -> String {
    let hex: String = key
        .field()
        .bytes()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    format!("{}.sup.{shard}.{hex}", layout.prefix)
}

/// The index stream posthorn needs.
pub fn wanted_stream(layout: &Layout, settings: &NatsSettings) -> stream::Config {
    stream::Config {
        name: stream_name(layout),
        subjects: vec![format!("{}.sup.>", layout.prefix)],
        max_age: settings.nats.retention,
        max_messages_per_subject: 1,
        discard: DiscardPolicy::Old,
        storage: StorageType::File,
        retention: RetentionPolicy::Limits,
        num_replicas: settings.nats.replicas,
        description: Some("posthorn supersede index: newest position per shard and key".into()),
        ..Default::default()
    }
}

/// Creates the index stream when it is missing (start-up); an existing one is used as it is.
pub async fn ensure(
    jetstream: &jetstream::Context,
    layout: &Layout,
    settings: &NatsSettings,
) -> BackendResult<()> {
    jetstream
        .get_or_create_stream(wanted_stream(layout, settings))
        .await
        .map(|_| ())
        .map_err(|error| {
            BackendError::rejected(format!(
                "nats: cannot create the supersede index stream {}: {error}",
                stream_name(layout)
            ))
        })
}

/// `<epoch> <position>`.
fn value(epoch: &Epoch, position: Position) -> String {
    format!("{} {position}", epoch.as_str())
}

/// The position of a stored value, when it is of life `epoch`.
fn parse_value(payload: &[u8], epoch: &Epoch) -> Option<Position> {
    let (life, position) = std::str::from_utf8(payload).ok()?.split_once(' ')?;
    (life == epoch.as_str())
        .then(|| position.parse().ok())
        .flatten()
}

/// The last message of `subject`: `(its sequence, its payload)`, `None` when there is none.
async fn last(
    jetstream: &jetstream::Context,
    layout: &Layout,
    subject: &str,
) -> BackendResult<Option<(u64, Bytes)>> {
    let stream = jetstream
        .get_stream_no_info(stream_name(layout))
        .await
        .map_err(|error| unavailable("supersede index", error))?;
    let last = found(stream.get_last_raw_message_by_subject(subject).await)
        .map_err(|error| unavailable("supersede index read", error))?;
    Ok(last.map(|message| (message.sequence, message.payload)))
}

/// Records `position` (life `epoch`) as the newest of `key` on `shard`, unless a newer one of
/// the same life is there already.
pub async fn record(
    jetstream: &jetstream::Context,
    layout: &Layout,
    shard: u32,
    key: &SupersedeKey,
    epoch: &Epoch,
    position: Position,
) -> BackendResult<()> {
    let subject = subject(layout, shard, key);
    for _ in 0..WRITE_ATTEMPTS {
        let expected = match last(jetstream, layout, &subject).await? {
            Some((_, payload)) if parse_value(&payload, epoch).is_some_and(|p| p >= position) => {
                return Ok(());
            }
            Some((sequence, _)) => sequence,
            // 0: the subject must still have no message.
            None => 0,
        };
        let publish = jetstream::message::PublishMessage::build()
            .payload(Bytes::from(value(epoch, position)))
            .expected_last_subject_sequence(expected);
        let acked = match jetstream.send_publish(subject.clone(), publish).await {
            Ok(ack) => ack.await,
            Err(error) => Err(error),
        };
        match acked {
            Ok(_) => return Ok(()),
            // Another writer got there first: read again.
            Err(error) if error.kind() == PublishErrorKind::WrongLastSequence => continue,
            Err(error) => return Err(unavailable("supersede index write", error)),
        }
    }
    Err(BackendError::unavailable(format!(
        "nats: supersede index of {subject}: still contended after {WRITE_ATTEMPTS} attempts"
    )))
}

/// The newest position of each key on `shard` in life `epoch` (read concurrently).
pub async fn newest_of(
    jetstream: &jetstream::Context,
    layout: &Layout,
    shard: u32,
    epoch: &Epoch,
    keys: &[SupersedeKey],
) -> BackendResult<Vec<Option<Position>>> {
    let reads = keys.iter().map(|key| async move {
        let found = last(jetstream, layout, &subject(layout, shard, key)).await?;
        Ok(found.and_then(|(_, payload)| parse_value(&payload, epoch)))
    });
    futures_util::future::join_all(reads)
        .await
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DeviceId, EventType, Target};

    fn layout() -> Layout {
        Layout {
            stream: "POSTHORN".into(),
            prefix: "posthorn.ev".into(),
            shards: 64,
        }
    }

    /// Subjects are valid single tokens for any device id (`:` and `..` included) and keep a
    /// unicast and a broadcast of one name apart.
    #[test]
    fn subjects_encode_the_key() {
        let name = EventType::parse("prices").unwrap();
        let device = SupersedeKey {
            target: Target::Device(DeviceId::parse("a..b:c").unwrap()),
            name: name.clone(),
        };
        let broadcast = SupersedeKey {
            target: Target::Broadcast,
            name,
        };
        let unicast = subject(&layout(), 3, &device);
        assert_eq!(unicast, "posthorn.ev.sup.3.612e2e623a632f707269636573");
        assert_ne!(unicast, subject(&layout(), 3, &broadcast));
        assert_eq!(stream_name(&layout()), "POSTHORN_SUP");
    }

    /// Values name their life: another life's position is unknown, not a position.
    #[test]
    fn values_are_read_in_their_life() {
        let (e1, e2) = (Epoch::new("e1").unwrap(), Epoch::new("e2").unwrap());
        let stored = value(&e1, Position::new(0, 42));
        assert_eq!(
            parse_value(stored.as_bytes(), &e1),
            Some(Position::new(0, 42))
        );
        assert_eq!(parse_value(stored.as_bytes(), &e2), None);
        assert_eq!(parse_value(b"garbage", &e1), None);
    }
}
