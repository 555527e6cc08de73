//! The store against its contract: host LRU, the disk format and its checks at open and at read,
//! the directory rules, the write queue's bound, and a property test against a model.

use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use proptest::prelude::*;

use super::disk::{file_name, Header, HEADER_BYTES};
use super::*;
use crate::kv::{checksum, KvDtype};

const PAGE: usize = 256;

/// A directory under the system's temporary directory, removed (with its contents) on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tandem-kv-tier-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ident(model: &str) -> TierIdentity {
    TierIdentity {
        model: model.into(),
        layout: KvLayout {
            num_layers: 2,
            num_blocks: 16,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::F16,
        },
        windows: vec![None, Some(64)],
    }
}

fn name(n: u128) -> BlockHash {
    BlockHash(n.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) ^ 0xABCD)
}

/// The bytes of page `n` (any length): the same for the same `n`, different for another.
fn page(n: u128, len: usize) -> Vec<u8> {
    let mut x = (n as u64) ^ 0x2545_F491_4F6C_DD1D | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn spill(t: &KvTiers, n: u128) {
    let bytes = page(n, t.page_bytes());
    let crc = checksum::update(0, &bytes);
    t.spill(name(n), bytes, crc);
}

fn host_only(pages: u64) -> KvTiers {
    let opts = TierOptions { host_bytes: pages * PAGE as u64, ..TierOptions::default() };
    KvTiers::open(&opts, &ident("m"), PAGE).unwrap().unwrap()
}

fn disk_opts(dir: &Path, host_pages: u64, disk_pages: u64, persist: bool) -> TierOptions {
    TierOptions {
        host_bytes: host_pages * PAGE as u64,
        disk_dir: Some(dir.to_path_buf()),
        disk_bytes: disk_pages * PAGE as u64,
        disk_persist: persist,
    }
}

fn open(opts: &TierOptions, id: &TierIdentity) -> KvTiers {
    KvTiers::open(opts, id, PAGE).unwrap().unwrap()
}

fn open_err(opts: &TierOptions, id: &TierIdentity, page_bytes: usize) -> String {
    match KvTiers::open(opts, id, page_bytes) {
        Ok(_) => panic!("{opts:?} opened"),
        Err(e) => {
            assert_eq!(e.kind(), "tier");
            e.to_string()
        }
    }
}

/// Prefetches `names` and waits until none is in flight.
fn load(t: &KvTiers, names: &[BlockHash]) -> usize {
    let n = t.prefetch(names);
    let start = Instant::now();
    while t.in_flight(names) {
        assert!(start.elapsed() < Duration::from_secs(10), "reads did not finish");
        t.wait_loaded(Duration::from_millis(200));
    }
    n
}

fn flush(t: &KvTiers) {
    assert!(t.flush(Duration::from_secs(10)), "writes did not finish");
}

fn disk(t: &KvTiers) -> TierCounters {
    t.stats().disk.unwrap()
}

fn host(t: &KvTiers) -> TierCounters {
    t.stats().host.unwrap()
}

fn kvp_files(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .filter(|f| f.ends_with(".kvp") || f.ends_with(".tmp"))
        .collect()
}

#[test]
fn a_store_is_send_sync_and_options_enabling_nothing_open_nothing() {
    fn send_sync<T: Send + Sync + Clone>() {}
    send_sync::<KvTiers>();
    assert!(matches!(KvTiers::open(&TierOptions::default(), &ident("m"), PAGE), Ok(None)));
}

#[test]
fn the_host_tier_evicts_the_least_recent_page_and_refreshes_on_spill_and_get() {
    let t = host_only(3);
    assert!(t.has_host() && !t.has_disk());
    for n in 1..=3 {
        spill(&t, n);
    }
    spill(&t, 4); // evicts 1
    assert_eq!(t.contains(name(1)), None);
    spill(&t, 2); // already held: refreshed, not stored again
    spill(&t, 5); // evicts 3, the least recent now
    assert_eq!(t.contains(name(3)), None);
    assert_eq!(t.contains(name(2)), Some(TierKind::Host));
    assert_eq!(t.get(name(4)).as_deref().map(|p| &p[..]), Some(&page(4, PAGE)[..])); // 4 is now the most recent
    spill(&t, 6); // evicts 2
    assert_eq!(t.contains(name(2)), None);
    assert_eq!(t.get(name(2)), None);
    let order: Vec<_> = t.names(10).into_iter().map(|(n, k)| (n, k.name())).collect();
    assert_eq!(order, vec![(name(6), "host"), (name(4), "host"), (name(5), "host")]);
    assert_eq!(t.names(2).len(), 2);
    let h = host(&t);
    assert_eq!(
        h,
        TierCounters {
            capacity_bytes: 3 * PAGE as u64,
            bytes: 3 * PAGE as u64,
            blocks: 3,
            hits: 1,
            spills: 6,
            reloads: 1,
            drops: 0,
            evictions: 3,
            errors: 0,
            reload_seconds: 0.0
        }
    );
    assert_eq!(t.stats().disk, None);
    t.check().unwrap();
}

#[test]
fn a_page_of_the_wrong_length_is_dropped() {
    let t = host_only(2);
    t.spill(name(1), vec![0; PAGE - 1], 0);
    assert_eq!(t.contains(name(1)), None);
    assert_eq!((host(&t).drops, host(&t).blocks), (1, 0));
}

#[test]
fn options_that_cannot_work_are_refused_naming_the_flag() {
    let id = ident("m");
    let tmp = TempDir::new("opts");
    assert!(open_err(&TierOptions { host_bytes: 1 << 20, ..Default::default() }, &id, 0).contains("0 bytes"));
    let small = open_err(&TierOptions { host_bytes: 100, ..Default::default() }, &id, PAGE);
    assert!(small.contains("--kv-host-bytes 100"), "{small}");
    let zero = open_err(&disk_opts(&tmp.0, 0, 0, false), &id, PAGE);
    assert!(zero.contains("--kv-disk-bytes"), "{zero}");
    let missing = tmp.0.join("nope");
    let e = open_err(&disk_opts(&missing, 0, 4, false), &id, PAGE);
    assert_eq!(e, format!("KV tier: --kv-disk-dir {}: no such directory", missing.display()));
    let file = tmp.0.join("file");
    std::fs::write(&file, b"x").unwrap();
    let e = open_err(&disk_opts(&file, 0, 4, false), &id, PAGE);
    assert!(e.contains("--kv-disk-dir") && e.contains("not a directory"), "{e}");

    use std::os::unix::fs::PermissionsExt;
    let ro = tmp.0.join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    let opened = KvTiers::open(&disk_opts(&ro, 0, 4, false), &id, PAGE);
    // SAFETY: geteuid has no preconditions and touches no memory.
    let root = unsafe { libc::geteuid() } == 0;
    if root {
        eprintln!("running as root, which writes to a 0o555 directory: that refusal is not checked");
    } else {
        let e = opened.unwrap_err().to_string();
        assert!(e.contains("--kv-disk-dir") && e.contains("not writable"), "{e}");
    }
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
    // A directory nobody may create files in, root included.
    if Path::new("/proc/self").is_dir() {
        let e = open_err(&disk_opts(Path::new("/proc"), 0, 4, false), &id, PAGE);
        assert!(e.contains("--kv-disk-dir /proc: not writable"), "{e}");
    }
}

#[test]
fn pages_survive_a_restart_when_persisted() {
    let tmp = TempDir::new("persist");
    let id = ident("m");
    let opts = disk_opts(&tmp.0, 0, 16, true);
    {
        let t = open(&opts, &id);
        for n in 0..5 {
            spill(&t, n);
        }
        flush(&t);
        assert_eq!(disk(&t).spills, 5);
        t.check().unwrap();
    }
    let t = open(&opts, &id);
    assert_eq!(disk(&t).blocks, 5);
    for n in 0..5 {
        assert_eq!(t.contains(name(n)), Some(TierKind::Disk));
    }
    assert_eq!(t.get(name(1)), None, "get never reads disk");
    let names = [name(1), name(3)];
    assert_eq!(load(&t, &names), 2);
    assert_eq!(t.contains(name(1)), Some(TierKind::Host), "staged");
    assert_eq!(t.get(name(1)).as_deref().map(|p| &p[..]), Some(&page(1, PAGE)[..]));
    assert_eq!(t.get(name(3)).as_deref().map(|p| &p[..]), Some(&page(3, PAGE)[..]));
    assert_eq!(t.get(name(1)), None, "a staged page is taken by get");
    assert_eq!(t.contains(name(1)), Some(TierKind::Disk));
    let d = disk(&t);
    assert_eq!((d.hits, d.reloads, d.errors), (2, 2, 0));
    assert!(d.reload_seconds > 0.0);
    t.check().unwrap();
}

#[test]
fn without_persist_the_pages_of_an_earlier_run_are_wiped() {
    let tmp = TempDir::new("wipe");
    let id = ident("m");
    {
        let t = open(&disk_opts(&tmp.0, 0, 16, true), &id);
        spill(&t, 1);
        flush(&t);
    }
    let t = open(&disk_opts(&tmp.0, 0, 16, false), &id);
    assert_eq!(t.contains(name(1)), None);
    assert!(kvp_files(t.disk_path().unwrap()).is_empty());
}

#[test]
fn a_corrupted_payload_is_rejected_at_read_and_removed() {
    let tmp = TempDir::new("corrupt");
    let id = ident("m");
    let opts = disk_opts(&tmp.0, 0, 16, true);
    let sub = {
        let t = open(&opts, &id);
        spill(&t, 7);
        spill(&t, 8);
        flush(&t);
        t.disk_path().unwrap().to_path_buf()
    };
    let file = sub.join(file_name(name(7)));
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[HEADER_BYTES + 100] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let t = open(&opts, &id);
    assert_eq!(t.contains(name(7)), Some(TierKind::Disk), "the payload is not checked at open");
    load(&t, &[name(7), name(8)]);
    assert_eq!(t.get(name(7)), None);
    assert_eq!(t.get(name(8)).as_deref().map(|p| &p[..]), Some(&page(8, PAGE)[..]));
    assert_eq!(disk(&t).errors, 1);
    assert_eq!(t.contains(name(7)), None);
    assert!(!file.exists());
    t.check().unwrap();
}

#[test]
fn unusable_files_are_removed_at_open_and_foreign_ones_left_alone() {
    let tmp = TempDir::new("scan");
    let id = ident("m");
    let opts = disk_opts(&tmp.0, 0, 16, true);
    let sub = {
        let t = open(&opts, &id);
        for n in 0..4 {
            spill(&t, n);
        }
        flush(&t);
        t.disk_path().unwrap().to_path_buf()
    };
    // Truncated.
    let f0 = sub.join(file_name(name(0)));
    let b = std::fs::read(&f0).unwrap();
    std::fs::write(&f0, &b[..b.len() - 1]).unwrap();
    // Another identity's key, written by hand.
    let other_key = ident("other").key();
    let bytes = page(9, PAGE);
    let h = Header { key: other_key, name: name(9), len: PAGE as u64, crc: checksum::update(0, &bytes) };
    let f9 = sub.join(file_name(name(9)));
    std::fs::write(&f9, [&h.encode()[..], &bytes].concat()).unwrap();
    // Named after another page than its header says.
    let f1 = sub.join(file_name(name(1)));
    let f10 = sub.join(file_name(name(10)));
    std::fs::rename(&f1, &f10).unwrap();
    // An unfinished write, and a file that is none of ours.
    let tmpfile = sub.join(format!("{:032x}.tmp", name(11).0));
    std::fs::write(&tmpfile, b"partial").unwrap();
    let notes = sub.join("notes.txt");
    std::fs::write(&notes, b"hello").unwrap();

    let t = open(&opts, &id);
    assert_eq!(disk(&t).blocks, 2);
    for n in [0, 1, 9, 10, 11] {
        assert_eq!(t.contains(name(n)), None, "page {n}");
    }
    for n in [2, 3] {
        assert_eq!(t.contains(name(n)), Some(TierKind::Disk));
    }
    for f in [&f0, &f9, &f10, &tmpfile] {
        assert!(!f.exists(), "{} still there", f.display());
    }
    assert!(notes.exists());
    t.check().unwrap();
}

#[test]
fn a_directory_is_locked_by_its_user_and_other_identities_keep_to_their_own() {
    let tmp = TempDir::new("lock");
    let opts = disk_opts(&tmp.0, 0, 16, false);
    let a = open(&opts, &ident("a"));
    spill(&a, 1);
    flush(&a);
    let e = open_err(&opts, &ident("a"), PAGE);
    assert!(e.contains("in use by another worker") && e.contains(&tmp.0.display().to_string()), "{e}");
    // Another model in the same directory, even wiping at open, sees nothing of a's and keeps off.
    let b = open(&opts, &ident("b"));
    assert_eq!(b.contains(name(1)), None);
    assert_ne!(a.disk_path(), b.disk_path());
    assert!(a.disk_path().unwrap().join(file_name(name(1))).exists());
    assert_eq!(a.contains(name(1)), Some(TierKind::Disk));
    drop(b);
    drop(a);
    // The lock goes with the store.
    open(&disk_opts(&tmp.0, 0, 16, true), &ident("a"));
}

#[test]
fn the_disk_tier_evicts_its_oldest_files() {
    let tmp = TempDir::new("evict");
    let id = ident("m");
    let t = open(&disk_opts(&tmp.0, 0, 3, true), &id);
    for n in 0..3 {
        spill(&t, n);
    }
    flush(&t);
    spill(&t, 0); // refreshed: 1 is now the oldest
    spill(&t, 3);
    flush(&t);
    let sub = t.disk_path().unwrap().to_path_buf();
    let files = kvp_files(&sub);
    let want: BTreeSet<String> = [0, 2, 3].into_iter().map(|n| file_name(name(n))).collect();
    assert_eq!(files, want);
    assert_eq!(disk(&t).evictions, 1);
    assert_eq!(disk(&t).bytes, 3 * PAGE as u64);
    t.check().unwrap();
    drop(t);

    // Reopened smaller: the oldest by modification time go.
    for (n, age) in [(0u128, 30u64), (2, 10), (3, 20)] {
        let f = std::fs::File::options().write(true).open(sub.join(file_name(name(n)))).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(age)).unwrap();
    }
    let t = open(&disk_opts(&tmp.0, 0, 2, true), &id);
    assert_eq!(kvp_files(&sub), [2, 3].into_iter().map(|n| file_name(name(n))).collect());
    let order: Vec<_> = t.names(10).into_iter().map(|(n, _)| n).collect();
    assert_eq!(order, vec![name(2), name(3)], "most recent first");
    t.check().unwrap();
}

