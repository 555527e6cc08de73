//! The router's OpenAI-compatible HTTP API, against the real router binary and fake workers with
//! scripted tokens: completions and chat completions answered at once and streamed as server-sent
//! events, the models list, every kind of bad input (each a 4xx with an OpenAI error body that
//! names the problem, and the next request served), the API key, a full queue, a client that goes
//! away mid-request, and a draining router.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_proto::v1::registry_client::RegistryClient;
use tandem_proto::v1::Role;
use tandem_serve::identity::model_identity;
use tokio::task::JoinHandle;

/// Tokens the fakes generate: ordinary vocabulary entries of the tiny model (no EOS).
const SCRIPT: [u32; 10] = [300, 301, 302, 303, 304, 305, 306, 307, 308, 309];
/// Longest wait for any one HTTP exchange.
const WAIT: Duration = Duration::from_secs(30);

fn tok() -> Tokenizer {
    model_identity(&tiny_model()).unwrap().tokenizer
}

/// The name the router serves the tiny model under.
fn model_name() -> String {
    model_identity(&tiny_model()).unwrap().model_name
}

struct Cluster {
    router: RouterProc,
    http: SocketAddr,
    prefill: FakeWorker,
    decode: FakeWorker,
}

/// A router with `extra` flags and a fake prefill and decode worker registered with it; the decode
/// worker holds its stream open after `hold_after` tokens.
async fn cluster(extra: &[&str], hold_after: Option<usize>) -> Cluster {
    let mut args = vec!["--heartbeat-ms", "60000", "--http-listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let router = RouterProc::start(&args);
    let http = router.http.expect("the router announces its HTTP address");
    let addr = "127.0.0.1:1".parse().unwrap();
    let p = FakeWorker::new(worker_info("p-1", Role::Prefill, addr, 16), SCRIPT.to_vec(), None);
    let d = FakeWorker::new(worker_info("d-1", Role::Decode, addr, 16), SCRIPT.to_vec(), hold_after);
    p.0.info.lock().unwrap().address = serve(p.clone()).await.to_string();
    d.0.info.lock().unwrap().address = serve(d.clone()).await.to_string();
    let mut reg = RegistryClient::new(router.channel().await);
    for w in [&p, &d] {
        let info = w.0.info.lock().unwrap().clone();
        reg.register(info).await.expect("registration");
    }
    Cluster { router, http, prefill: p, decode: d }
}

/// An HTTP/1.1 exchange on a fresh connection; the returned task drives the connection (abort it
/// to cut the connection as a client that goes away would).
async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (hyper::Response<Incoming>, JoinHandle<()>) {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connecting to the router's HTTP server");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("HTTP handshake");
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::builder().method(method).uri(path).header(header::HOST, addr.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body))).unwrap();
    let resp = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("no answer in time")
        .expect("the request failed");
    (resp, conn)
}

async fn read_body(resp: hyper::Response<Incoming>) -> (StatusCode, http::HeaderMap, String) {
    let (parts, body) = resp.into_parts();
    let bytes =
        tokio::time::timeout(WAIT, body.collect()).await.expect("body in time").expect("body").to_bytes();
    (parts.status, parts.headers, String::from_utf8(bytes.to_vec()).expect("UTF-8 body"))
}

const JSON: (&str, &str) = ("content-type", "application/json");

/// POSTs `body` as JSON; returns the status and the parsed answer.
async fn post(addr: SocketAddr, path: &str, body: &Value) -> (StatusCode, Value) {
    post_raw(addr, path, &[JSON], body.to_string().into_bytes()).await
}

async fn post_raw(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (StatusCode, Value) {
    let (resp, _conn) = send(addr, Method::POST, path, headers, body).await;
    let (status, _, text) = read_body(resp).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("answer is not JSON ({e}): {text:?}"));
    (status, v)
}

async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (StatusCode, Value) {
    let (resp, _conn) = send(addr, Method::GET, path, headers, Vec::new()).await;
    let (status, _, text) = read_body(resp).await;
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("answer is not JSON ({e}): {text:?}")))
}

/// A streamed answer: every `data:` payload in order (the last is `[DONE]`).
async fn post_stream(addr: SocketAddr, path: &str, body: &Value) -> Vec<String> {
    let (resp, _conn) = send(addr, Method::POST, path, &[JSON], body.to_string().into_bytes()).await;
    let (status, headers, text) = read_body(resp).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(headers[header::CONTENT_TYPE], "text/event-stream");
    events(&text)
}

/// Splits a server-sent event stream into its `data:` payloads, checking the framing.
fn events(text: &str) -> Vec<String> {
    assert!(text.ends_with("\n\n"), "the stream ends with a whole event: {text:?}");
    text.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {e:?}")).to_owned())
        .collect()
}

