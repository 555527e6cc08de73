//! Shared-memory KV segments: where they live, that they disappear with their pool, and that
//! segments left by dead processes are cleaned up while live ones are kept.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use tandem_engine::kv::shm::{remove_stale_segments, segment_dir, SEGMENT_PREFIX};
use tandem_engine::kv::{CpuKvPool, KvDtype, KvLayout};

const LAYOUT: KvLayout = KvLayout {
    num_layers: 2,
    num_blocks: 8,
    block_size: 4,
    num_kv_heads: 1,
    head_dim: 8,
    dtype: KvDtype::F16,
};

/// A private directory for segments, removed at the end.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("tandem-{tag}-{}-{}", std::process::id(), rand_suffix()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// The pid of a process that has exited.
fn dead_pid() -> u32 {
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn segment_lives_in_shm_and_is_removed_with_its_pool_and_sinks() {
    let mut pool = CpuKvPool::try_new_shared(LAYOUT).unwrap();
    let path = pool.segment_path().unwrap().to_path_buf();
    // Published by descriptor; no name of it is left in the segment directory (so a crash
    // leaves nothing there).
    assert!(path.starts_with(format!("/proc/{}/fd/", std::process::id())), "{}", path.display());
    let file_id = |p: &std::path::Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
    };
    let id = file_id(&path).expect("the descriptor names the segment");
    let named: Vec<_> = std::fs::read_dir(segment_dir())
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name().to_string_lossy().starts_with(SEGMENT_PREFIX) && file_id(&e.path()) == Some(id)
        })
        .map(|e| e.path())
        .collect();
    assert!(named.is_empty(), "the segment still has a name: {named:?}");
    // Header page plus every layer's K and V.
    let data = 2 * LAYOUT.num_layers * LAYOUT.num_blocks * LAYOUT.block_bytes();
    assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, 4096 + data);

    // The file holds the pool's bytes at the documented offsets: layer 1's V of block 3.
    let k = vec![0u8; LAYOUT.block_bytes()];
    let v: Vec<u8> = (0..LAYOUT.block_bytes()).map(|i| i as u8 | 1).collect();
    pool.write_block_bytes(1, 3, &k, &v).unwrap();
    let file = std::fs::read(&path).unwrap();
    let layer_bytes = LAYOUT.num_blocks * LAYOUT.block_bytes();
    let at = 4096 + (2 + 1) * layer_bytes + 3 * LAYOUT.block_bytes();
    assert_eq!(&file[at..at + v.len()], v.as_slice());
    assert_eq!(&file[..8], b"TNDMKVSG");
    // The header names the layout, dtype included.
    assert_eq!(&file[64..64 + LAYOUT.name().len()], b"tandem-f16-lkv-v1");

    // A sink keeps the segment alive after the pool is gone; the last one removes it.
    let sink = pool.sink();
    drop(pool);
    assert_eq!(file_id(&path), Some(id));
    assert_eq!(sink.segment_path().as_deref(), Some(path.as_path()));
    drop(sink);
    // The descriptor is closed: the path names nothing, or (its number reused) another file.
    assert_ne!(file_id(&path), Some(id), "{} still names the segment", path.display());

    // Private pools have no segment.
    assert!(CpuKvPool::try_new(LAYOUT).unwrap().segment_path().is_none());
}

#[test]
fn stale_segments_of_dead_processes_are_removed() {
    let dir = TempDir::new("shm-stale");
    let dead = dead_pid();
    let stale = dir.0.join(format!("{SEGMENT_PREFIX}{dead}-00000000deadbeef"));
    std::fs::write(&stale, b"left by a SIGKILLed worker").unwrap();
    // Our own pid: alive, kept.
    let mine = dir.0.join(format!("{SEGMENT_PREFIX}{}-0000000000000001", std::process::id()));
    std::fs::write(&mine, b"x").unwrap();
    // Not a segment name: never touched.
    let other = dir.0.join("tandem-kv-notapid");
    std::fs::write(&other, b"x").unwrap();
    // A segment named for a dead pid whose lock someone still holds (a live owner, as where
    // /proc cannot publish a segment by descriptor and its name stays): kept.
    let disguised = dir.0.join(format!("{SEGMENT_PREFIX}{dead}-00000000cafef00d"));
    std::fs::write(&disguised, b"x").unwrap();
    let live = std::fs::File::open(&disguised).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(unsafe { libc::flock(live.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);

    // Creating a pool in the directory cleans it, and leaves no name of its own there.
    let before = names(&dir.0);
    let pool = CpuKvPool::try_new_shared_in(LAYOUT, &dir.0).unwrap();
    assert!(!stale.exists(), "stale segment kept");
    assert!(mine.exists() && other.exists() && disguised.exists(), "{:?}", names(&dir.0));
    let after = names(&dir.0);
    assert_eq!(after.len(), before.len() - 1, "only the stale one went, nothing came: {after:?}");
    drop(pool);

    // The explicit call reports what it removed.
    std::fs::write(&stale, b"again").unwrap();
    assert_eq!(remove_stale_segments(&dir.0), vec![stale.clone()]);
    drop(live);
    // Its owner has let go of the lock: now the disguised one is stale too.
    assert_eq!(remove_stale_segments(&dir.0), vec![disguised]);
}
