//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`).
//!
//! A request is read field by field, as every API here reads them: each field is used, accepted
//! only with the value that changes nothing, or refused by name with a 400, so a client never
//! believes it got a behaviour it did not. The conversation (`system`, `messages` with their
//! `text`, `tool_use` and `tool_result` blocks) becomes the router's chat prompt through
//! [`ChatInput::build`], which also handles tools, forced calls and reasoning for every API.
//!
//! The router's [`GenerateResponse`] stream is shaped by a [`Shaper`] into one `message` object,
//! or into Anthropic's named server-sent events: `message_start`, then per content block
//! `content_block_start`, `content_block_delta`s and `content_block_stop`, then `message_delta`
//! (the stop reason and the usage) and `message_stop`.
//!
//! Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens that were computed,
//! `cache_read_input_tokens` those whose KV came from the prefix cache; their sum is the prompt's
//! length, which `count_tokens` gives.

use serde_json::{json, Value};
use tandem_proto::v1::{self, GenerateRequest, GenerateResponse};

use super::answer::{AnswerReader, Piece};
use super::chat::{self, ChatInput, OutputPlan, ParamNames, ToolChoice, ToolSpec};
use super::{random_id, rename, ApiError, Fields, Prepared, Served, Shape};
use tandem_model::grammar::Constraint;
use tandem_model::request::{MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES};
use tandem_model::tokenizer::Tokenizer;
use tandem_model::tools::{ParsedCall, ToolDef, ToolFormat};

/// Most stop sequences in one request (the router's limit on stop strings).
pub const MAX_STOP_SEQUENCES: usize = MAX_STOP_STRINGS;
/// Smallest `thinking.budget_tokens` (Anthropic's rule).
pub const MIN_THINKING_BUDGET: u64 = 1024;

/// Top-level fields that are part of Anthropic's API but not served here; refused by name.
const UNSUPPORTED: &[&str] = &[
    "container",
    "context_management",
    "diagnostics",
    "inference_geo",
    "mcp_servers",
    "service_tier",
    "speed",
];

/// The names this API gives the chat fields, for errors.
const NAMES: ParamNames = ParamNames { tools: "tools", tool_choice: "tool_choice" };

/// A request read from the wire.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub request: GenerateRequest,
    pub stream: bool,
    /// How the answer is read: tool calls, reasoning.
    pub output: OutputPlan,
    /// `thinking.display: "omitted"`: thinking blocks come without their text.
    pub omit_thinking: bool,
}

