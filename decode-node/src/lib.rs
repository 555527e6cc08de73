//! The decode worker (`tandem-decode`): reserves KV blocks for prompts a prefill worker fills
//! through the KV transport, continues the filled sequences in its continuous batch, and streams
//! their tokens. It also runs whole requests itself (`Decode` with reservation 0): always when
//! started with `--colocated` (it then registers as a colocated worker), and when the router has no
//! prefill worker for a prompt or the prompt's KV transfer failed (the router's
//! `--prefill-fallback decode`).
//!
//! # Speculative decoding
//! With `--speculate ngram|draft` (and the other `--spec-*` flags, [`SpeculationArgs`]) the
//! engine drafts and verifies several tokens per sequence per step; output is unchanged. The
//! drafter is built at start-up (a draft model that cannot draft for this model stops the worker
//! with an error naming `--draft-model`), the registration record says how the worker speculates,
//! and `/metrics` and `Stats` report the draft tokens proposed and accepted.
//!
//! # Reservations
//! A reservation moves through `Reserved → Filling → Filled → adopted` (a sequence):
//! - `Reserve` creates it (blocks taken from the engine's pool) in state *Reserved* with a lease;
//! - a prefill worker opening a transfer for it ([`ReservationGate::begin`]) makes it *Filling*:
//!   the lease stops, because an open transfer connection is proof of life;
//! - the transfer completing with matching checksums makes it *Filled*, with a fresh lease;
//! - `Decode` adopts a Filled reservation as a running sequence.
//!
//! A lease that runs out in *Reserved* or *Filled* (`--lease-ms`), a failed transfer, or a
//! `Release` ends it. While a transfer is in flight the blocks may be written at any moment (for
//! shm, by another process), so a `Release` then only marks the reservation, and it ends when the
//! transfer does. A `Release` by request id that overtakes its `Reserve` is remembered for one
//! lease, and that `Reserve` is then refused (CANCELLED) without taking blocks.
//!
//! # LoRA adapters
//! A `Reserve` names the request's adapter (`adapter`, `adapter_id`): the worker checks it holds
//! it (NOT_FOUND, FAILED_PRECONDITION otherwise), looks cached blocks up under the adapter's salt
//! ([`tandem_engine::scheduler::Engine::request_salt`]) and remembers the adapter's id with the
//! reservation, in [`Reservations`] beside the engine's table (the table itself knows nothing of
//! adapters). The KV receiver asks for it through [`Gate`] and refuses a transfer computed under
//! another adapter (or the base model); the `Decode` that adopts the reservation must run the
//! same adapter, with the same id.
//!
//! The engine owns the one table that holds a reservation's state, lease and blocks
//! ([`tandem_engine::kv::reservation`]). [`Reservations`] is this worker's handle on it: the
//! transfer gate, `Release` and the lease sweeper take the table's lock and make their state-only
//! transition at once (a transfer never waits for a forward pass); anything that moves blocks
//! (reserving, adopting, returning the blocks of ended reservations) is a job on the engine
//! thread, which holds the allocator.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_proto::v1::worker_server::Worker;
use tandem_proto::v1::{
    AdapterInfo, DecodeRequest, DecodeResponse, InfoRequest, ListAdaptersRequest, ListAdaptersResponse,
    LoadAdapterRequest, PrefillRequest, PrefillResponse, ReleaseRequest, ReleaseResponse, ReserveRequest,
    ReserveResponse, Role, StatsRequest, StatsResponse, UnloadAdapterRequest, UnloadAdapterResponse,
    WorkerInfo,
};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use tandem_engine::kv::reservation::{Completion, ReservationError, SharedReservations};
use tandem_engine::kv::{BlockId, SeqId};
use tandem_engine::sampler::{choices, SamplingParams};
use tandem_engine::scheduler::{Engine, ReservationId, SeqEvent};
use tandem_engine::EngineError;
use tandem_serve::config::{init_logging, shutdown_signal};
use tandem_transport::{KvReceiver, ReceiverOptions, ReservationGate, TransportKind};
use tandem_worker::compat_record;
use tandem_worker::kv_wire::offer_to_wire;
use tandem_worker::speculation::{self, SpeculationArgs};
use tandem_worker::{
    adapters, adapters_wire, advertise_addr, bind, build_engine, engine_status, kv_token, load_model,
    local_addr, prompt_scores_wire, resolve_adapter_id, sampling_params, serve, top_wire, CancelOnDrop,
    EngineHandle, GuardedStream, RequestTable, SeqSink, ServeOptions, SinkFlow, TransportChoice, WorkerArgs,
    WorkerError, WorkerState, MAX_CACHE_SALT_BYTES,
};

/// The longest a reservation waits for its prompt's pages to be read from this worker's disk tier.
const DISK_WAIT: Duration = Duration::from_millis(500);

pub use tandem_engine::kv::reservation::ReservationState;

