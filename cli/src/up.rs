//! `tandem up`: a local cluster as child processes — `tandem-router`, then `--prefill-workers`
//! `tandem-prefill` and `--decode-workers` `tandem-decode` (or `--decode-workers` colocated
//! `tandem-decode`) registering with it, all on 127.0.0.1 with OS-picked ports. Worker ids are
//! `<role>-<index>` (`prefill-0`, `decode-1`, `colocated-0`); with several workers of a role, the
//! `[name]` prefix of their stderr lines carries the index too.
//!
//! Start-up: each child prints `listening grpc=.. http=..` when it serves; once the router's
//! `Health` says it serves with every worker registered and healthy, `ready router=<grpc addr>
//! http=<http addr>` goes to stdout, once (the only thing `tandem up` prints there, never repeated
//! after a restart; `http` is the router's OpenAI-compatible API). A child that dies before the
//! ready line fails the start: it is reported with its last stderr lines, the others are stopped,
//! and `tandem up` exits 1.
//!
//! Supervision: once the cluster is ready, a child that exits on its own is started again under
//! the same name, with the program, arguments, environment and nice value it had ([`Spec`]). A
//! worker keeps its `--worker-id` and registers again by itself (it may come back on a new port);
//! a router comes back on the addresses it bound the first time (even when it was given port 0),
//! so the workers' `--router` list and the clients' addresses stay valid. [`RestartPolicy`]
//! decides when, per child: the first restart 0.5 s after the exit, each next wait doubled up to
//! 30 s, back to 0.5 s for a child that had run 60 s; at most 5 restarts in any 60 s, after which
//! the child stays down and the rest of the cluster serves on. A restart's wait never delays a
//! stop: SIGINT/SIGTERM are looked for every 0.1 s throughout. Only SIGINT/SIGTERM, or every
//! router down for good, stop the cluster.
//!
//! Lines on stderr about supervision (their shape is stable; tests parse them):
//! - `tandem up: <name> (pid <pid>[, on <device>]) exited (<status>); restarting it in <secs> s
//!   (restart <n> of 5 in 60 s, <role> restarts: <total>)` (`<total>`: since `tandem up` began;
//!   a restart counts when it is decided);
//! - `tandem up: <name> restarted (pid <pid>)`;
//! - `tandem up: <name> (pid <pid>[, on <device>]) exited (<status>) after 5 restarts in 60 s; it
//!   will not be restarted again; its last stderr lines:` followed by those lines, indented;
//! - `tandem up: <name> could not be started again (<error>)`, in place of `(pid ..) exited (..)`
//!   when starting it failed (counted like an exit);
//! - on shutdown, once the cluster had been ready: `tandem up: restarts: router=<n> prefill=<n>
//!   decode=<n> colocated=<n>`, naming only the roles this cluster has, in that order.
//!
//! Stopping: SIGINT/SIGTERM stop the cluster gracefully (routers first, so requests in flight
//! finish, then the workers) and exit 0. Every child is given `--drain-timeout-ms` (ours) and gets
//! that much and 10 s more to exit before SIGKILL ([`grace`]), so a clean stop never kills a child
//! that is still within its own drain. When every router is down past its restart budget, the
//! workers are stopped the same way and `tandem up` exits 1. Children never outlive `tandem up`,
//! even when it is SIGKILLed: each asks the kernel for SIGTERM when its parent dies (restarted
//! ones too: they are started from the same, main, thread).
//!
//! Devices: every worker is given its `--device` explicitly, from `--device`, `--prefill-device`
//! and `--decode-device` ([`crate::placement`]: a role's own flag wins, comma lists are dealt
//! round-robin); the ready message on stderr and a dead worker's error name each worker's device.
//! The placement and `--transport` (the GPU transports need every worker on a GPU, NCCL never a
//! prefill and a decode worker on one GPU) are checked before anything starts.
//!
//! Speculation: `--speculate` and the other `--spec-*` flags (and `--draft-model`) go to the
//! decode worker, or the colocated one, never to the prefill worker; they are checked here before
//! anything starts.
//!
//! Secrets: the children share a cluster secret (`--cluster-secret[-file]`, or a random one made
//! for this run), and the router asks clients for `--api-key[-file]` when one is given. Values
//! travel to the children in their environment, never on their command lines.
//!
//! TLS: with `--tls`, a throwaway CA and one certificate for `localhost`/`127.0.0.1`/`::1` are
//! made in a temporary directory (removed when `tandem up` exits); every child gets them through
//! its environment (`TANDEM_TLS_CERT`, `TANDEM_TLS_KEY`, `TANDEM_TLS_CLIENT_CA`: TLS on every
//! port, mutual TLS between the processes) and the ready line gains `ca=<CA file>`, the file
//! clients verify the router with.
//!
//! Children run in their own process group, so a terminal's Ctrl-C reaches only `tandem up`,
//! which then stops them in order. Their stderr is copied to ours with a `[name]` prefix, or with
//! `--log-file` appended to that file instead, so that the terminal keeps only `tandem up`'s own
//! messages. Either way each child's last lines are kept, and a child's death or a start-up
//! timeout is reported on stderr with them.
//! `--log-level` becomes the children's `RUST_LOG` (their servers read their filter from it); it is
//! parsed here first, because a child given a bad filter would fall back to its default silently.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use tandem_engine::Device;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_proto::v1::HealthRequest;
use tandem_serve::auth::{load_secret, Secret};
use tandem_serve::config::{parse_listening, Listening};
use tandem_serve::identity::resolve_model;
use tandem_worker::args::LoraSpec;
use tandem_worker::speculation::SpeculationArgs;

use crate::placement::{DeviceFlags, DeviceList, Placement, Role, Transport};

/// What a stopped child gets beyond its drain timeout before SIGKILL: after its drain a router
/// takes up to 2 s to cancel what is left and 5 s to close its servers, a worker 2 s to deregister
/// from a router (the routers are gone by then: refused at once) and 5 s to close its server.
const AFTER_DRAIN: Duration = Duration::from_secs(10);
/// Lines of each child's stderr kept for error messages.
const TAIL_LINES: usize = 40;

