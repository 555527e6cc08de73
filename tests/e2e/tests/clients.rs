//! Clients nobody here wrote, against real clusters on the default model (SmolLM2):
//!
//! - the official `openai` Python package lists the models and makes streaming and
//!   non-streaming chat completions and completions through `tandem up`'s HTTP address; greedy
//!   streamed and non-streamed results are equal, and the router's Prometheus counters (parsed by
//!   `prometheus_client`) move by exactly what the client saw;
//! - `grpcio-health-checking` finds every process SERVING, and a stopped one NOT_SERVING or gone;
//! - every worker's `/metrics` parses and counts the KV transfers, tokens and requests the client
//!   caused, and its KV gauges return to empty;
//! - the `openai` package's tool calls on the default model, whose template renders no tools
//!   (the generic format);
//! - with `--api-key`, the `openai` package without the key gets `AuthenticationError` (401) and
//!   with it succeeds, while health and metrics stay open.
//!
//! The Python side lives in `tests/e2e/py`; these tests skip with a message when
//! `TANDEM_PYTHON` is unset, unless `TANDEM_REQUIRE_EXTERNAL=1`.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tandem_e2e::*;

/// Starts `tandem up` on the default model and waits for its ready line.
fn start_up(model: &Path, extra: &[&str]) -> (Proc, UpReady) {
    let mut args =
        vec!["up".to_string(), "--model".into(), model.display().to_string(), "--threads".into(), "1".into()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let up = Proc::spawn("up", &bin("tandem"), &args);
    let line = up
        .next_line(Duration::from_secs(300))
        .unwrap_or_else(|| panic!("no ready line:\n{}", up.log_tail(4000)));
    let ready = parse_ready(&line)
        .unwrap_or_else(|| panic!("unexpected first line {line:?}:\n{}", up.log_tail(4000)));
    assert!(ready.http.is_some(), "the ready line names no http address: {line:?}");
    (up, ready)
}

fn openai(python: &Path, http: SocketAddr, extra: &[&str]) -> Value {
    let mut args = vec![format!("http://{http}/v1")];
    args.extend(extra.iter().map(|s| s.to_string()));
    run_py_json(python, "openai_client.py", &args, Duration::from_secs(600))
}

fn health(python: &Path, target: SocketAddr, services: &[&str], expect: &str) -> Value {
    let mut args = vec![target.to_string()];
    for s in services {
        args.push("--service".into());
        args.push(s.to_string());
    }
    args.extend(["--expect".into(), expect.into(), "--timeout".into(), "30".into()]);
    run_py_json(python, "health_check.py", &args, Duration::from_secs(90))
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("no number {key:?} in {v}"))
}

/// Every `prefix*` family carries help text (the contract of every metric).
fn assert_documented(m: &Metrics, prefix: &str, who: &str) {
    let ours: Vec<_> = m.families.iter().filter(|(n, _)| n.starts_with(prefix)).collect();
    assert!(!ours.is_empty(), "{who}: no {prefix}* metrics at all");
    for (name, (_, help)) in ours {
        assert!(!help.trim().is_empty(), "{who}: {name} has no HELP text");
    }
}

