//! What a request leaves behind on its workers, undone whatever way it ends.
//!
//! [`Cleanup`] is a drop guard: finished, failed, client gone, deadline or panic, dropping it
//! un-counts the request in the registry and sends `Release` to each worker that may still hold
//! something for it. Dropping a worker call's future resets its HTTP/2 stream, which the worker
//! treats as a cancellation too; `Release` covers what a stream reset cannot (a reservation, or
//! a prompt a prefill worker still holds).
//!
//! Invariants:
//! - The registry's counts for the request are taken off exactly once: the prefill worker's when
//!   it answers or the request gives up on it, the decode worker's when the guard drops.
//! - Every worker that may hold a reservation or a sequence for the request gets a `Release`,
//!   including a decode worker the request moved away from, unless its process was replaced
//!   (the worker registered again at the same address): the `Release` would reach the new one.

use std::sync::Arc;

use crate::registry::{Plan, Target};
use crate::workers;
use crate::Shared;

/// Decides what happens to the request's workers when it ends, whatever the way.
pub(super) struct Cleanup {
    shared: Arc<Shared>,
    request_id: String,
    /// The id the workers know the request by (what a Release names).
    wire_id: String,
    /// The request's current plan (its counts are on these workers).
    plan: Plan,
    /// Prompt tokens counted against the prefill worker's queue.
    prompt_tokens: u64,
    /// The prompt still counts against the prefill worker's queue in the registry.
    prefill_counted: bool,
    /// The prefill worker has the prompt (Prefill sent, not answered).
    pub(super) prefill_pending: bool,
    /// The decode worker may hold a reservation or a sequence: release this reservation id.
    pub(super) decode_release: Option<u64>,
}

impl Cleanup {
    /// The guard of request `request_id`, counted on `plan` with a prompt of `prompt_tokens`.
    pub(super) fn new(
        shared: Arc<Shared>,
        request_id: String,
        wire_id: String,
        plan: Plan,
        prompt_tokens: u64,
    ) -> Cleanup {
        Cleanup {
            shared,
            request_id,
            wire_id,
            prefill_counted: matches!(plan, Plan::Split { .. }),
            plan,
            prompt_tokens,
            prefill_pending: false,
            decode_release: None,
        }
    }

    /// The prefill worker is done with the prompt (answered, failed, or was never asked).
    pub(super) fn uncount_prefill(&mut self) {
        if let (Plan::Split { prefill, .. }, true) = (&self.plan, self.prefill_counted) {
            self.prefill_counted = false;
            let tokens = self.prompt_tokens;
            self.shared.with_registry(|r| r.prefill_done(prefill, tokens));
        }
    }

    /// The request is now counted on `plan`, with a prompt of `prompt_tokens`.
    pub(super) fn counted_on(&mut self, plan: &Plan, prompt_tokens: u64) {
        self.prefill_counted = matches!(plan, Plan::Split { .. });
        self.plan = plan.clone();
        self.prompt_tokens = prompt_tokens;
    }

    /// The request left the decode worker `left`, which may still hold blocks for it (a frozen
    /// worker that comes back, or a reservation a lost prefill worker was filling): release them
    /// now rather than when the request ends. `only_reservation`: the request may go on on the
    /// same worker (its prefill worker was lost), so only that reservation is released, not
    /// everything of the request there (which would take the next reservation too).
    pub(super) fn release_left(&mut self, left: &Target, only_reservation: bool) {
        if let (Some(res), Ok(rt)) = (self.decode_release.take(), tokio::runtime::Handle::try_current()) {
            if only_reservation && res == 0 {
                return; // a Reserve in flight that never answered: its lease ends it
            }
            if self.replaced(left) {
                return;
            }
            let request_id = if only_reservation { String::new() } else { self.wire_id.clone() };
            rt.spawn(workers::release(
                self.shared.clone(),
                left.worker_id.clone(),
                left.address.clone(),
                request_id,
                res,
            ));
        }
    }
}

impl Cleanup {
    /// Tells the prefill worker `t`, which the request left, to drop the prompt if it still
    /// holds it (best effort: a dead worker needs nothing).
    pub(super) fn release_prompt(&self, t: &Target) {
        if self.replaced(t) {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(workers::release(
                self.shared.clone(),
                t.worker_id.clone(),
                t.address.clone(),
                self.wire_id.clone(),
                0,
            ));
        }
    }
}

impl Cleanup {
    /// Whether `t`'s process was replaced: the worker registered again, restarted at the same
    /// address. What the old process held died with it, and a `Release` by request or
    /// reservation id would reach the new one, whose ids mean other things (reservation ids
    /// start again at 1; a request id released before its `Reserve` is refused when it comes).
    fn replaced(&self, t: &Target) -> bool {
        self.shared.with_registry(|r| r.registered_again(&t.incarnation(), t.registration))
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        self.uncount_prefill();
        let shared = self.shared.clone();
        let prefill_pending = self.prefill_pending;
        shared.with_registry(|r| r.request_done(self.plan.decoder()));
        shared.free_request_id(&self.request_id);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // the runtime is gone: so is the process, and the workers cancel on disconnect
        };
        let mut releases: Vec<(&Target, u64)> = Vec::new();
        if let (Plan::Split { prefill, .. }, true) = (&self.plan, prefill_pending) {
            releases.push((prefill, 0));
        }
        if let Some(res) = self.decode_release {
            releases.push((self.plan.decoder(), res));
        }
        for (t, res) in releases {
            if self.replaced(t) {
                continue;
            }
            rt.spawn(workers::release(
                shared.clone(),
                t.worker_id.clone(),
                t.address.clone(),
                self.wire_id.clone(),
                res,
            ));
        }
    }
}
