//! Transfer throughput: the real sender and receiver between two in-process pools (sender on a
//! long-lived thread of its own as on a prefill worker's engine thread, receiver on the tokio
//! runtime, a real loopback socket), next to a plain memcpy of the same number of bytes measured
//! in the same run and, when tcp is timed, a bare loopback socket moving those bytes and nothing
//! else (the ceiling of any transfer over TCP on this host). Not a test: no thresholds, numbers
//! only.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::{
    block_payload_bytes, KvBlockSource, KvDestination, KvReceiver, KvSender, NixlConfig, ReceiverOptions,
    ReservationGate, SenderOptions, TransportError, TransportKind,
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
    /// Transports to time (a memcpy row, or on GPUs a device-to-device copy row, is always
    /// added).
    pub transports: Vec<TransportKind>,
    /// `(source, destination)` CUDA ordinals: time the GPU transports between pools on these
    /// devices (they may be the same) instead of host pools. Default none.
    pub gpus: Option<(usize, usize)>,
    /// nixl's library and backend, when `transports` holds nixl. Default: the library from
    /// `TANDEM_NIXL_LIB` (else the loader's path) and the UCX backend.
    pub nixl: NixlConfig,
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
            gpus: None,
            nixl: NixlConfig::default(),
        }
    }
}

/// One measured row.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TransferBenchRow {
    /// `"memcpy"`, `"socket"` (a bare loopback TCP socket), `"copy-summed"` / `"copy+sum"`
    /// (staging alone, checksummed while copying / after copying), `"d2d"` (a device-to-device copy),
    /// `"shm"`, `"tcp"`, `"cuda-ipc"` or `"nccl"`.
    pub transport: String,
    pub tokens: usize,
    /// Block payload bytes moved (whole blocks).
    pub bytes: u64,
    /// Median wall time of one transfer: open, stage, send, acknowledgement.
    pub seconds: f64,
    /// `bytes / seconds / 1e9`.
    pub gb_per_s: f64,
    /// Transports: median time the sender's thread spent staging (on the host, copying and
    /// checksumming the blocks; on GPUs, issuing the copies and waiting for them); the engine
    /// thread of a prefill worker is busy that long per transfer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage_seconds: Option<f64>,
    /// Transports: median time from the start of staging to the acknowledgement, the part of a
    /// transfer a request waits for after its prefill (a prefill worker opens the session
    /// before it prefills).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_open_seconds: Option<f64>,
    pub repetitions: usize,
    /// Why the transport could not be timed here (then `seconds` and `gb_per_s` are NaN).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
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
    TransferBenchRow {
        transport: transport.into(),
        tokens,
        bytes,
        seconds,
        gb_per_s,
        stage_seconds: None,
        after_open_seconds: None,
        repetitions,
        unavailable: None,
    }
}

/// A transport's row: whole transfers timed, and the parts of each.
fn transfer_row(transport: &str, tokens: usize, bytes: u64, t: Timings) -> TransferBenchRow {
    TransferBenchRow {
        stage_seconds: Some(median(t.stages)),
        after_open_seconds: Some(median(t.after_open)),
        ..row(transport, tokens, bytes, t.whole)
    }
}

/// Seconds per timed transfer: whole (open to acknowledgement), staging only, and staging to
/// acknowledgement.
#[derive(Default)]
struct Timings {
    whole: Vec<f64>,
    stages: Vec<f64>,
    after_open: Vec<f64>,
}

fn unavailable_row(transport: &str, tokens: usize, bytes: u64, why: String) -> TransferBenchRow {
    TransferBenchRow {
        transport: transport.into(),
        tokens,
        bytes,
        seconds: f64::NAN,
        gb_per_s: f64::NAN,
        stage_seconds: None,
        after_open_seconds: None,
        repetitions: 0,
        unavailable: Some(why),
    }
}