/// Reads a `POST /v1/messages` body into the request to run and its shaper.
pub fn prepare(body: &[u8], served: &Served<'_>) -> Result<Prepared, ApiError> {
    let parsed = parse(body, served)?;
    let tok = served.loaded_tokenizer()?;
    let shape = Shaper::new(served.answering(&parsed.request), tok, &parsed);
    Ok(Prepared { request: parsed.request, stream: parsed.stream, shape: Box::new(shape) })
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}`, the length of the prompt a message
/// request with the same `system`, `messages`, `tools`, `tool_choice`, `thinking` and
/// `output_config` would run (the sum of its usage's `input_tokens` and
/// `cache_read_input_tokens`).
pub fn count_tokens(body: &[u8], served: &Served<'_>) -> Result<Value, ApiError> {
    let mut f = Fields::of_body(body)?;
    f.take_model(served)?;
    let (input, _) = chat_input(&mut f, served, None)?;
    f.finish_refusing(UNSUPPORTED)?;
    let plan = input.build(served, NAMES)?;
    let tok = served.loaded_tokenizer()?;
    let ids = crate::request::tokenize_with(&tok, &plan.prompt, false).map_err(|e| {
        // `prompt.chat: ...` in this API's names.
        let why = e.split_once(": ").map_or(e.as_str(), |(_, rest)| rest);
        invalid("messages", why)
    })?;
    Ok(json!({"input_tokens": ids.len()}))
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, the type
/// told by the HTTP status (and `request_id` once the request had one).
pub fn error_body(e: &ApiError) -> Value {
    let kind = match e.status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    let mut body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
    if let Some(id) = &e.request_id {
        body["request_id"] = json!(id);
    }
    body
}

/// A 400 about `param`, its message starting with the parameter's name.
fn invalid(param: &str, why: impl std::fmt::Display) -> ApiError {
    ApiError::invalid(param, format!("{param}: {why}"))
}

/// A JSON value's kind, for errors.
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

/// The fields of `v`, which must be an object (`at` names it).
fn object(v: Value, at: &str) -> Result<Fields, ApiError> {
    match v {
        Value::Object(o) => Ok(Fields(o)),
        other => Err(invalid(at, format!("expected an object, got {}", kind_of(&other)))),
    }
}

/// Takes field `name`, accepted only absent or null.
fn null_only(f: &mut Fields, name: &str, at: &str) -> Result<(), ApiError> {
    match f.take_raw(name) {
        None => Ok(()),
        Some(_) => Err(invalid(&format!("{at}{name}"), "not supported by this server")),
    }
}

/// Reads a `POST /v1/messages` body.
pub fn parse(body: &[u8], served: &Served<'_>) -> Result<Parsed, ApiError> {
    let mut f = Fields::of_body(body)?;
    let model = f.take_model(served)?;

    // Required, as in Anthropic's API; it must fit after the prompt (checked by the router).
    let max_tokens = match f.take::<i64>("max_tokens")? {
        None => return Err(invalid("max_tokens", "is required")),
        Some(n) if n < 1 => return Err(invalid("max_tokens", format!("must be at least 1, got {n}"))),
        Some(n) if n as u64 > served.context_len as u64 => {
            return Err(invalid(
                "max_tokens",
                format!("{n} is more than the model's context length of {} tokens", served.context_len),
            ))
        }
        Some(n) => n as u32,
    };

    let temperature = f.take::<f32>("temperature")?.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&temperature) {
        return Err(invalid("temperature", format!("must be between 0 and 1, got {temperature}")));
    }
    let top_p = f.take::<f32>("top_p")?;
    if let Some(p) = top_p.filter(|p| !(0.0..=1.0).contains(p)) {
        return Err(invalid("top_p", format!("must be between 0 and 1, got {p}")));
    }
    let sampling = v1::SamplingParams {
        // Anthropic's default temperature is 1.
        temperature: Some(temperature),
        top_p,
        top_k: f.take("top_k")?,
        ..Default::default()
    };

    let stop = stop_sequences(f.take_raw("stop_sequences"))?;
    let stream = f.take::<bool>("stream")?.unwrap_or(false);
    let cache_salt = metadata(f.take_raw("metadata"))?;
    let (input, omit_thinking) = chat_input(&mut f, served, Some(max_tokens))?;
    f.finish_refusing(UNSUPPORTED)?;
    let plan = input.build(served, NAMES)?;

    Ok(Parsed {
        request: GenerateRequest {
            prompt: Some(plan.prompt),
            max_tokens: Some(max_tokens),
            sampling: Some(sampling),
            stop,
            cache_salt,
            max_tokens_must_fit: true,
            constraint: plan.constraint.map(|c| tandem_serve::constraint::to_wire(&c)),
            n: 1,
            model,
            ..Default::default()
        },
        stream,
        output: plan.output,
        omit_thinking,
    })
}

/// `stop_sequences`: up to [`MAX_STOP_SEQUENCES`] non-empty strings.
fn stop_sequences(v: Option<Value>) -> Result<Vec<String>, ApiError> {
    const P: &str = "stop_sequences";
    let items = match v {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(invalid(P, format!("expected an array of strings, got {}", kind_of(&other))))
        }
    };
    if items.len() > MAX_STOP_SEQUENCES {
        return Err(invalid(P, format!("at most {MAX_STOP_SEQUENCES} stop sequences, got {}", items.len())));
    }
    items
        .into_iter()
        .map(|v| match v {
            Value::String(s) if s.is_empty() => Err(invalid(P, "must not contain an empty string")),
            Value::String(s) if s.len() > MAX_STOP_STRING_BYTES => Err(invalid(
                P,
                format!("each must be at most {MAX_STOP_STRING_BYTES} bytes, got {}", s.len()),
            )),
            Value::String(s) => Ok(s),
            other => Err(invalid(P, format!("expected strings, got {}", kind_of(&other)))),
        })
        .collect()
}

/// `metadata`: only `user_id`, which names the end user's prefix-cache namespace
/// (`user:<id>`, the salt OpenAI's `user` gives).
fn metadata(v: Option<Value>) -> Result<String, ApiError> {
    let Some(v) = v else { return Ok(String::new()) };
    let mut m = object(v, "metadata")?;
    let user: Option<String> = m.take("user_id").map_err(|e| rename(e, "metadata."))?;
    m.finish().map_err(|e| rename(e, "metadata."))?;
    super::user_salt(user.as_deref(), "metadata.user_id")
}

/// The fields that make the prompt (and what the answer may be): `system`, `messages`, `tools`,
/// `tool_choice`, `thinking`, `output_config` and `cache_control`; also whether thinking is
/// shown without its text. `max_tokens` (absent when counting tokens) bounds the thinking budget.
fn chat_input(
    f: &mut Fields,
    served: &Served<'_>,
    max_tokens: Option<u32>,
) -> Result<(ChatInput, bool), ApiError> {
    let messages = conversation(f)?;
    let tools = tools(f, served.tokenizer)?;
    let (enable_thinking, omit_thinking) = thinking(f.take_raw("thinking"), max_tokens)?;
    let constraint = output_config(f.take_raw("output_config"))?;
    // The prefix cache keeps every prompt's KV on its own, so cache breakpoints change nothing.
    cache_control(f.take_raw("cache_control"), "cache_control")?;
    let input = ChatInput { messages, tools, constraint, enable_thinking };
    Ok((input, omit_thinking))
}

/// A `cache_control` marker: an object (or null), accepted as is (see [`chat_input`]).
fn cache_control(v: Option<Value>, at: &str) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Object(_)) => Ok(()),
        Some(other) => Err(invalid(at, format!("expected an object, got {}", kind_of(&other)))),
    }
}

/// `thinking`: `{"type": "enabled", "budget_tokens"}` turns the template's thinking switch on,
/// `{"type": "disabled"}` off, and `{"type": "adaptive"}` leaves the template's default (the model
/// decides). `display: "omitted"` sends thinking blocks without their text.
///
/// `budget_tokens` must be at least [`MIN_THINKING_BUDGET`] and less than `max_tokens`, as
/// Anthropic requires, but it is not enforced on its own: the reasoning and the answer together
/// are bounded by `max_tokens` only. On a model whose template has no thinking block the switch
/// changes nothing and answers have no thinking block.
fn thinking(v: Option<Value>, max_tokens: Option<u32>) -> Result<(Option<bool>, bool), ApiError> {
    let Some(v) = v else { return Ok((None, false)) };
    let mut t = object(v, "thinking")?;
    let re = |e| rename(e, "thinking.");
    let kind: String = t.take("type").map_err(re)?.ok_or_else(|| invalid("thinking.type", "is required"))?;
    let enable = match kind.as_str() {
        "enabled" => {
            let budget: u64 = t
                .take("budget_tokens")
                .map_err(re)?
                .ok_or_else(|| invalid("thinking.budget_tokens", "is required with type enabled"))?;
            if budget < MIN_THINKING_BUDGET {
                return Err(invalid(
                    "thinking.budget_tokens",
                    format!("must be at least {MIN_THINKING_BUDGET}, got {budget}"),
                ));
            }
            if let Some(max) = max_tokens.filter(|&m| budget >= u64::from(m)) {
                return Err(invalid(
                    "thinking.budget_tokens",
                    format!("must be less than max_tokens ({max}), got {budget}"),
                ));
            }
            Some(true)
        }
        "disabled" => Some(false),
        "adaptive" => None,
        other => {
            return Err(invalid(
                "thinking.type",
                format!("`{other}` is not supported (enabled, disabled or adaptive)"),
            ))
        }
    };
    let omit = match t.take::<String>("display").map_err(re)?.as_deref() {
        None | Some("summarized") => false,
        Some("omitted") => true,
        Some(other) => {
            return Err(invalid("thinking.display", format!("`{other}` is not one of summarized or omitted")))
        }
    };
    if kind == "disabled" && omit {
        return Err(invalid("thinking.display", "only with thinking enabled or adaptive"));
    }
    t.finish().map_err(re)?;
    Ok((enable, omit))
}

/// `output_config`: `format` (`{"type": "json_schema", "schema"}`) constrains the answer to the
/// schema; `effort` is refused unless null.
fn output_config(v: Option<Value>) -> Result<Option<(String, Constraint)>, ApiError> {
    let Some(v) = v else { return Ok(None) };
    let mut o = object(v, "output_config")?;
    null_only(&mut o, "effort", "output_config.")?;
    let c = match o.take_raw("format") {
        None => None,
        Some(fmt) => {
            const P: &str = "output_config.format";
            let mut fmt = object(fmt, P)?;
            let re = |e| rename(e, "output_config.format.");
            match fmt.take::<String>("type").map_err(re)?.as_deref() {
                Some("json_schema") => {}
                Some(other) => {
                    return Err(invalid(P, format!("type `{other}` is not supported (json_schema)")))
                }
                None => return Err(invalid("output_config.format.type", "is required (json_schema)")),
            }
            let schema = match fmt.take_raw("schema") {
                Some(s @ Value::Object(_)) => s,
                Some(other) => {
                    return Err(invalid(
                        "output_config.format.schema",
                        format!("expected a JSON Schema object, got {}", kind_of(&other)),
                    ))
                }
                None => return Err(invalid("output_config.format.schema", "is required")),
            };
            fmt.finish().map_err(re)?;
            let c = Constraint::JsonSchema(schema.to_string());
            c.check_shape().map_err(|e| invalid(P, e))?;
            Some((P.to_owned(), c))
        }
    };
    o.finish().map_err(|e| rename(e, "output_config."))?;
    Ok(c)
}

/// Reads `tools` and `tool_choice`; `None` when there are no tools. Tools are custom tools
/// (`{"name", "description"?, "input_schema", "type"?: "custom"}`); Anthropic's server tools
/// (`web_search_...`, `bash_...`, ...) are refused by their type.
fn tools(f: &mut Fields, tok: Option<&Tokenizer>) -> Result<Option<ToolSpec>, ApiError> {
    let list = f.take_raw("tools").filter(|l| l.as_array().is_none_or(|a| !a.is_empty()));
    let choice = f.take_raw("tool_choice");
    let (choice, parallel) = match choice {
        None => (None, true),
        Some(v) => {
            let (c, p) = tool_choice(v)?;
            (Some(c), p)
        }
    };
    let Some(list) = list else {
        return match choice {
            None | Some(ToolChoice::Auto) | Some(ToolChoice::None) => Ok(None),
            Some(_) => Err(invalid("tool_choice", "needs tools")),
        };
    };
    let Value::Array(items) = list else {
        return Err(invalid("tools", format!("expected an array of tools, got {}", kind_of(&list))));
    };
    chat::check_tool_count(items.len(), "tools")?;
    let choice = choice.unwrap_or(ToolChoice::Auto);
    let format = tok.and_then(ToolFormat::of);
    let mut defs: Vec<ToolDef> = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("tools[{i}]");
        let mut t = object(item, &at)?;
        let re = |e| rename(e, &format!("{at}."));
        match t.take::<String>("type").map_err(re)?.as_deref() {
            None | Some("custom") => {}
            Some(other) => {
                return Err(invalid(
                    &format!("{at}.type"),
                    format!(
                        "server tool `{other}` is not supported by this server (only custom tools: name, \
                         description, input_schema)"
                    ),
                ))
            }
        }
        let name: String =
            t.take("name").map_err(re)?.ok_or_else(|| invalid(&format!("{at}.name"), "is required"))?;
        chat::check_tool_name(&name, &defs, &at)?;
        let schema = t
            .take_raw("input_schema")
            .ok_or_else(|| invalid(&format!("{at}.input_schema"), "is required"))?;
        let parameters = chat::tool_parameters(Some(&schema), &format!("{at}.input_schema"))?;
        let description: Option<String> = t.take("description").map_err(re)?;
        cache_control(t.take_raw("cache_control"), &format!("{at}.cache_control"))?;
        // Forced calls, and every call in the generic format, follow the schema; calls the model
        // makes on its own in its template's format are read as written.
        let strict = t.take::<bool>("strict").map_err(re)?.unwrap_or(false);
        if strict && choice == ToolChoice::Auto && format.is_some_and(|f| f != ToolFormat::Generic) {
            return Err(invalid(
                &format!("{at}.strict"),
                "true cannot be kept with tool_choice auto on this model (calls the model makes on its own \
                 are read as written); use tool_choice any or tool, which force calls that follow the schema",
            ));
        }
        // Whether arguments stream in pieces: a call goes out whole here either way.
        let _eager: Option<bool> = t.take("eager_input_streaming").map_err(re)?;
        if t.take::<bool>("defer_loading").map_err(re)? == Some(true) {
            return Err(invalid(&format!("{at}.defer_loading"), "not supported by this server"));
        }
        t.finish_refusing(&["allowed_callers", "input_examples"]).map_err(re)?;
        defs.push(ToolDef { name, description, parameters });
    }
    if let ToolChoice::Named(name) = &choice {
        chat::check_named(name, &defs, "tool_choice.name")?;
    }
    Ok(Some(ToolSpec { defs, choice, parallel }))
}

/// `tool_choice`: `{"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}`;
/// also whether several calls may be made.
fn tool_choice(v: Value) -> Result<(ToolChoice, bool), ApiError> {
    let mut c = object(v, "tool_choice")?;
    let re = |e| rename(e, "tool_choice.");
    let kind: Option<String> = c.take("type").map_err(re)?;
    let name: Option<String> = c.take("name").map_err(re)?;
    let parallel = !c.take::<bool>("disable_parallel_tool_use").map_err(re)?.unwrap_or(false);
    c.finish().map_err(re)?;
    let choice = match (kind.as_deref(), name) {
        (None, _) => return Err(invalid("tool_choice.type", "is required (auto, any, tool or none)")),
        (Some("tool"), Some(n)) => ToolChoice::Named(n),
        (Some("tool"), None) => return Err(invalid("tool_choice.name", "is required with type tool")),
        (Some(_), Some(_)) => return Err(invalid("tool_choice.name", "only with type tool")),
        (Some("auto"), None) => ToolChoice::Auto,
        (Some("any"), None) => ToolChoice::Required,
        (Some("none"), None) => ToolChoice::None,
        (Some(other), None) => {
            return Err(invalid(
                "tool_choice.type",
                format!("`{other}` is not one of auto, any, tool or none"),
            ))
        }
    };
    Ok((choice, parallel))
}

/// A chat message of `role` with `content`.
fn message(role: &str, content: String) -> v1::ChatMessage {
    v1::ChatMessage { role: role.to_owned(), content, ..Default::default() }
}

/// Adds `m` to the conversation. Consecutive turns of one role are one turn, as Anthropic's API
/// has them (templates expect roles to alternate): their texts are joined, their calls kept.
fn push(out: &mut Vec<v1::ChatMessage>, m: v1::ChatMessage) {
    if let Some(last) = out.last_mut() {
        if last.role == m.role && matches!(m.role.as_str(), "user" | "assistant") {
            match (last.content.is_empty(), m.content.is_empty()) {
                (_, true) => {}
                (true, false) => last.content = m.content,
                (false, false) => last.content = format!("{}\n\n{}", last.content, m.content),
            }
            last.tool_calls.extend(m.tool_calls);
            return;
        }
    }
    out.push(m);
}

/// `system` and `messages`: the conversation the template renders. The system prompt leads as a
/// `system` message; a user turn's `tool_result` blocks become `tool` messages, followed by a
/// user message with its text; an assistant turn's `tool_use` blocks become its calls.
fn conversation(f: &mut Fields) -> Result<Vec<v1::ChatMessage>, ApiError> {
    let mut out = Vec::new();
    if let Some(system) = f.take_raw("system") {
        let text = match system {
            Value::String(s) => s,
            Value::Array(blocks) => {
                let mut texts = Vec::with_capacity(blocks.len());
                for (j, b) in blocks.into_iter().enumerate() {
                    let at = format!("system[{j}]");
                    let (kind, b) = block(b, &at)?;
                    if kind != "text" {
                        return Err(invalid(&at, format!("`{kind}` blocks are not supported here (text)")));
                    }
                    texts.push(text_block(b, &at)?);
                }
                texts.join("\n")
            }
            other => {
                return Err(invalid(
                    "system",
                    format!("expected a string or an array of text blocks, got {}", kind_of(&other)),
                ))
            }
        };
        if !text.is_empty() {
            out.push(message("system", text));
        }
    }
    let items = match f.take_raw("messages") {
        None => return Err(invalid("messages", "is required")),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(invalid("messages", format!("expected an array, got {}", kind_of(&other))))
        }
    };
    if items.is_empty() {
        return Err(invalid("messages", "is empty"));
    }
    let last = items.len() - 1;
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("messages[{i}]");
        let mut m = object(item, &at)?;
        let re = |e| rename(e, &format!("{at}."));
        let role: String =
            m.take("role").map_err(re)?.ok_or_else(|| invalid(&format!("{at}.role"), "is required"))?;
        let content =
            m.take_raw("content").ok_or_else(|| invalid(&format!("{at}.content"), "is required"))?;
        m.finish().map_err(re)?;
        match role.as_str() {
            "user" => user_turn(content, &at, &mut out)?,
            "assistant" if i == last => {
                return Err(invalid(
                    &at,
                    "a conversation ending with an assistant message (a prefilled answer to continue) is \
                     not supported; end with a user message",
                ))
            }
            "assistant" => assistant_turn(content, &at, &mut out)?,
            "system" => {
                return Err(invalid(
                    &format!("{at}.role"),
                    "`system` is not a message role here; give the system prompt as the top-level `system`",
                ))
            }
            other => {
                return Err(invalid(
                    &format!("{at}.role"),
                    format!("`{other}` is not one of user or assistant"),
                ))
            }
        }
    }
    Ok(out)
}

