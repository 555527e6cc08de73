//! CPU storage of the paged KV cache.
//!
//! Per layer one K and one V tensor of `f32`, shape `[num_blocks, block_size, num_kv_heads,
//! head_dim]`, row-major. A *slot* is `block * block_size + offset`; the values of one token (all KV
//! heads) are contiguous at `slot * num_kv_heads * head_dim`. This layout is part of the
//! compatibility record between workers ([`KvLayout`] is serialized into it), so two workers that
//! agree on it can move blocks as raw bytes and the destination holds exactly the source's bytes.
//!
//! Layers never share storage: each layer owns its own two vectors, so a write to layer `l` can only
//! reach layer `l`.

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

/// The KV pool in host memory.
#[derive(Debug, Clone)]
pub struct CpuKvPool {
    layout: KvLayout,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl CpuKvPool {
    /// A zero-filled pool.
    ///
    /// # Panics
    /// If the layout is invalid ([`KvLayout::validate`]); use [`Self::try_new`] for layouts that come
    /// from configuration.
    pub fn new(layout: KvLayout) -> Self {
        match Self::try_new(layout) {
            Ok(p) => p,
            Err(e) => panic!("CpuKvPool::new: {e}"),
        }
    }

    /// A zero-filled pool, or an error for an invalid layout.
    pub fn try_new(layout: KvLayout) -> Result<Self, KvError> {
        layout.validate()?;
        let n = layout.layer_elems();
        Ok(Self {
            layout,
            k: (0..layout.num_layers).map(|_| vec![0.0; n]).collect(),
            v: (0..layout.num_layers).map(|_| vec![0.0; n]).collect(),
        })
    }

    /// The pool's shape.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The whole K tensor of `layer` (what attention reads).
    ///
    /// # Panics
    /// If `layer >= num_layers` (the caller's model and pool disagree: a bug, not bad input).
    pub fn k(&self, layer: usize) -> &[f32] {
        &self.k[self.layer_index(layer)]
    }

    /// The whole V tensor of `layer`.
    ///
    /// # Panics
    /// If `layer >= num_layers`.
    pub fn v(&self, layer: usize) -> &[f32] {
        &self.v[self.layer_index(layer)]
    }

    /// Writes one token's K and V (`num_kv_heads * head_dim` values each) of `layer` at `slot`.
    /// Validates everything before writing.
    pub fn write_token(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        self.check_layer(layer)?;
        self.check_slot(slot)?;
        let te = self.layout.token_elems();
        check_len("k", k.len(), te)?;
        check_len("v", v.len(), te)?;
        let at = slot * te;
        self.k[layer][at..at + te].copy_from_slice(k);
        self.v[layer][at..at + te].copy_from_slice(v);
        Ok(())
    }

    /// The K and V bytes of one block of `layer` (native-endian `f32`), for transfers and KV-parity
    /// checks.
    ///
    /// # Panics
    /// If `layer` or `block` is out of range; use [`Self::try_block_bytes`] for ids from the wire.
    pub fn block_bytes(&self, layer: usize, block: BlockId) -> (&[u8], &[u8]) {
        match self.try_block_bytes(layer, block) {
            Ok(kv) => kv,
            Err(e) => panic!("CpuKvPool::block_bytes: {e}"),
        }
    }

    /// Like [`Self::block_bytes`], returning an error for an out-of-range layer or block.
    pub fn try_block_bytes(&self, layer: usize, block: BlockId) -> Result<(&[u8], &[u8]), KvError> {
        self.check_layer(layer)?;
        let r = self.block_range(block)?;
        Ok((bytemuck::cast_slice(&self.k[layer][r.clone()]), bytemuck::cast_slice(&self.v[layer][r])))
    }

    /// Overwrites one block of `layer` with raw K and V bytes (as produced by [`Self::block_bytes`]
    /// on a pool of the same layout). Validates lengths and ids before writing.
    pub fn write_block_bytes(
        &mut self,
        layer: usize,
        block: BlockId,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), KvError> {
        self.check_layer(layer)?;
        let r = self.block_range(block)?;
        let nb = self.layout.block_bytes();
        check_len("k block bytes", k.len(), nb)?;
        check_len("v block bytes", v.len(), nb)?;
        // Casting the (aligned) f32 destination to bytes sidesteps the alignment of the source bytes.
        bytemuck::cast_slice_mut::<f32, u8>(&mut self.k[layer][r.clone()]).copy_from_slice(k);
        bytemuck::cast_slice_mut::<f32, u8>(&mut self.v[layer][r]).copy_from_slice(v);
        Ok(())
    }

    /// Copies block `src` over block `dst` in every layer, K and V (copy-on-write after a fork).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<(), KvError> {
        let s = self.block_range(src)?;
        let d = self.block_range(dst)?;
        if s == d {
            return Ok(());
        }
        for layer in 0..self.layout.num_layers {
            self.k[layer].copy_within(s.clone(), d.start);
            self.v[layer].copy_within(s.clone(), d.start);
        }
        tracing::trace!(src, dst, layers = self.layout.num_layers, "kv copy_block");
        Ok(())
    }

