//! The engine a worker runs, built from a model loaded once: the model's path is resolved and its
//! files read by [`load_model`]; [`build_engine`] takes that value and never opens the path again.
//! A decode or colocated worker's engine may speculate: its drafter (and a draft model's backend,
//! on the same device) is built here too, so a drafter that cannot work stops the worker at
//! start-up.

use tandem_engine::backend::{default_kv_dtype, BackendOptions};
use tandem_engine::factory::create_backend;
use tandem_engine::kv::{KvGroups, KvLayout};
use tandem_engine::scheduler::{Engine, SchedulerOptions};

use crate::args::WorkerArgs;
use crate::error::WorkerError;
use tandem_serve::identity::{resolve_model, ModelIdentity};

use crate::model::Model;
use crate::speculation::{self, SpeculationArgs};

/// A model loaded into an engine, with what a worker registers with.
pub struct BuiltEngine {
    /// The engine, not yet on its thread.
    pub engine: Engine,
    /// The model's identity (for the compatibility record).
    pub identity: ModelIdentity,
    /// The backend's KV pool layout.
    pub layout: KvLayout,
}

/// Checks the flags that need no model, then reads the model `--model` names (or the default),
/// each of its files once.
pub fn load_model(a: &WorkerArgs) -> Result<Model, WorkerError> {
    for (flag, value) in [
        ("--block-size", a.block_size),
        ("--max-batch-tokens", a.max_batch_tokens),
        ("--max-num-seqs", a.max_num_seqs),
    ] {
        if value == 0 {
            return Err(WorkerError::Flag(format!("{flag} must be at least 1")));
        }
    }
    if a.kv_blocks == Some(0) {
        return Err(WorkerError::Flag("--kv-blocks must be at least 1".into()));
    }
    a.check_loras().map_err(WorkerError::Flag)?;
    let path = resolve_model(a.model.as_deref())?;
    Ok(Model::load(&path)?)
}

/// Builds an engine over `model` on a backend on `--device`. With `kv_shared` the KV pool lives
/// in a shared-memory segment (decode workers offering shm). With `spec` (decode and colocated
/// workers) the engine speculates as those flags say; prefill workers pass `None`.
pub fn build_engine(
    a: &WorkerArgs,
    model: Model,
    kv_shared: bool,
    spec: Option<&SpeculationArgs>,
) -> Result<BuiltEngine, WorkerError> {
    let Model { identity, loaded } = model;
    let cfg = &identity.config;
    let kv_dtype = a.kv_dtype.unwrap_or_else(|| default_kv_dtype(a.device));
    let num_blocks = match (a.kv_blocks, a.kv_memory_mb) {
        (Some(n), _) => n,
        (None, Some(mb)) => {
            // Layers a block stores: on the CPU with sliding-window KV, the layer groups' pages
            // (their last group of a kind may leave layers unused).
            let layers = if a.device == tandem_engine::Device::Cpu {
                let g = KvGroups::new(&cfg.layer_windows(), a.windowed_kv);
                g.per_page() * g.len()
            } else {
                cfg.num_layers
            };
            let per_block = 2 * layers * a.block_size * cfg.num_kv_heads * cfg.head_dim * kv_dtype.bytes();
            let n = (mb as u128 * (1 << 20) / per_block.max(1) as u128) as usize;
            if n == 0 {
                return Err(WorkerError::Flag(format!(
                    "--kv-memory-mb {mb}: not even one KV block fits ({per_block} bytes per block of {} tokens)",
                    a.block_size
                )));
            }
            n
        }
        (None, None) => 512,
    };
    if num_blocks == 0 {
        return Err(WorkerError::Flag("--kv-blocks must be at least 1".into()));
    }
    let tokenizer = loaded.tokenizer.clone();
    let opts = BackendOptions {
        num_blocks,
        block_size: a.block_size,
        max_batch_tokens: a.max_batch_tokens,
        threads: a.threads.unwrap_or(0),
        kv_shared,
        dtype: a.dtype,
        cuda_graphs: !a.no_cuda_graphs,
        tiled_attention: true,
        tensor_core_attention: true,
        decode_gemv: true,
        device_sampling: true,
        moe_routed: true,
        pdl: true,
        activations: a.activations,
        kv_dtype: Some(kv_dtype),
        attention_amx: None,
        windowed_kv: a.windowed_kv,
        max_adapters: a.max_loras as usize,
    };
    let backend = create_backend(a.device, loaded, opts).map_err(WorkerError::Engine)?;
    let layout = backend.kv_layout();
    let mut engine = Engine::new(
        backend,
        tokenizer,
        SchedulerOptions { max_batch_tokens: a.max_batch_tokens, max_num_seqs: a.max_num_seqs },
    );
    if a.prefix_cache {
        engine = engine.with_prefix_cache(&identity.model_id);
    }
    // Pages are only reused by workers computing the same way: the model, the device kind and
    // the CPU's activations join the KV layout in the tier's identity.
    let kind = if a.device == tandem_engine::Device::Cpu { "cpu" } else { "cuda" };
    let tier_identity = format!("{} {kind} activations={}", identity.model_id, a.activations);
    engine = open_tiers(a, engine, &tier_identity)?;
    if let Some(spec) = spec {
        engine = speculation::speculate(engine, spec, a.device, &opts)?;
    }
    load_adapters(a, &mut engine)?;
    let spec_line = tandem_serve::speculation::describe(speculation::registration_record(&engine).as_ref());
    tracing::info!(
        model = %identity.model_name,
        model_id = %identity.model_id,
        path = %identity.path.display(),
        device = %a.device,
        blocks = layout.num_blocks,
        block_size = layout.block_size,
        kv_dtype = %layout.dtype,
        kv_shared,
        prefix_cache = a.prefix_cache,
        speculation = %spec_line,
        max_loras = engine.max_adapters(),
        loras = a.lora.len(),
        "engine ready"
    );
    Ok(BuiltEngine { engine, identity, layout })
}

