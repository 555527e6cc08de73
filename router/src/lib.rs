//! The router: the client API (`Tandem`), the worker registry (`Registry`), and the orchestration
//! of each request across a prefill and a decode worker. It owns the tokenizer and the incremental
//! detokenizer; KV bytes never pass through it.
//!
//! - [`registry`]: the worker table (pure): admission checks, heartbeat expiry, worker choice.
//! - [`request`]: validation, tokenization and defaults of a `GenerateRequest`.
//! - [`orchestrate`]: one request's life: Reserve → Prefill → Decode, streaming, cancellation,
//!   migration to another worker when the one holding the sequence is lost.
//! - [`service`]: the gRPC services over all of that.
//! - [`workers`]: channels to workers, polling of statically listed workers, expiry sweeps.
//! - [`http`], [`openai`]: the HTTP server's routes (the OpenAI-compatible API); [`admin`]: the
//!   admin API (LoRA adapters: load, unload, list on every worker), behind `--admin-key`.
//! - [`metrics`]: the router's Prometheus metrics.
//!
//! Shared state is a [`std::sync::Mutex`] around the registry, locked only for short synchronous
//! updates, never across an `.await`.

pub mod admin;
pub mod api;
pub mod error;
pub mod http;
pub mod metrics;
pub use api::openai;
pub mod orchestrate;
pub mod registry;
pub mod request;
pub mod service;
pub mod workers;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{watch, Semaphore};
use tonic::transport::Channel;

use error::StartError;
use registry::{OwnModel, Registry};
use tandem_serve::auth::{load_secret, ClusterSecretArgs, Secret};
use tandem_serve::config::{poll_once, print_listening, shutdown_signal, Listening, LogFormat};
use tandem_serve::identity::{model_identity, resolve_model, ModelIdentity};
use tandem_serve::ops;
use tandem_serve::tls::{self, Port, Tls, TlsArgs};

