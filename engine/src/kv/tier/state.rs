//! What a store knows, without the I/O: the host tier, the staging map, the disk tier's index and
//! its two queues (reads, writes), and the counters. The I/O thread ([`super::disk`]) takes jobs
//! from here ([`State::next_job`]), performs them without holding the lock, and reports back
//! ([`State::read_done`], [`State::write_done`]). Time is passed in; no method here touches a file,
//! so every method is as cheap as a few map operations and the engine thread never waits on I/O.
//!
//! Invariants ([`State::check`]):
//! - per tier, `bytes == blocks * page_bytes` and `bytes <= capacity`; the staging map holds at
//!   most `staged_cap` pages;
//! - the disk index holds only pages whose file is written (renamed into place) and not yet
//!   deleted: a file is created before its name enters the index and deleted after it leaves;
//! - every name in the write order is pending; only the page being written may be pending and
//!   not in the order; `queued_bytes` is the pending pages' total and at most the queue bound;
//! - every name in the read queue is in flight; at most one name in flight (the read in progress)
//!   is not in the queue.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::lru::Lru;
use super::{Page, TierCounters, TierKind};
use crate::kv::BlockHash;

/// How long the disk tier refuses new writes after a write failed.
pub(super) const WRITE_BACKOFF: Duration = Duration::from_secs(30);

/// How often a disk tier shrunk by a full file system looks for room to grow back.
pub(super) const REGROW_INTERVAL: Duration = Duration::from_secs(30);

/// Bounds of the write queue and of the staging map: at least this many bytes...
const QUEUE_MIN_BYTES: u64 = 16 << 20;
/// ... and at least this many pages.
const QUEUE_MIN_PAGES: u64 = 64;

/// The bound, in pages of `page_bytes`, of the write queue, of the staging map, and of the spill
/// queue: `max(16 MiB, 64 pages)`.
pub(super) fn bound_pages(page_bytes: usize) -> usize {
    QUEUE_MIN_PAGES.max(QUEUE_MIN_BYTES.div_ceil(page_bytes as u64)) as usize
}

pub(super) struct HostTier {
    pub pages: Lru<Arc<Page>>,
    pub capacity: u64,
    pub counters: TierCounters,
}

/// A page waiting for (or in) its disk write. It is in memory, so a prefetch takes it from here.
pub(super) struct Pending {
    pub bytes: Arc<Page>,
    pub crc: u32,
}

pub(super) struct DiskTier {
    /// Pages whose file is in place (value: nothing; size: payload bytes).
    pub index: Lru<()>,
    pub capacity: u64,
    pub counters: TierCounters,
    pub pending: HashMap<BlockHash, Pending>,
    pub write_order: VecDeque<BlockHash>,
    pub queued_bytes: u64,
    pub queue_cap: u64,
    pub reads: VecDeque<BlockHash>,
    pub in_flight: HashSet<BlockHash>,
    /// No new writes are accepted before this instant (set by a failed write).
    pub writes_paused_until: Option<Instant>,
    /// The capacity the tier was opened with; a full file system may shrink `capacity` below it.
    pub configured: u64,
    /// While shrunk: when the I/O thread next looks at the file system's free space.
    pub regrow_at: Option<Instant>,
}

impl DiskTier {
    /// Evicts the oldest pages until a page of `len` bytes fits the capacity, naming their files
    /// in `delete`.
    fn make_room(&mut self, len: u64, delete: &mut Vec<BlockHash>) {
        while self.index.bytes() + len > self.capacity {
            let Some((old, ())) = self.index.pop_oldest() else { break };
            self.counters.evictions += 1;
            delete.push(old);
        }
    }
}

/// Work for the I/O thread.
pub(super) enum Job {
    Read(BlockHash),
    Write(BlockHash, Arc<Page>, u32),
    Stop,
}

/// How a write ended.
pub(super) enum WriteResult {
    Written,
    /// The page was not written for a reason of its own (its checksum disagrees with its bytes).
    Rejected,
    /// The file system is full (ENOSPC, EDQUOT: the error): the tier shrinks to what it holds,
    /// when it holds pages to give back, else backs off as for [`WriteResult::Failed`].
    Full(String),
    /// The disk failed (EROFS, EIO, ...: the error): the tier backs off.
    Failed(String),
}

/// What the I/O thread does after a write: delete these files (evicted), and warn that writes
/// are paused when `paused` is `Some((pages dropped from the queue, the error))`.
pub(super) struct WriteOutcome {
    pub delete: Vec<BlockHash>,
    pub paused: Option<(usize, String)>,
    /// The disk tier's capacity went from the first to the second number of bytes (the file
    /// system filled up under it).
    pub shrunk: Option<(u64, u64)>,
}

