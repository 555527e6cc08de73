//! Whole-block access to a GPU KV pool from the host: the backend's `read_block`/`write_block`
//! and the transfer receiver's sink (host-staged TCP transfers into blocks reserved for an
//! incoming sequence, on a stream of the sink's own, while the engine runs).

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::mem::DevBuf;
use crate::kv::KvBlockSink;
use crate::kv::{BlockId, KvError, KvLayout};
use crate::Device;

/// The pool `[layers][K|V][blocks][block_size][kv_heads × head_dim]` (f32) on its context, and
/// copies of whole blocks between it and host memory. Each copy binds the context, runs on the
/// stream it is given and waits for it, so a block is complete when the call returns.
#[derive(Clone)]
pub(crate) struct KvPoolAccess {
    ctx: Arc<CudaContext>,
    pool: Arc<DevBuf>,
    layout: KvLayout,
}

impl KvPoolAccess {
    pub fn new(ctx: &Arc<CudaContext>, pool: DevBuf, layout: KvLayout) -> KvPoolAccess {
        KvPoolAccess { ctx: ctx.clone(), pool: Arc::new(pool), layout }
    }

    /// The context the pool lives on.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The pool's allocation, shared.
    pub fn owner(&self) -> Arc<DevBuf> {
        self.pool.clone()
    }

    /// The pool's allocation.
    pub fn buf(&self) -> &DevBuf {
        &self.pool
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> KvError {
        KvError::Device { device: Device::Cuda(self.ctx.ordinal()).to_string(), msg: format!("{what}: {e}") }
    }

    /// Device address of `(layer, K=0|V=1)`'s plane.
    pub fn plane(&self, layer: usize, kv: usize) -> u64 {
        let l = &self.layout;
        self.pool.at((layer * 2 + kv) * l.num_blocks * l.block_bytes())
    }

    /// Device address of `block` in `(layer, K=0|V=1)`'s plane, after range checks.
    pub fn address(&self, layer: usize, kv: usize, block: BlockId) -> Result<u64, KvError> {
        Ok(self.pool.at(self.layout.block_offset(layer, kv, block)?))
    }

    fn check_len(&self, k: usize, v: usize) -> Result<(), KvError> {
        let expected = self.layout.block_bytes();
        for actual in [k, v] {
            if actual != expected {
                return Err(KvError::ShapeMismatch { what: "KV block bytes", expected, actual });
            }
        }
        Ok(())
    }

    /// Overwrites one block of `layer` with `k` and `v` on `stream`. The caller makes sure
    /// nothing on the device uses the block meanwhile.
    pub fn write(
        &self,
        stream: &CudaStream,
        layer: usize,
        block: BlockId,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), KvError> {
        self.check_len(k.len(), v.len())?;
        super::bind(&self.ctx).map_err(|e| self.error("binding the context", e))?;
        for (kv, src) in [(0, k), (1, v)] {
            let dst = self.address(layer, kv, block)?;
            // SAFETY: `dst` is one block inside the pool (range-checked); `src` is one block long
            // and borrowed until the synchronize below.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }
                .map_err(|e| self.error("writing a KV block", e))?;
        }
        stream.synchronize().map_err(|e| self.error("writing a KV block", e))
    }

    /// Copies one block of `layer` into `k` and `v` on `stream`.
    pub fn read(
        &self,
        stream: &CudaStream,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), KvError> {
        self.check_len(k.len(), v.len())?;
        super::bind(&self.ctx).map_err(|e| self.error("binding the context", e))?;
        for (kv, dst) in [(0, k), (1, v)] {
            let src = self.address(layer, kv, block)?;
            // SAFETY: as for `write`, with `dst` one block long.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
                .map_err(|e| self.error("reading a KV block", e))?;
        }
        stream.synchronize().map_err(|e| self.error("reading a KV block", e))
    }
}

impl KvPoolAccess {
    /// Queues copies of whole blocks, every layer's K then V, into `pages` (one page of
    /// `2 * num_layers * block_bytes` per block) on `stream`, without waiting. On an error the
    /// stream is waited for; when even that fails, the error says so (`Err((error, false))`) and
    /// the pages may still be written.
    ///
    /// # Safety
    /// The pages' memory must stay allocated and untouched until `stream` has passed this point.
    pub unsafe fn read_pages_async(
        &self,
        stream: &CudaStream,
        blocks: &[BlockId],
        pages: &mut [&mut [u8]],
    ) -> Result<(), (KvError, bool)> {
        let lens: Vec<usize> = pages.iter().map(|p| p.len()).collect();
        let queued = self.queue_page_copies(blocks, &lens, |i, off, n, src| {
            let dst = &mut pages[i][off..off + n];
            // SAFETY: `src` is one block inside the pool (range-checked); the caller keeps `dst`
            // alive until the stream passes this copy.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
        });
        queued.map_err(|e| (e, super::mem::wait_stream(&self.ctx, stream).is_ok()))
    }

