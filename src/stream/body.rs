//! The SSE response body of one connection: it drains the connection's queues into the socket.
//!
//! Order of what it writes: the prelude (`retry:` and a comment, at once); then, while the
//! Connection replays a backlog, only the replay channel (live events wait in the bounded queue);
//! then the live queue. Frames that are ready together are written in one chunk (one syscall
//! instead of one per event). When every sender is gone the stream ends cleanly, after the
//! closing `retry:` of a drain; an abort ends it with an error at once.
//!
//! What it writes is decided by a small state: the life of the data the client is in (an
//! [`EpochId`]) and the newest position it has been sent there (the floor).
//! - An event at or below the floor was already sent (replayed, then routed live): dropped. So the
//!   switch from replay to live has no gap and no duplicate.
//! - An event of another life than the client's was read before a loss the client has been told
//!   about (or after one it has not been told about yet, which cannot happen: tails and replays
//!   send the `resync` of a loss before any event of the new life): dropped.
//! - A `resync` `data_lost` moves the client into the new life at the resync's position. A second
//!   one for the same life (a replay and a tail both found the loss) is dropped: the client hears
//!   of each loss once, and the tail's events after the first one's position still arrive.
//! - A `resync` `expired` at or below the floor changes nothing for this client (it was sent what
//!   the tail missed, by its replay): dropped.
//! - A replay channel that closes without [`QueueItem::ReplayEnd`] was cut short (a drain reached
//!   the connection mid-replay): the stream ends after what was replayed, without live events,
//!   so the client's cursor never jumps past events it was not sent.

use std::{
    error::Error as StdError,
    fmt,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use actix::Recipient;
use actix_web::body::{BodySize, MessageBody};
use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;

use super::{connection::BodyDropped, control::StreamControl, queue::QueueReceiver};
use crate::{
    metrics::Metrics,
    model::{unix_ms, EpochId, Position, ResyncReason},
    pod::PodState,
    sse::{frame, QueueItem},
};

/// Largest chunk assembled from queued frames before handing it to actix.
const MAX_CHUNK: usize = 64 * 1024;

#[derive(Debug)]
pub struct Evicted;

impl fmt::Display for Evicted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("connection evicted")
    }
}

impl StdError for Evicted {}

pub struct SseBody {
    prelude: Option<Bytes>,
    /// Present while the Connection replays; its end switches the body to `live`.
    replay: Option<mpsc::Receiver<QueueItem>>,
    /// The bounded queue the Router (and the Connection) feed.
    live: QueueReceiver,
    /// The life of the data the client is in, once known.
    epoch: Option<EpochId>,
    /// Newest position written in `epoch`: events at or before it are duplicates.
    floor: Option<Position>,
    /// The life the client was last moved into by a `resync` `data_lost`.
    resynced_to: Option<EpochId>,
    ended: bool,
    control: Arc<StreamControl>,
    /// Tells the Connection actor that the client is gone when actix drops the body.
    on_drop: Option<Recipient<BodyDropped>>,
    metrics: Arc<Metrics>,
    /// Counts this body among the pod's open streams until it is dropped.
    pod: Arc<PodState>,
}

impl SseBody {
    pub fn new(
        prelude: Bytes,
        replay: Option<mpsc::Receiver<QueueItem>>,
        live: QueueReceiver,
        control: Arc<StreamControl>,
        on_drop: Recipient<BodyDropped>,
        metrics: Arc<Metrics>,
        pod: Arc<PodState>,
    ) -> Self {
        pod.stream_opened();
        if replay.is_some() {
            live.set_replaying(true);
        }
        Self {
            prelude: Some(prelude),
            replay,
            live,
            epoch: None,
            floor: None,
            resynced_to: None,
            ended: false,
            control,
            on_drop: Some(on_drop),
            metrics,
            pod,
        }
    }

