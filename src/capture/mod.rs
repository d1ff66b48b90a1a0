//! Capture: every exchange kept once, redacted in memory, stored without repetition.
//! [`Capture`] (a [`RecordSink`]) only queues a record on the request path; a writer
//! thread (`writer`) redacts and cuts it, and the store's own thread writes it.
//! A full queue is waited on for a bounded time at admission, then the record is
//! dropped, counted and logged (or, with `capture.required`, new requests are
//! refused). It never holds a stream's bytes back.

pub(crate) mod advice;
pub(crate) mod analysis;
pub(crate) mod anatomy;
pub(crate) mod cache_report;
pub(crate) mod export;
pub(crate) mod fleet;
pub(crate) mod layout;
pub(crate) mod record;
pub(crate) mod settings;
mod spool;
pub(crate) mod store;
pub(crate) mod timestamp;
pub(crate) mod units;
mod writer;

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::id::ExchangeId;
use crate::record::{ExchangeRecord, RecordSink, Refusal, StoredNotice};
use crate::redact::Redactor;

pub(crate) use record::CaptureRecord;
pub(crate) use settings::{CaptureLayer, CaptureSettings};
pub(crate) use store::{Store, StoreError, StoreLocation};

/// Records written per transaction at most.
const BATCH: usize = 64;
/// How long a shutdown waits for the queue to be written.
const FLUSH_LIMIT: Duration = Duration::from_secs(120);

/// Counters of the capture pipeline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Counters {
    /// Records waiting for the writer.
    pub queued: u64,
    /// Body bytes those records hold.
    pub queued_bytes: u64,
    /// The last write succeeded.
    pub healthy: bool,
    pub written: u64,
    /// Records dropped: `dropped_queue_full` + `dropped_closed`.
    pub dropped: u64,
    /// Dropped because the queue stayed full (no place kept, none free at the end).
    pub dropped_queue_full: u64,
    /// Dropped because they ended after the capture closed (at shutdown).
    pub dropped_closed: u64,
    /// Records the store failed to write.
    pub failed: u64,
    /// Records waiting in the spool for a PostgreSQL store to come back.
    pub spooled: u64,
}

struct QueueState {
    items: VecDeque<ExchangeRecord>,
    bytes: u64,
    /// Exchanges admitted with room: their records have a place, whatever the queue
    /// holds when they end (their bodies are in memory already, in flight).
    reserved: HashSet<ExchangeId>,
    /// The writer holds records taken from the queue and not yet committed.
    busy: bool,
    /// The writer sleeps on `not_empty`: only then is a new record worth a wake-up
    /// (a futex call per record otherwise, on the thread that hands records over).
    writer_waiting: bool,
    closed: bool,
}

struct Shared {
    state: Mutex<QueueState>,
    not_empty: Condvar,
    idle: Condvar,
    /// Told when the writer takes records off the queue: admissions waiting for
    /// room look again at once.
    room: tokio::sync::Notify,
    written: AtomicU64,
    dropped: AtomicU64,
    dropped_queue_full: AtomicU64,
    dropped_closed: AtomicU64,
    /// When a drop was last logged, and the drops since: a burst logs once a second.
    drop_log: Mutex<(Option<Instant>, u64)>,
    failed: AtomicU64,
    spooled: AtomicU64,
    /// The last write succeeded (what `capture.required` admits on).
    healthy: AtomicBool,
    /// Why the last failed write failed.
    last_error: Mutex<Option<String>>,
}

impl Shared {
    /// Counts a drop; says how many to report when this one should be logged (the
    /// first of a burst, then at most once a second with the count since), else `None`.
    fn drop_due(&self) -> Option<u64> {
        let mut log = self.drop_log.lock().unwrap_or_else(|p| p.into_inner());
        log.1 += 1;
        let now = Instant::now();
        if log.0.is_some_and(|t| now - t < Duration::from_secs(1)) {
            return None;
        }
        let count = log.1;
        *log = (Some(now), 0);
        Some(count)
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A writer that panicked leaves a consistent queue behind: keep using it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on `condvar` while `blocked` holds, until `deadline`; says whether it
    /// still holds. A multi-threaded runtime moves its other tasks off this thread
    /// meanwhile: a full capture queue must not stall live streams.
    fn wait_while<'a>(
        &self,
        state: MutexGuard<'a, QueueState>,
        condvar: &Condvar,
        deadline: Instant,
        blocked: impl Fn(&QueueState) -> bool,
    ) -> (MutexGuard<'a, QueueState>, bool) {
        if !blocked(&state) {
            return (state, false);
        }
        let wait = move || {
            let mut state = state;
            while blocked(&state) {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return (state, true);
                }
                state = condvar
                    .wait_timeout(state, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            (state, false)
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(wait)
            }
            _ => wait(),
        }
    }
}

