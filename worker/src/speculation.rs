//! Speculative decoding from flags: the flags every process that decodes takes
//! ([`SpeculationArgs`]: `tandem generate`, `tandem bench`, decode and colocated workers, passed on
//! by `tandem up`), the drafter they describe ([`build_drafter`]), and what a worker reports about
//! it (its registration record and its `Stats`).
//!
//! Flags are checked before any model is read ([`SpeculationArgs::validate`]); the draft model is
//! read, put on the target's device and checked against the target's vocabulary at start-up, so a
//! drafter that cannot work stops the process with an error naming `--draft-model`, never a
//! request. Prefill workers never speculate: [`NotOnPrefill`] gives them the same flags only to
//! refuse them with a message saying where they belong.

use std::path::{Path, PathBuf};

use tandem_engine::backend::BackendOptions;
use tandem_engine::factory::create_backend;
use tandem_engine::scheduler::Engine;
use tandem_engine::spec::draft_model::DraftModelDrafter;
use tandem_engine::spec::ngram::NgramDrafter;
use tandem_engine::spec::{Drafter, SpecMethod, SpecOptions, SpecStats, MAX_SPEC_TOKENS};
use tandem_engine::tokenizer::Tokenizer;
use tandem_engine::{Device, EngineError};
use tandem_proto::v1;

use tandem_serve::identity::{resolve_model, IdentityError};

use crate::model::Model;

/// Longest n-gram the drafter may look up (`--spec-ngram-max`).
pub const MAX_NGRAM: usize = 64;

/// Speculative decoding flags. Every flag can also be set with `TANDEM_<FLAG>` or, on the
/// worker binaries, as a key of the `--config` file.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct SpeculationArgs {
    /// Speculative decoding: off, ngram (prompt lookup: drafts what followed the newest tokens
    /// earlier in the sequence) or draft (a smaller model with the same vocabulary,
    /// --draft-model). Changes speed, never greedy output.
    #[arg(long, env = "TANDEM_SPECULATE", default_value = "off", value_name = "off|ngram|draft")]
    pub speculate: SpecMethod,
    /// With --speculate draft: the draft model (GGUF file or Hugging Face directory). It runs on
    /// the same device as the target and must share its vocabulary.
    #[arg(long, env = "TANDEM_DRAFT_MODEL", value_name = "PATH")]
    pub draft_model: Option<PathBuf>,
    /// Most draft tokens per sequence per step (k), 1 to 16.
    #[arg(long, env = "TANDEM_SPEC_TOKENS", default_value_t = 4, value_name = "K")]
    pub spec_tokens: usize,
    /// Adapt the number of draft tokens to each sequence's acceptance rate, the batch size and
    /// the free KV blocks (false: always draft K when budget and blocks allow).
    #[arg(
        long,
        env = "TANDEM_SPEC_ADAPTIVE",
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "true|false"
    )]
    pub spec_adaptive: bool,
    /// With --speculate ngram: the shortest suffix of the sequence to look up.
    #[arg(long, env = "TANDEM_SPEC_NGRAM_MIN", default_value_t = 2, value_name = "N")]
    pub spec_ngram_min: usize,
    /// With --speculate ngram: the longest suffix to look up (tried first).
    #[arg(long, env = "TANDEM_SPEC_NGRAM_MAX", default_value_t = 4, value_name = "N")]
    pub spec_ngram_max: usize,
    /// With --speculate draft: for requests with temperature > 0, sample the drafts from the draft
    /// model at the request's temperature and accept each with probability min(1, p/q). Keeps the
    /// output's distribution, but a seeded request no longer gives the same tokens as without
    /// speculation (false: greedy drafts, same tokens).
    #[arg(
        long,
        env = "TANDEM_SPEC_SAMPLED_DRAFTS",
        default_value_t = false,
        action = clap::ArgAction::Set,
        value_name = "true|false"
    )]
    pub spec_sampled_drafts: bool,
}

impl Default for SpeculationArgs {
    fn default() -> Self {
        let o = SpecOptions::default();
        SpeculationArgs {
            speculate: SpecMethod::Off,
            draft_model: None,
            spec_tokens: o.max_draft,
            spec_adaptive: o.adaptive,
            spec_ngram_min: o.ngram_min,
            spec_ngram_max: o.ngram_max,
            spec_sampled_drafts: o.sampled_drafts,
        }
    }
}

