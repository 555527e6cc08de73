//! LoRA adapters on the real `tandem-decode` binary over the tiny fixture model and its fixture
//! adapters: `--lora` at start (a bad one stops the start naming it), the LoadAdapter /
//! UnloadAdapter / ListAdapters calls and their statuses, Info advertising the adapters, requests
//! naming an adapter (unknown: NOT_FOUND, another id: FAILED_PRECONDITION) and running it as an
//! in-process engine does, and a reservation's adapter checked against the transfer that fills
//! it and the Decode that adopts it.

mod common;

use std::path::{Path, PathBuf};

use common::{run_to_exit, tiny_model, Proc};
use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_proto::v1::worker_client::WorkerClient;
use tandem_proto::v1::{
    AdapterInfo, DecodeRequest, EngineParams, InfoRequest, ListAdaptersRequest, LoadAdapterRequest,
    ReserveRequest, StatsRequest, UnloadAdapterRequest, WorkerInfo,
};
use tandem_serve::auth::{cluster_request, Secret};
use tandem_transport::{KvDestination, KvSender, SenderOptions};
use tandem_worker::kv_wire::offer_from_wire;
use tonic::transport::Channel;
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_tandem-decode");
const BLOCK: usize = 8;

/// A fixture adapter of the tiny model (`a`, `b`, `c`: PEFT directories; `b.gguf`).
fn lora(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/lora/llama-gqa").join(name)
}

fn lora_arg(name: &str) -> String {
    format!("{name}={}", lora(name).display())
}

fn start(extra: &[&str]) -> Proc {
    let model = tiny_model();
    let mut args =
        vec!["--model", model.to_str().expect("utf-8 path"), "--kv-blocks", "48", "--block-size", "8"];
    args.extend_from_slice(extra);
    Proc::start(BIN, &args)
}

/// The in-process reference, holding the fixture adapters `names`.
fn local_engine(names: &[&str]) -> Engine {
    let m = load_model(&tiny_model()).expect("fixture model");
    let config = m.config.clone();
    let opts =
        BackendOptions { num_blocks: 64, block_size: BLOCK, max_batch_tokens: 512, ..Default::default() };
    let be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
    let mut e = Engine::new(Box::new(be), m.tokenizer, SchedulerOptions::default());
    for n in names {
        let a = tandem_engine::lora::load::load(n, &lora(n), &config).expect("fixture adapter");
        e.add_adapter(a).expect("held");
    }
    e
}

fn greedy(n: usize, adapter: &str, adapter_id: &str) -> SamplingParams {
    SamplingParams {
        max_tokens: n,
        ignore_eos: true,
        seed: Some(1),
        adapter: adapter.into(),
        adapter_id: adapter_id.into(),
        ..SamplingParams::greedy()
    }
}

fn engine_params(p: &SamplingParams) -> EngineParams {
    EngineParams {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k as u32,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        seed: p.seed.expect("tests use explicit seeds"),
        max_tokens: p.max_tokens as u32,
        ignore_eos: p.ignore_eos,
        adapter: p.adapter.clone(),
        adapter_id: p.adapter_id.clone(),
        ..Default::default()
    }
}

async fn decode(
    c: &mut WorkerClient<Channel>,
    prompt: &[u32],
    params: &SamplingParams,
    reservation_id: u64,
    first_token: Option<u32>,
) -> Result<Vec<u32>, tonic::Status> {
    let req = DecodeRequest {
        request_id: "r".into(),
        prompt_token_ids: prompt.to_vec(),
        params: Some(engine_params(params)),
        reservation_id,
        first_token,
        n: 0,
    };
    let mut stream = c.decode(req).await?.into_inner();
    let mut tokens = Vec::new();
    while let Some(msg) = stream.message().await? {
        tokens.extend(msg.token_ids);
        if msg.finish_reason.is_some() {
            break;
        }
    }
    Ok(tokens)
}

