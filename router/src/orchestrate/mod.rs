//! One request's life: pick workers, `Reserve` on the decode worker, `Prefill` on the prefill
//! worker (which moves the KV blocks into the reservation), `Decode` on the decode worker, and
//! stream tokens and text to the client.
//!
//! The parts, each in its own file:
//! - `start`: validation, tokenization and the first choice of workers, before anything runs;
//! - `placement`: where the request runs and where it moves: pure decisions over the registry;
//! - `calls`: the worker calls (`Reserve`, `Prefill`, `Decode`, the `Info` probe) and what a
//!   failed one means; `kv_wait`: the line of requests waiting for free KV blocks;
//!   `stream`: following a `Decode` stream to the client;
//! - `output`: output shaping: the only place a cluster's tokens become text (the model crate's
//!   `TextOutput`: detokenizer and stop strings), usage, finish reasons;
//! - `cleanup`: what the request leaves on its workers, undone whatever way it ends.
//!
//! This file holds the request itself (`Run`): its state, its end, and the glue that applies
//! a placement decision to it.
//!
//! With prefix caching, `Reserve` carries the prompt and its salt; a decode worker that already
//! holds the prompt's leading blocks says how many (`cached_blocks`) and reserves only the rest,
//! and `Prefill` is told to skip them. The router checks that answer (the block of the last prompt
//! token is always sent) and reports the prompt tokens a worker did not compute in the usage.
//!
//! Migration: when the worker holding a sequence is lost mid-stream (its call fails at the
//! transport, it answers UNAVAILABLE, it ends the stream without a finish reason, a KV transfer
//! into it fails and it does not answer a probe, or the registry gave up on it, for missed
//! heartbeats or as unhealthy, and its stream has been silent as long), the request moves to
//! another decode (or colocated) worker, at most `--max-migrations` times. The new worker is
//! given the prompt followed by every token already streamed as its prompt, and `max_tokens` less
//! those tokens; it computes that prompt (its prefix cache may hold part of it) and continues from
//! the next token. The router's text output already holds the streamed tokens, so it only sees
//! the new ones: the client's stream goes on without a gap or a repeat, and greedy
//! output equals an uninterrupted run. Sampled output stays a valid sample but is not the random
//! stream the first worker would have drawn. A worker that answers with an error of its own
//! (INVALID_ARGUMENT, INTERNAL, ...) is not lost: the request fails as before. A request of
//! several choices (`n` > 1) moves only before its first token: afterwards each choice would need
//! a prompt of its own, and the request fails instead.
//!
//! Degraded modes (`--prefill-fallback decode`, the default): with no prefill worker usable when a
//! request is placed or moved, a decode worker computes the prompt itself (a colocated worker's
//! plan on a decode worker); when the prompt's KV transfer fails after its prefill (a checksum
//! mismatch, a connection cut, a sender that gave up) and the decode worker still answers, that
//! worker computes the prompt itself too, instead of the request failing. Both are counted in
//! `tandem_router_decode_prefills_total{reason}`; greedy output is the same as on the split path.
//! With `--prefill-fallback fail`, both fail with a retryable error as before.
//!
//! A request that lost its worker before its first token, with no worker able to take it now,
//! waits up to `--lost-worker-wait-ms` for one (a restarted worker registering again, the lost
//! one included: nothing was streamed, so nothing ties the request to the worker it lost), then
//! fails with UNAVAILABLE. One that has streamed tokens never waits.
//!
//! Invariants:
//! - The registry counts the request on the workers of its current plan only (`placement`),
//!   and the `cleanup::Cleanup` guard takes those counts off when the request ends.
//! - The client's stream is shaped by one `output::Output` for the whole request, whichever
//!   workers produce its tokens.

mod calls;
mod cleanup;
mod kv_wait;
mod output;
mod placement;
mod start;
mod stream;

use std::sync::Arc;
use std::time::Instant;

use tandem_proto::v1::GenerateResponse;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tonic::Status;

