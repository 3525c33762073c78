//! The chat page served at `/`: plain HTML, CSS and JavaScript from `crates/server/page/`,
//! embedded in the binary with `include_str!` (no build step, no CDN; it works offline).
//! The page talks to `/v1/chat/completions` like any other client; these routes sit
//! outside the API-key check so that the page can load and then ask for the key.

use axum::extract::Path;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

/// One embedded file: its name under `/assets/`, content type and bytes.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static str,
}

/// The page itself.
const INDEX: &str = include_str!("../page/index.html");

/// Everything `index.html` loads.
const ASSETS: &[Asset] = &[
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../page/app.js"),
    },
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("../page/app.css"),
    },
    Asset {
        name: "icon.svg",
        content_type: "image/svg+xml",
        body: include_str!("../page/icon.svg"),
    },
];

/// Only the page's own files, no inline script, no other origin.
const CSP: &str = "default-src 'self'; img-src 'self' data:; style-src 'self'; \
                   script-src 'self'; connect-src 'self'; frame-ancestors 'none'";

fn reply(content_type: &'static str, body: &'static str) -> Response {
    let mut resp = body.into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Revalidated on every load, so a new binary's page is never mixed with an old script.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    resp
}

/// `GET /`: the chat page.
pub async fn index() -> Response {
    reply("text/html; charset=utf-8", INDEX)
}

/// `GET /assets/{name}`: a file the page loads; 404 for any other name.
pub async fn asset(Path(name): Path<String>) -> Response {
    match ASSETS.iter().find(|a| a.name == name) {
        Some(a) => reply(a.content_type, a.body),
        None => crate::ApiError::NotFound(format!("no asset named {name:?}")).into_response(),
    }
}
