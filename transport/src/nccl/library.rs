//! Finding and loading `libnccl` at run time.
//!
//! The search order is [`library_candidates`]'s; the first candidate that loads and has every
//! symbol this module calls wins. Loading happens once per process ([`load`]); a failure is
//! remembered too, so every caller gets the same message.

use std::ffi::{c_int, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::ffi::{self, NcclResult, RawUniqueId, NCCL_SUCCESS, UNIQUE_ID_BYTES};
use super::NcclError;

/// Environment variable naming the NCCL library file to load; when set, nothing else is tried.
pub const LIBRARY_ENV: &str = "TANDEM_NCCL_LIBRARY";

/// The soname of NCCL 2.x, what the wheel and the distribution packages install.
const SONAME: &str = "libnccl.so.2";
/// The development symlink (present with headers, or in hand-built trees).
const DEV_NAME: &str = "libnccl.so";

/// Where distributions and the CUDA toolkit put libnccl (`*` is one directory level, read from
/// the file system).
const SYSTEM_DIRS: &[&str] = &[
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/local/cuda/lib64",
    "usr/local/cuda/targets/*/lib",
    "usr/local/nccl/lib",
];

const HINT: &str = "install NCCL 2.x: `pip install nvidia-nccl-cu13` (or nvidia-nccl-cu12) in the \
    Python environment, or the distribution's libnccl2 package; or set TANDEM_NCCL_LIBRARY to the \
    path of libnccl.so.2, or add its directory to LD_LIBRARY_PATH";

/// The files [`load`] tries, in order:
/// 1. `TANDEM_NCCL_LIBRARY`, when set: then it is the only candidate (returned even when it does
///    not exist, so the error names it);
/// 2. `libnccl.so.2` then `libnccl.so` in each `LD_LIBRARY_PATH` directory;
/// 3. the NVIDIA wheel's `nvidia/nccl/lib/libnccl.so.2` (`nvidia-nccl-cu13`, `-cu12`) in the
///    site-packages of `VIRTUAL_ENV`, `CONDA_PREFIX`, each `PYTHONPATH` entry,
///    `/usr/local/lib/python3.*/dist-packages`, `/usr/lib/python3/dist-packages` and
///    `~/.local/lib/python3.*/site-packages` (newest Python first);
/// 4. `libnccl.so.2` then `libnccl.so` in the distribution and CUDA directories
///    (`/usr/lib/x86_64-linux-gnu`, `/usr/lib/aarch64-linux-gnu`, `/usr/lib64`,
///    `/usr/local/cuda/lib64`, `/usr/local/cuda/targets/*/lib`, `/usr/local/nccl/lib`);
/// 5. the bare names `libnccl.so.2` and `libnccl.so`, for the dynamic loader's own search.
///
/// Only files that exist are listed, except in 1 and 5; a path is listed once.
pub fn library_candidates(env: &dyn Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    candidates_under(env, Path::new("/"))
}

/// [`library_candidates`] with the fixed system directories taken under `root` (`/` but in
/// tests).
fn candidates_under(env: &dyn Fn(&str) -> Option<String>, root: &Path) -> Vec<PathBuf> {
    let var = |k: &str| env(k).filter(|v| !v.is_empty());
    if let Some(explicit) = var(LIBRARY_ENV) {
        return vec![PathBuf::from(explicit)];
    }
    let mut found = Vec::new();
    let mut push = |p: PathBuf| {
        if p.is_file() && !found.contains(&p) {
            found.push(p);
        }
    };
    let split = |v: Option<String>| -> Vec<PathBuf> {
        v.map(|v| v.split(':').filter(|d| !d.is_empty()).map(PathBuf::from).collect()).unwrap_or_default()
    };

    for dir in split(var("LD_LIBRARY_PATH")) {
        push(dir.join(SONAME));
        push(dir.join(DEV_NAME));
    }

    let mut site = Vec::new();
    for prefix in [var("VIRTUAL_ENV"), var("CONDA_PREFIX")].into_iter().flatten() {
        site.extend(python_dirs(&Path::new(&prefix).join("lib"), "site-packages"));
    }
    site.extend(split(var("PYTHONPATH")));
    site.extend(python_dirs(&root.join("usr/local/lib"), "dist-packages"));
    site.push(root.join("usr/lib/python3/dist-packages"));
    if let Some(home) = var("HOME") {
        site.extend(python_dirs(&Path::new(&home).join(".local/lib"), "site-packages"));
    }
    for dir in site {
        push(dir.join("nvidia/nccl/lib").join(SONAME));
    }

    for pattern in SYSTEM_DIRS {
        for dir in expand(root, pattern) {
            push(dir.join(SONAME));
            push(dir.join(DEV_NAME));
        }
    }

    found.push(PathBuf::from(SONAME));
    found.push(PathBuf::from(DEV_NAME));
    found
}

/// `<lib>/python3.*/<leaf>` for every `python3.*` directory in `lib`, newest Python first.
fn python_dirs(lib: &Path, leaf: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(lib) else { return Vec::new() };
    let mut versions: Vec<(u32, String)> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|name| {
            let minor = name.strip_prefix("python3.")?.parse().ok()?;
            Some((minor, name))
        })
        .collect();
    versions.sort_by(|a, b| b.cmp(a));
    versions.into_iter().map(|(_, name)| lib.join(name).join(leaf)).collect()
}

