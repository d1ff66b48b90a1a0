//! `/api/live`: the [`LiveFeed`](crate::live::LiveFeed) as server-sent events.
//!
//! A `recorded` event carries its row's `seq` as the SSE `id`. A browser's
//! `EventSource` sends the last one back as `Last-Event-ID` when it reconnects (a
//! page that listed first passes `?after=SEQ`), and the stream begins with every
//! row stored since: nothing recorded is missed across a reconnect, or when a slow
//! viewer falls behind the feed. `started` and `progress` are of the moment and
//! are not replayed.
//!
//! Viewers are capped (`--admin-live-max-viewers`), and so is what each one has
//! waiting (`--admin-live-backlog` bytes): a viewer that takes nothing for
//! [`PATIENCE`] while its backlog is full is sent `reload` and dropped.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode, header};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, broadcast};

use super::{AdminBody, AdminResponse, AdminState, reply};
use crate::capture::store::Filter;
use crate::capture::{Store, StoreLocation};
use crate::live::sse_frame as frame;

/// A comment this often keeps proxies and the browser from closing a quiet stream.
const KEEPALIVE: Duration = Duration::from_secs(15);

/// Rows a reconnect fills in at most; past it the page is told to reload.
const FILL_LIMIT: usize = 10_000;

/// How long events gather before they are written to a viewer.
const LINGER: Duration = Duration::from_millis(50);

/// How long the browser waits before reconnecting.
const RETRY: &[u8] = b"retry: 1000\n\n";

/// How long a viewer whose backlog is full may take nothing before it is dropped.
const PATIENCE: Duration = Duration::from_secs(5);

/// How long a dropped viewer has to take its `reload`; then its connection is cut.
const GRACE: Duration = Duration::from_secs(5);

/// The live feed's viewers: how many at once, and how much each may have waiting.
#[derive(Debug)]
pub(super) struct Viewers {
    max: usize,
    slots: Arc<Semaphore>,
    backlog: usize,
    /// Viewers refused past the cap, since start.
    refused: AtomicU64,
    /// Viewers dropped for falling behind, since start.
    dropped: AtomicU64,
}

impl Viewers {
    pub(super) fn new(max: usize, backlog: usize) -> Viewers {
        Viewers {
            max,
            slots: Arc::new(Semaphore::new(max)),
            backlog,
            refused: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    /// For `/healthz`.
    pub(super) fn counts(&self) -> serde_json::Value {
        serde_json::json!({
            "viewers": self.max - self.slots.available_permits(),
            "max_viewers": self.max,
            "backlog_bytes": self.backlog,
            "refused": self.refused.load(Ordering::Relaxed),
            "dropped": self.dropped.load(Ordering::Relaxed),
        })
    }
}

/// Why a viewer gets no more events.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    /// It went away (or its stream already ended).
    Gone,
    /// Its backlog stayed full for [`PATIENCE`].
    Behind,
}

/// What one viewer has not taken yet, bounded in bytes: a viewer that stops
/// reading holds at most this much here (besides its socket's and hyper's buffers).
struct Backlog {
    queue: Mutex<Queue>,
    limit: usize,
    /// The body took frames: there may be room.
    taken: Notify,
    /// The body takes no more: it ended, or the viewer went away.
    closed: Notify,
}

#[derive(Default)]
struct Queue {
    frames: VecDeque<Bytes>,
    bytes: usize,
    /// Nothing comes after the frames queued: the body ends once they are taken.
    last: bool,
    closed: bool,
    waker: Option<Waker>,
}

impl Backlog {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // Each change to the queue is whole under the lock: a panic cannot leave half of one.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `frame`, waiting while the backlog is full, at most [`PATIENCE`].
    async fn send(&self, frame: Bytes) -> Result<(), Stop> {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            {
                let mut queue = self.lock();
                if queue.closed || queue.last {
                    return Err(Stop::Gone);
                }
                // One frame larger than the whole backlog still goes, alone.
                if queue.bytes == 0 || queue.bytes + frame.len() <= self.limit {
                    queue.bytes += frame.len();
                    queue.frames.push_back(frame);
                    if let Some(waker) = queue.waker.take() {
                        waker.wake();
                    }
                    return Ok(());
                }
            }
            if tokio::time::timeout_at(deadline, self.taken.notified())
                .await
                .is_err()
            {
                return Err(Stop::Behind);
            }
        }
    }

