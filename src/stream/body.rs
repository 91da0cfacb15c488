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
    model::{EpochId, Position, ResyncReason},
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
    fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.rest.as_ref().map_or(0, BytesMut::len)
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
        while !this.ended && chunk.len() < MAX_CHUNK {
            let Some((item, replaying)) = this.poll_item(cx) else {
                break;
            };
            match item {
                QueueItem::Event {
                    epoch,
                    position,
                    frame,
                } => {
                    if this.admit_event(epoch, position) {
                        events += 1;
                        chunk.push(frame);
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
        // Every sender is gone: a clean end (drain) tells the client when to come back.
        if this.ended && !this.control.is_aborted() {
            if let Some(retry_ms) = this.control.take_closing_retry() {
                chunk.push(frame::retry(retry_ms));
            }
        }
        match chunk.into_bytes() {
            Some(bytes) => {
                this.control.wrote();
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
