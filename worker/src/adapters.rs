//! LoRA adapters on a worker (docs/lora.md): the `LoadAdapter`, `UnloadAdapter` and
//! `ListAdapters` calls, answered the same way by every worker service, and the adapter id a
//! request runs under.
//!
//! `LoadAdapter` reads the file off the engine thread (a blocking task: the engine keeps
//! stepping meanwhile), then holds the adapter on the engine thread. A bad file, or one made for
//! another base model, is INVALID_ARGUMENT naming the adapter and the problem; a name already
//! held with other weights ALREADY_EXISTS (a name means one adapter across a cluster: unload it
//! first); a worker without adapter slots (`--max-loras 0`, a backend without LoRA) answers
//! FAILED_PRECONDITION before reading anything. Every change refreshes the adapters the worker
//! advertises ([`WorkerState::cached_adapters`]); the next heartbeat carries them.

use std::path::PathBuf;

use tandem_engine::error::EngineError;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::Engine;
use tandem_proto::v1::{
    AdapterInfo, ListAdaptersResponse, LoadAdapterRequest, UnloadAdapterRequest, UnloadAdapterResponse,
};
use tonic::Status;

use crate::args::check_adapter_name;
use crate::convert::{adapter_load_status, adapter_wire, adapters_wire};
use crate::state::WorkerState;

/// `LoadAdapter`: reads the adapter at `path` for this worker's model and holds it under `name`.
pub async fn load_adapter(state: &WorkerState, r: LoadAdapterRequest) -> Result<AdapterInfo, Status> {
    check_adapter_name(&r.name).map_err(|e| Status::invalid_argument(format!("name: {e}")))?;
    if r.path.trim().is_empty() {
        return Err(Status::invalid_argument(format!("path: empty (the file of adapter '{}')", r.name)));
    }
    if state.info.max_adapters == 0 {
        return Err(Status::failed_precondition(format!(
            "worker {} runs no LoRA adapter (--max-loras 0, or a backend without LoRA support)",
            state.info.worker_id
        )));
    }
    let config = state.engine.model_config();
    let (name, path) = (r.name.clone(), PathBuf::from(r.path.trim()));
    let adapter = tokio::task::spawn_blocking(move || tandem_engine::lora::load::load(&name, &path, &config))
        .await
        .map_err(|e| Status::internal(format!("loading adapter '{}': {e}", r.name)))?
        .map_err(|e| adapter_load_status(&r.name, &e))?;
    let cache = state.adapter_cache();
    let info = state
        .engine
        .call(move |core| {
            let held = core.engine.adapters().into_iter().find(|s| s.name == adapter.name);
            if let Some(have) = held.filter(|h| h.id != adapter.id) {
                return Err(Status::already_exists(format!(
                    "adapter '{}' is already loaded with other weights (id {}, from {}); {} has id {}: \
                     unload it first",
                    adapter.name,
                    have.id,
                    have.source.display(),
                    adapter.source.display(),
                    adapter.id
                )));
            }
            let name = adapter.name.clone();
            let status = core.engine.add_adapter(adapter).map_err(|e| adapter_load_status(&name, &e))?;
            let version =
                cache.lock().unwrap_or_else(|p| p.into_inner()).changed(adapters_wire(&core.engine));
            Ok(AdapterInfo { adapters_version: version, ..adapter_wire!(status) })
        })
        .await??;
    tracing::info!(name = %info.name, id = %info.id, rank = info.rank, source = %info.source, "LoRA adapter loaded");
    Ok(info)
}

/// `UnloadAdapter`: stops holding `name` (sequences running it finish with it).
pub async fn unload_adapter(
    state: &WorkerState,
    r: UnloadAdapterRequest,
) -> Result<UnloadAdapterResponse, Status> {
    let cache = state.adapter_cache();
    let name = r.name.clone();
    let (unloaded, adapters_version) = state
        .engine
        .call(move |core| {
            let unloaded = core.engine.remove_adapter(&name);
            let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
            let version = if unloaded { c.changed(adapters_wire(&core.engine)) } else { c.version };
            (unloaded, version)
        })
        .await?;
    if unloaded {
        tracing::info!(name = %r.name, "LoRA adapter unloaded");
    }
    Ok(UnloadAdapterResponse { unloaded, adapters_version })
}

/// `ListAdapters`: the adapters held, and the slots.
pub async fn list_adapters(state: &WorkerState) -> Result<ListAdaptersResponse, Status> {
    let set = state.refresh_adapters().await?;
    Ok(ListAdaptersResponse {
        adapters: set.list,
        max_adapters: state.info.max_adapters,
        adapters_version: set.version,
    })
}

/// The id of the adapter a request with `params` runs under on `engine` (empty: the base model),
/// checked as the engine checks a request: an adapter it does not hold is
/// [`EngineError::UnknownAdapter`], one whose id is not the request's `adapter_id`
/// [`EngineError::AdapterMismatch`].
pub fn resolve_adapter_id(engine: &Engine, params: &SamplingParams) -> Result<String, EngineError> {
    engine.request_salt(params)?;
    if params.adapter.is_empty() {
        return Ok(String::new());
    }
    let held = engine.adapters().into_iter().find(|s| s.name == params.adapter);
    held.map(|s| s.id).ok_or_else(|| EngineError::UnknownAdapter(params.adapter.clone()))
}
