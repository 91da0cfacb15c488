//! The one backend trait the actors talk to (memory, Redis Streams and NATS JetStream implement it).
//!
//! # Contract
//! - **Shards and positions.** A backend stores `shards` append-only logs. Within one shard,
//!   positions are strictly increasing in append order; `read_after` and tails return entries in
//!   that order. Positions of different shards are unrelated.
//! - **Groups.** Shards are split into contiguous groups (Redis node groups); one tail reads one
//!   group. `groups()[g]` lists the shards of group `g`.
//! - **Epochs.** Each shard is in one epoch, a name for the current life of its stored data, which
//!   began at [`ShardState::start`]. When stored data is lost (restart without persistence, flush,
//!   a recreated or rolled-back stream) the shard gets a new epoch, so cursors from before the
//!   loss are answered with `resync` `data_lost`. Every event a backend returns carries the epoch
//!   it was read in, and a read never mixes two lives.
//! - **Tails** start at "now": they deliver only entries appended after `open_tail` returned. A
//!   tail reports a [`Gap`] when it could not read what it was due to read: entries trimmed
//!   before it read them (`expired`, the tail continues after them), or a lost life (`data_lost`:
//!   the gap's cursor is the new life's start, and the tail delivers every entry of the new life
//!   after it). A gap is reported before any event after it.
//! - **Trimming** keeps `retention` (by age, on the backend's clock) and a length cap per shard.
//!   `ShardState::trimmed_through` is the highest position that may have been removed: a cursor
//!   below it may have missed entries. Trimming may overtake any reader: a tail reports entries
//!   removed before it read them as an `expired` gap, and a page of `read_after` carries the
//!   `trimmed_through` of its read, so that a replay whose next entries were removed under it
//!   resyncs instead of jumping.
//! - **Idempotency** is atomic with the append and scoped to the item's target: an item whose key
//!   was accepted for the same device (or for a broadcast) within the dedupe window is not
//!   appended again and returns the original cursor.
//! - **Expiry** (`exp`): an event may carry an absolute expiry ([`StoredEvent::expires_ms`], Unix
//!   ms). Backends store and return it; the readers drop what has expired by the pod's clock (the
//!   tail before routing, the replay before sending): an expired event is neither delivered live
//!   nor replayed. Nothing is removed from the store for it: retention still does that.
//! - **Supersede** (`sup`): an event may carry a supersede name. A backend keeps, per shard, the
//!   newest position of each (target, name) the hub appended (`newest_of`), written with the
//!   append (Redis: in the same script; memory: under the same lock; NATS: after the publish
//!   ack, in a KV bucket). A replay skips an event when a newer one of its (target, name) is
//!   stored; live delivery sends every event. The target is part of the name: a unicast and a
//!   broadcast of one name never supersede each other. Entries of external producers carry the
//!   name but do not move the index, so every version of theirs is replayed unless the hub
//!   appended a newer one of the name. The index may point below the newest version (a lost
//!   index write), never above a stored version it has not seen: it can make a replay send too
//!   much, never lose the newest.
//! - **Partial failure.** `append` answers per item. A request that appends nothing fails as a
//!   whole; otherwise each item is appended, or not appended, or was appended to some shards only
//!   (a broadcast), or its outcome is unknown ([`ItemFailure`]).

pub mod fleet;
pub mod memory;
pub mod nats;
pub mod redis;
pub mod revocation;

use std::{ops::Range, sync::Arc, time::Duration};

use futures_util::future::BoxFuture;
use thiserror::Error;

use crate::model::{Cursor, Epoch, EventType, Position, ResyncReason, Target};

pub use memory::MemoryBackend;
pub use nats::NatsBackend;
pub use redis::RedisBackend;

/// What a backend's client library reported, shared: one failed read can answer several waiting
/// replays.
pub type Cause = Arc<dyn std::error::Error + Send + Sync>;

/// A backend operation failed. The message says what the hub was doing; the source, when there
/// is one, is the client library's own error ([`crate::report::Report`] shows both).
#[derive(Debug, Error, Clone)]
pub enum BackendError {
    /// No answer, or a connection error: a retry may succeed.
    #[error("backend unavailable: {what}")]
    Unavailable {
        what: String,
        #[source]
        cause: Option<Cause>,
    },
    /// The backend answered, but not as the hub needs (a refused command, an unexpected reply).
    #[error("backend rejected the request: {what}")]
    Rejected {
        what: String,
        #[source]
        cause: Option<Cause>,
    },
}

