//! The router's OpenAI-compatible HTTP API (`/v1/...`); `/health`, `/ready` and `/metrics` are
//! merged in by the server.
//!
//! - `POST /v1/completions`, `POST /v1/chat/completions`: one JSON object, or with `stream: true`
//!   server-sent events (`data: {chunk}\n\n` ..., `data: [DONE]\n\n`).
//! - `GET /v1/models`, `GET /v1/models/{id}`: the served model and the LoRA adapters its workers
//!   hold.
//! - The admin API ([`crate::admin`]): `POST /v1/load_lora_adapter`,
//!   `POST /v1/unload_lora_adapter`, `GET /v1/lora_adapters`.
//!
//! Routes are nested under `/v1` (handlers see paths without it). Every error, including the
//! HTTP layer's own (body too large, wrong content type, unknown route), is an OpenAI error body.
//! With `--api-key`, every `/v1` route but the admin API's asks for `Authorization: Bearer <key>`;
//! the admin API asks for the admin key instead (`--admin-key`).
//!
//! Cancellation: the request's response stream ([`orchestrate::ResponseRx`]) is owned by the
//! handler's future while it waits, then by the response body while it streams. A client that
//! goes away drops whichever holds it; the request's run sees its channel close and its cleanup
//! releases what the workers hold.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tokio_stream::Stream;

use crate::api::openai::{self, Endpoint};
use crate::api::{anthropic, responses, ApiError, Prepared, Served, Shape, Style};
use crate::error::RouterError;
use crate::orchestrate::{self, Api, ResponseRx, DRAINING};
use crate::Shared;
use tandem_proto::v1::generate_request::Prompt;
use tandem_serve::auth::check_api_key_http;

/// Largest request body accepted unless `--max-body-bytes` says otherwise.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// A body over the limit is still read (and dropped) up to this many more bytes, for at most
/// [`DRAIN_TIME`], so that a client still sending it reads the 413 instead of a connection reset
/// under its feet; past either, the connection is closed.
const DRAIN_BYTES: usize = 1 << 30;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Clone)]
struct AppState {
    shared: Arc<Shared>,
    /// When this server started (the models' `created`).
    created: u64,
}

/// The router's HTTP application: the `/v1` routes.
pub(crate) fn app(shared: Arc<Shared>) -> axum::Router {
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let state = AppState { shared, created };
    let v1 = axum::Router::new()
        .route("/completions", post(completions).fallback(method_not_allowed))
        .route("/chat/completions", post(chat).fallback(method_not_allowed))
        .route("/messages", post(messages).fallback(method_not_allowed))
        .route("/messages/count_tokens", post(count_tokens).fallback(method_not_allowed))
        .route("/responses", post(create_response).fallback(method_not_allowed))
        .route("/responses/{id}", get(get_response).delete(delete_response).fallback(method_not_allowed))
        .route("/models", get(models).fallback(method_not_allowed))
        .route("/models/{*id}", get(model).fallback(method_not_allowed))
        .route("/load_lora_adapter", post(load_lora_adapter).fallback(method_not_allowed))
        .route("/unload_lora_adapter", post(unload_lora_adapter).fallback(method_not_allowed))
        .route("/lora_adapters", get(lora_adapters).fallback(method_not_allowed))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .with_state(state.clone());
    // vLLM's tokenizer endpoints sit beside /v1, not under it.
    let tokenizer = axum::Router::new()
        .route("/tokenize", post(tokenize).fallback(root_method_not_allowed))
        .route("/detokenize", post(detokenize).fallback(root_method_not_allowed))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .with_state(state);
    axum::Router::new().nest("/v1", v1).merge(tokenizer)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.styled(Style::OpenAi)
    }
}

impl ApiError {
    /// The error as a response of the API `style`.
    fn styled(self, style: Style) -> Response {
        let mut r = (self.status, axum::Json(self.body_in(style))).into_response();
        let h = r.headers_mut();
        if self.status == StatusCode::UNAUTHORIZED {
            h.insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        }
        if let Some(secs) = self.retry_after {
            h.insert(header::RETRY_AFTER, header::HeaderValue::from(secs));
        }
        if let Some(id) = self.request_id.as_deref().and_then(|id| header::HeaderValue::from_str(id).ok()) {
            h.insert(crate::error::REQUEST_ID_KEY, id);
        }
        r
    }
}

