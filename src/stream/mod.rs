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

use std::{cell::OnceCell, rc::Rc, sync::Arc};

use actix::Recipient;

pub use body::SseBody;
pub use connection::{AnnounceRetry, BodyDropped, Close, DrainTarget, OpenStream};
pub use control::ConnectionSocket;
use control::StreamControl as ConnectionControl;
pub use membership::{Change, Membership, Register, RouterGone, Unregister};
pub use queue::{QueueSender, QueueWatch, TrySendError, Waiting, WakeBatch};

use crate::{
    metrics::Metrics,
    model::{CloseReason, Credential, Groups},
    pod::PodState,
    replay::Replayer,
};
use connection::Connection;
use membership::Outbox;
use queue::WorkerWakes;

/// What the Router keeps of a stream: its queue, and its controls for a takeover or a drain.
pub struct Route {
    /// Unique per process; tells a takeover's successor apart from its predecessor.
    pub connection_id: u64,
    pub queue: QueueSender,
    pub control: DrainTarget,
    /// Unix ms (the pod's clock) when it opened: of two streams of a device on two pods, the
    /// older one closes (docs/fleet.md, takeover).
    pub opened_ms: u64,
    pub progress: Progress,
    /// Its token's `iat` and `exp`: the Router ends the stream when the token does, or when a
    /// revocation covers it.
    pub credential: Credential,
}

/// Who opened a stream: what presence records of the session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Peer {
    pub remote: String,
    pub user_agent: String,
    /// The groups the stream was opened with (its credential's), shown in the device's record.
    pub groups: Groups,
}

/// What a stream has written so far, read by the Router for presence.
#[derive(Clone)]
pub struct Progress(Arc<ConnectionControl>);

/// A stream that has written nothing (a Router's test stand-in).
impl Default for Progress {
    fn default() -> Self {
        Progress(Arc::new(ConnectionControl::new(None)))
    }
}

impl Progress {
    /// The id of the last event or resync written, and a counter that changes with it.
    pub fn last_sent(&self) -> (Option<crate::model::Cursor>, u64) {
        self.0.last_sent()
    }

    /// How long before `now` the stream last wrote anything (the prelude counts).
    pub fn quiet_for(&self, now: std::time::Instant) -> std::time::Duration {
        now.saturating_duration_since(self.0.last_write())
    }

    /// Records a write now, as the body does (a Router's test stand-in).
    #[cfg(test)]
    pub fn wrote(&self) {
        self.0.wrote();
    }

    /// Records a frame handed to the socket, as the body does (a Fleet's test stand-in).
    #[cfg(test)]
    pub fn sent(&self, frame: &[u8]) {
        self.0.sent(frame);
    }
}

/// The HTTP edge's handle: opens streams on the worker thread that built it.
///
/// Not `Send`: its outbox batches the joins of one turn of this worker's event loop, so each
/// worker builds its own (see `membership.rs`).
pub struct StreamOpener {
    outbox: Rc<Outbox>,
    /// Where the Router's wakes of this worker's bodies go (`queue.rs`); started with the
    /// first stream, inside the worker's event loop.
    wakes: OnceCell<Arc<WorkerWakes>>,
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
            wakes: OnceCell::new(),
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