/// The capture sink and its writer thread. See the module docs.
pub(crate) struct Capture {
    shared: Arc<Shared>,
    settings: CaptureSettings,
    writer: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("store", &self.settings.store)
            .field("counters", &self.counters())
            .finish()
    }
}

/// The spool of `settings`' store: a directory of its own under the configured
/// one. Every promptgate of a data directory drains the spool it finds into its
/// own store, so two of them on different stores must not share one (records
/// spooled for one store were written into the other's).
fn spool_of(settings: &CaptureSettings) -> std::path::PathBuf {
    let StoreLocation::Postgres(url) = &settings.store else {
        return settings.spool_dir.clone();
    };
    let legacy = settings.spool_dir.join(store::DB_FILE);
    if legacy.exists() {
        tracing::warn!(
            "{} is a spool of an older promptgate, for a store it did not name: not drained here (start the older promptgate with its store to drain it, or remove it)",
            legacy.display()
        );
    }
    let key = crate::digest::hex(&crate::digest::sha256(url.as_bytes())[..6]);
    settings.spool_dir.join(key)
}

impl Capture {
    /// Opens the store at `settings.store` and starts the writer.
    /// `redactor` is the process's one redactor (the logs use it too).
    pub(crate) fn start(
        settings: &CaptureSettings,
        redactor: Arc<Redactor>,
        live: Option<Arc<dyn StoredNotice>>,
    ) -> Result<Arc<Capture>, StoreError> {
        let settings = &CaptureSettings {
            spool_dir: spool_of(settings),
            ..settings.clone()
        };
        let mut store = match Store::open(&settings.store) {
            Ok(store) => Some(store),
            // A fleet replica serves while its database is away: the spool holds.
            Err(StoreError::Unreachable(why))
                if matches!(settings.store, StoreLocation::Postgres(_)) =>
            {
                tracing::warn!(
                    "capture store unreachable at start ({why}); records wait in the spool at {} until it answers",
                    settings.spool_dir.display()
                );
                None
            }
            Err(e) => return Err(e),
        };
        if let Some(store) = store.as_mut() {
            match store.prune(&settings.retention, timestamp::now_ms()) {
                Ok(p) if p.records > 0 => {
                    tracing::info!("capture retention removed {} record(s)", p.records)
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("capture retention failed: {e}"),
            }
        }
        let spool = match &settings.store {
            StoreLocation::Postgres(_) => Some(spool::Spool::open(
                &settings.spool_dir,
                settings.spool_max_size,
            )?),
            StoreLocation::Dir(_) => None,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(QueueState {
                items: VecDeque::new(),
                bytes: 0,
                reserved: HashSet::new(),
                busy: false,
                writer_waiting: false,
                closed: false,
            }),
            not_empty: Condvar::new(),
            idle: Condvar::new(),
            room: tokio::sync::Notify::new(),
            written: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            dropped_queue_full: AtomicU64::new(0),
            dropped_closed: AtomicU64::new(0),
            drop_log: Mutex::new((None, 0)),
            failed: AtomicU64::new(0),
            spooled: AtomicU64::new(spool.as_ref().map_or(0, spool::Spool::held)),
            healthy: AtomicBool::new(true),
            last_error: Mutex::new(None),
        });
        let writer = writer::Writer {
            shared: shared.clone(),
            store: writer::StoreThread::start(store, settings.store.clone(), live)?,
            cache: record::UnitCache::default(),
            redactor,
            retention: settings.retention,
            repeats: writer::BlockedRepeats::default(),
            spool,
            patience: writer::Writer::patience_for(settings.queue_wait),
        };
        let handle = std::thread::Builder::new()
            .name("capture-writer".into())
            .spawn(move || writer.run())
            .map_err(|e| StoreError::Io {
                path: "capture writer thread".into(),
                source: e,
            })?;
        Ok(Arc::new(Capture {
            shared,
            settings: settings.clone(),
            writer: Mutex::new(Some(handle)),
        }))
    }

