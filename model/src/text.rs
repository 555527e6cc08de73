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
use crate::stop::{FinishReason, StopStrings};
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

/// What a run of tokens from the worker that generated them added ([`TextOutput::feed`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fed {
    /// Leading tokens of the run that are the client's: all of them, or up to and including
    /// the one that completed a stop string (the worker made the rest past the stop).
    pub taken: usize,
    /// Text now safe to show; once the sequence ended, with what was held back.
    pub text: String,
    /// Why the sequence ended, if it did: the worker's token rule, or a stop string.
    pub finish: Option<FinishReason>,
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

    /// Adds a run of tokens as the worker that generated them streamed it, with the token rule
    /// the worker ended the sequence by, if it did (`finish`). The rules of text at the edge,
    /// written once for the router and for the in-process `generate`:
    /// - an EOS or stop-token finish means the run's last token is that token: it is taken
    ///   (counted) and its text is never shown;
    /// - a stop string ends the sequence at the token that completes it, whatever the worker
    ///   said, and the tokens after it are not taken;
    /// - once the sequence ends, the text includes what was held back ([`Self::finish`]).
    ///
    /// An error when the tokenizer cannot decode a token.
    pub fn feed(&mut self, tokens: &[u32], finish: Option<FinishReason>) -> Result<Fed> {
        let mut fed = Fed::default();
        if let Some(stop) = self.stopped() {
            fed.finish = Some(FinishReason::StopString(stop.to_owned()));
            return Ok(fed);
        }
        let stop_token = matches!(finish, Some(FinishReason::Eos | FinishReason::StopToken(_)));
        for (i, &token) in tokens.iter().enumerate() {
            fed.taken += 1;
            if stop_token && i + 1 == tokens.len() {
                break;
            }
            let pushed = self.push(token)?;
            fed.text.push_str(&pushed.text);
            if let Some(stop) = pushed.stop {
                fed.finish = Some(FinishReason::StopString(stop));
                return Ok(fed);
            }
        }
        if finish.is_some() {
            fed.text.push_str(&self.finish());
            fed.finish = finish;
        }
        Ok(fed)
    }

    /// The stop string generated, once one was.
    pub fn stopped(&self) -> Option<&str> {
        self.stops.matched()
    }
}
