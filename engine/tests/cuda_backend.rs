//! What only the CUDA backend has: a clear error for a device that is not there, instances that
//! share nothing on one GPU, refused impossible settings, greedy picks on the device, and LoRA
//! adapters mixed in one batch giving the CPU backend's logits.
//!
//! The behaviour both backends share (logits and greedy tokens against transformers, staged
//! commit, KV block round trips) is checked by one test body per device in `reference_parity.rs`
//! and `backend_kv.rs` (`device_test!`, the `::cuda` instances).
//!
//! Every test but the first needs a GPU: without one it prints a `SKIPPED` line and passes,
//! unless `TANDEM_REQUIRE_GPU=1` (set by scripts/gpu-check.sh), which turns a skip into a failure.

use std::sync::{Arc, Barrier};

use tandem_engine::backend::{Activations, Backend, BackendOptions, ComputeDtype, LogitsRequest, SeqChunk};
use tandem_engine::config::ModelConfig;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::cuda::{self, CudaBackend};
use tandem_engine::factory::create_backend;
use tandem_engine::kv::{BlockAllocator, KvDtype, WriteMode};
use tandem_engine::loader::{load_model, LoadedModel};
use tandem_engine::lora::{LoraAdapter, LoraTarget, LoraWeight, Proj};
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::{Device, EngineError};

mod common;
use common::gpu;

#[path = "../../tests/reference/fixture_reader.rs"]
mod fixture_reader;
use fixture_reader::{fixture, read_reference, Prompt};

fn load(name: &str) -> LoadedModel {
    load_model(&fixture(name)).unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

fn opts(dtype: ComputeDtype, graphs: bool, max_batch_tokens: usize) -> BackendOptions {
    BackendOptions {
        num_blocks: 64,
        block_size: 8,
        max_batch_tokens,
        dtype,
        cuda_graphs: graphs,
        ..Default::default()
    }
}

fn cuda_backend(name: &str, dtype: ComputeDtype, graphs: bool, max_batch_tokens: usize) -> CudaBackend {
    let m = load(name);
    CudaBackend::new(0, m.config, m.weights, opts(dtype, graphs, max_batch_tokens))
        .unwrap_or_else(|e| panic!("{name}: creating the CUDA backend: {e}"))
}

/// Block tables for `prompts` from a fresh allocator of 64 blocks of 8, each with room for
/// `extra` tokens past its prompt.
fn prompt_tables<P: std::borrow::Borrow<Prompt>>(prompts: &[P], extra: usize) -> Vec<Vec<u32>> {
    let mut alloc = BlockAllocator::new(64, 8);
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            alloc.add_sequence(i as u64, p.borrow().ids.len() + extra).unwrap();
            alloc.block_table(i as u64).unwrap().to_vec()
        })
        .collect()
}

/// A chunk of `tokens` from `start_pos` over `table`, written directly, asking for its last row.
fn last_chunk<'a>(tokens: &'a [u32], start_pos: usize, table: &'a [u32]) -> SeqChunk<'a> {
    SeqChunk {
        tokens,
        start_pos,
        block_table: table,
        logits: LogitsRequest::Last,
        write: WriteMode::Direct,
        adapter: None,
    }
}

/// Every prompt whole, one chunk each ([`last_chunk`] from position 0).
fn prompt_chunks<'a>(prompts: &'a [Prompt], tables: &'a [Vec<u32>]) -> Vec<SeqChunk<'a>> {
    prompts.iter().zip(tables).map(|(p, t)| last_chunk(&p.ids, 0, t)).collect()
}

#[test]
fn cuda_device_that_is_not_there_is_a_clear_error() {
    let m = load("llama-gqa");
    let (device, expect) = if cuda::driver_present() && cuda::probe(0).is_ok() {
        (Device::Cuda(4096), "no such device")
    } else {
        (Device::Cuda(0), if cuda::driver_present() { "cuda" } else { "no NVIDIA driver" })
    };
    let err = match create_backend(device, m, BackendOptions::default()) {
        Ok(_) => panic!("{device} should not be usable here"),
        Err(e) => e,
    };
    assert!(matches!(err, EngineError::Device { .. }), "{device}: unexpected error kind: {err}");
    let msg = err.to_string();
    assert!(msg.contains(expect), "{device}: error does not say {expect:?}: {msg}");
    assert!(msg.contains(&device.to_string()), "error does not name the device: {msg}");
}

