//! The prefill worker (`tandem-prefill`): computes prompts, moves their KV blocks into blocks a
//! decode worker reserved, and answers with the first token.
//!
//! A `Prefill` opens the KV transfer session to the destination *first* (which pins the
//! reservation there), then queues a prefill-only request on the engine thread carrying the
//! session. When the engine has computed the prompt and sampled the first token, the engine thread
//! copies the sequence's blocks into the session (`stage`), frees them (`release_prefilled`) and
//! hands the session back; the handler finishes the transfer (waits for the destination's
//! acknowledgement) and answers. Whatever fails, the scratch blocks are freed, and a session that
//! is dropped unfinished closes its connection, which makes the destination free its reservation.
//!
//! A request under a LoRA adapter (`EngineParams.adapter`) is checked against the adapters this
//! worker holds before the transfer is opened (NOT_FOUND, FAILED_PRECONDITION), runs with the
//! adapter's id pinned, and its transfer carries that id: the decode worker refuses it unless its
//! reservation was made for the same adapter.

use std::sync::Arc;
use std::time::Instant;

use tandem_proto::v1::worker_server::Worker;
use tandem_proto::v1::{
    AdapterInfo, DecodeRequest, DecodeResponse, InfoRequest, ListAdaptersRequest, ListAdaptersResponse,
    LoadAdapterRequest, PrefillRequest, PrefillResponse, ReleaseRequest, ReleaseResponse, ReserveRequest,
    ReserveResponse, Role, StatsRequest, StatsResponse, TopLogprobs, UnloadAdapterRequest,
    UnloadAdapterResponse, WorkerInfo,
};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use tandem_engine::kv::prefix::blocks_to_send;
use tandem_engine::kv::SeqId;
use tandem_engine::scheduler::{Engine, SeqEvent};
use tandem_serve::config::{init_logging, shutdown_signal};
use tandem_transport::{KvSender, SenderOptions, TransferSession, TransportKind};
use tandem_worker::compat_record;
use tandem_worker::kv_wire::{destination_from_wire, offer_to_wire};
use tandem_worker::speculation::NotOnPrefill;
use tandem_worker::{
    adapters, adapters_wire, advertise_addr, bind, build_engine, engine_status, kv_token, load_model,
    local_addr, prompt_scores_wire, resolve_adapter_id, sampling_params, serve, top_wire, transport_status,
    CancelOnDrop, EngineHandle, GuardedStream, RequestTable, SeqSink, ServeOptions, SinkFlow,
    TransportChoice, WorkerArgs, WorkerError, WorkerState,
};

/// Flags of `tandem-prefill`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "tandem-prefill",
    version,
    about = "Tandem prefill worker: computes prompts and sends their KV cache to decode workers"
)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub common: WorkerArgs,
    /// The speculation flags, refused: prefill workers never speculate.
    #[command(flatten)]
    pub not_speculation: NotOnPrefill,
}

/// What the engine thread hands back once a prompt is computed and its blocks are staged.
struct Prefilled {
    session: TransferSession,
    token: u32,
    logprob: f32,
    /// The token's alternatives, when the request asked for them.
    top_logprobs: Option<tandem_proto::v1::TopLogprobs>,
    /// The token rule `token` already ends the sequence by, if any ("length" or "stop").
    finish: Option<&'static str>,
    queue_ms: f64,
    compute_ms: f64,
    /// Prompt tokens this worker's prefix cache supplied.
    cached_tokens: usize,
    /// The prompt's scores, when asked for (`prompt_logprobs`).
    prompt_logprobs: Vec<f32>,
    prompt_top_logprobs: Vec<TopLogprobs>,
}

/// Stages a prefilled sequence into its transfer session, on the engine thread.
struct PrefillSink {
    session: Option<TransferSession>,
    tx: Option<oneshot::Sender<Result<Prefilled, Status>>>,
    submitted: Instant,
    prompt_tokens: u64,
    /// Leading prompt blocks the destination already holds: not sent.
    skip_blocks: usize,
    state: Arc<WorkerState>,
    /// The prompt's scores ([`SeqEvent::PromptLogprobs`]), kept for the answer.
    prompt_scores: (Vec<f32>, Vec<TopLogprobs>),
}

impl PrefillSink {
    fn answer(&mut self, r: Result<Prefilled, Status>) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(r);
        }
    }
}

