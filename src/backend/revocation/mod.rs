//! Revocations: "the tokens of this device issued until now are refused", kept in the backend so
//! that every pod applies them, and a pod that starts later too (docs/security.md,
//! "Revocation"). Implemented by the memory backend (this pod only), Redis (a stream under one
//! key) and NATS (a KV bucket); `tests/revocation_store.rs` holds every implementation to this
//! contract.
//!
//! # Contract
//! - **Revoke** records the device with the store's clock (Redis `TIME`, the NATS server's
//!   timestamp, the pod's clock for memory) and answers the revocation as stored. Revoking a
//!   device again moves its time forward.
//! - **Changes** come in the order they were stored, each with a [`Mark`] after which the next
//!   read continues: a reader that keeps its mark misses nothing that was stored after it,
//!   whatever happened between two reads (an outage of the store included). A mark the store no
//!   longer knows (its data was lost) reads from the beginning again.
//! - **Retention.** A revocation older than `auth.revocation_retention` may be forgotten: the
//!   tokens it covers have expired long before (it must be longer than any token's lifetime).
//! - **Listing** answers every revocation kept, the newest of each device.

pub mod memory;

use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
    time::Duration,
};

use futures_util::future::BoxFuture;

use super::BackendResult;
use crate::model::{Credential, DeviceId};

/// One revocation: the tokens of `device` issued until `at_ms` (Unix ms, the store's clock)
/// are refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revocation {
    pub device: DeviceId,
    pub at_ms: u64,
}

/// Where a reader of changes stands: opaque to everyone but its store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mark(pub String);

/// What one read of changes answers.
#[derive(Debug, Clone, Default)]
pub struct Changes {
    pub revocations: Vec<Revocation>,
    /// Where the next read continues.
    pub mark: Mark,
}

pub trait RevocationStore: Send + Sync {
    /// Records a revocation of `device` now, kept for `retention`.
    fn revoke(&self, device: &DeviceId) -> BoxFuture<'_, BackendResult<Revocation>>;
    /// What was stored after `after` (the default mark: everything kept), oldest first.
    fn changes(&self, after: &Mark) -> BoxFuture<'_, BackendResult<Changes>>;
}

/// This pod's view of the revocations: every one it has read or made, kept until retention
/// forgets it, also while the store is away (a pod never forgets a revocation it has seen).
/// Read by the HTTP edge at every token check and by the Router when a stream registers.
#[derive(Debug, Default)]
pub struct Revoked {
    by_device: RwLock<HashMap<DeviceId, u64>>,
}

impl Revoked {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Notes `revocation`; true when it is news (a device not revoked, or revoked earlier).
    pub fn note(&self, revocation: &Revocation) -> bool {
        let mut by_device = self
            .by_device
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match by_device.get_mut(&revocation.device) {
            Some(at_ms) if *at_ms >= revocation.at_ms => false,
            Some(at_ms) => {
                *at_ms = revocation.at_ms;
                true
            }
            None => {
                by_device.insert(revocation.device.clone(), revocation.at_ms);
                true
            }
        }
    }

    /// When `device` was last revoked (Unix ms).
    pub fn of(&self, device: &str) -> Option<u64> {
        let by_device = self
            .by_device
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if by_device.is_empty() {
            return None;
        }
        by_device.get(device).copied()
    }

    /// Whether a token of `device` with `credential` is refused.
    pub fn refuses(&self, device: &str, credential: &Credential) -> bool {
        self.of(device)
            .is_some_and(|at_ms| credential.revoked_by(at_ms))
    }

    /// Forgets what is older than `retention` at `now_ms`.
    pub fn forget_before(&self, now_ms: u64, retention: Duration) {
        let oldest = now_ms.saturating_sub(retention.as_millis() as u64);
        self.by_device
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|_, at_ms| *at_ms >= oldest);
    }

    /// How many devices are revoked.
    pub fn len(&self) -> usize {
        self.by_device
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every revocation known, newest first.
    pub fn list(&self) -> Vec<Revocation> {
        let mut all: Vec<Revocation> = self
            .by_device
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .map(|(device, at_ms)| Revocation {
                device: device.clone(),
                at_ms: *at_ms,
            })
            .collect();
        all.sort_by(|a, b| b.at_ms.cmp(&a.at_ms).then_with(|| a.device.cmp(&b.device)));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revocation(device: &str, at_ms: u64) -> Revocation {
        Revocation {
            device: DeviceId::parse(device).unwrap(),
            at_ms,
        }
    }

    /// The view keeps the newest time per device, refuses the tokens it covers, lists newest
    /// first and forgets by retention.
    #[test]
    fn the_view_keeps_the_newest_revocation_per_device() {
        let revoked = Revoked::default();
        assert!(revoked.note(&revocation("pos-1", 5_000)));
        assert!(!revoked.note(&revocation("pos-1", 4_000)), "older: no news");
        assert!(revoked.note(&revocation("pos-1", 9_000)));
        assert!(revoked.note(&revocation("pos-2", 7_000)));
        assert_eq!(revoked.of("pos-1"), Some(9_000));
        let token = |issued| Credential {
            issued: Some(issued),
            expires: Some(100),
            ..Credential::default()
        };
        assert!(revoked.refuses("pos-1", &token(9)));
        assert!(!revoked.refuses("pos-1", &token(10)));
        assert!(!revoked.refuses("pos-3", &token(1)));
        assert_eq!(
            revoked.list(),
            [revocation("pos-1", 9_000), revocation("pos-2", 7_000)]
        );
        revoked.forget_before(10_000, Duration::from_millis(2_000));
        assert_eq!(revoked.list(), [revocation("pos-1", 9_000)]);
    }
}
