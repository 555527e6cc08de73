//! The in-process engine: `tandem generate` and `tandem bench` without `--router`. `generate`
//! speculates when `--speculate` says so (`--json` then reports the draft tokens proposed and
//! accepted); the speculative `bench` is in `spec_bench`.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tandem_engine::backend::{Backend, BackendOptions, LogitsRequest, SeqChunk};
use tandem_engine::factory::create_backend;
use tandem_engine::kv::{BlockAllocator, WriteMode};
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions};
use tandem_engine::tokenizer::{ChatMessage, Tokenizer};
use tandem_serve::identity::resolve_model;
use tandem_worker::speculation::speculate;

use crate::{BenchArgs, EngineArgs, GenerateArgs};

/// The backend options the flags describe.
pub(crate) fn backend_options(a: &EngineArgs) -> BackendOptions {
    BackendOptions {
        num_blocks: a.kv_blocks,
        block_size: a.block_size,
        max_batch_tokens: a.max_batch_tokens,
        threads: a.threads.unwrap_or(0),
        dtype: a.dtype,
        cuda_graphs: !a.no_cuda_graphs,
        activations: a.activations,
        kv_dtype: a.kv_dtype,
        ..Default::default()
    }
}

/// Loads the model and creates the backend the flags describe.
fn build_backend(a: &EngineArgs) -> Result<(PathBuf, Box<dyn Backend>, Tokenizer)> {
    let path = resolve_model(a.model.as_deref())?;
    let model = load_model(&path).with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = model.tokenizer.clone();
    let backend = create_backend(a.device, model, backend_options(a))?;
    Ok((path, backend, tokenizer))
}

/// The engine the flags describe, without speculation, and the model's path.
pub(crate) fn build_engine(a: &EngineArgs) -> Result<(PathBuf, Engine)> {
    let (path, backend, tokenizer) = build_backend(a)?;
    let sched = SchedulerOptions { max_batch_tokens: a.max_batch_tokens, ..Default::default() };
    let mut engine = Engine::new(backend, tokenizer, sched);
    if a.prefix_cache {
        // The chain's root only has to be stable within this process.
        engine = engine.with_prefix_cache(&path.display().to_string());
    }
    Ok((path, engine))
}

pub(crate) fn generate(args: GenerateArgs) -> Result<()> {
    // Flags first: a bad combination fails before any model is read.
    args.spec.validate()?;
    let (_, engine) = build_engine(&args.engine)?;
    let mut engine = speculate(engine, &args.spec, args.engine.device, &backend_options(&args.engine))?;
    let tok = engine.tokenizer().clone();
    let prompt_ids = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::new("user", args.prompt.clone()));
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
    // The engine streams token ids; `generate` makes the text with the same piece the router
    // runs (detokenizer and stop strings), so this prints what a cluster would stream.
    let out = engine.generate(prompt_ids, params, |text| {
        if json {
            return;
        }
        let mut lock = stdout.lock();
        let _ = lock.write_all(text.as_bytes());
        let _ = lock.flush();
    })?;
    engine.check_kv()?;
    if json {
        let mut v = serde_json::json!({
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": out.token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason.as_ref().map(|r| r.as_str()),
        });
        if let Some(s) = out.speculation {
            v["speculation"] = serde_json::json!({"proposed": s.proposed, "accepted": s.accepted});
        }
        println!("{v}");
    } else {
        println!();
    }
    Ok(())
}

