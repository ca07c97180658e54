//! TLS between trainer ranks and workers (docs/security.md).
//!
//! A worker serves with a certificate for its names ([`ServerTls`]); a rank trusts a CA bundle
//! and checks the worker's name in the handshake, before the pipeline token leaves it
//! ([`ClientTls`]). TLS 1.3 only (both ends are ours), rustls with ring; nothing here is
//! cryptography of our own. Plaintext is a value of its own ([`Dial::InsecurePlaintext`]), never
//! what happens when certificates are missing. With the `issue` feature, [`issue`] makes the
//! certificates.

#![forbid(unsafe_code)]

#[cfg(feature = "issue")]
pub mod issue;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, BufReader, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// TCP keepalive on every link, at both ends: a peer gone without a FIN or RST (its node lost,
/// a partition) is noticed by the end waiting to read after this much silence plus
/// [`KEEPALIVE_PROBES`] unanswered probes [`KEEPALIVE_INTERVAL`] apart: 30 s in all.
pub const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(15);
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);
pub const KEEPALIVE_PROBES: u32 = 3;
/// A rank's link fails when bytes it sent stay unacknowledged this long (TCP_USER_TIMEOUT):
/// keepalive probes only an idle socket, so without it a worker gone silent while a request
/// was on the way held the link until the kernel's retransmissions gave up (~15 min, Linux's
/// `tcp_retries2`). Ranks only: their requests are small, and a worker's link to a rank that
/// stops reading ends by the worker's send timeout instead.
pub const USER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// What every link's socket needs, at both ends: no Nagle delay (requests are tiny and wait on
/// their answers) and keepalive.
pub fn tune_link_socket(tcp: &TcpStream) -> io::Result<()> {
    tcp.set_nodelay(true)?;
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    socket2::SockRef::from(tcp).set_tcp_keepalive(&keepalive)
}

/// A PEM file larger than this is refused before it is read (a bundle holds a few
/// certificates of ~1 KiB).
const MAX_PEM_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("{what}: {why}")]
    Invalid { what: String, why: String },
}

fn invalid(what: &str, why: impl std::fmt::Display) -> TlsError {
    TlsError::Invalid {
        what: what.into(),
        why: why.to_string(),
    }
}

/// Reads a PEM file whole, refusing one past [`MAX_PEM_BYTES`] by its length.
pub fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    let err = |source| TlsError::Read {
        path: path.display().to_string(),
        source,
    };
    let len = std::fs::metadata(path).map_err(err)?.len();
    if len > MAX_PEM_BYTES {
        return Err(invalid(
            &path.display().to_string(),
            format!("{len} bytes, more than the {MAX_PEM_BYTES} a PEM file may hold"),
        ));
    }
    std::fs::read(path).map_err(err)
}

/// Every certificate in `pem`; none is an error.
fn certificates(what: &str, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(what, e))?;
    if certs.is_empty() {
        return Err(invalid(what, "no PEM CERTIFICATE in it"));
    }
    Ok(certs)
}

/// ring, as kube's client uses: no C toolchain beyond ring's for the Python extension.
/// (rustls 0.23.48 deprecates it for want of post-quantum key exchange; a link between a
/// rank and a worker of one job carries nothing that must stay secret for decades.)
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What a rank trusts, and the name every worker must prove.
#[derive(Clone)]
pub struct ClientTls {
    connector: TlsConnector,
    server_name: Option<ServerName<'static>>,
}

impl ClientTls {
    /// Trusts the certificates of `pem` (a CA bundle) and nothing else.
    pub fn from_ca_pem(pem: &[u8]) -> Result<Self, TlsError> {
        let mut roots = RootCertStore::empty();
        for cert in certificates("the CA bundle", pem)? {
            roots
                .add(cert)
                .map_err(|e| invalid("a certificate of the CA bundle", e))?;
        }
        let config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| invalid("TLS client", e))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(ClientTls {
            connector: TlsConnector::from(Arc::new(config)),
            server_name: None,
        })
    }

    /// [`ClientTls::from_ca_pem`] of the file at `path`.
    pub fn from_ca_file(path: impl AsRef<Path>) -> Result<Self, TlsError> {
        let path = path.as_ref();
        Self::from_ca_pem(&read_pem(path)?).map_err(|e| match e {
            TlsError::Invalid { what, why } => invalid(&format!("{what} {}", path.display()), why),
            e => e,
        })
    }

    /// The name every worker's certificate must hold, whatever address is dialled: a headless
    /// Service's name while its pods are dialled by IP. Without one, the dialled host.
    pub fn with_server_name(mut self, name: &str) -> Result<Self, TlsError> {
        self.server_name = Some(server_name(name)?);
        Ok(self)
    }

    pub fn has_server_name(&self) -> bool {
        self.server_name.is_some()
    }

    /// The TLS handshake over `tcp`, checking the worker's certificate for the server name
    /// (else `host`); nothing of the caller's is sent before it succeeds.
    pub async fn connect(&self, host: &str, tcp: TcpStream) -> io::Result<Stream> {
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => {
                server_name(host).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?
            }
        };
        let shown = name.to_str().into_owned();
        let wire = BufReader::with_capacity(RANK_READ_BUFFER, tcp);
        let stream = self.connector.connect(name, wire).await.map_err(|e| {
            io::Error::new(e.kind(), format!("TLS with the worker as {shown}: {e}"))
        })?;
        Ok(Stream::Tls(Box::new(stream.into())))
    }
}