/// Pseudo-random, non-zero-ish bytes for the source blocks.
fn fill_blocks(
    layout: &KvLayout,
    mut write: impl FnMut(usize, BlockId, &[u8]) -> Result<(), TransportError>,
) -> Result<(), TransportError> {
    let mut x: u32 = 0x9e37_79b9;
    let mut fill = vec![0u8; layout.block_bytes()];
    for block in 0..layout.num_blocks as BlockId {
        for layer in 0..layout.num_layers {
            for b in fill.iter_mut() {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                *b = x as u8;
            }
            write(layer, block, &fill)?;
        }
    }
    Ok(())
}

/// Times `reps` transfers (after one untimed) of blocks `0..n` of `src` into blocks `0..n` of
/// the receiver's pool over `kind`: each whole (open to acknowledgement), and its staging.
async fn time_transfers<S: KvBlockSource + Send + Sync + ?Sized + 'static>(
    sender: &KvSender,
    rx: &KvReceiver,
    kind: TransportKind,
    n: usize,
    bytes: u64,
    src: Arc<S>,
    reps: usize,
) -> Result<Timings, TransportError> {
    let offer = rx
        .offers()
        .into_iter()
        .find(|o| o.kind == kind)
        .ok_or_else(|| TransportError::Invalid(format!("the receiver does not offer {kind}")))?;
    let dest = KvDestination {
        worker_id: "bench".into(),
        ..KvDestination::for_offer(&offer, n as u64, (0..n as BlockId).collect())
    };
    let src_blocks: Vec<BlockId> = (0..n as BlockId).collect();
    // Every repetition stages on one long-lived thread, as a prefill worker stages on its engine
    // thread. (Staged on the runtime's blocking pool and awaited here, the tasks the staging woke
    // were often run only after it finished, on the 2-core development machine.) The thread
    // ends when `jobs` is dropped.
    type Job = Box<dyn FnOnce() + Send>;
    let (jobs, queue) = std::sync::mpsc::channel::<Job>();
    std::thread::Builder::new()
        .name("bench-stage".into())
        .spawn(move || queue.into_iter().for_each(|job| job()))
        .map_err(|e| TransportError::Invalid(format!("cannot start the staging thread: {e}")))?;
    let mut timed = Timings::default();
    for rep in 0..=reps {
        let t = Instant::now();
        let mut session = sender.open(&dest).await?;
        let opened = Instant::now();
        let (s, blocks) = (src.clone(), src_blocks.clone());
        let (done, staged) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = done.send(session.stage_from(&*s, &blocks).map(|()| session));
        });
        jobs.send(job).map_err(|_| TransportError::Invalid("the staging thread is gone".into()))?;
        let session =
            staged.await.map_err(|_| TransportError::Invalid("the staging thread panicked".into()))??;
        let report = session.finish().await?;
        if rep > 0 {
            timed.whole.push(t.elapsed().as_secs_f64());
            timed.after_open.push(opened.elapsed().as_secs_f64());
            timed.stages.push(report.stage_seconds);
        }
        if report.bytes != bytes {
            return Err(TransportError::Invalid(format!(
                "{kind} transfer moved {} bytes, expected {bytes}",
                report.bytes
            )));
        }
    }
    Ok(timed)
}

fn runtime() -> Result<tokio::runtime::Runtime, TransportError> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(|e| {
        TransportError::Io {
            peer: "localhost".into(),
            what: "starting the benchmark runtime".into(),
            source: e,
        }
    })
}