/// The CUDA kernels store KV in f32, bf16 or fp8: f16 is refused at start-up, naming the flag and
/// what the GPU takes, whether or not a GPU is present; unset, the GPU's default is bf16.
#[test]
fn an_f16_kv_cache_on_cuda_is_refused_naming_the_flag() {
    let opts = BackendOptions { kv_dtype: Some(KvDtype::F16), ..BackendOptions::default() };
    let err = match create_backend(Device::Cuda(0), load("llama-gqa"), opts) {
        Ok(_) => panic!("an f16 KV cache on CUDA was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("--kv-dtype f16") && err.contains("bf16") && err.contains("fp8"), "{err}");
    assert_eq!(BackendOptions::default().kv_dtype_on(Device::Cuda(0)), KvDtype::Bf16);
}

fn greedy_params(p: &Prompt) -> SamplingParams {
    SamplingParams { max_tokens: p.greedy.len(), ignore_eos: !p.stopped_at_eos, ..SamplingParams::greedy() }
}

/// Two CUDA instances on one GPU and a CPU instance generate from three threads in lock-step;
/// each must produce the reference tokens, and every allocation of a CUDA instance must report
/// that instance's device.
#[test]
fn device_audit_instances_share_nothing() {
    let Some(ordinal) = gpu("device_audit_instances_share_nothing") else { return };
    let name = "qwen3";
    let a = cuda_backend(name, ComputeDtype::F32, true, 512);
    let b = cuda_backend(name, ComputeDtype::F32, false, 64);
    for be in [&a, &b] {
        let allocs = be.allocation_devices().unwrap();
        assert!(allocs.len() > 10, "too few allocations listed: {allocs:?}");
        for (what, dev) in allocs {
            assert_eq!(dev, ordinal, "{what} lives on device {dev}, not the backend's {ordinal}");
        }
    }
    let m = load(name);
    let c = CpuBackend::new(m.config, m.weights, opts(ComputeDtype::F32, false, 512)).unwrap();
    let backends: Vec<Box<dyn Backend>> = vec![Box::new(a), Box::new(b), Box::new(c)];
    let barrier = Arc::new(Barrier::new(backends.len()));
    let threads: Vec<_> = backends
        .into_iter()
        .map(|be| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let (_, prompts) = read_reference(name);
                let tok = load(name).tokenizer;
                let mut eng =
                    Engine::new(be, tok, SchedulerOptions { max_batch_tokens: 64, max_num_seqs: 16 });
                let ids: Vec<_> = prompts
                    .iter()
                    .map(|p| eng.add_request(p.ids.clone(), greedy_params(p)).unwrap())
                    .collect();
                let mut got = vec![Vec::new(); prompts.len()];
                // Steps interleave across threads; each thread keeps stepping (possibly idle)
                // until every thread is done, so the barrier never waits for a finished thread.
                for _ in 0..400 {
                    barrier.wait();
                    for ev in eng.step().unwrap() {
                        if let SeqEvent::Token { seq, token, .. } = ev {
                            got[ids.iter().position(|&i| i == seq).unwrap()].push(token);
                        }
                    }
                }
                assert_eq!(eng.num_active(), 0, "not every sequence finished in 400 steps");
                let s = eng.kv_stats();
                assert_eq!(s.free, s.total, "KV blocks leaked");
                prompts.iter().zip(got).all(|(p, g)| p.greedy == g)
            })
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        assert!(t.join().unwrap(), "instance {i} generated tokens other than the reference");
    }
}

#[test]
fn impossible_settings_are_refused_with_the_reason() {
    let Some(ordinal) = gpu("impossible_settings_are_refused_with_the_reason") else { return };
    let m = load("llama-gqa");
    let shared = BackendOptions { kv_shared: true, ..opts(ComputeDtype::Bf16, true, 64) };
    let err =
        CudaBackend::new(ordinal, m.config.clone(), m.weights.clone(), shared).err().unwrap().to_string();
    assert!(err.contains("--transport tcp"), "{err}");
    let huge = BackendOptions { num_blocks: 1 << 26, block_size: 8, ..opts(ComputeDtype::Bf16, true, 64) };
    let err = CudaBackend::new(ordinal, m.config, m.weights, huge).err().unwrap().to_string();
    assert!(err.contains("--kv-blocks"), "{err}");
}

