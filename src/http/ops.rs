//! Operations endpoints (docs/http-api.md): health, readiness, metrics, status, drain and
//! revocations.

use std::time::Duration;

use actix_web::{web, HttpRequest, HttpResponse};
use serde::Deserialize;
use serde_json::{json, Value};

use super::auth::Access;
use super::{error::ApiError, AppState};
use crate::{
    actors::{revocations::Revoke, shutdown::StartDrain},
    backend::revocation::Revocation,
    model::DeviceId,
};

/// How long readiness waits for the backend before calling it unreachable.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({ "status": "ok" }))
}

pub async fn readyz(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    readiness(&state).await?;
    Ok(HttpResponse::Ok().json(json!({ "status": "ready" })))
}

/// How often [`watch_readiness`] checks, for the `ready` gauge.
const READY_EVERY: Duration = Duration::from_secs(5);

/// Keeps the `ready` gauge current where nothing probes `/readyz`, from a task of its own: a
/// scrape never waits for the backend (a hung one would make the scrape time out and the pod
/// look down instead of not ready). Runs until the system stops.
pub fn watch_readiness(state: AppState) {
    actix_rt::spawn(async move {
        loop {
            let _ = readiness(&state).await;
            tokio::time::sleep(READY_EVERY).await;
        }
    });
}

/// Whether the pod takes new streams: not draining, and its backend answers a ping. Also noted in
/// the `ready` gauge.
async fn readiness(state: &AppState) -> Result<(), ApiError> {
    let verdict = if state.pod.is_draining() {
        Err(ApiError::Draining)
    } else {
        match tokio::time::timeout(READY_TIMEOUT, state.backend.ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(error.into()),
            Err(_) => Err(ApiError::BackendSilent(READY_TIMEOUT)),
        }
    };
    state.metrics.ready.set(i64::from(verdict.is_ok()));
    verdict
}

pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render())
}

/// Admin endpoints need the `admin` scope with jwt auth, and a loopback client that no browser
/// sent for another site with auth `none`.
pub(super) async fn require_admin(request: &HttpRequest, state: &AppState) -> Result<(), ApiError> {
    state.auth.check(request, Access::Admin).await?;
    if state.auth.is_enabled() {
        return Ok(());
    }
    loopback_only(request.peer_addr(), "admin endpoints")
}

/// Without authentication only a client on this machine may drain it, read its status or the
/// fleet's.
pub(super) fn loopback_only(
    peer: Option<std::net::SocketAddr>,
    what: &str,
) -> Result<(), ApiError> {
    match peer {
        Some(peer) if peer.ip().is_loopback() => Ok(()),
        _ => Err(ApiError::Forbidden(format!(
            "{what} are only served to loopback clients when auth.mode is none"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With auth `none`, admin endpoints answer loopback peers (IPv4 and IPv6) and nobody else.
    /// (Black-box tests can only connect from loopback here; they cover the allowed side.)
    #[test]
    fn admin_without_auth_is_loopback_only() {
        for allowed in ["127.0.0.1:5000", "127.0.0.2:1", "[::1]:80"] {
            assert!(
                loopback_only(Some(allowed.parse().unwrap()), "admin endpoints").is_ok(),
                "{allowed}"
            );
        }
        for refused in [
            "10.0.0.7:5000",
            "192.168.1.2:1",
            "[2001:db8::1]:80",
            "0.0.0.0:1",
        ] {
            let error =
                loopback_only(Some(refused.parse().unwrap()), "admin endpoints").unwrap_err();
            assert!(matches!(error, ApiError::Forbidden(_)), "{refused}");
        }
        assert!(
            loopback_only(None, "admin endpoints").is_err(),
            "an unknown peer is not trusted"
        );
    }
}

pub async fn status(
    request: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    require_admin(&request, &state).await?;
    let tails: Vec<_> = state
        .tails
        .iter()
        .map(|tail| tail.lock().unwrap_or_else(|p| p.into_inner()).clone())
        .collect();
    let drain = state
        .drain
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(HttpResponse::Ok().json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "backend": state.backend.kind(),
        "connections": state.pod.connections(),
        "draining": state.pod.is_draining(),
        "drain": drain,
        "tails": tails,
        "config": state.config.summary(),
    })))
}

#[derive(Debug, Deserialize)]
pub struct DrainQuery {
    exit: Option<bool>,
}

pub async fn drain(
    request: HttpRequest,
    query: web::Query<DrainQuery>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    require_admin(&request, &state).await?;
    let exit = query.exit.unwrap_or(true);
    let started = state
        .shutdown
        .send(StartDrain {
            exit,
            trigger: "admin request",
        })
        .await
        .map_err(|_| ApiError::Internal("the shutdown actor is gone"))?;
    Ok(HttpResponse::Accepted().json(json!({
        "draining": true,
        "started": started,
        "exit": exit,
    })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RevokeBody {
    device: String,
}

/// Largest revoke body: `{"device": "<128 characters>"}`.
const MAX_REVOKE_BODY: usize = 4096;

/// `POST /admin/revoke` with `{"device": "..."}`: the device's tokens issued until now are
/// refused on every pod, and its open streams close with `event: revoked` within about a
/// second (docs/security.md, "Revocation"). 202 once the backend stored it; 503 when it could
/// not, in which case it holds on this pod only until it is made again.
pub async fn revoke(
    request: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    require_admin(&request, &state).await?;
    super::publish::require_json(&request, "POST /admin/revoke")?;
    let body = super::publish::read_limited(&request, payload, MAX_REVOKE_BODY).await?;
    let RevokeBody { device: text } = serde_json::from_slice(&body)
        .map_err(|error| ApiError::MalformedJson(error.to_string()))?;
    let device = DeviceId::parse(&text).map_err(|source| ApiError::InvalidDevice {
        device: text.clone(),
        source,
    })?;
    let outcome = state
        .revocations
        .send(Revoke { device })
        .await
        .map_err(|_| ApiError::Internal("the revocations actor is gone: the hub is stopping"))?;
    match outcome {
        Ok(revocation) => Ok(HttpResponse::Accepted().json(revocation_json(&revocation))),
        Err(failed) => {
            log::warn!(
                "revocation of {} holds on this pod only: {}",
                failed.applied_here.device,
                crate::report::Report(&failed.error)
            );
            Err(ApiError::Backend(failed.error))
        }
    }
}

/// `GET /admin/revocations`: every revocation this pod applies, newest first.
pub async fn revocations(
    request: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    require_admin(&request, &state).await?;
    let all: Vec<Value> = state.revoked.list().iter().map(revocation_json).collect();
    Ok(HttpResponse::Ok().json(json!({ "revocations": all })))
}

fn revocation_json(revocation: &Revocation) -> Value {
    let at = jiff::Timestamp::from_millisecond(revocation.at_ms as i64)
        .map(|at| at.to_string())
        .unwrap_or_default();
    json!({
        "device": revocation.device.as_str(),
        "revoked_at": at,
        "revoked_at_ms": revocation.at_ms,
    })
}
