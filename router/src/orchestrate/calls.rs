//! The worker calls of one request: `Reserve` on the decode worker, `Prefill` on the prefill
//! worker (which moves the KV blocks into the reservation), `Decode` on the decode or colocated
//! worker, and the `Info` probe; and what a failed call means for the request.
//!
//! With prefix caching, `Reserve` carries the prompt and its salt; a decode worker that already
//! holds the prompt's leading blocks says how many (`cached_blocks`) and reserves only the rest,
//! and `Prefill` is told to skip them. The router checks that answer ([`check_reservation`]).
//!
//! Invariants:
//! - A failure that means the worker is gone (unreachable, or UNAVAILABLE: it is going away)
//!   is a loss the request may move away from; any other answer ends the request. A prefill
//!   failure is the decode worker's loss only when the decode worker does not answer a probe;
//!   when it does, a prefill worker's UNAVAILABLE or ABORTED that is not a drain means the KV
//!   transfer failed, and the decode worker may compute the prompt itself (`Recompute`).
//! - A worker that could not be reached is marked unhealthy, and the client is told a public
//!   reason, never the worker.
//! - Whenever the decode worker may hold something for the request, the [`Cleanup`] guard knows
//!   which reservation to release (set before the call that could create it).
//!
//! [`Cleanup`]: super::cleanup::Cleanup

use tandem_model::request::Request;
use tandem_proto::v1::worker_client::WorkerClient;
use tandem_proto::v1::{
    DecodeRequest, EngineParams, InfoRequest, KvDestination, PrefillRequest, PrefillResponse, ReserveRequest,
    ReserveResponse, TransportOffer,
};
use tonic::transport::Channel;
use tonic::{Code, Status};

use super::kv_wait::Waiting;
use super::{ResponseTx, Run, RunError, ADAPTER_GONE, FAILED, FULL, INTERNAL, REFUSED, UNREACHABLE};
use crate::error::{is_transport_failure, RouterError};
use crate::metrics::DecodePrefill;
use crate::registry::{Plan, Target};
use crate::workers::RESERVE_CALL;
use tandem_serve::auth::cluster_request;

/// How long a worker suspected lost gets to answer `Info`.
const PROBE: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether a failed call means the worker (not the request) is gone: it could not be reached, or
/// it said it is going away. Such a failure moves the request; any other answer ends it.
fn is_worker_loss(st: &Status) -> bool {
    is_transport_failure(st) || st.code() == Code::Unavailable
}

/// The wire form of a validated request's parameters, as every worker call carries them (the
/// router has resolved every default). Stop strings stay here: workers apply the token rules
/// only, and the router makes the text.
fn engine_params(r: &Request) -> EngineParams {
    let p = r.params();
    EngineParams {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k as u32,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        seed: p.seed.unwrap_or(0),
        max_tokens: p.max_tokens as u32,
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
        logprobs: true,
        cache_salt: r.salt().to_owned(),
        top_logprobs: p.logprobs.unwrap_or(0) as u32,
        constraint: p.constraint.as_ref().map(tandem_serve::constraint::to_wire),
        constraint_generated: p.constraint_generated as u32,
        prompt_logprobs: p.prompt_logprobs.map(|n| n as u32),
        adapter: p.adapter.clone(),
        adapter_id: p.adapter_id.clone(),
    }
}

impl Run {
    pub(super) fn client(&self, t: &Target) -> Result<WorkerClient<Channel>, RouterError> {
        let ch = self.shared.channel(&t.address).map_err(|e| {
            RouterError::concealed(Code::Unavailable, UNREACHABLE, format!("{}: {e}", t.describe()))
        })?;
        Ok(WorkerClient::new(ch))
    }

