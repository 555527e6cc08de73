//! The router's gRPC services: `Tandem` (clients), `Registry` (workers), and the standard health
//! service kept in step with whether a request could be served.
//!
//! `Tandem` asks for the API key (when one is set) in every method; `Registry` asks for the
//! cluster secret (when one is set) through an interceptor, so a worker with the wrong secret is
//! told UNAUTHENTICATED before anything else is looked at. Health and reflection stay open.

use std::sync::Arc;
use std::time::Instant;

use tandem_proto::v1::registry_server::{Registry as RegistryService, RegistryServer};
use tandem_proto::v1::tandem_server::{Tandem, TandemServer};
use tandem_proto::v1::{
    DeregisterRequest, DeregisterResponse, GenerateRequest, GenerateResponse, HealthRequest, HealthResponse,
    HeartbeatRequest, HeartbeatResponse, RegisterResponse, WorkerInfo,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::error::RouterError;
use crate::orchestrate::{self, Api};
use crate::registry::{describe, AdmitError};
use crate::Shared;
use tandem_serve::auth::{check_api_key_grpc, cluster_interceptor};

/// `tandem.v1.Tandem`.
pub(crate) struct TandemService {
    shared: Arc<Shared>,
}

pub(crate) fn tandem_server(shared: &Arc<Shared>) -> TandemServer<TandemService> {
    TandemServer::new(TandemService { shared: shared.clone() })
}

impl TandemService {
    /// The client's API key, checked (and a refusal counted) when the router has one.
    fn authorize<T>(&self, request: &Request<T>) -> Result<(), Status> {
        check_api_key_grpc(self.shared.api_key.as_ref(), request.metadata()).map_err(|st| {
            let e = RouterError::Unauthenticated(st.message().to_owned());
            orchestrate::refused(&self.shared, Api::Grpc, &e);
            Status::from(e)
        })
    }
}

#[tonic::async_trait]
impl Tandem for TandemService {
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        self.authorize(&request)?;
        let rx = orchestrate::start(self.shared.clone(), request.into_inner(), Api::Grpc).await?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn health(&self, request: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        check_api_key_grpc(self.shared.api_key.as_ref(), request.metadata())?;
        let (serving, message, workers) = self.shared.with_registry(|r| {
            let (s, m) = r.serving();
            (s, m, r.summaries())
        });
        let (serving, message) = if self.shared.draining() {
            (false, orchestrate::DRAINING.to_owned())
        } else {
            (serving, message)
        };
        Ok(Response::new(HealthResponse {
            serving,
            model: self.shared.model.model_name.clone(),
            model_id: self.shared.model.model_id.clone(),
            workers,
            message,
        }))
    }
}

/// `tandem.v1.Registry`.
pub(crate) struct RegistryImpl {
    shared: Arc<Shared>,
}

/// The `Registry` server, behind the cluster-secret check.
pub(crate) fn registry_server(
    shared: &Arc<Shared>,
) -> tonic::service::interceptor::InterceptedService<
    RegistryServer<RegistryImpl>,
    impl tonic::service::Interceptor + Clone,
> {
    RegistryServer::with_interceptor(RegistryImpl { shared: shared.clone() }, {
        let shared = shared.clone();
        let mutual = shared.tls.as_ref().is_some_and(|t| t.mutual());
        let mut secret = cluster_interceptor(shared.cluster_secret.clone(), {
            let shared = shared.clone();
            move |_: &Status| shared.metrics.errors.with_label_values(&["unauthenticated"]).inc()
        });
        // Under mutual TLS a worker must have presented a certificate the CA signed (the
        // handshake already refused one it did not sign; API clients may present none).
        move |req: tonic::Request<()>| {
            if mutual && req.peer_certs().is_none_or(|c| c.is_empty()) {
                shared.metrics.errors.with_label_values(&["unauthenticated"]).inc();
                return Err(Status::unauthenticated("registry calls need a client certificate (mutual TLS)"));
            }
            secret(req)
        }
    })
}

#[tonic::async_trait]
impl RegistryService for RegistryImpl {
    async fn register(&self, request: Request<WorkerInfo>) -> Result<Response<RegisterResponse>, Status> {
        let info = request.into_inner();
        let who = describe(&info);
        let (transports, blocks) = (
            info.transports.iter().map(|t| t.kind.as_str()).collect::<Vec<_>>().join(","),
            info.total_blocks,
        );
        let speculation = tandem_serve::speculation::describe(info.speculation.as_ref());
        match self.shared.with_registry(|r| r.admit(info, false, Instant::now())) {
            Ok(replaced) => {
                tracing::info!(transports, blocks, replaced, speculation, "registered {who}");
                Ok(Response::new(RegisterResponse {
                    heartbeat_interval_ms: self.shared.heartbeat.as_millis() as u32,
                    router_id: self.shared.router_id.clone(),
                }))
            }
            Err(AdmitError::Invalid(m)) => {
                tracing::warn!("refused registration: {m}");
                Err(Status::invalid_argument(m))
            }
            Err(AdmitError::Mismatch(m)) => {
                tracing::warn!("refused {who}: {m}");
                Err(Status::failed_precondition(m))
            }
        }
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let hb = request.into_inner();
        let known = self.shared.with_registry(|r| {
            let known = r.heartbeat(&hb.worker_id, hb.load, Instant::now());
            r.set_cache(&hb.worker_id, hb.cache.as_ref());
            // The adapters it holds now replace what the router knew (a worker older than
            // adapters never sets the flag, and keeps what it registered with).
            if hb.adapters_set {
                r.set_adapters(&hb.worker_id, hb.adapters, hb.adapters_version);
            }
            known
        });
        if !known {
            tracing::debug!(worker = %hb.worker_id, "heartbeat from an unknown worker: asking it to register");
        }
        Ok(Response::new(HeartbeatResponse { known }))
    }

    async fn deregister(
        &self,
        request: Request<DeregisterRequest>,
    ) -> Result<Response<DeregisterResponse>, Status> {
        let id = request.into_inner().worker_id;
        if let Some(e) = self.shared.with_registry(|r| r.remove(&id)) {
            tracing::info!("{} left", e.describe());
        }
        Ok(Response::new(DeregisterResponse {}))
    }
}

/// Keeps `grpc.health.v1` in step with the router: SERVING (overall and for `tandem.v1.Tandem`)
/// exactly when a request could be served. Sets the initial status before returning.
pub(crate) async fn publish_health(shared: &Arc<Shared>, reporter: HealthReporter) {
    let mut rx = shared.subscribe_serving();
    let initial = *rx.borrow_and_update();
    set_health(&reporter, initial).await;
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let serving = *rx.borrow_and_update();
            tracing::info!(serving, "router health changed");
            set_health(&reporter, serving).await;
        }
    });
}

async fn set_health(reporter: &HealthReporter, serving: bool) {
    let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
    reporter.set_service_status("", status).await;
    reporter
        .set_service_status(<TandemServer<TandemService> as tonic::server::NamedService>::NAME, status)
        .await;
}
