//! Self-tests of the nginx piece of the harness (`support::nginx`): a real
//! nginx in front of tiny in-test HTTP upstreams, without the hub, proving
//! the proxy behaves as the hub tests behind it assume (round-robin, retry
//! on 503, no response buffering).

mod support;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use support::http::{self, BodyFraming};
use support::{Nginx, IO_TIMEOUT};

/// Pause of the streaming upstream between its two chunks.
const STREAM_GAP: Duration = Duration::from_millis(300);
/// How soon the first chunk must reach the client through nginx; well
/// under [`STREAM_GAP`], so a buffering proxy (which would hold the chunk
/// until more data or the end) cannot pass.
const STREAM_DEADLINE: Duration = Duration::from_millis(200);

/// How a test upstream answers every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    /// 200 with its name as the body.
    Ok,
    /// 503 with its name as the body, like a draining hub refusing a stream.
    Unavailable,
    /// 200 with `first`, then after [`STREAM_GAP`] `second`. Framed by
    /// `Content-Length`, not chunked: nginx passes each complete upstream
    /// chunk on even with buffering on, but holds a partial
    /// `Content-Length` body in its buffer, so only this framing tells the
    /// two modes apart.
    Streaming,
}

/// What the streaming upstream did when, for timing assertions.
#[derive(Debug, Default)]
struct StreamLog {
    first_written: Mutex<Option<Instant>>,
    second_written: AtomicBool,
}

/// A tiny HTTP/1.1 server on a free loopback port; dropping it stops
/// accepting and aborts the connections in flight.
struct Upstream {
    name: &'static str,
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    stream_log: Arc<StreamLog>,
    task: JoinHandle<()>,
}

impl Upstream {
    async fn start(name: &'static str, behaviour: Behaviour) -> Upstream {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind upstream on 127.0.0.1:0");
        let addr = listener.local_addr().expect("local_addr");
        let hits = Arc::new(AtomicUsize::new(0));
        let stream_log = Arc::new(StreamLog::default());
        let (task_hits, task_log) = (hits.clone(), stream_log.clone());
        let task = tokio::spawn(async move {
            // Connection tasks are detached; aborting the accept loop is
            // enough because nginx closes its side when the test ends.
            while let Ok((conn, _)) = listener.accept().await {
                let (hits, log) = (task_hits.clone(), task_log.clone());
                tokio::spawn(serve(conn, name, behaviour, hits, log));
            }
        });
        Upstream {
            name,
            addr,
            hits,
            stream_log,
            task,
        }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Answers requests on one connection until the peer closes it. Requests
/// are GETs without a body, so the head is the whole request.
async fn serve(
    mut conn: TcpStream,
    name: &'static str,
    behaviour: Behaviour,
    hits: Arc<AtomicUsize>,
    log: Arc<StreamLog>,
) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        while http::find(&buf, b"\r\n\r\n").is_none() {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let end = http::find(&buf, b"\r\n\r\n").expect("head end") + 4;
        buf.drain(..end);
        hits.fetch_add(1, Ordering::SeqCst);
        let written = match behaviour {
            Behaviour::Ok | Behaviour::Unavailable => {
                let status = if behaviour == Behaviour::Ok {
                    "200 OK"
                } else {
                    "503 Service Unavailable"
                };
                let response = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{name}",
                    name.len()
                );
                conn.write_all(response.as_bytes()).await
            }
            Behaviour::Streaming => stream(&mut conn, &log).await,
        };
        if written.is_err() {
            return;
        }
    }
}

async fn stream(conn: &mut TcpStream, log: &StreamLog) -> std::io::Result<()> {
    conn.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 11\r\n\r\nfirst",
    )
    .await?;
    *log.first_written.lock().unwrap() = Some(Instant::now());
    tokio::time::sleep(STREAM_GAP).await;
    log.second_written.store(true, Ordering::SeqCst);
    conn.write_all(b"second").await
}

