//! From a client's `GenerateRequest` to what the workers run, a `tandem_model::request::Request`:
//! validation (messages name the field as the proto spells it), tokenization exactly as `tandem
//! generate` does it, and every default resolved.
//!
//! Tokenization mirrors the in-process CLI so that the same prompt gives the same token ids:
//! plain text is encoded with special tokens (BOS where the model wants one); a chat is rendered
//! with the model's template and encoded without (the template writes any BOS itself).

use tandem_proto::v1::{self, generate_request::Prompt};

use crate::error::RouterError;
use tandem_model::request::{Request, SamplingParams};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::tools::{TemplateToolCall, ToolFormat};
use tandem_model::ModelError;

/// `max_tokens` when the request leaves it unset.
pub const DEFAULT_MAX_TOKENS: u32 = 128;
/// Longest client-supplied request id, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 128;
/// Longest prefix-cache salt, in bytes (checked with the rest of the request).
pub use tandem_model::prefix::MAX_SALT_BYTES as MAX_CACHE_SALT_BYTES;

fn invalid(msg: impl Into<String>) -> RouterError {
    RouterError::InvalidArgument(msg.into())
}

/// Validates and tokenizes `req` into the one validated request type, every default resolved.
/// `vocab_size` is the model's (embedding rows); `seed` is used when the request has none. This
/// is the only place a client's parameters are checked: workers are sent the result.
pub fn prepare(
    tok: &Tokenizer,
    vocab_size: usize,
    req: &v1::GenerateRequest,
    seed: u64,
) -> Result<Request, RouterError> {
    prepare_under(tok, vocab_size, req, seed, None)
}

/// [`prepare`] for a request the router resolved to run under the LoRA adapter `adapter` (its
/// name and id; None: the base model), which the workers are sent with it.
pub fn prepare_under(
    tok: &Tokenizer,
    vocab_size: usize,
    req: &v1::GenerateRequest,
    seed: u64,
    adapter: Option<&crate::registry::AdapterKey>,
) -> Result<Request, RouterError> {
    if req.request_id.len() > MAX_REQUEST_ID_BYTES {
        return Err(invalid(format!(
            "request_id: at most {MAX_REQUEST_ID_BYTES} bytes, got {}",
            req.request_id.len()
        )));
    }
    let s = req.sampling.unwrap_or_default();
    let params = SamplingParams {
        temperature: s.temperature.unwrap_or(0.0),
        top_k: s.top_k.unwrap_or(0) as usize,
        top_p: s.top_p.unwrap_or(1.0),
        min_p: s.min_p.unwrap_or(0.0),
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        seed: Some(s.seed.unwrap_or(seed)),
        // Scoring only (max_tokens 0 with prompt_logprobs): one token is generated and dropped.
        max_tokens: match req.max_tokens {
            Some(0) if req.prompt_logprobs.is_some() => 1,
            m => m.unwrap_or(DEFAULT_MAX_TOKENS) as usize,
        },
        stop_token_ids: req.stop_token_ids.clone(),
        stop_strings: req.stop.clone(),
        ignore_eos: req.ignore_eos,
        logprobs: (req.top_logprobs > 0).then_some(req.top_logprobs as usize),
        prompt_logprobs: req.prompt_logprobs.map(|n| n as usize),
        constraint: tandem_serve::constraint::from_wire(req.constraint.as_ref()).map_err(invalid)?,
        constraint_generated: 0,
        cache_salt: req.cache_salt.clone(),
        adapter: adapter.map(|a| a.name.clone()).unwrap_or_default(),
        adapter_id: adapter.map(|a| a.id.clone()).unwrap_or_default(),
    };
    // Parameters first, so that a bad one is named even when the prompt is bad too.
    params.validate(vocab_size).map_err(|e| invalid(field_names(e, req.prompt.as_ref())))?;
    if let Some(c) = &params.constraint {
        check_constraint(tok, c)?;
    }
    let prompt = tokenize(tok, req.prompt.as_ref())?;
    Request::new(prompt, params, vocab_size).map_err(|e| invalid(field_names(e, req.prompt.as_ref())))
}

/// Compiles `c` against the model's vocabulary, so that a schema, regex or grammar the constraint
/// engine cannot use is refused here, naming the problem, before any worker is asked.
pub fn check_constraint(tok: &Tokenizer, c: &tandem_model::grammar::Constraint) -> Result<(), RouterError> {
    let env = tok.grammar().map_err(|e| invalid(format!("constraint: {e}")))?;
    env.compile(c).map(drop).map_err(|e| invalid(format!("constraint: invalid {}: {e}", c.kind())))
}

