//! The one error type of the HTTP layer. Every failure a client can see is an [`ApiError`],
//! rendered as OpenAI's error body `{"error": {"message", "type", "param", "code"}}` with
//! the matching status code.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something impossible (HTTP 400).
    #[error("{message}")]
    BadRequest {
        /// What is wrong, naming the field.
        message: String,
        /// The offending field (`messages[0].content`), when known.
        param: Option<String>,
        /// A machine-readable code (`context_length_exceeded`), when one applies.
        code: Option<&'static str>,
    },
    /// Missing or wrong API key (HTTP 401).
    #[error("invalid or missing API key")]
    Unauthorized,
    /// The requested model is not served here (HTTP 404).
    #[error("the model `{requested}` does not exist; this server serves `{served}`")]
    ModelNotFound {
        /// The name the client asked for.
        requested: String,
        /// The served model's name.
        served: String,
    },
    /// A stored object that does not exist (HTTP 404), e.g. a `previous_response_id`.
    #[error("{0}")]
    NotFound(String),
    /// The route exists but not with this method (HTTP 405).
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The body exceeds the size limit (HTTP 413).
    #[error("the request body exceeds the limit of {limit} bytes")]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The engine's queue is full (HTTP 429).
    #[error("{0}")]
    Busy(String),
    /// The server is shutting down or the engine stopped (HTTP 503).
    #[error("{0}")]
    Unavailable(String),
    /// A fault on the server's side (HTTP 500).
    #[error("{0}")]
    Internal(String),
}

impl From<runtime::constraint::PlanError> for ApiError {
    fn from(e: runtime::constraint::PlanError) -> ApiError {
        match e {
            runtime::constraint::PlanError::Invalid { param, message } => {
                ApiError::invalid(param, message)
            }
            runtime::constraint::PlanError::Internal(m) => ApiError::Internal(m),
        }
    }
}

impl ApiError {
    /// A 400 naming the field `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::BadRequest {
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 400 without a field.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::BadRequest {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound { .. } | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `error.type`.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. }
            | ApiError::ModelNotFound { .. }
            | ApiError::NotFound(_)
            | ApiError::MethodNotAllowed
            | ApiError::PayloadTooLarge { .. }
            | ApiError::Unauthorized => "invalid_request_error",
            ApiError::Busy(_) => "rate_limit_error",
            ApiError::Unavailable(_) | ApiError::Internal(_) => "server_error",
        }
    }

    /// OpenAI's `error.code`.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::BadRequest { code, .. } => *code,
            ApiError::Unauthorized => Some("invalid_api_key"),
            ApiError::ModelNotFound { .. } => Some("model_not_found"),
            ApiError::NotFound(_) => Some("not_found"),
            ApiError::PayloadTooLarge { .. } => Some("request_too_large"),
            ApiError::Busy(_) => Some("rate_limit_exceeded"),
            _ => None,
        }
    }

    /// OpenAI's `error.param`.
    pub fn param(&self) -> Option<&str> {
        match self {
            ApiError::BadRequest { param, .. } => param.as_deref(),
            ApiError::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    /// The JSON error body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.to_string(),
                "type": self.kind(),
                "param": self.param(),
                "code": self.code(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(status = status.as_u16(), "request failed: {self}");
        } else {
            tracing::debug!(status = status.as_u16(), "request refused: {self}");
        }
        (status, axum::Json(self.body())).into_response()
    }
}

impl From<engine::SubmitError> for ApiError {
    fn from(e: engine::SubmitError) -> ApiError {
        match e {
            engine::SubmitError::Busy { .. } => ApiError::Busy(format!(
                "{e}; retry later or lower the number of concurrent requests"
            )),
            engine::SubmitError::Invalid(msg) => ApiError::bad_request(msg),
            engine::SubmitError::ShutDown => ApiError::Unavailable(e.to_string()),
        }
    }
}