/// Flags of `tandem-decode`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "tandem-decode",
    version,
    about = "Tandem decode worker: continues prefilled sequences and streams their tokens"
)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub common: WorkerArgs,
    /// Address the KV listener binds (transfers from prefill workers arrive here).
    #[arg(long, env = "TANDEM_KV_LISTEN", default_value = "127.0.0.1:0")]
    pub kv_listen: SocketAddr,
    /// `host:port` prefill workers dial for KV transfers [default: the --advertise host with the
    /// bound KV port, else the bound KV address].
    #[arg(long, env = "TANDEM_KV_ADVERTISE")]
    pub kv_advertise: Option<String>,
    /// How long an unused reservation (not yet being filled, or filled but not decoded) lives.
    #[arg(long, env = "TANDEM_LEASE_MS", default_value_t = 30_000)]
    pub lease_ms: u64,
    /// Register as a colocated worker: the router sends it whole requests, never a prefill
    /// worker's KV. (A decode worker also runs whole requests when the router has no prefill
    /// worker for them, its `--prefill-fallback decode`.)
    #[arg(long, env = "TANDEM_COLOCATED")]
    pub colocated: bool,
    /// Inter-token latency target, in ms: a step that decodes computes only as many prompt
    /// tokens (new prompts when colocated, prompts recomputed after a preemption) as keep it
    /// within the target, by a step-cost model measured at start-up. 0 turns the budget off
    /// (prompt chunks then take up to --max-batch-tokens).
    #[arg(long, env = "TANDEM_ITL_TARGET_MS", default_value_t = 100, value_name = "MS",
          value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub itl_target_ms: u64,
    /// While prompts for this worker are being computed elsewhere, start steps no closer together
    /// than --itl-target-ms, leaving the rest of the cores to a prefill worker on the same host
    /// (`tandem up` turns it on when the two share one CPU).
    #[arg(long, env = "TANDEM_PACE_STEPS")]
    pub pace_steps: bool,
    #[command(flatten)]
    pub speculation: SpeculationArgs,
}

/// Why a decode worker could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// What every worker can fail at (flags, model, engine, sockets, registration).
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// `--transport shm` on a GPU: the pool is not in host memory, so no shm peer can write it.
    #[error(
        "--transport shm needs the KV pool in host shared memory, which a decode worker on {0} does \
         not have; use --transport tcp or auto"
    )]
    ShmOnGpu(tandem_engine::Device),
    /// The backend cannot receive KV blocks into its pool.
    #[error("the backend has no KV sink for transfers into its pool")]
    NoKvSink,
    /// `--transport` allows none of what the KV listener offers; the string says why.
    #[error("--transport {0:?}: the KV listener cannot offer it: {1}")]
    NoOffer(TransportChoice, String),
}

impl DecodeError {
    /// Stable, low-cardinality name of the failure.
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeError::Worker(e) => e.kind(),
            DecodeError::ShmOnGpu(_) => "shm_on_gpu",
            DecodeError::NoKvSink => "no_kv_sink",
            DecodeError::NoOffer(..) => "no_offer",
        }
    }
}

/// The gRPC status for an engine error met while reserving or adopting: a reservation's own
/// refusals keep the codes clients know (unknown or unfilled: FAILED_PRECONDITION, another
/// request's: INVALID_ARGUMENT, released before it was made: CANCELLED).
fn reservation_status(e: &EngineError) -> Status {
    let msg = e.to_string();
    match e {
        EngineError::Reservation(r) => match r {
            ReservationError::NotYours { .. } => Status::invalid_argument(msg),
            ReservationError::ReleasedEarly(_) => Status::cancelled(msg),
            ReservationError::Kv(_) => Status::internal(msg),
            ReservationError::Unknown(_)
            | ReservationError::NotFilled(_)
            | ReservationError::StillFilling(_)
            | ReservationError::AlreadyFilling(_)
            | ReservationError::AlreadyFilled(_) => Status::failed_precondition(msg),
        },
        e => engine_status(e),
    }
}

/// The decode worker's handle on the engine's reservation table (see the module
/// documentation): state-only transitions run here, under the table's lock, on the caller's
/// thread; whatever moves blocks runs as a job on the engine thread.
pub struct Reservations {
    table: SharedReservations,
    engine: EngineHandle,
    /// The LoRA adapter (name, id) of each reservation made under one (absent: the base model),
    /// kept here rather than in the engine's table, which knows nothing of adapters. Written by
    /// the reserve job on the engine thread before the reservation is answered (so before any
    /// transfer can name it); read by the KV receiver's [`Gate`] and by the `Decode` that adopts
    /// the reservation; an entry whose reservation has left the table is dropped by
    /// [`Reservations::sweep`].
    adapters: Arc<Mutex<HashMap<ReservationId, (String, String)>>>,
}

impl Reservations {
    /// The handle over `table` (the engine's, [`Engine::reservations`], taken before the engine
    /// moved to its thread) whose engine runs on `engine`; reservations are leased for `lease`.
    pub fn new(engine: EngineHandle, table: SharedReservations, lease: Duration) -> Arc<Reservations> {
        table.lock().set_lease(lease);
        Arc::new(Reservations { table, engine, adapters: Arc::default() })
    }

    /// The id of the LoRA adapter reservation `id` was made for (empty: the base model, or no
    /// such reservation).
    pub fn adapter_of(&self, id: ReservationId) -> String {
        self.made_for(id).map(|(_, id)| id).unwrap_or_default()
    }

