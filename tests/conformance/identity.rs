//! Identity on every backend (docs/security.md, "Token lifetime" and "Revocation"): a stream ends
//! when its token does and a fresh token resumes it without loss; a revocation made on one pod
//! closes the device's streams on every pod within 2 s and refuses its older tokens there, also
//! after a pod restarts; a pod never forgets a revocation it has seen, while its store is away
//! too.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{EncodingKey, Header};
use serde_json::{json, Value};

use crate::env::{Env, Fault};
use crate::support::{http, metrics, stream_path, Hub, SseClient, SseEvent, SseNext};
use crate::WAIT;

const SECRET: &str = "identity-scenarios-secret";
/// How soon every pod must have closed a revoked device's streams.
const REVOCATION_REACH: Duration = Duration::from_secs(2);

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn token(claims: Value) -> String {
    let key = EncodingKey::from_secret(SECRET.as_bytes()).unwrap();
    jsonwebtoken::encode(&Header::default(), &claims, &key).unwrap()
}

/// A device token issued at `iat`, valid for an hour.
fn device_token(device: &str, iat: u64) -> String {
    token(json!({ "sub": device, "iat": iat, "exp": now() + 3600 }))
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// A jwt hub of this backend named `pod`, with `auth.leeway` 1 s.
async fn pod(env: &Env, pod: &str) -> Hub {
    env.hub()
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", SECRET)
        .env("POSTHORN_AUTH__LEEWAY", "1s")
        .env("POSTHORN_PRESENCE__POD_NAME", pod)
        .start()
        .await
}

async fn publish(hub: &Hub, device: &str, data: &str) -> String {
    let publisher = token(json!({ "scope": "publish", "exp": now() + 3600 }));
    let item = json!({ "device": device, "type": "test", "data": data });
    publish_with(hub, &publisher, &item).await
}

/// Publishes `item` with the token `publisher`; its id.
async fn publish_with(hub: &Hub, publisher: &str, item: &Value) -> String {
    let response = http::request(
        hub.addr(),
        "POST",
        "/v1/events",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &bearer(publisher)),
        ],
        Some(item.to_string().as_bytes()),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
    response.json()["results"][0]["id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn stream(hub: &Hub, device: &str, token: &str, cursor: Option<&str>) -> SseClient {
    let authorization = bearer(token);
    let mut headers = vec![("Authorization", authorization.as_str())];
    if let Some(cursor) = cursor {
        headers.push(("Last-Event-ID", cursor));
    }
    let client = SseClient::connect(hub.addr(), &stream_path(device), &headers).await;
    assert_eq!(client.status(), 200, "stream of {device} on {}", hub.addr());
    client
}

/// The answer to a stream request with `token`: 200 (the stream is dropped at once), or the
/// status and the JSON error code.
async fn refused_with(hub: &Hub, device: &str, token: &str) -> (u16, Option<String>) {
    let authorization = bearer(token);
    let headers = [("Authorization", authorization.as_str())];
    let client = SseClient::connect(hub.addr(), &stream_path(device), &headers).await;
    if client.status() == 200 {
        return (200, None);
    }
    let response = http::request(hub.addr(), "GET", &stream_path(device), &headers, None).await;
    (
        response.status,
        response.json()["error"].as_str().map(String::from),
    )
}

/// `POST /admin/revoke` through `hub`; the revocation's second.
async fn revoke(hub: &Hub, device: &str) -> u64 {
    let response = admin(
        hub,
        "POST",
        "/admin/revoke",
        Some(json!({ "device": device })),
    )
    .await;
    assert_eq!(response.0, 202, "{}", response.1);
    assert_eq!(response.1["device"], device);
    response.1["revoked_at_ms"].as_u64().expect("revoked_at_ms") / 1000
}

async fn admin(hub: &Hub, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let authorization = bearer(&token(json!({ "scope": "admin", "exp": now() + 3600 })));
    let body = body.map(|body| body.to_string());
    let response = http::request(
        hub.addr(),
        method,
        path,
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &authorization),
        ],
        body.as_deref().map(str::as_bytes),
    )
    .await;
    let json = if response.body.is_empty() {
        Value::Null
    } else {
        response.json()
    };
    (response.status, json)
}

/// The next event that is not `skip`ped, or a panic naming what came instead.
async fn next_kind(stream: &mut SseClient, within: Duration) -> SseEvent {
    match stream.next_event(within).await {
        SseNext::Event(event) => event,
        other => panic!("no event within {within:?}: {other:?}"),
    }
}

