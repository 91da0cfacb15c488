//! Wiring: builds the backend, starts the actors on their own arbiters, runs the HTTP server.
//!
//! The Router and the StreamTails run on dedicated arbiters, never on an HTTP worker: a producer
//! sharing a worker with thousands of connections starves them of coalesced writes (docs/ARCHITECTURE.md, the paragraph on threads).

use std::{io, sync::Arc};

use actix::prelude::*;
use prometheus::Registry;
use thiserror::Error;

use crate::{
    actors::{
        fleet::{Farewell, Fleet},
        revocations::Revocations,
        router::{AttachFleet, Router, TokenRules},
        shutdown::{AttachServer, Shutdown},
        stream_tail::{SharedTailStatus, StreamTail, TailState},
    },
    backend::{
        fleet::{memory::MemoryFleet, FleetSettings, FleetStore},
        memory::MemorySettings,
        nats::{NatsAccess, NatsBackend, NatsSettings},
        redis::{ConnectionSetup, RedisBackend, RedisSettings},
        revocation::{memory::MemoryRevocations, RevocationStore, Revoked},
        Backend, BackendError, MemoryBackend,
    },
    config::{AuthMode, BackendChoice, Config},
    http::{self, AppState, FleetHandle},
    metrics::Metrics,
    pod::PodState,
    replay::Replayer,
    report::Report,
};

