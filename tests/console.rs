//! The operator's page `GET /admin/console` (docs/http-api.md, section 10), in headless Chromium:
//! its headers, that it loads without a console error under its Content-Security-Policy, that the
//! numbers it shows are those of `/metrics`, that its device lookup computes the hub's shard and
//! shows the device's presence, and
//! that its drain button, once confirmed, drains the pod.
//!
//! Needs Debian's `chromium` (`scripts/test` installs it). With `POSTHORN_CONSOLE_SCREENSHOT=<path>`
//! the test also saves a screenshot of the page there (how `docs/console.png` is made).

mod support;

use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};

use support::chromium::{Cdp, Chromium};
use support::{http, live_stream, metrics, publish_to, stream_path, Hub, SseClient};

/// The page polls every 2 s and needs two polls for rates; Chromium on busy cores is slow.
const PAGE_WAIT: Duration = Duration::from_secs(20);
/// Failure guard for what the hub does at once.
const WAIT: Duration = Duration::from_secs(10);

/// The page is HTML with a strict policy: no caching, no framing, scripts and styles by hash only,
/// fetches only to the hub.
#[tokio::test]
async fn console_is_served_with_a_strict_policy() {
    let hub = Hub::builder().start().await;
    let page = http::get(hub.addr(), "/admin/console").await;
    assert_eq!(page.status, 200, "{}", page.text());
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert_eq!(page.header("cache-control"), Some("no-store"));
    assert_eq!(page.header("x-frame-options"), Some("DENY"));
    let policy = page.header("content-security-policy").unwrap_or_default();
    for directive in [
        "default-src 'none'",
        "script-src 'sha256-",
        "style-src 'sha256-",
        "connect-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(policy.contains(directive), "{directive} not in {policy}");
    }
    assert!(!policy.contains("unsafe"), "{policy}");
    assert!(page.text().contains("<title>posthorn console</title>"));

    // With auth none it follows the /admin rule: a page of another site cannot have it.
    let foreign = http::request(
        hub.addr(),
        "GET",
        "/admin/console",
        &[("Host", "evil.example")],
        None,
    )
    .await;
    assert_eq!(foreign.status, 403, "{}", foreign.text());
}

/// With jwt auth the page is served without a token (a browser cannot send one when it navigates;
/// the page holds no data), while what it reads still needs the admin token: in Chromium the page
/// asks for one, uses it, and keeps it out of storage and cookies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_jwt_the_page_asks_for_an_admin_token() {
    const SECRET: &str = "console-test-secret";
    let hub = Hub::builder()
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", SECRET)
        .start()
        .await;
    let page = http::get(hub.addr(), "/admin/console").await;
    assert_eq!(page.status, 200, "{}", page.text());
    let status = http::get(hub.addr(), "/admin/status").await;
    assert_eq!(status.status, 401, "{}", status.text());

    let chromium = Chromium::start(1280, 900).await;
    let mut page = chromium.page().await;
    page.call("Log.enable", json!({})).await;
    page.call("Runtime.enable", json!({})).await;
    page.call("Page.enable", json!({})).await;
    page.navigate(&hub.url("/admin/console")).await;
    page.wait_for(
        "!document.getElementById('auth').hidden",
        PAGE_WAIT,
        "the token form",
    )
    .await;
    assert_eq!(
        page.evaluate("document.getElementById('connections').dataset.value ?? null")
            .await,
        Value::Null,
        "no data without a token"
    );

    let expires = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs()
        + 600;
    let token = jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &json!({ "scope": "admin", "exp": expires }),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()).expect("hs256 key"),
    )
    .expect("token");
    page.evaluate(&format!(
        "document.getElementById('token').value = '{token}'; \
         document.getElementById('token-use').click()"
    ))
    .await;
    page.wait_for(
        "document.getElementById('connections').dataset.value === '0'",
        PAGE_WAIT,
        "the data read with the token",
    )
    .await;
    assert_eq!(
        page.evaluate(
            "[document.getElementById('auth').hidden, document.getElementById('token').value, \
              localStorage.length, sessionStorage.length, document.cookie]"
        )
        .await,
        json!([true, "", 0, 0, ""]),
        "form hidden and emptied, nothing stored"
    );
    // The only errors are the answers to the requests made before the token was given.
    let errors = page.console_errors();
    assert!(!errors.is_empty(), "the first /admin/status was a 401");
    for error in errors {
        let entry = &error["params"]["entry"];
        assert!(
            entry["source"] == "network"
                && entry["url"].as_str().is_some_and(|u| {
                    u.ends_with("/admin/status") || u.ends_with("/admin/revocations")
                }),
            "unexpected console error: {error:#}"
        );
    }
}

