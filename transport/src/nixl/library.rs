//! Loading NIXL's C API (`libnixl_capi.so`) at run time, and the few calls the nixl kind makes,
//! wrapped so that every handle is released exactly once and every failure is a [`NixlError`].
//!
//! Why libloading and not the `nixl-sys` crate: that crate's build script runs bindgen in every
//! mode, so the default build would need libclang, and without the library its first call
//! aborts the process. The functions bound here are the ones `nixl-sys` declares, with the same
//! C signatures; a library that lacks any of them is refused by name.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use super::NixlError;

/// The NIXL release this build is tested with (the wheel `scripts/fetch-nixl.sh` installs).
pub const PINNED_VERSION: &str = "1.5.1";
/// Environment variable naming the directory that holds `libnixl_capi.so`.
pub const LIBRARY_ENV: &str = "TANDEM_NIXL_LIB";
/// The C API's file name.
pub const CAPI: &str = "libnixl_capi.so";
/// File `scripts/fetch-nixl.sh` writes beside the library: the installed release.
pub const VERSION_FILE: &str = "NIXL_VERSION";

const HINT: &str = "run scripts/fetch-nixl.sh (it installs the pinned nixl-cu12 wheel's libraries without \
    torch and prints their directory), then pass that directory with --nixl-lib or TANDEM_NIXL_LIB";

const SUCCESS: c_int = 0;
const IN_PROG: c_int = 1;
/// `nixl_capi_mem_type_t`: host memory.
pub const MEM_DRAM: c_int = 0;
/// `nixl_capi_xfer_op_t`: write local descriptors into remote ones.
const OP_WRITE: c_int = 1;

type Handle = *mut c_void;

/// `nixl_capi_agent_config_t`.
#[repr(C)]
struct AgentConfig {
    enable_prog_thread: bool,
    enable_listen_thread: bool,
    listen_port: c_int,
    thread_sync: c_int,
    num_workers: u32,
    pthr_delay_us: u64,
    lthr_delay_us: u64,
    capture_telemetry: bool,
}

/// How long NIXL's progress thread waits between rounds when nothing wakes it. NIXL's own
/// default, 0, makes the thread spin: a core per worker, taken from the engine.
const PROGRESS_DELAY_US: u64 = 1000;

/// `nixl_capi_create_xfer_req(agent, op, local, remote, remote_agent, out, opt_args)`.
type CreateXferReq =
    unsafe extern "C" fn(Handle, c_int, Handle, Handle, *const c_char, *mut Handle, Handle) -> c_int;

/// The C API's entry points this module calls.
struct Fns {
    is_stub: unsafe extern "C" fn() -> bool,
    create_configured_agent: unsafe extern "C" fn(*const c_char, *const AgentConfig, *mut Handle) -> c_int,
    destroy_agent: unsafe extern "C" fn(Handle) -> c_int,
    get_available_plugins: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    string_list_size: unsafe extern "C" fn(Handle, *mut usize) -> c_int,
    string_list_get: unsafe extern "C" fn(Handle, usize, *mut *const c_char) -> c_int,
    destroy_string_list: unsafe extern "C" fn(Handle) -> c_int,
    get_plugin_params: unsafe extern "C" fn(Handle, *const c_char, *mut Handle, *mut Handle) -> c_int,
    destroy_mem_list: unsafe extern "C" fn(Handle) -> c_int,
    destroy_params: unsafe extern "C" fn(Handle) -> c_int,
    create_backend: unsafe extern "C" fn(Handle, *const c_char, Handle, *mut Handle) -> c_int,
    destroy_backend: unsafe extern "C" fn(Handle) -> c_int,
    get_local_md: unsafe extern "C" fn(Handle, *mut *mut c_void, *mut usize) -> c_int,
    load_remote_md: unsafe extern "C" fn(Handle, *const c_void, usize, *mut *mut c_char) -> c_int,
    invalidate_remote_md: unsafe extern "C" fn(Handle, *const c_char) -> c_int,
    create_reg_dlist: unsafe extern "C" fn(c_int, *mut Handle) -> c_int,
    reg_dlist_add_desc: unsafe extern "C" fn(Handle, usize, usize, u64, *const c_void, usize) -> c_int,
    destroy_reg_dlist: unsafe extern "C" fn(Handle) -> c_int,
    register_mem: unsafe extern "C" fn(Handle, Handle, Handle) -> c_int,
    deregister_mem: unsafe extern "C" fn(Handle, Handle, Handle) -> c_int,
    create_xfer_dlist: unsafe extern "C" fn(c_int, *mut Handle) -> c_int,
    xfer_dlist_add_desc: unsafe extern "C" fn(Handle, usize, usize, u64) -> c_int,
    destroy_xfer_dlist: unsafe extern "C" fn(Handle) -> c_int,
    create_xfer_req: CreateXferReq,
    post_xfer_req: unsafe extern "C" fn(Handle, Handle, Handle) -> c_int,
    get_xfer_status: unsafe extern "C" fn(Handle, Handle) -> c_int,
    release_xfer_req: unsafe extern "C" fn(Handle, Handle) -> c_int,
    destroy_xfer_req: unsafe extern "C" fn(Handle) -> c_int,
}