impl BackendError {
    pub fn unavailable(what: impl Into<String>) -> Self {
        Self::Unavailable {
            what: what.into(),
            cause: None,
        }
    }

    pub fn unavailable_by(
        what: impl Into<String>,
        cause: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::Unavailable {
            what: what.into(),
            cause: Some(Arc::from(cause.into())),
        }
    }

    pub fn rejected(what: impl Into<String>) -> Self {
        Self::Rejected {
            what: what.into(),
            cause: None,
        }
    }
}

pub type BackendResult<T> = Result<T, BackendError>;

/// An event to append, validated at the edge. A broadcast is expanded by the backend into one
/// copy per shard.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub target: Target,
    pub event_type: EventType,
    pub data: String,
    pub key: Option<String>,
    /// Absolute expiry in Unix ms (`ttl` of the item): not delivered from then on.
    pub expires_ms: Option<u64>,
    /// Supersede name: on replay only the newest of its (target, name) is sent.
    pub supersede: Option<EventType>,
    /// Of a group event: the shards to store it in, ascending and not empty (where the group's
    /// members were seen, `fleet::groups`). `None`: every shard; ignored for other targets.
    pub only_shards: Option<Vec<u32>>,
}

impl NewEvent {
    /// The shards it is appended to, of `shards`, ascending: its device's, every shard, or
    /// those its group event was given.
    pub fn stored_in(&self, shards: u32) -> Vec<u32> {
        match (&self.target, &self.only_shards) {
            (Target::Group(_), Some(only)) => only.clone(),
            (target, _) => target.shards(shards).collect(),
        }
    }
}

/// Outcome of one appended (or deduplicated) event, in input order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    /// For a broadcast: the copy on shard 0; for a group event: the copy on the first shard
    /// it was stored in.
    pub cursor: Cursor,
    pub duplicate: bool,
    /// For a broadcast or a group event stored on every shard it was given (every shard, or
    /// its members' ones), by this request or (a duplicate) by an earlier one with its key:
    /// each copy, in shard order (what the fleet
    /// API's not-acknowledged query compares acks with), so an event completed by a retry is
    /// known like any other. Empty for a unicast, and when some copy's id is not known.
    pub copies: Vec<Cursor>,
}

/// Why one item of a request was not (wholly) appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ItemFailure {
    /// Certainly not appended.
    NotAppended(String),
    /// A broadcast that reached some shards only; retrying it with its key completes it.
    Incomplete(String),
    /// The backend may or may not have appended it (a timeout, a lost connection).
    Unknown(String),
}

impl ItemFailure {
    pub fn message(&self) -> &str {
        match self {
            ItemFailure::NotAppended(message)
            | ItemFailure::Incomplete(message)
            | ItemFailure::Unknown(message) => message,
        }
    }

    /// Some copy of the item may be stored.
    pub fn may_be_stored(&self) -> bool {
        !matches!(self, ItemFailure::NotAppended(_))
    }
}

pub type ItemOutcome = Result<Appended, ItemFailure>;

/// A stored entry as read back. Cheap to clone (shared strings).
#[derive(Debug, Clone)]
pub struct StoredEvent {
    pub shard: u32,
    /// The life of the shard it was read in.
    pub epoch: Epoch,
    pub position: Position,
    /// Unix ms at which it was appended, by the backend's clock: the time in the position for
    /// memory and Redis, the message timestamp for JetStream.
    pub appended_ms: u64,
    pub target: Target,
    pub event_type: EventType,
    pub data: Arc<str>,
    /// Unix ms from which it is no longer delivered (`exp`); `None`: never expires.
    pub expires_ms: Option<u64>,
    /// Supersede name (`sup`).
    pub supersede: Option<EventType>,
}

impl StoredEvent {
    /// Whether it has expired at `now_ms` (the pod's clock).
    pub fn expired_at(&self, now_ms: u64) -> bool {
        self.expires_ms.is_some_and(|expires| expires <= now_ms)
    }

