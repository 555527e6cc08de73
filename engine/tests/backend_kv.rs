//! The backend's KV paths on a real (tiny) model: staged speculative passes commit exactly the
//! accepted prefix into every layer, blocks copied to another backend instance continue the
//! sequence identically (KV parity), and bad requests are refused without touching the pool. Each
//! runs on an f32 pool and again on every narrower pool the device stores (CPU: f16, bf16, fp8;
//! CUDA: bf16, fp8).

use std::path::Path;

use tandem_engine::backend::{Backend, BackendOptions, ComputeDtype, LogitsRequest, SeqChunk};
use tandem_engine::cpu::CpuBackend;
use tandem_engine::factory::create_backend;
use tandem_engine::kv::{BlockAllocator, KvDtype, WriteMode};
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions};
use tandem_engine::Device;

#[macro_use]
mod common;
use common::{assert_close, f32s, tolerance};

const BS: usize = 4;

fn options(kv: KvDtype) -> BackendOptions {
    BackendOptions {
        num_blocks: 32,
        block_size: BS,
        max_batch_tokens: 64,
        dtype: ComputeDtype::F32,
        cuda_graphs: false,
        kv_dtype: Some(kv),
        ..Default::default()
    }
}

/// The pool dtypes narrower than f32 that `device` stores.
fn narrow_kv(device: Device) -> &'static [KvDtype] {
    match device {
        Device::Cpu => &[KvDtype::F16, KvDtype::Bf16, KvDtype::Fp8],
        Device::Cuda(_) => &[KvDtype::Bf16, KvDtype::Fp8],
    }
}

fn backend(name: &str, kv: KvDtype) -> CpuBackend {
    let m = load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name))
        .unwrap();
    CpuBackend::new(m.config, m.weights, options(kv)).unwrap()
}

fn backend_on(device: Device, name: &str, kv: KvDtype) -> Box<dyn Backend> {
    let m = load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name))
        .unwrap();
    create_backend(device, m, options(kv)).unwrap_or_else(|e| panic!("{name} on {device}: {e}"))
}

/// Stored K/V of two backends that computed them apart: equal to `tol` in f32 (bit for bit where
/// `tol` is 0, as between CPU backends); in a narrower dtype on devices `tol` apart, each value
/// the other's or one of its neighbours (a value the two devices compute a
/// hair apart can round either way), so at most one step of the dtype apart.
fn assert_stored_close(dtype: KvDtype, got: &[f32], want: &[f32], tol: f32, what: &str) {
    if dtype == KvDtype::F32 || tol == 0.0 {
        return assert_close(got, want, tol, what);
    }
    assert_eq!(got.len(), want.len(), "{what}: length");
    // The relative spacing of the dtype's values, and the spacing of its smallest values.
    let (rel, abs) = match dtype {
        KvDtype::F16 => (2f32.powi(-10), 2f32.powi(-24)),
        KvDtype::Bf16 => (2f32.powi(-7), 0.0),
        _ => (2f32.powi(-3), 2f32.powi(-9)),
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let step = (rel * g.abs().max(w.abs())).max(abs);
        assert!((g - w).abs() <= step.max(tol), "{what}: element {i}: {g} vs {w} ({dtype})");
    }
}

fn last_logits(
    be: &mut dyn Backend,
    tokens: &[u32],
    start: usize,
    table: &[u32],
    mode: WriteMode,
) -> Vec<f32> {
    let c = SeqChunk {
        tokens,
        start_pos: start,
        block_table: table,
        logits: LogitsRequest::Last,
        write: mode,
        adapter: None,
    };
    be.forward(&[c]).unwrap().remove(0)
}

fn pool_snapshot(be: &dyn Backend, blocks: &[u32]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let layers = be.kv_layout().num_layers;
    (0..layers)
        .flat_map(|l| blocks.iter().map(move |&b| (l, b)))
        .map(|(l, b)| be.read_block(l, b).unwrap())
        .collect()
}

/// A staged pass never touches the pool; `discard` leaves it as it was; `commit(accepted)` writes
/// exactly the accepted prefix into every layer's own cache (equal to direct writes, to the
/// device's tolerance) and the rejected token nowhere; no pass runs while staged data waits.
fn staged_commit(device: Device) {
    staged_commit_in(device, KvDtype::F32)
}

