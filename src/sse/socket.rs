//! A handle on a connection's TCP socket that lets the hub drop a stuck client at once.
//!
//! actix-http stops polling a response body while its write buffer is full, so a client that
//! never reads would never see an error returned by the body: its connection (and everything
//! queued for it) would stay. Eviction therefore acts on the socket itself: `SO_LINGER 0` plus
//! `shutdown(RDWR)` wakes the dispatcher, which drops the connection, and the kernel discards the
//! unsent bytes with an RST instead of holding them for a peer that does not read.
//!
//! The raw fd is only touched while the response body is alive. actix-http drops the body before
//! it closes the socket, and [`SocketGuard::release`] (called from the body's `Drop`) takes the
//! same lock as [`SocketGuard::abort`], so an abort can never hit a reused file descriptor.

use std::{
    os::fd::{BorrowedFd, RawFd},
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
    time::Duration,
};

/// The fd of a TCP connection, recorded by `HttpServer::on_connect`.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionSocket(pub RawFd);

#[derive(Debug)]
pub struct SocketGuard {
    fd: Mutex<Option<RawFd>>,
    aborted: AtomicBool,
}

impl SocketGuard {
    pub fn new(fd: Option<RawFd>) -> Self {
        Self {
            fd: Mutex::new(fd),
            aborted: AtomicBool::new(false),
        }
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
