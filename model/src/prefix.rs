//! Names for full KV blocks, so that two sequences (or two workers, or a router) can tell that a
//! block holds the same K/V without comparing bytes.
//!
//! A block's hash is a chain: SHA-256 over its parent's hash and its own token ids, where the
//! first block's parent is a *root* made of the model identity and a per-tenant salt. Two blocks
//! share a hash only when the model, the salt and every token from the start of the sequence to
//! the end of the block are equal, which is exactly when their K/V are equal. Only full blocks of
//! committed tokens are ever named: a partial block or a draft token has no hash.
//!
//! Hashes are 128 bits (the first half of the SHA-256 digest), stable across processes and
//! versions of this crate that keep [`CHAIN_VERSION`]; routers and workers compute the same ones.
//! Digests sent to a router carry the first 64 bits ([`BlockHash::short`]): a collision there only
//! misroutes a request, it never shares a block.

use sha2::{Digest, Sha256};

/// Bumped whenever the hashing scheme changes, so that old and new hashes never meet.
pub const CHAIN_VERSION: &str = "tandem-prefix-v1";

/// The name of a full block of tokens (and of everything before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The first 64 bits, as cache digests carry them.
    pub fn short(self) -> u64 {
        (self.0 >> 64) as u64
    }
}

/// The parent of a sequence's first block: the model identity and the tenant's salt (empty for
/// the shared namespace).
pub fn chain_root(model_identity: &str, salt: &str) -> BlockHash {
    let mut h = Sha256::new();
    h.update(CHAIN_VERSION.as_bytes());
    h.update((model_identity.len() as u64).to_le_bytes());
    h.update(model_identity.as_bytes());
    h.update((salt.len() as u64).to_le_bytes());
    h.update(salt.as_bytes());
    finish(h)
}

/// The salt a request's blocks are rooted under (see [`chain_root`]): its cache salt for the base
/// model, or under the LoRA adapter whose id is `adapter_id` the salt joined with that id by a
/// byte no salt from the wire holds, so blocks are never shared across adapters or with the
/// base. Workers root their blocks with it and the router scores its digests with it.
pub fn adapter_salt(salt: &str, adapter_id: Option<&str>) -> String {
    match adapter_id {
        None => salt.to_string(),
        Some(id) => format!("{salt}\u{0}lora:{id}"),
    }
}

/// The hash of the block holding `tokens`, whose predecessor (or root) is `parent`.
pub fn block_hash(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent.0.to_le_bytes());
    h.update((tokens.len() as u32).to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    finish(h)
}

fn finish(h: Sha256) -> BlockHash {
    let d = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    BlockHash(u128::from_be_bytes(b))
}

/// Extends a chain block by block: `hashes` names the first `hashes.len()` full blocks of
/// `tokens`; appends the hashes of the full blocks after them.
pub fn extend_chain(root: BlockHash, hashes: &mut Vec<BlockHash>, tokens: &[u32], block_size: usize) {
    let full = tokens.len() / block_size;
    while hashes.len() < full {
        let i = hashes.len();
        let parent = hashes.last().copied().unwrap_or(root);
        hashes.push(block_hash(parent, &tokens[i * block_size..(i + 1) * block_size]));
    }
}

/// The hashes of every full block of `tokens`, in order.
pub fn block_hashes(root: BlockHash, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    extend_chain(root, &mut out, tokens, block_size);
    out
}

/// Longest prefix-cache salt a request may carry, in bytes (routers and workers refuse longer).
pub const MAX_SALT_BYTES: usize = 256;

/// How many leading blocks of a prompt of `n_tokens` tokens may come from a cache: full blocks
/// only, and never the block of the last token, which is always computed so that its logits exist.
pub fn reusable_blocks(n_tokens: usize, block_size: usize) -> usize {
    n_tokens.saturating_sub(1) / block_size
}

/// The blocks a transfer of a prompt of `n_tokens` tokens fills when its destination already
/// holds the first `cached` ones. `Err(max)` when `cached` exceeds [`reusable_blocks`] (`max`):
/// the peer that said so is broken.
pub fn blocks_to_send(n_tokens: usize, block_size: usize, cached: usize) -> Result<usize, usize> {
    let max = reusable_blocks(n_tokens, block_size);
    if cached > max {
        return Err(max);
    }
    Ok(n_tokens.div_ceil(block_size) - cached)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_adapter_salts_apart_from_the_base_and_other_adapters() {
        assert_eq!(adapter_salt("user:7", None), "user:7");
        assert_eq!(adapter_salt("user:7", Some("ab12")), "user:7\u{0}lora:ab12");
        let roots: Vec<BlockHash> = [None, Some("ab12"), Some("cd34")]
            .iter()
            .map(|id| chain_root("sha256:aa", &adapter_salt("", *id)))
            .collect();
        assert!(roots[0] != roots[1] && roots[1] != roots[2] && roots[0] != roots[2]);
        // No salt from the wire (NUL is refused there) can name an adapter's root.
        assert_ne!(chain_root("sha256:aa", "lora:ab12"), roots[1]);
    }

    #[test]
    fn chain_depends_on_model_salt_and_every_earlier_token() {
        let root = chain_root("sha256:aa", "");
        let a = block_hashes(root, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        assert_eq!(a.len(), 2, "partial blocks are never named");
        let b = block_hashes(root, &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a, b);
        // A different first block changes the second block's hash too.
        let c = block_hashes(root, &[1, 2, 3, 9, 5, 6, 7, 8], 4);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
        // Salt and model identity are part of the root.
        assert_ne!(a, block_hashes(chain_root("sha256:aa", "tenant-1"), &[1, 2, 3, 4, 5, 6, 7, 8], 4));
        assert_ne!(a, block_hashes(chain_root("sha256:bb", ""), &[1, 2, 3, 4, 5, 6, 7, 8], 4));
        // Length-prefixed: moving bytes between identity and salt changes the root.
        assert_ne!(chain_root("ab", "c"), chain_root("a", "bc"));
    }

    #[test]
    fn extend_continues_where_it_stopped() {
        let root = chain_root("m", "s");
        let tokens: Vec<u32> = (0..23).collect();
        let mut h = block_hashes(root, &tokens[..9], 4);
        extend_chain(root, &mut h, &tokens, 4);
        assert_eq!(h, block_hashes(root, &tokens, 4));
    }

    #[test]
    fn a_transfer_sends_what_the_destination_lacks_and_always_the_last_block() {
        assert_eq!(blocks_to_send(9, 4, 0), Ok(3));
        assert_eq!(blocks_to_send(9, 4, 2), Ok(1));
        assert_eq!(blocks_to_send(9, 4, 3), Err(2));
        assert_eq!(blocks_to_send(8, 4, 1), Ok(1));
        assert_eq!(blocks_to_send(8, 4, 2), Err(1));
    }

    #[test]
    fn the_last_token_is_never_reused() {
        assert_eq!(reusable_blocks(0, 4), 0);
        assert_eq!(reusable_blocks(4, 4), 0);
        assert_eq!(reusable_blocks(5, 4), 1);
        assert_eq!(reusable_blocks(8, 4), 1);
        assert_eq!(reusable_blocks(9, 4), 2);
    }
}
