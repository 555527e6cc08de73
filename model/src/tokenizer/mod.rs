//! Tokenizer, detokenizer and chat template, from a Hugging Face model directory or a GGUF file.
//!
//! Every source ends up as one vocabulary model plus the facts around it that the model files
//! state separately: the BOS/EOS ids, whether encoding prepends BOS, and the chat template. The
//! model is a `tokenizers::Tokenizer` (a Hugging Face directory, a byte-level BPE GGUF) or a
//! SentencePiece vocabulary run as llama.cpp runs it (a GGUF with `tokenizer.ggml.model =
//! "llama"`: Llama 2, Mistral, Gemma, Phi-3).
//!
//! Invariants:
//! - `encode(text, true)` prepends BOS exactly once, and only when the model says so
//!   (`add_bos_token` in `tokenizer_config.json` / `tokenizer.ggml.add_bos_token`, or a
//!   `tokenizer.json` post-processor that adds it); it appends EOS only for a SentencePiece GGUF
//!   that sets `tokenizer.ggml.add_eos_token`. `encode(text, false)` never adds anything.
//!   Special-token text inside `text` (e.g. `<|im_start|>`) is always matched as that token, as
//!   transformers does.
//! - `decode` rejects ids outside the vocabulary instead of silently dropping them.
//! - [`IncrementalDecoder`] emits text deltas that are whole UTF-8 characters and whose
//!   concatenation equals decoding all ids at once (for byte-level BPE and SentencePiece GGUF
//!   vocabularies, exactly).
//! - The byte-level BPE GGUF path reproduces what transformers builds from the same file (the
//!   reference the tests compare against), which for the supported pre-tokenizer types is also
//!   llama.cpp's split. The SentencePiece GGUF path reproduces llama.cpp's ids and text.
//!
//! One file per concern, each reaching only into this one (never into a sibling): `hf` reads a
//! Hugging Face directory, `gguf_vocab` builds from GGUF metadata, `spm` encodes and decodes a
//! SentencePiece vocabulary, `template` compiles and renders chat templates, `incremental`
//! streams text deltas.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{ModelError, Result};

pub mod builtin;
mod gguf_vocab;
mod hf;
mod incremental;
mod spm;
mod template;

pub use gguf_vocab::{GgufPreTokenizer, GgufVocab, GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED};
pub use incremental::IncrementalDecoder;

use spm::{Spm, SpmSpec};
use template::ChatTemplate;

/// One chat message, as the OpenAI-style APIs and Hugging Face chat templates see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The participant's name (OpenAI's `messages[].name`); templates that know it read
    /// `message.name`, and it is absent from the template's view when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's tool calls, as Hugging Face templates read them
    /// (`message.tool_calls[i].function.name` and `.arguments`, the arguments as an object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<TemplateToolCall>>,
    /// A `tool` turn's answer to this call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A tool call as Hugging Face chat templates read it from an assistant message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TemplateToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: TemplateFunction,
}

/// The function a [`TemplateToolCall`] calls: its name and its arguments, an object when the
/// client's JSON parses as one (templates write it with `tojson`), else the string as given.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TemplateFunction {
    pub name: String,
    pub arguments: Value,
}

impl TemplateToolCall {
    /// A call from the OpenAI API's wire form (arguments as a JSON string).
    pub fn from_wire(id: Option<String>, name: String, arguments: &str) -> TemplateToolCall {
        let arguments = serde_json::from_str::<Value>(arguments)
            .ok()
            .filter(Value::is_object)
            .unwrap_or_else(|| Value::String(arguments.to_owned()));
        TemplateToolCall { id, kind: "function".into(), function: TemplateFunction { name, arguments } }
    }
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }

    /// The message with a participant's name.
    pub fn with_name(self, name: Option<String>) -> Self {
        ChatMessage { name, ..self }
    }
}

/// A model's tokenizer. Cheap to clone (shared, immutable); `Send + Sync`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

/// The vocabulary and its encoding algorithm.
enum Model {
    /// A `tokenizer.json`, or a byte-level BPE GGUF vocabulary.
    Hf(Box<tokenizers::Tokenizer>),
    /// A SentencePiece GGUF vocabulary.
    Spm(Box<Spm>),
}

