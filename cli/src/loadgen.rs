//! A load generator for a running cluster (`tandem bench --router`): a fixed synthetic workload at
//! a given concurrency, measuring time to first token, inter-token latency and throughput as a
//! client sees them.
//!
//! The workload is deterministic: every request sends the same number of pseudo-random prompt
//! token ids (distinct per request, so no two prompts are equal) and asks for exactly
//! `output_tokens` tokens with `ignore_eos`, so every run and every cluster does the same work.
//!
//! With a duration instead of a request count, every client sends requests back to back until
//! the time is up: offered load is the concurrency, whatever the cluster admits. A request the
//! cluster refuses for capacity (RESOURCE_EXHAUSTED before its first token) is counted apart from
//! failures, with how long the refusal took; its client waits [`REFUSED_BACKOFF`] and sends the
//! next one.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tandem_proto::v1;
use tandem_proto::v1::tandem_client::TandemClient;

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadSpec {
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Requests in total (with `duration`: at most).
    pub requests: usize,
    /// Send requests until this much time has passed instead of a fixed count.
    pub duration: Option<Duration>,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Token ids are drawn below this (stay inside any vocabulary).
    pub vocab_limit: u32,
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `v` (zeros when empty).
    pub fn of(v: &mut [f64]) -> Percentiles {
        if v.is_empty() {
            return Percentiles::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Percentiles { p50: rank(0.50), p99: rank(0.99), mean: v.iter().sum::<f64>() / v.len() as f64 }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LoadReport {
    pub concurrency: usize,
    pub requests: usize,
    pub failed: usize,
    /// Requests refused for capacity (RESOURCE_EXHAUSTED before the first token).
    pub refused: usize,
    /// Refusals that did not say when to retry (`retry-after` metadata).
    pub refused_without_retry_after: usize,
    /// Request sent → refusal received.
    pub refusal_ms: Percentiles,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub wall_s: f64,
    /// Request sent → first token received.
    pub ttft_ms: Percentiles,
    /// Gap between consecutive tokens of one request.
    pub itl_ms: Percentiles,
    /// Generated tokens per second over the whole run, all requests together.
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
    /// The first failure's message, if any.
    pub first_error: Option<String>,
}

/// The prompt of request `i`: `n` pseudo-random ids below `limit` (never 0, which is often a
/// special token).
pub fn synthetic_prompt(i: usize, n: usize, limit: u32) -> Vec<u32> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1 + (x % (limit.max(2) as u64 - 1)) as u32
        })
        .collect()
}

/// How long a client whose request was refused waits before sending the next: short, so the
/// offered load stays high, yet long enough that refusals do not become the whole workload.
pub const REFUSED_BACKOFF: Duration = Duration::from_millis(100);

#[derive(Default)]
struct One {
    ttft: Option<Duration>,
    gaps: Vec<f64>,
    tokens: usize,
    error: Option<String>,
    /// Refused for capacity after this long; whether the refusal said when to retry.
    refused: Option<(Duration, bool)>,
}

impl One {
    /// Records a failed call: a refusal for capacity before the first token, or an error.
    fn failed(&mut self, s: &tonic::Status, t0: Instant) {
        if s.code() == tonic::Code::ResourceExhausted && self.ttft.is_none() {
            self.refused = Some((t0.elapsed(), s.metadata().get("retry-after").is_some()));
        } else {
            self.error = Some(format!("{:?}: {}", s.code(), s.message()));
        }
    }
}

