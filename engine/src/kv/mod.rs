//! The paged KV cache: who owns which block, where the bytes live, and how a forward pass writes them.
//!
//! - [`allocator`]: a pure, reference-counted block allocator (sequences, forks, copy-on-write,
//!   raw reservations for incoming transfers) with an invariant checker.
//! - [`reservation`]: the decode side's reservation table, the one owner of a reservation's
//!   state, lease and blocks (reserved → filling → filled → adopted, or released / expired); it
//!   drives the allocator.
//! - [`layout`]: the pool's shape ([`KvLayout`]), part of the compatibility record.
//! - [`groups`]: layer groups of a model with sliding-window layers: pages per token block, and
//!   which pages a window group gives back as the sequence grows.
//! - [`dtype`]: the element type of the pool ([`KvDtype`]: f32, f16, bf16 or fp8) and the conversions
//!   from and to the f32 the backends compute in.
//! - [`block_io`]: how a transfer receiver or sender outside the engine thread reaches blocks.
//! - [`checksum`]: block checksums (CRC-32), and a copy that computes one as it goes.
//! - [`pool`]: CPU storage, per layer one K and one V tensor `[num_blocks, block_size, kv_heads, head_dim]`,
//!   in private memory or in a shared-memory segment ([`shm`]) a prefill worker can write into.
//! - [`write`]: the single KV write path, one call per layer with the layer index explicit, in
//!   *direct* or *staged* mode chosen for a whole pass; staged data reaches the pool only through
//!   `commit(accepted)`.
//!
//! Invariants kept here (and checked in tests): at quiescence `free == total`; no block is both free
//! and owned; a block's reference count equals its number of holders; rejected speculative tokens
//! never reach the pool; accepted ones reach every layer's own cache.

pub mod allocator;
pub mod block_io;
pub mod checksum;
pub mod device;
pub mod dtype;
pub mod groups;
pub mod layout;
pub mod pool;
pub use tandem_model::prefix;
pub mod reservation;
pub mod shm;
pub mod tier;
pub mod write;

pub use allocator::{BlockAllocator, BlockId, CopyOnWrite, InvariantViolation, KvStats, SeqId, Violation};
pub use block_io::{KvBlockSink, KvBlockSource};
pub use device::DeviceKvPool;
pub use dtype::{KvDtype, KvSlice};
pub use groups::{KvGroups, NO_PAGE};
pub use layout::KvLayout;
pub use pool::CpuKvPool;
pub use prefix::BlockHash;
pub use reservation::{ReservationId, ReservationTable, SharedReservations};
pub use tier::{
    HeapMemory, HostAlloc, HostMemory, KvTiers, Page, PageArena, SpillCopy, TierCounters, TierIdentity,
    TierKind, TierOptions, TierStats,
};
pub use write::{KvWritePath, StagedSegment, WriteMode};

