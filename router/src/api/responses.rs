//! OpenAI's Responses API: `POST /v1/responses`, `GET /v1/responses/{id}` and
//! `DELETE /v1/responses/{id}`.
//!
//! A request is read field by field, as the chat completions API's ([`super::openai`]): every
//! field is used, accepted only with the value that means "off", or refused by name with a 400,
//! so a client never believes it got a behaviour it did not. Its `input` (a string, or a list of
//! items: messages, function calls and their outputs) and `instructions` become a chat built by
//! [`ChatInput::build`] (tools in the model's own format or the generic one, forced calls,
//! structured output from `text.format`, reasoning). The answer, read by an [`AnswerReader`],
//! becomes the response's output items (a `reasoning` item, a `message`, `function_call`s),
//! answered at once or streamed as the API's typed events, `response.created` to
//! `response.completed` (or `response.incomplete`, or `response.failed`), without `[DONE]`.
//!
//! **Conversation state.** A response made with `store` (the default) is kept in this router's
//! memory, in its [`Store`] (at most `--responses-max`, each for `--responses-ttl-secs`), with the
//! conversation that led to it and its own answer, so that `previous_response_id` continues it
//! and `GET`/`DELETE` find it. Each router keeps its own: a response stored by another router
//! replica, expired, evicted, deleted or made with `store: false` is answered 404. As in OpenAI's
//! API, a previous response's `instructions` do not carry over to the next one.
//!
//! **Not served** (refused naming the field): built-in tools (`web_search`, `file_search`,
//! `code_interpreter`, `computer_use`, `mcp`, `image_generation`, ...), non-text input (images,
//! files, audio) and item types other than messages and function calls, `background`,
//! `conversation`, `prompt`, `service_tier`, `max_tool_calls`, `top_logprobs`, `include`,
//! `stream_options`, `safety_identifier`, `prompt_cache_key`, `truncation: auto`, reasoning
//! summaries, and a `text.verbosity` other than `medium`.
//!
//! Nothing here knows about HTTP servers: [`crate::http`] serves it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use serde_json::{json, Map, Value};
use tandem_proto::v1::{self, GenerateRequest, GenerateResponse};

use super::answer::{AnswerReader, Piece};
use super::chat::{self, ChatInput, OutputPlan, ParamNames, ToolChoice, ToolSpec};
use super::{random_id, rename, ApiError, Fields, Prepared, Served, Shape};
use tandem_model::grammar::Constraint;
use tandem_model::tokenizer::Tokenizer;
use tandem_model::tools::{ParsedCall, ToolDef};

/// Most `metadata` pairs, and the longest key and value (OpenAI's limits).
pub const MAX_METADATA_PAIRS: usize = 16;
pub const MAX_METADATA_KEY: usize = 64;
pub const MAX_METADATA_VALUE: usize = 512;

/// Fields of OpenAI's Responses API that this server does not serve; refused by name (a null
/// value is accepted as absent).
const UNSUPPORTED: &[&str] = &[
    "conversation",
    "prompt",
    "service_tier",
    "max_tool_calls",
    "top_logprobs",
    "stream_options",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
];

// ---------------------------------------------------------------------------------------------
// The store
// ---------------------------------------------------------------------------------------------

/// Stored responses, in this router's memory: at most `max` (the oldest go first when a new one
/// comes; 0 stores nothing), each for `ttl` after it was stored (expired ones go whenever the
/// store is used). Each holds the response's JSON object, as `GET` returns it, and the
/// conversation that continues it: its input messages (those of the responses before it
/// included, `instructions` not) and its answer as an assistant message.
pub struct Store {
    max: usize,
    ttl: Duration,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    /// The next entry's number: entries are numbered in the order they were stored.
    next: u64,
    /// Ids by number, oldest first.
    order: BTreeMap<u64, String>,
    entries: HashMap<String, Entry>,
}

struct Entry {
    seq: u64,
    stored_at: Instant,
    response: Value,
    conversation: Arc<Vec<v1::ChatMessage>>,
}

/// Counts only: the entries hold clients' conversations.
impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.held.lock().map_or(0, |h| h.entries.len());
        f.debug_struct("Store").field("max", &self.max).field("ttl", &self.ttl).field("held", &held).finish()
    }
}

impl Store {
    pub fn new(max: usize, ttl: Duration) -> Store {
        Store { max, ttl, held: Mutex::new(Held::default()) }
    }

    /// Most responses held at once (0: storing is off).
    pub fn capacity(&self) -> usize {
        self.max
    }

    /// Keeps a finished response under `id` (replacing one with the same id).
    pub fn put(&self, id: &str, response: Value, conversation: Vec<v1::ChatMessage>) {
        self.put_at(Instant::now(), id, response, conversation)
    }

    /// The stored response object.
    pub fn response(&self, id: &str) -> Option<Value> {
        self.response_at(Instant::now(), id)
    }

    /// The conversation that continues the stored response.
    pub fn conversation(&self, id: &str) -> Option<Arc<Vec<v1::ChatMessage>>> {
        self.conversation_at(Instant::now(), id)
    }

    /// Forgets a stored response; false when none is held under `id`.
    pub fn remove(&self, id: &str) -> bool {
        self.held(Instant::now()).remove(id)
    }

    /// Responses held now.
    pub fn len(&self) -> usize {
        self.held(Instant::now()).entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entries, those expired at `now` dropped.
    fn held(&self, now: Instant) -> MutexGuard<'_, Held> {
        // A panic while holding the lock leaves the maps consistent (each change is one insert
        // or remove), so a poisoned lock is used as it is.
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.expire(now, self.ttl);
        held
    }

    fn put_at(&self, now: Instant, id: &str, response: Value, conversation: Vec<v1::ChatMessage>) {
        if self.max == 0 {
            return;
        }
        let mut held = self.held(now);
        held.remove(id);
        while held.entries.len() >= self.max {
            held.pop_oldest();
        }
        let seq = held.next;
        held.next += 1;
        held.order.insert(seq, id.to_owned());
        let entry = Entry { seq, stored_at: now, response, conversation: Arc::new(conversation) };
        held.entries.insert(id.to_owned(), entry);
    }

    fn response_at(&self, now: Instant, id: &str) -> Option<Value> {
        self.held(now).entries.get(id).map(|e| e.response.clone())
    }

    fn conversation_at(&self, now: Instant, id: &str) -> Option<Arc<Vec<v1::ChatMessage>>> {
        self.held(now).entries.get(id).map(|e| e.conversation.clone())
    }
}

impl Held {
    /// Drops the entries stored `ttl` or longer before `now`: the oldest, at the front.
    fn expire(&mut self, now: Instant, ttl: Duration) {
        while let Some((&seq, id)) = self.order.first_key_value() {
            let fresh =
                self.entries.get(id).is_some_and(|e| now.saturating_duration_since(e.stored_at) < ttl);
            if fresh {
                break;
            }
            let id = id.clone();
            self.order.remove(&seq);
            self.entries.remove(&id);
        }
    }

    fn remove(&mut self, id: &str) -> bool {
        match self.entries.remove(id) {
            Some(e) => {
                self.order.remove(&e.seq);
                true
            }
            None => false,
        }
    }

    fn pop_oldest(&mut self) {
        if let Some((_, id)) = self.order.pop_first() {
            self.entries.remove(&id);
        }
    }
}

/// The 404 for a response this router does not hold; `param` and `code` say which field asked.
fn not_held(id: &str, store: Option<&Store>, param: Option<&str>, code: &'static str) -> ApiError {
    let why = match store {
        Some(s) if s.capacity() > 0 => {
            "it may have expired (--responses-ttl-secs), been evicted by newer ones (--responses-max), \
             been deleted, been made with store false, or been stored by another router replica (each \
             router keeps its own responses)"
        }
        _ => "this router stores no responses (--responses-max 0)",
    };
    ApiError {
        param: param.map(str::to_owned),
        ..ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some(code),
            format!(
                "{}response `{id}` is not held by this router: {why}",
                param.map_or(String::new(), |p| format!("{p}: "))
            ),
        )
    }
}

/// `GET /v1/responses/{id}`: the stored response object.
pub fn get(store: &Store, id: &str) -> Result<Value, ApiError> {
    store.response(id).ok_or_else(|| not_held(id, Some(store), None, "not_found"))
}

/// `DELETE /v1/responses/{id}`: forgets a stored response.
pub fn delete(store: &Store, id: &str) -> Result<Value, ApiError> {
    if store.remove(id) {
        Ok(json!({"id": id, "object": "response", "deleted": true}))
    } else {
        Err(not_held(id, Some(store), None, "not_found"))
    }
}

// ---------------------------------------------------------------------------------------------
// The request
// ---------------------------------------------------------------------------------------------

/// A `POST /v1/responses` request read from the wire.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub request: GenerateRequest,
    pub stream: bool,
    /// How the answer is read: tool calls, reasoning.
    pub output: OutputPlan,
    /// Keep the finished response (`store`).
    pub store: bool,
    /// The conversation without the instructions: the previous response's, then this input.
    /// The answer is added to it when the response is stored.
    pub conversation: Vec<v1::ChatMessage>,
    /// The response object's fields that repeat the request's (`model`, `instructions`, `tools`,
    /// `text`, `metadata`, ...).
    pub echo: Map<String, Value>,
}

/// Reads a `POST /v1/responses` body into the request to run and its shaper.
pub fn prepare(body: &[u8], served: &Served<'_>) -> Result<Prepared, ApiError> {
    let parsed = parse(body, served)?;
    let tok = served.loaded_tokenizer()?;
    let store = if parsed.store { served.responses.cloned() } else { None };
    let Parsed { request, stream, output, conversation, echo, .. } = parsed;
    let shape = Shaper::new(output, tok, echo, conversation, store);
    Ok(Prepared { request, stream, shape: Box::new(shape) })
}

