//! The KV tiers behind the pool, on the tiny fixture models: a conversation whose blocks the pool
//! evicted comes back from host memory or from disk, with the same greedy output as an engine
//! without any cache and with fewer prompt tokens computed (the counters say how many). The disk
//! tier outlives its engine; a page from another model, or a corrupt one, is never used; and the
//! allocator's invariants hold after every step.

mod common;
#[macro_use]
mod sched_common;
use sched_common::{fixture, fixture_backend, fixture_engine, greedy, Setup};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_engine::backend::{Backend, SeqChunk};
use tandem_engine::kv::{
    BlockId, HeapMemory, HostMemory, KvTiers, Page, SpillCopy, TierIdentity, TierOptions,
};
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, PrefixStats, SchedulerOptions, SeqEvent};

/// A pool of 40 blocks of 8 tokens: one 96-token conversation turn and its answer take 13.
const SMALL: Setup = Setup { model: "llama-gqa", blocks: 40, block_size: 8, budget: 64, max_num_seqs: 4 };

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|j| 3 + (seed * 131 + j * 29 + j * j * 7 + seed * seed * 17) % 400).collect()
}

/// A fresh, empty directory for a disk tier.
fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tandem-kv-tiers-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn options(host_bytes: u64, disk: Option<&Path>) -> TierOptions {
    TierOptions {
        host_bytes,
        disk_dir: disk.map(Path::to_path_buf),
        disk_bytes: 64 << 20,
        disk_persist: true,
    }
}

/// An engine of `s` with the prefix cache under `identity` and the tiers `opts`.
fn tiered(s: Setup, identity: &str, opts: &TierOptions) -> Engine {
    let e = fixture_engine(&s).with_prefix_cache(identity);
    let id = TierIdentity {
        model: identity.to_owned(),
        layout: e.backend().kv_layout(),
        windows: e.kv_windows().to_vec(),
    };
    let store = KvTiers::open(opts, &id, e.page_bytes()).expect("tiers open").expect("a tier is on");
    e.with_kv_tiers(store).expect("tiers accepted")
}

/// Runs one request to its end, checking the KV invariants after every step; its tokens.
fn solo(e: &mut Engine, prompt: &[u32], params: SamplingParams) -> Vec<u32> {
    let id = e.add_request(prompt.to_vec(), params).expect("request accepted");
    let mut out = Vec::new();
    let mut steps = 0;
    while e.num_active() > 0 {
        steps += 1;
        assert!(steps < 20_000, "no progress");
        for ev in e.step().expect("step") {
            match ev {
                SeqEvent::Token { seq, token, .. } if seq == id => out.push(token),
                SeqEvent::Failed { error, .. } => panic!("failed: {error}"),
                _ => {}
            }
        }
        e.check_kv().expect("KV invariants after a step");
    }
    let s = e.kv_stats();
    assert_eq!((s.used, s.free + s.cached), (0, s.total), "quiescent: {s:?}");
    if let Some(t) = e.kv_tiers() {
        t.check().expect("the tiers' own counts agree");
    }
    out
}

/// A conversation's first turn, then enough other prompts to evict it from the pool, then its
/// second turn (the first turn, its answer and new tokens). Returns the second turn's tokens
/// and the prefix counters of that turn alone.
fn revisit(e: &mut Engine, seed: u32) -> (Vec<u32>, PrefixStats) {
    let first = tokens(seed, 96);
    let answer = solo(e, &first, greedy(8));
    for other in 0..4 {
        solo(e, &tokens(seed * 10 + 100 + other, 96), greedy(4));
    }
    let second: Vec<u32> = first.iter().chain(&answer).chain(&tokens(seed + 50, 16)).copied().collect();
    let before = e.prefix_stats();
    let out = solo(e, &second, greedy(8));
    let after = e.prefix_stats();
    let d = PrefixStats {
        hit_tokens: after.hit_tokens - before.hit_tokens,
        computed_prompt_tokens: after.computed_prompt_tokens - before.computed_prompt_tokens,
        evictions: after.evictions,
        ..after
    };
    (out, d)
}

