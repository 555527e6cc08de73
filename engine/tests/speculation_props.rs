//! The scheduler's speculative life cycle against a scripted backend, as a property test:
//! plan → staged verification → commit or discard → truncate, with random acceptance, random
//! cancellations, failing passes and failing commits, chunked prefill and preemption. After every
//! step: the allocator's invariants hold (free + owned == total, no orphan, no overlap), nothing
//! is staged, and every layer of the pool holds exactly the sequence's own tokens at every
//! position it has computed (so no rejected draft, no missing layer). At the end every block is
//! free and the drafter has forgotten every sequence. Without failures, the output equals the
//! output without speculation.
//!
//! The scripted backend writes `(token, position)` into each layer's slot instead of K/V, and its
//! logits make the greedy next token a hash of the current token and position, so what the
//! engine must produce is known without a model.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use tandem_engine::backend::{Backend, LogitsRequest, SeqChunk};
use tandem_engine::config::ModelConfig;
use tandem_engine::error::{EngineError, Result};
use tandem_engine::kv::{BlockId, KvDtype, KvError, KvLayout, SeqId, WriteMode};
use tandem_engine::loader::load_model_info;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::spec::{DraftAsk, Drafter, SpecMethod, SpecOptions};
use tandem_engine::tokenizer::Tokenizer;
use tandem_engine::Device;

/// Tokens the script's greedy choice ranges over (drafts draw from the same few, so acceptance is
/// neither rare nor certain).
const CHOICES: u32 = 3;

