//! The KV transport's types at the worker's wire edge: a destination, an offer and transfer
//! counters, converted between the transport's plain Rust structs and their protobuf messages.
//!
//! The transport crate knows no protobuf; the worker services and their registration speak it.
//! Both types being foreign here, the orphan rule rules out `From` impls, so these are functions.
//! Each conversion copies every field the message has: a field added to one side and not the
//! other is a compile error in the struct literal below, not a silent loss.

use tandem_proto::v1;
use tandem_transport::{KvDestination, TransferCounters, TransportError, TransportKind, TransportOffer};

/// A `KvDestination` from the wire; an unknown transport name is an error naming it.
pub fn destination_from_wire(d: &v1::KvDestination) -> Result<KvDestination, TransportError> {
    Ok(KvDestination {
        worker_id: d.worker_id.clone(),
        transport: d.transport.parse()?,
        address: d.address.clone(),
        segment_path: d.segment_path.clone(),
        reservation_id: d.reservation_id,
        block_ids: d.block_ids.clone(),
        skip_blocks: d.skip_blocks,
        ipc_handle: d.ipc_handle.clone(),
        pool_blocks: d.pool_blocks,
        device_uuid: d.device_uuid.clone(),
        nixl_metadata: d.nixl_metadata.clone(),
    })
}

/// A `KvDestination` for the wire.
pub fn destination_to_wire(d: &KvDestination) -> v1::KvDestination {
    v1::KvDestination {
        worker_id: d.worker_id.clone(),
        transport: d.transport.as_str().into(),
        address: d.address.clone(),
        segment_path: d.segment_path.clone(),
        reservation_id: d.reservation_id,
        block_ids: d.block_ids.clone(),
        skip_blocks: d.skip_blocks,
        ipc_handle: d.ipc_handle.clone(),
        pool_blocks: d.pool_blocks,
        device_uuid: d.device_uuid.clone(),
        nixl_metadata: d.nixl_metadata.clone(),
    }
}

/// A `TransportOffer` for the wire (a worker's registration record).
pub fn offer_to_wire(o: &TransportOffer) -> v1::TransportOffer {
    v1::TransportOffer {
        kind: o.kind.as_str().into(),
        address: o.address.clone(),
        segment_path: o.segment_path.clone(),
        host_id: o.host_id.clone(),
        ipc_handle: o.ipc_handle.clone(),
        device_uuid: o.device_uuid.clone(),
        pool_blocks: o.pool_blocks,
        writable_gpus: o.writable_gpus.clone(),
        nixl_metadata: o.nixl_metadata.clone(),
    }
}

/// A `TransportOffer` from the wire; an unknown kind is an error naming it.
pub fn offer_from_wire(o: &v1::TransportOffer) -> Result<TransportOffer, TransportError> {
    Ok(TransportOffer {
        kind: o.kind.parse::<TransportKind>()?,
        address: o.address.clone(),
        segment_path: o.segment_path.clone(),
        host_id: o.host_id.clone(),
        ipc_handle: o.ipc_handle.clone(),
        device_uuid: o.device_uuid.clone(),
        pool_blocks: o.pool_blocks,
        writable_gpus: o.writable_gpus.clone(),
        nixl_metadata: o.nixl_metadata.clone(),
    })
}

/// `TransferCounters` for the wire (a worker's stats).
pub fn counters_to_wire(c: &TransferCounters) -> v1::TransferCounters {
    v1::TransferCounters {
        transfers: c.transfers,
        bytes: c.bytes,
        seconds: c.seconds,
        failures: c.failures,
        checksum_failures: c.checksum_failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_survives_the_wire_both_ways() {
        let d = KvDestination {
            worker_id: "d1".into(),
            transport: TransportKind::CudaIpc,
            address: "10.0.0.2:7000".into(),
            segment_path: "/dev/shm/x".into(),
            reservation_id: 42,
            block_ids: vec![3, 1, 4],
            skip_blocks: 2,
            ipc_handle: vec![9; 64],
            pool_blocks: 128,
            device_uuid: "GPU-1".into(),
            nixl_metadata: vec![5, 6, 7],
        };
        let w = destination_to_wire(&d);
        assert_eq!(w.transport, "cuda-ipc");
        assert_eq!(destination_from_wire(&w).unwrap(), d);
    }

    #[test]
    fn an_offer_survives_the_wire_both_ways() {
        let o = TransportOffer {
            kind: TransportKind::Shm,
            address: "127.0.0.1:9".into(),
            segment_path: "/dev/shm/pool".into(),
            host_id: "boot/shm-dev-1".into(),
            ipc_handle: vec![1, 2],
            device_uuid: "GPU-2".into(),
            pool_blocks: 7,
            writable_gpus: vec!["GPU-2".into(), "GPU-3".into()],
            nixl_metadata: vec![8, 9],
        };
        let w = offer_to_wire(&o);
        assert_eq!(w.kind, "shm");
        assert_eq!(offer_from_wire(&w).unwrap(), o);
    }

    #[test]
    fn unknown_transport_names_are_refused_by_name() {
        let w = v1::KvDestination { transport: "carrier-pigeon".into(), ..Default::default() };
        let e = destination_from_wire(&w).unwrap_err();
        assert!(e.to_string().contains("carrier-pigeon"), "{e}");
        let o = v1::TransportOffer { kind: "smoke".into(), ..Default::default() };
        assert!(offer_from_wire(&o).unwrap_err().to_string().contains("smoke"));
    }

    #[test]
    fn counters_keep_every_field() {
        let c = TransferCounters { transfers: 1, bytes: 2, seconds: 0.5, failures: 3, checksum_failures: 4 };
        let w = counters_to_wire(&c);
        assert_eq!((w.transfers, w.bytes, w.seconds, w.failures, w.checksum_failures), (1, 2, 0.5, 3, 4));
    }
}
