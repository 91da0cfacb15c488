//! Black-box tests of the operations surface (docs/http-api.md, docs/metrics.md): health, readiness, errors for
//! unknown routes, metrics, `/admin/status`, and the graceful drain by admin request and SIGTERM.

mod support;

use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use support::http::{self, HttpResponse};
use support::{live_stream, metrics, publish_to, stream_path, Hub, SseClient};

/// Failure guard for anything the hub should do "at once".
const WAIT: Duration = Duration::from_secs(10);

fn assert_json_error(resp: &HttpResponse, status: u16, code: &str) -> Value {
    assert_eq!(resp.status, status, "answer: {}", resp.text());
    let content_type = resp.header("content-type").unwrap_or_default();
    assert!(
        content_type.starts_with("application/json"),
        "content-type {content_type:?}"
    );
    let body = resp.json();
    assert_eq!(body["error"], code, "{body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "no message in {body}"
    );
    body
}

async fn admin_status(hub: &Hub) -> Value {
    let resp = http::get(hub.addr(), "/admin/status").await;
    assert_eq!(resp.status, 200, "/admin/status: {}", resp.text());
    resp.json()
}

/// Polls `/admin/status` until `check` holds; panics with the last status after `timeout`.
async fn wait_status(hub: &Hub, timeout: Duration, what: &str, check: impl Fn(&Value) -> bool) {
    let deadline = Instant::now() + timeout;
    loop {
        let status = admin_status(hub).await;
        if check(&status) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "/admin/status never showed {what} within {timeout:?}: {status}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `/healthz` and `/readyz` are 200 on a running hub.
#[tokio::test]
async fn healthz_and_readyz_are_ok() {
    let hub = Hub::builder().start().await;
    let resp = http::get(hub.addr(), "/healthz").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let resp = http::get(hub.addr(), "/readyz").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.header("retry-after"), None);
}

/// An unknown path is a 404 JSON `not_found` error (`/v1/devices` and `/v1/devices/{device}`
/// are the fleet API's: a device never seen is `device_not_found`).
#[tokio::test]
async fn unknown_path_is_json_404() {
    let hub = Hub::builder().start().await;
    let resp = http::get(hub.addr(), "/v1/devices/pos-1").await;
    assert_json_error(&resp, 404, "device_not_found");
    for path in [
        "/nope",
        "/v1/devices/pos-1/events/extra",
        "/v1/devices/pos-1/events/",
        "/v1/devices/pos-1/",
        "/v1/devices//events",
        "/v1/devicesx/pos-1/events",
        "/",
    ] {
        let resp = http::get(hub.addr(), path).await;
        assert_json_error(&resp, 404, "not_found");
    }
}

/// A wrong method on a known endpoint is a 405 JSON `method_not_allowed` error.
#[tokio::test]
async fn wrong_method_is_json_405() {
    let hub = Hub::builder().start().await;
    let resp = http::get(hub.addr(), "/v1/events").await;
    assert_json_error(&resp, 405, "method_not_allowed");
    let resp = http::request(hub.addr(), "DELETE", "/v1/events", &[], None).await;
    assert_json_error(&resp, 405, "method_not_allowed");
    let resp = http::request(hub.addr(), "POST", &stream_path("pos-1"), &[], Some(b"")).await;
    assert_json_error(&resp, 405, "method_not_allowed");
}

/// A 405 names the allowed methods in an `Allow` header, as HTTP (RFC 9110 15.5.6) requires.
#[tokio::test]
async fn method_not_allowed_carries_allow_header() {
    let hub = Hub::builder().start().await;
    let resp = http::get(hub.addr(), "/v1/events").await;
    assert_eq!(resp.status, 405);
    let allow = resp
        .header("allow")
        .unwrap_or_default()
        .to_ascii_uppercase();
    assert!(allow.contains("POST"), "Allow header {allow:?}");
    let resp = http::request(hub.addr(), "PUT", &stream_path("pos-1"), &[], Some(b"")).await;
    assert_json_error(&resp, 405, "method_not_allowed");
    assert_eq!(resp.header("allow"), Some("GET, OPTIONS"));
}

/// `/metrics` is Prometheus text with a HELP line for every metric of docs/metrics.md this build has, and
/// the labelled counters start with every label value at 0.
#[tokio::test]
async fn metrics_have_help_and_initial_labels() {
    let hub = Hub::builder().start().await;
    let resp = http::get(hub.addr(), "/metrics").await;
    assert_eq!(resp.status, 200);
    let content_type = resp.header("content-type").unwrap_or_default();
    assert!(
        content_type.starts_with("text/plain") && content_type.contains("version=0.0.4"),
        "content-type {content_type:?}"
    );

    let scrape = metrics::scrape(hub.addr()).await;
    let expected = [
        ("sse_connections", "gauge"),
        ("sse_connections_opened_total", "counter"),
        ("sse_connections_closed_total", "counter"),
        ("sse_slow_consumer_disconnects_total", "counter"),
        ("sse_events_sent_total", "counter"),
        ("sse_heartbeats_sent_total", "counter"),
        ("sse_replayed_events_total", "counter"),
        ("sse_resyncs_total", "counter"),
        ("memory_tail_lag_seconds", "gauge"),
        ("memory_tail_reconnects_total", "counter"),
        ("router_events_total", "counter"),
        ("drain_in_progress", "gauge"),
        ("drain_duration_seconds", "gauge"),
        ("ready", "gauge"),
        ("replays_in_flight", "gauge"),
        ("replay_duration_seconds", "histogram"),
        ("events_expired_total", "counter"),
        ("events_superseded_total", "counter"),
        ("sse_delivery_lag_seconds", "histogram"),
        ("publish_duration_seconds", "histogram"),
        ("process_resident_memory_bytes", "gauge"),
    ];
    let missing: Vec<&str> = expected
        .iter()
        .filter(|(name, _)| scrape.help(name).is_none_or(|h| h.is_empty()))
        .map(|(name, _)| *name)
        .collect();
    assert!(
        missing.is_empty(),
        "no HELP line for {missing:?}:\n{}",
        scrape.text
    );
    for (name, kind) in expected {
        assert_eq!(scrape.metric_type(name), Some(kind), "TYPE of {name}");
    }

    for reason in ["client", "slow_consumer", "drain", "takeover", "error"] {
        assert_eq!(
            scrape.value("sse_connections_closed_total", &[("reason", reason)]),
            Some(0.0),
            "sse_connections_closed_total{{reason={reason:?}}} on a fresh hub"
        );
    }
    for path in ["live", "replay"] {
        assert_eq!(
            scrape.value("events_expired_total", &[("path", path)]),
            Some(0.0),
            "events_expired_total{{path={path:?}}} on a fresh hub"
        );
    }
    for reason in ["expired", "invalid", "data_lost"] {
        assert_eq!(
            scrape.value("sse_resyncs_total", &[("reason", reason)]),
            Some(0.0),
            "sse_resyncs_total{{reason={reason:?}}} on a fresh hub"
        );
    }
    assert_eq!(scrape.value("sse_connections", &[]), Some(0.0));
    assert_eq!(scrape.value("drain_in_progress", &[]), Some(0.0));
    assert_eq!(scrape.value("drain_duration_seconds", &[]), Some(0.0));
    assert_eq!(
        scrape.value("memory_tail_reconnects_total", &[("group", "0")]),
        Some(0.0)
    );
    assert!(
        scrape.value_or_zero("process_resident_memory_bytes", &[]) > 0.0,
        "RSS of a running process"
    );
}

/// `sse_delivery_lag_seconds` observes every live event written to a stream, once per stream
/// (a broadcast to two streams is two observations), and no replayed one;
/// `publish_duration_seconds` observes every answered publish, refused ones too.
#[tokio::test]
async fn delivery_lag_and_publish_duration_are_observed() {
    let hub = Hub::builder().start().await;
    let mut first = live_stream(&hub, "pos-1").await;
    let mut second = live_stream(&hub, "pos-2").await;
    let cursor = publish_to(&hub, "pos-1", "one").await;
    publish_to(&hub, "pos-1", "two").await;
    let response = http::post_json(
        hub.addr(),
        "/v1/events",
        &serde_json::json!({ "broadcast": true, "type": "notice", "data": "all" }),
    )
    .await;
    assert_eq!(response.status, 201);
    first.expect_events(3, WAIT).await;
    second.expect_events(1, WAIT).await;
    let refused = http::post_json(hub.addr(), "/v1/events", &serde_json::json!({})).await;
    assert_eq!(refused.status, 400);
    // A resume replays two events: not a delivery lag.
    let mut resumed = SseClient::connect(
        hub.addr(),
        &stream_path("pos-1"),
        &[("Last-Event-ID", cursor.as_str())],
    )
    .await;
    resumed.expect_events(2, WAIT).await;

    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape.value("sse_delivery_lag_seconds_count", &[]),
        Some(4.0),
        "three live events on pos-1 and the broadcast on pos-2"
    );
    assert_eq!(
        scrape.value("sse_delivery_lag_seconds_bucket", &[("le", "+Inf")]),
        Some(4.0)
    );
    assert_eq!(
        scrape.value("publish_duration_seconds_count", &[]),
        Some(4.0),
        "three accepted publishes and one refused"
    );
}