/// In Chromium: the page loads with no console error (a script or style refused by its policy
/// would be one), shows the open streams, totals and tail groups that `/metrics` has, the
/// revocations `/admin/revocations` lists, computes
/// rates once it has two scrapes, looks up a device's shard, and its drain button, after the
/// confirmation step, drains the pod: `/readyz` 503 and `drain_in_progress` 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_shows_the_metrics_and_drains() {
    const STREAMS: usize = 3;
    // One close per second: the drain lasts long enough to see `drain_in_progress` at 1.
    let hub = Hub::builder()
        .env("POSTHORN_DRAIN__CLOSE_RATE", "1")
        .start()
        .await;
    let mut streams = Vec::new();
    // pos-0 is a member of two groups (the lookup shows them).
    let in_groups = SseClient::connect(
        hub.addr(),
        &format!("{}?groups=store-17,merchant-9", stream_path("pos-0")),
        &[],
    )
    .await;
    assert_eq!(in_groups.status(), 200);
    streams.push(in_groups);
    for i in 1..STREAMS {
        streams.push(live_stream(&hub, &format!("pos-{i}")).await);
    }
    for (i, stream) in streams.iter_mut().enumerate() {
        publish_to(&hub, &format!("pos-{i}"), "hello").await;
        stream.expect_event(WAIT).await;
    }

    let revoked = http::post_json(
        hub.addr(),
        "/admin/revoke",
        &json!({ "device": "pos-stolen" }),
    )
    .await;
    assert_eq!(revoked.status, 202, "{}", revoked.text());

    let chromium = Chromium::start(1280, 900).await;
    let mut page = chromium.page().await;
    page.call("Runtime.enable", json!({})).await;
    page.call("Log.enable", json!({})).await;
    page.call("Page.enable", json!({})).await;
    page.navigate(&hub.url("/admin/console")).await;

    // Two polls: the first fills the numbers, the second the rates.
    page.wait_for(
        "document.getElementById('events-sent-rate').dataset.value !== undefined",
        PAGE_WAIT,
        "rates",
    )
    .await;
    // The hub is idle now, so the page's last scrape and this one agree.
    let scrape = metrics::scrape(hub.addr()).await;
    let shown = |id: &str| format!("Number(document.getElementById('{id}').dataset.value)");
    let cases = [
        ("connections", scrape.value("sse_connections", &[])),
        (
            "events-sent-total",
            scrape.value("sse_events_sent_total", &[]),
        ),
        (
            "published-total",
            scrape.value("publish_events_total", &[("result", "accepted")]),
        ),
        (
            "evictions-total",
            scrape.value("sse_slow_consumer_disconnects_total", &[]),
        ),
        (
            "resyncs-expired-total",
            scrape.value("sse_resyncs_total", &[("reason", "expired")]),
        ),
    ];
    for (id, expected) in cases {
        let expected = expected.unwrap_or_else(|| panic!("no sample for #{id} in /metrics"));
        assert_eq!(
            page.evaluate(&shown(id)).await.as_f64(),
            Some(expected),
            "#{id}"
        );
    }
    assert_eq!(scrape.value("sse_connections", &[]), Some(STREAMS as f64));
    assert_eq!(
        page.evaluate(&shown("events-sent-rate")).await.as_f64(),
        Some(0.0)
    );

    // The revocations, as GET /admin/revocations lists them.
    assert_eq!(
        page.evaluate(
            "[...document.querySelectorAll('#revocations tr')].map((row) => row.cells[0].textContent)"
        )
        .await,
        json!(["pos-stolen"])
    );
    assert_eq!(
        page.evaluate("document.getElementById('revocations-count').textContent")
            .await,
        "1"
    );

    let mut groups: Vec<String> = scrape
        .matching("memory_tail_lag_seconds", &[])
        .iter()
        .filter_map(|sample| sample.label("group").map(str::to_string))
        .collect();
    groups.sort_by_key(|group| group.parse::<u32>().expect("numeric group"));
    assert!(!groups.is_empty(), "no tail lag in /metrics");
    let shown_groups = page
        .evaluate("[...document.querySelectorAll('#tails tr')].map((row) => row.dataset.group)")
        .await;
    assert_eq!(shown_groups, json!(groups));
    assert_eq!(
        page.evaluate("document.getElementById('lag-metric').textContent")
            .await,
        "memory_tail_lag_seconds"
    );

    // crc32("pos-17") = 2524787842 (src/model/shard.rs); the memory backend has 64 shards.
    page.evaluate(
        "document.getElementById('lookup-device').value = 'pos-17'; \
         document.getElementById('lookup').click()",
    )
    .await;
    assert_eq!(
        page.evaluate(&shown("lookup-shard")).await,
        json!(2_524_787_842u64 % 64)
    );
    // Presence from the fleet API: pos-0 is connected and was sent "hello"; pos-17 never was.
    let text = |id: &str| format!("document.getElementById('{id}').textContent");
    page.wait_for(
        "document.getElementById('lookup-presence').textContent \
         === 'unknown device (or the fleet API is off)'",
        PAGE_WAIT,
        "presence of pos-17",
    )
    .await;
    let record = http::get(hub.addr(), "/v1/devices/pos-0").await.json();
    page.evaluate(
        "document.getElementById('lookup-device').value = 'pos-0'; \
         document.getElementById('lookup').click()",
    )
    .await;
    page.wait_for(
        "document.getElementById('lookup-presence').textContent === 'online'",
        PAGE_WAIT,
        "presence of pos-0",
    )
    .await;
    assert_eq!(page.evaluate(&text("lookup-pod")).await, record["pod"]);
    assert_eq!(
        page.evaluate(&text("lookup-groups")).await,
        json!("merchant-9, store-17")
    );
    assert_eq!(
        page.evaluate(&text("lookup-seen")).await,
        record["connected_at"]
    );

    if let Ok(path) = std::env::var("POSTHORN_CONSOLE_SCREENSHOT") {
        save_screenshot(&mut page, &path).await;
    }
    let errors = faults(&page);
    assert!(errors.is_empty(), "console errors: {errors:#?}");

    // The button only asks; nothing happens until the confirmation.
    page.evaluate("document.getElementById('drain').click()")
        .await;
    assert_eq!(
        page.evaluate("document.getElementById('drain-confirm-panel').hidden")
            .await,
        false
    );
    assert_eq!(http::get(hub.addr(), "/readyz").await.status, 200);
    page.evaluate("document.getElementById('drain-confirm').click()")
        .await;
    page.wait_for(
        "document.getElementById('drain-result').textContent !== ''",
        WAIT,
        "the answer to the drain",
    )
    .await;
    assert_eq!(
        page.evaluate("document.getElementById('drain-result').textContent")
            .await,
        "Drain started."
    );
    let ready = http::get(hub.addr(), "/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.text());
    metrics::wait_for(hub.addr(), "drain_in_progress", &[], 1.0, WAIT).await;
    let status = http::get(hub.addr(), "/admin/status").await.json();
    assert_eq!(status["drain"]["trigger"], "admin request", "{status}");
    // The page follows: the drain's phase, and no second drain to ask for.
    page.wait_for(
        "document.getElementById('drain').disabled && \
         ['draining', 'drained'].includes(document.getElementById('drain-phase').dataset.value)",
        PAGE_WAIT,
        "the drain",
    )
    .await;
    let errors = faults(&page);
    assert!(errors.is_empty(), "console errors: {errors:#?}");
}

/// The page's console errors, but for the one expected: the browser logs the 404 of the
/// lookup of a device the hub does not know.
fn faults(page: &Cdp) -> Vec<&serde_json::Value> {
    page.console_errors()
        .into_iter()
        .filter(|error| {
            let entry = &error["params"]["entry"];
            !(entry["source"] == "network"
                && entry["url"]
                    .as_str()
                    .is_some_and(|url| url.ends_with("/v1/devices/pos-17")))
        })
        .collect()
}

/// Saves a PNG of the page at `path` (for docs/console.png).
async fn save_screenshot(page: &mut Cdp, path: &str) {
    let shot: Value = page
        .call("Page.captureScreenshot", json!({ "format": "png" }))
        .await;
    let png = base64::engine::general_purpose::STANDARD
        .decode(shot["data"].as_str().expect("screenshot data"))
        .expect("screenshot in base64");
    std::fs::write(path, png).unwrap_or_else(|e| panic!("write {path}: {e}"));
}
