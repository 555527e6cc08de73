//! The KV tcp plane over TLS: blocks arrive byte for byte through an encrypted connection (tcp
//! and shm's control connection); a receiver that requires client certificates refuses a sender
//! without one, or with one from another CA, during the handshake — its reservation is never
//! looked up and nothing is written into the pool; a client that connects and says nothing does
//! not stop other transfers.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{State, TestGate};
use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tandem_engine::kv::{BlockId, CpuKvPool, KvDtype, KvLayout};
use tandem_transport::{
    block_payload_bytes, KvClientTls, KvDestination, KvReceiver, KvSender, KvServerTls, ReceiverOptions,
    SenderOptions, TransportError, TransportKind,
};

const LAYOUT: KvLayout = KvLayout {
    num_layers: 3,
    num_blocks: 24,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 8,
    dtype: KvDtype::F16,
};

/// A CA and what it signs.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new() -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        Ca { cert: p.self_signed(&key).unwrap(), key }
    }

    /// A certificate for 127.0.0.1, usable by a server and by a client.
    fn issue(&self) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        p.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (vec![cert.der().clone()], PrivatePkcs8KeyDer::from(key.serialize_der()).into())
    }

    fn roots(&self) -> Arc<RootCertStore> {
        let mut r = RootCertStore::empty();
        r.add(self.cert.der().clone()).unwrap();
        Arc::new(r)
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A receiver's configuration; with `clients`, client certificates signed by it are required.
fn server(ca: &Ca, clients: Option<&Ca>) -> Arc<dyn KvServerTls> {
    let (certs, key) = ca.issue();
    let b = ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions().unwrap();
    let b = match clients {
        Some(c) => b.with_client_cert_verifier(
            WebPkiClientVerifier::builder_with_provider(c.roots(), provider()).build().unwrap(),
        ),
        None => b.with_no_client_auth(),
    };
    Arc::new(b.with_single_cert(certs, key).unwrap())
}

/// A sender's configuration trusting `ca`; with `identity`, it presents a certificate that CA signs.
fn client(ca: &Ca, identity: Option<&Ca>) -> Arc<dyn KvClientTls> {
    let b = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(ca.roots());
    Arc::new(match identity {
        Some(id) => {
            let (certs, key) = id.issue();
            b.with_client_auth_cert(certs, key).unwrap()
        }
        None => b.with_no_client_auth(),
    })
}

fn source_pool() -> CpuKvPool {
    let mut p = CpuKvPool::new(LAYOUT);
    let bb = LAYOUT.block_bytes();
    for b in 0..LAYOUT.num_blocks as BlockId {
        for l in 0..LAYOUT.num_layers {
            let k: Vec<u8> = (0..bb).map(|i| (i as u32 * 13 + b * 29 + l as u32 * 71) as u8).collect();
            let v: Vec<u8> = k.iter().map(|x| x ^ 0xa5).collect();
            p.write_block_bytes(l, b, &k, &v).unwrap();
        }
    }
    p
}

struct Rig {
    gate: Arc<TestGate>,
    rx: KvReceiver,
    addr: SocketAddr,
    dst: CpuKvPool,
}

async fn rig(tls: Arc<dyn KvServerTls>) -> Rig {
    let dst = CpuKvPool::try_new_shared(LAYOUT).unwrap();
    let gate = Arc::new(TestGate::default());
    let opts = ReceiverOptions { tls: Some(tls), io_timeout: Duration::from_secs(2), ..Default::default() };
    let rx = KvReceiver::bind(SocketAddr::from(([127, 0, 0, 1], 0)), dst.sink(), gate.clone(), opts)
        .await
        .unwrap();
    let addr = rx.local_addr();
    Rig { gate, rx, addr, dst }
}

impl Rig {
    fn dest(&self, kind: TransportKind, r: u64, blocks: &[BlockId]) -> KvDestination {
        common::destination(&self.rx, kind, r, blocks, 0)
    }

    fn zeroed(&self, blocks: &[BlockId]) -> bool {
        blocks.iter().all(|&b| {
            (0..LAYOUT.num_layers).all(|l| {
                let (k, v) = self.dst.block_bytes(l, b);
                k.iter().chain(v).all(|&x| x == 0)
            })
        })
    }
}

/// Moves `src_blocks` into reservation `r`'s blocks and checks every byte arrived.
async fn transfer(g: &Rig, sender: &KvSender, src: &CpuKvPool, kind: TransportKind, r: u64, dst: &[BlockId]) {
    let src_blocks: Vec<BlockId> = (0..dst.len() as BlockId).map(|i| (i * 7 + 3) % 24).collect();
    g.gate.add(r, dst.to_vec());
    let mut s = sender.open(&g.dest(kind, r, dst)).await.unwrap();
    s.stage_from(src, &src_blocks).unwrap();
    let rep = s.finish().await.unwrap();
    assert_eq!(rep.bytes, (dst.len() * block_payload_bytes(&LAYOUT)) as u64);
    let c = g.gate.settled(r).await;
    assert_eq!((c.begins, c.completes, c.aborts.len(), c.state), (1, 1, 0, State::Filled), "{kind}");
    for (&sb, &db) in src_blocks.iter().zip(dst) {
        for l in 0..LAYOUT.num_layers {
            assert_eq!(src.block_bytes(l, sb), g.dst.block_bytes(l, db), "{kind}: block {db} layer {l}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_cross_tls_byte_for_byte() {
    let ca = Ca::new();
    let g = rig(server(&ca, Some(&ca))).await;
    let src = source_pool();
    // Groups of one block: a transfer is many BLOCKS frames, each read through TLS records.
    let opts = SenderOptions {
        tls: Some(client(&ca, Some(&ca))),
        group_bytes: block_payload_bytes(&LAYOUT),
        ..Default::default()
    };
    let sender = KvSender::new(LAYOUT, opts);
    transfer(&g, &sender, &src, TransportKind::Tcp, 1, &[17, 2, 9, 21, 4, 11, 0]).await;
    transfer(&g, &sender, &src, TransportKind::Shm, 2, &[5, 13, 22]).await;
    assert_eq!(sender.counters().transfers, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_without_a_valid_client_certificate_is_refused_before_any_byte() {
    let ca = Ca::new();
    let other = Ca::new();
    let g = rig(server(&ca, Some(&ca))).await;
    let src = source_pool();
    let blocks: Vec<BlockId> = vec![3, 8, 15];
    let cases = [
        ("no client certificate", client(&ca, None)),
        ("a client certificate from another CA", client(&ca, Some(&other))),
    ];
    for (i, (what, tls)) in cases.into_iter().enumerate() {
        let r = 10 + i as u64;
        g.gate.add(r, blocks.clone());
        let sender = KvSender::new(LAYOUT, SenderOptions { tls: Some(tls), ..Default::default() });
        // Under TLS 1.3 the client finishes its side of the handshake before the server has
        // judged its certificate: the refusal shows at open (the server's alert) at the latest
        // at finish; either way the transfer fails.
        let outcome = match sender.open(&g.dest(TransportKind::Tcp, r, &blocks)).await {
            Err(e) => Err(e),
            Ok(mut s) => match s.stage_from(&src, &[1, 2, 3]) {
                Err(e) => Err(e),
                Ok(()) => s.finish().await.map(|_| ()),
            },
        };
        let e = outcome.expect_err(what);
        assert!(
            !matches!(e, TransportError::Refused { .. }),
            "{what}: refused by the KV protocol, not TLS: {e}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let c = g.gate.calls(r);
        assert_eq!((c.begins, c.completes, c.aborts.len()), (0, 0, 0), "{what}: the reservation was touched");
        assert!(g.zeroed(&blocks), "{what}: bytes reached the pool");
    }
    // A sender the CA signed fills the very same reservation's blocks.
    let sender =
        KvSender::new(LAYOUT, SenderOptions { tls: Some(client(&ca, Some(&ca))), ..Default::default() });
    transfer(&g, &sender, &src, TransportKind::Tcp, 20, &blocks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_sender_is_refused_and_a_silent_client_stalls_nobody() {
    let ca = Ca::new();
    let g = rig(server(&ca, None)).await;
    let src = source_pool();
    let blocks: Vec<BlockId> = vec![6, 1];
    g.gate.add(30, blocks.clone());
    let plain = KvSender::new(LAYOUT, SenderOptions::default());
    assert!(plain.open(&g.dest(TransportKind::Tcp, 30, &blocks)).await.is_err());
    let c = g.gate.calls(30);
    assert_eq!((c.begins, c.completes, c.aborts.len()), (0, 0, 0), "a plaintext HELLO was read: {c:?}");

    // Connected, never says a word: its handshake waits in its own task.
    let silent = tokio::net::TcpStream::connect(g.addr).await.unwrap();
    let sender = KvSender::new(LAYOUT, SenderOptions { tls: Some(client(&ca, None)), ..Default::default() });
    transfer(&g, &sender, &src, TransportKind::Tcp, 31, &[12, 19, 7]).await;
    // The silent client's handshake is still pending: the transfer did not wait for it to time out.
    let mut byte = [0u8; 1];
    let pending = matches!(silent.try_read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    assert!(pending, "the silent connection was already closed");
}