pub(super) struct State {
    page_bytes: usize,
    clock: u64,
    pub host: Option<HostTier>,
    /// Pages loaded from disk when there is no host tier, until `get` takes them.
    pub staged: Lru<Arc<Page>>,
    staged_cap: usize,
    pub disk: Option<DiskTier>,
    /// Set when the last handle is dropped: writes go on until this instant, reads are abandoned.
    pub shutdown_deadline: Option<Instant>,
    /// The I/O thread has returned.
    pub stopped: bool,
    /// Reads finished (loaded, failed or abandoned), for `wait_loaded`.
    pub reads_done: u64,
    /// The I/O thread is writing a page (or deleting the files its write evicted).
    writing: bool,
    /// Tests: the I/O thread takes no write while set.
    pub hold_writes: bool,
    /// Tests: this many next writes fail as on a full file system.
    pub fail_full: usize,
    /// Tests: the free bytes the file system reports instead of its own.
    pub free_bytes: Option<u64>,
}

fn host_insert(h: &mut HostTier, name: BlockHash, tick: u64, page: Arc<Page>) {
    let len = page.len() as u64;
    while h.pages.bytes() + len > h.capacity && h.pages.pop_oldest().is_some() {
        h.counters.evictions += 1;
    }
    h.pages.insert(name, tick, len, page);
}