/// A stream whose token expires gets `event: token_expired` (no `id:`, `{"exp": ...}`) at `exp`
/// plus the leeway and is closed (counted as `token_expired`); the expired token opens nothing
/// more; a fresh token resumes from the last id with nothing lost.
pub async fn a_stream_ends_when_its_token_does(env: &mut Env) {
    let hub = pod(env, "pod-a").await;
    let exp = now() + 2;
    let short = token(json!({ "sub": "pos-x", "iat": now(), "exp": exp }));
    let mut client = stream(&hub, "pos-x", &short, None).await;
    let first = publish(&hub, "pos-x", "before").await;
    assert_eq!(
        client.expect_event(WAIT).await.id.as_deref(),
        Some(first.as_str())
    );
    // exp + 1 s of leeway, then one Router tick; the wait bounds it with room to spare.
    let ended = next_kind(&mut client, Duration::from_secs(8)).await;
    assert_eq!(ended.event, "token_expired", "{ended:?}");
    assert_eq!(ended.id, None, "the hub's own event carries no id");
    let data: Value = serde_json::from_str(&ended.data).unwrap();
    assert_eq!(data["exp"], exp);
    assert!(now() > exp, "not before exp + leeway");
    assert_eq!(client.next_event(WAIT).await, SseNext::Closed);
    metrics::wait_for(
        hub.addr(),
        "sse_connections_closed_total",
        &[("reason", "token_expired")],
        1.0,
        WAIT,
    )
    .await;

    let missed = publish(&hub, "pos-x", "while away").await;
    // Past the leeway's last second, in which the token is still taken.
    crate::support::wait_until(WAIT, "the leeway has passed", async || now() > exp + 1).await;
    let (status, error) = refused_with(&hub, "pos-x", &short).await;
    assert_eq!((status, error.as_deref()), (401, Some("unauthorized")));
    let rejected = metrics::scrape(hub.addr()).await;
    assert!(
        rejected.value_or_zero("auth_rejections_total", &[("reason", "expired")]) >= 1.0,
        "the refusal is counted as expired"
    );
    let mut resumed = stream(&hub, "pos-x", &device_token("pos-x", now()), Some(&first)).await;
    let event = resumed.expect_event(WAIT).await;
    assert_eq!(
        (event.id.as_deref(), event.data.as_str()),
        (Some(missed.as_str()), "while away"),
        "the fresh token resumes with nothing lost"
    );
}

/// A revocation made through one pod closes the device's open stream on every pod within 2 s
/// (`event: revoked`, no `id:`, counted as `revoked`), refuses its older tokens everywhere with
/// 401 `token_revoked`, and lets a token issued later in; the revocations are listed, and a pod
/// started after the revocation refuses the old token from its first request.
pub async fn a_revocation_reaches_every_pod(env: &mut Env) {
    let a = pod(env, "pod-a").await;
    let shared = env.part("revoked through another pod", &[Fault::SharedStore]);
    let b = if shared {
        Some(pod(env, "pod-b").await)
    } else {
        None
    };
    let revoking = b.as_ref().unwrap_or(&a);
    let old = device_token("pos-r", now() - 30);
    let mut open = stream(&a, "pos-r", &old, None).await;
    let mut bystander = stream(&a, "pos-s", &device_token("pos-s", now() - 30), None).await;

    let started = tokio::time::Instant::now();
    let revoked_at = revoke(revoking, "pos-r").await;
    let ended = next_kind(&mut open, REVOCATION_REACH).await;
    let took = started.elapsed();
    assert_eq!(
        (ended.event.as_str(), ended.id.as_deref()),
        ("revoked", None),
        "{ended:?}"
    );
    assert!(took <= REVOCATION_REACH, "closed after {took:?}");
    assert_eq!(open.next_event(WAIT).await, SseNext::Closed);
    metrics::wait_for(
        a.addr(),
        "sse_connections_closed_total",
        &[("reason", "revoked")],
        1.0,
        WAIT,
    )
    .await;

    let mut pods = vec![&a];
    pods.extend(b.as_ref());
    let newer = device_token("pos-r", revoked_at + 1);
    for hub in &pods {
        let (status, error) = refused_with(hub, "pos-r", &old).await;
        assert_eq!(
            (status, error.as_deref()),
            (401, Some("token_revoked")),
            "{}",
            hub.addr()
        );
        let (status, _) = refused_with(hub, "pos-r", &newer).await;
        assert_eq!(
            status,
            200,
            "a token issued after the revocation, on {}",
            hub.addr()
        );
        let (status, listed) = admin(hub, "GET", "/admin/revocations", None).await;
        assert_eq!(status, 200);
        assert_eq!(listed["revocations"][0]["device"], "pos-r", "{listed}");
    }
    // Another device's stream is untouched, until its own revocation, which reaches every pod
    // as the first did (a reader that has seen revocations continues after them).
    let marker = publish(&a, "pos-s", "still here").await;
    assert_eq!(
        bystander.expect_event(WAIT).await.id.as_deref(),
        Some(marker.as_str())
    );
    revoke(revoking, "pos-s").await;
    let ended = next_kind(&mut bystander, REVOCATION_REACH).await;
    assert_eq!(ended.event, "revoked", "the second revocation: {ended:?}");

    if env.part("a pod started after the revocation", &[Fault::SharedStore]) {
        let late = pod(env, "pod-c").await;
        let (status, error) = refused_with(&late, "pos-r", &old).await;
        assert_eq!((status, error.as_deref()), (401, Some("token_revoked")));
    }
}

