//! Safetensors reader over memory maps, single file or sharded (`model.safetensors.index.json`).
//!
//! F32 tensors are used in place when the map is suitably aligned; F16 and BF16 are widened to
//! F32 once at load, because the CPU kernels compute in f32 and the widening is exact.
//!
//! FP8 checkpoints (`F8_E4M3` weights with their scales, [`Fp8Blocks`]) are dequantized to F32 at
//! load: each code's exact value times its scale, one f32 product, so a checkpoint and its
//! dequantized twin load to the same values bit for bit.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::quant::GgmlType;
use crate::weights::{Bytes, Matrix};

/// Element types found in safetensors files that the engine loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StDtype {
    F32,
    F16,
    BF16,
    /// fp8 E4M3 (`float8_e4m3fn`), scaled by a companion tensor.
    F8E4M3,
}

/// The block of an FP8 checkpoint's `weight_scale_inv` scales (`weight_block_size` of its
/// `quantization_config`): one scale per block of `rows × cols` weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Blocks {
    pub rows: usize,
    pub cols: usize,
}

#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    /// Absolute byte range in the file's map.
    start: usize,
    end: usize,
}

/// All tensors of a model, possibly spread over several files.
pub struct SafeTensors {
    files: Vec<(PathBuf, Arc<Mmap>)>,
    entries: HashMap<String, Entry>,
    /// The block of `weight_scale_inv` scales, from the checkpoint's configuration.
    fp8_blocks: Option<Fp8Blocks>,
}

