//! CPU storage of the paged KV cache.
//!
//! Per layer one K and one V tensor of the layout's dtype ([`KvDtype`]: f32, f16, bf16 or fp8), shape
//! `[num_blocks, block_size, num_kv_heads, head_dim]`, row-major, all in one region (layer `l`'s K, then its V, then layer `l + 1`; see
//! [`super::shm`]). A *slot* is `block * block_size + offset`; the values of one token (all KV
//! heads) are contiguous at `slot * num_kv_heads * head_dim`. This layout is part of the
//! compatibility record between workers ([`KvLayout`] is serialized into it), so two workers that
//! agree on it can move blocks as raw bytes and the destination holds exactly the source's bytes.
//!
//! Values arrive and leave as f32: [`CpuKvPool::write_token`] rounds them to the dtype (to
//! nearest, ties to even) and attention widens what it reads ([`KvSlice`]), row by row, without
//! copying the tensor.
//!
//! Layers never share storage: each layer's K and V are disjoint ranges of the region and every
//! access is bounds-checked against its own layer's range, so a write to layer `l` can only reach
//! layer `l`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::allocator::BlockId;
use super::block_io::{KvBlockSink, KvBlockSource};
use super::checksum;
use super::dtype::{KvDtype, KvSlice};
use super::layout::KvLayout;
use super::shm::KvMemory;
use super::KvError;

/// The KV pool in host memory: private heap memory ([`CpuKvPool::try_new`]) or a shared-memory
/// segment ([`CpuKvPool::try_new_shared`]) that a prefill worker on the same host maps to write
/// transferred blocks straight into it. See [`super::shm`] for the byte layout, which is the same
/// for both.
///
/// Besides the engine thread (which owns the pool and reaches it through `&`/`&mut self`), a
/// transfer receiver may write blocks through a [`CpuKvPool::sink`], and another process may write
/// them through the segment. Both only ever touch blocks of a raw reservation, which no sequence
/// holds, while the engine only reads and writes blocks of its sequences' tables; that
/// disjointness is what makes the shared memory sound.
pub struct CpuKvPool {
    layout: KvLayout,
    mem: Arc<KvMemory>,
}