    fn layer_index(&self, layer: usize) -> usize {
        if let Err(e) = self.check_layer(layer) {
            panic!("CpuKvPool: {e}");
        }
        layer
    }

    pub(crate) fn check_layer(&self, layer: usize) -> Result<(), KvError> {
        if layer >= self.layout.num_layers {
            return Err(KvError::LayerOutOfRange { layer, num_layers: self.layout.num_layers });
        }
        Ok(())
    }

    pub(crate) fn check_slot(&self, slot: usize) -> Result<(), KvError> {
        if slot >= self.layout.num_slots() {
            return Err(KvError::SlotOutOfRange { slot, num_slots: self.layout.num_slots() });
        }
        Ok(())
    }

    fn block_range(&self, block: BlockId) -> Result<std::ops::Range<usize>, KvError> {
        if block as usize >= self.layout.num_blocks {
            return Err(KvError::BlockOutOfRange { block, num_blocks: self.layout.num_blocks });
        }
        let be = self.layout.block_elems();
        let start = block as usize * be;
        Ok(start..start + be)
    }
}

fn check_len(what: &'static str, actual: usize, expected: usize) -> Result<(), KvError> {
    if actual != expected {
        return Err(KvError::ShapeMismatch { what, expected, actual });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { num_layers: 2, num_blocks: 4, block_size: 2, num_kv_heads: 2, head_dim: 3 }
    }

    #[test]
    fn token_lands_at_its_slot_in_its_layer_only() {
        let mut p = CpuKvPool::new(layout());
        let k: Vec<f32> = (0..6).map(|i| i as f32 + 1.0).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        p.write_token(1, 5, &k, &v).unwrap();
        assert_eq!(&p.k(1)[30..36], k.as_slice());
        assert_eq!(&p.v(1)[30..36], v.as_slice());
        assert!(p.k(0).iter().all(|&x| x == 0.0));
        assert_eq!(p.write_token(2, 0, &k, &v), Err(KvError::LayerOutOfRange { layer: 2, num_layers: 2 }));
        assert_eq!(p.write_token(0, 8, &k, &v), Err(KvError::SlotOutOfRange { slot: 8, num_slots: 8 }));
        assert!(matches!(p.write_token(0, 0, &k[..5], &v), Err(KvError::ShapeMismatch { .. })));
    }

    #[test]
    fn block_bytes_round_trip_between_pools() {
        let mut a = CpuKvPool::new(layout());
        for slot in 0..8 {
            let k: Vec<f32> = (0..6).map(|i| (slot * 10 + i) as f32).collect();
            a.write_token(0, slot, &k, &k).unwrap();
        }
        let mut b = CpuKvPool::new(layout());
        let (k, v) = a.block_bytes(0, 2);
        let (k, v) = (k.to_vec(), v.to_vec());
        b.write_block_bytes(0, 3, &k, &v).unwrap();
        assert_eq!(b.block_bytes(0, 3).0, k.as_slice());
        assert_eq!(b.block_bytes(0, 3).1, v.as_slice());
        assert!(matches!(b.write_block_bytes(0, 3, &k[1..], &v), Err(KvError::ShapeMismatch { .. })));
        assert!(matches!(b.try_block_bytes(0, 4), Err(KvError::BlockOutOfRange { block: 4, .. })));
    }

    #[test]
    fn layout_serializes_and_rejects_zero_dims() {
        let l = layout();
        let s = serde_json::to_string(&l).unwrap();
        assert_eq!(serde_json::from_str::<KvLayout>(&s).unwrap(), l);
        assert!(CpuKvPool::try_new(KvLayout { head_dim: 0, ..l }).is_err());
    }
}
