//! How token signatures are verified: jsonwebtoken's RustCrypto provider, with RS256 and ES256
//! verified through ring instead.
//!
//! Why: every stream checks a token, so a reconnect storm verifies one signature per stream. The
//! RustCrypto provider rebuilds the RSA key and runs its exponentiation in portable code: a
//! storm of 10,000 streams with RS256 tokens from a key set cost the hub 219 µs of CPU per
//! accepted stream against 56 µs with HS256 (docs/BENCHMARKS.md, "Identity"). ring, already in
//! the binary for TLS, verifies the same signatures in a fraction of that. HMAC, EdDSA and the
//! rarer algorithms stay with RustCrypto, as does all signing (`posthorn token`, the tests).

use std::sync::{LazyLock, Once};

use jsonwebtoken::{
    crypto::{rust_crypto, CryptoProvider, JwtVerifier},
    errors::Error,
    Algorithm, DecodingKey, DecodingKeyKind,
};
use ring::signature::{self as ring_signature, RsaPublicKeyComponents, UnparsedPublicKey};

/// The provider the hub installs once per process: RustCrypto's, but for its verifiers.
static PROVIDER: LazyLock<CryptoProvider> = LazyLock::new(|| CryptoProvider {
    verifier_factory: verifier,
    ..rust_crypto::DEFAULT_PROVIDER.clone()
});

/// Installs the provider for the process (the first call; later ones do nothing).
pub fn install() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        // Only fails when a provider is installed already, which is the same outcome.
        let _ = LazyLock::force(&PROVIDER).install_default();
    });
}

fn verifier(algorithm: &Algorithm, key: &DecodingKey) -> Result<Box<dyn JwtVerifier>, Error> {
    match algorithm {
        Algorithm::RS256 | Algorithm::ES256 => Ok(Box::new(RingVerifier {
            algorithm: *algorithm,
            key: key.kind().clone(),
        })),
        _ => (rust_crypto::DEFAULT_PROVIDER.verifier_factory)(algorithm, key),
    }
}

/// An RS256 or ES256 public key, verified by ring.
struct RingVerifier {
    algorithm: Algorithm,
    key: DecodingKeyKind,
}

impl signature::Verifier<Vec<u8>> for RingVerifier {
    fn verify(&self, message: &[u8], signature: &Vec<u8>) -> Result<(), signature::Error> {
        let verified = match (self.algorithm, &self.key) {
            // From a key set's `n` and `e`.
            (Algorithm::RS256, DecodingKeyKind::RsaModulusExponent { n, e }) => {
                RsaPublicKeyComponents { n, e }.verify(
                    &ring_signature::RSA_PKCS1_2048_8192_SHA256,
                    message,
                    signature,
                )
            }
            // From a PEM file: the PKCS#1 `RSAPublicKey`.
            (Algorithm::RS256, DecodingKeyKind::SecretOrDer(der)) => {
                UnparsedPublicKey::new(&ring_signature::RSA_PKCS1_2048_8192_SHA256, der)
                    .verify(message, signature)
            }
            // The uncompressed point, from a key set's `x` and `y` or a PEM file; a JWT's
            // signature is the fixed-length `r || s`.
            (Algorithm::ES256, DecodingKeyKind::SecretOrDer(point)) => {
                UnparsedPublicKey::new(&ring_signature::ECDSA_P256_SHA256_FIXED, point)
                    .verify(message, signature)
            }
            _ => return Err(signature::Error::new()),
        };
        verified.map_err(|_| signature::Error::new())
    }
}

impl JwtVerifier for RingVerifier {
    fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
}

#[cfg(test)]
mod tests {
    use jsonwebtoken::{EncodingKey, Header, Validation};

    use super::*;

    /// The provider is the process's, and a token signed by RustCrypto verifies through it,
    /// failing once a byte of it changes.
    #[test]
    fn ring_verifies_what_rust_crypto_signed() {
        install();
        assert!(std::ptr::eq(
            CryptoProvider::try_get_default().expect("installed"),
            LazyLock::force(&PROVIDER)
        ));
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let key = EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap();
        let claims = serde_json::json!({ "sub": "pos-1", "exp": 4_102_444_800u64 });
        let token = jsonwebtoken::encode(&Header::new(Algorithm::ES256), &claims, &key).unwrap();
        let public = DecodingKey::from_ec_pem(pair.public_key_pem().as_bytes()).unwrap();
        let validation = Validation::new(Algorithm::ES256);
        assert!(jsonwebtoken::decode::<serde_json::Value>(&token, &public, &validation).is_ok());
        let mut tampered = token.into_bytes();
        let last = tampered.len() - 3;
        tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(tampered).unwrap();
        assert!(
            jsonwebtoken::decode::<serde_json::Value>(&tampered, &public, &validation).is_err()
        );
    }
}
