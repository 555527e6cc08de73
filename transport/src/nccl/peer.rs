//! A two-rank NCCL communicator owned by one thread.
//!
//! NCCL wants a communicator driven from one thread, so [`NcclPeer`] is a handle: the thread
//! (`nccl-peer-r<rank>`) creates the communicator and a stream of its own, then runs the jobs
//! the handle sends it one at a time. Every NCCL call on the communicator is made on that
//! thread; the handle only sends jobs and waits for answers, each with a deadline, so a peer
//! that never shows up costs a timeout, not a hang.
//!
//! Once something went wrong (an NCCL or CUDA error, a timeout, [`NcclPeer::abort`]) the
//! communicator is aborted and the peer is *broken*: every later call fails with
//! [`NcclError::Broken`] and the original reason. A broken peer is not repaired; connect a new
//! one with a new unique id.
//!
//! A communicator is never destroyed with `ncclCommDestroy`, only aborted (see `Comm`): the two
//! ranks live in different processes that tear down independently, and destroy waits for the
//! other rank.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{cuStreamQuery, CUresult};
use cudarc::driver::{CudaContext, CudaStream};

use super::ffi::{NcclComm, RawUniqueId, NCCL_IN_PROGRESS, NCCL_SUCCESS, NCCL_UINT8};
use super::{groups, NcclError, NcclLib, UniqueId};

/// Pause between two looks at a running transfer.
const POLL: Duration = Duration::from_micros(50);
/// How long past a job's deadline the handle waits for the thread's answer before it decides the
/// thread is stuck inside NCCL.
const ANSWER_GRACE: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Send,
    Recv,
}

impl Direction {
    fn call(self) -> &'static str {
        match self {
            Direction::Send => "ncclSend",
            Direction::Recv => "ncclRecv",
        }
    }
}

enum Job {
    Transfer {
        direction: Direction,
        pieces: Vec<(u64, usize)>,
        timeout: Duration,
        deadline: Instant,
        answer: mpsc::SyncSender<Result<(), NcclError>>,
    },
    Abort,
}

/// What the handle and the thread share.
#[derive(Default)]
struct Shared {
    /// Why the peer is broken; None while it is usable.
    broken: Mutex<Option<String>>,
    /// The thread is running a transfer (it may be touching the pieces' memory).
    busy: AtomicBool,
    /// A transfer's answer did not come back in time: the thread is inside an NCCL call that has
    /// not returned, so dropping the handle does not wait for it.
    stuck: AtomicBool,
}

impl Shared {
    fn broken(&self) -> Option<String> {
        self.broken.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Marks the peer broken; the first reason is kept.
    fn set_broken(&self, why: String) {
        let mut b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        if b.is_none() {
            *b = Some(why);
        }
    }
}

/// One end of a two-rank NCCL communicator: rank 0 is the prefill worker (it sends), rank 1 the
/// decode worker (it receives). See the module docs for the threading and failure rules.
pub struct NcclPeer {
    rank: u32,
    ordinal: usize,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for NcclPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclPeer")
            .field("rank", &self.rank)
            .field("ordinal", &self.ordinal)
            .field("broken", &self.shared.broken())
            .finish()
    }
}