/// Seconds to move `bytes` through a bare loopback TCP connection (one writer thread writing
/// 1 MiB at a time, one reader thread reading straight into a destination buffer, as the tcp
/// receiver reads into the reserved blocks), once per repetition after one untimed warm-up: what
/// the kernel's two copies of loopback TCP cost alone.
fn time_socket(bytes: usize, repetitions: usize) -> Result<Vec<f64>, TransportError> {
    use std::io::{Read, Write};
    let io = |what: &str| {
        let what = what.to_owned();
        move |source| TransportError::Io { peer: "localhost".into(), what: what.clone(), source }
    };
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).map_err(io("binding a loopback socket"))?;
    let addr = listener.local_addr().map_err(io("reading the socket's address"))?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut sink = vec![0u8; bytes];
        loop {
            // One round: `bytes` read into `sink`, one byte of acknowledgement back.
            let mut got = 0;
            while got < bytes {
                let n = s.read(&mut sink[got..])?;
                if n == 0 {
                    return Ok(());
                }
                got += n;
            }
            std::hint::black_box(&sink);
            s.write_all(&[1])?;
        }
    });
    let mut s = std::net::TcpStream::connect(addr).map_err(io("connecting a loopback socket"))?;
    s.set_nodelay(true).map_err(io("setting TCP_NODELAY"))?;
    let data = vec![7u8; bytes];
    let mut times = Vec::new();
    for rep in 0..=repetitions {
        let t = Instant::now();
        for chunk in data.chunks(1 << 20) {
            s.write_all(chunk).map_err(io("writing to a loopback socket"))?;
        }
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).map_err(io("reading from a loopback socket"))?;
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    drop(s);
    let _ = reader.join();
    Ok(times)
}

/// Seconds to stage blocks `0..n` of `src` alone, with no peer and no protocol: every layer's
/// pieces copied into a buffer of the transfer's size in the sender's order and checksummed,
/// either in the same pass ([`KvBlockSource::read_block_summed`], as senders do) or by a second
/// pass over each copied piece (the trait's default, as senders did before). Timed `reps` times
/// after one, each way in turn.
fn time_staging(src: &CpuKvPool, n: usize, reps: usize) -> Result<(Vec<f64>, Vec<f64>), TransportError> {
    /// The pool seen only through the trait's default, which sums each copy afterwards.
    struct TwoPass<'a>(&'a CpuKvPool);
    impl KvBlockSource for TwoPass<'_> {
        fn source_layout(&self) -> KvLayout {
            self.0.layout()
        }
        fn read_block_into(
            &self,
            layer: usize,
            block: BlockId,
            k: &mut [u8],
            v: &mut [u8],
        ) -> Result<(), tandem_engine::kv::KvError> {
            self.0.read_block_into(layer, block, k, v)
        }
    }
    let layout = src.layout();
    let piece = layout.block_bytes();
    let mut dst = vec![0u8; n * 2 * piece * layout.num_layers];
    let stage = |s: &dyn KvBlockSource, dst: &mut [u8]| -> Result<f64, TransportError> {
        let t = Instant::now();
        let mut sums = vec![0u32; n];
        let mut pieces = dst.chunks_exact_mut(piece);
        for layer in 0..layout.num_layers {
            for (block, sum) in sums.iter_mut().enumerate() {
                let (k, v) = (pieces.next(), pieces.next());
                let (Some(k), Some(v)) = (k, v) else {
                    return Err(TransportError::Invalid("staging buffer too small".into()));
                };
                *sum = s.read_block_summed(layer, block as BlockId, k, v, *sum)?;
            }
        }
        std::hint::black_box(&sums);
        Ok(t.elapsed().as_secs_f64())
    };
    let (mut fused, mut two_pass) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let (a, b) = (stage(src, &mut dst)?, stage(&TwoPass(src), &mut dst)?);
        if rep > 0 {
            fused.push(a);
            two_pass.push(b);
        }
    }
    Ok((fused, two_pass))
}

