//! `tandem generate --router` against a stand-in router (a fake `Tandem` service): the flags become
//! the request `tandem generate` would run in process, the output has the in-process shape
//! (streamed text and a newline, or one JSON object), and errors are the router's message with
//! exit 1. `tandem up` without its server binaries says which file is missing; a bad API key or
//! cluster secret is refused before anything starts.

use std::net::SocketAddr;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use tandem_proto::v1;
use tandem_proto::v1::tandem_server::{Tandem, TandemServer};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

#[derive(Clone, Default)]
struct FakeRouter {
    requests: Arc<Mutex<Vec<v1::GenerateRequest>>>,
}

#[tonic::async_trait]
impl Tandem for FakeRouter {
    type GenerateStream = ReceiverStream<Result<v1::GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let req = request.into_inner();
        self.requests.lock().unwrap().push(req.clone());
        if let Some(v1::generate_request::Prompt::Text(t)) = &req.prompt {
            if t == "refuse" {
                return Err(Status::invalid_argument("max_tokens: must be at least 1"));
            }
        }
        let fail_midway = matches!(&req.prompt, Some(v1::generate_request::Prompt::Text(t)) if t == "fail");
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        tokio::spawn(async move {
            let first = v1::GenerateResponse {
                token_ids: vec![11, 12],
                text: "Hel".into(),
                prompt_token_ids: vec![1, 2, 3],
                request_id: "r-1".into(),
                ..Default::default()
            };
            let _ = tx.send(Ok(first)).await;
            if fail_midway {
                let _ = tx.send(Err(Status::aborted("decode worker d-1 failed in Decode"))).await;
                return;
            }
            let last = v1::GenerateResponse {
                token_ids: vec![13],
                text: "lo".into(),
                finish_reason: Some("length".into()),
                usage: Some(v1::Usage { prompt_tokens: 3, completion_tokens: 3, cached_tokens: 0 }),
                ..Default::default()
            };
            let _ = tx.send(Ok(last)).await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn health(&self, _r: Request<v1::HealthRequest>) -> Result<Response<v1::HealthResponse>, Status> {
        Ok(Response::new(v1::HealthResponse::default()))
    }
}

async fn start_fake() -> (SocketAddr, FakeRouter) {
    let fake = FakeRouter::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TandemServer::new(fake.clone()))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    (addr, fake)
}

async fn tandem(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_tandem")).args(&args).env_remove("TANDEM_ROUTER").output().unwrap()
    })
    .await
    .unwrap()
}

