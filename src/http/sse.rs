//! `GET /v1/devices/{device}/events` (docs/http-api.md): validates the request, opens a Connection actor
//! and answers with the body it feeds.
//!
//! The path is matched here rather than by an actix-web resource pattern: a pattern with a
//! `{device}` segment is matched by a regular expression (regex-lite's PikeVM), which cost about
//! 18,000 instructions per stream opened, a fifth of the hub's own instructions in a reconnect
//! storm (docs/BENCHMARKS.md, "Fifth run"). The scope
//! `/v1/devices` is a plain prefix; [`device_segment`] takes the rest apart as the pattern did:
//! one non-empty segment, then exactly `/events`.

use actix_web::{http::Method, web, HttpRequest, HttpResponse};
use serde::Deserialize;

use super::{
    auth::Access,
    cors::{self, Cors},
    error::ApiError,
    fleet, method_not_allowed, AppState,
};
use crate::{
    config::AuthMode,
    model::{shard_of, CloseReason, DeviceId, Groups},
    stream::{ConnectionSocket, OpenStream, Peer, StreamOpener},
};

#[derive(Debug, Deserialize)]
pub struct StreamQuery {
    last_event_id: Option<String>,
    /// The device's groups, comma-separated; read with `auth.mode = "none"` only (with tokens
    /// the token's `groups` claim says them, and a client cannot add one).
    groups: Option<String>,
}

/// Everything under the scope `/v1/devices`: the fleet listing, a device's presence, its
/// stream, its ack, or 404.
pub async fn devices(
    request: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
    opener: web::Data<StreamOpener>,
    cors: web::Data<Cors>,
) -> Result<HttpResponse, ApiError> {
    let Some(path) = device_path(request.match_info().unprocessed()) else {
        return Err(ApiError::NotFound);
    };
    match (path, request.method().clone()) {
        (DevicePath::Events(device), Method::GET) => stream(&request, device, state, &opener).await,
        (DevicePath::Fleet, Method::GET) => fleet::list(&request, &state).await,
        (DevicePath::Device(device), Method::GET) => fleet::device(&request, device, &state).await,
        (DevicePath::Ack(device), Method::POST) => {
            fleet::ack(&request, device, payload, &state).await
        }
        (DevicePath::Events(_) | DevicePath::Ack(_), Method::OPTIONS) => {
            Ok(cors::preflight(request, cors).await)
        }
        (DevicePath::Events(_), _) => Ok(method_not_allowed("GET, OPTIONS").await),
        (DevicePath::Ack(_), _) => Ok(method_not_allowed("POST, OPTIONS").await),
        (DevicePath::Fleet | DevicePath::Device(_), _) => Ok(method_not_allowed("GET").await),
    }
}