/// Times transfers of each prompt length over each transport, plus a memcpy of the same bytes
/// (and, when tcp is timed, a bare loopback socket), and staging alone both ways
/// ([`time_staging`]). Rows come per prompt length: memcpy first, then the socket, then
/// `copy-summed` and `copy+sum` (staging alone), then the transports in the order given.
pub fn run_transfer_bench(opts: &TransferBenchOptions) -> Result<Vec<TransferBenchRow>, TransportError> {
    let invalid = |m: String| Err(TransportError::Invalid(m));
    if opts.prompt_tokens.is_empty() || opts.prompt_tokens.contains(&0) {
        return invalid(format!("prompt lengths must be positive (got {:?})", opts.prompt_tokens));
    }
    if opts.repetitions == 0 {
        return invalid("at least one repetition is needed".into());
    }
    if let Some((from, to)) = opts.gpus {
        return gpu::run(opts, from, to);
    }
    let bs = opts.layout.block_size.max(1);
    let max_blocks = opts.prompt_tokens.iter().map(|t| t.div_ceil(bs)).max().unwrap_or(1);
    let layout = KvLayout { num_blocks: max_blocks, ..opts.layout };
    layout.validate()?;

    // nixl is loaded only when asked for.
    let nixl = opts.transports.contains(&TransportKind::Nixl).then(|| opts.nixl.clone());
    // Source: private memory with arbitrary bytes; destination: a shared segment.
    let mut src = CpuKvPool::try_new(layout)?;
    fill_blocks(&layout, |layer, block, b| Ok(src.write_block_bytes(layer, block, b, b)?))?;
    let src = Arc::new(src);
    let dst = CpuKvPool::try_new_shared(layout)?;
    let payload = block_payload_bytes(&layout);

    let rt = runtime()?;
    let mut rows = Vec::new();
    rt.block_on(async {
        let gate = Arc::new(BenchGate::default());
        let rx = KvReceiver::bind(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            dst.sink(),
            gate.clone(),
            ReceiverOptions { nixl: nixl.clone(), ..ReceiverOptions::default() },
        )
        .await?;
        if let Some(why) = nixl.as_ref().and_then(|_| rx.unavailable(TransportKind::Nixl)) {
            return Err(TransportError::Invalid(format!("--transfer-transports nixl: {why}")));
        }
        let sender = KvSender::new(layout, SenderOptions { nixl: nixl.clone(), ..SenderOptions::default() });
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
            if opts.transports.contains(&TransportKind::Tcp) {
                let times = time_socket(bytes as usize, opts.repetitions)?;
                rows.push(row("socket", tokens, bytes, times));
            }

            let (fused, two_pass) = time_staging(&src, n, opts.repetitions)?;
            rows.push(row("copy-summed", tokens, bytes, fused));
            rows.push(row("copy+sum", tokens, bytes, two_pass));

            for &kind in &opts.transports {
                let timings =
                    time_transfers(&sender, &rx, kind, n, bytes, src.clone(), opts.repetitions).await?;
                rows.push(transfer_row(&row_name(kind), tokens, bytes, timings));
            }
        }
        rx.shutdown().await;
        Ok::<(), TransportError>(())
    })?;
    Ok(rows)
}

/// The GPU rows: both pools on GPUs (on contexts of their own, as two workers' would be), a
/// device-to-device copy of the same bytes as the baseline, then cuda-ipc and nccl through the
/// real sender and receiver. Both sides run in this process, so cuda-ipc uses the pool's own
/// address instead of opening its IPC handle; the copies are the same. After the last transfer
/// of each row the first and last blocks are read back and compared with the source.
mod gpu {
    use super::*;
    use tandem_engine::cuda::DeviceKvPool;

    fn engine(e: tandem_engine::EngineError) -> TransportError {
        TransportError::Invalid(e.to_string())
    }

