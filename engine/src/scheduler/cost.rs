//! What a step costs, and how much prompt work fits beside the decodes of one step.
//!
//! A step that decodes sequences is an inter-token gap for every one of them, so a prompt chunk
//! computed in the same step delays every running stream by its cost. With an inter-token
//! latency (ITL) target the engine sizes each step's prefill share so that the step's
//! *predicted* time stays within the target (the Sarathi-Serve idea of a per-step token budget,
//! here derived from time instead of fixed):
//!
//! `predicted = slowdown × (fixed + per_decode × decode_tokens + per_prefill × prefill_tokens)`
//!
//! - `fixed`, `per_decode` and `per_prefill` are measured once, at start-up, by
//!   [`super::Engine::calibrate_step_cost`]: timed passes of one decode token, of
//!   [`CALIBRATION_DECODES`] decode tokens, and of one prompt chunk, on this machine and this
//!   model;
//! - `slowdown` follows what steps actually take: after every step the ratio of its measured time
//!   to the prediction moves it ([`SLOWDOWN_WEIGHT`] per step, within
//!   [`SLOWDOWN_MIN`]..=[`SLOWDOWN_MAX`]), so cores taken by another process on the host, a
//!   longer context or a calibration that ran on a cold machine are all absorbed within a few
//!   steps.
//!
//! Rules ([`StepCost::prefill_limit`]):
//! - with no sequence decoding, a step has nobody to delay: prefill takes the whole
//!   `max_batch_tokens`;
//! - with decodes, prefill gets what fits in the target after them, but never fewer than
//!   [`MIN_PREFILL_CHUNK`] tokens (nor more than `max_batch_tokens` leaves after the decodes).
//!   So a target too tight for the decodes alone still lets prompts in: once a prompt of `P`
//!   tokens is admitted and at the head of the queue, it is computed within
//!   `ceil(P / MIN_PREFILL_CHUNK)` steps however many sequences decode, as long as
//!   `max_batch_tokens` leaves that many tokens beside the decodes and no preempted sequence
//!   goes before it.

use std::time::Duration;

/// Fewest prompt tokens a step may compute while sequences decode (when prompts wait).
pub const MIN_PREFILL_CHUNK: usize = 32;
/// Weight of one step's measured/predicted ratio in [`StepCost::slowdown`].
pub const SLOWDOWN_WEIGHT: f64 = 0.2;
/// Bounds of [`StepCost::slowdown`].
pub const SLOWDOWN_MIN: f64 = 0.25;
pub const SLOWDOWN_MAX: f64 = 8.0;
/// Decode tokens of the calibration's batched pass.
pub const CALIBRATION_DECODES: usize = 8;

/// The step-cost model (see the module documentation). Costs are in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    /// Cost of a pass beyond its tokens (launches, synchronisation, sampling).
    pub fixed_ms: f64,
    /// Cost of each decode (or verification) token.
    pub per_decode_ms: f64,
    /// Cost of each prompt token.
    pub per_prefill_ms: f64,
    /// Measured over predicted, averaged over recent steps (1: as calibrated).
    pub slowdown: f64,
}

/// Timings of the calibration passes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    /// A pass of one decode token.
    pub one_decode: Duration,
    /// A pass of `decode_tokens` decode tokens (one per sequence; [`CALIBRATION_DECODES`] when
    /// the pool and the token budget allow).
    pub decodes: Duration,
    pub decode_tokens: usize,
    /// A pass of one prompt chunk of `prefill_tokens` tokens.
    pub prefill: Duration,
    pub prefill_tokens: usize,
}

impl StepCost {
    /// The model the calibration's timings imply. Every coefficient stays positive, so a noisy
    /// measurement (a batched pass timed faster than a single one) never makes tokens free.
    pub fn from_calibration(c: &Calibration) -> StepCost {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let one = ms(c.one_decode).max(1e-3);
        let many = ms(c.decodes);
        // With one decode token only, nothing separates the fixed cost from the token's.
        let (per_decode, fixed) = if c.decode_tokens > 1 {
            let per = ((many - one) / (c.decode_tokens - 1) as f64).max(one * 0.01);
            (per, (one - per).max(0.0))
        } else {
            (one, 0.0)
        };
        let per_prefill = ((ms(c.prefill) - fixed) / c.prefill_tokens.max(1) as f64).max(1e-4);
        StepCost { fixed_ms: fixed, per_decode_ms: per_decode, per_prefill_ms: per_prefill, slowdown: 1.0 }
    }

    /// Predicted time of a step with `decode` decode or verification tokens and `prefill` prompt
    /// tokens.
    pub fn predict(&self, decode: usize, prefill: usize) -> Duration {
        let ms = self.slowdown * self.calibrated_ms(decode, prefill);
        Duration::from_secs_f64(ms.max(0.0) / 1e3)
    }

    /// The calibrated cost of a step, before the slowdown.
    fn calibrated_ms(&self, decode: usize, prefill: usize) -> f64 {
        self.fixed_ms + self.per_decode_ms * decode as f64 + self.per_prefill_ms * prefill as f64
    }