/// The directories `pattern` (relative, at most one `*` component) names under `root`.
fn expand(root: &Path, pattern: &str) -> Vec<PathBuf> {
    let Some((before, after)) = pattern.split_once("/*/") else { return vec![root.join(pattern)] };
    let parent = root.join(before);
    let Ok(entries) = std::fs::read_dir(&parent) else { return Vec::new() };
    let mut names: Vec<_> = entries.filter_map(|e| Some(e.ok()?.file_name())).collect();
    names.sort();
    names.into_iter().map(|n| parent.join(n).join(after)).collect()
}

/// Decodes `ncclGetVersion`'s code: `major*10000 + minor*100 + patch` since 2.9,
/// `major*1000 + minor*100 + patch` before.
pub fn decode_version(code: i32) -> (u32, u32, u32) {
    let code = code.max(0) as u32;
    if code >= 20900 {
        (code / 10000, code % 10000 / 100, code % 100)
    } else {
        (code / 1000, code % 1000 / 100, code % 100)
    }
}

/// An `ncclUniqueId`: what both ranks pass to `ncclCommInitRank` to find each other. It holds
/// the address of rank 0's bootstrap listener, so `Debug` does not print it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; UNIQUE_ID_BYTES]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

/// A loaded NCCL library and the entry points this module calls. Lives for the whole process
/// once [`load`]ed (the library is never unloaded).
pub struct NcclLib {
    path: String,
    version: (u32, u32, u32),
    pub(crate) get_unique_id: ffi::GetUniqueIdFn,
    pub(crate) comm_init_rank: ffi::CommInitRankFn,
    pub(crate) comm_abort: ffi::CommFn,
    pub(crate) comm_get_async_error: ffi::CommGetAsyncErrorFn,
    get_error_string: ffi::GetErrorStringFn,
    pub(crate) group_start: ffi::GroupFn,
    pub(crate) group_end: ffi::GroupFn,
    pub(crate) send: ffi::SendFn,
    pub(crate) recv: ffi::RecvFn,
    // Last: the entry points above point into it, and nothing unloads it before they are gone.
    _library: libloading::Library,
}

impl std::fmt::Debug for NcclLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLib").field("path", &self.path).field("version", &self.version).finish()
    }
}

impl NcclLib {
    /// The candidate the library was loaded from (a bare name when the dynamic loader found it).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `(major, minor, patch)` as the library reports it.
    pub fn version(&self) -> (u32, u32, u32) {
        self.version
    }

    /// A fresh unique id (rank 0 creates it and hands it to rank 1 out of band).
    pub fn unique_id(&self) -> Result<UniqueId, NcclError> {
        let mut raw = RawUniqueId { internal: [0; UNIQUE_ID_BYTES] };
        // SAFETY: `raw` is a writable ncclUniqueId-sized buffer that outlives the call.
        let rc = unsafe { (self.get_unique_id)(&mut raw) };
        self.check("ncclGetUniqueId (creating the id the two ranks meet with)", rc)?;
        Ok(UniqueId(raw.internal))
    }

    /// NCCL's description of `code`.
    pub fn error_string(&self, code: i32) -> String {
        // SAFETY: ncclGetErrorString accepts any value and returns a static NUL-terminated string
        // (checked for null anyway).
        let ptr = unsafe { (self.get_error_string)(code) };
        if ptr.is_null() {
            return format!("unknown NCCL result {code}");
        }
        // SAFETY: non-null, NUL-terminated and static, per NCCL's API.
        unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
    }

    /// `Ok` for `ncclSuccess`; otherwise a [`NcclError::Call`] saying what was being done.
    pub(crate) fn check(&self, what: &str, rc: NcclResult) -> Result<(), NcclError> {
        if rc == NCCL_SUCCESS {
            Ok(())
        } else {
            Err(NcclError::Call { what: what.to_owned(), code: rc, msg: self.error_string(rc) })
        }
    }
}

