//! Dequantization is bit-exact with gguf-py (what Hugging Face transformers uses for GGUF files).
//! Fixtures come from `tests/reference/make_quant_fixtures.py`.

use std::path::{Path, PathBuf};

use tandem_engine::gguf::{GgufFile, GgufTensors};
use tandem_engine::quant::{dequantize, GgmlType};
use tandem_engine::weights::{Bytes, Matrix};
use tandem_test_support::default_model_for_test;

const ROWS: usize = 3;
const COLS: usize = 512;

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant")
}

fn read_f32(p: &Path) -> Vec<f32> {
    std::fs::read(p).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i}: got {g:e}, gguf-py {w:e}");
    }
}

const TYPES: [GgmlType; GgmlType::ALL.len()] = GgmlType::ALL;

#[test]
fn dequantize_matches_gguf_py_bit_for_bit() {
    for t in TYPES {
        let bytes = std::fs::read(data_dir().join(format!("{}.bin", t.name()))).unwrap();
        let want = read_f32(&data_dir().join(format!("{}.f32", t.name())));
        assert_eq!(bytes.len(), ROWS * t.row_bytes(COLS), "{t}: fixture size");
        let mut got = vec![f32::NAN; ROWS * COLS];
        dequantize(t, &bytes, &mut got).unwrap();
        assert_bits_eq(&got, &want, t.name());

        // Row access gives the same values.
        let m = Matrix { rows: ROWS, cols: COLS, dtype: t, data: Bytes::copy_from(&bytes) };
        for r in 0..ROWS {
            let mut row = vec![0f32; COLS];
            m.dequantize_row(r, &mut row);
            assert_bits_eq(&row, &want[r * COLS..(r + 1) * COLS], &format!("{t} row {r}"));
        }
    }
}

#[test]
fn dequantize_rejects_wrong_sizes() {
    for t in TYPES {
        let bytes = vec![0u8; t.row_bytes(COLS)];
        let mut out = vec![0f32; COLS];
        assert!(dequantize(t, &bytes, &mut out).is_ok());
        assert!(dequantize(t, &bytes[..bytes.len() - 1], &mut out).is_err(), "{t}: short input");
        if t.block_len() > 1 {
            assert!(dequantize(t, &bytes, &mut out[..COLS - 1]).is_err(), "{t}: partial block");
        }
    }
}

#[test]
fn real_model_rows_match_gguf_py() {
    let Some(model) = default_model_for_test("real_model_rows_match_gguf_py") else { return };
    let listing: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data_dir().join("model_rows.json")).unwrap()).unwrap();
    let want = read_f32(&data_dir().join("model_rows.f32"));
    let f = GgufFile::open(&model).unwrap();
    let mut at = 0;
    for entry in listing["rows"].as_array().unwrap() {
        let name = entry["tensor"].as_str().unwrap();
        let r = entry["row"].as_u64().unwrap() as usize;
        let len = entry["len"].as_u64().unwrap() as usize;
        let m = f.matrix(name).unwrap();
        let mut row = vec![0f32; m.cols];
        m.dequantize_row(r, &mut row);
        assert_bits_eq(&row, &want[at..at + len], &format!("{name} row {r}"));
        at += len;
    }
    assert_eq!(at, want.len());
}
