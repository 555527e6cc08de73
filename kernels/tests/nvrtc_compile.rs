//! Every kernel source compiles with NVRTC for sm_80 and sm_90 and defines exactly the entries it
//! declares; compile errors name the source and carry NVRTC's log; the PTX cache round-trips.
//!
//! NVRTC needs no GPU. Without libnvrtc.so.13 on the library path these tests skip with a message,
//! unless TANDEM_REQUIRE_EXTERNAL=1 (scripts/test.sh sets it and puts the library from
//! scripts/fetch-nvrtc.sh on LD_LIBRARY_PATH), where they fail.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use tandem_kernels::{
    compile_ptx, nvrtc_available, nvrtc_version, KernelError, KernelSource, PtxCache, SOURCES,
};

const ARCHS: [(u32, u32); 2] = [(8, 0), (9, 0)];

/// A small header-free source like the shipped ones, so the compile path is checked whatever
/// SOURCES holds: a device helper (not an entry), bf16 rounding through inline PTX, two entries.
const CHECK: KernelSource = KernelSource {
    name: "nvrtc_check",
    source: r#"
__device__ float fma_one(float a, float x, float y) { return a * x + y; }

extern "C" __global__ void axpy_f32(int n, float a, const float* x, float* y) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fma_one(a, x[i], y[i]);
}

extern "C" __global__ void round_bf16(int n, const float* x, unsigned short* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned short r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x[i]));
        out[i] = r;
    }
}
"#,
    entries: &["axpy_f32", "round_bf16"],
};

/// Does not compile: an undefined identifier on line 3.
const BROKEN: KernelSource = KernelSource {
    name: "nvrtc_broken",
    source: "extern \"C\" __global__ void broken(float* out) {
    int i = threadIdx.x;
    out[i] = missing_value;
}
",
    entries: &["broken"],
};

fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc_available() {
        return true;
    }
    common::skip_external(
        test,
        "libnvrtc.so.13 not found",
        "scripts/fetch-nvrtc.sh fetches it; put the directory it prints on LD_LIBRARY_PATH",
    );
    // Without the library, compiling is a typed error, never a panic.
    assert!(matches!(compile_ptx(&CHECK, (8, 0)), Err(KernelError::NvrtcMissing)));
    false
}

/// The names of the kernels a PTX module defines (`.entry name(` lines).
fn ptx_entries(ptx: &str) -> BTreeSet<String> {
    ptx.lines()
        .filter_map(|line| line.split_once(".entry ").map(|(_, rest)| rest))
        .map(|rest| rest.split(|c: char| c == '(' || c.is_whitespace()).next().unwrap_or("").to_string())
        .collect()
}

/// Compiles `src` for `arch` and checks the target and the entries; the error says what differs.
fn check_source(src: &KernelSource, arch: (u32, u32)) -> Result<(), String> {
    let ptx = compile_ptx(src, arch).map_err(|e| e.to_string())?;
    let target = format!(".target sm_{}{}", arch.0, arch.1);
    if !ptx.contains(&target) {
        return Err(format!("{} for {arch:?}: PTX lacks `{target}`", src.name));
    }
    let found = ptx_entries(&ptx);
    let declared: BTreeSet<String> = src.entries.iter().map(|e| e.to_string()).collect();
    if found != declared {
        let missing: Vec<_> = declared.difference(&found).collect();
        let undeclared: Vec<_> = found.difference(&declared).collect();
        return Err(format!(
            "{} for {arch:?}: declared entries missing from the PTX: {missing:?}; entries not declared: \
             {undeclared:?}",
            src.name
        ));
    }
    Ok(())
}

/// Each entry's PTX body, by name (from its `.entry` line to the next one).
fn entry_bodies(ptx: &str) -> Vec<(String, &str)> {
    let starts: Vec<usize> = ptx.match_indices(".entry ").map(|(i, _)| i).collect();
    starts
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let body = &ptx[i..starts.get(k + 1).copied().unwrap_or(ptx.len())];
            (ptx_entries(body).into_iter().next().unwrap_or_default(), body)
        })
        .collect()
}

/// The backend launches every model kernel with programmatic stream serialization on sm_90 and
/// later, which is safe only if each one waits for its predecessor before touching memory:
/// every entry compiled for sm_90 holds `griddepcontrol.wait` (and `launch_dependents`), and
/// none compiled for sm_80 does (the instruction does not exist there).
#[test]
fn every_model_kernel_waits_for_its_predecessor_on_sm90() {
    if !nvrtc_or_skip("every_model_kernel_waits_for_its_predecessor_on_sm90") {
        return;
    }
    let src = tandem_kernels::source("model").expect("the model kernels");
    let ptx90 = compile_ptx(src, (9, 0)).unwrap();
    let bodies = entry_bodies(&ptx90);
    assert_eq!(bodies.len(), src.entries.len(), "one body per entry");
    let missing: Vec<&str> = bodies
        .iter()
        .filter(|(_, b)| {
            !b.contains("griddepcontrol.wait") || !b.contains("griddepcontrol.launch_dependents")
        })
        .map(|(n, _)| n.as_str())
        .collect();
    assert!(missing.is_empty(), "kernels that do not wait for their predecessor on sm_90: {missing:?}");
    let ptx80 = compile_ptx(src, (8, 0)).unwrap();
    assert!(!ptx80.contains("griddepcontrol"), "sm_80 has no programmatic dependent launch");
}

