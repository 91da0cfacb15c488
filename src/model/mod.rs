//! The data model (docs/stream-format.md): validated device ids and event types, shards, stream positions and
//! the opaque cursor that clients send back as `Last-Event-ID`. Everything here is pure.

mod close_reason;
mod credential;
mod cursor;
mod ident;
mod resync;
mod shard;

pub use close_reason::CloseReason;
pub use credential::Credential;
pub use cursor::{Cursor, CursorError, Epoch, EpochId, Position};
pub use ident::{Addressee, DeviceId, EventType, GroupName, Groups, IdentError, Target};
pub use resync::ResyncReason;
pub use shard::shard_of;

/// The wall clock in Unix milliseconds, the unit of positions (0 if the clock is before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|since| since.as_millis() as u64)
        .unwrap_or(0)
}
