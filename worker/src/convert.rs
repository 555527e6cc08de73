//! The worker's edge: wire types become domain types here, and domain errors become gRPC
//! statuses here, so neither the engine nor the transport ever sees a protobuf or a `Status`.
//!
//! The orphan rule keeps `TryFrom<&EngineParams> for SamplingParams` out of this crate (both
//! types are foreign), so the conversion targets [`RequestSampling`], a newtype the handlers
//! unwrap; the status mappings are functions for the same reason.

use tandem_engine::error::EngineError;
use tandem_engine::kv::KvError;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::Engine;
use tandem_proto::v1::{AdapterInfo, EngineParams, TopLogprobs};
use tandem_transport::TransportError;
use tonic::Status;

/// A request's sampling parameters as the engine takes them, from the wire's [`EngineParams`]
/// (every default already resolved by the router).
#[derive(Debug, Clone)]
pub struct RequestSampling(pub SamplingParams);

impl TryFrom<&EngineParams> for RequestSampling {
    /// What is wrong with the wire form, naming the field.
    type Error = String;

    fn try_from(p: &EngineParams) -> Result<Self, String> {
        Ok(RequestSampling(SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            seed: Some(p.seed),
            max_tokens: p.max_tokens as usize,
            stop_token_ids: p.stop_token_ids.clone(),
            // Stop strings are the router's: it makes the text, workers only see token ids.
            stop_strings: Vec::new(),
            ignore_eos: p.ignore_eos,
            logprobs: (p.top_logprobs > 0).then_some(p.top_logprobs as usize),
            prompt_logprobs: p.prompt_logprobs.map(|n| n as usize),
            constraint: tandem_serve::constraint::from_wire(p.constraint.as_ref())?,
            constraint_generated: p.constraint_generated as usize,
            cache_salt: p.cache_salt.clone(),
            adapter: p.adapter.clone(),
            adapter_id: p.adapter_id.clone(),
        }))
    }
}

/// A token's alternatives ([`tandem_engine::sampler::Sampled::top_logprobs`]) on the wire.
pub fn top_wire(top: &[(u32, f32)]) -> TopLogprobs {
    TopLogprobs {
        token_ids: top.iter().map(|&(t, _)| t).collect(),
        logprobs: top.iter().map(|&(_, l)| l).collect(),
    }
}

/// A prompt's scores ([`tandem_engine::scheduler::SeqEvent::PromptLogprobs`]) on the wire: one
/// alternatives entry per position when alternatives were asked for (an empty one for a row with
/// none, so positions stay aligned), none otherwise.
pub fn prompt_scores_wire(logprobs: &[f32], tops: &[Vec<(u32, f32)>]) -> (Vec<f32>, Vec<TopLogprobs>) {
    let asked = tops.iter().any(|t| !t.is_empty());
    (logprobs.to_vec(), if asked { tops.iter().map(|t| top_wire(t)).collect() } else { Vec::new() })
}

/// The engine's sampling parameters for a request's optional `params` field: decoding only. The
/// engine checks them, with the prompt, in `Request::new` (the one validation, whose errors
/// become INVALID_ARGUMENT naming the field) before the request runs. Missing params are
/// INVALID_ARGUMENT.
pub fn sampling_params(p: Option<&EngineParams>) -> Result<SamplingParams, Status> {
    let p = p.ok_or_else(|| Status::invalid_argument("params: missing (the router resolves them)"))?;
    RequestSampling::try_from(p).map(|r| r.0).map_err(|e| Status::invalid_argument(format!("params.{e}")))
}

/// Longest prefix-cache salt a `Reserve` may carry (the limit a request's salt has too).
pub use tandem_engine::kv::prefix::MAX_SALT_BYTES as MAX_CACHE_SALT_BYTES;

/// The gRPC status for an engine error: a bad request is INVALID_ARGUMENT, no room now
/// RESOURCE_EXHAUSTED (the router may retry elsewhere), a LoRA adapter this worker does not hold
/// NOT_FOUND and one it holds with other weights than the request expects FAILED_PRECONDITION
/// (both naming the adapter, and marked for the router by [`tandem_proto::ADAPTER_ERROR_KEY`]),
/// anything else INTERNAL.
pub fn engine_status(e: &EngineError) -> Status {
    let msg = e.to_string();
    match e {
        EngineError::InvalidRequest(_) => Status::invalid_argument(msg),
        EngineError::UnknownAdapter(_) => {
            tandem_proto::mark_adapter_refusal(Status::not_found(msg), tandem_proto::ADAPTER_UNKNOWN)
        }
        EngineError::AdapterMismatch { .. } => tandem_proto::mark_adapter_refusal(
            Status::failed_precondition(msg),
            tandem_proto::ADAPTER_OTHER_WEIGHTS,
        ),
        EngineError::Kv(KvError::OutOfBlocks { .. }) | EngineError::Busy(_) => {
            Status::resource_exhausted(msg)
        }
        _ => Status::internal(msg),
    }
}

