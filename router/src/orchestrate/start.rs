//! A request's way in: counted, validated, tokenized, its prompt's blocks named and its first
//! workers chosen, all before anything runs; then its [`Run`](super::Run) is spawned.
//!
//! Invariants:
//! - Every request, refused or run, is counted once in the metrics under the API it came in on.
//! - A request refused here holds nothing: no permit, no request id, no count on a worker.
//!   A refusal that is the cluster's doing (no worker, overloaded, draining) still names the
//!   request (its client id, or one made for it and not held), so the client can quote it.
//! - A request counts as in flight (for a drain) from before the draining check, so a drain
//!   either sees it or refuses it.

use std::sync::Arc;
use std::time::Instant;

use tandem_proto::v1::GenerateRequest;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tonic::Code;

use super::placement::{place, prompt_blocks, routed_by_cache};
use super::{ResponseRx, Run, Shape, Ticket, DRAINING, INTERNAL};
use crate::error::RouterError;
use crate::metrics::Outcome;
use crate::registry::{AdapterKey, Plan, PromptBlocks, Registry};
use crate::request::prepare_under;
use crate::Shared;
use tandem_model::request::{choices, Request};

/// Messages buffered towards a slow client before the router stops reading the decode stream.
const STREAM_BUFFER: usize = 32;

/// The client API a request came in on (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `tandem.v1.Tandem/Generate`.
    Grpc,
    /// The OpenAI-compatible HTTP API.
    Http,
}

impl Api {
    /// `grpc` or `http`.
    pub fn label(self) -> &'static str {
        match self {
            Api::Grpc => "grpc",
            Api::Http => "http",
        }
    }
}

/// Counts a request refused before [`start`] could run it (bad JSON, missing API key, ...).
pub(crate) fn refused(shared: &Shared, api: Api, e: &RouterError) {
    shared.metrics.finished(api.label(), Outcome::Error, Some(e.kind()));
}

/// Validates `req`, picks its workers and starts it; the returned receiver streams its responses.
/// Errors before anything runs (draining, bad request, no worker, overloaded) are returned
/// directly, as the client's status. Every request, refused or run, is counted in the metrics
/// under `api`.
pub(crate) async fn start(
    shared: Arc<Shared>,
    req: GenerateRequest,
    api: Api,
) -> Result<ResponseRx, tonic::Status> {
    let received = Instant::now();
    // Counted before the draining check: a drain either sees this request or refuses it.
    let inflight = shared.enter();
    let client_id = req.request_id.clone();
    let a = match admit(&shared, req).await {
        Ok(a) => a,
        Err(e) => {
            refused(&shared, api, &e);
            tracing::debug!(kind = e.kind(), "request refused: {e}");
            // The client's own mistakes speak for themselves; a refusal of the cluster's doing
            // names the request, as a failure after the start would.
            let named = !matches!(e.code(), Code::InvalidArgument | Code::Unauthenticated | Code::NotFound);
            let id = named.then(|| shared.refusal_id(&client_id));
            return Err(e.client_status(id.as_deref()));
        }
    };
    let (request_id, plan) = (a.request_id, a.plan);
    tracing::debug!(request_id, prompt_tokens = a.request.prompt().len(), ?plan, "request accepted");
    shared.metrics.prompt_tokens.inc_by(a.request.prompt().len() as u64);
    if routed_by_cache(&plan) {
        shared.metrics.cache_routed.inc();
    }
    shared.metrics.queue_depth.inc();
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let ticket = Ticket { received, api, _permit: a.permit, _inflight: inflight };
    let run = Run::new(shared, request_id, plan, a.request, a.shape, a.blocks, ticket);
    tokio::spawn(run.drive(tx));
    Ok(rx)
}

/// A request let in: validated, its prompt's blocks named, its workers chosen and counted.
struct Admitted {
    request: Request,
    shape: Shape,
    blocks: PromptBlocks,
    plan: Plan,
    request_id: String,
    permit: OwnedSemaphorePermit,
}

/// The LoRA adapter a request's `model` names: None for the base model (empty, the served name
/// or the model's id), the adapter (and the id requests for it are routed to) for a name some
/// registered worker holds; NOT_FOUND naming it otherwise.
fn model(shared: &Shared, reg: &Registry, model: &str) -> Result<Option<AdapterKey>, RouterError> {
    if model.is_empty() || model == shared.model.model_name || model == shared.model.model_id {
        return Ok(None);
    }
    reg.resolve_adapter(model).map(Some).ok_or_else(|| {
        RouterError::NotFound(format!(
            "model: `{model}` does not exist; this server serves `{}` and the LoRA adapters its workers \
             hold (GET /v1/models lists them)",
            shared.model.model_name
        ))
    })
}

async fn admit(shared: &Arc<Shared>, req: GenerateRequest) -> Result<Admitted, RouterError> {
    if shared.draining() {
        return Err(RouterError::Unavailable(DRAINING.into()));
    }
    let permit = shared.permits.clone().try_acquire_owned().map_err(|_| {
        RouterError::ResourceExhausted(format!(
            "the router already has {} requests in flight (--max-queue); retry later",
            shared.max_queue
        ))
    })?;
    let tok = shared.model.tokenizer.clone();
    let vocab = shared.model.config.vocab_size;
    let seed = rand::random::<u64>();
    let client_id = req.request_id.clone();
    let shape = Shape {
        n: choices(req.n).map_err(RouterError::InvalidArgument)?,
        score_only: req.max_tokens == Some(0) && req.prompt_logprobs.is_some(),
    };
    let strict_max_tokens = crate::request::strict_max_tokens(&req);
    let model_id = shared.model.model_id.clone();
    let (adapter, block_sizes) =
        shared.with_registry(|r| Ok::<_, RouterError>((model(shared, r, &req.model)?, r.block_sizes())))?;
    // Tokenizing a long prompt, rendering a template and hashing the prompt's blocks are CPU
    // work: keep them off the async threads. The blocks are named once per request, in the
    // namespace the workers use (the model id of the compatibility record and the request's salt).
    let (request, blocks) = tokio::task::spawn_blocking(move || {
        let request = prepare_under(&tok, vocab, &req, seed, adapter.as_ref())?;
        let blocks = prompt_blocks(&request, &model_id, &block_sizes);
        Ok::<_, RouterError>((request, blocks))
    })
    .await
    .map_err(|e| RouterError::concealed(Code::Internal, INTERNAL, format!("tokenizer task failed: {e}")))??;

    let plan = shared.with_registry(|r| place(r, &blocks, strict_max_tokens))?;
    let request_id = shared.claim_request_id(&client_id);
    Ok(Admitted { request, shape, blocks, plan, request_id, permit })
}
