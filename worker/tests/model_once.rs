//! A model is read once at start-up: loading it opens each of its files once (the fingerprint
//! hashes the bytes the parser mapped), and everything built afterwards (the engine, the
//! compatibility record) comes from the loaded value, never from the path again.
//!
//! Opens are counted with inotify on a private copy of a fixture model, so the count is the
//! kernel's, not the loader's own bookkeeping.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use clap::Parser;
use tandem_serve::identity::model_identity;
use tandem_worker::{build_engine, WorkerArgs};
use tandem_worker::{compat_record, Model};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures")
}

/// A fresh directory holding copies of `files`.
fn copy_of(files: &[PathBuf]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tandem-model-once-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for f in files {
        std::fs::copy(f, dir.join(f.file_name().unwrap())).unwrap();
    }
    dir
}

fn hf_copy() -> PathBuf {
    let src = fixtures().join("llama-gqa");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&src).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    copy_of(&files)
}

/// Counts the opens of the files in one directory, by name, while alive.
///
/// inotify merges an event into the previous one when both are identical and unread, and a file
/// that is mapped stays open after its descriptor is closed, so two opens of one mapped file
/// would be one event. Each file is therefore watched twice, as itself and through its directory:
/// the two watches' events alternate, no two in a row are identical, and the directory's are
/// counted.
struct OpenCounter {
    fd: i32,
}

impl OpenCounter {
    fn watch(dir: &Path) -> OpenCounter {
        let counter = OpenCounter::watch_one(dir);
        for entry in std::fs::read_dir(dir).unwrap() {
            counter.add(&entry.unwrap().path());
        }
        counter
    }

    fn add(&self, path: &Path) {
        let path = CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: `path` is a valid NUL-terminated string that outlives the call.
        let wd = unsafe { libc::inotify_add_watch(self.fd, path.as_ptr(), libc::IN_OPEN) };
        assert!(wd >= 0, "inotify_add_watch: {}", std::io::Error::last_os_error());
    }

    fn watch_one(dir: &Path) -> OpenCounter {
        // SAFETY: plain system calls; the path is a valid NUL-terminated string that outlives the
        // call, and the descriptor is checked before use and closed in `Drop`.
        unsafe {
            let fd = libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC);
            assert!(fd >= 0, "inotify_init1: {}", std::io::Error::last_os_error());
            let path = CString::new(dir.as_os_str().as_bytes()).unwrap();
            let wd = libc::inotify_add_watch(fd, path.as_ptr(), libc::IN_OPEN);
            assert!(wd >= 0, "inotify_add_watch: {}", std::io::Error::last_os_error());
            OpenCounter { fd }
        }
    }

    /// Opens seen so far, by file name.
    fn opens(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            // SAFETY: `buf` is valid for writes of its whole length, which is what we pass.
            let n = unsafe { libc::read(self.fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            let mut at = 0usize;
            let header = std::mem::size_of::<libc::inotify_event>();
            while at + header <= n as usize {
                // SAFETY: the kernel wrote a whole event header at `at` (checked against `n`);
                // `read_unaligned` needs no alignment.
                let ev: libc::inotify_event = unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
                let name = &buf[at + header..at + header + ev.len as usize];
                let name =
                    String::from_utf8_lossy(name.split(|&b| b == 0).next().unwrap_or(&[])).into_owned();
                if ev.mask & libc::IN_OPEN != 0 && !name.is_empty() {
                    *out.entry(name).or_insert(0) += 1;
                }
                at += header + ev.len as usize;
            }
        }
        out
    }
}

impl Drop for OpenCounter {
    fn drop(&mut self) {
        // SAFETY: `fd` is the descriptor `watch` opened, closed only here.
        unsafe { libc::close(self.fd) };
    }
}

#[test]
fn loading_a_model_opens_each_of_its_files_once() {
    let dir = hf_copy();
    let counter = OpenCounter::watch(&dir);
    let model = Model::load(&dir).expect("fixture model");
    let opens = counter.opens();
    // Config and weights are parsed and fingerprinted from one read each.
    assert_eq!(opens.get("config.json"), Some(&1), "{opens:?}");
    assert_eq!(opens.get("model.safetensors"), Some(&1), "{opens:?}");
    assert_eq!(model.identity.model_id, model.loaded.model_id);
    // The id does not depend on where the files are, and is what a reader without weights sees.
    assert_eq!(model.identity.model_id, model_identity(&fixtures().join("llama-gqa")).unwrap().model_id);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn reading_a_gguf_identity_opens_the_file_once() {
    let dir = copy_of(&[fixtures().join("gguf-tokenizers/tiny-smollm.gguf")]);
    let counter = OpenCounter::watch(&dir);
    let id = model_identity(&dir.join("tiny-smollm.gguf")).expect("fixture GGUF");
    let opens = counter.opens();
    assert_eq!(opens.get("tiny-smollm.gguf"), Some(&1), "{opens:?}");
    assert!(id.model_id.starts_with("sha256:"), "{}", id.model_id);
    assert_eq!(id.model_id, tandem_serve::identity::fingerprint(&dir.join("tiny-smollm.gguf")).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    worker: WorkerArgs,
}

#[test]
fn the_engine_and_the_compatibility_record_come_from_the_loaded_value() {
    let dir = hf_copy();
    let model = Model::load(&dir).expect("fixture model");
    let expected_id = model.identity.model_id.clone();
    // Nothing after loading may need the files.
    std::fs::remove_dir_all(&dir).unwrap();
    let flags =
        Flags::try_parse_from(["w", "--kv-blocks", "8", "--block-size", "4", "--threads", "1"]).unwrap();
    let mut built = build_engine(&flags.worker, model, false, None).expect("engine from the loaded model");
    let compat = compat_record(&built.identity, &built.layout, built.engine.kv_windows());
    assert_eq!(compat.model_id, expected_id);
    assert_eq!((compat.block_size, built.layout.num_blocks), (4, 8));
    let prompt = built.engine.tokenizer().encode("hello world", true).unwrap();
    assert!(!prompt.is_empty());
    let params = tandem_engine::sampler::SamplingParams { max_tokens: 2, ..Default::default() };
    built.engine.add_request(prompt, params).expect("a request");
    let mut tokens = 0;
    while built.engine.has_work() {
        for ev in built.engine.step().expect("a step") {
            if let tandem_engine::scheduler::SeqEvent::Token { .. } = ev {
                tokens += 1;
            }
        }
    }
    assert!(tokens >= 1, "the engine built from the loaded model generates");
}
