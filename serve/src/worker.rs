//! What prefill and decode workers share: their common flags, the engine thread, the gRPC server
//! (the `Worker` service, `grpc.health.v1`, server reflection), load and stats reports,
//! registration with the router, and the drain on SIGTERM/SIGINT.
//!
//! # The engine thread
//! One `std::thread` owns the [`Engine`]. Handlers send it jobs (closures over [`EngineCore`]) over
//! a channel and get answers back over tokio channels; the thread steps the engine while there is
//! work and blocks on the channel when there is none (or when every block it needs is held by
//! reservations or prefilled sequences waiting to be released). Jobs run in the order they were
//! sent, between steps, so a cancel sent after an add always finds what the add created.
//!
//! A request's sequence is attached to a [`SeqSink`] under a [`Ticket`]; the sink receives the
//! sequence's events of every step, on the engine thread. A handler whose client went away drops
//! a [`CancelOnDrop`] guard, which cancels the ticket's sequence: nothing a request holds outlives
//! the request.
//!
//! # Draining
//! On SIGTERM/SIGINT a worker stops taking new work (`Reserve`, `Prefill` and new `Decode`s answer
//! UNAVAILABLE "draining", health turns NOT_SERVING, heartbeats say `draining`), lets requests in
//! flight finish for up to `--drain-timeout-ms`, cancels what is left, deregisters and exits 0.
//! Readiness (`GET /ready`, `tandem_worker_ready`) turns off at once; the HTTP server keeps
//! answering until the gRPC server stops, so probes see a clear 503 rather than a refused
//! connection.
//!
//! # Health
//! `GET /health` fails when the engine thread has stopped without being told to (it panicked).
//! `GET /ready` succeeds when the worker serves, is registered with the router (when `--router`
//! is given), is not draining, and its engine is not wedged: an engine with work to do must have
//! finished a step within `--ready-stall-ms` ([`readiness`]).
//!
//! # Cluster secret
//! With `--cluster-secret`, the `Worker` service refuses calls without it (UNAUTHENTICATED;
//! health and reflection stay open), registry calls carry it, and so does the KV transport's
//! handshake. A router that refuses the secret ends the worker (exit 1).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tandem_proto::v1::registry_client::RegistryClient;
use tandem_proto::v1::worker_server::{Worker, WorkerServer};
use tandem_proto::v1::{
    DeregisterRequest, EngineParams, HeartbeatRequest, KvCounters, Role, StatsResponse, TransferCounters,
    WorkerInfo, WorkerLoad,
};
use tokio::sync::{mpsc, oneshot, watch};
use tonic::{Code, Status};

use tandem_engine::backend::BackendOptions;
use tandem_engine::factory::create_backend;
use tandem_engine::scheduler::{Engine, EngineLoad, SchedulerOptions, SeqEvent};
use tandem_engine::error::EngineError;
use tandem_engine::kv::{KvError, KvLayout, KvStats, SeqId};
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use crate::auth::{self, ClusterSecretArgs, Secret};
use crate::config::{poll_once, print_listening, Listening, LogFormat};
use crate::identity::{model_identity, resolve_model, ModelIdentity};
use crate::ops::{self, Probe};
use crate::worker_metrics::{LiveValues, WorkerMetrics};
use tandem_transport::{KvToken, TransportError, TransportKind};
use tandem_engine::Device;

/// Which KV transports a worker offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TransportChoice {
    /// Both: shared memory (same host) and TCP.
    #[default]
    Auto,
    /// Shared memory only.
    Shm,
    /// TCP only.
    Tcp,
}

impl TransportChoice {
    /// Whether offers of `kind` (`"shm"`/`"tcp"`) are allowed.
    pub fn allows(self, kind: &str) -> bool {
        match self {
            TransportChoice::Auto => true,
            TransportChoice::Shm => kind == "shm",
            TransportChoice::Tcp => kind == "tcp",
        }
    }
}

/// Flags both worker binaries take. Every flag can also be set with `TANDEM_<FLAG>` or as a key
/// of the `--config` TOML file.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// TOML file with flag values (keys are long flag names).
    #[arg(long, env = "TANDEM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address the gRPC server binds (port 0: any free port; the bound address is printed).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// `host:port` the router and peers dial to reach this worker [default: the bound address].
    #[arg(long, env = "TANDEM_ADVERTISE")]
    pub advertise: Option<String>,
    /// The router's registry address (`host:port`); without it the worker waits to be listed in a
    /// router's static worker list.
    #[arg(long, env = "TANDEM_ROUTER")]
    pub router: Option<String>,
    /// GGUF file or Hugging Face model directory [default: the SmolLM2-135M-Instruct Q4_1 GGUF in
    /// the model cache, $TANDEM_MODEL_DIR or ~/.cache/tandem/models].
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute device: cpu or cuda:N.
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: Device,
    /// Matrix dtype on a GPU: bf16 (default) or f32 (matches the CPU backend exactly, slower).
    #[arg(long, env = "TANDEM_DTYPE", default_value = "bf16")]
    pub dtype: tandem_engine::backend::ComputeDtype,
    /// Run every decode step eagerly instead of replaying captured CUDA graphs (GPU only).
    #[arg(long, env = "TANDEM_NO_CUDA_GRAPHS")]
    pub no_cuda_graphs: bool,
    /// Worker threads for the CPU backend [default: all cores].
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
    /// KV-cache blocks in the pool [default: 512].
    #[arg(long, env = "TANDEM_KV_BLOCKS", conflicts_with = "kv_memory_mb")]
    pub kv_blocks: Option<usize>,
    /// KV-cache memory in MiB, instead of --kv-blocks: as many blocks as fit.
    #[arg(long, env = "TANDEM_KV_MEMORY_MB")]
    pub kv_memory_mb: Option<usize>,
    /// Tokens per KV-cache block (must match the other workers').
    #[arg(long, env = "TANDEM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Most tokens in one forward pass (longer prompts are prefilled in chunks).
    #[arg(long, env = "TANDEM_MAX_BATCH_TOKENS", default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Most sequences computing at once.
    #[arg(long, env = "TANDEM_MAX_NUM_SEQS", default_value_t = 64)]
    pub max_num_seqs: usize,
    /// KV transports to offer: auto (shm and tcp), shm or tcp.
    #[arg(long, env = "TANDEM_TRANSPORT", value_enum, default_value_t = TransportChoice::Auto)]
    pub transport: TransportChoice,
    /// Name of this worker in the router [default: <role>-<hostname>-<pid>].
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub worker_id: Option<String>,
    /// On SIGTERM/SIGINT, how long requests in flight may take to finish before they are cancelled.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_MS", default_value_t = 30_000)]
    pub drain_timeout_ms: u64,
    /// Log format on stderr.
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Address of the HTTP server for `/health`, `/ready` and `/metrics` (port 0: any free port;
    /// the bound address is printed).
    #[arg(long, env = "TANDEM_HTTP_LISTEN", default_value = "127.0.0.1:0")]
    pub http_listen: SocketAddr,
    #[command(flatten)]
    pub cluster: ClusterSecretArgs,
    /// Readiness turns off when the engine has work but has not finished a step for this long
    /// (a wedged engine), in ms.
    #[arg(long, env = "TANDEM_READY_STALL_MS", default_value_t = 30_000)]
    pub ready_stall_ms: u64,
}

