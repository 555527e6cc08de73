//! Who may join the cluster: a worker's record is checked for form, against the router's own
//! model, and against every registered worker before it enters the table.
//!
//! Pure functions over `WorkerInfo` records (no tokio, no tonic, no table of their own).
//!
//! Invariants:
//! - Every admitted worker serves the router's model (same protocol version and model id).
//! - Any two admitted prefill/decode workers agree on every KV field of the compatibility record,
//!   and every prefill worker shares a usable transport with every decode worker
//!   ([`common_transport`]); a refusal names both workers and, for transports, why none pairs.
//! - A prefill worker that claims to speculate has a malformed record; any other speculation
//!   record is no compatibility field (speculation changes speed, never output).

use tandem_proto::v1::{Role, TransportOffer, WorkerInfo};

use super::{describe, role_of};
use tandem_serve::identity::compat_mismatch;

/// Why a worker was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The record itself is malformed (missing id, role or address).
    #[error("{0}")]
    Invalid(String),
    /// The record is well-formed but does not fit the cluster.
    #[error("{0}")]
    Mismatch(String),
}

/// What the router itself serves.
#[derive(Debug, Clone)]
pub struct OwnModel {
    pub model_id: String,
    pub model_name: String,
}

fn describe_offers(offers: &[TransportOffer]) -> String {
    if offers.is_empty() {
        return "none".into();
    }
    let short = |s: &str, skip: usize| -> String {
        let s: String = s.chars().skip(skip).take(8).collect();
        if s.is_empty() {
            "?".into()
        } else {
            s
        }
    };
    offers
        .iter()
        .map(|o| match o.kind.as_str() {
            "shm" => format!("shm (host {})", short(&o.host_id, 0)),
            "cuda-ipc" => {
                format!("cuda-ipc (host {}, GPU {})", short(&o.host_id, 0), short(&o.device_uuid, 4))
            }
            "nccl" => format!("nccl (GPU {})", short(&o.device_uuid, 4)),
            _ => o.kind.clone(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The transport a prefill worker and a decode worker can use, as the decode worker offers it,
/// fastest first: `cuda-ipc` when both offer it on the same host and the decode worker's GPU is
/// one the prefill worker can write (its own, or one it has peer access to); `nccl` when both offer it on
/// different GPUs (NCCL cannot put both ranks of a pair on one GPU); `shm` when both offer it on
/// the same host; `nixl` when both offer it (on any hosts); else `tcp` when both offer it.
pub fn common_transport(prefill: &WorkerInfo, decode: &WorkerInfo) -> Option<TransportOffer> {
    let p_has = |kind: &str, ok: &dyn Fn(&TransportOffer) -> bool| {
        prefill.transports.iter().any(|p| p.kind == kind && ok(p))
    };
    let same_host = |d: &TransportOffer| !d.host_id.is_empty() && p_has(&d.kind, &|p| p.host_id == d.host_id);
    let pairs = |d: &TransportOffer| match d.kind.as_str() {
        "cuda-ipc" => {
            same_host(d)
                && p_has("cuda-ipc", &|p| p.host_id == d.host_id && p.writable_gpus.contains(&d.device_uuid))
        }
        "shm" => same_host(d),
        "nccl" => p_has("nccl", &|p| p.device_uuid.is_empty() || p.device_uuid != d.device_uuid),
        "nixl" => p_has("nixl", &|_| true),
        "tcp" => p_has("tcp", &|_| true),
        _ => false,
    };
    ["cuda-ipc", "nccl", "shm", "nixl", "tcp"]
        .into_iter()
        .find_map(|kind| decode.transports.iter().find(|d| d.kind == kind && pairs(d)))
        .cloned()
}

/// Why two workers share no transport.
fn transport_mismatch(prefill: &WorkerInfo, decode: &WorkerInfo) -> String {
    let both = |kind: &str| {
        prefill.transports.iter().any(|o| o.kind == kind) && decode.transports.iter().any(|o| o.kind == kind)
    };
    let mut why = Vec::new();
    if both("shm") {
        why.push("shm needs both on the same host (equal host_id)");
    }
    if both("cuda-ipc") {
        why.push(
            "cuda-ipc needs both on the same host (equal host_id) and the decode worker on a GPU the \
             prefill worker can write (its own, or one it has peer access to)",
        );
    }
    if both("nccl") {
        why.push("nccl needs the two workers on different GPUs (NCCL cannot put both ranks on one GPU)");
    }
    format!(
        "{} and {} share no KV transport: the prefill worker offers [{}], the decode worker offers [{}]{}",
        describe(prefill),
        describe(decode),
        describe_offers(&prefill.transports),
        describe_offers(&decode.transports),
        why.iter().map(|w| format!("; {w}")).collect::<String>()
    )
}

pub(super) fn validate_record(info: &WorkerInfo) -> Result<(), AdmitError> {
    let invalid = |m: String| Err(AdmitError::Invalid(m));
    if info.worker_id.trim().is_empty() {
        return invalid(format!("worker_id is empty (worker at {:?})", info.address));
    }
    let role = role_of(info);
    if role == Role::Unspecified {
        return invalid(format!("worker {}: role is unspecified (role {})", info.worker_id, info.role));
    }
    if info.address.trim().is_empty() {
        return invalid(format!("{}: address is empty", describe(info)));
    }
    if info.compat.is_none() {
        return invalid(format!("{}: compat record is missing", describe(info)));
    }
    if info.max_sequence_len == 0 {
        return invalid(format!("{}: max_sequence_len is 0", describe(info)));
    }
    if role == Role::Prefill && info.speculation.is_some() {
        return invalid(format!(
            "{}: a prefill worker never speculates, yet its record says it does",
            describe(info)
        ));
    }
    match role {
        Role::Prefill | Role::Decode if info.transports.is_empty() => {
            return invalid(format!("{}: offers no KV transport", describe(info)));
        }
        Role::Decode => {
            if let Some(o) = info.transports.iter().find(|o| o.address.is_empty()) {
                return invalid(format!("{}: its {} offer has no address", describe(info), o.kind));
            }
            if let Some(o) = info.transports.iter().find(|o| o.kind == "cuda-ipc") {
                if o.ipc_handle.len() != 64 || o.pool_blocks == 0 || o.host_id.is_empty() {
                    return invalid(format!(
                        "{}: its cuda-ipc offer lacks the pool's IPC handle (64 bytes, got {}), its block \
                         count or its host id",
                        describe(info),
                        o.ipc_handle.len()
                    ));
                }
            }
            if let Some(o) = info.transports.iter().find(|o| o.kind == "nixl") {
                if o.nixl_metadata.is_empty() {
                    return invalid(format!(
                        "{}: its nixl offer lacks the pool's NIXL registration (nixl_metadata is empty)",
                        describe(info)
                    ));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// Checks `info` against the router's model `own` and every `registered` worker (those it would
/// replace, same id or same address, are skipped: a restart may change its record).
pub(super) fn check_fit<'a>(
    own: &OwnModel,
    registered: impl Iterator<Item = &'a WorkerInfo>,
    info: &WorkerInfo,
) -> Result<(), AdmitError> {
    let mismatch = |m: String| Err(AdmitError::Mismatch(m));
    let compat = info.compat.as_ref().ok_or_else(|| AdmitError::Invalid("compat missing".into()))?;
    if compat.protocol_version != tandem_proto::PROTOCOL_VERSION {
        return mismatch(format!(
            "{} speaks protocol version {}, the router speaks {}",
            describe(info),
            compat.protocol_version,
            tandem_proto::PROTOCOL_VERSION
        ));
    }
    if compat.model_id != own.model_id {
        return mismatch(format!(
            "{} serves a different model: model_id {} ({}) vs the router's {} ({})",
            describe(info),
            compat.model_id,
            compat.model_name,
            own.model_id,
            own.model_name
        ));
    }
    let role = role_of(info);
    if role == Role::Colocated {
        return Ok(()); // moves no KV: only the model must match
    }
    for other in registered {
        if other.worker_id == info.worker_id || other.address == info.address {
            continue; // being replaced
        }
        let other_role = role_of(other);
        if other_role == Role::Colocated {
            continue;
        }
        if let Some(other_compat) = &other.compat {
            if let Some(diff) = compat_mismatch(other_compat, compat) {
                return mismatch(format!(
                    "{} does not match {}: {diff} (registered vs new)",
                    describe(info),
                    describe(other)
                ));
            }
        }
        let pair = match (role, other_role) {
            (Role::Prefill, Role::Decode) => Some((info, other)),
            (Role::Decode, Role::Prefill) => Some((other, info)),
            _ => None,
        };
        if let Some((p, d)) = pair {
            if common_transport(p, d).is_none() {
                return mismatch(transport_mismatch(p, d));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::fixtures::*;
    use crate::registry::Plan;
    use std::time::Instant;

    #[test]
    fn refuses_other_model_and_other_block_size_naming_both() {
        let mut r = registry();
        let now = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, now).unwrap();

        let mut other_model = worker("p1", Role::Prefill, 2, &[("tcp", "")]);
        other_model.compat = Some(test_compat("sha256:bbbb", 16));
        let e = r.admit(other_model, false, now).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, AdmitError::Mismatch(_)));
        assert!(m.contains("p1") && m.contains("sha256:bbbb") && m.contains(MODEL), "{m}");

        let mut other_blocks = worker("p2", Role::Prefill, 3, &[("tcp", "")]);
        other_blocks.compat = Some(test_compat(MODEL, 32));
        let m = r.admit(other_blocks, false, now).unwrap_err().to_string();
        assert!(m.contains("p2") && m.contains("d1") && m.contains("block_size: 16 vs 32"), "{m}");

        let mut other_dtype = worker("p3", Role::Prefill, 4, &[("tcp", "")]);
        let c = other_dtype.compat.as_mut().unwrap();
        c.kv_dtype = "f16".into();
        let m = r.admit(other_dtype, false, now).unwrap_err().to_string();
        assert!(m.contains("p3") && m.contains(r#"kv_dtype: "f32" vs "f16""#), "{m}");
        assert_eq!(r.entries().count(), 1);
    }

    #[test]
    fn refuses_pairs_without_a_common_transport() {
        let mut r = registry();
        let now = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("shm", "host-a")]), false, now).unwrap();
        let m = r.admit(worker("p1", Role::Prefill, 2, &[("shm", "host-b")]), false, now).unwrap_err();
        let m = m.to_string();
        assert!(m.contains("p1") && m.contains("d1") && m.contains("share no KV transport"), "{m}");
        assert!(m.contains("host_id"), "{m}");
        let m = r.admit(worker("p2", Role::Prefill, 3, &[("tcp", "")]), false, now).unwrap_err();
        assert!(m.to_string().contains("offers [tcp]"), "{m}");
        // Same host: fine, and shm is chosen.
        r.admit(worker("p3", Role::Prefill, 4, &[("tcp", ""), ("shm", "host-a")]), false, now).unwrap();
        // The other direction: a decode worker that no registered prefill worker can reach.
        let m = r.admit(worker("d2", Role::Decode, 5, &[("shm", "host-c")]), false, now).unwrap_err();
        assert!(m.to_string().contains("p3") && m.to_string().contains("d2"), "{m}");
        match r.pick(&load_only()).unwrap() {
            Plan::Split { prefill, decode, transport } => {
                assert_eq!((prefill.worker_id.as_str(), decode.worker_id.as_str()), ("p3", "d1"));
                assert_eq!(transport.kind, "shm");
                assert_eq!(transport.segment_path, "/dev/shm/x");
            }
            other => panic!("expected a split plan, got {other:?}"),
        }
    }

    #[test]
    fn tcp_when_hosts_differ() {
        let p = worker("p", Role::Prefill, 1, &[("shm", "a"), ("tcp", "")]);
        let d = worker("d", Role::Decode, 2, &[("shm", "b"), ("tcp", "")]);
        assert_eq!(common_transport(&p, &d).unwrap().kind, "tcp");
        let d_same = worker("d", Role::Decode, 2, &[("tcp", ""), ("shm", "a")]);
        assert_eq!(common_transport(&p, &d_same).unwrap().kind, "shm");
    }

    /// `--transport auto` on GPUs: cuda-ipc on one host, nccl between different GPUs elsewhere,
    /// tcp otherwise; a CPU worker never gets a GPU transport. (The offers' second field is the
    /// host for shm and cuda-ipc, the GPU for nccl.)
    #[test]
    fn gpu_transports_are_preferred_where_they_can_work() {
        let gpu_p = |host: &str, gpu: &str| {
            worker("p", Role::Prefill, 1, &[("cuda-ipc", host), ("nccl", gpu), ("shm", host), ("tcp", "")])
        };
        let gpu_d = |host: &str, gpu: &str| {
            worker("d", Role::Decode, 2, &[("cuda-ipc", host), ("nccl", gpu), ("tcp", "")])
        };
        // Same host: cuda-ipc, whatever the GPUs; the destination carries the pool's handle.
        let t = common_transport(&gpu_p("h", "g0"), &gpu_d("h", "g1")).unwrap();
        assert_eq!((t.kind.as_str(), t.ipc_handle.len(), t.pool_blocks), ("cuda-ipc", 64, 64));
        assert_eq!(common_transport(&gpu_p("h", "g0"), &gpu_d("h", "g0")).unwrap().kind, "cuda-ipc");
        // The same host, but the decode worker's GPU is not one the prefill worker can write (no
        // peer access, or not visible to it): nccl between the two GPUs instead.
        let mut no_peer = gpu_p("h", "g0");
        no_peer.transports[0].writable_gpus = vec!["GPU-other".into()];
        assert_eq!(common_transport(&no_peer, &gpu_d("h", "g1")).unwrap().kind, "nccl");
        // Other hosts: nccl between different GPUs.
        assert_eq!(common_transport(&gpu_p("h1", "g0"), &gpu_d("h2", "g1")).unwrap().kind, "nccl");
        // The same GPU on another host cannot happen, but a record saying so gets tcp, not nccl.
        assert_eq!(common_transport(&gpu_p("h1", "g0"), &gpu_d("h2", "g0")).unwrap().kind, "tcp");
        // A CPU prefill worker (shm, tcp) and a GPU decode worker on one host: tcp.
        let cpu_p = worker("p", Role::Prefill, 1, &[("shm", "h"), ("tcp", "")]);
        assert_eq!(common_transport(&cpu_p, &gpu_d("h", "g1")).unwrap().kind, "tcp");
        // Forced GPU transports that cannot pair are refused at registration, naming why.
        let mut r = registry();
        let now = Instant::now();
        r.admit(worker("d1", Role::Decode, 3, &[("nccl", "g0")]), false, now).unwrap();
        let m =
            r.admit(worker("p1", Role::Prefill, 4, &[("nccl", "g0")]), false, now).unwrap_err().to_string();
        assert!(m.contains("share no KV transport") && m.contains("cannot put both ranks on one GPU"), "{m}");
        let mut r = registry();
        r.admit(worker("d1", Role::Decode, 3, &[("cuda-ipc", "h1")]), false, now).unwrap();
        let m = r
            .admit(worker("p1", Role::Prefill, 4, &[("cuda-ipc", "h2")]), false, now)
            .unwrap_err()
            .to_string();
        assert!(m.contains("cuda-ipc needs both on the same host") && m.contains("cuda-ipc (host h1"), "{m}");
        // A cuda-ipc offer without the pool's handle is malformed.
        let mut d = worker("d2", Role::Decode, 5, &[("cuda-ipc", "h1")]);
        d.transports[0].ipc_handle.clear();
        let m = r.admit(d, false, now).unwrap_err();
        assert!(matches!(&m, AdmitError::Invalid(s) if s.contains("IPC handle")), "{m}");
    }

    /// nixl pairs a prefill and a decode worker on any hosts, after the same-host kinds and
    /// before tcp; a decode worker's nixl offer must carry its pool's registration.
    #[test]
    fn nixl_pairs_across_hosts_and_needs_the_registration() {
        let p = worker("p", Role::Prefill, 1, &[("shm", "a"), ("nixl", ""), ("tcp", "")]);
        let d = worker("d", Role::Decode, 2, &[("shm", "b"), ("nixl", ""), ("tcp", "")]);
        let t = common_transport(&p, &d).unwrap();
        assert_eq!(t.kind, "nixl");
        assert!(!t.nixl_metadata.is_empty(), "the destination carries the decode worker's registration");
        let d_same = worker("d", Role::Decode, 2, &[("shm", "a"), ("nixl", ""), ("tcp", "")]);
        assert_eq!(common_transport(&p, &d_same).unwrap().kind, "shm");
        let p_tcp = worker("p", Role::Prefill, 1, &[("tcp", "")]);
        assert_eq!(common_transport(&p_tcp, &d).unwrap().kind, "tcp");

        let mut r = registry();
        let now = Instant::now();
        let mut d1 = worker("d1", Role::Decode, 3, &[("nixl", ""), ("tcp", "")]);
        d1.transports[0].nixl_metadata.clear();
        let e = r.admit(d1, false, now).unwrap_err();
        assert!(matches!(e, AdmitError::Invalid(_)), "{e}");
        let m = e.to_string();
        assert!(m.contains("d1") && m.contains("nixl offer") && m.contains("nixl_metadata"), "{m}");
        assert_eq!(r.entries().count(), 0);
        // A prefill worker's nixl offer carries no registration, and needs none.
        r.admit(worker("d1", Role::Decode, 3, &[("nixl", "")]), false, now).unwrap();
        r.admit(worker("p1", Role::Prefill, 4, &[("nixl", "")]), false, now).unwrap();
        assert!(r.get("p1").unwrap().info.transports[0].nixl_metadata.is_empty());
    }

    #[test]
    fn malformed_records_are_invalid() {
        let mut r = registry();
        let now = Instant::now();
        let mut w = worker("", Role::Decode, 1, &[("tcp", "")]);
        assert!(
            matches!(r.admit(w.clone(), false, now), Err(AdmitError::Invalid(m)) if m.contains("worker_id"))
        );
        w.worker_id = "d".into();
        w.role = 0;
        assert!(matches!(r.admit(w.clone(), false, now), Err(AdmitError::Invalid(m)) if m.contains("role")));
        w.role = Role::Decode as i32;
        w.transports.clear();
        assert!(
            matches!(r.admit(w.clone(), false, now), Err(AdmitError::Invalid(m)) if m.contains("transport"))
        );
    }

    #[test]
    fn speculation_records_are_listed_and_pair_with_plain_workers() {
        let mut r = registry();
        let now = Instant::now();
        let spec = tandem_proto::v1::SpeculationInfo {
            method: "ngram".into(),
            max_draft: 4,
            adaptive: true,
            drafter: "ngram 2..4".into(),
        };
        let mut d1 = worker("d1", Role::Decode, 1, &[("tcp", "")]);
        d1.speculation = Some(spec.clone());
        r.admit(d1, false, now).unwrap();
        // A decode worker without speculation, and a prefill worker, pair with it as before.
        r.admit(worker("d2", Role::Decode, 2, &[("tcp", "")]), false, now).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, now).unwrap();
        let listed: Vec<_> = r.summaries().into_iter().map(|s| (s.worker_id, s.speculation)).collect();
        assert_eq!(listed, vec![("d1".into(), Some(spec.clone())), ("d2".into(), None), ("p1".into(), None)]);
        // A prefill worker that claims to speculate has a malformed record.
        let mut p2 = worker("p2", Role::Prefill, 4, &[("tcp", "")]);
        p2.speculation = Some(spec);
        let e = r.admit(p2, false, now).unwrap_err();
        assert!(
            matches!(&e, AdmitError::Invalid(m) if m.contains("p2") && m.contains("never speculates")),
            "{e}"
        );
    }
}