/// Reads a `POST /v1/responses` body.
pub fn parse(body: &[u8], served: &Served<'_>) -> Result<Parsed, ApiError> {
    let mut f = Fields::of_body(body)?;

    let model = f.take_model(served)?;

    let previous: Option<String> = f.take("previous_response_id")?;
    let mut conversation = match &previous {
        None => Vec::new(),
        Some(id) => {
            let store = served.responses.map(|s| s.as_ref());
            let held = store.and_then(|s| s.conversation(id)).ok_or_else(|| {
                not_held(id, store, Some("previous_response_id"), "previous_response_not_found")
            })?;
            held.as_ref().clone()
        }
    };
    let input = f.take_raw("input").ok_or_else(|| ApiError::invalid("input", "input: is required"))?;
    read_input(input, &mut conversation)?;
    let instructions: Option<String> = f.take("instructions")?;

    let max_given = f.take::<i64>("max_output_tokens")?;
    let max_tokens = match max_given {
        Some(n) if n < 1 => {
            return Err(ApiError::invalid(
                "max_output_tokens",
                format!("max_output_tokens: must be at least 1, got {n}"),
            ))
        }
        Some(n) if n as u64 > served.context_len as u64 => {
            return Err(ApiError::invalid(
                "max_output_tokens",
                format!(
                    "max_output_tokens: {n} is more than the model's context length of {} tokens",
                    served.context_len
                ),
            ))
        }
        Some(n) => n as u32,
        None => served.context_len.min(u32::MAX as usize) as u32,
    };
    // OpenAI's defaults: temperature 1, top_p 1. The numbers are repeated in the response as
    // they came.
    let temperature = f.take::<f64>("temperature")?.unwrap_or(1.0);
    let top_p = f.take::<f64>("top_p")?;

    let stream = f.take::<bool>("stream")?.unwrap_or(false);
    let store = f.take::<bool>("store")?.unwrap_or(true);
    if f.take::<bool>("background")? == Some(true) {
        return Err(ApiError::invalid(
            "background",
            "background: not supported by this server (responses run while the request waits; only false)",
        ));
    }
    let user: Option<String> = f.take("user")?;
    let cache_salt = super::user_salt(user.as_deref(), "user")?;
    let metadata = metadata(f.take_raw("metadata"))?;
    let (reasoning_echo, enable_thinking) = reasoning(f.take_raw("reasoning"))?;
    if let Some(t) = f.take::<String>("truncation")? {
        if t != "disabled" {
            return Err(ApiError::invalid(
                "truncation",
                format!(
                    "truncation: only `disabled` is served (an input longer than the context is refused, \
                     not truncated); got `{t}`"
                ),
            ));
        }
    }
    if let Some(include) = f.take::<Vec<String>>("include")? {
        if let Some(first) = include.first() {
            return Err(ApiError::invalid(
                "include",
                format!("include: not supported by this server (only an empty list); got `{first}`"),
            ));
        }
    }
    let (text_echo, constraint) = text_config(f.take_raw("text"))?;
    let tools = tools(&mut f)?;

    // Fields this server does not serve are accepted when null, as absent.
    f.0.retain(|k, v| !(v.is_null() && UNSUPPORTED.contains(&k.as_str())));
    f.finish_refusing(UNSUPPORTED)?;

    let messages = with_instructions(instructions.as_deref(), &conversation);
    let input = ChatInput {
        messages,
        tools: tools.spec,
        constraint: constraint.map(|c| ("text.format".to_owned(), c)),
        enable_thinking,
    };
    let plan = input.build(served, ParamNames { tools: "tools", tool_choice: "tool_choice" })?;

    let mut echo = Map::new();
    echo.insert("model".into(), json!(if model.is_empty() { served.model } else { &model }));
    echo.insert("instructions".into(), json!(instructions));
    echo.insert("max_output_tokens".into(), json!(max_given));
    echo.insert("temperature".into(), json!(temperature));
    echo.insert("top_p".into(), json!(top_p.unwrap_or(1.0)));
    echo.insert("tool_choice".into(), tools.choice);
    echo.insert("tools".into(), tools.echo);
    echo.insert("parallel_tool_calls".into(), json!(tools.parallel));
    echo.insert("previous_response_id".into(), json!(previous));
    echo.insert("text".into(), text_echo);
    echo.insert("reasoning".into(), reasoning_echo);
    echo.insert("store".into(), json!(store));
    echo.insert("metadata".into(), metadata);
    echo.insert("truncation".into(), json!("disabled"));
    echo.insert("background".into(), json!(false));
    echo.insert("user".into(), json!(user));

    Ok(Parsed {
        request: GenerateRequest {
            prompt: Some(plan.prompt),
            max_tokens: Some(max_tokens),
            sampling: Some(v1::SamplingParams {
                temperature: Some(temperature as f32),
                top_p: top_p.map(|p| p as f32),
                ..Default::default()
            }),
            request_id: String::new(),
            cache_salt,
            // A max_output_tokens the client gave must fit after the prompt (OpenAI's rule);
            // without one, the answer may run to the end of the context.
            max_tokens_must_fit: max_given.is_some(),
            constraint: plan.constraint.map(|c| tandem_serve::constraint::to_wire(&c)),
            n: 1,
            model,
            ..Default::default()
        },
        stream,
        output: plan.output,
        store,
        conversation,
        echo,
    })
}

/// The prompt's messages: `instructions` as a system message in front of the conversation. When
/// the conversation starts with a system message of its own, the two are joined (instructions
/// first), since many chat templates take only one system message, at the start.
fn with_instructions(instructions: Option<&str>, conversation: &[v1::ChatMessage]) -> Vec<v1::ChatMessage> {
    let Some(instructions) = instructions else { return conversation.to_vec() };
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    let rest = match conversation.split_first() {
        Some((first, rest)) if first.role == "system" => {
            let content = format!("{instructions}\n\n{}", first.content);
            messages.push(v1::ChatMessage { content, ..first.clone() });
            rest
        }
        _ => {
            messages.push(v1::ChatMessage {
                role: "system".into(),
                content: instructions.to_owned(),
                ..Default::default()
            });
            conversation
        }
    };
    messages.extend(rest.iter().cloned());
    messages
}

fn required(at: &str, field: &str) -> ApiError {
    ApiError::invalid(&format!("{at}.{field}"), format!("{at}.{field}: is required"))
}

fn user_message(content: String) -> v1::ChatMessage {
    v1::ChatMessage { role: "user".into(), content, ..Default::default() }
}

/// Reads `input` into chat messages, appended to `into` (which holds the previous response's
/// conversation, if any). `input` is a string (one user message) or a list of items:
///
/// - messages (`{"role", "content"}`, `type` `message` or absent): roles `user`, `assistant`,
///   `system` and `developer` (a system message); content a string or a list of `input_text` and
///   `output_text` parts (joined by newlines). An earlier output message sent back as it came
///   (with its `id`, `status` and annotations) is read as an assistant message.
/// - `function_call` (`call_id`, `name`, `arguments`): a call the assistant made, joined to the
///   assistant message just before it (text then calls is one turn), else a turn of its own.
/// - `function_call_output` (`call_id`, `output`: a string or `input_text` parts): the call's
///   result, as a tool message.
/// - `reasoning`: accepted and dropped. The model's earlier reasoning is not shown to it again,
///   as chat templates leave out earlier turns' thinking.
///
/// Any other item (images, files, audio, computer, web search or MCP calls, item references) is
/// refused naming its index.
fn read_input(v: Value, into: &mut Vec<v1::ChatMessage>) -> Result<(), ApiError> {
    let items = match v {
        Value::String(s) => {
            into.push(user_message(s));
            return Ok(());
        }
        Value::Array(items) => items,
        other => {
            return Err(ApiError::invalid(
                "input",
                format!("input: expected a string or an array of items, got {}", kind_of(&other)),
            ))
        }
    };
    if items.is_empty() {
        return Err(ApiError::invalid("input", "input: is empty"));
    }
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("input[{i}]");
        let bad = |m: String| ApiError::invalid(&at, format!("{at}: {m}"));
        let Value::Object(mut o) = item else {
            return Err(bad("expected an object (a message or another input item)".into()));
        };
        let kind = match o.remove("type") {
            Some(Value::String(t)) => t,
            None | Some(Value::Null) if o.contains_key("role") => "message".to_owned(),
            None | Some(Value::Null) => return Err(bad("`type` is required".into())),
            Some(other) => return Err(bad(format!("`type` must be a string, got {other}"))),
        };
        let mut f = Fields(o);
        let prefix = format!("{at}.");
        let re = |e: ApiError| rename(e, &prefix);
        match kind.as_str() {
            "message" => into.push(input_message(f, &at)?),
            "function_call" => {
                let call_id: String =
                    f.take("call_id").map_err(re)?.ok_or_else(|| required(&at, "call_id"))?;
                let name: String = f.take("name").map_err(re)?.ok_or_else(|| required(&at, "name"))?;
                let arguments: String =
                    f.take("arguments").map_err(re)?.ok_or_else(|| required(&at, "arguments"))?;
                // A call sent back as it came out carries its item id and status, and from the
                // package's parsing helpers its parsed arguments.
                for echoed in ["id", "status", "parsed_arguments"] {
                    f.take_raw(echoed);
                }
                f.finish().map_err(re)?;
                let call = v1::ToolCall { id: call_id, name, arguments };
                match into.last_mut() {
                    Some(m) if m.role == "assistant" => m.tool_calls.push(call),
                    _ => into.push(v1::ChatMessage {
                        role: "assistant".into(),
                        tool_calls: vec![call],
                        ..Default::default()
                    }),
                }
            }
            "function_call_output" => {
                let call_id: String =
                    f.take("call_id").map_err(re)?.ok_or_else(|| required(&at, "call_id"))?;
                let content = match f.take_raw("output") {
                    None => return Err(required(&at, "output")),
                    Some(Value::String(s)) => s,
                    Some(Value::Array(parts)) => text_parts(parts, &format!("{at}.output"), &["input_text"])?,
                    Some(other) => {
                        return Err(ApiError::invalid(
                            &format!("{at}.output"),
                            format!("{at}.output: expected a string or text parts, got {}", kind_of(&other)),
                        ))
                    }
                };
                for echoed in ["id", "status"] {
                    f.take_raw(echoed);
                }
                f.finish().map_err(re)?;
                into.push(v1::ChatMessage {
                    role: "tool".into(),
                    content,
                    tool_call_id: Some(call_id),
                    ..Default::default()
                });
            }
            "reasoning" => {}
            other => {
                return Err(bad(format!(
                    "items of type `{other}` are not supported (message, function_call, \
                     function_call_output and reasoning are)"
                )))
            }
        }
    }
    Ok(())
}

