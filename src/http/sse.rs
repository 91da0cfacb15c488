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
    method_not_allowed, AppState,
};
use crate::{
    model::{shard_of, CloseReason, DeviceId},
    stream::{ConnectionSocket, OpenStream, StreamOpener},
};

#[derive(Debug, Deserialize)]
pub struct StreamQuery {
    last_event_id: Option<String>,
}

/// Everything under the scope `/v1/devices`: the stream resource, or 404.
pub async fn devices(
    request: HttpRequest,
    state: web::Data<AppState>,
    opener: web::Data<StreamOpener>,
    cors: web::Data<Cors>,
) -> Result<HttpResponse, ApiError> {
    let Some(device) = device_segment(request.match_info().unprocessed()) else {
        return Err(ApiError::NotFound);
    };
    match *request.method() {
        Method::GET => stream(&request, device, state, &opener).await,
        Method::OPTIONS => Ok(cors::preflight(request, cors).await),
        _ => Ok(method_not_allowed("GET, OPTIONS").await),
    }
}

/// The device of `/{device}/events` (the path after the scope); `None` for any other path.
///
/// actix-web has already decoded every escape in the path except `%2F`, `%25` and `%2B`, so a
/// `/` here separates segments. The escapes left would decode to `/`, `%` or `+`, which no device
/// id may contain, so the segment is not decoded further: `DeviceId::parse` refuses its `%`.
fn device_segment(rest: &str) -> Option<&str> {
    let (segment, tail) = rest.strip_prefix('/')?.split_once('/')?;
    (!segment.is_empty() && tail == "events").then_some(segment)
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
    state.auth.check(request, Access::Stream(&device))?;
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
        .or_else(|| query.into_inner().last_event_id)
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

#[cfg(test)]
mod tests {
    use super::device_segment;

    #[test]
    fn the_stream_path_has_one_segment_then_events() {
        assert_eq!(device_segment("/pos-1/events"), Some("pos-1"));
        for other in [
            "",
            "/",
            "/pos-1",
            "/pos-1/",
            "/pos-1/events/",
            "/pos-1/events/extra",
            "/pos-1/eventsx",
            "//events",
            "/a/b/events",
            "pos-1/events",
        ] {
            assert_eq!(device_segment(other), None, "{other:?}");
        }
    }
}
