//! Structured output: a request's [`Constraint`] (JSON Schema, any JSON object, a regex, a choice
//! of strings, a Lark grammar) compiled by the `llguidance` constraint engine into a per-sequence
//! [`Grammar`] that gives, before each token, the set of tokens that keep the output inside the
//! language ([`TokenMask`]).
//!
//! Invariants:
//! - **One vocabulary view.** [`GrammarEnv`] is built once per tokenizer from
//!   `Tokenizer::token_bytes`: every token is the bytes it stands for, special tokens are marked
//!   special (the grammar never produces them as text), and every EOS id of the tokenizer ends the
//!   grammar. The router (to refuse a bad schema with a 400) and the workers (to mask) build the
//!   same view from the same file, so they agree on what a schema allows.
//! - **Deterministic state.** A [`Grammar`]'s state is a function of the constraint and the tokens
//!   it has consumed. A decode worker that continues a sequence another process started compiles
//!   the same constraint and consumes the same tokens, and is in the same state.
//! - **Compact JSON.** Unless a schema says otherwise in its own `x-guidance` options, JSON is
//!   written with `", "` and `": "` separators and no other whitespace: a model cannot fill its
//!   budget with blank lines inside an object.
//! - **EOS only when complete.** EOS is allowed exactly when the output so far is a complete
//!   sentence of the language; once the grammar can go no further, only EOS is allowed.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};

use crate::error::{ModelError, Result};

/// Longest constraint text (a schema, a regex, a grammar, or all choices together), in bytes.
pub const MAX_CONSTRAINT_BYTES: usize = 256 * 1024;
/// Most strings a [`Constraint::Choice`] may list.
pub const MAX_CHOICES: usize = 1024;

/// What a request's output must be. Travels with the request's sampling parameters.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid against this JSON Schema (its text).
    JsonSchema(String),
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A sentence of this context-free grammar, in llguidance's Lark dialect (which also reads
    /// GBNF-style rules).
    Grammar(String),
}

impl Constraint {
    /// Short name of the kind, for errors and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonObject => "json_object",
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Choice(_) => "choice",
            Constraint::Grammar(_) => "grammar",
        }
    }

    /// Checks what can be checked without a tokenizer: sizes, and that a schema is JSON. The
    /// error names the problem; the caller prefixes the request field.
    pub fn check_shape(&self) -> std::result::Result<(), String> {
        self.check_sizes()?;
        if let Constraint::JsonSchema(s) = self {
            schema_value(s)?;
        }
        Ok(())
    }

    /// The size limits: constraint text and number of choices.
    fn check_sizes(&self) -> std::result::Result<(), String> {
        let bytes = match self {
            Constraint::JsonObject => 0,
            Constraint::JsonSchema(s) | Constraint::Regex(s) | Constraint::Grammar(s) => s.len(),
            Constraint::Choice(c) => {
                if c.is_empty() {
                    return Err("a choice needs at least one string".into());
                }
                if c.len() > MAX_CHOICES {
                    return Err(format!("at most {MAX_CHOICES} choices allowed, got {}", c.len()));
                }
                c.iter().map(String::len).sum()
            }
        };
        if bytes > MAX_CONSTRAINT_BYTES {
            return Err(format!("at most {MAX_CONSTRAINT_BYTES} bytes allowed, got {bytes}"));
        }
        Ok(())
    }

    /// The llguidance grammar for this constraint.
    fn to_grammar(&self) -> std::result::Result<TopLevelGrammar, String> {
        Ok(match self {
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(json_schema_with_options(
                serde_json::json!({"type": "object"}),
            )),
            Constraint::JsonSchema(s) => {
                TopLevelGrammar::from_json_schema(json_schema_with_options(schema_value(s)?))
            }
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Choice(c) => {
                let alternatives: Vec<String> = c.iter().map(|s| regex_syntax::escape(s)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
            Constraint::Grammar(g) => TopLevelGrammar::from_lark(g.clone()),
        })
    }
}

/// A JSON Schema's text as the object llguidance compiles (`true`, the schema that allows
/// everything, as `{}`); the error says why it is not one.
fn schema_value(text: &str) -> std::result::Result<serde_json::Value, String> {
    match serde_json::from_str(text).map_err(|e| format!("the schema is not JSON: {e}"))? {
        serde_json::Value::Bool(true) => Ok(serde_json::json!({})),
        v if v.is_object() => Ok(v),
        _ => Err("a JSON schema must be an object (or `true`)".into()),
    }
}

/// The schema with this crate's JSON layout (compact separators, no free whitespace), unless the
/// schema sets its own `x-guidance` options.
fn json_schema_with_options(mut schema: serde_json::Value) -> serde_json::Value {
    if schema.get("x-guidance").is_none() {
        let opts = JsonCompileOptions {
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            whitespace_flexible: false,
            ..JsonCompileOptions::default()
        };
        opts.apply_to(&mut schema);
    }
    schema
}

/// A tokenizer's vocabulary as the constraint engine sees it, and the compiler of constraints
/// against it. One per tokenizer (`Tokenizer::grammar` builds and keeps it), shared.
pub struct GrammarEnv {
    factory: ParserFactory,
    vocab_size: usize,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for GrammarEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEnv").field("vocab_size", &self.vocab_size).finish()
    }
}