impl std::fmt::Debug for CpuKvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuKvPool").field("layout", &self.layout).field("memory", &self.mem).finish()
    }
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

    /// A zero-filled pool in private memory, or an error for an invalid layout.
    pub fn try_new(layout: KvLayout) -> Result<Self, KvError> {
        Ok(Self { layout, mem: Arc::new(KvMemory::heap(layout)?) })
    }

    /// A zero-filled pool in a new shared-memory segment (in [`super::shm::segment_dir`]). The
    /// segment file is removed when the pool and every sink of it are dropped; stale segments of
    /// dead processes are removed first.
    pub fn try_new_shared(layout: KvLayout) -> Result<Self, KvError> {
        Ok(Self { layout, mem: Arc::new(KvMemory::create_segment(layout)?) })
    }

    /// Like [`Self::try_new_shared`], with the segment in `dir`.
    pub fn try_new_shared_in(layout: KvLayout, dir: &Path) -> Result<Self, KvError> {
        Ok(Self { layout, mem: Arc::new(KvMemory::create_segment_in(layout, dir)?) })
    }

    /// The pool's shape.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Path of the shared-memory segment holding the pool (`None` for a private pool).
    pub fn segment_path(&self) -> Option<&Path> {
        self.mem.segment_path()
    }

    /// A thread-safe view for a transfer receiver, which writes incoming blocks of reservations
    /// while the engine keeps running (see [`KvBlockSink`] for the contract). Works for both
    /// kinds of memory; only a shared pool also accepts writes from another process.
    pub fn sink(&self) -> Arc<dyn KvBlockSink> {
        Arc::new(PoolSink { mem: self.mem.clone() })
    }

    /// The whole K tensor of `layer` as stored (what attention reads, widening rows to f32).
    ///
    /// # Panics
    /// If `layer >= num_layers` (the caller's model and pool disagree: a bug, not bad input).
    pub fn k(&self, layer: usize) -> KvSlice<'_> {
        let (k, _) = self.mem.layer_offsets(self.layer_index(layer));
        // SAFETY: in bounds (checked layer). The slice covers blocks that a receiver or a peer
        // process may be filling concurrently, but those are reservation blocks, which are in no
        // block table, and every read through this slice goes through a block table.
        self.typed(unsafe { self.mem.slice(k, self.layout.layer_elems()) })
    }

    /// The whole V tensor of `layer` as stored.
    ///
    /// # Panics
    /// If `layer >= num_layers`.
    pub fn v(&self, layer: usize) -> KvSlice<'_> {
        let (_, v) = self.mem.layer_offsets(self.layer_index(layer));
        // SAFETY: as in `k`.
        self.typed(unsafe { self.mem.slice(v, self.layout.layer_elems()) })
    }

    /// Stored bytes as values of the pool's dtype (the memory is aligned for it).
    fn typed<'a>(&self, bytes: &'a [u8]) -> KvSlice<'a> {
        match self.layout.dtype {
            KvDtype::F32 => KvSlice::F32(bytemuck::cast_slice(bytes)),
            KvDtype::F16 => KvSlice::F16(bytemuck::cast_slice(bytes)),
            KvDtype::Bf16 => KvSlice::Bf16(bytemuck::cast_slice(bytes)),
            KvDtype::Fp8 => KvSlice::Fp8(bytes),
        }
    }

    /// One token's K and V of `layer` at `slot`, widened to f32 (tests and parity checks).
    pub fn read_token(&self, layer: usize, slot: usize) -> Result<(Vec<f32>, Vec<f32>), KvError> {
        self.check_layer(layer)?;
        self.check_slot(slot)?;
        let te = self.layout.token_elems();
        Ok((self.k(layer).sub(slot * te, te).to_f32_vec(), self.v(layer).sub(slot * te, te).to_f32_vec()))
    }

    /// Writes one token's K and V (`num_kv_heads * head_dim` values each) of `layer` at `slot`,
    /// converted to the pool's dtype. Validates everything before writing.
    pub fn write_token(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        self.check_layer(layer)?;
        self.check_slot(slot)?;
        let te = self.layout.token_elems();
        check_len("k", k.len(), te)?;
        check_len("v", v.len(), te)?;
        let (kl, vl) = self.mem.layer_offsets(layer);
        let at = slot * te;
        // SAFETY: in bounds (checked layer and slot). `&mut self` excludes other users in this
        // process but the sink; the slot belongs to a sequence's table, never to a reservation.
        let dtype = self.layout.dtype;
        unsafe {
            dtype.encode(k, self.mem.slice_mut(kl + at, te));
            dtype.encode(v, self.mem.slice_mut(vl + at, te));
        }
        Ok(())
    }

    /// The K and V bytes of one block of `layer` (little-endian values of the pool's dtype), for
    /// transfers and KV-parity checks.
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
        // SAFETY: the engine reads blocks of its own sequences (or, in tests, blocks no transfer
        // is writing); reservation blocks are written only by their transfer.
        unsafe { self.mem.block_bytes(layer, block) }
    }

    /// Copies the K and V bytes of one block of `layer` into `k` and `v` (each exactly
    /// [`KvLayout::block_bytes`] long) — for instance straight into a peer's mapped pool.
    pub fn read_block_into(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), KvError> {
        let (sk, sv) = self.source_pieces(layer, block, k, v)?;
        k.copy_from_slice(sk);
        v.copy_from_slice(sv);
        Ok(())
    }

    /// [`Self::read_block_into`], returning `state` continued over the K bytes, then the V bytes,
    /// computed while copying ([`super::checksum::copy_summed`]).
    pub fn read_block_summed(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
        state: u32,
    ) -> Result<u32, KvError> {
        let (sk, sv) = self.source_pieces(layer, block, k, v)?;
        let state = checksum::copy_summed(state, sk, k);
        Ok(checksum::copy_summed(state, sv, v))
    }

    /// The K and V bytes of one block of `layer`, once `k` and `v` are checked to be as long:
    /// where [`Self::read_block_into`] and [`Self::read_block_summed`] copy from.
    fn source_pieces(
        &self,
        layer: usize,
        block: BlockId,
        k: &[u8],
        v: &[u8],
    ) -> Result<(&[u8], &[u8]), KvError> {
        let (sk, sv) = self.try_block_bytes(layer, block)?;
        check_len("k block buffer", k.len(), sk.len())?;
        check_len("v block buffer", v.len(), sv.len())?;
        Ok((sk, sv))
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
        let nb = self.layout.block_bytes();
        self.mem.block_offsets(layer, block)?;
        check_len("k block bytes", k.len(), nb)?;
        check_len("v block bytes", v.len(), nb)?;
        // SAFETY: `&mut self`: the engine writes a block it owns; a transfer writes only blocks
        // of its reservation, which the engine does not pass here while it is in flight.
        let (dk, dv) = unsafe { self.mem.block_bytes_mut(layer, block)? };
        dk.copy_from_slice(k);
        dv.copy_from_slice(v);
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
            let (k, v) = self.mem.layer_offsets(layer);
            // SAFETY: distinct blocks of one layer tensor are disjoint ranges in bounds; both
            // belong to the engine's sequences (`&mut self`).
            unsafe {
                self.mem.copy_within(k + s.start, k + d.start, s.len());
                self.mem.copy_within(v + s.start, v + d.start, s.len());
            }
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

    /// Element range of `block` within one layer's K (or V) tensor.
    fn block_range(&self, block: BlockId) -> Result<std::ops::Range<usize>, KvError> {
        if block as usize >= self.layout.num_blocks {
            return Err(KvError::BlockOutOfRange { block, num_blocks: self.layout.num_blocks });
        }
        let be = self.layout.block_elems();
        let start = block as usize * be;
        Ok(start..start + be)
    }
}

