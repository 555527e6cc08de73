//! GGUF (llama.cpp's model format, versions 2 and 3) read over a memory map.
//!
//! Layout: magic `GGUF`, version, tensor count, metadata count, metadata key/values, tensor infos,
//! padding to `general.alignment` (default 32), then tensor data. All little-endian.
//!
//! Invariants: opening never panics and never allocates more than a small multiple of the file's
//! size, whatever the bytes say (every count is capped by the bytes left to read it from); every
//! tensor in [`GgufFile::tensors`] has a supported type, a row length that is a whole number of
//! blocks, and data that lies inside the file, so [`GgufFile::tensor_range`] cannot fail.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{ModelError, Result};
pub use crate::ggml::GgmlType;

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
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the map is read-only and model files are not modified while being served; a
        // concurrent truncation by another process is outside what any mmap-based loader can guard.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let map = Arc::new(map);
        let parsed = parse(&map, path, true)?;
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

    /// Maps `path` and parses its header and metadata only: [`GgufFile::tensors`] is empty, so
    /// the metadata (tokenizer, configuration) of a file whose tensor types this engine cannot
    /// load is still readable.
    pub fn open_metadata(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: as in `open`.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let map = Arc::new(map);
        let parsed = parse(&map, path, false)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: Vec::new(),
            map,
            index: HashMap::new(),
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

    /// The memory map the tensors' bytes live in (shared, so the engine's weights borrow it
    /// without copying).
    pub fn map(&self) -> &Arc<Mmap> {
        &self.map
    }

    /// The byte range of a tensor's data in [`Self::map`].
    ///
    /// # Panics
    /// If `info` does not come from this file and lies outside it (infos from `self.tensors`
    /// were bounds-checked at open).
    pub fn tensor_range(&self, info: &GgufTensorInfo) -> std::ops::Range<usize> {
        let range = info.offset..info.offset + info.byte_len();
        assert!(range.end <= self.map.len(), "tensor `{}` is not from this file", info.name);
        range
    }

    /// A tensor's info by name, or [`ModelError::MissingTensor`] naming the file.
    pub fn require(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensor(name)
            .ok_or_else(|| ModelError::MissingTensor { path: self.path.clone(), tensor: name.to_string() })
    }

    /// The error for a tensor of the wrong rank.
    pub fn shape_error(&self, info: &GgufTensorInfo, rank: usize) -> ModelError {
        ModelError::Format {
            path: self.path.clone(),
            msg: format!("tensor `{}` has dims {:?}, expected a {rank}-D tensor", info.name, info.dims),
        }
    }

    /// A small 1-D tensor stored unquantized (`F32`, `F16` or `BF16`, trailing dims of 1
    /// allowed) as `f32`: what configuration reading needs (e.g. `rope_freqs.weight`). Quantized
    /// tensors are the engine's business and are refused here by name.
    pub fn plain_vector_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.require(name)?;
        if info.dims.is_empty() || info.dims[1..].iter().any(|&x| x != 1) {
            return Err(self.shape_error(info, 1));
        }
        let bytes = &self.map[self.tensor_range(info)];
        let half = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]);
        Ok(match info.dtype {
            GgmlType::F32 => {
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            GgmlType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_bits(half(c)).to_f32()).collect(),
            GgmlType::BF16 => bytes.chunks_exact(2).map(|c| f32::from_bits((half(c) as u32) << 16)).collect(),
            other => {
                return Err(ModelError::Unsupported {
                    path: self.path.clone(),
                    msg: format!("tensor `{name}` is {other}; only F32, F16 or BF16 is read as metadata"),
                })
            }
        })
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
    fn err(&self, msg: impl std::fmt::Display) -> ModelError {
        ModelError::format(self.path, format!("{msg} (at byte {})", self.pos))
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

/// Parses the header, the metadata and, with `with_tensors`, every tensor info.
fn parse(buf: &[u8], path: &Path, with_tensors: bool) -> Result<Parsed> {
    let mut r = Reader { buf, pos: 0, path };
    let magic = r.array::<4>("magic")?;
    if &magic != MAGIC {
        return Err(r.err(format!("not a GGUF file (magic {magic:02x?})")));
    }
    let version = r.u32("version")?;
    if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
        return Err(ModelError::Unsupported {
            path: path.to_path_buf(),
            msg: "big-endian GGUF files".into(),
        });
    }
    if version != 2 && version != 3 {
        return Err(ModelError::Unsupported {
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
            _ => return Err(ModelError::format(path, format!("invalid general.alignment {v:?}"))),
        },
    };
    if !with_tensors {
        return Ok(Parsed { version, metadata, tensors: Vec::new() });
    }

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
        let dtype = GgmlType::from_ggml_id(type_id).ok_or_else(|| ModelError::Unsupported {
            path: path.to_path_buf(),
            msg: format!("tensor `{name}` has GGML type id {type_id}, which is not supported"),
        })?;
        if dims[0] % dtype.block_len() != 0 {
            return Err(ModelError::format(
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
                return Err(ModelError::format(
                    path,
                    format!(
                        "tensor `{name}` ({dtype}, dims {dims:?}, offset {offset}) lies outside the file ({} bytes)",
                        buf.len()
                    ),
                ))
            }
        }
        if offset % alignment != 0 {
            return Err(ModelError::format(
                path,
                format!("tensor `{name}`: offset {offset} is not aligned to {alignment}"),
            ));
        }
        tensors.push(GgufTensorInfo { name, dims, dtype, offset: (data_start + offset) as usize });
    }
    Ok(Parsed { version, metadata, tensors })
}
