//! Tokenizer, detokenizer and chat template, from a Hugging Face model directory or a GGUF file.
//!
//! Both sources end up as one `tokenizers::Tokenizer` plus the facts around it that the model
//! files state separately: the BOS/EOS ids, whether encoding prepends BOS, and the chat template.
//!
//! Invariants:
//! - `encode(text, true)` prepends BOS exactly once, and only when the model says so
//!   (`add_bos_token` in `tokenizer_config.json` / `tokenizer.ggml.add_bos_token`, or a
//!   `tokenizer.json` post-processor that adds it); `encode(text, false)` never adds anything.
//!   Special-token text inside `text` (e.g. `<|im_start|>`) is always matched as that token, as
//!   transformers does.
//! - `decode` rejects ids outside the vocabulary instead of silently dropping them.
//! - [`IncrementalDecoder`] emits text deltas that are whole UTF-8 characters and whose
//!   concatenation equals decoding all ids at once (for byte-level BPE, exactly).
//! - The GGUF path reproduces what transformers builds from the same file (the reference the
//!   tests compare against), which for the supported pre-tokenizer types is also llama.cpp's split.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{EngineError, Result};

/// One chat message, as the OpenAI-style APIs and Hugging Face chat templates see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A model's tokenizer. Cheap to clone (shared, immutable); `Send + Sync`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    tok: tokenizers::Tokenizer,
    /// The file or directory the tokenizer came from, for error messages.
    source: PathBuf,
    bos_id: Option<u32>,
    bos_token: Option<String>,
    eos_ids: Vec<u32>,
    eos_token: Option<String>,
    /// Whether `encode(_, true)` starts with BOS.
    add_bos: bool,
    /// Whether the `tokenizers` post-processor already inserts BOS (Llama 3 style
    /// `TemplateProcessing`), so it must not be prepended a second time.
    post_adds_bos: bool,
    template: Option<ChatTemplate>,
    vocab_size: usize,
}

struct ChatTemplate {
    env: minijinja::Environment<'static>,
}

const TEMPLATE_NAME: &str = "chat";

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.inner.source)
            .field("vocab_size", &self.inner.vocab_size)
            .field("bos_id", &self.inner.bos_id)
            .field("eos_ids", &self.inner.eos_ids)
            .field("add_bos", &self.inner.add_bos)
            .field("chat_template", &self.inner.template.is_some())
            .finish()
    }
}

fn tok_err(source: &Path, e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(format!("{}: {e}", source.display()))
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s)
            .map(Some)
            .map_err(|e| EngineError::format(path, format!("invalid JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(EngineError::io(path, e)),
    }
}

/// `"bos_token": "<s>"` or `"bos_token": {"content": "<s>", ...}` (older files).
fn special_token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `"chat_template": "..."` or a list of named templates, of which "default" is the chat one.
fn chat_template_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => {
            let named = |n: &str| list.iter().find(|t| t.get("name").and_then(|x| x.as_str()) == Some(n));
            named("default")
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_owned)
        }
        _ => None,
    }
}

