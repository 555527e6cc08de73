//! The flags both worker binaries take ([`WorkerArgs`]), and what is derived from them alone:
//! the worker id, the drain timeout, what readiness checks.
//!
//! Every flag can also be set with `TANDEM_<FLAG>` or as a key of the `--config` TOML file
//! ([`crate::config`] applies both).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tandem_engine::Device;
use tandem_proto::v1::Role;
use tandem_transport::NixlConfig;

use crate::readiness::ReadinessOptions;
use tandem_serve::auth::ClusterSecretArgs;
use tandem_serve::config::LogFormat;
use tandem_serve::tls::TlsArgs;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TransportChoice {
    /// Every transport this worker can use: cuda-ipc and nccl on a GPU, shared memory on the
    /// CPU, nixl when --nixl-lib is given, and TCP; the router picks the fastest a pair shares.
    #[default]
    Auto,
    /// Shared memory only (CPU pools on one host).
    Shm,
    /// TCP only.
    Tcp,
    /// CUDA IPC only (GPU pools on one host).
    #[value(name = "cuda-ipc")]
    CudaIpc,
    /// NCCL only (GPU pools on distinct GPUs).
    Nccl,
    /// NIXL only (host pools on any hosts; loads NIXL at run time).
    #[value(name = "nixl")]
    Nixl,
}

impl TransportChoice {
    /// Whether offers of `kind` (`"cuda-ipc"`, `"nccl"`, `"shm"`, `"nixl"`, `"tcp"`) are allowed.
    pub fn allows(self, kind: &str) -> bool {
        match self {
            TransportChoice::Auto => true,
            TransportChoice::Shm => kind == "shm",
            TransportChoice::Tcp => kind == "tcp",
            TransportChoice::CudaIpc => kind == "cuda-ipc",
            TransportChoice::Nccl => kind == "nccl",
            TransportChoice::Nixl => kind == "nixl",
        }
    }

