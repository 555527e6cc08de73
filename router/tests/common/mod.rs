//! Test helpers: start the real `tandem-router` binary, fake workers that follow the worker
//! protocol with scripted tokens (so the router's orchestration is tested without a model), and
//! a TCP proxy that can be cut to simulate a worker dying.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use tandem_proto::v1::worker_server::{Worker, WorkerServer};
use tandem_proto::v1::{
    self, AdapterInfo, ListAdaptersRequest, ListAdaptersResponse, LoadAdapterRequest, Role,
    UnloadAdapterRequest, UnloadAdapterResponse, WorkerInfo,
};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The tiny reference model (vocabulary 448, context 512) the router reads its tokenizer from.
pub fn tiny_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa")
}

/// The running router binary.
pub struct RouterProc {
    child: Child,
    /// The gRPC server.
    pub addr: SocketAddr,
    /// The HTTP server, when the router announced one.
    pub http: Option<SocketAddr>,
    stderr: Arc<Mutex<String>>,
}

impl RouterProc {
    /// Starts `tandem-router --listen 127.0.0.1:0 --model <tiny> <extra...>` and waits for its
    /// listening line.
    pub fn start(extra: &[&str]) -> RouterProc {
        RouterProc::start_with_model(&tiny_model(), extra)
    }

    /// [`RouterProc::start`] on another model directory.
    pub fn start_with_model(model: &std::path::Path, extra: &[&str]) -> RouterProc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tandem-router"))
            .args(["--listen", "127.0.0.1:0", "--model"])
            .arg(model)
            .args(extra)
            .env_remove("TANDEM_CONFIG")
            .env_remove("TANDEM_WORKER")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting tandem-router");
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().expect("piped stderr");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let out = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("no listening line from tandem-router; stderr:\n{}", stderr.lock().unwrap())
        });
        let l = tandem_serve::config::parse_listening(&line)
            .unwrap_or_else(|| panic!("unexpected first stdout line {line:?}"));
        RouterProc { child, addr: l.grpc, http: l.http, stderr }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    pub fn sigterm(&self) {
        // SAFETY: signalling our own child process, not yet reaped.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
    }

    /// Waits for the process to exit (panics after `timeout`).
    pub fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return st;
            }
            assert!(std::time::Instant::now() < deadline, "router did not exit; stderr:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .expect("connecting to the router")
    }
}