/// The constraint engine's tokenizer interface over our token bytes. Tokenizing a literal greedily
/// over the trie is enough: masks are computed over the trie, and a non-canonical tokenization is
/// only used for forced tokens, which we do not use.
struct TrieEnv {
    trie: TokTrie,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

impl GrammarEnv {
    /// The vocabulary given as each token's bytes and whether it is special, in id order (what
    /// `Tokenizer::vocabulary_bytes` gives), with the ids that end generation. Costs a pass over
    /// the vocabulary (about 0.1 s for 50k tokens). `Tokenizer::grammar` builds and keeps one.
    pub fn new(vocabulary: Vec<(Vec<u8>, bool)>, eos_ids: &[u32]) -> Result<Arc<GrammarEnv>> {
        let n = vocabulary.len();
        let mut words = Vec::with_capacity(n);
        for (bytes, special) in vocabulary {
            words.push(if special {
                // The trie's mark for a special token: never matched as text.
                let mut w = Vec::with_capacity(bytes.len() + 1);
                w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                w.extend_from_slice(&bytes);
                w
            } else {
                bytes
            });
        }
        // EOS ids outside the vocabulary (a generation config naming a padding row) end nothing.
        let eos: Vec<u32> = eos_ids.iter().copied().filter(|&t| (t as usize) < n).collect();
        let Some(&first_eos) = eos.first() else {
            return Err(ModelError::Tokenizer(
                "structured output needs an end-of-sequence token inside the vocabulary and the model names none"
                    .into(),
            ));
        };
        let info = TokRxInfo::new(n as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(TrieEnv { trie });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ModelError::Internal(format!("constraint engine: {e}")))?;
        factory.quiet();
        Ok(Arc::new(GrammarEnv { factory, vocab_size: n, eos: eos.into() }))
    }

