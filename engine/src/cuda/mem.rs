//! Device memory owned by one backend instance.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, DriverError};

use super::{bind, driver_error};
use crate::error::Result;

/// One `cuMemAlloc` allocation on a given context, freed on drop. Plain `cuMemAlloc` (not a
/// stream-ordered pool) so that a buffer such as the KV pool can later be exported to another
/// process with an IPC handle.
pub(crate) struct DevBuf {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
    bytes: usize,
    what: &'static str,
}

impl DevBuf {
    /// Allocates `bytes` (at least 16) on `ctx`'s device; `what` names the buffer in errors.
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize, what: &'static str) -> Result<DevBuf> {
        let ordinal = ctx.ordinal();
        bind(ctx).map_err(|e| driver_error(ordinal, "binding the context", e))?;
        let bytes = bytes.max(16);
        // SAFETY: the context is current on this thread; the pointer is owned by the returned value
        // and freed exactly once, in Drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(|e| {
            driver_error(
                ordinal,
                &format!("allocating {what} ({:.1} MiB)", bytes as f64 / (1 << 20) as f64),
                e,
            )
        })?;
        Ok(DevBuf { ctx: ctx.clone(), ptr, bytes, what })
    }

    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The address `byte_offset` bytes into the buffer.
    pub fn at(&self, byte_offset: usize) -> CUdeviceptr {
        debug_assert!(
            byte_offset <= self.bytes,
            "{}: offset {byte_offset} past {} bytes",
            self.what,
            self.bytes
        );
        self.ptr + byte_offset as u64
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn what(&self) -> &'static str {
        self.what
    }

    /// The device ordinal the driver reports for this allocation (the device audit checks it is
    /// the backend's own).
    pub fn reported_ordinal(&self) -> Result<usize> {
        let ordinal = self.ctx.ordinal();
        let mut value: i32 = -1;
        // SAFETY: `value` is a valid i32 out-parameter, the attribute's documented type; the
        // pointer is a live allocation.
        unsafe {
            cudarc::driver::sys::cuPointerGetAttribute(
                (&mut value as *mut i32).cast(),
                cudarc::driver::sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                self.ptr,
            )
            .result()
        }
        .map_err(|e| driver_error(ordinal, "reading a pointer's device", e))?;
        Ok(value.max(0) as usize)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // Freed even if the bind fails: the driver finds the allocation's context from the
        // pointer, and a failed free is only a warning, where skipping it would leak the buffer.
        if let Err(e) = bind(&self.ctx) {
            tracing::warn!(buffer = self.what, error = %e, "binding the context to free device memory failed");
        }
        // SAFETY: `ptr` came from cuMemAlloc on this context and is freed only here.
        if let Err(e) = unsafe { cudarc::driver::result::free_sync(self.ptr) } {
            tracing::warn!(buffer = self.what, error = %e, "freeing device memory failed");
        }
    }
}

/// Page-locked host memory from one context's driver (`cuMemHostAlloc`), freed on drop: the KV
/// tiers' pages, which the copy engines read and write without staging, so that copies to and
/// from the pool run while the host goes on.
pub(crate) struct PinnedMemory {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the allocation is owned and lives until drop; access to its bytes is arbitrated by its
// user (the KV tiers' page arena hands each slot to one page at a time).
unsafe impl Send for PinnedMemory {}
// SAFETY: as above.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    /// Allocates `bytes` (at least 1) of page-locked memory on `ctx`.
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedMemory> {
        let ordinal = ctx.ordinal();
        bind(ctx).map_err(|e| driver_error(ordinal, "binding the context", e))?;
        let bytes = bytes.max(1);
        // SAFETY: the context is current on this thread; the pointer is owned by the returned
        // value and freed exactly once, in Drop. Flags 0: memory for this context's copies.
        let ptr = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }.map_err(|e| {
            driver_error(
                ordinal,
                &format!("allocating {:.1} MiB of pinned host memory", bytes as f64 / (1 << 20) as f64),
                e,
            )
        })?;
        Ok(PinnedMemory { ctx: ctx.clone(), ptr: ptr.cast::<u8>(), bytes })
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: `ptr` came from `malloc_host` and is freed once; its users (pages) are gone,
            // since they hold the arena that holds this.
            let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
        }
    }
}

impl crate::kv::HostMemory for PinnedMemory {
    fn base(&self) -> *mut u8 {
        self.ptr
    }
    fn bytes(&self) -> usize {
        self.bytes
    }
    fn kind(&self) -> &'static str {
        "pinned"
    }
}

/// Copies queued on a stream, done when the event recorded after them has passed.
pub(crate) struct StreamCopy {
    pub ctx: Arc<CudaContext>,
    pub event: cudarc::driver::CudaEvent,
}

impl crate::kv::SpillCopy for StreamCopy {
    fn wait(&self) -> std::result::Result<(), String> {
        // Through `bind`, not the event's own `synchronize`: a stale error recorded on the context
        // would make that return at once, without waiting, while the copies still run.
        bind(&self.ctx).map_err(|e| e.to_string())?;
        // SAFETY: the event is alive (owned by self) and its context is current.
        unsafe { cudarc::driver::result::event::synchronize(self.event.cu_event()) }
            .map_err(|e| e.to_string())
    }
}

/// Waits for everything queued on `stream`, binding its context first (see [`bind`]); an error
/// means the work may still be running.
pub(crate) fn wait_stream(
    ctx: &CudaContext,
    stream: &cudarc::driver::CudaStream,
) -> std::result::Result<(), DriverError> {
    bind(ctx)?;
    // SAFETY: the stream is alive (borrowed) and its context is current.
    unsafe { cudarc::driver::result::stream::synchronize(stream.cu_stream()) }
}
