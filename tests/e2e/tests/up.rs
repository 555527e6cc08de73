//! The README's main job: `tandem up` starts a router, a prefill and a decode worker, prints
//! `ready router=<addr>`, serves `tandem generate --router` with the same output as in-process
//! `tandem generate`, and takes its children down with it on SIGINT. A child killed after that is
//! started again (up to its restart budget) while the rest of the cluster serves on.

use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_e2e::*;
use tandem_proto::v1;

fn generate_json(args: &[&str]) -> serde_json::Value {
    let out =
        Command::new(bin("tandem")).arg("generate").arg("--json").args(args).output().expect("tandem runs");
    assert!(
        out.status.success(),
        "tandem generate {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

model_test!(tandem_up_serves_the_same_output_as_in_process_generate, up_and_generate);

fn up_and_generate(model: &TestModel) {
    let model = model.path.display().to_string();
    let mut up = Proc::spawn(
        "up",
        &bin("tandem"),
        &["up".into(), "--model".into(), model.clone(), "--threads".into(), "1".into()],
    );
    let ready = up
        .next_line(Duration::from_secs(180))
        .unwrap_or_else(|| panic!("no ready line:\n{}", up.log_tail(4000)));
    let addr = ready
        .strip_prefix("ready router=")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line {ready:?}:\n{}", up.log_tail(4000)))
        .to_owned();
    for (prompt, chat) in [("The capital of France is", false), ("Write a haiku about rivers.", true)] {
        let mut args = vec!["--model", model.as_str(), "--max-tokens", "24"];
        if chat {
            args.push("--chat");
        }
        args.push(prompt);
        let local = generate_json(&args);
        let mut remote_args = vec!["--router", addr.as_str(), "--max-tokens", "24"];
        if chat {
            remote_args.push("--chat");
        }
        remote_args.push(prompt);
        let remote = generate_json(&remote_args);
        assert_eq!(remote, local, "prompt {prompt:?}");
    }
    // A bad request through the router is a clear error, and the cluster keeps serving.
    let out = Command::new(bin("tandem"))
        .args(["generate", "--router", &addr, "--max-tokens", "0", "hi"])
        .output()
        .expect("tandem runs");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("max_tokens"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    up.signal(libc::SIGINT);
    let st = up
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("tandem up did not stop:\n{}", up.log_tail(4000)));
    assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(4000));
    // Its children went with it: the router no longer answers.
    let sock: std::net::SocketAddr = addr.parse().expect("address");
    assert!(
        std::net::TcpStream::connect_timeout(&sock, Duration::from_secs(1)).is_err(),
        "router still listening"
    );
}

/// `tandem up --prefill-workers N --decode-workers M` (or `--colocated --decode-workers M`) starts
/// that many workers, prints its one ready line once every one of them has registered, and
/// serves with them.
#[test]
fn tandem_up_starts_as_many_workers_as_asked() {
    let model = tiny_model().display().to_string();
    let cases: [(&[&str], &[&str]); 2] = [
        (
            &["--prefill-workers", "2", "--decode-workers", "3"],
            &["decode-0", "decode-1", "decode-2", "prefill-0", "prefill-1"],
        ),
        (&["--colocated", "--decode-workers", "2"], &["colocated-0", "colocated-1"]),
    ];
    for (flags, want) in cases {
        let mut args: Vec<String> = ["up", "--model", &model, "--threads", "1"].map(String::from).to_vec();
        args.extend(flags.iter().map(|s| s.to_string()));
        let mut up = Proc::spawn("up", &bin("tandem"), &args);
        let line = up
            .next_line(Duration::from_secs(180))
            .unwrap_or_else(|| panic!("no ready line for {flags:?}:\n{}", up.log_tail(4000)));
        let ready = parse_ready(&line).unwrap_or_else(|| panic!("unexpected first line {line:?}"));
        let h = block_on(health(ready.router)).expect("the router answers");
        let mut ids: Vec<String> =
            h.workers.iter().filter(|w| w.healthy).map(|w| w.worker_id.clone()).collect();
        ids.sort();
        assert_eq!(ids, want, "{flags:?}: every worker registered before the ready line");
        for i in 0..4 {
            let r = Req::text(format!("Request {i} to a bigger local cluster:"), 6);
            let c = block_on(generate(ready.router, r.to_proto()))
                .unwrap_or_else(|s| panic!("{flags:?}: request {i} failed: {s:?}\n{}", up.log_tail(4000)));
            assert_eq!(c.token_ids.len(), 6, "{c:?}");
        }
        up.signal(libc::SIGINT);
        let st = up
            .wait_exit(Duration::from_secs(60))
            .unwrap_or_else(|| panic!("tandem up did not stop:\n{}", up.log_tail(4000)));
        assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(4000));
        // Its stdout is closed now: the ready line was its only line.
        assert_eq!(up.next_line(Duration::from_secs(5)), None, "{flags:?}");
    }
}

