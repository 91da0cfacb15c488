//! `POST /v1/events`: one object or an array, validated as a whole, appended in one backend call,
//! answered in input order with each event's SSE id (docs/operations.md, "Publishing answers"). When only part of a
//! batch was stored (one of several Redis instances or node groups down, unacknowledged NATS
//! publishes), the answer is 207 and names per item its id or why it has none; a batch of which
//! nothing is known to be stored is a 503.

use std::{collections::HashMap, time::Instant};

use actix_web::{web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use super::{auth::Access, error::ApiError, AppState};
use crate::{
    backend::{
        fleet::groups::{seen_window, shards_to_write},
        ItemFailure, NewEvent,
    },
    config::parse_duration,
    metrics::PublishResult,
    model::{shard_of, unix_ms, DeviceId, EventType, GroupName, Target},
};

/// Longest idempotency key accepted.
const MAX_KEY_LEN: usize = 256;
const FIELDS: [&str; 8] = [
    "device",
    "broadcast",
    "group",
    "type",
    "data",
    "key",
    "ttl",
    "supersede",
];

pub async fn publish(
    request: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let started = Instant::now();
    let answer = answer_publish(request, payload, &state).await;
    state
        .metrics
        .publish_duration_seconds
        .observe(started.elapsed().as_secs_f64());
    answer
}

async fn answer_publish(
    request: HttpRequest,
    payload: web::Payload,
    state: &AppState,
) -> Result<HttpResponse, ApiError> {
    // Before reading the body: an unauthenticated producer gets nothing buffered.
    state.auth.check(&request, Access::Publish).await?;
    if let Err(error) = require_json(&request, "POST /v1/events") {
        state.metrics.published(PublishResult::Rejected, 1);
        return Err(error);
    }
    let events = match read_limited(&request, payload, state.config.limits.max_body_bytes)
        .await
        .and_then(|body| parse_batch(&body, &state.config.limits))
    {
        Ok(events) => events,
        Err(error) => {
            state.metrics.published(PublishResult::Rejected, 1);
            return Err(error);
        }
    };
    let count = events.len() as u64;
    let mut events = events;
    choose_group_shards(&mut events, state).await;
    let appended = match state.backend.append(events).await {
        Ok(appended) => appended,
        Err(error) => {
            state.metrics.published(PublishResult::Failed, count);
            return Err(error.into());
        }
    };
    if let Some(fleet) = &state.fleet {
        // What the not-acknowledged query of a broadcast or group event compares each device's
        // ack with. The event is published either way: a failure here only makes that query
        // answer 404.
        for appended in appended.iter().flatten() {
            if appended.copies.is_empty() {
                continue;
            }
            if let Err(error) = fleet.store.record_broadcast(appended.copies.clone()).await {
                log::warn!(
                    "fleet: the copies of broadcast {} were not recorded: {}",
                    appended.cursor,
                    crate::report::Report(&error)
                );
            }
        }
    }
    let mut tally = [0u64; 3];
    let results: Vec<Value> = appended
        .iter()
        .map(|outcome| match outcome {
            Ok(appended) => {
                tally[usize::from(appended.duplicate)] += 1;
                json!({ "id": appended.cursor.to_string(), "duplicate": appended.duplicate })
            }
            Err(failure) => {
                tally[2] += 1;
                json!({ "error": failure_code(failure), "message": failure.message() })
            }
        })
        .collect();
    let [accepted, duplicates, failed] = tally;
    state.metrics.published(PublishResult::Accepted, accepted);
    state
        .metrics
        .published(PublishResult::Duplicate, duplicates);
    state.metrics.published(PublishResult::Failed, failed);
    let body = json!({ "results": results });
    Ok(if failed == 0 {
        HttpResponse::Created().json(body)
    } else {
        HttpResponse::MultiStatus().json(body)
    })
}

/// A body is JSON only when it says so. Besides telling a producer that sent a form what is
/// wrong, this keeps browsers out: `application/json` is not a content type a page may send to
/// another site without a CORS preflight, which the hub grants only to `server.cors_origins`.
pub(super) fn require_json(request: &HttpRequest, endpoint: &str) -> Result<(), ApiError> {
    let content_type = request
        .headers()
        .get(actix_web::http::header::CONTENT_TYPE)
        .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned());
    let essence = content_type
        .as_deref()
        .map(|value| value.split(';').next().unwrap_or("").trim());
    if essence.is_some_and(|essence| essence.eq_ignore_ascii_case("application/json")) {
        return Ok(());
    }
    Err(ApiError::UnsupportedMediaType(format!(
        "{endpoint} takes Content-Type: application/json (got {})",
        content_type.map_or_else(|| "none".into(), |value| format!("{value:?}"))
    )))
}

