//! Registration with the routers (`--router A,B,..`), each on its own: register (retrying with
//! backoff until the router answers), heartbeat at the interval it asks for, register again when
//! it forgets this worker, and deregister at shutdown. The worker is ready while any router knows
//! it. A refusal (incompatible worker, wrong cluster secret, unusable
//! `--router`) is fatal: it is handed to the server, which stops the worker with it.

use std::sync::Arc;
use std::time::Duration;

use tandem_proto::v1::registry_client::RegistryClient;
use tandem_proto::v1::{DeregisterRequest, HeartbeatRequest};
use tokio::sync::mpsc;
use tonic::Code;

use crate::error::WorkerError;
use crate::state::WorkerState;
use tandem_serve::auth::{self, Secret};
use tandem_serve::tls::{self, Tls};

/// The router's URI. Whether the connection speaks TLS is decided by this worker's TLS flags,
/// not by the scheme: an `https://` router is dialled like an `http://` one, through the TLS
/// connector when TLS is on.
fn router_uri(router: &str) -> String {
    match router.split_once("://") {
        Some(("https", rest)) => format!("http://{rest}"),
        Some(_) => router.to_owned(),
        None => format!("http://{router}"),
    }
}

fn registry_client(
    router: &str,
    tls: Option<Arc<Tls>>,
) -> Result<RegistryClient<tonic::transport::Channel>, String> {
    let ep = tonic::transport::Endpoint::from_shared(router_uri(router))
        .map_err(|e| format!("--router {router}: {e}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5));
    Ok(RegistryClient::new(tls::grpc_channel(ep, tls)))
}

/// The routers of `--router`: one address, or several separated by commas (each router admits
/// the worker on its own; decode reservations are leases the worker grants, so two routers never
/// book the same block).
pub fn routers(list: &str) -> Vec<String> {
    list.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect()
}

/// Registers with router number `index` of `--router` (retrying with backoff until it answers),
/// then heartbeats at the interval it asked for; registers again when the router no longer knows
/// this worker. A refusal (FAILED_PRECONDITION, or UNAUTHENTICATED for the cluster secret) is sent
/// to `fatal`.
pub(super) async fn register_loop(
    state: Arc<WorkerState>,
    index: usize,
    router: String,
    secret: Option<Secret>,
    tls: Option<Arc<Tls>>,
    fatal: mpsc::Sender<WorkerError>,
) {
    let mut client = match registry_client(&router, tls) {
        Ok(c) => c,
        Err(e) => {
            let _ = fatal.send(WorkerError::BadRouter(e)).await;
            return;
        }
    };
    loop {
        let mut backoff = Duration::from_millis(100);
        let mut attempts = 0u32;
        let interval = loop {
            match client.register(auth::cluster_request(secret.as_ref(), state.registration_info())).await {
                Ok(r) => {
                    let r = r.into_inner();
                    state.set_registered(index, true);
                    tracing::info!(%router, router_id = %r.router_id, "registered with the router");
                    break Duration::from_millis(u64::from(r.heartbeat_interval_ms).clamp(50, 60_000));
                }
                // A refusal ends the worker, unless another router has it registered (a router
                // being replaced, a secret being rotated): then it serves that one and asks this
                // one again later.
                Err(st)
                    if matches!(st.code(), Code::FailedPrecondition | Code::Unauthenticated)
                        && state.registered_elsewhere(index) =>
                {
                    tracing::error!(%router, reason = %st.message(), "this router refused the worker; serving the others, asking again in 30 s");
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                Err(st) if st.code() == Code::FailedPrecondition => {
                    tracing::error!(%router, reason = %st.message(), "the router refused this worker");
                    let _ = fatal.send(WorkerError::Refused(st.message().to_owned())).await;
                    return;
                }
                Err(st) if st.code() == Code::Unauthenticated => {
                    tracing::error!(%router, reason = %st.message(), "the router refused the cluster secret");
                    let _ = fatal.send(WorkerError::SecretRefused(st.message().to_owned())).await;
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
        let mut last_digest = None;
        loop {
            tokio::time::sleep(interval).await;
            if state.wedged() {
                // Heartbeats say the worker can take work; a wedged engine cannot (readiness says
                // so too). Routers drop it after the heartbeats they miss.
                continue;
            }
            // The digest and the adapters come from the engine thread, which may be in a long
            // step (a big prompt chunk): the heartbeat does not wait for them past half an
            // interval, and carries the last ones instead, so that a busy worker is never taken
            // for a dead one.
            let (digest, adapters) = tokio::join!(
                tokio::time::timeout(interval / 2, state.cache_digest()),
                state.adapters_within(interval / 2),
            );
            let cache = match digest {
                Ok(d) => {
                    last_digest.clone_from(&d);
                    d
                }
                Err(_) => last_digest.clone(),
            };
            let req = HeartbeatRequest {
                worker_id: state.info.worker_id.clone(),
                load: Some(state.load()),
                cache,
                adapters: adapters.list,
                adapters_set: true,
                adapters_version: adapters.version,
            };
            match client.heartbeat(auth::cluster_request(secret.as_ref(), req)).await {
                Ok(r) if !r.get_ref().known => {
                    state.set_registered(index, false);
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

pub(super) async fn deregister(
    router: &str,
    secret: Option<&Secret>,
    tls: Option<Arc<Tls>>,
    worker_id: &str,
) {
    let Ok(mut client) = registry_client(router, tls) else {
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