/// The process's NCCL library, loaded on the first call from the first of
/// [`library_candidates`] (with the process's environment) that works. The outcome, failure
/// included, is kept for the life of the process.
pub fn load() -> Result<&'static NcclLib, NcclError> {
    static LIB: OnceLock<Result<NcclLib, NcclError>> = OnceLock::new();
    LIB.get_or_init(|| {
        let env = |k: &str| std::env::var(k).ok();
        load_from(&library_candidates(&env))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Loads the first of `candidates` that opens. One that opens but lacks a symbol is an error at
/// once: it is a broken or foreign library under NCCL's name, which an operator should fix.
pub(crate) fn load_from(candidates: &[PathBuf]) -> Result<NcclLib, NcclError> {
    let mut tried = Vec::new();
    for candidate in candidates {
        let Some(name) = candidate.to_str() else {
            tried.push(format!("{} (path is not UTF-8)", candidate.display()));
            continue;
        };
        // SAFETY: loading runs the library's initialisers; the candidates are files named as
        // NCCL (or the file the operator named), whose initialisers have no preconditions.
        match unsafe { libloading::Library::new(name) } {
            Ok(library) => return resolve(name, library),
            Err(e) => tried.push(format!("{name} ({})", chain(&e))),
        }
    }
    Err(NcclError::Missing { tried, hint: HINT.to_owned() })
}

/// An error and its sources on one line (libloading's own message is only "dlopen failed"; the
/// loader's reason is its source).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        next = cause.source();
    }
    out
}

