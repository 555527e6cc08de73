//! Driving a `tandem up` cluster from outside, as its users do: start it on a model with a
//! known cluster secret (so the tests can ask its workers for `Stats`), find the process behind
//! each worker id, and kill one.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tandem_proto::v1;

use crate::{bin, channel, parse_ready, Proc, UpReady, WorkerClient};

/// The cluster secret of the clusters [`start_up_on`] starts.
pub const UP_SECRET: &str = "up-test-cluster-secret-0123456789";

/// `tandem up --model <model> --threads 1` with `flags`, once it printed its ready line (parsed).
pub fn start_up_on(model: &Path, flags: &[&str]) -> (Proc, UpReady) {
    let model = model.display().to_string();
    let mut args: Vec<String> =
        ["up", "--model", &model, "--threads", "1", "--cluster-secret", UP_SECRET].map(String::from).to_vec();
    args.extend(flags.iter().map(|s| s.to_string()));
    let up = Proc::spawn("up", &bin("tandem"), &args);
    let line = up
        .next_line(Duration::from_secs(180))
        .unwrap_or_else(|| panic!("no ready line:\n{}", up.log_tail(4000)));
    let ready = parse_ready(&line).unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    (up, ready)
}

/// A worker's `Stats`, presenting [`UP_SECRET`].
pub async fn worker_stats(worker: SocketAddr, check: bool) -> anyhow::Result<v1::StatsResponse> {
    let secret = tandem_serve::auth::Secret::new(UP_SECRET, "cluster-secret")?;
    let mut c = WorkerClient::new(channel(worker).await?);
    let req =
        tandem_serve::auth::cluster_request(Some(&secret), v1::StatsRequest { check_invariants: check });
    Ok(c.stats(req).await?.into_inner())
}

/// Live children of `parent` running worker `id` (`--worker-id <id>` on their command line; a
/// child not yet exec'd or exited and not yet reaped has none).
pub fn worker_pids(parent: i32, id: &str) -> Vec<i32> {
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

/// SIGKILL to `pid`, a live child of a `tandem up` the caller started (found by [`worker_pids`]).
pub fn sigkill(pid: i32) {
    // SAFETY: kill(2) with a pid the caller just found among its own cluster's live children:
    // it names that worker and no other process, and signals nothing else.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
}
