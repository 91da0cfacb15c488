//! Every end of a connection as an enum: logs, metric labels and tests use exactly these (the
//! reasons for a resync are [`super::ResyncReason`]).

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
    /// The stream's token expired (its `exp` plus `auth.leeway` passed).
    TokenExpired,
    /// The device's tokens were revoked (`POST /admin/revoke`).
    Revoked,
}

impl CloseReason {
    pub const ALL: [CloseReason; 7] = [
        CloseReason::Client,
        CloseReason::SlowConsumer,
        CloseReason::Drain,
        CloseReason::Takeover,
        CloseReason::Error,
        CloseReason::TokenExpired,
        CloseReason::Revoked,
    ];

    pub fn label(self) -> &'static str {
        match self {
            CloseReason::Client => "client",
            CloseReason::SlowConsumer => "slow_consumer",
            CloseReason::Drain => "drain",
            CloseReason::Takeover => "takeover",
            CloseReason::Error => "error",
            CloseReason::TokenExpired => "token_expired",
            CloseReason::Revoked => "revoked",
        }
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}
