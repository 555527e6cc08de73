//! Prompt lookup: propose the continuation of the longest earlier match of the sequence's newest
//! tokens. Costs no model and no memory; it pays off wherever the output repeats the input
//! (quoting, editing, summarising with the source's words, code).

use super::{DraftAsk, Drafter, SpecMethod};
use crate::error::Result;
use crate::kv::SeqId;

/// The n-gram (prompt lookup) drafter.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    min: usize,
    max: usize,
}

impl NgramDrafter {
    /// Looks up suffixes of `min..=max` tokens, the longest first (`1 <= min <= max`).
    pub fn new(min: usize, max: usize) -> NgramDrafter {
        let min = min.max(1);
        NgramDrafter { min, max: max.max(min) }
    }
}

/// Up to `limit` tokens that followed the most recent earlier occurrence of the longest suffix of
/// `tokens` of `min..=max` tokens that occurs earlier; empty when none does.
pub fn lookup(tokens: &[u32], min: usize, max: usize, limit: usize) -> Vec<u32> {
    let len = tokens.len();
    if limit == 0 {
        return Vec::new();
    }
    for n in (min.max(1)..=max).rev() {
        if n >= len {
            continue;
        }
        let suffix = &tokens[len - n..];
        // Most recent earlier occurrence: start positions len-n-1 down to 0.
        if let Some(start) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix) {
            let from = start + n;
            let to = (from + limit).min(len);
            return tokens[from..to].to_vec();
        }
    }
    Vec::new()
}

impl Drafter for NgramDrafter {
    fn method(&self) -> SpecMethod {
        SpecMethod::Ngram
    }

    fn describe(&self) -> String {
        format!("ngram {}..{}", self.min, self.max)
    }

    fn propose(&mut self, asks: &[DraftAsk<'_>]) -> Result<Vec<Vec<u32>>> {
        Ok(asks.iter().map(|a| lookup(a.tokens, self.min, self.max, a.max)).collect())
    }

    fn forget(&mut self, _seq: SeqId) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_most_recent_match_wins() {
        // Suffix [1, 2, 3]: the 3-gram occurs at 0 (followed by 9) and the 2-gram [2, 3] also at
        // 5 (followed by 7); the longest match is taken even though a shorter one is more recent.
        let t = [1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3];
        assert_eq!(lookup(&t, 1, 3, 4), vec![9, 8, 2, 3]);
        // With at most 2-grams, the most recent [2, 3] wins.
        assert_eq!(lookup(&t, 1, 2, 2), vec![7, 1]);
    }

    #[test]
    fn continuation_stops_at_the_end_and_at_the_limit() {
        let t = [5, 6, 5, 6];
        // [5, 6] occurred at 0; what followed is [5, 6] (overlapping the suffix itself).
        assert_eq!(lookup(&t, 2, 2, 8), vec![5, 6]);
        assert_eq!(lookup(&t, 2, 2, 1), vec![5]);
        assert_eq!(lookup(&t, 2, 2, 0), Vec::<u32>::new());
    }

    #[test]
    fn nothing_when_no_suffix_recurs() {
        assert!(lookup(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(lookup(&[7], 1, 3, 4).is_empty());
        assert!(lookup(&[], 1, 3, 4).is_empty());
        // A 1-gram match is ignored when the minimum is 2.
        assert!(lookup(&[4, 1, 2, 4], 2, 3, 4).is_empty());
        assert_eq!(lookup(&[4, 1, 2, 4], 1, 3, 4), vec![1, 2, 4]);
    }
}
