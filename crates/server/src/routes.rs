//! The router: thin handlers (extract, call the service, return), the API-key check, the
//! body limit and per-endpoint request counting.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{Value, json};

use crate::api::{ChatCompletionRequest, CompletionRequest, ResponsesRequest};
use crate::error::ApiError;
use crate::extract::{ApiJson, BodyLimit};
use crate::state::AppState;
use crate::{anthropic, chat_completions, completions, page, responses};

type Shared = Arc<AppState>;

/// The application: every route with its middleware.
pub fn router(state: Shared) -> Router {
    let limit = state.config.body_limit;
    let v1 = Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completion))
        .route("/v1/responses", post(create_response))
        .route("/v1/responses/{id}", get(get_response))
        .merge(anthropic::routes())
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .route("/", get(page::index))
        .route("/assets/{name}", get(page::asset))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .layer(middleware::from_fn(anthropic::error_bodies))
        .layer(DefaultBodyLimit::max(limit))
        .layer(Extension(BodyLimit(limit)))
        .with_state(state)
}

async fn health(State(state): State<Shared>) -> Json<Value> {
    let m = state.model.engine().metrics();
    Json(json!({
        "status": "ok",
        "model": state.model.name(),
        "running": m.running,
        "queued": m.queue_depth,
        "speculation": state.model.speculates(),
    }))
}

async fn metrics(State(state): State<Shared>) -> Response {
    let body = state.metrics.render(
        &state.model.engine().metrics(),
        crate::metrics::SpecSetup {
            enabled: state.model.speculates(),
            draft_model: state.model.drafts_with_a_model(),
        },
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

fn model_object(state: &AppState, id: &str) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": state.model.created(),
        "owned_by": "lockstep",
        "context_length": state.model.context_len(),
    })
}

async fn list_models(State(state): State<Shared>) -> Json<Value> {
    let data: Vec<Value> = std::iter::once(state.model.name())
        .chain(state.model.listed_aliases().iter().map(String::as_str))
        .map(|id| model_object(&state, id))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn get_model(
    State(state): State<Shared>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    state.check_model(Some(&id))?;
    let listed = state.model.listed_aliases().contains(&id);
    Ok(Json(model_object(
        &state,
        if listed { &id } else { state.model.name() },
    )))
}

async fn chat(
    State(state): State<Shared>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    chat_completions::serve(state, req).await
}

async fn completion(
    State(state): State<Shared>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    completions::serve(state, req).await
}

async fn create_response(
    State(state): State<Shared>,
    ApiJson(req): ApiJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    responses::serve(state, req).await
}

async fn get_response(
    State(state): State<Shared>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    responses::get_stored(&state, &id).map(Json)
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such endpoint".into())
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// Checks `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's clients) when
/// a key is configured.
async fn require_key(
    State(state): State<Shared>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.config.api_key {
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        let x_api_key = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim);
        let matches =
            |g: Option<&str>| g.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()));
        if !(matches(bearer) || matches(x_api_key)) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Counts answered requests by route and status.
async fn count_requests(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let endpoint = endpoint_label(req.uri().path());
    let resp = next.run(req).await;
    let status = resp.status();
    state.metrics.observe_request(endpoint, status.as_u16());
    if status == StatusCode::PAYLOAD_TOO_LARGE && resp.headers().get(header::CONTENT_TYPE).is_none()
    {
        return ApiError::PayloadTooLarge {
            limit: state.config.body_limit,
        }
        .into_response();
    }
    resp
}

/// The metrics label of a path: the route pattern, or `other` (so clients cannot create
/// unbounded label sets).
fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/" => "/",
        p if p.starts_with("/assets/") => "/assets/{name}",
        "/health" => "/health",
        "/metrics" => "/metrics",
        "/v1/models" => "/v1/models",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/responses" => "/v1/responses",
        "/v1/messages" => "/v1/messages",
        "/v1/messages/count_tokens" => "/v1/messages/count_tokens",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        p if p.starts_with("/v1/responses/") => "/v1/responses/{id}",
        _ => "other",
    }
}