/// The pid of `up`'s child running worker `id` that is none of `old`, once there is one.
fn next_worker_pid(up: &mut Proc, id: &str, old: &[i32]) -> i32 {
    // A bound on a hang, not a timing assertion.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(&pid) = worker_pids(up.pid(), id).iter().find(|p| !old.contains(p)) {
            return pid;
        }
        assert!(up.is_running(), "tandem up exited:\n{}", up.log_tail(8000));
        assert!(Instant::now() < deadline, "no new {id} process (old: {old:?}):\n{}", up.log_tail(8000));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls (`what` in the panic message) until `done`; 60 s at most, a bound on a hang.
fn wait_until(up: &mut Proc, what: &str, mut done: impl FnMut(&Proc) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(up) {
        assert!(up.is_running(), "tandem up exited while waiting for {what}:\n{}", up.log_tail(8000));
        assert!(Instant::now() < deadline, "waited 60 s for {what}:\n{}", up.log_tail(8000));
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `tandem up` with `flags` on the tiny model, one thread per worker; its parsed ready line.
fn start_up(flags: &[&str]) -> (Proc, UpReady) {
    start_up_on(&tiny_model(), flags)
}

fn requests_succeed(up: &Proc, router: SocketAddr, n: usize) {
    for i in 0..n {
        let r = Req::text(format!("Request {i} to a cluster that lost a worker:"), 6);
        let c = block_on(generate(router, r.to_proto()))
            .unwrap_or_else(|s| panic!("request {i} failed: {s:?}\n{}", up.log_tail(8000)));
        assert_eq!(c.token_ids.len(), 6, "{c:?}");
    }
}

/// SIGINT; `tandem up` exits 0 and its last word is the restart status line, returned.
fn stop(up: &mut Proc) -> String {
    up.signal(libc::SIGINT);
    let st = up
        .wait_exit(Duration::from_secs(90))
        .unwrap_or_else(|| panic!("tandem up did not stop:\n{}", up.log_tail(8000)));
    assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(8000));
    let log = up.log_text();
    let status = log.lines().rev().find(|l| l.starts_with("tandem up: restarts: "));
    status.unwrap_or_else(|| panic!("no restart status line:\n{}", up.log_tail(8000))).to_owned()
}

/// The line of `tandem up`'s stderr about `name`'s process `pid`, once it is there.
fn line_about(up: &mut Proc, name: &str, pid: i32) -> String {
    let prefix = format!("tandem up: {name} (pid {pid}, ");
    let mut found = None;
    wait_until(up, &format!("a line starting {prefix:?}"), |up| {
        found = up.log_text().lines().find(|l| l.starts_with(&prefix)).map(str::to_owned);
        found.is_some()
    });
    found.expect("found")
}

/// A worker SIGKILLed after the ready line is started again under its name: it registers again
/// (at a new address) and the cluster serves as before; the restart is on stderr and counted in
/// the status line `tandem up` ends with.
#[test]
fn tandem_up_restarts_a_killed_worker() {
    let (mut up, ready) = start_up(&["--prefill-workers", "2"]);
    let old = next_worker_pid(&mut up, "prefill-1", &[]);
    sigkill(old);
    let line = line_about(&mut up, "prefill-1", old);
    assert!(
        line.ends_with(
            " exited (signal: 9 (SIGKILL)); restarting it in 0.5 s (restart 1 of 5 in 60 s, prefill restarts: 1)"
        ),
        "{line}"
    );
    let new = next_worker_pid(&mut up, "prefill-1", &[old]);
    // Back in the router's table at an address that answers: the old process, dead, answers
    // nowhere, so that is the new one.
    wait_until(&mut up, "prefill-1 to register again", |_| {
        let Ok(h) = block_on(health(ready.router)) else { return false };
        h.workers.iter().any(|w| {
            w.worker_id == "prefill-1"
                && w.healthy
                && w.address
                    .parse::<SocketAddr>()
                    .is_ok_and(|a| TcpStream::connect_timeout(&a, Duration::from_secs(1)).is_ok())
        })
    });
    assert!(up.log_text().contains(&format!("tandem up: prefill-1 restarted (pid {new})")));
    requests_succeed(&up, ready.router, 3);
    assert_eq!(stop(&mut up), "tandem up: restarts: router=0 prefill=1 decode=0");
}

/// A worker that keeps dying is restarted 5 times, then left down with one line naming it; the
/// rest of the cluster serves on, and `tandem up` runs until it is told to stop.
#[test]
fn tandem_up_gives_up_on_a_crash_loop_and_serves_on() {
    let (mut up, ready) = start_up(&["--decode-workers", "2"]);
    // Each new process is killed as soon as it runs: the six exits take the restart waits
    // (0.5 + 1 + 2 + 4 + 8 s) and little more, well within the budget's 60 s.
    let mut killed = Vec::new();
    for _ in 0..6 {
        let pid = next_worker_pid(&mut up, "decode-1", &killed);
        sigkill(pid);
        killed.push(pid);
    }
    for (n, &pid) in killed.iter().enumerate().take(5) {
        let line = line_about(&mut up, "decode-1", pid);
        let want = format!("(restart {} of 5 in 60 s, decode restarts: {})", n + 1, n + 1);
        assert!(line.contains("; restarting it in ") && line.ends_with(&want), "{line}");
    }
    let last = line_about(&mut up, "decode-1", killed[5]);
    assert!(
        last.ends_with(
            " exited (signal: 9 (SIGKILL)) after 5 restarts in 60 s; it will not be restarted again; its last \
             stderr lines:"
        ),
        "{last}"
    );
    assert!(
        worker_pids(up.pid(), "decode-1").is_empty(),
        "decode-1 was started again:\n{}",
        up.log_tail(8000)
    );
    assert!(up.is_running(), "tandem up stopped:\n{}", up.log_tail(8000));
    // Once the router has dropped the dead worker (missed heartbeats), decode-0 serves alone.
    wait_until(&mut up, "the router to drop decode-1", |_| {
        block_on(health(ready.router))
            .is_ok_and(|h| h.serving && !h.workers.iter().any(|w| w.worker_id == "decode-1" && w.healthy))
    });
    requests_succeed(&up, ready.router, 3);
    assert!(worker_pids(up.pid(), "decode-1").is_empty(), "decode-1 came back:\n{}", up.log_tail(8000));
    assert_eq!(stop(&mut up), "tandem up: restarts: router=0 prefill=0 decode=5");
}

/// Six long prompts (as token ids, so every run sees the same ones), greedy, with output enough
/// to decode for a while.
fn long_prompts(model: &TestModel, tokens: usize) -> Vec<v1::GenerateRequest> {
    let words = "the quick brown fox jumps over a lazy dog near the river bank ";
    (0..6)
        .map(|i| {
            let req =
                model.fit(tokens, |n| Req::text(format!("Prompt {i}: {}", words.repeat(n / 12 + 1)), 24));
            let mut ids = model.tokenizer().encode(&req.prompt, true).unwrap();
            ids.truncate(tokens);
            v1::GenerateRequest {
                prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids })),
                max_tokens: Some(24),
                ignore_eos: true,
                ..Default::default()
            }
        })
        .collect()
}

