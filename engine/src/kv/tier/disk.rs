//! The disk tier's files and its I/O thread: the page file format, opening (checking, locking,
//! scanning or wiping) a tier directory, and the thread that reads and writes page files while
//! the engine thread goes on. The format is described in the [module documentation](super).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use super::state::{Job, WriteResult};
use super::{Page, Shared};
use crate::kv::{checksum, BlockHash, KvError};

/// First bytes of a page file.
pub(super) const MAGIC: [u8; 8] = *b"TNDMKVP\0";
/// Version of the page file header.
pub(super) const VERSION: u32 = 1;
/// Bytes before the payload: magic, version, identity key, name, payload length, CRC-32.
pub(super) const HEADER_BYTES: usize = 8 + 4 + 16 + 16 + 8 + 4;

/// A page file's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub key: [u8; 16],
    pub name: BlockHash,
    pub len: u64,
    pub crc: u32,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..28].copy_from_slice(&self.key);
        b[28..44].copy_from_slice(&self.name.0.to_le_bytes());
        b[44..52].copy_from_slice(&self.len.to_le_bytes());
        b[52..56].copy_from_slice(&self.crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header, String> {
        if b[0..8] != MAGIC {
            return Err("not a KV page file (bad magic)".into());
        }
        let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(format!("page file version {version}, expected {VERSION}"));
        }
        Ok(Header {
            key: b[12..28].try_into().expect("16 bytes"),
            name: BlockHash(u128::from_le_bytes(b[28..44].try_into().expect("16 bytes"))),
            len: u64::from_le_bytes(b[44..52].try_into().expect("8 bytes")),
            crc: u32::from_le_bytes(b[52..56].try_into().expect("4 bytes")),
        })
    }

    /// Why a page file with this header is not one of ours, if it is not.
    fn mismatch(&self, key: &[u8; 16], name: BlockHash, page_bytes: usize) -> Option<String> {
        if self.key != *key {
            Some(format!("identity key {} (ours {})", hex(&self.key), hex(key)))
        } else if self.name != name {
            Some(format!("header names {:032x}", self.name.0))
        } else if self.len != page_bytes as u64 {
            Some(format!("payload of {} bytes (pages here have {page_bytes})", self.len))
        } else {
            None
        }
    }
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `<32 hex digits>.kvp`.
pub(super) fn file_name(name: BlockHash) -> String {
    format!("{:032x}.kvp", name.0)
}

fn parse_file_name(file: &str) -> Option<BlockHash> {
    let stem = file.strip_suffix(".kvp")?;
    if stem.len() != 32 || !stem.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) {
        return None;
    }
    u128::from_str_radix(stem, 16).ok().map(BlockHash)
}

/// The subdirectory of a disk directory that holds the pages of one identity.
pub(super) fn tier_dir(disk_dir: &Path, key: &[u8; 16]) -> PathBuf {
    disk_dir.join(format!("tandem-kv-{}", hex(key)))
}

/// An opened tier directory.
pub(super) struct DiskDir {
    /// `<disk_dir>/tandem-kv-<key>`.
    pub path: PathBuf,
    /// Holds the `flock` for the store's life.
    pub lock: File,
    /// Pages found (persist only), oldest first, within the capacity.
    pub found: Vec<BlockHash>,
}

fn tier_err(msg: String) -> KvError {
    KvError::Tier(msg)
}

/// Checks `disk_dir`, creates and locks our subdirectory, then indexes (`persist`) or removes the
/// page files in it. Files beyond `capacity` (oldest first) are removed.
pub(super) fn open_dir(
    disk_dir: &Path,
    capacity: u64,
    persist: bool,
    key: &[u8; 16],
    page_bytes: usize,
) -> Result<DiskDir, KvError> {
    let shown = disk_dir.display();
    match fs::metadata(disk_dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(tier_err(format!("--kv-disk-dir {shown}: no such directory")))
        }
        Err(e) => return Err(tier_err(format!("--kv-disk-dir {shown}: {e}"))),
        Ok(m) if !m.is_dir() => return Err(tier_err(format!("--kv-disk-dir {shown}: not a directory"))),
        Ok(_) => {}
    }
    let path = tier_dir(disk_dir, key);
    fs::create_dir_all(&path).map_err(|e| {
        tier_err(format!("--kv-disk-dir {shown}: not writable (cannot create {}: {e})", path.display()))
    })?;
    // The subdirectory may be left from an earlier run while the disk turned read-only since.
    let probe = path.join(format!(".probe-{}", std::process::id()));
    File::create(&probe).map_err(|e| {
        tier_err(format!("--kv-disk-dir {shown}: not writable (cannot create {}: {e})", probe.display()))
    })?;
    let _ = fs::remove_file(&probe);
    let lock_path = path.join("lock");
    let lock =
        OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&lock_path).map_err(
            |e| tier_err(format!("--kv-disk-dir {shown}: cannot open {}: {e}", lock_path.display())),
        )?;
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = io::Error::last_os_error();
        return Err(tier_err(if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            format!("--kv-disk-dir {shown}: {} is in use by another worker", path.display())
        } else {
            format!("--kv-disk-dir {shown}: cannot lock {}: {e}", lock_path.display())
        }));
    }
    let found = if persist { scan(&path, key, page_bytes, capacity)? } else { wipe(&path)? };
    Ok(DiskDir { path, lock, found })
}

