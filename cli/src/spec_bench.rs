//! `tandem bench --speculate ...` (and `--workload friendly|unfriendly`): a workload of prompts
//! through the scheduler, continuously batched at `--concurrency`, run twice in one process on one
//! engine, first without speculation (the baseline) and then with it, and printed side by side.
//!
//! Workloads (deterministic: the same flags give the same prompts):
//! - `friendly`: prompts that ask to repeat, quote or edit a passage given in the prompt, so the
//!   output repeats the input; this is what prompt lookup (`--speculate ngram`) is for;
//! - `unfriendly`: prompts that ask for free-form stories, so little of the output is in the prompt;
//! - `synthetic`: pseudo-random token ids of `--prompt-tokens` (the same prompts as
//!   `tandem bench --router`).
//!
//! What a run reports: *decode tokens/s*, the tokens produced by steps that ran while no prompt
//! work was pending, over those steps' time (a step that also computes prompt tokens is left out
//! of it); *output tokens/s*, every generated token over the run's wall time; and the draft tokens
//! proposed and accepted. The speedup is the ratio of decode tokens/s. Both runs are greedy, so
//! their outputs should be identical (bit for bit on the CPU while every pass stays within
//! `cpu::matmul::SMALL_N` tokens; otherwise up to a near-tie flipped by rounding); the report says
//! whether they were. A short warm-up on the
//! same engine precedes the baseline, so both runs find the weights in memory. These are figures,
//! not pass/fail thresholds: on a shared machine they move between runs, which is why both are
//! measured in the same invocation.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tandem_engine::kv::SeqId;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SeqEvent};
use tandem_engine::spec::SpecStats;
use tandem_engine::tokenizer::{ChatMessage, Tokenizer};
use tandem_serve::speculation::describe;
use tandem_worker::speculation::{build_drafter, registration_record, Target};

use crate::loadgen::synthetic_prompt;
use crate::local::{backend_options, build_engine};
use crate::BenchArgs;

/// What `tandem bench` runs in process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Workload {
    /// Pseudo-random prompt token ids.
    Synthetic,
    /// Repeat, quote or edit a passage given in the prompt.
    Friendly,
    /// Free-form stories.
    Unfriendly,
    /// With --router only: a shared system prompt and multi-turn chats, prefix cache off then on.
    SharedPrefix,
    /// With --router only: many multi-turn conversations revisited in random order.
    Revisit,
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Workload::Synthetic => "synthetic",
            Workload::Friendly => "friendly",
            Workload::Unfriendly => "unfriendly",
            Workload::SharedPrefix => "shared-prefix",
            Workload::Revisit => "revisit",
        })
    }
}

/// Passages the friendly prompts quote; short enough for a 512-token context with the
/// instruction and the output.
const PASSAGES: [&str; 4] = [
    "The river town kept its clocks by the ferry. Every morning the first boat left at six, and the \
     baker, the teacher and the harbour master all set their watches by its horn.",
    "To make the bread, mix the flour with the salt, add the water slowly, and knead the dough for \
     ten minutes until it is smooth. Let it rise for an hour, then bake it until golden.",
    "The meeting is moved to Thursday at ten in the small room on the second floor. Please bring the \
     budget figures for the spring quarter and the list of open orders.",
    "fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n\nfn main() {\n    let total = add(2, 3);\n    \
     println!(\"total = {total}\");\n}",
];

/// What the friendly prompts ask for; `{}` is the passage.
const FRIENDLY: [&str; 4] = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Quote this passage in full, without changing anything:\n\n{}",
    "Rewrite the text below with every sentence on its own line, keeping all the words the same:\n\n{}",
    "Copy the following text and put it in quotation marks:\n\n{}",
];

/// What the unfriendly prompts ask a story about.
const TOPICS: [&str; 8] = [
    "a lighthouse keeper who finds a map",
    "a robot learning to paint",
    "two friends lost in a desert city",
    "a dragon who is afraid of heights",
    "the last train of the night",
    "a garden that grows at night",
    "a detective who cannot remember faces",
    "a village where it never stops snowing",
];

