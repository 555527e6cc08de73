//! When generation ends, and which generated text may be shown ([`StopChecker`]).
//!
//! Invariant: the checker never emits text that could still turn out to be part of a stop string,
//! and never emits a stop string itself; the emitted text does not depend on how the generated
//! text was split into deltas.

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

/// Decides when generation ends and which text may be released to the client.
///
/// Stop strings are matched against generated text only. When several could match, the one that is
/// completed earliest in the text wins (ties → the one starting earliest, i.e. the longest), which is
/// what a token-by-token stream observes whatever the delta boundaries. After a stop, further
/// `push` calls emit nothing and repeat the reason.
#[derive(Debug, Clone)]
pub struct StopChecker {
    max_tokens: usize,
    eos_token_ids: Vec<u32>,
    stop_token_ids: Vec<u32>,
    stop_strings: Vec<String>,
    ignore_eos: bool,
    /// Text not yet emitted: the longest suffix that may still begin a stop string.
    held: String,
    generated: usize,
    finished: Option<FinishReason>,
}

impl StopChecker {
    /// A checker for `params`; `eos_token_ids` are the model's end-of-sequence tokens.
    pub fn new(params: &SamplingParams, eos_token_ids: &[u32]) -> Self {
        StopChecker {
            max_tokens: params.max_tokens,
            eos_token_ids: eos_token_ids.to_vec(),
            stop_token_ids: params.stop_token_ids.clone(),
            stop_strings: params.stop_strings.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ignore_eos: params.ignore_eos,
            held: String::new(),
            generated: 0,
            finished: None,
        }
    }

    /// Records one generated token and the text it produced (possibly empty). Returns the text now
    /// safe to emit and `Some(reason)` once generation must stop.
    pub fn push(&mut self, token: u32, text_delta: &str) -> (String, Option<FinishReason>) {
        if let Some(reason) = &self.finished {
            return (String::new(), Some(reason.clone()));
        }
        self.generated += 1;

        let token_reason = if !self.ignore_eos && self.eos_token_ids.contains(&token) {
            Some(FinishReason::Eos)
        } else if self.stop_token_ids.contains(&token) {
            Some(FinishReason::StopToken(token))
        } else {
            None
        };
        if let Some(reason) = token_reason {
            // The token's own text is dropped; what was held back can no longer become a stop string.
            let out = std::mem::take(&mut self.held);
            return self.finish(out, reason);
        }

        self.held.push_str(text_delta);
        if let Some((start, idx)) = self.earliest_stop_match() {
            let mut out = std::mem::take(&mut self.held);
            out.truncate(start);
            let reason = FinishReason::StopString(self.stop_strings[idx].clone());
            return self.finish(out, reason);
        }
        if self.generated >= self.max_tokens {
            let out = std::mem::take(&mut self.held);
            return self.finish(out, FinishReason::Length);
        }

        let keep_from = self.held_back_start();
        let tail = self.held.split_off(keep_from);
        let out = std::mem::replace(&mut self.held, tail);
        (out, None)
    }

    /// Releases the text held back (for when the stream ends for another reason, e.g. an error).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Whether generating `token` would end the sequence by itself (an EOS token unless
    /// `ignore_eos`, or a stop token). Stop strings depend on text and are not considered.
    pub fn is_stop_token(&self, token: u32) -> bool {
        (!self.ignore_eos && self.eos_token_ids.contains(&token)) || self.stop_token_ids.contains(&token)
    }

    /// Tokens that may still be generated before `max_tokens` ends the sequence.
    pub fn tokens_left(&self) -> usize {
        self.max_tokens.saturating_sub(self.generated)
    }

    /// Tokens pushed before generation finished (the finishing token included).
    pub fn generated_tokens(&self) -> usize {
        self.generated
    }

    fn finish(&mut self, out: String, reason: FinishReason) -> (String, Option<FinishReason>) {
        self.finished = Some(reason.clone());
        (out, Some(reason))
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
        let params = SamplingParams { stop_strings: vec!["é!".into()], ..Default::default() };
        let mut c = StopChecker::new(&params, &[]);
        assert_eq!(c.push(1, "aé"), ("a".to_string(), None));
        assert_eq!(c.push(1, "?"), ("é?".to_string(), None));
    }
}
