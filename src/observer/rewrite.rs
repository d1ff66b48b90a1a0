//! The upstream's response body as the tee reads it: straight through, or, when
//! per-event rules are loaded for an SSE answer, through the stream engine of the
//! policies that act on its events ([`EventPolicy`]).
//!
//! Rules that only observe (`tag`, `log`) see each event while its bytes pass
//! unchanged and unheld. Rules that may change events (`mask`, `drop_event`,
//! `block`, or any `enforce` rule) get whole events: bytes go out at event
//! boundaries, and a masked block's events wait behind its `hold_back` window.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use super::EventSplitter;
use crate::policy::{Block, EventPolicy};

/// Why the body the tee reads failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StreamError {
    #[error(transparent)]
    Upstream(#[from] hyper::Error),
    /// A per-event rule ended the stream.
    #[error("rule {:?} ended the stream: {}", .0.rule, .0.message)]
    Blocked(Block),
}

/// The upstream body, maybe under per-event rules.
pub(crate) enum ResponseBody {
    Plain(Incoming),
    Events(Box<EventBody>),
}

impl ResponseBody {
    /// `rules` applied to `inner`'s events.
    pub(crate) fn with_rules(inner: Incoming, rules: Box<dyn EventPolicy>) -> ResponseBody {
        let hold = rules.may_change();
        ResponseBody::events(inner, rules, hold, None)
    }

    /// `rules` applied to `inner` whole, as one event, once it has all come (a JSON
    /// answer); past [`WHOLE_MAX`] bytes it goes on as it came.
    pub(crate) fn whole_with_rules(inner: Incoming, rules: Box<dyn EventPolicy>) -> ResponseBody {
        ResponseBody::events(inner, rules, true, Some(Vec::new()))
    }

    fn events(
        inner: Incoming,
        rules: Box<dyn EventPolicy>,
        hold: bool,
        whole: Option<Vec<u8>>,
    ) -> ResponseBody {
        ResponseBody::Events(Box::new(EventBody {
            hold,
            inner,
            rules,
            splitter: EventSplitter::default(),
            out: VecDeque::new(),
            scratch: Vec::new(),
            timer: None,
            failed: None,
            ended: false,
            whole,
            bypass: false,
        }))
    }
}

/// The most bytes of a JSON answer held whole for the policies that read it: past
/// this the answer goes on unread (a JSON answer of a model is kilobytes).
pub(super) const WHOLE_MAX: usize = 16 << 20;

/// An SSE body under per-event rules. See the module docs.
pub(crate) struct EventBody {
    inner: Incoming,
    rules: Box<dyn EventPolicy>,
    /// Rules may change events: they go out whole, when the rules release them.
    hold: bool,
    splitter: EventSplitter,
    out: VecDeque<Bytes>,
    scratch: Vec<Bytes>,
    /// Wakes when the oldest held event must go out.
    timer: Option<Pin<Box<Sleep>>>,
    /// What ends the body once `out` is sent.
    failed: Option<StreamError>,
    ended: bool,
    /// A JSON answer being gathered whole for the rules.
    whole: Option<Vec<u8>>,
    /// The answer outgrew [`WHOLE_MAX`]: the rest passes as it comes.
    bypass: bool,
}

impl EventBody {
    /// Feeds whole events to the rules; what they release joins `out`.
    fn feed(&mut self, data: &Bytes) {
        if self.bypass {
            self.out.push_back(data.clone());
            return;
        }
        if let Some(buf) = &mut self.whole {
            if buf.len() + data.len() > WHOLE_MAX {
                let held = std::mem::take(buf);
                self.out.push_back(Bytes::from(held));
                self.out.push_back(data.clone());
                self.whole = None;
                self.bypass = true;
            } else {
                buf.extend_from_slice(data);
            }
            return;
        }
        self.splitter.push(data);
        let now = Instant::now();
        while self.failed.is_none()
            && let Some(event) = self.splitter.next_event()
        {
            if let Some(block) = self.rules.push(event, now, &mut self.scratch) {
                self.failed = Some(StreamError::Blocked(block));
            }
        }
        self.take_scratch();
    }

    fn take_scratch(&mut self) {
        if self.hold {
            self.out.extend(self.scratch.drain(..));
        } else {
            // Observing only: the bytes already went out as they came.
            self.scratch.clear();
        }
    }

    /// The upstream ended (cleanly or not): what is held goes out, then an
    /// unfinished event's bytes as they came.
    fn drain(&mut self) {
        if self.bypass {
            return;
        }
        if let Some(buf) = self.whole.take()
            && let Some(block) =
                self.rules
                    .push(Bytes::from(buf), Instant::now(), &mut self.scratch)
        {
            self.failed = Some(StreamError::Blocked(block));
        }
        self.rules.finish(&mut self.scratch);
        let rest = self.splitter.rest();
        if !rest.is_empty() {
            self.scratch.push(rest);
        }
        self.take_scratch();
    }

    fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamError>>> {
        loop {
            if let Some(bytes) = self.out.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if let Some(e) = self.failed.take() {
                self.ended = true;
                return Poll::Ready(Some(Err(e)));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Some(data) = frame.data_ref() else {
                        return Poll::Ready(Some(Ok(frame)));
                    };
                    let data = data.clone();
                    self.feed(&data);
                    if !self.hold {
                        return Poll::Ready(Some(Ok(frame)));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.drain();
                    self.failed = Some(StreamError::Upstream(e));
                }
                Poll::Ready(None) => {
                    self.drain();
                    self.ended = true;
                }
                Poll::Pending => {
                    let Some(at) = self.rules.next_release() else {
                        self.timer = None;
                        return Poll::Pending;
                    };
                    let timer = self
                        .timer
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                    if timer.deadline() != at {
                        timer.as_mut().reset(at);
                    }
                    if timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.rules.release_due(Instant::now(), &mut self.scratch);
                    self.take_scratch();
                    if self.out.is_empty() {
                        return Poll::Pending;
                    }
                }
            }
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = StreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamError>>> {
        match self.get_mut() {
            ResponseBody::Plain(b) => Pin::new(b).poll_frame(cx).map_err(StreamError::from),
            ResponseBody::Events(b) => b.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Plain(b) => b.is_end_stream(),
            ResponseBody::Events(b) => b.ended && b.out.is_empty() && b.failed.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Plain(b) => b.size_hint(),
            // Masks and drops change the length.
            ResponseBody::Events(_) => SizeHint::default(),
        }
    }
}
