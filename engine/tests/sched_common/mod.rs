//! What the scheduler-level tests (speculation, prefix cache, disaggregation) share: fixture
//! paths and engines, greedy parameters, and loops that run sequences while checking the KV
//! invariants after every step.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::KvDtype;
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::tokenizer::Tokenizer;

/// The [`tandem_engine::backend::Backend`] methods a test backend wrapping another in its field
/// `inner` passes straight through, except `forward` (each wrapper writes its own, to count or
/// fail passes) and the adapter methods (left at their defaults unless the wrapper writes them).
/// Expands inside `impl Backend for ...`.
#[macro_export]
macro_rules! delegate_backend {
    () => {
        fn device(&self) -> tandem_engine::Device {
            self.inner.device()
        }
        fn config(&self) -> &tandem_engine::config::ModelConfig {
            self.inner.config()
        }
        fn kv_layout(&self) -> tandem_engine::kv::KvLayout {
            self.inner.kv_layout()
        }
        fn max_batch_tokens(&self) -> usize {
            self.inner.max_batch_tokens()
        }
        fn commit_staged(&mut self, accepted: &[usize]) -> tandem_engine::Result<()> {
            self.inner.commit_staged(accepted)
        }
        fn discard_staged(&mut self) {
            self.inner.discard_staged()
        }
        fn staged_pending(&self) -> bool {
            self.inner.staged_pending()
        }
        fn copy_block(
            &mut self,
            src: tandem_engine::kv::BlockId,
            dst: tandem_engine::kv::BlockId,
        ) -> tandem_engine::Result<()> {
            self.inner.copy_block(src, dst)
        }
        fn read_block(
            &self,
            layer: usize,
            block: tandem_engine::kv::BlockId,
        ) -> tandem_engine::Result<(Vec<u8>, Vec<u8>)> {
            self.inner.read_block(layer, block)
        }
        fn write_block(
            &mut self,
            layer: usize,
            block: tandem_engine::kv::BlockId,
            k: &[u8],
            v: &[u8],
        ) -> tandem_engine::Result<()> {
            self.inner.write_block(layer, block, k, v)
        }
    };
}

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name)
}

/// A tiny fixture model, its KV pool and its scheduler limits.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub model: &'static str,
    pub blocks: usize,
    pub block_size: usize,
    pub budget: usize,
    pub max_num_seqs: usize,
}

/// A plain engine (no speculation, no prefix cache) on one CPU thread for `s`, with the CPU's
/// default KV dtype.
pub fn fixture_engine(s: &Setup) -> Engine {
    fixture_engine_with(s, None)
}

/// Like [`fixture_engine`], with the KV pool in `kv_dtype` (`None`: the CPU's default).
pub fn fixture_engine_with(s: &Setup, kv_dtype: Option<KvDtype>) -> Engine {
    let (be, tokenizer) = fixture_backend(s, kv_dtype);
    Engine::new(
        Box::new(be),
        tokenizer,
        SchedulerOptions { max_batch_tokens: s.budget, max_num_seqs: s.max_num_seqs },
    )
}

/// The CPU backend (one thread) and tokenizer of `s`'s fixture model, its pool and batch limit
/// from `s`, the KV pool in `kv_dtype` (`None`: the CPU's default).
pub fn fixture_backend(s: &Setup, kv_dtype: Option<KvDtype>) -> (CpuBackend, Tokenizer) {
    // As workers run: window layers give back what no later query reaches.
    fixture_backend_with(s, kv_dtype, true)
}

/// [`fixture_backend`], with window layers giving back old KV (`windowed`) or keeping it all.
pub fn fixture_backend_with(s: &Setup, kv_dtype: Option<KvDtype>, windowed: bool) -> (CpuBackend, Tokenizer) {
    let m = load_model(&fixture(s.model)).expect("fixture model loads");
    let opts = BackendOptions {
        num_blocks: s.blocks,
        block_size: s.block_size,
        max_batch_tokens: s.budget,
        threads: 1,
        kv_dtype,
        windowed_kv: windowed,
        ..Default::default()
    };
    (CpuBackend::new(m.config, m.weights, opts).expect("backend"), m.tokenizer)
}

/// Steps `e` until nothing runs; returns every event. Fails on a stall, a failed sequence or a
/// broken KV invariant.
pub fn drain(e: &mut Engine) -> Vec<SeqEvent> {
    let mut all = Vec::new();
    let mut steps = 0;
    while e.has_work() {
        steps += 1;
        assert!(steps < 5_000, "no progress");
        let ev = e.step().expect("step");
        assert!(!e.stalled(), "engine stalled with free blocks");
        e.check_kv().expect("allocator invariants mid-run");
        for x in &ev {
            if let SeqEvent::Failed { error, .. } = x {
                panic!("sequence failed: {error}");
            }
        }
        all.extend(ev);
    }
    all
}

/// Greedy, `n` tokens, EOS ignored (so every run has the same length).
pub fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_tokens: n, ignore_eos: true, ..SamplingParams::greedy() }
}

/// Runs every prompt concurrently; returns each one's tokens and the engine's proposed/accepted
/// counts. Checks the allocator and that nothing is staged after every step, and that no block is
/// held at the end (a prefix cache may keep evictable ones).
pub fn run(eng: &mut Engine, prompts: &[Vec<u32>], params: &[SamplingParams]) -> (Vec<Vec<u32>>, (u64, u64)) {
    let ids: Vec<_> =
        prompts.iter().zip(params).map(|(p, sp)| eng.add_request(p.clone(), sp.clone()).unwrap()).collect();
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut steps = 0;
    while eng.num_active() > 0 {
        steps += 1;
        assert!(steps < 20_000, "no progress: {} sequences still active", eng.num_active());
        for ev in eng.step().unwrap() {
            match ev {
                SeqEvent::Token { seq, token, .. } => out.entry(seq).or_default().push(token),
                SeqEvent::Failed { error, .. } => panic!("{error}"),
                SeqEvent::Finished { .. } | SeqEvent::Prefilled { .. } | SeqEvent::PromptLogprobs { .. } => {}
            }
        }
        eng.check_kv().unwrap();
        assert!(!eng.backend().staged_pending(), "staged data outlived a step");
    }
    let s = eng.kv_stats();
    assert_eq!(
        (s.used, s.free + s.cached),
        (0, s.total),
        "blocks left allocated (cached ones are free to evict)"
    );
    let st = eng.spec_stats();
    (ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect(), (st.proposed, st.accepted))
}

/// Copies `src` (blocks of `p`) into `dst` (blocks reservation `res` of `d` fills), every storage
/// layer of the pool, moving the reservation through Filling to Filled as a transport's gate
/// does.
pub fn copy_blocks(
    p: &Engine,
    src: &[u32],
    d: &mut Engine,
    res: tandem_engine::scheduler::ReservationId,
    dst: &[u32],
) {
    use tandem_engine::kv::reservation::Completion;
    assert_eq!(src.len(), dst.len());
    assert_eq!(d.reservations().lock().begin(res).expect("a transfer begins"), dst);
    for layer in 0..p.backend().kv_layout().num_layers {
        for (&s, &t) in src.iter().zip(dst) {
            let (k, v) = p.backend().read_block(layer, s).expect("read block");
            d.write_reserved_block(res, layer, t, &k, &v).expect("write block");
        }
    }
    assert_eq!(d.reservations().lock().complete(res, std::time::Instant::now()), Completion::Filled);
}
