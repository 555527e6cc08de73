//! Tensor access over a GGUF file: the engine's half of reading GGUF. `tandem_model::gguf` parses
//! the container (metadata, tensor table, bounds) and is re-exported here; [`GgufTensors`] turns
//! its tensors into the engine's weights ([`Matrix`], dequantized vectors), borrowing the memory
//! map without copying.

pub use tandem_model::gguf::*;

use crate::error::Result;
use crate::quant;
use crate::weights::{Bytes, Matrix};

/// The engine's view of a GGUF file's tensors.
pub trait GgufTensors {
    /// The tensor's bytes, borrowed from the memory map (zero-copy).
    fn tensor_bytes(&self, info: &GgufTensorInfo) -> Bytes;
    /// A 2-D tensor as a matrix: `rows = dims[1]`, `cols = dims[0]` (trailing dims of 1 allowed).
    fn matrix(&self, name: &str) -> Result<Matrix>;
    /// A 1-D tensor (trailing dims of 1 allowed) of any supported type, dequantized to `f32`.
    fn vector_f32(&self, name: &str) -> Result<Vec<f32>>;
    /// A 3-D tensor of `dims[2]` matrices of `dims[1] × dims[0]` (llama.cpp's stacked experts,
    /// `blk.N.ffn_*_exps.weight`) as one matrix each. Each matrix's rows are contiguous and rows
    /// are independent in every GGML type, so the matrices are byte ranges of the map (no copy).
    fn stacked(&self, name: &str) -> Result<Vec<Matrix>>;
}

impl GgufTensors for GgufFile {
    fn tensor_bytes(&self, info: &GgufTensorInfo) -> Bytes {
        Bytes::Mapped { map: self.map().clone(), range: self.tensor_range(info) }
    }

    fn matrix(&self, name: &str) -> Result<Matrix> {
        let info = self.require(name)?;
        let d = &info.dims;
        if d.len() < 2 || d[2..].iter().any(|&x| x != 1) {
            return Err(self.shape_error(info, 2).into());
        }
        Ok(Matrix { rows: d[1], cols: d[0], dtype: info.dtype, data: self.tensor_bytes(info) })
    }

    fn stacked(&self, name: &str) -> Result<Vec<Matrix>> {
        let info = self.require(name)?;
        let d = &info.dims;
        if d.len() < 3 || d[3..].iter().any(|&x| x != 1) {
            return Err(self.shape_error(info, 3).into());
        }
        // The file's tensor table was checked against the file size when it was opened.
        let all = Matrix { rows: d[1] * d[2], cols: d[0], dtype: info.dtype, data: self.tensor_bytes(info) };
        Ok(all.split_stacked(d[2], d[1]))
    }

    fn vector_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.require(name)?;
        if info.dims.is_empty() || info.dims[1..].iter().any(|&x| x != 1) {
            return Err(self.shape_error(info, 1).into());
        }
        let mut out = vec![0f32; info.dims[0]];
        quant::dequantize(info.dtype, &self.tensor_bytes(info), &mut out)?;
        Ok(out)
    }
}

/// A minimal GGUF writer for tests: metadata (raw typed values) and tensors (raw bytes).
#[cfg(test)]
pub(crate) mod test_file {
    use std::path::PathBuf;