/// `eos_token_id` in `generation_config.json` / `config.json`: an int or a list of ints.
fn id_list(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().and_then(|x| u32::try_from(x).ok()).into_iter().collect()
        }
        Some(serde_json::Value::Array(a)) => {
            a.iter().filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect()
        }
        _ => Vec::new(),
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a Hugging Face model directory, with `tokenizer_config.json`
    /// (chat template, `add_bos_token`, BOS/EOS tokens), `chat_template.jinja` (preferred over
    /// the config's template, as transformers does) and `generation_config.json` (its
    /// `eos_token_id`, int or list, joins the EOS set), each optional.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let tj = dir.join("tokenizer.json");
        if !tj.is_file() {
            return Err(EngineError::io(
                &tj,
                std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer.json not found"),
            ));
        }
        let tok = tokenizers::Tokenizer::from_file(&tj).map_err(|e| tok_err(&tj, e))?;
        let cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(serde_json::Value::Null);
        let gen_cfg = read_json(&dir.join("generation_config.json"))?.unwrap_or(serde_json::Value::Null);

        let bos_token = special_token_text(cfg.get("bos_token"));
        let eos_token = special_token_text(cfg.get("eos_token"));
        let bos_id = match &bos_token {
            Some(t) => tok.token_to_id(t),
            None => id_list(gen_cfg.get("bos_token_id")).first().copied(),
        };
        let mut eos_ids = Vec::new();
        if let Some(id) = eos_token.as_deref().and_then(|t| tok.token_to_id(t)) {
            eos_ids.push(id);
        }
        for id in id_list(gen_cfg.get("eos_token_id")) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }

        let jinja = dir.join("chat_template.jinja");
        let template_src = match std::fs::read_to_string(&jinja) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                chat_template_text(cfg.get("chat_template"))
            }
            Err(e) => return Err(EngineError::io(&jinja, e)),
        };

        let post_adds_bos = match bos_id {
            Some(b) => {
                let enc = tok.encode_fast("", true).map_err(|e| tok_err(&tj, e))?;
                enc.get_ids().first() == Some(&b)
            }
            None => false,
        };
        let add_bos = cfg.get("add_bos_token").and_then(|v| v.as_bool()).unwrap_or(post_adds_bos);
        Self::assemble(
            tok,
            dir.to_path_buf(),
            bos_id,
            bos_token,
            eos_ids,
            eos_token,
            add_bos,
            post_adds_bos,
            template_src,
        )
    }

    /// Builds the tokenizer a GGUF file describes in its `tokenizer.*` metadata. Only byte-level
    /// BPE (`tokenizer.ggml.model = "gpt2"`) is supported; see [`GgufVocab::build`].
    pub fn from_gguf(g: &crate::gguf::GgufFile) -> Result<Tokenizer> {
        GgufVocab::from_gguf(g)?.build()
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        tok: tokenizers::Tokenizer,
        source: PathBuf,
        bos_id: Option<u32>,
        bos_token: Option<String>,
        eos_ids: Vec<u32>,
        eos_token: Option<String>,
        add_bos: bool,
        post_adds_bos: bool,
        template_src: Option<String>,
    ) -> Result<Tokenizer> {
        let vocab_size = tok.get_vocab_size(true);
        if add_bos && bos_id.is_none() {
            return Err(tok_err(&source, "add_bos_token is set but the model names no BOS token"));
        }
        let bos_token = bos_token.or_else(|| bos_id.and_then(|id| tok.id_to_token(id)));
        let eos_token = eos_token.or_else(|| eos_ids.first().and_then(|&id| tok.id_to_token(id)));
        let template = match template_src {
            Some(src) => Some(
                ChatTemplate::compile(src).map_err(|e| tok_err(&source, format!("chat template: {e}")))?,
            ),
            None => None,
        };
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                tok,
                source,
                bos_id,
                bos_token,
                eos_ids,
                eos_token,
                add_bos,
                post_adds_bos,
                template,
                vocab_size,
            }),
        })
    }

    /// Token ids for `text`. With `add_special_tokens`, BOS comes first when the model asks for
    /// it ([`Tokenizer::add_bos`]); nothing else is ever appended.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let i = &*self.inner;
        // A post-processor that adds BOS against an explicit `add_bos_token: false` is bypassed.
        let use_post = add_special_tokens && (i.add_bos || !i.post_adds_bos);
        let enc = i.tok.encode_fast(text, use_post).map_err(|e| tok_err(&i.source, e))?;
        let ids = enc.get_ids();
        if add_special_tokens && i.add_bos && !i.post_adds_bos {
            // `assemble` guarantees a BOS id whenever add_bos is set.
            let bos = i.bos_id.ok_or_else(|| EngineError::Internal("add_bos without a BOS id".into()))?;
            let mut out = Vec::with_capacity(ids.len() + 1);
            out.push(bos);
            out.extend_from_slice(ids);
            Ok(out)
        } else {
            Ok(ids.to_vec())
        }
    }

    /// Text for `ids`. Ids outside the vocabulary are an error. Byte sequences that are not valid
    /// UTF-8 (a character cut in the middle) come out as U+FFFD, as in transformers.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let i = &*self.inner;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= i.vocab_size) {
            return Err(EngineError::Tokenizer(format!(
                "{}: token id {bad} is outside the vocabulary (size {})",
                i.source.display(),
                i.vocab_size
            )));
        }
        i.tok.decode(ids, skip_special_tokens).map_err(|e| tok_err(&i.source, e))
    }

    /// Renders the model's chat template (Jinja, as transformers renders it: `trim_blocks`,
    /// `lstrip_blocks`, Python string methods, `raise_exception`) with `messages`,
    /// `add_generation_prompt`, `bos_token` and `eos_token`. The result is meant to be encoded
    /// with `add_special_tokens = false`, since templates write BOS themselves when they want it.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let i = &*self.inner;
        let t = i.template.as_ref().ok_or_else(|| tok_err(&i.source, "the model has no chat template"))?;
        let mut ctx: BTreeMap<&str, minijinja::Value> = BTreeMap::new();
        ctx.insert("messages", minijinja::Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", add_generation_prompt.into());
        if let Some(b) = &i.bos_token {
            ctx.insert("bos_token", b.as_str().into());
        }
        if let Some(e) = &i.eos_token {
            ctx.insert("eos_token", e.as_str().into());
        }
        let tmpl = t.env.get_template(TEMPLATE_NAME).map_err(|e| tok_err(&i.source, e))?;
        tmpl.render(ctx).map_err(|e| tok_err(&i.source, format!("chat template: {e:#}")))
    }

    /// Whether the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.inner.template.is_some()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos_id
    }

    /// Ids that end generation: the tokenizer's EOS plus the generation config's (HF) or the
    /// end-of-turn/end-of-message ids (GGUF). May be empty.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos_ids
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// Whether `encode(_, true)` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.inner.add_bos
    }

    /// The text one token decodes to on its own (special tokens included; a token holding part
    /// of a UTF-8 character shows U+FFFD). `None` for an id outside the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<String> {
        if id as usize >= self.inner.vocab_size {
            return None;
        }
        self.inner.tok.decode(&[id], false).ok()
    }

    /// The id of a token given as its vocabulary string (e.g. `"<|im_end|>"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tok.token_to_id(token)
    }
}

