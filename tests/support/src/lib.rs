//! What tests do when something they need is missing: a real model in the model cache (the
//! default model, Gemma 3 270M), a GPU, an external tool. A test skips visibly, or fails when the
//! prerequisite's switch (`TANDEM_REQUIRE_MODEL`, `TANDEM_REQUIRE_GPU`, `TANDEM_REQUIRE_EXTERNAL`)
//! is `1`. A skip prints one line
//! `SKIPPED <test>: <why>` on stderr and, when `TANDEM_SKIP_LOG` names a file, appends
//! `<kind>\t<test>\t<why>` to it, so a test run can say what it skipped even though cargo hides
//! the output of passing tests (`scripts/test.sh` counts them in its last line).
//!
//! This crate is a dev-dependency only: no library's API carries test helpers (the layering test
//! checks it).

use std::io::Write;
use std::path::{Path, PathBuf};

#[cfg(test)]
use tandem_model::cache::DEFAULT_MODEL_FILE;
use tandem_model::cache::{default_model_path, model_dir};

/// The default model for `test`: its path when the file exists. When it does not, the test is
/// skipped (None, after a `SKIPPED` line), or fails when `TANDEM_REQUIRE_MODEL=1`.
pub fn default_model_for_test(test: &str) -> Option<PathBuf> {
    let path = default_model_path();
    model_for_test(test, path, Prerequisite::Model.required(), skip_log().as_deref())
}

/// A real model other than the default, `file` in the model cache (Gemma 3 270M, which
/// `scripts/fetch-gemma.sh` fetches and `scripts/test.sh` fetches with the default model), for
/// `test`: its path when the file exists. When it does not, the test is skipped (None, after a
/// `SKIPPED` line), or fails when `TANDEM_REQUIRE_MODEL=1`, as for the default model.
pub fn cached_model_for_test(test: &str, file: &str) -> Option<PathBuf> {
    model_for_test(test, model_dir().join(file), Prerequisite::Model.required(), skip_log().as_deref())
}

/// Something a test needs that a machine may lack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prerequisite {
    /// A real model in the model cache (`scripts/fetch-model.sh`, `scripts/fetch-gemma.sh`).
    Model,
    /// A usable CUDA device.
    Gpu,
    /// A program or environment outside the workspace: the Python test environment, NVRTC, a
    /// C++ compiler, systemd-analyze.
    External,
}

impl Prerequisite {
    /// The environment variable that, set to `1`, turns a missing prerequisite into a failure.
    pub fn switch(self) -> &'static str {
        match self {
            Prerequisite::Model => "TANDEM_REQUIRE_MODEL",
            Prerequisite::Gpu => "TANDEM_REQUIRE_GPU",
            Prerequisite::External => "TANDEM_REQUIRE_EXTERNAL",
        }
    }

    /// The kind written to the skip log (`model`, `gpu`, `external`).
    pub fn kind(self) -> &'static str {
        match self {
            Prerequisite::Model => "model",
            Prerequisite::Gpu => "gpu",
            Prerequisite::External => "external",
        }
    }

    /// Whether the switch is set.
    pub fn required(self) -> bool {
        std::env::var(self.switch()).is_ok_and(|v| v == "1")
    }
}

/// Reports that `test` cannot run because `why` (`fix`: how to provide what is missing). Panics
/// when the prerequisite is required; otherwise prints `SKIPPED <test>: <why>` and logs the skip,
/// and the caller returns.
pub fn skip_test(need: Prerequisite, test: &str, why: &str, fix: &str) {
    skip_or_fail(need, test, why, fix, need.required(), skip_log().as_deref());
}

/// Whether `cuda:<ordinal>` is usable for `test`, given what probing it returned
/// (`tandem_engine::cuda::probe(ordinal)`; passed in so that this crate links no engine); when it
/// is not, reports the skip as [`skip_test`] does (a failure under `TANDEM_REQUIRE_GPU=1`) and
/// returns false.
pub fn gpu_for_test<T, E: std::fmt::Display>(test: &str, ordinal: usize, probe: Result<T, E>) -> bool {
    match probe {
        Ok(_) => true,
        Err(e) => {
            let why = format!("no usable cuda:{ordinal} ({e})");
            skip_test(Prerequisite::Gpu, test, &why, "run it on a machine with an NVIDIA GPU");
            false
        }
    }
}

fn skip_log() -> Option<PathBuf> {
    std::env::var_os("TANDEM_SKIP_LOG").filter(|p| !p.is_empty()).map(PathBuf::from)
}

fn model_for_test(test: &str, path: PathBuf, required: bool, log: Option<&Path>) -> Option<PathBuf> {
    if path.is_file() {
        return Some(path);
    }
    let why = format!("model missing ({})", path.display());
    let fix = if path.file_name().is_some_and(|f| f.to_string_lossy().starts_with("gemma")) {
        "run scripts/fetch-gemma.sh"
    } else {
        "run scripts/fetch-model.sh"
    };
    skip_or_fail(Prerequisite::Model, test, &why, fix, required, log);
    None
}