/// The [`KvBlockSink`] of a [`CpuKvPool`]: shares the pool's memory, so it stays valid (and a
/// segment stays on disk) for as long as either lives.
struct PoolSink {
    mem: Arc<KvMemory>,
}

impl KvBlockSink for PoolSink {
    fn layout(&self) -> KvLayout {
        self.mem.layout()
    }

    fn segment_path(&self) -> Option<PathBuf> {
        self.mem.segment_path().map(Path::to_path_buf)
    }

    fn host_region(&self) -> Option<(usize, usize)> {
        Some(self.mem.region())
    }

    unsafe fn write_block(&self, layer: usize, block: BlockId, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        let nb = self.mem.layout().block_bytes();
        self.mem.block_offsets(layer, block)?;
        check_len("k block bytes", k.len(), nb)?;
        check_len("v block bytes", v.len(), nb)?;
        // SAFETY: the caller holds the block's reservation (the trait's contract), so nothing else
        // touches it.
        let (dk, dv) = unsafe { self.mem.block_bytes_mut(layer, block)? };
        dk.copy_from_slice(k);
        dv.copy_from_slice(v);
        Ok(())
    }

    unsafe fn read_block(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), KvError> {
        // SAFETY: the caller holds the block's reservation (the trait's contract).
        let (sk, sv) = unsafe { self.mem.block_bytes(layer, block)? };
        check_len("k block buffer", k.len(), sk.len())?;
        check_len("v block buffer", v.len(), sv.len())?;
        k.copy_from_slice(sk);
        v.copy_from_slice(sv);
        Ok(())
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn block_slices_mut(&self, block: BlockId) -> Result<Option<Vec<&mut [u8]>>, KvError> {
        let layers = self.mem.layout().num_layers;
        let mut out = Vec::with_capacity(2 * layers);
        for layer in 0..layers {
            // SAFETY: the caller holds the block's reservation (the trait's contract); K and V
            // of distinct layers are disjoint ranges, so the slices never overlap.
            let (k, v) = unsafe { self.mem.block_bytes_mut(layer, block)? };
            out.push(k);
            out.push(v);
        }
        Ok(Some(out))
    }

    unsafe fn block_checksum(&self, block: BlockId) -> Result<u32, KvError> {
        // SAFETY: the caller holds the block's reservation (the trait's contract).
        unsafe { self.mem.block_checksum(block) }
    }

    unsafe fn blocks_checksums(&self, blocks: &[BlockId]) -> Result<Vec<u32>, KvError> {
        // SAFETY: the caller holds the blocks' reservation (the trait's contract).
        unsafe { self.mem.blocks_checksums(blocks) }
    }
}

fn check_len(what: &'static str, actual: usize, expected: usize) -> Result<(), KvError> {
    if actual != expected {
        return Err(KvError::ShapeMismatch { what, expected, actual });
    }
    Ok(())
}

/// A pool is a source of blocks for a transfer sender (tests and benchmarks send from one).
impl KvBlockSource for CpuKvPool {
    fn source_layout(&self) -> KvLayout {
        self.layout()
    }
    fn host_region(&self) -> Option<(usize, usize)> {
        Some(self.mem.region())
    }
    fn read_block_into(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), KvError> {
        CpuKvPool::read_block_into(self, layer, block, k, v)
    }
    fn read_block_summed(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
        state: u32,
    ) -> Result<u32, KvError> {
        CpuKvPool::read_block_summed(self, layer, block, k, v, state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_blocks: 4,
            block_size: 2,
            num_kv_heads: 2,
            head_dim: 3,
            dtype: KvDtype::F32,
        }
    }