    /// Ends the stream after what is queued, or, with `instead`, after `instead`
    /// alone (what was waiting is dropped).
    fn finish(&self, instead: Option<Bytes>) {
        let mut queue = self.lock();
        if let Some(frame) = instead {
            queue.frames.clear();
            queue.bytes = frame.len();
            queue.frames.push_back(frame);
        }
        queue.last = true;
        if let Some(waker) = queue.waker.take() {
            waker.wake();
        }
    }

    /// Resolves once the body takes no more.
    async fn closed(&self) {
        loop {
            if self.lock().closed {
                return;
            }
            self.closed.notified().await;
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        // Each has one waiter at most; a permit is kept for one not yet waiting.
        self.closed.notify_one();
        self.taken.notify_one();
    }
}

/// The body of `/api/live`: the viewer's backlog, frame by frame.
pub(crate) struct LiveBody(Arc<Backlog>);

impl LiveBody {
    pub(super) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        let mut queue = self.0.lock();
        if let Some(frame) = queue.frames.pop_front() {
            queue.bytes -= frame.len();
            drop(queue);
            self.0.taken.notify_one();
            return Poll::Ready(Some(frame));
        }
        if queue.last {
            drop(queue);
            self.0.close();
            return Poll::Ready(None);
        }
        queue.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for LiveBody {
    fn drop(&mut self) {
        self.0.close();
    }
}

pub(super) fn stream(
    state: &Arc<AdminState>,
    dir: StoreLocation,
    headers: &HeaderMap,
    query: &str,
    cut: &Arc<Notify>,
) -> AdminResponse {
    let named = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| {
            query
                .split('&')
                .find_map(|p| p.strip_prefix("after=").map(str::to_owned))
        });
    let after = match named.as_deref().map(str::parse::<i64>) {
        None => None,
        Some(Ok(seq)) => Some(seq),
        Some(Err(_)) => {
            let why = format!("after {named:?} is not a row's seq");
            return reply(StatusCode::BAD_REQUEST, &serde_json::json!({"error": why}));
        }
    };
    let viewers = &state.limits.live;
    let Ok(slot) = viewers.slots.clone().try_acquire_owned() else {
        viewers.refused.fetch_add(1, Ordering::Relaxed);
        let why = format!(
            "{} viewers are watching the live feed, the most allowed (--admin-live-max-viewers)",
            viewers.max
        );
        return reply(
            StatusCode::SERVICE_UNAVAILABLE,
            &serde_json::json!({"error": why}),
        );
    };
    // Subscribed before the gap is read: a row stored in between comes twice, and
    // the second is skipped by its seq.
    let events = state.live.subscribe();
    let out = Arc::new(Backlog {
        queue: Mutex::default(),
        limit: viewers.backlog,
        taken: Notify::new(),
        closed: Notify::new(),
    });
    let viewer = Viewer {
        state: state.clone(),
        out: out.clone(),
        slot,
        cut: cut.clone(),
    };
    tokio::spawn(viewer.follow(dir, after, events));
    let mut response = Response::new(AdminBody::Live(LiveBody(out)));
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    response
}

/// One viewer's side of the feed: its backlog, its place among the viewers, and
/// the connection to cut should it not take its `reload`.
struct Viewer {
    state: Arc<AdminState>,
    out: Arc<Backlog>,
    slot: OwnedSemaphorePermit,
    cut: Arc<Notify>,
}

impl Viewer {
    async fn follow(
        self,
        dir: StoreLocation,
        after: Option<i64>,
        events: broadcast::Receiver<crate::live::LiveEvent>,
    ) {
        let Viewer {
            state,
            out,
            slot,
            cut,
        } = self;
        let stop = follow(&dir, after, events, &out).await;
        drop(slot);
        if stop != Err(Stop::Behind) {
            out.finish(None);
            return;
        }
        state.limits.live.dropped.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "dropped a live-feed viewer that took nothing for {}s with its backlog full \
             ({} bytes, --admin-live-backlog)",
            PATIENCE.as_secs(),
            out.limit
        );
        let why = serde_json::json!({"why": "this viewer fell behind the feed"}).to_string();
        out.finish(Some(frame("reload", None, why.as_bytes())));
        if tokio::time::timeout(GRACE, out.closed()).await.is_err() {
            cut.notify_one();
        }
    }
}