/// The `error` of an item that has no id (docs/operations.md, "Publishing answers").
fn failure_code(failure: &ItemFailure) -> &'static str {
    match failure {
        ItemFailure::NotAppended(_) => "not_appended",
        ItemFailure::Incomplete(_) => "incomplete",
        ItemFailure::Unknown(_) => "outcome_unknown",
    }
}

/// Reads the body, refusing it as soon as it exceeds `limit` (by `Content-Length` before reading,
/// or while reading a chunked body), so an oversized body is never buffered whole.
pub(super) async fn read_limited(
    request: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
) -> Result<web::BytesMut, ApiError> {
    let too_large = || {
        ApiError::PayloadTooLarge(format!(
            "request body exceeds limits.max_body_bytes ({limit} bytes)"
        ))
    };
    let declared = request
        .headers()
        .get("content-length")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<usize>().ok());
    if declared.is_some_and(|length| length > limit) {
        return Err(too_large());
    }
    let mut body = web::BytesMut::with_capacity(declared.unwrap_or(4096).min(limit));
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|error| {
            ApiError::InvalidRequest(format!("cannot read request body: {error}"))
        })?;
        if body.len() + chunk.len() > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Validates a whole batch: the first invalid item fails the request and nothing is appended.
pub fn parse_batch(
    body: &[u8],
    limits: &crate::config::LimitsConfig,
) -> Result<Vec<NewEvent>, ApiError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|error| ApiError::MalformedJson(error.to_string()))?;
    let (items, indexed) = match value {
        Value::Array(items) => (items, true),
        Value::Object(_) => (vec![value], false),
        _ => {
            return Err(ApiError::InvalidRequest(
                "body must be an event object or an array of event objects".into(),
            ))
        }
    };
    if items.is_empty() {
        return Err(ApiError::InvalidRequest("batch is empty".into()));
    }
    if items.len() > limits.max_batch {
        return Err(ApiError::PayloadTooLarge(format!(
            "batch has {} items, limits.max_batch is {}",
            items.len(),
            limits.max_batch
        )));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(index, item)| {
            parse_item(
                item,
                indexed.then_some(index),
                limits.max_event_bytes,
                unix_ms(),
            )
        })
        .collect()
}

/// One item; `now_ms` (the pod's clock) turns a `ttl` into the absolute expiry stored.
fn parse_item(
    item: Value,
    index: Option<usize>,
    max_event_bytes: usize,
    now_ms: u64,
) -> Result<NewEvent, ApiError> {
    let invalid = |field: &'static str, message: String| ApiError::InvalidField {
        index,
        field,
        message,
    };
    let Value::Object(mut object) = item else {
        return Err(invalid("item", format!("must be an object, got {item}")));
    };
    if let Some(unknown) = object.keys().find(|key| !FIELDS.contains(&key.as_str())) {
        return Err(invalid(
            "body",
            format!("unknown field {unknown:?} (known: {})", FIELDS.join(", ")),
        ));
    }
    let broadcast = match object.remove("broadcast") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(flag)) => flag,
        Some(other) => {
            return Err(invalid(
                "broadcast",
                format!("must be true or false, got {other}"),
            ))
        }
    };
    let device = take_string(&mut object, "device", index)?;
    let group = take_string(&mut object, "group", index)?;
    let target = match (broadcast, device, group) {
        (true, None, None) => Target::Broadcast,
        (false, Some(device), None) => Target::Device(
            DeviceId::parse(&device)
                .map_err(|error| invalid("device", format!("{device:?} {error}")))?,
        ),
        (false, None, Some(group)) => Target::Group(
            GroupName::parse(&group)
                .map_err(|error| invalid("group", format!("{group:?} {error}")))?,
        ),
        (false, None, None) => {
            return Err(invalid(
                "device",
                "is required (or a group, or broadcast: true)".into(),
            ))
        }
        (_, _, group) => {
            return Err(invalid(
                if group.is_some() { "group" } else { "device" },
                "exactly one of device, group and broadcast: true names who the event is for"
                    .into(),
            ))
        }
    };
    let event_type = match take_string(&mut object, "type", index)? {
        None => EventType::message(),
        Some(text) => EventType::parse_published(&text)
            .map_err(|error| invalid("type", format!("{text:?} {error}")))?,
    };
    let data = match object.remove("data") {
        None => return Err(invalid("data", "is required".into())),
        Some(Value::String(text)) => text,
        Some(other) => other.to_string(),
    };
    if data.len() > max_event_bytes {
        return Err(ApiError::FieldTooLarge {
            index,
            field: "data",
            message: format!(
                "is {} bytes, limits.max_event_bytes is {max_event_bytes}",
                data.len()
            ),
        });
    }
    let key = take_string(&mut object, "key", index)?;
    if let Some(key) = &key {
        if key.is_empty() || key.len() > MAX_KEY_LEN || key.chars().any(char::is_control) {
            return Err(invalid(
                "key",
                format!("must be 1 to {MAX_KEY_LEN} bytes without control characters"),
            ));
        }
    }
    let expires_ms = match take_string(&mut object, "ttl", index)? {
        None => None,
        Some(text) => match parse_duration(&text).filter(|ttl| !ttl.is_zero()) {
            Some(ttl) => Some(now_ms.saturating_add(ttl.as_millis() as u64)),
            None => {
                return Err(invalid(
                    "ttl",
                    format!(
                        "{text:?} must be a duration above zero and at most 36500d, such as \
                         30s, 10m or 2h"
                    ),
                ))
            }
        },
    };
    let supersede = match take_string(&mut object, "supersede", index)? {
        None => None,
        Some(text) => Some(
            EventType::parse(&text)
                .map_err(|error| invalid("supersede", format!("{text:?} {error}")))?,
        ),
    };
    Ok(NewEvent {
        target,
        event_type,
        data,
        key,
        expires_ms,
        supersede,
        only_shards: None,
    })
}

