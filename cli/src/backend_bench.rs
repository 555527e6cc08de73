//! `tandem backend-bench`: decode and prefill speed of one backend, measured by calling
//! [`Backend::forward`] directly (no scheduler, no sampler), next to what the hardware allows.
//!
//! - **Decode**: `max(--batch)` sequences are prefilled to `--context` tokens once. For each batch
//!   size `b`, the first `b` of them run `--warmup` untimed and `--steps` timed decode steps, each
//!   step one token per sequence with the last position's logits returned, as the engine asks for
//!   them. Every batch size starts again at position `--context` (the steps overwrite the same
//!   slots), so all of them attend to the same history.
//! - **Prefill**: one `--prefill`-token prompt in passes of at most the backend's max batch
//!   tokens, last position's logits only; the median of `--reps` runs after one warm-up.
//! - **Verification passes** (`--verify`): sequence 0 (at `--context` tokens) runs, in turn, a
//!   one-token decode step and one staged pass of N tokens with logits for every position, as
//!   speculative verification asks for them, each row then picked greedily on the host and the
//!   staged K/V dropped. The medians of `--steps` pairs give the price of verifying N - 1 drafts
//!   in decode steps.
//! - **Memory-bandwidth bound** for a decode step: the bytes it must read (weights as stored on
//!   the device + the KV of every sequence, see [`decode_bytes`]) over the memory traffic rate
//!   that a copy measured in this run achieves (CUDA: a device-to-device copy, CPU: a
//!   multi-threaded memcpy). A copy of N bytes reads N and writes N bytes, so that rate is twice
//!   the copy bandwidth; a step that reads B bytes cannot take less than `B / rate`.
//! - **Matmul bound** for prefill, with `--peak-tflops`: the FLOPs of every matrix product of the
//!   pass (projections, MLP, the causal attention products and the last position's output head)
//!   over that peak.
//!
//! Decode inputs are fixed pseudo-random tokens rather than the argmax of the previous step, so
//! every run does the same work. Each step picks greedily (on the device where the backend can);
//! with `--sampled` it draws by seeded sampling instead, on the device or on the host, and that
//! sampling is part of the step's time.

use std::time::Instant;

use anyhow::{bail, ensure, Result};
use clap::Args;
use serde_json::json;
use tandem_engine::backend::{Backend, DevicePick, LogitsRequest, SeqChunk};
use tandem_engine::kv::{BlockAllocator, BlockId, WriteMode};
use tandem_engine::sampler::{RowSampling, Sampler, SamplingParams};
use tandem_engine::Device;

use crate::direct::{BackendFlags, WeightsInfo};