    /// Next queued item, replay first; `None` when nothing is ready (or the stream ended).
    fn poll_item(&mut self, cx: &mut Context<'_>) -> Option<(QueueItem, bool)> {
        loop {
            if let Some(replay) = &mut self.replay {
                match replay.poll_recv(cx) {
                    Poll::Ready(Some(QueueItem::ReplayEnd)) => {
                        self.replay = None;
                        self.live.set_replaying(false);
                    }
                    Poll::Ready(Some(item)) => return Some((item, true)),
                    // Cut short: nothing live may follow what was replayed.
                    Poll::Ready(None) => {
                        self.replay = None;
                        self.ended = true;
                        return None;
                    }
                    Poll::Pending => return None,
                }
            } else {
                return match self.live.poll_recv(cx) {
                    Poll::Ready(Some(item)) => Some((item, false)),
                    Poll::Ready(None) => {
                        self.ended = true;
                        None
                    }
                    Poll::Pending => None,
                };
            }
        }
    }

    /// Whether an event of `epoch` at `position` is new to the client; if so, it is now sent.
    fn admit_event(&mut self, epoch: EpochId, position: Position) -> bool {
        if self.epoch.is_some_and(|known| known != epoch)
            || self.floor.is_some_and(|floor| position <= floor)
        {
            return false;
        }
        self.epoch = Some(epoch);
        self.floor = Some(position);
        true
    }

    /// Whether a `resync` must be written (see the module doc); if so, the client continues
    /// after `position` of `epoch`.
    fn admit_resync(&mut self, epoch: EpochId, position: Position, reason: ResyncReason) -> bool {
        let known = match reason {
            ResyncReason::DataLost => self.resynced_to == Some(epoch),
            ResyncReason::Expired | ResyncReason::Invalid => {
                self.epoch == Some(epoch) && self.floor.is_some_and(|floor| position <= floor)
            }
        };
        if known {
            return false;
        }
        if reason == ResyncReason::DataLost {
            self.resynced_to = Some(epoch);
        }
        self.epoch = Some(epoch);
        self.floor = Some(position);
        true
    }
}

/// Frames gathered for one write: the first is passed through without copying.
#[derive(Default)]
struct Chunk {
    first: Option<Bytes>,
    rest: Option<BytesMut>,
}

