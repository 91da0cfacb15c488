//! The fleet API (docs/http-api.md, "Fleet API"; docs/fleet.md): device presence, the fleet
//! event stream, acknowledgements and the not-acknowledged query.
//!
//! Reads need the `fleet` scope (jwt) or, with auth `none`, follow the admin rules (a loopback
//! client; pages of named origins only). An ack needs the device's own token, as its stream does.

use std::time::Duration;

use actix_web::{web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{
    auth::Access,
    error::ApiError,
    ops,
    publish::{read_limited, require_json},
    AppState,
};
use crate::{
    actors::fleet::SubscribeEvents,
    backend::fleet::{DeviceFilter, DeviceRecord, OnlineFilter},
    model::{shard_of, unix_ms, Cursor, DeviceId, GroupName, Target},
    sse::Farewell,
};

/// Devices per page when the request names no `limit`, and the most it may name.
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;
/// Largest ack body: `{"id": "<cursor>"}` is under 200 bytes.
const MAX_ACK_BODY: usize = 4096;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    online: Option<String>,
    group: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
    /// The token may come as `?token=` (auth.rs); it is no filter.
    #[serde(rename = "token")]
    _token: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnackedQuery {
    event: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
    #[serde(rename = "token")]
    _token: Option<String>,
}

fn fleet_of(state: &AppState) -> Result<&super::FleetHandle, ApiError> {
    state.fleet.as_ref().ok_or(ApiError::FleetDisabled)
}

async fn require_fleet_reader(request: &HttpRequest, state: &AppState) -> Result<(), ApiError> {
    state.auth.check(request, Access::Fleet).await?;
    if state.auth.is_enabled() {
        return Ok(());
    }
    ops::loopback_only(request.peer_addr(), "fleet endpoints")
}

fn time(ms: u64) -> Value {
    match jiff::Timestamp::from_millisecond(ms as i64) {
        Ok(at) if ms > 0 => Value::String(at.to_string()),
        _ => Value::Null,
    }
}

/// A device as `GET /v1/devices/{device}` answers it.
pub fn record_json(record: &DeviceRecord) -> Value {
    let text = |value: &str| (!value.is_empty()).then(|| value.to_owned());
    json!({
        "device": record.device.as_str(),
        "online": record.online,
        "pod": text(&record.pod),
        "connected_at": time(record.connected_ms),
        "last_seen_at": time(record.last_seen_ms),
        "remote": text(&record.remote),
        "user_agent": text(&record.user_agent),
        "groups": record.groups,
        "last_sent_id": record.last_sent.as_ref().map(Cursor::to_string),
        "acked_id": record.acked.as_ref().map(Cursor::to_string),
        "acked_at": record.acked_ms.map_or(Value::Null, time),
    })
}

fn parse_limit(limit: Option<&str>) -> Result<usize, ApiError> {
    match limit {
        None => Ok(DEFAULT_LIMIT),
        Some(text) => match text.parse::<usize>() {
            Ok(limit) if (1..=MAX_LIMIT).contains(&limit) => Ok(limit),
            _ => Err(ApiError::InvalidRequest(format!(
                "limit must be a whole number from 1 to {MAX_LIMIT} (got {text:?})"
            ))),
        },
    }
}

fn parse_device(text: &str) -> Result<DeviceId, ApiError> {
    DeviceId::parse(text).map_err(|source| ApiError::InvalidDevice {
        device: text.to_owned(),
        source,
    })
}

/// `GET /v1/devices/{device}`.
pub async fn device(
    request: &HttpRequest,
    device_text: &str,
    state: &AppState,
) -> Result<HttpResponse, ApiError> {
    let device = parse_device(device_text)?;
    require_fleet_reader(request, state).await?;
    let fleet = fleet_of(state)?;
    match fleet.store.device(&device).await? {
        Some(record) => Ok(HttpResponse::Ok().json(record_json(&record))),
        None => Err(ApiError::DeviceNotFound(device.to_string())),
    }
}

/// `GET /v1/devices?online=true|false&group=G&limit=N&cursor=C`.
pub async fn list(request: &HttpRequest, state: &AppState) -> Result<HttpResponse, ApiError> {
    let query = web::Query::<ListQuery>::from_query(request.query_string())
        .map_err(|error| ApiError::InvalidRequest(format!("invalid query string: {error}")))?
        .into_inner();
    require_fleet_reader(request, state).await?;
    let fleet = fleet_of(state)?;
    let online = match query.online.as_deref() {
        None => OnlineFilter::Any,
        Some("true") => OnlineFilter::Online,
        Some("false") => OnlineFilter::Offline,
        Some(other) => {
            return Err(ApiError::InvalidRequest(format!(
                "online must be true or false (got {other:?})"
            )))
        }
    };
    let group = query
        .group
        .as_deref()
        .map(GroupName::parse)
        .transpose()
        .map_err(|error| ApiError::InvalidRequest(format!("group: {error}")))?;
    let filter = DeviceFilter { online, group };
    let limit = parse_limit(query.limit.as_deref())?;
    let page = fleet
        .store
        .list(&filter, limit, query.cursor.as_deref())
        .await?;
    Ok(HttpResponse::Ok().json(json!({
        "devices": page.devices.iter().map(record_json).collect::<Vec<_>>(),
        "next": page.next,
    })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AckBody {
    id: String,
}

/// `POST /v1/devices/{device}/ack` with `{"id": "<cursor>"}`: 204 whether it moved the ack or
/// was behind it (acks only move forward; a late one is no error).
pub async fn ack(
    request: &HttpRequest,
    device_text: &str,
    payload: web::Payload,
    state: &AppState,
) -> Result<HttpResponse, ApiError> {
    let device = parse_device(device_text)?;
    state.auth.check(request, Access::Ack(&device)).await?;
    require_json(request, "POST /v1/devices/{device}/ack")?;
    let fleet = fleet_of(state)?;
    let body = read_limited(request, payload, MAX_ACK_BODY).await?;
    let ack: AckBody = serde_json::from_slice(&body)
        .map_err(|error| ApiError::MalformedJson(error.to_string()))?;
    let cursor = Cursor::parse(&ack.id).map_err(|_| ApiError::InvalidField {
        index: None,
        field: "id",
        message: format!("{:?} is not an event id of this hub", ack.id),
    })?;
    let shard = shard_of(device.as_str(), state.backend.shards());
    let not_ours = |why: &str| ApiError::InvalidField {
        index: None,
        field: "id",
        message: format!(
            "{} is not an id of device {device}'s stream (shard {shard}): {why}",
            ack.id
        ),
    };
    if cursor.shard != shard {
        return Err(not_ours("another shard"));
    }
    // Every ack is checked against the stream as it is now: one beyond its newest event (an
    // invented id) would move the ack past events the device never processed, and then every
    // real ack after it would be ignored as late.
    let current = state.backend.shard_state(shard, None).await?;
    if current.epoch != cursor.epoch {
        // A late ack of the life the stored ack is in, which has ended since (data loss): no
        // error, and nothing to move. Any other life is not this device's.
        let stored = fleet.store.device(&device).await?;
        let late = stored
            .as_ref()
            .and_then(|record| record.acked.as_ref())
            .is_some_and(|acked| acked.epoch == cursor.epoch);
        if !late {
            return Err(not_ours("not of its current life"));
        }
        state.metrics.acked(false);
        return Ok(HttpResponse::NoContent().finish());
    }
    if cursor.position > current.head {
        return Err(not_ours("beyond its newest event"));
    }
    let outcome = fleet.store.ack(&device, &cursor, unix_ms()).await?;
    state
        .metrics
        .acked(outcome == crate::backend::fleet::AckOutcome::Moved);
    Ok(HttpResponse::NoContent().finish())
}

/// `GET /v1/fleet/unacknowledged?event=ID&limit=N&cursor=C`: the devices that have not
/// acknowledged the event (a unicast: its device, if it has not; a broadcast published through
/// this API: every known device whose ack is behind the copy on its shard; a group event: the
/// same among the group's members), a page at a time.
pub async fn unacknowledged(
    request: &HttpRequest,
    state: &AppState,
) -> Result<HttpResponse, ApiError> {
    let query = web::Query::<UnackedQuery>::from_query(request.query_string())
        .map_err(|error| ApiError::InvalidRequest(format!("invalid query string: {error}")))?
        .into_inner();
    require_fleet_reader(request, state).await?;
    let fleet = fleet_of(state)?;
    let event_text = query
        .event
        .ok_or_else(|| ApiError::InvalidRequest("event (an event id) is required".into()))?;
    let event = Cursor::parse(&event_text)
        .ok()
        .filter(|event| event.shard < state.backend.shards())
        .ok_or_else(|| {
            ApiError::InvalidRequest(format!("{event_text:?} is not an event id of this hub"))
        })?;
    let limit = parse_limit(query.limit.as_deref())?;
    let not_found = || {
        ApiError::EventNotFound(format!(
            "event {event_text} is not stored (trimmed, or never appended)"
        ))
    };
    // What the id names: its entry says whom it was for.
    let before = crate::model::Position::before(event.position);
    let page = state.backend.read_after(event.shard, before, 1).await?;
    let entry = page
        .events
        .first()
        .filter(|entry| entry.position == event.position && page.epoch == event.epoch)
        .ok_or_else(not_found)?;
    let (devices, next) = match &entry.target {
        Target::Device(device) => {
            // One device; the cursor pages nothing.
            let record = fleet.store.device(device).await?;
            let acked = record
                .as_ref()
                .is_some_and(|record| acked_copy(record, &event));
            let unacked = if acked {
                Vec::new()
            } else {
                vec![unknown_or(record, device)]
            };
            (unacked, None)
        }
        Target::Broadcast | Target::Group(_) => {
            let (what, group) = match &entry.target {
                Target::Group(group) => ("an event of a group", Some(group.clone())),
                _ => ("a broadcast", None),
            };
            let copies = fleet.store.broadcast_copies(&event).await?.ok_or_else(|| {
                ApiError::EventNotFound(format!(
                    "{event_text} is not {what} published through POST /v1/events and still \
                     kept by the backend (the hub records the copies of those only)"
                ))
            })?;
            // A group's: the devices whose latest session was in the group.
            let filter = DeviceFilter {
                online: OnlineFilter::Any,
                group,
            };
            let page = fleet
                .store
                .list(&filter, limit, query.cursor.as_deref())
                .await?;
            let shards = state.backend.shards();
            let unacked = page
                .devices
                .into_iter()
                .filter(|record| {
                    // A group event has copies only in the shards its members were seen in: a
                    // member on another shard (it joined there after the event was stored) was
                    // never sent it, and has nothing to acknowledge.
                    let shard = shard_of(record.device.as_str(), shards);
                    copies
                        .iter()
                        .find(|copy| copy.shard == shard)
                        .is_some_and(|copy| !acked_copy(record, copy))
                })
                .map(|record| record_json(&record))
                .collect();
            (unacked, page.next)
        }
    };
    Ok(HttpResponse::Ok().json(json!({
        "event": event_text,
        "devices": devices,
        "next": next,
    })))
}

/// Whether the device's ack is at or past `copy` (same life of the shard).
fn acked_copy(record: &DeviceRecord, copy: &Cursor) -> bool {
    record.acked.as_ref().is_some_and(|acked| {
        acked.epoch == copy.epoch && acked.shard == copy.shard && acked.position >= copy.position
    })
}

fn unknown_or(record: Option<DeviceRecord>, device: &DeviceId) -> Value {
    match record {
        Some(record) => record_json(&record),
        None => json!({ "device": device.as_str(), "online": false }),
    }
}

/// `GET /v1/fleet/events`: `device.online` / `device.offline` as the fleet goes. With a token
/// that expires, the stream ends at its `exp` plus `auth.leeway` with `event: token_expired`, as
/// a device's stream does.
pub async fn events(
    request: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let credential = state.auth.check(&request, Access::Fleet).await?;
    if !state.auth.is_enabled() {
        ops::loopback_only(request.peer_addr(), "fleet endpoints")?;
    }
    let fleet = fleet_of(&state)?;
    if state.pod.is_draining() {
        return Err(ApiError::Draining);
    }
    let receiver = fleet
        .actor
        .send(SubscribeEvents)
        .await
        .map_err(|_| ApiError::Internal("the fleet actor is gone: the hub is stopping"))?;
    let ends = credential.expires.map(|exp| {
        let at_ms = exp
            .saturating_mul(1000)
            .saturating_add(state.config.auth.leeway.as_millis() as u64);
        let left = Duration::from_millis(at_ms.saturating_sub(unix_ms()));
        (exp, tokio::time::Instant::now() + left)
    });
    let body = futures_util::stream::unfold(
        (receiver, ends, false),
        move |(mut receiver, ends, ended)| async move {
            if ended {
                return None;
            }
            let Some((exp, at)) = ends else {
                let frame = receiver.recv().await?;
                return Some((Ok::<_, actix_web::Error>(frame), (receiver, ends, false)));
            };
            tokio::select! {
                frame = receiver.recv() => {
                    Some((Ok(frame?), (receiver, ends, false)))
                }
                () = tokio::time::sleep_until(at) => {
                    let frame = Farewell::TokenExpired { exp }.frame();
                    Some((Ok(frame), (receiver, ends, true)))
                }
            }
        },
    )
    .boxed_local();
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(body))
}
