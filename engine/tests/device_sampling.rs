//! The scheduler's device-sampling path (`Backend::forward_sampled`) against its host path, on a
//! tiny fixture model: a backend that "samples on its device" by the device contract's host
//! reference (`RowSampling::draw_on_host`), and leaves every third row to the host, gives every
//! request the tokens, log-probabilities and alternatives the plain CPU backend gives, for seeded
//! sampling with every filter, repetition penalties, alternatives and constraints. So the
//! parameters the scheduler hands a device (the sampler's peeked draw, the penalty's ids, the
//! constraint's mask) are the host sampler's, and a device's draw advances the sampler's stream
//! exactly as a host draw would; also with n-gram speculation and a prompt being scored, whose
//! rows come back in the same steps as device draws.

#[macro_use]
mod sched_common;
use sched_common::{fixture_backend, Setup};

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tandem_engine::backend::{Backend, DevicePick, SeqChunk};
use tandem_engine::cpu::CpuBackend;
use tandem_engine::sampler::{RowSampling, SamplingParams};
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::spec::ngram::NgramDrafter;
use tandem_engine::spec::SpecOptions;
use tandem_model::grammar::Constraint;

const SETUP: Setup = Setup { model: "llama-gqa", blocks: 256, block_size: 4, budget: 64, max_num_seqs: 16 };

/// The CPU backend, sampling "on its device" with the host reference of the device contract.
struct DeviceLike {
    inner: CpuBackend,
    /// Rows drawn by the reference and rows handed back, over the run.
    counts: Arc<(AtomicUsize, AtomicUsize)>,
}

impl Backend for DeviceLike {
    delegate_backend!();

    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> tandem_engine::Result<Vec<Vec<f32>>> {
        self.inner.forward(batch)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn forward_sampled(
        &mut self,
        batch: &[SeqChunk<'_>],
        rows: &mut dyn FnMut() -> Vec<Option<RowSampling>>,
    ) -> tandem_engine::Result<Vec<DevicePick>> {
        let logits = self.inner.forward(batch)?;
        let specs = rows();
        assert_eq!(specs.len(), batch.len(), "one sampling per chunk");
        let mut out = Vec::new();
        for (i, (mut row, spec)) in logits.into_iter().zip(specs).enumerate() {
            match spec {
                Some(spec) if i % 3 != 2 => {
                    assert_eq!(
                        row.len(),
                        self.inner.config().vocab_size,
                        "a sampling for a chunk without one last row"
                    );
                    let (sampled, drew) = spec.draw_on_host(&mut row);
                    self.counts.0.fetch_add(1, Ordering::Relaxed);
                    out.push(DevicePick::Sampled { sampled, drew });
                }
                _ => {
                    self.counts.1.fetch_add(usize::from(!row.is_empty()), Ordering::Relaxed);
                    out.push(DevicePick::Row(row));
                }
            }
        }
        Ok(out)
    }
}

type Emitted = Vec<(u32, f32, Vec<(u32, f32)>)>;

fn run(
    backend: Box<dyn Backend>,
    tok: tandem_engine::tokenizer::Tokenizer,
    reqs: &[(Vec<u32>, SamplingParams)],
    speculate: bool,
) -> (Vec<Emitted>, Engine) {
    let mut eng = Engine::new(
        backend,
        tok,
        SchedulerOptions { max_batch_tokens: SETUP.budget, max_num_seqs: SETUP.max_num_seqs },
    );
    if speculate {
        // n-gram drafts: verification passes share steps with device-sampled decode rows.
        let o =
            SpecOptions { max_draft: 3, adaptive: false, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
        eng = eng.with_speculation(Box::new(NgramDrafter::new(o.ngram_min, o.ngram_max)), o).unwrap();
    }
    let ids: Vec<u64> = reqs.iter().map(|(p, sp)| eng.add_request(p.clone(), sp.clone()).unwrap()).collect();
    let mut out: HashMap<u64, Emitted> = HashMap::new();
    let mut steps = 0;
    while eng.num_active() > 0 {
        steps += 1;
        assert!(steps < 5_000, "no progress");
        for ev in eng.step().unwrap() {
            match ev {
                SeqEvent::Token { seq, token, logprob, top_logprobs } => {
                    out.entry(seq).or_default().push((token, logprob, top_logprobs))
                }
                SeqEvent::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
        eng.check_kv().unwrap();
    }
    (ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect(), eng)
}

const SCHEMA: &str = r#"{"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 4}}, "required": ["n", "s"], "additionalProperties": false}"#;

#[test]
fn device_sampled_requests_emit_what_host_sampled_ones_do() {
    let base = SamplingParams { max_tokens: 24, ignore_eos: true, ..SamplingParams::greedy() };
    let sampled = |t: f32, seed: u64| SamplingParams { temperature: t, seed: Some(seed), ..base.clone() };
    let params = vec![
        sampled(1.0, 1),
        SamplingParams { top_k: 5, ..sampled(0.8, 2) },
        SamplingParams { top_p: 0.7, ..sampled(1.2, 3) },
        SamplingParams { min_p: 0.1, ..sampled(1.0, 4) },
        SamplingParams { top_k: 40, top_p: 0.9, min_p: 0.02, ..sampled(0.7, 5) },
        SamplingParams { repetition_penalty: 1.4, ..sampled(1.0, 6) },
        SamplingParams { repetition_penalty: 1.3, logprobs: Some(3), ..base.clone() },
        SamplingParams { logprobs: Some(5), top_k: 8, ..sampled(1.0, 7) },
        // Its prompt is scored: every row of its prompt chunks comes back beside device draws.
        SamplingParams { prompt_logprobs: Some(2), top_p: 0.8, ..sampled(0.9, 10) },
        SamplingParams {
            constraint: Some(Constraint::JsonSchema(SCHEMA.into())),
            ignore_eos: false,
            max_tokens: 40,
            ..sampled(1.0, 8)
        },
        SamplingParams {
            constraint: Some(Constraint::JsonSchema(SCHEMA.into())),
            ignore_eos: false,
            max_tokens: 40,
            logprobs: Some(2),
            ..sampled(0.6, 9)
        },
    ];
    // Each parameter set twice: alone in its step and among the others.
    let reqs: Vec<(Vec<u32>, SamplingParams)> = params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            ((0..4 + i as u32 * 2).map(|j| 3 + (i as u32 * 37 + j * 11) % 300).collect(), p.clone())
        })
        .collect();
    for speculate in [false, true] {
        let (host_be, tok) = fixture_backend(&SETUP, None);
        let (host, _) = run(Box::new(host_be), tok.clone(), &reqs, speculate);
        let (inner, _) = fixture_backend(&SETUP, None);
        let counts = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let (device, eng) =
            run(Box::new(DeviceLike { inner, counts: counts.clone() }), tok, &reqs, speculate);
        for (i, (h, d)) in host.iter().zip(&device).enumerate() {
            assert!(!h.is_empty(), "request {i} emitted nothing");
            assert_eq!(
                h, d,
                "request {i} ({:?}), speculate {speculate}: device-sampled output differs",
                reqs[i].1
            );
        }
        // Both kinds of rows occurred: drawn by the "device" and handed back to the host.
        let (drawn, returned) = (counts.0.load(Ordering::Relaxed), counts.1.load(Ordering::Relaxed));
        assert!(drawn > 50 && returned > 20, "{drawn} rows drawn on the device, {returned} handed back");
        if speculate {
            assert!(eng.spec_stats().verifications > 0, "no verification pass ran");
        }
    }
}
