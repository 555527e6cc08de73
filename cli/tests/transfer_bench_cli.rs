//! `tandem bench --transfer` on the tiny reference model's KV geometry: the table has a row per
//! prompt length with memcpy, the bare socket and both transports; a line per length gives the
//! time from staging to acknowledgement; and the staging lines give the time each transport's
//! sender spent staging and staging alone both ways. Figures are printed, never checked against
//! thresholds.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn transfer_bench_prints_the_table_and_the_staging_lines() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa");
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench", "--transfer", "--model"])
        .arg(&model)
        .args(["--transfer-tokens", "16,64", "--reps", "2"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("| prompt tokens | MiB | memcpy GB/s | socket GB/s | shm GB/s | tcp GB/s |"),
        "{text}"
    );
    for tokens in [16, 64] {
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("| {tokens} |")))
            .unwrap_or_else(|| panic!("{text}"));
        // Tokens, MiB, four rates, three ratios.
        assert_eq!(row.matches('|').count(), 10, "{row}");
        assert!(!row.contains(" - "), "a transport was not timed: {row}");
        let staging = text
            .lines()
            .find(|l| l.starts_with(&format!("{tokens} tokens: in shm")))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(staging.contains(", in tcp ") && staging.contains(", alone "), "{staging}");
        assert!(staging.contains("copying, then checksumming each piece"), "{staging}");
        let after = text
            .lines()
            .find(|l| l.starts_with(&format!("{tokens} tokens: shm ")))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(after.contains("% of memcpy), tcp ") && after.ends_with("% of memcpy)"), "{after}");
    }
    // The staging lines are not mistaken for table columns.
    assert!(!text.contains("copy-summed GB/s") && !text.contains("copy+sum GB/s"), "{text}");
}