/// `tandem-router` flags. Each has an environment variable `TANDEM_<FLAG>` and a config-file key.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "tandem-router",
    version,
    about = "Tandem router: takes client requests, picks a prefill and a decode worker for each, streams tokens back"
)]
pub struct RouterArgs {
    /// TOML config file; keys are the long flag names (`heartbeat-ms = 500`, `worker = ["a:1"]`).
    #[arg(long, env = "TANDEM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address of the gRPC server (`Tandem`, `Registry`, health, reflection).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// The model the cluster serves (GGUF file or Hugging Face directory); the router reads its
    /// tokenizer, chat template and identity, not its weights [default: the default model in the
    /// model cache].
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// The model's id on the OpenAI API: what `/v1/models` lists and requests must name in
    /// `model` [default: the model's own name, GGUF `general.name` or the file/directory name].
    #[arg(long, env = "TANDEM_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// A worker's gRPC address (repeatable, or comma-separated): the router asks it for its record
    /// until it answers and polls its load every heartbeat. Workers may also register themselves.
    #[arg(long = "worker", env = "TANDEM_WORKER", value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Heartbeat interval told to workers (and the poll interval of listed workers), in ms; a
    /// registered worker missing 3 heartbeats is dropped.
    #[arg(long, env = "TANDEM_HEARTBEAT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=600_000))]
    pub heartbeat_ms: u64,
    /// Most requests in flight; beyond it requests fail at once with RESOURCE_EXHAUSTED.
    #[arg(long, env = "TANDEM_MAX_QUEUE", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_queue: u64,
    /// Longest a request may take from arrival to its last token, in ms (0: no limit).
    #[arg(long, env = "TANDEM_REQUEST_TIMEOUT_MS", default_value_t = 600_000)]
    pub request_timeout_ms: u64,
    /// Longest a request waits, in ms, for a decode worker with free KV blocks for its prompt
    /// while every decode worker is full; it then fails with RESOURCE_EXHAUSTED (HTTP 429).
    /// 0: fail at once.
    #[arg(long, env = "TANDEM_KV_WAIT_MS", default_value_t = 30_000)]
    pub kv_wait_ms: u64,
    /// Most requests waiting for KV blocks at once; a request that finds the line full is refused
    /// at once with RESOURCE_EXHAUSTED (HTTP 429) and `Retry-After`, so that under overload
    /// refusals are fast and the line (and every waiter's wait) stays short.
    #[arg(long, env = "TANDEM_MAX_KV_WAITING", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_kv_waiting: u64,
    /// How many times one request may move to another decode (or colocated) worker when the one
    /// holding its sequence is lost mid-stream (killed, unreachable, or missing heartbeats); the
    /// tokens already streamed become part of the prompt the new worker computes. 0: never move;
    /// the request fails with the worker.
    #[arg(long, env = "TANDEM_MAX_MIGRATIONS", default_value_t = 2)]
    pub max_migrations: u32,
    /// What happens to a prompt no prefill worker can compute: `decode` (a decode worker computes
    /// it itself, as a colocated worker would: while no prefill worker is usable, and when the
    /// prompt's KV transfer fails after its prefill) or `fail` (the request fails with a
    /// retryable error; one already running first waits `--lost-worker-wait-ms`). Each fallback is counted in `tandem_router_decode_prefills_total{reason}`.
    #[arg(long, env = "TANDEM_PREFILL_FALLBACK", value_enum, default_value_t = PrefillFallback::Decode)]
    pub prefill_fallback: PrefillFallback,
    /// How long a request whose worker was lost before its first token waits, in ms, for a
    /// worker that can take it when no other can now (the lost one restarted, or another
    /// registering); then it fails with UNAVAILABLE. 0: fail at once. A request that has streamed
    /// tokens never waits (it fails with ABORTED when it cannot move).
    #[arg(long, env = "TANDEM_LOST_WORKER_WAIT_MS", default_value_t = 10_000)]
    pub lost_worker_wait_ms: u64,
    /// Largest HTTP request body accepted, in bytes; a larger one is answered 413 naming this
    /// limit.
    #[arg(long, env = "TANDEM_MAX_BODY_BYTES", default_value_t = http::MAX_BODY_BYTES,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..=(1u64 << 30)))]
    pub max_body_bytes: usize,
    /// Most responses the Responses API keeps (`store`, for `previous_response_id` and
    /// `GET /v1/responses/{id}`), in this router's memory; the oldest go first.
    #[arg(long, env = "TANDEM_RESPONSES_MAX", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub responses_max: u64,
    /// How long a stored response is kept, in seconds.
    #[arg(long, env = "TANDEM_RESPONSES_TTL_SECS", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=30 * 86_400))]
    pub responses_ttl_secs: u64,
    /// Log format on stderr.
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Address of the HTTP server: the OpenAI-compatible API (`/v1/...`), `/health`, `/ready`
    /// and `/metrics` (port 0: any free port; the bound address is printed).
    #[arg(long, env = "TANDEM_HTTP_LISTEN", default_value = "127.0.0.1:0")]
    pub http_listen: SocketAddr,
    /// API key clients must present (HTTP `Authorization: Bearer <key>`, gRPC metadata
    /// `authorization: Bearer <key>`) [default: none, the client APIs are open].
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// File whose first line is the API key.
    #[arg(long, env = "TANDEM_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Key of the admin API (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`,
    /// `GET /v1/lora_adapters`: HTTP `Authorization: Bearer <key>`); the API key does not open
    /// it, and the two must differ [default: none, the admin API answers 403].
    #[arg(long, env = "TANDEM_ADMIN_KEY", hide_env_values = true, conflicts_with = "admin_key_file")]
    pub admin_key: Option<String>,
    /// File whose first line is the admin key.
    #[arg(long, env = "TANDEM_ADMIN_KEY_FILE")]
    pub admin_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub cluster: ClusterSecretArgs,
    /// TLS on both ports and towards workers. With `--tls-client-ca`, client certificates are
    /// verified when presented on both ports and required of workers calling the `Registry`
    /// service; API clients need only the CA.
    #[command(flatten)]
    pub tls: TlsArgs,
    /// On SIGTERM/SIGINT, how long requests in flight may take to finish before they are
    /// cancelled; readiness turns off at once and new requests are refused.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_MS", default_value_t = 30_000)]
    pub drain_timeout_ms: u64,
}