    /// A copy of `bytes` from the start of `src` to the start of `dst` (the same bytes a
    /// transfer of that many blocks moves, in one piece), timed `reps` times after one.
    fn d2d(
        src: &DeviceKvPool,
        dst: &DeviceKvPool,
        bytes: usize,
        reps: usize,
    ) -> Result<Vec<f64>, TransportError> {
        use cudarc::driver::sys;
        let err = |what: &str, e: &dyn std::fmt::Display| TransportError::Invalid(format!("{what}: {e}"));
        tandem_engine::cuda::bind(src.context()).map_err(|e| err("binding the context", &e))?;
        let stream = src.context().new_stream().map_err(|e| err("creating a stream", &e))?;
        let mut times = Vec::new();
        for rep in 0..=reps {
            let t = Instant::now();
            // SAFETY: both are live pool allocations of at least `bytes` bytes (the caller sizes
            // the pools for the longest prompt), on their own contexts.
            unsafe {
                sys::cuMemcpyPeerAsync(
                    dst.base(),
                    dst.context().cu_ctx(),
                    src.base(),
                    src.context().cu_ctx(),
                    bytes,
                    stream.cu_stream(),
                )
                .result()
            }
            .map_err(|e| err("device-to-device copy", &e))?;
            stream.synchronize().map_err(|e| err("waiting for the copy", &e))?;
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        Ok(times)
    }

    pub(super) fn run(
        opts: &TransferBenchOptions,
        from: usize,
        to: usize,
    ) -> Result<Vec<TransferBenchRow>, TransportError> {
        let bs = opts.layout.block_size.max(1);
        let max_blocks = opts.prompt_tokens.iter().map(|t| t.div_ceil(bs)).max().unwrap_or(1);
        let layout = KvLayout { num_blocks: max_blocks, ..opts.layout };
        layout.validate()?;
        let (src, src_sink) = tandem_engine::cuda::allocate_kv_pool(from, layout).map_err(engine)?;
        let (dst, dst_sink) = tandem_engine::cuda::allocate_kv_pool(to, layout).map_err(engine)?;
        // SAFETY: nothing else uses the freshly made source pool.
        fill_blocks(&layout, |layer, block, b| Ok(unsafe { src_sink.write_block(layer, block, b, b) }?))?;
        let source = Arc::new(src.clone());
        let payload = block_payload_bytes(&layout);
        let rt = runtime()?;
        let mut rows = Vec::new();
        rt.block_on(async {
            let rx = KvReceiver::bind(
                SocketAddr::from(([127, 0, 0, 1], 0)),
                dst_sink.clone(),
                Arc::new(BenchGate::default()),
                ReceiverOptions::default(),
            )
            .await?;
            let sender = KvSender::new(
                layout,
                SenderOptions { device: Some(src.clone()), ..SenderOptions::default() },
            );
            for &tokens in &opts.prompt_tokens {
                let n = tokens.div_ceil(bs);
                let bytes = (n * payload) as u64;
                rows.push(row("d2d", tokens, bytes, d2d(&src, &dst, n * payload, opts.repetitions)?));
                for &kind in opts.transports.iter().filter(|k| k.needs_gpu()) {
                    let why = if kind == TransportKind::Nccl && from == to {
                        Some("NCCL cannot put two ranks on one GPU; give two devices".to_string())
                    } else if !rx.offers().iter().any(|o| o.kind == kind) {
                        Some(
                            match kind {
                                TransportKind::Nccl => rx.nccl_unavailable(),
                                _ => rx.cuda_ipc_unavailable(),
                            }
                            .unwrap_or_else(|| format!("{kind} is not offered")),
                        )
                    } else {
                        None
                    };
                    if let Some(why) = why {
                        rows.push(unavailable_row(kind.as_str(), tokens, bytes, why));
                        continue;
                    }
                    let timings =
                        time_transfers(&sender, &rx, kind, n, bytes, source.clone(), opts.repetitions)
                            .await?;
                    for b in [0, n as BlockId - 1] {
                        // SAFETY: no transfer is in flight.
                        let (got, want) =
                            unsafe { (dst_sink.block_checksum(b)?, src_sink.block_checksum(b)?) };
                        if got != want {
                            return Err(TransportError::Invalid(format!(
                                "{kind}: destination block {b} differs from the source after the transfer"
                            )));
                        }
                    }
                    rows.push(transfer_row(kind.as_str(), tokens, bytes, timings));
                }
            }
            rx.shutdown().await;
            Ok::<(), TransportError>(())
        })?;
        Ok(rows)
    }
}

/// A transfer row's name: the kind's, and for nixl the UCX transports when `UCX_TLS` picks them
/// (`nixl UCX_TLS=tcp`, the stand-in for two hosts without RDMA).
pub fn row_name(kind: TransportKind) -> String {
    match std::env::var("UCX_TLS") {
        Ok(tls) if kind == TransportKind::Nixl && !tls.is_empty() => format!("nixl UCX_TLS={tls}"),
        _ => kind.as_str().to_owned(),
    }
}
