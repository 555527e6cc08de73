//! Incremental detokenization: generated ids in, text deltas out.
//!
//! Invariants:
//! - Every delta is whole UTF-8 characters; a character split across ids (byte-level BPE tokens,
//!   SentencePiece `<0xHH>` byte tokens) comes out once the id that completes it arrives (or as
//!   U+FFFD from [`IncrementalDecoder::finish`]).
//! - The deltas of a sequence, concatenated, equal decoding all its ids at once (for byte-level
//!   BPE and SentencePiece GGUF vocabularies, exactly: a SentencePiece decoder drops the leading
//!   space of a window's first token in both decodings it compares).
//! - Memory stays bounded on long generations: ids before the decoding window are dropped.

use crate::error::{ModelError, Result};

use super::Tokenizer;

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
            return Err(ModelError::Tokenizer(format!(
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
