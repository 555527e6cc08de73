//! The CUDA backend against the reference fixtures and the CPU backend.
//!
//! Every test but the first needs a GPU: without one it prints why it is skipped and passes,
//! unless `TANDEM_REQUIRE_GPU=1` (set by scripts/gpu-check.sh), which turns a skip into a failure.

use std::sync::{Arc, Barrier};

use tandem_engine::backend::{Backend, BackendOptions, ComputeDtype, LogitsRequest, SeqChunk};
use tandem_engine::factory::create_backend;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::cuda::{self, CudaBackend};
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::kv::{BlockAllocator, WriteMode};
use tandem_engine::loader::{load_model, LoadedModel};
use tandem_engine::sampler::SamplingParams;
use tandem_engine::{Device, EngineError};

#[path = "../../tests/reference/fixture_reader.rs"]
mod fixture_reader;
use fixture_reader::{argmax, fixture, read_reference, Prompt, MODELS};

fn load(name: &str) -> LoadedModel {
    load_model(&fixture(name)).unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

/// `Some(0)` when cuda:0 is usable; otherwise prints why the test is skipped (or fails, when a
/// GPU is required).
fn gpu(test: &str) -> Option<usize> {
    match cuda::probe(0) {
        Ok(_) => Some(0),
        Err(e) => {
            if std::env::var("TANDEM_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: a GPU is required (TANDEM_REQUIRE_GPU=1) but cuda:0 is unusable: {e}");
            }
            eprintln!("skipping {test}: no usable GPU: {e}");
            None
        }
    }
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

fn all_logits(be: &mut dyn Backend, ids: &[u32]) -> Vec<f32> {
    let mut alloc = BlockAllocator::new(64, 8);
    alloc.add_sequence(1, ids.len()).unwrap();
    let table = alloc.block_table(1).unwrap().to_vec();
    let chunk = SeqChunk { tokens: ids, start_pos: 0, block_table: &table, logits: LogitsRequest::All };
    be.forward(&[chunk], WriteMode::Direct).unwrap().remove(0)
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

#[test]
fn logits_match_transformers() {
    let Some(_) = gpu("logits_match_transformers") else { return };
    for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
        let (mut agree, mut positions) = (0usize, 0usize);
        for name in MODELS {
            let (vocab, prompts) = read_reference(name);
            let mut be = cuda_backend(name, dtype, false, 512);
            for (pi, p) in prompts.iter().enumerate() {
                let got = all_logits(&mut be, &p.ids);
                assert_eq!(got.len(), p.logits.len(), "{name} prompt {pi}: logits shape");
                let (mut max_abs, mut num, mut den) = (0f32, 0f64, 0f64);
                for (g, r) in got.chunks(vocab).zip(p.logits.chunks(vocab)) {
                    for (a, b) in g.iter().zip(r) {
                        max_abs = max_abs.max((a - b).abs());
                        num += ((a - b) as f64).powi(2);
                        den += (*b as f64).powi(2);
                    }
                    agree += usize::from(argmax(g) == argmax(r));
                    positions += 1;
                }
                let rel = (num / den.max(1e-30)).sqrt();
                match dtype {
                    ComputeDtype::F32 => {
                        assert!(max_abs < 2e-3, "{name} prompt {pi} f32: max abs error {max_abs}")
                    }
                    ComputeDtype::Bf16 => {
                        assert!(rel < 2e-2, "{name} prompt {pi} bf16: relative error {rel}")
                    }
                }
            }
        }
        let share = agree as f64 / positions as f64;
        let floor = if dtype == ComputeDtype::F32 { 1.0 } else { 0.99 };
        assert!(share >= floor, "{dtype}: argmax agrees on {agree} of {positions} positions");
    }
}

fn greedy_params(p: &Prompt) -> SamplingParams {
    SamplingParams { max_tokens: p.greedy.len(), ignore_eos: !p.stopped_at_eos, ..SamplingParams::greedy() }
}

/// Runs every prompt of `name` at once through the engine (prefill chunks mixed into decode
/// steps when the budget is small) and returns each sequence's tokens.
fn generate_all(be: Box<dyn Backend>, name: &str, budget: usize) -> Vec<Vec<u32>> {
    let (_, prompts) = read_reference(name);
    let tok = load(name).tokenizer;
    let mut eng = Engine::new(be, tok, SchedulerOptions { max_batch_tokens: budget, max_num_seqs: 16 });
    let ids: Vec<_> =
        prompts.iter().map(|p| eng.add_request(p.ids.clone(), greedy_params(p)).unwrap()).collect();
    let mut got = vec![Vec::new(); prompts.len()];
    for _ in 0..10_000 {
        if eng.num_active() == 0 {
            break;
        }
        for ev in eng.step().unwrap() {
            match ev {
                SeqEvent::Token { seq, token, .. } => {
                    got[ids.iter().position(|&i| i == seq).unwrap()].push(token)
                }
                SeqEvent::Failed { error, .. } => panic!("{name}: {error}"),
                SeqEvent::Finished { .. } | SeqEvent::Prefilled { .. } => {}
            }
        }
        eng.check_kv().unwrap();
    }
    let s = eng.kv_stats();
    assert_eq!(s.free, s.total, "{name}: KV blocks leaked");
    got
}

#[test]
fn greedy_generation_matches_the_cpu_backend() {
    let Some(_) = gpu("greedy_generation_matches_the_cpu_backend") else { return };
    for name in MODELS {
        let (_, prompts) = read_reference(name);
        for (graphs, budget) in [(false, 512), (true, 512), (true, 7)] {
            let be = cuda_backend(name, ComputeDtype::F32, graphs, budget);
            let got = generate_all(Box::new(be), name, budget);
            for (pi, p) in prompts.iter().enumerate() {
                assert_eq!(got[pi], p.greedy, "{name} graphs={graphs} budget={budget} prompt {pi}");
            }
        }
    }
}

#[test]
fn staged_pass_reaches_the_pool_only_through_commit() {
    let Some(_) = gpu("staged_pass_reaches_the_pool_only_through_commit") else { return };
    let name = "qwen3";
    let (_, prompts) = read_reference(name);
    let ids = &prompts.iter().max_by_key(|p| p.ids.len()).unwrap().ids;
    assert!(ids.len() >= 8, "the longest qwen3 prompt is too short for this test");
    let mut be = cuda_backend(name, ComputeDtype::F32, false, 512);
    let full = all_logits(&mut be, ids);
    let vocab = be.config().vocab_size;

    let mut alloc = BlockAllocator::new(64, 8);
    alloc.add_sequence(7, ids.len()).unwrap();
    let table = alloc.block_table(7).unwrap().to_vec();
    let (k, drafted) = (ids.len() / 2, 3);
    let chunk = |start: usize, end: usize| SeqChunk {
        tokens: &ids[start..end],
        start_pos: start,
        block_table: &table,
        logits: LogitsRequest::All,
    };
    be.forward(&[chunk(0, k)], WriteMode::Direct).unwrap();
    // A staged pass whose tokens are all discarded must leave no trace...
    be.forward(&[SeqChunk { tokens: &[0, 0, 0], ..chunk(k, k + drafted) }], WriteMode::Staged).unwrap();
    assert!(be.forward(&[chunk(k, k + 1)], WriteMode::Direct).is_err(), "a pass while staged data waits");
    be.discard_staged();
    // ...and a staged pass of the real tokens, one accepted, must equal a direct run.
    be.forward(&[chunk(k, k + drafted)], WriteMode::Staged).unwrap();
    be.commit_staged(&[1]).unwrap();
    let rest = be.forward(&[chunk(k + 1, ids.len())], WriteMode::Direct).unwrap().remove(0);
    let want = &full[(k + 1) * vocab..];
    let err = rest.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err < 1e-3, "logits after commit differ from a direct run by {err}");
}