fn server_name(name: &str) -> Result<ServerName<'static>, TlsError> {
    let bare = name.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(bare.to_string()).map_err(|e| invalid(&format!("server name {name:?}"), e))
}

/// A worker's certificate chain and key.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: TlsAcceptor,
}

impl ServerTls {
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<Self, TlsError> {
        let chain = certificates("the worker certificate", cert_pem)?;
        let key = PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|e| invalid("the worker's private key", e))?;
        let config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| invalid("TLS server", e))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| invalid("the worker certificate and key", e))?;
        Ok(ServerTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    pub fn from_files(cert: impl AsRef<Path>, key: impl AsRef<Path>) -> Result<Self, TlsError> {
        let (cert, key) = (cert.as_ref(), key.as_ref());
        Self::from_pem(&read_pem(cert)?, &read_pem(key)?).map_err(|e| match e {
            TlsError::Invalid { what, why } => invalid(
                &format!("{what} ({}, {})", cert.display(), key.display()),
                why,
            ),
            e => e,
        })
    }

    /// The server side of the handshake (the caller bounds it in time).
    pub async fn accept(&self, tcp: TcpStream) -> io::Result<Stream> {
        let wire = BufReader::with_capacity(WORKER_READ_BUFFER, tcp);
        let stream = self.acceptor.accept(wire).await?;
        Ok(Stream::Tls(Box::new(stream.into())))
    }
}

/// How a rank dials workers.
#[derive(Clone)]
pub enum Dial {
    Tls(ClientTls),
    /// Only when asked for by name (`--insecure-plaintext`, `insecure_plaintext=True`): the
    /// token travels in the clear and any listener can pose as a worker.
    InsecurePlaintext,
}

impl Dial {
    /// Connects to `addr` (`host:port`), tuned as every link ([`tune_link_socket`]), then
    /// TLS where asked.
    pub async fn connect(&self, addr: &str) -> io::Result<Stream> {
        let tcp = TcpStream::connect(addr).await?;
        tune_link_socket(&tcp)?;
        socket2::SockRef::from(&tcp).set_tcp_user_timeout(Some(USER_TIMEOUT))?;
        match self {
            Dial::InsecurePlaintext => Ok(Stream::Plain(tcp)),
            Dial::Tls(tls) => {
                let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
                tls.connect(host, tcp).await
            }
        }
    }
}

/// How a worker serves.
#[derive(Clone)]
pub enum Serve {
    Tls(ServerTls),
    InsecurePlaintext,
}

impl Serve {
    pub async fn accept(&self, tcp: TcpStream) -> io::Result<Stream> {
        match self {
            Serve::InsecurePlaintext => Ok(Stream::Plain(tcp)),
            Serve::Tls(tls) => tls.accept(tcp).await,
        }
    }
}

/// A connection between a rank and a worker, in TLS or (asked for) plaintext.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<Wire>>),
}

/// What TLS runs over: rustls reads the socket 4 KiB at a time, so a rank receiving batches of
/// megabytes would make a system call per 4 KiB; a read buffer under it makes one per
/// [`RANK_READ_BUFFER`]. A worker reads only small requests: one record's worth suffices, and it
/// holds one per connection.
type Wire = BufReader<TcpStream>;
const RANK_READ_BUFFER: usize = 256 << 10;
const WORKER_READ_BUFFER: usize = 17 << 10;

impl Stream {
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ends of a link are tuned alike: a rank's dial, and a socket a worker accepted.
    #[tokio::test]
    async fn links_keep_alive_without_delay_at_both_ends() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (dialled, accepted) =
            tokio::join!(Dial::InsecurePlaintext.connect(&addr), listener.accept());
        let Stream::Plain(dialled) = dialled.unwrap() else {
            panic!("plaintext was asked for")
        };
        let (accepted, _) = accepted.unwrap();
        tune_link_socket(&accepted).unwrap();
        for tcp in [&dialled, &accepted] {
            let s = socket2::SockRef::from(tcp);
            assert!(s.keepalive().unwrap());
            assert_eq!(s.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
            assert_eq!(s.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
            assert_eq!(s.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
            assert!(tcp.nodelay().unwrap());
        }
        let user_timeout = |tcp| socket2::SockRef::from(tcp).tcp_user_timeout().unwrap();
        assert_eq!(user_timeout(&dialled), Some(USER_TIMEOUT), "the rank's end");
        assert_eq!(user_timeout(&accepted), None, "the worker's end");
    }
}
