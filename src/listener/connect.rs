//! Forward-proxy requests: CONNECT tunnels and absolute-form `http://` requests.
//!
//! A CONNECT to an intercepted host is answered 200, then TLS is terminated with a
//! leaf from the CA and every request inside (HTTP/1.1 or HTTP/2 by ALPN) goes to
//! [`Proxy::handle`] with a [`Target`] taken from the CONNECT authority. Other hosts
//! get a blind TCP tunnel, or a refusal with `--intercept-only`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::Authority;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::{Front, connection_builder, own_response};
use crate::error::error_chain;
use crate::exchange::{ProxyBody, Target};
use crate::provider::Provider;
use crate::record::Mode;

/// Time a client gets to finish the TLS handshake inside its tunnel.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// A CONNECT request that passed the port check: what the client asked to reach.
struct Connect {
    request: Request<Incoming>,
    peer: SocketAddr,
    authority: Authority,
    /// The authority's host, without IPv6 brackets.
    host: String,
    port: u16,
}

/// Answers a CONNECT: intercept, tunnel blind, or refuse.
pub(super) async fn tunnel(
    front: Arc<Front>,
    request: Request<Incoming>,
    peer: SocketAddr,
) -> Response<ProxyBody> {
    let config = &front.config;
    let Some(authority) = request.uri().authority().cloned() else {
        return refuse(
            peer,
            "-",
            StatusCode::BAD_REQUEST,
            "CONNECT needs HOST:PORT".into(),
        );
    };
    let Some(port) = authority.port_u16() else {
        return refuse(
            peer,
            authority.as_str(),
            StatusCode::BAD_REQUEST,
            "CONNECT needs HOST:PORT".into(),
        );
    };
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    if !config.connect_ports.contains(&port) {
        return refuse(
            peer,
            authority.as_str(),
            StatusCode::FORBIDDEN,
            format!(
                "CONNECT to port {port} is not allowed (allowed: {:?}; see connect_ports)",
                config.connect_ports
            ),
        );
    }
    let connect = Connect {
        request,
        peer,
        authority,
        host,
        port,
    };
    let counts = &front.counts;
    match config.intercept.provider_for(&connect.host) {
        Some(provider) => {
            counts.intercepted.fetch_add(1, Ordering::Relaxed);
            intercept(front, connect, provider).await
        }
        None if config.intercept_only => refuse(
            peer,
            connect.authority.as_str(),
            StatusCode::FORBIDDEN,
            format!(
                "{} is not intercepted and --intercept-only is set (intercepted: {})",
                connect.host,
                config.intercept.patterns().join(", ")
            ),
        ),
        None => {
            counts.tunnelled.fetch_add(1, Ordering::Relaxed);
            blind(front, connect).await
        }
    }
}

/// Terminates TLS for an intercepted host and serves the requests inside.
async fn intercept(front: Arc<Front>, connect: Connect, provider: Provider) -> Response<ProxyBody> {
    let Connect {
        request,
        peer,
        authority,
        host,
        port,
    } = connect;
    // The CA is made on the first CONNECT that needs it.
    let leaves = match &front.leaves {
        Some(interception) => interception.leaves().await,
        None => None,
    };
    let Some(leaves) = leaves else {
        return refuse(
            peer,
            authority.as_str(),
            StatusCode::BAD_GATEWAY,
            "promptgate has no usable CA, so it cannot intercept (see its log)".into(),
        );
    };
    let upstream = match front.config.upstream_for(&host, port, "https") {
        Ok(url) => url,
        Err(e) => {
            return refuse(
                peer,
                authority.as_str(),
                StatusCode::BAD_REQUEST,
                e.to_string(),
            );
        }
    };
    // Minted before the 200, so a failure is still a proper answer to the CONNECT.
    let tls_config = match leaves.server_config(&host).await {
        Ok(c) => c,
        Err(e) => {
            return refuse(
                peer,
                authority.as_str(),
                StatusCode::BAD_GATEWAY,
                e.to_string(),
            );
        }
    };
    let target = Target {
        provider,
        upstream,
        mode: Mode::Forward,
        host: authority.to_string(),
    };
    tokio::spawn(async move {
        let upgraded = match hyper::upgrade::on(request).await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(client = %peer, "CONNECT {} upgrade failed: {e}", target.host);
                return;
            }
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(tls_config);
        let accepted =
            tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(TokioIo::new(upgraded))).await;
        let tls = match accepted {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::warn!(
                    client = %peer,
                    host = %target.host,
                    "TLS handshake inside CONNECT failed: {}",
                    handshake_hint(&e, leaves.ca().cert_path())
                );
                return;
            }
            Err(_) => {
                tracing::warn!(client = %peer, host = %target.host, "TLS handshake inside CONNECT timed out");
                return;
            }
        };
        let proxy = front.proxy.clone();
        let service = service_fn(move |mut request: Request<Incoming>| {
            let proxy = proxy.clone();
            request.extensions_mut().insert(target.clone());
            // Begun here, not in the future, which hyper may drop unpolled (Proxy::begin).
            let begun = proxy.begin(&request, Some(peer));
            async move { Ok::<_, std::convert::Infallible>(proxy.serve(begun, request).await) }
        });
        let builder = connection_builder(front.config.header_timeout);
        // With upgrades: a WebSocket inside the tunnel (Codex) is relayed like any other.
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
        tokio::pin!(connection);
        let mut draining = front.draining.clone();
        tokio::select! {
            ended = connection.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(client = %peer, "tunnelled connection ended: {e}");
                }
            }
            () = async { let _ = draining.wait_for(|d| *d).await; } => {
                connection.as_mut().graceful_shutdown();
                let _ = connection.await;
            }
        }
    });
    Response::new(ProxyBody::Own(Default::default()))
}