#[test]
fn openai_package_streams_and_completes_through_tandem_up_and_router_metrics_count_it() {
    let test = "openai_package_streams_and_completes_through_tandem_up_and_router_metrics_count_it";
    let Some(model) = default_model_for_test(test) else { return };
    let Some(python) = external_python(test) else { return };
    let (mut up, ready) = start_up(&model, &[]);
    let http = ready.http.unwrap();
    health(&python, ready.router, &["", "tandem.v1.Tandem"], "serving");

    let before = scrape(&python, http);
    let summary = openai(&python, http, &["--max-tokens", "16"]);
    let after = scrape(&python, http);
    let n = num(&summary, "requests");
    assert_eq!(n, 4.0, "{summary}");
    assert!(!summary["model"].as_str().unwrap_or("").is_empty(), "{summary}");

    let delta = |name: &str, labels: &[(&str, &str)]| after.sum(name, labels) - before.sum(name, labels);
    assert_documented(&after, "tandem_router_", "router");
    assert_eq!(
        delta("tandem_router_requests_total", &[("api", "http"), ("outcome", "ok")]),
        n,
        "HTTP requests counted ok"
    );
    assert_eq!(delta("tandem_router_requests_total", &[("outcome", "error")]), 0.0, "no request failed");
    // The vLLM-named twins count the same, labelled with the served model.
    let model = [("model_name", summary["model"].as_str().unwrap())];
    assert_eq!(delta("vllm:request_success_total", &model), n, "vllm:request_success_total");
    assert_eq!(delta("vllm:time_to_first_token_seconds_count", &model), n);
    assert_eq!(delta("vllm:e2e_request_latency_seconds_count", &model), n);
    assert_eq!(delta("vllm:prompt_tokens_total", &model), num(&summary, "prompt_tokens"));
    assert_eq!(delta("vllm:generation_tokens_total", &model), num(&summary, "completion_tokens"));
    assert_eq!(delta("tandem_router_ttft_seconds_count", &[]), n, "one time-to-first-token per request");
    assert_eq!(delta("tandem_router_e2e_seconds_count", &[]), n, "one end-to-end latency per request");
    assert!(delta("tandem_router_ttft_seconds_sum", &[]) > 0.0, "TTFT sum moved");
    assert_eq!(
        delta("tandem_router_prompt_tokens_total", &[]),
        num(&summary, "prompt_tokens"),
        "prompt tokens = usage"
    );
    assert_eq!(
        delta("tandem_router_generated_tokens_total", &[]),
        num(&summary, "completion_tokens"),
        "generated tokens = usage"
    );
    // Inter-token latencies: one per token after the first, at least one per multi-token reply.
    assert!(delta("tandem_router_inter_token_seconds_count", &[]) > 0.0, "inter-token latency recorded");
    assert_eq!(after.sum("tandem_router_requests_in_flight", &[]), 0.0, "nothing left in flight");
    assert_eq!(after.sum("tandem_router_draining", &[]), 0.0);

    // Tokenize/detokenize, the context-length 400 and a named chat message, through the package
    // and plain HTTP (checked in the script).
    let extras = openai(&python, http, &["--extras"]);
    assert!(num(&extras["tokenize"], "count") > 0.0, "{extras}");
    assert!(extras["context_error"].as_str().is_some_and(|m| m.contains("context length")), "{extras}");
    assert_eq!(extras["choices"]["n"], 3, "{extras}");
    assert!(num(&extras["echo"], "scored") > 0.0, "{extras}");

    // Tool calls on the default model, whose chat template renders no tools: the generic format
    // (required, named and auto, streamed and not, arguments judged by jsonschema, a tool result
    // handed back).
    let tools = openai(&python, http, &["--tools"]);
    assert!(!tools["required"].as_array().unwrap().is_empty(), "{tools}");
    assert_eq!(tools["single"].as_array().map(Vec::len), Some(1), "{tools}");
    assert_eq!(tools["named_streamed"][0]["name"], "add", "{tools}");
    assert_eq!(tools["loop"]["call"], "get_weather", "{tools}");

    up.signal(libc::SIGTERM);
    let st = up
        .wait_exit(Duration::from_secs(90))
        .unwrap_or_else(|| panic!("tandem up did not stop:\n{}", up.log_tail(4000)));
    assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(4000));
    health(&python, ready.router, &["", "tandem.v1.Tandem"], "down");
}

