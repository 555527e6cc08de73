//! `tandem`: run the engine in one process (`generate`, `bench`), talk to a running cluster
//! (`generate --router`, `bench --router`), and start a local cluster (`up`).

mod backend_bench;
mod direct;
mod greedy_stream;
mod loadgen;
mod local;
mod logits;
mod lora_bench;
mod placement;
mod prefix_bench;
mod remote;
mod revisit_bench;
mod spec_bench;
mod structured_bench;
mod up;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use tandem_engine::Device;
use tandem_worker::speculation::SpeculationArgs;

#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "Tandem: LLM serving with prefill and decode in separate processes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion and stream it to stdout: in this process, or through a router with
    /// --router.
    Generate(GenerateArgs),
    /// Measure prompt and decode throughput of the in-process engine, or load a running cluster
    /// with --router. With --speculate or --workload: a workload of real prompts through the
    /// scheduler, without and then with speculation, side by side. With --router and --workload
    /// shared-prefix: the cluster's prefix cache off (a unique cache_salt per request, so no
    /// sharing is possible: the baseline, on the same cluster in the same run) and on (one salt
    /// for the run), side by side.
    Bench(BenchArgs),
    /// Start a local cluster (router, prefill worker, decode worker) and keep it running until
    /// SIGINT/SIGTERM. Prints `ready router=<grpc addr> http=<http addr>` once it serves
    /// (and ` ca=<CA file>` with --tls).
    Up(up::UpArgs),
    /// Write the logits at every position of one prompt (token ids) as little-endian f32, for
    /// comparison with a reference implementation; prints a JSON line with the shape and argmaxes.
    Logits(logits::LogitsArgs),
    /// Time decode steps and prefill of one backend directly (no scheduler) next to the
    /// memory-bandwidth and matmul bounds.
    BackendBench(backend_bench::BackendBenchArgs),
}