    /// The name and id of the LoRA adapter reservation `id` was made for (`None`: the base
    /// model, or no such reservation).
    pub fn made_for(&self, id: ReservationId) -> Option<(String, String)> {
        self.adapters.lock().unwrap_or_else(|p| p.into_inner()).get(&id).cloned()
    }

    /// Forgets the adapter of `id` (adopted: it is a sequence now).
    fn forget_adapter(&self, id: ReservationId) {
        self.adapters.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    /// Request ids released before their reservation landed (and not forgotten yet).
    pub fn released_early(&self) -> usize {
        self.table.lock().released_early()
    }

    /// Outstanding reservations.
    pub fn len(&self) -> usize {
        self.table.lock().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The state of reservation `id`.
    pub fn state(&self, id: ReservationId) -> Option<ReservationState> {
        self.table.lock().state(id)
    }

    /// The lease length.
    pub fn lease(&self) -> Duration {
        self.table.lock().lease()
    }

    /// Asks the engine thread to give the blocks of ended reservations back to the allocator.
    fn reclaim_in_engine(&self) {
        self.engine.submit(|core| {
            if let Err(e) = core.engine.reclaim_reservations() {
                tracing::error!(error = %e, "returning the blocks of ended reservations failed");
            }
        });
    }

    /// Reserves blocks for `num_tokens` prompt tokens of `request_id`. With the prompt itself
    /// (`prompt` non-empty, `num_tokens` long) and its cache salt, leading blocks the prefix cache
    /// holds are pinned instead; the returned blocks are the ones a transfer fills, after the
    /// returned number of cached blocks.
    pub async fn reserve(
        self: &Arc<Self>,
        request_id: String,
        num_tokens: usize,
        prompt: Vec<u32>,
        salt: String,
        max_new_tokens: usize,
    ) -> Result<(ReservationId, Vec<BlockId>, usize), Status> {
        let key = SamplingParams { cache_salt: salt, ..Default::default() };
        self.reserve_under(request_id, num_tokens, prompt, key, max_new_tokens).await
    }

    /// [`Reservations::reserve`] for a request under the LoRA adapter `key.adapter` (empty: the
    /// base model), expected with id `key.adapter_id` (empty: any), with cache salt
    /// `key.cache_salt` (the rest of `key` is not read). An adapter this worker does not hold is
    /// NOT_FOUND, one with another id FAILED_PRECONDITION; cached blocks are looked up under the
    /// adapter's salt, and the reservation remembers the adapter's id for the transfer's check.
    pub async fn reserve_under(
        self: &Arc<Self>,
        request_id: String,
        num_tokens: usize,
        prompt: Vec<u32>,
        key: SamplingParams,
        max_new_tokens: usize,
    ) -> Result<(ReservationId, Vec<BlockId>, usize), Status> {
        // Pages of the prompt's prefix on this worker's disk tier are read first (for at most
        // DISK_WAIT), so that the reservation pins them instead of having them transferred.
        if self.engine.has_tiers() && !prompt.is_empty() {
            let ask = (prompt.clone(), key.clone());
            let reading = self
                .engine
                .call(move |core| {
                    let salt = core.engine.request_salt(&ask.1).map_err(|e| engine_status(&e))?;
                    Ok::<_, Status>(match core.engine.prefetch_prompt(&ask.0, &salt) {
                        Ok(reading) => reading,
                        Err(e) => {
                            tracing::warn!(error = %e, "reloading a prompt's KV from the tiers failed");
                            None
                        }
                    })
                })
                .await??;
            if let Some((tiers, names)) = reading {
                let until = Instant::now() + DISK_WAIT;
                while tiers.in_flight(&names) && Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        }
        let adapters = self.adapters.clone();
        self.engine
            .call(move |core| {
                // The adapter and the salt are resolved in the job that reserves, so that the
                // blocks looked up and the id remembered are those of one adapter.
                let adapter_id = resolve_adapter_id(&core.engine, &key).map_err(|e| engine_status(&e))?;
                let adapter = (!adapter_id.is_empty()).then(|| (key.adapter.clone(), adapter_id));
                let salt = core.engine.request_salt(&key).map_err(|e| engine_status(&e))?;
                // Recorded in the table on the engine thread, in this job: if the caller has gone
                // by now, the lease still frees the blocks.
                match core.engine.reserve_for(&request_id, num_tokens, &prompt, &salt, max_new_tokens) {
                    Ok(r) => {
                        if let Some(a) = adapter {
                            adapters.lock().unwrap_or_else(|p| p.into_inner()).insert(r.id, a);
                        }
                        Ok((r.id, r.blocks, r.cached_blocks))
                    }
                    Err(e) => {
                        if let EngineError::Reservation(ReservationError::ReleasedEarly(_)) = e {
                            tracing::debug!(%request_id, "request released before its reservation landed");
                        }
                        Err(reservation_status(&e))
                    }
                }
            })
            .await?
    }

    /// Releases `id` and every reservation of `request_id` (either may be empty/0). Transfers in
    /// flight are marked and freed when they end. Returns whether anything was found.
    pub fn release(&self, id: ReservationId, request_id: &str) -> bool {
        let released = self.table.lock().release(id, request_id, Instant::now());
        for rid in &released.ended {
            tracing::debug!(reservation = rid, "reservation released");
        }
        if !released.ended.is_empty() {
            self.reclaim_in_engine();
        }
        released.found()
    }

    /// Checks that `id` is Filled and may be adopted by `request_id`; returns how many blocks it
    /// holds. The adoption itself happens on the engine thread, which checks again.
    fn check_filled(&self, id: ReservationId, request_id: &str) -> Result<usize, Status> {
        self.table
            .lock()
            .filled(id, request_id)
            .map(|b| b.len())
            .map_err(|e| reservation_status(&EngineError::from(e)))
    }

    /// Ends every Reserved or Filled reservation whose lease ended by `now`; returns how many.
    /// Also forgets the adapters of reservations that have left the table.
    pub fn sweep(&self, now: Instant) -> usize {
        let (expired, lease) = {
            let mut t = self.table.lock();
            (t.expire(now), t.lease())
        };
        {
            // The adapters' lock, then the table's (the only place that holds both).
            let mut adapters = self.adapters.lock().unwrap_or_else(|p| p.into_inner());
            if !adapters.is_empty() {
                let t = self.table.lock();
                adapters.retain(|id, _| t.state(*id).is_some());
            }
        }
        for r in &expired {
            tracing::info!(
                reservation = r.id,
                request_id = %r.request_id,
                state = ?r.state,
                lease_ms = lease.as_millis() as u64,
                "reservation lease expired; blocks freed"
            );
        }
        if !expired.is_empty() {
            self.reclaim_in_engine();
        }
        expired.len()
    }
}

/// The [`ReservationGate`] the KV receiver consults: each call is one state-only transition of
/// the table, taken under its lock without waiting for the engine thread.
pub struct Gate(pub Arc<Reservations>);

impl ReservationGate for Gate {
    fn begin(&self, reservation: u64) -> Result<Vec<BlockId>, String> {
        // The receiver prefixes "reservation N: ".
        self.0.table.lock().begin(reservation).map_err(|e| match e {
            ReservationError::Unknown(_) => {
                "unknown (its lease expired, it was released, or it never existed)".to_owned()
            }
            ReservationError::AlreadyFilling(_) => "already has a transfer in progress".to_owned(),
            ReservationError::AlreadyFilled(_) => "already filled".to_owned(),
            e => e.to_string(),
        })
    }

    fn complete(&self, reservation: u64) {
        let done = self.0.table.lock().complete(reservation, Instant::now());
        match done {
            Completion::Filled => tracing::debug!(reservation, "reservation filled"),
            Completion::Ended => {
                tracing::debug!(reservation, "transfer completed after a release; blocks freed");
                self.0.reclaim_in_engine();
            }
            Completion::Ignored => {}
        }
    }

    fn abort(&self, reservation: u64, why: &str) {
        if self.0.table.lock().abort(reservation) {
            tracing::warn!(reservation, reason = why, "KV transfer failed; reservation released");
            self.0.reclaim_in_engine();
        }
    }

    fn adapter_id(&self, reservation: u64) -> String {
        self.0.adapter_of(reservation)
    }
}

/// Checks that a `Decode` continuing reservation `res`, made for the LoRA adapter `made_for`
/// (name and id; `None`: the base model), runs that adapter (or the base model), and pins the
/// adapter's id in `params`, so that the engine refuses the request if the adapter of that name
/// has other weights by now. A refusal leaves the reservation alone.
fn pin_adapter(
    params: &mut SamplingParams,
    res: ReservationId,
    made_for: Option<(String, String)>,
) -> Result<(), Status> {
    let same = match &made_for {
        None => params.adapter.is_empty(),
        Some((name, id)) => {
            params.adapter == *name && (params.adapter_id.is_empty() || params.adapter_id == *id)
        }
    };
    if !same {
        let made = match &made_for {
            None => "the base model (no LoRA adapter)".to_owned(),
            Some((name, id)) => format!("LoRA adapter '{name}' (id {id})"),
        };
        let runs = match (params.adapter.as_str(), params.adapter_id.as_str()) {
            ("", _) => "the base model".to_owned(),
            (name, "") => format!("LoRA adapter '{name}'"),
            (name, id) => format!("LoRA adapter '{name}' (id {id})"),
        };
        return Err(Status::failed_precondition(format!(
            "reservation {res} was made for {made}, but the request runs {runs}"
        )));
    }
    if let Some((_, id)) = made_for {
        params.adapter_id = id;
    }
    Ok(())
}

/// Streams a decoding sequence's tokens: one message per step.
struct StreamSink {
    tx: mpsc::UnboundedSender<Result<DecodeResponse, Status>>,
    /// The choice this sequence is (0 to n - 1): every message says so.
    index: u32,
    /// Shared by the request's choices: the request is counted once.
    outcome: Arc<Outcome>,
    logprobs: bool,
    /// Alternatives were asked for: one `top_logprobs` entry per token.
    top_logprobs: bool,
    state: Arc<WorkerState>,
    /// Prompt tokens this worker computes (a colocated request's), counted with its first token.
    prompt_tokens: u64,
    /// A colocated request whose first message has not said how many prompt tokens came from
    /// the prefix cache yet.
    report_cached: bool,
}

/// How a request of one or more choices ended, counted once whichever choice ends it.
struct Outcome {
    /// Choices not finished yet.
    left: std::sync::atomic::AtomicU32,
    counted: std::sync::atomic::AtomicBool,
}

impl Outcome {
    fn new(n: u32) -> Arc<Outcome> {
        Arc::new(Outcome { left: n.into(), counted: false.into() })
    }

    /// Counts the request as ended with `result`, unless it was counted already.
    fn count(&self, state: &WorkerState, result: Result<(), &Status>) {
        if !self.counted.swap(true, std::sync::atomic::Ordering::SeqCst) {
            state.record(result.is_ok());
            state.metrics.request(result);
        }
    }

    /// One choice finished; the request is counted a success when it was the last.
    fn choice_done(&self, state: &WorkerState) {
        if self.left.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            self.count(state, Ok(()));
        }
    }
}

impl StreamSink {
    /// The request ended with `st` (sent to the client if it still listens).
    fn fail(&mut self, st: Status) {
        self.outcome.count(&self.state, Err(&st));
        let _ = self.tx.send(Err(st));
    }
}

impl SeqSink for StreamSink {
    fn on_events(&mut self, engine: &mut Engine, seq: SeqId, events: &[SeqEvent]) -> SinkFlow {
        let mut msg = DecodeResponse { index: self.index, ..DecodeResponse::default() };
        if std::mem::take(&mut self.report_cached) {
            msg.cached_tokens = Some(engine.cached_tokens(seq).unwrap_or(0) as u32);
        }
        let mut done = false;
        for ev in events {
            match ev {
                SeqEvent::Token { token, logprob, top_logprobs, .. } => {
                    msg.token_ids.push(*token);
                    if self.logprobs {
                        msg.logprobs.push(*logprob);
                    }
                    if self.top_logprobs {
                        msg.top_logprobs.push(top_wire(top_logprobs));
                    }
                }
                SeqEvent::Finished { reason, .. } => {
                    msg.finish_reason = Some(reason.as_str().to_owned());
                    done = true;
                }
                SeqEvent::Failed { error, .. } => {
                    self.fail(Status::internal(format!("sequence failed: {error}")));
                    return SinkFlow::Done;
                }
                SeqEvent::Prefilled { .. } => {
                    self.fail(Status::internal("a decode sequence stopped after prefill"));
                    return SinkFlow::Cancel;
                }
                SeqEvent::PromptLogprobs { logprobs, top_logprobs, .. } => {
                    (msg.prompt_logprobs, msg.prompt_top_logprobs) =
                        prompt_scores_wire(logprobs, top_logprobs);
                }
            }
        }
        if !msg.token_ids.is_empty() {
            if self.prompt_tokens > 0 {
                self.state.metrics.prefilled(std::mem::take(&mut self.prompt_tokens));
            }
            self.state.metrics.decoded(msg.token_ids.len() as u64);
        }
        if msg.token_ids.is_empty() && !done {
            return SinkFlow::Continue;
        }
        if self.tx.send(Ok(msg)).is_err() {
            // The stream was dropped.
            self.outcome.count(&self.state, Err(&Status::cancelled("the client went away")));
            return SinkFlow::Cancel;
        }
        if done {
            self.outcome.choice_done(&self.state);
            SinkFlow::Done
        } else {
            SinkFlow::Continue
        }
    }

    fn on_cancel(&mut self, status: Status) {
        self.fail(status);
    }
}

/// The decode worker's `Worker` service.
#[derive(Clone)]
pub struct DecodeService {
    state: Arc<WorkerState>,
    reservations: Arc<Reservations>,
    requests: Arc<RequestTable>,
}

impl DecodeService {
    /// The service over a worker's shared state and reservation table.
    pub fn new(state: Arc<WorkerState>, reservations: Arc<Reservations>) -> Self {
        DecodeService { state, reservations, requests: Arc::default() }
    }
}

#[tonic::async_trait]
impl Worker for DecodeService {
    async fn load_adapter(&self, req: Request<LoadAdapterRequest>) -> Result<Response<AdapterInfo>, Status> {
        let r = adapters::load_adapter(&self.state, req.into_inner()).await;
        self.state.answered(r).map(Response::new)
    }

    async fn unload_adapter(
        &self,
        req: Request<UnloadAdapterRequest>,
    ) -> Result<Response<UnloadAdapterResponse>, Status> {
        let r = adapters::unload_adapter(&self.state, req.into_inner()).await;
        self.state.answered(r).map(Response::new)
    }

    async fn list_adapters(
        &self,
        _req: Request<ListAdaptersRequest>,
    ) -> Result<Response<ListAdaptersResponse>, Status> {
        let r = adapters::list_adapters(&self.state).await;
        self.state.answered(r).map(Response::new)
    }

    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(self.state.current_info().await))
    }