// ------------------------------------------------------------------------------------------------
// Chat template
// ------------------------------------------------------------------------------------------------

impl ChatTemplate {
    fn compile(src: String) -> std::result::Result<ChatTemplate, minijinja::Error> {
        let mut env = minijinja::Environment::new();
        // transformers renders with jinja2's trim_blocks + lstrip_blocks, and jinja2 drops one
        // trailing newline of the template (keep_trailing_newline = False).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<minijinja::Value, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, src)?;
        Ok(ChatTemplate { env })
    }
}

/// `strftime_now(fmt)`, which some templates (Llama 3.x) call for today's date. UTC; supports
/// the common `%d %m %Y %y %b %B %H %M %S %%` directives.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    format_utc(secs, &fmt)
}

fn format_utc(secs: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian), by 400-year eras.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

// ------------------------------------------------------------------------------------------------
// GGUF
// ------------------------------------------------------------------------------------------------

/// GGUF `tokenizer.ggml.token_type` value of a control token (BOS, EOS, `<|im_start|>`, ...).
pub const GGUF_TOKEN_CONTROL: i32 = 3;
/// GGUF `tokenizer.ggml.token_type` value of a user-defined token (matched whole, not special).
pub const GGUF_TOKEN_USER_DEFINED: i32 = 4;