fn resolve(path: &str, library: libloading::Library) -> Result<NcclLib, NcclError> {
    fn get<T: Copy>(library: &libloading::Library, path: &str, name: &str) -> Result<T, NcclError> {
        // SAFETY: every `T` requested below is the C signature NCCL 2.x declares for `name`
        // (ffi.rs); the pointer is used only while the library stays loaded (NcclLib owns it).
        match unsafe { library.get::<T>(name) } {
            Ok(sym) => Ok(*sym),
            Err(e) => Err(NcclError::Symbol { path: path.to_owned(), name: name.to_owned(), msg: chain(&e) }),
        }
    }
    let get_version: ffi::GetVersionFn = get(&library, path, "ncclGetVersion")?;
    let lib = NcclLib {
        path: path.to_owned(),
        version: (0, 0, 0),
        get_unique_id: get(&library, path, "ncclGetUniqueId")?,
        comm_init_rank: get(&library, path, "ncclCommInitRank")?,
        comm_abort: get(&library, path, "ncclCommAbort")?,
        comm_get_async_error: get(&library, path, "ncclCommGetAsyncError")?,
        get_error_string: get(&library, path, "ncclGetErrorString")?,
        group_start: get(&library, path, "ncclGroupStart")?,
        group_end: get(&library, path, "ncclGroupEnd")?,
        send: get(&library, path, "ncclSend")?,
        recv: get(&library, path, "ncclRecv")?,
        _library: library,
    };
    let mut code: c_int = 0;
    // SAFETY: writes one int into `code`, which outlives the call.
    let rc = unsafe { get_version(&mut code) };
    lib.check(&format!("ncclGetVersion of {path}"), rc)?;
    Ok(NcclLib { version: decode_version(code), ..lib })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A fresh empty directory under the system's temporary directory.
    fn scratch(name: &str) -> PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tandem-nccl-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn touch(path: &Path) -> PathBuf {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"not a library").unwrap();
        path.to_owned()
    }

    fn env_of(vars: &[(&str, String)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn candidates_follow_the_documented_order() {
        let t = scratch("order");
        let ld1 = t.join("ld1");
        let ld2 = t.join("ld2");
        let ld1_so2 = touch(&ld1.join("libnccl.so.2"));
        let ld1_so = touch(&ld1.join("libnccl.so"));
        let ld2_so = touch(&ld2.join("libnccl.so"));
        std::fs::create_dir_all(t.join("ld-empty")).unwrap();
        let venv = t.join("venv");
        let wheel = "nvidia/nccl/lib/libnccl.so.2";
        let venv312 = touch(&venv.join("lib/python3.12/site-packages").join(wheel));
        let venv39 = touch(&venv.join("lib/python3.9/site-packages").join(wheel));
        let conda = touch(&t.join("conda/lib/python3.11/site-packages").join(wheel));
        let pp = touch(&t.join("pp").join(wheel));
        let home = touch(&t.join("home/.local/lib/python3.10/site-packages").join(wheel));
        let root = t.join("root");
        let usr_local = touch(&root.join("usr/local/lib/python3.12/dist-packages").join(wheel));
        let usr_lib = touch(&root.join("usr/lib/python3/dist-packages").join(wheel));
        let deb = touch(&root.join("usr/lib/x86_64-linux-gnu/libnccl.so.2"));
        let cuda_target = touch(&root.join("usr/local/cuda/targets/x86_64-linux/lib/libnccl.so.2"));
        let nccl_dir = touch(&root.join("usr/local/nccl/lib/libnccl.so"));

        let env = env_of(&[
            (
                "LD_LIBRARY_PATH",
                format!(
                    "{}::{}:{}:{}",
                    ld1.display(),
                    t.join("ld-empty").display(),
                    ld2.display(),
                    ld1.display()
                ),
            ),
            ("VIRTUAL_ENV", venv.display().to_string()),
            ("CONDA_PREFIX", t.join("conda").display().to_string()),
            ("PYTHONPATH", format!("{}:{}", t.join("pp").display(), t.join("nowhere").display())),
            ("HOME", t.join("home").display().to_string()),
        ]);
        let got = candidates_under(&env, &root);
        let want = vec![
            ld1_so2,
            ld1_so,
            ld2_so,
            venv312,
            venv39,
            conda,
            pp,
            usr_local,
            usr_lib,
            home,
            deb,
            cuda_target,
            nccl_dir,
            PathBuf::from("libnccl.so.2"),
            PathBuf::from("libnccl.so"),
        ];
        assert_eq!(got, want);
        let _ = std::fs::remove_dir_all(&t);
    }

    #[test]
    fn the_explicit_library_is_the_only_candidate() {
        let t = scratch("explicit");
        let ld = t.join("ld");
        touch(&ld.join("libnccl.so.2"));
        let env = env_of(&[
            (LIBRARY_ENV, "/opt/custom/libnccl.so.2.99".into()),
            ("LD_LIBRARY_PATH", ld.display().to_string()),
        ]);
        assert_eq!(candidates_under(&env, &t), vec![PathBuf::from("/opt/custom/libnccl.so.2.99")]);
        // Set but empty counts as unset.
        let env = env_of(&[(LIBRARY_ENV, String::new()), ("LD_LIBRARY_PATH", ld.display().to_string())]);
        assert_eq!(candidates_under(&env, &t)[0], ld.join("libnccl.so.2"));
        let _ = std::fs::remove_dir_all(&t);
    }

    #[test]
    fn an_empty_environment_leaves_the_bare_names() {
        let t = scratch("bare");
        let got = candidates_under(&|_| None, &t);
        assert_eq!(got, vec![PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")]);
        let _ = std::fs::remove_dir_all(&t);
    }

    #[test]
    fn a_file_that_is_not_a_library_is_an_error_naming_it() {
        let t = scratch("notlib");
        let fake = touch(&t.join("libnccl.so.2"));
        let missing = t.join("absent/libnccl.so.2");
        let err = load_from(&[fake.clone(), missing.clone()]).unwrap_err();
        assert_eq!(err.kind(), "missing");
        let msg = err.to_string();
        assert!(msg.contains(&fake.display().to_string()), "{msg}");
        assert!(msg.contains(&missing.display().to_string()), "{msg}");
        assert!(msg.contains("nvidia-nccl-cu13") && msg.contains("TANDEM_NCCL_LIBRARY"), "{msg}");
        let _ = std::fs::remove_dir_all(&t);
    }

    #[test]
    fn a_library_without_the_nccl_symbols_is_a_symbol_error() {
        // libc is loadable everywhere this builds, and is not NCCL.
        let err = load_from(&[PathBuf::from("libc.so.6")]).unwrap_err();
        assert_eq!(err.kind(), "symbol", "{err}");
        assert!(err.to_string().contains("ncclGetVersion"), "{err}");
    }

    #[test]
    fn load_reports_what_it_tried_when_nccl_is_absent() {
        match load() {
            Ok(lib) => {
                let (major, _, _) = lib.version();
                assert_eq!(major, 2, "{lib:?}");
                eprintln!("NCCL present here: {lib:?}");
            }
            Err(e) => {
                assert_eq!(e.kind(), "missing", "{e}");
                assert!(e.to_string().contains("libnccl.so.2"), "{e}");
                eprintln!("{e}");
            }
        }
    }

    #[test]
    fn versions_decode_in_both_encodings() {
        assert_eq!(decode_version(22703), (2, 27, 3));
        assert_eq!(decode_version(21805), (2, 18, 5));
        assert_eq!(decode_version(20900), (2, 9, 0));
        assert_eq!(decode_version(2804), (2, 8, 4));
        assert_eq!(decode_version(2708), (2, 7, 8));
    }

    #[test]
    fn unique_id_debug_hides_the_bytes() {
        let id = UniqueId([0xab; UNIQUE_ID_BYTES]);
        let shown = format!("{id:?}");
        assert_eq!(shown, "UniqueId(..)");
        assert!(!shown.contains("171") && !shown.to_lowercase().contains("ab,"));
    }
}