#[test]
fn kv_blocks_match_the_cpu_backend_and_round_trip() {
    let Some(_) = gpu("kv_blocks_match_the_cpu_backend_and_round_trip") else { return };
    let name = "llama-gqa";
    let (_, prompts) = read_reference(name);
    let ids = &prompts[0].ids;
    let mut gpu_be = cuda_backend(name, ComputeDtype::F32, false, 512);
    let m = load(name);
    let mut cpu_be = CpuBackend::new(m.config, m.weights, opts(ComputeDtype::F32, false, 512)).unwrap();
    all_logits(&mut gpu_be, ids);
    all_logits(&mut cpu_be, ids);
    let layout = gpu_be.kv_layout();
    assert_eq!(layout, cpu_be.kv_layout());
    let used = ids.len().div_ceil(layout.block_size) as u32;
    let f =
        |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    for layer in 0..layout.num_layers {
        for block in 0..used {
            let (gk, gv) = gpu_be.read_block(layer, block).unwrap();
            let (ck, cv) = cpu_be.read_block(layer, block).unwrap();
            for (g, c) in [(f(&gk), f(&ck)), (f(&gv), f(&cv))] {
                let err = g.iter().zip(&c).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 1e-4, "layer {layer} block {block}: K/V differ from the CPU backend by {err}");
            }
            // Write the block elsewhere, copy it back over a third block, read it back exactly.
            let spare = 60 - block;
            gpu_be.write_block(layer, spare, &gk, &gv).unwrap();
            gpu_be.copy_block(spare, spare - 1).unwrap();
            assert_eq!(
                gpu_be.read_block(layer, spare - 1).unwrap(),
                (gk.clone(), gv.clone()),
                "layer {layer} block {block}"
            );
            // The transfer sink (TCP receiver) writes into the same device pool.
            let sink = gpu_be.kv_sink().expect("a CUDA backend has a transfer sink");
            assert!(sink.segment_path().is_none(), "a GPU pool is not a shared-memory segment");
            // SAFETY: nothing else uses block `spare - 2` of this test's backend.
            unsafe { sink.write_block(layer, spare - 2, &gk, &gv).unwrap() };
            assert_eq!(gpu_be.read_block(layer, spare - 2).unwrap(), (gk, gv), "sink write, layer {layer}");
        }
    }
    assert!(gpu_be.read_block(layout.num_layers, 0).is_err());
    assert!(gpu_be.write_block(0, 0, &[0u8; 3], &[0u8; 3]).is_err());
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
        let mut alloc = BlockAllocator::new(64, 8);
        let mut tables = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            alloc.add_sequence(i as u64, p.ids.len() + 1).unwrap();
            tables.push(alloc.block_table(i as u64).unwrap().to_vec());
        }
        let prefill: Vec<SeqChunk<'_>> = prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| SeqChunk {
                tokens: &p.ids,
                start_pos: 0,
                block_table: t,
                logits: LogitsRequest::Last,
            })
            .collect();
        let rows = be.forward(&prefill, WriteMode::Direct).unwrap();
        let picks = be.forward_greedy(&prefill, WriteMode::Direct).unwrap();
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
            })
            .collect();
        for _ in 0..2 {
            let rows = be.forward(&step, WriteMode::Direct).unwrap();
            let picks = be.forward_greedy(&step, WriteMode::Direct).unwrap();
            for (i, (mut row, pick)) in rows.into_iter().zip(picks).enumerate() {
                assert_eq!(pick.unwrap().0, tandem_engine::sampler::greedy_pick(&mut row).0, "decode {i}");
            }
        }
        let all = SeqChunk { logits: LogitsRequest::All, ..prefill[0] };
        assert!(be.forward_greedy(&[all], WriteMode::Direct).is_err(), "All logits cannot be picked");
    }
}
