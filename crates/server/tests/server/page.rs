//! The chat page's routes: `/` and its assets come from the binary with a strict content
//! security policy, stay reachable on a server with an API key (the page asks for the key),
//! and an unknown asset is an OpenAI-shaped 404.

use std::sync::OnceLock;

use lockstep_server::ServerConfig;

use crate::common::{TestServer, assert_error, client, smol, smol_model, spawn};

static KEYED: OnceLock<TestServer> = OnceLock::new();

fn keyed() -> &'static TestServer {
    KEYED.get_or_init(|| {
        spawn(
            smol_model(),
            ServerConfig {
                api_key: Some("page-key".into()),
                ..ServerConfig::default()
            },
        )
    })
}

async fn get(server: &TestServer, path: &str) -> (u16, reqwest::header::HeaderMap, String) {
    let r = client().get(server.url(path)).send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.text().await.unwrap())
}

#[tokio::test]
async fn the_page_and_every_asset_it_loads_are_served_from_the_binary() {
    for server in [smol(), keyed()] {
        let (s, h, html) = get(server, "/").await;
        assert_eq!(s, 200, "{html}");
        assert!(h["content-type"].to_str().unwrap().starts_with("text/html"));
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("default-src 'self'") && csp.contains("script-src 'self'"),
            "{csp}"
        );
        assert_eq!(h["cache-control"], "no-cache");
        assert!(html.contains("<title>lockstep</title>"), "{html}");
        // Every `/assets/…` the page names is served, with its type, and not empty.
        let mut named = 0;
        for part in html.split("\"/assets/").skip(1) {
            let name = &part[..part.find('"').unwrap()];
            let (s, h, body) = get(server, &format!("/assets/{name}")).await;
            assert_eq!(s, 200, "/assets/{name}");
            let ctype = h["content-type"].to_str().unwrap();
            let want = match name.rsplit('.').next().unwrap() {
                "js" => "text/javascript",
                "css" => "text/css",
                "svg" => "image/svg+xml",
                other => panic!("unexpected asset type {other}"),
            };
            assert!(ctype.starts_with(want), "{name}: {ctype}");
            assert!(body.len() > 100, "{name} is {} bytes", body.len());
            named += 1;
        }
        assert!(
            named >= 3,
            "the page loads its script, style sheet and icon"
        );
    }
}

#[tokio::test]
async fn an_unknown_asset_is_a_404_with_an_error_body() {
    for path in ["/assets/nope.js", "/assets/..%2Fpage.rs"] {
        let r = client().get(smol().url(path)).send().await.unwrap();
        let s = r.status().as_u16();
        assert_error(s, &r.json().await.unwrap(), 404);
    }
}