impl Chunk {
    /// Bytes gathered so far (`rest`, once started, holds the first frame too).
    fn len(&self) -> usize {
        match (&self.first, &self.rest) {
            (_, Some(rest)) => rest.len(),
            (Some(first), None) => first.len(),
            (None, None) => 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    fn push(&mut self, bytes: Bytes) {
        match (&self.first, &mut self.rest) {
            (None, _) => self.first = Some(bytes),
            (Some(_), Some(rest)) => rest.extend_from_slice(&bytes),
            (Some(first), None) => {
                let mut rest = BytesMut::with_capacity((first.len() + bytes.len()) * 4);
                rest.extend_from_slice(first);
                rest.extend_from_slice(&bytes);
                self.rest = Some(rest);
            }
        }
    }

    fn into_bytes(self) -> Option<Bytes> {
        match self.rest {
            Some(rest) => Some(rest.freeze()),
            None => self.first,
        }
    }
}

impl MessageBody for SseBody {
    type Error = Evicted;

    fn size(&self) -> BodySize {
        BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Evicted>>> {
        let this = self.get_mut();
        if this.control.is_aborted() {
            return Poll::Ready(Some(Err(Evicted)));
        }
        if let Some(prelude) = this.prelude.take() {
            return Poll::Ready(Some(Ok(prelude)));
        }
        let mut chunk = Chunk::default();
        // Counted per chunk: one shared atomic update per write, not one per event.
        let (mut events, mut pings) = (0, 0);
        // Read once per chunk, for the delivery lag of the live events in it.
        let mut now_ms = None;
        // Where the newest frame with an id starts in the chunk: the device's last sent id
        // (presence), read once the chunk is complete.
        let mut last_with_id = None;
        while !this.ended && chunk.len() < MAX_CHUNK {
            let Some((item, replaying)) = this.poll_item(cx) else {
                break;
            };
            match item {
                QueueItem::Event {
                    epoch,
                    position,
                    appended_ms,
                    frame,
                } => {
                    if this.admit_event(epoch, position) {
                        events += 1;
                        last_with_id = Some(chunk.len());
                        chunk.push(frame);
                        if !replaying && appended_ms > 0 {
                            let now = *now_ms.get_or_insert_with(unix_ms);
                            this.metrics
                                .sse_delivery_lag_seconds
                                .observe(now.saturating_sub(appended_ms) as f64 / 1000.0);
                        }
                    }
                }
                QueueItem::Resync {
                    epoch,
                    position,
                    reason,
                    frame,
                } => {
                    if this.admit_resync(epoch, position, reason) {
                        this.metrics.resync(reason);
                        last_with_id = Some(chunk.len());
                        chunk.push(frame);
                    }
                }
                QueueItem::Floor { epoch, position } => {
                    // The client's cursor is of this life: a `data_lost` into it (a tail here
                    // that finds the loss after another pod told the client) is no news.
                    this.epoch = Some(epoch);
                    this.floor = Some(position);
                    this.resynced_to = Some(epoch);
                }
                QueueItem::Ping => {
                    pings += 1;
                    chunk.push(frame::PING);
                }
                QueueItem::Retry(retry_ms) => chunk.push(frame::retry(retry_ms)),
                // Consumed by `poll_item`.
                QueueItem::ReplayEnd => {}
            }
            // Returning data means actix polls again, and that poll will find the queue empty
            // (registering the waker) or take what arrived meanwhile; polling the queue now would
            // only lock it to find it empty, once more per event. With nothing to write yet
            // the loop must go on: only a `Pending` from the queue leaves a waker behind.
            if !replaying && this.live.emptied() && !chunk.is_empty() {
                break;
            }
        }
        if events > 0 {
            this.metrics.sse_events_sent.inc_by(events);
        }
        if pings > 0 {
            this.metrics.sse_heartbeats_sent.inc_by(pings);
        }
        // Every sender is gone: a clean end tells the client when, or with what, to come back.
        if this.ended && !this.control.is_aborted() {
            if let Some(farewell) = this.control.take_farewell() {
                chunk.push(farewell.frame());
            }
        }
        match chunk.into_bytes() {
            Some(bytes) => {
                this.control.wrote();
                if let Some(at) = last_with_id {
                    this.control.sent(&bytes[at..]);
                }
                Poll::Ready(Some(Ok(bytes)))
            }
            None if this.ended && this.control.is_aborted() => Poll::Ready(Some(Err(Evicted))),
            None if this.ended => Poll::Ready(None),
            None => Poll::Pending,
        }
    }
}

impl Drop for SseBody {
    fn drop(&mut self) {
        self.control.release();
        self.pod.stream_closed();
        if let Some(connection) = self.on_drop.take() {
            connection.do_send(BodyDropped);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::{Read, Write},
        net::{TcpListener, TcpStream},
        os::fd::{AsRawFd, RawFd},
        task::Waker,
        time::{Duration, Instant},
    };

    use actix::{Actor, AsyncContext, Handler, Message};
    use prometheus::Registry;

    use super::*;
    use crate::{
        model::Epoch,
        sse::Farewell,
        stream::{
            queue::{self, QueueSender, Waiting},
            tests::{chunks, read, Ending},
        },
    };

    /// Stands in for the Connection actor: counts the `BodyDropped` it is sent.
    #[derive(Default)]
    struct Owner {
        dropped: usize,
    }

    impl Actor for Owner {
        type Context = actix::Context<Self>;
    }

    impl Handler<BodyDropped> for Owner {
        type Result = ();

        fn handle(&mut self, _: BodyDropped, _: &mut actix::Context<Self>) {
            self.dropped += 1;
        }
    }

    #[derive(Message)]
    #[rtype(result = "usize")]
    struct DroppedCount;

    impl Handler<DroppedCount> for Owner {
        type Result = usize;

        fn handle(&mut self, _: DroppedCount, _: &mut actix::Context<Self>) -> usize {
            self.dropped
        }
    }

    /// One body with the ends that feed it.
    struct Stream {
        body: SseBody,
        /// The replay channel's sender, for a resumed stream.
        replay: Option<mpsc::Sender<QueueItem>>,
        /// The live queue's sender (the Router's and the Connection's, in one).
        live: Option<QueueSender>,
        control: Arc<StreamControl>,
        metrics: Arc<Metrics>,
        pod: Arc<PodState>,
        /// Keeps the body's `BodyDropped` recipient connected; never run.
        _owner: Option<actix::Context<Owner>>,
    }

    const PRELUDE: &str = "retry: 1000\n: posthorn\n\n";

    impl Stream {
        fn fresh() -> Self {
            Self::build(false, None, None)
        }

        fn resuming() -> Self {
            Self::build(true, None, None)
        }

        /// `owner` receives `BodyDropped` (else nobody does); `fd` is the stream's socket.
        fn build(resuming: bool, owner: Option<Recipient<BodyDropped>>, fd: Option<RawFd>) -> Self {
            let (live, receiver) = queue::channel(64);
            let (replay, replay_receiver) = if resuming {
                let (tx, rx) = mpsc::channel(64);
                (Some(tx), Some(rx))
            } else {
                (None, None)
            };
            let (owner_context, on_drop) = match owner {
                Some(owner) => (None, owner),
                None => {
                    let context = actix::Context::<Owner>::new();
                    let address = context.address();
                    (Some(context), address.recipient())
                }
            };
            let control = Arc::new(StreamControl::new(fd));
            let metrics = Arc::new(Metrics::new(Registry::new(), "memory"));
            let pod = Arc::new(PodState::default());
            let body = SseBody::new(
                frame::prelude(1000),
                replay_receiver,
                receiver,
                control.clone(),
                on_drop,
                metrics.clone(),
                pod.clone(),
            );
            Self {
                body,
                replay,
                live: Some(live),
                control,
                metrics,
                pod,
                _owner: owner_context,
            }
        }

        fn live(&self, item: QueueItem) {
            self.live.as_ref().unwrap().try_send(item).unwrap();
        }

        fn replay(&self, item: QueueItem) {
            self.replay.as_ref().unwrap().try_send(item).unwrap();
        }

        fn poll(&mut self) -> Poll<Option<Result<Bytes, Evicted>>> {
            Pin::new(&mut self.body).poll_next(&mut Context::from_waker(Waker::noop()))
        }

        fn chunks(&mut self) -> (Vec<Bytes>, Ending) {
            chunks(&mut self.body)
        }

        fn read(&mut self) -> (String, Ending) {
            read(&mut self.body)
        }

        /// Reads the prelude, which every stream writes first.
        fn skip_prelude(&mut self) {
            match self.poll() {
                Poll::Ready(Some(Ok(prelude))) => assert_eq!(&prelude[..], PRELUDE.as_bytes()),
                other => panic!("expected the prelude, got {other:?}"),
            }
        }

        fn resyncs(&self, reason: ResyncReason) -> u64 {
            let series = format!("sse_resyncs_total{{reason=\"{}\"}} ", reason.label());
            self.metrics
                .render()
                .lines()
                .find_map(|line| line.strip_prefix(&series))
                .map(|value| value.parse().unwrap())
                .unwrap()
        }
    }

    fn life(name: &str) -> EpochId {
        Epoch::new(name).unwrap().id()
    }

    fn at(seq: u64) -> Position {
        Position::new(1_700_000_000_000, seq)
    }

    /// A stand-in frame: one line that names the event.
    fn event(name: &str, seq: u64) -> QueueItem {
        QueueItem::Event {
            epoch: life(name),
            position: at(seq),
            appended_ms: 0,
            frame: Bytes::from(format!("E {name} {seq}\n")),
        }
    }

    fn resync(name: &str, seq: u64, reason: ResyncReason) -> QueueItem {
        QueueItem::Resync {
            epoch: life(name),
            position: at(seq),
            reason,
            frame: Bytes::from(format!("R {} {name} {seq}\n", reason.label())),
        }
    }

    fn floor(name: &str, seq: u64) -> QueueItem {
        QueueItem::Floor {
            epoch: life(name),
            position: at(seq),
        }
    }

    #[test]
    fn the_prelude_comes_first() {
        let mut stream = Stream::resuming();
        stream.replay(floor("alpha", 1));
        stream.replay(event("alpha", 2));
        stream.live(event("alpha", 3));
        stream.skip_prelude();
        assert_eq!(stream.read(), ("E alpha 2\n".into(), Ending::Pending));
    }

    /// Live events routed while the replay ran wait, and those the replay sent are skipped at
    /// the switch: no gap, no duplicate.
    #[test]
    fn replay_before_live_without_gap_or_duplicate() {
        let mut stream = Stream::resuming();
        // Registered before the replay read the backend: the live queue has them too.
        for seq in 2..=4 {
            stream.live(event("alpha", seq));
        }
        stream.replay(floor("alpha", 1));
        stream.replay(event("alpha", 2));
        stream.replay(event("alpha", 3));
        stream.skip_prelude();
        assert_eq!(
            stream.read(),
            ("E alpha 2\nE alpha 3\n".into(), Ending::Pending),
            "nothing live before the replay ends"
        );
        let in_an_hour = Instant::now() + Duration::from_secs(3600);
        assert_eq!(
            stream.live.as_ref().unwrap().watch().waiting(in_an_hour),
            Waiting::Nothing,
            "live events waiting behind a replay are not a stall"
        );
        stream.replay(QueueItem::ReplayEnd);
        assert_eq!(stream.read(), ("E alpha 4\n".into(), Ending::Pending));
        stream.live(event("alpha", 5));
        assert_eq!(stream.read(), ("E alpha 5\n".into(), Ending::Pending));
        assert_eq!(stream.metrics.sse_events_sent.get(), 4);
    }

    /// `Floor` is the client's cursor: what is at or below it is known, its life is the
    /// client's, and a `data_lost` into that life is no news.
    #[test]
    fn the_floor_sets_the_life_and_the_position() {
        let mut stream = Stream::resuming();
        stream.replay(floor("alpha", 5));
        stream.replay(QueueItem::ReplayEnd);
        stream.live(event("alpha", 4));
        stream.live(event("alpha", 5));
        stream.live(event("beta", 9));
        stream.live(event("alpha", 6));
        stream.live(resync("alpha", 0, ResyncReason::DataLost));
        stream.live(event("alpha", 7));
        stream.skip_prelude();
        assert_eq!(
            stream.read(),
            ("E alpha 6\nE alpha 7\n".into(), Ending::Pending)
        );
        assert_eq!(stream.resyncs(ResyncReason::DataLost), 0);
    }

    /// Across an epoch change: the floor of the old life does not hold back the new one, and
    /// events of the life the client left are dropped.
    #[test]
    fn the_floor_follows_the_client_across_an_epoch_change() {
        let mut stream = Stream::resuming();
        stream.replay(floor("alpha", 50));
        stream.replay(event("alpha", 51));
        // The data was lost while replaying: the replay moves the client to the new life.
        stream.replay(resync("beta", 0, ResyncReason::DataLost));
        stream.replay(event("beta", 1));
        stream.replay(event("beta", 2));
        stream.replay(QueueItem::ReplayEnd);
        // Live, meanwhile: an event of the old life, the tail's own report of the same loss,
        // and the new life's events, some of them replayed already.
        stream.live(event("alpha", 52));
        stream.live(resync("beta", 0, ResyncReason::DataLost));
        stream.live(event("beta", 1));
        stream.live(event("beta", 2));
        stream.live(event("beta", 3));
        stream.skip_prelude();
        assert_eq!(
            stream.read(),
            (
                "E alpha 51\nR data_lost beta 0\nE beta 1\nE beta 2\nE beta 3\n".into(),
                Ending::Pending
            )
        );
        assert_eq!(stream.resyncs(ResyncReason::DataLost), 1);
    }

    /// A fresh stream takes the life of its first event; events of any other life are dropped.
    #[test]
    fn events_of_another_life_are_dropped() {
        let mut stream = Stream::fresh();
        stream.live(event("alpha", 1));
        stream.live(event("beta", 2));
        stream.live(event("alpha", 2));
        stream.skip_prelude();
        assert_eq!(
            stream.read(),
            ("E alpha 1\nE alpha 2\n".into(), Ending::Pending)
        );
    }

    #[test]
    fn data_lost_moves_the_client_once_per_life() {
        let mut stream = Stream::fresh();
        stream.live(event("alpha", 5));
        stream.live(resync("beta", 0, ResyncReason::DataLost));
        stream.live(event("alpha", 6));
        stream.live(event("beta", 1));
        // The same loss found again (by the replay and the tail), even at a later position.
        stream.live(resync("beta", 3, ResyncReason::DataLost));
        stream.live(event("beta", 2));
        stream.live(event("beta", 1));
        // A further loss is news again.
        stream.live(resync("gamma", 0, ResyncReason::DataLost));
        stream.live(event("gamma", 1));
        stream.skip_prelude();
        assert_eq!(
            stream.read(),
            (
                "E alpha 5\nR data_lost beta 0\nE beta 1\nE beta 2\nR data_lost gamma 0\nE gamma 1\n"
                    .into(),
                Ending::Pending
            )
        );
        assert_eq!(stream.resyncs(ResyncReason::DataLost), 2);
        assert_eq!(stream.metrics.sse_events_sent.get(), 4);
    }

    #[test]
    fn expired_at_or_below_the_floor_is_dropped() {
        let mut stream = Stream::fresh();
        stream.live(event("alpha", 10));
        stream.live(resync("alpha", 8, ResyncReason::Expired));
        stream.live(resync("alpha", 10, ResyncReason::Expired));
        stream.live(resync("alpha", 12, ResyncReason::Expired));
        // The client continues after 12 now.
        stream.live(event("alpha", 11));
        stream.live(event("alpha", 12));
        stream.live(event("alpha", 13));
        stream.skip_prelude();
        assert_eq!(
            stream.read(),
            (
                "E alpha 10\nR expired alpha 12\nE alpha 13\n".into(),
                Ending::Pending
            )
        );
        assert_eq!(stream.resyncs(ResyncReason::Expired), 1);
    }

    /// A replay channel that closes without `ReplayEnd` (a drain cut it): what was replayed,
    /// the closing `retry:`, and the end; the live events waiting are never written.
    #[test]
    fn a_cut_replay_ends_the_stream_after_what_was_replayed() {
        let mut stream = Stream::resuming();
        stream.live(event("alpha", 3));
        stream.replay(floor("alpha", 1));
        stream.replay(event("alpha", 2));
        stream.control.set_farewell(Farewell::Retry(700));
        stream.replay = None;
        stream.skip_prelude();
        assert_eq!(
            stream.read(),
            ("E alpha 2\nretry: 700\n\n".into(), Ending::Ended),
            "the live sender is still there, yet the stream ends"
        );
        assert!(
            matches!(stream.poll(), Poll::Ready(None)),
            "and stays ended"
        );
    }

    /// Every sender gone: what is queued, then the closing `retry:` of the drain, then the end.
    #[test]
    fn a_clean_end_writes_the_closing_retry_last() {
        let mut stream = Stream::fresh();
        stream.live(event("alpha", 1));
        stream.live(QueueItem::Retry(1500));
        stream.live(event("alpha", 2));
        stream.control.set_farewell(Farewell::Retry(1500));
        stream.live = None;
        stream.skip_prelude();
        assert_eq!(
            stream.read(),
            (
                "E alpha 1\nretry: 1500\n\nE alpha 2\nretry: 1500\n\n".into(),
                Ending::Ended
            )
        );
        assert!(matches!(stream.poll(), Poll::Ready(None)));
    }

    #[test]
    fn an_end_without_a_closing_retry_writes_nothing_more() {
        let mut stream = Stream::fresh();
        stream.live(event("alpha", 1));
        stream.live = None;
        stream.skip_prelude();
        assert_eq!(stream.read(), ("E alpha 1\n".into(), Ending::Ended));
    }

    #[test]
    fn an_abort_ends_with_an_error_before_anything_else() {
        let mut stream = Stream::fresh();
        stream.live(event("alpha", 1));
        stream.control.abort();
        assert_eq!(
            stream.read(),
            (String::new(), Ending::Evicted),
            "not even the prelude"
        );

        let mut stream = Stream::fresh();
        stream.skip_prelude();
        stream.live(event("alpha", 1));
        stream.control.set_farewell(Farewell::Retry(500));
        stream.live = None;
        stream.control.abort();
        assert_eq!(
            stream.read(),
            (String::new(), Ending::Evicted),
            "neither what is queued nor the closing retry"
        );
    }

    #[test]
    fn frames_ready_together_are_one_chunk() {
        let mut stream = Stream::fresh();
        stream.skip_prelude();
        stream.live(event("alpha", 1));
        stream.live(QueueItem::Ping);
        stream.live(event("alpha", 2));
        stream.live(QueueItem::Retry(250));
        let (chunks, ending) = stream.chunks();
        assert_eq!(ending, Ending::Pending);
        assert_eq!(
            chunks,
            vec![Bytes::from_static(
                b"E alpha 1\n: ping\n\nE alpha 2\nretry: 250\n\n"
            )]
        );
        assert_eq!(stream.metrics.sse_events_sent.get(), 2);
        assert_eq!(stream.metrics.sse_heartbeats_sent.get(), 1);
    }

    /// A lone frame is handed over as it is: the shared bytes of a broadcast, not a copy.
    #[test]
    fn a_lone_frame_is_not_copied() {
        let mut stream = Stream::fresh();
        stream.skip_prelude();
        let frame = Bytes::from_static(b"E shared\n");
        stream.live(QueueItem::Event {
            epoch: life("alpha"),
            position: at(1),
            appended_ms: 0,
            frame: frame.clone(),
        });
        let (chunks, _) = stream.chunks();
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0].as_ptr(), frame.as_ptr());
    }

    #[test]
    fn a_chunk_stops_growing_at_64_kib() {
        let mut stream = Stream::fresh();
        stream.skip_prelude();
        for seq in 1..=3 {
            stream.live(QueueItem::Event {
                epoch: life("alpha"),
                position: at(seq),
                appended_ms: 0,
                frame: Bytes::from(vec![b'x'; 40 * 1024]),
            });
        }
        let (chunks, ending) = stream.chunks();
        assert_eq!(ending, Ending::Pending);
        let sizes: Vec<usize> = chunks.iter().map(Bytes::len).collect();
        assert_eq!(sizes, vec![80 * 1024, 40 * 1024]);
    }

    /// Dropping the body (actix does when the client is gone) releases the socket, counts the
    /// stream as closed, and tells the Connection.
    #[actix_rt::test]
    async fn drop_releases_the_socket_counts_the_stream_and_tells_the_connection() {
        let owner = Owner::default().start();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();

        let mut stream = Stream::build(
            false,
            Some(owner.clone().recipient()),
            Some(server.as_raw_fd()),
        );
        let control = stream.control.clone();
        let pod = stream.pod.clone();
        assert_eq!(pod.open_streams(), 1);
        stream.skip_prelude();
        drop(stream);
        assert_eq!(pod.open_streams(), 0);
        assert_eq!(owner.send(DroppedCount).await.unwrap(), 1);

        // The fd may belong to another connection by now: an abort leaves it alone.
        control.abort();
        server.write_all(b"ok").unwrap();
        let mut buffer = [0u8; 2];
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        client.read_exact(&mut buffer).unwrap();
        assert_eq!(&buffer, b"ok");
    }
}
