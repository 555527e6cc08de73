//! The planner on hand-built states (each test pins one rule) and on generated ones (the
//! invariants of the module documentation).

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

const BS: usize = 4;

fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BS)
}

fn state(budget: usize, max_num_seqs: usize, free: usize, total: usize) -> StepState {
    StepState {
        max_batch_tokens: budget,
        prefill_limit: None,
        max_num_seqs,
        block_size: BS,
        windows: vec![None],
        free_blocks: free,
        total_blocks: total,
        running: Vec::new(),
        queued: Vec::new(),
    }
}

/// A sequence that decodes: all but its newest token cached, blocks for exactly those.
fn running(id: SeqId, len: usize) -> SeqView {
    SeqView { id, len, computed: len - 1, blocks: blocks_for(len - 1), shared: 0, draft: 0 }
}

/// A prompt waiting for admission.
fn prompt(id: SeqId, len: usize) -> SeqView {
    SeqView { id, len, computed: 0, blocks: 0, shared: 0, draft: 0 }
}

/// An admitted sequence part way through its prefill: blocks for all its tokens.
fn admitted(id: SeqId, len: usize, computed: usize) -> SeqView {
    SeqView { id, len, computed, blocks: blocks_for(len), shared: 0, draft: 0 }
}

fn decode(seq: SeqId, len: usize) -> Entry {
    Entry { seq, kind: EntryKind::Decode, start: len - 1, tokens: 1, kv_len: len, samples: true }
}

fn prefill(seq: SeqId, len: usize, start: usize, tokens: usize) -> Entry {
    Entry { seq, kind: EntryKind::Prefill, start, tokens, kv_len: len, samples: start + tokens == len }
}

fn ids(plan: &Plan) -> Vec<SeqId> {
    plan.batch.iter().map(|e| e.seq).collect()
}

#[test]
fn the_token_budget_caps_the_batch_and_the_last_prompt_is_chunked() {
    let mut s = state(5, 16, 100, 100);
    s.running = vec![running(1, 6), running(2, 6), running(3, 6)];
    s.queued = vec![prompt(4, 10)];
    let p = plan(&s);
    assert_eq!(p.batch, vec![decode(1, 6), decode(2, 6), decode(3, 6), prefill(4, 10, 0, 2)]);
    assert_eq!(p.tokens(), 5);
    assert!(p.preempted.is_empty());
    assert_eq!(p.idle, None);
}

#[test]
fn decode_comes_before_new_prefill_and_oldest_first() {
    let mut s = state(2, 16, 100, 100);
    // Given out of order; the prompt is older than one of the running sequences.
    s.running = vec![running(3, 6), running(1, 6)];
    s.queued = vec![prompt(2, 4)];
    assert_eq!(ids(&plan(&s)), vec![1, 3]);
    s.max_batch_tokens = 3;
    assert_eq!(plan(&s).batch, vec![decode(1, 6), decode(3, 6), prefill(2, 4, 0, 1)]);
}

#[test]
fn a_long_prompt_runs_in_chunks_and_samples_only_at_its_end() {
    let mut s = state(8, 16, 10, 10);
    s.queued = vec![prompt(1, 20)];
    let p = plan(&s);
    assert_eq!(p.batch, vec![prefill(1, 20, 0, 8)], "admitted with blocks for all 20 tokens");
    assert!(!p.batch[0].samples);

    s.free_blocks = 5;
    s.queued = vec![admitted(1, 20, 16)];
    let p = plan(&s);
    assert_eq!(p.batch, vec![prefill(1, 20, 16, 4)]);
    assert!(p.batch[0].samples);
}

#[test]
fn the_newest_sequence_is_preempted_when_blocks_run_out() {
    // Three sequences at a block boundary, no free block: the oldest gets the newest one's block,
    // the middle one is then the newest holder left and gives up its own.
    let mut s = state(16, 16, 0, 3);
    s.running = vec![running(1, 5), running(2, 5), running(3, 5)];
    let p = plan(&s);
    assert_eq!(p.batch, vec![decode(1, 5)]);
    assert_eq!(p.preempted, vec![Preemption { seq: 3, before: 0 }, Preemption { seq: 2, before: 1 }]);
    assert_eq!(p.idle, None);
}

