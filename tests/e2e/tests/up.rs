//! The README's main job: `tandem up` starts a router, a prefill and a decode worker, prints
//! `ready router=<addr>`, serves `tandem generate --router` with the same output as in-process
//! `tandem generate`, and takes its children down with it on SIGINT. A child killed after that is
//! started again (up to its restart budget) while the rest of the cluster serves on.

use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_e2e::*;

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

/// Live children of `parent` running worker `id` (`--worker-id <id>` on their command line; a
/// child not yet exec'd or exited and not yet reaped has none).
fn worker_pids(parent: i32, id: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return pids };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // `pid (comm) state ppid ..`: the command name may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(')') else { continue };
        let mut fields = rest.split_whitespace();
        let (state, ppid) = (fields.next(), fields.next().and_then(|x| x.parse::<i32>().ok()));
        if ppid != Some(parent) || state == Some("Z") {
            continue;
        }
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        if args.windows(2).any(|w| w[0] == b"--worker-id" && w[1] == id.as_bytes()) {
            pids.push(pid);
        }
    }
    pids
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

fn sigkill(pid: i32) {
    // SAFETY: `pid` is a live child of the `tandem up` this test started (seen in /proc just now,
    // not a zombie), so it names that worker and no other process.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
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
    let model = tiny_model().display().to_string();
    let mut args: Vec<String> = ["up", "--model", &model, "--threads", "1"].map(String::from).to_vec();
    args.extend(flags.iter().map(|s| s.to_string()));
    let up = Proc::spawn("up", &bin("tandem"), &args);
    let line = up
        .next_line(Duration::from_secs(180))
        .unwrap_or_else(|| panic!("no ready line:\n{}", up.log_tail(4000)));
    let ready = parse_ready(&line).unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    (up, ready)
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