#[derive(Args)]
pub(crate) struct BackendBenchArgs {
    #[command(flatten)]
    backend: BackendFlags,
    /// Decode batch sizes (sequences per step).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    batch: Vec<usize>,
    /// Tokens already in every sequence's KV cache when the decode steps start.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Tokens in one verification pass of a single sequence, timed against a one-token decode
    /// step of the same sequence (e.g. `2,5,8`; none by default).
    #[arg(long, value_delimiter = ',')]
    verify: Vec<usize>,
    /// Prompt length of the prefill measurement (0: skip it).
    #[arg(long, default_value_t = 2048)]
    prefill: usize,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Untimed decode steps before them (graph capture, caches).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed prefill runs (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Most tokens in one forward pass (raised to the largest batch size if smaller).
    #[arg(long, default_value_t = 2048)]
    max_batch_tokens: usize,
    /// Peak matrix throughput of the device in TFLOP/s, for the prefill bound (e.g. measured with
    /// a large bf16 matrix product).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Decode steps draw each token by seeded sampling (temperature 1, top-p 0.9) instead of a
    /// greedy pick: on the device where the backend samples there, else from logits rows copied
    /// to the host sampler (`--no-device-sampling`), sampling included in the step's time.
    #[arg(long)]
    sampled: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The copy bandwidth of `device` in bytes copied per second, and how it was measured.
fn copy_bandwidth(device: Device, threads: usize) -> Result<(f64, String)> {
    match device {
        Device::Cpu => Ok((host_memcpy(threads), format!("host memcpy, {threads} threads"))),
        Device::Cuda(n) => Ok((tandem_engine::cuda::copy_bandwidth(n)?, "device-to-device copy".into())),
    }
}

/// Best of several multi-threaded copies of a buffer much larger than any CPU cache, as bytes
/// copied per second.
fn host_memcpy(threads: usize) -> f64 {
    const BYTES: usize = 256 << 20;
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    let part = BYTES.div_ceil(threads.max(1));
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, sr) in dst.chunks_mut(part).zip(src.chunks(part)) {
                s.spawn(move || d.copy_from_slice(sr));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    BYTES as f64 / best
}

/// Bytes one decode step of `batch` sequences that each attend to `kv_tokens` positions must read:
/// `weights` plus `batch × kv_tokens × layers × 2 (K and V) × kv_heads × head_dim × kv_elem`.
fn decode_bytes(weights: u64, batch: usize, kv_tokens: f64, kv_token_bytes: u64) -> f64 {
    weights as f64 + batch as f64 * kv_tokens * kv_token_bytes as f64
}

/// Matrix-product FLOPs of a prefill of `p` tokens returning the last position's logits.
fn prefill_flops(c: &tandem_engine::config::ModelConfig, info: &WeightsInfo, p: usize) -> f64 {
    let head = info.head_elems as f64;
    let linear = (info.step_matrix_elems - info.head_elems) as f64;
    let p = p as f64;
    // Causal attention: position i scores i + 1 keys and mixes i + 1 values, in every head.
    let attention = 4.0 * (c.num_layers * c.num_heads * c.head_dim) as f64 * p * (p + 1.0) / 2.0;
    2.0 * p * linear + 2.0 * head + attention
}

/// A fixed pseudo-random token for (sequence, position).
fn token(seq: usize, pos: usize, vocab: usize) -> u32 {
    let x =
        (seq as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (pos as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    ((x ^ (x >> 29)) % vocab as u64) as u32
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Checks one pass's returned logits: one row of `vocab` finite values per chunk.
fn check_last_logits(out: &[Vec<f32>], chunks: usize, vocab: usize) -> Result<()> {
    ensure!(out.len() == chunks, "the backend returned logits for {} of {chunks} sequences", out.len());
    for (i, row) in out.iter().enumerate() {
        ensure!(row.len() == vocab, "sequence {i}: {} logits, expected {vocab}", row.len());
        ensure!(row.iter().all(|x| x.is_finite()), "sequence {i}: non-finite logits");
    }
    Ok(())
}

/// Prefills `seqs` sequences to `context` tokens each, packing chunks of several sequences into
/// passes of at most the backend's max batch tokens. Returns the seconds it took.
fn fill(backend: &mut dyn Backend, tables: &[Vec<BlockId>], context: usize) -> Result<f64> {
    let vocab = backend.config().vocab_size;
    let budget = backend.max_batch_tokens();
    let prompts: Vec<Vec<u32>> =
        (0..tables.len()).map(|s| (0..context).map(|p| token(s, p, vocab)).collect()).collect();
    let t = Instant::now();
    let (mut seq, mut pos) = (0, 0);
    while seq < tables.len() {
        let mut chunks = Vec::new();
        let mut room = budget;
        while room > 0 && seq < tables.len() {
            let n = room.min(context - pos);
            chunks.push(SeqChunk {
                tokens: &prompts[seq][pos..pos + n],
                start_pos: pos,
                block_table: &tables[seq],
                logits: LogitsRequest::None,
                write: WriteMode::Direct,
                adapter: None,
            });
            room -= n;
            pos += n;
            if pos == context {
                (seq, pos) = (seq + 1, 0);
            }
        }
        backend.forward(&chunks)?;
    }
    Ok(t.elapsed().as_secs_f64())
}

struct DecodeRow {
    batch: usize,
    ms_per_step: f64,
    bytes_per_step: f64,
    /// Kernel launches (and library calls) of one step's pass, where the backend counts them.
    kernels: Option<u64>,
}

/// Times decode steps (greedy picks) of the first `batch` sequences, starting at position
/// `context`. Also returns the kernels of a step's pass, where the backend counts them and
/// encoded one for this batch (its first step captures or runs the pass).
fn decode(
    backend: &mut dyn Backend,
    tables: &[Vec<BlockId>],
    batch: usize,
    a: &BackendBenchArgs,
) -> Result<(f64, Option<u64>)> {
    let vocab = backend.config().vocab_size;
    let mut times = Vec::with_capacity(a.steps);
    let mut kernels = None;
    let params = SamplingParams { temperature: 1.0, top_p: 0.9, ..SamplingParams::greedy() };
    let mut samplers: Vec<Sampler> = (0..batch).map(|s| Sampler::new(&params, s as u64)).collect();
    for step in 0..a.warmup + a.steps {
        let encoded_before = backend.pass_launches().map(|p| p.0);
        let pos = a.context + step;
        let tokens: Vec<[u32; 1]> = (0..batch).map(|s| [token(s, pos, vocab)]).collect();
        let chunks: Vec<SeqChunk<'_>> = (0..batch)
            .map(|s| SeqChunk {
                tokens: &tokens[s],
                start_pos: pos,
                block_table: &tables[s],
                logits: LogitsRequest::Last,
                write: WriteMode::Direct,
                adapter: None,
            })
            .collect();
        // Greedy picks, as the scheduler asks for them when every sequence decodes greedily (a
        // GPU backend then returns a token per sequence, not a vocabulary of logits).
        let t = Instant::now();
        let out = if a.sampled {
            sampled_step(backend, &chunks, &mut samplers)?
        } else {
            backend.forward_greedy(&chunks)?
        };
        let dt = t.elapsed().as_secs_f64();
        if let (Some(before), Some((after, launched))) = (encoded_before, backend.pass_launches()) {
            if after > before && kernels.is_none() {
                kernels = Some(launched);
            }
        }
        ensure!(out.len() == batch, "the backend returned picks for {} of {batch} sequences", out.len());
        for (i, pick) in out.iter().enumerate() {
            match pick {
                Some((tok, lp)) => ensure!(
                    (*tok as usize) < vocab && *lp <= 0.0,
                    "sequence {i}: picked token {tok} with log-probability {lp}"
                ),
                None => anyhow::bail!("sequence {i}: no pick"),
            }
        }
        if step >= a.warmup {
            times.push(dt);
        }
    }
    Ok((median(times), kernels))
}

/// One sampled decode step as the scheduler runs it: drawn on the device where the backend
/// samples there, else from each logits row on the host.
fn sampled_step(
    backend: &mut dyn Backend,
    chunks: &[SeqChunk<'_>],
    samplers: &mut [Sampler],
) -> Result<Vec<Option<(u32, f32)>>> {
    let vocab = backend.config().vocab_size;
    let picks = if backend.samples_on_device() {
        let specs: Vec<Option<RowSampling>> =
            samplers.iter().map(|s| Some(s.device_row(&[], vocab))).collect();
        backend.forward_sampled(chunks, &mut || specs.clone())?
    } else {
        backend.forward(chunks)?.into_iter().map(DevicePick::Row).collect()
    };
    Ok(picks
        .into_iter()
        .zip(samplers.iter_mut())
        .map(|(pick, s)| match pick {
            DevicePick::Sampled { sampled, drew } => {
                s.device_drew(drew);
                Some((sampled.token, sampled.logprob))
            }
            DevicePick::Row(mut row) => (!row.is_empty()).then(|| {
                let x = s.sample(&mut row, &[]);
                (x.token, x.logprob)
            }),
        })
        .collect())
}

/// Median seconds of a one-token decode step of sequence `table` at `context` and of an `n`-token
/// staged verification pass there (all rows' logits, each picked greedily, the staging dropped),
/// timed in alternation.
fn verify(
    backend: &mut dyn Backend,
    table: &[BlockId],
    context: usize,
    n: usize,
    a: &BackendBenchArgs,
) -> Result<(f64, f64)> {
    let vocab = backend.config().vocab_size;
    let tokens: Vec<u32> = (0..n).map(|i| token(0, context + i, vocab)).collect();
    let (mut one, mut many) = (Vec::new(), Vec::new());
    for step in 0..a.warmup + a.steps {
        let decode = SeqChunk {
            tokens: &tokens[..1],
            start_pos: context,
            block_table: table,
            logits: LogitsRequest::Last,
            write: WriteMode::Direct,
            adapter: None,
        };
        let t = Instant::now();
        let out = backend.forward_greedy(&[decode])?;
        let dt1 = t.elapsed().as_secs_f64();
        ensure!(matches!(out.as_slice(), [Some(_)]), "the decode step returned no pick");
        let chunk =
            SeqChunk { tokens: &tokens, logits: LogitsRequest::All, write: WriteMode::Staged, ..decode };
        let t = Instant::now();
        let mut rows = backend.forward(&[chunk])?;
        let picks: Vec<(u32, f32)> = rows
            .iter_mut()
            .flat_map(|r| r.chunks_exact_mut(vocab))
            .map(tandem_engine::sampler::greedy_pick)
            .collect();
        backend.discard_staged();
        let dtn = t.elapsed().as_secs_f64();
        ensure!(picks.len() == n, "the verification pass returned {} rows for {n} tokens", picks.len());
        if step >= a.warmup {
            one.push(dt1);
            many.push(dtn);
        }
    }
    Ok((median(one), median(many)))
}

/// Times a `len`-token prefill of sequence `table` (one warm-up, then `reps` runs).
fn prefill(backend: &mut dyn Backend, table: &[BlockId], len: usize, reps: usize) -> Result<f64> {
    let vocab = backend.config().vocab_size;
    let prompt: Vec<u32> = (0..len).map(|p| token(usize::MAX, p, vocab)).collect();
    let step = backend.max_batch_tokens();
    let mut times = Vec::new();
    for rep in 0..reps + 1 {
        let t = Instant::now();
        let mut last = Vec::new();
        for (i, chunk) in prompt.chunks(step).enumerate() {
            let is_last = (i + 1) * step >= len;
            let c = SeqChunk {
                tokens: chunk,
                start_pos: i * step,
                block_table: table,
                logits: if is_last { LogitsRequest::Last } else { LogitsRequest::None },
                write: WriteMode::Direct,
                adapter: None,
            };
            last = backend.forward(&[c])?;
        }
        let dt = t.elapsed().as_secs_f64();
        check_last_logits(&last, 1, vocab)?;
        if rep > 0 {
            times.push(dt);
        }
    }
    Ok(median(times))
}

pub(crate) fn run(a: BackendBenchArgs) -> Result<()> {
    ensure!(!a.batch.is_empty() && a.batch.iter().all(|&b| b > 0), "--batch sizes must be positive");
    ensure!(a.context > 0, "--context must be positive");
    ensure!(a.verify.iter().all(|&n| n > 0), "--verify lengths must be positive");
    ensure!(a.steps > 0 && a.reps > 0, "--steps and --reps must be positive");
    ensure!(
        a.backend.block_size > 0 && a.max_batch_tokens > 0,
        "--block-size and --max-batch-tokens must be positive"
    );
    if let Some(p) = a.peak_tflops {
        ensure!(p.is_finite() && p > 0.0, "--peak-tflops must be positive");
    }
    let max_batch = *a.batch.iter().max().expect("checked non-empty");
    let max_verify = a.verify.iter().copied().max().unwrap_or(0);
    let seq_tokens = a.context + (a.warmup + a.steps).max(max_verify);
    let bs = a.backend.block_size;
    let num_blocks = (max_batch * seq_tokens.div_ceil(bs)).max(a.prefill.div_ceil(bs));
    let threads = a
        .backend
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));

    // Measured before the backend takes its memory (a large KV pool can leave a GPU little room).
    let device = a.backend.device;
    let bandwidth = match copy_bandwidth(device, threads) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("warning: no copy bandwidth measurement on {device}: {e:#}; no bounds");
            None
        }
    };

    let opts = a.backend.options(num_blocks, a.max_batch_tokens.max(max_batch).max(max_verify));
    let (path, info, mut backend) = a.backend.open(opts)?;
    let cfg = backend.config().clone();
    let max_pos = cfg.max_position_embeddings;
    if seq_tokens > max_pos || a.prefill > max_pos {
        bail!(
            "--context {} + the larger of --warmup + --steps ({}) and --verify ({max_verify}) = {seq_tokens} \
             and --prefill {} must not exceed the model's context of {max_pos} tokens",
            a.context,
            a.warmup + a.steps,
            a.prefill
        );
    }
    ensure!(
        backend.max_batch_tokens() >= max_batch.max(max_verify),
        "the backend accepts at most {} tokens per pass, fewer than the batch of {max_batch} or the \
         verification pass of {max_verify}",
        backend.max_batch_tokens()
    );
    let layout = backend.kv_layout();
    let kv_elem = (layout.block_bytes() / layout.block_elems()) as u64;
    let kv_token_bytes = (cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim) as u64 * kv_elem;
    let (weight_bytes, weight_storage) = info.step_bytes_on(device, a.backend.dtype);

    let mut alloc = BlockAllocator::try_new(num_blocks, bs)?;
    let mut tables = Vec::with_capacity(max_batch);
    for s in 0..max_batch {
        tables.push(alloc.add_sequence(s as u64, seq_tokens)?.to_vec());
    }
    let fill_s = fill(backend.as_mut(), &tables, a.context)?;

    let mut rows = Vec::new();
    for &b in &a.batch {
        let (step_s, kernels) = decode(backend.as_mut(), &tables, b, &a)?;
        // Timed step `i` attends to `context + warmup + i + 1` positions.
        let kv_tokens = (a.context + a.warmup) as f64 + (a.steps as f64 + 1.0) / 2.0;
        rows.push(DecodeRow {
            batch: b,
            ms_per_step: step_s * 1e3,
            bytes_per_step: decode_bytes(weight_bytes, b, kv_tokens, kv_token_bytes),
            kernels,
        });
    }
    let mut verify_json = Vec::new();
    for &n in &a.verify {
        let (one, many) = verify(backend.as_mut(), &tables[0], a.context, n, &a)?;
        verify_json.push(json!({
            "tokens": n,
            "ms_per_pass": many * 1e3,
            "decode_ms": one * 1e3,
            "decode_steps": many / one,
        }));
    }
    for s in 0..max_batch {
        alloc.free_sequence(s as u64)?;
    }

    let prefill_s = if a.prefill > 0 {
        let table = alloc.add_sequence(u64::MAX, a.prefill)?.to_vec();
        let s = prefill(backend.as_mut(), &table, a.prefill, a.reps)?;
        alloc.free_sequence(u64::MAX)?;
        Some(s)
    } else {
        None
    };
    alloc.check_invariants()?;

    // Bytes read + written per second by the copy.
    let traffic = bandwidth.as_ref().map(|b| 2.0 * b.0);
    let decode_json: Vec<_> = rows
        .iter()
        .map(|r| {
            let bound_ms = traffic.map(|t| r.bytes_per_step / t * 1e3);
            json!({
                "batch": r.batch,
                "ms_per_step": r.ms_per_step,
                "tokens_per_s": r.batch as f64 / r.ms_per_step * 1e3,
                "bytes_per_step": r.bytes_per_step,
                "bound_ms_per_step": bound_ms,
                "bound_tokens_per_s": bound_ms.map(|b| r.batch as f64 / b * 1e3),
                "times_bound": bound_ms.map(|b| r.ms_per_step / b),
                "kernels_per_step": r.kernels,
                "kernels_per_layer": r.kernels.map(|k| k as f64 / cfg.num_layers as f64),
            })
        })
        .collect();
    let prefill_json = prefill_s.map(|s| {
        let flops = prefill_flops(&cfg, &info, a.prefill);
        let bound_s = a.peak_tflops.map(|p| flops / (p * 1e12));
        json!({
            "tokens": a.prefill,
            "seconds": s,
            "tokens_per_s": a.prefill as f64 / s,
            "flops": flops,
            "achieved_tflops": flops / s / 1e12,
            "peak_tflops": a.peak_tflops,
            "bound_tokens_per_s": bound_s.map(|b| a.prefill as f64 / b),
            "times_bound": bound_s.map(|b| s / b),
        })
    });
    let report = json!({
        "model": path.display().to_string(),
        "device": backend.device().to_string(),
        "compute_dtype": a.backend.compute_dtype(),
        "activations": a.backend.activations.to_string(),
        "layers": cfg.num_layers,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab": cfg.vocab_size,
        "weight_bytes_per_step": weight_bytes,
        "weight_storage": weight_storage,
        "kv_elem_bytes": kv_elem,
        "kv_dtype": layout.dtype.to_string(),
        "context": a.context,
        "warmup_steps": a.warmup,
        "steps": a.steps,
        "block_size": bs,
        "max_batch_tokens": backend.max_batch_tokens(),
        "copy_bytes_per_s": bandwidth.as_ref().map(|b| b.0),
        "traffic_bytes_per_s": traffic,
        "bandwidth_source": bandwidth.as_ref().map(|b| b.1.clone()),
        "fill_seconds": fill_s,
        "fill_tokens_per_s": (max_batch * a.context) as f64 / fill_s,
        "decode_sampling": if !a.sampled {
            "greedy"
        } else if backend.samples_on_device() {
            "sampled on the device"
        } else {
            "sampled on the host"
        },
        "decode": decode_json,
        "prefill": prefill_json,
        "verify": verify_json,
    });
    if a.json {
        println!("{report}");
    } else {
        print_table(&report);
    }
    Ok(())
}

fn print_table(r: &serde_json::Value) {
    let f = |v: &serde_json::Value, digits: usize| match v.as_f64() {
        Some(x) => format!("{x:.digits$}"),
        None => "-".into(),
    };
    println!("model: {}", r["model"].as_str().unwrap_or("?"));
    println!(
        "device: {} ({}); weights read per step: {:.1} MB ({}); KV: {} bytes per element; context {}",
        r["device"].as_str().unwrap_or("?"),
        r["compute_dtype"].as_str().unwrap_or("?"),
        r["weight_bytes_per_step"].as_f64().unwrap_or(0.0) / 1e6,
        r["weight_storage"].as_str().unwrap_or("?"),
        r["kv_elem_bytes"],
        r["context"]
    );
    match r["traffic_bytes_per_s"].as_f64() {
        Some(bw) => println!(
            "memory traffic: {:.1} GB/s read + written ({}, twice the copy bandwidth)",
            bw / 1e9,
            r["bandwidth_source"].as_str().unwrap_or("?")
        ),
        None => println!("memory traffic: not measured; no bounds"),
    }
    println!();
    println!(
        "| batch | ms/step | tokens/s | MB read/step | bound ms/step | bound tokens/s | × bound | kernels/layer |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for d in r["decode"].as_array().into_iter().flatten() {
        println!(
            "| {} | {} | {} | {:.1} | {} | {} | {} | {} |",
            d["batch"],
            f(&d["ms_per_step"], 3),
            f(&d["tokens_per_s"], 1),
            d["bytes_per_step"].as_f64().unwrap_or(0.0) / 1e6,
            f(&d["bound_ms_per_step"], 3),
            f(&d["bound_tokens_per_s"], 1),
            f(&d["times_bound"], 2),
            f(&d["kernels_per_layer"], 1)
        );
    }
    let v = r["verify"].as_array().map(Vec::as_slice).unwrap_or_default();
    if !v.is_empty() {
        println!();
        println!("| verification pass, tokens | ms/pass | one-token step ms | × a decode step |");
        println!("|---:|---:|---:|---:|");
        for x in v {
            println!(
                "| {} | {} | {} | {} |",
                x["tokens"],
                f(&x["ms_per_pass"], 3),
                f(&x["decode_ms"], 3),
                f(&x["decode_steps"], 2)
            );
        }
    }
    let p = &r["prefill"];
    if !p.is_null() {
        println!();
        println!(
            "prefill of {} tokens: {} tokens/s ({} s, {} TFLOP/s of matrix products); bound at {} TFLOP/s: {} \
             tokens/s (× bound {})",
            p["tokens"],
            f(&p["tokens_per_s"], 1),
            f(&p["seconds"], 4),
            f(&p["achieved_tflops"], 3),
            f(&p["peak_tflops"], 1),
            f(&p["bound_tokens_per_s"], 1),
            f(&p["times_bound"], 2)
        );
    }
}