fn staged_commit_narrow(device: Device) {
    for &kv in narrow_kv(device) {
        staged_commit_in(device, kv)
    }
}

fn staged_commit_in(device: Device, kv: KvDtype) {
    let tol = tolerance(device);
    let prompt: Vec<u32> = vec![5, 17, 42, 99, 7, 3];
    let draft: Vec<u32> = vec![11, 23, 31];
    for name in ["llama-gqa", "qwen3"] {
        let mut alloc = BlockAllocator::new(32, BS);
        // Reference: everything written directly.
        let mut direct = backend_on(device, name, kv);
        alloc.add_sequence(1, prompt.len() + draft.len()).unwrap();
        let table = alloc.block_table(1).unwrap().to_vec();
        last_logits(&mut *direct, &prompt, 0, &table, WriteMode::Direct);
        last_logits(&mut *direct, &draft[..2], prompt.len(), &table, WriteMode::Direct);
        let want = last_logits(&mut *direct, &[77], prompt.len() + 2, &table, WriteMode::Direct);

        let mut spec = backend_on(device, name, kv);
        assert_eq!(spec.kv_layout().dtype, kv);
        last_logits(&mut *spec, &prompt, 0, &table, WriteMode::Direct);
        let before = pool_snapshot(&*spec, &table);
        // A staged verification pass over three draft tokens, then a discard: pool unchanged.
        last_logits(&mut *spec, &draft, prompt.len(), &table, WriteMode::Staged);
        assert_eq!(pool_snapshot(&*spec, &table), before, "{name}: staged pass touched the pool");
        let next = SeqChunk {
            tokens: &[77],
            start_pos: prompt.len(),
            block_table: &table,
            logits: LogitsRequest::Last,
            write: WriteMode::Direct,
            adapter: None,
        };
        assert!(spec.forward(&[next]).is_err(), "{name}: a pass while staged data waits");
        spec.discard_staged();
        assert_eq!(pool_snapshot(&*spec, &table), before, "{name}: discard touched the pool");
        // Again, now accepting two of three: the next step must see exactly those two.
        last_logits(&mut *spec, &draft, prompt.len(), &table, WriteMode::Staged);
        spec.commit_staged(&[2]).unwrap();
        // Accepted draft tokens reached every layer's own cache, equal to direct writes; the
        // rejected third one never reached any layer.
        let layout = spec.kv_layout();
        let row = layout.token_bytes();
        let rows_at = |be: &dyn Backend, l: usize, pos: usize| {
            let (k, v) = be.read_block(l, table[pos / BS]).unwrap();
            let off = (pos % BS) * row;
            (k[off..off + row].to_vec(), v[off..off + row].to_vec())
        };
        for l in 0..layout.num_layers {
            for pos in prompt.len()..prompt.len() + 2 {
                let ((sk, sv), (dk, dv)) = (rows_at(&*spec, l, pos), rows_at(&*direct, l, pos));
                assert_stored_close(
                    kv,
                    &f32s(&layout, &sk),
                    &f32s(&layout, &dk),
                    tol.kv,
                    &format!("{name} {kv}: K, layer {l} position {pos}"),
                );
                assert_stored_close(
                    kv,
                    &f32s(&layout, &sv),
                    &f32s(&layout, &dv),
                    tol.kv,
                    &format!("{name} {kv}: V, layer {l} position {pos}"),
                );
            }
            let rejected = prompt.len() + 2;
            let (block, off) = (rejected / BS, (rejected % BS) * row);
            let (bk, bv) = &before[l * table.len() + block];
            assert_eq!(
                rows_at(&*spec, l, rejected),
                (bk[off..off + row].to_vec(), bv[off..off + row].to_vec()),
                "{name}: rejected token reached layer {l}"
            );
        }
        let got = last_logits(&mut *spec, &[77], prompt.len() + 2, &table, WriteMode::Direct);
        assert_close(
            &got,
            &want,
            tol.logits,
            &format!("{name} {kv}: committed prefix against direct writes"),
        );
    }
}

device_test!(staged_commit_equals_direct_and_discard_leaves_pool_untouched, staged_commit);
device_test!(staged_commit_in_narrow_kv_pools, staged_commit_narrow);