impl NcclPeer {
    /// Joins the communicator `id` as `rank` (0 or 1) on the device of `ctx`, on a new thread.
    /// Returns once `ncclCommInitRank` did, which needs the other rank to join with the same id.
    ///
    /// If that takes longer than `timeout`, returns [`NcclError::Timeout`]. The thread stays
    /// blocked in `ncclCommInitRank` until NCCL gives up or the other rank arrives; then it
    /// aborts the communicator and exits. Nothing else is left behind.
    pub fn connect(
        lib: &'static NcclLib,
        ctx: Arc<CudaContext>,
        id: UniqueId,
        rank: u32,
        timeout: Duration,
    ) -> Result<NcclPeer, NcclError> {
        if rank > 1 {
            return Err(NcclError::Invalid(format!(
                "NCCL rank {rank}: a two-rank communicator has ranks 0 and 1"
            )));
        }
        let ordinal = ctx.ordinal();
        let shared = Arc::new(Shared::default());
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (jobs_tx, jobs_rx) = mpsc::channel();
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("nccl-peer-r{rank}"))
            .spawn(move || run(lib, ctx, id, rank, ready_tx, jobs_rx, thread_shared))
            .map_err(|e| NcclError::Thread(format!("cannot start the NCCL thread of rank {rank}: {e}")))?;
        match ready_rx.recv_timeout(timeout) {
            Ok(Ok(())) => Ok(NcclPeer { rank, ordinal, jobs: Some(jobs_tx), thread: Some(thread), shared }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            // Dropping `jobs_tx` and `thread` detaches the thread: when init returns it finds no
            // handle and cleans up.
            Err(mpsc::RecvTimeoutError::Timeout) => Err(NcclError::Timeout {
                what: format!(
                    "joining the NCCL communicator as rank {rank} on cuda:{ordinal} (ncclCommInitRank waits \
                     for the other rank: is it connecting with the same unique id?)"
                ),
                after: timeout,
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(NcclError::Thread(format!(
                "the NCCL thread of rank {rank} ended while joining the communicator (it panicked)"
            ))),
        }
    }

    /// Sends `pieces` (device address, bytes) in order to the other rank, in NCCL groups of at
    /// most [`MAX_GROUP_OPS`](super::MAX_GROUP_OPS) pieces ([`groups`](super::groups)), and
    /// waits until they have left (the stream is done), at most `timeout` (counted from this
    /// call, including time spent behind another call on this peer). Pieces of 0 bytes are
    /// skipped. The receiver must post the same number of nonzero pieces with the same sizes in
    /// the same order (see [`runs`](fn@super::runs)); it then cuts the same groups.
    ///
    /// # Safety
    /// Every piece must be device memory readable from this peer's context for its whole length,
    /// and must stay allocated and unwritten until this call returns; if it returns
    /// [`NcclError::Timeout`], until [`is_busy`](Self::is_busy) is false.
    pub unsafe fn send(&self, pieces: Vec<(u64, usize)>, timeout: Duration) -> Result<(), NcclError> {
        self.transfer(Direction::Send, pieces, timeout)
    }

    /// Receives `pieces` (device address, bytes) in order from the other rank, in the same NCCL
    /// groups as the sender, and waits until they have arrived, at most `timeout`; otherwise as
    /// [`send`](Self::send).
    ///
    /// # Safety
    /// Every piece must be device memory writable from this peer's context for its whole length,
    /// that nothing else reads or writes until this call returns; if it returns
    /// [`NcclError::Timeout`], until [`is_busy`](Self::is_busy) is false. After an error the
    /// pieces hold partial data.
    pub unsafe fn recv(&self, pieces: Vec<(u64, usize)>, timeout: Duration) -> Result<(), NcclError> {
        self.transfer(Direction::Recv, pieces, timeout)
    }

    fn transfer(
        &self,
        direction: Direction,
        pieces: Vec<(u64, usize)>,
        timeout: Duration,
    ) -> Result<(), NcclError> {
        if let Some(why) = self.shared.broken() {
            return Err(NcclError::Broken(why));
        }
        let rank = self.rank;
        let gone = || NcclError::Thread(format!("the NCCL thread of rank {rank} has ended"));
        let (answer, answer_rx) = mpsc::sync_channel(1);
        let deadline = Instant::now() + timeout;
        let jobs = self.jobs.as_ref().ok_or_else(gone)?;
        jobs.send(Job::Transfer { direction, pieces, timeout, deadline, answer }).map_err(|_| gone())?;
        match answer_rx.recv_timeout(timeout + ANSWER_GRACE) {
            Ok(result) => result,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let what = format!(
                    "{} on rank {rank}: the NCCL thread is blocked inside NCCL (is the other rank posting \
                     the matching {}?)",
                    direction.call(),
                    match direction {
                        Direction::Send => "ncclRecv",
                        Direction::Recv => "ncclSend",
                    }
                );
                let err = NcclError::Timeout { what, after: timeout };
                self.shared.stuck.store(true, Ordering::SeqCst);
                self.shared.set_broken(err.to_string());
                Err(err)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let err = gone();
                self.shared.set_broken(err.to_string());
                Err(err)
            }
        }
    }

    /// Marks the peer broken and has its thread abort the communicator (after the job it is
    /// running, if any). Later calls fail with [`NcclError::Broken`].
    pub fn abort(&self) {
        self.shared.set_broken(format!("rank {} was aborted by its owner", self.rank));
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Job::Abort);
        }
    }

    /// Whether the peer is broken (every call fails).
    pub fn is_broken(&self) -> bool {
        self.shared.broken().is_some()
    }

    /// Whether the thread is running a transfer, so the memory of its pieces may still be in use.
    pub fn is_busy(&self) -> bool {
        self.shared.busy.load(Ordering::SeqCst)
    }

    /// This end's rank: 0 sends, 1 receives.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The CUDA device this end runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl Drop for NcclPeer {
    /// Ends the thread, which aborts the communicator (never waiting for the other rank), and
    /// waits for it, unless it is stuck inside NCCL: then it is left to clean up when NCCL
    /// returns.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            if self.shared.stuck.load(Ordering::SeqCst) {
                tracing::warn!(
                    rank = self.rank,
                    "NCCL thread is blocked inside NCCL; leaving it to end by itself"
                );
            } else {
                let _ = thread.join();
            }
        }
    }
}

