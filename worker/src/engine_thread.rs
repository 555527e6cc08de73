//! The engine-thread actor. One `std::thread` owns the [`Engine`]; handlers send it jobs
//! (closures over [`EngineCore`]) through a cloneable [`EngineHandle`] and get answers back over
//! tokio channels. Jobs run in the order they were sent, between steps, so a cancel sent after an
//! add always finds what the add created.
//!
//! Invariants: a sequence with a [`SeqSink`] has exactly one ticket (a ticket may name several
//! sequences: the choices of one request), and one without a sink is cancelled at its next event
//! (nothing holds blocks that nobody listens to); cancelling a ticket cancels every sequence it
//! names; every attached sequence is cancelled, its sink told why, when the thread stops.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use tandem_engine::kv::{KvLayout, KvStats, SeqId, TierStats};
use tandem_engine::scheduler::cost::StepCost;
use tandem_engine::scheduler::{AdapterStats, Engine, EngineLoad, PrefixStats, SeqEvent, TierEngineStats};
use tandem_engine::spec::{SpecMethod, SpecStats};

use crate::error::WorkerError;

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
#[derive(Debug, Clone)]
pub struct EngineSnapshot {
    /// Sequences, queue and reservations.
    pub load: EngineLoad,
    /// Allocator counters (in pages: one per layer group and token block).
    pub kv: KvStats,
    /// Steps run so far.
    pub steps: u64,
    /// The engine has sequences to step (waiting or running, not merely blocked on blocks held
    /// elsewhere): it should be finishing steps.
    pub has_work: bool,
    /// When the last step finished, or when work arrived at an idle engine if later.
    pub progress_at: Instant,
    /// Draft tokens proposed and accepted since the engine started; `None` when it does not
    /// speculate.
    pub spec: Option<SpecStats>,
    /// Prefix-cache counters; `None` without a prefix cache.
    pub prefix: Option<PrefixStats>,
    /// The KV tiers' counters and the engine's; `None` without tiers.
    pub tiers: Option<(TierStats, TierEngineStats)>,
    /// The step-cost model and inter-token target; `None` without a latency budget.
    pub step_cost: Option<(StepCost, Duration)>,
    /// LoRA adapter counters; `None` without adapter slots.
    pub adapters: Option<AdapterStats>,
}

/// The engine and the sinks of its sequences; jobs get `&mut` to it on the engine thread.
pub struct EngineCore {
    pub engine: Engine,
    sinks: HashMap<SeqId, (Ticket, Box<dyn SeqSink>)>,
    /// The sequences each ticket names (one per choice of its request).
    tickets: HashMap<Ticket, Vec<SeqId>>,
    steps: u64,
    snapshot: Arc<Mutex<EngineSnapshot>>,
    stop: bool,
}

impl EngineCore {
    /// Routes `seq`'s events to `sink` under `ticket` (which [`CancelOnDrop`] and releases use);
    /// a ticket may name several sequences.
    pub fn attach(&mut self, ticket: Ticket, seq: SeqId, sink: Box<dyn SeqSink>) {
        self.tickets.entry(ticket).or_default().push(seq);
        self.sinks.insert(seq, (ticket, sink));
    }

    /// Cancels every sequence of `ticket` and tells their sinks why. False if there is none (they
    /// ended).
    pub fn cancel_ticket(&mut self, ticket: Ticket, status: Status) -> bool {
        let Some(seqs) = self.tickets.remove(&ticket) else {
            return false;
        };
        for seq in seqs {
            if let Err(e) = self.engine.cancel(seq) {
                tracing::error!(seq, error = %e, "cancelling a sequence failed");
            }
            if let Some((_, mut sink)) = self.sinks.remove(&seq) {
                sink.on_cancel(status.clone());
            }
        }
        true
    }