/// The device's greedy picks (tokens and log-probabilities) equal the host sampler's picks from
/// the same pass's logits, eagerly and through decode graphs.
#[test]
fn device_greedy_picks_match_host_picks() {
    let Some(_) = gpu("device_greedy_picks_match_host_picks") else { return };
    for graphs in [false, true] {
        let name = "llama-gqa";
        let (_, prompts) = read_reference(name);
        let mut be = cuda_backend(name, ComputeDtype::F32, graphs, 512);
        let tables = prompt_tables(&prompts, 1);
        let prefill = prompt_chunks(&prompts, &tables);
        let rows = be.forward(&prefill).unwrap();
        let picks = be.forward_greedy(&prefill).unwrap();
        let mut next = Vec::new();
        for (i, (mut row, pick)) in rows.into_iter().zip(picks).enumerate() {
            let want = tandem_engine::sampler::greedy_pick(&mut row);
            let (tok, lp) = pick.expect("a pick for a Last chunk");
            assert_eq!(tok, want.0, "graphs={graphs} prompt {i}: token");
            assert!((lp - want.1).abs() < 1e-4, "graphs={graphs} prompt {i}: logprob {lp} vs {}", want.1);
            next.push([tok]);
        }
        // One decode step of every sequence (graph-eligible), picked both ways.
        let step: Vec<SeqChunk<'_>> = prompts
            .iter()
            .zip(&tables)
            .zip(&next)
            .map(|((p, t), tok)| SeqChunk {
                tokens: tok,
                start_pos: p.ids.len(),
                block_table: t,
                logits: LogitsRequest::Last,
                write: WriteMode::Direct,
                adapter: None,
            })
            .collect();
        for _ in 0..2 {
            let rows = be.forward(&step).unwrap();
            let picks = be.forward_greedy(&step).unwrap();
            for (i, (mut row, pick)) in rows.into_iter().zip(picks).enumerate() {
                assert_eq!(pick.unwrap().0, tandem_engine::sampler::greedy_pick(&mut row).0, "decode {i}");
            }
        }
        let all = SeqChunk { logits: LogitsRequest::All, ..prefill[0] };
        assert!(be.forward_greedy(&[all]).is_err(), "All logits cannot be picked");
    }
}

/// The device's sampled tokens (`forward_sampled`) are those the host reference of the device
/// contract (`RowSampling::draw_on_host`) draws from the same pass's logits, with the same
/// log-probabilities and alternatives, for every filter, penalties and a constraint's mask; a
/// chunk asking for every position's row, placed before sampled ones, gets those rows back. The
/// GPU's `expf` may differ from the host's by an ulp or two, which moves a token only when the
/// draw lands that close to a boundary (odds far below one in a million per row).
#[test]
fn device_sampling_matches_the_host_reference() {
    use tandem_engine::backend::DevicePick;
    use tandem_engine::sampler::{RowSampling, Sampler};
    let Some(_) = gpu("device_sampling_matches_the_host_reference") else { return };
    let name = "llama-gqa";
    let (_, prompts) = read_reference(name);
    let mut be = cuda_backend(name, ComputeDtype::F32, true, 512);
    let vocab = be.config().vocab_size;
    let tables = prompt_tables(&prompts, 1);
    let mut batch = prompt_chunks(&prompts, &tables);
    // Prompt 1 asks for every position's row (as a verification does), ahead of sampled chunks.
    batch[1].logits = LogitsRequest::All;
    let base = SamplingParams { temperature: 1.0, ..SamplingParams::greedy() };
    let cases = [
        base.clone(),
        SamplingParams { top_k: 7, logprobs: Some(4), ..base.clone() },
        SamplingParams { top_p: 0.8, temperature: 0.7, ..base.clone() },
        SamplingParams { min_p: 0.05, repetition_penalty: 1.5, ..base.clone() },
        SamplingParams { top_k: 50, top_p: 0.9, min_p: 0.01, logprobs: Some(20), ..base.clone() },
        SamplingParams { temperature: 0.0, repetition_penalty: 0.7, logprobs: Some(2), ..base.clone() },
    ];
    let mut checked = 0;
    for (c, params) in cases.iter().enumerate() {
        for seed in 0..4u64 {
            let specs: Vec<Option<RowSampling>> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    if i == 1 {
                        return None; // this chunk's rows come back whole
                    }
                    let sp = SamplingParams { seed: Some(seed * 100 + i as u64), ..params.clone() };
                    let mut row = Sampler::new(&sp, 0).device_row(&p.ids, vocab);
                    if (seed + i as u64).is_multiple_of(2) {
                        // A constraint allowing every third id (and some past the row: never).
                        row.allowed = (0..vocab.div_ceil(32))
                            .map(|w| 0x4924_9249u32.rotate_left(w as u32 % 3))
                            .collect();
                        let tail = vocab % 32;
                        if tail != 0 {
                            *row.allowed.last_mut().unwrap() &= (1u32 << tail) - 1;
                        }
                    }
                    Some(row)
                })
                .collect();
            let rows = be.forward(&batch).unwrap();
            let picks = be.forward_sampled(&batch, &mut || specs.clone()).unwrap();
            for (i, ((row, pick), spec)) in rows.into_iter().zip(picks).zip(&specs).enumerate() {
                let what = format!("case {c} seed {seed} prompt {i}");
                match (pick, spec) {
                    (DevicePick::Row(got), None) => assert_eq!(got, row, "{what}: the row handed back"),
                    (DevicePick::Sampled { sampled, drew }, Some(spec)) => {
                        let (want, want_drew) = spec.draw_on_host(&mut row.clone());
                        assert_eq!(sampled.token, want.token, "{what}: token");
                        assert_eq!(drew, want_drew, "{what}: whether the draw was used");
                        assert!(
                            (sampled.logprob - want.logprob).abs() < 1e-4,
                            "{what}: logprob {} vs {}",
                            sampled.logprob,
                            want.logprob
                        );
                        assert_eq!(
                            sampled.top_logprobs.len(),
                            want.top_logprobs.len(),
                            "{what}: alternatives"
                        );
                        for (g, w) in sampled.top_logprobs.iter().zip(&want.top_logprobs) {
                            assert_eq!(g.0, w.0, "{what}: alternative");
                            assert!((g.1 - w.1).abs() < 1e-4, "{what}: alternative's logprob");
                        }
                        checked += 1;
                    }
                    (p, s) => panic!("{what}: {p:?} for sampling {s:?}"),
                }
            }
        }
    }
    assert!(checked >= 40, "only {checked} rows were drawn on the device");
}