/// Why speculation could not be set up. Every message names the flag at fault.
#[derive(Debug, thiserror::Error)]
pub enum SpeculationError {
    /// A flag, or a combination of flags, is unusable; the message names them.
    #[error("{0}")]
    Flag(String),
    /// The draft model could not be found or read.
    #[error("--draft-model {}", .path.display())]
    DraftModel {
        path: PathBuf,
        #[source]
        source: Box<IdentityError>,
    },
    /// No backend could be built for the draft model on the target's device.
    #[error("--draft-model {}: building its backend on {device}", .path.display())]
    DraftBackend {
        path: PathBuf,
        device: Device,
        #[source]
        source: Box<EngineError>,
    },
    /// The draft model cannot draft for the target (a different vocabulary, ...).
    #[error("--draft-model {}: it cannot draft for the target model", .path.display())]
    Incompatible {
        path: PathBuf,
        #[source]
        source: Box<EngineError>,
    },
    /// The engine refused the drafter or its settings.
    #[error("turning speculative decoding on")]
    Engine(#[source] Box<EngineError>),
}

impl SpeculationError {
    /// Stable, low-cardinality name of the failure.
    pub fn kind(&self) -> &'static str {
        match self {
            SpeculationError::Flag(_) => "flag",
            SpeculationError::DraftModel { .. } => "draft_model",
            SpeculationError::DraftBackend { .. } => "draft_backend",
            SpeculationError::Incompatible { .. } => "draft_incompatible",
            SpeculationError::Engine(_) => "engine",
        }
    }
}

impl SpeculationArgs {
    /// Whether these flags turn speculation on.
    pub fn enabled(&self) -> bool {
        self.speculate != SpecMethod::Off
    }

    /// The engine's settings from the flags (meaningful when speculation is on).
    pub fn options(&self) -> SpecOptions {
        SpecOptions {
            max_draft: self.spec_tokens,
            adaptive: self.spec_adaptive,
            ngram_min: self.spec_ngram_min,
            ngram_max: self.spec_ngram_max,
            sampled_drafts: self.spec_sampled_drafts,
        }
    }

    /// Checks the flags alone (no model read): `--draft-model` goes with `--speculate draft` and
    /// only with it, and the numbers are in range.
    pub fn validate(&self) -> Result<(), SpeculationError> {
        let bad = |m: String| Err(SpeculationError::Flag(m));
        match (self.speculate, &self.draft_model) {
            (SpecMethod::Draft, None) => {
                return bad("--speculate draft needs --draft-model PATH (a model sharing the target's \
                            vocabulary)"
                    .into())
            }
            (SpecMethod::Draft, Some(p)) if p.as_os_str().is_empty() => {
                return bad("--draft-model is empty".into())
            }
            (method, Some(p)) if method != SpecMethod::Draft => {
                return bad(format!(
                    "--draft-model {} is only used with --speculate draft (got --speculate {method})",
                    p.display()
                ))
            }
            _ => {}
        }
        if self.spec_sampled_drafts && self.speculate != SpecMethod::Draft {
            return bad(format!(
                "--spec-sampled-drafts true is only used with --speculate draft (got --speculate {}): \
                 n-gram drafts are deterministic",
                self.speculate
            ));
        }
        if !(1..=MAX_SPEC_TOKENS).contains(&self.spec_tokens) {
            return bad(format!(
                "--spec-tokens must be between 1 and {MAX_SPEC_TOKENS}, got {}",
                self.spec_tokens
            ));
        }
        let (min, max) = (self.spec_ngram_min, self.spec_ngram_max);
        if min == 0 || min > max || max > MAX_NGRAM {
            return bad(format!(
                "--spec-ngram-min and --spec-ngram-max must satisfy 1 <= min <= max <= {MAX_NGRAM}, got \
                 {min} and {max}"
            ));
        }
        self.options().validate().map_err(|e| SpeculationError::Flag(e.to_string()))
    }

    /// The flags as command-line arguments, for a launcher that passes them on (`tandem up` to
    /// its decode workers); empty when speculation is off, so the workers keep their defaults.
    pub fn to_args(&self) -> Vec<String> {
        if !self.enabled() {
            return Vec::new();
        }
        let mut v = vec![
            "--speculate".into(),
            self.speculate.to_string(),
            "--spec-tokens".into(),
            self.spec_tokens.to_string(),
            "--spec-adaptive".into(),
            self.spec_adaptive.to_string(),
            "--spec-ngram-min".into(),
            self.spec_ngram_min.to_string(),
            "--spec-ngram-max".into(),
            self.spec_ngram_max.to_string(),
        ];
        if let Some(p) = &self.draft_model {
            v.extend(["--draft-model".into(), p.display().to_string()]);
        }
        if self.spec_sampled_drafts {
            v.extend(["--spec-sampled-drafts".into(), "true".into()]);
        }
        v
    }
}