    async fn stats(&self, req: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        let r = self.state.stats(req.get_ref().check_invariants).await;
        self.state.answered(r).map(Response::new)
    }

    async fn reserve(&self, req: Request<ReserveRequest>) -> Result<Response<ReserveResponse>, Status> {
        match self.reserve_inner(req.into_inner()).await {
            Err(st) if st.code() == tonic::Code::ResourceExhausted => {
                // Back-pressure, asked again in milliseconds while the router waits: not an error.
                self.state.metrics.reserve_refused();
                Err(st)
            }
            r => self.state.answered(r).map(Response::new),
        }
    }

    async fn prefill(&self, _: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        self.state.answered(Err(Status::unimplemented(
            "this is a decode worker; Prefill is served by prefill workers",
        )))
    }

    type DecodeStream = GuardedStream<DecodeResponse>;

    async fn decode(&self, req: Request<DecodeRequest>) -> Result<Response<Self::DecodeStream>, Status> {
        let r = self.decode_inner(req.into_inner()).await;
        if let Err(st) = &r {
            self.state.metrics.request(Err(st));
        }
        r.map(Response::new)
    }

    async fn release(&self, req: Request<ReleaseRequest>) -> Result<Response<ReleaseResponse>, Status> {
        let r = req.into_inner();
        let mut released = self.reservations.release(r.reservation_id, &r.request_id);
        if !r.request_id.is_empty() {
            released |= self.requests.cancel(&r.request_id, &self.state.engine);
        }
        Ok(Response::new(ReleaseResponse { released }))
    }
}

