//! What a revisit run measured: per round, and for the revisits (every round after the first)
//! together, sums and percentiles over the requests' outcomes, and the text table. Pure
//! arithmetic, no I/O.
//!
//! Invariants: token figures count finished requests only (a failed request reported nothing); a
//! request's cached tokens are capped at its prompt; a mean or a fraction without a finished
//! request or a prompt token is 0, never a division by zero; the revisits' percentiles are taken
//! over all their requests, not mixed from the rounds' percentiles.

use std::fmt::Write;

/// What one finished request reported.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Done {
    /// Client side: request sent → first token received.
    pub ttft_ms: f64,
    pub prompt_tokens: usize,
    /// `Usage.cached_tokens`: prompt tokens taken from the prefix cache or a KV tier behind it.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
}

/// One request: what it reported, or why it failed.
pub(crate) type Outcome = Result<Done, String>;

/// Nearest-rank percentiles of the time to first token.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub(crate) struct Ttft {
    pub p50: f64,
    pub p90: f64,
}

impl Ttft {
    /// Zeros when `v` is empty.
    pub fn of(v: &mut [f64]) -> Ttft {
        if v.is_empty() {
            return Ttft::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Ttft { p50: rank(0.50), p90: rank(0.90) }
    }
}

/// One round, or the revisits together.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub(crate) struct RoundReport {
    pub requests: usize,
    pub failed: usize,
    /// Of the finished requests, as the client saw it.
    pub ttft_ms: Ttft,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Cached tokens per finished request.
    pub cached_per_request: f64,
    /// Cached tokens over prompt tokens.
    pub cached_fraction: f64,
    pub output_tokens: usize,
    /// Output tokens over the wall time.
    pub output_tokens_per_s: f64,
    /// Wall time (the revisits: the sum of their rounds', which run one after the other).
    pub wall_s: f64,
    pub first_error: Option<String>,
}

impl RoundReport {
    pub fn of<'a>(outcomes: impl IntoIterator<Item = &'a Outcome>, wall_s: f64) -> RoundReport {
        let mut r = RoundReport { wall_s, ..RoundReport::default() };
        let mut ttft = Vec::new();
        for o in outcomes {
            r.requests += 1;
            match o {
                Ok(d) => {
                    ttft.push(d.ttft_ms);
                    r.prompt_tokens += d.prompt_tokens;
                    r.cached_tokens += d.cached_tokens.min(d.prompt_tokens);
                    r.output_tokens += d.output_tokens;
                }
                Err(e) => {
                    r.failed += 1;
                    r.first_error.get_or_insert_with(|| e.clone());
                }
            }
        }
        r.ttft_ms = Ttft::of(&mut ttft);
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        r.cached_per_request = ratio(r.cached_tokens as f64, ttft.len() as f64);
        r.cached_fraction = ratio(r.cached_tokens as f64, r.prompt_tokens as f64);
        r.output_tokens_per_s = ratio(r.output_tokens as f64, wall_s);
        r
    }

    pub fn finished(&self) -> usize {
        self.requests - self.failed
    }
}

/// A whole run: every round, and the revisits together.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct RunReport {
    /// Round 1 (the openings) first.
    pub rounds: Vec<RoundReport>,
    /// Rounds 2 and later together.
    pub revisits: RoundReport,
    /// Every request.
    pub all: RoundReport,
}

impl RunReport {
    /// `rounds[i]`: round `i`'s outcomes and wall time.
    pub fn new(rounds: &[(Vec<Outcome>, f64)]) -> RunReport {
        let later = rounds.get(1..).unwrap_or_default();
        RunReport {
            rounds: rounds.iter().map(|(o, s)| RoundReport::of(o, *s)).collect(),
            revisits: RoundReport::of(later.iter().flat_map(|(o, _)| o), later.iter().map(|(_, s)| s).sum()),
            all: RoundReport::of(rounds.iter().flat_map(|(o, _)| o), rounds.iter().map(|(_, s)| s).sum()),
        }
    }
}

