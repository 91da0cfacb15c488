//! Stream positions and cursors.
//!
//! A [`Position`] orders the entries of one shard: `(ms, seq)` like a Redis entry id (the memory
//! log uses the same shape; JetStream puts its sequence in `seq`). A [`Cursor`] is what a client
//! holds as its SSE `id:`: `{epoch}.{shard}.{ms}-{seq}`. The epoch names one life of the stored
//! stream, so a cursor from before a data loss is recognised (`resync` `data_lost`) instead of
//! silently skipping what was lost. Clients must treat the text as opaque.

use std::{fmt, str::FromStr, sync::Arc};

use thiserror::Error;

/// Longest cursor text we even try to parse; real ones are under 90 bytes.
const MAX_CURSOR_LEN: usize = 160;
const MAX_EPOCH_LEN: usize = 32;

#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    pub ms: u64,
    pub seq: u64,
}

impl Position {
    pub const ZERO: Position = Position { ms: 0, seq: 0 };

    pub fn new(ms: u64, seq: u64) -> Self {
        Self { ms, seq }
    }

    /// The greatest position below `position` (`ZERO` for `ZERO`): reading after it starts at
    /// `position` itself.
    pub fn before(position: Position) -> Position {
        match (position.ms, position.seq) {
            (_, seq) if seq > 0 => Position::new(position.ms, seq - 1),
            (0, _) => Position::ZERO,
            (ms, _) => Position::new(ms - 1, u64::MAX),
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

impl FromStr for Position {
    type Err = CursorError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (ms, seq) = text.split_once('-').ok_or(CursorError::Malformed)?;
        Ok(Position {
            ms: parse_decimal(ms)?,
            seq: parse_decimal(seq)?,
        })
    }
}

/// Plain decimal digits only: `u64::from_str` would also take a leading `+`.
fn parse_decimal(text: &str) -> Result<u64, CursorError> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(CursorError::Malformed);
    }
    text.parse().map_err(|_| CursorError::Malformed)
}

/// One life of a stored stream. Short alphanumeric text, compared for equality only.
#[derive(Clone)]
pub struct Epoch {
    text: Arc<str>,
    /// A hash of `text`, so queued events carry their life as a plain number (see [`EpochId`]).
    id: EpochId,
}

/// A number that tells epochs apart without touching their text: what every queued event
/// carries, so a connection can drop events of a life it has left. A 64-bit hash: two epochs of
/// one shard colliding is about as likely as two random 64-bit numbers being equal.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct EpochId(u64);

impl PartialEq for Epoch {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Epoch {}

impl std::hash::Hash for Epoch {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.text.hash(state);
    }
}

impl Epoch {
    pub fn new(text: &str) -> Result<Self, CursorError> {
        if text.is_empty()
            || text.len() > MAX_EPOCH_LEN
            || !text.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            return Err(CursorError::Malformed);
        }
        Ok(Self::from_valid(text))
    }

    fn from_valid(text: &str) -> Self {
        // FNV-1a: tiny, stable across builds and processes, good enough to tell epochs apart.
        let id = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
        Self {
            text: Arc::from(text),
            id: EpochId(id),
        }
    }

    pub fn id(&self) -> EpochId {
        self.id
    }

    /// A fresh random epoch (memory log: one per process start; Redis: one per data life).
    pub fn random() -> Self {
        use rand::Rng;
        const ALPHABET: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
        let mut rng = rand::rng();
        let text: String = (0..10)
            .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
            .collect();
        Self::from_valid(&text)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Debug for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.text)
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum CursorError {
    #[error("malformed cursor")]
    Malformed,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cursor {
    pub epoch: Epoch,
    pub shard: u32,
    pub position: Position,
}

impl Cursor {
    pub fn new(epoch: Epoch, shard: u32, position: Position) -> Self {
        Self {
            epoch,
            shard,
            position,
        }
    }

    pub fn parse(text: &str) -> Result<Self, CursorError> {
        if text.len() > MAX_CURSOR_LEN {
            return Err(CursorError::Malformed);
        }
        let mut parts = text.splitn(3, '.');
        let (Some(epoch), Some(shard), Some(position)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(CursorError::Malformed);
        };
        Ok(Cursor {
            epoch: Epoch::new(epoch)?,
            shard: u32::try_from(parse_decimal(shard)?).map_err(|_| CursorError::Malformed)?,
            position: position.parse()?,
        })
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.{}.{}",
            self.epoch.as_str(),
            self.shard,
            self.position
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cursor survives formatting and parsing unchanged.
    #[test]
    fn cursor_round_trips() {
        let cursor = Cursor::new(
            Epoch::new("k3f9a").unwrap(),
            17,
            Position::new(1_732_999_999_999, 4),
        );
        let text = cursor.to_string();
        assert_eq!(text, "k3f9a.17.1732999999999-4");
        assert_eq!(Cursor::parse(&text), Ok(cursor));
    }

    /// Anything that is not exactly `epoch.shard.ms-seq` is malformed, including absurd values.
    #[test]
    fn malformed_cursors_are_rejected() {
        let long = "9".repeat(10_000);
        for bad in [
            "",
            "abc",
            "e.1",
            "e.1.2",
            "e.1.2-",
            "e.1.-2",
            "e.-1.2-3",
            "e.+1.2-3",
            "e.1.+2-3",
            "e.1.2-3-4",
            "e.1.2-3.4",
            "é.1.2-3",
            "e.99999999999.2-3",
            "e.1.18446744073709551616-0",
            ".1.2-3",
            "e.1. 2-3",
            long.as_str(),
        ] {
            assert!(Cursor::parse(bad).is_err(), "{bad:?} must be rejected");
        }
    }

    /// Positions order like Redis entry ids: by milliseconds, then by sequence.
    #[test]
    fn positions_order_like_redis_ids() {
        assert!(Position::new(1, 9) < Position::new(2, 0));
        assert!(Position::new(2, 0) < Position::new(2, 1));
        assert_eq!("5-6".parse::<Position>(), Ok(Position::new(5, 6)));
    }

    /// Random epochs are valid epochs and differ between calls, as do their ids; the same text
    /// always has the same id.
    #[test]
    fn random_epochs_are_valid_and_distinct() {
        let a = Epoch::random();
        let b = Epoch::random();
        assert!(Epoch::new(a.as_str()).is_ok());
        assert_ne!(a, b);
        assert_ne!(a.id(), b.id());
        assert_eq!(Epoch::new(a.as_str()).unwrap().id(), a.id());
    }
}
