//! Terminals following the client contract: each persists the id of the last event it
//! processed as its cursor, sends it as `Last-Event-ID` on every connect, takes a resync's id as
//! its cursor, and reconnects after any break after a short jittered delay (the stream's
//! `retry:`, at most 1 s). It names the same groups (`?groups=`) on every connect. What a device
//! processes is recorded, in order, in its [`DeviceHistory`].
//!
//! Behaviours, chosen per device from the seed:
//! - steady: reads all the time;
//! - flappy: drops its connection every few seconds and resumes after 0.1 to 2.5 s; after more
//!   than 1 s away it takes 15 ms per event for a second or two (catching up);
//! - slow: stops reading for 5 to 9 s now and then (with a small receive buffer), so the
//!   hub evicts it; it then processes what had arrived, resumes, and for a few seconds takes
//!   15 ms per event (its replays stay in progress meanwhile);
//! - takeover: now and then opens a new connection while the old one is open and stops
//!   processing the old one at that moment (the hub closes it when both are on one pod; the
//!   device drops its socket a little later either way).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::{rngs::StdRng, Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

use super::history::{Clock, DeviceHistory, Observation, Observed};
use crate::support::http::{encode_request, read_head, BodyFraming};
use crate::support::sse::{SseDecoder, SseEvent};
use crate::support::stream_path;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Silence after which a connection is presumed dead (the hubs send `: ping` every second).
const SILENCE: Duration = Duration::from_secs(4);
const POLL: Duration = Duration::from_millis(100);
/// Time a slow reader takes per event while it is sluggish.
const SLUGGISH: Duration = Duration::from_millis(15);
/// Longest wait before a reconnect, whatever `retry:` said.
const MAX_RECONNECT_DELAY_MS: u64 = 1000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    Steady,
    Flappy,
    Slow,
    Takeover,
}

impl Behaviour {
    pub fn label(self) -> &'static str {
        match self {
            Behaviour::Steady => "steady",
            Behaviour::Flappy => "flappy",
            Behaviour::Slow => "slow",
            Behaviour::Takeover => "takeover",
        }
    }
}

/// Where clients and producers can reach the hubs: nginx in front of all of them, and each
/// hub directly (their ports stay the same across restarts).
#[derive(Clone, Debug)]
pub struct Endpoints {
    pub nginx: SocketAddr,
    pub hubs: Vec<SocketAddr>,
}

impl Endpoints {
    /// nginx, or with probability `direct` one hub at random.
    pub fn pick(&self, rng: &mut StdRng, direct: f64) -> (String, SocketAddr) {
        if self.hubs.is_empty() || !rng.random_bool(direct) {
            return ("nginx".into(), self.nginx);
        }
        let i = rng.random_range(0..self.hubs.len());
        (format!("hub{i}"), self.hubs[i])
    }
}

pub struct DeviceSpec {
    /// Index on the [`Board`].
    pub index: usize,
    pub device: String,
    pub behaviour: Behaviour,
    /// Named on every connect, so that a resume replays the same groups' events.
    pub groups: Vec<String>,
    pub seed: u64,
}

/// What the fault injector may know of a device, to aim faults where they can hurt: where it is
/// connected and whether it is reading.
#[derive(Clone, Debug)]
pub struct Presence {
    pub shard: u32,
    /// The hub it is connected to directly (not through nginx), if any.
    pub hub: Option<usize>,
    /// When its current stream was answered, and whether it sent a cursor (so it replays).
    pub opened: Option<Instant>,
    pub resumed: bool,
    /// True while it has a stream open.
    pub connected: bool,
    /// False while it has no stream or does not read it.
    pub reading: bool,
    /// Until when a slow reader reads slowly after a pause: its replay then holds more than
    /// the hub buffers ahead of the client, and takes a while.
    pub sluggish_until: Option<Instant>,
}

pub type Board = Arc<Mutex<Vec<Presence>>>;

