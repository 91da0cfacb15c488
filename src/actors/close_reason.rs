//! Every end of a connection, and every reason for a resync, as enums: logs, metric labels and
//! tests use exactly these.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CloseReason {
    /// The client went away (socket closed or write failed).
    Client,
    /// The bounded queue overflowed: the client does not read fast enough.
    SlowConsumer,
    /// The pod is draining.
    Drain,
    /// A newer connection for the same device replaced this one.
    Takeover,
    /// The hub failed while serving the stream (backend error during replay, router gone).
    Error,
}

impl CloseReason {
    pub const ALL: [CloseReason; 5] = [
        CloseReason::Client,
        CloseReason::SlowConsumer,
        CloseReason::Drain,
        CloseReason::Takeover,
        CloseReason::Error,
    ];

    pub fn label(self) -> &'static str {
        match self {
            CloseReason::Client => "client",
            CloseReason::SlowConsumer => "slow_consumer",
            CloseReason::Drain => "drain",
            CloseReason::Takeover => "takeover",
            CloseReason::Error => "error",
        }
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Why a client's cursor could not be resumed (the `reason` of `event: resync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResyncReason {
    /// Older than the retained window: events after it were trimmed.
    Expired,
    /// Not a cursor of this deployment (unparsable, wrong shard, in the future).
    Invalid,
    /// From another life of the stored data: the backend lost what the cursor points into.
    DataLost,
}

impl ResyncReason {
    pub const ALL: [ResyncReason; 3] = [
        ResyncReason::Expired,
        ResyncReason::Invalid,
        ResyncReason::DataLost,
    ];

    pub fn label(self) -> &'static str {
        match self {
            ResyncReason::Expired => "expired",
            ResyncReason::Invalid => "invalid",
            ResyncReason::DataLost => "data_lost",
        }
    }
}