use crate::error::RouterError;
use crate::metrics::{DecodePrefill, Outcome};
use crate::registry::{Plan, PromptBlocks, Target};
use crate::{InFlight, Shared};
use cleanup::Cleanup;
use output::Output;
use placement::{resume, Moves, Stuck};
use tandem_model::request::Request;

pub use start::Api;
pub(crate) use start::{refused, start};

/// How often a request waiting for a worker (`--lost-worker-wait-ms`) looks at the registry.
const WORKER_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// What a draining router tells new requests (gRPC UNAVAILABLE, HTTP 503).
pub const DRAINING: &str = "the router is draining (shutting down)";

// What clients are told of a failure inside the cluster (the router's log has the detail, under
// the request id the client is also given).
const UNREACHABLE: &str = "no worker could serve the request now (unreachable, draining or gone); retry";
const FAILED: &str = "the request failed inside the cluster after it started";
const FULL: &str = "the cluster is at capacity; retry later";
const NO_BLOCKS: &str = "no decode worker had free KV blocks for this prompt in time; retry later";
const REFUSED: &str = "a worker refused the request";
const INTERNAL: &str = "internal error in the cluster";
const ADAPTER_GONE: &str =
    "the worker chosen no longer holds the request's LoRA adapter (unloaded or replaced since); retry";

/// The client-facing stream of one request.
pub type ResponseRx = mpsc::Receiver<Result<GenerateResponse, Status>>;

/// Where a request's messages go.
type ResponseTx = mpsc::Sender<Result<GenerateResponse, Status>>;

/// How one attempt at running a request on its chosen workers ended, when it did not finish it.
#[derive(Debug)]
enum RunError {
    /// The request fails with this error.
    Fatal(RouterError),
    /// The worker holding the sequence was lost; the request may move to another one, and fails
    /// with `error` when it cannot.
    Lost { worker: Target, error: RouterError },
    /// The prompt's KV never reached `decode` whole (the transfer failed after the prefill ran,
    /// and `decode` still answers): `decode` may compute the prompt itself, or the request fails
    /// with `error` (`--prefill-fallback fail`).
    Recompute { decode: Target, error: RouterError },
}

impl From<RouterError> for RunError {
    fn from(e: RouterError) -> RunError {
        RunError::Fatal(e)
    }
}

/// What an admitted request holds for its whole life: its place under `--max-queue`, its count
/// in the drain, and where it came from and when.
struct Ticket {
    received: Instant,
    api: Api,
    _permit: OwnedSemaphorePermit,
    _inflight: InFlight,
}

/// What the client gets back, beyond the request the workers run.
#[derive(Debug, Clone, Copy)]
struct Shape {
    /// Choices asked for (`n`, at least 1): one prompt, `n` sequences on the decode worker.
    n: u32,
    /// Scoring only (`max_tokens` 0 with `prompt_logprobs`): the workers generate one token,
    /// which the client never sees.
    score_only: bool,
}

/// One running request.
struct Run {
    shared: Arc<Shared>,
    /// The id the client and the logs know the request by (the client's tag, when it gave one).
    request_id: String,
    /// The id the workers know it by: always this router's, so that requests of several routers
    /// sharing workers never share one (a Release of one would cancel the other).
    wire_id: String,
    plan: Plan,
    /// The client's request, validated at the edge with every default resolved.
    original: Request,
    /// Choices asked for (`n`, at least 1): one prompt, `n` sequences on the decode worker.
    n: u32,
    /// What the current workers run: the client's request or, after a migration, its
    /// continuation (the prompt followed by the tokens streamed before it, and `max_tokens`
    /// counting what is left).
    current: Request,
    /// The named blocks of `current`'s prompt, for choosing workers again.
    blocks: PromptBlocks,
    /// What the client was told so far, and how the next tokens become text.
    out: Output,
    /// Times the request moved to another worker, and the workers it lost (never chosen again).
    moves: Moves,
    /// Why the next colocated run on a decode worker computes the prompt there, when the plan
    /// says so and the reason is not the usual one (no prefill worker usable).
    fallback: Option<DecodePrefill>,
    cleanup: Cleanup,
    ticket: Ticket,
}