/// A loaded C API. Kept for the life of the process (the library is never unloaded: UCX keeps
/// threads in it).
pub struct NixlLib {
    fns: Fns,
    /// The file loaded.
    pub path: PathBuf,
    /// The release named by the `NIXL_VERSION` file beside it, if there is one.
    pub version: Option<String>,
    _lib: libloading::Library,
}

impl std::fmt::Debug for NixlLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlLib").field("path", &self.path).field("version", &self.version).finish()
    }
}

/// Where the library is looked for: `dir` (from `--nixl-lib`), else `TANDEM_NIXL_LIB`, else the
/// dynamic loader's own search for the bare file name. A directory names the file in it.
pub fn library_path(dir: Option<&Path>, env: &dyn Fn(&str) -> Option<String>) -> (PathBuf, bool) {
    match dir.map(Path::to_path_buf).or_else(|| env(LIBRARY_ENV).filter(|v| !v.is_empty()).map(PathBuf::from))
    {
        Some(d) => (d.join(CAPI), true),
        None => (PathBuf::from(CAPI), false),
    }
}

/// Loads the C API from `dir` (see [`library_path`]), once per path per process; a failure is
/// returned again to every caller with the same message.
pub fn load(dir: Option<&Path>) -> Result<Arc<NixlLib>, NixlError> {
    type Loads = Vec<(PathBuf, Result<Arc<NixlLib>, NixlError>)>;
    static LOADED: OnceLock<Mutex<Loads>> = OnceLock::new();
    let (path, explicit) = library_path(dir, &|k| std::env::var(k).ok());
    let mut cache = LOADED.get_or_init(Mutex::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, r)) = cache.iter().find(|(p, _)| *p == path) {
        return r.clone();
    }
    let r = open(&path, explicit).map(Arc::new);
    cache.push((path, r.clone()));
    r
}