/// One message item of `input`.
fn input_message(mut f: Fields, at: &str) -> Result<v1::ChatMessage, ApiError> {
    let prefix = format!("{at}.");
    let re = |e: ApiError| rename(e, &prefix);
    let role: String = f.take("role").map_err(re)?.ok_or_else(|| required(at, "role"))?;
    let role = match role.as_str() {
        "user" | "assistant" | "system" => role,
        // OpenAI's newer name for system instructions; chat templates know `system`.
        "developer" => "system".to_owned(),
        other => {
            return Err(ApiError::invalid(
                &format!("{at}.role"),
                format!("{at}.role: `{other}` is not supported (user, assistant, system, developer)"),
            ))
        }
    };
    let content = match f.take_raw("content") {
        None => return Err(required(at, "content")),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            text_parts(parts, &format!("{at}.content"), &["input_text", "output_text"])?
        }
        Some(other) => {
            return Err(ApiError::invalid(
                &format!("{at}.content"),
                format!("{at}.content: expected a string or an array of parts, got {}", kind_of(&other)),
            ))
        }
    };
    // An earlier output message sent back as it came.
    for echoed in ["id", "status", "phase"] {
        f.take_raw(echoed);
    }
    f.finish().map_err(re)?;
    Ok(v1::ChatMessage { role, content, ..Default::default() })
}

/// Text parts (`{"type": one of kinds, "text"}`) joined by newlines; `at` names the list.
fn text_parts(parts: Vec<Value>, at: &str, kinds: &[&str]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.into_iter().enumerate() {
        let here = format!("{at}[{j}]");
        let Value::Object(o) = p else {
            return Err(ApiError::invalid(&here, format!("{here}: expected an object")));
        };
        let kind = o.get("type").and_then(Value::as_str).unwrap_or_default().to_owned();
        if !kinds.contains(&kind.as_str()) {
            return Err(ApiError::invalid(
                &here,
                format!("{here}: `{kind}` parts are not supported (only text: {})", kinds.join(", ")),
            ));
        }
        let mut part = Fields(o);
        part.0.remove("type");
        let prefix = format!("{here}.");
        let re = |e: ApiError| rename(e, &prefix);
        let text: String = part.take("text").map_err(re)?.ok_or_else(|| required(&here, "text"))?;
        if kind == "output_text" {
            // An earlier answer's part sent back as it came.
            for echoed in ["annotations", "logprobs", "parsed"] {
                part.take_raw(echoed);
            }
        }
        part.finish().map_err(re)?;
        texts.push(text);
    }
    Ok(texts.join("\n"))
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `metadata`: string values under string keys, repeated in the response (`{}` when absent).
fn metadata(v: Option<Value>) -> Result<Value, ApiError> {
    let Some(v) = v else { return Ok(json!({})) };
    let bad = |m: String| ApiError::invalid("metadata", format!("metadata: {m}"));
    let Value::Object(o) = &v else { return Err(bad("expected an object of strings".into())) };
    if o.len() > MAX_METADATA_PAIRS {
        return Err(bad(format!("at most {MAX_METADATA_PAIRS} pairs, got {}", o.len())));
    }
    for (k, val) in o {
        if k.chars().count() > MAX_METADATA_KEY {
            return Err(bad(format!("key `{k}` is longer than {MAX_METADATA_KEY} characters")));
        }
        match val {
            Value::String(s) if s.chars().count() > MAX_METADATA_VALUE => {
                return Err(bad(format!("the value of `{k}` is longer than {MAX_METADATA_VALUE} characters")))
            }
            Value::String(_) => {}
            other => return Err(bad(format!("the value of `{k}` must be a string, got {}", kind_of(other)))),
        }
    }
    Ok(v)
}

/// `reasoning`: its `effort` turns the template's thinking switch (`enable_thinking`) off for
/// `none` and `minimal` and on for the others; a template without one is not changed by it.
/// Summaries are not served (the reasoning comes whole, as `reasoning_text`). Gives the object the
/// response repeats, and the switch.
fn reasoning(v: Option<Value>) -> Result<(Value, Option<bool>), ApiError> {
    let Some(v) = v else { return Ok((json!({"effort": null, "summary": null}), None)) };
    let Value::Object(o) = v else {
        return Err(ApiError::invalid("reasoning", "reasoning: expected an object"));
    };
    let mut f = Fields(o);
    let re = |e: ApiError| rename(e, "reasoning.");
    let effort: Option<String> = f.take("effort").map_err(re)?;
    for field in ["summary", "generate_summary"] {
        if let Some(s) = f.take::<String>(field).map_err(re)? {
            return Err(ApiError::invalid(
                &format!("reasoning.{field}"),
                format!(
                    "reasoning.{field}: reasoning summaries are not served (the reasoning comes whole, as \
                     reasoning_text); got `{s}`"
                ),
            ));
        }
    }
    f.finish().map_err(re)?;
    let thinking = match effort.as_deref() {
        None => None,
        Some("none" | "minimal") => Some(false),
        Some("low" | "medium" | "high" | "xhigh" | "max") => Some(true),
        Some(other) => {
            return Err(ApiError::invalid(
                "reasoning.effort",
                format!(
                    "reasoning.effort: `{other}` is not one of none, minimal, low, medium, high, xhigh, max"
                ),
            ))
        }
    };
    Ok((json!({"effort": effort, "summary": null}), thinking))
}

/// `text`: `format` (`text`, `json_object`, or `json_schema` with its `schema`) becomes the
/// answer's constraint; `verbosity` is accepted only as `medium`. Gives the object the response
/// repeats, and the constraint.
fn text_config(v: Option<Value>) -> Result<(Value, Option<Constraint>), ApiError> {
    let plain = json!({"type": "text"});
    let Some(v) = v else { return Ok((json!({"format": plain, "verbosity": "medium"}), None)) };
    let Value::Object(o) = v else {
        return Err(ApiError::invalid("text", "text: expected an object"));
    };
    let mut f = Fields(o);
    let re = |e: ApiError| rename(e, "text.");
    if let Some(v) = f.take::<String>("verbosity").map_err(re)? {
        if v != "medium" {
            return Err(ApiError::invalid(
                "text.verbosity",
                format!(
                    "text.verbosity: only `medium` is served (answers are not steered by length); got `{v}`"
                ),
            ));
        }
    }
    let format = f.take_raw("format");
    f.finish().map_err(re)?;
    let (format, constraint) = match format {
        None => (plain, None),
        Some(Value::Object(o)) => text_format(Fields(o))?,
        Some(other) => {
            return Err(ApiError::invalid(
                "text.format",
                format!("text.format: expected an object, got {}", kind_of(&other)),
            ))
        }
    };
    Ok((json!({"format": format, "verbosity": "medium"}), constraint))
}

/// `text.format`: the format as the response repeats it, and its constraint.
fn text_format(mut f: Fields) -> Result<(Value, Option<Constraint>), ApiError> {
    let re = |e: ApiError| rename(e, "text.format.");
    let kind: String = f.take("type").map_err(re)?.ok_or_else(|| {
        ApiError::invalid(
            "text.format.type",
            "text.format.type: is required (text, json_object or json_schema)",
        )
    })?;
    let (echo, constraint) = match kind.as_str() {
        "text" => (json!({"type": "text"}), None),
        "json_object" => (json!({"type": "json_object"}), Some(Constraint::JsonObject)),
        "json_schema" => {
            let name: Option<String> = f.take("name").map_err(re)?;
            let description: Option<String> = f.take("description").map_err(re)?;
            // Every answer obeys the schema whether or not `strict` is set.
            let strict: Option<bool> = f.take("strict").map_err(re)?;
            let schema = match f.take_raw("schema") {
                None => {
                    return Err(ApiError::invalid("text.format.schema", "text.format.schema: is required"))
                }
                Some(s @ Value::Object(_)) => s,
                Some(other) => {
                    return Err(ApiError::invalid(
                        "text.format.schema",
                        format!("text.format.schema: expected a JSON Schema object, got {}", kind_of(&other)),
                    ))
                }
            };
            let mut echo = json!({"type": "json_schema", "name": name, "schema": schema, "strict": strict});
            if let Some(d) = description {
                echo["description"] = json!(d);
            }
            (echo, Some(Constraint::JsonSchema(schema.to_string())))
        }
        other => {
            return Err(ApiError::invalid(
                "text.format.type",
                format!("text.format.type: `{other}` is not supported (text, json_object or json_schema)"),
            ))
        }
    };
    f.finish().map_err(re)?;
    if let Some(c) = &constraint {
        c.check_shape().map_err(|e| ApiError::invalid("text.format", format!("text.format: {e}")))?;
    }
    Ok((echo, constraint))
}

/// The request's tools as read: what the chat is built with, and what the response repeats.
struct ToolsRead {
    /// `None` when there are no tools (or none may be called and none were given).
    spec: Option<ToolSpec>,
    echo: Value,
    choice: Value,
    parallel: bool,
}

/// Reads `tools` (function tools only: `{"type": "function", "name", "description",
/// "parameters", "strict"}`), `tool_choice` and `parallel_tool_calls`.
fn tools(f: &mut Fields) -> Result<ToolsRead, ApiError> {
    let list = f.take_raw("tools");
    let choice = f.take_raw("tool_choice");
    let parallel = f.take::<bool>("parallel_tool_calls")?.unwrap_or(true);
    let items = match list {
        None => Vec::new(),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(ApiError::invalid(
                "tools",
                format!("tools: expected an array of tools, got {}", kind_of(&other)),
            ))
        }
    };
    chat::check_tool_count(items.len(), "tools")?;
    let mut defs: Vec<ToolDef> = Vec::with_capacity(items.len());
    let mut echo = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("tools[{i}]");
        let Value::Object(o) = item else {
            return Err(ApiError::invalid(&at, format!("{at}: expected an object")));
        };
        let mut t = Fields(o);
        let prefix = format!("{at}.");
        let re = |e: ApiError| rename(e, &prefix);
        let kind: String = t.take("type").map_err(re)?.ok_or_else(|| required(&at, "type"))?;
        if kind != "function" {
            return Err(ApiError::invalid(
                &format!("{at}.type"),
                format!(
                    "{at}.type: `{kind}` tools are not served here; only `function` tools are (built-in \
                     tools such as web_search, file_search, code_interpreter, computer_use, mcp and \
                     image_generation are not)"
                ),
            ));
        }
        let name: String = t.take("name").map_err(re)?.ok_or_else(|| required(&at, "name"))?;
        chat::check_tool_name(&name, &defs, &at)?;
        let description: Option<String> = t.take("description").map_err(re)?;
        let given = t.take_raw("parameters");
        let parameters = chat::tool_parameters(given.as_ref(), &format!("{at}.parameters"))?;
        // A call's arguments obey the schema whenever the call is forced (`required`, a named
        // tool, or the generic format), whether or not `strict` is set.
        let strict: Option<bool> = t.take("strict").map_err(re)?;
        t.finish().map_err(re)?;
        echo.push(json!({"type": "function", "name": name, "description": description,
                         "parameters": parameters, "strict": strict}));
        defs.push(ToolDef { name, description, parameters });
    }
    let choice_error = || {
        ApiError::invalid(
            "tool_choice",
            "tool_choice: expected none, auto, required or {\"type\": \"function\", \"name\": ...} \
             (built-in tool types, allowed_tools, mcp and custom choices are not served)",
        )
    };
    let (choice, choice_echo) = match choice {
        None => (ToolChoice::Auto, json!("auto")),
        Some(Value::String(s)) => match s.as_str() {
            "none" => (ToolChoice::None, json!(s)),
            "auto" => (ToolChoice::Auto, json!(s)),
            "required" => (ToolChoice::Required, json!(s)),
            _ => return Err(choice_error()),
        },
        Some(Value::Object(o)) => {
            let mut c = Fields(o);
            let re = |e: ApiError| rename(e, "tool_choice.");
            let kind: Option<String> = c.take("type").map_err(re)?;
            if kind.as_deref() != Some("function") {
                return Err(choice_error());
            }
            let name: String = c.take("name").map_err(re)?.ok_or_else(|| required("tool_choice", "name"))?;
            c.finish().map_err(re)?;
            chat::check_named(&name, &defs, "tool_choice")?;
            (ToolChoice::Named(name.clone()), json!({"type": "function", "name": name}))
        }
        Some(_) => return Err(choice_error()),
    };
    let spec = if defs.is_empty() {
        if matches!(choice, ToolChoice::Required) {
            return Err(ApiError::invalid("tool_choice", "tool_choice: `required` needs tools"));
        }
        None
    } else {
        Some(ToolSpec { defs, choice, parallel })
    };
    Ok(ToolsRead { spec, echo: Value::Array(echo), choice: choice_echo, parallel })
}

