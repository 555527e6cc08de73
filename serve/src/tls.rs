//! TLS on every port (rustls with the `ring` provider; no OpenSSL).
//!
//! A process serves TLS when it is given `--tls-cert` and `--tls-key`. Its outgoing
//! connections to other processes of the cluster (router → worker gRPC, worker → router
//! registration, prefill → decode KV tcp) then use TLS too, and verify the peer's server
//! certificate against `--tls-ca`, or against `--tls-client-ca` when `--tls-ca` is not given
//! (one CA signing every process's certificate is the common case). A TLS process therefore
//! needs one of the two.
//!
//! With `--tls-client-ca` the process asks for client certificates signed by that CA and
//! presents its own certificate as its client identity when it connects to peers (mutual TLS).
//! Where a client certificate is *required* and where it is only *verified when presented* is
//! decided per port by [`Port`]: the workers' gRPC and KV ports require one, so a peer without a
//! valid certificate is refused during the handshake, before any RPC or KV byte is read; the
//! router's client-facing ports and every `/health`-`/ready`-`/metrics` server only verify one
//! when it is presented, so API clients and probes need nothing but the CA.
//!
//! Certificates are reloaded on SIGHUP ([`spawn_reload_on_sighup`]): every file is read again
//! and, if all of it is valid, new handshakes use the new configuration while connections
//! already open keep theirs. A reload that fails logs an error and keeps the old configuration.
//!
//! A handshake never blocks an accept loop: each accepted socket is handshaken in a task of its
//! own, bounded by [`HANDSHAKE_TIMEOUT`] ([`TlsIncoming`]).
//!
//! [`dev`] makes throwaway CAs and certificates for local clusters and tests.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

pub mod dev;

/// Longest a TLS handshake may take before the connection is dropped (a client that connects
/// and sends nothing holds only its own task, for this long).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS flags the router and both workers take. Every flag also has an environment variable
/// `TANDEM_<FLAG>` and a config-file key.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// PEM file with this process's certificate (chain): every port it serves speaks TLS, and so
    /// does every connection it opens to another process of the cluster [default: none,
    /// plaintext].
    #[arg(long, env = "TANDEM_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM file with the private key of `--tls-cert`.
    #[arg(long, env = "TANDEM_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM file with the CA that signs client certificates: mutual TLS. A worker's gRPC and KV
    /// ports then require a certificate it signed; the router verifies one when presented and
    /// requires one of workers registering; this process presents its own certificate when it
    /// connects to peers.
    #[arg(long, env = "TANDEM_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// PEM file with the CA that signed the other processes' server certificates, which this
    /// process verifies when it connects to them [default: --tls-client-ca].
    #[arg(long, env = "TANDEM_TLS_CA", requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
}

/// Why TLS could not be set up. Every message names the flag and the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("{flag} {}: cannot read the file", .path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file holds no PEM item of the kind the flag needs, or a malformed one.
    #[error("{flag} {}: {problem}", .path.display())]
    Pem { flag: &'static str, path: PathBuf, problem: String },
    /// The private key is not the key of the certificate.
    #[error("--tls-key {} does not match the certificate in --tls-cert {}", .key.display(), .cert.display())]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    /// rustls refused the certificate, key or CA.
    #[error("{flag} {}: {source}", .path.display())]
    Rustls {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    /// A CA file's certificates cannot verify anything.
    #[error("{flag} {}: {problem}", .path.display())]
    Verifier { flag: &'static str, path: PathBuf, problem: String },
    /// A TLS flag is set without the others it needs (a config file's values are not held to
    /// the flags' `requires`, so this is checked again here: TLS never turns off silently).
    #[error("{0}")]
    Incomplete(&'static str),
    /// TLS is on but nothing says how to verify the peers this process connects to.
    #[error("--tls-cert needs --tls-ca or --tls-client-ca: the CA that verifies the other processes of the cluster")]
    NoPeerCa,
}

impl TlsError {
    /// Stable, low-cardinality name of the failure.
    pub fn kind(&self) -> &'static str {
        match self {
            TlsError::Read { .. } => "read",
            TlsError::Pem { .. } => "pem",
            TlsError::KeyMismatch { .. } => "key_mismatch",
            TlsError::Rustls { .. } => "rustls",
            TlsError::Verifier { .. } => "verifier",
            TlsError::Incomplete(_) => "incomplete",
            TlsError::NoPeerCa => "no_peer_ca",
        }
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { flag, path: path.into(), source })
}

/// The certificates of the PEM file `path` (the `flag`'s value); at least one.
pub fn load_certs(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(flag, path)?;
    let pem_err = |problem: String| TlsError::Pem { flag, path: path.into(), problem };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(format!("not a valid PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(pem_err("no PEM certificate (`-----BEGIN CERTIFICATE-----`) in the file".into()));
    }
    Ok(certs)
}

/// The private key of the PEM file `path` (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(flag: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(flag, path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::Pem {
        flag,
        path: path.into(),
        problem: format!("no usable PEM private key in the file: {e}"),
    })
}

