//! The OTLP/HTTP exporter: spans go into a bounded queue, a task on the runtime
//! batches them and posts them as protobuf. Nothing waits on it: past the queue
//! (in spans, or in bytes: `traces.queue_bytes`), or when the collector is down or
//! slow, spans are dropped and counted, with one warning a minute.
//!
//! Not the `opentelemetry_sdk` batch processor: spans here are built after the
//! fact from finished records (with their own start and end times), not by a
//! tracer around live code, and the SDK's processor runs a thread of its own with
//! a blocking executor, which the hyper client (a tokio one) does not run on. The
//! messages are the official ones (`opentelemetry-proto`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Uri, header};
use http_body_util::BodyExt;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::InstrumentationScope;
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
use prost::Message;
use tokio::sync::mpsc;

use super::{SpanContext, TracesSettings, semconv, span_of, text};
use crate::record::{ExchangeRecord, RecordSink};
use crate::redact::Redactor;
use crate::upstream::{Upstream, UpstreamBody};

/// Spans per request to the collector at most.
const BATCH: usize = 512;
/// How long a span waits for its batch to fill.
const LINGER: Duration = Duration::from_secs(1);
/// Time a collector gets to answer one post.
const POST_TIMEOUT: Duration = Duration::from_secs(10);
/// At most one warning per this long.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// What the exporter did, for `/metrics` and `/healthz`.
#[derive(Debug, Default)]
pub(crate) struct ExportCounts {
    pub exported: AtomicU64,
    /// Dropped: the queue was full, or the collector failed or refused them.
    pub dropped: AtomicU64,
    last_warning: Mutex<Option<Instant>>,
}

impl ExportCounts {
    fn drop_spans(&self, n: u64, why: &str) {
        let total = self.dropped.fetch_add(n, Ordering::Relaxed) + n;
        let mut last = self.last_warning.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            *last = Some(Instant::now());
            tracing::warn!(
                dropped_total = total,
                "OTLP export dropped {n} span(s): {why}"
            );
        }
    }
}

enum Item {
    /// A span and its encoded size, counted in [`Held`] until its batch is posted.
    Span(Box<Span>, usize),
    /// Post what is queued, then say so.
    Flush(std::sync::mpsc::Sender<()>),
}

/// The bytes of spans the exporter holds: queued, batched, or in a post under way.
#[derive(Debug)]
struct Held {
    bytes: AtomicUsize,
    max: usize,
}

impl Held {
    /// Takes room for `size` bytes, if it fits under the bound (or nothing is held:
    /// one span larger than the bound still goes).
    fn take(&self, size: usize) -> bool {
        let before = self.bytes.fetch_add(size, Ordering::SeqCst);
        if before > 0 && before.saturating_add(size) > self.max {
            self.bytes.fetch_sub(size, Ordering::SeqCst);
            return false;
        }
        true
    }

    fn give_back(&self, size: usize) {
        self.bytes.fetch_sub(size, Ordering::SeqCst);
    }
}

/// The record sink that turns each record into a span and queues it.
pub(crate) struct SpanExporter {
    queue: mpsc::Sender<Item>,
    held: Arc<Held>,
    redactor: Arc<Redactor>,
    content: bool,
    counts: Arc<ExportCounts>,
}

impl SpanExporter {
    /// The sink, and the task that posts its spans to `settings.url` (to be spawned
    /// on the runtime); `None` when export is off.
    pub(crate) fn start(
        settings: &TracesSettings,
        redactor: Arc<Redactor>,
        client: Upstream,
    ) -> Option<(Arc<SpanExporter>, impl Future<Output = ()> + Send + 'static)> {
        let url = settings.url.clone()?;
        let (tx, rx) = mpsc::channel(settings.queue);
        let counts = Arc::new(ExportCounts::default());
        let held = Arc::new(Held {
            bytes: AtomicUsize::new(0),
            max: settings.queue_bytes,
        });
        let resource = Resource {
            attributes: vec![
                text(semconv::SERVICE_NAME, settings.service_name.clone()),
                text(semconv::SERVICE_VERSION, env!("CARGO_PKG_VERSION")),
            ],
            ..Default::default()
        };
        let task = post_batches(
            rx,
            held.clone(),
            Collector {
                url,
                client,
                resource,
                counts: counts.clone(),
            },
        );
        let sink = SpanExporter {
            queue: tx,
            held,
            redactor,
            content: settings.content,
            counts,
        };
        Some((Arc::new(sink), task))
    }