#[test]
fn the_write_queue_is_bounded_and_spill_never_waits() {
    let tmp = TempDir::new("queue");
    let page_bytes = 4096;
    let opts = TierOptions {
        host_bytes: 0,
        disk_dir: Some(tmp.0.clone()),
        disk_bytes: 1 << 30,
        disk_persist: false,
    };
    let t = KvTiers::open(&opts, &ident("m"), page_bytes).unwrap().unwrap();
    let bound = (16 << 20) / page_bytes as u64; // max(16 MiB, 64 pages)
    let total = 10_000u64;
    t.hold_writes(true);
    let bytes = page(1, page_bytes);
    let crc = checksum::update(0, &bytes);
    let start = Instant::now();
    for n in 0..total {
        t.spill(name(n as u128), bytes.clone(), crc);
    }
    let took = start.elapsed();
    assert!(took < Duration::from_secs(2), "10,000 spills took {took:?}");
    assert_eq!(t.stats().queued_write_bytes, bound * page_bytes as u64);
    assert_eq!(disk(&t).drops, total - bound);
    // A queued page is in memory: get hands it out (a disk hit) and it stays queued.
    assert_eq!(t.contains(name(0)), Some(TierKind::Host));
    assert_eq!(t.prefetch(&[name(0)]), 0);
    assert_eq!(t.get(name(0)).as_deref().map(|p| &p[..]), Some(&bytes[..]));
    assert_eq!(t.get(name(0)).as_deref().map(|p| &p[..]), Some(&bytes[..]));
    assert_eq!(disk(&t).hits, 2);
    assert_eq!(t.stats().queued_write_bytes, bound * page_bytes as u64);
    t.check().unwrap();
    t.hold_writes(false);
    flush(&t);
    let d = disk(&t);
    assert_eq!((d.spills, d.drops + d.spills), (bound, total));
    assert_eq!(t.stats().queued_write_bytes, 0);
    t.check().unwrap();
}

