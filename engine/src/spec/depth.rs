//! How many draft tokens a sequence proposes this step.
//!
//! With adaptive depth, each sequence keeps a moving average of its per-token acceptance rate
//! `a` (the chance a draft token is accepted given the ones before it were). The `j`-th draft token
//! is then accepted with probability about `a^j`, and it is worth verifying while that beats the
//! marginal cost of one more token in the pass, which grows with the batch: on a lone sequence a
//! verification pass costs little more than a decode step (the weights are read once either way),
//! while in a full batch every extra token is compute the other sequences wait for. A sequence
//! whose rate falls so low that it drafts nothing probes with one token every [`PROBE_EVERY`]
//! steps, so a sequence that turns repetitive later is noticed.
//!
//! The planner applies the step's other limits afterwards: the token budget, and free KV blocks
//! (it never preempts or takes the blocks other sequences need in order to speculate).

use super::SpecOptions;

/// Rate a new sequence starts from.
pub const PRIOR_RATE: f64 = 0.6;
/// Weight of the newest observation in the moving average.
pub const RATE_WEIGHT: f64 = 0.3;
/// A sequence drafting nothing proposes one token every this many steps.
pub const PROBE_EVERY: u32 = 8;

/// One sequence's depth state.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqDepth {
    rate: f64,
    idle_steps: u32,
}

impl Default for SeqDepth {
    fn default() -> Self {
        SeqDepth { rate: PRIOR_RATE, idle_steps: 0 }
    }
}

/// The acceptance probability the `j`-th draft token must reach to be worth verifying when
/// `running` sequences decode together.
pub fn cost_threshold(running: usize) -> f64 {
    (0.05 + 0.1 * running as f64).min(0.9)
}

impl SeqDepth {
    /// The moving average of the per-token acceptance rate.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Records a verification: `accepted` of `proposed` draft tokens. Acceptance stops at the
    /// first rejection, so the tokens that were really tried are the accepted ones plus the one
    /// rejected (if any).
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        let tried = (accepted + 1).min(proposed);
        let est = accepted.min(tried) as f64 / tried as f64;
        self.rate = (1.0 - RATE_WEIGHT) * self.rate + RATE_WEIGHT * est;
    }

    /// Draft tokens to ask for this step, with `running` sequences decoding.
    pub fn want(&mut self, opts: &SpecOptions, running: usize) -> usize {
        if !opts.adaptive {
            return opts.max_draft;
        }
        let threshold = cost_threshold(running);
        let mut k = 0;
        let mut p = 1.0;
        while k < opts.max_draft {
            p *= self.rate;
            if p < threshold {
                break;
            }
            k += 1;
        }
        if k > 0 {
            self.idle_steps = 0;
            return k;
        }
        self.idle_steps += 1;
        if self.idle_steps >= PROBE_EVERY {
            self.idle_steps = 0;
            return 1;
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(adaptive: bool) -> SpecOptions {
        SpecOptions { max_draft: 6, adaptive, ..Default::default() }
    }

    #[test]
    fn fixed_depth_ignores_rate_and_batch() {
        let mut d = SeqDepth::default();
        for _ in 0..20 {
            d.observe(6, 0);
        }
        assert_eq!(d.want(&opts(false), 64), 6);
    }

    #[test]
    fn high_acceptance_drafts_deep_and_low_acceptance_backs_off() {
        let mut d = SeqDepth::default();
        for _ in 0..30 {
            d.observe(6, 6);
        }
        assert!(d.rate() > 0.99);
        assert_eq!(d.want(&opts(true), 1), 6);
        for _ in 0..30 {
            d.observe(6, 0);
        }
        assert!(d.rate() < 0.01);
        assert_eq!(d.want(&opts(true), 1), 0);
    }

    #[test]
    fn a_bigger_batch_drafts_fewer_tokens() {
        let mut d = SeqDepth::default();
        for _ in 0..30 {
            d.observe(4, 3); // 3 of 4 tried accepted: rate 0.75
        }
        let lone = d.want(&opts(true), 1);
        let crowded = d.want(&opts(true), 8);
        assert!(lone > crowded, "lone {lone}, crowded {crowded}");
        assert!(crowded <= 1);
    }

    #[test]
    fn a_sequence_that_drafts_nothing_probes_now_and_then() {
        let mut d = SeqDepth::default();
        for _ in 0..30 {
            d.observe(4, 0);
        }
        let asks: Vec<usize> = (0..2 * PROBE_EVERY).map(|_| d.want(&opts(true), 1)).collect();
        assert_eq!(asks.iter().filter(|&&k| k == 1).count(), 2, "{asks:?}");
        assert_eq!(asks.iter().filter(|&&k| k > 1).count(), 0, "{asks:?}");
    }

    #[test]
    fn tried_tokens_stop_at_the_first_rejection() {
        let mut d = SeqDepth { rate: 0.5, idle_steps: 0 };
        // 2 of 8 accepted: 3 were tried (2 accepted, 1 rejected), the rest never were.
        d.observe(8, 2);
        let expected = 0.7 * 0.5 + 0.3 * (2.0 / 3.0);
        assert!((d.rate() - expected).abs() < 1e-12);
    }
}