/// The role's name in worker ids and logs.
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Colocated => "colocated",
        Role::Unspecified => "worker",
    }
}

/// This host's name (for default worker ids).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is valid for writes of its whole length, which is what we pass; gethostname
    // writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        let name = String::from_utf8_lossy(&buf[..end]).trim().to_owned();
        if !name.is_empty() {
            return name;
        }
    }
    "localhost".into()
}

impl WorkerArgs {
    /// `--worker-id`, or `<role>-<hostname>-<pid>`.
    pub fn worker_id(&self, role: Role) -> String {
        self.worker_id
            .clone()
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| format!("{}-{}-{}", role_name(role), hostname(), std::process::id()))
    }

    /// The drain timeout.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }

    /// What readiness checks, from the flags.
    pub fn readiness(&self) -> ReadinessOptions {
        ReadinessOptions {
            needs_registration: self.router.is_some(),
            stall: Duration::from_millis(self.ready_stall_ms.max(1)),
        }
    }
}

/// The KV transport token of a cluster secret.
pub fn kv_token(secret: Option<&Secret>) -> Option<KvToken> {
    secret.map(|s| KvToken(s.kv_token()))
}

/// A model loaded into an engine, with what a worker registers with.
pub struct BuiltEngine {
    /// The engine, not yet on its thread.
    pub engine: Engine,
    /// The model's identity (for the compatibility record).
    pub identity: ModelIdentity,
    /// The backend's KV pool layout.
    pub layout: KvLayout,
}

/// Loads the model the flags name and builds an engine over a backend on `--device`. With
/// `kv_shared` the KV pool lives in a shared-memory segment (decode workers offering shm).
pub fn build_engine(a: &WorkerArgs, kv_shared: bool) -> Result<BuiltEngine> {
    if a.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    if a.max_batch_tokens == 0 {
        bail!("--max-batch-tokens must be at least 1");
    }
    if a.max_num_seqs == 0 {
        bail!("--max-num-seqs must be at least 1");
    }
    let path = resolve_model(a.model.as_deref())?;
    let identity = model_identity(&path).with_context(|| format!("reading model {}", path.display()))?;
    let cfg = &identity.config;
    let num_blocks = match (a.kv_blocks, a.kv_memory_mb) {
        (Some(n), _) => n,
        (None, Some(mb)) => {
            let per_block = 2 * cfg.num_layers * a.block_size * cfg.num_kv_heads * cfg.head_dim * 4;
            let n = (mb as u128 * (1 << 20) / per_block.max(1) as u128) as usize;
            if n == 0 {
                bail!("--kv-memory-mb {mb}: not even one KV block fits ({per_block} bytes per block of {} tokens)", a.block_size);
            }
            n
        }
        (None, None) => 512,
    };
    if num_blocks == 0 {
        bail!("--kv-blocks must be at least 1");
    }
    let model = load_model(&path).with_context(|| format!("loading model {}", path.display()))?;
    let tokenizer = model.tokenizer.clone();
    let opts = BackendOptions {
        num_blocks,
        block_size: a.block_size,
        max_batch_tokens: a.max_batch_tokens,
        threads: a.threads.unwrap_or(0),
        kv_shared,
        dtype: a.dtype,
        cuda_graphs: !a.no_cuda_graphs,
    };
    let backend = create_backend(a.device, model, opts)?;
    let layout = backend.kv_layout();
    let engine = Engine::new(
        backend,
        tokenizer,
        SchedulerOptions { max_batch_tokens: a.max_batch_tokens, max_num_seqs: a.max_num_seqs },
    );
    tracing::info!(
        model = %identity.model_name,
        model_id = %identity.model_id,
        path = %path.display(),
        device = %a.device,
        blocks = layout.num_blocks,
        block_size = layout.block_size,
        kv_shared,
        "engine ready"
    );
    Ok(BuiltEngine { engine, identity, layout })
}

// ------------------------------------------------------------------------------------------------
// Engine thread
// ------------------------------------------------------------------------------------------------

/// Names a request's sequence on the engine thread before (and after) it has a [`SeqId`].
pub type Ticket = u64;

type Job = Box<dyn FnOnce(&mut EngineCore) + Send>;

