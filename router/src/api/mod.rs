//! The router's HTTP APIs, each in its own module, kept at the edge of the router:
//!
//! - [`openai`]: OpenAI's chat completions and completions (`/v1/chat/completions`,
//!   `/v1/completions`), and vLLM's tokenizer endpoints.
//! - [`responses`]: OpenAI's Responses API (`/v1/responses`), with its store.
//! - [`anthropic`]: Anthropic's Messages API (`/v1/messages`).
//!
//! Each reads its wire format into the router's one request type (a [`GenerateRequest`], built for
//! chats by [`chat::ChatInput::build`]) and shapes the router's one output stream (its
//! [`GenerateResponse`]s) into its own objects and events through a [`Shape`]. The pieces every
//! chat API needs are written once, here: reading fields ([`Fields`]), errors ([`ApiError`]), tool
//! calls and reasoning ([`chat`] for the request, [`answer`] for the output). A new API is a new
//! module implementing [`Shape`] and a route in [`crate::http`]; it touches no other API's module.
//!
//! Nothing here knows about HTTP servers: [`crate::http`] serves it.

use http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};
use tandem_proto::v1::GenerateResponse;
use tonic::{Code, Status};

use tandem_model::tokenizer::Tokenizer;

pub mod answer;
pub mod anthropic;
pub mod chat;
pub mod openai;
pub mod responses;

/// A generation request ready to run: the router's request, and how its output is shaped.
pub struct Prepared {
    pub request: tandem_proto::v1::GenerateRequest,
    pub stream: bool,
    pub shape: Box<dyn Shape>,
}

impl Served<'_> {
    /// What a request's `model` asks for: the served model (empty) or a LoRA adapter a worker
    /// holds (its name); a 404 `model_not_found` otherwise.
    pub fn resolve(&self, model: String) -> Result<String, ApiError> {
        if model == self.model {
            Ok(String::new())
        } else if self.adapters.has(&model) {
            Ok(model)
        } else {
            Err(ApiError::model_not_found(&model, self.model))
        }
    }

    /// The model an answer names: the adapter the request ran under, else the served model.
    pub fn answering<'b>(&'b self, request: &'b tandem_proto::v1::GenerateRequest) -> &'b str {
        if request.model.is_empty() {
            self.model
        } else {
            &request.model
        }
    }

    /// The model's tokenizer, which shaping an answer needs (always loaded in a router).
    pub fn loaded_tokenizer(&self) -> Result<Tokenizer, ApiError> {
        self.tokenizer.cloned().ok_or_else(|| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                None,
                "the model's tokenizer is not loaded",
            )
        })
    }
}

