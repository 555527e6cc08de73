//! What every serving binary shares: arguments from flags, environment and a config file;
//! logging; shutdown signals; the line that tells a launcher where a server listens.
//!
//! Precedence, highest first: command-line flags, environment variables (`TANDEM_<FLAG>`, e.g.
//! `TANDEM_KV_BLOCKS` for `--kv-blocks`), the TOML config file (`--config FILE` or `TANDEM_CONFIG`),
//! the built-in defaults. Config keys are the long flag names (`kv-blocks = 1024`, or `kv_blocks`);
//! a key that names no flag is an error that names the key, so a typo never passes silently.

use std::ffi::OsString;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Parses `P` from this process's arguments, environment and optional config file.
pub fn parse_args<P: Parser>() -> Result<P> {
    parse_args_from(std::env::args_os().collect())
}

/// Like [`parse_args`] with explicit arguments (`argv[0]` first).
///
/// `--help` and `--version` print and exit as usual; other parse errors are returned with clap's
/// message so the caller decides how to report them.
pub fn parse_args_from<P: Parser>(argv: Vec<OsString>) -> Result<P> {
    let mut cmd = P::command();
    let config = config_path(&argv);
    if let Some(path) = &config {
        for (name, value) in read_config(path, &cmd)? {
            let Some(arg) = cmd.get_arguments().find(|a| a.get_long() == Some(name.as_str())) else {
                unreachable!("read_config only returns known keys");
            };
            let Some(env) = arg.get_env().map(|e| e.to_owned()) else {
                bail!("{}: key `{name}` cannot be set from a config file", path.display());
            };
            // The config file sits below the environment: only fill what is not already set.
            if std::env::var_os(&env).is_none() {
                // SAFETY (not unsafe in edition 2021, but racy with other threads): called while the
                // process is still single-threaded, before any runtime or worker thread starts.
                std::env::set_var(&env, value);
            }
        }
        cmd = P::command();
    }
    let matches = match cmd.try_get_matches_from(argv) {
        Ok(m) => m,
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            e.exit()
        }
        Err(e) => return Err(anyhow::anyhow!("{}", e.render().to_string().trim_end())),
    };
    P::from_arg_matches(&matches).map_err(|e| anyhow::anyhow!("{}", e.render().to_string().trim_end()))
}

/// `--config FILE`, `--config=FILE`, or `TANDEM_CONFIG`.
fn config_path(argv: &[OsString]) -> Option<PathBuf> {
    let mut it = argv.iter().skip(1);
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--" {
            break;
        }
        if s == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(v) = s.strip_prefix("--config=") {
            return Some(PathBuf::from(v));
        }
    }
    std::env::var_os("TANDEM_CONFIG").map(PathBuf::from)
}

/// Reads a TOML config file into (long flag name, value as a command-line string) pairs.
fn read_config(path: &Path, cmd: &clap::Command) -> Result<Vec<(String, String)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading config file {}", path.display()))?;
    let table: toml::Table =
        toml::from_str(&text).with_context(|| format!("config file {} is not valid TOML", path.display()))?;
    let known: Vec<&str> = cmd.get_arguments().filter_map(|a| a.get_long()).collect();
    let mut out = Vec::new();
    for (key, value) in table {
        let name = key.replace('_', "-");
        if name == "config" || !known.contains(&name.as_str()) {
            bail!(
                "{}: unknown key `{key}` (known keys: {})",
                path.display(),
                known
                    .iter()
                    .filter(|k| !matches!(**k, "config" | "help" | "version"))
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let value = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Array(items) => {
                let mut parts = Vec::new();
                for item in items {
                    match item {
                        toml::Value::String(s) if !s.contains(',') => parts.push(s),
                        toml::Value::Integer(i) => parts.push(i.to_string()),
                        other => bail!("{}: key `{key}`: list items must be strings without commas or integers, found {other}", path.display()),
                    }
                }
                parts.join(",")
            }
            other => bail!("{}: key `{key}` has a value of an unsupported type: {other}", path.display()),
        };
        out.push((name, value));
    }
    Ok(out)
}

/// Installs the `tracing` subscriber: stderr, filter from `RUST_LOG` (default `info`).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour codes only on a terminal: logs captured by launchers, tests and journald stay plain.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    // A second initialisation (tests running several servers in one process) is harmless.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Resolves when the process receives SIGTERM or SIGINT; returns the signal's name.
pub async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        // Without signal handlers the process still ends on the default action; never resolve.
        tracing::warn!("could not install SIGTERM/SIGINT handlers; signals end the process without draining");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// Polls `fut` once and reports whether it has already resolved. Servers call this on their
/// shutdown future before printing the `listening` line: a signal future installs its handlers on
/// first poll, and a SIGTERM that arrives after a launcher learns the address must drain the
/// server, not kill it with the default action.
pub async fn poll_once<F: std::future::Future + Unpin>(fut: &mut F) -> bool {
    std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut *fut).poll(cx).is_ready())).await
}

/// Where a server listens, as its `listening` line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listening {
    /// The gRPC server.
    pub grpc: SocketAddr,
    /// The HTTP server (OpenAI API on the router; `/metrics`, `/health`, `/ready` everywhere).
    pub http: Option<SocketAddr>,
    /// The KV transport listener (decode workers).
    pub kv: Option<SocketAddr>,
}

