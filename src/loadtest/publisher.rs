//! Publishing load-test events to the server under test: posthorn's `POST /v1/events` (batched,
//! or a set number of events per request pipelined like nchan's), straight into Redis Streams
//! with `XADD` as an external producer would (the entry format of docs/stream-format.md,
//! standalone key layout), or nchan's `POST /pub/{channel}` (one message per request, pipelined
//! over several keep-alive connections, as nchan has no batch publish).

use std::{
    io,
    time::{Duration, Instant},
};

use tokio::io::AsyncWriteExt;

use super::{payload::Target, wire, Endpoint, Peer};

/// Connections that pipelined requests are spread over (nchan's, and posthorn's with a set
/// number of events per request).
const PIPELINED_CONNECTIONS: usize = 8;
/// A connection idle this long is opened anew before its next request: servers close idle
/// keep-alive connections (actix-web after 5 s, nginx after 75 s), and a request written into
/// one that is closing fails (a broadcast every 10 s did).
const REOPEN_AFTER_IDLE: Duration = Duration::from_secs(2);
/// posthorn's default `limits.max_batch`.
pub const POSTHORN_MAX_BATCH: usize = 1000;

/// One event: to a device (index into the run's device names), a group or all.
pub struct Outgoing {
    pub target: Target,
    pub data: String,
}

pub enum Publisher {
    Posthorn(Connection),
    /// posthorn with `events_per_request` events per request, pipelined.
    PosthornPipelined {
        connections: Vec<Connection>,
        events_per_request: usize,
        /// The connection the next request goes to: requests go round all of them, so none
        /// sits idle past the server's timeout for a first request.
        next: usize,
    },
    Nchan(Vec<Connection>),
    Redis {
        connection: Connection,
        prefix: String,
        shards: u32,
    },
}

pub struct Connection {
    endpoint: Endpoint,
    stream: wire::Conn,
    buf: Vec<u8>,
    /// When its last request began.
    used: Instant,
}

impl Connection {
    async fn open(endpoint: &Endpoint) -> io::Result<Self> {
        Ok(Self {
            endpoint: endpoint.clone(),
            stream: wire::open(endpoint, None, None).await?,
            buf: Vec::new(),
            used: Instant::now(),
        })
    }

    /// Before a request: opened anew if it sat idle for [`REOPEN_AFTER_IDLE`].
    async fn ready(&mut self) -> io::Result<()> {
        if self.used.elapsed() >= REOPEN_AFTER_IDLE {
            self.stream = wire::open(&self.endpoint, None, None).await?;
            self.buf.clear();
        }
        self.used = Instant::now();
        Ok(())
    }
}

/// How events reach the server.
#[derive(Debug, Clone)]
pub enum Route {
    Http {
        endpoint: Endpoint,
        /// posthorn only: a set number of events per request, pipelined.
        events_per_request: Option<usize>,
    },
    Redis {
        endpoint: Endpoint,
        prefix: String,
        shards: u32,
    },
}

impl Publisher {
    pub async fn open(peer: Peer, route: &Route) -> io::Result<Self> {
        Ok(match (peer, route) {
            (
                _,
                Route::Redis {
                    endpoint,
                    prefix,
                    shards,
                },
            ) => Publisher::Redis {
                connection: Connection::open(endpoint).await?,
                prefix: prefix.clone(),
                shards: *shards,
            },
            (
                Peer::Posthorn,
                Route::Http {
                    endpoint,
                    events_per_request: None,
                },
            ) => Publisher::Posthorn(Connection::open(endpoint).await?),
            (
                Peer::Posthorn,
                Route::Http {
                    endpoint,
                    events_per_request: Some(events_per_request),
                },
            ) => Publisher::PosthornPipelined {
                connections: open_pipelined(endpoint).await?,
                events_per_request: *events_per_request,
                next: 0,
            },
            (Peer::Nchan, Route::Http { endpoint, .. }) => {
                Publisher::Nchan(open_pipelined(endpoint).await?)
            }
        })
    }

    /// Publishes `events` and waits until the server accepted every one.
    pub async fn publish(&mut self, devices: &[String], events: &[Outgoing]) -> io::Result<()> {
        let connections: Vec<&mut Connection> = match self {
            Publisher::Posthorn(connection) | Publisher::Redis { connection, .. } => {
                vec![connection]
            }
            Publisher::PosthornPipelined { connections, .. } | Publisher::Nchan(connections) => {
                connections.iter_mut().collect()
            }
        };
        for connection in connections {
            connection.ready().await?;
        }
        match self {
            Publisher::Posthorn(connection) => {
                for batch in events.chunks(POSTHORN_MAX_BATCH) {
                    posthorn_batch(connection, devices, batch).await?;
                }
                Ok(())
            }
            Publisher::PosthornPipelined {
                connections,
                events_per_request,
                next,
            } => {
                let requests: Vec<&[Outgoing]> = events.chunks(*events_per_request).collect();
                let count = connections.len();
                let first = *next;
                *next = (first + requests.len()) % count;
                let work = connections
                    .iter_mut()
                    .enumerate()
                    .map(|(lane, connection)| {
                        let share = lane_share(&requests, first, lane, count).copied();
                        posthorn_pipeline(connection, devices, share)
                    });
                futures_util::future::try_join_all(work).await.map(|_| ())
            }
            Publisher::Nchan(connections) => {
                let count = connections.len();
                let work = connections
                    .iter_mut()
                    .enumerate()
                    .map(|(lane, connection)| {
                        let share = events.iter().skip(lane).step_by(count);
                        nchan_pipeline(connection, devices, share)
                    });
                futures_util::future::try_join_all(work).await.map(|_| ())
            }
            Publisher::Redis {
                connection,
                prefix,
                shards,
            } => redis_pipeline(connection, devices, events, prefix, *shards).await,
        }
    }
}