/// What a sink wants after seeing a step's events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkFlow {
    /// Keep sending events.
    Continue,
    /// The sequence is over (finished, failed, or released by the sink): forget the sink.
    Done,
    /// Nobody listens any more: cancel the sequence and forget the sink.
    Cancel,
}

/// Receives one sequence's events on the engine thread.
pub trait SeqSink: Send {
    /// The sequence's events of one step, in order. `engine` lets a sink act on the sequence at
    /// once (a prefill sink copies the blocks out and releases them).
    fn on_events(&mut self, engine: &mut Engine, seq: SeqId, events: &[SeqEvent]) -> SinkFlow;
    /// The sequence was cancelled (release, client gone, shutdown, engine failure): `status` says why.
    fn on_cancel(&mut self, status: Status);
}

/// Load and occupancy, published by the engine thread after every job and step.
#[derive(Debug, Clone, Copy)]
pub struct EngineSnapshot {
    /// Sequences, queue and reservations.
    pub load: EngineLoad,
    /// Allocator counters.
    pub kv: KvStats,
    /// Steps run so far.
    pub steps: u64,
    /// The engine has sequences to step (waiting or running, not merely blocked on blocks held
    /// elsewhere): it should be finishing steps.
    pub has_work: bool,
    /// When the last step finished, or when work arrived at an idle engine if later.
    pub progress_at: Instant,
}

/// The engine and the sinks of its sequences; jobs get `&mut` to it on the engine thread.
pub struct EngineCore {
    pub engine: Engine,
    sinks: HashMap<SeqId, (Ticket, Box<dyn SeqSink>)>,
    tickets: HashMap<Ticket, SeqId>,
    steps: u64,
    snapshot: Arc<Mutex<EngineSnapshot>>,
    stop: bool,
}

impl EngineCore {
    /// Routes `seq`'s events to `sink` under `ticket` (which [`CancelOnDrop`] and releases use).
    pub fn attach(&mut self, ticket: Ticket, seq: SeqId, sink: Box<dyn SeqSink>) {
        self.tickets.insert(ticket, seq);
        self.sinks.insert(seq, (ticket, sink));
    }

    /// Cancels the sequence of `ticket` and tells its sink why. False if there is none (it ended).
    pub fn cancel_ticket(&mut self, ticket: Ticket, status: Status) -> bool {
        let Some(seq) = self.tickets.remove(&ticket) else {
            return false;
        };
        if let Err(e) = self.engine.cancel(seq) {
            tracing::error!(seq, error = %e, "cancelling a sequence failed");
        }
        if let Some((_, mut sink)) = self.sinks.remove(&seq) {
            sink.on_cancel(status);
        }
        true
    }

    /// Cancels every attached sequence.
    pub fn cancel_all(&mut self, status: Status) {
        let tickets: Vec<Ticket> = self.tickets.keys().copied().collect();
        for t in tickets {
            self.cancel_ticket(t, status.clone());
        }
    }

    /// Steps since the engine started.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Publishes load and occupancy; `stepped`: a step has just finished.
    fn publish(&self, stepped: bool) {
        let mut snap = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        snap.load = self.engine.load();
        snap.kv = self.engine.kv_stats();
        snap.steps = self.steps;
        snap.has_work = self.engine.has_work() && !self.engine.stalled();
        if stepped {
            snap.progress_at = Instant::now();
        }
    }

    /// About to step: an idle engine that got work starts its stall clock now.
    fn mark_busy(&self) {
        let mut snap = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        if !snap.has_work {
            snap.has_work = true;
            snap.progress_at = Instant::now();
        }
    }

    fn step(&mut self) {
        let events = match self.engine.step() {
            Ok(ev) => ev,
            Err(e) => {
                tracing::error!(error = %e, "engine step failed; cancelling every sequence");
                self.cancel_all(Status::internal(format!("engine failure: {e}")));
                return;
            }
        };
        self.steps += 1;
        // Group by sequence, keeping each sequence's order.
        let mut by_seq: Vec<(SeqId, Vec<SeqEvent>)> = Vec::new();
        for ev in events {
            let seq = match &ev {
                SeqEvent::Token { seq, .. }
                | SeqEvent::Finished { seq, .. }
                | SeqEvent::Failed { seq, .. }
                | SeqEvent::Prefilled { seq, .. } => *seq,
            };
            match by_seq.iter_mut().find(|(s, _)| *s == seq) {
                Some((_, v)) => v.push(ev),
                None => by_seq.push((seq, vec![ev])),
            }
        }
        for (seq, evs) in by_seq {
            let flow = match self.sinks.get_mut(&seq) {
                Some((_, sink)) => sink.on_events(&mut self.engine, seq, &evs),
                None => SinkFlow::Cancel, // nobody wants it: never let it hold blocks
            };
            if flow != SinkFlow::Continue {
                if let Some((ticket, _)) = self.sinks.remove(&seq) {
                    self.tickets.remove(&ticket);
                }
                if let Err(e) = self.engine.cancel(seq) {
                    tracing::error!(seq, error = %e, "freeing a sequence failed");
                }
            }
        }
    }
}

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    /// Jobs for the engine thread.
    tx: mpsc::UnboundedSender<Job>,
    next_ticket: Arc<AtomicU64>,
    snapshot: Arc<Mutex<EngineSnapshot>>,
    max_sequence_len: usize,
    layout: KvLayout,
    /// Set by [`EngineHandle::stop`]: the thread ending afterwards is expected.
    stopping: Arc<AtomicBool>,
}

/// The engine thread, for joining it at shutdown.
pub struct EngineThread {
    join: Option<std::thread::JoinHandle<()>>,
}

