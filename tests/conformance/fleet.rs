//! The fleet API through the hub (docs/http-api.md, "Fleet API"; docs/fleet.md): presence,
//! fleet events, acknowledgements, the not-acknowledged query and takeover, with one hub on
//! every backend and, where the store is shared, with two or three pods on it.

use std::time::Duration;

use serde_json::{json, Value};

use crate::env::{Env, Fault};
use crate::support::{http, hub::HubBuilder, stream_path, Hub, SseClient, SseEvent, SseNext};
use crate::{publish_ok, publish_to, WAIT};

/// `presence.ttl` of the scenarios that kill a pod: short, so they end soon.
const SHORT_TTL: &str = "2s";
/// `presence.debounce` of the fleet event scenarios.
const DEBOUNCE: Duration = Duration::from_secs(1);

/// A hub of this backend named `pod`, with `ttl` and `debounce`.
async fn pod(env: &Env, pod: &str, ttl: &str, debounce: Duration) -> Hub {
    env.hub()
        .env("POSTHORN_PRESENCE__POD_NAME", pod)
        .env("POSTHORN_PRESENCE__TTL", ttl)
        .env(
            "POSTHORN_PRESENCE__DEBOUNCE",
            format!("{}ms", debounce.as_millis()),
        )
        .start()
        .await
}

/// Pod `pod-a` with `ttl`, whose drain closes its streams at once, sends them back in 1–2 s
/// and ends within 5 s.
fn drained_soon(env: &Env, ttl: &str) -> HubBuilder {
    env.hub()
        .env("POSTHORN_PRESENCE__POD_NAME", "pod-a")
        .env("POSTHORN_PRESENCE__TTL", ttl)
        .env("POSTHORN_DRAIN__READINESS_DELAY", "0s")
        .env("POSTHORN_DRAIN__GRACE", "5s")
        .env("POSTHORN_DRAIN__RETRY_MIN", "1s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "2s")
}

async fn get_json(hub: &Hub, path: &str) -> (u16, Value) {
    let response = http::get(hub.addr(), path).await;
    let body = if response.body.is_empty() {
        Value::Null
    } else {
        response.json()
    };
    (response.status, body)
}

/// `GET /v1/devices/{device}`: the record, or `None` on 404.
async fn presence(hub: &Hub, device: &str) -> Option<Value> {
    let (status, body) = get_json(hub, &format!("/v1/devices/{device}")).await;
    match status {
        200 => Some(body),
        404 => {
            assert_eq!(body["error"], "device_not_found", "{body}");
            None
        }
        other => panic!("GET /v1/devices/{device}: {other} {body}"),
    }
}

/// Polls `device`'s record on `hub` until `check` holds; fails after `within`.
async fn presence_until(
    hub: &Hub,
    device: &str,
    within: Duration,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let record = presence(hub, device).await;
        if let Some(record) = record.as_ref().filter(|record| check(record)) {
            return record.clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{device} on {}: not {what} within {within:?}: {record:?}",
            hub.addr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn stream_of(hub: &Hub, device: &str, headers: &[(&str, &str)]) -> SseClient {
    let client = SseClient::connect(hub.addr(), &stream_path(device), headers).await;
    assert_eq!(client.status(), 200, "stream of {device}");
    client
}

/// `POST /v1/devices/{device}/ack`.
async fn ack(hub: &Hub, device: &str, id: &str) -> http::HttpResponse {
    http::post_json(
        hub.addr(),
        &format!("/v1/devices/{device}/ack"),
        &json!({ "id": id }),
    )
    .await
}

/// The fleet event stream of `hub`.
async fn fleet_events(hub: &Hub) -> SseClient {
    let client = SseClient::connect(hub.addr(), "/v1/fleet/events", &[]).await;
    assert_eq!(client.status(), 200, "fleet events");
    client
}

/// The next fleet event about `device` (others are skipped), within `within`.
async fn next_fleet_event(events: &mut SseClient, device: &str, within: Duration) -> SseEvent {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match events.next_event(left).await {
            SseNext::Event(event) => {
                let data: Value = serde_json::from_str(&event.data).expect("JSON data");
                if data["device"] == device {
                    return event;
                }
            }
            other => panic!("no fleet event about {device} within {within:?}: {other:?}"),
        }
    }
}

/// No fleet event about `device` for `during`.
async fn no_fleet_event(events: &mut SseClient, device: &str, during: Duration) {
    let deadline = tokio::time::Instant::now() + during;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return;
        }
        match events.next_event(left).await {
            SseNext::Event(event) => {
                let data: Value = serde_json::from_str(&event.data).expect("JSON data");
                assert_ne!(data["device"], device, "unexpected {event:?}");
            }
            SseNext::Timeout => return,
            other => panic!("the fleet event stream ended: {other:?}"),
        }
    }
}