#[test]
fn a_write_failure_drops_the_queue_and_pauses_writing() {
    let tmp = TempDir::new("fail");
    let t = open(&disk_opts(&tmp.0, 2, 16, false), &ident("m"));
    t.hold_writes(true);
    spill(&t, 1);
    spill(&t, 2);
    // The directory vanishes under the store (as a disk would fail).
    std::fs::remove_dir_all(t.disk_path().unwrap()).unwrap();
    t.hold_writes(false);
    flush(&t);
    let d = disk(&t);
    assert_eq!((d.spills, d.drops, d.errors), (0, 2, 1), "one failure, the other page dropped with it");
    spill(&t, 3);
    assert_eq!(disk(&t).drops, 3, "refused during the back-off");
    assert_eq!(t.stats().queued_write_bytes, 0);
    // The host tier goes on.
    assert_eq!(t.get(name(3)).as_deref().map(|p| &p[..]), Some(&page(3, PAGE)[..]));
    t.check().unwrap();
}

#[test]
fn a_full_file_system_shrinks_the_tier_instead_of_pausing_it() {
    let tmp = TempDir::new("full");
    let t = open(&disk_opts(&tmp.0, 0, 16, false), &ident("m"));
    for n in 0..6 {
        spill(&t, n);
    }
    flush(&t);
    assert_eq!((disk(&t).blocks, disk(&t).capacity_bytes), (6, 16 * PAGE as u64));
    // The file system fills up under the tier: the page is dropped, the capacity becomes five
    // pages, and the two oldest are evicted to make room for the next write.
    t.fail_writes_full(1);
    spill(&t, 6);
    flush(&t);
    let d = disk(&t);
    assert_eq!((d.capacity_bytes, d.blocks, d.drops, d.evictions), (5 * PAGE as u64, 4, 1, 2));
    assert_eq!((t.contains(name(0)), t.contains(name(1)), t.contains(name(6))), (None, None, None));
    t.check().unwrap();
    // Writing goes on at once (no back-off), each page now evicting the oldest at five.
    for n in 7..12 {
        spill(&t, n);
    }
    flush(&t);
    let d = disk(&t);
    assert_eq!((d.blocks, d.spills, d.drops), (5, 11, 1));
    assert_eq!(t.contains(name(11)), Some(TierKind::Disk));
    let files = std::fs::read_dir(t.disk_path().unwrap())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "kvp"))
        .count();
    assert_eq!(files, 5, "evicted files deleted");
    t.check().unwrap();
    // Full again with fewer than two pages to give back is a failure: the tier backs off.
    let tiny = TempDir::new("full-tiny");
    let t = open(&disk_opts(&tiny.0, 0, 16, false), &ident("m"));
    spill(&t, 1);
    flush(&t);
    t.fail_writes_full(1);
    spill(&t, 2);
    flush(&t);
    spill(&t, 3);
    let d = disk(&t);
    assert_eq!((d.capacity_bytes, d.drops, d.errors), (16 * PAGE as u64, 2, 1), "paused, not shrunk");
    t.check().unwrap();
}