// ---------------------------------------------------------------------------------------------
// The response
// ---------------------------------------------------------------------------------------------

/// Which output item is being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ItemKind {
    Reasoning,
    Message,
}

/// The output item being written while the answer comes.
struct OpenItem {
    kind: ItemKind,
    id: String,
    index: usize,
    text: String,
}

/// Shapes one request's [`GenerateResponse`] stream into a response object and its events. The
/// answer's pieces open, fill and close output items in the order they come (reasoning, then
/// the message); the calls, read from the finished answer, follow. Answered at once, the events
/// are built the same way and dropped, so that both give the same output. Once finished, a
/// response to keep goes into the store with its conversation.
pub struct Shaper {
    id: String,
    created_at: u64,
    /// The response object's fields that repeat the request's.
    echo: Map<String, Value>,
    reader: AnswerReader,
    /// Where the finished response is kept (`store`), when it is.
    store: Option<Arc<Store>>,
    /// The conversation without the instructions, the answer added once finished.
    conversation: Vec<v1::ChatMessage>,
    /// The next event's `sequence_number`.
    seq: u64,
    started: bool,
    open: Option<OpenItem>,
    /// Finished output items.
    items: Vec<Value>,
    /// The message's text, as the conversation keeps it.
    message_text: String,
    has_message: bool,
    usage: Option<v1::Usage>,
    /// The finished response.
    done: Option<Value>,
}

impl Shaper {
    pub fn new(
        output: OutputPlan,
        tok: Tokenizer,
        echo: Map<String, Value>,
        conversation: Vec<v1::ChatMessage>,
        store: Option<Arc<Store>>,
    ) -> Shaper {
        Shaper {
            id: format!("resp_{}", random_id()),
            created_at: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            echo,
            reader: AnswerReader::new(output, tok),
            store,
            conversation,
            seq: 0,
            started: false,
            open: None,
            items: Vec::new(),
            message_text: String::new(),
            has_message: false,
            usage: None,
            done: None,
        }
    }

    /// The response's id (`resp_...`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The response object as it stands, with `status`.
    fn snapshot(&self, status: &str) -> Value {
        let mut v = Map::new();
        v.insert("id".into(), json!(self.id));
        v.insert("object".into(), json!("response"));
        v.insert("created_at".into(), json!(self.created_at));
        v.insert("status".into(), json!(status));
        v.insert("incomplete_details".into(), Value::Null);
        v.insert("error".into(), Value::Null);
        v.insert("output".into(), Value::Array(self.items.clone()));
        v.insert("usage".into(), self.usage_json());
        for (k, val) in &self.echo {
            v.insert(k.clone(), val.clone());
        }
        Value::Object(v)
    }

