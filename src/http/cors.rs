//! CORS for browsers (a web POS on another origin): `Access-Control-Allow-Origin` for origins in
//! `server.cors_origins`, preflight for the publish and stream endpoints. No CORS headers at all
//! when the list is empty.

use std::future::{ready, Ready};

use actix_web::{
    body::MessageBody,
    dev::{forward_ready, Service, ServiceRequest, ServiceResponse, Transform},
    http::header::{self, HeaderValue},
    web, HttpRequest, HttpResponse,
};
use futures_util::future::LocalBoxFuture;

#[derive(Debug, Clone)]
pub struct Cors {
    any: bool,
    origins: Vec<String>,
}

impl Cors {
    pub fn new(origins: &[String]) -> Self {
        Self {
            any: origins.iter().any(|origin| origin == "*"),
            origins: origins.to_vec(),
        }
    }

    /// The `Access-Control-Allow-Origin` value for a request's `Origin`, if it is allowed.
    pub fn allow(&self, origin: Option<&HeaderValue>) -> Option<HeaderValue> {
        let origin = origin?;
        if self.any {
            return Some(HeaderValue::from_static("*"));
        }
        let text = origin.to_str().ok()?;
        self.origins
            .iter()
            .any(|allowed| allowed == text)
            .then(|| origin.clone())
    }
}

/// Answers `OPTIONS` preflights: 204, with the CORS grant when the origin is allowed.
pub async fn preflight(request: HttpRequest, cors: web::Data<Cors>) -> HttpResponse {
    let mut response = HttpResponse::NoContent();
    if cors.allow(request.headers().get(header::ORIGIN)).is_some() {
        response
            .insert_header((header::ACCESS_CONTROL_ALLOW_METHODS, "GET, POST, OPTIONS"))
            .insert_header((
                header::ACCESS_CONTROL_ALLOW_HEADERS,
                "authorization, content-type, last-event-id",
            ))
            .insert_header((header::ACCESS_CONTROL_MAX_AGE, "600"));
    }
    response.finish()
}

/// Middleware adding `Access-Control-Allow-Origin` (and `Vary: Origin`) to every response.
pub struct CorsHeaders;

impl<S, B> Transform<S, ServiceRequest> for CorsHeaders
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<B>;
    type Error = actix_web::Error;
    type Transform = CorsHeadersMiddleware<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(CorsHeadersMiddleware { service }))
    }
}

pub struct CorsHeadersMiddleware<S> {
    service: S,
}

impl<S, B> Service<ServiceRequest> for CorsHeadersMiddleware<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<B>;
    type Error = actix_web::Error;
    type Future = LocalBoxFuture<'static, Result<Self::Response, Self::Error>>;

    forward_ready!(service);

    fn call(&self, request: ServiceRequest) -> Self::Future {
        let grant = request
            .app_data::<web::Data<Cors>>()
            .and_then(|cors| cors.allow(request.headers().get(header::ORIGIN)));
        let response = self.service.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            if let Some(origin) = grant {
                let headers = response.headers_mut();
                headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
                headers.insert(header::VARY, HeaderValue::from_static("Origin"));
            }
            Ok(response)
        })
    }
}