/// `--prefill-fallback`: who computes a prompt no prefill worker can.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefillFallback {
    /// A decode worker computes it.
    Decode,
    /// The request fails with a retryable error (a request already running first waits
    /// `--lost-worker-wait-ms` for a prefill worker to come back).
    Fail,
}

/// State every request and RPC handler shares.
pub(crate) struct Shared {
    pub(crate) model: ModelIdentity,
    registry: Mutex<Registry>,
    pub(crate) router_id: String,
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) max_queue: u64,
    pub(crate) request_timeout: Option<Duration>,
    /// `--kv-wait-ms`.
    pub(crate) kv_wait: Duration,
    /// `--max-kv-waiting`.
    pub(crate) max_kv_waiting: u64,
    /// The line of requests waiting for KV blocks: its head holds the lock and retries. Its
    /// length is the `tandem_router_kv_waiting` gauge.
    pub(crate) kv_line: Arc<tokio::sync::Mutex<()>>,
    pub(crate) heartbeat: Duration,
    /// `--max-migrations`.
    pub(crate) max_migrations: u32,
    /// `--prefill-fallback decode`.
    pub(crate) decode_prefills: bool,
    /// `--lost-worker-wait-ms`.
    pub(crate) lost_worker_wait: Duration,
    /// `--max-body-bytes`.
    pub(crate) max_body_bytes: usize,
    /// The Responses API's stored responses (`--responses-max`, `--responses-ttl-secs`).
    pub(crate) responses: Arc<api::responses::Store>,
    serving: watch::Sender<bool>,
    /// The registry's [`Registry::losses`], for requests that follow a worker's stream.
    losses: watch::Sender<u64>,
    shutting_down: AtomicBool,
    channels: Mutex<HashMap<String, Channel>>,
    next_request: AtomicU64,
    inflight_ids: Mutex<HashSet<String>>,
    /// The key clients must present (`--api-key`), if any.
    pub(crate) api_key: Option<Secret>,
    /// The key of the admin API (`--admin-key`), if any: without one the admin API is off.
    pub(crate) admin_key: Option<Secret>,
    /// The secret shared with workers (`--cluster-secret`), if any.
    pub(crate) cluster_secret: Option<Secret>,
    /// TLS on both ports and towards workers (`--tls-*`), if any.
    pub(crate) tls: Option<Arc<Tls>>,
    pub(crate) metrics: metrics::RouterMetrics,
    /// Requests running (each holds an [`InFlight`]); a drain waits for this to reach 0.
    running: watch::Sender<usize>,
    /// Set when a drain runs out of time: requests still running end at once.
    cancel: watch::Sender<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving with it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn new(
        model: ModelIdentity,
        args: &RouterArgs,
        keys: Keys,
        cluster_secret: Option<Secret>,
        tls: Option<Arc<Tls>>,
    ) -> Shared {
        let Keys { api_key, admin_key } = keys;
        let heartbeat = Duration::from_millis(args.heartbeat_ms);
        let own = OwnModel { model_id: model.model_id.clone(), model_name: model.model_name.clone() };
        let metrics = metrics::RouterMetrics::new(&model.model_name);
        Shared {
            model,
            registry: Mutex::new({
                let mut r = Registry::new(own, heartbeat);
                r.set_prefill_fallback(args.prefill_fallback == PrefillFallback::Decode);
                r
            }),
            router_id: format!("router-{:08x}", rand::random::<u32>()),
            permits: Arc::new(Semaphore::new(args.max_queue as usize)),
            max_queue: args.max_queue,
            request_timeout: (args.request_timeout_ms > 0)
                .then(|| Duration::from_millis(args.request_timeout_ms)),
            kv_wait: Duration::from_millis(args.kv_wait_ms),
            max_kv_waiting: args.max_kv_waiting,
            kv_line: Arc::new(tokio::sync::Mutex::new(())),
            heartbeat,
            max_migrations: args.max_migrations,
            decode_prefills: args.prefill_fallback == PrefillFallback::Decode,
            lost_worker_wait: Duration::from_millis(args.lost_worker_wait_ms),
            max_body_bytes: args.max_body_bytes,
            responses: Arc::new(api::responses::Store::new(
                args.responses_max as usize,
                Duration::from_secs(args.responses_ttl_secs),
            )),
            serving: watch::channel(false).0,
            losses: watch::channel(0).0,
            shutting_down: AtomicBool::new(false),
            channels: Mutex::new(HashMap::new()),
            next_request: AtomicU64::new(1),
            inflight_ids: Mutex::new(HashSet::new()),
            api_key,
            admin_key,
            cluster_secret,
            tls,
            metrics,
            running: watch::channel(0).0,
            cancel: watch::channel(false).0,
        }
    }

    /// Runs `f` on the registry (briefly locked) and publishes whether the router now serves.
    pub(crate) fn with_registry<R>(&self, f: impl FnOnce(&mut Registry) -> R) -> R {
        let (out, serving, counts, losses) = {
            let mut r = lock(&self.registry);
            let out = f(&mut r);
            (out, r.serving().0, r.counts(), r.losses())
        };
        self.metrics.set_workers(&counts);
        self.losses.send_if_modified(|n| std::mem::replace(n, losses) != losses);
        let serving = serving && !self.shutting_down.load(Ordering::Relaxed);
        self.serving.send_if_modified(|s| std::mem::replace(s, serving) != serving);
        out
    }

    /// Changes each time a worker leaves the table or turns unhealthy.
    pub(crate) fn subscribe_losses(&self) -> watch::Receiver<u64> {
        self.losses.subscribe()
    }

    /// Whether the router can serve a request now.
    pub(crate) fn subscribe_serving(&self) -> watch::Receiver<bool> {
        self.serving.subscribe()
    }

    /// Whether a request could be served now, and why not: draining, or no usable worker pair.
    pub(crate) fn readiness(&self) -> Result<(), String> {
        if self.draining() {
            return Err("draining".into());
        }
        let (serving, why) = lock(&self.registry).serving();
        if serving {
            Ok(())
        } else {
            Err(why)
        }
    }

    /// Stops reporting SERVING and refuses new requests (shutdown has begun).
    pub(crate) fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.metrics.draining.set(1);
        self.serving.send_if_modified(|s| std::mem::replace(s, false));
    }

    /// Whether shutdown has begun: new requests are refused, those in flight finish.
    pub(crate) fn draining(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Counts a request as running until the guard drops.
    pub(crate) fn enter(self: &Arc<Self>) -> InFlight {
        self.running.send_modify(|n| *n += 1);
        self.metrics.in_flight.inc();
        InFlight { shared: self.clone() }
    }

    /// Resolves when the drain has run out of time and running requests must end now.
    pub(crate) async fn cancelled(&self) {
        let mut rx = self.cancel.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }

    /// Waits until no request runs, or `limit` passes; returns how many still run.
    async fn wait_idle(&self, limit: Duration) -> usize {
        let mut rx = self.running.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|n| *n == 0)).await;
        let left = *self.running.borrow();
        left
    }

    /// A channel to the worker at `address` (created lazily, cached, reconnects by itself).
    pub(crate) fn channel(&self, address: &str) -> Result<Channel, String> {
        if let Some(c) = lock(&self.channels).get(address) {
            return Ok(c.clone());
        }
        let c = workers::connect_lazy(address, self.tls.clone())?;
        lock(&self.channels).insert(address.to_owned(), c.clone());
        Ok(c)
    }

    /// A request id unique among the requests in flight: the client's tag when it has one.
    pub(crate) fn claim_request_id(&self, client: &str) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        let mut ids = lock(&self.inflight_ids);
        let id = if client.is_empty() {
            format!("{}-{n}", self.router_id)
        } else if ids.contains(client) {
            format!("{client}-{n}")
        } else {
            client.to_owned()
        };
        ids.insert(id.clone());
        id
    }

    /// An id for a request refused before it ran: the client's, or a new one. It is not held
    /// (the request never runs), so it may name a later request too.
    pub(crate) fn refusal_id(&self, client: &str) -> String {
        if client.is_empty() {
            format!("{}-{}", self.router_id, self.next_request.fetch_add(1, Ordering::Relaxed))
        } else {
            client.to_owned()
        }
    }

    /// The request is over; its id may be reused.
    pub(crate) fn free_request_id(&self, id: &str) {
        lock(&self.inflight_ids).remove(id);
    }
}