/// Longest wait for one group's index: a slow fleet store must not hold group publishes (they
/// then go to every shard).
const GROUP_INDEX_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);
/// Group indexes read at once for one request.
const GROUP_INDEX_READS: usize = 16;

/// Gives each group event of `events` the shards where its group's members were seen (one read
/// of the group's index per group, `fleet::groups` decides). Where that is not known (presence
/// off, no index for the group or one too young to trust, a store that does not answer within
/// [`GROUP_INDEX_TIMEOUT`]) the event goes to every shard: a copy too many costs an entry, a
/// copy too few would lose the event for a member. A group whose index names no shard (no
/// member seen lately) gets one copy, on the shard its name hashes to, so that it has an id
/// like any event.
async fn choose_group_shards(events: &mut [NewEvent], state: &AppState) {
    let Some(fleet) = &state.fleet else {
        return;
    };
    let mut groups: Vec<GroupName> = events
        .iter()
        .filter_map(|event| match &event.target {
            Target::Group(group) => Some(group.clone()),
            _ => None,
        })
        .collect();
    if groups.is_empty() {
        return;
    }
    groups.sort();
    groups.dedup();
    let shards = state.backend.shards();
    let window = seen_window(
        state.config.presence.retention,
        state.config.backend_choice().retention(),
    );
    let chosen: HashMap<GroupName, Option<Vec<u32>>> = futures_util::stream::iter(groups)
        .map(|group| async move {
            let read = tokio::time::timeout(GROUP_INDEX_TIMEOUT, fleet.store.group_index(&group));
            let chosen = match read.await {
                Ok(Ok(index)) => shards_to_write(index.as_ref(), window, shards).map(|seen| {
                    if seen.is_empty() {
                        vec![shard_of(group.as_str(), shards)]
                    } else {
                        seen
                    }
                }),
                Ok(Err(error)) => {
                    log::warn!(
                        "fleet: where the members of group {group} are is not known ({}): its \
                         events go to every shard",
                        crate::report::Report(&error)
                    );
                    None
                }
                Err(_) => {
                    log::warn!(
                        "fleet: the index of group {group} took over {GROUP_INDEX_TIMEOUT:?}: its \
                         events go to every shard"
                    );
                    None
                }
            };
            (group, chosen)
        })
        .buffer_unordered(GROUP_INDEX_READS)
        .collect()
        .await;
    for event in events.iter_mut() {
        if let Target::Group(group) = &event.target {
            event.only_shards = chosen.get(group).cloned().flatten();
        }
    }
}