/// Sends every request at once and returns each one's tokens; panics naming any that failed.
fn run_all(up: &Proc, router: SocketAddr, reqs: &[v1::GenerateRequest], what: &str) -> Vec<Vec<u32>> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let tasks: Vec<_> = reqs.iter().map(|r| rt.spawn(generate(router, r.clone()))).collect();
    collect(up, &rt, tasks, what)
}

fn collect(
    up: &Proc,
    rt: &tokio::runtime::Runtime,
    tasks: Vec<tokio::task::JoinHandle<Result<Completion, tonic::Status>>>,
    what: &str,
) -> Vec<Vec<u32>> {
    rt.block_on(async {
        let mut out = Vec::new();
        for (i, t) in tasks.into_iter().enumerate() {
            // A bound on a hang, not a timing assertion.
            let r =
                tokio::time::timeout(Duration::from_secs(300), t).await.expect("not left hanging").unwrap();
            let c = r.unwrap_or_else(|s| panic!("{what}: request {i} failed: {s:?}\n{}", up.log_tail(8000)));
            out.push(c.token_ids);
        }
        out
    })
}

/// The router's workers of `role` ("prefill-", "decode-") that hold work now, by id.
async fn busy(router: SocketAddr, prefix: &str) -> Option<String> {
    let h = health(router).await.ok()?;
    for w in h.workers.iter().filter(|w| w.worker_id.starts_with(prefix) && w.healthy) {
        let Ok(addr) = w.address.parse::<SocketAddr>() else { continue };
        let load = worker_stats(addr, false).await.ok().and_then(|s| s.load);
        if load.is_some_and(|l| l.running + l.queued > 0) {
            return Some(w.worker_id.clone());
        }
    }
    None
}