#[test]
fn a_preempted_running_sequence_goes_to_the_front_of_the_queue() {
    // Sequence 3 loses its 2 blocks to sequence 1, then needs 3 to come back: as it now heads the
    // queue, admission closes and the small prompt 2 behind it does not overtake it.
    let mut s = state(16, 16, 0, 3);
    s.running = vec![running(1, 5), running(3, 9)];
    s.queued = vec![prompt(2, 2)];
    let p = plan(&s);
    assert_eq!(p.batch, vec![decode(1, 5)]);
    assert_eq!(p.preempted, vec![Preemption { seq: 3, before: 0 }]);
}

#[test]
fn a_preempted_prefill_keeps_its_place_in_the_queue() {
    // Sequence 3 is part way through its prefill, behind prompt 2. Preempted for sequence 1, it
    // stays behind 2, so 2 (which fits the freed blocks) is admitted.
    let mut s = state(16, 16, 0, 4);
    s.running = vec![running(1, 5)];
    s.queued = vec![prompt(2, 8), admitted(3, 10, 4)];
    let p = plan(&s);
    assert_eq!(p.batch, vec![decode(1, 5), prefill(2, 8, 0, 8)]);
    assert_eq!(p.preempted, vec![Preemption { seq: 3, before: 0 }]);
}

#[test]
fn admission_never_preempts() {
    let mut s = state(16, 16, 1, 3);
    s.running = vec![running(1, 6)];
    s.queued = vec![prompt(2, 8)];
    let p = plan(&s);
    assert_eq!(p.batch, vec![decode(1, 6)]);
    assert!(p.preempted.is_empty());
}

#[test]
fn admission_stops_at_the_first_prompt_that_does_not_fit() {
    let mut s = state(16, 16, 3, 10);
    s.queued = vec![prompt(1, 40), prompt(2, 2)];
    let p = plan(&s);
    assert!(p.batch.is_empty(), "the small prompt must not overtake the big one");
    assert_eq!(p.idle, Some(Idle::Stalled));

    // A sequence admitted earlier keeps running behind a prompt that waits.
    s.queued = vec![prompt(1, 40), admitted(3, 10, 4)];
    assert_eq!(plan(&s).batch, vec![prefill(3, 10, 4, 6)]);
}

#[test]
fn admission_respects_max_num_seqs() {
    let mut s = state(16, 2, 100, 100);
    s.running = vec![running(1, 6), running(2, 6)];
    s.queued = vec![prompt(3, 4)];
    assert_eq!(ids(&plan(&s)), vec![1, 2]);
    s.max_num_seqs = 3;
    assert_eq!(ids(&plan(&s)), vec![1, 2, 3]);
}

#[test]
fn an_empty_batch_says_why() {
    let s = state(16, 16, 10, 10);
    assert_eq!(plan(&s).idle, Some(Idle::NoWork));

    // Blocks held elsewhere (reservations, held sequences): wait for a release.
    let mut s = state(16, 16, 1, 10);
    s.queued = vec![prompt(1, 8)];
    let p = plan(&s);
    assert!(p.batch.is_empty() && p.preempted.is_empty());
    assert_eq!(p.idle, Some(Idle::Stalled));

    // Every block free and still nothing fits: an engine bug, reported.
    let mut s = state(16, 16, 1, 1);
    s.queued = vec![prompt(1, 8)];
    assert_eq!(plan(&s).idle, Some(Idle::NoProgress));
}

#[test]
fn a_one_token_budget_runs_one_token() {
    let mut s = state(1, 16, 100, 100);
    s.running = vec![running(1, 6), running(2, 6)];
    s.queued = vec![prompt(3, 4)];
    assert_eq!(plan(&s).batch, vec![decode(1, 6)]);

    s.running.clear();
    assert_eq!(plan(&s).batch, vec![prefill(3, 4, 0, 1)]);
    s.queued = vec![prompt(3, 1)];
    assert!(plan(&s).batch[0].samples, "a one-token prompt samples at once");
}

