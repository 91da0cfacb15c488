//! The reference client `posthorn tail` (docs/client-contract.md) against real hubs: restart of the hub
//! with Redis keeping the data, a drain's `retry:`, resync, refusal, backoff and dead-connection
//! detection.

mod support;

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::json;
use support::{http, redis::RedisServer, Hub};

const WAIT: Duration = Duration::from_secs(30);

/// A `posthorn tail` process with its stdout and stderr in files of a temp dir.
struct Tail {
    child: Child,
    dir: PathBuf,
}

impl Tail {
    fn start(url: &str, device: &str, extra: &[&str]) -> Tail {
        Self::spawn(url, device, extra, false)
    }

    /// With `--cursor-file` in the tail's own temp dir (at-least-once).
    fn start_with_cursor(url: &str, device: &str) -> Tail {
        Self::spawn(url, device, &[], true)
    }

    fn spawn(url: &str, device: &str, extra: &[&str], with_cursor: bool) -> Tail {
        let dir = std::env::temp_dir().join(format!(
            "posthorn-tail-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut command = Command::new(env!("CARGO_BIN_EXE_posthorn"));
        command
            .args(["tail", "--url", url, "--device", device])
            .args(extra);
        if with_cursor {
            command.arg("--cursor-file").arg(Self::cursor_path(&dir));
        }
        let child = command
            .stdout(std::fs::File::create(dir.join("out")).expect("stdout file"))
            .stderr(std::fs::File::create(dir.join("err")).expect("stderr file"))
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn posthorn tail");
        Tail { child, dir }
    }

    fn cursor_path(dir: &Path) -> PathBuf {
        dir.join("cursor")
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(self.dir.join("out")).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("err")).unwrap_or_default()
    }

    /// Waits until stdout has `lines` lines (or fails with both outputs).
    async fn wait_lines(&self, lines: usize) -> Vec<String> {
        let deadline = Instant::now() + WAIT;
        loop {
            let out: Vec<String> = self.stdout().lines().map(String::from).collect();
            if out.len() >= lines {
                return out;
            }
            assert!(
                Instant::now() < deadline,
                "tail printed {} of {lines} lines; stderr:\n{}",
                out.len(),
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_stderr(&self, needle: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let err = self.stderr();
            if err.contains(needle) {
                return err;
            }
            assert!(
                Instant::now() < deadline,
                "stderr never said {needle:?}:\n{err}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Tail {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `reconnecting in N ms` delays `posthorn tail` reported on stderr, in order.
fn reconnect_delays(stderr: &str) -> Vec<u64> {
    stderr
        .lines()
        .filter_map(|line| line.split("reconnecting in ").nth(1))
        .filter_map(|rest| rest.split(' ').next()?.parse().ok())
        .collect()
}

fn data_column(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .map(|line| line.split('\t').nth(2).unwrap_or("").to_string())
        .collect()
}

async fn publish(hub: &Hub, device: &str, data: &str) {
    let response = http::post_json(
        hub.addr(),
        "/v1/events",
        &json!({ "device": device, "data": data }),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
}

/// The hub is killed mid-stream and restarted while Redis keeps the data and an external producer
/// keeps appending: the tail reconnects with its cursor and prints every event exactly once, in
/// order; its cursor file holds the id of the last one.
#[tokio::test]
async fn hub_restart_loses_nothing_and_duplicates_nothing() {
    let redis = RedisServer::start().await;
    let port = support::free_port();
    let builder = || {
        Hub::builder()
            .port(port)
            .env("POSTHORN_BACKEND__KIND", "redis")
            .env("POSTHORN_REDIS__URL", redis.url())
            .env("POSTHORN_REDIS__BLOCK", "1s")
            .env("POSTHORN_SSE__RETRY_MS", "1000")
    };
    let mut hub = builder().start().await;
    let tail = Tail::start_with_cursor(&hub.base_url(), "pos-3");
    tail.wait_stderr("connected").await;
    for i in 0..10 {
        publish(&hub, "pos-3", &i.to_string()).await;
    }
    tail.wait_lines(10).await;
    hub.kill();
    let mut producer = redis.client().await;
    let key = format!("pos-ev:{}", crc32fast::hash(b"pos-3") % 64);
    for i in 10..20 {
        producer
            .xadd(&key, &[("dev", "pos-3"), ("data", &i.to_string())])
            .await;
    }
    let hub = builder().start().await;
    for i in 20..30 {
        publish(&hub, "pos-3", &i.to_string()).await;
    }
    let lines = tail.wait_lines(30).await;
    let expected: Vec<String> = (0..30).map(|i| i.to_string()).collect();
    assert_eq!(data_column(&lines), expected, "stderr:\n{}", tail.stderr());
    // A duration, not a synchronisation: a duplicate would follow at once, so nothing more may
    // be printed within 300 ms.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        tail.stdout().lines().count(),
        30,
        "no duplicate after the restart"
    );
    let last_id = lines[29].split('\t').next().unwrap().to_string();
    let stored = std::fs::read_to_string(Tail::cursor_path(&tail.dir)).expect("cursor file");
    assert_eq!(stored.trim(), last_id);
    assert!(
        tail.stderr().contains("resuming after"),
        "{}",
        tail.stderr()
    );
}

/// A drain closes the stream with a jittered `retry:`; the tail waits that long (not less than
/// the drain's minimum) before reconnecting.
#[tokio::test]
async fn drain_retry_is_honoured() {
    let hub = Hub::builder()
        .env("POSTHORN_SSE__RETRY_MS", "1000")
        .env("POSTHORN_DRAIN__RETRY_MIN", "2s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "3s")
        .start()
        .await;
    let tail = Tail::start(&hub.base_url(), "pos-1", &[]);
    tail.wait_stderr("connected").await;
    let drain = http::request(hub.addr(), "POST", "/admin/drain?exit=false", &[], None).await;
    assert_eq!(drain.status, 202);
    let err = tail.wait_stderr("reconnecting in").await;
    let delay = reconnect_delays(&err)[0];
    // The drain's retry, plus the client's own jitter of up to 100 % of it.
    assert!(
        (2000..=6000).contains(&delay),
        "reconnect delay {delay} ms ignores the drain's retry"
    );
}

/// Bug pinned: after a healthy connection the tail waited exactly `retry`, so every
/// terminal of a pod that crashed came back in the same instant. Now it waits `retry` plus a
/// random 0-100 % of it: four tails told the same `retry: 1000` spread over [1 s, 2 s].
#[tokio::test]
async fn the_first_reconnect_after_a_healthy_connection_is_jittered() {
    let hub = Hub::builder()
        .env("POSTHORN_DRAIN__RETRY_MIN", "1s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "1s")
        .start()
        .await;
    let tails: Vec<Tail> = (0..4)
        .map(|i| Tail::start(&hub.base_url(), &format!("pos-{i}"), &[]))
        .collect();
    for tail in &tails {
        tail.wait_stderr("connected").await;
    }
    let drain = http::request(hub.addr(), "POST", "/admin/drain?exit=false", &[], None).await;
    assert_eq!(drain.status, 202);
    let mut delays = Vec::new();
    for tail in &tails {
        let err = tail.wait_stderr("reconnecting in").await;
        delays.push(reconnect_delays(&err)[0]);
    }
    assert!(
        delays.iter().all(|delay| (1000..=2000).contains(delay)),
        "{delays:?}"
    );
    assert!(
        delays.iter().any(|delay| *delay != delays[0]),
        "four tails reconnect at the same moment: {delays:?}"
    );
}

/// A cursor the hub cannot resume gives a resync, reported on stderr; the tail stores the
/// resync's id and goes on with live events.
#[tokio::test]
async fn resync_resets_the_cursor() {
    let hub = Hub::builder().start().await;
    let dir = std::env::temp_dir().join(format!("posthorn-tail-cursor-{}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    let cursor = dir.join("cursor");
    std::fs::write(&cursor, "not-a-cursor").unwrap();
    let tail = Tail::start(
        &hub.base_url(),
        "pos-1",
        &["--cursor-file", cursor.to_str().unwrap()],
    );
    let err = tail.wait_stderr("resync (invalid)").await;
    assert!(err.contains("resuming after not-a-cursor"), "{err}");
    // The tail reports the resync before it stores its id (at-least-once), so the file may
    // still hold the old cursor for a moment.
    let deadline = Instant::now() + WAIT;
    loop {
        let stored = std::fs::read_to_string(&cursor).unwrap();
        if stored != "not-a-cursor" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the resync id never replaced the cursor"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    publish(&hub, "pos-1", "after resync").await;
    let lines = tail.wait_lines(1).await;
    assert_eq!(data_column(&lines), ["after resync"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A stream the hub refuses (an invalid device id: 400) stops the tail with an error instead of
/// hammering the hub.
#[tokio::test]
async fn refusal_stops_the_client() {
    let hub = Hub::builder().start().await;
    let mut tail = Tail::start(&hub.base_url(), "not valid", &[]);
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = tail.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the tail kept running: {}",
            tail.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.code(), Some(1));
    assert!(
        tail.stderr().contains("refused the stream with 400"),
        "{}",
        tail.stderr()
    );
}

/// Against a port where nothing listens, reconnect attempts are at least 1 s apart and their
/// delays stay within [1 s, 60 s].
#[tokio::test]
async fn failures_back_off_with_a_floor() {
    let port = support::free_port();
    let tail = Tail::start(&format!("http://127.0.0.1:{port}"), "pos-1", &[]);
    // A duration, not a synchronisation: the attempts of 4 s are counted.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let err = tail.stderr();
    let delays = reconnect_delays(&err);
    assert!(!delays.is_empty(), "{err}");
    assert!(delays.len() <= 4, "more than one attempt per second: {err}");
    assert!(
        delays.iter().all(|d| (1000..=60_000).contains(d)),
        "{delays:?}"
    );
}

/// A hub that stops sending anything (frozen with SIGSTOP) is detected after about three
/// heartbeat intervals and the tail reconnects.
#[tokio::test]
async fn silence_is_detected() {
    let hub = Hub::builder()
        .env("POSTHORN_SSE__HEARTBEAT", "300ms")
        .start()
        .await;
    let tail = Tail::start(&hub.base_url(), "pos-1", &["--heartbeat", "1s"]);
    tail.wait_stderr("connected").await;
    hub.signal("STOP");
    let err = tail.wait_stderr("presumed dead").await;
    hub.signal("CONT");
    assert!(err.contains("no data for 3s"), "{err}");
}

/// A hub answering 503 with `Retry-After` (here: its connection limit is reached) is not asked
/// again before that many seconds.
#[tokio::test]
async fn retry_after_of_a_503_is_honoured() {
    let hub = Hub::builder()
        .env("POSTHORN_LIMITS__MAX_CONNECTIONS", "1")
        .start()
        .await;
    let _holder = support::live_stream(&hub, "pos-1").await;
    let tail = Tail::start(&hub.base_url(), "pos-2", &[]);
    let err = tail.wait_stderr("reconnecting in").await;
    assert!(err.contains("the hub answered 503"), "{err}");
    let delay = reconnect_delays(&err)[0];
    assert!(
        delay >= 5000,
        "Retry-After: 5 means at least 5000 ms, got {delay}"
    );
}

/// With a cursor file the client acknowledges what it persisted: the newest cursor, at most once
/// per second (a burst of 30 events is a handful of acks, the last one naming the last event);
/// `--no-ack` sends none.
#[tokio::test]
async fn persisted_cursors_are_acknowledged_at_most_once_per_second() {
    let hub = Hub::builder().start().await;
    let tail = Tail::start_with_cursor(&hub.base_url(), "pos-ack");
    tail.wait_stderr("connected").await;
    let started = Instant::now();
    for n in 0..30 {
        publish(&hub, "pos-ack", &format!("e{n}")).await;
    }
    let lines = tail.wait_lines(30).await;
    let last_id = lines[29].split('\t').next().unwrap().to_string();
    let deadline = Instant::now() + WAIT;
    let acked = loop {
        let record = http::get(hub.addr(), "/v1/devices/pos-ack").await.json();
        if record["acked_id"] == last_id.as_str() {
            break record;
        }
        assert!(Instant::now() < deadline, "never acked {last_id}: {record}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(acked["acked_at"].is_string());
    let acks = support::metrics::scrape(hub.addr())
        .await
        .value_or_zero("fleet_acks_total", &[("result", "moved")]);
    // One ack per second since the first event, and the first at once.
    let allowed = started.elapsed().as_secs_f64().ceil() + 1.0;
    assert!(
        (1.0..=allowed).contains(&acks),
        "{acks} acks for 30 events in {:?}",
        started.elapsed()
    );

    let quiet = Tail::spawn(&hub.base_url(), "pos-quiet", &["--no-ack"], true);
    quiet.wait_stderr("connected").await;
    publish(&hub, "pos-quiet", "x").await;
    let lines = quiet.wait_lines(1).await;
    // Persisted: with acks on, this is what would be acknowledged.
    let id = lines[0].split('\t').next().unwrap().to_string();
    let cursor = Tail::cursor_path(&quiet.dir);
    support::wait_until(WAIT, "the quiet tail persisted its cursor", async || {
        std::fs::read_to_string(&cursor).is_ok_and(|stored| stored.trim() == id)
    })
    .await;
    // A duration, not a synchronisation: more than the ack interval (1 s) must pass without an
    // ack.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let record = http::get(hub.addr(), "/v1/devices/pos-quiet").await.json();
    assert_eq!(record["acked_id"], serde_json::Value::Null, "{record}");
}
