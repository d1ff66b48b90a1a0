//! Capture: every exchange kept once, redacted in memory, stored without repetition.
//! [`Capture`] (a [`RecordSink`]) only queues a record on the request path; a writer
//! thread redacts, cuts, compresses and writes it. A full queue is waited on for a
//! bounded time, then the record is dropped, counted and logged (or, with
//! `capture.required`, new requests are refused). It never holds a stream's bytes back.

pub mod analysis;
pub mod export;
pub mod layout;
pub mod record;
pub mod redact;
pub mod settings;
mod spool;
pub mod store;
pub mod timestamp;
pub mod units;

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::conversation::KeySource;
use crate::id::ExchangeId;
use crate::record::{ExchangeRecord, RecordSink};

pub use record::CaptureRecord;
pub use redact::Redactor;
pub use settings::{CaptureLayer, CaptureSettings};
pub use store::{Store, StoreError, StoreLocation};

/// Records written per transaction at most.
const BATCH: usize = 64;
/// How often the writer applies the retention.
const PRUNE_EVERY: Duration = Duration::from_secs(600);
/// How long the writer, woken from an empty queue, waits for more records.
const LINGER: Duration = Duration::from_millis(2);
/// How long the writer keeps draining the spool before it looks at new records.
const DRAIN_BUDGET: Duration = Duration::from_millis(500);
/// How long after a failed drain the store is tried again.
const DRAIN_RETRY: Duration = Duration::from_secs(1);
/// How long a shutdown waits for the queue to be written.
const FLUSH_LIMIT: Duration = Duration::from_secs(120);

/// Counters of the capture pipeline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    /// Records waiting for the writer.
    pub queued: u64,
    /// Body bytes those records hold.
    pub queued_bytes: u64,
    /// The last write succeeded.
    pub healthy: bool,
    pub written: u64,
    /// Records dropped because the queue stayed full.
    pub dropped: u64,
    /// Records the store failed to write.
    pub failed: u64,
    /// Records waiting in the spool for a PostgreSQL store to come back.
    pub spooled: u64,
}

struct QueueState {
    items: VecDeque<ExchangeRecord>,
    bytes: u64,
    /// Exchanges admitted under `capture.required`: their records have a place.
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
    written: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
    spooled: AtomicU64,
    /// The last write succeeded (what `capture.required` admits on).
    healthy: AtomicBool,
    /// Why the last failed write failed.
    last_error: Mutex<Option<String>>,
}

impl Shared {
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
pub struct Capture {
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

impl Capture {
    /// Opens the store at `settings.store` and starts the writer.
    /// `redactor` is the process's one redactor (the logs use it too).
    pub fn start(
        settings: &CaptureSettings,
        keys: KeySource,
        redactor: Arc<Redactor>,
        live: Option<Arc<crate::live::LiveFeed>>,
    ) -> Result<Arc<Capture>, StoreError> {
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
            written: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            spooled: AtomicU64::new(spool.as_ref().map_or(0, spool::Spool::held)),
            healthy: AtomicBool::new(true),
            last_error: Mutex::new(None),
        });
        let writer = Writer {
            shared: shared.clone(),
            store: StoreSlot {
                store,
                location: settings.store.clone(),
                next_try: Instant::now(),
            },
            cache: record::UnitCache::default(),
            redactor,
            keys,
            retention: settings.retention,
            repeats: BlockedRepeats::default(),
            live,
            spool,
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
    pub fn counters(&self) -> Counters {
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
            failed: self.shared.failed.load(Ordering::SeqCst),
            spooled: self.shared.spooled.load(Ordering::SeqCst),
        }
    }

    /// Where records wait while a PostgreSQL store is away (none for SQLite).
    pub fn spool_dir(&self) -> Option<&std::path::Path> {
        matches!(self.settings.store, StoreLocation::Postgres(_))
            .then_some(self.settings.spool_dir.as_path())
    }

