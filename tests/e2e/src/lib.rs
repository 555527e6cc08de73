//! Harness for end-to-end tests: starts the real `tandem-router`, `tandem-prefill` and
//! `tandem-decode` binaries on OS-picked ports, talks to them over gRPC, and computes reference
//! output with the in-process engine (the code `tandem generate` runs).
//!
//! The binaries are (re)built on first use with the same cargo and profile as the test, so a test
//! never runs against stale binaries. Each process's stderr goes to a log file whose tail is
//! printed when something goes wrong.

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tandem_engine::backend::BackendOptions;
use tandem_engine::factory::create_backend;
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions};
use tandem_engine::tokenizer::{ChatMessage, Tokenizer};
use tandem_engine::Device;
use tandem_proto::v1;
use tonic::transport::Channel;

pub use tandem_proto::v1::tandem_client::TandemClient;
pub use tandem_proto::v1::worker_client::WorkerClient;

pub mod external;
pub mod up;
pub use external::*;
pub use tandem_test_support::default_model_for_test;
pub use up::*;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

/// A tiny random-weight model from the reference fixtures (fast; a 512-token context).
pub fn tiny_model() -> PathBuf {
    workspace_root().join("tests/reference/fixtures/llama-gqa")
}

/// A model an end-to-end test runs on, with what a workload needs to know about it.
pub struct TestModel {
    /// `smollm2` or `tiny`.
    pub name: &'static str,
    pub path: PathBuf,
    /// The longest sequence (prompt and output) a workload may ask for.
    pub max_len: usize,
    /// How many tokens the longest prompt of a workload should have.
    pub long_prompt: usize,
    /// Output tokens of a request meant to stream for a while (with a short prompt): long enough
    /// that the tiny model is still streaming when a test acts, short enough for SmolLM2 on a
    /// debug build.
    pub long_output: u32,
    tokenizer: Tokenizer,
}

impl TestModel {
    /// The default model (SmolLM2-135M-Instruct Q4_1), or None after a `SKIPPED` line when it is
    /// not in the model cache (a failure under `TANDEM_REQUIRE_MODEL=1`).
    pub fn smollm2(test: &str) -> Option<TestModel> {
        let path = default_model_for_test(test)?;
        Some(TestModel::load("smollm2", path, 8192, 1000, 64))
    }

    /// The tiny fixture model of [`tiny_model`]: always present, so its variants always run.
    pub fn tiny() -> TestModel {
        TestModel::load("tiny", tiny_model(), 512, 300, 448)
    }

    /// The real Gemma 3 270M (GGUF Q4_K_M, `scripts/fetch-gemma.sh`), or None after a `SKIPPED`
    /// line when it is not in the model cache (a failure under `TANDEM_REQUIRE_MODEL=1`).
    pub fn gemma3_270m(test: &str) -> Option<TestModel> {
        let path = tandem_test_support::cached_model_for_test(test, "gemma-3-270m-q4_k_m.gguf")?;
        Some(TestModel::load("gemma3_270m", path, 4096, 600, 64))
    }

    /// Another tiny reference fixture (`tests/reference/fixtures/<name>`, a 512-token context),
    /// for the model families beyond Llama.
    pub fn fixture(name: &'static str) -> TestModel {
        TestModel::load(name, workspace_root().join("tests/reference/fixtures").join(name), 512, 300, 448)
    }

    fn load(
        name: &'static str,
        path: PathBuf,
        max_len: usize,
        long_prompt: usize,
        long_output: u32,
    ) -> TestModel {
        let tokenizer =
            load_model(&path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display())).tokenizer;
        TestModel { name, path, max_len, long_prompt, long_output, tokenizer }
    }

    /// The model's tokenizer (to build token-id prompts from text).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Prompt tokens of `req`, tokenized as [`reference`] and the router do.
    pub fn prompt_tokens(&self, req: &Req) -> usize {
        let tok = &self.tokenizer;
        if req.chat {
            let text =
                tok.apply_chat_template(&[ChatMessage::new("user", req.prompt.clone())], true).unwrap();
            tok.encode(&text, false).unwrap().len()
        } else {
            tok.encode(&req.prompt, true).unwrap().len()
        }
    }

    /// Whether `req`'s prompt and all its output tokens fit the model's context.
    pub fn fits(&self, req: &Req) -> bool {
        self.prompt_tokens(req) + (req.max_tokens as usize) < self.max_len
    }

    /// `make(k)` for the largest `k <= n` (at least 1) whose request fits the context: long
    /// prompts are cut to what the model takes, short ones are left alone.
    pub fn fit(&self, n: usize, make: impl Fn(usize) -> Req) -> Req {
        let (mut lo, mut hi) = (1, n.max(1));
        if self.fits(&make(hi)) {
            return make(hi);
        }
        // Invariant: make(hi) does not fit; make(lo) fits or lo == 1.
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if self.fits(&make(mid)) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        make(lo)
    }
}