/// A content block's type and its other fields.
fn block(v: Value, at: &str) -> Result<(String, Fields), ApiError> {
    let mut b = object(v, at)?;
    let kind: String = b
        .take("type")
        .map_err(|e| rename(e, &format!("{at}.")))?
        .ok_or_else(|| invalid(&format!("{at}.type"), "is required"))?;
    Ok((kind, b))
}

/// A block type that is part of Anthropic's API but not served.
fn unsupported_block(kind: &str, at: &str, served: &str) -> ApiError {
    invalid(at, format!("`{kind}` blocks are not supported by this server ({served})"))
}

/// A `text` block's text (`cache_control` accepted, `citations` only empty).
fn text_block(mut b: Fields, at: &str) -> Result<String, ApiError> {
    let re = |e| rename(e, &format!("{at}."));
    let text: String =
        b.take("text").map_err(re)?.ok_or_else(|| invalid(&format!("{at}.text"), "is required"))?;
    cache_control(b.take_raw("cache_control"), &format!("{at}.cache_control"))?;
    match b.take_raw("citations") {
        None => {}
        Some(Value::Array(c)) if c.is_empty() => {}
        Some(_) => return Err(invalid(&format!("{at}.citations"), "not supported by this server")),
    }
    b.finish().map_err(re)?;
    Ok(text)
}

/// A user turn: a string, or `text` and `tool_result` blocks.
fn user_turn(content: Value, at: &str, out: &mut Vec<v1::ChatMessage>) -> Result<(), ApiError> {
    let blocks = match content {
        Value::String(s) => {
            push(out, message("user", s));
            return Ok(());
        }
        Value::Array(b) if b.is_empty() => return Err(invalid(&format!("{at}.content"), "is empty")),
        Value::Array(b) => b,
        other => {
            return Err(invalid(
                &format!("{at}.content"),
                format!("expected a string or an array of content blocks, got {}", kind_of(&other)),
            ))
        }
    };
    let mut texts = Vec::new();
    for (j, b) in blocks.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let (kind, b) = block(b, &at)?;
        match kind.as_str() {
            "text" => texts.push(text_block(b, &at)?),
            // Results come first, as Anthropic's API has them.
            "tool_result" => out.push(tool_result(b, &at)?),
            "tool_use" | "thinking" | "redacted_thinking" => {
                return Err(invalid(&at, format!("`{kind}` blocks are only in assistant messages")))
            }
            other => return Err(unsupported_block(other, &at, "text and tool_result in user messages")),
        }
    }
    if !texts.is_empty() {
        push(out, message("user", texts.join("\n")));
    }
    Ok(())
}

/// A `tool_result` block: a `tool` message answering the call `tool_use_id`. Its content is a
/// string or text blocks; with `is_error` it is marked as an error for the model.
fn tool_result(mut b: Fields, at: &str) -> Result<v1::ChatMessage, ApiError> {
    let re = |e| rename(e, &format!("{at}."));
    let id: String = b
        .take("tool_use_id")
        .map_err(re)?
        .ok_or_else(|| invalid(&format!("{at}.tool_use_id"), "is required"))?;
    let content = match b.take_raw("content") {
        None => String::new(),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (k, p) in parts.into_iter().enumerate() {
                let at = format!("{at}.content[{k}]");
                let (kind, p) = block(p, &at)?;
                if kind != "text" {
                    return Err(unsupported_block(&kind, &at, "text in tool results"));
                }
                texts.push(text_block(p, &at)?);
            }
            texts.join("\n")
        }
        Some(other) => {
            return Err(invalid(
                &format!("{at}.content"),
                format!("expected a string or an array of text blocks, got {}", kind_of(&other)),
            ))
        }
    };
    let is_error = b.take::<bool>("is_error").map_err(re)?.unwrap_or(false);
    cache_control(b.take_raw("cache_control"), &format!("{at}.cache_control"))?;
    b.finish().map_err(re)?;
    let content = if is_error { format!("Error: {content}") } else { content };
    Ok(v1::ChatMessage { tool_call_id: Some(id), ..message("tool", content) })
}

