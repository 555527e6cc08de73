//! `tandem logits`: the logits at every position of one prompt, on any device, written as raw
//! little-endian `f32` (`positions × vocab`, row-major) for comparison with a reference
//! implementation (`scripts/gpu/compare_logits.py`).
//!
//! The prompt is run through [`Backend::forward`] directly, in chunks of at most the backend's
//! max batch tokens, each chunk asking for all of its logits; no scheduler and no sampler are
//! involved, so what is written is exactly what the backend computed.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_engine::backend::{Backend, LogitsRequest, SeqChunk};
use tandem_engine::kv::{BlockAllocator, WriteMode};

use crate::direct::{argmax, BackendFlags};

#[derive(Args)]
pub(crate) struct LogitsArgs {
    #[command(flatten)]
    backend: BackendFlags,
    /// Prompt token ids, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "tokens_file",
        conflicts_with = "tokens_file"
    )]
    tokens: Vec<u32>,
    /// Read the prompt token ids from this file instead: a JSON array, or ids separated by
    /// commas or white space.
    #[arg(long)]
    tokens_file: Option<PathBuf>,
    /// Where to write the logits: little-endian f32, `positions × vocab`.
    #[arg(long)]
    out: PathBuf,
    /// Most tokens in one forward pass; longer prompts run in several chunks.
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Add the element types (in the model file, as loaded, as computed) to the JSON line.
    #[arg(long)]
    dtype_note: bool,
}

/// Token ids from `--tokens-file`: a JSON array, or ids separated by commas or white space.
fn read_tokens_file(path: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let text = text.trim();
    if text.starts_with('[') {
        return serde_json::from_str(text)
            .with_context(|| format!("{}: expected a JSON array of token ids", path.display()));
    }
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().with_context(|| format!("{}: {s:?} is not a token id", path.display())))
        .collect()
}

/// Runs `tokens` through `backend` from position 0, in chunks of at most its max batch tokens
/// over one sequence of the whole pool, and returns the logits of every position
/// (`tokens.len() × vocab`) and the number of passes.
fn all_logits(backend: &mut dyn Backend, tokens: &[u32]) -> Result<(Vec<f32>, usize)> {
    let vocab = backend.config().vocab_size;
    let layout = backend.kv_layout();
    let step = backend.max_batch_tokens().max(1);
    let mut alloc = BlockAllocator::try_new(layout.num_blocks, layout.block_size)?;
    let table = alloc.add_sequence(1, tokens.len())?.to_vec();
    let mut out = Vec::with_capacity(tokens.len() * vocab);
    let mut passes = 0;
    for (i, chunk) in tokens.chunks(step).enumerate() {
        let c = SeqChunk {
            tokens: chunk,
            start_pos: i * step,
            block_table: &table,
            logits: LogitsRequest::All,
            write: WriteMode::Direct,
            adapter: None,
        };
        let got = backend.forward(&[c])?;
        match got.as_slice() {
            [rows] if rows.len() == chunk.len() * vocab => out.extend_from_slice(rows),
            _ => bail!(
                "the backend returned {} logits in {} rows for a chunk of {} tokens (vocab {vocab})",
                got.iter().map(Vec::len).sum::<usize>(),
                got.len(),
                chunk.len()
            ),
        }
        passes += 1;
    }
    alloc.free_sequence(1)?;
    Ok((out, passes))
}

pub(crate) fn run(a: LogitsArgs) -> Result<()> {
    let tokens = match &a.tokens_file {
        Some(f) => read_tokens_file(f)?,
        None => a.tokens.clone(),
    };
    if tokens.is_empty() {
        bail!("the prompt has no tokens (pass --tokens or --tokens-file)");
    }
    if a.backend.block_size == 0 || a.max_batch_tokens == 0 {
        bail!("--block-size and --max-batch-tokens must be positive");
    }
    let opts = a.backend.options(tokens.len().div_ceil(a.backend.block_size), a.max_batch_tokens);
    let (path, info, mut backend) = a.backend.open(opts)?;
    let vocab = backend.config().vocab_size;
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {t} is outside the vocabulary of {} ({vocab} tokens)", path.display());
    }
    let (logits, passes) = all_logits(backend.as_mut(), &tokens)?;
    let non_finite = logits.iter().filter(|x| !x.is_finite()).count();

    let file = std::fs::File::create(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut w = std::io::BufWriter::new(file);
    for x in &logits {
        w.write_all(&x.to_le_bytes())?;
    }
    w.flush().with_context(|| format!("writing {}", a.out.display()))?;

    let mut line = serde_json::json!({
        "model": path.display().to_string(),
        "device": backend.device().to_string(),
        "positions": tokens.len(),
        "vocab": vocab,
        "passes": passes,
        "out": a.out.display().to_string(),
        "non_finite": non_finite,
        "argmax": logits.chunks(vocab).map(argmax).collect::<Vec<_>>(),
    });
    if a.dtype_note {
        line["dtype"] = serde_json::json!({
            "file": info.file_dtype,
            "loaded": info.dtypes,
            "compute": a.backend.compute_dtype(),
            "activations": a.backend.activations.to_string(),
            "logits": "f32",
        });
    }
    println!("{line}");
    if non_finite > 0 {
        bail!("{non_finite} logits are not finite (written to {} all the same)", a.out.display());
    }
    Ok(())
}