/// Instantiates a test body `fn(&TestModel)` once per model: `name::smollm2` (skipped, or failed
/// under `TANDEM_REQUIRE_MODEL=1`, without the default model) and `name::tiny` (always runs).
#[macro_export]
macro_rules! model_test {
    ($(#[$meta:meta])* $name:ident, $body:expr) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[test]
            fn smollm2() {
                let test = concat!(stringify!($name), "::smollm2");
                if let Some(model) = $crate::TestModel::smollm2(test) {
                    ($body)(&model);
                }
            }

            #[test]
            fn tiny() {
                ($body)(&$crate::TestModel::tiny());
            }
        }
    };
}

/// Instantiates a test body `fn(&TestModel)` once per model family beyond Llama: on each tiny
/// fixture (`name::gemma3`, `name::gemma2`, `name::phi3`, `name::qwen3_moe`, `name::mixtral`,
/// always run) and on the real Gemma 3 270M (`name::gemma3_270m`: skipped, or failed under
/// `TANDEM_REQUIRE_MODEL=1`, without it in the model cache).
#[macro_export]
macro_rules! family_test {
    ($(#[$meta:meta])* $name:ident, $body:expr) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[test]
            fn gemma3() {
                ($body)(&$crate::TestModel::fixture("gemma3"));
            }

            #[test]
            fn gemma2() {
                ($body)(&$crate::TestModel::fixture("gemma2"));
            }

            #[test]
            fn phi3() {
                ($body)(&$crate::TestModel::fixture("phi3"));
            }

            #[test]
            fn qwen3_moe() {
                ($body)(&$crate::TestModel::fixture("qwen3-moe"));
            }

            #[test]
            fn mixtral() {
                ($body)(&$crate::TestModel::fixture("mixtral"));
            }

            #[test]
            fn gemma3_270m() {
                let test = concat!(stringify!($name), "::gemma3_270m");
                if let Some(model) = $crate::TestModel::gemma3_270m(test) {
                    ($body)(&model);
                }
            }
        }
    };
}

/// Names a directory of prebuilt server binaries to use as they are: cargo is never called
/// (a GPU machine that runs a bundle of prebuilt tests has no Rust toolchain).
pub const BIN_DIR_ENV: &str = "TANDEM_BIN_DIR";

/// Directory of the binaries: `TANDEM_BIN_DIR` when set, else built (or found up to date) once
/// per test process.
pub fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os(BIN_DIR_ENV).filter(|d| !d.is_empty()) {
            let dir = PathBuf::from(dir);
            for name in ["tandem", "tandem-router", "tandem-prefill", "tandem-decode"] {
                assert!(
                    dir.join(name).is_file(),
                    "{BIN_DIR_ENV}={} has no {name} (build it with scripts/gpu-check.sh --prebuild)",
                    dir.display()
                );
            }
            return dir;
        }
        let exe = std::env::current_exe().expect("test executable path");
        // target/<profile>/deps/<test binary>
        let dir = exe.parent().and_then(Path::parent).expect("target profile directory").to_path_buf();
        let release = dir.file_name().is_some_and(|n| n == "release");
        let out = tandem_test_support::cargo_build_bins(env!("CARGO"), &workspace_root(), release)
            .output()
            .expect("running cargo build for the server binaries");
        assert!(
            out.status.success(),
            "building the binaries failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for name in ["tandem", "tandem-router", "tandem-prefill", "tandem-decode"] {
            assert!(dir.join(name).exists(), "{} was not built in {}", name, dir.display());
        }
        dir
    })
}

/// Path of one of the project's binaries.
pub fn bin(name: &str) -> PathBuf {
    bin_dir().join(name)
}

fn log_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("tandem-e2e-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("log directory");
        d
    })
}

/// A child process that prints `listening grpc=.. [kv=..]` once it serves.
pub struct Proc {
    pub name: String,
    child: Child,
    log: PathBuf,
    listening: mpsc::Receiver<String>,
    pub grpc: Option<SocketAddr>,
    pub kv: Option<SocketAddr>,
    /// The HTTP address from the `listening` line (metrics, health, and the router's OpenAI API).
    pub http: Option<SocketAddr>,
}