fn skip_or_fail(need: Prerequisite, test: &str, why: &str, fix: &str, required: bool, log: Option<&Path>) {
    if required {
        panic!("{test}: {why}, and {}=1 requires it ({fix})", need.switch());
    }
    eprintln!("SKIPPED {test}: {why}");
    if let Some(log) = log {
        // One short append per skip: concurrent test processes each add whole lines.
        let line = format!("{}\t{test}\t{}\n", need.kind(), why.replace(['\t', '\n'], " "));
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = appended {
            eprintln!("could not append to the skip log {}: {e}", log.display());
        }
    }
}

/// A `cargo build --workspace --bins` command, from inside a test, for the server binaries a
/// test runs (`cargo` is the `CARGO` cargo gave the test; `release` for a test built in release
/// mode).
///
/// Cargo gives a test process its package's variables (`CARGO_MANIFEST_DIR`, `CARGO_PKG_NAME`,
/// ...), and a dependency's build script (ring's) reruns when they change: left in place, each
/// test package's build would rebuild the TLS stack and everything above it, once per package,
/// and undo the last one's. Without them every test's build is the one a plain
/// `cargo build --workspace --bins` in the same shell does, and after the first it does nothing.
pub fn cargo_build_bins(cargo: &str, root: &Path, release: bool) -> std::process::Command {
    let mut cmd = std::process::Command::new(cargo);
    cmd.args(["build", "--workspace", "--bins"]).current_dir(root);
    if release {
        cmd.arg("--release");
    }
    let per_package =
        ["CARGO_MANIFEST_", "CARGO_PKG_", "CARGO_CRATE_", "CARGO_BIN_", "CARGO_PRIMARY_PACKAGE"];
    for (name, _) in std::env::vars_os() {
        let n = name.to_string_lossy();
        if per_package.iter().any(|p| n.starts_with(p)) || n == "CARGO_TARGET_TMPDIR" {
            cmd.env_remove(&name);
        }
    }
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tandem-model-cache-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_present_model_is_returned_and_nothing_is_logged() {
        let dir = scratch("present");
        let model = dir.join(DEFAULT_MODEL_FILE);
        std::fs::write(&model, b"GGUF").unwrap();
        let log = dir.join("skips.log");
        for required in [false, true] {
            assert_eq!(model_for_test("t", model.clone(), required, Some(&log)), Some(model.clone()));
        }
        assert!(!log.exists(), "a test that runs logs no skip");
    }

    #[test]
    fn a_missing_model_skips_with_one_logged_line() {
        let dir = scratch("skip");
        let model = dir.join(DEFAULT_MODEL_FILE);
        let log = dir.join("skips.log");
        assert_eq!(model_for_test("parity_tiny", model.clone(), false, Some(&log)), None);
        assert_eq!(model_for_test("parity_smollm2", model.clone(), false, Some(&log)), None);
        let text = std::fs::read_to_string(&log).unwrap();
        let want = format!(
            "model\tparity_tiny\tmodel missing ({0})\nmodel\tparity_smollm2\tmodel missing ({0})\n",
            model.display()
        );
        assert_eq!(text, want);
        // A directory where the file should be is not a model either.
        std::fs::create_dir_all(&model).unwrap();
        assert_eq!(model_for_test("t", model, false, None), None);
    }

    #[test]
    fn a_missing_model_fails_when_required_naming_the_path_and_the_fetch_script() {
        let dir = scratch("required");
        let model = dir.join(DEFAULT_MODEL_FILE);
        let log = dir.join("skips.log");
        let panic = std::panic::catch_unwind(|| model_for_test("needs_it", model.clone(), true, Some(&log)))
            .expect_err("a required model that is missing must fail the test");
        let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("needs_it"), "{msg}");
        assert!(msg.contains(&model.display().to_string()), "{msg}");
        assert!(msg.contains("scripts/fetch-model.sh"), "{msg}");
        assert!(msg.contains("TANDEM_REQUIRE_MODEL=1"), "{msg}");
        assert!(!log.exists(), "a failure is not a skip");
    }

    #[test]
    fn every_prerequisite_has_its_own_switch_and_kind() {
        let all = [Prerequisite::Model, Prerequisite::Gpu, Prerequisite::External];
        let switches: std::collections::BTreeSet<_> = all.iter().map(|p| p.switch()).collect();
        let kinds: std::collections::BTreeSet<_> = all.iter().map(|p| p.kind()).collect();
        assert_eq!((switches.len(), kinds.len()), (3, 3));
        let dir = scratch("kinds");
        let log = dir.join("skips.log");
        skip_or_fail(Prerequisite::Gpu, "g", "no usable GPU:\tdriver\nmissing", "", false, Some(&log));
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "gpu\tg\tno usable GPU: driver missing\n");
    }
}