/// Names the request's fields as the proto spells them (`sampling.temperature`, `stop`,
/// `prompt.token_ids`).
fn field_names(e: ModelError, prompt: Option<&Prompt>) -> String {
    let msg = match e {
        ModelError::InvalidRequest(m) => m,
        other => other.to_string(),
    };
    for f in ["temperature", "top_p", "top_k", "min_p", "repetition_penalty"] {
        if let Some(rest) = msg.strip_prefix(&format!("{f}:")) {
            return format!("sampling.{f}:{rest}");
        }
    }
    if let Some(rest) = msg.strip_prefix("stop_strings:") {
        return format!("stop:{rest}");
    }
    if let (Some(rest), Some(Prompt::TokenIds(_))) = (msg.strip_prefix("prompt: token id"), prompt) {
        return format!("prompt.token_ids: token id{rest}");
    }
    msg
}

/// The prompt's token ids (the ids and the emptiness are checked with the rest of the request).
fn tokenize(tok: &Tokenizer, prompt: Option<&Prompt>) -> Result<Vec<u32>, RouterError> {
    match prompt {
        None => Err(invalid("prompt: one of text, chat or token_ids is required")),
        // Text with BOS where the model wants one; a chat without (its template writes BOS).
        Some(p) => tokenize_with(tok, p, matches!(p, Prompt::Text(_))).map_err(invalid),
    }
}

/// The token ids of `prompt`, encoded with or without the tokenizer's special tokens (BOS).
/// Errors name the field as the gRPC API spells it (`prompt.text: ...`).
pub fn tokenize_with(tok: &Tokenizer, prompt: &Prompt, add_special_tokens: bool) -> Result<Vec<u32>, String> {
    let tok_err = |field: &str, e: ModelError| format!("{field}: {e}");
    let ids = match prompt {
        Prompt::Text(text) => tok.encode(text, add_special_tokens).map_err(|e| tok_err("prompt.text", e))?,
        Prompt::Chat(chat) => {
            if chat.messages.is_empty() {
                return Err("prompt.chat.messages: is empty".into());
            }
            if !tok.has_chat_template() {
                return Err("prompt.chat: the model has no chat template (send text or token_ids)".into());
            }
            let messages: Vec<ChatMessage> = chat
                .messages
                .iter()
                .map(|m| ChatMessage {
                    tool_calls: (!m.tool_calls.is_empty()).then(|| {
                        m.tool_calls
                            .iter()
                            .map(|c| {
                                let id = (!c.id.is_empty()).then(|| c.id.clone());
                                TemplateToolCall::from_wire(id, c.name.clone(), &c.arguments)
                            })
                            .collect()
                    }),
                    tool_call_id: m.tool_call_id.clone(),
                    ..ChatMessage::new(m.role.clone(), m.content.clone()).with_name(m.name.clone())
                })
                .collect();
            let tools = if chat.tools_json.is_empty() {
                None
            } else {
                let v: serde_json::Value = serde_json::from_str(&chat.tools_json)
                    .map_err(|e| format!("prompt.chat.tools_json: not JSON: {e}"))?;
                Some(v)
            };
            // A template without a known tool format: the tools are described in the system
            // message, and earlier calls and results written as the generic format has them.
            let generic = ToolFormat::of(tok) == Some(ToolFormat::Generic);
            let (messages, tools) = if generic {
                (tandem_model::tools::generic_messages(&messages, tools.as_ref()), None)
            } else {
                (messages, tools)
            };
            let render = |messages: &[ChatMessage]| {
                tok.apply_chat_template_full(
                    messages,
                    tools.as_ref(),
                    chat.add_generation_prompt.unwrap_or(true),
                    chat.enable_thinking,
                )
            };
            let text = match render(&messages) {
                // A template that refuses a system message (Gemma 2's) gets the generic format's
                // description in front of the first user message instead.
                Err(e) if generic => match tandem_model::tools::fold_system(&messages) {
                    Some(folded) => render(&folded).map_err(|_| tok_err("prompt.chat", e))?,
                    None => return Err(tok_err("prompt.chat", e)),
                },
                r => r.map_err(|e| tok_err("prompt.chat", e))?,
            };
            tok.encode(&text, add_special_tokens).map_err(|e| tok_err("prompt.chat", e))?
        }
        Prompt::TokenIds(t) => t.ids.clone(),
    };
    Ok(ids)
}

/// The `max_tokens` that must fit after the prompt (refused when it does not) rather than be cut
/// short where the context ends: set when the request says so (`max_tokens_must_fit`, the
/// OpenAI API's rule); gRPC requests are cut short by default.
pub fn strict_max_tokens(req: &v1::GenerateRequest) -> Option<u32> {
    req.max_tokens.filter(|_| req.max_tokens_must_fit)
}

