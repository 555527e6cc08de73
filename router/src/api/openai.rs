//! OpenAI's chat completions and completions APIs' wire format.
//!
//! Requests are read field by field into a [`GenerateRequest`]: every field is either used,
//! accepted only with the value that means "off" (`echo: false`, `presence_penalty: 0`,
//! ...), or refused by name with a 400 — never silently ignored, so a client never believes it got
//! a behaviour it did not. The router's [`GenerateResponse`] stream is shaped into OpenAI's
//! completion, chat completion and chunk objects by a [`Shaper`].
//!
//! Nothing here knows about HTTP servers: [`crate::http`] serves it.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};
use tandem_proto::v1::{self, generate_request::Prompt, GenerateRequest, GenerateResponse};

use super::answer::{AnswerReader, Piece};
use super::chat::{self, ChatInput, OutputPlan, ParamNames, ToolChoice, ToolSpec};
use super::{random_id, rename, sse, user_salt, ApiError, Fields, Prepared, Served, Shape, SSE_DONE};
use tandem_model::grammar::Constraint;
use tandem_model::request::MAX_CHOICES;
use tandem_model::tokenizer::Tokenizer;
use tandem_model::tools::{ParsedCall, ToolDef};

/// Most alternatives per token a request may ask for (`logprobs` of a completion, `top_logprobs`
/// of a chat; OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Most stop sequences in one request (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// `max_tokens` of a completion request that leaves it unset (OpenAI's default). A chat request
/// that leaves it unset may use the whole context.
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;
pub use super::USER_SALT_PREFIX;

/// Which endpoint a request came to; it decides the prompt field and the response objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`: `prompt`, objects `text_completion`.
    Completions,
    /// `POST /v1/chat/completions`: `messages`, objects `chat.completion[.chunk]`.
    Chat,
}

impl Endpoint {
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Completions => "prompt",
            Endpoint::Chat => "messages",
        }
    }
}

/// A request read from the wire.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub request: GenerateRequest,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage.
    pub include_usage: bool,
    /// Completions `echo`: each choice's text (and logprobs) starts with the prompt's.
    pub echo: bool,
    /// Report the log-probability of each sampled token.
    pub logprobs: bool,
    /// How a chat's answer is read: tool calls, reasoning.
    pub output: OutputPlan,
}

/// Fields that are part of OpenAI's API but not of this server's; refused by name.
const UNSUPPORTED: &[&str] = &[
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "reasoning_effort",
    "store",
    "metadata",
    "service_tier",
];

/// Reads a request body for `endpoint` into the request to run and its shaper.
pub fn prepare(endpoint: Endpoint, body: &[u8], served: &Served<'_>) -> Result<Prepared, ApiError> {
    let parsed = parse(endpoint, body, served)?;
    let tok = served.loaded_tokenizer()?;
    let shape = Shaper::new(endpoint, served.answering(&parsed.request), tok, &parsed);
    Ok(Prepared { request: parsed.request, stream: parsed.stream, shape: Box::new(shape) })
}

/// Reads a request body for `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8], served: &Served<'_>) -> Result<Parsed, ApiError> {
    let mut f = Fields::of_body(body)?;

    let model = f.take_model(served)?;

    let prompt = match endpoint {
        Endpoint::Completions => completion_prompt(f.take_raw("prompt"))?,
        Endpoint::Chat => chat_prompt(f.take_raw("messages"))?,
    };

    let max_tokens = match endpoint {
        Endpoint::Completions => f.take::<i64>("max_tokens")?.map(|n| ("max_tokens", n)),
        Endpoint::Chat => {
            let a = f.take::<i64>("max_completion_tokens")?.map(|n| ("max_completion_tokens", n));
            let b = f.take::<i64>("max_tokens")?.map(|n| ("max_tokens", n));
            if a.is_some() && b.is_some() {
                return Err(ApiError::invalid(
                    "max_tokens",
                    "max_tokens: set either max_tokens or max_completion_tokens, not both",
                ));
            }
            a.or(b)
        }
    };
    let max_tokens_given = max_tokens;
    let max_tokens = match max_tokens {
        Some((name, n)) => {
            // 0 scores the prompt without generating: only with `echo` (checked below).
            if n < 1 && !(n == 0 && endpoint == Endpoint::Completions) {
                return Err(ApiError::invalid(name, format!("{name}: must be at least 1, got {n}")));
            }
            if n as u64 > served.context_len as u64 {
                return Err(ApiError::invalid(
                    name,
                    format!(
                        "{name}: {n} is more than the model's context length of {} tokens",
                        served.context_len
                    ),
                ));
            }
            n as u32
        }
        None if endpoint == Endpoint::Completions => DEFAULT_COMPLETION_MAX_TOKENS,
        None => served.context_len.min(u32::MAX as usize) as u32,
    };
    // A chat request without max_tokens asks for as many as fit (OpenAI's behaviour), so its
    // generation ends where the context does; a max_tokens the client gave, or the completions
    // default, must fit after the prompt or the request is refused naming both numbers.
    let max_tokens_must_fit = !(endpoint == Endpoint::Chat && max_tokens_given.is_none());

    let seed = match f.take::<serde_json::Number>("seed")? {
        None => None,
        Some(n) => Some(
            n.as_u64()
                .or_else(|| n.as_i64().map(|x| x as u64))
                .ok_or_else(|| ApiError::invalid("seed", format!("seed: must be an integer, got {n}")))?,
        ),
    };
    let sampling = v1::SamplingParams {
        // OpenAI's defaults: temperature 1, top_p 1.
        temperature: Some(f.take::<f32>("temperature")?.unwrap_or(1.0)),
        top_p: f.take("top_p")?,
        top_k: f.take("top_k")?,
        min_p: f.take("min_p")?,
        repetition_penalty: f.take("repetition_penalty")?,
        seed,
    };

    let stop = match f.take_raw("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP {
                return Err(ApiError::invalid(
                    "stop",
                    format!("stop: at most {MAX_STOP} stop sequences, got {}", items.len()),
                ));
            }
            items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    other => Err(ApiError::invalid("stop", format!("stop: expected strings, got {other}"))),
                })
                .collect::<Result<_, _>>()?
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "stop",
                format!("stop: expected a string or an array of strings, got {other}"),
            ))
        }
    };
    let stop_token_ids: Vec<u32> = f.take("stop_token_ids")?.unwrap_or_default();
    let ignore_eos = f.take::<bool>("ignore_eos")?.unwrap_or(false);

    let stream = f.take::<bool>("stream")?.unwrap_or(false);
    let include_usage = match f.take_raw("stream_options") {
        None => false,
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options: only allowed when stream is true",
            ))
        }
        Some(Value::Object(o)) => {
            let mut o = Fields(o);
            let usage = o.take::<bool>("include_usage").map_err(|e| rename(e, "stream_options."))?;
            o.finish().map_err(|e| rename(e, "stream_options."))?;
            usage.unwrap_or(false)
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!("stream_options: expected an object, got {other}"),
            ))
        }
    };

    // Log-probabilities, and how many alternatives per token (OpenAI's limit, 20).
    let too_many = |field: &str, n: u32| {
        ApiError::invalid(
            field,
            format!("{field}: at most {MAX_TOP_LOGPROBS} alternatives per token, got {n}"),
        )
    };
    let (logprobs, top_logprobs) = match endpoint {
        Endpoint::Completions => match f.take::<u32>("logprobs")? {
            None => (false, 0),
            Some(n) if n > MAX_TOP_LOGPROBS => return Err(too_many("logprobs", n)),
            Some(n) => (true, n),
        },
        Endpoint::Chat => {
            let on = f.take::<bool>("logprobs")?.unwrap_or(false);
            match f.take::<u32>("top_logprobs")? {
                Some(n) if n > MAX_TOP_LOGPROBS => return Err(too_many("top_logprobs", n)),
                Some(n) if n > 0 && !on => {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        "top_logprobs: requires logprobs to be true",
                    ))
                }
                n => (on, n.unwrap_or(0)),
            }
        }
    };

    let n = match f.take::<i64>("n")? {
        None => 1,
        Some(n) if (1..=i64::from(MAX_CHOICES)).contains(&n) => n as u32,
        Some(n) => {
            return Err(ApiError::invalid("n", format!("n: must be between 1 and {MAX_CHOICES}, got {n}")))
        }
    };
    // Accepted only with the value that leaves them off.
    for p in ["presence_penalty", "frequency_penalty"] {
        if let Some(x) = f.take::<f64>(p)? {
            if x != 0.0 {
                return Err(ApiError::invalid(
                    p,
                    format!("{p}: not supported (only 0); repetition_penalty is, as an extension"),
                ));
            }
        }
    }
    if let Some(bias) = f.take::<Map<String, Value>>("logit_bias")? {
        if !bias.is_empty() {
            return Err(ApiError::invalid("logit_bias", "logit_bias: not supported (only an empty object)"));
        }
    }
    let cache_salt = salt(f.take("cache_salt")?, f.take("user")?)?;
    let echo = endpoint == Endpoint::Completions && f.take::<bool>("echo")?.unwrap_or(false);
    if max_tokens == 0 && !echo {
        return Err(ApiError::invalid(
            "max_tokens",
            "max_tokens: must be at least 1, got 0 (0 only with echo, to score the prompt)",
        ));
    }
    // Echo with logprobs scores the prompt: each prompt token's log-probability and alternatives
    // (and max_tokens 0 is a request that only scores it).
    let prompt_logprobs = (echo && (logprobs || max_tokens == 0)).then_some(top_logprobs);
    if endpoint == Endpoint::Completions {
        only(&mut f, "best_of", Value::from(n), "only equal to n is supported")?;
        if f.take::<String>("suffix")?.is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "suffix: not supported"));
        }
    }
    let constraint = structured_output(&mut f)?;
    let (prompt, constraint, output) = match (endpoint, prompt) {
        (Endpoint::Chat, Prompt::Chat(chat)) => {
            let tools = tools(&mut f)?;
            let enable_thinking = template_kwargs(&mut f)?;
            let input = ChatInput {
                messages: chat.messages,
                tools,
                constraint: constraint.map(|(p, c)| (p.to_owned(), c)),
                enable_thinking,
            };
            f.finish_refusing(UNSUPPORTED)?;
            let plan = input.build(served, ParamNames { tools: "tools", tool_choice: "tool_choice" })?;
            (plan.prompt, plan.constraint, plan.output)
        }
        (_, prompt) => {
            for k in ["tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"] {
                if f.0.contains_key(k) {
                    return Err(ApiError::invalid(k, format!("{k}: only /v1/chat/completions takes it")));
                }
            }
            f.finish_refusing(UNSUPPORTED)?;
            if let (Some((param, c)), Some(tok)) = (&constraint, served.tokenizer) {
                let env = tok.grammar().map_err(|e| ApiError::invalid(param, format!("{param}: {e}")))?;
                env.compile(c)
                    .map_err(|e| ApiError::invalid(param, format!("{param}: invalid {}: {e}", c.kind())))?;
            }
            (prompt, constraint.map(|(_, c)| c), OutputPlan::default())
        }
    };

    Ok(Parsed {
        request: GenerateRequest {
            prompt: Some(prompt),
            max_tokens: Some(max_tokens),
            sampling: Some(sampling),
            stop,
            stop_token_ids,
            ignore_eos,
            request_id: String::new(),
            cache_salt,
            max_tokens_must_fit,
            top_logprobs,
            constraint: constraint.map(|c| tandem_serve::constraint::to_wire(&c)),
            n,
            prompt_logprobs,
            model,
        },
        stream,
        echo,
        include_usage,
        logprobs,
        output,
    })
}