/// Every digit alone: llama.cpp's first split for "smollm" and its kin, before the GPT-2 regex
/// (which is the one `tokenizers`' ByteLevel applies with `use_regex = true`).
const SPLIT_DIGITS: &str = r"\p{N}";
/// llama.cpp's "llama-bpe" (Llama 3) split.
const SPLIT_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's "qwen2" split: like Llama 3's, but digits one at a time.
const SPLIT_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a byte-level vocabulary splits text before BPE, by `tokenizer.ggml.pre`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufPreTokenizer {
    /// GPT-2 regex ("gpt2", "default", or no key).
    Gpt2,
    /// Every digit alone, then the GPT-2 regex ("smollm", "starcoder", "refact", "command-r",
    /// "codeshell", "exaone", "minerva").
    DigitsThenGpt2,
    /// Llama 3 ("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx", "pixtral").
    Llama3,
    /// Qwen2 ("qwen2", "deepseek-r1-qwen", "stablelm2").
    Qwen2,
}

impl GgufPreTokenizer {
    /// The split for a `tokenizer.ggml.pre` value; `None` for types this engine does not know.
    pub fn from_name(pre: Option<&str>) -> Option<GgufPreTokenizer> {
        Some(match pre {
            None | Some("default") | Some("gpt2") | Some("gpt-2") => GgufPreTokenizer::Gpt2,
            Some("smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva") => {
                GgufPreTokenizer::DigitsThenGpt2
            }
            Some("llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "smaug-bpe" | "dbrx" | "pixtral") => {
                GgufPreTokenizer::Llama3
            }
            Some("qwen2" | "deepseek-r1-qwen" | "stablelm2") => GgufPreTokenizer::Qwen2,
            Some(_) => return None,
        })
    }

    fn build(self) -> std::result::Result<PreTokenizerWrapper, tokenizers::Error> {
        let split = |re: &str| -> std::result::Result<PreTokenizerWrapper, tokenizers::Error> {
            Ok(Split::new(SplitPattern::Regex(re.to_owned()), SplitDelimiterBehavior::Isolated, false)?
                .into())
        };
        Ok(match self {
            GgufPreTokenizer::Gpt2 => ByteLevel::new(false, true, true).into(),
            GgufPreTokenizer::DigitsThenGpt2 => {
                Sequence::new(vec![split(SPLIT_DIGITS)?, ByteLevel::new(false, true, true).into()]).into()
            }
            GgufPreTokenizer::Llama3 => {
                Sequence::new(vec![split(SPLIT_LLAMA3)?, ByteLevel::new(false, true, false).into()]).into()
            }
            GgufPreTokenizer::Qwen2 => {
                Sequence::new(vec![split(SPLIT_QWEN2)?, ByteLevel::new(false, true, false).into()]).into()
            }
        })
    }
}

/// The `tokenizer.*` metadata of a GGUF file, read out into plain values.
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// The file, for error messages.
    pub path: PathBuf,
    /// `tokenizer.ggml.model` ("gpt2" for byte-level BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`, in the byte-level alphabet (`Ġ` for a space).
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type` (empty when absent).
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`, each `"left right"`.
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` / `eom_token_id`: also end generation, as in llama.cpp.
    pub extra_eos_ids: Vec<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token` (absent: false, as transformers reads a byte-level file).
    pub add_bos: Option<bool>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

