//! `tandem up`: a local cluster as child processes — `tandem-router`, then `--prefill-workers`
//! `tandem-prefill` and `--decode-workers` `tandem-decode` (or `--decode-workers` colocated
//! `tandem-decode`) registering with it, all on 127.0.0.1 with OS-picked ports. Worker ids are
//! `<role>-<index>` (`prefill-0`, `decode-1`, `colocated-0`); with several workers of a role, the
//! `[name]` prefix of their stderr lines carries the index too.
//!
//! Life cycle: each child prints `listening grpc=.. http=..` when it serves; once the router's
//! `Health` says it serves with every worker registered and healthy, `ready router=<grpc addr>
//! http=<http addr>` goes to stdout, once (the only thing `tandem up` prints there; `http` is the
//! router's OpenAI-compatible API).
//! SIGINT/SIGTERM stop the cluster gracefully (router first, so requests in flight finish, then
//! the workers; SIGKILL after a grace period) and exit 0. A child that dies on its own is
//! reported, the others are stopped, and `tandem up` exits 1. Children never outlive `tandem up`,
//! even when it is SIGKILLed: each asks the kernel for SIGTERM when its parent dies.
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
use tandem_worker::speculation::SpeculationArgs;

use crate::placement::{DeviceFlags, DeviceList, Placement, Role, Transport};

/// How long a stopped child gets before SIGKILL.
const GRACE: Duration = Duration::from_secs(15);
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
    /// KV transport between the workers: auto, shm, tcp, cuda-ipc or nccl [default: the
    /// workers' default, auto]. cuda-ipc and nccl need every worker on a GPU, and nccl a prefill
    /// and a decode worker never on the same GPU.
    #[arg(long, value_enum)]
    transport: Option<Transport>,
    /// Element type of the workers' KV caches: f32, f16 or bf16 (both workers get the same)
    /// [default: the workers' default, f16 on the CPU and f32 on a GPU].
    #[arg(long, value_name = "DTYPE")]
    kv_dtype: Option<tandem_engine::kv::KvDtype>,
    /// Prefix cache on the workers (true or false) [default: the workers' default, true].
    #[arg(long, value_name = "BOOL")]
    prefix_cache: Option<bool>,
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

/// One child process.
struct Proc {
    name: String,
    child: Child,
    stdout: mpsc::Receiver<String>,
    tail: Arc<Mutex<VecDeque<String>>>,
    /// Closed when the child's stderr reaches its end (all of it is in `tail`).
    stderr_done: mpsc::Receiver<()>,
    status: Option<ExitStatus>,
    /// A worker's device, named with it in what we print about it.
    device: Option<Device>,
}