impl Drop for RouterProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `tandem-router` with `args` and returns (exit code, stderr).
pub fn run_router(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-router"))
        .args(args)
        .env_remove("TANDEM_CONFIG")
        .output()
        .expect("running tandem-router");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The tiny model's id, as the router computes it.
pub fn tiny_model_id() -> String {
    tandem_serve::identity::model_identity(&tiny_model()).expect("tiny model identity").model_id
}

pub fn compat(model_id: &str, block_size: u32) -> v1::CompatRecord {
    v1::CompatRecord {
        protocol_version: tandem_proto::PROTOCOL_VERSION,
        model_id: model_id.into(),
        model_name: "tiny".into(),
        kv_dtype: "f32".into(),
        block_size,
        num_layers: 3,
        num_kv_heads: 2,
        head_dim: 16,
        kv_layout: "test".into(),
        vocab_size: 448,
        max_position_embeddings: 512,
        kv_token_stride: 128,
        kv_block_stride: 2048,
        kv_windows: Vec::new(),
    }
}

/// A worker record with a tcp offer (decode workers: at `kv`).
pub fn worker_info(id: &str, role: Role, address: SocketAddr, block_size: u32) -> WorkerInfo {
    let transports = match role {
        Role::Colocated => Vec::new(),
        Role::Decode => vec![v1::TransportOffer {
            kind: "tcp".into(),
            address: "127.0.0.1:9".into(),
            ..Default::default()
        }],
        _ => vec![v1::TransportOffer { kind: "tcp".into(), ..Default::default() }],
    };
    WorkerInfo {
        worker_id: id.into(),
        role: role as i32,
        address: address.to_string(),
        compat: Some(compat(&tiny_model_id(), block_size)),
        transports,
        device: "cpu".into(),
        total_blocks: 64,
        max_sequence_len: 512,
        speculation: None,
        prefix_cache: false,
        ..Default::default()
    }
}

/// The token rules a worker applies to the `generated`-th token (counting the first) it made
/// after a prompt of `prompt_len` tokens, in a context of `max_len`: a stop token ends the
/// sequence with "stop", the `max_tokens`-th token or a full context with "length".
fn token_rule(
    p: &v1::EngineParams,
    token: u32,
    generated: usize,
    prompt_len: usize,
    max_len: u32,
) -> Option<String> {
    if p.stop_token_ids.contains(&token) {
        Some("stop".into())
    } else if generated >= p.max_tokens as usize || prompt_len + generated >= max_len as usize {
        Some("length".into())
    } else {
        None
    }
}

/// A worker that answers the protocol with scripted tokens and records what it was asked.
///
/// The script is followed like a greedy model would: a prompt whose last token is `script[i]`
/// continues with `script[i + 1]` (any other prompt with `script[0]`), so a request moved to
/// another fake with the tokens streamed so far appended to its prompt continues the script.
#[derive(Clone)]
pub struct FakeWorker(pub Arc<FakeState>);

pub struct FakeState {
    pub info: Mutex<WorkerInfo>,
    /// Generated tokens in order (the prefill worker's first token is `script[0]`).
    pub script: Vec<u32>,
    /// Decode stops sending after this many generated tokens (counting the first) and holds the
    /// stream open until the router drops it.
    pub hold_after: Option<usize>,
    /// Pause before each decode token.
    pub token_delay: Mutex<Duration>,
    /// While true, decode streams wait before each token (set with `send_replace`).
    pub paused: tokio::sync::watch::Sender<bool>,
    pub calls: Mutex<Vec<String>>,
    pub decode_dropped: AtomicUsize,
    pub prefills: Mutex<Vec<v1::PrefillRequest>>,
    pub decodes: Mutex<Vec<v1::DecodeRequest>>,
    pub releases: Mutex<Vec<v1::ReleaseRequest>>,
    /// (method, cluster secret the caller presented) for every call, in order.
    pub secrets: Mutex<Vec<(String, Option<String>)>>,
    /// `Reserve` calls still to refuse with RESOURCE_EXHAUSTED, as a full decode worker does
    /// (`usize::MAX`: all of them).
    pub full_reserves: AtomicUsize,
    /// `num_tokens` of each `Reserve` granted, in order.
    pub granted: Mutex<Vec<u32>>,
    /// Answer `Reserve` with UNAVAILABLE, as a worker that has begun draining does.
    pub draining: std::sync::atomic::AtomicBool,
    /// Every `Reserve` request, in order.
    pub reserves: Mutex<Vec<v1::ReserveRequest>>,
    /// When set, `Reserve` answers with these `cached_blocks` and `block_ids`, as they are.
    pub reserve_answer: Mutex<Option<(u32, Vec<u32>)>>,
    /// Prompt tokens this worker says it took from its prefix cache: in `Prefill`'s answer, and
    /// in the first message of a colocated `Decode` (when nonzero).
    pub cached_tokens: std::sync::atomic::AtomicU32,
    /// The cache digest `Stats` reports.
    pub digest: Mutex<Option<v1::CacheDigest>>,
    /// A decode stream fails with this code once it has this many tokens (counting the first).
    pub fail_after: Mutex<Option<(usize, tonic::Code)>>,
    /// Run by the next `Prefill`, which then fails with the status it returns.
    pub prefill_hook: Mutex<Option<PrefillHook>>,
    /// While true, `Prefill` and `Info` never answer (a frozen worker, or a dying one mid-prefill).
    pub prefill_hang: std::sync::atomic::AtomicBool,
    /// `LoadAdapter` fails with this code and message (a missing file, a full worker, ...).
    pub load_error: Mutex<Option<(tonic::Code, String)>>,
    /// Every `LoadAdapter` (`"load <name> <path>"`) and `UnloadAdapter` (`"unload <name>"`), in
    /// order.
    pub adapter_calls: Mutex<Vec<String>>,
    /// The version of its adapter set: each load, unload and `hold` bumps it.
    pub adapters_version: AtomicU64,
}

/// What a fake prefill worker does instead of answering one `Prefill`.
pub type PrefillHook = Box<dyn FnOnce() -> Status + Send>;

impl FakeWorker {
    pub fn new(info: WorkerInfo, script: Vec<u32>, hold_after: Option<usize>) -> FakeWorker {
        FakeWorker(Arc::new(FakeState {
            info: Mutex::new(info),
            script,
            hold_after,
            token_delay: Mutex::new(Duration::ZERO),
            paused: tokio::sync::watch::channel(false).0,
            calls: Mutex::new(Vec::new()),
            decode_dropped: AtomicUsize::new(0),
            prefills: Mutex::new(Vec::new()),
            decodes: Mutex::new(Vec::new()),
            releases: Mutex::new(Vec::new()),
            secrets: Mutex::new(Vec::new()),
            full_reserves: AtomicUsize::new(0),
            granted: Mutex::new(Vec::new()),
            draining: std::sync::atomic::AtomicBool::new(false),
            reserves: Mutex::new(Vec::new()),
            reserve_answer: Mutex::new(None),
            cached_tokens: std::sync::atomic::AtomicU32::new(0),
            digest: Mutex::new(None),
            fail_after: Mutex::new(None),
            prefill_hook: Mutex::new(None),
            prefill_hang: std::sync::atomic::AtomicBool::new(false),
            load_error: Mutex::new(None),
            adapter_calls: Mutex::new(Vec::new()),
            adapters_version: AtomicU64::new(0),
        }))
    }

    /// The adapters it holds now (they are part of its record: `Info` and registration carry
    /// them).
    pub fn adapters(&self) -> Vec<AdapterInfo> {
        self.0.info.lock().unwrap().adapters.clone()
    }

    /// Holds `adapters` (as loaded before it registered), with room for `max` of them.
    pub fn hold(&self, adapters: Vec<AdapterInfo>, max: u32) {
        let mut info = self.0.info.lock().unwrap();
        info.adapters = adapters;
        info.max_adapters = max;
        self.0.adapters_version.fetch_add(1, Ordering::SeqCst);
    }

    /// The heartbeat that tells the router which adapters it holds now.
    pub fn adapter_heartbeat(&self) -> v1::HeartbeatRequest {
        let info = self.0.info.lock().unwrap();
        v1::HeartbeatRequest {
            worker_id: info.worker_id.clone(),
            load: Some(v1::WorkerLoad {
                total_blocks: info.total_blocks,
                free_blocks: info.total_blocks,
                ..Default::default()
            }),
            adapters: info.adapters.clone(),
            adapters_set: true,
            adapters_version: self.0.adapters_version.load(Ordering::SeqCst),
            ..Default::default()
        }
    }

    /// `(call, adapter, adapter_id)` of every `Reserve`, `Prefill` and `Decode` it was sent, in
    /// that order of kinds.
    pub fn adapter_fields(&self) -> Vec<(String, String, String)> {
        let mut out = Vec::new();
        for r in self.0.reserves.lock().unwrap().iter() {
            out.push(("Reserve".to_owned(), r.adapter.clone(), r.adapter_id.clone()));
        }
        for r in self.0.prefills.lock().unwrap().iter() {
            let p = r.params.clone().unwrap_or_default();
            out.push(("Prefill".to_owned(), p.adapter, p.adapter_id));
        }
        for r in self.0.decodes.lock().unwrap().iter() {
            let p = r.params.clone().unwrap_or_default();
            out.push(("Decode".to_owned(), p.adapter, p.adapter_id));
        }
        out
    }

    pub fn adapter_calls(&self) -> Vec<String> {
        self.0.adapter_calls.lock().unwrap().clone()
    }

    /// A worker's refusal of a request under an adapter it does not hold (NOT_FOUND) or holds
    /// under another id (FAILED_PRECONDITION), marked as a real worker marks it.
    fn check_adapter(&self, name: &str, id: &str) -> Result<(), Status> {
        if name.is_empty() {
            return Ok(());
        }
        match self.adapters().iter().find(|a| a.name == name) {
            None => Err(tandem_proto::mark_adapter_refusal(
                Status::not_found(format!("no LoRA adapter `{name}` on this worker")),
                tandem_proto::ADAPTER_UNKNOWN,
            )),
            Some(a) if !id.is_empty() && a.id != id => Err(tandem_proto::mark_adapter_refusal(
                Status::failed_precondition(format!("LoRA adapter `{name}` here has id {}, not {id}", a.id)),
                tandem_proto::ADAPTER_OTHER_WEIGHTS,
            )),
            Some(_) => Ok(()),
        }
    }

    /// Where the script continues after `prompt`.
    fn script_start(&self, prompt: &[u32]) -> usize {
        let last = prompt.last().copied();
        self.0.script.iter().position(|&t| Some(t) == last).map_or(0, |i| i + 1)
    }

    pub fn calls(&self) -> Vec<String> {
        self.0.calls.lock().unwrap().clone()
    }

    fn log(&self, s: String) {
        self.0.calls.lock().unwrap().push(s);
    }

    pub fn releases(&self) -> Vec<v1::ReleaseRequest> {
        self.0.releases.lock().unwrap().clone()
    }

    /// (method, presented cluster secret) of every call so far.
    pub fn secrets(&self) -> Vec<(String, Option<String>)> {
        self.0.secrets.lock().unwrap().clone()
    }

    fn saw<T>(&self, method: &str, r: &Request<T>) {
        let secret = r
            .metadata()
            .get("x-tandem-cluster-secret")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        self.0.secrets.lock().unwrap().push((method.to_owned(), secret));
    }
}

#[tonic::async_trait]
impl Worker for FakeWorker {
    async fn load_adapter(&self, req: Request<LoadAdapterRequest>) -> Result<Response<AdapterInfo>, Status> {
        self.saw("LoadAdapter", &req);
        let req = req.into_inner();
        self.0.adapter_calls.lock().unwrap().push(format!("load {} {}", req.name, req.path));
        if let Some((code, msg)) = self.0.load_error.lock().unwrap().clone() {
            return Err(Status::new(code, msg));
        }
        let loaded = fake_adapter(&req.name, &req.path);
        let mut info = self.0.info.lock().unwrap();
        match info.adapters.iter().find(|a| a.name == req.name) {
            Some(a) if a.id != loaded.id => {
                return Err(Status::failed_precondition(format!(
                    "LoRA adapter `{}` is already held with other weights (id {})",
                    req.name, a.id
                )))
            }
            Some(a) => {
                let version = self.0.adapters_version.load(Ordering::SeqCst);
                return Ok(Response::new(AdapterInfo { adapters_version: version, ..a.clone() }));
            }
            None => info.adapters.push(loaded.clone()),
        }
        let version = self.0.adapters_version.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Response::new(AdapterInfo { adapters_version: version, ..loaded }))
    }

    async fn unload_adapter(
        &self,
        req: Request<UnloadAdapterRequest>,
    ) -> Result<Response<UnloadAdapterResponse>, Status> {
        self.saw("UnloadAdapter", &req);
        let req = req.into_inner();
        self.0.adapter_calls.lock().unwrap().push(format!("unload {}", req.name));
        let mut info = self.0.info.lock().unwrap();
        let before = info.adapters.len();
        info.adapters.retain(|a| a.name != req.name);
        let unloaded = info.adapters.len() < before;
        let version = if unloaded {
            self.0.adapters_version.fetch_add(1, Ordering::SeqCst) + 1
        } else {
            self.0.adapters_version.load(Ordering::SeqCst)
        };
        Ok(Response::new(UnloadAdapterResponse { unloaded, adapters_version: version }))
    }

    async fn list_adapters(
        &self,
        req: Request<ListAdaptersRequest>,
    ) -> Result<Response<ListAdaptersResponse>, Status> {
        self.saw("ListAdapters", &req);
        let info = self.0.info.lock().unwrap();
        Ok(Response::new(ListAdaptersResponse {
            adapters: info.adapters.clone(),
            max_adapters: info.max_adapters,
            adapters_version: self.0.adapters_version.load(Ordering::SeqCst),
        }))
    }

    type DecodeStream = ReceiverStream<Result<v1::DecodeResponse, Status>>;

    async fn info(&self, r: Request<v1::InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        self.saw("Info", &r);
        self.log("Info".into());
        if self.0.prefill_hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await; // frozen: nothing answers
        }
        Ok(Response::new(self.0.info.lock().unwrap().clone()))
    }

    async fn stats(&self, r: Request<v1::StatsRequest>) -> Result<Response<v1::StatsResponse>, Status> {
        self.saw("Stats", &r);
        let total = self.0.info.lock().unwrap().total_blocks;
        Ok(Response::new(v1::StatsResponse {
            load: Some(v1::WorkerLoad { total_blocks: total, free_blocks: total, ..Default::default() }),
            cache: self.0.digest.lock().unwrap().clone(),
            ..Default::default()
        }))
    }

    async fn reserve(&self, r: Request<v1::ReserveRequest>) -> Result<Response<v1::ReserveResponse>, Status> {
        self.saw("Reserve", &r);
        let r = r.into_inner();
        self.log(format!("Reserve {}", r.num_tokens));
        self.0.reserves.lock().unwrap().push(r.clone());
        self.check_adapter(&r.adapter, &r.adapter_id)?;
        if self.0.draining.load(Ordering::SeqCst) {
            return Err(Status::unavailable("the worker is draining (shutting down) and takes no new work"));
        }
        let full = self.0.full_reserves.load(Ordering::SeqCst);
        if full > 0 {
            if full != usize::MAX {
                self.0.full_reserves.fetch_sub(1, Ordering::SeqCst);
            }
            return Err(Status::resource_exhausted(format!(
                "out of KV blocks: {} needed, 0 free",
                r.num_tokens.div_ceil(16)
            )));
        }
        let bs = self.0.info.lock().unwrap().compat.as_ref().unwrap().block_size;
        let n = r.num_tokens.div_ceil(bs);
        self.0.granted.lock().unwrap().push(r.num_tokens);
        if let Some((cached_blocks, block_ids)) = self.0.reserve_answer.lock().unwrap().clone() {
            return Ok(Response::new(v1::ReserveResponse {
                reservation_id: 7,
                block_ids,
                lease_ms: 5000,
                cached_blocks,
            }));
        }
        Ok(Response::new(v1::ReserveResponse {
            reservation_id: 7,
            block_ids: (0..n).collect(),
            lease_ms: 5000,
            cached_blocks: 0,
        }))
    }

    async fn prefill(&self, r: Request<v1::PrefillRequest>) -> Result<Response<v1::PrefillResponse>, Status> {
        self.saw("Prefill", &r);
        let r = r.into_inner();
        self.log(format!("Prefill {}", r.prompt_token_ids.len()));
        let first = self.script_start(&r.prompt_token_ids);
        let prompt_len = r.prompt_token_ids.len();
        let (prompt_logprobs, prompt_top_logprobs) =
            fake_prompt_scores(&r.params.clone().unwrap_or_default(), &r.prompt_token_ids);
        let params = r.params.clone().unwrap_or_default();
        self.0.prefills.lock().unwrap().push(r);
        self.check_adapter(&params.adapter, &params.adapter_id)?;
        let hook = self.0.prefill_hook.lock().unwrap().take();
        if let Some(hook) = hook {
            return Err(hook());
        }
        if self.0.prefill_hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        // The token rules, as a worker applies them to the token it sampled.
        let token = self.0.script[first];
        let params =
            self.0.prefills.lock().unwrap().last().and_then(|r| r.params.clone()).unwrap_or_default();
        Ok(Response::new(v1::PrefillResponse {
            first_token: token,
            logprob: -0.5,
            first_top_logprobs: fake_top(&params, token, -0.5),
            queue_ms: 1.0,
            compute_ms: 2.0,
            transfer_ms: 3.0,
            transfer_bytes: 100,
            cached_tokens: self.0.cached_tokens.load(Ordering::SeqCst),
            prompt_logprobs,
            prompt_top_logprobs,
            finish_reason: token_rule(
                &params,
                token,
                1,
                prompt_len,
                self.0.info.lock().unwrap().max_sequence_len,
            ),
        }))
    }

    async fn decode(&self, r: Request<v1::DecodeRequest>) -> Result<Response<Self::DecodeStream>, Status> {
        self.saw("Decode", &r);
        let r = r.into_inner();
        self.log(format!("Decode reservation={} first={:?}", r.reservation_id, r.first_token));
        let params = r.params.clone().unwrap_or_default();
        let max = params.max_tokens as usize;
        let (prompt_len, max_len) = (r.prompt_token_ids.len(), self.0.info.lock().unwrap().max_sequence_len);
        let first_given = usize::from(r.first_token.is_some());
        let start = self.script_start(&r.prompt_token_ids);
        let n = r.n.max(1) as usize;
        // Each choice walks the script from the start; choice 0 past the token it was given.
        let mut choices: Vec<(usize, usize, bool)> = (0..n)
            .map(|i| if i == 0 { (start + first_given, first_given, false) } else { (start, 0, false) })
            .collect();
        let cached = self.0.cached_tokens.load(Ordering::SeqCst);
        let mut cached_tokens = (first_given == 0 && cached > 0).then_some(cached);
        self.0.decodes.lock().unwrap().push(r);
        self.check_adapter(&params.adapter, &params.adapter_id)?;
        let fail_after = *self.0.fail_after.lock().unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let me = self.clone();
        tokio::spawn(async move {
            'steps: loop {
                let mut sent_any = false;
                for (index, (next, generated, done)) in choices.iter_mut().enumerate() {
                    // Tokens of this sequence so far, counting the prefill worker's first.
                    if *done || *generated >= max || *next >= me.0.script.len() {
                        continue;
                    }
                    if me.0.hold_after.is_some_and(|h| *generated >= h) {
                        continue;
                    }
                    if let Some((n, code)) = fail_after.filter(|(n, _)| *generated >= *n) {
                        let _ = tx.send(Err(Status::new(code, format!("failing after {n} tokens")))).await;
                        return;
                    }
                    let delay = *me.0.token_delay.lock().unwrap();
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    let mut paused = me.0.paused.subscribe();
                    tokio::select! {
                        _ = paused.wait_for(|p| !*p) => {}
                        _ = tx.closed() => {
                            me.0.decode_dropped.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    }
                    let token = me.0.script[*next];
                    *next += 1;
                    *generated += 1;
                    let finish = token_rule(&params, token, *generated, prompt_len, max_len);
                    *done = finish.is_some();
                    let msg = v1::DecodeResponse {
                        token_ids: vec![token],
                        logprobs: vec![-1.0],
                        finish_reason: finish,
                        cached_tokens: cached_tokens.take(),
                        top_logprobs: fake_top(&params, token, -1.0).into_iter().collect(),
                        index: index as u32,
                        prompt_logprobs: Vec::new(),
                        prompt_top_logprobs: Vec::new(),
                    };
                    if tx.send(Ok(msg)).await.is_err() {
                        me.0.decode_dropped.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    sent_any = true;
                }
                if !sent_any {
                    break 'steps;
                }
            }
            // Holding (or out of script): wait until the router drops the stream.
            tx.closed().await;
            me.0.decode_dropped.fetch_add(1, Ordering::SeqCst);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn release(&self, r: Request<v1::ReleaseRequest>) -> Result<Response<v1::ReleaseResponse>, Status> {
        self.saw("Release", &r);
        let r = r.into_inner();
        self.log(format!("Release {}", r.reservation_id));
        self.0.releases.lock().unwrap().push(r);
        Ok(Response::new(v1::ReleaseResponse { released: true }))
    }
}

/// The adapter a fake worker loads from `path` under `name`: its id (32 hex digits) follows
/// from the path, as a real id follows from the weights.
pub fn fake_adapter(name: &str, path: &str) -> AdapterInfo {
    use std::hash::{Hash, Hasher};
    let half = |seed: u8| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (seed, path).hash(&mut h);
        h.finish()
    };
    AdapterInfo {
        name: name.into(),
        id: format!("{:016x}{:016x}", half(1), half(2)),
        rank: 8,
        resident: false,
        source: path.into(),
        targets: vec!["q_proj".into(), "v_proj".into()],
        bytes: 4096,
        adapters_version: 0,
    }
}

/// Serves `fake` on an OS-picked port; returns its address.
pub async fn serve(fake: FakeWorker) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WorkerServer::new(fake))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    addr
}

