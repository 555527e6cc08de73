//! GGUF (llama.cpp's model format, versions 2 and 3) read over a memory map.
//!
//! Layout: magic `GGUF`, version, tensor count, metadata count, metadata key/values, tensor infos,
//! padding to `general.alignment` (default 32), then tensor data. All little-endian.
//!
//! Invariants: opening never panics and never allocates more than a small multiple of the file's
//! size, whatever the bytes say (every count is capped by the bytes left to read it from); every
//! tensor in [`GgufFile::tensors`] has a supported type, a row length that is a whole number of
//! blocks, and data that lies inside the file, so [`GgufFile::tensor_bytes`] cannot fail.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{EngineError, Result};
use crate::quant::{self, GgmlType};
use crate::weights::{Bytes, Matrix};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// GGML tensors have at most four dimensions.
const MAX_DIMS: usize = 4;
/// Arrays of arrays appear in practice one level deep; deeper nesting is refused so a corrupt file
/// cannot recurse without bound.
const MAX_ARRAY_DEPTH: usize = 3;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// Any integer that is non-negative (or a bool, or a float holding a non-negative integer).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            GgufValue::Bool(v) => Some(v.into()),
            GgufValue::F32(_) | GgufValue::F64(_) => {
                let f = self.as_f64()?;
                (f >= 0.0 && f.fract() == 0.0 && f < u64::MAX as f64).then_some(f as u64)
            }
            _ => None,
        }
    }

    /// Any integer that fits an `i64` (or a bool, or a float holding an integer).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            GgufValue::Bool(v) => Some(v.into()),
            GgufValue::F32(_) | GgufValue::F64(_) => {
                let f = self.as_f64()?;
                (f.fract() == 0.0 && f >= i64::MIN as f64 && f < i64::MAX as f64).then_some(f as i64)
            }
            _ => None,
        }
    }

    /// Any float, or an integer (converted; integers above 2^53 round).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v as f64),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    /// A bool, or an integer 0 / 1.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            GgufValue::Bool(b) => Some(*b),
            GgufValue::String(_) | GgufValue::Array(_) | GgufValue::F32(_) | GgufValue::F64(_) => None,
            other => match other.as_u64()? {
                0 => Some(false),
                1 => Some(true),
                _ => None,
            },
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where a tensor lives in the file and how it is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the innermost dimension (the row length).
    pub dims: Vec<usize>,
    pub dtype: GgmlType,
    /// Absolute byte offset of the tensor's data in the file.
    pub offset: usize,
}

impl GgufTensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// Size of the tensor's data in bytes.
    pub fn byte_len(&self) -> usize {
        self.numel() / self.dtype.block_len() * self.dtype.block_bytes()
    }
}

