//! LoRA adapters through the router, against the real router binary and fake workers: the
//! models list (the served model and each adapter the workers hold), a request naming an adapter
//! (it reaches only workers holding it, with the adapter's name and id), an unknown model (404
//! naming it on every HTTP API, NOT_FOUND over gRPC), heartbeats that change what a worker holds,
//! and the admin API (its own key; load on every worker, list, unload; a partial failure).

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tandem_proto::v1::registry_client::RegistryClient;
use tandem_proto::v1::{self, AdapterInfo, Role};
use tandem_serve::identity::model_identity;

/// Tokens the fakes generate: ordinary vocabulary entries of the tiny model (no EOS).
const SCRIPT: [u32; 10] = [300, 301, 302, 303, 304, 305, 306, 307, 308, 309];
/// Longest wait for any one HTTP exchange.
const WAIT: Duration = Duration::from_secs(30);
const JSON: (&str, &str) = ("content-type", "application/json");
const ADMIN_KEY: &str = "sk-admin-42";
const API_KEY: &str = "sk-api-7";

/// The name the router serves the tiny model under.
fn model_name() -> String {
    model_identity(&tiny_model()).unwrap().model_name
}

struct Cluster {
    router: RouterProc,
    http: SocketAddr,
    /// By id: `p-1`, then the decode workers `d-1`, `d-2`, ...
    workers: Vec<FakeWorker>,
}

impl Cluster {
    fn worker(&self, id: &str) -> &FakeWorker {
        self.workers.iter().find(|w| w.0.info.lock().unwrap().worker_id == id).expect("a worker of that id")
    }

    async fn registry(&self) -> RegistryClient<tonic::transport::Channel> {
        RegistryClient::new(self.router.channel().await)
    }
}

