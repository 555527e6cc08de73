//! The operational HTTP endpoints every binary serves: `GET /health` (liveness), `GET /ready`
//! (readiness) and `GET /metrics` (Prometheus text format 0.0.4). The router mounts its OpenAI
//! API on the same server; workers serve only these.
//!
//! None of these endpoints asks for a key: probes and scrapers must reach them.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::serve::ListenerExt;
use prometheus::{Encoder, TextEncoder};

/// What `/health` and `/ready` report. Implementations must answer quickly without blocking.
pub trait Probe: Send + Sync + 'static {
    /// Liveness: Err(reason) when the process should be restarted (e.g. its engine thread died).
    fn live(&self) -> Result<(), String>;
    /// Readiness: Err(reason) when the process should not be sent traffic now (loading, not
    /// registered, draining, wedged).
    fn ready(&self) -> Result<(), String>;
}

/// The metrics of one process: a Prometheus registry (the process's own; never the global one,
/// so two servers in one test process never mix their counters).
pub fn new_registry() -> prometheus::Registry {
    prometheus::Registry::new()
}

/// Renders `registry` in the Prometheus text format.
pub fn render(registry: &prometheus::Registry) -> String {
    let mut buf = Vec::new();
    let enc = TextEncoder::new();
    if let Err(e) = enc.encode(&registry.gather(), &mut buf) {
        tracing::error!(error = %e, "encoding metrics failed");
    }
    String::from_utf8(buf).unwrap_or_default()
}

fn probe_response(r: Result<(), String>, ok: &'static str) -> Response {
    match r {
        Ok(()) => (StatusCode::OK, axum::Json(serde_json::json!({ "status": ok }))).into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({ "status": "unavailable", "reason": reason })),
        )
            .into_response(),
    }
}

/// The vLLM-named metrics, as `docs/vllm-metrics.txt` lists them: name, type, labels, process.
pub const VLLM_METRICS: &str = include_str!("../../docs/vllm-metrics.txt");

/// Checks a rendered exposition (`text`) against the [`VLLM_METRICS`] lines of `process`
/// (`router` or `worker`): each is declared with its type and has a sample carrying exactly its
/// labels (plus `le` for a histogram's buckets). Returns how many were checked, or what is wrong.
pub fn check_vllm_metrics(text: &str, process: &str) -> Result<usize, String> {
    let mut checked = 0;
    for line in VLLM_METRICS.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [name, kind, labels, who] = f[..] else {
            return Err(format!("malformed line in the list: {line:?}"));
        };
        if who != process {
            continue;
        }
        if !text.lines().any(|l| l == format!("# TYPE {name} {kind}")) {
            return Err(format!("{name}: no `# TYPE {name} {kind}` line"));
        }
        let sample = if kind == "histogram" { format!("{name}_count{{") } else { format!("{name}{{") };
        let Some(s) = text.lines().find(|l| l.starts_with(&sample)) else {
            return Err(format!("{name}: no sample (`{sample}...`)"));
        };
        let inside = &s[sample.len()..s.find('}').unwrap_or(s.len())];
        let mut got: Vec<&str> =
            inside.split(',').filter_map(|kv| kv.split_once('=').map(|(k, _)| k)).collect();
        let mut want: Vec<&str> = labels.split(',').collect();
        got.sort_unstable();
        want.sort_unstable();
        if got != want {
            return Err(format!("{name}: labels {got:?}, the list says {want:?}"));
        }
        checked += 1;
    }
    Ok(checked)
}

/// Routes for `/health`, `/ready` and `/metrics`.
pub fn ops_routes(probe: Arc<dyn Probe>, registry: prometheus::Registry) -> axum::Router {
    let (p1, p2) = (probe.clone(), probe);
    axum::Router::new()
        .route("/health", get(move || async move { probe_response(p1.live(), "ok") }))
        .route("/ready", get(move || async move { probe_response(p2.ready(), "ready") }))
        .route(
            "/metrics",
            get(move || async move {
                ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], render(&registry))
            }),
        )
}

/// Serves `app` on `listener` until `shutdown` resolves; connections in flight are then allowed
/// to finish (axum's graceful shutdown). With `tls`, every connection is a TLS one
/// ([`Port::Http`](crate::tls::Port::Http): a client certificate is verified when presented,
/// never required, so probes need only the CA).
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    tls: Option<Arc<crate::tls::Tls>>,
    app: axum::Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    match tls {
        None => axum::serve(listener, app).with_graceful_shutdown(shutdown).await,
        Some(tls) => {
            // `tap_io` only to get axum's `ConnectInfo<SocketAddr>` for a listener of our own.
            let incoming = crate::tls::TlsIncoming::new(listener, tls, crate::tls::Port::Http)?;
            axum::serve(incoming.tap_io(|_| {}), app).with_graceful_shutdown(shutdown).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    struct Flag(AtomicBool);
    impl Probe for Flag {
        fn live(&self) -> Result<(), String> {
            Ok(())
        }
        fn ready(&self) -> Result<(), String> {
            if self.0.load(Ordering::SeqCst) {
                Ok(())
            } else {
                Err("draining".into())
            }
        }
    }

    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        let code = out[9..12].parse().unwrap();
        let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
        (code, body)
    }

    #[tokio::test]
    async fn probes_and_metrics_answer() {
        let reg = new_registry();
        let c = prometheus::IntCounter::new("tandem_test_total", "A test counter.").unwrap();
        reg.register(Box::new(c.clone())).unwrap();
        c.inc_by(3);
        let flag = Arc::new(Flag(AtomicBool::new(true)));
        let app = ops_routes(flag.clone(), reg);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_http(l, None, app, async move {
            let _ = rx.await;
        }));
        assert_eq!(get(addr, "/health").await.0, 200);
        assert_eq!(get(addr, "/ready").await.0, 200);
        flag.0.store(false, Ordering::SeqCst);
        let (code, body) = get(addr, "/ready").await;
        assert_eq!(code, 503);
        assert!(body.contains("draining"), "{body}");
        let (code, body) = get(addr, "/metrics").await;
        assert_eq!(code, 200);
        assert!(body.contains("tandem_test_total 3"), "{body}");
        let _ = tx.send(());
        server.await.unwrap().unwrap();
    }
}
