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

    /// Whether `origin` is named in `server.cors_origins` itself (not merely let in by `*`).
    pub fn lists(&self, origin: &HeaderValue) -> bool {
        origin
            .to_str()
            .is_ok_and(|text| self.origins.iter().any(|allowed| allowed == text))
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

/// Middleware adding `Access-Control-Allow-Origin` (with `Vary: Origin` and
/// `Access-Control-Expose-Headers: Retry-After`) to every response.
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
                // A page must read a 503's Retry-After to honour it, as the client contract
                // asks; without this, browsers hide it from scripts.
                headers.insert(
                    header::ACCESS_CONTROL_EXPOSE_HEADERS,
                    HeaderValue::from_static("Retry-After"),
                );
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use actix_web::{
        http::StatusCode,
        test::{self, TestRequest},
        App,
    };

    use super::*;

    fn cors(origins: &[&str]) -> Cors {
        Cors::new(&origins.iter().map(ToString::to_string).collect::<Vec<_>>())
    }

    fn origin(text: &'static str) -> HeaderValue {
        HeaderValue::from_static(text)
    }

    #[test]
    fn a_listed_origin_is_echoed() {
        let cors = cors(&["https://pos.example", "https://admin.example"]);
        assert_eq!(
            cors.allow(Some(&origin("https://admin.example"))),
            Some(origin("https://admin.example"))
        );
        assert_eq!(cors.allow(Some(&origin("https://evil.example"))), None);
        // Exact match only: no prefix, no other scheme or port.
        assert_eq!(cors.allow(Some(&origin("https://pos.example.evil"))), None);
        assert_eq!(cors.allow(Some(&origin("http://pos.example"))), None);
        assert_eq!(cors.allow(Some(&origin("https://pos.example:8443"))), None);
        assert_eq!(cors.allow(None), None, "no Origin, no CORS");
    }

    #[test]
    fn a_star_allows_every_origin_as_star() {
        let cors = cors(&["*"]);
        assert_eq!(
            cors.allow(Some(&origin("https://anything.example"))),
            Some(origin("*"))
        );
        assert_eq!(cors.allow(None), None);
    }

    #[test]
    fn an_empty_list_allows_nothing() {
        let cors = cors(&[]);
        assert_eq!(cors.allow(Some(&origin("https://pos.example"))), None);
        assert_eq!(cors.allow(Some(&origin("*"))), None);
    }

    async fn preflight_for(cors: Cors, from: Option<&'static str>) -> HttpResponse {
        let mut request = TestRequest::default().method(actix_web::http::Method::OPTIONS);
        if let Some(from) = from {
            request = request.insert_header((header::ORIGIN, from));
        }
        preflight(request.to_http_request(), web::Data::new(cors)).await
    }

    #[actix_rt::test]
    async fn a_preflight_from_an_allowed_origin_is_granted() {
        let response =
            preflight_for(cors(&["https://pos.example"]), Some("https://pos.example")).await;
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        let headers = response.headers();
        assert_eq!(
            headers.get(header::ACCESS_CONTROL_ALLOW_METHODS).unwrap(),
            "GET, POST, OPTIONS"
        );
        assert_eq!(
            headers.get(header::ACCESS_CONTROL_ALLOW_HEADERS).unwrap(),
            "authorization, content-type, last-event-id"
        );
        assert_eq!(headers.get(header::ACCESS_CONTROL_MAX_AGE).unwrap(), "600");
    }

    #[actix_rt::test]
    async fn a_preflight_from_elsewhere_gets_no_grant() {
        for (cors, from) in [
            (cors(&["https://pos.example"]), Some("https://evil.example")),
            (cors(&["https://pos.example"]), None),
            (cors(&[]), Some("https://pos.example")),
        ] {
            let response = preflight_for(cors, from).await;
            assert_eq!(response.status(), StatusCode::NO_CONTENT);
            let headers = response.headers();
            assert!(
                !headers.contains_key(header::ACCESS_CONTROL_ALLOW_METHODS)
                    && !headers.contains_key(header::ACCESS_CONTROL_ALLOW_HEADERS)
                    && !headers.contains_key(header::ACCESS_CONTROL_MAX_AGE)
                    && !headers.contains_key(header::ACCESS_CONTROL_ALLOW_ORIGIN),
                "{from:?}: {headers:?}"
            );
        }
    }

    /// The middleware adds the grant (with `Vary: Origin` and `Retry-After` exposed to scripts)
    /// to every response for an allowed origin, and nothing otherwise.
    #[actix_rt::test]
    async fn the_middleware_grants_allowed_origins_only() {
        for (origins, from, grant) in [
            (
                &["https://pos.example"][..],
                Some("https://pos.example"),
                Some("https://pos.example"),
            ),
            (&["*"][..], Some("https://pos.example"), Some("*")),
            (
                &["https://pos.example"][..],
                Some("https://evil.example"),
                None,
            ),
            (&["https://pos.example"][..], None, None),
            (&[][..], Some("https://pos.example"), None),
        ] {
            let app = test::init_service(
                App::new()
                    .app_data(web::Data::new(cors(origins)))
                    .wrap(CorsHeaders)
                    .route("/", web::get().to(|| async { HttpResponse::Ok().finish() })),
            )
            .await;
            let mut request = TestRequest::get().uri("/");
            if let Some(from) = from {
                request = request.insert_header((header::ORIGIN, from));
            }
            let response = test::call_service(&app, request.to_request()).await;
            assert_eq!(response.status(), StatusCode::OK);
            let headers = response.headers();
            assert_eq!(
                headers
                    .get(header::ACCESS_CONTROL_ALLOW_ORIGIN)
                    .map(|value| value.to_str().unwrap()),
                grant,
                "{origins:?} {from:?}"
            );
            assert_eq!(
                headers
                    .get(header::VARY)
                    .map(|value| value.to_str().unwrap()),
                grant.map(|_| "Origin"),
                "{origins:?} {from:?}"
            );
            assert_eq!(
                headers
                    .get(header::ACCESS_CONTROL_EXPOSE_HEADERS)
                    .map(|value| value.to_str().unwrap()),
                grant.map(|_| "Retry-After"),
                "{origins:?} {from:?}"
            );
        }
    }

    /// Errors pass through the middleware with the grant too (a browser must be able to read a
    /// 401 or 503).
    #[actix_rt::test]
    async fn the_middleware_grants_error_responses_too() {
        let app = test::init_service(
            App::new()
                .app_data(web::Data::new(cors(&["https://pos.example"])))
                .wrap(CorsHeaders)
                .route(
                    "/",
                    web::get().to(|| async {
                        Err::<HttpResponse, _>(crate::http::error::ApiError::Draining)
                    }),
                ),
        )
        .await;
        let request = TestRequest::get()
            .uri("/")
            .insert_header((header::ORIGIN, "https://pos.example"))
            .to_request();
        let response = test::call_service(&app, request).await;
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            response
                .headers()
                .get(header::ACCESS_CONTROL_ALLOW_ORIGIN)
                .unwrap(),
            "https://pos.example"
        );
    }
}