    pub(crate) struct Writer {
        pub(crate) version: u32,
        pub(crate) alignment: usize,
        kv: Vec<(String, u32, Vec<u8>)>,
        tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    pub(crate) fn str_bytes(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    pub(crate) fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Writes `bytes` to a file of this test process's temporary directory.
    pub(crate) fn write_tmp(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-gguf-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    impl Writer {
        pub(crate) fn new() -> Self {
            Writer { version: 3, alignment: 32, kv: vec![], tensors: vec![] }
        }
        /// A metadata entry of GGUF type `ty` (4: u32, 5: i32, 6: f32, 7: bool, 8: string, 9: array).
        pub(crate) fn kv(mut self, key: &str, ty: u32, value: Vec<u8>) -> Self {
            self.kv.push((key.into(), ty, value));
            self
        }
        pub(crate) fn u32(self, key: &str, v: u32) -> Self {
            self.kv(key, 4, v.to_le_bytes().to_vec())
        }
        pub(crate) fn f32(self, key: &str, v: f32) -> Self {
            self.kv(key, 6, v.to_le_bytes().to_vec())
        }
        pub(crate) fn string(self, key: &str, v: &str) -> Self {
            self.kv(key, 8, str_bytes(v))
        }
        /// A tensor of GGML type `ty` with dims innermost first.
        pub(crate) fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
            self.tensors.push((name.into(), dims.to_vec(), ty, data));
            self
        }
        pub(crate) fn bytes(&self) -> Vec<u8> {
            let mut out = b"GGUF".to_vec();
            out.extend(self.version.to_le_bytes());
            out.extend((self.tensors.len() as u64).to_le_bytes());
            out.extend((self.kv.len() as u64).to_le_bytes());
            for (k, ty, v) in &self.kv {
                out.extend(str_bytes(k));
                out.extend(ty.to_le_bytes());
                out.extend(v);
            }
            let mut offset = 0usize;
            let mut offsets = vec![];
            for (name, dims, ty, data) in &self.tensors {
                out.extend(str_bytes(name));
                out.extend((dims.len() as u32).to_le_bytes());
                for d in dims {
                    out.extend(d.to_le_bytes());
                }
                out.extend(ty.to_le_bytes());
                out.extend((offset as u64).to_le_bytes());
                offsets.push(offset);
                offset = (offset + data.len()).div_ceil(self.alignment) * self.alignment;
            }
            out.resize(out.len().div_ceil(self.alignment) * self.alignment, 0);
            let start = out.len();
            for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
                out.resize(start + off, 0);
                out.extend(data);
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_file::{f32_bytes, str_bytes, write_tmp, Writer};
    use super::*;
    use crate::error::EngineError;

    fn sample() -> Writer {
        let mut arr = 8u32.to_le_bytes().to_vec(); // array of strings
        arr.extend(2u64.to_le_bytes());
        arr.extend(str_bytes("a"));
        arr.extend(str_bytes("bc"));
        let w: Vec<f32> = (0..64 * 3).map(|i| i as f32 * 0.25 - 7.0).collect();
        Writer::new()
            .kv("general.architecture", 8, str_bytes("llama"))
            .kv("llama.block_count", 4, 30u32.to_le_bytes().to_vec())
            .kv("llama.rope.freq_base", 6, 10000f32.to_le_bytes().to_vec())
            .kv("tokenizer.ggml.add_bos_token", 7, vec![1])
            .kv("tokenizer.ggml.tokens", 9, arr)
            .kv("neg", 5, (-3i32).to_le_bytes().to_vec())
            .tensor("norm", &[5], 0, f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0]))
            .tensor("w", &[64, 3], 0, f32_bytes(&w))
            .tensor("q", &[32, 2], 8, {
                // two Q8_0 rows: d = 1.0 (0x3c00), quants 0..32 and -32..0
                let mut b = vec![];
                for r in 0..2i32 {
                    b.extend([0x00, 0x3c]);
                    b.extend((0..32).map(|i| (i - 32 * r) as i8 as u8));
                }
                b
            })
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let p = write_tmp("ok.gguf", &sample().bytes());
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.get("general.architecture").unwrap().as_str(), Some("llama"));
        assert_eq!(f.get("llama.block_count").unwrap().as_u64(), Some(30));
        assert_eq!(f.get("llama.block_count").unwrap().as_i64(), Some(30));
        assert_eq!(f.get("llama.rope.freq_base").unwrap().as_f64(), Some(10000.0));
        assert_eq!(f.get("tokenizer.ggml.add_bos_token").unwrap().as_bool(), Some(true));
        assert_eq!(f.get("neg").unwrap().as_u64(), None);
        assert_eq!(f.get("neg").unwrap().as_i64(), Some(-3));
        let toks = f.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap();
        assert_eq!(toks.iter().map(|v| v.as_str().unwrap()).collect::<Vec<_>>(), ["a", "bc"]);

        assert_eq!(f.vector_f32("norm").unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0]);
        let w = f.matrix("w").unwrap();
        assert_eq!((w.rows, w.cols, w.dtype), (3, 64, GgmlType::F32));
        assert_eq!(w.data.as_f32().unwrap()[65], 1.0 * 0.25 * 65.0 - 7.0);
        for t in &f.tensors {
            assert_eq!(t.offset % 32, 0, "tensor data must honour the alignment");
        }
        let q = f.matrix("q").unwrap();
        let mut row = vec![0f32; 32];
        q.dequantize_row(1, &mut row);
        assert_eq!(row[0], -32.0);
        assert_eq!(row[31], -1.0);
        assert!(matches!(f.matrix("absent"), Err(EngineError::MissingTensor { .. })));
        assert!(f.matrix("norm").is_err(), "a 1-D tensor is not a matrix");
        assert!(f.vector_f32("w").is_err(), "a 2-D tensor is not a vector");
    }

