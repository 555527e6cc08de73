//! Shared by the engine's test files: the device a test body runs on.
//!
//! `device_test!(name, body)` instantiates `name::cpu` and `name::cuda` from one body taking a
//! [`Device`]. The CUDA instance skips with a `SKIPPED` line when cuda:0 is unusable, and fails
//! instead under `TANDEM_REQUIRE_GPU=1` (scripts/gpu-check.sh sets it).
#![allow(dead_code)]

use tandem_engine::backend::ComputeDtype;
use tandem_engine::kv::KvLayout;
use tandem_engine::Device;

/// `Some(0)` when cuda:0 is usable; otherwise reports why `test` is skipped (or fails it, when a
/// GPU is required) and returns None.
pub fn gpu(test: &str) -> Option<usize> {
    tandem_test_support::gpu_for_test(test, 0, tandem_engine::cuda::probe(0)).then_some(0)
}

/// How far a device's results may be from exact: the CPU backend is bit-for-bit deterministic;
/// CUDA kernels pick other reduction orders for other batch shapes.
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    /// Max abs difference of K/V values (f32).
    pub kv: f32,
    /// Max abs difference of logits.
    pub logits: f32,
}

pub fn tolerance(device: Device) -> Tolerance {
    match device {
        Device::Cpu => Tolerance { kv: 0.0, logits: 0.0 },
        Device::Cuda(_) => Tolerance { kv: 1e-4, logits: 1e-3 },
    }
}

/// The compute dtypes a device is checked in: the CPU computes in f32 only.
pub fn dtypes(device: Device) -> &'static [ComputeDtype] {
    match device {
        Device::Cpu => &[ComputeDtype::F32],
        Device::Cuda(_) => &[ComputeDtype::F32, ComputeDtype::Bf16],
    }
}

/// Asserts `got` is within `tol` of `want` element by element (bit-equal when `tol` is 0).
pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if tol == 0.0 {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i}: {g} vs {w}");
        }
        return;
    }
    let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err <= tol, "{what}: differs by {err} (tolerance {tol})");
}

/// The values of a K or V block (or row) of a pool of `layout`, as f32.
pub fn f32s(layout: &KvLayout, bytes: &[u8]) -> Vec<f32> {
    layout.dtype.decode(bytes)
}

/// One test body, run on the CPU (`name::cpu`) and on cuda:0 (`name::cuda`).
#[allow(unused_macros)]
macro_rules! device_test {
    ($(#[$meta:meta])* $name:ident, $body:ident) => {
        $(#[$meta])*
        mod $name {
            #[test]
            fn cpu() {
                super::$body(tandem_engine::Device::Cpu);
            }

            #[test]
            fn cuda() {
                if let Some(ordinal) = crate::common::gpu(concat!(stringify!($name), "::cuda")) {
                    super::$body(tandem_engine::Device::Cuda(ordinal));
                }
            }
        }
    };
}
