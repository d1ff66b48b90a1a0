//! The spool: while a PostgreSQL store is away, records wait in a local SQLite
//! store, and go to PostgreSQL oldest first once it is back. An exchange id is
//! unique in the store, so a record moved twice (a crash between its insert and
//! its removal here) is still stored once.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::record::CaptureRecord;
use super::store::{Store, StoreError, StoreLocation};

/// Records moved per PostgreSQL transaction while draining.
const DRAIN_BATCH: usize = 64;
/// The longest wait between tries of a store that keeps failing: a try against a
/// server that answers nothing holds the writer for the connect limit.
const MOST_BETWEEN_TRIES: Duration = Duration::from_secs(30);
/// The first wait after the spool's own disk refused a write (full, say): doubled
/// after each failure, up to [`MOST_BETWEEN_OWN_TRIES`], so a full disk is not
/// retried in a hot loop, and room coming back is noticed within seconds.
const OWN_RETRY: Duration = Duration::from_millis(50);
/// The longest wait between tries of a spool whose own writes keep failing.
const MOST_BETWEEN_OWN_TRIES: Duration = Duration::from_secs(5);

/// The local store records wait in.
pub(super) struct Spool {
    store: Store,
    dir: PathBuf,
    max_bytes: u64,
    /// Records in it now.
    held: u64,
    /// No drain before this: the store was away at the last try.
    next_try: Instant,
    /// The wait after the next failed try: doubled each time, up to
    /// [`MOST_BETWEEN_TRIES`]; back to the first once a drain succeeds.
    backoff: Option<Duration>,
    /// Where records the store refused on their own data are kept (opened on first use).
    rejected: Option<Store>,
    /// Records the store took that the spool could not delete yet (its disk full):
    /// deleted before anything else is moved, never sent again.
    unremoved: Vec<String>,
    /// Why the spool's own writes fail, while they do: said once when it starts
    /// and once when it ends, not on every try.
    failing: Option<String>,
}

impl Spool {
    /// Opens (or creates) the spool in `dir`; records a crash left there are kept.
    pub(super) fn open(dir: &Path, max_bytes: u64) -> Result<Spool, StoreError> {
        let store = Store::open(&StoreLocation::Dir(dir.to_path_buf()))?;
        let held = store.stats()?.records;
        Ok(Spool {
            store,
            dir: dir.to_path_buf(),
            max_bytes,
            held,
            next_try: Instant::now(),
            backoff: None,
            rejected: None,
            unremoved: Vec::new(),
            failing: None,
        })
    }

    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records waiting.
    pub(super) fn held(&self) -> u64 {
        self.held
    }

    /// Something waits and it is time to try the store again.
    pub(super) fn due(&self) -> bool {
        self.held > 0 && Instant::now() >= self.next_try
    }

    /// How long until [`Spool::due`] may hold.
    pub(super) fn until_due(&self) -> Duration {
        self.next_try.saturating_duration_since(Instant::now())
    }

    /// The spool's own writes fail now (its disk is full, say).
    pub(super) fn failing(&self) -> bool {
        self.failing.is_some()
    }

    /// Keeps `records` until the store is back; refuses once the spool is full.
    pub(super) fn keep(&mut self, records: &[CaptureRecord]) -> Result<(), StoreError> {
        let used = self.store.stats()?.used_bytes;
        if used >= self.max_bytes {
            return Err(StoreError::SpoolFull(self.dir.display().to_string(), used));
        }
        if let Err(e) = self.store.insert(records) {
            self.write_failed(&e);
            return Err(e);
        }
        self.write_ok();
        self.held += records.len() as u64;
        Ok(())
    }

    /// Keeps a record the store refused on its own data in `rejected/` beside the
    /// spool, where it stays (`promptgate captures list --captures <that dir>` reads
    /// it); refuses once that store is past the spool's size. Its directory.
    pub(super) fn reject(&mut self, record: &CaptureRecord) -> Result<PathBuf, StoreError> {
        let dir = self.dir.join("rejected");
        let store = match &mut self.rejected {
            Some(store) => store,
            empty => empty.insert(Store::open(&StoreLocation::Dir(dir.clone()))?),
        };
        let used = store.stats()?.used_bytes;
        if used >= self.max_bytes {
            return Err(StoreError::SpoolFull(dir.display().to_string(), used));
        }
        store.insert(std::slice::from_ref(record))?;
        Ok(dir)
    }

    /// The oldest records, a batch, with their ids; taken out by [`Spool::moved`]
    /// once the store has them.
    pub(super) fn oldest(&mut self) -> Result<(Vec<String>, Vec<CaptureRecord>), StoreError> {
        let ids = self.store.oldest(DRAIN_BATCH)?;
        if ids.is_empty() {
            self.held = 0;
        }
        let records = ids
            .iter()
            .map(|id| self.store.load(id))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((ids, records))
    }

    /// The store took the records `ids`: they leave the spool. When the spool cannot
    /// delete them (its disk full), they are remembered and deleted by a later
    /// [`Spool::forget_moved`], never moved again; tries wait, longer each time.
    pub(super) fn moved(&mut self, ids: &[String]) {
        self.unremoved.extend_from_slice(ids);
        self.forget_moved();
    }

    /// Deletes the records the store took and the spool still holds; whether none
    /// is left. A failure waits before the next try (see [`OWN_RETRY`]).
    pub(super) fn forget_moved(&mut self) -> bool {
        if self.unremoved.is_empty() {
            return true;
        }
        match self.store.remove(&self.unremoved) {
            Ok(()) => {
                self.held = self.held.saturating_sub(self.unremoved.len() as u64);
                self.unremoved.clear();
                self.backoff = None;
                self.write_ok();
                true
            }
            Err(e) => {
                self.write_failed(&e);
                self.tried_within(OWN_RETRY, MOST_BETWEEN_OWN_TRIES);
                false
            }
        }
    }

    /// The store took records sent to it directly: it is back, so what waits here
    /// moves now, unless the spool's own disk is what holds it up.
    pub(super) fn store_answers(&mut self) {
        if self.held > 0 && self.unremoved.is_empty() {
            self.backoff = None;
            self.next_try = Instant::now();
        }
    }

    /// A try of the store failed: none before `retry` has passed, twice that after a
    /// second failure, and so on.
    pub(super) fn tried(&mut self, retry: Duration) {
        self.tried_within(retry, MOST_BETWEEN_TRIES);
    }

    /// A try failed: the next waits `first`, or twice the last wait, at most `most`.
    fn tried_within(&mut self, first: Duration, most: Duration) {
        let wait = self.backoff.unwrap_or(first).min(most);
        self.next_try = Instant::now() + wait;
        self.backoff = Some((wait * 2).min(most));
    }

    /// A write to the spool failed: logged when the failing starts or its reason
    /// changes, not on every try.
    fn write_failed(&mut self, e: &StoreError) {
        let why = e.to_string();
        if self.failing.as_ref() != Some(&why) {
            tracing::warn!(
                "capture spool at {} cannot be written ({why}); its {} record(s) are kept, tried again at most every {} s until it can",
                self.dir.display(),
                self.held,
                MOST_BETWEEN_OWN_TRIES.as_secs()
            );
            self.failing = Some(why);
        }
    }

    /// A write to the spool succeeded: a failing that was logged is over.
    fn write_ok(&mut self) {
        if self.failing.take().is_some() {
            tracing::info!(
                "capture spool at {} can be written again",
                self.dir.display()
            );
        }
    }
}