    /// A tensor of every supported type loads from a GGUF file, as a matrix and as a vector, with
    /// gguf-py's values bit for bit (the fixtures of `tests/quant_dequant.rs`, 3 rows of 512); a
    /// row that is not a whole number of blocks is refused when the file is opened.
    #[test]
    fn loads_every_type() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant");
        let (rows, cols) = (3usize, 512usize);
        for t in GgmlType::ALL {
            let bytes = std::fs::read(dir.join(format!("{t}.bin"))).unwrap();
            let want: Vec<u32> = std::fs::read(dir.join(format!("{t}.f32")))
                .unwrap()
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!((bytes.len(), want.len()), (rows * t.row_bytes(cols), rows * cols), "{t}");
            let (id, first_row) = (t as u32, bytes[..t.row_bytes(cols)].to_vec());
            let w = sample().tensor("m", &[cols as u64, rows as u64], id, bytes);
            let w = w.tensor("v", &[cols as u64, 1], id, first_row);
            let f = GgufFile::open(&write_tmp(&format!("type-{t}.gguf"), &w.bytes())).unwrap();
            let m = f.matrix("m").unwrap();
            assert_eq!((m.rows, m.cols, m.dtype), (rows, cols, t));
            let mut row = vec![f32::NAN; cols];
            for r in 0..rows {
                m.dequantize_row(r, &mut row);
                let got: Vec<u32> = row.iter().map(|v| v.to_bits()).collect();
                assert!(got == want[r * cols..(r + 1) * cols], "{t} row {r}");
            }
            let v: Vec<u32> = f.vector_f32("v").unwrap().iter().map(|v| v.to_bits()).collect();
            assert!(v == want[..cols], "{t} vector");

            if t.block_len() > 1 {
                let ragged = (t.block_len() * 3 / 2) as u64;
                let w = sample().tensor("ragged", &[ragged], id, vec![0; 2 * t.block_bytes()]);
                let e = GgufFile::open(&write_tmp(&format!("ragged-{t}.gguf"), &w.bytes())).unwrap_err();
                assert!(
                    e.to_string().contains("ragged") && e.to_string().contains("block length"),
                    "{t}: {e}"
                );
            }
        }
    }

    /// llama.cpp's stacked experts: a 3-D tensor `[cols, rows, experts]` is one matrix per
    /// expert, each a byte range of the map, whatever the type (a row is whole blocks).
    #[test]
    fn slices_stacked_experts() {
        let (cols, rows, experts) = (32usize, 3usize, 4usize);
        let dims = [cols as u64, rows as u64, experts as u64];
        let vals: Vec<f32> = (0..experts * rows * cols)
            .map(|i| ((i / (rows * cols)) * 1000 + (i / cols % rows) * 100 + i % cols) as f32)
            .collect();
        // Q8_0, one block per row: scale 1.0 (f16 0x3c00), every quant `10 · expert + row`.
        let mut q = vec![];
        for e in 0..experts {
            for r in 0..rows {
                q.extend([0x00, 0x3c]);
                q.extend(std::iter::repeat_n((10 * e + r) as u8, 32));
            }
        }
        let w = sample().tensor("blk.0.ffn_up_exps.weight", &dims, 0, f32_bytes(&vals)).tensor(
            "blk.0.ffn_gate_exps.weight",
            &dims,
            8,
            q,
        );
        let f = GgufFile::open(&write_tmp("experts.gguf", &w.bytes())).unwrap();
        let mut row = vec![0f32; cols];
        let up = GgufTensors::stacked(&f, "blk.0.ffn_up_exps.weight").unwrap();
        assert_eq!(up.len(), experts);
        for (e, m) in up.iter().enumerate() {
            assert_eq!((m.rows, m.cols, m.dtype), (rows, cols, GgmlType::F32));
            assert!(matches!(m.data, Bytes::Mapped { .. }), "expert {e} was copied");
            for r in 0..rows {
                m.dequantize_row(r, &mut row);
                assert_eq!(
                    (row[0], row[31]),
                    ((e * 1000 + r * 100) as f32, (e * 1000 + r * 100 + 31) as f32)
                );
            }
        }
        let gate = GgufTensors::stacked(&f, "blk.0.ffn_gate_exps.weight").unwrap();
        for (e, m) in gate.iter().enumerate() {
            assert_eq!((m.rows, m.cols, m.dtype), (rows, cols, GgmlType::Q8_0));
            for r in 0..rows {
                m.dequantize_row(r, &mut row);
                assert!(row.iter().all(|&v| v == (10 * e + r) as f32), "expert {e} row {r}: {row:?}");
            }
        }
        assert!(GgufTensors::stacked(&f, "w").is_err(), "a 2-D tensor is not stacked matrices");
        assert!(GgufTensors::matrix(&f, "blk.0.ffn_up_exps.weight").is_err(), "a 3-D tensor is not a matrix");
    }

    #[test]
    fn honours_custom_alignment() {
        let mut w = sample().kv("general.alignment", 4, 64u32.to_le_bytes().to_vec());
        w.alignment = 64;
        let p = write_tmp("align64.gguf", &w.bytes());
        let f = GgufFile::open(&p).unwrap();
        for t in &f.tensors {
            assert_eq!(t.offset % 64, 0);
        }
        assert_eq!(f.vector_f32("norm").unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample().bytes();
        for len in 0..bytes.len() {
            let p = write_tmp("trunc.gguf", &bytes[..len]);
            assert!(GgufFile::open(&p).is_err(), "truncated to {len} bytes must fail");
        }
    }

    #[test]
    fn corrupt_bytes_never_panic() {
        // Flip every byte of the header region to a few hostile values; any outcome but a panic
        // (or an absurd allocation) is acceptable.
        let bytes = sample().bytes();
        let header_len = bytes.len().min(600);
        for i in 0..header_len {
            for v in [0x00, 0xff, 0x7f, 0x09] {
                let mut b = bytes.clone();
                b[i] = v;
                let p = write_tmp("corrupt.gguf", &b);
                let _ = GgufFile::open(&p);
            }
        }
    }

    #[test]
    fn specific_errors() {
        let mut bad_magic = sample().bytes();
        bad_magic[0] = b'X';
        let e = GgufFile::open(&write_tmp("m.gguf", &bad_magic)).unwrap_err();
        assert_eq!(e.kind(), "format");

        let mut w = sample();
        w.version = 1;
        let e = GgufFile::open(&write_tmp("v1.gguf", &w.bytes())).unwrap_err();
        assert_eq!(e.kind(), "unsupported");

        // Q8_1 (type 9) is a real GGML type Tandem does not load.
        let w = sample().tensor("odd", &[32], 9, vec![0; 36]);
        let e = GgufFile::open(&write_tmp("t9.gguf", &w.bytes())).unwrap_err();
        assert_eq!(e.kind(), "unsupported");
        assert!(e.to_string().contains("odd") && e.to_string().contains('9'), "{e}");

        let w = sample().tensor("ragged", &[33, 1], 8, vec![0; 34]);
        let e = GgufFile::open(&write_tmp("rag.gguf", &w.bytes())).unwrap_err();
        assert!(e.to_string().contains("ragged"), "{e}");

        let w = sample().kv("weird", 13, vec![0; 8]);
        let e = GgufFile::open(&write_tmp("vt.gguf", &w.bytes())).unwrap_err();
        assert!(e.to_string().contains("weird"), "{e}");

        // Tensor data past the end of the file.
        let mut bytes = sample().tensor("big", &[1024, 1024], 0, vec![0; 64]).bytes();
        bytes.truncate(bytes.len() - 8);
        let e = GgufFile::open(&write_tmp("oob.gguf", &bytes)).unwrap_err();
        assert_eq!(e.kind(), "format");
        assert!(e.to_string().contains("big") && e.to_string().contains("oob.gguf"), "{e}");

        // A huge array count must be refused before allocating.
        let mut arr = 0u32.to_le_bytes().to_vec();
        arr.extend(u64::MAX.to_le_bytes());
        let w = sample().kv("huge", 9, arr);
        assert!(GgufFile::open(&write_tmp("huge.gguf", &w.bytes())).is_err());
    }

    #[test]
    fn real_model_when_present() {
        let Some(p) = tandem_test_support::default_model_for_test("gguf::tests::real_model_when_present")
        else {
            return;
        };
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.get("general.architecture").and_then(|v| v.as_str()), Some("llama"));
        assert_eq!(f.get("llama.block_count").and_then(|v| v.as_u64()), Some(30));
        let emb = f.matrix("token_embd.weight").unwrap();
        assert_eq!((emb.rows, emb.cols, emb.dtype), (49152, 576, GgmlType::Q8_0));
        let q = f.matrix("blk.0.attn_q.weight").unwrap();
        assert_eq!((q.rows, q.cols, q.dtype), (576, 576, GgmlType::Q4_1));
        let norm = f.vector_f32("output_norm.weight").unwrap();
        assert_eq!(norm.len(), 576);
        assert!(norm.iter().all(|x| x.is_finite()));
        let toks = f.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).unwrap();
        assert_eq!(toks.len(), 49152);
    }
}
