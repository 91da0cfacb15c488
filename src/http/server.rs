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
//! Stop: the [`StopHandle`] of [`Server::handle`] ends the accept loops (the socket closes when the last loop has
//! dropped it), tells the open connections' dispatchers to finish (idle keep-alive connections
//! close at once), waits up to [`STOP_TIMEOUT`] for them, then stops the worker arbiters.
//! [`Server::stopped`] resolves when every worker has.

use std::{
    cell::{Cell, RefCell},
    future::Future,
    io,
    net::{SocketAddr, TcpListener},
    os::fd::{AsRawFd, RawFd},
    pin::Pin,
    rc::Rc,
    task::{Context, Poll, Waker},
    time::Duration,
};

use actix_http::{error::DispatchError, Protocol};
use actix_rt::{net::TcpStream, Arbiter};
use actix_service::{map_config, IntoServiceFactory, Service, ServiceFactory, ServiceFactoryExt};
use actix_web::{dev::AppConfig, App};
use slab::Slab;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::{mpsc, watch, Notify},
};
use tokio_rustls::server::TlsStream;

use super::{configure, cors, tls::HttpsListener, AppState};
use crate::{
    stop::{sleep_or_stop, StopHandle},
    stream::ConnectionSocket,
};

/// How long a stop waits for requests in flight. SSE responses never finish on their own; the
/// drain has closed them before the server stops, so waiting longer would only delay the exit.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest TLS handshake: as long as a client may take to send its request head.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Pause after an accept failed for want of file descriptors or memory: retrying at once would
/// spin on the same error while the listen queue waits either way.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(500);

/// A running server: its worker threads, until they have stopped.
pub struct Server {
    handle: StopHandle,
    workers_running: mpsc::Receiver<()>,
}

impl Server {
    /// Starts `workers` arbiters that accept from `listener` (already bound and listening),
    /// serving HTTPS when `https` is given.
    pub fn start(
        listener: TcpListener,
        workers: usize,
        state: AppState,
        https: Option<HttpsListener>,
    ) -> io::Result<Self> {
        let address = listener.local_addr()?;
        let (handle, stop_requested) = StopHandle::new();
        let (worker_running, workers_running) = mpsc::channel(1);
        for index in 0..workers.max(1) {
            let listener = listener.try_clone()?;
            let state = state.clone();
            let stop_requested = stop_requested.clone();
            let worker_running = worker_running.clone();
            let https = https.clone();
            let arbiter = Arbiter::new();
            let handle = arbiter.handle();
            // The service and its connections are not `Send`: they are built on the worker's
            // own thread and stay there.
            arbiter.spawn_fn(move || {
                actix_rt::spawn(async move {
                    if let Err(error) = serve(listener, address, state, stop_requested, https).await
                    {
                        log::error!("HTTP worker {index} failed: {error}");
                    }
                    handle.stop();
                    // Dropping the last sender resolves `Server::stopped`.
                    drop(worker_running);
                });
            });
        }
        Ok(Self {
            handle,
            workers_running,
        })
    }

