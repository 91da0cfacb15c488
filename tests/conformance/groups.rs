//! Groups on every backend (docs/stream-format.md, "Groups"; docs/http-api.md): a group event
//! reaches the connected members of its group on every pod and no one else; it is stored at
//! most once per shard, so a member away resumes it with its one cursor, in order with its own
//! events and the broadcasts, with `ttl` and `supersede` applied; external producers write
//! group entries; memberships and group publishes are checked at the edge.

use serde_json::{json, Value};

use crate::env::{device_on_shard, shard, Env, Fault, SHARDS};
use crate::support::{http, stream_path, Hub, SseClient, SseNext};
use crate::{assert_quiet, data_of, publish, publish_ok, publish_to, WAIT};

/// The stream path of `device` as a member of `groups` (comma-separated).
fn member_path(device: &str, groups: &str) -> String {
    format!("{}?groups={groups}", stream_path(device))
}

/// Opens `device`'s stream as a member of `groups`, after `cursor` if given.
async fn member(hub: &Hub, device: &str, groups: &str, cursor: Option<&str>) -> SseClient {
    let headers: Vec<(&str, &str)> = cursor.map(|id| ("Last-Event-ID", id)).into_iter().collect();
    let client = SseClient::connect(hub.addr(), &member_path(device, groups), &headers).await;
    assert_eq!(client.status(), 200, "stream of {device} in {groups}");
    client
}

/// Publishes `data` to `group` with `extra` fields; returns its id.
async fn publish_to_group(hub: &Hub, group: &str, data: &str, extra: Value) -> String {
    let mut item = json!({ "group": group, "type": "test", "data": data });
    item.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    publish_ok(hub, &item).await[0]["id"]
        .as_str()
        .expect("id")
        .to_string()
}

/// Members of a group on different shards (and, where pods share a store, on two pods) receive
/// a group event once, in order with the events after it; a device of another group or of none,
/// on the same shard as a member, does not. One group event is at most one stored entry per
/// shard. An entry an external producer writes for a group (`grp`, `Posthorn-Group`) reaches the
/// members the same way.
pub async fn a_group_event_reaches_its_members_only(env: &mut Env) {
    let hub = env.start_hub().await;
    let (near, far) = (device_on_shard("m", 5), device_on_shard("m", 40));
    let (stranger, loner) = (device_on_shard("s", 5), device_on_shard("l", 5));
    let mut on_near = member(&hub, &near, "store-17", None).await;
    let mut on_far = member(&hub, &far, "merchant-9,store-17", None).await;
    let mut on_stranger = member(&hub, &stranger, "store-18", None).await;
    let mut on_loner = member(&hub, &loner, "", None).await;

    let stored_before = if env.part("at most one entry per shard", &[Fault::InspectStore]) {
        Some(env.stored_entries().await)
    } else {
        None
    };
    let price = publish_to_group(&hub, "store-17", "price", json!({})).await;
    if let Some(before) = stored_before {
        let added = env.stored_entries().await - before;
        assert!(
            (1..=u64::from(SHARDS)).contains(&added),
            "one group event stored {added} entries over {SHARDS} shards"
        );
    }
    publish_to_group(&hub, "merchant-9", "menu", json!({})).await;
    for device in [&near, &far, &stranger, &loner] {
        publish_to(&hub, device, "marker").await;
    }
    let near_events = on_near.expect_events(2, WAIT).await;
    assert_eq!(data_of(&near_events), ["price", "marker"], "{near}");
    assert_eq!(
        near_events[0].id.as_deref().map(|id| id.split('.').nth(1)),
        Some(Some(shard(&near).to_string().as_str())),
        "the member's copy is on its own shard: {near_events:?}"
    );
    assert_eq!(price.split('.').count(), 3, "{price}");
    let far_events = on_far.expect_events(3, WAIT).await;
    assert_eq!(data_of(&far_events), ["price", "menu", "marker"], "{far}");
    for (client, device) in [(&mut on_stranger, &stranger), (&mut on_loner, &loner)] {
        let events = client.expect_events(1, WAIT).await;
        assert_eq!(data_of(&events), ["marker"], "{device} is no member");
        assert_quiet(client, "nothing else for a non-member").await;
    }
    env.ran("members receive a group event once, non-members on their shard do not");

    if env.part("members on two pods", &[Fault::SharedStore]) {
        let other = env.start_hub().await;
        let there = device_on_shard("t", 5);
        let mut on_there = member(&other, &there, "store-17", None).await;
        let mut stranger_there = member(&other, &device_on_shard("u", 40), "store-18", None).await;
        publish_to_group(&hub, "store-17", "across pods", json!({})).await;
        assert_eq!(on_there.expect_event(WAIT).await.data, "across pods");
        assert_eq!(on_near.expect_event(WAIT).await.data, "across pods");
        assert_eq!(on_far.expect_event(WAIT).await.data, "across pods");
        assert_quiet(&mut stranger_there, "no member on the other pod").await;
    }

    if env.part(
        "an external producer's group entry",
        &[Fault::ExternalProducer],
    ) {
        env.produce_for_group(shard(&near), "store-17", "from outside")
            .await;
        let event = on_near.expect_event(WAIT).await;
        assert_eq!(
            (event.event.as_str(), event.data.as_str()),
            ("ext", "from outside")
        );
        assert_quiet(&mut on_stranger, "the producer's entry is for store-17").await;
        assert_quiet(&mut on_loner, "the producer's entry is for store-17").await;
    }
}

