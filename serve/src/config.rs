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

use clap::parser::ValueSource;
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

/// Why a process's arguments could not be taken: the config file is unreadable or names what no
/// flag is, or the flags themselves are wrong (clap's message).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("reading config file {}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The config file is not TOML.
    #[error("config file {} is not valid TOML", .path.display())]
    Toml {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    /// A key names no flag (a typo never passes silently).
    #[error("{}: unknown key `{key}` (known keys: {known})", .path.display())]
    UnknownKey { path: PathBuf, key: String, known: String },
    /// A key's value is of a type no flag takes.
    #[error("{}: key `{key}`: {problem}", .path.display())]
    BadValue { path: PathBuf, key: String, problem: String },
    /// The flags, environment and file together are not valid (clap's message: which flag, why).
    #[error("{0}")]
    Args(String),
}

impl ConfigError {
    /// Stable, low-cardinality name of the failure.
    pub fn kind(&self) -> &'static str {
        match self {
            ConfigError::Read { .. } => "read",
            ConfigError::Toml { .. } => "toml",
            ConfigError::UnknownKey { .. } => "unknown_key",
            ConfigError::BadValue { .. } => "bad_value",
            ConfigError::Args(_) => "args",
        }
    }

    fn clap(e: clap::Error) -> ConfigError {
        ConfigError::Args(e.render().to_string().trim_end().to_owned())
    }
}

/// Parses `P` from this process's arguments, environment and optional config file.
pub fn parse_args<P: Parser>() -> Result<P, ConfigError> {
    parse_args_from(std::env::args_os().collect())
}

/// Like [`parse_args`] with explicit arguments (`argv[0]` first).
///
/// The config file's values become the flags' default values before parsing, so clap itself
/// applies the precedence (a flag, then its environment variable, then the default) and checks
/// every value as it would a flag's. The process environment is only read, never written.
///
/// `--help` and `--version` print and exit as usual; other parse errors are returned with clap's
/// message so the caller decides how to report them.
pub fn parse_args_from<P: Parser>(argv: Vec<OsString>) -> Result<P, ConfigError> {
    let mut cmd = P::command();
    let mut from_file = Vec::new();
    let config = config_path(&argv);
    if let Some(path) = &config {
        for (id, value) in read_config(path, &cmd)? {
            cmd = cmd.mut_arg(&id, |a| match value {
                ConfigValue::One(v) => a.default_value(v),
                ConfigValue::Many(v) => a.default_values(v),
            });
            from_file.push(id);
        }
    }
    let matches = match cmd.try_get_matches_from_mut(argv) {
        Ok(m) => m,
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            e.exit()
        }
        Err(e) => return Err(ConfigError::clap(e)),
    };
    if let Some(path) = &config {
        check_file_conflicts(&mut cmd, &matches, &from_file, path)?;
    }
    P::from_arg_matches(&matches).map_err(ConfigError::clap)
}

/// clap does not hold default values to `conflicts_with`, but a value from the config file is a
/// setting the operator made: one that is in effect and conflicts with another setting (a flag,
/// an environment variable or another key of the file) is refused as if both were flags.
fn check_file_conflicts(
    cmd: &mut clap::Command,
    m: &clap::ArgMatches,
    from_file: &[String],
    path: &Path,
) -> Result<(), ConfigError> {
    let source = |id: &str| m.value_source(id);
    let explicit = |id: &str| matches!(source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable));
    let in_file =
        |id: &str| from_file.iter().any(|f| f == id) && source(id) == Some(ValueSource::DefaultValue);
    let mut clash = None;
    for a in cmd.get_arguments() {
        for b in cmd.get_arg_conflicts_with(a) {
            let (ia, ib) = (a.get_id().as_str(), b.get_id().as_str());
            let a_set = in_file(ia) || explicit(ia);
            let b_set = in_file(ib) || explicit(ib);
            if a_set && b_set && (in_file(ia) || in_file(ib)) {
                let long = |x: &clap::Arg| x.get_long().unwrap_or(x.get_id().as_str()).to_owned();
                clash = Some((long(a), long(b)));
            }
        }
    }
    match clash {
        None => Ok(()),
        Some((a, b)) => Err(ConfigError::clap(cmd.error(
            clap::error::ErrorKind::ArgumentConflict,
            format!(
                "the argument '--{a}' cannot be used with '--{b}' (one of them is set in config file {})",
                path.display()
            ),
        ))),
    }
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