#[test]
fn a_shrunk_tier_grows_back_when_the_file_system_has_room() {
    let tmp = TempDir::new("regrow");
    let t = open(&disk_opts(&tmp.0, 0, 16, false), &ident("m"));
    for n in 0..6 {
        spill(&t, n);
    }
    flush(&t);
    t.fail_writes_full(1);
    spill(&t, 6);
    flush(&t);
    assert_eq!(disk(&t).capacity_bytes, 5 * PAGE as u64, "shrunk to what it held, less a page");
    // Room appears, but the tier looks only once the interval has passed.
    t.report_free_bytes(Some(4 * PAGE as u64));
    spill(&t, 7);
    flush(&t);
    assert_eq!(disk(&t).capacity_bytes, 5 * PAGE as u64, "not due yet");
    // Due: it grows by what is free less a page kept free, and looks again later.
    t.regrow_due_now();
    spill(&t, 8);
    flush(&t);
    let d = disk(&t);
    assert_eq!((d.capacity_bytes, d.blocks), (8 * PAGE as u64, 6));
    t.check().unwrap();
    for n in 9..12 {
        spill(&t, n);
    }
    flush(&t);
    // Two evictions made room at the shrink; now the regained room fills and one more goes.
    assert_eq!((disk(&t).blocks, disk(&t).evictions), (8, 3), "the pages fill the regained room");
    // Plenty of room: back to the capacity it was opened with, and no further.
    t.report_free_bytes(Some(1 << 40));
    t.regrow_due_now();
    spill(&t, 12);
    flush(&t);
    let d = disk(&t);
    assert_eq!((d.capacity_bytes, d.blocks), (16 * PAGE as u64, 9));
    assert_eq!(t.contains(name(12)), Some(TierKind::Disk));
    t.check().unwrap();
    // No room: it stays as it is.
    t.fail_writes_full(1);
    spill(&t, 13);
    flush(&t);
    let shrunk = disk(&t).capacity_bytes;
    assert!(shrunk < 16 * PAGE as u64);
    t.report_free_bytes(Some(PAGE as u64 / 2));
    t.regrow_due_now();
    spill(&t, 14);
    flush(&t);
    assert_eq!(disk(&t).capacity_bytes, shrunk, "less than a page free beyond the page kept free");
    t.check().unwrap();
}