#[test]
fn a_transferred_sequence_decodes_at_once() {
    // A prompt of 8 tokens cached in 2 blocks by another worker, its first token sampled there:
    // it decodes that token and needs a third block for it.
    let mut s = state(16, 16, 1, 3);
    s.running = vec![SeqView { id: 7, len: 9, computed: 8, blocks: 2, shared: 0, draft: 0 }];
    let p = plan(&s);
    assert_eq!(p.batch, vec![decode(7, 9)]);
    assert!(p.preempted.is_empty());

    // With the third block held elsewhere it preempts itself (it is the newest holder) and
    // waits, to be recomputed once a block comes back.
    s.free_blocks = 0;
    let p = plan(&s);
    assert!(p.batch.is_empty());
    assert_eq!(p.preempted, vec![Preemption { seq: 7, before: 0 }]);
    assert_eq!(p.idle, Some(Idle::Stalled));
}

#[test]
fn reservations_wait_for_waiting_sequences_and_leave_room_to_grow() {
    let ask = |needed, free, waiting, running, reservations| {
        let growth = running + reservations;
        check_reservation(ReservationAsk {
            needed,
            free,
            waiting,
            running,
            reservations,
            growth,
            own_growth: 0,
        })
    };
    assert_eq!(ask(1, 10, 1, 0, 0), Err(ReservationRefusal::Waiting { waiting: 1 }));
    assert_eq!(ask(20, 10, 2, 0, 0), Err(ReservationRefusal::Waiting { waiting: 2 }), "waiting comes first");
    assert_eq!(ask(11, 10, 0, 0, 0), Err(ReservationRefusal::OutOfBlocks));
    assert_eq!(ask(10, 10, 0, 0, 0), Ok(()), "nothing to grow: the whole pool may go");
    assert_eq!(ask(4, 5, 0, 2, 0), Err(ReservationRefusal::KeptForGrowth { kept: 2 }));
    assert_eq!(ask(3, 5, 0, 2, 0), Ok(()));
    assert_eq!(
        ask(1, 1, 0, 0, 1),
        Err(ReservationRefusal::KeptForGrowth { kept: 1 }),
        "a reservation will run"
    );
}

#[test]
fn reservations_keep_room_for_the_output_everyone_will_generate() {
    let ask = |needed, free, running, growth, own_growth| {
        check_reservation(ReservationAsk {
            needed,
            free,
            waiting: 0,
            running,
            reservations: 0,
            growth,
            own_growth,
        })
    };
    // Two running sequences will grow into 6 blocks, the new one into 3: 4 + 6 + 3 = 13.
    assert_eq!(ask(4, 12, 2, 6, 3), Err(ReservationRefusal::KeptForGrowth { kept: 9 }));
    assert_eq!(ask(4, 13, 2, 6, 3), Ok(()));
    // Sequences whose blocks already hold all their output keep nothing more.
    assert_eq!(ask(4, 5, 2, 0, 0), Ok(()));
    // Alone, a reservation that fits is granted whatever it will grow into.
    assert_eq!(ask(4, 4, 0, 0, 30), Ok(()));
}

#[test]
fn growth_is_counted_within_the_horizon_and_the_context() {
    // The next pass covers 20 positions, 5 blocks of 4 held; 10 more tokens: 29 positions, 8 blocks.
    assert_eq!(growth_blocks(20, 5, Some(10), 1000, 4, &[None]), 3);
    // Far more output than the horizon: only the horizon counts.
    assert_eq!(
        growth_blocks(20, 5, Some(100_000), 100_000, 4, &[None]),
        (20 + GROWTH_HORIZON - 1).div_ceil(4) - 5
    );
    // The context ends first.
    assert_eq!(growth_blocks(20, 5, Some(50), 24, 4, &[None]), 1);
    // Blocks that already cover the output: nothing; unknown output: one block.
    assert_eq!(growth_blocks(20, 8, Some(5), 1000, 4, &[None]), 0);
    assert_eq!(growth_blocks(20, 5, Some(1), 1000, 4, &[None]), 0);
    assert_eq!(growth_blocks(20, 5, None, 1000, 4, &[None]), 1);
}

fn drafting(id: SeqId, len: usize, draft: usize) -> SeqView {
    SeqView { draft, ..running(id, len) }
}

