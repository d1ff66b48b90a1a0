//! The response body the client reads: upstream frames pass straight through while
//! a reference to each chunk is kept for the observer.
//!
//! It also owns the two things only the body can see: the idle timeout (no byte
//! from upstream for too long; a live stream is never cut) and how the body ended.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use crate::error::error_chain;
use crate::provider::{self, Api, Provider};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How a response body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyEnd {
    /// The upstream finished the body and the client took all of it.
    Complete,
    /// The upstream broke off (reset, protocol error) before the end.
    UpstreamError(String),
    /// No byte from upstream within the idle timeout.
    IdleTimeout(Duration),
    /// The client went away before the end; the upstream request was dropped with it.
    ClientGone,
    /// promptgate's shutdown grace period ended first; the client was told.
    Shutdown,
}

/// What the tap saw, handed over once when the body ends.
#[derive(Debug)]
pub struct TapResult {
    /// The chunks as the client received them (up to the retention limit).
    pub chunks: Vec<Bytes>,
    /// More bytes passed than were retained.
    pub truncated: bool,
    /// Bytes forwarded to the client.
    pub bytes: u64,
    /// When the first body byte arrived from upstream.
    pub first_byte: Option<Instant>,
    /// When the body ended.
    pub ended: Instant,
    pub end: BodyEnd,
}

type OnEnd = Box<dyn FnOnce(TapResult) + Send>;

struct Tap {
    chunks: Vec<Bytes>,
    retained: usize,
    limit: usize,
    truncated: bool,
    bytes: u64,
    first_byte: Option<Instant>,
    /// The last bytes forwarded, to know whether the stream stands at an event boundary.
    tail: [u8; 4],
    on_end: OnEnd,
}

impl Tap {
    fn record(&mut self, data: &Bytes, now: Instant) {
        self.first_byte.get_or_insert(now);
        self.bytes += data.len() as u64;
        if self.retained + data.len() <= self.limit {
            self.retained += data.len();
            self.chunks.push(data.clone());
        } else {
            self.truncated = true;
        }
        let n = data.len().min(4);
        self.tail.rotate_left(n);
        self.tail[4 - n..].copy_from_slice(&data[data.len() - n..]);
    }

    fn at_event_boundary(&self) -> bool {
        self.bytes == 0
            || self.tail.ends_with(b"\n\n")
            || self.tail.ends_with(b"\r\r")
            || self.tail == *b"\r\n\r\n"
    }
}

/// A response body that tees into the observer. See the module docs.
pub struct ObservedBody<B: Body> {
    inner: B,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    last_activity: Instant,
    tap: Option<Tap>,
    /// Set for SSE responses without a fixed length: on an upstream failure at an
    /// event boundary the client gets the provider's error event instead of a cut.
    error_event: Option<(Provider, Api)>,
    /// Resolves when promptgate's shutdown grace period is over.
    shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
    done: bool,
}

impl<B> ObservedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    /// Wraps `inner`. `on_end` runs exactly once, when the body ends or is dropped.
    pub fn new(
        inner: B,
        idle_timeout: Duration,
        retain_limit: usize,
        error_event: Option<(Provider, Api)>,
        shutdown: impl Future<Output = ()> + Send + 'static,
        on_end: impl FnOnce(TapResult) + Send + 'static,
    ) -> Self {
        let now = Instant::now();
        let empty = inner.is_end_stream();
        let mut body = ObservedBody {
            inner,
            idle_timeout,
            idle: Box::pin(tokio::time::sleep_until(now + idle_timeout)),
            last_activity: now,
            tap: Some(Tap {
                chunks: Vec::new(),
                retained: 0,
                limit: retain_limit,
                truncated: false,
                bytes: 0,
                first_byte: None,
                tail: [0; 4],
                on_end: Box::new(on_end),
            }),
            error_event,
            shutdown: Box::pin(shutdown),
            done: false,
        };
        if empty {
            // HEAD, 204, 304 or a zero length: hyper may never poll it.
            body.done = true;
            body.finish(BodyEnd::Complete);
        }
        body
    }

    fn finish(&mut self, end: BodyEnd) {
        if let Some(tap) = self.tap.take() {
            (tap.on_end)(TapResult {
                chunks: tap.chunks,
                truncated: tap.truncated,
                bytes: tap.bytes,
                first_byte: tap.first_byte,
                ended: Instant::now(),
                end,
            });
        }
    }

    /// Ends the body after an upstream failure: with the provider's error event when the
    /// stream stands at an event boundary, else with an error that cuts the connection.
    fn fail(&mut self, kind: &str, end: BodyEnd) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let message = match &end {
            BodyEnd::UpstreamError(m) => m.clone(),
            BodyEnd::IdleTimeout(d) => format!("no data from upstream for {}s", d.as_secs()),
            BodyEnd::Shutdown => "shutting down: the answer was cut off (--shutdown-grace)".into(),
            _ => String::new(),
        };
        let at_boundary = self.tap.as_ref().is_some_and(Tap::at_event_boundary);
        self.finish(end);
        self.done = true;
        // The event ends the stream as a provider's own `event: error` does: a cut
        // right after it could lose it in hyper's write buffer.
        match self.error_event {
            Some((provider, api)) if at_boundary => {
                let event = provider::stream_error_event(provider, api, kind, &message);
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
            }
            _ => Poll::Ready(Some(Err(format!("promptgate: {message}").into()))),
        }
    }
}

