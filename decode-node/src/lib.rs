//! The decode worker (`tandem-decode`): reserves KV blocks for prompts a prefill worker fills
//! through the KV transport, continues the filled sequences in its continuous batch, and streams
//! their tokens. With `--colocated` it also runs whole requests itself (`Decode` with
//! reservation 0).
//!
//! # Speculative decoding
//! With `--speculate ngram|draft` (and the other `--spec-*` flags, [`SpeculationArgs`]) the
//! engine drafts and verifies several tokens per sequence per step; output is unchanged. The
//! drafter is built at start-up (a draft model that cannot draft for this model stops the worker
//! with an error naming `--draft-model`), the registration record says how the worker speculates,
//! and `/metrics` and `Stats` report the draft tokens proposed and accepted.
//!
//! # Reservations
//! A reservation moves through `Reserved → Transferring → Filled → adopted` (a sequence):
//! - `Reserve` creates it (blocks taken from the engine's pool) in state *Reserved* with a lease;
//! - a prefill worker opening a transfer for it ([`ReservationGate::begin`]) makes it
//!   *Transferring*: the lease stops, because an open transfer connection is proof of life;
//! - the transfer completing with matching checksums makes it *Filled*, with a fresh lease;
//! - `Decode` adopts a Filled reservation as a running sequence.
//!
//! A lease that runs out in *Reserved* or *Filled*, a failed transfer, or a `Release` frees the
//! blocks. While a transfer is in flight the blocks may be written at any moment (for shm, by
//! another process), so a `Release` then only marks the reservation, and the blocks are freed
//! when the transfer ends. The table here and the engine's reservations change together: an entry
//! exists exactly while the engine holds the blocks (removal sends the engine its release job).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_proto::v1::worker_server::Worker;
use tandem_proto::v1::{
    DecodeRequest, DecodeResponse, InfoRequest, PrefillRequest, PrefillResponse, ReleaseRequest,
    ReleaseResponse, ReserveRequest, ReserveResponse, Role, StatsRequest, StatsResponse, WorkerInfo,
};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use tandem_engine::kv::{BlockId, SeqId};
use tandem_engine::scheduler::{Engine, ReservationId, SeqEvent};
use tandem_serve::config::{init_logging, shutdown_signal};
use tandem_worker::compat_record;
use tandem_worker::speculation::{self, SpeculationArgs};
use tandem_worker::kv_wire::offer_to_wire;
use tandem_worker::{
    advertise_addr, bind, build_engine, engine_status, kv_token, load_model, local_addr, sampling_params,
    serve, CancelOnDrop, EngineHandle, GuardedStream, RequestTable, SeqSink, ServeOptions, SinkFlow,
    TransportChoice, WorkerArgs, WorkerError, WorkerState, MAX_CACHE_SALT_BYTES,
};
use tandem_transport::{KvReceiver, ReceiverOptions, ReservationGate, TransportKind};

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
    /// Also run whole requests here (registers as a colocated worker).
    #[arg(long, env = "TANDEM_COLOCATED")]
    pub colocated: bool,
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

/// Where a reservation is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationState {
    /// Blocks set aside; no transfer yet. Leased.
    Reserved,
    /// A transfer is writing the blocks. Not leased; `release_when_done` records a `Release`
    /// that arrived meanwhile.
    Transferring { release_when_done: bool },
    /// The blocks hold the prompt's KV. Leased.
    Filled,
}

#[derive(Debug, Clone)]
struct Reservation {
    request_id: String,
    blocks: Vec<BlockId>,
    state: ReservationState,
    /// Lease end (Reserved and Filled only).
    deadline: Option<Instant>,
}

/// The decode worker's reservation table (see the module documentation).
pub struct Reservations {
    map: Mutex<HashMap<ReservationId, Reservation>>,
    /// Request ids released before their `Reserve` landed, with when to forget them. The router
    /// sends `Release` as soon as a request ends, and that call can overtake a `Reserve` still
    /// queued for the engine thread; the reservation it makes is then freed as it lands instead
    /// of holding its blocks for a whole lease. Locked only while `map` is held, so a release and
    /// a landing reservation see each other.
    released_early: Mutex<HashMap<String, Instant>>,
    engine: EngineHandle,
    lease: Duration,
}

/// Most request ids remembered as released before their reservation landed; beyond it the oldest
/// are forgotten (their reservations, should they still land, end with their lease).
const MAX_RELEASED_EARLY: usize = 4096;