/// A session is recorded with everything the API shows, the pod that holds it says online, a
/// clean close says offline with the last id written; on a shared store every pod answers the
/// same. An unknown device is 404.
pub async fn presence_follows_a_session(env: &mut Env) {
    let a = pod(env, "pod-a", "30s", DEBOUNCE).await;
    assert_eq!(presence(&a, "pos-never").await, None);
    let mut stream = stream_of(&a, "pos-1", &[("User-Agent", "till/4.2")]).await;
    let record = presence_until(&a, "pos-1", WAIT, "online", |r| r["online"] == true).await;
    assert_eq!(record["pod"], "pod-a");
    assert_eq!(record["user_agent"], "till/4.2");
    assert!(
        record["remote"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{record}"
    );
    assert!(
        record["connected_at"].as_str().unwrap().ends_with('Z'),
        "{record}"
    );
    assert_eq!(record["acked_id"], Value::Null);

    let first = publish_to(&a, "pos-1", "one").await;
    let last = publish_to(&a, "pos-1", "two").await;
    let events = stream.expect_events(2, WAIT).await;
    assert_eq!(events[1].id.as_deref(), Some(last.as_str()));
    let _ = first;
    drop(stream);
    let record = presence_until(&a, "pos-1", WAIT, "offline", |r| r["online"] == false).await;
    assert_eq!(record["last_sent_id"], last.as_str(), "{record}");
    assert!(record["last_seen_at"].is_string(), "{record}");

    if env.part(
        "a second pod reads the shared records",
        &[Fault::SharedStore],
    ) {
        let b = pod(env, "pod-b", "30s", DEBOUNCE).await;
        let seen = presence(&b, "pos-1").await.expect("pod-b knows pos-1");
        assert_eq!(seen, record);
        let _stream = stream_of(&b, "pos-2", &[]).await;
        presence_until(&a, "pos-2", WAIT, "online on pod-b", |r| {
            r["online"] == true && r["pod"] == "pod-b"
        })
        .await;
    }
}

/// A device's last sent id outlives its session: a reconnect that is sent nothing (it resumes
/// with nothing new) still shows the last id it was sent, while the new session is open and
/// after it ends, on this pod and (shared store) on another. Regression: `last_sent_id` went
/// back to null at every connect, and an operator lost the device's real position.
pub async fn the_last_sent_id_outlives_its_session(env: &mut Env) {
    let a = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let mut stream = stream_of(&a, "pos-ls", &[]).await;
    let sent = publish_to(&a, "pos-ls", "one").await;
    assert_eq!(
        stream.expect_event(WAIT).await.id.as_deref(),
        Some(sent.as_str())
    );
    drop(stream);
    presence_until(&a, "pos-ls", WAIT, "offline having sent", |r| {
        r["online"] == false && r["last_sent_id"] == sent.as_str()
    })
    .await;

    let pods = if env.part("the next session on another pod", &[Fault::SharedStore]) {
        vec![a, pod(env, "pod-b", "30s", DEBOUNCE).await]
    } else {
        vec![a]
    };
    let reconnected = pods.last().unwrap();
    let connected_at = presence(&pods[0], "pos-ls").await.unwrap()["connected_at"].clone();
    let mut again = stream_of(reconnected, "pos-ls", &[("Last-Event-ID", &sent)]).await;
    let record = presence_until(&pods[0], "pos-ls", WAIT, "online again", |r| {
        r["online"] == true && r["connected_at"] != connected_at
    })
    .await;
    assert_eq!(
        record["last_sent_id"],
        sent.as_str(),
        "while open: {record}"
    );
    crate::assert_quiet(&mut again, "nothing after the cursor").await;
    drop(again);
    for hub in &pods {
        let record = presence_until(hub, "pos-ls", WAIT, "offline", |r| r["online"] == false).await;
        assert_eq!(record["last_sent_id"], sent.as_str(), "after: {record}");
    }
}

/// A pod killed without a goodbye: its devices show offline on the other pods within
/// `presence.ttl`, and their fleet event streams report it.
pub async fn a_killed_pods_devices_go_offline_within_ttl(env: &mut Env) {
    if !env.part("a pod killed under its devices", &[Fault::SharedStore]) {
        return;
    }
    let mut a = pod(env, "pod-a", SHORT_TTL, DEBOUNCE).await;
    let b = pod(env, "pod-b", SHORT_TTL, DEBOUNCE).await;
    let mut events = fleet_events(&b).await;
    let _stream = stream_of(&a, "pos-9", &[]).await;
    presence_until(&b, "pos-9", WAIT, "online", |r| r["online"] == true).await;
    let online = next_fleet_event(&mut events, "pos-9", WAIT).await;
    assert_eq!(online.event, "device.online");

    let killed = tokio::time::Instant::now();
    a.kill();
    // ttl 2 s, plus a beat interval of slack for the pod's last beat.
    let record = presence_until(&b, "pos-9", Duration::from_secs(5), "offline", |r| {
        r["online"] == false
    })
    .await;
    assert!(killed.elapsed() <= Duration::from_secs(5));
    assert_eq!(record["pod"], "pod-a");
    let offline = next_fleet_event(&mut events, "pos-9", Duration::from_secs(8)).await;
    assert_eq!(offline.event, "device.offline");
    let data: Value = serde_json::from_str(&offline.data).unwrap();
    assert_eq!(data["pod"], "pod-a");
}

/// 1,000 devices page through in device order, `limit` at a time, with the online filter:
/// every device once, none repeated.
pub async fn the_fleet_pages_through_1000_devices(env: &mut Env) {
    let hub = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let _ = rlimit::increase_nofile_limit(4096);
    let devices: Vec<String> = (0..1000).map(|n| format!("fleet-{n:04}")).collect();
    // 500 that came and went, 500 still connected.
    for chunk in devices[..500].chunks(100) {
        let mut streams = Vec::new();
        for device in chunk {
            streams.push(stream_of(&hub, device, &[]).await);
        }
        drop(streams);
    }
    let mut open = Vec::new();
    for device in &devices[500..] {
        open.push(stream_of(&hub, device, &[]).await);
    }
    presence_until(&hub, "fleet-0499", WAIT, "offline", |r| {
        r["online"] == false
    })
    .await;
    presence_until(&hub, "fleet-0999", WAIT, "online", |r| r["online"] == true).await;

    for (filter, expected) in [
        ("", &devices[..]),
        ("&online=true", &devices[500..]),
        ("&online=false", &devices[..500]),
    ] {
        let deadline = tokio::time::Instant::now() + WAIT;
        let listed = loop {
            let listed = page_through(&hub, filter).await;
            let ours: Vec<String> = listed
                .into_iter()
                .filter(|device| device.starts_with("fleet-"))
                .collect();
            if ours == expected || tokio::time::Instant::now() >= deadline {
                break ours;
            }
            // Presence writes land in batches: the last ones may still be on their way.
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(listed.len(), expected.len(), "filter {filter:?}");
        assert_eq!(listed, expected, "filter {filter:?}");
    }
    drop(open);
    let (status, body) = get_json(&hub, "/v1/devices?limit=0").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (400, Some("invalid_request"))
    );
    let (status, _) = get_json(&hub, "/v1/devices?online=maybe").await;
    assert_eq!(status, 400);
}

/// Every device of the listing with `filter`, following `next` with pages of 100.
async fn page_through(hub: &Hub, filter: &str) -> Vec<String> {
    let mut devices = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..100 {
        let mut path = format!("/v1/devices?limit=100{filter}");
        if let Some(cursor) = &cursor {
            path.push_str(&format!("&cursor={}", urlencode(cursor)));
        }
        let (status, body) = get_json(hub, &path).await;
        assert_eq!(status, 200, "{path}: {body}");
        let page = body["devices"].as_array().expect("devices");
        assert!(page.len() <= 100);
        devices.extend(
            page.iter()
                .map(|record| record["device"].as_str().unwrap().to_string()),
        );
        match body["next"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => return devices,
        }
    }
    panic!("more than 100 pages");
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (byte as char).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}

/// Online and offline are reported once each, after `presence.debounce`; a terminal that
/// reconnects within it produces no event. On a shared store another pod reports them too.
pub async fn fleet_events_are_debounced(env: &mut Env) {
    let a = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let b = if env.part("events of another pod's devices", &[Fault::SharedStore]) {
        Some(pod(env, "pod-b", "30s", DEBOUNCE).await)
    } else {
        None
    };
    let mut watchers = vec![fleet_events(&a).await];
    if let Some(b) = &b {
        watchers.push(fleet_events(b).await);
    }
    let stream = stream_of(&a, "pos-5", &[]).await;
    for events in &mut watchers {
        let event = next_fleet_event(events, "pos-5", WAIT).await;
        assert_eq!(event.event, "device.online");
        let data: Value = serde_json::from_str(&event.data).unwrap();
        assert_eq!(data["pod"], "pod-a");
    }
    let hubs: Vec<&Hub> = std::iter::once(&a).chain(b.as_ref()).collect();
    for hub in &hubs {
        devices_online_until(hub, 1.0).await;
    }
    // A flap: gone and back within the debounce.
    drop(stream);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stream = stream_of(&a, "pos-5", &[]).await;
    for events in &mut watchers {
        no_fleet_event(events, "pos-5", DEBOUNCE * 3).await;
    }
    drop(stream);
    for events in &mut watchers {
        let event = next_fleet_event(events, "pos-5", WAIT).await;
        assert_eq!(event.event, "device.offline");
    }
    for hub in &hubs {
        devices_online_until(hub, 0.0).await;
    }
}

/// Waits until `fleet_devices_online` of `hub` is `value`.
async fn devices_online_until(hub: &Hub, value: f64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = crate::support::metrics::scrape(hub.addr())
            .await
            .value_or_zero("fleet_devices_online", &[]);
        if now == value {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "fleet_devices_online of {} is {now}, not {value}",
            hub.addr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Acks move forward only and are kept with presence; a bad id or an id of another device's
/// stream is 400.
pub async fn acks_only_move_forward(env: &mut Env) {
    let hub = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let ids: Vec<String> = publish_ok(
        &hub,
        &json!([
            { "device": "pos-7", "type": "test", "data": "1" },
            { "device": "pos-7", "type": "test", "data": "2" },
            { "device": "pos-7", "type": "test", "data": "3" },
        ]),
    )
    .await
    .iter()
    .map(|result| result["id"].as_str().unwrap().to_string())
    .collect();
    assert_eq!(ack(&hub, "pos-7", &ids[1]).await.status, 204);
    let record = presence(&hub, "pos-7")
        .await
        .expect("an ack makes a record");
    assert_eq!(record["acked_id"], ids[1].as_str());
    assert!(record["acked_at"].is_string());
    assert_eq!(
        ack(&hub, "pos-7", &ids[0]).await.status,
        204,
        "a late ack is no error"
    );
    assert_eq!(
        presence(&hub, "pos-7").await.unwrap()["acked_id"],
        ids[1].as_str(),
        "but it does not move the ack back"
    );
    assert_eq!(ack(&hub, "pos-7", &ids[2]).await.status, 204);
    assert_eq!(
        presence(&hub, "pos-7").await.unwrap()["acked_id"],
        ids[2].as_str()
    );
    let bad = ack(&hub, "pos-7", "not-a-cursor").await;
    assert_eq!(
        (bad.status, bad.json()["field"].as_str()),
        (400, Some("id"))
    );
    // An id of another life of the stream (an ended one, or invented) would replace the ack:
    // refused. So is one beyond the stream's newest event.
    let shard = crate::env::shard("pos-7");
    let invented = format!("zz0ther.{shard}.1-0");
    assert_eq!(ack(&hub, "pos-7", &invented).await.status, 400);
    let ahead = format!("{}.{shard}.99999999999999-0", crate::epoch_of(&ids[2]));
    let fresh = crate::env::device_on_shard("fresh", shard);
    assert_eq!(
        ack(&hub, &fresh, &ahead).await.status,
        400,
        "a first ack beyond the head"
    );
    // Regression: once a device had an ack in the stream's current life, an id beyond the head
    // was taken (204), the ack jumped into the future and every later real ack was ignored.
    let beyond = ack(&hub, "pos-7", &ahead).await;
    assert_eq!(
        beyond.status,
        400,
        "an ack beyond the head after earlier acks: {}",
        beyond.text()
    );
    assert_eq!(beyond.json()["field"], "id");
    assert_eq!(
        presence(&hub, "pos-7").await.unwrap()["acked_id"],
        ids[2].as_str()
    );
    let next = publish_to(&hub, "pos-7", "4").await;
    assert_eq!(ack(&hub, "pos-7", &next).await.status, 204);
    assert_eq!(
        presence(&hub, "pos-7").await.unwrap()["acked_id"],
        next.as_str(),
        "a real ack after the refused one moves the ack"
    );
    // pos-7's id is not on the stream of a device of another shard.
    let other = crate::env::device_on_shard("ack", (crate::env::shard("pos-7") + 1) % 64);
    assert_eq!(ack(&hub, &other, &ids[2]).await.status, 400);
    let form = http::post_raw(
        hub.addr(),
        "/v1/devices/pos-7/ack",
        "text/plain",
        format!("{{\"id\":\"{}\"}}", ids[2]).as_bytes(),
    )
    .await;
    assert_eq!(form.status, 415);

    if env.part("concurrent acks through two pods", &[Fault::SharedStore]) {
        let b = pod(env, "pod-b", "30s", DEBOUNCE).await;
        let more: Vec<String> = publish_ok(
            &hub,
            &json!((0..20)
                .map(|n| json!({ "device": "pos-7", "type": "test", "data": n.to_string() }))
                .collect::<Vec<_>>()),
        )
        .await
        .iter()
        .map(|result| result["id"].as_str().unwrap().to_string())
        .collect();
        // Every ack at once, half through each pod, in scrambled order: the newest wins.
        let acks = more.iter().rev().enumerate().map(|(n, id)| {
            let hub = if n % 2 == 0 { &hub } else { &b };
            ack(hub, "pos-7", id)
        });
        for response in futures_util::future::join_all(acks).await {
            assert_eq!(response.status, 204);
        }
        assert_eq!(
            presence(&b, "pos-7").await.unwrap()["acked_id"],
            more.last().unwrap().as_str()
        );
    }
}

/// With jwt auth an ack needs the device's own token and the fleet reads need the `fleet` scope.
pub async fn the_fleet_api_checks_tokens(env: &mut Env) {
    let hub = env
        .hub()
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", JWT_SECRET)
        .start()
        .await;
    let publisher = token(json!({ "scope": "publish" }));
    let response = http::request(
        hub.addr(),
        "POST",
        "/v1/events",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &format!("Bearer {publisher}")),
        ],
        Some(br#"{"device":"pos-j","data":"x"}"#),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
    let id = response.json()["results"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let body = json!({ "id": id }).to_string();
    let ack_as = |sub: &'static str| {
        let bearer = format!("Bearer {}", token(json!({ "sub": sub })));
        let body = body.clone();
        let addr = hub.addr();
        async move {
            http::request(
                addr,
                "POST",
                "/v1/devices/pos-j/ack",
                &[
                    ("Content-Type", "application/json"),
                    ("Authorization", &bearer),
                ],
                Some(body.as_bytes()),
            )
            .await
            .status
        }
    };
    assert_eq!(ack_as("pos-other").await, 403, "another device's token");
    assert_eq!(ack_as("pos-j").await, 204);
    let read = |claims: Value| {
        let bearer = format!("Bearer {}", token(claims));
        let addr = hub.addr();
        async move {
            http::request(
                addr,
                "GET",
                "/v1/devices/pos-j",
                &[("Authorization", &bearer)],
                None,
            )
            .await
        }
    };
    assert_eq!(read(json!({ "scope": "admin publish" })).await.status, 403);
    assert_eq!(
        read(json!({ "sub": "pos-j" })).await.status,
        403,
        "a device's own token"
    );
    let record = read(json!({ "scope": "fleet" })).await;
    assert_eq!(record.status, 200);
    assert_eq!(record.json()["acked_id"], id.as_str());
    let events = SseClient::connect(hub.addr(), "/v1/fleet/events", &[]).await;
    assert_eq!(events.status(), 401);
}

const JWT_SECRET: &str = "fleet-test-secret";

/// A token signed with [`JWT_SECRET`] with `claims` and an hour to live.
fn token(mut claims: Value) -> String {
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    claims["exp"] = json!(exp);
    let key = jsonwebtoken::EncodingKey::from_secret(JWT_SECRET.as_bytes()).unwrap();
    jsonwebtoken::encode(&jsonwebtoken::Header::default(), &claims, &key).unwrap()
}

/// The devices that have not acknowledged a unicast event (its device, until it acks) or a
/// broadcast (every known device whose ack is behind the copy on its shard), a page at a time.
pub async fn the_unacknowledged_are_listed(env: &mut Env) {
    let hub = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let unicast = publish_to(&hub, "pos-u", "receipt").await;
    let listed = unacknowledged(&hub, &unicast, 10).await;
    assert_eq!(listed, ["pos-u"]);
    assert_eq!(ack(&hub, "pos-u", &unicast).await.status, 204);
    assert!(unacknowledged(&hub, &unicast, 10).await.is_empty());

    // Three known devices, each on its own stream, then a broadcast they all receive.
    let devices = ["bc-a", "bc-b", "bc-c"];
    let mut streams = Vec::new();
    for device in devices {
        streams.push(stream_of(&hub, device, &[]).await);
    }
    for device in devices {
        presence_until(&hub, device, WAIT, "online", |r| r["online"] == true).await;
    }
    let results = publish_ok(
        &hub,
        &json!({ "broadcast": true, "type": "prices", "data": "v2" }),
    )
    .await;
    let broadcast = results[0]["id"].as_str().unwrap().to_string();
    let mut received = Vec::new();
    for stream in &mut streams {
        received.push(stream.expect_event(WAIT).await.id.unwrap());
    }
    let ours = |listed: Vec<String>| -> Vec<String> {
        listed
            .into_iter()
            .filter(|device| device.starts_with("bc-"))
            .collect()
    };
    assert_eq!(ours(unacknowledged_all(&hub, &broadcast, 2).await), devices);
    // Each acks the copy it received (the id of its own shard's copy).
    assert_eq!(ack(&hub, "bc-a", &received[0]).await.status, 204);
    assert_eq!(ack(&hub, "bc-c", &received[2]).await.status, 204);
    assert_eq!(
        ours(unacknowledged_all(&hub, &broadcast, 2).await),
        ["bc-b"]
    );

    let (status, body) = get_json(&hub, "/v1/fleet/unacknowledged").await;
    assert_eq!(status, 400, "{body}");
    let unknown = format!("{}.0.1-0", crate::epoch_of(&unicast));
    let (status, body) = get_json(&hub, &format!("/v1/fleet/unacknowledged?event={unknown}")).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (404, Some("event_not_found"))
    );
}

/// A device's record says the groups of its stream; `GET /v1/devices?group=` lists a group's
/// devices, online or not; a group event's not-acknowledged list holds the members that have
/// not acknowledged the copy on their shard, and no other device.
pub async fn the_fleet_knows_the_groups(env: &mut Env) {
    let hub = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let join = |device: &str, groups: &str| {
        let path = format!("{}?groups={groups}", stream_path(device));
        let addr = hub.addr();
        async move {
            let client = SseClient::connect(addr, &path, &[]).await;
            assert_eq!(client.status(), 200, "{path}");
            client
        }
    };
    let mut in_both = join("gr-a", "store-17,merchant-9").await;
    let mut in_store = join("gr-b", "store-17").await;
    let _elsewhere = join("gr-c", "store-18").await;
    let _in_none = stream_of(&hub, "gr-d", &[]).await;
    for device in ["gr-a", "gr-b", "gr-c", "gr-d"] {
        presence_until(&hub, device, WAIT, "online", |r| r["online"] == true).await;
    }
    let (status, record) = get_json(&hub, "/v1/devices/gr-a").await;
    assert_eq!(status, 200, "{record}");
    assert_eq!(
        record["groups"],
        json!(["merchant-9", "store-17"]),
        "{record}"
    );
    let (_, record) = get_json(&hub, "/v1/devices/gr-d").await;
    assert_eq!(record["groups"], json!([]), "{record}");
    let listed = |query: &'static str| {
        let hub = &hub;
        async move {
            let (status, body) = get_json(hub, &format!("/v1/devices?{query}&limit=1000")).await;
            assert_eq!(status, 200, "{query}: {body}");
            body["devices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|record| record["device"].as_str().unwrap().to_string())
                .filter(|device| device.starts_with("gr-"))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(listed("group=store-17").await, ["gr-a", "gr-b"]);
    assert_eq!(listed("group=merchant-9").await, ["gr-a"]);

    // A group event: both members receive it; gr-b then goes away without acking it.
    let results = publish_ok(
        &hub,
        &json!({ "group": "store-17", "type": "prices", "data": "v2" }),
    )
    .await;
    let event = results[0]["id"].as_str().unwrap().to_string();
    let received = in_both.expect_event(WAIT).await.id.unwrap();
    let ours = |listed: Vec<String>| -> Vec<String> {
        listed
            .into_iter()
            .filter(|device| device.starts_with("gr-"))
            .collect()
    };
    in_store.expect_event(WAIT).await;
    drop(in_store);
    presence_until(&hub, "gr-b", WAIT, "offline", |r| r["online"] == false).await;
    assert_eq!(listed("group=store-17&online=true").await, ["gr-a"]);
    assert_eq!(listed("group=store-17&online=false").await, ["gr-b"]);
    assert_eq!(
        ours(unacknowledged_all(&hub, &event, 2).await),
        ["gr-a", "gr-b"]
    );
    assert_eq!(ack(&hub, "gr-a", &received).await.status, 204);
    assert_eq!(ours(unacknowledged_all(&hub, &event, 2).await), ["gr-b"]);

    let (status, body) = get_json(&hub, "/v1/devices?group=a%2Fb").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (400, Some("invalid_request")),
        "{body}"
    );
}

async fn unacknowledged(hub: &Hub, event: &str, limit: usize) -> Vec<String> {
    let (status, body) = get_json(
        hub,
        &format!("/v1/fleet/unacknowledged?event={event}&limit={limit}"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["event"], event);
    body["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|record| record["device"].as_str().unwrap().to_string())
        .collect()
}

/// The whole not-acknowledged list of `event`, following `next`.
async fn unacknowledged_all(hub: &Hub, event: &str, limit: usize) -> Vec<String> {
    let mut devices = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("/v1/fleet/unacknowledged?event={event}&limit={limit}");
        if let Some(cursor) = &cursor {
            path.push_str(&format!("&cursor={}", urlencode(cursor)));
        }
        let (status, body) = get_json(hub, &path).await;
        assert_eq!(status, 200, "{body}");
        devices.extend(
            body["devices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|record| record["device"].as_str().unwrap().to_string()),
        );
        match body["next"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => return devices,
        }
    }
}

/// A device that connects to another pod closes its stream on the first within 2 s
/// (`takeover`); on one pod the newer stream replaces the older at once.
pub async fn a_new_stream_takes_over_across_pods(env: &mut Env) {
    let a = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let mut first = stream_of(&a, "pos-t", &[]).await;
    let second_hub = if env.part("takeover across pods", &[Fault::SharedStore]) {
        Some(pod(env, "pod-b", "30s", DEBOUNCE).await)
    } else {
        None
    };
    let target = second_hub.as_ref().unwrap_or(&a);
    let connected = tokio::time::Instant::now();
    let mut second = stream_of(target, "pos-t", &[]).await;
    assert!(
        first.wait_closed(Duration::from_secs(2)).await,
        "the older stream is still open 2 s after the newer one opened"
    );
    assert!(connected.elapsed() <= Duration::from_secs(3));
    assert!(!second.is_closed());
    let published = publish_to(target, "pos-t", "after the takeover").await;
    let event = second.expect_event(WAIT).await;
    assert_eq!(event.id.as_deref(), Some(published.as_str()));
    let takeovers = crate::support::metrics::scrape(a.addr())
        .await
        .value("sse_connections_closed_total", &[("reason", "takeover")]);
    assert_eq!(takeovers, Some(1.0));
}

/// A device that connects to two pods at nearly the same time ends with exactly one stream.
pub async fn a_double_connect_leaves_one_stream(env: &mut Env) {
    if !env.part("one device on two pods at once", &[Fault::SharedStore]) {
        return;
    }
    let a = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let b = pod(env, "pod-b", "30s", DEBOUNCE).await;
    for round in 0..5 {
        let device = format!("pos-race-{round}");
        let (mut on_a, mut on_b) =
            tokio::join!(stream_of(&a, &device, &[]), stream_of(&b, &device, &[]));
        tokio::time::sleep(Duration::from_secs(2)).await;
        let closed = [
            on_a.wait_closed(Duration::from_millis(100)).await,
            on_b.wait_closed(Duration::from_millis(100)).await,
        ];
        assert_eq!(
            closed.iter().filter(|closed| **closed).count(),
            1,
            "round {round}: closed (a, b) = {closed:?}"
        );
        // The survivor gets the device's events, and its record names it, online.
        let (survivor, stream) = if closed[0] {
            ("pod-b", &mut on_b)
        } else {
            ("pod-a", &mut on_a)
        };
        let id = publish_to(&a, &device, "after the race").await;
        assert_eq!(
            stream.expect_event(WAIT).await.id.as_deref(),
            Some(id.as_str())
        );
        presence_until(&a, &device, WAIT, "online on the survivor", |r| {
            r["online"] == true && r["pod"] == survivor
        })
        .await;
    }
}

/// The store goes away while devices come and go: the fleet API answers 503
/// `backend_unavailable` (never a stale or wrong record), and once the store is back, what
/// happened meanwhile is recorded: the device that left is offline with the last id it was sent,
/// the one that connected during the outage is online. Two things bring the writes back: the
/// Fleet keeps a failed batch for its next flush, and the Redis and NATS clients send what they
/// buffered while disconnected once they reconnect; this checks the outcome, not which of them.
pub async fn presence_written_during_an_outage_lands_after_it(env: &mut Env) {
    if !env.part("presence across an outage", &[Fault::Outage]) {
        return;
    }
    let hub = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let mut leaving = stream_of(&hub, "pos-out-1", &[]).await;
    presence_until(&hub, "pos-out-1", WAIT, "online", |r| r["online"] == true).await;
    let last = publish_to(&hub, "pos-out-1", "before the outage").await;
    assert_eq!(
        leaving.expect_event(WAIT).await.id.as_deref(),
        Some(last.as_str())
    );

    env.outage_begin().await;
    crate::env::wait_for_readiness(&hub, 503, WAIT).await;
    let (status, body) = get_json(&hub, "/v1/devices/pos-out-1").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (503, Some("backend_unavailable")),
        "{body}"
    );
    drop(leaving);
    // A stream without a cursor opens without the store.
    let arriving = SseClient::connect(hub.addr(), &stream_path("pos-out-2"), &[]).await;
    assert_eq!(arriving.status(), 200, "a stream opens during the outage");
    // Longer than a flush may take (5 s): the pod's writes of both changes fail, and must be
    // kept for a later flush (a shorter outage only delays the flush in the client).
    tokio::time::sleep(Duration::from_secs(7)).await;
    env.outage_end().await;
    crate::env::wait_for_readiness(&hub, 200, WAIT).await;

    let record = presence_until(&hub, "pos-out-1", WAIT, "offline", |r| r["online"] == false).await;
    assert_eq!(record["last_sent_id"], last.as_str(), "{record}");
    presence_until(&hub, "pos-out-2", WAIT, "online", |r| r["online"] == true).await;
    drop(arriving);
}

/// Devices come and go on one pod while the store is away: once it is back, another pod's fleet
/// event stream reports both changes, the connect as `device.online` and the disconnect as
/// `device.offline`. What either pod announced meanwhile may be lost with the channel (a pod's
/// client may send it before the other pod's client has subscribed again), so each pod reads the
/// devices online again when its channel comes back, and a pod whose writes had to wait for the
/// store announces them again once they are stored.
pub async fn changes_during_an_outage_reach_other_pods_fleet_events(env: &mut Env) {
    if !env.part(
        "fleet events across an outage",
        &[Fault::Outage, Fault::SharedStore],
    ) {
        return;
    }
    let a = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let b = pod(env, "pod-b", "30s", DEBOUNCE).await;
    let mut events = fleet_events(&b).await;
    let leaving = stream_of(&a, "pos-dark-1", &[]).await;
    assert_eq!(
        next_fleet_event(&mut events, "pos-dark-1", WAIT)
            .await
            .event,
        "device.online"
    );

    env.outage_begin().await;
    crate::env::wait_for_readiness(&a, 503, WAIT).await;
    crate::env::wait_for_readiness(&b, 503, WAIT).await;
    drop(leaving);
    let arriving = SseClient::connect(a.addr(), &stream_path("pos-dark-2"), &[]).await;
    assert_eq!(arriving.status(), 200, "a stream opens during the outage");
    // Longer than a flush may take (5 s): the writes fail and wait for the store.
    tokio::time::sleep(Duration::from_secs(7)).await;
    env.outage_end().await;
    crate::env::wait_for_readiness(&a, 200, WAIT).await;
    crate::env::wait_for_readiness(&b, 200, WAIT).await;

    // Well within presence.ttl (30 s): not the liveness fallback.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut heard = std::collections::BTreeMap::new();
    while heard.len() < 2 {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match events.next_event(left).await {
            SseNext::Event(event) => {
                let data: Value = serde_json::from_str(&event.data).expect("JSON data");
                let device = data["device"].as_str().unwrap_or_default().to_owned();
                heard.entry(device).or_insert(event.event);
            }
            other => panic!("fleet events of pod-b after the outage: {heard:?}, then {other:?}"),
        }
    }
    let expected = [
        ("pos-dark-1".to_owned(), "device.offline".to_owned()),
        ("pos-dark-2".to_owned(), "device.online".to_owned()),
    ];
    assert_eq!(heard, expected.into_iter().collect());
    drop(arriving);
}

/// A pod drained on deploy leaves no device online behind: its devices show offline on the other
/// pods at once (well within `presence.ttl`, 30 s here), with the last id each was sent, and
/// their fleet event streams report it. (The drain closes the stream, whose end is written like
/// any other; the farewell's flush matters for the ends of the last moment, which this does not
/// single out.)
pub async fn a_drained_pods_devices_go_offline_at_once(env: &mut Env) {
    if !env.part("a pod drained under its devices", &[Fault::SharedStore]) {
        return;
    }
    let mut a = drained_soon(env, "30s")
        .env("POSTHORN_PRESENCE__DEBOUNCE", "100ms")
        .start()
        .await;
    let b = pod(env, "pod-b", "30s", Duration::from_millis(100)).await;
    let mut events = fleet_events(&b).await;
    let mut stream = stream_of(&a, "pos-drain", &[]).await;
    presence_until(&b, "pos-drain", WAIT, "online", |r| r["online"] == true).await;
    assert_eq!(
        next_fleet_event(&mut events, "pos-drain", WAIT).await.event,
        "device.online"
    );
    let last = publish_to(&a, "pos-drain", "before the drain").await;
    assert_eq!(
        stream.expect_event(WAIT).await.id.as_deref(),
        Some(last.as_str())
    );

    let drained = tokio::time::Instant::now();
    a.signal("TERM");
    let status = a.wait_exit(WAIT).await.expect("the drained pod exits");
    assert!(status.success(), "{status}");
    let record = presence_until(&b, "pos-drain", Duration::from_secs(10), "offline", |r| {
        r["online"] == false
    })
    .await;
    assert!(
        drained.elapsed() < Duration::from_secs(10),
        "offline only after {:?}",
        drained.elapsed()
    );
    assert_eq!(record["last_sent_id"], last.as_str(), "{record}");
    let offline = next_fleet_event(&mut events, "pos-drain", Duration::from_secs(10)).await;
    assert_eq!(offline.event, "device.offline");
}

/// The store restarts empty under a running pod (Redis without persistence, nats-server without
/// its store directory): the records of the devices still connected are gone. The pod hears the
/// gap in its channel and writes those sessions again, so within one sampling round (5 s) the
/// device is online again with what it was last sent, long before the pod's periodic refresh
/// (`presence.retention / 4`) would have rewritten it.
pub async fn a_store_restarted_empty_hears_again_of_the_connected_devices(env: &mut Env) {
    if !env.part(
        "presence after the store restarted empty",
        &[Fault::RestartLosingDataUnderTheHub],
    ) {
        return;
    }
    let mut hub = pod(env, "pod-a", "30s", DEBOUNCE).await;
    let mut stream = stream_of(&hub, "pos-kept", &[]).await;
    presence_until(&hub, "pos-kept", WAIT, "online", |r| r["online"] == true).await;

    env.restart_losing_data(&mut hub).await;
    crate::env::wait_for_readiness(&hub, 200, WAIT).await;
    // A loss of the event data too: the stream hears of it (a `resync`), then goes on.
    let last = publish_to(&hub, "pos-kept", "after the restart").await;
    loop {
        let event = stream.expect_event(WAIT).await;
        if event.id.as_deref() == Some(last.as_str()) {
            break;
        }
        assert_eq!(event.event, "resync", "{event:?}");
    }
    let record = presence_until(&hub, "pos-kept", WAIT, "online again", |r| {
        r["online"] == true && r["last_sent_id"] == last.as_str()
    })
    .await;
    assert_eq!(record["pod"], "pod-a", "{record}");
}

/// A pod drained while its store is away: its clients are told when to come back and closed
/// within the drain's grace, and the pod exits cleanly soon after, although its last presence
/// writes and its goodbye cannot be stored (the farewell gives up after 3 s). Once the store is
/// back the device is offline for the other pods: its pod's beats stopped, so liveness ends it.
pub async fn a_pod_drained_while_its_store_is_away_exits_in_time(env: &mut Env) {
    if !env.part(
        "a pod drained during an outage",
        &[Fault::Outage, Fault::SharedStore],
    ) {
        return;
    }
    let mut a = drained_soon(env, SHORT_TTL).start().await;
    let mut stream = stream_of(&a, "pos-dark-drain", &[]).await;
    presence_until(&a, "pos-dark-drain", WAIT, "online", |r| {
        r["online"] == true
    })
    .await;

    env.outage_begin().await;
    crate::env::wait_for_readiness(&a, 503, WAIT).await;
    let drained = tokio::time::Instant::now();
    a.signal("TERM");
    stream.read_to_close(Duration::from_secs(10)).await;
    let retry = stream.retry.expect("a retry before the close");
    assert!((1000..=2000).contains(&retry), "retry {retry}");
    let status = a.wait_exit(WAIT).await.expect("the drained pod exits");
    assert!(status.success(), "{status}");
    // The grace (5 s) and the farewell's limit (3 s), with a margin for a loaded machine.
    assert!(
        drained.elapsed() < Duration::from_secs(13),
        "exited only after {:?}",
        drained.elapsed()
    );

    env.outage_end().await;
    let b = pod(env, "pod-b", SHORT_TTL, DEBOUNCE).await;
    let record = presence_until(&b, "pos-dark-drain", WAIT, "offline", |r| {
        r["online"] == false
    })
    .await;
    assert_eq!(record["pod"], "pod-a", "{record}");
}
