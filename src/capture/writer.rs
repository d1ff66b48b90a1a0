//! The writer thread: takes records off the queue, redacts them and hands them to
//! the store's own thread. With a PostgreSQL store, a store that does not answer
//! within [`PATIENCE`] holds only that thread: the writer goes on and puts new
//! records in the spool until the store answers again, so the queue never fills
//! behind a hung server.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::record::{self, CaptureRecord};
use super::spool;
use super::store::{self, Store, StoreError, StoreLocation};
use super::{BATCH, Shared, timestamp};
use crate::record::{ExchangeRecord, StoredNotice};
use crate::redact::Redactor;

/// How often the writer applies the retention.
const PRUNE_EVERY: Duration = Duration::from_secs(600);
/// How long the writer, woken from an empty queue, waits for more records.
const LINGER: Duration = Duration::from_millis(2);
/// How long the writer keeps draining the spool before it looks at new records.
const DRAIN_BUDGET: Duration = Duration::from_millis(500);
/// How long after a failed try the store is tried again.
pub(super) const DRAIN_RETRY: Duration = Duration::from_secs(1);
/// How long the writer waits at most for a store with a spool before it spools
/// instead (a batch takes milliseconds to a store that is well); never more than
/// half the queue's wait for room, so that nothing is dropped meanwhile.
const PATIENCE: Duration = Duration::from_secs(1);
/// How often a writer with a store call outstanding looks for its answer.
const POLL: Duration = Duration::from_millis(50);
/// How long after a blocked request the same one counts as a client's retry of it.
const REPEAT_WINDOW_MS: u64 = 60_000;

/// The writer thread's state.
pub(super) struct Writer {
    pub(super) shared: Arc<Shared>,
    pub(super) store: StoreThread,
    pub(super) cache: record::UnitCache,
    pub(super) redactor: Arc<Redactor>,
    pub(super) retention: store::Retention,
    pub(super) repeats: BlockedRepeats,
    /// With a PostgreSQL store: where records wait while it is away or slow.
    pub(super) spool: Option<spool::Spool>,
    /// How long to wait for a store with a spool (see [`PATIENCE`]).
    pub(super) patience: Duration,
}

