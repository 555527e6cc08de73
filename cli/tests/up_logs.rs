//! `tandem up --log-level` and `--log-file`: the filter reaches the router and the workers (it is
//! their `RUST_LOG`), the children's lines go to the file with their `[name]` prefix and not to the
//! terminal, and `tandem up`'s own messages stay on the terminal. A bad filter or an unopenable
//! file is refused before anything starts.
//!
//! The cluster runs on the tiny fixture model `tests/reference/fixtures/llama-gqa`, so this needs
//! no download; the server binaries are built (or found up to date) first, next to `tandem`.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture_model() -> PathBuf {
    workspace_root().join("tests/reference/fixtures/llama-gqa")
}

/// `tandem up` runs the server binaries that sit next to it; cargo builds only `tandem` for this
/// crate's tests, so build the others into the same profile directory. `--workspace` as the e2e
/// tests do: the same feature set as a workspace build, so binaries already built are reused
/// rather than rebuilt for a different one.
fn build_server_binaries() {
    let tandem = PathBuf::from(env!("CARGO_BIN_EXE_tandem"));
    let dir = tandem.parent().expect("profile directory").to_path_buf();
    let release = dir.file_name().is_some_and(|n| n == "release");
    let out = tandem_test_support::cargo_build_bins(env!("CARGO"), &workspace_root(), release)
        .output()
        .expect("running cargo build for the server binaries");
    assert!(
        out.status.success(),
        "building the server binaries failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in ["tandem-router", "tandem-prefill", "tandem-decode"] {
        assert!(dir.join(name).is_file(), "{name} was not built in {}", dir.display());
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tandem-up-logs-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The children's lines: those starting with the `[name] ` prefix `tandem up` gives them.
fn child_lines(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| ["[router] ", "[prefill] ", "[decode] "].iter().any(|p| l.starts_with(p)))
        .collect()
}

#[test]
fn log_file_takes_the_childrens_lines_and_log_level_filters_them() {
    build_server_binaries();
    let dir = temp_dir("run");
    let log = dir.join("cluster.log");
    // Something already there stays: the file is appended to.
    std::fs::write(&log, "earlier line\n").unwrap();
    let mut up = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("up")
        .arg("--model")
        .arg(fixture_model())
        .args(["--threads", "1", "--log-level", "info,tandem_router=warn", "--log-file"])
        .arg(&log)
        // Our own filter must not leak into the children: --log-level replaces it.
        .env("RUST_LOG", "error")
        .env_remove("TANDEM_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tandem up starts");

    let (tx, rx) = mpsc::channel();
    let stdout = up.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let mut stderr = up.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });

    let ready = rx.recv_timeout(Duration::from_secs(300));
    // SAFETY: signalling our own child, which has not been waited for yet.
    unsafe {
        libc::kill(up.id() as libc::pid_t, libc::SIGINT);
    }
    let status = up.wait().unwrap();
    let terminal = err_reader.join().unwrap();
    let file = std::fs::read_to_string(&log).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();

    let ready = ready.unwrap_or_else(|_| panic!("no ready line; stderr:\n{terminal}\nlog file:\n{file}"));
    assert!(ready.starts_with("ready router="), "{ready}");
    assert!(status.success(), "tandem up exited with {status}; stderr:\n{terminal}");

    // The terminal has tandem up's own messages and none of the children's lines.
    assert!(terminal.contains("tandem up: cluster ready"), "{terminal}");
    assert!(child_lines(&terminal).is_empty(), "children's lines on the terminal:\n{terminal}");

    // The file kept what it had and gained the workers' lines, at the level asked for.
    assert!(file.starts_with("earlier line\n"), "{file}");
    let lines = child_lines(&file);
    for role in ["[prefill] ", "[decode] "] {
        assert!(
            lines.iter().any(|l| l.starts_with(role) && l.contains(" INFO ")),
            "no INFO line from {role}in the log file:\n{file}"
        );
    }
    // The router's own INFO lines were filtered out by `tandem_router=warn`, so the filter is the
    // children's, not a fixed level (and not the RUST_LOG=error of this environment either).
    assert!(
        !lines.iter().any(|l| l.starts_with("[router] ") && l.contains(" INFO tandem_router")),
        "router INFO lines despite tandem_router=warn:\n{file}"
    );
    assert!(!lines.iter().any(|l| l.contains(" DEBUG ")), "DEBUG lines at info:\n{file}");
}

#[test]
fn a_bad_log_filter_or_log_file_is_refused_before_anything_starts() {
    let dir = temp_dir("refuse");
    let unwritable = dir.join("no-such-dir").join("cluster.log");
    let cases: [(Vec<String>, &str); 2] = [
        (vec!["--log-level".into(), "tandem_router=loud".into()], "--log-level"),
        (vec!["--log-file".into(), unwritable.display().to_string()], "--log-file"),
    ];
    for (flags, needle) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .arg("up")
            .arg("--model")
            .arg(fixture_model())
            .args(&flags)
            .env_remove("TANDEM_CONFIG")
            .output()
            .unwrap();
        assert_ne!(out.status.code(), Some(0), "{flags:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{flags:?}: {err}");
        assert!(!err.contains("not found"), "refused before looking for the server binaries: {err}");
        assert!(out.stdout.is_empty(), "{flags:?}");
    }
    assert!(!unwritable.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
