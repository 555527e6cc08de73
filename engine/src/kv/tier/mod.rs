//! The tiers behind the KV pool: stores of named KV *pages* in host memory and on local disk.
//!
//! A page is one pool block's contents for every storage layer of the pool, `page_bytes` long
//! for a given worker, named by the block's [`BlockHash`] (which already covers the model and the
//! tenant's salt). The engine *spills* a page here when the pool evicts its block and, when a
//! prompt's prefix continues in a tier, *prefetches* it and *gets* it back. Both tiers are LRU
//! by bytes.
//!
//! - **Host tier** (`host_bytes > 0`): pages in memory, inserted at spill.
//! - **Disk tier** (`disk_dir`): write-through. A spilled page is queued for the I/O thread, which
//!   writes its file; a prefetched page is read back by that thread, verified, and put in the host
//!   tier, or in a small *staging* map when there is no host tier. The write queue and the staging
//!   map are each bounded to `max(16 MiB, 64 pages)`: a spill that does not fit the queue is
//!   dropped (counted), and the oldest staged page makes room for a new one. A page waiting for
//!   its write is in memory: `contains` says [`TierKind::Host`] and `get` hands out its bytes (a
//!   disk hit) while it stays queued.
//!
//! - **Spill queue.** [`KvTiers::spill_copied`] takes pages whose bytes may still be in flight (a
//!   GPU's copy out of its pool, with a [`SpillCopy`] to wait for); the *spill thread* waits for
//!   each batch, takes the pages' CRC-32 and spills them as above. A page in the queue counts as
//!   in memory for `contains`, and `get` settles its batch first. The queue is bounded like the
//!   write queue; what does not fit is dropped (counted), and so is a batch whose copy fails.
//!   Dropping the last handle settles the queue before the I/O thread stops.
//! - **Page memory** ([`page`]): with [`KvTiers::open_in`], pages held in memory live in slots of
//!   one allocation (a GPU worker's pinned memory), the heap taking any overflow.
//!
//! The engine thread never waits on disk I/O: `spill`, `contains`, `get`, `prefetch`, `stats` and
//! `names` take one lock that the I/O thread only holds between I/Os (`state.rs` is the whole
//! state, without I/O); only [`KvTiers::wait_loaded`] and [`KvTiers::flush`] block, each with a
//! timeout. Reads go before writes. Dropping the last handle stops the I/O thread after it
//! finishes the queued writes, or after two seconds, whichever comes first.
//!
//! # Disk format
//! - `<disk_dir>/tandem-kv-<32 hex digits of the identity key>/` ([`TierIdentity::key`]), created
//!   at open; other entries of `disk_dir` (other models, dtypes, layouts) are never touched, so
//!   workers of different models may share a `disk_dir`. A `lock` file in it is held with
//!   `flock(LOCK_EX | LOCK_NB)` for the store's life: a second opener is refused ("in use by
//!   another worker").
//! - One file per page, `<32 lowercase hex digits of the name>.kvp`, written as `<name>.tmp` then
//!   renamed (no fsync: a file torn by a crash fails the checks below and is removed).
//! - The file is a 56-byte header, little-endian: magic `b"TNDMKVP\0"`, version `u32` = 1, the
//!   identity key (16 bytes), the name (`u128`), the payload length (`u64`), the payload's CRC-32
//!   (`u32`, as [`crate::kv::checksum::update`]`(0, payload)`); then the payload.
//! - At open with `disk_persist`, every `.kvp` whose header is well-formed, whose key and length
//!   are ours, whose file name matches its header's name and whose size is header + payload is
//!   indexed, oldest modification time first; every other `.kvp` and every `.tmp` is removed (one
//!   warning with the count). The payload's CRC is checked at read, where a bad page is removed
//!   and counted as an error. Reading a page sets its modification time, so the order survives a
//!   restart; pages beyond the capacity, oldest first, are removed. Without `disk_persist`, every
//!   `.kvp` and `.tmp` of our subdirectory is removed at open.
//! - Capacity counts payload bytes only (not the 56-byte headers, nor the file system's blocks).
//!   Evicting a page deletes its file. A write that finds the file system full (ENOSPC, EDQUOT)
//!   drops that page, and the tier shrinks its capacity to a page below what it holds, evicting
//!   the oldest pages to make room, and goes on at that size until the process restarts (warned
//!   once per shrink); a tier holding fewer than two pages then, and any other failed write
//!   (EROFS, EIO, ...), drops the queue too, warns once, and refuses new writes for 30 seconds.
//!
//! Invariants (checked by [`KvTiers::check`]): per tier `bytes == blocks * page_bytes <=
//! capacity`; the LRU order and the index hold the same names; every page in the disk index has
//! its file; the write queue is within its bound. A page is stored under its name only, so a get
//! returns the bytes spilled under that name (or read back and verified from its file).