    /// Forgets `seq`'s sink and its place under its ticket (the sequence is over).
    fn detach(&mut self, seq: SeqId) {
        if let Some((ticket, _)) = self.sinks.remove(&seq) {
            if let Some(seqs) = self.tickets.get_mut(&ticket) {
                seqs.retain(|&s| s != seq);
                if seqs.is_empty() {
                    self.tickets.remove(&ticket);
                }
            }
        }
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
        snap.spec = spec_stats(&self.engine);
        snap.prefix = prefix_stats(&self.engine);
        snap.tiers = self.engine.tier_stats();
        snap.step_cost = self.engine.step_cost();
        snap.adapters = self.engine.adapter_stats();
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
                | SeqEvent::Prefilled { seq, .. }
                | SeqEvent::PromptLogprobs { seq, .. } => *seq,
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
                self.detach(seq);
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
    /// Window of each layer group of the pool (`[None]` without groups).
    windows: Arc<[Option<usize>]>,
    /// Set by [`EngineHandle::stop`]: the thread ending afterwards is expected.
    stopping: Arc<AtomicBool>,
    /// The engine has KV tiers behind its pool.
    tiers: bool,
    /// The model's shape (what LoRA adapters are checked against, off the engine thread).
    config: Arc<tandem_engine::config::ModelConfig>,
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
    pub fn spawn(engine: Engine) -> Result<(EngineHandle, EngineThread), WorkerError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let snapshot = Arc::new(Mutex::new(EngineSnapshot {
            load: engine.load(),
            kv: engine.kv_stats(),
            steps: 0,
            has_work: false,
            progress_at: Instant::now(),
            spec: spec_stats(&engine),
            prefix: prefix_stats(&engine),
            tiers: engine.tier_stats(),
            step_cost: engine.step_cost(),
            adapters: engine.adapter_stats(),
        }));
        let handle = EngineHandle {
            tx,
            next_ticket: Arc::new(AtomicU64::new(1)),
            snapshot: snapshot.clone(),
            max_sequence_len: engine.max_sequence_len(),
            layout: engine.backend().kv_layout(),
            windows: engine.kv_windows().into(),
            stopping: Arc::new(AtomicBool::new(false)),
            tiers: engine.kv_tiers().is_some(),
            config: Arc::new(engine.backend().config().clone()),
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
            .map_err(|source| WorkerError::Io { what: "starting the engine thread", source })?;
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

    /// Cancels the sequences of `ticket` (those still running), telling their sinks `status`.
    pub fn cancel(&self, ticket: Ticket, status: Status) {
        self.submit(move |core| {
            core.cancel_ticket(ticket, status);
        });
    }

    /// The latest published load and occupancy.
    pub fn snapshot(&self) -> EngineSnapshot {
        self.snapshot.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Longest sequence the engine holds.
    pub fn max_sequence_len(&self) -> usize {
        self.max_sequence_len
    }

    /// The engine's KV layout.
    /// Window of each layer group of the KV pool ([`tandem_engine::kv::groups`]; `[None]`
    /// without groups): block tables and transfers hold one page per group and token block.
    pub fn kv_windows(&self) -> &[Option<usize>] {
        &self.windows
    }

    /// Whether the engine has KV tiers behind its pool.
    pub fn has_tiers(&self) -> bool {
        self.tiers
    }

    /// The engine's model config (adapters are read against it off the engine thread).
    pub fn model_config(&self) -> Arc<tandem_engine::config::ModelConfig> {
        self.config.clone()
    }

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

/// The engine's prefix-cache counters, when it has a prefix cache.
pub(super) fn prefix_stats(engine: &Engine) -> Option<PrefixStats> {
    engine.prefix_cache().then(|| engine.prefix_stats())
}

/// The engine's speculation counters, when it speculates.
pub(super) fn spec_stats(engine: &Engine) -> Option<SpecStats> {
    (engine.spec_method() != SpecMethod::Off).then(|| engine.spec_stats())
}

fn engine_gone() -> Status {
    Status::internal("the engine thread has stopped")
}

/// Longest sleep of a paced engine thread before it looks at its jobs again.
const PACE_SLICE: Duration = Duration::from_millis(5);

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
            if let Some(at) = core.engine.pace_until() {
                // Paced (`--pace-steps`): the cores are the prefill worker's until `at`. Jobs
                // (cancels, new sequences) are still taken every slice.
                std::thread::sleep(at.saturating_duration_since(Instant::now()).min(PACE_SLICE));
                continue;
            }
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
    // What the pool holds goes to the KV tiers too, so a restarted worker finds it on disk.
    match core.engine.spill_pool(Duration::from_secs(5)) {
        Ok(0) => {}
        Ok(pages) => tracing::info!(pages, "KV pool pages kept in the tiers for the next start"),
        Err(e) => tracing::warn!(error = %e, "keeping the KV pool's pages in the tiers failed"),
    }
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
