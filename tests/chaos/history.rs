//! What the clients of a chaos run were told, as plain data: every publish attempt with its
//! outcome, every device's observations in the order the device processed them, and the faults
//! injected. The checker (`checker.rs`) is a pure function of a [`History`].
//!
//! Times are microseconds since the start of the run ([`Micros`]), taken from one [`Clock`].

use std::fmt;
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Microseconds since the start of the run.
pub type Micros = u64;

/// The run's time base, shared by every task that records.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
}

impl Clock {
    pub fn start() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    pub fn now(&self) -> Micros {
        self.start.elapsed().as_micros() as Micros
    }
}

/// `m:ss.mmm` for reports.
pub fn show_time(at: Micros) -> String {
    let ms = at / 1000;
    format!("{}:{:02}.{:03}", ms / 60_000, ms / 1000 % 60, ms % 1000)
}

/// A position within a shard: `ms-seq` (NATS: `0-sequence`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Pos {
    pub ms: u64,
    pub seq: u64,
}

impl Pos {
    pub fn parse(text: &str) -> Option<Pos> {
        let (ms, seq) = text.split_once('-')?;
        Some(Pos {
            ms: ms.parse().ok()?,
            seq: seq.parse().ok()?,
        })
    }
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

/// An SSE id `{epoch}.{shard}.{ms}-{seq}`, or what an external producer learnt of it (Redis XADD
/// and a JetStream ack name the position but not the hub's epoch).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EventId {
    pub epoch: Option<String>,
    pub shard: u32,
    pub pos: Pos,
}

impl EventId {
    pub fn parse(text: &str) -> Option<EventId> {
        let mut parts = text.split('.');
        let (epoch, shard, pos) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || epoch.is_empty() {
            return None;
        }
        Some(EventId {
            epoch: Some(epoch.to_string()),
            shard: shard.parse().ok()?,
            pos: Pos::parse(pos)?,
        })
    }

    /// Same event position in the same life of the data, as far as both ids tell.
    pub fn same_place(&self, other: &EventId) -> bool {
        self.shard == other.shard && self.pos == other.pos
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let epoch = self.epoch.as_deref().unwrap_or("?");
        write!(f, "{epoch}.{}.{}", self.shard, self.pos)
    }
}

/// The sequentially published series a token belongs to: the unicasts of one device, the
/// broadcasts, or the events of one group.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Series {
    Unicast(String),
    Broadcast,
    Group(String),
}

impl fmt::Display for Series {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Series::Unicast(device) => write!(f, "unicasts of {device}"),
            Series::Broadcast => write!(f, "broadcasts"),
            Series::Group(group) => write!(f, "events of group {group}"),
        }
    }
}

/// The unique token an event carries in its `data` (`u:<device>:<n>`, `b:<n>` or
/// `g:<group>:<n>`, optionally followed by `|` and padding). Within a series, `n` counts up from
/// 1 in publishing order.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Token {
    pub series: Series,
    pub n: u64,
}

impl Token {
    pub fn unicast(device: &str, n: u64) -> Token {
        Token {
            series: Series::Unicast(device.to_string()),
            n,
        }
    }

    pub fn broadcast(n: u64) -> Token {
        Token {
            series: Series::Broadcast,
            n,
        }
    }

    pub fn group(group: &str, n: u64) -> Token {
        Token {
            series: Series::Group(group.to_string()),
            n,
        }
    }

    /// The token at the start of an event's data, if it has one.
    pub fn parse(data: &str) -> Option<Token> {
        let text = data.split('|').next().unwrap_or_default();
        if let Some(n) = text.strip_prefix("b:") {
            return Some(Token::broadcast(n.parse().ok()?));
        }
        let (make, rest): (fn(&str, u64) -> Token, &str) = match text.strip_prefix("u:") {
            Some(rest) => (Token::unicast, rest),
            None => (Token::group, text.strip_prefix("g:")?),
        };
        let (name, n) = rest.rsplit_once(':')?;
        if name.is_empty() {
            return None;
        }
        Some(make(name, n.parse().ok()?))
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.series {
            Series::Unicast(device) => write!(f, "u:{device}:{}", self.n),
            Series::Broadcast => write!(f, "b:{}", self.n),
            Series::Group(group) => write!(f, "g:{group}:{}", self.n),
        }
    }
}

/// How a token was published.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Via {
    /// `POST /v1/events` (through nginx or straight to a hub), always with an idempotency key.
    Http,
    /// `XADD pos-ev:{shard} * dev .. type .. data ..` by an external producer (no idempotency,
    /// so never retried once the command may have reached Redis).
    RedisXadd,
    /// A JetStream publish with `Nats-Msg-Id` by an external producer, awaiting the ack.
    NatsPublish,
}

/// What the producer was finally told about one token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Appended; `id` is the id the hub (or Redis/JetStream) answered.
    Acked { id: EventId, duplicate: bool },
    /// Definitely not appended (every try was refused before anything could be stored).
    Failed,
    /// Perhaps appended (a 503, a transport error, a timeout, or the run stopped the attempt).
    Unknown,
}

