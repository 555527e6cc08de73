//! Layer groups of a KV pool whose model mixes sliding-window and global layers (Gemma 2 and 3).
//!
//! A window layer's query at position `p` reads positions `p + 1 - w ..= p` only, so once every
//! later query starts past a block, the block's K/V for that layer are dead. To give that memory
//! back, layers are put in *groups* of equal size: every layer of a group has the same window (or
//! none), and a pool *page* holds one block of tokens for the layers of one group. A sequence
//! holds, for each of its token blocks, one page per group, in a flat table:
//!
//! ```text
//! table[i * groups + g] = the page of token block i for group g   (NO_PAGE once freed)
//! ```
//!
//! A window group's page of token block `i` is freed once the first position any later pass
//! queries, `from`, satisfies `(i + 1) * block_size <= from + 1 - w`: no query at `from` or later
//! reaches it ([`kept`]). Global groups keep every page.
//!
//! A model without window layers, or whose layers all share one window, has one group: the table
//! is the plain block table and a page holds every layer, as in a pool without groups. Group 0 is
//! a global group whenever the model has global layers, so the prefix cache names group 0's pages
//! by the block hashes themselves (and the router's view of cached prefixes is unchanged).
//!
//! The storage layers of a page are `0..per_page`; model layer `l` lives in storage layer
//! [`KvGroups::slot`]`(l)` of the pages of group [`KvGroups::group`]`(l)`. When groups of one kind
//! do not divide evenly, the last group of that kind leaves storage layers unused (padding).

use super::allocator::BlockId;
pub use super::allocator::NO_PAGE;

/// How a model's layers map onto the pages of a KV pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    /// Window of each group (`None`: a global group).
    windows: Vec<Option<usize>>,
    /// Per model layer: its group.
    group: Vec<usize>,
    /// Per model layer: its storage layer within a page.
    slot: Vec<usize>,
    per_page: usize,
}

impl KvGroups {
    /// One group holding every layer with no window: a pool without groups.
    pub fn single(num_layers: usize) -> Self {
        Self {
            windows: vec![None],
            group: vec![0; num_layers],
            slot: (0..num_layers).collect(),
            per_page: num_layers,
        }
    }

    /// Groups for layers with these windows (`None`: global). With `windowed` false, or when
    /// every layer has the same window, one group holds every layer (with that window when
    /// `windowed`). Otherwise each kind of layer (global, or one window size) gets groups of
    /// `per_page` layers, `per_page` being the size of the smallest kind; global groups come first.
    pub fn new(layer_windows: &[Option<usize>], windowed: bool) -> Self {
        let n = layer_windows.len();
        let mut kinds: Vec<Option<usize>> = Vec::new();
        for &w in layer_windows {
            if !kinds.contains(&w) {
                kinds.push(w);
            }
        }
        kinds.sort_by_key(|w| w.map_or(0, |w| w.max(1)));
        if !windowed || kinds.len() <= 1 {
            let mut g = Self::single(n);
            if windowed {
                g.windows[0] = kinds.first().copied().flatten();
            }
            return g;
        }
        let count = |k: Option<usize>| layer_windows.iter().filter(|&&w| w == k).count();
        let per_page = kinds.iter().map(|&k| count(k)).min().unwrap_or(1).max(1);
        let mut windows = Vec::new();
        let (mut group, mut slot) = (vec![0; n], vec![0; n]);
        for &k in &kinds {
            let first = windows.len();
            for (i, l) in (0..n).filter(|&l| layer_windows[l] == k).enumerate() {
                group[l] = first + i / per_page;
                slot[l] = i % per_page;
            }
            windows.extend(std::iter::repeat_n(k, count(k).div_ceil(per_page)));
        }
        Self { windows, group, slot, per_page }
    }

    /// Groups, and pages per token block.
    pub fn len(&self) -> usize {
        self.windows.len()
    }

    /// Never: a pool has at least one group.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// Storage layers of a page.
    pub fn per_page(&self) -> usize {
        self.per_page
    }

    /// Model layers.
    pub fn num_layers(&self) -> usize {
        self.group.len()
    }

    /// Window of every group (`None`: global).
    pub fn windows(&self) -> &[Option<usize>] {
        &self.windows
    }

    /// The group of model layer `layer`.
    pub fn group(&self, layer: usize) -> usize {
        self.group[layer]
    }

    /// The storage layer of model layer `layer` within its group's pages.
    pub fn slot(&self, layer: usize) -> usize {
        self.slot[layer]
    }
}

pub use tandem_model::window::{dropped, kept, kept_count, kept_entries, pages_held, transfer_from};

