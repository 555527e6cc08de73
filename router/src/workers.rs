//! Talking to workers outside a request: channels, the static worker list (polled with `Stats`
//! for load and cache digest, and with `ListAdapters` for the LoRA adapters of a worker that runs
//! them), heartbeat expiry.
//!
//! Channels fail fast: a 1 s connect timeout and HTTP/2 keepalive pings every second (answered
//! within a second, idle or not), so a worker that vanishes is noticed within about two seconds
//! even when no packet tells us.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_proto::v1::worker_client::WorkerClient;
use tandem_proto::v1::{InfoRequest, ListAdaptersRequest, ReleaseRequest, StatsRequest};
use tandem_serve::tls::Tls;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};

use crate::error::is_transport_failure;
use crate::registry::{describe, AdmitError};
use crate::Shared;
use tandem_serve::auth::cluster_request;

/// How long to wait for a TCP connection to a worker.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// HTTP/2 keepalive ping interval, and how long a ping may go unanswered.
pub const KEEPALIVE: Duration = Duration::from_secs(1);
/// Deadline of the small unary calls (Info, Stats, Release).
pub const SHORT_CALL: Duration = Duration::from_secs(5);
/// Deadline of `Reserve`. The decode worker runs it on its engine thread between two steps, so
/// it waits for the step in progress, which on a loaded CPU worker (a long prompt recomputed
/// after a preemption) can take several seconds.
pub const RESERVE_CALL: Duration = Duration::from_secs(30);

/// A lazily connecting channel to `address` (`host:port`, or a full `http://` URI), over TLS
/// when `tls` is given (the router's `--tls-*` flags decide, whatever the scheme says).
pub fn connect_lazy(address: &str, tls: Option<Arc<Tls>>) -> Result<Channel, String> {
    let uri = match address.split_once("://") {
        Some(("https", rest)) => format!("http://{rest}"),
        Some(_) => address.to_owned(),
        None => format!("http://{address}"),
    };
    let ep = Endpoint::from_shared(uri).map_err(|e| format!("invalid worker address {address:?}: {e}"))?;
    let ep = ep
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(KEEPALIVE)
        .keep_alive_while_idle(true)
        .tcp_nodelay(true);
    Ok(tandem_serve::tls::grpc_channel(ep, tls))
}

/// Starts the static-worker pollers and the heartbeat-expiry sweep.
pub(crate) fn spawn_background(shared: &Arc<Shared>, statics: &[String]) -> Vec<JoinHandle<()>> {
    let mut tasks: Vec<JoinHandle<()>> =
        statics.iter().map(|addr| tokio::spawn(poll_static(shared.clone(), addr.clone()))).collect();
    tasks.push(tokio::spawn(expire_loop(shared.clone())));
    tasks
}

async fn expire_loop(shared: Arc<Shared>) {
    let period = (shared.heartbeat / 2).max(Duration::from_millis(5));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Instant::now();
    loop {
        tick.tick().await;
        let now = Instant::now();
        // A tick this late means the router itself did not run (frozen, or starved of CPU): the
        // heartbeats it did not read meanwhile say nothing about the workers.
        let stalled = now.saturating_duration_since(last).saturating_sub(period);
        last = now;
        if stalled > shared.heartbeat {
            tracing::warn!(
                stalled_ms = stalled.as_millis() as u64,
                "the router did not run for a while; \
                workers get that long again to heartbeat"
            );
            shared.with_registry(|r| r.excuse(stalled, now));
        }
        for (who, since) in shared.with_registry(|r| r.expire(now)) {
            tracing::warn!("dropping {who}: no heartbeat for {} ms", since.as_millis());
        }
    }
}

