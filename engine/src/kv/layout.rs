//! The shape of a KV pool, shared by its storage ([`super::pool`], [`super::shm`]), the write
//! path and the transports. It is part of the compatibility record two workers compare before
//! they exchange blocks as raw bytes.

use serde::{Deserialize, Serialize};

use super::allocator::BlockId;
use super::KvError;

/// Shape of a KV pool. Part of the compatibility record exchanged at worker registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvLayout {
    /// Transformer layers (one K and one V tensor each).
    pub num_layers: usize,
    /// Blocks per layer tensor.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Key/value heads (after grouped-query sharing).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements of one token in one layer's K (or V): `num_kv_heads * head_dim`.
    pub fn token_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Elements of one block in one layer's K (or V).
    pub fn block_elems(&self) -> usize {
        self.block_size * self.token_elems()
    }

    /// Elements of one layer's K (or V) tensor.
    pub fn layer_elems(&self) -> usize {
        self.num_blocks * self.block_elems()
    }

    /// Token slots in the pool (`num_blocks * block_size`).
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Bytes of one block in one layer's K (or V).
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * std::mem::size_of::<f32>()
    }

    /// Rejects layouts with a zero dimension (other than zero blocks) or a size that overflows.
    pub fn validate(&self) -> Result<(), KvError> {
        if self.num_layers == 0 || self.block_size == 0 || self.num_kv_heads == 0 || self.head_dim == 0 {
            return Err(KvError::InvalidLayout(format!("zero dimension in {self:?}")));
        }
        self.num_blocks
            .checked_mul(self.block_size)
            .and_then(|n| n.checked_mul(self.num_kv_heads))
            .and_then(|n| n.checked_mul(self.head_dim))
            .and_then(|n| n.checked_mul(std::mem::size_of::<f32>()))
            .ok_or_else(|| KvError::InvalidLayout(format!("size overflows in {self:?}")))?;
        if self.num_blocks > BlockId::MAX as usize {
            return Err(KvError::InvalidLayout(format!(
                "{} blocks do not fit a 32-bit block id",
                self.num_blocks
            )));
        }
        Ok(())
    }
}
