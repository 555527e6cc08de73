//! `tandem bench --router HOST:PORT --workload shared-prefix`: what a cluster's prefix cache saves,
//! measured on one cluster in one run.
//!
//! The workload ([`workload`]) runs twice. First with the cache *off*: every request carries a
//! `cache_salt` of its own, so no request can use another's KV blocks. This is the baseline, "no
//! sharing possible", measured on the same cluster in the same run (workers started with
//! `--prefix-cache false` would be the other way to measure it). Then with the cache *on*: every
//! request carries the run's one salt, new for every run so that an earlier run's cache cannot
//! help. Each phase opens with one uncounted warm-up request whose prompt and salt share nothing
//! with the workload. Within a phase the system-prompt requests run first, then the chats; each
//! part keeps `--concurrency` requests (or chats) in flight, and a chat's turns run in order.
//!
//! A failed request is counted, never retried; a chat stops at a failed turn and its later turns
//! count as failed too (their prompts need the failed turn's answer). A request that has not
//! finished after `--request-timeout-s` is a failure, so a run always ends. The bench exits
//! non-zero when every request of a phase failed.
//!
//! Until a cluster reports `Usage.cached_tokens` and `Timings.transfer_bytes` these read 0, and
//! the two phases differ only by chance.

mod report;
mod workload;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};

use crate::greedy_stream::{run_id, Ask};
use crate::BenchArgs;
use report::{tables, Done, OnVsOff, Outcome, PhaseReport};
use workload::{Phase, RequestKey, Shape};

/// What the two phases are, for the output.
const OFF: &str = "a unique cache_salt per request, so no sharing is possible: the baseline, measured on the \
     same cluster in the same run (workers started with --prefix-cache false are the other way to measure it)";
const ON: &str = "one cache_salt for every request of this run, new for each run so that no earlier run's \
     cache can help";

/// One phase's requests and where they go.
struct Ctx {
    ask: Ask,
    shape: Shape,
    /// This run's id, part of every salt.
    run: String,
    phase: Phase,
}

/// What a finished request returned.
struct Reply {
    done: Done,
    /// The generated tokens (a chat's next turn continues with them).
    answer: Vec<u32>,
}

impl Ctx {
    /// Sends request `key`; a failure or a timeout is its error message, prefixed with `key`.
    async fn send(&self, key: RequestKey, prompt: Vec<u32>) -> Result<Reply, String> {
        let salt = self.phase.salt(&self.run, key);
        let id = format!("bench-{}-{}-{key}", self.run, self.phase);
        self.send_salted(prompt, salt, id).await.map_err(|e| format!("{key}: {e}"))
    }

    async fn send_salted(
        &self,
        prompt: Vec<u32>,
        cache_salt: String,
        request_id: String,
    ) -> Result<Reply, String> {
        let r = self.ask.send(prompt, cache_salt, request_id).await?;
        let done = Done {
            ttft_ms: r.ttft_ms,
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens,
            transfer_bytes: r.transfer_bytes,
        };
        Ok(Reply { done, answer: r.answer })
    }

    /// Every turn of chat `chat`, in order.
    async fn chat(&self, chat: usize) -> Vec<Outcome> {
        let turns = self.shape.turns;
        let mut out = Vec::with_capacity(turns);
        let mut prompt = self.shape.first_turn(chat);
        for turn in 0..turns {
            match self.send(RequestKey::Chat { chat, turn }, prompt.clone()).await {
                Ok(r) => {
                    out.push(Ok(r.done));
                    if turn + 1 < turns {
                        prompt = self.shape.next_turn(chat, turn + 1, &prompt, &r.answer);
                    }
                }
                Err(e) => {
                    out.push(Err(e));
                    for later in turn + 1..turns {
                        let key = RequestKey::Chat { chat, turn: later };
                        out.push(Err(format!("{key}: not sent, turn {turn} of its chat failed")));
                    }
                    break;
                }
            }
        }
        out
    }
}

/// Runs `job(0..jobs)` with at most `concurrency` at a time; the results in job order.
async fn pool<T, F, Fut>(jobs: usize, concurrency: usize, job: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let job = Arc::new(job);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency.min(jobs) {
        let (job, next) = (job.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= jobs {
                    return done;
                }
                done.push((i, job(i).await));
            }
        }));
    }
    let mut all = Vec::with_capacity(jobs);
    for t in tasks {
        all.extend(t.await.context("a bench task panicked")?);
    }
    all.sort_by_key(|(i, _)| *i);
    Ok(all.into_iter().map(|(_, t)| t).collect())
}

