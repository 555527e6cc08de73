//! TLS on every port, end to end on loopback.
//!
//! - `tandem up --tls` serves the same greedy completion as a plaintext cluster, to `tandem
//!   generate --tls-ca`, to the openai Python package (HTTPS verified with the CA) and to a
//!   Python gRPC client (`grpc.ssl_channel_credentials`); plaintext clients are refused on both
//!   of the router's ports; the CA's directory goes away with the cluster.
//! - A cluster started with certificates made here (mutual TLS): a worker's gRPC port refuses
//!   a client without a certificate and one with a certificate from another CA, and serves one
//!   with a certificate from the cluster's CA; SIGHUP with newly issued certificate files makes
//!   new connections see the new certificate while a stream opened before it completes; a
//!   reload from a broken file keeps the certificate in use.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_e2e::external::{external_python, http_get, run_py_json};
use tandem_e2e::*;
use tandem_proto::v1;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_proto::v1::worker_client::WorkerClient;
use tandem_serve::tls::dev::DevCa;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

const PROMPT: &str = "The capital of France is";

fn generate_json(args: &[&str]) -> Result<serde_json::Value, String> {
    let out =
        Command::new(bin("tandem")).arg("generate").arg("--json").args(args).output().expect("tandem runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout))))
}

/// `tandem up` with `extra` flags; returns it with its ready line's fields.
fn up(model: &Path, extra: &[&str]) -> (Proc, String, String, Option<PathBuf>) {
    let mut args: Vec<String> =
        ["up", "--threads", "1", "--kv-blocks", "64", "--transport", "tcp", "--model"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    args.push(model.display().to_string());
    args.extend(extra.iter().map(|s| s.to_string()));
    let p = Proc::spawn("up", &bin("tandem"), &args);
    let ready = p
        .next_line(Duration::from_secs(180))
        .unwrap_or_else(|| panic!("no ready line:\n{}", p.log_tail(4000)));
    let field = |k: &str| ready.split_whitespace().find_map(|f| f.strip_prefix(k)).map(str::to_owned);
    let router = field("router=").unwrap_or_else(|| panic!("no router in {ready:?}"));
    let http = field("http=").unwrap_or_else(|| panic!("no http in {ready:?}"));
    (p, router, http, field("ca=").map(PathBuf::from))
}

fn stop(mut p: Proc) {
    p.signal(libc::SIGINT);
    let st =
        p.wait_exit(Duration::from_secs(60)).unwrap_or_else(|| panic!("did not stop:\n{}", p.log_tail(4000)));
    assert!(st.success(), "exited with {st}:\n{}", p.log_tail(4000));
}

#[test]
fn tandem_up_tls_serves_what_a_plaintext_cluster_serves() {
    let model = TestModel::tiny();
    let (plain, plain_router, _, no_ca) = up(&model.path, &[]);
    assert_eq!(no_ca, None, "a plaintext cluster names no CA");
    let expected = generate_json(&["--router", &plain_router, "--max-tokens", "12", PROMPT]).unwrap();
    stop(plain);

    let (tls, router, http, ca) = up(&model.path, &["--tls"]);
    let ca = ca.expect("the ready line of `tandem up --tls` names the CA file");
    assert!(ca.is_file(), "{} is not a file", ca.display());
    let ca_s = ca.display().to_string();
    let got = generate_json(&["--router", &router, "--tls-ca", &ca_s, "--max-tokens", "12", PROMPT]).unwrap();
    assert_eq!(got, expected, "greedy output over TLS differs from plaintext");
    // The https:// form says the same.
    let https = format!("https://{router}");
    let got = generate_json(&["--router", &https, "--tls-ca", &ca_s, "--max-tokens", "12", PROMPT]).unwrap();
    assert_eq!(got, expected);

    // Plaintext clients are refused on both ports.
    let e = generate_json(&["--router", &router, "--max-tokens", "4", PROMPT]).unwrap_err();
    assert!(!e.is_empty());
    let http_addr = http.parse().unwrap();
    let answer = http_get(http_addr, "/health");
    assert!(answer.is_none(), "plaintext HTTP got an answer from the TLS port: {answer:?}");

    let test = "tls::tandem_up_tls_serves_what_a_plaintext_cluster_serves (python clients)";
    if let Some(python) = external_python(test) {
        let v = run_py_json(
            &python,
            "grpc_tls_client.py",
            &[
                router.clone(),
                "--ca".into(),
                ca_s.clone(),
                "--prompt".into(),
                PROMPT.into(),
                "--max-tokens".into(),
                "12".into(),
            ],
            Duration::from_secs(300),
        );
        assert_eq!(v["token_ids"], expected["token_ids"], "Python gRPC over TLS: {v}");
        let v = run_py_json(
            &python,
            "openai_client.py",
            &[format!("https://{http}/v1"), "--ca".into(), ca_s.clone(), "--max-tokens".into(), "6".into()],
            Duration::from_secs(300),
        );
        assert_eq!(v["requests"], 4, "openai over HTTPS: {v}");
    }
    stop(tls);
    assert!(!ca.exists(), "the CA file outlived `tandem up`: {}", ca.display());
}

/// Certificates of a cluster made here, kept with the CA key (to issue new ones for a reload).
struct Certs {
    dir: PathBuf,
    ca: DevCa,
}

impl Certs {
    fn new() -> Certs {
        let dir = std::env::temp_dir().join(format!(
            "tandem-e2e-tls-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = DevCa::new("e2e CA").unwrap();
        std::fs::write(dir.join("ca.pem"), ca.cert_pem()).unwrap();
        let c = Certs { dir, ca };
        c.issue_into("cert.pem", "key.pem");
        c
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// A new certificate and key for loopback, written (each by rename) to the two files.
    fn issue_into(&self, cert: &str, key: &str) {
        let (c, k) = self.ca.issue("e2e node", &["127.0.0.1", "localhost"]).unwrap();
        for (name, text) in [(cert, c), (key, k)] {
            let tmp = self.path(&format!("{name}.new"));
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, self.path(name)).unwrap();
        }
    }

    fn flags(&self) -> Vec<String> {
        let p = |n: &str| self.path(n).display().to_string();
        vec![
            "--tls-cert".into(),
            p("cert.pem"),
            "--tls-key".into(),
            p("key.pem"),
            "--tls-client-ca".into(),
            p("ca.pem"),
        ]
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A TLS channel to `addr` verifying with `ca`, presenting `identity` (cert and key PEM).
async fn tls_channel(
    addr: std::net::SocketAddr,
    ca: &Path,
    identity: Option<(String, String)>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(std::fs::read(ca).unwrap()));
    if let Some((c, k)) = identity {
        tls = tls.identity(Identity::from_pem(c, k));
    }
    Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30))
        .tls_config(tls)?
        .connect()
        .await
}

/// SHA-256 of the certificate `addr` presents on a new connection.
async fn served_fingerprint(addr: std::net::SocketAddr, ca: &Path) -> String {
    let cfg = tandem_serve::tls::client_config_with_ca("--tls-ca", ca).unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = tandem_serve::tls::server_name(&addr.to_string()).unwrap();
    let s = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg)).connect(name, tcp).await.unwrap();
    let certs = s.get_ref().1.peer_certificates().expect("a server certificate");
    tandem_serve::tls::fingerprint(&certs[0])
}

fn wait_for_log(p: &Proc, needle: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if p.log_text().contains(needle) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

#[test]
fn mutual_tls_refuses_foreign_clients_and_sighup_reloads_certificates() {
    let model = TestModel::tiny();
    let certs = Certs::new();
    let ca = certs.path("ca.pem");
    let mut rargs: Vec<String> =
        vec!["--listen".into(), "127.0.0.1:0".into(), "--model".into(), model.path.display().to_string()];
    rargs.extend(certs.flags());
    let mut router = Proc::spawn("router", &bin("tandem-router"), &rargs);
    let raddr = router.wait_listening(Duration::from_secs(60));
    let mut spec = ClusterSpec::new(model.path.clone(), "tcp");
    spec.kv_blocks = 64;
    let mut workers = Vec::new();
    for (role, program) in [("prefill", "tandem-prefill"), ("decode", "tandem-decode")] {
        let mut a = Cluster::worker_args(&spec, role, raddr, 0);
        a.extend(certs.flags());
        workers.push(Proc::spawn(role, &bin(program), &a));
    }
    for w in &mut workers {
        w.wait_listening(Duration::from_secs(120));
    }
    let decode = workers[1].grpc.unwrap();

    block_on(async {
        // Registered over mutual TLS: the router serves.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut router_client = TandemClient::new(tls_channel(raddr, &ca, None).await.unwrap());
        loop {
            let h = router_client.health(v1::HealthRequest {}).await.unwrap().into_inner();
            if h.serving {
                break;
            }
            assert!(Instant::now() < deadline, "never serving: {}\n{}", h.message, router.log_tail(4000));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        // A worker's gRPC port: no certificate, or one from another CA, is refused at the
        // handshake; the cluster's CA's certificate is served.
        let stats = |ch: tonic::transport::Channel| async move {
            WorkerClient::new(ch).stats(v1::StatsRequest { check_invariants: false }).await
        };
        let anonymous = match tls_channel(decode, &ca, None).await {
            Ok(ch) => stats(ch).await.map(|_| ()).map_err(|s| s.to_string()),
            Err(e) => Err(e.to_string()),
        };
        assert!(anonymous.is_err(), "a client without a certificate was served");
        let other = DevCa::new("another CA").unwrap().issue("intruder", &["127.0.0.1"]).unwrap();
        let foreign = match tls_channel(decode, &ca, Some(other)).await {
            Ok(ch) => stats(ch).await.map(|_| ()).map_err(|s| s.to_string()),
            Err(e) => Err(e.to_string()),
        };
        assert!(foreign.is_err(), "a client with another CA's certificate was served");
        // The router's gRPC port takes API clients without a certificate, but its Registry
        // does not take a worker without one.
        let anonymous_worker = tandem_proto::v1::registry_client::RegistryClient::new(
            tls_channel(raddr, &ca, None).await.unwrap(),
        )
        .register(v1::WorkerInfo::default())
        .await
        .expect_err("a registration without a client certificate was taken");
        assert_eq!(anonymous_worker.code(), tonic::Code::Unauthenticated, "{anonymous_worker:?}");
        let ours = certs.ca.issue("operator", &["127.0.0.1"]).unwrap();
        stats(tls_channel(decode, &ca, Some(ours)).await.unwrap())
            .await
            .expect("the cluster CA's client is served");

        // A stream opened before the reload...
        let before = served_fingerprint(raddr, &ca).await;
        let req = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text(PROMPT.into())),
            max_tokens: Some(48),
            ignore_eos: true,
            ..Default::default()
        };
        let mut stream = router_client.generate(req).await.unwrap().into_inner();
        let first = stream.message().await.unwrap().expect("a first message");
        let mut tokens = first.token_ids.len();

        // ...new certificate files and SIGHUP: new connections see the new certificate.
        certs.issue_into("cert.pem", "key.pem");
        router.signal(libc::SIGHUP);
        assert!(
            wait_for_log(&router, "TLS certificates reloaded", Duration::from_secs(30)),
            "no reload logged:\n{}",
            router.log_tail(4000)
        );
        let after = served_fingerprint(raddr, &ca).await;
        assert_ne!(after, before, "a new connection still sees the old certificate");

        // The stream opened before the reload completes on its old connection.
        let mut finish = None;
        while let Some(m) = stream.message().await.expect("the stream survived the reload") {
            tokens += m.token_ids.len();
            finish = m.finish_reason.or(finish);
        }
        assert_eq!(tokens, 48);
        assert_eq!(finish.as_deref(), Some("length"));
        // And requests on new connections are served, KV moving prefill → decode over TLS.
        let mut fresh = TandemClient::new(tls_channel(raddr, &ca, None).await.unwrap());
        let req = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text(PROMPT.into())),
            max_tokens: Some(4),
            ..Default::default()
        };
        let mut s = fresh.generate(req).await.unwrap().into_inner();
        while s.message().await.unwrap().is_some() {}

        // A reload from a broken file keeps the certificate in use.
        std::fs::write(certs.path("cert.pem"), "not a certificate").unwrap();
        router.signal(libc::SIGHUP);
        assert!(
            wait_for_log(&router, "TLS reload failed", Duration::from_secs(30)),
            "no failed reload logged:\n{}",
            router.log_tail(4000)
        );
        assert_eq!(served_fingerprint(raddr, &ca).await, after);
    });
    for mut w in workers {
        w.terminate(Duration::from_secs(30));
    }
    router.terminate(Duration::from_secs(30));
}