/// The requests of connection `lane` of `count` when the first request goes to `first`: request
/// k of the publish goes to connection (first + k) mod count, so that successive publishes go
/// round every connection.
fn lane_share<T>(
    requests: &[T],
    first: usize,
    lane: usize,
    count: usize,
) -> impl Iterator<Item = &T> {
    requests
        .iter()
        .skip((lane + count - first) % count)
        .step_by(count)
}

async fn open_pipelined(endpoint: &Endpoint) -> io::Result<Vec<Connection>> {
    let mut connections = Vec::with_capacity(PIPELINED_CONNECTIONS);
    for _ in 0..PIPELINED_CONNECTIONS {
        connections.push(Connection::open(endpoint).await?);
    }
    Ok(connections)
}

/// One `POST /v1/events` of `batch`: a JSON array, or the event's own object when `batch` holds
/// one event and `single` is set.
fn posthorn_request(
    endpoint: &Endpoint,
    devices: &[String],
    batch: &[Outgoing],
    single: bool,
) -> String {
    let host = &endpoint.host;
    let mut body = String::with_capacity(batch.iter().map(|e| e.data.len() + 48).sum());
    let array = !(single && batch.len() == 1);
    if array {
        body.push('[');
    }
    for (i, event) in batch.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        // Load-test payloads are plain ASCII without quotes or backslashes: no escaping needed.
        match event.target {
            Target::Device(device) => {
                body.push_str("{\"device\":\"");
                body.push_str(&devices[device as usize]);
                body.push_str("\",\"data\":\"");
            }
            Target::Group(group) => {
                body.push_str("{\"group\":\"");
                body.push_str(&super::group_name(1, group as usize));
                body.push_str("\",\"data\":\"");
            }
            Target::Broadcast => body.push_str("{\"broadcast\":true,\"data\":\""),
        }
        body.push_str(&event.data);
        body.push_str("\"}");
    }
    if array {
        body.push(']');
    }
    let authorization = endpoint
        .authorization
        .as_deref()
        .map(|value| format!("Authorization: {value}\r\n"))
        .unwrap_or_default();
    format!(
        "POST /v1/events HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{authorization}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn posthorn_answer(status: u16, answer: &[u8]) -> io::Result<()> {
    if status != 201 {
        return Err(io::Error::other(format!(
            "publish answered {status}: {}",
            String::from_utf8_lossy(answer)
        )));
    }
    Ok(())
}

async fn posthorn_batch(
    connection: &mut Connection,
    devices: &[String],
    batch: &[Outgoing],
) -> io::Result<()> {
    let request = posthorn_request(&connection.endpoint, devices, batch, false);
    let (status, answer) = wire::request(
        &mut connection.stream,
        &mut connection.buf,
        request.as_bytes(),
    )
    .await?;
    posthorn_answer(status, &answer)
}

/// Writes every request of `batches` at once, then reads their answers in order.
async fn posthorn_pipeline<'a>(
    connection: &mut Connection,
    devices: &[String],
    batches: impl Iterator<Item = &'a [Outgoing]>,
) -> io::Result<()> {
    let mut requests = Vec::new();
    let mut count = 0;
    for batch in batches {
        let request = posthorn_request(&connection.endpoint, devices, batch, true);
        requests.extend_from_slice(request.as_bytes());
        count += 1;
    }
    pipeline(connection, &requests, count, posthorn_answer).await
}

async fn nchan_pipeline<'a>(
    connection: &mut Connection,
    devices: &[String],
    events: impl Iterator<Item = &'a Outgoing>,
) -> io::Result<()> {
    let mut requests = Vec::new();
    let mut count = 0;
    for event in events {
        let channel = match event.target {
            Target::Device(device) => devices[device as usize].as_str(),
            Target::Broadcast => "broadcast",
            // The fanout refuses group events for nchan before anything is published.
            Target::Group(_) => return Err(io::Error::other("nchan has no groups")),
        };
        requests.extend_from_slice(
            format!(
                "POST /pub/{channel} HTTP/1.1\r\nHost: {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n",
                connection.endpoint.host,
                event.data.len()
            )
            .as_bytes(),
        );
        requests.extend_from_slice(event.data.as_bytes());
        count += 1;
    }
    pipeline(connection, &requests, count, nchan_answer).await
}