impl Model {
    fn vocab_size(&self) -> usize {
        match self {
            Model::Hf(t) => t.get_vocab_size(true),
            Model::Spm(s) => s.vocab_size(),
        }
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        match self {
            Model::Hf(t) => t.id_to_token(id),
            Model::Spm(s) => s.id_to_token(id).map(str::to_owned),
        }
    }
}

struct Inner {
    model: Model,
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
    /// The constraint engine's view of this vocabulary, built on first use ([`Tokenizer::grammar`]).
    grammar: std::sync::OnceLock<std::result::Result<Arc<crate::grammar::GrammarEnv>, String>>,
}

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

fn tok_err(source: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{}: {e}", source.display()))
}

/// What a loader found, handed to [`Tokenizer::assemble`].
struct Parts {
    model: Model,
    /// The file or directory read, for error messages.
    source: PathBuf,
    bos_id: Option<u32>,
    /// BOS as text; `None` takes the vocabulary's spelling of `bos_id`.
    bos_token: Option<String>,
    eos_ids: Vec<u32>,
    /// EOS as text; `None` takes the vocabulary's spelling of the first EOS id.
    eos_token: Option<String>,
    add_bos: bool,
    post_adds_bos: bool,
    /// Jinja source of the chat template, if the model has one.
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a Hugging Face model directory, with `tokenizer_config.json`
    /// (chat template, `add_bos_token`, BOS/EOS tokens), `chat_template.jinja` (preferred over
    /// the config's template, as transformers does) and `generation_config.json` (its
    /// `eos_token_id`, int or list, joins the EOS set), each optional.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        hf::load(dir)
    }

    /// Builds the tokenizer a GGUF file describes in its `tokenizer.*` metadata: byte-level BPE
    /// (`tokenizer.ggml.model = "gpt2"`) or SentencePiece (`"llama"`); see [`GgufVocab::build`].
    pub fn from_gguf(g: &crate::gguf::GgufFile) -> Result<Tokenizer> {
        GgufVocab::from_gguf(g)?.build()
    }

    /// The one place a tokenizer comes into being, whichever file it was read from: checks what
    /// every source must agree on and fills in the token texts a source left out.
    fn assemble(parts: Parts) -> Result<Tokenizer> {
        let Parts {
            model,
            source,
            bos_id,
            bos_token,
            eos_ids,
            eos_token,
            add_bos,
            post_adds_bos,
            chat_template: template_src,
        } = parts;
        let vocab_size = model.vocab_size();
        if add_bos && bos_id.is_none() {
            return Err(tok_err(&source, "add_bos_token is set but the model names no BOS token"));
        }
        let bos_token = bos_token.or_else(|| bos_id.and_then(|id| model.id_to_token(id)));
        let eos_token = eos_token.or_else(|| eos_ids.first().and_then(|&id| model.id_to_token(id)));
        let template = match template_src {
            Some(src) => Some(
                ChatTemplate::compile(src).map_err(|e| tok_err(&source, format!("chat template: {e}")))?,
            ),
            None => None,
        };
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                model,
                source,
                bos_id,
                bos_token,
                eos_ids,
                eos_token,
                add_bos,
                post_adds_bos,
                template,
                vocab_size,
                grammar: std::sync::OnceLock::new(),
            }),
        })
    }

    /// Token ids for `text`. With `add_special_tokens`, BOS comes first when the model asks for
    /// it ([`Tokenizer::add_bos`]); EOS is appended only by a SentencePiece GGUF that asks for it.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let i = &*self.inner;
        let tok = match &i.model {
            Model::Hf(t) => t,
            Model::Spm(s) => return s.encode(text, add_special_tokens).map_err(|e| tok_err(&i.source, e)),
        };
        // A post-processor that adds BOS against an explicit `add_bos_token: false` is bypassed.
        let use_post = add_special_tokens && (i.add_bos || !i.post_adds_bos);
        let enc = tok.encode_fast(text, use_post).map_err(|e| tok_err(&i.source, e))?;
        let ids = enc.get_ids();
        if add_special_tokens && i.add_bos && !i.post_adds_bos {
            // `assemble` guarantees a BOS id whenever add_bos is set.
            let bos = i.bos_id.ok_or_else(|| ModelError::Internal("add_bos without a BOS id".into()))?;
            let mut out = Vec::with_capacity(ids.len() + 1);
            out.push(bos);
            out.extend_from_slice(ids);
            Ok(out)
        } else {
            Ok(ids.to_vec())
        }
    }

    /// Text for `ids`. Ids outside the vocabulary are an error. Byte sequences that are not valid
    /// UTF-8 (a character cut in the middle) come out as U+FFFD, as in transformers. A
    /// SentencePiece vocabulary decodes as llama.cpp's `llama_detokenize` does, with
    /// `skip_special_tokens` as its `remove_special` and the negation as its `unparse_special`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let i = &*self.inner;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= i.vocab_size) {
            return Err(ModelError::Tokenizer(format!(
                "{}: token id {bad} is outside the vocabulary (size {})",
                i.source.display(),
                i.vocab_size
            )));
        }
        match &i.model {
            Model::Hf(t) => t.decode(ids, skip_special_tokens).map_err(|e| tok_err(&i.source, e)),
            Model::Spm(s) => Ok(s.decode(ids, skip_special_tokens)),
        }
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
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Tokenizer::apply_chat_template`] with the request's tool definitions in the template's
    /// `tools` variable (OpenAI's `[{"type": "function", "function": {...}}]`, as Hugging Face
    /// templates expect them). A template that cannot render tools is refused by
    /// [`Tokenizer::tool_format`] before this is called.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_full(messages, tools, add_generation_prompt, None)
    }

    /// [`Tokenizer::apply_chat_template_with_tools`] with the template's thinking switch
    /// (`enable_thinking`, Qwen3's) set when `enable_thinking` is given.
    pub fn apply_chat_template_full(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String> {
        let i = &*self.inner;
        let t = i.template.as_ref().ok_or_else(|| tok_err(&i.source, "the model has no chat template"))?;
        let mut ctx = template::context(
            messages,
            add_generation_prompt,
            i.bos_token.as_deref(),
            i.eos_token.as_deref(),
        );
        if let Some(tools) = tools {
            ctx.insert("tools", minijinja::Value::from_serialize(tools));
        }
        if let Some(on) = enable_thinking {
            ctx.insert("enable_thinking", on.into());
        }
        let tmpl = t.template().map_err(|e| tok_err(&i.source, e))?;
        tmpl.render(ctx).map_err(|e| tok_err(&i.source, format!("chat template: {e:#}")))
    }

    /// The chat template's Jinja source, if the model has one (read to tell how it writes tool
    /// calls).
    pub fn chat_template_source(&self) -> Option<&str> {
        self.inner.template.as_ref().map(|t| t.source())
    }

    /// Whether the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.inner.template.is_some()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos_id
    }

    /// Ids that end generation: the tokenizer's EOS plus the generation config's (HF) or the
    /// end-of-turn/end-of-message ids (GGUF), and for a SentencePiece GGUF the tokens llama.cpp
    /// recognises by their text (`<end_of_turn>`, `<|end|>`, `</s>`, ...). EOS first; may be
    /// empty.
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
    /// of a UTF-8 character shows U+FFFD; a SentencePiece token keeps its leading space).
    /// `None` for an id outside the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<String> {
        if id as usize >= self.inner.vocab_size {
            return None;
        }
        match &self.inner.model {
            Model::Hf(t) => t.decode(&[id], false).ok(),
            Model::Spm(s) => Some(s.token_text(id)),
        }
    }

    /// The bytes one token stands for on its own: a byte-level BPE piece mapped back to its
    /// bytes, a SentencePiece piece with `▁` as a space, a byte-fallback token (`<0xE2>`) as its
    /// byte, a special or added token as its text. Unlike [`Tokenizer::token_text`], a token
    /// holding part of a UTF-8 character gives its real bytes (what OpenAI's `bytes` field
    /// carries), so the tokens of a text concatenate to its bytes. `None` outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if id as usize >= self.inner.vocab_size {
            return None;
        }
        match &self.inner.model {
            Model::Hf(t) => {
                hf_token_bytes(t, t.get_added_tokens_decoder().contains_key(&id), hf_byte_level(t), id)
            }
            Model::Spm(s) => Some(s.token_bytes(id)),
        }
    }

    /// Every token's bytes ([`Tokenizer::token_bytes`]) and whether it is special
    /// ([`Tokenizer::is_special`]), in id order: one pass for the whole vocabulary.
    pub fn vocabulary_bytes(&self) -> Vec<(Vec<u8>, bool)> {
        let n = self.inner.vocab_size as u32;
        match &self.inner.model {
            Model::Hf(t) => {
                let added = t.get_added_tokens_decoder();
                let byte_level = hf_byte_level(t);
                (0..n)
                    .map(|id| {
                        let bytes =
                            hf_token_bytes(t, added.contains_key(&id), byte_level, id).unwrap_or_default();
                        (bytes, added.get(&id).is_some_and(|a| a.special))
                    })
                    .collect()
            }
            Model::Spm(s) => (0..n).map(|id| (s.token_bytes(id), s.is_special(id))).collect(),
        }
    }

    /// The constraint engine's view of this vocabulary (structured output), built on the first
    /// call and shared by every later one and every clone of this tokenizer.
    pub fn grammar(&self) -> Result<Arc<crate::grammar::GrammarEnv>> {
        self.inner
            .grammar
            .get_or_init(|| {
                crate::grammar::GrammarEnv::new(self.vocabulary_bytes(), self.eos_token_ids())
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(ModelError::Tokenizer)
    }

    /// Whether the token is a special one (a control token such as BOS, EOS or a chat-turn
    /// marker): it stands for no text, so the constraint engine never lets it spell output.
    /// `false` outside the vocabulary.
    pub fn is_special(&self, id: u32) -> bool {
        if id as usize >= self.inner.vocab_size {
            return false;
        }
        match &self.inner.model {
            Model::Hf(t) => t.get_added_tokens_decoder().get(&id).is_some_and(|a| a.special),
            Model::Spm(s) => s.is_special(id),
        }
    }

    /// The token's string in the vocabulary, as stored (byte-level BPE spells a leading space
    /// `Ġ`, SentencePiece `▁`; what transformers' `convert_ids_to_tokens` gives). `None` for an id
    /// outside the vocabulary.
    pub fn token_piece(&self, id: u32) -> Option<String> {
        if id as usize >= self.inner.vocab_size {
            return None;
        }
        match &self.inner.model {
            Model::Hf(t) => t.id_to_token(id),
            Model::Spm(s) => s.id_to_token(id).map(str::to_owned),
        }
    }

    /// The id of a token given as its vocabulary string (e.g. `"<|im_end|>"`, `"▁the"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.inner.model {
            Model::Hf(t) => t.token_to_id(token),
            Model::Spm(s) => s.token_to_id(token),
        }
    }
}