impl Proc {
    /// Starts `program args...`; stdout is read for the listening line, stderr goes to a log file.
    pub fn spawn(name: &str, program: &Path, args: &[String]) -> Proc {
        Proc::spawn_env(name, program, args, &[])
    }

    /// [`Proc::spawn`] with `env` added to the child's environment.
    pub fn spawn_env(name: &str, program: &Path, args: &[String], env: &[(String, String)]) -> Proc {
        let log = log_dir().join(format!("{name}-{}.log", rand::random::<u32>()));
        let err = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(err);
        cmd.env_remove("TANDEM_CONFIG");
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to kill this child if the
        // test process dies, so no server outlives a crashed test.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    // Nobody listens any more; keep draining so the child never blocks on stdout.
                    continue;
                }
            }
        });
        Proc { name: name.into(), child, log, listening: rx, grpc: None, kv: None, http: None }
    }

    /// Waits for the `listening` line (panics with the log tail if it does not come).
    pub fn wait_listening(&mut self, timeout: Duration) -> SocketAddr {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.listening.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(line) => {
                    if let Some(l) = tandem_serve::config::parse_listening(&line) {
                        self.grpc = Some(l.grpc);
                        self.kv = l.kv;
                        self.http = l.http;
                        return l.grpc;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(st)) = self.child.try_wait() {
                        panic!("{} exited ({st}) before listening:\n{}", self.name, self.log_tail(4000));
                    }
                    if Instant::now() >= deadline {
                        panic!(
                            "{} did not print its listening line in {timeout:?}:\n{}",
                            self.name,
                            self.log_tail(4000)
                        );
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let st = self.child.wait().ok();
                    panic!("{} closed stdout ({st:?}) before listening:\n{}", self.name, self.log_tail(4000));
                }
            }
        }
    }

    /// Next stdout line, if one comes within `timeout`.
    pub fn next_line(&self, timeout: Duration) -> Option<String> {
        self.listening.recv_timeout(timeout).ok()
    }

    pub fn addr(&self) -> SocketAddr {
        self.grpc.expect("process has printed its listening line")
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The last `max` bytes of the process's stderr.
    pub fn log_tail(&self, max: u64) -> String {
        let Ok(mut f) = std::fs::File::open(&self.log) else { return String::new() };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
        let mut s = String::new();
        let _ = f.read_to_string(&mut s);
        s
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: sending a signal to our own child process, which has not been reaped yet.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM and wait; panics (with the log) if it does not exit in time.
    pub fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        self.signal(libc::SIGTERM);
        match self.wait_exit(timeout) {
            Some(st) => st,
            None => {
                let tail = self.log_tail(3000);
                self.kill();
                panic!("{} did not exit within {timeout:?} of SIGTERM:\n{tail}", self.name)
            }
        }
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// How to start a local cluster.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub model: PathBuf,
    /// `--transport` for the workers: "shm", "tcp" or "auto".
    pub transport: String,
    pub prefill_workers: usize,
    pub decode_workers: usize,
    /// Start colocated workers (role COLOCATED) instead of prefill + decode.
    pub colocated: bool,
    pub kv_blocks: usize,
    /// `--kv-blocks` of the decode workers when it differs from `kv_blocks`.
    pub decode_kv_blocks: Option<usize>,
    pub block_size: usize,
    pub max_batch_tokens: usize,
    pub threads: usize,
    pub router_args: Vec<String>,
    pub prefill_args: Vec<String>,
    pub decode_args: Vec<String>,
    /// Routers (replicas): every worker registers with each.
    pub routers: usize,
    /// Mutual TLS on every port of every process (certificates made for this cluster); the
    /// harness then reaches the processes over TLS with the same certificate.
    pub tls: Option<Arc<TestCerts>>,
    /// Environment added to the workers' (e.g. `UCX_TLS` for nixl).
    pub worker_env: Vec<(String, String)>,
}

impl ClusterSpec {
    pub fn new(model: PathBuf, transport: &str) -> ClusterSpec {
        ClusterSpec {
            model,
            transport: transport.into(),
            prefill_workers: 1,
            decode_workers: 1,
            colocated: false,
            kv_blocks: 512,
            decode_kv_blocks: None,
            block_size: 16,
            max_batch_tokens: 512,
            threads: 1,
            router_args: Vec::new(),
            prefill_args: Vec::new(),
            decode_args: Vec::new(),
            routers: 1,
            tls: None,
            worker_env: Vec::new(),
        }
    }

    /// The TLS flags every process gets (none in plaintext).
    pub fn tls_flags(&self) -> Vec<String> {
        self.tls.as_ref().map(|t| t.flags()).unwrap_or_default()
    }

    /// A gRPC channel to one of the cluster's processes: plaintext, or TLS presenting the
    /// cluster's certificate. It connects lazily (on the first call); call it inside a runtime.
    pub fn channel(&self, addr: SocketAddr) -> Channel {
        // With TLS the connector makes the TLS stream itself: the URI stays `http://`.
        // A generous connect timeout: a process frozen for seconds (SIGSTOP) accepts the
        // connection once it resumes, and that is not a failure.
        let ep = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("valid uri")
            .connect_timeout(Duration::from_secs(30));
        tandem_serve::tls::grpc_channel(ep, self.tls.as_ref().map(|t| t.tls.clone()))
    }
}

/// A CA and one certificate for `127.0.0.1`/`localhost`, written to a temporary directory that
/// goes away with the value, and the TLS configuration a process would load from them.
pub struct TestCerts {
    pub files: tandem_serve::tls::dev::ClusterCerts,
    pub tls: Arc<tandem_serve::tls::Tls>,
    dir: PathBuf,
}

impl std::fmt::Debug for TestCerts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCerts").field("files", &self.files).finish()
    }
}