/// Requests through nginx reach the upstreams, and nginx spreads them
/// round-robin: over several requests both upstreams answer, and every
/// request was served exactly once.
#[tokio::test]
async fn proxies_to_all_upstreams_round_robin() {
    let a = Upstream::start("upstream-a", Behaviour::Ok).await;
    let b = Upstream::start("upstream-b", Behaviour::Ok).await;
    let nginx = Nginx::start(&[a.addr, b.addr]).await;
    assert_eq!(
        nginx.addr(),
        SocketAddr::from((Ipv4Addr::LOCALHOST, nginx.port()))
    );

    let mut seen = Vec::new();
    for _ in 0..6 {
        let response = http::get(nginx.addr(), "/anything").await;
        assert_eq!(response.status, 200, "body {:?}", response.text());
        seen.push(response.text());
    }
    for upstream in [&a, &b] {
        assert!(
            seen.iter().any(|body| body == upstream.name),
            "{} never answered: {seen:?}\nnginx error log:\n{}",
            upstream.name,
            nginx.error_log()
        );
    }
    assert_eq!(
        a.hits() + b.hits(),
        6,
        "one upstream request per client request"
    );
}

/// When an upstream refuses a request with 503 (a draining hub), nginx
/// retries it on the other upstream and the client only ever sees 200 from
/// the healthy one; the refusing upstream really was tried.
#[tokio::test]
async fn retries_a_503_on_the_other_upstream() {
    // Listed first: round-robin with equal weights starts with it.
    let draining = Upstream::start("draining", Behaviour::Unavailable).await;
    let healthy = Upstream::start("healthy", Behaviour::Ok).await;
    let nginx = Nginx::start(&[draining.addr, healthy.addr]).await;

    for i in 0..4 {
        let response = http::get(nginx.addr(), "/v1/devices/d1/events").await;
        assert_eq!(
            (response.status, response.text().as_str()),
            (200, "healthy"),
            "request {i}\nnginx error log:\n{}",
            nginx.error_log()
        );
    }
    assert!(
        draining.hits() >= 1,
        "the 503 upstream was never tried, so the retry was not exercised"
    );
    assert_eq!(healthy.hits(), 4);
}

/// Proxy buffering is off: the first chunk of a streaming response reaches
/// the client through nginx within 200 ms of the upstream writing it, while
/// the upstream has not written the second chunk yet (it waits 300 ms).
#[tokio::test]
async fn streams_chunks_without_buffering() {
    let upstream = Upstream::start("streamer", Behaviour::Streaming).await;
    let nginx = Nginx::start(&[upstream.addr]).await;

    let mut conn = TcpStream::connect(nginx.addr())
        .await
        .expect("connect nginx");
    conn.write_all(&http::encode_request(
        nginx.addr(),
        "GET",
        "/stream",
        &[("Connection", "close")],
        None,
    ))
    .await
    .expect("send request");

    let read_body = async {
        let mut buf = Vec::new();
        let head = http::read_head(&mut conn, &mut buf).await.expect("head");
        assert_eq!(head.status, 200);
        let mut framing = BodyFraming::for_response("GET", &head).expect("framing");
        let mut body = Vec::new();
        framing.decode(&buf, &mut body).expect("decode");
        let mut first_arrived = None;
        let mut chunk = [0u8; 4096];
        while !framing.is_complete() {
            if first_arrived.is_none() && body.starts_with(b"first") {
                first_arrived = Some(Instant::now());
                assert!(
                    !upstream.stream_log.second_written.load(Ordering::SeqCst),
                    "the first chunk arrived only after the second was written"
                );
            }
            let n = conn.read(&mut chunk).await.expect("read body");
            assert!(n > 0, "nginx closed mid-body; got {body:?}");
            framing.decode(&chunk[..n], &mut body).expect("decode");
        }
        (first_arrived, body)
    };
    let (first_arrived, body) = tokio::time::timeout(IO_TIMEOUT, read_body)
        .await
        .expect("streamed response within the harness timeout");

    assert_eq!(String::from_utf8_lossy(&body), "firstsecond");
    let first_arrived = first_arrived
        .expect("`first` arrived only together with `second`: nginx buffered the response");
    let first_written = upstream
        .stream_log
        .first_written
        .lock()
        .unwrap()
        .expect("upstream wrote the first chunk");
    let delay = first_arrived.duration_since(first_written);
    assert!(
        delay < STREAM_DEADLINE,
        "first chunk took {delay:?} through nginx (limit {STREAM_DEADLINE:?})"
    );
}