/// Checks an OpenAI error body and returns its message.
fn error_message(v: &Value) -> String {
    let e = &v["error"];
    assert!(e["message"].is_string() && e["type"].is_string(), "not an OpenAI error body: {v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "not an OpenAI error body: {v}");
    e["message"].as_str().unwrap().to_owned()
}

fn completion(prompt: Value, max_tokens: u32) -> Value {
    json!({"model": model_name(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

fn prompt_ids() -> Value {
    json!((10..30).collect::<Vec<u32>>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_answers_with_text_usage_and_logprobs() {
    let c = cluster(&[], None).await;
    let mut body = completion(prompt_ids(), 5);
    body["logprobs"] = json!(0);
    let (status, v) = post(c.http, "/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"), "{v}");
    assert_eq!(v["model"], model_name());
    assert!(v["created"].as_u64().unwrap() > 0);
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["text"], tok().decode(&SCRIPT[..5], true).unwrap());
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    let lp = &choice["logprobs"];
    assert_eq!(lp["token_logprobs"], json!([-0.5, -1.0, -1.0, -1.0, -1.0]), "{lp}");
    let tokens: Vec<String> = SCRIPT[..5].iter().map(|&t| tok().token_text(t).unwrap()).collect();
    assert_eq!(lp["tokens"], json!(tokens));
    assert_eq!(lp["text_offset"][0], 0);
    assert_eq!(c.prefill.0.prefills.lock().unwrap()[0].prompt_token_ids, (10..30).collect::<Vec<u32>>());

    // A text prompt is tokenized as the gRPC API does it; without logprobs there are none.
    let (status, v) = post(c.http, "/v1/completions", &completion(json!(["Hello world"]), 3)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    let want = tok().encode("Hello world", true).unwrap();
    assert_eq!(c.prefill.0.prefills.lock().unwrap()[1].prompt_token_ids, want);
    assert_eq!(v["usage"]["prompt_tokens"], want.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_parameters_and_seed_reach_the_workers() {
    let c = cluster(&[], None).await;
    let body = json!({"model": model_name(), "prompt": prompt_ids(), "max_tokens": 4, "temperature": 0.7,
                      "top_p": 0.9, "seed": 1234, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                      "ignore_eos": true, "n": 1, "presence_penalty": 0, "frequency_penalty": 0, "user": "x"});
    let (a, va) = post(c.http, "/v1/completions", &body).await;
    let (b, vb) = post(c.http, "/v1/completions", &body).await;
    assert_eq!((a, b), (StatusCode::OK, StatusCode::OK), "{va} {vb}");
    assert_eq!(va["choices"], vb["choices"]);
    let prefills = c.prefill.0.prefills.lock().unwrap().clone();
    let decodes = c.decode.0.decodes.lock().unwrap().clone();
    for p in prefills
        .iter()
        .map(|p| p.params.clone().unwrap())
        .chain(decodes.iter().map(|d| d.params.clone().unwrap()))
    {
        assert_eq!(p.seed, 1234, "the same seed on both workers, on every request");
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty),
            (0.7, 0.9, 5, 0.05, 1.1)
        );
        assert!(p.ignore_eos);
        assert_eq!(p.max_tokens, 4);
    }
    assert_eq!(prefills.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_structured_output_constraint_reaches_both_workers() {
    use tandem_proto::v1::output_constraint::Kind;
    let c = cluster(&[], None).await;
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
    let body = json!({"model": model_name(), "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 4,
                      "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": true}}});
    let (st, v) = post(c.http, "/v1/chat/completions", &body).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let prefills = c.prefill.0.prefills.lock().unwrap().clone();
    let decodes = c.decode.0.decodes.lock().unwrap().clone();
    assert_eq!((prefills.len(), decodes.len()), (1, 1));
    for p in prefills
        .iter()
        .map(|p| p.params.clone().unwrap())
        .chain(decodes.iter().map(|d| d.params.clone().unwrap()))
    {
        let Some(Kind::JsonSchema(text)) = p.constraint.and_then(|c| c.kind) else {
            panic!("no schema reached a worker")
        };
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), schema);
    }
    // A request without one sends none.
    let plain = json!({"model": model_name(), "prompt": prompt_ids(), "max_tokens": 2});
    assert_eq!(post(c.http, "/v1/completions", &plain).await.0, StatusCode::OK);
    let last = c.prefill.0.prefills.lock().unwrap().last().cloned().unwrap();
    assert!(last.params.unwrap().constraint.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_string_ends_the_completion_with_finish_reason_stop() {
    let c = cluster(&[], None).await;
    let tok = tok();
    let full = tok.decode(&SCRIPT, true).unwrap();
    let before = tok.decode(&SCRIPT[..3], true).unwrap();
    // A stop string made of the 4th token's text: the output ends just before its first match.
    let stop = full[before.len()..tok.decode(&SCRIPT[..4], true).unwrap().len()].to_owned();
    assert!(!stop.trim().is_empty(), "token {} has visible text", SCRIPT[3]);
    let want = &full[..full.find(&stop).unwrap()];
    let mut body = completion(prompt_ids(), 10);
    body["stop"] = json!([stop, "never-seen"]);
    let (status, v) = post(c.http, "/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["text"], want);
    let mut body = completion(prompt_ids(), 10);
    body["stop"] = json!(stop);
    body["stream"] = json!(true);
    let ev = post_stream(c.http, "/v1/completions", &body).await;
    let text: String = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_renders_the_template_and_answers_as_the_assistant() {
    let c = cluster(&[], None).await;
    let body = json!({"model": model_name(), "max_completion_tokens": 4, "temperature": 0, "logprobs": true,
                      "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]});
    let (status, v) = post(c.http, "/v1/chat/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], tok().decode(&SCRIPT[..4], true).unwrap());
    assert_eq!(choice["finish_reason"], "length");
    let content = choice["logprobs"]["content"].as_array().expect("chat logprobs");
    assert_eq!(content.len(), 4);
    assert_eq!(content[0]["logprob"], -0.5);
    assert_eq!(content[0]["token"], tok().token_text(SCRIPT[0]).unwrap());
    let tok = tok();
    let rendered = tok
        .apply_chat_template(&[ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")], true)
        .unwrap();
    let want = tok.encode(&rendered, false).unwrap();
    assert_eq!(c.prefill.0.prefills.lock().unwrap()[0].prompt_token_ids, want);
    assert_eq!(v["usage"]["prompt_tokens"], want.len());
    assert_eq!(v["usage"]["total_tokens"], want.len() + 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_server_sent_events_ending_in_done() {
    let c = cluster(&[], None).await;
    let tok = tok();

    // Completions, with a usage chunk at the end.
    let mut body = completion(prompt_ids(), 6);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let ev = post_stream(c.http, "/v1/completions", &body).await;
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.len() >= 3, "{chunks:?}");
    let id = chunks[0]["id"].clone();
    assert!(chunks.iter().all(|c| c["id"] == id && c["object"] == "text_completion"), "{chunks:?}");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let body_chunks = &chunks[..chunks.len() - 2];
    assert!(body_chunks.iter().all(|c| c["choices"][0]["finish_reason"].is_null() && c["usage"].is_null()));
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, tok.decode(&SCRIPT[..6], true).unwrap());

    // Chat: the first delta names the assistant; no usage unless asked for.
    let body = json!({"model": model_name(), "max_tokens": 3, "stream": true, "temperature": 0,
                      "messages": [{"role": "user", "content": "Hi"}]});
    let ev = post_stream(c.http, "/v1/chat/completions", &body).await;
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c.get("usage").is_none()));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[1..].iter().all(|c| c["choices"][0]["delta"].get("role").is_none()));
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["choices"][0]["delta"], json!({}));
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, tok.decode(&SCRIPT[..3], true).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_lists_the_served_model() {
    let c = cluster(&[], None).await;
    let (status, v) = get(c.http, "/v1/models", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], model_name());
    assert_eq!(v["data"][0]["object"], "model");
    let (status, v) = get(c.http, &format!("/v1/models/{}", model_name()), &[]).await;
    assert_eq!((status, &v["id"]), (StatusCode::OK, &json!(model_name())));
    let (status, v) = get(c.http, "/v1/models/no-such-model", &[]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], "model_not_found");
    let (status, v) = get(c.http, "/v1/embeddings", &[]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(error_message(&v).contains("/v1/embeddings"), "{v}");
    let (status, v) = get(c.http, "/v1/completions", &[]).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    error_message(&v);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_model_name_renames_the_model_on_the_api() {
    let c = cluster(&["--served-model-name", "acme/tiny chat"], None).await;
    let (status, v) = get(c.http, "/v1/models", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["data"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v["data"][0]["id"], "acme/tiny chat");
    let (status, v) = get(c.http, "/v1/models/acme/tiny%20chat", &[]).await;
    assert_eq!((status, &v["id"]), (StatusCode::OK, &json!("acme/tiny chat")), "{v}");
    let (status, v) = get(c.http, &format!("/v1/models/{}", model_name()), &[]).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");

    let body = json!({"model": "acme/tiny chat", "max_tokens": 2, "prompt": "Hi"});
    let (status, v) = post(c.http, "/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["model"], "acme/tiny chat");
    assert_eq!(v["choices"][0]["text"], json!(tok().decode(&SCRIPT[..2], true).unwrap()));
    // The file's own name is not an alias.
    let body = json!({"model": model_name(), "max_tokens": 2, "prompt": "Hi"});
    let (status, v) = post(c.http, "/v1/completions", &body).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found");
    assert!(error_message(&v).contains("acme/tiny chat"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_a_400_naming_the_problem_and_the_next_request_is_served() {
    let c = cluster(&[], None).await;
    let m = model_name();
    let long: Vec<u32> = (0..600).map(|i| 10 + i % 100).collect();
    let chat = |extra: Value| {
        let mut b = json!({"model": m, "messages": [{"role": "user", "content": "Hi"}]});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let comp = |extra: Value| {
        let mut b = json!({"model": m, "prompt": "Hello"});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    // (endpoint, body, status, param, words the message must contain)
    let cases: Vec<(&str, Value, StatusCode, Value, &str)> = vec![
        (
            "/v1/completions",
            comp(json!({"frobnicate": true})),
            StatusCode::BAD_REQUEST,
            json!("frobnicate"),
            "unknown parameter `frobnicate`",
        ),
        (
            "/v1/completions",
            comp(json!({"max_tokens": "many"})),
            StatusCode::BAD_REQUEST,
            json!("max_tokens"),
            "invalid type",
        ),
        (
            "/v1/completions",
            comp(json!({"max_tokens": -5})),
            StatusCode::BAD_REQUEST,
            json!("max_tokens"),
            "at least 1",
        ),
        (
            "/v1/completions",
            comp(json!({"max_tokens": 0})),
            StatusCode::BAD_REQUEST,
            json!("max_tokens"),
            "at least 1",
        ),
        (
            "/v1/completions",
            comp(json!({"max_tokens": 1_000_000_000_000u64})),
            StatusCode::BAD_REQUEST,
            json!("max_tokens"),
            "context length",
        ),
        (
            "/v1/completions",
            comp(json!({"max_tokens": 1e30})),
            StatusCode::BAD_REQUEST,
            json!("max_tokens"),
            "invalid type",
        ),
        ("/v1/completions", comp(json!({"prompt": ""})), StatusCode::BAD_REQUEST, json!("prompt"), "empty"),
        ("/v1/completions", comp(json!({"prompt": []})), StatusCode::BAD_REQUEST, json!("prompt"), "empty"),
        (
            "/v1/completions",
            comp(json!({"prompt": 7})),
            StatusCode::BAD_REQUEST,
            json!("prompt"),
            "expected a string",
        ),
        (
            "/v1/completions",
            comp(json!({"prompt": long})),
            StatusCode::BAD_REQUEST,
            json!("prompt"),
            "prompt has 600 tokens",
        ),
        (
            "/v1/completions",
            comp(json!({"prompt": [100000]})),
            StatusCode::BAD_REQUEST,
            json!("prompt"),
            "outside the vocabulary",
        ),
        (
            "/v1/completions",
            comp(json!({"temperature": -1})),
            StatusCode::BAD_REQUEST,
            json!("temperature"),
            "temperature",
        ),
        ("/v1/completions", comp(json!({"top_p": 0})), StatusCode::BAD_REQUEST, json!("top_p"), "top_p"),
        ("/v1/completions", comp(json!({"stop": [""]})), StatusCode::BAD_REQUEST, json!("stop"), "empty"),
        ("/v1/completions", comp(json!({"n": 17})), StatusCode::BAD_REQUEST, json!("n"), "between 1 and 16"),
        (
            "/v1/completions",
            comp(json!({"logprobs": 21})),
            StatusCode::BAD_REQUEST,
            json!("logprobs"),
            "at most 20",
        ),
        (
            "/v1/completions",
            comp(json!({"presence_penalty": 1.5})),
            StatusCode::BAD_REQUEST,
            json!("presence_penalty"),
            "not supported",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"echo": true})),
            StatusCode::BAD_REQUEST,
            json!("echo"),
            "unknown parameter",
        ),
        ("/v1/completions", comp(json!({"model": "gpt-4"})), StatusCode::NOT_FOUND, json!("model"), "gpt-4"),
        ("/v1/completions", json!({"prompt": "x"}), StatusCode::BAD_REQUEST, json!("model"), "required"),
        (
            "/v1/chat/completions",
            chat(json!({"messages": []})),
            StatusCode::BAD_REQUEST,
            json!("messages"),
            "empty",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"messages": "Hi"})),
            StatusCode::BAD_REQUEST,
            json!("messages"),
            "expected an array",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"messages": [{"role": "user", "content": 5}]})),
            StatusCode::BAD_REQUEST,
            json!("messages[0].content"),
            "expected a string",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 30})),
            StatusCode::BAD_REQUEST,
            json!("top_logprobs"),
            "at most 20",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function"}]})),
            StatusCode::BAD_REQUEST,
            json!("tools[0]"),
            "`function` is required",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                "response_format": {"type": "json_object"}})),
            StatusCode::BAD_REQUEST,
            json!("response_format"),
            "generic format",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}})),
            StatusCode::BAD_REQUEST,
            json!("response_format"),
            "invalid json_schema",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"guided_regex": "([a-z]"})),
            StatusCode::BAD_REQUEST,
            json!("guided_regex"),
            "invalid regex",
        ),
        (
            "/v1/completions",
            comp(json!({"guided_choice": []})),
            StatusCode::BAD_REQUEST,
            json!("guided_choice"),
            "at least one",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stream_options": {"include_usage": true}})),
            StatusCode::BAD_REQUEST,
            json!("stream_options"),
            "stream is true",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": 4, "max_completion_tokens": 4})),
            StatusCode::BAD_REQUEST,
            json!("max_tokens"),
            "not both",
        ),
    ];
    for (path, body, status, param, needle) in cases {
        let (got, v) = post(c.http, path, &body).await;
        assert_eq!(got, status, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], param, "{path} {body}: {v}");
        let msg = error_message(&v);
        assert!(msg.contains(needle), "{path} {body}: message {msg:?} lacks {needle:?}");
    }
    let (_, v) = post(c.http, "/v1/completions", &comp(json!({"prompt": long}))).await;
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");

    // The HTTP layer's own refusals carry the same body: (headers, body, status, words).
    type Raw<'a> = (&'a [(&'a str, &'a str)], Vec<u8>, StatusCode, &'a str);
    let raw: Vec<Raw> = vec![
        (&[JSON], b"{\"model\": ".to_vec(), StatusCode::BAD_REQUEST, "not valid JSON"),
        (&[JSON], b"[1, 2]".to_vec(), StatusCode::BAD_REQUEST, "JSON object"),
        (
            &[],
            comp(json!({})).to_string().into_bytes(),
            StatusCode::BAD_REQUEST,
            "Content-Type: application/json",
        ),
        (&[("content-type", "text/plain")], b"hi".to_vec(), StatusCode::BAD_REQUEST, "Content-Type"),
        (&[JSON], vec![b' '; 17 << 20], StatusCode::PAYLOAD_TOO_LARGE, "larger than"),
    ];
    for (headers, body, status, needle) in raw {
        let (got, v) = post_raw(c.http, "/v1/completions", headers, body).await;
        assert_eq!(got, status, "{v}");
        let msg = error_message(&v);
        assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
    }

    // Nothing reached the workers, and the router still serves.
    assert!(c.prefill.calls().is_empty() && c.decode.calls().is_empty(), "{:?}", c.decode.calls());
    let (status, v) = post(c.http, "/v1/completions", &completion(prompt_ids(), 2)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, v) = post(c.http, "/v1/chat/completions", &chat(json!({"max_tokens": 2}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_on_every_v1_route() {
    let c = cluster(&["--api-key", "sk-test-123"], None).await;
    let body = completion(prompt_ids(), 2).to_string().into_bytes();
    for headers in [
        vec![JSON],
        vec![JSON, ("authorization", "Bearer wrong")],
        vec![JSON, ("authorization", "sk-test-123")],
    ] {
        let (status, v) = post_raw(c.http, "/v1/completions", &headers, body.clone()).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{headers:?}: {v}");
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert!(error_message(&v).contains("API key"), "{v}");
    }
    let (status, _) = get(c.http, "/v1/models", &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    for path in ["/tokenize", "/detokenize"] {
        let (status, v) = post(c.http, path, &json!({"prompt": "x", "tokens": [1]})).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}: {v}");
    }
    let auth = ("authorization", "Bearer sk-test-123");
    let (status, v) = post_raw(c.http, "/v1/completions", &[JSON, auth], body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, v) = get(c.http, "/v1/models", &[auth]).await;
    assert_eq!((status, &v["object"]), (StatusCode::OK, &json!("list")));
    assert!(c.prefill.calls().len() == 1, "only the authorised request ran: {:?}", c.prefill.calls());
}

/// Opens a streamed completion that the fake decode worker holds after 2 tokens; returns the
/// first event and the connection.
async fn held_stream(http: SocketAddr) -> (hyper::Response<Incoming>, JoinHandle<()>, String) {
    let mut body = completion(prompt_ids(), 8);
    body["stream"] = json!(true);
    let (resp, conn) =
        send(http, Method::POST, "/v1/completions", &[JSON], body.to_string().into_bytes()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let (parts, mut body) = resp.into_parts();
    let frame =
        tokio::time::timeout(WAIT, body.frame()).await.expect("a first event in time").unwrap().unwrap();
    let first = String::from_utf8(frame.into_data().unwrap().to_vec()).unwrap();
    assert!(first.starts_with("data: {"), "{first:?}");
    (hyper::Response::from_parts(parts, body), conn, first)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_a_429_and_a_dropped_stream_releases_the_workers() {
    let c = cluster(&["--max-queue", "1"], Some(2)).await;
    let (resp, conn, _first) = held_stream(c.http).await;
    eventually("the decode stream is open", || c.decode.calls().iter().any(|s| s.starts_with("Decode")))
        .await;

    let (status, v) = post(c.http, "/v1/completions", &completion(prompt_ids(), 2)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert!(error_message(&v).contains("--max-queue"), "{v}");

    // The client goes away mid-stream: the decode stream is dropped and the reservation released.
    drop(resp);
    conn.abort();
    eventually("the decode stream is dropped", || c.decode.0.decode_dropped.load(Ordering::SeqCst) == 1)
        .await;
    eventually("the decode worker is told to release", || !c.decode.releases().is_empty()).await;

    // The slot is free again. The first event can reach the client before the decode stream
    // opens (it is the prefill worker's token), so wait for the stream before leaving.
    let (resp, conn, _) = held_stream(c.http).await;
    let decodes = || c.decode.calls().iter().filter(|s| s.starts_with("Decode")).count();
    eventually("the second decode stream is open", || decodes() == 2).await;
    drop(resp);
    conn.abort();
    eventually("the second stream is dropped", || c.decode.0.decode_dropped.load(Ordering::SeqCst) == 2)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_a_non_streamed_request_cancels_it() {
    let c = cluster(&[], Some(2)).await;
    let body = completion(prompt_ids(), 8).to_string().into_bytes();
    let stream = tokio::net::TcpStream::connect(c.http).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = Request::builder()
        .method(Method::POST)
        .uri("/v1/completions")
        .header(header::HOST, "x")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let pending = tokio::spawn(async move { sender.send_request(req).await.map(|r| r.status()) });
    eventually("the decode stream is open", || c.decode.calls().iter().any(|s| s.starts_with("Decode")))
        .await;
    pending.abort();
    conn.abort();
    eventually("the decode stream is dropped", || c.decode.0.decode_dropped.load(Ordering::SeqCst) == 1)
        .await;
    eventually("the decode worker is told to release", || !c.decode.releases().is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_router_refuses_new_requests_with_503() {
    let mut c = cluster(&["--drain-timeout-ms", "20000"], Some(2)).await;
    let (resp, conn, _) = held_stream(c.http).await;
    c.router.sigterm();
    let deadline = std::time::Instant::now() + WAIT;
    let v = loop {
        let (status, v) = post(c.http, "/v1/completions", &completion(prompt_ids(), 2)).await;
        if status == StatusCode::SERVICE_UNAVAILABLE {
            break v;
        }
        assert!(std::time::Instant::now() < deadline, "still served after SIGTERM: {status} {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(v["error"]["code"], "draining");
    assert!(error_message(&v).contains("draining"), "{v}");
    // The stream in flight is the only thing holding the drain; ending it lets the router exit.
    drop(resp);
    conn.abort();
    let st = c.router.wait(WAIT);
    assert!(st.success(), "{st:?}; stderr:\n{}", c.router.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_salt_and_user_reach_the_workers_and_usage_counts_cached_tokens() {
    let c = cluster(&[], None).await;
    c.prefill.0.cached_tokens.store(16, Ordering::SeqCst);
    let salts = |w: &FakeWorker| -> Vec<String> {
        w.0.reserves.lock().unwrap().iter().map(|r| r.cache_salt.clone()).collect()
    };

    // `user` alone: the salt is derived from it, distinct from a `cache_salt` of the same text.
    let mut body = completion(prompt_ids(), 3);
    body["user"] = json!("alice");
    let (status, v) = post(c.http, "/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"], json!({"cached_tokens": 16}), "{v}");
    let reserve = c.decode.0.reserves.lock().unwrap()[0].clone();
    assert_eq!(reserve.prompt_token_ids, (10..30).collect::<Vec<u32>>());
    assert_eq!((reserve.num_tokens, reserve.cache_salt.as_str()), (20, "user:alice"));
    // The decode worker keeps room for the output the request may still generate.
    assert_eq!(reserve.max_new_tokens, 3);
    let pre = c.prefill.0.prefills.lock().unwrap()[0].clone();
    assert_eq!(pre.params.unwrap().cache_salt, "user:alice");
    assert_eq!(c.decode.0.decodes.lock().unwrap()[0].params.as_ref().unwrap().cache_salt, "user:alice");

    // Chat: `cache_salt` wins over `user`; the streamed usage chunk reports the cached tokens.
    let body = json!({"model": model_name(), "max_tokens": 3, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}, "cache_salt": "alice", "user": "bob",
                      "messages": [{"role": "user", "content": "Hi"}]});
    let ev = post_stream(c.http, "/v1/chat/completions", &body).await;
    let usage: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["prompt_tokens_details"], json!({"cached_tokens": 16}), "{usage}");
    assert_eq!(salts(&c.decode), vec!["user:alice".to_string(), "alice".into()]);
    let pre = c.prefill.0.prefills.lock().unwrap()[1].clone();
    assert_eq!(c.decode.0.reserves.lock().unwrap()[1].prompt_token_ids, pre.prompt_token_ids);

    // Neither: the shared namespace.
    let (status, v) = post(c.http, "/v1/completions", &completion(prompt_ids(), 2)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(salts(&c.decode)[2], "");

    // Too long a salt is refused by name, and no worker is asked.
    let mut body = completion(prompt_ids(), 2);
    body["cache_salt"] = json!("s".repeat(257));
    let (status, v) = post(c.http, "/v1/completions", &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "cache_salt", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("at most 256 bytes, got 257"), "{v}");
    let mut body = completion(prompt_ids(), 2);
    body["user"] = json!("u".repeat(252));
    let (status, v) = post(c.http, "/v1/completions", &body).await;
    assert_eq!((status, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("user")), "{v}");
    assert_eq!(salts(&c.decode).len(), 3);
    // The longest salt is accepted.
    let mut body = completion(prompt_ids(), 2);
    body["cache_salt"] = json!("s".repeat(256));
    assert_eq!(post(c.http, "/v1/completions", &body).await.0, StatusCode::OK);
    assert_eq!(salts(&c.decode)[3].len(), 256);
}

/// A 3-token completion of [`prompt_ids`]: status, headers and body.
async fn complete_3(http: SocketAddr) -> (StatusCode, http::HeaderMap, String) {
    let body = completion(prompt_ids(), 3).to_string().into_bytes();
    let (resp, _conn) = send(http, Method::POST, "/v1/completions", &[JSON], body).await;
    read_body(resp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_kv_line_refuses_at_once_with_429_and_retry_after() {
    let c = cluster(&["--max-kv-waiting", "1", "--kv-wait-ms", "60000"], None).await;
    c.decode.0.full_reserves.store(usize::MAX, Ordering::SeqCst);
    // The first request waits in the line for blocks (up to a minute).
    let waiting = tokio::spawn(complete_3(c.http));
    let deadline = std::time::Instant::now() + WAIT;
    while metric_value(&router_metrics(&c.router).await, "tandem_router_kv_waiting") != Some(1.0) {
        assert!(std::time::Instant::now() < deadline, "no request ever waited for KV blocks");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The line is full: the next request is refused without waiting.
    let (status, headers, text) = complete_3(c.http).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{text}");
    assert_eq!(headers[header::RETRY_AFTER], "1", "{headers:?}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(error_message(&v).contains("--max-kv-waiting"), "{v}");
    assert_eq!(v["error"]["code"], "overloaded", "{v}");
    let m = router_metrics(&c.router).await;
    assert_eq!(metric_value(&m, "tandem_router_kv_waiting"), Some(1.0), "the line stayed bounded:\n{m}");

    // Room again: the waiting request is served, and its answer names its request id.
    c.decode.0.full_reserves.store(0, Ordering::SeqCst);
    let (status, headers, text) = tokio::time::timeout(WAIT, waiting).await.expect("served in time").unwrap();
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let id = headers[REQUEST_ID].to_str().unwrap();
    assert_eq!(v["id"], format!("cmpl-{id}"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_inside_the_cluster_names_no_worker_to_an_http_client() {
    let c = cluster(&[], None).await;
    c.decode.0.draining.store(true, Ordering::SeqCst);
    let (status, headers, text) = complete_3(c.http).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    let id = headers[REQUEST_ID].to_str().unwrap().to_owned();
    let v: Value = serde_json::from_str(&text).unwrap();
    let msg = error_message(&v);
    assert!(msg.ends_with(&format!("(request id {id})")), "{v}");
    for leak in ["d-1", "p-1", "127.0.0.1", "Reserve"] {
        assert!(!msg.replace(&id, "").contains(leak), "the client was told `{leak}`: {v}");
    }
    eventually("the router's log names the worker under the request id", || {
        c.router.stderr().lines().any(|l| l.contains(&id) && l.contains("decode worker d-1"))
    })
    .await;
}

const REQUEST_ID: &str = "x-request-id";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_plus_max_tokens_beyond_the_context_is_a_400_naming_both_numbers() {
    let c = cluster(&[], None).await;
    // The fake workers hold 512 tokens.
    let long = json!((0..500).map(|i| 10 + i % 100).collect::<Vec<u32>>());
    let (status, v) = post(c.http, "/v1/completions", &completion(long.clone(), 20)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let msg = error_message(&v);
    assert!(msg.contains("500 tokens plus max_tokens 20") && msg.contains("context length of 512"), "{msg}");
    assert!(msg.contains("at most 12 tokens"), "{msg}");
    assert_eq!(
        (&v["error"]["param"], &v["error"]["code"]),
        (&json!("max_tokens"), &json!("context_length_exceeded"))
    );
    // The completions default (16 tokens) is held to the same rule, as in vLLM and OpenAI.
    let (status, v) = post(c.http, "/v1/completions", &json!({"model": model_name(), "prompt": long})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(error_message(&v).contains("500 tokens plus max_tokens 16"), "{v}");
    assert!(c.prefill.calls().is_empty(), "nothing refused reached a worker");
    // What fits is served.
    let (status, v) = post(c.http, "/v1/completions", &completion(long, 4)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // A chat's explicit max_completion_tokens is held to the rule too. (A chat without it asks
    // for as many tokens as fit: the parser's tests check that it is marked so.)
    let too_many = json!({"model": model_name(), "messages": [{"role": "user", "content": "Hi"}],
                          "max_completion_tokens": 512});
    let (status, v) = post(c.http, "/v1/chat/completions", &too_many).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(error_message(&v).contains("plus max_tokens 512"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_round_trip_in_vllms_shapes() {
    let c = cluster(&[], None).await;
    let tok = tok();
    let m = model_name();
    let text = "Grüße aus Köln, 東京 and naïve café ☕";
    // prompt: add_special_tokens defaults to true, as a completion prompt is encoded.
    let (status, v) = post(c.http, "/tokenize", &json!({"model": m, "prompt": text})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let want = tok.encode(text, true).unwrap();
    assert_eq!(v["tokens"], json!(want));
    assert_eq!(v["count"], want.len());
    assert!(v["max_model_len"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["token_strs"], Value::Null);
    // Without special tokens, detokenize gives the text back byte for byte.
    let body = json!({"prompt": text, "add_special_tokens": false, "return_token_strs": true});
    let (status, v) = post(c.http, "/tokenize", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(ids, tok.encode(text, false).unwrap());
    let pieces: Vec<String> = ids.iter().map(|&id| tok.token_piece(id).unwrap()).collect();
    assert_eq!(v["token_strs"], json!(pieces));
    let (status, v) = post(c.http, "/detokenize", &json!({"model": m, "tokens": ids})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["prompt"], text);
    // messages: rendered by the chat template, as a chat request's prompt is.
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]);
    let (status, v) = post(c.http, "/tokenize", &json!({"messages": msgs})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let rendered = tok
        .apply_chat_template(&[ChatMessage::new("system", "Be brief."), ChatMessage::new("user", text)], true)
        .unwrap();
    assert_eq!(v["tokens"], json!(tok.encode(&rendered, false).unwrap()));
    // Bad input: a 400 naming the field.
    let cases = [
        ("/tokenize", json!({"prompt": "a", "messages": msgs}), "prompt", "not both"),
        ("/tokenize", json!({}), "prompt", "required"),
        ("/tokenize", json!({"prompt": "a", "frobnicate": 1}), "frobnicate", "unknown parameter"),
        ("/detokenize", json!({"tokens": [1, 10_000_000]}), "tokens", "outside the vocabulary"),
        ("/detokenize", json!({"tokens": "abc"}), "tokens", "invalid type"),
        ("/detokenize", json!({}), "tokens", "required"),
    ];
    for (path, body, param, words) in cases {
        let (status, v) = post(c.http, path, &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], param, "{path} {body}: {v}");
        assert!(error_message(&v).contains(words), "{path} {body}: {v}");
    }
    let (status, v) = post(c.http, "/tokenize", &json!({"model": "other", "prompt": "a"})).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    let (status, _) = get(c.http, "/tokenize", &[]).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_logprobs_come_back_for_every_token_in_both_apis() {
    let c = cluster(&[], None).await;
    let tok = tok();
    let body = json!({"model": model_name(), "max_completion_tokens": 3, "temperature": 0, "logprobs": true,
                      "top_logprobs": 4, "messages": [{"role": "user", "content": "Hi"}]});
    let (status, v) = post(c.http, "/v1/chat/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().expect("content").clone();
    assert_eq!(content.len(), 3, "{v}");
    for (i, entry) in content.iter().enumerate() {
        let top = entry["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 4, "token {i}: {entry}");
        // The fakes report the token itself first, then the ids after it (see fake_top).
        let id = SCRIPT[i];
        assert_eq!(top[0]["token"], tok.token_text(id).unwrap(), "token {i}");
        assert_eq!(top[0]["logprob"], entry["logprob"], "token {i}");
        assert_eq!(top[1]["token"], tok.token_text(id + 1).unwrap());
        assert_eq!(top[1]["bytes"], json!(tok.token_bytes(id + 1).unwrap()));
    }
    // The request carried the number to the workers.
    let asked = c.prefill.0.prefills.lock().unwrap()[0].params.clone().unwrap().top_logprobs;
    assert_eq!(asked, 4);

    let body = json!({"model": model_name(), "prompt": prompt_ids(), "max_tokens": 2, "temperature": 0,
                      "logprobs": 2, "stream": true});
    let events = post_stream(c.http, "/v1/completions", &body).await;
    let mut tops = Vec::new();
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(t) = v["choices"][0]["logprobs"]["top_logprobs"].as_array() {
            tops.extend(t.iter().cloned());
        }
    }
    assert_eq!(tops.len(), 2, "one object per token: {events:?}");
    for (i, t) in tops.iter().enumerate() {
        let o = t.as_object().expect("token text -> logprob");
        assert_eq!(o.len(), 2, "{t}");
        assert!(o.contains_key(&tok.token_text(SCRIPT[i]).unwrap()), "{t}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_come_from_one_prefill_and_one_decode_stream() {
    let c = cluster(&[], None).await;
    let tok = tok();
    let mut body = completion(prompt_ids(), 5);
    body["n"] = json!(3);
    body["seed"] = json!(7);
    let (status, v) = post(c.http, "/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    for (i, ch) in choices.iter().enumerate() {
        assert_eq!(ch["index"], i, "{v}");
        assert_eq!(ch["text"], tok.decode(&SCRIPT[..5], true).unwrap(), "{v}");
        assert_eq!(ch["finish_reason"], "length");
    }
    assert_eq!(v["usage"]["completion_tokens"], 15, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 20, "{v}");
    // One prefill (one transfer), one decode stream carrying every choice.
    assert_eq!(c.prefill.0.prefills.lock().unwrap().len(), 1);
    let decodes = c.decode.0.decodes.lock().unwrap().clone();
    assert_eq!(decodes.len(), 1);
    assert_eq!(decodes[0].n, 3);
    assert_eq!(decodes[0].params.as_ref().unwrap().seed, 7, "choice 0 keeps the request's seed");

    // Streamed chat: each choice's deltas under its index, one finish per choice, one usage.
    let body = json!({"model": model_name(), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                      "temperature": 0, "n": 2, "stream": true, "stream_options": {"include_usage": true}});
    let ev = post_stream(c.http, "/v1/chat/completions", &body).await;
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let mut text = [String::new(), String::new()];
    let mut finishes = [0, 0];
    let mut roles = [0, 0];
    let mut usage = Vec::new();
    for e in &ev[..ev.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        if !v["usage"].is_null() {
            usage.push(v["usage"].clone());
            continue;
        }
        let ch = &v["choices"][0];
        let i = ch["index"].as_u64().unwrap() as usize;
        text[i].push_str(ch["delta"]["content"].as_str().unwrap_or(""));
        roles[i] += usize::from(ch["delta"]["role"] == "assistant");
        finishes[i] += usize::from(!ch["finish_reason"].is_null());
    }
    let want = tok.decode(&SCRIPT[..4], true).unwrap();
    assert_eq!(text, [want.clone(), want], "{ev:?}");
    assert_eq!((finishes, roles), ([1, 1], [1, 1]), "{ev:?}");
    assert_eq!(usage.len(), 1, "{ev:?}");
    assert_eq!(usage[0]["completion_tokens"], 8);

    // A stop string ends each choice where it matches, and then the request.
    let full = tok.decode(&SCRIPT, true).unwrap();
    let before = tok.decode(&SCRIPT[..3], true).unwrap();
    let stop = full[before.len()..tok.decode(&SCRIPT[..4], true).unwrap().len()].to_owned();
    let mut body = completion(prompt_ids(), 10);
    body["stop"] = json!(stop);
    body["n"] = json!(2);
    let (status, v) = post(c.http, "/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    for ch in v["choices"].as_array().unwrap() {
        assert_eq!(ch["finish_reason"], "stop", "{v}");
        assert_eq!(ch["text"], &full[..full.find(&stop).unwrap()], "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_scores_the_prompt_and_max_tokens_0_only_scores_it() {
    let c = cluster(&[], None).await;
    let tok = tok();
    let prompt: Vec<u32> = (10..30).collect();
    let prompt_text = tok.decode(&prompt, false).unwrap();
    let mut body = completion(json!(prompt), 0);
    body["echo"] = json!(true);
    body["logprobs"] = json!(2);
    let (status, v) = post(c.http, "/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let ch = &v["choices"][0];
    assert_eq!(ch["text"], prompt_text, "{v}");
    assert_eq!(ch["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
    let lp = &ch["logprobs"];
    let texts: Vec<String> = prompt.iter().map(|&t| tok.token_text(t).unwrap()).collect();
    assert_eq!(lp["tokens"], json!(texts));
    assert_eq!(lp["token_logprobs"][0], Value::Null, "nothing predicts the first prompt token");
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    for j in 1..prompt.len() {
        // The fake prefill worker scores prompt token j at -j/10, its alternatives after it.
        let want = -(j as f64) / 10.0;
        assert!((lp["token_logprobs"][j].as_f64().unwrap() - want).abs() < 1e-6, "{lp}");
        assert_eq!(lp["top_logprobs"][j].as_object().unwrap().len(), 2, "{lp}");
    }
    assert_eq!(lp["text_offset"][0], 0);
    // The workers were asked to score the prompt, and to make one token nobody sees.
    let pre = c.prefill.0.prefills.lock().unwrap()[0].clone();
    let params = pre.params.unwrap();
    assert_eq!((params.prompt_logprobs, params.max_tokens), (Some(2), 1));

    // Echo with generated tokens, streamed: the prompt leads the first chunk, then the tokens.
    let mut body = completion(json!(prompt), 3);
    body["echo"] = json!(true);
    body["stream"] = json!(true);
    let ev = post_stream(c.http, "/v1/completions", &body).await;
    let text: String = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, format!("{prompt_text}{}", tok.decode(&SCRIPT[..3], true).unwrap()));
    // Without logprobs the prompt is not scored (its prefix cache stays usable).
    let pre = c.prefill.0.prefills.lock().unwrap()[1].clone();
    assert_eq!(pre.params.unwrap().prompt_logprobs, None);

    // max_tokens 0 needs echo.
    let (status, v) = post(c.http, "/v1/completions", &completion(json!(prompt), 0)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(error_message(&v).contains("0 only with echo"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_is_a_413_naming_it() {
    let c = cluster(&["--max-body-bytes", "2048"], None).await;
    let mut body = completion(prompt_ids(), 2);
    body["user"] = json!("x".repeat(4096));
    let (status, v) = post_raw(c.http, "/v1/completions", &[JSON], body.to_string().into_bytes()).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert!(error_message(&v).contains("larger than 2048 bytes (--max-body-bytes)"), "{v}");
    // Far over it (64 MiB): still an answer, not a reset connection.
    let (status, v) = post_raw(c.http, "/v1/completions", &[JSON], vec![b' '; 64 << 20]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    // Under it, served.
    let (status, v) = post(c.http, "/v1/completions", &completion(prompt_ids(), 2)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
}