    #[test]
    fn token_lands_at_its_slot_in_its_layer_only() {
        for dtype in KvDtype::ALL {
            let mut p = CpuKvPool::new(KvLayout { dtype, ..layout() });
            let k: Vec<f32> = (0..6).map(|i| i as f32 + 1.0).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            p.write_token(1, 5, &k, &v).unwrap();
            assert_eq!(&p.k(1).to_f32_vec()[30..36], k.as_slice(), "{dtype}");
            assert_eq!(&p.v(1).to_f32_vec()[30..36], v.as_slice(), "{dtype}");
            assert_eq!(p.read_token(1, 5).unwrap(), (k.clone(), v.clone()));
            assert!(p.k(0).to_f32_vec().iter().all(|&x| x == 0.0));
            assert_eq!(p.k(0).len(), 4 * 2 * 6);
            let (kb, _) = p.block_bytes(1, 2);
            assert_eq!(kb.len(), 2 * 6 * dtype.bytes());
            assert_eq!(dtype.decode(&kb[6 * dtype.bytes()..]), k, "{dtype}: slot 5 is block 2 offset 1");
        }
        let mut p = CpuKvPool::new(layout());
        let k: Vec<f32> = (0..6).map(|i| i as f32 + 1.0).collect();
        let v = k.clone();
        assert_eq!(p.write_token(2, 0, &k, &v), Err(KvError::LayerOutOfRange { layer: 2, num_layers: 2 }));
        assert_eq!(p.write_token(0, 8, &k, &v), Err(KvError::SlotOutOfRange { slot: 8, num_slots: 8 }));
        assert!(matches!(p.write_token(0, 0, &k[..5], &v), Err(KvError::ShapeMismatch { .. })));
    }

    #[test]
    fn values_are_stored_rounded_to_the_dtype() {
        let x = [1.0 + 2f32.powi(-9), 1.0 / 3.0, 70000.0, -1e-9, 0.1, 2.0, 3.0, -4.0, 5.5, 6.25, 7.0, 8.0];
        for dtype in [KvDtype::F16, KvDtype::Bf16] {
            let l = KvLayout { dtype, ..layout() };
            let mut p = CpuKvPool::new(l);
            p.write_token(0, 3, &x[..6], &x[6..]).unwrap();
            let (mut rk, mut rv) = (x[..6].to_vec(), x[6..].to_vec());
            dtype.round(&mut rk);
            dtype.round(&mut rv);
            assert_eq!(p.read_token(0, 3).unwrap(), (rk.clone(), rv), "{dtype}");
            assert_ne!(rk, x[..6].to_vec(), "{dtype}: some values are not representable");
        }
    }

    #[test]
    fn a_block_summed_while_read_has_the_receivers_checksum() {
        // Pieces of 4 KiB (the checksumming copy's wide path) and of 48 bytes (its short one).
        let wide = KvLayout {
            num_layers: 3,
            num_blocks: 3,
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 64,
            dtype: KvDtype::F16,
        };
        for l in [wide, layout()] {
            let mut p = CpuKvPool::new(l);
            let n = l.block_bytes();
            let mut x = 7u32;
            let mut bytes = || -> Vec<u8> {
                (0..n)
                    .map(|_| {
                        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                        (x >> 24) as u8
                    })
                    .collect()
            };
            for layer in 0..l.num_layers {
                for b in 0..l.num_blocks as BlockId {
                    let (k, v) = (bytes(), bytes());
                    p.write_block_bytes(layer, b, &k, &v).unwrap();
                }
            }
            for b in 0..l.num_blocks as BlockId {
                let (mut k, mut v) = (vec![0u8; n], vec![0u8; n]);
                let mut sum = 0;
                for layer in 0..l.num_layers {
                    sum = p.read_block_summed(layer, b, &mut k, &mut v, sum).unwrap();
                    assert_eq!((k.as_slice(), v.as_slice()), p.block_bytes(layer, b));
                }
                // SAFETY: nothing writes the pool meanwhile.
                assert_eq!(sum, unsafe { p.sink().block_checksum(b) }.unwrap(), "block {b}");
            }
            let (mut k, mut v) = (vec![0u8; n], vec![0u8; n + 1]);
            assert!(matches!(
                p.read_block_summed(0, 0, &mut k, &mut v, 0),
                Err(KvError::ShapeMismatch { .. })
            ));
        }
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
        let f16 = KvLayout { dtype: KvDtype::F16, ..l };
        assert!(serde_json::to_string(&f16).unwrap().contains(r#""dtype":"f16""#));
        assert_eq!(f16.block_bytes() * 2, l.block_bytes());
        let e = f16.check_same(&KvLayout { head_dim: 4, ..l }, "pool vs peer").unwrap_err().to_string();
        assert!(e.contains("dtype: f16 vs f32") && e.contains("head_dim: 3 vs 4"), "{e}");
        assert!(!e.contains("num_layers"), "{e}");
    }
}