/// `tandem up` flags. Engine flags are passed to the workers as given (unset ones take the
/// workers' defaults).
#[derive(Args, Debug, Clone)]
pub(crate) struct UpArgs {
    /// GGUF file or Hugging Face model directory [default: the default model in the model cache].
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// The model's id on the router's OpenAI API [default: the model's own name].
    #[arg(long, env = "TANDEM_SERVED_MODEL_NAME")]
    served_model_name: Option<String>,
    /// Compute device of every worker: cpu, cuda:N, or a comma list dealt round-robin to the
    /// workers of each role (cuda:0,cuda:1) [default: cpu].
    #[arg(long, env = "TANDEM_DEVICE", value_name = "DEV")]
    device: Option<DeviceList>,
    /// Device of the prefill workers, instead of --device for them: a device or a comma list
    /// dealt round-robin.
    #[arg(long, value_name = "DEV", conflicts_with = "colocated")]
    prefill_device: Option<DeviceList>,
    /// Device of the decode (or colocated) workers, instead of --device for them: a device or a
    /// comma list dealt round-robin.
    #[arg(long, value_name = "DEV")]
    decode_device: Option<DeviceList>,
    /// CPU threads of each worker [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// KV-cache blocks of each worker.
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Tokens per KV-cache block.
    #[arg(long)]
    block_size: Option<usize>,
    /// Most tokens in one forward pass.
    #[arg(long)]
    max_batch_tokens: Option<usize>,
    /// KV transport between the workers: auto, shm, tcp, cuda-ipc, nccl or nixl [default: the
    /// workers' default, auto]. cuda-ipc and nccl need every worker on a GPU, and nccl a prefill
    /// and a decode worker never on the same GPU.
    #[arg(long, value_enum)]
    transport: Option<Transport>,
    /// Directory holding libnixl_capi.so, as printed by scripts/fetch-nixl.sh, given to every
    /// worker (with --transport auto it also makes them offer nixl) [default: the workers'
    /// default, TANDEM_NIXL_LIB or the dynamic loader's search path].
    #[arg(long, value_name = "DIR")]
    nixl_lib: Option<PathBuf>,
    /// NIXL backend plugin that moves the bytes, given to every worker [default: the workers'
    /// default, UCX].
    #[arg(long, value_name = "NAME")]
    nixl_backend: Option<String>,
    /// Element type of the workers' KV caches: f32, f16, bf16 or fp8 (both workers get the same)
    /// [default: the workers' default, f16 on the CPU and bf16 on a GPU].
    #[arg(long, value_name = "DTYPE")]
    kv_dtype: Option<tandem_engine::kv::KvDtype>,
    /// Prefix cache on the workers (true or false) [default: the workers' default, true].
    #[arg(long, value_name = "BOOL")]
    prefix_cache: Option<bool>,
    /// Sliding-window layers give back the KV no later query reaches, on CPU workers (true or
    /// false; both workers get the same) [default: the workers' default, true].
    #[arg(long, value_name = "BOOL")]
    windowed_kv: Option<bool>,
    /// Host-memory KV tier of each worker, in bytes (suffixes: 512MiB, 4GiB)
    /// (docs/prefix-cache.md#kv-tiers) [default: the workers' default, off].
    #[arg(long, value_name = "BYTES")]
    kv_host_bytes: Option<String>,
    /// Disk KV tier: an existing directory; each worker keeps its pages in a subdirectory named
    /// after it (`decode-0`, `prefill-0`, ...), created if missing, which it finds again when
    /// started again.
    #[arg(long, value_name = "DIR")]
    kv_disk_dir: Option<PathBuf>,
    /// Capacity of each worker's disk KV tier [default: the workers' default, 8GiB].
    #[arg(long, value_name = "BYTES")]
    kv_disk_bytes: Option<String>,
    /// Keep the disk tiers' pages across restarts (true or false) [default: the workers'
    /// default, true].
    #[arg(long, value_name = "BOOL")]
    kv_disk_persist: Option<bool>,
    /// CPU activations of the workers: q16, q8 or f32 [default: the workers' default, q16].
    #[arg(long)]
    activations: Option<tandem_engine::backend::Activations>,
    /// Start colocated workers (both phases in one process; `--decode-workers` of them) instead of
    /// prefill and decode workers.
    #[arg(long)]
    colocated: bool,
    /// Prefill workers to start (not with `--colocated`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64), conflicts_with = "colocated")]
    prefill_workers: u32,
    /// Decode workers to start (with `--colocated`: colocated workers). With more than one, a
    /// request whose decode worker dies moves to another (see the router's `--max-migrations`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    decode_workers: u32,
    /// Inter-token latency target of the decode (or colocated) workers, in ms (0: off)
    /// [default: the workers' default, 100].
    #[arg(long, value_name = "MS")]
    itl_target_ms: Option<u64>,
    /// Share this host's cores between prefill and decode workers on the CPU (true or false):
    /// decode workers on the CPU pace their steps to the latency target while their prompts are
    /// prefilled (`--pace-steps`), and prefill workers on the CPU run at a lower priority (nice
    /// 10), so that prompts never slow a decode step and get every core the decodes leave
    /// [default: true when a prefill and a decode worker are both on the CPU and the workers on the
    /// CPU have more threads together than the host has cores, as they do without --threads]
    #[arg(long, value_name = "BOOL")]
    share_cpu: Option<bool>,
    /// A LoRA adapter every worker loads at start: NAME=PATH, a PEFT directory or a GGUF LoRA
    /// file (repeatable; docs/lora.md). Requests name it in `model`.
    #[arg(long = "lora", value_name = "NAME=PATH", value_parser = tandem_worker::args::parse_lora)]
    lora: Vec<LoraSpec>,
    /// Most LoRA adapters resident at once on each worker (0: none) [default: the workers'
    /// default, 8].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=tandem_worker::args::MAX_LORA_SLOTS as i64))]
    max_loras: Option<u32>,
    /// Speculative decoding on the decode (or colocated) worker.
    #[command(flatten)]
    speculation: SpeculationArgs,
    /// Routers to start (replicas: every worker registers with each, and each serves clients on
    /// its own addresses). The first takes `--listen` and `--http-listen`; the others take free
    /// ports, all named on the ready line.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    routers: u32,
    /// Address of the (first) router's gRPC server.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Address of the router's HTTP server (OpenAI-compatible API, /health, /ready, /metrics).
    #[arg(long, default_value = "127.0.0.1:0")]
    http_listen: String,
    /// API key clients must present to the router [default: none, the client APIs are open].
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// File whose first line is the API key.
    #[arg(long, env = "TANDEM_API_KEY_FILE")]
    api_key_file: Option<PathBuf>,
    /// Key the router's admin API asks for (loading and unloading LoRA adapters at run time,
    /// docs/lora.md) [default: none, the admin API is off].
    #[arg(long, env = "TANDEM_ADMIN_KEY", hide_env_values = true, conflicts_with = "admin_key_file")]
    admin_key: Option<String>,
    /// File whose first line is the admin key.
    #[arg(long, env = "TANDEM_ADMIN_KEY_FILE")]
    admin_key_file: Option<PathBuf>,
    /// Secret the router and workers present to each other [default: a random one for this run].
    #[arg(
        long,
        env = "TANDEM_CLUSTER_SECRET",
        hide_env_values = true,
        conflicts_with = "cluster_secret_file"
    )]
    cluster_secret: Option<String>,
    /// File whose first line is the cluster secret.
    #[arg(long, env = "TANDEM_CLUSTER_SECRET_FILE")]
    cluster_secret_file: Option<PathBuf>,
    /// On SIGINT/SIGTERM, how long the router's (then each worker's) requests in flight may take
    /// to finish, in ms; given to every child as its `--drain-timeout-ms`, and each gets 10 s
    /// more than this to exit before it is killed.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_MS", default_value_t = 30_000, value_name = "MS")]
    drain_timeout_ms: u64,
    /// Who computes a prompt no prefill worker can (none left, or its KV transfer failed):
    /// `decode` (the decode worker) or `fail` (a retryable error); given to every router
    /// [default: the router's default, decode].
    #[arg(long, value_name = "POLICY", value_parser = ["decode", "fail"])]
    prefill_fallback: Option<String>,
    /// How long a request whose worker was lost before its first token waits for one to come
    /// back (a restarted one), in ms; given to every router [default: the router's default, 10000].
    #[arg(long, value_name = "MS")]
    lost_worker_wait_ms: Option<u64>,
    /// Longest wait for the cluster to become ready, in seconds.
    #[arg(long, default_value_t = 300)]
    startup_timeout_s: u64,
    /// TLS on every port with a throwaway CA made for this run (mutual TLS between the
    /// processes); the ready line names the CA file clients verify the router with (`ca=`).
    #[arg(long)]
    tls: bool,
    /// Log filter of the router and the workers, in `RUST_LOG` syntax: a level (`warn`) or
    /// per-crate directives (`info,tandem_router=debug`) [default: `RUST_LOG` from this
    /// environment, else the servers' default, info].
    #[arg(long, value_name = "FILTER", value_parser = parse_log_filter)]
    log_level: Option<String>,
    /// Append the router's and the workers' log lines (each with its `[name]` prefix) to this
    /// file instead of stderr; `tandem up`'s own messages stay on stderr.
    #[arg(long, value_name = "PATH")]
    log_file: Option<PathBuf>,
}

/// Checks a `--log-level` filter the way the children's logging will read it.
fn parse_log_filter(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("empty filter; give a level such as warn or info".into());
    }
    tracing_subscriber::EnvFilter::try_new(s).map(|_| s.to_owned()).map_err(|e| e.to_string())
}

/// Where the children's stderr lines go: our stderr, or the `--log-file`. Lines from several
/// children are written whole, one at a time, so they never interleave within a line.
#[derive(Clone)]
enum LogSink {
    Stderr,
    File(Arc<Mutex<std::fs::File>>),
}

impl LogSink {
    fn open(path: Option<&Path>) -> Result<LogSink> {
        let Some(path) = path else { return Ok(LogSink::Stderr) };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("--log-file {}: cannot open it for appending", path.display()))?;
        Ok(LogSink::File(Arc::new(Mutex::new(file))))
    }

    /// Writes one line; a failed write is dropped, as a closed terminal would drop it: a child's
    /// logs must never stop the cluster.
    fn line(&self, prefix: &str, line: &str) {
        let _ = match self {
            LogSink::Stderr => writeln!(std::io::stderr().lock(), "{prefix}{line}"),
            LogSink::File(f) => writeln!(f.lock().unwrap_or_else(|e| e.into_inner()), "{prefix}{line}"),
        };
    }
}

