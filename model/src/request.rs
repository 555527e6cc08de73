//! A request's sampling and stopping parameters ([`SamplingParams`]), and [`Request`]: the one
//! validated request type, holding the prompt, how to sample, when to stop and the cache salt.
//!
//! Validation is written once, in [`Request::new`], and needs only the model's vocabulary size,
//! so it runs where a request arrives, before any worker is asked: the router's service for a
//! cluster, the in-process callers (`tandem generate`, the engine's `add_request`) for
//! themselves. Past that point the request travels as a [`Request`] and nothing checks it again.
//! A worker decodes the wire form with the same [`Request::new`]: a process never trusts bytes
//! from a peer, so that is where a garbage peer gets an error naming the field.

use crate::error::{ModelError, Result};
use crate::grammar::Constraint;
use crate::prefix::MAX_SALT_BYTES;

/// Most stop strings a request may carry.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// Most stop token ids a request may carry.
pub const MAX_STOP_TOKEN_IDS: usize = 256;
/// Most alternatives a request may ask for with `logprobs`.
pub const MAX_LOGPROBS: usize = 20;
/// Most choices (`n`) one request may ask for: each is a sequence of its own on the decode
/// worker, sharing the prompt's KV blocks.
pub const MAX_CHOICES: u32 = 16;

/// The number of choices a request's `n` asks for (0 means 1), or the error naming `n`.
pub fn choices(n: u32) -> std::result::Result<u32, String> {
    match n {
        0 => Ok(1),
        n if n > MAX_CHOICES => Err(format!("n: at most {MAX_CHOICES} choices, got {n}")),
        n => Ok(n),
    }
}

/// Per-request sampling parameters.
///
/// Defaults match common servers: temperature 1.0, top-k off (0), top-p off (1.0), min-p off (0.0),
/// repetition penalty off (1.0), no seed, 256 new tokens, no stop tokens or strings, EOS honoured,
/// no logprobs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy. Default 1.0.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 (default) disables it.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose cumulative probability reaches `top_p`; 1.0 (default) disables it.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely one's; 0.0 (default) disables it.
    pub min_p: f32,
    /// Hugging Face-style repetition penalty over prompt and generated tokens; 1.0 (default) disables it.
    pub repetition_penalty: f32,
    /// RNG seed; `None` (default) uses the fallback seed the caller gives [`Sampler::new`].
    pub seed: Option<u64>,
    /// Most tokens to generate. Default 256.
    pub max_tokens: usize,
    /// Tokens that end generation (their text is not emitted). Default none.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation (they are not emitted). Default none.
    pub stop_strings: Vec<String>,
    /// Keep generating past the model's EOS tokens. Default false.
    pub ignore_eos: bool,
    /// Return this many most likely alternatives with each token (at most [`MAX_LOGPROBS`]). Default none.
    pub logprobs: Option<usize>,
    /// Report the log-probability of every prompt token after the first under the model's own
    /// distribution at the position before it, with this many most likely alternatives (at most
    /// [`MAX_LOGPROBS`]). The whole prompt is then computed (no prefix-cache hit). Default none.
    pub prompt_logprobs: Option<usize>,
    /// What the output must be (structured output): every token is drawn from those the
    /// constraint allows next ([`crate::grammar`]). Default none.
    pub constraint: Option<Constraint>,
    /// With a constraint, how many of the prompt's last tokens were generated under it (a
    /// continuation of a request whose worker was lost): the constraint moves past them before
    /// the first new token. Default 0.
    pub constraint_generated: usize,
    /// Not a sampling parameter but travels with them: the request's prefix-cache salt. Requests
    /// share cached KV blocks only when their salts are equal (empty: the shared namespace).
    pub cache_salt: String,
    /// Not a sampling parameter but travels with them: the LoRA adapter the request runs under,
    /// by the name its worker holds it (empty: the base model). Default empty.
    pub adapter: String,
    /// The adapter's id ([`tandem_engine`'s `lora::adapter_id`]) the request expects: a worker
    /// whose adapter of that name has another id refuses it. Empty: whatever the worker holds.
    pub adapter_id: String,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            max_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
            constraint_generated: 0,
            cache_salt: String::new(),
            adapter: String::new(),
            adapter_id: String::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0), all other parameters at their defaults.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    /// Checks the parameters against a model with `vocab_size` tokens. The error names the field.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        let bad = |field: &str, msg: String| Err(ModelError::InvalidRequest(format!("{field}: {msg}")));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", format!("must be finite and >= 0, got {}", self.temperature));
        }
        // `!(x > 0)` also rejects NaN.
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("must be in (0, 1], got {}", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return bad("min_p", format!("must be in [0, 1], got {}", self.min_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(
                "repetition_penalty",
                format!("must be finite and > 0, got {}", self.repetition_penalty),
            );
        }
        if self.max_tokens == 0 {
            return bad("max_tokens", "must be at least 1".into());
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return bad(
                "stop_token_ids",
                format!("at most {MAX_STOP_TOKEN_IDS} allowed, got {}", self.stop_token_ids.len()),
            );
        }
        if let Some(&id) = self.stop_token_ids.iter().find(|&&id| id as usize >= vocab_size) {
            return bad("stop_token_ids", format!("token id {id} is outside the vocabulary of {vocab_size}"));
        }
        if self.stop_strings.len() > MAX_STOP_STRINGS {
            return bad(
                "stop_strings",
                format!("at most {MAX_STOP_STRINGS} allowed, got {}", self.stop_strings.len()),
            );
        }
        for s in &self.stop_strings {
            if s.is_empty() {
                return bad("stop_strings", "must not contain an empty string".into());
            }
            if s.len() > MAX_STOP_STRING_BYTES {
                return bad(
                    "stop_strings",
                    format!("each must be at most {MAX_STOP_STRING_BYTES} bytes, got {}", s.len()),
                );
            }
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return bad("logprobs", format!("at most {MAX_LOGPROBS} allowed, got {n}"));
            }
        }
        if let Some(n) = self.prompt_logprobs {
            if n > MAX_LOGPROBS {
                return bad("prompt_logprobs", format!("at most {MAX_LOGPROBS} allowed, got {n}"));
            }
        }
        if let Some(c) = &self.constraint {
            if let Err(msg) = c.check_shape() {
                return bad("constraint", format!("{} {msg}", c.kind()));
            }
        }
        if self.cache_salt.contains('\0') {
            // The byte that separates a salt from an adapter's id in the prefix cache's root.
            return bad("cache_salt", "must not contain a NUL character".to_string());
        }
        if self.cache_salt.len() > MAX_SALT_BYTES {
            return bad(
                "cache_salt",
                format!("at most {MAX_SALT_BYTES} bytes, got {}", self.cache_salt.len()),
            );
        }
        Ok(())
    }
}

