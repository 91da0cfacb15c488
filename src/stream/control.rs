//! [`StreamControl`]: what a Connection actor and its response body share to end the stream.
//!
//! Two ways to end, for two reasons. A drain (or a token's end) ends cleanly: the Connection
//! drops its queue sender and leaves the Router, the body writes what is queued, then the
//! [`Farewell`] stored here (`retry:`, `event: token_expired`, `event: revoked`), then ends. An eviction (slow consumer, takeover) ends at once, as follows.
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
        atomic::{AtomicBool, AtomicU64, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

use crate::{model::Cursor, sse::Farewell};

/// The fd of a TCP connection, recorded by the HTTP service's `on_connect_ext` hook.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionSocket(pub RawFd);

#[derive(Debug)]
pub struct StreamControl {
    fd: Mutex<Option<RawFd>>,
    aborted: AtomicBool,
    /// What the body writes after the last queued frame of a clean end ([`Farewell::encode`]);
    /// 0 = nothing.
    farewell: AtomicU64,
    created: Instant,
    /// When the body last handed bytes to the socket, in ms after `created`: a drain cuts off a
    /// client that stops taking what is left.
    written_ms: AtomicU64,
    /// The id of the last event or resync the body handed to the socket, copied once per chunk
    /// (never the frame itself: an idle stream must not pin its last payload), read by presence
    /// (docs/fleet.md) with the number of times it changed.
    last_sent: Mutex<LastSent>,
}

/// Longest id kept: real ones are under 90 bytes (`model/cursor.rs`).
const MAX_ID: usize = 96;

#[derive(Debug)]
struct LastSent {
    id: [u8; MAX_ID],
    len: u8,
    changes: u64,
}

impl StreamControl {
    pub fn new(fd: Option<RawFd>) -> Self {
        Self {
            created: Instant::now(),
            written_ms: AtomicU64::new(0),
            fd: Mutex::new(fd),
            aborted: AtomicBool::new(false),
            farewell: AtomicU64::new(0),
            last_sent: Mutex::new(LastSent {
                id: [0; MAX_ID],
                len: 0,
                changes: 0,
            }),
        }
    }

    /// The body handed a frame with an `id:` line to the socket; `frame` starts with it.
    pub fn sent(&self, frame: &[u8]) {
        let Some(id) = frame
            .strip_prefix(b"id: ")
            .and_then(|rest| Some(&rest[..memchr::memchr(b'\n', rest)?]))
            .filter(|id| id.len() <= MAX_ID)
        else {
            return;
        };
        let mut last = self
            .last_sent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        last.id[..id.len()].copy_from_slice(id);
        last.len = id.len() as u8;
        last.changes += 1;
    }

    /// The id of the last event or resync written, and a counter that changes whenever it does.
    pub fn last_sent(&self) -> (Option<Cursor>, u64) {
        let last = self
            .last_sent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let cursor = std::str::from_utf8(&last.id[..usize::from(last.len)])
            .ok()
            .filter(|id| !id.is_empty())
            .and_then(|id| Cursor::parse(id).ok());
        (cursor, last.changes)
    }

    /// The body handed bytes to the socket.
    pub fn wrote(&self) {
        let ms = self.created.elapsed().as_millis() as u64;
        self.written_ms.store(ms, Ordering::Relaxed);
    }

    /// When the body last handed bytes to the socket (its creation, before the first write).
    pub fn last_write(&self) -> Instant {
        self.created + Duration::from_millis(self.written_ms.load(Ordering::Relaxed))
    }

    /// How long since the body last handed bytes to the socket.
    pub fn idle_for(&self) -> Duration {
        self.last_write().elapsed()
    }

    /// What the stream says last when it ends cleanly. A drain's `retry:` does not replace a
    /// token's end: the client must come back with another token, not merely later.
    pub fn set_farewell(&self, farewell: Farewell) {
        let _ = self
            .farewell
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                match (Farewell::decode(current), farewell) {
                    (
                        Some(Farewell::TokenExpired { .. } | Farewell::Revoked { .. }),
                        Farewell::Retry(_),
                    ) => None,
                    _ => Some(farewell.encode()),
                }
            });
    }

    /// The farewell, once.
    pub fn take_farewell(&self) -> Option<Farewell> {
        Farewell::decode(self.farewell.swap(0, Ordering::AcqRel))
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

#[cfg(test)]
mod tests {
    use std::{
        io::{ErrorKind, Read, Write},
        net::{TcpListener, TcpStream},
        os::fd::AsRawFd,
    };

    use super::*;

    /// A connected pair of TCP sockets on loopback: (client, server side).
    fn tcp_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        (client, server)
    }

    /// The farewell is taken once; a drain's `retry:` never replaces a token's end (the client
    /// must come back with another token, not merely later), while a token's end replaces a
    /// `retry:`.
    #[test]
    fn the_farewell_is_taken_once_and_a_retry_never_hides_a_tokens_end() {
        let control = StreamControl::new(None);
        assert_eq!(control.take_farewell(), None);
        control.set_farewell(Farewell::Retry(2500));
        assert_eq!(control.take_farewell(), Some(Farewell::Retry(2500)));
        assert_eq!(control.take_farewell(), None, "only once");
        control.set_farewell(Farewell::Retry(1000));
        control.set_farewell(Farewell::TokenExpired { exp: 7 });
        control.set_farewell(Farewell::Retry(2000));
        assert_eq!(
            control.take_farewell(),
            Some(Farewell::TokenExpired { exp: 7 })
        );
        control.set_farewell(Farewell::TokenExpired { exp: 7 });
        control.set_farewell(Farewell::Revoked { at: 9 });
        assert_eq!(control.take_farewell(), Some(Farewell::Revoked { at: 9 }));
    }

    #[test]
    fn abort_without_a_socket_only_marks_the_stream() {
        let control = StreamControl::new(None);
        assert!(!control.is_aborted());
        control.abort();
        assert!(control.is_aborted());
        control.abort();
        assert!(control.is_aborted(), "a second abort is harmless");
    }

    /// The eviction acts on the socket: the peer sees the connection end (reset, since the
    /// unsent bytes are discarded) although nobody closed the descriptor.
    #[test]
    fn abort_shuts_the_socket_down() {
        let (mut client, server) = tcp_pair();
        let control = StreamControl::new(Some(server.as_raw_fd()));
        control.abort();
        assert!(control.is_aborted());
        let mut buffer = [0u8; 16];
        match client.read(&mut buffer) {
            Ok(0) => {}
            Err(error) if error.kind() == ErrorKind::ConnectionReset => {}
            other => panic!("the peer should see the end of the connection: {other:?}"),
        }
    }

    /// Once the body is gone the fd may be reused by another connection: an abort after
    /// `release` must not touch it.
    #[test]
    fn abort_after_release_leaves_the_descriptor_alone() {
        let (mut client, mut server) = tcp_pair();
        let control = StreamControl::new(Some(server.as_raw_fd()));
        control.release();
        control.abort();
        assert!(control.is_aborted());
        server.write_all(b"still open").unwrap();
        let mut buffer = [0u8; 10];
        client.read_exact(&mut buffer).unwrap();
        assert_eq!(&buffer, b"still open");
    }

    #[test]
    fn the_last_sent_id_is_read_from_the_last_frame() {
        let control = StreamControl::new(None);
        assert_eq!(control.last_sent(), (None, 0));
        control.sent(&crate::sse::frame::event("e1.3.5-0", "message", "x"));
        control.sent(&crate::sse::frame::event("e1.3.7-1", "message", "y\nz"));
        let (cursor, changes) = control.last_sent();
        assert_eq!(cursor.unwrap().to_string(), "e1.3.7-1");
        assert_eq!(changes, 2);
    }

    #[test]
    fn idle_time_counts_from_the_last_write() {
        let control = StreamControl::new(None);
        std::thread::sleep(Duration::from_millis(30));
        assert!(control.idle_for() >= Duration::from_millis(30));
        control.wrote();
        // Stored in whole milliseconds: at most one is lost to rounding.
        assert!(control.idle_for() < Duration::from_millis(20));
    }
}