    /// The pipeline's counters now.
    pub(crate) fn counters(&self) -> Counters {
        let (queued, queued_bytes) = {
            let state = self.shared.lock();
            (state.items.len() as u64, state.bytes)
        };
        Counters {
            queued,
            queued_bytes,
            healthy: self.shared.healthy.load(Ordering::SeqCst),
            written: self.shared.written.load(Ordering::SeqCst),
            dropped: self.shared.dropped.load(Ordering::SeqCst),
            dropped_queue_full: self.shared.dropped_queue_full.load(Ordering::SeqCst),
            dropped_closed: self.shared.dropped_closed.load(Ordering::SeqCst),
            failed: self.shared.failed.load(Ordering::SeqCst),
            spooled: self.shared.spooled.load(Ordering::SeqCst),
        }
    }

    /// Where records wait while a PostgreSQL store is away (none for SQLite).
    pub(crate) fn spool_dir(&self) -> Option<&std::path::Path> {
        matches!(self.settings.store, StoreLocation::Postgres(_))
            .then_some(self.settings.spool_dir.as_path())
    }

    /// Why the store last failed to write, if it ever did.
    pub(crate) fn last_error(&self) -> Option<String> {
        self.shared
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether a record could be taken now: the store writes and the queue has room.
    pub(crate) fn can_take(&self) -> bool {
        self.shared.healthy.load(Ordering::SeqCst) && self.room_for(0)
    }

    /// Room for a record of `bytes` (for admission: the count bound includes the places promised).
    fn room_for(&self, bytes: u64) -> bool {
        let state = self.shared.lock();
        state.closed || !self.full(&state, bytes, true)
    }

    /// Writes everything queued, stops the writer and checkpoints the store.
    pub(crate) fn close(&self) {
        self.flush();
        self.shared.lock().closed = true;
        self.shared.not_empty.notify_all();
        let handle = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
        let c = self.counters();
        tracing::info!(
            "capture closed: {} written, {} dropped, {} failed",
            c.written,
            c.dropped,
            c.failed
        );
    }

    /// Keeps a place for `record` when there is room (or one is kept for it already).
    /// The look and the promise are one step: a record landing between them would
    /// take the room (seen: an exchange let through unpromised, its record dropped
    /// with no wait).
    fn promise(&self, state: &mut QueueState, record: &ExchangeRecord) -> bool {
        if state.reserved.contains(&record.id) {
            return true;
        }
        let room = !self.full(state, record.held_bytes(), true);
        if room {
            state.reserved.insert(record.id);
        }
        room
    }

    /// No room for a record of `extra_bytes`. The byte bound is on records waiting
    /// for the writer: an exchange in flight holds its bodies whether or not it is
    /// captured, so a promise takes no bytes (it would otherwise cap how many
    /// exchanges run at once: 16 MiB held 40 streams of 200 KB, half of c64). It
    /// takes a place in the count bound when admission (`reserving`) asks. Records
    /// promised a place may take the queue past its bytes when they end together;
    /// that memory moves there from the exchanges, and nobody is admitted meanwhile.
    fn full(&self, state: &QueueState, extra_bytes: u64, reserving: bool) -> bool {
        let promised = if reserving { state.reserved.len() } else { 0 };
        state.items.len() + promised >= self.settings.queue
            || (!state.items.is_empty() && state.bytes + extra_bytes > self.settings.queue_bytes)
    }
}

impl RecordSink for Capture {
    fn reads_message(&self) -> bool {
        true
    }

    fn compares_bodies(&self) -> bool {
        true
    }

