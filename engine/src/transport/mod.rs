//! KV transports: move a sequence's KV blocks from a prefill worker's pool into blocks a decode
//! worker reserved, and say when they have arrived intact.

/// Name of the byte layout of KV blocks on the wire and in a shared pool (compatibility record
/// field `kv_layout`): per layer, K then V, each `[num_blocks, block_size, num_kv_heads, head_dim]`
/// of little-endian f32.
pub const KV_LAYOUT_NAME: &str = "tandem-f32-lkv-v1";

/// Identity of this host: the kernel's boot id (two processes share shared memory only when it
/// is equal), or the host name where it cannot be read.
pub fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_owned()))
        .unwrap_or_else(|| "unknown-host".into())
}
