//! Starting a worker binary and talking to it (shared by the decode and prefill workers' tests).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tandem_proto::v1::worker_client::WorkerClient;
use tonic::transport::Channel;

/// Longest wait for anything a test waits on (only to turn a hang into a failure).
pub const HANG: Duration = Duration::from_secs(120);

/// The tiny fixture model (a Hugging Face directory).
pub fn tiny_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tandem-node-test-{}-{name}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish()
}

/// Runs `bin` to completion (it must not start serving): exit status and stderr.
pub fn run_to_exit(bin: &str, args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, String) {
    let mut cmd = Command::new(bin);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawning the worker binary");
    let deadline = Instant::now() + HANG;
    loop {
        if child.try_wait().expect("waiting").is_some() {
            let out = child.wait_with_output().expect("output");
            return (out.status, String::from_utf8_lossy(&out.stderr).into_owned());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{bin} {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running worker process.
pub struct Proc {
    child: Child,
    pub grpc: SocketAddr,
    pub kv: Option<SocketAddr>,
    /// The HTTP address (metrics, health), when the worker printed one.
    pub http: Option<SocketAddr>,
    stderr: PathBuf,
}

impl Proc {
    /// Starts `bin` and waits for its `listening` line.
    pub fn start(bin: &str, args: &[&str]) -> Proc {
        let dir = scratch("proc");
        let stderr = dir.join("stderr.log");
        let err = std::fs::File::create(&stderr).expect("stderr file");
        let mut child = Command::new(bin)
            .args(args)
            .env("RUST_LOG", "info,tandem_engine=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .expect("spawning the worker binary");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let line = match rx.recv_timeout(HANG) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "{bin} printed no listening line; stderr:\n{}",
                    std::fs::read_to_string(&stderr).unwrap_or_default()
                );
            }
        };
        let l = parse_listening(&line).unwrap_or_else(|| panic!("unexpected first stdout line {line:?}"));
        Proc { child, grpc: l.grpc, kv: l.kv, http: l.http, stderr }
    }

    pub async fn client(&self) -> WorkerClient<Channel> {
        WorkerClient::connect(format!("http://{}", self.grpc)).await.expect("connecting to the worker")
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with the pid of our own child process; no memory is involved.
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "kill failed");
    }

    /// Waits for the process to exit (it was told to).
    pub fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + HANG;
        loop {
            if let Some(s) = self.child.try_wait().expect("waiting") {
                return s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("worker did not exit; stderr:\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().expect("waiting").is_none()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub use tandem_serve::config::parse_listening;

/// Polls `f` until it returns true (fails the test after [`HANG`]).
pub async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + HANG;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `GET path` on a worker's HTTP server (one request per connection): status and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connecting to the HTTP server");
        let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.expect("sending the request");
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.expect("reading the response");
        String::from_utf8(out).expect("a UTF-8 response")
    };
    let text = tokio::time::timeout(HANG, exchange).await.expect("the HTTP server answers");
    let code = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("not HTTP: {text:?}"));
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (code, body)
}

/// The samples of a Prometheus text exposition, keyed by series as printed (`name{labels}`).
/// Panics on any line that is neither a comment nor `series value`, and on a metric without HELP.
pub fn parse_metrics(text: &str) -> std::collections::HashMap<String, f64> {
    let mut out = std::collections::HashMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap_or_default();
            assert!(text.contains(&format!("# HELP {name} ")), "no HELP line for {name}");
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let v: f64 = value.parse().unwrap_or_else(|_| panic!("bad sample value in {line:?}"));
        out.insert(series.to_owned(), v);
    }
    out
}

/// `/metrics` of a worker, parsed.
pub async fn metrics(w: &Proc) -> std::collections::HashMap<String, f64> {
    let (code, body) = http_get(w.http.expect("the worker printed http="), "/metrics").await;
    assert_eq!(code, 200, "{body}");
    parse_metrics(&body)
}

/// One sample (0 when the series is absent, as Prometheus reads a counter not yet created).
pub fn sample(m: &std::collections::HashMap<String, f64>, series: &str) -> f64 {
    m.get(series).copied().unwrap_or(0.0)
}
