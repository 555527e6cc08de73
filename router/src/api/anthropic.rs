//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

use http::StatusCode;
use serde_json::{json, Value};

use super::{ApiError, Prepared, Served};

/// Reads a `POST /v1/messages` body into the request to run and its shaper.
pub fn prepare(_body: &[u8], _served: &Served<'_>) -> Result<Prepared, ApiError> {
    Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "api_error", None, "not built yet"))
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}`.
pub fn count_tokens(_body: &[u8], _served: &Served<'_>) -> Result<Value, ApiError> {
    Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "api_error", None, "not built yet"))
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
pub fn error_body(e: &ApiError) -> Value {
    json!({"type": "error", "error": {"type": "api_error", "message": e.message}})
}
