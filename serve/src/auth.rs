//! Shared secrets: the optional API key clients present to the router (HTTP `Authorization:
//! Bearer <key>`, gRPC metadata `authorization: Bearer <key>`), and the optional cluster secret
//! the router and workers present to each other (gRPC metadata `x-tandem-cluster-secret`, and a
//! token derived from it in the KV transport's handshake).
//!
//! Secrets come from a flag, an environment variable or a file (`--api-key-file`,
//! `--cluster-secret-file`: the first line, trimmed). They are compared in constant time and never
//! logged: [`Secret`]'s `Debug` prints a fingerprint, not the value. Health, readiness and metrics
//! stay open so probes and scrapers need no key.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tonic::metadata::MetadataMap;
use tonic::Status;

/// gRPC metadata key (and HTTP header) carrying the cluster secret between router and workers.
pub const CLUSTER_SECRET_HEADER: &str = "x-tandem-cluster-secret";

/// Why a secret could not be loaded; every message names the flag it came from.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The value is empty (or only whitespace).
    #[error("{what} is empty")]
    Empty { what: String },
    /// The value cannot travel in an HTTP header.
    #[error("{what} must be printable ASCII without spaces (it travels in an HTTP header)")]
    NotPrintable { what: String },
    /// Both `--<flag>` and `--<flag>-file` are set.
    #[error("--{flag} and --{flag}-file are both set; use one")]
    BothSet { flag: String },
    /// The secret file could not be read.
    #[error("reading --{flag}-file {}", .path.display())]
    ReadFile {
        flag: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A secret value (API key or cluster secret).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(sha256:{})", &hex(&Sha256::digest(self.0.as_bytes()))[..12])
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Secret {
    /// A secret with this value (must be non-empty visible ASCII, so it fits in a header).
    pub fn new(value: &str, what: &str) -> Result<Secret, SecretError> {
        let v = value.trim();
        if v.is_empty() {
            return Err(SecretError::Empty { what: what.to_owned() });
        }
        if !v.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(SecretError::NotPrintable { what: what.to_owned() });
        }
        Ok(Secret(v.to_owned()))
    }

    /// The value, for presenting it to a peer.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` equals the secret (constant time in the secret's content).
    pub fn matches(&self, presented: &[u8]) -> bool {
        let a = Sha256::digest(self.0.as_bytes());
        let b = Sha256::digest(presented);
        a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }

    /// The 32-byte token a KV transport handshake carries instead of the secret itself.
    pub fn kv_token(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"tandem-kv-auth-v1\0");
        h.update(self.0.as_bytes());
        h.finalize().into()
    }
}

/// The secret from `--<flag>` (or its environment variable) or `--<flag>-file`; None when neither
/// is set. Both set is an error.
pub fn load_secret(
    value: Option<&str>,
    file: Option<&Path>,
    flag: &str,
) -> Result<Option<Secret>, SecretError> {
    match (value, file) {
        (Some(_), Some(_)) => Err(SecretError::BothSet { flag: flag.to_owned() }),
        (Some(v), None) => Ok(Some(Secret::new(v, &format!("--{flag}"))?)),
        (None, Some(p)) => {
            let text = std::fs::read_to_string(p).map_err(|source| SecretError::ReadFile {
                flag: flag.to_owned(),
                path: p.to_path_buf(),
                source,
            })?;
            let first = text.lines().next().unwrap_or("");
            Ok(Some(Secret::new(first, &format!("--{flag}-file {}", p.display()))?))
        }
        (None, None) => Ok(None),
    }
}

/// The cluster-secret flags the router and both workers take.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ClusterSecretArgs {
    /// Secret the router and workers present to each other (gRPC metadata and the KV transport
    /// handshake); must be the same on every process of the cluster [default: none].
    #[arg(
        long,
        env = "TANDEM_CLUSTER_SECRET",
        hide_env_values = true,
        conflicts_with = "cluster_secret_file"
    )]
    pub cluster_secret: Option<String>,
    /// File whose first line is the cluster secret.
    #[arg(long, env = "TANDEM_CLUSTER_SECRET_FILE")]
    pub cluster_secret_file: Option<std::path::PathBuf>,
    /// Serve the cluster's ports (the router's registry, a worker's gRPC and KV ports) on an
    /// address other hosts reach without a cluster secret or mutual TLS: only on a network where
    /// every host is trusted. Without it such a process refuses to start.
    #[arg(long)]
    pub insecure_cluster: bool,
}

impl ClusterSecretArgs {
    /// The cluster secret from `--cluster-secret` or `--cluster-secret-file`, if any.
    pub fn load(&self) -> Result<Option<Secret>, SecretError> {
        load_secret(self.cluster_secret.as_deref(), self.cluster_secret_file.as_deref(), "cluster-secret")
    }
}

/// Whether other hosts can reach a listener on `addr`: any address but a loopback one (the
/// unspecified `0.0.0.0` and `::` included).
pub fn reachable_from_network(addr: &std::net::SocketAddr) -> bool {
    !addr.ip().to_canonical().is_loopback()
}

