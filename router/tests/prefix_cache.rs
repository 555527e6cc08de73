//! The router's side of the prefix cache, against fake workers: `Reserve` carries the prompt and
//! its salt, a decode worker's cached blocks are skipped by the transfer (and a malformed answer
//! fails the request and releases), cached prompt tokens reach the usage, salts are checked, and
//! requests follow the workers' cache digests (heartbeats, `Stats` of listed workers, and the
//! prompts routed since the last digest).

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use tandem_model::prefix;
use tandem_proto::v1::registry_client::RegistryClient;
use tandem_proto::v1::{self, Role};
use tonic::Code;

/// Tokens the fakes generate: ordinary vocabulary entries of the tiny model (no EOS).
const SCRIPT: [u32; 10] = [300, 301, 302, 303, 304, 305, 306, 307, 308, 309];
const BLOCK: u32 = 16;

/// A prompt of 60 tokens: 4 blocks, of which the first 3 may come from a cache.
fn prompt_60(first: u32) -> Vec<u32> {
    (first..first + 60).collect()
}

/// The short hashes of `prompt`'s reusable blocks under `salt`, as a worker's digest lists them.
fn hashes(prompt: &[u32], salt: &str) -> Vec<u64> {
    let root = prefix::chain_root(&tiny_model_id(), salt);
    let n = prefix::reusable_blocks(prompt.len(), BLOCK as usize) * BLOCK as usize;
    prefix::block_hashes(root, &prompt[..n], BLOCK as usize).iter().map(|h| h.short()).collect()
}

fn salted(prompt: Vec<u32>, salt: &str, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest { cache_salt: salt.into(), ..token_prompt(prompt, max_tokens) }
}

/// A fake worker serving on its own port, registered with `router` (`caching`: its record says
/// it keeps a prefix cache).
async fn join(router: &RouterProc, id: &str, role: Role, caching: bool) -> FakeWorker {
    let w =
        FakeWorker::new(worker_info(id, role, "127.0.0.1:1".parse().unwrap(), BLOCK), SCRIPT.to_vec(), None);
    w.0.info.lock().unwrap().prefix_cache = caching;
    w.0.info.lock().unwrap().address = serve(w.clone()).await.to_string();
    let info = w.0.info.lock().unwrap().clone();
    RegistryClient::new(router.channel().await).register(info).await.expect("registration");
    w
}

/// A heartbeat from `id` with `free` of 64 blocks free and, when given, a digest of `cached`.
async fn heartbeat(router: &RouterProc, id: &str, free: u32, cached: Option<Vec<u64>>) {
    let req = v1::HeartbeatRequest {
        worker_id: id.into(),
        load: Some(v1::WorkerLoad { total_blocks: 64, free_blocks: free, ..Default::default() }),
        cache: cached.map(|block_hashes| v1::CacheDigest {
            enabled: true,
            block_hashes,
            ..Default::default()
        }),
        ..Default::default()
    };
    let r = RegistryClient::new(router.channel().await).heartbeat(req).await.unwrap().into_inner();
    assert!(r.known);
}