/// An adapter's status ([`Engine::adapters`], [`Engine::add_adapter`]) on the wire. A macro, not
/// a function: the engine does not name the status type outside its scheduler.
macro_rules! adapter_wire {
    ($status:expr) => {{
        let s = $status;
        tandem_proto::v1::AdapterInfo {
            name: s.name,
            id: s.id,
            rank: s.rank as u32,
            resident: s.resident,
            source: s.source.display().to_string(),
            targets: s.targets,
            adapters_version: 0,
            bytes: s.bytes as u64,
        }
    }};
}
pub(crate) use adapter_wire;

/// The adapters `engine` holds, by name, on the wire.
pub fn adapters_wire(engine: &Engine) -> Vec<AdapterInfo> {
    engine.adapters().into_iter().map(|s| adapter_wire!(s)).collect()
}

/// The gRPC status for an adapter that could not be loaded under `name`: whatever is wrong with
/// the file (unreadable, malformed, made for another base model) or with holding it (no adapter
/// slots) is INVALID_ARGUMENT naming the adapter and the problem; an internal failure INTERNAL.
pub fn adapter_load_status(name: &str, e: &EngineError) -> Status {
    let msg = format!("adapter '{name}': {e}");
    match e {
        EngineError::Internal(_) => Status::internal(msg),
        _ => Status::invalid_argument(msg),
    }
}

/// The gRPC status for a failed KV transfer: an unreachable peer is UNAVAILABLE, a bad
/// destination INVALID_ARGUMENT, anything that broke mid-transfer ABORTED.
pub fn transport_status(e: &TransportError) -> Status {
    let msg = e.to_string();
    match e {
        TransportError::Connect { .. } => Status::unavailable(msg),
        TransportError::Invalid(_) => Status::invalid_argument(msg),
        _ => Status::aborted(msg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_params_become_engine_params_and_missing_ones_are_refused() {
        let wire = EngineParams {
            temperature: 0.5,
            top_k: 7,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            seed: 42,
            max_tokens: 9,
            stop_token_ids: vec![2, 3],
            ignore_eos: true,
            ..Default::default()
        };
        let p = sampling_params(Some(&wire)).unwrap();
        assert_eq!((p.top_k, p.max_tokens, p.seed), (7, 9, Some(42)));
        assert_eq!(p.stop_token_ids, vec![2, 3]);
        assert!(p.ignore_eos && p.stop_strings.is_empty() && p.logprobs.is_none());
        assert_eq!((p.temperature, p.top_p, p.min_p, p.repetition_penalty), (0.5, 0.9, 0.05, 1.1));
        let st = sampling_params(None).unwrap_err();
        assert_eq!(st.code(), tonic::Code::InvalidArgument);
        assert!(st.message().contains("params"), "{}", st.message());
        assert!(p.constraint.is_none());

        // A constraint travels; one with no kind (a peer's garbage) is refused naming the field.
        use tandem_engine::grammar::Constraint;
        let c = Constraint::Regex("[0-9]+".into());
        let with = EngineParams { constraint: Some(tandem_serve::constraint::to_wire(&c)), ..wire.clone() };
        assert_eq!(sampling_params(Some(&with)).unwrap().constraint, Some(c));
        let empty = EngineParams { constraint: Some(Default::default()), ..wire };
        let st = sampling_params(Some(&empty)).unwrap_err();
        assert_eq!(st.code(), tonic::Code::InvalidArgument);
        assert!(st.message().starts_with("params.constraint"), "{}", st.message());
    }

    #[test]
    fn errors_map_to_the_status_a_caller_can_act_on() {
        assert_eq!(
            engine_status(&EngineError::InvalidRequest("x".into())).code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(engine_status(&EngineError::Busy("x".into())).code(), tonic::Code::ResourceExhausted);
        assert_eq!(engine_status(&EngineError::Internal("x".into())).code(), tonic::Code::Internal);
        let st = engine_status(&EngineError::UnknownAdapter("sql".into()));
        assert_eq!(st.code(), tonic::Code::NotFound);
        assert!(st.message().contains("'sql'"), "{}", st.message());
        assert_eq!(tandem_proto::adapter_refusal(&st), Some(tandem_proto::ADAPTER_UNKNOWN));
        let st = engine_status(&EngineError::AdapterMismatch {
            name: "sql".into(),
            have: "aa".into(),
            want: "bb".into(),
        });
        assert_eq!(st.code(), tonic::Code::FailedPrecondition);
        assert!(st.message().contains("sql") && st.message().contains("aa") && st.message().contains("bb"));
        assert_eq!(tandem_proto::adapter_refusal(&st), Some(tandem_proto::ADAPTER_OTHER_WEIGHTS));
        // Other errors carry no such mark.
        assert!(engine_status(&EngineError::Internal("adapter".into())).metadata().is_empty());
        let st =
            adapter_load_status("sql", &EngineError::Lora { path: "/no/such".into(), msg: "missing".into() });
        assert_eq!(st.code(), tonic::Code::InvalidArgument);
        assert!(st.message().contains("'sql'") && st.message().contains("/no/such"), "{}", st.message());
        assert_eq!(
            transport_status(&TransportError::Invalid("x".into())).code(),
            tonic::Code::InvalidArgument
        );
    }
}