/// One open stream.
struct Conn {
    number: u32,
    stream: TcpStream,
    framing: BodyFraming,
    decoder: SseDecoder,
    pending: VecDeque<SseEvent>,
    /// Why the stream ended, once it has; reported after the pending events.
    ended: Option<String>,
    last_bytes: Instant,
}

enum Next {
    Event(SseEvent),
    Idle,
    Ended(String),
}

/// The answer to a stream request.
enum Opened {
    Stream(Box<Conn>),
    Refused(u16),
    Failed(String),
}

impl Conn {
    async fn open(
        number: u32,
        addr: SocketAddr,
        device: &str,
        groups: &[String],
        cursor: Option<&str>,
        small_buffer: bool,
    ) -> Opened {
        let attempt = async {
            let socket = TcpSocket::new_v4()?;
            if small_buffer {
                socket.set_recv_buffer_size(4096)?;
            }
            let mut stream = socket.connect(addr).await?;
            stream.set_nodelay(true)?;
            let mut headers = vec![("Accept", "text/event-stream")];
            if let Some(cursor) = cursor {
                headers.push(("Last-Event-ID", cursor));
            }
            let mut path = stream_path(device);
            if !groups.is_empty() {
                path = format!("{path}?groups={}", groups.join(","));
            }
            let request = encode_request(addr, "GET", &path, &headers, None);
            stream.write_all(&request).await?;
            let mut leftover = Vec::new();
            let head = read_head(&mut stream, &mut leftover).await?;
            if head.status != 200 {
                return Ok(Opened::Refused(head.status));
            }
            let framing = BodyFraming::for_response("GET", &head)?;
            let mut conn = Conn {
                number,
                stream,
                framing,
                decoder: SseDecoder::new(),
                pending: VecDeque::new(),
                ended: None,
                last_bytes: Instant::now(),
            };
            conn.ingest(&leftover);
            std::io::Result::Ok(Opened::Stream(Box::new(conn)))
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
            Ok(Ok(opened)) => opened,
            Ok(Err(error)) => Opened::Failed(error.to_string()),
            Err(_) => Opened::Failed(format!("no answer within {CONNECT_TIMEOUT:?}")),
        }
    }

    fn ingest(&mut self, wire: &[u8]) {
        let mut body = Vec::new();
        if let Err(error) = self.framing.decode(wire, &mut body) {
            self.ended = Some(format!("bad body framing: {error}"));
            return;
        }
        self.pending.extend(self.decoder.feed(&body));
        if self.framing.is_complete() {
            self.ended = Some("the hub ended the stream".into());
        }
    }

    async fn next(&mut self, wait: Duration) -> Next {
        let deadline = Instant::now() + wait;
        let mut buf = [0u8; 16 * 1024];
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Next::Event(event);
            }
            if let Some(why) = &self.ended {
                return Next::Ended(why.clone());
            }
            match tokio::time::timeout_at(deadline, self.stream.read(&mut buf)).await {
                Err(_) => return Next::Idle,
                Ok(Ok(0)) => self.ended = Some("the connection closed mid-stream".into()),
                Ok(Err(error)) => self.ended = Some(format!("read failed: {error}")),
                Ok(Ok(n)) => {
                    self.last_bytes = Instant::now();
                    self.ingest(&buf[..n]);
                }
            }
        }
    }

    /// The reconnect delay the stream asked for (`retry:`), capped.
    fn retry_ms(&self) -> u64 {
        self.decoder
            .retry()
            .unwrap_or(200)
            .min(MAX_RECONNECT_DELAY_MS)
    }
}

/// The data as the application keeps it: intact padding (`token|xxx...`) is shortened to
/// `token|x*N`; anything else is kept whole.
fn compact(data: String) -> String {
    match data.split_once('|') {
        Some((token, pad)) if pad.bytes().all(|b| b == b'x') => {
            format!("{token}|x*{}", pad.len())
        }
        _ => data,
    }
}

/// The device's state while it runs.
struct Device {
    spec: DeviceSpec,
    board: Board,
    endpoints: Arc<Endpoints>,
    clock: Clock,
    history: Arc<Mutex<DeviceHistory>>,
    rng: StdRng,
    cursor: Option<String>,
    connections: u32,
}