fn take_string(
    object: &mut Map<String, Value>,
    field: &'static str,
    index: Option<usize>,
) -> Result<Option<String>, ApiError> {
    match object.remove(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(other) => Err(ApiError::InvalidField {
            index,
            field,
            message: format!("must be a string, got {other}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn parse(body: &str) -> Result<Vec<NewEvent>, ApiError> {
        parse_batch(body.as_bytes(), &Config::default().limits)
    }

    /// A JSON string is sent as its text; any other JSON value as compact JSON.
    #[test]
    fn data_is_text_or_compact_json() {
        let events =
            parse(r#"[{"device":"pos-1","data":"plain"},{"device":"pos-1","data":{"a": [1, 2]}}]"#)
                .unwrap();
        assert_eq!(events[0].data, "plain");
        assert_eq!(events[1].data, r#"{"a":[1,2]}"#);
        assert_eq!(events[1].event_type.as_str(), "message");
    }

    /// Errors name the item index and the field.
    #[test]
    fn errors_name_item_and_field() {
        let error =
            parse(r#"[{"device":"ok","data":"x"},{"device":"a b","data":"x"}]"#).unwrap_err();
        assert!(
            matches!(
                error,
                ApiError::InvalidField {
                    index: Some(1),
                    field: "device",
                    ..
                }
            ),
            "{error:?}"
        );
        let error = parse(r#"{"device":"ok","type":"bad type","data":"x"}"#).unwrap_err();
        assert!(matches!(
            error,
            ApiError::InvalidField {
                index: None,
                field: "type",
                ..
            }
        ));
        let error = parse(r#"{"broadcast":true,"device":"x","data":"x"}"#).unwrap_err();
        assert!(matches!(
            error,
            ApiError::InvalidField {
                field: "device",
                ..
            }
        ));
        let error = parse(r#"{"device":"x","data":"x","extra":1}"#).unwrap_err();
        assert!(error.to_string().contains("extra"), "{error}");
        assert!(matches!(parse("{"), Err(ApiError::MalformedJson(_))));
        assert!(matches!(parse("[]"), Err(ApiError::InvalidRequest(_))));
        assert!(matches!(parse("42"), Err(ApiError::InvalidRequest(_))));
    }

    /// `ttl` becomes an absolute expiry from the pod's clock; `supersede` is a name with the
    /// rules of an event type. Both are optional.
    #[test]
    fn ttl_and_supersede_are_read() {
        let before = unix_ms();
        let events = parse(
            r#"[{"device":"a","data":"x","ttl":"10m","supersede":"price.table"},
                {"broadcast":true,"data":"y"}]"#,
        )
        .unwrap();
        let after = unix_ms();
        let expires = events[0].expires_ms.unwrap();
        assert!(
            (before + 600_000..=after + 600_000).contains(&expires),
            "{expires}"
        );
        assert_eq!(
            events[0].supersede.as_ref().unwrap().as_str(),
            "price.table"
        );
        assert_eq!(events[1].expires_ms, None);
        assert_eq!(events[1].supersede, None);
    }

    /// A zero, unparsable or non-string `ttl` and an invalid `supersede` name are refused,
    /// naming the item and the field.
    #[test]
    fn bad_ttl_and_supersede_are_named() {
        for ttl in [
            r#""0""#,
            r#""0s""#,
            r#""10 minutes""#,
            r#""-5s""#,
            r#""""#,
            "600",
            r#""18446744073709552s""#,
            r#""876001h""#,
        ] {
            let error = parse(&format!(
                r#"[{{"device":"a","data":"x"}},{{"device":"a","data":"x","ttl":{ttl}}}]"#
            ))
            .unwrap_err();
            assert!(
                matches!(
                    error,
                    ApiError::InvalidField {
                        index: Some(1),
                        field: "ttl",
                        ..
                    }
                ),
                "{ttl}: {error:?}"
            );
        }
        let error = parse(r#"{"device":"a","data":"x","supersede":"two words"}"#).unwrap_err();
        assert!(
            matches!(
                error,
                ApiError::InvalidField {
                    index: None,
                    field: "supersede",
                    ..
                }
            ),
            "{error:?}"
        );
    }

    /// Oversized payloads are 413 naming the item.
    #[test]
    fn oversized_data_is_named() {
        let big = "x".repeat(65_537);
        let error = parse(&format!(r#"[{{"device":"a","data":"{big}"}}]"#)).unwrap_err();
        assert!(matches!(
            error,
            ApiError::FieldTooLarge {
                index: Some(0),
                field: "data",
                ..
            }
        ));
    }
}
