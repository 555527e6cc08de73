//! Third-party programs the tests drive: the Python clients and validators of `tests/e2e/py`
//! (run with the interpreter of `TANDEM_PYTHON`, the environment `scripts/py-env.sh` builds) and
//! system tools such as `systemd-analyze`.
//!
//! A test whose tool is missing prints `SKIPPED <test>: <why>` and returns, unless
//! `TANDEM_REQUIRE_EXTERNAL=1` (set by `scripts/test.sh`, so CI never skips silently): then it
//! fails (see `tandem_test_support::skip_test`). Every program runs under a time limit,
//! with its output captured in files so a chatty child can never block on a full pipe.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_test_support::{skip_test, Prerequisite};

/// Whether a missing external tool fails the test (`TANDEM_REQUIRE_EXTERNAL=1`).
pub fn require_external() -> bool {
    Prerequisite::External.required()
}

/// Reports that `test` lacks an external tool: a failure under `TANDEM_REQUIRE_EXTERNAL=1`,
/// otherwise a `SKIPPED` line (the caller returns).
pub fn missing(test: &str, what: &str) {
    skip_test(Prerequisite::External, test, what, "scripts/test.sh sets it up");
}

/// Whether NIXL's libraries are there for `--transport nixl` (`TANDEM_NIXL_LIB`, which
/// scripts/test.sh sets from scripts/fetch-nixl.sh; the workers inherit it); false after saying
/// why (a failure under `TANDEM_REQUIRE_EXTERNAL=1`).
pub fn nixl_library(test: &str) -> bool {
    match std::env::var_os("TANDEM_NIXL_LIB").filter(|d| !d.is_empty()) {
        Some(d) if Path::new(&d).join("libnixl_capi.so").exists() => true,
        Some(d) => {
            missing(test, &format!("TANDEM_NIXL_LIB={} holds no libnixl_capi.so", Path::new(&d).display()));
            false
        }
        None => {
            missing(test, "TANDEM_NIXL_LIB is not set (scripts/fetch-nixl.sh installs NIXL)");
            false
        }
    }
}

/// The Python interpreter with the test packages, or None (after saying why) to skip.
pub fn external_python(test: &str) -> Option<PathBuf> {
    match std::env::var_os("TANDEM_PYTHON") {
        Some(p) if Path::new(&p).exists() => Some(PathBuf::from(p)),
        Some(p) => {
            missing(test, &format!("TANDEM_PYTHON={} does not exist", Path::new(&p).display()));
            None
        }
        None => {
            missing(test, "TANDEM_PYTHON is not set (run scripts/py-env.sh and export its output)");
            None
        }
    }
}

/// A program found on `PATH`, or None (after saying why) to skip.
pub fn external_program(name: &str, test: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let p = dir.join(name);
        if p.is_file() {
            return Some(p);
        }
    }
    missing(test, &format!("{name} is not on PATH"));
    None
}

/// A script of `tests/e2e/py`.
pub fn py_script(name: &str) -> PathBuf {
    crate::workspace_root().join("tests/e2e/py").join(name)
}

/// Runs `cmd` to completion within `timeout` (killed after it) and returns its output.
pub fn run_bounded(cmd: &mut Command, timeout: Duration) -> Output {
    let dir =
        std::env::temp_dir().join(format!("tandem-ext-{}-{}", std::process::id(), rand::random::<u64>()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let (out_path, err_path) = (dir.join("stdout"), dir.join("stderr"));
    let out = std::fs::File::create(&out_path).expect("stdout file");
    let err = std::fs::File::create(&err_path).expect("stderr file");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait().expect("waiting for a child") {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
            panic!("{cmd:?} did not finish within {timeout:?}; stderr:\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = Output {
        status,
        stdout: std::fs::read(&out_path).unwrap_or_default(),
        stderr: std::fs::read(&err_path).unwrap_or_default(),
    };
    let _ = std::fs::remove_dir_all(&dir);
    output
}

/// Runs `python tests/e2e/py/<script> args...` within `timeout`.
pub fn run_py(python: &Path, script: &str, args: &[String], timeout: Duration) -> Output {
    let mut cmd = Command::new(python);
    cmd.arg(py_script(script)).args(args).env("PYTHONUNBUFFERED", "1").env("PYTHONDONTWRITEBYTECODE", "1");
    run_bounded(&mut cmd, timeout)
}

/// Runs a script that must succeed and print one JSON object as its last stdout line.
pub fn run_py_json(python: &Path, script: &str, args: &[String], timeout: Duration) -> Value {
    let out = run_py(python, script, args, timeout);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} {args:?} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("{script}: last line is not JSON ({e}):\n{stdout}\nstderr:\n{stderr}"))
}

/// `tandem up`'s first line: `ready router=<grpc> http=<http>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpReady {
    pub router: SocketAddr,
    pub http: Option<SocketAddr>,
}

