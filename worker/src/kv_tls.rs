//! The KV plane's TLS: the transport asks for the current configurations on every connection
//! ([`tandem_transport::KvServerTls`], [`tandem_transport::KvClientTls`]), and a worker answers
//! from its reloadable [`Tls`] (the KV port's server configuration, the KV client configuration),
//! so a certificate reloaded on SIGHUP is used by the next transfer.

use std::sync::Arc;

use rustls::{ClientConfig, ServerConfig};
use tandem_serve::tls::{Port, Tls};

/// A worker's TLS, as the KV transport sees it.
#[derive(Clone)]
pub struct KvTls(pub Arc<Tls>);

impl std::fmt::Debug for KvTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvTls(..)")
    }
}

impl tandem_transport::KvServerTls for KvTls {
    fn server_config(&self) -> Arc<ServerConfig> {
        self.0.server(Port::Kv)
    }
}

impl tandem_transport::KvClientTls for KvTls {
    fn client_config(&self) -> Arc<ClientConfig> {
        self.0.client_kv()
    }
}