/// Which of `workers` got each `Reserve`, in order of the workers' own logs.
fn reserved_on(workers: &[(&str, &FakeWorker)]) -> Vec<(String, usize)> {
    workers.iter().map(|(id, w)| (id.to_string(), w.0.reserves.lock().unwrap().len())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_carries_the_prompt_and_salt_and_the_transfer_skips_cached_blocks() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let p = join(&router, "p-1", Role::Prefill, false).await;
    let d = join(&router, "d-1", Role::Decode, true).await;
    // The decode worker holds the prompt's first 2 blocks: it reserves the other 2.
    *d.0.reserve_answer.lock().unwrap() = Some((2, vec![41, 42]));
    p.0.cached_tokens.store(32, Ordering::SeqCst);
    let ch = router.channel().await;
    let prompt = prompt_60(10);
    let c = generate(ch.clone(), salted(prompt.clone(), "tenant-a", 4)).await.unwrap();
    assert_eq!(c.token_ids, SCRIPT[..4].to_vec());

    let reserve = d.0.reserves.lock().unwrap()[0].clone();
    assert_eq!(reserve.num_tokens, 60);
    assert_eq!(reserve.prompt_token_ids, prompt);
    assert_eq!(reserve.cache_salt, "tenant-a");
    let pre = p.0.prefills.lock().unwrap()[0].clone();
    let dest = pre.destination.expect("destination");
    assert_eq!((dest.skip_blocks, dest.block_ids, dest.reservation_id), (2, vec![41, 42], 7));
    assert_eq!(pre.params.expect("params").cache_salt, "tenant-a");
    let dec = d.0.decodes.lock().unwrap()[0].clone();
    assert_eq!((dec.reservation_id, dec.params.expect("params").cache_salt.as_str()), (7, "tenant-a"));

    // The prefill worker's cached tokens are the usage's; its transfer volume is in the timings.
    assert_eq!(c.usage, Some(v1::Usage { prompt_tokens: 60, completion_tokens: 4, cached_tokens: 32 }));
    assert_eq!(c.timings.expect("timings").transfer_bytes, 100);
    let text = router_metrics(&router).await;
    assert_eq!(metric_value(&text, "tandem_router_cached_prompt_tokens_total"), Some(32.0), "{text}");

    // The most a worker may hold: every block but the last token's.
    *d.0.reserve_answer.lock().unwrap() = Some((3, vec![43]));
    generate(ch.clone(), salted(prompt.clone(), "tenant-a", 2)).await.unwrap();
    let dest = p.0.prefills.lock().unwrap()[1].destination.clone().expect("destination");
    assert_eq!((dest.skip_blocks, dest.block_ids), (3, vec![43]));
    assert!(d.releases().is_empty(), "{:?}", d.releases());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_cached_answer_fails_the_request_and_releases_the_reservation() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let p = join(&router, "p-1", Role::Prefill, false).await;
    let d = join(&router, "d-1", Role::Decode, true).await;
    let ch = router.channel().await;

    // All 4 blocks claimed cached: the last prompt token's block is always transferred.
    *d.0.reserve_answer.lock().unwrap() = Some((4, vec![]));
    let err = generate(ch.clone(), token_prompt(prompt_60(10), 4)).await.unwrap_err();
    assert_eq!(err.code(), Code::Internal, "{err:?}");
    assert_concealed(&err, &router, &["decode worker d-1", "4 cached blocks", "at most 3"]).await;
    eventually("the reservation is released", || d.releases().len() == 1).await;
    assert_eq!(d.releases()[0].reservation_id, 7);

    // 2 cached, yet blocks for 3 of the 4 blocks.
    *d.0.reserve_answer.lock().unwrap() = Some((2, vec![1, 2, 3]));
    let err = generate(ch.clone(), token_prompt(prompt_60(10), 4)).await.unwrap_err();
    assert_eq!(err.code(), Code::Internal, "{err:?}");
    assert_concealed(
        &err,
        &router,
        &["decode worker d-1", "reserved 3 blocks for 60 prompt tokens with 2 cached; 2 expected"],
    )
    .await;
    eventually("the reservation is released", || d.releases().len() == 2).await;
    assert!(p.calls().is_empty(), "no prefill for a malformed reservation: {:?}", p.calls());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_long_salt_is_refused_naming_the_field() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let _p = join(&router, "p-1", Role::Prefill, false).await;
    let d = join(&router, "d-1", Role::Decode, false).await;
    let ch = router.channel().await;
    let err = generate(ch.clone(), salted(vec![1, 2, 3], &"s".repeat(257), 2)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().starts_with("cache_salt: at most 256 bytes, got 257"), "{err:?}");
    assert!(d.calls().is_empty());
    generate(ch.clone(), salted(vec![1, 2, 3], &"s".repeat(256), 2)).await.unwrap();
    assert_eq!(d.0.reserves.lock().unwrap()[0].cache_salt.len(), 256);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_whose_digest_holds_the_prefix_is_chosen_unless_overloaded() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let _p = join(&router, "p-1", Role::Prefill, false).await;
    let d1 = join(&router, "d-1", Role::Decode, true).await;
    let d2 = join(&router, "d-2", Role::Decode, true).await;
    let ch = router.channel().await;
    let prompt = prompt_60(10);
    // d-2 has fewer free blocks, but holds the prompt's 3 reusable blocks under salt "a":
    // 2*1 - 30 beats 2*4 - 34.
    heartbeat(&router, "d-1", 34, Some(Vec::new())).await;
    heartbeat(&router, "d-2", 30, Some(hashes(&prompt, "a"))).await;
    let workers = [("d-1", &d1), ("d-2", &d2)];

    generate(ch.clone(), salted(prompt.clone(), "a", 2)).await.unwrap();
    assert_eq!(reserved_on(&workers), vec![("d-1".into(), 0), ("d-2".into(), 1)]);
    // The same tokens under another salt are other blocks: by load, to d-1.
    generate(ch.clone(), salted(prompt.clone(), "b", 2)).await.unwrap();
    assert_eq!(reserved_on(&workers), vec![("d-1".into(), 1), ("d-2".into(), 1)]);
    // d-2 without a free block is overloaded: its cache does not matter.
    heartbeat(&router, "d-2", 0, Some(hashes(&prompt, "a"))).await;
    generate(ch.clone(), salted(prompt.clone(), "a", 2)).await.unwrap();
    assert_eq!(reserved_on(&workers), vec![("d-1".into(), 2), ("d-2".into(), 1)]);
    // Without digests the choice is by load alone: d-1, with more free blocks.
    heartbeat(&router, "d-1", 34, None).await;
    heartbeat(&router, "d-2", 30, None).await;
    generate(ch.clone(), salted(prompt.clone(), "a", 2)).await.unwrap();
    assert_eq!(reserved_on(&workers), vec![("d-1".into(), 3), ("d-2".into(), 1)]);

    let text = router_metrics(&router).await;
    assert_eq!(metric_value(&text, "tandem_router_cache_routed_requests_total"), Some(1.0), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_request_with_the_same_prefix_follows_the_first_before_any_heartbeat() {
    let router = RouterProc::start(&["--heartbeat-ms", "60000"]);
    let _p = join(&router, "p-1", Role::Prefill, false).await;
    let d1 = join(&router, "d-1", Role::Decode, true).await;
    let d2 = join(&router, "d-2", Role::Decode, true).await;
    let ch = router.channel().await;
    let workers = [("d-1", &d1), ("d-2", &d2)];
    // Equal load: the first goes to d-1 (lowest id), which is then counted with 4 blocks fewer.
    let first = prompt_60(10);
    generate(ch.clone(), token_prompt(first.clone(), 2)).await.unwrap();
    assert_eq!(reserved_on(&workers), vec![("d-1".into(), 1), ("d-2".into(), 0)]);
    // The same first 48 tokens, another ending: to d-1 all the same, which now holds them.
    let mut second = first[..48].to_vec();
    second.extend(400..412);
    generate(ch.clone(), token_prompt(second, 2)).await.unwrap();
    assert_eq!(reserved_on(&workers), vec![("d-1".into(), 2), ("d-2".into(), 0)]);
    // Another prompt goes by load: to d-2.
    generate(ch.clone(), token_prompt(prompt_60(100), 2)).await.unwrap();
    assert_eq!(reserved_on(&workers), vec![("d-1".into(), 2), ("d-2".into(), 1)]);
    let text = router_metrics(&router).await;
    assert_eq!(metric_value(&text, "tandem_router_cache_routed_requests_total"), Some(1.0), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listed_workers_report_their_digest_in_stats_and_colocated_usage_counts_cached_tokens() {
    let prompt = prompt_60(10);
    let mut listed = Vec::new();
    let mut fakes = Vec::new();
    for id in ["c-1", "c-2"] {
        let w = FakeWorker::new(
            worker_info(id, Role::Colocated, "127.0.0.1:1".parse().unwrap(), BLOCK),
            SCRIPT.to_vec(),
            None,
        );
        w.0.info.lock().unwrap().prefix_cache = true;
        listed.push(serve(w.clone()).await.to_string());
        fakes.push(w);
    }
    let (c1, c2) = (&fakes[0], &fakes[1]);
    *c2.0.digest.lock().unwrap() =
        Some(v1::CacheDigest { enabled: true, block_hashes: hashes(&prompt, ""), ..Default::default() });
    c2.0.cached_tokens.store(48, Ordering::SeqCst);
    let workers = listed.join(",");
    let router = RouterProc::start(&["--heartbeat-ms", "100", "--worker", &workers]);
    // Two answered polls of c-2: the first one's digest is recorded before the second is asked.
    let stats = |w: &FakeWorker| w.secrets().iter().filter(|(m, _)| m == "Stats").count();
    let deadline = Instant::now() + Duration::from_secs(10);
    while stats(c1) < 1 || stats(c2) < 2 {
        assert!(Instant::now() < deadline, "listed workers never polled:\n{}", router.stderr());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ch = router.channel().await;
    let c = generate(ch.clone(), token_prompt(prompt.clone(), 3)).await.unwrap();
    assert_eq!(c.token_ids, SCRIPT[..3].to_vec());
    assert_eq!((c1.0.decodes.lock().unwrap().len(), c2.0.decodes.lock().unwrap().len()), (0, 1));
    assert_eq!(c.usage, Some(v1::Usage { prompt_tokens: 60, completion_tokens: 3, cached_tokens: 48 }));
    assert_eq!(c.timings.expect("timings").transfer_bytes, 0, "colocated: nothing moves");
    // Under another salt the digest holds nothing of it: by load (equal), to c-1.
    generate(ch.clone(), salted(prompt.clone(), "x", 3)).await.unwrap();
    assert_eq!((c1.0.decodes.lock().unwrap().len(), c2.0.decodes.lock().unwrap().len()), (1, 1));
    assert_eq!(c1.0.decodes.lock().unwrap()[0].params.as_ref().unwrap().cache_salt, "x");
}
