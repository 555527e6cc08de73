//! The list of kernel sources (files under `kernels/cuda/`).

use crate::KernelSource;

/// Every kernel source the CUDA backend compiles.
pub const SOURCES: &[KernelSource] = &[];