/// An assistant turn (not the last message): a string, or `text`, `tool_use` and thinking blocks.
/// Thinking blocks of earlier turns are accepted and not rendered (a chat message has no place
/// for them, and templates drop earlier reasoning).
fn assistant_turn(content: Value, at: &str, out: &mut Vec<v1::ChatMessage>) -> Result<(), ApiError> {
    let blocks = match content {
        Value::String(s) => {
            push(out, message("assistant", s));
            return Ok(());
        }
        Value::Array(b) => b,
        other => {
            return Err(invalid(
                &format!("{at}.content"),
                format!("expected a string or an array of content blocks, got {}", kind_of(&other)),
            ))
        }
    };
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let (kind, b) = block(b, &at)?;
        match kind.as_str() {
            "text" => texts.push(text_block(b, &at)?),
            "tool_use" => calls.push(tool_use(b, &at)?),
            "thinking" | "redacted_thinking" => {}
            "tool_result" => return Err(invalid(&at, "`tool_result` blocks are only in user messages")),
            other => {
                return Err(unsupported_block(
                    other,
                    &at,
                    "text, tool_use and thinking in assistant messages",
                ))
            }
        }
    }
    push(out, v1::ChatMessage { tool_calls: calls, ..message("assistant", texts.join("\n")) });
    Ok(())
}

/// A `tool_use` block of an earlier turn: `{"id", "name", "input": {...}}`.
fn tool_use(mut b: Fields, at: &str) -> Result<v1::ToolCall, ApiError> {
    let re = |e| rename(e, &format!("{at}."));
    let id: String = b.take("id").map_err(re)?.ok_or_else(|| invalid(&format!("{at}.id"), "is required"))?;
    let name: String =
        b.take("name").map_err(re)?.ok_or_else(|| invalid(&format!("{at}.name"), "is required"))?;
    let input = match b.take_raw("input") {
        Some(v @ Value::Object(_)) => v,
        Some(other) => {
            return Err(invalid(
                &format!("{at}.input"),
                format!("expected an object, got {}", kind_of(&other)),
            ))
        }
        None => return Err(invalid(&format!("{at}.input"), "is required")),
    };
    cache_control(b.take_raw("cache_control"), &format!("{at}.cache_control"))?;
    // A call the model made itself (the only kind there is here) says so, or nothing.
    match b.take_raw("caller") {
        None => {}
        Some(c) if c.get("type").and_then(Value::as_str) == Some("direct") => {}
        Some(_) => return Err(invalid(&format!("{at}.caller"), "only a direct caller is supported")),
    }
    null_only(&mut b, "toolset_name", &format!("{at}."))?;
    b.finish().map_err(re)?;
    Ok(v1::ToolCall { id, name, arguments: input.to_string() })
}

/// What one block of a streamed answer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
}

/// Shapes one request's [`GenerateResponse`] stream into Anthropic's `message` object
/// ([`Shaper::absorb`], then [`Shaper::response`]) or its events ([`Shaper::events`]).
pub struct Shaper {
    model: String,
    id: String,
    tok: Tokenizer,
    /// With tools or reasoning: the answer's reader; `None` for plain text.
    reader: Option<AnswerReader>,
    omit_thinking: bool,
    /// The request's stop sequences, to tell which ended the answer.
    stop_sequences: Vec<String>,
    /// The answer's text (plain answers).
    text: String,
    /// The answer's tokens.
    tokens: Vec<u32>,
    /// The prompt's length, from the first response.
    prompt_tokens: u32,
    usage: Option<v1::Usage>,
    finish: Option<String>,
    /// Streaming: `message_start` was sent.
    started: bool,
    /// Streaming: the block being streamed, and its index.
    open: Option<(usize, Block)>,
    /// Streaming: blocks started so far.
    blocks: usize,
}

impl Shaper {
    pub fn new(model: &str, tok: Tokenizer, parsed: &Parsed) -> Shaper {
        Shaper {
            model: model.to_owned(),
            id: format!("msg_{}", random_id()),
            reader: (!parsed.output.is_plain())
                .then(|| AnswerReader::new(parsed.output.clone(), tok.clone())),
            tok,
            omit_thinking: parsed.omit_thinking,
            stop_sequences: parsed.request.stop.clone(),
            text: String::new(),
            tokens: Vec::new(),
            prompt_tokens: 0,
            usage: None,
            finish: None,
            started: false,
            open: None,
            blocks: 0,
        }
    }

    /// Takes in what every response tells, whichever way the answer goes out.
    fn take(&mut self, r: &GenerateResponse) {
        if !r.prompt_token_ids.is_empty() {
            self.prompt_tokens = r.prompt_token_ids.len() as u32;
        }
        if r.usage.is_some() {
            self.usage = r.usage;
        }
        self.tokens.extend_from_slice(&r.token_ids);
        if let Some(reason) = &r.finish_reason {
            self.finish = Some(reason.clone());
        }
    }

    /// Why the answer ended, and the stop sequence that ended it, as Anthropic names them.
    fn stop_reason(&self, calls: bool) -> (&'static str, Option<String>) {
        if calls {
            return ("tool_use", None);
        }
        match self.finish.as_deref() {
            Some("length") => ("max_tokens", None),
            _ => match self.matched_stop() {
                Some(s) => ("stop_sequence", Some(s)),
                None => ("end_turn", None),
            },
        }
    }

    /// The stop sequence that ended the answer, if one did. The router reports it as any other
    /// stop; an answer that ended on a special token (end of turn) was not stopped by one, else
    /// the first stop sequence to be complete in the answer's text is the one that matched (the
    /// text shown stops before it).
    fn matched_stop(&self) -> Option<String> {
        if self.stop_sequences.is_empty() {
            return None;
        }
        let last = *self.tokens.last()?;
        if self.tok.eos_token_ids().contains(&last) || self.tok.is_special(last) {
            return None;
        }
        let text = self.tok.decode(&self.tokens, true).ok()?;
        self.stop_sequences
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|at| (at + s.len(), s)))
            .min_by_key(|(end, _)| *end)
            .map(|(_, s)| s.clone())
    }

    /// The usage in Anthropic's accounting: prompt tokens computed, prompt tokens read from the
    /// prefix cache, and generated tokens.
    fn usage_json(&self) -> Value {
        let u = self.usage.unwrap_or(v1::Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.tokens.len() as u32,
            cached_tokens: 0,
        });
        json!({
            "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
            "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens,
        })
    }

    /// A `tool_use` block of a call read from the answer. Its `input` is the arguments object
    /// (arguments that are not JSON go out as a string).
    fn tool_use_block(call: &ParsedCall) -> Value {
        let input = serde_json::from_str::<Value>(&call.arguments).unwrap_or_else(|_| json!(call.arguments));
        json!({"type": "tool_use", "id": format!("toolu_{}", random_id()), "name": call.name, "input": input})
    }

    /// Takes in one response of a request answered at once.
    pub fn absorb(&mut self, r: &GenerateResponse) {
        self.take(r);
        match &mut self.reader {
            Some(reader) => reader.append(r),
            None => self.text.push_str(&r.text),
        }
    }

    /// The whole `message`, once the last response was absorbed.
    pub fn response(&mut self) -> Value {
        let (reasoning, content, calls) = match &self.reader {
            Some(reader) => {
                let a = reader.answer();
                (a.reasoning, a.content.unwrap_or_default(), a.calls)
            }
            None => (None, std::mem::take(&mut self.text), Vec::new()),
        };
        let mut blocks = Vec::new();
        if let Some(r) = reasoning.filter(|r| !r.is_empty()) {
            let shown = if self.omit_thinking { String::new() } else { r };
            blocks.push(json!({"type": "thinking", "thinking": shown, "signature": ""}));
        }
        // An answer with nothing else still has its (empty) text.
        if !content.is_empty() || (blocks.is_empty() && calls.is_empty()) {
            blocks.push(json!({"type": "text", "text": content}));
        }
        blocks.extend(calls.iter().map(Shaper::tool_use_block));
        let (stop_reason, stop_sequence) = self.stop_reason(!calls.is_empty());
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage_json(),
        })
    }

    /// The events one response becomes when streaming, as (event type, data): `message_start`
    /// before the first; each piece of thinking or text as a delta of its block (started when it
    /// first has something to show, stopped when another starts); after the last, the calls as
    /// whole `tool_use` blocks, `message_delta` and `message_stop`.
    pub fn events(&mut self, r: &GenerateResponse) -> Vec<(&'static str, Value)> {
        self.take(r);
        let mut out = Vec::new();
        if !std::mem::replace(&mut self.started, true) {
            let message = json!({
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
            });
            out.push(("message_start", json!({"type": "message_start", "message": message})));
        }
        let last = r.finish_reason.is_some();
        let (mut pieces, mut calls) = (Vec::new(), Vec::new());
        match &mut self.reader {
            Some(reader) => {
                pieces = reader.push(r);
                if last {
                    let (rest, c) = reader.finish();
                    pieces.extend(rest);
                    calls = c;
                }
            }
            None if !r.text.is_empty() => pieces.push(Piece::Text(r.text.clone())),
            None => {}
        }
        for p in pieces {
            let (block, delta) = match p {
                Piece::Reasoning(_) if self.omit_thinking => (Block::Thinking, None),
                Piece::Reasoning(t) => {
                    (Block::Thinking, Some(json!({"type": "thinking_delta", "thinking": t})))
                }
                Piece::Text(t) => (Block::Text, Some(json!({"type": "text_delta", "text": t}))),
            };
            let index = self.open_block(block, &mut out);
            if let Some(delta) = delta {
                out.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": delta}),
                ));
            }
        }
        if !last {
            return out;
        }
        if self.blocks == 0 && calls.is_empty() {
            self.open_block(Block::Text, &mut out);
        }
        self.close_block(&mut out);
        for call in &calls {
            let mut block = Shaper::tool_use_block(call);
            let input = std::mem::replace(&mut block["input"], json!({}));
            let index = self.blocks;
            self.blocks += 1;
            out.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": block}),
            ));
            out.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
            ));
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": index})));
        }
        let (stop_reason, stop_sequence) = self.stop_reason(!calls.is_empty());
        out.push((
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                   "usage": self.usage_json()}),
        ));
        out.push(("message_stop", json!({"type": "message_stop"})));
        out
    }

    /// The index of the open block of kind `block`, starting it (and stopping the one before)
    /// when another is open.
    fn open_block(&mut self, block: Block, out: &mut Vec<(&'static str, Value)>) -> usize {
        if let Some((index, open)) = self.open {
            if open == block {
                return index;
            }
            self.close_block(out);
        }
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some((index, block));
        let content_block = match block {
            Block::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            Block::Text => json!({"type": "text", "text": ""}),
        };
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": content_block}),
        ));
        index
    }

    fn close_block(&mut self, out: &mut Vec<(&'static str, Value)>) {
        if let Some((index, _)) = self.open.take() {
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": index})));
        }
    }
}

