//! `tandem bench --structured`: what structured output costs on this machine. The constraint
//! engine's one-time and per-request costs (building the vocabulary view, compiling a schema),
//! the time to compute one token mask, and a chat workload run twice in this process, without and
//! then with a JSON Schema constraint, side by side: the masks are computed beside the forward
//! pass, and the figure that matters is the part of that time a step still waits for.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use tandem_engine::grammar::Constraint;
use tandem_engine::sampler::SamplingParams;

use crate::local::build_engine;
use crate::spec_bench::{run_workload, user_prompt, RunReport};
use crate::BenchArgs;

/// The schema of the constrained run: a record with strings, a number, an enum and a list.
const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "maxLength": 40},
    "role": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4}
  },
  "required": ["name", "age", "city", "role", "hobbies"],
  "additionalProperties": false
}"#;

const PEOPLE: [&str; 8] = [
    "a baker in Lyon",
    "a retired sailor",
    "a young violinist",
    "a nurse who runs marathons",
    "a beekeeper in Vermont",
    "a chess coach",
    "a train driver in Osaka",
    "a painter who restores churches",
];

pub(crate) fn run(a: BenchArgs) -> Result<()> {
    if a.requests == 0 || a.concurrency == 0 || a.decode_tokens == 0 {
        bail!("--requests, --concurrency and --decode-tokens must all be at least 1");
    }
    let engine_args = crate::EngineArgs { prefix_cache: false, ..a.engine.clone() };
    let (path, mut engine) = build_engine(&engine_args)?;
    let tok = engine.tokenizer().clone();

    let t = Instant::now();
    let env = tok.grammar()?;
    let env_ms = t.elapsed().as_secs_f64() * 1e3;
    let constraint = Constraint::JsonSchema(SCHEMA.into());
    let reps = 20;
    let t = Instant::now();
    for _ in 0..reps {
        env.compile(&constraint).map_err(anyhow::Error::msg)?;
    }
    let compile_ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;

    // One mask per token along a document the schema allows, as a request would walk it.
    let doc = r#"{"name": "Ada Lovelace", "age": 36, "city": "London", "role": "engineer", "hobbies": ["mathematics", "poetry", "horses"]}"#;
    let ids = tok.encode(doc, false)?;
    let mut g = env.compile(&constraint).map_err(anyhow::Error::msg)?;
    let mut mask_us = Vec::with_capacity(ids.len());
    for &t in &ids {
        let t0 = Instant::now();
        let m = g.mask().map_err(anyhow::Error::msg)?;
        mask_us.push(t0.elapsed().as_secs_f64() * 1e6);
        if !m.allows(t) {
            bail!("the bench's document leaves its own schema at token {t}");
        }
        g.advance(t).map_err(anyhow::Error::msg)?;
    }
    mask_us.sort_by(f64::total_cmp);
    let mean_us = mask_us.iter().sum::<f64>() / mask_us.len() as f64;
    let p50_us = mask_us[mask_us.len() / 2];
    let max_us = *mask_us.last().unwrap_or(&0.0);

    let prompts: Vec<Vec<u32>> = (0..a.requests)
        .map(|i| {
            let text = format!(
                "Describe {} as a JSON record with name, age, city, role and hobbies.",
                PEOPLE[i % PEOPLE.len()]
            );
            user_prompt(&tok, text)
        })
        .collect::<Result<_>>()?;
    let plain = SamplingParams { max_tokens: a.decode_tokens, ..SamplingParams::greedy() };
    let constrained = SamplingParams { constraint: Some(constraint), ..plain.clone() };
    run_workload(&mut engine, &prompts[..1], &SamplingParams { max_tokens: 4, ..plain.clone() }, 1)
        .context("warming up")?;
    let baseline =
        run_workload(&mut engine, &prompts, &plain, a.concurrency).context("the unconstrained run")?;
    let before = engine.structured_stats();
    let with =
        run_workload(&mut engine, &prompts, &constrained, a.concurrency).context("the constrained run")?;
    let after = engine.structured_stats();
    engine.check_kv()?;
    let masks = after.masks - before.masks;
    let per_mask_us = |s: f64| if masks > 0 { s * 1e6 / masks as f64 } else { 0.0 };
    let thread_us = per_mask_us(after.mask_seconds - before.mask_seconds);
    let exposed_us = per_mask_us(after.exposed_seconds - before.exposed_seconds);
    let valid = with
        .outputs
        .iter()
        .filter(|o| {
            let body: Vec<u32> = o.iter().copied().filter(|t| !tok.eos_token_ids().contains(t)).collect();
            tok.decode(&body, true)
                .ok()
                .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
                .is_some_and(|v| v.is_object())
        })
        .count();

    if a.json {
        let v = serde_json::json!({
            "engine": "tandem",
            "model": path.display().to_string(),
            "requests": a.requests,
            "concurrency": a.concurrency,
            "max_tokens": a.decode_tokens,
            "vocab_view_ms": env_ms,
            "compile_ms": compile_ms,
            "mask_us": {"mean": mean_us, "p50": p50_us, "max": max_us, "tokens": ids.len()},
            "unconstrained": baseline,
            "constrained": with,
            "masks": masks,
            "mask_thread_us_per_token": thread_us,
            "exposed_us_per_token": exposed_us,
            "valid_json": valid,
        });
        println!("{v}");
        return Ok(());
    }
    println!("model: {}", path.display());
    println!(
        "constraint engine: vocabulary view {env_ms:.1} ms (once per process), schema compile {compile_ms:.2} ms \
         (per request), one mask {mean_us:.0} us mean / {p50_us:.0} us p50 / {max_us:.0} us max over {} tokens",
        ids.len()
    );
    println!(
        "workload: {} chat requests, concurrency {}, up to {} tokens each, greedy",
        a.requests, a.concurrency, a.decode_tokens
    );
    println!();
    println!(
        "| run | output tokens | decode tok/s | output tok/s | mask time / token | step waited / token |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    let row = |name: &str, r: &RunReport, extra: String| {
        println!(
            "| {name} | {} | {:.1} | {:.1} | {extra} |",
            r.output_tokens, r.decode_tokens_per_s, r.output_tokens_per_s
        );
    };
    row("unconstrained", &baseline, "- | -".into());
    row("JSON Schema", &with, format!("{thread_us:.0} us | {exposed_us:.0} us"));
    println!();
    println!("constrained answers that parse as a JSON object: {valid} of {}", with.outputs.len());
    Ok(())
}