/// A root store of the CA certificates in the PEM file `path`.
fn load_roots(flag: &'static str, path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(flag, path)? {
        roots.add(cert).map_err(|source| TlsError::Rustls { flag, path: path.into(), source })?;
    }
    Ok(Arc::new(roots))
}

/// Which port a server configuration is for: what ALPN it offers and whether a client
/// certificate is required (under mutual TLS) or only verified when presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    /// A worker's gRPC port: only the router and peers call it; a client certificate is required.
    PeerGrpc,
    /// The router's gRPC port: API clients and registering workers; a client certificate is
    /// verified when presented.
    ClientGrpc,
    /// An HTTP server (the OpenAI API, `/health`, `/ready`, `/metrics`): a client certificate is
    /// verified when presented, so probes and API clients need only the CA.
    Http,
    /// The KV listener: only prefill workers connect; a client certificate is required.
    Kv,
}

impl Port {
    const ALL: [Port; 4] = [Port::PeerGrpc, Port::ClientGrpc, Port::Http, Port::Kv];

    fn index(self) -> usize {
        self as usize
    }

    fn alpn(self) -> Vec<Vec<u8>> {
        match self {
            Port::PeerGrpc | Port::ClientGrpc => vec![b"h2".to_vec()],
            Port::Http => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            Port::Kv => vec![b"tandem-kv".to_vec()],
        }
    }

    fn requires_client_cert(self) -> bool {
        matches!(self, Port::PeerGrpc | Port::Kv)
    }
}

/// The paths a TLS configuration is read from (the values of [`TlsArgs`]).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
    pub ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The files to read, or `None` in plaintext mode.
    pub fn files(&self) -> Option<TlsFiles> {
        Some(TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            client_ca: self.tls_client_ca.clone(),
            ca: self.tls_ca.clone(),
        })
    }

    /// Reads the files: `None` in plaintext mode, the reloadable configuration otherwise.
    pub fn load(&self) -> Result<Option<Arc<Tls>>, TlsError> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => return Err(TlsError::Incomplete("--tls-cert needs --tls-key")),
            (None, Some(_)) => return Err(TlsError::Incomplete("--tls-key needs --tls-cert")),
            (None, None) if self.tls_client_ca.is_some() || self.tls_ca.is_some() => {
                return Err(TlsError::Incomplete(
                    "--tls-client-ca and --tls-ca need --tls-cert and --tls-key (this process's own certificate)",
                ))
            }
            _ => {}
        }
        self.files().map(|f| Tls::load(f).map(Arc::new)).transpose()
    }
}

/// Every configuration one reading of the files produced.
struct Configs {
    servers: [Arc<ServerConfig>; 4],
    /// For gRPC peers (ALPN `h2`).
    client_grpc: Arc<ClientConfig>,
    /// For KV peers.
    client_kv: Arc<ClientConfig>,
    /// SHA-256 of this process's certificate, for logs.
    fingerprint: String,
}

/// A process's TLS configuration, reloadable: servers and clients take the current one for
/// every new connection.
pub struct Tls {
    files: TlsFiles,
    current: RwLock<Arc<Configs>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.files).finish_non_exhaustive()
    }
}

