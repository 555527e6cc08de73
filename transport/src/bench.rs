//! Transfer throughput: the real sender and receiver between two in-process pools (sender on a
//! blocking thread as the engine thread would be, receiver on the tokio runtime, a real
//! loopback socket), next to a plain memcpy of the same number of bytes measured in the same
//! run. Not a test: no thresholds, numbers only.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tandem_proto::v1::KvDestination;

use crate::{
    block_payload_bytes, KvReceiver, KvSender, ReceiverOptions, ReservationGate, SenderOptions,
    TransportError, TransportKind,
};
use tandem_engine::kv::{BlockId, CpuKvPool, KvDtype, KvLayout};

/// What to measure.
#[derive(Debug, Clone)]
pub struct TransferBenchOptions {
    /// KV geometry (a model's layers, KV heads, head dim and block size); `num_blocks` is
    /// ignored: both pools are sized for the longest prompt.
    pub layout: KvLayout,
    /// Prompt lengths in tokens (each is rounded up to whole blocks).
    pub prompt_tokens: Vec<usize>,
    /// Timed repetitions per row (after one untimed warm-up); the median is reported.
    pub repetitions: usize,
    /// Transports to time (a memcpy row is always added).
    pub transports: Vec<TransportKind>,
}

impl Default for TransferBenchOptions {
    fn default() -> Self {
        TransferBenchOptions {
            // SmolLM2-135M: 30 layers, 3 KV heads of 64, the CPU's default KV dtype.
            layout: KvLayout {
                num_layers: 30,
                num_blocks: 0,
                block_size: 16,
                num_kv_heads: 3,
                head_dim: 64,
                dtype: KvDtype::F16,
            },
            prompt_tokens: vec![1024, 2048, 4096],
            repetitions: 5,
            transports: vec![TransportKind::Shm, TransportKind::Tcp],
        }
    }
}

/// One measured row.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TransferBenchRow {
    /// `"memcpy"`, `"shm"` or `"tcp"`.
    pub transport: String,
    pub tokens: usize,
    /// Block payload bytes moved (whole blocks).
    pub bytes: u64,
    /// Median wall time of one transfer: open, stage, send, acknowledgement.
    pub seconds: f64,
    /// `bytes / seconds / 1e9`.
    pub gb_per_s: f64,
    pub repetitions: usize,
}

/// Hands out blocks `0..n` for reservation `n`, counts nothing: the benchmark's gate.
#[derive(Default)]
struct BenchGate {
    open: Mutex<HashMap<u64, Vec<BlockId>>>,
}