async fn follow(
    dir: &StoreLocation,
    after: Option<i64>,
    mut events: broadcast::Receiver<crate::live::LiveEvent>,
    out: &Backlog,
) -> Result<(), Stop> {
    out.send(Bytes::from_static(RETRY)).await?;
    let mut last = match after {
        Some(seq) => fill(dir, seq, out).await?,
        None => match last_seq(dir).await {
            Ok(seq) => seq,
            Err(e) => return out.send(frame("error", None, &e)).await,
        },
    };
    let hello = serde_json::json!({ "seq": last }).to_string();
    out.send(frame("hello", None, hello.as_bytes())).await?;
    loop {
        let first = tokio::select! {
            () = out.closed() => return Err(Stop::Gone),
            event = events.recv() => event,
            () = tokio::time::sleep(KEEPALIVE) => {
                out.send(Bytes::from_static(b": keepalive\n\n")).await?;
                continue;
            }
        };
        // What arrives within the linger goes out as one write: a viewer costs a
        // wake-up and a write per linger, not per event (5 viewers: 1322 -> 529 µs/exchange).
        tokio::time::sleep(LINGER).await;
        let mut batch = Vec::new();
        let mut next = Some(first);
        while let Some(event) = next.take() {
            match event {
                Ok(event) => {
                    if event.seq.is_none_or(|seq| seq > last) {
                        batch.extend_from_slice(&event.frame);
                        last = event.seq.unwrap_or(last);
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    if !batch.is_empty() {
                        out.send(std::mem::take(&mut batch).into()).await?;
                    }
                    last = fill(dir, last, out).await?;
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            }
            next = match events.try_recv() {
                Ok(event) => Some(Ok(event)),
                Err(broadcast::error::TryRecvError::Empty) => None,
                Err(broadcast::error::TryRecvError::Lagged(n)) => {
                    Some(Err(broadcast::error::RecvError::Lagged(n)))
                }
                Err(broadcast::error::TryRecvError::Closed) => {
                    Some(Err(broadcast::error::RecvError::Closed))
                }
            };
        }
        if !batch.is_empty() {
            out.send(batch.into()).await?;
        }
    }
}

/// Sends every row stored after `after`, oldest first; the last seq sent (`after`
/// when none was).
async fn fill(dir: &StoreLocation, after: i64, out: &Backlog) -> Result<i64, Stop> {
    let dir = dir.clone();
    let read = tokio::task::spawn_blocking(move || {
        let store = Store::open_read_only(&dir)?;
        let filter = Filter {
            after_seq: Some(after),
            limit: Some(FILL_LIMIT + 1),
            ..Filter::default()
        };
        Ok::<_, crate::capture::StoreError>((store.list(&filter)?, store.last_seq()?))
    })
    .await;
    let mut rows = match read {
        // The viewer saw rows this store does not have (a new store behind the same
        // address, or one retention emptied, whose seqs start again): it reloads.
        Ok(Ok((_, newest))) if after > newest => {
            let data = serde_json::json!({ "seq": newest }).to_string();
            out.send(frame("reload", None, data.as_bytes())).await?;
            return Ok(newest);
        }
        Ok(Ok((rows, _))) => rows,
        Ok(Err(e)) => {
            let why = format!("reading the store: {e}");
            out.send(frame("error", None, why.as_bytes())).await?;
            return Ok(after);
        }
        Err(e) => {
            let why = e.to_string();
            out.send(frame("error", None, why.as_bytes())).await?;
            return Ok(after);
        }
    };
    rows.sort_by_key(|r| r.seq);
    if rows.len() > FILL_LIMIT {
        // Too much was missed to replay: the page reloads its list instead.
        let last = rows.last().map_or(after, |r| r.seq);
        let data = serde_json::json!({ "seq": last }).to_string();
        out.send(frame("reload", None, data.as_bytes())).await?;
        return Ok(last);
    }
    let mut last = after;
    for row in rows {
        let data = serde_json::to_vec(&row).unwrap_or_default();
        out.send(frame("recorded", Some(row.seq), &data)).await?;
        last = row.seq;
    }
    Ok(last)
}

async fn last_seq(dir: &StoreLocation) -> Result<i64, Vec<u8>> {
    let dir = dir.clone();
    let read =
        tokio::task::spawn_blocking(move || Store::open_read_only(&dir).and_then(|s| s.last_seq()))
            .await;
    match read {
        Ok(Ok(seq)) => Ok(seq),
        Ok(Err(e)) => Err(format!("reading the store: {e}").into_bytes()),
        Err(e) => Err(e.to_string().into_bytes()),
    }
}
