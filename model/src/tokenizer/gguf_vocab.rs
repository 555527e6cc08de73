//! Building a tokenizer from the `tokenizer.*` metadata of a GGUF file.
//!
//! [`GgufVocab`] reads the metadata out into plain values (so tests can build one by hand);
//! [`GgufVocab::build`] turns it into a byte-level BPE or a SentencePiece tokenizer.
//!
//! Invariants:
//! - Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) with a known `tokenizer.ggml.pre`,
//!   and SentencePiece (`"llama"`), are built; anything else is [`ModelError::Unsupported`]
//!   naming the file, never a tokenizer that splits text differently from the model's own.
//! - A byte-level result reproduces what transformers builds from the same file, which for the
//!   supported pre-tokenizer types is also llama.cpp's split. A SentencePiece result reproduces
//!   llama.cpp, with llama.cpp's defaults for what the file leaves out (BOS 1, EOS 2, unknown 0,
//!   `add_bos_token` and `add_space_prefix` true, `add_eos_token` false).
//! - Token ids are the file's: the built tokenizer has exactly as many ids as
//!   `tokenizer.ggml.tokens`, and every special id the file names lies inside it.

use std::path::PathBuf;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{ModelError, Result};

use super::{tok_err, Model, Parts, Spm, SpmSpec, Tokenizer};

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
    /// `tokenizer.ggml.model` ("gpt2" for byte-level BPE, "llama" for SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: in the byte-level alphabet (`Ġ` for a space) for BPE, with `▁`
    /// for a space and `<0xHH>` byte tokens for SentencePiece.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores` (SentencePiece; empty when absent).
    pub scores: Vec<f32>,
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
    /// `tokenizer.ggml.add_bos_token` (absent: false for byte-level BPE, as transformers reads
    /// such a file; true for SentencePiece, as llama.cpp does).
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token` (SentencePiece only; absent: false).
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece only; absent: true).
    pub add_space_prefix: Option<bool>,
    /// `general.name` (llama.cpp strips whitespace after Phi-3's special tokens, by name).
    pub name: Option<String>,
    /// `tokenizer.chat_template`, else the built-in template of the file's architecture
    /// ([`super::builtin`]), if any.
    pub chat_template: Option<String>,
}

impl GgufVocab {
    /// Reads the tokenizer metadata of an open GGUF file.
    pub fn from_gguf(g: &crate::gguf::GgufFile) -> Result<GgufVocab> {
        let path = g.path.clone();
        let bad = |key: &str, what: &str| ModelError::format(&path, format!("metadata `{key}`: {what}"));
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
        let model = string("tokenizer.ggml.model")?.ok_or_else(|| ModelError::Unsupported {
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
        let flag = |key: &str| -> Result<Option<bool>> {
            match g.get(key) {
                None => Ok(None),
                Some(v) => Ok(Some(v.as_bool().ok_or_else(|| bad(key, "expected a bool"))?)),
            }
        };
        let scores = match g.get("tokenizer.ggml.scores") {
            None => Vec::new(),
            Some(v) => v
                .as_array()
                .ok_or_else(|| bad("tokenizer.ggml.scores", "expected an array"))?
                .iter()
                .map(|x| {
                    x.as_f64()
                        .map(|x| x as f32)
                        .ok_or_else(|| bad("tokenizer.ggml.scores", "expected numbers"))
                })
                .collect::<Result<_>>()?,
        };
        let mut extra_eos_ids = Vec::new();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            extra_eos_ids.extend(id(key)?);
        }
        Ok(GgufVocab {
            model,
            pre: string("tokenizer.ggml.pre")?,
            tokens: strings("tokenizer.ggml.tokens")?,
            scores,
            token_types,
            merges: strings("tokenizer.ggml.merges")?,
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            extra_eos_ids,
            unk_id: id("tokenizer.ggml.unknown_token_id")?,
            pad_id: id("tokenizer.ggml.padding_token_id")?,
            add_bos: flag("tokenizer.ggml.add_bos_token")?,
            add_eos: flag("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix")?,
            name: string("general.name")?,
            chat_template: match string("tokenizer.chat_template")? {
                Some(t) => Some(t),
                None => string("general.architecture")?
                    .and_then(|a| super::builtin::for_architecture(&a))
                    .map(str::to_owned),
            },
            path,
        })
    }

    /// Builds the tokenizer. For `gpt2`: byte-level BPE over `tokens` and `merges`, control
    /// tokens as special added tokens and user-defined ones as plain added tokens (both matched
    /// whole in text), the pre-tokenizer chosen by `pre`, a byte-level decoder. For `llama`: a
    /// SentencePiece vocabulary over `tokens`, `scores` and `token_types`, run as llama.cpp runs
    /// it.
    pub fn build(self) -> Result<Tokenizer> {
        let path = self.path.clone();
        match self.model.as_str() {
            "gpt2" => {}
            "llama" => return self.build_spm(),
            _ => {
                return Err(ModelError::Unsupported {
                    path,
                    msg: format!(
                        "tokenizer model `{}` (only byte-level BPE, `gpt2`, and SentencePiece, `llama`, \
                         are supported)",
                        self.model
                    ),
                })
            }
        }
        let pre =
            GgufPreTokenizer::from_name(self.pre.as_deref()).ok_or_else(|| ModelError::Unsupported {
                path: path.clone(),
                msg: format!("pre-tokenizer type `{}`", self.pre.as_deref().unwrap_or("")),
            })?;
        if self.tokens.is_empty() {
            return Err(ModelError::format(&path, "tokenizer.ggml.tokens is empty"));
        }
        if !self.token_types.is_empty() && self.token_types.len() != self.tokens.len() {
            return Err(ModelError::format(
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
                    return Err(ModelError::format(
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
                .ok_or_else(|| ModelError::format(&path, format!("merge `{m}` is not two tokens")))?;
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
            return Err(ModelError::format(
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
        Tokenizer::assemble(Parts {
            model: Model::Hf(Box::new(tok)),
            source: path,
            bos_id: self.bos_id,
            bos_token: name(self.bos_id),
            eos_ids,
            eos_token: name(self.eos_id),
            add_bos: self.add_bos.unwrap_or(false),
            post_adds_bos: false,
            chat_template: self.chat_template,
        })
    }
}

impl GgufVocab {
    /// The SentencePiece tokenizer, with llama.cpp's defaults for what the file leaves out.
    fn build_spm(self) -> Result<Tokenizer> {
        let path = self.path;
        let n = self.tokens.len();
        // llama.cpp's defaults for a `llama` vocabulary, used only when they lie inside it.
        let default = |id: u32| ((id as usize) < n).then_some(id);
        let bos_id = self.bos_id.or_else(|| default(1));
        let eos_id = self.eos_id.or_else(|| default(2));
        let unk_id = self.unk_id.or_else(|| default(0));
        if let Some(id) = self.pad_id.filter(|&id| id as usize >= n) {
            return Err(ModelError::format(&path, format!("padding token id {id} >= vocabulary size {n}")));
        }
        let add_bos = self.add_bos.unwrap_or(true);
        let spm = Spm::new(SpmSpec {
            tokens: self.tokens,
            scores: self.scores,
            token_types: self.token_types,
            bos_id,
            eos_id,
            unk_id,
            extra_eog_ids: self.extra_eos_ids,
            add_bos,
            add_eos: self.add_eos.unwrap_or(false),
            add_space_prefix: self.add_space_prefix.unwrap_or(true),
            model_name: self.name,
        })
        .map_err(|e| ModelError::format(&path, e))?;
        let name = |id: Option<u32>| id.and_then(|i| spm.id_to_token(i)).map(str::to_owned);
        let (bos_token, eos_token) = (name(bos_id), name(eos_id));
        let eos_ids = spm.eog_ids().to_vec();
        Tokenizer::assemble(Parts {
            model: Model::Spm(Box::new(spm)),
            source: path,
            bos_id,
            bos_token,
            eos_ids,
            eos_token,
            add_bos,
            post_adds_bos: false,
            chat_template: self.chat_template,
        })
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
}