impl Run {
    fn new(
        shared: Arc<Shared>,
        request_id: String,
        plan: Plan,
        request: Request,
        shape: Shape,
        blocks: PromptBlocks,
        ticket: Ticket,
    ) -> Run {
        let prompt_len = request.prompt().len() as u64;
        let wire_id = if request_id.starts_with(&shared.router_id) {
            request_id.clone()
        } else {
            format!("{}/{request_id}", shared.router_id)
        };
        let cleanup =
            Cleanup::new(shared.clone(), request_id.clone(), wire_id.clone(), plan.clone(), prompt_len);
        let out = Output::new(request_id.clone(), &request, shape, &shared.model.tokenizer, ticket.received);
        let n = shape.n;
        Run {
            moves: Moves::new(shared.max_migrations),
            fallback: None,
            shared,
            request_id,
            wire_id,
            plan,
            current: request.clone(),
            original: request,
            n,
            blocks,
            out,
            cleanup,
            ticket,
        }
    }

    /// Runs the request to its end, racing the client's disconnect, the deadline and the end of
    /// a drain.
    async fn drive(mut self, tx: ResponseTx) {
        let deadline = self.shared.request_timeout;
        let shared = self.shared.clone();
        let outcome = tokio::select! {
            r = async {
                match deadline {
                    Some(d) => tokio::time::timeout(d, self.execute(&tx)).await.unwrap_or_else(|_| {
                        Err(RouterError::DeadlineExceeded(format!(
                            "request took longer than --request-timeout-ms {}",
                            d.as_millis()
                        )))
                    }),
                    None => self.execute(&tx).await,
                }
            } => r,
            _ = tx.closed() => Err(RouterError::Cancelled("the client went away".into())),
            _ = shared.cancelled() => Err(RouterError::Unavailable(format!(
                "{DRAINING}: --drain-timeout-ms passed before the request finished"
            ))),
        };
        self.record(&outcome);
        if let Err(e) = outcome {
            if !matches!(e, RouterError::Cancelled(_)) {
                let _ = tx.send(Err(e.client_status(Some(&self.request_id)))).await;
            }
        }
        // `self` (and its Cleanup) drops here: counters, Release calls.
    }

    /// Counts and logs how the request ended.
    fn record(&self, outcome: &Result<(), RouterError>) {
        let elapsed = self.ticket.received.elapsed();
        let total_ms = elapsed.as_secs_f64() * 1e3;
        let m = &self.shared.metrics;
        if !self.out.streamed_any() {
            m.queue_depth.dec(); // never got its first token
        }
        let api = self.ticket.api.label();
        match outcome {
            Ok(()) => {
                m.e2e.observe(elapsed.as_secs_f64());
                m.finished(api, Outcome::Ok, None);
                // OpenAI's reasons, as vLLM counts them: a length limit, or a stop of any kind.
                m.succeeded(self.out.finish().map_or("stop", |f| f.as_str()));
                tracing::info!(
                    request_id = %self.request_id,
                    prompt_tokens = self.out.prompt().len(),
                    completion_tokens = self.out.completion_tokens(),
                    choices = self.n,
                    migrations = self.moves.made(),
                    finish = self.out.finish().map_or("", |f| f.as_str()),
                    ttft_ms = self.out.timings().ttft_ms,
                    total_ms,
                    "request finished"
                );
            }
            Err(RouterError::Cancelled(why)) => {
                m.finished(api, Outcome::Cancelled, None);
                tracing::info!(request_id = %self.request_id, generated = self.out.completion_tokens(), "request cancelled: {why}");
            }
            Err(e) => {
                m.finished(api, Outcome::Error, Some(e.kind()));
                tracing::warn!(request_id = %self.request_id, kind = e.kind(), "request failed: {e}");
            }
        }
    }

