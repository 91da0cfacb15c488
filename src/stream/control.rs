//! [`StreamControl`]: what a Connection actor and its response body share to end the stream.
//!
//! Two ways to end, for two reasons. A drain ends cleanly: the Connection drops its queue sender
//! and leaves the Router, the body writes what is queued, then the `retry:` stored here, then
//! ends. An eviction (slow consumer, takeover) ends at once, as follows.
//!
//! actix-http stops polling a response body while its write buffer is full, so a client that
//! never reads would never see an error returned by the body: its connection (and everything
//! queued for it) would stay. Eviction therefore acts on the socket itself: `SO_LINGER 0` plus
//! `shutdown(RDWR)` wakes the dispatcher, which drops the connection, and the kernel discards the
//! unsent bytes with an RST instead of holding them for a peer that does not read.
//!
//! The raw fd is only touched while the response body is alive. actix-http drops the body before
//! it closes the socket, and [`StreamControl::release`] (called from the body's `Drop`) takes the
//! same lock as [`StreamControl::abort`], so an abort can never hit a reused file descriptor.

use std::{
    os::fd::{BorrowedFd, RawFd},
    sync::{
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

/// The fd of a TCP connection, recorded by the HTTP service's `on_connect_ext` hook.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionSocket(pub RawFd);

#[derive(Debug)]
pub struct StreamControl {
    fd: Mutex<Option<RawFd>>,
    aborted: AtomicBool,
    /// `retry:` (ms) the body writes after the last queued frame of a clean end; 0 = none.
    closing_retry_ms: AtomicU32,
    created: Instant,
    /// When the body last handed bytes to the socket, in ms after `created`: a drain cuts off a
    /// client that stops taking what is left.
    written_ms: AtomicU64,
}

impl StreamControl {
    pub fn new(fd: Option<RawFd>) -> Self {
        Self {
            created: Instant::now(),
            written_ms: AtomicU64::new(0),
            fd: Mutex::new(fd),
            aborted: AtomicBool::new(false),
            closing_retry_ms: AtomicU32::new(0),
        }
    }

    /// The body handed bytes to the socket.
    pub fn wrote(&self) {
        let ms = self.created.elapsed().as_millis() as u64;
        self.written_ms.store(ms, Ordering::Relaxed);
    }

    /// How long since the body last handed bytes to the socket.
    pub fn idle_for(&self) -> Duration {
        let written = Duration::from_millis(self.written_ms.load(Ordering::Relaxed));
        self.created.elapsed().saturating_sub(written)
    }

    pub fn set_closing_retry(&self, retry_ms: u32) {
        self.closing_retry_ms.store(retry_ms, Ordering::Release);
    }

    /// The closing `retry:`, once.
    pub fn take_closing_retry(&self) -> Option<u32> {
        Some(self.closing_retry_ms.swap(0, Ordering::AcqRel)).filter(|ms| *ms > 0)
    }

    /// Drops the connection now, discarding whatever is still buffered for it.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        let fd = self
            .fd
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(fd) = *fd {
            // SAFETY: the body is alive while `fd` is Some (see module doc), so the socket is open.
            let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
            let socket = socket2::SockRef::from(&borrowed);
            // Both can fail only if the peer already reset the connection: nothing left to do.
            let _ = socket.set_linger(Some(Duration::ZERO));
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Forgets the fd; called when the response body is dropped, before actix closes the socket.
    pub fn release(&self) {
        *self
            .fd
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
    }
}
