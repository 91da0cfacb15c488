//! Baseline measurements for docs/BENCHMARKS.md until `posthorn loadtest` exists (issue 7).
//!
//! ```text
//! baseline idle   ADDR CONNECTIONS SERVER_PID      # RSS per idle connection
//! baseline fanout ADDR CONNECTIONS RATE SECONDS SIZE  # paced broadcasts: deliveries/s, loss
//! baseline latency ADDR REDIS_ADDR CONNECTIONS RATE SECONDS  # XADD -> SSE bytes, unicast
//! baseline drain  ADDR CONNECTIONS SERVER_PID      # drain: total time, close rate, retry spread
//! ```
//! Loopback targets only; client sockets are spread over 127.0.0.2.. so that more than one
//! source address's worth of ephemeral ports is available. Every phase is bounded in time.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpSocket, TcpStream},
};

const CONNECTIONS_PER_SOURCE: usize = 20_000;
const PHASE_LIMIT: Duration = Duration::from_secs(120);

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("server pid");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

async fn open_stream(addr: SocketAddr, index: usize, device: String) -> TcpStream {
    let source = Ipv4Addr::new(127, 0, 0, 2 + (index / CONNECTIONS_PER_SOURCE) as u8);
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(IpAddr::V4(source), 0))
        .expect("bind source");
    let mut stream = socket.connect(addr).await.expect("connect");
    let request = format!("GET /v1/devices/{device}/events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("request");
    // Read the head and the prelude, so the connection is known to be open.
    let mut buf = [0u8; 1024];
    let mut seen = Vec::new();
    while !seen.windows(10).any(|w| w == b"posthorn\n\n") {
        let n = stream.read(&mut buf).await.expect("read");
        assert!(n > 0, "closed during connect");
        seen.extend_from_slice(&buf[..n]);
    }
    stream
}

/// Opens `count` streams, 500 at a time, device `i` named by `device(i)`.
async fn open_streams(
    addr: SocketAddr,
    count: usize,
    device: impl Fn(usize) -> String,
) -> Vec<TcpStream> {
    let mut streams = Vec::with_capacity(count);
    for chunk in (0..count).collect::<Vec<_>>().chunks(500) {
        streams.extend(
            futures_util::future::join_all(chunk.iter().map(|&i| open_stream(addr, i, device(i))))
                .await,
        );
    }
    streams
}

async fn post(addr: SocketAddr, body: &str) {
    let mut stream = TcpStream::connect(addr).await.expect("connect publisher");
    let request = format!(
        "POST /v1/events HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("publish");
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .expect("publish answer");
    assert!(
        response.starts_with(b"HTTP/1.1 201"),
        "{}",
        String::from_utf8_lossy(&response)
    );
}

async fn idle(addr: SocketAddr, connections: usize, pid: u32) {
    let before = rss_kib(pid);
    let started = Instant::now();
    let streams = open_streams(addr, connections, |i| format!("idle-{i}")).await;
    let connect_seconds = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let open = rss_kib(pid);
    drop(streams);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = rss_kib(pid);
    let per_connection = (open.saturating_sub(before)) as f64 * 1024.0 / connections as f64;
    println!(
        "idle: {connections} connections opened in {connect_seconds:.2}s ({:.0}/s); server RSS {before} KiB before, {open} KiB open, {after} KiB after close; {per_connection:.0} bytes per idle connection",
        connections as f64 / connect_seconds
    );
    println!(
        "{{\"scenario\":\"idle\",\"connections\":{connections},\"rss_before_kib\":{before},\"rss_open_kib\":{open},\"rss_after_kib\":{after},\"bytes_per_connection\":{per_connection:.0},\"connects_per_second\":{:.0}}}",
        connections as f64 / connect_seconds
    );
}

/// Counts `id: ` occurrences across reads (events carry one, pings none).
async fn count_events(mut stream: TcpStream, counter: Arc<AtomicU64>, target: u64) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut carry: Vec<u8> = Vec::new();
    let mut seen = 0;
    while seen < target {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        carry.extend_from_slice(&buf[..n]);
        let found = carry.windows(4).filter(|w| w == b"id: ").count() as u64;
        seen += found;
        counter.fetch_add(found, Ordering::Relaxed);
        let keep = carry.len().min(3);
        carry.drain(..carry.len() - keep);
    }
}