/// A config-file value as the flag's default: one value, or several for a repeatable flag.
enum ConfigValue {
    One(String),
    Many(Vec<String>),
}

/// Reads a TOML config file into (argument id, value as command-line strings) pairs.
fn read_config(path: &Path, cmd: &clap::Command) -> Result<Vec<(String, ConfigValue)>, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
    let table: toml::Table =
        toml::from_str(&text).map_err(|source| ConfigError::Toml { path: path.to_path_buf(), source })?;
    let settable = |long: &str| !matches!(long, "config" | "help" | "version");
    let mut out = Vec::new();
    for (key, value) in table {
        let name = key.replace('_', "-");
        let Some(arg) = cmd.get_arguments().find(|a| a.get_long() == Some(name.as_str()) && settable(&name))
        else {
            return Err(ConfigError::UnknownKey {
                path: path.to_path_buf(),
                key,
                known: cmd
                    .get_arguments()
                    .filter_map(|a| a.get_long())
                    .filter(|l| settable(l))
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        };
        let bad =
            |problem: String| ConfigError::BadValue { path: path.to_path_buf(), key: key.clone(), problem };
        let value = match value {
            toml::Value::String(s) => match arg.get_value_delimiter() {
                // As from the environment: `worker = "a:1,b:2"` is two values.
                Some(d) => ConfigValue::Many(s.split(d).map(str::to_owned).collect()),
                None => ConfigValue::One(s),
            },
            toml::Value::Integer(i) => ConfigValue::One(i.to_string()),
            toml::Value::Float(f) => ConfigValue::One(f.to_string()),
            toml::Value::Boolean(b) => ConfigValue::One(b.to_string()),
            toml::Value::Array(items) => {
                let mut parts = Vec::new();
                for item in items {
                    match item {
                        toml::Value::String(s) if !s.contains(',') => parts.push(s),
                        toml::Value::Integer(i) => parts.push(i.to_string()),
                        other => {
                            return Err(bad(format!(
                                "list items must be strings without commas or integers, found {other}"
                            )))
                        }
                    }
                }
                ConfigValue::Many(parts)
            }
            other => return Err(bad(format!("a value of an unsupported type: {other}"))),
        };
        out.push((arg.get_id().as_str().to_owned(), value));
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
        #[arg(
            long,
            env = "TANDEM_TEST_CFG_KV_BLOCKS",
            default_value_t = 512,
            conflicts_with = "kv_memory_mb"
        )]
        kv_blocks: usize,
        #[arg(long, env = "TANDEM_TEST_CFG_KV_MEMORY_MB")]
        kv_memory_mb: Option<usize>,
        #[arg(long, env = "TANDEM_TEST_CFG_WORKER", value_delimiter = ',')]
        worker: Vec<String>,
        #[arg(long, env = "TANDEM_TEST_CFG_COLOCATED")]
        colocated: bool,
        #[arg(long)]
        config: Option<PathBuf>,
    }

    /// Like [`Args`], with environment variables no other test reads or writes.
    #[derive(Parser, Debug)]
    struct EnvArgs {
        #[arg(long, env = "TANDEM_TEST_CFG_ONLY_ENV_LISTEN", default_value = "127.0.0.1:0")]
        listen: String,
        #[arg(long, env = "TANDEM_TEST_CFG_ONLY_ENV_BLOCKS", conflicts_with = "kv_memory_mb")]
        kv_blocks: Option<usize>,
        #[arg(long, env = "TANDEM_TEST_CFG_ONLY_ENV_MEMORY")]
        kv_memory_mb: Option<usize>,
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

    #[test]
    fn the_file_fills_what_no_flag_sets_and_a_flag_beats_it() {
        let cfg = write_config("kv-blocks = 64\nworker = [\"a:1\", \"b:2\"]\ncolocated = true\n");
        let c = cfg.to_str().unwrap();
        let a: Args = parse_args_from(argv(&["--config", c])).unwrap();
        assert_eq!(a.kv_blocks, 64);
        assert_eq!(a.worker, vec!["a:1", "b:2"]);
        assert!(a.colocated);
        assert_eq!(a.listen, "127.0.0.1:0");
        // The file is applied as values: the process environment is left as it was.
        assert_eq!(std::env::var_os("TANDEM_TEST_CFG_KV_BLOCKS"), None);
        assert_eq!(std::env::var_os("TANDEM_TEST_CFG_WORKER"), None);
        // A flag beats the file, also for a repeatable flag (replaced, not appended to).
        let a: Args = parse_args_from(argv(&["--config", c, "--kv-blocks", "8", "--worker", "c:3"])).unwrap();
        assert_eq!(a.kv_blocks, 8);
        assert_eq!(a.worker, vec!["c:3"]);
        // `--config=FILE` works too, and a comma-separated string is a list, as in the environment.
        let cfg2 = write_config("worker = \"x:1,y:2\"\n");
        let a: Args = parse_args_from(argv(&[&format!("--config={}", cfg2.display())])).unwrap();
        assert_eq!(a.worker, vec!["x:1", "y:2"]);
        // Without a file, the built-in defaults.
        let a: Args = parse_args_from(argv(&[])).unwrap();
        assert_eq!((a.kv_blocks, a.worker.len(), a.colocated), (512, 0, false));
    }

    // The only test that sets these variables (names no other test uses), so nothing races it.
    #[test]
    fn the_environment_beats_the_file_and_conflicts_span_all_three() {
        std::env::set_var("TANDEM_TEST_CFG_ONLY_ENV_LISTEN", "0.0.0.0:9");
        let cfg = write_config("listen = \"10.0.0.1:1\"\nkv-blocks = 8\n");
        let c = cfg.to_str().unwrap();
        let a: EnvArgs = parse_args_from(argv(&["--config", c])).unwrap();
        assert_eq!(a.listen, "0.0.0.0:9");
        assert_eq!(a.kv_blocks, Some(8));
        // A flag still beats the environment.
        let a: EnvArgs = parse_args_from(argv(&["--config", c, "--listen", "1.2.3.4:5"])).unwrap();
        assert_eq!(a.listen, "1.2.3.4:5");
        std::env::remove_var("TANDEM_TEST_CFG_ONLY_ENV_LISTEN");

        // A file's value conflicts with a flag, and with an environment variable, as two flags would.
        let e = parse_args_from::<EnvArgs>(argv(&["--config", c, "--kv-memory-mb", "4"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--kv-memory-mb") && e.contains("--kv-blocks"), "{e}");
        std::env::set_var("TANDEM_TEST_CFG_ONLY_ENV_MEMORY", "4");
        let e = parse_args_from::<EnvArgs>(argv(&["--config", c])).unwrap_err().to_string();
        assert!(e.contains("--kv-memory-mb") && e.contains("--kv-blocks"), "{e}");
        std::env::remove_var("TANDEM_TEST_CFG_ONLY_ENV_MEMORY");
        // Two keys of one file conflict too.
        let both = write_config("kv-blocks = 8\nkv-memory-mb = 4\n");
        let e =
            parse_args_from::<EnvArgs>(argv(&["--config", both.to_str().unwrap()])).unwrap_err().to_string();
        assert!(e.contains("--kv-memory-mb") && e.contains("--kv-blocks"), "{e}");
    }

    #[test]
    fn bad_files_and_values_are_errors_naming_them() {
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
        // A file's value is checked like a flag's.
        let wrong = write_config("kv-blocks = \"many\"\n");
        let e =
            parse_args_from::<Args>(argv(&["--config", wrong.to_str().unwrap()])).unwrap_err().to_string();
        assert!(e.contains("many") && e.contains("--kv-blocks"), "{e}");
        let table = write_config("[kv-blocks]\nx = 1\n");
        let e =
            parse_args_from::<Args>(argv(&["--config", table.to_str().unwrap()])).unwrap_err().to_string();
        assert!(e.contains("`kv-blocks`") && e.contains("unsupported type"), "{e}");
        let config_key = write_config("config = \"other.toml\"\n");
        let e = parse_args_from::<Args>(argv(&["--config", config_key.to_str().unwrap()]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown key `config`"), "{e}");
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
        assert_eq!(
            parse_listening(&format!("listening grpc={g}")),
            Some(Listening { grpc: g, http: None, kv: None })
        );
        let all = Listening { grpc: g, http: Some(h), kv: Some(k) };
        print_listening(&all);
        assert_eq!(parse_listening(&format!("listening grpc={g} http={h} kv={k}")), Some(all));
        assert_eq!(parse_listening(&format!("listening grpc={g} http=nonsense")), None);
        assert_eq!(parse_listening("ready router=1.2.3.4:5"), None);
        assert_eq!(parse_listening("listening kv=127.0.0.1:1"), None);
    }
}
