//! The one place where typed errors become HTTP: `{"error": "<code>", "message": "<text>"}`,
//! plus `index` and `field` when a publish item is at fault.

use actix_web::{http::StatusCode, HttpResponse, ResponseError};
use serde_json::json;
use thiserror::Error;

use crate::{backend::BackendError, model::IdentError, report::Report};

#[derive(Debug, Error)]
pub enum ApiError {
    #[error("invalid device id {device:?}: {source}")]
    InvalidDevice { device: String, source: IdentError },
    /// A publish item (or the request) has an invalid field.
    #[error("{}{field}: {message}", item_prefix(*.index))]
    InvalidField {
        index: Option<usize>,
        field: &'static str,
        message: String,
    },
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("malformed JSON: {0}")]
    MalformedJson(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{}{field}: {message}", item_prefix(*.index))]
    FieldTooLarge {
        index: Option<usize>,
        field: &'static str,
        message: String,
    },
    #[error("this pod is draining; reconnect to another pod")]
    Draining,
    #[error("connection limit of {0} reached on this pod")]
    TooManyConnections(usize),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("the backend did not answer within {}s", .0.as_secs())]
    BackendSilent(std::time::Duration),
    /// A part of the hub itself failed (an actor that should live as long as the process is
    /// gone): not the client's fault, and not the backend's.
    #[error("internal failure: {0}")]
    Internal(&'static str),
    #[error("{0}")]
    Unauthorized(String),
    /// A revocation of the token's device covers it.
    #[error("{0}")]
    TokenRevoked(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("no such endpoint")]
    NotFound,
    #[error("device {0} is unknown: never seen, or not within presence.retention")]
    DeviceNotFound(String),
    #[error("{0}")]
    EventNotFound(String),
    #[error("the fleet API is off on this hub (presence.enabled = false)")]
    FleetDisabled,
    #[error("method not allowed")]
    MethodNotAllowed,
}

fn item_prefix(index: Option<usize>) -> String {
    index.map(|i| format!("item {i}: ")).unwrap_or_default()
}

impl ApiError {
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidDevice { .. } => "invalid_device",
            ApiError::InvalidField { .. } | ApiError::InvalidRequest(_) => "invalid_request",
            ApiError::UnsupportedMediaType(_) => "unsupported_media_type",
            ApiError::MalformedJson(_) => "malformed_json",
            ApiError::PayloadTooLarge(_) | ApiError::FieldTooLarge { .. } => "payload_too_large",
            ApiError::Draining => "draining",
            ApiError::TooManyConnections(_) => "too_many_connections",
            ApiError::Backend(_) | ApiError::BackendSilent(_) => "backend_unavailable",
            ApiError::Internal(_) => "internal_error",
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::TokenRevoked(_) => "token_revoked",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::NotFound => "not_found",
            ApiError::DeviceNotFound(_) => "device_not_found",
            ApiError::EventNotFound(_) => "event_not_found",
            ApiError::FleetDisabled => "fleet_disabled",
            ApiError::MethodNotAllowed => "method_not_allowed",
        }
    }

    /// Seconds a client should wait before retrying, for the 503s.
    fn retry_after(&self) -> Option<u32> {
        match self {
            ApiError::Draining | ApiError::TooManyConnections(_) => Some(5),
            ApiError::Backend(_) | ApiError::BackendSilent(_) | ApiError::Internal(_) => Some(2),
            _ => None,
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::InvalidDevice { .. }
            | ApiError::InvalidField { .. }
            | ApiError::InvalidRequest(_)
            | ApiError::MalformedJson(_) => StatusCode::BAD_REQUEST,
            ApiError::PayloadTooLarge(_) | ApiError::FieldTooLarge { .. } => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Draining
            | ApiError::TooManyConnections(_)
            | ApiError::Backend(_)
            | ApiError::BackendSilent(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unauthorized(_) | ApiError::TokenRevoked(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound
            | ApiError::DeviceNotFound(_)
            | ApiError::EventNotFound(_)
            | ApiError::FleetDisabled => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let message = Report(self).to_string();
        let mut body = json!({ "error": self.code(), "message": message });
        if let ApiError::InvalidField { index, field, .. }
        | ApiError::FieldTooLarge { index, field, .. } = self
        {
            body["field"] = json!(field);
            if let Some(index) = index {
                body["index"] = json!(index);
            }
        }
        let mut response = HttpResponse::build(self.status_code());
        if let ApiError::Unauthorized(_) | ApiError::TokenRevoked(_) = self {
            response.insert_header(("WWW-Authenticate", "Bearer"));
        }
        if let Some(seconds) = self.retry_after() {
            response.insert_header(("Retry-After", seconds.to_string()));
        }
        response.json(body)
    }
}
