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
//!
//! Coalescing happens in [`runs`]: consecutive blocks on both sides make one piece, so a
//! contiguous transfer costs one operation per tensor whatever its length. A scattered one can
//! still need thousands (one per tensor and block), so [`groups`] splits the posting into NCCL
//! groups of at most [`MAX_GROUP_OPS`] operations. It cuts by position in the piece list, which
//! the two sides share, so both post the same groups in the same order.

use std::ops::Range;

/// Most NCCL operations (`ncclSend`/`ncclRecv` calls) one `ncclGroupStart`/`ncclGroupEnd` group
/// holds; a transfer with more pieces is posted as several groups, one after the other on the
/// same stream.
///
/// Why 256: NCCL's guides have documented a ceiling on the calls one group may aggregate (2048),
/// and a group runs as one kernel that takes its operations a few at a time per p2p channel
/// (8, as NCCL's maintainers describe it; 256 fills 32 channels once), so a larger group mostly
/// adds host-side work at `ncclGroupEnd` rather than parallelism. 256 stays far below the
/// ceiling while spreading each group's launch over hundreds of pieces.
///
/// Untimed: both forms (a scattered transfer in one group, and split into these groups, plus a
/// few other sizes) should be timed on a GPU when one is available, and this value set from it.
pub const MAX_GROUP_OPS: usize = 256;

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

/// The groups a transfer of `ops` pieces is posted in: consecutive ranges of piece indices, in
/// order, each of at most [`MAX_GROUP_OPS`], covering `0..ops`.
///
/// Both ranks call it with the length of their own list of nonzero pieces, which is the same on
/// both sides (the lists pair up one to one, see the module docs), so the two cut at the same
/// indices and each send group meets a receive group of the same pieces.
pub fn groups(ops: usize) -> Vec<Range<usize>> {
    (0..ops).step_by(MAX_GROUP_OPS).map(|start| start..ops.min(start + MAX_GROUP_OPS)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_pieces_no_groups() {
        assert!(groups(0).is_empty());
    }

    #[test]
    fn a_scattered_list_is_split_alike_on_both_sides() {
        // Every other source block against consecutive destination blocks: no two blocks make a
        // run, so each tensor has one piece per block.
        let n = 700;
        let src: Vec<u32> = (0..n).map(|i| 2 * i).collect();
        let dst: Vec<u32> = (0..n).map(|i| 5 + i).collect();
        let r = runs(&src, &dst);
        assert_eq!(r.len(), n as usize);
        let tensors_p = [0x10_0000, 0x90_0000, 0x110_0000, 0x190_0000];
        let tensors_d = [0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000];
        let send = pieces(&tensors_p, 64, &src, &r);
        let recv = pieces(&tensors_d, 64, &dst, &r);
        let total = send.len();
        assert_eq!(total, 4 * n as usize);
        assert_eq!(recv.len(), total);

        let (gs, gr) = (groups(send.len()), groups(recv.len()));
        assert_eq!(gs.len(), total.div_ceil(MAX_GROUP_OPS));
        assert_eq!(gs, gr, "both ranks cut at the same indices");
        // In order, contiguous, covering every piece, none over the cap, only the last short.
        assert_eq!(gs.first().map(|g| g.start), Some(0));
        assert_eq!(gs.last().map(|g| g.end), Some(total));
        assert!(gs.windows(2).all(|w| w[0].end == w[1].start));
        assert!(gs.iter().all(|g| !g.is_empty() && g.len() <= MAX_GROUP_OPS));
        assert!(gs[..gs.len() - 1].iter().all(|g| g.len() == MAX_GROUP_OPS));
        // Each send group meets a receive group of the same sizes, piece by piece.
        for g in gs {
            let sizes = |p: &[(u64, usize)]| p.iter().map(|x| x.1).collect::<Vec<_>>();
            assert_eq!(sizes(&send[g.clone()]), sizes(&recv[g]));
        }
    }

    #[test]
    fn exact_multiples_and_remainders() {
        assert_eq!(groups(1), vec![0..1]);
        assert_eq!(groups(MAX_GROUP_OPS), vec![0..MAX_GROUP_OPS]);
        assert_eq!(groups(2 * MAX_GROUP_OPS), vec![0..MAX_GROUP_OPS, MAX_GROUP_OPS..2 * MAX_GROUP_OPS]);
        assert_eq!(groups(MAX_GROUP_OPS + 1), vec![0..MAX_GROUP_OPS, MAX_GROUP_OPS..MAX_GROUP_OPS + 1]);
    }

    #[test]
    fn contiguous_blocks_are_coalesced_into_one_piece_per_tensor() {
        // 1000 blocks, consecutive on both sides (at different ids): one run, so 64 tensors
        // (32 layers' K and V) make 64 operations, a single group.
        let src: Vec<u32> = (100..1100).collect();
        let dst: Vec<u32> = (7..1007).collect();
        let r = runs(&src, &dst);
        assert_eq!(r, vec![(0, 1000)]);
        let tensors: Vec<u64> = (0..64).map(|t| t << 32).collect();
        let send = pieces(&tensors, 16, &src, &r);
        assert_eq!(send.len(), 64);
        assert!(send.iter().all(|&(_, len)| len == 1000 * 16));
        assert_eq!(groups(send.len()), vec![0..64]);
    }

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