    /// The flag value: `auto`, `shm`, `tcp`, `cuda-ipc`, `nccl` or `nixl`.
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Shm => "shm",
            TransportChoice::Tcp => "tcp",
            TransportChoice::CudaIpc => "cuda-ipc",
            TransportChoice::Nccl => "nccl",
            TransportChoice::Nixl => "nixl",
        }
    }

    /// Whether the choice moves KV between GPUs only (cuda-ipc, nccl).
    pub fn needs_gpus(self) -> bool {
        matches!(self, TransportChoice::CudaIpc | TransportChoice::Nccl)
    }

    /// Checks, before anything is loaded, that this choice can work on `device`: a GPU
    /// transport needs a GPU device, nccl its library, and nixl its library (from `nixl_lib`,
    /// `--nixl-lib`). The error names what is missing.
    pub fn check_device(self, device: Device, nixl_lib: Option<&Path>) -> Result<(), String> {
        if self == TransportChoice::Nixl {
            tandem_transport::nixl_library(nixl_lib).map_err(|e| format!("--transport nixl: {e}"))?;
        }
        if !self.needs_gpus() {
            return Ok(());
        }
        let name = self.name();
        if device == Device::Cpu {
            return Err(format!(
                "--transport {name} moves KV blocks between GPUs, but this worker runs on the CPU \
                 (--device cpu); give --device cuda:N, or use --transport auto, shm or tcp"
            ));
        }
        if self == TransportChoice::Nccl {
            tandem_transport::nccl_library().map_err(|e| format!("--transport nccl: {e}"))?;
        }
        Ok(())
    }
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Flags both worker binaries take. Every flag can also be set with `TANDEM_<FLAG>` or as a key
/// of the `--config` TOML file.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// TOML file with flag values (keys are long flag names).
    #[arg(long, env = "TANDEM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address the gRPC server binds (port 0: any free port; the bound address is printed).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// `host:port` the router and peers dial to reach this worker [default: the bound address].
    #[arg(long, env = "TANDEM_ADVERTISE")]
    pub advertise: Option<String>,
    /// The router's registry address (`host:port`), or several separated by commas: the worker
    /// registers and heartbeats with each (router replicas). Without it the worker waits to be
    /// listed in a router's static worker list.
    #[arg(long, env = "TANDEM_ROUTER")]
    pub router: Option<String>,
    /// GGUF file or Hugging Face model directory [default: the SmolLM2-135M-Instruct Q4_1 GGUF in
    /// the model cache, $TANDEM_MODEL_DIR or ~/.cache/tandem/models].
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute device: cpu or cuda:N.
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: Device,
    /// Matrix dtype on a GPU: bf16 (default) or f32 (matches the CPU backend with `--activations f32`
    /// exactly, slower).
    #[arg(long, env = "TANDEM_DTYPE", default_value = "bf16")]
    pub dtype: tandem_engine::backend::ComputeDtype,
    /// Element type of the KV cache: f32, f16, bf16 or fp8 (E4M3) [default: f16 on the CPU, bf16
    /// on a GPU, whose kernels store f32, bf16 or fp8]. f16 and bf16 halve KV memory and transfer
    /// bytes, fp8 quarters them at a stated cost in accuracy (docs/engine.md); workers that
    /// exchange KV blocks must agree on it (the router refuses a mismatched pair).
    #[arg(long, env = "TANDEM_KV_DTYPE", value_name = "DTYPE")]
    pub kv_dtype: Option<tandem_engine::kv::KvDtype>,
    /// Run every decode step eagerly instead of replaying captured CUDA graphs (GPU only).
    #[arg(long, env = "TANDEM_NO_CUDA_GRAPHS")]
    pub no_cuda_graphs: bool,
    /// CPU: activations fed to quantized matrices (Q4_0, Q4_1, Q5_0, Q8_0 and Q2_K..Q6_K): q16 (16-bit integer kernels, the
    /// default), q8 (8-bit, fastest, least exact) or f32 (exact: matches Hugging Face
    /// transformers token for token).
    #[arg(long, env = "TANDEM_ACTIVATIONS", default_value = "q16")]
    pub activations: tandem_engine::backend::Activations,
    /// Worker threads for the CPU backend [default: all cores].
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
    /// KV-cache blocks in the pool [default: 512].
    #[arg(long, env = "TANDEM_KV_BLOCKS", conflicts_with = "kv_memory_mb")]
    pub kv_blocks: Option<usize>,
    /// KV-cache memory in MiB, instead of --kv-blocks: as many blocks as fit.
    #[arg(long, env = "TANDEM_KV_MEMORY_MB")]
    pub kv_memory_mb: Option<usize>,
    /// Tokens per KV-cache block (must match the other workers').
    #[arg(long, env = "TANDEM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Most tokens in one forward pass (longer prompts are prefilled in chunks).
    #[arg(long, env = "TANDEM_MAX_BATCH_TOKENS", default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Most sequences computing at once.
    #[arg(long, env = "TANDEM_MAX_NUM_SEQS", default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Keep a prefix cache: finished sequences' full KV blocks stay cached (evicted least
    /// recently used first) and prompts that start with the same tokens reuse them
    /// (docs/prefix-cache.md). Changes speed, never output.
    #[arg(long, env = "TANDEM_PREFIX_CACHE", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub prefix_cache: bool,
    /// CPU: give back the KV of sliding-window layers that no later query reaches (Gemma 2 and
    /// 3: their local layers keep only their window). Changes memory, never output. Workers that
    /// exchange KV must agree on it.
    #[arg(long, env = "TANDEM_WINDOWED_KV", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub windowed_kv: bool,
    /// Host-memory KV tier: bytes of prefix-cache pages kept in memory after the pool evicts
    /// them, found again by name (docs/prefix-cache.md#kv-tiers); 0 turns it off. Accepts
    /// suffixes: 512MiB, 4GiB, 2G [default: 0].
    #[arg(long, env = "TANDEM_KV_HOST_BYTES", value_parser = parse_bytes, default_value = "0", value_name = "BYTES")]
    pub kv_host_bytes: u64,
    /// Disk KV tier: an existing, writable directory where evicted prefix-cache pages are kept,
    /// one file per page, under a subdirectory per model and KV format.
    #[arg(long, env = "TANDEM_KV_DISK_DIR", value_name = "DIR")]
    pub kv_disk_dir: Option<PathBuf>,
    /// Capacity of the disk KV tier (suffixes as for --kv-host-bytes) [default: 8GiB].
    #[arg(long, env = "TANDEM_KV_DISK_BYTES", value_parser = parse_bytes, default_value = "8GiB", value_name = "BYTES")]
    pub kv_disk_bytes: u64,
    /// Keep the disk KV tier's pages across restarts (each is checked before use); false wipes
    /// them at start.
    #[arg(long, env = "TANDEM_KV_DISK_PERSIST", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub kv_disk_persist: bool,
    /// KV transports to offer: auto (every one this worker can use), cuda-ipc, nccl, shm, nixl or
    /// tcp.
    #[arg(long, env = "TANDEM_TRANSPORT", value_enum, default_value_t = TransportChoice::Auto)]
    pub transport: TransportChoice,
    /// Directory holding libnixl_capi.so, as printed by scripts/fetch-nixl.sh [default: the
    /// dynamic loader's search path]. With --transport auto, giving it also offers nixl.
    #[arg(long, env = "TANDEM_NIXL_LIB", value_name = "DIR")]
    pub nixl_lib: Option<PathBuf>,
    /// NIXL backend plugin that moves the bytes.
    #[arg(long, env = "TANDEM_NIXL_BACKEND", value_name = "NAME", default_value = "UCX")]
    pub nixl_backend: String,
    /// Name of this worker in the router [default: <role>-<hostname>-<pid>].
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub worker_id: Option<String>,
    /// On SIGTERM/SIGINT, how long requests in flight may take to finish before they are cancelled.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_MS", default_value_t = 30_000)]
    pub drain_timeout_ms: u64,
    /// Log format on stderr.
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Address of the HTTP server for `/health`, `/ready` and `/metrics` (port 0: any free port;
    /// the bound address is printed).
    #[arg(long, env = "TANDEM_HTTP_LISTEN", default_value = "127.0.0.1:0")]
    pub http_listen: SocketAddr,
    #[command(flatten)]
    pub cluster: ClusterSecretArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Readiness turns off when the engine has work but has not finished a step for this long
    /// (a wedged engine), in ms.
    #[arg(long, env = "TANDEM_READY_STALL_MS", default_value_t = 30_000)]
    pub ready_stall_ms: u64,
    /// A LoRA adapter to hold from the start, under NAME (what requests name): a PEFT directory
    /// or a GGUF LoRA file at PATH, checked against the model (docs/lora.md). Repeatable; in
    /// TANDEM_LORA and the config file, a list (`lora = ["a=/x", "b=/y"]` or "a=/x,b=/y").
    #[arg(long = "lora", env = "TANDEM_LORA", value_name = "NAME=PATH", value_delimiter = ',',
          value_parser = parse_lora)]
    pub lora: Vec<LoraSpec>,
    /// Most LoRA adapters resident at once (backend slots; more may be held, and take turns);
    /// 0: this worker runs no adapter.
    #[arg(long, env = "TANDEM_MAX_LORAS", default_value_t = 8, value_name = "N",
          value_parser = clap::value_parser!(u32).range(0..=MAX_LORA_SLOTS as i64))]
    pub max_loras: u32,
}

