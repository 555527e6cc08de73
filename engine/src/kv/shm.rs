//! The memory behind a KV pool: private heap memory, or a shared-memory segment that another
//! process (a prefill worker on the same host) maps to write blocks straight into the pool.
//!
//! Both kinds hold the same bytes in the same order (the layout named by [`KvLayout::name`]): per
//! layer `l`, the K tensor at element `2 * l * layer_elems` and the V tensor right after it, each
//! `[num_blocks, block_size, num_kv_heads, head_dim]` of little-endian values of the layout's
//! dtype (f32, f16, bf16 or fp8; offsets here count elements of that dtype).
//!
//! # Segment file
//! A segment is a file created as `tandem-kv-<owner pid>-<16 hex digits>` in [`segment_dir`]
//! (`/dev/shm`, else the temporary directory), mapped `MAP_SHARED`. Once it is set up its name is
//! unlinked and peers open it as `/proc/<owner pid>/fd/<fd>` ([`KvMemory::segment_path`]), so a
//! process killed by SIGKILL leaves nothing in the directory. It starts with a header page of
//! [`SEGMENT_HEADER_BYTES`] bytes (all integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `TNDMKVSG` |
//! | 8 | 4 | header version (1) |
//! | 12 | 4 | header size = offset of the data (4096) |
//! | 16 | 8 × 5 | num_layers, num_blocks, block_size, num_kv_heads, head_dim |
//! | 56 | 4 | pid of the owner |
//! | 64 | 32 | layout name, NUL-padded (`tandem-f32-lkv-v1`, `tandem-f16-lkv-v1` or `tandem-bf16-lkv-v1`: the dtype) |
//!
//! followed by the data. The owner holds an exclusive `flock` on the file for its lifetime. Where
//! `/proc` cannot name the descriptor, the name stays until the memory is dropped; a process that
//! dies without cleaning up (SIGKILL) then leaves a file whose lock is gone and whose pid is dead,
//! and the next segment created in the same directory removes it ([`remove_stale_segments`], which
//! also clears files left by older builds). Space for the whole segment is
//! allocated when it is created, so a too-small `/dev/shm` is a clear error at start-up rather
//! than a SIGBUS on the first write.
//!
//! # Concurrency
//! The memory is reached through raw pointers only. The engine thread reads and writes blocks of
//! its sequences; a transfer receiver (another thread) or a prefill worker (another process)
//! writes blocks of a *reservation*, which no sequence holds until the transfer completes. The
//! callers of the `unsafe` accessors below promise that disjointness.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use memmap2::{MmapOptions, MmapRaw};

use super::allocator::BlockId;
use super::checksum;
use super::dtype::KvDtype;
use super::layout::KvLayout;
use super::KvError;

// Block bytes are native-endian values on the wire and in segments; the layout name promises
// little-endian.
const _: () = assert!(cfg!(target_endian = "little"), "the KV layout is little-endian");

/// File-name prefix of KV segments.
pub const SEGMENT_PREFIX: &str = "tandem-kv-";
/// First bytes of a segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"TNDMKVSG";
/// Version of the segment header.
pub const SEGMENT_HEADER_VERSION: u32 = 1;
/// Bytes before the data (one page, so the data is page-aligned).
pub const SEGMENT_HEADER_BYTES: usize = 4096;
const NAME_OFFSET: usize = 64;
const NAME_BYTES: usize = 32;

/// Where KV segments are created: `/dev/shm` when it exists, else [`std::env::temp_dir`].
pub fn segment_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// The pool memory: a zeroed region of `2 * num_layers * layer_elems` values of the layout's dtype.
pub struct KvMemory {
    layout: KvLayout,
    /// First byte of the data (page-aligned for segments, 64-byte aligned on the heap).
    base: NonNull<u8>,
    /// Elements in the data.
    elems: usize,
    backing: Backing,
}

enum Backing {
    /// From `std::alloc::alloc_zeroed` with this layout (`None`: zero bytes, nothing allocated).
    Heap(Option<std::alloc::Layout>),
    Shm(Segment),
}