/// `publish_events_total` is exposed, with its HELP line and every result at 0, before the
/// first publish, like the other labelled counters (a dashboard or alert on it must not see
/// an absent series on a fresh pod); after a publish it counts it.
#[tokio::test]
async fn publish_events_total_is_exposed_on_a_fresh_hub() {
    let hub = Hub::builder().start().await;
    let scrape = metrics::scrape(hub.addr()).await;
    assert!(
        scrape
            .help("publish_events_total")
            .is_some_and(|h| !h.is_empty()),
        "no HELP line for publish_events_total on a fresh hub:\n{}",
        scrape.text
    );
    assert_eq!(scrape.metric_type("publish_events_total"), Some("counter"));
    for result in ["accepted", "duplicate", "rejected", "failed"] {
        assert_eq!(
            scrape.value("publish_events_total", &[("result", result)]),
            Some(0.0),
            "publish_events_total{{result={result:?}}} on a fresh hub"
        );
    }
}

/// After one publish `publish_events_total` has its HELP line and counts the event.
#[tokio::test]
async fn publish_events_total_has_help_after_a_publish() {
    let hub = Hub::builder().start().await;
    let resp = http::post_json(
        hub.addr(),
        "/v1/events",
        &serde_json::json!({"device": "pos-1", "data": "x"}),
    )
    .await;
    assert_eq!(resp.status, 201, "{}", resp.text());
    let scrape = metrics::scrape(hub.addr()).await;
    assert!(
        scrape
            .help("publish_events_total")
            .is_some_and(|h| !h.is_empty()),
        "{}",
        scrape.text
    );
    assert_eq!(scrape.metric_type("publish_events_total"), Some("counter"));
    assert_eq!(
        scrape.value("publish_events_total", &[("result", "accepted")]),
        Some(1.0)
    );
}