mod disk;
mod lru;
mod page;
mod state;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet, VecDeque};

use super::{BlockHash, KvError, KvLayout};
pub use page::{HeapMemory, HostAlloc, HostMemory, Page, PageArena};
use state::State;

/// What a worker keeps behind its KV pool. The default enables nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierOptions {
    /// Capacity of the host (memory) tier in bytes; 0: no host tier.
    pub host_bytes: u64,
    /// Directory of the disk tier; `None`: no disk tier.
    pub disk_dir: Option<PathBuf>,
    /// Capacity of the disk tier in payload bytes; must be > 0 when `disk_dir` is set.
    pub disk_bytes: u64,
    /// Keep the pages of earlier runs; false: remove this worker's page files at open.
    pub disk_persist: bool,
}

impl TierOptions {
    /// Whether any tier is enabled.
    pub fn enabled(&self) -> bool {
        self.host_bytes > 0 || self.disk_dir.is_some()
    }
}

/// What makes pages of one worker readable by another, besides the page name (which covers the
/// model identity and the salt).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierIdentity {
    /// The model identity (as the prefix chain root takes it).
    pub model: String,
    /// The pool's layout; its block count does not matter.
    pub layout: KvLayout,
    /// Per layer group, its sliding window (`None`: full attention), in the pool's order.
    pub windows: Vec<Option<usize>>,
}

impl TierIdentity {
    /// The first 16 bytes of SHA-256 over this canonical text (each line ends with `\n`):
    ///
    /// ```text
    /// tandem-kv-tier-identity-v1
    /// model <byte length of the model identity> <model identity>
    /// num_layers <n>
    /// block_size <n>
    /// num_kv_heads <n>
    /// head_dim <n>
    /// dtype <the dtype's layout name, e.g. tandem-f16-lkv-v1>
    /// windows <per group: the window in decimal, or "-" for none; comma-separated>
    /// ```
    ///
    /// The block count is left out: a page stays readable by a worker whose pool is of another size.
    pub fn key(&self) -> [u8; 16] {
        let l = &self.layout;
        let windows: Vec<String> =
            self.windows.iter().map(|w| w.map_or_else(|| "-".to_string(), |w| w.to_string())).collect();
        let text = format!(
            "tandem-kv-tier-identity-v1\nmodel {} {}\nnum_layers {}\nblock_size {}\nnum_kv_heads {}\n\
             head_dim {}\ndtype {}\nwindows {}\n",
            self.model.len(),
            self.model,
            l.num_layers,
            l.block_size,
            l.num_kv_heads,
            l.head_dim,
            l.dtype.layout_name(),
            windows.join(",")
        );
        let digest = Sha256::digest(text.as_bytes());
        digest[..16].try_into().expect("16 bytes of a SHA-256 digest")
    }
}

/// A tier of the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierKind {
    Host,
    Disk,
}

impl TierKind {
    /// `host` or `disk` (metric labels).
    pub fn name(self) -> &'static str {
        match self {
            TierKind::Host => "host",
            TierKind::Disk => "disk",
        }
    }
}

/// One tier's size and counters (since open).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TierCounters {
    pub capacity_bytes: u64,
    /// Bytes held (payload bytes on disk).
    pub bytes: u64,
    /// Pages held.
    pub blocks: u64,
    /// Pages handed back by `get` from this tier (for the disk tier: staged pages).
    pub hits: u64,
    /// Pages stored into this tier (for the disk tier: files written).
    pub spills: u64,
    /// Disk: pages read back from disk into memory. Host: the same as `hits`.
    pub reloads: u64,
    /// Pages that could not be stored: wrong length, write queue full, write failed or refused
    /// during the back-off after a failure, unwritten at shutdown.
    pub drops: u64,
    /// Pages evicted by LRU for capacity.
    pub evictions: u64,
    /// Failed writes, and reads that failed or were rejected (format, identity, checksum).
    pub errors: u64,
    /// Total seconds of successful disk reads (`reload_seconds / reloads` is the mean latency).
    pub reload_seconds: f64,
}

