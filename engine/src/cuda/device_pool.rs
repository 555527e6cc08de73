//! The CUDA backend's side of [`DeviceKvPool`]: describing its own pool, and pools made without a
//! model (benchmarks, transport tests).

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::sink::{CudaKvSink, KvPoolAccess};
use crate::kv::{DeviceKvPool, KvBlockSink, KvLayout};

impl KvPoolAccess {
    /// The pool as the GPU transports see it (sharing the allocation).
    pub fn device_pool(&self) -> DeviceKvPool {
        let buf = self.owner();
        DeviceKvPool::new(self.context().clone(), buf.ptr(), buf.bytes(), self.layout(), buf)
    }
}

/// A zeroed pool of `layout` on `cuda:<ordinal>`, on a context of its own, and its transfer sink
/// (whole-block copies from and to the host on a stream of the sink's own), for transfers without
/// a model. Errors name what is missing (driver, device, memory).
pub fn allocate_kv_pool(
    ordinal: usize,
    layout: KvLayout,
) -> crate::Result<(DeviceKvPool, Arc<dyn KvBlockSink>)> {
    layout.validate()?;
    super::check_device(ordinal)?;
    let ctx = CudaContext::new(ordinal).map_err(|e| super::driver_error(ordinal, "creating a context", e))?;
    let bytes = 2 * layout.num_layers * layout.num_blocks * layout.block_bytes();
    let buf = super::mem::DevBuf::alloc(&ctx, bytes, "KV pool")?;
    // SAFETY: `buf` is a live allocation of `buf.bytes()` bytes on the bound context.
    unsafe { cudarc::driver::result::memset_d8_sync(buf.ptr(), 0, buf.bytes()) }
        .map_err(|e| super::driver_error(ordinal, "clearing the KV pool", e))?;
    let access = KvPoolAccess::new(&ctx, buf, layout);
    Ok((access.device_pool(), Arc::new(CudaKvSink::new(access)?)))
}