/// Structured output through the openai package on a disaggregated `tandem up`, every answer
/// judged by pydantic and `jsonschema` (in the script); then the same requests on a cluster that
/// speculates (n-gram drafts) give the same documents, greedy and seeded.
#[test]
fn structured_output_through_the_openai_package_with_and_without_speculation() {
    let test = "structured_output_through_the_openai_package_with_and_without_speculation";
    let Some(model) = default_model_for_test(test) else { return };
    let Some(python) = external_python(test) else { return };
    let mut runs = Vec::new();
    for flags in [&[][..], &["--speculate", "ngram", "--spec-tokens", "4"][..]] {
        let (mut up, ready) = start_up(&model, flags);
        let summary = openai(&python, ready.http.unwrap(), &["--structured"]);
        assert!(summary["bad_schema"].as_str().is_some_and(|m| m.contains("json_schema")), "{summary}");
        assert_eq!(summary["parsed"]["greedy"]["city"], "Paris", "{summary}");
        up.signal(libc::SIGTERM);
        let st = up
            .wait_exit(Duration::from_secs(90))
            .unwrap_or_else(|| panic!("tandem up did not stop:\n{}", up.log_tail(4000)));
        assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(4000));
        runs.push(summary);
    }
    assert_eq!(runs[0], runs[1], "speculation changed a constrained answer");
}

