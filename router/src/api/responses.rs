//! OpenAI's Responses API (`/v1/responses`).

use std::time::Duration;

use http::StatusCode;
use serde_json::Value;

use super::{ApiError, Prepared, Served};

/// Stored responses: bounded and expiring, in this router's memory.
#[derive(Debug)]
pub struct Store {
    _max: usize,
    _ttl: Duration,
}

impl Store {
    pub fn new(max: usize, ttl: Duration) -> Store {
        Store { _max: max, _ttl: ttl }
    }
}

/// Reads a `POST /v1/responses` body into the request to run and its shaper.
pub fn prepare(_body: &[u8], _served: &Served<'_>) -> Result<Prepared, ApiError> {
    Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "server_error", None, "not built yet"))
}

/// `GET /v1/responses/{id}`.
pub fn get(_store: &Store, _id: &str) -> Result<Value, ApiError> {
    Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "server_error", None, "not built yet"))
}

/// `DELETE /v1/responses/{id}`.
pub fn delete(_store: &Store, _id: &str) -> Result<Value, ApiError> {
    Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "server_error", None, "not built yet"))
}
