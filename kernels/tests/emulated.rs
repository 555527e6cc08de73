//! Runs the forward-pass kernels (kernels/cuda/model.cu) on the CPU: the CUDA C source is compiled
//! as C++ together with a small stand-in for CUDA's thread model (`emulated/shim.h`: one OS thread
//! per CUDA thread, barriers for `__syncthreads` and warp shuffles) and a harness
//! (`emulated/harness.cpp`) that checks each kernel against a double-precision reference: RMSNorm,
//! q/k norm, RoPE, SwiGLU, GeGLU (tanh GELU, f32 and bf16 out, saturated gates), bias, embedding
//! (bf16 and f32 tables, unscaled and scaled by sqrt(hidden)), row gather, soft-capping, paged
//! attention (in-pass and pooled K/V, GQA, sliding window, split-K, soft-capped scores; f32, bf16
//! and fp8 pools; the tensor-core prompt kernel, with `mma.m16n8k16` emulated from PTX's fragment
//! layout, for head dimensions 16 to 256 zero-padded into its variants), KV write and commit on every pool dtype, fp8 E4M3's conversions against the
//! format's definition, the fused decode kernels against the unfused ones bit for bit
//! (`add_rms_norm`, the gated activations over a fused gate/up product, `qkv_split` with and
//! without the KV write), the decode products (`gemv_*`: against double precision, and their norm
//! prologue and residual and gated epilogues against the unfused kernels bit for bit), a decode
//! step's mixture of experts over routed experts only (against one expert at a time, bit for bit), the greedy pick's NaN/inf/tie rules, a mixture of experts' routing (softmax,
//! top-k with ties to the lower index, renormalization) and weighted accumulation, and LoRA's
//! grouped shrink and expand (several adapters and ranks in one pass, f32 and bf16 inputs, tokens
//! without an adapter or whose adapter lacks the target left untouched).
//!
//! This checks the kernels' index math and arithmetic without a GPU; it cannot catch what only a
//! GPU shows (memory model, launch limits, speed). Needs a C++20 compiler (`g++`, or `$CXX`);
//! without one the test is skipped with a message, unless TANDEM_REQUIRE_EXTERNAL=1.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn compiler() -> Option<String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    Command::new(&cxx).arg("--version").output().ok().filter(|o| o.status.success()).map(|_| cxx)
}

#[test]
fn kernels_match_double_precision_references_on_the_cpu() {
    let Some(cxx) = compiler() else {
        common::skip_external(
            "kernels_match_double_precision_references_on_the_cpu",
            "no C++ compiler (g++ or $CXX) to run the kernels on the CPU",
            "install g++ or set CXX",
        );
        return;
    };
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("emulated-kernels");
    std::fs::create_dir_all(&work).unwrap();

    // The one CUDA-only construct the shim cannot define away: dynamic shared memory.
    let src = tandem_kernels::source("model").expect("the model kernels").source;
    let decl = "extern __shared__ u32x4 sm_dyn[];";
    assert_eq!(src.matches(decl).count(), 1, "model.cu should declare its dynamic shared memory once");
    let emulated = work.join("model_emulated.cu");
    std::fs::write(&emulated, src.replace(decl, "#define sm_dyn ((u32x4*)g_dyn_shared.data())")).unwrap();

    let exe = work.join("harness");
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-fno-strict-aliasing", "-pthread", "-Wno-unknown-pragmas"])
        .arg(format!("-I{}", here.join("tests/emulated").display()))
        .arg(format!("-DMODEL_CU=\"{}\"", emulated.display()))
        .arg(here.join("tests/emulated/harness.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(out.status.success(), "compiling the harness failed:\n{}", String::from_utf8_lossy(&out.stderr));

    let run = Command::new(&exe).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    eprintln!("{stdout}");
    assert!(
        run.status.success(),
        "kernel checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let checks = stdout.lines().filter(|l| l.starts_with("ok ")).count();
    assert!(checks >= 30, "only {checks} checks ran:\n{stdout}");
    assert!(stdout.contains("0 failed"), "{stdout}");
}
