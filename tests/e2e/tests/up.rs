//! The README's main job: `tandem up` starts a router, a prefill and a decode worker, prints
//! `ready router=<addr>`, serves `tandem generate --router` with the same output as in-process
//! `tandem generate`, and takes its children down with it on SIGINT.

use std::process::Command;
use std::time::Duration;

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