/// The communicator, owned by the thread. Dropping it aborts it.
///
/// Why abort and never `ncclCommDestroy`: destroy of a communicator that was not aborted runs a
/// barrier with the other ranks on the node, so it returns only once the other rank destroys
/// too. Prefill and decode are separate processes that never tear a communicator down together
/// (a prefill worker shutting down, an eviction past the link table's size on one side, a connect
/// that timed out on one side), so one side's destroy would block until the other's, possibly
/// forever, and [`NcclPeer`]'s drop joins this thread. Abort releases the local resources without
/// waiting for anyone; when the peer is dropped no transfer is in flight (each one waits for its
/// stream), so nothing is cut short. The other rank then sees an error on its next use and is
/// replaced, as after any failure.
struct Comm {
    lib: &'static NcclLib,
    raw: NcclComm,
    rank: u32,
}

impl Comm {
    /// Aborts the communicator now, if not done yet; later calls on it are refused by the broken
    /// flag (or, from [`Drop`], there are none).
    fn abort(&mut self) {
        if self.raw.is_null() {
            return;
        }
        // SAFETY: `raw` came from a successful ncclCommInitRank on this thread and is nulled
        // right after, so it is aborted once and never used again.
        let rc = unsafe { (self.lib.comm_abort)(self.raw) };
        self.raw = std::ptr::null_mut();
        if rc != NCCL_SUCCESS {
            tracing::warn!(rank = self.rank, "ncclCommAbort: {}", self.lib.error_string(rc));
        }
    }
}

impl Drop for Comm {
    /// Aborts, never destroys: see the type's docs.
    fn drop(&mut self) {
        self.abort();
    }
}

/// The peer's thread: set up, say so, then run jobs until the handle is gone.
fn run(
    lib: &'static NcclLib,
    ctx: Arc<CudaContext>,
    id: UniqueId,
    rank: u32,
    ready: mpsc::SyncSender<Result<(), NcclError>>,
    jobs: mpsc::Receiver<Job>,
    shared: Arc<Shared>,
) {
    let (stream, mut comm) = match setup(lib, &ctx, id, rank) {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    if ready.send(Ok(())).is_err() {
        return; // connect gave up; `comm` is aborted on the way out
    }
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Abort => comm.abort(),
            Job::Transfer { direction, pieces, timeout, deadline, answer } => {
                shared.busy.store(true, Ordering::SeqCst);
                let result = match shared.broken() {
                    Some(why) => Err(NcclError::Broken(why)),
                    None => transfer(&comm, &stream, direction, &pieces, timeout, deadline),
                };
                if let Err(e) = &result {
                    if !matches!(e, NcclError::Broken(_)) {
                        shared.set_broken(e.to_string());
                        comm.abort();
                        // What the aborted group left on the stream ends before the pieces'
                        // memory is declared free (`busy` false); if it never ends, the memory
                        // stays claimed.
                        let _ = stream.synchronize();
                    }
                }
                shared.busy.store(false, Ordering::SeqCst);
                let _ = answer.send(result);
            }
        }
    }
    // The handle is gone: `comm` is aborted before `stream` is released.
    drop(comm);
    drop(stream);
}