/// Options of a chunked prefill: an f32 KV cache, computing in `dtype`, with tiled attention on
/// or off and, in bf16, on the tensor cores or the CUDA cores.
fn chunk_opts(dtype: ComputeDtype, tiled: bool, tensor_cores: bool) -> BackendOptions {
    BackendOptions {
        tiled_attention: tiled,
        tensor_core_attention: tensor_cores,
        kv_dtype: Some(KvDtype::F32),
        ..opts(dtype, false, 512)
    }
}

/// Logits of every position of a two-pass prefill under `options`: the fixture's longest prompt
/// split in two chunks (the second reading the first from the pool), next to another whole
/// prompt and a one-token chunk in the first pass. Returns, per prompt, its logits rows in order
/// and the reference's (transformers float32).
fn chunked_prefill_logits(device: Device, name: &str, options: BackendOptions) -> Vec<(Vec<f32>, Vec<f32>)> {
    let m = load(name);
    let (_, mut prompts) = read_reference(name);
    prompts.sort_by_key(|p| std::cmp::Reverse(p.ids.len()));
    let (a, b) = (&prompts[0], &prompts[1 % prompts.len()]);
    assert!(a.ids.len() >= 4, "{name}: the longest prompt has {} tokens", a.ids.len());
    let mut be = create_backend(device, m, options).unwrap_or_else(|e| panic!("{name} on {device}: {e}"));
    let mut alloc = BlockAllocator::new(64, 8);
    for (seq, len) in [(0u64, a.ids.len()), (1, b.ids.len()), (2, 1)] {
        alloc.add_sequence(seq, len).unwrap();
    }
    let tables: Vec<Vec<u32>> = (0..3).map(|s| alloc.block_table(s).unwrap().to_vec()).collect();
    let half = a.ids.len() / 2;
    let chunk = |tokens, start_pos, table, logits| SeqChunk {
        tokens,
        start_pos,
        block_table: table,
        logits,
        write: WriteMode::Direct,
        adapter: None,
    };
    let first = [
        chunk(&a.ids[..half], 0, &tables[0], LogitsRequest::All),
        chunk(&b.ids[..], 0, &tables[1], LogitsRequest::All),
        chunk(&b.ids[..1], 0, &tables[2], LogitsRequest::All),
    ];
    let out = be.forward(&first).unwrap();
    let second = be.forward(&[chunk(&a.ids[half..], half, &tables[0], LogitsRequest::All)]).unwrap();
    let vocab = b.logits.len() / b.ids.len();
    vec![
        ([out[0].clone(), second[0].clone()].concat(), a.logits.clone()),
        (out[1].clone(), b.logits.clone()),
        (out[2].clone(), b.logits[..vocab].to_vec()),
    ]
}