/// What the drafter needs to know about the target model and its backend.
#[derive(Clone, Copy)]
pub struct Target<'a> {
    /// The target's tokenizer (a draft model must share its vocabulary).
    pub tokenizer: &'a Tokenizer,
    /// Rows of the target's output head.
    pub vocab_size: usize,
    /// The target's device: a draft model runs on the same one.
    pub device: Device,
    /// The target backend's options: a draft model's pool holds as many tokens in blocks of the
    /// same size, and its passes are as large.
    pub backend: &'a BackendOptions,
}

/// A drafter and the settings the engine runs it with.
pub type DrafterSetup = (Box<dyn Drafter>, SpecOptions);

/// The drafter and settings the flags describe, or `None` when speculation is off. A draft model
/// is read, given a backend on the target's device and checked against the target here.
pub fn build_drafter(
    args: &SpeculationArgs,
    target: Target<'_>,
) -> Result<Option<DrafterSetup>, SpeculationError> {
    args.validate()?;
    let opts = args.options();
    let drafter: Box<dyn Drafter> = match args.speculate {
        SpecMethod::Off => return Ok(None),
        SpecMethod::Ngram => Box::new(NgramDrafter::new(opts.ngram_min, opts.ngram_max)),
        SpecMethod::Draft => {
            let path = args
                .draft_model
                .as_deref()
                .ok_or_else(|| SpeculationError::Flag("--speculate draft needs --draft-model PATH".into()))?;
            Box::new(draft_model_drafter(path, target)?)
        }
    };
    Ok(Some((drafter, opts)))
}

/// Reads the draft model, builds its backend beside the target's and the drafter over it.
fn draft_model_drafter(path: &Path, target: Target<'_>) -> Result<DraftModelDrafter, SpeculationError> {
    let draft_error =
        |source| SpeculationError::DraftModel { path: path.to_path_buf(), source: Box::new(source) };
    let model = Model::load(&resolve_model(Some(path)).map_err(draft_error)?).map_err(draft_error)?;
    let Model { identity, loaded } = model;
    // Blocks of the target's size, as many of them (so the pool holds as many tokens), passes as
    // large; the pool is private, since nothing is ever transferred into it.
    // The drafter keeps its own plain block tables: its pool has one layer group.
    let opts = BackendOptions { kv_shared: false, windowed_kv: false, ..*target.backend };
    let backend =
        create_backend(target.device, loaded, opts).map_err(|source| SpeculationError::DraftBackend {
            path: path.to_path_buf(),
            device: target.device,
            source: Box::new(source),
        })?;
    let short_id: String = identity.model_id.chars().take(19).collect();
    let name = format!("{} ({short_id})", identity.model_name);
    DraftModelDrafter::new(target.tokenizer, target.vocab_size, backend, &identity.tokenizer, name).map_err(
        |source| SpeculationError::Incompatible { path: path.to_path_buf(), source: Box::new(source) },
    )
}

/// `engine` with the speculation the flags describe (unchanged when it is off). `device` and
/// `backend` are the target's, as it was built.
pub fn speculate(
    engine: Engine,
    args: &SpeculationArgs,
    device: Device,
    backend: &BackendOptions,
) -> Result<Engine, SpeculationError> {
    let vocab_size = engine.backend().config().vocab_size;
    let tokenizer = engine.tokenizer().clone();
    let target = Target { tokenizer: &tokenizer, vocab_size, device, backend };
    match build_drafter(args, target)? {
        None => Ok(engine),
        Some((drafter, opts)) => {
            engine.with_speculation(drafter, opts).map_err(|e| SpeculationError::Engine(Box::new(e)))
        }
    }
}

/// What a worker registers about its speculation: `None` when its engine does not speculate.
pub fn registration_record(engine: &Engine) -> Option<v1::SpeculationInfo> {
    let (opts, drafter) = engine.spec_config()?;
    Some(v1::SpeculationInfo {
        method: engine.spec_method().to_string(),
        max_draft: opts.max_draft as u32,
        adaptive: opts.adaptive,
        drafter,
    })
}

/// An engine's counters as `Stats` reports them.
pub fn counters(stats: SpecStats) -> v1::SpecCounters {
    v1::SpecCounters {
        proposed: stats.proposed,
        accepted: stats.accepted,
        verifications: stats.verifications,
    }
}