/// While the store is away a pod still applies every revocation it has seen, and one made
/// through it then is applied on it at once (503: stored nowhere else yet); once the store is
/// back, a revocation made on one pod reaches the other again.
pub async fn revocations_hold_through_a_store_outage(env: &mut Env) {
    if !env.part("a store outage", &[Fault::Outage, Fault::SharedStore]) {
        return;
    }
    let a = pod(env, "pod-a").await;
    let b = pod(env, "pod-b").await;
    let before = device_token("pos-o1", now() - 30);
    revoke(&b, "pos-o1").await;
    crate::support::wait_until(WAIT, "pod-a learns the revocation", async || {
        refused_with(&a, "pos-o1", &before).await.0 == 401
    })
    .await;

    env.outage_begin().await;
    let (status, error) = refused_with(&a, "pos-o1", &before).await;
    assert_eq!(
        (status, error.as_deref()),
        (401, Some("token_revoked")),
        "kept while away"
    );
    let during = device_token("pos-o2", now() - 30);
    let mut open = stream(&a, "pos-o2", &during, None).await;
    let (status, body) = admin(
        &a,
        "POST",
        "/admin/revoke",
        Some(json!({ "device": "pos-o2" })),
    )
    .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (503, Some("backend_unavailable")),
        "{body}"
    );
    let ended = next_kind(&mut open, REVOCATION_REACH).await;
    assert_eq!(ended.event, "revoked", "applied on this pod at once");
    let (status, error) = refused_with(&a, "pos-o2", &during).await;
    assert_eq!((status, error.as_deref()), (401, Some("token_revoked")));
    env.outage_end().await;
    // Both pods reach the store again (each client reconnects on its own schedule).
    for hub in [&a, &b] {
        crate::env::wait_for_readiness(hub, 200, WAIT).await;
    }

    let after = device_token("pos-o3", now() - 30);
    let mut on_b = stream(&b, "pos-o3", &after, None).await;
    // Revoked through pod-a once its store is back (retried while it still answers 503).
    crate::support::wait_until(WAIT, "a revocation is stored again", async || {
        admin(
            &a,
            "POST",
            "/admin/revoke",
            Some(json!({ "device": "pos-o3" })),
        )
        .await
        .0 == 202
    })
    .await;
    let ended = next_kind(&mut on_b, REVOCATION_REACH + Duration::from_secs(1)).await;
    assert_eq!(ended.event, "revoked");
    let (status, error) = refused_with(&a, "pos-o1", &before).await;
    assert_eq!(
        (status, error.as_deref()),
        (401, Some("token_revoked")),
        "still kept"
    );
}

/// With tokens, the `groups` claim says a device's groups: `?groups=` on the stream URL cannot
/// add one. A token naming a group outside the device-id characters, or more groups than
/// `limits.max_groups_per_device` (16), opens nothing: 400 `invalid_request`.
pub async fn groups_come_from_the_token(env: &mut Env) {
    let hub = pod(env, "pod-a").await;
    let device = "pos-g";
    let with_groups = |groups: Value| {
        token(json!({ "sub": device, "iat": now(), "exp": now() + 3600, "groups": groups }))
    };
    let authorization = bearer(&with_groups(json!(["store-17"])));
    let mut client = SseClient::connect(
        hub.addr(),
        &format!("{}?groups=store-18", stream_path(device)),
        &[("Authorization", authorization.as_str())],
    )
    .await;
    assert_eq!(client.status(), 200);
    let publisher = token(json!({ "scope": "publish", "exp": now() + 3600 }));
    for group in ["store-18", "store-17"] {
        let item = json!({ "group": group, "type": "test", "data": group });
        publish_with(&hub, &publisher, &item).await;
    }
    assert_eq!(next_kind(&mut client, WAIT).await.data, "store-17");
    assert!(
        matches!(
            client.next_event(Duration::from_millis(500)).await,
            SseNext::Timeout
        ),
        "?groups= added store-18 to a token's groups"
    );
    env.ran("the token's groups, not the URL's");

    let seventeen: Vec<String> = (0..17).map(|n| format!("g{n}")).collect();
    for (groups, why) in [
        (json!(["store 17"]), "a name with a space"),
        (json!(seventeen), "17 groups"),
        (json!("admins"), "a text, not a list"),
        (json!([17]), "a number in the list"),
    ] {
        assert_eq!(
            refused_with(&hub, device, &with_groups(groups)).await,
            (400, Some("invalid_request".into())),
            "{why}"
        );
    }
    env.ran("bad groups claims refused");

    // The claim is read for streams only, after the token's own checks: another device's token
    // is refused for that (403) whatever its groups, and a token whose issuer uses `groups` for
    // something else still publishes.
    assert_eq!(
        refused_with(&hub, "pos-other", &with_groups(json!("admins"))).await,
        (403, Some("forbidden".into()))
    );
    let publisher = token(json!({
        "sub": "producer", "scope": "publish", "iat": now(), "exp": now() + 3600,
        "groups": ["/stores/17", "Everyone"],
    }));
    let item = json!({ "device": device, "type": "test", "data": "x" });
    publish_with(&hub, &publisher, &item).await;
    env.ran("the groups claim of other tokens");
}