fn build(files: &TlsFiles) -> Result<Configs, TlsError> {
    let provider = provider();
    let certs = load_certs("--tls-cert", &files.cert)?;
    let key = load_key("--tls-key", &files.key)?;
    let certified = rustls::sign::CertifiedKey::from_der(certs.clone(), key.clone_key(), &provider).map_err(
        |e| match e {
            rustls::Error::InconsistentKeys(_) => {
                TlsError::KeyMismatch { cert: files.cert.clone(), key: files.key.clone() }
            }
            source => TlsError::Rustls { flag: "--tls-key", path: files.key.clone(), source },
        },
    )?;
    let client_roots = files.client_ca.as_deref().map(|p| load_roots("--tls-client-ca", p)).transpose()?;
    let (peer_flag, peer_ca) = match (&files.ca, &files.client_ca) {
        (Some(ca), _) => ("--tls-ca", ca),
        (None, Some(ca)) => ("--tls-client-ca", ca),
        (None, None) => return Err(TlsError::NoPeerCa),
    };
    let peer_roots = load_roots(peer_flag, peer_ca)?;
    fn versions<'a>(flag: &'static str, path: &'a Path) -> impl Fn(rustls::Error) -> TlsError + 'a {
        move |source| TlsError::Rustls { flag, path: path.to_path_buf(), source }
    }

    let mut servers = Vec::with_capacity(Port::ALL.len());
    for port in Port::ALL {
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(versions("--tls-cert", &files.cert))?;
        let builder = match (&client_roots, &files.client_ca) {
            (Some(roots), Some(path)) => {
                let v = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone());
                let v = if port.requires_client_cert() { v } else { v.allow_unauthenticated() };
                let v = v.build().map_err(|e| TlsError::Verifier {
                    flag: "--tls-client-ca",
                    path: path.clone(),
                    problem: e.to_string(),
                })?;
                builder.with_client_cert_verifier(v)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut cfg = builder
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(versions("--tls-cert", &files.cert))?;
        cfg.alpn_protocols = port.alpn();
        servers.push(Arc::new(cfg));
    }
    let client = |alpn: Vec<Vec<u8>>| -> Result<Arc<ClientConfig>, TlsError> {
        let mut cfg = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(versions("--tls-cert", &files.cert))?
            .with_root_certificates(peer_roots.clone())
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(versions("--tls-key", &files.key))?;
        cfg.alpn_protocols = alpn;
        Ok(Arc::new(cfg))
    };
    let servers: [Arc<ServerConfig>; 4] = servers.try_into().unwrap_or_else(|_| unreachable!("one per port"));
    Ok(Configs {
        servers,
        client_grpc: client(Port::PeerGrpc.alpn())?,
        client_kv: client(Port::Kv.alpn())?,
        fingerprint: fingerprint(&certified.cert[0]),
    })
}

/// SHA-256 of a DER certificate, hex.
pub fn fingerprint(cert: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(cert).iter().map(|b| format!("{b:02x}")).collect()
}

impl Tls {
    /// Reads every file; an error names the flag and the file.
    pub fn load(files: TlsFiles) -> Result<Tls, TlsError> {
        let configs = build(&files)?;
        Ok(Tls { files, current: RwLock::new(Arc::new(configs)) })
    }

    fn current(&self) -> Arc<Configs> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Reads the files again; on success new handshakes use them, on failure the old
    /// configuration stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let configs = Arc::new(build(&self.files)?);
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = configs;
        Ok(())
    }

    /// Whether client certificates are asked for (`--tls-client-ca`).
    pub fn mutual(&self) -> bool {
        self.files.client_ca.is_some()
    }

    /// SHA-256 of the certificate in use.
    pub fn fingerprint(&self) -> String {
        self.current().fingerprint.clone()
    }

    /// The current server configuration of `port`.
    pub fn server(&self, port: Port) -> Arc<ServerConfig> {
        self.current().servers[port.index()].clone()
    }

    /// The current client configuration for gRPC peers.
    pub fn client_grpc(&self) -> Arc<ClientConfig> {
        self.current().client_grpc.clone()
    }

    /// The current client configuration for KV peers.
    pub fn client_kv(&self) -> Arc<ClientConfig> {
        self.current().client_kv.clone()
    }
}