    fn worker_wakes(&self) -> Arc<WorkerWakes> {
        self.wakes.get_or_init(WorkerWakes::start).clone()
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

/// The harness of the stream tests (a probe that stands in for the Router, an opener over the
/// memory backend, a body reader), and the tests of the two handles.
#[cfg(test)]
mod tests {
    use std::{
        pin::Pin,
        task::{Context, Poll, Waker},
        time::{Duration, Instant},
    };

    use actix::{Actor, Addr, AsyncContext, Handler, Message, MessageResult};
    use actix_web::body::MessageBody;
    use bytes::Bytes;
    use prometheus::Registry;

    use super::*;
    use crate::{
        backend::{
            memory::{MemoryBackend, MemorySettings},
            Backend, NewEvent,
        },
        model::{shard_of, Cursor, DeviceId, EventType, Target},
    };

    /// Shards of the harness's backend.
    pub(super) const SHARDS: u32 = 4;
    /// What every stream of the harness writes first (`retry_ms` 1500).
    pub(super) const PRELUDE: &str = "retry: 1500\n: posthorn\n\n";

    /// One change the probe Router was sent: (join?, device, shard, connection id).
    pub(super) type Seen = (bool, String, u32, u64);

    /// Stands in for the Router: keeps the routes it is given, drops one on its own leave (as the
    /// Router does, so the stream's queue loses that sender), and records every change.
    #[derive(Default)]
    pub(super) struct ProbeRouter {
        routes: Vec<Route>,
        seen: Vec<Seen>,
    }

    impl Actor for ProbeRouter {
        type Context = actix::Context<Self>;
    }

    impl Handler<Membership> for ProbeRouter {
        type Result = ();

        fn handle(&mut self, Membership(changes): Membership, _: &mut actix::Context<Self>) {
            for change in changes {
                match change {
                    Change::Join(register) => {
                        self.seen.push((
                            true,
                            register.device.to_string(),
                            register.shard,
                            register.route.connection_id,
                        ));
                        self.routes.push(register.route);
                    }
                    Change::Leave(unregister) => {
                        self.seen.push((
                            false,
                            unregister.device.to_string(),
                            unregister.shard,
                            unregister.connection_id,
                        ));
                        self.routes
                            .retain(|route| route.connection_id != unregister.connection_id);
                    }
                }
            }
        }
    }

    /// Every change received so far (the mailbox is FIFO: this answer comes after them).
    #[derive(Message)]
    #[rtype(result = "Vec<Seen>")]
    pub(super) struct Changes;

    impl Handler<Changes> for ProbeRouter {
        type Result = MessageResult<Changes>;

        fn handle(&mut self, _: Changes, _: &mut actix::Context<Self>) -> Self::Result {
            MessageResult(self.seen.clone())
        }
    }

    /// A clone of the queue sender and the controls of a routed connection.
    #[derive(Message)]
    #[rtype(result = "Option<(QueueSender, DrainTarget)>")]
    pub(super) struct RouteOf(pub u64);

    impl Handler<RouteOf> for ProbeRouter {
        type Result = MessageResult<RouteOf>;

        fn handle(&mut self, RouteOf(id): RouteOf, _: &mut actix::Context<Self>) -> Self::Result {
            MessageResult(
                self.routes
                    .iter()
                    .find(|route| route.connection_id == id)
                    .map(|route| (route.queue.clone(), route.control.clone())),
            )
        }
    }

    /// A pod of one worker: the probe Router, the memory backend, and an opener for them.
    /// Built inside an actix system (`#[actix_rt::test]`).
    pub(super) struct Harness {
        pub router: Addr<ProbeRouter>,
        pub opener: StreamOpener,
        pub backend: Arc<MemoryBackend>,
        pub metrics: Arc<Metrics>,
        pub pod: Arc<PodState>,
    }

    impl Harness {
        pub fn new() -> Self {
            let router = ProbeRouter::default().start();
            Self::with_router(router.clone(), router.recipient())
        }

        fn with_router(router: Addr<ProbeRouter>, recipient: Recipient<Membership>) -> Self {
            let backend = Arc::new(MemoryBackend::new(MemorySettings {
                shards: SHARDS,
                retention: Duration::from_secs(600),
                max_len: 10_000,
                tail_count: 100,
                dedupe_window: Duration::from_secs(60),
            }));
            let metrics = Arc::new(Metrics::new(Registry::new(), "memory"));
            let pod = Arc::new(PodState::default());
            // No stall timeout for replays, and a heartbeat that never comes within a test.
            let replayer = Arc::new(Replayer::new(
                backend.clone(),
                metrics.clone(),
                4,
                1000,
                Duration::ZERO,
                Duration::from_secs(3600),
            ));
            let opener = StreamOpener::new(recipient, replayer, metrics.clone(), pod.clone());
            Self {
                router,
                opener,
                backend,
                metrics,
                pod,
            }
        }

        /// Opens a stream of `device` the way the HTTP edge does (a slot first), with a queue of
        /// 4 items.
        pub async fn open(
            &self,
            device: &str,
            cursor: Option<String>,
            stall_timeout: Duration,
        ) -> Result<(SseBody, CloseHandle), RouterGone> {
            assert!(self.pod.try_acquire_connection(0));
            self.opener
                .open(OpenStream {
                    device: DeviceId::parse(device).unwrap(),
                    shard: shard_of(device, SHARDS),
                    cursor,
                    queue_limit: 4,
                    retry_ms: 1500,
                    stall_timeout,
                    socket_fd: None,
                    peer: Peer::default(),
                    credential: Default::default(),
                })
                .await
        }

        pub async fn changes(&self) -> Vec<Seen> {
            self.router.send(Changes).await.unwrap()
        }

        pub async fn route(&self, connection_id: u64) -> (QueueSender, DrainTarget) {
            self.router
                .send(RouteOf(connection_id))
                .await
                .unwrap()
                .expect("the connection is routed")
        }

        /// Appends unicast events for `device`, one per payload; their cursors.
        pub async fn append(&self, device: &str, payloads: &[String]) -> Vec<Cursor> {
            let events = payloads
                .iter()
                .map(|data| NewEvent {
                    target: Target::Device(DeviceId::parse(device).unwrap()),
                    event_type: EventType::message(),
                    data: data.clone(),
                    key: None,
                    expires_ms: None,
                    supersede: None,
                    only_shards: None,
                })
                .collect();
            self.backend
                .append(events)
                .await
                .unwrap()
                .into_iter()
                .map(|outcome| outcome.unwrap().cursor)
                .collect()
        }

        /// `sse_connections_closed_total{reason}`.
        pub fn closed(&self, reason: CloseReason) -> u64 {
            let series = format!(
                "sse_connections_closed_total{{reason=\"{}\"}} ",
                reason.label()
            );
            self.metrics
                .render()
                .lines()
                .find_map(|line| line.strip_prefix(&series))
                .expect("every reason is registered")
                .parse()
                .unwrap()
        }

        /// Waits (a second at most) until the stream actor `connection_id` has stopped: it
        /// leaves the Router when it stops.
        pub async fn stopped(&self, connection_id: u64) {
            until(|| async {
                // A drain leaves the Router before its actor stops; the stop leaves once more.
                self.changes()
                    .await
                    .iter()
                    .any(|(join, _, _, id)| !join && *id == connection_id)
                    && self.metrics.sse_connections.get() == 0
            })
            .await;
        }
    }

    /// Waits (a second at most) until `check` holds, letting the actors run meanwhile.
    pub(super) async fn until<F, Fut>(mut check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + Duration::from_secs(1);
        while !check().await {
            assert!(Instant::now() < deadline, "timed out");
            actix_rt::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// How a body stopped handing out chunks.
    #[derive(Debug, PartialEq, Eq)]
    pub(super) enum Ending {
        /// Nothing ready: the body waits to be woken.
        Pending,
        /// `Ready(None)`: the response is complete.
        Ended,
        /// `Err(Evicted)`: the response is cut off.
        Evicted,
    }

    /// The chunks `body` hands out until it has nothing more, and why it stopped.
    pub(super) fn chunks(body: &mut SseBody) -> (Vec<Bytes>, Ending) {
        let mut context = Context::from_waker(Waker::noop());
        let mut chunks = Vec::new();
        loop {
            match Pin::new(&mut *body).poll_next(&mut context) {
                Poll::Ready(Some(Ok(chunk))) => chunks.push(chunk),
                Poll::Ready(Some(Err(_))) => return (chunks, Ending::Evicted),
                Poll::Ready(None) => return (chunks, Ending::Ended),
                Poll::Pending => return (chunks, Ending::Pending),
            }
        }
    }

    /// Everything `body` writes until it has nothing more, as text.
    pub(super) fn read(body: &mut SseBody) -> (String, Ending) {
        let (chunks, ending) = chunks(body);
        let text = chunks
            .iter()
            .map(|chunk| std::str::from_utf8(chunk).unwrap())
            .collect();
        (text, ending)
    }

    #[actix_rt::test]
    async fn open_fails_when_the_router_is_gone_and_gives_the_slot_back() {
        let gone = actix::Context::<ProbeRouter>::new().address();
        let harness = Harness::with_router(gone.clone(), gone.recipient());
        assert!(harness.open("pos-1", None, Duration::ZERO).await.is_err());
        assert_eq!(harness.pod.connections(), 0, "the slot is given back");
        assert_eq!(harness.pod.open_streams(), 0, "no body was made");
    }

    /// The HTTP edge closes a stream it opened while a drain began: at once, as `drain`.
    #[actix_rt::test]
    async fn a_close_handle_ends_the_stream_at_once() {
        let harness = Harness::new();
        let (mut body, close) = harness.open("pos-1", None, Duration::ZERO).await.unwrap();
        let (queue, _) = harness.route(0).await;
        queue.try_send(crate::sse::QueueItem::Ping).unwrap();
        close.close(CloseReason::Drain);
        harness.stopped(0).await;
        assert_eq!(read(&mut body), (String::new(), Ending::Evicted));
        assert_eq!(harness.closed(CloseReason::Drain), 1);
        assert_eq!(harness.pod.connections(), 0);
    }
}