impl SeqSink for PrefillSink {
    fn on_events(&mut self, engine: &mut Engine, seq: SeqId, events: &[SeqEvent]) -> SinkFlow {
        // A prefill-only sequence has one event: Prefilled, or Failed; the prompt's scores come
        // just before Prefilled when they were asked for.
        let mut rest = events.iter();
        let ev = loop {
            match rest.next() {
                Some(SeqEvent::PromptLogprobs { logprobs, top_logprobs, .. }) => {
                    self.prompt_scores = prompt_scores_wire(logprobs, top_logprobs);
                }
                Some(ev) => break ev,
                None => return SinkFlow::Continue,
            }
        };
        match ev {
            SeqEvent::Prefilled { token, logprob, top_logprobs, finish, .. } => {
                self.state.metrics.prefilled(self.prompt_tokens);
                let now = Instant::now();
                let started = engine.started_at(seq).unwrap_or(self.submitted);
                let queue_ms = started.saturating_duration_since(self.submitted).as_secs_f64() * 1e3;
                let compute_ms = now.saturating_duration_since(started).as_secs_f64() * 1e3;
                let cached_tokens = engine.cached_tokens(seq).unwrap_or(0);
                // The pages a sequence of the prompt's length keeps, after the skipped blocks.
                let bs = engine.backend().kv_layout().block_size;
                let windows = engine.kv_windows();
                let table = engine.block_table(seq).and_then(|t| {
                    tandem_engine::kv::groups::kept_pages(
                        t,
                        windows,
                        self.prompt_tokens as usize,
                        self.skip_blocks,
                        bs,
                    )
                });
                let staged = match (self.session.take(), table) {
                    (Some(mut session), Some(table)) => session
                        .stage(engine.backend(), &table)
                        .map(|()| session)
                        .map_err(|e| transport_status(&e)),
                    _ => Err(Status::internal("prefilled sequence without a session or block table")),
                };
                // The scratch blocks are free whatever happened to the copy.
                if let Err(e) = engine.release_prefilled(seq) {
                    tracing::error!(seq, error = %e, "releasing a prefilled sequence failed");
                }
                let r = staged.map(|session| Prefilled {
                    session,
                    token: *token,
                    logprob: *logprob,
                    top_logprobs: (!top_logprobs.is_empty()).then(|| top_wire(top_logprobs)),
                    finish: finish.as_ref().map(|f| f.as_str()),
                    queue_ms,
                    compute_ms,
                    cached_tokens,
                    prompt_logprobs: std::mem::take(&mut self.prompt_scores.0),
                    prompt_top_logprobs: std::mem::take(&mut self.prompt_scores.1),
                });
                self.answer(r);
                SinkFlow::Done
            }
            SeqEvent::Failed { error, .. } => {
                self.answer(Err(Status::internal(format!("prefill failed: {error}"))));
                SinkFlow::Done
            }
            SeqEvent::Token { .. } | SeqEvent::Finished { .. } | SeqEvent::PromptLogprobs { .. } => {
                self.answer(Err(Status::internal("a prefill-only sequence generated past its first token")));
                SinkFlow::Cancel
            }
        }
    }

    fn on_cancel(&mut self, status: Status) {
        self.answer(Err(status));
    }
}

/// The prefill worker's `Worker` service.
#[derive(Clone)]
pub struct PrefillService {
    state: Arc<WorkerState>,
    sender: Arc<KvSender>,
    requests: Arc<RequestTable>,
}

impl PrefillService {
    /// The service over a worker's shared state and its KV sender.
    pub fn new(state: Arc<WorkerState>, sender: Arc<KvSender>) -> Self {
        PrefillService { state, sender, requests: Arc::default() }
    }

