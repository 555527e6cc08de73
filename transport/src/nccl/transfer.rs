//! The nccl kind's two halves: GPU to GPU over a two-rank NCCL communicator per prefill/decode
//! pair ([`super::link`]), the session's connection carrying only the control frames.
//!
//! P names the communicator in its HELLO (with the NCCL unique id when it is new); D refuses a
//! key it does not know by name ([`UNKNOWN_COMM`]) before it pins the reservation, and P then
//! opens a new communicator and tries once more. A new communicator is joined by both sides only
//! after D accepted the HELLO, so neither starts joining one the other may never join. To send,
//! P tells D its source blocks in an NCCL_GO frame (both sides cut the same pieces from the two
//! block lists), then sends every layer's K and V of them in NCCL groups of at most
//! [`super::MAX_GROUP_OPS`] pieces; D receives them into the reserved blocks, in the same
//! groups. No checksums: the bytes stay in GPU memory and the interconnect.
//!
//! Every NCCL wait has a deadline ([`nccl_deadline`]). After a failure the communicator is
//! forgotten on both sides; on D, a receive still inside NCCL keeps the reservation pinned until
//! it returns, so no late write lands in a block the engine reuses.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::io::BufReader;

use super::link::{Opening, RecvLinks, SendLinks, UNKNOWN_COMM};
use super::{NcclError, NcclPeer, UniqueId};
use crate::conn::KvRead;
use crate::kind::{
    bad_destination, gpu_error, host_pool, protocol, BoxFuture, Inbound, Link, Outbound, Outgoing, Pinned,
    ReceiveKind, ReceiverEnv, Registration, SendKind, SenderEnv, Transfer,
};
use crate::types::{KvDestination, TransportOffer};
use crate::wire::{self, tag, Hello, NcclHello};
use crate::{KvBlockSource, TransportError, TransportKind};
use tandem_engine::cuda::DeviceKvPool;
use tandem_engine::kv::BlockId;

pub(crate) const KIND: Registration = Registration {
    name: "nccl",
    wire_code: 4,
    needs_gpu: true,
    writes_directly: false,
    hello_ext: true,
    sender,
    receiver,
};

/// How long one NCCL transfer of `bytes` may take: 10 s, plus a second per GB (far below what
/// any GPU interconnect moves, so only a stuck peer reaches it).
pub(crate) fn nccl_deadline(bytes: usize) -> Duration {
    Duration::from_secs(10) + Duration::from_secs_f64(bytes as f64 / 1e9)
}

fn sender(env: &SenderEnv<'_>) -> Box<dyn SendKind> {
    Box::new(NcclSend {
        device: env.opts.device.clone(),
        enabled: env.opts.enable_nccl,
        links: OnceLock::new(),
    })
}