/// Every worker the router lists is quiescent (free + cached == total, nothing held or
/// reserved, invariants checked), once the requests are done; the router's `/metrics` text.
fn assert_all_quiescent(up: &mut Proc, ready: &UpReady) -> String {
    let mut last = String::new();
    wait_until(up, "every worker to be quiescent", |_| {
        let Ok(h) = block_on(health(ready.router)) else { return false };
        let mut all = true;
        last.clear();
        for w in h.workers.iter().filter(|w| w.healthy) {
            let st = w.address.parse().ok().and_then(|a| block_on(worker_stats(a, true)).ok());
            let ok = st.as_ref().is_some_and(is_quiescent);
            last.push_str(&format!("{} quiescent={ok} {:?}\n", w.worker_id, st.and_then(|s| s.kv)));
            all &= ok;
        }
        all
    });
    let http = ready.http.expect("the ready line names the HTTP address");
    let (code, text) = http_get(http, "/metrics").expect("the router answers /metrics");
    assert_eq!(code, 200, "{text}");
    text
}

model_test!(a_prefill_worker_killed_mid_prefill_under_tandem_up_costs_only_time, kill_prefill_under_up);

/// The README's promise under `tandem up --prefill-workers 2`: a prefill worker SIGKILLed while
/// six long prompts are in flight costs the clients only a later first token (every request ends
/// with the undisturbed output), `tandem up` restarts it, and the next round uses it again.
fn kill_prefill_under_up(model: &TestModel) {
    survive_prefill_kill(model, 2);
}

/// The same with the only prefill worker: the decode worker computes the prompts meanwhile.
#[test]
fn the_only_prefill_worker_killed_under_tandem_up_costs_only_time() {
    survive_prefill_kill(&TestModel::tiny(), 1);
}