impl Reservations {
    /// An empty table whose reservations live in `engine` and are leased for `lease`.
    pub fn new(engine: EngineHandle, lease: Duration) -> Arc<Reservations> {
        Arc::new(Reservations {
            map: Mutex::new(HashMap::new()),
            released_early: Mutex::new(HashMap::new()),
            engine,
            lease,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ReservationId, Reservation>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The early releases; call only while holding [`Reservations::lock`].
    fn lock_released_early(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.released_early.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Request ids released before their reservation landed (and not forgotten yet).
    pub fn released_early(&self) -> usize {
        let _table = self.lock();
        self.lock_released_early().len()
    }

    /// Outstanding reservations.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The state of reservation `id`.
    pub fn state(&self, id: ReservationId) -> Option<ReservationState> {
        self.lock().get(&id).map(|r| r.state)
    }

    /// The lease length.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Frees the engine's blocks of `id` (the entry is already gone from the table).
    fn release_in_engine(&self, id: ReservationId) {
        self.engine.submit(move |core| match core.engine.release_reservation(id) {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(reservation = id, "release of a reservation the engine does not hold")
            }
            Err(e) => tracing::error!(reservation = id, error = %e, "releasing a reservation failed"),
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
    ) -> Result<(ReservationId, Vec<BlockId>, usize), Status> {
        let table = self.clone();
        self.engine
            .call(move |core| {
                let r = if prompt.is_empty() {
                    core.engine.reserve(num_tokens).map(|(id, blocks)| (id, blocks, 0))
                } else {
                    core.engine.reserve_prompt(&prompt, &salt).map(|r| (r.id, r.blocks, r.cached_blocks))
                };
                let (id, blocks, cached) = r.map_err(|e| engine_status(&e))?;
                // Recorded on the engine thread, in the same job: if the caller has gone by now,
                // the lease still frees the blocks.
                let mut map = table.lock();
                let released = !request_id.is_empty()
                    && table.lock_released_early().remove(&request_id).is_some_and(|until| Instant::now() < until);
                if released {
                    drop(map);
                    tracing::debug!(%request_id, reservation = id, "request released before its reservation landed");
                    if let Err(e) = core.engine.release_reservation(id) {
                        tracing::error!(reservation = id, error = %e, "releasing a reservation failed");
                    }
                    return Err(Status::cancelled(format!(
                        "request {request_id} was released before its reservation was made"
                    )));
                }
                map.insert(
                    id,
                    Reservation {
                        request_id,
                        blocks: blocks.clone(),
                        state: ReservationState::Reserved,
                        deadline: Some(Instant::now() + table.lease),
                    },
                );
                Ok((id, blocks, cached))
            })
            .await?
    }

    /// Releases `id` and every reservation of `request_id` (either may be empty/0). Transfers in
    /// flight are marked and freed when they end. Returns whether anything was found.
    pub fn release(&self, id: ReservationId, request_id: &str) -> bool {
        let mut freed = Vec::new();
        let mut found = false;
        {
            let mut m = self.lock();
            let ids: Vec<ReservationId> = m
                .iter()
                .filter(|(rid, r)| {
                    (id != 0 && **rid == id) || (!request_id.is_empty() && r.request_id == request_id)
                })
                .map(|(rid, _)| *rid)
                .collect();
            if ids.is_empty() && id == 0 && !request_id.is_empty() {
                // Nothing yet: a `Reserve` for this request may still be on its way to the
                // engine thread. Remember the release for one lease.
                let mut early = self.lock_released_early();
                let now = Instant::now();
                early.retain(|_, until| now < *until);
                if early.len() >= MAX_RELEASED_EARLY {
                    if let Some(oldest) =
                        early.iter().min_by_key(|(_, until)| **until).map(|(k, _)| k.clone())
                    {
                        early.remove(&oldest);
                    }
                }
                early.insert(request_id.to_owned(), now + self.lease);
            }
            for rid in ids {
                found = true;
                let Some(r) = m.get_mut(&rid) else { continue };
                if let ReservationState::Transferring { release_when_done } = &mut r.state {
                    *release_when_done = true;
                } else {
                    m.remove(&rid);
                    freed.push(rid);
                }
            }
        }
        for rid in freed {
            tracing::debug!(reservation = rid, "reservation released");
            self.release_in_engine(rid);
        }
        found
    }

    /// Takes a Filled reservation out of the table for adoption; the caller must adopt or release
    /// it in the engine.
    fn take_filled(&self, id: ReservationId, request_id: &str) -> Result<Vec<BlockId>, Status> {
        let mut m = self.lock();
        let Some(r) = m.get(&id) else {
            return Err(Status::failed_precondition(format!(
                "reservation {id} is unknown (its lease expired, it was released, or it never existed)"
            )));
        };
        if !request_id.is_empty() && !r.request_id.is_empty() && r.request_id != request_id {
            return Err(Status::invalid_argument(format!(
                "reservation {id} belongs to request {}, not {request_id}",
                r.request_id
            )));
        }
        match r.state {
            ReservationState::Filled => Ok(m.remove(&id).map(|r| r.blocks).unwrap_or_default()),
            ReservationState::Reserved => Err(Status::failed_precondition(format!(
                "reservation {id} has not been filled: no KV transfer arrived for it"
            ))),
            ReservationState::Transferring { .. } => Err(Status::failed_precondition(format!(
                "reservation {id} has not been filled: its KV transfer is still in progress"
            ))),
        }
    }

    /// Frees every Reserved or Filled reservation whose lease ended; returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        let expired: Vec<(ReservationId, Reservation)> = {
            let mut m = self.lock();
            let ids: Vec<ReservationId> =
                m.iter().filter(|(_, r)| r.deadline.is_some_and(|d| d <= now)).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| m.remove(&id).map(|r| (id, r))).collect()
        };
        for (id, r) in &expired {
            tracing::info!(
                reservation = id,
                request_id = %r.request_id,
                state = ?r.state,
                lease_ms = self.lease.as_millis() as u64,
                "reservation lease expired; blocks freed"
            );
            self.release_in_engine(*id);
        }
        expired.len()
    }
}

/// The [`ReservationGate`] the KV receiver consults.
pub struct Gate(pub Arc<Reservations>);

impl ReservationGate for Gate {
    fn begin(&self, reservation: u64) -> Result<Vec<BlockId>, String> {
        let mut m = self.0.lock();
        let Some(r) = m.get_mut(&reservation) else {
            // The receiver prefixes "reservation N: ".
            return Err("unknown (its lease expired, it was released, or it never existed)".into());
        };
        match r.state {
            ReservationState::Reserved => {
                r.state = ReservationState::Transferring { release_when_done: false };
                r.deadline = None;
                Ok(r.blocks.clone())
            }
            ReservationState::Transferring { .. } => Err("already has a transfer in progress".into()),
            ReservationState::Filled => Err("already filled".into()),
        }
    }

    fn complete(&self, reservation: u64) {
        let release = {
            let mut m = self.0.lock();
            match m.get_mut(&reservation) {
                Some(r) => match r.state {
                    ReservationState::Transferring { release_when_done: true } => {
                        m.remove(&reservation);
                        true
                    }
                    _ => {
                        r.state = ReservationState::Filled;
                        r.deadline = Some(Instant::now() + self.0.lease);
                        false
                    }
                },
                None => false,
            }
        };
        if release {
            tracing::debug!(reservation, "transfer completed after a release; blocks freed");
            self.0.release_in_engine(reservation);
        } else {
            tracing::debug!(reservation, "reservation filled");
        }
    }

    fn abort(&self, reservation: u64, why: &str) {
        let removed = self.0.lock().remove(&reservation).is_some();
        if removed {
            tracing::warn!(reservation, reason = why, "KV transfer failed; reservation released");
            self.0.release_in_engine(reservation);
        }
    }
}

/// Streams a decoding sequence's tokens: one message per step.
struct StreamSink {
    tx: mpsc::UnboundedSender<Result<DecodeResponse, Status>>,
    logprobs: bool,
    state: Arc<WorkerState>,
    /// Prompt tokens this worker computes (a colocated request's), counted with its first token.
    prompt_tokens: u64,
    /// A colocated request whose first message has not said how many prompt tokens came from
    /// the prefix cache yet.
    report_cached: bool,
}

impl StreamSink {
    /// The request ended with `st` (sent to the client if it still listens).
    fn fail(&mut self, st: Status) {
        self.state.record(false);
        self.state.metrics.request(Err(&st));
        let _ = self.tx.send(Err(st));
    }
}

impl SeqSink for StreamSink {
    fn on_events(&mut self, engine: &mut Engine, seq: SeqId, events: &[SeqEvent]) -> SinkFlow {
        let mut msg = DecodeResponse::default();
        if std::mem::take(&mut self.report_cached) {
            msg.cached_tokens = Some(engine.cached_tokens(seq).unwrap_or(0) as u32);
        }
        let mut done = false;
        for ev in events {
            match ev {
                SeqEvent::Token { token, logprob, .. } => {
                    msg.token_ids.push(*token);
                    if self.logprobs {
                        msg.logprobs.push(*logprob);
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
            self.state.record(false);
            self.state.metrics.request(Err(&Status::cancelled("the client went away")));
            return SinkFlow::Cancel;
        }
        if done {
            self.state.record(true);
            self.state.metrics.request(Ok(()));
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
    colocated: bool,
}

impl DecodeService {
    /// The service over a worker's shared state and reservation table; `colocated` also serves
    /// whole requests (`Decode` with reservation 0).
    pub fn new(state: Arc<WorkerState>, reservations: Arc<Reservations>, colocated: bool) -> Self {
        DecodeService { state, reservations, requests: Arc::default(), colocated }
    }
}

#[tonic::async_trait]
impl Worker for DecodeService {
    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(self.state.info.clone()))
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
        let (id, blocks, cached_blocks) = self
            .reservations
            .reserve(r.request_id.clone(), r.num_tokens as usize, r.prompt_token_ids, r.cache_salt)
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
        let params = sampling_params(r.params.as_ref())?;
        let logprobs = r.params.as_ref().is_some_and(|p| p.logprobs);
        let prompt = r.prompt_token_ids;
        let res_id = r.reservation_id;
        if res_id == 0 {
            // A whole request computed here.
            self.state.check_accepting()?;
            if !self.colocated {
                return Err(Status::failed_precondition(
                    "reservation_id 0 asks to compute the prompt here, which only a worker started with --colocated does",
                ));
            }
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
        }
        let inflight = self.state.inflight();
        let engine = self.state.engine.clone();
        let ticket = engine.ticket();
        let (tx, rx) = mpsc::unbounded_channel();
        let prompt_tokens = if res_id == 0 { prompt.len() as u64 } else { 0 };
        let sink = Box::new(StreamSink {
            tx,
            logprobs,
            state: self.state.clone(),
            prompt_tokens,
            report_cached: res_id == 0,
        });
        let added = if res_id == 0 {
            let cancel = CancelOnDrop::new(engine.clone(), ticket);
            let added = engine
                .call(move |core| {
                    let seq = core.engine.add_request(prompt, params).map_err(|e| engine_status(&e))?;
                    core.attach(ticket, seq, sink);
                    Ok::<_, Status>(seq)
                })
                .await?;
            (added, cancel)
        } else {
            let first = r.first_token.unwrap_or_default();
            let blocks = self.reservations.take_filled(res_id, &r.request_id)?;
            let n = blocks.len();
            let cancel = CancelOnDrop::new(engine.clone(), ticket);
            let added = engine
                .call(move |core| match core.engine.add_prefilled(res_id, prompt, first, params) {
                    Ok(seq) => {
                        core.attach(ticket, seq, sink);
                        Ok(seq)
                    }
                    Err(e) => {
                        // The reservation left the table: free it here or nobody will.
                        let _ = core.engine.release_reservation(res_id);
                        Err(engine_status(&e))
                    }
                })
                .await?;
            tracing::debug!(request_id = %r.request_id, reservation = res_id, blocks = n, "adopted");
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
    let role = if args.colocated { Role::Colocated } else { Role::Decode };
    // A GPU pool cannot live in host shared memory: a GPU decode worker offers TCP only.
    let on_gpu = a.device != tandem_engine::Device::Cpu;
    if on_gpu && a.transport == TransportChoice::Shm {
        return Err(DecodeError::ShmOnGpu(a.device));
    }
    a.transport.check_device(a.device).map_err(WorkerError::Flag)?;
    let kv_shared = a.transport != TransportChoice::Tcp && !on_gpu;
    args.speculation.validate().map_err(WorkerError::from)?;
    let model = load_model(a)?;
    let built = build_engine(a, model, kv_shared, Some(&args.speculation))?;
    let spec_record = speculation::registration_record(&built.engine);
    let sink = built.engine.backend().kv_sink().ok_or(DecodeError::NoKvSink)?;
    let total_blocks = built.layout.num_blocks;
    let compat = compat_record(&built.identity, &built.layout);
    let (engine, thread) = tandem_worker::EngineHandle::spawn(built.engine)?;
    let reservations = Reservations::new(engine.clone(), Duration::from_millis(args.lease_ms.max(1)));

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
                tls: tls.clone().map(|t| Arc::new(tandem_worker::KvTls(t)) as Arc<dyn tandem_transport::KvServerTls>),
                enable_cuda_ipc: a.transport.allows("cuda-ipc"),
                enable_nccl: a.transport.allows("nccl"),
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
        let svc = DecodeService::new(state.clone(), reservations.clone(), args.colocated);
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