/// The table: one row per round, then the revisits together.
pub(crate) fn table(run: &RunReport) -> String {
    let mut s = String::new();
    s.push_str(
        "| round | requests | failed | TTFT p50 ms | TTFT p90 ms | cached tokens / request | cached % of prompt | output tok/s | time s |\n",
    );
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let n = run.rounds.len();
    let named = run.rounds.iter().enumerate().map(|(i, r)| (format!("{}", i + 1), r));
    let revisits = (n > 1).then(|| (if n == 2 { "2".to_string() } else { format!("2-{n}") }, &run.revisits));
    for (name, r) in named.chain(revisits) {
        let ms = |x: f64| if r.finished() > 0 { format!("{x:.1}") } else { "-".to_string() };
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} | {:.1} | {:.1}% | {:.1} | {:.1} |",
            r.requests,
            r.failed,
            ms(r.ttft_ms.p50),
            ms(r.ttft_ms.p90),
            r.cached_per_request,
            100.0 * r.cached_fraction,
            r.output_tokens_per_s,
            r.wall_s
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(ttft_ms: f64, prompt_tokens: usize, cached_tokens: usize) -> Outcome {
        Ok(Done { ttft_ms, prompt_tokens, cached_tokens, output_tokens: 16 })
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut v: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        assert_eq!(Ttft::of(&mut v), Ttft { p50: 5.0, p90: 9.0 });
        assert_eq!(Ttft::of(&mut [7.0]), Ttft { p50: 7.0, p90: 7.0 });
        assert_eq!(Ttft::of(&mut [3.0, 1.0]), Ttft { p50: 1.0, p90: 3.0 });
        assert_eq!(Ttft::of(&mut []), Ttft::default());
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(Ttft::of(&mut v), Ttft { p50: 50.0, p90: 90.0 });
    }

    #[test]
    fn a_round_sums_finished_requests_and_counts_failures() {
        let outcomes = [done(10.0, 100, 64), Err("boom".into()), done(30.0, 50, 0), Err("later".into())];
        let r = RoundReport::of(&outcomes, 2.0);
        assert_eq!((r.requests, r.failed, r.finished()), (4, 2, 2));
        assert_eq!((r.prompt_tokens, r.cached_tokens, r.output_tokens), (150, 64, 32));
        assert_eq!(r.ttft_ms, Ttft { p50: 10.0, p90: 30.0 });
        assert_eq!(r.cached_per_request, 32.0, "per finished request");
        assert_eq!(r.cached_fraction, 64.0 / 150.0);
        assert_eq!(r.output_tokens_per_s, 16.0);
        assert_eq!(r.first_error.as_deref(), Some("boom"));
        // Cached tokens are capped at the prompt.
        assert_eq!(RoundReport::of(&[done(1.0, 40, 48)], 1.0).cached_tokens, 40);
    }

    #[test]
    fn nothing_finished_gives_zeros_not_nan() {
        let r = RoundReport::of(&[Err("down".into())], 0.0);
        assert_eq!((r.cached_per_request, r.cached_fraction, r.output_tokens_per_s), (0.0, 0.0, 0.0));
        assert_eq!(RoundReport::of(&[], 0.0), RoundReport::default());
    }

    #[test]
    fn revisits_are_every_round_after_the_first_together() {
        let rounds = vec![
            (vec![done(500.0, 512, 0), done(600.0, 512, 0)], 4.0),
            (vec![done(20.0, 560, 512), done(400.0, 560, 0)], 2.0),
            (vec![done(30.0, 608, 560), Err("x".into())], 1.0),
        ];
        let run = RunReport::new(&rounds);
        assert_eq!(run.rounds.len(), 3);
        assert_eq!(run.rounds[0].cached_tokens, 0);
        let v = &run.revisits;
        assert_eq!((v.requests, v.failed), (4, 1));
        assert_eq!((v.prompt_tokens, v.cached_tokens), (560 + 560 + 608, 512 + 560));
        assert_eq!(v.wall_s, 3.0);
        assert_eq!(v.output_tokens_per_s, 48.0 / 3.0);
        // Over the union: 20, 30, 400.
        assert_eq!(v.ttft_ms, Ttft { p50: 30.0, p90: 400.0 });
        assert_eq!(run.all.requests, 6);
        assert_eq!(run.all.wall_s, 7.0);
        // A single round has no revisits.
        let one = RunReport::new(&rounds[..1]);
        assert_eq!(one.revisits, RoundReport::default());
        assert_eq!(table(&one).lines().count(), 3);
    }

    #[test]
    fn the_table_has_a_row_per_round_then_the_revisits() {
        let rounds = vec![
            (vec![done(500.0, 512, 0)], 2.0),
            (vec![done(20.0, 560, 512)], 1.0),
            (vec![Err("x".into())], 0.5),
        ];
        let t = table(&RunReport::new(&rounds));
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 6);
        assert_eq!(lines[2], "| 1 | 1 | 0 | 500.0 | 500.0 | 0.0 | 0.0% | 8.0 | 2.0 |");
        assert_eq!(lines[3], "| 2 | 1 | 0 | 20.0 | 20.0 | 512.0 | 91.4% | 16.0 | 1.0 |");
        assert_eq!(lines[4], "| 3 | 1 | 1 | - | - | 0.0 | 0.0% | 0.0 | 0.5 |");
        assert_eq!(lines[5], "| 2-3 | 2 | 1 | 20.0 | 20.0 | 512.0 | 91.4% | 10.7 | 1.5 |");
    }
}
