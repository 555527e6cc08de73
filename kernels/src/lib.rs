//! CUDA kernel sources, addressed by name, compiled by NVRTC for the device's architecture.
//!
//! NVRTC (`libnvrtc.so.13`) is loaded with dlopen on first use: the crate builds and links without
//! any CUDA library, and [`nvrtc_available`] says whether compiling is possible before anything
//! touches the library (cudarc panics on a missing library; nothing here does).
//!
//! [`PtxCache`] keeps compiled PTX on disk. An entry's file name holds the source's name, the
//! architecture and a SHA-256 of everything that determines the output (source text, compiler
//! options, NVRTC version), so a changed kernel or a new NVRTC never reads a stale entry. Entries
//! are written to a temporary file and renamed into place, and each carries a checksum of its PTX:
//! a reader sees a whole entry or none, and a damaged one is compiled again. The cache is an
//! optimisation only: when its directory cannot be written, kernels are compiled and a warning is
//! logged.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

mod sources;
pub use sources::SOURCES;

/// A CUDA C source file shipped with Tandem.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// Stable name used to look the module up.
    pub name: &'static str,
    /// CUDA C source text.
    pub source: &'static str,
    /// The `extern "C" __global__` functions the source defines.
    pub entries: &'static [&'static str],
}

/// Looks a kernel source up by name.
pub fn source(name: &str) -> Option<&'static KernelSource> {
    SOURCES.iter().find(|s| s.name == name)
}

/// What can go wrong while turning a kernel source into PTX.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The NVRTC library could not be loaded.
    #[error(
        "NVRTC is not available: libnvrtc.so.13 was not found (or is not usable). Install the CUDA 13 \
         toolkit or PyPI's nvidia-cuda-nvrtc package (scripts/fetch-nvrtc.sh fetches it into \
         target/nvrtc/lib) and put the directory holding libnvrtc.so.13 on LD_LIBRARY_PATH"
    )]
    NvrtcMissing,
    /// NVRTC rejected a source; `log` is NVRTC's program log.
    #[error("NVRTC could not compile kernel source `{name}` for compute_{}{}:\n{log}", arch.0, arch.1)]
    Compile {
        /// The source's [`KernelSource::name`].
        name: String,
        /// The target architecture, `(major, minor)`.
        arch: (u32, u32),
        /// The compiler's log (or, when it wrote none, the NVRTC status).
        log: String,
    },
    /// A PTX cache file or directory could not be used. [`PtxCache::get_or_compile`] does not fail
    /// with it (it compiles instead); it is what the cache logs as a warning.
    #[error("kernel cache {0}: {1}")]
    Cache(PathBuf, #[source] io::Error),
}

impl KernelError {
    /// A stable name for the kind of error, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            KernelError::NvrtcMissing => "nvrtc_missing",
            KernelError::Compile { .. } => "kernel_compile",
            KernelError::Cache(..) => "kernel_cache",
        }
    }
}

/// Whether NVRTC can be loaded (`libnvrtc` on the library search path). Checked once per process.
pub fn nvrtc_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the candidate library names and closes what it
    // opened; it calls no NVRTC function.
    *PRESENT.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(u32, u32), KernelError> {
    static VERSION: OnceLock<Option<(u32, u32)>> = OnceLock::new();
    if !nvrtc_available() {
        return Err(KernelError::NvrtcMissing);
    }
    let version = VERSION.get_or_init(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the library is present (checked above), so cudarc's lazy symbol lookup succeeds;
        // nvrtcVersion only writes the two integers it is given pointers to.
        let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        status.result().ok().map(|()| (major as u32, minor as u32))
    });
    // NVRTC documents no failure for valid pointers: a library that fails here is not a usable NVRTC.
    version.ok_or(KernelError::NvrtcMissing)
}

