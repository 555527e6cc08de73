//! One greedy, fixed-length request through a router's gRPC API, timed from the client: what the
//! cluster benchmarks (`--workload shared-prefix`, `--workload revisit`) send and measure.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tandem_proto::v1;
use tandem_proto::v1::tandem_client::TandemClient;
use tonic::transport::Channel;

/// What a finished request returned.
pub(crate) struct Streamed {
    /// Client side: request sent → first token received.
    pub ttft_ms: f64,
    /// The router's count of prompt tokens, or the tokens sent when it gives none.
    pub prompt_tokens: usize,
    /// `Usage.cached_tokens`: prompt tokens not computed (prefix cache or KV tiers).
    pub cached_tokens: usize,
    /// `Timings.transfer_bytes`: KV bytes moved to the decode worker.
    pub transfer_bytes: u64,
    /// The generated tokens.
    pub answer: Vec<u32>,
}

/// Where requests go and what every one asks for, from the bench flags.
#[derive(Clone)]
pub(crate) struct Ask {
    client: TandemClient<Channel>,
    api_key: Option<String>,
    answer_tokens: usize,
    timeout: Duration,
}

impl Ask {
    /// Connects to `router` (`--tls-ca`); requests carry `--api-key`, ask for `--answer-tokens`
    /// and fail after `--request-timeout-s`.
    pub(crate) async fn connect(router: &str, a: &crate::BenchArgs) -> anyhow::Result<Ask> {
        Ok(Ask {
            client: TandemClient::new(crate::remote::connect(router, a.tls_ca.as_deref()).await?),
            api_key: a.api_key.clone(),
            answer_tokens: a.answer_tokens,
            timeout: Duration::from_secs(a.request_timeout_s),
        })
    }

    /// Sends `prompt` greedily for exactly `answer_tokens` tokens (EOS ignored, so every run
    /// does the same work) under `cache_salt`; a failure or a timeout is its error message.
    pub(crate) async fn send(
        &self,
        prompt: Vec<u32>,
        cache_salt: String,
        request_id: String,
    ) -> Result<Streamed, String> {
        let sent = prompt.len();
        let req = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids: prompt })),
            max_tokens: Some(u32::try_from(self.answer_tokens).unwrap_or(u32::MAX)),
            sampling: Some(v1::SamplingParams { temperature: Some(0.0), ..Default::default() }),
            ignore_eos: true,
            request_id,
            cache_salt,
            ..Default::default()
        };
        match tokio::time::timeout(self.timeout, self.stream(req, sent)).await {
            Ok(r) => r,
            Err(_) => Err(format!("not finished after {} s (--request-timeout-s)", self.timeout.as_secs())),
        }
    }

    async fn stream(&self, req: v1::GenerateRequest, sent: usize) -> Result<Streamed, String> {
        let status = |s: tonic::Status| format!("{:?}: {}", s.code(), s.message());
        let t0 = Instant::now();
        let mut client = self.client.clone();
        let mut stream = client
            .generate(tandem_serve::auth::api_key_request(self.api_key.as_deref(), req))
            .await
            .map_err(status)?
            .into_inner();
        let (mut ttft, mut answer, mut usage, mut timings, mut finished) =
            (None, Vec::new(), None, None, false);
        while let Some(msg) = stream.message().await.map_err(status)? {
            if ttft.is_none() && !msg.token_ids.is_empty() {
                ttft = Some(t0.elapsed());
            }
            answer.extend_from_slice(&msg.token_ids);
            usage = msg.usage.or(usage);
            timings = msg.timings.or(timings);
            finished |= msg.finish_reason.is_some();
        }
        if !finished {
            return Err("the stream ended without a finish reason".into());
        }
        let ttft: Duration = ttft.ok_or("finished without a token")?;
        let usage = usage.unwrap_or_default();
        Ok(Streamed {
            ttft_ms: ttft.as_secs_f64() * 1e3,
            // The router's count when it gives one: it is what the workers saw.
            prompt_tokens: if usage.prompt_tokens > 0 { usage.prompt_tokens as usize } else { sent },
            cached_tokens: usage.cached_tokens as usize,
            transfer_bytes: timings.map_or(0, |t| t.transfer_bytes),
            answer,
        })
    }
}

/// A new id per run, so that salts never repeat across runs.
pub(crate) fn run_id() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    format!("{:x}", nanos ^ (u64::from(std::process::id()) << 44))
}