fn next_token(token: u32, pos: usize) -> u32 {
    let h = (token as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (pos as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    10 + ((h >> 29) % CHOICES as u64) as u32
}

type Slot = Option<(u32, usize)>;
/// One chunk of a staged pass: `(slot, token, position)` per token, and whether it was direct.
type StagedChunk = (Vec<(usize, u32, usize)>, bool);

#[derive(Default)]
struct Shared {
    /// `[layer][slot]`: the token and position last written there.
    pool: Vec<Vec<Slot>>,
    /// Failure injection: fail the n-th forward / commit call (counting from 1) when set.
    fail_forward: BTreeSet<u64>,
    fail_commit: BTreeSet<u64>,
    forwards: u64,
    commits: u64,
}

struct Script {
    config: ModelConfig,
    layout: KvLayout,
    shared: Arc<Mutex<Shared>>,
    /// The chunks of the pending staged pass.
    staged: Option<Vec<StagedChunk>>,
}

impl Backend for Script {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn kv_layout(&self) -> KvLayout {
        self.layout
    }
    fn max_batch_tokens(&self) -> usize {
        1 << 20
    }
    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>> {
        if self.staged.is_some() {
            return Err(KvError::StagedPending.into());
        }
        let mut sh = self.shared.lock().unwrap();
        sh.forwards += 1;
        let n = sh.forwards;
        if sh.fail_forward.contains(&n) {
            return Err(EngineError::Internal(format!("scripted failure of pass {n}")));
        }
        let bs = self.layout.block_size;
        let vocab = self.config.vocab_size;
        let mut out = Vec::new();
        let mut staged = Vec::new();
        let mut any_staged = false;
        for c in batch {
            let slots: Vec<(usize, u32, usize)> = c
                .tokens
                .iter()
                .enumerate()
                .map(|(j, &t)| {
                    let p = c.start_pos + j;
                    (c.block_table[p / bs] as usize * bs + p % bs, t, p)
                })
                .collect();
            if c.write == WriteMode::Direct {
                for &(slot, t, p) in &slots {
                    for layer in sh.pool.iter_mut() {
                        layer[slot] = Some((t, p));
                    }
                }
            } else {
                any_staged = true;
            }
            staged.push((slots, c.write == WriteMode::Direct));
            let rows: Vec<usize> = match c.logits {
                LogitsRequest::None => vec![],
                LogitsRequest::Last => vec![c.tokens.len() - 1],
                LogitsRequest::All => (0..c.tokens.len()).collect(),
            };
            let mut logits = vec![0f32; rows.len() * vocab];
            for (r, &j) in rows.iter().enumerate() {
                logits[r * vocab + next_token(c.tokens[j], c.start_pos + j) as usize] = 5.0;
            }
            out.push(logits);
        }
        if any_staged {
            self.staged = Some(staged);
        }
        Ok(out)
    }
    fn commit_staged(&mut self, accepted: &[usize]) -> Result<()> {
        let Some(staged) = self.staged.as_ref() else {
            return Err(KvError::NothingStaged("no staged pass").into());
        };
        let mut sh = self.shared.lock().unwrap();
        sh.commits += 1;
        let n = sh.commits;
        if sh.fail_commit.contains(&n) {
            return Err(EngineError::Internal(format!("scripted failure of commit {n}")));
        }
        assert_eq!(accepted.len(), staged.len(), "one accepted length per chunk");
        for ((slots, direct), &a) in staged.iter().zip(accepted) {
            assert!(a <= slots.len(), "accepted {a} of {}", slots.len());
            if *direct {
                assert_eq!(a, slots.len(), "a direct chunk is accepted whole");
                continue;
            }
            for &(slot, t, p) in &slots[..a] {
                for layer in sh.pool.iter_mut() {
                    layer[slot] = Some((t, p));
                }
            }
        }
        drop(sh);
        self.staged = None;
        Ok(())
    }
    fn discard_staged(&mut self) {
        self.staged = None;
    }
    fn staged_pending(&self) -> bool {
        self.staged.is_some()
    }
    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<()> {
        let bs = self.layout.block_size;
        let mut sh = self.shared.lock().unwrap();
        for layer in sh.pool.iter_mut() {
            for o in 0..bs {
                layer[dst as usize * bs + o] = layer[src as usize * bs + o];
            }
        }
        Ok(())
    }
    fn read_block(&self, _layer: usize, _block: BlockId) -> Result<(Vec<u8>, Vec<u8>)> {
        Err(EngineError::Internal("not scripted".into()))
    }
    fn write_block(&mut self, _layer: usize, _block: BlockId, _k: &[u8], _v: &[u8]) -> Result<()> {
        Err(EngineError::Internal("not scripted".into()))
    }
}

/// Proposes the script's true continuation for a while, then a wrong token, as `accuracy` says.
struct ScriptDrafter {
    accuracy: u32,
    calls: u64,
    asked: Arc<Mutex<BTreeSet<SeqId>>>,
    forgotten: Arc<Mutex<BTreeSet<SeqId>>>,
}

impl Drafter for ScriptDrafter {
    fn method(&self) -> SpecMethod {
        SpecMethod::Ngram
    }
    fn describe(&self) -> String {
        "scripted".into()
    }
    fn propose(&mut self, asks: &[DraftAsk<'_>]) -> Result<Vec<Vec<u32>>> {
        self.calls += 1;
        Ok(asks
            .iter()
            .map(|a| {
                self.asked.lock().unwrap().insert(a.seq);
                let mut t = *a.tokens.last().unwrap();
                let mut pos = a.tokens.len() - 1;
                (0..a.max)
                    .map(|i| {
                        let right = next_token(t, pos);
                        let roll = (self.calls * 31 + a.seq * 17 + i as u64 * 7) % 100;
                        t = if roll < self.accuracy as u64 { right } else { 10 + (right - 10 + 1) % CHOICES };
                        pos += 1;
                        t
                    })
                    .collect()
            })
            .collect())
    }
    fn forget(&mut self, seq: SeqId) {
        self.forgotten.lock().unwrap().insert(seq);
    }
}

fn info() -> (ModelConfig, Tokenizer) {
    let m =
        load_model_info(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa"))
            .unwrap();
    (m.config, m.tokenizer)
}

#[derive(Debug, Clone)]
struct Case {
    prompts: Vec<(usize, usize)>,
    blocks: usize,
    block_size: usize,
    budget: usize,
    k: usize,
    adaptive: bool,
    accuracy: u32,
    cancels: Vec<(usize, usize)>,
    fail_forward: Vec<u64>,
    fail_commit: Vec<u64>,
}

fn cases() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec((1usize..20, 2usize..30), 1..8),
        6usize..40,
        1usize..6,
        1usize..24,
        1usize..9,
        any::<bool>(),
        0u32..101,
        prop::collection::vec((0usize..60, 0usize..8), 0..4),
        prop::collection::vec(1u64..80, 0..3),
        prop::collection::vec(1u64..40, 0..3),
    )
        .prop_map(
            |(
                prompts,
                blocks,
                block_size,
                budget,
                k,
                adaptive,
                accuracy,
                cancels,
                fail_forward,
                fail_commit,
            )| {
                Case {
                    prompts,
                    blocks,
                    block_size,
                    budget,
                    k,
                    adaptive,
                    accuracy,
                    cancels,
                    fail_forward,
                    fail_commit,
                }
            },
        )
}

struct Run {
    outputs: BTreeMap<SeqId, Vec<u32>>,
    failed: BTreeSet<SeqId>,
    cancelled: BTreeSet<SeqId>,
}

fn run(c: &Case, speculate: bool) -> std::result::Result<Run, TestCaseError> {
    let (config, tokenizer) = info();
    let layout = KvLayout {
        num_layers: config.num_layers,
        num_blocks: c.blocks,
        block_size: c.block_size,
        num_kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        dtype: KvDtype::F32,
    };
    let shared = Arc::new(Mutex::new(Shared {
        pool: vec![vec![None; layout.num_slots()]; layout.num_layers],
        fail_forward: c.fail_forward.iter().copied().collect(),
        fail_commit: c.fail_commit.iter().copied().collect(),
        ..Default::default()
    }));
    let be = Script { config, layout, shared: shared.clone(), staged: None };
    let mut eng = Engine::new(
        Box::new(be),
        tokenizer,
        SchedulerOptions { max_batch_tokens: c.budget, max_num_seqs: 16 },
    );
    let asked = Arc::new(Mutex::new(BTreeSet::new()));
    let forgotten = Arc::new(Mutex::new(BTreeSet::new()));
    if speculate {
        let d = ScriptDrafter {
            accuracy: c.accuracy,
            calls: 0,
            asked: asked.clone(),
            forgotten: forgotten.clone(),
        };
        let opts = SpecOptions { max_draft: c.k, adaptive: c.adaptive, ..Default::default() };
        eng = eng.with_speculation(Box::new(d), opts).unwrap();
    }
    let max_len = eng.max_sequence_len();
    let mut tokens: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut prompt_len: HashMap<SeqId, usize> = HashMap::new();
    let mut ids = Vec::new();
    for (i, &(plen, gen)) in c.prompts.iter().enumerate() {
        // Prompts that fit the pool with room to generate.
        let plen = plen.min(max_len.saturating_sub(2)).max(1);
        let prompt: Vec<u32> = (0..plen).map(|j| 20 + ((i * 13 + j * 5) % 300) as u32).collect();
        let params = SamplingParams { max_tokens: gen, ignore_eos: true, ..SamplingParams::greedy() };
        let id = eng.add_request(prompt.clone(), params).unwrap();
        prompt_len.insert(id, prompt.len());
        tokens.insert(id, prompt);
        ids.push(id);
    }
    let mut out = Run { outputs: BTreeMap::new(), failed: BTreeSet::new(), cancelled: BTreeSet::new() };
    let mut step = 0usize;
    while eng.num_active() > 0 {
        step += 1;
        prop_assert!(step < 5_000, "no progress");
        for &(at, which) in &c.cancels {
            if at == step && speculate {
                let id = ids[which % ids.len()];
                if eng.generated_len(id).is_some() {
                    eng.cancel(id).unwrap();
                    out.cancelled.insert(id);
                }
            }
        }
        for ev in eng.step().unwrap() {
            match ev {
                SeqEvent::Token { seq, token, .. } => tokens.get_mut(&seq).unwrap().push(token),
                SeqEvent::Failed { seq, .. } => {
                    out.failed.insert(seq);
                }
                SeqEvent::Finished { .. } | SeqEvent::Prefilled { .. } | SeqEvent::PromptLogprobs { .. } => {}
            }
        }
        eng.check_kv().map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(!eng.backend().staged_pending(), "staged data outlived step {}", step);
        // Every computed position of every live sequence holds its own token in every layer.
        let sh = shared.lock().unwrap();
        for &id in &ids {
            let (Some(computed), Some(table)) = (eng.computed_len(id), eng.block_table(id)) else { continue };
            let t = &tokens[&id];
            if t.len() > prompt_len[&id] {
                // Never blocks past the tokens the sequence has: a rejected draft's blocks went back.
                prop_assert!(
                    table.len() <= t.len().div_ceil(c.block_size),
                    "seq {} step {} speculate {}",
                    id,
                    step,
                    speculate
                );
            }
            for p in 0..computed {
                let slot = table[p / c.block_size] as usize * c.block_size + p % c.block_size;
                for (l, layer) in sh.pool.iter().enumerate() {
                    prop_assert_eq!(
                        layer[slot],
                        Some((t[p], p)),
                        "seq {} pos {} layer {} step {}",
                        id,
                        p,
                        l,
                        step
                    );
                }
            }
        }
    }
    let s = eng.kv_stats();
    prop_assert_eq!(s.free, s.total, "blocks left allocated");
    if speculate {
        let asked = asked.lock().unwrap();
        let forgotten = forgotten.lock().unwrap();
        prop_assert!(asked.is_subset(&forgotten), "asked {:?}, forgotten {:?}", asked, forgotten);
    }
    for id in ids {
        let p = tokens.remove(&id).unwrap();
        out.outputs.insert(id, p);
    }
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn speculative_steps_keep_every_invariant(c in cases()) {
        let plain = run(&Case { fail_forward: vec![], fail_commit: vec![], cancels: vec![], ..c.clone() }, false)?;
        let spec = run(&c, true)?;
        // Sequences the speculative run did not cancel or fail produced exactly the plain tokens.
        for (id, toks) in &spec.outputs {
            if spec.failed.contains(id) || spec.cancelled.contains(id) {
                continue;
            }
            prop_assert_eq!(toks, &plain.outputs[id], "sequence {}", id);
        }
    }
}
