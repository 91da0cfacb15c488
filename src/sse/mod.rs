//! SSE on the wire, pure: how events, resyncs, pings and `retry:` are framed, and the items a
//! stream's queue and replay channel carry (the body that writes them is in `stream/`).

pub mod frame;

use bytes::Bytes;

use crate::model::{EpochId, Position, ResyncReason};

/// What travels through a connection's bounded queue (and its replay channel).
///
/// Events carry their epoch and shard position, so the body can drop live events it already
/// replayed and events of a life of the data it has left (after a `resync`). The frame bytes are
/// shared: a broadcast is framed once and the same buffer is queued everywhere.
#[derive(Debug, Clone)]
pub enum QueueItem {
    Event {
        epoch: EpochId,
        position: Position,
        /// Unix ms at which the backend stored it (0: unknown), for the delivery lag.
        appended_ms: u64,
        frame: Bytes,
    },
    /// The replay starts after this position of this epoch (the client's cursor): live events at
    /// or before it are already known to the client.
    Floor {
        epoch: EpochId,
        position: Position,
    },
    /// `event: resync`: the client continues after `position` of `epoch`. The body writes it
    /// unless the client already heard of this loss (see `body.rs`).
    Resync {
        epoch: EpochId,
        position: Position,
        reason: ResyncReason,
        frame: Bytes,
    },
    /// The replay has sent everything: the body switches to the live queue. A replay channel
    /// that closes without it was cut short (a drain): the stream ends there.
    ReplayEnd,
    Ping,
    /// `retry: <ms>`: a draining pod tells the client when to come back before closing it.
    Retry(u32),
}
