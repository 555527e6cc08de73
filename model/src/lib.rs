//! What the router and the engine both need to know about a model, and nothing numeric.
//!
//! - [`gguf`], [`ggml`], [`config`]: read a GGUF file's metadata and tensor table, and a model's
//!   configuration (from GGUF metadata or `config.json`); errors name the file and the key.
//! - [`tokenizer`]: tokenizer, chat templates and the incremental detokenizer (from
//!   `tokenizer.json` or from GGUF metadata).
//! - [`fingerprint`], [`info`]: a model's identity, and its description without weights.
//! - [`cache`]: where models live when no path is given, and the default model.
//! - [`request`], [`stop`]: a request's sampling and stopping parameters, validated once at the
//!   edge, and the stop checker that decides when generation ends and what text may be shown.
//! - [`prefix`]: prefix-cache block names (the hash chain over model id, salt and tokens).
//!
//! This crate depends on no other workspace crate; the engine builds on it (and re-exports what
//! it uses under its old paths), and the router links it instead of the engine.

pub mod cache;
pub mod config;
pub mod error;
pub mod fingerprint;
pub mod ggml;
pub mod gguf;
pub mod info;
pub mod prefix;
pub mod request;
pub mod stop;
pub mod tokenizer;

pub use error::{ModelError, Result};