pub(crate) fn bench(args: BenchArgs) -> Result<()> {
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
    let (mut pp, mut tg, mut attn_share) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..args.reps.max(1) + 1 {
        let seq = 1;
        alloc.add_sequence(seq, total)?;
        let table = alloc.block_table(seq).unwrap().to_vec();
        let (t0, attn0) = (Instant::now(), tandem_engine::cpu::attention_time());
        let chunk = SeqChunk {
            tokens: &prompt,
            start_pos: 0,
            block_table: &table,
            logits: LogitsRequest::Last,
            write: WriteMode::Direct,
            adapter: None,
        };
        let logits = backend.forward(&[chunk])?;
        let t_pp = t0.elapsed().as_secs_f64();
        let attn_pp = (tandem_engine::cpu::attention_time() - attn0).as_secs_f64();
        let mut next = argmax(&logits[0]);
        let t1 = Instant::now();
        for i in 0..args.decode_tokens {
            let tokens = [next];
            let chunk = SeqChunk {
                tokens: &tokens,
                start_pos: args.prompt_tokens + i,
                block_table: &table,
                logits: LogitsRequest::Last,
                write: WriteMode::Direct,
                adapter: None,
            };
            let logits = backend.forward(&[chunk])?;
            next = argmax(&logits[0]);
        }
        let t_tg = t1.elapsed().as_secs_f64();
        alloc.free_sequence(seq)?;
        if rep > 0 {
            // The first repetition warms caches and page faults in the weights.
            pp.push(args.prompt_tokens as f64 / t_pp);
            attn_share.push(attn_pp / t_pp);
            tg.push(args.decode_tokens as f64 / t_tg);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (pp, tg) = (mean(&pp), mean(&tg));
    // Attention's share of the prompt's time (CPU backend only; the GPU's is not timed).
    let attn_share = (a.device == tandem_engine::Device::Cpu).then(|| mean(&attn_share));
    // The CPU's integer kernels' AMX decision (made when the backend was built).
    let amx = (a.device == tandem_engine::Device::Cpu
        && a.activations != tandem_engine::backend::Activations::F32)
        .then(tandem_engine::cpu::q8::amx_report)
        .flatten();
    // The attention kernel every row took: the backend's choice, by the same rule from the same
    // inputs (its pool's dtype, nothing asked).
    let attn_kernel = (a.device == tandem_engine::Device::Cpu)
        .then(|| tandem_engine::cpu::attention::choose(backend.kv_layout().dtype, None).ok())
        .flatten()
        .map(|(_, words)| words);
    let batched = match args.batch {
        0 | 1 => None,
        n => Some(batched_decode(
            backend.as_mut(),
            &mut alloc,
            &prompt,
            args.decode_tokens,
            n,
            args.reps.max(1),
        )?),
    };
    if args.json {
        let mut v = serde_json::json!({"engine": "tandem", "version": env!("CARGO_PKG_VERSION"), "threads": threads,
            "activations": a.activations.to_string(),
            "prompt_tokens": args.prompt_tokens, "prompt_tps": pp, "decode_tokens": args.decode_tokens, "decode_tps": tg});
        if let Some(amx) = &amx {
            v["amx"] = amx.as_str().into();
        }
        if let Some(share) = attn_share {
            v["prompt_attention_share"] = share.into();
        }
        if let Some(k) = &attn_kernel {
            v["attention_kernel"] = k.as_str().into();
        }
        if let Some(b) = batched {
            v["batch"] = args.batch.into();
            v["batched_decode_tps"] = b.into();
        }
        println!("{v}");
    } else {
        println!("model: {}", path.display());
        println!("threads: {threads}, activations: {}", a.activations);
        if let Some(amx) = &amx {
            println!("{amx}");
        }
        if let Some(k) = &attn_kernel {
            println!("{k}");
        }
        match attn_share {
            Some(share) => println!(
                "prompt ({} tokens): {pp:.1} tokens/s, {:.0}% of its time in attention",
                args.prompt_tokens,
                100.0 * share
            ),
            None => println!("prompt ({} tokens): {pp:.1} tokens/s", args.prompt_tokens),
        }
        println!("decode ({} tokens): {tg:.1} tokens/s", args.decode_tokens);
        if let Some(b) = batched {
            println!(
                "decode, {} sequences together: {b:.1} tokens/s ({:.2}x one stream)",
                args.batch,
                b / tg
            );
        }
    }
    Ok(())
}

/// Total decode tokens/s of `n` sequences stepped together, one token each per pass, after each
/// prefilled `prompt` (mean of `reps` runs after a warm-up run).
fn batched_decode(
    backend: &mut dyn Backend,
    alloc: &mut BlockAllocator,
    prompt: &[u32],
    decode_tokens: usize,
    n: usize,
    reps: usize,
) -> Result<f64> {
    let total = prompt.len() + decode_tokens;
    let mut rates = Vec::new();
    for rep in 0..reps + 1 {
        let mut tables = Vec::with_capacity(n);
        for s in 0..n {
            let seq = 100 + s as u64;
            if let Err(e) = alloc.add_sequence(seq, total) {
                for done in 0..s {
                    alloc.free_sequence(100 + done as u64)?;
                }
                bail!("{n} sequences of {total} tokens do not fit the KV pool ({e}); raise --kv-blocks");
            }
            tables.push(alloc.block_table(seq).unwrap().to_vec());
        }
        let mut next = Vec::with_capacity(n);
        for table in &tables {
            let chunk = SeqChunk {
                tokens: prompt,
                start_pos: 0,
                block_table: table,
                logits: LogitsRequest::Last,
                write: WriteMode::Direct,
                adapter: None,
            };
            next.push(argmax(&backend.forward(&[chunk])?[0]));
        }
        let t0 = Instant::now();
        for i in 0..decode_tokens {
            let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let chunks: Vec<SeqChunk<'_>> = tokens
                .iter()
                .zip(&tables)
                .map(|(t, table)| SeqChunk {
                    tokens: t,
                    start_pos: prompt.len() + i,
                    block_table: table,
                    logits: LogitsRequest::Last,
                    write: WriteMode::Direct,
                    adapter: None,
                })
                .collect();
            next = backend.forward(&chunks)?.iter().map(|l| argmax(l)).collect();
        }
        let secs = t0.elapsed().as_secs_f64();
        for s in 0..n {
            alloc.free_sequence(100 + s as u64)?;
        }
        if rep > 0 {
            rates.push((n * decode_tokens) as f64 / secs);
        }
    }
    Ok(rates.iter().sum::<f64>() / rates.len() as f64)
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