impl DecodeService {
    async fn reserve_inner(&self, r: ReserveRequest) -> Result<ReserveResponse, Status> {
        self.state.check_accepting()?;
        if r.num_tokens == 0 {
            return Err(Status::invalid_argument("num_tokens: must be at least 1"));
        }
        if !r.prompt_token_ids.is_empty() && r.prompt_token_ids.len() != r.num_tokens as usize {
            return Err(Status::invalid_argument(format!(
                "prompt_token_ids: {} ids but num_tokens is {}",
                r.prompt_token_ids.len(),
                r.num_tokens
            )));
        }
        if r.cache_salt.len() > MAX_CACHE_SALT_BYTES {
            return Err(Status::invalid_argument(format!(
                "cache_salt: at most {MAX_CACHE_SALT_BYTES} bytes, got {}",
                r.cache_salt.len()
            )));
        }
        let key = SamplingParams {
            cache_salt: r.cache_salt,
            adapter: r.adapter,
            adapter_id: r.adapter_id,
            ..Default::default()
        };
        let (id, blocks, cached_blocks) = self
            .reservations
            .reserve_under(
                r.request_id.clone(),
                r.num_tokens as usize,
                r.prompt_token_ids,
                key,
                r.max_new_tokens as usize,
            )
            .await?;
        tracing::debug!(request_id = %r.request_id, reservation = id, blocks = blocks.len(), cached_blocks, "reserved");
        Ok(ReserveResponse {
            reservation_id: id,
            block_ids: blocks,
            lease_ms: self.reservations.lease().as_millis().min(u32::MAX as u128) as u32,
            cached_blocks: cached_blocks as u32,
        })
    }

