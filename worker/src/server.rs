//! The worker's servers and its life after start-up: the gRPC server (the role's `Worker`
//! service behind the cluster-secret check, `grpc.health.v1`, reflection), the HTTP ops
//! endpoints, registration in the background, and the drain on shutdown. Also the response
//! stream whose guards end a request's work when the client goes away.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use tandem_proto::v1::worker_server::{Worker, WorkerServer};
use tandem_transport::KvToken;
use tokio::sync::{mpsc, watch};
use tonic::Status;

use crate::args::role_name;
use crate::engine_thread::CancelOnDrop;
use crate::error::WorkerError;
use crate::registration::{deregister, register_loop, routers};
use crate::requests::{InflightGuard, RequestEntry};
use crate::state::WorkerState;
use tandem_serve::auth::{self, Secret};
use tandem_serve::config::{poll_once, print_listening, Listening};
use tandem_serve::ops::{self, Probe};
use tandem_serve::tls::{self, Port, Tls};

/// Binds the TCP listener `flag` names (`--listen`, `--http-listen`); an error names the flag.
pub async fn bind(flag: &'static str, addr: SocketAddr) -> Result<tokio::net::TcpListener, WorkerError> {
    tokio::net::TcpListener::bind(addr).await.map_err(|source| WorkerError::Bind {
        flag,
        addr: addr.to_string(),
        source,
    })
}

/// The bound address of a listener.
pub fn local_addr(l: &tokio::net::TcpListener) -> Result<SocketAddr, WorkerError> {
    l.local_addr().map_err(|source| WorkerError::Io { what: "reading a bound address", source })
}

/// The KV transport token of a cluster secret.
pub fn kv_token(secret: Option<&Secret>) -> Option<KvToken> {
    secret.map(|s| KvToken(s.kv_token()))
}

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
    /// TLS on both servers and towards the router (reloaded on SIGHUP); `None`: plaintext.
    pub tls: Option<Arc<Tls>>,
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

/// Serves `svc` on `listener` with health and reflection, and the HTTP ops endpoints on
/// `opts.http`; registers with the router, and on `shutdown` drains and deregisters. Returns an
/// error (exit 1) when the router refuses the registration.
pub async fn serve<S: Worker>(
    state: Arc<WorkerState>,
    svc: S,
    listener: tokio::net::TcpListener,
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), WorkerError> {
    let routers = opts.router.as_deref().map(routers).unwrap_or_default();
    if opts.router.is_some() && (routers.is_empty() || routers.len() > 64) {
        return Err(WorkerError::BadRouter(format!(
            "--router {:?}: one to 64 addresses separated by commas",
            opts.router.as_deref().unwrap_or("")
        )));
    }
    let addr = local_addr(&listener)?;
    let http_addr = local_addr(&opts.http)?;
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<WorkerServer<S>>().await;
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(tandem_proto::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1().map_err(|e| WorkerError::Reflection(e.to_string()))?;
    let reflection_v1alpha =
        reflection().build_v1alpha().map_err(|e| WorkerError::Reflection(e.to_string()))?;

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
    let mut shutdown = std::pin::pin!(shutdown);
    let signalled = poll_once(&mut shutdown).await;
    let server_task =
        tls::spawn_grpc(server, listener, opts.tls.as_ref(), Port::PeerGrpc, stopped(stop_rx.clone()))
            .map_err(|source| WorkerError::Io { what: "reading a bound address", source })?;
    let reload = opts.tls.clone().map(tls::spawn_reload_on_sighup);
    let app = ops::ops_routes(Arc::new(WorkerProbe(state.clone())), state.metrics.registry());
    let http_task = tokio::spawn(ops::serve_http(opts.http, opts.tls.clone(), app, stopped(stop_rx)));
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
        tls = opts.tls.is_some(),
        mutual_tls = opts.tls.as_ref().is_some_and(|t| t.mutual()),
        "worker listening"
    );

    let (fatal_tx, mut fatal_rx) = tokio::sync::mpsc::channel::<WorkerError>(routers.len().max(1));
    let registration: Vec<_> = routers
        .iter()
        .enumerate()
        .map(|(i, router)| {
            tokio::spawn(register_loop(
                state.clone(),
                i,
                router.clone(),
                opts.secret.clone(),
                opts.tls.clone(),
                fatal_tx.clone(),
            ))
        })
        .collect();
    drop(fatal_tx);

    let refused = if signalled {
        None
    } else {
        tokio::select! {
            _ = &mut shutdown => None,
            r = fatal_rx.recv(), if !registration.is_empty() => r,
        }
    };
    if let Some(why) = refused {
        // The routers that did accept this worker stop sending it work at once.
        for task in &registration {
            task.abort();
        }
        for router in &routers {
            deregister(router, opts.secret.as_ref(), opts.tls.clone(), &state.info.worker_id).await;
        }
        let _ = stop_tx.send(true);
        state.engine.stop("the router refused this worker");
        let _ = tokio::time::timeout(Duration::from_secs(2), server_task).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), http_task).await;
        return Err(why);
    }

    // Drain: readiness is off from here on (`draining` is checked by every probe).
    state.start_draining();
    health.set_not_serving::<WorkerServer<S>>().await;
    health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
    tracing::info!(
        inflight = state.inflight_count(),
        timeout_ms = opts.drain_timeout.as_millis() as u64,
        "draining: no new work; finishing requests in flight"
    );
    let deadline = Instant::now() + opts.drain_timeout;
    loop {
        let busy = state.busy();
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
    for task in &registration {
        task.abort();
    }
    for router in &routers {
        deregister(router, opts.secret.as_ref(), opts.tls.clone(), &state.info.worker_id).await;
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
    if let Some(r) = reload {
        r.abort();
    }
    tracing::info!("worker stopped");
    Ok(())
}