    pub(crate) fn counts(&self) -> Arc<ExportCounts> {
        self.counts.clone()
    }
}

impl RecordSink for SpanExporter {
    fn reads_message(&self) -> bool {
        self.content
    }

    fn record(&self, record: &ExchangeRecord) {
        let cx = SpanContext {
            redactor: &self.redactor,
            content: self.content,
        };
        let span = span_of(record, &cx);
        // The newest span is the one dropped: the older ones are already in a batch
        // on its way, and a full queue is only known when a span comes.
        let size = span.encoded_len();
        if !self.held.take(size) {
            self.counts.drop_spans(
                1,
                "the export queue holds traces.queue_bytes of spans (the collector is slow or down)",
            );
            return;
        }
        if self
            .queue
            .try_send(Item::Span(Box::new(span), size))
            .is_err()
        {
            self.held.give_back(size);
            self.counts.drop_spans(
                1,
                "the export queue is full (the collector is slow or down)",
            );
        }
    }

    fn flush(&self) {
        let (tx, rx) = std::sync::mpsc::channel();
        if self.queue.try_send(Item::Flush(tx)).is_ok() {
            let _ = rx.recv_timeout(POST_TIMEOUT + Duration::from_secs(1));
        }
    }
}

/// Where batches go, and what counts them.
struct Collector {
    url: Uri,
    client: Upstream,
    resource: Resource,
    counts: Arc<ExportCounts>,
}

/// Takes spans off the queue and posts them in batches until the queue closes; a
/// batch's bytes are given back to `held` once its post is over.
async fn post_batches(mut queue: mpsc::Receiver<Item>, held: Arc<Held>, collector: Collector) {
    let mut batch: Vec<Span> = Vec::with_capacity(BATCH);
    let mut batch_bytes = 0;
    let post = async |batch: &mut Vec<Span>, bytes: &mut usize| {
        collector.post(std::mem::take(batch)).await;
        held.give_back(std::mem::take(bytes));
    };
    loop {
        let next = if batch.is_empty() {
            queue.recv().await
        } else {
            match tokio::time::timeout(LINGER, queue.recv()).await {
                Ok(item) => item,
                Err(_) => {
                    post(&mut batch, &mut batch_bytes).await;
                    continue;
                }
            }
        };
        match next {
            None => {
                post(&mut batch, &mut batch_bytes).await;
                return;
            }
            Some(Item::Span(span, size)) => {
                batch.push(*span);
                batch_bytes += size;
                if batch.len() >= BATCH {
                    post(&mut batch, &mut batch_bytes).await;
                }
            }
            Some(Item::Flush(done)) => {
                post(&mut batch, &mut batch_bytes).await;
                let _ = done.send(());
            }
        }
    }
}

impl Collector {
    /// Posts one batch; a failure drops it (counted): spans are never retried, so
    /// a slow collector cannot make the queue grow.
    async fn post(&self, spans: Vec<Span>) {
        let Collector {
            url,
            client,
            resource,
            counts,
        } = self;
        if spans.is_empty() {
            return;
        }
        let n = spans.len() as u64;
        let body = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "promptgate".into(),
                        version: env!("CARGO_PKG_VERSION").into(),
                        ..Default::default()
                    }),
                    spans,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        }
        .encode_to_vec();
        let request = Request::builder()
            .method(Method::POST)
            .uri(url.clone())
            .header(header::CONTENT_TYPE, "application/x-protobuf")
            .header(header::CONTENT_LENGTH, body.len())
            .body(UpstreamBody::from(Bytes::from(body)));
        let Ok(request) = request else {
            counts.drop_spans(n, "the collector URL cannot be requested");
            return;
        };
        let answered = tokio::time::timeout(POST_TIMEOUT, async {
            let response = client.send(request).await.map_err(|e| e.to_string())?;
            let status = response.status();
            // Read to the end, so the connection goes back to the pool.
            let _ = response.into_body().collect().await;
            Ok::<_, String>(status)
        })
        .await;
        match answered {
            Ok(Ok(status)) if status.is_success() => {
                counts.exported.fetch_add(n, Ordering::Relaxed);
            }
            Ok(Ok(status)) => {
                counts.drop_spans(n, &format!("the collector at {url} answered {status}"))
            }
            Ok(Err(e)) => counts.drop_spans(n, &format!("posting to {url}: {e}")),
            Err(_) => counts.drop_spans(
                n,
                &format!(
                    "the collector at {url} did not answer within {}s",
                    POST_TIMEOUT.as_secs()
                ),
            ),
        }
    }
}