/// Refuses a prompt plus a strict `max_tokens` (see [`strict_max_tokens`]) longer than the
/// chosen workers' sequences, naming both numbers.
pub fn check_budget(prompt_len: usize, max_tokens: u32, max_sequence_len: u32) -> Result<(), RouterError> {
    let (want, max) = (prompt_len as u64 + max_tokens as u64, max_sequence_len as u64);
    if want > max {
        return Err(invalid(format!(
            "max_tokens: the prompt's {prompt_len} tokens plus max_tokens {max_tokens} make {want} tokens, \
             more than the context length of {max} tokens (of the model and the chosen workers' KV \
             pool); ask for at most {} tokens or shorten the prompt",
            max.saturating_sub(prompt_len as u64)
        )));
    }
    Ok(())
}

/// Refuses a prompt that leaves no room for a generated token on the chosen workers.
pub fn check_length(prompt_len: usize, max_sequence_len: u32) -> Result<(), RouterError> {
    let max = max_sequence_len as usize;
    if prompt_len >= max {
        return Err(invalid(format!(
            "prompt has {prompt_len} tokens; the limit is {} (context length and KV pool of the \
             chosen workers), leaving room for at least one generated token",
            max.saturating_sub(1)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_messages_get_proto_field_names() {
        let e = |m: &str| ModelError::InvalidRequest(m.into());
        let m = field_names(e("temperature: must be finite and >= 0, got -1"), None);
        assert_eq!(m, "sampling.temperature: must be finite and >= 0, got -1");
        let m = field_names(e("stop_strings: must not contain an empty string"), None);
        assert_eq!(m, "stop: must not contain an empty string");
        let m = field_names(e("max_tokens: must be at least 1"), None);
        assert_eq!(m, "max_tokens: must be at least 1");
        let ids = Prompt::TokenIds(v1::TokenIds { ids: vec![9] });
        let m = field_names(e("prompt: token id 9 is outside the vocabulary (5)"), Some(&ids));
        assert_eq!(m, "prompt.token_ids: token id 9 is outside the vocabulary (5)");
    }

    #[test]
    fn length_limit_names_the_numbers() {
        assert!(check_length(10, 11).is_ok());
        let e = check_length(11, 11).unwrap_err();
        assert!(e.to_string().contains("prompt has 11 tokens; the limit is 10"), "{e}");
    }

    #[test]
    fn a_strict_max_tokens_must_fit_after_the_prompt() {
        assert!(check_budget(10, 6, 16).is_ok());
        let e = check_budget(10, 7, 16).unwrap_err().to_string();
        assert!(e.starts_with("max_tokens: the prompt's 10 tokens plus max_tokens 7 make 17 tokens"), "{e}");
        assert!(e.contains("context length of 16 tokens") && e.contains("at most 6 tokens"), "{e}");
        let mut req = v1::GenerateRequest { max_tokens: Some(5), ..Default::default() };
        assert_eq!(strict_max_tokens(&req), None, "gRPC's max_tokens is cut short by default");
        req.max_tokens_must_fit = true;
        assert_eq!(strict_max_tokens(&req), Some(5));
        let unset = v1::GenerateRequest { max_tokens_must_fit: true, ..Default::default() };
        assert_eq!(strict_max_tokens(&unset), None, "nothing to fit without a max_tokens");
    }

    /// The generic tool format on a template that refuses a system message: the description
    /// goes in front of the first user message instead.
    #[test]
    fn generic_tools_reach_a_template_without_a_system_role() {
        let tok = crate::api::test_support::tokenizer(Some("no-system.jinja"));
        let tools = serde_json::json!([{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]);
        let chat = |messages: Vec<v1::ChatMessage>| {
            Prompt::Chat(v1::ChatPrompt { messages, tools_json: tools.to_string(), ..Default::default() })
        };
        let user =
            v1::ChatMessage { role: "user".into(), content: "Add 1 and 2".into(), ..Default::default() };
        let system =
            v1::ChatMessage { role: "system".into(), content: "Be brief.".into(), ..Default::default() };
        for messages in [vec![user.clone()], vec![system, user]] {
            let ids = tokenize_with(&tok, &chat(messages), false).unwrap();
            let text = tok.decode(&ids, false).unwrap();
            assert!(text.contains("You can call tools") && text.contains("\"add\""), "{text}");
            assert!(!text.contains("<start_of_turn>system"), "{text}");
        }
    }
}