fn survive_prefill_kill(model: &TestModel, prefill_workers: u32) {
    let n = prefill_workers.to_string();
    // No prefix cache: every round computes its prompts again. The tiny model computes a prompt
    // in one short step, so it gets small steps, to be killed while it computes.
    let mut flags = vec!["--prefill-workers", &n, "--prefix-cache", "false"];
    let tokens = if model.name == "tiny" {
        flags.extend(["--max-batch-tokens", "4"]);
        300
    } else {
        400
    };
    let (mut up, ready) = start_up_on(&model.path, &flags);
    let reqs = long_prompts(model, tokens);
    let undisturbed = run_all(&up, ready.router, &reqs, "the undisturbed round");

    let rt = tokio::runtime::Runtime::new().unwrap();
    let tasks: Vec<_> = reqs.iter().map(|r| rt.spawn(generate(ready.router, r.clone()))).collect();
    let victim = rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(id) = busy(ready.router, "prefill-").await {
                break id;
            }
            assert!(Instant::now() < deadline, "no prefill worker took the prompts:\n{}", up.log_tail(8000));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let old = next_worker_pid(&mut up, &victim, &[]);
    sigkill(old);
    let disturbed = collect(&up, &rt, tasks, "the round with the kill");
    assert_eq!(disturbed, undisturbed, "greedy output as if nothing happened");

    // Restarted and registered again, then used by the next round.
    let new = next_worker_pid(&mut up, &victim, &[old]);
    wait_until(&mut up, "the killed worker to register again", |_| {
        block_on(health(ready.router)).is_ok_and(|h| {
            h.workers.iter().any(|w| {
                w.worker_id == victim
                    && w.healthy
                    && w.address
                        .parse::<SocketAddr>()
                        .is_ok_and(|a| TcpStream::connect_timeout(&a, Duration::from_secs(1)).is_ok())
            })
        })
    });
    // A lone worker of a role keeps its plain name in tandem up's lines.
    let name = if prefill_workers == 1 { "prefill" } else { victim.as_str() };
    assert!(
        up.log_text().contains(&format!("tandem up: {name} restarted (pid {new})")),
        "{}",
        up.log_tail(8000)
    );
    let again = run_all(&up, ready.router, &reqs, "the round after the restart");
    assert_eq!(again, undisturbed);
    let h = block_on(health(ready.router)).unwrap();
    let addr: SocketAddr =
        h.workers.iter().find(|w| w.worker_id == victim).expect("listed").address.parse().unwrap();
    let finished = block_on(worker_stats(addr, false)).expect("stats").requests_finished;
    assert!(finished > 0, "the restarted {victim} took no prompt");

    let metrics = assert_all_quiescent(&mut up, &ready);
    // The worker held prompts when it was killed: they moved (to the other prefill worker, or
    // to the decode worker when it was the only one).
    let moved = sample(&metrics, r#"tandem_router_migrations_total{phase="prefill"}"#);
    assert!(moved.is_some_and(|n| n >= 1.0), "prompts moved off the killed worker:\n{metrics}");
    if prefill_workers == 1 {
        let fell_back =
            sample(&metrics, r#"tandem_router_decode_prefills_total{reason="no_prefill_worker"}"#);
        assert!(fell_back.is_some_and(|n| n >= 1.0), "the decode worker computed prompts:\n{metrics}");
    }
    assert_eq!(stop(&mut up), "tandem up: restarts: router=0 prefill=1 decode=0");
}

/// Ctrl-C while requests wait for KV blocks: every process exits within the grace, and each
/// request either finishes or gets a retryable error; none is left hanging.
#[test]
fn ctrl_c_with_requests_waiting_for_kv_blocks_stops_cleanly() {
    // 40 blocks of 16 tokens: one request (about 200 prompt tokens and 250 generated) at a time;
    // the others wait in the router's line for blocks.
    let (mut up, ready) = start_up(&["--kv-blocks", "40", "--drain-timeout-ms", "3000"]);
    let model = TestModel::tiny();
    let reqs: Vec<v1::GenerateRequest> = long_prompts(&model, 200)
        .into_iter()
        .map(|r| v1::GenerateRequest { max_tokens: Some(250), ..r })
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let tasks: Vec<_> = reqs.iter().map(|r| rt.spawn(generate(ready.router, r.clone()))).collect();
    wait_until(&mut up, "a request to wait for KV blocks", |_| {
        let (_, text) = http_get(ready.http.unwrap(), "/metrics").unwrap_or_default();
        sample(&text, "tandem_router_kv_waiting").is_some_and(|n| n >= 1.0)
    });
    let children: Vec<i32> =
        ["prefill-0", "decode-0"].iter().flat_map(|id| worker_pids(up.pid(), id)).collect();
    up.signal(libc::SIGINT);
    // A bound on a hang: the grace is the drain (3 s) and 10 s more.
    let st = up
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("tandem up hangs:\n{}", up.log_tail(8000)));
    assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(8000));
    for pid in children {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid),
            "{pid} still runs"
        );
    }
    rt.block_on(async {
        for (i, t) in tasks.into_iter().enumerate() {
            let r =
                tokio::time::timeout(Duration::from_secs(30), t).await.expect("not left hanging").unwrap();
            if let Err(s) = r {
                assert!(
                    matches!(s.code(), tonic::Code::Unavailable),
                    "request {i} got a non-retryable error: {s:?}"
                );
            }
        }
    });
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, r)| r.trim_start().starts_with('Z')))
        .unwrap_or(true)
}