/// The second turn's tokens on an engine without any cache.
fn reference(s: Setup, seed: u32) -> Vec<u32> {
    revisit(&mut fixture_engine(&s), seed).0
}

#[test]
fn without_tiers_the_pool_forgets_the_conversation() {
    // What the tiers are measured against: the small pool evicts the first turn.
    let mut e = fixture_engine(&SMALL).with_prefix_cache("fixture/llama-gqa");
    let (out, d) = revisit(&mut e, 1);
    assert_eq!(out, reference(SMALL, 1));
    assert!(d.evictions > 0, "{d:?}");
    assert_eq!(d.hit_tokens, 0, "the pool kept the first turn: the test measures nothing: {d:?}");
}

#[test]
fn an_evicted_conversation_comes_back_from_host_memory() {
    for model in ["llama-gqa", "qwen3", "mistral-sliding", "gemma3", "gemma2"] {
        let s = Setup { model, ..SMALL };
        let mut e = tiered(s, &format!("fixture/{model}"), &options(16 << 20, None));
        let (out, d) = revisit(&mut e, 2);
        assert_eq!(out, reference(s, 2), "{model}: the same tokens as without any cache");
        let (tiers, engine) = e.tier_stats().unwrap();
        assert!(engine.spilled_pages > 0 && engine.reloaded_pages > 0, "{model}: {engine:?}");
        assert!(tiers.host.as_ref().unwrap().hits > 0, "{model}: {tiers:?}");
        // The first turn and its answer, in whole blocks, less the block of the last token.
        assert!(d.hit_tokens >= 96, "{model}: {d:?}");
        assert!(d.computed_prompt_tokens <= 120 - 96, "{model}: {d:?}");
    }
}