/// The NVRTC options every kernel is compiled with: the virtual architecture and the language
/// standard. No fast math: kernels keep IEEE division, square root and denormals, so results
/// track the CPU backend (NVRTC's defaults; multiply-add contraction into FMA stays on).
fn nvrtc_options(arch: (u32, u32)) -> Vec<String> {
    vec![format!("--gpu-architecture=compute_{}{}", arch.0, arch.1), "-std=c++17".to_string()]
}

/// Compiles `src` to PTX for the virtual architecture `compute_{major}{minor}` with NVRTC.
pub fn compile_ptx(src: &KernelSource, arch: (u32, u32)) -> Result<String, KernelError> {
    use cudarc::nvrtc::{CompileError, CompileOptions};

    if !nvrtc_available() {
        return Err(KernelError::NvrtcMissing);
    }
    let fail = |log: String| KernelError::Compile { name: src.name.to_string(), arch, log };
    // cudarc panics on an interior NUL; say which source has one instead.
    if src.source.contains('\0') || src.name.contains('\0') {
        return Err(fail("the source or its name contains a NUL byte".into()));
    }
    let opts = CompileOptions {
        options: nvrtc_options(arch),
        // NVRTC names the program in its log lines ("<name>.cu(12): error: ...").
        name: Some(format!("{}.cu", src.name)),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src.source, opts).map_err(|e| match e {
        CompileError::CompileError { nvrtc, log, .. } => {
            let log = log.to_string_lossy().trim_end().to_string();
            fail(if log.is_empty() { format!("{nvrtc:?}") } else { log })
        }
        other => fail(format!("{other:?}")),
    })?;
    let bytes = ptx.as_bytes().ok_or_else(|| fail("NVRTC returned no PTX image".into()))?;
    // The image is a NUL-terminated C string.
    let text = bytes.split(|&b| b == 0).next().unwrap_or_default();
    String::from_utf8(text.to_vec()).map_err(|_| fail("NVRTC returned PTX that is not UTF-8".into()))
}

type CompileFn = dyn Fn(&KernelSource, (u32, u32)) -> Result<String, KernelError> + Send + Sync;
type VersionFn = dyn Fn() -> Result<String, KernelError> + Send + Sync;

/// What the cache compiles with: NVRTC, or a stand-in in unit tests.
struct Compiler {
    /// Names the compiler and its version; part of every cache key.
    version: Box<VersionFn>,
    /// The options `compile` passes for an architecture; part of every cache key.
    options: fn((u32, u32)) -> Vec<String>,
    compile: Box<CompileFn>,
}

impl Compiler {
    fn nvrtc() -> Self {
        Compiler {
            version: Box::new(|| nvrtc_version().map(|(major, minor)| format!("nvrtc {major}.{minor}"))),
            options: nvrtc_options,
            compile: Box::new(compile_ptx),
        }
    }
}

/// Counts of what a [`PtxCache`] did, since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Entries read from disk instead of compiling.
    pub hits: u64,
    /// Sources compiled (misses, damaged entries and uncacheable compiles included).
    pub compiled: u64,
    /// Entries found damaged or unreadable (each was compiled again).
    pub corrupt: u64,
    /// Entries that could not be written (the PTX was still returned).
    pub write_failures: u64,
}

/// Compiled PTX on disk, keyed by source text, compiler options, NVRTC version and architecture.
/// Safe to share between threads and processes: entries appear atomically and concurrent
/// writers of one key write the same bytes.
pub struct PtxCache {
    dir: PathBuf,
    compiler: Compiler,
    hits: AtomicU64,
    compiled: AtomicU64,
    corrupt: AtomicU64,
    write_failures: AtomicU64,
    /// Whether an unwritable cache has been reported (once per cache, not once per kernel).
    warned_write: AtomicBool,
}

impl std::fmt::Debug for PtxCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PtxCache").field("dir", &self.dir).field("stats", &self.stats()).finish()
    }
}