impl GgufVocab {
    /// Reads the tokenizer metadata of an open GGUF file.
    pub fn from_gguf(g: &crate::gguf::GgufFile) -> Result<GgufVocab> {
        let path = g.path.clone();
        let bad = |key: &str, what: &str| EngineError::format(&path, format!("metadata `{key}`: {what}"));
        let string = |key: &str| -> Result<Option<String>> {
            match g.get(key) {
                None => Ok(None),
                Some(v) => {
                    v.as_str().map(|s| Some(s.to_owned())).ok_or_else(|| bad(key, "expected a string"))
                }
            }
        };
        let id = |key: &str| -> Result<Option<u32>> {
            match g.get(key) {
                None => Ok(None),
                Some(v) => {
                    let x = v.as_u64().or_else(|| v.as_i64().and_then(|x| u64::try_from(x).ok()));
                    x.and_then(|x| u32::try_from(x).ok())
                        .map(Some)
                        .ok_or_else(|| bad(key, "expected a token id"))
                }
            }
        };
        let strings = |key: &str| -> Result<Vec<String>> {
            match g.get(key) {
                None => Ok(Vec::new()),
                Some(v) => v
                    .as_array()
                    .ok_or_else(|| bad(key, "expected an array"))?
                    .iter()
                    .map(|x| x.as_str().map(str::to_owned).ok_or_else(|| bad(key, "expected strings")))
                    .collect(),
            }
        };
        let model = string("tokenizer.ggml.model")?.ok_or_else(|| EngineError::Unsupported {
            path: path.clone(),
            msg: "no tokenizer in this GGUF (tokenizer.ggml.model missing)".into(),
        })?;
        let token_types = match g.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(v) => v
                .as_array()
                .ok_or_else(|| bad("tokenizer.ggml.token_type", "expected an array"))?
                .iter()
                .map(|x| {
                    x.as_i64()
                        .and_then(|x| i32::try_from(x).ok())
                        .ok_or_else(|| bad("tokenizer.ggml.token_type", "expected integers"))
                })
                .collect::<Result<_>>()?,
        };
        let add_bos = match g.get("tokenizer.ggml.add_bos_token") {
            None => None,
            Some(v) => {
                Some(v.as_bool().ok_or_else(|| bad("tokenizer.ggml.add_bos_token", "expected a bool"))?)
            }
        };
        let mut extra_eos_ids = Vec::new();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            extra_eos_ids.extend(id(key)?);
        }
        Ok(GgufVocab {
            model,
            pre: string("tokenizer.ggml.pre")?,
            tokens: strings("tokenizer.ggml.tokens")?,
            token_types,
            merges: strings("tokenizer.ggml.merges")?,
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            extra_eos_ids,
            unk_id: id("tokenizer.ggml.unknown_token_id")?,
            pad_id: id("tokenizer.ggml.padding_token_id")?,
            add_bos,
            chat_template: string("tokenizer.chat_template")?,
            path,
        })
    }

    /// Builds the tokenizer: byte-level BPE over `tokens` and `merges`, control tokens as special
    /// added tokens and user-defined ones as plain added tokens (both matched whole in text),
    /// the pre-tokenizer chosen by `pre`, a byte-level decoder.
    pub fn build(self) -> Result<Tokenizer> {
        let path = self.path.clone();
        if self.model != "gpt2" {
            return Err(EngineError::Unsupported {
                path,
                msg: format!("tokenizer model `{}` (only byte-level BPE, `gpt2`, is supported)", self.model),
            });
        }
        let pre =
            GgufPreTokenizer::from_name(self.pre.as_deref()).ok_or_else(|| EngineError::Unsupported {
                path: path.clone(),
                msg: format!("pre-tokenizer type `{}`", self.pre.as_deref().unwrap_or("")),
            })?;
        if self.tokens.is_empty() {
            return Err(EngineError::format(&path, "tokenizer.ggml.tokens is empty"));
        }
        if !self.token_types.is_empty() && self.token_types.len() != self.tokens.len() {
            return Err(EngineError::format(
                &path,
                format!("{} token types for {} tokens", self.token_types.len(), self.tokens.len()),
            ));
        }
        let n = self.tokens.len();
        for (name, id) in
            [("bos", self.bos_id), ("eos", self.eos_id), ("unknown", self.unk_id), ("padding", self.pad_id)]
        {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(EngineError::format(
                        &path,
                        format!("{name} token id {id} >= vocabulary size {n}"),
                    ));
                }
            }
        }

        let alphabet: std::collections::HashSet<char> = byte_alphabet().into_iter().collect();
        let spell = byte_alphabet();
        let mut vocab = tokenizers::models::bpe::Vocab::default();
        for (i, t) in self.tokens.iter().enumerate() {
            // A token written outside the byte alphabet is a plain-text spelling; re-spell it as
            // transformers does so BPE can reach it.
            let key = if t.chars().all(|c| alphabet.contains(&c)) {
                t.clone()
            } else {
                t.bytes().map(|b| spell[b as usize]).collect()
            };
            vocab.insert(key, i as u32);
        }
        let mut merges = Vec::with_capacity(self.merges.len());
        for m in &self.merges {
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| EngineError::format(&path, format!("merge `{m}` is not two tokens")))?;
            merges.push((a.to_owned(), b.to_owned()));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| tok_err(&path, format!("BPE: {e}")))?;
        let mut tok = tokenizers::Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(pre.build().map_err(|e| tok_err(&path, e))?));
        tok.with_decoder(Some(ByteLevelDecoder::default()));

        let kind = |i: usize| self.token_types.get(i).copied();
        let control: Vec<AddedToken> = self
            .tokens
            .iter()
            .enumerate()
            .filter(|&(i, t)| kind(i) == Some(GGUF_TOKEN_CONTROL) && t.chars().all(|c| alphabet.contains(&c)))
            .map(|(_, t)| AddedToken::from(t.clone(), true).normalized(false))
            .collect();
        tok.add_special_tokens(&control);
        let user: Vec<AddedToken> = self
            .tokens
            .iter()
            .enumerate()
            .filter(|&(i, _)| kind(i) == Some(GGUF_TOKEN_USER_DEFINED))
            .map(|(_, t)| AddedToken::from(t.clone(), false).normalized(false))
            .collect();
        tok.add_tokens(&user);
        if tok.get_vocab_size(true) != n {
            return Err(EngineError::format(
                &path,
                format!(
                    "tokenizer has {} ids after adding special tokens, file lists {n}",
                    tok.get_vocab_size(true)
                ),
            ));
        }

        let mut eos_ids: Vec<u32> = self.eos_id.into_iter().collect();
        for id in self.extra_eos_ids {
            if (id as usize) < n && !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let name = |id: Option<u32>| id.map(|i| self.tokens[i as usize].clone());
        Tokenizer::assemble(
            tok,
            path,
            self.bos_id,
            name(self.bos_id),
            eos_ids,
            name(self.eos_id),
            self.add_bos.unwrap_or(false),
            false,
            self.chat_template,
        )
    }
}

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the others
/// are shifted to U+0100 and up, so every byte string is a printable token string.
fn byte_alphabet() -> Vec<char> {
    let mut table = vec!['\0'; 256];
    let mut shifted = 0u32;
    for b in 0..=255u32 {
        let printable =
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or('\0')
        };
    }
    table
}