    /// A worker call failed: name the worker, choose the client's code, and take the worker out of
    /// selection when it could not be reached.
    pub(super) fn worker_error(&self, t: &Target, call: &str, st: Status) -> RouterError {
        let transport = is_transport_failure(&st);
        let detail = if st.message().is_empty() {
            st.code().description().to_owned()
        } else {
            st.message().to_owned()
        };
        let msg = format!("{} failed in {call} for request {}: {detail}", t.describe(), self.request_id);
        if transport {
            self.shared.with_registry(|r| r.mark_unhealthy(&t.worker_id, &t.address, &msg));
        }
        // A worker that no longer holds the request's adapter (unloaded, or replaced by other
        // weights under its name, since its last report): the router stops sending it there.
        // The worker marks that case in the status's metadata; no code or message alone says it.
        let adapter = &self.current.params().adapter;
        let adapter_gone = !adapter.is_empty() && tandem_proto::adapter_refusal(&st).is_some();
        if adapter_gone {
            self.shared.with_registry(|r| r.adapter_unloaded(&t.worker_id, &t.address, adapter, 0));
            return RouterError::concealed(Code::Unavailable, ADAPTER_GONE, msg);
        }
        let (code, public) = match st.code() {
            Code::InvalidArgument => (Code::InvalidArgument, REFUSED),
            Code::ResourceExhausted => (Code::ResourceExhausted, FULL),
            _ if !self.out.sent_first() && (transport || st.code() == Code::Unavailable) => {
                (Code::Unavailable, UNREACHABLE)
            }
            _ => (Code::Aborted, FAILED),
        };
        RouterError::concealed(code, public, msg)
    }

    /// A call to the worker holding (or about to hold) the sequence failed: a loss when the
    /// worker is gone, else the request's end.
    pub(super) fn call_failed(&self, t: &Target, call: &str, st: Status) -> RunError {
        let lost = is_worker_loss(&st);
        let error = self.worker_error(t, call, st);
        if lost {
            RunError::Lost { worker: t.clone(), error }
        } else {
            RunError::Fatal(error)
        }
    }

    /// Runs the request on its chosen workers: Reserve (choosing again while decode workers are
    /// full or draining), then the split or colocated path.
    pub(super) async fn attempt(&mut self, tx: &ResponseTx) -> Result<(), RunError> {
        let mut wait = Waiting::new();
        loop {
            let (prefill, decode, transport) = match self.plan.clone() {
                Plan::Split { prefill, decode, transport } => (prefill, decode, transport),
                Plan::Colocated { worker } => return self.run_colocated(&worker, tx).await,
            };
            if self.behind_others(&mut wait, &decode).await? {
                continue;
            }
            let mut d = self.client(&decode)?;
            let res = match self.reserve(&mut d).await {
                Ok(res) => {
                    wait.reserved(); // the next request in line takes its turn
                    res
                }
                Err(st) if st.code() == Code::ResourceExhausted => {
                    self.wait_for_blocks(&mut wait, &decode, &st).await?;
                    continue;
                }
                Err(st) if st.code() == Code::Unavailable && !is_transport_failure(&st) => {
                    // The worker is draining (its next report would say so) and reserved
                    // nothing: move to another decode worker if there is one.
                    self.cleanup.decode_release = None;
                    self.shared.with_registry(|r| r.mark_draining(&decode.worker_id, &decode.address));
                    self.replan();
                    if self.plan.decoder().incarnation() == decode.incarnation() {
                        return Err(self.worker_error(&decode, "Reserve", st).into());
                    }
                    tracing::debug!(request_id = %self.request_id, worker = %decode.worker_id, "decode worker draining; request moved");
                    continue;
                }
                Err(st) => return Err(self.call_failed(&decode, "Reserve", st)),
            };
            return self.run_split(&prefill, &decode, &mut d, &transport, res, tx).await;
        }
    }

    /// Asks the decode worker behind `d` for blocks for the whole prompt; with the prompt and its
    /// salt (and its LoRA adapter: cached blocks are looked up in the adapter's namespace), a
    /// worker that caches the prompt's leading blocks keeps those and reserves the rest. The
    /// caller maps the error.
    async fn reserve(&mut self, d: &mut WorkerClient<Channel>) -> Result<ReserveResponse, Status> {
        let shared = self.shared.clone();
        let num_tokens = self.current.prompt().len() as u32;
        let mut req = cluster_request(
            shared.cluster_secret.as_ref(),
            ReserveRequest {
                request_id: self.wire_id.clone(),
                num_tokens,
                prompt_token_ids: self.current.prompt().to_vec(),
                cache_salt: self.current.salt().to_owned(),
                max_new_tokens: self.current.params().max_tokens.min(u32::MAX as usize) as u32,
                adapter: self.current.params().adapter.clone(),
                adapter_id: self.current.params().adapter_id.clone(),
            },
        );
        req.set_timeout(RESERVE_CALL);
        self.cleanup.decode_release = Some(0); // a Reserve in flight may still land
        Ok(d.reserve(req).await?.into_inner())
    }

