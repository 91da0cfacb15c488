//! The HTTP edge (docs/http-api.md): routes, shared state, and the server with its socket settings.

pub mod auth;
pub mod browser;
pub mod console;
pub mod cors;
pub mod error;
pub mod fleet;
pub mod jwks;
pub mod ops;
pub mod publish;
pub mod server;
pub mod signatures;
pub mod sse;
pub mod tls;

use std::{net::TcpListener, sync::Arc, time::Duration};

use actix::Addr;
use actix_web::{web, HttpRequest};
use socket2::{Domain, Protocol, Socket, TcpKeepalive, Type};

use crate::{
    actors::{
        fleet::Fleet,
        revocations::Revocations,
        router::Router,
        shutdown::{SharedDrainStatus, Shutdown},
        stream_tail::SharedTailStatus,
    },
    backend::{fleet::FleetStore, revocation::Revoked, Backend},
    config::Config,
    metrics::Metrics,
    pod::PodState,
    replay::Replayer,
    stream::StreamOpener,
};

pub use error::ApiError;
pub use server::Server;

/// Everything a request handler may touch. Cloned into each worker.
#[derive(Clone)]
pub struct AppState {
    pub config: Arc<Config>,
    pub backend: Arc<dyn Backend>,
    pub replayer: Arc<Replayer>,
    pub metrics: Arc<Metrics>,
    pub pod: Arc<PodState>,
    pub router: Addr<Router>,
    pub shutdown: Addr<Shutdown>,
    pub tails: Vec<SharedTailStatus>,
    pub drain: SharedDrainStatus,
    pub auth: Arc<auth::Authenticator>,
    /// The fleet API; `None` with `presence.enabled = false`.
    pub fleet: Option<FleetHandle>,
    /// Makes revocations; the pod's view of them is `revoked`.
    pub revocations: Addr<Revocations>,
    pub revoked: Arc<Revoked>,
}

/// The fleet store for reads and acks, and the actor for the fleet event stream.
#[derive(Clone)]
pub struct FleetHandle {
    pub store: Arc<dyn FleetStore>,
    pub actor: Addr<Fleet>,
}

/// The routes of one HTTP worker; called on the worker's own thread, which its
/// [`StreamOpener`] must not leave.
pub fn configure(state: AppState) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        let cors = cors::Cors::new(&state.config.server.cors_origins);
        let opener = StreamOpener::new(
            state.router.clone().recipient(),
            state.replayer.clone(),
            state.metrics.clone(),
            state.pod.clone(),
        );
        cfg.app_data(web::Data::new(state))
            .app_data(web::Data::new(opener))
            .app_data(web::Data::new(cors))
            .app_data(web::QueryConfig::default().error_handler(|error, _| {
                ApiError::InvalidRequest(format!("invalid query string: {error}")).into()
            }))
            // `/v1/devices/{device}/events`, matched without a regular expression (see sse.rs).
            .service(web::scope("/v1/devices").default_service(web::to(sse::devices)))
            .service(
                web::resource("/v1/events")
                    .route(web::post().to(publish::publish))
                    .route(web::method(actix_web::http::Method::OPTIONS).to(cors::preflight))
                    .default_service(web::to(|| method_not_allowed("POST, OPTIONS"))),
            )
            .service(
                web::resource("/v1/fleet/events")
                    .route(web::get().to(fleet::events))
                    .default_service(web::to(|| method_not_allowed("GET"))),
            )
            .service(
                web::resource("/v1/fleet/unacknowledged")
                    .route(web::get().to(
                        |request: HttpRequest, state: web::Data<AppState>| async move {
                            fleet::unacknowledged(&request, &state).await
                        },
                    ))
                    .default_service(web::to(|| method_not_allowed("GET"))),
            )
            .service(web::resource("/healthz").route(web::get().to(ops::healthz)))
            .service(web::resource("/readyz").route(web::get().to(ops::readyz)))
            .service(web::resource("/metrics").route(web::get().to(ops::metrics)))
            .service(web::resource("/admin/status").route(web::get().to(ops::status)))
            .service(web::resource("/admin/drain").route(web::post().to(ops::drain)))
            .service(
                web::resource("/admin/revoke")
                    .route(web::post().to(ops::revoke))
                    .default_service(web::to(|| method_not_allowed("POST"))),
            )
            .service(
                web::resource("/admin/revocations")
                    .route(web::get().to(ops::revocations))
                    .default_service(web::to(|| method_not_allowed("GET"))),
            )
            .service(web::resource("/admin/console").route(web::get().to(console::page)))
            .default_service(web::to(not_found));
    }
}

async fn not_found(_: HttpRequest) -> ApiError {
    ApiError::NotFound
}

pub(crate) async fn method_not_allowed(allow: &'static str) -> actix_web::HttpResponse {
    let mut response = actix_web::ResponseError::error_response(&ApiError::MethodNotAllowed);
    response.headers_mut().insert(
        actix_web::http::header::ALLOW,
        actix_web::http::header::HeaderValue::from_static(allow),
    );
    response
}

impl actix_web::Responder for ApiError {
    type Body = actix_web::body::BoxBody;

    fn respond_to(self, _: &HttpRequest) -> actix_web::HttpResponse {
        actix_web::ResponseError::error_response(&self)
    }
}

/// Starts the HTTP workers on a socket from [`bind`], serving HTTPS with `https`. Signals are
/// ours (the Shutdown actor), not the server's.
pub fn server(
    listener: TcpListener,
    state: AppState,
    https: Option<tls::HttpsListener>,
) -> std::io::Result<Server> {
    let workers = state.config.effective_workers();
    Server::start(listener, workers, state, https)
}

/// The listening socket, with every option an accepted connection needs: Linux copies them to
/// each accepted socket, so they are set once instead of with seven `setsockopt` calls per
/// connection (`listener_options_reach_accepted_sockets` checks the inheritance).
pub fn bind(address: std::net::SocketAddr, send_buffer: usize) -> std::io::Result<TcpListener> {
    let socket = Socket::new(
        Domain::for_address(address),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    // Events must leave at once; the SSE body already coalesces what is queued into one write,
    // so Nagle's algorithm would only add a round trip of delay to a lone event.
    socket.set_tcp_nodelay(true)?;
    // A stalled client must fill our bounded queue, not megabytes of kernel buffer.
    if send_buffer > 0 {
        socket.set_send_buffer_size(send_buffer)?;
    }
    let keepalive = TcpKeepalive::new()
        .with_time(Duration::from_secs(60))
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    socket.set_tcp_keepalive(&keepalive)?;
    // Unacknowledged data for this long means the peer is gone (a pulled cable).
    socket.set_tcp_user_timeout(Some(Duration::from_secs(90)))?;
    socket.bind(&address.into())?;
    socket.listen(4096)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listener_options_reach_accepted_sockets() {
        let listener = bind("127.0.0.1:0".parse().unwrap(), 32768).unwrap();
        listener.set_nonblocking(false).unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let socket = socket2::SockRef::from(&accepted);
        assert!(socket.tcp_nodelay().unwrap());
        // Linux doubles the value it is given, for its own bookkeeping.
        assert_eq!(socket.send_buffer_size().unwrap(), 2 * 32768);
        assert!(socket.keepalive().unwrap());
        assert_eq!(
            socket.tcp_keepalive_time().unwrap(),
            Duration::from_secs(60)
        );
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(10)
        );
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), 3);
        assert_eq!(
            socket.tcp_user_timeout().unwrap(),
            Some(Duration::from_secs(90))
        );
    }
}