struct Segment {
    /// Keeps the mapping alive; `base` points into it.
    _map: MmapRaw,
    /// What peers open: `/proc/<owner pid>/fd/<fd>` once the name is unlinked, else the file.
    path: PathBuf,
    /// The file still has its name in the segment directory (removed on drop by the owner).
    linked: bool,
    /// Open for the lifetime of the memory; the owner holds the `flock` through it.
    _file: File,
    /// Device and inode of the file when it was opened (a path can be reused by another segment).
    id: (u64, u64),
    /// Created (and unlinked on drop) by this process.
    owner: bool,
}

// SAFETY: `KvMemory` owns its allocation or mapping (the pointer never aliases memory owned by
// anything else in this process) and hands it out only through `unsafe` accessors whose callers
// promise that no two threads touch the same block at once with one of them writing.
unsafe impl Send for KvMemory {}
// SAFETY: as for `Send`; shared references only give access through those same accessors.
unsafe impl Sync for KvMemory {}

impl std::fmt::Debug for KvMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("KvMemory");
        d.field("layout", &self.layout);
        match &self.backing {
            Backing::Heap(_) => d.field("backing", &"heap"),
            Backing::Shm(s) => d.field("segment", &s.path).field("owner", &s.owner),
        };
        d.finish()
    }
}

fn data_elems(layout: &KvLayout) -> Result<usize, KvError> {
    layout.validate()?;
    layout
        .layer_elems()
        .checked_mul(2 * layout.num_layers)
        .filter(|n| {
            n.checked_mul(layout.elem_bytes()).is_some_and(|b| b.checked_add(SEGMENT_HEADER_BYTES).is_some())
        })
        .ok_or_else(|| KvError::InvalidLayout(format!("size overflows in {layout:?}")))
}

fn shm_err(path: &Path, msg: impl Into<String>) -> KvError {
    KvError::SharedMemory { path: path.to_path_buf(), msg: msg.into() }
}

impl KvMemory {
    /// Zeroed private memory.
    pub fn heap(layout: KvLayout) -> Result<KvMemory, KvError> {
        let elems = data_elems(&layout)?;
        if elems == 0 {
            return Ok(KvMemory { layout, base: NonNull::dangling(), elems, backing: Backing::Heap(None) });
        }
        let alloc = std::alloc::Layout::from_size_align(elems * layout.elem_bytes(), 64)
            .map_err(|e| KvError::InvalidLayout(format!("{layout:?}: {e}")))?;
        // SAFETY: `alloc` has a non-zero size (elems > 0).
        let p = unsafe { std::alloc::alloc_zeroed(alloc) };
        let Some(base) = NonNull::new(p) else {
            return Err(KvError::InvalidLayout(format!(
                "cannot allocate {:.2} GiB for the KV pool {layout:?}",
                (elems * layout.elem_bytes()) as f64 / (1u64 << 30) as f64
            )));
        };
        // SAFETY: the allocation is `alloc.size()` bytes long, zeroed, and ours alone.
        unsafe { prefault(base.as_ptr(), alloc.size()) };
        Ok(KvMemory { layout, base, elems, backing: Backing::Heap(Some(alloc)) })
    }

    /// A new zeroed shared-memory segment in [`segment_dir`], owned by this process.
    pub fn create_segment(layout: KvLayout) -> Result<KvMemory, KvError> {
        Self::create_segment_in(layout, &segment_dir())
    }