impl State {
    /// `host_bytes == 0`: no host tier. `disk`: the disk capacity and the pages found on disk,
    /// oldest first (they must fit the capacity).
    pub fn new(page_bytes: usize, host_bytes: u64, disk: Option<(u64, Vec<BlockHash>)>) -> State {
        let pb = page_bytes as u64;
        let bound_pages = QUEUE_MIN_PAGES.max(QUEUE_MIN_BYTES.div_ceil(pb));
        let mut st = State {
            page_bytes,
            clock: 0,
            host: (host_bytes > 0).then(|| HostTier {
                pages: Lru::default(),
                capacity: host_bytes,
                counters: TierCounters { capacity_bytes: host_bytes, ..TierCounters::default() },
            }),
            staged: Lru::default(),
            staged_cap: bound_pages as usize,
            disk: None,
            shutdown_deadline: None,
            stopped: false,
            reads_done: 0,
            writing: false,
            hold_writes: false,
            fail_full: 0,
            free_bytes: None,
        };
        if let Some((capacity, found)) = disk {
            let mut index = Lru::default();
            for name in found {
                let t = st.tick();
                index.insert(name, t, pb, ());
            }
            st.disk = Some(DiskTier {
                index,
                capacity,
                counters: TierCounters { capacity_bytes: capacity, ..TierCounters::default() },
                pending: HashMap::new(),
                write_order: VecDeque::new(),
                queued_bytes: 0,
                queue_cap: QUEUE_MIN_BYTES.max(QUEUE_MIN_PAGES * pb),
                reads: VecDeque::new(),
                in_flight: HashSet::new(),
                writes_paused_until: None,
                configured: capacity,
                regrow_at: None,
            });
        }
        st
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The host tier or the staging map holds `name`.
    fn stored_in_memory(&self, name: BlockHash) -> bool {
        self.host.as_ref().is_some_and(|h| h.pages.contains(name)) || self.staged.contains(name)
    }

    /// Memory holds `name`: the host tier, the staging map, or the write queue.
    fn in_memory(&self, name: BlockHash) -> bool {
        self.stored_in_memory(name) || self.disk.as_ref().is_some_and(|d| d.pending.contains_key(&name))
    }

    pub fn on_disk(&self, name: BlockHash) -> bool {
        self.disk.as_ref().is_some_and(|d| d.pending.contains_key(&name) || d.index.contains(name))
    }

    pub fn read_room(&self) -> usize {
        match &self.host {
            Some(h) => (h.counters.capacity_bytes / self.page_bytes as u64) as usize,
            None => self.staged_cap,
        }
    }

    pub fn contains(&self, name: BlockHash) -> Option<TierKind> {
        if self.in_memory(name) {
            return Some(TierKind::Host);
        }
        self.disk.as_ref()?.index.contains(name).then_some(TierKind::Disk)
    }

    /// A page of the wrong length: stored nowhere, a drop for every tier.
    pub fn drop_page(&mut self) {
        if let Some(h) = self.host.as_mut() {
            h.counters.drops += 1;
        }
        if let Some(d) = self.disk.as_mut() {
            d.counters.drops += 1;
        }
    }

    /// Stores `page` (of `page_bytes`) in every tier. True when the writer has a new job.
    pub fn spill(&mut self, name: BlockHash, page: Arc<Page>, crc: u32, now: Instant) -> bool {
        let t = self.tick();
        if let Some(h) = self.host.as_mut() {
            if !h.pages.touch(name, t) {
                host_insert(h, name, t, page.clone());
                h.counters.spills += 1;
            }
        }
        let Some(d) = self.disk.as_mut() else { return false };
        if d.index.touch(name, t) || d.pending.contains_key(&name) {
            return false;
        }
        let len = page.len() as u64;
        if d.writes_paused_until.is_some_and(|until| now < until) || d.queued_bytes + len > d.queue_cap {
            d.counters.drops += 1;
            return false;
        }
        d.writes_paused_until = None;
        d.pending.insert(name, Pending { bytes: page, crc });
        d.write_order.push_back(name);
        d.queued_bytes += len;
        true
    }

    pub fn get(&mut self, name: BlockHash) -> Option<Arc<Page>> {
        let t = self.tick();
        if let Some(h) = self.host.as_mut() {
            if h.pages.touch(name, t) {
                h.counters.hits += 1;
                h.counters.reloads += 1;
                return h.pages.peek(name).cloned();
            }
        }
        // Staged pages are taken; a page waiting for its write stays queued.
        let d = self.disk.as_mut()?;
        let page = match self.staged.remove(name) {
            Some(page) => page,
            None => d.pending.get(&name)?.bytes.clone(),
        };
        d.counters.hits += 1;
        Some(page)
    }

    /// Puts a page read from disk in memory: the host tier if there is one, else the staging map
    /// (dropping its oldest page when full). A page memory already holds is left as it is.
    fn store_in_memory(&mut self, name: BlockHash, page: Arc<Page>) {
        if self.stored_in_memory(name) {
            return;
        }
        let t = self.tick();
        if let Some(h) = self.host.as_mut() {
            host_insert(h, name, t, page);
            return;
        }
        while self.staged.len() >= self.staged_cap && self.staged.pop_oldest().is_some() {}
        let len = page.len() as u64;
        self.staged.insert(name, t, len, page);
    }

    /// Queues reads for the names the disk holds and memory does not. Returns how many of
    /// `names` are in flight, and whether the reader has a new job.
    pub fn prefetch(&mut self, names: &[BlockHash]) -> (usize, bool) {
        let (mut in_flight, mut queued) = (0, false);
        for &name in names {
            if self.in_memory(name) {
                continue;
            }
            let Some(d) = self.disk.as_mut() else { return (in_flight, queued) };
            if d.in_flight.contains(&name) {
                in_flight += 1;
            } else if d.index.contains(name) {
                d.reads.push_back(name);
                d.in_flight.insert(name);
                in_flight += 1;
                queued = true;
            }
        }
        (in_flight, queued)
    }

    pub fn in_flight(&self, names: &[BlockHash]) -> bool {
        self.disk.as_ref().is_some_and(|d| names.iter().any(|n| d.in_flight.contains(n)))
    }

    /// Nothing waits to be written, is being written, or waits for its evicted files to go.
    pub fn writes_idle(&self) -> bool {
        !self.writing && self.disk.as_ref().is_none_or(|d| d.pending.is_empty())
    }

    /// The I/O thread's next job: reads first, then writes; `None` when there is nothing to do
    /// (wait for a notification, or until the shutdown deadline).
    pub fn next_job(&mut self, now: Instant) -> Option<Job> {
        let Some(d) = self.disk.as_mut() else { return Some(Job::Stop) };
        while let Some(name) = d.reads.pop_front() {
            if self.shutdown_deadline.is_none() && d.index.contains(name) {
                return Some(Job::Read(name));
            }
            // Abandoned (shutting down) or gone from the disk meanwhile.
            d.in_flight.remove(&name);
            self.reads_done += 1;
        }
        if self.shutdown_deadline.is_some_and(|deadline| now >= deadline) {
            d.counters.drops += d.pending.len() as u64;
            d.pending.clear();
            d.write_order.clear();
            d.queued_bytes = 0;
            return Some(Job::Stop);
        }
        if !self.hold_writes {
            while let Some(name) = d.write_order.pop_front() {
                if let Some(p) = d.pending.get(&name) {
                    self.writing = true;
                    return Some(Job::Write(name, p.bytes.clone(), p.crc));
                }
            }
        }
        if self.shutdown_deadline.is_some() && d.pending.is_empty() {
            return Some(Job::Stop);
        }
        None
    }

    /// A read returned: a good page goes to memory, a bad one leaves the index. Returns the name
    /// whose file is to be deleted (a rejected page); the name stays in flight until
    /// [`Self::read_finished`], so that a waiter sees the file gone.
    pub fn read_done(&mut self, name: BlockHash, read: Option<Arc<Page>>, secs: f64) -> Option<BlockHash> {
        let t = self.tick();
        let d = self.disk.as_mut()?;
        match read {
            Some(page) => {
                d.counters.reloads += 1;
                d.counters.reload_seconds += secs;
                d.index.touch(name, t);
                self.store_in_memory(name, page);
                None
            }
            None => {
                d.counters.errors += 1;
                d.index.remove(name).map(|()| name)
            }
        }
    }

    /// The read of `name` is over, its file deleted if it was bad.
    pub fn read_finished(&mut self, name: BlockHash) {
        self.reads_done += 1;
        if let Some(d) = self.disk.as_mut() {
            d.in_flight.remove(&name);
        }
    }

    /// The write is over, the files it evicted deleted.
    pub fn write_finished(&mut self) {
        self.writing = false;
    }

    /// Whether the disk tier, shrunk by a full file system, is due to look for room again.
    pub fn regrow_due(&self, now: Instant) -> bool {
        self.disk
            .as_ref()
            .is_some_and(|d| d.capacity < d.configured && d.regrow_at.is_some_and(|at| now >= at))
    }

    /// A shrunk disk tier grows back by what the file system has free, less a page kept free,
    /// up to the capacity it was opened with; it looks again after [`REGROW_INTERVAL`] while it
    /// stays below that. Returns the capacity before and after when it grew.
    pub fn regrow(&mut self, free_bytes: u64, now: Instant) -> Option<(u64, u64)> {
        let pb = self.page_bytes as u64;
        let d = self.disk.as_mut()?;
        let room = free_bytes.saturating_sub(pb) / pb * pb;
        let grown = (d.capacity + room).min(d.configured);
        let before = d.capacity;
        d.capacity = grown;
        d.counters.capacity_bytes = grown;
        d.regrow_at = (grown < d.configured).then_some(now + REGROW_INTERVAL);
        (grown > before).then_some((before, grown))
    }

    /// A write returned: a written page enters the index (evicting the oldest pages beyond the
    /// capacity); a write that found the file system full shrinks the tier's capacity to a page
    /// below what it holds and evicts the oldest pages to leave room for the next write (each
    /// write then evicts one, as at capacity), or, holding fewer than two pages, is a failure; a
    /// failed write pauses writing and drops the queue.
    pub fn write_done(&mut self, name: BlockHash, result: WriteResult, now: Instant) -> WriteOutcome {
        let t = self.tick();
        let mut out = WriteOutcome { delete: Vec::new(), paused: None, shrunk: None };
        let Some(d) = self.disk.as_mut() else { return out };
        if let Some(p) = d.pending.remove(&name) {
            d.queued_bytes -= p.bytes.len() as u64;
        }
        match result {
            WriteResult::Written => {
                let len = self.page_bytes as u64;
                d.make_room(len, &mut out.delete);
                d.index.insert(name, t, len, ());
                d.counters.spills += 1;
            }
            WriteResult::Rejected => {
                d.counters.drops += 1;
                d.counters.errors += 1;
            }
            WriteResult::Full(_) if d.index.bytes() >= 2 * self.page_bytes as u64 => {
                let len = self.page_bytes as u64;
                let capacity = d.index.bytes() - len;
                out.shrunk = Some((d.capacity, capacity));
                d.capacity = capacity;
                d.counters.capacity_bytes = capacity;
                d.counters.drops += 1;
                d.make_room(len, &mut out.delete);
                d.regrow_at = Some(now + REGROW_INTERVAL);
            }
            WriteResult::Full(error) | WriteResult::Failed(error) => {
                d.counters.drops += 1 + d.pending.len() as u64;
                d.counters.errors += 1;
                out.paused = Some((d.pending.len(), error));
                d.pending.clear();
                d.write_order.clear();
                d.queued_bytes = 0;
                d.writes_paused_until = Some(now + WRITE_BACKOFF);
            }
        }
        out
    }

    /// Names held, Host before Disk for a name in both, most recent first.
    pub fn names(&self, limit: usize) -> Vec<(BlockHash, TierKind)> {
        type Walk<'a> = std::iter::Peekable<Box<dyn Iterator<Item = (u64, BlockHash)> + 'a>>;
        fn walk<'a>(it: impl Iterator<Item = (u64, BlockHash)> + 'a) -> Walk<'a> {
            (Box::new(it) as Box<dyn Iterator<Item = (u64, BlockHash)> + 'a>).peekable()
        }
        let mut walks: Vec<(Walk, TierKind)> = Vec::new();
        if let Some(h) = &self.host {
            walks.push((walk(h.pages.newest_first()), TierKind::Host));
        }
        walks.push((walk(self.staged.newest_first()), TierKind::Host));
        if let Some(d) = &self.disk {
            walks.push((walk(d.index.newest_first()), TierKind::Disk));
        }
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        while out.len() < limit {
            let next = walks
                .iter_mut()
                .enumerate()
                .filter_map(|(i, (w, _))| w.peek().map(|&(t, _)| (t, i)))
                .max()
                .map(|(_, i)| i);
            let Some(i) = next else { break };
            let (_, name) = walks[i].0.next().expect("peeked");
            if seen.insert(name) {
                let kind = if self.in_memory(name) { TierKind::Host } else { walks[i].1 };
                out.push((name, kind));
            }
        }
        out
    }