    fn usage_json(&self) -> Value {
        match &self.usage {
            Some(u) => json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }),
            None => Value::Null,
        }
    }

    /// Numbers an event and adds it to `out`.
    fn emit(&mut self, out: &mut Vec<Value>, mut event: Value) {
        event["sequence_number"] = json!(self.seq);
        self.seq += 1;
        out.push(event);
    }

    /// The events one response becomes (the first one's start with `response.created`).
    pub fn events(&mut self, r: &GenerateResponse) -> Vec<Value> {
        let mut out = Vec::new();
        if self.done.is_some() {
            return out;
        }
        self.start(&mut out);
        if r.usage.is_some() {
            self.usage = r.usage;
        }
        let mut pieces = self.reader.push(r);
        let mut calls = Vec::new();
        if r.finish_reason.is_some() {
            let (rest, c) = self.reader.finish();
            pieces.extend(rest);
            calls = c;
        }
        for p in pieces {
            self.piece(p, &mut out);
        }
        if let Some(reason) = &r.finish_reason {
            self.complete(reason == "length", calls, &mut out);
        }
        out
    }

    fn start(&mut self, out: &mut Vec<Value>) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        let snapshot = self.snapshot("in_progress");
        self.emit(out, json!({"type": "response.created", "response": snapshot}));
        self.emit(out, json!({"type": "response.in_progress", "response": snapshot}));
    }

    /// A piece of reasoning or text: a delta of the open item of its kind, opened when needed.
    fn piece(&mut self, p: Piece, out: &mut Vec<Value>) {
        let (kind, delta) = match p {
            Piece::Reasoning(t) => (ItemKind::Reasoning, t),
            Piece::Text(t) => (ItemKind::Message, t),
        };
        if self.open.as_ref().map(|o| o.kind) != Some(kind) {
            self.close("completed", out);
            self.open_item(kind, out);
        }
        let Some(open) = self.open.as_mut() else { return };
        open.text.push_str(&delta);
        let (item_id, output_index) = (open.id.clone(), open.index);
        let event = match kind {
            ItemKind::Message => json!({"type": "response.output_text.delta", "item_id": item_id,
                "output_index": output_index, "content_index": 0, "delta": delta, "logprobs": []}),
            ItemKind::Reasoning => json!({"type": "response.reasoning_text.delta", "item_id": item_id,
                "output_index": output_index, "content_index": 0, "delta": delta}),
        };
        self.emit(out, event);
    }

    fn open_item(&mut self, kind: ItemKind, out: &mut Vec<Value>) {
        let index = self.items.len();
        let (id, item, part) = match kind {
            ItemKind::Message => {
                let id = format!("msg_{}", random_id());
                let item = json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant",
                                  "content": []});
                (id, item, json!({"type": "output_text", "text": "", "annotations": []}))
            }
            ItemKind::Reasoning => {
                let id = format!("rs_{}", random_id());
                let item = json!({"type": "reasoning", "id": id, "summary": [], "content": [],
                                  "status": "in_progress"});
                (id, item, json!({"type": "reasoning_text", "text": ""}))
            }
        };
        self.emit(out, json!({"type": "response.output_item.added", "output_index": index, "item": item}));
        self.emit(
            out,
            json!({"type": "response.content_part.added", "item_id": id, "output_index": index,
                   "content_index": 0, "part": part}),
        );
        self.open = Some(OpenItem { kind, id, index, text: String::new() });
    }

    /// Closes the open item, if any, with `status`.
    fn close(&mut self, status: &str, out: &mut Vec<Value>) {
        let Some(OpenItem { kind, id, index, text }) = self.open.take() else { return };
        let (done, part, item) = match kind {
            ItemKind::Message => {
                let part = json!({"type": "output_text", "text": text, "annotations": []});
                let done = json!({"type": "response.output_text.done", "item_id": id, "output_index": index,
                                  "content_index": 0, "text": text, "logprobs": []});
                let item = json!({"type": "message", "id": id, "status": status, "role": "assistant",
                                  "content": [part]});
                self.message_text.push_str(&text);
                self.has_message = true;
                (done, part, item)
            }
            ItemKind::Reasoning => {
                let part = json!({"type": "reasoning_text", "text": text});
                let done = json!({"type": "response.reasoning_text.done", "item_id": id,
                                  "output_index": index, "content_index": 0, "text": text});
                let item = json!({"type": "reasoning", "id": id, "summary": [], "content": [part],
                                  "status": status});
                (done, part, item)
            }
        };
        self.emit(out, done);
        self.emit(
            out,
            json!({"type": "response.content_part.done", "item_id": id, "output_index": index,
                   "content_index": 0, "part": part}),
        );
        self.emit(out, json!({"type": "response.output_item.done", "output_index": index, "item": item}));
        self.items.push(item);
    }

    /// The answer's end: the open item closed, the calls' items, the finished response (kept in
    /// the store when asked), and `response.completed` (`response.incomplete` when `cut` short by
    /// max_output_tokens or the context).
    fn complete(&mut self, cut: bool, calls: Vec<ParsedCall>, out: &mut Vec<Value>) {
        let status = if cut { "incomplete" } else { "completed" };
        self.close(status, out);
        let mut tool_calls = Vec::with_capacity(calls.len());
        for c in calls {
            let index = self.items.len();
            let id = format!("fc_{}", random_id());
            let call_id = format!("call_{}", random_id());
            let added = json!({"type": "function_call", "id": id, "call_id": call_id, "name": c.name,
                               "arguments": "", "status": "in_progress"});
            self.emit(
                out,
                json!({"type": "response.output_item.added", "output_index": index, "item": added}),
            );
            self.emit(
                out,
                json!({"type": "response.function_call_arguments.delta", "item_id": id,
                       "output_index": index, "delta": c.arguments}),
            );
            self.emit(
                out,
                json!({"type": "response.function_call_arguments.done", "item_id": id,
                       "output_index": index, "arguments": c.arguments}),
            );
            let item = json!({"type": "function_call", "id": id, "call_id": call_id, "name": c.name,
                              "arguments": c.arguments, "status": "completed"});
            self.emit(out, json!({"type": "response.output_item.done", "output_index": index, "item": item}));
            self.items.push(item);
            tool_calls.push(v1::ToolCall { id: call_id, name: c.name, arguments: c.arguments });
        }
        if !self.has_message && tool_calls.is_empty() {
            // An answer without text or calls still has its message, empty.
            self.open_item(ItemKind::Message, out);
            self.close(status, out);
        }
        let mut response = self.snapshot(status);
        if cut {
            response["incomplete_details"] = json!({"reason": "max_output_tokens"});
        } else {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
            response["completed_at"] = json!(now);
        }
        if let Some(store) = &self.store {
            let mut conversation = std::mem::take(&mut self.conversation);
            conversation.push(v1::ChatMessage {
                role: "assistant".into(),
                content: std::mem::take(&mut self.message_text),
                tool_calls,
                ..Default::default()
            });
            store.put(&self.id, response.clone(), conversation);
        }
        let kind = if cut { "response.incomplete" } else { "response.completed" };
        self.emit(out, json!({"type": kind, "response": response}));
        self.done = Some(response);
    }

    /// The events that end a stream that failed after it started: `response.failed`, with the
    /// error and the items finished so far.
    pub fn failed(&mut self, e: &ApiError) -> Vec<Value> {
        let mut out = Vec::new();
        self.start(&mut out);
        self.open = None;
        let code =
            if e.status == StatusCode::TOO_MANY_REQUESTS { "rate_limit_exceeded" } else { "server_error" };
        let mut response = self.snapshot("failed");
        response["error"] = json!({"code": code, "message": e.message});
        self.emit(&mut out, json!({"type": "response.failed", "response": response}));
        out
    }
}

/// One server-sent event of the Responses API: `event: <type>` and the event's JSON.
fn sse_event(v: &Value) -> String {
    format!("event: {}\ndata: {v}\n\n", v["type"].as_str().unwrap_or("message"))
}

impl Shape for Shaper {
    fn stream(&mut self, r: &GenerateResponse) -> String {
        self.events(r).iter().map(sse_event).collect()
    }

    fn stream_error(&mut self, e: &ApiError) -> String {
        self.failed(e).iter().map(sse_event).collect()
    }

    fn stream_end(&mut self) -> String {
        String::new()
    }

    fn finished(&self) -> bool {
        self.done.is_some()
    }

    fn absorb(&mut self, r: &GenerateResponse) {
        self.events(r);
    }

    fn response(&mut self) -> Value {
        self.done.clone().unwrap_or_else(|| self.snapshot("in_progress"))
    }

