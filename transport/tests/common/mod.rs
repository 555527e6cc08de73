//! Shared pieces of the transport tests: a reservation gate that records every call, and
//! helpers to talk raw bytes to a receiver.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use tandem_engine::kv::BlockId;
use tandem_transport::wire;
use tandem_transport::{KvDestination, KvReceiver, ReservationGate, TransportKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Reserved,
    Transferring,
    Filled,
    Released,
}

#[derive(Debug)]
struct Entry {
    blocks: Vec<BlockId>,
    state: State,
    begins: usize,
    completes: usize,
    aborts: Vec<String>,
}

/// Where a sender sends blocks `blocks` of reservation `reservation` to `rx` over `kind`, skipping
/// the first `skip`, as a router would tell it: from the receiver's own offer.
pub fn destination(
    rx: &KvReceiver,
    kind: TransportKind,
    reservation: u64,
    blocks: &[BlockId],
    skip: u32,
) -> KvDestination {
    let offer = rx.offers().into_iter().find(|o| o.kind == kind).expect("the receiver offers it");
    KvDestination {
        worker_id: "d".into(),
        transport: kind,
        address: offer.address,
        segment_path: offer.segment_path,
        reservation_id: reservation,
        block_ids: blocks.to_vec(),
        skip_blocks: skip,
        ipc_handle: offer.ipc_handle,
        pool_blocks: offer.pool_blocks,
        device_uuid: offer.device_uuid,
        nixl_metadata: offer.nixl_metadata,
    }
}

/// A reservation table like a decode node's, counting begin / complete / abort per reservation.
#[derive(Default)]
pub struct TestGate {
    table: Mutex<HashMap<u64, Entry>>,
    /// The LoRA adapter id of each reservation made under one (none: the base model).
    adapters: Mutex<HashMap<u64, String>>,
}

/// Calls seen for one reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Calls {
    pub state: State,
    pub begins: usize,
    pub completes: usize,
    pub aborts: Vec<String>,
}

impl TestGate {
    pub fn add(&self, reservation: u64, blocks: Vec<BlockId>) {
        self.table.lock().unwrap().insert(
            reservation,
            Entry { blocks, state: State::Reserved, begins: 0, completes: 0, aborts: Vec::new() },
        );
    }

    /// Makes `reservation` one made under the LoRA adapter `id`.
    pub fn set_adapter(&self, reservation: u64, id: &str) {
        self.adapters.lock().unwrap().insert(reservation, id.to_owned());
    }

    pub fn calls(&self, reservation: u64) -> Calls {
        let t = self.table.lock().unwrap();
        let e = &t[&reservation];
        Calls { state: e.state, begins: e.begins, completes: e.completes, aborts: e.aborts.clone() }
    }

    /// Waits (bounded, only to avoid hanging) until the reservation completed or aborted.
    pub async fn settled(&self, reservation: u64) -> Calls {
        for _ in 0..1000 {
            let c = self.calls(reservation);
            if c.completes + c.aborts.len() > 0 {
                // Give a buggy second call a chance to show up before the caller asserts.
                tokio::time::sleep(Duration::from_millis(20)).await;
                return self.calls(reservation);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("reservation {reservation} never settled: {:?}", self.calls(reservation));
    }
}

impl ReservationGate for TestGate {
    fn begin(&self, reservation: u64) -> Result<Vec<BlockId>, String> {
        let mut t = self.table.lock().unwrap();
        let e = t.get_mut(&reservation).ok_or_else(|| format!("unknown reservation {reservation}"))?;
        e.begins += 1;
        if e.state != State::Reserved {
            return Err(format!("reservation {reservation} is {:?}, not Reserved", e.state));
        }
        e.state = State::Transferring;
        Ok(e.blocks.clone())
    }

    fn complete(&self, reservation: u64) {
        let mut t = self.table.lock().unwrap();
        let e = t.get_mut(&reservation).expect("complete on an unknown reservation");
        e.completes += 1;
        e.state = State::Filled;
    }

    fn abort(&self, reservation: u64, why: &str) {
        let mut t = self.table.lock().unwrap();
        let e = t.get_mut(&reservation).expect("abort on an unknown reservation");
        e.aborts.push(why.to_string());
        e.state = State::Released;
    }

    fn adapter_id(&self, reservation: u64) -> String {
        self.adapters.lock().unwrap().get(&reservation).cloned().unwrap_or_default()
    }
}

/// Connects, writes `bytes`, closes the write side when `close` is set, and returns everything
/// the receiver sends until it closes the connection.
pub async fn exchange(addr: SocketAddr, bytes: &[u8], close: bool) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    if close {
        s.shutdown().await.unwrap();
    }
    read_to_close(&mut s).await
}

/// Reads until EOF (or a reset, which ends the conversation as well).
pub async fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await {
            Err(_) => panic!("receiver never closed the connection"),
            Ok(Ok(0)) | Ok(Err(_)) => return out,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// Splits a byte stream from the receiver into frames (tag, body).
pub fn frames(mut b: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while b.len() >= wire::FRAME_HEADER_BYTES {
        let len = u32::from_le_bytes([b[1], b[2], b[3], b[4]]) as usize;
        let end = (wire::FRAME_HEADER_BYTES + len).min(b.len());
        out.push((b[0], b[wire::FRAME_HEADER_BYTES..end].to_vec()));
        b = &b[end..];
    }
    out
}

/// The message of the ERROR frame in a receiver's answer; panics if there is none.
pub fn error_message(answer: &[u8]) -> String {
    frames(answer)
        .into_iter()
        .find(|(t, _)| *t == wire::tag::ERROR)
        .map(|(_, b)| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_else(|| panic!("no ERROR frame in the answer {:?}", frames(answer)))
}
