//! Creating a backend for a device: the one place that knows every implementation of
//! [`Backend`], so the trait module depends on none of them.

use crate::backend::{Backend, BackendOptions};
use crate::cpu::CpuBackend;
use crate::cuda::CudaBackend;
use crate::error::Result;
use crate::loader::LoadedModel;
use crate::Device;

/// Creates a backend for `device`. A CUDA device that this machine lacks (no driver, no such
/// ordinal, missing CUDA libraries) is a clear error naming what is missing, never a fallback.
pub fn create_backend(device: Device, model: LoadedModel, opts: BackendOptions) -> Result<Box<dyn Backend>> {
    match device {
        Device::Cpu => Ok(Box::new(CpuBackend::new(model.config, model.weights, opts)?)),
        Device::Cuda(ordinal) => Ok(Box::new(CudaBackend::new(ordinal, model.config, model.weights, opts)?)),
    }
}
