//! Tandem's engine: everything between a model file and a stream of tokens.
//!
//! - [`safetensors`], [`loader`], [`gguf`] (tensor access over `tandem_model`'s GGUF reader): read
//!   model files into a [`config::ModelConfig`] and [`models::ModelWeights`]; errors name the file
//!   and the tensor.
//! - [`quant`]: GGML block formats, dequantization and the quantized matrix kernels.
//! - [`config`], [`fingerprint`], [`tokenizer`], [`grammar`] (structured output's constraints): re-exported from `tandem_model`, which owns
//!   everything about a model that is not numeric (configuration, identity, tokenizer, request
//!   parameters, stop checking, prefix-block names).
//! - [`kv`]: block allocator (pure), KV pool storage and the layer-indexed write path.
//! - [`backend`]: the [`backend::Backend`] trait; [`cpu`] and [`cuda`] implement it, and
//!   [`factory`] creates one for a device.
//! - [`sampler`]: per-request sampling and stop conditions.
//! - [`scheduler`]: the generation loop over a backend: continuous batching, chunked prefill,
//!   preemption, reservations for transferred KV blocks, speculative verification.
//! - [`vmath`]: exponentials and maxima over f32 rows (attention's softmax, the sampler).
//! - [`spec`]: speculative decoding: drafters (n-gram lookup, draft model), adaptive depth and
//!   the verification rule.

pub mod backend;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod error;
pub mod factory;
pub mod gguf;
pub mod kv;
pub mod loader;
pub mod lora;
pub mod models;
pub mod quant;
pub mod safetensors;
pub mod sampler;
pub mod scheduler;
pub mod spec;
pub mod vmath;
pub mod weights;

pub use tandem_model::{config, fingerprint, grammar, tokenizer};

pub use device::Device;
pub use error::{EngineError, Result};