/// Reloads `tls` on every SIGHUP for as long as the process runs.
///
/// The handler is installed before this returns, so a SIGHUP sent once the process has said it
/// listens never meets the default action (which ends the process).
pub fn spawn_reload_on_sighup(tls: Arc<Tls>) -> tokio::task::JoinHandle<()> {
    let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
    tokio::spawn(async move {
        let mut hup = match hup {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGHUP; certificates will not be reloaded");
                return;
            }
        };
        while hup.recv().await.is_some() {
            match tls.reload() {
                Ok(()) => {
                    tracing::info!(fingerprint = %tls.fingerprint(), "SIGHUP: TLS certificates reloaded")
                }
                Err(e) => tracing::error!(
                    error = %e,
                    kind = e.kind(),
                    "SIGHUP: TLS reload failed; keeping the certificates in use"
                ),
            }
        }
    })
}

/// Spawns `server` on `listener` until `shutdown` resolves: plain TCP (no Nagle delay) without
/// `tls`, TLS as `port` with it. The gRPC twin of [`crate::ops::serve_http`]; it fails only when
/// the listener's address cannot be read.
pub fn spawn_grpc(
    server: tonic::transport::server::Router,
    listener: TcpListener,
    tls: Option<&Arc<Tls>>,
    port: Port,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>> {
    Ok(match tls {
        None => {
            let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            tokio::spawn(server.serve_with_incoming_shutdown(incoming, shutdown))
        }
        Some(t) => {
            let incoming = TlsIncoming::new(listener, t.clone(), port)?;
            tokio::spawn(server.serve_with_incoming_shutdown(incoming, shutdown))
        }
    })
}

/// Accepted connections of a TLS port, handshaken: a [`tokio_stream::Stream`] for tonic's
/// `serve_with_incoming` and an [`axum::serve::Listener`] for axum.
///
/// Accepting runs in a task of its own that hands each socket to a handshake task of its own
/// (bounded by [`HANDSHAKE_TIMEOUT`]), so a slow or silent client never stalls the others. A
/// failed handshake (no client certificate, one from another CA, not TLS at all) ends that
/// connection and is logged at debug level. Dropping the incoming stops accepting.
pub struct TlsIncoming {
    rx: mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl TlsIncoming {
    /// Starts accepting on `listener` with `tls`'s current configuration for `port`.
    pub fn new(listener: TcpListener, tls: Arc<Tls>, port: Port) -> std::io::Result<TlsIncoming> {
        let local = listener.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        let accept = tokio::spawn(accept_loop(listener, tls, port, tx));
        Ok(TlsIncoming { rx, local, accept })
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: Arc<Tls>,
    port: Port,
    tx: mpsc::Sender<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
) {
    loop {
        let (tcp, peer) = tokio::select! {
            _ = tx.closed() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.server(port));
        let tx = tx.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => {
                    let _ = tx.send((stream, peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, ?port, error = %e, "TLS handshake refused"),
                Err(_) => tracing::debug!(%peer, ?port, "TLS handshake timed out"),
            }
        });
    }
}

impl tokio_stream::Stream for TlsIncoming {
    type Item = Result<tokio_rustls::server::TlsStream<TcpStream>, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|c| c.map(|(s, _)| Ok(s)))
    }
}

impl axum::serve::Listener for TlsIncoming {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task never ends while the incoming lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// The server name to verify for `host:port` (or a URL): the host, an IP address or a DNS name.
pub fn server_name(address: &str) -> Result<ServerName<'static>, String> {
    let rest = address.split_once("://").map_or(address, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = match authority.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_owned()).map_err(|e| format!("{host:?} is not a host name: {e}"))
}