#[derive(Args, Clone)]
struct EngineArgs {
    /// GGUF file or Hugging Face model directory [default: the SmolLM2-135M-Instruct Q4_1 GGUF in
    /// the model cache, $TANDEM_MODEL_DIR or ~/.cache/tandem/models].
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Compute device.
    #[arg(long, default_value = "cpu", env = "TANDEM_DEVICE")]
    device: Device,
    /// Worker threads for the CPU backend [default: all cores].
    #[arg(long, env = "TANDEM_THREADS")]
    threads: Option<usize>,
    /// Element type of a GPU's weights and matrix inputs: bf16, or f32 (matches the CPU backend
    /// with `--activations f32` token for token); the CPU backend ignores it.
    #[arg(long, default_value = "bf16", env = "TANDEM_DTYPE")]
    dtype: tandem_engine::backend::ComputeDtype,
    /// GPU: run every decode step eagerly instead of replaying captured CUDA graphs.
    #[arg(long)]
    no_cuda_graphs: bool,
    /// CPU: activations fed to quantized matrices (Q4_0, Q4_1, Q5_0, Q8_0 and Q2_K..Q6_K): q16 (16-bit integer kernels, the
    /// default), q8 (8-bit, fastest, least exact) or f32 (exact: matches Hugging Face
    /// transformers token for token).
    #[arg(long, default_value = "q16", env = "TANDEM_ACTIVATIONS")]
    activations: tandem_engine::backend::Activations,
    /// KV-cache blocks in the pool.
    #[arg(long, default_value_t = 512)]
    kv_blocks: usize,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Most tokens in one forward pass (longer prompts are prefilled in chunks).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Element type of the KV cache: f32, f16, bf16 or fp8 [default: f16 on the CPU, bf16 on a
    /// GPU]. f16/bf16 halve KV memory, fp8 quarters it; f32 matches the reference implementation
    /// most closely.
    #[arg(long, env = "TANDEM_KV_DTYPE", value_name = "DTYPE")]
    kv_dtype: Option<tandem_engine::kv::KvDtype>,
    /// Keep a prefix cache: full KV blocks of finished sequences are reused by prompts that
    /// start with the same tokens (docs/prefix-cache.md). Changes speed, never output.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL", env = "TANDEM_PREFIX_CACHE")]
    prefix_cache: bool,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    spec: SpeculationArgs,
    /// Send the request to the router at HOST:PORT instead of running the model here (the engine
    /// flags above are then the cluster's business and ignored).
    #[arg(long, env = "TANDEM_ROUTER")]
    router: Option<String>,
    /// With --router: the API key the router asks for (sent as `authorization: Bearer <key>`).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true, requires = "router")]
    api_key: Option<String>,
    /// With --router: PEM file with the CA that signed the router's certificate; the connection
    /// then speaks TLS (`tandem up --tls` prints it as `ca=` on its ready line). A router given
    /// as `https://HOST:PORT` needs it.
    #[arg(long, env = "TANDEM_TLS_CA", requires = "router")]
    tls_ca: Option<std::path::PathBuf>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens less likely than MIN_P times the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalise tokens already present (1: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Random seed: the same seed gives the same output.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text is generated (repeatable); the stop text is not printed.
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// With --chat: a system message to put before the prompt (otherwise the template's default).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Print one JSON object at the end instead of streaming text (with `speculation`:
    /// draft tokens proposed and accepted, when speculating).
    #[arg(long)]
    json: bool,
    /// The prompt.
    prompt: String,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// With --speculate ngram|draft the workload runs twice in this process, without and with
    /// speculation, and the two are printed side by side.
    #[command(flatten)]
    spec: SpeculationArgs,
    /// What to run. In process: synthetic (one pseudo-random prompt timed on the backend alone;
    /// with --speculate, --requests pseudo-random prompts through the scheduler), friendly
    /// (prompts asking to repeat, quote or edit a given passage: the output repeats the input)
    /// or unfriendly (free-form stories). With --router: synthetic (a fixed load; latencies and
    /// throughput) or shared-prefix: --requests prompts sharing one --system-tokens system prompt,
    /// each with its own --question-tokens question, then --chats chats of --turns turns (each
    /// turn's prompt is the previous one, its answer and a new message), all as pseudo-random
    /// token ids from --seed; run first with the prefix cache off (a unique cache_salt per
    /// request, so no sharing is possible: the baseline, measured on the same cluster in the same
    /// run; workers started with --prefix-cache false are the other way to measure it), then on
    /// (one salt for the run, new for each run). Prints TTFT, prompt tokens computed and cached,
    /// and KV bytes moved per phase and part, and the ratios on vs off. Or revisit: --conversations
    /// conversations of --rounds rounds (a --first-tokens opening each, then every conversation
    /// revisited once per round in a seeded random order with its whole history and --turn-tokens
    /// new tokens), so the working set can outgrow the workers' KV pool; prints per round TTFT and
    /// the cached share of the prompts, which is what the pool or a KV tier behind it kept.
    #[arg(long, value_enum, default_value_t = spec_bench::Workload::Synthetic)]
    workload: spec_bench::Workload,
    /// Load the cluster behind the router at HOST:PORT instead of timing the engine here.
    #[arg(long, env = "TANDEM_ROUTER")]
    router: Option<String>,
    /// With --router: the API key the router asks for (sent as `authorization: Bearer <key>`).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true, requires = "router")]
    api_key: Option<String>,
    /// With --router: PEM file with the CA that signed the router's certificate; the connection
    /// then speaks TLS (`tandem up --tls` prints it as `ca=` on its ready line). A router given
    /// as `https://HOST:PORT` needs it.
    #[arg(long, env = "TANDEM_TLS_CA", requires = "router")]
    tls_ca: Option<std::path::PathBuf>,
    /// Prompt length for the prefill measurement (with --router's synthetic load, or a synthetic
    /// workload through the scheduler: of every request).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens generated one at a time for the decode measurement (with --router's synthetic load:
    /// per request; through the scheduler: at most, per request).
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Repetitions of the synthetic backend measurement (the mean is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Without --router: also decode this many sequences together (one pass per step, each with
    /// the same prompt length) and report their total tokens/s next to the single stream.
    #[arg(long, default_value_t = 0)]
    batch: usize,
    /// With --router, or through the scheduler (--speculate, --workload): requests in flight at once
    /// (shared-prefix: requests, or chats, of one part in flight at once).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// With --router, or through the scheduler (--speculate, --workload): requests in total
    /// (shared-prefix: the requests sharing the system prompt, per phase).
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// With --router: send requests back to back for this many seconds instead of --requests
    /// (offered load = --concurrency, whatever is admitted); refusals for capacity are counted
    /// and timed apart from failures.
    #[arg(long, requires = "router")]
    duration_s: Option<f64>,
    /// With --router: prompt token ids are drawn below this id (keep it inside the vocabulary).
    #[arg(long, default_value_t = 256)]
    vocab_limit: u32,
    /// In process: decode the --requests synthetic prompts on the base model, then spread
    /// round-robin over this many LoRA adapters (random, rank --lora-rank, every projection),
    /// --reps times each, and print both rates and their ratio (0: off).
    #[arg(long, default_value_t = 0, conflicts_with = "router")]
    lora_adapters: usize,
    /// With --lora-adapters: the adapters' rank.
    #[arg(long, default_value_t = 16)]
    lora_rank: usize,
    /// With --workload shared-prefix: tokens of the system prompt the --requests prompts share.
    #[arg(long, default_value_t = 1000)]
    system_tokens: usize,
    /// With --workload shared-prefix: tokens of each question after the system prompt, and of each
    /// user message of a chat.
    #[arg(long, default_value_t = 50)]
    question_tokens: usize,
    /// With --workload shared-prefix: multi-turn chats per phase (at most --concurrency at once).
    #[arg(long, default_value_t = 8)]
    chats: usize,
    /// With --workload shared-prefix: turns per chat, run in order.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// With --workload shared-prefix or revisit: tokens generated per request (greedy, past
    /// end-of-sequence); a chat's (a conversation's) answers become part of its next prompt.
    #[arg(long, default_value_t = 16)]
    answer_tokens: usize,
    /// With --workload shared-prefix or revisit: seed of the prompt token ids and of revisit's
    /// orders (a seed names one workload).
    /// Through the scheduler with --temperature: every request's sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Through the scheduler (--speculate, --workload): sample at this temperature, seeded from
    /// --seed (0, the default: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// With --workload shared-prefix or revisit: a request not finished after this many seconds
    /// counts as failed.
    #[arg(long, default_value_t = 300)]
    request_timeout_s: u64,
    /// With --workload revisit: conversations, each revisited once per round.
    #[arg(long, default_value_t = 24)]
    conversations: usize,
    /// With --workload revisit: rounds; the first sends every conversation's opening.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// With --workload revisit: tokens of each conversation's opening.
    #[arg(long, default_value_t = 512)]
    first_tokens: usize,
    /// With --workload revisit: tokens a revisit adds after the conversation's history.
    #[arg(long, default_value_t = 32)]
    turn_tokens: usize,
    /// With --workload revisit: the cache_salt of every request [default: a new one per run, so no
    /// earlier run's cache can help]. Give an earlier run's (printed as its salt) to measure what
    /// the cluster kept of it, e.g. in a disk KV tier across a restart.
    #[arg(long, requires = "router")]
    cache_salt: Option<String>,
    /// Measure KV transfer throughput for the KV geometry of --model instead of timing the
    /// engine: shm and tcp over loopback next to a memcpy of the same bytes, or with --device
    /// cuda:N cuda-ipc and nccl next to a device-to-device copy.
    #[arg(long, conflicts_with = "router")]
    transfer: bool,
    /// Measure structured output instead: the constraint engine's costs (vocabulary view, schema
    /// compile, one token mask) and a chat workload without and then with a JSON Schema
    /// constraint, side by side, with the mask time per token and the part of it a step waited for.
    #[arg(long, conflicts_with_all = ["router", "transfer"])]
    structured: bool,
    /// With --transfer: prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096")]
    transfer_tokens: Vec<usize>,
    /// With --transfer: the transports to time [default: shm,tcp with --device cpu; cuda-ipc,nccl
    /// with --device cuda:N].
    #[arg(long, value_delimiter = ',')]
    transfer_transports: Vec<String>,
    /// With --transfer on a GPU: the device of the destination pool [default: --device]; nccl
    /// needs another GPU than the source's.
    #[arg(long)]
    transfer_to: Option<tandem_engine::Device>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// `(source, destination)` CUDA ordinals of a GPU transfer benchmark; `None` on the CPU.
type GpuPair = Option<(usize, usize)>;

/// What `tandem bench --transfer` times: the transports (`--transfer-transports`, default shm
/// and tcp on the CPU, cuda-ipc and nccl on a GPU) and, on GPUs, the source and destination
/// devices (`--device`, `--transfer-to`). A GPU transport without GPUs is refused here, before
/// anything is loaded.
fn transfer_plan(
    device: tandem_engine::Device,
    to: Option<tandem_engine::Device>,
    kinds: &[String],
) -> anyhow::Result<(Vec<tandem_transport::TransportKind>, GpuPair)> {
    use tandem_engine::Device;
    use tandem_transport::TransportKind;
    let gpus = match (device, to) {
        (Device::Cuda(a), Some(Device::Cuda(b))) => Some((a, b)),
        (Device::Cuda(a), None) => Some((a, a)),
        (Device::Cpu, None) => None,
        (d, Some(t)) => anyhow::bail!(
            "--transfer-to {t}: both pools must be on GPUs for the GPU transports (--device is {d}); \
             give --device cuda:N --transfer-to cuda:M"
        ),
    };
    let kinds: Vec<TransportKind> = if kinds.is_empty() {
        match gpus {
            Some(_) => vec![TransportKind::CudaIpc, TransportKind::Nccl],
            None => vec![TransportKind::Shm, TransportKind::Tcp],
        }
    } else {
        kinds.iter().map(|k| k.parse()).collect::<Result<_, _>>()?
    };
    for k in &kinds {
        match (k.needs_gpu(), gpus.is_some()) {
            (true, false) => anyhow::bail!(
                "--transfer-transports {k}: {k} moves KV between GPUs, and --device is cpu; give --device cuda:N \
                 (and --transfer-to cuda:M for a second GPU)"
            ),
            (false, true) => anyhow::bail!(
                "--transfer-transports {k}: with --device {device} the benchmark times the GPU transports \
                 (cuda-ipc, nccl); time {k} with --device cpu"
            ),
            _ => {}
        }
    }
    Ok((kinds, gpus))
}

/// `tandem bench --transfer`: KV transfer GB/s per transport next to a plain memcpy (host pools)
/// or a device-to-device copy (GPU pools) of the same bytes.
fn transfer_bench(a: BenchArgs) -> anyhow::Result<()> {
    use tandem_serve::identity::{model_identity, resolve_model};
    use tandem_transport::{run_transfer_bench, TransferBenchOptions, TransferBenchRow};
    let (kinds, gpus) = transfer_plan(a.engine.device, a.transfer_to, &a.transfer_transports)?;
    if let Some((from, to)) = gpus {
        for o in [from, to] {
            tandem_engine::cuda::probe(o)?;
        }
    }
    let path = resolve_model(a.engine.model.as_deref())?;
    let id = model_identity(&path)?;
    let mut opts = TransferBenchOptions::default();
    opts.layout.num_layers = id.config.num_layers;
    opts.layout.num_kv_heads = id.config.num_kv_heads;
    opts.layout.head_dim = id.config.head_dim;
    opts.layout.block_size = a.engine.block_size;
    opts.layout.dtype =
        a.engine.kv_dtype.unwrap_or_else(|| tandem_engine::backend::default_kv_dtype(a.engine.device));
    opts.prompt_tokens = a.transfer_tokens.clone();
    opts.repetitions = a.reps.max(1);
    opts.transports = kinds.clone();
    opts.gpus = gpus;
    let rows = run_transfer_bench(&opts)?;
    if a.json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    let base = if gpus.is_some() { "d2d" } else { "memcpy" };
    let place = match gpus {
        Some((f, t)) => format!("cuda:{f} to cuda:{t}"),
        None => "host memory".into(),
    };
    println!(
        "KV transfer, {} ({} layers, {} KV heads of {}, {}, blocks of {}), {place}, median of {} runs:",
        id.model_name,
        opts.layout.num_layers,
        opts.layout.num_kv_heads,
        opts.layout.head_dim,
        opts.layout.dtype,
        opts.layout.block_size,
        opts.repetitions
    );
    println!();
    // A bare loopback socket's row (when tcp was timed): the ceiling of any transfer over TCP.
    let socket = rows.iter().any(|r| r.transport == "socket");
    let names: Vec<String> = socket
        .then(|| "socket".to_owned())
        .into_iter()
        .chain(kinds.iter().map(|&k| tandem_transport::bench::row_name(k)))
        .collect();
    let mut head = format!("| prompt tokens | MiB | {base} GB/s |");
    let mut rule = "|---:|---:|---:|".to_string();
    for n in &names {
        head += &format!(" {n} GB/s |");
        rule += "---:|";
    }
    for n in &names {
        head += &format!(" {n} / {base} |");
        rule += "---:|";
    }
    println!("{head}\n{rule}");
    let mut notes = std::collections::BTreeSet::new();
    for &t in &opts.prompt_tokens {
        let get = |name: &str| rows.iter().find(|r| r.tokens == t && r.transport == name);
        let Some(m) = get(base) else { continue };
        let cell = |r: Option<&TransferBenchRow>, f: &dyn Fn(&TransferBenchRow) -> String| match r {
            Some(r) if r.unavailable.is_none() => f(r),
            _ => "-".into(),
        };
        let mut line = format!("| {t} | {:.1} | {:.2} |", m.bytes as f64 / (1 << 20) as f64, m.gb_per_s);
        for n in &names {
            line += &format!(" {} |", cell(get(n), &|r| format!("{:.2}", r.gb_per_s)));
        }
        for n in &names {
            line += &format!(" {} |", cell(get(n), &|r| format!("{:.0}%", 100.0 * r.gb_per_s / m.gb_per_s)));
        }
        println!("{line}");
        for r in rows.iter().filter(|r| r.tokens == t) {
            if let Some(why) = &r.unavailable {
                notes.insert(format!("{}: not timed: {why}", r.transport));
            }
        }
    }
    // The part of each transfer a request waits for once its prompt is prefilled.
    println!("\nafter the prompt (staging to acknowledgement; a prefill worker opens the session before it prefills):");
    for &t in &opts.prompt_tokens {
        let Some(m) = rows.iter().find(|r| r.tokens == t && r.transport == base) else { continue };
        let after: Vec<String> = rows
            .iter()
            .filter(|r| r.tokens == t && r.unavailable.is_none())
            .filter_map(|r| {
                let s = r.after_open_seconds?;
                let gb = r.bytes as f64 / s / 1e9;
                Some(format!(
                    "{} {:.2} ms ({gb:.1} GB/s, {:.0}% of {base})",
                    r.transport,
                    s * 1e3,
                    100.0 * gb / m.gb_per_s
                ))
            })
            .collect();
        if !after.is_empty() {
            println!("{t} tokens: {}", after.join(", "));
        }
    }
    // How long the sender's thread (a prefill worker's engine thread) was busy per transfer, and
    // what staging costs alone (host pools).
    let staging = if gpus.is_some() {
        "issuing the device copies and waiting for them"
    } else {
        "copying and checksumming the blocks"
    };
    println!(
        "\nstaging (the sender's thread {staging}; a prefill worker's engine thread is busy that long):"
    );
    for &t in &opts.prompt_tokens {
        let get = |name: &str| rows.iter().find(|r| r.tokens == t && r.transport == name);
        let mut staged: Vec<String> = rows
            .iter()
            .filter(|r| r.tokens == t && r.unavailable.is_none())
            .filter_map(|r| {
                let s = r.stage_seconds?;
                Some(format!("in {} {:.2} ms ({:.1} GB/s)", r.transport, s * 1e3, r.bytes as f64 / s / 1e9))
            })
            .collect();
        if let (Some(f), Some(p)) = (get("copy-summed"), get("copy+sum")) {
            staged.push(format!(
                "alone {:.2} ms ({:.1} GB/s; copying, then checksumming each piece: {:.1} GB/s)",
                f.seconds * 1e3,
                f.gb_per_s,
                p.gb_per_s
            ));
        }
        if !staged.is_empty() {
            println!("{t} tokens: {}", staged.join(", "));
        }
    }
    if socket {
        println!("\nsocket: the same bytes through a bare loopback TCP socket, nothing else (the ceiling of tcp here).");
        for &t in &opts.prompt_tokens {
            let get = |name: &str| {
                rows.iter().find(|r| r.tokens == t && r.transport == name && r.unavailable.is_none())
            };
            if let (Some(tcp), Some(s)) = (get("tcp"), get("socket")) {
                println!(
                    "{t} tokens: tcp moved {:.0}% of what the bare socket did",
                    100.0 * tcp.gb_per_s / s.gb_per_s
                );
            }
        }
    }
    for n in notes {
        println!("\n{n}");
    }
    Ok(())
}

/// Refuses speculation flags where `mode` runs no engine of this process: with --router the
/// cluster's decode workers speculate (or not) as they were started.
fn no_speculation(spec: &SpeculationArgs, mode: &str) -> anyhow::Result<()> {
    if spec.enabled() || spec.draft_model.is_some() {
        anyhow::bail!(
            "--speculate and --draft-model have no effect with {mode}: speculation runs in the engine \
             that decodes (with --router, start the cluster's decode workers with them, e.g. `tandem up \
             --speculate ngram`)"
        );
    }
    Ok(())
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TANDEM_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let res = match cli.command {
        Command::Generate(a) => match a.router.clone() {
            Some(router) => no_speculation(&a.spec, "--router").and_then(|_| remote::generate(&router, a)),
            None => local::generate(a),
        },
        Command::Bench(a)
            if a.temperature != 0.0
                && (a.structured
                    || a.transfer
                    || a.router.is_some()
                    || (!a.spec.enabled() && a.workload == spec_bench::Workload::Synthetic)) =>
        {
            Err(anyhow::anyhow!(
                "--temperature samples the workload run through the scheduler here (--speculate, or \
                 --workload friendly|unfriendly); this measurement is greedy"
            ))
        }
        Command::Bench(a) if a.lora_adapters > 0 => {
            no_speculation(&a.spec, "--lora-adapters").and_then(|_| lora_bench::run(a))
        }
        Command::Bench(a) if a.structured => {
            no_speculation(&a.spec, "--structured").and_then(|_| structured_bench::run(a))
        }
        Command::Bench(a) if a.transfer => {
            no_speculation(&a.spec, "--transfer").and_then(|_| transfer_bench(a))
        }
        Command::Bench(a) => match a.router.clone() {
            Some(router) => no_speculation(&a.spec, "--router").and_then(|_| match a.workload {
                spec_bench::Workload::Synthetic => remote::bench(&router, a),
                spec_bench::Workload::SharedPrefix => prefix_bench::run(&router, a),
                spec_bench::Workload::Revisit => revisit_bench::run(&router, a),
                w => anyhow::bail!(
                    "--workload {w} runs in this process; with --router the workload is synthetic, \
                     shared-prefix or revisit"
                ),
            }),
            None if matches!(
                a.workload,
                spec_bench::Workload::SharedPrefix | spec_bench::Workload::Revisit
            ) =>
            {
                Err(anyhow::anyhow!(
                    "--workload {} measures a cluster's prefix cache: give it --router HOST:PORT \
                     (`tandem up` starts a local cluster)",
                    a.workload
                ))
            }
            None if a.spec.enabled() || a.workload != spec_bench::Workload::Synthetic => spec_bench::run(a),
            // Off, but a --draft-model without --speculate draft is still refused.
            None => a.spec.validate().map_err(anyhow::Error::from).and_then(|_| local::bench(a)),
        },
        Command::Up(a) => up::up(a),
        Command::Logits(a) => logits::run(a),
        Command::BackendBench(a) => backend_bench::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_engine::Device;
    use tandem_transport::TransportKind;

    /// `--transfer-transports` takes every kind's name (nixl included); the defaults are
    /// unchanged, and a host-pool kind is refused on GPUs.
    #[test]
    fn transfer_transports_parse_every_kind() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let (kinds, gpus) = transfer_plan(Device::Cpu, None, &names(&["nixl", "tcp"])).unwrap();
        assert_eq!((kinds, gpus), (vec![TransportKind::Nixl, TransportKind::Tcp], None));
        let (kinds, _) = transfer_plan(Device::Cpu, None, &[]).unwrap();
        assert_eq!(kinds, [TransportKind::Shm, TransportKind::Tcp]);
        let (kinds, gpus) = transfer_plan(Device::Cuda(0), None, &[]).unwrap();
        assert_eq!((kinds, gpus), (vec![TransportKind::CudaIpc, TransportKind::Nccl], Some((0, 0))));
        let e = transfer_plan(Device::Cuda(0), None, &names(&["nixl"])).unwrap_err().to_string();
        assert!(e.contains("time nixl with --device cpu"), "{e}");
        let e = transfer_plan(Device::Cpu, None, &names(&["rdma"])).unwrap_err().to_string();
        assert!(e.contains("rdma") && e.contains("nixl"), "{e}");
    }
}