async fn one(
    mut client: TandemClient<tonic::transport::Channel>,
    i: usize,
    spec: LoadSpec,
    api_key: Option<&str>,
) -> One {
    let req = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: synthetic_prompt(i, spec.prompt_tokens, spec.vocab_limit),
        })),
        max_tokens: Some(spec.output_tokens as u32),
        ignore_eos: true,
        request_id: format!("bench-{i}"),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut out = One::default();
    let mut stream = match client.generate(tandem_serve::auth::api_key_request(api_key, req)).await {
        Ok(s) => s.into_inner(),
        Err(s) => {
            out.failed(&s, t0);
            return out;
        }
    };
    let mut last = t0;
    loop {
        match stream.message().await {
            Ok(Some(msg)) => {
                let n = msg.token_ids.len();
                if n == 0 {
                    continue;
                }
                let now = Instant::now();
                if out.ttft.is_none() {
                    out.ttft = Some(now - t0);
                    // Tokens that arrive together after the first share the gap.
                    out.gaps.extend(std::iter::repeat_n(0.0, n - 1));
                } else {
                    let gap = (now - last).as_secs_f64() * 1e3 / n as f64;
                    out.gaps.extend(std::iter::repeat_n(gap, n));
                }
                last = now;
                out.tokens += n;
            }
            Ok(None) => {
                // With ignore_eos the only short ending is the context limit: the load is wrong.
                if out.tokens != spec.output_tokens {
                    out.error = Some(format!(
                        "the stream ended after {} of {} tokens",
                        out.tokens, spec.output_tokens
                    ));
                }
                break;
            }
            Err(s) => {
                out.failed(&s, t0);
                break;
            }
        }
    }
    out
}

/// Runs `spec` through `channel` (a connection to the router, plaintext or TLS).
/// `api_key` is sent with every request when the router asks for one.
pub async fn run_load(
    channel: tonic::transport::Channel,
    spec: LoadSpec,
    api_key: Option<String>,
) -> Result<LoadReport> {
    if spec.concurrency == 0 || spec.requests == 0 || spec.output_tokens == 0 || spec.prompt_tokens == 0 {
        bail!("concurrency, requests, prompt tokens and output tokens must all be at least 1");
    }
    let client = TandemClient::new(channel);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..spec.concurrency.min(spec.requests) {
        let (client, next, key) = (client.clone(), next.clone(), api_key.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= spec.requests || spec.duration.is_some_and(|d| t0.elapsed() >= d) {
                    return done;
                }
                let r = one(client.clone(), i, spec, key.as_deref()).await;
                if r.refused.is_some() {
                    tokio::time::sleep(REFUSED_BACKOFF).await;
                }
                done.push(r);
            }
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(t.await.context("load task panicked")?);
    }
    let wall = t0.elapsed().as_secs_f64();
    let mut ttft: Vec<f64> = results.iter().filter_map(|r| r.ttft).map(|d| d.as_secs_f64() * 1e3).collect();
    let mut itl: Vec<f64> = results.iter().flat_map(|r| r.gaps.iter().copied()).collect();
    let failed = results.iter().filter(|r| r.error.is_some()).count();
    let refusals: Vec<(Duration, bool)> = results.iter().filter_map(|r| r.refused).collect();
    let mut refusal_ms: Vec<f64> = refusals.iter().map(|(d, _)| d.as_secs_f64() * 1e3).collect();
    let tokens: usize = results.iter().map(|r| r.tokens).sum();
    let admitted = results.len() - failed - refusals.len();
    Ok(LoadReport {
        concurrency: spec.concurrency,
        requests: results.len(),
        failed,
        refused: refusals.len(),
        refused_without_retry_after: refusals.iter().filter(|(_, hint)| !hint).count(),
        refusal_ms: Percentiles::of(&mut refusal_ms),
        prompt_tokens: spec.prompt_tokens,
        output_tokens: spec.output_tokens,
        wall_s: wall,
        ttft_ms: Percentiles::of(&mut ttft),
        itl_ms: Percentiles::of(&mut itl),
        output_tokens_per_s: tokens as f64 / wall,
        requests_per_s: admitted as f64 / wall,
        first_error: results.iter().find_map(|r| r.error.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let p = Percentiles::of(&mut v);
        assert_eq!((p.p50, p.p99), (50.0, 99.0));
        assert_eq!(p.mean, 50.5);
        assert_eq!(Percentiles::of(&mut []), Percentiles::default());
        let mut one = vec![7.0];
        assert_eq!(Percentiles::of(&mut one).p99, 7.0);
    }

    #[test]
    fn synthetic_prompts_are_deterministic_distinct_and_in_range() {
        let a = synthetic_prompt(3, 64, 1000);
        assert_eq!(a, synthetic_prompt(3, 64, 1000));
        assert_ne!(a, synthetic_prompt(4, 64, 1000));
        assert!(a.iter().all(|&t| (1..1000).contains(&t)));
        assert_eq!(a.len(), 64);
    }
}