/// A lazily connecting gRPC channel to `address` (`host:port` or a URL) that speaks TLS with
/// `tls`'s current client configuration on every new connection (so a reloaded certificate is
/// presented from the next reconnection on), or plaintext when `tls` is `None`.
pub fn grpc_channel(
    endpoint: tonic::transport::Endpoint,
    tls: Option<Arc<Tls>>,
) -> tonic::transport::Channel {
    let Some(tls) = tls else {
        return endpoint.connect_lazy();
    };
    let connector = tower::service_fn(move |uri: http::Uri| {
        let tls = tls.clone();
        async move {
            let authority = uri.authority().map(|a| a.as_str().to_owned()).unwrap_or_default();
            let name = server_name(&authority)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            let tcp = TcpStream::connect(&authority).await?;
            let _ = tcp.set_nodelay(true);
            let stream = tokio_rustls::TlsConnector::from(tls.client_grpc()).connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    endpoint.connect_with_connector_lazy(connector)
}

/// A client configuration for a client of a TLS cluster that has only the CA file (`tandem`
/// commands talking to a router): verifies the server with `ca`, presents no certificate.
pub fn client_config_with_ca(flag: &'static str, ca: &Path) -> Result<ClientConfig, TlsError> {
    let roots = load_roots(flag, ca)?;
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls { flag, path: ca.into(), source })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tmp(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("tandem-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    fn files(d: &Path) -> TlsFiles {
        let ca = dev::DevCa::new("test CA").unwrap();
        let other = dev::DevCa::new("other CA").unwrap();
        let (cert, key) = ca.issue("node", &["localhost", "127.0.0.1"]).unwrap();
        let (_, other_key) = other.issue("node", &["localhost"]).unwrap();
        std::fs::write(d.join("ca.pem"), ca.cert_pem()).unwrap();
        std::fs::write(d.join("cert.pem"), cert).unwrap();
        std::fs::write(d.join("key.pem"), key).unwrap();
        std::fs::write(d.join("other-key.pem"), other_key).unwrap();
        TlsFiles {
            cert: d.join("cert.pem"),
            key: d.join("key.pem"),
            client_ca: Some(d.join("ca.pem")),
            ca: None,
        }
    }

    #[test]
    fn valid_files_load_and_reload() {
        let d = tmp("valid");
        let f = files(&d.0);
        let tls = Tls::load(f.clone()).unwrap();
        assert!(tls.mutual());
        let before = tls.fingerprint();
        assert_eq!(tls.server(Port::PeerGrpc).alpn_protocols, vec![b"h2".to_vec()]);
        // A reload with a broken file keeps the configuration in use.
        std::fs::write(&f.cert, "garbage").unwrap();
        let e = tls.reload().unwrap_err();
        assert!(e.to_string().contains("--tls-cert"), "{e}");
        assert_eq!(tls.fingerprint(), before);
        // A reload with a newly issued certificate takes it.
        let ca = dev::DevCa::new("new CA").unwrap();
        let (cert, key) = ca.issue("node", &["localhost"]).unwrap();
        std::fs::write(&f.cert, cert).unwrap();
        std::fs::write(&f.key, key).unwrap();
        tls.reload().unwrap();
        assert_ne!(tls.fingerprint(), before);
    }

    #[test]
    fn missing_file_names_the_flag_and_the_file() {
        let d = tmp("missing");
        let mut f = files(&d.0);
        f.cert = d.0.join("nope.pem");
        let e = Tls::load(f).unwrap_err();
        assert!(matches!(e, TlsError::Read { flag: "--tls-cert", .. }), "{e:?}");
        assert!(e.to_string().contains("--tls-cert") && e.to_string().contains("nope.pem"), "{e}");

        let mut f = files(&d.0);
        f.client_ca = Some(d.0.join("no-ca.pem"));
        let e = Tls::load(f).unwrap_err();
        assert!(e.to_string().contains("--tls-client-ca") && e.to_string().contains("no-ca.pem"), "{e}");
    }

    #[test]
    fn wrong_pem_names_the_flag() {
        let d = tmp("pem");
        let f = files(&d.0);
        // A key where a certificate belongs, and a certificate where the key belongs.
        let e = Tls::load(TlsFiles { cert: f.key.clone(), ..f.clone() }).unwrap_err();
        assert!(matches!(e, TlsError::Pem { flag: "--tls-cert", .. }), "{e:?}");
        let e = Tls::load(TlsFiles { key: f.cert.clone(), ..f.clone() }).unwrap_err();
        assert!(matches!(e, TlsError::Pem { flag: "--tls-key", .. }), "{e:?}");
        assert!(e.to_string().contains("cert.pem"), "{e}");
        let e = Tls::load(TlsFiles { client_ca: Some(f.key.clone()), ..f }).unwrap_err();
        assert!(matches!(e, TlsError::Pem { flag: "--tls-client-ca", .. }), "{e:?}");
    }

    #[test]
    fn key_of_another_certificate_is_refused() {
        let d = tmp("mismatch");
        let f = files(&d.0);
        let e = Tls::load(TlsFiles { key: d.0.join("other-key.pem"), ..f }).unwrap_err();
        assert!(matches!(e, TlsError::KeyMismatch { .. }), "{e:?}");
        assert!(e.to_string().contains("--tls-key") && e.to_string().contains("other-key.pem"), "{e}");
    }

    #[test]
    fn a_peer_ca_is_required() {
        let d = tmp("noca");
        let f = files(&d.0);
        let e = Tls::load(TlsFiles { client_ca: None, ca: None, ..f }).unwrap_err();
        assert!(matches!(e, TlsError::NoPeerCa), "{e:?}");
    }

    /// `/health` over TLS through [`crate::ops::serve_http`], while another client sits
    /// connected without sending a byte: its handshake holds only its own task.
    #[tokio::test]
    async fn a_silent_client_does_not_stall_the_handshakes_of_others() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        struct Up;
        impl crate::ops::Probe for Up {
            fn live(&self) -> Result<(), String> {
                Ok(())
            }
            fn ready(&self) -> Result<(), String> {
                Ok(())
            }
        }
        let d = tmp("silent");
        let f = files(&d.0);
        let ca = f.client_ca.clone().unwrap();
        let tls = Arc::new(Tls::load(f).unwrap());
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let app = crate::ops::ops_routes(Arc::new(Up), crate::ops::new_registry());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(crate::ops::serve_http(l, Some(tls), app, async move {
            let _ = stopped.await;
        }));

        let silent = TcpStream::connect(addr).await.unwrap();
        let mut cfg = client_config_with_ca("--tls-ca", &ca).unwrap();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = server_name(&addr.to_string()).unwrap();
        let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        let out = String::from_utf8_lossy(&out);
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        // The silent client's handshake is still pending: the other one did not wait for it to
        // time out.
        let mut byte = [0u8; 1];
        let pending =
            matches!(silent.try_read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        assert!(pending, "the silent connection was already closed");

        // A plaintext request on the TLS port gets no HTTP answer.
        let mut plain = TcpStream::connect(addr).await.unwrap();
        plain.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut buf = Vec::new();
        let _ = plain.read_to_end(&mut buf).await;
        assert!(!String::from_utf8_lossy(&buf).contains("HTTP/1.1"), "plaintext was answered");
        let _ = stop.send(());
        let _ = server.await;
    }

    #[test]
    fn half_a_configuration_is_refused_not_ignored() {
        let p = |s: &str| Some(PathBuf::from(s));
        let args = |cert, key, client_ca, ca| TlsArgs {
            tls_cert: cert,
            tls_key: key,
            tls_client_ca: client_ca,
            tls_ca: ca,
        };
        assert!(args(None, None, None, None).load().unwrap().is_none());
        for (a, flag) in [
            (args(p("c.pem"), None, None, None), "--tls-key"),
            (args(None, p("k.pem"), None, None), "--tls-cert"),
            (args(None, None, p("ca.pem"), None), "--tls-cert"),
            (args(None, None, None, p("ca.pem")), "--tls-cert"),
        ] {
            let e = a.load().unwrap_err();
            assert!(matches!(e, TlsError::Incomplete(_)) && e.to_string().contains(flag), "{e}");
        }
    }

    #[test]
    fn server_names_of_addresses() {
        assert_eq!(server_name("127.0.0.1:50051").unwrap(), ServerName::try_from("127.0.0.1").unwrap());
        assert_eq!(
            server_name("https://router.local:8443/x").unwrap(),
            ServerName::try_from("router.local").unwrap()
        );
        assert_eq!(server_name("[::1]:9").unwrap(), ServerName::try_from("::1").unwrap());
    }
}
