//! One request's life: pick workers, `Reserve` on the decode worker, `Prefill` on the prefill
//! worker (which moves the KV blocks into the reservation), `Decode` on the decode worker, and
//! stream tokens and text to the client.
//!
//! With prefix caching, `Reserve` carries the prompt and its salt; a decode worker that already
//! holds the prompt's leading blocks says how many (`cached_blocks`) and reserves only the rest,
//! and `Prefill` is told to skip them. The router checks that answer (the block of the last prompt
//! token is always sent) and reports the prompt tokens a worker did not compute in the usage.
//!
//! Text is produced exactly as the in-process engine (`tandem_engine::scheduler::Engine`) produces it: every token
//! goes through an [`IncrementalDecoder`] and a [`StopChecker`] built from the same parameters, the
//! context limit ends the sequence the same way, and the final flush is the same, so greedy output
//! (token ids and text) equals `tandem generate`'s.
//!
//! Migration: when the worker holding a sequence is lost mid-stream (its call fails at the
//! transport, it answers UNAVAILABLE, it ends the stream without a finish reason, a KV transfer
//! into it fails and it does not answer a probe, or the registry gave up on it, for missed
//! heartbeats or as unhealthy, and its stream has been silent as long), the request moves to
//! another decode (or colocated) worker, at most `--max-migrations` times. The new worker is
//! given the prompt followed by every token already streamed as its prompt, and `max_tokens` less
//! those tokens; it computes that prompt (its prefix cache may hold part of it) and continues from
//! the next token. The router's detokenizer and stop checker already hold the streamed tokens, so
//! they only see the new ones: the client's stream goes on without a gap or a repeat, and greedy
//! output equals an uninterrupted run. Sampled output stays a valid sample but is not the random
//! stream the first worker would have drawn. A worker that answers with an error of its own
//! (INVALID_ARGUMENT, INTERNAL, ...) is not lost: the request fails as before.
//!
//! Cleanup is a drop guard ([`Cleanup`]): whatever way the request ends — finished, failed, client
//! gone, deadline — it un-counts the request in the registry and sends `Release` to each worker
//! that may still hold something for it. Dropping a worker call's future resets its HTTP/2 stream,
//! which the worker treats as a cancellation too.

use std::sync::Arc;
use std::time::Instant;

use tandem_proto::v1::worker_client::WorkerClient;
use tandem_proto::v1::{
    DecodeRequest, DecodeResponse, GenerateRequest, GenerateResponse, InfoRequest, KvDestination,
    PrefillRequest, ReserveRequest, ReserveResponse, Timings, TransportOffer, Usage,
};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit};
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::error::{is_transport_failure, RouterError};
use crate::metrics::Outcome;
use crate::registry::{Plan, PromptBlocks, Target, MISSED_HEARTBEATS};
use crate::request::{check_length, prepare, Prepared};
use crate::workers::{self, RESERVE_CALL};
use crate::{InFlight, Shared};
use tandem_model::stop::{FinishReason, StopChecker};
use tandem_model::tokenizer::IncrementalDecoder;
use tandem_serve::auth::cluster_request;

/// Messages buffered towards a slow client before the router stops reading the decode stream.
const STREAM_BUFFER: usize = 32;

/// First pause before asking again for KV blocks when every decode worker is full; it doubles
/// up to [`KV_WAIT_MAX_PAUSE`] while the request waits (at most `--kv-wait-ms`).
const KV_WAIT_FIRST_PAUSE: std::time::Duration = std::time::Duration::from_millis(5);
const KV_WAIT_MAX_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);

/// How long a worker suspected lost gets to answer `Info`.
const PROBE: std::time::Duration = std::time::Duration::from_secs(1);

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

/// The client-facing stream of one request.
pub type ResponseRx = mpsc::Receiver<Result<GenerateResponse, Status>>;

/// How one attempt at running a request on its chosen workers ended, when it did not finish it.
#[derive(Debug)]
enum RunError {
    /// The request fails with this error.
    Fatal(RouterError),
    /// The worker holding the sequence was lost; the request may move to another one, and fails
    /// with `error` when it cannot.
    Lost { worker: Target, error: RouterError },
}

impl From<RouterError> for RunError {
    fn from(e: RouterError) -> RunError {
        RunError::Fatal(e)
    }
}

/// Whether a failed call means the worker (not the request) is gone: it could not be reached, or
/// it said it is going away. Such a failure moves the request; any other answer ends it.
fn is_worker_loss(st: &Status) -> bool {
    is_transport_failure(st) || st.code() == Code::Unavailable
}

/// The client API a request came in on (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `tandem.v1.Tandem/Generate`.
    Grpc,
    /// The OpenAI-compatible HTTP API.
    Http,
}

impl Api {
    /// `grpc` or `http`.
    pub fn label(self) -> &'static str {
        match self {
            Api::Grpc => "grpc",
            Api::Http => "http",
        }
    }
}

/// Counts a request refused before [`start`] could run it (bad JSON, missing API key, ...).
pub(crate) fn refused(shared: &Shared, api: Api, e: &RouterError) {
    shared.metrics.finished(api.label(), Outcome::Error, Some(e.kind()));
}