    /// Runs the request, moving it to another worker each time the one holding its sequence is
    /// lost, as long as `--max-migrations` allows and another worker can take it.
    async fn execute(&mut self, tx: &ResponseTx) -> Result<(), RouterError> {
        loop {
            match self.attempt(tx).await {
                Ok(()) => return Ok(()),
                Err(RunError::Fatal(e)) => return Err(e),
                Err(RunError::Lost { worker, error }) => self.migrate(&worker, error).await?,
                Err(RunError::Recompute { decode, error }) => self.recompute_on(&decode, error)?,
            }
        }
    }

    /// The prompt's KV transfer into `decode` failed after the prefill worker computed it:
    /// release the reservation it was filling and let `decode` compute the prompt itself (its
    /// prefix cache still supplies the blocks it held). Fails with `error` under
    /// `--prefill-fallback fail`.
    fn recompute_on(&mut self, decode: &Target, error: RouterError) -> Result<(), RouterError> {
        if !self.shared.decode_prefills {
            tracing::warn!(
                request_id = %self.request_id,
                worker = %decode.worker_id,
                "KV transfer failed; --prefill-fallback fail: the request fails ({error})"
            );
            return Err(error);
        }
        // Only the reservation: the request goes on on the same worker.
        self.cleanup.release_left(decode, true);
        let plan = Plan::Colocated { worker: decode.clone() };
        // The prefill worker's count came off when it answered; the decode worker's stays.
        self.cleanup.counted_on(&plan, self.current.prompt().len() as u64);
        self.plan = plan;
        self.fallback = Some(DecodePrefill::KvTransferFailed);
        tracing::info!(
            request_id = %self.request_id,
            worker = %decode.worker_id,
            "KV transfer failed; the decode worker computes the prompt itself ({error})"
        );
        Ok(())
    }

    /// The worker `lost` no longer holds the sequence: release whatever it may still hold,
    /// choose another worker (never one the request lost) and make the tokens streamed so far
    /// part of the prompt it computes. Fails with `error` when `--max-migrations` is used up or
    /// no other worker can take the request.
    async fn migrate(&mut self, lost: &Target, error: RouterError) -> Result<(), RouterError> {
        if self.moves.exhausted() {
            return Err(self.stuck(lost, Stuck::Exhausted, error));
        }
        if self.n > 1 && self.out.streamed_any() {
            // Each choice would continue from its own tokens: a prompt of its own each.
            return Err(self.stuck(lost, Stuck::Choices, error));
        }
        // The prefill worker is lost before it answered, or the worker holding the sequence.
        let phase = match &self.plan {
            Plan::Split { prefill, .. } if prefill.worker_id == lost.worker_id => "prefill",
            _ => "decode",
        };
        let old_decoder = self.plan.decoder().clone();
        self.cleanup.prefill_pending = false;
        self.cleanup.uncount_prefill();
        let next = resume(&self.original, self.out.tokens()).map_err(|e| {
            RouterError::concealed(
                tonic::Code::Internal,
                INTERNAL,
                format!("the streamed tokens cannot continue the request: {e}"),
            )
        })?;
        // What the old decode worker holds for the request (a reservation a lost prefill worker
        // may still be writing, or the sequence of a lost decode worker) is released now, before
        // any wait for a worker: the next attempt reserves afresh, so no block a late write could
        // reach is used again, and nothing stays held meanwhile.
        self.cleanup.release_left(&old_decoder, phase == "prefill");
        if phase == "prefill" {
            // The lost prefill worker may still hold the prompt (frozen, or going away).
            self.cleanup.release_prompt(lost);
        }
        let model_id = self.shared.model.model_id.clone();
        let block_sizes = self.shared.with_registry(|r| r.block_sizes());
        let blocks = placement::prompt_blocks(&next, &model_id, &block_sizes);
        let (old, moves) = (&self.plan, &mut self.moves);
        let plan = match self.shared.with_registry(|r| moves.leave(r, old, lost, &blocks)) {
            Ok(plan) => plan,
            Err(Stuck::Nowhere) if !self.out.streamed_any() && !self.shared.lost_worker_wait.is_zero() => {
                match self.wait_for_worker(lost, &blocks).await {
                    Ok(plan) => plan,
                    Err(why) => return Err(self.stuck(lost, why, error)),
                }
            }
            Err(why) => return Err(self.stuck(lost, why, error)),
        };
        self.shared.metrics.migrations.with_label_values(&[phase]).inc();
        tracing::info!(
            request_id = %self.request_id,
            from = %lost.worker_id,
            to = %match &plan {
                Plan::Split { prefill, decode, .. } => format!("{} + {}", prefill.worker_id, decode.worker_id),
                Plan::Colocated { worker } => worker.worker_id.clone(),
            },
            phase,
            generated = self.out.tokens().len(),
            "worker lost: request moved ({error})"
        );
        self.current = next;
        self.blocks = blocks;
        self.cleanup.counted_on(&plan, self.current.prompt().len() as u64);
        self.plan = plan;
        Ok(())
    }

