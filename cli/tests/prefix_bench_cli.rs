//! `tandem bench --router --workload shared-prefix` against a stand-in router that keeps a toy
//! prefix cache: it reports as cached the longest prefix (in whole blocks) a request shares with a
//! finished sequence of the same salt, and as transferred the KV of the rest. The printed table
//! must add up what the router reported; the requests must carry the workload's prompts and
//! salts; a failed or stuck request is counted, never waited for forever.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use tandem_proto::v1;
use tandem_proto::v1::tandem_server::{Tandem, TandemServer};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Tokens per block of the toy cache.
const BLOCK: usize = 4;
/// KV bytes per token the toy router reports moving.
const BYTES_PER_TOKEN: u64 = 4096;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Serve,
    /// Fail turn 1 of chat 0 after its first token.
    FailChat0Turn1,
    /// Never answer.
    Hang,
}

#[derive(Debug, Clone)]
struct Logged {
    request_id: String,
    salt: String,
    prompt: Vec<u32>,
    answer: Vec<u32>,
    cached: usize,
    bytes: u64,
}

#[derive(Clone)]
struct FakeRouter {
    mode: Mode,
    /// Finished sequences (prompt + answer) per salt.
    cache: Arc<Mutex<HashMap<String, Vec<Vec<u32>>>>>,
    log: Arc<Mutex<Vec<Logged>>>,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[tonic::async_trait]
impl Tandem for FakeRouter {
    type GenerateStream = ReceiverStream<Result<v1::GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let req = request.into_inner();
        let Some(v1::generate_request::Prompt::TokenIds(ids)) = req.prompt else {
            return Err(Status::invalid_argument("token ids expected"));
        };
        let prompt = ids.ids;
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        if self.mode == Mode::Hang {
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_secs(60)).await;
                drop(tx);
            });
            return Ok(Response::new(ReceiverStream::new(rx)));
        }
        // At least one prompt token is always computed.
        let shared = {
            let cache = self.cache.lock().unwrap();
            cache
                .get(&req.cache_salt)
                .into_iter()
                .flatten()
                .map(|s| common_prefix(s, &prompt))
                .max()
                .unwrap_or(0)
        };
        let cached = shared.min(prompt.len() - 1) / BLOCK * BLOCK;
        let bytes = (prompt.len() - cached) as u64 * BYTES_PER_TOKEN;
        let n = req.max_tokens.unwrap() as usize;
        let sum: u64 = prompt.iter().map(|&t| u64::from(t)).sum();
        let answer: Vec<u32> = (0..n as u64).map(|k| ((sum + 7 * k) % 250 + 1) as u32).collect();
        let fail = self.mode == Mode::FailChat0Turn1 && req.request_id.ends_with("-c0t1");
        if !fail {
            let mut seq = prompt.clone();
            seq.extend(&answer);
            self.cache.lock().unwrap().entry(req.cache_salt.clone()).or_default().push(seq);
        }
        self.log.lock().unwrap().push(Logged {
            request_id: req.request_id.clone(),
            salt: req.cache_salt.clone(),
            prompt: prompt.clone(),
            answer: answer.clone(),
            cached,
            bytes,
        });
        tokio::spawn(async move {
            let first = v1::GenerateResponse {
                token_ids: answer[..1].to_vec(),
                prompt_token_ids: prompt.clone(),
                ..Default::default()
            };
            let _ = tx.send(Ok(first)).await;
            if fail {
                let _ = tx.send(Err(Status::aborted("decode worker d-1 failed in Decode"))).await;
                return;
            }
            let last = v1::GenerateResponse {
                token_ids: answer[1..].to_vec(),
                finish_reason: Some("length".into()),
                usage: Some(v1::Usage {
                    prompt_tokens: prompt.len() as u32,
                    completion_tokens: n as u32,
                    cached_tokens: cached as u32,
                }),
                timings: Some(v1::Timings { transfer_bytes: bytes, ttft_ms: 1.0, ..Default::default() }),
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

async fn start_fake(mode: Mode) -> (SocketAddr, FakeRouter) {
    let fake = FakeRouter { mode, cache: Arc::default(), log: Arc::default() };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder().add_service(TandemServer::new(fake.clone())).serve_with_incoming(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        ),
    );
    (addr, fake)
}

/// A small workload: 4 requests sharing a 40-token system prompt, 2 chats of 3 turns.
const SMALL: [&str; 14] = [
    "--system-tokens",
    "40",
    "--question-tokens",
    "8",
    "--requests",
    "4",
    "--chats",
    "2",
    "--turns",
    "3",
    "--answer-tokens",
    "4",
    "--seed",
    "5",
];

async fn bench(router: SocketAddr, extra: &[&str]) -> Output {
    let args: Vec<String> = ["bench", "--router", &router.to_string(), "--workload", "shared-prefix"]
        .iter()
        .chain(SMALL.iter())
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(&args)
            .env_remove("TANDEM_ROUTER")
            .env_remove("TANDEM_API_KEY")
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

/// The request's name in the workload: `s<i>` or `c<chat>t<turn>` (or `warm-up`).
fn key(l: &Logged) -> &str {
    l.request_id.rsplit('-').next().unwrap()
}

fn phase_of(l: &Logged) -> &'static str {
    if l.salt.starts_with("bench-off-") {
        "off"
    } else if l.salt.starts_with("bench-on-") {
        "on"
    } else {
        assert!(l.salt.starts_with("bench-warm-"), "{l:?}");
        "warm-up"
    }
}

/// Table rows by (cache, part): the remaining columns.
fn rows(stdout: &str) -> HashMap<(String, String), Vec<String>> {
    stdout
        .lines()
        .filter(|l| l.starts_with("| off |") || l.starts_with("| on |"))
        .map(|l| {
            let cols: Vec<String> = l.trim_matches('|').split('|').map(|c| c.trim().to_string()).collect();
            ((cols[0].clone(), cols[1].clone()), cols[2..].to_vec())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_adds_up_what_the_router_reported() {
    let (addr, fake) = start_fake(Mode::Serve).await;
    let out = bench(addr, &["--concurrency", "2"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("no sharing is possible"), "{stdout}");
    assert!(stdout.contains("same cluster in the same run"), "{stdout}");
    let log = fake.log.lock().unwrap().clone();
    assert_eq!(log.len(), 2 * (1 + 4 + 2 * 3), "a warm-up and 10 requests per phase");
    assert_eq!(log.iter().filter(|l| phase_of(l) == "warm-up").count(), 2);

    let table = rows(&stdout);
    for phase in ["off", "on"] {
        for (part, prefix) in [("system prompt", "s"), ("chats", "c"), ("all", "")] {
            let reqs: Vec<&Logged> =
                log.iter().filter(|l| phase_of(l) == phase && key(l).starts_with(prefix)).collect();
            let prompt: usize = reqs.iter().map(|l| l.prompt.len()).sum();
            let cached: usize = reqs.iter().map(|l| l.cached).sum();
            let bytes: u64 = reqs.iter().map(|l| l.bytes).sum();
            let row = &table[&(phase.to_string(), part.to_string())];
            assert_eq!(row[0], reqs.len().to_string(), "{phase} {part}: requests");
            assert_eq!(row[1], "0", "{phase} {part}: failed");
            assert!(
                row[2].parse::<f64>().unwrap() > 0.0
                    && row[3].parse::<f64>().unwrap() >= row[2].parse().unwrap()
            );
            assert_eq!(row[4], prompt.to_string(), "{phase} {part}: prompt tokens");
            assert_eq!(row[5], (prompt - cached).to_string(), "{phase} {part}: computed");
            assert_eq!(row[6], cached.to_string(), "{phase} {part}: cached");
            assert_eq!(
                row[7],
                format!("{:.2}", bytes as f64 / (1u64 << 20) as f64),
                "{phase} {part}: KV MiB"
            );
            if phase == "off" {
                assert_eq!(cached, 0, "nothing is shared with a salt per request");
            } else {
                assert!(cached > 0, "{part}: the cache-on phase shares");
            }
        }
    }
    // The toy cache saves: the saving line shows a positive share for every part.
    for part in ["system prompt", "chats", "all"] {
        let line = stdout.lines().find(|l| l.starts_with(&format!("| {part} |"))).unwrap();
        let cols: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert!(cols[1].ends_with('x'), "{line}");
        let saved: f64 = cols[2].trim_end_matches('%').parse().unwrap();
        assert!(saved > 0.0 && saved < 100.0, "{line}");
        let bytes_saved: f64 = cols[3].trim_end_matches('%').parse().unwrap();
        assert!(bytes_saved > 0.0, "{line}");
    }

    // Salts: one per request with the cache off, one for the run with it on.
    let off: Vec<&Logged> = log.iter().filter(|l| phase_of(l) == "off").collect();
    let on: Vec<&Logged> = log.iter().filter(|l| phase_of(l) == "on").collect();
    assert_eq!(off.iter().map(|l| &l.salt).collect::<HashSet<_>>().len(), off.len());
    assert_eq!(on.iter().map(|l| &l.salt).collect::<HashSet<_>>().len(), 1);

    // Prompts: the same in both phases for the system part, a shared system prompt, distinct
    // questions; chat turns extend the previous prompt and the router's answer.
    let by_key = |set: &[&Logged], k: &str| set.iter().find(|l| key(l) == k).map(|l| (*l).clone()).unwrap();
    let system = by_key(&off, "s0").prompt[..40].to_vec();
    let mut questions = HashSet::new();
    for i in 0..4 {
        let p = by_key(&off, &format!("s{i}")).prompt;
        assert_eq!(p, by_key(&on, &format!("s{i}")).prompt);
        assert_eq!(p.len(), 48);
        assert_eq!(p[..40], system[..]);
        assert!(questions.insert(p[40..].to_vec()));
    }
    for set in [&off, &on] {
        for c in 0..2 {
            let mut prev = by_key(set, &format!("c{c}t0"));
            assert_eq!(prev.prompt.len(), 8);
            for t in 1..3 {
                let cur = by_key(set, &format!("c{c}t{t}"));
                let mut expect = prev.prompt.clone();
                expect.extend(&prev.answer);
                assert_eq!(cur.prompt[..expect.len()], expect[..], "c{c}t{t}");
                assert_eq!(cur.prompt.len(), expect.len() + 8);
                prev = cur;
            }
        }
    }
    assert!(log.iter().all(|l| l.prompt.iter().all(|&t| (1..256).contains(&t))));

    // Again, as JSON: the same seed sends the same prompts under new salts.
    let before = log.len();
    let out = bench(addr, &["--concurrency", "2", "--json"]).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let log = fake.log.lock().unwrap().clone();
    let again: Vec<&Logged> = log[before..].iter().filter(|l| phase_of(l) == "on").collect();
    assert_eq!(by_key(&again, "s2").prompt, by_key(&on, "s2").prompt);
    assert_ne!(again[0].salt, on[0].salt, "a new run, a new salt");
    let cached: usize = again.iter().map(|l| l.cached).sum();
    assert_eq!(v["on"]["all"]["cached_tokens"], cached);
    assert_eq!(v["off"]["all"]["cached_tokens"], 0);
    assert_eq!(v["on"]["all"]["requests"], 10);
    let saved = v["on_vs_off"]["all"]["computed_tokens_saved"].as_f64().unwrap();
    let (off_c, on_c) = (
        v["off"]["all"]["computed_tokens"].as_f64().unwrap(),
        v["on"]["all"]["computed_tokens"].as_f64().unwrap(),
    );
    assert!((saved - (1.0 - on_c / off_c)).abs() < 1e-12);
    assert!(v["baseline"].as_str().unwrap().contains("no sharing is possible"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_chat_turn_is_counted_and_its_chat_stops() {
    let (addr, fake) = start_fake(Mode::FailChat0Turn1).await;
    let out = bench(addr, &["--concurrency", "2"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}\n{stdout}");
    assert!(stderr.contains("2 of 10 cache-off requests failed"), "{stderr}");
    assert!(stderr.contains("c0t1: Aborted: decode worker d-1 failed in Decode"), "{stderr}");
    let table = rows(&stdout);
    for phase in ["off", "on"] {
        assert_eq!(table[&(phase.into(), "chats".into())][..2], ["6".to_string(), "2".into()]);
        assert_eq!(table[&(phase.into(), "system prompt".into())][1], "0");
    }
    let log = fake.log.lock().unwrap();
    assert!(log.iter().all(|l| key(l) != "c0t2"), "turn 2 of chat 0 needs turn 1's answer: never sent");
    assert_eq!(log.iter().filter(|l| key(l) == "c1t2").count(), 2, "the other chat goes on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_never_answers_fails_the_bench_instead_of_hanging_it() {
    let (addr, _fake) = start_fake(Mode::Hang).await;
    let out = bench(addr, &["--concurrency", "4", "--request-timeout-s", "1"]).await;
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("every request of the cache-off phase failed (10)"), "{stderr}");
    assert!(stderr.contains("not finished after 1 s"), "{stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn shared_prefix_needs_a_router() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench", "--workload", "shared-prefix"])
        .env_remove("TANDEM_ROUTER")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--workload shared-prefix") && err.contains("--router"), "{err}");
}