/// `/admin/status` reports the memory backend, the number of open streams, a running tail for
/// group 0, an idle drain, and a config summary without secret values.
#[tokio::test]
async fn admin_status_reports_state_without_secrets() {
    const SECRET: &str = "s3cr3t-jwt-value-do-not-show";
    const PASSWORD: &str = "hunter2-redis-password";
    const NATS_PASSWORD: &str = "hunter3-nats-password";
    let hub = Hub::builder()
        .env("POSTHORN_AUTH__JWT_SECRET", SECRET)
        .env(
            "POSTHORN_REDIS__URL",
            format!("redis://admin:{PASSWORD}@127.0.0.1:6379"),
        )
        .env(
            "POSTHORN_NATS__URL",
            format!("nats://hub:{NATS_PASSWORD}@127.0.0.1:4222"),
        )
        .start()
        .await;

    let status = admin_status(&hub).await;
    assert_eq!(status["backend"], "memory", "{status}");
    assert_eq!(status["connections"], 0, "{status}");

    let _a = live_stream(&hub, "pos-1").await;
    let _b = live_stream(&hub, "pos-2").await;
    wait_status(&hub, WAIT, "a running tail for group 0", |s| {
        s["tails"].as_array().is_some_and(|tails| {
            tails
                .iter()
                .any(|t| t["group"] == 0 && t["state"] == "running")
        })
    })
    .await;

    let resp = http::get(hub.addr(), "/admin/status").await;
    assert_eq!(resp.status, 200);
    let status = resp.json();
    assert_eq!(status["connections"], 2, "{status}");
    let tails = status["tails"].as_array().expect("tails array");
    assert_eq!(tails.len(), 1, "one tail for the memory backend: {status}");
    assert_eq!(tails[0]["group"], 0);
    assert_eq!(tails[0]["state"], "running");
    assert_eq!(status["drain"]["phase"], "idle", "{status}");

    // The tail shows the last position it read per shard as `[shard, "ms-seq"]`.
    let published = http::post_json(
        hub.addr(),
        "/v1/events",
        &serde_json::json!({ "device": "pos-1", "data": "status" }),
    )
    .await;
    assert_eq!(published.status, 201, "{}", published.text());
    let id = published.json()["results"][0]["id"]
        .as_str()
        .expect("an event id")
        .to_owned();
    let (epoch_and_shard, position) = id.rsplit_once('.').expect("epoch.shard.position");
    let (_, shard) = epoch_and_shard.rsplit_once('.').expect("epoch.shard");
    let shard: u64 = shard.parse().expect("a numeric shard");
    wait_status(&hub, WAIT, "the published position in last_ids", |s| {
        s["tails"][0]["last_ids"]
            .as_array()
            .is_some_and(|ids| ids.contains(&serde_json::json!([shard, position])))
    })
    .await;

    let config = &status["config"];
    assert!(config.is_object(), "config summary in {status}");
    assert_eq!(config["server"]["listen"], hub.addr().to_string());
    assert_eq!(config["backend"]["kind"], "memory");
    assert_eq!(config["auth"]["jwt_secret"], "(set)");

    // Each secret's key is in the summary, shown without its value.
    assert_eq!(
        config["redis"]["url"], "redis://(redacted)@127.0.0.1:6379",
        "{status}"
    );
    assert_eq!(
        config["nats"]["url"], "nats://(redacted)@127.0.0.1:4222",
        "{status}"
    );
    let text = resp.text();
    assert!(!text.contains(SECRET), "JWT secret leaked: {text}");
    assert!(!text.contains(PASSWORD), "Redis password leaked: {text}");
    assert!(
        !text.contains(NATS_PASSWORD),
        "NATS password leaked: {text}"
    );
}