// ------------------------------------------------------------------------------------------------
// Incremental detokenizer
// ------------------------------------------------------------------------------------------------

/// Turns a stream of generated ids into text deltas.
///
/// It decodes a short window (from `prefix` to the end) and emits what the newest ids added
/// beyond the text already emitted. A window whose text ends in U+FFFD is held back, since the
/// next id may complete the character; [`IncrementalDecoder::finish`] flushes whatever is held.
/// Decoding the window together with a little prompt context keeps decoders that treat the
/// first token specially (leading-space stripping) from changing the text mid-stream.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    tok: Tokenizer,
    ids: Vec<u32>,
    /// Start of the decoding window.
    prefix: usize,
    /// End of the ids whose text has been emitted.
    read: usize,
    skip_special_tokens: bool,
}

/// Prompt ids kept as decoding context.
const CONTEXT_IDS: usize = 6;

impl IncrementalDecoder {
    /// A decoder for a sequence that starts after `prompt_ids` (pass `&[]` for none).
    pub fn new(tok: &Tokenizer, prompt_ids: &[u32], skip_special_tokens: bool) -> IncrementalDecoder {
        let ctx = &prompt_ids[prompt_ids.len().saturating_sub(CONTEXT_IDS)..];
        IncrementalDecoder {
            tok: tok.clone(),
            ids: ctx.to_vec(),
            prefix: 0,
            read: ctx.len(),
            skip_special_tokens,
        }
    }