fn setup(
    lib: &'static NcclLib,
    ctx: &Arc<CudaContext>,
    id: UniqueId,
    rank: u32,
) -> Result<(Arc<CudaStream>, Comm), NcclError> {
    let ordinal = ctx.ordinal();
    let cuda = |what: &str, e: cudarc::driver::DriverError| NcclError::Cuda {
        what: format!("{what} on cuda:{ordinal} for NCCL rank {rank}"),
        msg: e.to_string(),
    };
    tandem_engine::cuda::bind(ctx).map_err(|e| cuda("binding the context to the NCCL thread", e))?;
    let stream = ctx.new_stream().map_err(|e| cuda("creating the NCCL stream", e))?;
    let mut raw: NcclComm = std::ptr::null_mut();
    // SAFETY: `raw` is a writable slot for the new communicator; the id is passed by value with
    // ncclUniqueId's layout; the device is the one bound to this thread just above.
    let rc = unsafe { (lib.comm_init_rank)(&mut raw, 2, RawUniqueId { internal: id.0 }, rank as c_int) };
    lib.check(&format!("ncclCommInitRank (rank {rank} of 2 on cuda:{ordinal})"), rc)?;
    Ok((stream, Comm { lib, raw, rank }))
}

/// Posts every nonzero piece, in the groups [`groups`] cuts, then waits for the stream, watching
/// for NCCL's asynchronous errors, until `deadline`. The groups go on the stream one after the
/// other and nothing waits between them: only the total is waited for.
fn transfer(
    comm: &Comm,
    stream: &CudaStream,
    direction: Direction,
    pieces: &[(u64, usize)],
    timeout: Duration,
    deadline: Instant,
) -> Result<(), NcclError> {
    let lib = comm.lib;
    let peer = 1 - comm.rank as c_int;
    let pieces: Vec<(u64, usize)> = pieces.iter().copied().filter(|&(_, len)| len > 0).collect();
    if pieces.is_empty() {
        return Ok(());
    }
    let total: usize = pieces.iter().map(|p| p.1).sum();
    let s = stream.cu_stream();

    // Both ranks hold the same number of nonzero pieces, so they cut the same groups.
    for group in groups(pieces.len()) {
        let first = group.start;
        // SAFETY: no arguments; opens a group on this thread, closed below on every path.
        lib.check("ncclGroupStart", unsafe { (lib.group_start)() })?;
        let mut posted = Ok(());
        for (i, &(addr, len)) in pieces[group].iter().enumerate() {
            let i = first + i;
            let buf = addr as usize as *mut c_void;
            // SAFETY: `comm.raw` is this thread's live communicator (not aborted: the peer is not
            // broken) and `s` its stream; the caller of send/recv vouched for the memory.
            let rc = unsafe {
                match direction {
                    Direction::Send => (lib.send)(buf, len, NCCL_UINT8, peer, comm.raw, s),
                    Direction::Recv => (lib.recv)(buf, len, NCCL_UINT8, peer, comm.raw, s),
                }
            };
            if let Err(e) =
                lib.check(&format!("{} of piece {i} ({len} bytes at {addr:#x})", direction.call()), rc)
            {
                posted = Err(e);
                break;
            }
        }
        // SAFETY: closes the group opened above.
        let ended =
            lib.check(&format!("ncclGroupEnd (group from piece {first})"), unsafe { (lib.group_end)() });
        posted?;
        ended?;
    }

    loop {
        let mut async_rc = NCCL_SUCCESS;
        // SAFETY: live communicator of this thread; writes one result into `async_rc`.
        let rc = unsafe { (lib.comm_get_async_error)(comm.raw, &mut async_rc) };
        lib.check("ncclCommGetAsyncError", rc)?;
        if async_rc != NCCL_SUCCESS && async_rc != NCCL_IN_PROGRESS {
            return lib
                .check(&format!("{} to/from rank {peer} (asynchronous error)", direction.call()), async_rc);
        }
        // SAFETY: `s` is this thread's stream, alive while `stream` is borrowed; the context is
        // bound to this thread.
        match unsafe { cuStreamQuery(s) } {
            CUresult::CUDA_SUCCESS => return Ok(()),
            CUresult::CUDA_ERROR_NOT_READY => {}
            other => {
                return Err(NcclError::Cuda {
                    what: format!("waiting for the {} stream of rank {}", direction.call(), comm.rank),
                    msg: format!("{other:?}"),
                })
            }
        }
        if Instant::now() >= deadline {
            return Err(NcclError::Timeout {
                what: format!(
                    "{} of {} pieces ({total} bytes) between rank {} and rank {peer}",
                    direction.call(),
                    pieces.len(),
                    comm.rank
                ),
                after: timeout,
            });
        }
        std::thread::sleep(POLL);
    }
}
