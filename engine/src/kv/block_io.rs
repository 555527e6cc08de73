//! How code outside the engine thread reaches KV blocks: a transfer receiver writing the blocks
//! of a reservation into a live pool ([`KvBlockSink`]), and a sender reading the blocks it ships
//! ([`KvBlockSource`]). Both see blocks in the pool's byte layout ([`KvLayout::name`], e.g.
//! `tandem-f16-lkv-v1`: per layer, K then V, each `[num_blocks, block_size, num_kv_heads,
//! head_dim]` of little-endian values of the layout's dtype), which a transport puts on the wire
//! unchanged.

use std::path::PathBuf;

use super::allocator::BlockId;
use super::checksum;
use super::layout::KvLayout;
use super::KvError;

/// What D's KV pool looks like to a receiver running outside the engine thread: a `Send + Sync`
/// view that writes and reads whole blocks of one layer.
///
/// The accessors are `unsafe` because the engine keeps using the pool meanwhile: a caller may
/// only touch blocks of a reservation it holds (handed out by the transport's reservation gate and
/// not yet completed or aborted). No sequence's block table contains such a block and no other
/// transfer writes it, so the accesses never overlap the engine's.
pub trait KvBlockSink: Send + Sync {
    /// Shape of the pool.
    fn layout(&self) -> KvLayout;
    /// The shared-memory segment holding the pool, if it is one (then P can write into it).
    fn segment_path(&self) -> Option<PathBuf>;
    /// The pool on its GPU, if it lives on one (then it can be exported with CUDA IPC or be the
    /// target of NCCL receives). `None` (the default) for host pools.
    fn device_pool(&self) -> Option<super::DeviceKvPool> {
        None
    }
    /// The pool's memory when it is host memory, as `(address, bytes)`: the whole pool in the
    /// layout's byte order, from layer 0's K tensor on (a shared-memory segment's header is not
    /// included). For a transport that registers the pool once and lets the sender write its
    /// blocks (nixl). `None` (the default) for device pools.
    ///
    /// Writing through the address is bound by the same contract as
    /// [`KvBlockSink::write_block`]: only blocks of a reservation the writer holds.
    fn host_region(&self) -> Option<(usize, usize)> {
        None
    }
    /// Overwrites one block of `layer` with `k` and `v` (each [`KvLayout::block_bytes`] long).
    ///
    /// # Safety
    /// The caller holds a reservation containing `block` (see the trait documentation).
    unsafe fn write_block(&self, layer: usize, block: BlockId, k: &[u8], v: &[u8]) -> Result<(), KvError>;
    /// Copies one block of `layer` into `k` and `v`.
    ///
    /// # Safety
    /// As for [`KvBlockSink::write_block`].
    unsafe fn read_block(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), KvError>;
    /// The pool's own memory of one block, in wire order (for every layer its K bytes then its V
    /// bytes: `2 * num_layers` slices of [`KvLayout::block_bytes`]), for a receiver that reads
    /// the network straight into place instead of through [`KvBlockSink::write_block`].
    /// `Ok(None)` (the default) when the pool cannot lend its memory (device memory).
    ///
    /// # Safety
    /// As for [`KvBlockSink::write_block`], and the slices are dropped before the reservation
    /// completes or aborts.
    #[allow(clippy::mut_from_ref)]
    unsafe fn block_slices_mut(&self, block: BlockId) -> Result<Option<Vec<&mut [u8]>>, KvError> {
        let _ = block;
        Ok(None)
    }
    /// [`KvBlockSink::block_checksum`] of each of `blocks`, in order (a pool may read them layer
    /// by layer across the group, which is faster for runs of consecutive ids).
    ///
    /// # Safety
    /// As for [`KvBlockSink::write_block`], for every block.
    unsafe fn blocks_checksums(&self, blocks: &[BlockId]) -> Result<Vec<u32>, KvError> {
        // SAFETY: forwarded from the caller.
        blocks.iter().map(|&b| unsafe { self.block_checksum(b) }).collect()
    }
    /// CRC-32 of one block's payload (every layer's K then V, see the module documentation).
    ///
    /// # Safety
    /// As for [`KvBlockSink::write_block`].
    unsafe fn block_checksum(&self, block: BlockId) -> Result<u32, KvError> {
        let n = self.layout().block_bytes();
        let (mut k, mut v) = (vec![0u8; n], vec![0u8; n]);
        let mut sum = 0;
        for layer in 0..self.layout().num_layers {
            // SAFETY: forwarded from the caller.
            unsafe { self.read_block(layer, block, &mut k, &mut v)? };
            sum = checksum::update_kv(sum, &k, &v);
        }
        Ok(sum)
    }
}

/// Where a sender reads the blocks it stages: a backend (the engine thread's), or any pool.
pub trait KvBlockSource {
    /// Shape of the source's pool (`num_blocks` may differ from the destination's).
    fn source_layout(&self) -> KvLayout;
    /// Copies one block of `layer` into `k` and `v` (each [`KvLayout::block_bytes`] long).
    fn read_block_into(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), KvError>;
    /// [`Self::read_block_into`], returning `state` continued over the K bytes, then the V bytes
    /// ([`super::checksum`]): how a sender checksums a block as it stages it. A pool in host
    /// memory sums while it copies ([`super::checksum::copy_summed`]); the default sums the copy.
    fn read_block_summed(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
        state: u32,
    ) -> Result<u32, KvError> {
        self.read_block_into(layer, block, k, v)?;
        Ok(checksum::update_kv(state, k, v))
    }
    /// The source pool's memory when it is host memory, as `(address, bytes)` in the layout's
    /// byte order (see [`KvBlockSink::host_region`]): a transport may read blocks there itself
    /// (nixl registers it once and keeps it registered, so a source that lends its region keeps
    /// it allocated for as long as senders use the source: an engine's pool lives as long as its
    /// worker). Read only while the caller stages, when nothing writes the pool. `None` (the
    /// default) when the pool cannot lend it.
    fn host_region(&self) -> Option<(usize, usize)> {
        None
    }
}
