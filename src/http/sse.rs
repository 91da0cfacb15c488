//! `GET /v1/devices/{device}/events` (SPEC 4.1): validates the request, opens a Connection actor
//! and answers with the body it feeds.

use actix_web::{web, HttpRequest, HttpResponse};
use serde::Deserialize;

use super::{auth::Access, error::ApiError, AppState};
use crate::{
    actors::{
        close_reason::CloseReason,
        connection::{Close, Connection, OpenStream},
    },
    model::{shard_of, DeviceId},
    sse::control::ConnectionSocket,
};

#[derive(Debug, Deserialize)]
pub struct StreamQuery {
    last_event_id: Option<String>,
}

pub async fn stream(
    request: HttpRequest,
    device: web::Path<String>,
    query: web::Query<StreamQuery>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let device_text = device.into_inner();
    let device = DeviceId::parse(&device_text).map_err(|source| ApiError::InvalidDevice {
        device: device_text,
        source,
    })?;
    state.auth.check(&request, Access::Stream(&device))?;
    if state.hub.is_draining() {
        return Err(ApiError::Draining);
    }
    let limit = state.config.limits.max_connections;
    if !state.hub.try_acquire_connection(limit) {
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
    let (body, control) = Connection::open(
        OpenStream {
            device,
            shard,
            cursor,
            queue_limit: state.config.sse.queue_limit,
            retry_ms: state.config.sse.retry_ms,
            socket_fd: request
                .conn_data::<ConnectionSocket>()
                .map(|socket| socket.0),
        },
        state.router_link(),
        state.backend.clone(),
        state.metrics.clone(),
        state.hub.clone(),
    )
    .await
    .map_err(|_| ApiError::BackendUnavailable("the hub could not register the stream".into()))?;
    // A drain that started while we registered may have taken its list of connections before us:
    // refuse instead of leaving an open stream the drain does not know about.
    if state.hub.is_draining() {
        control.do_send(Close::now(CloseReason::Drain));
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
