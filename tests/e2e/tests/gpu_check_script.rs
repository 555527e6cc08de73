//! `scripts/gpu-check.sh`, the GPU session's driver, checked where it can be without a GPU: its
//! refusal of a bundle that would not fit in one device call (the working tree and the bundle
//! together, at most 64 MiB), and its options. The bundle itself is built and measured by
//! `scripts/gpu-check.sh --prebuild`, which applies the same check (figures in docs/gpu.md).

use std::fs::File;
use std::path::Path;
use std::process::{Command, Output};

use tandem_e2e::workspace_root;

fn script(args: &[&str]) -> Output {
    Command::new("bash")
        .arg(workspace_root().join("scripts/gpu-check.sh"))
        .args(args)
        .current_dir(workspace_root())
        .output()
        .expect("bash runs the script")
}

/// A file of `len` bytes (sparse: nothing is written).
fn file_of(path: &Path, len: u64) {
    File::create(path).and_then(|f| f.set_len(len)).expect("a sparse file");
}

#[test]
fn a_bundle_that_would_not_fit_in_a_device_call_is_refused() {
    let dir = std::env::temp_dir().join(format!("tandem-gpu-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let small = dir.join("small.tar.gz");
    file_of(&small, 20 << 20);
    let out = script(&["--check-fit", small.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "20 MiB and the working tree fit: {err}");
    assert!(err.contains("20.0 MiB") && err.contains("working tree") && err.contains("64.0 MiB"), "{err}");

    // 64 MiB alone leaves no room for the working tree.
    let big = dir.join("big.tar.gz");
    file_of(&big, 64 << 20);
    let out = script(&["--check-fit", big.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("does not fit"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_stages_and_options_are_refused_by_name() {
    let out = script(&["--stage", "everything"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown stage 'everything'"));
    let out = script(&["--frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown option --frobnicate"));
    let out = script(&["--check-fit", "/nonexistent/bundle.tar.gz"]);
    assert_eq!(out.status.code(), Some(2));
}
