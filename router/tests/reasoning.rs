//! Reasoning apart from the answer, through the real router binary: a tiny model whose chat
//! template thinks (Qwen3's shape, with its `enable_thinking` switch) and fake workers that
//! generate a known answer with a thinking block. The split is exact in the chat, Messages and
//! Responses APIs, answered at once and streamed, and the switch reaches the template.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tandem_proto::v1::registry_client::RegistryClient;
use tandem_proto::v1::Role;
use tandem_serve::identity::model_identity;

/// What the fake workers generate: reasoning, then the answer.
const THOUGHT: &str = "I add 2 and 2, which makes 4.";
const ANSWER: &str = "It is 4.";

/// The tiny model with the thinking template.
fn thinking_model() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-router-reasoning-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(tiny_model()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let template = tiny_model().join("../../templates/think-qwen3.jinja");
    std::fs::copy(template, dir.join("chat_template.jinja")).unwrap();
    dir
}

async fn cluster(model: &Path, script: Vec<u32>) -> (RouterProc, SocketAddr) {
    let router =
        RouterProc::start_with_model(model, &["--heartbeat-ms", "60000", "--http-listen", "127.0.0.1:0"]);
    let http = router.http.expect("the router announces its HTTP address");
    let model_id = model_identity(model).unwrap().model_id;
    let addr = "127.0.0.1:1".parse().unwrap();
    let mut reg = RegistryClient::new(router.channel().await);
    for (id, role) in [("p-1", Role::Prefill), ("d-1", Role::Decode)] {
        let mut info = worker_info(id, role, addr, 16);
        info.compat = Some(compat(&model_id, 16));
        let w = FakeWorker::new(info, script.clone(), None);
        w.0.info.lock().unwrap().address = serve(w.clone()).await.to_string();
        let info = w.0.info.lock().unwrap().clone();
        reg.register(info).await.expect("registration");
        std::mem::forget(w);
    }
    (router, http)
}

/// POSTs `body`; the status and the whole body's text.
async fn post(addr: SocketAddr, path: &str, body: &Value) -> (StatusCode, String) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(header::HOST, addr.to_string())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let wait = Duration::from_secs(30);
    let resp = tokio::time::timeout(wait, sender.send_request(req)).await.unwrap().unwrap();
    let status = resp.status();
    let bytes = tokio::time::timeout(wait, resp.into_body().collect()).await.unwrap().unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// The `data:` payloads of a server-sent event stream, as JSON (`[DONE]` left out).
fn data_events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

#[tokio::test]
async fn every_api_returns_the_reasoning_apart_from_the_content() {
    let model = thinking_model();
    let tok = model_identity(&model).unwrap().tokenizer;
    let generated = format!("<think>{THOUGHT}</think> {ANSWER}");
    let script = tok.encode(&generated, false).unwrap();
    // The fakes continue the script after the prompt's last token: it must not be in the script.
    for switch in [None, Some(false)] {
        let messages = [tandem_model::tokenizer::ChatMessage::new("user", "What is 2 + 2?")];
        let prompt = tok.apply_chat_template_full(&messages, None, true, switch).unwrap();
        let last = *tok.encode(&prompt, false).unwrap().last().unwrap();
        assert!(!script.contains(&last), "the script holds the prompt's last token {last}");
    }
    let n = script.len();
    let (_router, http) = cluster(&model, script).await;
    let body = |extra: Value| {
        let mut b = json!({"model": model_identity(&model).unwrap().model_name, "max_tokens": n,
            "messages": [{"role": "user", "content": "What is 2 + 2?"}]});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };

    let (status, text) = post(http, "/v1/chat/completions", &body(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], THOUGHT, "{v}");
    assert_eq!(m["content"], ANSWER, "{v}");

    let (status, text) = post(http, "/v1/chat/completions", &body(json!({"stream": true}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in data_events(&text) {
        let d = &e["choices"][0]["delta"];
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(d["content"].as_str().unwrap_or(""));
    }
    assert_eq!((reasoning.as_str(), content.as_str()), (THOUGHT, ANSWER), "{text}");

    // Thinking turned off: the template closes the block in the prompt, and the whole answer
    // is content (the fakes still spell a block, which is then not reasoning).
    let off = body(json!({"chat_template_kwargs": {"enable_thinking": false}}));
    let (status, text) = post(http, "/v1/chat/completions", &off).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(v["choices"][0]["message"].get("reasoning_content").is_none(), "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], generated.as_str(), "{v}");
    let bad = body(json!({"chat_template_kwargs": {"enable_thinking": false, "x": 1}}));
    let (status, text) = post(http, "/v1/chat/completions", &bad).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("chat_template_kwargs.x"), "{text}");

    // The Messages API: a thinking block, then the text.
    let name = model_identity(&model).unwrap().model_name;
    let msg =
        json!({"model": name, "max_tokens": n, "messages": [{"role": "user", "content": "What is 2 + 2?"}]});
    let (status, text) = post(http, "/v1/messages", &msg).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["content"][0]["type"], "thinking", "{v}");
    assert_eq!(v["content"][0]["thinking"], THOUGHT, "{v}");
    assert_eq!(
        (v["content"][1]["type"].as_str(), v["content"][1]["text"].as_str()),
        (Some("text"), Some(ANSWER))
    );
    let mut streamed = msg.clone();
    streamed["stream"] = json!(true);
    let (status, text) = post(http, "/v1/messages", &streamed).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in data_events(&text) {
        reasoning.push_str(e["delta"]["thinking"].as_str().unwrap_or(""));
        content.push_str(e["delta"]["text"].as_str().unwrap_or(""));
    }
    assert_eq!((reasoning.as_str(), content.as_str()), (THOUGHT, ANSWER), "{text}");

    // The Responses API: a reasoning item, then the message.
    let req = json!({"model": name, "max_output_tokens": n, "input": "What is 2 + 2?", "store": false});
    let (status, text) = post(http, "/v1/responses", &req).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["output"][0]["type"], "reasoning", "{v}");
    assert_eq!(v["output"][0]["content"][0]["text"], THOUGHT, "{v}");
    assert_eq!(v["output"][1]["content"][0]["text"], ANSWER, "{v}");
    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    let (status, text) = post(http, "/v1/responses", &streamed).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in data_events(&text) {
        match e["type"].as_str() {
            Some("response.reasoning_text.delta") => reasoning.push_str(e["delta"].as_str().unwrap()),
            Some("response.output_text.delta") => content.push_str(e["delta"].as_str().unwrap()),
            _ => {}
        }
    }
    assert_eq!((reasoning.as_str(), content.as_str()), (THOUGHT, ANSWER), "{text}");
    std::fs::remove_dir_all(&model).ok();
}
