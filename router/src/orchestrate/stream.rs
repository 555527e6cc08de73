//! Following a `Decode` stream: the worker's messages go through output shaping to the client
//! until the request finishes, and a worker that stops streaming is noticed.
//!
//! Invariants:
//! - A stream ends the request only with a finish reason (the worker's, or the router's own stop
//!   or context limit); a stream that ends without one, or fails at the transport, is a loss.
//! - A worker the registry gave up on (missed heartbeats, unhealthy) is left only after its
//!   stream has been silent as long as the registry waits for heartbeats, and only when another
//!   worker could take the request: a worker too busy to heartbeat still streams, and is
//!   followed to the end.

use std::time::Instant;

use tandem_proto::v1::worker_client::WorkerClient;
use tandem_proto::v1::{DecodeRequest, DecodeResponse};
use tokio::sync::watch;
use tonic::transport::Channel;
use tonic::Code;

use super::{ResponseTx, Run, RunError, FAILED};
use crate::error::RouterError;
use crate::registry::{Plan, Target, MISSED_HEARTBEATS};
use tandem_serve::auth::cluster_request;

impl Run {
    /// Calls `Decode` on `t` and streams its answer to the client.
    pub(super) async fn decode_and_follow(
        &mut self,
        client: &mut WorkerClient<Channel>,
        t: &Target,
        req: DecodeRequest,
        tx: &ResponseTx,
    ) -> Result<(), RunError> {
        let shared = self.shared.clone();
        // Subscribed before the call: a loss announced from here on is seen by `follow`.
        let losses = shared.subscribe_losses();
        let stream = match client.decode(cluster_request(shared.cluster_secret.as_ref(), req)).await {
            Ok(s) => s.into_inner(),
            Err(st) => return Err(self.call_failed(t, "Decode", st)),
        };
        self.follow(stream, losses, t, tx).await
    }

    /// Streams a `Decode` response stream to the client until the request finishes.
    ///
    /// Besides the stream's own end or failure, a worker is lost when the registry gave up on it
    /// (`losses` changed and it no longer [`holds`](crate::registry::Registry::holds) `t`:
    /// missed heartbeats, or unhealthy) and the stream has been silent for as long as the
    /// registry waits for heartbeats, and another worker could take the request. A worker that is
    /// stuck sends nothing and may fail nothing; one that is only too busy to heartbeat in time
    /// still streams, and is followed to the end. With nowhere to move, the stream is followed
    /// as well: waiting loses nothing, and a connection that dies still ends it.
    async fn follow(
        &mut self,
        mut stream: tonic::Streaming<DecodeResponse>,
        mut losses: watch::Receiver<u64>,
        t: &Target,
        tx: &ResponseTx,
    ) -> Result<(), RunError> {
        let shared = self.shared.clone();
        let stall = shared.heartbeat * MISSED_HEARTBEATS;
        let mut held = shared.with_registry(|r| r.holds(t));
        let mut watching = true;
        let mut last = Instant::now();
        loop {
            let silent_until = tokio::time::Instant::from_std(last + stall);
            let next = tokio::select! {
                m = stream.message() => m,
                changed = losses.changed(), if watching => {
                    watching = changed.is_ok();
                    held = shared.with_registry(|r| r.holds(t));
                    continue;
                }
                _ = tokio::time::sleep_until(silent_until), if !held => {
                    if self.can_move(t) {
                        return Err(RunError::Lost {
                            worker: t.clone(),
                            error: RouterError::concealed(Code::Aborted, FAILED, format!(
                                "{} stopped heartbeating and streaming request {}",
                                t.describe(),
                                self.request_id
                            )),
                        });
                    }
                    last = Instant::now(); // look again later: a worker may join
                    continue;
                }
            };
            last = Instant::now();
            let msg = match next {
                Ok(Some(msg)) => msg,
                Ok(None) => {
                    return Err(RunError::Lost {
                        worker: t.clone(),
                        error: RouterError::concealed(
                            Code::Aborted,
                            FAILED,
                            format!(
                                "{} ended the Decode stream of request {} without a finish reason",
                                t.describe(),
                                self.request_id
                            ),
                        ),
                    })
                }
                Err(st) => return Err(self.call_failed(t, "Decode", st)),
            };
            if let (Plan::Colocated { .. }, None, Some(n)) =
                (&self.plan, self.out.cached_tokens(), msg.cached_tokens)
            {
                self.out.note_cached(n, &self.shared.metrics);
            }
            self.out.note_prompt_scores(msg.prompt_logprobs, msg.prompt_top_logprobs);
            let worker_done = msg.finish_reason.is_some();
            let finish = msg.finish_reason.as_deref();
            if self.push(msg.index, &msg.token_ids, &msg.logprobs, &msg.top_logprobs, finish, t, tx).await? {
                // With several choices the router may have ended some at a stop string while the
                // worker still runs them: Cleanup's Release ends those.
                if worker_done && self.n == 1 {
                    self.cleanup.decode_release = None; // the worker ended the sequence itself
                }
                // Otherwise the router stopped first (stop string): dropping the stream cancels the
                // sequence, and Cleanup sends a Release as well.
                return Ok(());
            }
        }
    }

    /// Feeds tokens of choice `index` through output shaping and sends the message it makes, if
    /// any. Returns whether the request is finished (the last message, with usage and timings,
    /// was sent).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn push(
        &mut self,
        index: u32,
        tokens: &[u32],
        logprobs: &[f32],
        top: &[tandem_proto::v1::TopLogprobs],
        worker_finish: Option<&str>,
        t: &Target,
        tx: &ResponseTx,
    ) -> Result<bool, RouterError> {
        if let Some(resp) =
            self.out.push(index, tokens, logprobs, top, worker_finish, t, &self.shared.metrics)?
        {
            tx.send(Ok(resp)).await.map_err(|_| RouterError::Cancelled("the client went away".into()))?;
        }
        Ok(self.out.finished())
    }
}