fn open(path: &Path, explicit: bool) -> Result<NixlLib, NixlError> {
    if explicit && !path.exists() {
        return Err(NixlError::Missing {
            path: path.display().to_string(),
            msg: "no such file".into(),
            hint: HINT.into(),
        });
    }
    // SAFETY: loading runs the library's initializers: NIXL's and UCX's, which only set up
    // their own state.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| NixlError::Missing {
        path: path.display().to_string(),
        msg: e.to_string(),
        hint: HINT.into(),
    })?;
    let name = path.display().to_string();
    macro_rules! sym {
        ($s:literal) => {{
            // SAFETY: the symbol is looked up by its C name and given the C signature NIXL's
            // `nixl_capi.h` declares for it (the field's type).
            let f = unsafe { lib.get(concat!("nixl_capi_", $s, "\0").as_bytes()) }.map_err(|e| {
                NixlError::Symbol {
                    path: name.clone(),
                    name: concat!("nixl_capi_", $s).into(),
                    msg: e.to_string(),
                }
            })?;
            *f
        }};
    }
    let fns = Fns {
        is_stub: sym!("is_stub"),
        create_configured_agent: sym!("create_configured_agent"),
        destroy_agent: sym!("destroy_agent"),
        get_available_plugins: sym!("get_available_plugins"),
        string_list_size: sym!("string_list_size"),
        string_list_get: sym!("string_list_get"),
        destroy_string_list: sym!("destroy_string_list"),
        get_plugin_params: sym!("get_plugin_params"),
        destroy_mem_list: sym!("destroy_mem_list"),
        destroy_params: sym!("destroy_params"),
        create_backend: sym!("create_backend"),
        destroy_backend: sym!("destroy_backend"),
        get_local_md: sym!("get_local_md"),
        load_remote_md: sym!("load_remote_md"),
        invalidate_remote_md: sym!("invalidate_remote_md"),
        create_reg_dlist: sym!("create_reg_dlist"),
        reg_dlist_add_desc: sym!("reg_dlist_add_desc"),
        destroy_reg_dlist: sym!("destroy_reg_dlist"),
        register_mem: sym!("register_mem"),
        deregister_mem: sym!("deregister_mem"),
        create_xfer_dlist: sym!("create_xfer_dlist"),
        xfer_dlist_add_desc: sym!("xfer_dlist_add_desc"),
        destroy_xfer_dlist: sym!("destroy_xfer_dlist"),
        create_xfer_req: sym!("create_xfer_req"),
        post_xfer_req: sym!("post_xfer_req"),
        get_xfer_status: sym!("get_xfer_status"),
        release_xfer_req: sym!("release_xfer_req"),
        destroy_xfer_req: sym!("destroy_xfer_req"),
    };
    // SAFETY: a function of no arguments that returns a constant.
    if unsafe { (fns.is_stub)() } {
        return Err(NixlError::Missing {
            path: name,
            msg: "this is nixl-sys's stub library, not NIXL".into(),
            hint: HINT.into(),
        });
    }
    let version = path
        .parent()
        .and_then(|d| std::fs::read_to_string(d.join(VERSION_FILE)).ok())
        .map(|s| s.trim().to_owned());
    if let Some(v) = &version {
        if v != PINNED_VERSION {
            return Err(NixlError::Version { path: name, found: v.clone(), pinned: PINNED_VERSION.into() });
        }
    }
    Ok(NixlLib { fns, path: path.to_path_buf(), version, _lib: lib })
}

fn check(code: c_int, what: &str) -> Result<(), NixlError> {
    if code == SUCCESS {
        Ok(())
    } else {
        Err(NixlError::Call { what: what.into(), code })
    }
}

fn cstring(s: &str, what: &str) -> Result<CString, NixlError> {
    CString::new(s).map_err(|_| NixlError::Invalid(format!("{what} contains a NUL byte")))
}

/// One NIXL agent with one backend. Every call on it is serialized (the agent is created
/// without NIXL's own locking); NIXL's progress thread runs beside it.
pub struct Agent {
    lib: Arc<NixlLib>,
    /// The agent and backend handles, behind the lock every call takes.
    inner: Mutex<(Handle, Handle)>,
    /// The agent's name (unique per process instance).
    pub name: String,
}

// SAFETY: the handles are used only under `inner`'s lock, and NIXL's agent may be called from
// any thread.
unsafe impl Send for Agent {}
// SAFETY: as above.
unsafe impl Sync for Agent {}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("name", &self.name).finish()
    }
}

/// A registered memory region; deregistered when dropped.
pub struct Registered {
    agent: Arc<Agent>,
    /// Start address and length.
    pub addr: usize,
    pub len: usize,
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Err(e) = self.agent.reg_call(self.addr, self.len, false) {
            tracing::warn!(error = %e, "NIXL: deregistering memory failed");
        }
    }
}

