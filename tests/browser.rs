//! Requests a web page could make a browser send to a hub that runs with `auth.mode = "none"` on
//! the same machine: a cross-site form POST, a cross-site `fetch`, and a DNS-rebinding page
//! (docs/security.md, "Requests a browser sends for someone else"). Each is refused and changes
//! nothing; the same requests from a non-browser client, an allowed origin or a configured host
//! still work.

mod support;

use std::time::Duration;

use serde_json::json;
use support::{http, live_stream, sse::SseNext, stream_path, Hub, SseClient};

const WAIT: Duration = Duration::from_secs(10);

fn event_body(data: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({ "device": "pos-1", "type": "test", "data": data })).unwrap()
}

async fn post(hub: &Hub, path: &str, headers: &[(&str, &str)], body: &[u8]) -> http::HttpResponse {
    http::request(hub.addr(), "POST", path, headers, Some(body)).await
}

/// What a `<form method=post enctype=text/plain>` on any site can send: the JSON of an event
/// as `text/plain` (no preflight). Refused with 415, and nothing reaches the stream; the same
/// body as `application/json` is published.
#[tokio::test]
async fn publish_takes_json_only() {
    let hub = Hub::builder().start().await;
    let mut stream = live_stream(&hub, "pos-1").await;
    for content_type in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let response = post(
            &hub,
            "/v1/events",
            &[
                ("Content-Type", content_type),
                ("Origin", "https://evil.example"),
            ],
            &event_body("forged"),
        )
        .await;
        assert!(
            response.status == 415 || response.status == 403,
            "{content_type}: {} {}",
            response.status,
            response.text()
        );
        // Without an Origin (curl with -d and no -H): 415, naming what is wanted.
        let response = post(
            &hub,
            "/v1/events",
            &[("Content-Type", content_type)],
            &event_body("forged"),
        )
        .await;
        assert_eq!(response.status, 415, "{}", response.text());
        assert_eq!(response.json()["error"], "unsupported_media_type");
        assert!(
            response.json()["message"]
                .as_str()
                .unwrap()
                .contains("application/json"),
            "{}",
            response.text()
        );
    }
    let response = post(&hub, "/v1/events", &[], &event_body("forged")).await;
    assert_eq!(response.status, 415, "no content type: {}", response.text());
    let response = post(
        &hub,
        "/v1/events",
        &[("Content-Type", "Application/JSON; charset=utf-8")],
        &event_body("real"),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
    // The first event the stream sees is the real one: nothing forged was stored.
    assert_eq!(stream.expect_event(WAIT).await.data, "real");
}