/// Publishes `rate` broadcasts per second for `seconds` (one batch every 10 ms) to `connections`
/// streams; each broadcast is one delivery per connection.
async fn fanout(addr: SocketAddr, connections: usize, rate: u64, seconds: u64, size: usize) {
    let streams = open_streams(addr, connections, |i| format!("fan-{i}")).await;
    let events = rate * seconds;
    let delivered = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = streams
        .into_iter()
        .map(|stream| tokio::spawn(count_events(stream, delivered.clone(), events)))
        .collect();
    let payload = "x".repeat(size);
    let started = Instant::now();
    let tick = Duration::from_millis(10);
    let mut sent = 0;
    let mut next = tokio::time::Instant::now();
    while sent < events {
        next += tick;
        tokio::time::sleep_until(next).await;
        let due = ((started.elapsed().as_secs_f64() * rate as f64) as u64).min(events);
        if due > sent {
            let items: Vec<String> = (sent..due)
                .map(|_| format!("{{\"broadcast\":true,\"data\":\"{payload}\"}}"))
                .collect();
            post(addr, &format!("[{}]", items.join(","))).await;
            sent = due;
        }
    }
    let published = started.elapsed().as_secs_f64();
    let expected = events * connections as u64;
    let drain_limit = Instant::now() + Duration::from_secs(10);
    while delivered.load(Ordering::Relaxed) < expected && Instant::now() < drain_limit {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let got = delivered.load(Ordering::Relaxed);
    let mut closed = 0;
    for reader in readers {
        if reader.is_finished() {
            continue;
        }
        reader.abort();
        closed += 1;
    }
    println!(
        "fanout: {rate} broadcasts/s of {size} B for {seconds}s to {connections} connections: {got}/{expected} delivered ({:.3}% loss, {closed} streams short) in {elapsed:.2}s (publishing took {published:.2}s): {:.0} deliveries/s",
        100.0 * (expected - got) as f64 / expected as f64,
        got as f64 / elapsed
    );
    println!(
        "{{\"scenario\":\"fanout\",\"connections\":{connections},\"rate\":{rate},\"seconds\":{seconds},\"size\":{size},\"delivered\":{got},\"expected\":{expected},\"elapsed\":{elapsed:.3},\"deliveries_per_second\":{:.0}}}",
        got as f64 / elapsed
    );
}

fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Reads a stream and records, per `data: <send time in µs>` line, now minus that time.
async fn record_latencies(
    mut stream: TcpStream,
    expected: usize,
    samples: Arc<std::sync::Mutex<Vec<u64>>>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    let mut seen = 0;
    while seen < expected {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let now = now_micros();
        pending.extend_from_slice(&buf[..n]);
        let mut start = 0;
        let mut local = Vec::new();
        while let Some(end) = pending[start..].iter().position(|b| *b == b'\n') {
            let line = &pending[start..start + end];
            if let Some(value) = line.strip_prefix(b"data: ") {
                if let Some(sent) = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                {
                    local.push(now.saturating_sub(sent));
                    seen += 1;
                }
            }
            start += end + 1;
        }
        pending.drain(..start);
        samples.lock().unwrap().extend(local);
    }
}

fn resp_command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Unicast events appended straight to Redis (as an external producer would, `XADD ... MINID ~`
/// not needed for a short run) at `rate` per second, round robin over `connections` devices.
async fn latency(addr: SocketAddr, redis: SocketAddr, connections: usize, rate: u64, seconds: u64) {
    assert!(
        redis.ip().is_loopback(),
        "baseline only targets loopback addresses"
    );
    let devices: Vec<String> = (0..connections).map(|i| format!("lat-{i}")).collect();
    let events = (rate * seconds) as usize;
    let per_device = events / connections;
    let streams = open_streams(addr, connections, |i| devices[i].clone()).await;
    let samples = Arc::new(std::sync::Mutex::new(Vec::with_capacity(events)));
    let readers: Vec<_> = streams
        .into_iter()
        .map(|stream| tokio::spawn(record_latencies(stream, per_device, samples.clone())))
        .collect();
    let keys: Vec<String> = devices
        .iter()
        .map(|d| format!("pos-ev:{}", crc32fast::hash(d.as_bytes()) % 64))
        .collect();
    let mut producer = TcpStream::connect(redis).await.expect("connect redis");
    producer.set_nodelay(true).expect("nodelay");
    let started = Instant::now();
    let tick = Duration::from_millis(5);
    let mut next = tokio::time::Instant::now();
    let mut sent = 0usize;
    let mut reply = vec![0u8; 64 * 1024];
    while sent < per_device * connections {
        next += tick;
        tokio::time::sleep_until(next).await;
        let due = ((started.elapsed().as_secs_f64() * rate as f64) as usize)
            .min(per_device * connections);
        let mut batch = Vec::new();
        for i in sent..due {
            let device = i % connections;
            let stamp = now_micros().to_string();
            batch.extend(resp_command(&[
                b"XADD",
                keys[device].as_bytes(),
                b"*",
                b"dev",
                devices[device].as_bytes(),
                b"data",
                stamp.as_bytes(),
            ]));
        }
        producer.write_all(&batch).await.expect("xadd");
        // One bulk-string reply (two CRLFs) per XADD.
        let mut crlfs = 0;
        while crlfs < 2 * (due - sent) {
            let n = producer.read(&mut reply).await.expect("xadd reply");
            crlfs += reply[..n].windows(2).filter(|w| w == b"\r\n").count();
        }
        sent = due;
    }
    let limit = Instant::now() + Duration::from_secs(10);
    while samples.lock().unwrap().len() < sent && Instant::now() < limit {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for reader in readers {
        reader.abort();
    }
    let mut all = samples.lock().unwrap().clone();
    all.sort_unstable();
    let pick = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0) as f64
            / 1000.0
    };
    println!(
        "latency: {rate} unicast XADD/s for {seconds}s over {connections} connections: {}/{sent} delivered; XADD -> SSE bytes p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max {:.2} ms",
        all.len(), pick(0.5), pick(0.99), pick(0.999), pick(1.0)
    );
    println!(
        "{{\"scenario\":\"latency\",\"connections\":{connections},\"rate\":{rate},\"seconds\":{seconds},\"sent\":{sent},\"delivered\":{},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"p999_ms\":{:.3},\"max_ms\":{:.3}}}",
        all.len(), pick(0.5), pick(0.99), pick(0.999), pick(1.0)
    );
}

/// Reads until the server closes; returns when that happened (since `started`) and the last
/// `retry:` value seen.
async fn until_closed(mut stream: TcpStream, started: Instant) -> (Duration, Option<u64>) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut tail: Vec<u8> = Vec::new();
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                tail.extend_from_slice(&buf[..n]);
                let keep = tail.len().saturating_sub(256);
                tail.drain(..keep);
            }
        }
    }
    let closed = started.elapsed();
    let text = String::from_utf8_lossy(&tail);
    let retry = text
        .rfind("retry: ")
        .and_then(|at| text[at + 7..].split('\n').next())
        .and_then(|value| value.trim().parse().ok());
    (closed, retry)
}

