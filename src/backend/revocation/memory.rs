//! The revocation store of the memory backend: this pod's list, in order, behind a mutex. Only
//! this pod exists, so there is nobody else to tell; the contract is the module doc of
//! `revocation`.

use std::{collections::VecDeque, sync::Mutex, time::Duration};

use futures_util::{future::BoxFuture, FutureExt};

use super::{Changes, Mark, Revocation, RevocationStore};
use crate::{
    backend::BackendResult,
    model::{unix_ms, DeviceId},
};

pub struct MemoryRevocations {
    retention: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// In the order they were made, each with its sequence number.
    log: VecDeque<(u64, Revocation)>,
    next: u64,
}

impl MemoryRevocations {
    pub fn new(retention: Duration) -> Self {
        Self {
            retention,
            state: Mutex::new(State {
                log: VecDeque::new(),
                next: 1,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl RevocationStore for MemoryRevocations {
    fn revoke(&self, device: &DeviceId) -> BoxFuture<'_, BackendResult<Revocation>> {
        let now = unix_ms();
        let revocation = Revocation {
            device: device.clone(),
            at_ms: now,
        };
        let mut state = self.state();
        let oldest = now.saturating_sub(self.retention.as_millis() as u64);
        while state
            .log
            .front()
            .is_some_and(|(_, kept)| kept.at_ms < oldest)
        {
            state.log.pop_front();
        }
        let sequence = state.next;
        state.next += 1;
        state.log.push_back((sequence, revocation.clone()));
        async move { Ok(revocation) }.boxed()
    }

    fn changes(&self, after: &Mark) -> BoxFuture<'_, BackendResult<Changes>> {
        let after: u64 = after.0.parse().unwrap_or(0);
        let state = self.state();
        let revocations = state
            .log
            .iter()
            .filter(|(sequence, _)| *sequence > after)
            .map(|(_, revocation)| revocation.clone())
            .collect();
        let mark = Mark((state.next - 1).to_string());
        async move { Ok(Changes { revocations, mark }) }.boxed()
    }
}