/// Parses `tandem up`'s ready line.
pub fn parse_ready(line: &str) -> Option<UpReady> {
    let rest = line.trim().strip_prefix("ready ")?;
    let (mut router, mut http) = (None, None);
    for part in rest.split_whitespace() {
        if let Some(a) = part.strip_prefix("router=") {
            router = Some(a.parse().ok()?);
        } else if let Some(a) = part.strip_prefix("http=") {
            http = Some(a.parse().ok()?);
        }
    }
    Some(UpReady { router: router?, http })
}

/// One Prometheus sample, as `metrics_check.py` reports it after parsing with
/// `prometheus_client`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A parsed `/metrics` page.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// Family name → (type, help).
    pub families: BTreeMap<String, (String, String)>,
    pub samples: Vec<Sample>,
}

impl Metrics {
    /// From `metrics_check.py`'s JSON.
    pub fn from_json(v: &Value) -> Metrics {
        let mut m = Metrics::default();
        for f in v["families"].as_array().expect("families") {
            let name = f["name"].as_str().expect("family name").to_owned();
            let help = f["help"].as_str().unwrap_or("").to_owned();
            let ty = f["type"].as_str().unwrap_or("").to_owned();
            m.families.insert(name, (ty, help));
            for s in f["samples"].as_array().expect("samples") {
                let labels = s["labels"]
                    .as_object()
                    .map(|o| {
                        o.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_owned())).collect()
                    })
                    .unwrap_or_default();
                m.samples.push(Sample {
                    name: s["name"].as_str().expect("sample name").to_owned(),
                    labels,
                    value: s["value"].as_f64().unwrap_or(f64::NAN),
                });
            }
        }
        m
    }

    /// Whether any sample is named `name`.
    pub fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|s| s.name == name)
    }

    /// Sum of the samples named `name` whose labels include every pair of `labels` (0 if none).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| {
                s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .sum()
    }
}

/// Fetches and parses `http://<addr>/metrics` with `prometheus_client` (through
/// `metrics_check.py`).
pub fn scrape(python: &Path, addr: SocketAddr) -> Metrics {
    let v =
        run_py_json(python, "metrics_check.py", &[format!("http://{addr}/metrics")], Duration::from_secs(60));
    Metrics::from_json(&v)
}

/// A plain `GET http://<addr><path>` (HTTP/1.1, connection closed after): the status code and
/// body, or None when nothing accepts the connection (the server has exited).
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    http_request(addr, "GET", path, None, None)
}

/// One HTTP/1.1 request (`Connection: close`) with an optional JSON body and bearer token: the
/// status code and body, or None when the connection fails.
pub fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    json: Option<&str>,
    bearer: Option<&str>,
) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(token) = bearer {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    let body = json.unwrap_or("");
    if json.is_some() {
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    write!(s, "{head}\r\n{body}").ok()?;
    let mut raw = Vec::new();
    // A reset after the response was read still leaves a usable response.
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Some((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_line() {
        let r = parse_ready("ready router=127.0.0.1:5 http=127.0.0.1:6\n").unwrap();
        assert_eq!(r.router, "127.0.0.1:5".parse().unwrap());
        assert_eq!(r.http, Some("127.0.0.1:6".parse().unwrap()));
        assert_eq!(parse_ready("ready router=127.0.0.1:5").unwrap().http, None);
        assert_eq!(parse_ready("listening grpc=127.0.0.1:5"), None);
        assert_eq!(parse_ready("ready http=127.0.0.1:6"), None);
    }
}