/// Protected mode: the ports other processes of the cluster use (`ports`, as flag and address)
/// may be reachable from other hosts only when the cluster's processes authenticate each other
/// (`authenticated`: a cluster secret or mutual TLS) or the operator said the network is trusted
/// (`insecure`). Otherwise anyone who reaches such a port could register a worker and receive
/// every prompt, inject tokens into streams, or write KV blocks. The error names the ports and
/// the flags that fix it.
pub fn check_protected(
    ports: &[(&str, std::net::SocketAddr)],
    authenticated: bool,
    insecure: bool,
) -> Result<(), String> {
    let open: Vec<String> =
        ports.iter().filter(|(_, a)| reachable_from_network(a)).map(|(f, a)| format!("{f} {a}")).collect();
    if authenticated || insecure || open.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{} can be reached from other hosts, and nothing authenticates the cluster's processes on it: \
         anyone who reaches it could register a worker and receive every prompt, or send it KV blocks. \
         Set --cluster-secret (or --cluster-secret-file) to the same value on every process, or use \
         mutual TLS (--tls-cert, --tls-key and --tls-client-ca), or bind a loopback address; on a \
         network where every host is trusted, --insecure-cluster starts it anyway",
        open.join(" and ")
    ))
}

/// The bearer token of an `Authorization` header value, if it is one.
pub fn bearer(value: &[u8]) -> Option<&[u8]> {
    let v = value.strip_prefix(b"Bearer ").or_else(|| value.strip_prefix(b"bearer "))?;
    Some(v.trim_ascii())
}

/// Checks a client's API key in gRPC metadata (`authorization: Bearer <key>`). Ok when no key is
/// configured.
pub fn check_api_key_grpc(expected: Option<&Secret>, md: &MetadataMap) -> Result<(), Status> {
    let Some(expected) = expected else { return Ok(()) };
    let presented = md.get("authorization").and_then(|v| bearer(v.as_bytes()));
    match presented {
        None => Err(Status::unauthenticated("missing API key: send metadata `authorization: Bearer <key>`")),
        Some(k) if expected.matches(k) => Ok(()),
        Some(_) => Err(Status::unauthenticated("invalid API key")),
    }
}

/// Checks a client's API key in HTTP headers (`Authorization: Bearer <key>`); Err is the message
/// for a 401. Ok when no key is configured.
pub fn check_api_key_http(expected: Option<&Secret>, headers: &http::HeaderMap) -> Result<(), String> {
    let Some(expected) = expected else { return Ok(()) };
    // Anthropic's clients send the key as `x-api-key`; either header is accepted.
    let given = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| bearer(v.as_bytes()))
        .or_else(|| headers.get("x-api-key").map(|v| v.as_bytes()).filter(|v| !v.is_empty()));
    match given {
        None => {
            Err("missing API key: send the header `Authorization: Bearer <key>` (or `x-api-key: <key>`)"
                .into())
        }
        Some(k) if expected.matches(k) => Ok(()),
        Some(_) => Err("invalid API key".into()),
    }
}

/// `msg` wrapped in a request carrying `authorization: Bearer <key>` when a key is given (for
/// clients of the router's `Tandem` service).
pub fn api_key_request<T>(key: Option<&str>, msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(v) = key.and_then(|k| format!("Bearer {}", k.trim()).parse().ok()) {
        r.metadata_mut().insert("authorization", v);
    }
    r
}

/// Checks the cluster secret a peer presented in gRPC metadata. Ok when none is configured.
pub fn check_cluster(expected: Option<&Secret>, md: &MetadataMap) -> Result<(), Status> {
    let Some(expected) = expected else { return Ok(()) };
    match md.get(CLUSTER_SECRET_HEADER) {
        None => Err(Status::unauthenticated(format!(
            "missing cluster secret: this peer requires `{CLUSTER_SECRET_HEADER}` (set --cluster-secret on both sides)"
        ))),
        Some(v) if expected.matches(v.as_bytes()) => Ok(()),
        Some(_) => Err(Status::unauthenticated("wrong cluster secret (--cluster-secret differs between peers)")),
    }
}

/// Adds the cluster secret (if any) to an outgoing request's metadata.
pub fn attach_cluster<T>(secret: Option<&Secret>, req: &mut tonic::Request<T>) {
    if let Some(s) = secret {
        if let Ok(v) = s.expose().parse() {
            req.metadata_mut().insert(CLUSTER_SECRET_HEADER, v);
        }
    }
}

/// `msg` wrapped in a request carrying the cluster secret (if any).
pub fn cluster_request<T>(secret: Option<&Secret>, msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    attach_cluster(secret, &mut r);
    r
}

