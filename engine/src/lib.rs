//! Tandem's engine: everything between a model file and a stream of tokens.
//!
//! - [`gguf`], [`safetensors`], [`loader`]: read model files into a [`config::ModelConfig`] and
//!   [`weights::ModelWeights`]; errors name the file and the tensor.
//! - [`quant`]: GGML block formats, dequantization and the quantized matrix kernels.
//! - [`fingerprint`]: a model's id, from the bytes of its files.
//! - [`model_cache`]: where the default model lives.
//! - [`tokenizer`]: tokenizer and chat template (from `tokenizer.json` or from GGUF metadata).
//! - [`kv`]: block allocator (pure), KV pool storage and the layer-indexed write path.
//! - [`backend`]: the [`backend::Backend`] trait; [`cpu`] and [`cuda`] implement it, and
//!   [`factory`] creates one for a device.
//! - [`sampler`]: per-request sampling and stop conditions.
//! - [`scheduler`]: the generation loop over a backend: continuous batching, chunked prefill,
//!   preemption, reservations for transferred KV blocks, speculative verification.
//! - [`spec`]: speculative decoding: drafters (n-gram lookup, draft model), adaptive depth and
//!   the verification rule.

pub mod backend;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod error;
pub mod factory;
pub mod fingerprint;
pub mod gguf;
pub mod kv;
pub mod loader;
pub mod model_cache;
pub mod quant;
pub mod safetensors;
pub mod sampler;
pub mod scheduler;
pub mod spec;
pub mod tokenizer;
pub mod weights;

pub use device::Device;
pub use error::{EngineError, Result};