/// Refuses `/v1` calls without the API key (when one is configured); the admin API checks its
/// own key.
async fn authenticate(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if crate::admin::is_admin_path(req.uri().path()) {
        return next.run(req).await;
    }
    if let Err(why) = check_api_key_http(st.shared.api_key.as_ref(), req.headers()) {
        let e = RouterError::Unauthenticated(why);
        orchestrate::refused(&st.shared, Api::Http, &e);
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            e.to_string(),
        )
        .styled(Style::of_path(req.uri().path()));
    }
    next.run(req).await
}

async fn not_found(req: Request) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        Some("not_found"),
        format!("no route {} /v1{}", req.method(), req.uri().path()),
    )
    .styled(Style::of_path(req.uri().path()))
}

async fn method_not_allowed(req: Request) -> Response {
    not_allowed("/v1", &req).styled(Style::of_path(req.uri().path()))
}

/// The same for the routes outside `/v1`.
async fn root_method_not_allowed(req: Request) -> ApiError {
    not_allowed("", &req)
}

fn not_allowed(prefix: &str, req: &Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        Some("method_not_allowed"),
        format!("{} is not allowed on {prefix}{}", req.method(), req.uri().path()),
    )
}

/// `GET /v1/models`: the served model, then each LoRA adapter a registered worker holds (once
/// per name).
async fn models(State(st): State<AppState>) -> Response {
    let base = &st.shared.model.model_name;
    let mut data = vec![openai::model_object(base, st.created)];
    let adapters = st.shared.with_registry(|r| r.adapter_names());
    data.extend(adapters.iter().map(|a| openai::adapter_object(a, base, st.created)));
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn model(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    let name = &st.shared.model.model_name;
    if &id == name {
        return axum::Json(openai::model_object(name, st.created)).into_response();
    }
    if st.shared.with_registry(|r| r.has_adapter(&id)) {
        return axum::Json(openai::adapter_object(&id, name, st.created)).into_response();
    }
    ApiError::model_not_found(&id, name).into_response()
}

/// `POST /v1/load_lora_adapter` (admin).
async fn load_lora_adapter(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let r = match crate::admin::authorize(&st.shared, &headers) {
        Err(e) => e.into_response(),
        Ok(()) => match json_body(&headers, body, st.shared.max_body_bytes).await {
            Ok(body) => crate::admin::load(st.shared.clone(), body).await,
            Err(e) => e.into_response(),
        },
    };
    st.shared.metrics.admin_call("load", r.status().as_u16());
    r
}

/// `POST /v1/unload_lora_adapter` (admin).
async fn unload_lora_adapter(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let r = match crate::admin::authorize(&st.shared, &headers) {
        Err(e) => e.into_response(),
        Ok(()) => match json_body(&headers, body, st.shared.max_body_bytes).await {
            Ok(body) => crate::admin::unload(st.shared.clone(), body).await,
            Err(e) => e.into_response(),
        },
    };
    st.shared.metrics.admin_call("unload", r.status().as_u16());
    r
}

/// `GET /v1/lora_adapters` (admin).
async fn lora_adapters(State(st): State<AppState>, headers: HeaderMap) -> Response {
    let r = match crate::admin::authorize(&st.shared, &headers) {
        Ok(()) => crate::admin::list(&st.shared),
        Err(e) => e.into_response(),
    };
    st.shared.metrics.admin_call("list", r.status().as_u16());
    r
}

async fn completions(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    serve(st, headers, body, Style::OpenAi, |b, s| openai::prepare(Endpoint::Completions, b, s)).await
}

async fn chat(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    serve(st, headers, body, Style::OpenAi, |b, s| openai::prepare(Endpoint::Chat, b, s)).await
}

async fn messages(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    serve(st, headers, body, Style::Anthropic, anthropic::prepare).await
}

async fn create_response(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    serve(st, headers, body, Style::OpenAi, responses::prepare).await
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as a message request would have them.
async fn count_tokens(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        let body = json_body(&headers, body, st.shared.max_body_bytes).await?;
        let shared = st.shared.clone();
        blocking(move || anthropic::count_tokens(&body, &served(&shared))).await
    };
    match run.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.styled(Style::Anthropic),
    }
}