impl Proc {
    /// Starts `program` with `args`; `env` sets (Some) or removes (None) environment variables;
    /// the child's stderr lines go to `logs`.
    fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, Option<&str>)],
        logs: &LogSink,
        nice: i32,
    ) -> Result<Proc> {
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in env {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        let parent = std::process::id() as libc::pid_t;
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
        let mut child = cmd.spawn().with_context(|| format!("starting {}", program.display()))?;
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let (done_tx, stderr_done) = mpsc::channel::<()>();
        if let Some(err) = child.stderr.take() {
            let (tail, prefix, logs) = (tail.clone(), format!("[{name}] "), logs.clone());
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
        Ok(Proc { name: name.into(), child, stdout: rx, tail, stderr_done, status: None, device: None })
    }

    fn tail(&self) -> String {
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

    fn died(&self, status: ExitStatus) -> anyhow::Error {
        // Let the reader catch up with what the child wrote before it exited.
        let _ = self.stderr_done.recv_timeout(Duration::from_secs(1));
        let on = self.device.map(|d| format!(", on {d}")).unwrap_or_default();
        anyhow!(
            "{} (pid {}{on}) exited ({status}); its last stderr lines:\n{}",
            self.name,
            self.child.id(),
            self.tail()
        )
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
                p.name,
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
            let tails: Vec<String> = procs.iter().map(|p| format!("[{}]\n{}", p.name, p.tail())).collect();
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
    opt("--kv-dtype", a.kv_dtype.map(|x| x.to_string()));
    opt("--prefix-cache", a.prefix_cache.map(|x| x.to_string()));
    opt("--activations", a.activations.map(|x| x.to_string()));
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

/// A random cluster secret for one run: 32 hex digits (128 bits).
fn random_secret() -> String {
    (0..4).map(|_| format!("{:08x}", rand::random::<u32>())).collect()
}

/// Starts the cluster and waits until it is ready, then until a signal or a child's death.
fn start_and_run(
    a: &UpArgs,
    procs: &mut Vec<Proc>,
    tls: Option<&tandem_serve::tls::dev::ClusterCerts>,
) -> Result<(), Interrupt> {
    let placement = placement(a)?;
    let model = resolve_model(a.model.as_deref()).map_err(anyhow::Error::from)?;
    a.speculation.validate().map_err(anyhow::Error::from)?;
    if let Some(draft) = &a.speculation.draft_model {
        resolve_model(Some(draft)).context("--draft-model")?;
    }
    // Checked here, so a bad key or secret file fails before anything starts.
    let api_key = load_secret(a.api_key.as_deref(), a.api_key_file.as_deref(), "api-key")
        .map_err(anyhow::Error::from)?;
    load_secret(a.cluster_secret.as_deref(), a.cluster_secret_file.as_deref(), "cluster-secret")
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
    ];
    // Workers take no API key; keep one set in our environment off them.
    let mut worker_env =
        vec![cluster_env[0], cluster_env[1], ("TANDEM_API_KEY", None), ("TANDEM_API_KEY_FILE", None)];
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
        ];
        if let Some(name) = &a.served_model_name {
            rargs.extend(["--served-model-name".into(), name.clone()]);
        }
        let name = if n_routers == 1 { "router".to_owned() } else { format!("router-{i}") };
        procs.push(Proc::spawn(&name, &router_bin, &rargs, &router_env, &logs, 0)?);
    }
    let mut routers = Vec::with_capacity(n_routers);
    for i in 0..n_routers {
        let listening = wait_listening(procs, i, deadline)?;
        let Some(http) = listening.http else {
            return Err(Interrupt::Failed(anyhow!("the router's listening line names no http address")));
        };
        routers.push((listening.grpc, http));
    }
    let (router, http) = routers[0];
    let router_list = routers.iter().map(|(g, _)| g.to_string()).collect::<Vec<_>>().join(",");

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = shares_cpu(a, &placement, cores);
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
            let mut p = Proc::spawn(&name, bin, &args, &worker_env, &logs, nice)?;
            p.device = Some(device);
            procs.push(p);
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
    loop {
        check(procs)?;
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Stops the children: the `n_routers` routers first (they finish the requests in flight), then
/// the workers; SIGKILL for any still running after the grace period.
fn stop_all(procs: &mut [Proc], n_routers: usize) {
    let (router, workers) = procs.split_at_mut(n_routers.min(procs.len()));
    for group in [router, workers] {
        for p in group.iter() {
            p.signal(libc::SIGTERM);
        }
        let deadline = Instant::now() + GRACE;
        while group.iter_mut().any(|p| p.exited().is_none()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        for p in group.iter_mut() {
            if p.exited().is_none() {
                eprintln!("tandem up: {} did not stop within {GRACE:?}; killing it", p.name);
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
    let outcome = start_and_run(&a, &mut procs, tls.as_ref().map(|t| &t.certs));
    match &outcome {
        Err(Interrupt::Signal(sig)) => eprintln!("tandem up: {sig}: stopping the cluster"),
        Err(Interrupt::Failed(_)) if !procs.is_empty() => eprintln!("tandem up: stopping the cluster"),
        _ => {}
    }
    stop_all(&mut procs, a.routers as usize);
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
        for t in ["auto", "shm", "tcp", "cuda-ipc", "nccl"] {
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