/// Every tier's counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TierStats {
    pub host: Option<TierCounters>,
    pub disk: Option<TierCounters>,
    /// Bytes waiting in the disk tier's write queue (or being written).
    pub queued_write_bytes: u64,
    /// Bytes of spilled pages waiting for their copy out of the pool to finish (or for their
    /// checksum) before they enter a tier.
    pub queued_spill_bytes: u64,
    /// Host memory of the tiers' pages: `pinned` (page-locked, from the GPU's driver) or `heap`.
    pub host_memory: &'static str,
    /// Pages that went to ordinary heap memory because every pinned slot was in use.
    pub unpinned_pages: u64,
}

/// Copies into spilled pages that may still be in flight (a GPU's copy engine writes them after
/// [`KvTiers::spill_copied`] returns): `wait` returns once the bytes are all there, or says why
/// they never will be. Called once, off the engine thread (or by a [`KvTiers::get`] of one of its
/// pages).
pub trait SpillCopy: Send + Sync {
    fn wait(&self) -> Result<(), String>;
}

/// A batch's pages to store, and those dropped.
type BatchPages = (Vec<(BlockHash, Page)>, Vec<Page>);

/// Pages handed over by one [`KvTiers::spill_copied`] call.
struct SpillBatch {
    copy: Option<Box<dyn SpillCopy>>,
    /// Taken by whoever settles the batch (the spill thread, or a `get` of one of its pages):
    /// the pages to store, and those dropped, whose memory the copy may still write until it ends.
    pages: Mutex<Option<BatchPages>>,
}

/// Batches waiting to enter the tiers.
#[derive(Default)]
struct SpillQueue {
    batches: VecDeque<Arc<SpillBatch>>,
    /// Every page name of `batches`, with its (latest) batch.
    names: HashMap<BlockHash, Arc<SpillBatch>>,
    pages: usize,
    /// Set when the last handle is dropped: the spill thread settles what is queued and returns.
    stop: bool,
}

/// What the handles and the I/O thread share.
struct Shared {
    state: Mutex<State>,
    /// The I/O thread waits here for work.
    work: Condvar,
    /// Signalled when a read finishes, a write finishes, or the I/O thread stops.
    done: Condvar,
    page_bytes: usize,
    has_host: bool,
    key: [u8; 16],
    /// The disk tier's directory (`<disk_dir>/tandem-kv-<key>`).
    dir: Option<PathBuf>,
    /// Holds the directory's `flock` until the I/O thread and every handle are gone.
    _lock: Option<File>,
    /// Slots of host memory pages are stored in (`None`: each page is its own heap allocation).
    arena: Option<PageArena>,
    spills: Mutex<SpillQueue>,
    /// The spill thread waits here for batches.
    spill_work: Condvar,
    /// Signalled when a batch is settled.
    spill_done: Condvar,
    /// The most pages the spill queue holds.
    spill_cap: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spills(&self) -> MutexGuard<'_, SpillQueue> {
        self.spills.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A page to fill: an arena slot when there is one free, else heap memory.
    fn page(&self) -> Page {
        match &self.arena {
            Some(a) => a.page(),
            None => Page::heap(self.page_bytes),
        }
    }

    /// The batch `name` waits in, if any.
    fn spilling(&self, name: BlockHash) -> Option<Arc<SpillBatch>> {
        self.spills().names.get(&name).cloned()
    }