    async fn run_prefill(&self, r: PrefillRequest) -> Result<PrefillResponse, Status> {
        let mut params = sampling_params(r.params.as_ref())?;
        let dest = r.destination.ok_or_else(|| Status::invalid_argument("destination: missing"))?;
        let prompt = r.prompt_token_ids;
        if prompt.is_empty() {
            return Err(Status::invalid_argument("prompt_token_ids: empty"));
        }
        let block_size = self.state.engine.layout().block_size;
        let skip = dest.skip_blocks as usize;
        blocks_to_send(prompt.len(), block_size, skip).map_err(|reusable| {
            Status::invalid_argument(format!(
                "destination.skip_blocks: {skip} for a prompt of {} tokens; at most {reusable} (the block of the last prompt token is always sent)",
                prompt.len()
            ))
        })?;
        // One page per layer group a sequence of the prompt's length keeps, per token block.
        let windows = self.state.engine.kv_windows();
        let want = tandem_engine::kv::groups::kept_count(windows, prompt.len(), skip, block_size);
        if dest.block_ids.len() != want {
            return Err(Status::invalid_argument(format!(
                "destination: {} block ids for a prompt of {} tokens with {skip} blocks skipped; {want} expected (block size {block_size})",
                dest.block_ids.len(),
                prompt.len()
            )));
        }
        // The adapter, checked before the destination's reservation is pinned; its id is pinned
        // in the request (the engine refuses it if the name is loaded again with other weights
        // meanwhile) and travels with the transfer.
        let adapter_id = if params.adapter.is_empty() && params.adapter_id.is_empty() {
            String::new()
        } else {
            let p = params.clone();
            let id = self.state.engine.call(move |core| resolve_adapter_id(&core.engine, &p)).await?;
            id.map_err(|e| engine_status(&e))?
        };
        params.adapter_id.clone_from(&adapter_id);
        let t_open = Instant::now();
        let dest = destination_from_wire(&dest).map_err(|e| transport_status(&e))?;
        let session =
            self.sender.open_for_adapter(&dest, &adapter_id).await.map_err(|e| transport_status(&e))?;
        let open_ms = t_open.elapsed().as_secs_f64() * 1e3;

        let engine = self.state.engine.clone();
        let ticket = engine.ticket();
        let _entry = self.requests.insert(&r.request_id, ticket);
        let (tx, rx) = oneshot::channel();
        let sink = Box::new(PrefillSink {
            session: Some(session),
            tx: Some(tx),
            submitted: Instant::now(),
            prompt_tokens: prompt.len() as u64,
            skip_blocks: skip,
            state: self.state.clone(),
            prompt_scores: Default::default(),
        });
        let mut cancel = CancelOnDrop::new(engine.clone(), ticket);
        engine
            .call(move |core| {
                let seq = core.engine.add_prefill_request(prompt, params).map_err(|e| engine_status(&e))?;
                core.attach(ticket, seq, sink);
                Ok::<_, Status>(())
            })
            .await
            .inspect_err(|_| cancel.disarm())??;
        let done = rx.await.map_err(|_| Status::internal("the engine thread dropped the prefill"))?;
        cancel.disarm();
        let done = done?;
        let report = done.session.finish().await.map_err(|e| transport_status(&e))?;
        Ok(PrefillResponse {
            first_token: done.token,
            logprob: done.logprob,
            first_top_logprobs: done.top_logprobs,
            queue_ms: done.queue_ms,
            compute_ms: done.compute_ms,
            transfer_ms: open_ms + report.seconds * 1e3,
            transfer_bytes: report.bytes,
            cached_tokens: done.cached_tokens as u32,
            finish_reason: done.finish.map(str::to_owned),
            prompt_logprobs: done.prompt_logprobs,
            prompt_top_logprobs: done.prompt_top_logprobs,
        })
    }
}

#[tonic::async_trait]
impl Worker for PrefillService {
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

    async fn reserve(&self, _: Request<ReserveRequest>) -> Result<Response<ReserveResponse>, Status> {
        self.state.answered(Err(Status::unimplemented(
            "this is a prefill worker; Reserve is served by decode workers",
        )))
    }

    async fn prefill(&self, req: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        if let Err(st) = self.state.check_accepting() {
            self.state.metrics.request(Err(&st));
            return Err(st);
        }
        let _inflight = self.state.inflight();
        let r = req.into_inner();
        let request_id = r.request_id.clone();
        let reservation = r.destination.as_ref().map(|d| d.reservation_id).unwrap_or_default();
        let out = self.run_prefill(r).await;
        match &out {
            Ok(p) => tracing::debug!(
                %request_id,
                reservation,
                first_token = p.first_token,
                compute_ms = p.compute_ms,
                transfer_ms = p.transfer_ms,
                bytes = p.transfer_bytes,
                "prefilled"
            ),
            Err(st) => {
                tracing::warn!(%request_id, reservation, code = ?st.code(), error = %st.message(), "prefill failed")
            }
        }
        self.state.record(out.is_ok());
        self.state.metrics.request(out.as_ref().map(|_| ()));
        out.map(Response::new)
    }

    type DecodeStream = GuardedStream<DecodeResponse>;

    async fn decode(&self, _: Request<DecodeRequest>) -> Result<Response<Self::DecodeStream>, Status> {
        self.state.answered(Err(Status::unimplemented(
            "this is a prefill worker; Decode is served by decode workers",
        )))
    }

