//! Cutting a transfer into NCCL pieces that both ranks agree on.
//!
//! NCCL pairs the sends and receives between two ranks one to one, in the order they were
//! posted, and a pair must have the same byte count. So the two lists of pieces must have the
//! same length and the same sizes, piece by piece, even though their addresses differ. Merging
//! adjacent pieces on each side by its own addresses would break that (the sender's blocks may
//! be consecutive where the receiver's are not). Instead both sides cut at the same places:
//! [`runs`] finds the stretches where the source *and* the destination block ids both go up by
//! one, from the two block lists that both sides know, and [`pieces`] turns those runs into one
//! piece per tensor and run. Given the same runs, the same number of tensors and the same block
//! size, the two lists match.

/// Maximal runs `(start, len)` of indices into the two block lists over which both the source
/// and the destination block id increase by exactly one from one index to the next. The runs
/// cover `0..min(src.len(), dst.len())` in order (callers check that the lists have the same
/// length first).
pub fn runs(src_blocks: &[u32], dst_blocks: &[u32]) -> Vec<(usize, usize)> {
    let n = src_blocks.len().min(dst_blocks.len());
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=n {
        let continues = i < n
            && src_blocks[i - 1].checked_add(1) == Some(src_blocks[i])
            && dst_blocks[i - 1].checked_add(1) == Some(dst_blocks[i]);
        if !continues {
            out.push((start, i - start));
            start = i;
        }
    }
    out
}

/// The pieces `(device address, bytes)` of one side of a transfer: for each tensor base in
/// `tensors` (in order), one piece per run of `runs`, covering the blocks `blocks[start..start +
/// len]` of that tensor, where block `b` of a tensor starts `b * block_bytes` past its base.
///
/// `blocks` is this side's list (source ids on the sender, destination ids on the receiver);
/// `runs` must come from [`runs`] over both lists, so that the two sides' pieces pair up.
pub fn pieces(
    tensors: &[u64],
    block_bytes: usize,
    blocks: &[u32],
    runs: &[(usize, usize)],
) -> Vec<(u64, usize)> {
    let mut out = Vec::with_capacity(tensors.len() * runs.len());
    for &base in tensors {
        for &(start, len) in runs {
            let first = u64::from(blocks[start]);
            out.push((base + first * block_bytes as u64, len * block_bytes));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_nothing_are_empty() {
        assert!(runs(&[], &[]).is_empty());
    }

    #[test]
    fn a_single_block_is_one_run() {
        assert_eq!(runs(&[7], &[3]), vec![(0, 1)]);
    }

    #[test]
    fn consecutive_on_both_sides_is_one_run() {
        assert_eq!(runs(&[4, 5, 6, 7], &[10, 11, 12, 13]), vec![(0, 4)]);
    }

    #[test]
    fn a_break_on_either_side_ends_the_run() {
        // Source breaks after index 1, destination after index 2.
        assert_eq!(runs(&[4, 5, 9, 10, 11], &[0, 1, 2, 8, 9]), vec![(0, 2), (2, 1), (3, 2)]);
        // Going down or repeating is a break too.
        assert_eq!(runs(&[3, 2, 2], &[0, 1, 2]), vec![(0, 1), (1, 1), (2, 1)]);
        // No overflow at the top of the id range.
        assert_eq!(runs(&[u32::MAX, 0], &[0, 1]), vec![(0, 1), (1, 1)]);
    }

    #[test]
    fn runs_cover_the_shorter_list() {
        assert_eq!(runs(&[1, 2, 3], &[5, 6]), vec![(0, 2)]);
    }

    #[test]
    fn both_sides_cut_the_same_pieces() {
        let src = [4, 5, 9, 10, 11];
        let dst = [0, 1, 2, 8, 9];
        let r = runs(&src, &dst);
        let send = pieces(&[0x1000, 0x9000], 16, &src, &r);
        let recv = pieces(&[0x50000, 0x70000], 16, &dst, &r);
        assert_eq!(
            send,
            vec![(0x1040, 32), (0x1090, 16), (0x10a0, 32), (0x9040, 32), (0x9090, 16), (0x90a0, 32)]
        );
        assert_eq!(
            recv,
            vec![(0x50000, 32), (0x50020, 16), (0x50080, 32), (0x70000, 32), (0x70020, 16), (0x70080, 32)]
        );
        let sizes = |p: &[(u64, usize)]| p.iter().map(|x| x.1).collect::<Vec<_>>();
        assert_eq!(sizes(&send), sizes(&recv));
    }
}
