//! The identity provider's key set (`auth.jwks_url`): the keys tokens name by `kid`.
//!
//! Fetched at start-up, every `auth.jwks_refresh`, and when a token names a `kid` the set does
//! not hold, at most once per [`UNKNOWN_KID_EVERY`] whatever the number of such tokens (a
//! storm of made-up `kid`s costs the provider one request per 10 s). A fetch that fails keeps
//! the keys already held: an unreachable provider does not lock the fleet out. A fetch that
//! succeeds replaces the set: a key the provider removed is refused from then on. Keys are
//! RS256, ES256 (P-256) or EdDSA (Ed25519); a key's algorithm is its `alg`, or follows from its
//! type, and a token must be signed with exactly that one.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant},
};

use jsonwebtoken::{
    jwk::{AlgorithmParameters, EllipticCurve, JwkSet, KeyAlgorithm},
    Algorithm, DecodingKey,
};
use posthorn_client::http::{self as client_http, Url};
use tokio_rustls::TlsConnector;

use crate::{config::AuthConfig, metrics::Metrics};

/// Fetches for unknown `kid`s happen at most this often.
pub const UNKNOWN_KID_EVERY: Duration = Duration::from_secs(10);
/// Longest wait for the provider's answer.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest key set accepted.
const MAX_SET_BYTES: usize = 1 << 20;

/// A key and the one algorithm it verifies.
pub struct VerifyingKey {
    pub key: DecodingKey,
    pub algorithm: Algorithm,
}

pub struct KeySet {
    url: Url,
    tls: Option<TlsConnector>,
    refresh: Duration,
    keys: RwLock<Arc<HashMap<String, Arc<VerifyingKey>>>>,
    /// When a fetch for an unknown `kid` last began.
    last_unknown_fetch: Mutex<Option<Instant>>,
    /// One fetch at a time; a token waiting for a fetch in flight looks again after it.
    fetching: tokio::sync::Mutex<()>,
    metrics: Arc<Metrics>,
}

impl KeySet {
    /// The key set of `auth.jwks_url`, fetched once (a failure is logged: the hub starts with no
    /// keys from the provider, and fetches again for the first token that names one); `None`
    /// without a URL. The error names the configuration key at fault.
    pub async fn start(
        config: &AuthConfig,
        metrics: Arc<Metrics>,
    ) -> Result<Option<Arc<KeySet>>, String> {
        if config.jwks_url.is_empty() {
            return Ok(None);
        }
        let url =
            Url::parse(&config.jwks_url).map_err(|error| format!("auth.jwks_url: {error}"))?;
        let tls = url
            .https
            .then(|| client_http::tls_connector(config.jwks_ca_file.as_deref()))
            .transpose()
            .map_err(|error| format!("auth.jwks_ca_file: {error}"))?;
        let set = Arc::new(KeySet {
            url,
            tls,
            refresh: config.jwks_refresh,
            keys: RwLock::new(Arc::new(HashMap::new())),
            last_unknown_fetch: Mutex::new(None),
            fetching: tokio::sync::Mutex::new(()),
            metrics,
        });
        set.fetch().await;
        let refresher = Arc::downgrade(&set);
        let every = set.refresh;
        actix_rt::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(set) = refresher.upgrade() else {
                    return;
                };
                set.fetch().await;
            }
        });
        Ok(Some(set))
    }

    /// Reads `auth.jwks_ca_file` as [`KeySet::start`] does, fetching nothing.
    pub fn check_files(config: &AuthConfig) -> Result<(), String> {
        if config.jwks_url.is_empty() {
            return Ok(());
        }
        let url =
            Url::parse(&config.jwks_url).map_err(|error| format!("auth.jwks_url: {error}"))?;
        if url.https {
            client_http::tls_connector(config.jwks_ca_file.as_deref())
                .map_err(|error| format!("auth.jwks_ca_file: {error}"))?;
        }
        Ok(())
    }

    /// The key named `kid`, fetching the set again first when it is unknown and a fetch for an
    /// unknown `kid` is allowed (or one is in flight).
    pub async fn key(&self, kid: &str) -> Option<Arc<VerifyingKey>> {
        if let Some(key) = self.held(kid) {
            return Some(key);
        }
        let allowed = {
            let mut last = self
                .last_unknown_fetch
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let allowed = last.is_none_or(|at| at.elapsed() >= UNKNOWN_KID_EVERY);
            if allowed {
                *last = Some(Instant::now());
            }
            allowed
        };
        if allowed {
            self.fetch().await;
        } else {
            // A fetch in flight may bring it: wait for its end, start none.
            drop(self.fetching.lock().await);
        }
        self.held(kid)
    }

    fn held(&self, kid: &str) -> Option<Arc<VerifyingKey>> {
        self.keys
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(kid)
            .cloned()
    }

    /// Fetches the set and replaces the keys held, or keeps them if the fetch fails.
    async fn fetch(&self) {
        let _one_at_a_time = self.fetching.lock().await;
        match self.download().await {
            Ok(keys) => {
                self.metrics.jwks_fetched.inc();
                self.metrics.jwks_keys.set(keys.len() as i64);
                *self
                    .keys
                    .write()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()) = Arc::new(keys);
            }
            Err(error) => {
                self.metrics.jwks_fetch_failed.inc();
                log::warn!(
                    "auth: cannot fetch the key set from {}: {error}; the keys held still work",
                    self.url.authority()
                );
            }
        }
    }

    async fn download(&self) -> Result<HashMap<String, Arc<VerifyingKey>>, String> {
        let response = client_http::get(
            &self.url,
            self.tls.as_ref(),
            &[("Accept", "application/json")],
            FETCH_TIMEOUT,
            MAX_SET_BYTES,
        )
        .await?;
        if response.status != 200 {
            return Err(format!("the provider answered {}", response.status));
        }
        let set: JwkSet = serde_json::from_slice(&response.body)
            .map_err(|error| format!("not a JSON Web Key Set: {error}"))?;
        Ok(keys_of(&set))
    }
}

