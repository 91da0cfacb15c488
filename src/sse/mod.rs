//! SSE on the wire: framing (pure) and the response body that drains a connection's queue.

pub mod body;
pub mod control;
pub mod frame;
pub mod queue;

use bytes::Bytes;

use crate::model::Position;

/// What travels through a connection's bounded queue (and its replay channel).
///
/// Events carry their shard position so the body can drop live events already replayed. The
/// frame bytes are shared: a broadcast is framed once and the same buffer is queued everywhere.
#[derive(Debug, Clone)]
pub enum QueueItem {
    Event {
        position: Position,
        frame: Bytes,
    },
    /// Replay starts after this position: live events at or before it are already known.
    Floor(Position),
    Ping,
    /// `retry: <ms>`: a draining pod tells the client when to come back before closing it.
    Retry(u32),
}
