//! Waiting for free KV blocks: when every decode worker is full, requests line up and retry.
//!
//! Requests that found the decode workers full are served first come, first served: the head of
//! the line holds the lock and retries (its pause doubling), the others wait for it, and a new
//! request queues behind them instead of overtaking.
//!
//! Invariants:
//! - The line never holds more than `--max-kv-waiting` requests: one that finds it full is
//!   refused at once (RESOURCE_EXHAUSTED).
//! - No request waits longer than `--kv-wait-ms` in all, nor while the router drains.
//! - A request's place in the line is given up whatever way it leaves (reserved, failed, or the
//!   client went away): the `tandem_router_kv_waiting` gauge counts the places held.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Code, Status};

use super::{Run, RunError, DRAINING, NO_BLOCKS};
use crate::error::RouterError;
use crate::registry::Target;
use crate::Shared;

/// First pause before asking again for KV blocks when every decode worker is full; it doubles
/// up to [`KV_WAIT_MAX_PAUSE`] while the request waits (at most `--kv-wait-ms`).
const KV_WAIT_FIRST_PAUSE: Duration = Duration::from_millis(5);
const KV_WAIT_MAX_PAUSE: Duration = Duration::from_millis(200);

/// A request's place in the router's line for KV blocks. Dropping the place lets the next
/// request go.
struct KvLine {
    shared: Arc<Shared>,
    _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

/// Why a request got no place at the head of the line for KV blocks.
enum NoTurn {
    /// `--max-kv-waiting` requests were in the line already.
    Full,
    /// The turn did not come before the deadline.
    TimedOut,
}

impl KvLine {
    /// Joins the line and waits for the turn, for at most `limit`; a full line is refused at once.
    async fn join(shared: &Arc<Shared>, limit: Duration) -> Result<KvLine, NoTurn> {
        shared.metrics.kv_waiting.inc();
        let mut place = KvLine { shared: shared.clone(), _turn: None };
        // Counted first, then checked: two requests racing for the last place may both be
        // refused, but the line never grows past the limit.
        if shared.metrics.kv_waiting.get() > shared.max_kv_waiting as i64 {
            return Err(NoTurn::Full);
        }
        let turn = tokio::time::timeout(limit, shared.kv_line.clone().lock_owned())
            .await
            .map_err(|_| NoTurn::TimedOut)?;
        place._turn = Some(turn);
        Ok(place)
    }
}

impl Drop for KvLine {
    fn drop(&mut self) {
        self.shared.metrics.kv_waiting.dec();
    }
}

/// How one attempt of a request waits for KV blocks: since when, its next pause, and its place
/// in the line once it has one.
pub(super) struct Waiting {
    since: Instant,
    pause: Duration,
    line: Option<KvLine>,
}

impl Waiting {
    /// Not waiting yet.
    pub(super) fn new() -> Waiting {
        Waiting { since: Instant::now(), pause: KV_WAIT_FIRST_PAUSE, line: None }
    }

    /// The request got its blocks: the next request in line takes its turn.
    pub(super) fn reserved(&mut self) {
        self.line = None;
    }
}

impl Run {
    /// Before asking for blocks: when earlier requests wait for KV blocks, queue behind them and
    /// choose workers again at the head of the line. Returns whether it queued (the caller starts
    /// over with the new choice).
    pub(super) async fn behind_others(
        &mut self,
        wait: &mut Waiting,
        decode: &Target,
    ) -> Result<bool, RouterError> {
        if wait.line.is_some() || self.shared.metrics.kv_waiting.get() <= 0 {
            return Ok(false);
        }
        wait.line = Some(self.join_line(wait.since, decode).await?);
        self.replan();
        Ok(true)
    }

    /// `decode` answered `Reserve` with RESOURCE_EXHAUSTED (`st`): it holds nothing for this
    /// request. Waits for a turn (the line's head tries again at once, then with a growing
    /// pause) and chooses workers again; fails when the wait would pass `--kv-wait-ms` or the
    /// router is draining.
    pub(super) async fn wait_for_blocks(
        &mut self,
        wait: &mut Waiting,
        decode: &Target,
        st: &Status,
    ) -> Result<(), RunError> {
        self.cleanup.decode_release = None;
        self.shared.with_registry(|r| r.no_room(&decode.worker_id));
        if self.shared.draining() {
            return Err(RouterError::Unavailable(format!(
                "{DRAINING}: the request was still waiting for free KV blocks"
            ))
            .into());
        }
        let waited = wait.since.elapsed();
        if waited + wait.pause > self.shared.kv_wait {
            let msg = if self.shared.kv_wait.is_zero() {
                format!("{} (--kv-wait-ms 0: no waiting)", st.message())
            } else {
                format!(
                    "no decode worker had free KV blocks for this prompt within --kv-wait-ms {} (last answer from {}: {})",
                    self.shared.kv_wait.as_millis(),
                    decode.describe(),
                    st.message()
                )
            };
            return Err(RouterError::concealed(Code::ResourceExhausted, NO_BLOCKS, msg).into());
        }
        self.shared.metrics.kv_waits.inc();
        tracing::debug!(
            request_id = %self.request_id,
            worker = %decode.worker_id,
            waited_ms = waited.as_millis() as u64,
            "decode worker full; waiting for free KV blocks"
        );
        if wait.line.is_none() {
            // Join the line; at its head, try again at once.
            wait.line = Some(self.join_line(wait.since, decode).await?);
        } else {
            tokio::time::sleep(wait.pause).await;
            wait.pause = (wait.pause * 2).min(KV_WAIT_MAX_PAUSE);
        }
        self.replan();
        Ok(())
    }

    /// Waits for this request's turn in the line for KV blocks, until `--kv-wait-ms` after
    /// `since` at most.
    async fn join_line(&self, since: Instant, decode: &Target) -> Result<KvLine, RouterError> {
        let limit = self.shared.kv_wait.saturating_sub(since.elapsed());
        let ahead = self.shared.metrics.kv_waiting.get();
        KvLine::join(&self.shared, limit).await.map_err(|why| match why {
            NoTurn::Full => RouterError::ResourceExhausted(format!(
                "the cluster is at capacity: {} requests already wait for KV blocks (--max-kv-waiting); retry later",
                self.shared.max_kv_waiting
            )),
            NoTurn::TimedOut => RouterError::concealed(Code::ResourceExhausted, NO_BLOCKS, format!(
                "no decode worker had free KV blocks for this prompt within --kv-wait-ms {} ({ahead} earlier request(s) were waiting for blocks; last worker chosen: {})",
                self.shared.kv_wait.as_millis(),
                decode.describe()
            ))
        })
    }
}