    /// The disaggregated path: `res` holds the prompt's blocks on `decode` (reached through the
    /// client `d` that reserved them); `prefill` fills them over `transport`, then `decode`
    /// continues the sequence.
    async fn run_split(
        &mut self,
        prefill: &Target,
        decode: &Target,
        d: &mut WorkerClient<Channel>,
        transport: &TransportOffer,
        res: ReserveResponse,
        tx: &ResponseTx,
    ) -> Result<(), RunError> {
        let mut p = self.client(prefill)?;
        self.cleanup.decode_release = Some(res.reservation_id);
        let skip = check_reservation(decode, self.current.prompt().len(), &res)?;
        let pre = self.prefill(&mut p, prefill, decode, transport, &res, skip).await?;
        // Summed over migrations: the time and bytes every attempt cost.
        let timings = self.out.timings_mut();
        timings.queue_ms += pre.queue_ms;
        timings.prefill_ms += pre.compute_ms;
        timings.transfer_ms += pre.transfer_ms;
        timings.transfer_bytes += pre.transfer_bytes;
        self.shared.metrics.kv_transfer(&transport.kind, pre.transfer_bytes, pre.transfer_ms / 1e3);
        self.out.note_cached(pre.cached_tokens, &self.shared.metrics);
        self.out.note_prompt_scores(pre.prompt_logprobs, pre.prompt_top_logprobs);

        // The prefill worker applied the token rules to the token it sampled.
        let finish = pre.finish_reason.as_deref();
        let top = pre.first_top_logprobs.as_slice();
        if self.push(0, &[pre.first_token], &[pre.logprob], top, finish, decode, tx).await? {
            // Finished on its first token: the reservation is released (Cleanup), not decoded.
            // (With several choices the others are still to come: it is decoded.)
            return Ok(());
        }
        let req = DecodeRequest {
            request_id: self.wire_id.clone(),
            prompt_token_ids: self.current.prompt().to_vec(),
            params: Some(engine_params(&self.current)),
            reservation_id: res.reservation_id,
            first_token: Some(pre.first_token),
            n: self.n,
        };
        self.decode_and_follow(d, decode, req, tx).await
    }

