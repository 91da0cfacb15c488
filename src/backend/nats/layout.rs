//! Where shards live in JetStream (docs/stream-format.md): one stream, one subject per shard,
//! `"{subject_prefix}.{shard}"`, and how a stream sequence becomes a [`Position`].
//!
//! Positions are `Position { ms: 0, seq: <stream sequence> }`. Every shard's subject lives in the
//! one stream, so they all share its sequence space, and the sequence alone is the true append
//! order. A timestamp in `ms` (as Redis ids have) would be wrong here: two messages stored in the
//! same millisecond on different pods' clocks, or a clock step, could order a later sequence
//! before an earlier one, and the SSE body's replay/live switch compares positions. The cursor
//! text keeps its `{epoch}.{shard}.{ms}-{seq}` shape, with `ms` always 0.

use crate::{
    config::NatsConfig,
    model::{Epoch, Position},
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub stream: String,
    pub prefix: String,
    pub shards: u32,
}

/// The layout of a `[nats]` configuration (also used by `posthorn shard-key`).
pub fn layout_of(nats: &NatsConfig) -> Layout {
    Layout {
        stream: nats.stream.clone(),
        prefix: nats.subject_prefix.clone(),
        shards: nats.shards,
    }
}

impl Layout {
    pub fn subject(&self, shard: u32) -> String {
        format!("{}.{shard}", self.prefix)
    }

    /// The stream's one subject filter, also the tail's consumer filter: every shard subject.
    pub fn filter(&self) -> String {
        format!("{}.*", self.prefix)
    }

    /// The shard a stored message's subject names; `None` for a subject the filter matched but
    /// that is no shard of ours (`{prefix}.x`, `{prefix}.99999`): such a message is skipped.
    pub fn shard_of_subject(&self, subject: &str) -> Option<u32> {
        let number = subject.strip_prefix(&self.prefix)?.strip_prefix('.')?;
        // Plain digits only: u32::from_str would also take "+3", which is not "3".
        if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let shard: u32 = number.parse().ok()?;
        // "03" is a different subject from "3": producers write the decimal shard number.
        (shard < self.shards && number == shard.to_string()).then_some(shard)
    }
}

pub fn position(sequence: u64) -> Position {
    Position::new(0, sequence)
}

/// The epoch of a stream: its creation time in nanoseconds, in base 36. It is stored with the
/// stream, so it survives server restarts (with the store directory); deleting and recreating the
/// stream changes it.
pub fn epoch_of(created_unix_nanos: i128) -> Epoch {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut value = created_unix_nanos.unsigned_abs();
    let mut text = Vec::new();
    loop {
        text.push(DIGITS[(value % 36) as usize]);
        value /= 36;
        if value == 0 {
            break;
        }
    }
    text.reverse();
    // At most 25 base-36 digits for any i128, all alphanumeric: always a valid epoch.
    Epoch::new(std::str::from_utf8(&text).expect("ASCII digits"))
        .expect("base-36 text of at most 25 digits is a valid epoch")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            stream: "POSTHORN".into(),
            prefix: "posthorn.ev".into(),
            shards: 64,
        }
    }

    /// Subjects follow docs/stream-format.md and read back to their shard; anything else is no shard.
    #[test]
    fn subjects_follow_the_spec() {
        let layout = layout();
        assert_eq!(layout.subject(17), "posthorn.ev.17");
        assert_eq!(layout.filter(), "posthorn.ev.*");
        assert_eq!(layout.shard_of_subject("posthorn.ev.17"), Some(17));
        assert_eq!(layout.shard_of_subject("posthorn.ev.0"), Some(0));
        for other in [
            "posthorn.ev.64",
            "posthorn.ev.017",
            "posthorn.ev.+1",
            "posthorn.ev.x",
            "posthorn.ev.",
            "posthorn.ev17",
            "other.ev.1",
            "posthorn.ev.99999999999",
        ] {
            assert_eq!(layout.shard_of_subject(other), None, "{other}");
        }
    }

    /// Epochs are short, valid, and differ for different creation times.
    #[test]
    fn epochs_name_creation_times() {
        let a = epoch_of(1_732_999_999_123_456_789);
        let b = epoch_of(1_732_999_999_123_456_790);
        assert_ne!(a, b);
        assert!(a.as_str().len() <= 13, "{a:?}");
        assert_eq!(epoch_of(0).as_str(), "0");
        assert_eq!(epoch_of(35).as_str(), "z");
        assert_eq!(epoch_of(36).as_str(), "10");
        assert!(Epoch::new(epoch_of(i128::MIN).as_str()).is_ok());
    }
}