/// Validates `req`, picks its workers and starts it; the returned receiver streams its responses.
/// Errors before anything runs (draining, bad request, no worker, overloaded) are returned
/// directly. Every request, refused or run, is counted in the metrics under `api`.
pub(crate) async fn start(
    shared: Arc<Shared>,
    req: GenerateRequest,
    api: Api,
) -> Result<ResponseRx, RouterError> {
    let received = Instant::now();
    // Counted before the draining check: a drain either sees this request or refuses it.
    let inflight = shared.enter();
    let a = match admit(&shared, req).await {
        Ok(a) => a,
        Err(e) => {
            refused(&shared, api, &e);
            return Err(e);
        }
    };
    let (request_id, plan) = (a.request_id, a.plan);
    tracing::debug!(request_id, prompt_tokens = a.prepared.prompt.len(), ?plan, "request accepted");
    shared.metrics.prompt_tokens.inc_by(a.prepared.prompt.len() as u64);
    if routed_by_cache(&plan) {
        shared.metrics.cache_routed.inc();
    }
    shared.metrics.queue_depth.inc();
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let ticket = Ticket { received, api, _permit: a.permit, _inflight: inflight };
    let run = Run::new(shared, request_id, plan, a.prepared, a.blocks, ticket);
    tokio::spawn(run.drive(tx));
    Ok(rx)
}

/// Whether a worker chosen for the request was known to hold the start of its prompt.
fn routed_by_cache(plan: &Plan) -> bool {
    match plan {
        Plan::Split { prefill, decode, .. } => prefill.overlap > 0 || decode.overlap > 0,
        Plan::Colocated { worker } => worker.overlap > 0,
    }
}

/// A request let in: validated, its prompt's blocks named, its workers chosen and counted.
struct Admitted {
    prepared: Prepared,
    blocks: PromptBlocks,
    plan: Plan,
    request_id: String,
    permit: OwnedSemaphorePermit,
}

async fn admit(shared: &Arc<Shared>, req: GenerateRequest) -> Result<Admitted, RouterError> {
    if shared.draining() {
        return Err(RouterError::Unavailable(DRAINING.into()));
    }
    let permit = shared.permits.clone().try_acquire_owned().map_err(|_| {
        RouterError::ResourceExhausted(format!(
            "the router already has {} requests in flight (--max-queue); retry later",
            shared.max_queue
        ))
    })?;
    let tok = shared.model.tokenizer.clone();
    let vocab = shared.model.config.vocab_size;
    let seed = rand::random::<u64>();
    let client_id = req.request_id.clone();
    let model_id = shared.model.model_id.clone();
    let block_sizes = shared.with_registry(|r| r.block_sizes());
    // Tokenizing a long prompt, rendering a template and hashing the prompt's blocks are CPU
    // work: keep them off the async threads. The blocks are named once per request, in the
    // namespace the workers use (the model id of the compatibility record and the request's salt).
    let (prepared, blocks) = tokio::task::spawn_blocking(move || {
        let prepared = prepare(&tok, vocab, &req, seed)?;
        let blocks =
            PromptBlocks::new(&prepared.prompt, &model_id, &prepared.engine.cache_salt, &block_sizes);
        Ok::<_, RouterError>((prepared, blocks))
    })
    .await
    .map_err(|e| RouterError::concealed(Code::Internal, INTERNAL, format!("tokenizer task failed: {e}")))??;

    let plan = shared.with_registry(|r| {
        let plan = r.pick(&blocks).map_err(RouterError::Unavailable)?;
        check_length(blocks.tokens(), plan.max_sequence_len())?;
        r.begin(&plan, &blocks);
        Ok::<_, RouterError>(plan)
    })?;
    let request_id = shared.claim_request_id(&client_id);
    Ok(Admitted { prepared, blocks, plan, request_id, permit })
}

/// Decides what happens to the request's workers when it ends, whatever the way.
struct Cleanup {
    shared: Arc<Shared>,
    request_id: String,
    plan: Plan,
    prompt_tokens: u64,
    /// The prompt still counts against the prefill worker's queue in the registry.
    prefill_counted: bool,
    /// The prefill worker has the prompt (Prefill sent, not answered).
    prefill_pending: bool,
    /// The decode worker may hold a reservation or a sequence: release this reservation id.
    decode_release: Option<u64>,
}

impl Cleanup {
    /// The prefill worker is done with the prompt (answered, failed, or was never asked).
    fn uncount_prefill(&mut self) {
        if let (Plan::Split { prefill, .. }, true) = (&self.plan, self.prefill_counted) {
            self.prefill_counted = false;
            let tokens = self.prompt_tokens;
            self.shared.with_registry(|r| r.prefill_done(&prefill.worker_id, tokens));
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        self.uncount_prefill();
        let shared = self.shared.clone();
        let prefill_pending = self.prefill_pending;
        shared.with_registry(|r| r.request_done(&self.plan.decoder().worker_id));
        shared.free_request_id(&self.request_id);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // the runtime is gone: so is the process, and the workers cancel on disconnect
        };
        let mut releases: Vec<(&Target, u64)> = Vec::new();
        if let (Plan::Split { prefill, .. }, true) = (&self.plan, prefill_pending) {
            releases.push((prefill, 0));
        }
        if let Some(res) = self.decode_release {
            releases.push((self.plan.decoder(), res));
        }
        for (t, res) in releases {
            rt.spawn(workers::release(
                shared.clone(),
                t.worker_id.clone(),
                t.address.clone(),
                self.request_id.clone(),
                res,
            ));
        }
    }
}

