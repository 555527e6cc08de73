//! Where a request runs, and where it goes when it must move: pure decisions over the registry.
//!
//! No tokio, no tonic, no network. Each decision takes the registry (which the caller has locked,
//! or which a test built), the request's named blocks and what went wrong, and returns a plan;
//! the worker calls that act on it live in [`super::calls`]. That keeps the choices unit-tested
//! like the registry's own.
//!
//! Invariants:
//! - A request is counted (requests and prompt tokens in flight) on the workers of its current
//!   plan only: a decision that changes the plan takes the counts off the old workers and puts
//!   them on the new ones, in the same registry update.
//! - A worker the request lost is never chosen again to hold its sequence (prefill workers are
//!   not avoided: losing a decode worker says nothing about them), unless it registered again at
//!   another address: restarted, it is another process.
//! - Every plan leaves room for at least one generated token on the workers it names.
//! - A request moves at most its limit of times (`--max-migrations`).

use crate::error::RouterError;
use crate::registry::{AdapterKey, Plan, PromptBlocks, Registry, Target};
use crate::request::{check_budget, check_length};
use tandem_model::request::Request;
use tandem_model::ModelError;

/// Chooses the workers for a new request whose prompt is `blocks` and counts it on them. Fails
/// with UNAVAILABLE when no worker can take it, and with INVALID_ARGUMENT when the prompt leaves
/// no room for a generated token on the workers chosen, or no room for `strict_max_tokens`
/// generated tokens; nothing is counted then.
pub(crate) fn place(
    reg: &mut Registry,
    blocks: &PromptBlocks,
    strict_max_tokens: Option<u32>,
) -> Result<Plan, RouterError> {
    let plan = reg.pick(blocks).map_err(RouterError::Unavailable)?;
    check_length(blocks.tokens(), plan.max_sequence_len())?;
    if let Some(m) = strict_max_tokens {
        check_budget(blocks.tokens(), m, plan.max_sequence_len())?;
    }
    reg.begin(&plan, blocks);
    Ok(plan)
}

/// The decode worker of `old` turned the request's `Reserve` down (full or draining, which the
/// caller has recorded in the registry): choose again among the workers not in `lost`, and move
/// the request's counts to the choice. When no other choice can hold the prompt, the request
/// stays on `old` (counted on it once, as before).
pub(crate) fn replan(reg: &mut Registry, old: &Plan, blocks: &PromptBlocks, lost: &[String]) -> Plan {
    let prompt_len = blocks.tokens();
    if let Plan::Split { prefill, .. } = old {
        reg.prefill_done(prefill, prompt_len as u64);
    }
    reg.request_done(old.decoder());
    let plan = match reg.pick_avoiding(blocks, lost) {
        Ok(p) if check_length(prompt_len, p.max_sequence_len()).is_ok() => p,
        _ => old.clone(),
    };
    reg.begin(&plan, blocks);
    plan
}

/// The LoRA adapter `request` runs under, as the router resolved it (None: the base model).
pub(crate) fn adapter_of(request: &Request) -> Option<AdapterKey> {
    let p = request.params();
    (!p.adapter.is_empty()).then(|| AdapterKey { name: p.adapter.clone(), id: p.adapter_id.clone() })
}

/// The named blocks of `request`'s prompt for each of `block_sizes`, in the namespace the workers
/// cache them under: the model `model_id`, the request's salt and its adapter.
pub(crate) fn prompt_blocks(request: &Request, model_id: &str, block_sizes: &[u32]) -> PromptBlocks {
    PromptBlocks::under(request.prompt(), model_id, request.salt(), adapter_of(request), block_sizes)
}

/// Whether a worker chosen for the request was known to hold the start of its prompt.
pub(crate) fn routed_by_cache(plan: &Plan) -> bool {
    match plan {
        Plan::Split { prefill, decode, .. } => prefill.overlap > 0 || decode.overlap > 0,
        Plan::Colocated { worker } => worker.overlap > 0,
    }
}