impl TestCerts {
    pub fn new() -> Arc<TestCerts> {
        let dir = std::env::temp_dir().join(format!(
            "tandem-e2e-certs-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).expect("certificate directory");
        let files = tandem_serve::tls::dev::write_cluster_certs(&dir).expect("test certificates");
        let tls = tandem_serve::tls::Tls::load(tandem_serve::tls::TlsFiles {
            cert: files.cert.clone(),
            key: files.key.clone(),
            client_ca: Some(files.ca.clone()),
            ca: None,
        })
        .expect("the test certificates load");
        Arc::new(TestCerts { files, tls: Arc::new(tls), dir })
    }

    /// `--tls-cert`, `--tls-key` and `--tls-client-ca` (mutual TLS).
    pub fn flags(&self) -> Vec<String> {
        let p = |p: &Path| p.display().to_string();
        vec![
            s("--tls-cert"),
            p(&self.files.cert),
            s("--tls-key"),
            p(&self.files.key),
            s("--tls-client-ca"),
            p(&self.files.ca),
        ]
    }
}

impl Drop for TestCerts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A router and its workers, all real processes.
pub struct Cluster {
    pub spec: ClusterSpec,
    pub router: Proc,
    /// The routers after the first (`spec.routers` > 1).
    pub more_routers: Vec<Proc>,
    pub prefill: Vec<Proc>,
    pub decode: Vec<Proc>,
}

fn s(x: impl ToString) -> String {
    x.to_string()
}

impl Cluster {
    /// The arguments a worker of `role` ("prefill" or "decode") gets.
    pub fn worker_args(spec: &ClusterSpec, role: &str, router: SocketAddr, index: usize) -> Vec<String> {
        Self::worker_args_for(spec, role, &router.to_string(), index)
    }

    /// [`Cluster::worker_args`] with `routers` (one address, or several separated by commas).
    pub fn worker_args_for(spec: &ClusterSpec, role: &str, routers: &str, index: usize) -> Vec<String> {
        let mut a = vec![
            s("--listen"),
            s("127.0.0.1:0"),
            s("--router"),
            s(routers),
            s("--model"),
            s(spec.model.display()),
            s("--threads"),
            s(spec.threads),
            s("--kv-blocks"),
            s(if role == "decode" {
                spec.decode_kv_blocks.unwrap_or(spec.kv_blocks)
            } else {
                spec.kv_blocks
            }),
            s("--block-size"),
            s(spec.block_size),
            s("--max-batch-tokens"),
            s(spec.max_batch_tokens),
            s("--transport"),
            spec.transport.clone(),
            s("--worker-id"),
            format!("{role}-{index}"),
        ];
        a.extend(spec.tls_flags());
        if role == "decode" {
            a.extend([s("--kv-listen"), s("127.0.0.1:0")]);
            if spec.colocated {
                a.push(s("--colocated"));
            }
            a.extend(spec.decode_args.iter().cloned());
        } else {
            a.extend(spec.prefill_args.iter().cloned());
        }
        a
    }

    /// The arguments of a router listening on `listen` (`127.0.0.1:0` for any port).
    pub fn router_args(spec: &ClusterSpec, listen: &str) -> Vec<String> {
        let mut a = vec![s("--listen"), s(listen), s("--model"), s(spec.model.display())];
        a.extend(spec.router_args.iter().cloned());
        a.extend(spec.tls_flags());
        a
    }

    /// Starts a router, then the workers, and waits until the router says it is serving with all
    /// of them registered.
    pub fn start(spec: ClusterSpec) -> Cluster {
        let rargs = Self::router_args(&spec, "127.0.0.1:0");
        let mut router = Proc::spawn("router", &bin("tandem-router"), &rargs);
        let mut routers = vec![router.wait_listening(Duration::from_secs(60)).to_string()];
        let mut more_routers = Vec::new();
        for i in 1..spec.routers.max(1) {
            let mut r = Proc::spawn(&format!("router-{i}"), &bin("tandem-router"), &rargs);
            routers.push(r.wait_listening(Duration::from_secs(60)).to_string());
            more_routers.push(r);
        }
        let raddr = routers.join(",");
        let mut cluster =
            Cluster { spec: spec.clone(), router, more_routers, prefill: Vec::new(), decode: Vec::new() };
        let n_prefill = if spec.colocated { 0 } else { spec.prefill_workers };
        for i in 0..n_prefill {
            let args = Self::worker_args_for(&spec, "prefill", &raddr, i);
            cluster.prefill.push(Proc::spawn_env(
                &format!("prefill-{i}"),
                &bin("tandem-prefill"),
                &args,
                &spec.worker_env,
            ));
        }
        for i in 0..spec.decode_workers {
            let args = Self::worker_args_for(&spec, "decode", &raddr, i);
            cluster.decode.push(Proc::spawn_env(
                &format!("decode-{i}"),
                &bin("tandem-decode"),
                &args,
                &spec.worker_env,
            ));
        }
        for p in cluster.prefill.iter_mut().chain(cluster.decode.iter_mut()) {
            p.wait_listening(Duration::from_secs(120));
        }
        let want = n_prefill + spec.decode_workers;
        cluster.wait_registered(want, Duration::from_secs(60));
        cluster
    }

    /// Every router, the first one first.
    pub fn routers(&self) -> impl Iterator<Item = &Proc> {
        std::iter::once(&self.router).chain(&self.more_routers)
    }

    /// Router `i` (0 is [`Cluster::router`]).
    pub fn router_mut(&mut self, i: usize) -> &mut Proc {
        if i == 0 {
            &mut self.router
        } else {
            &mut self.more_routers[i - 1]
        }
    }

    /// Starts router `i` again on the gRPC address it had (the workers know it by that address),
    /// after it was killed; returns once it listens. A port that another process took in the
    /// meantime is retried for a few seconds.
    pub fn restart_router(&mut self, i: usize) {
        let addr = self.router_mut(i).addr();
        let args = Self::router_args(&self.spec, &addr.to_string());
        let name = if i == 0 { s("router") } else { format!("router-{i}") };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut p = Proc::spawn(&name, &bin("tandem-router"), &args);
            let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                p.wait_listening(Duration::from_secs(60));
            }));
            match started {
                Ok(()) => {
                    *self.router_mut(i) = p;
                    return;
                }
                Err(e) if Instant::now() >= deadline => std::panic::resume_unwind(e),
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// Starts worker `i` of `role` ("prefill" or "decode") again, with the arguments (and worker
    /// id) it had, after it was killed; returns once every router lists it, healthy, at its new
    /// address (until then a router may still hold the dead process's registration).
    pub fn restart_worker(&mut self, role: &str, i: usize) {
        let routers: Vec<String> = self.routers().map(|r| r.addr().to_string()).collect();
        let args = Self::worker_args_for(&self.spec, role, &routers.join(","), i);
        let (program, list) = match role {
            "prefill" => ("tandem-prefill", &mut self.prefill),
            _ => ("tandem-decode", &mut self.decode),
        };
        let name = format!("{role}-{i}");
        let mut p = Proc::spawn(&name, &bin(program), &args);
        let at = p.wait_listening(Duration::from_secs(120)).to_string();
        list[i] = p;
        let deadline = Instant::now() + Duration::from_secs(60);
        let routers: Vec<SocketAddr> = self.routers().map(|r| r.addr()).collect();
        loop {
            let listed = routers.iter().all(|&r| {
                block_on(async { health_on(self.spec.channel(r)).await }).is_ok_and(|h| {
                    h.workers.iter().any(|w| w.worker_id == name && w.address == at && w.healthy)
                })
            });
            if listed {
                return;
            }
            assert!(Instant::now() < deadline, "{name} did not register at {at} in 60 s\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every router reports `n` healthy workers and serving.
    pub fn wait_registered(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut last = None;
        let routers: Vec<SocketAddr> = self.routers().map(|r| r.addr()).collect();
        while Instant::now() < deadline {
            let mut all = true;
            for &r in &routers {
                match block_on(async { health_on(self.spec.channel(r)).await }) {
                    Ok(h) if h.serving && h.workers.iter().filter(|w| w.healthy).count() >= n => {}
                    Ok(h) => {
                        all = false;
                        last = Some(h);
                    }
                    Err(_) => all = false,
                }
            }
            if all {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "router did not report {n} healthy workers in {timeout:?}; last health: {last:?}\n{}",
            self.logs()
        );
    }

    /// Every process's log tail, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for p in self.routers().chain(&self.prefill).chain(&self.decode) {
            out.push_str(&format!("----- {} -----\n{}\n", p.name, p.log_tail(3000)));
        }
        out
    }

    pub fn workers(&self) -> impl Iterator<Item = &Proc> {
        self.prefill.iter().chain(self.decode.iter())
    }

    /// Polls every live worker's stats until each is quiescent (free == total, no sequences, no
    /// reservations, invariants hold), then returns the stats. Panics with the last stats and the
    /// logs if that does not happen within `timeout`.
    pub fn assert_quiescent(&self, timeout: Duration) -> Vec<(String, v1::StatsResponse)> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut all = Vec::new();
            let mut ok = true;
            for p in self.workers() {
                match block_on(async { stats_on(self.spec.channel(p.addr()), true).await }) {
                    Ok(st) => {
                        ok &= is_quiescent(&st);
                        all.push((p.name.clone(), st));
                    }
                    Err(e) => {
                        ok = false;
                        all.push((
                            p.name.clone(),
                            v1::StatsResponse { invariant_error: e.to_string(), ..Default::default() },
                        ));
                    }
                }
            }
            if ok {
                return all;
            }
            if Instant::now() >= deadline {
                panic!("workers not quiescent after {timeout:?}: {all:#?}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// free + cached == total (the prefix cache keeps finished sequences' blocks), nothing held,
/// invariant check ran and passed.
pub fn is_quiescent(st: &v1::StatsResponse) -> bool {
    let Some(kv) = &st.kv else { return false };
    kv.free + kv.cached == kv.total
        && kv.used == 0
        && kv.sequences == 0
        && kv.raw_reserved == 0
        && st.invariants_checked
        && st.invariants_ok
        && st.load.as_ref().is_none_or(|l| l.reservations == 0 && l.running == 0 && l.queued == 0)
}

/// Runs a future to completion on a fresh current-thread runtime (for synchronous tests).
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(f)
}

pub async fn channel(addr: SocketAddr) -> Result<Channel, tonic::transport::Error> {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("valid uri")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
}

pub async fn health(router: SocketAddr) -> anyhow::Result<v1::HealthResponse> {
    health_on(channel(router).await?).await
}

/// `Health` over a channel of the caller's (TLS, for instance).
pub async fn health_on(router: Channel) -> anyhow::Result<v1::HealthResponse> {
    let mut c = TandemClient::new(router);
    Ok(c.health(v1::HealthRequest {}).await?.into_inner())
}

pub async fn stats(worker: SocketAddr, check: bool) -> anyhow::Result<v1::StatsResponse> {
    stats_on(channel(worker).await?, check).await
}

/// `Stats` over a channel of the caller's (TLS, for instance).
pub async fn stats_on(worker: Channel, check: bool) -> anyhow::Result<v1::StatsResponse> {
    let mut c = WorkerClient::new(worker);
    Ok(c.stats(v1::StatsRequest { check_invariants: check }).await?.into_inner())
}

/// What a client collects from one Generate stream (the fields of `tandem generate --json`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Completion {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: Option<String>,
}

impl Completion {
    /// Adds one message of a Generate stream.
    pub fn absorb(&mut self, msg: v1::GenerateResponse) {
        if !msg.prompt_token_ids.is_empty() {
            self.prompt_token_ids = msg.prompt_token_ids;
        }
        self.token_ids.extend(msg.token_ids);
        self.text.push_str(&msg.text);
        if msg.finish_reason.is_some() {
            self.finish_reason = msg.finish_reason;
        }
    }
}

/// One request, as both the router and the in-process reference understand it.
#[derive(Debug, Clone)]
pub struct Req {
    pub prompt: String,
    pub chat: bool,
    pub max_tokens: u32,
    pub stop: Vec<String>,
}

impl Req {
    pub fn text(prompt: impl Into<String>, max_tokens: u32) -> Req {
        Req { prompt: prompt.into(), chat: false, max_tokens, stop: Vec::new() }
    }

    pub fn to_proto(&self) -> v1::GenerateRequest {
        let prompt = if self.chat {
            v1::generate_request::Prompt::Chat(v1::ChatPrompt {
                messages: vec![v1::ChatMessage {
                    role: "user".into(),
                    content: self.prompt.clone(),
                    ..Default::default()
                }],
                ..Default::default()
            })
        } else {
            v1::generate_request::Prompt::Text(self.prompt.clone())
        };
        v1::GenerateRequest {
            prompt: Some(prompt),
            max_tokens: Some(self.max_tokens),
            stop: self.stop.clone(),
            ..Default::default()
        }
    }
}

/// Sends one Generate and collects the whole stream.
pub async fn generate(router: SocketAddr, req: v1::GenerateRequest) -> Result<Completion, tonic::Status> {
    generate_watching(router, req, |_| {}).await
}

/// [`generate`], calling `seen` with what has arrived so far after each message (to follow a
/// stream's progress from outside it).
pub async fn generate_watching(
    router: SocketAddr,
    req: v1::GenerateRequest,
    mut seen: impl FnMut(&Completion),
) -> Result<Completion, tonic::Status> {
    let ch = channel(router).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut c = TandemClient::new(ch);
    let mut stream = c.generate(req).await?.into_inner();
    let mut out = Completion::default();
    while let Some(msg) = stream.message().await? {
        out.absorb(msg);
        seen(&out);
    }
    Ok(out)
}

/// Sends every request at once and collects each answer, in the order of `reqs`.
pub fn generate_all(router: SocketAddr, reqs: &[Req]) -> Vec<Result<Completion, tonic::Status>> {
    block_on(async {
        let tasks: Vec<_> = reqs.iter().map(|r| tokio::spawn(generate(router, r.to_proto()))).collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("request task"));
        }
        out
    })
}

/// The in-process engine (no prefix cache, no speculation) the reference outputs come from, and
/// its tokenizer.
fn reference_engine(model: &Path, kv_blocks: usize, block_size: usize) -> (Engine, Tokenizer) {
    let loaded = load_model(model).expect("model loads");
    let tok = loaded.tokenizer.clone();
    let opts = BackendOptions {
        num_blocks: kv_blocks,
        block_size,
        max_batch_tokens: 512,
        threads: 0,
        ..Default::default()
    };
    let backend = create_backend(Device::Cpu, loaded, opts).expect("backend");
    let engine =
        Engine::new(backend, tok.clone(), SchedulerOptions { max_batch_tokens: 512, ..Default::default() });
    (engine, tok)
}

fn reference_one(engine: &mut Engine, ids: Vec<u32>, params: SamplingParams) -> Completion {
    let g = engine.generate(ids, params, |_| {}).expect("reference generation");
    Completion {
        prompt_token_ids: g.prompt_token_ids,
        token_ids: g.token_ids,
        text: g.text,
        finish_reason: g.finish_reason.map(|f| f.as_str().to_owned()),
    }
}

/// Reference completions already computed in this test process, by request: several tests of a
/// binary (the same workload over each transport, a subset of it colocated) ask for the same
/// ones, and a greedy completion depends only on the model file, the engine's sizes and the
/// request. A key being computed is waited for rather than computed twice.
fn remembered(key: String, compute: impl FnOnce() -> Completion) -> Completion {
    type Slot = Arc<OnceLock<Completion>>;
    static DONE: OnceLock<std::sync::Mutex<std::collections::HashMap<String, Slot>>> = OnceLock::new();
    let slot = {
        let mut map = DONE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        map.entry(key).or_default().clone()
    };
    slot.get_or_init(compute).clone()
}

/// An engine built on first use: a call whose references are all remembered loads nothing.
struct LazyEngine<'a> {
    model: &'a Path,
    kv_blocks: usize,
    block_size: usize,
    built: Option<(Engine, Tokenizer)>,
}

impl LazyEngine<'_> {
    fn get(&mut self) -> &mut (Engine, Tokenizer) {
        let (model, kv_blocks, block_size) = (self.model, self.kv_blocks, self.block_size);
        self.built.get_or_insert_with(|| reference_engine(model, kv_blocks, block_size))
    }

