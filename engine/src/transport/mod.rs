//! KV transports: move a sequence's KV blocks from a prefill worker's pool into blocks a decode
//! worker reserved, and say when they have arrived intact.