    /// Sends `Prefill` to `prefill` (through its client `p`): it computes the prompt and fills the
    /// reservation `res` on `decode` over `transport`, skipping the first `skip` blocks (the
    /// decode worker's cache holds them).
    async fn prefill(
        &mut self,
        p: &mut WorkerClient<Channel>,
        prefill: &Target,
        decode: &Target,
        transport: &TransportOffer,
        res: &ReserveResponse,
        skip: u32,
    ) -> Result<PrefillResponse, RunError> {
        let req = PrefillRequest {
            request_id: self.wire_id.clone(),
            prompt_token_ids: self.current.prompt().to_vec(),
            params: Some(engine_params(&self.current)),
            destination: Some(KvDestination {
                worker_id: decode.worker_id.clone(),
                transport: transport.kind.clone(),
                address: transport.address.clone(),
                segment_path: transport.segment_path.clone(),
                reservation_id: res.reservation_id,
                block_ids: res.block_ids.clone(),
                skip_blocks: skip,
                ipc_handle: transport.ipc_handle.clone(),
                pool_blocks: transport.pool_blocks,
                device_uuid: transport.device_uuid.clone(),
                nixl_metadata: transport.nixl_metadata.clone(),
            }),
        };
        self.cleanup.prefill_pending = true;
        // Subscribed before the call: the registry giving the prefill worker up (missed
        // heartbeats: a frozen worker never answers) is seen while waiting.
        let mut losses = self.shared.subscribe_losses();
        let call = p.prefill(cluster_request(self.shared.cluster_secret.as_ref(), req));
        tokio::pin!(call);
        let mut watching = true;
        let answer = loop {
            tokio::select! {
                a = &mut call => break Some(a),
                changed = losses.changed(), if watching => {
                    watching = changed.is_ok();
                    // Given up only when another worker can take the prompt (with nowhere to go,
                    // waiting loses nothing: a connection that dies still ends the call) and the
                    // worker does not answer a probe either: one only too busy computing a long
                    // prompt to heartbeat in time still answers, and is waited for.
                    if !self.shared.with_registry(|r| r.holds(prefill))
                        && self.can_move(prefill)
                        && !self.responds(prefill).await
                    {
                        break None;
                    }
                }
            }
        };
        self.cleanup.prefill_pending = false;
        self.cleanup.uncount_prefill();
        let st = match answer {
            Some(Ok(a)) => return Ok(a.into_inner()),
            Some(Err(st)) => st,
            None => {
                // The call is dropped (its stream reset cancels the prompt there if the worker
                // ever comes back); a late write into the reservation is fenced by releasing it.
                let error = RouterError::concealed(
                    Code::Unavailable,
                    UNREACHABLE,
                    format!(
                        "{} was given up by the registry while prefilling request {}",
                        prefill.describe(),
                        self.request_id
                    ),
                );
                return Err(RunError::Lost { worker: prefill.clone(), error });
            }
        };
        // Unreachable: the prefill worker is gone (the request moves to another one).
        // UNAVAILABLE or ABORTED from the prefill worker itself: moving the KV blocks may have
        // failed because the decode worker is gone, which a probe tells; otherwise a prefill
        // worker that says it is draining is going away, and the request moves too. (Any other
        // UNAVAILABLE, such as a KV listener it could not reach, is not its loss.)
        let transport = is_transport_failure(&st);
        let code = st.code();
        // A prefill worker going away says so: "draining" before it stops taking work, "shutting
        // down" for what it cancels as it stops.
        let draining = code == Code::Unavailable
            && (st.message().contains("draining") || st.message().contains("shutting down"));
        let error = self.worker_error(prefill, "Prefill", st);
        if transport {
            return Err(RunError::Lost { worker: prefill.clone(), error });
        }
        if matches!(code, Code::Unavailable | Code::Aborted) {
            if !self.answers(decode).await {
                // Nothing was streamed yet: should the request fail for it, it is a retryable
                // UNAVAILABLE, whatever the prefill worker's own word for the cut was.
                let error = RouterError::concealed(
                    Code::Unavailable,
                    UNREACHABLE,
                    format!("{} was lost while its KV blocks were moved in: {error}", decode.describe()),
                );
                return Err(RunError::Lost { worker: decode.clone(), error });
            }
            if draining {
                // Its next report would say so; until then, never choose it again.
                self.shared.with_registry(|r| r.mark_draining(&prefill.worker_id, &prefill.address));
                return Err(RunError::Lost { worker: prefill.clone(), error });
            }
            // Both workers answer, but the prompt's KV did not arrive whole (the transfer was cut,
            // a checksum did not match, the KV listener could not be reached): the decode worker
            // may compute the prompt itself.
            return Err(RunError::Recompute { decode: decode.clone(), error });
        }
        Err(error.into())
    }

    /// One colocated worker (or a decode worker, as the prefill fallback) computes the prompt
    /// and decodes.
    async fn run_colocated(&mut self, worker: &Target, tx: &ResponseTx) -> Result<(), RunError> {
        let mut w = self.client(worker)?;
        if self.plan.decode_prefills() {
            let why = self.fallback.take().unwrap_or(DecodePrefill::NoPrefillWorker);
            self.shared.metrics.decode_prefills.with_label_values(&[why.label()]).inc();
            tracing::debug!(request_id = %self.request_id, worker = %worker.worker_id, reason = why.label(), "the decode worker computes the prompt");
        }
        let req = DecodeRequest {
            request_id: self.wire_id.clone(),
            prompt_token_ids: self.current.prompt().to_vec(),
            params: Some(engine_params(&self.current)),
            reservation_id: 0,
            first_token: None,
            n: self.n,
        };
        self.cleanup.decode_release = Some(0);
        self.decode_and_follow(&mut w, worker, req, tx).await
    }

    /// Whether `t` answers `Info` within [`PROBE`] at all (a frozen process does not; a busy one
    /// does, as its gRPC server does not wait for its engine).
    async fn responds(&self, t: &Target) -> bool {
        let Ok(mut c) = self.client(t) else { return false };
        let req = cluster_request(self.shared.cluster_secret.as_ref(), InfoRequest {});
        matches!(tokio::time::timeout(PROBE, c.info(req)).await, Ok(Ok(_)))
    }

