//! Certificates for TLS tests, made when a test runs (nothing checked in can expire): a private
//! CA ([`TestPki`]) that signs server certificates for loopback names and client certificates for
//! mutual TLS, all written as PEM files into a temporary directory removed with the PKI.
//!
//! A second, unrelated [`TestPki`] is the CA a client must refuse. Also the harness's HTTPS
//! client: [`connect`], [`try_https_request`] and [`https_request`], verified against a CA file.

use std::{
    io,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use super::http::{self, HttpResponse};

/// The names every server certificate of the harness is valid for: servers listen on loopback.
pub const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// A certificate and its private key as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A private certificate authority with its files in a temporary directory.
pub struct TestPki {
    dir: PathBuf,
    issuer: Issuer<'static, KeyPair>,
    ca_file: PathBuf,
    issued: usize,
}

impl TestPki {
    /// A new CA named `name` (its subject's common name).
    pub fn new(name: &str) -> TestPki {
        let dir = super::unique_temp_dir("pki");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("self-signed CA");
        let ca_pem = cert.pem();
        let ca_file = dir.join("ca.pem");
        std::fs::write(&ca_file, &ca_pem).expect("write CA");
        TestPki {
            dir,
            issuer: Issuer::new(params, key),
            ca_file,
            issued: 0,
        }
    }

    /// The CA certificate as a PEM file: what a client trusts.
    pub fn ca_file(&self) -> &Path {
        &self.ca_file
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A server certificate for the loopback names ([`LOOPBACK_NAMES`]).
    pub fn server_cert(&mut self) -> CertFiles {
        self.server_cert_for(&LOOPBACK_NAMES)
    }

    /// A server certificate for `names` (DNS names or IP addresses).
    pub fn server_cert_for(&mut self, names: &[&str]) -> CertFiles {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("server params");
        params.distinguished_name.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("server"),
        );
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue("server", params)
    }

    /// A client certificate for mutual TLS with common name `name`.
    pub fn client_cert(&mut self, name: &str) -> CertFiles {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("client params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue("client", params)
    }

    /// A certificate usable both ways (a server that is also a client of its peers, like the
    /// nodes of a Redis Cluster talking over their bus).
    pub fn peer_cert(&mut self) -> CertFiles {
        self.peer_cert_for(&LOOPBACK_NAMES)
    }

    /// A certificate usable both ways for `names` only (e.g. a host name without the loopback
    /// IPs, which a client must then not verify against).
    pub fn peer_cert_for(&mut self, names: &[&str]) -> CertFiles {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("peer params");
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.issue("peer", params)
    }

    fn issue(&mut self, kind: &str, params: CertificateParams) -> CertFiles {
        self.issued += 1;
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        let stem = format!("{kind}-{}", self.issued);
        let files = CertFiles {
            cert: self.dir.join(format!("{stem}.pem")),
            key: self.dir.join(format!("{stem}-key.pem")),
        };
        std::fs::write(&files.cert, cert.pem()).expect("write cert");
        std::fs::write(&files.key, key.serialize_pem()).expect("write key");
        files
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A TLS client that trusts only the CA in `ca_file`.
pub fn connector(ca_file: &Path) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject;
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca_file).expect("read CA") {
        roots.add(cert.expect("CA PEM")).expect("add CA");
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// A TLS connection to `addr` (a loopback address the certificates name), verified with `ca_file`.
pub async fn connect(
    addr: SocketAddr,
    ca_file: &Path,
) -> io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    connector(ca_file).connect(name, tcp).await
}

/// [`http::try_request`] over TLS.
pub async fn try_https_request(
    addr: SocketAddr,
    ca_file: &Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> io::Result<HttpResponse> {
    let exchange = async {
        let stream = connect(addr, ca_file).await?;
        http::exchange(stream, addr, method, path, headers, body).await
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no answer over TLS",
            ))
        })
}

/// [`try_https_request`] with the harness timeout, panicking on failure.
pub async fn https_request(
    addr: SocketAddr,
    ca_file: &Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> HttpResponse {
    try_https_request(
        addr,
        ca_file,
        method,
        path,
        headers,
        body,
        super::IO_TIMEOUT,
    )
    .await
    .unwrap_or_else(|e| panic!("HTTPS {method} {path} to {addr} failed: {e}"))
}