impl Default for PtxCache {
    /// The cache in `$TANDEM_KERNEL_CACHE`, else `$XDG_CACHE_HOME/tandem/kernels`, else
    /// `~/.cache/tandem/kernels` (the system's temporary directory when there is no home).
    fn default() -> Self {
        PtxCache::new(default_dir(|key| std::env::var_os(key)))
    }
}

fn default_dir(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    let set = |key: &str| var(key).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set("TANDEM_KERNEL_CACHE") {
        return dir;
    }
    // The XDG spec says to ignore a relative XDG_CACHE_HOME.
    if let Some(xdg) = set("XDG_CACHE_HOME").filter(|p| p.is_absolute()) {
        return xdg.join("tandem/kernels");
    }
    match set("HOME") {
        Some(home) => home.join(".cache/tandem/kernels"),
        None => std::env::temp_dir().join("tandem-kernels"),
    }
}

/// First line of every entry; the hex SHA-256 of the PTX that follows comes after it.
const ENTRY_HEADER: &str = "// tandem PTX cache entry v1, sha256 of the PTX below: ";

impl PtxCache {
    /// A cache in `dir` (created on first write) that compiles with NVRTC.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        PtxCache::with_compiler(dir.into(), Compiler::nvrtc())
    }

    fn with_compiler(dir: PathBuf, compiler: Compiler) -> Self {
        PtxCache {
            dir,
            compiler,
            hits: AtomicU64::new(0),
            compiled: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            write_failures: AtomicU64::new(0),
            warned_write: AtomicBool::new(false),
        }
    }

    /// The directory entries live in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What the cache has done so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            compiled: self.compiled.load(Ordering::Relaxed),
            corrupt: self.corrupt.load(Ordering::Relaxed),
            write_failures: self.write_failures.load(Ordering::Relaxed),
        }
    }

    /// Where the entry for `src` compiled for `arch` lives (whether or not it exists yet).
    /// Needs NVRTC, whose version is part of the key.
    pub fn entry_path(&self, src: &KernelSource, arch: (u32, u32)) -> Result<PathBuf, KernelError> {
        let version = (self.compiler.version)()?;
        let key = cache_key(src.source, &(self.compiler.options)(arch), &version);
        Ok(self.dir.join(entry_file_name(src.name, arch, &key)))
    }

    /// The PTX of `src` for `arch`: from the cache when a sound entry exists, otherwise compiled
    /// (and stored, when the directory can be written).
    pub fn get_or_compile(&self, src: &KernelSource, arch: (u32, u32)) -> Result<String, KernelError> {
        let path = self.entry_path(src, arch)?;
        match fs::read(&path) {
            Ok(bytes) => match parse_entry(&bytes) {
                Some(ptx) => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(ptx.to_string());
                }
                None => {
                    self.corrupt.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(path = %path.display(), "damaged kernel cache entry; compiling again");
                }
            },
            // No entry, or no directory to hold one: a plain miss.
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => {}
            Err(e) => {
                self.corrupt.fetch_add(1, Ordering::Relaxed);
                let err = KernelError::Cache(path.clone(), e);
                tracing::warn!("{err}; compiling again");
            }
        }
        let ptx = (self.compiler.compile)(src, arch)?;
        self.compiled.fetch_add(1, Ordering::Relaxed);
        if let Err(err) = self.store(&path, &ptx) {
            self.write_failures.fetch_add(1, Ordering::Relaxed);
            if !self.warned_write.swap(true, Ordering::Relaxed) {
                tracing::warn!("{err}; kernels will be compiled at every start");
            }
        }
        Ok(ptx)
    }

    /// Writes an entry atomically: a temporary file in the same directory, renamed into place.
    fn store(&self, path: &Path, ptx: &str) -> Result<(), KernelError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let cache_err = |p: &Path, e| KernelError::Cache(p.to_path_buf(), e);
        fs::create_dir_all(&self.dir).map_err(|e| cache_err(&self.dir, e))?;
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("entry");
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(".{name}.{}.{seq}.tmp", std::process::id()));
        let written = (|| {
            let mut file = fs::File::create(&tmp)?;
            file.write_all(format_entry(ptx).as_bytes())?;
            file.sync_all()?;
            fs::rename(&tmp, path)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written.map_err(|e| cache_err(path, e))
    }
}