impl ReservationGate for BenchGate {
    fn begin(&self, reservation: u64) -> Result<Vec<BlockId>, String> {
        let mut m = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if m.contains_key(&reservation) {
            return Err(format!("reservation {reservation} is already transferring"));
        }
        let blocks: Vec<BlockId> = (0..reservation as BlockId).collect();
        m.insert(reservation, blocks.clone());
        Ok(blocks)
    }
    fn complete(&self, reservation: u64) {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).remove(&reservation);
    }
    fn abort(&self, reservation: u64, why: &str) {
        tracing::warn!(reservation, why, "benchmark transfer aborted");
        self.open.lock().unwrap_or_else(|p| p.into_inner()).remove(&reservation);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn row(transport: &str, tokens: usize, bytes: u64, times: Vec<f64>) -> TransferBenchRow {
    let repetitions = times.len();
    let seconds = median(times);
    let gb_per_s = if seconds > 0.0 { bytes as f64 / seconds / 1e9 } else { f64::INFINITY };
    TransferBenchRow { transport: transport.into(), tokens, bytes, seconds, gb_per_s, repetitions }
}

/// Times transfers of each prompt length over each transport, plus a memcpy of the same bytes.
/// Rows come per prompt length: memcpy first, then the transports in the order given.
pub fn run_transfer_bench(opts: &TransferBenchOptions) -> Result<Vec<TransferBenchRow>, TransportError> {
    let invalid = |m: String| Err(TransportError::Invalid(m));
    if opts.prompt_tokens.is_empty() || opts.prompt_tokens.contains(&0) {
        return invalid(format!("prompt lengths must be positive (got {:?})", opts.prompt_tokens));
    }
    if opts.repetitions == 0 {
        return invalid("at least one repetition is needed".into());
    }
    let bs = opts.layout.block_size.max(1);
    let max_blocks = opts.prompt_tokens.iter().map(|t| t.div_ceil(bs)).max().unwrap_or(1);
    let layout = KvLayout { num_blocks: max_blocks, ..opts.layout };
    layout.validate()?;

    // Source: private memory with arbitrary (non-zero) bytes; destination: a shared segment.
    let mut src = CpuKvPool::try_new(layout)?;
    let bb = layout.block_bytes();
    let mut x: u32 = 0x9e37_79b9;
    let mut fill = vec![0u8; bb];
    for block in 0..max_blocks as BlockId {
        for layer in 0..layout.num_layers {
            for b in fill.iter_mut() {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                *b = x as u8;
            }
            src.write_block_bytes(layer, block, &fill, &fill)?;
        }
    }
    let src = Arc::new(src);
    let dst = CpuKvPool::try_new_shared(layout)?;
    let payload = block_payload_bytes(&layout);

    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(|e| {
            TransportError::Io {
                peer: "localhost".into(),
                what: "starting the benchmark runtime".into(),
                source: e,
            }
        })?;
    let mut rows = Vec::new();
    rt.block_on(async {
        let gate = Arc::new(BenchGate::default());
        let rx = KvReceiver::bind(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            dst.sink(),
            gate.clone(),
            ReceiverOptions::default(),
        )
        .await?;
        let sender = KvSender::new(layout, SenderOptions::default());
        let addr = rx.local_addr().to_string();
        let segment = dst.segment_path().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        for &tokens in &opts.prompt_tokens {
            let n = tokens.div_ceil(bs);
            let bytes = (n * payload) as u64;

            let from = vec![1u8; n * payload];
            let mut to = vec![0u8; n * payload];
            let mut times = Vec::new();
            for rep in 0..=opts.repetitions {
                let t = Instant::now();
                to.copy_from_slice(std::hint::black_box(&from));
                std::hint::black_box(&mut to);
                if rep > 0 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            drop((from, to));
            rows.push(row("memcpy", tokens, bytes, times));

            for &kind in &opts.transports {
                let dest = KvDestination {
                    worker_id: "bench".into(),
                    transport: kind.as_str().into(),
                    address: addr.clone(),
                    segment_path: if kind == TransportKind::Shm { segment.clone() } else { String::new() },
                    reservation_id: n as u64,
                    block_ids: (0..n as BlockId).collect(),
                    skip_blocks: 0,
                    ..Default::default()
                };
                let src_blocks: Vec<BlockId> = (0..n as BlockId).collect();
                let mut times = Vec::new();
                for rep in 0..=opts.repetitions {
                    let t = Instant::now();
                    let mut session = sender.open(&dest).await?;
                    let (s, blocks) = (src.clone(), src_blocks.clone());
                    let session = tokio::task::spawn_blocking(move || {
                        session.stage_from(&*s, &blocks).map(|()| session)
                    })
                    .await
                    .map_err(|e| TransportError::Invalid(format!("staging task failed: {e}")))??;
                    let report = session.finish().await?;
                    if rep > 0 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                    if report.bytes != bytes {
                        return Err(TransportError::Invalid(format!(
                            "{kind} transfer moved {} bytes, expected {bytes}",
                            report.bytes
                        )));
                    }
                }
                rows.push(row(kind.as_str(), tokens, bytes, times));
            }
        }
        rx.shutdown().await;
        Ok::<(), TransportError>(())
    })?;
    Ok(rows)
}