    async fn decode_inner(&self, r: DecodeRequest) -> Result<GuardedStream<DecodeResponse>, Status> {
        let n = choices(r.n).map_err(Status::invalid_argument)?;
        let mut params = sampling_params(r.params.as_ref())?;
        let logprobs = r.params.as_ref().is_some_and(|p| p.logprobs);
        let top_logprobs = params.logprobs.is_some_and(|n| n > 0);
        let prompt = r.prompt_token_ids;
        let res_id = r.reservation_id;
        let mut blocks = 0;
        if res_id == 0 {
            // A whole request computed here: a colocated worker's work, or a decode worker's when
            // the router has no prefill worker for the prompt (or its KV transfer failed).
            self.state.check_accepting()?;
            if r.first_token.is_some() {
                return Err(Status::invalid_argument("first_token: must be absent when reservation_id is 0"));
            }
        } else {
            // Work begun before a drain (its reservation exists) is finished, not refused.
            if self.state.draining() && self.reservations.state(res_id).is_none() {
                self.state.check_accepting()?;
            }
            if r.first_token.is_none() {
                return Err(Status::invalid_argument(
                    "first_token: required to continue a prefilled reservation",
                ));
            }
            // Refused here, before any engine work, as long as it is not Filled or not this
            // request's; such a refusal leaves the reservation alone. Then the adapter: the
            // one the reservation (and its transfer) was made for.
            blocks = self.reservations.check_filled(res_id, &r.request_id)?;
            pin_adapter(&mut params, res_id, self.reservations.made_for(res_id))?;
        }
        let inflight = self.state.inflight();
        let engine = self.state.engine.clone();
        let ticket = engine.ticket();
        let (tx, rx) = mpsc::unbounded_channel();
        let outcome = Outcome::new(n);
        let state = self.state.clone();
        let prompt_len = prompt.len() as u64;
        // One sink per choice, all into one stream; choice 0 reports the prompt's work.
        let sink = move |index: u32| {
            let first = index == 0;
            Box::new(StreamSink {
                tx: tx.clone(),
                index,
                outcome: outcome.clone(),
                logprobs,
                top_logprobs,
                state: state.clone(),
                prompt_tokens: if res_id == 0 && first { prompt_len } else { 0 },
                report_cached: res_id == 0 && first,
            })
        };
        // Choice i draws with seed + i (choice 0 is the request as given); only choice 0 scores
        // the prompt.
        let choice = move |i: u32| SamplingParams {
            seed: params.seed.map(|s| s.wrapping_add(u64::from(i))),
            prompt_logprobs: params.prompt_logprobs.filter(|_| i == 0),
            ..params.clone()
        };
        let added = if res_id == 0 {
            let cancel = CancelOnDrop::new(engine.clone(), ticket);
            let prompt = prompt.clone();
            let added = engine
                .call(move |core| {
                    // Colocated: each choice computes the prompt (the prefix cache, when on, shares
                    // its full blocks).
                    add_choices(core, ticket, Vec::new(), n, sink, |e, i| {
                        e.add_request(prompt.clone(), choice(i))
                    })
                })
                .await?;
            (added, cancel)
        } else {
            let first = r.first_token.unwrap_or_default();
            let cancel = CancelOnDrop::new(engine.clone(), ticket);
            let request_id = r.request_id.clone();
            let prompt = prompt.clone();
            let added = engine
                .call(move |core| {
                    let seq =
                        match core.engine.add_prefilled_for(res_id, &request_id, prompt, first, choice(0)) {
                            Ok(seq) => seq,
                            Err(e) => {
                                // The Decode for it failed: nobody will adopt it, so free it now
                                // rather than at the end of its lease.
                                let _ = core.engine.release_reservation(res_id);
                                return Err(reservation_status(&e));
                            }
                        };
                    // The other choices share the prompt's blocks: one transfer for all.
                    add_choices(core, ticket, vec![seq], n, sink, |e, i| e.fork_prompt(seq, choice(i)))
                })
                .await?;
            if added.is_ok() {
                self.reservations.forget_adapter(res_id);
            }
            tracing::debug!(request_id = %r.request_id, reservation = res_id, blocks, n, "adopted");
            (added, cancel)
        };
        let (seq, cancel) = match added {
            (Ok(seq), cancel) => (seq, cancel),
            (Err(st), mut cancel) => {
                cancel.disarm();
                self.state.record(false);
                return Err(st);
            }
        };
        tracing::debug!(request_id = %r.request_id, seq, "decoding");
        let entry = self.requests.insert(&r.request_id, ticket);
        Ok(GuardedStream::new(rx, cancel, inflight, Some(entry)))
    }
}