/// Why a client's TLS handshake failed, with the fix when it is the usual one.
fn handshake_hint(e: &std::io::Error, ca: &std::path::Path) -> String {
    let rejected = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|tls| {
            use rustls::AlertDescription as A;
            matches!(
                tls,
                rustls::Error::AlertReceived(
                    A::UnknownCA | A::BadCertificate | A::CertificateUnknown | A::DecryptError
                )
            )
        });
    if rejected {
        format!(
            "{e}: the client does not trust promptgate's CA; give it {} \
             (`promptgate env --mode forward` prints the settings per client)",
            ca.display()
        )
    } else {
        error_chain(e)
    }
}

/// Connects to a host that is not intercepted and relays bytes both ways, unread.
async fn blind(front: Arc<Front>, connect: Connect) -> Response<ProxyBody> {
    let Connect {
        request,
        peer,
        authority,
        ..
    } = connect;
    let (host, port) = (connect.host, connect.port);
    let config = &front.config;
    let addresses = match tokio::net::lookup_host((host.as_str(), port)).await {
        Ok(found) => found.collect::<Vec<SocketAddr>>(),
        Err(e) => {
            return refuse(
                peer,
                authority.as_str(),
                StatusCode::BAD_GATEWAY,
                format!("cannot resolve {host}: {e}"),
            );
        }
    };
    // A remote client must not reach services bound to promptgate's own machine.
    if config.allow_remote && addresses.iter().any(|a| is_this_machine(a.ip())) {
        return refuse(
            peer,
            authority.as_str(),
            StatusCode::FORBIDDEN,
            format!(
                "{host} resolves to this machine; tunnels there are refused with --allow-remote"
            ),
        );
    }
    let connected = tokio::time::timeout(
        config.connect_timeout,
        TcpStream::connect(addresses.as_slice()),
    )
    .await;
    let upstream = match connected {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return refuse(
                peer,
                authority.as_str(),
                StatusCode::BAD_GATEWAY,
                format!("cannot connect to {authority}: {e}"),
            );
        }
        Err(_) => {
            return refuse(
                peer,
                authority.as_str(),
                StatusCode::GATEWAY_TIMEOUT,
                format!("connecting to {authority} timed out"),
            );
        }
    };
    // Checked again on the address actually reached, whatever resolved to it.
    if config.allow_remote
        && let Ok(reached) = upstream.peer_addr()
        && is_this_machine(reached.ip())
    {
        return refuse(
            peer,
            authority.as_str(),
            StatusCode::FORBIDDEN,
            format!(
                "{host} reached {reached}, this machine; tunnels there are refused with --allow-remote"
            ),
        );
    }
    let _ = upstream.set_nodelay(true);
    tokio::spawn(async move {
        let upgraded = match hyper::upgrade::on(request).await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(client = %peer, "CONNECT {authority} upgrade failed: {e}");
                return;
            }
        };
        // Counted on the writes, so a tunnel that ends in an error still reports what
        // it relayed (copy_bidirectional returns no counts with its error).
        let mut client = Counted::new(TokioIo::new(upgraded));
        let mut upstream = Counted::new(upstream);
        let relayed = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        tracing::info!(
            client = %peer,
            host = %authority,
            bytes_up = upstream.written,
            bytes_down = client.written,
            error = relayed.err().map(|e| e.to_string()),
            "tunnel closed"
        );
    });
    Response::new(ProxyBody::Own(Default::default()))
}

/// A stream that counts the bytes written to it.
struct Counted<T> {
    inner: T,
    written: u64,
}