/// A staged pass that also carries a prefill chunk (verification batched with prefill): the
/// prefill chunk is written straight into the pool even when the pass is discarded, the staged
/// chunk only through commit; a commit that would accept part of the direct chunk is refused.
/// (Prefill treated as speculation would lose the prompt's KV on discard.)
fn prefill_beside_verification(device: Device) {
    let tol = tolerance(device);
    let prompt_a: Vec<u32> = vec![5, 17, 42, 99, 7];
    // Longer than the CPU's small-pass limit alone and beside the draft, so both passes compute
    // its K/V with the same kernels and the pools can be compared byte for byte.
    let prompt_b: Vec<u32> = vec![8, 9, 10, 11, 12, 13, 14, 15, 16];
    let draft: Vec<u32> = vec![11, 23, 31];
    let mut alloc = BlockAllocator::new(32, BS);
    alloc.add_sequence(1, prompt_a.len() + draft.len()).unwrap();
    alloc.add_sequence(2, prompt_b.len()).unwrap();
    let (ta, tb) = (alloc.block_table(1).unwrap().to_vec(), alloc.block_table(2).unwrap().to_vec());

    // Reference: B's prompt prefilled alone, directly.
    let mut direct = backend_on(device, "llama-gqa", KvDtype::F32);
    let want_b = last_logits(&mut *direct, &prompt_b, 0, &tb, WriteMode::Direct);

    let mut be = backend_on(device, "llama-gqa", KvDtype::F32);
    last_logits(&mut *be, &prompt_a, 0, &ta, WriteMode::Direct);
    let before_a = pool_snapshot(&*be, &ta);
    let mixed = |be: &mut dyn Backend| {
        let chunks = [
            SeqChunk {
                tokens: &draft,
                start_pos: prompt_a.len(),
                block_table: &ta,
                logits: LogitsRequest::All,
                write: WriteMode::Staged,
                adapter: None,
            },
            SeqChunk {
                tokens: &prompt_b,
                start_pos: 0,
                block_table: &tb,
                logits: LogitsRequest::Last,
                write: WriteMode::Direct,
                adapter: None,
            },
        ];
        be.forward(&chunks).unwrap()
    };
    let rows = mixed(&mut *be);
    assert_eq!(rows[0].len(), draft.len() * 448, "all-position logits for the verification chunk");
    // One logits row alone goes through the CPU's single-row kernel, four rows through the tiled
    // one: equal up to summation order.
    assert_close(&rows[1], &want_b, tol.logits.max(1e-5), "prefill beside verification");
    assert!(be.staged_pending());
    be.discard_staged();
    assert!(!be.staged_pending());
    assert_eq!(pool_snapshot(&*be, &ta), before_a, "a discarded verification chunk touched the pool");
    assert_eq!(
        pool_snapshot(&*be, &tb),
        pool_snapshot(&*direct, &tb),
        "the prefill chunk of a discarded staged pass is not in the pool"
    );

    mixed(&mut *be);
    assert!(be.commit_staged(&[2, 3]).is_err(), "part of a direct chunk accepted");
    assert!(be.staged_pending(), "a refused commit must leave the pass pending");
    be.commit_staged(&[2, prompt_b.len()]).unwrap();
    assert!(!be.staged_pending());
    // A continues from its committed prefix exactly as if the two tokens had been written directly.
    last_logits(&mut *direct, &prompt_a, 0, &ta, WriteMode::Direct);
    last_logits(&mut *direct, &draft[..2], prompt_a.len(), &ta, WriteMode::Direct);
    let want_a = last_logits(&mut *direct, &[77], prompt_a.len() + 2, &ta, WriteMode::Direct);
    let got_a = last_logits(&mut *be, &[77], prompt_a.len() + 2, &ta, WriteMode::Direct);
    // The mixed pass is over the small-pass limit (tiled kernels), the reference not: equal up to
    // summation order.
    assert_close(&got_a, &want_a, tol.logits.max(1e-5), "verification chunk committed beside a prefill");
}

device_test!(a_prefill_chunk_in_a_staged_pass_is_written_direct, prefill_beside_verification);

/// KV blocks round-trip on a device: they hold the CPU backend's values (to the device's
/// tolerance); written elsewhere, copied, or written through the transfer sink they read back
/// byte for byte; copied to another instance under other block ids, they continue the sequence
/// identically (KV parity); bad layers and sizes are refused.
fn blocks_round_trip(device: Device) {
    blocks_round_trip_in(device, KvDtype::F32)
}