/// The text of request `i` of a friendly or unfriendly workload.
fn prompt_text(w: Workload, i: usize) -> String {
    match w {
        Workload::Friendly => {
            let passage = PASSAGES[i % PASSAGES.len()];
            FRIENDLY[(i / PASSAGES.len()) % FRIENDLY.len()].replace("{}", passage)
        }
        _ => format!("Write a short story about {}.", TOPICS[i % TOPICS.len()]),
    }
}

/// The `n` prompts of workload `w` as token ids: chat prompts when the model has a chat template,
/// plain text otherwise; synthetic prompts are `prompt_tokens` ids below `vocab_limit`.
pub(crate) fn prompts(
    w: Workload,
    tok: &Tokenizer,
    n: usize,
    prompt_tokens: usize,
    vocab_limit: u32,
) -> Result<Vec<Vec<u32>>> {
    (0..n)
        .map(|i| {
            if w == Workload::Synthetic {
                return Ok(synthetic_prompt(i, prompt_tokens, vocab_limit));
            }
            user_prompt(tok, prompt_text(w, i))
        })
        .collect()
}

/// `text` as a user's prompt: the chat template's rendering of one user message when the model
/// has one, else the plain text (with BOS where the model wants it).
pub(crate) fn user_prompt(tok: &Tokenizer, text: String) -> Result<Vec<u32>> {
    if tok.has_chat_template() {
        let chat = tok.apply_chat_template(&[ChatMessage::new("user", text)], true)?;
        Ok(tok.encode(&chat, false)?)
    } else {
        Ok(tok.encode(&text, true)?)
    }
}

/// What one run of a workload measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub(crate) struct RunReport {
    /// Tokens generated, all requests together.
    pub output_tokens: usize,
    pub wall_s: f64,
    pub output_tokens_per_s: f64,
    /// Tokens of the steps that ran with no prompt work pending, and those steps' time.
    pub decode_tokens: usize,
    pub decode_s: f64,
    pub decode_tokens_per_s: f64,
    /// Draft tokens verified and accepted, and verification chunks run, in this run.
    pub proposed: u64,
    pub accepted: u64,
    pub verifications: u64,
    pub acceptance_rate: f64,
    pub mean_accepted_len: f64,
    /// Each request's generated tokens.
    #[serde(skip)]
    pub outputs: Vec<Vec<u32>>,
}

