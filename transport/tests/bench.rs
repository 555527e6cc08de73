//! The transfer benchmark runs end to end and reports consistent rows. (Numbers are printed,
//! never asserted: `cargo test -p tandem-engine --test transport_bench -- --ignored --nocapture`
//! prints the full table.)

use tandem_engine::kv::{KvDtype, KvLayout};
use tandem_transport::{block_payload_bytes, run_transfer_bench, TransferBenchOptions, TransportKind};

fn print(rows: &[tandem_transport::TransferBenchRow]) {
    println!("{:>8} {:>7} {:>12} {:>10} {:>8}", "kind", "tokens", "bytes", "ms", "GB/s");
    for r in rows {
        println!(
            "{:>8} {:>7} {:>12} {:>10.3} {:>8.2}",
            r.transport,
            r.tokens,
            r.bytes,
            r.seconds * 1e3,
            r.gb_per_s
        );
    }
}

#[test]
fn bench_rows_cover_every_transport_and_length() {
    let layout = KvLayout {
        num_layers: 3,
        num_blocks: 0,
        block_size: 4,
        num_kv_heads: 2,
        head_dim: 16,
        dtype: KvDtype::F16,
    };
    let opts = TransferBenchOptions {
        layout,
        prompt_tokens: vec![5, 64],
        repetitions: 2,
        transports: vec![TransportKind::Shm, TransportKind::Tcp],
        gpus: None,
        ..Default::default()
    };
    if !tandem_engine::cuda::driver_present() {
        // GPU rows without a GPU: an error naming the driver, not a panic.
        let gpu = TransferBenchOptions {
            gpus: Some((0, 0)),
            transports: vec![TransportKind::CudaIpc],
            ..opts.clone()
        };
        let e = run_transfer_bench(&gpu).unwrap_err().to_string();
        assert!(e.contains("no NVIDIA driver"), "{e}");
    }
    let rows = run_transfer_bench(&opts).unwrap();
    print(&rows);
    let kinds: Vec<(&str, usize)> = rows.iter().map(|r| (r.transport.as_str(), r.tokens)).collect();
    // With tcp timed, a bare loopback socket's row follows memcpy's; staging alone (both ways)
    // comes before the transports.
    let per_length = ["memcpy", "socket", "copy-summed", "copy+sum", "shm", "tcp"];
    let expected: Vec<(&str, usize)> =
        [5, 64].into_iter().flat_map(|t| per_length.iter().map(move |&k| (k, t))).collect();
    assert_eq!(kinds, expected);
    for r in &rows {
        // Whole blocks: 5 tokens need 2 blocks of 4.
        assert_eq!(r.bytes as usize, r.tokens.div_ceil(4) * block_payload_bytes(&layout));
        assert_eq!(r.repetitions, 2);
        assert!(r.seconds > 0.0 && r.gb_per_s > 0.0, "{r:?}");
        // Only transfers have parts, each within the whole: staging within staging to
        // acknowledgement, within open to acknowledgement.
        let transfer = ["shm", "tcp"].contains(&r.transport.as_str());
        match (r.stage_seconds, r.after_open_seconds) {
            (Some(s), Some(a)) => {
                assert!(transfer, "{r:?}");
                assert!(s > 0.0 && s <= a && a <= r.seconds, "{r:?}");
            }
            (None, None) => assert!(!transfer, "{r:?}"),
            _ => panic!("a staging time without the time after opening, or the reverse: {r:?}"),
        }
    }
    assert!(run_transfer_bench(&TransferBenchOptions { repetitions: 0, ..opts }).is_err());
}

#[test]
#[ignore = "benchmark: run explicitly"]
fn bench_smollm2_layout() {
    let rows = run_transfer_bench(&TransferBenchOptions::default()).unwrap();
    print(&rows);
    assert_eq!(rows.len(), 18);
}
