//! A forward-proxy client: CONNECT through promptgate, then (optionally) TLS inside
//! the tunnel trusting only a given CA — what an agent with HTTPS_PROXY does.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The proxy's answer to a CONNECT, and the socket (the tunnel when it is 200).
pub struct Connected {
    pub status: u16,
    pub head: String,
    pub stream: TcpStream,
}

/// Sends `CONNECT authority` with `headers`, reads the answer's head byte by byte
/// (so nothing of the tunnel is consumed).
pub async fn connect(proxy: SocketAddr, authority: &str, headers: &[(&str, &str)]) -> Connected {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let mut request = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        if stream.read(&mut byte).await.unwrap() == 0 {
            break;
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Connected {
        status,
        head,
        stream,
    }
}

/// A TLS client that trusts only the PEM certificate(s) at `ca`, offering `alpn`.
pub fn client_config(ca: &Path, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// TLS handshake with `host` over an open tunnel.
pub async fn handshake(
    stream: TcpStream,
    host: &str,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let name = ServerName::try_from(host.to_owned()).unwrap();
    tokio_rustls::TlsConnector::from(config)
        .connect(name, stream)
        .await
}