/// A tonic server interceptor that refuses calls without the cluster secret (when one is set),
/// telling `refused` about each refusal (for the error metrics).
pub fn cluster_interceptor(
    secret: Option<Secret>,
    refused: impl Fn(&Status) + Clone,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, Status> + Clone {
    move |req: tonic::Request<()>| {
        check_cluster(secret.as_ref(), req.metadata()).inspect_err(|st| refused(st))?;
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    #[test]
    fn cluster_ports_reachable_from_other_hosts_need_authentication_or_insecure() {
        let any: SocketAddr = "0.0.0.0:7000".parse().unwrap();
        let v6: SocketAddr = "[::]:7003".parse().unwrap();
        let lan: SocketAddr = "10.1.2.3:7002".parse().unwrap();
        let lo: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let lo6: SocketAddr = "[::1]:7000".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:7000".parse().unwrap();
        assert!(!reachable_from_network(&mapped));
        assert!(check_protected(&[("--listen", lo), ("--kv-listen", lo6)], false, false).is_ok());
        let e = check_protected(&[("--listen", lo), ("--kv-listen", v6), ("--x", lan)], false, false)
            .unwrap_err();
        assert!(e.starts_with("--kv-listen [::]:7003 and --x 10.1.2.3:7002 can be reached"), "{e}");
        assert!(!e.contains("--listen 127.0.0.1"), "{e}");
        for flag in ["--cluster-secret", "--tls-client-ca", "--insecure-cluster"] {
            assert!(e.contains(flag), "{e}");
        }
        assert!(check_protected(&[("--listen", any)], true, false).is_ok());
        assert!(check_protected(&[("--listen", any)], false, true).is_ok());
    }

    use super::*;

    #[test]
    fn secrets_compare_load_and_never_print() {
        let s = Secret::new(" hunter2 ", "--api-key").unwrap();
        assert!(s.matches(b"hunter2"));
        assert!(!s.matches(b"hunter3"));
        assert!(!s.matches(b""));
        assert!(!format!("{s:?}").contains("hunter2"));
        assert!(Secret::new("  ", "--api-key").is_err());
        assert!(Secret::new("a b", "--api-key").is_err());
        assert_ne!(s.kv_token(), Secret::new("hunter3", "x").unwrap().kv_token());

        let dir = std::env::temp_dir().join(format!("tandem-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key");
        std::fs::write(&f, "from-file\nignored\n").unwrap();
        assert_eq!(load_secret(None, Some(&f), "api-key").unwrap().unwrap().expose(), "from-file");
        assert!(load_secret(Some("x"), Some(&f), "api-key").is_err());
        assert!(load_secret(None, None, "api-key").unwrap().is_none());
        let missing = load_secret(None, Some(&dir.join("nope")), "cluster-secret").unwrap_err();
        assert!(format!("{missing:#}").contains("--cluster-secret-file"), "{missing:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn grpc_and_http_checks() {
        let key = Secret::new("k1", "x").unwrap();
        let mut md = MetadataMap::new();
        assert!(check_api_key_grpc(None, &md).is_ok());
        assert_eq!(check_api_key_grpc(Some(&key), &md).unwrap_err().code(), tonic::Code::Unauthenticated);
        md.insert("authorization", "Bearer k2".parse().unwrap());
        assert_eq!(check_api_key_grpc(Some(&key), &md).unwrap_err().message(), "invalid API key");
        md.insert("authorization", "Bearer k1".parse().unwrap());
        assert!(check_api_key_grpc(Some(&key), &md).is_ok());

        let with = api_key_request(Some("k1"), ());
        assert!(check_api_key_grpc(Some(&key), with.metadata()).is_ok());
        assert!(check_api_key_grpc(Some(&key), api_key_request(None, ()).metadata()).is_err());

        let mut h = http::HeaderMap::new();
        assert!(check_api_key_http(Some(&key), &h).unwrap_err().contains("missing"));
        h.insert(http::header::AUTHORIZATION, "Bearer k1".parse().unwrap());
        assert!(check_api_key_http(Some(&key), &h).is_ok());
        let mut x = http::HeaderMap::new();
        x.insert("x-api-key", "k1".parse().unwrap());
        assert!(check_api_key_http(Some(&key), &x).is_ok(), "Anthropic's header");
        x.insert("x-api-key", "k2".parse().unwrap());
        assert_eq!(check_api_key_http(Some(&key), &x).unwrap_err(), "invalid API key");

        let mut req = tonic::Request::new(());
        assert!(check_cluster(Some(&key), req.metadata()).is_err());
        attach_cluster(Some(&key), &mut req);
        assert!(check_cluster(Some(&key), req.metadata()).is_ok());
        assert!(check_cluster(Some(&Secret::new("other", "x").unwrap()), req.metadata()).is_err());
        let refusals = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = refusals.clone();
        let mut icpt = cluster_interceptor(Some(key.clone()), move |st: &Status| {
            assert_eq!(st.code(), tonic::Code::Unauthenticated);
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        assert!(icpt(cluster_request(Some(&key), ())).is_ok());
        assert!(icpt(tonic::Request::new(())).is_err());
        assert_eq!(refusals.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
