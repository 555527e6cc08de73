//! What a worker knows of its requests in flight: their ids, so `Release(request_id)` finds the
//! work to cancel, and their number, so a drain knows when it is done.
//!
//! Both are kept by guards: an entry and a count exist exactly while the guard a handler or
//! response stream holds is alive, whatever way the request ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tonic::Status;

use crate::engine_thread::{EngineHandle, Ticket};

/// Request ids of work in flight, for `Release(request_id)`.
#[derive(Default)]
pub struct RequestTable {
    map: Mutex<HashMap<String, Ticket>>,
}

impl RequestTable {
    /// Records `request_id` → `ticket`; the returned guard forgets it again.
    pub fn insert(self: &Arc<Self>, request_id: &str, ticket: Ticket) -> RequestEntry {
        if !request_id.is_empty() {
            self.lock().insert(request_id.to_owned(), ticket);
        }
        RequestEntry { table: self.clone(), request_id: request_id.to_owned(), ticket }
    }

    /// The ticket of `request_id`'s work in flight.
    pub fn get(&self, request_id: &str) -> Option<Ticket> {
        self.lock().get(request_id).copied()
    }

    /// `Release(request_id)`: cancels `request_id`'s work in flight on `engine`, if there is
    /// any, and says whether there was.
    pub fn cancel(&self, request_id: &str, engine: &EngineHandle) -> bool {
        let Some(ticket) = self.get(request_id) else { return false };
        engine.cancel(ticket, Status::cancelled(format!("request {request_id} was released")));
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Ticket>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Removes a request id from its [`RequestTable`] when dropped.
pub struct RequestEntry {
    table: Arc<RequestTable>,
    request_id: String,
    ticket: Ticket,
}

impl Drop for RequestEntry {
    fn drop(&mut self) {
        let mut m = self.table.lock();
        if m.get(&self.request_id) == Some(&self.ticket) {
            m.remove(&self.request_id);
        }
    }
}

/// Counts a request in flight (for the drain) while alive.
pub struct InflightGuard {
    count: Arc<AtomicUsize>,
}

impl InflightGuard {
    /// Counts one more request in `count` until the guard drops.
    pub fn new(count: Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        InflightGuard { count }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
    }
}