fn receiver(env: &ReceiverEnv<'_>) -> Box<dyn ReceiveKind> {
    let pool = env.sink.device_pool();
    let mut links = None;
    let status = match &pool {
        Some(pool) if env.opts.enable_nccl => Some(match RecvLinks::new(pool.clone()) {
            Ok(l) => {
                links = Some(Arc::new(l));
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        }),
        _ => None,
    };
    if let Some(Err(e)) = &status {
        tracing::warn!(error = %e, "NCCL is not available; not offering nccl");
    }
    Box::new(NcclReceive {
        uuid: pool.as_ref().and_then(|p| p.device_uuid().ok()).unwrap_or_default(),
        status,
        links,
    })
}

/// P's half: this worker's pool on its GPU, and its communicators with decode workers (made on
/// first use).
struct NcclSend {
    device: Option<DeviceKvPool>,
    enabled: bool,
    links: OnceLock<Result<Arc<SendLinks>, String>>,
}

impl NcclSend {
    fn links(&self) -> Result<Arc<SendLinks>, TransportError> {
        let Some(own) = &self.device else {
            return Err(TransportError::Invalid(host_pool(TransportKind::Nccl)));
        };
        self.links
            .get_or_init(|| SendLinks::new(own.clone()).map(Arc::new).map_err(|e| e.to_string()))
            .clone()
            .map_err(TransportError::Invalid)
    }
}

impl SendKind for NcclSend {
    fn unavailable(&self) -> Option<String> {
        if self.device.is_none() {
            Some(host_pool(TransportKind::Nccl))
        } else if !self.enabled {
            Some("nccl is turned off (--transport)".into())
        } else {
            crate::nccl_library().err()
        }
    }

    fn offer(&self, offer: &mut TransportOffer) {
        if let Some(d) = &self.device {
            offer.device_uuid = d.device_uuid().unwrap_or_default();
        }
    }

    fn prepare(&self, dest: &KvDestination) -> Result<Box<dyn Outbound>, TransportError> {
        if let Some(why) = self.unavailable() {
            return Err(bad_destination(dest, format!("nccl is not available on this worker: {why}")));
        }
        let peer = dest.address.clone();
        let links = self.links()?;
        let opening = links.opening(&peer).map_err(|e| gpu_error(&peer, e))?;
        let (comm_key, unique_id) = match &opening {
            Opening::Reuse(k, _) => (*k, None),
            Opening::New(k, id) => (*k, Some(id.0)),
        };
        let ext = NcclHello { comm_key, unique_id }.encode();
        Ok(Box::new(NcclOut { links, peer, ext, opening: Some(opening), comm: None }))
    }

    fn retry_after(&self, error: &TransportError, peer: &str) -> bool {
        let lost = matches!(error, TransportError::Refused { msg, .. } if msg.contains(UNKNOWN_COMM));
        if lost {
            // The decode worker restarted since our communicator with it was made: the next
            // open makes a new one.
            tracing::info!(peer, "decode worker lost its NCCL communicator; opening a new one");
        }
        lost
    }
}

struct NcclOut {
    links: Arc<SendLinks>,
    peer: String,
    ext: Vec<u8>,
    /// The communicator named in the HELLO, until D accepted.
    opening: Option<Opening>,
    /// Its key, and the communicator once joined.
    comm: Option<(u64, Arc<NcclPeer>)>,
}

impl Outbound for NcclOut {
    fn hello_ext(&self) -> Vec<u8> {
        self.ext.clone()
    }

    fn refused(&self, msg: &str) {
        if let Some(Opening::Reuse(key, _)) = &self.opening {
            if msg.contains(UNKNOWN_COMM) {
                self.links.forget(&self.peer, *key);
            }
        }
    }

    /// A new communicator: D accepted the reservation (nothing it would refuse is left) and now
    /// joins as rank 1; join as rank 0.
    fn accepted<'a>(&'a mut self, peer: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.comm = match self.opening.take() {
                Some(Opening::Reuse(key, p)) => Some((key, p)),
                Some(Opening::New(key, id)) => {
                    let (l, p) = (self.links.clone(), peer.to_owned());
                    let comm = tokio::task::spawn_blocking(move || l.join(&p, key, id))
                        .await
                        .map_err(|e| TransportError::Invalid(format!("NCCL join task failed: {e}")))?
                        .map_err(|e| gpu_error(peer, e))?;
                    Some((key, comm))
                }
                None => None,
            };
            Ok(())
        })
    }

    /// Tells D the source blocks (NCCL_GO, so both sides cut the same pieces), then sends every
    /// layer's K and V of them (in groups of at most [`super::MAX_GROUP_OPS`] pieces) and waits
    /// until they have left.
    fn stage(
        &mut self,
        _src: &dyn KvBlockSource,
        src_blocks: &[BlockId],
        link: &Link,
    ) -> Result<(), TransportError> {
        let Some((key, comm)) = self.comm.clone() else {
            return Err(TransportError::Invalid(format!(
                "reservation {}: nccl session without a communicator",
                link.reservation
            )));
        };
        let (links, peer) = (&self.links, &link.peer);
        if comm.is_broken() {
            // Fail before NCCL_GO: D would post a receive nobody answers.
            links.forget(peer, key);
            return Err(gpu_error(peer, "the NCCL communicator with this decode worker failed earlier"));
        }
        let pieces = links.pieces(src_blocks, &link.dest_blocks).map_err(|e| gpu_error(peer, e))?;
        let bytes: usize = pieces.iter().map(|p| p.1).sum();
        link.send(Outgoing::Frame(wire::frame(tag::NCCL_GO, &wire::nccl_go_body(src_blocks))))?;
        // SAFETY: the pieces are this worker's own pool blocks of the sequence being sent; the
        // engine thread (this one) neither frees nor writes them until staging returns. After a
        // failure NCCL may still read them for a while (bounded below): reads only, into a
        // reservation D then releases or holds back, never into anything D uses.
        let sent = unsafe { comm.send(pieces, nccl_deadline(bytes)) };
        if let Err(e) = sent {
            links.forget(peer, key);
            let until = Instant::now() + Duration::from_secs(5);
            while comm.is_busy() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
            return Err(link.check_stopped().err().unwrap_or_else(|| gpu_error(peer, e)));
        }
        Ok(())
    }
}

/// D's half: the communicators with prefill workers, when the pool is on a GPU and NCCL loads.
struct NcclReceive {
    /// The UUID of the pool's GPU; empty for a host pool.
    uuid: String,
    /// Whether nccl is offered, or why not; `None` when not attempted.
    status: Option<Result<(), String>>,
    links: Option<Arc<RecvLinks>>,
}

impl ReceiveKind for NcclReceive {
    fn unavailable(&self) -> Option<String> {
        match &self.status {
            Some(Ok(())) => None,
            Some(Err(e)) => Some(e.clone()),
            None if self.uuid.is_empty() => Some(host_pool(TransportKind::Nccl)),
            None => Some("nccl is turned off".into()),
        }
    }

    fn offer(&self, offer: &mut TransportOffer) {
        offer.device_uuid = self.uuid.clone();
    }

