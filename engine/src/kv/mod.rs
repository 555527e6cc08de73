//! KV cache (in progress).

/// KV-cache bookkeeping errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("out of KV blocks")]
    OutOfBlocks,
}