/// The client keys the router checks: `--api-key` and `--admin-key`.
struct Keys {
    api_key: Option<Secret>,
    admin_key: Option<Secret>,
}

/// The LoRA adapters the registered workers hold, as the HTTP APIs ask about a request's
/// `model` (only one that is not the served model's name).
impl api::Adapters for Shared {
    fn has(&self, name: &str) -> bool {
        lock(&self.registry).has_adapter(name)
    }
}

/// A running request, counted until dropped.
pub(crate) struct InFlight {
    shared: Arc<Shared>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shared.running.send_modify(|n| *n = n.saturating_sub(1));
        self.shared.metrics.in_flight.dec();
    }
}

/// `/health` and `/ready` of the router: live while the process runs; ready when a request could
/// be served (a usable worker pair) and not draining.
struct RouterProbe(Arc<Shared>);

impl tandem_serve::ops::Probe for RouterProbe {
    fn live(&self) -> Result<(), String> {
        Ok(())
    }

    fn ready(&self) -> Result<(), String> {
        self.0.readiness()
    }
}

/// A router ready to serve: model identity read, state built.
pub struct Router {
    shared: Arc<Shared>,
    args: RouterArgs,
}

/// A served model name must survive JSON, URL paths (`/v1/models/{id}`, where `/` is allowed:
/// `org/model` ids are common) and log lines unchanged.
fn check_served_name(name: &str) -> Result<(), StartError> {
    let bad = |why: String| Err(StartError::Flag(format!("--served-model-name: {why}")));
    if name.trim().is_empty() {
        return bad("must not be empty".into());
    }
    if name.len() > 256 {
        return bad(format!("at most 256 bytes, got {}", name.len()));
    }
    if let Some(c) = name.chars().find(|c| c.is_control() || *c == '?' || *c == '#' || *c == '%') {
        return bad(format!("{name:?} contains {c:?}, which cannot appear in a model id"));
    }
    Ok(())
}

