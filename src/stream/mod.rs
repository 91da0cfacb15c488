//! One open SSE stream, from the HTTP edge's request to the bytes on its socket: the
//! `Connection` actor, its bounded queue, the response body that drains it, the control both
//! share to end it, and the way its joins and leaves reach the Router.
//!
//! Two handles, one per neighbour:
//! - the HTTP edge holds a [`StreamOpener`] (one per worker thread) and gets, per stream, the
//!   response body and a [`CloseHandle`];
//! - the Router receives a [`Route`] per stream in a [`Membership`] message: the queue it
//!   `try_send`s into and the [`DrainTarget`] that Shutdown later closes.
//!
//! Below this folder: framing (`sse`), resumes (`replay`), pod-wide state (`pod`), the model.
//! Nothing here imports the actors or the HTTP edge.

mod body;
mod connection;
mod control;
mod membership;
pub mod queue;

use std::{rc::Rc, sync::Arc};

use actix::Recipient;

pub use body::SseBody;
pub use connection::{AnnounceRetry, BodyDropped, Close, DrainTarget, OpenStream};
pub use control::ConnectionSocket;
pub use membership::{Change, Membership, Register, RouterGone, Unregister};
pub use queue::{QueueSender, TrySendError};

use crate::{metrics::Metrics, model::CloseReason, pod::PodState, replay::Replayer};
use connection::Connection;
use membership::Outbox;

/// What the Router keeps of a stream: its queue, and its controls for a takeover or a drain.
pub struct Route {
    /// Unique per process; tells a takeover's successor apart from its predecessor.
    pub connection_id: u64,
    pub queue: QueueSender,
    pub control: DrainTarget,
}

/// The HTTP edge's handle: opens streams on the worker thread that built it.
///
/// Not `Send`: its outbox batches the joins of one turn of this worker's event loop, so each
/// worker builds its own (see `membership.rs`).
pub struct StreamOpener {
    outbox: Rc<Outbox>,
    replayer: Arc<Replayer>,
    metrics: Arc<Metrics>,
    pod: Arc<PodState>,
}

impl StreamOpener {
    pub fn new(
        router: Recipient<Membership>,
        replayer: Arc<Replayer>,
        metrics: Arc<Metrics>,
        pod: Arc<PodState>,
    ) -> Self {
        Self {
            outbox: Outbox::new(router),
            replayer,
            metrics,
            pod,
        }
    }

    /// Opens a stream: returns its response body and close handle once its registration is in
    /// the Router's mailbox (so an event appended after the client saw the first bytes reaches
    /// it). The caller has taken a connection slot with [`PodState::try_acquire_connection`];
    /// the stream gives it back when it ends, also when this fails.
    pub async fn open(&self, stream: OpenStream) -> Result<(SseBody, CloseHandle), RouterGone> {
        Connection::open(stream, self).await
    }
}

/// Ends one stream from the HTTP edge.
pub struct CloseHandle(Recipient<connection::Close>);

impl CloseHandle {
    /// Ends the stream at once, for `reason`.
    pub fn close(&self, reason: CloseReason) {
        self.0.do_send(Close::now(reason));
    }
}