fn blocks_round_trip_narrow(device: Device) {
    for &kv in narrow_kv(device) {
        blocks_round_trip_in(device, kv)
    }
}

fn blocks_round_trip_in(device: Device, kv: KvDtype) {
    let tol = tolerance(device);
    let name = "llama3-rope-scaled";
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 % 400) as u32).collect();
    let mut a = backend_on(device, name, kv);
    let mut b = backend_on(device, name, kv);
    let mut cpu = backend(name, kv);
    let mut alloc_a = BlockAllocator::new(32, BS);
    let mut alloc_b = BlockAllocator::new(32, BS);
    // Different block ids on each side, as between a prefill and a decode node.
    alloc_b.alloc_blocks(5).unwrap();
    alloc_a.add_sequence(1, prompt.len() + 1).unwrap();
    alloc_b.add_sequence(1, prompt.len() + 1).unwrap();
    let (ta, tb) = (alloc_a.block_table(1).unwrap().to_vec(), alloc_b.block_table(1).unwrap().to_vec());
    assert_ne!(ta, tb);
    let first = last_logits(&mut *a, &prompt, 0, &ta, WriteMode::Direct);
    last_logits(&mut cpu, &prompt, 0, &ta, WriteMode::Direct);
    let next = first.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).unwrap().0 as u32;
    let layout = a.kv_layout();
    assert_eq!(layout, cpu.kv_layout());
    let used = prompt.len().div_ceil(BS);
    let sink = a.kv_sink().expect("a backend has a transfer sink");
    assert!(sink.segment_path().is_none(), "a pool that is not shared is no shared-memory segment");
    for l in 0..layout.num_layers {
        for i in 0..used {
            let (k, v) = a.read_block(l, ta[i]).unwrap();
            let (ck, cv) = cpu.read_block(l, ta[i]).unwrap();
            let what = format!("{kv}: layer {l} block {i}: K/V against the CPU backend");
            assert_stored_close(kv, &f32s(&layout, &k), &f32s(&layout, &ck), tol.kv, &what);
            assert_stored_close(kv, &f32s(&layout, &v), &f32s(&layout, &cv), tol.kv, &what);
            b.write_block(l, tb[i], &k, &v).unwrap();
            let copied = b.read_block(l, tb[i]).unwrap();
            assert_eq!(copied, (k.clone(), v.clone()), "layer {l} block {i}: bytes differ after the copy");
            // Write the block to a spare one, copy that over a second, read it back exactly.
            let spare = 31 - i as u32;
            a.write_block(l, spare, &k, &v).unwrap();
            a.copy_block(spare, spare - 4).unwrap();
            let copied = a.read_block(l, spare - 4).unwrap();
            assert_eq!(copied, (k.clone(), v.clone()), "layer {l} block {i}: copy");
            // The transfer sink (the TCP receiver) writes into the same pool.
            // SAFETY: nothing else uses block `spare - 8` of this test's backend.
            unsafe { sink.write_block(l, spare - 8, &k, &v).unwrap() };
            assert_eq!(a.read_block(l, spare - 8).unwrap(), (k, v), "layer {l} block {i}: sink write");
        }
    }
    assert!(a.read_block(layout.num_layers, 0).is_err(), "a layer out of range");
    assert!(a.write_block(0, 0, &[0u8; 3], &[0u8; 3]).is_err(), "a block of the wrong size");
    let on_a = last_logits(&mut *a, &[next], prompt.len(), &ta, WriteMode::Direct);
    let on_b = last_logits(&mut *b, &[next], prompt.len(), &tb, WriteMode::Direct);
    assert_close(&on_b, &on_a, tol.logits, "continuation after the copy");
}

device_test!(blocks_copied_to_another_instance_continue_identically, blocks_round_trip);
device_test!(narrow_kv_blocks_copied_to_another_instance_continue_identically, blocks_round_trip_narrow);