/// A TCP proxy in front of a worker; `kill` drops every connection and the listener, as if the
/// worker process had died.
pub struct Proxy {
    pub addr: SocketAddr,
    accept: JoinHandle<()>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let c2 = conns.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                c2.lock().unwrap().push(task);
            }
        });
        Proxy { addr, accept, conns }
    }

    pub fn kill(&self) {
        self.accept.abort();
        for t in self.conns.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}

/// Collected output of one Generate stream.
#[derive(Debug, Default, Clone)]
pub struct Collected {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: Option<String>,
    pub request_id: String,
    pub usage: Option<v1::Usage>,
    pub timings: Option<v1::Timings>,
    pub messages: usize,
}

pub async fn generate(ch: Channel, req: v1::GenerateRequest) -> Result<Collected, Status> {
    let mut client = v1::tandem_client::TandemClient::new(ch);
    let mut stream = client.generate(req).await?.into_inner();
    let mut c = Collected::default();
    while let Some(m) = stream.message().await? {
        c.messages += 1;
        if c.messages == 1 {
            c.prompt_token_ids = m.prompt_token_ids.clone();
            c.request_id = m.request_id.clone();
        }
        c.token_ids.extend(&m.token_ids);
        c.text.push_str(&m.text);
        if m.finish_reason.is_some() {
            c.finish_reason = m.finish_reason;
            c.usage = m.usage;
            c.timings = m.timings;
        }
    }
    Ok(c)
}