impl Writer {
    pub(super) fn run(mut self) {
        let mut last_prune = Instant::now();
        loop {
            self.collect();
            let batch: Vec<ExchangeRecord> = {
                let mut state = self.shared.lock();
                let mut waited = false;
                while state.items.is_empty() && !state.closed {
                    // A drain is due only once the store is free: with a call still
                    // outstanding, breaking here would spin until it answers.
                    if self.store.outstanding == 0
                        && self.spool.as_ref().is_some_and(spool::Spool::due)
                    {
                        break;
                    }
                    let wait = if self.store.outstanding > 0 {
                        POLL
                    } else {
                        match &self.spool {
                            // Until the next try is due (sooner after a spool write failed).
                            Some(s) if s.held() > 0 => {
                                s.until_due().clamp(Duration::from_millis(1), DRAIN_RETRY)
                            }
                            _ => PRUNE_EVERY,
                        }
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
                    if state.items.is_empty()
                        && (last_prune.elapsed() >= PRUNE_EVERY || self.store.outstanding > 0)
                    {
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
                state.busy = !batch.is_empty() || self.store.outstanding > 0;
                if !batch.is_empty() {
                    self.shared.room.notify_waiters();
                }
                batch
            };
            self.collect();
            self.drain_spool();
            if !batch.is_empty() {
                self.write(&batch);
            }
            if last_prune.elapsed() >= PRUNE_EVERY && self.store.outstanding == 0 {
                last_prune = Instant::now();
                self.store
                    .send(Job::Prune(self.retention, timestamp::now_ms()));
            }
            let mut state = self.shared.lock();
            state.busy = self.store.outstanding > 0;
            if state.items.is_empty() && !state.busy {
                self.shared.idle.notify_all();
            }
        }
        // Shutting down: what the store still holds is answered or given up on.
        while self.store.outstanding > 0 {
            match self.store.done.recv() {
                Ok(done) => self.handle(done),
                Err(_) => break,
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
        self.store.send(Job::Checkpoint);
        self.wait(None);
        self.shared.idle.notify_all();
    }

    fn write(&mut self, batch: &[ExchangeRecord]) {
        let Writer {
            redactor,
            cache,
            repeats,
            ..
        } = self;
        let mut records: Vec<CaptureRecord> = Vec::with_capacity(batch.len());
        for r in batch {
            // A record that cannot be prepared (a bug) is counted; the writer goes on.
            let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                CaptureRecord::redacted_with(r, redactor, cache)
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
        if self
            .spool
            .as_ref()
            .is_some_and(|s| self.store.outstanding > 0 || (s.held() > 0 && !s.failing()))
        {
            // Behind what already waits (or while the store has not answered), so
            // the store gets records in order and the writer never waits on it. A
            // spool that cannot be written (its disk full) is passed by: the store,
            // if it answers, is the only place left for them.
            self.spool_records(records);
            return;
        }
        self.store.send(Job::Insert {
            records,
            spooled: Vec::new(),
        });
        self.wait(self.patience());
    }

    /// How long to wait for the store: bounded only when records can wait elsewhere.
    fn patience(&self) -> Option<Duration> {
        self.spool.as_ref().map(|_| self.patience)
    }

    /// The patience for a queue whose records wait `queue_wait` for room.
    pub(super) fn patience_for(queue_wait: Duration) -> Duration {
        (queue_wait / 2).min(PATIENCE)
    }

    /// Waits for the store's answers, up to `limit` (`None`: until it answers).
    fn wait(&mut self, limit: Option<Duration>) {
        let until = limit.map(|l| Instant::now() + l);
        while self.store.outstanding > 0 {
            let done = match until {
                None => self.store.done.recv().ok(),
                Some(until) => {
                    let left = until.saturating_duration_since(Instant::now());
                    match self.store.done.recv_timeout(left) {
                        Ok(done) => Some(done),
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            tracing::warn!(
                                "capture store has not answered in {} ms; new records wait in the spool",
                                self.patience.as_millis()
                            );
                            return;
                        }
                        Err(mpsc::RecvTimeoutError::Disconnected) => None,
                    }
                }
            };
            match done {
                Some(done) => self.handle(done),
                None => {
                    self.store.outstanding = 0;
                    return;
                }
            }
        }
    }

    /// Takes whatever the store has answered by now.
    fn collect(&mut self) {
        while self.store.outstanding > 0 {
            match self.store.done.try_recv() {
                Ok(done) => self.handle(done),
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.store.outstanding = 0;
                    return;
                }
            }
        }
    }

    fn handle(&mut self, done: Done) {
        self.store.outstanding = self.store.outstanding.saturating_sub(1);
        match done {
            Done::Inserted {
                n,
                spooled,
                rejected,
            } if spooled.is_empty() => {
                self.store.away = false;
                if let Some(spool) = self.spool.as_mut() {
                    spool.store_answers();
                }
                self.rejected(rejected);
                self.stored(n);
            }
            Done::Inserted {
                n,
                spooled,
                rejected,
            } => {
                self.store.away = false;
                self.rejected(rejected);
                let Some(spool) = self.spool.as_mut() else {
                    return;
                };
                // Kept to be deleted later if the spool cannot delete them now.
                spool.moved(&spooled);
                self.shared.written.fetch_add(n, Ordering::SeqCst);
                self.spool_shrank();
            }
            Done::NotInserted { spooled, error, .. } if !spooled.is_empty() => {
                if let Some(spool) = self.spool.as_mut() {
                    spool.tried(DRAIN_RETRY);
                }
                if matches!(
                    error,
                    StoreError::Unreachable(_) | StoreError::Tls(_) | StoreError::Login(_)
                ) {
                    self.store.away = true;
                } else {
                    tracing::warn!("capture spool could not drain: {error}");
                }
            }
            // A certificate refused once the replica runs (a rotation gone wrong)
            // is a store away too: the records wait for it to be fixed.
            Done::NotInserted {
                records,
                // A password changed while it runs: the records wait for it too.
                error: StoreError::Unreachable(why) | StoreError::Tls(why) | StoreError::Login(why),
                ..
            } if self.spool.is_some() => {
                if !std::mem::replace(&mut self.store.away, true) {
                    let dir = self.spool.as_ref().map(|s| s.dir().display().to_string());
                    tracing::warn!(
                        "capture store unreachable ({why}); records wait in the spool at {} until it is back",
                        dir.unwrap_or_default()
                    );
                }
                if let Some(spool) = self.spool.as_mut() {
                    spool.tried(DRAIN_RETRY);
                }
                self.spool_records(records);
            }
            Done::NotInserted { records, error, .. } => self.failed(records.len() as u64, error),
            Done::Pruned(Err(e)) => tracing::warn!("capture retention failed: {e}"),
            Done::Pruned(Ok(_)) => {}
            Done::Checkpointed(Err(e)) => tracing::warn!("capture checkpoint failed: {e}"),
            Done::Checkpointed(Ok(())) => {}
        }
    }

    /// Records the store refused on their own data (see
    /// [`StoreError::is_record_error`]): each counted as failed and logged once with
    /// its id; with a spool, kept in its `rejected/` store, never moved again. The
    /// store is not marked failing: the next record (and, with `capture.required`, the
    /// next request) is not refused for this one.
    fn rejected(&mut self, rejected: Vec<(CaptureRecord, StoreError)>) {
        for (record, error) in rejected {
            let failed = self.shared.failed.fetch_add(1, Ordering::SeqCst) + 1;
            let kept = self.spool.as_mut().map(|s| s.reject(&record));
            match kept {
                Some(Ok(dir)) => tracing::error!(
                    id = %record.id,
                    failed_total = failed,
                    "capture store refused the record ({error}); kept in {}",
                    dir.display()
                ),
                Some(Err(e)) => tracing::error!(
                    id = %record.id,
                    failed_total = failed,
                    "capture store refused the record ({error}), and so did the spool ({e}); record lost"
                ),
                None => tracing::error!(
                    id = %record.id,
                    failed_total = failed,
                    "capture store refused the record ({error}); record lost"
                ),
            }
        }
    }

    /// Records left the spool for the store: the store took them, and the spool has
    /// room again (a full spool had marked the capture failing); once it is empty,
    /// what went wrong is over and /healthz no longer shows it.
    fn spool_shrank(&mut self) {
        let Some(spool) = self.spool.as_ref() else {
            return;
        };
        self.shared.spooled.store(spool.held(), Ordering::SeqCst);
        self.healthy();
        if spool.held() == 0 {
            *self
                .shared
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = None;
            tracing::info!("capture store is back: the spool is drained");
        }
    }

    fn stored(&self, n: u64) {
        self.shared.written.fetch_add(n, Ordering::SeqCst);
        self.healthy();
    }

    /// A write succeeded: a failing capture is well again, said once.
    fn healthy(&self) {
        if !self.shared.healthy.swap(true, Ordering::SeqCst) {
            tracing::info!(
                failed_total = self.shared.failed.load(Ordering::SeqCst),
                "capture writes again"
            );
        }
    }

    /// Records counted failed; logged when the capture starts failing or the reason
    /// changes, not for every batch (the count is in /healthz and /metrics).
    fn failed(&self, n: u64, e: StoreError) {
        let failed = self.shared.failed.fetch_add(n, Ordering::SeqCst) + n;
        let was_healthy = self.shared.healthy.swap(false, Ordering::SeqCst);
        let why = e.to_string();
        let changed = {
            let mut last = self
                .shared
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let changed = last.as_deref() != Some(why.as_str());
            *last = Some(why);
            changed
        };
        if was_healthy || changed {
            tracing::error!(
                failed_total = failed,
                "capture store failed to write {n} record(s): {e}; later failures are counted, not logged, until it writes again"
            );
        }
    }

    /// Into the spool: a record there counts as kept, so `capture.required` admits
    /// until the spool is full as well.
    fn spool_records(&mut self, records: Vec<CaptureRecord>) {
        let Some(spool) = self.spool.as_mut() else {
            return;
        };
        let kept = spool.keep(&records);
        self.shared.spooled.store(spool.held(), Ordering::SeqCst);
        match kept {
            Ok(()) => self.healthy(),
            Err(e) => self.failed(records.len() as u64, e),
        }
    }

    /// Moves what waits in the spool to the store, a batch at a time, if it is time
    /// to try, while the store answers and for at most [`DRAIN_BUDGET`].
    fn drain_spool(&mut self) {
        let until = Instant::now() + DRAIN_BUDGET;
        while self.store.outstanding == 0 && Instant::now() < until {
            let Some(spool) = self.spool.as_mut().filter(|s| s.due()) else {
                return;
            };
            // What the store already took is deleted first; until it is, nothing moves.
            let before = spool.held();
            if !spool.forget_moved() {
                return;
            }
            if spool.held() < before {
                self.spool_shrank();
                continue;
            }
            let (spooled, records) = match spool.oldest() {
                Ok(batch) => batch,
                Err(e) => {
                    tracing::warn!("capture spool could not be read: {e}");
                    spool.tried(DRAIN_RETRY);
                    return;
                }
            };
            if records.is_empty() {
                return;
            }
            self.store.send(Job::Insert { records, spooled });
            self.wait(self.patience());
        }
    }
}

/// What the store's thread is asked to do.
pub(super) enum Job {
    /// Store records; `spooled` names them in the spool when they come from it.
    Insert {
        records: Vec<CaptureRecord>,
        spooled: Vec<String>,
    },
    Prune(store::Retention, u64),
    Checkpoint,
}

/// What the store's thread answers, one per job.
pub(super) enum Done {
    Inserted {
        n: u64,
        spooled: Vec<String>,
        /// Records the store refused on their own data, with why; the others are stored.
        rejected: Vec<(CaptureRecord, StoreError)>,
    },
    /// The store did not take them: they come back, with why.
    NotInserted {
        records: Vec<CaptureRecord>,
        spooled: Vec<String>,
        error: StoreError,
    },
    Pruned(Result<store::Pruned, StoreError>),
    Checkpointed(Result<(), StoreError>),
}

/// The store on a thread of its own.
pub(super) struct StoreThread {
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<Done>,
    /// Jobs sent and not answered yet.
    outstanding: usize,
    /// The store's last answer was that it is away: said once, not per batch.
    away: bool,
}

impl StoreThread {
    /// Starts the thread over `store` (`None`: a PostgreSQL store that was away at
    /// start, opened once it answers); stored rows are announced to `live`.
    pub(super) fn start(
        store: Option<Store>,
        location: StoreLocation,
        live: Option<Arc<dyn StoredNotice>>,
    ) -> Result<StoreThread, StoreError> {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (outbox, done) = mpsc::channel::<Done>();
        let mut slot = StoreSlot {
            store,
            location,
            next_try: Instant::now(),
        };
        std::thread::Builder::new()
            .name("capture-store".into())
            .spawn(move || {
                for job in inbox {
                    let answer = match job {
                        Job::Insert {
                            mut records,
                            spooled,
                        } => {
                            match slot
                                .get()
                                .and_then(|s| insert_each(s, live.as_deref(), &records))
                            {
                                Ok(refused) => {
                                    let rejected = take_refused(&mut records, refused);
                                    Done::Inserted {
                                        n: records.len() as u64,
                                        spooled,
                                        rejected,
                                    }
                                }
                                Err(error) => Done::NotInserted {
                                    records,
                                    spooled,
                                    error,
                                },
                            }
                        }
                        Job::Prune(retention, now) => {
                            Done::Pruned(slot.get().and_then(|s| s.prune(&retention, now)))
                        }
                        Job::Checkpoint => Done::Checkpointed(match slot.store.as_ref() {
                            Some(s) => s.checkpoint(),
                            None => Ok(()),
                        }),
                    };
                    if outbox.send(answer).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| StoreError::Io {
                path: "capture store thread".into(),
                source: e,
            })?;
        Ok(StoreThread {
            jobs,
            done,
            outstanding: 0,
            away: false,
        })
    }

    fn send(&mut self, job: Job) {
        if self.jobs.send(job).is_ok() {
            self.outstanding += 1;
        }
    }
}

/// The store. A PostgreSQL store that was away when the replica started is opened
/// once it answers, tried at most once per [`DRAIN_RETRY`].
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

/// The blocked requests of the last minute, by who sent them and the digest of
/// what was received: a client that retries a block (400s are retried) gets each
/// attempt recorded, linked to the first.
#[derive(Debug, Default)]
pub(super) struct BlockedRepeats {
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

/// Inserts `records`; when the batch fails on one record's own data, each is tried
/// alone, so that one record cannot keep the others out. The places of the records
/// the store refused, with why; any other failure is the store's, for all of them
/// (a retry skips those already stored: an id is stored once).
fn insert_each(
    store: &mut Store,
    live: Option<&dyn crate::record::StoredNotice>,
    records: &[CaptureRecord],
) -> Result<Vec<(usize, StoreError)>, StoreError> {
    match insert_announced(store, live, records) {
        Ok(()) => return Ok(Vec::new()),
        Err(e) if !e.is_record_error() => return Err(e),
        Err(_) => {}
    }
    let mut refused = Vec::new();
    for (i, record) in records.iter().enumerate() {
        match insert_announced(store, live, std::slice::from_ref(record)) {
            Ok(()) => {}
            Err(e) if e.is_record_error() => refused.push((i, e)),
            Err(e) => return Err(e),
        }
    }
    Ok(refused)
}

/// Moves the refused records (by place, ascending) out of `records`.
fn take_refused(
    records: &mut Vec<CaptureRecord>,
    refused: Vec<(usize, StoreError)>,
) -> Vec<(CaptureRecord, StoreError)> {
    refused
        .into_iter()
        .rev()
        .map(|(i, e)| (records.remove(i), e))
        .rev()
        .collect()
}

/// Inserts `records`; while somebody watches the live feed, the rows they became
/// are read back and announced.
fn insert_announced(
    store: &mut Store,
    live: Option<&dyn StoredNotice>,
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
                for row in &rows {
                    live.stored(row.seq, &serde_json::to_vec(row).unwrap_or_default());
                }
            }
            Err(e) => tracing::warn!("reading stored rows for the viewer: {e}"),
        }
    }
    Ok(())
}