/// One token's bytes in a Hugging Face vocabulary (see [`Tokenizer::token_bytes`]), given
/// whether it is an added token and whether the vocabulary is byte-level.
fn hf_token_bytes(t: &tokenizers::Tokenizer, added: bool, byte_level: bool, id: u32) -> Option<Vec<u8>> {
    let piece = t.id_to_token(id)?;
    if added {
        return Some(piece.into_bytes());
    }
    if byte_level {
        if let Some(bytes) = piece.chars().map(byte_level_byte).collect::<Option<Vec<u8>>>() {
            return Some(bytes);
        }
    }
    if let Some(b) = byte_fallback(&piece) {
        return Some(vec![b]);
    }
    Some(piece.replace('▁', " ").into_bytes())
}

/// Whether a Hugging Face tokenizer decodes byte-level BPE (GPT-2's byte-to-character map).
fn hf_byte_level(t: &tokenizers::Tokenizer) -> bool {
    use tokenizers::DecoderWrapper;
    fn is_byte_level(d: &DecoderWrapper) -> bool {
        match d {
            DecoderWrapper::ByteLevel(_) => true,
            DecoderWrapper::Sequence(s) => s.get_decoders().iter().any(is_byte_level),
            _ => false,
        }
    }
    t.get_decoder().is_some_and(is_byte_level)
}

/// The byte a byte-level BPE character stands for: GPT-2 keeps the printable bytes `!`..`~`,
/// `¡`..`¬` and `®`..`ÿ` as their own code points and moves the other 68 to U+0100 onwards, in
/// byte order.
fn byte_level_byte(c: char) -> Option<u8> {
    let kept =
        |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let c = c as u32;
    if c <= 0xFF {
        return kept(c).then_some(c as u8);
    }
    let n = (c - 0x100) as usize;
    (0u32..=0xFF).filter(|&b| !kept(b)).nth(n).map(|b| b as u8)
}

/// The byte of a byte-fallback piece (`<0xE2>`).
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_send_sync_clone() {
        fn check<T: Send + Sync + Clone>() {}
        check::<Tokenizer>();
        check::<IncrementalDecoder>();
    }
}