/// Prints the one stdout line launchers and tests read to learn where a server listens:
/// `listening grpc=<addr> [http=<addr>] [kv=<addr>]`.
pub fn print_listening(l: &Listening) {
    let mut line = format!("listening grpc={}", l.grpc);
    if let Some(h) = l.http {
        line.push_str(&format!(" http={h}"));
    }
    if let Some(k) = l.kv {
        line.push_str(&format!(" kv={k}"));
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Parses a `listening ...` line back into its addresses (for launchers and tests).
pub fn parse_listening(line: &str) -> Option<Listening> {
    let rest = line.trim().strip_prefix("listening ")?;
    let mut grpc = None;
    let (mut http, mut kv) = (None, None);
    for part in rest.split_whitespace() {
        if let Some(a) = part.strip_prefix("grpc=") {
            grpc = a.parse().ok();
        } else if let Some(a) = part.strip_prefix("http=") {
            http = Some(a.parse().ok()?);
        } else if let Some(a) = part.strip_prefix("kv=") {
            kv = Some(a.parse().ok()?);
        }
    }
    Some(Listening { grpc: grpc?, http, kv })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Parser, Debug)]
    struct Args {
        #[arg(long, env = "TANDEM_TEST_CFG_LISTEN", default_value = "127.0.0.1:0")]
        listen: String,
        #[arg(long, env = "TANDEM_TEST_CFG_KV_BLOCKS", default_value_t = 512)]
        kv_blocks: usize,
        #[arg(long, env = "TANDEM_TEST_CFG_WORKER", value_delimiter = ',')]
        worker: Vec<String>,
        #[arg(long)]
        config: Option<PathBuf>,
    }

    fn argv(args: &[&str]) -> Vec<OsString> {
        std::iter::once("bin").chain(args.iter().copied()).map(OsString::from).collect()
    }

    fn write_config(text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "tandem-cfg-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("c.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    // One test, so the environment variables it sets are not raced by a parallel test.
    #[test]
    fn precedence_and_errors() {
        let cfg = write_config("kv-blocks = 64\nworker = [\"a:1\", \"b:2\"]\n");
        let a: Args = parse_args_from(argv(&["--config", cfg.to_str().unwrap()])).unwrap();
        assert_eq!(a.kv_blocks, 64);
        assert_eq!(a.worker, vec!["a:1", "b:2"]);
        assert_eq!(a.listen, "127.0.0.1:0");
        // A flag beats the file (the env var the file filled is now set, and a flag beats it too).
        let a: Args =
            parse_args_from(argv(&["--config", cfg.to_str().unwrap(), "--kv-blocks", "8"])).unwrap();
        assert_eq!(a.kv_blocks, 8);
        // The environment beats the file.
        std::env::set_var("TANDEM_TEST_CFG_LISTEN", "0.0.0.0:9");
        let cfg2 = write_config("listen = \"10.0.0.1:1\"\n");
        let a: Args = parse_args_from(argv(&["--config", cfg2.to_str().unwrap()])).unwrap();
        assert_eq!(a.listen, "0.0.0.0:9");
        std::env::remove_var("TANDEM_TEST_CFG_LISTEN");

        let bad = write_config("kv-blokcs = 3\n");
        let e = parse_args_from::<Args>(argv(&["--config", bad.to_str().unwrap()])).unwrap_err().to_string();
        assert!(e.contains("unknown key `kv-blokcs`") && e.contains("kv-blocks"), "{e}");
        let e = parse_args_from::<Args>(argv(&["--config", "/nonexistent/tandem.toml"])).unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/tandem.toml"), "{e:#}");
        let notoml = write_config("kv-blocks = = 3\n");
        let e = parse_args_from::<Args>(argv(&["--config", notoml.to_str().unwrap()])).unwrap_err();
        assert!(format!("{e:#}").contains("not valid TOML"), "{e:#}");
        let e = parse_args_from::<Args>(argv(&["--kv-blocks", "many"])).unwrap_err().to_string();
        assert!(e.contains("--kv-blocks"), "{e}");
        std::env::remove_var("TANDEM_TEST_CFG_KV_BLOCKS");
        std::env::remove_var("TANDEM_TEST_CFG_WORKER");
    }

    #[test]
    fn listening_line_round_trips() {
        let g: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let k: SocketAddr = "127.0.0.1:4001".parse().unwrap();
        let h: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        assert_eq!(
            parse_listening(&format!("listening grpc={g} kv={k}\n")),
            Some(Listening { grpc: g, http: None, kv: Some(k) })
        );
        assert_eq!(parse_listening(&format!("listening grpc={g}")), Some(Listening { grpc: g, http: None, kv: None }));
        let all = Listening { grpc: g, http: Some(h), kv: Some(k) };
        print_listening(&all);
        assert_eq!(parse_listening(&format!("listening grpc={g} http={h} kv={k}")), Some(all));
        assert_eq!(parse_listening(&format!("listening grpc={g} http=nonsense")), None);
        assert_eq!(parse_listening("ready router=1.2.3.4:5"), None);
        assert_eq!(parse_listening("listening kv=127.0.0.1:1"), None);
    }
}
