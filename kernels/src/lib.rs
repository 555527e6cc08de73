//! CUDA kernel sources, addressed by name, compiled by NVRTC for the device's architecture.

mod sources;
pub use sources::SOURCES;

/// A CUDA C source file shipped with Tandem.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// Stable name used to look the module up.
    pub name: &'static str,
    /// CUDA C source text.
    pub source: &'static str,
    /// The `extern "C" __global__` functions the source defines.
    pub entries: &'static [&'static str],
}

/// Looks a kernel source up by name.
pub fn source(name: &str) -> Option<&'static KernelSource> {
    SOURCES.iter().find(|s| s.name == name)
}
