//! Registration of the real `tandem-decode` binary with a stand-in registry: retries until the
//! router answers, heartbeats at the interval the router asks for, registers again when the router
//! no longer knows it, deregisters on SIGTERM, and exits 1 when the router refuses it or its
//! cluster secret. Readiness waits for the registration.

mod common;

use std::sync::{Arc, Mutex};

use common::{eventually, http_get, metrics, sample, tiny_model, Proc};
use tandem_proto::v1::registry_server::{Registry, RegistryServer};
use tandem_proto::v1::{
    DeregisterRequest, DeregisterResponse, HeartbeatRequest, HeartbeatResponse, RegisterResponse, Role,
    WorkerInfo,
};
use tonic::{Request, Response, Status};

const BIN: &str = env!("CARGO_BIN_EXE_tandem-decode");

#[derive(Default)]
struct Log {
    registers: Vec<WorkerInfo>,
    heartbeats: Vec<HeartbeatRequest>,
    deregisters: Vec<String>,
}

#[derive(Clone)]
struct FakeRegistry {
    log: Arc<Mutex<Log>>,
    /// Refuse every registration with this message.
    refuse: Option<String>,
    /// The cluster secret every call must carry.
    secret: Option<String>,
}

impl FakeRegistry {
    fn check<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let Some(want) = &self.secret else { return Ok(()) };
        match req.metadata().get("x-tandem-cluster-secret").map(|v| v.to_str().unwrap_or_default()) {
            Some(got) if got == want => Ok(()),
            Some(_) => Err(Status::unauthenticated("wrong cluster secret")),
            None => Err(Status::unauthenticated("missing cluster secret")),
        }
    }
}

#[tonic::async_trait]
impl Registry for FakeRegistry {
    async fn register(&self, req: Request<WorkerInfo>) -> Result<Response<RegisterResponse>, Status> {
        self.check(&req)?;
        if let Some(m) = &self.refuse {
            return Err(Status::failed_precondition(m.clone()));
        }
        self.log.lock().unwrap().registers.push(req.into_inner());
        Ok(Response::new(RegisterResponse { heartbeat_interval_ms: 50, router_id: "fake".into() }))
    }

    async fn heartbeat(&self, req: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        self.check(&req)?;
        let mut log = self.log.lock().unwrap();
        log.heartbeats.push(req.into_inner());
        // The first heartbeat after the first registration: pretend the router restarted.
        let known = !(log.registers.len() == 1 && log.heartbeats.len() == 1);
        Ok(Response::new(HeartbeatResponse { known }))
    }

    async fn deregister(
        &self,
        req: Request<DeregisterRequest>,
    ) -> Result<Response<DeregisterResponse>, Status> {
        self.check(&req)?;
        self.log.lock().unwrap().deregisters.push(req.into_inner().worker_id);
        Ok(Response::new(DeregisterResponse {}))
    }
}

async fn serve_registry(listener: tokio::net::TcpListener, reg: FakeRegistry) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let _ = tonic::transport::Server::builder()
            .add_service(RegistryServer::new(reg))
            .serve_with_incoming(incoming)
            .await;
    })
}

