//! CUDA kernel sources, addressed by name.
//!
//! The CUDA backend (a later change) compiles these with NVRTC for the device's architecture. Today
//! the list is empty: the CPU backend is the only backend, and its kernels live in
//! `tandem-engine::cpu`.

/// A CUDA C source file shipped with Tandem.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// Stable name used to look the module up.
    pub name: &'static str,
    /// CUDA C source text.
    pub source: &'static str,
}

/// Every kernel source the CUDA backend compiles. Empty until the CUDA backend lands.
pub const SOURCES: &[KernelSource] = &[];

/// Looks a kernel source up by name.
pub fn source(name: &str) -> Option<&'static KernelSource> {
    SOURCES.iter().find(|s| s.name == name)
}
