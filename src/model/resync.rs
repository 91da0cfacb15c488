//! Why a client is told to `resync` instead of being resumed: the `reason` of `event: resync`.

/// Why a client's position could not be continued (the `reason` of `event: resync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResyncReason {
    /// Older than the retained window: events after it were trimmed.
    Expired,
    /// Not a cursor of this deployment (unparsable, or of another shard).
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