/// Most adapter slots `--max-loras` may ask for.
pub const MAX_LORA_SLOTS: u32 = 256;

/// A `--lora NAME=PATH` value: an adapter to load at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraSpec {
    /// The name requests use.
    pub name: String,
    /// A PEFT directory or a GGUF LoRA file.
    pub path: PathBuf,
}

impl std::fmt::Display for LoraSpec {
    /// As the flag takes it (`NAME=PATH`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.name, self.path.display())
    }
}

/// Checks an adapter name (from `--lora` or a `LoadAdapter` call): not empty, at most 128 bytes,
/// no whitespace, control characters, `=` or `,` (which the flag's syntax uses).
pub fn check_adapter_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the adapter name is empty".into());
    }
    if name.len() > 128 {
        return Err(format!("the adapter name is {} bytes long (at most 128)", name.len()));
    }
    if let Some(c) = name.chars().find(|c| c.is_whitespace() || c.is_control() || *c == '=' || *c == ',') {
        return Err(format!(
            "the adapter name {name:?} holds {c:?} (no whitespace, control characters, '=' or ',')"
        ));
    }
    Ok(())
}

/// Checks `--lora` adapters against `--max-loras`: no name twice, and slots for them.
pub fn check_loras(lora: &[LoraSpec], max_loras: u32) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for l in lora {
        if !seen.insert(l.name.as_str()) {
            return Err(format!("--lora: the adapter name '{}' is given twice", l.name));
        }
    }
    match lora.first() {
        Some(l) if max_loras == 0 => Err(format!(
            "--lora {l}: a worker runs no adapter with --max-loras 0; give --max-loras 1 or more"
        )),
        _ => Ok(()),
    }
}