impl EngineThread {
    /// Waits (off the async runtime) until the engine thread has exited and dropped the engine.
    pub async fn join(mut self) {
        if let Some(j) = self.join.take() {
            let _ = tokio::task::spawn_blocking(move || j.join()).await;
        }
    }
}

impl EngineHandle {
    /// Moves `engine` onto a new thread and returns a handle to it.
    pub fn spawn(engine: Engine) -> Result<(EngineHandle, EngineThread)> {
        let (tx, rx) = mpsc::unbounded_channel();
        let snapshot = Arc::new(Mutex::new(EngineSnapshot {
            load: engine.load(),
            kv: engine.kv_stats(),
            steps: 0,
            has_work: false,
            progress_at: Instant::now(),
        }));
        let handle = EngineHandle {
            tx,
            next_ticket: Arc::new(AtomicU64::new(1)),
            snapshot: snapshot.clone(),
            max_sequence_len: engine.max_sequence_len(),
            layout: engine.backend().kv_layout(),
            stopping: Arc::new(AtomicBool::new(false)),
        };
        let core = EngineCore {
            engine,
            sinks: HashMap::new(),
            tickets: HashMap::new(),
            steps: 0,
            snapshot,
            stop: false,
        };
        let join = std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || engine_loop(core, rx))
            .context("starting the engine thread")?;
        Ok((handle, EngineThread { join: Some(join) }))
    }

    /// Queues `job` on the engine thread. False when the thread has stopped.
    pub fn submit(&self, job: impl FnOnce(&mut EngineCore) + Send + 'static) -> bool {
        self.tx.send(Box::new(job)).is_ok()
    }

    /// Runs `f` on the engine thread and returns its result.
    pub async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut EngineCore) -> R + Send + 'static,
    ) -> Result<R, Status> {
        let (tx, rx) = oneshot::channel();
        if !self.submit(move |core| {
            let _ = tx.send(f(core));
        }) {
            return Err(engine_gone());
        }
        rx.await.map_err(|_| engine_gone())
    }

    /// A fresh ticket.
    pub fn ticket(&self) -> Ticket {
        self.next_ticket.fetch_add(1, Ordering::Relaxed)
    }

    /// Cancels the sequence of `ticket` (if it still runs), telling its sink `status`.
    pub fn cancel(&self, ticket: Ticket, status: Status) {
        self.submit(move |core| {
            core.cancel_ticket(ticket, status);
        });
    }

    /// The latest published load and occupancy.
    pub fn snapshot(&self) -> EngineSnapshot {
        *self.snapshot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Longest sequence the engine holds.
    pub fn max_sequence_len(&self) -> usize {
        self.max_sequence_len
    }

    /// The engine's KV layout.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Ok while the engine thread runs or was told to stop; Err once it has ended otherwise (a
    /// panic in a step or job).
    pub fn alive(&self) -> Result<(), String> {
        if self.tx.is_closed() && !self.stopping.load(Ordering::SeqCst) {
            return Err("the engine thread has stopped unexpectedly".into());
        }
        Ok(())
    }

    /// Cancels everything and stops the engine thread (which then drops the engine).
    pub fn stop(&self, why: &str) {
        self.stopping.store(true, Ordering::SeqCst);
        let why = why.to_owned();
        self.submit(move |core| {
            core.cancel_all(Status::unavailable(why));
            core.stop = true;
        });
    }
}

fn engine_gone() -> Status {
    Status::internal("the engine thread has stopped")
}

fn engine_loop(mut core: EngineCore, mut rx: mpsc::UnboundedReceiver<Job>) {
    loop {
        // Jobs first: cancels and releases take effect before the next pass.
        loop {
            match rx.try_recv() {
                Ok(job) => job(&mut core),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    core.stop = true;
                    break;
                }
            }
            if core.stop {
                break;
            }
        }
        if core.stop {
            break;
        }
        if core.engine.has_work() && !core.engine.stalled() {
            core.mark_busy();
            core.step();
            core.publish(true);
            continue;
        }
        core.publish(false);
        match rx.blocking_recv() {
            Some(job) => job(&mut core),
            None => break,
        }
        if core.stop {
            break;
        }
    }
    core.cancel_all(Status::unavailable("the worker is shutting down"));
    core.publish(false);
    tracing::debug!("engine thread stopped");
}

/// Cancels a ticket's sequence when dropped (the handler or response stream went away), unless
/// disarmed.
pub struct CancelOnDrop {
    handle: EngineHandle,
    ticket: Ticket,
    armed: bool,
}

impl CancelOnDrop {
    /// A guard for `ticket`'s sequence on `handle`'s engine thread.
    pub fn new(handle: EngineHandle, ticket: Ticket) -> Self {
        CancelOnDrop { handle, ticket, armed: true }
    }

    /// The request ended on its own; nothing to cancel.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.handle.cancel(self.ticket, Status::cancelled("the client went away"));
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Shared worker state
// ------------------------------------------------------------------------------------------------

/// Request ids of work in flight, for `Release(request_id)`.
#[derive(Default)]
pub struct RequestTable {
    map: Mutex<HashMap<String, Ticket>>,
}

impl RequestTable {
    /// Records `request_id` → `ticket`; the returned guard forgets it again.
    pub fn insert(self: &Arc<Self>, request_id: &str, ticket: Ticket) -> RequestEntry {
        if !request_id.is_empty() {
            self.lock().insert(request_id.to_owned(), ticket);
        }
        RequestEntry { table: self.clone(), request_id: request_id.to_owned(), ticket }
    }

    /// The ticket of `request_id`'s work in flight.
    pub fn get(&self, request_id: &str) -> Option<Ticket> {
        self.lock().get(request_id).copied()
    }