#[test]
fn bad_batches_are_errors_not_panics() {
    let mut be = backend("llama-gqa", KvDtype::F32);
    let table = vec![0u32, 1];
    let vocab = be.config().vocab_size as u32;
    let cases: Vec<(Vec<u32>, usize, Vec<u32>)> = vec![
        (vec![vocab], 0, table.clone()),     // token outside the vocabulary
        (vec![], 0, table.clone()),          // empty chunk
        (vec![1; 9], 0, table.clone()),      // block table too short
        (vec![1], 0, vec![9999]),            // block outside the pool
        (vec![1; 65], 0, (0..20).collect()), // more than max_batch_tokens
    ];
    for (tokens, start, table) in cases {
        let c = SeqChunk {
            tokens: &tokens,
            start_pos: start,
            block_table: &table,
            logits: LogitsRequest::Last,
            write: WriteMode::Direct,
            adapter: None,
        };
        assert!(be.forward(&[c]).is_err(), "{} tokens at {start} with table {table:?}", tokens.len());
    }
    // The backend still works afterwards.
    let c = SeqChunk {
        tokens: &[1, 2],
        start_pos: 0,
        block_table: &table,
        logits: LogitsRequest::Last,
        write: WriteMode::Direct,
        adapter: None,
    };
    assert_eq!(be.forward(&[c]).unwrap()[0].len(), vocab as usize);
}

#[test]
fn engine_refuses_requests_that_cannot_run() {
    let be = backend("llama-gqa", KvDtype::F32);
    let m = load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa"))
        .unwrap();
    let mut eng = Engine::new(Box::new(be), m.tokenizer, SchedulerOptions::default());
    let max = eng.max_sequence_len();
    let e = eng.add_request(vec![1; max], SamplingParams::greedy()).unwrap_err();
    assert_eq!(e.kind(), "invalid_request");
    assert!(e.to_string().contains("prompt has"), "{e}");
    assert_eq!(eng.add_request(vec![], SamplingParams::greedy()).unwrap_err().kind(), "invalid_request");
    assert_eq!(
        eng.add_request(vec![100_000], SamplingParams::greedy()).unwrap_err().kind(),
        "invalid_request"
    );
    let bad = SamplingParams { temperature: -1.0, ..SamplingParams::greedy() };
    assert_eq!(eng.add_request(vec![1], bad).unwrap_err().kind(), "invalid_request");
    // A request that runs into the end of the pool stops with `length`, and frees its blocks.
    let out = eng
        .generate(
            vec![1; max - 3],
            SamplingParams { max_tokens: 100, ignore_eos: true, ..SamplingParams::greedy() },
            |_| {},
        )
        .unwrap();
    assert_eq!(out.token_ids.len(), 3);
    eng.check_kv().unwrap();
    // Cancelling a queued request frees everything.
    let id = eng.add_request(vec![1, 2, 3], SamplingParams::greedy()).unwrap();
    eng.step().unwrap();
    eng.cancel(id).unwrap();
    eng.check_kv().unwrap();
    assert_eq!(eng.num_active(), 0);
}

/// Two backend instances in one process, driven from two threads at once, share nothing: each
/// produces exactly what it produces alone, and each reports its own device.
#[test]
fn two_instances_on_two_threads_share_nothing() {
    let run = |name: &'static str, prompt: Vec<u32>| {
        std::thread::spawn(move || {
            let mut be = backend(name, KvDtype::F32);
            assert_eq!(be.device(), tandem_engine::Device::Cpu);
            let mut alloc = BlockAllocator::new(32, BS);
            alloc.add_sequence(1, prompt.len() + 8).unwrap();
            let table = alloc.block_table(1).unwrap().to_vec();
            let mut out = Vec::new();
            let mut logits = last_logits(&mut be, &prompt, 0, &table, WriteMode::Direct);
            for i in 0..8 {
                let next = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
                out.push(next);
                logits = last_logits(&mut be, &[next], prompt.len() + i, &table, WriteMode::Direct);
            }
            out
        })
    };
    let (pa, pb): (Vec<u32>, Vec<u32>) = ((1..20).collect(), (100..107).collect());
    let solo_a = run("llama3-rope-scaled", pa.clone()).join().unwrap();
    let solo_b = run("qwen3", pb.clone()).join().unwrap();
    for _ in 0..3 {
        let (ta, tb) = (run("llama3-rope-scaled", pa.clone()), run("qwen3", pb.clone()));
        assert_eq!(ta.join().unwrap(), solo_a);
        assert_eq!(tb.join().unwrap(), solo_b);
    }
}
