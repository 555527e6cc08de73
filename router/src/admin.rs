//! The admin API: LoRA adapters on every worker of the cluster, under vLLM's names.
//!
//! - `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}`: `LoadAdapter` on every registered
//!   worker (prefill, decode and colocated) at once, each within [`ADMIN_CALL`].
//! - `POST /v1/unload_lora_adapter` `{"lora_name"}`: `UnloadAdapter` on every worker.
//! - `GET /v1/lora_adapters`: the adapters the workers hold, as the router knows them.
//!
//! Every route asks for `Authorization: Bearer <admin key>` (`--admin-key`); the API key does not
//! open it. Without an admin key every route answers 403.
//!
//! Invariants:
//! - After a load or an unload the registry's view of each worker that answered is updated at once
//!   (heartbeats confirm it later), so a request right after the call finds the adapter (or not).
//! - A partial failure leaves what succeeded in place: the answer names every failing worker and
//!   its error, and says where the adapter is now. Unlike a client's error, an admin's names
//!   workers: the admin runs them.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tandem_proto::v1::worker_client::WorkerClient;
use tandem_proto::v1::{AdapterInfo, LoadAdapterRequest, Role, UnloadAdapterRequest};
use tonic::{Code, Status};

use crate::api::{ApiError, Fields};
use crate::error::is_transport_failure;
use crate::registry::role_name;
use crate::Shared;
use tandem_serve::auth::{bearer, cluster_request};

/// Longest a worker may take to load or unload an adapter (reading its weights from disk).
pub const ADMIN_CALL: Duration = Duration::from_secs(120);

/// The admin API's paths, under `/v1`.
pub const PATHS: [&str; 3] = ["/load_lora_adapter", "/unload_lora_adapter", "/lora_adapters"];

/// Longest adapter name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// Whether `path` (with or without its `/v1` prefix) is an admin route: the API key's check
/// leaves it to the admin key's.
pub fn is_admin_path(path: &str) -> bool {
    let p = path.strip_prefix("/v1").unwrap_or(path);
    PATHS.contains(&p)
}

/// Checks the admin key: 403 when the router has none, 401 when it is missing or wrong.
pub(crate) fn authorize(shared: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = shared.admin_key.as_ref() else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            Some("admin_api_disabled"),
            "the admin API is off: start the router with --admin-key (or --admin-key-file, or \
             TANDEM_ADMIN_KEY) to load and unload LoRA adapters",
        ));
    };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| bearer(v.as_bytes()));
    let why = match given {
        None => "missing admin key: send the header `Authorization: Bearer <admin key>`",
        Some(k) if key.matches(k) => return Ok(()),
        Some(_) => "invalid admin key (the API key does not open the admin API)",
    };
    Err(ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", Some("invalid_admin_key"), why))
}

/// A worker an admin call goes to.
#[derive(Debug, Clone)]
struct WorkerRef {
    id: String,
    address: String,
    role: Role,
}

impl WorkerRef {
    fn describe(&self) -> String {
        format!("{} ({}, {})", self.id, role_name(self.role), self.address)
    }

    fn json(&self) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("worker_id".into(), json!(self.id));
        m.insert("role".into(), json!(role_name(self.role)));
        m.insert("address".into(), json!(self.address));
        m
    }
}

/// Every registered worker, by id.
fn workers(shared: &Shared) -> Vec<WorkerRef> {
    shared.with_registry(|r| {
        r.entries()
            .map(|e| WorkerRef {
                id: e.info.worker_id.clone(),
                address: e.info.address.clone(),
                role: Role::try_from(e.info.role).unwrap_or(Role::Unspecified),
            })
            .collect()
    })
}

/// Runs `call` on every worker at once (each within [`ADMIN_CALL`]); results by worker id.
async fn on_every_worker<T, F, Fut>(
    shared: &Arc<Shared>,
    workers: &[WorkerRef],
    call: F,
) -> Vec<Result<T, Status>>
where
    T: Send + 'static,
    F: Fn(WorkerClient<tonic::transport::Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<T, Status>> + Send + 'static,
{
    let mut tasks = Vec::with_capacity(workers.len());
    for w in workers {
        let task = match shared.channel(&w.address) {
            Ok(ch) => {
                let fut = call(WorkerClient::new(ch));
                tokio::spawn(async move {
                    tokio::time::timeout(ADMIN_CALL, fut).await.unwrap_or_else(|_| {
                        Err(Status::deadline_exceeded(format!("no answer within {} s", ADMIN_CALL.as_secs())))
                    })
                })
            }
            Err(e) => tokio::spawn(async move { Err(Status::unavailable(e)) }),
        };
        tasks.push(task);
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| Err(Status::internal(format!("the call's task failed: {e}")))));
    }
    out
}