fn per_s(n: usize, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// Runs every prompt to completion, at most `concurrency` at a time (a finished request's place
/// goes to the next prompt at once).
pub(crate) fn run_workload(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    concurrency: usize,
) -> Result<RunReport> {
    run_workload_each(engine, prompts, &vec![params.clone(); prompts.len()], concurrency)
}

/// [`run_workload`] with each prompt's own parameters (`params[i]` for `prompts[i]`).
pub(crate) fn run_workload_each(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    params: &[SamplingParams],
    concurrency: usize,
) -> Result<RunReport> {
    let before = engine.spec_stats();
    let mut outputs = vec![Vec::new(); prompts.len()];
    let mut active: HashMap<SeqId, usize> = HashMap::new();
    let mut next = 0;
    let (mut decode_tokens, mut decode_time) = (0usize, Duration::ZERO);
    let t0 = Instant::now();
    while next < prompts.len() || !active.is_empty() {
        while active.len() < concurrency.max(1) && next < prompts.len() {
            let seq = engine
                .add_request(prompts[next].clone(), params[next].clone())
                .with_context(|| format!("request {next} ({} prompt tokens)", prompts[next].len()))?;
            active.insert(seq, next);
            next += 1;
        }
        let prompt_work = engine.load().waiting_prompt_tokens > 0;
        let step_start = Instant::now();
        let events = engine.step()?;
        let step_time = step_start.elapsed();
        let mut produced = 0;
        for ev in events {
            match ev {
                SeqEvent::Token { seq, token, .. } => {
                    if let Some(&i) = active.get(&seq) {
                        outputs[i].push(token);
                        produced += 1;
                    }
                }
                SeqEvent::Finished { seq, .. } => {
                    active.remove(&seq);
                }
                SeqEvent::Failed { seq, error } => {
                    bail!("request {} failed: {error}", active.get(&seq).copied().unwrap_or(usize::MAX))
                }
                SeqEvent::Prefilled { .. } | SeqEvent::PromptLogprobs { .. } => {}
            }
        }
        if !prompt_work {
            decode_tokens += produced;
            decode_time += step_time;
        }
        if produced == 0 && !active.is_empty() && !engine.has_work() {
            bail!("the engine stopped with {} requests unfinished", active.len());
        }
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let after = engine.spec_stats();
    let delta = SpecStats {
        proposed: after.proposed - before.proposed,
        accepted: after.accepted - before.accepted,
        verifications: after.verifications - before.verifications,
    };
    let output_tokens = outputs.iter().map(Vec::len).sum();
    let decode_s = decode_time.as_secs_f64();
    Ok(RunReport {
        output_tokens,
        wall_s,
        output_tokens_per_s: per_s(output_tokens, wall_s),
        decode_tokens,
        decode_s,
        decode_tokens_per_s: per_s(decode_tokens, decode_s),
        proposed: delta.proposed,
        accepted: delta.accepted,
        verifications: delta.verifications,
        acceptance_rate: delta.acceptance_rate(),
        mean_accepted_len: delta.mean_accepted_len(),
        outputs,
    })
}

/// `tandem bench` through the scheduler: the baseline, then (with `--speculate`) the same
/// workload with speculation.
pub(crate) fn run(a: BenchArgs) -> Result<()> {
    a.spec.validate()?;
    if a.requests == 0 || a.concurrency == 0 || a.decode_tokens == 0 {
        bail!("--requests, --concurrency and --decode-tokens must all be at least 1");
    }
    if a.workload == Workload::Synthetic && a.prompt_tokens == 0 {
        bail!("--prompt-tokens must be at least 1");
    }
    // Both runs compute the same prompts on one engine: a prefix cache would let the second reuse
    // the first's KV and time something else than speculation.
    let engine_args = crate::EngineArgs { prefix_cache: false, ..a.engine.clone() };
    let (path, mut engine) = build_engine(&engine_args)?;
    let tok = engine.tokenizer().clone();
    let vocab = engine.backend().config().vocab_size;
    let prompts = prompts(a.workload, &tok, a.requests, a.prompt_tokens, a.vocab_limit.min(vocab as u32))?;
    // Built before anything runs, so a draft model that cannot work fails at once.
    let opts = backend_options(&a.engine);
    let target = Target { tokenizer: &tok, vocab_size: vocab, device: a.engine.device, backend: &opts };
    let drafter = build_drafter(&a.spec, target)?;
    let params = SamplingParams {
        max_tokens: a.decode_tokens,
        temperature: a.temperature,
        seed: (a.temperature > 0.0).then_some(a.seed),
        ..SamplingParams::greedy()
    };
    // The request's own check (temperature finite and >= 0, ...), naming the field.
    params.validate(vocab).map_err(|e| anyhow::anyhow!("--temperature {}: {e}", a.temperature))?;
    // Sampled drafts keep the output's distribution, not its tokens: nothing to compare then.
    let comparable = !(a.temperature > 0.0 && a.spec.spec_sampled_drafts);

    let warm_up = SamplingParams { max_tokens: a.decode_tokens.min(4), ..SamplingParams::greedy() };
    run_workload(&mut engine, &prompts[..1], &warm_up, 1).context("warming up")?;
    let baseline = run_workload(&mut engine, &prompts, &params, a.concurrency).context("the baseline run")?;
    let (engine, speculative) = match drafter {
        None => (engine, None),
        Some((drafter, spec_opts)) => {
            let mut engine = engine.with_speculation(drafter, spec_opts)?;
            let r =
                run_workload(&mut engine, &prompts, &params, a.concurrency).context("the speculative run")?;
            (engine, Some(r))
        }
    };
    engine.check_kv()?;
    let spec_line = registration_record(&engine).map(|r| describe(Some(&r)));
    let same_output = speculative.as_ref().filter(|_| comparable).map(|s| s.outputs == baseline.outputs);
    let speedup = speculative.as_ref().map(|s| {
        if baseline.decode_tokens_per_s > 0.0 {
            s.decode_tokens_per_s / baseline.decode_tokens_per_s
        } else {
            0.0
        }
    });
    if same_output == Some(false) {
        eprintln!(
            "warning: output with speculation differs from the baseline's. Passes within the CPU's \
             small-pass limit (8 tokens) compute exactly what decode steps do; larger ones (many sequences, \
             many draft tokens) agree to rounding, which can flip a near-tie. Anything else is a bug"
        );
    }
    if a.json {
        let v = serde_json::json!({
            "engine": "tandem",
            "version": env!("CARGO_PKG_VERSION"),
            "model": path.display().to_string(),
            "workload": a.workload,
            "requests": a.requests,
            "concurrency": a.concurrency,
            "max_tokens": a.decode_tokens,
            "prompt_tokens": prompts.iter().map(Vec::len).sum::<usize>(),
            "speculation": spec_line,
            "baseline": baseline,
            "speculative": speculative,
            "speedup": speedup,
            "same_output": same_output,
        });
        println!("{v}");
        return Ok(());
    }
    println!("model: {}", path.display());
    println!(
        "workload: {}, {} requests ({} prompt tokens in all), concurrency {}, up to {} tokens each, {}",
        a.workload,
        a.requests,
        prompts.iter().map(Vec::len).sum::<usize>(),
        a.concurrency,
        a.decode_tokens,
        if a.temperature > 0.0 {
            format!("temperature {} (seed {})", a.temperature, a.seed)
        } else {
            "greedy".to_string()
        }
    );
    let sampled_drafts = if a.spec.spec_sampled_drafts { ", sampled drafts" } else { "" };
    println!("speculation: {}{sampled_drafts}", spec_line.as_deref().unwrap_or("off"));
    println!();
    println!(
        "| run | output tokens | decode tok/s | output tok/s | speedup | proposed | accepted | acceptance | mean accepted len |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let row = |name: &str, r: &RunReport, speedup: Option<f64>, spec: bool| {
        let dash = || "-".to_string();
        println!(
            "| {name} | {} | {} | {:.1} | {} | {} | {} | {} | {} |",
            r.output_tokens,
            if r.decode_s > 0.0 { format!("{:.1}", r.decode_tokens_per_s) } else { dash() },
            r.output_tokens_per_s,
            speedup.map(|x| format!("{x:.2}x")).unwrap_or_else(dash),
            if spec { r.proposed.to_string() } else { dash() },
            if spec { r.accepted.to_string() } else { dash() },
            if spec { format!("{:.1}%", 100.0 * r.acceptance_rate) } else { dash() },
            if spec { format!("{:.2}", r.mean_accepted_len) } else { dash() },
        );
    };
    row("baseline", &baseline, None, false);
    if let Some(s) = &speculative {
        row(&format!("{}", a.spec.speculate), s, speedup, true);
    }
    if let Some(same) = same_output {
        println!();
        println!("same output with and without speculation: {}", if same { "yes" } else { "NO" });
    } else if speculative.is_some() {
        println!();
        println!("output not compared: sampled drafts keep the output's distribution, not its tokens");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads_are_deterministic_and_friendly_prompts_quote_their_passage() {
        for i in 0..16 {
            let t = prompt_text(Workload::Friendly, i);
            assert_eq!(t, prompt_text(Workload::Friendly, i));
            assert!(t.contains(PASSAGES[i % PASSAGES.len()]), "{t}");
            assert!(prompt_text(Workload::Unfriendly, i).starts_with("Write a short story about"));
        }
        // Sixteen friendly prompts are sixteen different requests.
        let all: std::collections::HashSet<String> =
            (0..16).map(|i| prompt_text(Workload::Friendly, i)).collect();
        assert_eq!(all.len(), 16);
    }
}