#[test]
fn the_file_system_reports_its_free_bytes() {
    let tmp = TempDir::new("statvfs");
    let free = super::disk::free_bytes(&tmp.0).expect("statvfs on a temporary directory");
    assert!(free > 0, "a writable temporary directory has room");
    assert_eq!(super::disk::free_bytes(&tmp.0.join("missing")), None);
}

#[test]
fn a_spill_with_a_wrong_checksum_is_not_written() {
    let tmp = TempDir::new("crc");
    let t = open(&disk_opts(&tmp.0, 0, 16, false), &ident("m"));
    t.spill(name(1), page(1, PAGE), 12345);
    spill(&t, 2);
    flush(&t);
    let d = disk(&t);
    assert_eq!((d.spills, d.drops, d.errors), (1, 1, 1));
    assert_eq!(t.contains(name(1)), None);
    spill(&t, 3);
    flush(&t);
    assert_eq!(disk(&t).spills, 2, "no back-off for a page's own fault");
}

#[test]
fn dropping_the_store_finishes_the_queued_writes() {
    let tmp = TempDir::new("drop");
    let id = ident("m");
    let opts = disk_opts(&tmp.0, 0, 64, true);
    {
        let t = open(&opts, &id);
        for n in 0..40 {
            spill(&t, n);
        }
    }
    let t = open(&opts, &id);
    assert_eq!(disk(&t).blocks, 40);
}

#[test]
fn with_both_tiers_memory_wins_and_reloads_go_to_the_host_tier() {
    let tmp = TempDir::new("both");
    let t = open(&disk_opts(&tmp.0, 2, 16, false), &ident("m"));
    for n in 0..4 {
        spill(&t, n);
    }
    flush(&t);
    assert_eq!(t.contains(name(0)), Some(TierKind::Disk));
    assert_eq!(t.contains(name(3)), Some(TierKind::Host));
    let names: Vec<_> = t.names(10).into_iter().map(|(n, k)| (n, k.name())).collect();
    assert_eq!(
        names,
        vec![(name(3), "host"), (name(2), "host"), (name(1), "disk"), (name(0), "disk")],
        "written in order; the host tier holds the last two"
    );
    assert_eq!(load(&t, &[name(0), name(3)]), 1, "only what memory lacks is read");
    assert_eq!(t.contains(name(0)), Some(TierKind::Host));
    assert_eq!(t.contains(name(2)), Some(TierKind::Disk), "evicted from memory by the reload");
    assert_eq!(t.get(name(0)).as_deref().map(|p| &p[..]), Some(&page(0, PAGE)[..]));
    let (h, d) = (host(&t), disk(&t));
    assert_eq!((h.hits, d.hits, d.reloads, h.evictions), (1, 0, 1, 3));
    assert_eq!(t.names(1), vec![(name(0), TierKind::Host)]);
    t.check().unwrap();
}

#[test]
fn the_identity_key_covers_everything_but_the_pool_size() {
    let id = ident("sha256:aa");
    let key = id.key();
    assert_eq!(key, id.clone().key());
    let mut other = id.clone();
    other.layout.num_blocks = 9999;
    assert_eq!(other.key(), key, "the pool size does not matter");
    let changes: [fn(&mut TierIdentity); 8] = [
        |i| i.model = "sha256:ab".into(),
        |i| i.layout.num_layers += 1,
        |i| i.layout.block_size += 1,
        |i| i.layout.num_kv_heads += 1,
        |i| i.layout.head_dim += 1,
        |i| i.layout.dtype = KvDtype::Bf16,
        |i| i.windows = vec![None, None],
        |i| i.windows = vec![None],
    ];
    for (i, change) in changes.iter().enumerate() {
        let mut other = id.clone();
        change(&mut other);
        assert_ne!(other.key(), key, "change {i}");
    }
    assert_eq!(
        disk::hex(&key),
        GOLDEN_KEY,
        "the key of a fixed identity changed: old pages become unreadable"
    );
}

/// The key of `ident("sha256:aa")`, computed independently (Python hashlib over the documented text).
const GOLDEN_KEY: &str = "2fafc345fdcbf8f42c364468fe0584a1";

#[test]
fn header_round_trips_and_rejects_other_formats() {
    let h = Header { key: [7; 16], name: BlockHash(u128::MAX - 5), len: 4096, crc: 0xDEAD_BEEF };
    let b = h.encode();
    assert_eq!(&b[..8], b"TNDMKVP\0");
    assert_eq!(Header::decode(&b), Ok(h));
    let mut bad = b;
    bad[8] = 2;
    assert!(Header::decode(&bad).unwrap_err().contains("version 2"));
    bad = b;
    bad[0] = b'X';
    assert!(Header::decode(&bad).is_err());
}