pub fn token_prompt(ids: Vec<u32>, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids })),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

/// Polls `f` every 20 ms until it is true (panics with `what` after 10 s).
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The router's `/metrics` text.
pub async fn router_metrics(router: &RouterProc) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = router.http.expect("the router announces its HTTP address");
    let io = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    let out = tokio::time::timeout(Duration::from_secs(10), io).await.expect("metrics in time");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out.split_once("\r\n\r\n").map_or("", |x| x.1).to_owned()
}

/// The value of the unlabelled sample `name` in Prometheus text.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A failure inside the cluster as a client sees it: a fixed sentence ending in the request id
/// (also in `x-request-id`), never a worker id, an address or a worker's own words; the router's
/// log has what happened, under that id. `detail` are words the log line must hold.
pub async fn assert_concealed(err: &Status, router: &RouterProc, detail: &[&str]) {
    let id = err
        .metadata()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no x-request-id on {err:?}"))
        .to_owned();
    let msg = err.message().strip_suffix(&format!(" (request id {id})")).unwrap_or_else(|| panic!("{err:?}"));
    for leak in ["d-1", "d-2", "p-1", "c-1", "127.0.0.1", "Reserve", "Decode", "Prefill", "KV blocks)"] {
        assert!(!msg.contains(leak), "the client was told `{leak}`: {err:?}");
    }
    eventually("the router logs the failure with its detail", || {
        let log = router.stderr();
        log.lines().any(|l| l.contains(&id) && detail.iter().all(|d| l.contains(d)))
    })
    .await;
}