    async fn release(&self, req: Request<ReleaseRequest>) -> Result<Response<ReleaseResponse>, Status> {
        let r = req.into_inner();
        let released = self.requests.cancel(&r.request_id, &self.state.engine);
        Ok(Response::new(ReleaseResponse { released }))
    }
}

/// Runs `tandem-prefill` until SIGTERM/SIGINT (then drains) or a registration refusal (error).
pub async fn run(args: PrefillArgs) -> Result<(), WorkerError> {
    let shutdown = async {
        let sig = shutdown_signal().await;
        tracing::info!(signal = sig, "shutting down");
    };
    run_until(args, shutdown).await
}

/// [`run`] with an explicit shutdown future (tests).
pub async fn run_until(
    args: PrefillArgs,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), WorkerError> {
    let a = &args.common;
    init_logging(a.log_format);
    let secret = a.cluster.load()?;
    let tls = a.tls.load()?;
    let mutual = tls.as_ref().is_some_and(|t| t.mutual());
    tandem_serve::auth::check_protected(
        &[("--listen", a.listen)],
        secret.is_some() || mutual,
        a.cluster.insecure_cluster,
    )
    .map_err(WorkerError::Flag)?;
    args.not_speculation.refuse()?;
    a.transport.check_device(a.device, a.nixl_lib.as_deref()).map_err(WorkerError::Flag)?;
    let model = load_model(a)?;
    let built = build_engine(a, model, false, None)?;
    let layout = built.layout;
    let compat = compat_record(&built.identity, &layout, built.engine.kv_windows());
    // The router counts token blocks; a pool of layer groups has one page per group and block.
    let built_groups = built.engine.kv_groups();
    let sender = Arc::new(KvSender::new(
        layout,
        SenderOptions {
            enable_shm: a.transport.allows("shm"),
            device: built.engine.backend().device_kv_pool(),
            enable_cuda_ipc: a.transport.allows("cuda-ipc"),
            enable_nccl: a.transport.allows("nccl"),
            nixl: a.nixl_config(),
            token: kv_token(secret.as_ref()),
            tls: tls
                .clone()
                .map(|t| Arc::new(tandem_worker::KvTls(t)) as Arc<dyn tandem_transport::KvClientTls>),
            ..Default::default()
        },
    ));
    let adapters = adapters_wire(&built.engine);
    let max_adapters = built.engine.max_adapters() as u32;
    let (engine, thread): (EngineHandle, _) = EngineHandle::spawn(built.engine)?;

    let result = async {
        let listener = bind("--listen", a.listen).await?;
        let grpc_addr = local_addr(&listener)?;
        let http = bind("--http-listen", a.http_listen).await?;
        let offers: Vec<_> = sender
            .offers()
            .iter()
            .filter(|o| a.transport.allows(o.kind.as_str()))
            .map(offer_to_wire)
            .collect();
        if offers.is_empty() {
            let why = match a.transport {
                TransportChoice::CudaIpc => sender.why_not(TransportKind::CudaIpc),
                TransportChoice::Nccl => sender.why_not(TransportKind::Nccl),
                TransportChoice::Nixl => sender.why_not(TransportKind::Nixl),
                other => format!("{other:?} is not available on this worker"),
            };
            return Err(WorkerError::Flag(format!(
                "--transport: this worker can offer no such KV transport: {why}"
            )));
        }
        let info = WorkerInfo {
            worker_id: a.worker_id(Role::Prefill),
            role: Role::Prefill as i32,
            address: advertise_addr(a.advertise.as_deref(), grpc_addr),
            compat: Some(compat),
            transports: offers,
            device: a.device.to_string(),
            total_blocks: (layout.num_blocks / built_groups) as u32,
            max_sequence_len: engine.max_sequence_len() as u32,
            speculation: None,
            prefix_cache: a.prefix_cache,
            adapters,
            max_adapters,
        };
        let counters = {
            let s = sender.clone();
            Box::new(move |kind: Option<TransportKind>| match kind {
                Some(k) => s.counters_of(k),
                None => s.counters(),
            })
        };
        let state = WorkerState::new(info, engine.clone(), counters, Box::new(|| 0), a.readiness());
        let svc = PrefillService::new(state.clone(), sender.clone());
        let opts = ServeOptions {
            router: a.router.clone(),
            drain_timeout: a.drain_timeout(),
            kv_addr: None,
            http,
            secret,
            tls,
        };
        serve(state, svc, listener, opts, shutdown).await
    }
    .await;
    engine.stop("the worker is shutting down");
    drop(engine);
    thread.join().await;
    result
}
