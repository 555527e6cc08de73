//! LoRA adapters through a disaggregated `tandem up` cluster (router, prefill worker, decode
//! worker) on the tiny Llama fixture, with the PEFT adapters `tests/reference/make_lora_fixtures.py`
//! made:
//!
//! - three adapters (two slots per worker, so sequences wait for a slot) and the base model,
//!   every reference prompt of each at once, streamed over gRPC: each gets transformers + PEFT's
//!   greedy tokens; run again, the prefix cache serves the repeats and the tokens are the same;
//!   then every worker is quiescent;
//! - with the `openai` package: `/v1/models` lists the base and each adapter, a request naming an
//!   adapter is served under it and an unknown name is a 404; the admin API (plain HTTP) refuses
//!   a call without the admin key, loads an adapter at run time on every worker while streams run
//!   (none is dropped), lists it, serves it, and unloads it.
//!
//! The Python side is `tests/e2e/py/lora_client.py`; that test skips with a message when
//! `TANDEM_PYTHON` is unset, unless `TANDEM_REQUIRE_EXTERNAL=1`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_e2e::up::{start_up_on, worker_stats};
use tandem_e2e::*;
use tandem_proto::v1;

const ADMIN_KEY: &str = "lora-admin-key-0123456789";

fn fixtures() -> PathBuf {
    workspace_root().join("tests/reference/fixtures")
}

fn adapter_dir(name: &str) -> PathBuf {
    fixtures().join("lora/llama-gqa").join(name)
}

/// One reference prompt: its ids and the reference's greedy tokens.
struct RefPrompt {
    ids: Vec<u32>,
    greedy: Vec<u32>,
    eos: bool,
}

fn references(dir: &Path) -> Vec<RefPrompt> {
    let path = dir.join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).expect("reference json");
    let ids = |x: &Value| -> Vec<u32> {
        x.as_array().expect("ids").iter().map(|t| t.as_u64().expect("id") as u32).collect()
    };
    v["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| RefPrompt {
            ids: ids(&p["prompt_ids"]),
            greedy: ids(&p["greedy_ids"]),
            eos: p["stopped_at_eos"].as_bool().unwrap_or(false),
        })
        .collect()
}

fn request(model: &str, ids: &[u32], max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids: ids.to_vec() })),
        max_tokens: Some(max_tokens),
        model: model.into(),
        sampling: Some(v1::SamplingParams { temperature: Some(0.0), ..Default::default() }),
        ..Default::default()
    }
}

/// Health's view of the cluster: the worker addresses.
fn worker_addrs(router: SocketAddr) -> Vec<SocketAddr> {
    let h = block_on(async {
        let mut c = v1::tandem_client::TandemClient::new(channel(router).await.expect("router"));
        c.health(v1::HealthRequest {}).await.expect("Health").into_inner()
    });
    h.workers.iter().map(|w| w.address.parse().expect("worker address")).collect()
}

/// Polls every worker until each is quiescent (allocator checked).
fn assert_quiescent(workers: &[SocketAddr]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats: Vec<v1::StatsResponse> =
            workers.iter().map(|&w| block_on(worker_stats(w, true)).expect("Stats")).collect();
        for (w, st) in workers.iter().zip(&stats) {
            assert!(st.invariants_checked && st.invariants_ok, "{w}: {}", st.invariant_error);
        }
        if stats.iter().all(is_quiescent) {
            return;
        }
        assert!(Instant::now() < deadline, "workers not quiescent: {stats:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn stop(mut up: Proc) {
    up.signal(libc::SIGINT);
    let st = up.wait_exit(Duration::from_secs(60)).expect("tandem up stops");
    assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(4000));
}

