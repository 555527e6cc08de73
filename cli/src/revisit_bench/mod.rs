//! `tandem bench --router HOST:PORT --workload revisit`: what a cluster keeps of many multi-turn
//! conversations when they together outgrow its KV pool, so that a revisit finds its history only
//! if the pool, or a KV tier behind it (`--kv-host-bytes`, `--kv-disk-dir`), kept it.
//!
//! The workload ([`workload`]): round 1 sends every conversation's opening; every later round
//! revisits every conversation once, in a seeded random order, with its whole history and a few
//! new tokens. A round keeps `--concurrency` requests in flight and ends when all have finished;
//! rounds run one after the other. Every request carries the run's one salt, new for every run so
//! that an earlier run's cache cannot help, unless `--cache-salt` names one (an earlier run's, to
//! measure what a restarted cluster found again). One uncounted warm-up request, sharing nothing
//! with the workload, goes first.
//!
//! A failed request is counted, never retried; the conversation's later requests are not sent and
//! count as failed too (their prompts need its answer). A request that has not finished after
//! `--request-timeout-s` is a failure, so a run always ends. The bench exits non-zero when every
//! request failed.
//!
//! The bench cannot see the workers' pools: it prints the working set (the final histories
//! together) for the user to compare with `--kv-blocks` × `--block-size`.

mod report;
mod workload;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};

use crate::greedy_stream::{run_id, Ask};
use crate::BenchArgs;
use report::{table, Done, Outcome, RunReport};
use workload::Shape;

/// Where the requests go and what they carry.
struct Ctx {
    ask: Ask,
    shape: Shape,
    /// This run's id, part of every request id.
    run: String,
    /// The salt every counted request carries.
    salt: String,
}

/// What a finished request returned.
struct Reply {
    done: Done,
    /// The generated tokens: the conversation's history continues with them.
    answer: Vec<u32>,
}

impl Ctx {
    /// Sends `prompt`; a failure or a timeout is its error message.
    async fn send(&self, prompt: Vec<u32>, cache_salt: String, request_id: String) -> Result<Reply, String> {
        let r = self.ask.send(prompt, cache_salt, request_id).await?;
        let done = Done {
            ttft_ms: r.ttft_ms,
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens,
            output_tokens: r.answer.len(),
        };
        Ok(Reply { done, answer: r.answer })
    }

    /// Round `round` (0-based) of conversation `conv`, or why it was not sent.
    async fn visit(
        &self,
        conv: usize,
        round: usize,
        prompt: Result<Vec<u32>, String>,
    ) -> Result<Reply, String> {
        let key = format!("c{conv}r{}", round + 1);
        let prompt = prompt.map_err(|e| format!("{key}: {e}"))?;
        let id = format!("bench-{}-revisit-{key}", self.run);
        self.send(prompt, self.salt.clone(), id).await.map_err(|e| format!("{key}: {e}"))
    }
}

/// Sends `prompts[i]` to conversation `convs[i]` in that order, at most `concurrency` at a time;
/// the replies in the same order.
async fn round(
    ctx: &Arc<Ctx>,
    round: usize,
    convs: Vec<usize>,
    prompts: Vec<Result<Vec<u32>, String>>,
    concurrency: usize,
) -> Result<Vec<Result<Reply, String>>> {
    let jobs: Arc<Vec<_>> = Arc::new(convs.into_iter().zip(prompts).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency.min(jobs.len()) {
        let (ctx, jobs, next) = (ctx.clone(), jobs.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((conv, prompt)) = jobs.get(i) else { return done };
                done.push((i, ctx.visit(*conv, round, prompt.clone()).await));
            }
        }));
    }
    let mut all = Vec::with_capacity(jobs.len());
    for t in tasks {
        all.extend(t.await.context("a bench task panicked")?);
    }
    all.sort_by_key(|(i, _)| *i);
    Ok(all.into_iter().map(|(_, r)| r).collect())
}

