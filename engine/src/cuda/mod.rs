//! The CUDA backend: one instance drives exactly the GPU it was created for.
//!
//! Device discipline (the bugs this prevents are listed in the design notes): an instance creates
//! its own handle on device N's context, its own stream, cuBLAS handle and kernel module, and binds
//! its context explicitly at the top of every method that touches the GPU, so the thread it runs on
//! and whatever another instance did on that thread never matter. Every buffer (weights, RoPE
//! tables, KV pool, staging, workspaces) is allocated by the instance on its device and freed by
//! it; nothing is cached process-wide and `CUDA_VISIBLE_DEVICES` is never consulted.
//!
//! CUDA libraries are loaded at run time (cudarc's dynamic loading, CUDA 13 API): the workspace
//! builds and runs without a toolkit or a driver, and asking for a GPU where there is none is a
//! clear error from [`probe`] rather than a panic inside the loader.
//!
//! Numerics: weights are dequantized on the host at load (GGUF quantized types included) and kept
//! on the device as bf16 ([`ComputeDtype::Bf16`], the default: tensor-core GEMMs through cuBLAS
//! with f32 accumulation) or f32 ([`ComputeDtype::F32`]: matches the CPU backend). The residual
//! stream, norms, RoPE, attention and the KV pool are f32 in both modes, so a KV block has the same
//! bytes layout as on the CPU backend and transfers between CPU and GPU workers need no conversion.

mod backend;
mod device_pool;
mod mem;
mod sink;

pub use crate::device::bind;
pub use crate::kv::device::{format_uuid, DeviceKvPool, IPC_HANDLE_BYTES};
pub use backend::CudaBackend;
pub use device_pool::allocate_kv_pool;

use std::sync::Arc;

use cudarc::driver::{CudaContext, DriverError};

use crate::backend::ComputeDtype;
use crate::error::{EngineError, Result};
use crate::Device;

/// What [`probe`] found out about one GPU.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// `(major, minor)`, e.g. `(9, 0)` for an H100.
    pub compute_capability: (u32, u32),
    pub total_memory: usize,
    pub free_memory: usize,
    pub multiprocessors: usize,
}

fn device_error(ordinal: usize, msg: impl Into<String>) -> EngineError {
    EngineError::Device { device: Device::Cuda(ordinal), msg: msg.into() }
}

pub(crate) fn driver_error(ordinal: usize, what: &str, e: DriverError) -> EngineError {
    device_error(ordinal, format!("{what}: {e}"))
}

/// Whether the CUDA driver library can be loaded at all on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library under its usual names; nothing is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Checks that `cuda:<ordinal>` can be used and describes it. Every failure names what is
/// missing: no driver, no device with that ordinal, or a driver that cannot start.
pub fn probe(ordinal: usize) -> Result<DeviceInfo> {
    check_device(ordinal)?;
    let ctx = CudaContext::new(ordinal).map_err(|e| driver_error(ordinal, "creating a context", e))?;
    describe(&ctx)
}

/// The checks of [`probe`] that need no context: a loadable driver that starts, and a device
/// with this ordinal.
pub(crate) fn check_device(ordinal: usize) -> Result<()> {
    if !driver_present() {
        return Err(device_error(
            ordinal,
            "no NVIDIA driver on this machine (the CUDA driver library libcuda.so cannot be loaded), \
             so there is no GPU to run on; use --device cpu",
        ));
    }
    cudarc::driver::result::init().map_err(|e| {
        driver_error(ordinal, "the CUDA driver failed to start (is a GPU visible to this process?)", e)
    })?;
    let count = CudaContext::device_count().map_err(|e| driver_error(ordinal, "counting CUDA devices", e))?;
    if ordinal >= count.max(0) as usize {
        return Err(device_error(
            ordinal,
            format!("no such device: this machine has {count} CUDA device(s), numbered from 0"),
        ));
    }
    Ok(())
}

