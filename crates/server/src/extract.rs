//! The JSON body extractor: a wrong type names the field (`serde_path_to_error`), unknown
//! fields are ignored and logged at debug level (`serde_ignored`), an oversized body is a
//! 413 — all as [`ApiError`]s with OpenAI's body.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A request body parsed as `T`.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(usize::MAX, |l| l.0);
        let bytes = Bytes::from_request(req, state).await.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge { limit }
            } else {
                ApiError::bad_request(format!("could not read the request body: {r}"))
            }
        })?;
        parse_body(&bytes).map(ApiJson)
    }
}

/// The body limit in force, stored as a request extension so the 413 message can name it.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

/// Parses a JSON body: the error names the field at fault.
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "the request body is empty; expected a JSON object",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let mut ignored: Vec<String> = Vec::new();
    let mut on_ignored = |path: serde_ignored::Path<'_>| ignored.push(path.to_string());
    let result: Result<T, _> = serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
        &mut de,
        &mut on_ignored,
    ));
    let value = result.map_err(|e| field_error(&e))?;
    de.end()
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    if !ignored.is_empty() {
        tracing::debug!(fields = ?ignored, "ignoring unknown request fields");
    }
    Ok(value)
}

fn field_error(e: &serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let inner = e.inner();
    let path = e.path().to_string();
    if inner.is_syntax() || inner.is_eof() {
        return ApiError::bad_request(format!("the request body is not valid JSON: {inner}"));
    }
    let msg = inner.to_string();
    // `missing field `x`` is reported at the parent: name the field itself.
    let missing = msg
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split('`').next());
    let param = match (missing, path.as_str()) {
        (Some(field), ".") => field.to_string(),
        (Some(field), parent) => format!("{parent}.{field}"),
        (None, p) => p.to_string(),
    };
    if missing.is_some() {
        return ApiError::invalid(
            param.clone(),
            format!("missing required parameter '{param}'"),
        );
    }
    ApiError::invalid(param.clone(), format!("invalid value for '{param}': {msg}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    struct Req {
        #[allow(dead_code)]
        model: String,
        #[serde(default)]
        #[allow(dead_code)]
        temperature: Option<f32>,
        #[serde(default)]
        #[allow(dead_code)]
        items: Vec<Item>,
    }

    #[derive(Debug, Deserialize)]
    struct Item {
        #[allow(dead_code)]
        n: u32,
    }

    fn err(body: &str) -> ApiError {
        parse_body::<Req>(body.as_bytes()).unwrap_err()
    }

    #[test]
    fn a_wrong_type_names_the_field_path() {
        let e = err(r#"{"model": "m", "items": [{"n": 1}, {"n": "x"}]}"#);
        assert_eq!(e.param(), Some("items[1].n"), "{e}");
        let e = err(r#"{"model": "m", "temperature": "hot"}"#);
        assert_eq!(e.param(), Some("temperature"));
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn a_missing_field_is_named() {
        let e = err(r#"{"items": []}"#);
        assert_eq!(e.param(), Some("model"), "{e}");
    }

    #[test]
    fn unknown_fields_are_ignored_and_bad_json_is_400() {
        assert!(parse_body::<Req>(br#"{"model": "m", "whatever": [1, 2]}"#).is_ok());
        assert_eq!(err("{").status(), StatusCode::BAD_REQUEST);
        assert_eq!(err("").status(), StatusCode::BAD_REQUEST);
        assert_eq!(err(r#"{"model": "m"} x"#).status(), StatusCode::BAD_REQUEST);
    }
}