/// A request checked once, at the edge: a non-empty prompt of token ids inside the vocabulary,
/// and parameters that passed [`SamplingParams::validate`] for the same vocabulary. Only
/// [`Request::new`] makes one, so holding a `Request` means it was checked.
///
/// What depends on where the request runs (the prompt against a worker's context length and KV
/// pool) is checked there; nothing else is checked twice.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    prompt: Vec<u32>,
    params: SamplingParams,
    vocab_size: usize,
}

impl Request {
    /// Checks `prompt` and `params` against a model with `vocab_size` tokens. The error names
    /// the field (`prompt`, `temperature`, `max_tokens`, ...).
    pub fn new(prompt: Vec<u32>, params: SamplingParams, vocab_size: usize) -> Result<Request> {
        params.validate(vocab_size)?;
        if prompt.is_empty() {
            return Err(ModelError::InvalidRequest("prompt: is empty (no tokens)".into()));
        }
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(ModelError::InvalidRequest(format!(
                "prompt: token id {t} is outside the vocabulary ({vocab_size})"
            )));
        }
        let g = params.constraint_generated;
        if g > 0 && (params.constraint.is_none() || g >= prompt.len()) {
            return Err(ModelError::InvalidRequest(format!(
                "constraint_generated: {g} tokens, but the request has {} and a prompt of {} tokens",
                if params.constraint.is_some() { "a constraint" } else { "no constraint" },
                prompt.len()
            )));
        }
        Ok(Request { prompt, params, vocab_size })
    }

    /// The prompt's token ids.
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// How to sample and when to stop (the stopping fields: `max_tokens`, `stop_token_ids`,
    /// `stop_strings`, `ignore_eos`).
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The prefix-cache salt (empty: the shared namespace).
    pub fn salt(&self) -> &str {
        &self.params.cache_salt
    }

    /// The vocabulary size the request was checked against.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The prompt and the parameters, to hand to code that owns them.
    pub fn into_parts(self) -> (Vec<u32>, SamplingParams) {
        (self.prompt, self.params)
    }

    /// The same request drawing from another random stream.
    pub fn with_seed(mut self, seed: u64) -> Request {
        self.params.seed = Some(seed);
        self
    }

    /// The request that continues this one after `streamed` tokens were generated: they join
    /// the prompt, `max_tokens` counts what is left (at least 1), and a constraint continues
    /// after them (`constraint_generated`). Still valid: the streamed
    /// ids must be inside the vocabulary, as every generated id is.
    pub fn continued(&self, streamed: &[u32]) -> Result<Request> {
        let mut prompt = self.prompt.clone();
        prompt.extend_from_slice(streamed);
        let mut params = self.params.clone();
        params.max_tokens = params.max_tokens.saturating_sub(streamed.len()).max(1);
        // The prompt was scored before anything was streamed; a continuation scores nothing
        // (one with nothing streamed is the same request again, and still scores it).
        if !streamed.is_empty() {
            params.prompt_logprobs = None;
        }
        if params.constraint.is_some() {
            // The streamed tokens were written under the constraint: the continuation starts
            // where they left it.
            params.constraint_generated += streamed.len();
        }
        Request::new(prompt, params, self.vocab_size)
    }
}