    fn record(&self, record: &ExchangeRecord) {
        let size = record.held_bytes();
        let mut state = self.shared.lock();
        if state.closed {
            self.shared.dropped.fetch_add(1, Ordering::SeqCst);
            self.shared.dropped_closed.fetch_add(1, Ordering::SeqCst);
            tracing::warn!(id = %record.id, reason = "closed", "capture is closed; record dropped");
            return;
        }
        // Admission already waited (up to queue_wait) for room; a record that got none
        // and finds the queue still full is dropped.
        let promised = state.reserved.remove(&record.id);
        // A record holding no body (its client left while it waited for room) takes
        // none: only the count bound applies to it.
        let full = match size {
            0 => state.items.len() >= self.settings.queue,
            _ => self.full(&state, size, false),
        };
        if !promised && full {
            let (queued, bytes) = (state.items.len(), state.bytes);
            drop(state);
            let dropped = self.shared.dropped.fetch_add(1, Ordering::SeqCst) + 1;
            self.shared
                .dropped_queue_full
                .fetch_add(1, Ordering::SeqCst);
            // No place was kept for it: admission waited queue_wait in vain, or the
            // exchange ended before it got that far (a client that gave up waiting).
            if let Some(count) = self.shared.drop_due() {
                let s = &self.settings;
                let limit = if queued >= s.queue {
                    format!("capture.queue ({} records now)", s.queue)
                } else {
                    format!("capture.queue_bytes ({} bytes now)", s.queue_bytes)
                };
                tracing::warn!(
                    id = %record.id,
                    reason = "queue_full",
                    count,
                    dropped_total = dropped,
                    "capture queue full ({queued} records, {bytes} bytes waiting); record dropped: \
                     raise {limit} or capture.queue_wait ({}ms now) to keep bursts like this",
                    s.queue_wait.as_millis()
                );
            }
            return;
        }
        state.bytes += size;
        state.items.push_back(record.clone());
        let wake = state.writer_waiting;
        drop(state);
        if wake {
            self.shared.not_empty.notify_one();
        }
    }

    /// Admission knows the store's health and the queue's room, not whether this
    /// record will be written (that happens after the answer): a record the store
    /// refuses on its own data fails alone and leaves the store healthy (README,
    /// `capture.required`).
    fn admit(&self, record: &ExchangeRecord) -> Result<(), Refusal> {
        let required = self.settings.required;
        if required && !self.shared.healthy.load(Ordering::SeqCst) {
            return Err(Refusal::StoreFailing);
        }
        // The recorder already waited up to queue_wait for room: when it found some,
        // `has_room` kept the place then (a record landing since cannot take it).
        let mut state = self.shared.lock();
        let kept = match state.closed {
            true => state.reserved.contains(&record.id),
            false => self.promise(&mut state, record),
        };
        match (kept, required) {
            (true, _) => Ok(()),
            (false, true) => Err(Refusal::QueueFull),
            // It goes upstream; its record is dropped if the queue is still full.
            (false, false) => Ok(()),
        }
    }

    fn has_room(&self, record: &ExchangeRecord) -> bool {
        let mut state = self.shared.lock();
        state.closed || self.promise(&mut state, record)
    }

    fn room_freed(&self) -> Option<tokio::sync::futures::Notified<'_>> {
        Some(self.shared.room.notified())
    }