impl<B> Body for ObservedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(tap)) = (frame.data_ref(), this.tap.as_mut())
                    && !data.is_empty()
                {
                    this.last_activity = Instant::now();
                    tap.record(data, this.last_activity);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                let message = format!("upstream broke off mid-response: {}", error_chain(&e));
                this.fail("upstream_error", BodyEnd::UpstreamError(message))
            }
            // A close-delimited stream that ends inside an event did not finish: the
            // upstream's FIN only looks like an end.
            Poll::Ready(None)
                if this.error_event.is_some()
                    && !this.tap.as_ref().is_none_or(Tap::at_event_boundary) =>
            {
                let message = "stream ended mid-event: the upstream closed the connection \
                               inside an event"
                    .to_owned();
                this.fail("upstream_error", BodyEnd::UpstreamError(message))
            }
            Poll::Ready(None) => {
                this.done = true;
                this.finish(BodyEnd::Complete);
                Poll::Ready(None)
            }
            Poll::Pending if this.shutdown.as_mut().poll(cx).is_ready() => {
                this.fail("shutting_down", BodyEnd::Shutdown)
            }
            Poll::Pending => loop {
                // The timer is re-armed lazily: chunks only move `last_activity`.
                match this.idle.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(()) => {
                        let deadline = this.last_activity + this.idle_timeout;
                        if Instant::now() >= deadline {
                            let end = BodyEnd::IdleTimeout(this.idle_timeout);
                            return this.fail("upstream_timeout", end);
                        }
                        this.idle.as_mut().reset(deadline);
                    }
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match self.error_event {
            Some(_) => SizeHint::default(),
            None => self.inner.size_hint(),
        }
    }
}

impl<B: Body> Drop for ObservedBody<B> {
    fn drop(&mut self) {
        if let Some(tap) = self.tap.take() {
            // hyper stops polling once the inner body says it is at its end, or once
            // the declared length was sent (an HTTP/2 upstream's END_STREAM may still be
            // on its way then); anything else dropped early means the client went away.
            let end = if self.inner.is_end_stream() || self.inner.size_hint().exact() == Some(0) {
                BodyEnd::Complete
            } else {
                BodyEnd::ClientGone
            };
            (tap.on_end)(TapResult {
                chunks: tap.chunks,
                truncated: tap.truncated,
                bytes: tap.bytes,
                first_byte: tap.first_byte,
                ended: Instant::now(),
                end,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::{Arc, Mutex};

    /// A scripted body: frames, errors and pauses.
    enum Step {
        Data(&'static str),
        Fail,
        Pause(Duration),
    }

    struct Script {
        steps: std::collections::VecDeque<Step>,
        sleep: Option<Pin<Box<Sleep>>>,
    }

    #[derive(Debug)]
    struct Broken;
    impl std::fmt::Display for Broken {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connection reset")
        }
    }
    impl std::error::Error for Broken {}

    impl Body for Script {
        type Data = Bytes;
        type Error = Broken;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Broken>>> {
            if let Some(s) = self.sleep.as_mut() {
                if s.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.sleep = None;
            }
            match self.steps.pop_front() {
                None => Poll::Ready(None),
                Some(Step::Data(d)) => {
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(d.as_bytes())))))
                }
                Some(Step::Fail) => Poll::Ready(Some(Err(Broken))),
                Some(Step::Pause(d)) => {
                    self.sleep = Some(Box::pin(tokio::time::sleep(d)));
                    self.poll_frame(cx)
                }
            }
        }
    }