/// Tool calling through the openai package on a disaggregated `tandem up` serving a tiny fixture
/// model whose chat template renders tools in the Hermes style (random weights: every forced call
/// is the grammar's doing). Required, named and auto choices, streamed and not, an agent-style
/// loop, and the calls' arguments judged by `jsonschema` (in the script).
#[test]
fn tool_calls_through_the_openai_package() {
    let test = "tool_calls_through_the_openai_package";
    let Some(python) = external_python(test) else { return };
    let fixture = workspace_root().join("tests/reference/fixtures/llama-gqa");
    let dir = std::env::temp_dir().join(format!("tandem-e2e-tools-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().is_some_and(|n| n != "chat_template.jinja") {
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    std::fs::copy(
        workspace_root().join("tests/reference/templates/tools-hermes.jinja"),
        dir.join("chat_template.jinja"),
    )
    .unwrap();
    // Tool definitions take room: a longer context (the weights do not care).
    let config = dir.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    cfg["max_position_embeddings"] = 4096.into();
    std::fs::write(&config, cfg.to_string()).unwrap();
    let (mut up, ready) = start_up(&dir, &[]);
    let summary = openai(&python, ready.http.unwrap(), &["--tools"]);
    assert!(!summary["required"].as_array().unwrap().is_empty(), "{summary}");
    assert_eq!(summary["named_streamed"][0]["name"], "add", "{summary}");
    assert_eq!(summary["loop"]["call"], "get_weather", "{summary}");
    up.signal(libc::SIGTERM);
    let st = up.wait_exit(Duration::from_secs(90)).unwrap_or_else(|| panic!("tandem up did not stop"));
    assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(4000));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn workers_serve_metrics_and_health_to_standard_clients() {
    let test = "workers_serve_metrics_and_health_to_standard_clients";
    let Some(model) = default_model_for_test(test) else { return };
    let Some(python) = external_python(test) else { return };
    let mut spec = ClusterSpec::new(model, "tcp");
    spec.threads = 1;
    let mut cluster = Cluster::start(spec.clone());
    let router_http = cluster.router.http.expect("the router's listening line names its http address");
    let prefill_http =
        cluster.prefill[0].http.expect("the prefill worker's listening line names its http address");
    let decode_http =
        cluster.decode[0].http.expect("the decode worker's listening line names its http address");

    health(&python, cluster.router.addr(), &["", "tandem.v1.Tandem"], "serving");
    for w in cluster.workers() {
        health(&python, w.addr(), &[""], "serving");
    }
    for (who, addr) in [("router", router_http), ("prefill", prefill_http), ("decode", decode_http)] {
        for path in ["/health", "/ready"] {
            let got = http_get(addr, path);
            assert_eq!(got.as_ref().map(|g| g.0), Some(200), "{who} {path}: {got:?}");
        }
    }

    let before_p = scrape(&python, prefill_http);
    let before_d = scrape(&python, decode_http);
    let summary = openai(&python, router_http, &["--max-tokens", "12"]);
    let n = num(&summary, "requests");
    cluster.assert_quiescent(Duration::from_secs(30));
    let after_p = scrape(&python, prefill_http);
    let after_d = scrape(&python, decode_http);
    let after_r = scrape(&python, router_http);

    for (who, m) in [("prefill", &after_p), ("decode", &after_d)] {
        assert_documented(m, "tandem_worker_", who);
        assert_eq!(m.sum("tandem_worker_ready", &[]), 1.0, "{who} ready gauge");
        assert_eq!(m.sum("tandem_worker_draining", &[]), 0.0, "{who} draining gauge");
        assert_eq!(m.sum("tandem_worker_kv_blocks_used", &[]), 0.0, "{who}: every block free again");
        assert_eq!(m.sum("tandem_worker_kv_blocks_capacity", &[]), spec.kv_blocks as f64, "{who} capacity");
        // The prefix cache keeps the finished requests' full blocks: free or cached, none used.
        assert_eq!(
            m.sum("tandem_worker_kv_blocks_free", &[]) + m.sum("tandem_worker_prefix_cache_blocks", &[]),
            spec.kv_blocks as f64,
            "{who} free + cached"
        );
        assert_eq!(m.sum("tandem_worker_running_sequences", &[]), 0.0, "{who}");
        assert_eq!(m.sum("tandem_worker_reservations", &[]), 0.0, "{who}");
        // The vLLM-named twins (docs/vllm-metrics.txt), labelled with the served model.
        let model = [("model_name", summary["model"].as_str().unwrap())];
        for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"] {
            assert_eq!(m.families.get(name).map(|f| f.0.as_str()), Some("gauge"), "{who}: {name}");
            assert!(
                m.samples
                    .iter()
                    .any(|s| s.name == name
                        && s.labels.get("model_name").map(String::as_str) == Some(model[0].1)),
                "{who}: {name} labelled"
            );
        }
        assert_eq!(m.sum("vllm:kv_cache_usage_perc", &model), 0.0, "{who}: no block in use");
        assert_eq!(
            m.sum("vllm:prefix_cache_hits_total", &model),
            m.sum("tandem_worker_prefix_cache_hit_tokens_total", &[]),
            "{who}: prefix hits in tokens"
        );
        assert_eq!(
            m.sum("vllm:prefix_cache_queries_total", &model),
            m.sum("tandem_worker_prefix_cache_lookup_tokens_total", &[]),
            "{who}: prefix queries in tokens"
        );
    }
    let dp = |name: &str, labels: &[(&str, &str)]| after_p.sum(name, labels) - before_p.sum(name, labels);
    let dd = |name: &str, labels: &[(&str, &str)]| after_d.sum(name, labels) - before_d.sum(name, labels);
    // One checked KV transfer per request, counted by the sender and by the receiver.
    let ok_tcp = [("transport", "tcp"), ("outcome", "ok")];
    assert_eq!(dp("tandem_worker_kv_transfers_total", &ok_tcp), n, "prefill (sender) transfers");
    assert_eq!(dd("tandem_worker_kv_transfers_total", &ok_tcp), n, "decode (receiver) transfers");
    assert_eq!(dp("tandem_worker_kv_transfers_total", &[("outcome", "failed")]), 0.0);
    assert_eq!(dd("tandem_worker_kv_transfers_total", &[("outcome", "failed")]), 0.0);
    assert!(dp("tandem_worker_kv_transfer_bytes_total", &[("transport", "tcp")]) > 0.0, "prefill sent bytes");
    assert!(
        dd("tandem_worker_kv_transfer_bytes_total", &[("transport", "tcp")]) > 0.0,
        "decode received bytes"
    );
    assert!(dp("tandem_worker_kv_transfer_seconds_total", &[("transport", "tcp")]) > 0.0);
    // The prefill worker computed every prompt token; the decode worker every token after each
    // request's first (which the prefill worker samples).
    assert!(
        dp("tandem_worker_prefill_tokens_total", &[]) >= num(&summary, "prompt_tokens"),
        "prefill tokens {} < prompt tokens {}",
        dp("tandem_worker_prefill_tokens_total", &[]),
        num(&summary, "prompt_tokens")
    );
    let decoded = dd("tandem_worker_decode_tokens_total", &[]);
    assert!(
        decoded > 0.0 && decoded >= num(&summary, "completion_tokens") - n,
        "decode tokens {decoded}: {summary}"
    );
    assert!(
        dp("tandem_worker_engine_steps_total", &[]) > 0.0
            && dd("tandem_worker_engine_steps_total", &[]) > 0.0
    );
    assert!(dp("tandem_worker_requests_total", &[("outcome", "ok")]) >= n, "prefill requests");
    assert!(dd("tandem_worker_requests_total", &[("outcome", "ok")]) >= n, "decode requests");
    // The router sees both workers serving.
    assert_eq!(after_r.sum("tandem_router_workers", &[("role", "prefill"), ("state", "serving")]), 1.0);
    assert_eq!(after_r.sum("tandem_router_workers", &[("role", "decode"), ("state", "serving")]), 1.0);

    // A stopped worker: health turns NOT_SERVING (or the worker is gone), /ready is no longer 200.
    let decode_grpc = cluster.decode[0].addr();
    cluster.decode[0].signal(libc::SIGTERM);
    health(&python, decode_grpc, &[""], "down");
    let ready = http_get(decode_http, "/ready");
    assert!(ready.as_ref().is_none_or(|r| r.0 == 503), "/ready of a stopped worker: {ready:?}");
    let st = cluster.decode[0]
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("decode worker did not exit:\n{}", cluster.logs()));
    assert!(st.success(), "decode worker exited with {st}:\n{}", cluster.logs());
}