    pub fn counters(&self) -> (Option<TierCounters>, Option<TierCounters>, u64) {
        let host = self.host.as_ref().map(|h| TierCounters {
            bytes: h.pages.bytes(),
            blocks: h.pages.len() as u64,
            ..h.counters.clone()
        });
        let disk = self.disk.as_ref().map(|d| TierCounters {
            bytes: d.index.bytes(),
            blocks: d.index.len() as u64,
            ..d.counters.clone()
        });
        (host, disk, self.disk.as_ref().map_or(0, |d| d.queued_bytes))
    }

    /// The invariants of the module documentation (all but the files, which the caller checks).
    pub fn check(&self) -> Result<(), String> {
        let pb = self.page_bytes as u64;
        let sized = |what: &str, bytes: u64, blocks: usize, cap: u64| {
            if bytes != blocks as u64 * pb {
                return Err(format!("{what}: {bytes} bytes in {blocks} pages of {pb} bytes"));
            }
            if bytes > cap {
                return Err(format!("{what}: {bytes} bytes over the capacity of {cap}"));
            }
            Ok(())
        };
        if let Some(h) = &self.host {
            h.pages.check("host tier")?;
            sized("host tier", h.pages.bytes(), h.pages.len(), h.capacity)?;
        }
        self.staged.check("staging")?;
        sized("staging", self.staged.bytes(), self.staged.len(), self.staged_cap as u64 * pb)?;
        if self.host.is_some() && self.staged.len() > 0 {
            return Err(format!("{} pages staged beside a host tier", self.staged.len()));
        }
        let Some(d) = &self.disk else {
            return if self.staged.len() > 0 {
                Err("pages staged without a disk tier".into())
            } else {
                Ok(())
            };
        };
        d.index.check("disk index")?;
        sized("disk tier", d.index.bytes(), d.index.len(), d.capacity)?;
        if let Some(n) = d.write_order.iter().find(|n| !d.pending.contains_key(n)) {
            return Err(format!("{n:?} in the write order but not pending"));
        }
        if d.pending.len() > d.write_order.len() + usize::from(self.writing) {
            return Err(format!(
                "{} pending writes, {} in the write order",
                d.pending.len(),
                d.write_order.len()
            ));
        }
        let queued: u64 = d.pending.values().map(|p| p.bytes.len() as u64).sum();
        if queued != d.queued_bytes || queued > d.queue_cap {
            return Err(format!(
                "write queue: {queued} bytes pending, {} counted, bound {}",
                d.queued_bytes, d.queue_cap
            ));
        }
        if let Some(n) = d.reads.iter().find(|n| !d.in_flight.contains(n)) {
            return Err(format!("{n:?} in the read queue but not in flight"));
        }
        if d.in_flight.len() > d.reads.len() + 1 {
            return Err(format!("{} reads in flight, {} queued", d.in_flight.len(), d.reads.len()));
        }
        Ok(())
    }

    /// The disk index's names (for the file check).
    pub fn disk_names(&self) -> Vec<BlockHash> {
        self.disk.as_ref().map_or_else(Vec::new, |d| d.index.entries().map(|(n, _)| n).collect())
    }
}