fn max_abs_diff(x: &[f32], y: &[f32]) -> f32 {
    assert_eq!(x.len(), y.len(), "logits shape");
    x.iter()
        .zip(y)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) })
}

const TILED_MODELS: [&str; 5] = ["llama-gqa", "qwen2-mqa", "mistral-sliding", "gemma2", "gemma3"];

/// The chunks `chunked_prefill_logits` runs give transformers' logits on the CPU: the test
/// below compares like with like.
#[test]
fn chunked_prefill_matches_the_reference_on_the_cpu() {
    for name in TILED_MODELS {
        for (i, (got, want)) in
            chunked_prefill_logits(Device::Cpu, name, chunk_opts(ComputeDtype::F32, true, true))
                .iter()
                .enumerate()
        {
            let worst = max_abs_diff(got, want);
            assert!(worst < 2e-3, "{name} prompt {i}: {worst} from the reference");
        }
    }
}

/// The tiled attention kernel (passes with prompt chunks) computes what the split-K kernel of
/// decode steps computes, and both match transformers, on models with GQA, MQA, a sliding window
/// and soft-capped scores, in f32. (head_dim 256 and more shapes: kernels/tests/emulated.rs.)
#[test]
fn tiled_attention_equals_split_k_attention() {
    let Some(_) = gpu("tiled_attention_equals_split_k_attention") else { return };
    for name in TILED_MODELS {
        let tiled = chunked_prefill_logits(Device::Cuda(0), name, chunk_opts(ComputeDtype::F32, true, true));
        let split = chunked_prefill_logits(Device::Cuda(0), name, chunk_opts(ComputeDtype::F32, false, true));
        for (i, ((t, want), (s, _))) in tiled.iter().zip(&split).enumerate() {
            let worst = max_abs_diff(t, s);
            assert!(worst < 1e-4, "{name} prompt {i}: tiled and split-K logits differ by {worst}");
            let off = max_abs_diff(t, want);
            assert!(off < 2e-3, "{name} prompt {i}: tiled attention is {off} from the reference");
        }
    }
}

/// In bf16, prompt attention on the tensor cores (bf16 q, K, V and weights) gives the logits the
/// CUDA-core tiled kernel gives, to bf16's precision, and both stay as near transformers as
/// bf16 parity asks (`scripts/gpu-check.sh`: 2e-2 of the largest logit), on the same models.
/// (The kernel's shapes, head_dim 256 and each pool dtype: kernels/tests/emulated.rs.)
#[test]
fn tensor_core_attention_matches_the_cuda_core_kernel_in_bf16() {
    let Some(_) = gpu("tensor_core_attention_matches_the_cuda_core_kernel_in_bf16") else { return };
    for name in TILED_MODELS {
        let tc = chunked_prefill_logits(Device::Cuda(0), name, chunk_opts(ComputeDtype::Bf16, true, true));
        let cc = chunked_prefill_logits(Device::Cuda(0), name, chunk_opts(ComputeDtype::Bf16, true, false));
        for (i, ((t, want), (c, _))) in tc.iter().zip(&cc).enumerate() {
            let top = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let between = max_abs_diff(t, c) / top;
            assert!(
                between < 2e-2,
                "{name} prompt {i}: the two kernels' logits differ by {between} of the largest"
            );
            let off = max_abs_diff(t, want) / top;
            assert!(off < 2e-2, "{name} prompt {i}: tensor-core attention is {off} of the largest logit off");
        }
    }
}

