//! The data model (docs/stream-format.md): validated device ids and event types, shards, stream positions and
//! the opaque cursor that clients send back as `Last-Event-ID`. Everything here is pure.

mod close_reason;
mod cursor;
mod ident;
mod resync;
mod shard;

pub use close_reason::CloseReason;
pub use cursor::{Cursor, CursorError, Epoch, EpochId, Position};
pub use ident::{DeviceId, EventType, IdentError, Target};
pub use resync::ResyncReason;
pub use shard::shard_of;