#[test]
fn concurrent_users_see_only_whole_pages_and_the_invariants_hold() {
    for host_pages in [0, 3] {
        let tmp = TempDir::new("stress");
        let t = open(&disk_opts(&tmp.0, host_pages, 8, false), &ident("m"));
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let users: Vec<_> = (0..4u64)
                .map(|seed| {
                    let t = t.clone();
                    s.spawn(move || {
                        let mut x = seed * 7919 + 1;
                        for _ in 0..1500 {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            let n = (x >> 8) as u128 % 24;
                            match x % 5 {
                                0 | 1 => spill(&t, n),
                                2 => {
                                    if let Some(b) = t.get(name(n)) {
                                        assert_eq!(&b[..], &page(n, PAGE)[..], "page {n}");
                                    }
                                }
                                3 => {
                                    t.prefetch(&[name(n), name(n + 1)]);
                                    t.wait_loaded(Duration::from_millis(1));
                                }
                                _ => {
                                    let _ = t.contains(name(n));
                                }
                            }
                        }
                    })
                })
                .collect();
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    t.check().unwrap();
                    std::thread::sleep(Duration::from_micros(200));
                }
            });
            for u in users {
                u.join().unwrap();
            }
            stop.store(true, Ordering::Relaxed);
        });
        flush(&t);
        t.check().unwrap();
        let d = disk(&t);
        assert_eq!(d.errors, 0);
        assert_eq!(d.spills - d.evictions, d.blocks, "{d:?}");
        // Every name was written at least once; whether reads happened depends on the timing.
        assert!(d.spills >= 24 && d.evictions >= 16, "{d:?}");
    }
}

// ---- the property test ----

#[derive(Debug, Clone)]
enum Op {
    Spill(u8),
    Get(u8),
    /// Prefetch these and wait for the reads.
    Load(Vec<u8>),
    /// Let the held writer write the queue, and wait for it.
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..12).prop_map(Op::Spill),
        3 => (0u8..12).prop_map(Op::Get),
        2 => prop::collection::vec(0u8..12, 0..5).prop_map(Op::Load),
        1 => Just(Op::Flush),
    ]
}

/// What the store should hold: the host tier's names least recent first, the disk's write queue
/// (the writer is held between flushes) and written pages (with a capacity and a queue bound
/// that are never reached), and the staged names.
#[derive(Default)]
struct Model {
    host: Option<(usize, VecDeque<u8>)>,
    disk: Option<(BTreeSet<u8>, BTreeSet<u8>)>,
    staged: BTreeSet<u8>,
    host_hits: u64,
    disk_hits: u64,
    reloads: u64,
}

impl Model {
    fn queued(&self, n: u8) -> bool {
        self.disk.as_ref().is_some_and(|(queued, _)| queued.contains(&n))
    }

    fn in_memory(&self, n: u8) -> bool {
        self.host.as_ref().is_some_and(|(_, h)| h.contains(&n)) || self.staged.contains(&n) || self.queued(n)
    }

    fn put_host(&mut self, n: u8) -> bool {
        let Some((cap, h)) = self.host.as_mut() else { return false };
        if let Some(i) = h.iter().position(|&x| x == n) {
            h.remove(i);
        } else if h.len() == *cap {
            h.pop_front();
        }
        h.push_back(n);
        true
    }

    fn spill(&mut self, n: u8) {
        self.put_host(n);
        if let Some((queued, written)) = self.disk.as_mut() {
            if !written.contains(&n) {
                queued.insert(n);
            }
        }
    }

    fn get(&mut self, n: u8) -> bool {
        if self.host.as_ref().is_some_and(|(_, h)| h.contains(&n)) {
            self.put_host(n);
            self.host_hits += 1;
        } else if self.staged.remove(&n) || self.queued(n) {
            self.disk_hits += 1;
        } else {
            return false;
        }
        true
    }

    fn load(&mut self, names: &[u8]) {
        let Some((_, written)) = &self.disk else { return };
        let mut read = Vec::new();
        for &n in names {
            if !self.in_memory(n) && written.contains(&n) && !read.contains(&n) {
                read.push(n);
            }
        }
        for n in read {
            self.reloads += 1;
            if !self.put_host(n) {
                self.staged.insert(n);
            }
        }
    }

    fn flush(&mut self) {
        if let Some((queued, written)) = self.disk.as_mut() {
            written.append(queued);
        }
    }

    fn contains(&self, n: u8) -> Option<TierKind> {
        if self.in_memory(n) {
            Some(TierKind::Host)
        } else if self.disk.as_ref().is_some_and(|(_, written)| written.contains(&n)) {
            Some(TierKind::Disk)
        } else {
            None
        }
    }
}

fn run_model(host_pages: usize, with_disk: bool, ops: &[Op]) -> Result<(), TestCaseError> {
    let tmp = TempDir::new("prop");
    let opts = TierOptions {
        host_bytes: (host_pages * PAGE) as u64,
        disk_dir: with_disk.then(|| tmp.0.clone()),
        disk_bytes: 1 << 20,
        disk_persist: false,
    };
    let t = open(&opts, &ident("m"));
    t.hold_writes(true);
    let mut m = Model {
        host: (host_pages > 0).then(|| (host_pages, VecDeque::new())),
        disk: with_disk.then(Default::default),
        ..Model::default()
    };
    for op in ops {
        match op {
            Op::Spill(n) => {
                spill(&t, *n as u128);
                m.spill(*n);
            }
            Op::Get(n) => {
                let got = t.get(name(*n as u128));
                prop_assert_eq!(got.is_some(), m.get(*n), "get {}", n);
                if let Some(bytes) = got {
                    prop_assert_eq!(&bytes[..], &page(*n as u128, PAGE)[..], "bytes of {}", n);
                }
            }
            Op::Load(ns) => {
                let names: Vec<_> = ns.iter().map(|&n| name(n as u128)).collect();
                load(&t, &names);
                m.load(ns);
            }
            Op::Flush => {
                t.hold_writes(false);
                flush(&t);
                t.hold_writes(true);
                m.flush();
            }
        }
        if let Err(e) = t.check() {
            return Err(TestCaseError::fail(format!("after {op:?}: {e}")));
        }
        for n in 0u8..12 {
            prop_assert_eq!(t.contains(name(n as u128)), m.contains(n), "contains {} after {:?}", n, op);
        }
        let stats = t.stats();
        if let Some(h) = &stats.host {
            prop_assert!(h.bytes <= h.capacity_bytes);
            prop_assert_eq!(h.hits, m.host_hits);
        }
        if let Some(d) = &stats.disk {
            prop_assert_eq!((d.hits, d.reloads, d.drops, d.errors), (m.disk_hits, m.reloads, 0, 0));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn host_only_store_follows_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run_model(4, false, &ops)?;
    }

    #[test]
    fn host_and_disk_store_follows_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run_model(3, true, &ops)?;
    }

    #[test]
    fn disk_only_store_follows_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run_model(0, true, &ops)?;
    }
}