/// Decode steps (no graphs, so each step is encoded) of `name` in bf16 with the decode products of
/// our own on or off: every sequence's logits per step and the launches of the last step.
fn decode_steps(name: &str, decode_gemv: bool) -> (Vec<Vec<f32>>, u64) {
    let m = load(name);
    let (_, prompts) = read_reference(name);
    // The baseline is cuBLAS's products throughout, mixtures included.
    let options =
        BackendOptions { decode_gemv, moe_routed: decode_gemv, ..opts(ComputeDtype::Bf16, false, 512) };
    let mut be = create_backend(Device::Cuda(0), m, options).unwrap_or_else(|e| panic!("{name}: {e}"));
    let steps = 3;
    let tables = prompt_tables(&prompts, steps);
    let prefill = prompt_chunks(&prompts, &tables);
    be.forward(&prefill).unwrap();
    let mut rows = Vec::new();
    let mut launches = 0;
    for s in 0..steps {
        // Both runs feed the same tokens (the prompt's own, again), whatever their logits say.
        let step: Vec<SeqChunk<'_>> = prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| last_chunk(&p.ids[s % p.ids.len()..][..1], p.ids.len() + s, t))
            .collect();
        rows.extend(be.forward(&step).unwrap());
        launches = be.pass_launches().expect("the CUDA backend counts its launches").1;
    }
    (rows, launches)
}

/// The decode products of our own (a norm fused before them, a residual add or gated activation
/// after) give cuBLAS's decode logits to bf16's precision, on a dense Llama-shaped model, one with
/// q/k norms and biases-free Qwen3 heads, the two Gemma families (GeGLU, extra norms) and two
/// mixtures of experts (whose decode steps then run the routed experts only), and a decode step
/// launches at least 3 fewer kernels per layer with them.
#[test]
fn decode_products_match_cublas_in_bf16() {
    let Some(_) = gpu("decode_products_match_cublas_in_bf16") else { return };
    for name in ["llama-gqa", "qwen3", "gemma2", "gemma3", "qwen3-moe", "mixtral"] {
        let layers = load(name).config.num_layers as u64;
        let (ours, ours_launches) = decode_steps(name, true);
        let (cublas, cublas_launches) = decode_steps(name, false);
        for (i, (a, b)) in ours.iter().zip(&cublas).enumerate() {
            let top = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let off = max_abs_diff(a, b) / top;
            assert!(off < 2e-2, "{name} row {i}: the two decode paths differ by {off} of the largest logit");
        }
        assert!(
            ours_launches + 3 * layers <= cublas_launches,
            "{name}: {ours_launches} launches per step with the decode products, {cublas_launches} without"
        );
    }
}

/// A mixture of experts' prompt pass over routed tokens only (grouped products on the tensor
/// cores) gives the logits of every expert over every token (cuBLAS) to bf16's precision, on both
/// mixture fixtures, whose prompts together pass more tokens than the decode products take.
#[test]
fn routed_moe_prompts_match_every_expert_over_every_token() {
    let Some(_) = gpu("routed_moe_prompts_match_every_expert_over_every_token") else { return };
    for name in ["qwen3-moe", "mixtral"] {
        let (_, prompts) = read_reference(name);
        let run = |routed: bool| {
            let options = BackendOptions { moe_routed: routed, ..opts(ComputeDtype::Bf16, false, 512) };
            let mut be = create_backend(Device::Cuda(0), load(name), options)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let tables = prompt_tables(&prompts, 0);
            let batch = prompt_chunks(&prompts, &tables);
            let rows = be.forward(&batch).unwrap();
            (rows, be.pass_launches().expect("the CUDA backend counts its launches").1)
        };
        let total: usize = prompts.iter().map(|p| p.ids.len()).sum();
        assert!(total > 8, "{name}: the prompts pass only {total} tokens");
        let ((routed, routed_launches), (dense, dense_launches)) = (run(true), run(false));
        // The routed form ran: 4 launches per layer's mixture after routing, not 5 per expert.
        assert!(
            routed_launches < dense_launches,
            "{name}: {routed_launches} launches over routed tokens, {dense_launches} dense"
        );
        for (i, (a, b)) in routed.iter().zip(&dense).enumerate() {
            let top = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let off = max_abs_diff(a, b) / top;
            assert!(
                off < 2e-2,
                "{name} prompt {i}: routed and dense mixtures differ by {off} of the largest logit"
            );
        }
    }
}