async fn drain(addr: SocketAddr, connections: usize, pid: u32) {
    let streams = open_streams(addr, connections, |i| format!("drain-{i}")).await;
    let started = Instant::now();
    let readers: Vec<_> = streams
        .into_iter()
        .map(|stream| tokio::spawn(until_closed(stream, started)))
        .collect();
    let mut admin = TcpStream::connect(addr).await.expect("connect admin");
    let request = format!("POST /admin/drain HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    admin
        .write_all(request.as_bytes())
        .await
        .expect("drain request");
    let mut answer = Vec::new();
    admin.read_to_end(&mut answer).await.expect("drain answer");
    assert!(
        answer.starts_with(b"HTTP/1.1 202"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    let mut closes = Vec::with_capacity(connections);
    let mut retries = Vec::with_capacity(connections);
    for reader in readers {
        let (closed, retry) = reader.await.expect("reader");
        closes.push(closed.as_secs_f64());
        retries.extend(retry);
    }
    let exit_wait = Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}")).exists()
        && exit_wait.elapsed() < Duration::from_secs(30)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let exited = started.elapsed().as_secs_f64();
    closes.sort_by(f64::total_cmp);
    retries.sort_unstable();
    let (first, last) = (closes[0], closes[closes.len() - 1]);
    let rate = connections as f64 / (last - first).max(0.001);
    let (low, high) = (
        retries.first().copied().unwrap_or(0),
        retries.last().copied().unwrap_or(0),
    );
    let mut buckets = [0usize; 6];
    for retry in &retries {
        let index = ((retry - low) * 6 / (high - low + 1)) as usize;
        buckets[index.min(5)] += 1;
    }
    println!(
        "drain: {connections} connections: first close {first:.2}s, last close {last:.2}s, process gone {exited:.2}s after the request; {rate:.0} closes/s; {} retry values in {low}..{high} ms, per sixth of the range: {buckets:?}",
        retries.len()
    );
    println!(
        "{{\"scenario\":\"drain\",\"connections\":{connections},\"first_close_s\":{first:.3},\"last_close_s\":{last:.3},\"exit_s\":{exited:.3},\"closes_per_second\":{rate:.1},\"retries\":{},\"retry_min_ms\":{low},\"retry_max_ms\":{high},\"retry_sixths\":{buckets:?}}}",
        retries.len()
    );
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: baseline idle ADDR CONNECTIONS SERVER_PID | baseline fanout ADDR CONNECTIONS RATE SECONDS SIZE | baseline latency ADDR REDIS_ADDR CONNECTIONS RATE SECONDS | baseline drain ADDR CONNECTIONS SERVER_PID";
    let addr: SocketAddr = args.get(1).and_then(|a| a.parse().ok()).expect(usage);
    assert!(
        addr.ip().is_loopback(),
        "baseline only targets loopback addresses"
    );
    let number = |i: usize| -> u64 { args.get(i).and_then(|a| a.parse().ok()).expect(usage) };
    let work = async {
        match args.first().map(String::as_str) {
            Some("idle") => idle(addr, number(2) as usize, number(3) as u32).await,
            Some("drain") => drain(addr, number(2) as usize, number(3) as u32).await,
            Some("latency") => {
                let redis: SocketAddr = args.get(2).and_then(|a| a.parse().ok()).expect(usage);
                latency(addr, redis, number(3) as usize, number(4), number(5)).await
            }
            Some("fanout") => {
                fanout(
                    addr,
                    number(2) as usize,
                    number(3),
                    number(4),
                    number(5) as usize,
                )
                .await
            }
            _ => panic!("{usage}"),
        }
    };
    tokio::time::timeout(PHASE_LIMIT * 2, work)
        .await
        .expect("baseline exceeded its time limit");
}