/// A member away resumes with its one cursor: its own events, the broadcasts and its groups'
/// events come back in the order they were appended, not another group's; an event whose `ttl`
/// passed while it was away is not replayed, and of two versions with one `supersede` name only
/// the newest is. A device that is no member resumes the same stretch without the group events.
pub async fn a_member_resumes_group_events_in_order_with_its_own(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = device_on_shard("pos", 23);
    let stranger = device_on_shard("other", 23);
    let cursor = publish_to(&hub, &device, "before").await;
    let stranger_cursor = publish_to(&hub, &stranger, "before").await;

    publish_to(&hub, &device, "own 1").await;
    publish_to_group(&hub, "store-17", "group 1", json!({})).await;
    publish_ok(
        &hub,
        &json!({ "broadcast": true, "type": "test", "data": "to all" }),
    )
    .await;
    publish_to_group(&hub, "store-18", "another store", json!({})).await;
    publish_to(&hub, &device, "own 2").await;
    let menu = json!({ "supersede": "menu" });
    publish_to_group(&hub, "store-17", "menu v1", menu.clone()).await;
    publish_to_group(&hub, "store-17", "short", json!({ "ttl": "1s" })).await;
    publish_to_group(&hub, "store-17", "menu v2", menu).await;
    publish_to_group(&hub, "store-17", "long", json!({ "ttl": "10m" })).await;
    publish_to(&hub, &device, "own 3").await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;

    let mut resumed = member(&hub, &device, "store-17", Some(&cursor)).await;
    let events = resumed.expect_events(7, WAIT).await;
    assert_eq!(
        data_of(&events),
        ["own 1", "group 1", "to all", "own 2", "menu v2", "long", "own 3"]
    );
    assert!(
        events.iter().all(|event| event.id.is_some()),
        "every replayed event carries its cursor: {events:?}"
    );
    assert_quiet(&mut resumed, "nothing after own 3").await;
    env.ran("a member resumes its groups' events in order, ttl and supersede applied");

    let mut outsider = SseClient::connect(
        hub.addr(),
        &stream_path(&stranger),
        &[("Last-Event-ID", stranger_cursor.as_str())],
    )
    .await;
    assert_eq!(outsider.status(), 200);
    assert_eq!(data_of(&outsider.expect_events(1, WAIT).await), ["to all"]);
    assert_quiet(&mut outsider, "no group event for a device in no group").await;
    env.ran("a device in no group resumes without them");
}

