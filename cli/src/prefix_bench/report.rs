//! What a shared-prefix run measured: per phase and per part, sums and percentiles over the
//! requests' outcomes, the comparison of the cache-on phase with the cache-off baseline, and the
//! text tables. Pure arithmetic, no I/O.
//!
//! Invariants: token and byte figures count finished requests only (a failed request reported
//! nothing); `computed + cached = prompt` for every part, with a request's cached tokens capped at
//! its prompt; a ratio whose baseline is zero or missing is `None` (printed `-`), never a division
//! by zero.

use std::fmt::Write;

use super::workload::Phase;
use crate::loadgen::Percentiles;

/// What one finished request reported.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Done {
    /// Client side: request sent → first token received.
    pub ttft_ms: f64,
    pub prompt_tokens: usize,
    /// `Usage.cached_tokens`: prompt tokens taken from the prefix cache instead of computed.
    pub cached_tokens: usize,
    /// `Timings.transfer_bytes`: KV bytes moved to the decode worker.
    pub transfer_bytes: u64,
}

/// One request: what it reported, or why it failed.
pub(crate) type Outcome = Result<Done, String>;

/// One part of one phase (or both parts together).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub(crate) struct PartReport {
    pub requests: usize,
    pub failed: usize,
    /// Time to first token of the finished requests, as the client saw it.
    pub ttft_ms: Percentiles,
    pub prompt_tokens: usize,
    /// Prompt tokens the cluster computed: `prompt_tokens - cached_tokens`.
    pub computed_tokens: usize,
    pub cached_tokens: usize,
    /// KV bytes moved to decode workers.
    pub transfer_bytes: u64,
    /// Wall time of the part (both parts: the sum, since they run one after the other).
    pub wall_s: f64,
    pub first_error: Option<String>,
}

impl PartReport {
    pub fn of<'a>(outcomes: impl IntoIterator<Item = &'a Outcome>, wall_s: f64) -> PartReport {
        let mut r = PartReport { wall_s, ..PartReport::default() };
        let mut ttft = Vec::new();
        for o in outcomes {
            r.requests += 1;
            match o {
                Ok(d) => {
                    let cached = d.cached_tokens.min(d.prompt_tokens);
                    ttft.push(d.ttft_ms);
                    r.prompt_tokens += d.prompt_tokens;
                    r.cached_tokens += cached;
                    r.computed_tokens += d.prompt_tokens - cached;
                    r.transfer_bytes += d.transfer_bytes;
                }
                Err(e) => {
                    r.failed += 1;
                    r.first_error.get_or_insert_with(|| e.clone());
                }
            }
        }
        r.ttft_ms = Percentiles::of(&mut ttft);
        r
    }

    fn finished(&self) -> usize {
        self.requests - self.failed
    }
}

/// One phase: the system-prompt part, the chats, and both together.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct PhaseReport {
    pub phase: Phase,
    pub system_prompt: PartReport,
    pub chats: PartReport,
    pub all: PartReport,
}

impl PhaseReport {
    pub fn new(
        phase: Phase,
        system: &[Outcome],
        system_s: f64,
        chats: &[Outcome],
        chats_s: f64,
    ) -> PhaseReport {
        PhaseReport {
            phase,
            system_prompt: PartReport::of(system, system_s),
            chats: PartReport::of(chats, chats_s),
            all: PartReport::of(system.iter().chain(chats), system_s + chats_s),
        }
    }
}

/// Cache on against the cache-off baseline, for one part.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub(crate) struct Comparison {
    /// Baseline TTFT p50 over cache-on TTFT p50.
    pub ttft_p50_speedup: Option<f64>,
    /// `1 - on / off` of the computed prompt tokens: the share the cache saved.
    pub computed_tokens_saved: Option<f64>,
    /// `1 - on / off` of the KV bytes moved.
    pub transfer_bytes_saved: Option<f64>,
}

fn saved(off: f64, on: f64) -> Option<f64> {
    (off > 0.0).then(|| 1.0 - on / off)
}