impl Router {
    /// Reads the model's identity and tokenizer (no weights) and builds the router's state.
    pub fn new(args: RouterArgs) -> Result<Router, StartError> {
        let path = resolve_model(args.model.as_deref())?;
        let mut model = model_identity(&path)?;
        if let Some(name) = &args.served_model_name {
            check_served_name(name)?;
            model.model_name = name.clone();
        }
        for w in &args.workers {
            if w.trim().is_empty() {
                return Err(StartError::Flag("--worker: empty address".into()));
            }
            workers::connect_lazy(w, None).map_err(|e| StartError::Flag(format!("--worker {w}: {e}")))?;
        }
        let api_key = load_secret(args.api_key.as_deref(), args.api_key_file.as_deref(), "api-key")?;
        let admin_key = load_secret(args.admin_key.as_deref(), args.admin_key_file.as_deref(), "admin-key")?;
        if let (Some(api), Some(admin)) = (&api_key, &admin_key) {
            if admin.matches(api.expose().as_bytes()) {
                return Err(StartError::Flag(
                    "--admin-key: must differ from --api-key (every client holds the API key; the admin key \
                     loads and unloads adapters on every worker)"
                        .into(),
                ));
            }
        }
        let cluster_secret = args.cluster.load()?;
        let tls = args.tls.load()?;
        let mutual = tls.as_ref().is_some_and(|t| t.mutual());
        tandem_serve::auth::check_protected(
            &[("--listen", args.listen)],
            cluster_secret.is_some() || mutual,
            args.cluster.insecure_cluster,
        )
        .map_err(StartError::Flag)?;
        if api_key.is_none() {
            for (flag, addr) in [("--listen", args.listen), ("--http-listen", args.http_listen)] {
                if tandem_serve::auth::reachable_from_network(&addr) {
                    tracing::warn!(
                        "{flag} {addr} serves the client API to other hosts without an API key: \
                         anyone who reaches it can send requests (set --api-key or --api-key-file)"
                    );
                }
            }
        }
        tracing::info!(
            model = %model.model_name,
            model_id = %model.model_id,
            path = %path.display(),
            api_key = api_key.is_some(),
            admin_key = admin_key.is_some(),
            cluster_secret = cluster_secret.is_some(),
            tls = tls.is_some(),
            mutual_tls = tls.as_ref().is_some_and(|t| t.mutual()),
            "router model"
        );
        let keys = Keys { api_key, admin_key };
        Ok(Router { shared: Arc::new(Shared::new(model, &args, keys, cluster_secret, tls)), args })
    }