    /// Folds a finished step's measured time into [`Self::slowdown`].
    pub fn observe(&mut self, decode: usize, prefill: usize, took: Duration) {
        if decode + prefill == 0 {
            return;
        }
        let base = self.calibrated_ms(decode, prefill);
        if base <= 0.0 {
            return;
        }
        let ratio = (took.as_secs_f64() * 1e3 / base).clamp(SLOWDOWN_MIN, SLOWDOWN_MAX);
        self.slowdown = (self.slowdown * (1.0 - SLOWDOWN_WEIGHT) + ratio * SLOWDOWN_WEIGHT)
            .clamp(SLOWDOWN_MIN, SLOWDOWN_MAX);
    }

    /// Most prompt tokens a step with `decode` decode tokens may compute to stay within `target`
    /// (at least [`MIN_PREFILL_CHUNK`]); `None` when nothing decodes (no limit).
    pub fn prefill_limit(&self, target: Duration, decode: usize) -> Option<usize> {
        if decode == 0 {
            return None;
        }
        let target_ms = target.as_secs_f64() * 1e3 / self.slowdown;
        let left = target_ms - self.calibrated_ms(decode, 0);
        let fits = if left <= 0.0 { 0.0 } else { (left / self.per_prefill_ms).floor() };
        // `fits` is finite and non-negative; the cast saturates for a huge target.
        Some((fits as usize).max(MIN_PREFILL_CHUNK))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    fn model() -> StepCost {
        // 10 ms fixed, 2 ms per decode token, 0.5 ms per prompt token.
        StepCost::from_calibration(&Calibration {
            one_decode: ms(12),
            decodes: ms(26),
            decode_tokens: 8,
            prefill: ms(138),
            prefill_tokens: 256,
        })
    }

    #[test]
    fn calibration_gives_the_coefficients_its_timings_imply() {
        let m = model();
        assert!((m.fixed_ms - 10.0).abs() < 1e-9, "{m:?}");
        assert!((m.per_decode_ms - 2.0).abs() < 1e-9, "{m:?}");
        assert!((m.per_prefill_ms - 0.5).abs() < 1e-9, "{m:?}");
        assert_eq!(m.predict(4, 100), ms(68));
    }

    #[test]
    fn noisy_calibration_never_makes_tokens_free() {
        let m = StepCost::from_calibration(&Calibration {
            one_decode: ms(20),
            decodes: ms(15),
            decode_tokens: 8,
            prefill: ms(5),
            prefill_tokens: 256,
        });
        assert!(m.per_decode_ms > 0.0 && m.per_prefill_ms > 0.0 && m.fixed_ms >= 0.0, "{m:?}");
    }

    #[test]
    fn prefill_fills_what_the_target_leaves_after_the_decodes() {
        let m = model();
        assert_eq!(m.prefill_limit(ms(100), 0), None, "nothing decodes: no limit");
        // 100 - 10 - 2 * 10 = 70 ms left, 0.5 ms per token.
        assert_eq!(m.prefill_limit(ms(100), 10), Some(140));
        let step = m.predict(10, 140);
        assert!(step <= ms(100), "{step:?}");
        assert!(m.predict(10, 141) > ms(100));
        // More decodes, less prefill.
        assert!(m.prefill_limit(ms(100), 30).unwrap() < 140);
    }

    #[test]
    fn a_target_too_tight_still_lets_prompts_progress() {
        let m = model();
        assert_eq!(m.prefill_limit(ms(5), 40), Some(MIN_PREFILL_CHUNK));
        assert_eq!(m.prefill_limit(Duration::ZERO, 1), Some(MIN_PREFILL_CHUNK));
    }

    #[test]
    fn slow_steps_shrink_the_budget_and_fast_ones_grow_it_back() {
        let mut m = model();
        let calm = m.prefill_limit(ms(100), 10).unwrap();
        for _ in 0..30 {
            // Another process takes half the cores: every step takes twice its calibrated
            // 10 + 2 * 10 + 0.5 * 100 = 80 ms.
            m.observe(10, 100, ms(160));
        }
        assert!((m.slowdown - 2.0).abs() < 0.05, "{m:?}");
        let busy = m.prefill_limit(ms(100), 10).unwrap();
        assert!(busy < calm / 2, "busy {busy} calm {calm}");
        assert!(m.predict(10, busy) <= ms(100));
        for _ in 0..60 {
            m.observe(10, 100, ms(80));
        }
        assert!((m.slowdown - 1.0).abs() < 0.05, "{m:?}");
        let back = m.prefill_limit(ms(100), 10).unwrap();
        assert!(back.abs_diff(calm) <= 1, "back {back} calm {calm}");
    }

    #[test]
    fn one_wild_step_moves_the_model_only_within_bounds() {
        let mut m = model();
        m.observe(1, 0, Duration::from_secs(3600));
        assert!(m.slowdown <= SLOWDOWN_MAX && m.slowdown > 1.0, "{m:?}");
        m.observe(1, 0, Duration::ZERO);
        assert!(m.slowdown >= SLOWDOWN_MIN, "{m:?}");
        m.observe(0, 0, Duration::from_secs(1));
        let before = m;
        m.observe(0, 0, Duration::from_secs(100));
        assert_eq!(m, before, "an empty step says nothing");
    }
}
