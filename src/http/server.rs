//! The HTTP server: every worker thread accepts from the one listening socket itself.
//!
//! Why not actix-web's `HttpServer`: its actix-server runs a separate accept thread that hands
//! each accepted socket to a worker through a channel and wakes it. On a reconnect storm that is
//! a thread switch or two per connection on top of the work itself (docs/BENCHMARKS.md,
//! "Connection acceptance: accept loops in the workers, registrations in batches"). Here each
//! worker is an arbiter whose event loop polls the shared listener, like nginx's workers:
//! whichever worker is idle takes the next connection, and the connection is served on the
//! thread that accepted it.
//!
//! Stop: [`ServerHandle::stop`] ends the accept loops (the socket closes when the last loop has
//! dropped it), tells the open connections' dispatchers to finish (idle keep-alive connections
//! close at once), waits up to [`STOP_TIMEOUT`] for them, then stops the worker arbiters.
//! [`Server::stopped`] resolves when every worker has.

use std::{
    cell::Cell,
    io,
    net::{SocketAddr, TcpListener},
    os::fd::AsRawFd,
    rc::Rc,
    time::Duration,
};

use actix_http::{error::DispatchError, Protocol};
use actix_rt::{net::TcpStream, Arbiter};
use actix_service::{map_config, IntoServiceFactory, Service, ServiceFactory, ServiceFactoryExt};
use actix_web::{dev::AppConfig, App};
use tokio::sync::{mpsc, watch, Notify};

use super::{configure, cors, AppState};
use crate::{sse::control::ConnectionSocket, stop::sleep_or_stop};

/// How long a stop waits for requests in flight. SSE responses never finish on their own; the
/// drain has closed them before the server stops, so waiting longer would only delay the exit.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// Pause after an accept failed for want of file descriptors or memory: retrying at once would
/// spin on the same error while the listen queue waits either way.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(500);

/// A running server: its worker threads, until they have stopped.
pub struct Server {
    handle: ServerHandle,
    workers_running: mpsc::Receiver<()>,
}

/// Stops a [`Server`]; cheap to clone.
#[derive(Clone)]
pub struct ServerHandle {
    stop: watch::Sender<bool>,
}

impl ServerHandle {
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }
}

impl Server {
    /// Starts `workers` arbiters that accept from `listener` (already bound and listening).
    pub fn start(listener: TcpListener, workers: usize, state: AppState) -> io::Result<Self> {
        let address = listener.local_addr()?;
        let (stop, stop_requested) = watch::channel(false);
        let (worker_running, workers_running) = mpsc::channel(1);
        for index in 0..workers.max(1) {
            let listener = listener.try_clone()?;
            let state = state.clone();
            let stop_requested = stop_requested.clone();
            let worker_running = worker_running.clone();
            let arbiter = Arbiter::new();
            let handle = arbiter.handle();
            // The service and its connections are not `Send`: they are built on the worker's
            // own thread and stay there.
            arbiter.spawn_fn(move || {
                actix_rt::spawn(async move {
                    if let Err(error) = serve(listener, address, state, stop_requested).await {
                        log::error!("HTTP worker {index} failed: {error}");
                    }
                    handle.stop();
                    // Dropping the last sender resolves `Server::stopped`.
                    drop(worker_running);
                });
            });
        }
        Ok(Self {
            handle: ServerHandle { stop },
            workers_running,
        })
    }

    pub fn handle(&self) -> ServerHandle {
        self.handle.clone()
    }

    /// Resolves when every worker has stopped.
    pub async fn stopped(mut self) {
        while self.workers_running.recv().await.is_some() {}
    }
}