/// Bad memberships and bad group publishes are refused with 400 and store nothing: a group name
/// outside the device-id characters, more groups than `limits.max_groups_per_device` (16), a
/// publish naming a group and a device, or a group and `broadcast`. 16 groups are accepted.
pub async fn memberships_and_group_publishes_are_checked(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = device_on_shard("pos", 9);
    let sixteen: Vec<String> = (0..16).map(|n| format!("g{n}")).collect();
    let seventeen = format!("{},g16", sixteen.join(","));
    for (groups, why) in [
        (seventeen.as_str(), "17 groups"),
        ("store%2017", "a space"),
        ("store-1,a/b", "a slash"),
    ] {
        let response =
            http::request(hub.addr(), "GET", &member_path(&device, groups), &[], None).await;
        assert_eq!(response.status, 400, "{why}: {}", response.text());
        assert_eq!(response.json()["error"], "invalid_request", "{why}");
    }
    let mut client = member(&hub, &device, &sixteen.join(","), None).await;
    env.ran("memberships checked");

    for (item, field) in [
        (json!({ "group": "store 17", "data": "x" }), "group"),
        (
            json!({ "group": "g1", "device": device, "data": "x" }),
            "group",
        ),
        (
            json!({ "group": "g1", "broadcast": true, "data": "x" }),
            "group",
        ),
        (json!({ "group": 17, "data": "x" }), "group"),
    ] {
        let response = publish(&hub, &json!([{ "group": "g2", "data": "fine" }, item])).await;
        assert_eq!(response.status, 400, "{item}: {}", response.text());
        assert_eq!(response.json()["error"], "invalid_request", "{item}");
        assert_eq!(
            response.json()["field"],
            field,
            "{item}: {}",
            response.text()
        );
    }
    publish_to(&hub, &device, "after the refusals").await;
    assert_eq!(
        client.expect_event(WAIT).await.data,
        "after the refusals",
        "no part of a refused batch was stored"
    );
    env.ran("group publishes checked");
}