fn verify(seq: SeqId, len: usize, drafts: usize) -> Entry {
    Entry {
        seq,
        kind: EntryKind::Verify,
        start: len - 1,
        tokens: 1 + drafts,
        kv_len: len + drafts,
        samples: true,
    }
}

#[test]
fn drafts_turn_decode_entries_into_verification_entries() {
    let mut s = state(64, 8, 20, 40);
    s.running = vec![drafting(1, 10, 4), running(2, 6), drafting(3, 7, 2)];
    let p = plan(&s);
    assert_eq!(p.batch, vec![verify(1, 10, 4), decode(2, 6), verify(3, 7, 2)]);
    assert_eq!(p.tokens(), 9);
}

#[test]
fn speculation_gets_what_prefill_leaves_of_the_budget() {
    let mut s = state(8, 8, 20, 40);
    s.running = vec![drafting(1, 10, 4)];
    s.queued = vec![prompt(2, 5)];
    let p = plan(&s);
    // 1 decode token + 5 prompt tokens leave 2 for drafts.
    assert_eq!(p.batch, vec![verify(1, 10, 2), prefill(2, 5, 0, 5)]);
}

#[test]
fn speculation_keeps_a_free_block_per_entry() {
    // Sequence 1 holds 3 blocks (9 cached tokens, positions 0..9); position 9 fits, drafts need
    // positions 10.. which fit in its third block up to 11, then a fourth block.
    let mut s = state(64, 8, 2, 10);
    s.running = vec![drafting(1, 10, 6), running(2, 4)];
    let p = plan(&s);
    // Two entries keep two blocks: no new block for drafts, so only positions up to 11.
    assert_eq!(p.batch, vec![verify(1, 10, 2), decode(2, 4)]);
    s.free_blocks = 3;
    assert_eq!(plan(&s).batch[0], verify(1, 10, 6), "one more free block holds 4 more drafts");
}

#[test]
fn the_latency_budget_limits_prompt_chunks_only_while_sequences_decode() {
    let mut s = state(64, 8, 100, 100);
    s.prefill_limit = Some(5);
    s.queued = vec![prompt(3, 20)];
    // Nothing decodes: nobody to delay, the whole token budget.
    assert_eq!(plan(&s).batch, vec![prefill(3, 20, 0, 20)]);
    s.running = vec![running(1, 9), running(2, 5)];
    s.free_blocks = 100 - 5;
    let p = plan(&s);
    assert_eq!(p.batch, vec![decode(1, 9), decode(2, 5), prefill(3, 20, 0, 5)]);
    // The next prompt waits: the budget is spent on the first one's chunk.
    s.queued.push(prompt(4, 3));
    assert_eq!(ids(&plan(&s)), vec![1, 2, 3]);
    // `max_batch_tokens` still caps everything.
    s.max_batch_tokens = 4;
    assert_eq!(plan(&s).batch, vec![decode(1, 9), decode(2, 5), prefill(3, 20, 0, 2)]);
}

#[test]
fn drafts_share_the_latency_budget_with_prompts() {
    let mut s = state(64, 8, 100, 100);
    s.prefill_limit = Some(5);
    s.running = vec![drafting(1, 10, 4), drafting(2, 6, 4)];
    // No prompt waits: drafts take the budget, oldest first.
    assert_eq!(plan(&s).batch, vec![verify(1, 10, 4), verify(2, 6, 1)]);
    s.queued = vec![prompt(3, 4)];
    assert_eq!(plan(&s).batch, vec![verify(1, 10, 1), decode(2, 6), prefill(3, 4, 0, 4)]);
}

#[test]
fn no_speculation_in_a_step_that_preempts() {
    let mut s = state(64, 8, 0, 6);
    s.running = vec![drafting(1, 9, 3), drafting(2, 5, 3)];
    let p = plan(&s);
    assert!(!p.preempted.is_empty());
    assert!(p.batch.iter().all(|e| e.kind != EntryKind::Verify), "{:?}", p.batch);
}