    fn key(&self, what: impl std::fmt::Debug) -> String {
        format!("{}|{}|{}|{what:?}", self.model.display(), self.kv_blocks, self.block_size)
    }
}

/// Greedy reference output from the in-process engine, one request at a time, tokenized exactly
/// as `tandem generate` does (text: with special tokens; chat: template, then without).
pub fn reference(model: &Path, reqs: &[Req], kv_blocks: usize, block_size: usize) -> Vec<Completion> {
    let mut lazy = LazyEngine { model, kv_blocks, block_size, built: None };
    reqs.iter()
        .map(|r| {
            remembered(lazy.key(("text", r)), || {
                let (engine, tok) = lazy.get();
                let ids = if r.chat {
                    let text =
                        tok.apply_chat_template(&[ChatMessage::new("user", r.prompt.clone())], true).unwrap();
                    tok.encode(&text, false).unwrap()
                } else {
                    tok.encode(&r.prompt, true).unwrap()
                };
                let params = SamplingParams {
                    max_tokens: r.max_tokens as usize,
                    stop_strings: r.stop.clone(),
                    ..SamplingParams::greedy()
                };
                reference_one(engine, ids, params)
            })
        })
        .collect()
}

/// Greedy reference output for prompts given as token ids (a `GenerateRequest` with `token_ids`
/// and `max_tokens`, nothing else), from the in-process engine, one prompt at a time.
pub fn reference_ids(
    model: &Path,
    prompts: &[Vec<u32>],
    max_tokens: u32,
    kv_blocks: usize,
    block_size: usize,
) -> Vec<Completion> {
    let params = SamplingParams { max_tokens: max_tokens as usize, ..SamplingParams::greedy() };
    reference_with(model, prompts, &params, kv_blocks, block_size)
}