/// Whose error shape an HTTP error takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// `{"error": {"message", "type", "param", "code"}}`: the OpenAI APIs (Responses included).
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`: Anthropic's Messages API.
    Anthropic,
}

impl Style {
    /// The style of a `/v1` route's path (as the `/v1` router sees it, without the prefix).
    pub fn of_path(path: &str) -> Style {
        let p = path.strip_prefix("/v1").unwrap_or(path);
        if p == "/messages" || p.starts_with("/messages/") {
            Style::Anthropic
        } else {
            Style::OpenAi
        }
    }
}

/// How one request's output is shaped for its API: streamed as server-sent events, or answered
/// at once. Built per request by the API's module; driven by [`crate::http`].
pub trait Shape: Send + 'static {
    /// The events one response becomes when streaming (SSE text, possibly empty).
    fn stream(&mut self, r: &GenerateResponse) -> String;
    /// The events that end a stream that failed after it started.
    fn stream_error(&mut self, e: &ApiError) -> String;
    /// The events after the last response (OpenAI's `[DONE]`), once [`Shape::finished`].
    fn stream_end(&mut self) -> String;
    /// Whether every choice's last response has been seen.
    fn finished(&self) -> bool;
    /// Takes in one response of a request answered at once.
    fn absorb(&mut self, r: &GenerateResponse);
    /// The whole answer's JSON, once finished.
    fn response(&mut self) -> Value;
    /// The API's name for the prompt's field, in errors about the prompt.
    fn prompt_param(&self) -> &'static str;
    /// The API's name for the most tokens to generate, in errors about it.
    fn max_tokens_param(&self) -> &'static str {
        "max_tokens"
    }
}

/// An error as OpenAI's API reports it: an HTTP status and
/// `{"error":{"message","type","param","code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The body's `type`.
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds to wait before retrying (`Retry-After`), when the cluster was full.
    pub retry_after: Option<u16>,
    /// The request the error belongs to (`x-request-id`), when it was given an id.
    pub request_id: Option<Box<str>>,
}

impl ApiError {
    /// A 400 about request parameter `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_owned()),
            code: None,
            retry_after: None,
            request_id: None,
        }
    }

    /// A 400 about the request as a whole (body, headers).
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, message)
    }

    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: Option<&'static str>,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code,
            retry_after: None,
            request_id: None,
        }
    }

    /// A 404 for a model this router does not serve.
    pub fn model_not_found(asked: &str, served: &str) -> ApiError {
        ApiError::not_found_model(format!(
            "the model `{asked}` does not exist; this server serves `{served}` and the LoRA adapters its \
             workers hold (GET /v1/models lists them)"
        ))
    }

    /// A 404 `model_not_found` saying `message`.
    fn not_found_model(message: String) -> ApiError {
        ApiError {
            param: Some("model".into()),
            ..ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", Some("model_not_found"), message)
        }
    }

    /// [`ApiError::from_status`] with the field names of the API `shape` serves.
    pub fn for_shape(st: &Status, shape: &dyn Shape) -> ApiError {
        let mut e = ApiError::from_status(st, shape.prompt_param());
        let name = shape.max_tokens_param();
        if name != "max_tokens" && e.param.as_deref() == Some("max_tokens") {
            e.param = Some(name.to_owned());
            if let Some(rest) = e.message.strip_prefix("max_tokens") {
                e.message = format!("{name}{rest}");
            }
            e.message = e.message.replace("plus max_tokens", &format!("plus {name}"));
        }
        e
    }

    /// The JSON body in the API `style`'s shape.
    pub fn body_in(&self, style: Style) -> Value {
        match style {
            Style::OpenAi => self.body(),
            Style::Anthropic => anthropic::error_body(self),
        }
    }

    /// The JSON body (OpenAI's shape).
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    /// The router's answer (a gRPC status, as the request's stream carries it) for an HTTP
    /// client. Invalid-argument messages start with the field they are about, in the gRPC API's
    /// names; they are renamed to the HTTP APIs' parameters, the prompt's to `prompt_param`.
    pub fn from_status(st: &Status, prompt_param: &str) -> ApiError {
        let msg = st.message().to_owned();
        let (status, kind, code) = match st.code() {
            Code::InvalidArgument => return invalid_argument(msg, prompt_param),
            Code::Unauthenticated => {
                (StatusCode::UNAUTHORIZED, "invalid_request_error", Some("invalid_api_key"))
            }
            // The only NOT_FOUND the router answers a request with: its `model`.
            Code::NotFound => {
                let msg = msg.strip_prefix("model: ").unwrap_or(&msg).to_owned();
                return ApiError::not_found_model(msg);
            }
            Code::ResourceExhausted => {
                (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", Some("overloaded"))
            }
            // A request that passed the HTTP checks just before the router started draining is
            // refused at admission with the same reason: it gets the same code.
            Code::Unavailable if msg.starts_with(crate::orchestrate::DRAINING) => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", Some("draining"))
            }
            Code::Unavailable => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", Some("unavailable"))
            }
            Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "timeout", Some("timeout")),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        let meta = |key| st.metadata().get(key).and_then(|v| v.to_str().ok());
        ApiError {
            retry_after: meta(crate::error::RETRY_AFTER_KEY).and_then(|v| v.parse().ok()),
            request_id: meta(crate::error::REQUEST_ID_KEY).map(Box::from),
            ..ApiError::new(status, kind, code, msg)
        }
    }
}

/// Renames the gRPC API's field names at the start of an invalid-argument message
/// (`sampling.temperature: ...`, `prompt.chat: ...`) to this API's, and sets `param`.
fn invalid_argument(msg: String, prompt: &str) -> ApiError {
    if msg.starts_with("prompt has ") && msg.contains("the limit is") {
        return ApiError { code: Some("context_length_exceeded"), ..ApiError::invalid(prompt, msg) };
    }
    if msg.starts_with("max_tokens: the prompt's ") {
        return ApiError { code: Some("context_length_exceeded"), ..ApiError::invalid("max_tokens", msg) };
    }
    let Some((field, rest)) = msg.split_once(':') else {
        return ApiError::bad_request(msg);
    };
    if field.is_empty() || !field.bytes().all(|b| b.is_ascii_lowercase() || b == b'_' || b == b'.') {
        return ApiError::bad_request(msg);
    }
    let param = if field == "prompt" || field.starts_with("prompt.") {
        prompt.to_owned()
    } else if let Some(f) = field.strip_prefix("sampling.") {
        f.to_owned()
    } else {
        field.to_owned()
    };
    ApiError::invalid(&param, format!("{param}:{rest}"))
}

/// The names besides the served model's that a request's `model` may give: the LoRA adapters
/// the cluster's workers hold.
pub trait Adapters: Sync {
    /// Whether some worker holds an adapter called `name`.
    fn has(&self, name: &str) -> bool;
}

impl std::fmt::Debug for dyn Adapters + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Adapters")
    }
}

/// No adapters (a server that runs none, and tests).
#[derive(Debug, Clone, Copy)]
pub struct NoAdapters;

impl Adapters for NoAdapters {
    fn has(&self, _: &str) -> bool {
        false
    }
}