/// One worker: accepts until asked to stop, then gives the open connections [`STOP_TIMEOUT`].
async fn serve(
    listener: TcpListener,
    address: SocketAddr,
    state: AppState,
    mut stop_requested: watch::Receiver<bool>,
) -> io::Result<()> {
    let listener = actix_rt::net::TcpListener::from_std(listener)?;
    let service = Rc::new(
        http_service(state, address, stop_requested.clone())
            .new_service(())
            .await
            .map_err(|()| io::Error::other("cannot build the HTTP service"))?,
    );
    let open = Rc::new(OpenConnections::default());
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stop_requested.wait_for(|stop| *stop) => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let service = service.clone();
                let guard = open.enter();
                actix_rt::spawn(async move {
                    // A failed connection (reset, bad request) is the client's affair; the
                    // dispatcher has answered what it could.
                    let _ = service.call((stream, Protocol::Http1, Some(peer))).await;
                    drop(guard);
                });
            }
            // A connection that failed before we took it (reset, aborted) concerns its client only.
            Err(error) if !is_resource_shortage(&error) => {
                log::debug!("a connection failed before it was accepted: {error}");
            }
            Err(error) => {
                log::error!("cannot accept a connection: {error}");
                if sleep_or_stop(ACCEPT_ERROR_PAUSE, &mut stop_requested).await {
                    break;
                }
            }
        }
    }
    drop(listener);
    let _ = actix_rt::time::timeout(STOP_TIMEOUT, open.all_closed()).await;
    Ok(())
}

/// Out of descriptors or memory: accepting again at once would fail the same way.
pub fn is_resource_shortage(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// The HTTP service of one worker. Its dispatchers finish (an idle keep-alive connection closes,
/// a request in flight is answered first) once `stop_requested` turns true; a `watch` because a
/// connection accepted just before the stop must still see it when its dispatcher first looks.
fn http_service(
    state: AppState,
    address: SocketAddr,
    stop_requested: watch::Receiver<bool>,
) -> impl ServiceFactory<
    (TcpStream, Protocol, Option<SocketAddr>),
    Config = (),
    Response = (),
    Error = DispatchError,
    InitError = (),
> {
    let app = App::new()
        .wrap(cors::CorsHeaders)
        .configure(configure(state))
        .into_factory()
        .map_err(|error| error.error_response());
    actix_http::HttpService::build()
        // actix-web's defaults, which the hub was built and tested with.
        .keep_alive(actix_http::KeepAlive::default())
        .client_request_timeout(Duration::from_secs(5))
        .client_disconnect_timeout(Duration::from_secs(1))
        // A client's FIN must end its stream now, not at the next failed write.
        .h1_allow_half_closed(false)
        .local_addr(address)
        .graceful_shutdown_signal(move || {
            let mut stop_requested = stop_requested.clone();
            async move {
                // An error means the server is gone, which is a stop too.
                let _ = stop_requested.wait_for(|stop| *stop).await;
            }
        })
        .on_connect_ext(|stream: &TcpStream, extensions| {
            extensions.insert(ConnectionSocket(stream.as_raw_fd()));
        })
        // actix-web keeps `AppConfig::new` to itself; the default's host and address only serve
        // `ConnectionInfo` for requests without a Host header and `url_for`, neither used here.
        // The peer address comes with the accepted socket, so actix-http's `tcp()` wrapper (one
        // more `getpeername` per connection) is left out.
        .finish(map_config(app, |()| AppConfig::default()))
}

/// Counts a worker's open connections so that a stop can wait for them.
#[derive(Default)]
struct OpenConnections {
    count: Cell<usize>,
    none_left: Notify,
}

struct OpenGuard(Rc<OpenConnections>);

impl OpenConnections {
    fn enter(self: &Rc<Self>) -> OpenGuard {
        self.count.set(self.count.get() + 1);
        OpenGuard(self.clone())
    }

    async fn all_closed(&self) {
        while self.count.get() > 0 {
            self.none_left.notified().await;
        }
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        let left = self.0.count.get() - 1;
        self.0.count.set(left);
        if left == 0 {
            self.0.none_left.notify_waiters();
        }
    }
}