/// A copy that lands when its gate opens: until then `wait` blocks; then it writes each page's
/// bytes into the page's memory (as a GPU's copy engine would, after `spill_copied` returned),
/// or fails.
struct Gated {
    gate: std::sync::Arc<(std::sync::Mutex<Option<bool>>, std::sync::Condvar)>,
    /// (address of a page's memory, its bytes).
    land: std::sync::Mutex<Vec<(usize, Vec<u8>)>>,
    waits: std::sync::Arc<AtomicUsize>,
}

impl SpillCopy for Gated {
    fn wait(&self) -> Result<(), String> {
        self.waits.fetch_add(1, Ordering::SeqCst);
        let (m, cv) = &*self.gate;
        let mut open = m.lock().unwrap();
        while open.is_none() {
            open = cv.wait(open).unwrap();
        }
        if *open == Some(false) {
            return Err("the device reported an error".into());
        }
        for (addr, bytes) in self.land.lock().unwrap().drain(..) {
            // SAFETY: the store keeps each page's memory until this wait returns.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
        }
        Ok(())
    }
}

type Gate = std::sync::Arc<(std::sync::Mutex<Option<bool>>, std::sync::Condvar)>;

fn open_gate(gate: &Gate, ok: bool) {
    *gate.0.lock().unwrap() = Some(ok);
    gate.1.notify_all();
}

/// Hands pages `ns` to `t` with a copy that lands when `gate` opens (their memory holds a marker
/// until then). Returns the copy's wait counter.
fn spill_late(t: &KvTiers, ns: &[u128], gate: &Gate) -> std::sync::Arc<AtomicUsize> {
    let mut pages = Vec::new();
    let mut land = Vec::new();
    for &n in ns {
        let mut p = t.page();
        p.fill(0xA5);
        land.push((p.as_mut_ptr() as usize, page(n, t.page_bytes())));
        pages.push((name(n), p));
    }
    let waits = std::sync::Arc::new(AtomicUsize::new(0));
    let copy = Gated { gate: gate.clone(), land: std::sync::Mutex::new(land), waits: waits.clone() };
    t.spill_copied(pages, Some(Box::new(copy)));
    waits
}

fn new_gate() -> Gate {
    std::sync::Arc::new((std::sync::Mutex::new(None), std::sync::Condvar::new()))
}

#[test]
fn pages_whose_copy_is_in_flight_are_found_and_read_only_once_it_lands() {
    let dir = TempDir::new("late");
    let t = open(&disk_opts(&dir.0, 4, 8, true), &ident("m"));
    let gate = new_gate();
    let waits = spill_late(&t, &[1, 2], &gate);
    // Held for the engine's lookups while the copy is in flight, and counted as queued.
    assert_eq!(t.contains(name(1)), Some(TierKind::Host));
    assert_eq!(t.contains(name(2)), Some(TierKind::Host));
    assert_eq!(t.stats().queued_spill_bytes, 2 * PAGE as u64);
    // Nothing is stored or written before the bytes are there.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!((host(&t).blocks, host(&t).spills), (0, 0));
    assert!(kvp_files(&dir.0.join(format!("tandem-kv-{}", hex(&ident("m").key())))).is_empty());
    // A get waits for the copy (here: opens the gate from another thread after a while).
    let opener = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            open_gate(&gate, true);
        })
    };
    assert_eq!(t.get(name(2)).as_deref().map(|p| &p[..]), Some(&page(2, PAGE)[..]));
    opener.join().unwrap();
    assert_eq!(t.get(name(1)).as_deref().map(|p| &p[..]), Some(&page(1, PAGE)[..]));
    assert_eq!(waits.load(Ordering::SeqCst), 1, "one wait per batch, whoever settles it");
    // The checksum was taken over the landed bytes: the disk writer accepted both pages.
    flush(&t);
    assert_eq!((disk(&t).spills, disk(&t).errors, disk(&t).drops), (2, 0, 0));
    assert_eq!(t.stats().queued_spill_bytes, 0);
    t.check().unwrap();
}