/// What the model is called here and how long a sequence it can hold.
#[derive(Debug, Clone)]
pub struct Served<'a> {
    pub model: &'a str,
    /// The LoRA adapters requests may name in `model` instead of the served model.
    pub adapters: &'a dyn Adapters,
    pub context_len: usize,
    /// The model's tokenizer: structured-output constraints are compiled against its vocabulary
    /// while the request is read, so a bad schema is refused naming the field it came in. `None`
    /// leaves that check to the router's (which names the gRPC field).
    pub tokenizer: Option<&'a Tokenizer>,
    /// The Responses API's store (`previous_response_id`); `None` where there is none.
    pub responses: Option<&'a std::sync::Arc<responses::Store>>,
}

/// The request body's fields, taken out one at a time; what is left at the end is unknown.
pub struct Fields(pub Map<String, Value>);

impl Fields {
    /// The fields of a request body, which must be a JSON object.
    pub fn of_body(body: &[u8]) -> Result<Fields, ApiError> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
        match value {
            Value::Object(map) => Ok(Fields(map)),
            _ => Err(ApiError::bad_request("the request body must be a JSON object")),
        }
    }

    /// The field's value as `T`; None when absent or null.
    pub fn take<T: DeserializeOwned>(&mut self, name: &str) -> Result<Option<T>, ApiError> {
        match self.0.remove(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v)
                .map(Some)
                .map_err(|e| ApiError::invalid(name, format!("{name}: {e}"))),
        }
    }

    /// Takes `model`, which every generation request must give and which must name the served
    /// model or a LoRA adapter a worker holds (a 404 `model_not_found` otherwise). Returns what
    /// the router's request carries in `model`: empty for the served model, else the adapter's
    /// name.
    pub fn take_model(&mut self, served: &Served<'_>) -> Result<String, ApiError> {
        let model: String = self.take("model")?.ok_or_else(|| {
            ApiError::invalid("model", format!("model: is required (this server serves `{}`)", served.model))
        })?;
        served.resolve(model)
    }

    pub fn take_raw(&mut self, name: &str) -> Option<Value> {
        self.0.remove(name).filter(|v| !v.is_null())
    }

    /// Refuses the first field nobody took.
    pub fn finish(self) -> Result<(), ApiError> {
        self.finish_refusing(&[])
    }

    /// Refuses the first field nobody took: one of `unsupported` (part of the API, not served
    /// here) as not supported, any other as unknown.
    pub fn finish_refusing(self, unsupported: &[&str]) -> Result<(), ApiError> {
        match self.0.keys().next() {
            None => Ok(()),
            Some(k) if unsupported.contains(&k.as_str()) => {
                Err(ApiError::invalid(k, format!("{k}: not supported by this server")))
            }
            Some(k) => Err(ApiError::invalid(k, format!("unknown parameter `{k}`"))),
        }
    }
}

/// What a salt derived from an end user's id starts with, so that it never equals a `cache_salt`
/// given as the same string.
pub const USER_SALT_PREFIX: &str = "user:";

/// The prefix-cache salt an end user's id gives (`user:<id>`): one end user's requests share
/// cached prompts only with each other; none without an id. `param` names the field in errors.
pub fn user_salt(user: Option<&str>, param: &str) -> Result<String, ApiError> {
    match user {
        Some(u) if !u.is_empty() => {
            let max = crate::request::MAX_CACHE_SALT_BYTES - USER_SALT_PREFIX.len();
            if u.len() > max {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "{param}: at most {max} bytes, got {} (it names the end user's prefix-cache namespace)",
                        u.len()
                    ),
                ));
            }
            if u.contains('\0') {
                return Err(ApiError::invalid(param, format!("{param}: must not contain a NUL character")));
            }
            Ok(format!("{USER_SALT_PREFIX}{u}"))
        }
        _ => Ok(String::new()),
    }
}

/// Prefixes a nested object's field name (`stream_options.include_usage`).
pub fn rename(mut e: ApiError, prefix: &str) -> ApiError {
    if let Some(p) = &e.param {
        let full = format!("{prefix}{p}");
        e.message = e.message.replacen(p.as_str(), &full, 1);
        e.param = Some(full);
    }
    e
}

/// The server-sent event that ends every OpenAI stream.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// One server-sent event carrying `v`.
pub fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// 24 random letters and digits (a tool call's id).
pub fn random_id() -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..24).map(|_| CHARS[rng.random_range(0..CHARS.len())] as char).collect()
}

/// Tokenizers the API modules' tests share.
#[cfg(test)]
pub(crate) mod test_support {
    use tandem_model::tokenizer::Tokenizer;

    /// The tiny llama-gqa fixture's tokenizer (byte-level BPE), with its own ChatML template (no
    /// tool format, no thinking) or with `template` of tests/reference/templates.
    pub fn tokenizer(template: Option<&str>) -> Tokenizer {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference");
        let Some(template) = template else {
            return tandem_serve::identity::model_identity(&root.join("fixtures/llama-gqa"))
                .unwrap()
                .tokenizer;
        };
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tandem-router-api-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
            std::fs::copy(root.join("fixtures/llama-gqa").join(f), dir.join(f)).unwrap();
        }
        std::fs::copy(root.join("templates").join(template), dir.join("chat_template.jinja")).unwrap();
        let tok = Tokenizer::from_hf_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        tok
    }
}