    /// `Release(request_id)`: cancels `request_id`'s work in flight on `engine`, if there is
    /// any, and says whether there was.
    pub fn cancel(&self, request_id: &str, engine: &EngineHandle) -> bool {
        let Some(ticket) = self.get(request_id) else { return false };
        engine.cancel(ticket, Status::cancelled(format!("request {request_id} was released")));
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Ticket>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Removes a request id from its [`RequestTable`] when dropped.
pub struct RequestEntry {
    table: Arc<RequestTable>,
    request_id: String,
    ticket: Ticket,
}

impl Drop for RequestEntry {
    fn drop(&mut self) {
        let mut m = self.table.lock();
        if m.get(&self.request_id) == Some(&self.ticket) {
            m.remove(&self.request_id);
        }
    }
}

/// Counts a request in flight (for the drain) while alive.
pub struct InflightGuard {
    state: Arc<WorkerState>,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.state.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Where a worker's transfer counters come from (the KV sender or receiver): the totals for
/// `None`, one transport's for `Some`.
pub type TransferSource = Box<dyn Fn(Option<TransportKind>) -> TransferCounters + Send + Sync>;

/// What readiness checks besides the engine and the drain.
#[derive(Debug, Clone, Copy)]
pub struct ReadinessOptions {
    /// The worker registers with a router (`--router`): not ready until it has.
    pub needs_registration: bool,
    /// An engine with work that finished no step for this long is wedged (`--ready-stall-ms`).
    pub stall: Duration,
}

/// Everything readiness depends on, at one instant.
#[derive(Debug, Clone, Copy)]
pub struct ReadyInputs {
    /// The model is loaded and the servers are up.
    pub serving: bool,
    /// Registered with the router, or none to register with.
    pub registered: bool,
    pub draining: bool,
    /// The engine has work it should be stepping.
    pub has_work: bool,
    /// Since the engine's last progress (see [`EngineSnapshot::progress_at`]).
    pub since_progress: Duration,
    /// `--ready-stall-ms`.
    pub stall: Duration,
}

/// The readiness decision: Ok, or why not.
pub fn readiness(i: &ReadyInputs) -> Result<(), String> {
    if !i.serving {
        return Err("starting: the model is loading".into());
    }
    if i.draining {
        return Err("draining: shutting down".into());
    }
    if !i.registered {
        return Err("not registered with the router yet".into());
    }
    if i.has_work && i.since_progress > i.stall {
        return Err(format!(
            "engine wedged: it has work but finished no step for {} ms (--ready-stall-ms {})",
            i.since_progress.as_millis(),
            i.stall.as_millis()
        ));
    }
    Ok(())
}

/// State every handler of a worker shares.
pub struct WorkerState {
    /// The worker's registration record.
    pub info: WorkerInfo,
    pub engine: EngineHandle,
    draining: AtomicBool,
    inflight: AtomicUsize,
    finished: AtomicU64,
    failed: AtomicU64,
    transfers: TransferSource,
    /// Outstanding reservations the role tracks outside the engine (decode), for the drain.
    pending: Box<dyn Fn() -> usize + Send + Sync>,
    /// The servers are up (the model was loaded before).
    serving: AtomicBool,
    /// The router accepted the registration (and still knows this worker).
    registered: AtomicBool,
    readiness: ReadinessOptions,
    /// The worker's metrics (its own registry).
    pub metrics: WorkerMetrics,
}

impl WorkerState {
    /// Shared state of a worker with registration record `info`; `transfers` reports the KV
    /// transport's counters and `pending` the work a drain waits for besides requests in flight.
    pub fn new(
        info: WorkerInfo,
        engine: EngineHandle,
        transfers: TransferSource,
        pending: Box<dyn Fn() -> usize + Send + Sync>,
        readiness: ReadinessOptions,
    ) -> Arc<WorkerState> {
        Arc::new_cyclic(|me: &std::sync::Weak<WorkerState>| {
            let me = me.clone();
            WorkerState {
                info,
                engine,
                draining: AtomicBool::new(false),
                inflight: AtomicUsize::new(0),
                finished: AtomicU64::new(0),
                failed: AtomicU64::new(0),
                transfers,
                pending,
                serving: AtomicBool::new(false),
                registered: AtomicBool::new(false),
                readiness,
                metrics: WorkerMetrics::new(Box::new(move || me.upgrade().map(|s| s.live_values()))),
            }
        })
    }

    /// The servers are up: with no router to register with, the worker is ready from now on.
    pub fn set_serving(&self) {
        self.serving.store(true, Ordering::SeqCst);
    }

    /// Whether the router has accepted this worker (and still knows it).
    pub fn set_registered(&self, yes: bool) {
        self.registered.store(yes, Ordering::SeqCst);
    }

    /// Readiness now (see [`readiness`]).
    pub fn ready(&self) -> Result<(), String> {
        let snap = self.engine.snapshot();
        readiness(&ReadyInputs {
            serving: self.serving.load(Ordering::SeqCst),
            registered: !self.readiness.needs_registration || self.registered.load(Ordering::SeqCst),
            draining: self.draining(),
            has_work: snap.has_work,
            since_progress: snap.progress_at.elapsed(),
            stall: self.readiness.stall,
        })
    }

    /// Liveness now: the engine thread runs (or was told to stop).
    pub fn live(&self) -> Result<(), String> {
        self.engine.alive()
    }

    /// What the metrics read at scrape time.
    fn live_values(&self) -> LiveValues {
        let s = self.engine.snapshot();
        LiveValues {
            kv_used: s.kv.used as u64,
            kv_free: s.kv.free as u64,
            kv_capacity: s.kv.total as u64,
            running: (s.load.running + s.load.held) as u64,
            queue_depth: s.load.waiting as u64,
            reservations: s.load.reservations as u64,
            engine_steps: s.steps,
            draining: self.draining(),
            ready: self.ready().is_ok(),
            transfers: [TransportKind::Tcp, TransportKind::Shm]
                .iter()
                .filter(|k| self.info.transports.iter().any(|o| o.kind == k.as_str()))
                .map(|&k| (k, (self.transfers)(Some(k))))
                .collect(),
        }
    }

    /// Counts an error answered by any method of the Worker service, and passes the result on.
    pub fn answered<T>(&self, r: Result<T, Status>) -> Result<T, Status> {
        if let Err(st) = &r {
            self.metrics.error(st);
        }
        r
    }

    /// Whether the worker is draining.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// UNAVAILABLE when draining: new work is not taken.
    pub fn check_accepting(&self) -> Result<(), Status> {
        if self.draining() {
            return Err(Status::unavailable(format!(
                "worker {} is draining (shutting down) and takes no new work",
                self.info.worker_id
            )));
        }
        Ok(())
    }

    /// Counts a request in flight until the guard drops.
    pub fn inflight(self: &Arc<Self>) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        InflightGuard { state: self.clone() }
    }

    /// Requests in flight.
    pub fn inflight_count(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    /// Records a request's outcome for `Stats`.
    pub fn record(&self, ok: bool) {
        if ok {
            self.finished.fetch_add(1, Ordering::Relaxed);
        } else {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The load report for heartbeats and `Stats`.
    pub fn load(&self) -> WorkerLoad {
        let s = self.engine.snapshot();
        WorkerLoad {
            total_blocks: s.kv.total as u32,
            free_blocks: s.kv.free as u32,
            running: (s.load.running + s.load.held) as u32,
            queued: s.load.waiting as u32,
            queued_prompt_tokens: s.load.waiting_prompt_tokens as u64,
            reservations: s.load.reservations as u32,
            draining: self.draining(),
        }
    }

    /// The `Stats` answer; with `check_invariants` the engine thread runs the allocator checker.
    pub async fn stats(&self, check_invariants: bool) -> Result<StatsResponse, Status> {
        let (kv, check, steps) = if check_invariants {
            self.engine
                .call(|core| {
                    let r = core.engine.check_kv().map_err(|e| e.to_string());
                    (core.engine.kv_stats(), Some(r), core.steps())
                })
                .await?
        } else {
            let s = self.engine.snapshot();
            (s.kv, None, s.steps)
        };
        Ok(StatsResponse {
            load: Some(self.load()),
            kv: Some(KvCounters {
                total: kv.total as u32,
                free: kv.free as u32,
                used: kv.used as u32,
                sequences: kv.sequences as u32,
                raw_reserved: kv.raw_reserved as u32,
            }),
            invariants_checked: check.is_some(),
            invariants_ok: matches!(check, Some(Ok(()))),
            invariant_error: match check {
                Some(Err(e)) => e,
                _ => String::new(),
            },
            transfers: Some((self.transfers)(None)),
            steps,
            requests_finished: self.finished.load(Ordering::Relaxed),
            requests_failed: self.failed.load(Ordering::Relaxed),
        })
    }
}

// ------------------------------------------------------------------------------------------------
// Conversions and status mapping
// ------------------------------------------------------------------------------------------------

/// The engine's sampling parameters for a request's [`EngineParams`] (every default resolved by
/// the router). Missing params are INVALID_ARGUMENT.
pub fn sampling_params(p: Option<&EngineParams>) -> Result<SamplingParams, Status> {
    let p = p.ok_or_else(|| Status::invalid_argument("params: missing (the router resolves them)"))?;
    Ok(SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        seed: Some(p.seed),
        max_tokens: p.max_tokens as usize,
        stop_token_ids: p.stop_token_ids.clone(),
        stop_strings: Vec::new(),
        ignore_eos: p.ignore_eos,
        logprobs: None,
    })
}

/// The gRPC status for an engine error.
pub fn engine_status(e: &EngineError) -> Status {
    let msg = e.to_string();
    match e {
        EngineError::InvalidRequest(_) => Status::invalid_argument(msg),
        EngineError::Kv(KvError::OutOfBlocks { .. }) | EngineError::Busy(_) => Status::resource_exhausted(msg),
        _ => Status::internal(msg),
    }
}

/// The gRPC status for a failed KV transfer: an unreachable peer is UNAVAILABLE, a bad
/// destination INVALID_ARGUMENT, anything that broke mid-transfer ABORTED.
pub fn transport_status(e: &TransportError) -> Status {
    let msg = e.to_string();
    match e {
        TransportError::Connect { .. } => Status::unavailable(msg),
        TransportError::Invalid(_) => Status::invalid_argument(msg),
        _ => Status::aborted(msg),
    }
}

// ------------------------------------------------------------------------------------------------
// Response streams
// ------------------------------------------------------------------------------------------------

/// A response stream that cancels its sequence when dropped and counts as in flight while alive.
pub struct GuardedStream<T> {
    rx: mpsc::UnboundedReceiver<Result<T, Status>>,
    _cancel: CancelOnDrop,
    _inflight: InflightGuard,
    _entry: Option<RequestEntry>,
}

impl<T> GuardedStream<T> {
    /// Streams what `rx` receives; dropping the stream drops the guards (cancel, in-flight count,
    /// request id entry).
    pub fn new(
        rx: mpsc::UnboundedReceiver<Result<T, Status>>,
        cancel: CancelOnDrop,
        inflight: InflightGuard,
        entry: Option<RequestEntry>,
    ) -> Self {
        GuardedStream { rx, _cancel: cancel, _inflight: inflight, _entry: entry }
    }
}

impl<T> tokio_stream::Stream for GuardedStream<T> {
    type Item = Result<T, Status>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

// ------------------------------------------------------------------------------------------------
// Server, registration, drain
// ------------------------------------------------------------------------------------------------

/// The address to advertise for a bound socket: `--advertise`, else the bound address with an
/// unspecified IP replaced by loopback.
pub fn advertise_addr(flag: Option<&str>, bound: SocketAddr) -> String {
    if let Some(a) = flag.filter(|a| !a.trim().is_empty()) {
        return a.trim().to_owned();
    }
    let mut a = bound;
    if a.ip().is_unspecified() {
        tracing::warn!(%bound, "bound to an unspecified address; advertising loopback (set --advertise)");
        a.set_ip(if a.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        });
    }
    a.to_string()
}

/// How [`serve`] runs a worker.
pub struct ServeOptions {
    /// Router registry address (`host:port` or a URL).
    pub router: Option<String>,
    /// How long requests in flight may take to finish after SIGTERM/SIGINT.
    pub drain_timeout: Duration,
    /// The KV listener address for the `listening` line (decode workers).
    pub kv_addr: Option<SocketAddr>,
    /// The bound `--http-listen` socket (`/health`, `/ready`, `/metrics`).
    pub http: tokio::net::TcpListener,
    /// The cluster secret: asked of callers of the Worker service, presented to the router.
    pub secret: Option<Secret>,
}

/// `/health` and `/ready` of a worker.
pub struct WorkerProbe(pub Arc<WorkerState>);

impl Probe for WorkerProbe {
    fn live(&self) -> Result<(), String> {
        self.0.live()
    }
    fn ready(&self) -> Result<(), String> {
        self.0.ready()
    }
}

/// Why the registration loop gave up: the worker exits 1 with this.
#[derive(Debug)]
enum Refusal {
    /// The router refused the worker (FAILED_PRECONDITION: incompatible with the cluster).
    Refused(String),
    /// The router refused the cluster secret (UNAUTHENTICATED).
    Secret(String),
    /// `--router` is unusable.
    BadAddress(String),
}

/// Serves `svc` on `listener` with health and reflection, and the HTTP ops endpoints on
/// `opts.http`; registers with the router, and on `shutdown` drains and deregisters. Returns an
/// error (exit 1) when the router refuses the registration.
pub async fn serve<S: Worker>(
    state: Arc<WorkerState>,
    svc: S,
    listener: tokio::net::TcpListener,
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let addr = listener.local_addr().context("reading the bound gRPC address")?;
    let http_addr = opts.http.local_addr().context("reading the bound HTTP address")?;
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<WorkerServer<S>>().await;
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(tandem_proto::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1().context("building the reflection service")?;
    let reflection_v1alpha = reflection().build_v1alpha().context("building the reflection service")?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .add_service(WorkerServer::with_interceptor(svc, {
            let state = state.clone();
            auth::cluster_interceptor(opts.secret.clone(), move |st: &tonic::Status| state.metrics.error(st))
        }))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut shutdown = std::pin::pin!(shutdown);
    let signalled = poll_once(&mut shutdown).await;
    let server_task = tokio::spawn(server.serve_with_incoming_shutdown(incoming, stopped(stop_rx.clone())));
    let app = ops::ops_routes(Arc::new(WorkerProbe(state.clone())), state.metrics.registry());
    let http_task = tokio::spawn(ops::serve_http(opts.http, app, stopped(stop_rx)));
    state.set_serving();
    print_listening(&Listening { grpc: addr, http: Some(http_addr), kv: opts.kv_addr });
    tracing::info!(
        %addr,
        http = %http_addr,
        kv = ?opts.kv_addr,
        worker_id = %state.info.worker_id,
        role = role_name(state.info.role()),
        advertise = %state.info.address,
        cluster_secret = opts.secret.is_some(),
        "worker listening"
    );

    let (fatal_tx, fatal_rx) = oneshot::channel::<Refusal>();
    let registration = opts
        .router
        .clone()
        .map(|router| tokio::spawn(register_loop(state.clone(), router, opts.secret.clone(), fatal_tx)));

    let refused = if signalled {
        None
    } else {
        tokio::select! {
            _ = &mut shutdown => None,
            r = fatal_rx, if registration.is_some() => r.ok(),
        }
    };
    if let Some(why) = refused {
        let _ = stop_tx.send(true);
        state.engine.stop("the router refused this worker");
        let _ = tokio::time::timeout(Duration::from_secs(2), server_task).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), http_task).await;
        match why {
            Refusal::Refused(msg) => bail!("the router refused to register this worker: {msg}"),
            Refusal::Secret(msg) => bail!(
                "the router refused this worker's cluster secret (check --cluster-secret / \
                 TANDEM_CLUSTER_SECRET: it must be the router's): {msg}"
            ),
            Refusal::BadAddress(msg) => bail!("{msg}"),
        }
    }

    // Drain: readiness is off from here on (`draining` is checked by every probe).
    state.draining.store(true, Ordering::SeqCst);
    health.set_not_serving::<WorkerServer<S>>().await;
    health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
    tracing::info!(
        inflight = state.inflight_count(),
        timeout_ms = opts.drain_timeout.as_millis() as u64,
        "draining: no new work; finishing requests in flight"
    );
    let deadline = Instant::now() + opts.drain_timeout;
    loop {
        let busy = state.inflight_count() + (state.pending)();
        if busy == 0 {
            break;
        }
        if Instant::now() >= deadline {
            tracing::warn!(busy, "drain timeout: cancelling what is left");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    state.engine.stop("the worker is shutting down");
    if let Some(task) = registration {
        task.abort();
        if let Some(router) = &opts.router {
            deregister(router, opts.secret.as_ref(), &state.info.worker_id).await;
        }
    }
    let _ = stop_tx.send(true);
    match tokio::time::timeout(Duration::from_secs(5), server_task).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "gRPC server ended with an error"),
        Ok(Err(e)) => tracing::warn!(error = %e, "gRPC server task failed"),
        Err(_) => tracing::warn!("gRPC server did not stop within 5 s; exiting anyway"),
    }
    match tokio::time::timeout(Duration::from_secs(5), http_task).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "HTTP server ended with an error"),
        Ok(Err(e)) => tracing::warn!(error = %e, "HTTP server task failed"),
        Err(_) => tracing::warn!("HTTP server did not stop within 5 s; exiting anyway"),
    }
    tracing::info!("worker stopped");
    Ok(())
}

fn router_uri(router: &str) -> String {
    if router.contains("://") {
        router.to_owned()
    } else {
        format!("http://{router}")
    }
}

fn registry_client(router: &str) -> Result<RegistryClient<tonic::transport::Channel>, String> {
    let ep = tonic::transport::Endpoint::from_shared(router_uri(router))
        .map_err(|e| format!("--router {router}: {e}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5));
    Ok(RegistryClient::new(ep.connect_lazy()))
}

/// Registers with the router (retrying with backoff until it answers), then heartbeats at the
/// interval it asked for; registers again when the router no longer knows this worker. A refusal
/// (FAILED_PRECONDITION, or UNAUTHENTICATED for the cluster secret) is sent to `fatal`.
async fn register_loop(
    state: Arc<WorkerState>,
    router: String,
    secret: Option<Secret>,
    fatal: oneshot::Sender<Refusal>,
) {
    let mut client = match registry_client(&router) {
        Ok(c) => c,
        Err(e) => {
            let _ = fatal.send(Refusal::BadAddress(e));
            return;
        }
    };
    loop {
        let mut backoff = Duration::from_millis(100);
        let mut attempts = 0u32;
        let interval = loop {
            match client.register(auth::cluster_request(secret.as_ref(), state.info.clone())).await {
                Ok(r) => {
                    let r = r.into_inner();
                    state.set_registered(true);
                    tracing::info!(%router, router_id = %r.router_id, "registered with the router");
                    break Duration::from_millis(u64::from(r.heartbeat_interval_ms).clamp(50, 60_000));
                }
                Err(st) if st.code() == Code::FailedPrecondition => {
                    tracing::error!(%router, reason = %st.message(), "the router refused this worker");
                    let _ = fatal.send(Refusal::Refused(st.message().to_owned()));
                    return;
                }
                Err(st) if st.code() == Code::Unauthenticated => {
                    tracing::error!(%router, reason = %st.message(), "the router refused the cluster secret");
                    let _ = fatal.send(Refusal::Secret(st.message().to_owned()));
                    return;
                }
                Err(st) => {
                    attempts += 1;
                    if attempts == 1 || attempts.is_multiple_of(20) {
                        tracing::warn!(%router, error = %st.message(), attempts, "router not answering; retrying");
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        };
        let mut failures = 0u32;
        loop {
            tokio::time::sleep(interval).await;
            let req = HeartbeatRequest { worker_id: state.info.worker_id.clone(), load: Some(state.load()) };
            match client.heartbeat(auth::cluster_request(secret.as_ref(), req)).await {
                Ok(r) if !r.get_ref().known => {
                    state.set_registered(false);
                    tracing::info!(%router, "the router does not know this worker (restarted?); registering again");
                    break;
                }
                Ok(_) => failures = 0,
                Err(st) => {
                    failures += 1;
                    if failures == 1 || failures.is_multiple_of(20) {
                        tracing::warn!(%router, error = %st.message(), "heartbeat failed");
                    }
                }
            }
        }
    }
}

async fn deregister(router: &str, secret: Option<&Secret>, worker_id: &str) {
    let Ok(mut client) = registry_client(router) else {
        return;
    };
    let req = auth::cluster_request(secret, DeregisterRequest { worker_id: worker_id.to_owned() });
    match tokio::time::timeout(Duration::from_secs(2), client.deregister(req)).await {
        Ok(Ok(_)) => tracing::info!(%router, "deregistered from the router"),
        // The router stopped first (a whole cluster shutting down): the registration went with it.
        Ok(Err(st)) if st.code() == Code::Unavailable => {
            tracing::info!(%router, "the router is already gone; nothing to deregister from")
        }
        Ok(Err(st)) => tracing::warn!(%router, error = %st.message(), "deregistering failed"),
        Err(_) => tracing::warn!(%router, "deregistering timed out"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> ReadyInputs {
        ReadyInputs {
            serving: true,
            registered: true,
            draining: false,
            has_work: true,
            since_progress: Duration::from_millis(10),
            stall: Duration::from_millis(30_000),
        }
    }

    #[test]
    fn readiness_needs_serving_registered_not_draining_and_progress() {
        assert_eq!(readiness(&inputs()), Ok(()));
        let e = readiness(&ReadyInputs { serving: false, ..inputs() }).unwrap_err();
        assert!(e.contains("loading"), "{e}");
        let e = readiness(&ReadyInputs { registered: false, ..inputs() }).unwrap_err();
        assert!(e.contains("not registered"), "{e}");
        let e = readiness(&ReadyInputs { draining: true, ..inputs() }).unwrap_err();
        assert!(e.contains("draining"), "{e}");
        // Wedged: work, and no step for longer than the stall limit.
        let wedged = ReadyInputs { since_progress: Duration::from_millis(30_001), ..inputs() };
        let e = readiness(&wedged).unwrap_err();
        assert!(e.contains("wedged") && e.contains("30001 ms"), "{e}");
        // Exactly at the limit is still fine; an idle engine is never wedged.
        assert_eq!(
            readiness(&ReadyInputs { since_progress: Duration::from_millis(30_000), ..inputs() }),
            Ok(())
        );
        assert_eq!(readiness(&ReadyInputs { has_work: false, ..wedged }), Ok(()));
    }
}