    /// The request lost `lost` before its first token and no other worker can take it now: wait
    /// up to `--lost-worker-wait-ms` for one that can (the lost worker restarted and registered
    /// again, or another joined), polling the registry. The drain, the request's deadline and the
    /// client going away still end the wait (they end the whole request).
    async fn wait_for_worker(&mut self, lost: &Target, blocks: &PromptBlocks) -> Result<Plan, Stuck> {
        let wait = self.shared.lost_worker_wait;
        let deadline = tokio::time::Instant::now() + wait;
        tracing::info!(
            request_id = %self.request_id,
            worker = %lost.worker_id,
            wait_ms = wait.as_millis() as u64,
            "worker lost and no other worker can take the request now; waiting for one"
        );
        let outcome = loop {
            tokio::time::sleep(
                WORKER_POLL.min(deadline.saturating_duration_since(tokio::time::Instant::now())),
            )
            .await;
            if self.shared.draining() {
                break Err(Stuck::Nowhere);
            }
            let (old, moves) = (&self.plan, &mut self.moves);
            match self.shared.with_registry(|r| moves.rejoin(r, old, blocks)) {
                Err(Stuck::Nowhere) if tokio::time::Instant::now() < deadline => continue,
                other => break other,
            }
        };
        let label = if outcome.is_ok() { "resumed" } else { "gave_up" };
        self.shared.metrics.lost_worker_waits.with_label_values(&[label]).inc();
        outcome
    }

    /// Logs why the request could not leave `lost`, and returns the error it fails with.
    fn stuck(&self, lost: &Target, why: Stuck, error: RouterError) -> RouterError {
        match why {
            Stuck::Exhausted => tracing::warn!(
                request_id = %self.request_id,
                worker = %lost.worker_id,
                migrations = self.moves.made(),
                "worker lost; --max-migrations {} reached",
                self.shared.max_migrations
            ),
            Stuck::Nowhere => tracing::warn!(
                request_id = %self.request_id,
                worker = %lost.worker_id,
                "worker lost; no other worker can continue the request"
            ),
            Stuck::Choices => tracing::warn!(
                request_id = %self.request_id,
                worker = %lost.worker_id,
                choices = self.n,
                "worker lost; a request of several choices does not move once tokens were streamed"
            ),
        }
        error
    }

    /// The chosen decode worker refused the Reserve (full or draining): choose workers again
    /// (another worker may have room, or the load reports changed) and move the request's counts
    /// to them. When no other choice can hold the prompt, the request stays where it is.
    fn replan(&mut self) {
        let (old, blocks, lost) = (&self.plan, &self.blocks, self.moves.lost());
        let plan = self.shared.with_registry(|r| placement::replan(r, old, blocks, lost));
        self.cleanup.counted_on(&plan, self.current.prompt().len() as u64);
        self.plan = plan;
    }

    /// Whether the request could move off `t` now: a migration is left, and another worker can
    /// take the prompt and the tokens streamed so far.
    fn can_move(&self, t: &Target) -> bool {
        if self.n > 1 && self.out.streamed_any() {
            return false;
        }
        let len = self.out.prompt().len() + self.out.tokens().len();
        let adapter = self.blocks.adapter();
        self.shared.with_registry(|r| self.moves.could_leave(r, t, len, adapter))
    }
}