fn list(dir: &Path) -> Result<Vec<(String, PathBuf)>, KvError> {
    let entries =
        fs::read_dir(dir).map_err(|e| tier_err(format!("cannot list the KV tier {}: {e}", dir.display())))?;
    Ok(entries.flatten().filter_map(|e| Some((e.file_name().into_string().ok()?, e.path()))).collect())
}

/// `persist = false`: every page file and leftover goes.
fn wipe(dir: &Path) -> Result<Vec<BlockHash>, KvError> {
    let mut removed = 0usize;
    for (file, path) in list(dir)? {
        if (file.ends_with(".kvp") || file.ends_with(".tmp")) && fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(dir = %dir.display(), removed, "KV disk tier: removed the pages of an earlier run");
    }
    Ok(Vec::new())
}

/// Why the file at `path`, named `name`, is not a page of ours (payload not checked).
fn inspect(path: &Path, name: BlockHash, key: &[u8; 16], page_bytes: usize) -> Result<SystemTime, String> {
    let mut f = File::open(path).map_err(|e| e.to_string())?;
    let meta = f.metadata().map_err(|e| e.to_string())?;
    let mut b = [0u8; HEADER_BYTES];
    f.read_exact(&mut b).map_err(|_| "shorter than a header".to_string())?;
    let h = Header::decode(&b)?;
    if let Some(why) = h.mismatch(key, name, page_bytes) {
        return Err(why);
    }
    if meta.len() != HEADER_BYTES as u64 + h.len {
        return Err(format!("{} bytes, expected {}", meta.len(), HEADER_BYTES as u64 + h.len));
    }
    Ok(meta.modified().unwrap_or(SystemTime::UNIX_EPOCH))
}

/// `persist = true`: indexes well-formed pages, removes the rest and any `.tmp` leftover.
fn scan(dir: &Path, key: &[u8; 16], page_bytes: usize, capacity: u64) -> Result<Vec<BlockHash>, KvError> {
    let mut found = Vec::new();
    let (mut removed, mut example) = (0usize, None);
    for (file, path) in list(dir)? {
        let verdict = if file.ends_with(".tmp") {
            Err("an unfinished write".to_string())
        } else if file.ends_with(".kvp") {
            match parse_file_name(&file) {
                Some(name) => inspect(&path, name, key, page_bytes).map(|mtime| (mtime, name)),
                None => Err("not named by a page hash".to_string()),
            }
        } else {
            continue;
        };
        match verdict {
            Ok(page) => found.push(page),
            Err(why) => {
                if fs::remove_file(&path).is_ok() {
                    removed += 1;
                    example.get_or_insert_with(|| format!("{file}: {why}"));
                }
            }
        }
    }
    if removed > 0 {
        let example = example.unwrap_or_default();
        tracing::warn!(dir = %dir.display(), removed, example, "KV disk tier: removed unusable page files");
    }
    found.sort();
    let fit = (capacity / page_bytes as u64) as usize;
    let over = found.len().saturating_sub(fit);
    for &(_, name) in &found[..over] {
        let _ = fs::remove_file(dir.join(file_name(name)));
    }
    if over > 0 {
        tracing::info!(dir = %dir.display(), removed = over, "KV disk tier: removed the oldest pages beyond --kv-disk-bytes");
    }
    let found: Vec<BlockHash> = found[over..].iter().map(|&(_, n)| n).collect();
    tracing::info!(dir = %dir.display(), pages = found.len(), "KV disk tier: pages of earlier runs indexed");
    Ok(found)
}

/// Reads and verifies the page `name` (header, length, payload CRC-32). Marks the file used
/// (its modification time orders the pages when the tier is opened again).
pub(super) fn read_page(
    path: &Path,
    key: &[u8; 16],
    name: BlockHash,
    page_bytes: usize,
    mut payload: Page,
) -> Result<Page, String> {
    let mut f = File::open(path).map_err(|e| e.to_string())?;
    let mut b = [0u8; HEADER_BYTES];
    f.read_exact(&mut b).map_err(|e| format!("header: {e}"))?;
    let h = Header::decode(&b)?;
    if let Some(why) = h.mismatch(key, name, page_bytes) {
        return Err(why);
    }
    if payload.len() != page_bytes {
        return Err(format!("a buffer of {} bytes for a page of {page_bytes}", payload.len()));
    }
    f.read_exact(&mut payload).map_err(|e| format!("payload: {e}"))?;
    if f.read(&mut [0u8; 1]).map_err(|e| e.to_string())? != 0 {
        return Err("longer than its header says".into());
    }
    let crc = checksum::update(0, &payload);
    if crc != h.crc {
        return Err(format!("payload CRC-32 {crc:08x}, header says {:08x}", h.crc));
    }
    let _ = f.set_modified(SystemTime::now());
    Ok(payload)
}

