//! A KV pool on a GPU as the GPU transports see it: its context, its base address and its byte
//! layout, so a transfer can copy blocks device to device (CUDA IPC, NCCL) without the engine
//! thread, and the pool can be exported to another process once. The CUDA backend makes these
//! ([`crate::cuda`]); this module only describes one and needs no backend.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::allocator::BlockId;
use super::block_io::KvBlockSource;
use super::layout::KvLayout;
use super::KvError;
use crate::Device;

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// A KV pool on its GPU: `[layers][K|V][blocks][block_size][kv_heads × head_dim]`, one
/// allocation made with the driver API (`cuMemAlloc`), so it can be shared with another process
/// through a CUDA IPC handle. Cloning shares the pool; the allocation lives as long as its owner
/// (the backend) or a clone, whichever is last.
#[derive(Clone)]
pub struct DeviceKvPool {
    ctx: Arc<CudaContext>,
    base: u64,
    bytes: usize,
    layout: KvLayout,
    _owner: Arc<dyn Send + Sync>,
}

impl std::fmt::Debug for DeviceKvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKvPool")
            .field("device", &self.device())
            .field("bytes", &self.bytes)
            .field("layout", &self.layout)
            .finish()
    }
}

impl DeviceKvPool {
    /// `bytes` bytes at `base` on `ctx`, laid out as `layout` and kept allocated by `owner`.
    pub(crate) fn new(
        ctx: Arc<CudaContext>,
        base: u64,
        bytes: usize,
        layout: KvLayout,
        owner: Arc<dyn Send + Sync>,
    ) -> DeviceKvPool {
        DeviceKvPool { ctx, base, bytes, layout, _owner: owner }
    }

    /// The context the pool was allocated on (bind it before any driver call about the pool).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.ctx.ordinal())
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Device address of the pool's first byte.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes of the allocation.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Device address of `block` in `(layer, K=0|V=1)`'s plane, after range checks.
    pub fn block_address(&self, layer: usize, kv: usize, block: BlockId) -> Result<u64, KvError> {
        Ok(self.base + self.layout.block_offset(layer, kv, block)? as u64)
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> KvError {
        KvError::Device { device: self.device().to_string(), msg: format!("{what}: {e}") }
    }

    /// The CUDA IPC handle of the pool's allocation (`cuIpcGetMemHandle`): another process on
    /// the same host opens it once and then writes the pool's blocks with device copies.
    pub fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_BYTES], KvError> {
        crate::device::bind(&self.ctx).map_err(|e| self.error("binding the context", e))?;
        let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
        // SAFETY: `h` is a valid out-parameter; the pointer is the base of a live cuMemAlloc
        // allocation on the bound context.
        unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), self.base).result() }
            .map_err(|e| self.error("exporting the KV pool (cuIpcGetMemHandle)", e))?;
        // SAFETY: initialised by the successful call above.
        let h = unsafe { h.assume_init() };
        Ok(h.reserved.map(|c| c as u8))
    }

    /// The device's UUID as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (as `nvidia-smi -L` shows
    /// it): the same physical GPU has the same UUID in every process, whatever its ordinal there.
    pub fn device_uuid(&self) -> Result<String, KvError> {
        device_uuid(self.ctx.cu_device()).map_err(|e| self.error("reading the device UUID", e))
    }
}

/// Reads blocks to the host on a stream made for the call: for tests and benchmarks (the GPU
/// transports copy on the device and only check a source's layout).
impl KvBlockSource for DeviceKvPool {
    fn source_layout(&self) -> KvLayout {
        self.layout
    }
    fn read_block_into(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), KvError> {
        let n = self.layout.block_bytes();
        if k.len() != n || v.len() != n {
            return Err(KvError::ShapeMismatch {
                what: "KV block bytes",
                expected: n,
                actual: k.len().min(v.len()),
            });
        }
        crate::device::bind(&self.ctx).map_err(|e| self.error("binding the context", e))?;
        let stream = self.ctx.new_stream().map_err(|e| self.error("creating a stream", e))?;
        for (kv, dst) in [(0, k), (1, v)] {
            let src = self.block_address(layer, kv, block)?;
            // SAFETY: `src` is one block inside the pool (range-checked); `dst` is one block
            // long and borrowed until the synchronize below.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
                .map_err(|e| self.error("reading a KV block", e))?;
        }
        stream.synchronize().map_err(|e| self.error("reading a KV block", e))
    }
}

/// The UUID of device `dev`, formatted as `nvidia-smi -L` prints it.
pub fn device_uuid(dev: sys::CUdevice) -> Result<String, cudarc::driver::DriverError> {
    let mut u = std::mem::MaybeUninit::<sys::CUuuid>::zeroed();
    // SAFETY: `u` is a valid out-parameter; the caller passes a device handle of a live driver.
    unsafe { sys::cuDeviceGetUuid_v2(u.as_mut_ptr(), dev).result() }?;
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