/// Loads every `--lora` adapter (each file read once, checked against the model) and holds it
/// in `engine`; the first that fails stops the start-up with an error naming it and the problem.
fn load_adapters(a: &WorkerArgs, engine: &mut Engine) -> Result<(), WorkerError> {
    if a.lora.is_empty() {
        return Ok(());
    }
    let config = engine.backend().config().clone();
    for l in &a.lora {
        let fail = |source| WorkerError::Lora { spec: Box::new(l.clone()), source: Box::new(source) };
        let adapter = tandem_engine::lora::load::load(&l.name, &l.path, &config).map_err(fail)?;
        let status = engine.add_adapter(adapter).map_err(fail)?;
        tracing::info!(
            name = %status.name,
            id = %status.id,
            rank = status.rank,
            targets = %status.targets.join(","),
            bytes = status.bytes,
            path = %l.path.display(),
            "LoRA adapter loaded"
        );
    }
    Ok(())
}

/// Puts the KV tiers the flags ask for behind the engine's pool (none: the engine unchanged).
fn open_tiers(a: &WorkerArgs, engine: Engine, identity: &str) -> Result<Engine, WorkerError> {
    let opts = tandem_engine::kv::TierOptions {
        host_bytes: a.kv_host_bytes,
        disk_dir: a.kv_disk_dir.clone(),
        disk_bytes: a.kv_disk_bytes,
        disk_persist: a.kv_disk_persist,
    };
    if !opts.enabled() {
        return Ok(engine);
    }
    if !a.prefix_cache {
        return Err(WorkerError::Flag(
            "--kv-host-bytes and --kv-disk-dir keep prefix-cache pages: they need --prefix-cache true".into(),
        ));
    }
    let id = tandem_engine::kv::TierIdentity {
        model: identity.to_owned(),
        layout: engine.backend().kv_layout(),
        windows: engine.kv_windows().to_vec(),
    };
    // On a GPU the pages in host memory are page-locked, so copies to and from the pool are
    // DMA the engine does not wait for; elsewhere each page is its own heap allocation.
    let backend = engine.backend();
    let pinned = |bytes: usize| backend.host_memory(bytes).transpose().map_err(|e| e.to_string());
    let store = tandem_engine::kv::KvTiers::open_in(&opts, &id, engine.page_bytes(), Some(&pinned))
        .map_err(|e| WorkerError::Flag(e.to_string()))?
        .expect("the options enable a tier");
    tracing::info!(
        host_bytes = a.kv_host_bytes,
        disk_dir = ?a.kv_disk_dir,
        disk_bytes = a.kv_disk_bytes,
        persist = a.kv_disk_persist,
        page_bytes = engine.page_bytes(),
        "KV tiers on"
    );
    engine.with_kv_tiers(store).map_err(WorkerError::Engine)
}