fn nchan_answer(status: u16, answer: &[u8]) -> io::Result<()> {
    // 201: delivered to subscribers; 202: stored, nobody subscribed.
    if status != 201 && status != 202 {
        return Err(io::Error::other(format!(
            "nchan publish answered {status}: {}",
            String::from_utf8_lossy(answer)
        )));
    }
    Ok(())
}

/// Writes `count` requests (back to back in `requests`) at once, then reads their answers in
/// order, each judged by `check`.
async fn pipeline(
    connection: &mut Connection,
    requests: &[u8],
    count: usize,
    check: fn(u16, &[u8]) -> io::Result<()>,
) -> io::Result<()> {
    if count == 0 {
        return Ok(());
    }
    connection.stream.write_all(requests).await?;
    for _ in 0..count {
        let (status, answer) =
            wire::read_response(&mut connection.stream, &mut connection.buf).await?;
        check(status, &answer)?;
    }
    Ok(())
}

fn resp_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

async fn redis_pipeline(
    connection: &mut Connection,
    devices: &[String],
    events: &[Outgoing],
    prefix: &str,
    shards: u32,
) -> io::Result<()> {
    let mut commands = Vec::new();
    let mut count = 0;
    let mut xadd = |key: String, field: &[u8], target: &[u8], data: &[u8]| {
        resp_command(
            &mut commands,
            &[b"XADD", key.as_bytes(), b"*", field, target, b"data", data],
        );
        count += 1;
    };
    for event in events {
        let data = event.data.as_bytes();
        match event.target {
            Target::Device(device) => {
                let name = devices[device as usize].as_bytes();
                let shard = crc32fast::hash(name) % shards;
                xadd(format!("{prefix}:{shard}"), b"dev", name, data);
            }
            // A group event, as a broadcast, is one copy on every shard (docs/stream-format.md).
            Target::Group(group) => {
                let name = super::group_name(1, group as usize);
                for shard in 0..shards {
                    xadd(format!("{prefix}:{shard}"), b"grp", name.as_bytes(), data);
                }
            }
            Target::Broadcast => {
                for shard in 0..shards {
                    xadd(format!("{prefix}:{shard}"), b"dev", b"*", data);
                }
            }
        }
    }
    connection.stream.write_all(&commands).await?;
    for _ in 0..count {
        read_resp_reply(connection).await?;
    }
    Ok(())
}

/// Reads one reply to XADD: a bulk string (the id) or an error.
async fn read_resp_reply(connection: &mut Connection) -> io::Result<()> {
    loop {
        let buf = &connection.buf;
        if let Some(end) = memchr::memmem::find(buf, b"\r\n") {
            match buf.first() {
                Some(b'$') => {
                    let length: i64 = std::str::from_utf8(&buf[1..end])
                        .ok()
                        .and_then(|n| n.parse().ok())
                        .ok_or_else(|| io::Error::other("malformed Redis reply"))?;
                    let total = end + 2 + if length < 0 { 0 } else { length as usize + 2 };
                    if buf.len() >= total {
                        connection.buf.drain(..total);
                        return Ok(());
                    }
                }
                _ => {
                    return Err(io::Error::other(format!(
                        "Redis answered {}",
                        String::from_utf8_lossy(&buf[..end])
                    )))
                }
            }
        }
        let mut chunk = [0u8; 16 * 1024];
        let n = tokio::io::AsyncReadExt::read(&mut connection.stream, &mut chunk).await?;
        if n == 0 {
            return Err(io::Error::other("Redis closed the connection"));
        }
        connection.buf.extend_from_slice(&chunk[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Publishes of any size keep going round the connections: request n of the whole run goes
    /// to connection n mod count.
    #[test]
    fn pipelined_requests_go_round_every_connection() {
        let count = 8;
        let mut next = 0;
        let mut sent = 0;
        for size in [5, 5, 6, 1, 0, 13, 8, 3] {
            let requests: Vec<usize> = (sent..sent + size).collect();
            let mut seen = Vec::new();
            for lane in 0..count {
                for &request in lane_share(&requests, next, lane, count) {
                    assert_eq!(request % count, lane, "request {request}");
                    seen.push(request);
                }
            }
            seen.sort();
            assert_eq!(seen, requests, "each request once");
            next = (next + size) % count;
            sent += size;
        }
    }

    /// A batch names each item's target as the publish API does: device, group, broadcast.
    #[test]
    fn items_for_a_device_a_group_and_all() {
        let endpoint = Endpoint::resolve("127.0.0.1:8080", 80, false).unwrap();
        let devices = ["lt-0".to_string(), "lt-1".to_string()];
        let events =
            [Target::Device(1), Target::Group(7), Target::Broadcast].map(|target| Outgoing {
                target,
                data: "x".into(),
            });
        let request = posthorn_request(&endpoint, &devices, &events, false);
        let body = request.split_once("\r\n\r\n").unwrap().1;
        assert_eq!(
            body,
            r#"[{"device":"lt-1","data":"x"},{"group":"g1-7","data":"x"},{"broadcast":true,"data":"x"}]"#
        );
    }
}