/// `POST /admin/drain?exit=false` drains without exiting: readiness (and the `ready` gauge) and
/// new streams answer 503
/// with `Retry-After`, an open stream ends cleanly with a `retry:` from
/// `[drain.retry_min, drain.retry_max]`, the process keeps serving, and status and metrics show
/// the finished drain.
#[tokio::test]
async fn admin_drain_without_exit() {
    let hub = Hub::builder()
        .env("POSTHORN_DRAIN__RETRY_MIN", "2s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "4s")
        .env("POSTHORN_SSE__RETRY_MS", "1500")
        .env("POSTHORN_DRAIN__GRACE", "10s")
        .start()
        .await;
    let mut client = live_stream(&hub, "pos-drain").await;
    assert_eq!(
        client.retry,
        Some(1500),
        "the stream's first retry is sse.retry_ms"
    );

    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape.value("ready", &[]),
        Some(1.0),
        "ready before the drain"
    );
    let resp = http::request(hub.addr(), "POST", "/admin/drain?exit=false", &[], None).await;
    assert_eq!(resp.status, 202, "{}", resp.text());
    let body = resp.json();
    assert_eq!(body["exit"], false, "{body}");

    let resp = http::get(hub.addr(), "/readyz").await;
    assert_json_error(&resp, 503, "draining");
    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape.value("ready", &[]),
        Some(0.0),
        "what /readyz answered"
    );
    assert!(
        resp.header("retry-after")
            .is_some_and(|v| v.parse::<u32>().is_ok()),
        "readyz Retry-After {:?}",
        resp.header("retry-after")
    );

    let mut refused = SseClient::connect(hub.addr(), &stream_path("pos-new"), &[]).await;
    assert_eq!(refused.status(), 503);
    assert!(
        refused
            .header("retry-after")
            .is_some_and(|v| v.parse::<u32>().is_ok()),
        "stream Retry-After {:?}",
        refused.header("retry-after")
    );
    refused.read_to_close(WAIT).await;
    let body: Value = serde_json::from_str(&refused.raw_text()).expect("503 body is JSON");
    assert_eq!(body["error"], "draining", "{body}");

    let events = client.read_to_close(Duration::from_secs(20)).await;
    assert!(events.is_empty(), "no events were published: {events:?}");
    assert!(
        client.body_complete(),
        "the drained stream must end with its terminating chunk, not a reset: {:?}",
        client.raw_text()
    );
    let retry = client.retry.expect("a retry value");
    assert!(
        (2000..=4000).contains(&retry),
        "drain retry {retry} outside [2000, 4000]; stream: {:?}",
        client.raw_text()
    );

    wait_status(&hub, Duration::from_secs(20), "drain phase drained", |s| {
        s["drain"]["phase"] == "drained"
    })
    .await;
    let status = admin_status(&hub).await;
    assert_eq!(status["connections"], 0, "{status}");
    assert_eq!(status["draining"], true, "{status}");

    let mut hub = hub;
    assert!(hub.is_running(), "exit=false must keep the process running");
    let resp = http::get(hub.addr(), "/healthz").await;
    assert_eq!(resp.status, 200);
    let resp = http::get(hub.addr(), "/readyz").await;
    assert_json_error(&resp, 503, "draining");

    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(scrape.value("drain_in_progress", &[]), Some(0.0));
    assert_eq!(
        scrape.value("sse_connections_closed_total", &[("reason", "drain")]),
        Some(1.0)
    );
    assert_eq!(scrape.value("sse_connections", &[]), Some(0.0));
    assert!(scrape.value_or_zero("drain_duration_seconds", &[]) > 0.0);
}