/// SHA-256 over the source text, the options and the compiler version, each length-prefixed so
/// that no two different inputs hash the same bytes.
fn cache_key(source: &str, options: &[String], compiler_version: &str) -> String {
    let mut hash = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    field(source.as_bytes());
    field(&(options.len() as u64).to_le_bytes());
    for option in options {
        field(option.as_bytes());
    }
    field(compiler_version.as_bytes());
    hex(&hash.finalize())
}

fn entry_file_name(name: &str, arch: (u32, u32), key: &str) -> String {
    let name: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' })
        .collect();
    format!("{name}.compute_{}{}.{key}.ptx", arch.0, arch.1)
}

fn format_entry(ptx: &str) -> String {
    format!("{ENTRY_HEADER}{}\n{ptx}", hex(&Sha256::digest(ptx.as_bytes())))
}

/// The PTX of a sound entry; `None` when the header or the checksum does not match.
fn parse_entry(bytes: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(bytes).ok()?;
    let (header, ptx) = text.split_once('\n')?;
    let sum = header.strip_prefix(ENTRY_HEADER)?;
    (sum == hex(&Sha256::digest(ptx.as_bytes()))).then_some(ptx)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    const SRC: KernelSource =
        KernelSource { name: "unit", source: "extern \"C\" __global__ void k() {}", entries: &["k"] };

    /// A compiler stand-in: its "PTX" names the source and the arch; it counts its calls.
    fn fake(calls: Arc<AtomicUsize>, version: &'static str) -> Compiler {
        Compiler {
            version: Box::new(move || Ok(version.to_string())),
            options: nvrtc_options,
            compile: Box::new(move |src, arch| {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok(format!("// {version}\n.target sm_{}{}\n// {}\n", arch.0, arch.1, src.source))
            }),
        }
    }

    fn temp_dir(tag: &str) -> PathBuf {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("tandem-kernels-unit-{}-{tag}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn key_changes_with_source_options_and_version() {
        let opts = nvrtc_options((8, 0));
        let base = cache_key("a", &opts, "nvrtc 13.0");
        assert_eq!(base, cache_key("a", &opts, "nvrtc 13.0"));
        assert_ne!(base, cache_key("b", &opts, "nvrtc 13.0"));
        assert_ne!(base, cache_key("a", &nvrtc_options((9, 0)), "nvrtc 13.0"));
        assert_ne!(base, cache_key("a", &[opts[0].clone()], "nvrtc 13.0"));
        assert_ne!(base, cache_key("a", &opts, "nvrtc 13.1"));
        // Field boundaries matter: moving text between fields changes the key.
        assert_ne!(cache_key("ab", &[], "c"), cache_key("a", &[], "bc"));
    }

    #[test]
    fn entries_differ_by_arch_and_source() {
        let cache = PtxCache::with_compiler(temp_dir("paths"), fake(Default::default(), "v1"));
        let other = KernelSource { source: "extern \"C\" __global__ void k() { }", ..SRC };
        let p80 = cache.entry_path(&SRC, (8, 0)).unwrap();
        assert!(p80.file_name().unwrap().to_str().unwrap().starts_with("unit.compute_80."), "{p80:?}");
        assert_ne!(p80, cache.entry_path(&SRC, (9, 0)).unwrap());
        assert_ne!(p80, cache.entry_path(&other, (8, 0)).unwrap());
        let v2 = PtxCache::with_compiler(cache.dir().to_path_buf(), fake(Default::default(), "v2"));
        assert_ne!(p80, v2.entry_path(&SRC, (8, 0)).unwrap());
    }

    #[test]
    fn second_call_hits_and_write_leaves_only_the_entry() {
        let calls = Arc::new(AtomicUsize::new(0));
        let dir = temp_dir("hit");
        let cache = PtxCache::with_compiler(dir.clone(), fake(calls.clone(), "v1"));
        let first = cache.get_or_compile(&SRC, (8, 0)).unwrap();
        let second = cache.get_or_compile(&SRC, (8, 0)).unwrap();
        assert_eq!(first, second);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(cache.stats(), CacheStats { hits: 1, compiled: 1, ..Default::default() });
        // No temporary file is left behind; the entry holds a checksummed copy of the PTX.
        let path = cache.entry_path(&SRC, (8, 0)).unwrap();
        assert_eq!(files(&dir), vec![path.file_name().unwrap().to_string_lossy().into_owned()]);
        assert_eq!(parse_entry(&fs::read(&path).unwrap()), Some(first.as_str()));
        // A new cache over the same directory (a later process) reads it too.
        let later = PtxCache::with_compiler(dir.clone(), fake(calls.clone(), "v1"));
        assert_eq!(later.get_or_compile(&SRC, (8, 0)).unwrap(), first);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Another arch is another entry.
        let sm90 = cache.get_or_compile(&SRC, (9, 0)).unwrap();
        assert!(sm90.contains(".target sm_90"));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stray_temporary_file_is_not_an_entry() {
        let calls = Arc::new(AtomicUsize::new(0));
        let dir = temp_dir("stray");
        let cache = PtxCache::with_compiler(dir.clone(), fake(calls.clone(), "v1"));
        let path = cache.entry_path(&SRC, (8, 0)).unwrap();
        // What a writer killed mid-write leaves: a partial temporary file beside the entry's name.
        fs::create_dir_all(&dir).unwrap();
        let name = path.file_name().unwrap().to_str().unwrap();
        fs::write(dir.join(format!(".{name}.1.0.tmp")), &format_entry("whole")[..20]).unwrap();
        let ptx = cache.get_or_compile(&SRC, (8, 0)).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(parse_entry(&fs::read(&path).unwrap()), Some(ptx.as_str()));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn corrupt_entries_are_compiled_again_and_repaired() {
        let calls = Arc::new(AtomicUsize::new(0));
        let dir = temp_dir("corrupt");
        let cache = PtxCache::with_compiler(dir.clone(), fake(calls.clone(), "v1"));
        let good = cache.get_or_compile(&SRC, (8, 0)).unwrap();
        let path = cache.entry_path(&SRC, (8, 0)).unwrap();
        let entry = fs::read(&path).unwrap();
        let mut flipped = entry.clone();
        *flipped.last_mut().unwrap() ^= 1;
        let damaged: [&[u8]; 5] = [
            b"",
            &entry[..entry.len() - 3], // truncated
            &flipped,                  // one bit changed in the PTX
            &[0xff, 0xfe, 0x00],       // not UTF-8
            good.as_bytes(),           // PTX without the header
        ];
        for (i, bytes) in damaged.iter().enumerate() {
            fs::write(&path, bytes).unwrap();
            assert_eq!(cache.get_or_compile(&SRC, (8, 0)).unwrap(), good, "case {i}");
            assert_eq!(calls.load(Ordering::SeqCst), 2 + i, "case {i} must recompile");
            assert_eq!(fs::read(&path).unwrap(), entry, "case {i} must be repaired");
        }
        // An entry that cannot be read as a file (a directory in its place) is compiled too.
        fs::remove_file(&path).unwrap();
        fs::create_dir(&path).unwrap();
        assert_eq!(cache.get_or_compile(&SRC, (8, 0)).unwrap(), good);
        let stats = cache.stats();
        assert_eq!((stats.corrupt, stats.compiled, stats.hits), (6, 7, 0));
        assert_eq!(stats.write_failures, 1, "the rename onto a directory fails");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unwritable_directory_still_compiles() {
        let calls = Arc::new(AtomicUsize::new(0));
        let parent = temp_dir("unwritable");
        fs::create_dir_all(&parent).unwrap();
        // A directory under a regular file cannot be created, even by root.
        let file = parent.join("file");
        fs::write(&file, b"not a directory").unwrap();
        let cache = PtxCache::with_compiler(file.join("kernels"), fake(calls.clone(), "v1"));
        let a = cache.get_or_compile(&SRC, (8, 0)).unwrap();
        let b = cache.get_or_compile(&SRC, (8, 0)).unwrap();
        assert_eq!(a, b);
        assert!(a.contains(".target sm_80"));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(cache.stats(), CacheStats { compiled: 2, write_failures: 2, ..Default::default() });
        assert_eq!(files(&parent), vec!["file".to_string()]);
        fs::remove_dir_all(&parent).unwrap();
    }

    #[test]
    fn compile_errors_pass_through_and_store_nothing() {
        let dir = temp_dir("fail");
        let compiler = Compiler {
            version: Box::new(|| Ok("v1".into())),
            options: nvrtc_options,
            compile: Box::new(|src, arch| {
                Err(KernelError::Compile { name: src.name.into(), arch, log: "error: nope".into() })
            }),
        };
        let cache = PtxCache::with_compiler(dir.clone(), compiler);
        let err = cache.get_or_compile(&SRC, (9, 0)).unwrap_err();
        let KernelError::Compile { name, arch, log } = &err else { panic!("{err:?}") };
        assert_eq!((name.as_str(), *arch, log.as_str()), ("unit", (9, 0), "error: nope"));
        assert_eq!(
            err.to_string(),
            "NVRTC could not compile kernel source `unit` for compute_90:\nerror: nope"
        );
        assert!(!dir.exists());
    }

    #[test]
    fn missing_compiler_is_reported_before_any_file_access() {
        let compiler = Compiler {
            version: Box::new(|| Err(KernelError::NvrtcMissing)),
            options: nvrtc_options,
            compile: Box::new(|_, _| panic!("must not compile")),
        };
        let cache = PtxCache::with_compiler(temp_dir("missing"), compiler);
        let err = cache.get_or_compile(&SRC, (8, 0)).unwrap_err();
        assert!(matches!(err, KernelError::NvrtcMissing));
        let msg = err.to_string();
        assert!(msg.contains("libnvrtc.so.13") && msg.contains("LD_LIBRARY_PATH"), "{msg}");
        assert!(msg.contains("nvidia-cuda-nvrtc") && msg.contains("CUDA 13"), "{msg}");
        assert_eq!(err.kind(), "nvrtc_missing");
    }

    #[test]
    fn default_dir_follows_the_environment() {
        fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<std::ffi::OsString> + 'a {
            move |key| pairs.iter().find(|(k, _)| *k == key).map(|(_, v)| v.into())
        }
        let all = [("TANDEM_KERNEL_CACHE", "/k"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(default_dir(env(&all)), PathBuf::from("/k"));
        assert_eq!(default_dir(env(&all[1..])), PathBuf::from("/x/tandem/kernels"));
        assert_eq!(default_dir(env(&all[2..])), PathBuf::from("/h/.cache/tandem/kernels"));
        let empty_or_relative = [("TANDEM_KERNEL_CACHE", ""), ("XDG_CACHE_HOME", "rel"), ("HOME", "/h")];
        assert_eq!(default_dir(env(&empty_or_relative)), PathBuf::from("/h/.cache/tandem/kernels"));
        assert_eq!(default_dir(env(&[])), std::env::temp_dir().join("tandem-kernels"));
    }

    #[test]
    fn options_name_the_virtual_arch_and_no_fast_math() {
        let opts = nvrtc_options((9, 0));
        assert_eq!(opts, ["--gpu-architecture=compute_90", "-std=c++17"]);
        assert!(!opts.iter().any(|o| o.contains("fast") || o.contains("ftz=true")));
    }
}