    fn body(
        steps: Vec<Step>,
        idle: Duration,
        sse: bool,
    ) -> (ObservedBody<Script>, Arc<Mutex<Option<TapResult>>>) {
        let seen = Arc::new(Mutex::new(None));
        let slot = seen.clone();
        let b = ObservedBody::new(
            Script {
                steps: steps.into(),
                sleep: None,
            },
            idle,
            1 << 20,
            sse.then_some((Provider::Anthropic, Api::Messages)),
            std::future::pending(),
            move |r| *slot.lock().unwrap() = Some(r),
        );
        (b, seen)
    }

    async fn read_all<B: Body<Data = Bytes> + Unpin>(mut b: B) -> (Vec<u8>, bool) {
        let mut out = Vec::new();
        while let Some(f) = b.frame().await {
            match f {
                Ok(f) => out.extend_from_slice(f.data_ref().map(|d| &d[..]).unwrap_or(b"")),
                Err(_) => return (out, true),
            }
        }
        (out, false)
    }

    #[tokio::test]
    async fn passes_frames_and_reports_completion() {
        let (b, seen) = body(
            vec![Step::Data("a"), Step::Data("bc")],
            Duration::from_secs(5),
            false,
        );
        assert_eq!(read_all(b).await, (b"abc".to_vec(), false));
        let r = seen.lock().unwrap().take().unwrap();
        assert_eq!(r.end, BodyEnd::Complete);
        assert_eq!(r.bytes, 3);
        assert_eq!(r.chunks.len(), 2);
    }

    #[tokio::test]
    async fn upstream_failure_at_boundary_becomes_an_error_event() {
        let (b, seen) = body(
            vec![Step::Data("event: ping\ndata: {}\n\n"), Step::Fail],
            Duration::from_secs(5),
            true,
        );
        let (out, errored) = read_all(b).await;
        let text = String::from_utf8(out).unwrap();
        assert!(!errored);
        assert!(
            text.ends_with("\n\n") && text.contains("event: error\ndata: {\"type\":\"error\""),
            "{text}"
        );
        let r = seen.lock().unwrap().take().unwrap();
        assert!(
            matches!(r.end, BodyEnd::UpstreamError(ref m) if m.contains("connection reset")),
            "{:?}",
            r.end
        );
    }

    #[tokio::test]
    async fn upstream_failure_mid_event_cuts_the_stream() {
        let (b, _) = body(
            vec![Step::Data("event: ping\ndata: {"), Step::Fail],
            Duration::from_secs(5),
            true,
        );
        let (out, errored) = read_all(b).await;
        assert!(errored);
        assert_eq!(out, b"event: ping\ndata: {");
    }

    #[tokio::test]
    async fn a_stream_that_ends_mid_event_is_cut_not_complete() {
        let (b, seen) = body(
            vec![Step::Data(
                "event: ping\ndata: {}\n\nevent: content_block_delta\ndata: {\"a\"",
            )],
            Duration::from_secs(5),
            true,
        );
        let (_, errored) = read_all(b).await;
        assert!(errored, "the client sees an abort, not a clean end");
        let r = seen.lock().unwrap().take().unwrap();
        assert!(
            matches!(r.end, BodyEnd::UpstreamError(ref m) if m.starts_with("stream ended mid-event")),
            "{:?}",
            r.end
        );
        // The same end at an event boundary is a clean one.
        let (b, seen) = body(
            vec![Step::Data("data: x\n\n")],
            Duration::from_secs(5),
            true,
        );
        assert!(!read_all(b).await.1);
        assert_eq!(seen.lock().unwrap().take().unwrap().end, BodyEnd::Complete);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_timeout_fires_only_after_silence() {
        // Five pauses of 3 s under a 5 s idle timeout: a live stream is never cut.
        let mut steps = Vec::new();
        for _ in 0..5 {
            steps.push(Step::Pause(Duration::from_secs(3)));
            steps.push(Step::Data("data: x\n\n"));
        }
        steps.push(Step::Pause(Duration::from_secs(60)));
        steps.push(Step::Data("never"));
        let (b, seen) = body(steps, Duration::from_secs(5), true);
        let (out, _) = read_all(b).await;
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.matches("data: x").count(), 5);
        assert!(text.contains("no data from upstream for 5s"), "{text}");
        assert_eq!(
            seen.lock().unwrap().take().unwrap().end,
            BodyEnd::IdleTimeout(Duration::from_secs(5))
        );
    }

    #[tokio::test]
    async fn dropping_early_means_the_client_left() {
        let (mut b, seen) = body(
            vec![Step::Data("a"), Step::Data("b")],
            Duration::from_secs(5),
            false,
        );
        let _ = b.frame().await;
        drop(b);
        let r = seen.lock().unwrap().take().unwrap();
        assert_eq!((r.end, r.bytes), (BodyEnd::ClientGone, 1));
    }
}