/// Adds the choices after `seqs` (those already added) up to `n` with `add`, then attaches choice
/// `i` under `ticket` with `sink(i)`; returns choice 0's sequence. On an error, every sequence
/// added is cancelled (nothing stays attached or holds blocks) and the error is returned.
fn add_choices(
    core: &mut tandem_worker::EngineCore,
    ticket: tandem_worker::Ticket,
    mut seqs: Vec<SeqId>,
    n: u32,
    sink: impl Fn(u32) -> Box<StreamSink>,
    mut add: impl FnMut(&mut Engine, u32) -> Result<SeqId, EngineError>,
) -> Result<SeqId, Status> {
    for i in seqs.len() as u32..n {
        match add(&mut core.engine, i) {
            Ok(seq) => seqs.push(seq),
            Err(e) => {
                for s in seqs {
                    let _ = core.engine.cancel(s);
                }
                return Err(engine_status(&e));
            }
        }
    }
    for (i, &seq) in seqs.iter().enumerate() {
        core.attach(ticket, seq, sink(i as u32));
    }
    Ok(seqs[0])
}

/// The host part of a `host:port` address (brackets of an IPv6 literal kept).
fn advertised_host(addr: &str) -> &str {
    match addr.rfind(':') {
        Some(i) if !addr[i + 1..].contains(']') => &addr[..i],
        _ => addr,
    }
}

/// Runs `tandem-decode` until SIGTERM/SIGINT (then drains) or a registration refusal (error).
pub async fn run(args: DecodeArgs) -> Result<(), DecodeError> {
    let shutdown = async {
        let sig = shutdown_signal().await;
        tracing::info!(signal = sig, "shutting down");
    };
    run_until(args, shutdown).await
}

