//! Output shaping: the token ids a worker streams become the client's `GenerateResponse`s. This is
//! the only place a cluster's tokens become text.
//!
//! The token rules (`max_tokens`, EOS and stop tokens, the context limit) are the workers': the
//! worker that generated a token says whether it ended the sequence (`finish_reason`), and the
//! router believes it. Text is the router's: every token goes through one
//! [`TextOutput`] (the detokenizer and the stop strings, the same piece `tandem generate` runs
//! in process), so greedy output (token ids and text) equals `tandem generate`'s. When a stop
//! string matches, the request ends here and the caller drops the decode stream, which cancels
//! the worker's sequence. The shaping is the same whichever worker streams: after a migration the
//! new worker's tokens continue the same text output.
//!
//! Invariants:
//! - Each token reaches the client once, in order; none after the finish (tokens a worker made
//!   past a stop string are dropped and not counted).
//! - The token a worker ended the sequence with by a stop rule is counted, and its text is
//!   never shown.
//! - The first message carries the request id and the prompt's token ids; the last one carries
//!   the finish reason, the rest of the text, the usage and the timings. Between them, a message
//!   with neither tokens nor text is never sent.
//! - Logprobs are sent only when there is one for every token of the message.
//! - No text after a stop string is ever sent.
//! - With `n` > 1 every message belongs to one choice (`index`), and the rules above hold per
//!   choice: each choice has its own text output and stop strings, and ends with its own finish
//!   reason; the usage (summed over the choices) and the timings come with the last message of
//!   the request, which is the one that finishes its last choice.

use std::time::Instant;

use tandem_proto::v1::{GenerateResponse, Timings, TopLogprobs, Usage};
use tonic::Code;

use super::{Shape, INTERNAL};
use crate::error::RouterError;
use crate::metrics::RouterMetrics;
use crate::registry::Target;
use tandem_model::request::Request;
use tandem_model::stop::FinishReason;
use tandem_model::text::TextOutput;
use tandem_model::tokenizer::Tokenizer;

/// One choice's output: its text, its tokens and how it ended.
struct ChoiceOutput {
    text: TextOutput,
    /// The tokens sent to the client, in order.
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
    /// The message with the finish reason was made.
    closed: bool,
}

/// What one request has told its client so far, and the state that makes the next message.
pub(super) struct Output {
    request_id: String,
    /// The client's prompt (what the usage reports and the context limit counts from).
    prompt: Vec<u32>,
    /// One per choice (`n`).
    choices: Vec<ChoiceOutput>,
    /// Scoring only: every token a worker sends is dropped, and each choice ends with "length".
    score_only: bool,
    /// The prompt's scores, for the first message (when they were asked for).
    prompt_scores: Option<(Vec<f32>, Vec<TopLogprobs>)>,
    sent_first: bool,
    /// When the request arrived (time to first token, total time).
    received: Instant,
    /// When the latest token message went to the client (inter-token latency).
    last_sent: Option<Instant>,
    timings: Timings,
    /// Prompt tokens a worker took from its prefix cache, once it said so.
    cached_tokens: Option<u32>,
}

impl Output {
    /// The output of request `request_id` (`request` shaped as `shape`, arrived at `received`),
    /// whose text `tok` makes.
    pub(super) fn new(
        request_id: String,
        request: &Request,
        shape: Shape,
        tok: &Tokenizer,
        received: Instant,
    ) -> Output {
        let choice = || ChoiceOutput {
            text: TextOutput::new(tok, request.prompt(), &request.params().stop_strings),
            tokens: Vec::new(),
            finish: None,
            closed: false,
        };
        Output {
            request_id,
            prompt: request.prompt().to_vec(),
            choices: (0..shape.n.max(1)).map(|_| choice()).collect(),
            score_only: shape.score_only,
            prompt_scores: None,
            sent_first: false,
            received,
            last_sent: None,
            timings: Timings::default(),
            cached_tokens: None,
        }
    }