    /// Adds one id; returns the new text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        if id as usize >= self.tok.vocab_size() {
            return Err(EngineError::Tokenizer(format!(
                "token id {id} is outside the vocabulary (size {})",
                self.tok.vocab_size()
            )));
        }
        self.ids.push(id);
        let done = self.tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let all = self.tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        if all.len() <= done.len() || all.ends_with('\u{FFFD}') || !all.starts_with(done.as_str()) {
            return Ok(String::new());
        }
        let delta = all[done.len()..].to_owned();
        self.prefix = self.read;
        self.read = self.ids.len();
        self.compact();
        Ok(delta)
    }

    /// Everything still held back (an incomplete character comes out as U+FFFD).
    pub fn finish(&mut self) -> Result<String> {
        let done = self.tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let all = self.tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        let delta = match all.strip_prefix(done.as_str()) {
            Some(rest) => rest.to_owned(),
            None => String::new(),
        };
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        self.compact();
        Ok(delta)
    }

    /// Drops ids before the window so memory stays bounded on long generations.
    fn compact(&mut self) {
        if self.prefix > 64 {
            self.ids.drain(..self.prefix);
            self.read -= self.prefix;
            self.prefix = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_a_bijection_with_gpt2_spellings() {
        let t = byte_alphabet();
        let set: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
    }

    #[test]
    fn format_utc_known_dates() {
        assert_eq!(format_utc(0, "%d %b %Y"), "01 Jan 1970");
        // 2024-02-29 12:34:56 UTC
        assert_eq!(format_utc(1_709_210_096, "%Y-%m-%d %H:%M:%S %B %%"), "2024-02-29 12:34:56 February %");
    }

    #[test]
    fn pre_tokenizer_names() {
        assert_eq!(GgufPreTokenizer::from_name(Some("smollm")), Some(GgufPreTokenizer::DigitsThenGpt2));
        assert_eq!(GgufPreTokenizer::from_name(None), Some(GgufPreTokenizer::Gpt2));
        assert_eq!(GgufPreTokenizer::from_name(Some("llama-bpe")), Some(GgufPreTokenizer::Llama3));
        assert_eq!(GgufPreTokenizer::from_name(Some("qwen2")), Some(GgufPreTokenizer::Qwen2));
        assert_eq!(GgufPreTokenizer::from_name(Some("no-such-thing")), None);
        for p in [
            GgufPreTokenizer::Gpt2,
            GgufPreTokenizer::DigitsThenGpt2,
            GgufPreTokenizer::Llama3,
            GgufPreTokenizer::Qwen2,
        ] {
            assert!(p.build().is_ok(), "{p:?} regex must compile");
        }
    }

    fn render(src: &str, messages: &[ChatMessage]) -> std::result::Result<String, minijinja::Error> {
        let t = ChatTemplate::compile(src.to_owned())?;
        let tmpl = t.env.get_template(TEMPLATE_NAME)?;
        tmpl.render(
            minijinja::context! { messages => messages, add_generation_prompt => true, bos_token => "<s>" },
        )
    }

    #[test]
    fn template_python_methods_blocks_and_exceptions() {
        // Python string methods (pycompat), namespace + loop controls, trim/lstrip of block tags,
        // and the trailing newline of the template dropped, as jinja2 does in transformers.
        let src = "{%- set ns = namespace(n=0) -%}\n{{ bos_token }}\n    {% for m in messages %}\n    {% if m.role == 'system' %}{% continue %}{% endif %}\n{{ m.role.upper() }}: {{ m.content.strip() }}{% set ns.n = ns.n + 1 %}\n    {% endfor %}\n{{ ns.n }}{{ '|' if 'x'.startswith('x') }}\n";
        let msgs = [ChatMessage::new("system", "ignored"), ChatMessage::new("user", "  hi  ")];
        // Expected text as transformers' jinja2 renderer produces it for this template.
        assert_eq!(render(src, &msgs).unwrap(), "<s>\nUSER: hi1|");

        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok";
        let err = render(src, &[ChatMessage::new("assistant", "x")]).unwrap_err();
        assert!(format!("{err:#}").contains("first message must be from the user"), "{err:#}");
        assert_eq!(render(src, &[ChatMessage::new("user", "x")]).unwrap(), "ok");

        assert!(ChatTemplate::compile("{% for %}".to_owned()).is_err());
    }

    #[test]
    fn tokenizer_is_send_sync_clone() {
        fn check<T: Send + Sync + Clone>() {}
        check::<Tokenizer>();
        check::<IncrementalDecoder>();
    }
}