impl<T> Counted<T> {
    fn new(inner: T) -> Self {
        Counted { inner, written: 0 }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if let Poll::Ready(Ok(n)) = polled {
            self.written += n as u64;
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Whether `ip`, in any of its spellings, is this machine or a link-local
/// neighbour: loopback, unspecified ("this host"), link-local (cloud metadata
/// services live there). IPv6 forms that embed an IPv4 address — mapped
/// `::ffff:a.b.c.d`, compatible `::a.b.c.d`, NAT64 `64:ff9b::/96` and 6to4
/// `2002:AABB:CCDD::/16` — are judged by the address they embed.
pub(crate) fn is_this_machine(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4_is_this_machine(v4),
        IpAddr::V6(v6) => {
            let s = v6.segments();
            let embedded = if let Some(v4) = v6.to_ipv4_mapped() {
                Some(v4)
            } else if s[..6] == [0; 6] && !(s[6] == 0 && s[7] <= 1) {
                // Compatible (::a.b.c.d); `::` and `::1` are IPv6's own, below.
                Some(Ipv4Addr::new(
                    (s[6] >> 8) as u8,
                    s[6] as u8,
                    (s[7] >> 8) as u8,
                    s[7] as u8,
                ))
            } else if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                Some(Ipv4Addr::new(
                    (s[6] >> 8) as u8,
                    s[6] as u8,
                    (s[7] >> 8) as u8,
                    s[7] as u8,
                ))
            } else if s[0] == 0x2002 {
                Some(Ipv4Addr::new(
                    (s[1] >> 8) as u8,
                    s[1] as u8,
                    (s[2] >> 8) as u8,
                    s[2] as u8,
                ))
            } else {
                None
            };
            match embedded {
                Some(v4) => v4_is_this_machine(v4),
                None => v6.is_loopback() || v6.is_unspecified() || (s[0] & 0xffc0) == 0xfe80,
            }
        }
    }
}

/// 127.0.0.0/8, 0.0.0.0/8 and 169.254.0.0/16.
fn v4_is_this_machine(ip: Ipv4Addr) -> bool {
    ip.is_loopback() || ip.octets()[0] == 0 || ip.is_link_local()
}

/// An absolute-form `http://` request (a client with `http_proxy` set): forwarded
/// like an intercepted request when its host is on the intercept list: returned with
/// its [`Target`] set, or the refusal to answer with.
pub(super) fn absolute_form(
    front: &Front,
    mut request: Request<Incoming>,
    peer: SocketAddr,
) -> Result<Request<Incoming>, Box<Response<ProxyBody>>> {
    let uri = request.uri().clone();
    let authority = uri.authority().map_or("-", |a| a.as_str()).to_owned();
    if uri.scheme_str() != Some("http") {
        return Err(Box::new(refuse(
            peer,
            &authority,
            StatusCode::BAD_REQUEST,
            "absolute-form requests must be http://; https goes through CONNECT".into(),
        )));
    }
    let Some(host) = uri.host().map(str::to_owned) else {
        return Err(Box::new(refuse(
            peer,
            &authority,
            StatusCode::BAD_REQUEST,
            "no host in the request URI".into(),
        )));
    };
    let config = &front.config;
    let Some(provider) = config.intercept.provider_for(&host) else {
        return Err(Box::new(refuse(
            peer,
            &authority,
            StatusCode::FORBIDDEN,
            format!(
                "promptgate forwards plain http:// only for intercepted hosts (intercepted: {})",
                config.intercept.patterns().join(", ")
            ),
        )));
    };
    let port = uri.port_u16().unwrap_or(80);
    let upstream = match config.upstream_for(&host, port, "http") {
        Ok(url) => url,
        Err(e) => {
            return Err(Box::new(refuse(
                peer,
                &authority,
                StatusCode::BAD_REQUEST,
                e.to_string(),
            )));
        }
    };
    request.extensions_mut().insert(Target {
        provider,
        upstream,
        mode: Mode::Forward,
        host: authority,
    });
    Ok(request)
}

/// Logs and answers a refused forward-proxy request.
fn refuse(
    peer: SocketAddr,
    target: &str,
    status: StatusCode,
    message: String,
) -> Response<ProxyBody> {
    tracing::warn!(client = %peer, target, status = status.as_u16(), "refused: {message}");
    own_response(status, &message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tunnels_cannot_name_this_machine_in_any_address_form() {
        for refused in [
            "127.0.0.1",
            "127.9.8.7",
            "0.0.0.0",
            "169.254.169.254",
            "::1",
            "::",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:7f00:1",
            "0:0:0:0:0:ffff:127.0.0.1",
            "::ffff:0.0.0.0",
            "::127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::127.0.0.1",
            "64:ff9b::7f00:1",
            "2002:7f00:1::",
            "2002:a9fe:a9fe::1",
        ] {
            let ip: IpAddr = refused.parse().unwrap();
            assert!(is_this_machine(ip), "{refused} must be refused");
        }
        for allowed in [
            "8.8.8.8",
            "10.1.2.3",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::",
            "2606:4700::1111",
            "fd00::1",
        ] {
            let ip: IpAddr = allowed.parse().unwrap();
            assert!(!is_this_machine(ip), "{allowed} is another machine");
        }
    }
}