    /// Writes whole pages (as [`KvPoolAccess::read_pages_async`] reads them) into `blocks` on
    /// `stream`: every copy queued, then one wait.
    pub fn write_pages(
        &self,
        stream: &CudaStream,
        blocks: &[BlockId],
        pages: &[&[u8]],
    ) -> Result<(), KvError> {
        let lens: Vec<usize> = pages.iter().map(|p| p.len()).collect();
        let queued = self.queue_page_copies(blocks, &lens, |i, off, n, dst| {
            let src = &pages[i][off..off + n];
            // SAFETY: `dst` is one block inside the pool (range-checked); `src` is borrowed until
            // the wait below.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }
        });
        let waited =
            super::mem::wait_stream(&self.ctx, stream).map_err(|e| self.error("writing KV pages", e));
        queued.and(waited)
    }

    /// Calls `copy(page index, byte offset in the page, bytes, device address)` for every
    /// layer's K and V block of every block, after checking the pages' count and lengths (`lens`).
    fn queue_page_copies(
        &self,
        blocks: &[BlockId],
        lens: &[usize],
        mut copy: impl FnMut(usize, usize, usize, u64) -> Result<(), cudarc::driver::DriverError>,
    ) -> Result<(), KvError> {
        let l = self.layout;
        let n = l.block_bytes();
        if lens.len() != blocks.len() {
            return Err(KvError::ShapeMismatch {
                what: "KV pages for blocks",
                expected: blocks.len(),
                actual: lens.len(),
            });
        }
        for &len in lens {
            if len != 2 * l.num_layers * n {
                return Err(KvError::ShapeMismatch {
                    what: "KV page bytes",
                    expected: 2 * l.num_layers * n,
                    actual: len,
                });
            }
        }
        super::bind(&self.ctx).map_err(|e| self.error("binding the context", e))?;
        for (i, &block) in blocks.iter().enumerate() {
            for layer in 0..l.num_layers {
                for kv in 0..2 {
                    let addr = self.address(layer, kv, block)?;
                    let off = (2 * layer + kv) * n;
                    copy(i, off, n, addr).map_err(|e| self.error("copying a KV page", e))?;
                }
            }
        }
        Ok(())
    }
}

/// The transfer receiver's view of a [`super::CudaBackend`]'s pool: block copies on a stream of
/// its own, waited for before the receiver acknowledges a block (and so before the engine, told
/// afterwards, launches kernels that read it).
pub(crate) struct CudaKvSink {
    pool: KvPoolAccess,
    stream: Arc<CudaStream>,
}

impl CudaKvSink {
    pub fn new(pool: KvPoolAccess) -> crate::Result<CudaKvSink> {
        let ordinal = pool.ctx.ordinal();
        super::bind(&pool.ctx).map_err(|e| super::driver_error(ordinal, "binding the context", e))?;
        let stream =
            pool.ctx.new_stream().map_err(|e| super::driver_error(ordinal, "creating a stream", e))?;
        Ok(CudaKvSink { pool, stream })
    }
}

impl KvBlockSink for CudaKvSink {
    fn layout(&self) -> KvLayout {
        self.pool.layout()
    }

    fn segment_path(&self) -> Option<PathBuf> {
        None
    }

    fn device_pool(&self) -> Option<crate::kv::DeviceKvPool> {
        Some(self.pool.device_pool())
    }

    unsafe fn write_block(&self, layer: usize, block: BlockId, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        // The caller holds the block's reservation, so the engine does not touch it meanwhile.
        self.pool.write(&self.stream, layer, block, k, v)
    }

    unsafe fn read_block(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), KvError> {
        self.pool.read(&self.stream, layer, block, k, v)
    }
}