    /// The client's prompt.
    pub(super) fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// The tokens of the first choice streamed to the client so far (a request of one choice:
    /// all of them).
    pub(super) fn tokens(&self) -> &[u32] {
        &self.choices[0].tokens
    }

    /// Tokens streamed to the client so far, over every choice.
    pub(super) fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.tokens.len()).sum()
    }

    /// Why the (first choice of the) request finished, once it has.
    pub(super) fn finish(&self) -> Option<&FinishReason> {
        self.choices[0].finish.as_ref()
    }

    /// The prompt's scores a worker sent (`prompt_logprobs`), for the first message; the first
    /// ones are kept.
    pub(super) fn note_prompt_scores(&mut self, logprobs: Vec<f32>, top: Vec<TopLogprobs>) {
        if !self.sent_first && self.prompt_scores.is_none() && !logprobs.is_empty() {
            self.prompt_scores = Some((logprobs, top));
        }
    }

    /// Whether the client got its first message.
    pub(super) fn sent_first(&self) -> bool {
        self.sent_first
    }

    /// Whether the client got any token.
    pub(super) fn streamed_any(&self) -> bool {
        self.last_sent.is_some()
    }

    /// The timings the last message reports; the worker calls add theirs (summed over
    /// migrations: the time and bytes every attempt cost).
    pub(super) fn timings_mut(&mut self) -> &mut Timings {
        &mut self.timings
    }

    /// The timings so far.
    pub(super) fn timings(&self) -> &Timings {
        &self.timings
    }

    /// Prompt tokens a worker said it took from its prefix cache, if one said so yet.
    pub(super) fn cached_tokens(&self) -> Option<u32> {
        self.cached_tokens
    }

    /// A worker took `n` prompt tokens from its prefix cache (what the usage reports; never more
    /// than the prompt).
    pub(super) fn note_cached(&mut self, n: u32, metrics: &RouterMetrics) {
        if self.cached_tokens.is_some() {
            return; // a migrated request reports what the first worker took
        }
        let n = n.min(self.prompt.len() as u32);
        self.cached_tokens = Some(n);
        metrics.cached_prompt_tokens.inc_by(u64::from(n));
    }

    /// Feeds `tokens` of choice `index` from worker `t` (with their `logprobs` and `top`
    /// alternatives, each empty or one per token, and the worker's finish reason when it ended
    /// the sequence) through the choice's text output. Returns the message for the client, or
    /// `None` when there is nothing to tell; once every choice's message with a finish reason is
    /// returned, the request is [`finished`](Output::finished).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push(
        &mut self,
        index: u32,
        tokens: &[u32],
        logprobs: &[f32],
        top: &[TopLogprobs],
        worker_finish: Option<&str>,
        t: &Target,
        metrics: &RouterMetrics,
    ) -> Result<Option<GenerateResponse>, RouterError> {
        let n = self.choices.len();
        let Some(choice) = self.choices.get_mut(index as usize) else {
            return Err(RouterError::concealed(
                Code::Internal,
                INTERNAL,
                format!("{} sent tokens of choice {index} of a request with {n}", t.describe()),
            ));
        };
        let mut resp = GenerateResponse { index, ..GenerateResponse::default() };
        if self.score_only {
            // The token the workers had to make is not the client's: the choice ends here.
            choice.feed(&[], &[], &[], Some("length"), t, &mut resp)?;
        } else {
            choice.feed(tokens, logprobs, top, worker_finish, t, &mut resp)?;
        }
        if resp.logprobs.len() != resp.token_ids.len() {
            resp.logprobs.clear();
        }
        if resp.top_logprobs.len() != resp.token_ids.len() {
            resp.top_logprobs.clear();
        }
        let now = Instant::now();
        self.observe(resp.token_ids.len(), now, metrics);
        let now_ms = now.duration_since(self.received).as_secs_f64() * 1e3;
        if !self.sent_first {
            self.timings.ttft_ms = now_ms;
            resp.prompt_token_ids = self.prompt.clone();
            resp.request_id = self.request_id.clone();
            if let Some((lps, tops)) = self.prompt_scores.take() {
                resp.prompt_logprobs = lps;
                resp.prompt_top_logprobs = tops;
            }
        }
        let choice = &mut self.choices[index as usize];
        match &choice.finish {
            Some(reason) if !choice.closed => {
                choice.closed = true;
                resp.finish_reason = Some(reason.as_str().to_owned());
                if self.finished() {
                    self.close(now_ms, &mut resp);
                }
            }
            _ if resp.token_ids.is_empty() && resp.text.is_empty() && self.sent_first => {
                return Ok(None); // nothing to tell
            }
            _ => {}
        }
        self.sent_first = true;
        Ok(Some(resp))
    }

    /// Whether the request is finished (the message that ends each choice was made).
    pub(super) fn finished(&self) -> bool {
        self.choices.iter().all(|c| c.closed)
    }

    /// Counts `n` tokens about to be sent at `now`: the first ones end the time to first token
    /// (and the request's wait in the queue), later ones share the gap since the last message.
    fn observe(&mut self, n: usize, now: Instant, m: &RouterMetrics) {
        if n == 0 {
            return;
        }
        m.generated_tokens.inc_by(n as u64);
        match self.last_sent {
            None => {
                m.ttft.observe(now.duration_since(self.received).as_secs_f64());
                m.queue_depth.dec();
            }
            Some(prev) => {
                // The gap is shared by the tokens it brought.
                let per_token = now.duration_since(prev).as_secs_f64() / n as f64;
                for _ in 0..n {
                    m.inter_token.observe(per_token);
                }
            }
        }
        self.last_sent = Some(now);
    }

    /// Ends the request's last message: the usage (over every choice) and the timings.
    fn close(&mut self, now_ms: f64, resp: &mut GenerateResponse) {
        resp.usage = Some(Usage {
            prompt_tokens: self.prompt.len() as u32,
            completion_tokens: self.completion_tokens() as u32,
            cached_tokens: self.cached_tokens.unwrap_or(0),
        });
        self.timings.total_ms = now_ms;
        resp.timings = Some(self.timings);
    }
}

