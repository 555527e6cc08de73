//! FP8 checkpoints (`F8_E4M3` weights with block scales, `quant_method: "fp8"`) on the CPU: the
//! fixture `qwen3-fp8` (made by `scripts/make_fp8_fixture.py` from the tiny Qwen3) computes the
//! logits of its dequantized twin `qwen3-fp8-twin` (F32 weights) bit for bit, stays near the
//! unquantized model it came from, and a checkpoint of another quantization method, or block
//! scales without a block size, is refused by name.

use tandem_engine::backend::{Backend, BackendOptions, LogitsRequest, SeqChunk};
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::{BlockAllocator, WriteMode};
use tandem_engine::loader::load_model;

#[path = "../../tests/reference/fixture_reader.rs"]
mod fixture_reader;
use fixture_reader::{fixture, read_reference};

/// Every position's logits of every reference prompt of `qwen3` under `model`'s weights.
fn logits(model: &str) -> Vec<Vec<f32>> {
    let m = load_model(&fixture(model)).unwrap_or_else(|e| panic!("loading {model}: {e}"));
    let opts = BackendOptions {
        num_blocks: 64,
        block_size: 8,
        max_batch_tokens: 256,
        threads: 1,
        ..Default::default()
    };
    let mut be = CpuBackend::new(m.config, m.weights, opts).unwrap();
    let (_, prompts) = read_reference("qwen3");
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut alloc = BlockAllocator::new(64, 8);
        alloc.add_sequence(i as u64, p.ids.len()).unwrap();
        let table = alloc.block_table(i as u64).unwrap().to_vec();
        let chunk = SeqChunk {
            tokens: &p.ids,
            start_pos: 0,
            block_table: &table,
            logits: LogitsRequest::All,
            write: WriteMode::Direct,
            adapter: None,
        };
        out.extend(be.forward(&[chunk]).unwrap());
    }
    out
}

#[test]
fn an_fp8_checkpoint_computes_its_dequantized_twins_logits_bit_for_bit() {
    let (fp8, twin, source) = (logits("qwen3-fp8"), logits("qwen3-fp8-twin"), logits("qwen3"));
    assert_eq!(fp8.len(), twin.len());
    for (i, (a, b)) in fp8.iter().zip(&twin).enumerate() {
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "prompt {i}: the FP8 checkpoint's logits differ from its dequantized twin's");
    }
    // The quantization itself moves the logits a little (blocks of 48 × 40, one scale each).
    let vocab = 448;
    let (mut worst, mut agree, mut rows) = (0f32, 0usize, 0usize);
    for (a, b) in fp8.iter().zip(&source) {
        let top = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        worst = worst.max(a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / top);
        for (ra, rb) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)) {
            let arg =
                |r: &[f32]| r.iter().enumerate().fold(0, |best, (i, &x)| if x > r[best] { i } else { best });
            agree += usize::from(arg(ra) == arg(rb));
            rows += 1;
        }
    }
    eprintln!("FP8 against the unquantized model: logits within {worst:.4} of the largest, argmax agrees on {agree} of {rows} positions");
    // Measured: within 0.13 of the largest logit, the argmax the same at 170 of 197 positions (a
    // random model's logits are close together, so FP8's rounding flips many of its argmaxes).
    // The bounds only catch a wrong scale, which moves logits by multiples of themselves.
    assert!(worst < 0.3, "FP8 logits moved by {worst} of the largest logit");
    assert!(agree * 10 >= rows * 7, "the argmax agrees on only {agree} of {rows} positions");
}

#[test]
fn a_checkpoint_of_another_quantization_method_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("tandem-quant-refusal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture("qwen3-fp8")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    for method in ["awq", "gptq"] {
        std::fs::write(dir.join("config.json"), config.replace("\"fp8\"", &format!("\"{method}\""))).unwrap();
        let err = load_model(&dir).err().expect("refused").to_string();
        assert!(err.contains(&format!("quantization method \"{method}\"")), "{err}");
    }
    // Block scales without a block size say so.
    let v: serde_json::Value = serde_json::from_str(&config).unwrap();
    let mut v = v;
    v["quantization_config"].as_object_mut().unwrap().remove("weight_block_size");
    std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
    let err = load_model(&dir).err().expect("refused").to_string();
    assert!(err.contains("no block size"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
