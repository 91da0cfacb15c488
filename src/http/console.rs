//! `GET /admin/console`: the operator's page (docs/http-api.md, section 10).
//!
//! Owns: the page itself, `console.html`, compiled into the binary with its CSS and JS inline
//! (no external assets, no build step), and the headers it is served with. The page holds no data:
//! its script reads `/metrics` and `/admin/status` and posts `/admin/drain?exit=false` from the
//! browser, with the admin token the operator typed in (jwt) or none (auth `none`), so every
//! number it shows passes the same checks as a `curl` would.
//!
//! Who gets the page: with auth `none`, the rule of every `/admin/*` endpoint (loopback peers, and
//! no browser request for another site). With jwt auth, anyone: a browser cannot attach a bearer
//! token to a navigation, and the page is the same static text for everyone.
//!
//! Its `Content-Security-Policy` allows exactly the page's one inline `<script>` and one inline
//! `<style>`, by their SHA-256 hashes computed once from the compiled-in text, and fetches to the
//! hub itself: an injected script or style, a foreign image or a foreign fetch is refused.

use std::sync::LazyLock;

use actix_web::{http::header, web, HttpRequest, HttpResponse};
use base64::Engine;
use sha2::{Digest, Sha256};

use super::{ops, ApiError, AppState};

const PAGE: &str = include_str!("console.html");

/// The policy for [`PAGE`], computed on first use: the page is a constant, so are its hashes.
static POLICY: LazyLock<String> = LazyLock::new(|| policy(PAGE));

/// The page, to a loopback admin client (auth `none`) or anyone (jwt: the data needs a token).
pub async fn page(
    request: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    if !state.auth.is_enabled() {
        ops::require_admin(&request, &state).await?;
    }
    Ok(HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .insert_header((header::CONTENT_SECURITY_POLICY, POLICY.as_str()))
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .insert_header((header::X_FRAME_OPTIONS, "DENY"))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "no-referrer"))
        .body(PAGE))
}

/// The CSP of `page`: nothing by default; its inline script and style by hash; fetches to the
/// hub's own origin; `data:` images for the empty favicon (without it the browser asks the hub for
/// `/favicon.ico` and logs the 404); no framing, no `<base>`, no form posts.
fn policy(page: &str) -> String {
    format!(
        "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; img-src data:; \
         base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        source_hash(inline(page, "script")),
        source_hash(inline(page, "style")),
    )
}

/// The text between `<tag>` and `</tag>`. The page has exactly one of each (a unit test checks);
/// a page without one is a bug of this file, caught by that test, so the empty text is fine.
fn inline<'a>(page: &'a str, tag: &str) -> &'a str {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    page.split_once(&open)
        .and_then(|(_, rest)| rest.split_once(&close))
        .map_or("", |(text, _)| text)
}

/// A CSP hash source: `'sha256-<base64 of the SHA-256 of the exact text>'`.
fn source_hash(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    format!(
        "'sha256-{}'",
        base64::engine::general_purpose::STANDARD.encode(digest.as_slice())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The policy can only name the page's inline code if there is exactly one `<script>` and one
    /// `<style>`, both without attributes (a `<script src>` would be refused by the policy).
    #[test]
    fn page_has_one_inline_script_and_one_style() {
        for tag in ["script", "style"] {
            assert_eq!(PAGE.matches(&format!("<{tag}")).count(), 1, "<{tag}");
            assert_eq!(PAGE.matches(&format!("<{tag}>")).count(), 1, "<{tag}>");
            assert_eq!(PAGE.matches(&format!("</{tag}>")).count(), 1, "</{tag}>");
            assert!(!inline(PAGE, tag).trim().is_empty(), "{tag}");
        }
    }

    /// No external asset: no URL with a scheme or a protocol-relative one anywhere in the page
    /// (the policy would refuse it anyway; this keeps the page honest about it).
    #[test]
    fn page_names_no_external_url() {
        for needle in [
            "http:",
            "https:",
            "ws:",
            "wss:",
            "src=\"//",
            "href=\"//",
            "url(",
        ] {
            assert!(!PAGE.contains(needle), "the page contains {needle:?}");
        }
    }

    /// Inline event handlers and style attributes would need `'unsafe-inline'`/`'unsafe-hashes'`,
    /// which the policy does not grant.
    #[test]
    fn page_has_no_inline_handlers_or_style_attributes() {
        for needle in [
            " onclick=",
            " onload=",
            " onsubmit=",
            " oninput=",
            " style=",
        ] {
            assert!(!PAGE.contains(needle), "the page contains {needle:?}");
        }
    }

    /// The hash is of the exact bytes between the tags: checked against a known vector
    /// (`printf 'alert(1)' | openssl dgst -sha256 -binary | base64`).
    #[test]
    fn source_hash_of_known_text() {
        assert_eq!(
            source_hash("alert(1)"),
            "'sha256-bhHHL3z2vDgxUt0W3dWQOrprscmda2Y5pLsLg4GF+pI='"
        );
        let policy = policy("<style>p{}</style><script>alert(1)</script>");
        assert!(policy.contains("script-src 'sha256-bhHHL3z2vDgxUt0W3dWQOrprscmda2Y5pLsLg4GF+pI='"));
        assert!(policy.starts_with("default-src 'none'"));
    }
}
