//! What the router and the engine both need to know about a model, and nothing numeric.
//!
//! - [`gguf`], [`ggml`], [`config`]: read a GGUF file's metadata and tensor table, and a model's
//!   configuration (from GGUF metadata or `config.json`); errors name the file and the key.
//! - [`tokenizer`]: tokenizer, chat templates and the incremental detokenizer (from
//!   `tokenizer.json` or from GGUF metadata).
//! - [`fingerprint`], [`info`]: a model's identity, and its description without weights.
//! - [`cache`]: where models live when no path is given, and the default model.
//! - [`request`]: a request's sampling and stopping parameters, and [`request::Request`], the
//!   one validated request type (prompt, sampling, stopping, salt) that travels from the edge.
//! - [`stop`]: the token rules a worker applies, and stop strings.
//! - [`text`]: where token ids become text (detokenizer and stop strings, composed once).
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
pub mod grammar;
pub mod info;
pub mod prefix;
pub mod reasoning;
pub mod request;
pub mod stop;
pub mod text;
pub mod tokenizer;
pub mod tools;
pub mod window;

pub use error::{ModelError, Result};