    /// A new zeroed shared-memory segment in `dir` (after removing stale segments there).
    pub fn create_segment_in(layout: KvLayout, dir: &Path) -> Result<KvMemory, KvError> {
        let elems = data_elems(&layout)?;
        remove_stale_segments(dir);
        let size = SEGMENT_HEADER_BYTES + elems * layout.elem_bytes();
        let path = dir.join(format!("{SEGMENT_PREFIX}{}-{:016x}", std::process::id(), rand::random::<u64>()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| shm_err(&path, format!("cannot create the KV segment: {e}")))?;
        // From here on, a failure removes the file again.
        let fail = |msg: String| {
            let _ = std::fs::remove_file(&path);
            Err(shm_err(&path, msg))
        };
        // SAFETY: flock on a file descriptor we own; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return fail(format!("cannot lock the KV segment: {}", std::io::Error::last_os_error()));
        }
        if let Some(avail) = free_bytes(dir) {
            if (size as u64) > avail {
                return fail(format!(
                    "the KV pool needs {:.2} GiB of shared memory but {} has {:.2} GiB free; enlarge it \
                     (containers: --shm-size) or lower the number of KV blocks",
                    size as f64 / GIB,
                    dir.display(),
                    avail as f64 / GIB
                ));
            }
        }
        if let Err(e) = file.set_len(size as u64) {
            return fail(format!("cannot size the KV segment to {size} bytes: {e}"));
        }
        // Reserve the pages now: on tmpfs a sparse file that cannot grow kills the process with
        // SIGBUS on first touch instead of returning an error.
        // SAFETY: posix_fallocate on a file descriptor we own; no memory is involved.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size as libc::off_t) };
        if rc != 0 && rc != libc::EOPNOTSUPP && rc != libc::EINVAL {
            return fail(format!(
                "cannot allocate {:.2} GiB of shared memory for the KV pool: {} (enlarge {} or lower the \
                 number of KV blocks)",
                size as f64 / GIB,
                std::io::Error::from_raw_os_error(rc),
                dir.display()
            ));
        }
        let map = match MmapOptions::new().map_raw(&file) {
            Ok(m) => m,
            Err(e) => return fail(format!("cannot map the KV segment: {e}")),
        };
        let meta = match file.metadata() {
            Ok(m) => m,
            Err(e) => return fail(format!("cannot stat the KV segment: {e}")),
        };
        let header = encode_header(&layout);
        // SAFETY: the mapping is `size >= SEGMENT_HEADER_BYTES` bytes long, writable, and no one
        // else can know of the file yet except a peer guessing its random name.
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), map.as_mut_ptr(), header.len()) };
        // SAFETY: the data starts SEGMENT_HEADER_BYTES into a mapping of `size` bytes; the offset
        // is in bounds and page-aligned (so aligned for every dtype).
        let base = unsafe { map.as_mut_ptr().add(SEGMENT_HEADER_BYTES) };
        let Some(base) = NonNull::new(base) else {
            return fail("the mapping returned a null pointer".into());
        };
        // SAFETY: the data is `size - SEGMENT_HEADER_BYTES` bytes of the mapping, zeroed, and no
        // peer knows of the segment yet.
        unsafe { prefault(base.as_ptr(), size - SEGMENT_HEADER_BYTES) };
        // Publish the segment by its descriptor, not by its name: with the name unlinked now,
        // nothing of this process is left in the directory when it dies, even by SIGKILL. A peer
        // (same user, same host and PID namespace) opens /proc/<pid>/fd/<fd>; the memory is freed
        // when the owner and every peer have closed it. Without /proc the name stays (and the
        // start-up sweep of a later segment removes it after a crash).
        let by_fd = PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), file.as_raw_fd()));
        let same_file =
            |p: &Path| std::fs::metadata(p).is_ok_and(|m| (m.dev(), m.ino()) == (meta.dev(), meta.ino()));
        let (published, linked) = if same_file(&by_fd) {
            match std::fs::remove_file(&path) {
                Ok(()) => (by_fd, false),
                Err(e) => return fail(format!("cannot unlink the KV segment's name: {e}")),
            }
        } else {
            (path.clone(), true)
        };
        tracing::debug!(name = %path.display(), path = %published.display(), bytes = size, "created KV segment");
        Ok(KvMemory {
            layout,
            base,
            elems,
            backing: Backing::Shm(Segment {
                _map: map,
                path: published,
                linked,
                _file: file,
                id: (meta.dev(), meta.ino()),
                owner: true,
            }),
        })
    }

    /// Maps an existing segment (a prefill worker opening a decode worker's pool). The layout is
    /// the one in the segment's header; the caller checks it against its own.
    pub fn open_segment(path: &Path) -> Result<KvMemory, KvError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| shm_err(path, format!("cannot open the KV segment: {e}")))?;
        let meta = file.metadata().map_err(|e| shm_err(path, format!("cannot stat the KV segment: {e}")))?;
        let size = meta.len();
        if size < SEGMENT_HEADER_BYTES as u64 {
            return Err(shm_err(path, format!("{size} bytes is too small for a KV segment")));
        }
        let map = MmapOptions::new()
            .map_raw(&file)
            .map_err(|e| shm_err(path, format!("cannot map the KV segment: {e}")))?;
        let mut header = [0u8; SEGMENT_HEADER_BYTES];
        // SAFETY: the mapping is at least SEGMENT_HEADER_BYTES long (checked above; the owner never
        // shrinks it) and the header is written once, before the segment's path is published.
        unsafe { std::ptr::copy_nonoverlapping(map.as_ptr(), header.as_mut_ptr(), header.len()) };
        let layout = decode_header(&header).map_err(|m| shm_err(path, m))?;
        let elems = data_elems(&layout).map_err(|e| shm_err(path, e.to_string()))?;
        let expected = (SEGMENT_HEADER_BYTES + elems * layout.elem_bytes()) as u64;
        if size != expected || map.len() as u64 != expected {
            return Err(shm_err(
                path,
                format!("segment is {size} bytes, its header describes {expected} ({layout:?})"),
            ));
        }
        // SAFETY: in bounds of the mapping (size >= SEGMENT_HEADER_BYTES) and page-aligned.
        let base = unsafe { map.as_mut_ptr().add(SEGMENT_HEADER_BYTES) };
        let base = NonNull::new(base).ok_or_else(|| shm_err(path, "the mapping returned a null pointer"))?;
        Ok(KvMemory {
            layout,
            base,
            elems,
            backing: Backing::Shm(Segment {
                _map: map,
                path: path.to_path_buf(),
                linked: true,
                _file: file,
                id: (meta.dev(), meta.ino()),
                owner: false,
            }),
        })
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The path a peer opens the segment by (`/proc/<owner pid>/fd/<fd>` for a segment this
    /// process created, where `/proc` names it; `None` for heap memory).
    pub fn segment_path(&self) -> Option<&Path> {
        match &self.backing {
            Backing::Shm(s) => Some(&s.path),
            Backing::Heap(_) => None,
        }
    }

    /// Device and inode of the segment file as it was when mapped.
    pub fn segment_id(&self) -> Option<(u64, u64)> {
        match &self.backing {
            Backing::Shm(s) => Some(s.id),
            Backing::Heap(_) => None,
        }
    }

    /// Element offset of layer `layer`'s K tensor (V follows at `+ layer_elems`).
    fn k_offset(&self, layer: usize) -> usize {
        2 * layer * self.layout.layer_elems()
    }

    fn check_layer(&self, layer: usize) -> Result<(), KvError> {
        if layer >= self.layout.num_layers {
            return Err(KvError::LayerOutOfRange { layer, num_layers: self.layout.num_layers });
        }
        Ok(())
    }

    fn check_block(&self, block: BlockId) -> Result<(), KvError> {
        if block as usize >= self.layout.num_blocks {
            return Err(KvError::BlockOutOfRange { block, num_blocks: self.layout.num_blocks });
        }
        Ok(())
    }

    /// The pool's bytes, `(address, length)`: every layer's K then V tensor, in the layout's
    /// order (after a segment's header).
    pub fn region(&self) -> (usize, usize) {
        (self.base.as_ptr() as usize, self.elems * self.layout.elem_bytes())
    }

    /// Element offsets of the K and V values of `block` in `layer`, after checking both.
    pub fn block_offsets(&self, layer: usize, block: BlockId) -> Result<(usize, usize), KvError> {
        self.check_layer(layer)?;
        self.check_block(block)?;
        let k = self.k_offset(layer) + block as usize * self.layout.block_elems();
        Ok((k, k + self.layout.layer_elems()))
    }

    /// Element offsets of the K and V tensors of `layer` (unchecked: callers check the layer).
    pub fn layer_offsets(&self, layer: usize) -> (usize, usize) {
        let k = self.k_offset(layer);
        (k, k + self.layout.layer_elems())
    }

    /// The bytes of `len` elements at element offset `off` (elements of the layout's dtype; the
    /// slice is aligned for that dtype).
    ///
    /// # Safety
    /// `off + len <= elems` (callers compute offsets from checked ids), and no other thread or
    /// process writes any of these elements while the returned slice is read.
    pub unsafe fn slice(&self, off: usize, len: usize) -> &[u8] {
        debug_assert!(off + len <= self.elems);
        let eb = self.layout.elem_bytes();
        // SAFETY: in bounds per the contract; `base` is aligned and valid for the memory's life.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(off * eb), len * eb) }
    }

    /// Mutable bytes of `len` elements at element offset `off`.
    ///
    /// # Safety
    /// `off + len <= elems`, and nothing else reads or writes these elements while the slice is
    /// alive (the caller holds the only claim on them: a `&mut` pool, or a reservation).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [u8] {
        debug_assert!(off + len <= self.elems);
        let eb = self.layout.elem_bytes();
        // SAFETY: in bounds and exclusive per the contract.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(off * eb), len * eb) }
    }

    /// Copies `len` elements from `src` to `dst` (element offsets; the ranges do not overlap).
    ///
    /// # Safety
    /// Both ranges are in bounds and disjoint, and the caller has exclusive access to `dst` and
    /// no one writes `src` meanwhile.
    pub unsafe fn copy_within(&self, src: usize, dst: usize, len: usize) {
        debug_assert!(src + len <= self.elems && dst + len <= self.elems);
        debug_assert!(src + len <= dst || dst + len <= src);
        let (p, eb) = (self.base.as_ptr(), self.layout.elem_bytes());
        // SAFETY: per the contract.
        unsafe { std::ptr::copy_nonoverlapping(p.add(src * eb), p.add(dst * eb), len * eb) };
    }

    /// The K and V bytes of one block of one layer.
    ///
    /// # Safety
    /// No one writes this block while the slices are alive.
    pub unsafe fn block_bytes(&self, layer: usize, block: BlockId) -> Result<(&[u8], &[u8]), KvError> {
        let (k, v) = self.block_offsets(layer, block)?;
        let n = self.layout.block_elems();
        // SAFETY: offsets from checked ids; the caller promises no concurrent writer.
        Ok(unsafe { (self.slice(k, n), self.slice(v, n)) })
    }

    /// Mutable K and V bytes of one block of one layer.
    ///
    /// # Safety
    /// The caller has exclusive access to this block while the slices are alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn block_bytes_mut(
        &self,
        layer: usize,
        block: BlockId,
    ) -> Result<(&mut [u8], &mut [u8]), KvError> {
        let (k, v) = self.block_offsets(layer, block)?;
        let n = self.layout.block_elems();
        // SAFETY: offsets from checked ids (K and V ranges are disjoint); exclusivity per the
        // caller's contract.
        Ok(unsafe { (self.slice_mut(k, n), self.slice_mut(v, n)) })
    }

    /// CRC-32 of one block in wire order: for every layer, its K bytes then its V bytes.
    ///
    /// # Safety
    /// No one writes this block meanwhile.
    pub unsafe fn block_checksum(&self, block: BlockId) -> Result<u32, KvError> {
        self.check_block(block)?;
        let mut sum = 0;
        for layer in 0..self.layout.num_layers {
            // SAFETY: per the caller's contract.
            let (k, v) = unsafe { self.block_bytes(layer, block)? };
            sum = checksum::update_kv(sum, k, v);
        }
        Ok(sum)
    }

    /// [`Self::block_checksum`] of each of `blocks`, reading layer by layer across all of them
    /// (consecutive block ids then make long sequential runs, which the hardware prefetches far
    /// better than one block's scattered pieces).
    ///
    /// # Safety
    /// No one writes these blocks meanwhile.
    pub unsafe fn blocks_checksums(&self, blocks: &[BlockId]) -> Result<Vec<u32>, KvError> {
        for &b in blocks {
            self.check_block(b)?;
        }
        let mut sums = vec![0u32; blocks.len()];
        for layer in 0..self.layout.num_layers {
            for (&b, sum) in blocks.iter().zip(&mut sums) {
                // SAFETY: per the caller's contract.
                let (k, v) = unsafe { self.block_bytes(layer, b)? };
                *sum = checksum::update_kv(*sum, k, v);
            }
        }
        Ok(sums)
    }
}