#[test]
fn peft_adapters_mixed_through_a_disaggregated_cluster_give_peft_tokens() {
    let model = fixtures().join("llama-gqa");
    let lora: Vec<String> =
        ["a", "b", "c"].iter().map(|n| format!("{n}={}", adapter_dir(n).display())).collect();
    let mut flags = vec!["--kv-dtype", "f32", "--max-loras", "2", "--block-size", "8"];
    for l in &lora {
        flags.extend(["--lora", l.as_str()]);
    }
    let (up, ready) = start_up_on(&model, &flags);
    let workers = worker_addrs(ready.router);
    assert_eq!(workers.len(), 2, "a prefill and a decode worker");

    // (model, prompt) pairs with PEFT's tokens: each adapter's prompts, and the base's.
    let mut cases: Vec<(String, RefPrompt)> = Vec::new();
    for name in ["a", "b", "c"] {
        cases.extend(references(&adapter_dir(name)).into_iter().map(|p| (name.to_string(), p)));
    }
    cases.extend(references(&model).into_iter().take(3).map(|p| (String::new(), p)));
    let mut kinds: Vec<&str> = cases.iter().map(|(m, _)| m.as_str()).collect();
    kinds.dedup();
    assert_eq!(kinds.len(), 4, "three adapters and the base");

    for round in 0..2 {
        let got: Vec<Result<Completion, tonic::Status>> = block_on(async {
            let tasks: Vec<_> = cases
                .iter()
                .map(|(m, p)| {
                    let n = if p.eos { p.greedy.len() as u32 + 4 } else { p.greedy.len() as u32 };
                    tokio::spawn(generate(ready.router, request(m, &p.ids, n)))
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.expect("task"));
            }
            out
        });
        for ((m, p), g) in cases.iter().zip(got) {
            let g = g.unwrap_or_else(|e| panic!("round {round}, model '{m}': {e}\n{}", up.log_tail(4000)));
            let want: Vec<u32> =
                if p.eos { p.greedy[..p.greedy.len() - 1].to_vec() } else { p.greedy.clone() };
            assert_eq!(
                g.token_ids[..want.len().min(g.token_ids.len())],
                want[..],
                "round {round}: model '{m}', prompt of {} tokens: the cluster's tokens differ from PEFT's",
                p.ids.len()
            );
        }
    }
    // The repeats hit the prefix cache, under their own adapters only (else tokens would differ).
    let d = block_on(worker_stats(workers[1], false)).expect("Stats");
    let p = block_on(worker_stats(workers[0], false)).expect("Stats");
    let hits = |s: &v1::StatsResponse| s.prefix_cache.as_ref().map_or(0, |c| c.hit_tokens);
    assert!(hits(&d) + hits(&p) > 0, "the second round found nothing in the prefix cache");
    assert_quiescent(&workers);
    stop(up);
}

fn lora_client(python: &Path, http: SocketAddr, args: &[String]) -> Value {
    let mut all = vec![format!("http://{http}/v1")];
    all.extend(args.iter().cloned());
    run_py_json(python, "lora_client.py", &all, Duration::from_secs(600))
}

/// An admin call over plain HTTP: its status and body.
fn admin(
    http: SocketAddr,
    method: &str,
    path: &str,
    body: Option<Value>,
    key: Option<&str>,
) -> (u16, String) {
    let body = body.map(|b| b.to_string());
    http_request(http, method, path, body.as_deref(), key)
        .unwrap_or_else(|| panic!("{method} {path}: no answer"))
}