/// The usable keys of `set` by `kid`; a key without `kid`, of another use than signatures, or
/// of a kind the hub does not take is left out (and logged).
pub fn keys_of(set: &JwkSet) -> HashMap<String, Arc<VerifyingKey>> {
    let mut keys = HashMap::new();
    for jwk in &set.keys {
        let Some(kid) = jwk.common.key_id.clone() else {
            log::warn!("auth: a key of the key set has no kid: left out");
            continue;
        };
        let signing = jwk
            .common
            .public_key_use
            .as_ref()
            .is_none_or(|usage| *usage == jsonwebtoken::jwk::PublicKeyUse::Signature);
        if !signing {
            continue;
        }
        let algorithm = match (&jwk.algorithm, jwk.common.key_algorithm) {
            (AlgorithmParameters::RSA(_), None | Some(KeyAlgorithm::RS256)) => {
                Some(Algorithm::RS256)
            }
            (AlgorithmParameters::EllipticCurve(params), None | Some(KeyAlgorithm::ES256))
                if params.curve == EllipticCurve::P256 =>
            {
                Some(Algorithm::ES256)
            }
            (AlgorithmParameters::OctetKeyPair(_), None | Some(KeyAlgorithm::EdDSA)) => {
                Some(Algorithm::EdDSA)
            }
            _ => None,
        };
        let key = algorithm.and_then(|algorithm| {
            DecodingKey::from_jwk(jwk)
                .ok()
                .map(|key| VerifyingKey { key, algorithm })
        });
        match key {
            Some(key) => {
                keys.insert(kid, Arc::new(key));
            }
            None => log::warn!(
                "auth: key {kid:?} of the key set is not an RS256, ES256 (P-256) or EdDSA key: \
                 left out"
            ),
        }
    }
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RSA, P-256 and Ed25519 keys are taken with their algorithm; keys without `kid`, for
    /// encryption, or of other kinds are left out.
    #[test]
    fn the_usable_keys_of_a_set() {
        let set: JwkSet = serde_json::from_value(serde_json::json!({ "keys": [
            { "kty": "RSA", "kid": "r1", "use": "sig", "alg": "RS256",
              "n": "sXchDaQebHnPiGvyDOAT4saGEUetSyo9MKLOoWFsueri23bOdgWp4Dy1WlUzewbgBHod5pcM9H95GQRV3JDXboIRROSBigeC5yjU1hGzHHyXss8UDprecbAYxknTcQkhslANGRUZmdTOQ5qTRsLAt6BTYuyvVRdhS8exSZEy_c4gs_7svlJJQ4H9_NxsiIoLwAEk7-Q3UXERGYw_75IDrGA84-lA_-Ct4eTlXHBIY2EaV7t7LjJaynVJCpkv4LKjTTAumiGUIuQhrNhZLuF_RJLqHpM2kgWFLU7-VTdL1VbC2tejvcI2BlMkEpk1BzBZI0KQB0GaDWFLN-aEAw3vRw",
              "e": "AQAB" },
            { "kty": "EC", "kid": "e1", "crv": "P-256",
              "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
              "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0" },
            { "kty": "OKP", "kid": "d1", "crv": "Ed25519",
              "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo" },
            { "kty": "RSA", "use": "sig",
              "n": "sXchDaQebHnPiGvyDOAT4saGEUetSyo9MKLOoWFsueri23bOdgWp4Dy1WlUzewbgBHod5pcM9H95GQRV3JDXboIRROSBigeC5yjU1hGzHHyXss8UDprecbAYxknTcQkhslANGRUZmdTOQ5qTRsLAt6BTYuyvVRdhS8exSZEy_c4gs_7svlJJQ4H9_NxsiIoLwAEk7-Q3UXERGYw_75IDrGA84-lA_-Ct4eTlXHBIY2EaV7t7LjJaynVJCpkv4LKjTTAumiGUIuQhrNhZLuF_RJLqHpM2kgWFLU7-VTdL1VbC2tejvcI2BlMkEpk1BzBZI0KQB0GaDWFLN-aEAw3vRw",
              "e": "AQAB" },
            { "kty": "RSA", "kid": "enc", "use": "enc",
              "n": "sXchDaQebHnPiGvyDOAT4saGEUetSyo9MKLOoWFsueri23bOdgWp4Dy1WlUzewbgBHod5pcM9H95GQRV3JDXboIRROSBigeC5yjU1hGzHHyXss8UDprecbAYxknTcQkhslANGRUZmdTOQ5qTRsLAt6BTYuyvVRdhS8exSZEy_c4gs_7svlJJQ4H9_NxsiIoLwAEk7-Q3UXERGYw_75IDrGA84-lA_-Ct4eTlXHBIY2EaV7t7LjJaynVJCpkv4LKjTTAumiGUIuQhrNhZLuF_RJLqHpM2kgWFLU7-VTdL1VbC2tejvcI2BlMkEpk1BzBZI0KQB0GaDWFLN-aEAw3vRw",
              "e": "AQAB" },
            { "kty": "RSA", "kid": "r512", "alg": "RS512",
              "n": "sXchDaQebHnPiGvyDOAT4saGEUetSyo9MKLOoWFsueri23bOdgWp4Dy1WlUzewbgBHod5pcM9H95GQRV3JDXboIRROSBigeC5yjU1hGzHHyXss8UDprecbAYxknTcQkhslANGRUZmdTOQ5qTRsLAt6BTYuyvVRdhS8exSZEy_c4gs_7svlJJQ4H9_NxsiIoLwAEk7-Q3UXERGYw_75IDrGA84-lA_-Ct4eTlXHBIY2EaV7t7LjJaynVJCpkv4LKjTTAumiGUIuQhrNhZLuF_RJLqHpM2kgWFLU7-VTdL1VbC2tejvcI2BlMkEpk1BzBZI0KQB0GaDWFLN-aEAw3vRw",
              "e": "AQAB" },
            { "kty": "oct", "kid": "hmac", "k": "c2VjcmV0" },
        ]}))
        .unwrap();
        let keys = keys_of(&set);
        let mut held: Vec<(&str, Algorithm)> = keys
            .iter()
            .map(|(kid, key)| (kid.as_str(), key.algorithm))
            .collect();
        held.sort_by_key(|(kid, _)| *kid);
        assert_eq!(
            held,
            [
                ("d1", Algorithm::EdDSA),
                ("e1", Algorithm::ES256),
                ("r1", Algorithm::RS256)
            ]
        );
    }
}