    /// Waits for `batch`'s copy, sums its pages and stores them in the tiers, then takes it out of
    /// the queue; nothing when another caller settled it already. Its pages are listed in the
    /// queue until they are in the state, so a look at the queue, then at the state, finds them.
    fn settle(&self, batch: &Arc<SpillBatch>) {
        let mut slot = batch.pages.lock().unwrap_or_else(|e| e.into_inner());
        let Some((pages, dropped)) = slot.take() else { return };
        let names: Vec<BlockHash> = pages.iter().map(|&(n, _)| n).collect();
        let copied = batch.copy.as_ref().map_or(Ok(()), |c| c.wait());
        match copied {
            Ok(()) => {
                let sums: Vec<u32> = pages.iter().map(|(_, p)| super::checksum::update(0, p)).collect();
                let now = Instant::now();
                let mut st = self.lock();
                let mut work = false;
                for ((name, page), crc) in pages.into_iter().zip(sums) {
                    work |= st.spill(name, Arc::new(page), crc, now);
                }
                drop(st);
                if work {
                    self.work.notify_one();
                }
            }
            Err(why) => {
                // The copy may still write into these pages: their memory is never given back.
                tracing::error!(
                    why,
                    pages = names.len() + dropped.len(),
                    "KV tiers: a copy of spilled pages could not be waited for; they are dropped and their \
                     memory leaked"
                );
                std::mem::forget(pages);
                std::mem::forget(dropped);
                let mut st = self.lock();
                for _ in &names {
                    st.drop_page();
                }
                drop(st);
                self.finish(batch, &names);
                drop(slot);
                self.spill_done.notify_all();
                return;
            }
        }
        drop(dropped);
        self.finish(batch, &names);
        drop(slot);
        self.spill_done.notify_all();
    }

    /// Takes a settled batch out of the queue.
    fn finish(&self, batch: &Arc<SpillBatch>, names: &[BlockHash]) {
        let mut q = self.spills();
        q.batches.retain(|b| !Arc::ptr_eq(b, batch));
        for name in names {
            if q.names.get(name).is_some_and(|b| Arc::ptr_eq(b, batch)) {
                q.names.remove(name);
            }
        }
        q.pages -= names.len();
    }

    /// Waits until the spill queue is empty (true) or `until` (false).
    fn spills_settled(&self, until: Instant) -> bool {
        let mut q = self.spills();
        while !q.batches.is_empty() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            q = self.spill_done.wait_timeout(q, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }
}

/// The spill thread: settles queued batches in order until the store is dropped and the queue
/// is empty.
fn spill_thread(shared: Arc<Shared>) {
    loop {
        let next = {
            let mut q = shared.spills();
            loop {
                if let Some(b) = q.batches.front() {
                    break Some(b.clone());
                }
                if q.stop {
                    break None;
                }
                q = shared.spill_work.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        match next {
            Some(batch) => shared.settle(&batch),
            None => return,
        }
    }
}

/// How long the I/O thread goes on writing queued pages after the last handle is dropped.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

struct Inner {
    shared: Arc<Shared>,
    io: Option<JoinHandle<()>>,
    spiller: Option<JoinHandle<()>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Queued spills enter the tiers first (their copies finish, on a GPU within a step), so
        // the disk writer sees them before it stops.
        if let Some(spiller) = self.spiller.take() {
            self.shared.spills().stop = true;
            self.shared.spill_work.notify_all();
            let _ = spiller.join();
        }
        let Some(io) = self.io.take() else { return };
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        {
            let mut st = self.shared.lock();
            st.shutdown_deadline = Some(deadline);
            st.hold_writes = false;
        }
        self.shared.work.notify_all();
        // A write stuck in the kernel past the deadline is not waited for (the thread is left).
        let give_up = deadline + Duration::from_secs(1);
        let mut st = self.shared.lock();
        while !st.stopped && !io.is_finished() {
            let left = give_up.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let slice = left.min(Duration::from_millis(100));
            st = self.shared.done.wait_timeout(st, slice).unwrap_or_else(|e| e.into_inner()).0;
        }
        let stopped = st.stopped || io.is_finished();
        drop(st);
        if stopped {
            let _ = io.join();
        } else {
            tracing::warn!("KV disk tier: the I/O thread did not stop in time; left behind");
        }
    }
}

/// The store: a cheap handle (clone it freely); the last one dropped stops the I/O thread.
#[derive(Clone)]
pub struct KvTiers {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for KvTiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvTiers")
            .field("page_bytes", &self.shared().page_bytes)
            .field("dir", &self.shared().dir)
            .field("stats", &self.stats())
            .finish()
    }
}

impl KvTiers {
    /// `None` when `opts` enables nothing. Errors ([`KvError::Tier`], naming the flag and the
    /// path): `page_bytes == 0`; a host tier smaller than one page (`--kv-host-bytes`);
    /// `disk_bytes` of 0 or less than one page with a disk directory (`--kv-disk-bytes`); a disk
    /// directory that is missing, not a directory, not writable, or in use by another live process
    /// (`--kv-disk-dir`).
    pub fn open(
        opts: &TierOptions,
        id: &TierIdentity,
        page_bytes: usize,
    ) -> Result<Option<KvTiers>, KvError> {
        Self::open_in(opts, id, page_bytes, None)
    }