/// One phase: the warm-up, the system-prompt requests, then the chats.
async fn run_phase(ctx: Arc<Ctx>, concurrency: usize) -> Result<PhaseReport> {
    let (shape, phase) = (ctx.shape, ctx.phase);
    let warm = ctx
        .send_salted(
            shape.warm_up(phase),
            phase.warm_up_salt(&ctx.run),
            format!("bench-{}-{phase}-warm-up", ctx.run),
        )
        .await;
    if let Err(e) = warm {
        eprintln!("warning: the cache-{phase} warm-up request failed (not counted): {e}");
    }

    let system = Arc::new(shape.system_prompt());
    let t0 = Instant::now();
    let c = ctx.clone();
    let system_outcomes = pool(shape.requests, concurrency, move |i| {
        let (c, system) = (c.clone(), system.clone());
        async move { c.send(RequestKey::System(i), shape.system_request(&system, i)).await.map(|r| r.done) }
    })
    .await?;
    let system_s = t0.elapsed().as_secs_f64();

    let t0 = Instant::now();
    let c = ctx.clone();
    let chats = pool(shape.chats, concurrency, move |chat| {
        let c = c.clone();
        async move { c.chat(chat).await }
    })
    .await?;
    let chat_outcomes: Vec<Outcome> = chats.into_iter().flatten().collect();
    let chats_s = t0.elapsed().as_secs_f64();
    Ok(PhaseReport::new(phase, &system_outcomes, system_s, &chat_outcomes, chats_s))
}

/// Fails when every request of the phase failed; warns when some did.
fn check(p: &PhaseReport) -> Result<()> {
    let all = &p.all;
    let first = all.first_error.as_deref().unwrap_or("");
    if all.requests > 0 && all.failed == all.requests {
        bail!("every request of the cache-{} phase failed ({}); the first: {first}", p.phase, all.requests);
    }
    if all.failed > 0 {
        eprintln!(
            "warning: {} of {} cache-{} requests failed; the first: {first}",
            all.failed, all.requests, p.phase
        );
    }
    Ok(())
}

/// `tandem bench --router HOST:PORT --workload shared-prefix`.
pub(crate) fn run(router: &str, a: BenchArgs) -> Result<()> {
    let shape = Shape {
        system_tokens: a.system_tokens,
        question_tokens: a.question_tokens,
        requests: a.requests,
        chats: a.chats,
        turns: a.turns,
        answer_tokens: a.answer_tokens,
        vocab_limit: a.vocab_limit,
        seed: a.seed,
    };
    if a.concurrency == 0
        || shape.question_tokens == 0
        || shape.answer_tokens == 0
        || a.request_timeout_s == 0
    {
        bail!("--concurrency, --question-tokens, --answer-tokens and --request-timeout-s must all be at least 1");
    }
    if shape.total_requests() == 0 {
        bail!("nothing to send: --requests and --chats × --turns are both 0");
    }
    if shape.vocab_limit < 2 {
        bail!("--vocab-limit must be at least 2 (token ids are drawn from 1 to the limit - 1)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let run = run_id();
    let (off, on) = rt.block_on(async {
        let ask = Ask::connect(router, &a).await?;
        let ctx = |phase| Arc::new(Ctx { ask: ask.clone(), shape, run: run.clone(), phase });
        let off = run_phase(ctx(Phase::Off), a.concurrency).await?;
        check(&off)?;
        let on = run_phase(ctx(Phase::On), a.concurrency).await?;
        check(&on)?;
        Ok::<_, anyhow::Error>((off, on))
    })?;
    let cmp = OnVsOff::of(&off, &on);
    if a.json {
        let v = serde_json::json!({
            "workload": "shared-prefix",
            "router": router,
            "run": run,
            "shape": shape,
            "concurrency": a.concurrency,
            "baseline": OFF,
            "cache_on": ON,
            "off": off,
            "on": on,
            "on_vs_off": cmp,
        });
        println!("{}", serde_json::to_string(&v).map_err(|e| anyhow!("encoding the report: {e}"))?);
        return Ok(());
    }
    println!("router: {router}");
    println!(
        "workload: shared-prefix, seed {}, run {run}, concurrency {}, {} tokens generated per request (greedy)",
        shape.seed, a.concurrency, shape.answer_tokens
    );
    println!(
        "  system prompt: {} requests, one shared {}-token system prompt + a distinct {}-token question each",
        shape.requests, shape.system_tokens, shape.question_tokens
    );
    println!(
        "  chats: {} chats of {} turns, each turn's prompt = the previous prompt + its answer + a new {}-token message",
        shape.chats, shape.turns, shape.question_tokens
    );
    println!("cache off: {OFF}");
    println!("cache on: {ON}");
    println!(
        "TTFT as measured here (request sent → first token); computed = prompt - cached \
         (Usage.cached_tokens); KV moved = Timings.transfer_bytes"
    );
    println!();
    print!("{}", tables(&[&off, &on], &cmp));
    if on.all.cached_tokens == 0 {
        println!();
        println!(
            "note: no request reported cached tokens; either the workers run without a prefix cache or the \
             cluster does not report Usage.cached_tokens"
        );
    }
    Ok(())
}