impl SafeTensors {
    /// Opens `dir/model.safetensors`, or every shard named by `dir/model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<SafeTensors> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let shard_names: Vec<String> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| EngineError::io(&index, e))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| EngineError::format(&index, format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| EngineError::format(&index, "missing `weight_map`"))?;
            let mut names: Vec<String> = map.values().filter_map(Value::as_str).map(String::from).collect();
            names.sort();
            names.dedup();
            for n in &names {
                if n.contains('/') || n.contains("..") {
                    return Err(EngineError::format(
                        &index,
                        format!("shard name {n:?} must be a plain file name"),
                    ));
                }
            }
            names
        } else if single.exists() {
            vec!["model.safetensors".to_string()]
        } else {
            return Err(EngineError::format(
                dir,
                "no model.safetensors or model.safetensors.index.json in this directory",
            ));
        };
        let mut st = SafeTensors { files: Vec::new(), entries: HashMap::new(), fp8_blocks: None };
        for name in shard_names {
            st.add_file(&dir.join(name))?;
        }
        Ok(st)
    }

    /// Maps one safetensors file on its own (an adapter's, say) and indexes its tensors.
    pub fn open_file(path: &Path) -> Result<SafeTensors> {
        let mut st = SafeTensors { files: Vec::new(), entries: HashMap::new(), fp8_blocks: None };
        st.add_file(path)?;
        Ok(st)
    }

    /// Maps one file and indexes its tensors.
    pub fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
        // SAFETY: the model file is opened read-only and treated as immutable for the life of the
        // process; like every mmap-based loader we rely on nobody truncating it underneath us.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))?;
        let fmt = |msg: String| EngineError::format(path, msg);
        if map.len() < 8 {
            return Err(fmt("file too short for a safetensors header".into()));
        }
        let header_len = u64::from_le_bytes(map[..8].try_into().unwrap()) as usize;
        let data_start = 8usize
            .checked_add(header_len)
            .filter(|&e| e <= map.len())
            .ok_or_else(|| fmt(format!("header length {header_len} exceeds the file size {}", map.len())))?;
        let header: BTreeMap<String, Value> = serde_json::from_slice(&map[8..data_start])
            .map_err(|e| fmt(format!("invalid header JSON: {e}")))?;
        let file_idx = self.files.len();
        for (name, info) in header {
            if name == "__metadata__" {
                continue;
            }
            let tfmt = |msg: String| fmt(format!("tensor `{name}`: {msg}"));
            let dtype = match info.get("dtype").and_then(Value::as_str) {
                Some("F32") => StDtype::F32,
                Some("F16") => StDtype::F16,
                Some("BF16") => StDtype::BF16,
                Some("F8_E4M3") => StDtype::F8E4M3,
                Some(other) => {
                    return Err(EngineError::Unsupported {
                        path: path.into(),
                        msg: format!(
                            "tensor `{name}` has dtype {other} (supported: F32, F16, BF16, F8_E4M3)"
                        ),
                    })
                }
                None => return Err(tfmt("missing dtype".into())),
            };
            let shape: Vec<usize> = info
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(|| tfmt("missing shape".into()))?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect::<Option<_>>()
                .ok_or_else(|| tfmt("invalid shape".into()))?;
            let offs = info
                .get("data_offsets")
                .and_then(Value::as_array)
                .filter(|a| a.len() == 2)
                .and_then(|a| Some((a[0].as_u64()? as usize, a[1].as_u64()? as usize)))
                .ok_or_else(|| tfmt("invalid data_offsets".into()))?;
            let elem = match dtype {
                StDtype::F32 => 4,
                StDtype::F16 | StDtype::BF16 => 2,
                StDtype::F8E4M3 => 1,
            };
            let n: usize = shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| tfmt("shape overflows".into()))?;
            let (start, end) = (data_start.saturating_add(offs.0), data_start.saturating_add(offs.1));
            if offs.0 > offs.1 || end > map.len() || Some(end - start) != n.checked_mul(elem) {
                return Err(tfmt(format!(
                    "data range {}..{} does not hold {n} elements of {dtype:?} within the file ({} bytes)",
                    offs.0,
                    offs.1,
                    map.len()
                )));
            }
            self.entries.insert(name, Entry { file: file_idx, dtype, shape, start, end });
        }
        self.files.push((path.to_path_buf(), Arc::new(map)));
        Ok(())
    }

    /// Sets the block of the FP8 weights' `weight_scale_inv` scales (the checkpoint's
    /// `weight_block_size`).
    pub fn set_fp8_blocks(&mut self, blocks: Option<Fp8Blocks>) {
        self.fp8_blocks = blocks;
    }

    /// Whether any tensor is stored in FP8.
    pub fn has_fp8(&self) -> bool {
        self.entries.values().any(|e| e.dtype == StDtype::F8E4M3)
    }

    /// Path of the first file (for error messages that are not about a particular tensor).
    pub fn path(&self) -> &Path {
        self.files.first().map(|(p, _)| p.as_path()).unwrap_or(Path::new("<no files>"))
    }

    /// Every mapped file and its bytes (for fingerprinting without opening the files again).
    pub fn mapped_files(&self) -> impl Iterator<Item = (&Path, &[u8])> {
        self.files.iter().map(|(p, m)| (p.as_path(), &m[..]))
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Every tensor's name, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// A tensor of any shape as f32 values (F16 and BF16 widened), with its shape.
    pub fn values(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let shape = self.entry(name)?.shape.clone();
        Ok((shape, self.f32_bytes(name)?.as_f32().expect("f32 bytes are aligned").to_vec()))
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).ok_or_else(|| EngineError::MissingTensor {
            path: self.path().to_path_buf(),
            tensor: name.to_string(),
        })
    }

    /// Shape of a tensor.
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.entry(name)?.shape)
    }

    /// A tensor's elements as f32 bytes: mapped in place for aligned F32, widened copy otherwise.
    fn f32_bytes(&self, name: &str) -> Result<Bytes> {
        let e = self.entry(name)?;
        let (_, map) = &self.files[e.file];
        let raw = &map[e.start..e.end];
        Ok(match e.dtype {
            StDtype::F32 => {
                let mapped = Bytes::Mapped { map: map.clone(), range: e.start..e.end };
                if mapped.as_f32().is_some() {
                    mapped
                } else {
                    Bytes::copy_from(raw)
                }
            }
            StDtype::F16 => {
                let v: Vec<f32> =
                    raw.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
                Bytes::from_f32(&v)
            }
            StDtype::BF16 => {
                let v: Vec<f32> =
                    raw.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
                Bytes::from_f32(&v)
            }
            StDtype::F8E4M3 => Bytes::from_f32(&self.fp8_dequantized(name, e, raw)?),
        })
    }

    /// An FP8 tensor's values times their scales, from its companion tensor `{name}_scale_inv`
    /// (the form Qwen3-*-FP8 and DeepSeek checkpoints use) or `{name}_scale` (compressed-tensors'):
    /// one scale for the tensor, one per row (`[rows]` or `[rows, 1]`), or one per block of
    /// [`Fp8Blocks`] (`[row blocks, column blocks]`). A `[experts, rows, cols]` tensor of stacked
    /// experts takes the same per expert (a leading `experts` dimension on the scales), or one
    /// scale per expert. Each value is the code's exact value times its scale, in f32.
    fn fp8_dequantized(&self, name: &str, e: &Entry, raw: &[u8]) -> Result<Vec<f32>> {
        let path = &self.files[e.file].0;
        let bad = |msg: String| EngineError::format(path, format!("FP8 tensor `{name}`: {msg}"));
        let (batch, rows, cols) = match e.shape.as_slice() {
            _ if e.shape.contains(&0) => return Err(bad(format!("shape {:?} holds no weights", e.shape))),
            [n] => (1, *n, 1),
            [r, c] => (1, *r, *c),
            [b, r, c] => (*b, *r, *c),
            other => return Err(bad(format!("shape {other:?}: FP8 weights must have 1 to 3 dimensions"))),
        };
        let inv = format!("{name}_scale_inv");
        let per = format!("{name}_scale");
        let scale_name = if self.contains(&inv) {
            inv
        } else if self.contains(&per) {
            per
        } else {
            return Err(bad(format!("no `{inv}` or `{per}` scales beside it")));
        };
        let (shape, scales) = self.values(&scale_name)?;
        // The scales' shape past a leading experts dimension (a stacked tensor's, when present).
        let inner: &[usize] = if batch > 1 && shape.first() == Some(&batch) { &shape[1..] } else { &shape };
        let stacked = inner.len() < shape.len();
        let blocks = self.fp8_blocks.filter(|b| b.rows > 0 && b.cols > 0);
        let grid = blocks.map(|b| (rows.div_ceil(b.rows), cols.div_ceil(b.cols)));
        // Which scale multiplies weight (slice, row, column).
        let index: Box<dyn Fn(usize, usize, usize) -> usize> = if scales.len() == 1 {
            Box::new(|_, _, _| 0)
        } else if batch > 1 && scales.len() == batch && inner.iter().all(|&d| d == 1) {
            Box::new(|s, _, _| s)
        } else if let (Some(b), Some((br, bc)), true) =
            (blocks, grid, inner.len() == 2 && (stacked || batch == 1) && inner != [rows, 1])
        {
            if inner != [br, bc] {
                return Err(bad(format!(
                    "`{scale_name}` has shape {shape:?}; {rows}×{cols} weights in blocks of {}×{} need [{br}, {bc}]",
                    b.rows, b.cols
                )));
            }
            Box::new(move |s, i, j| (s * br + i / b.rows) * bc + j / b.cols)
        } else if (stacked || batch == 1) && (inner == [rows] || inner == [rows, 1]) {
            Box::new(move |s, i, _| s * rows + i)
        } else if blocks.is_none() && inner.len() == 2 {
            return Err(bad(format!(
                "`{scale_name}` holds block scales (shape {shape:?}), but the configuration gives no block size"
            )));
        } else {
            return Err(bad(format!(
                "`{scale_name}` has shape {shape:?}: expected one scale, one per row ({rows}) or one per block"
            )));
        };
        let mut v: Vec<f32> = raw.iter().map(|&b| crate::kv::dtype::fp8_to_f32(b)).collect();
        for (k, x) in v.iter_mut().enumerate() {
            let (s, i, j) = (k / (rows * cols), k / cols % rows, k % cols);
            *x *= scales[index(s, i, j)];
        }
        Ok(v)
    }

    fn check_shape(&self, name: &str, expected: &[usize]) -> Result<()> {
        let e = self.entry(name)?;
        if e.shape != expected {
            return Err(EngineError::Shape {
                path: self.files[e.file].0.clone(),
                tensor: name.to_string(),
                expected: expected.to_vec(),
                actual: e.shape.clone(),
            });
        }
        Ok(())
    }

    /// A `[rows, cols]` tensor as an f32 [`Matrix`], checking the shape.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        self.check_shape(name, &[rows, cols])?;
        Ok(Matrix { rows, cols, dtype: GgmlType::F32, data: self.f32_bytes(name)? })
    }

    /// A `[count, rows, cols]` tensor (experts stacked along the first dimension, as transformers
    /// keeps them in memory) as `count` f32 matrices, checking the shape.
    pub fn stacked(&self, name: &str, count: usize, rows: usize, cols: usize) -> Result<Vec<Matrix>> {
        self.check_shape(name, &[count, rows, cols])?;
        let all = Matrix { rows: count * rows, cols, dtype: GgmlType::F32, data: self.f32_bytes(name)? };
        Ok(all.split_stacked(count, rows))
    }

    /// A `[len]` tensor as f32 values, checking the shape.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.check_shape(name, &[len])?;
        Ok(self.f32_bytes(name)?.as_f32().expect("f32 bytes are aligned").to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_file(path: &Path, header: &str, data: &[u8]) {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn reads_f32_and_widens_bf16() {
        let dir = std::env::temp_dir().join(format!("tandem-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut data = Vec::new();
        for x in [1.0f32, -2.0, 0.5, 3.0] {
            data.extend_from_slice(&x.to_le_bytes());
        }
        for x in [1.5f32, -0.25] {
            data.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
        }
        let header = r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[16,20]}}"#;
        write_file(&dir.join("model.safetensors"), header, &data);
        let st = SafeTensors::open_dir(&dir).unwrap();
        let m = st.matrix("a", 2, 2).unwrap();
        assert_eq!(m.data.as_f32().unwrap(), &[1.0, -2.0, 0.5, 3.0]);
        assert_eq!(st.vector("b", 2).unwrap(), vec![1.5, -0.25]);
        let e = st.matrix("a", 4, 1).unwrap_err();
        assert!(matches!(e, EngineError::Shape { .. }), "{e}");
        let e = st.vector("missing", 1).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A 2 × 4 FP8 matrix `w` (codes of 1, 2, -0.5, 448 and 0.25, 3, -1, 0) with the scale tensors
    /// of `scales` (name, shape, f32 values), loaded with `blocks`.
    fn fp8_file(
        tag: &str,
        scales: &[(&str, &[usize], &[f32])],
        blocks: Option<Fp8Blocks>,
    ) -> Result<Vec<f32>> {
        let dir = std::env::temp_dir().join(format!("tandem-st-fp8-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let codes: Vec<u8> = [1.0f32, 2.0, -0.5, 448.0, 0.25, 3.0, -1.0, 0.0]
            .iter()
            .map(|&x| crate::kv::dtype::fp8_bits(x))
            .collect();
        let mut data = codes.clone();
        let mut header = vec![format!(r#""w":{{"dtype":"F8_E4M3","shape":[2,4],"data_offsets":[0,8]}}"#)];
        for (name, shape, vals) in scales {
            let start = data.len();
            vals.iter().for_each(|v| data.extend_from_slice(&v.to_le_bytes()));
            header.push(format!(
                r#""{name}":{{"dtype":"F32","shape":{shape:?},"data_offsets":[{start},{}]}}"#,
                data.len()
            ));
        }
        write_file(&dir.join("model.safetensors"), &format!("{{{}}}", header.join(",")), &data);
        let mut st = SafeTensors::open_dir(&dir)?;
        st.set_fp8_blocks(blocks);
        let out = st.matrix("w", 2, 4).map(|m| m.data.as_f32().unwrap().to_vec());
        std::fs::remove_dir_all(&dir).unwrap();
        out
    }

    #[test]
    fn fp8_weights_take_their_scales_per_tensor_row_or_block() {
        let base = [1.0f32, 2.0, -0.5, 448.0, 0.25, 3.0, -1.0, 0.0];
        let scaled = |f: &dyn Fn(usize, usize) -> f32| -> Vec<f32> {
            base.iter().enumerate().map(|(i, &x)| x * f(i / 4, i % 4)).collect()
        };
        assert_eq!(fp8_file("t", &[("w_scale", &[], &[0.5])], None).unwrap(), scaled(&|_, _| 0.5));
        let rows = [2.0f32, -3.0];
        assert_eq!(fp8_file("r", &[("w_scale", &[2, 1], &rows)], None).unwrap(), scaled(&|r, _| rows[r]));
        // Blocks of 1 × 3: two per row, the second partial.
        let blocks = Some(Fp8Blocks { rows: 1, cols: 3 });
        let s = [1.0f32, 10.0, 100.0, 1000.0];
        let got = fp8_file("b", &[("w_scale_inv", &[2, 2], &s)], blocks).unwrap();
        assert_eq!(got, scaled(&|r, c| s[r * 2 + c / 3]));
        // A block grid of the wrong shape, block scales without a block size, no scales at all.
        let e = fp8_file("bad", &[("w_scale_inv", &[1, 2], &[1.0, 2.0])], blocks).unwrap_err().to_string();
        assert!(e.contains("[2, 2]") && e.contains("`w`"), "{e}");
        let e = fp8_file("nob", &[("w_scale_inv", &[2, 2], &s)], None).unwrap_err().to_string();
        assert!(e.contains("no block size"), "{e}");
        // One per row as a [rows, 1] matrix, even with a block size configured.
        assert_eq!(fp8_file("rb", &[("w_scale", &[2, 1], &rows)], blocks).unwrap(), scaled(&|r, _| rows[r]));
        // [1, cols] is not one per row, even when it holds as many scales.
        let e = fp8_file("cols", &[("w_scale", &[1, 2], &rows)], None).unwrap_err().to_string();
        assert!(e.contains("[1, 2]"), "{e}");
        let e = fp8_file("none", &[], None).unwrap_err().to_string();
        assert!(e.contains("w_scale_inv") && e.contains("w_scale"), "{e}");
    }

    #[test]
    fn corrupt_files_are_errors_naming_the_tensor() {
        let dir = std::env::temp_dir().join(format!("tandem-st-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let header = r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        write_file(&dir.join("model.safetensors"), header, &[0u8; 8]);
        let e = SafeTensors::open_dir(&dir).err().unwrap();
        assert!(e.to_string().contains("`w`"), "{e}");
        let header = r#"{"w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#;
        write_file(&dir.join("model.safetensors"), header, &[0u8; 8]);
        let e = SafeTensors::open_dir(&dir).err().unwrap();
        assert!(e.to_string().contains("I64"), "{e}");
        std::fs::write(dir.join("model.safetensors"), [255u8; 12]).unwrap();
        assert!(SafeTensors::open_dir(&dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
