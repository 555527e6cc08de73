//! The shape of a KV pool, shared by its storage ([`super::pool`], [`super::shm`]), the write
//! path and the transports. It is part of the compatibility record two workers compare before
//! they exchange blocks as raw bytes. Every byte size derives from its element type
//! ([`KvLayout::dtype`]), never from an assumed 4 bytes.

use serde::{Deserialize, Serialize};

use super::allocator::BlockId;
use super::dtype::KvDtype;
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
    /// Element type of the stored K and V values.
    pub dtype: KvDtype,
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

    /// Bytes of one stored value.
    pub fn elem_bytes(&self) -> usize {
        self.dtype.bytes()
    }

    /// Bytes of one token in one layer's K (or V).
    pub fn token_bytes(&self) -> usize {
        self.token_elems() * self.elem_bytes()
    }

    /// Bytes of one block in one layer's K (or V).
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.elem_bytes()
    }

    /// Bytes one token occupies in the whole pool: K and V of every layer.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.token_bytes()
    }

    /// Name of the byte layout (compatibility record field `kv_layout`, transfer HELLOs,
    /// shared-memory segment headers): per layer, K then V, each `[num_blocks, block_size,
    /// num_kv_heads, head_dim]` of little-endian values of [`Self::dtype`], e.g.
    /// `tandem-f16-lkv-v1`.
    pub fn name(&self) -> &'static str {
        self.dtype.layout_name()
    }

    /// Every field in which `other` differs from `self`, as `name: ours vs theirs` (the block
    /// count is a pool's own business and only compared when `with_blocks`). Empty when the two
    /// can exchange blocks as raw bytes.
    pub fn differences(&self, other: &KvLayout, with_blocks: bool) -> Vec<String> {
        let mut d = Vec::new();
        if self.dtype != other.dtype {
            d.push(format!("dtype: {} vs {} ({} vs {})", self.dtype, other.dtype, self.name(), other.name()));
        }
        for (name, a, b) in [
            ("num_layers", self.num_layers, other.num_layers),
            ("num_blocks", self.num_blocks, other.num_blocks),
            ("block_size", self.block_size, other.block_size),
            ("num_kv_heads", self.num_kv_heads, other.num_kv_heads),
            ("head_dim", self.head_dim, other.head_dim),
        ] {
            if a != b && (with_blocks || name != "num_blocks") {
                d.push(format!("{name}: {a} vs {b}"));
            }
        }
        d
    }

    /// `Ok` when `other` equals `self`; otherwise a [`KvError::LayoutMismatch`] naming `what` is
    /// compared and every field that differs, also logged at DEBUG.
    pub fn check_same(&self, other: &KvLayout, what: &str) -> Result<(), KvError> {
        let diffs = self.differences(other, true);
        if diffs.is_empty() {
            return Ok(());
        }
        let diffs = diffs.join(", ");
        tracing::debug!(what, differences = %diffs, "kv layout mismatch");
        Err(KvError::LayoutMismatch { what: format!("{what}: {diffs}") })
    }

    /// Byte offset of `block` in `(layer, K=0|V=1)`'s plane of a pool of this layout (per layer K
    /// then V, each `[num_blocks, ...]`), after range checks: where a device pool's block lives,
    /// relative to the pool's start.
    pub fn block_offset(&self, layer: usize, kv: usize, block: BlockId) -> Result<usize, KvError> {
        if layer >= self.num_layers {
            return Err(KvError::LayerOutOfRange { layer, num_layers: self.num_layers });
        }
        if block as usize >= self.num_blocks {
            return Err(KvError::BlockOutOfRange { block, num_blocks: self.num_blocks });
        }
        Ok(((layer * 2 + kv.min(1)) * self.num_blocks + block as usize) * self.block_bytes())
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
            .and_then(|n| n.checked_mul(self.elem_bytes()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_offsets_follow_the_plane_order_and_refuse_out_of_range() {
        let l = KvLayout {
            num_layers: 3,
            num_blocks: 5,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::F32,
        };
        let bb = l.block_bytes();
        assert_eq!(l.block_offset(0, 0, 0), Ok(0));
        assert_eq!(l.block_offset(0, 0, 4), Ok(4 * bb));
        // Layer 0's V plane follows its K plane; layer 1's K follows layer 0's V.
        assert_eq!(l.block_offset(0, 1, 0), Ok(5 * bb));
        assert_eq!(l.block_offset(1, 0, 2), Ok((10 + 2) * bb));
        assert_eq!(l.block_offset(2, 1, 4), Ok((25 + 4) * bb));
        assert_eq!(l.block_offset(3, 0, 0), Err(KvError::LayerOutOfRange { layer: 3, num_layers: 3 }));
        assert_eq!(l.block_offset(0, 0, 5), Err(KvError::BlockOutOfRange { block: 5, num_blocks: 5 }));
    }
}