fn start(router: &str, extra: &[&str]) -> Proc {
    let model = tiny_model();
    let mut args = vec![
        "--model",
        model.to_str().unwrap(),
        "--kv-blocks",
        "16",
        "--block-size",
        "8",
        "--router",
        router,
        "--worker-id",
        "dec-1",
    ];
    args.extend_from_slice(extra);
    Proc::start(BIN, &args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_heartbeats_registers_again_and_deregisters() {
    // The router is not up yet when the worker starts: it must keep trying.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut w = start(&addr, &["--cluster-secret", "s3cret"]);
    // Serving but not registered: alive, not ready.
    let h = w.http.expect("http=");
    assert_eq!(http_get(h, "/health").await.0, 200);
    let (code, body) = http_get(h, "/ready").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("not registered"), "{body}");
    assert_eq!(sample(&metrics(&w).await, "tandem_worker_ready"), 0.0);

    let log = Arc::new(Mutex::new(Log::default()));
    let listener = tokio::net::TcpListener::bind(&addr).await.expect("binding the registry port again");
    let reg = FakeRegistry { log: log.clone(), refuse: None, secret: Some("s3cret".into()) };
    let server = serve_registry(listener, reg).await;

    let l = log.clone();
    eventually("registered twice and heartbeating", || {
        let l = l.clone();
        async move {
            let l = l.lock().unwrap();
            l.registers.len() == 2 && l.heartbeats.len() >= 3
        }
    })
    .await;
    {
        let l = log.lock().unwrap();
        let info = &l.registers[0];
        assert_eq!(info.worker_id, "dec-1");
        assert_eq!(info.role(), Role::Decode);
        assert_eq!(info.address, w.grpc.to_string());
        assert!(info.compat.is_some());
        assert!(info.transports.iter().any(|o| o.kind == "tcp" && o.address == w.kv.unwrap().to_string()));
        let hb = l.heartbeats.last().unwrap();
        assert_eq!(hb.worker_id, "dec-1");
        let load = hb.load.unwrap();
        assert_eq!((load.total_blocks, load.free_blocks, load.draining), (16, 16, false));
        assert!(l.deregisters.is_empty());
    }
    eventually("ready once registered", || async { http_get(h, "/ready").await.0 == 200 }).await;
    assert_eq!(sample(&metrics(&w).await, "tandem_worker_ready"), 1.0);

    w.signal(libc::SIGTERM);
    let st = w.wait();
    assert_eq!(st.code(), Some(0), "stderr:\n{}", w.stderr());
    assert_eq!(log.lock().unwrap().deregisters, ["dec-1"]);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_registration_exits_1_with_the_reason() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let reason = "block_size: 8 vs 16".to_string();
    let reg = FakeRegistry { log: Arc::default(), refuse: Some(reason.clone()), secret: None };
    let server = serve_registry(listener, reg).await;
    let mut w = start(&addr, &[]);
    let st = w.wait();
    assert_eq!(st.code(), Some(1));
    let err = w.stderr();
    assert!(err.contains("refused") && err.contains(&reason), "{err}");
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_cluster_secret_exits_1_naming_it() {
    for extra in [&["--cluster-secret", "wrong"][..], &[]] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let log = Arc::new(Mutex::new(Log::default()));
        let reg = FakeRegistry { log: log.clone(), refuse: None, secret: Some("right".into()) };
        let server = serve_registry(listener, reg).await;
        let mut w = start(&addr, extra);
        let st = w.wait();
        assert_eq!(st.code(), Some(1), "{extra:?}");
        let err = w.stderr();
        assert!(err.contains("cluster secret") && err.contains("--cluster-secret"), "{extra:?}: {err}");
        assert!(log.lock().unwrap().registers.is_empty());
        server.abort();
    }
}

/// The adapters a worker holds are in its registration (with its slots), and every heartbeat
/// carries the current list (`adapters_set`), so loads and unloads reach the router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_and_heartbeats_advertise_the_adapters() {
    let lora = |n: &str| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/reference/fixtures/lora/llama-gqa")
            .join(n)
            .display()
            .to_string()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let log = Arc::new(Mutex::new(Log::default()));
    let server =
        serve_registry(listener, FakeRegistry { log: log.clone(), refuse: None, secret: None }).await;
    let w = start(&addr, &["--lora", &format!("a={}", lora("a")), "--max-loras", "3"]);
    let heard = |want: &'static [&'static str]| {
        let l = log.clone();
        move || {
            let l = l.clone();
            async move {
                let l = l.lock().unwrap();
                l.heartbeats.last().is_some_and(|hb| {
                    hb.adapters_set && hb.adapters.iter().map(|a| a.name.as_str()).eq(want.iter().copied())
                })
            }
        }
    };
    eventually("a heartbeat with adapter a", heard(&["a"])).await;
    {
        let l = log.lock().unwrap();
        let info = &l.registers[0];
        assert_eq!(info.max_adapters, 3);
        assert_eq!(info.adapters.len(), 1);
        assert_eq!((info.adapters[0].name.as_str(), info.adapters[0].id.len()), ("a", 32));
    }
    let mut c = w.client().await;
    let req = tandem_proto::v1::LoadAdapterRequest { name: "b".into(), path: lora("b") };
    c.load_adapter(req).await.expect("LoadAdapter");
    eventually("a heartbeat with adapters a and b", heard(&["a", "b"])).await;
    let req = tandem_proto::v1::UnloadAdapterRequest { name: "a".into() };
    assert!(c.unload_adapter(req).await.unwrap().into_inner().unloaded);
    eventually("a heartbeat with adapter b only", heard(&["b"])).await;
    server.abort();
}