/// One named server-sent event.
fn event(kind: &str, data: &Value) -> String {
    format!("event: {kind}\ndata: {data}\n\n")
}

impl Shape for Shaper {
    fn stream(&mut self, r: &GenerateResponse) -> String {
        self.events(r).iter().map(|(kind, data)| event(kind, data)).collect()
    }

    fn stream_error(&mut self, e: &ApiError) -> String {
        event("error", &error_body(e))
    }

    fn stream_end(&mut self) -> String {
        // `message_stop` ended the stream.
        String::new()
    }

    fn finished(&self) -> bool {
        self.finish.is_some()
    }

    fn absorb(&mut self, r: &GenerateResponse) {
        Shaper::absorb(self, r)
    }

    fn response(&mut self) -> Value {
        Shaper::response(self)
    }

    fn prompt_param(&self) -> &'static str {
        "messages"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{NoAdapters, USER_SALT_PREFIX};
    use crate::request::MAX_CACHE_SALT_BYTES;
    use http::StatusCode;
    use tandem_proto::v1::generate_request::Prompt;
    use tandem_proto::v1::output_constraint::Kind;

    const SERVED: Served<'static> =
        Served { model: "tiny", adapters: &NoAdapters, context_len: 512, tokenizer: None, responses: None };

    fn parse_json(v: Value) -> Result<Parsed, ApiError> {
        parse(v.to_string().as_bytes(), &SERVED)
    }