/// Reference output for prompts given as token ids, each generated with `params`, from the
/// in-process engine, one prompt at a time.
pub fn reference_with(
    model: &Path,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    kv_blocks: usize,
    block_size: usize,
) -> Vec<Completion> {
    let mut lazy = LazyEngine { model, kv_blocks, block_size, built: None };
    prompts
        .iter()
        .map(|ids| {
            let key = lazy.key(("ids", ids, params));
            let mut compute = || reference_one(&mut lazy.get().0, ids.clone(), params.clone());
            // Sampling without a seed draws from the engine's own fallback seed, which depends on
            // what ran before: only greedy or seeded output is a function of the request.
            if params.temperature == 0.0 || params.seed.is_some() {
                remembered(key, compute)
            } else {
                compute()
            }
        })
        .collect()
}

/// `GET https://<addr><path>` over HTTP/1.1 to a TLS cluster's HTTP port, verifying the server
/// with `certs`' CA: the status code and body, or None when the connection or handshake fails.
pub fn https_get(addr: SocketAddr, path: &str, certs: &TestCerts) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut cfg = tandem_serve::tls::client_config_with_ca("--tls-ca", &certs.files.ca).ok()?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    block_on(async {
        let work = async {
            let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
            let name = tandem_serve::tls::server_name(&addr.to_string()).ok()?;
            let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp).await.ok()?;
            let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
            s.write_all(req.as_bytes()).await.ok()?;
            let mut raw = Vec::new();
            // A close without close_notify after the response still leaves a usable response.
            let _ = s.read_to_end(&mut raw).await;
            let text = String::from_utf8_lossy(&raw).into_owned();
            let status = text.split_whitespace().nth(1)?.parse().ok()?;
            let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
            Some((status, body))
        };
        tokio::time::timeout(Duration::from_secs(30), work).await.ok().flatten()
    })
}