/// Parses `NAME=PATH` (the first `=` separates them).
pub fn parse_lora(s: &str) -> Result<LoraSpec, String> {
    let Some((name, path)) = s.split_once('=') else {
        return Err(format!(
            "{s:?}: expected NAME=PATH (an adapter name, '=', a PEFT directory or GGUF file)"
        ));
    };
    let name = name.trim();
    check_adapter_name(name).map_err(|e| format!("{s:?}: {e}"))?;
    if path.trim().is_empty() {
        return Err(format!("{s:?}: the path of adapter '{name}' is empty"));
    }
    Ok(LoraSpec { name: name.to_owned(), path: PathBuf::from(path.trim()) })
}

/// The role's name in worker ids and logs.
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Colocated => "colocated",
        Role::Unspecified => "worker",
    }
}

/// This host's name (for default worker ids).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is valid for writes of its whole length, which is what we pass; gethostname
    // writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        let name = String::from_utf8_lossy(&buf[..end]).trim().to_owned();
        if !name.is_empty() {
            return name;
        }
    }
    "localhost".into()
}

impl WorkerArgs {
    /// `--worker-id`, or `<role>-<hostname>-<pid>`.
    pub fn worker_id(&self, role: Role) -> String {
        self.worker_id
            .clone()
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| format!("{}-{}-{}", role_name(role), hostname(), std::process::id()))
    }

    /// The drain timeout.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }

    /// Whether this worker loads and offers nixl, and how: with `--transport nixl`, or with
    /// `--transport auto` when a library directory is given (`--nixl-lib` or `TANDEM_NIXL_LIB`).
    /// `None` otherwise, so a default run never loads NIXL.
    pub fn nixl_config(&self) -> Option<NixlConfig> {
        let lib_dir = self.nixl_lib.clone().filter(|d| !d.as_os_str().is_empty());
        let enabled = match self.transport {
            TransportChoice::Nixl => true,
            TransportChoice::Auto => lib_dir.is_some(),
            _ => false,
        };
        enabled.then(|| NixlConfig { lib_dir, backend: self.nixl_backend.clone() })
    }

    /// Checks `--lora` and `--max-loras` together ([`check_loras`]).
    pub fn check_loras(&self) -> Result<(), String> {
        check_loras(&self.lora, self.max_loras)
    }

    /// What readiness checks, from the flags.
    pub fn readiness(&self) -> ReadinessOptions {
        ReadinessOptions {
            needs_registration: self.router.is_some(),
            stall: Duration::from_millis(self.ready_stall_ms.max(1)),
        }
    }
}

