//! Which token blocks a sliding-window layer still needs: the arithmetic of KV pools whose
//! window layers give back what no later query reaches. The engine's `kv::groups` builds its
//! pages on it; the router uses it to check a decode worker's reservation.

/// Whether a group with `window` must keep token block `index` while later queries start at
/// position `from` or later: always for a global group; for a window, while the block holds a
/// position at or past `from + 1 - window`.
pub fn kept(window: Option<usize>, index: usize, from: usize, block_size: usize) -> bool {
    match window {
        None => true,
        Some(w) => (index + 1) * block_size > (from + 1).saturating_sub(w),
    }
}

/// Token blocks a group with `window` has given back once later queries start at `from`: the
/// leading blocks [`kept`] says are dead.
pub fn dropped(window: Option<usize>, from: usize, block_size: usize) -> usize {
    match window {
        None => 0,
        Some(w) => (from + 1).saturating_sub(w) / block_size,
    }
}

/// Pages a sequence of `len` tokens holds once later queries start at `from` (`from <= len`):
/// per group, its `len.div_ceil(block_size)` token blocks less those it has given back.
pub fn pages_held(windows: &[Option<usize>], len: usize, from: usize, block_size: usize) -> usize {
    let blocks = len.div_ceil(block_size);
    windows.iter().map(|&w| blocks - dropped(w, from.min(len), block_size).min(blocks)).sum()
}

/// Where the queries of a sequence of `len` tokens that moves between workers may start: at its
/// last token, which a choice forked from it (`n` > 1) computes again. A transfer moves, and a
/// reservation takes, the pages [`kept`] there.
pub fn transfer_from(len: usize) -> usize {
    len.saturating_sub(1)
}

/// The pages a sequence of `len` tokens that moves between workers keeps for its token blocks
/// `first..`, as `(token block, layer group)` in table order (token block by token block, group
/// by group): per token block, one per group (`windows`, `[None]` without groups) that [`kept`]
/// at [`transfer_from`]`(len)`. What a transfer moves and a reservation takes.
pub fn kept_entries(
    windows: &[Option<usize>],
    len: usize,
    first: usize,
    block_size: usize,
) -> impl Iterator<Item = (usize, usize)> + '_ {
    let from = transfer_from(len);
    (first..len.div_ceil(block_size)).flat_map(move |i| {
        windows
            .iter()
            .enumerate()
            .filter(move |&(_, &w)| kept(w, i, from, block_size))
            .map(move |(k, _)| (i, k))
    })
}

/// How many pages [`kept_entries`] lists.
pub fn kept_count(windows: &[Option<usize>], len: usize, first: usize, block_size: usize) -> usize {
    kept_entries(windows, len, first, block_size).count()
}
