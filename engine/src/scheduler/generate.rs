//! One request run to completion in process ([`Engine::generate`]): what `tandem generate` and
//! the tests run. It composes the same pieces as a cluster: the engine streams token ids and
//! applies the token rules, exactly as a worker does, and one [`TextOutput`] (detokenizer and
//! stop strings) makes the text, exactly as the router does. A stop string cancels the
//! sequence, as the router cancels a decode leg, and tokens past it are dropped.

use super::{Engine, SeqEvent};
use crate::error::{EngineError, Result};
use crate::sampler::{FinishReason, SamplingParams};
use crate::spec::SpecCounts;
use tandem_model::text::TextOutput;

/// A finished single-request generation.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Generation {
    pub prompt_token_ids: Vec<u32>,
    /// Generated tokens: up to and including the one that ended the sequence (an EOS or stop
    /// token, or the token that completed a stop string); none after it.
    pub token_ids: Vec<u32>,
    pub text: String,
    #[serde(skip)]
    pub finish_reason: Option<FinishReason>,
    /// Draft tokens proposed and accepted, when the engine speculates.
    #[serde(skip)]
    pub speculation: Option<SpecCounts>,
}

/// One step's events for the request: its tokens, and why the engine ended it, if it did.
struct StepOut {
    tokens: Vec<u32>,
    finish: Option<(FinishReason, SpecCounts)>,
}

impl Engine {
    /// Runs one request to completion, calling `on_text` with each piece of text as it becomes
    /// safe to show. On error the request is cancelled, so no blocks stay behind.
    pub fn generate(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        mut on_text: impl FnMut(&str),
    ) -> Result<Generation> {
        let req = self.request(prompt, params)?;
        let mut text = TextOutput::new(&self.tokenizer, req.prompt(), &req.params().stop_strings);
        let mut out = Generation {
            prompt_token_ids: req.prompt().to_vec(),
            token_ids: Vec::new(),
            text: String::new(),
            finish_reason: None,
            speculation: None,
        };
        let id = self.add(req)?;
        loop {
            let step = match self.step_for(id) {
                Ok(step) => step,
                Err(e) => {
                    self.cancel(id)?;
                    return Err(e);
                }
            };
            let (finish, spec) = step.finish.map_or((None, None), |(r, s)| (Some(r), Some(s)));
            let fed = match text.feed(&step.tokens, finish) {
                Ok(fed) => fed,
                Err(e) => {
                    self.cancel(id)?;
                    return Err(e.into());
                }
            };
            out.token_ids.extend_from_slice(&step.tokens[..fed.taken]);
            if !fed.text.is_empty() {
                out.text.push_str(&fed.text);
                on_text(&fed.text);
            }
            if let Some(reason) = fed.finish {
                // A stop string may end a sequence the engine still runs (it knows no stop
                // strings): end it here, as the router drops the decode stream.
                let spec = match spec {
                    Some(spec) => spec,
                    None => {
                        let spec = self.seqs.get(&id).map(|s| s.spec).unwrap_or_default();
                        self.cancel(id)?;
                        spec
                    }
                };
                out.finish_reason = Some(reason);
                out.speculation = self.spec.is_some().then_some(spec);
                return Ok(out);
            }
        }
    }

    /// Runs one step and picks out what happened to sequence `id`.
    fn step_for(&mut self, id: crate::kv::SeqId) -> Result<StepOut> {
        let events = self.step()?;
        if events.is_empty() && !self.seqs.contains_key(&id) {
            return Err(EngineError::Internal("sequence vanished without an event".into()));
        }
        let mut out = StepOut { tokens: Vec::new(), finish: None };
        for ev in events {
            match ev {
                SeqEvent::Token { seq, token, .. } if seq == id => out.tokens.push(token),
                SeqEvent::Finished { seq, reason, speculation } if seq == id => {
                    out.finish = Some((reason, speculation));
                }
                SeqEvent::Failed { seq, error } if seq == id => return Err(EngineError::Internal(error)),
                _ => {}
            }
        }
        Ok(out)
    }
}