/// The certificates of a `--tls` run, in a directory removed when dropped.
struct TlsDir {
    dir: PathBuf,
    certs: tandem_serve::tls::dev::ClusterCerts,
}

impl TlsDir {
    fn create() -> Result<TlsDir> {
        let dir = std::env::temp_dir().join(format!(
            "tandem-up-tls-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let certs = tandem_serve::tls::dev::write_cluster_certs(&dir);
        match certs {
            Ok(certs) => Ok(TlsDir { dir, certs }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e).context("making the cluster's certificates")
            }
        }
    }
}

impl Drop for TlsDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The signal that asked us to stop (0: none yet).
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    STOP_SIGNAL.store(sig, Ordering::SeqCst);
}

fn install_signal_handlers() -> Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `on_signal` only stores to an atomic, which is async-signal-safe; the sigaction
        // struct is zero-initialised (a valid empty mask and no flags) before we fill it.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            bail!("installing the handler for signal {sig}: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn stop_requested() -> Option<&'static str> {
    match STOP_SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        libc::SIGINT => Some("SIGINT"),
        _ => Some("SIGTERM"),
    }
}

/// What a child is in the cluster: the role its restarts are counted under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Router,
    Worker(Role),
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Router => "router",
            Kind::Worker(role) => role.name(),
        }
    }
}

/// How a child is started, kept with it so that one that died is started again the same way.
#[derive(Debug, Clone)]
struct Spec {
    /// `router`, `prefill-1`, ...: the `[name]` prefix of its stderr lines.
    name: String,
    kind: Kind,
    program: PathBuf,
    args: Vec<String>,
    /// Variables set (`Some`) or removed (`None`) in the child's environment; the rest is ours.
    env: Vec<(String, Option<String>)>,
    /// Scheduling priority (0: ours).
    nice: i32,
    /// A worker's device, named with it in what we print about it.
    device: Option<Device>,
}

impl Spec {
    /// Sets `flag`'s value in `args` (the flag must be there, followed by its value).
    fn set_arg(&mut self, flag: &str, value: String) {
        match self.args.iter().position(|a| a == flag) {
            Some(i) if i + 1 < self.args.len() => self.args[i + 1] = value,
            _ => debug_assert!(false, "{} has no {flag} to set", self.name),
        }
    }
}

/// An environment for [`Spec::env`], from borrowed pairs.
fn owned_env(env: &[(&str, Option<&str>)]) -> Vec<(String, Option<String>)> {
    env.iter().map(|(k, v)| ((*k).to_owned(), v.map(str::to_owned))).collect()
}

/// One child process.
struct Proc {
    spec: Spec,
    child: Child,
    stdout: mpsc::Receiver<String>,
    tail: Arc<Mutex<VecDeque<String>>>,
    /// Closed when the child's stderr reaches its end (all of it is in `tail`).
    stderr_done: mpsc::Receiver<()>,
    status: Option<ExitStatus>,
}

impl Proc {
    /// Starts the child `spec` describes; its stderr lines go to `logs`. Must be called from the
    /// main thread: the child's parent-death signal follows the thread that forked it.
    fn spawn(spec: Spec, logs: &LogSink) -> Result<Proc> {
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in &spec.env {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        let parent = std::process::id() as libc::pid_t;
        let nice = spec.nice;
        // SAFETY: between fork and exec only async-signal-safe calls are made (setpgid, prctl,
        // getppid, _exit). PR_SET_PDEATHSIG makes the kernel send SIGTERM to the child when the
        // thread that forked it (our main thread, which lives as long as the process) ends; the
        // getppid check covers a parent that died before prctl took effect.
        unsafe {
            cmd.pre_exec(move || {
                libc::setpgid(0, 0);
                // Lowering one's own priority needs no privilege; its threads inherit it.
                if nice != 0 && libc::setpriority(libc::PRIO_PROCESS, 0, nice) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().with_context(|| format!("starting {}", spec.program.display()))?;
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let (done_tx, stderr_done) = mpsc::channel::<()>();
        if let Some(err) = child.stderr.take() {
            let (tail, prefix, logs) = (tail.clone(), format!("[{}] ", spec.name), logs.clone());
            std::thread::spawn(move || {
                let _done = done_tx; // dropped at the end of the stream
                for line in BufReader::new(err).lines() {
                    let Ok(line) = line else { break };
                    logs.line(&prefix, &line);
                    let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                    if t.len() == TAIL_LINES {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            });
        }
        let (tx, rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                // Keep draining after the receiver is gone, so the child never blocks on stdout.
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    let _ = tx.send(line);
                }
            });
        }
        Ok(Proc { spec, child, stdout: rx, tail, stderr_done, status: None })
    }

    fn name(&self) -> &str {
        &self.spec.name
    }

    /// Its last stderr lines, indented; waits (a second at most) for the reader to catch up with
    /// what a child that exited wrote before it did.
    fn tail(&self) -> String {
        if self.status.is_some() {
            let _ = self.stderr_done.recv_timeout(Duration::from_secs(1));
        }
        let t = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        if t.is_empty() {
            return "  (no output on stderr)".into();
        }
        t.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
    }

    /// The exit status once the child has exited.
    fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    fn signal(&self, sig: libc::c_int) {
        if self.status.is_none() {
            // SAFETY: signalling our own child, which has not been reaped (status is None).
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, sig);
            }
        }
    }

    /// `<name> (pid <pid>[, on <device>]) exited (<status>)`.
    fn exit_summary(&self, status: ExitStatus) -> String {
        let on = self.spec.device.map(|d| format!(", on {d}")).unwrap_or_default();
        format!("{} (pid {}{on}) exited ({status})", self.name(), self.child.id())
    }

    fn died(&self, status: ExitStatus) -> anyhow::Error {
        anyhow!("{}; its last stderr lines:\n{}", self.exit_summary(status), self.tail())
    }
}

/// First wait before a restart.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// Longest wait before a restart.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Most restarts of one child within [`RESTART_WINDOW`].
const RESTART_BUDGET: usize = 5;
/// The window of the restart budget; also how long a child must have run for its next restart to
/// wait [`FIRST_BACKOFF`] again.
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// When a child that exited is started again, and when it is left down: the supervisor's whole
/// decision, pure, with time passed in.
///
/// Invariants: the wait before a restart is [`FIRST_BACKOFF`] at first, doubles with each restart,
/// never exceeds [`MAX_BACKOFF`], and is [`FIRST_BACKOFF`] again after a run of
/// [`RESTART_WINDOW`] or more; at most [`RESTART_BUDGET`] restarts are decided within any
/// [`RESTART_WINDOW`] (the exit that would be one more is answered [`Decision::GiveUp`]).
#[derive(Debug, Clone)]
struct RestartPolicy {
    /// The wait before the next restart.
    backoff: Duration,
    /// When the exits that were restarted happened, those within the last window only.
    restarts: VecDeque<Instant>,
    /// When the child last started.
    started: Instant,
}

/// What to do about a child that exited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    /// Start it again at `at`, `wait` after its exit; it is the `nth` restart in the window.
    RestartAt { at: Instant, wait: Duration, nth: usize },
    /// It exited past its budget: leave it down.
    GiveUp,
}

impl RestartPolicy {
    fn new(started: Instant) -> RestartPolicy {
        RestartPolicy { backoff: FIRST_BACKOFF, restarts: VecDeque::new(), started }
    }

    /// The child runs (again) from `now`.
    fn on_started(&mut self, now: Instant) {
        self.started = now;
    }

    /// The child exited (or could not be started again) at `now`.
    fn on_exit(&mut self, now: Instant) -> Decision {
        // A child that ran a while was healthy: this exit is news, not a crash loop.
        if now.saturating_duration_since(self.started) >= RESTART_WINDOW {
            self.backoff = FIRST_BACKOFF;
        }
        while self.restarts.front().is_some_and(|&t| now.saturating_duration_since(t) >= RESTART_WINDOW) {
            self.restarts.pop_front();
        }
        if self.restarts.len() >= RESTART_BUDGET {
            return Decision::GiveUp;
        }
        self.restarts.push_back(now);
        let wait = self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        Decision::RestartAt { at: now + wait, wait, nth: self.restarts.len() }
    }
}

/// The order roles are named in the restart status line.
const KINDS: [Kind; 4] =
    [Kind::Router, Kind::Worker(Role::Prefill), Kind::Worker(Role::Decode), Kind::Worker(Role::Colocated)];