/// A random adapter of rank `rank` over `projs` of every layer, large enough to change the logits
/// visibly (as `lora_scheduler.rs` makes them).
fn random_adapter(c: &ModelConfig, name: &str, seed: u64, rank: usize, projs: &[Proj]) -> Arc<LoraAdapter> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let mut weights = Vec::new();
    for layer in 0..c.num_layers {
        for &proj in projs {
            let (din, dout) = proj.dims(c);
            weights.push(LoraWeight {
                target: LoraTarget { layer: layer as u32, proj },
                rank,
                a: (0..rank * din).map(|_| 0.3 * next()).collect(),
                b: (0..dout * rank).map(|_| 0.3 * next()).collect(),
                scale: 2.0 / rank as f32,
            });
        }
    }
    Arc::new(LoraAdapter::new(name, std::path::Path::new(name), weights, c).expect("a valid adapter"))
}

/// CUDA logits (`dtype`) against the CPU's (f32) for the same pass: in f32 within 2e-3, in bf16
/// within 2e-2 relative (the bounds `reference_parity.rs` holds each device to against
/// transformers).
fn assert_lora_close(dtype: ComputeDtype, got: &[f32], want: &[f32], what: &str) {
    match dtype {
        ComputeDtype::F32 => {
            let e = max_abs_diff(got, want);
            assert!(e < 2e-3, "{what}: CUDA f32 logits differ from the CPU's by {e}");
        }
        ComputeDtype::Bf16 => {
            assert_eq!(got.len(), want.len(), "{what}: logits shape");
            let num: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
            let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
            let rel = (num / den.max(1e-30)).sqrt();
            assert!(rel < 2e-2, "{what}: CUDA bf16 logits are {rel} (relative) from the CPU's f32");
        }
    }
}

