//! Forward-proxy requests: CONNECT tunnels and absolute-form `http://` requests.
//!
//! A CONNECT to an intercepted host is answered 200, then TLS is terminated with a
//! leaf from the CA and every request inside (HTTP/1.1 or HTTP/2 by ALPN) goes to
//! [`Proxy::handle`] with a [`Target`] taken from the CONNECT authority. Other hosts
//! get a blind TCP tunnel, or a refusal with `--intercept-only`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::uri::Authority;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
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
    let config = &front.proxy.config;
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
    match config.intercept.provider_for(&connect.host) {
        Some(provider) => intercept(front, connect, provider).await,
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
        None => blind(front, connect).await,
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
    let Some(leaves) = front.leaves.clone() else {
        return refuse(
            peer,
            authority.as_str(),
            StatusCode::BAD_GATEWAY,
            "promptgate has no usable CA, so it cannot intercept (see its startup log)".into(),
        );
    };
    let upstream = match front.proxy.config.upstream_for(&host, port, "https") {
        Ok(url) => url,
        Err(e) => return refuse(peer, authority.as_str(), StatusCode::BAD_REQUEST, e),
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
            async move { Ok::<_, std::convert::Infallible>(proxy.handle(request, Some(peer)).await) }
        });
        let builder = connection_builder(front.proxy.config.header_timeout);
        let connection = builder.serve_connection(TokioIo::new(tls), service);
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
    let config = &front.proxy.config;
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
    if config.allow_remote
        && addresses
            .iter()
            .any(|a| a.ip().is_loopback() || a.ip().is_unspecified())
    {
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
    let mut upstream = match connected {
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
    let _ = upstream.set_nodelay(true);
    tokio::spawn(async move {
        let upgraded = match hyper::upgrade::on(request).await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(client = %peer, "CONNECT {authority} upgrade failed: {e}");
                return;
            }
        };
        let mut client = TokioIo::new(upgraded);
        let relayed = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        let (up, down) = relayed.as_ref().map_or((0, 0), |&(u, d)| (u, d));
        tracing::info!(
            client = %peer,
            host = %authority,
            bytes_up = up,
            bytes_down = down,
            error = relayed.err().map(|e| e.to_string()),
            "tunnel closed"
        );
    });
    Response::new(ProxyBody::Own(Default::default()))
}

/// An absolute-form `http://` request (a client with `http_proxy` set): forwarded
/// like an intercepted request when its host is on the intercept list.
pub(super) async fn absolute_form(
    front: Arc<Front>,
    mut request: Request<Incoming>,
    peer: SocketAddr,
) -> Response<ProxyBody> {
    let uri = request.uri().clone();
    let authority = uri.authority().map_or("-", |a| a.as_str()).to_owned();
    if uri.scheme_str() != Some("http") {
        return refuse(
            peer,
            &authority,
            StatusCode::BAD_REQUEST,
            "absolute-form requests must be http://; https goes through CONNECT".into(),
        );
    }
    let Some(host) = uri.host().map(str::to_owned) else {
        return refuse(
            peer,
            &authority,
            StatusCode::BAD_REQUEST,
            "no host in the request URI".into(),
        );
    };
    let config = &front.proxy.config;
    let Some(provider) = config.intercept.provider_for(&host) else {
        return refuse(
            peer,
            &authority,
            StatusCode::FORBIDDEN,
            format!(
                "promptgate forwards plain http:// only for intercepted hosts (intercepted: {})",
                config.intercept.patterns().join(", ")
            ),
        );
    };
    let port = uri.port_u16().unwrap_or(80);
    let upstream = match config.upstream_for(&host, port, "http") {
        Ok(url) => url,
        Err(e) => return refuse(peer, &authority, StatusCode::BAD_REQUEST, e),
    };
    request.extensions_mut().insert(Target {
        provider,
        upstream,
        mode: Mode::Forward,
        host: authority,
    });
    front.proxy.clone().handle(request, Some(peer)).await
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
