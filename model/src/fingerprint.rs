//! A model's id: a fingerprint of its files, so that two processes can tell whether they serve
//! the same model before they exchange KV blocks as raw bytes.
//!
//! SHA-256 over each file's name and size, the whole of every small file (configs, tokenizers),
//! and for large files their first and last MiB plus 64 KiB samples spread through them. That
//! covers a GGUF's metadata and tensor table and a safetensors header, and catches a different
//! quantization or fine-tune, while a multi-gigabyte model is fingerprinted in milliseconds.
//!
//! The loader fingerprints the bytes it has already mapped ([`Source::Mapped`]), so a model file
//! is opened once whether it is hashed, parsed or both; [`fingerprint`] opens files itself, for
//! callers that hold nothing open.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{ModelError, Result};

const SMALL_FILE: u64 = 4 << 20;
const EDGE: u64 = 1 << 20;
const SAMPLE: u64 = 64 << 10;
const SAMPLES: u64 = 16;

/// Where the bytes of one file of a model come from.
pub enum Source<'a> {
    /// Already in memory (a file's whole memory map, or its whole text).
    Mapped(&'a [u8]),
    /// Not open: read the sampled ranges from this path.
    File(PathBuf),
}

/// The model id (`sha256:<32 hex digits>`) of a GGUF file or a model directory, opening each
/// file to read only the ranges hashed.
pub fn fingerprint(path: &Path) -> Result<String> {
    if path.is_dir() {
        let files = directory_files(path)?.into_iter().map(|(name, p)| (name, Source::File(p))).collect();
        fingerprint_sources(files)
    } else {
        fingerprint_sources(vec![(String::new(), Source::File(path.to_path_buf()))])
    }
}

/// The files of a model directory that its id covers: every regular file whose name does not
/// start with a dot, sorted by name.
pub fn directory_files(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))? {
        let entry = entry.map_err(|e| ModelError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') && entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
            files.push((name, entry.path()));
        }
    }
    files.sort();
    Ok(files)
}

/// The model id of named files, in the order given (a single file is named `""`).
pub fn fingerprint_sources(files: Vec<(String, Source<'_>)>) -> Result<String> {
    let mut h = Sha256::new();
    let mut buf = Vec::new();
    for (name, source) in files {
        let mut file = match &source {
            Source::Mapped(_) => None,
            Source::File(p) => Some(File::open(p).map_err(|e| ModelError::io(p, e))?),
        };
        let len = match (&source, &file) {
            (Source::Mapped(b), _) => b.len() as u64,
            (Source::File(p), Some(f)) => f.metadata().map_err(|e| ModelError::io(p, e))?.len(),
            (Source::File(_), None) => unreachable!("a file source was opened above"),
        };
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(len.to_le_bytes());
        for (start, n) in ranges(len) {
            match (&source, &mut file) {
                (Source::Mapped(b), _) => h.update(&b[start as usize..(start + n) as usize]),
                (Source::File(p), Some(f)) => {
                    buf.resize(n as usize, 0);
                    f.seek(SeekFrom::Start(start))
                        .and_then(|_| f.read_exact(&mut buf))
                        .map_err(|e| ModelError::io(p, e))?;
                    h.update(&buf);
                }
                (Source::File(_), None) => unreachable!("a file source was opened above"),
            }
        }
    }
    let digest = h.finalize();
    Ok(format!("sha256:{}", digest[..16].iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

/// The byte ranges hashed of a file of `len` bytes: all of a small file; the edges and evenly
/// spaced samples of a large one.
fn ranges(len: u64) -> Vec<(u64, u64)> {
    if len <= SMALL_FILE {
        return vec![(0, len)];
    }
    let mut r = vec![(0, EDGE), (len - EDGE, EDGE)];
    let step = len / (SAMPLES + 1);
    r.extend((1..=SAMPLES).map(|i| (i * step, SAMPLE)));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir() -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("tandem-fp-{}-{}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn fingerprint_sees_content_and_size() {
        let dir = temp_dir();
        let big = dir.join("w.bin");
        let mut data = vec![7u8; (SMALL_FILE + 3 * EDGE) as usize];
        std::fs::write(&big, &data).unwrap();
        let f1 = fingerprint(&big).unwrap();
        assert_eq!(f1, fingerprint(&big).unwrap());
        assert!(f1.starts_with("sha256:") && f1.len() == 7 + 32, "{f1}");
        data[10] = 8; // in the first MiB
        std::fs::write(&big, &data).unwrap();
        let f2 = fingerprint(&big).unwrap();
        assert_ne!(f1, f2);
        data.push(0);
        std::fs::write(&big, &data).unwrap();
        assert_ne!(f2, fingerprint(&big).unwrap());
        // A directory's id covers its small files whole.
        std::fs::write(dir.join("config.json"), "{\"a\":1}").unwrap();
        let d1 = fingerprint(&dir).unwrap();
        std::fs::write(dir.join("config.json"), "{\"a\":2}").unwrap();
        assert_ne!(d1, fingerprint(&dir).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bytes_in_memory_hash_like_the_file_they_came_from() {
        let dir = temp_dir();
        let big = dir.join("w.bin");
        let data: Vec<u8> = (0..(SMALL_FILE + 5 * EDGE + 3)).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&big, &data).unwrap();
        let from_file = fingerprint(&big).unwrap();
        let from_memory = fingerprint_sources(vec![(String::new(), Source::Mapped(&data))]).unwrap();
        assert_eq!(from_file, from_memory);
        // In a directory, names count: the same bytes under another name are another model.
        std::fs::write(dir.join("a.json"), "{}").unwrap();
        let named = |n: &str| fingerprint_sources(vec![(n.into(), Source::Mapped(b"{}"))]).unwrap();
        std::fs::remove_file(&big).unwrap();
        assert_eq!(fingerprint(&dir).unwrap(), named("a.json"));
        assert_ne!(named("a.json"), named("b.json"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