#[derive(Debug, Error)]
pub enum ServeError {
    /// The configuration cannot be served (exit code 64, like a configuration error).
    #[error("{0}")]
    Unservable(String),
    #[error("cannot listen on {addr}")]
    Bind {
        addr: std::net::SocketAddr,
        source: io::Error,
    },
    #[error("the drain reached drain.grace with streams still open")]
    DrainForced,
    #[error("cannot load the HTTPS certificate (server.tls_cert_file, server.tls_key_file)")]
    Certificate(#[source] crate::tls::TlsError),
    #[error("cannot start the backend")]
    Backend(#[source] BackendError),
    #[error("the stream tails did not start within {}s (last error: {last_error})", within.as_secs())]
    TailsNotStarted {
        within: std::time::Duration,
        last_error: String,
    },
    #[error("server failed")]
    Io(#[from] io::Error),
}

/// Checks what the typed configuration cannot express on its own: secure defaults.
pub fn check_servable(config: &Config) -> Result<(), ServeError> {
    if config.auth.mode == AuthMode::None && !config.listen_is_loopback() && !config.server.insecure
    {
        return Err(ServeError::Unservable(format!(
            "refusing to listen on {} with auth.mode = none: anyone who can reach it could read every \
             device's events and publish. Listen on a loopback address, enable auth.mode = jwt, or \
             set server.insecure = true (--insecure) if a trusted network or proxy guards it",
            config.server.listen
        )));
    }
    Ok(())
}

/// Reads every file the configuration names (the HTTPS certificate and key, the JWT public key,
/// the backend's TLS and credential files; the JWT secret file is read with the configuration)
/// as `serve` does before it connects, and keeps nothing: what
/// `posthorn config check` adds to the configuration's own validation.
pub fn check_files(config: &Config) -> Result<(), ServeError> {
    if let Some((cert, key)) = config.server.tls_files() {
        crate::tls::certified_key(cert, key).map_err(ServeError::Certificate)?;
    }
    // The JWT public key file and the key set's CA file.
    http::auth::check_files(&config.auth).map_err(ServeError::Unservable)?;
    match config.backend_choice() {
        BackendChoice::Memory(_) => {}
        BackendChoice::Redis(redis) => {
            ConnectionSetup::read(redis)
                .map_err(|error| ServeError::Unservable(Report(&error).to_string()))?;
        }
        BackendChoice::Nats(nats) => {
            NatsAccess::load(nats)
                .map_err(|error| ServeError::Unservable(Report(&error).to_string()))?;
        }
    }
    Ok(())
}

/// Entries per memory tail read: one Router batch, as `redis.count` is for a Redis tail.
const MEMORY_TAIL_BATCH: usize = 500;

/// The backend `build_backend` made: what the hub uses, and the concrete store the fleet store is
/// built on (it shares its connections and their TLS and credentials).
pub enum BuiltBackend {
    Memory(Arc<MemoryBackend>),
    Redis(Arc<RedisBackend>),
    Nats(Arc<NatsBackend>),
}

impl BuiltBackend {
    pub fn shared(&self) -> Arc<dyn Backend> {
        match self {
            BuiltBackend::Memory(backend) => backend.clone(),
            BuiltBackend::Redis(backend) => backend.clone(),
            BuiltBackend::Nats(backend) => backend.clone(),
        }
    }
}

/// Builds the backend `backend.kind` selects: the one place that matches on it.
pub async fn build_backend(config: &Config) -> Result<BuiltBackend, ServeError> {
    let dedupe_window = config.publish.dedupe_window;
    Ok(match config.backend_choice() {
        BackendChoice::Memory(memory) => {
            BuiltBackend::Memory(Arc::new(MemoryBackend::new(MemorySettings {
                shards: memory.shards,
                retention: memory.retention,
                max_len: memory.max_len,
                tail_count: MEMORY_TAIL_BATCH,
                dedupe_window,
            })))
        }
        BackendChoice::Redis(redis) => {
            // A file that cannot be used is a configuration error: stop before connecting.
            let setup = ConnectionSetup::read(redis)
                .map_err(|error| ServeError::Unservable(Report(&error).to_string()))?;
            BuiltBackend::Redis(Arc::new(
                RedisBackend::connect(
                    RedisSettings {
                        redis: redis.clone(),
                        dedupe_window,
                    },
                    &setup,
                )
                .await
                .map_err(ServeError::Backend)?,
            ))
        }
        BackendChoice::Nats(nats) => {
            // A TLS or credentials file that cannot be used is a configuration error (exit 64),
            // found before anything connects.
            let access = NatsAccess::load(nats)
                .map_err(|error| ServeError::Unservable(Report(&error).to_string()))?;
            BuiltBackend::Nats(Arc::new(
                NatsBackend::connect(
                    NatsSettings {
                        nats: nats.clone(),
                        dedupe_window,
                    },
                    access,
                )
                .await
                .map_err(ServeError::Backend)?,
            ))
        }
    })
}

/// The fleet store of the backend `backend.kind` selects; `None` with presence disabled.
async fn build_fleet_store(
    config: &Config,
    backend: &BuiltBackend,
) -> Result<Option<Arc<dyn FleetStore>>, ServeError> {
    if !config.presence.enabled {
        return Ok(None);
    }
    let settings = FleetSettings {
        shards: config.shards(),
        ttl: config.presence.ttl,
        retention: config.presence.retention,
        broadcast_retention: config.backend_choice().retention(),
    };
    Ok(Some(match backend {
        BuiltBackend::Memory(_) => Arc::new(MemoryFleet::new(settings, config.memory.max_len)),
        BuiltBackend::Redis(redis) => {
            Arc::new(redis.fleet(settings).await.map_err(ServeError::Backend)?)
        }
        BuiltBackend::Nats(nats) => {
            Arc::new(nats.fleet(settings).await.map_err(ServeError::Backend)?)
        }
    }))
}

/// The revocation store of the backend `backend.kind` selects (the backend's own connections).
async fn build_revocation_store(
    config: &Config,
    backend: &BuiltBackend,
) -> Result<Arc<dyn RevocationStore>, ServeError> {
    let retention = config.auth.revocation_retention;
    Ok(match backend {
        BuiltBackend::Memory(_) => Arc::new(MemoryRevocations::new(retention)),
        BuiltBackend::Redis(redis) => Arc::new(redis.revocations(retention)),
        BuiltBackend::Nats(nats) => Arc::new(
            nats.revocations(retention)
                .await
                .map_err(ServeError::Backend)?,
        ),
    })
}

/// A random name for this process, so that a pod restarted under the same name does not revive
/// the sessions of its previous life (docs/fleet.md).
fn instance_id() -> String {
    use rand::Rng;
    format!("{:016x}", rand::rng().random::<u64>())
}

/// Runs the hub until it has drained (SIGTERM, SIGINT, `POST /admin/drain`).
pub fn serve(config: Config) -> Result<(), ServeError> {
    check_servable(&config)?;
    // Every stream is a file descriptor; a soft limit of 1024 would cap the pod at ~1,000 streams.
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => log::info!("open files limit: {limit}"),
        Err(error) => log::warn!("cannot raise the open files limit: {error}"),
    }
    let config = Arc::new(config);
    // Before the backend: a certificate that does not load is a mistake to report at once.
    let https = config
        .server
        .tls_files()
        .map(|(cert, key)| http::tls::HttpsListener::new(cert, key))
        .transpose()
        .map_err(ServeError::Certificate)?;
    System::new().block_on(async move {
        let built = build_backend(&config).await?;
        let backend = built.shared();
        let metrics = Arc::new(Metrics::new(Registry::new(), backend.kind()));
        let groups = backend.groups();
        metrics.init_groups(groups.len());
        let pod = Arc::new(PodState::default());

        // Before anything is served: a pod restarted after a revocation refuses the old tokens
        // from its first request.
        let revoked = Revoked::new();
        let revocation_store = build_revocation_store(&config, &built).await?;
        let revocations_read = Revocations::load(&*revocation_store, &revoked)
            .await
            .map_err(ServeError::Backend)?;

        let router_arbiter = Arbiter::new();
        let (shards, heartbeat, stall_timeout, router_metrics) = (
            backend.shards(),
            config.sse.heartbeat,
            config.sse.stall_timeout,
            metrics.clone(),
        );
        let tokens = TokenRules {
            leeway: config.auth.leeway,
            revoked: revoked.clone(),
        };
        let router = Router::start_in_arbiter(&router_arbiter.handle(), move |_| {
            Router::new(shards, heartbeat, stall_timeout, router_metrics, tokens)
        });
        let revocations = Revocations::new(
            revocation_store,
            revoked.clone(),
            router.clone().recipient(),
            config.auth.revocation_retention,
            revocations_read,
            metrics.clone(),
        )
        .start();

        let tail_arbiter = Arbiter::new();
        let retention = config.backend_choice().retention();
        let mut tail_statuses = Vec::new();
        let mut tail_stops = Vec::new();
        for group in 0..groups.len() {
            let tail = StreamTail::new(
                group,
                backend.clone(),
                router.clone().recipient(),
                metrics.clone(),
                retention,
            );
            tail_statuses.push(tail.status());
            let address = StreamTail::start_in_arbiter(&tail_arbiter.handle(), move |_| tail);
            tail_stops.push(address.recipient());
        }

        let fleet_store = build_fleet_store(&config, &built).await?;
        let fleet_arbiter = Arbiter::new();
        let fleet = fleet_store.map(|store| {
            let instance = instance_id();
            let (actor_store, actor_router, actor_metrics, presence) = (
                store.clone(),
                router.clone().recipient(),
                metrics.clone(),
                config.presence.clone(),
            );
            let actor_instance = instance.clone();
            let actor = Fleet::start_in_arbiter(&fleet_arbiter.handle(), move |_| {
                Fleet::new(
                    actor_store,
                    actor_router,
                    actor_metrics,
                    presence,
                    shards,
                    actor_instance,
                )
            });
            router.do_send(AttachFleet {
                fleet: actor.clone().recipient(),
                instance,
            });
            FleetHandle { store, actor }
        });

        // Serve only once every tail reads: a stream registered before its tail has fixed its
        // starting point could miss events appended in between.
        wait_for_tails(&tail_statuses).await?;

        let shutdown = Shutdown::new(
            pod.clone(),
            router.clone().recipient(),
            tail_stops,
            config.drain.clone(),
            metrics.clone(),
        );
        let drain_status = shutdown.status();
        let shutdown = shutdown.start();

        let auth = Arc::new(
            crate::http::auth::Authenticator::new(
                &config.auth,
                &config.server,
                revoked.clone(),
                metrics.clone(),
            )
            .await
            .map_err(ServeError::Unservable)?,
        );
        let replayer = Arc::new(Replayer::new(
            backend.clone(),
            metrics.clone(),
            config.replay.max_concurrent,
            config.replay.cache_entries,
            config.sse.stall_timeout,
            config.sse.heartbeat,
        ));
        let state = AppState {
            config: config.clone(),
            backend,
            replayer,
            metrics,
            pod: pod.clone(),
            router,
            shutdown: shutdown.clone(),
            tails: tail_statuses,
            drain: drain_status,
            auth,
            fleet: fleet.clone(),
            revocations,
            revoked,
        };
        http::ops::watch_readiness(state.clone());
        let bind_error = |source| ServeError::Bind {
            addr: config.server.listen,
            source,
        };
        let listener =
            http::bind(config.server.listen, config.sse.send_buffer).map_err(bind_error)?;
        // Written before the workers start, so that nobody is answered by a hub that has not
        // said where it listens yet.
        log::info!(
            "posthorn {} listening on {}://{} (backend {}, {} workers)",
            env!("CARGO_PKG_VERSION"),
            if https.is_some() { "https" } else { "http" },
            config.server.listen,
            config.backend.kind.as_str(),
            config.effective_workers()
        );
        let server = http::server(listener, state, https.clone()).map_err(bind_error)?;
        shutdown.do_send(AttachServer(server.handle()));
        if let Some(https) = &https {
            https.spawn_reloader();
        }
        server.stopped().await;
        if let Some(fleet) = &fleet {
            // The last presence writes, and the word that this instance is gone, so that its
            // devices show offline now rather than after presence.ttl.
            let farewell = fleet.actor.send(Farewell);
            if tokio::time::timeout(FAREWELL_TIMEOUT, farewell)
                .await
                .is_err()
            {
                log::warn!("presence: the farewell did not reach the backend in time");
            }
        }
        fleet_arbiter.stop();
        router_arbiter.stop();
        if pod.drain_was_forced() {
            tail_arbiter.stop();
            return Err(ServeError::DrainForced);
        }
        tail_arbiter.stop();
        log::info!("posthorn stopped");
        Ok(())
    })
}

/// Longest wait at exit for the last presence writes.
const FAREWELL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Longest wait at start-up for the tails to open.
const TAILS_START_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

async fn wait_for_tails(statuses: &[SharedTailStatus]) -> Result<(), ServeError> {
    let deadline = tokio::time::Instant::now() + TAILS_START_TIMEOUT;
    loop {
        let started = statuses.iter().all(|status| {
            status.lock().unwrap_or_else(|p| p.into_inner()).state == TailState::Running
        });
        if started {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            let last_error = statuses
                .iter()
                .find_map(|status| {
                    status
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .last_error
                        .clone()
                })
                .unwrap_or_else(|| "none".into());
            return Err(ServeError::TailsNotStarted {
                within: TAILS_START_TIMEOUT,
                last_error,
            });
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
