//! The client side of a running cluster: `tandem generate --router` and `tandem bench --router`.
//!
//! `generate --router` prints exactly what in-process `tandem generate` prints for the same flags:
//! the streamed text and a final newline, or with `--json` one object with the same fields.
//! A failed request prints the router's status message and exits 1.

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use crate::loadgen::{run_load, LoadSpec};
use anyhow::{anyhow, Context, Result};
use tandem_proto::v1;
use tandem_proto::v1::tandem_client::TandemClient;
use tandem_serve::auth::api_key_request;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::{BenchArgs, GenerateArgs};

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the async runtime")
}

/// Connects to the router at `router` (`host:port`, `http://` or `https://`), over TLS verified
/// with the CA file `tls_ca` when one is given.
pub(crate) async fn connect(router: &str, tls_ca: Option<&Path>) -> Result<Channel> {
    let (scheme, rest) = router.split_once("://").unwrap_or(("http", router));
    let mut ep =
        Endpoint::from_shared(format!("{}://{rest}", if tls_ca.is_some() { "https" } else { scheme }))
            .with_context(|| format!("invalid router address {router:?} (expected HOST:PORT)"))?
            .connect_timeout(Duration::from_secs(5));
    match (tls_ca, scheme) {
        (Some(ca), _) => {
            let pem = std::fs::read(ca)
                .with_context(|| format!("--tls-ca {}: cannot read the file", ca.display()))?;
            let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem));
            ep = ep.tls_config(tls).with_context(|| format!("--tls-ca {}", ca.display()))?;
        }
        (None, "https") => {
            return Err(anyhow!(
                "{router}: an https:// router needs --tls-ca (the CA that signed its certificate)"
            ))
        }
        (None, _) => {}
    }
    ep.connect().await.map_err(|e| anyhow!("cannot reach the router at {router}: {}", error_chain(&e)))
}

/// `e: cause: cause`, since transport errors put the useful part in their sources.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(&format!(": {c}"));
        src = c.source();
    }
    s
}

/// The request `tandem generate` flags describe.
fn request(a: &GenerateArgs) -> v1::GenerateRequest {
    let prompt = if a.chat {
        let mut messages = Vec::new();
        if let Some(system) = &a.system {
            messages.push(v1::ChatMessage {
                role: "system".into(),
                content: system.clone(),
                name: None,
                ..Default::default()
            });
        }
        messages.push(v1::ChatMessage {
            role: "user".into(),
            content: a.prompt.clone(),
            name: None,
            ..Default::default()
        });
        v1::generate_request::Prompt::Chat(v1::ChatPrompt {
            messages,
            add_generation_prompt: Some(true),
            ..Default::default()
        })
    } else {
        v1::generate_request::Prompt::Text(a.prompt.clone())
    };
    v1::GenerateRequest {
        prompt: Some(prompt),
        max_tokens: Some(u32::try_from(a.max_tokens).unwrap_or(u32::MAX)),
        sampling: Some(v1::SamplingParams {
            temperature: Some(a.temperature),
            top_p: Some(a.top_p),
            top_k: Some(u32::try_from(a.top_k).unwrap_or(u32::MAX)),
            min_p: Some(a.min_p),
            repetition_penalty: Some(a.repetition_penalty),
            seed: a.seed,
        }),
        stop: a.stop.clone(),
        ..Default::default()
    }
}

/// `tandem generate --router HOST:PORT ...`.
pub(crate) fn generate(router: &str, args: GenerateArgs) -> Result<()> {
    runtime()?.block_on(async {
        let mut client = TandemClient::new(connect(router, args.tls_ca.as_deref()).await?);
        let mut stream = client
            .generate(api_key_request(args.api_key.as_deref(), request(&args)))
            .await
            .map_err(|s| anyhow!("{}", s.message()))?
            .into_inner();
        let (mut prompt_ids, mut token_ids, mut text, mut finish) =
            (Vec::new(), Vec::new(), String::new(), None);
        let stdout = std::io::stdout();
        loop {
            let msg = match stream.message().await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(s) => {
                    if !args.json && !text.is_empty() {
                        println!(); // end the partial completion's line before the error
                    }
                    return Err(anyhow!("{}", s.message()));
                }
            };
            if !msg.prompt_token_ids.is_empty() {
                prompt_ids = msg.prompt_token_ids;
            }
            token_ids.extend_from_slice(&msg.token_ids);
            if !args.json && !msg.text.is_empty() {
                let mut lock = stdout.lock();
                let _ = lock.write_all(msg.text.as_bytes());
                let _ = lock.flush();
            }
            text.push_str(&msg.text);
            if msg.finish_reason.is_some() {
                finish = msg.finish_reason;
            }
        }
        if finish.is_none() {
            return Err(anyhow!("the router ended the stream without a finish reason"));
        }
        if args.json {
            let v = serde_json::json!({
                "prompt_token_ids": prompt_ids,
                "token_ids": token_ids,
                "text": text,
                "finish_reason": finish,
            });
            println!("{v}");
        } else {
            println!();
        }
        Ok(())
    })
}

fn resolve(router: &str) -> Result<SocketAddr> {
    router
        .to_socket_addrs()
        .with_context(|| format!("invalid router address {router:?} (expected HOST:PORT)"))?
        .next()
        .ok_or_else(|| anyhow!("router address {router:?} resolves to nothing"))
}

/// `tandem bench --router HOST:PORT ...`: a fixed synthetic load, client-side latencies.
pub(crate) fn bench(router: &str, a: BenchArgs) -> Result<()> {
    let addr = resolve(router)?;
    let spec = LoadSpec {
        concurrency: a.concurrency,
        requests: if a.duration_s.is_some() { usize::MAX } else { a.requests },
        duration: match a.duration_s {
            Some(s) if s.is_finite() && s > 0.0 => Some(std::time::Duration::from_secs_f64(s)),
            Some(s) => return Err(anyhow!("--duration-s must be a positive number of seconds, got {s}")),
            None => None,
        },
        prompt_tokens: a.prompt_tokens,
        output_tokens: a.decode_tokens,
        vocab_limit: a.vocab_limit,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = rt.block_on(async {
        let channel = connect(router, a.tls_ca.as_deref()).await?;
        run_load(channel, spec, a.api_key.clone()).await
    })?;
    if a.json {
        println!("{}", serde_json::to_string(&report).context("encoding the report")?);
    } else {
        println!("router: {addr}");
        println!(
            "requests: {} ({} failed), concurrency {}, {} prompt + {} output tokens each",
            report.requests, report.failed, report.concurrency, report.prompt_tokens, report.output_tokens
        );
        if report.refused > 0 {
            println!(
                "refused for capacity: {} ({} without retry-after), answered in p50 {:.1} ms, p99 {:.1} ms",
                report.refused,
                report.refused_without_retry_after,
                report.refusal_ms.p50,
                report.refusal_ms.p99
            );
        }
        println!(
            "ttft: p50 {:.1} ms, p99 {:.1} ms; inter-token: p50 {:.1} ms, p99 {:.1} ms",
            report.ttft_ms.p50, report.ttft_ms.p99, report.itl_ms.p50, report.itl_ms.p99
        );
        println!(
            "throughput: {:.1} output tokens/s, {:.2} requests/s over {:.1} s",
            report.output_tokens_per_s, report.requests_per_s, report.wall_s
        );
    }
    if let Some(e) = &report.first_error {
        if report.failed == report.requests {
            return Err(anyhow!("every request failed; the first: {e}"));
        }
        eprintln!("warning: {} requests failed; the first: {e}", report.failed);
    }
    Ok(())
}