    /// Its supersede key, when it has a name.
    pub fn supersede_key(&self) -> Option<SupersedeKey> {
        self.supersede.as_ref().map(|name| SupersedeKey {
            target: self.target.clone(),
            name: name.clone(),
        })
    }
}

/// An expiry as stored (`exp` field, `Posthorn-Exp` header): plain decimal Unix ms, no sign or
/// exponent, as the hub writes it. Anything else makes the entry undeliverable.
pub fn parse_exp(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// What a supersede name is scoped to: one target (a device, or the broadcasts) and the name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SupersedeKey {
    pub target: Target,
    pub name: EventType,
}

impl SupersedeKey {
    /// `<dev>/<name>`, the field of the Redis index and the text of the NATS one: device ids
    /// (and `*`) contain no `/`, so no two keys share it.
    pub fn field(&self) -> String {
        format!("{}/{}", self.target.as_field(), self.name.as_str())
    }
}

/// One page of a shard read by `read_after`, all of one life.
#[derive(Debug, Clone)]
pub struct ReadPage {
    pub epoch: Epoch,
    pub events: Vec<StoredEvent>,
    /// Entries read, delivered or not: a page that read fewer than asked reached the end.
    pub read: usize,
    /// Position of the last entry read (delivered or not): the next page starts after it.
    pub last: Option<Position>,
    /// [`ShardState::trimmed_through`] as of the read (or after it). Above the position the page
    /// was read after, entries after it may have been removed before they were read: the page
    /// does not continue the reader's and it must resync.
    pub trimmed_through: Position,
}

/// The resume-relevant state of one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardState {
    pub epoch: Epoch,
    /// Where the current life of the shard began: a loss moves clients here.
    pub start: Position,
    /// Position of the newest entry (`Position::ZERO` when the shard is empty).
    pub head: Position,
    /// Highest position removed by trimming (`Position::ZERO` when nothing was trimmed).
    pub trimmed_through: Position,
    /// Whether the position asked about is stored (`None`: not asked, or the backend cannot
    /// tell). A cursor's own entry missing while nothing trimmed it means the stream went back
    /// in time (a restart from an older snapshot, a failover to a lagging replica).
    pub probe: Option<bool>,
}

impl ShardState {
    /// Where a cursor of this shard resumes: after its position, or a resync for a reason.
    pub fn judge(&self, cursor: &Cursor) -> Result<Position, ResyncReason> {
        let position = cursor.position;
        if cursor.epoch != self.epoch {
            return Err(ResyncReason::DataLost);
        }
        // Ahead of the newest entry, or an entry that was neither trimmed nor is stored: this
        // life of the stream went back in time and lost what the cursor saw.
        if position > self.head
            || (self.probe == Some(false)
                && position > self.trimmed_through
                && position != Position::ZERO)
        {
            return Err(ResyncReason::DataLost);
        }
        if position < self.trimmed_through {
            return Err(ResyncReason::Expired);
        }
        Ok(position)
    }
}

/// A tail could not read what it was due to read: connections of `cursor.shard` may have missed
/// events and get `resync` with `cursor` (the position the tail continues after).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    pub cursor: Cursor,
    /// `Expired` (trimmed before the tail read it) or `DataLost` (a new life of the shard).
    pub reason: ResyncReason,
}

/// One read of a tail.
#[derive(Debug, Default)]
pub struct TailBatch {
    /// Reported before `events`: no event below is from before a gap of its shard.
    pub gaps: Vec<Gap>,
    pub events: Vec<StoredEvent>,
    /// Entries read but not deliverable (missing or invalid fields), counted by the StreamTail.
    pub skipped: u64,
}

/// The per-group reader a StreamTail drives. Dropping it abandons any blocked read.
pub trait Tail: Send {
    /// Waits for the next entries (at most the configured count), or a gap.
    fn next_batch(&mut self) -> BoxFuture<'_, BackendResult<TailBatch>>;
    /// Last position read per shard of the group, for status pages.
    fn last_positions(&self) -> Vec<(u32, Position)>;
    /// Whether the tail's connection was re-established since the last call without a read
    /// failing (the client library reconnected and retried the read itself), so that the
    /// outage is counted all the same.
    fn reconnected(&mut self) -> bool {
        false
    }
}

