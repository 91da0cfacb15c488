//! Pod-wide state: whether the pod drains, how many streams it holds, and the ids it hands out.
//! Shared by the HTTP edge (readiness, the connection cap), the streams (their slots, their
//! bodies alive) and the Shutdown actor (the drain). Atomics only: read on every request.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// What the HTTP edge, the streams and the Shutdown actor share about this pod.
#[derive(Debug, Default)]
pub struct PodState {
    draining: AtomicBool,
    /// Set when a drain hit its grace deadline with streams still open; the process exits 1.
    drain_forced: AtomicBool,
    connections: AtomicUsize,
    /// Response bodies alive: a closed connection may still be writing what it had queued.
    open_streams: AtomicUsize,
    next_connection_id: AtomicU64,
}

impl PodState {
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn start_draining(&self) -> bool {
        !self.draining.swap(true, Ordering::AcqRel)
    }

    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Acquire)
    }

    pub fn open_streams(&self) -> usize {
        self.open_streams.load(Ordering::Acquire)
    }

    pub fn stream_opened(&self) {
        self.open_streams.fetch_add(1, Ordering::AcqRel);
    }

    pub fn stream_closed(&self) {
        self.open_streams.fetch_sub(1, Ordering::AcqRel);
    }

    pub fn mark_drain_forced(&self) {
        self.drain_forced.store(true, Ordering::Release);
    }

    pub fn drain_was_forced(&self) -> bool {
        self.drain_forced.load(Ordering::Acquire)
    }

    /// Takes a connection slot unless `limit` (0 = none) is reached.
    pub fn try_acquire_connection(&self, limit: usize) -> bool {
        self.connections
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (limit == 0 || open < limit).then_some(open + 1)
            })
            .is_ok()
    }

    /// Gives back a slot taken with [`Self::try_acquire_connection`].
    pub fn release_connection(&self) {
        self.connections.fetch_sub(1, Ordering::AcqRel);
    }

    /// A connection id unique in this process.
    pub fn next_connection_id(&self) -> u64 {
        self.next_connection_id.fetch_add(1, Ordering::Relaxed)
    }
}