/// `NOT_FOUND`, `FAILED_PRECONDITION`, ...: a gRPC code as its name.
fn code_name(code: Code) -> String {
    let camel = format!("{code:?}");
    let mut out = String::with_capacity(camel.len() + 4);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// A worker's failure, as the answer lists it.
fn failure_text(st: &Status) -> String {
    if is_transport_failure(st) {
        format!("UNREACHABLE: {}", st.message())
    } else {
        format!("{}: {}", code_name(st.code()), st.message())
    }
}

/// The HTTP status a worker's failure calls for: the worker's own refusal of what was asked (no
/// such file, a name held with other weights, no room) is the admin's to fix; anything else is
/// the cluster's.
fn failure_status(st: &Status) -> StatusCode {
    if is_transport_failure(st) {
        return StatusCode::BAD_GATEWAY;
    }
    match st.code() {
        Code::InvalidArgument => StatusCode::BAD_REQUEST,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::FailedPrecondition | Code::AlreadyExists | Code::ResourceExhausted => StatusCode::CONFLICT,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::BAD_GATEWAY,
    }
}

/// The status of an answer whose failures are `failed`: theirs when they agree, else 502.
fn combined_status(failed: &[&Status]) -> StatusCode {
    let mut statuses = failed.iter().map(|st| failure_status(st));
    let first = statuses.next().unwrap_or(StatusCode::BAD_GATEWAY);
    if statuses.all(|s| s == first) {
        first
    } else {
        StatusCode::BAD_GATEWAY
    }
}

/// An error answer in OpenAI's shape, with each worker's result beside it.
fn failed(status: StatusCode, code: &'static str, message: String, workers: Vec<Value>) -> Response {
    let kind = if status.is_client_error() { "invalid_request_error" } else { "server_error" };
    let e = ApiError::new(status, kind, Some(code), message);
    let mut body = e.body();
    body["workers"] = Value::Array(workers);
    (status, axum::Json(body)).into_response()
}

fn no_workers() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        Some("unavailable"),
        "no worker is registered: there is nothing to load or unload an adapter on",
    )
}

fn adapter_json(a: &AdapterInfo) -> Value {
    json!({
        "name": a.name,
        "id": a.id,
        "rank": a.rank,
        "resident": a.resident,
        "source": a.source,
        "targets": a.targets,
        "bytes": a.bytes,
    })
}

/// Reads `lora_name`, which must be usable as a model id: not empty, at most
/// [`MAX_NAME_BYTES`], no control character, `?`, `#` or `%`, and not the served model's name.
fn take_name(f: &mut Fields, shared: &Shared) -> Result<String, ApiError> {
    let bad = |why: String| ApiError::invalid("lora_name", format!("lora_name: {why}"));
    let name: String = f.take("lora_name")?.ok_or_else(|| bad("is required".into()))?;
    if name.trim().is_empty() {
        return Err(bad("must not be empty".into()));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(bad(format!("at most {MAX_NAME_BYTES} bytes, got {}", name.len())));
    }
    if let Some(c) = name.chars().find(|c| c.is_control() || matches!(c, '?' | '#' | '%')) {
        return Err(bad(format!("{name:?} contains {c:?}, which cannot appear in a model id")));
    }
    if name == shared.model.model_name || name == shared.model.model_id {
        return Err(bad(format!("`{name}` is the served model's name; give the adapter another")));
    }
    Ok(name)
}

