//! The session layer, written once for every kind: a transfer is one connection from P to D's
//! KV listener, opened before the prompt is computed.
//!
//! - [`send`] (P): connect (TLS when configured), preamble and HELLO, wait until D pinned the
//!   reservation, keep-alives while the prompt is computed, hand staging to the kind, DONE and
//!   the acknowledgement, one retry when the kind says the peer lost cached state.
//! - [`receive`] (D): accept, TLS, preamble and HELLO, the token checked before anything else,
//!   the layout checked by name, the reservation pinned through the
//!   [`ReservationGate`](crate::ReservationGate), the HELLO's LoRA adapter id checked against
//!   the reservation's ([`ReservationGate::adapter_id`](crate::ReservationGate::adapter_id)),
//!   the kind's data frames under the inactivity
//!   timeout and the session deadline, verification, complete and ACK, or ERROR (refusal by
//!   name) and abort, exactly once.
//!
//! What differs by kind is behind [`crate::kind`]'s trait pair; this layer names no kind, it finds
//! each kind's halves through the registry.

mod receive;
mod send;

pub use receive::KvReceiver;
pub use send::{KvSender, TransferReport, TransferSession};