/// The warm-up, then every round; each round's outcomes (in visiting order) and wall time.
async fn run_rounds(ctx: Arc<Ctx>, concurrency: usize) -> Result<Vec<(Vec<Outcome>, f64)>> {
    let shape = ctx.shape;
    let warm_id = format!("bench-{}-revisit-warm-up", ctx.run);
    if let Err(e) = ctx.send(shape.warm_up(), workload::warm_up_salt(&ctx.run), warm_id).await {
        eprintln!("warning: the warm-up request failed (not counted): {e}");
    }
    // Each conversation's history (every prompt and answer so far), or the round it failed in.
    let mut histories: Vec<Result<Vec<u32>, usize>> = vec![Ok(Vec::new()); shape.conversations];
    let mut rounds = Vec::with_capacity(shape.rounds);
    for r in 0..shape.rounds {
        let order = shape.order(r);
        let prompts: Vec<Result<Vec<u32>, String>> = order
            .iter()
            .map(|&c| match &histories[c] {
                Ok(_) if r == 0 => Ok(shape.opening(c)),
                Ok(h) => Ok(shape.revisit(c, r, h)),
                Err(f) => Err(format!("not sent, round {} of its conversation failed", f + 1)),
            })
            .collect();
        let t0 = Instant::now();
        let replies = round(&ctx, r, order.clone(), prompts.clone(), concurrency).await?;
        let wall_s = t0.elapsed().as_secs_f64();
        let mut outcomes = Vec::with_capacity(replies.len());
        for ((&c, prompt), reply) in order.iter().zip(prompts).zip(replies) {
            match (prompt, reply) {
                (Ok(mut p), Ok(reply)) => {
                    p.extend_from_slice(&reply.answer);
                    histories[c] = Ok(p);
                    outcomes.push(Ok(reply.done));
                }
                (Ok(_), Err(e)) => {
                    histories[c] = Err(r);
                    outcomes.push(Err(e));
                }
                (Err(_), reply) => outcomes.push(reply.map(|r| r.done)),
            }
        }
        rounds.push((outcomes, wall_s));
    }
    Ok(rounds)
}

/// `tandem bench --router HOST:PORT --workload revisit`.
pub(crate) fn run(router: &str, a: BenchArgs) -> Result<()> {
    let shape = Shape {
        conversations: a.conversations,
        rounds: a.rounds,
        first_tokens: a.first_tokens,
        turn_tokens: a.turn_tokens,
        answer_tokens: a.answer_tokens,
        vocab_limit: a.vocab_limit,
        seed: a.seed,
    };
    if [a.concurrency, a.conversations, a.rounds, a.first_tokens, a.turn_tokens, a.answer_tokens].contains(&0)
        || a.request_timeout_s == 0
    {
        bail!(
            "--concurrency, --conversations, --rounds, --first-tokens, --turn-tokens, --answer-tokens and \
             --request-timeout-s must all be at least 1"
        );
    }
    if shape.vocab_limit < 2 {
        bail!("--vocab-limit must be at least 2 (token ids are drawn from 1 to the limit - 1)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let run = run_id();
    let salt = a.cache_salt.clone().unwrap_or_else(|| workload::run_salt(&run));
    let rounds = rt.block_on(async {
        let ctx = Arc::new(Ctx {
            ask: Ask::connect(router, &a).await?,
            shape,
            run: run.clone(),
            salt: salt.clone(),
        });
        run_rounds(ctx, a.concurrency).await
    })?;
    let report = RunReport::new(&rounds);
    let all = &report.all;
    let first = all.first_error.as_deref().unwrap_or("");
    if all.requests > 0 && all.failed == all.requests {
        bail!("every request failed ({}); the first: {first}", all.requests);
    }
    if all.failed > 0 {
        eprintln!("warning: {} of {} requests failed; the first: {first}", all.failed, all.requests);
    }
    let working_set = shape.working_set_tokens();
    if a.json {
        let v = serde_json::json!({
            "workload": "revisit",
            "router": router,
            "run": run,
            "salt": salt,
            "shape": shape,
            "concurrency": a.concurrency,
            "working_set_tokens": working_set,
            "rounds": report.rounds,
            "revisits": report.revisits,
            "all": report.all,
        });
        println!("{}", serde_json::to_string(&v).map_err(|e| anyhow!("encoding the report: {e}"))?);
        return Ok(());
    }
    println!("router: {router}");
    println!(
        "workload: revisit, seed {}, run {run}, salt {salt}, concurrency {}, {} tokens generated per request \
         (greedy)",
        shape.seed, a.concurrency, shape.answer_tokens
    );
    println!(
        "  {} conversations, {} rounds: round 1 sends each conversation's {}-token opening; each later round \
         revisits every conversation once, in a seeded random order, with its whole history + {} new tokens",
        shape.conversations, shape.rounds, shape.first_tokens, shape.turn_tokens
    );
    println!(
        "working set: {working_set} tokens (the conversations' final histories together); compare with a \
         worker's pool, --kv-blocks × --block-size (the workers' defaults: 512 × 16 = 8192 tokens)"
    );
    println!(
        "TTFT as measured here (request sent → first token); cached = Usage.cached_tokens (from the pool or a \
         KV tier behind it)"
    );
    println!();
    print!("{}", table(&report));
    if report.rounds.len() > 1 && report.revisits.cached_tokens == 0 {
        println!();
        println!(
            "note: no revisit reported cached tokens; either the workers run without a prefix cache or the \
             cluster does not report Usage.cached_tokens"
        );
    }
    Ok(())
}
