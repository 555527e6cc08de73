//! `tandem bench --lora-adapters N`: decode speed with LoRA adapters against the base model, in
//! this process, side by side in one run.
//!
//! The same `--requests` prompts run with `--concurrency` in flight, alternately on the base
//! model and spread round-robin over N adapters of rank `--lora-rank` targeting every projection
//! (random weights made here from `--seed`, or the `--lora NAME=PATH` files given), `--reps`
//! times each. Prints each run's decode tokens/s and the ratio of the medians: what serving many
//! fine-tunes from one base costs against serving the base alone.

use anyhow::{bail, Context, Result};
use std::path::Path;

use tandem_engine::config::ModelConfig;
use tandem_engine::lora::{LoraAdapter, LoraTarget, LoraWeight, Proj};
use tandem_engine::sampler::SamplingParams;

use crate::loadgen::synthetic_prompt;
use crate::local::build_engine;
use crate::spec_bench::{run_workload_each, RunReport};
use crate::BenchArgs;

/// A seeded random adapter of rank `rank` over every projection of every layer, scaled so its
/// deltas are of the order of the base projections' outputs.
pub(crate) fn random_adapter(c: &ModelConfig, name: &str, seed: u64, rank: usize) -> Result<LoraAdapter> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let mut weights = Vec::new();
    for layer in 0..c.num_layers {
        for proj in Proj::ALL {
            let (din, dout) = proj.dims(c);
            let (sa, sb) = (1.0 / (din as f32).sqrt(), 0.02);
            weights.push(LoraWeight {
                target: LoraTarget { layer: layer as u32, proj },
                rank,
                a: (0..rank * din).map(|_| sa * next()).collect(),
                b: (0..dout * rank).map(|_| sb * next()).collect(),
                scale: 2.0,
            });
        }
    }
    Ok(LoraAdapter::new(name, Path::new(name), weights, c)?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

pub(crate) fn run(a: BenchArgs) -> Result<()> {
    let n = a.lora_adapters;
    if a.requests == 0 || a.concurrency == 0 || a.decode_tokens == 0 || a.prompt_tokens == 0 {
        bail!("--requests, --concurrency, --decode-tokens and --prompt-tokens must all be at least 1");
    }
    if a.lora_rank == 0 {
        bail!("--lora-rank must be at least 1");
    }
    // Runs repeat the same prompts on one engine: no prefix cache, so each computes them.
    let engine_args = crate::EngineArgs { prefix_cache: false, ..a.engine.clone() };
    let (path, mut engine) = build_engine(&engine_args)?;
    let config = engine.backend().config().clone();
    let vocab = config.vocab_size;
    if engine.max_adapters() < n {
        bail!("{n} adapters but the backend holds {} at once", engine.max_adapters());
    }
    let mut names = Vec::new();
    for i in 0..n {
        let name = format!("bench-{i}");
        let adapter = random_adapter(&config, &name, a.seed.wrapping_add(i as u64), a.lora_rank)?;
        engine.add_adapter(adapter).with_context(|| format!("adding adapter {name}"))?;
        names.push(name);
    }
    let prompts: Vec<Vec<u32>> = (0..a.requests)
        .map(|i| synthetic_prompt(i, a.prompt_tokens, a.vocab_limit.min(vocab as u32)))
        .collect();
    let greedy = SamplingParams { max_tokens: a.decode_tokens, ignore_eos: true, ..SamplingParams::greedy() };
    let base: Vec<SamplingParams> = vec![greedy.clone(); prompts.len()];
    let lora: Vec<SamplingParams> = (0..prompts.len())
        .map(|i| SamplingParams { adapter: names[i % n].clone(), ..greedy.clone() })
        .collect();
    // Warm up both paths (first passes, adapters made resident).
    run_workload_each(
        &mut engine,
        &prompts[..n.min(prompts.len())],
        &lora[..n.min(prompts.len())],
        a.concurrency,
    )
    .context("warming up")?;
    run_workload_each(&mut engine, &prompts[..1], &base[..1], 1).context("warming up")?;
    let (mut base_runs, mut lora_runs): (Vec<RunReport>, Vec<RunReport>) = (Vec::new(), Vec::new());
    for rep in 0..a.reps.max(1) {
        base_runs.push(
            run_workload_each(&mut engine, &prompts, &base, a.concurrency)
                .with_context(|| format!("base run {rep}"))?,
        );
        lora_runs.push(
            run_workload_each(&mut engine, &prompts, &lora, a.concurrency)
                .with_context(|| format!("adapter run {rep}"))?,
        );
    }
    engine.check_kv()?;
    let rate = |runs: &[RunReport]| median(runs.iter().map(|r| r.decode_tokens_per_s).collect());
    let (b, l) = (rate(&base_runs), rate(&lora_runs));
    let ratio = if b > 0.0 { l / b } else { 0.0 };
    let bytes: usize = engine.adapters().iter().map(|x| x.bytes).sum();
    let differs = lora_runs[0].outputs != base_runs[0].outputs;
    if a.json {
        let v = serde_json::json!({
            "engine": "tandem",
            "model": path.display().to_string(),
            "requests": a.requests,
            "concurrency": a.concurrency,
            "prompt_tokens": a.prompt_tokens,
            "decode_tokens": a.decode_tokens,
            "adapters": n,
            "rank": a.lora_rank,
            "adapter_bytes": bytes,
            "base_decode_tokens_per_s": base_runs.iter().map(|r| r.decode_tokens_per_s).collect::<Vec<_>>(),
            "lora_decode_tokens_per_s": lora_runs.iter().map(|r| r.decode_tokens_per_s).collect::<Vec<_>>(),
            "ratio": ratio,
            "adapters_change_output": differs,
        });
        println!("{v}");
        return Ok(());
    }
    println!("model: {}", path.display());
    println!(
        "{} requests of {} prompt tokens, {} in flight, {} tokens each (greedy); {n} adapters of rank {} on every \
         projection ({:.1} MB in all), requests spread round-robin",
        a.requests,
        a.prompt_tokens,
        a.concurrency,
        a.decode_tokens,
        a.lora_rank,
        bytes as f64 / 1e6
    );
    println!();
    println!("| run | decode tok/s (each rep) | median |");
    println!("|---|---|---:|");
    let list = |runs: &[RunReport]| {
        runs.iter().map(|r| format!("{:.1}", r.decode_tokens_per_s)).collect::<Vec<_>>().join(", ")
    };
    println!("| base | {} | {b:.1} |", list(&base_runs));
    println!("| {n} adapters | {} | {l:.1} |", list(&lora_runs));
    println!();
    println!(
        "adapters / base: {ratio:.2}x (the adapters change the output: {})",
        if differs { "yes" } else { "NO" }
    );
    Ok(())
}
