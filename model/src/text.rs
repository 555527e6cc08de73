//! Where generated token ids become text: the incremental detokenizer and the stop strings,
//! composed once ([`TextOutput`]). The router runs it for every request it streams; `tandem
//! generate` and the engine's `Engine::generate` run the same piece in process. Workers never make text: they stream token ids and apply the token
//! rules ([`crate::stop::TokenStop`]).
//!
//! Invariants:
//! - No text after a stop string is ever returned, and the stop string itself never is.
//! - The text returned, concatenated, does not depend on how the tokens were batched.
//! - A token that a token rule ended the sequence with (EOS, a stop token) is not pushed: its
//!   text is never shown. [`TextOutput::finish`] then releases what was held back.

use crate::error::Result;
use crate::stop::StopStrings;
use crate::tokenizer::{IncrementalDecoder, Tokenizer};

/// One request's generated text: token ids in, text safe to show out.
#[derive(Debug, Clone)]
pub struct TextOutput {
    decoder: IncrementalDecoder,
    stops: StopStrings,
}

/// What one token added.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pushed {
    /// Text now safe to show (often empty: a partial character, or a possible stop string).
    pub text: String,
    /// The stop string this token completed: the sequence ends here, and no later token is
    /// the client's.
    pub stop: Option<String>,
}

impl TextOutput {
    /// The text of a sequence that continues `prompt` (its last ids give the detokenizer its
    /// context), ended by any of `stop_strings`. Special tokens are not shown.
    pub fn new(tok: &Tokenizer, prompt: &[u32], stop_strings: &[String]) -> TextOutput {
        TextOutput {
            decoder: IncrementalDecoder::new(tok, prompt, true),
            stops: StopStrings::new(stop_strings),
        }
    }

    /// Adds one generated token that no token rule ended the sequence with. An error when the
    /// tokenizer cannot decode the id (a model whose embedding rows outnumber its vocabulary).
    /// After a stop string, returns nothing and repeats it.
    pub fn push(&mut self, token: u32) -> Result<Pushed> {
        if let Some(m) = self.stops.matched() {
            return Ok(Pushed { text: String::new(), stop: Some(m.to_owned()) });
        }
        let delta = self.decoder.push(token)?;
        let (text, stop) = self.stops.push(&delta);
        Ok(Pushed { text, stop })
    }

    /// The text held back when the sequence ends for any reason but a stop string: the possible
    /// start of a stop string that never completed, and the bytes of a character the stream
    /// ended inside (as U+FFFD). Empty after a stop string.
    pub fn finish(&mut self) -> String {
        if self.stops.matched().is_some() {
            return String::new();
        }
        let mut text = self.stops.flush();
        text.push_str(&self.decoder.finish().unwrap_or_default());
        text
    }

    /// The stop string generated, once one was.
    pub fn stopped(&self) -> Option<&str> {
        self.stops.matched()
    }
}