/// A posted transfer. [`Agent::finish`] waits for it; dropping it unfinished releases it (which
/// aborts it where the backend can).
pub struct Request {
    agent: Arc<Agent>,
    handle: Handle,
    done: bool,
}

// SAFETY: the handle is only used through the agent's lock.
unsafe impl Send for Request {}

impl Request {
    /// `Ok(true)` once complete, `Ok(false)` while in progress.
    pub fn poll(&mut self) -> Result<bool, NixlError> {
        if self.done {
            return Ok(true);
        }
        let g = self.agent.lock();
        // SAFETY: the handles are live (held by `self` and the agent).
        let code = unsafe { (self.agent.lib.fns.get_xfer_status)(g.0, self.handle) };
        drop(g);
        match code {
            SUCCESS => {
                self.done = true;
                Ok(true)
            }
            IN_PROG => Ok(false),
            c => Err(NixlError::Call { what: "transfer status".into(), code: c }),
        }
    }

    /// Releases the request (the backend aborts it if it is still running). Err gives the
    /// request back when the backend could not: then its memory may still be read or written.
    pub fn release(mut self) -> Result<(), (Request, NixlError)> {
        match self.release_inner() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    fn release_inner(&mut self) -> Result<(), NixlError> {
        if self.handle.is_null() {
            return Ok(());
        }
        let g = self.agent.lock();
        let f = &self.agent.lib.fns;
        // SAFETY: the handles are live; after a successful release the request wrapper holds
        // nothing and is destroyed.
        let code = unsafe { (f.release_xfer_req)(g.0, self.handle) };
        if code == SUCCESS {
            // SAFETY: released above; destroyed once.
            unsafe { (f.destroy_xfer_req)(self.handle) };
            self.handle = std::ptr::null_mut();
        }
        check(code, "releasing a transfer")
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Err(e) = self.release_inner() {
            // The request, and the agent under it, are leaked on purpose: its transfer may
            // still be running.
            std::mem::forget(self.agent.clone());
            tracing::warn!(error = %e, "NIXL: a transfer could not be released");
        }
    }
}

impl Agent {
    /// Creates agent `name` with backend `backend` (e.g. `UCX`). A backend the library has no
    /// plugin for is refused, naming the plugins it has.
    pub fn new(lib: Arc<NixlLib>, name: &str, backend: &str) -> Result<Arc<Agent>, NixlError> {
        let cname = cstring(name, "agent name")?;
        let cbackend = cstring(backend, "backend name")?;
        let f = &lib.fns;
        let mut agent: Handle = std::ptr::null_mut();
        // A progress thread (the backend needs one on the side that is written, for transports
        // such as TCP that the target must progress), waiting between rounds instead of
        // spinning; no listener thread (metadata travels with the workers' registration); no
        // locking of NIXL's own (every call here holds the agent's lock).
        let cfg = AgentConfig {
            enable_prog_thread: true,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: 0,
            num_workers: 1,
            pthr_delay_us: PROGRESS_DELAY_US,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        // SAFETY: valid C string, configuration and out-pointer.
        check(unsafe { (f.create_configured_agent)(cname.as_ptr(), &cfg, &mut agent) }, "creating an agent")?;
        let destroy = |a: Handle| {
            // SAFETY: `a` was created above and is destroyed once.
            unsafe { (f.destroy_agent)(a) };
        };
        let plugins = match plugin_names(f, agent) {
            Ok(p) => p,
            Err(e) => {
                destroy(agent);
                return Err(e);
            }
        };
        if !plugins.iter().any(|p| p == backend) {
            destroy(agent);
            return Err(NixlError::Invalid(format!(
                "NIXL has no `{backend}` backend plugin here (it has: {}); check --nixl-backend",
                plugins.join(", ")
            )));
        }
        let (mut mems, mut params): (Handle, Handle) = (std::ptr::null_mut(), std::ptr::null_mut());
        let mut be: Handle = std::ptr::null_mut();
        // SAFETY: live agent, valid C string and out-pointers; the lists are destroyed once.
        let r = unsafe {
            check(
                (f.get_plugin_params)(agent, cbackend.as_ptr(), &mut mems, &mut params),
                "backend parameters",
            )
            .and_then(|()| {
                check((f.create_backend)(agent, cbackend.as_ptr(), params, &mut be), "creating the backend")
            })
        };
        // SAFETY: destroyed once, whether or not the backend was created.
        unsafe {
            if !mems.is_null() {
                (f.destroy_mem_list)(mems);
            }
            if !params.is_null() {
                (f.destroy_params)(params);
            }
        }
        if let Err(e) = r {
            destroy(agent);
            return Err(e);
        }
        Ok(Arc::new(Agent { lib, inner: Mutex::new((agent, be)), name: name.to_owned() }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Handle, Handle)> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reg_call(&self, addr: usize, len: usize, register: bool) -> Result<(), NixlError> {
        let f = &self.lib.fns;
        let g = self.lock();
        let mut list: Handle = std::ptr::null_mut();
        // SAFETY: out-pointer; the list is destroyed once below.
        check(unsafe { (f.create_reg_dlist)(MEM_DRAM, &mut list) }, "creating a registration list")?;
        // SAFETY: live list and agent; the caller owns the memory range.
        let r = unsafe {
            check((f.reg_dlist_add_desc)(list, addr, len, 0, std::ptr::null(), 0), "describing memory")
                .and_then(|()| {
                    if register {
                        check((f.register_mem)(g.0, list, std::ptr::null_mut()), "registering memory")
                    } else {
                        check((f.deregister_mem)(g.0, list, std::ptr::null_mut()), "deregistering memory")
                    }
                })
        };
        // SAFETY: created above.
        unsafe { (f.destroy_reg_dlist)(list) };
        r
    }

    /// Registers `len` bytes of host memory at `addr` with the backend.
    ///
    /// # Safety
    /// The range stays allocated until the returned guard is dropped, and whoever may write it
    /// through NIXL (a peer given this agent's metadata) writes only what its owner allows.
    pub unsafe fn register(self: &Arc<Self>, addr: usize, len: usize) -> Result<Registered, NixlError> {
        self.reg_call(addr, len, true)?;
        Ok(Registered { agent: self.clone(), addr, len })
    }

    /// This agent's metadata (its name, the backend's connection information and its
    /// registered memory), for a peer's [`Agent::load_remote`].
    pub fn local_metadata(&self) -> Result<Vec<u8>, NixlError> {
        let g = self.lock();
        let (mut data, mut len): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: live agent and out-pointers; the blob is malloc'd by the library and freed
        // here once copied.
        unsafe {
            check((self.lib.fns.get_local_md)(g.0, &mut data, &mut len), "reading local metadata")?;
            if data.is_null() {
                return Err(NixlError::Invalid("NIXL returned no local metadata".into()));
            }
            let out = std::slice::from_raw_parts(data as *const u8, len).to_vec();
            libc::free(data);
            Ok(out)
        }
    }

    /// Loads a peer's metadata; returns the peer agent's name.
    pub fn load_remote(&self, md: &[u8]) -> Result<String, NixlError> {
        if md.is_empty() {
            return Err(NixlError::Invalid("empty agent metadata".into()));
        }
        let g = self.lock();
        let mut name: *mut c_char = std::ptr::null_mut();
        // SAFETY: live agent, a valid byte range and an out-pointer; the name is strdup'd by
        // the library and freed here once copied.
        unsafe {
            check(
                (self.lib.fns.load_remote_md)(g.0, md.as_ptr().cast(), md.len(), &mut name),
                "loading peer metadata",
            )?;
            let out = CStr::from_ptr(name).to_string_lossy().into_owned();
            libc::free(name.cast());
            Ok(out)
        }
    }

    /// Forgets a peer's metadata (and the backend's connection to it).
    pub fn invalidate_remote(&self, peer: &str) {
        let Ok(c) = cstring(peer, "peer name") else { return };
        let g = self.lock();
        // SAFETY: live agent and a valid C string.
        let code = unsafe { (self.lib.fns.invalidate_remote_md)(g.0, c.as_ptr()) };
        if code != SUCCESS {
            tracing::debug!(peer, code, "NIXL: invalidating peer metadata failed (not loaded?)");
        }
    }

    /// Posts one WRITE of `pieces` (`(local address, remote address, length)`, local memory
    /// registered with this agent, remote memory registered by `peer`).
    pub fn write(
        self: &Arc<Self>,
        peer: &str,
        pieces: &[(usize, usize, usize)],
    ) -> Result<Request, NixlError> {
        let f = &self.lib.fns;
        let cpeer = cstring(peer, "peer name")?;
        let g = self.lock();
        let (mut local, mut remote): (Handle, Handle) = (std::ptr::null_mut(), std::ptr::null_mut());
        let mut req: Handle = std::ptr::null_mut();
        // SAFETY: out-pointers, live lists and agent; the lists are destroyed once below (the
        // request keeps its own copy of the descriptors).
        let r = unsafe {
            check((f.create_xfer_dlist)(MEM_DRAM, &mut local), "creating a descriptor list")
                .and_then(|()| {
                    check((f.create_xfer_dlist)(MEM_DRAM, &mut remote), "creating a descriptor list")
                })
                .and_then(|()| {
                    for &(l, r, n) in pieces {
                        check((f.xfer_dlist_add_desc)(local, l, n, 0), "adding a local descriptor")?;
                        check((f.xfer_dlist_add_desc)(remote, r, n, 0), "adding a remote descriptor")?;
                    }
                    Ok(())
                })
                .and_then(|()| {
                    check(
                        (f.create_xfer_req)(
                            g.0,
                            OP_WRITE,
                            local,
                            remote,
                            cpeer.as_ptr(),
                            &mut req,
                            std::ptr::null_mut(),
                        ),
                        "preparing a transfer (is the peer's metadata loaded, and its memory registered?)",
                    )
                })
        };
        // SAFETY: created above (or null), destroyed once.
        unsafe {
            if !local.is_null() {
                (f.destroy_xfer_dlist)(local);
            }
            if !remote.is_null() {
                (f.destroy_xfer_dlist)(remote);
            }
        }
        r?;
        let mut request = Request { agent: self.clone(), handle: req, done: false };
        // SAFETY: live agent and request.
        let code = unsafe { (f.post_xfer_req)(g.0, req, std::ptr::null_mut()) };
        drop(g);
        match code {
            SUCCESS => request.done = true,
            IN_PROG => {}
            c => return Err(NixlError::Call { what: "posting a transfer".into(), code: c }),
        }
        Ok(request)
    }
}

fn plugin_names(f: &Fns, agent: Handle) -> Result<Vec<String>, NixlError> {
    let mut list: Handle = std::ptr::null_mut();
    // SAFETY: live agent and out-pointer; the list is destroyed once below.
    unsafe {
        check((f.get_available_plugins)(agent, &mut list), "listing backend plugins")?;
        let mut n = 0usize;
        let mut out = Vec::new();
        if (f.string_list_size)(list, &mut n) == SUCCESS {
            for i in 0..n {
                let mut s: *const c_char = std::ptr::null();
                if (f.string_list_get)(list, i, &mut s) == SUCCESS && !s.is_null() {
                    out.push(CStr::from_ptr(s).to_string_lossy().into_owned());
                }
            }
        }
        (f.destroy_string_list)(list);
        out.sort();
        Ok(out)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let g = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        let f = &self.lib.fns;
        // SAFETY: the last reference is gone (requests and registrations hold an `Arc`), so
        // nothing else uses the handles; each is destroyed once.
        unsafe {
            (f.destroy_backend)(g.1);
            (f.destroy_agent)(g.0);
        }
    }
}