#[test]
fn openai_package_names_adapters_and_the_admin_api_loads_one_while_streams_run() {
    let test = "openai_package_names_adapters_and_the_admin_api_loads_one_while_streams_run";
    let Some(python) = external_python(test) else { return };
    let model = fixtures().join("llama-gqa");
    let a = format!("a={}", adapter_dir("a").display());
    let (up, ready) = start_up_on(&model, &["--lora", &a, "--max-loras", "2", "--admin-key", ADMIN_KEY]);
    let http = ready.http.expect("an http address");
    let workers = worker_addrs(ready.router);
    let prompts: Vec<Vec<u32>> = references(&adapter_dir("b")).into_iter().map(|p| p.ids).collect();

    // The admin API: closed without the key, and the API key (none here) opens nothing.
    let r = admin(http, "GET", "/v1/lora_adapters", None, None);
    assert_eq!(r.0, 401, "{r:?}");
    let r = admin(http, "GET", "/v1/lora_adapters", None, Some("wrong-key"));
    assert_eq!(r.0, 401, "{r:?}");

    // Streams under the adapter and the base run while `b` is loaded.
    let long = 400u32;
    let streams = std::thread::spawn({
        let router = ready.router;
        let prompts = prompts.clone();
        move || {
            block_on(async move {
                let tasks: Vec<_> = (0..6)
                    .map(|i| {
                        let m = if i % 2 == 0 { "a" } else { "" };
                        let req = v1::GenerateRequest {
                            ignore_eos: true,
                            ..request(m, &prompts[i % prompts.len()], long)
                        };
                        tokio::spawn(async move { (generate(router, req).await, Instant::now()) })
                    })
                    .collect();
                let mut out = Vec::new();
                for t in tasks {
                    out.push(t.await.expect("task"));
                }
                out
            })
        }
    });
    // Load once the streams produce tokens (a Health poll is cheap; the first tokens come fast).
    std::thread::sleep(Duration::from_millis(100));
    let body = serde_json::json!({"lora_name": "b", "lora_path": adapter_dir("b").display().to_string()});
    let r = admin(http, "POST", "/v1/load_lora_adapter", Some(body), Some(ADMIN_KEY));
    assert_eq!(r.0, 200, "loading b: {r:?}");
    let loaded = Instant::now();
    let done = streams.join().expect("streams");
    let last = done.iter().map(|(_, at)| *at).max().expect("streams");
    assert!(last > loaded, "every stream ended before the load returned: the test loaded nothing under load");
    for (i, (c, _)) in done.into_iter().enumerate() {
        let c = c.unwrap_or_else(|e| panic!("stream {i} dropped while an adapter loaded: {e}"));
        assert_eq!(c.token_ids.len(), long as usize, "stream {i} ended early ({:?})", c.finish_reason);
    }
    let (status, text) = admin(http, "GET", "/v1/lora_adapters", None, Some(ADMIN_KEY));
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("\"b\"") && text.contains("\"a\""), "{text}");

    // The openai package: models, a request under `b` and one under the base, an unknown model.
    let plan: Vec<Value> = prompts
        .iter()
        .flat_map(|p| {
            ["b", "a"]
                .map(|m| serde_json::json!({"model": m, "prompt": p, "max_tokens": 12, "stream": m == "b"}))
        })
        .collect();
    let file = std::env::temp_dir().join(format!("tandem-lora-plan-{}.json", std::process::id()));
    std::fs::write(&file, serde_json::to_string(&plan).unwrap()).unwrap();
    let out = lora_client(
        &python,
        http,
        &["--plan".into(), file.display().to_string(), "--concurrency".into(), "4".into()],
    );
    let ids: Vec<&str> =
        out["models"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert!(ids.contains(&"a") && ids.contains(&"b") && ids.len() == 3, "models listed: {ids:?}");
    assert!(out["unknown_model_error"].as_str().unwrap().contains("no-such-adapter"), "{out}");
    // Each answer is what gRPC gives the same request under the same adapter.
    for (i, (req, res)) in plan.iter().zip(out["results"].as_array().unwrap()).enumerate() {
        let m = req["model"].as_str().unwrap();
        let want = block_on(generate(ready.router, request(m, &prompts[i / 2], 12))).expect("gRPC");
        assert_eq!(res["text"].as_str().unwrap(), want.text, "request {i} under '{m}'");
        assert_eq!(res["completion_tokens"].as_u64(), Some(want.token_ids.len() as u64), "request {i}");
    }
    // b and a answer differently for the same prompt.
    let texts = out["results"].as_array().unwrap();
    assert_ne!(texts[0]["text"], texts[1]["text"], "adapters b and a answered alike");

    // Unloaded, `b` is gone for new requests.
    let r = admin(
        http,
        "POST",
        "/v1/unload_lora_adapter",
        Some(serde_json::json!({"lora_name": "b"})),
        Some(ADMIN_KEY),
    );
    assert_eq!(r.0, 200, "{r:?}");
    let gone = block_on(generate(ready.router, request("b", &prompts[0], 4)));
    assert_eq!(gone.expect_err("b was unloaded").code(), tonic::Code::NotFound);
    assert_quiescent(&workers);
    stop(up);
}