fn hex(key: &[u8; 16]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_copy_that_fails_drops_its_pages_and_never_gives_their_memory_back() {
    let opts = TierOptions { host_bytes: 8 * PAGE as u64, ..TierOptions::default() };
    // An arena of 4 slots, whatever the store asks for.
    let alloc = |_: usize| -> Result<Option<Box<dyn HostMemory>>, String> {
        Ok(Some(Box::new(HeapMemory::labelled(4 * PAGE, "pinned"))))
    };
    let t = KvTiers::open_in(&opts, &ident("m"), PAGE, Some(&alloc)).unwrap().unwrap();
    let gate = new_gate();
    spill_late(&t, &[3, 4], &gate);
    open_gate(&gate, false);
    assert!(t.flush(Duration::from_secs(10)));
    assert_eq!(t.contains(name(3)), None);
    assert_eq!(t.get(name(4)), None);
    let h = host(&t);
    assert_eq!((h.blocks, h.spills, h.drops), (0, 0, 2));
    // The copy might still land in those two slots: they are not handed out again.
    let pages: Vec<Page> = (0..4).map(|_| t.page()).collect();
    assert_eq!(pages.iter().filter(|p| p.in_arena()).count(), 2);
    assert_eq!(t.stats().unpinned_pages, 2);
    t.check().unwrap();
}

#[test]
fn settling_the_spill_queue_waits_for_every_copy_handed_over() {
    let t = host_only(8);
    let gate = new_gate();
    let first = spill_late(&t, &[1], &gate);
    let second = spill_late(&t, &[2, 3], &gate);
    let opener = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            open_gate(&gate, true);
        })
    };
    t.settle_spills();
    assert_eq!((first.load(Ordering::SeqCst), second.load(Ordering::SeqCst)), (1, 1));
    assert_eq!(t.stats().queued_spill_bytes, 0);
    assert_eq!(host(&t).blocks, 3);
    opener.join().unwrap();
    t.check().unwrap();
}

#[test]
fn the_spill_queue_is_bounded_and_drops_what_does_not_fit() {
    // Pages of 256 KiB: the bound is 64 of them.
    let pb = 256 << 10;
    let cap = super::state::bound_pages(pb);
    assert_eq!(cap, 64);
    let opts = TierOptions { host_bytes: (cap as u64 + 8) * pb as u64, ..TierOptions::default() };
    let t = KvTiers::open(&opts, &ident("m"), pb).unwrap().unwrap();
    assert_eq!(t.spill_room(), cap);
    let gate = new_gate();
    let first: Vec<u128> = (0..cap as u128 - 1).collect();
    spill_late(&t, &first, &gate);
    assert_eq!(t.spill_room(), 1);
    // Three more: one fits, two are dropped.
    spill_late(&t, &[5000, 5001, 5002], &gate);
    assert!(!first.contains(&5000));
    assert_eq!(t.spill_room(), 0);
    assert_eq!(host(&t).drops, 2);
    open_gate(&gate, true);
    assert!(t.flush(Duration::from_secs(10)));
    assert_eq!(t.spill_room(), cap);
    assert_eq!(host(&t).blocks, cap as u64);
    assert_eq!(t.contains(name(5000)), Some(TierKind::Host));
    assert_eq!(t.contains(name(5001)), None);
    t.check().unwrap();
}

#[test]
fn a_store_dropped_with_copies_in_flight_waits_for_them_and_writes_them() {
    let dir = TempDir::new("late-drop");
    let opts = disk_opts(&dir.0, 0, 8, true);
    let gate = new_gate();
    {
        let t = open(&opts, &ident("m"));
        spill_late(&t, &[7, 8], &gate);
        let opener = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                open_gate(&gate, true);
            })
        };
        drop(t);
        opener.join().unwrap();
    }
    let t = open(&opts, &ident("m"));
    assert_eq!(load(&t, &[name(7), name(8)]), 2);
    assert_eq!(t.get(name(7)).as_deref().map(|p| &p[..]), Some(&page(7, PAGE)[..]));
    assert_eq!(t.get(name(8)).as_deref().map(|p| &p[..]), Some(&page(8, PAGE)[..]));
}

#[test]
fn pages_live_in_the_host_memory_given_and_overflow_to_the_heap() {
    let dir = TempDir::new("arena");
    let opts = disk_opts(&dir.0, 4, 16, true);
    let asked = std::sync::Mutex::new(0usize);
    let alloc = |bytes: usize| -> Result<Option<Box<dyn HostMemory>>, String> {
        *asked.lock().unwrap() = bytes;
        // Room for 3 of the host tier's 4 pages: the rest overflows.
        Ok(Some(Box::new(HeapMemory::labelled(3 * PAGE, "pinned"))))
    };
    let t = KvTiers::open_in(&opts, &ident("m"), PAGE, Some(&alloc)).unwrap().unwrap();
    let bound = super::state::bound_pages(PAGE);
    // The host tier, the write queue and the spill queue.
    assert_eq!(*asked.lock().unwrap(), (4 + 2 * bound) * PAGE);
    assert_eq!(t.stats().host_memory, "pinned");
    let p = t.page();
    assert!(p.in_arena());
    drop(p);
    let gate = new_gate();
    open_gate(&gate, true);
    for n in 0..12u128 {
        spill_late(&t, &[n], &gate);
        assert!(t.flush(Duration::from_secs(10)));
    }
    // The host tier holds the last 4, all read back right, whether in a slot or not.
    for n in 8..12u128 {
        assert_eq!(t.get(name(n)).as_deref().map(|p| &p[..]), Some(&page(n, PAGE)[..]), "page {n}");
    }
    assert_eq!(load(&t, &[name(0)]), 1);
    assert_eq!(t.get(name(0)).as_deref().map(|p| &p[..]), Some(&page(0, PAGE)[..]));
    assert!(t.stats().unpinned_pages > 0, "{:?}", t.stats());
    t.check().unwrap();

    // An allocation that fails is refused at open, naming the flag.
    let refuse = |_: usize| -> Result<Option<Box<dyn HostMemory>>, String> { Err("out of memory".into()) };
    let err = KvTiers::open_in(&opts, &ident("m2"), PAGE, Some(&refuse)).unwrap_err().to_string();
    assert!(err.contains("--kv-host-bytes") && err.contains("out of memory"), "{err}");
}