pub(crate) fn describe(ctx: &Arc<CudaContext>) -> Result<DeviceInfo> {
    let ordinal = ctx.ordinal();
    let err = |what: &'static str| move |e| driver_error(ordinal, what, e);
    let (major, minor) = ctx.compute_capability().map_err(err("reading the compute capability"))?;
    let (free_memory, total_memory) = ctx.mem_get_info().map_err(err("reading free memory"))?;
    let sms = ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(err("reading the multiprocessor count"))?;
    Ok(DeviceInfo {
        ordinal,
        name: ctx.name().map_err(err("reading the device name"))?,
        compute_capability: (major as u32, minor as u32),
        total_memory,
        free_memory,
        multiprocessors: sms.max(1) as usize,
    })
}

/// Checks the CUDA libraries a backend needs besides the driver (cuBLAS for the matrix products,
/// NVRTC for the kernels), naming the one that is missing.
pub(crate) fn check_libraries(ordinal: usize) -> Result<()> {
    // SAFETY: only tries to dlopen the library under its usual names.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(device_error(
            ordinal,
            "cuBLAS (libcublas.so.13) cannot be loaded: install the CUDA 13 cuBLAS library (toolkit, \
             or PyPI nvidia-cublas) and put it on LD_LIBRARY_PATH",
        ));
    }
    if !tandem_kernels::nvrtc_available() {
        return Err(device_error(
            ordinal,
            "NVRTC (libnvrtc.so.13) cannot be loaded, so the kernels cannot be compiled: install the \
             CUDA 13 NVRTC library (toolkit, or PyPI nvidia-cuda-nvrtc) and put it on LD_LIBRARY_PATH",
        ));
    }
    Ok(())
}

/// Device-to-device copy rate of `cuda:<ordinal>` in bytes per second, counting each byte copied
/// once. A copy reads and writes every byte, so the memory traffic it sustains is twice this
/// figure; a step that only reads `B` bytes is bounded by `B / (2 × rate)`. Measured with 256 MiB
/// buffers, after a warm-up copy, over 20 copies timed with events.
pub fn copy_bandwidth(ordinal: usize) -> Result<f64> {
    probe(ordinal)?;
    let ctx = CudaContext::new(ordinal).map_err(|e| driver_error(ordinal, "creating a context", e))?;
    let err = |what: &'static str| move |e| driver_error(ordinal, what, e);
    bind(&ctx).map_err(err("binding the context"))?;
    let stream = ctx.new_stream().map_err(err("creating a stream"))?;
    const BYTES: usize = 256 << 20;
    const ITERS: usize = 20;
    let src = mem::DevBuf::alloc(&ctx, BYTES, "bandwidth source")?;
    let dst = mem::DevBuf::alloc(&ctx, BYTES, "bandwidth destination")?;
    let copy = || {
        // SAFETY: both buffers are live allocations of BYTES bytes on this context.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst.ptr(), src.ptr(), BYTES, stream.cu_stream()) }
    };
    copy().map_err(err("copying"))?;
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = ctx.new_event(flags).map_err(err("creating an event"))?;
    let end = ctx.new_event(flags).map_err(err("creating an event"))?;
    start.record(&stream).map_err(err("recording an event"))?;
    for _ in 0..ITERS {
        copy().map_err(err("copying"))?;
    }
    end.record(&stream).map_err(err("recording an event"))?;
    end.synchronize().map_err(err("waiting for the copies"))?;
    let ms = start.elapsed_ms(&end).map_err(err("reading the timer"))?;
    Ok((BYTES * ITERS) as f64 / (ms as f64 / 1e3))
}

/// Bytes per element of the matrix operands in `dtype`.
pub(crate) fn dtype_bytes(dtype: ComputeDtype) -> usize {
    match dtype {
        ComputeDtype::Bf16 => 2,
        ComputeDtype::F32 => 4,
    }
}
