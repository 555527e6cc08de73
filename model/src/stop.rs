//! When generation ends: the token rules ([`TokenStop`]), which the worker that generates a
//! token applies, and stop strings ([`StopStrings`]), which apply where tokens become text (the
//! router, or [`crate::text::TextOutput`] in process).
//!
//! Invariant: [`StopStrings`] never emits text that could still turn out to be part of a stop
//! string, and never emits a stop string itself; the emitted text does not depend on how the
//! generated text was split into deltas.

use crate::request::SamplingParams;

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` tokens were generated.
    Length,
    /// The model produced one of its EOS tokens (and `ignore_eos` was off).
    Eos,
    /// The model produced one of the request's stop tokens.
    StopToken(u32),
    /// The generated text contained this stop string.
    StopString(String),
}

impl FinishReason {
    /// The OpenAI-style name: `"length"` or `"stop"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Eos | FinishReason::StopToken(_) | FinishReason::StopString(_) => "stop",
        }
    }
}

/// The token rules that end a sequence: `max_tokens`, the model's EOS tokens (unless
/// `ignore_eos`) and the request's stop tokens. The worker that generates a token applies them,
/// once; stop strings are text and belong to [`StopStrings`], applied where tokens become text.
#[derive(Debug, Clone)]
pub struct TokenStop {
    max_tokens: usize,
    eos_token_ids: Vec<u32>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    generated: usize,
    finished: Option<FinishReason>,
}

impl TokenStop {
    /// The rules of `params`; `eos_token_ids` are the model's end-of-sequence tokens.
    pub fn new(params: &SamplingParams, eos_token_ids: &[u32]) -> Self {
        TokenStop {
            max_tokens: params.max_tokens,
            eos_token_ids: eos_token_ids.to_vec(),
            stop_token_ids: params.stop_token_ids.clone(),
            ignore_eos: params.ignore_eos,
            generated: 0,
            finished: None,
        }
    }

    /// Records one generated token; `Some(reason)` once the sequence must end (the token that
    /// ends it is counted). After the end, further calls count nothing and repeat the reason.
    pub fn push(&mut self, token: u32) -> Option<FinishReason> {
        if self.finished.is_some() {
            return self.finished.clone();
        }
        self.generated += 1;
        let reason = if !self.ignore_eos && self.eos_token_ids.contains(&token) {
            Some(FinishReason::Eos)
        } else if self.stop_token_ids.contains(&token) {
            Some(FinishReason::StopToken(token))
        } else if self.generated >= self.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        self.finished = reason.clone();
        reason
    }

    /// Whether generating `token` would end the sequence by itself (an EOS token unless
    /// `ignore_eos`, or a stop token).
    pub fn is_stop_token(&self, token: u32) -> bool {
        (!self.ignore_eos && self.eos_token_ids.contains(&token)) || self.stop_token_ids.contains(&token)
    }

    /// Tokens that may still be generated before `max_tokens` ends the sequence.
    pub fn tokens_left(&self) -> usize {
        self.max_tokens.saturating_sub(self.generated)
    }

    /// Tokens pushed before the sequence ended (the one that ended it included).
    pub fn generated_tokens(&self) -> usize {
        self.generated
    }
}

/// Stop strings over generated text: decides which text may be shown and whether a stop string
/// was generated.
///
/// Stop strings are matched against generated text only. When several could match, the one that
/// is completed earliest in the text wins (ties → the one starting earliest, i.e. the longest),
/// which is what a token-by-token stream observes whatever the delta boundaries. After a match,
/// further `push` calls emit nothing and repeat the match.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stop_strings: Vec<String>,
    /// Text not yet emitted: the longest suffix that may still begin a stop string.
    held: String,
    matched: Option<String>,
}

impl StopStrings {
    /// A matcher for `stop_strings` (empty strings are ignored).
    pub fn new(stop_strings: &[String]) -> Self {
        StopStrings {
            stop_strings: stop_strings.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// Adds generated text. Returns the text now safe to show and, once the text holds a stop
    /// string, that string (the text before it is shown; the stop string and anything after it
    /// never are).
    pub fn push(&mut self, text_delta: &str) -> (String, Option<String>) {
        if let Some(m) = &self.matched {
            return (String::new(), Some(m.clone()));
        }
        self.held.push_str(text_delta);
        if let Some((start, idx)) = self.earliest_stop_match() {
            let mut out = std::mem::take(&mut self.held);
            out.truncate(start);
            let stop = self.stop_strings[idx].clone();
            self.matched = Some(stop.clone());
            return (out, Some(stop));
        }
        let keep_from = self.held_back_start();
        let tail = self.held.split_off(keep_from);
        let out = std::mem::replace(&mut self.held, tail);
        (out, None)
    }

    /// Releases the text held back (when the stream ends for another reason: a token rule, the
    /// length limit or an error). Empty after a match.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The stop string generated, once one was.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// The match in `held` that ends first (ties → starts first): (start byte, stop string index).
    fn earliest_stop_match(&self) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None; // (end, start, idx)
        for (idx, stop) in self.stop_strings.iter().enumerate() {
            // The first occurrence of a given string also ends first.
            if let Some(start) = self.held.find(stop.as_str()) {
                let key = (start + stop.len(), start, idx);
                if best.is_none_or(|b| (key.0, key.1) < (b.0, b.1)) {
                    best = Some(key);
                }
            }
        }
        best.map(|(_, start, idx)| (start, idx))
    }

    /// Byte offset of the longest suffix of `held` that is a proper prefix of some stop string
    /// (`held.len()` when none is). Held text never contains a whole stop string here.
    fn held_back_start(&self) -> usize {
        let bytes = self.held.as_bytes();
        let longest = self.stop_strings.iter().map(|s| s.len()).max().unwrap_or(0);
        let lowest = bytes.len().saturating_sub(longest.saturating_sub(1));
        (lowest..bytes.len())
            .filter(|&i| self.held.is_char_boundary(i))
            .find(|&i| {
                let suffix = &bytes[i..];
                self.stop_strings.iter().any(|s| s.as_bytes().starts_with(suffix))
            })
            .unwrap_or(bytes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_back_start_respects_char_boundaries() {
        let mut c = StopStrings::new(&["é!".into()]);
        assert_eq!(c.push("aé"), ("a".to_string(), None));
        assert_eq!(c.push("?"), ("é?".to_string(), None));
    }
}
