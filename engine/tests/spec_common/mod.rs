//! What the speculative decoding tests share: fixture paths, greedy parameters, and a loop that
//! runs prompts concurrently while checking the KV invariants after every step.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SeqEvent};

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name)
}

/// Greedy, `n` tokens, EOS ignored (so every run has the same length).
pub fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_tokens: n, ignore_eos: true, ..SamplingParams::greedy() }
}

/// Runs every prompt concurrently; returns each one's tokens and the engine's proposed/accepted
/// counts. Checks the allocator and that nothing is staged after every step, and that every block is free
/// at the end.
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
                SeqEvent::Finished { .. } | SeqEvent::Prefilled { .. } => {}
            }
        }
        eng.check_kv().unwrap();
        assert!(!eng.backend().staged_pending(), "staged data outlived a step");
    }
    let s = eng.kv_stats();
    assert_eq!(s.free, s.total, "blocks left allocated");
    let st = eng.spec_stats();
    (ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect(), (st.proposed, st.accepted))
}