    /// [`KvTiers::open`], with the pages held in memory kept in slots of one allocation from
    /// `host_memory` (called once with the bytes wanted; a GPU worker passes its driver's pinned
    /// memory), sized for the host tier, the disk tier's write queue and staging map, and the
    /// spill queue. A failed allocation is refused, naming `--kv-host-bytes`. No `host_memory`,
    /// or one that gives none: every page is its own heap allocation.
    pub fn open_in(
        opts: &TierOptions,
        id: &TierIdentity,
        page_bytes: usize,
        host_memory: Option<HostAlloc<'_>>,
    ) -> Result<Option<KvTiers>, KvError> {
        if !opts.enabled() {
            return Ok(None);
        }
        if page_bytes == 0 {
            return Err(KvError::Tier("KV pages of 0 bytes cannot be stored".into()));
        }
        let pb = page_bytes as u64;
        if opts.host_bytes > 0 && opts.host_bytes < pb {
            return Err(KvError::Tier(format!(
                "--kv-host-bytes {}: less than one KV page ({page_bytes} bytes)",
                opts.host_bytes
            )));
        }
        let key = id.key();
        let disk = match &opts.disk_dir {
            None => None,
            Some(dir) => {
                if opts.disk_bytes < pb {
                    return Err(KvError::Tier(format!(
                        "--kv-disk-bytes {}: the disk tier in {} needs room for at least one KV page \
                         ({page_bytes} bytes)",
                        opts.disk_bytes,
                        dir.display()
                    )));
                }
                Some(disk::open_dir(dir, opts.disk_bytes, opts.disk_persist, &key, page_bytes)?)
            }
        };
        let (dir, lock, found) = match disk {
            Some(d) => (Some(d.path), Some(d.lock), Some(d.found)),
            None => (None, None, None),
        };
        let state = State::new(page_bytes, opts.host_bytes, found.map(|f| (opts.disk_bytes, f)));
        let spill_cap = state::bound_pages(page_bytes);
        let arena = match host_memory {
            None => None,
            Some(alloc) => {
                let host_pages = (opts.host_bytes / pb) as usize;
                let disk_pages = match (&dir, host_pages) {
                    (None, _) => 0,
                    (Some(_), 0) => 2 * spill_cap, // write queue and staging map
                    (Some(_), _) => spill_cap,     // write queue
                };
                let bytes = (host_pages + disk_pages + spill_cap) * page_bytes;
                let memory = alloc(bytes).map_err(|e| {
                    KvError::Tier(format!(
                        "--kv-host-bytes {}: cannot allocate {bytes} bytes of host memory for the KV \
                         tiers' pages: {e}",
                        opts.host_bytes
                    ))
                })?;
                memory.map(|m| PageArena::new(m, page_bytes))
            }
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            work: Condvar::new(),
            done: Condvar::new(),
            page_bytes,
            has_host: opts.host_bytes > 0,
            key,
            dir,
            _lock: lock,
            arena,
            spills: Mutex::new(SpillQueue::default()),
            spill_work: Condvar::new(),
            spill_done: Condvar::new(),
            spill_cap,
        });
        let io = match &shared.dir {
            None => None,
            Some(dir) => {
                let for_thread = shared.clone();
                let spawned = std::thread::Builder::new()
                    .name("kv-tier-io".into())
                    .spawn(move || disk::io_thread(for_thread))
                    .map_err(|e| {
                        KvError::Tier(format!("cannot start the I/O thread for {}: {e}", dir.display()))
                    })?;
                Some(spawned)
            }
        };
        let for_spiller = shared.clone();
        let spiller = std::thread::Builder::new()
            .name("kv-tier-spill".into())
            .spawn(move || spill_thread(for_spiller))
            .map_err(|e| KvError::Tier(format!("cannot start the KV tiers' spill thread: {e}")))?;
        tracing::info!(
            page_bytes,
            host_bytes = opts.host_bytes,
            host_memory = shared.arena.as_ref().map_or("heap", PageArena::kind),
            disk_dir = ?shared.dir,
            disk_bytes = opts.disk_bytes,
            "KV tiers open"
        );
        Ok(Some(KvTiers { inner: Arc::new(Inner { shared, io, spiller: Some(spiller) }) }))
    }

    fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    pub fn page_bytes(&self) -> usize {
        self.shared().page_bytes
    }

    pub fn has_host(&self) -> bool {
        self.shared().has_host
    }

    pub fn has_disk(&self) -> bool {
        self.shared().dir.is_some()
    }

    /// Where `name` is: [`TierKind::Host`] if memory holds it (the host tier, staged from disk, or
    /// waiting in the write queue), else [`TierKind::Disk`] if the disk index holds it, else
    /// `None`. Touches nothing.
    pub fn contains(&self, name: BlockHash) -> Option<TierKind> {
        // The queue first: a page leaves it only after it is in the state.
        if self.shared().spilling(name).is_some() {
            return Some(TierKind::Host);
        }
        self.shared().lock().contains(name)
    }

    /// Whether the disk tier holds `name` (written, or waiting in the write queue).
    pub fn on_disk(&self, name: BlockHash) -> bool {
        self.shared().lock().on_disk(name)
    }

    /// How many pages read from disk memory can hold until they are taken: the staging map's
    /// bound without a host tier, else the host tier's capacity in pages.
    pub fn read_room(&self) -> usize {
        self.shared().lock().read_room()
    }

    /// Stores a page the pool evicts; `checksum` is its CRC-32 ([`crate::kv::checksum::update`]
    /// from 0). A page of the wrong length is ignored and counted as a drop. A page already held
    /// is only made most recent. Host tier: inserted, evicting the least recent pages as needed.
    /// Disk tier: queued for writing unless the disk holds it; dropped (counted) when the queue is
    /// full or writes are paused after a failure. Never waits on I/O.
    pub fn spill(&self, name: BlockHash, bytes: Vec<u8>, checksum: u32) {
        let shared = self.shared();
        if bytes.len() != shared.page_bytes {
            tracing::debug!(
                len = bytes.len(),
                page_bytes = shared.page_bytes,
                "KV tier: page of the wrong length"
            );
            shared.lock().drop_page();
            return;
        }
        let page = Arc::new(Page::from(bytes));
        if shared.lock().spill(name, page, checksum, Instant::now()) {
            shared.work.notify_one();
        }
    }

    /// A page to copy a pool block into for [`KvTiers::spill_copied`]: a free slot of the
    /// tiers' host memory (pinned on a GPU worker) when there is one, else heap memory. Its bytes
    /// are whatever the slot held last.
    pub fn page(&self) -> Page {
        self.shared().page()
    }

    /// How many more pages [`KvTiers::spill_copied`] takes now (the spill queue's bound less what
    /// it holds): the engine drops the rest ([`KvTiers::drop_spills`]) rather than wait.
    pub fn spill_room(&self) -> usize {
        self.shared().spill_cap.saturating_sub(self.shared().spills().pages)
    }

    /// Counts `n` evicted pages as dropped (no room in the spill queue).
    pub fn drop_spills(&self, n: usize) {
        let mut st = self.shared().lock();
        for _ in 0..n {
            st.drop_page();
        }
    }

    /// Stores pages the pool evicts whose bytes are still being copied into them: once `copy`
    /// says they are there (`None`: they are), the spill thread sums them and stores them as
    /// [`KvTiers::spill`] does. Meanwhile [`KvTiers::contains`] counts them as in memory and
    /// [`KvTiers::get`] waits for them. Never waits itself; pages of the wrong length, and pages
    /// past [`KvTiers::spill_room`], are dropped (counted).
    pub fn spill_copied(&self, pages: Vec<(BlockHash, Page)>, copy: Option<Box<dyn SpillCopy>>) {
        let shared = self.shared();
        let (mut keep, mut dropped) = (Vec::with_capacity(pages.len()), Vec::new());
        let room = self.spill_room();
        for (name, page) in pages {
            if page.len() != shared.page_bytes || keep.len() >= room {
                dropped.push(page);
            } else {
                keep.push((name, page));
            }
        }
        if !dropped.is_empty() {
            self.drop_spills(dropped.len());
        }
        if keep.is_empty() && (copy.is_none() || dropped.is_empty()) {
            return;
        }
        // Dropped pages go with the batch too: the copy may write into them until it ends.
        let names: Vec<BlockHash> = keep.iter().map(|&(n, _)| n).collect();
        let batch = Arc::new(SpillBatch { copy, pages: Mutex::new(Some((keep, dropped))) });
        let mut q = shared.spills();
        q.pages += names.len();
        for name in names {
            q.names.insert(name, batch.clone());
        }
        q.batches.push_back(batch);
        drop(q);
        shared.spill_work.notify_one();
    }