#[test]
fn an_evicted_conversation_comes_back_from_disk() {
    let dir = temp_dir("disk");
    let mut e = tiered(SMALL, "fixture/llama-gqa", &options(0, Some(&dir)));
    let (out, d) = revisit(&mut e, 3);
    assert_eq!(out, reference(SMALL, 3));
    let (tiers, engine) = e.tier_stats().unwrap();
    let disk = tiers.disk.unwrap();
    // From files, or from the write queue when the writes are behind: either way the disk tier's.
    assert!(disk.spills > 0 && disk.hits > 0, "{disk:?}");
    assert!(engine.reloaded_pages > 0, "{engine:?}");
    assert!(d.hit_tokens >= 96, "{d:?}");
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_disk_tier_outlives_its_engine_and_other_models_never_read_it() {
    let dir = temp_dir("restart");
    let first = tokens(4, 96);
    let second: Vec<u32> = first.iter().chain(&tokens(60, 24)).copied().collect();
    let want = {
        let mut e = fixture_engine(&SMALL);
        solo(&mut e, &second, greedy(8))
    };
    {
        let mut e = tiered(SMALL, "fixture/llama-gqa", &options(0, Some(&dir)));
        solo(&mut e, &first, greedy(4));
        for other in 0..4 {
            solo(&mut e, &tokens(200 + other, 96), greedy(4));
        }
        assert!(e.kv_tiers().unwrap().flush(Duration::from_secs(10)), "the writes finish");
    }
    // Another model's identity in the same directory sees none of it.
    {
        let mut e = tiered(SMALL, "fixture/another-model", &options(0, Some(&dir)));
        let before = e.prefix_stats();
        assert_eq!(solo(&mut e, &second, greedy(8)), want);
        assert_eq!(e.prefix_stats().hit_tokens - before.hit_tokens, 0);
    }
    // The same model, started again, finds the first turn on disk.
    let mut e = tiered(SMALL, "fixture/llama-gqa", &options(0, Some(&dir)));
    assert!(e.kv_tiers().unwrap().stats().disk.unwrap().blocks > 0);
    let before = e.prefix_stats();
    assert_eq!(solo(&mut e, &second, greedy(8)), want);
    let hit = e.prefix_stats().hit_tokens - before.hit_tokens;
    assert!(hit >= 88, "the restarted engine reloaded the first turn: {hit} tokens");
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_corrupt_page_on_disk_is_computed_instead() {
    let dir = temp_dir("corrupt");
    let first = tokens(5, 96);
    let second: Vec<u32> = first.iter().chain(&tokens(61, 24)).copied().collect();
    let want = solo(&mut fixture_engine(&SMALL), &second, greedy(8));
    {
        let mut e = tiered(SMALL, "fixture/llama-gqa", &options(0, Some(&dir)));
        solo(&mut e, &first, greedy(4));
        for other in 0..4 {
            solo(&mut e, &tokens(300 + other, 96), greedy(4));
        }
        assert!(e.kv_tiers().unwrap().flush(Duration::from_secs(10)));
    }
    // Flip one payload byte in every page file.
    let mut flipped = 0;
    for sub in std::fs::read_dir(&dir).unwrap() {
        for f in std::fs::read_dir(sub.unwrap().path()).unwrap() {
            let p = f.unwrap().path();
            if p.extension().is_some_and(|x| x == "kvp") {
                let mut bytes = std::fs::read(&p).unwrap();
                let last = bytes.len() - 1;
                bytes[last] ^= 0x40;
                std::fs::write(&p, bytes).unwrap();
                flipped += 1;
            }
        }
    }
    assert!(flipped > 0);
    let mut e = tiered(SMALL, "fixture/llama-gqa", &options(0, Some(&dir)));
    let before = e.prefix_stats();
    assert_eq!(solo(&mut e, &second, greedy(8)), want, "computed, not read from a corrupt page");
    assert_eq!(e.prefix_stats().hit_tokens - before.hit_tokens, 0);
    let disk = e.kv_tiers().unwrap().stats().disk.unwrap();
    assert!(disk.errors > 0, "the bad pages were rejected: {disk:?}");
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn many_conversations_revisited_in_turn_keep_their_output_with_a_tight_tier() {
    // A host tier of a few pages and a disk tier behind it: conversations come back from either,
    // or are computed, and every answer equals the uncached engine's.
    let dir = temp_dir("many");
    let e0 = fixture_engine(&SMALL);
    let page = e0.page_bytes() as u64;
    drop(e0);
    let mut e =
        tiered(SMALL, "fixture/llama-gqa", &TierOptions { host_bytes: 10 * page, ..options(0, Some(&dir)) });
    let mut plain = fixture_engine(&SMALL);
    let mut history: Vec<Vec<u32>> = (0..6).map(|c| tokens(400 + c, 40)).collect();
    for round in 0..3u32 {
        for c in [0usize, 3, 1, 5, 2, 4] {
            let turn: Vec<u32> =
                history[c].iter().chain(&tokens(500 + round * 10 + c as u32, 8)).copied().collect();
            let got = solo(&mut e, &turn, greedy(6));
            assert_eq!(got, solo(&mut plain, &turn, greedy(6)), "round {round}, conversation {c}");
            history[c] = turn.into_iter().chain(got).collect();
        }
    }
    let (tiers, engine) = e.tier_stats().unwrap();
    assert!(engine.reloaded_pages > 0, "{engine:?} {tiers:?}");
    assert!(tiers.host.unwrap().evictions > 0, "the host tier was full at times");
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tiers_need_the_prefix_cache_and_the_pools_page_size() {
    let e = fixture_engine(&SMALL);
    let id =
        TierIdentity { model: "m".into(), layout: e.backend().kv_layout(), windows: e.kv_windows().to_vec() };
    let store = KvTiers::open(&options(1 << 20, None), &id, e.page_bytes()).unwrap().unwrap();
    let err = match e.with_kv_tiers(store.clone()) {
        Ok(_) => panic!("tiers without a prefix cache"),
        Err(err) => err.to_string(),
    };
    assert!(err.contains("prefix cache"), "{err}");
    let other = KvTiers::open(&options(1 << 20, None), &id, 1234).unwrap().unwrap();
    let err = match fixture_engine(&SMALL).with_prefix_cache("m").with_kv_tiers(other) {
        Ok(_) => panic!("a store of another page size"),
        Err(err) => err.to_string(),
    };
    assert!(err.contains("1234"), "{err}");
    let _ = fixture("llama-gqa");
}

/// A prefill worker's engine (prefill-only requests, held until released, blocks of 16): started
/// again on its disk tier, it reads a whole evicted prompt back, even when the disk answers before
/// the engine looks again (pages read at once are still waited for, one step).
#[test]
fn a_prefill_engine_restarted_on_its_disk_tier_computes_only_the_rest() {
    let s = Setup { model: "llama-gqa", blocks: 40, block_size: 16, budget: 512, max_num_seqs: 64 };
    let dir = temp_dir("prefill");
    let first = tokens(7, 208);
    let mut next = first.clone();
    next.extend(tokens(9, 40));
    // Prefills `p`, releases it, and returns the tokens its lookup found cached.
    let prefill = |e: &mut Engine, p: &[u32]| -> u64 {
        let before = e.prefix_stats().hit_tokens;
        let id = e.add_prefill_request(p.to_vec(), greedy(4)).unwrap();
        let mut steps = 0;
        while !e.step().unwrap().iter().any(|ev| matches!(ev, SeqEvent::Prefilled { seq, .. } if *seq == id))
        {
            steps += 1;
            assert!(steps < 1000, "no progress");
        }
        e.release_prefilled(id).unwrap();
        e.check_kv().unwrap();
        e.prefix_stats().hit_tokens - before
    };
    {
        let mut e = tiered(s, "m", &options(0, Some(&dir)));
        assert_eq!(prefill(&mut e, &first), 0);
        for i in 0..4 {
            prefill(&mut e, &tokens(700 + i, 200 + i as usize));
        }
        assert_eq!(prefill(&mut e, &next), 208, "the evicted first prompt came back from disk");
        assert!(e.kv_tiers().unwrap().flush(Duration::from_secs(10)));
    }
    let mut e = tiered(s, "m", &options(0, Some(&dir)));
    assert_eq!(prefill(&mut e, &next), 208, "after the restart too");
    let (tiers, engine) = e.tier_stats().unwrap();
    assert_eq!((engine.reloaded_pages, engine.waits, engine.wait_timeouts), (13, 1, 0), "{engine:?}");
    assert_eq!(tiers.disk.unwrap().hits, 13);
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stopping worker keeps what its pool holds in the tiers ([`Engine::spill_pool`]): started
/// again, it finds a prompt the pool never evicted.
#[test]
fn the_pools_pages_are_kept_when_the_engine_stops() {
    let dir = temp_dir("stop");
    let first = tokens(8, 96);
    let second: Vec<u32> = first.iter().chain(&tokens(62, 24)).copied().collect();
    let want = solo(&mut fixture_engine(&SMALL), &second, greedy(8));
    {
        let mut e = tiered(SMALL, "fixture/llama-gqa", &options(0, Some(&dir)));
        solo(&mut e, &first, greedy(4));
        assert_eq!(e.prefix_stats().evictions, 0, "the pool kept the prompt");
        assert_eq!(e.kv_tiers().unwrap().stats().disk.unwrap().blocks, 0);
        assert!(e.spill_pool(Duration::from_secs(10)).unwrap() >= 12);
        assert_eq!(e.spill_pool(Duration::from_secs(10)).unwrap(), 0, "nothing twice");
    }
    let mut e = tiered(SMALL, "fixture/llama-gqa", &options(0, Some(&dir)));
    let before = e.prefix_stats();
    assert_eq!(solo(&mut e, &second, greedy(8)), want);
    assert!(e.prefix_stats().hit_tokens - before.hit_tokens >= 96);
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The CPU backend with its page copies landing late, as a GPU's do: the blocks are read at the
/// call (the CPU pool is written in program order), the pages are filled with a marker, and the
/// bytes land in them only when the tiers wait for the copy, a moment later, or never (`fail`).
struct LateCopy {
    inner: tandem_engine::cpu::CpuBackend,
    fail: bool,
    copies: Arc<AtomicUsize>,
}

/// A copy still in flight: the pages' addresses and the bytes that land there.
struct Landing {
    land: Mutex<Vec<(usize, Vec<u8>)>>,
    fail: bool,
}

impl SpillCopy for Landing {
    fn wait(&self) -> Result<(), String> {
        std::thread::sleep(Duration::from_millis(1));
        if self.fail {
            return Err("the copy engine reported an error".into());
        }
        for (addr, bytes) in self.land.lock().unwrap().drain(..) {
            // SAFETY: the tiers keep each page's memory until this wait returns.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
        }
        Ok(())
    }
}

impl Backend for LateCopy {
    delegate_backend!();

    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> tandem_engine::Result<Vec<Vec<f32>>> {
        self.inner.forward(batch)
    }

    unsafe fn copy_pages_out(
        &self,
        blocks: &[BlockId],
        pages: &mut [Page],
    ) -> tandem_engine::Result<Option<Box<dyn SpillCopy>>> {
        self.copies.fetch_add(1, Ordering::SeqCst);
        let mut land = Vec::new();
        for (&block, page) in blocks.iter().zip(pages.iter_mut()) {
            let mut now = Page::heap(page.len());
            // SAFETY: the CPU backend's copy is complete on return.
            let pending = unsafe { self.inner.copy_pages_out(&[block], std::slice::from_mut(&mut now)) }?;
            assert!(pending.is_none());
            page.fill(0xA5);
            land.push((page.as_mut_ptr() as usize, now.to_vec()));
        }
        Ok(Some(Box::new(Landing { land: Mutex::new(land), fail: self.fail })))
    }
}

/// An engine of `s` on [`LateCopy`], its tiers' pages in heap memory standing in for a GPU
/// driver's page-locked memory.
fn late_tiered(s: Setup, opts: &TierOptions, fail: bool) -> (Engine, Arc<AtomicUsize>) {
    let (inner, tokenizer) = fixture_backend(&s, None);
    let copies = Arc::new(AtomicUsize::new(0));
    let be = LateCopy { inner, fail, copies: copies.clone() };
    let options = SchedulerOptions { max_batch_tokens: s.budget, max_num_seqs: s.max_num_seqs };
    let e = Engine::new(Box::new(be), tokenizer, options).with_prefix_cache("fixture/llama-gqa");
    let id = TierIdentity {
        model: "fixture/llama-gqa".into(),
        layout: e.backend().kv_layout(),
        windows: e.kv_windows().to_vec(),
    };
    let alloc = |bytes: usize| -> Result<Option<Box<dyn HostMemory>>, String> {
        Ok(Some(Box::new(HeapMemory::labelled(bytes, "pinned"))))
    };
    let store =
        KvTiers::open_in(opts, &id, e.page_bytes(), Some(&alloc)).expect("tiers open").expect("a tier is on");
    (e.with_kv_tiers(store).expect("tiers accepted"), copies)
}

#[test]
fn pages_copied_out_late_come_back_from_memory_and_disk_with_the_same_output() {
    let dir = temp_dir("late");
    for opts in [options(16 << 20, None), options(0, Some(&dir)), options(16 << 20, Some(&dir))] {
        let (mut e, copies) = late_tiered(SMALL, &opts, false);
        let (out, d) = revisit(&mut e, 9);
        assert_eq!(out, reference(SMALL, 9), "{opts:?}: the same tokens as without any cache");
        let (tiers, engine) = e.tier_stats().unwrap();
        assert!(copies.load(Ordering::SeqCst) > 0, "the engine copied through the backend");
        assert!(engine.spilled_pages > 0 && engine.reloaded_pages > 0, "{opts:?}: {engine:?}");
        assert_eq!(tiers.host_memory, "pinned");
        assert_eq!(tiers.unpinned_pages, 0, "the arena is sized for every page in memory: {tiers:?}");
        assert!(d.hit_tokens >= 96, "{opts:?}: {d:?}");
        if let Some(disk) = &tiers.disk {
            // Summed after landing: the writer accepted every page.
            assert_eq!(disk.errors, 0, "{disk:?}");
        }
        assert!(e.kv_tiers().unwrap().flush(Duration::from_secs(10)));
        e.kv_tiers().unwrap().check().unwrap();
        drop(e);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pages_whose_copy_fails_are_computed_instead() {
    let (mut e, _) = late_tiered(SMALL, &options(16 << 20, None), true);
    let (out, d) = revisit(&mut e, 10);
    assert_eq!(out, reference(SMALL, 10));
    let (tiers, engine) = e.tier_stats().unwrap();
    let host = tiers.host.unwrap();
    assert!(engine.spilled_pages > 0 && host.drops == engine.spilled_pages, "{engine:?} {host:?}");
    assert_eq!((engine.reloaded_pages, host.blocks, d.hit_tokens), (0, 0, 0), "{d:?}");
}

/// An engine on `cuda:ordinal` over `s`'s fixture model (f32, as the CPU computes), with the
/// prefix cache.
fn cuda_engine(s: Setup, ordinal: usize) -> Engine {
    use tandem_engine::backend::{BackendOptions, ComputeDtype};
    let m = tandem_engine::loader::load_model(&fixture(s.model)).expect("fixture model loads");
    let opts = BackendOptions {
        num_blocks: s.blocks,
        block_size: s.block_size,
        max_batch_tokens: s.budget,
        dtype: ComputeDtype::F32,
        ..Default::default()
    };
    let be = tandem_engine::cuda::CudaBackend::new(ordinal, m.config, m.weights, opts).expect("CUDA backend");
    let options = SchedulerOptions { max_batch_tokens: s.budget, max_num_seqs: s.max_num_seqs };
    Engine::new(Box::new(be), m.tokenizer, options).with_prefix_cache("fixture/llama-gqa")
}

#[test]
fn on_a_gpu_pages_live_in_pinned_memory_and_come_back_as_the_pool_held_them() {
    let Some(ordinal) = common::gpu("kv_tiers::on_a_gpu_pages_live_in_pinned_memory") else { return };
    // What the pool gives when it never evicts: the same hits, computed the same way.
    let roomy = Setup { blocks: 400, ..SMALL };
    let (want, kept) = revisit(&mut cuda_engine(roomy, ordinal), 11);
    assert_eq!(kept.evictions, 0);
    let dir = temp_dir("gpu");
    for opts in [options(16 << 20, None), options(0, Some(&dir))] {
        let e = cuda_engine(SMALL, ordinal);
        let id = TierIdentity {
            model: "fixture/llama-gqa".into(),
            layout: e.backend().kv_layout(),
            windows: e.kv_windows().to_vec(),
        };
        let backend = e.backend();
        let pinned = |bytes: usize| backend.host_memory(bytes).transpose().map_err(|e| e.to_string());
        let store = KvTiers::open_in(&opts, &id, e.page_bytes(), Some(&pinned)).unwrap().unwrap();
        let mut e = e.with_kv_tiers(store).unwrap();
        let (out, d) = revisit(&mut e, 11);
        assert_eq!(out, want, "{opts:?}: the same tokens as from a pool that kept every block");
        assert_eq!(d.hit_tokens, kept.hit_tokens, "{opts:?}: {d:?}");
        let (tiers, engine) = e.tier_stats().unwrap();
        assert_eq!(tiers.host_memory, "pinned");
        assert_eq!(tiers.unpinned_pages, 0, "{tiers:?}");
        assert!(engine.spilled_pages > 0 && engine.reloaded_pages > 0, "{engine:?}");
        e.kv_tiers().unwrap().check().unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
