//! TLS material from PEM files, for every link of the hub: the HTTPS listener's certificate
//! (`http::tls` keeps it current), and the client side of the connections to Redis and NATS
//! (trusted CAs, a client certificate for mutual TLS).
//!
//! One TLS stack in the binary: rustls with the ring provider, which async-nats and fred use as
//! well, so no second crypto library is compiled in and every link accepts the same protocol
//! versions (TLS 1.2 and 1.3) and cipher suites. docs/security.md, "TLS", lists them.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use rustls::{
    crypto::CryptoProvider,
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer},
    sign::CertifiedKey,
    ClientConfig, RootCertStore,
};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} holds no {what} in PEM", path.display())]
    Missing { path: PathBuf, what: &'static str },
    #[error("{} is not valid PEM", path.display())]
    Pem {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("the key in {} cannot sign", path.display())]
    Key {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("the key in {} does not belong to the certificate in {}", key.display(), cert.display())]
    Mismatch { cert: PathBuf, key: PathBuf },
    #[error("no usable certificate authority among the system's ({errors} could not be loaded)")]
    NoSystemRoots { errors: usize },
    #[error("cannot set up TLS")]
    Setup(#[source] rustls::Error),
}

/// The crypto provider of every TLS link.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file, in order (a chain starts with the end-entity certificate).
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certificates = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            path: path.into(),
            source,
        })?;
    if certificates.is_empty() {
        return Err(TlsError::Missing {
            path: path.into(),
            what: "certificate",
        });
    }
    Ok(certificates)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|source| match source {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::Missing {
            path: path.into(),
            what: "private key",
        },
        source => TlsError::Pem {
            path: path.into(),
            source,
        },
    })
}

/// A certificate chain with its key, checked to belong together: a pair caught between two
/// writes of a renewal must be refused, not served.
pub fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = certificates(cert)?;
    let signing_key = provider()
        .key_provider
        .load_private_key(private_key(key)?)
        .map_err(|source| TlsError::Key {
            path: key.into(),
            source,
        })?;
    let certified = CertifiedKey::new(chain, signing_key);
    certified.keys_match().map_err(|_| TlsError::Mismatch {
        cert: cert.into(),
        key: key.into(),
    })?;
    Ok(certified)
}

/// The authorities a client trusts: those of `ca_file`, or the system's when it is `None`.
pub fn root_store(ca_file: Option<&Path>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let (_, unusable) = roots.add_parsable_certificates(certificates(path)?);
            if roots.is_empty() {
                return Err(TlsError::Missing {
                    path: path.into(),
                    what: if unusable > 0 {
                        "usable CA certificate"
                    } else {
                        "certificate"
                    },
                });
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(TlsError::NoSystemRoots {
                    errors: found.errors.len(),
                });
            }
        }
    }
    Ok(roots)
}

/// A TLS client configuration trusting `ca_file` (or the system's authorities), without a
/// client certificate.
pub fn client_config(ca_file: Option<&Path>) -> Result<ClientConfig, TlsError> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Setup)?
        .with_root_certificates(root_store(ca_file)?)
        .with_no_client_auth())
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.into(),
        source,
    })
}