/// The alternatives a fake worker reports when `params` asks for them: the token itself first
/// (at `logprob`), then the ids after it, each one less likely.
/// What the fake prefill worker says of a prompt asked to be scored: prompt token `j` (from the
/// second) gets log-probability `-(j as f32) / 10`, and its alternatives start with itself.
pub fn fake_prompt_scores(params: &v1::EngineParams, prompt: &[u32]) -> (Vec<f32>, Vec<v1::TopLogprobs>) {
    let Some(k) = params.prompt_logprobs else { return (Vec::new(), Vec::new()) };
    let lps: Vec<f32> = (1..prompt.len()).map(|j| -(j as f32) / 10.0).collect();
    let tops = if k == 0 {
        Vec::new()
    } else {
        prompt[1..]
            .iter()
            .zip(&lps)
            .map(|(&t, &lp)| v1::TopLogprobs {
                token_ids: (0..k).map(|i| t + i).collect(),
                logprobs: (0..k).map(|i| lp - i as f32).collect(),
            })
            .collect()
    };
    (lps, tops)
}

pub fn fake_top(params: &v1::EngineParams, token: u32, logprob: f32) -> Option<v1::TopLogprobs> {
    let n = params.top_logprobs;
    (n > 0).then(|| v1::TopLogprobs {
        token_ids: (0..n).map(|i| token + i).collect(),
        logprobs: (0..n).map(|i| logprob - i as f32).collect(),
    })
}
