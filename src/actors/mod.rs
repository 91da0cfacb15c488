//! The actors of SPEC 2: StreamTail → Router → Connection, and Shutdown. Events never travel
//! through actix mailboxes past the Router: it `try_send`s into each Connection's bounded queue.

pub mod close_reason;
pub mod connection;
pub mod membership;
pub mod rotation;
pub mod router;
pub mod shutdown;
pub mod stream_tail;