    fn check_hello(&self, h: &Hello) -> Result<(), String> {
        let Some(links) = &self.links else {
            return Err("this worker offers no nccl (its KV pool is not on a GPU, or NCCL is missing)".into());
        };
        let n = NcclHello::decode(&h.ext)?;
        // A communicator named but unknown (this worker restarted, or it failed): refused
        // before the reservation is pinned, so the sender can retry with a new one.
        match &n.unique_id {
            None if links.get(n.comm_key).is_none() => Err(format!(
                "{UNKNOWN_COMM} {:#018x} (this decode worker restarted, or the communicator failed)",
                n.comm_key
            )),
            _ => Ok(()),
        }
    }

    /// The communicator the HELLO names: joined now (as rank 1, after OK, as the sender does)
    /// when the HELLO brings a unique id, else one made by an earlier transfer.
    fn start<'a>(
        &'a self,
        hello: &'a Hello,
        t: Transfer,
    ) -> BoxFuture<'a, Result<Box<dyn Inbound>, TransportError>> {
        Box::pin(async move {
            let Some(links) = self.links.clone() else {
                return Err(TransportError::Invalid("nccl transfer without communicators".into()));
            };
            let peer = t.peer.as_str();
            let h = NcclHello::decode(&hello.ext).map_err(|m| protocol(peer, m))?;
            let comm = match h.unique_id {
                Some(id) => {
                    let l = links.clone();
                    tokio::task::spawn_blocking(move || l.join(h.comm_key, UniqueId(id)))
                        .await
                        .map_err(|e| TransportError::Invalid(format!("NCCL join task failed: {e}")))?
                        .map_err(|e| gpu_error(peer, e))?
                }
                None => links.get(h.comm_key).ok_or_else(|| TransportError::Refused {
                    peer: peer.into(),
                    msg: format!(
                        "{UNKNOWN_COMM} {:#018x} (this decode worker restarted, or it failed)",
                        h.comm_key
                    ),
                })?,
            };
            Ok(Box::new(NcclIn { links, comm, t }) as Box<dyn Inbound>)
        })
    }
}

struct NcclIn {
    links: Arc<RecvLinks>,
    comm: Arc<NcclPeer>,
    t: Transfer,
}

impl Inbound for NcclIn {
    fn frame_limit(&self, t: u8, next: usize) -> Option<usize> {
        (t == tag::NCCL_GO && next == 0).then_some(4 * self.t.blocks.len())
    }

    fn on_frame<'a>(
        &'a mut self,
        _tag: u8,
        len: usize,
        _next: usize,
        rd: &'a mut BufReader<KvRead>,
    ) -> BoxFuture<'a, Result<usize, TransportError>> {
        Box::pin(async move {
            let (peer, n) = (self.t.peer.as_str(), self.t.blocks.len());
            let mut body = vec![0u8; len];
            wire::read_exact_idle(rd, &mut body, self.t.io, peer, "reading NCCL_GO").await?;
            let src = wire::parse_u32s(&body);
            if src.len() != n {
                return Err(protocol(
                    peer,
                    format!("NCCL_GO names {} source blocks, {n} expected", src.len()),
                ));
            }
            receive(&self.links, &self.comm, &src, &self.t.blocks, &self.t.pin, self.t.grace, peer).await?;
            Ok(n)
        })
    }
}

/// Receives the transfer of P's blocks `src` into the reserved `dst` and waits for it. On a
/// failure the communicator is aborted; if its thread is still inside NCCL after `grace`, a task
/// keeps the reservation pinned until it is out, so no late write lands in a block the engine
/// reuses (the blocks stay claimed meanwhile, and a warning says so).
async fn receive(
    links: &Arc<RecvLinks>,
    comm: &Arc<NcclPeer>,
    src: &[BlockId],
    dst: &[BlockId],
    pinned: &Arc<Pinned>,
    grace: Duration,
    peer: &str,
) -> Result<(), TransportError> {
    let gpu = |e: NcclError| gpu_error(peer, e);
    let pieces = links.pieces(src, dst).map_err(gpu)?;
    let deadline = nccl_deadline(pieces.iter().map(|p| p.1).sum());
    let c = comm.clone();
    // SAFETY: the pieces are blocks of the reservation this connection pinned: no sequence holds
    // them and no other transfer writes them until this connection completes or aborts it, which
    // happens only after this call, and after a failure only once NCCL is done with them.
    let r = tokio::task::spawn_blocking(move || unsafe { c.recv(pieces, deadline) })
        .await
        .map_err(|e| TransportError::Invalid(format!("NCCL receive task failed: {e}")))?;
    if let Err(e) = r {
        let until = Instant::now() + grace;
        while comm.is_busy() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if comm.is_busy() {
            tracing::warn!(
                peer,
                reservation = pinned.reservation,
                "NCCL receive still in flight after an error; its reservation stays claimed until NCCL returns"
            );
            let (comm, hold) = (comm.clone(), pinned.clone());
            tokio::spawn(async move {
                while comm.is_busy() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                drop(hold);
            });
        }
        return Err(gpu(e));
    }
    Ok(())
}