/// What a path under `/v1/devices` names.
#[derive(Debug, PartialEq, Eq)]
enum DevicePath<'a> {
    /// `/v1/devices` itself: the fleet listing.
    Fleet,
    /// `/{device}`: its presence.
    Device(&'a str),
    /// `/{device}/events`: its stream.
    Events(&'a str),
    /// `/{device}/ack`.
    Ack(&'a str),
}

/// The path after the scope, taken apart; `None` for a path that names nothing.
///
/// actix-web has already decoded every escape in the path except `%2F`, `%25` and `%2B`, so a
/// `/` here separates segments. The escapes left would decode to `/`, `%` or `+`, which no device
/// id may contain, so the segment is not decoded further: `DeviceId::parse` refuses its `%`.
fn device_path(rest: &str) -> Option<DevicePath<'_>> {
    if rest.is_empty() || rest == "/" {
        return Some(DevicePath::Fleet);
    }
    let rest = rest.strip_prefix('/')?;
    let (segment, tail) = match rest.split_once('/') {
        Some((segment, tail)) => (segment, Some(tail)),
        None => (rest, None),
    };
    if segment.is_empty() {
        return None;
    }
    match tail {
        None => Some(DevicePath::Device(segment)),
        Some("events") => Some(DevicePath::Events(segment)),
        Some("ack") => Some(DevicePath::Ack(segment)),
        Some(_) => None,
    }
}

async fn stream(
    request: &HttpRequest,
    device_text: &str,
    state: web::Data<AppState>,
    opener: &StreamOpener,
) -> Result<HttpResponse, ApiError> {
    let query = web::Query::<StreamQuery>::from_query(request.query_string())
        .map_err(|error| ApiError::InvalidRequest(format!("invalid query string: {error}")))?;
    let device = DeviceId::parse(device_text).map_err(|source| ApiError::InvalidDevice {
        device: device_text.to_owned(),
        source,
    })?;
    let mut credential = state.auth.check(request, Access::Stream(&device)).await?;
    let query = query.into_inner();
    if state.config.auth.mode == AuthMode::None {
        if let Some(text) = &query.groups {
            credential.groups = Groups::parse_list(text).map_err(|(name, error)| {
                ApiError::InvalidRequest(format!("groups: {name:?} {error}"))
            })?;
        }
    }
    let max_groups = state.config.limits.max_groups_per_device;
    if credential.groups.len() > max_groups {
        return Err(ApiError::InvalidRequest(format!(
            "the device is in {} groups, limits.max_groups_per_device is {max_groups}",
            credential.groups.len()
        )));
    }
    if state.pod.is_draining() {
        return Err(ApiError::Draining);
    }
    let limit = state.config.limits.max_connections;
    if !state.pod.try_acquire_connection(limit) {
        return Err(ApiError::TooManyConnections(limit));
    }
    // The header wins; the query parameter exists for clients that cannot set headers. An empty
    // value means "no cursor", as EventSource sends none before its first event.
    let cursor = request
        .headers()
        .get("last-event-id")
        .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
        .or(query.last_event_id)
        .filter(|cursor| !cursor.is_empty());
    let shard = shard_of(device.as_str(), state.backend.shards());
    // `open` returns once the registration is in the Router's mailbox, so a client that has seen
    // the first bytes cannot miss an event published after them.
    let (body, stream) = opener
        .open(OpenStream {
            device,
            shard,
            cursor,
            queue_limit: state.config.sse.queue_limit,
            retry_ms: state.config.sse.retry_ms,
            stall_timeout: state.config.sse.stall_timeout,
            socket_fd: request
                .conn_data::<ConnectionSocket>()
                .map(|socket| socket.0),
            peer: Peer {
                groups: credential.groups.clone(),
                ..peer_of(request)
            },
            credential,
        })
        .await
        .map_err(|_| ApiError::Internal("the router is gone: the hub is stopping"))?;
    // A drain that started while we registered may have taken its list of connections before us:
    // refuse instead of leaving an open stream the drain does not know about.
    if state.pod.is_draining() {
        stream.close(CloseReason::Drain);
        return Err(ApiError::Draining);
    }
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        .insert_header(("X-Accel-Buffering", "no"))
        // When the stream ends (drain, takeover) the TCP connection ends with it.
        .force_close()
        .body(body))
}

/// The remote address (the TCP peer; behind a proxy, the proxy) and the user agent, for
/// presence. Bounded so that a hostile header cannot bloat every device record.
fn peer_of(request: &HttpRequest) -> Peer {
    const MAX_USER_AGENT: usize = 256;
    let user_agent = request
        .headers()
        .get(actix_web::http::header::USER_AGENT)
        .map(|value| String::from_utf8_lossy(value.as_bytes()))
        .unwrap_or_default();
    let mut end = user_agent.len().min(MAX_USER_AGENT);
    while !user_agent.is_char_boundary(end) {
        end -= 1;
    }
    Peer {
        remote: request
            .peer_addr()
            .map(|address| address.to_string())
            .unwrap_or_default(),
        user_agent: user_agent[..end].to_owned(),
        groups: Groups::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::{device_path, DevicePath};

    #[test]
    fn paths_under_devices_name_one_segment_then_what() {
        assert_eq!(
            device_path("/pos-1/events"),
            Some(DevicePath::Events("pos-1"))
        );
        assert_eq!(device_path("/pos-1/ack"), Some(DevicePath::Ack("pos-1")));
        assert_eq!(device_path("/pos-1"), Some(DevicePath::Device("pos-1")));
        assert_eq!(device_path(""), Some(DevicePath::Fleet));
        assert_eq!(device_path("/"), Some(DevicePath::Fleet));
        for other in [
            "/pos-1/",
            "/pos-1/events/",
            "/pos-1/events/extra",
            "/pos-1/eventsx",
            "//events",
            "/a/b/events",
            "pos-1/events",
        ] {
            assert_eq!(device_path(other), None, "{other:?}");
        }
    }
}