/// LoRA on `device` computes what the CPU backend computes with the same adapters in the same
/// slots: a mixed prefill (adapter 0, the base model, adapter 1; every position's logits), then
/// decode steps of all three (through graphs where on: a step with adapters, one without, one
/// with again, which replays the first's graph), then slot 0 swapped for an adapter of rank 64 on
/// other projections (on CUDA the intermediate grows and graphs with LoRA are captured again) and
/// two more steps with the slots in other places. In each of the device's dtypes, graphs on and
/// off. A chunk naming an emptied slot, or one past the slots, is refused. On the CPU this checks
/// the test's premises (the adapters move the logits, the base chunk does not).
fn lora_mixed_batches(device: Device) {
    let name = "llama-gqa";
    let (_, prompts) = read_reference(name);
    assert!(prompts.len() >= 2, "{name}: {} prompts", prompts.len());
    let ps: Vec<&Prompt> = (0..3).map(|i| &prompts[i % prompts.len()]).collect();
    let c = load(name).config;
    let a = random_adapter(&c, "a", 1, 4, &[Proj::Q, Proj::V, Proj::Down]);
    let b = random_adapter(&c, "b", 2, 16, &Proj::ALL);
    let swap = random_adapter(&c, "c", 3, 64, &[Proj::K, Proj::O, Proj::Gate, Proj::Up]);
    // An exact CPU: f32 activations and KV cache (its defaults quantize both).
    let with_slots = |o: BackendOptions| BackendOptions {
        max_adapters: 2,
        kv_dtype: Some(KvDtype::F32),
        activations: Activations::F32,
        ..o
    };
    for &dtype in common::dtypes(device) {
        for graphs in [false, true] {
            let what = format!("{device} {dtype} graphs={graphs}");
            let m = load(name);
            let mut cpu =
                CpuBackend::new(m.config, m.weights, with_slots(opts(ComputeDtype::F32, false, 512)))
                    .unwrap();
            let mut dut = create_backend(device, load(name), with_slots(opts(dtype, graphs, 512)))
                .unwrap_or_else(|e| panic!("{what}: creating the backend: {e}"));
            assert_eq!(dut.adapter_slots(), 2);
            for be in [&mut cpu as &mut dyn Backend, dut.as_mut()] {
                be.set_adapter(0, Some(a.clone())).unwrap();
                be.set_adapter(1, Some(b.clone())).unwrap();
            }
            let tables = prompt_tables(&ps, 8);
            let both = |cpu: &mut CpuBackend, dut: &mut dyn Backend, batch: &[SeqChunk<'_>], step: &str| {
                let want = cpu.forward(batch).unwrap();
                let got = dut.forward(batch).unwrap_or_else(|e| panic!("{what} {step}: {e}"));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_lora_close(dtype, g, w, &format!("{what} {step} chunk {i}"));
                }
                want
            };

            let slots0 = [Some(0), None, Some(1)];
            let prefill: Vec<SeqChunk<'_>> = ps
                .iter()
                .zip(&tables)
                .zip(slots0)
                .map(|((p, t), adapter)| SeqChunk {
                    tokens: &p.ids,
                    start_pos: 0,
                    block_table: t,
                    logits: LogitsRequest::All,
                    write: WriteMode::Direct,
                    adapter,
                })
                .collect();
            let rows = both(&mut cpu, dut.as_mut(), &prefill, "prefill");
            // The adapters change the logits (against transformers' base model); the base chunk
            // does not.
            for (i, moved) in
                [(0, max_abs_diff(&rows[0], &ps[0].logits)), (2, max_abs_diff(&rows[2], &ps[2].logits))]
            {
                assert!(moved > 1e-1, "{what}: the adapter of chunk {i} moves its logits by only {moved}");
            }
            assert!(max_abs_diff(&rows[1], &ps[1].logits) < 2e-3, "{what}: the base chunk moved");

            let vocab = c.vocab_size;
            let mut last: Vec<u32> = rows
                .iter()
                .map(|r| tandem_engine::sampler::greedy_pick(&mut r[r.len() - vocab..].to_vec()).0)
                .collect();
            let mut pos: Vec<usize> = ps.iter().map(|p| p.ids.len()).collect();
            let steps: [(&str, [Option<u16>; 3]); 5] = [
                ("decode with adapters", slots0),
                ("decode without adapters", [None; 3]),
                ("decode with adapters again", slots0),
                ("decode after the swap", [None, Some(0), Some(1)]),
                ("decode after the swap again", [Some(1), Some(0), None]),
            ];
            for (si, (step, slots)) in steps.iter().enumerate() {
                if si == 3 {
                    for be in [&mut cpu as &mut dyn Backend, dut.as_mut()] {
                        be.set_adapter(0, Some(swap.clone())).unwrap();
                    }
                }
                let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
                let batch: Vec<SeqChunk<'_>> = (0..3)
                    .map(|i| SeqChunk {
                        tokens: &toks[i],
                        start_pos: pos[i],
                        block_table: &tables[i],
                        logits: LogitsRequest::Last,
                        write: WriteMode::Direct,
                        adapter: slots[i],
                    })
                    .collect();
                let rows = both(&mut cpu, dut.as_mut(), &batch, step);
                last = rows.into_iter().map(|mut r| tandem_engine::sampler::greedy_pick(&mut r).0).collect();
                pos.iter_mut().for_each(|p| *p += 1);
            }

            // An emptied slot, and a slot past the last, are refused before anything runs.
            dut.set_adapter(1, None).unwrap();
            assert_eq!(dut.adapter_slots(), 2);
            for slot in [1u16, 2] {
                let toks = [last[0]];
                let chunk = SeqChunk {
                    tokens: &toks,
                    start_pos: pos[0],
                    block_table: &tables[0],
                    logits: LogitsRequest::Last,
                    write: WriteMode::Direct,
                    adapter: Some(slot),
                };
                let err = dut.forward(&[chunk]).err().unwrap_or_else(|| panic!("{what}: slot {slot} ran"));
                assert!(err.to_string().contains("empty"), "{what}: slot {slot}: {err}");
            }
            assert!(dut.set_adapter(2, Some(a.clone())).is_err(), "{what}: a third slot was filled");
        }
    }
    if let Device::Cuda(ordinal) = device {
        // The adapters' buffers and the table are the instance's, on its device.
        let m = load(name);
        let mut be =
            CudaBackend::new(ordinal, m.config, m.weights, with_slots(opts(ComputeDtype::Bf16, true, 64)))
                .unwrap();
        be.set_adapter(1, Some(b)).unwrap();
        let allocs = be.allocation_devices().unwrap();
        for what in ["LoRA table", "LoRA intermediate", "LoRA adapter"] {
            assert!(allocs.iter().any(|(w, _)| *w == what), "{what} is not listed: {allocs:?}");
        }
        assert!(allocs.iter().all(|&(_, d)| d == ordinal), "{allocs:?}");
    }
}

#[test]
fn lora_mixed_batches_on_the_cpu() {
    lora_mixed_batches(Device::Cpu);
}

#[test]
fn lora_mixed_batches_on_cuda_match_the_cpu() {
    let Some(ordinal) = gpu("lora_mixed_batches_on_cuda_match_the_cpu") else { return };
    lora_mixed_batches(Device::Cuda(ordinal));
}