async fn load(c: &mut WorkerClient<Channel>, name: &str, path: &Path) -> Result<AdapterInfo, tonic::Status> {
    let req = LoadAdapterRequest { name: name.into(), path: path.display().to_string() };
    c.load_adapter(req).await.map(|r| r.into_inner())
}

fn names(adapters: &[AdapterInfo]) -> Vec<&str> {
    adapters.iter().map(|a| a.name.as_str()).collect()
}

async fn assert_all_free(c: &mut WorkerClient<Channel>) {
    let s = c.stats(StatsRequest { check_invariants: true }).await.expect("Stats").into_inner();
    assert!(s.invariants_checked && s.invariants_ok, "invariants: {}", s.invariant_error);
    let kv = s.kv.expect("kv counters");
    assert_eq!((kv.free + kv.cached, kv.used), (kv.total, 0), "blocks still in use: {kv:?}");
}

#[test]
fn a_bad_lora_flag_stops_the_start_naming_the_adapter() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    let (st, err) = run_to_exit(BIN, &["--model", m, "--lora", "gone=/nonexistent/tandem-lora"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("'gone'") && err.contains("/nonexistent/tandem-lora"), "{err}");
    // An adapter of another base model: refused by name, with the problem.
    let gemma = lora("../gemma3/a");
    let other = format!("g={}", gemma.display());
    let (st, err) = run_to_exit(BIN, &["--model", m, "--lora", &other], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("'g'") && err.contains("gemma3/a"), "{err}");
    let (st, err) = run_to_exit(BIN, &["--model", m, "--lora", &lora_arg("a"), "--max-loras", "0"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--max-loras 0"), "{err}");
    let (st, err) = run_to_exit(BIN, &["--model", m, "--lora", "no-path"], &[]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("--lora") && err.contains("NAME=PATH"), "{err}");
    // TANDEM_LORA, a comma list, is read like the flag.
    let env = format!("{},x=/nonexistent/x-adapter", lora_arg("a"));
    let (st, err) = run_to_exit(BIN, &["--model", m], &[("TANDEM_LORA", &env)]);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(err.contains("'x'") && err.contains("/nonexistent/x-adapter"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_are_loaded_listed_advertised_and_unloaded() {
    let w = start(&["--lora", &lora_arg("a"), "--max-loras", "4"]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.expect("Info").into_inner();
    assert_eq!(info.max_adapters, 4);
    assert_eq!(names(&info.adapters), ["a"], "the --lora adapter is advertised");
    let a = info.adapters[0].clone();
    assert_eq!(a.id.len(), 32, "{a:?}");
    assert_eq!((a.rank, a.targets.clone()), (4, vec!["q_proj".to_string(), "v_proj".to_string()]));
    assert!(a.source.ends_with("lora/llama-gqa/a") && a.bytes > 0, "{a:?}");

    // Another adapter at run time: answered with its record, then listed and advertised.
    let started = c.list_adapters(ListAdaptersRequest {}).await.unwrap().into_inner().adapters_version;
    let b = load(&mut c, "b", &lora("b")).await.expect("LoadAdapter");
    assert_eq!(b.name, "b");
    assert!(b.id.len() == 32 && b.id != a.id, "{b:?}");
    let list = c.list_adapters(ListAdaptersRequest {}).await.expect("ListAdapters").into_inner();
    assert_eq!((names(&list.adapters), list.max_adapters), (vec!["a", "b"], 4));
    // The load's answer carries the version of the adapter set it made (one above the start's,
    // which is the process's start time in microseconds), and the list is of that version.
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    assert!(started > 0 && started <= since_epoch.as_micros() as u64, "{started}");
    assert!(since_epoch.as_micros() as u64 - started < 3_600_000_000, "{started}: not this process's start");
    assert_eq!((b.adapters_version, list.adapters_version), (started + 1, started + 1));
    assert_eq!(
        list.adapters[1],
        AdapterInfo { resident: list.adapters[1].resident, adapters_version: 0, ..b.clone() }
    );
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(names(&info.adapters), ["a", "b"]);

    // The same weights under the same name again: a no-op.
    let again = load(&mut c, "a", &lora("a")).await.expect("the same adapter again");
    assert_eq!(again.id, a.id);
    // A name held with other weights.
    let err = load(&mut c, "a", &lora("c")).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err}");
    assert!(err.message().contains("'a'") && err.message().contains(&a.id), "{err}");
    // A path with nothing there, and an adapter of another model: named, with the problem.
    let err = load(&mut c, "gone", Path::new("/nonexistent/tandem-adapter")).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.message().contains("'gone'") && err.message().contains("/nonexistent/tandem-adapter"));
    let err = load(&mut c, "g", &lora("../gemma3/a")).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.message().contains("'g'"), "{err}");
    let err = load(&mut c, "", &lora("a")).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let list = c.list_adapters(ListAdaptersRequest {}).await.unwrap().into_inner();
    assert_eq!(names(&list.adapters), ["a", "b"], "refused loads changed nothing");

    // Unloading: true once, then false.
    let before = c.list_adapters(ListAdaptersRequest {}).await.unwrap().into_inner().adapters_version;
    let r = c.unload_adapter(UnloadAdapterRequest { name: "b".into() }).await.unwrap().into_inner();
    assert!(r.unloaded);
    assert!(
        r.adapters_version > before,
        "an unload is a later version: {} after {before}",
        r.adapters_version
    );
    let r2 = c.unload_adapter(UnloadAdapterRequest { name: "b".into() }).await.unwrap().into_inner();
    assert!(!r2.unloaded);
    assert_eq!(r2.adapters_version, r.adapters_version, "nothing changed");
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(names(&info.adapters), ["a"]);
    // A GGUF adapter loads too.
    let g = load(&mut c, "bg", &lora("b.gguf")).await.expect("a GGUF adapter");
    assert_eq!(g.name, "bg");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_adapter_slots_refuses_to_load() {
    let w = start(&["--max-loras", "0"]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.max_adapters, info.adapters.len()), (0, 0));
    let err = load(&mut c, "a", &lora("a")).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("--max-loras 0"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adapter_calls_ask_for_the_cluster_secret() {
    let w = start(&["--cluster-secret", "s3cret"]);
    let secret = Secret::new("s3cret", "test").unwrap();
    let mut c = w.client().await;
    let err = load(&mut c, "a", &lora("a")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
    let err = c.unload_adapter(UnloadAdapterRequest { name: "a".into() }).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
    let err = c.list_adapters(ListAdaptersRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
    let req = LoadAdapterRequest { name: "a".into(), path: lora("a").display().to_string() };
    let a = c.load_adapter(cluster_request(Some(&secret), req)).await.expect("with the secret").into_inner();
    assert_eq!(a.name, "a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_run_the_adapter_they_name() {
    let w = start(&["--colocated", "--lora", &lora_arg("a")]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    let id = info.adapters[0].id.clone();
    let prompt: Vec<u32> = (40..60).collect();
    let mut reference = local_engine(&["a"]);

    // Unknown adapter: NOT_FOUND naming it; another id: FAILED_PRECONDITION naming both.
    let err = decode(&mut c, &prompt, &greedy(4, "nope", ""), 0, None).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
    assert!(err.message().contains("'nope'"), "{err}");
    assert_eq!(
        tandem_proto::adapter_refusal(&err),
        Some(tandem_proto::ADAPTER_UNKNOWN),
        "marked for the router: {err:?}"
    );
    let wrong = "00000000000000000000000000000000";
    let err = decode(&mut c, &prompt, &greedy(4, "a", wrong), 0, None).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert_eq!(tandem_proto::adapter_refusal(&err), Some(tandem_proto::ADAPTER_OTHER_WEIGHTS), "{err:?}");
    assert!(err.message().contains(wrong) && err.message().contains(&id), "{err}");

    // The adapter runs as in one process, and is not the base model.
    let base = decode(&mut c, &prompt, &greedy(12, "", ""), 0, None).await.expect("base");
    for p in [greedy(12, "a", ""), greedy(12, "a", &id)] {
        let want = reference.generate(prompt.clone(), p.clone(), |_| {}).unwrap().token_ids;
        let got = decode(&mut c, &prompt, &p, 0, None).await.expect("under the adapter");
        assert_eq!(got, want);
        assert_ne!(got, base, "the adapter changes the output");
    }
    assert_all_free(&mut c).await;
}

fn destination(info: &WorkerInfo, kind: &str, reservation_id: u64, block_ids: Vec<u32>) -> KvDestination {
    let offer = info.transports.iter().find(|o| o.kind == kind).unwrap_or_else(|| panic!("no {kind} offer"));
    let offer = offer_from_wire(offer).expect("an offer of a known transport");
    KvDestination {
        worker_id: info.worker_id.clone(),
        ..KvDestination::for_offer(&offer, reservation_id, block_ids)
    }
}

/// Prefills `prompt` under `params` in `p` and moves its blocks to `dest`, the HELLO naming
/// `adapter_id`; returns the first token, or the transport's refusal.
async fn transfer(
    sender: &KvSender,
    dest: &KvDestination,
    adapter_id: &str,
    p: &mut Engine,
    prompt: &[u32],
    params: &SamplingParams,
) -> Result<u32, String> {
    let mut session = sender.open_for_adapter(dest, adapter_id).await.map_err(|e| e.to_string())?;
    let seq = p.add_prefill_request(prompt.to_vec(), params.clone()).expect("prefill request");
    let mut first = None;
    while first.is_none() {
        for ev in p.step().expect("step") {
            if let SeqEvent::Prefilled { token, .. } = ev {
                first = Some(token);
            }
        }
    }
    let table = p.block_table(seq).expect("held table").to_vec();
    session.stage(p.backend(), &table).expect("stage");
    p.release_prefilled(seq).expect("release prefilled");
    session.finish().await.map_err(|e| e.to_string())?;
    Ok(first.expect("first token"))
}

/// A Reserve for `prompt`'s length under `adapter` (without the prompt: no prefix-cache lookup).
fn reserve_req(request_id: &str, prompt: &[u32], adapter: &str, adapter_id: &str) -> ReserveRequest {
    ReserveRequest {
        request_id: request_id.into(),
        num_tokens: prompt.len() as u32,
        adapter: adapter.into(),
        adapter_id: adapter_id.into(),
        ..Default::default()
    }
}

/// Waits until every block is free again (refused transfers release their reservations a
/// moment after the sender hears it).
async fn eventually_all_free(c: &WorkerClient<Channel>) {
    common::eventually("every block is free", || {
        let mut c = c.clone();
        async move {
            let s = c.stats(StatsRequest { check_invariants: true }).await.expect("Stats").into_inner();
            let kv = s.kv.expect("kv counters");
            s.invariants_ok && kv.free + kv.cached == kv.total && kv.used == 0
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_takes_only_the_transfer_and_decode_of_its_adapter() {
    let w = start(&["--lease-ms", "60000", "--lora", &lora_arg("a"), "--lora", &lora_arg("b")]);
    let mut c = w.client().await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    let id = |n: &str| info.adapters.iter().find(|a| a.name == n).expect("advertised").id.clone();
    let (a, b) = (id("a"), id("b"));
    let mut p = local_engine(&["a", "b"]);
    let mut reference = local_engine(&["a", "b"]);
    let sender = KvSender::new(p.backend().kv_layout(), SenderOptions::default());
    let prompt: Vec<u32> = (1..20).collect();

    // Reserve checks the adapter as a request does.
    let err = c.reserve(reserve_req("x", &prompt, "nope", "")).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
    assert!(err.message().contains("'nope'"), "{err}");
    assert_eq!(tandem_proto::adapter_refusal(&err), Some(tandem_proto::ADAPTER_UNKNOWN), "{err:?}");
    let err = c.reserve(reserve_req("x", &prompt, "a", &b)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert_eq!(tandem_proto::adapter_refusal(&err), Some(tandem_proto::ADAPTER_OTHER_WEIGHTS), "{err:?}");

    for kind in ["tcp", "shm"] {
        let params = greedy(8, "a", "");
        // A transfer under another adapter, or the base model, is refused naming both ids.
        for sent in [b.as_str(), ""] {
            let res = c.reserve(reserve_req("r", &prompt, "a", "")).await.expect("Reserve").into_inner();
            let dest = destination(&info, kind, res.reservation_id, res.block_ids);
            let err = transfer(&sender, &dest, sent, &mut p, &prompt, &params).await.unwrap_err();
            assert!(err.contains(&format!("adapter id {a}")), "{kind}: {err}");
            let named =
                if sent.is_empty() { "the base model".to_owned() } else { format!("adapter id {sent}") };
            assert!(err.contains(&named), "{kind}: {err}");
        }
        eventually_all_free(&c).await;

        // Under its own adapter it fills, and decodes as one process would.
        let want = reference.generate(prompt.clone(), params.clone(), |_| {}).unwrap().token_ids;
        let res = c.reserve(reserve_req("r", &prompt, "a", &a)).await.expect("Reserve").into_inner();
        let dest = destination(&info, kind, res.reservation_id, res.block_ids.clone());
        let first = transfer(&sender, &dest, &a, &mut p, &prompt, &params).await.expect("accepted");
        // A Decode that runs another adapter, or the base model, may not adopt it...
        for other in [greedy(8, "b", ""), greedy(8, "", ""), greedy(8, "a", &b)] {
            let err = decode(&mut c, &prompt, &other, res.reservation_id, Some(first)).await.unwrap_err();
            assert_eq!(err.code(), Code::FailedPrecondition, "{kind}: {err}");
            assert!(err.message().contains(&a), "{kind}: {err}");
            // The reservation's refusal, not the worker lacking the adapter: no mark.
            assert_eq!(tandem_proto::adapter_refusal(&err), None, "{kind}: {err:?}");
        }
        // ...and the one it was made for does.
        let rest = decode(&mut c, &prompt, &params, res.reservation_id, Some(first)).await.expect("Decode");
        let mut got = vec![first];
        got.extend(rest);
        assert_eq!(got, want, "{kind}");
        assert_all_free(&mut c).await;
    }
}

/// A Reserve with the prompt looks its cached blocks up under the adapter's salt: blocks a
/// request under `a` left are found under `a`, never under `b` or the base model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_find_cached_blocks_only_under_their_adapter() {
    let w = start(&["--lease-ms", "60000", "--lora", &lora_arg("a"), "--lora", &lora_arg("b")]);
    let mut c = w.client().await;
    let prompt: Vec<u32> = (1..20).collect();
    decode(&mut c, &prompt, &greedy(4, "a", ""), 0, None).await.expect("a whole request under a");
    let with_prompt = |adapter: &str| ReserveRequest {
        prompt_token_ids: prompt.clone(),
        ..reserve_req("cached", &prompt, adapter, "")
    };
    for (adapter, hit) in [("a", true), ("b", false), ("", false)] {
        let res = c.reserve(with_prompt(adapter)).await.expect("Reserve").into_inner();
        assert_eq!(res.cached_blocks > 0, hit, "under {adapter:?}: {res:?}");
        let rel =
            tandem_proto::v1::ReleaseRequest { reservation_id: res.reservation_id, ..Default::default() };
        assert!(c.release(rel).await.unwrap().into_inner().released);
    }
    eventually_all_free(&c).await;
}