    /// Stops the server.
    pub fn handle(&self) -> StopHandle {
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
    https: Option<HttpsListener>,
) -> io::Result<()> {
    let listener = actix_rt::net::TcpListener::from_std(listener)?;
    let worker_stop = Rc::new(WorkerStop::default());
    let open = Rc::new(OpenConnections::default());
    match https {
        None => {
            let service = build::<TcpStream>(state, address, &worker_stop).await?;
            accept_until_stopped(&listener, &mut stop_requested, |stream, peer| {
                let service = service.clone();
                let guard = open.enter();
                actix_rt::spawn(async move {
                    // A failed connection (reset, bad request) is the client's affair; the
                    // dispatcher has answered what it could.
                    let _ = service.call((stream, Protocol::Http1, Some(peer))).await;
                    drop(guard);
                });
            })
            .await;
        }
        Some(https) => {
            let tls_buffer = state.config.sse.send_buffer;
            let service = build::<TlsStream<TcpStream>>(state, address, &worker_stop).await?;
            accept_until_stopped(&listener, &mut stop_requested, |stream, peer| {
                let service = service.clone();
                let guard = open.enter();
                let handshake = https.acceptor.accept(stream);
                actix_rt::spawn(async move {
                    match actix_rt::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                        Ok(Ok(mut stream)) => {
                            // What rustls holds back, encrypted, on top of the kernel's send
                            // buffer: capped alike, so a client that stops reading fills its
                            // queue and is evicted instead of parking bytes here.
                            if tls_buffer > 0 {
                                stream.get_mut().1.set_buffer_limit(Some(tls_buffer));
                            }
                            let _ = service.call((stream, Protocol::Http1, Some(peer))).await;
                        }
                        Ok(Err(error)) => log::debug!("TLS handshake with {peer} failed: {error}"),
                        Err(_) => log::debug!(
                            "TLS handshake with {peer} not done within {HANDSHAKE_TIMEOUT:?}"
                        ),
                    }
                    drop(guard);
                });
            })
            .await;
        }
    }
    // No more connections from here on: the socket closes once every worker has let go of it.
    drop(listener);
    worker_stop.stop();
    if actix_rt::time::timeout(STOP_TIMEOUT, open.all_closed())
        .await
        .is_err()
    {
        log::warn!(
            "{} connections still open {STOP_TIMEOUT:?} after the stop; closing them",
            open.count.get()
        );
    }
    Ok(())
}

/// A worker's HTTP service for connections of type `Io`.
async fn build<Io: TcpConnection>(
    state: AppState,
    address: SocketAddr,
    worker_stop: &Rc<WorkerStop>,
) -> io::Result<Rc<impl Service<(Io, Protocol, Option<SocketAddr>)>>> {
    let service = http_service::<Io>(state, address, worker_stop.clone())
        .new_service(())
        .await
        .map_err(|()| io::Error::other("cannot build the HTTP service"))?;
    Ok(Rc::new(service))
}

/// Hands each accepted connection to `serve` until the stop.
async fn accept_until_stopped(
    listener: &actix_rt::net::TcpListener,
    stop_requested: &mut watch::Receiver<bool>,
    mut serve: impl FnMut(TcpStream, SocketAddr),
) {
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stop_requested.wait_for(|stop| *stop) => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => serve(stream, peer),
            // A connection that failed before we took it (reset, aborted) concerns its client only.
            Err(error) if !is_resource_shortage(&error) => {
                log::debug!("a connection failed before it was accepted: {error}");
            }
            Err(error) => {
                log::error!("cannot accept a connection: {error}");
                if sleep_or_stop(ACCEPT_ERROR_PAUSE, stop_requested).await {
                    break;
                }
            }
        }
    }
}

/// Out of descriptors or memory: accepting again at once would fail the same way.
pub fn is_resource_shortage(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// The HTTP service of one worker. Its dispatchers finish (an idle keep-alive connection closes,
/// a request in flight is answered first) once `worker_stop` has stopped, also those of
/// connections accepted just before the stop whose dispatchers look for the first time after it.
fn http_service<Io: TcpConnection>(
    state: AppState,
    address: SocketAddr,
    worker_stop: Rc<WorkerStop>,
) -> impl ServiceFactory<
    (Io, Protocol, Option<SocketAddr>),
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
        .graceful_shutdown_signal(move || worker_stop.signal())
        .on_connect_ext(|stream: &Io, extensions| {
            extensions.insert(ConnectionSocket(stream.tcp_fd()));
        })
        // actix-web keeps `AppConfig::new` to itself; the default's host and address only serve
        // `ConnectionInfo` for requests without a Host header and `url_for`, neither used here.
        // The peer address comes with the accepted socket, so actix-http's `tcp()` wrapper (one
        // more `getpeername` per connection) is left out.
        .finish(map_config(app, |()| AppConfig::default()))
}

/// A connection the server serves: plain TCP, or TLS over it. The TCP socket underneath is what
/// a stream's control cuts off (`stream::ConnectionSocket`).
trait TcpConnection: AsyncRead + AsyncWrite + Unpin + 'static {
    fn tcp_fd(&self) -> RawFd;
}

impl TcpConnection for TcpStream {
    fn tcp_fd(&self) -> RawFd {
        self.as_raw_fd()
    }
}