/// A byte count: digits with an optional unit, `K`/`M`/`G`/`T` (powers of 1,000) or
/// `KiB`/`MiB`/`GiB`/`TiB` (powers of 1,024), `B` allowed after either.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(digits);
    let n: u64 =
        n.parse().map_err(|_| format!("{s:?} is not a byte count (e.g. 536870912, 512MiB, 4GiB)"))?;
    let unit = unit.trim();
    let unit = unit.strip_suffix(['B', 'b']).unwrap_or(unit);
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" => 1,
        "k" => 1_000,
        "m" => 1_000_000,
        "g" => 1_000_000_000,
        "t" => 1_000_000_000_000,
        "ki" => 1 << 10,
        "mi" => 1 << 20,
        "gi" => 1 << 30,
        "ti" => 1 << 40,
        _ => return Err(format!("{s:?}: unknown unit (use K, M, G, T or KiB, MiB, GiB, TiB)")),
    };
    n.checked_mul(scale).ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, clap::Parser)]
    struct Args {
        #[command(flatten)]
        common: WorkerArgs,
    }

    fn parse(args: &[&str]) -> WorkerArgs {
        Args::try_parse_from(std::iter::once("worker").chain(args.iter().copied())).unwrap().common
    }

    #[test]
    fn nixl_is_parsed_allowed_and_named() {
        let a = parse(&["--transport", "nixl", "--nixl-lib", "/opt/nixl/lib", "--nixl-backend", "MOCK"]);
        assert_eq!(a.transport, TransportChoice::Nixl);
        assert_eq!(a.transport.name(), "nixl");
        assert_eq!(a.transport.to_string(), "nixl");
        assert!(a.transport.allows("nixl") && !a.transport.allows("tcp") && !a.transport.allows("shm"));
        assert!(!a.transport.needs_gpus(), "nixl moves host pools");
        assert!(TransportChoice::Auto.allows("nixl") && !TransportChoice::Tcp.allows("nixl"));
        assert_eq!(a.nixl_lib.as_deref(), Some(Path::new("/opt/nixl/lib")));
        assert_eq!(a.nixl_backend, "MOCK");
    }

    /// nixl is loaded with `--transport nixl`, or with `--transport auto` and a library
    /// directory; never otherwise.
    #[test]
    fn nixl_is_enabled_only_when_asked_for() {
        let with = |transport: TransportChoice, lib: Option<&str>| {
            let mut a = parse(&["--nixl-backend", "UCX"]);
            a.transport = transport;
            a.nixl_lib = lib.map(PathBuf::from);
            a.nixl_config()
        };
        let dir = NixlConfig { lib_dir: Some("/opt/nixl/lib".into()), backend: "UCX".into() };
        assert_eq!(with(TransportChoice::Nixl, None), Some(NixlConfig::default()));
        assert_eq!(with(TransportChoice::Nixl, Some("/opt/nixl/lib")), Some(dir.clone()));
        assert_eq!(with(TransportChoice::Auto, Some("/opt/nixl/lib")), Some(dir));
        assert_eq!(with(TransportChoice::Auto, None), None, "a default run never loads NIXL");
        assert_eq!(with(TransportChoice::Auto, Some("")), None, "an empty directory is none");
        for t in [TransportChoice::Tcp, TransportChoice::Shm, TransportChoice::CudaIpc, TransportChoice::Nccl]
        {
            assert_eq!(with(t, Some("/opt/nixl/lib")), None, "{t}");
        }
        let mut a = parse(&["--transport", "nixl", "--nixl-backend", "GDS"]);
        a.nixl_lib = None;
        assert_eq!(a.nixl_config().map(|c| c.backend), Some("GDS".into()));
    }

    #[test]
    fn nixl_without_its_library_is_refused_naming_the_flag() {
        let dir = std::env::temp_dir().join(format!("tandem-no-nixl-{}", std::process::id()));
        let e = TransportChoice::Nixl.check_device(Device::Cpu, Some(&dir)).unwrap_err();
        assert!(e.starts_with("--transport nixl: "), "{e}");
        // The other choices never load it.
        TransportChoice::Auto.check_device(Device::Cpu, Some(&dir)).unwrap();
        TransportChoice::Tcp.check_device(Device::Cpu, Some(&dir)).unwrap();
    }

    #[test]
    fn lora_flags_are_parsed_repeated_and_checked() {
        let a = parse(&[]);
        assert!(a.lora.is_empty());
        assert_eq!(a.max_loras, 8);
        a.check_loras().unwrap();
        let a = parse(&["--lora", "sql=/a/sql", "--lora", "chat=/b/c=d.gguf", "--max-loras", "2"]);
        let names: Vec<String> = a.lora.iter().map(|l| l.to_string()).collect();
        assert_eq!(names, ["sql=/a/sql", "chat=/b/c=d.gguf"], "the first '=' splits");
        assert_eq!(a.lora[1].path, Path::new("/b/c=d.gguf"));
        assert_eq!(a.max_loras, 2);
        a.check_loras().unwrap();
        // A comma list, as TANDEM_LORA and a config-file string give it.
        let a = parse(&["--lora", "x=/1,y=/2"]);
        assert_eq!(a.lora.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(), ["x", "y"]);
        for bad in ["noequals", "=/path", "a b=/p", "a="] {
            let e = Args::try_parse_from(["worker", "--lora", bad]).unwrap_err().to_string();
            assert!(e.contains("--lora"), "{bad}: {e}");
        }
        let e = Args::try_parse_from(["worker", "--max-loras", "1000"]).unwrap_err().to_string();
        assert!(e.contains("--max-loras"), "{e}");
        let twice = parse(&["--lora", "a=/x", "--lora", "a=/y"]).check_loras().unwrap_err();
        assert!(twice.contains("'a'") && twice.contains("twice"), "{twice}");
        let off = parse(&["--lora", "a=/x", "--max-loras", "0"]).check_loras().unwrap_err();
        assert!(off.contains("--max-loras 0") && off.contains("a=/x"), "{off}");
        parse(&["--max-loras", "0"]).check_loras().unwrap();
        assert!(check_adapter_name(&"n".repeat(129)).unwrap_err().contains("129 bytes"));
    }

    /// In the config file `lora` is a list (or a comma-separated string), like other list keys.
    #[test]
    fn lora_adapters_can_come_from_the_config_file() {
        let dir = std::env::temp_dir().join(format!("tandem-lora-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("w.toml");
        let argv = |extra: &[&str]| -> Vec<std::ffi::OsString> {
            let mut v = vec!["worker".into(), "--config".into(), cfg.clone().into_os_string()];
            v.extend(extra.iter().map(Into::into));
            v
        };
        std::fs::write(&cfg, "lora = [\"a=/x\", \"b=/y\"]\nmax-loras = 3\n").unwrap();
        let a: Args = tandem_serve::config::parse_args_from(argv(&[])).unwrap();
        assert_eq!(a.common.lora.iter().map(|l| l.to_string()).collect::<Vec<_>>(), ["a=/x", "b=/y"]);
        assert_eq!(a.common.max_loras, 3);
        // A flag replaces the file's list.
        let a: Args = tandem_serve::config::parse_args_from(argv(&["--lora", "c=/z"])).unwrap();
        assert_eq!(a.common.lora.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(), ["c"]);
        std::fs::write(&cfg, "lora = \"p=/1,q=/2\"\n").unwrap();
        let a: Args = tandem_serve::config::parse_args_from(argv(&[])).unwrap();
        assert_eq!(a.common.lora.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(), ["p", "q"]);
        std::fs::write(&cfg, "lora = [\"nameless\"]\n").unwrap();
        assert!(tandem_serve::config::parse_args_from::<Args>(argv(&[])).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn byte_counts_take_decimal_and_binary_units() {
        assert_eq!(parse_bytes("0"), Ok(0));
        assert_eq!(parse_bytes("1536"), Ok(1536));
        assert_eq!(parse_bytes("2G"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("64kb"), Ok(64_000));
        for bad in ["", "GiB", "-1", "1.5G", "3 parsecs", "99999999999TiB"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?}");
        }
        let a = parse(&[
            "--kv-host-bytes",
            "1GiB",
            "--kv-disk-dir",
            "/var/cache/kv",
            "--kv-disk-persist",
            "false",
        ]);
        assert_eq!((a.kv_host_bytes, a.kv_disk_bytes, a.kv_disk_persist), (1 << 30, 8 << 30, false));
        assert_eq!(a.kv_disk_dir.as_deref(), Some(Path::new("/var/cache/kv")));
    }
}
