//! The one backend trait the actors talk to (memory, Redis Streams and NATS JetStream implement it).
//!
//! # Contract
//! - **Shards and positions.** A backend stores `shards` append-only logs. Within one shard,
//!   positions are strictly increasing in append order; `read_after` and tails return entries in
//!   that order. Positions of different shards are unrelated.
//! - **Groups.** Shards are split into contiguous groups (Redis node groups); one tail reads one
//!   group. `groups()[g]` lists the shards of group `g`.
//! - **Epoch.** Each shard belongs to one epoch, a name for the current life of its stored data.
//!   When stored data is lost (restart without persistence, flush, recreated stream) the epoch
//!   changes, so cursors from before the loss are answered with `resync` `data_lost`.
//! - **Tails** start at "now": they deliver only entries appended after `open_tail` returned. A
//!   tail reports a [`Gap`] when entries of a shard were trimmed before it could read them.
//! - **Trimming** keeps `retention` (by age) and a length cap per shard. `ShardState::trimmed_through`
//!   is the highest position ever removed by trimming: a cursor below it may have missed entries.
//! - **Idempotency** is atomic with the append: an item whose key was accepted within the dedupe
//!   window is not appended again and returns the original cursor.

pub mod memory;
pub mod nats;
pub mod redis;

use std::{ops::Range, sync::Arc};

use futures_util::future::BoxFuture;
use thiserror::Error;

use crate::model::{Cursor, Epoch, EventType, Position, Target};

pub use memory::MemoryBackend;
pub use nats::NatsBackend;
pub use redis::RedisBackend;

#[derive(Debug, Error, Clone)]
pub enum BackendError {
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    #[error("backend rejected the request: {0}")]
    Rejected(String),
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
}

/// Outcome of one appended (or deduplicated) event, in input order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    /// For a broadcast: the copy on shard 0.
    pub cursor: Cursor,
    pub duplicate: bool,
}

/// A stored entry as read back. Cheap to clone (shared strings).
#[derive(Debug, Clone)]
pub struct StoredEvent {
    pub shard: u32,
    pub position: Position,
    pub target: Target,
    pub event_type: EventType,
    pub data: Arc<str>,
}

/// The resume-relevant state of one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardState {
    pub epoch: Epoch,
    /// Position of the newest entry (`Position::ZERO` when the shard is empty).
    pub head: Position,
    /// Highest position removed by trimming (`Position::ZERO` when nothing was trimmed).
    pub trimmed_through: Position,
}

/// Entries of a shard were removed before the tail read them: connections of that shard may have
/// missed events and get `resync` with `cursor` (the position the tail continues after).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    pub cursor: Cursor,
    pub reason: GapReason,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapReason {
    /// Trimmed by retention before the tail read them.
    Expired,
    /// The backend lost its data (new epoch).
    DataLost,
}

/// One read of a tail.
#[derive(Debug, Default)]
pub struct TailBatch {
    /// Epoch per shard of the events below (the tail's group shares one epoch).
    pub epoch: Option<Epoch>,
    pub events: Vec<StoredEvent>,
    pub gaps: Vec<Gap>,
    /// Entries read but not deliverable (missing or invalid fields), counted by the StreamTail.
    pub skipped: u64,
    /// Unix ms at which the newest entry read was appended, for the lag metric, when positions
    /// do not carry that time (JetStream positions are stream sequences). `None`: the lag comes
    /// from `Position::ms` of the newest event (memory, Redis).
    pub newest_ms: Option<u64>,
}

/// The per-group reader a StreamTail drives. Dropping it abandons any blocked read.
pub trait Tail: Send {
    /// Waits for the next entries (at most the configured count), or a gap.
    fn next_batch(&mut self) -> BoxFuture<'_, BackendResult<TailBatch>>;
    /// Last position read per shard of the group, for status pages.
    fn last_positions(&self) -> Vec<(u32, Position)>;
}

pub trait Backend: Send + Sync + 'static {
    /// `memory`, `redis` or `nats`: used in metric names and status.
    fn kind(&self) -> &'static str;
    fn shards(&self) -> u32;
    /// Shards of each group, contiguous and in order.
    fn groups(&self) -> Vec<Range<u32>>;
    fn append(&self, events: Vec<NewEvent>) -> BoxFuture<'_, BackendResult<Vec<Appended>>>;
    /// Opens a tail of `group` positioned at "now".
    fn open_tail(&self, group: usize) -> BoxFuture<'_, BackendResult<Box<dyn Tail>>>;
    /// Up to `limit` entries of `shard` strictly after `after`, in order.
    fn read_after(
        &self,
        shard: u32,
        after: Position,
        limit: usize,
    ) -> BoxFuture<'_, BackendResult<Vec<StoredEvent>>>;
    fn shard_state(&self, shard: u32) -> BoxFuture<'_, BackendResult<ShardState>>;
    /// Applies retention to the shards of `group` (run periodically by its tail).
    fn trim(&self, group: usize) -> BoxFuture<'_, BackendResult<()>>;
    /// Cheap reachability check for readiness.
    fn ping(&self) -> BoxFuture<'_, BackendResult<()>>;
}