/// [`run`] with an explicit shutdown future (tests).
pub async fn run_until(
    args: DecodeArgs,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), DecodeError> {
    let a = &args.common;
    init_logging(a.log_format);
    let secret = a.cluster.load().map_err(WorkerError::from)?;
    let tls = a.tls.load().map_err(WorkerError::from)?;
    let mutual = tls.as_ref().is_some_and(|t| t.mutual());
    tandem_serve::auth::check_protected(
        &[("--listen", a.listen), ("--kv-listen", args.kv_listen)],
        secret.is_some() || mutual,
        a.cluster.insecure_cluster,
    )
    .map_err(WorkerError::Flag)?;
    let role = if args.colocated { Role::Colocated } else { Role::Decode };
    // A GPU pool cannot live in host shared memory: a GPU decode worker offers TCP only.
    let on_gpu = a.device != tandem_engine::Device::Cpu;
    if on_gpu && a.transport == TransportChoice::Shm {
        return Err(DecodeError::ShmOnGpu(a.device));
    }
    a.transport.check_device(a.device, a.nixl_lib.as_deref()).map_err(WorkerError::Flag)?;
    // The pool lives in a shared segment only where shm may be offered.
    let kv_shared = a.transport.allows("shm") && !on_gpu;
    args.speculation.validate().map_err(WorkerError::from)?;
    if args.pace_steps && args.itl_target_ms == 0 {
        return Err(WorkerError::Flag(
            "--pace-steps paces steps to --itl-target-ms, which is 0 (off)".into(),
        )
        .into());
    }
    let model = load_model(a)?;
    let mut built = build_engine(a, model, kv_shared, Some(&args.speculation))?;
    if args.itl_target_ms > 0 {
        let target = Duration::from_millis(args.itl_target_ms);
        built.engine = built.engine.with_itl_target(target, args.pace_steps).map_err(WorkerError::Engine)?;
    }
    let spec_record = speculation::registration_record(&built.engine);
    let sink = built.engine.backend().kv_sink().ok_or(DecodeError::NoKvSink)?;
    // In token blocks, as the router counts them (a pool of layer groups has one page per group).
    let total_blocks = built.layout.num_blocks / built.engine.kv_groups();
    let compat = compat_record(&built.identity, &built.layout, built.engine.kv_windows());
    let table = built.engine.reservations();
    let adapters = adapters_wire(&built.engine);
    let max_adapters = built.engine.max_adapters() as u32;
    let (engine, thread) = tandem_worker::EngineHandle::spawn(built.engine)?;
    let reservations = Reservations::new(engine.clone(), table, Duration::from_millis(args.lease_ms.max(1)));

    let result = async {
        let listener = bind("--listen", a.listen).await?;
        let grpc_addr = local_addr(&listener)?;
        let advertise = advertise_addr(a.advertise.as_deref(), grpc_addr);
        let http = bind("--http-listen", a.http_listen).await?;

        let receiver = KvReceiver::bind(
            args.kv_listen,
            sink,
            Arc::new(Gate(reservations.clone())),
            ReceiverOptions {
                token: kv_token(secret.as_ref()),
                tls: tls
                    .clone()
                    .map(|t| Arc::new(tandem_worker::KvTls(t)) as Arc<dyn tandem_transport::KvServerTls>),
                enable_cuda_ipc: a.transport.allows("cuda-ipc"),
                enable_nccl: a.transport.allows("nccl"),
                nixl: a.nixl_config(),
                ..Default::default()
            },
        )
        .await
        .map_err(|source| WorkerError::Transport {
            what: format!("binding --kv-listen {}", args.kv_listen),
            source,
        })?;
        let kv_addr = receiver.local_addr();
        // Where prefill workers dial the KV listener: --kv-advertise, else the --advertise host
        // with the bound KV port, else what the receiver derives from the bound address.
        let kv_advertise = match (&args.kv_advertise, &a.advertise) {
            (Some(k), _) if !k.trim().is_empty() => Some(k.trim().to_owned()),
            (_, Some(_)) => Some(format!("{}:{}", advertised_host(&advertise), kv_addr.port())),
            _ => None,
        };
        let offers: Vec<_> = receiver
            .offers()
            .into_iter()
            .filter(|o| a.transport.allows(o.kind.as_str()))
            .map(|mut o| {
                if let Some(k) = &kv_advertise {
                    o.address = k.clone();
                }
                offer_to_wire(&o)
            })
            .collect();
        if offers.is_empty() {
            let why = match a.transport {
                TransportChoice::CudaIpc => receiver.cuda_ipc_unavailable().unwrap_or_default(),
                TransportChoice::Nccl => receiver.nccl_unavailable().unwrap_or_default(),
                TransportChoice::Nixl => receiver.unavailable(TransportKind::Nixl).unwrap_or_default(),
                _ => "it is not available on this worker".into(),
            };
            return Err(DecodeError::NoOffer(a.transport, why));
        }
        let info = WorkerInfo {
            worker_id: a.worker_id(role),
            role: role as i32,
            address: advertise,
            compat: Some(compat),
            transports: offers,
            device: a.device.to_string(),
            total_blocks: total_blocks as u32,
            max_sequence_len: engine.max_sequence_len() as u32,
            speculation: spec_record,
            prefix_cache: a.prefix_cache,
            adapters,
            max_adapters,
        };
        let receiver = Arc::new(receiver);
        let counters = {
            let r = receiver.clone();
            Box::new(move |kind: Option<TransportKind>| match kind {
                Some(k) => r.counters_of(k),
                None => r.counters(),
            })
        };
        let pending = {
            let r = reservations.clone();
            Box::new(move || r.len())
        };
        let state = WorkerState::new(info, engine.clone(), counters, pending, a.readiness());
        let sweeper = {
            let r = reservations.clone();
            let every = (r.lease() / 4).clamp(Duration::from_millis(5), Duration::from_millis(500));
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    r.sweep(Instant::now());
                }
            })
        };
        let svc = DecodeService::new(state.clone(), reservations.clone());
        let opts = ServeOptions {
            router: a.router.clone(),
            drain_timeout: a.drain_timeout(),
            kv_addr: Some(kv_addr),
            http,
            secret,
            tls,
        };
        let served = serve(state, svc, listener, opts, shutdown).await.map_err(DecodeError::from);
        sweeper.abort();
        if let Ok(r) = Arc::try_unwrap(receiver) {
            r.shutdown().await;
        }
        served
    }
    .await;
    engine.stop("the worker is shutting down");
    drop(engine);
    drop(reservations);
    thread.join().await;
    result
}