    fn flush(&self) {
        let deadline = Instant::now() + FLUSH_LIMIT;
        let (state, unwritten) =
            self.shared
                .wait_while(self.shared.lock(), &self.shared.idle, deadline, |s| {
                    !s.items.is_empty() || s.busy
                });
        if unwritten {
            tracing::error!(
                "capture flush gave up after {}s with {} record(s) unwritten",
                FLUSH_LIMIT.as_secs(),
                state.items.len()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A capture in a new store `name` whose queue holds 16 KiB of bodies.
    fn small_queue(name: &str) -> (std::path::PathBuf, Arc<Capture>) {
        let dir = std::env::temp_dir().join(format!("pg-capture-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let settings = CaptureSettings {
            store: dir.clone().into(),
            queue_bytes: 16 << 10,
            ..CaptureSettings::default()
        };
        let redactor = Arc::new(settings.redactor().unwrap());
        let capture = Capture::start(&settings, redactor, None).unwrap();
        (dir, capture)
    }

    /// An exchange whose request holds one user message of `n` bytes.
    fn exchange_of(n: usize) -> ExchangeRecord {
        let body = bytes::Bytes::from(format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "x".repeat(n)
        ));
        let mut r = ExchangeRecord::begin(
            ExchangeId::new(),
            None,
            http::Method::POST,
            "/v1/messages".into(),
        );
        r.set_request_body(body.clone(), body);
        r
    }

    #[test]
    fn records_after_close_are_counted_as_dropped_and_records_before_are_written() {
        let dir = std::env::temp_dir().join(format!("pg-capture-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let settings = CaptureSettings {
            store: dir.clone().into(),
            ..CaptureSettings::default()
        };
        let redactor = Arc::new(settings.redactor().unwrap());
        let capture = Capture::start(&settings, redactor, None).unwrap();
        let record = |path: &str| {
            let mut r =
                ExchangeRecord::begin(ExchangeId::new(), None, http::Method::POST, path.into());
            let body = bytes::Bytes::from_static(b"{\"messages\":[]}");
            r.set_request_body(body.clone(), body);
            r
        };
        for _ in 0..5 {
            capture.record(&record("/v1/messages"));
        }
        capture.flush();
        assert_eq!(capture.counters().written, 5, "flush waits for the writer");
        capture.close();
        capture.record(&record("/v1/late"));
        let c = capture.counters();
        assert_eq!((c.written, c.dropped, c.queued), (5, 1, 0));
        let store = Store::open_read_only(&dir.clone().into()).unwrap();
        assert_eq!(store.list(&store::Filter::default()).unwrap().len(), 5);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_promised_place_is_kept_past_the_byte_bound_and_takes_none_of_it() {
        let (dir, capture) = small_queue("admit");
        // A stalled disk, and a first record the writer takes and waits on with it.
        let blocker = rusqlite::Connection::open(dir.join(store::DB_FILE)).unwrap();
        blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
        capture.record(&exchange_of(10));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !capture.shared.lock().items.is_empty() {
            assert!(
                Instant::now() < deadline,
                "the writer never took the record"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // Three exchanges of ~6 KB admitted together, 18 KB against a 16 KiB queue:
        // being in flight takes no room, so each finds it and is promised a place.
        let [first, second, third, other, late, early] = [(); 6].map(|_| exchange_of(6000));
        // The look and the promise are one step: room found is kept while records land.
        assert!(capture.has_room(&early));
        for r in [&first, &second, &third] {
            assert!(capture.has_room(r), "a promise takes no bytes");
            capture.admit(r).unwrap();
        }
        // A record nobody promised a place to takes the room there is...
        capture.record(&other);
        // ...and the promised ones are kept past the byte bound.
        for r in [&first, &second, &third] {
            capture.record(r);
        }
        let state = capture.shared.lock();
        assert_eq!((state.items.len(), state.reserved.len()), (4, 1));
        assert!(state.bytes > 16 << 10, "{} bytes queued", state.bytes);
        drop(state);
        capture.admit(&early).unwrap();
        capture.record(&early);
        assert_eq!(capture.counters().dropped, 0);
        // Past its bound the queue admits nobody, and drops a record it promised nothing.
        assert!(!capture.has_room(&late));
        capture.record(&late);
        assert_eq!(capture.counters().dropped, 1);
        // One that holds no body (its client left while it waited for room) is kept.
        let left = ExchangeRecord::begin(
            ExchangeId::new(),
            None,
            http::Method::POST,
            "/v1/messages".into(),
        );
        capture.record(&left);
        assert_eq!(capture.counters().dropped, 1);
        blocker.execute_batch("ROLLBACK").unwrap();
        capture.close();
        assert_eq!(capture.counters().written, 7);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_writer_that_falls_behind_drops_records_past_the_byte_bound_and_counts_them() {
        let (dir, capture) = small_queue("behind");
        // A stalled disk: another connection holds the store's write lock.
        let blocker = rusqlite::Connection::open(dir.join(store::DB_FILE)).unwrap();
        blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
        for _ in 0..20 {
            capture.record(&exchange_of(4000));
            let queued = capture.shared.lock().bytes;
            assert!(queued <= 16 << 10, "{queued} bytes queued");
        }
        let behind = capture.counters();
        assert!(behind.dropped >= 10, "{behind:?}");
        blocker.execute_batch("ROLLBACK").unwrap();
        capture.close();
        let c = capture.counters();
        let error = capture.shared.last_error.lock().unwrap().clone();
        assert_eq!(
            (c.written + c.dropped, c.failed, c.queued),
            (20, 0, 0),
            "{c:?}: {error:?}"
        );
        let store = Store::open_read_only(&dir.clone().into()).unwrap();
        assert_eq!(
            store.list(&store::Filter::default()).unwrap().len() as u64,
            c.written
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
