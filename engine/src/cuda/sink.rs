//! The transfer receiver's view of a GPU KV pool: host-staged block writes (TCP transport) into
//! blocks reserved for an incoming sequence, on a stream of its own, while the engine runs.

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::mem::DevBuf;
use crate::kv::{BlockId, KvError, KvLayout};
use crate::transport::KvBlockSink;
use crate::Device;

/// Writes and reads whole blocks of a [`super::CudaBackend`]'s pool from any thread. Each call
/// binds the pool's context, copies on the sink's own stream and waits for the copy, so a block
/// is complete on the device before the receiver acknowledges it (and before the engine, told
/// afterwards, launches kernels that read it).
pub(crate) struct CudaKvSink {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pool: Arc<DevBuf>,
    layout: KvLayout,
}

impl CudaKvSink {
    pub fn new(ctx: &Arc<CudaContext>, pool: Arc<DevBuf>, layout: KvLayout) -> crate::Result<CudaKvSink> {
        let ordinal = ctx.ordinal();
        ctx.bind_to_thread().map_err(|e| super::driver_error(ordinal, "binding the context", e))?;
        let stream = ctx.new_stream().map_err(|e| super::driver_error(ordinal, "creating a stream", e))?;
        Ok(CudaKvSink { ctx: ctx.clone(), stream, pool, layout })
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> KvError {
        KvError::Device { device: Device::Cuda(self.ctx.ordinal()).to_string(), msg: format!("{what}: {e}") }
    }

    /// Device address of `block` in `(layer, K=0|V=1)`'s plane, after range checks.
    fn address(&self, layer: usize, kv: usize, block: BlockId) -> Result<u64, KvError> {
        let l = &self.layout;
        if layer >= l.num_layers {
            return Err(KvError::LayerOutOfRange { layer, num_layers: l.num_layers });
        }
        if block as usize >= l.num_blocks {
            return Err(KvError::BlockOutOfRange { block, num_blocks: l.num_blocks });
        }
        let plane = l.num_blocks * l.block_bytes();
        Ok(self.pool.at((layer * 2 + kv) * plane + block as usize * l.block_bytes()))
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
}

impl KvBlockSink for CudaKvSink {
    fn layout(&self) -> KvLayout {
        self.layout
    }

    fn segment_path(&self) -> Option<PathBuf> {
        None
    }

    unsafe fn write_block(&self, layer: usize, block: BlockId, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        self.check_len(k.len(), v.len())?;
        self.ctx.bind_to_thread().map_err(|e| self.error("binding the context", e))?;
        for (kv, src) in [(0, k), (1, v)] {
            let dst = self.address(layer, kv, block)?;
            // SAFETY: `dst` is one block inside the pool (range-checked); `src` is one block long
            // and borrowed until the synchronize below; the caller holds the block's reservation,
            // so the engine does not touch it meanwhile.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
                .map_err(|e| self.error("writing a KV block", e))?;
        }
        self.stream.synchronize().map_err(|e| self.error("writing a KV block", e))
    }

    unsafe fn read_block(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), KvError> {
        self.check_len(k.len(), v.len())?;
        self.ctx.bind_to_thread().map_err(|e| self.error("binding the context", e))?;
        for (kv, dst) in [(0, k), (1, v)] {
            let src = self.address(layer, kv, block)?;
            // SAFETY: as for write_block, with `dst` one block long.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
                .map_err(|e| self.error("reading a KV block", e))?;
        }
        self.stream.synchronize().map_err(|e| self.error("reading a KV block", e))
    }
}