/// Writes the page to `<name>.tmp` and renames it to `<name>.kvp`; the `.tmp` goes on failure.
pub(super) fn write_page(
    dir: &Path,
    key: &[u8; 16],
    name: BlockHash,
    bytes: &[u8],
    crc: u32,
) -> io::Result<()> {
    let tmp = dir.join(format!("{:032x}.tmp", name.0));
    let header = Header { key: *key, name, len: bytes.len() as u64, crc }.encode();
    let written = File::create(&tmp).and_then(|mut f| {
        f.write_all(&header)?;
        f.write_all(bytes)
    });
    let result = written.and_then(|()| fs::rename(&tmp, dir.join(file_name(name))));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Bytes the file system holding `dir` has free for this process (`statvfs`: available blocks
/// times the fragment size); `None` where it cannot say.
pub(super) fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` a writable statvfs the call fills on success.
    if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// The I/O thread: reads before writes, never holding the state's lock during I/O. Returns once
/// the store is dropped and the queued writes are done (or the shutdown deadline passed).
pub(super) fn io_thread(shared: Arc<Shared>) {
    let dir = shared.dir.clone().expect("the I/O thread runs for a disk tier");
    let (key, page_bytes) = (shared.key, shared.page_bytes);
    loop {
        let job = {
            let mut st = shared.lock();
            loop {
                let done_before = st.reads_done;
                let job = st.next_job(Instant::now());
                if st.reads_done != done_before || st.writes_idle() {
                    shared.done.notify_all();
                }
                match (job, st.shutdown_deadline) {
                    (Some(job), _) => break job,
                    (None, Some(deadline)) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        st = shared.work.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
                    }
                    (None, None) => st = shared.work.wait(st).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        match job {
            Job::Stop => {
                shared.lock().stopped = true;
                shared.done.notify_all();
                return;
            }
            Job::Read(name) => {
                let path = dir.join(file_name(name));
                let start = Instant::now();
                let read = read_page(&path, &key, name, page_bytes, shared.page());
                let secs = start.elapsed().as_secs_f64();
                if let Err(why) = &read {
                    tracing::warn!(path = %path.display(), why, "KV disk tier: page rejected at read; removed");
                }
                let page: Option<Arc<Page>> = read.ok().map(Arc::new);
                let delete = shared.lock().read_done(name, page, secs);
                if let Some(name) = delete {
                    let _ = fs::remove_file(dir.join(file_name(name)));
                }
                shared.lock().read_finished(name);
                shared.done.notify_all();
            }
            Job::Write(name, bytes, crc) => {
                let now = Instant::now();
                if shared.lock().regrow_due(now) {
                    let free = shared.lock().free_bytes.or_else(|| free_bytes(&dir));
                    let grown = free.and_then(|f| shared.lock().regrow(f, now));
                    if let Some((from, to)) = grown {
                        tracing::info!(
                            dir = %dir.display(),
                            from_bytes = from,
                            to_bytes = to,
                            "KV disk tier: the file system has room again; the tier grows back"
                        );
                    }
                }
                let result = if checksum::update(0, &bytes) != crc {
                    tracing::warn!(
                        name = %format!("{:032x}", name.0),
                        "KV disk tier: page spilled with a checksum that does not match its bytes; not written"
                    );
                    WriteResult::Rejected
                } else {
                    let full = {
                        let mut st = shared.lock();
                        let f = st.fail_full > 0;
                        st.fail_full = st.fail_full.saturating_sub(1);
                        f
                    };
                    let written = if full {
                        Err(io::Error::from(io::ErrorKind::StorageFull))
                    } else {
                        write_page(&dir, &key, name, &bytes, crc)
                    };
                    match written {
                        Ok(()) => WriteResult::Written,
                        // ENOSPC, or EDQUOT (122 on Linux: a quota is a full disk for this tier).
                        Err(e) if e.kind() == io::ErrorKind::StorageFull || e.raw_os_error() == Some(122) => {
                            WriteResult::Full(e.to_string())
                        }
                        Err(e) => WriteResult::Failed(e.to_string()),
                    }
                };
                drop(bytes);
                let out = shared.lock().write_done(name, result, Instant::now());
                if let Some((from, to)) = out.shrunk {
                    tracing::warn!(
                        dir = %dir.display(),
                        from_bytes = from,
                        to_bytes = to,
                        "KV disk tier: the file system is full; the tier shrinks to what it holds, less a page, \
                         and goes on (it grows back as the file system frees room)"
                    );
                }
                if let Some((dropped, error)) = &out.paused {
                    tracing::warn!(
                        dir = %dir.display(),
                        error,
                        dropped_queued = dropped,
                        backoff_s = super::state::WRITE_BACKOFF.as_secs(),
                        "KV disk tier: a page write failed; no page is written to disk for a while"
                    );
                }
                for name in out.delete {
                    if let Err(e) = fs::remove_file(dir.join(file_name(name))) {
                        tracing::debug!(error = %e, "KV disk tier: cannot remove an evicted page");
                    }
                }
                shared.lock().write_finished();
                shared.done.notify_all();
            }
        }
    }
}