impl ChoiceOutput {
    /// Turns `tokens` into text in `resp` ([`TextOutput::feed`]): the choice finishes at a stop
    /// string here, or where the worker said (`"stop"`: the last token is an EOS or stop token;
    /// `"length"`).
    fn feed(
        &mut self,
        tokens: &[u32],
        logprobs: &[f32],
        top: &[TopLogprobs],
        worker_finish: Option<&str>,
        t: &Target,
        resp: &mut GenerateResponse,
    ) -> Result<(), RouterError> {
        if self.finish.is_some() {
            return Ok(()); // tokens after the finish are not the client's
        }
        let finish = worker_finish.map(|f| match (f, tokens.last()) {
            ("length", _) => FinishReason::Length,
            (_, Some(&last)) => FinishReason::StopToken(last),
            // "stop" with no token in the message: the worker ended it on a token it sent earlier.
            (_, None) => FinishReason::Eos,
        });
        let fed = self.text.feed(tokens, finish).map_err(|e| {
            RouterError::concealed(
                Code::Internal,
                INTERNAL,
                format!("{} produced a token the tokenizer cannot decode: {e}", t.describe()),
            )
        })?;
        // Tokens the worker made past a stop string are not the client's.
        let taken = &tokens[..fed.taken];
        self.tokens.extend_from_slice(taken);
        resp.token_ids.extend_from_slice(taken);
        resp.logprobs.extend_from_slice(&logprobs[..fed.taken.min(logprobs.len())]);
        resp.top_logprobs.extend_from_slice(&top[..fed.taken.min(top.len())]);
        resp.text.push_str(&fed.text);
        self.finish = fed.finish;
        Ok(())
    }
}