/// The kept pages of token blocks `first..` of a flat table (`windows.len()` entries per token
/// block), for a sequence of `len` tokens that moves between workers ([`transfer_from`]), in
/// table order: what a transfer of that sequence moves ([`kept_count`] of them). `None` when a
/// kept entry has been given back (the table was slid past [`transfer_from`]`(len)`).
pub fn kept_pages(
    table: &[BlockId],
    windows: &[Option<usize>],
    len: usize,
    first: usize,
    block_size: usize,
) -> Option<Vec<BlockId>> {
    let g = windows.len();
    if table.len() < len.div_ceil(block_size) * g {
        return None;
    }
    kept_entries(windows, len, first, block_size)
        .map(|(i, k)| Some(table[i * g + k]).filter(|&p| p != NO_PAGE))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma3_270m_groups() {
        // 18 layers, every sixth global, the others with a 512-token window.
        let windows: Vec<Option<usize>> =
            (0..18).map(|l| if l % 6 == 5 { None } else { Some(512) }).collect();
        let g = KvGroups::new(&windows, true);
        assert_eq!((g.len(), g.per_page()), (6, 3));
        assert_eq!(g.windows()[0], None);
        assert!(g.windows()[1..].iter().all(|&w| w == Some(512)));
        assert_eq!((g.group(5), g.slot(5)), (0, 0));
        assert_eq!((g.group(17), g.slot(17)), (0, 2));
        assert_eq!((g.group(0), g.slot(0)), (1, 0));
        assert_eq!((g.group(16), g.slot(16)), (5, 2));
        // Every (group, slot) holds one layer.
        let mut seen = std::collections::BTreeSet::new();
        assert!((0..18).all(|l| seen.insert((g.group(l), g.slot(l)))));
        assert_eq!(KvGroups::new(&windows, false), KvGroups::single(18));
    }

    #[test]
    fn uneven_kinds_pad_the_last_group() {
        let windows = [None, Some(4), Some(4), None, Some(4), Some(4), Some(4)];
        let g = KvGroups::new(&windows, true);
        assert_eq!((g.len(), g.per_page()), (4, 2));
        assert_eq!(g.windows(), &[None, Some(4), Some(4), Some(4)]);
        assert_eq!((g.group(6), g.slot(6)), (3, 0));
    }

    #[test]
    fn one_kind_is_one_group() {
        let g = KvGroups::new(&[Some(16); 4], true);
        assert_eq!((g.len(), g.per_page(), g.windows()), (1, 4, &[Some(16)][..]));
        assert_eq!(KvGroups::new(&[Some(16); 4], false).windows(), &[None][..]);
        assert_eq!(KvGroups::new(&[None; 4], true), KvGroups::single(4));
    }

    #[test]
    fn kept_follows_the_window() {
        // Window 8, blocks of 4: a query at 11 reads 4..=11, so block 0 (0..4) is dead.
        assert!(!kept(Some(8), 0, 11, 4));
        assert!(kept(Some(8), 1, 11, 4));
        assert!(kept(Some(8), 0, 10, 4));
        assert_eq!(dropped(Some(8), 11, 4), 1);
        assert_eq!(dropped(Some(8), 10, 4), 0);
        assert_eq!(dropped(None, 1000, 4), 0);
        // Exactly the blocks `kept` rejects.
        for from in 0..64 {
            for w in [1, 3, 4, 8, 13] {
                let d = dropped(Some(w), from, 4);
                assert!((0..16).all(|i| kept(Some(w), i, from, 4) == (i >= d)), "w {w} from {from}");
            }
        }
        let windows = [None, Some(8)];
        assert_eq!(pages_held(&windows, 12, 11, 4), 3 + 2);
        // A transferred sequence of 13 tokens may be queried from its last token, 12.
        assert_eq!(transfer_from(13), 12);
        // Its window reads 5..=12: blocks 1 to 3.
        assert_eq!(kept_count(&windows, 13, 0, 4), 4 + 3);
        assert_eq!(kept_count(&windows, 13, 1, 4), 3 + 3);
        // 12 tokens, queried from 11: the window reads 4..=11, blocks 1 and 2.
        assert_eq!(kept_count(&windows, 12, 0, 4), 3 + 2);
        let table = [10, NO_PAGE, 11, 21, 12, 22, 13, 23];
        assert_eq!(kept_pages(&table, &windows, 13, 0, 4), Some(vec![10, 11, 21, 12, 22, 13, 23]));
        assert_eq!(kept_pages(&table, &windows, 13, 2, 4), Some(vec![12, 22, 13, 23]));
        assert_eq!(kept_pages(&[10, NO_PAGE, 11, NO_PAGE, 12, 22], &windows, 12, 0, 4), None);
    }
}