/// With presence on, a group event goes only to the shards where its members were seen, once
/// the group's index has been kept for a whole seen window (the longer of `presence.retention`
/// and the event retention, plus three refresh periods: 6 s + 3 s here): the answer's id is then
/// the copy on the members' first shard, not shard 0's, members on k shards cost k entries
/// (where the store can be counted), each member receives its shard's copy and a device of
/// another group on a third shard nothing. The not-acknowledged query lists the members behind
/// their shard's copy. A member that joins on a new shard is marked at its pod's next flush, and
/// group events from then on are stored there too.
pub async fn a_group_event_is_stored_only_where_its_members_are(env: &mut Env) {
    let hub = env
        .hub_with_event_retention("6s")
        // JetStream's duplicate window may not exceed its retention.
        .env("POSTHORN_PUBLISH__DEDUPE_WINDOW", "5s")
        .env("POSTHORN_PRESENCE__TTL", "1s")
        .env("POSTHORN_PRESENCE__RETENTION", "4s")
        .start()
        .await;
    let (near, far, late) = (
        device_on_shard("k", 5),
        device_on_shard("k", 40),
        device_on_shard("k", 20),
    );
    let mut on_near = member(&hub, &near, "store-8", None).await;
    let mut on_far = member(&hub, &far, "store-8", None).await;
    let mut stranger = member(&hub, &device_on_shard("x", 20), "store-9", None).await;
    let counted = env.part("k entries for members in k shards", &[Fault::InspectStore]);
    let shard_of_id = |id: &str| id.split('.').nth(1).map(str::to_owned);

    // Until the index is trusted every shard gets a copy (shard 0's answers); then the
    // members' two (shard 5's answers).
    let mut probes = 0;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let before = if counted {
            env.appended_entries().await
        } else {
            0
        };
        let id = publish_to_group(&hub, "store-8", &format!("probe-{probes}"), json!({})).await;
        probes += 1;
        let added = if counted {
            env.appended_entries().await - before
        } else {
            0
        };
        if shard_of_id(&id).as_deref() == Some("5") {
            if counted {
                assert_eq!(added, 2, "{id}");
            }
            break;
        }
        assert_eq!(shard_of_id(&id).as_deref(), Some("0"), "every shard: {id}");
        if counted {
            assert_eq!(
                added,
                u64::from(SHARDS),
                "before the index is trusted: {id}"
            );
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "every shard still after {WAIT:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    assert!(
        probes > 1,
        "the index was trusted at once: it must settle first"
    );
    let before = if counted {
        env.appended_entries().await
    } else {
        0
    };
    let targeted = publish_to_group(&hub, "store-8", "targeted", json!({})).await;
    if counted {
        assert_eq!(env.appended_entries().await - before, 2, "{targeted}");
    }
    let mut copies = Vec::new();
    for (client, device, shard) in [(&mut on_near, &near, "5"), (&mut on_far, &far, "40")] {
        let events = client.expect_events(probes + 1, WAIT).await;
        let last = events.last().unwrap();
        assert_eq!(last.data, "targeted", "{device}");
        let id = last.id.clone().expect("id");
        assert_eq!(shard_of_id(&id).as_deref(), Some(shard), "{device}: {id}");
        copies.push(id);
    }
    assert_eq!(copies[0], targeted, "answered by the first copy");
    assert_quiet(&mut stranger, "store-9 has no event").await;
    env.ran("a group event is stored in its members' shards only");

    // The not-acknowledged query: both members; after one acks its copy, the other.
    let unacked = |event: &str| {
        let path = format!("/v1/fleet/unacknowledged?event={event}&limit=100");
        let addr = hub.addr();
        async move {
            let response = http::get(addr, &path).await;
            assert_eq!(response.status, 200, "{}", response.text());
            let mut devices: Vec<String> = response.json()["devices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|record| record["device"].as_str().unwrap().to_string())
                .collect();
            devices.sort();
            devices
        }
    };
    let mut both = vec![near.clone(), far.clone()];
    both.sort();
    assert_eq!(unacked(&targeted).await, both);
    let response = http::post_json(
        hub.addr(),
        &format!("/v1/devices/{far}/ack"),
        &json!({ "id": copies[1] }),
    )
    .await;
    assert_eq!(response.status, 204, "{}", response.text());
    assert_eq!(unacked(&targeted).await, vec![near.clone()]);
    env.ran("the not-acknowledged query of a group event stored in some shards");

    // A member joins on shard 20: once its pod has marked it, events are stored there too.
    let mut on_late = member(&hub, &late, "store-8", None).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut sent = 0;
    let first = loop {
        let before = if counted {
            env.appended_entries().await
        } else {
            0
        };
        let data = format!("join-{sent}");
        publish_to_group(&hub, "store-8", &data, json!({})).await;
        sent += 1;
        let added = if counted {
            env.appended_entries().await - before
        } else {
            0
        };
        match on_late
            .next_event(std::time::Duration::from_millis(300))
            .await
        {
            SseNext::Event(event) => {
                if counted {
                    assert_eq!(added, 3, "{event:?}");
                }
                assert_eq!(event.data, data, "its first group event is the newest");
                break event;
            }
            SseNext::Timeout => {
                if counted {
                    assert_eq!(added, 2, "the members' shards, until the third is marked");
                }
            }
            SseNext::Closed => panic!("the late member's stream closed"),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "shard 20 never marked"
        );
    };
    assert_eq!(
        first.id.as_deref().and_then(shard_of_id),
        Some("20".to_owned())
    );
    for client in [&mut on_near, &mut on_far] {
        let events = client.expect_events(sent, WAIT).await;
        assert_eq!(events.last().unwrap().data, first.data);
    }
    env.ran("a member on a new shard is stored for from its mark on");
}