/// SIGTERM with three open streams: all three end, the process exits 0 within `drain.grace`,
/// and the log shows the drain starting and finishing.
#[tokio::test]
async fn sigterm_drains_and_exits_zero() {
    let mut hub = Hub::builder()
        .env("POSTHORN_DRAIN__GRACE", "5s")
        .env("POSTHORN_DRAIN__RETRY_MIN", "1s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "2s")
        .start()
        .await;
    let mut clients = Vec::new();
    for device in ["pos-t1", "pos-t2", "pos-t3"] {
        clients.push(live_stream(&hub, device).await);
    }

    hub.signal("TERM");
    for client in &mut clients {
        client.read_to_close(Duration::from_secs(15)).await;
        assert!(client.body_complete(), "{:?}", client.raw_text());
        let retry = client.retry.expect("retry");
        assert!((1000..=2000).contains(&retry), "drain retry {retry}");
    }
    let status = hub
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("posthorn still running after SIGTERM");
    assert_eq!(status.code(), Some(0), "exit status {status}");
    let log = hub.stderr_log();
    assert!(log.contains("drain started"), "{log}");
    assert!(
        log.contains("drain finished"),
        "drain did not finish within grace: {log}"
    );
    assert!(log.contains("3 connections"), "{log}");
}

/// `POST /admin/drain` without `exit=false` is 202 and the process then exits 0.
#[tokio::test]
async fn admin_drain_exits_zero() {
    let mut hub = Hub::builder()
        .env("POSTHORN_DRAIN__GRACE", "5s")
        .start()
        .await;
    let mut client = live_stream(&hub, "pos-x").await;
    let resp = http::request(hub.addr(), "POST", "/admin/drain", &[], None).await;
    assert_eq!(resp.status, 202, "{}", resp.text());
    assert_eq!(resp.json()["exit"], true);
    assert!(client.wait_closed(Duration::from_secs(15)).await);
    let status = hub
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("posthorn still running after POST /admin/drain");
    assert_eq!(status.code(), Some(0), "exit status {status}");
    assert!(hub.stderr_log().contains("drain finished"));
}

/// When a drain ends in an exit, the server stops accepting at once but still answers a request
/// that was in flight: here a publish whose body arrives only after the listening socket closed.
#[tokio::test]
async fn the_exit_answers_a_request_in_flight() {
    use tokio::io::AsyncWriteExt;

    let mut hub = Hub::builder().start().await;
    let addr = hub.addr();
    let body = br#"{"device":"pos-late","data":"sent while the server stops"}"#;
    let mut in_flight = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/events HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    in_flight.write_all(head.as_bytes()).await.unwrap();
    in_flight.write_all(&body[..10]).await.unwrap();

    let drain = http::request(addr, "POST", "/admin/drain", &[], None).await;
    assert_eq!(drain.status, 202, "{}", drain.text());
    let deadline = Instant::now() + WAIT;
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        assert!(
            Instant::now() < deadline,
            "still accepting connections after the drain"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    in_flight.write_all(&body[10..]).await.unwrap();
    let mut buf = Vec::new();
    let response = tokio::time::timeout(WAIT, http::read_head(&mut in_flight, &mut buf))
        .await
        .expect("an answer to the request in flight")
        .expect("a response head, not a reset");
    assert_eq!(response.status, 201);
    let status = hub.wait_exit(WAIT).await.expect("the process exits");
    assert_eq!(status.code(), Some(0), "exit status {status}");
}

/// An idle keep-alive connection does not hold up the exit: its dispatcher closes it as soon as
/// the server stops, so the worker need not wait out its stop timeout (2 s).
#[tokio::test]
async fn the_exit_closes_idle_keep_alive_connections_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut hub = Hub::builder().start().await;
    let addr = hub.addr();
    let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    idle.write_all(&http::encode_request(addr, "GET", "/healthz", &[], None))
        .await
        .unwrap();
    let mut buf = Vec::new();
    let head = tokio::time::timeout(WAIT, http::read_head(&mut idle, &mut buf))
        .await
        .expect("an answer")
        .expect("a response head");
    assert_eq!(head.status, 200);
    assert!(
        !head
            .headers
            .iter()
            .any(|(name, value)| name.eq_ignore_ascii_case("connection") && value == "close"),
        "the connection must stay open for this test"
    );

    let drain = http::request(addr, "POST", "/admin/drain", &[], None).await;
    assert_eq!(drain.status, 202, "{}", drain.text());
    // The server stops once the drain is done: from then on the port refuses connections.
    let deadline = Instant::now() + WAIT;
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        assert!(
            Instant::now() < deadline,
            "still accepting connections after the drain"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopped = Instant::now();
    let mut rest = [0u8; 1024];
    loop {
        let n = tokio::time::timeout(WAIT, idle.read(&mut rest))
            .await
            .expect("the server closes the idle connection")
            .expect("a clean close, not a reset");
        if n == 0 {
            break;
        }
    }
    // Closed by the stop timeout, it would come 2 s after the stop; at once is a few ms.
    let closed_after = stopped.elapsed();
    assert!(
        closed_after < Duration::from_secs(1),
        "the idle connection closed {closed_after:?} after the server stopped"
    );
    let status = hub.wait_exit(WAIT).await.expect("the process exits");
    assert_eq!(status.code(), Some(0), "exit status {status}");
}