/// Restarts per role since `tandem up` began, for the status line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RestartCounts(Vec<(Kind, u32)>);

impl RestartCounts {
    /// Zero for each kind in `present`, in the order of [`KINDS`].
    fn new(present: impl IntoIterator<Item = Kind>) -> RestartCounts {
        let present: Vec<Kind> = present.into_iter().collect();
        RestartCounts(KINDS.iter().filter(|k| present.contains(k)).map(|&k| (k, 0)).collect())
    }

    /// Counts one restart of a `kind` child; returns that kind's total.
    fn add(&mut self, kind: Kind) -> u32 {
        match self.0.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                self.0.push((kind, 1));
                1
            }
        }
    }

    /// `restarts: router=0 prefill=1 decode=0`.
    fn line(&self) -> String {
        let parts: Vec<String> = self.0.iter().map(|(k, n)| format!("{}={n}", k.name())).collect();
        format!("restarts: {}", parts.join(" "))
    }
}

/// What the supervisor knows of a child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watch {
    /// Running, as far as we have seen.
    Up,
    /// Exited; to be started again at this time.
    RestartAt(Instant),
    /// Exited past its budget; stays down.
    Down,
}

/// Keeps the cluster's children running once it is ready (see the module comment).
struct Supervisor<'a> {
    logs: &'a LogSink,
    /// One per child, in the order of the children.
    children: Vec<(RestartPolicy, Watch)>,
}

impl Supervisor<'_> {
    fn new(logs: &LogSink, n: usize, now: Instant) -> Supervisor<'_> {
        Supervisor { logs, children: vec![(RestartPolicy::new(now), Watch::Up); n] }
    }

    /// One look at every child: notes exits, starts those whose wait is over. Fails when no router
    /// is left to serve.
    fn tick(&mut self, procs: &mut [Proc], counts: &mut RestartCounts, now: Instant) -> Result<()> {
        for (p, (policy, watch)) in procs.iter_mut().zip(&mut self.children) {
            match *watch {
                Watch::Up => {
                    if let Some(st) = p.exited() {
                        *watch = decide(p, p.exit_summary(st), policy, counts, now);
                    }
                }
                Watch::RestartAt(at) if now >= at => match Proc::spawn(p.spec.clone(), self.logs) {
                    Ok(new) => {
                        eprintln!("tandem up: {} restarted (pid {})", new.name(), new.child.id());
                        policy.on_started(now);
                        *p = new;
                        *watch = Watch::Up;
                    }
                    Err(e) => {
                        let what = format!("{} could not be started again ({e:#})", p.name());
                        *watch = decide(p, what, policy, counts, now);
                    }
                },
                Watch::RestartAt(_) | Watch::Down => {}
            }
        }
        let mut routers = procs.iter().zip(&self.children).filter(|(p, _)| p.spec.kind == Kind::Router);
        if routers.all(|(_, (_, w))| *w == Watch::Down) {
            bail!(
                "every router exited more than {RESTART_BUDGET} times in {} s and will not be restarted; \
                 the cluster cannot serve",
                RESTART_WINDOW.as_secs()
            );
        }
        Ok(())
    }
}

/// Asks `policy` about `p`'s exit (`what` says how it ended), says on stderr what follows, and
/// returns the child's next state.
fn decide(
    p: &Proc,
    what: String,
    policy: &mut RestartPolicy,
    counts: &mut RestartCounts,
    now: Instant,
) -> Watch {
    match policy.on_exit(now) {
        Decision::RestartAt { at, wait, nth } => {
            let total = counts.add(p.spec.kind);
            eprintln!(
                "tandem up: {what}; restarting it in {} s (restart {nth} of {RESTART_BUDGET} in {} s, {} \
                 restarts: {total})",
                wait.as_secs_f64(),
                RESTART_WINDOW.as_secs(),
                p.spec.kind.name()
            );
            Watch::RestartAt(at)
        }
        Decision::GiveUp => {
            eprintln!(
                "tandem up: {what} after {RESTART_BUDGET} restarts in {} s; it will not be restarted again; \
                 its last stderr lines:\n{}",
                RESTART_WINDOW.as_secs(),
                p.tail()
            );
            Watch::Down
        }
    }
}

