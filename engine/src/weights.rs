//! Weight storage shared by the loaders and the backends.
//!
//! A [`Matrix`] is row-major `rows × cols` in any [`GgmlType`]; quantized types store each row as
//! `cols / block_len` consecutive blocks, so rows are independent (a row permutation is a byte
//! copy). Bytes are either borrowed from a memory-mapped file or owned and 8-byte aligned.

use std::ops::{Deref, Range};
use std::sync::Arc;

use memmap2::Mmap;

use crate::quant::GgmlType;

/// Immutable bytes: a range of a memory-mapped file, or an owned, 8-byte-aligned buffer.
#[derive(Clone)]
pub enum Bytes {
    /// A range of a memory-mapped model file.
    Mapped { map: Arc<Mmap>, range: Range<usize> },
    /// Owned storage; `u64` words keep the data 8-byte aligned so `f32` views always work.
    Owned { words: Arc<[u64]>, len: usize },
}

impl Bytes {
    /// Copies `data` into owned, aligned storage.
    pub fn copy_from(data: &[u8]) -> Bytes {
        let mut words = vec![0u64; data.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..data.len()].copy_from_slice(data);
        Bytes::Owned { words: words.into(), len: data.len() }
    }

    /// Owned storage holding `values`.
    pub fn from_f32(values: &[f32]) -> Bytes {
        Bytes::copy_from(bytemuck::cast_slice(values))
    }

    /// A sub-range: a narrower range of the same map (no copy), or a copy of owned bytes.
    ///
    /// # Panics
    /// If `range` is not inside the bytes.
    pub fn slice(&self, range: Range<usize>) -> Bytes {
        assert!(range.start <= range.end && range.end <= self.len(), "Bytes::slice out of range");
        match self {
            Bytes::Mapped { map, range: r } => {
                Bytes::Mapped { map: map.clone(), range: r.start + range.start..r.start + range.end }
            }
            Bytes::Owned { .. } => Bytes::copy_from(&self[range]),
        }
    }

    /// The bytes as `f32`s, if the length and alignment allow it.
    pub fn as_f32(&self) -> Option<&[f32]> {
        bytemuck::try_cast_slice(self).ok()
    }
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, range } => &map[range.clone()],
            Bytes::Owned { words, len } => &bytemuck::cast_slice::<u64, u8>(words)[..*len],
        }
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bytes::Mapped { range, .. } => write!(f, "Bytes::Mapped({range:?})"),
            Bytes::Owned { len, .. } => write!(f, "Bytes::Owned({len})"),
        }
    }
}

/// A row-major weight matrix (`rows` outputs × `cols` inputs), possibly quantized.
#[derive(Clone, Debug)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub dtype: GgmlType,
    pub data: Bytes,
}

impl Matrix {
    /// Size in bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols)
    }

    /// The bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows `range` as a matrix of their own (rows are independent in every type): a view of a
    /// mapped file, or a copy of owned bytes.
    ///
    /// # Panics
    /// If `range` is not inside the matrix.
    pub fn rows(&self, range: Range<usize>) -> Matrix {
        assert!(range.start <= range.end && range.end <= self.rows, "Matrix::rows out of range");
        let rb = self.row_bytes();
        Matrix {
            rows: range.len(),
            cols: self.cols,
            dtype: self.dtype,
            data: self.data.slice(range.start * rb..range.end * rb),
        }
    }

    /// `count` matrices of `rows` rows each, stored one after another (a 3-D tensor of experts).
    ///
    /// # Panics
    /// If `self.rows != count * rows`.
    pub fn split_stacked(&self, count: usize, rows: usize) -> Vec<Matrix> {
        assert_eq!(self.rows, count * rows, "split_stacked: {} rows are not {count} × {rows}", self.rows);
        (0..count).map(|e| self.rows(e * rows..(e + 1) * rows)).collect()
    }

    /// Dequantizes row `row` into `out` (embedding lookups).
    ///
    /// # Panics
    /// If `row >= self.rows` or `out.len() != self.cols`: callers are internal and size their
    /// buffers from the matrix itself.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.rows, "dequantize_row: row {row} out of {} rows", self.rows);
        assert_eq!(out.len(), self.cols, "dequantize_row: output length must equal cols");
        crate::quant::dequantize_unchecked(self.dtype, self.row(row), out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splitting by rows keeps each row's bytes, from owned and from mapped storage alike.
    #[test]
    fn rows_keeps_rows() {
        let values: Vec<f32> = (0..5 * 3).map(|i| i as f32).collect();
        let owned = Matrix { rows: 5, cols: 3, dtype: GgmlType::F32, data: Bytes::from_f32(&values) };
        let path = std::env::temp_dir().join(format!("tandem-row-range-{}", std::process::id()));
        // Four bytes before the matrix, so the mapped range does not start at the file's start.
        let mut file_bytes = vec![0u8; 4];
        file_bytes.extend_from_slice(bytemuck::cast_slice(&values));
        std::fs::write(&path, &file_bytes).unwrap();
        // SAFETY: the file is private to this test and not modified while mapped.
        let map = Arc::new(unsafe { Mmap::map(&std::fs::File::open(&path).unwrap()) }.unwrap());
        let mapped = Matrix {
            rows: 5,
            cols: 3,
            dtype: GgmlType::F32,
            data: Bytes::Mapped { map, range: 4..4 + values.len() * 4 },
        };
        for m in [&owned, &mapped] {
            let mid = m.rows(1..4);
            assert_eq!((mid.rows, mid.cols), (3, 3));
            assert_eq!(mid.data.as_f32().unwrap(), &values[3..12]);
            assert_eq!(m.rows(4..5).data.as_f32().unwrap(), &values[12..15]);
            assert_eq!(m.rows(2..2).rows, 0);
        }
        assert!(matches!(mapped.rows(0..1).data, Bytes::Mapped { .. }), "a mapped split is a view");
        std::fs::remove_file(&path).unwrap();
    }
}
