//! Tandem's engine: everything between a model file and a stream of tokens.
//!
//! - [`gguf`], [`safetensors`], [`loader`]: read model files into a [`config::ModelConfig`] and
//!   [`weights::ModelWeights`]; errors name the file and the tensor.
//! - [`quant`]: GGML block formats, dequantization and the quantized matrix kernels.
//! - [`tokenizer`]: tokenizer and chat template (from `tokenizer.json` or from GGUF metadata).
//! - [`kv`]: block allocator (pure), KV pool storage and the layer-indexed write path.
//! - [`backend`]: the [`backend::Backend`] trait; [`cpu`] and [`cuda`] implement it.
//! - [`sampler`]: per-request sampling and stop conditions.
//! - [`engine`]: the in-process generation loop over a backend.
//! - [`transport`]: KV transports (`shm`, `tcp`) between prefill and decode workers.
//! - [`serve`]: the router and worker processes (gRPC services over the engine).

pub mod backend;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod kv;
pub mod loader;
pub mod quant;
pub mod safetensors;
pub mod sampler;
pub mod serve;
pub mod tokenizer;
pub mod transport;
pub mod weights;

pub use device::Device;
pub use error::{EngineError, Result};