/// A router with `extra` flags, a fake prefill worker `p-1` holding `prefill` and a fake decode
/// worker `d-<i+1>` holding `decode[i]` for each entry, each with room for 4 adapters, registered
/// in that order.
async fn cluster(extra: &[&str], prefill: Vec<AdapterInfo>, decode: Vec<Vec<AdapterInfo>>) -> Cluster {
    let mut args = vec!["--heartbeat-ms", "60000", "--http-listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let router = RouterProc::start(&args);
    let http = router.http.expect("the router announces its HTTP address");
    let addr = "127.0.0.1:1".parse().unwrap();
    let mut workers =
        vec![FakeWorker::new(worker_info("p-1", Role::Prefill, addr, 16), SCRIPT.to_vec(), None)];
    workers[0].hold(prefill, 4);
    for (i, held) in decode.into_iter().enumerate() {
        let id = format!("d-{}", i + 1);
        let w = FakeWorker::new(worker_info(&id, Role::Decode, addr, 16), SCRIPT.to_vec(), None);
        w.hold(held, 4);
        workers.push(w);
    }
    let mut reg = RegistryClient::new(router.channel().await);
    for w in &workers {
        let served = serve(w.clone()).await.to_string();
        w.0.info.lock().unwrap().address = served;
        let info = w.0.info.lock().unwrap().clone();
        reg.register(info).await.expect("registration");
    }
    Cluster { router, http, workers }
}

/// An HTTP/1.1 exchange on a fresh connection: the status and the body.
async fn call_text(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (StatusCode, String) {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connecting to the router's HTTP server");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("HTTP handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::builder().method(method).uri(path).header(header::HOST, addr.to_string());
    if body.is_some() {
        req = req.header(JSON.0, JSON.1);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let bytes = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
    let req = req.body(Full::new(Bytes::from(bytes))).unwrap();
    let resp = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("no answer in time")
        .expect("the request failed");
    let (parts, body) = resp.into_parts();
    let bytes =
        tokio::time::timeout(WAIT, body.collect()).await.expect("body in time").expect("body").to_bytes();
    (parts.status, String::from_utf8(bytes.to_vec()).expect("UTF-8 body"))
}

/// [`call_text`] of an answer in JSON, parsed.
async fn call(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (StatusCode, Value) {
    let (status, text) = call_text(addr, method, path, headers, body).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("answer is not JSON ({e}): {text:?}"));
    (status, v)
}

async fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> (StatusCode, Value) {
    call(addr, Method::POST, path, headers, Some(body)).await
}

async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (StatusCode, Value) {
    call(addr, Method::GET, path, headers, None).await
}

fn bearer(key: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {key}"))
}

fn completion(model: &str) -> Value {
    json!({"model": model, "prompt": [10, 11, 12], "max_tokens": 3})
}

fn error_message(v: &Value) -> String {
    v["error"]["message"].as_str().unwrap_or_else(|| panic!("no error message in {v}")).to_owned()
}

/// Whether `w` was sent any `Reserve`, `Prefill` or `Decode`.
fn ran_anything(w: &FakeWorker) -> bool {
    !w.adapter_fields().is_empty()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_lists_the_served_model_and_each_adapter_the_workers_hold() {
    let sql = fake_adapter("sql", "/lora/sql");
    let poem = fake_adapter("poem", "/lora/poem");
    let c = cluster(&[], vec![sql.clone()], vec![vec![poem.clone(), sql.clone()], vec![]]).await;
    let base = model_name();
    let (status, v) = get(c.http, "/v1/models", &[]).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [base.as_str(), "poem", "sql"], "the base model first, then each adapter once: {v}");
    assert_eq!(v["data"][0]["parent"], Value::Null);
    for m in &v["data"].as_array().unwrap()[1..] {
        assert_eq!(
            (&m["object"], &m["parent"], &m["root"]),
            (&json!("model"), &json!(base), &json!(base)),
            "{m}"
        );
    }
    let (status, v) = get(c.http, "/v1/models/sql", &[]).await;
    assert_eq!((status, &v["id"], &v["parent"]), (StatusCode::OK, &json!("sql"), &json!(base)), "{v}");
    let (status, v) = get(c.http, "/v1/models/prose", &[]).await;
    assert_eq!((status, &v["error"]["code"]), (StatusCode::NOT_FOUND, &json!("model_not_found")), "{v}");
    assert!(error_message(&v).contains("prose"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_naming_an_adapter_reaches_only_workers_holding_it_with_its_name_and_id() {
    let sql = fake_adapter("sql", "/lora/sql");
    // d-1 holds no adapter and would win a base request's tie (lowest id); d-2 holds "sql".
    let c = cluster(&[], vec![sql.clone()], vec![vec![], vec![sql.clone()]]).await;
    let (p1, d1, d2) = (c.worker("p-1"), c.worker("d-1"), c.worker("d-2"));

    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["model"], "sql", "the answer names the adapter it ran: {v}");
    let expect = |call: &str| (call.to_owned(), "sql".to_owned(), sql.id.clone());
    assert_eq!(d2.adapter_fields(), vec![expect("Reserve"), expect("Decode")]);
    assert_eq!(p1.adapter_fields(), vec![expect("Prefill")]);
    assert!(!ran_anything(d1), "d-1 does not hold the adapter: {:?}", d1.adapter_fields());

    // Chat completions and the Messages API name it the same way; the answer echoes it.
    let chat = json!({"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, v) = post(c.http, "/v1/chat/completions", &[], &chat).await;
    assert_eq!((status, &v["model"]), (StatusCode::OK, &json!("sql")), "{v}");
    let (status, v) = post(c.http, "/v1/messages", &[], &chat).await;
    assert_eq!((status, &v["model"]), (StatusCode::OK, &json!("sql")), "{v}");
    assert!(!ran_anything(d1), "{:?}", d1.adapter_fields());
    assert_eq!(d2.adapter_fields().iter().filter(|f| f.0 == "Decode").count(), 3);

    // gRPC names it in `model` too.
    let req = v1::GenerateRequest { model: "sql".into(), ..token_prompt(vec![10, 11, 12], 3) };
    let out = generate(c.router.channel().await, req).await.expect("generate under the adapter");
    assert_eq!(out.token_ids, SCRIPT[..3]);
    assert!(!ran_anything(d1));
    assert!(d2.adapter_fields().iter().all(|(_, a, id)| a == "sql" && *id == sql.id));

    // The base model, by its name (HTTP) or its id or nothing (gRPC), runs with no adapter, and
    // may go to d-1.
    let (status, v) = post(c.http, "/v1/completions", &[], &completion(&model_name())).await;
    assert_eq!((status, &v["model"]), (StatusCode::OK, &json!(model_name())), "{v}");
    for model in [String::new(), tiny_model_id()] {
        let req = v1::GenerateRequest { model, ..token_prompt(vec![10, 11, 12], 3) };
        generate(c.router.channel().await, req).await.expect("generate on the base model");
    }
    let base: Vec<_> = d1.adapter_fields();
    assert!(!base.is_empty(), "the base model's requests go by load: d-1 has more free blocks");
    assert!(base.iter().all(|(_, a, id)| a.is_empty() && id.is_empty()), "{base:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_model_is_a_404_naming_it_over_http_and_not_found_over_grpc() {
    let sql = fake_adapter("sql", "/lora/sql");
    let c = cluster(&[], vec![sql.clone()], vec![vec![sql]]).await;
    let chat = json!({"model": "nope-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/responses"] {
        let body = match path {
            "/v1/completions" => completion("nope-7b"),
            "/v1/responses" => json!({"model": "nope-7b", "input": "hi"}),
            _ => chat.clone(),
        };
        let (status, v) = post(c.http, path, &[], &body).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {v}");
        assert_eq!(v["error"]["code"], "model_not_found", "{path}: {v}");
        assert_eq!(v["error"]["param"], "model", "{path}: {v}");
        assert!(error_message(&v).contains("`nope-7b`"), "{path}: {v}");
    }
    // Anthropic's shape on the Messages API.
    let (status, v) = post(c.http, "/v1/messages", &[], &chat).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!((&v["type"], &v["error"]["type"]), (&json!("error"), &json!("not_found_error")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("`nope-7b`"), "{v}");

    let req = v1::GenerateRequest { model: "nope-7b".into(), ..token_prompt(vec![10, 11], 2) };
    let err = generate(c.router.channel().await, req).await.expect_err("an unknown model");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    assert!(err.message().contains("`nope-7b`") && err.message().contains(&model_name()), "{err:?}");
    for w in &c.workers {
        assert!(!ran_anything(w), "nothing ran: {:?}", w.adapter_fields());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_is_off_without_an_admin_key_and_needs_its_own_key() {
    let load = json!({"lora_name": "sql", "lora_path": "/lora/sql"});
    let unload = json!({"lora_name": "sql"});

    let off = cluster(&["--api-key", API_KEY], vec![], vec![vec![]]).await;
    let api = bearer(API_KEY);
    let auth = [(api.0, api.1.as_str())];
    for (method, path, body) in [
        (Method::POST, "/v1/load_lora_adapter", Some(&load)),
        (Method::POST, "/v1/unload_lora_adapter", Some(&unload)),
        (Method::GET, "/v1/lora_adapters", None),
    ] {
        let (status, v) = call(off.http, method, path, &auth, body).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{path}: {v}");
        assert!(error_message(&v).contains("--admin-key"), "{path}: {v}");
    }
    assert!(off.workers.iter().all(|w| w.adapter_calls().is_empty()));

    let c = cluster(&["--api-key", API_KEY, "--admin-key", ADMIN_KEY], vec![], vec![vec![]]).await;
    let wrong = bearer("sk-guess");
    let refusals: [&[(&str, &str)]; 4] =
        [&[], &[(api.0, api.1.as_str())], &[(wrong.0, wrong.1.as_str())], &[("x-api-key", ADMIN_KEY)]];
    for headers in refusals {
        let (status, v) = post(c.http, "/v1/load_lora_adapter", headers, &load).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{headers:?}: {v}");
        assert_eq!(v["error"]["code"], "invalid_admin_key", "{v}");
        let (status, _) = get(c.http, "/v1/lora_adapters", headers).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{headers:?}");
    }
    assert!(c.workers.iter().all(|w| w.adapter_calls().is_empty()), "no worker was asked anything");
    // The admin key opens the admin API only; the API key still opens the rest.
    let admin = bearer(ADMIN_KEY);
    let (status, v) = get(c.http, "/v1/lora_adapters", &[(admin.0, admin.1.as_str())]).await;
    assert_eq!((status, &v["object"]), (StatusCode::OK, &json!("list")), "{v}");
    let (status, _) = get(c.http, "/v1/models", &[(admin.0, admin.1.as_str())]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = get(c.http, "/v1/models", &auth).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaded_adapter_is_on_every_worker_listed_and_usable_at_once_then_unloaded() {
    let c = cluster(&["--admin-key", ADMIN_KEY], vec![], vec![vec![], vec![]]).await;
    let admin = bearer(ADMIN_KEY);
    let auth = [(admin.0, admin.1.as_str())];
    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "not loaded yet: {v}");

    // The served model's name is not an adapter's.
    let (status, v) =
        post(c.http, "/v1/load_lora_adapter", &auth, &json!({"lora_name": model_name(), "lora_path": "/x"}))
            .await;
    assert_eq!((status, &v["error"]["param"]), (StatusCode::BAD_REQUEST, &json!("lora_name")), "{v}");

    let body = json!({"lora_name": "sql", "lora_path": "/lora/sql"});
    let (status, v) = post(c.http, "/v1/load_lora_adapter", &auth, &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let id = fake_adapter("sql", "/lora/sql").id;
    assert_eq!(v["id"], id);
    assert_eq!(v["workers"].as_array().map(Vec::len), Some(3), "{v}");
    for w in &c.workers {
        assert_eq!(w.adapter_calls(), ["load sql /lora/sql"]);
    }

    // No heartbeat came: the router's view was updated by the call itself.
    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!((status, &v["model"]), (StatusCode::OK, &json!("sql")), "{v}");
    let ran: Vec<_> = c.workers.iter().flat_map(|w| w.adapter_fields()).collect();
    assert_eq!(ran.len(), 3, "Reserve, Prefill, Decode: {ran:?}");
    assert!(ran.iter().all(|(_, a, i)| a == "sql" && *i == id), "{ran:?}");

    let (status, v) = get(c.http, "/v1/lora_adapters", &auth).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!((&v["data"][0]["name"], &v["data"][0]["id"]), (&json!("sql"), &json!(id)), "{v}");
    let holders: Vec<&str> = v["data"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["worker_id"].as_str().unwrap())
        .collect();
    assert_eq!(holders, ["d-1", "d-2", "p-1"], "{v}");
    let (_, models) = get(c.http, "/v1/models", &[]).await;
    assert_eq!(models["data"][1]["id"], "sql", "{models}");

    // Heartbeats read before the unload (they still list the adapter) ...
    let stale: Vec<_> = c.workers.iter().map(|w| w.adapter_heartbeat()).collect();
    let (status, v) = post(c.http, "/v1/unload_lora_adapter", &auth, &json!({"lora_name": "sql"})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    for w in &c.workers {
        assert_eq!(w.adapter_calls(), ["load sql /lora/sql", "unload sql"]);
        assert!(w.adapters().is_empty());
    }
    // ... and arriving after it do not bring the adapter back (their version is older).
    let mut reg = c.registry().await;
    for hb in stale {
        assert!(hb.adapters.iter().any(|a| a.name == "sql"));
        assert!(reg.heartbeat(hb).await.unwrap().into_inner().known);
    }
    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "unloaded: {v}");
    let (_, v) = get(c.http, "/v1/lora_adapters", &auth).await;
    assert_eq!(v["data"], json!([]), "{v}");
    let (status, v) = post(c.http, "/v1/unload_lora_adapter", &auth, &json!({"lora_name": "sql"})).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "no worker holds it any more: {v}");
    assert!(error_message(&v).contains("`sql`"), "{v}");
    // Every admin call is counted by action and outcome; a call without the key is refused.
    let (status, _) = get(c.http, "/v1/lora_adapters", &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (code, m) = call_text(c.http, Method::GET, "/metrics", &[], None).await;
    assert_eq!(code, StatusCode::OK, "{m}");
    let calls = |action: &str, outcome: &str| {
        metric_value(
            &m,
            &format!("tandem_router_admin_calls_total{{action=\"{action}\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(
        (calls("load", "ok"), calls("load", "refused"), calls("load", "failed")),
        (Some(1.0), Some(1.0), Some(0.0))
    );
    assert_eq!((calls("unload", "ok"), calls("unload", "refused")), (Some(1.0), Some(1.0)));
    assert_eq!((calls("list", "ok"), calls("list", "refused")), (Some(2.0), Some(1.0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_that_fails_on_one_worker_names_it_and_leaves_the_adapter_where_it_loaded() {
    let c = cluster(&["--admin-key", ADMIN_KEY, "--prefill-fallback", "fail"], vec![], vec![vec![]]).await;
    let admin = bearer(ADMIN_KEY);
    let auth = [(admin.0, admin.1.as_str())];
    *c.worker("d-1").0.load_error.lock().unwrap() =
        Some((tonic::Code::NotFound, "no adapter_config.json under /lora/sql".into()));
    let body = json!({"lora_name": "sql", "lora_path": "/lora/sql"});
    let (status, v) = post(c.http, "/v1/load_lora_adapter", &auth, &body).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    let msg = error_message(&v);
    for words in ["d-1", "no adapter_config.json", "stays loaded", "p-1"] {
        assert!(msg.contains(words), "`{words}` in {msg}");
    }
    let failed: Vec<&Value> = v["workers"].as_array().unwrap().iter().filter(|w| w["ok"] == false).collect();
    assert_eq!(failed.len(), 1, "{v}");
    assert_eq!(failed[0]["worker_id"], "d-1");

    let (_, v) = get(c.http, "/v1/lora_adapters", &auth).await;
    let holders = v["data"][0]["workers"].as_array().unwrap();
    assert_eq!((holders.len(), &holders[0]["worker_id"]), (1, &json!("p-1")), "{v}");
    // No decode worker holds it: a request for it cannot run, and says why.
    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(error_message(&v).contains("LoRA adapter `sql`"), "{v}");
    assert!(c.workers.iter().all(|w| !ran_anything(w)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_with_adapters_replaces_what_the_router_knew() {
    let c = cluster(&[], vec![], vec![vec![]]).await;
    let mut reg = c.registry().await;
    let sql = fake_adapter("sql", "/lora/sql");
    let listed = |v: &Value| -> Vec<String> {
        v["data"].as_array().unwrap().iter().skip(1).map(|m| m["id"].as_str().unwrap().to_owned()).collect()
    };
    for w in &c.workers {
        w.hold(vec![sql.clone()], 4);
        assert!(reg.heartbeat(w.adapter_heartbeat()).await.unwrap().into_inner().known);
    }
    let (_, v) = get(c.http, "/v1/models", &[]).await;
    assert_eq!(listed(&v), ["sql"], "{v}");
    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // A heartbeat without the flag leaves the list alone (a worker older than adapters).
    let d1 = c.worker("d-1");
    let quiet = v1::HeartbeatRequest { adapters: Vec::new(), adapters_set: false, ..d1.adapter_heartbeat() };
    reg.heartbeat(quiet).await.unwrap();
    let (_, v) = get(c.http, "/v1/models", &[]).await;
    assert_eq!(listed(&v), ["sql"], "{v}");
    // One with the flag and an empty list: it holds none now; no decode worker holds it.
    d1.hold(Vec::new(), 4);
    reg.heartbeat(d1.adapter_heartbeat()).await.unwrap();
    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    c.worker("p-1").hold(Vec::new(), 4);
    reg.heartbeat(c.worker("p-1").adapter_heartbeat()).await.unwrap();
    let (_, v) = get(c.http, "/v1/models", &[]).await;
    assert!(listed(&v).is_empty(), "{v}");
    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_dropped_the_adapter_unannounced_is_not_asked_again() {
    let sql = fake_adapter("sql", "/lora/sql");
    let c = cluster(&[], vec![sql.clone()], vec![vec![sql.clone()]]).await;
    let d1 = c.worker("d-1");
    // d-1 lets the adapter go; no heartbeat tells the router.
    d1.hold(Vec::new(), 4);
    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(error_message(&v).contains("no longer holds the request's LoRA adapter"), "{v}");
    assert_eq!(d1.adapter_fields().len(), 1, "one Reserve, refused: {:?}", d1.adapter_fields());
    // The router learned from the refusal: the next request is refused before any call.
    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(error_message(&v).contains("no usable decode worker holds the LoRA adapter `sql`"), "{v}");
    assert_eq!(d1.adapter_fields().len(), 1, "{:?}", d1.adapter_fields());
    // The base model still runs there.
    let (status, v) = post(c.http, "/v1/completions", &[], &completion(&model_name())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_that_merely_mentions_an_adapter_does_not_unlist_it() {
    let sql = fake_adapter("sql", "/lora/sql");
    let c = cluster(&["--prefill-fallback", "fail"], vec![sql.clone()], vec![vec![sql.clone()]]).await;
    // The prefill worker refuses with the codes an adapter refusal has, but unmarked (a
    // reservation's own refusal, say, which names the adapter it was made for).
    for (code, msg) in [
        (tonic::Code::FailedPrecondition, "reservation 7 was made for LoRA adapter 'sql' (id 1)"),
        (tonic::Code::NotFound, "no such adapter-shaped thing"),
    ] {
        *c.worker("p-1").0.prefill_hook.lock().unwrap() =
            Some(Box::new(move || tonic::Status::new(code, msg)));
        let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
        assert!(status.is_server_error() || status.is_client_error(), "{status}: {v}");
        assert!(!error_message(&v).contains("no longer holds"), "{v}");
        let (_, models) = get(c.http, "/v1/models", &[]).await;
        assert_eq!(models["data"][1]["id"], "sql", "still listed after {code:?}: {models}");
    }
    let (status, v) = post(c.http, "/v1/completions", &[], &completion("sql")).await;
    assert_eq!(status, StatusCode::OK, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_worker_that_runs_adapters_is_asked_which_it_holds_at_every_poll() {
    let addr = "127.0.0.1:1".parse().unwrap();
    let p = FakeWorker::new(worker_info("p-1", Role::Prefill, addr, 16), SCRIPT.to_vec(), None);
    let d = FakeWorker::new(worker_info("d-1", Role::Decode, addr, 16), SCRIPT.to_vec(), None);
    p.hold(vec![fake_adapter("sql", "/lora/sql")], 4);
    d.hold(vec![fake_adapter("sql", "/lora/sql")], 4);
    let mut addrs = Vec::new();
    for w in [&p, &d] {
        let a = serve(w.clone()).await.to_string();
        w.0.info.lock().unwrap().address = a.clone();
        addrs.push(a);
    }
    let workers = addrs.join(",");
    let router =
        RouterProc::start(&["--heartbeat-ms", "50", "--http-listen", "127.0.0.1:0", "--worker", &workers]);
    let http = router.http.unwrap();
    let names = || async move {
        let (_, v) = get(http, "/v1/models", &[]).await;
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .skip(1)
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let until = |want: &'static [&'static str]| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let got = names().await;
            if got == want {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "/v1/models lists {got:?}, not {want:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // From their records (`Info`), then from `ListAdapters`: the decode worker loaded another.
    until(&["sql"]).await;
    d.hold(vec![fake_adapter("sql", "/lora/sql"), fake_adapter("poem", "/lora/poem")], 4);
    until(&["poem", "sql"]).await;
    assert!(d.secrets().iter().any(|(m, _)| m == "ListAdapters"));
    p.hold(Vec::new(), 4);
    d.hold(Vec::new(), 4);
    until(&[]).await;
}
