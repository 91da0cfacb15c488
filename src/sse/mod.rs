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

/// The last words of a stream that ends cleanly, written after everything queued: when to come
/// back (a drain), or why the client must come back with another token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Farewell {
    /// `retry: <ms>`: the drain's reconnect delay.
    Retry(u32),
    /// `event: token_expired` with the token's `exp` (Unix seconds): reconnect with a fresh one.
    TokenExpired { exp: u64 },
    /// `event: revoked` with the revocation's time (Unix seconds): this device's tokens issued
    /// until then are refused.
    Revoked { at: u64 },
}

/// Values are at most 62 bits, so the kind fits in the top two of a `u64` (0 = none).
const FAREWELL_VALUE: u64 = (1 << 62) - 1;

impl Farewell {
    pub fn frame(self) -> Bytes {
        match self {
            Farewell::Retry(ms) => frame::retry(ms),
            Farewell::TokenExpired { exp } => {
                frame::named_event("token_expired", &format!("{{\"exp\":{exp}}}"))
            }
            Farewell::Revoked { at } => {
                frame::named_event("revoked", &format!("{{\"revoked_at\":{at}}}"))
            }
        }
    }

    /// As one number (never 0), for an atomic.
    pub fn encode(self) -> u64 {
        let (kind, value) = match self {
            Farewell::Retry(ms) => (1, u64::from(ms)),
            Farewell::TokenExpired { exp } => (2, exp),
            Farewell::Revoked { at } => (3, at),
        };
        kind << 62 | (value & FAREWELL_VALUE)
    }

    pub fn decode(encoded: u64) -> Option<Self> {
        let value = encoded & FAREWELL_VALUE;
        match encoded >> 62 {
            1 => Some(Farewell::Retry(value as u32)),
            2 => Some(Farewell::TokenExpired { exp: value }),
            3 => Some(Farewell::Revoked { at: value }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every farewell survives the atomic's encoding, and frames as its event without an `id:`.
    #[test]
    fn farewells_encode_and_frame() {
        for farewell in [
            Farewell::Retry(1),
            Farewell::Retry(u32::MAX),
            Farewell::TokenExpired { exp: 1_796_070_072 },
            Farewell::Revoked { at: 0 },
        ] {
            assert_ne!(farewell.encode(), 0);
            assert_eq!(Farewell::decode(farewell.encode()), Some(farewell));
        }
        assert_eq!(Farewell::decode(0), None);
        assert_eq!(
            &Farewell::TokenExpired { exp: 17 }.frame()[..],
            b"event: token_expired\ndata: {\"exp\":17}\n\n"
        );
        assert_eq!(
            &Farewell::Revoked { at: 5 }.frame()[..],
            b"event: revoked\ndata: {\"revoked_at\":5}\n\n"
        );
        assert_eq!(&Farewell::Retry(700).frame()[..], b"retry: 700\n\n");
    }
}