/// The value of the series `series` in Prometheus text: a name (`tandem_router_queue_depth`) or
/// a name with its labels as the exposition writes them
/// (`tandem_router_requests_total{api="grpc",outcome="ok"}`). None when it is absent (a
/// labelled counter appears only once it has counted).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Names of the files in the shared-memory segment directory that were created by one of
/// `pids` (`tandem-kv-<pid>-...`): what a killed worker would have left behind.
pub fn shm_segments_of(pids: &[i32]) -> Vec<String> {
    std::fs::read_dir(tandem_engine::kv::shm::segment_dir())
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| tandem_engine::kv::shm::owner_pid(n).is_some_and(|p| pids.contains(&p)))
                .collect()
        })
        .unwrap_or_default()
}

/// Shared-memory segments of `owners` (`tandem-kv-<pid>-...`) that a process in `holders` still
/// has mapped (`/proc/<holder>/maps`; a segment unlinked at creation shows as `(deleted)`):
/// `(holder, mapping)` pairs. What a killed decode worker's pool costs until its peers let go.
pub fn shm_segments_mapped(holders: &[i32], owners: &[i32]) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for &h in holders {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{h}/maps")) else { continue };
        for line in maps.lines() {
            let Some(name) = line.split('/').next_back() else { continue };
            if tandem_engine::kv::shm::owner_pid(name).is_some_and(|p| owners.contains(&p)) {
                out.push((h, line.to_owned()));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}