impl TcpConnection for TlsStream<TcpStream> {
    fn tcp_fd(&self) -> RawFd {
        self.get_ref().0.as_raw_fd()
    }
}

/// A worker's stop as its connections' dispatchers see it.
///
/// actix-http polls a connection's shutdown signal every time it polls the connection, so on a
/// stream once per event written. A `watch::Receiver::wait_for` there touched three separate
/// pieces of memory per poll (the boxed future, the receiver, its `Notified`), each a likely
/// cache miss with 10,000 streams; a [`StopSignal`] touches its own box and this shared state,
/// which every connection of the worker reads and nothing writes until the stop.
#[derive(Default)]
struct WorkerStop {
    stopped: Cell<bool>,
    waiting: RefCell<Slab<Waker>>,
}

impl WorkerStop {
    fn stop(&self) {
        self.stopped.set(true);
        let waiting = std::mem::take(&mut *self.waiting.borrow_mut());
        for (_, waker) in waiting {
            waker.wake();
        }
    }

    fn signal(self: &Rc<Self>) -> StopSignal {
        StopSignal {
            worker: self.clone(),
            registered: None,
        }
    }
}

/// Resolves when its worker stops.
struct StopSignal {
    worker: Rc<WorkerStop>,
    /// The waker this signal left with the worker, and its key there. Kept here too, so that
    /// the poll of every event compares against the signal's own memory, not the shared slab.
    registered: Option<(usize, Waker)>,
}

impl Future for StopSignal {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.worker.stopped.get() {
            return Poll::Ready(());
        }
        match &mut this.registered {
            Some((_, waker)) if waker.will_wake(cx.waker()) => {}
            Some((key, waker)) => {
                waker.clone_from(cx.waker());
                this.worker.waiting.borrow_mut()[*key] = cx.waker().clone();
            }
            None => {
                let key = this.worker.waiting.borrow_mut().insert(cx.waker().clone());
                this.registered = Some((key, cx.waker().clone()));
            }
        }
        Poll::Pending
    }
}

impl Drop for StopSignal {
    fn drop(&mut self) {
        // After the stop the worker's list is empty already.
        if let Some((key, _)) = self.registered.take() {
            if !self.worker.stopped.get() {
                self.worker.waiting.borrow_mut().remove(key);
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            atomic::{AtomicUsize, Ordering},
            Arc,
        },
        task::Wake,
    };

    use super::*;

    #[derive(Default)]
    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn poll(signal: &mut StopSignal, waker: &Waker) -> Poll<()> {
        Pin::new(signal).poll(&mut Context::from_waker(waker))
    }

    #[test]
    fn stop_signal_wakes_the_latest_waker_of_each_waiting_signal_once() {
        let worker = Rc::new(WorkerStop::default());
        let (first, second) = (
            Arc::new(CountingWaker::default()),
            Arc::new(CountingWaker::default()),
        );
        let (first_waker, second_waker) = (Waker::from(first.clone()), Waker::from(second.clone()));

        let mut waiting = worker.signal();
        assert_eq!(poll(&mut waiting, &first_waker), Poll::Pending);
        assert_eq!(poll(&mut waiting, &first_waker), Poll::Pending);
        assert_eq!(
            worker.waiting.borrow().len(),
            1,
            "polled twice, registered once"
        );

        let mut closed_early = worker.signal();
        assert_eq!(poll(&mut closed_early, &first_waker), Poll::Pending);
        assert_eq!(worker.waiting.borrow().len(), 2);
        drop(closed_early);
        assert_eq!(
            worker.waiting.borrow().len(),
            1,
            "a dropped signal leaves nothing behind"
        );

        // Polled by another task now: the stop must wake that one.
        assert_eq!(poll(&mut waiting, &second_waker), Poll::Pending);
        assert_eq!(worker.waiting.borrow().len(), 1);

        worker.stop();
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
        assert_eq!(poll(&mut waiting, &second_waker), Poll::Ready(()));
        assert_eq!(poll(&mut worker.signal(), &first_waker), Poll::Ready(()));
        drop(waiting);
        assert!(worker.waiting.borrow().is_empty());
    }
}