fn args(router: SocketAddr, rest: &[&str]) -> Vec<String> {
    let mut v = vec!["generate".to_string(), "--router".into(), router.to_string()];
    v.extend(rest.iter().map(|s| s.to_string()));
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flags_become_the_request_and_output_has_the_in_process_shape() {
    let (addr, fake) = start_fake().await;
    let out = tandem(args(
        addr,
        &[
            "--json",
            "--chat",
            "--system",
            "Be brief.",
            "--temperature",
            "0.5",
            "--top-k",
            "40",
            "--seed",
            "3",
            "--stop",
            "END",
            "--max-tokens",
            "7",
            "Hi there",
        ],
    ))
    .await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"prompt_token_ids": [1, 2, 3], "token_ids": [11, 12, 13], "text": "Hello", "finish_reason": "length"})
    );
    let req = fake.requests.lock().unwrap()[0].clone();
    let Some(v1::generate_request::Prompt::Chat(chat)) = req.prompt else {
        panic!("chat prompt expected: {req:?}")
    };
    let roles: Vec<(&str, &str)> =
        chat.messages.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
    assert_eq!(roles, vec![("system", "Be brief."), ("user", "Hi there")]);
    assert_eq!(chat.add_generation_prompt, Some(true));
    assert_eq!(req.max_tokens, Some(7));
    assert_eq!(req.stop, vec!["END".to_string()]);
    let s = req.sampling.unwrap();
    assert_eq!((s.temperature, s.top_k, s.seed, s.top_p), (Some(0.5), Some(40), Some(3), Some(1.0)));

    // Streaming prints the text and a newline, like in-process generate.
    let out = tandem(args(addr, &["--max-tokens", "3", "plain"])).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "Hello\n");
    let req = fake.requests.lock().unwrap()[1].clone();
    assert_eq!(req.prompt, Some(v1::generate_request::Prompt::Text("plain".into())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_errors_print_the_status_message_and_exit_1() {
    let (addr, _fake) = start_fake().await;
    let out = tandem(args(addr, &["refuse"])).await;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("max_tokens: must be at least 1"), "{err}");

    let out = tandem(args(addr, &["--json", "fail"])).await;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("decode worker d-1 failed in Decode"), "{err}");
    assert!(out.stdout.is_empty(), "no JSON for a failed request");

    let out = tandem(vec!["generate".into(), "--router".into(), "127.0.0.1:1".into(), "hi".into()]).await;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach the router at 127.0.0.1:1"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn up_names_the_missing_server_binary() {
    let dir = std::env::temp_dir().join(format!("tandem-up-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("tandem");
    std::fs::copy(env!("CARGO_BIN_EXE_tandem"), &exe).unwrap();
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa");
    // A child another test forks while the copy is open for writing inherits that descriptor
    // until it execs, and the copy cannot run meanwhile (ETXTBSY): try again shortly.
    let mut tries = 0;
    let out = loop {
        match Command::new(&exe).arg("up").arg("--model").arg(&model).output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 100 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => break r.unwrap(),
        }
    };
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}", dir.join("tandem-router").display())) && err.contains("not found"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "nothing on stdout before the cluster is ready");
}

#[test]
fn up_refuses_a_bad_api_key_or_cluster_secret_before_starting_anything() {
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa");
    let missing = std::env::temp_dir().join(format!("tandem-no-such-key-{}", std::process::id()));
    let cases: [(&[&str], &str); 3] = [
        (&["--api-key-file", missing.to_str().unwrap()], "--api-key-file"),
        (&["--cluster-secret", "two words"], "--cluster-secret"),
        (&["--api-key", " "], "--api-key is empty"),
    ];
    for (flags, needle) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .arg("up")
            .arg("--model")
            .arg(&model)
            .args(flags)
            .env_remove("TANDEM_API_KEY")
            .env_remove("TANDEM_API_KEY_FILE")
            .env_remove("TANDEM_CLUSTER_SECRET")
            .env_remove("TANDEM_CLUSTER_SECRET_FILE")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{flags:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{flags:?}: {err}");
        assert!(!err.contains("not found"), "refused before looking for the server binaries: {err}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn up_refuses_bad_devices_and_gpu_transports_it_cannot_serve_before_starting_anything() {
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa");
    let cases: [(&[&str], &str); 4] = [
        (&["--prefill-device", "gpu:0"], "--prefill-device"),
        (&["--decode-device", "cuda:0,"], "--decode-device"),
        (
            &["--transport", "cuda-ipc", "--decode-device", "cuda:1"],
            "--transport cuda-ipc moves KV between GPUs, but the prefill worker is on cpu",
        ),
        (
            &[
                "--transport",
                "nccl",
                "--prefill-device",
                "cuda:0",
                "--decode-device",
                "cuda:1,cuda:0",
                "--decode-workers",
                "2",
            ],
            "NCCL cannot put two ranks on one GPU (cuda:0)",
        ),
    ];
    for (flags, needle) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .arg("up")
            .arg("--model")
            .arg(&model)
            .args(flags)
            .env_remove("TANDEM_DEVICE")
            .output()
            .unwrap();
        assert_ne!(out.status.code(), Some(0), "{flags:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{flags:?}: {err}");
        assert!(!err.contains("not found"), "refused before looking for the server binaries: {err}");
        assert!(out.stdout.is_empty());
    }
}