/// A request's place in the router's line for KV blocks. Requests that found the decode workers
/// full are served first come, first served: the head of the line holds the lock and retries,
/// the others wait for it, and a new request queues behind them instead of overtaking. Dropping
/// the place (reserved, failed, or the client went away) lets the next request go.
struct KvLine {
    shared: Arc<Shared>,
    _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

/// Why a request got no place at the head of the line for KV blocks.
enum NoTurn {
    /// `--max-kv-waiting` requests were in the line already.
    Full,
    /// The turn did not come before the deadline.
    TimedOut,
}

impl KvLine {
    /// Joins the line and waits for the turn, for at most `limit`; a full line is refused at once.
    async fn join(shared: &Arc<Shared>, limit: std::time::Duration) -> Result<KvLine, NoTurn> {
        shared.metrics.kv_waiting.inc();
        let mut place = KvLine { shared: shared.clone(), _turn: None };
        // Counted first, then checked: two requests racing for the last place may both be
        // refused, but the line never grows past the limit.
        if shared.metrics.kv_waiting.get() > shared.max_kv_waiting as i64 {
            return Err(NoTurn::Full);
        }
        let turn = tokio::time::timeout(limit, shared.kv_line.clone().lock_owned())
            .await
            .map_err(|_| NoTurn::TimedOut)?;
        place._turn = Some(turn);
        Ok(place)
    }
}

impl Drop for KvLine {
    fn drop(&mut self) {
        self.shared.metrics.kv_waiting.dec();
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

struct Run {
    shared: Arc<Shared>,
    request_id: String,
    plan: Plan,
    /// The client's prompt (what the usage reports and the context limit counts from).
    prompt: Vec<u32>,
    /// What the current workers take as the prompt: the client's prompt, followed (after a
    /// migration) by the tokens streamed before it.
    input: Vec<u32>,
    /// The named blocks of `input`, for choosing workers again.
    blocks: PromptBlocks,
    /// What the current workers are told; after a migration `max_tokens` counts what is left.
    engine: tandem_proto::v1::EngineParams,
    /// `max_tokens` and `seed` as the request resolved them.
    max_tokens: u32,
    seed: u64,
    decoder: IncrementalDecoder,
    stop: StopChecker,
    /// The tokens sent to the client, in order.
    output: Vec<u32>,
    /// Times the request moved to another worker, and the workers it lost (never chosen again).
    migrations: u32,
    lost: Vec<String>,
    finish: Option<FinishReason>,
    sent_first: bool,
    /// When the latest token message went to the client (inter-token latency).
    last_sent: Option<Instant>,
    timings: Timings,
    /// Prompt tokens a worker took from its prefix cache, once it said so.
    cached_tokens: Option<u32>,
    cleanup: Cleanup,
    ticket: Ticket,
}

impl Run {
    fn new(
        shared: Arc<Shared>,
        request_id: String,
        plan: Plan,
        p: Prepared,
        blocks: PromptBlocks,
        ticket: Ticket,
    ) -> Run {
        let tok = &shared.model.tokenizer;
        let decoder = IncrementalDecoder::new(tok, &p.prompt, true);
        let stop = StopChecker::new(&p.params, tok.eos_token_ids());
        let cleanup = Cleanup {
            shared: shared.clone(),
            request_id: request_id.clone(),
            plan: plan.clone(),
            prompt_tokens: p.prompt.len() as u64,
            prefill_counted: matches!(plan, Plan::Split { .. }),
            prefill_pending: false,
            decode_release: None,
        };
        Run {
            shared,
            request_id,
            plan,
            input: p.prompt.clone(),
            prompt: p.prompt,
            blocks,
            max_tokens: p.engine.max_tokens,
            seed: p.engine.seed,
            engine: p.engine,
            decoder,
            stop,
            output: Vec::new(),
            migrations: 0,
            lost: Vec::new(),
            finish: None,
            sent_first: false,
            last_sent: None,
            timings: Timings::default(),
            cached_tokens: None,
            cleanup,
            ticket,
        }
    }

    /// Runs the request to its end, racing the client's disconnect, the deadline and the end of
    /// a drain.
    async fn drive(mut self, tx: mpsc::Sender<Result<GenerateResponse, Status>>) {
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
        let elapsed = self.ticket.received.elapsed();
        let total_ms = elapsed.as_secs_f64() * 1e3;
        let m = &self.shared.metrics;
        if self.last_sent.is_none() {
            m.queue_depth.dec(); // never got its first token
        }
        match &outcome {
            Ok(()) => {
                m.e2e.observe(elapsed.as_secs_f64());
                m.finished(self.ticket.api.label(), Outcome::Ok, None);
            }
            Err(RouterError::Cancelled(_)) => m.finished(self.ticket.api.label(), Outcome::Cancelled, None),
            Err(e) => m.finished(self.ticket.api.label(), Outcome::Error, Some(e.kind())),
        }
        match outcome {
            Ok(()) => tracing::info!(
                request_id = %self.request_id,
                prompt_tokens = self.prompt.len(),
                completion_tokens = self.output.len(),
                migrations = self.migrations,
                finish = self.finish.as_ref().map_or("", |f| f.as_str()),
                ttft_ms = self.timings.ttft_ms,
                total_ms,
                "request finished"
            ),
            Err(RouterError::Cancelled(why)) => {
                tracing::info!(request_id = %self.request_id, generated = self.output.len(), "request cancelled: {why}")
            }
            Err(e) => {
                tracing::warn!(request_id = %self.request_id, kind = e.kind(), "request failed: {e}");
                let _ = tx.send(Err(e.client_status(Some(&self.request_id)))).await;
            }
        }
        // `self` (and its Cleanup) drops here: counters, Release calls.
    }

    fn client(&self, t: &Target) -> Result<WorkerClient<Channel>, RouterError> {
        let ch = self.shared.channel(&t.address).map_err(|e| {
            RouterError::concealed(Code::Unavailable, UNREACHABLE, format!("{}: {e}", t.describe()))
        })?;
        Ok(WorkerClient::new(ch))
    }

    /// A worker call failed: name the worker, choose the client's code, and take the worker out of
    /// selection when it could not be reached.
    fn worker_error(&self, t: &Target, call: &str, st: Status) -> RouterError {
        let transport = is_transport_failure(&st);
        let detail = if st.message().is_empty() {
            st.code().description().to_owned()
        } else {
            st.message().to_owned()
        };
        let msg = format!("{} failed in {call} for request {}: {detail}", t.describe(), self.request_id);
        if transport {
            self.shared.with_registry(|r| r.mark_unhealthy(&t.worker_id, &msg));
        }
        let (code, public) = match st.code() {
            Code::InvalidArgument => (Code::InvalidArgument, REFUSED),
            Code::ResourceExhausted => (Code::ResourceExhausted, FULL),
            _ if !self.sent_first && (transport || st.code() == Code::Unavailable) => {
                (Code::Unavailable, UNREACHABLE)
            }
            _ => (Code::Aborted, FAILED),
        };
        RouterError::concealed(code, public, msg)
    }

    /// A call to the worker holding (or about to hold) the sequence failed: a loss when the
    /// worker is gone, else the request's end.
    fn call_failed(&self, t: &Target, call: &str, st: Status) -> RunError {
        let lost = is_worker_loss(&st);
        let error = self.worker_error(t, call, st);
        if lost {
            RunError::Lost { worker: t.clone(), error }
        } else {
            RunError::Fatal(error)
        }
    }

    /// The worker `lost` no longer holds the sequence: release whatever it may still hold,
    /// choose another worker (never one the request lost) and make the tokens streamed so far
    /// part of the prompt it computes. Fails with `error` when `--max-migrations` is used up or
    /// no other worker can take the request.
    fn migrate(&mut self, lost: &Target, error: RouterError) -> Result<(), RouterError> {
        if self.migrations >= self.shared.max_migrations {
            tracing::warn!(
                request_id = %self.request_id,
                worker = %lost.worker_id,
                migrations = self.migrations,
                "worker lost; --max-migrations {} reached",
                self.shared.max_migrations
            );
            return Err(error);
        }
        if !self.lost.contains(&lost.worker_id) {
            self.lost.push(lost.worker_id.clone());
        }
        self.cleanup.prefill_pending = false;
        self.cleanup.uncount_prefill();
        let mut input = self.prompt.clone();
        input.extend_from_slice(&self.output);
        let model_id = self.shared.model.model_id.clone();
        let block_sizes = self.shared.with_registry(|r| r.block_sizes());
        let blocks = PromptBlocks::new(&input, &model_id, &self.engine.cache_salt, &block_sizes);
        let old = self.plan.clone();
        let lost_ids = &self.lost;
        let plan = self.shared.with_registry(|r| {
            let plan = r.pick_avoiding(&blocks, lost_ids).ok()?;
            check_length(input.len(), plan.max_sequence_len()).ok()?;
            r.request_done(&old.decoder().worker_id);
            r.begin(&plan, &blocks);
            Some(plan)
        });
        let Some(plan) = plan else {
            tracing::warn!(
                request_id = %self.request_id,
                worker = %lost.worker_id,
                "worker lost; no other worker can continue the request"
            );
            return Err(error);
        };
        // The lost worker may still hold blocks (a frozen worker that comes back): release them.
        if let (Some(res), Ok(rt)) =
            (self.cleanup.decode_release.take(), tokio::runtime::Handle::try_current())
        {
            rt.spawn(workers::release(
                self.shared.clone(),
                lost.worker_id.clone(),
                lost.address.clone(),
                self.request_id.clone(),
                res,
            ));
        }
        self.migrations += 1;
        self.shared.metrics.migrations.inc();
        tracing::info!(
            request_id = %self.request_id,
            from = %lost.worker_id,
            to = %plan.decoder().worker_id,
            generated = self.output.len(),
            "worker lost: request moved ({error})"
        );
        // What is left to generate; the router's stop checker still counts from the start. A
        // fresh seed: the continuation is a valid sample, not a replay of the first worker's
        // random stream.
        self.engine.max_tokens = self.max_tokens.saturating_sub(self.output.len() as u32).max(1);
        self.engine.seed = self.seed ^ (self.output.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.input = input;
        self.blocks = blocks;
        self.cleanup.prompt_tokens = self.input.len() as u64;
        self.cleanup.prefill_counted = matches!(plan, Plan::Split { .. });
        self.cleanup.plan = plan.clone();
        self.plan = plan;
        Ok(())
    }

    /// Runs the request, moving it to another worker each time the one holding its sequence is
    /// lost, as long as `--max-migrations` allows and another worker can take it.
    async fn execute(
        &mut self,
        tx: &mpsc::Sender<Result<GenerateResponse, Status>>,
    ) -> Result<(), RouterError> {
        loop {
            match self.attempt(tx).await {
                Ok(()) => return Ok(()),
                Err(RunError::Fatal(e)) => return Err(e),
                Err(RunError::Lost { worker, error }) => self.migrate(&worker, error)?,
            }
        }
    }

    /// Runs the request on its chosen workers: Reserve (choosing again while decode workers are
    /// full or draining), then the split or colocated path.
    async fn attempt(&mut self, tx: &mpsc::Sender<Result<GenerateResponse, Status>>) -> Result<(), RunError> {
        let waiting_since = Instant::now();
        let mut pause = KV_WAIT_FIRST_PAUSE;
        let mut line: Option<KvLine> = None;
        loop {
            let (prefill, decode, transport) = match self.plan.clone() {
                Plan::Split { prefill, decode, transport } => (prefill, decode, transport),
                Plan::Colocated { worker } => return self.run_colocated(&worker, tx).await,
            };
            if line.is_none() && self.shared.metrics.kv_waiting.get() > 0 {
                // Earlier requests are waiting for KV blocks: queue behind them.
                line = Some(self.join_line(waiting_since, &decode).await?);
                self.replan();
                continue;
            }
            let mut d = self.client(&decode)?;
            let res = match self.reserve(&mut d).await {
                Ok(res) => {
                    drop(line.take()); // the next request in line takes its turn
                    res
                }
                Err(st) if st.code() == Code::ResourceExhausted => {
                    // The worker answered: it holds nothing for this request.
                    self.cleanup.decode_release = None;
                    self.shared.with_registry(|r| r.no_room(&decode.worker_id));
                    if self.shared.draining() {
                        return Err(RouterError::Unavailable(format!(
                            "{DRAINING}: the request was still waiting for free KV blocks"
                        ))
                        .into());
                    }
                    let waited = waiting_since.elapsed();
                    if waited + pause > self.shared.kv_wait {
                        let msg = if self.shared.kv_wait.is_zero() {
                            format!("{} (--kv-wait-ms 0: no waiting)", st.message())
                        } else {
                            format!(
                                "no decode worker had free KV blocks for this prompt within --kv-wait-ms {} (last answer from {}: {})",
                                self.shared.kv_wait.as_millis(),
                                decode.describe(),
                                st.message()
                            )
                        };
                        return Err(RouterError::concealed(Code::ResourceExhausted, NO_BLOCKS, msg).into());
                    }
                    self.shared.metrics.kv_waits.inc();
                    tracing::debug!(
                        request_id = %self.request_id,
                        worker = %decode.worker_id,
                        waited_ms = waited.as_millis() as u64,
                        "decode worker full; waiting for free KV blocks"
                    );
                    if line.is_none() {
                        // Join the line; at its head, try again at once.
                        line = Some(self.join_line(waiting_since, &decode).await?);
                    } else {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(KV_WAIT_MAX_PAUSE);
                    }
                    self.replan();
                    continue;
                }
                Err(st) if st.code() == Code::Unavailable && !is_transport_failure(&st) => {
                    // The worker is draining (its next report would say so) and reserved
                    // nothing: move to another decode worker if there is one.
                    self.cleanup.decode_release = None;
                    self.shared.with_registry(|r| r.mark_draining(&decode.worker_id));
                    self.replan();
                    if self.plan.decoder().worker_id == decode.worker_id {
                        return Err(self.worker_error(&decode, "Reserve", st).into());
                    }
                    tracing::debug!(request_id = %self.request_id, worker = %decode.worker_id, "decode worker draining; request moved");
                    continue;
                }
                Err(st) => return Err(self.call_failed(&decode, "Reserve", st)),
            };
            return self.run_split(&prefill, &decode, &mut d, &transport, res, tx).await;
        }
    }

    /// Waits for this request's turn in the line for KV blocks, until `--kv-wait-ms` after
    /// `since` at most.
    async fn join_line(&self, since: Instant, decode: &Target) -> Result<KvLine, RouterError> {
        let limit = self.shared.kv_wait.saturating_sub(since.elapsed());
        let ahead = self.shared.metrics.kv_waiting.get();
        KvLine::join(&self.shared, limit).await.map_err(|why| match why {
            NoTurn::Full => RouterError::ResourceExhausted(format!(
                "the cluster is at capacity: {} requests already wait for KV blocks (--max-kv-waiting); retry later",
                self.shared.max_kv_waiting
            )),
            NoTurn::TimedOut => RouterError::concealed(Code::ResourceExhausted, NO_BLOCKS, format!(
                "no decode worker had free KV blocks for this prompt within --kv-wait-ms {} ({ahead} earlier request(s) were waiting for blocks; last worker chosen: {})",
                self.shared.kv_wait.as_millis(),
                decode.describe()
            ))
        })
    }

    /// Asks the decode worker behind `d` for blocks for the whole prompt; with the prompt and its
    /// salt, a worker that caches the prompt's leading blocks keeps those and reserves the rest.
    /// The caller maps the error.
    async fn reserve(&mut self, d: &mut WorkerClient<Channel>) -> Result<ReserveResponse, Status> {
        let shared = self.shared.clone();
        let num_tokens = self.input.len() as u32;
        let mut req = cluster_request(
            shared.cluster_secret.as_ref(),
            ReserveRequest {
                request_id: self.request_id.clone(),
                num_tokens,
                prompt_token_ids: self.input.clone(),
                cache_salt: self.engine.cache_salt.clone(),
            },
        );
        req.set_timeout(RESERVE_CALL);
        self.cleanup.decode_release = Some(0); // a Reserve in flight may still land
        Ok(d.reserve(req).await?.into_inner())
    }

    /// The chosen decode worker refused the Reserve (full or draining): choose workers again
    /// (another worker may have room, or the load reports changed) and move the request's counts
    /// to them. When no other choice can hold the prompt, the request stays where it is.
    fn replan(&mut self) {
        let old = self.plan.clone();
        let prompt_len = self.input.len();
        let (blocks, lost) = (&self.blocks, &self.lost);
        let plan = self.shared.with_registry(|r| {
            if let Plan::Split { prefill, .. } = &old {
                r.prefill_done(&prefill.worker_id, prompt_len as u64);
            }
            r.request_done(&old.decoder().worker_id);
            let plan = match r.pick_avoiding(blocks, lost) {
                Ok(p) if check_length(prompt_len, p.max_sequence_len()).is_ok() => p,
                _ => old,
            };
            r.begin(&plan, blocks);
            plan
        });
        self.cleanup.prefill_counted = matches!(plan, Plan::Split { .. });
        self.cleanup.plan = plan.clone();
        self.plan = plan;
    }

    /// The disaggregated path: `res` holds the prompt's blocks on `decode` (reached through the
    /// client `d` that reserved them); `prefill` fills them over `transport`, then `decode`
    /// continues the sequence.
    async fn run_split(
        &mut self,
        prefill: &Target,
        decode: &Target,
        d: &mut WorkerClient<Channel>,
        transport: &TransportOffer,
        res: ReserveResponse,
        tx: &mpsc::Sender<Result<GenerateResponse, Status>>,
    ) -> Result<(), RunError> {
        let mut p = self.client(prefill)?;
        let num_tokens = self.input.len();
        let shared = self.shared.clone();
        let secret = shared.cluster_secret.as_ref();
        self.cleanup.decode_release = Some(res.reservation_id);
        let skip = check_reservation(decode, num_tokens, &res)?;

        let req = PrefillRequest {
            request_id: self.request_id.clone(),
            prompt_token_ids: self.input.clone(),
            params: Some(self.engine.clone()),
            destination: Some(KvDestination {
                worker_id: decode.worker_id.clone(),
                transport: transport.kind.clone(),
                address: transport.address.clone(),
                segment_path: transport.segment_path.clone(),
                reservation_id: res.reservation_id,
                block_ids: res.block_ids.clone(),
                skip_blocks: skip,
                ipc_handle: transport.ipc_handle.clone(),
                pool_blocks: transport.pool_blocks,
                device_uuid: transport.device_uuid.clone(),
            }),
        };
        self.cleanup.prefill_pending = true;
        let answer = p.prefill(cluster_request(secret, req)).await;
        self.cleanup.prefill_pending = false;
        self.cleanup.uncount_prefill();
        let pre = match answer {
            Ok(a) => a.into_inner(),
            Err(st) => {
                // UNAVAILABLE or ABORTED from the prefill worker itself: moving the KV blocks may
                // have failed because the decode worker is gone (or the prefill worker is
                // draining). Only a decode worker that does not answer either is taken as lost.
                let answered =
                    !is_transport_failure(&st) && matches!(st.code(), Code::Unavailable | Code::Aborted);
                let error = self.worker_error(prefill, "Prefill", st);
                if answered && !self.answers(decode).await {
                    return Err(RunError::Lost { worker: decode.clone(), error });
                }
                return Err(error.into());
            }
        };
        // Summed over migrations: the time and bytes every attempt cost.
        self.timings.queue_ms += pre.queue_ms;
        self.timings.prefill_ms += pre.compute_ms;
        self.timings.transfer_ms += pre.transfer_ms;
        self.timings.transfer_bytes += pre.transfer_bytes;
        self.shared.metrics.kv_transfer(&transport.kind, pre.transfer_bytes, pre.transfer_ms / 1e3);
        self.note_cached(pre.cached_tokens);

        if self.push(&[pre.first_token], &[pre.logprob], None, decode, tx).await? {
            // Finished on its first token: the reservation is released (Cleanup), not decoded.
            return Ok(());
        }
        let req = DecodeRequest {
            request_id: self.request_id.clone(),
            prompt_token_ids: self.input.clone(),
            params: Some(self.engine.clone()),
            reservation_id: res.reservation_id,
            first_token: Some(pre.first_token),
        };
        self.decode_and_follow(d, decode, req, tx).await
    }

    /// One colocated worker computes the prompt and decodes.
    async fn run_colocated(
        &mut self,
        worker: &Target,
        tx: &mpsc::Sender<Result<GenerateResponse, Status>>,
    ) -> Result<(), RunError> {
        let mut w = self.client(worker)?;
        let req = DecodeRequest {
            request_id: self.request_id.clone(),
            prompt_token_ids: self.input.clone(),
            params: Some(self.engine.clone()),
            reservation_id: 0,
            first_token: None,
        };
        self.cleanup.decode_release = Some(0);
        self.decode_and_follow(&mut w, worker, req, tx).await
    }

    /// Calls `Decode` on `t` and streams its answer to the client.
    async fn decode_and_follow(
        &mut self,
        client: &mut WorkerClient<Channel>,
        t: &Target,
        req: DecodeRequest,
        tx: &mpsc::Sender<Result<GenerateResponse, Status>>,
    ) -> Result<(), RunError> {
        let shared = self.shared.clone();
        // Subscribed before the call: a loss announced from here on is seen by `follow`.
        let losses = shared.subscribe_losses();
        let stream = match client.decode(cluster_request(shared.cluster_secret.as_ref(), req)).await {
            Ok(s) => s.into_inner(),
            Err(st) => return Err(self.call_failed(t, "Decode", st)),
        };
        self.follow(stream, losses, t, tx).await
    }

    /// Streams a `Decode` response stream to the client until the request finishes.
    ///
    /// Besides the stream's own end or failure, a worker is lost when the registry gave up on it
    /// (`losses` changed and it no longer [`holds`](crate::registry::Registry::holds) `t`:
    /// missed heartbeats, or unhealthy) and the stream has been silent for as long as the
    /// registry waits for heartbeats, and another worker could take the request. A worker that is
    /// stuck sends nothing and may fail nothing; one that is only too busy to heartbeat in time
    /// still streams, and is followed to the end. With nowhere to move, the stream is followed
    /// as well: waiting loses nothing, and a connection that dies still ends it.
    async fn follow(
        &mut self,
        mut stream: tonic::Streaming<DecodeResponse>,
        mut losses: watch::Receiver<u64>,
        t: &Target,
        tx: &mpsc::Sender<Result<GenerateResponse, Status>>,
    ) -> Result<(), RunError> {
        let shared = self.shared.clone();
        let stall = shared.heartbeat * MISSED_HEARTBEATS;
        let mut held = shared.with_registry(|r| r.holds(t));
        let mut watching = true;
        let mut last = Instant::now();
        loop {
            let silent_until = tokio::time::Instant::from_std(last + stall);
            let next = tokio::select! {
                m = stream.message() => m,
                changed = losses.changed(), if watching => {
                    watching = changed.is_ok();
                    held = shared.with_registry(|r| r.holds(t));
                    continue;
                }
                _ = tokio::time::sleep_until(silent_until), if !held => {
                    if self.can_move(t) {
                        return Err(RunError::Lost {
                            worker: t.clone(),
                            error: RouterError::concealed(Code::Aborted, FAILED, format!(
                                "{} stopped heartbeating and streaming request {}",
                                t.describe(),
                                self.request_id
                            )),
                        });
                    }
                    last = Instant::now(); // look again later: a worker may join
                    continue;
                }
            };
            last = Instant::now();
            let msg = match next {
                Ok(Some(msg)) => msg,
                Ok(None) => {
                    return Err(RunError::Lost {
                        worker: t.clone(),
                        error: RouterError::concealed(
                            Code::Aborted,
                            FAILED,
                            format!(
                                "{} ended the Decode stream of request {} without a finish reason",
                                t.describe(),
                                self.request_id
                            ),
                        ),
                    })
                }
                Err(st) => return Err(self.call_failed(t, "Decode", st)),
            };
            if let (Plan::Colocated { .. }, None, Some(n)) =
                (&self.plan, self.cached_tokens, msg.cached_tokens)
            {
                self.note_cached(n);
            }
            let worker_done = msg.finish_reason.is_some();
            if self.push(&msg.token_ids, &msg.logprobs, msg.finish_reason.as_deref(), t, tx).await? {
                if worker_done {
                    self.cleanup.decode_release = None; // the worker ended the sequence itself
                }
                // Otherwise the router stopped first (stop string): dropping the stream cancels the
                // sequence, and Cleanup sends a Release as well.
                return Ok(());
            }
        }
    }

    /// Whether `t` answers a small call within [`PROBE`]; one that does not is marked unhealthy.
    async fn answers(&self, t: &Target) -> bool {
        let Ok(mut c) = self.client(t) else { return false };
        let mut req = cluster_request(self.shared.cluster_secret.as_ref(), InfoRequest {});
        req.set_timeout(PROBE);
        match c.info(req).await {
            Ok(_) => true,
            Err(st) if is_transport_failure(&st) => {
                let why = format!("Info failed: {}", st.message());
                self.shared.with_registry(|r| r.mark_unhealthy(&t.worker_id, &why));
                false
            }
            Err(_) => true,
        }
    }

    /// Whether the request could move off `t` now: a migration is left, and another worker can
    /// take the prompt and the tokens streamed so far.
    fn can_move(&self, t: &Target) -> bool {
        if self.migrations >= self.shared.max_migrations {
            return false;
        }
        let mut avoid = self.lost.clone();
        avoid.push(t.worker_id.clone());
        let len = self.prompt.len() + self.output.len();
        self.shared.with_registry(|r| {
            r.pick_avoiding(&PromptBlocks::unhashed(len), &avoid)
                .is_ok_and(|p| check_length(len, p.max_sequence_len()).is_ok())
        })
    }

    /// A worker took `n` prompt tokens from its prefix cache (what the usage reports; never more
    /// than the prompt).
    fn note_cached(&mut self, n: u32) {
        if self.cached_tokens.is_some() {
            return; // a migrated request reports what the first worker took
        }
        let n = n.min(self.prompt.len() as u32);
        self.cached_tokens = Some(n);
        self.shared.metrics.cached_prompt_tokens.inc_by(u64::from(n));
    }

    /// Feeds tokens through the detokenizer and stop checker and sends one response. Returns
    /// whether the request is finished (the last response, with usage and timings, was sent).
    async fn push(
        &mut self,
        tokens: &[u32],
        logprobs: &[f32],
        worker_finish: Option<&str>,
        t: &Target,
        tx: &mpsc::Sender<Result<GenerateResponse, Status>>,
    ) -> Result<bool, RouterError> {
        let mut resp = GenerateResponse::default();
        let max_len = t.max_sequence_len as usize;
        for (i, &token) in tokens.iter().enumerate() {
            if self.finish.is_some() {
                break; // tokens the worker made past a stop the router saw: not the client's
            }
            let delta = self.decoder.push(token).map_err(|e| {
                RouterError::concealed(
                    Code::Internal,
                    INTERNAL,
                    format!("{} produced token {token} the tokenizer cannot decode: {e}", t.describe()),
                )
            })?;
            self.output.push(token);
            resp.token_ids.push(token);
            if let Some(&lp) = logprobs.get(i) {
                resp.logprobs.push(lp);
            }
            let (text, finish) = self.stop.push(token, &delta);
            resp.text.push_str(&text);
            let room_left = self.prompt.len() + self.output.len() < max_len;
            self.finish = finish.or(if room_left { None } else { Some(FinishReason::Length) });
        }
        if self.finish.is_none() {
            if let Some(reason) = worker_finish {
                // The worker ended the sequence for a reason the router's mirror did not see.
                self.finish = Some(if reason == "length" { FinishReason::Length } else { FinishReason::Eos });
            }
        }
        if resp.logprobs.len() != resp.token_ids.len() {
            resp.logprobs.clear();
        }
        let now = Instant::now();
        let now_ms = now.duration_since(self.ticket.received).as_secs_f64() * 1e3;
        let n = resp.token_ids.len();
        if n > 0 {
            let m = &self.shared.metrics;
            m.generated_tokens.inc_by(n as u64);
            match self.last_sent {
                None => {
                    m.ttft.observe(now_ms / 1e3);
                    m.queue_depth.dec();
                }
                Some(prev) => {
                    // The gap is shared by the tokens it brought.
                    let per_token = now.duration_since(prev).as_secs_f64() / n as f64;
                    for _ in 0..n {
                        m.inter_token.observe(per_token);
                    }
                }
            }
            self.last_sent = Some(now);
        }
        if !self.sent_first {
            self.timings.ttft_ms = now_ms;
            resp.prompt_token_ids = self.prompt.clone();
            resp.request_id = self.request_id.clone();
        }
        if let Some(reason) = &self.finish {
            let mut text = self.stop.flush();
            if !matches!(reason, FinishReason::StopString(_)) {
                // Bytes of a character the stream ended inside; never text after a stop string.
                text.push_str(&self.decoder.finish().unwrap_or_default());
            }
            resp.text.push_str(&text);
            resp.finish_reason = Some(reason.as_str().to_owned());
            resp.usage = Some(Usage {
                prompt_tokens: self.prompt.len() as u32,
                completion_tokens: self.output.len() as u32,
                cached_tokens: self.cached_tokens.unwrap_or(0),
            });
            self.timings.total_ms = now_ms;
            resp.timings = Some(self.timings);
        } else if resp.token_ids.is_empty() && resp.text.is_empty() && self.sent_first {
            return Ok(false); // nothing to tell
        }
        self.sent_first = true;
        tx.send(Ok(resp)).await.map_err(|_| RouterError::Cancelled("the client went away".into()))?;
        Ok(self.finish.is_some())
    }
}

/// Checks a decode worker's `Reserve` answer for a prompt of `num_tokens` tokens and returns how
/// many leading prompt blocks it holds already (the transfer skips them). The answer must hold
/// `blocks_for(prompt) - cached_blocks` blocks, and the block of the last prompt token is never
/// among the cached ones (the prefill worker always sends it). Anything else is a worker bug.
fn check_reservation(decode: &Target, num_tokens: usize, res: &ReserveResponse) -> Result<u32, RouterError> {
    let bs = decode.block_size.max(1) as usize;
    let cached = res.cached_blocks as usize;
    let want = tandem_model::prefix::blocks_to_send(num_tokens, bs, cached).map_err(|max_cached| {
        RouterError::concealed(
            Code::Internal,
            INTERNAL,
            format!(
                "{} answered Reserve for {num_tokens} prompt tokens with {cached} cached blocks; at most \
             {max_cached} can be cached (block size {}; the last prompt token's block is always sent)",
                decode.describe(),
                decode.block_size
            ),
        )
    })?;
    if res.block_ids.len() != want {
        let with = if cached > 0 { format!(" with {cached} cached") } else { String::new() };
        return Err(RouterError::concealed(
            Code::Internal,
            INTERNAL,
            format!(
                "{} reserved {} blocks for {num_tokens} prompt tokens{with}; {want} expected (block size {})",
                decode.describe(),
                res.block_ids.len(),
                decode.block_size
            ),
        ));
    }
    Ok(res.cached_blocks)
}
