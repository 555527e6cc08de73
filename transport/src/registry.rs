//! The one place that lists the transport kinds: each [`TransportKind`] maps to its module's
//! [`Registration`] (name, HELLO code, and how its sender and receiver halves are built).
//!
//! Adding a kind: write its module (both halves, see [`crate::kind`]), add its variant to
//! [`TransportKind`] (and its place in [`TransportKind::ALL`], fastest first), and add its line
//! to the match below; the compiler points at the match until the line is there.

use crate::kind::Registration;
use crate::{cuda_ipc, nccl, nixl, shm, tcp, TransportKind};

/// The registration of `kind`.
pub(crate) fn registration(kind: TransportKind) -> &'static Registration {
    match kind {
        TransportKind::CudaIpc => &cuda_ipc::KIND,
        TransportKind::Nccl => &nccl::KIND,
        TransportKind::Nixl => &nixl::KIND,
        TransportKind::Shm => &shm::KIND,
        TransportKind::Tcp => &tcp::KIND,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_wire_codes_are_distinct_and_fixed() {
        let named: Vec<(&str, u8)> =
            TransportKind::ALL.iter().map(|&k| (registration(k).name, registration(k).wire_code)).collect();
        // The codes are part of the KV wire format: they never change.
        assert_eq!(named, [("cuda-ipc", 3), ("nccl", 4), ("shm", 2), ("nixl", 5), ("tcp", 1)]);
        for k in TransportKind::ALL {
            assert_eq!(TransportKind::from_wire_code(k.wire_code()), Some(k));
            assert_eq!(k.as_str().parse::<TransportKind>().unwrap(), k);
        }
        assert_eq!(TransportKind::from_wire_code(0), None);
    }

    #[test]
    fn only_the_mapping_kinds_write_directly_and_only_gpu_kinds_need_a_gpu() {
        let direct: Vec<_> = TransportKind::ALL.into_iter().filter(|k| k.writes_directly()).collect();
        assert_eq!(direct, [TransportKind::CudaIpc, TransportKind::Shm, TransportKind::Nixl]);
        let gpu: Vec<_> = TransportKind::ALL.into_iter().filter(|k| k.needs_gpu()).collect();
        assert_eq!(gpu, [TransportKind::CudaIpc, TransportKind::Nccl]);
    }
}
