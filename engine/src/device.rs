//! Devices are values. Every allocation names the device it lives on; there is no process-wide
//! "current device" anywhere in the engine. The one place a thread's current CUDA context is set
//! is [`bind`], which every GPU path calls with the context it is about to use.

use std::fmt;
use std::str::FromStr;

use cudarc::driver::{CudaContext, DriverError};

/// Where a backend instance keeps its weights, RoPE tables and KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory, computed on the CPU.
    Cpu,
    /// CUDA device with the given ordinal (not yet implemented by any backend).
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("cpu") {
            return Ok(Device::Cpu);
        }
        if let Some(n) = s.strip_prefix("cuda:") {
            return n
                .parse()
                .map(Device::Cuda)
                .map_err(|_| format!("invalid CUDA ordinal in device {s:?} (expected cuda:N)"));
        }
        Err(format!("unknown device {s:?} (expected \"cpu\" or \"cuda:N\")"))
    }
}

/// Makes `ctx` current on the calling thread. Use this, never `CudaContext::bind_to_thread`
/// directly (it is re-exported as `cuda::bind`).
///
/// cudarc's `bind_to_thread` first returns, and clears, an error that an earlier call recorded on
/// the context where it could not return one (a `Drop` of a stream, an event or a buffer), and in
/// that case does not bind. Its first failure may therefore be stale and unrelated to the caller,
/// and the context is then not current. A second call finds the error cleared and binds, so its
/// result is the real one; the stale error is logged, not lost.
///
/// It lives here rather than in `cuda` because the KV module's GPU pool binds too, and `cuda`
/// already depends on `kv`.
pub fn bind(ctx: &CudaContext) -> Result<(), DriverError> {
    if let Err(stale) = ctx.bind_to_thread() {
        tracing::debug!(
            device = ctx.ordinal(),
            error = %stale,
            "binding a CUDA context reported an earlier error; binding again"
        );
        return ctx.bind_to_thread();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert!("cuda:x".parse::<Device>().is_err());
        assert!("gpu".parse::<Device>().is_err());
    }
}
