//! Workers, loads and prompts for the registry's unit tests and the router's placement tests
//! (compiled for tests only).
//!
//! Every worker serves [`MODEL`] with block size 16, 64 blocks and a context of 512 tokens; its
//! gRPC address is `127.0.0.1:<port>`, so two workers given the same port are one restarting.

use std::time::Duration;

use tandem_proto::v1::{CacheDigest, CompatRecord, Role, TransportOffer, WorkerInfo, WorkerLoad};

use super::{OwnModel, PromptBlocks, Registry, Target};

/// A compatibility record for tests and examples.
pub(crate) fn test_compat(model_id: &str, block_size: u32) -> CompatRecord {
    CompatRecord {
        protocol_version: tandem_proto::PROTOCOL_VERSION,
        model_id: model_id.into(),
        model_name: "tiny".into(),
        kv_dtype: "f32".into(),
        block_size,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 8,
        kv_layout: "blocks".into(),
        vocab_size: 256,
        max_position_embeddings: 512,
        kv_token_stride: 64,
        kv_block_stride: 1024,
        kv_windows: Vec::new(),
    }
}

pub(crate) const MODEL: &str = "sha256:aaaa";

/// Worker `id` as a plan would name it (no cached overlap).
pub(crate) fn target(r: &Registry, id: &str) -> Target {
    Target::of(r.get(id).expect("registered"), 0)
}

pub(crate) fn registry() -> Registry {
    Registry::new(OwnModel { model_id: MODEL.into(), model_name: "tiny".into() }, Duration::from_millis(100))
}

pub(crate) fn offer(kind: &str, host: &str, decode: bool) -> TransportOffer {
    TransportOffer {
        kind: kind.into(),
        address: if decode { "127.0.0.1:7000".into() } else { String::new() },
        segment_path: if decode && kind == "shm" { "/dev/shm/x".into() } else { String::new() },
        host_id: if kind == "shm" || kind == "cuda-ipc" { host.into() } else { String::new() },
        ipc_handle: if decode && kind == "cuda-ipc" { vec![7; 64] } else { Vec::new() },
        pool_blocks: if decode && kind == "cuda-ipc" { 64 } else { 0 },
        device_uuid: if kind == "nccl" || kind == "cuda-ipc" { format!("GPU-{host}") } else { String::new() },
        writable_gpus: if !decode && kind == "cuda-ipc" { vec![format!("GPU-{host}")] } else { Vec::new() },
        nixl_metadata: if decode && kind == "nixl" { b"tandem-nixl-v1\0test".to_vec() } else { Vec::new() },
    }
}

pub(crate) fn worker(id: &str, role: Role, port: u16, offers: &[(&str, &str)]) -> WorkerInfo {
    let decode = role == Role::Decode;
    WorkerInfo {
        worker_id: id.into(),
        role: role as i32,
        address: format!("127.0.0.1:{port}"),
        compat: Some(test_compat(MODEL, 16)),
        transports: offers.iter().map(|(k, h)| offer(k, h, decode)).collect(),
        device: "cpu".into(),
        total_blocks: 64,
        max_sequence_len: 512,
        speculation: None,
        prefix_cache: false,
        adapters: Vec::new(),
        max_adapters: 0,
    }
}

/// A prompt with no named blocks: the choice is by load alone, as before caching.
pub(crate) fn load_only() -> PromptBlocks {
    PromptBlocks::unhashed(20)
}

pub(crate) fn load(free: u32, queued_prompt_tokens: u64) -> WorkerLoad {
    WorkerLoad { total_blocks: 64, free_blocks: free, queued_prompt_tokens, ..Default::default() }
}

pub(crate) fn digest(hashes: &[u64]) -> CacheDigest {
    CacheDigest { enabled: true, block_hashes: hashes.to_vec(), ..Default::default() }
}

/// A digest of `pool` in the pool, `host` in the host-memory tier and `disk` on the disk tier.
pub(crate) fn tiered(pool: &[u64], host: &[u64], disk: &[u64]) -> CacheDigest {
    CacheDigest { host_hashes: host.to_vec(), disk_hashes: disk.to_vec(), ..digest(pool) }
}

/// The blocks of a prompt of the tokens `from..to` in the namespace of `salt`, at block size 16.
pub(crate) fn prompt(from: u32, to: u32, salt: &str) -> PromptBlocks {
    PromptBlocks::new(&(from..to).collect::<Vec<_>>(), MODEL, salt, &[16])
}

pub(crate) fn caching(id: &str, role: Role, port: u16) -> WorkerInfo {
    WorkerInfo { prefix_cache: true, ..worker(id, role, port, &[("tcp", "")]) }
}