/// States the engine can build: running sequences with blocks for all but their newest token,
/// queued prompts without blocks, admitted ones with blocks for all their tokens, in a shuffled
/// queue (preempted sequences go to its front), queued ones holding only a cached prefix, blocks
/// shared with other owners (a cached prefix), and some blocks held elsewhere.
fn states() -> impl Strategy<Value = StepState> {
    let seqs = prop::collection::vec((1usize..24, 0u8..4, 0usize..24), 0..9);
    let limit = prop::option::of(0usize..12);
    (1usize..5, 1usize..20, 1usize..6, seqs, 0usize..8, 0usize..4, limit).prop_flat_map(
        |(block_size, budget, max_num_seqs, seqs, free, elsewhere, prefill_limit)| {
            let mut running = Vec::new();
            let mut queued = Vec::new();
            for (i, (len, kind, at)) in seqs.into_iter().enumerate() {
                let id = i as SeqId + 1;
                let len = len + 1;
                match kind {
                    0 => {
                        let blocks = (len - 1).div_ceil(block_size);
                        running.push(SeqView {
                            id,
                            len,
                            computed: len - 1,
                            blocks,
                            // Some share their first blocks with others.
                            shared: (at % 3).min(blocks),
                            // Half the running sequences have drafts.
                            draft: if at % 2 == 0 { at % 7 } else { 0 },
                        })
                    }
                    1 => queued.push(SeqView { id, len, computed: 0, blocks: 0, shared: 0, draft: 0 }),
                    2 => queued.push(SeqView {
                        id,
                        len,
                        computed: at % len,
                        blocks: len.div_ceil(block_size),
                        shared: 0,
                        draft: 0,
                    }),
                    _ => {
                        // Holds a cached prefix of whole blocks, never its last token's block.
                        let k = ((len - 1) / block_size).min(at % 4);
                        queued.push(SeqView {
                            id,
                            len,
                            computed: k * block_size,
                            blocks: k,
                            shared: k.min(at % 2),
                            draft: 0,
                        })
                    }
                }
            }
            let held: usize = running.iter().chain(&queued).map(|v| v.blocks).sum();
            (Just(running), Just(queued).prop_shuffle()).prop_map(move |(running, queued)| StepState {
                max_batch_tokens: budget,
                prefill_limit,
                max_num_seqs,
                block_size,
                windows: vec![None],
                free_blocks: free,
                total_blocks: held + free + elsewhere,
                running,
                queued,
            })
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_plan_keeps_the_invariants(s in states()) {
        let p = plan(&s);
        let views: BTreeMap<SeqId, SeqView> = s.running.iter().chain(&s.queued).map(|v| (v.id, *v)).collect();

        // Budget.
        prop_assert!(p.tokens() <= s.max_batch_tokens);
        let decodes = p.batch.iter().filter(|e| e.kind != EntryKind::Prefill).count();
        if let (Some(limit), true) = (s.prefill_limit, decodes > 0) {
            prop_assert!(p.tokens() - decodes <= limit, "{} tokens beside {decodes} decodes, limit {limit}", p.tokens());
        }

        // Blocks: applying the plan in order never takes more than is free.
        let mut free = s.free_blocks;
        let mut holds: BTreeMap<SeqId, usize> = views.iter().map(|(&id, v)| (id, v.blocks)).collect();
        let mut shared: BTreeMap<SeqId, usize> = views.iter().map(|(&id, v)| (id, v.shared)).collect();
        let is_running = |id: SeqId| s.running.iter().any(|r| r.id == id);
        let mut preemptions = p.preempted.iter().peekable();
        let mut admitted_new = Vec::new();
        for (i, e) in p.batch.iter().enumerate() {
            while let Some(x) = preemptions.next_if(|x| x.before <= i) {
                let h = holds.get_mut(&x.seq).unwrap();
                prop_assert!(*h > 0, "preempted sequence {} holds nothing", x.seq);
                // Shared blocks stay held by their other owners.
                free += std::mem::take(h) - std::mem::take(shared.get_mut(&x.seq).unwrap());
            }
            let h = holds.get_mut(&e.seq).unwrap();
            let all = views[&e.seq].len.div_ceil(s.block_size);
            if !is_running(e.seq) && *h < all {
                admitted_new.push(e.seq);
            }
            let want = e.kv_len.div_ceil(s.block_size);
            let need = want.saturating_sub(*h);
            prop_assert!(need <= free, "entry {i} needs {need} blocks, {free} free");
            free -= need;
            *h = (*h).max(want);
        }
        for x in preemptions {
            let h = holds.get_mut(&x.seq).unwrap();
            prop_assert!(*h > 0);
            free += std::mem::take(h) - std::mem::take(shared.get_mut(&x.seq).unwrap());
        }
        prop_assert!(free <= s.total_blocks);
        // Speculation kept one free block per batch entry.
        if p.batch.iter().any(|e| e.kind == EntryKind::Verify) {
            prop_assert!(free >= p.batch.len(), "{free} blocks left for {} entries", p.batch.len());
        }
        if !admitted_new.is_empty() {
            let admitted = holds
                .iter()
                .filter(|&(&id, &h)| h > 0 && (is_running(id) || h >= views[&id].len.div_ceil(s.block_size)))
                .count();
            prop_assert!(admitted <= s.max_num_seqs);
        }

        // Entries: each sequence once, never empty, within its tokens, decodes first.
        let mut seen = std::collections::BTreeSet::new();
        let first_prefill = p.batch.iter().position(|e| e.kind == EntryKind::Prefill).unwrap_or(p.batch.len());
        prop_assert!(p.batch.iter().skip(first_prefill).all(|e| e.kind == EntryKind::Prefill));
        for (i, e) in p.batch.iter().enumerate() {
            let v = views[&e.seq];
            prop_assert!(seen.insert(e.seq), "sequence {} twice in the batch", e.seq);
            prop_assert!(e.tokens >= 1);
            prop_assert_eq!(e.start + e.tokens - e.drafts(), e.start + e.tokens.min(v.len - e.start));
            prop_assert_eq!(e.kv_len, v.len + e.drafts());
            prop_assert_eq!(e.samples, e.start + e.tokens - e.drafts() == v.len);
            prop_assert_eq!(e.kind != EntryKind::Prefill, i < first_prefill);
            if e.kind != EntryKind::Prefill {
                prop_assert!(s.running.iter().any(|r| r.id == e.seq));
                prop_assert_eq!((e.start, e.tokens - e.drafts()), (v.len - 1, 1));
                prop_assert!(e.drafts() <= v.draft, "{} drafts verified of {}", e.drafts(), v.draft);
                if e.kind == EntryKind::Verify {
                    prop_assert!(e.drafts() >= 1);
                    prop_assert!(p.preempted.is_empty(), "speculation in a step that preempts");
                }
            } else {
                let preempted = p.preempted.iter().any(|x| x.seq == e.seq);
                prop_assert_eq!(e.start, if preempted { 0 } else { v.computed });
            }
        }

        // Preemption: only while decoding, newest first, never of a sequence older than one
        // that decodes.
        for x in &p.preempted {
            prop_assert!(x.before <= first_prefill);
            for e in &p.batch[..first_prefill] {
                prop_assert!(e.seq < x.seq, "sequence {} decodes but older {} was preempted", e.seq, x.seq);
            }
        }
        prop_assert!(p.preempted.windows(2).all(|w| w[0].seq > w[1].seq));

        // Progress: a running sequence decodes or is preempted, unless the budget ran out first.
        for r in &s.running {
            let progressed = p.batch.iter().any(|e| e.seq == r.id) || p.preempted.iter().any(|x| x.seq == r.id);
            prop_assert!(progressed || p.tokens() == s.max_batch_tokens, "running sequence {} skipped", r.id);
        }

        // No overtaking: without preemptions, the prompts admitted are a prefix of those waiting.
        if p.preempted.is_empty() {
            let waiting: Vec<SeqId> =
                s.queued.iter().filter(|v| v.blocks < v.len.div_ceil(s.block_size)).map(|v| v.id).collect();
            prop_assert_eq!(&admitted_new[..], &waiting[..admitted_new.len()]);
        }

        // Idle exactly when the batch is empty.
        prop_assert_eq!(p.idle.is_some(), p.batch.is_empty());
        if s.running.is_empty() && s.queued.is_empty() {
            prop_assert_eq!(p.idle, Some(Idle::NoWork));
        }
    }
}
