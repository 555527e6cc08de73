//! Verification of one sequence's draft tokens against the target model.
//!
//! The target's logits come from one staged pass over `[last, d1..dk]`: row `i` is the target's
//! distribution for the token after `d1..di`. Verification walks the rows in order, drawing the
//! target's token at each with the request's own sampler (repetition penalty over everything
//! accepted so far, temperature, top-k/p, min-p, exactly one RNG draw per token) and stops at the
//! first token that differs from the draft; that token is kept (a correction, or after `k` hits
//! the bonus token), so a pass always yields at least one token.
//!
//! **Why the output is exactly the target's.** Our drafters are deterministic: given the tokens so
//! far they propose one token `d`, i.e. a draft distribution `q` that puts all its mass on `d`.
//! Rejection sampling with such a `q` accepts `d` with probability `min(1, p(d)/q(d)) = p(d)` and
//! otherwise draws from `max(p − q, 0)` normalised, which is `p` restricted to tokens other than
//! `d`. Drawing `t ~ p` and accepting exactly when `t = d` has the same law: `t = d` with
//! probability `p(d)`, and given `t ≠ d`, `t` is distributed as `p` without `d`. It also uses the
//! same single draw per token as decoding without speculation, so a seeded request produces the
//! *same tokens* with speculation on or off, not just the same distribution; greedy requests are
//! the special case with no draw at all.
//!
//! **Sampled drafts** (a draft model drawing its drafts from its own distribution `q`,
//! [`super::SpecOptions::sampled_drafts`]) use the general rule at each draft row: the callback
//! accepts the draft with probability `min(1, p(d)/q(d))` and otherwise draws from
//! `max(p − q, 0)` ([`crate::sampler::Sampler::sample_against_draft`]); that draw is never the
//! draft, so "the emitted token equals the draft" still says whether it was accepted, and this
//! walk is unchanged. The output keeps the target's distribution but not the exact tokens of a
//! run without speculation.

/// What verifying one sequence's drafts produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Tokens emitted (at least 1 unless `next` failed on the first).
    pub emitted: usize,
    /// Draft tokens accepted (emitted tokens equal to the draft at their position). When the
    /// sequence stopped on an accepted token, that token counts.
    pub accepted: usize,
}

/// What [`verify`]'s callback did with the target's token at one position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drawn {
    /// The target's token at this position.
    pub token: u32,
    /// The sequence must stop after this token (a stop rule, the length limit).
    pub stop: bool,
}

/// Walks the verification rows: `next(i)` draws (and records) the target's token at row `i`, given
/// that `drafts[..i]` were accepted. Stops after the first token that differs from the draft, after
/// the bonus token (row `drafts.len()`), or when `next` says the sequence stops.
pub fn verify<E>(drafts: &[u32], mut next: impl FnMut(usize) -> Result<Drawn, E>) -> Result<Outcome, E> {
    let mut accepted = 0;
    for i in 0..=drafts.len() {
        let drawn = next(i)?;
        let hit = drafts.get(i) == Some(&drawn.token);
        if hit {
            accepted += 1;
        }
        if !hit || drawn.stop {
            return Ok(Outcome { emitted: i + 1, accepted });
        }
    }
    unreachable!("the bonus row never matches a draft")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(drafts: &[u32], target: &[u32], stop_at: Option<usize>) -> (Outcome, Vec<u32>) {
        let mut seen = Vec::new();
        let out = verify::<()>(drafts, |i| {
            seen.push(target[i]);
            Ok(Drawn { token: target[i], stop: stop_at == Some(i) })
        })
        .unwrap();
        (out, seen)
    }

    #[test]
    fn accepts_the_matching_prefix_then_keeps_the_targets_token() {
        let (o, seen) = run(&[5, 6, 7], &[5, 6, 9, 1], None);
        assert_eq!(o, Outcome { emitted: 3, accepted: 2 });
        assert_eq!(seen, [5, 6, 9]);
    }

    #[test]
    fn all_accepted_adds_the_bonus_token() {
        let (o, seen) = run(&[5, 6], &[5, 6, 8], None);
        assert_eq!(o, Outcome { emitted: 3, accepted: 2 });
        assert_eq!(seen, [5, 6, 8]);
    }

    #[test]
    fn first_rejected_and_no_drafts_emit_one_token() {
        assert_eq!(run(&[5], &[4, 0], None).0, Outcome { emitted: 1, accepted: 0 });
        assert_eq!(run(&[], &[4], None).0, Outcome { emitted: 1, accepted: 0 });
    }

    #[test]
    fn a_stop_cuts_the_accepted_run() {
        let (o, seen) = run(&[5, 6, 7], &[5, 6, 7, 8], Some(1));
        assert_eq!(o, Outcome { emitted: 2, accepted: 2 });
        assert_eq!(seen, [5, 6], "nothing is drawn after the stop");
    }

    #[test]
    fn an_error_stops_at_once() {
        let mut calls = 0;
        let r = verify(&[1, 2], |i| {
            calls += 1;
            if i == 1 {
                Err("boom")
            } else {
                Ok(Drawn { token: 1, stop: false })
            }
        });
        assert_eq!(r, Err("boom"));
        assert_eq!(calls, 2);
    }
}