/// Why a request cannot leave a worker it lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stuck {
    /// It already moved as often as it may.
    Exhausted,
    /// No worker it has not lost can hold its sequence now.
    Nowhere,
    /// It has several choices and streamed tokens of them (each would need a prompt of its own).
    Choices,
}

/// A request's record of moves between decode (or colocated) workers: how many it made, how many
/// it may make, and the workers it lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Moves {
    made: u32,
    limit: u32,
    lost: Vec<String>,
    /// The admission each lost incarnation was chosen under, in `lost`'s order.
    lost_registrations: Vec<u64>,
}

impl Moves {
    /// No moves yet; at most `limit` of them.
    pub(crate) fn new(limit: u32) -> Moves {
        Moves { made: 0, limit, lost: Vec::new(), lost_registrations: Vec::new() }
    }

    /// Moves made so far.
    pub(crate) fn made(&self) -> u32 {
        self.made
    }

    /// The worker incarnations (`id@address`) the request lost, in the order it lost them.
    pub(crate) fn lost(&self) -> &[String] {
        &self.lost
    }

    /// Whether every move allowed is used up.
    pub(crate) fn exhausted(&self) -> bool {
        self.made >= self.limit
    }

    /// Whether the request, holding `len` tokens (its prompt and the tokens streamed), could move
    /// off `from` now: a move is left, and a worker it has not lost (nor `from`) can hold that
    /// many (and holds its LoRA `adapter`, if any). Counts nothing: this is the question a stream
    /// asks before it gives its worker up.
    pub(crate) fn could_leave(
        &self,
        reg: &Registry,
        from: &Target,
        len: usize,
        adapter: Option<&AdapterKey>,
    ) -> bool {
        if self.exhausted() {
            return false;
        }
        let mut avoid = self.lost.clone();
        avoid.push(from.incarnation());
        reg.pick_avoiding(&PromptBlocks::unhashed(len).with_adapter(adapter.cloned()), &avoid)
            .is_ok_and(|p| check_length(len, p.max_sequence_len()).is_ok())
    }

    /// `from`, the worker holding the sequence of `old`, is lost: record it, choose where the
    /// sequence continues (`blocks` names what the new workers must take as their prompt: the
    /// client's prompt followed by the tokens streamed), and move the request's count from `old`'s
    /// decode worker to the choice. `old`'s prefill worker is the caller's to uncount first (it
    /// may already have answered). Counts a move only when one is made.
    pub(crate) fn leave(
        &mut self,
        reg: &mut Registry,
        old: &Plan,
        from: &Target,
        blocks: &PromptBlocks,
    ) -> Result<Plan, Stuck> {
        if self.exhausted() {
            return Err(Stuck::Exhausted);
        }
        // The latest registration it was lost under: a later rejoin takes it again only once it
        // registered after that.
        match self.lost.iter().position(|l| *l == from.incarnation()) {
            Some(i) => self.lost_registrations[i] = from.registration,
            None => {
                self.lost.push(from.incarnation());
                self.lost_registrations.push(from.registration);
            }
        }
        let avoid = self.lost.clone();
        self.move_to_any(reg, old, blocks, &avoid)
    }

    /// Chooses a worker for `blocks` among those not in `avoid` with room for it, and moves the
    /// request's count from `old`'s decode worker to the choice, counting a move.
    fn move_to_any(
        &mut self,
        reg: &mut Registry,
        old: &Plan,
        blocks: &PromptBlocks,
        avoid: &[String],
    ) -> Result<Plan, Stuck> {
        let len = blocks.tokens();
        let plan = reg
            .pick_avoiding(blocks, avoid)
            .ok()
            .filter(|p| check_length(len, p.max_sequence_len()).is_ok())
            .ok_or(Stuck::Nowhere)?;
        reg.request_done(old.decoder());
        reg.begin(&plan, blocks);
        self.made += 1;
        Ok(plan)
    }