    fn prompt_param(&self) -> &'static str {
        "input"
    }

    fn max_tokens_param(&self) -> &'static str {
        "max_output_tokens"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::NoAdapters;
    use tandem_proto::v1::generate_request::Prompt;

    /// The tiny llama-gqa fixture's tokenizer: byte-level BPE, a chat template that renders no
    /// tools (so tools take the generic format) and no thinking block.
    fn fixture_tokenizer() -> Tokenizer {
        crate::api::test_support::tokenizer(None)
    }

    /// The fixture's tokenizer with the chat template `name` of tests/reference/templates.
    fn templated_tokenizer(name: &str) -> Tokenizer {
        crate::api::test_support::tokenizer(Some(name))
    }

    fn served<'a>(tok: &'a Tokenizer, store: Option<&'a Arc<Store>>) -> Served<'a> {
        Served {
            model: "tiny",
            adapters: &NoAdapters,
            context_len: 512,
            tokenizer: Some(tok),
            responses: store,
        }
    }

    fn body(extra: Value) -> Vec<u8> {
        let mut b = json!({"model": "tiny", "input": "Hello"});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b.to_string().into_bytes()
    }

    fn messages(r: &GenerateRequest) -> Vec<v1::ChatMessage> {
        match &r.prompt {
            Some(Prompt::Chat(c)) => c.messages.clone(),
            other => panic!("not a chat prompt: {other:?}"),
        }
    }

    fn roles(ms: &[v1::ChatMessage]) -> Vec<&str> {
        ms.iter().map(|m| m.role.as_str()).collect()
    }

    /// `text` as the router streams it: `per` tokens a message, the last with the finish reason
    /// and the usage.
    fn generated(tok: &Tokenizer, text: &str, per: usize, finish: &str) -> Vec<GenerateResponse> {
        let mut ids = tok.encode(text, false).unwrap();
        if finish == "stop" {
            ids.push(tok.eos_token_ids()[0]);
        }
        let n = ids.len();
        let chunks: Vec<&[u32]> = ids.chunks(per).collect();
        let last = chunks.len() - 1;
        chunks
            .into_iter()
            .enumerate()
            .map(|(i, c)| GenerateResponse {
                token_ids: c.to_vec(),
                text: tok.decode(c, true).unwrap(),
                finish_reason: (i == last).then(|| finish.to_owned()),
                usage: (i == last).then_some(v1::Usage {
                    prompt_tokens: 7,
                    completion_tokens: n as u32,
                    cached_tokens: 2,
                }),
                request_id: if i == 0 { "r1".into() } else { String::new() },
                ..Default::default()
            })
            .collect()
    }

    fn shaper(parsed: Parsed, tok: &Tokenizer, store: Option<Arc<Store>>) -> Shaper {
        let store = if parsed.store { store } else { None };
        Shaper::new(parsed.output, tok.clone(), parsed.echo, parsed.conversation, store)
    }

    fn streamed(sh: &mut Shaper, rs: &[GenerateResponse]) -> Vec<Value> {
        rs.iter().flat_map(|r| sh.events(r)).collect()
    }

    fn types(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    fn weather_tool() -> Value {
        json!([{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": false},
                "strict": true}])
    }

    #[test]
    fn fields_map_to_the_generate_request_and_the_response_repeats_them() {
        let tok = fixture_tokenizer();
        let p = parse(
            &body(json!({"instructions": "Be brief.", "max_output_tokens": 40, "temperature": 0.25,
                         "top_p": 0.5, "user": "ana", "metadata": {"k": "v"}, "stream": true,
                         "store": false, "truncation": "disabled", "include": [], "background": false,
                         "reasoning": {"effort": "minimal", "summary": null},
                         "text": {"verbosity": "medium", "format": {"type": "json_object"}},
                         "service_tier": null})),
            &served(&tok, None),
        )
        .unwrap();
        let r = &p.request;
        assert_eq!(r.max_tokens, Some(40));
        assert!(r.max_tokens_must_fit, "a max_output_tokens given must fit");
        let s = r.sampling.unwrap();
        assert_eq!((s.temperature, s.top_p), (Some(0.25), Some(0.5)));
        assert_eq!(r.cache_salt, "user:ana");
        assert_eq!(r.n, 1);
        assert!(r.constraint.is_some(), "text.format json_object constrains the answer");
        let ms = messages(r);
        assert_eq!(roles(&ms), ["system", "user"]);
        assert_eq!((ms[0].content.as_str(), ms[1].content.as_str()), ("Be brief.", "Hello"));
        let Some(Prompt::Chat(c)) = &r.prompt else { panic!() };
        assert_eq!(c.enable_thinking, Some(false), "effort minimal turns thinking off");
        assert!(p.stream && !p.store);
        assert_eq!(p.conversation.len(), 1, "the instructions are not part of the conversation");
        let e = &p.echo;
        assert_eq!(e["instructions"], "Be brief.");
        assert_eq!(e["max_output_tokens"], 40);
        assert_eq!(e["temperature"], 0.25);
        assert_eq!(e["top_p"], 0.5);
        assert_eq!(e["metadata"], json!({"k": "v"}));
        assert_eq!(e["text"]["format"], json!({"type": "json_object"}));
        assert_eq!(e["reasoning"], json!({"effort": "minimal", "summary": null}));
        assert_eq!(e["store"], false);
        assert_eq!(e["tool_choice"], "auto");
        assert_eq!(e["tools"], json!([]));
        assert_eq!(e["model"], "tiny");
    }

    #[test]
    fn defaults_follow_openai() {
        let tok = fixture_tokenizer();
        let p = parse(&body(json!({})), &served(&tok, None)).unwrap();
        let r = &p.request;
        assert_eq!(r.max_tokens, Some(512), "up to the context");
        assert!(!r.max_tokens_must_fit, "without max_output_tokens the context may cut it short");
        assert_eq!(r.sampling.unwrap().temperature, Some(1.0));
        assert_eq!(r.cache_salt, "");
        assert!(r.constraint.is_none());
        assert!(p.store && !p.stream);
        assert_eq!(roles(&messages(r)), ["user"]);
        assert!(p.output.is_plain());
        assert_eq!(p.echo["parallel_tool_calls"], true);
        assert_eq!(p.echo["text"], json!({"format": {"type": "text"}, "verbosity": "medium"}));
        assert_eq!(p.echo["metadata"], json!({}));
        assert_eq!(p.echo["previous_response_id"], Value::Null);
        let p = parse(&body(json!({"reasoning": {"effort": "high"}})), &served(&tok, None)).unwrap();
        let Some(Prompt::Chat(c)) = &p.request.prompt else { panic!() };
        assert_eq!(c.enable_thinking, Some(true));
    }

    #[test]
    fn every_refusal_names_its_field() {
        let tok = fixture_tokenizer();
        let store = Arc::new(Store::new(4, Duration::from_secs(60)));
        let s = served(&tok, Some(&store));
        let cases: Vec<(Value, &str, &str)> = vec![
            (json!({"bogus": 1}), "bogus", "unknown parameter `bogus`"),
            (
                json!({"tools": [{"type": "web_search"}]}),
                "tools[0].type",
                "`web_search` tools are not served",
            ),
            (json!({"tools": [{"type": "file_search"}]}), "tools[0].type", "only `function` tools"),
            (
                json!({"tools": [{"type": "function", "name": "f"}, {"type": "code_interpreter"}]}),
                "tools[1].type",
                "code_interpreter",
            ),
            (json!({"tools": [{"type": "function"}]}), "tools[0].name", "is required"),
            (json!({"tools": [{"type": "function", "name": "bad name"}]}), "tools[0]", "tool name"),
            (
                json!({"tools": [{"type": "function", "name": "f", "defer_loading": true}]}),
                "tools[0].defer_loading",
                "unknown parameter",
            ),
            (
                json!({"tools": [{"type": "function", "name": "f", "parameters": 3}]}),
                "tools[0].parameters",
                "JSON Schema object",
            ),
            (json!({"tool_choice": "sometimes"}), "tool_choice", "expected none, auto, required"),
            (json!({"tool_choice": {"type": "web_search_preview"}}), "tool_choice", "built-in"),
            (json!({"tool_choice": "required"}), "tool_choice", "needs tools"),
            (
                json!({"tools": weather_tool(), "tool_choice": {"type": "function", "name": "fly"}}),
                "tool_choice",
                "unknown tool name `fly`",
            ),
            (json!({"background": true}), "background", "not supported"),
            (json!({"conversation": "conv_1"}), "conversation", "not supported by this server"),
            (json!({"prompt": {"id": "p"}}), "prompt", "not supported by this server"),
            (json!({"service_tier": "flex"}), "service_tier", "not supported by this server"),
            (json!({"max_tool_calls": 3}), "max_tool_calls", "not supported by this server"),
            (json!({"top_logprobs": 2}), "top_logprobs", "not supported by this server"),
            (json!({"stream_options": {}}), "stream_options", "not supported by this server"),
            (json!({"safety_identifier": "x"}), "safety_identifier", "not supported by this server"),
            (json!({"prompt_cache_key": "x"}), "prompt_cache_key", "not supported by this server"),
            (json!({"truncation": "auto"}), "truncation", "only `disabled`"),
            (json!({"include": ["reasoning.encrypted_content"]}), "include", "reasoning.encrypted_content"),
            (json!({"text": {"verbosity": "low"}}), "text.verbosity", "only `medium`"),
            (json!({"text": {"format": {"type": "grammar"}}}), "text.format.type", "`grammar`"),
            (
                json!({"text": {"format": {"type": "json_schema", "name": "x"}}}),
                "text.format.schema",
                "required",
            ),
            (json!({"text": {"format": {"type": "text", "x": 1}}}), "text.format.x", "unknown parameter"),
            (json!({"text": {"colour": 1}}), "text.colour", "unknown parameter"),
            (
                json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}}),
                "text.format",
                "invalid json_schema",
            ),
            (json!({"reasoning": {"summary": "auto"}}), "reasoning.summary", "summaries are not served"),
            (json!({"reasoning": {"effort": "huge"}}), "reasoning.effort", "`huge`"),
            (json!({"metadata": {"k": 1}}), "metadata", "must be a string"),
            (json!({"max_output_tokens": 0}), "max_output_tokens", "at least 1"),
            (json!({"max_output_tokens": 100000}), "max_output_tokens", "context length of 512"),
            (json!({"temperature": "hot"}), "temperature", "invalid type"),
            (json!({"instructions": ["a"]}), "instructions", "invalid type"),
            (json!({"user": "u".repeat(1000)}), "user", "at most"),
            (json!({"input": null}), "input", "input: is required"),
            (json!({"input": []}), "input", "input: is empty"),
            (json!({"input": 3}), "input", "expected a string or an array"),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
                "input[0].content[0]",
                "`input_image` parts are not supported",
            ),
            (
                json!({"input": [{"role": "user", "content": "a"}, {"type": "computer_call", "call_id": "c"}]}),
                "input[1]",
                "items of type `computer_call` are not supported",
            ),
            (json!({"input": [{"type": "item_reference", "id": "x"}]}), "input[0]", "`item_reference`"),
            (
                json!({"input": [{"role": "tool", "content": "a"}]}),
                "input[0].role",
                "`tool` is not supported",
            ),
            (json!({"input": [{"role": "user"}]}), "input[0].content", "is required"),
            (json!({"input": [{"role": "user", "content": "a", "x": 1}]}), "input[0].x", "unknown parameter"),
            (
                json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
                "input[0].call_id",
                "is required",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c"}]}),
                "input[0].output",
                "is required",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c",
                                  "output": [{"type": "input_file", "file_id": "f"}]}]}),
                "input[0].output[0]",
                "`input_file` parts",
            ),
            (json!({"input": ["a"]}), "input[0]", "expected an object"),
            (json!({"input": [{"content": "a"}]}), "input[0]", "`type` is required"),
            (json!({"previous_response_id": "resp_nope"}), "previous_response_id", "resp_nope"),
        ];
        for (extra, param, fragment) in cases {
            let e = parse(&body(extra.clone()), &s).expect_err(&extra.to_string());
            assert_eq!(e.param.as_deref(), Some(param), "{extra}: {e:?}");
            assert!(e.message.contains(fragment), "{extra}: {:?} lacks {fragment:?}", e.message);
            assert!(e.message.contains(param), "{extra}: the message names {param}: {:?}", e.message);
        }
        let e = parse(br#"{"model": "big", "input": "x"}"#, &s).unwrap_err();
        assert_eq!((e.status, e.code), (StatusCode::NOT_FOUND, Some("model_not_found")));
        let e = parse(br#"{"input": "x"}"#, &s).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
    }

    #[test]
    fn input_items_become_chat_messages() {
        let tok = fixture_tokenizer();
        let input = json!([
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                             {"type": "input_text", "text": "in Oslo?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
             "arguments": "{\"city\": \"Oslo\"}", "status": "completed"},
            {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": "{\"city\": \"Bergen\"}"},
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "function_call", "call_id": "call_c", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_c", "output": "?"},
            {"role": "user", "content": "Thanks"}
        ]);
        let p = parse(&body(json!({"input": input, "tools": weather_tool()})), &served(&tok, None)).unwrap();
        let ms = messages(&p.request);
        assert_eq!(roles(&ms), ["system", "user", "assistant", "tool", "tool", "assistant", "tool", "user"]);
        assert_eq!(ms[0].content, "Use tools.");
        assert_eq!(ms[1].content, "Weather\nin Oslo?");
        assert_eq!(ms[2].content, "Checking.", "reasoning items are dropped");
        let calls: Vec<(&str, &str)> =
            ms[2].tool_calls.iter().map(|c| (c.id.as_str(), c.name.as_str())).collect();
        assert_eq!(calls, [("call_a", "get_weather"), ("call_b", "get_weather")], "calls join the turn");
        assert_eq!(ms[2].tool_calls[1].arguments, "{\"city\": \"Bergen\"}");
        assert_eq!((ms[3].tool_call_id.as_deref(), ms[3].content.as_str()), (Some("call_a"), "sunny"));
        assert_eq!((ms[4].tool_call_id.as_deref(), ms[4].content.as_str()), (Some("call_b"), "rain"));
        assert_eq!((ms[5].content.as_str(), ms[5].tool_calls[0].id.as_str()), ("", "call_c"));
        assert_eq!(ms[7].content, "Thanks");
        assert_eq!(p.conversation, ms, "no instructions: the conversation is the prompt");

        // Instructions join a leading system message of the input (one system message in front).
        let input =
            json!([{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Hi"}]);
        let p =
            parse(&body(json!({"input": input, "instructions": "Be kind."})), &served(&tok, None)).unwrap();
        let ms = messages(&p.request);
        assert_eq!(roles(&ms), ["system", "user"]);
        assert_eq!(ms[0].content, "Be kind.\n\nUse tools.");
        assert_eq!(p.conversation[0].content, "Use tools.", "the conversation keeps the input as it came");
    }

    /// The generic format's forced call (the fixture's template has no tool format).
    const CALL: &str = r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}"#;

    #[test]
    fn previous_response_id_continues_the_stored_conversation_without_its_instructions() {
        let tok = fixture_tokenizer();
        let store = Arc::new(Store::new(8, Duration::from_secs(60)));
        let s = served(&tok, Some(&store));
        let first = parse(
            &body(
                json!({"instructions": "First rules.", "input": "Weather in Oslo?", "tools": weather_tool(),
                         "tool_choice": "required"}),
            ),
            &s,
        )
        .unwrap();
        let mut sh = shaper(first, &tok, Some(store.clone()));
        for r in generated(&tok, CALL, 4, "stop") {
            sh.absorb(&r);
        }
        assert!(sh.finished());
        let v = sh.response();
        let id = v["id"].as_str().unwrap().to_owned();
        assert_eq!(v["output"].as_array().unwrap().len(), 1, "{v}");
        let call = &v["output"][0];
        assert_eq!(call["type"], "function_call");
        let call_id = call["call_id"].as_str().unwrap().to_owned();
        assert_eq!(store.response(&id), Some(v.clone()), "kept as answered");
        assert_eq!(get(&store, &id).unwrap(), v);

        let second = parse(
            &body(json!({"previous_response_id": id, "instructions": "Second rules.",
                         "input": [{"type": "function_call_output", "call_id": call_id, "output": "sunny"}]})),
            &s,
        )
        .unwrap();
        let ms = messages(&second.request);
        assert_eq!(roles(&ms), ["system", "user", "assistant", "tool"]);
        assert_eq!(ms[0].content, "Second rules.", "only this request's instructions");
        assert!(ms.iter().all(|m| m.content != "First rules."), "instructions do not carry over");
        assert_eq!(ms[1].content, "Weather in Oslo?");
        let c = &ms[2].tool_calls[0];
        assert_eq!((c.id.as_str(), c.name.as_str()), (call_id.as_str(), "get_weather"));
        assert_eq!(serde_json::from_str::<Value>(&c.arguments).unwrap(), json!({"city": "Oslo"}));
        assert_eq!(ms[3].tool_call_id.as_deref(), Some(call_id.as_str()));
        assert_eq!(second.echo["previous_response_id"], json!(id));

        // A plain answer to it, stored too; a third turn sees the whole chain.
        let mut sh = shaper(second, &tok, Some(store.clone()));
        for r in generated(&tok, "It is sunny.", 3, "stop") {
            sh.absorb(&r);
        }
        let id2 = sh.response()["id"].as_str().unwrap().to_owned();
        let third = parse(&body(json!({"previous_response_id": id2, "input": "Thanks!"})), &s).unwrap();
        let ms = messages(&third.request);
        assert_eq!(roles(&ms), ["user", "assistant", "tool", "assistant", "user"]);
        assert_eq!(ms[3].content, "It is sunny.");

        // store false: answered, not kept.
        let fourth = parse(&body(json!({"store": false})), &s).unwrap();
        let mut sh = shaper(fourth, &tok, Some(store.clone()));
        for r in generated(&tok, "Hi.", 3, "stop") {
            sh.absorb(&r);
        }
        let id4 = sh.response()["id"].as_str().unwrap().to_owned();
        assert_eq!(sh.response()["store"], false);
        assert!(store.response(&id4).is_none());
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn responses_not_held_are_404s_that_say_why() {
        let tok = fixture_tokenizer();
        let store = Arc::new(Store::new(4, Duration::from_secs(60)));
        let e =
            parse(&body(json!({"previous_response_id": "resp_x"})), &served(&tok, Some(&store))).unwrap_err();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some("previous_response_id"), Some("previous_response_not_found"))
        );
        assert!(
            e.message.contains("`resp_x`") && e.message.contains("another router replica"),
            "{}",
            e.message
        );
        let off = Arc::new(Store::new(0, Duration::from_secs(60)));
        let e =
            parse(&body(json!({"previous_response_id": "resp_x"})), &served(&tok, Some(&off))).unwrap_err();
        assert!(e.message.contains("stores no responses (--responses-max 0)"), "{}", e.message);
        let e = parse(&body(json!({"previous_response_id": "resp_x"})), &served(&tok, None)).unwrap_err();
        assert_eq!(e.status, StatusCode::NOT_FOUND);

        // With storing off, store true is accepted and nothing is kept.
        let p = parse(&body(json!({"store": true})), &served(&tok, Some(&off))).unwrap();
        let mut sh = shaper(p, &tok, Some(off.clone()));
        for r in generated(&tok, "Hi.", 3, "stop") {
            sh.absorb(&r);
        }
        assert!(off.is_empty());

        for e in [get(&store, "resp_y").unwrap_err(), delete(&store, "resp_y").unwrap_err()] {
            assert_eq!((e.status, e.code), (StatusCode::NOT_FOUND, Some("not_found")));
            assert!(e.message.contains("`resp_y`"), "{}", e.message);
        }
        store.put("resp_y", json!({"id": "resp_y"}), Vec::new());
        assert_eq!(
            delete(&store, "resp_y").unwrap(),
            json!({"id": "resp_y", "object": "response", "deleted": true})
        );
        assert!(get(&store, "resp_y").is_err(), "deleted");
        assert!(delete(&store, "resp_y").is_err(), "deleted once");
    }

    #[test]
    fn the_store_is_bounded_and_expires() {
        let ttl = Duration::from_secs(10);
        let store = Store::new(2, ttl);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let conv = |s: &str| vec![user_message(s.into())];
        store.put_at(at(0), "a", json!("A"), conv("a"));
        store.put_at(at(1), "b", json!("B"), conv("b"));
        store.put_at(at(2), "c", json!("C"), conv("c"));
        assert_eq!(store.response_at(at(2), "a"), None, "the oldest went first");
        assert_eq!(store.response_at(at(2), "b"), Some(json!("B")));
        assert_eq!(store.conversation_at(at(2), "c").unwrap()[0].content, "c");
        // b expires at 11, c at 12.
        assert_eq!(store.response_at(at(11), "b"), None, "expired");
        assert_eq!(store.response_at(at(11), "c"), Some(json!("C")));
        assert_eq!(store.held(at(11)).entries.len(), 1);
        assert_eq!(store.held(at(11)).order.len(), 1, "expired entries leave the order too");
        assert!(store.conversation_at(at(12), "c").is_none());
        assert_eq!(store.held(at(12)).entries.len(), 0);
        // Removing one frees its place; putting an id again replaces it.
        store.put_at(at(20), "d", json!("D"), conv("d"));
        store.put_at(at(21), "e", json!("E"), conv("e"));
        assert!(store.held(at(21)).remove("d"));
        store.put_at(at(22), "e", json!("E2"), conv("e"));
        store.put_at(at(23), "f", json!("F"), conv("f"));
        assert_eq!(store.response_at(at(23), "e"), Some(json!("E2")));
        assert_eq!(store.response_at(at(23), "f"), Some(json!("F")));
        let held = store.held(at(23));
        assert_eq!((held.entries.len(), held.order.len()), (2, 2));
        drop(held);
        let off = Store::new(0, ttl);
        off.put("x", json!(1), Vec::new());
        assert!(off.is_empty() && off.response("x").is_none());
    }

    fn check_sequence(events: &[Value]) {
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e["sequence_number"], i, "{e}");
        }
    }

    #[test]
    fn a_streamed_plain_answer_is_a_sequence_of_typed_events() {
        let tok = fixture_tokenizer();
        let store = Arc::new(Store::new(8, Duration::from_secs(60)));
        let p = parse(&body(json!({"stream": true, "metadata": {"run": "1"}})), &served(&tok, Some(&store)))
            .unwrap();
        let mut sh = shaper(p, &tok, Some(store.clone()));
        let rs = generated(&tok, "The sky is blue today.", 2, "stop");
        assert!(rs.len() > 3);
        let events = streamed(&mut sh, &rs);
        check_sequence(&events);
        let t = types(&events);
        let deltas = t.iter().filter(|&&t| t == "response.output_text.delta").count();
        assert!(deltas >= 3, "{t:?}");
        let mut expected = vec![
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ];
        expected.extend(std::iter::repeat_n("response.output_text.delta", deltas));
        expected.extend([
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]);
        assert_eq!(t, expected);
        let id = sh.id().to_owned();
        assert_eq!(events[0]["response"]["status"], "in_progress");
        assert_eq!(events[0]["response"]["id"], json!(id));
        assert_eq!(events[0]["response"]["output"], json!([]));
        let text: String = events.iter().filter_map(|e| e.get("delta").and_then(Value::as_str)).collect();
        assert_eq!(text, "The sky is blue today.");
        let added = &events[2];
        let item_id = added["item"]["id"].as_str().unwrap();
        assert!(item_id.starts_with("msg_"));
        assert_eq!(added["item"]["status"], "in_progress");
        for e in &events[3..events.len() - 1] {
            assert_eq!(e["output_index"], 0, "{e}");
            if e.get("item_id").is_some() {
                assert_eq!(e["item_id"], item_id, "{e}");
            }
        }
        assert_eq!(events[events.len() - 4]["text"], text);
        let done = &events[events.len() - 1]["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["id"], json!(id));
        assert_eq!(
            done["output"][0]["content"][0],
            json!({"type": "output_text", "text": text, "annotations": []})
        );
        assert_eq!(done["output"][0]["id"], item_id);
        assert_eq!(done["metadata"], json!({"run": "1"}));
        assert_eq!(done["usage"]["input_tokens"], 7);
        assert_eq!(done["usage"]["input_tokens_details"]["cached_tokens"], 2);
        assert_eq!(
            done["usage"]["total_tokens"],
            done["usage"]["input_tokens"].as_u64().unwrap()
                + done["usage"]["output_tokens"].as_u64().unwrap()
        );
        assert_eq!(done["incomplete_details"], Value::Null);
        assert_eq!(done["error"], Value::Null);
        assert!(sh.finished());
        assert_eq!(&sh.response(), done);
        assert_eq!(store.response(&id).as_ref(), Some(done), "a streamed response is kept too");
        let conv = store.conversation(&id).unwrap();
        assert_eq!(roles(&conv), ["user", "assistant"]);
        assert_eq!(conv[1].content, text);

        // Answered at once: the same output.
        let p = parse(&body(json!({})), &served(&tok, None)).unwrap();
        let mut sh = shaper(p, &tok, None);
        for r in &rs {
            sh.absorb(r);
        }
        let v = sh.response();
        assert_eq!(v["output"][0]["content"][0]["text"], text);
        assert_eq!(v["status"], "completed");

        // As server-sent events: named, no [DONE].
        let p = parse(&body(json!({"stream": true})), &served(&tok, None)).unwrap();
        let mut sh = shaper(p, &tok, None);
        let sse: String = rs.iter().map(|r| Shape::stream(&mut sh, r)).collect();
        assert!(sse.starts_with("event: response.created\ndata: {"), "{sse}");
        assert!(sse.contains("\n\nevent: response.output_text.delta\ndata: {"), "{sse}");
        assert!(sse.ends_with("}\n\n") && !sse.contains("[DONE]"));
        assert_eq!(sh.stream_end(), "");
        for block in sse.trim_end().split("\n\n") {
            let (head, data) = block.split_once('\n').unwrap();
            let v: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(head.strip_prefix("event: ").unwrap(), v["type"], "{block}");
        }
    }

    #[test]
    fn a_forced_function_call_streams_as_a_function_call_item() {
        let tok = fixture_tokenizer();
        let p = parse(
            &body(json!({"stream": true, "tools": weather_tool(), "tool_choice": "required",
                         "parallel_tool_calls": false})),
            &served(&tok, None),
        )
        .unwrap();
        assert!(p.request.constraint.is_some(), "the call is forced");
        let Some(Prompt::Chat(c)) = &p.request.prompt else { panic!() };
        assert!(c.tools_json.contains("get_weather"));
        assert_eq!(p.echo["tools"][0]["name"], "get_weather");
        assert_eq!(p.echo["tools"][0]["strict"], true);
        assert_eq!(p.echo["tool_choice"], "required");
        assert_eq!(p.echo["parallel_tool_calls"], false);
        let mut sh = shaper(p, &tok, None);
        let events = streamed(&mut sh, &generated(&tok, CALL, 3, "stop"));
        check_sequence(&events);
        assert_eq!(
            types(&events),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ],
            "no text leaks out of the call"
        );
        let added = &events[2]["item"];
        assert_eq!((added["type"].as_str(), added["arguments"].as_str()), (Some("function_call"), Some("")));
        let done = &events[5]["item"];
        assert_eq!(done["id"], added["id"]);
        assert_eq!(done["call_id"], added["call_id"]);
        assert!(done["id"].as_str().unwrap().starts_with("fc_"));
        assert!(done["call_id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(done["name"], "get_weather");
        assert_eq!(done["status"], "completed");
        assert_eq!(events[3]["delta"], done["arguments"]);
        assert_eq!(events[4]["arguments"], done["arguments"]);
        assert_eq!(events[3]["item_id"], done["id"]);
        let args: Value = serde_json::from_str(done["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Oslo"}));
        let response = &events[6]["response"];
        assert_eq!(response["status"], "completed");
        assert_eq!(response["output"], json!([done]));
    }

    #[test]
    fn a_generic_reply_streams_as_text_and_a_cut_answer_is_incomplete() {
        let tok = fixture_tokenizer();
        // tool_choice auto in the generic format: a reply or calls; this one replies.
        let p = parse(&body(json!({"stream": true, "tools": weather_tool()})), &served(&tok, None)).unwrap();
        assert!(p.request.constraint.is_some(), "the generic format constrains the whole answer");
        let mut sh = shaper(p, &tok, None);
        let events =
            streamed(&mut sh, &generated(&tok, r#"{"response": "It is sunny in Oslo."}"#, 2, "stop"));
        check_sequence(&events);
        let text: String = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(text, "It is sunny in Oslo.");
        let done = &events.last().unwrap()["response"];
        assert_eq!(done["output"].as_array().unwrap().len(), 1, "{done}");
        assert_eq!(done["output"][0]["type"], "message");

        // Cut short by max_output_tokens.
        let p = parse(&body(json!({"stream": true, "max_output_tokens": 3})), &served(&tok, None)).unwrap();
        let mut sh = shaper(p, &tok, None);
        let events = streamed(&mut sh, &generated(&tok, "Once upon a", 1, "length"));
        check_sequence(&events);
        let last = events.last().unwrap();
        assert_eq!(last["type"], "response.incomplete");
        assert_eq!(last["response"]["status"], "incomplete");
        assert_eq!(last["response"]["incomplete_details"], json!({"reason": "max_output_tokens"}));
        assert_eq!(last["response"]["output"][0]["status"], "incomplete");
        assert_eq!(last["response"]["max_output_tokens"], 3);
        assert!(sh.finished());

        // An empty answer still has its message.
        let p = parse(&body(json!({})), &served(&tok, None)).unwrap();
        let mut sh = shaper(p, &tok, None);
        sh.absorb(&GenerateResponse { finish_reason: Some("stop".into()), ..Default::default() });
        let v = sh.response();
        assert_eq!(v["output"][0]["content"][0]["text"], "", "{v}");
    }

    #[test]
    fn reasoning_streams_as_its_own_item_before_the_message() {
        let tok = templated_tokenizer("think-open.jinja");
        let store = Arc::new(Store::new(8, Duration::from_secs(60)));
        let p = parse(&body(json!({"stream": true})), &served(&tok, Some(&store))).unwrap();
        assert!(p.output.reasoning.is_some(), "the template opens a thinking block");
        let mut sh = shaper(p, &tok, Some(store.clone()));
        let events =
            streamed(&mut sh, &generated(&tok, "The user greets me.</think>\n\nHello there.", 2, "stop"));
        check_sequence(&events);
        let t = types(&events);
        let first_text = t.iter().position(|&t| t == "response.output_text.delta").unwrap();
        let reasoning_done = t.iter().position(|&t| t == "response.reasoning_text.done").unwrap();
        assert!(reasoning_done < first_text, "the reasoning item closes before the message opens: {t:?}");
        assert_eq!(t.iter().filter(|&&t| t == "response.output_item.added").count(), 2, "{t:?}");
        assert_eq!(t.iter().filter(|&&t| t == "response.output_item.done").count(), 2, "{t:?}");
        let reasoning: String = events
            .iter()
            .filter(|e| e["type"] == "response.reasoning_text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(reasoning, "The user greets me.");
        assert_eq!(events[reasoning_done]["text"], "The user greets me.");
        let done = &events.last().unwrap()["response"];
        let output = done["output"].as_array().unwrap();
        assert_eq!(output.len(), 2, "{done}");
        assert_eq!(output[0]["type"], "reasoning");
        assert!(output[0]["id"].as_str().unwrap().starts_with("rs_"));
        assert_eq!(output[0]["summary"], json!([]));
        assert_eq!(output[0]["content"], json!([{"type": "reasoning_text", "text": "The user greets me."}]));
        assert_eq!(output[1]["type"], "message");
        assert_eq!(output[1]["content"][0]["text"], "Hello there.");
        for e in &events {
            if e["type"] == "response.output_text.delta" {
                assert_eq!(e["output_index"], 1, "{e}");
            }
        }
        let conv = store.conversation(sh.id()).unwrap();
        assert_eq!(conv[1].content, "Hello there.", "the reasoning is not kept in the conversation");

        // The thinking switch follows reasoning.effort where the template has one.
        let tok = templated_tokenizer("think-qwen3.jinja");
        let p = parse(&body(json!({"reasoning": {"effort": "none"}})), &served(&tok, None)).unwrap();
        assert!(p.output.reasoning.is_none(), "effort none: no thinking");
        let p = parse(&body(json!({"reasoning": {"effort": "high"}})), &served(&tok, None)).unwrap();
        assert!(p.output.reasoning.is_some());
    }

    #[test]
    fn a_failure_mid_stream_ends_with_response_failed() {
        let tok = fixture_tokenizer();
        let store = Arc::new(Store::new(8, Duration::from_secs(60)));
        let p = parse(&body(json!({"stream": true})), &served(&tok, Some(&store))).unwrap();
        let mut sh = shaper(p, &tok, Some(store.clone()));
        let rs = generated(&tok, "Partial answer here", 2, "stop");
        let mut events = sh.events(&rs[0]);
        let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, "a worker failed");
        let sse = Shape::stream_error(&mut sh, &e);
        assert!(sse.starts_with("event: response.failed\n"), "{sse}");
        events.extend(sh.failed(&e));
        let last = events.last().unwrap();
        assert_eq!(last["response"]["status"], "failed");
        assert_eq!(last["response"]["error"], json!({"code": "server_error", "message": "a worker failed"}));
        assert!(!sh.finished());
        assert!(store.is_empty(), "a failed response is not kept");
    }

    /// A budget that does not fit after the prompt names `max_output_tokens`, as this API spells it.
    #[test]
    fn a_budget_past_the_context_names_max_output_tokens() {
        let tok = fixture_tokenizer();
        let body = json!({"model": "tiny", "input": "Hi", "max_output_tokens": 500}).to_string();
        let p = prepare(body.as_bytes(), &served(&tok, None)).unwrap();
        let st = tonic::Status::invalid_argument(
            "max_tokens: the prompt's 20 tokens plus max_tokens 500 make 520 tokens, more than the context length of 512 tokens",
        );
        let e = ApiError::for_shape(&st, &*p.shape);
        assert_eq!(e.param.as_deref(), Some("max_output_tokens"));
        assert!(
            e.message.starts_with("max_output_tokens: the prompt's 20 tokens plus max_output_tokens 500"),
            "{}",
            e.message
        );
        assert_eq!(e.code, Some("context_length_exceeded"));
    }
}