/// What interrupted a wait: a stop signal (graceful, exit 0) or a failure.
enum Interrupt {
    Signal(&'static str),
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for Interrupt {
    fn from(e: anyhow::Error) -> Self {
        Interrupt::Failed(e)
    }
}

/// Checks for a stop signal and for children that died.
fn check(procs: &mut [Proc]) -> Result<(), Interrupt> {
    if let Some(sig) = stop_requested() {
        return Err(Interrupt::Signal(sig));
    }
    for p in procs.iter_mut() {
        if let Some(st) = p.exited() {
            return Err(Interrupt::Failed(p.died(st)));
        }
    }
    Ok(())
}

/// Waits for child `i`'s `listening grpc=..` line.
fn wait_listening(procs: &mut [Proc], i: usize, deadline: Instant) -> Result<Listening, Interrupt> {
    loop {
        check(procs)?;
        match procs[i].stdout.recv_timeout(Duration::from_millis(100)) {
            Ok(line) => {
                if let Some(l) = parse_listening(&line) {
                    return Ok(l);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // Stdout closed: the child is exiting; `check` reports it once it has.
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if Instant::now() >= deadline {
            let p = &procs[i];
            return Err(Interrupt::Failed(anyhow!(
                "{} did not report a listening address in time; its last stderr lines:\n{}",
                p.name(),
                p.tail()
            )));
        }
    }
}

/// Polls the router's `Health` until it serves with `want` healthy workers.
fn wait_serving(
    procs: &mut [Proc],
    router: SocketAddr,
    api_key: Option<&Secret>,
    tls_ca: Option<&Path>,
    want: usize,
    deadline: Instant,
) -> Result<(), Interrupt> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    loop {
        check(procs)?;
        let answer = rt.block_on(async {
            let ch = crate::remote::connect(&router.to_string(), tls_ca).await?;
            let mut client = TandemClient::new(ch);
            let mut req = tonic::Request::new(HealthRequest {});
            if let Some(key) = api_key {
                let v = format!("Bearer {}", key.expose()).parse().context("the API key as a header")?;
                req.metadata_mut().insert("authorization", v);
            }
            let fut = client.health(req);
            let h = tokio::time::timeout(Duration::from_secs(2), fut)
                .await
                .map_err(|_| anyhow!("Health timed out"))?
                .map_err(|s| anyhow!("Health failed: {}", s.message()))?;
            Ok::<_, anyhow::Error>(h.into_inner())
        });
        let last = match answer {
            Ok(h) if h.serving && h.workers.iter().filter(|w| w.healthy).count() >= want => return Ok(()),
            Ok(h) => h.message,
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() >= deadline {
            let tails: Vec<String> = procs.iter().map(|p| format!("[{}]\n{}", p.name(), p.tail())).collect();
            return Err(Interrupt::Failed(anyhow!(
                "the router did not become ready in time (last health: {last}); the children's last stderr lines:\n{}",
                tails.join("\n")
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The server binaries sit next to `tandem`.
fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the tandem executable")?;
    let dir = exe.parent().ok_or_else(|| anyhow!("{} has no parent directory", exe.display()))?;
    let p = dir.join(name);
    if !p.is_file() {
        bail!(
            "{} not found: `tandem up` runs the server binaries next to the tandem executable; build \
             them with `cargo build --workspace --bins` (add --release for release builds)",
            p.display()
        );
    }
    Ok(p)
}

/// Where the workers go, checked against `--transport`: refused before any child starts.
fn placement(a: &UpArgs) -> Result<Placement> {
    let flags = DeviceFlags {
        device: a.device.as_ref(),
        prefill: a.prefill_device.as_ref(),
        decode: a.decode_device.as_ref(),
    };
    let p = Placement::new(flags, a.colocated, a.prefill_workers, a.decode_workers);
    p.check_transport(a.transport.unwrap_or(Transport::Auto)).map_err(|e| anyhow!(e))?;
    Ok(p)
}

/// Scheduling priority of prefill workers that share the CPU with decode workers (see
/// `--share-cpu`).
const PREFILL_NICE: i32 = 10;

/// Whether prefill and decode workers share this host's cores (`--share-cpu`; by default when
/// both roles have a worker on the CPU and their threads together outnumber the cores); never
/// with the latency target off, which pacing needs.
fn shares_cpu(a: &UpArgs, p: &Placement, cores: usize) -> bool {
    let on_cpu = |role: Role| p.roles.iter().any(|(r, d)| *r == role && d.contains(&Device::Cpu));
    let both = on_cpu(Role::Prefill) && on_cpu(Role::Decode);
    let cpu_workers: usize =
        p.roles.iter().map(|(_, d)| d.iter().filter(|&&x| x == Device::Cpu).count()).sum();
    // Without --threads every worker uses every core.
    let compete = a.threads.is_none_or(|t| t.saturating_mul(cpu_workers) > cores);
    // The workers inherit this process's environment, TANDEM_ITL_TARGET_MS included.
    let target = a.itl_target_ms.or_else(|| std::env::var("TANDEM_ITL_TARGET_MS").ok()?.trim().parse().ok());
    a.share_cpu.unwrap_or(both && compete) && both && target != Some(0)
}

fn worker_args(
    a: &UpArgs,
    model: &Path,
    router: &str,
    role: Role,
    index: u32,
    device: Device,
    pace: bool,
) -> Vec<String> {
    let role = role.name();
    let mut v: Vec<String> = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--router".into(),
        router.to_string(),
        "--model".into(),
        model.display().to_string(),
        "--worker-id".into(),
        format!("{role}-{index}"),
        "--device".into(),
        device.to_string(),
        "--drain-timeout-ms".into(),
        a.drain_timeout_ms.to_string(),
    ];
    let mut opt = |flag: &str, value: Option<String>| {
        if let Some(value) = value {
            v.push(flag.into());
            v.push(value);
        }
    };
    opt("--threads", a.threads.map(|x| x.to_string()));
    opt("--kv-blocks", a.kv_blocks.map(|x| x.to_string()));
    opt("--block-size", a.block_size.map(|x| x.to_string()));
    opt("--max-batch-tokens", a.max_batch_tokens.map(|x| x.to_string()));
    opt("--transport", a.transport.map(|t| t.name().to_owned()));
    opt("--nixl-lib", a.nixl_lib.as_ref().map(|d| d.display().to_string()));
    opt("--nixl-backend", a.nixl_backend.clone());
    opt("--kv-dtype", a.kv_dtype.map(|x| x.to_string()));
    opt("--prefix-cache", a.prefix_cache.map(|x| x.to_string()));
    opt("--windowed-kv", a.windowed_kv.map(|x| x.to_string()));
    opt("--kv-host-bytes", a.kv_host_bytes.clone());
    opt(
        "--kv-disk-dir",
        a.kv_disk_dir.as_ref().map(|d| d.join(format!("{role}-{index}")).display().to_string()),
    );
    opt("--kv-disk-bytes", a.kv_disk_bytes.clone());
    opt("--kv-disk-persist", a.kv_disk_persist.map(|x| x.to_string()));
    opt("--activations", a.activations.map(|x| x.to_string()));
    opt("--max-loras", a.max_loras.map(|x| x.to_string()));
    for l in &a.lora {
        v.extend(["--lora".into(), l.to_string()]);
    }
    if role != "prefill" {
        v.extend(["--kv-listen".into(), "127.0.0.1:0".into()]);
    }
    if role == "colocated" {
        v.push("--colocated".into());
    }
    if role != "prefill" {
        v.extend(a.speculation.to_args());
        if let Some(ms) = a.itl_target_ms {
            v.extend(["--itl-target-ms".into(), ms.to_string()]);
        }
        if pace {
            v.push("--pace-steps".into());
        }
    }
    v
}

/// The `--lora` adapters, before anything starts: no name twice, slots for them (when
/// `--max-loras` is given), and something at each path (the workers check the rest).
fn check_loras(a: &UpArgs) -> Result<()> {
    tandem_worker::args::check_loras(&a.lora, a.max_loras.unwrap_or(1)).map_err(|e| anyhow!(e))?;
    for l in &a.lora {
        if !l.path.exists() {
            bail!("--lora {l}: nothing at {}", l.path.display());
        }
    }
    Ok(())
}

/// A random cluster secret for one run: 32 hex digits (128 bits).
fn random_secret() -> String {
    (0..4).map(|_| format!("{:08x}", rand::random::<u32>())).collect()
}

/// Starts the cluster and waits until it is ready, then keeps it running until a stop signal or
/// until no router is left; `restarts` is set once the cluster is ready and counts from there.
fn start_and_run(
    a: &UpArgs,
    procs: &mut Vec<Proc>,
    tls: Option<&tandem_serve::tls::dev::ClusterCerts>,
    restarts: &mut Option<RestartCounts>,
) -> Result<(), Interrupt> {
    let placement = placement(a)?;
    let model = resolve_model(a.model.as_deref()).map_err(anyhow::Error::from)?;
    a.speculation.validate().map_err(anyhow::Error::from)?;
    check_loras(a)?;
    if let Some(draft) = &a.speculation.draft_model {
        resolve_model(Some(draft)).context("--draft-model")?;
    }
    // Checked here, so a bad key or secret file fails before anything starts.
    let api_key = load_secret(a.api_key.as_deref(), a.api_key_file.as_deref(), "api-key")
        .map_err(anyhow::Error::from)?;
    load_secret(a.cluster_secret.as_deref(), a.cluster_secret_file.as_deref(), "cluster-secret")
        .map_err(anyhow::Error::from)?;
    load_secret(a.admin_key.as_deref(), a.admin_key_file.as_deref(), "admin-key")
        .map_err(anyhow::Error::from)?;
    let logs = LogSink::open(a.log_file.as_deref())?;
    let router_bin = sibling("tandem-router")?;
    let decode_bin = sibling("tandem-decode")?;
    let prefill_bin = if a.colocated { None } else { Some(sibling("tandem-prefill")?) };
    let deadline = Instant::now() + Duration::from_secs(a.startup_timeout_s);
    let generated;
    let cluster_file = a.cluster_secret_file.as_ref().map(|p| p.display().to_string());
    let cluster_value = match (&a.cluster_secret, &cluster_file) {
        (Some(v), _) => Some(v.as_str()),
        (None, Some(_)) => None,
        (None, None) => {
            generated = random_secret();
            Some(generated.as_str())
        }
    };
    let key_file = a.api_key_file.as_ref().map(|p| p.display().to_string());
    let admin_file = a.admin_key_file.as_ref().map(|p| p.display().to_string());
    let cluster_env =
        [("TANDEM_CLUSTER_SECRET", cluster_value), ("TANDEM_CLUSTER_SECRET_FILE", cluster_file.as_deref())];
    let path = |p: &Path| p.display().to_string();
    let (cert, key, ca) = match tls {
        Some(t) => (Some(path(&t.cert)), Some(path(&t.key)), Some(path(&t.ca))),
        None => (None, None, None),
    };
    let tls_env = [
        ("TANDEM_TLS_CERT", cert.as_deref()),
        ("TANDEM_TLS_KEY", key.as_deref()),
        ("TANDEM_TLS_CLIENT_CA", ca.as_deref()),
        ("TANDEM_TLS_CA", None),
    ];
    let mut router_env = vec![
        cluster_env[0],
        cluster_env[1],
        ("TANDEM_API_KEY", a.api_key.as_deref()),
        ("TANDEM_API_KEY_FILE", key_file.as_deref()),
        ("TANDEM_ADMIN_KEY", a.admin_key.as_deref()),
        ("TANDEM_ADMIN_KEY_FILE", admin_file.as_deref()),
    ];
    // Workers take no API key; keep one set in our environment off them.
    let mut worker_env = vec![
        cluster_env[0],
        cluster_env[1],
        ("TANDEM_API_KEY", None),
        ("TANDEM_API_KEY_FILE", None),
        ("TANDEM_ADMIN_KEY", None),
        ("TANDEM_ADMIN_KEY_FILE", None),
    ];
    router_env.extend(tls_env);
    worker_env.extend(tls_env);
    // Without --log-level the children inherit our RUST_LOG, as they always did.
    if let Some(filter) = a.log_level.as_deref() {
        router_env.push(("RUST_LOG", Some(filter)));
        worker_env.push(("RUST_LOG", Some(filter)));
    }

    let n_routers = a.routers as usize;
    for i in 0..n_routers {
        let (listen, http_listen) = if i == 0 {
            (a.listen.clone(), a.http_listen.clone())
        } else {
            ("127.0.0.1:0".into(), "127.0.0.1:0".into())
        };
        let mut rargs: Vec<String> = vec![
            "--listen".into(),
            listen,
            "--http-listen".into(),
            http_listen,
            "--model".into(),
            model.display().to_string(),
            "--drain-timeout-ms".into(),
            a.drain_timeout_ms.to_string(),
        ];
        if let Some(name) = &a.served_model_name {
            rargs.extend(["--served-model-name".into(), name.clone()]);
        }
        if let Some(policy) = &a.prefill_fallback {
            rargs.extend(["--prefill-fallback".into(), policy.clone()]);
        }
        if let Some(ms) = a.lost_worker_wait_ms {
            rargs.extend(["--lost-worker-wait-ms".into(), ms.to_string()]);
        }
        let name = if n_routers == 1 { "router".to_owned() } else { format!("router-{i}") };
        let spec = Spec {
            name,
            kind: Kind::Router,
            program: router_bin.clone(),
            args: rargs,
            env: owned_env(&router_env),
            nice: 0,
            device: None,
        };
        procs.push(Proc::spawn(spec, &logs)?);
    }
    let mut routers = Vec::with_capacity(n_routers);
    for i in 0..n_routers {
        let listening = wait_listening(procs, i, deadline)?;
        let Some(http) = listening.http else {
            return Err(Interrupt::Failed(anyhow!("the router's listening line names no http address")));
        };
        // A router started again binds what it bound now, even when it was given port 0: the
        // workers and the clients know it by these addresses.
        procs[i].spec.set_arg("--listen", listening.grpc.to_string());
        procs[i].spec.set_arg("--http-listen", http.to_string());
        routers.push((listening.grpc, http));
    }
    let (router, http) = routers[0];
    let router_list = routers.iter().map(|(g, _)| g.to_string()).collect::<Vec<_>>().join(",");

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = shares_cpu(a, &placement, cores);
    if let Some(dir) = &a.kv_disk_dir {
        // Each worker's own subdirectory, kept across restarts; the parent must exist.
        if !dir.is_dir() {
            return Err(Interrupt::Failed(anyhow!("--kv-disk-dir {}: no such directory", dir.display())));
        }
        for (role, devices) in &placement.roles {
            for i in 0..devices.len() {
                let sub = dir.join(format!("{}-{i}", role.name()));
                std::fs::create_dir_all(&sub).map_err(|e| {
                    Interrupt::Failed(anyhow!("--kv-disk-dir: cannot create {}: {e}", sub.display()))
                })?;
            }
        }
    }
    for (role, devices) in &placement.roles {
        let bin = match (role, &prefill_bin) {
            (Role::Prefill, Some(prefill_bin)) => prefill_bin.as_path(),
            _ => decode_bin.as_path(),
        };
        let n = devices.len();
        for (i, &device) in devices.iter().enumerate() {
            let on_shared_cpu = share && device == Device::Cpu;
            let pace = on_shared_cpu && *role == Role::Decode;
            let args = worker_args(a, &model, &router_list, *role, i as u32, device, pace);
            // A lone worker of a role keeps the plain name its logs always had.
            let name = if n == 1 { role.name().to_owned() } else { format!("{}-{i}", role.name()) };
            let nice = if on_shared_cpu && *role == Role::Prefill { PREFILL_NICE } else { 0 };
            let spec = Spec {
                name,
                kind: Kind::Worker(*role),
                program: bin.to_owned(),
                args,
                env: owned_env(&worker_env),
                nice,
                device: Some(device),
            };
            procs.push(Proc::spawn(spec, &logs)?);
        }
    }
    for i in n_routers..procs.len() {
        wait_listening(procs, i, deadline)?;
    }
    let workers = procs.len() - n_routers;
    for &(grpc, _) in &routers {
        wait_serving(procs, grpc, api_key.as_ref(), tls.map(|t| t.ca.as_path()), workers, deadline)?;
    }

    let ca_field = tls.map(|t| format!(" ca={}", t.ca.display())).unwrap_or_default();
    // Every router's addresses when there are several (the first stays `router=` / `http=`).
    let routers_field = if n_routers > 1 {
        let https = routers.iter().map(|(_, h)| h.to_string()).collect::<Vec<_>>().join(",");
        format!(" routers={router_list} routers_http={https}")
    } else {
        String::new()
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready router={router} http={http}{routers_field}{ca_field}")
        .and_then(|_| out.flush())
        .context("writing the ready line")?;
    drop(out);
    eprintln!(
        "tandem up: cluster ready, router at {router} (gRPC) and {}://{http} (HTTP), workers {}; Ctrl-C \
         stops it",
        if tls.is_some() { "https" } else { "http" },
        placement.summary()
    );
    let counts = restarts.insert(RestartCounts::new(procs.iter().map(|p| p.spec.kind)));
    let mut supervisor = Supervisor::new(&logs, procs.len(), Instant::now());
    loop {
        if let Some(sig) = stop_requested() {
            return Err(Interrupt::Signal(sig));
        }
        supervisor.tick(procs, counts, Instant::now())?;
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How long a child given `--drain-timeout-ms drain` has to exit once told to stop, before
/// SIGKILL: never less than its drain.
fn grace(drain: Duration) -> Duration {
    drain.saturating_add(AFTER_DRAIN)
}

/// Stops the children: the `n_routers` routers first (they finish the requests in flight), then
/// the workers; SIGKILL for any still running after the grace period ([`grace`] of `drain`).
fn stop_all(procs: &mut [Proc], n_routers: usize, drain: Duration) {
    let (router, workers) = procs.split_at_mut(n_routers.min(procs.len()));
    let grace = grace(drain);
    for group in [router, workers] {
        for p in group.iter() {
            p.signal(libc::SIGTERM);
        }
        // A grace too long to add to the clock (a huge --drain-timeout-ms) is no deadline.
        let deadline = Instant::now().checked_add(grace);
        while group.iter_mut().any(|p| p.exited().is_none()) && deadline.is_none_or(|d| Instant::now() < d) {
            std::thread::sleep(Duration::from_millis(50));
        }
        for p in group.iter_mut() {
            if p.exited().is_none() {
                eprintln!("tandem up: {} did not stop within {grace:?}; killing it", p.name());
                let _ = p.child.kill();
                p.status = p.child.wait().ok();
            }
        }
    }
}

/// `tandem up`.
pub(crate) fn up(a: UpArgs) -> Result<()> {
    install_signal_handlers()?;
    let tls = if a.tls { Some(TlsDir::create()?) } else { None };
    let mut procs = Vec::new();
    let mut restarts = None;
    let outcome = start_and_run(&a, &mut procs, tls.as_ref().map(|t| &t.certs), &mut restarts);
    match &outcome {
        Err(Interrupt::Signal(sig)) => eprintln!("tandem up: {sig}: stopping the cluster"),
        Err(Interrupt::Failed(_)) if !procs.is_empty() => eprintln!("tandem up: stopping the cluster"),
        _ => {}
    }
    stop_all(&mut procs, a.routers as usize, Duration::from_millis(a.drain_timeout_ms));
    if let Some(counts) = &restarts {
        eprintln!("tandem up: {}", counts.line());
    }
    match outcome {
        Ok(()) | Err(Interrupt::Signal(_)) => Ok(()),
        Err(Interrupt::Failed(e)) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    fn parse(args: &[&str]) -> Result<UpArgs, String> {
        let argv = std::iter::once("up").chain(args.iter().copied());
        Cli::try_parse_from(argv).map(|c| c.up).map_err(|e| e.to_string())
    }

    #[test]
    fn device_and_transport_flags_are_checked_naming_the_flag() {
        for (args, flag) in [
            (&["--prefill-device", "gpu0"][..], "--prefill-device"),
            (&["--decode-device", "cuda:0,cuda:one"], "--decode-device"),
            (&["--device", "cuda:"], "--device"),
            (&["--transport", "rdma"], "--transport"),
        ] {
            let e = parse(args).expect_err("refused");
            assert!(e.contains(flag), "{args:?}: {e}");
        }
        // Colocated workers are placed with --decode-device.
        let e = parse(&["--colocated", "--prefill-device", "cuda:0"]).expect_err("refused");
        assert!(e.contains("--prefill-device") && e.contains("--colocated"), "{e}");
        for t in ["auto", "shm", "tcp", "cuda-ipc", "nccl", "nixl"] {
            let a = parse(&["--transport", t, "--device", "cuda:0", "--decode-device", "cuda:1"]).unwrap();
            assert_eq!(a.transport.map(Transport::name), Some(t));
        }
    }

    #[test]
    fn log_level_is_checked_as_a_filter_naming_the_flag() {
        for bad in ["tandem_router=loud", "", "info,[bad"] {
            let e = parse(&["--log-level", bad]).expect_err("refused");
            assert!(e.contains("--log-level"), "{bad:?}: {e}");
        }
        for good in ["warn", "info,tandem_router=debug", "tandem_engine=trace"] {
            let a = parse(&["--log-level", good]).unwrap();
            assert_eq!(a.log_level.as_deref(), Some(good));
        }
        let a = parse(&[]).unwrap();
        assert!(a.log_level.is_none() && a.log_file.is_none(), "both off unless asked for");
    }

    #[test]
    fn each_worker_is_told_its_device_and_the_transport() {
        let a = parse(&[
            "--device",
            "cuda:3",
            "--decode-device",
            "cuda:0,cuda:1",
            "--decode-workers",
            "3",
            "--transport",
            "cuda-ipc",
        ])
        .unwrap();
        let p = placement(&a).unwrap();
        assert_eq!(
            p.summary(),
            "prefill-0 on cuda:3, decode-0 on cuda:0, decode-1 on cuda:1, decode-2 on cuda:0"
        );
        let args = worker_args(
            &a,
            Path::new("m.gguf"),
            "127.0.0.1:7000,127.0.0.1:7010",
            Role::Decode,
            1,
            Device::Cuda(1),
            false,
        );
        let value = |flag: &str| args.iter().position(|x| x == flag).map(|i| args[i + 1].as_str());
        assert_eq!(value("--router"), Some("127.0.0.1:7000,127.0.0.1:7010"), "every router");
        assert_eq!(value("--device"), Some("cuda:1"));
        assert_eq!(value("--transport"), Some("cuda-ipc"));
        assert_eq!(value("--worker-id"), Some("decode-1"));
        // Refused before anything starts: the message names the transport and the workers.
        let a = parse(&["--decode-device", "cuda:1", "--transport", "nccl"]).unwrap();
        let e = placement(&a).unwrap_err().to_string();
        assert!(e.contains("--transport nccl") && e.contains("the prefill worker is on cpu"), "{e}");
        let a = parse(&["--device", "cuda:0", "--transport", "nccl"]).unwrap();
        let e = placement(&a).unwrap_err().to_string();
        assert!(e.starts_with("NCCL cannot put two ranks on one GPU (cuda:0)"), "{e}");
    }

    /// `--nixl-lib` and `--nixl-backend` reach every worker as they were given, beside
    /// `--transport`; nixl needs no GPU. Unset, the workers keep their defaults.
    #[test]
    fn kv_tier_flags_reach_every_worker_with_its_own_directory() {
        let a = parse(&[
            "--kv-host-bytes",
            "1GiB",
            "--kv-disk-dir",
            "/var/cache/tandem",
            "--kv-disk-bytes",
            "20G",
            "--kv-disk-persist",
            "false",
        ])
        .unwrap();
        for (role, i) in [(Role::Prefill, 0), (Role::Decode, 1), (Role::Colocated, 0)] {
            let args = worker_args(&a, Path::new("m.gguf"), "127.0.0.1:7000", role, i, Device::Cpu, false);
            let value = |flag: &str| args.iter().position(|x| x == flag).map(|i| args[i + 1].clone());
            assert_eq!(value("--kv-host-bytes").as_deref(), Some("1GiB"), "{role:?}");
            let dir = format!("/var/cache/tandem/{}-{i}", role.name());
            assert_eq!(value("--kv-disk-dir"), Some(dir), "{role:?}");
            assert_eq!(value("--kv-disk-bytes").as_deref(), Some("20G"), "{role:?}");
            assert_eq!(value("--kv-disk-persist").as_deref(), Some("false"), "{role:?}");
        }
        let a = parse(&[]).unwrap();
        let args =
            worker_args(&a, Path::new("m.gguf"), "127.0.0.1:7000", Role::Decode, 0, Device::Cpu, false);
        assert!(!args.iter().any(|x| x.starts_with("--kv-host") || x.starts_with("--kv-disk")), "{args:?}");
    }

    #[test]
    fn nixl_flags_reach_every_worker() {
        let a =
            parse(&["--transport", "nixl", "--nixl-lib", "/opt/nixl/lib", "--nixl-backend", "UCX"]).unwrap();
        let p = placement(&a).expect("nixl on CPU workers");
        assert_eq!(p.summary(), "prefill-0 on cpu, decode-0 on cpu");
        for role in [Role::Prefill, Role::Decode, Role::Colocated] {
            let args = worker_args(&a, Path::new("m.gguf"), "127.0.0.1:7000", role, 0, Device::Cpu, false);
            let value = |flag: &str| args.iter().position(|x| x == flag).map(|i| args[i + 1].as_str());
            assert_eq!(value("--transport"), Some("nixl"), "{role:?}");
            assert_eq!(value("--nixl-lib"), Some("/opt/nixl/lib"), "{role:?}");
            assert_eq!(value("--nixl-backend"), Some("UCX"), "{role:?}");
        }
        // With auto, the library directory alone is passed on (it makes the workers offer nixl).
        let a = parse(&["--nixl-lib", "/opt/nixl/lib"]).unwrap();
        let args =
            worker_args(&a, Path::new("m.gguf"), "127.0.0.1:7000", Role::Prefill, 0, Device::Cpu, false);
        assert!(args.windows(2).any(|w| w == ["--nixl-lib", "/opt/nixl/lib"]), "{args:?}");
        assert!(!args.iter().any(|x| x == "--transport" || x == "--nixl-backend"), "{args:?}");
        let a = parse(&[]).unwrap();
        let args =
            worker_args(&a, Path::new("m.gguf"), "127.0.0.1:7000", Role::Decode, 0, Device::Cpu, false);
        assert!(!args.iter().any(|x| x.starts_with("--nixl")), "{args:?}");
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// Exits `run` after each (re)start, `n` times; the waits decided, `None` for a give-up.
    fn crash_loop(p: &mut RestartPolicy, t0: Instant, run: Duration, n: usize) -> Vec<Option<f64>> {
        let mut t = t0;
        let mut waits = Vec::new();
        for _ in 0..n {
            t += run;
            match p.on_exit(t) {
                Decision::RestartAt { at, wait, .. } => {
                    assert_eq!(at, t + wait);
                    waits.push(Some(wait.as_secs_f64()));
                    t = at;
                    p.on_started(t);
                }
                Decision::GiveUp => waits.push(None),
            }
        }
        waits
    }

    #[test]
    fn restart_waits_double_from_half_a_second_up_to_thirty() {
        let t0 = Instant::now();
        // 13 s runs keep the restarts under the budget (never 6 in 60 s) and under the reset.
        let mut p = RestartPolicy::new(t0);
        let waits = crash_loop(&mut p, t0, secs(13.0), 10);
        let want = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0].map(Some);
        assert_eq!(waits, want);
    }

    #[test]
    fn a_child_that_ran_a_minute_waits_half_a_second_again() {
        let t0 = Instant::now();
        let mut p = RestartPolicy::new(t0);
        assert_eq!(crash_loop(&mut p, t0, secs(1.0), 4), [0.5, 1.0, 2.0, 4.0].map(Some));
        let t = p.started + secs(59.9);
        assert!(matches!(p.on_exit(t), Decision::RestartAt { wait, .. } if wait == secs(8.0)), "short run");
        p.on_started(t + secs(8.0));
        let t = t + secs(8.0) + RESTART_WINDOW;
        assert!(matches!(p.on_exit(t), Decision::RestartAt { wait, .. } if wait == FIRST_BACKOFF));
        p.on_started(t + FIRST_BACKOFF);
        let t = t + FIRST_BACKOFF + secs(0.1);
        assert!(
            matches!(p.on_exit(t), Decision::RestartAt { wait, .. } if wait == secs(1.0)),
            "doubles again"
        );
    }

    #[test]
    fn the_sixth_exit_within_a_minute_gives_up() {
        let t0 = Instant::now();
        // Crashing at once: the five restarts take 15.5 s, the sixth exit is refused.
        let mut p = RestartPolicy::new(t0);
        let waits = crash_loop(&mut p, t0, Duration::ZERO, 6);
        assert_eq!(waits, [Some(0.5), Some(1.0), Some(2.0), Some(4.0), Some(8.0), None]);
        // Each restart says which one it is within the window.
        let mut p = RestartPolicy::new(t0);
        let nths: Vec<usize> = (0..5)
            .map(|i| match p.on_exit(t0 + secs(f64::from(i))) {
                Decision::RestartAt { nth, .. } => nth,
                Decision::GiveUp => 0,
            })
            .collect();
        assert_eq!(nths, [1, 2, 3, 4, 5]);
        assert_eq!(p.on_exit(t0 + secs(59.9)), Decision::GiveUp, "six exits within 60 s");
        // The window slides: once the first restart is 60 s old, there is room for one more.
        assert!(matches!(p.on_exit(t0 + secs(60.0)), Decision::RestartAt { nth: 5, .. }));
    }

    #[test]
    fn exits_spread_over_more_than_a_minute_never_give_up() {
        let t0 = Instant::now();
        // 12 s runs and at least 0.5 s of wait: never six exits within 60 s.
        let mut p = RestartPolicy::new(t0);
        let waits = crash_loop(&mut p, t0, secs(12.0), 50);
        assert!(waits.iter().all(Option::is_some), "{waits:?}");
        // Hourly crashes always start from the first wait.
        let mut p = RestartPolicy::new(t0);
        let waits = crash_loop(&mut p, t0, secs(3600.0), 20);
        assert!(waits.iter().all(|w| *w == Some(0.5)), "{waits:?}");
    }

    #[test]
    fn restarts_are_counted_per_role_in_a_stable_line() {
        let kinds = [Kind::Worker(Role::Decode), Kind::Router, Kind::Worker(Role::Prefill), Kind::Router];
        let mut c = RestartCounts::new(kinds);
        assert_eq!(c.line(), "restarts: router=0 prefill=0 decode=0", "roles present, in a fixed order");
        assert_eq!(c.add(Kind::Worker(Role::Prefill)), 1);
        assert_eq!(c.add(Kind::Worker(Role::Prefill)), 2);
        assert_eq!(c.add(Kind::Router), 1);
        assert_eq!(c.line(), "restarts: router=1 prefill=2 decode=0");
        let c = RestartCounts::new([Kind::Router, Kind::Worker(Role::Colocated)]);
        assert_eq!(c.line(), "restarts: router=0 colocated=0");
    }

    #[test]
    fn a_stopped_child_gets_at_least_its_drain_to_exit() {
        for ms in [0, 1, 5_000, 30_000, 600_000, u64::MAX] {
            let drain = Duration::from_millis(ms);
            assert!(grace(drain) >= drain, "{ms} ms");
            assert!(grace(drain) >= AFTER_DRAIN, "{ms} ms");
        }
        assert_eq!(grace(Duration::from_secs(30)), Duration::from_secs(40));
        // Every child is told the drain its grace was computed from.
        let a = parse(&[]).unwrap();
        assert_eq!(a.drain_timeout_ms, 30_000);
        let a = parse(&["--drain-timeout-ms", "120000"]).unwrap();
        let args =
            worker_args(&a, Path::new("m.gguf"), "127.0.0.1:7000", Role::Prefill, 0, Device::Cpu, false);
        let at = args.iter().position(|x| x == "--drain-timeout-ms").expect("the flag");
        assert_eq!(args[at + 1], "120000");
    }

    /// `--lora` (repeatable) and `--max-loras` reach every worker, whatever its role; unset,
    /// the workers keep their defaults. Bad values are refused before anything starts.
    #[test]
    fn lora_flags_reach_every_worker() {
        let a = parse(&["--lora", "sql=/m/sql", "--lora", "chat=/m/chat.gguf", "--max-loras", "2"]).unwrap();
        for (role, i) in [(Role::Prefill, 0), (Role::Decode, 1), (Role::Colocated, 0)] {
            let args = worker_args(&a, Path::new("m.gguf"), "127.0.0.1:7000", role, i, Device::Cpu, false);
            let loras: Vec<&str> =
                args.windows(2).filter(|w| w[0] == "--lora").map(|w| w[1].as_str()).collect();
            assert_eq!(loras, ["sql=/m/sql", "chat=/m/chat.gguf"], "{role:?}");
            let at = args.iter().position(|x| x == "--max-loras").expect("--max-loras");
            assert_eq!(args[at + 1], "2", "{role:?}");
        }
        let none =
            worker_args(&parse(&[]).unwrap(), Path::new("m.gguf"), "r", Role::Decode, 0, Device::Cpu, false);
        assert!(!none.iter().any(|x| x == "--lora" || x == "--max-loras"), "{none:?}");
        let e = parse(&["--lora", "nameless"]).unwrap_err();
        assert!(e.contains("--lora") && e.contains("NAME=PATH"), "{e}");
        let e = check_loras(&parse(&["--lora", "a=/x", "--lora", "a=/y"]).unwrap()).unwrap_err();
        assert!(e.to_string().contains("'a'"), "{e}");
        let e = check_loras(&parse(&["--lora", "a=/x", "--max-loras", "0"]).unwrap()).unwrap_err();
        assert!(e.to_string().contains("--max-loras 0"), "{e}");
        let e = check_loras(&parse(&["--lora", "a=/nonexistent/tandem-up-lora"]).unwrap()).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/tandem-up-lora"), "{e}");
        let dir = std::env::temp_dir();
        check_loras(&parse(&["--lora", &format!("t={}", dir.display())]).unwrap()).unwrap();
    }

    #[test]
    fn a_router_is_started_again_on_the_addresses_it_bound() {
        let mut spec = Spec {
            name: "router".into(),
            kind: Kind::Router,
            program: PathBuf::from("tandem-router"),
            args: ["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--model", "m"]
                .map(String::from)
                .to_vec(),
            env: owned_env(&[("TANDEM_API_KEY", None), ("RUST_LOG", Some("warn"))]),
            nice: 0,
            device: None,
        };
        spec.set_arg("--listen", "127.0.0.1:7000".into());
        spec.set_arg("--http-listen", "127.0.0.1:8000".into());
        assert_eq!(
            spec.args,
            ["--listen", "127.0.0.1:7000", "--http-listen", "127.0.0.1:8000", "--model", "m"]
        );
        assert_eq!(spec.env, [("TANDEM_API_KEY".into(), None), ("RUST_LOG".into(), Some("warn".into()))]);
    }

    #[test]
    fn workers_sharing_the_cpu_are_paced_unless_told_otherwise() {
        let share = |flags: &[&str]| {
            let a = parse(flags).unwrap();
            shares_cpu(&a, &placement(&a).unwrap(), 4)
        };
        assert!(share(&[]), "prefill and decode on the CPU share it");
        assert!(share(&["--threads", "3"]), "6 threads on 4 cores");
        assert!(!share(&["--threads", "2"]), "a core for each thread: nothing to share");
        assert!(share(&["--threads", "2", "--share-cpu", "true"]));
        assert!(share(&["--threads", "1", "--decode-workers", "2", "--prefill-workers", "3"]));
        assert!(!share(&["--share-cpu", "false"]));
        assert!(!share(&["--itl-target-ms", "0"]), "pacing needs the latency target");
        assert!(!share(&["--colocated"]), "no prefill worker");
        assert!(!share(&["--decode-device", "cuda:0"]), "the decode worker is on a GPU");
        assert!(!share(&["--prefill-device", "cuda:0", "--share-cpu", "true"]));

        let args = |flags: &[&str], role: Role, pace: bool| {
            let a = parse(flags).unwrap();
            worker_args(&a, Path::new("m.gguf"), "127.0.0.1:7000", role, 0, Device::Cpu, pace)
        };
        let has = |v: &[String], flag: &str| v.iter().any(|x| x == flag);
        assert!(has(&args(&[], Role::Decode, true), "--pace-steps"));
        assert!(!has(&args(&[], Role::Decode, false), "--pace-steps"));
        let off = args(&["--itl-target-ms", "0"], Role::Decode, false);
        assert_eq!(off.iter().position(|x| x == "--itl-target-ms").map(|i| off[i + 1].as_str()), Some("0"));
        // Prefill workers never decode: neither flag.
        let prefill = args(&["--itl-target-ms", "50"], Role::Prefill, true);
        assert!(!has(&prefill, "--pace-steps") && !has(&prefill, "--itl-target-ms"), "{prefill:?}");
    }
}