    /// Settles every queued batch on the calling thread, in order (each copy waited for): on
    /// return no copy handed over before the call still writes into a page or reads its block.
    pub fn settle_spills(&self) {
        loop {
            let Some(batch) = self.shared().spills().batches.front().cloned() else { return };
            self.shared().settle(&batch);
        }
    }

    /// The page's bytes if memory holds it: from the host tier (a host hit, made most recent),
    /// staged by a finished prefetch (a disk hit; taken out of staging), or waiting in the write
    /// queue (a disk hit; the write goes on). A page still in the spill queue is settled first
    /// (its copy waited for). Never reads disk.
    pub fn get(&self, name: BlockHash) -> Option<Arc<Page>> {
        if let Some(batch) = self.shared().spilling(name) {
            self.shared().settle(&batch);
        }
        self.shared().lock().get(name)
    }

    /// Queues disk reads for those of `names` that the disk holds and memory does not, unless
    /// already in flight. Returns how many of `names` are in flight (a name listed twice counts
    /// twice).
    pub fn prefetch(&self, names: &[BlockHash]) -> usize {
        let (in_flight, queued) = self.shared().lock().prefetch(names);
        if queued {
            self.shared().work.notify_one();
        }
        in_flight
    }

    /// Whether any of `names` is being read.
    pub fn in_flight(&self, names: &[BlockHash]) -> bool {
        self.shared().lock().in_flight(names)
    }