/// `POST /v1/load_lora_adapter`.
pub(crate) async fn load(shared: Arc<Shared>, body: Bytes) -> Response {
    let mut f = match Fields::of_body(&body) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    let parsed = (|| {
        let name = take_name(&mut f, &shared)?;
        let path: String =
            f.take("lora_path")?.filter(|p: &String| !p.trim().is_empty()).ok_or_else(|| {
                ApiError::invalid("lora_path", "lora_path: is required (a path on the workers' hosts)")
            })?;
        if f.take::<bool>("load_inplace")? == Some(true) {
            return Err(ApiError::invalid(
                "load_inplace",
                "load_inplace: not supported by this server (unload the adapter first, then load it again)",
            ));
        }
        Ok((name, path))
    })()
    .and_then(|x| f.finish().map(|_| x));
    let (name, path) = match parsed {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let targets = workers(&shared);
    if targets.is_empty() {
        return no_workers().into_response();
    }
    let secret = shared.cluster_secret.clone();
    let results = on_every_worker(&shared, &targets, |mut c| {
        let mut req =
            cluster_request(secret.as_ref(), LoadAdapterRequest { name: name.clone(), path: path.clone() });
        req.set_timeout(ADMIN_CALL);
        async move { c.load_adapter(req).await.map(|r| r.into_inner()) }
    })
    .await;

    let mut listed = Vec::with_capacity(targets.len());
    let mut ok: Vec<(&WorkerRef, AdapterInfo)> = Vec::new();
    let mut bad: Vec<(&WorkerRef, &Status)> = Vec::new();
    for (w, r) in targets.iter().zip(&results) {
        let mut entry = w.json();
        match r {
            Ok(info) => {
                let info = AdapterInfo { name: name.clone(), ..info.clone() };
                entry.insert("ok".into(), json!(true));
                entry.insert("adapter".into(), adapter_json(&info));
                ok.push((w, info));
            }
            Err(st) => {
                entry.insert("ok".into(), json!(false));
                entry.insert("error".into(), json!(failure_text(st)));
                bad.push((w, st));
            }
        }
        listed.push(Value::Object(entry));
    }
    // The registry learns at once: a request right after this call may use the adapter.
    shared.with_registry(|r| {
        for (w, info) in &ok {
            r.adapter_loaded(&w.id, &w.address, info.clone());
        }
    });
    let mut ids: Vec<&str> = ok.iter().map(|(_, a)| a.id.as_str()).collect();
    ids.sort();
    ids.dedup();
    if bad.is_empty() {
        tracing::info!(adapter = %name, path = %path, workers = ok.len(), ids = ?ids, "LoRA adapter loaded");
        let mut message = format!("LoRA adapter `{name}` loaded on {} workers", ok.len());
        if ids.len() > 1 {
            message.push_str(&format!(
                "; they hold it under different ids ({}): requests go to the id most workers hold",
                ids.join(", ")
            ));
        }
        let first = &ok[0].1;
        return axum::Json(json!({
            "object": "lora_adapter",
            "lora_name": name,
            "id": first.id,
            "rank": first.rank,
            "message": message,
            "workers": listed,
        }))
        .into_response();
    }
    let failures: Vec<String> =
        bad.iter().map(|(w, st)| format!("{}: {}", w.describe(), failure_text(st))).collect();
    let mut message = if ok.is_empty() {
        format!(
            "LoRA adapter `{name}` failed to load on every worker ({}): {}",
            bad.len(),
            failures.join("; ")
        )
    } else {
        let held: Vec<&str> = ok.iter().map(|(w, _)| w.id.as_str()).collect();
        format!(
            "LoRA adapter `{name}` failed to load on {} of {} workers: {}. It stays loaded on the {} others ({}), \
             and requests for it go to those; POST /v1/unload_lora_adapter removes it, or load it again once \
             the failing workers are fixed",
            bad.len(),
            targets.len(),
            failures.join("; "),
            ok.len(),
            held.join(", ")
        )
    };
    if ids.len() > 1 {
        message.push_str(&format!(" (the workers hold it under different ids: {})", ids.join(", ")));
    }
    tracing::warn!(adapter = %name, path = %path, "{message}");
    let statuses: Vec<&Status> = bad.iter().map(|(_, st)| *st).collect();
    failed(combined_status(&statuses), "lora_load_failed", message, listed)
}

/// `POST /v1/unload_lora_adapter`.
pub(crate) async fn unload(shared: Arc<Shared>, body: Bytes) -> Response {
    let parsed = Fields::of_body(&body).and_then(|mut f| {
        let name: String =
            f.take("lora_name")?.ok_or_else(|| ApiError::invalid("lora_name", "lora_name: is required"))?;
        // vLLM's clients may send the id they got back; it is not needed.
        let _: Option<Value> = f.take_raw("lora_int_id");
        f.finish()?;
        Ok(name)
    });
    let name = match parsed {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    let targets = workers(&shared);
    if targets.is_empty() {
        return no_workers().into_response();
    }
    let secret = shared.cluster_secret.clone();
    let results = on_every_worker(&shared, &targets, |mut c| {
        let mut req = cluster_request(secret.as_ref(), UnloadAdapterRequest { name: name.clone() });
        req.set_timeout(ADMIN_CALL);
        async move {
            match c.unload_adapter(req).await {
                Ok(r) => {
                    let r = r.into_inner();
                    Ok((r.unloaded, r.adapters_version))
                }
                // A worker that holds no adapter of that name may say so with NOT_FOUND.
                Err(st) if st.code() == Code::NotFound && !is_transport_failure(&st) => Ok((false, 0)),
                Err(st) => Err(st),
            }
        }
    })
    .await;

    let mut listed = Vec::with_capacity(targets.len());
    let (mut unloaded, mut answered, mut bad) = (Vec::new(), Vec::new(), Vec::new());
    for (w, r) in targets.iter().zip(&results) {
        let mut entry = w.json();
        match r {
            Ok((u, version)) => {
                entry.insert("ok".into(), json!(true));
                entry.insert("unloaded".into(), json!(u));
                answered.push((w, *version));
                if *u {
                    unloaded.push(w.id.as_str());
                }
            }
            Err(st) => {
                entry.insert("ok".into(), json!(false));
                entry.insert("error".into(), json!(failure_text(st)));
                bad.push((w, st));
            }
        }
        listed.push(Value::Object(entry));
    }
    // Every worker that answered holds no adapter of that name now.
    shared.with_registry(|r| {
        for (w, version) in &answered {
            r.adapter_unloaded(&w.id, &w.address, &name, *version);
        }
    });
    if bad.is_empty() {
        if unloaded.is_empty() {
            return failed(
                StatusCode::NOT_FOUND,
                "lora_not_found",
                format!("no worker held a LoRA adapter called `{name}`"),
                listed,
            );
        }
        tracing::info!(adapter = %name, workers = unloaded.len(), "LoRA adapter unloaded");
        return axum::Json(json!({
            "object": "lora_adapter",
            "lora_name": name,
            "message": format!("LoRA adapter `{name}` unloaded from {} workers", unloaded.len()),
            "workers": listed,
        }))
        .into_response();
    }
    let failures: Vec<String> =
        bad.iter().map(|(w, st)| format!("{}: {}", w.describe(), failure_text(st))).collect();
    let message = format!(
        "LoRA adapter `{name}` could not be unloaded from {} of {} workers: {}. {}",
        bad.len(),
        targets.len(),
        failures.join("; "),
        if unloaded.is_empty() {
            "No other worker held it".to_owned()
        } else {
            format!("It was unloaded from {}", unloaded.join(", "))
        }
    );
    tracing::warn!(adapter = %name, "{message}");
    let statuses: Vec<&Status> = bad.iter().map(|(_, st)| *st).collect();
    failed(combined_status(&statuses), "lora_unload_failed", message, listed)
}

/// `GET /v1/lora_adapters`: every adapter (name and id) the registered workers hold, with its
/// holders, and each worker's room for adapters.
pub(crate) fn list(shared: &Shared) -> Response {
    let (views, workers) = shared.with_registry(|r| {
        let workers: Vec<Value> = r
            .entries()
            .map(|e| {
                json!({
                    "worker_id": e.info.worker_id,
                    "role": role_name(Role::try_from(e.info.role).unwrap_or(Role::Unspecified)),
                    "address": e.info.address,
                    "max_adapters": e.info.max_adapters,
                    "adapters": e.info.adapters.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
                })
            })
            .collect();
        (r.adapters(), workers)
    });
    let data: Vec<Value> = views
        .iter()
        .map(|v| {
            json!({
                "name": v.name,
                "id": v.id,
                "rank": v.rank,
                "source": v.source,
                "targets": v.targets,
                "bytes": v.bytes,
                "routed": v.routed,
                "workers": v.holders.iter().map(|h| json!({
                    "worker_id": h.worker_id,
                    "role": role_name(h.role),
                    "address": h.address,
                    "resident": h.resident,
                    "usable": h.usable,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    axum::Json(json!({"object": "list", "data": data, "workers": workers})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_named_as_grpc_names_them() {
        assert_eq!(code_name(Code::NotFound), "NOT_FOUND");
        assert_eq!(code_name(Code::FailedPrecondition), "FAILED_PRECONDITION");
        assert_eq!(code_name(Code::Internal), "INTERNAL");
    }

    #[test]
    fn failures_that_agree_give_their_status_and_others_a_502() {
        let nf = Status::not_found("no such file");
        let fp = Status::failed_precondition("held with other weights");
        assert_eq!(combined_status(&[&nf, &nf]), StatusCode::NOT_FOUND);
        assert_eq!(combined_status(&[&fp]), StatusCode::CONFLICT);
        assert_eq!(combined_status(&[&nf, &fp]), StatusCode::BAD_GATEWAY);
        assert!(is_admin_path("/v1/load_lora_adapter") && is_admin_path("/lora_adapters"));
        assert!(!is_admin_path("/v1/models"));
    }
}
