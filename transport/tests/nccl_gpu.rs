//! NCCL send/recv between two GPUs of this machine: rank 0 on cuda:0 sends pieces, rank 1 on
//! cuda:1 receives them into other addresses, and the bytes must arrive intact; then a receive
//! nobody answers must time out and leave the peer broken.
//!
//! Without a GPU the test prints a `SKIPPED` line and passes, unless `TANDEM_REQUIRE_GPU=1`,
//! which makes it fail. With exactly one GPU it prints a `NOT RUN` line and passes even under
//! `TANDEM_REQUIRE_GPU=1`, whether NCCL is there or not: NCCL refuses two ranks on one device, so
//! such a machine cannot run it. With two GPUs and no NCCL it skips (`TANDEM_REQUIRE_EXTERNAL=1`
//! makes that fail).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use tandem_engine::cuda;
use tandem_test_support::{skip_test, Prerequisite};
use tandem_transport::nccl::{self, NcclError, NcclPeer};

const TEST: &str = "nccl_send_recv_between_two_gpus";
const TIMEOUT: Duration = Duration::from_secs(60);

fn addr(slice: &CudaSlice<u8>, stream: &Arc<CudaStream>) -> u64 {
    let (ptr, _sync) = slice.device_ptr(stream);
    ptr
}

#[test]
fn nccl_send_recv_between_two_gpus() {
    if let Err(e) = cuda::probe(0) {
        skip_test(
            Prerequisite::Gpu,
            TEST,
            &format!("no usable GPU ({e})"),
            "run it on a machine with NVIDIA GPUs",
        );
        return;
    }
    // Count the GPUs before looking for NCCL: a one-GPU machine cannot run this test whether or
    // not it has the library, and that is NOT RUN, not a missing prerequisite.
    let count = CudaContext::device_count().expect("counting CUDA devices");
    if count < 2 {
        eprintln!("NOT RUN {TEST}: {count} GPU here; NCCL needs its two ranks on two different GPUs");
        return;
    }
    let lib = match nccl::load() {
        Ok(lib) => lib,
        Err(e) => {
            skip_test(Prerequisite::External, TEST, &e.to_string(), "pip install nvidia-nccl-cu13");
            return;
        }
    };
    eprintln!("NCCL {:?} from {}", lib.version(), lib.path());

    let ctx0 = CudaContext::new(0).expect("cuda:0");
    let ctx1 = CudaContext::new(1).expect("cuda:1");
    let s0 = ctx0.default_stream();
    let s1 = ctx1.default_stream();

    // Three pieces of different sizes, one of 0 bytes, at other offsets on each side.
    let sizes = [4096usize, 0, 1 << 20, 333];
    let data: Vec<u8> = (0..sizes.iter().sum::<usize>() + 4096).map(|i| (i * 31 % 251) as u8).collect();
    let src = s0.clone_htod(&data).expect("upload");
    let dst = s1.alloc_zeros::<u8>(data.len() + 8192).expect("alloc on cuda:1");
    s0.synchronize().unwrap();
    s1.synchronize().unwrap();
    let (src_base, dst_base) = (addr(&src, &s0), addr(&dst, &s1));
    let mut send_pieces = Vec::new();
    let mut recv_pieces = Vec::new();
    let (mut so, mut ro) = (0usize, 8192usize);
    for &n in &sizes {
        send_pieces.push((src_base + so as u64, n));
        recv_pieces.push((dst_base + ro as u64, n));
        so += n;
        ro += n;
    }

    let id = lib.unique_id().expect("unique id");
    let c1 = ctx1.clone();
    let decode =
        std::thread::spawn(move || NcclPeer::connect(lib, c1, id, 1, TIMEOUT).expect("rank 1 connects"));
    let prefill = NcclPeer::connect(lib, ctx0.clone(), id, 0, TIMEOUT).expect("rank 0 connects");
    let decode = decode.join().unwrap();
    assert_eq!((prefill.rank(), prefill.ordinal(), decode.rank(), decode.ordinal()), (0, 0, 1, 1));

    let expected_recv = recv_pieces.clone();
    let decode = std::thread::spawn(move || {
        // SAFETY: `dst` is alive until the end of the test and nothing else touches it meanwhile.
        let r = unsafe { decode.recv(expected_recv, TIMEOUT) };
        (decode, r)
    });
    // SAFETY: `src` is alive and not written until the end of the test.
    unsafe { prefill.send(send_pieces, TIMEOUT) }.expect("send");
    let (decode, received) = decode.join().unwrap();
    received.expect("recv");

    // An empty list is no work on either side.
    // SAFETY: no memory is named.
    unsafe { prefill.send(Vec::new(), TIMEOUT) }.expect("empty send");

    let got = s1.clone_dtoh(&dst).expect("download");
    let mut offset = 0;
    for (i, &(_, n)) in recv_pieces.iter().enumerate() {
        let at = (recv_pieces[i].0 - dst_base) as usize;
        assert_eq!(&got[at..at + n], &data[offset..offset + n], "piece {i}");
        offset += n;
    }
    assert!(got[..8192].iter().all(|&b| b == 0), "bytes before the first piece were written");

    // A receive nobody answers times out, and the peer stays broken.
    // SAFETY: `dst` is alive; after a timeout the test waits until the peer is idle.
    let err = unsafe { decode.recv(vec![(dst_base, 1024)], Duration::from_millis(300)) }.unwrap_err();
    assert_eq!(err.kind(), "timeout", "{err}");
    assert!(decode.is_broken());
    // SAFETY: as above.
    let again = unsafe { decode.recv(vec![(dst_base, 1024)], TIMEOUT) }.unwrap_err();
    assert!(matches!(again, NcclError::Broken(_)), "{again}");
    prefill.abort();
    assert!(prefill.is_broken());
    drop(prefill);
    let waited = std::time::Instant::now();
    while decode.is_busy() && waited.elapsed() < TIMEOUT {
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(decode);
}
