//! The pod's actors: StreamTail → Router → (streams, see `stream/`), Shutdown, Fleet and
//! Revocations. Events never
//! travel through actix mailboxes past the Router: it `try_send`s into each stream's bounded
//! queue.

pub mod deadlines;
pub mod fleet;
pub mod revocations;
pub mod rotation;
pub mod router;
pub mod shutdown;
pub mod stream_tail;
