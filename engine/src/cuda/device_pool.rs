//! A GPU KV pool as the GPU transports see it: its context, its base address and its byte
//! layout, so a transfer can copy blocks device to device (CUDA IPC, NCCL) without the engine
//! thread, and the pool can be exported to another process once.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::sink::KvPoolAccess;
use crate::kv::{BlockId, KvError, KvLayout};
use crate::Device;

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// A backend's KV pool on its device: `[layers][K|V][blocks][block_size][kv_heads × head_dim]`,
/// one allocation made with the driver API (`cuMemAlloc`), so it can be shared with another
/// process through a CUDA IPC handle. Cloning shares the pool; the allocation lives as long as
/// its backend or a clone, whichever is last.
#[derive(Clone)]
pub struct DeviceKvPool {
    access: KvPoolAccess,
}

impl std::fmt::Debug for DeviceKvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKvPool")
            .field("device", &self.device())
            .field("bytes", &self.bytes())
            .field("layout", &self.layout())
            .finish()
    }
}

impl DeviceKvPool {
    pub(crate) fn new(access: KvPoolAccess) -> DeviceKvPool {
        DeviceKvPool { access }
    }

    /// A zeroed pool of `layout` on `cuda:<ordinal>`, on a context of its own, for transfers
    /// without a model (benchmarks, transport tests). Errors name what is missing (driver,
    /// device, memory).
    pub fn allocate(ordinal: usize, layout: KvLayout) -> crate::Result<DeviceKvPool> {
        layout.validate()?;
        super::check_device(ordinal)?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| super::driver_error(ordinal, "creating a context", e))?;
        let bytes = 2 * layout.num_layers * layout.num_blocks * layout.block_bytes();
        let buf = super::mem::DevBuf::alloc(&ctx, bytes, "KV pool")?;
        // SAFETY: `buf` is a live allocation of `buf.bytes()` bytes on the bound context.
        unsafe { cudarc::driver::result::memset_d8_sync(buf.ptr(), 0, buf.bytes()) }
            .map_err(|e| super::driver_error(ordinal, "clearing the KV pool", e))?;
        Ok(DeviceKvPool { access: KvPoolAccess::new(&ctx, buf, layout) })
    }

    /// A transfer receiver's view of the pool (whole-block copies from and to the host on a
    /// stream of its own).
    pub fn sink(&self) -> crate::Result<Arc<dyn crate::kv::KvBlockSink>> {
        Ok(Arc::new(super::sink::CudaKvSink::new(self.access.clone())?))
    }

    /// The context the pool was allocated on (bind it before any driver call about the pool).
    pub fn context(&self) -> &Arc<CudaContext> {
        self.access.context()
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.context().ordinal())
    }

    pub fn layout(&self) -> KvLayout {
        self.access.layout()
    }

    /// Device address of the pool's first byte.
    pub fn base(&self) -> u64 {
        self.access.buf().ptr()
    }

    /// Bytes of the allocation.
    pub fn bytes(&self) -> usize {
        self.access.buf().bytes()
    }

    /// Device address of `block` in `(layer, K=0|V=1)`'s plane, after range checks.
    pub fn block_address(&self, layer: usize, kv: usize, block: BlockId) -> Result<u64, KvError> {
        self.access.address(layer, kv, block)
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> KvError {
        KvError::Device { device: self.device().to_string(), msg: format!("{what}: {e}") }
    }

    /// The CUDA IPC handle of the pool's allocation (`cuIpcGetMemHandle`): another process on
    /// the same host opens it once and then writes the pool's blocks with device copies.
    pub fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_BYTES], KvError> {
        self.context().bind_to_thread().map_err(|e| self.error("binding the context", e))?;
        let mut h = std::mem::MaybeUninit::<cudarc::driver::sys::CUipcMemHandle>::zeroed();
        // SAFETY: `h` is a valid out-parameter; the pointer is the base of a live cuMemAlloc
        // allocation on the bound context.
        unsafe { cudarc::driver::sys::cuIpcGetMemHandle(h.as_mut_ptr(), self.base()).result() }
            .map_err(|e| self.error("exporting the KV pool (cuIpcGetMemHandle)", e))?;
        // SAFETY: initialised by the successful call above.
        let h = unsafe { h.assume_init() };
        Ok(h.reserved.map(|c| c as u8))
    }

    /// The device's UUID as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (as `nvidia-smi -L` shows
    /// it): the same physical GPU has the same UUID in every process, whatever its ordinal there.
    pub fn device_uuid(&self) -> Result<String, KvError> {
        device_uuid(self.context()).map_err(|e| self.error("reading the device UUID", e))
    }
}

/// The UUID of `ctx`'s device, formatted as `nvidia-smi -L` prints it.
pub fn device_uuid(ctx: &Arc<CudaContext>) -> Result<String, cudarc::driver::DriverError> {
    let mut u = std::mem::MaybeUninit::<cudarc::driver::sys::CUuuid>::zeroed();
    // SAFETY: `u` is a valid out-parameter; the device handle comes from a live context.
    unsafe { cudarc::driver::sys::cuDeviceGetUuid_v2(u.as_mut_ptr(), ctx.cu_device()).result() }?;
    // SAFETY: initialised by the successful call above.
    let b = unsafe { u.assume_init() }.bytes.map(|c| c as u8);
    Ok(format_uuid(&b))
}

/// `GPU-` and the 16 bytes in the 8-4-4-4-12 hex grouping.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16))
}

#[cfg(test)]
mod tests {
    #[test]
    fn uuid_is_formatted_like_nvidia_smi() {
        let b: [u8; 16] = std::array::from_fn(|i| (i * 17) as u8);
        assert_eq!(super::format_uuid(&b), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }
}