    /// Why the store last failed to write, if it ever did.
    pub fn last_error(&self) -> Option<String> {
        self.shared
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether a record could be taken now: the store writes and the queue has room.
    pub fn can_take(&self) -> bool {
        self.shared.healthy.load(Ordering::SeqCst) && self.has_room()
    }

    /// Writes everything queued, stops the writer and checkpoints the store.
    pub fn close(&self) {
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

    /// No room for a record of `extra_bytes`. Admission (`reserving`) also counts the
    /// places promised to exchanges in flight; a record arriving does not, so the queue
    /// may hold up to twice its size while every promise is kept.
    fn full(&self, state: &QueueState, extra_bytes: u64, reserving: bool) -> bool {
        let promised = if reserving { state.reserved.len() } else { 0 };
        state.items.len() + promised >= self.settings.queue
            || (!state.items.is_empty() && state.bytes + extra_bytes > self.settings.queue_bytes)
    }
}

impl RecordSink for Capture {
    fn record(&self, record: &ExchangeRecord) {
        let size = record.held_bytes();
        let mut state = self.shared.lock();
        if state.closed {
            self.shared.dropped.fetch_add(1, Ordering::SeqCst);
            tracing::warn!(id = %record.id, "capture is closed; record dropped");
            return;
        }
        // Admission already waited (up to queue_wait) for room; still full now means drop.
        if !state.reserved.remove(&record.id) && self.full(&state, size, false) {
            drop(state);
            let dropped = self.shared.dropped.fetch_add(1, Ordering::SeqCst) + 1;
            tracing::warn!(
                id = %record.id,
                dropped_total = dropped,
                "capture queue still full after {}ms; record dropped",
                self.settings.queue_wait.as_millis()
            );
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

    fn admit(&self, record: &ExchangeRecord) -> Result<(), String> {
        if !self.settings.required {
            return Ok(());
        }
        if !self.shared.healthy.load(Ordering::SeqCst) {
            return Err("capture is required and the capture store is failing".into());
        }
        // The recorder already waited up to queue_wait for room (has_room).
        let mut state = self.shared.lock();
        if state.closed || self.full(&state, 0, true) {
            return Err("capture is required and the capture queue is full".into());
        }
        state.reserved.insert(record.id);
        Ok(())
    }

    fn has_room(&self) -> bool {
        let state = self.shared.lock();
        state.closed || !self.full(&state, 0, true)
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

/// The writer thread: takes records off the queue, redacts and stores them.
struct Writer {
    shared: Arc<Shared>,
    store: StoreSlot,
    cache: record::UnitCache,
    redactor: Arc<Redactor>,
    keys: KeySource,
    retention: store::Retention,
    repeats: BlockedRepeats,
    /// Where stored rows are announced, for the live viewer.
    live: Option<Arc<crate::live::LiveFeed>>,
    /// With a PostgreSQL store: where records wait while it is away.
    spool: Option<spool::Spool>,
}

/// The writer's store. A PostgreSQL store that was away when the replica started
/// is opened once it answers, tried at most once per [`DRAIN_RETRY`].
struct StoreSlot {
    store: Option<Store>,
    location: StoreLocation,
    next_try: Instant,
}

impl StoreSlot {
    fn get(&mut self) -> Result<&mut Store, StoreError> {
        if self.store.is_none() {
            if Instant::now() < self.next_try {
                return Err(StoreError::Unreachable(format!(
                    "{} (not answering; tried again in a moment)",
                    self.location
                )));
            }
            match Store::open(&self.location) {
                Ok(store) => {
                    tracing::info!("capture store {} answers", self.location);
                    self.store = Some(store);
                }
                Err(e) => {
                    self.next_try = Instant::now() + DRAIN_RETRY;
                    return Err(e);
                }
            }
        }
        self.store
            .as_mut()
            .ok_or_else(|| StoreError::Unreachable(self.location.to_string()))
    }
}

/// How long after a blocked request the same one counts as a client's retry of it.
const REPEAT_WINDOW_MS: u64 = 60_000;

/// The blocked requests of the last minute, by who sent them and the digest of
/// what was received: a client that retries a block (400s are retried) gets each
/// attempt recorded, linked to the first.
#[derive(Debug, Default)]
struct BlockedRepeats {
    first: std::collections::HashMap<String, (String, u64)>,
}

impl BlockedRepeats {
    /// The id of the attempt `r` repeats, if it is a blocked repeat; else notes it.
    fn link(&mut self, r: &CaptureRecord) -> Option<String> {
        if r.outcome != "blocked" {
            return None;
        }
        let who = r
            .conversation
            .as_deref()
            .or(r.client.as_deref())
            .unwrap_or("-");
        let key = format!("{who}|{}", r.received_digest);
        let now = r.times.started_ms;
        if self.first.len() > 4096 {
            self.first
                .retain(|_, (_, at)| now.saturating_sub(*at) <= REPEAT_WINDOW_MS);
        }
        match self.first.get(&key) {
            Some((id, at)) if now.saturating_sub(*at) <= REPEAT_WINDOW_MS => Some(id.clone()),
            _ => {
                self.first.insert(key, (r.id.clone(), now));
                None
            }
        }
    }
}

impl Writer {
    fn run(mut self) {
        let mut last_prune = Instant::now();
        loop {
            let batch: Vec<ExchangeRecord> = {
                let mut state = self.shared.lock();
                let mut waited = false;
                while state.items.is_empty() && !state.closed {
                    if self.spool.as_ref().is_some_and(spool::Spool::due) {
                        break;
                    }
                    let wait = match &self.spool {
                        Some(s) if s.held() > 0 => DRAIN_RETRY,
                        _ => PRUNE_EVERY,
                    };
                    state.writer_waiting = true;
                    state = self
                        .shared
                        .not_empty
                        .wait_timeout(state, wait)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    state.writer_waiting = false;
                    waited = true;
                    if state.items.is_empty() && last_prune.elapsed() >= PRUNE_EVERY {
                        break;
                    }
                }
                if waited && state.items.len() < BATCH && !state.closed {
                    // Woken by one record: let a few more arrive, so that a steady
                    // stream costs a wake-up per batch rather than per record.
                    drop(state);
                    std::thread::sleep(LINGER);
                    state = self.shared.lock();
                }
                if state.items.is_empty() && state.closed {
                    break;
                }
                let n = state.items.len().min(BATCH);
                let batch: Vec<ExchangeRecord> = state.items.drain(..n).collect();
                state.bytes -= batch
                    .iter()
                    .map(ExchangeRecord::held_bytes)
                    .sum::<u64>()
                    .min(state.bytes);
                state.busy = !batch.is_empty();
                batch
            };
            self.drain_spool();
            if !batch.is_empty() {
                self.write(&batch);
            }
            if last_prune.elapsed() >= PRUNE_EVERY {
                last_prune = Instant::now();
                let now = timestamp::now_ms();
                let retention = self.retention;
                if let Err(e) = self.store.get().and_then(|s| s.prune(&retention, now)) {
                    tracing::warn!("capture retention failed: {e}");
                }
            }
            let mut state = self.shared.lock();
            state.busy = false;
            if state.items.is_empty() {
                self.shared.idle.notify_all();
            }
        }
        self.drain_spool();
        if let Some(spool) = self.spool.as_ref().filter(|s| s.held() > 0) {
            tracing::warn!(
                "{} record(s) wait in the capture spool at {}; the next start moves them to the store",
                spool.held(),
                spool.dir().display()
            );
        }
        if let Some(Err(e)) = self.store.store.as_ref().map(Store::checkpoint) {
            tracing::warn!("capture checkpoint failed: {e}");
        }
        self.shared.idle.notify_all();
    }

    fn write(&mut self, batch: &[ExchangeRecord]) {
        let Writer {
            redactor,
            keys,
            cache,
            repeats,
            ..
        } = self;
        let mut records: Vec<CaptureRecord> = Vec::with_capacity(batch.len());
        for r in batch {
            // A record that cannot be prepared (a bug) is counted; the writer goes on.
            let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                CaptureRecord::redacted_with(r, redactor, keys, cache)
            }));
            match prepared {
                Ok(mut record) => {
                    record.repeat_of = repeats.link(&record);
                    records.push(record);
                }
                Err(_) => {
                    *cache = record::UnitCache::default();
                    let failed = self.shared.failed.fetch_add(1, Ordering::SeqCst) + 1;
                    tracing::error!(id = %r.id, failed_total = failed, "capture could not prepare a record");
                }
            }
        }
        if self.spool.as_ref().is_some_and(|s| s.held() > 0) {
            // Behind what already waits, so the store gets records in order.
            self.spool_records(&records);
            return;
        }
        let live = self.live.as_deref();
        match self
            .store
            .get()
            .and_then(|store| insert_announced(store, live, &records))
        {
            Ok(()) => self.stored(records.len() as u64),
            Err(StoreError::Unreachable(why)) if self.spool.is_some() => {
                let dir = self.spool.as_ref().map(|s| s.dir().display().to_string());
                tracing::warn!(
                    "capture store unreachable ({why}); records wait in the spool at {} until it is back",
                    dir.unwrap_or_default()
                );
                self.spool_records(&records);
            }
            Err(e) => self.failed(records.len() as u64, e),
        }
    }

    fn stored(&self, n: u64) {
        self.shared.written.fetch_add(n, Ordering::SeqCst);
        self.shared.healthy.store(true, Ordering::SeqCst);
    }

    fn failed(&self, n: u64, e: StoreError) {
        let failed = self.shared.failed.fetch_add(n, Ordering::SeqCst) + n;
        self.shared.healthy.store(false, Ordering::SeqCst);
        *self
            .shared
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        tracing::error!(
            failed_total = failed,
            "capture store failed to write {n} record(s): {e}"
        );
    }

    /// Into the spool: a record there counts as kept, so `capture.required` admits
    /// until the spool is full as well.
    fn spool_records(&mut self, records: &[CaptureRecord]) {
        let Some(spool) = self.spool.as_mut() else {
            return;
        };
        let kept = spool.keep(records);
        self.shared.spooled.store(spool.held(), Ordering::SeqCst);
        match kept {
            Ok(()) => self.shared.healthy.store(true, Ordering::SeqCst),
            Err(e) => self.failed(records.len() as u64, e),
        }
    }

    /// Moves what waits in the spool to the store, if it is time to try.
    fn drain_spool(&mut self) {
        let Writer {
            spool: Some(spool),
            store,
            live,
            shared,
            ..
        } = self
        else {
            return;
        };
        if !spool.due() {
            return;
        }
        let moved = spool.drain(DRAIN_BUDGET, DRAIN_RETRY, &mut |records| {
            insert_announced(store.get()?, live.as_deref(), records)
        });
        shared.spooled.store(spool.held(), Ordering::SeqCst);
        match moved {
            Ok(n) => {
                shared.written.fetch_add(n, Ordering::SeqCst);
                if spool.held() == 0 {
                    tracing::info!("capture store is back: the spool is drained");
                }
            }
            Err(StoreError::Unreachable(_)) => {}
            Err(e) => tracing::warn!("capture spool could not drain: {e}"),
        }
    }
}

/// Inserts `records`; while somebody watches the live feed, the rows they became
/// are read back and announced.
fn insert_announced(
    store: &mut Store,
    live: Option<&crate::live::LiveFeed>,
    records: &[CaptureRecord],
) -> Result<(), StoreError> {
    let watched = live.filter(|l| l.watched());
    let before = watched.and_then(|_| store.last_seq().ok());
    store.insert(records)?;
    if let (Some(live), Some(before)) = (watched, before) {
        let after = store::Filter {
            after_seq: Some(before),
            ..store::Filter::default()
        };
        match store.list(&after) {
            Ok(mut rows) => {
                rows.sort_by_key(|r| r.seq);
                live.stored(&rows);
            }
            Err(e) => tracing::warn!("reading stored rows for the viewer: {e}"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_after_close_are_counted_as_dropped_and_records_before_are_written() {
        let dir = std::env::temp_dir().join(format!("pg-capture-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let settings = CaptureSettings {
            store: dir.clone().into(),
            ..CaptureSettings::default()
        };
        let redactor = Arc::new(settings.redactor().unwrap());
        let capture = Capture::start(&settings, KeySource::default(), redactor, None).unwrap();
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
    fn a_writer_that_falls_behind_drops_records_past_the_byte_bound_and_counts_them() {
        let dir = std::env::temp_dir().join(format!("pg-capture-behind-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let settings = CaptureSettings {
            store: dir.clone().into(),
            queue_bytes: 16 << 10,
            ..CaptureSettings::default()
        };
        let redactor = Arc::new(settings.redactor().unwrap());
        let capture = Capture::start(&settings, KeySource::default(), redactor, None).unwrap();
        // A stalled disk: another connection holds the store's write lock.
        let blocker = rusqlite::Connection::open(dir.join(store::DB_FILE)).unwrap();
        blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
        let body = bytes::Bytes::from(format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "x".repeat(4000)
        ));
        for _ in 0..20 {
            let mut r = ExchangeRecord::begin(
                ExchangeId::new(),
                None,
                http::Method::POST,
                "/v1/messages".into(),
            );
            r.set_request_body(body.clone(), body.clone());
            capture.record(&r);
            let queued = capture.shared.lock().bytes;
            assert!(queued <= 16 << 10, "{queued} bytes queued");
        }
        let behind = capture.counters();
        assert!(behind.dropped >= 10, "{behind:?}");
        blocker.execute_batch("ROLLBACK").unwrap();
        capture.close();
        let c = capture.counters();
        assert_eq!(
            (c.written + c.dropped, c.failed, c.queued),
            (20, 0, 0),
            "{c:?}"
        );
        let store = Store::open_read_only(&dir.clone().into()).unwrap();
        assert_eq!(
            store.list(&store::Filter::default()).unwrap().len() as u64,
            c.written
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