    /// The request, which lost a worker of `old` with nowhere to go ([`Moves::leave`] said so),
    /// has waited: choose a usable worker now, a lost one included once it registered again (a
    /// restarted process on the same address; nothing was streamed, so nothing ties the request
    /// to the process it lost), and move the request's count to it. Counts a move when one is
    /// made.
    pub(crate) fn rejoin(
        &mut self,
        reg: &mut Registry,
        old: &Plan,
        blocks: &PromptBlocks,
    ) -> Result<Plan, Stuck> {
        if self.exhausted() {
            return Err(Stuck::Exhausted);
        }
        let avoid: Vec<String> = self
            .lost
            .iter()
            .zip(&self.lost_registrations)
            .filter(|(inc, &at)| !reg.registered_again(inc, at))
            .map(|(inc, _)| inc.clone())
            .collect();
        self.move_to_any(reg, old, blocks, &avoid)
    }
}

/// The continuation of `original` after `streamed` tokens were generated, when its worker was
/// lost: its prompt is the client's prompt followed by every token streamed so far (the router's
/// text output already holds those, so it only sees the new ones), `max_tokens` counts what is
/// left (at least 1), and it gets a seed of its own: the continuation is a valid sample, not a
/// replay of the random stream the first worker drew. The same request when nothing was
/// streamed.
pub(crate) fn resume(original: &Request, streamed: &[u32]) -> Result<Request, ModelError> {
    let seed = original.params().seed.unwrap_or(0);
    Ok(original
        .continued(streamed)?
        .with_seed(seed ^ (streamed.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::fixtures::*;
    use crate::registry::WorkerEntry;
    use std::time::Instant;
    use tandem_model::request::SamplingParams;
    use tandem_proto::v1::Role;

    /// Two decode workers (d1 with more free blocks) and one prefill worker, over tcp.
    fn cluster() -> Registry {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("d2", Role::Decode, 2, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        r.heartbeat("d1", Some(load(60, 0)), t0);
        r.heartbeat("d2", Some(load(50, 0)), t0);
        r
    }

    /// `(requests, prompt tokens)` in flight on `id`, as the router counts them.
    fn counted(r: &Registry, id: &str) -> (u32, u64) {
        let e: &WorkerEntry = r.get(id).unwrap();
        (e.inflight_requests, e.inflight_prompt_tokens)
    }

    fn ids(plan: &Plan) -> (String, String) {
        match plan {
            Plan::Split { prefill, decode, .. } => (prefill.worker_id.clone(), decode.worker_id.clone()),
            Plan::Colocated { worker } => (String::new(), worker.worker_id.clone()),
        }
    }

    #[test]
    fn a_new_request_goes_to_the_least_loaded_pair_and_is_counted_there() {
        let mut r = cluster();
        let plan = place(&mut r, &PromptBlocks::unhashed(40), None).unwrap();
        assert_eq!(ids(&plan), ("p1".into(), "d1".into()));
        assert_eq!(counted(&r, "d1"), (1, 0));
        assert_eq!(counted(&r, "d2"), (0, 0));
        assert_eq!(counted(&r, "p1"), (1, 40));
        assert!(!routed_by_cache(&plan));
    }

    #[test]
    fn nothing_fits_no_worker_or_no_room_for_a_token_and_nothing_is_counted() {
        let mut empty = registry();
        let e = place(&mut empty, &PromptBlocks::unhashed(40), None).unwrap_err();
        assert!(matches!(&e, RouterError::Unavailable(m) if m.contains("no worker")), "{e}");
        // Decode workers without a prefill worker cannot take a request either, unless the
        // prefill fallback lets them compute the prompt themselves.
        let mut r = registry();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, Instant::now()).unwrap();
        assert!(matches!(place(&mut r, &PromptBlocks::unhashed(40), None), Err(RouterError::Unavailable(_))));
        assert!(!r.serving().0, "{}", r.serving().1);
        r.set_prefill_fallback(true);
        assert!(r.serving().0 && r.serving().1.contains("--prefill-fallback decode"), "{}", r.serving().1);
        let plan = place(&mut r, &PromptBlocks::unhashed(40), None).unwrap();
        assert!(plan.decode_prefills(), "{plan:?}");
        assert_eq!(counted(&r, "d1"), (1, 0));
        // The workers hold 512 tokens: a 512-token prompt leaves no room for one more.
        let mut r = cluster();
        let e = place(&mut r, &PromptBlocks::unhashed(512), None).unwrap_err();
        assert!(matches!(&e, RouterError::InvalidArgument(m) if m.contains("limit is 511")), "{e}");
        assert!(place(&mut r, &PromptBlocks::unhashed(511), None).is_ok());
        assert_eq!(counted(&r, "p1"), (1, 511), "only the request that fit is counted");
        // A strict max_tokens must fit after the prompt; nothing is counted when it does not.
        let mut r = cluster();
        let e = place(&mut r, &PromptBlocks::unhashed(500), Some(13)).unwrap_err();
        assert!(
            matches!(&e, RouterError::InvalidArgument(m) if m.contains("500 tokens plus max_tokens 13")),
            "{e}"
        );
        assert_eq!(counted(&r, "p1"), (0, 0), "a refused request is not counted");
        assert!(place(&mut r, &PromptBlocks::unhashed(500), Some(12)).is_ok());
    }

    #[test]
    fn a_request_that_waited_rejoins_a_worker_it_lost_once_it_is_usable_again() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        let blocks = PromptBlocks::unhashed(40);
        let plan = place(&mut r, &blocks, None).unwrap();
        let d1 = plan.decoder().clone();
        r.mark_unhealthy("d1", &d1.address, "connection refused");
        let mut moves = Moves::new(2);
        assert_eq!(moves.leave(&mut r, &plan, &d1, &blocks), Err(Stuck::Nowhere));
        assert_eq!(moves.rejoin(&mut r, &plan, &blocks), Err(Stuck::Nowhere), "still down");
        // Reporting again is not coming back: the same process the request lost.
        r.heartbeat("d1", None, t0);
        assert_eq!(moves.rejoin(&mut r, &plan, &blocks), Err(Stuck::Nowhere), "the same process");
        assert_eq!(moves.made(), 0);
        // It comes back (restarted at the same address, it registers again): the request goes
        // back to it, counted once.
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        let back = moves.rejoin(&mut r, &plan, &blocks).unwrap();
        assert_eq!(back.decoder().incarnation(), d1.incarnation());
        assert_eq!((moves.made(), counted(&r, "d1").0), (1, 1));
        let mut spent = Moves::new(0);
        assert_eq!(spent.rejoin(&mut r, &plan, &blocks), Err(Stuck::Exhausted));
    }

    #[test]
    fn decode_workers_compute_prompts_only_while_no_prefill_worker_is_left() {
        let mut r = cluster();
        r.set_prefill_fallback(true);
        // A prefill worker is up: the usual split.
        let plan = place(&mut r, &PromptBlocks::unhashed(40), None).unwrap();
        assert!(!plan.decode_prefills() && matches!(plan, Plan::Split { .. }), "{plan:?}");
        // It is lost mid-prefill: the request moves to a decode worker that computes the prompt.
        let Plan::Split { prefill, .. } = plan.clone() else { unreachable!() };
        r.prefill_done(&prefill, 40);
        let mut moves = Moves::new(2);
        let next = moves.leave(&mut r, &plan, &prefill, &PromptBlocks::unhashed(40)).unwrap();
        assert!(next.decode_prefills(), "{next:?}");
        assert_eq!(ids(&next), (String::new(), "d1".into()));
        assert_eq!(counted(&r, "d1"), (1, 0), "moved from d1 to d1: counted once");
        // Without the fallback, the request has nowhere to go.
        r.set_prefill_fallback(false);
        let mut moves = Moves::new(2);
        assert_eq!(moves.leave(&mut r, &plan, &prefill, &PromptBlocks::unhashed(40)), Err(Stuck::Nowhere));
        // A prefill worker that is draining is no prefill worker.
        let mut r = cluster();
        r.set_prefill_fallback(true);
        r.mark_draining("p1", &r.get("p1").unwrap().info.address.clone());
        assert!(place(&mut r, &PromptBlocks::unhashed(40), None).unwrap().decode_prefills());
    }

    #[test]
    fn a_prompt_goes_where_its_prefix_is_cached() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(caching("d1", Role::Decode, 1), false, t0).unwrap();
        r.admit(caching("d2", Role::Decode, 2), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        r.heartbeat("d1", Some(load(40, 0)), t0);
        r.heartbeat("d2", Some(load(36, 0)), t0);
        let ask = prompt(0, 80, "");
        r.set_cache("d2", Some(&digest(ask.reusable(16))));
        let plan = place(&mut r, &ask, None).unwrap();
        assert_eq!((plan.decoder().worker_id.as_str(), plan.decoder().overlap), ("d2", 4));
        assert!(routed_by_cache(&plan));
    }

    #[test]
    fn a_refused_reserve_moves_the_request_and_its_counts_to_the_next_choice() {
        let mut r = cluster();
        let blocks = PromptBlocks::unhashed(40);
        let first = place(&mut r, &blocks, None).unwrap();
        // d1 answered Reserve with RESOURCE_EXHAUSTED: orchestration marks it, then replans.
        r.no_room("d1");
        let second = replan(&mut r, &first, &blocks, &[]);
        assert_eq!(ids(&second), ("p1".into(), "d2".into()));
        assert_eq!(counted(&r, "d1"), (0, 0));
        assert_eq!(counted(&r, "d2"), (1, 0));
        assert_eq!(counted(&r, "p1"), (1, 40), "the prompt is queued once, not twice");
        // Draining is a refusal too.
        r.mark_draining("d2", &r.get("d2").unwrap().info.address.clone());
        r.heartbeat("d1", Some(load(60, 0)), Instant::now());
        let third = replan(&mut r, &second, &blocks, &[]);
        assert_eq!(third.decoder().worker_id, "d1");
        assert_eq!((counted(&r, "d1"), counted(&r, "d2")), ((1, 0), (0, 0)));
    }

    #[test]
    fn with_nowhere_else_to_go_a_replan_keeps_the_plan_counted_once() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 2, &[("tcp", "")]), false, t0).unwrap();
        let blocks = PromptBlocks::unhashed(40);
        let first = place(&mut r, &blocks, None).unwrap();
        r.mark_draining("d1", &r.get("d1").unwrap().info.address.clone());
        let again = replan(&mut r, &first, &blocks, &[]);
        assert_eq!(again, first, "the request waits where it is");
        assert_eq!((counted(&r, "d1"), counted(&r, "p1")), ((1, 0), (1, 40)));
    }

    #[test]
    fn a_replan_never_returns_to_a_worker_the_request_lost() {
        let mut r = cluster();
        let blocks = PromptBlocks::unhashed(40);
        let lost = vec![r.get("d1").unwrap().incarnation()];
        // The request already moved off d1, which came back with the most free blocks.
        let on_d2 = r.pick_avoiding(&blocks, &lost).unwrap();
        r.begin(&on_d2, &blocks);
        r.no_room("d2");
        let plan = replan(&mut r, &on_d2, &blocks, &lost);
        assert_eq!(plan.decoder().worker_id, "d2", "d1 is never chosen again");
        assert_eq!((counted(&r, "d1"), counted(&r, "d2")), ((0, 0), (1, 0)));
    }

    #[test]
    fn a_decode_worker_lost_mid_stream_hands_the_sequence_to_another() {
        let mut r = cluster();
        let prompt: Vec<u32> = (0..40).collect();
        let first = place(&mut r, &PromptBlocks::unhashed(prompt.len()), None).unwrap();
        assert_eq!(first.decoder().worker_id, "d1");
        // p1 answered its Prefill (orchestration uncounted it), d1 streamed 5 tokens, then died.
        r.prefill_done(&target(&r, "p1"), 40);
        r.mark_unhealthy("d1", &r.get("d1").unwrap().info.address.clone(), "connection refused");
        let streamed = [100, 101, 102, 103, 104];
        let resume = resume(&request(&prompt, 16, 7), &streamed).unwrap();
        let mut moves = Moves::new(2);
        let blocks = PromptBlocks::unhashed(resume.prompt().len());
        let d1 = first.decoder().clone();
        assert!(moves.could_leave(&r, &d1, resume.prompt().len(), None));
        let second = moves.leave(&mut r, &first, &d1, &blocks).unwrap();
        assert_eq!(ids(&second), ("p1".into(), "d2".into()));
        assert_eq!((moves.made(), moves.lost()), (1, &[d1.incarnation()][..]));
        // The count followed the sequence; p1 computes the prompt and the streamed tokens.
        assert_eq!(counted(&r, "d1"), (0, 0));
        assert_eq!(counted(&r, "d2"), (1, 0));
        assert_eq!(counted(&r, "p1"), (1, 45));
    }

    #[test]
    fn workers_that_already_failed_are_excluded_until_nowhere_is_left() {
        let mut r = cluster();
        let blocks = PromptBlocks::unhashed(40);
        let mut moves = Moves::new(5);
        let first = place(&mut r, &blocks, None).unwrap();
        r.prefill_done(&target(&r, "p1"), 40);
        // d1 comes back healthy at once, with the most free blocks: it is still never chosen.
        let second = moves.leave(&mut r, &first, first.decoder(), &blocks).unwrap();
        assert_eq!(second.decoder().worker_id, "d2");
        assert!(!moves.could_leave(&r, second.decoder(), 40, None), "only d1, which it lost, is left");
        r.prefill_done(&target(&r, "p1"), 40);
        assert_eq!(moves.leave(&mut r, &second, second.decoder(), &blocks), Err(Stuck::Nowhere));
        assert_eq!(moves.made(), 1, "a move that found nowhere to go is not counted");
        assert_eq!(moves.lost(), [first.decoder().incarnation(), second.decoder().incarnation()]);
        // The request stays counted where it was (its cleanup uncounts it there).
        assert_eq!((counted(&r, "d1"), counted(&r, "d2")), ((0, 0), (1, 0)));
    }

    #[test]
    fn a_request_moves_no_more_often_than_its_limit() {
        let mut r = cluster();
        let blocks = PromptBlocks::unhashed(40);
        let first = place(&mut r, &blocks, None).unwrap();
        let mut never = Moves::new(0);
        assert!(!never.could_leave(&r, first.decoder(), 40, None));
        assert_eq!(never.leave(&mut r, &first, first.decoder(), &blocks), Err(Stuck::Exhausted));
        assert!(never.lost().is_empty());
        let mut once = Moves::new(1);
        let second = once.leave(&mut r, &first, first.decoder(), &blocks).unwrap();
        assert!(once.exhausted());
        r.admit(worker("d3", Role::Decode, 4, &[("tcp", "")]), false, Instant::now()).unwrap();
        assert!(!once.could_leave(&r, second.decoder(), 40, None), "d3 could take it, but no move is left");
        assert_eq!(once.leave(&mut r, &second, second.decoder(), &blocks), Err(Stuck::Exhausted));
    }

    #[test]
    fn a_move_needs_room_for_the_prompt_and_the_tokens_streamed() {
        let mut r = cluster();
        let first = place(&mut r, &PromptBlocks::unhashed(500), None).unwrap();
        let mut moves = Moves::new(2);
        // 500 prompt tokens and 11 streamed fit in 512 with one to spare; 12 do not.
        assert!(moves.could_leave(&r, first.decoder(), 511, None));
        assert!(!moves.could_leave(&r, first.decoder(), 512, None));
        let full = PromptBlocks::unhashed(512);
        assert_eq!(moves.leave(&mut r, &first, first.decoder(), &full), Err(Stuck::Nowhere));
    }

    #[test]
    fn a_colocated_request_moves_to_another_colocated_worker() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("c1", Role::Colocated, 1, &[]), false, t0).unwrap();
        r.admit(worker("c2", Role::Colocated, 2, &[]), false, t0).unwrap();
        let blocks = PromptBlocks::unhashed(40);
        let first = place(&mut r, &blocks, None).unwrap();
        assert!(matches!(&first, Plan::Colocated { worker } if worker.worker_id == "c1"));
        let second = Moves::new(1).leave(&mut r, &first, first.decoder(), &blocks).unwrap();
        assert!(matches!(&second, Plan::Colocated { worker } if worker.worker_id == "c2"));
        assert_eq!((counted(&r, "c1"), counted(&r, "c2")), ((0, 0), (1, 0)));
    }

    #[test]
    fn a_moved_sequence_follows_its_cached_blocks() {
        // The new worker is chosen for the prompt and the tokens streamed, as named blocks: one
        // that holds their start wins over one with more free blocks.
        let mut r = registry();
        let t0 = Instant::now();
        for (id, port) in [("d1", 1), ("d2", 2), ("d3", 3)] {
            r.admit(caching(id, Role::Decode, port), false, t0).unwrap();
        }
        r.admit(worker("p1", Role::Prefill, 4, &[("tcp", "")]), false, t0).unwrap();
        r.heartbeat("d1", Some(load(60, 0)), t0);
        r.heartbeat("d2", Some(load(36, 0)), t0);
        r.heartbeat("d3", Some(load(40, 0)), t0);
        let first = place(&mut r, &PromptBlocks::unhashed(48), None).unwrap();
        assert_eq!(first.decoder().worker_id, "d1");
        let resume =
            resume(&request(&(0..48).collect::<Vec<_>>(), 64, 1), &(48..80).collect::<Vec<_>>()).unwrap();
        let blocks = PromptBlocks::new(resume.prompt(), MODEL, "", &[16]);
        r.set_cache("d2", Some(&digest(blocks.reusable(16))));
        let second = Moves::new(1).leave(&mut r, &first, first.decoder(), &blocks).unwrap();
        assert_eq!((second.decoder().worker_id.as_str(), second.decoder().overlap), ("d2", 4));
    }

    fn request(prompt: &[u32], max_tokens: usize, seed: u64) -> Request {
        let params = SamplingParams { max_tokens, seed: Some(seed), ..SamplingParams::greedy() };
        Request::new(prompt.to_vec(), params, 1000).unwrap()
    }

    #[test]
    fn the_continuation_takes_the_streamed_tokens_as_prompt_and_what_is_left_to_generate() {
        let original = request(&[1, 2, 3], 10, 42);
        let r = resume(&original, &[7, 8]).unwrap();
        assert_eq!(r.prompt(), &[1, 2, 3, 7, 8]);
        assert_eq!(r.params().max_tokens, 8);
        assert_ne!(r.params().seed, Some(42), "a fresh random stream");
        assert_eq!(resume(&original, &[7, 8]).unwrap(), r, "the same for the same request");
        assert_ne!(resume(&original, &[7, 8, 9]).unwrap().params().seed, r.params().seed);
        // Nothing streamed yet: the same request again.
        assert_eq!(resume(&original, &[]).unwrap(), original);
        // Never less than one token to generate.
        assert_eq!(resume(&request(&[1], 10, 0), &[5; 12]).unwrap().params().max_tokens, 1);
        // A streamed id outside the vocabulary cannot become a prompt.
        assert!(resume(&original, &[5000]).is_err());
    }
}