/// How often retention is applied, for a resume window of `retention`: at least every 30 s,
/// at most every second.
pub fn trim_interval(retention: Duration) -> Duration {
    (retention / 2).clamp(Duration::from_secs(1), Duration::from_secs(30))
}

pub trait Backend: Send + Sync + 'static {
    /// `memory`, `redis` or `nats`: used in metric names and status.
    fn kind(&self) -> &'static str;
    fn shards(&self) -> u32;
    /// Shards of each group, contiguous and in order.
    fn groups(&self) -> Vec<Range<u32>>;
    /// Appends every item, answering each in input order. `Err` only when nothing was appended.
    fn append(&self, events: Vec<NewEvent>) -> BoxFuture<'_, BackendResult<Vec<ItemOutcome>>>;
    /// Opens a tail of `group` positioned at "now".
    fn open_tail(&self, group: usize) -> BoxFuture<'_, BackendResult<Box<dyn Tail>>>;
    /// Up to `limit` entries of `shard` strictly after `after` (fewer only at the end), in order,
    /// all of one life.
    fn read_after(
        &self,
        shard: u32,
        after: Position,
        limit: usize,
    ) -> BoxFuture<'_, BackendResult<ReadPage>>;
    /// The shard's life, head and trimming, and whether `probe` (a cursor's position) is stored.
    fn shard_state(
        &self,
        shard: u32,
        probe: Option<Position>,
    ) -> BoxFuture<'_, BackendResult<ShardState>>;
    /// Applies retention to the shards of `group` (run periodically by its tail). Backends
    /// shared by several pods let one pod at a time do it.
    fn trim(&self, group: usize) -> BoxFuture<'_, BackendResult<()>>;
    /// Gives up whatever `trim` holds so another pod takes over at once (the pod is stopping).
    fn stop_trimming(&self, _group: usize) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// The newest stored position of each of `keys` in life `epoch` of `shard`, as far as the
    /// supersede index knows (same order; `None`: not known, which supersedes nothing).
    fn newest_of(
        &self,
        shard: u32,
        epoch: &Epoch,
        keys: Vec<SupersedeKey>,
    ) -> BoxFuture<'_, BackendResult<Vec<Option<Position>>>>;
    /// Cheap reachability check for readiness.
    fn ping(&self) -> BoxFuture<'_, BackendResult<()>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(head: u64, trimmed: u64, probe: Option<bool>) -> ShardState {
        ShardState {
            epoch: Epoch::new("e1").unwrap(),
            start: Position::ZERO,
            head: Position::new(head, 0),
            trimmed_through: Position::new(trimmed, 0),
            probe,
        }
    }

    fn cursor(epoch: &str, ms: u64) -> Cursor {
        Cursor::new(Epoch::new(epoch).unwrap(), 0, Position::new(ms, 0))
    }

    /// A cursor resumes when it is of this life, not ahead of the head, stored (or trimmed), and
    /// not older than what trimming removed; each failure has its reason.
    #[test]
    fn cursors_are_judged_against_the_shard() {
        assert_eq!(
            state(10, 2, Some(true)).judge(&cursor("e1", 5)),
            Ok(Position::new(5, 0))
        );
        assert_eq!(
            state(10, 2, None).judge(&cursor("e1", 2)),
            Ok(Position::new(2, 0))
        );
        assert_eq!(
            state(10, 2, Some(true)).judge(&cursor("e0", 5)),
            Err(ResyncReason::DataLost)
        );
        assert_eq!(
            state(10, 2, None).judge(&cursor("e1", 11)),
            Err(ResyncReason::DataLost),
            "ahead of the head: the stream went back"
        );
        assert_eq!(
            state(10, 2, Some(false)).judge(&cursor("e1", 5)),
            Err(ResyncReason::DataLost),
            "its own entry vanished without trimming"
        );
        assert_eq!(
            state(10, 6, Some(false)).judge(&cursor("e1", 5)),
            Err(ResyncReason::Expired),
            "trimmed away: expired"
        );
        assert_eq!(
            state(0, 0, Some(false)).judge(&cursor("e1", 0)),
            Ok(Position::ZERO),
            "the head of an empty stream"
        );
    }
}