    /// Blocks until some read finishes or `timeout` passes; returns at once when no read is in
    /// flight.
    pub fn wait_loaded(&self, timeout: Duration) {
        let shared = self.shared();
        let until = Instant::now() + timeout;
        let mut st = shared.lock();
        let before = st.reads_done;
        while st.reads_done == before
            && st.disk.as_ref().is_some_and(|d| !d.in_flight.is_empty())
            && !st.stopped
        {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            st = shared.done.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Blocks until the spill queue and the write queue are empty (true) or `timeout` passes
    /// (false).
    pub fn flush(&self, timeout: Duration) -> bool {
        let shared = self.shared();
        let until = Instant::now() + timeout;
        if !shared.spills_settled(until) {
            return false;
        }
        let mut st = shared.lock();
        while !st.writes_idle() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || st.stopped {
                return false;
            }
            st = shared.done.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }

    pub fn stats(&self) -> TierStats {
        let shared = self.shared();
        let queued_spill_bytes = (shared.spills().pages * shared.page_bytes) as u64;
        let (host, disk, queued_write_bytes) = shared.lock().counters();
        TierStats {
            host,
            disk,
            queued_write_bytes,
            queued_spill_bytes,
            host_memory: shared.arena.as_ref().map_or("heap", PageArena::kind),
            unpinned_pages: shared
                .arena
                .as_ref()
                .filter(|a| a.kind() == "pinned")
                .map_or(0, PageArena::overflow_pages),
        }
    }

    /// Names held with their tier ([`TierKind::Host`] when memory holds one, even if the disk does
    /// too), most recently used first, at most `limit`. Pages still in the write queue are left out.
    pub fn names(&self, limit: usize) -> Vec<(BlockHash, TierKind)> {
        self.shared().lock().names(limit)
    }

    /// [`KvTiers::names`] as a router can match them on a pool of `groups` layer groups: a token
    /// block's group 0 page is named by the block's hash, the others by its images
    /// ([`crate::kv::allocator::group_hash`]), which match no prompt, so a name that is the image
    /// of another name held here or of one of `held` (the pool's group 0 names) is left out. (A
    /// page of a later group whose group 0 page is held nowhere stays: nothing tells it from a
    /// block's own name.) At most `limit`; the flag says whether the names looked at ran out
    /// before `limit` were found, so that more may exist.
    pub fn root_names(
        &self,
        limit: usize,
        groups: usize,
        held: &[BlockHash],
    ) -> (Vec<(BlockHash, TierKind)>, bool) {
        if groups <= 1 {
            return (self.names(limit), false);
        }
        let window = limit.saturating_mul(groups);
        let names = self.names(window);
        let full = names.len() == window;
        let roots = root_names_of(names, groups, limit, held);
        let more = full && roots.len() < limit;
        (roots, more)
    }

    /// The invariants of the module documentation, with every indexed page's file checked (size
    /// only), under the lock: meant for tests, it makes the engine thread wait on a `stat` per page.
    pub fn check(&self) -> Result<(), String> {
        let shared = self.shared();
        let st = shared.lock();
        st.check()?;
        if let Some(dir) = &shared.dir {
            let want = (disk::HEADER_BYTES + shared.page_bytes) as u64;
            for name in st.disk_names() {
                let path = dir.join(disk::file_name(name));
                match std::fs::metadata(&path) {
                    Ok(m) if m.len() == want => {}
                    Ok(m) => return Err(format!("{}: {} bytes, expected {want}", path.display(), m.len())),
                    Err(e) => return Err(format!("{} is indexed but {e}", path.display())),
                }
            }
        }
        Ok(())
    }

    /// The disk tier's directory (`<disk_dir>/tandem-kv-<key>`).
    pub fn disk_path(&self) -> Option<&std::path::Path> {
        self.shared().dir.as_deref()
    }

    /// Tests: the next `n` page writes fail as on a full file system.
    #[cfg(test)]
    fn fail_writes_full(&self, n: usize) {
        self.shared().lock().fail_full = n;
    }

    /// Tests: the file system reports `free` bytes free (`None`: its own figure).
    #[cfg(test)]
    fn report_free_bytes(&self, free: Option<u64>) {
        self.shared().lock().free_bytes = free;
    }

    /// Tests: a shrunk disk tier looks for room at its next write instead of after the interval.
    #[cfg(test)]
    fn regrow_due_now(&self) {
        if let Some(d) = self.shared().lock().disk.as_mut() {
            if d.regrow_at.is_some() {
                d.regrow_at = Some(std::time::Instant::now());
            }
        }
    }

    /// Tests: hold (or release) the disk writer, which then takes no write.
    #[cfg(test)]
    fn hold_writes(&self, hold: bool) {
        self.shared().lock().hold_writes = hold;
        self.shared().work.notify_all();
    }
}

/// `names` without those that are a later group's image of another name among them or of one of
/// `held`, at most `limit` (see [`KvTiers::root_names`]).
fn root_names_of(
    names: Vec<(BlockHash, TierKind)>,
    groups: usize,
    limit: usize,
    held: &[BlockHash],
) -> Vec<(BlockHash, TierKind)> {
    let images: HashSet<BlockHash> = names
        .iter()
        .map(|&(h, _)| h)
        .chain(held.iter().copied())
        .flat_map(|h| (1..groups).map(move |g| crate::kv::allocator::group_hash(h, g)))
        .collect();
    names.into_iter().filter(|(h, _)| !images.contains(h)).take(limit).collect()
}

#[cfg(test)]
mod root_name_tests {
    use super::*;
    use crate::kv::allocator::group_hash;

    #[test]
    fn a_later_groups_page_is_left_out_when_its_blocks_name_is_held() {
        let (a, b, c) = (BlockHash(11), BlockHash(22), BlockHash(33));
        let names = vec![
            (group_hash(a, 1), TierKind::Host),
            (a, TierKind::Host),
            (group_hash(a, 2), TierKind::Disk),
            (b, TierKind::Disk),
            (group_hash(c, 1), TierKind::Disk), // c's own page is not held: nothing marks this one
            (group_hash(b, 2), TierKind::Disk),
        ];
        let got = root_names_of(names.clone(), 3, 10, &[]);
        assert_eq!(got, vec![(a, TierKind::Host), (b, TierKind::Disk), (group_hash(c, 1), TierKind::Disk)]);
        // Within the limit, in the order given.
        assert_eq!(root_names_of(names.clone(), 3, 2, &[]), vec![(a, TierKind::Host), (b, TierKind::Disk)]);
        // c's own page held in the pool: its later group's page goes too.
        let held = root_names_of(names.clone(), 3, 10, &[c]);
        assert_eq!(held, vec![(a, TierKind::Host), (b, TierKind::Disk)]);
        // With two groups only group 1's images go.
        let two = root_names_of(names, 2, 10, &[]);
        assert!(
            two.contains(&(group_hash(a, 2), TierKind::Disk))
                && !two.contains(&(group_hash(a, 1), TierKind::Host))
        );
    }
}
