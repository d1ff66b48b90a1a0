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

    /// Keeps `records` until the store is back; refuses once the spool is full.
    pub(super) fn keep(&mut self, records: &[CaptureRecord]) -> Result<(), StoreError> {
        let used = self.store.stats()?.used_bytes;
        if used >= self.max_bytes {
            return Err(StoreError::SpoolFull(self.dir.display().to_string(), used));
        }
        self.store.insert(records)?;
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

    /// The store took the records `ids`: they leave the spool.
    pub(super) fn moved(&mut self, ids: &[String]) -> Result<(), StoreError> {
        self.backoff = None;
        self.store.remove(ids)?;
        self.held = self.held.saturating_sub(ids.len() as u64);
        Ok(())
    }

    /// A try of the store failed: none before `retry` has passed, twice that after a
    /// second failure, and so on.
    pub(super) fn tried(&mut self, retry: Duration) {
        let wait = self.backoff.unwrap_or(retry);
        self.next_try = Instant::now() + wait;
        self.backoff = Some((wait * 2).min(MOST_BETWEEN_TRIES));
    }
}