/// `chat_template_kwargs`: only `enable_thinking` (the template's thinking switch) is served.
fn template_kwargs(f: &mut Fields) -> Result<Option<bool>, ApiError> {
    let Some(v) = f.take_raw("chat_template_kwargs") else { return Ok(None) };
    let Value::Object(o) = v else {
        return Err(ApiError::invalid("chat_template_kwargs", "chat_template_kwargs: expected an object"));
    };
    let mut o = Fields(o);
    let on = o.take::<bool>("enable_thinking").map_err(|e| rename(e, "chat_template_kwargs."))?;
    o.finish().map_err(|e| rename(e, "chat_template_kwargs."))?;
    Ok(on)
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` when there are no tools.
fn tools(f: &mut Fields) -> Result<Option<ToolSpec>, ApiError> {
    // An empty list is no tools, as in OpenAI's API.
    let list = f.take_raw("tools").filter(|l| l.as_array().is_none_or(|a| !a.is_empty()));
    let choice = f.take_raw("tool_choice");
    let parallel = f.take::<bool>("parallel_tool_calls")?.unwrap_or(true);
    let Some(list) = list else {
        return match choice {
            None => Ok(None),
            Some(Value::String(s)) if s == "none" => Ok(None),
            Some(_) => Err(ApiError::invalid("tool_choice", "tool_choice: needs tools")),
        };
    };
    let Value::Array(items) = &list else {
        return Err(ApiError::invalid("tools", "tools: expected an array of tools"));
    };
    chat::check_tool_count(items.len(), "tools")?;
    let mut defs: Vec<ToolDef> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = |m: &str| ApiError::invalid(&format!("tools[{i}]"), format!("tools[{i}]: {m}"));
        if item.get("type").and_then(Value::as_str) != Some("function") {
            return Err(at("`type` must be \"function\""));
        }
        let func =
            item.get("function").and_then(Value::as_object).ok_or_else(|| at("`function` is required"))?;
        let name =
            func.get("name").and_then(Value::as_str).ok_or_else(|| at("`function.name` is required"))?;
        chat::check_tool_name(name, &defs, &format!("tools[{i}]"))?;
        let parameters =
            chat::tool_parameters(func.get("parameters"), &format!("tools[{i}].function.parameters"))?;
        let description = func.get("description").and_then(Value::as_str).map(str::to_owned);
        defs.push(ToolDef { name: name.to_owned(), description, parameters });
    }
    let choice = match &choice {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice: `{other}` is not one of none, auto, required or a named function"),
                ))
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "tool_choice: expected none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            chat::check_named(name, &defs, "tool_choice")?;
            ToolChoice::Named(name.to_owned())
        }
    };
    Ok(Some(ToolSpec { defs, choice, parallel }))
}

/// The request's structured-output constraint and the parameter it came in, from one of:
/// `response_format` (OpenAI: `text`, `json_object`, `json_schema`), vLLM's `structured_outputs`
/// object (`json`, `regex`, `choice`, `grammar`, `json_object`) or its older `guided_json`,
/// `guided_regex`, `guided_choice` and `guided_grammar` fields. At most one may be given.
fn structured_output(f: &mut Fields) -> Result<Option<(&'static str, Constraint)>, ApiError> {
    let mut found: Vec<(&'static str, Constraint)> = Vec::new();
    if let Some(rf) = f.take_raw("response_format") {
        if let Some(c) = response_format(rf)? {
            found.push(("response_format", c));
        }
    }
    if let Some(so) = f.take_raw("structured_outputs") {
        let Value::Object(o) = so else {
            return Err(ApiError::invalid("structured_outputs", "structured_outputs: expected an object"));
        };
        let mut o = Fields(o);
        let mut inner = guided(&mut o, ["json", "regex", "choice", "grammar"])
            .map_err(|e| rename(e, "structured_outputs."))?;
        if o.take::<bool>("json_object").map_err(|e| rename(e, "structured_outputs."))? == Some(true) {
            inner.push(("json_object", Constraint::JsonObject));
        }
        o.finish().map_err(|e| rename(e, "structured_outputs."))?;
        if inner.len() > 1 {
            return Err(ApiError::invalid(
                "structured_outputs",
                "structured_outputs: set only one of json, regex, choice, grammar and json_object",
            ));
        }
        found.extend(inner.into_iter().map(|(_, c)| ("structured_outputs", c)));
    }
    found.extend(guided(f, ["guided_json", "guided_regex", "guided_choice", "guided_grammar"])?);
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(p, _)| *p).collect();
        return Err(ApiError::invalid(
            found[1].0,
            format!(
                "{}: only one structured-output constraint per request; got {}",
                found[1].0,
                names.join(", ")
            ),
        ));
    }
    if let Some((param, c)) = found.first() {
        c.check_shape().map_err(|e| ApiError::invalid(param, format!("{param}: {e}")))?;
    }
    Ok(found.pop())
}

/// OpenAI's `response_format`.
fn response_format(rf: Value) -> Result<Option<Constraint>, ApiError> {
    let bad = |m: String| ApiError::invalid("response_format", format!("response_format: {m}"));
    let Value::Object(o) = rf else { return Err(bad("expected an object".into())) };
    let mut o = Fields(o);
    let kind: String = o
        .take("type")
        .map_err(|e| rename(e, "response_format."))?
        .ok_or_else(|| bad("type is required (text, json_object or json_schema)".into()))?;
    let c = match kind.as_str() {
        "text" => None,
        "json_object" => Some(Constraint::JsonObject),
        "json_schema" => {
            let Some(Value::Object(js)) = o.take_raw("json_schema") else {
                return Err(bad("json_schema: an object with the schema is required".into()));
            };
            let mut js = Fields(js);
            let re = |e| rename(e, "response_format.json_schema.");
            let _name: Option<String> = js.take("name").map_err(re)?;
            let _description: Option<String> = js.take("description").map_err(re)?;
            // Every answer obeys the schema whether or not `strict` is set.
            let _strict: Option<bool> = js.take("strict").map_err(re)?;
            let schema =
                js.take_raw("schema").ok_or_else(|| bad("json_schema.schema: is required".into()))?;
            js.finish().map_err(re)?;
            Some(Constraint::JsonSchema(schema.to_string()))
        }
        other => {
            return Err(bad(format!("type `{other}` is not supported (text, json_object or json_schema)")))
        }
    };
    o.finish().map_err(|e| rename(e, "response_format."))?;
    Ok(c)
}

/// vLLM's guided-decoding fields, named `[json, regex, choice, grammar]` in that order. A JSON
/// schema may be given as an object or as its text.
fn guided(f: &mut Fields, names: [&'static str; 4]) -> Result<Vec<(&'static str, Constraint)>, ApiError> {
    let [json, regex, choice, grammar] = names;
    let mut out = Vec::new();
    match f.take_raw(json) {
        None => {}
        Some(Value::String(s)) => out.push((json, Constraint::JsonSchema(s))),
        Some(v @ (Value::Object(_) | Value::Bool(true))) => {
            out.push((json, Constraint::JsonSchema(v.to_string())))
        }
        Some(other) => {
            return Err(ApiError::invalid(
                json,
                format!("{json}: expected a JSON schema object, got {other}"),
            ))
        }
    }
    if let Some(r) = f.take::<String>(regex)? {
        out.push((regex, Constraint::Regex(r)));
    }
    if let Some(c) = f.take::<Vec<String>>(choice)? {
        out.push((choice, Constraint::Choice(c)));
    }
    if let Some(g) = f.take::<String>(grammar)? {
        out.push((grammar, Constraint::Grammar(g)));
    }
    Ok(out)
}

/// The request's prefix-cache salt: `cache_salt` as given; else, from `user`, `user:<user>`
/// (requests of one end user share cached prompts, and never with a `cache_salt` spelled like the
/// user); else none (the shared namespace). The length limit is checked here for `user`, whose
/// salt is longer than the field, and by the router for `cache_salt`.
fn salt(cache_salt: Option<String>, user: Option<String>) -> Result<String, ApiError> {
    match cache_salt {
        Some(s) => Ok(s),
        None => user_salt(user.as_deref(), "user"),
    }
}

/// Accepts field `name` only when absent, null or equal to `allowed`.
fn only(f: &mut Fields, name: &str, allowed: Value, why: &str) -> Result<(), ApiError> {
    match f.take_raw(name) {
        Some(v) if v != allowed => Err(ApiError::invalid(name, format!("{name}: {why}; got {v}"))),
        _ => Ok(()),
    }
}

/// `prompt`: a string, an array of one string, an array of token ids, or an array of one array
/// of token ids.
fn completion_prompt(v: Option<Value>) -> Result<Prompt, ApiError> {
    let bad = |m: String| ApiError::invalid("prompt", format!("prompt: {m}"));
    let ids = |items: Vec<Value>| -> Result<Prompt, ApiError> {
        let ids: Vec<u32> = items
            .into_iter()
            .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("token ids must be non-negative integers".into()))?;
        Ok(Prompt::TokenIds(v1::TokenIds { ids }))
    };
    let one = |v: Value| -> Result<Prompt, ApiError> {
        match v {
            Value::String(s) if s.is_empty() => Err(bad("is empty".into())),
            Value::String(s) => Ok(Prompt::Text(s)),
            Value::Array(items) if items.is_empty() => Err(bad("is empty".into())),
            Value::Array(items) => ids(items),
            other => Err(bad(format!("expected a string or an array of token ids, got {other}"))),
        }
    };
    match v {
        None => Err(bad("is required".into())),
        Some(Value::Array(items)) if items.is_empty() => Err(bad("is empty".into())),
        Some(Value::Array(items)) if items.iter().all(|x| x.is_number()) => ids(items),
        Some(Value::Array(items)) if items.len() > 1 => Err(bad(format!(
            "one prompt per request is supported, got {} (send them as separate requests)",
            items.len()
        ))),
        Some(Value::Array(mut items)) => one(items.remove(0)),
        Some(v) => one(v),
    }
}

/// `messages`: `[{role, content, name?}]`; content is a string or an array of text parts.
fn chat_prompt(v: Option<Value>) -> Result<Prompt, ApiError> {
    let items = match v {
        None => return Err(ApiError::invalid("messages", "messages: is required")),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(ApiError::invalid("messages", format!("messages: expected an array, got {other}")))
        }
    };
    if items.is_empty() {
        return Err(ApiError::invalid("messages", "messages: is empty"));
    }
    let mut messages = Vec::with_capacity(items.len());
    for (i, m) in items.into_iter().enumerate() {
        let at = format!("messages[{i}]");
        let bad =
            |field: &str, m: String| ApiError::invalid(&format!("{at}{field}"), format!("{at}{field}: {m}"));
        let Value::Object(m) = m else {
            return Err(bad("", "expected an object with role and content".into()));
        };
        let mut f = Fields(m);
        let role: String = f
            .take("role")
            .map_err(|e| rename(e, &format!("{at}.")))?
            .ok_or_else(|| bad(".role", "is required".into()))?;
        let role = match role.as_str() {
            "system" | "user" | "assistant" | "tool" => role,
            // OpenAI's newer name for system instructions; chat templates know `system`.
            "developer" => "system".to_owned(),
            other => {
                return Err(bad(
                    ".role",
                    format!("`{other}` is not supported (system, developer, user, assistant, tool)"),
                ))
            }
        };
        let re = |e| rename(e, &format!("{at}."));
        let tool_calls = match f.take_raw("tool_calls") {
            None => Vec::new(),
            Some(_) if role != "assistant" => {
                return Err(bad(".tool_calls", "only an assistant message has them".into()))
            }
            Some(Value::Array(calls)) => calls
                .into_iter()
                .enumerate()
                .map(|(j, c)| history_call(c).map_err(|m| bad(&format!(".tool_calls[{j}]"), m)))
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(bad(".tool_calls", format!("expected an array, got {other}"))),
        };
        let tool_call_id: Option<String> = f.take("tool_call_id").map_err(re)?;
        if role == "tool" && tool_call_id.is_none() {
            return Err(bad(".tool_call_id", "is required in a tool message".into()));
        }
        if role == "assistant" {
            // An earlier answer sent back as it came (openai-python's `message`) carries its
            // `refusal`; it is not part of the conversation the model sees.
            let _refusal: Option<String> = f.take("refusal").map_err(re)?;
        }
        let content = match f.take_raw("content") {
            // An assistant turn that only called tools (or refused) has no content.
            None if role == "assistant" => String::new(),
            None => return Err(bad(".content", "is required".into())),
            Some(Value::String(s)) => s,
            Some(Value::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, p) in parts.into_iter().enumerate() {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) if p.as_object().is_some_and(|o| o.len() == 2) => {
                            texts.push(t.to_owned())
                        }
                        _ => {
                            return Err(bad(
                                &format!(".content[{j}]"),
                                "only text parts ({\"type\": \"text\", \"text\": ...}) are supported".into(),
                            ))
                        }
                    }
                }
                texts.join("\n")
            }
            Some(other) => {
                return Err(bad(".content", format!("expected a string or an array of parts, got {other}")))
            }
        };
        let name: Option<String> = f.take("name").map_err(re)?;
        f.finish().map_err(re)?;
        messages.push(v1::ChatMessage { role, content, name, tool_calls, tool_call_id });
    }
    Ok(Prompt::Chat(v1::ChatPrompt {
        messages,
        add_generation_prompt: Some(true),
        tools_json: String::new(),
        enable_thinking: None,
    }))
}

/// One of an assistant message's earlier tool calls:
/// `{"id", "type": "function", "function": {"name", "arguments"}}` (arguments a JSON string).
fn history_call(c: Value) -> Result<v1::ToolCall, String> {
    let Value::Object(o) = c else { return Err("expected an object".into()) };
    let id = o.get("id").and_then(Value::as_str).unwrap_or_default().to_owned();
    if o.get("type").is_some_and(|t| t != "function") {
        return Err("only type `function` is supported".into());
    }
    let f = o.get("function").and_then(Value::as_object).ok_or("function: is required")?;
    let name = f.get("name").and_then(Value::as_str).ok_or("function.name: is required")?.to_owned();
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    Ok(v1::ToolCall { id, name, arguments })
}

/// A `/tokenize` request, in vLLM's shape: `prompt` (text), or `messages` rendered with the
/// model's chat template (`add_generation_prompt`, default true); `add_special_tokens` (default
/// true for `prompt`, false for `messages`, whose template writes BOS itself);
/// `return_token_strs` adds each token's vocabulary string. `model` is optional.
#[derive(Debug, Clone)]
pub struct TokenizeRequest {
    pub prompt: Prompt,
    pub add_special_tokens: bool,
    pub return_token_strs: bool,
}

/// Reads a `/tokenize` body.
pub fn parse_tokenize(body: &[u8], served: &Served<'_>) -> Result<TokenizeRequest, ApiError> {
    let mut f = object_fields(body, served)?;
    let prompt = match (f.take_raw("prompt"), f.take_raw("messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("prompt", "prompt: give either prompt or messages, not both"))
        }
        (Some(Value::String(s)), None) => Prompt::Text(s),
        (Some(other), None) => {
            return Err(ApiError::invalid("prompt", format!("prompt: expected a string, got {other}")))
        }
        (None, Some(m)) => {
            let Prompt::Chat(mut chat) = chat_prompt(Some(m))? else {
                unreachable!("chat_prompt gives a chat")
            };
            chat.add_generation_prompt = Some(f.take::<bool>("add_generation_prompt")?.unwrap_or(true));
            Prompt::Chat(chat)
        }
        (None, None) => {
            return Err(ApiError::invalid("prompt", "prompt: one of prompt or messages is required"))
        }
    };
    let chat = matches!(prompt, Prompt::Chat(_));
    let add_special_tokens = f.take::<bool>("add_special_tokens")?.unwrap_or(!chat);
    let return_token_strs = f.take::<bool>("return_token_strs")?.unwrap_or(false);
    f.finish()?;
    Ok(TokenizeRequest { prompt, add_special_tokens, return_token_strs })
}

/// The `/tokenize` response: `count`, `max_model_len`, `tokens` and `token_strs` (null unless
/// asked for).
pub fn tokenize_response(ids: &[u32], max_model_len: usize, token_strs: Option<Vec<String>>) -> Value {
    json!({"count": ids.len(), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs})
}

/// Reads a `/detokenize` body: `tokens` (required), `model` (optional).
pub fn parse_detokenize(body: &[u8], served: &Served<'_>) -> Result<Vec<u32>, ApiError> {
    let mut f = object_fields(body, served)?;
    let tokens: Vec<u32> =
        f.take("tokens")?.ok_or_else(|| ApiError::invalid("tokens", "tokens: is required"))?;
    f.finish()?;
    Ok(tokens)
}

/// A JSON object body whose `model`, when given, must be the served one.
fn object_fields(body: &[u8], served: &Served<'_>) -> Result<Fields, ApiError> {
    let mut f = Fields::of_body(body)?;
    if let Some(model) = f.take::<String>("model")? {
        served.resolve(model)?;
    }
    Ok(f)
}

/// Characters in the longest valid UTF-8 prefix of a byte stream, counted as the bytes come (a
/// character cut at the end is not counted yet): each byte is checked once while the stream is
/// valid, so a completion's offsets cost linear time.
#[derive(Debug, Default)]
struct CharCount {
    /// Characters of the valid prefix so far.
    chars: usize,
    /// The bytes after it: a cut character, or everything from an invalid sequence on.
    rest: Vec<u8>,
}

impl CharCount {
    fn push(&mut self, bytes: &[u8]) {
        self.rest.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.rest) {
            Ok(s) => s,
            Err(e) => std::str::from_utf8(&self.rest[..e.valid_up_to()]).unwrap_or(""),
        };
        let (chars, len) = (valid.chars().count(), valid.len());
        self.chars += chars;
        self.rest.drain(..len);
    }
}

/// Shapes one request's [`GenerateResponse`] stream into OpenAI objects: chunks as they come
/// ([`Shaper::chunks`]), or one response at the end ([`Shaper::absorb`] then
/// [`Shaper::response`]). With `n` > 1 each message belongs to one choice (its `index`), and each
/// choice is shaped on its own; the usage comes once, for the whole request.
pub struct Shaper {
    endpoint: Endpoint,
    model: String,
    tok: Tokenizer,
    logprobs: bool,
    include_usage: bool,
    created: u64,
    id: String,
    /// Alternatives asked for per token (0: none).
    top_logprobs: u32,
    usage: Option<v1::Usage>,
    /// Chat: how answers are read (tool calls, reasoning); when not plain, each choice's text
    /// goes through its [`AnswerReader`].
    output: OutputPlan,
    /// One per choice.
    choices: Vec<ChoiceShape>,
    /// Completions `echo`: each choice starts with the prompt.
    echo: bool,
    /// The prompt as echoed, once the first response brought it.
    prompt: Option<Echo>,
}

/// The prompt as `echo` shows it: its text (every token's, special ones included, so that the
/// offsets of the tokens match it), and per token its log-probability (none for the first) and
/// alternatives, when the prompt was scored.
struct Echo {
    text: String,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    tops: Vec<v1::TopLogprobs>,
}

/// What one choice has shown so far.
#[derive(Default)]
struct ChoiceShape {
    /// Characters of the completion so far, from its tokens' bytes (the next token's
    /// `text_offset`).
    offset: CharCount,
    sent_first: bool,
    /// The prompt was put in front of this choice (`echo`).
    echoed: bool,
    text: String,
    token_logprobs: Vec<(u32, f32)>,
    /// The alternatives at each token of `token_logprobs` (when asked for).
    token_tops: Vec<v1::TopLogprobs>,
    finish: Option<String>,
    /// With tools or reasoning: the answer's reader.
    reader: Option<AnswerReader>,
}

impl Shaper {
    pub fn new(endpoint: Endpoint, model: &str, tok: Tokenizer, parsed: &Parsed) -> Shaper {
        let reader_tok = tok.clone();
        Shaper {
            endpoint,
            model: model.to_owned(),
            tok,
            logprobs: parsed.logprobs,
            include_usage: parsed.include_usage,
            created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            id: String::new(),
            top_logprobs: parsed.request.top_logprobs,
            usage: None,
            output: if endpoint == Endpoint::Chat { parsed.output.clone() } else { OutputPlan::default() },
            choices: (0..parsed.request.n.max(1))
                .map(|_| ChoiceShape {
                    reader: (endpoint == Endpoint::Chat && !parsed.output.is_plain())
                        .then(|| AnswerReader::new(parsed.output.clone(), reader_tok.clone())),
                    ..ChoiceShape::default()
                })
                .collect(),
            echo: parsed.echo,
            prompt: None,
        }
    }

    /// With `echo`, the prompt for choice `i` when it has not had it yet (the first response of
    /// the request carries the prompt and its scores).
    fn echo_for(&mut self, i: usize, r: &GenerateResponse) -> Option<Echo> {
        if !self.echo || self.choices[i].echoed {
            return None;
        }
        if self.prompt.is_none() && !r.prompt_token_ids.is_empty() {
            let tokens = r.prompt_token_ids.clone();
            let mut logprobs = vec![f32::NAN];
            logprobs.extend(&r.prompt_logprobs);
            let mut tops = vec![v1::TopLogprobs::default()];
            tops.extend(r.prompt_top_logprobs.iter().cloned());
            let text = self.tok.decode(&tokens, false).unwrap_or_default();
            self.prompt = Some(Echo { text, tokens, logprobs, tops });
        }
        let p = self.prompt.as_ref()?;
        self.choices[i].echoed = true;
        Some(Echo {
            text: p.text.clone(),
            tokens: p.tokens.clone(),
            logprobs: p.logprobs.clone(),
            tops: p.tops.clone(),
        })
    }

    /// Whether every choice's last response (with its finish reason) has been seen.
    pub fn finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    fn take_id(&mut self, r: &GenerateResponse) {
        if self.id.is_empty() {
            let prefix = match self.endpoint {
                Endpoint::Completions => "cmpl-",
                Endpoint::Chat => "chatcmpl-",
            };
            let rid = if r.request_id.is_empty() { "0" } else { r.request_id.as_str() };
            self.id = format!("{prefix}{rid}");
        }
        if r.usage.is_some() {
            self.usage = r.usage;
        }
    }

    /// The choice a response belongs to (one the request did not ask for is shaped as the last).
    fn index(&self, r: &GenerateResponse) -> usize {
        (r.index as usize).min(self.choices.len() - 1)
    }

    /// The `logprobs` object of choice `i`'s `tokens` (null unless asked for).
    fn logprobs_of(&mut self, i: usize, tokens: &[u32], logprobs: &[f32], tops: &[v1::TopLogprobs]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        // Each token's alternatives, as (text, bytes, logprob), most likely first; none unless
        // asked for.
        let alts: Vec<Vec<(String, Vec<u8>, f32)>> = (0..tokens.len())
            .map(|i| match tops.get(i) {
                Some(t) if self.top_logprobs > 0 => t
                    .token_ids
                    .iter()
                    .zip(&t.logprobs)
                    .map(|(&id, &lp)| {
                        let text = self.tok.token_text(id).unwrap_or_default();
                        (text, self.tok.token_bytes(id).unwrap_or_default(), lp)
                    })
                    .collect(),
                _ => Vec::new(),
            })
            .collect();
        let texts: Vec<String> = tokens.iter().map(|&t| self.tok.token_text(t).unwrap_or_default()).collect();
        // A token's real bytes: one holding part of a UTF-8 character shows U+FFFD as its text,
        // but its bytes (and the offsets after it) are exact.
        let bytes: Vec<Vec<u8>> =
            tokens.iter().map(|&t| self.tok.token_bytes(t).unwrap_or_default()).collect();
        let lps: Vec<Value> =
            (0..tokens.len()).map(|i| logprobs.get(i).map_or(Value::Null, |&x| json!(x))).collect();
        match self.endpoint {
            Endpoint::Completions => {
                let offset = &mut self.choices[i].offset;
                let mut offsets = Vec::with_capacity(texts.len());
                for b in &bytes {
                    offsets.push(offset.chars);
                    offset.push(b);
                }
                // One object per position, token text → log-probability, as OpenAI's legacy API
                // (null for an echoed prompt's first token, which nothing predicts).
                let tops = if self.top_logprobs > 0 {
                    let per: Vec<Value> = alts
                        .iter()
                        .zip(&lps)
                        .map(|(a, lp)| match (a.is_empty(), lp) {
                            (true, Value::Null) => Value::Null,
                            _ => Value::Object(a.iter().map(|(t, _, lp)| (t.clone(), json!(lp))).collect()),
                        })
                        .collect();
                    json!(per)
                } else {
                    Value::Null
                };
                json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
            }
            Endpoint::Chat => {
                let content: Vec<Value> = texts
                    .into_iter()
                    .zip(lps)
                    .zip(bytes)
                    .zip(alts)
                    .map(|(((t, lp), b), a)| {
                        let top: Vec<Value> = a
                            .into_iter()
                            .map(|(t, b, lp)| json!({"token": t, "logprob": lp, "bytes": b}))
                            .collect();
                        json!({"token": t, "logprob": lp, "bytes": b, "top_logprobs": top})
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
        }
    }

    fn usage_json(&self) -> Value {
        match &self.usage {
            Some(u) => json!({
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            }),
            None => Value::Null,
        }
    }

    fn chunk(&self, choices: Value) -> Value {
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices});
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The chunks one response becomes when streaming: its text (chat: each choice's first with
    /// the assistant's role), then on a choice's last response a chunk with its finish reason
    /// and, after the last choice's, one with the usage when asked for.
    pub fn chunks(&mut self, r: &GenerateResponse) -> Vec<Value> {
        self.take_id(r);
        let i = self.index(r);
        if self.choices[i].reader.is_some() {
            return self.read_chunks(i, r);
        }
        let mut out = Vec::new();
        let first = !std::mem::replace(&mut self.choices[i].sent_first, true);
        if first || !r.text.is_empty() || !r.token_ids.is_empty() {
            let logprobs;
            let mut text = r.text.clone();
            if let Some(mut e) = self.echo_for(i, r) {
                // The prompt first, then what this response brought.
                text = e.text + &text;
                e.tokens.extend(&r.token_ids);
                e.logprobs.resize(e.tokens.len() - r.token_ids.len(), f32::NAN);
                e.logprobs.extend(&r.logprobs);
                e.tops.resize(e.tokens.len() - r.token_ids.len(), v1::TopLogprobs::default());
                e.tops.extend(r.top_logprobs.iter().cloned());
                logprobs = self.logprobs_of(i, &e.tokens, &e.logprobs, &e.tops);
            } else {
                logprobs = self.logprobs_of(i, &r.token_ids, &r.logprobs, &r.top_logprobs);
            }
            let choice = match self.endpoint {
                Endpoint::Completions => {
                    json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": null})
                }
                Endpoint::Chat => {
                    let delta = if first {
                        json!({"role": "assistant", "content": r.text})
                    } else {
                        json!({"content": r.text})
                    };
                    json!({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": null})
                }
            };
            out.push(self.chunk(json!([choice])));
        }
        if let Some(reason) = &r.finish_reason {
            self.close(i, reason.clone(), &mut out);
        }
        out
    }

    /// A choice's last chunk, with its finish reason; after the last choice's, the chunk with
    /// the usage when asked for.
    fn close(&mut self, i: usize, reason: String, out: &mut Vec<Value>) {
        let choice = match self.endpoint {
            Endpoint::Completions => {
                json!({"index": i, "text": "", "logprobs": null, "finish_reason": reason})
            }
            Endpoint::Chat => json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": reason}),
        };
        self.choices[i].finish = Some(reason);
        out.push(self.chunk(json!([choice])));
        if self.include_usage && self.finished() {
            let mut u = self.chunk(json!([]));
            u["usage"] = self.usage_json();
            out.push(u);
        }
    }

    /// The calls of a finished answer as OpenAI writes them (`index` for streamed deltas).
    fn tool_calls_json(&self, calls: &[ParsedCall], with_index: bool) -> Vec<Value> {
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({
                    "id": format!("call_{}", random_id()),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                if with_index {
                    v["index"] = json!(i);
                }
                v
            })
            .collect()
    }

    /// Streaming with tools or reasoning: reasoning goes out as `reasoning_content` and text as
    /// `content` once no continuation can take them back; the calls, read from the finished
    /// answer, go out as tool-call deltas, and the finish reason is `tool_calls` when there are
    /// any.
    fn read_chunks(&mut self, i: usize, r: &GenerateResponse) -> Vec<Value> {
        let mut out = Vec::new();
        let reader = self.choices[i].reader.as_mut().expect("a reader");
        let mut pieces = reader.push(r);
        let mut calls = Vec::new();
        if r.finish_reason.is_some() {
            let (rest, c) = reader.finish();
            pieces.extend(rest);
            calls = c;
        }
        let mut first = !std::mem::replace(&mut self.choices[i].sent_first, true);
        if first && pieces.is_empty() {
            pieces.push(Piece::Text(String::new()));
        }
        for p in pieces {
            let mut delta = match p {
                Piece::Reasoning(t) => json!({"reasoning_content": t}),
                Piece::Text(t) => json!({"content": t}),
            };
            if std::mem::take(&mut first) {
                delta["role"] = json!("assistant");
            }
            out.push(
                self.chunk(json!([{"index": i, "delta": delta, "logprobs": null, "finish_reason": null}])),
            );
        }
        let Some(reason) = r.finish_reason.clone() else { return out };
        let reason = if calls.is_empty() {
            reason
        } else {
            for call in self.tool_calls_json(&calls, true) {
                out.push(self.chunk(json!([{"index": i, "delta": {"tool_calls": [call]}, "logprobs": null, "finish_reason": null}])));
            }
            "tool_calls".to_owned()
        };
        self.close(i, reason, &mut out);
        out
    }

    /// Takes in one response of a request answered at once.
    pub fn absorb(&mut self, r: &GenerateResponse) {
        self.take_id(r);
        let i = self.index(r);
        if let Some(reader) = &mut self.choices[i].reader {
            reader.append(r);
        }
        if let Some(e) = self.echo_for(i, r) {
            let c = &mut self.choices[i];
            c.text.push_str(&e.text);
            for (k, &t) in e.tokens.iter().enumerate() {
                c.token_logprobs.push((t, e.logprobs.get(k).copied().unwrap_or(f32::NAN)));
                c.token_tops.push(e.tops.get(k).cloned().unwrap_or_default());
            }
        }
        let c = &mut self.choices[i];
        c.text.push_str(&r.text);
        for (k, &t) in r.token_ids.iter().enumerate() {
            c.token_logprobs.push((t, r.logprobs.get(k).copied().unwrap_or(f32::NAN)));
            c.token_tops.push(r.top_logprobs.get(k).cloned().unwrap_or_default());
        }
        if let Some(reason) = &r.finish_reason {
            c.finish = Some(reason.clone());
        }
    }

    /// The whole response, once every choice's last message was absorbed.
    pub fn response(&mut self) -> Value {
        let choices: Vec<Value> = (0..self.choices.len()).map(|i| self.choice_json(i)).collect();
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage_json(),
        })
    }

    /// Choice `i` of the whole response.
    fn choice_json(&mut self, i: usize) -> Value {
        let (tokens, lps): (Vec<u32>, Vec<f32>) =
            std::mem::take(&mut self.choices[i].token_logprobs).into_iter().unzip();
        let tops = std::mem::take(&mut self.choices[i].token_tops);
        let logprobs = self.logprobs_of(i, &tokens, &lps, &tops);
        let c = &self.choices[i];
        match self.endpoint {
            Endpoint::Completions => {
                json!({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish})
            }
            Endpoint::Chat => {
                let mut message = json!({"role": "assistant", "content": c.text, "refusal": null});
                let mut finish = c.finish.clone();
                if let Some(reader) = &c.reader {
                    let a = reader.answer();
                    if self.output.reasoning.is_some() {
                        message["reasoning_content"] = json!(a.reasoning);
                    }
                    if a.calls.is_empty() {
                        message["content"] = json!(a.content.unwrap_or_default());
                    } else {
                        message["content"] = json!(a.content);
                        message["tool_calls"] = json!(self.tool_calls_json(&a.calls, false));
                        finish = Some("tool_calls".into());
                    }
                }
                json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }
}

impl Shape for Shaper {
    fn stream(&mut self, r: &GenerateResponse) -> String {
        self.chunks(r).iter().map(sse).collect()
    }

    fn stream_error(&mut self, e: &ApiError) -> String {
        format!("{}{SSE_DONE}", sse(&e.body()))
    }

    fn stream_end(&mut self) -> String {
        SSE_DONE.to_owned()
    }

    fn finished(&self) -> bool {
        Shaper::finished(self)
    }

    fn absorb(&mut self, r: &GenerateResponse) {
        Shaper::absorb(self, r)
    }

    fn response(&mut self) -> Value {
        Shaper::response(self)
    }

    fn prompt_param(&self) -> &'static str {
        self.endpoint.prompt_param()
    }
}

/// `GET /v1/models/{id}`'s object for the served model (and the first entry of `GET /v1/models`).
pub fn model_object(name: &str, created: u64) -> Value {
    json!({"id": name, "object": "model", "created": created, "owned_by": "tandem", "root": name, "parent": null})
}

/// The object of a LoRA adapter over the served model `base` (vLLM's shape: the base model is
/// its `parent` and `root`).
pub fn adapter_object(name: &str, base: &str, created: u64) -> Value {
    json!({"id": name, "object": "model", "created": created, "owned_by": "tandem", "root": base, "parent": base})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{NoAdapters, USER_SALT_PREFIX};
    use crate::request::MAX_CACHE_SALT_BYTES;
    use http::StatusCode;
    use tandem_model::tools::ToolFormat;
    use tonic::{Code, Status};

    const SERVED: Served<'static> =
        Served { model: "tiny", adapters: &NoAdapters, context_len: 512, tokenizer: None, responses: None };

    fn parse_json(endpoint: Endpoint, v: Value) -> Result<Parsed, ApiError> {
        parse(endpoint, v.to_string().as_bytes(), &SERVED)
    }

    fn fixture_tokenizer() -> Tokenizer {
        crate::api::test_support::tokenizer(None)
    }

    fn err(endpoint: Endpoint, v: Value) -> ApiError {
        parse_json(endpoint, v).expect_err("should be refused")
    }

    #[test]
    fn completion_fields_map_to_the_generate_request() {
        let p = parse_json(
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": ["Hello"], "max_tokens": 7, "temperature": 0, "top_p": 0.5,
                   "seed": -1, "stop": "\n", "top_k": 4, "ignore_eos": true, "n": 1, "user": "u",
                   "presence_penalty": 0, "echo": false, "logprobs": 0, "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
        .unwrap();
        let r = &p.request;
        assert_eq!(r.prompt, Some(Prompt::Text("Hello".into())));
        assert_eq!(r.max_tokens, Some(7));
        let s = r.sampling.unwrap();
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.seed),
            (Some(0.0), Some(0.5), Some(4), Some(u64::MAX))
        );
        assert_eq!(r.stop, vec!["\n".to_string()]);
        assert!(r.ignore_eos && p.stream && p.include_usage && p.logprobs);
    }

    #[test]
    fn alternatives_per_token_reach_the_request() {
        let p = parse_json(Endpoint::Completions, json!({"model": "tiny", "prompt": "x", "logprobs": 5}))
            .unwrap();
        assert!(p.logprobs);
        assert_eq!(p.request.top_logprobs, 5);
        let chat = |extra: Value| {
            let mut b = json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}]});
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            parse_json(Endpoint::Chat, b)
        };
        let p = chat(json!({"logprobs": true, "top_logprobs": 20})).unwrap();
        assert_eq!((p.logprobs, p.request.top_logprobs), (true, 20));
        let p = chat(json!({"logprobs": true})).unwrap();
        assert_eq!((p.logprobs, p.request.top_logprobs), (true, 0));
        let e = chat(json!({"top_logprobs": 2})).unwrap_err();
        assert!(e.message.contains("requires logprobs"), "{}", e.message);
    }

    #[test]
    fn only_a_chat_without_max_tokens_may_be_cut_short_by_the_context() {
        let chat = |extra: Value| {
            let mut b =
                json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi", "name": "ana"}]});
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            parse_json(Endpoint::Chat, b).unwrap().request
        };
        let r = chat(json!({}));
        assert!(!r.max_tokens_must_fit, "as many as fit");
        assert_eq!(r.max_tokens, Some(512));
        let Some(Prompt::Chat(c)) = &r.prompt else { panic!("a chat prompt") };
        assert_eq!(c.messages[0].name.as_deref(), Some("ana"), "messages[].name reaches the template");
        assert!(chat(json!({"max_tokens": 5})).max_tokens_must_fit);
        assert!(chat(json!({"max_completion_tokens": 5})).max_tokens_must_fit);
        let p = parse_json(Endpoint::Completions, json!({"model": "tiny", "prompt": "x"})).unwrap();
        assert!(p.request.max_tokens_must_fit, "the completions default must fit, as in OpenAI");
    }

    #[test]
    fn defaults_follow_openai() {
        let p = parse_json(Endpoint::Completions, json!({"model": "tiny", "prompt": [[1, 2, 3]]})).unwrap();
        assert_eq!(p.request.prompt, Some(Prompt::TokenIds(v1::TokenIds { ids: vec![1, 2, 3] })));
        assert_eq!(p.request.max_tokens, Some(DEFAULT_COMPLETION_MAX_TOKENS));
        assert_eq!(p.request.sampling.unwrap().temperature, Some(1.0));
        assert!(!p.stream && !p.logprobs);
        let p = parse_json(
            Endpoint::Chat,
            json!({"model": "tiny", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                   "logprobs": true, "top_logprobs": 0}),
        )
        .unwrap();
        let Some(Prompt::Chat(c)) = p.request.prompt else { panic!("chat prompt") };
        assert_eq!((c.messages[0].role.as_str(), c.messages[0].content.as_str()), ("system", "a\nb"));
        assert_eq!(p.request.max_tokens, Some(512), "chat may use the whole context by default");
        assert!(p.logprobs);
    }

    #[test]
    fn refusals_name_the_parameter() {
        let c = Endpoint::Completions;
        let cases: Vec<(Endpoint, Value, &str, &str)> = vec![
            (c, json!({"model": "tiny", "prompt": "x", "bogus": 1}), "bogus", "unknown parameter `bogus`"),
            (c, json!({"model": "tiny", "prompt": "x", "max_tokens": "5"}), "max_tokens", "invalid type"),
            (c, json!({"model": "tiny", "prompt": "x", "max_tokens": -1}), "max_tokens", "at least 1"),
            (
                c,
                json!({"model": "tiny", "prompt": "x", "max_tokens": 100000}),
                "max_tokens",
                "context length of 512",
            ),
            (c, json!({"model": "tiny", "prompt": ""}), "prompt", "prompt: is empty"),
            (c, json!({"model": "tiny", "prompt": []}), "prompt", "prompt: is empty"),
            (c, json!({"model": "tiny", "prompt": ["a", "b"]}), "prompt", "one prompt per request"),
            (c, json!({"model": "tiny"}), "prompt", "prompt: is required"),
            (c, json!({"prompt": "x"}), "model", "model: is required"),
            (c, json!({"model": "tiny", "prompt": "x", "n": 17}), "n", "n: must be between 1 and 16, got 17"),
            (c, json!({"model": "tiny", "prompt": "x", "n": 0}), "n", "n: must be between 1 and 16, got 0"),
            (c, json!({"model": "tiny", "prompt": "x", "n": 2, "best_of": 3}), "best_of", "only equal to n"),
            (
                c,
                json!({"model": "tiny", "prompt": "x", "logprobs": 21}),
                "logprobs",
                "at most 20 alternatives",
            ),
            (c, json!({"model": "tiny", "prompt": "x", "max_tokens": 0}), "max_tokens", "0 only with echo"),
            (
                Endpoint::Chat,
                json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "echo": true}),
                "echo",
                "unknown parameter",
            ),
            (
                c,
                json!({"model": "tiny", "prompt": "x", "frequency_penalty": 0.5}),
                "frequency_penalty",
                "not supported",
            ),
            (
                c,
                json!({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}),
                "stop",
                "at most 4",
            ),
            (
                c,
                json!({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": true}}),
                "stream_options",
                "only allowed when stream is true",
            ),
            (
                c,
                json!({"model": "tiny", "prompt": "x", "stream": true, "stream_options": {"x": 1}}),
                "stream_options.x",
                "unknown parameter",
            ),
            (Endpoint::Chat, json!({"model": "tiny", "messages": []}), "messages", "messages: is empty"),
            (
                Endpoint::Chat,
                json!({"model": "tiny", "messages": [{"role": "function", "content": "x"}]}),
                "messages[0].role",
                "not supported",
            ),
            (
                Endpoint::Chat,
                json!({"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}),
                "messages[0].tool_call_id",
                "is required",
            ),
            (
                Endpoint::Chat,
                json!({"model": "tiny", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
                "messages[0].tool_calls",
                "only an assistant message",
            ),
            (
                Endpoint::Chat,
                json!({"model": "tiny", "messages": [{"role": "user"}]}),
                "messages[0].content",
                "is required",
            ),
            (
                Endpoint::Chat,
                json!({"model": "tiny", "messages": [{"role": "user", "content": "x", "extra": 1}]}),
                "messages[0].extra",
                "unknown parameter",
            ),
            (
                Endpoint::Chat,
                json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": true}),
                "top_logprobs",
                "at most 20 alternatives",
            ),
            (
                Endpoint::Chat,
                json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [],
                       "tool_choice": "required"}),
                "tool_choice",
                "needs tools",
            ),
        ];
        for (endpoint, body, param, needle) in cases {
            let e = err(endpoint, body.clone());
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}: {e:?}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
            assert!(e.message.contains(needle), "{body}: {:?} lacks {needle:?}", e.message);
        }
        let e = err(c, json!({"model": "other", "prompt": "x"}));
        assert_eq!((e.status, e.code), (StatusCode::NOT_FOUND, Some("model_not_found")));
        let e = parse(c, b"{not json", &SERVED).unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{e:?}");
        let e = parse(c, b"[1]", &SERVED).unwrap_err();
        assert!(e.message.contains("JSON object"), "{e:?}");
    }

    #[test]
    fn router_statuses_become_openai_errors() {
        let e = ApiError::from_status(
            &Status::invalid_argument("sampling.temperature: must be finite and >= 0, got -1"),
            Endpoint::Chat.prompt_param(),
        );
        assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("temperature")));
        assert_eq!(e.message, "temperature: must be finite and >= 0, got -1");
        let e = ApiError::from_status(
            &Status::invalid_argument("prompt.chat: bad template"),
            Endpoint::Chat.prompt_param(),
        );
        assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("messages"), "messages: bad template"));
        let e = ApiError::from_status(
            &Status::invalid_argument("prompt has 600 tokens; the limit is 511 (context length)"),
            Endpoint::Completions.prompt_param(),
        );
        assert_eq!((e.param.as_deref(), e.code), (Some("prompt"), Some("context_length_exceeded")));
        let codes = [
            (Code::ResourceExhausted, StatusCode::TOO_MANY_REQUESTS),
            (Code::Unavailable, StatusCode::SERVICE_UNAVAILABLE),
            (Code::DeadlineExceeded, StatusCode::GATEWAY_TIMEOUT),
            (Code::Unauthenticated, StatusCode::UNAUTHORIZED),
            (Code::Aborted, StatusCode::INTERNAL_SERVER_ERROR),
        ];
        for (code, status) in codes {
            assert_eq!(
                ApiError::from_status(&Status::new(code, "x"), Endpoint::Chat.prompt_param()).status,
                status
            );
        }
        let body = ApiError::model_not_found("a", "b").body();
        assert_eq!(body["error"]["code"], "model_not_found");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn cache_salt_comes_from_cache_salt_else_from_user() {
        for endpoint in [Endpoint::Completions, Endpoint::Chat] {
            let salt_of = |extra: Value| {
                let mut body = match endpoint {
                    Endpoint::Completions => json!({"model": "tiny", "prompt": "x"}),
                    Endpoint::Chat => {
                        json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
                    }
                };
                body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
                parse_json(endpoint, body).map(|p| p.request.cache_salt)
            };
            assert_eq!(salt_of(json!({})).unwrap(), "");
            assert_eq!(salt_of(json!({"user": ""})).unwrap(), "");
            assert_eq!(salt_of(json!({"cache_salt": "x"})).unwrap(), "x");
            assert_eq!(salt_of(json!({"user": "x"})).unwrap(), "user:x", "never the salt `x`");
            assert_eq!(salt_of(json!({"user": "x", "cache_salt": "t"})).unwrap(), "t");
            let longest = "u".repeat(MAX_CACHE_SALT_BYTES - USER_SALT_PREFIX.len());
            assert_eq!(salt_of(json!({"user": longest})).unwrap().len(), MAX_CACHE_SALT_BYTES);
            let e = salt_of(json!({"user": format!("{longest}u")})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("user"), "{e:?}");
            assert!(e.message.starts_with("user: at most 251 bytes, got 252"), "{e:?}");
            let e = salt_of(json!({"cache_salt": 5})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("cache_salt"), "{e:?}");
        }
        // The router's own length check is renamed to this API's parameter.
        let e = ApiError::from_status(
            &Status::invalid_argument("cache_salt: at most 256 bytes, got 300"),
            Endpoint::Chat.prompt_param(),
        );
        assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("cache_salt")));
    }

    #[test]
    fn usage_reports_cached_prompt_tokens() {
        let tok = fixture_tokenizer();
        let last = GenerateResponse {
            token_ids: vec![300],
            finish_reason: Some("length".into()),
            usage: Some(v1::Usage { prompt_tokens: 40, completion_tokens: 1, cached_tokens: 32 }),
            ..Default::default()
        };
        let want = json!({"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
                          "prompt_tokens_details": {"cached_tokens": 32}});
        let body = json!({"model": "tiny", "prompt": "x", "stream": true, "stream_options": {"include_usage": true}});
        let parsed = parse_json(Endpoint::Completions, body).unwrap();
        let mut shaper = Shaper::new(Endpoint::Completions, "tiny", tok.clone(), &parsed);
        let chunks = shaper.chunks(&last);
        assert_eq!(chunks.last().unwrap()["usage"], want);
        let parsed = parse_json(
            Endpoint::Chat,
            json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
        )
        .unwrap();
        let mut shaper = Shaper::new(Endpoint::Chat, "tiny", tok, &parsed);
        shaper.absorb(&last);
        assert_eq!(shaper.response()["usage"], want);
    }

    /// Logprobs of tokens that cut a character: `bytes` are the token's real bytes (they
    /// concatenate to the text), and `text_offset` counts the characters of the text before each
    /// token, never drifting over U+FFFD stand-ins.
    #[test]
    fn logprob_bytes_and_offsets_follow_the_real_text() {
        let tok = fixture_tokenizer();
        let text = "é東京x";
        let ids = tok.encode(text, false).unwrap();
        let last = GenerateResponse {
            token_ids: ids.clone(),
            logprobs: vec![-0.5; ids.len()],
            finish_reason: Some("length".into()),
            ..Default::default()
        };
        let chat = json!({"model": "tiny", "logprobs": true, "messages": [{"role": "user", "content": "x"}]});
        let mut shaper =
            Shaper::new(Endpoint::Chat, "tiny", tok.clone(), &parse_json(Endpoint::Chat, chat).unwrap());
        shaper.absorb(&last);
        let content = shaper.response()["choices"][0]["logprobs"]["content"].clone();
        let bytes: Vec<u8> = content
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|c| {
                c["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(bytes, text.as_bytes(), "{content}");

        let comp = json!({"model": "tiny", "prompt": "x", "logprobs": 0});
        let parsed = parse_json(Endpoint::Completions, comp).unwrap();
        let mut shaper = Shaper::new(Endpoint::Completions, "tiny", tok.clone(), &parsed);
        shaper.absorb(&last);
        let lp = shaper.response()["choices"][0]["logprobs"].clone();
        let offsets: Vec<usize> =
            lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap() as usize).collect();
        // Each offset is the characters fully decoded before that token; the last token is `x`,
        // after the three characters é, 東 and 京.
        assert_eq!(offsets.len(), ids.len());
        assert_eq!(*offsets.last().unwrap(), 3, "{lp}");
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{lp}");
        let count = |parts: &[&[u8]]| {
            let mut c = CharCount::default();
            parts.iter().for_each(|p| c.push(p));
            c.chars
        };
        let b = "é東".as_bytes();
        assert_eq!(count(&[b]), 2);
        assert_eq!(count(&[&b[..3]]), 1, "a cut character is not counted");
        assert_eq!(count(&[&b[..1], &b[1..3], &b[3..]]), 2, "a character counts once it is whole");
        assert_eq!(count(&[b"a", &[0xFF], b"bc"]), 1, "nothing counts after an invalid byte");
    }

    /// A request refused at admission because the router began draining gets the same code as
    /// one refused at the door, whichever check saw the drain first.
    #[test]
    fn draining_refusals_carry_the_draining_code_from_either_check() {
        let e = ApiError::from_status(
            &Status::unavailable(crate::orchestrate::DRAINING),
            Endpoint::Completions.prompt_param(),
        );
        assert_eq!((e.status, e.code), (StatusCode::SERVICE_UNAVAILABLE, Some("draining")));
        let e = ApiError::from_status(
            &Status::unavailable("no decode worker is ready"),
            Endpoint::Completions.prompt_param(),
        );
        assert_eq!(e.code, Some("unavailable"));
    }

    /// Every way of asking for structured output reads into one constraint; two at once, an
    /// unknown kind, a missing schema and a schema the engine cannot compile are each refused
    /// naming the parameter.
    #[test]
    fn structured_output_fields_read_into_one_constraint() {
        use tandem_proto::v1::output_constraint::Kind;
        let chat = |extra: Value| {
            let mut b = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]});
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            b
        };
        let kind = |extra: Value| {
            let p = parse_json(Endpoint::Chat, chat(extra)).unwrap();
            p.request.constraint.and_then(|c| c.kind)
        };
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(kind(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(kind(json!({"response_format": {"type": "json_object"}})), Some(Kind::JsonObject(true)));
        let got = kind(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": true}}}));
        let Some(Kind::JsonSchema(text)) = got else { panic!("{got:?}") };
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), schema);
        assert_eq!(kind(json!({"guided_json": schema})), Some(Kind::JsonSchema(schema.to_string())));
        assert_eq!(
            kind(json!({"guided_json": schema.to_string()})),
            Some(Kind::JsonSchema(schema.to_string()))
        );
        assert_eq!(kind(json!({"guided_regex": "[a-z]+"})), Some(Kind::Regex("[a-z]+".into())));
        assert_eq!(
            kind(json!({"guided_choice": ["yes", "no"]})),
            Some(Kind::Choice(v1::Choices { options: vec!["yes".into(), "no".into()] }))
        );
        assert_eq!(
            kind(json!({"guided_grammar": "start: \"x\""})),
            Some(Kind::Grammar("start: \"x\"".into()))
        );
        assert_eq!(kind(json!({"structured_outputs": {"regex": "a+"}})), Some(Kind::Regex("a+".into())));
        assert_eq!(kind(json!({"structured_outputs": {"json_object": true}})), Some(Kind::JsonObject(true)));
        // Completions take them too (as vLLM's do).
        let p = parse_json(
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}}),
        )
        .unwrap();
        assert!(p.request.constraint.is_some());

        let refused = |extra: Value| parse_json(Endpoint::Chat, chat(extra)).unwrap_err();
        let e = refused(json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}));
        assert_eq!(e.param.as_deref(), Some("guided_regex"), "{}", e.message);
        assert!(e.message.contains("only one"), "{}", e.message);
        let e = refused(json!({"response_format": {"type": "yaml"}}));
        assert_eq!(e.param.as_deref(), Some("response_format"));
        assert!(e.message.contains("yaml"), "{}", e.message);
        let e = refused(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}));
        assert!(e.message.contains("json_schema.schema"), "{}", e.message);
        let e = refused(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": {}, "colour": 1}}}));
        assert_eq!(e.param.as_deref(), Some("response_format.json_schema.colour"), "{}", e.message);
        let e = refused(json!({"guided_choice": []}));
        assert_eq!(e.param.as_deref(), Some("guided_choice"));
        let e = refused(json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}));
        assert_eq!(e.param.as_deref(), Some("structured_outputs"));

        // With the model's tokenizer, a schema the engine cannot compile is refused while reading.
        let tok = fixture_tokenizer();
        let served = Served { tokenizer: Some(&tok), ..SERVED };
        let body = chat(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}}));
        let e = parse(Endpoint::Chat, body.to_string().as_bytes(), &served).unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("response_format")));
        assert!(e.message.contains("minimum"), "{}", e.message);
        let e = parse(Endpoint::Chat, chat(json!({"guided_regex": "(a"})).to_string().as_bytes(), &served)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_regex"), "{}", e.message);
        assert!(parse(Endpoint::Chat, chat(json!({"guided_regex": "a|b"})).to_string().as_bytes(), &served)
            .is_ok());
    }

    /// The fixture's tokenizer with a Hermes-style tool template.
    fn hermes_tokenizer() -> Tokenizer {
        crate::api::test_support::tokenizer(Some("tools-hermes.jinja"))
    }

    fn weather_tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
               {"type": "function", "function": {"name": "get_time"}}])
    }

    #[test]
    fn tools_and_tool_choice_read_into_a_template_variable_and_a_forcing_grammar() {
        use tandem_proto::v1::output_constraint::Kind;
        let tok = hermes_tokenizer();
        let served = Served { tokenizer: Some(&tok), ..SERVED };
        let chat = |extra: Value| {
            let mut b = json!({"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}]});
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            parse(Endpoint::Chat, b.to_string().as_bytes(), &served)
        };
        let p = chat(json!({"tools": weather_tools()})).unwrap();
        assert_eq!(
            p.output.tools.as_ref().map(|t| (t.format, t.names.len())),
            Some((ToolFormat::Hermes, 2)),
            "auto by default"
        );
        assert!(p.request.constraint.is_none(), "auto forces nothing");
        let Some(Prompt::Chat(c)) = &p.request.prompt else { panic!() };
        // The template sees the tools as OpenAI's array, an absent parameters schema as any object.
        let mut expected = weather_tools();
        expected[1]["function"]["parameters"] = json!({"type": "object"});
        assert_eq!(serde_json::from_str::<Value>(&c.tools_json).unwrap(), expected);
        for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_time"}})] {
            let p = chat(json!({"tools": weather_tools(), "tool_choice": choice})).unwrap();
            let Some(Kind::Grammar(g)) = p.request.constraint.and_then(|c| c.kind) else {
                panic!("{choice}")
            };
            assert!(g.contains("<tool_call>") && g.contains("get_time"), "{g}");
        }
        let p = chat(json!({"tools": weather_tools(), "tool_choice": "none"})).unwrap();
        assert_eq!(p.output.tools, None, "none reads no calls back");

        // History: an assistant turn that called a tool, and the tool's answer.
        let p = parse(
            Endpoint::Chat,
            json!({"model": "tiny", "tools": weather_tools(), "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
            .to_string()
            .as_bytes(),
            &served,
        )
        .unwrap();
        let Some(Prompt::Chat(c)) = &p.request.prompt else { panic!() };
        assert_eq!(c.messages[1].tool_calls[0].name, "get_weather");
        // An answer sent back as it came (content null, refusal null) is a valid history entry.
        let echoed = json!({"model": "tiny", "tools": weather_tools(), "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "refusal": null, "tool_calls": []},
            {"role": "user", "content": "Again?"}]});
        assert!(parse(Endpoint::Chat, echoed.to_string().as_bytes(), &served).is_ok());
        assert_eq!(c.messages[2].tool_call_id.as_deref(), Some("call_1"));

        let refused = |extra: Value| chat(extra).unwrap_err();
        let e = refused(
            json!({"tools": weather_tools(), "tool_choice": {"type": "function", "function": {"name": "fly"}}}),
        );
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        assert!(e.message.contains("unknown tool name `fly`"), "{}", e.message);
        let e = refused(json!({"tool_choice": "required"}));
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = refused(json!({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}));
        assert_eq!(e.param.as_deref(), Some("tools[0]"), "{}", e.message);
        let e = refused(json!({"tools": [{"type": "function", "function": {"name": "f", "parameters":
            {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "tool_choice": "required"}));
        assert_eq!(e.param.as_deref(), Some("tools"), "{}", e.message);
        let e = refused(
            json!({"tools": weather_tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}),
        );
        assert_eq!(e.param.as_deref(), Some("response_format"), "{}", e.message);
        let e = parse(
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": "x", "tools": weather_tools()}).to_string().as_bytes(),
            &served,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools"));
        // A template that renders no tools gets the generic format: `auto` is constrained to a
        // reply or calls, `none` neither describes the tools nor reads calls.
        let plain = fixture_tokenizer();
        let served = Served { tokenizer: Some(&plain), ..SERVED };
        let generic = |extra: Value| {
            let mut b = json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": weather_tools()});
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            parse(Endpoint::Chat, b.to_string().as_bytes(), &served)
        };
        let p = generic(json!({})).unwrap();
        assert_eq!(p.output.tools.as_ref().map(|t| t.format), Some(ToolFormat::Generic));
        let Some(Kind::JsonSchema(schema)) = p.request.constraint.and_then(|c| c.kind) else { panic!() };
        assert!(schema.contains("\"response\"") && schema.contains("\"tool_calls\""), "{schema}");
        let p = generic(json!({"tool_choice": "none"})).unwrap();
        let Some(Prompt::Chat(c)) = &p.request.prompt else { panic!() };
        assert!(c.tools_json.is_empty() && p.request.constraint.is_none() && p.output.tools.is_none());
        let e = generic(json!({"response_format": {"type": "json_object"}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format"));
        assert!(e.message.contains("generic format"), "{}", e.message);
        assert!(generic(json!({"response_format": {"type": "json_object"}, "tool_choice": "none"})).is_ok());
    }

    /// The generic format's answers: a reply streams as content while it is written, calls come
    /// as `tool_calls`.
    #[test]
    fn generic_replies_stream_and_generic_calls_are_read() {
        let tok = fixture_tokenizer();
        let served = Served { tokenizer: Some(&tok), ..SERVED };
        let body = |stream: bool| {
            json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": weather_tools(),
                   "stream": stream})
            .to_string()
        };
        let pieces = ["{\"response\": \"It is", " sunny \\\"", "today\\\".\"}"];
        let resp = |i: usize| GenerateResponse {
            request_id: "7".into(),
            text: pieces[i].into(),
            token_ids: vec![300],
            finish_reason: (i == pieces.len() - 1).then(|| "stop".into()),
            ..Default::default()
        };
        let p = parse(Endpoint::Chat, body(true).as_bytes(), &served).unwrap();
        let mut sh = Shaper::new(Endpoint::Chat, "tiny", tok.clone(), &p);
        let mut content = String::new();
        for i in 0..pieces.len() {
            for c in sh.chunks(&resp(i)) {
                if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
                    content.push_str(t);
                }
            }
        }
        assert_eq!(content, "It is sunny \"today\".");
        let p = parse(Endpoint::Chat, body(false).as_bytes(), &served).unwrap();
        let mut sh = Shaper::new(Endpoint::Chat, "tiny", tok.clone(), &p);
        let call = "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]}";
        sh.absorb(&GenerateResponse {
            text: call.into(),
            finish_reason: Some("stop".into()),
            ..Default::default()
        });
        let v = sh.response();
        let m = &v["choices"][0]["message"];
        assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather", "{v}");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], "{\"city\":\"Oslo\"}", "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    }

    /// An answer that is a tool call comes back as `tool_calls` with finish reason `tool_calls`,
    /// answered at once and streamed; text before the call is content; plain text stays text.
    #[test]
    fn tool_calls_are_read_out_of_the_answer_at_once_and_streamed() {
        let tok = hermes_tokenizer();
        let served = Served { tokenizer: Some(&tok), ..SERVED };
        let body = |stream: bool| {
            json!({"model": "tiny", "stream": stream, "messages": [{"role": "user", "content": "Weather?"}],
                   "tools": weather_tools()})
        };
        let answer = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let mut ids = tok.encode(answer, false).unwrap();
        ids.push(tok.eos_token_ids()[0]);
        let responses = |ids: &[u32]| -> Vec<GenerateResponse> {
            let n = ids.len();
            ids.chunks(3)
                .enumerate()
                .map(|(i, c)| GenerateResponse {
                    token_ids: c.to_vec(),
                    text: tok.decode(c, true).unwrap(),
                    finish_reason: ((i + 1) * 3 >= n).then(|| "stop".to_owned()),
                    usage: Some(v1::Usage {
                        prompt_tokens: 5,
                        completion_tokens: n as u32,
                        cached_tokens: 0,
                    }),
                    ..Default::default()
                })
                .collect()
        };
        let p = parse(Endpoint::Chat, body(false).to_string().as_bytes(), &served).unwrap();
        let mut sh = Shaper::new(Endpoint::Chat, "tiny", tok.clone(), &p);
        for r in responses(&ids) {
            sh.absorb(&r);
        }
        let v = sh.response();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
        assert_eq!(choice["message"]["content"], "Checking.", "{v}");
        let call = &choice["message"]["tool_calls"][0];
        assert_eq!(call["function"]["name"], "get_weather");
        assert_eq!(
            serde_json::from_str::<Value>(call["function"]["arguments"].as_str().unwrap()).unwrap(),
            json!({"city": "Oslo"})
        );
        assert!(call["id"].as_str().unwrap().starts_with("call_"));

        let p = parse(Endpoint::Chat, body(true).to_string().as_bytes(), &served).unwrap();
        let mut sh = Shaper::new(Endpoint::Chat, "tiny", tok.clone(), &p);
        let chunks: Vec<Value> = responses(&ids).iter().flat_map(|r| sh.chunks(r)).collect();
        let content: String =
            chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(content, "Checking.", "nothing of the call leaks into the content: {chunks:?}");
        let calls: Vec<&Value> =
            chunks.iter().filter_map(|c| c["choices"][0]["delta"].get("tool_calls")).collect();
        assert_eq!(calls.len(), 1, "{chunks:?}");
        assert_eq!(calls[0][0]["index"], 0);
        assert_eq!(calls[0][0]["function"]["name"], "get_weather");
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");

        // Plain text: all of it streams as content, the finish reason stays.
        let mut plain = tok.encode("It is a < b, fine.", false).unwrap();
        plain.push(tok.eos_token_ids()[0]);
        let mut sh = Shaper::new(Endpoint::Chat, "tiny", tok.clone(), &p);
        let chunks: Vec<Value> = responses(&plain).iter().flat_map(|r| sh.chunks(r)).collect();
        let content: String =
            chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(content, "It is a < b, fine.");
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
    }
}