#[test]
fn every_source_compiles_for_sm80_and_sm90_with_exactly_its_entries() {
    if !nvrtc_or_skip("every_source_compiles_for_sm80_and_sm90_with_exactly_its_entries") {
        return;
    }
    let (major, minor) = nvrtc_version().unwrap();
    assert!(major >= 12, "NVRTC {major}.{minor}");
    let mut failures = Vec::new();
    for src in SOURCES.iter().chain([&CHECK]) {
        for arch in ARCHS {
            if let Err(e) = check_source(src, arch) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n\n"));
}

#[test]
fn source_names_and_entries_are_unique() {
    let names: BTreeSet<&str> = SOURCES.iter().map(|s| s.name).collect();
    assert_eq!(names.len(), SOURCES.len(), "duplicate source names");
    for src in SOURCES {
        let entries: BTreeSet<&str> = src.entries.iter().copied().collect();
        assert_eq!(entries.len(), src.entries.len(), "{}: duplicate entries", src.name);
        assert!(!src.entries.is_empty(), "{}: no entries declared", src.name);
        assert_eq!(tandem_kernels::source(src.name).map(|s| s.source), Some(src.source));
    }
    assert!(tandem_kernels::source("no such source").is_none());
}

#[test]
fn undeclared_and_missing_entries_are_reported() {
    if !nvrtc_or_skip("undeclared_and_missing_entries_are_reported") {
        return;
    }
    let fewer = KernelSource { entries: &["axpy_f32"], ..CHECK };
    let err = check_source(&fewer, (8, 0)).unwrap_err();
    assert!(err.contains("entries not declared: [\"round_bf16\"]"), "{err}");
    let more = KernelSource { entries: &["axpy_f32", "round_bf16", "ghost"], ..CHECK };
    let err = check_source(&more, (8, 0)).unwrap_err();
    assert!(err.contains("missing from the PTX: [\"ghost\"]"), "{err}");
}

#[test]
fn compile_error_names_source_and_arch_and_carries_the_log() {
    if !nvrtc_or_skip("compile_error_names_source_and_arch_and_carries_the_log") {
        return;
    }
    let err = compile_ptx(&BROKEN, (9, 0)).unwrap_err();
    let KernelError::Compile { name, arch, log } = &err else { panic!("not a compile error: {err:?}") };
    assert_eq!((name.as_str(), *arch), ("nvrtc_broken", (9, 0)));
    // NVRTC's own diagnostic, with the program name and the line.
    assert!(log.contains("nvrtc_broken.cu(3)") && log.contains("missing_value"), "{log}");
    let shown = err.to_string();
    assert!(shown.contains("`nvrtc_broken`") && shown.contains("compute_90") && shown.contains(log.as_str()));
    assert_eq!(err.kind(), "kernel_compile");

    // An architecture NVRTC does not support is a compile error too, not a panic.
    let err = compile_ptx(&CHECK, (3, 0)).unwrap_err();
    assert!(matches!(&err, KernelError::Compile { arch: (3, 0), log, .. } if !log.is_empty()), "{err:?}");
}

#[test]
fn cache_round_trips_and_recompiles_a_corrupt_entry() {
    if !nvrtc_or_skip("cache_round_trips_and_recompiles_a_corrupt_entry") {
        return;
    }
    let dir: PathBuf = std::env::temp_dir().join(format!("tandem-nvrtc-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = PtxCache::new(&dir);
    let direct = compile_ptx(&CHECK, (9, 0)).unwrap();

    let first = cache.get_or_compile(&CHECK, (9, 0)).unwrap();
    assert_eq!(first, direct);
    let entry = cache.entry_path(&CHECK, (9, 0)).unwrap();
    assert!(entry.starts_with(&dir) && entry.is_file(), "{entry:?}");
    let second = cache.get_or_compile(&CHECK, (9, 0)).unwrap();
    assert_eq!(second, direct);
    let stats = cache.stats();
    assert_eq!((stats.compiled, stats.hits), (1, 1), "{stats:?}");

    // A second cache over the directory (as in the next process) hits as well.
    let again = PtxCache::new(&dir);
    assert_eq!(again.get_or_compile(&CHECK, (9, 0)).unwrap(), direct);
    assert_eq!((again.stats().compiled, again.stats().hits), (0, 1));

    // A damaged entry is compiled again and rewritten.
    let sound = std::fs::read(&entry).unwrap();
    std::fs::write(&entry, &sound[..sound.len() / 2]).unwrap();
    assert_eq!(cache.get_or_compile(&CHECK, (9, 0)).unwrap(), direct);
    let stats = cache.stats();
    assert_eq!((stats.compiled, stats.hits, stats.corrupt), (2, 1, 1), "{stats:?}");
    assert_eq!(std::fs::read(&entry).unwrap(), sound);
    assert_eq!(cache.get_or_compile(&CHECK, (9, 0)).unwrap(), direct);
    assert_eq!(cache.stats().hits, 2);

    // Another architecture is another entry, not a hit.
    assert_ne!(cache.entry_path(&CHECK, (8, 0)).unwrap(), entry);
    let sm80 = cache.get_or_compile(&CHECK, (8, 0)).unwrap();
    assert!(sm80.contains(".target sm_80"));
    assert_eq!(cache.stats().compiled, 3);

    // A compile error is returned through the cache and leaves no entry behind.
    let before = std::fs::read_dir(&dir).unwrap().count();
    assert!(matches!(cache.get_or_compile(&BROKEN, (8, 0)), Err(KernelError::Compile { .. })));
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), before);
    std::fs::remove_dir_all(&dir).unwrap();
}