    /// Binds `--listen` and `--http-listen`, prints the `listening` line, serves until
    /// SIGTERM/SIGINT, then drains (see [`Router::serve`]).
    pub async fn run(self) -> Result<(), StartError> {
        let bind = |flag: &'static str, addr: SocketAddr| async move {
            tokio::net::TcpListener::bind(addr).await.map_err(|source| StartError::Bind {
                flag,
                addr: addr.to_string(),
                source,
            })
        };
        let grpc = bind("--listen", self.args.listen).await?;
        let http = bind("--http-listen", self.args.http_listen).await?;
        let shutdown = async {
            let sig = shutdown_signal().await;
            tracing::info!(signal = sig, "shutting down");
        };
        self.serve(grpc, http, shutdown).await
    }

    /// Serves gRPC on `grpc` and HTTP on `http` until `shutdown` resolves, then drains:
    /// readiness turns off at once (gRPC health NOT_SERVING, `/ready` 503), new requests are
    /// refused with UNAVAILABLE / 503 while both listeners stay open, and requests in flight get
    /// `--drain-timeout-ms` to finish (a second signal cuts that short); whatever still runs then
    /// is cancelled, and both servers stop.
    pub async fn serve(
        self,
        grpc: tokio::net::TcpListener,
        http: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), StartError> {
        let shared = self.shared;
        let grpc_addr = grpc
            .local_addr()
            .map_err(|source| StartError::Io { what: "reading the bound gRPC address", source })?;
        let http_addr = http
            .local_addr()
            .map_err(|source| StartError::Io { what: "reading the bound HTTP address", source })?;
        let (health, health_service) = tonic_health::server::health_reporter();
        service::publish_health(&shared, health).await;
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(tandem_proto::v1::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let reflection_v1 = reflection().build_v1().map_err(|e| StartError::Reflection(e.to_string()))?;
        let reflection_v1alpha =
            reflection().build_v1alpha().map_err(|e| StartError::Reflection(e.to_string()))?;

        let mut background = workers::spawn_background(&shared, &self.args.workers);
        let grpc_server = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .add_service(service::tandem_server(&shared))
            .add_service(service::registry_server(&shared))
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha);
        let probe: Arc<dyn ops::Probe> = Arc::new(RouterProbe(shared.clone()));
        let app = http::app(shared.clone()).merge(ops::ops_routes(probe, shared.metrics.registry.clone()));

        // Both servers run until `stop` turns true, which happens only after the drain.
        let (stop_tx, stop_rx) = watch::channel(false);
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let mut shutdown = Box::pin(shutdown);
        let signalled = poll_once(&mut shutdown).await;
        let mut grpc_task = tls::spawn_grpc(
            grpc_server,
            grpc,
            shared.tls.as_ref(),
            Port::ClientGrpc,
            stopped(stop_rx.clone()),
        )
        .map_err(|source| StartError::Io { what: "reading the bound gRPC address", source })?;
        // Certificates are reloaded on SIGHUP from here on (before the listening line).
        background.extend(shared.tls.clone().map(tls::spawn_reload_on_sighup));
        let mut http_task = tokio::spawn(ops::serve_http(http, shared.tls.clone(), app, stopped(stop_rx)));
        print_listening(&Listening { grpc: grpc_addr, http: Some(http_addr), kv: None });
        tracing::info!(grpc = %grpc_addr, http = %http_addr, router_id = %shared.router_id, "router listening");

        let failed = tokio::select! {
            _ = async { if !signalled { shutdown.await } } => None,
            r = &mut grpc_task => Some(format!("the gRPC server stopped: {}", task_result(r))),
            r = &mut http_task => Some(format!("the HTTP server stopped: {}", task_result(r))),
        };
        if let Some(why) = failed {
            for task in background {
                task.abort();
            }
            return Err(StartError::ServerStopped(why));
        }

        shared.begin_shutdown();
        let limit = Duration::from_millis(self.args.drain_timeout_ms);
        let running = *shared.running.borrow();
        tracing::info!(
            running,
            drain_timeout_ms = self.args.drain_timeout_ms,
            "draining: new requests are refused, requests in flight may finish"
        );
        let left = tokio::select! {
            left = shared.wait_idle(limit) => left,
            sig = shutdown_signal() => {
                tracing::warn!(signal = sig, "second signal: cancelling the requests in flight");
                *shared.running.borrow()
            }
        };
        if left > 0 {
            tracing::warn!(left, "drain over: cancelling the requests still in flight");
            shared.cancel.send_replace(true);
            // Each cancelled request tells its client and releases its workers' blocks.
            let still = shared.wait_idle(CANCEL_GRACE).await;
            if still > 0 {
                tracing::warn!(still, "requests did not end after cancellation");
            }
        } else {
            tracing::info!("drained: no request in flight");
        }
        stop_tx.send_replace(true);
        // Connections finish sending what they have; a client that holds one open cannot keep the
        // process alive past this.
        let joined = tokio::time::timeout(SERVER_STOP, async { (grpc_task.await, http_task.await) }).await;
        for task in background {
            task.abort();
        }
        match joined {
            Ok((g, h)) => {
                if let Ok(Err(e)) = g {
                    tracing::warn!("gRPC server: {e}");
                }
                if let Ok(Err(e)) = h {
                    tracing::warn!("HTTP server: {e}");
                }
            }
            Err(_) => tracing::warn!("servers did not stop within {} ms; exiting", SERVER_STOP.as_millis()),
        }
        tracing::info!("router stopped");
        Ok(())
    }
}

/// How long cancelled requests get to tell their clients and release their workers.
const CANCEL_GRACE: Duration = Duration::from_secs(2);
/// How long the servers get to close their connections once no request runs.
const SERVER_STOP: Duration = Duration::from_secs(5);

fn task_result<E: std::fmt::Display>(r: Result<Result<(), E>, tokio::task::JoinError>) -> String {
    match r {
        Ok(Ok(())) => "without an error".into(),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    }
}
