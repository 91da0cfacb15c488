//! HTTPS: the listener's certificate, kept current without a restart (docs/operations.md, "TLS").
//!
//! Owns the certificate every new handshake presents ([`CertStore`]). The reloader task re-reads
//! `server.tls_cert_file` and `server.tls_key_file` when either changes (checked every
//! [`POLL_INTERVAL`]) and on SIGHUP. A new pair replaces the old one for the next handshakes
//! only: open streams keep the session they have. A pair that does not load (unreadable, not
//! PEM, a key of another certificate: a renewal caught between its two writes) is logged and the
//! old one kept; the next change tries again.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::{Duration, SystemTime},
};

use rustls::{server::ClientHello, sign::CertifiedKey, ServerConfig};
use tokio_rustls::TlsAcceptor;

use crate::{
    report::Report,
    tls::{self, TlsError},
};

/// How often the files are looked at: a renewal is served within this.
pub const POLL_INTERVAL: Duration = Duration::from_secs(5);

/// The certificate the next handshake presents.
#[derive(Debug)]
pub struct CertStore {
    current: RwLock<Arc<CertifiedKey>>,
}

impl rustls::server::ResolvesServerCert for CertStore {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // A poisoned lock only means a writer panicked between two complete values.
        Some(match self.current.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        })
    }
}

impl CertStore {
    fn replace(&self, key: CertifiedKey) {
        let key = Arc::new(key);
        match self.current.write() {
            Ok(mut current) => *current = key,
            Err(poisoned) => *poisoned.into_inner() = key,
        }
    }
}

/// The HTTPS side of the listener: a certificate store and the acceptor that uses it.
#[derive(Clone)]
pub struct HttpsListener {
    pub acceptor: TlsAcceptor,
    store: Arc<CertStore>,
    files: Arc<(PathBuf, PathBuf)>,
}

impl HttpsListener {
    /// Loads the pair once; start-up fails on a pair that does not load.
    pub fn new(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let store = Arc::new(CertStore {
            current: RwLock::new(Arc::new(tls::certified_key(cert, key)?)),
        });
        let mut config = ServerConfig::builder_with_provider(tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Setup)?
            .with_no_client_auth()
            .with_cert_resolver(store.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        // Stateless session tickets: a terminal that reconnects to the same pod resumes without
        // the certificate signature, and the pod keeps no per-client session cache for it.
        config.ticketer = rustls::crypto::ring::Ticketer::new().map_err(TlsError::Setup)?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            store,
            files: Arc::new((cert.to_path_buf(), key.to_path_buf())),
        })
    }

    /// Re-reads the pair now; on failure the current one stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let (cert, key) = &*self.files;
        self.store.replace(tls::certified_key(cert, key)?);
        Ok(())
    }

    /// Reloads on SIGHUP and when the files change, for as long as the calling arbiter runs.
    pub fn spawn_reloader(&self) {
        let listener = self.clone();
        actix_rt::spawn(async move {
            let mut hangups = match tokio::signal::unix::signal(
                tokio::signal::unix::SignalKind::hangup(),
            ) {
                Ok(signal) => Some(signal),
                Err(error) => {
                    log::warn!("cannot listen for SIGHUP, the certificate reloads on file changes only: {error}");
                    None
                }
            };
            let mut seen = listener.stamp();
            let mut poll = tokio::time::interval(POLL_INTERVAL);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let cause = tokio::select! {
                    Some(()) = async { match hangups.as_mut() { Some(h) => h.recv().await, None => None } } => "SIGHUP",
                    _ = poll.tick() => {
                        let now = listener.stamp();
                        if now == seen {
                            continue;
                        }
                        seen = now;
                        "a change of the files"
                    }
                };
                let (cert, key) = &*listener.files;
                match listener.reload() {
                    Ok(()) => log::info!(
                        "TLS certificate reloaded from {} and {} after {cause}",
                        cert.display(),
                        key.display()
                    ),
                    Err(error) => log::error!(
                        "TLS certificate not reloaded after {cause}, the previous one stays in use: {}",
                        Report(&error)
                    ),
                }
            }
        });
    }

    /// What changes when either file is rewritten or replaced (a Kubernetes Secret volume swaps
    /// a symlink; `metadata` follows it).
    fn stamp(&self) -> [Option<(SystemTime, u64, u64)>; 2] {
        let (cert, key) = &*self.files;
        [cert, key].map(|path| {
            use std::os::unix::fs::MetadataExt;
            let meta = std::fs::metadata(path).ok()?;
            Some((meta.modified().ok()?, meta.len(), meta.ino()))
        })
    }
}
