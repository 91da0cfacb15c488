//! Certificates for TLS tests, made when a test runs (nothing checked in can expire): a private
//! CA ([`TestPki`]) that signs server certificates for loopback names and client certificates for
//! mutual TLS, all written as PEM files into a temporary directory removed with the PKI.
//!
//! A second, unrelated [`TestPki`] is the CA a client must refuse.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

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
    ca_pem: String,
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
            ca_pem,
            issued: 0,
        }
    }

    /// The CA certificate as a PEM file: what a client trusts.
    pub fn ca_file(&self) -> &Path {
        &self.ca_file
    }

    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
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
