//! CPU backend.
pub mod matmul;