/// Keeps one statically listed worker in the table: asks for its record until it answers (and
/// again after any failed poll, in case it restarted as someone else), then polls its load.
async fn poll_static(shared: Arc<Shared>, addr: String) {
    let channel = match shared.channel(&addr) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("--worker {addr}: {e}");
            return;
        }
    };
    let mut client = WorkerClient::new(channel);
    let mut tick = tokio::time::interval(shared.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut known: Option<String> = None;
    // Whether the worker runs adapters (`max_adapters` > 0) and answers `ListAdapters`.
    let mut lists_adapters = false;
    let mut last_problem = String::new();
    let timeout = SHORT_CALL.min(shared.heartbeat * 3).max(CONNECT_TIMEOUT);
    loop {
        tick.tick().await;
        match &known {
            None => {
                let mut req = cluster_request(shared.cluster_secret.as_ref(), InfoRequest {});
                req.set_timeout(timeout);
                match client.info(req).await {
                    Ok(resp) => {
                        let mut info = resp.into_inner();
                        // We know how to reach it; that beats whatever it thinks its address is.
                        info.address = addr.clone();
                        let id = info.worker_id.clone();
                        let who = describe(&info);
                        lists_adapters = info.max_adapters > 0;
                        let speculation = tandem_serve::speculation::describe(info.speculation.as_ref());
                        match shared.with_registry(|r| r.admit(info, true, Instant::now())) {
                            Ok(_) => {
                                tracing::info!(speculation, "using listed {who}");
                                known = Some(id);
                                last_problem.clear();
                            }
                            Err(AdmitError::Invalid(m) | AdmitError::Mismatch(m)) => {
                                if m != last_problem {
                                    tracing::error!("refusing listed {who}: {m}");
                                    last_problem = m;
                                }
                            }
                        }
                    }
                    Err(st) => {
                        let m = format!("{}: {}", st.code(), st.message());
                        if m != last_problem {
                            tracing::warn!("waiting for listed worker {addr}: {m}");
                            last_problem = m;
                        }
                    }
                }
            }
            Some(id) => {
                let mut req =
                    cluster_request(shared.cluster_secret.as_ref(), StatsRequest { check_invariants: false });
                req.set_timeout(timeout);
                match client.stats(req).await {
                    Ok(resp) => {
                        let stats = resp.into_inner();
                        let listed = shared.with_registry(|r| {
                            let known = r.heartbeat(id, stats.load, Instant::now());
                            r.set_cache(id, stats.cache.as_ref());
                            known
                        });
                        if !listed {
                            known = None; // deregistered or replaced: ask who is there now
                        } else if lists_adapters {
                            let mut req =
                                cluster_request(shared.cluster_secret.as_ref(), ListAdaptersRequest {});
                            req.set_timeout(timeout);
                            match client.list_adapters(req).await {
                                Ok(resp) => {
                                    let list = resp.into_inner();
                                    shared.with_registry(|r| {
                                        r.set_adapters(id, list.adapters, list.adapters_version)
                                    });
                                }
                                Err(st) if st.code() == tonic::Code::Unimplemented => lists_adapters = false,
                                Err(st) => {
                                    tracing::debug!(worker = %id, %addr, "ListAdapters failed: {}", st.message())
                                }
                            }
                        }
                    }
                    Err(st) => {
                        let why = format!("Stats failed: {}", st.message());
                        tracing::warn!(worker = %id, %addr, "listed worker unhealthy: {why}");
                        shared.with_registry(|r| r.mark_unhealthy(id, &addr, &why));
                        known = None;
                    }
                }
            }
        }
    }
}

/// Best-effort `Release` of what `address` holds for a request; failures are logged, and a worker
/// that cannot be reached is marked unhealthy.
pub(crate) async fn release(
    shared: Arc<Shared>,
    worker_id: String,
    address: String,
    request_id: String,
    reservation_id: u64,
) {
    let channel = match shared.channel(&address) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(request_id, worker = %worker_id, "release: {e}");
            return;
        }
    };
    let mut req = cluster_request(
        shared.cluster_secret.as_ref(),
        ReleaseRequest { request_id: request_id.clone(), reservation_id },
    );
    req.set_timeout(SHORT_CALL);
    match WorkerClient::new(channel).release(req).await {
        Ok(r) => {
            tracing::debug!(request_id, worker = %worker_id, reservation_id, released = r.into_inner().released, "release")
        }
        Err(st) => {
            tracing::debug!(request_id, worker = %worker_id, "release failed: {}", st.message());
            if is_transport_failure(&st) || st.code() == tonic::Code::Unavailable {
                shared.with_registry(|r| {
                    r.mark_unhealthy(&worker_id, &address, &format!("Release failed: {}", st.message()))
                });
            }
        }
    }
}