/// The speculation flags on a role that never speculates (prefill workers), hidden from `--help`:
/// taken only so that one given by mistake (a flag, or a key of a config file shared with the
/// decode workers) is refused with a message saying where it belongs.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct NotOnPrefill {
    #[arg(long, hide = true)]
    speculate: Option<String>,
    #[arg(long, hide = true)]
    draft_model: Option<String>,
    #[arg(long, hide = true)]
    spec_tokens: Option<String>,
    #[arg(long, hide = true)]
    spec_adaptive: Option<String>,
    #[arg(long, hide = true)]
    spec_ngram_min: Option<String>,
    #[arg(long, hide = true)]
    spec_ngram_max: Option<String>,
    #[arg(long, hide = true)]
    spec_sampled_drafts: Option<String>,
}

impl NotOnPrefill {
    /// An error naming the first speculation flag given, if any.
    pub fn refuse(&self) -> Result<(), SpeculationError> {
        let given = [
            ("--speculate", &self.speculate),
            ("--draft-model", &self.draft_model),
            ("--spec-tokens", &self.spec_tokens),
            ("--spec-adaptive", &self.spec_adaptive),
            ("--spec-ngram-min", &self.spec_ngram_min),
            ("--spec-ngram-max", &self.spec_ngram_max),
            ("--spec-sampled-drafts", &self.spec_sampled_drafts),
        ];
        match given.iter().find(|(_, v)| v.is_some()) {
            None => Ok(()),
            Some((flag, _)) => Err(SpeculationError::Flag(format!(
                "{flag}: prefill workers never speculate (speculation runs where tokens are decoded); \
                 give the speculation flags to the decode or colocated workers"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(flatten)]
        spec: SpeculationArgs,
    }

    fn parse(args: &[&str]) -> Result<SpeculationArgs, String> {
        let argv = std::iter::once("x").chain(args.iter().copied());
        Cli::try_parse_from(argv).map(|c| c.spec).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_off_and_the_engine_defaults() {
        let a = parse(&[]).unwrap();
        assert_eq!(a, SpeculationArgs::default());
        assert!(!a.enabled());
        assert_eq!(a.options(), SpecOptions::default());
        a.validate().unwrap();
        assert!(a.to_args().is_empty());
    }

    #[test]
    fn flags_parse_and_round_trip_through_to_args() {
        let a = parse(&[
            "--speculate",
            "ngram",
            "--spec-tokens",
            "7",
            "--spec-adaptive",
            "false",
            "--spec-ngram-min",
            "1",
            "--spec-ngram-max",
            "3",
        ])
        .unwrap();
        assert_eq!(a.speculate, SpecMethod::Ngram);
        assert_eq!(
            a.options(),
            SpecOptions { max_draft: 7, adaptive: false, ngram_min: 1, ngram_max: 3, sampled_drafts: false }
        );
        let args = a.to_args();
        let back = parse(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back, a);
        let d = parse(&["--speculate", "draft", "--draft-model", "/m/draft.gguf"]).unwrap();
        let back = parse(&d.to_args().iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back, d);
        let d =
            parse(&["--speculate", "draft", "--draft-model", "/m/d.gguf", "--spec-sampled-drafts", "true"])
                .unwrap();
        assert!(d.options().sampled_drafts);
        let back = parse(&d.to_args().iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back, d);
        let e = parse(&["--speculate", "ngram", "--spec-sampled-drafts", "true"])
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("--spec-sampled-drafts") && e.to_string().contains("draft"), "{e}");
        let e = parse(&["--speculate", "medusa"]).unwrap_err();
        assert!(e.contains("medusa") && e.contains("ngram"), "{e}");
    }

    #[test]
    fn a_config_file_sets_the_flags_and_a_flag_beats_it() {
        let path = std::env::temp_dir().join(format!("tandem-spec-config-{}.toml", std::process::id()));
        std::fs::write(&path, "speculate = \"ngram\"\nspec-adaptive = false\nspec_tokens = 6\n").unwrap();
        let c = path.to_str().unwrap();
        let argv = |extra: &[&str]| {
            ["x", "--config", c].iter().chain(extra).map(std::ffi::OsString::from).collect::<Vec<_>>()
        };
        let a = tandem_serve::config::parse_args_from::<Cli>(argv(&[])).unwrap().spec;
        assert_eq!((a.speculate, a.spec_adaptive, a.spec_tokens), (SpecMethod::Ngram, false, 6));
        let a = tandem_serve::config::parse_args_from::<Cli>(argv(&["--speculate", "off"])).unwrap().spec;
        assert_eq!((a.speculate, a.spec_tokens), (SpecMethod::Off, 6));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn bad_combinations_name_the_flags() {
        let check = |args: &[&str], want: &[&str]| {
            let e = parse(args).unwrap().validate().unwrap_err().to_string();
            for w in want {
                assert!(e.contains(w), "{args:?}: {e}");
            }
        };
        check(&["--speculate", "draft"], &["--speculate draft", "--draft-model"]);
        check(&["--speculate", "ngram", "--draft-model", "d.gguf"], &["--draft-model d.gguf", "ngram"]);
        check(&["--draft-model", "d.gguf"], &["--draft-model", "off"]);
        check(&["--speculate", "ngram", "--spec-tokens", "0"], &["--spec-tokens", "16"]);
        check(&["--speculate", "ngram", "--spec-tokens", "17"], &["--spec-tokens"]);
        check(&["--speculate", "ngram", "--spec-ngram-min", "5"], &["--spec-ngram-min", "5 and 4"]);
        check(&["--speculate", "ngram", "--spec-ngram-min", "0"], &["--spec-ngram-min"]);
        check(&["--speculate", "ngram", "--spec-ngram-max", "65"], &["--spec-ngram-max"]);
    }

    #[test]
    fn a_missing_draft_model_is_named() {
        let tok_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa");
        let tokenizer = Tokenizer::from_hf_dir(&tok_path).unwrap();
        let opts = BackendOptions { num_blocks: 8, max_batch_tokens: 32, ..Default::default() };
        let target = Target { tokenizer: &tokenizer, vocab_size: 448, device: Device::Cpu, backend: &opts };
        let a = parse(&["--speculate", "draft", "--draft-model", "/nonexistent/draft.gguf"]).unwrap();
        let e = build_drafter(&a, target).err().expect("refused");
        assert_eq!(e.kind(), "draft_model");
        let chain = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert!(chain.starts_with("--draft-model /nonexistent/draft.gguf: "), "{chain}");
        assert!(chain.contains("does not exist"), "{chain}");
        // Off builds nothing; ngram builds the n-gram drafter with the flags' range.
        assert!(build_drafter(&SpeculationArgs::default(), target).unwrap().is_none());
        let ngram = parse(&["--speculate", "ngram", "--spec-ngram-max", "6"]).unwrap();
        let (d, o) = build_drafter(&ngram, target).unwrap().unwrap();
        assert_eq!((d.method(), d.describe(), o.ngram_max), (SpecMethod::Ngram, "ngram 2..6".into(), 6));
    }

    #[test]
    fn a_gemma_draft_model_drafts_beside_a_target_with_windowed_kv() {
        // The target's pool has layer groups (the workers' default); the drafter keeps plain
        // tables of its own, so its passes must not inherit them.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/gemma3");
        let tokenizer = Tokenizer::from_hf_dir(&dir).unwrap();
        let opts = BackendOptions {
            num_blocks: 32,
            block_size: 4,
            max_batch_tokens: 64,
            windowed_kv: true,
            ..Default::default()
        };
        let target = Target { tokenizer: &tokenizer, vocab_size: 448, device: Device::Cpu, backend: &opts };
        let a = parse(&["--speculate", "draft", "--draft-model", dir.to_str().unwrap()]).unwrap();
        let (mut d, _) = build_drafter(&a, target).expect("draft model").expect("a drafter");
        let tokens: Vec<u32> = (0..40u32).map(|i| 3 + i * 7 % 400).collect();
        let ask = tandem_engine::spec::DraftAsk { seq: 1, tokens: &tokens, max: 4, sampling: None };
        let drafts = d.propose(&[ask]).expect("the drafter runs its passes");
        assert_eq!(drafts.len(), 1);
        assert_eq!(drafts[0].len(), 4, "{drafts:?}");
    }

    #[test]
    fn prefill_refuses_every_speculation_flag() {
        #[derive(Debug, Parser)]
        struct Prefill {
            #[command(flatten)]
            spec: NotOnPrefill,
        }
        let p = Prefill::try_parse_from(["x"]).unwrap();
        p.spec.refuse().unwrap();
        for flag in [
            "--speculate",
            "--draft-model",
            "--spec-tokens",
            "--spec-adaptive",
            "--spec-ngram-min",
            "--spec-sampled-drafts",
        ] {
            let p = Prefill::try_parse_from(["x", flag, "1"]).unwrap();
            let e = p.spec.refuse().unwrap_err().to_string();
            assert!(e.starts_with(flag) && e.contains("prefill workers never speculate"), "{e}");
        }
    }
}