/// A `fetch` from another site with `Content-Type: application/json` would need a preflight the
/// hub does not grant, but a browser still sends simple requests and some clients skip CORS:
/// publish and drain carrying a foreign `Origin` are refused, and the pod keeps serving.
#[tokio::test]
async fn foreign_origins_cannot_publish_or_drain() {
    let hub = Hub::builder().start().await;
    let mut stream = live_stream(&hub, "pos-1").await;
    for origin in ["https://evil.example", "null", "http://127.0.0.1:1"] {
        let response = post(
            &hub,
            "/v1/events",
            &[("Content-Type", "application/json"), ("Origin", origin)],
            &event_body("forged"),
        )
        .await;
        assert_eq!(response.status, 403, "{origin}: {}", response.text());
        assert!(
            response.text().contains("server.cors_origins"),
            "{}",
            response.text()
        );
        let response = post(&hub, "/admin/drain", &[("Origin", origin)], b"").await;
        assert_eq!(response.status, 403, "{origin}: {}", response.text());
        let response = http::request(
            hub.addr(),
            "GET",
            "/admin/status",
            &[("Origin", origin)],
            None,
        )
        .await;
        assert_eq!(response.status, 403, "{origin}: {}", response.text());
    }
    assert_eq!(
        http::get(hub.addr(), "/readyz").await.status,
        200,
        "not draining"
    );
    // The hub's own origin (a page it serves) and no Origin at all are fine.
    let own = format!("http://{}", hub.addr());
    let response = post(
        &hub,
        "/v1/events",
        &[("Content-Type", "application/json"), ("Origin", &own)],
        &event_body("same origin"),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
    assert_eq!(stream.expect_event(WAIT).await.data, "same origin");
    let status = http::request(hub.addr(), "GET", "/admin/status", &[], None).await;
    assert_eq!(status.status, 200, "{}", status.text());
}

/// An origin listed in `server.cors_origins` may publish from a browser.
#[tokio::test]
async fn listed_origins_may_publish() {
    let hub = Hub::builder()
        .env("POSTHORN_SERVER__CORS_ORIGINS", "https://pos.example")
        .start()
        .await;
    let mut stream = live_stream(&hub, "pos-1").await;
    let response = post(
        &hub,
        "/v1/events",
        &[
            ("Content-Type", "application/json"),
            ("Origin", "https://pos.example"),
        ],
        &event_body("from the web POS"),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
    assert_eq!(
        response.header("access-control-allow-origin"),
        Some("https://pos.example")
    );
    assert_eq!(stream.expect_event(WAIT).await.data, "from the web POS");
    let response = post(
        &hub,
        "/v1/events",
        &[
            ("Content-Type", "application/json"),
            ("Origin", "https://evil.example"),
        ],
        &event_body("forged"),
    )
    .await;
    assert_eq!(response.status, 403, "{}", response.text());
}

/// `server.cors_origins = ["*"]` lets any page publish, but not drain the pod or read its
/// status: /admin takes only origins listed by name (and the hub's own).
#[tokio::test]
async fn the_cors_wildcard_does_not_open_admin() {
    let hub = Hub::builder()
        .env("POSTHORN_SERVER__CORS_ORIGINS", "*")
        .start()
        .await;
    let origin = ("Origin", "https://any.example");
    let response = post(
        &hub,
        "/v1/events",
        &[("Content-Type", "application/json"), origin],
        &event_body("from any page"),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
    let response = post(&hub, "/admin/drain", &[origin], b"").await;
    assert_eq!(response.status, 403, "{}", response.text());
    let status = http::request(hub.addr(), "GET", "/admin/status", &[origin], None).await;
    assert_eq!(status.status, 403, "{}", status.text());
    assert_eq!(
        http::get(hub.addr(), "/readyz").await.status,
        200,
        "still serving"
    );
}

/// A DNS-rebinding page names its own host: streams, publish and admin refuse any Host that is
/// not a loopback name or address, unless `server.allowed_hosts` lists it.
#[tokio::test]
async fn rebinding_hosts_are_refused() {
    let hub = Hub::builder()
        .env("POSTHORN_SERVER__ALLOWED_HOSTS", "hub.internal")
        .start()
        .await;
    for host in [
        "evil.example",
        "evil.example:8080",
        "0.0.0.0",
        "localhost.evil.example",
    ] {
        let stream = SseClient::connect(hub.addr(), &stream_path("pos-1"), &[("Host", host)]).await;
        assert_eq!(stream.status(), 403, "stream with Host {host}");
        let response = post(
            &hub,
            "/v1/events",
            &[("Content-Type", "application/json"), ("Host", host)],
            &event_body("forged"),
        )
        .await;
        assert_eq!(response.status, 403, "{host}: {}", response.text());
        assert!(
            response.text().contains("DNS rebinding"),
            "{}",
            response.text()
        );
        let response = post(&hub, "/admin/drain", &[("Host", host)], b"").await;
        assert_eq!(response.status, 403, "{host}: {}", response.text());
    }
    assert_eq!(
        http::get(hub.addr(), "/readyz").await.status,
        200,
        "not draining"
    );
    let port = hub.port().to_string();
    for host in [
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
        "hub.internal".to_string(),
        format!("HUB.internal:{port}"),
    ] {
        let mut stream = SseClient::connect(
            hub.addr(),
            &stream_path("pos-1"),
            &[("Host", host.as_str())],
        )
        .await;
        assert_eq!(stream.status(), 200, "stream with Host {host}");
        let response = post(
            &hub,
            "/v1/events",
            &[("Content-Type", "application/json"), ("Host", &host)],
            &event_body(&host),
        )
        .await;
        assert_eq!(response.status, 201, "{host}: {}", response.text());
        match stream.next_event(WAIT).await {
            SseNext::Event(event) => assert_eq!(event.data, host),
            other => panic!("Host {host}: {other:?}"),
        }
    }
}
