//! The byte stream of a tcp KV transfer: a plain TCP socket, or TLS over it.
//!
//! The plain halves are tokio's owned TCP halves, untouched, so the receiver keeps its vectored
//! reads straight into the pool. TLS halves are the two sides of a split rustls stream; the
//! receiver reads them with ordinary reads (records must be decrypted anyway).
//!
//! The transport does not load certificates: a server or client configuration comes from a
//! [`KvServerTls`] / [`KvClientTls`] asked once per connection, so a source that swaps its
//! configuration (a certificate reload) takes effect from the next transfer on.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// The KV listener's TLS: the server configuration for a new connection. It decides whether
/// client certificates are required (mutual TLS).
pub trait KvServerTls: Send + Sync + 'static {
    /// The configuration for the next handshake.
    fn server_config(&self) -> Arc<rustls::ServerConfig>;
}

/// A KV sender's TLS: the client configuration for a new connection (the CA that verifies the
/// receiver, and the certificate presented under mutual TLS).
pub trait KvClientTls: Send + Sync + 'static {
    /// The configuration for the next handshake.
    fn client_config(&self) -> Arc<rustls::ClientConfig>;
}

impl std::fmt::Debug for dyn KvServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvServerTls")
    }
}

impl std::fmt::Debug for dyn KvClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvClientTls")
    }
}

/// A fixed configuration (tests, or a caller that never reloads): cloned per connection, which
/// copies a few `Arc`s.
impl KvServerTls for rustls::ServerConfig {
    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        Arc::new(self.clone())
    }
}

impl KvClientTls for rustls::ClientConfig {
    fn client_config(&self) -> Arc<rustls::ClientConfig> {
        Arc::new(self.clone())
    }
}

type Tls = tokio_rustls::TlsStream<TcpStream>;

/// The read side of a connection.
pub(crate) enum KvRead {
    Plain(OwnedReadHalf),
    Tls(tokio::io::ReadHalf<Tls>),
}

/// The write side of a connection.
pub(crate) enum KvWrite {
    Plain(OwnedWriteHalf),
    Tls(tokio::io::WriteHalf<Tls>),
}

/// Splits a plain socket.
pub(crate) fn split_plain(s: TcpStream) -> (KvRead, KvWrite) {
    let (r, w) = s.into_split();
    (KvRead::Plain(r), KvWrite::Plain(w))
}

/// Splits a TLS stream.
pub(crate) fn split_tls(s: Tls) -> (KvRead, KvWrite) {
    let (r, w) = tokio::io::split(s);
    (KvRead::Tls(r), KvWrite::Tls(w))
}

impl AsyncRead for KvRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            KvRead::Plain(r) => Pin::new(r).poll_read(cx, buf),
            KvRead::Tls(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for KvWrite {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            KvWrite::Plain(w) => Pin::new(w).poll_write(cx, buf),
            KvWrite::Tls(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            KvWrite::Plain(w) => Pin::new(w).poll_flush(cx),
            KvWrite::Tls(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            KvWrite::Plain(w) => Pin::new(w).poll_shutdown(cx),
            KvWrite::Tls(w) => Pin::new(w).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            KvWrite::Plain(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            KvWrite::Tls(w) => Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            KvWrite::Plain(w) => w.is_write_vectored(),
            KvWrite::Tls(w) => w.is_write_vectored(),
        }
    }
}