#[test]
fn api_key_guards_the_openai_api_but_not_health_or_metrics() {
    let test = "api_key_guards_the_openai_api_but_not_health_or_metrics";
    let Some(model) = default_model_for_test(test) else { return };
    let Some(python) = external_python(test) else { return };
    let key = format!("test-key-{}", rand::random::<u64>());
    let (mut up, ready) = start_up(&model, &["--api-key", &key]);
    let http = ready.http.unwrap();

    // Health and metrics need no key.
    health(&python, ready.router, &["", "tandem.v1.Tandem"], "serving");
    let before = scrape(&python, http);

    // The package's default (a dummy key) and a wrong key are refused with 401.
    let refused = openai(&python, http, &["--expect-auth-error"]);
    assert_eq!(num(&refused, "refused"), 2.0, "{refused}");
    let refused = openai(&python, http, &["--expect-auth-error", "--api-key", "wrong"]);
    assert_eq!(num(&refused, "refused"), 2.0, "{refused}");
    // The right key works.
    let ok = openai(&python, http, &["--api-key", &key, "--max-tokens", "8"]);
    assert_eq!(num(&ok, "requests"), 4.0, "{ok}");

    let after = scrape(&python, http);
    let delta = |name: &str, labels: &[(&str, &str)]| after.sum(name, labels) - before.sum(name, labels);
    assert!(
        delta("tandem_router_errors_total", &[("kind", "unauthenticated")]) >= 2.0,
        "refusals are counted"
    );
    assert_eq!(delta("tandem_router_requests_total", &[("api", "http"), ("outcome", "ok")]), 4.0);

    up.signal(libc::SIGTERM);
    let st = up
        .wait_exit(Duration::from_secs(90))
        .unwrap_or_else(|| panic!("tandem up did not stop:\n{}", up.log_tail(4000)));
    assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(4000));
}