    /// Compiles `constraint` into a fresh [`Grammar`] at the start of the output. The error names
    /// what is wrong with the schema, regex or grammar (the caller prefixes the request field).
    pub fn compile(&self, constraint: &Constraint) -> std::result::Result<Grammar, String> {
        constraint.check_sizes()?;
        let grammar = constraint.to_grammar()?;
        let parser = self.factory.create_parser(grammar).map_err(|e| format!("{e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Grammar { matcher, ended: false, vocab_size: self.vocab_size, eos: self.eos.clone() })
    }

    /// Number of tokens of the vocabulary (a mask's length).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

/// Which tokens may come next. Tokens beyond the tokenizer's vocabulary (padding rows of the
/// model's output) are never allowed.
#[derive(Debug, Clone)]
pub struct TokenMask {
    bits: SimpleVob,
    vocab_size: usize,
}

impl TokenMask {
    /// Whether `token` may come next.
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.vocab_size && self.bits.is_allowed(token)
    }

    /// Sets every forbidden token's logit to `-inf` (rows longer than the vocabulary included).
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.bits.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let word = if w * 32 < self.vocab_size { words.get(w).copied().unwrap_or(0) } else { 0 };
            if word == u32::MAX && (w + 1) * 32 <= self.vocab_size {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                let id = w * 32 + b;
                if id >= self.vocab_size || word & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// The allowed ids of a row of `len` ids as bits, bit `i % 32` of word `i / 32` (what a device
    /// masks a row with); ids past the vocabulary are never allowed.
    pub fn words(&self, len: usize) -> Vec<u32> {
        let words = self.bits.as_slice();
        let allowed = self.vocab_size.min(len);
        (0..len.div_ceil(32))
            .map(|w| {
                let word = words.get(w).copied().unwrap_or(0);
                match allowed.saturating_sub(w * 32) {
                    0 => 0,
                    n if n >= 32 => word,
                    n => word & ((1u32 << n) - 1),
                }
            })
            .collect()
    }

    /// The lowest allowed token, if any.
    pub fn first_allowed(&self) -> Option<u32> {
        (0..self.vocab_size as u32).find(|&t| self.bits.is_allowed(t))
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.bits.num_set()
    }
}

/// One sequence's place in its constraint's language.
pub struct Grammar {
    matcher: Matcher,
    /// An EOS token was produced: only EOS may follow.
    ended: bool,
    vocab_size: usize,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("ended", &self.ended).finish()
    }
}

fn engine_err(e: impl std::fmt::Display) -> String {
    format!("structured output: {e}")
}

impl Grammar {
    /// The tokens allowed next. Once the language is complete and nothing more can follow, that
    /// is the EOS tokens only. Costs from microseconds to a few milliseconds: callers compute it
    /// while the forward pass runs.
    pub fn mask(&mut self) -> std::result::Result<TokenMask, String> {
        if self.ended {
            return Ok(self.eos_mask());
        }
        let mut bits = self.matcher.compute_mask_or_eos().map_err(engine_err)?;
        // The engine allows its first EOS id where the language may end; every EOS id ends it.
        if self.eos.iter().any(|&t| bits.is_allowed(t)) {
            for &t in self.eos.iter() {
                bits.allow_token(t);
            }
        }
        Ok(TokenMask { bits, vocab_size: self.vocab_size })
    }

    /// Moves past `token`, which the last mask allowed. An EOS token ends the grammar.
    pub fn advance(&mut self, token: u32) -> std::result::Result<(), String> {
        if self.ended {
            return Ok(());
        }
        if token as usize >= self.vocab_size {
            return Err(engine_err(format!("token {token} is outside the vocabulary")));
        }
        if self.is_eos(token) {
            self.ended = true;
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(engine_err)
    }

    /// How many of `tokens` the grammar accepts in a row from here (stops at the first it forbids,
    /// and at an EOS token, which it counts when the language may end there). The state is unchanged.
    pub fn accepted_prefix(&mut self, tokens: &[u32]) -> std::result::Result<usize, String> {
        if self.ended {
            return Ok(0);
        }
        // A token outside the vocabulary (a padding row of the model's output) is never allowed,
        // and must not reach the constraint engine, which would stop on it for good.
        let tokens = match tokens.iter().position(|&t| t as usize >= self.vocab_size) {
            Some(i) => &tokens[..i],
            None => tokens,
        };
        let first_eos = tokens.iter().position(|&t| self.is_eos(t)).unwrap_or(tokens.len());
        let n = self.matcher.validate_tokens(&tokens[..first_eos]).map_err(engine_err)?;
        if n == first_eos && first_eos < tokens.len() {
            // An EOS right after an accepted run: allowed when the language may end there.
            self.matcher.consume_tokens(&tokens[..n]).map_err(engine_err)?;
            let ok = self.matcher.is_accepting().map_err(engine_err)? || self.matcher.is_stopped();
            self.matcher.rollback(n).map_err(engine_err)?;
            return Ok(if ok { n + 1 } else { n });
        }
        Ok(n)
    }

    /// The masks at each position of a draft: before `drafts[0]`, after it, ..., after all of
    /// them (`drafts.len() + 1` masks). Every draft token must be allowed where it stands
    /// ([`Grammar::accepted_prefix`]); an EOS token may only come last (after it, only EOS is
    /// allowed). The state is unchanged.
    pub fn masks_along(&mut self, drafts: &[u32]) -> std::result::Result<Vec<TokenMask>, String> {
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        masks.push(self.mask()?);
        let mut consumed = 0;
        let mut result = Ok(());
        for (i, &d) in drafts.iter().enumerate() {
            if d as usize >= self.vocab_size {
                result = Err(engine_err(format!("draft token {d} is outside the vocabulary")));
                break;
            }
            if self.is_eos(d) {
                if i + 1 != drafts.len() {
                    result = Err(engine_err("a draft continues past an EOS token"));
                } else {
                    masks.push(self.eos_mask());
                }
                break;
            }
            if let Err(e) = self.matcher.consume_token(d) {
                result = Err(engine_err(e));
                break;
            }
            consumed += 1;
            match self.mask() {
                Ok(m) => masks.push(m),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if consumed > 0 {
            self.matcher.rollback(consumed).map_err(engine_err)?;
        }
        result.map(|()| masks)
    }

    fn eos_mask(&self) -> TokenMask {
        let mut bits = SimpleVob::alloc(self.vocab_size);
        for &t in self.eos.iter() {
            bits.allow_token(t);
        }
        TokenMask { bits, vocab_size: self.vocab_size }
    }

    /// Whether `token` may come next (an EOS after the end included).
    pub fn allows_next(&mut self, token: u32) -> std::result::Result<bool, String> {
        if self.ended {
            return Ok(self.is_eos(token));
        }
        Ok(self.accepted_prefix(&[token])? == 1)
    }

    /// Whether the output so far is a complete sentence (EOS would be allowed now).
    pub fn is_complete(&mut self) -> bool {
        self.ended || self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }

    fn is_eos(&self, token: u32) -> bool {
        self.eos.contains(&token)
    }
}