/// An opened GGUF file: parsed metadata and tensor infos over a shared memory map.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    map: Arc<Mmap>,
    index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`, validating the header, metadata and every tensor info.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
        // SAFETY: the map is read-only and model files are not modified while being served; a
        // concurrent truncation by another process is outside what any mmap-based loader can guard.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))?;
        let map = Arc::new(map);
        let parsed = parse(&map, path)?;
        let index = parsed.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            map,
            index,
        })
    }

    /// The whole file as mapped (for fingerprinting without opening the file again).
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// A tensor's info by name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's bytes, borrowed from the memory map (zero-copy).
    ///
    /// # Panics
    /// If `info` does not come from this file and lies outside it (infos from `self.tensors`
    /// were bounds-checked at open).
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> Bytes {
        let range = info.offset..info.offset + info.byte_len();
        assert!(range.end <= self.map.len(), "tensor `{}` is not from this file", info.name);
        Bytes::Mapped { map: self.map.clone(), range }
    }

    /// A 2-D tensor as a matrix: `rows = dims[1]`, `cols = dims[0]` (trailing dims of 1 allowed).
    pub fn matrix(&self, name: &str) -> Result<Matrix> {
        let info = self.require(name)?;
        let d = &info.dims;
        if d.len() < 2 || d[2..].iter().any(|&x| x != 1) {
            return Err(self.shape_error(info, 2));
        }
        Ok(Matrix { rows: d[1], cols: d[0], dtype: info.dtype, data: self.tensor_bytes(info) })
    }

    /// A 1-D tensor (trailing dims of 1 allowed) of any supported type, dequantized to `f32`.
    pub fn vector_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.require(name)?;
        if info.dims.is_empty() || info.dims[1..].iter().any(|&x| x != 1) {
            return Err(self.shape_error(info, 1));
        }
        let mut out = vec![0f32; info.dims[0]];
        quant::dequantize(info.dtype, &self.tensor_bytes(info), &mut out)?;
        Ok(out)
    }

    fn require(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensor(name)
            .ok_or_else(|| EngineError::MissingTensor { path: self.path.clone(), tensor: name.to_string() })
    }

    fn shape_error(&self, info: &GgufTensorInfo, rank: usize) -> EngineError {
        EngineError::Format {
            path: self.path.clone(),
            msg: format!("tensor `{}` has dims {:?}, expected a {rank}-D tensor", info.name, info.dims),
        }
    }
}

struct Parsed {
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
}

/// A bounds-checked little-endian cursor; every read failure names what was being read.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, msg: impl std::fmt::Display) -> EngineError {
        EngineError::format(self.path, format!("{msg} (at byte {})", self.pos))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(
                self.err(format!("truncated file: {what} needs {n} bytes, {} left", self.remaining()))
            );
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each at least `min_item_bytes` long: refused if the rest of the file
    /// cannot possibly hold them, which bounds every allocation by the file size.
    fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize> {
        let n = self.u64(what)?;
        let cap = self.remaining() / min_item_bytes.max(1);
        if n > cap as u64 {
            return Err(self.err(format!("{what} is {n}, but only {} bytes are left", self.remaining())));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.count(&format!("length of {what}"), 1)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err(format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(key)?[0]),
            1 => GgufValue::I8(self.array::<1>(key)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => GgufValue::U32(self.u32(key)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(self.err(format!("metadata `{key}`: invalid bool byte {b}"))),
            },
            8 => GgufValue::String(self.string(&format!("metadata `{key}`"))?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!("metadata `{key}`: arrays nested too deeply")));
                }
                let elem_ty = self.u32(key)?;
                let min = value_min_bytes(elem_ty).ok_or_else(|| {
                    self.err(format!("metadata `{key}`: unknown array element type {elem_ty}"))
                })?;
                let n = self.count(&format!("element count of `{key}`"), min)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(key)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(key)?)),
            other => return Err(self.err(format!("metadata `{key}`: unknown value type {other}"))),
        })
    }
}

/// Smallest encoding of a value of type `ty` (used to cap array counts), or `None` if unknown.
fn value_min_bytes(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,     // the length prefix
        9 => 4 + 8, // element type and count
        10..=12 => 8,
        _ => return None,
    })
}

fn parse(buf: &[u8], path: &Path) -> Result<Parsed> {
    let mut r = Reader { buf, pos: 0, path };
    let magic = r.array::<4>("magic")?;
    if &magic != MAGIC {
        return Err(r.err(format!("not a GGUF file (magic {magic:02x?})")));
    }
    let version = r.u32("version")?;
    if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
        return Err(EngineError::Unsupported {
            path: path.to_path_buf(),
            msg: "big-endian GGUF files".into(),
        });
    }
    if version != 2 && version != 3 {
        return Err(EngineError::Unsupported {
            path: path.to_path_buf(),
            msg: format!("GGUF version {version} (supported: 2, 3)"),
        });
    }
    // A tensor info is at least: name length (8), n_dims (4), one dim (8), type (4), offset (8).
    let n_tensors = r.count("tensor count", 32)?;
    // A key/value is at least: key length (8), value type (4), one byte of value.
    let n_kv = r.count("metadata count", 13)?;

    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string("metadata key")?;
        let ty = r.u32(&key)?;
        let value = r.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(r.err(format!("duplicate metadata key `{key}`")));
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => return Err(EngineError::format(path, format!("invalid general.alignment {v:?}"))),
        },
    };

    let mut raw = Vec::with_capacity(n_tensors);
    let mut seen = std::collections::HashSet::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = r.string("tensor name")?;
        let n_dims = r.u32(&name)? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(r.err(format!("tensor `{name}` has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            let d = r.u64(&name)?;
            // Anything bigger cannot fit in the file anyway; the byte check below refines this.
            if d > buf.len() as u64 * 8 {
                return Err(r.err(format!("tensor `{name}` has an impossible dimension {d}")));
            }
            dims.push(d as usize);
        }
        let type_id = r.u32(&name)?;
        let offset = r.u64(&name)?;
        if !seen.insert(name.clone()) {
            return Err(r.err(format!("duplicate tensor `{name}`")));
        }
        raw.push((name, dims, type_id, offset));
    }

    let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, type_id, offset) in raw {
        let dtype = GgmlType::from_ggml_id(type_id).ok_or_else(|| EngineError::Unsupported {
            path: path.to_path_buf(),
            msg: format!("tensor `{name}` has GGML type id {type_id}, which is not supported"),
        })?;
        if dims[0] % dtype.block_len() != 0 {
            return Err(EngineError::format(
                path,
                format!(
                    "tensor `{name}`: row length {} is not a multiple of the {dtype} block length {}",
                    dims[0],
                    dtype.block_len()
                ),
            ));
        }
        let numel = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
        let bytes = numel
            .map(|n| n / dtype.block_len() as u64 * dtype.block_bytes() as u64)
            .filter(|&b| b <= buf.len() as u64);
        let start = data_start.checked_add(offset);
        let end = match (start, bytes) {
            (Some(s), Some(b)) => s.checked_add(b),
            _ => None,
        };
        match end {
            Some(end) if end <= buf.len() as u64 => {}
            _ => {
                return Err(EngineError::format(
                    path,
                    format!(
                        "tensor `{name}` ({dtype}, dims {dims:?}, offset {offset}) lies outside the file ({} bytes)",
                        buf.len()
                    ),
                ))
            }
        }
        if offset % alignment != 0 {
            return Err(EngineError::format(
                path,
                format!("tensor `{name}`: offset {offset} is not aligned to {alignment}"),
            ));
        }
        tensors.push(GgufTensorInfo { name, dims, dtype, offset: (data_start + offset) as usize });
    }
    Ok(Parsed { version, metadata, tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal GGUF writer for tests: metadata (raw typed values) and tensors (raw bytes).
    struct Writer {
        version: u32,
        alignment: usize,
        kv: Vec<(String, u32, Vec<u8>)>,
        tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    fn str_bytes(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    impl Writer {
        fn new() -> Self {
            Writer { version: 3, alignment: 32, kv: vec![], tensors: vec![] }
        }
        fn kv(mut self, key: &str, ty: u32, value: Vec<u8>) -> Self {
            self.kv.push((key.into(), ty, value));
            self
        }
        fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
            self.tensors.push((name.into(), dims.to_vec(), ty, data));
            self
        }
        fn bytes(&self) -> Vec<u8> {
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

    fn write_tmp(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-gguf-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

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

        // Q5_0 (type 6) is a real GGML type Tandem does not load.
        let w = sample().tensor("odd", &[32], 6, vec![0; 22]);
        let e = GgufFile::open(&write_tmp("t6.gguf", &w.bytes())).unwrap_err();
        assert_eq!(e.kind(), "unsupported");
        assert!(e.to_string().contains("odd") && e.to_string().contains('6'), "{e}");

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
        let Some(p) = crate::model_cache::default_model_for_test("gguf::tests::real_model_when_present")
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