impl Drop for KvMemory {
    fn drop(&mut self) {
        match &self.backing {
            Backing::Heap(Some(alloc)) => {
                // SAFETY: allocated by `alloc_zeroed` with exactly this layout; dropped once.
                unsafe { std::alloc::dealloc(self.base.as_ptr().cast::<u8>(), *alloc) };
            }
            Backing::Heap(None) => {}
            Backing::Shm(s) => {
                if s.owner && s.linked {
                    match std::fs::remove_file(&s.path) {
                        Ok(()) => tracing::debug!(path = %s.path.display(), "removed KV segment"),
                        Err(e) => {
                            tracing::warn!(path = %s.path.display(), error = %e, "cannot remove KV segment")
                        }
                    }
                }
            }
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Touches every page of `len` zeroed bytes at `p` (writing the zero each already holds), so the
/// pool's memory is committed when it is created: a host short of that much memory runs out at
/// start-up (the OOM killer or swap act then; for a segment whose space `posix_fallocate` could
/// not reserve, a SIGBUS) rather than under load, and the process's resident size is the pool's
/// from the start rather than growing as the prefix cache first reaches each block.
///
/// # Safety
/// `p` is valid for writes of `len` bytes that hold zeros and that nothing else accesses now.
unsafe fn prefault(p: *mut u8, len: usize) {
    const PAGE: usize = 4096;
    for off in (0..len).step_by(PAGE) {
        // SAFETY: in bounds per the contract; a volatile write so the touch is not elided.
        unsafe { p.add(off).write_volatile(0) };
    }
}

fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` points to writable memory for one statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    // The field types differ between platforms.
    #[allow(clippy::unnecessary_cast)]
    let bytes = st.f_bavail as u64 * st.f_frsize as u64;
    Some(bytes)
}

fn encode_header(layout: &KvLayout) -> Vec<u8> {
    let mut h = vec![0u8; SEGMENT_HEADER_BYTES];
    h[0..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&SEGMENT_HEADER_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(SEGMENT_HEADER_BYTES as u32).to_le_bytes());
    let dims =
        [layout.num_layers, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim];
    for (i, d) in dims.iter().enumerate() {
        h[16 + 8 * i..24 + 8 * i].copy_from_slice(&(*d as u64).to_le_bytes());
    }
    h[56..60].copy_from_slice(&std::process::id().to_le_bytes());
    let name = layout.name().as_bytes();
    h[NAME_OFFSET..NAME_OFFSET + name.len()].copy_from_slice(name);
    h
}

fn decode_header(h: &[u8; SEGMENT_HEADER_BYTES]) -> Result<KvLayout, String> {
    if h[0..8] != SEGMENT_MAGIC {
        return Err("not a KV segment (bad magic)".into());
    }
    let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
    let version = u32_at(8);
    if version != SEGMENT_HEADER_VERSION {
        return Err(format!("segment header version {version}, this build reads {SEGMENT_HEADER_VERSION}"));
    }
    let hb = u32_at(12) as usize;
    if hb != SEGMENT_HEADER_BYTES {
        return Err(format!("segment header of {hb} bytes, expected {SEGMENT_HEADER_BYTES}"));
    }
    let name_raw = &h[NAME_OFFSET..NAME_OFFSET + NAME_BYTES];
    let name_len = name_raw.iter().position(|&b| b == 0).unwrap_or(NAME_BYTES);
    let name = String::from_utf8_lossy(&name_raw[..name_len]);
    let Some(dtype) = KvDtype::from_layout_name(&name) else {
        let known: Vec<_> = KvDtype::ALL.iter().map(|d| d.layout_name()).collect();
        return Err(format!("segment layout `{name}` is none this build reads ({})", known.join(", ")));
    };
    let mut dims = [0usize; 5];
    for (i, d) in dims.iter_mut().enumerate() {
        let o = 16 + 8 * i;
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[o..o + 8]);
        *d = usize::try_from(u64::from_le_bytes(b)).map_err(|_| "segment dimension overflows".to_string())?;
    }
    Ok(KvLayout {
        num_layers: dims[0],
        num_blocks: dims[1],
        block_size: dims[2],
        num_kv_heads: dims[3],
        head_dim: dims[4],
        dtype,
    })
}

/// Owner pid encoded in a segment file name (`tandem-kv-<pid>-<id>`, anything may follow), if
/// `name` is one.
pub fn owner_pid(name: &str) -> Option<i32> {
    let rest = name.strip_prefix(SEGMENT_PREFIX)?;
    let (pid, suffix) = rest.split_once('-')?;
    if suffix.is_empty() {
        return None;
    }
    pid.parse().ok()
}

fn pid_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks whether the process exists; nothing is delivered.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Removes KV segments in `dir` left by processes that died without cleaning up: files named
/// `tandem-kv-<pid>-…` whose pid is not running and whose lock nobody holds (the lock check
/// keeps a live owner in another pid namespace safe). Returns the removed paths. Errors are
/// logged and skipped: cleanup is best effort.
pub fn remove_stale_segments(dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return removed;
    };
    let me = std::process::id() as i32;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(owner_pid) else {
            continue;
        };
        if pid == me || pid_alive(pid) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = std::fs::OpenOptions::new().read(true).open(&path) else {
            continue;
        };
        // SAFETY: flock on a file descriptor we own; no memory is involved.
        let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        if !locked {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {
                tracing::info!(path = %path.display(), pid, "removed stale KV segment of a dead process");
                removed.push(path);
            }
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove stale KV segment"),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_blocks: 3,
            block_size: 2,
            num_kv_heads: 1,
            head_dim: 4,
            dtype: KvDtype::F32,
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

        /// Any header bytes: decoding never panics, and what it accepts names a dtype this build
        /// reads. A header with the right magic, version and name but arbitrary dimensions (what
        /// a hostile or corrupted segment file holds) opens only when the file's size is exactly
        /// what the dimensions describe, never by trusting a size that overflows.
        #[test]
        fn headers_and_segment_files_from_anyone_are_checked(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), SEGMENT_HEADER_BYTES),
            dims in proptest::array::uniform5(proptest::prelude::any::<u64>()),
            small in proptest::array::uniform5(0u64..5),
            use_small in proptest::prelude::any::<bool>(),
            extra in 0usize..64,
        ) {
            let mut a = [0u8; SEGMENT_HEADER_BYTES];
            a.copy_from_slice(&bytes);
            if let Ok(l) = decode_header(&a) {
                proptest::prop_assert!(KvDtype::ALL.contains(&l.dtype));
            }
            let mut h = encode_header(&layout());
            let dims = if use_small { small } else { dims };
            for (i, d) in dims.iter().enumerate() {
                h[16 + 8 * i..24 + 8 * i].copy_from_slice(&d.to_le_bytes());
            }
            let dir = std::env::temp_dir().join(format!("tandem-shm-fuzz-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("segment");
            let mut file = h.clone();
            file.resize(SEGMENT_HEADER_BYTES + extra * 8, 0);
            std::fs::write(&path, &file).unwrap();
            if let Ok(m) = KvMemory::open_segment(&path) {
                let l = m.layout();
                let want = SEGMENT_HEADER_BYTES + data_elems(&l).unwrap() * l.elem_bytes();
                proptest::prop_assert_eq!(want, file.len());
            }
            std::fs::remove_file(&path).unwrap();
        }
    }

    #[test]
    fn header_round_trips_and_rejects_other_files() {
        for dtype in KvDtype::ALL {
            let l = KvLayout { dtype, ..layout() };
            let h = encode_header(&l);
            let mut a = [0u8; SEGMENT_HEADER_BYTES];
            a.copy_from_slice(&h);
            assert_eq!(decode_header(&a).unwrap(), l);
            assert_eq!(&a[NAME_OFFSET..NAME_OFFSET + l.name().len()], l.name().as_bytes());
            a[NAME_OFFSET..NAME_OFFSET + NAME_BYTES].fill(0);
            a[NAME_OFFSET..NAME_OFFSET + 17].copy_from_slice(b"tandem-f64-lkv-v1");
            let e = decode_header(&a).unwrap_err();
            assert!(e.contains("tandem-f64-lkv-v1") && e.contains("tandem-bf16-lkv-v1"), "{e}");
            a[0] = b'X';
            assert!(decode_header(&a).unwrap_err().contains("magic"));
        }
    }

    #[test]
    fn a_segment_is_sized_by_its_dtype() {
        for dtype in KvDtype::ALL {
            let l = KvLayout { dtype, ..layout() };
            let own = KvMemory::create_segment(l).unwrap();
            let path = own.segment_path().unwrap().to_path_buf();
            let size = std::fs::metadata(&path).unwrap().len() as usize;
            assert_eq!(size, SEGMENT_HEADER_BYTES + 2 * l.num_layers * l.num_blocks * l.block_bytes());
            let peer = KvMemory::open_segment(&path).unwrap();
            assert_eq!(peer.layout().dtype, dtype);
        }
    }

    #[test]
    fn segment_name_parsing() {
        assert_eq!(owner_pid("tandem-kv-123-00ff"), Some(123));
        assert_eq!(owner_pid("tandem-kv-123-"), None);
        assert_eq!(owner_pid("tandem-kv-x-1"), None);
        assert_eq!(owner_pid("other-123-1"), None);
    }

    #[test]
    fn opened_segment_sees_the_owners_bytes() {
        let own = KvMemory::create_segment(layout()).unwrap();
        let path = own.segment_path().unwrap().to_path_buf();
        // SAFETY: single-threaded test; nothing else touches block 1.
        unsafe { own.block_bytes_mut(1, 2).unwrap().1.fill(7) };
        let peer = KvMemory::open_segment(&path).unwrap();
        assert_eq!(peer.layout(), layout());
        // SAFETY: as above.
        unsafe {
            assert!(peer.block_bytes(1, 2).unwrap().1.iter().all(|&b| b == 7));
            assert!(peer.block_bytes(1, 2).unwrap().0.iter().all(|&b| b == 0));
            assert_eq!(peer.block_checksum(2).unwrap(), own.block_checksum(2).unwrap());
            // The layer-by-layer group checksum agrees with the per-block one, in block order.
            let each: Vec<u32> = [2, 0, 1].iter().map(|&b| own.block_checksum(b).unwrap()).collect();
            assert_eq!(peer.blocks_checksums(&[2, 0, 1]).unwrap(), each);
            assert_ne!(each[0], each[1], "block 2 was written, block 0 was not");
            assert!(peer.blocks_checksums(&[1, 3]).is_err(), "block 3 is out of range");
        }
        drop(peer);
        let id = own.segment_id().unwrap();
        let file_id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
        assert_eq!(file_id(&path), Some(id));
        drop(own);
        // The descriptor is closed: the path names nothing, or (its number reused) another file.
        assert_ne!(file_id(&path), Some(id));
    }

    #[test]
    fn a_segment_leaves_no_name_behind() {
        let dir = std::env::temp_dir().join(format!("tandem-shm-names-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let own = KvMemory::create_segment_in(layout(), &dir).unwrap();
        let path = own.segment_path().unwrap().to_path_buf();
        assert!(path.starts_with("/proc/"), "published by descriptor: {}", path.display());
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(names.is_empty(), "the name is unlinked at creation: {names:?}");
        // A peer still maps it by its descriptor.
        let peer = KvMemory::open_segment(&path).unwrap();
        assert_eq!(peer.layout(), layout());
        drop((peer, own));
        std::fs::remove_dir(&dir).unwrap();
    }
}