/// `GET /v1/responses/{id}`: a stored response.
async fn get_response(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    match responses::get(&st.shared.responses, &id) {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /v1/responses/{id}`: forgets a stored response.
async fn delete_response(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    match responses::delete(&st.shared.responses, &id) {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Runs `f` off the async threads (rendering a template, compiling a constraint).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            None,
            format!("request parser task failed: {e}"),
        ))
    })
}

/// A request parser of one API: the body to the router's request and the output's shape.
type Parser = fn(&[u8], &Served<'_>) -> Result<Prepared, ApiError>;

/// Serves one generation request of an API: errors in its `style`.
async fn serve(st: AppState, headers: HeaderMap, body: Body, style: Style, parse: Parser) -> Response {
    generate(st, parse, headers, body).await.unwrap_or_else(|e| e.styled(style))
}

/// Reads, checks and parses the body; refusals are counted like the router's own. Parsing runs
/// off the async threads: it may render tools and compile a structured-output constraint.
async fn read_request(
    st: &AppState,
    parse: Parser,
    headers: &HeaderMap,
    body: Body,
) -> Result<Prepared, ApiError> {
    let shared = &st.shared;
    let refuse = |e: ApiError, as_router: RouterError| {
        orchestrate::refused(shared, Api::Http, &as_router);
        e
    };
    if shared.draining() {
        let msg = format!("{DRAINING}: it accepts no new requests; retry on another replica");
        return Err(refuse(
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                Some("draining"),
                msg.clone(),
            ),
            RouterError::Unavailable(msg),
        ));
    }
    let parsed = match json_body(headers, body, st.shared.max_body_bytes).await {
        Err(e) => Err(e),
        Ok(body) => {
            let owned = shared.clone();
            blocking(move || parse(&body, &served(&owned))).await
        }
    };
    parsed.map_err(|e| {
        let m = e.message.clone();
        refuse(e, RouterError::InvalidArgument(m))
    })
}

/// What the router serves, as the request parsers see it.
fn served(shared: &Shared) -> Served<'_> {
    Served {
        model: &shared.model.model_name,
        adapters: shared,
        context_len: shared.model.config.max_position_embeddings,
        tokenizer: Some(&shared.model.tokenizer),
        responses: Some(&shared.responses),
    }
}

/// The body of a request that must be JSON (`Content-Type: application/json`, at most `limit`
/// bytes: `--max-body-bytes`). A larger body is read to its end and dropped (see [`DRAIN_BYTES`])
/// before the 413 goes out, so that the client gets it.
async fn json_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    use tokio_stream::StreamExt;
    let json_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"));
    if !json_type {
        let msg = "the request body must be JSON, sent with the header `Content-Type: application/json`";
        return Err(ApiError::bad_request(msg));
    }
    let mut stream = body.into_data_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut over = false;
    let mut drained = 0usize;
    let deadline = std::time::Instant::now() + DRAIN_TIME;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                format!("reading the request body: {e}"),
            )
        })?;
        if !over && buf.len() + chunk.len() <= limit {
            buf.extend_from_slice(&chunk);
            continue;
        }
        over = true;
        buf = Vec::new();
        drained += chunk.len();
        if drained > DRAIN_BYTES || std::time::Instant::now() > deadline {
            break;
        }
    }
    if over {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            None,
            format!("the request body is larger than {limit} bytes (--max-body-bytes)"),
        ));
    }
    Ok(Bytes::from(buf))
}

/// `POST /tokenize` (vLLM's shape): the prompt's token ids as a generation request would get
/// them (text, or messages through the chat template), their count and the context length.
async fn tokenize(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        let body = json_body(&headers, body, st.shared.max_body_bytes).await?;
        let req = openai::parse_tokenize(&body, &served(&st.shared))?;
        let tok = st.shared.model.tokenizer.clone();
        let max_model_len = st.shared.model.config.max_position_embeddings;
        // Rendering a template and encoding a long text are CPU work: off the async threads.
        tokio::task::spawn_blocking(move || {
            let field = if matches!(req.prompt, Prompt::Chat(_)) { "messages" } else { "prompt" };
            let ids =
                crate::request::tokenize_with(&tok, &req.prompt, req.add_special_tokens).map_err(|e| {
                    // `prompt.chat: ...` / `prompt.text: ...` in this API's names.
                    let why = e.split_once(": ").map_or(e.as_str(), |(_, rest)| rest);
                    ApiError::invalid(field, format!("{field}: {why}"))
                })?;
            let strs = req
                .return_token_strs
                .then(|| ids.iter().map(|&id| tok.token_piece(id).unwrap_or_default()).collect());
            Ok::<_, ApiError>(openai::tokenize_response(&ids, max_model_len, strs))
        })
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                None,
                format!("tokenizer task failed: {e}"),
            )
        })?
    };
    match run.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize` (vLLM's shape): `{"tokens": [...]}` to `{"prompt": text}`, special tokens
/// kept.
async fn detokenize(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let body = match json_body(&headers, body, st.shared.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let run = || {
        let ids = openai::parse_detokenize(&body, &served(&st.shared))?;
        let tok = &st.shared.model.tokenizer;
        // Checked here to name the id without the tokenizer's own message (which names a path
        // on the server).
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= tok.vocab_size()) {
            let msg = format!("tokens: token id {bad} is outside the vocabulary (size {})", tok.vocab_size());
            return Err(ApiError::invalid("tokens", msg));
        }
        let text = tok.decode(&ids, false).map_err(|e| {
            tracing::warn!("detokenize: {e}");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                None,
                "the tokenizer failed to decode",
            )
        })?;
        Ok::<_, ApiError>(json!({"prompt": text}))
    };
    match run() {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn generate(st: AppState, parse: Parser, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let Prepared { request, stream, shape: mut shaper } = read_request(&st, parse, &headers, body).await?;
    let shared = &st.shared;
    let mut rx = orchestrate::start(shared.clone(), request, Api::Http)
        .await
        .map_err(|st| ApiError::for_shape(&st, &*shaper))?;

    // Wait for the first message either way, so a request that fails before its first token
    // (no worker, a worker refusing it) gets an HTTP error status, not a broken stream.
    let first = match rx.recv().await {
        Some(Ok(r)) => r,
        Some(Err(st)) => return Err(ApiError::for_shape(&st, &*shaper)),
        None => return Err(ended_early()),
    };
    // The id the router's log and metrics know the request by, for the client to quote.
    let request_id = (crate::error::REQUEST_ID_KEY, first.request_id.clone());
    if stream {
        let mut head = shaper.stream(&first);
        let state = if shaper.finished() {
            head.push_str(&shaper.stream_end());
            SseState::Done
        } else {
            SseState::Streaming
        };
        let body = SseBody { rx, shaper, pending: Some(head), state };
        return Ok((
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
                (header::HeaderName::from_static("x-accel-buffering"), "no"),
            ],
            [request_id],
            Body::from_stream(body),
        )
            .into_response());
    }
    shaper.absorb(&first);
    while let Some(msg) = rx.recv().await {
        match msg {
            Ok(r) => shaper.absorb(&r),
            Err(st) => return Err(ApiError::for_shape(&st, &*shaper)),
        }
    }
    if !shaper.finished() {
        return Err(ended_early());
    }
    Ok(([request_id], axum::Json(shaper.response())).into_response())
}

fn ended_early() -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        None,
        "the request ended without a finish reason",
    )
}

enum SseState {
    /// Chunks are still coming.
    Streaming,
    /// `[DONE]` was sent; waiting for the run to let go of the stream before ending the body.
    Done,
    Ended,
}

/// The body of a streamed response. It owns the request's response stream: dropping the body
/// (the client went away) cancels the request.
struct SseBody {
    rx: ResponseRx,
    shaper: Box<dyn Shape>,
    /// Events to send before reading more.
    pending: Option<String>,
    state: SseState,
}

impl Stream for SseBody {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(p) = this.pending.take() {
            return Poll::Ready(Some(Ok(Bytes::from(p))));
        }
        loop {
            match this.state {
                SseState::Ended => return Poll::Ready(None),
                SseState::Done => {
                    // Drain to the end, so the run completes before its stream is dropped
                    // (dropping it earlier would read as a client that went away).
                    if ready!(this.rx.poll_recv(cx)).is_none() {
                        this.state = SseState::Ended;
                    }
                }
                SseState::Streaming => {
                    let mut out = String::new();
                    match ready!(this.rx.poll_recv(cx)) {
                        Some(Ok(r)) => {
                            out.push_str(&this.shaper.stream(&r));
                            if this.shaper.finished() {
                                out.push_str(&this.shaper.stream_end());
                                this.state = SseState::Done;
                            }
                        }
                        Some(Err(st)) => {
                            let e = ApiError::for_shape(&st, &*this.shaper);
                            out.push_str(&this.shaper.stream_error(&e));
                            this.state = SseState::Done;
                        }
                        None => {
                            out.push_str(&this.shaper.stream_error(&ended_early()));
                            this.state = SseState::Ended;
                        }
                    }
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Bytes::from(out))));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_responses_carry_the_openai_body() {
        let r = ApiError::invalid("max_tokens", "max_tokens: must be at least 1, got 0").into_response();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let r =
            ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", Some("invalid_api_key"), "x")
                .into_response();
        assert_eq!(r.headers().get(header::WWW_AUTHENTICATE).unwrap(), "Bearer");
        let _: serde_json::Value = ApiError::bad_request("x").body();
    }
}