/// One token's publish: all tries until a definite answer or the deadline.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Attempt {
    pub token: Token,
    pub via: Via,
    /// When the first try started.
    pub started: Micros,
    /// When the final answer came (equal to `started` while still in flight).
    pub finished: Micros,
    pub tries: u32,
    pub outcome: Outcome,
    /// Answers of the tries, e.g. `503`, `201`, `reset`, for reports.
    pub answers: Vec<String>,
}

impl Attempt {
    pub fn acked_id(&self) -> Option<&EventId> {
        match &self.outcome {
            Outcome::Acked { id, .. } => Some(id),
            _ => None,
        }
    }
}

/// Something a device saw or did, in the order it processed them. `conn` numbers the device's
/// connections (1, 2, ...).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Observation {
    /// A stream request was answered (`status`) or failed before an answer (`None`).
    Connected {
        conn: u32,
        endpoint: String,
        cursor: Option<String>,
        status: Option<u16>,
    },
    /// An event handed to the application.
    Event {
        conn: u32,
        id: Option<String>,
        kind: String,
        data: String,
    },
    /// `event: resync`: the application reloads its state and continues from `id`.
    Resync {
        conn: u32,
        id: Option<String>,
        reason: String,
    },
    /// The device stopped processing connection `conn`, and why.
    Closed { conn: u32, why: String },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Observed {
    pub at: Micros,
    pub what: Observation,
}

impl fmt::Display for Observed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ", show_time(self.at))?;
        match &self.what {
            Observation::Connected {
                conn,
                endpoint,
                cursor,
                status,
            } => {
                let status = status.map_or_else(|| "no answer".to_string(), |s| s.to_string());
                let cursor = cursor.as_deref().unwrap_or("(none)");
                write!(
                    f,
                    "#{conn} connect via {endpoint} cursor {cursor} -> {status}"
                )
            }
            Observation::Event {
                conn,
                id,
                kind,
                data,
            } => {
                let token = data.split('|').next().unwrap_or_default();
                let id = id.as_deref().unwrap_or("(no id)");
                write!(f, "#{conn} event {token} id {id} type {kind}")
            }
            Observation::Resync { conn, id, reason } => {
                let id = id.as_deref().unwrap_or("(no id)");
                write!(f, "#{conn} RESYNC {reason} id {id}")
            }
            Observation::Closed { conn, why } => write!(f, "#{conn} closed: {why}"),
        }
    }
}

/// Everything one device processed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceHistory {
    pub device: String,
    pub shard: u32,
    /// The groups it names on every connect (`?groups=`), fixed for the run. Histories written
    /// before groups were checked have none.
    #[serde(default)]
    pub groups: Vec<String>,
    /// Its client behaviour (steady, flappy, slow, takeover) and producer, for reports.
    pub behaviour: String,
    pub observations: Vec<Observed>,
}

/// One injected fault.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FaultRecord {
    /// The fault kind's label (`FaultKind::label`).
    pub kind: String,
    pub started: Micros,
    /// When the system was whole again (the restarted process answered, and so on).
    pub finished: Micros,
    pub detail: String,
}

/// A whole run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct History {
    pub seed: u64,
    pub backend: String,
    pub attempts: Vec<Attempt>,
    pub devices: Vec<DeviceHistory>,
    pub faults: Vec<FaultRecord>,
    /// When the last fault had healed.
    pub faults_stopped: Micros,
    /// When the last publish attempt had finished.
    pub publishing_stopped: Micros,
    /// When the devices were stopped (after the quiet period).
    pub ended: Micros,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_tokens_parse() {
        let id = EventId::parse("k3f9a.17.1732999999999-4").unwrap();
        assert_eq!(id.epoch.as_deref(), Some("k3f9a"));
        assert_eq!(id.shard, 17);
        assert_eq!(
            id.pos,
            Pos {
                ms: 1732999999999,
                seq: 4
            }
        );
        assert_eq!(id.to_string(), "k3f9a.17.1732999999999-4");
        assert!(EventId::parse("garbage").is_none());
        assert!(EventId::parse("a.1.2").is_none());
        assert!(Pos { ms: 1, seq: 9 } < Pos { ms: 2, seq: 0 });

        assert_eq!(
            Token::parse("u:pos-1:12|xxxx"),
            Some(Token::unicast("pos-1", 12))
        );
        assert_eq!(Token::parse("u:a:b:3"), Some(Token::unicast("a:b", 3)));
        assert_eq!(Token::parse("b:7"), Some(Token::broadcast(7)));
        assert_eq!(Token::parse("b:x"), None);
        assert_eq!(
            Token::parse("g:store-1:4|xx"),
            Some(Token::group("store-1", 4))
        );
        assert_eq!(Token::parse("g::4"), None);
        assert_eq!(Token::group("store-1", 4).to_string(), "g:store-1:4");
        assert_eq!(Token::parse("hello"), None);
        assert_eq!(Token::unicast("pos-1", 12).to_string(), "u:pos-1:12");
    }
}