impl Device {
    fn record(&self, what: Observation) {
        let at = self.clock.now();
        self.history
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observations
            .push(Observed { at, what });
    }

    fn closed(&self, conn: u32, why: impl Into<String>) {
        self.record(Observation::Closed {
            conn,
            why: why.into(),
        });
        self.present(|p| {
            p.hub = None;
            p.opened = None;
            p.connected = false;
            p.reading = false;
        });
    }

    fn present(&self, change: impl FnOnce(&mut Presence)) {
        change(&mut self.board.lock().unwrap_or_else(|e| e.into_inner())[self.spec.index]);
    }

    /// Opens a stream with the current cursor and records the answer.
    async fn connect(&mut self) -> Option<Box<Conn>> {
        let direct = match self.spec.behaviour {
            Behaviour::Slow => 0.8,
            _ => 0.3,
        };
        let (endpoint, addr) = self.endpoints.pick(&mut self.rng, direct);
        self.connections += 1;
        let number = self.connections;
        let small = self.spec.behaviour == Behaviour::Slow;
        let cursor = self.cursor.clone();
        let opened = Conn::open(
            number,
            addr,
            &self.spec.device,
            &self.spec.groups,
            cursor.as_deref(),
            small,
        )
        .await;
        let status = match &opened {
            Opened::Stream(_) => Some(200),
            Opened::Refused(status) => Some(*status),
            Opened::Failed(_) => None,
        };
        self.record(Observation::Connected {
            conn: number,
            endpoint: endpoint.clone(),
            cursor: cursor.clone(),
            status,
        });
        match opened {
            Opened::Stream(conn) => {
                let hub = endpoint_hub(&endpoint);
                let resumed = cursor.is_some();
                self.present(|p| {
                    p.hub = hub;
                    p.opened = Some(Instant::now());
                    p.resumed = resumed;
                    p.connected = true;
                    p.reading = true;
                });
                Some(conn)
            }
            Opened::Refused(status) => {
                self.closed(number, format!("refused with {status}"));
                None
            }
            Opened::Failed(error) => {
                self.closed(number, error);
                None
            }
        }
    }

    /// Hands an event to the application and persists its id as the cursor.
    fn process(&mut self, conn: u32, event: SseEvent) {
        if event.event == "resync" {
            let reason = serde_json::from_str::<serde_json::Value>(&event.data)
                .ok()
                .and_then(|v| v["reason"].as_str().map(String::from))
                .unwrap_or_else(|| format!("unparseable {:?}", event.data));
            self.record(Observation::Resync {
                conn,
                id: event.id.clone(),
                reason,
            });
        } else {
            self.record(Observation::Event {
                conn,
                id: event.id.clone(),
                kind: event.event,
                data: compact(event.data),
            });
        }
        if let Some(id) = event.id {
            self.cursor = Some(id);
        }
    }

    fn soon(&mut self, from: f64, to: f64) -> Instant {
        Instant::now() + Duration::from_secs_f64(self.rng.random_range(from..to))
    }

    /// Sleeps `wait`, or less once the run calms down or stops.
    async fn pause(&mut self, wait: Duration, calm: &watch::Receiver<bool>) {
        let until = Instant::now() + wait;
        while Instant::now() < until && !*calm.borrow() {
            tokio::time::sleep(POLL.min(until - Instant::now())).await;
        }
    }