    /// Whether `t` answers a small call within [`PROBE`]; one that does not is marked unhealthy.
    async fn answers(&self, t: &Target) -> bool {
        let Ok(mut c) = self.client(t) else { return false };
        let mut req = cluster_request(self.shared.cluster_secret.as_ref(), InfoRequest {});
        req.set_timeout(PROBE);
        match c.info(req).await {
            Ok(_) => true,
            Err(st) if is_transport_failure(&st) => {
                let why = format!("Info failed: {}", st.message());
                self.shared.with_registry(|r| r.mark_unhealthy(&t.worker_id, &t.address, &why));
                false
            }
            Err(_) => true,
        }
    }
}

/// Checks a decode worker's `Reserve` answer for a prompt of `num_tokens` tokens and returns how
/// many leading prompt blocks it holds already (the transfer skips them). The answer must hold
/// `blocks_for(prompt) - cached_blocks` blocks (with layer groups, the pages a sequence of the
/// prompt keeps for those blocks, [`tandem_model::window::kept_count`]), and the block of the last prompt token is never
/// among the cached ones (the prefill worker always sends it). Anything else is a worker bug.
fn check_reservation(decode: &Target, num_tokens: usize, res: &ReserveResponse) -> Result<u32, RouterError> {
    let bs = decode.block_size.max(1) as usize;
    let cached = res.cached_blocks as usize;
    tandem_model::prefix::blocks_to_send(num_tokens, bs, cached).map_err(|max_cached| {
        RouterError::concealed(
            Code::Internal,
            INTERNAL,
            format!(
                "{} answered Reserve for {num_tokens} prompt tokens with {cached} cached blocks; at most \
             {max_cached} can be cached (block size {}; the last prompt token's block is always sent)",
                decode.describe(),
                decode.block_size
            ),
        )
    })?;
    // One block (page) per layer group of the pool and token block sent, less those a window
    // group no longer needs.
    let want = tandem_model::window::kept_count(&decode.kv_windows, num_tokens, cached, bs);
    if res.block_ids.len() != want {
        let with = if cached > 0 { format!(" with {cached} cached") } else { String::new() };
        return Err(RouterError::concealed(
            Code::Internal,
            INTERNAL,
            format!(
                "{} reserved {} blocks for {num_tokens} prompt tokens{with}; {want} expected (block size {})",
                decode.describe(),
                res.block_ids.len(),
                decode.block_size
            ),
        ));
    }
    Ok(res.cached_blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_proto::v1::Role;

    fn decode(kv_windows: Vec<Option<usize>>) -> Target {
        Target {
            worker_id: "d1".into(),
            address: "127.0.0.1:1".into(),
            role: Role::Decode,
            max_sequence_len: 4096,
            block_size: 4,
            kv_windows,
            overlap: 0,
            registration: 1,
        }
    }

    fn reserved(blocks: u32, cached_blocks: u32) -> ReserveResponse {
        ReserveResponse { reservation_id: 1, block_ids: (0..blocks).collect(), lease_ms: 1000, cached_blocks }
    }

    #[test]
    fn a_reservation_holds_a_page_per_layer_group_the_prompt_keeps() {
        // 30 prompt tokens in blocks of 4: 8 token blocks.
        let plain = decode(vec![None]);
        assert_eq!(check_reservation(&plain, 30, &reserved(8, 0)).ok(), Some(0));
        assert!(check_reservation(&plain, 30, &reserved(7, 0)).is_err());
        // A global group and an 8-token window group: the window of the last prompt token (29)
        // reads 22..=29, token blocks 5 to 7.
        let windowed = decode(vec![None, Some(8)]);
        assert_eq!(check_reservation(&windowed, 30, &reserved(8 + 3, 0)).ok(), Some(0));
        assert_eq!(check_reservation(&windowed, 30, &reserved(3 + 3, 5)).ok(), Some(5));
        assert!(
            check_reservation(&windowed, 30, &reserved(16, 0)).is_err(),
            "a page for every group and block"
        );
        assert!(check_reservation(&windowed, 30, &reserved(8, 0)).is_err(), "the window's pages left out");
    }
}