impl Comparison {
    pub fn of(off: &PartReport, on: &PartReport) -> Comparison {
        let timed = off.finished() > 0 && on.finished() > 0 && on.ttft_ms.p50 > 0.0;
        Comparison {
            ttft_p50_speedup: timed.then(|| off.ttft_ms.p50 / on.ttft_ms.p50),
            computed_tokens_saved: saved(off.computed_tokens as f64, on.computed_tokens as f64),
            transfer_bytes_saved: saved(off.transfer_bytes as f64, on.transfer_bytes as f64),
        }
    }
}

/// Cache on against cache off, per part.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub(crate) struct OnVsOff {
    pub system_prompt: Comparison,
    pub chats: Comparison,
    pub all: Comparison,
}

impl OnVsOff {
    pub fn of(off: &PhaseReport, on: &PhaseReport) -> OnVsOff {
        OnVsOff {
            system_prompt: Comparison::of(&off.system_prompt, &on.system_prompt),
            chats: Comparison::of(&off.chats, &on.chats),
            all: Comparison::of(&off.all, &on.all),
        }
    }
}

const MIB: f64 = (1u64 << 20) as f64;

/// The two tables: every phase and part, then cache on against cache off.
pub(crate) fn tables(phases: &[&PhaseReport], cmp: &OnVsOff) -> String {
    let mut s = String::new();
    let dash = || "-".to_string();
    s.push_str(
        "| cache | part | requests | failed | TTFT p50 ms | TTFT p99 ms | prompt tokens | computed | cached | KV MiB moved | time s |\n",
    );
    s.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for p in phases {
        for (name, r) in [("system prompt", &p.system_prompt), ("chats", &p.chats), ("all", &p.all)] {
            let ms = |x: f64| if r.finished() > 0 { format!("{x:.1}") } else { dash() };
            let _ = writeln!(
                s,
                "| {} | {name} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.1} |",
                p.phase,
                r.requests,
                r.failed,
                ms(r.ttft_ms.p50),
                ms(r.ttft_ms.p99),
                r.prompt_tokens,
                r.computed_tokens,
                r.cached_tokens,
                r.transfer_bytes as f64 / MIB,
                r.wall_s
            );
        }
    }
    s.push('\n');
    s.push_str("| on vs off | TTFT p50 speed-up | computed tokens saved | KV bytes saved |\n");
    s.push_str("|---|---:|---:|---:|\n");
    let pct = |x: Option<f64>| x.map(|x| format!("{:.1}%", 100.0 * x)).unwrap_or_else(dash);
    for (name, c) in [("system prompt", &cmp.system_prompt), ("chats", &cmp.chats), ("all", &cmp.all)] {
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} |",
            c.ttft_p50_speedup.map(|x| format!("{x:.2}x")).unwrap_or_else(dash),
            pct(c.computed_tokens_saved),
            pct(c.transfer_bytes_saved)
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(ttft_ms: f64, prompt_tokens: usize, cached_tokens: usize, transfer_bytes: u64) -> Outcome {
        Ok(Done { ttft_ms, prompt_tokens, cached_tokens, transfer_bytes })
    }

    #[test]
    fn a_part_sums_finished_requests_and_counts_failures() {
        let outcomes = [
            done(10.0, 100, 64, 1000),
            Err("boom".to_string()),
            done(30.0, 50, 0, 500),
            Err("later".to_string()),
        ];
        let r = PartReport::of(&outcomes, 2.5);
        assert_eq!((r.requests, r.failed), (4, 2));
        assert_eq!((r.prompt_tokens, r.computed_tokens, r.cached_tokens), (150, 86, 64));
        assert_eq!(r.transfer_bytes, 1500);
        assert_eq!((r.ttft_ms.p50, r.ttft_ms.p99, r.ttft_ms.mean), (10.0, 30.0, 20.0));
        assert_eq!(r.wall_s, 2.5);
        assert_eq!(r.first_error.as_deref(), Some("boom"));
    }

    #[test]
    fn cached_tokens_are_capped_at_the_prompt() {
        let r = PartReport::of(&[done(1.0, 40, 48, 0)], 1.0);
        assert_eq!((r.prompt_tokens, r.computed_tokens, r.cached_tokens), (40, 0, 40));
    }

    #[test]
    fn all_is_both_parts_together() {
        let system = [done(100.0, 1050, 0, 10), done(300.0, 1050, 992, 20)];
        let chats = [done(20.0, 50, 0, 1), Err("x".into()), done(40.0, 116, 48, 2)];
        let p = PhaseReport::new(Phase::On, &system, 4.0, &chats, 1.5);
        assert_eq!((p.system_prompt.requests, p.chats.requests, p.all.requests), (2, 3, 5));
        assert_eq!(p.all.failed, 1);
        assert_eq!(p.all.prompt_tokens, 1050 + 1050 + 50 + 116);
        assert_eq!(p.all.cached_tokens, 992 + 48);
        assert_eq!(p.all.computed_tokens, p.all.prompt_tokens - p.all.cached_tokens);
        assert_eq!(p.all.transfer_bytes, 33);
        assert_eq!(p.all.wall_s, 5.5);
        // Percentiles over the union, not a mix of the parts' percentiles.
        assert_eq!((p.all.ttft_ms.p50, p.all.ttft_ms.p99), (40.0, 300.0));
        assert_eq!(p.all.first_error.as_deref(), Some("x"));
    }

    #[test]
    fn on_against_off_gives_speed_up_and_savings() {
        let off = PartReport::of(&[done(100.0, 1000, 0, 4000), done(120.0, 1000, 0, 4000)], 1.0);
        let on = PartReport::of(&[done(25.0, 1000, 800, 800), done(200.0, 1000, 900, 400)], 1.0);
        let c = Comparison::of(&off, &on);
        assert_eq!(c.ttft_p50_speedup, Some(4.0));
        assert_eq!(c.computed_tokens_saved, Some(1.0 - 300.0 / 2000.0));
        assert_eq!(c.transfer_bytes_saved, Some(1.0 - 1200.0 / 8000.0));
        // More work with the cache on is a negative saving, not hidden.
        let c = Comparison::of(&on, &off);
        assert!(c.computed_tokens_saved.unwrap() < 0.0);
    }

    #[test]
    fn ratios_without_a_baseline_are_none() {
        // A cluster that reports neither cached tokens nor bytes: nothing saved, bytes unknown.
        let off = PartReport::of(&[done(100.0, 1000, 0, 0)], 1.0);
        let on = PartReport::of(&[done(50.0, 1000, 0, 0)], 1.0);
        let c = Comparison::of(&off, &on);
        assert_eq!(
            (c.ttft_p50_speedup, c.computed_tokens_saved, c.transfer_bytes_saved),
            (Some(2.0), Some(0.0), None)
        );
        // Every request of a side failed: no TTFT to compare, no tokens to save.
        let failed = PartReport::of(&[Err("down".into())], 1.0);
        let c = Comparison::of(&failed, &on);
        assert_eq!(c, Comparison::default());
        assert_eq!(Comparison::of(&off, &failed).ttft_p50_speedup, None);
        assert_eq!(Comparison::of(&PartReport::default(), &PartReport::default()), Comparison::default());
    }

    #[test]
    fn tables_show_every_phase_and_part_and_dashes_for_unknowns() {
        let off =
            PhaseReport::new(Phase::Off, &[done(100.0, 1000, 0, 3 << 20)], 2.0, &[Err("e".into())], 0.5);
        let on = PhaseReport::new(Phase::On, &[done(50.0, 1000, 992, 1 << 19)], 1.0, &[Err("e".into())], 0.3);
        let t = tables(&[&off, &on], &OnVsOff::of(&off, &on));
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[2],
            "| off | system prompt | 1 | 0 | 100.0 | 100.0 | 1000 | 1000 | 0 | 3.00 | 2.0 |"
        );
        assert_eq!(lines[3], "| off | chats | 1 | 1 | - | - | 0 | 0 | 0 | 0.00 | 0.5 |");
        assert_eq!(lines[7], "| on | all | 2 | 1 | 50.0 | 50.0 | 1000 | 8 | 992 | 0.50 | 1.3 |");
        assert_eq!(lines[11], "| system prompt | 2.00x | 99.2% | 83.3% |");
        assert_eq!(lines[12], "| chats | - | - | - |");
        assert_eq!(lines.len(), 14);
    }
}