    async fn run(mut self, calm: watch::Receiver<bool>, stop: watch::Receiver<bool>) {
        let mut current: Option<Box<Conn>> = None;
        // A connection given up by a takeover, kept open for a while.
        let mut abandoned: Option<(Box<Conn>, Instant)> = None;
        let mut next_drop = self.soon(1.5, 5.0);
        let mut next_pause = self.soon(2.0, 6.0);
        let mut next_takeover = self.soon(2.0, 6.0);
        let mut sluggish_until = Instant::now();
        loop {
            if abandoned
                .as_ref()
                .is_some_and(|(_, until)| Instant::now() >= *until)
            {
                abandoned = None;
            }
            if *stop.borrow() {
                if let Some(conn) = current.take() {
                    self.closed(conn.number, "the run is over");
                }
                return;
            }
            let Some(conn) = current.as_mut() else {
                current = self.connect().await;
                if current.is_none() {
                    let delay = self.rng.random_range(50..300);
                    self.pause(Duration::from_millis(delay), &calm).await;
                }
                continue;
            };
            let number = conn.number;
            let now = Instant::now();
            // Calm (the quiet period at the end): every device just reads.
            let behaviour = if *calm.borrow() {
                sluggish_until = now;
                Behaviour::Steady
            } else {
                self.spec.behaviour
            };
            match behaviour {
                Behaviour::Flappy if now >= next_drop => {
                    current = None;
                    self.closed(number, "dropped by the client (flappy)");
                    next_drop = self.soon(1.5, 5.0);
                    // Off the network for a moment or for a while; after a while it takes its
                    // time over the backlog.
                    let delay = self.rng.random_range(100..2500);
                    self.pause(Duration::from_millis(delay), &calm).await;
                    if delay > 1000 {
                        sluggish_until = self.soon(1.0, 2.0);
                    }
                    continue;
                }
                Behaviour::Slow if now >= next_pause => {
                    // Long enough for its buffers to fill, the 2 s stall timeout and the 1 s
                    // sweep: usually evicted.
                    let wait = Duration::from_secs_f64(self.rng.random_range(5.0..9.0));
                    self.present(|p| p.reading = false);
                    self.pause(wait, &calm).await;
                    self.present(|p| p.reading = true);
                    if let Some(conn) = current.as_mut() {
                        conn.last_bytes = Instant::now();
                    }
                    // Then sluggish for a while: its replays take their time.
                    sluggish_until = self.soon(2.0, 4.0);
                    self.present(|p| p.sluggish_until = Some(sluggish_until));
                    next_pause = self.soon(3.0, 6.0);
                    continue;
                }
                Behaviour::Takeover if now >= next_takeover => {
                    let old = current.take().expect("a connection");
                    self.closed(
                        number,
                        "no longer processed: taken over by a new connection",
                    );
                    let keep = self.soon(0.5, 3.0);
                    abandoned = Some((old, keep));
                    next_takeover = self.soon(2.0, 7.0);
                    current = self.connect().await;
                    continue;
                }
                _ => {}
            }
            match conn.next(POLL).await {
                Next::Event(event) => {
                    self.process(number, event);
                    if Instant::now() < sluggish_until {
                        tokio::time::sleep(SLUGGISH).await;
                    }
                }
                Next::Idle => {
                    if conn.last_bytes.elapsed() >= SILENCE {
                        current = None;
                        self.closed(number, format!("no data for {SILENCE:?}: presumed dead"));
                    }
                }
                Next::Ended(why) => {
                    let retry = conn.retry_ms();
                    current = None;
                    self.closed(number, why);
                    let delay = retry / 2 + self.rng.random_range(0..=retry / 2);
                    self.pause(Duration::from_millis(delay), &calm).await;
                }
            }
        }
    }
}

/// `hubN` -> `N`.
fn endpoint_hub(endpoint: &str) -> Option<usize> {
    endpoint.strip_prefix("hub")?.parse().ok()
}

/// Runs one device until `stop`; everything it processes goes to `history`. Once `calm` is
/// set it behaves steadily (reads all the time), so that it can catch up.
pub async fn run(
    spec: DeviceSpec,
    board: Board,
    endpoints: Arc<Endpoints>,
    clock: Clock,
    history: Arc<Mutex<DeviceHistory>>,
    calm: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
) {
    let device = Device {
        rng: StdRng::seed_from_u64(spec.seed),
        spec,
        board,
        endpoints,
        clock,
        history,
        cursor: None,
        connections: 0,
    };
    device.run(calm, stop).await;
}
