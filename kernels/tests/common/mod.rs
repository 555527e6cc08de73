//! How a kernels test that lacks an external tool says so. The kernels crate sits below the
//! engine, so this mirrors `tandem_test_support::skip_test` for external tools: the same
//! `SKIPPED <test>: <why>` line, the same `TANDEM_SKIP_LOG` entry, the same switch.

use std::io::Write;

/// Fails `test` when `TANDEM_REQUIRE_EXTERNAL=1`; otherwise prints `SKIPPED <test>: <why>`,
/// appends `external\t<test>\t<why>` to `$TANDEM_SKIP_LOG` when it is set, and the caller returns.
pub fn skip_external(test: &str, why: &str, fix: &str) {
    if std::env::var("TANDEM_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1") {
        panic!("{test}: {why}, and TANDEM_REQUIRE_EXTERNAL=1 requires it ({fix})");
    }
    eprintln!("SKIPPED {test}: {why}");
    if let Some(log) = std::env::var_os("TANDEM_SKIP_LOG").filter(|p| !p.is_empty()) {
        let line = format!("external\t{test}\t{}\n", why.replace(['\t', '\n'], " "));
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = appended {
            eprintln!("could not append to the skip log {}: {e}", std::path::Path::new(&log).display());
        }
    }
}
