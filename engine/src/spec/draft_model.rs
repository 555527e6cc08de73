//! The draft-model drafter (being written).

use super::{DraftAsk, Drafter, SpecMethod};
use crate::backend::Backend;
use crate::error::{EngineError, Result};
use crate::kv::SeqId;
use crate::tokenizer::Tokenizer;

/// Proposes tokens with a smaller model sharing the target's vocabulary.
pub struct DraftModelDrafter {
    name: String,
}

impl DraftModelDrafter {
    /// A drafter over `backend` (the draft model, on the target's device).
    pub fn new(
        _target: &Tokenizer,
        _target_vocab: usize,
        _backend: Box<dyn Backend>,
        _draft: &Tokenizer,
        name: String,
    ) -> Result<DraftModelDrafter> {
        Err(EngineError::InvalidRequest(format!("draft model {name}: not available yet")))
    }
}

impl Drafter for DraftModelDrafter {
    fn method(&self) -> SpecMethod {
        SpecMethod::Draft
    }
    fn describe(&self) -> String {
        format!("draft model {}", self.name)
    }
    fn propose(&mut self, asks: &[DraftAsk<'_>]) -> Result<Vec<Vec<u32>>> {
        Ok(vec![Vec::new(); asks.len()])
    }
    fn forget(&mut self, _seq: SeqId) {}
}
