//! The OTLP/HTTP exporter: spans go into a bounded queue, a task on the runtime
//! batches them and posts them as protobuf. Nothing waits on it: past the queue,
//! or when the collector is down or slow, spans are dropped and counted, with one
//! warning a minute.
//!
//! Not the `opentelemetry_sdk` batch processor: spans here are built after the
//! fact from finished records (with their own start and end times), not by a
//! tracer around live code, and the SDK's processor runs a thread of its own with
//! a blocking executor, which the hyper client (a tokio one) does not run on. The
//! messages are the official ones (`opentelemetry-proto`).

use std::sync::atomic::{AtomicU64, Ordering};
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
use crate::conversation::KeySource;
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
pub struct ExportCounts {
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
    Span(Box<Span>),
    /// Post what is queued, then say so.
    Flush(std::sync::mpsc::Sender<()>),
}

/// The record sink that turns each record into a span and queues it.
pub struct SpanExporter {
    queue: mpsc::Sender<Item>,
    redactor: Arc<Redactor>,
    conversation: KeySource,
    content: bool,
    counts: Arc<ExportCounts>,
}

impl SpanExporter {
    /// The sink, and the task that posts its spans to `settings.url` (to be spawned
    /// on the runtime); `None` when export is off.
    pub fn start(
        settings: &TracesSettings,
        redactor: Arc<Redactor>,
        conversation: KeySource,
        client: Upstream,
    ) -> Option<(Arc<SpanExporter>, impl Future<Output = ()> + Send + 'static)> {
        let url = settings.url.clone()?;
        let (tx, rx) = mpsc::channel(settings.queue);
        let counts = Arc::new(ExportCounts::default());
        let resource = Resource {
            attributes: vec![
                text(semconv::SERVICE_NAME, settings.service_name.clone()),
                text(semconv::SERVICE_VERSION, env!("CARGO_PKG_VERSION")),
            ],
            ..Default::default()
        };
        let task = post_batches(
            rx,
            Collector {
                url,
                client,
                resource,
                counts: counts.clone(),
            },
        );
        let sink = SpanExporter {
            queue: tx,
            redactor,
            conversation,
            content: settings.content,
            counts,
        };
        Some((Arc::new(sink), task))
    }

    pub fn counts(&self) -> Arc<ExportCounts> {
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
            conversation: &self.conversation,
            content: self.content,
        };
        let span = span_of(record, &cx);
        if self.queue.try_send(Item::Span(Box::new(span))).is_err() {
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

/// Takes spans off the queue and posts them in batches until the queue closes.
async fn post_batches(mut queue: mpsc::Receiver<Item>, collector: Collector) {
    let mut batch: Vec<Span> = Vec::with_capacity(BATCH);
    loop {
        let next = if batch.is_empty() {
            queue.recv().await
        } else {
            match tokio::time::timeout(LINGER, queue.recv()).await {
                Ok(item) => item,
                Err(_) => {
                    collector.post(std::mem::take(&mut batch)).await;
                    continue;
                }
            }
        };
        match next {
            None => {
                collector.post(batch).await;
                return;
            }
            Some(Item::Span(span)) => {
                batch.push(*span);
                if batch.len() >= BATCH {
                    collector.post(std::mem::take(&mut batch)).await;
                }
            }
            Some(Item::Flush(done)) => {
                collector.post(std::mem::take(&mut batch)).await;
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