/// KV-cache bookkeeping and write-path errors. Every variant names the sequence, block, layer or
/// slot at fault; [`KvError::kind`] gives a stable class name for metrics and status mapping.
///
/// Every operation that returns one of these leaves the allocator / pool / write path unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// Not enough free blocks for the request (nothing was allocated).
    #[error("out of KV blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    /// The sequence id is not known to the allocator.
    #[error("unknown sequence {seq}")]
    UnknownSequence { seq: SeqId },
    /// A sequence with this id already exists.
    #[error("sequence {seq} already exists")]
    SequenceExists { seq: SeqId },
    /// The block is already free (or listed twice in one release).
    #[error("double free of block {block}")]
    DoubleFree { block: BlockId },
    /// The block cannot be released or adopted here: out of range, or held by a sequence.
    #[error("block {block} is not a raw reservation of this allocator: {why}")]
    ForeignBlock { block: BlockId, why: &'static str },
    /// A requested length is impossible (e.g. truncating a sequence to more tokens than it has).
    #[error("sequence {seq}: invalid length {requested} (current length {current})")]
    InvalidLength { seq: SeqId, requested: usize, current: usize },
    /// The number of blocks handed over does not match the number of tokens.
    #[error("sequence {seq}: {given} blocks given for {n_tokens} tokens, {expected} expected")]
    BlockCountMismatch { seq: SeqId, given: usize, n_tokens: usize, expected: usize },
    /// A layout or allocator configuration is unusable (zero block size, too many blocks, ...).
    #[error("invalid KV layout: {0}")]
    InvalidLayout(String),
    /// Two components disagree on the KV layout.
    #[error("KV layout mismatch: {what}")]
    LayoutMismatch { what: String },
    /// A layer index is outside the model.
    #[error("layer {layer} out of range ({num_layers} layers)")]
    LayerOutOfRange { layer: usize, num_layers: usize },
    /// A block id is outside the pool.
    #[error("block {block} out of range ({num_blocks} blocks)")]
    BlockOutOfRange { block: BlockId, num_blocks: usize },
    /// A slot (block * block_size + offset) is outside the pool.
    #[error("slot {slot} out of range ({num_slots} slots)")]
    SlotOutOfRange { slot: usize, num_slots: usize },
    /// The same slot is written twice in one pass.
    #[error("slot {slot} written twice in one pass (layer {layer})")]
    DuplicateSlot { layer: usize, slot: usize },
    /// A buffer has the wrong length.
    #[error("{what}: length {actual}, expected {expected}")]
    ShapeMismatch { what: &'static str, expected: usize, actual: usize },
    /// A staged pass holds more tokens than the staging buffer was sized for.
    #[error("staged pass of {n_tokens} tokens exceeds the staging capacity of {capacity}")]
    TooManyTokens { n_tokens: usize, capacity: usize },
    /// The segments given to `begin_pass` do not tile the pass's tokens.
    #[error("invalid staged segments: {0}")]
    InvalidSegments(String),
    /// A layer wrote different slots than the pass declared (or than earlier layers wrote).
    #[error("layer {layer}: slots differ from the pass's slots")]
    SlotsMismatch { layer: usize },
    /// `begin_pass` while a pass is open.
    #[error("a KV write pass is already open")]
    PassAlreadyOpen,
    /// `begin_pass` while staged data waits for commit or discard.
    #[error("staged KV data is pending: commit or discard it before a new pass")]
    StagedPending,
    /// `write` or `end_pass` without an open pass.
    #[error("no KV write pass is open")]
    NoOpenPass,
    /// `commit` without staged data waiting (no staged pass, or the pass is not ended yet).
    #[error("nothing staged to commit: {0}")]
    NothingStaged(&'static str),
    /// A layer was written twice in one pass.
    #[error("layer {layer} written twice in one pass")]
    LayerWrittenTwice { layer: usize },
    /// `end_pass` found layers that were never written.
    #[error("pass ended with layers not written: {missing:?}")]
    LayersNotWritten { missing: Vec<usize> },
    /// `commit` got the wrong number of accepted lengths, or a length larger than its segment.
    #[error("commit: {0}")]
    InvalidAccepted(String),
    /// The allocator's invariant checker found a problem.
    #[error(transparent)]
    Invariant(#[from] InvariantViolation),
    /// A device (GPU) operation on the pool failed.
    #[error("KV pool on {device}: {msg}")]
    Device { device: String, msg: String },
    /// A shared-memory segment cannot be created, opened or used.
    #[error("shared-memory KV segment {}: {msg}", path.display())]
    SharedMemory { path: std::path::PathBuf, msg: String },
    /// The host or disk tier behind the pool cannot be opened or used (the message names the
    /// flag and the path at fault).
    #[error("KV tier: {0}")]
    Tier(String),
}

impl KvError {
    /// Stable, low-cardinality name of the error class.
    pub fn kind(&self) -> &'static str {
        match self {
            KvError::OutOfBlocks { .. } => "out_of_blocks",
            KvError::UnknownSequence { .. } => "unknown_sequence",
            KvError::SequenceExists { .. } => "sequence_exists",
            KvError::DoubleFree { .. } => "double_free",
            KvError::ForeignBlock { .. } => "foreign_block",
            KvError::InvalidLength { .. } => "invalid_length",
            KvError::BlockCountMismatch { .. } => "block_count_mismatch",
            KvError::InvalidLayout(_) => "invalid_layout",
            KvError::LayoutMismatch { .. } => "layout_mismatch",
            KvError::LayerOutOfRange { .. } => "layer_out_of_range",
            KvError::BlockOutOfRange { .. } => "block_out_of_range",
            KvError::SlotOutOfRange { .. } => "slot_out_of_range",
            KvError::DuplicateSlot { .. } => "duplicate_slot",
            KvError::ShapeMismatch { .. } => "shape_mismatch",
            KvError::TooManyTokens { .. } => "too_many_tokens",
            KvError::InvalidSegments(_) => "invalid_segments",
            KvError::SlotsMismatch { .. } => "slots_mismatch",
            KvError::PassAlreadyOpen => "pass_already_open",
            KvError::StagedPending => "staged_pending",
            KvError::NoOpenPass => "no_open_pass",
            KvError::NothingStaged(_) => "nothing_staged",
            KvError::LayerWrittenTwice { .. } => "layer_written_twice",
            KvError::LayersNotWritten { .. } => "layers_not_written",
            KvError::InvalidAccepted(_) => "invalid_accepted",
            KvError::Invariant(_) => "invariant",
            KvError::Device { .. } => "device",
            KvError::SharedMemory { .. } => "shared_memory",
            KvError::Tier(_) => "tier",
        }
    }
}