    /// A request body: `model`, one user message, `max_tokens` 16, and `extra`.
    fn body(extra: Value) -> Value {
        let mut b =
            json!({"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    }

    fn chat_of(r: &GenerateRequest) -> &v1::ChatPrompt {
        match &r.prompt {
            Some(Prompt::Chat(c)) => c,
            other => panic!("not a chat prompt: {other:?}"),
        }
    }

    /// The llama-gqa fixture's tokenizer, with `template` (a file of tests/reference/templates)
    /// in place of its own; `None` keeps its own (no tool format: the generic one).
    fn fixture_tokenizer(template: Option<&str>) -> Tokenizer {
        crate::api::test_support::tokenizer(template)
    }

    fn weather_tools() -> Value {
        json!([{"name": "get_weather", "description": "The weather in a city", "input_schema": {"type": "object",
                "properties": {"city": {"type": "string"}}, "required": ["city"]}},
               {"type": "custom", "name": "get_time", "input_schema": {"type": "object"}}])
    }

    /// The responses a worker would stream for `text`, three tokens each, the last with
    /// `finish` and the usage; `eos` ends the answer with an end-of-sequence token.
    fn responses(tok: &Tokenizer, text: &str, eos: bool, finish: &str) -> Vec<GenerateResponse> {
        let mut ids = tok.encode(text, false).unwrap();
        if eos {
            ids.push(tok.eos_token_ids()[0]);
        }
        let n = ids.len();
        ids.chunks(3)
            .enumerate()
            .map(|(i, c)| {
                let last = (i + 1) * 3 >= n;
                GenerateResponse {
                    token_ids: c.to_vec(),
                    text: tok.decode(c, true).unwrap(),
                    prompt_token_ids: if i == 0 { vec![1; 9] } else { Vec::new() },
                    finish_reason: last.then(|| finish.to_owned()),
                    usage: last.then_some(v1::Usage {
                        prompt_tokens: 9,
                        completion_tokens: n as u32,
                        cached_tokens: 4,
                    }),
                    ..Default::default()
                }
            })
            .collect()
    }

    /// The whole answer to `req` (a body), answered at once and streamed, on `tok`'s model.
    fn answer(tok: &Tokenizer, req: Value, rs: &[GenerateResponse]) -> (Value, Vec<(&'static str, Value)>) {
        let served = Served { tokenizer: Some(tok), ..SERVED };
        let p = parse(req.to_string().as_bytes(), &served).unwrap();
        let mut sh = Shaper::new("tiny", tok.clone(), &p);
        rs.iter().for_each(|r| sh.absorb(r));
        assert!(Shape::finished(&sh));
        let whole = sh.response();
        let mut sh = Shaper::new("tiny", tok.clone(), &p);
        let events = rs.iter().flat_map(|r| sh.events(r)).collect();
        (whole, events)
    }

    /// The message a client builds from the events (as the SDKs accumulate them), checking
    /// their order on the way.
    fn accumulate(events: &[(&'static str, Value)]) -> Value {
        let mut msg = Value::Null;
        let mut open: Option<u64> = None;
        let mut json_bufs: std::collections::BTreeMap<u64, String> = Default::default();
        for (kind, data) in events {
            assert_eq!(data["type"], *kind, "{data}");
            match *kind {
                "message_start" => {
                    assert!(msg.is_null(), "message_start twice");
                    msg = data["message"].clone();
                }
                "content_block_start" => {
                    assert_eq!(open, None, "a block started before the last one stopped");
                    let i = data["index"].as_u64().unwrap();
                    assert_eq!(i as usize, msg["content"].as_array().unwrap().len(), "indexes in order");
                    msg["content"].as_array_mut().unwrap().push(data["content_block"].clone());
                    open = Some(i);
                }
                "content_block_delta" => {
                    let i = data["index"].as_u64().unwrap();
                    assert_eq!(open, Some(i), "a delta outside its block");
                    let b = &mut msg["content"][i as usize];
                    let d = &data["delta"];
                    match d["type"].as_str().unwrap() {
                        "text_delta" => {
                            b["text"] =
                                json!(b["text"].as_str().unwrap().to_owned() + d["text"].as_str().unwrap())
                        }
                        "thinking_delta" => {
                            b["thinking"] = json!(
                                b["thinking"].as_str().unwrap().to_owned() + d["thinking"].as_str().unwrap()
                            )
                        }
                        "input_json_delta" => {
                            let buf = json_bufs.entry(i).or_default();
                            buf.push_str(d["partial_json"].as_str().unwrap());
                            b["input"] = serde_json::from_str(buf).unwrap();
                        }
                        other => panic!("delta {other}"),
                    }
                }
                "content_block_stop" => {
                    assert_eq!(open, data["index"].as_u64(), "{data}");
                    open = None;
                }
                "message_delta" => {
                    assert_eq!(open, None);
                    msg["stop_reason"] = data["delta"]["stop_reason"].clone();
                    msg["stop_sequence"] = data["delta"]["stop_sequence"].clone();
                    msg["usage"] = data["usage"].clone();
                }
                "message_stop" => assert_eq!(events.last().unwrap().0, "message_stop"),
                other => panic!("event {other}"),
            }
        }
        msg
    }

    /// The answer without its random ids, to compare one way of sending it with the other.
    fn without_ids(mut v: Value) -> Value {
        v["id"] = Value::Null;
        for b in v["content"].as_array_mut().unwrap() {
            if b["type"] == "tool_use" {
                assert!(b["id"].as_str().unwrap().starts_with("toolu_"), "{b}");
                b["id"] = Value::Null;
            }
        }
        v
    }

    #[test]
    fn fields_map_to_the_generate_request() {
        let p = parse_json(json!({
            "model": "tiny", "max_tokens": 40, "temperature": 0.25, "top_p": 0.9, "top_k": 5,
            "stop_sequences": ["END", "\n\n"], "metadata": {"user_id": "u-7"}, "stream": true,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
            "cache_control": {"type": "ephemeral"},
        }))
        .unwrap();
        let r = &p.request;
        assert_eq!((r.max_tokens, r.max_tokens_must_fit, r.n), (Some(40), true, 1));
        let s = r.sampling.unwrap();
        assert_eq!((s.temperature, s.top_p, s.top_k, s.seed), (Some(0.25), Some(0.9), Some(5), None));
        assert_eq!(r.stop, ["END", "\n\n"]);
        assert_eq!(r.cache_salt, "user:u-7", "metadata.user_id names the prefix-cache namespace");
        assert!(p.stream && r.constraint.is_none() && p.output.is_plain());
        let c = chat_of(r);
        let roles: Vec<(&str, &str)> =
            c.messages.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        assert_eq!(roles, [("system", "Be brief."), ("user", "Hi\nthere")]);
        assert_eq!(
            (c.add_generation_prompt, c.enable_thinking, c.tools_json.as_str()),
            (Some(true), None, "")
        );

        // Anthropic's defaults: temperature 1, not streamed, the shared cache namespace.
        let p = parse_json(body(json!({}))).unwrap();
        assert_eq!(p.request.sampling.unwrap().temperature, Some(1.0));
        assert!(!p.stream);
        assert_eq!(p.request.cache_salt, "");
        assert_eq!(parse_json(body(json!({"metadata": {"user_id": null}}))).unwrap().request.cache_salt, "");
    }

    #[test]
    fn refusals_name_the_field() {
        let long_user = "u".repeat(MAX_CACHE_SALT_BYTES - USER_SALT_PREFIX.len() + 1);
        let cases: Vec<(Value, &str, &str)> = vec![
            (body(json!({"bogus": 1})), "bogus", "unknown parameter `bogus`"),
            (body(json!({"container": "c"})), "container", "not supported"),
            (body(json!({"mcp_servers": []})), "mcp_servers", "not supported"),
            (body(json!({"service_tier": "auto"})), "service_tier", "not supported"),
            (body(json!({"context_management": {}})), "context_management", "not supported"),
            (
                json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
                "max_tokens",
                "is required",
            ),
            (body(json!({"max_tokens": 0})), "max_tokens", "at least 1"),
            (body(json!({"max_tokens": 513})), "max_tokens", "context length of 512"),
            (json!({"max_tokens": 5, "messages": []}), "model", "model: is required"),
            (body(json!({"temperature": 1.5})), "temperature", "between 0 and 1"),
            (body(json!({"top_p": 2})), "top_p", "between 0 and 1"),
            (body(json!({"stop_sequences": "x"})), "stop_sequences", "array of strings"),
            (body(json!({"stop_sequences": [""]})), "stop_sequences", "empty string"),
            (body(json!({"stop_sequences": vec!["a"; 17]})), "stop_sequences", "at most 16"),
            (body(json!({"metadata": {"user_id": long_user}})), "metadata.user_id", "at most 251 bytes"),
            (body(json!({"metadata": {"tier": 1}})), "metadata.tier", "unknown parameter"),
            (body(json!({"messages": []})), "messages", "messages: is empty"),
            (
                body(json!({"messages": [{"role": "system", "content": "x"}]})),
                "messages[0].role",
                "top-level `system`",
            ),
            (body(json!({"messages": [{"role": "user"}]})), "messages[0].content", "is required"),
            (
                body(json!({"messages": [{"role": "user", "content": "x", "name": "ana"}]})),
                "messages[0].name",
                "unknown parameter",
            ),
            (
                body(json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]})),
                "messages[0].content[0]",
                "`image` blocks are not supported",
            ),
            (
                body(json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                    {"type": "document", "source": {}}]}]})),
                "messages[0].content[1]",
                "`document` blocks",
            ),
            (
                body(
                    json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                    "content": [{"type": "image", "source": {}}]}]}]}),
                ),
                "messages[0].content[0].content[0]",
                "`image` blocks",
            ),
            (
                body(
                    json!({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                    "input": {}}]}]}),
                ),
                "messages[0].content[0]",
                "only in assistant messages",
            ),
            (
                body(
                    json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "colour": 1}]}]}),
                ),
                "messages[0].content[0].colour",
                "unknown parameter",
            ),
            (
                body(
                    json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
                ),
                "messages[1]",
                "prefilled answer",
            ),
            (
                body(json!({"messages": [{"role": "user", "content": "a"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]},
                    {"role": "user", "content": "c"}]})),
                "messages[1].content[0].input",
                "expected an object",
            ),
            (body(json!({"system": 5})), "system", "a string or an array of text blocks"),
            (body(json!({"system": [{"type": "image"}]})), "system[0]", "not supported"),
            (body(json!({"thinking": {"type": "enabled"}})), "thinking.budget_tokens", "is required"),
            (
                body(json!({"thinking": {"type": "enabled", "budget_tokens": 1000}})),
                "thinking.budget_tokens",
                "at least 1024",
            ),
            (
                body(json!({"max_tokens": 500, "thinking": {"type": "enabled", "budget_tokens": 1024}})),
                "thinking.budget_tokens",
                "less than max_tokens (500)",
            ),
            (body(json!({"thinking": {"type": "sometimes"}})), "thinking.type", "not supported"),
            (body(json!({"output_config": {"effort": "high"}})), "output_config.effort", "not supported"),
            (
                body(json!({"output_config": {"format": {"type": "json_schema"}}})),
                "output_config.format.schema",
                "is required",
            ),
            (body(json!({"tool_choice": {"type": "any"}})), "tool_choice", "needs tools"),
            (
                body(json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]})),
                "tools[0].type",
                "server tool `web_search_20250305` is not supported",
            ),
            (body(json!({"tools": [{"name": "f"}]})), "tools[0].input_schema", "is required"),
            (
                body(json!({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]})),
                "tools[0]",
                "must be 1 to 64",
            ),
            (
                body(json!({"tools": [{"name": "f", "input_schema": {}, "input_examples": [{}]}]})),
                "tools[0].input_examples",
                "not supported",
            ),
            (
                body(json!({"tools": weather_tools(), "tool_choice": {"type": "tool", "name": "fly"}})),
                "tool_choice.name",
                "unknown tool name `fly`",
            ),
            (
                body(json!({"tools": weather_tools(), "tool_choice": {"type": "tool"}})),
                "tool_choice.name",
                "is required",
            ),
            (
                body(json!({"tools": weather_tools(), "tool_choice": {"type": "required"}})),
                "tool_choice.type",
                "not one of auto, any, tool or none",
            ),
        ];
        for (b, param, needle) in cases {
            let e = parse_json(b.clone()).expect_err("should be refused");
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{b}: {e:?}");
            assert_eq!(e.param.as_deref(), Some(param), "{b}: {e:?}");
            assert!(e.message.contains(param), "{b}: {:?} does not name {param}", e.message);
            assert!(e.message.contains(needle), "{b}: {:?} lacks {needle:?}", e.message);
            assert_eq!(error_body(&e)["error"]["type"], "invalid_request_error");
        }
        let e = parse_json(body(json!({"model": "other"}))).unwrap_err();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(error_body(&e)["error"]["type"], "not_found_error");
        assert!(e.message.contains("`other`") && e.message.contains("`tiny`"), "{}", e.message);
        let e = parse(b"{not json", &SERVED).unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{e:?}");
    }

    #[test]
    fn error_bodies_take_anthropics_types_by_status() {
        let cases = [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (405, "invalid_request_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (501, "api_error"),
            (503, "overloaded_error"),
            (504, "timeout_error"),
        ];
        for (status, kind) in cases {
            let e = ApiError::new(StatusCode::from_u16(status).unwrap(), "x", None, "max_tokens: too many");
            let b = error_body(&e);
            assert_eq!(
                b,
                json!({"type": "error", "error": {"type": kind, "message": "max_tokens: too many"}})
            );
            assert_eq!(e.body_in(super::super::Style::Anthropic), b);
        }
        let e = ApiError { request_id: Some("router-1".into()), ..ApiError::bad_request("x") };
        assert_eq!(error_body(&e)["request_id"], "router-1");
        // The router's own refusals, renamed to this API's fields.
        let st = tonic::Status::invalid_argument("prompt has 600 tokens; the limit is 511 (context length)");
        let e = ApiError::from_status(&st, "messages");
        assert_eq!(e.param.as_deref(), Some("messages"));
        // Mid-stream, the error is an `error` event.
        let tok = fixture_tokenizer(None);
        let p = parse_json(body(json!({"stream": true}))).unwrap();
        let mut sh = Shaper::new("tiny", tok, &p);
        let ev = Shape::stream_error(
            &mut sh,
            &ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "x", None, "boom"),
        );
        let data = ev.strip_prefix("event: error\ndata: ").and_then(|d| d.strip_suffix("\n\n")).unwrap();
        let want = json!({"type": "error", "error": {"type": "api_error", "message": "boom"}});
        assert_eq!(serde_json::from_str::<Value>(data).unwrap(), want);
        assert_eq!(Shape::stream_end(&mut sh), "");
        assert_eq!(Shape::prompt_param(&sh), "messages");
    }

    #[test]
    fn tool_use_and_tool_result_history_becomes_calls_and_tool_messages() {
        let p = parse_json(body(json!({"messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Let me look.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                 "content": [{"type": "text", "text": "no clock"}]},
                {"type": "text", "text": "And tomorrow?"}]},
            {"role": "assistant", "content": "Also sunny."},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
            {"role": "user", "content": "Thanks."},
            {"role": "user", "content": "Bye."}]})))
        .unwrap();
        let m = &chat_of(&p.request).messages;
        let brief: Vec<(&str, &str, Option<&str>)> =
            m.iter().map(|m| (m.role.as_str(), m.content.as_str(), m.tool_call_id.as_deref())).collect();
        assert_eq!(
            brief,
            [
                ("user", "Weather in Oslo?", None),
                ("assistant", "Checking.", None),
                ("tool", "sunny", Some("toolu_1")),
                ("tool", "Error: no clock", Some("toolu_2")),
                ("user", "And tomorrow?", None),
                ("assistant", "Also sunny.", None),
                ("tool", "", Some("toolu_3")),
                // Consecutive user turns are one turn.
                ("user", "Thanks.\n\nBye.", None),
            ]
        );
        let calls = &m[1].tool_calls;
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0].id.as_str(), calls[0].name.as_str()), ("toolu_1", "get_weather"));
        assert_eq!(serde_json::from_str::<Value>(&calls[0].arguments).unwrap(), json!({"city": "Oslo"}));
        assert_eq!(calls[1].arguments, "{}");
    }

    #[test]
    fn tools_and_tool_choice_read_into_the_chat_plan() {
        let tok = fixture_tokenizer(Some("tools-hermes.jinja"));
        let served = Served { tokenizer: Some(&tok), ..SERVED };
        let read = |extra: Value| parse(body(extra).to_string().as_bytes(), &served);
        let p = read(json!({"tools": weather_tools()})).unwrap();
        assert!(p.request.constraint.is_none(), "auto by default, forcing nothing");
        let t = p.output.tools.as_ref().unwrap();
        assert_eq!(
            (t.format, t.names.clone()),
            (ToolFormat::Hermes, vec!["get_weather".into(), "get_time".into()])
        );
        let rendered: Value = serde_json::from_str(&chat_of(&p.request).tools_json).unwrap();
        assert_eq!(rendered[0]["function"]["name"], "get_weather");
        assert_eq!(rendered[0]["function"]["description"], "The weather in a city");
        assert_eq!(rendered[0]["function"]["parameters"], weather_tools()[0]["input_schema"]);

        for (choice, needle) in [
            (json!({"type": "any"}), "get_time"),
            (json!({"type": "tool", "name": "get_weather"}), "get_weather"),
            (json!({"type": "any", "disable_parallel_tool_use": true}), "get_weather"),
        ] {
            let p = read(json!({"tools": weather_tools(), "tool_choice": choice})).unwrap();
            let Some(Kind::Grammar(g)) = p.request.constraint.and_then(|c| c.kind) else {
                panic!("{choice}")
            };
            assert!(g.contains("<tool_call>") && g.contains(needle), "{choice}: {g}");
            // Several calls where allowed (however many the format's grammar repeats).
            if choice["type"] == "any" {
                let parallel = !choice.get("disable_parallel_tool_use").is_some_and(|d| d == true);
                assert_eq!(g.contains("(\"\\n\" call)"), parallel, "{choice}: {g}");
            }
        }
        let p = read(json!({"tools": weather_tools(), "tool_choice": {"type": "none"}})).unwrap();
        assert!(p.output.tools.is_none() && p.request.constraint.is_none(), "none reads no calls back");
        // `strict` holds where calls are forced; calls the model makes on its own are read as written.
        let strict = json!([{"name": "f", "input_schema": {"type": "object"}, "strict": true}]);
        let e = read(json!({"tools": strict})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].strict"), "{}", e.message);
        assert!(read(json!({"tools": strict, "tool_choice": {"type": "any"}})).is_ok());
        // Structured output and forced calls do not mix.
        let e = read(json!({"tools": weather_tools(), "tool_choice": {"type": "any"},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("output_config.format"), "{}", e.message);

        // A template without a tool format: the generic one; auto is a grammar too, strict holds.
        let plain = fixture_tokenizer(None);
        let served = Served { tokenizer: Some(&plain), ..SERVED };
        let p = parse(body(json!({"tools": strict})).to_string().as_bytes(), &served).unwrap();
        assert_eq!(p.output.tools.as_ref().map(|t| t.format), Some(ToolFormat::Generic));
        assert!(matches!(p.request.constraint.and_then(|c| c.kind), Some(Kind::JsonSchema(_))));
    }

    #[test]
    fn output_config_format_and_thinking_read_into_the_request() {
        let schema =
            json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
        let p =
            parse_json(body(json!({"output_config": {"format": {"type": "json_schema", "schema": schema}}})))
                .unwrap();
        let Some(Kind::JsonSchema(s)) = p.request.constraint.and_then(|c| c.kind) else { panic!() };
        assert_eq!(serde_json::from_str::<Value>(&s).unwrap(), schema);
        assert!(parse_json(body(json!({"output_config": {"effort": null}})))
            .unwrap()
            .request
            .constraint
            .is_none());

        let served = Served { context_len: 4096, ..SERVED };
        let thinking = |t: Value| {
            let b = body(json!({"max_tokens": 2048, "thinking": t}));
            let p = parse(b.to_string().as_bytes(), &served).unwrap();
            (chat_of(&p.request).enable_thinking, p.omit_thinking)
        };
        assert_eq!(thinking(json!({"type": "enabled", "budget_tokens": 1024})), (Some(true), false));
        assert_eq!(thinking(json!({"type": "disabled"})), (Some(false), false));
        assert_eq!(thinking(json!({"type": "adaptive", "display": "omitted"})), (None, true));
        assert_eq!(
            thinking(json!({"type": "enabled", "budget_tokens": 2047, "display": "summarized"})),
            (Some(true), false)
        );
    }

    #[test]
    fn a_plain_answer_streams_as_one_text_block() {
        let tok = fixture_tokenizer(None);
        let rs = responses(&tok, "Paris is the capital of France.", true, "stop");
        let (whole, events) = answer(&tok, body(json!({})), &rs);
        let kinds: Vec<&str> = events.iter().map(|(k, _)| *k).collect();
        let deltas = kinds.iter().filter(|k| **k == "content_block_delta").count();
        assert!(deltas >= 2, "the text streams as it comes: {kinds:?}");
        let mut want = vec!["message_start", "content_block_start"];
        want.extend(std::iter::repeat_n("content_block_delta", deltas));
        want.extend(["content_block_stop", "message_delta", "message_stop"]);
        assert_eq!(kinds, want);
        let start = &events[0].1["message"];
        assert_eq!(start["usage"]["input_tokens"], 9, "the prompt's length, known from the first response");
        assert_eq!(
            (start["role"].as_str(), start["content"].as_array().map(Vec::len)),
            (Some("assistant"), Some(0))
        );

        assert_eq!(whole["type"], "message");
        assert!(whole["id"].as_str().unwrap().starts_with("msg_"));
        assert_eq!(whole["content"], json!([{"type": "text", "text": "Paris is the capital of France."}]));
        assert_eq!(
            (whole["stop_reason"].as_str(), &whole["stop_sequence"]),
            (Some("end_turn"), &Value::Null)
        );
        let n = tok.encode("Paris is the capital of France.", false).unwrap().len() + 1;
        assert_eq!(
            whole["usage"],
            json!({"input_tokens": 5, "output_tokens": n, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4})
        );
        assert_eq!(without_ids(accumulate(&events)), without_ids(whole), "the streamed message is the same");

        // Cut by max_tokens.
        let rs = responses(&tok, "Paris is", false, "length");
        let (whole, events) = answer(&tok, body(json!({})), &rs);
        assert_eq!(whole["stop_reason"], "max_tokens");
        assert_eq!(accumulate(&events)["stop_reason"], "max_tokens");

        // An empty answer still has its (empty) text block.
        let rs = responses(&tok, "", true, "stop");
        let (whole, events) = answer(&tok, body(json!({})), &rs);
        assert_eq!(whole["content"], json!([{"type": "text", "text": ""}]));
        assert_eq!(without_ids(accumulate(&events)), without_ids(whole));
    }

    #[test]
    fn a_stop_sequence_is_told_from_the_end_of_the_turn() {
        let tok = fixture_tokenizer(None);
        let req = body(json!({"stop_sequences": ["Rome", "capital"]}));
        // The router ends the text before the stop sequence; its tokens are the answer's.
        let mut rs = responses(&tok, "Paris is the capital", false, "stop");
        let shown = "Paris is the ";
        for r in &mut rs {
            r.text.clear();
        }
        rs[0].text = shown.into();
        let (whole, events) = answer(&tok, req.clone(), &rs);
        assert_eq!(whole["content"][0]["text"], shown);
        assert_eq!(
            (whole["stop_reason"].as_str(), whole["stop_sequence"].as_str()),
            (Some("stop_sequence"), Some("capital"))
        );
        let m = accumulate(&events);
        assert_eq!(
            (m["stop_reason"].as_str(), m["stop_sequence"].as_str()),
            (Some("stop_sequence"), Some("capital"))
        );
        // An answer that ended on the end-of-sequence token did not stop on a sequence.
        let rs = responses(&tok, "Paris is nice", true, "stop");
        let (whole, _) = answer(&tok, req, &rs);
        assert_eq!(
            (whole["stop_reason"].as_str(), &whole["stop_sequence"]),
            (Some("end_turn"), &Value::Null)
        );
    }

    #[test]
    fn a_tool_call_streams_as_a_tool_use_block() {
        let tok = fixture_tokenizer(Some("tools-hermes.jinja"));
        let req = body(json!({"tools": weather_tools()}));
        let text = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let rs = responses(&tok, text, true, "stop");
        let (whole, events) = answer(&tok, req.clone(), &rs);
        assert_eq!(whole["stop_reason"], "tool_use", "{whole}");
        let content = whole["content"].as_array().unwrap();
        assert_eq!(content.len(), 2, "{whole}");
        assert_eq!(content[0], json!({"type": "text", "text": "Checking."}));
        assert_eq!(
            (content[1]["type"].as_str(), content[1]["name"].as_str()),
            (Some("tool_use"), Some("get_weather"))
        );
        assert_eq!(content[1]["input"], json!({"city": "Oslo"}));

        let kinds: Vec<&str> = events.iter().map(|(k, _)| *k).collect();
        let tail = &kinds[kinds.len() - 6..];
        assert_eq!(
            tail,
            [
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ],
            "{kinds:?}"
        );
        let start = &events[kinds.len() - 5].1;
        assert_eq!(start["content_block"]["input"], json!({}), "the input comes as a JSON delta");
        assert_eq!(start["index"], 1);
        let delta = &events[kinds.len() - 4].1["delta"];
        assert_eq!(delta["type"], "input_json_delta");
        assert_eq!(
            serde_json::from_str::<Value>(delta["partial_json"].as_str().unwrap()).unwrap(),
            json!({"city": "Oslo"})
        );
        let streamed = accumulate(&events);
        assert!(!streamed["content"][0]["text"].as_str().unwrap().contains("tool_call"), "{streamed}");
        assert_eq!(without_ids(streamed), without_ids(whole));

        // Only the call: one block, no empty text.
        let rs = responses(
            &tok,
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
            true,
            "stop",
        );
        let (whole, events) = answer(&tok, req, &rs);
        assert_eq!(whole["content"].as_array().unwrap().len(), 1, "{whole}");
        assert_eq!(whole["content"][0]["input"], json!({}));
        assert_eq!(without_ids(accumulate(&events)), without_ids(whole));
    }

    #[test]
    fn generic_format_calls_and_replies_become_blocks() {
        let tok = fixture_tokenizer(None);
        let req = body(json!({"tools": weather_tools()}));
        let call = "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]}";
        let (whole, events) = answer(&tok, req.clone(), &responses(&tok, call, true, "stop"));
        assert_eq!(whole["stop_reason"], "tool_use");
        assert_eq!(whole["content"].as_array().unwrap().len(), 1, "{whole}");
        assert_eq!(whole["content"][0]["input"], json!({"city": "Oslo"}));
        assert_eq!(without_ids(accumulate(&events)), without_ids(whole));

        let reply = "{\"response\": \"It is sunny in \\\"Oslo\\\".\"}";
        let (whole, events) = answer(&tok, req, &responses(&tok, reply, true, "stop"));
        assert_eq!(whole["content"], json!([{"type": "text", "text": "It is sunny in \"Oslo\"."}]));
        assert_eq!(whole["stop_reason"], "end_turn");
        assert_eq!(without_ids(accumulate(&events)), without_ids(whole));
    }

    #[test]
    fn reasoning_goes_out_as_a_thinking_block() {
        let tok = fixture_tokenizer(Some("think-qwen3.jinja"));
        let text = "<think>\nThe capital is Paris.\n</think>\n\nParis.";
        let req = body(json!({"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}}));
        let served = Served { context_len: 4096, ..SERVED };
        let tokened = Served { tokenizer: Some(&tok), ..served.clone() };
        let p = parse(req.to_string().as_bytes(), &tokened).unwrap();
        assert!(p.output.reasoning.is_some());
        let rs = responses(&tok, text, true, "stop");
        let run = |p: &Parsed| {
            let mut sh = Shaper::new("tiny", tok.clone(), p);
            rs.iter().for_each(|r| sh.absorb(r));
            let whole = sh.response();
            let mut sh = Shaper::new("tiny", tok.clone(), p);
            let events: Vec<_> = rs.iter().flat_map(|r| sh.events(r)).collect();
            (whole, events)
        };
        let (whole, events) = run(&p);
        let content = whole["content"].as_array().unwrap();
        assert_eq!(content[0]["type"], "thinking", "{whole}");
        assert_eq!(content[0]["thinking"].as_str().unwrap().trim(), "The capital is Paris.");
        assert_eq!(content[1], json!({"type": "text", "text": "Paris."}));
        assert_eq!(without_ids(accumulate(&events)), without_ids(whole));

        // Omitted: the block is there, its text is not.
        let req = body(json!({"max_tokens": 2048, "thinking": {"type": "adaptive", "display": "omitted"}}));
        let p = parse(req.to_string().as_bytes(), &tokened).unwrap();
        let (whole, events) = run(&p);
        assert_eq!(whole["content"][0], json!({"type": "thinking", "thinking": "", "signature": ""}));
        assert!(events.iter().all(|(_, d)| d["delta"]["type"] != "thinking_delta"));
        assert_eq!(without_ids(accumulate(&events)), without_ids(whole));
    }

    #[test]
    fn count_tokens_counts_the_prompt_a_message_request_runs() {
        let tok = fixture_tokenizer(None);
        let served = Served { tokenizer: Some(&tok), context_len: 4096, ..SERVED };
        for extra in [json!({}), json!({"system": "Be brief.", "tools": weather_tools()})] {
            let b = body(extra.clone());
            let p = parse(b.to_string().as_bytes(), &served).unwrap();
            let want =
                crate::request::tokenize_with(&tok, p.request.prompt.as_ref().unwrap(), false).unwrap();
            let mut counted = b.clone();
            counted.as_object_mut().unwrap().remove("max_tokens");
            let n = count_tokens(counted.to_string().as_bytes(), &served).unwrap();
            assert_eq!(n, json!({"input_tokens": want.len()}), "{extra}");
        }
        // Only the prompt's fields: generation's are unknown there.
        let e = count_tokens(body(json!({})).to_string().as_bytes(), &served).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"), "{}", e.message);
        let e =
            count_tokens(json!({"model": "x", "messages": []}).to_string().as_bytes(), &served).unwrap_err();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
    }
}
