//! Accepts client connections (HTTP/1.1, and HTTP/2 with prior knowledge) and hands
//! every request to [`Proxy::handle`].
//!
//! On shutdown it stops accepting, lets open connections finish their in-flight
//! exchanges within the grace period (idle keep-alive connections close at once),
//! and waits for the last records to be emitted.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::exchange::Proxy;

/// Serves `listener` until `shutdown` resolves, then drains for up to `grace`.
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .preserve_header_case(true)
        .timer(TokioTimer::new())
        // A client that sends headers slowly is cut after this; bodies are not limited by it.
        .header_read_timeout(Duration::from_secs(60));
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);

    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let proxy = proxy.clone();
        let service = service_fn(move |request| {
            let proxy = proxy.clone();
            async move { Ok::<_, Infallible>(proxy.handle(request, Some(peer)).await) }
        });
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("connection from {peer} ended: {e}");
            }
        });
    }

    drop(listener);
    let in_flight = proxy.recorder.in_flight();
    tracing::info!(
        "shutting down: {in_flight} exchange(s) in flight, grace {}s",
        grace.as_secs()
    );
    let drained = async {
        graceful.shutdown().await;
        proxy.recorder.drained().await;
    };
    if tokio::time::timeout(grace, drained).await.is_err() {
        tracing::warn!(
            "grace period over with {} exchange(s) still in flight; closing them",
            proxy.recorder.in_flight()
        );
        proxy.recorder.abandon_in_flight();
    }
    // Everything recorded so far reaches its sinks' storage before serve returns.
    let recorder = proxy.recorder.clone();
    let _ = tokio::task::spawn_blocking(move || recorder.flush()).await;
}
