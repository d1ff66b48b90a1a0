//! The capture store, behind one interface with two databases: SQLite in a
//! directory (the embedded default, `sqlite.rs`) or a PostgreSQL server that a fleet
//! of replicas shares (`postgres.rs`). Each distinct unit is kept once,
//! zstd-compressed, under its content digest; a record keeps its metadata and, per
//! body, the layout of its units. It stores what it is given: redaction is done.
//! Every statement is written once (`sql.rs`); the pipeline and the readers never
//! ask which database is behind it.

mod budgets;
mod meta;
mod pg_tls;
mod postgres;
mod sql;
mod sqlite;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::layout::{self, Parts};
use super::record::{BodyInfo, CaptureRecord};
use crate::digest::{self, DigestMap, DigestSet};
use crate::prompt::{Format, Prompt};
use sql::{Connection, Dialect, SqlRow, Value};

/// The file name of the store inside the captures directory.
pub const DB_FILE: &str = "promptgate.db";

/// Bytes the store in `dir` takes on disk: the database, its write-ahead log and
/// shared-memory index (0 for what does not exist).
pub(crate) fn size_on_disk(dir: &Path) -> u64 {
    ["", "-wal", "-shm"]
        .iter()
        .filter_map(|suffix| std::fs::metadata(dir.join(format!("{DB_FILE}{suffix}"))).ok())
        .map(|m| m.len())
        .sum()
}

/// zstd level for units and records: most of the saving comes from storing each unit
/// once. Level 1 against 3 (callgrind, conversations): the store's work per record
/// −8 % (1.03M → 0.94M instructions), for 2.8 % more unit bytes.
const ZSTD_LEVEL: i32 = 1;
/// Unit hashes remembered in memory to skip a lookup (about 3 MB at most; the
/// lookup they save is one index probe).
const KNOWN_UNITS: usize = 50_000;
/// Bytes reserved up front for a unit being read back: its stored size, up to this
/// (a larger one grows as it decompresses). A damaged size allocates no more.
const UNIT_PREALLOC: usize = 16 << 20;
/// Units deleted per transaction by retention, so writers wait for one batch at most.
const DELETE_BATCH: usize = 500;
/// How long the index of cached prefixes keeps a row: past the longest cache ttl
/// (1 h), nobody reads that prefix from the provider's cache any more.
const PREFIX_INDEX_KEEP_MS: u64 = 2 * 3_600_000;

/// Where the store is: a directory holding SQLite's file, or a PostgreSQL URL
/// (`postgres://user@host:port/db`; never with a password in it).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum StoreLocation {
    Dir(PathBuf),
    Postgres(String),
}

impl StoreLocation {
    /// The directory, for a SQLite store.
    pub fn dir(&self) -> Option<&Path> {
        match self {
            StoreLocation::Dir(d) => Some(d),
            StoreLocation::Postgres(_) => None,
        }
    }

    /// Relative to `base` (a config file's directory), for a directory.
    pub fn relative_to(self, base: Option<&Path>) -> StoreLocation {
        match (self, base) {
            (StoreLocation::Dir(d), Some(base)) if d.is_relative() => {
                StoreLocation::Dir(base.join(d))
            }
            (other, _) => other,
        }
    }
}

impl std::str::FromStr for StoreLocation {
    type Err = StoreError;

    fn from_str(text: &str) -> Result<StoreLocation, StoreError> {
        if text.starts_with("postgres://") || text.starts_with("postgresql://") {
            if let Some(problem) = postgres::url_problem(text) {
                return Err(StoreError::Url(problem));
            }
            return Ok(StoreLocation::Postgres(text.to_owned()));
        }
        Ok(StoreLocation::Dir(PathBuf::from(text)))
    }
}

impl TryFrom<String> for StoreLocation {
    type Error = StoreError;
    fn try_from(text: String) -> Result<StoreLocation, StoreError> {
        text.parse()
    }
}

impl From<StoreLocation> for String {
    fn from(location: StoreLocation) -> String {
        location.to_string()
    }
}

impl From<PathBuf> for StoreLocation {
    fn from(dir: PathBuf) -> StoreLocation {
        StoreLocation::Dir(dir)
    }
}

impl std::fmt::Display for StoreLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreLocation::Dir(d) => write!(f, "{}", d.display()),
            StoreLocation::Postgres(url) => f.write_str(url),
        }
    }
}

/// What can go wrong with the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "no captures in {0} (start promptgate with --captures DIR|URL, or pass the same --captures here)"
    )]
    Missing(String),
    #[error("{0}: written by a newer promptgate (schema {1}, this one knows up to {2})")]
    Newer(String, i64, i64),
    #[error("no capture {0:?}")]
    NotFound(String),
    #[error("{0:?} matches {1} captures; give more of the id")]
    Ambiguous(String, usize),
    #[error(
        "{0:?} is not a capture reference: `@-N` takes a whole number N >= 0 (`@-1` is the one before `last`)"
    )]
    BadReference(String),
    #[error("capture store is damaged: {0}")]
    Corrupt(String),
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("postgres: {0}")]
    Postgres(String),
    /// PostgreSQL refused one record's own data (a value out of range, a constraint):
    /// the store is well, and other records still go.
    #[error("postgres refused the data: {0}")]
    Rejected(String),
    #[error("cannot reach PostgreSQL at {0}")]
    Unreachable(String),
    /// PostgreSQL refused the login (no password, a wrong one): at start this stops
    /// `serve` rather than spooling for a store that will never take the records.
    #[error(
        "PostgreSQL refused the login at {0}: set PGPASSWORD (or a passfile: PGPASSFILE, ~/.pgpass); the store URL must not carry the password"
    )]
    Login(String),
    #[error("TLS to PostgreSQL: {0}")]
    Tls(String),
    #[error("the capture spool at {0} is full ({1} bytes; capture.spool_max_size)")]
    SpoolFull(String, u64),
    #[error("store URL: {0}")]
    Url(String),
    #[error("the store is open for reading only")]
    ReadOnly,
    #[error("zstd: {0}")]
    Zstd(std::io::Error),
}

impl StoreError {
    /// The database refused a record's own data, not the store being away or broken:
    /// that record fails alone (see the writer), the store stays healthy.
    pub(crate) fn is_record_error(&self) -> bool {
        use rusqlite::ErrorCode::{ConstraintViolation, TooBig, TypeMismatch};
        match self {
            StoreError::Rejected(_) => true,
            StoreError::Sqlite(e) => matches!(
                e.sqlite_error_code(),
                Some(ConstraintViolation | TooBig | TypeMismatch)
            ),
            _ => false,
        }
    }
}

/// A record that could not be read whole (its metadata, a body or a unit of it is
/// damaged): verbs that read many records leave it out, name it, and go on.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Damaged {
    pub id: String,
    /// What is wrong with it.
    pub reason: String,
}

impl Damaged {
    /// `loaded` (the record `id`) as `Some`, or `None` with its damage noted in
    /// `into`; any other error (the store itself failing) is passed on.
    pub fn sift(
        id: &str,
        loaded: Result<CaptureRecord, StoreError>,
        into: &mut Vec<Damaged>,
    ) -> Result<Option<CaptureRecord>, StoreError> {
        match loaded {
            Ok(record) => Ok(Some(record)),
            Err(e @ StoreError::Corrupt(_)) => {
                into.push(Damaged {
                    id: id.to_owned(),
                    reason: e.to_string(),
                });
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// How long and how much to keep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    pub max_age: Option<Duration>,
    pub max_size: Option<u64>,
}

/// Which records a listing shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub since_ms: Option<u64>,
    /// Only records that started before this.
    pub until_ms: Option<u64>,
    /// A model name; `*` matches any run of characters.
    pub model: Option<String>,
    /// A conversation key or its start.
    pub conversation: Option<String>,
    pub outcome: Option<String>,
    /// Text that must occur in the record (its metadata or any of its bodies).
    pub grep: Option<String>,
    /// At most this many, the most recent.
    pub limit: Option<usize>,
    /// Skip this many of the most recent matches first (paging with `limit`).
    pub offset: Option<usize>,
    /// `anthropic` or `openai`.
    pub provider: Option<String>,
    /// Only records this rule fired on.
    pub rule: Option<String>,
    /// A cache verdict: `hit`, `partial`, `miss`, `write`, `none`, `unexplained`.
    pub verdict: Option<String>,
    /// Only records with this tag.
    pub tag: Option<String>,
    /// A glob on the path (`*` matches anything); without a `?` it also matches the
    /// path without its query.
    pub path: Option<String>,
    /// `reverse` or `forward`.
    pub mode: Option<String>,
    /// `Some(false)`: model calls only; `Some(true)`: side requests only.
    pub side: Option<bool>,
    /// Only records stored after the one of this [`Row::seq`].
    pub after_seq: Option<i64>,
}

/// One line of a listing.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Row {
    pub id: String,
    pub started_ms: u64,
    pub conversation: Option<String>,
    pub model: Option<String>,
    pub provider: Option<String>,
    pub status: Option<u16>,
    pub outcome: String,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cache_read_tokens: Option<u64>,
    pub cache_write_tokens: Option<u64>,
    pub rules: Vec<String>,
    /// The cache verdict in a few words (`hit`, `partial system[2]`, `MISS ttl`).
    pub cache: Option<String>,
    /// Its place in storing order (SQLite's rowid): records land when their
    /// exchange ends, so a follower asks for what came after the last one it saw.
    pub seq: i64,
    pub tags: Vec<String>,
    /// Path and query, redacted (`None` in a store older than schema 3).
    pub path: Option<String>,
    /// Not a model call (see [`Filter::side`]).
    pub side: bool,
    /// The whole cost at the provider's prices, when the cache analysis priced it.
    pub cost_usd: Option<f64>,
}

/// One conversation: its requests, tokens and cost.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ConversationRow {
    pub conversation: Option<String>,
    pub requests: u64,
    pub models: Vec<String>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
    /// What its priced requests cost (`None`: none was priced).
    pub cost_usd: Option<f64>,
    pub first_ms: u64,
    pub last_ms: u64,
}

/// What a prune removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    pub records: u64,
    pub units: u64,
}

/// Sizes, for reports and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub records: u64,
    pub units: u64,
    /// Uncompressed bytes of all units.
    pub unit_bytes: u64,
    /// Compressed bytes of all units.
    pub stored_unit_bytes: u64,
    /// Bytes of the database in use (pages minus free pages).
    pub used_bytes: u64,
}

/// An open store. See the module docs.
pub struct Store {
    conn: Box<dyn Connection>,
    location: StoreLocation,
    units: UnitWriter,
    /// The schema of the store (older than the build's only when read-only).
    version: i64,
}

/// How long a writer trusts that a unit it stored or found is still there without
/// asking again; each time it asks it marks the unit used (`units.used_ms`).
const TOUCH_EVERY: Duration = Duration::from_secs(300);
/// Garbage collection removes a unit no record uses only once nobody has marked it
/// used for this long: twice [`TOUCH_EVERY`], and a margin for the replicas' clocks
/// and a writer's transaction. So a record another replica commits after the
/// collection looked, with a unit it trusted from memory, never loses that unit.
const UNTOUCHED_FOR: Duration = Duration::from_secs(2 * 300 + 600);

/// Writes units: remembers the ids of units already stored (a lookup saved per unit)
/// and keeps one zstd context for every unit, and one for every record's metadata.
struct UnitWriter {
    /// Each unit's id, and when this writer last marked it used.
    known: DigestMap<(i64, Instant)>,
    /// The last bodies laid out, newest last: a body stored again (a resend takes
    /// the parts stored for it) is laid out as it was, its units not looked up.
    // 200 KB resend, full, c16: the store thread 66–75 → 60–65 µs a record (/proc).
    laid_out: std::collections::VecDeque<LaidOut>,
    /// The units of each conversation's last request body, by place.
    placed: std::collections::VecDeque<PlacedIds>,
    /// Ids found by place (tests).
    #[cfg(test)]
    placed_hits: usize,
    zstd: zstd::bulk::Compressor<'static>,
    /// Made on the first record written: a reader's store never needs it.
    meta: Option<meta::MetaWriter>,
    touch_every: Duration,
}

/// A body's layout (`layout::encode`), trusted as [`UnitWriter::known`] is: until
/// `TOUCH_EVERY` after the oldest mark of its units.
struct LaidOut {
    parts: std::sync::Arc<Parts>,
    layout: Vec<u8>,
    marked: Instant,
    /// The bytes its parts keep alive.
    size: usize,
}

/// A conversation's last request body: its units' digests and ids in order, trusted
/// as a layout is. The next turn sends most of them again in the same order and
/// takes their ids here, not from [`UnitWriter::known`].
// Conversations at the 400 KB band, full, c16: the lookups in `known` (a cold bucket
// a unit) grew with the body (perf).
struct PlacedIds {
    conversation: String,
    /// The units' digests (the skeleton's left out), and their ids.
    hashes: crate::prompt::DigestPlaces,
    ids: Vec<i64>,
    marked: Instant,
}

impl PlacedIds {
    /// The id of the unit at `cursor` or a few places on whose digest is `hash`;
    /// the cursor moves past it.
    fn find(&self, cursor: &mut usize, hash: &[u8; 32]) -> Option<i64> {
        let k = self.hashes.find(cursor, hash)?;
        Some(self.ids[k])
    }
}

/// The most conversations [`UnitWriter`] keeps the last request body of.
const PLACED: usize = 64;

/// The most layouts [`UnitWriter`] keeps (a resend's body received and body sent),
/// and the most bytes their parts may keep alive: as `exchange::resent` holds.
const LAID_OUT: usize = 4;
const LAID_OUT_BYTES: usize = 2 << 20;

impl UnitWriter {
    fn new() -> Result<UnitWriter, StoreError> {
        Ok(UnitWriter {
            known: DigestMap::default(),
            laid_out: Default::default(),
            placed: Default::default(),
            #[cfg(test)]
            placed_hits: 0,
            zstd: zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(StoreError::Zstd)?,
            meta: None,
            touch_every: TOUCH_EVERY,
        })
    }

    /// A record's metadata JSON compressed (`meta.rs`).
    fn compress_meta(&mut self, json: &[u8]) -> Result<Vec<u8>, std::io::Error> {
        let writer = match &mut self.meta {
            Some(writer) => writer,
            None => self.meta.insert(meta::MetaWriter::new()?),
        };
        writer.compress(json)
    }

    /// Forgets every id: after a rollback they may not exist.
    fn forget(&mut self) {
        self.known.clear();
        self.laid_out.clear();
        self.placed.clear();
    }

    /// Keeps the ids of a conversation's request body (`ids`: the skeleton's first),
    /// the oldest marked at `marked`, for its next turn.
    fn keep_placed(&mut self, conversation: &str, parts: &Parts, ids: &[i64], marked: Instant) {
        self.placed.retain(|p| p.conversation != conversation);
        if self.placed.len() == PLACED {
            self.placed.pop_front();
        }
        self.placed.push_back(PlacedIds {
            conversation: conversation.to_owned(),
            hashes: crate::prompt::DigestPlaces::new(
                parts.units.iter().map(|(_, _, hash)| Some(*hash)).collect(),
            ),
            ids: ids[1..].to_vec(),
            marked,
        });
    }

    /// The layout of `parts` when they were laid out lately and their units are
    /// still trusted to be stored.
    fn layout_of(&self, parts: &std::sync::Arc<Parts>, now: Instant) -> Option<Vec<u8>> {
        self.laid_out
            .iter()
            .find(|l| std::sync::Arc::ptr_eq(&l.parts, parts))
            .filter(|l| now.saturating_duration_since(l.marked) < self.touch_every)
            .map(|l| l.layout.clone())
    }

    /// Keeps the layout of `parts`, whose units [`UnitWriter::ids`] found, the oldest
    /// marked at `marked`.
    fn keep_layout(&mut self, parts: std::sync::Arc<Parts>, layout: &[u8], marked: Instant) {
        // A layout saves its units' lookups: parts without units (a response, kept
        // whole in parts made for its record alone) save none, and kept, a batch's
        // answers pushed the requests' layouts out (half of a 200 KB resend's missed).
        if parts.units.is_empty() {
            return;
        }
        let size: usize = parts.pieces().map(|(_, bytes)| bytes.len()).sum();
        if size > LAID_OUT_BYTES {
            return;
        }
        self.laid_out
            .retain(|l| !std::sync::Arc::ptr_eq(&l.parts, &parts));
        while self.laid_out.len() == LAID_OUT
            || self.laid_out.iter().map(|l| l.size).sum::<usize>() + size > LAID_OUT_BYTES
        {
            self.laid_out.pop_front();
        }
        self.laid_out.push_back(LaidOut {
            parts,
            layout: layout.to_vec(),
            marked,
            size,
        });
    }

    /// `bytes` compressed; the same output as `zstd::bulk::compress` at [`ZSTD_LEVEL`].
    fn compress(&mut self, bytes: &[u8]) -> Result<Vec<u8>, std::io::Error> {
        self.zstd.compress(bytes)
    }

    /// Each record's response bodies as they go in its row, compressed
    /// ([`layout::encode_inline`]).
    fn inline_responses(
        &mut self,
        records: &[&CaptureRecord],
        laid_out: &mut [[Option<Vec<u8>>; 4]],
    ) -> Result<(), StoreError> {
        for (record, layouts) in records.iter().zip(laid_out) {
            let responses = layouts.iter_mut().zip(record.bodies()).skip(2);
            for (slot, body) in responses.filter(|_| record.captured) {
                if let Some(body) = body.filter(|b| !b.bytes.is_empty()) {
                    let data = self.compress(&body.bytes).map_err(|e| {
                        StoreError::Corrupt(format!("compressing record {}: {e}", record.id))
                    })?;
                    *slot = Some(layout::encode_inline(&data));
                }
            }
        }
        Ok(())
    }

    /// A body's skeleton and units with their digests: as the writer cut them, or
    /// cut here as a request of `format`.
    fn pieces(body: &BodyInfo, format: Option<Format>) -> std::borrow::Cow<'_, Parts> {
        if let Some(parts) = &body.parts {
            return std::borrow::Cow::Borrowed(parts);
        }
        let prompt = Prompt::read(body.bytes.clone(), format);
        let split = layout::split(&prompt);
        let skeleton = Bytes::from(split.skeleton);
        let hash = digest::content(&skeleton);
        std::borrow::Cow::Owned(Parts {
            skeleton: (skeleton, hash),
            units: split
                .units
                .iter()
                .map(|(offset, unit)| {
                    (*offset, Bytes::copy_from_slice(unit), digest::content(unit))
                })
                .collect(),
        })
    }

    /// The ids of body `b`'s pieces this writer trusts from memory (its
    /// conversation's last turn by place, else the ids it knows); the others go in
    /// `asking`, a 0 in their place.
    fn remembered<'b>(
        &mut self,
        b: usize,
        parts: &'b Parts,
        conversation: Option<&str>,
        looked: Instant,
        asking: &mut Asking<'b>,
    ) -> BodyIds {
        let mut ids = Vec::with_capacity(parts.units.len() + 1);
        let mut marked: Option<Instant> = None;
        let previous = conversation
            .and_then(|c| self.placed.iter().rev().find(|p| p.conversation == c))
            .filter(|p| looked.saturating_duration_since(p.marked) < self.touch_every);
        let mut cursor = 0;
        for (place, (hash, bytes)) in parts.pieces().enumerate() {
            if place > 0
                && let Some(p) = previous
                && let Some(id) = p.find(&mut cursor, hash)
            {
                ids.push(id);
                marked = Some(marked.map_or(p.marked, |m| m.min(p.marked)));
                #[cfg(test)]
                {
                    self.placed_hits += 1;
                }
                continue;
            }
            match self.known.get(hash) {
                Some((id, touched))
                    if looked.saturating_duration_since(*touched) < self.touch_every =>
                {
                    ids.push(*id);
                    marked = Some(marked.map_or(*touched, |m| m.min(*touched)));
                }
                seen => {
                    asking.unknown.push((b, ids.len(), *hash));
                    ids.push(0);
                    if asking.asked.insert(*hash) {
                        asking.wanted.push((*hash, bytes, seen.is_some()));
                    }
                }
            }
        }
        BodyIds { ids, marked }
    }

    /// The ids of every unit of `bodies`, storing those the store lacks: a few
    /// statements for a whole batch, whatever its size (a round trip each to a
    /// PostgreSQL server). Units another replica stores at the same moment are
    /// taken as theirs (`ON CONFLICT`). Each body's ids come in its order, the
    /// skeleton's first, with the oldest mark among them.
    // By place, not in a map by digest: each unit was hashed once here instead of
    // three times (the lookup, the map, the layout's read of it).
    fn ids(
        &mut self,
        conn: &dyn Connection,
        bodies: &[(&Parts, Option<&str>)],
    ) -> Result<Vec<BodyIds>, StoreError> {
        // One clock read for the batch, not one per unit: per unit it was ~8 % of the
        // store thread on the 200 KB resend (perf).
        let looked = Instant::now();
        let mut asking = Asking::default();
        let mut out: Vec<BodyIds> = bodies
            .iter()
            .enumerate()
            .map(|(b, (parts, conversation))| {
                self.remembered(b, parts, *conversation, looked, &mut asking)
            })
            .collect();
        let Asking {
            unknown, wanted, ..
        } = asking;
        if wanted.is_empty() {
            return Ok(out);
        }
        let mut found = DigestMap::default();
        let now = Value::Int(super::timestamp::now_ms() as i64);
        let found_rows = |rows: Vec<SqlRow>, found: &mut DigestMap<i64>| {
            for row in rows {
                let hash: [u8; 32] = row
                    .blob(0)?
                    .try_into()
                    .map_err(|_| StoreError::Corrupt("a unit hash is not 32 bytes".into()))?;
                found.insert(hash, row.int(1)?);
            }
            Ok::<(), StoreError>(())
        };
        // Units known once are marked used as they are found: garbage collection
        // leaves them alone a while. A unit never known is most likely new (a turn's
        // new round): it goes straight to the insert, whose conflict clause finds and
        // marks one stored by another writer or before a restart, at the cost of
        // compressing it. Probing those first was ~5 % of the store thread on growing
        // conversations (perf), for rows that were nearly never there.
        let stale: Vec<_> = wanted.iter().filter(|(_, _, seen)| *seen).collect();
        for chunk in stale.chunks(UNITS_PER_STATEMENT) {
            let mut args = vec![now.clone()];
            args.extend(chunk.iter().map(|(hash, _, _)| Value::Blob(hash.to_vec())));
            let rows = conn.query(
                &format!(
                    "UPDATE units SET used_ms = ?1 WHERE hash IN ({}) RETURNING hash, id",
                    placeholders(2, chunk.len())
                ),
                &args,
            )?;
            found_rows(rows, &mut found)?;
        }
        let missing: Vec<_> = wanted
            .iter()
            .filter(|(h, _, _)| !found.contains_key(h))
            .collect();
        for chunk in missing.chunks(UNITS_PER_STATEMENT) {
            let mut rows = Vec::with_capacity(chunk.len());
            let mut args = vec![now.clone()];
            for (hash, bytes, _) in chunk {
                let data = self
                    .compress(bytes)
                    .map_err(|e| StoreError::Corrupt(format!("compressing a unit: {e}")))?;
                let at = args.len() + 1;
                rows.push(format!("(?{at}, ?{}, ?{}, ?1)", at + 1, at + 2));
                args.extend([
                    Value::Blob(hash.to_vec()),
                    Value::Int(bytes.len() as i64),
                    Value::Blob(data),
                ]);
            }
            let stored = conn.query(
                &format!(
                    "INSERT INTO units (hash, size, data, used_ms) VALUES {}
                     ON CONFLICT (hash) DO UPDATE SET used_ms = excluded.used_ms
                     RETURNING hash, id",
                    rows.join(", ")
                ),
                &args,
            )?;
            found_rows(stored, &mut found)?;
        }
        let touched = Instant::now();
        for (hash, _, _) in &wanted {
            let id = found
                .get(hash)
                .ok_or_else(|| StoreError::Corrupt("a unit vanished as it was stored".into()))?;
            self.known.insert(*hash, (*id, touched));
        }
        for (b, place, hash) in unknown {
            let body = &mut out[b];
            body.ids[place] = *found
                .get(&hash)
                .ok_or_else(|| StoreError::Corrupt("a unit vanished as it was stored".into()))?;
            body.marked = Some(body.marked.map_or(touched, |m| m.min(touched)));
        }
        Ok(out)
    }
}

/// The units a batch asks the store for.
#[derive(Default)]
struct Asking<'b> {
    /// (body, place, digest) of each id not known yet.
    unknown: Vec<(usize, usize, [u8; 32])>,
    /// The units to ask for, with whether this writer knew them once (then they
    /// are likely still stored).
    wanted: Vec<([u8; 32], &'b Bytes, bool)>,
    asked: DigestSet,
}

/// A body's unit ids, as [`UnitWriter::ids`] found them.
struct BodyIds {
    /// The skeleton's id, then each unit's.
    ids: Vec<i64>,
    /// The oldest mark among them: until [`TOUCH_EVERY`] after it, all are trusted.
    marked: Option<Instant>,
}

/// The conversation of `record` when its body at `place` is its last request body
/// (the one sent, when rules changed it): the next turn finds its unit ids by place.
fn placed_by(record: &CaptureRecord, place: usize) -> Option<&str> {
    let last_request = usize::from(record.request.sent_body.is_some());
    record
        .conversation
        .as_deref()
        .filter(|_| place == last_request)
}

/// Every body to lay out, in order; a request body (the first two) with its
/// record's conversation.
fn named_bodies<'a>(
    records: &[&'a CaptureRecord],
    bodies: &'a [[Option<std::borrow::Cow<'_, Parts>>; 4]],
) -> Vec<(&'a Parts, Option<&'a str>)> {
    records
        .iter()
        .zip(bodies)
        .flat_map(|(record, parts)| {
            parts.iter().enumerate().filter_map(|(i, p)| {
                let conversation = record.conversation.as_deref().filter(|_| i < 2);
                Some((&**p.as_ref()?, conversation))
            })
        })
        .collect()
}

/// Units looked up or stored per statement: SQLite takes at most 32,766 parameters
/// in one, PostgreSQL 65,535; three per unit stored.
const UNITS_PER_STATEMENT: usize = 500;
/// Records per statement: 22 parameters each.
const RECORDS_PER_STATEMENT: usize = 64;

/// `?first, ?first+1, …`, `n` of them.
fn placeholders(first: usize, n: usize) -> String {
    (first..first + n)
        .map(|i| format!("?{i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("location", &self.location)
            .finish()
    }
}

/// The records of `records` the store does not hold yet (a replica's spool may
/// hold an exchange another already stored), each once.
fn not_stored<'r>(
    conn: &dyn Connection,
    records: &'r [CaptureRecord],
) -> Result<Vec<&'r CaptureRecord>, StoreError> {
    let mut stored: HashSet<String> = HashSet::new();
    for chunk in records.chunks(RECORDS_PER_STATEMENT) {
        let sql = format!(
            "SELECT id FROM records WHERE id IN ({})",
            placeholders(1, chunk.len())
        );
        let args: Vec<Value> = chunk.iter().map(|r| Value::from(r.id.as_str())).collect();
        for row in conn.query(&sql, &args)? {
            stored.insert(row.text(0)?);
        }
    }
    Ok(records
        .iter()
        .filter(|r| stored.insert(r.id.clone()))
        .collect())
}

/// The 23 values of a record's row, in the order of the `records` columns.
fn record_row(record: &CaptureRecord, meta: Vec<u8>, layouts: [Option<Vec<u8>>; 4]) -> [Value; 23] {
    let [received, sent, response, message] = layouts;
    let usage = record.usage.as_ref();
    let count = |f: fn(&crate::provider::Usage) -> u64| usage.map(|u| f(u) as i64);
    [
        record.id.as_str().into(),
        (record.times.started_ms as i64).into(),
        record.conversation.clone().into(),
        record.model.clone().into(),
        record.provider.clone().into(),
        record.response.status.map(i64::from).into(),
        record.outcome.as_str().into(),
        count(|u| u.input_tokens).into(),
        count(|u| u.output_tokens).into(),
        count(|u| u.cache_read_tokens).into(),
        count(|u| u.cache_write_tokens).into(),
        record.rules_fired.join(",").into(),
        meta.into(),
        received.into(),
        sent.into(),
        response.into(),
        message.into(),
        record.cache.as_ref().map(|c| c.short()).into(),
        record.tags.join(",").into(),
        record.path.clone().into(),
        record.mode.clone().into(),
        record.side.into(),
        record.cost_usd().map(micro_usd).into(),
    ]
}

/// Dollars in the millionths the store keeps.
fn micro_usd(usd: f64) -> i64 {
    (usd * 1e6).round() as i64
}

/// Indexes the breakpoint prefixes of `records` by workspace, for the fleet's
/// cross-conversation lookup.
fn index_prefixes(conn: &dyn Connection, records: &[&CaptureRecord]) -> Result<(), StoreError> {
    let prefixes: Vec<[Value; 4]> = records
        .iter()
        .filter_map(|r| Some((r, r.cache.as_ref()?)))
        .filter_map(|(r, c)| Some((r, c, c.workspace.as_ref()?)))
        .flat_map(|(r, c, w)| {
            c.breakpoints
                .iter()
                .filter(|b| !b.prefix.is_empty())
                .map(move |b| {
                    [
                        r.id.as_str().into(),
                        b.prefix.as_str().into(),
                        w.as_str().into(),
                        (c.started_ms as i64).into(),
                    ]
                })
        })
        .collect();
    for chunk in prefixes.chunks(UNITS_PER_STATEMENT) {
        let rows: Vec<String> = (0..chunk.len())
            .map(|i| format!("({})", placeholders(i * 4 + 1, 4)))
            .collect();
        let args: Vec<Value> = chunk.iter().flatten().cloned().collect();
        conn.execute(
            &format!(
                "INSERT INTO cache_prefixes (record, prefix, workspace, started_ms)
                 VALUES {} ON CONFLICT DO NOTHING",
                rows.join(", ")
            ),
            &args,
        )?;
    }
    Ok(())
}

impl Store {
    /// Opens (creating and migrating if needed) the store at `location` for writing.
    pub fn open(location: &StoreLocation) -> Result<Store, StoreError> {
        let (conn, version): (Box<dyn Connection>, i64) = match location {
            StoreLocation::Dir(dir) => {
                (Box::new(sqlite::Sqlite::open(dir)?), sqlite::SCHEMA_VERSION)
            }
            StoreLocation::Postgres(url) => (Box::new(postgres::Postgres::open(url)?), i64::MAX),
        };
        Ok(Store {
            conn,
            location: location.clone(),
            units: UnitWriter::new()?,
            version,
        })
    }

    /// Opens an existing store for reading only (the command line, the admin API).
    pub fn open_read_only(location: &StoreLocation) -> Result<Store, StoreError> {
        Store::open_reading(location, None)
    }

    /// As [`open_read_only`](Self::open_read_only), every call to a PostgreSQL store
    /// answered within `within` or failed: for the record pipeline, which must not
    /// wait long on a server that answers nothing.
    pub fn open_for_lookups(
        location: &StoreLocation,
        within: Duration,
    ) -> Result<Store, StoreError> {
        Store::open_reading(location, Some(within))
    }

    fn open_reading(
        location: &StoreLocation,
        within: Option<Duration>,
    ) -> Result<Store, StoreError> {
        let (conn, version): (Box<dyn Connection>, i64) = match location {
            StoreLocation::Dir(dir) => {
                let (conn, version) = sqlite::Sqlite::open_read_only(dir)?;
                (Box::new(conn), version)
            }
            StoreLocation::Postgres(url) => {
                let (conn, version) = postgres::Postgres::open_read_only(url, within)?;
                (Box::new(conn), postgres::as_sqlite_schema(version))
            }
        };
        Ok(Store {
            conn,
            location: location.clone(),
            units: UnitWriter::new()?,
            version,
        })
    }

    /// Where the store is.
    pub fn location(&self) -> &StoreLocation {
        &self.location
    }

    /// Stores records (already redacted) in one transaction. A record whose id is
    /// already stored is skipped: each exchange is stored once.
    pub fn insert(&mut self, records: &[CaptureRecord]) -> Result<(), StoreError> {
        self.conn.begin()?;
        let result = self.insert_all(records);
        let result = match result {
            Ok(()) => self.conn.commit(),
            Err(e) => {
                let _ = self.conn.rollback();
                Err(e)
            }
        };
        if result.is_err() {
            // Ids remembered inside a rolled-back transaction may not exist.
            self.units.forget();
        } else if self.units.known.len() > KNOWN_UNITS {
            self.units.forget();
        }
        result
    }

    /// Stores `records` in a few statements whatever their number (a round trip
    /// each to a PostgreSQL server): which are stored already, their units, their
    /// rows, their prefixes.
    fn insert_all(&mut self, records: &[CaptureRecord]) -> Result<(), StoreError> {
        let conn = &*self.conn;
        // Another replica's spool may hold the same exchange: it is stored once.
        let new = not_stored(conn, records)?;
        // Each record's bodies cut into their skeleton and units; responses stay whole.
        // A body laid out lately is taken as it was.
        let now = Instant::now();
        let mut laid_out: Vec<[Option<Vec<u8>>; 4]> = Vec::with_capacity(new.len());
        let bodies: Vec<[Option<std::borrow::Cow<'_, Parts>>; 4]> = new
            .iter()
            .map(|record| {
                let format = record.request_format();
                let mut parts: [Option<std::borrow::Cow<'_, Parts>>; 4] = Default::default();
                let mut layouts: [Option<Vec<u8>>; 4] = Default::default();
                if record.captured {
                    // Request bodies only: responses are stored in their row (below).
                    let requests = parts.iter_mut().zip(record.bodies()).take(2);
                    for (i, (slot, body)) in requests.enumerate() {
                        if let Some(body) = body.filter(|b| !b.bytes.is_empty()) {
                            let known = body
                                .parts
                                .as_ref()
                                .and_then(|p| self.units.layout_of(p, now));
                            match known {
                                Some(layout) => layouts[i] = Some(layout),
                                None => *slot = Some(UnitWriter::pieces(body, format)),
                            }
                        }
                    }
                }
                laid_out.push(layouts);
                parts
            })
            .collect();
        self.units.inline_responses(&new, &mut laid_out)?;
        let every = named_bodies(&new, &bodies);
        let mut ids = self.units.ids(conn, &every)?.into_iter();
        for (record, (parts, layouts)) in new.iter().zip(bodies.iter().zip(&mut laid_out)) {
            for (i, ((part, slot), body)) in parts
                .iter()
                .zip(layouts.iter_mut())
                .zip(record.bodies())
                .enumerate()
            {
                let Some(part) = part else { continue };
                let found = ids
                    .next()
                    .ok_or_else(|| StoreError::Corrupt("a body without its unit ids".into()))?;
                let units: Vec<(usize, i64)> = part
                    .units
                    .iter()
                    .zip(&found.ids[1..])
                    .map(|((offset, _, _), id)| (*offset, *id))
                    .collect();
                let encoded = layout::encode(found.ids[0], &units);
                if let (Some(c), Some(marked)) = (placed_by(record, i), found.marked) {
                    self.units.keep_placed(c, part, &found.ids, marked);
                }
                if let (Some(arc), Some(marked)) =
                    (body.and_then(|b| b.parts.clone()), found.marked)
                {
                    self.units.keep_layout(arc, &encoded, marked);
                }
                *slot = Some(encoded);
            }
        }
        for (chunk, parts) in new
            .chunks(RECORDS_PER_STATEMENT)
            .zip(laid_out.chunks_mut(RECORDS_PER_STATEMENT))
        {
            let mut rows = Vec::with_capacity(chunk.len());
            let mut args: Vec<Value> = Vec::with_capacity(chunk.len() * 23);
            for (record, layouts) in chunk.iter().zip(parts.iter_mut()) {
                let meta = serde_json::to_vec(record)
                    .map_err(|e| StoreError::Corrupt(format!("record {}: {e}", record.id)))?;
                let meta = self.units.compress_meta(&meta).map_err(|e| {
                    StoreError::Corrupt(format!("compressing record {}: {e}", record.id))
                })?;
                let [received, sent, response, message] = std::mem::take(layouts);
                rows.push(format!("({})", placeholders(args.len() + 1, 23)));
                args.extend(record_row(
                    record,
                    meta,
                    [received, sent, response, message],
                ));
            }
            conn.execute(
                &format!(
                    "INSERT INTO records (id, started_ms, conversation, model, provider, status,
                       outcome, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens,
                       rules, meta, received, sent, response, message, cache, tags, path, mode, side,
                       cost_microusd)
                     VALUES {} ON CONFLICT (id) DO NOTHING",
                    rows.join(", ")
                ),
                &args,
            )?;
        }
        // The index serves replicas that share the store; one replica's own cache
        // analysis already knows every prefix it saw.
        if matches!(self.location, StoreLocation::Postgres(_)) {
            index_prefixes(conn, &new)?;
        }
        Ok(())
    }

    /// The full id of the one record whose id starts with `prefix` (case-insensitive),
    /// or of `last` (the newest) and `@-N` (the Nth before it).
    pub fn resolve(&self, prefix: &str) -> Result<String, StoreError> {
        // `last` is the newest record, `@-1` the one before it, `@-2` the one before that.
        let back = match prefix.trim() {
            "last" => Some(0),
            p => match p.strip_prefix("@-") {
                // Checked here: a negative OFFSET is an error in PostgreSQL's words.
                Some(n) => Some(
                    n.parse::<u32>()
                        .map_err(|_| StoreError::BadReference(prefix.to_owned()))?
                        .into(),
                ),
                None => None,
            },
        };
        if let Some(back) = back {
            return self
                .conn
                .query_row(
                    "SELECT id FROM records ORDER BY id DESC LIMIT 1 OFFSET ?1",
                    &[Value::Int(back)],
                )?
                .ok_or_else(|| StoreError::NotFound(prefix.to_owned()))?
                .text(0);
        }
        let p = prefix.trim().to_ascii_uppercase();
        if p.is_empty() {
            return Err(StoreError::NotFound(prefix.to_owned()));
        }
        let ids = self.conn.query(
            "SELECT id FROM records WHERE id >= ?1 AND id < ?1 || '~' LIMIT 50",
            &[Value::Text(p)],
        )?;
        match ids.as_slice() {
            [] => Err(StoreError::NotFound(prefix.to_owned())),
            [one] => one.text(0),
            many => Err(StoreError::Ambiguous(prefix.to_owned(), many.len())),
        }
    }

    /// The record before `id` in its conversation, if it has one and is not the first.
    pub fn previous_in_conversation(&self, id: &str) -> Result<Option<String>, StoreError> {
        self.conn
            .query_row(
                "SELECT id FROM records WHERE id < ?1 AND conversation IS NOT NULL
                   AND conversation = (SELECT conversation FROM records WHERE id = ?1)
                 ORDER BY id DESC LIMIT 1",
                &[Value::from(id)],
            )?
            .map(|r| r.text(0))
            .transpose()
    }

    /// A record with its bodies loaded and checked against their hashes.
    pub fn load(&self, id: &str) -> Result<CaptureRecord, StoreError> {
        let id = self.resolve(id)?;
        let mut row = self
            .conn
            .query_row(
                "SELECT meta, received, sent, response, message FROM records WHERE id = ?1",
                &[Value::from(id.as_str())],
            )?
            .ok_or_else(|| StoreError::NotFound(id.clone()))?;
        let meta = row.blob(0)?;
        let layouts = layouts(&mut row, 1)?;
        let mut record = decode_meta(&id, &meta)?;
        let algorithm = record.digest;
        for (body, layout) in record.bodies_mut().into_iter().zip(layouts) {
            if let (Some(body), Some(layout)) = (body, layout) {
                self.fill(&id, body, &layout, algorithm)
                    .map_err(|e| match e {
                        StoreError::Corrupt(why) if !why.starts_with("record ") => {
                            StoreError::Corrupt(format!("record {id}: {why}"))
                        }
                        e => e,
                    })?;
            }
        }
        Ok(record)
    }

    fn fill(
        &self,
        id: &str,
        body: &mut BodyInfo,
        layout: &[u8],
        algorithm: digest::Algorithm,
    ) -> Result<(), StoreError> {
        let bytes = self.rebuild(layout)?;
        if digest::hex(&algorithm.of(&bytes)) != body.digest {
            return Err(StoreError::Corrupt(format!(
                "record {id}: a rebuilt body does not match its {}",
                algorithm.name()
            )));
        }
        body.bytes = Bytes::from(bytes);
        Ok(())
    }

    /// A body from its layout.
    fn rebuild(&self, layout: &[u8]) -> Result<Vec<u8>, StoreError> {
        let (skeleton, units) = match read_layout(layout)? {
            layout::Stored::Units(skeleton, units) => (skeleton, units),
            layout::Stored::Inline(data) => return inflate_inline(data),
        };
        let skeleton = self.unit(skeleton)?;
        let parts: Vec<(usize, Vec<u8>)> = units
            .into_iter()
            .map(|(offset, id)| Ok((offset, self.unit(id)?)))
            .collect::<Result<_, StoreError>>()?;
        Ok(layout::join(
            &skeleton,
            parts.iter().map(|(o, u)| (*o, u.as_slice())),
        ))
    }

    fn unit(&self, id: i64) -> Result<Vec<u8>, StoreError> {
        let row = self
            .conn
            .query_row(
                "SELECT size, data FROM units WHERE id = ?1",
                &[Value::Int(id)],
            )?
            .ok_or_else(|| StoreError::Corrupt(format!("unit {id} is missing")))?;
        let (size, data) = (row.int(0)?, row.blob(1)?);
        let damaged = |why: String| StoreError::Corrupt(format!("unit {id}: {why}"));
        let size = u64::try_from(size).map_err(|_| damaged(format!("size {size}")))?;
        inflate(&data, size).map_err(damaged)
    }

    /// How many records the column filters of `filter` select (no grep, no paging).
    pub fn count(&self, filter: &Filter) -> Result<u64, StoreError> {
        let (clause, args) = where_clause(filter, self.version, self.conn.dialect());
        let n = self
            .conn
            .query_row(&format!("SELECT COUNT(*) FROM records {clause}"), &args)?
            .map(|r| r.int(0))
            .transpose()?
            .unwrap_or(0);
        Ok(n as u64)
    }

    /// The [`Row::seq`] of the last record stored (0 for an empty store).
    pub fn last_seq(&self) -> Result<i64, StoreError> {
        let seq = self.conn.dialect().seq();
        let n = self
            .conn
            .query_row(&format!("SELECT max({seq}) FROM records"), &[])?
            .map(|r| r.opt_int(0))
            .transpose()?
            .flatten();
        Ok(n.unwrap_or(0))
    }

    /// Records matching `filter`, oldest first.
    pub fn list(&self, filter: &Filter) -> Result<Vec<Row>, StoreError> {
        let (clause, args) = where_clause(filter, self.version, self.conn.dialect());
        let skip = filter.offset.unwrap_or(0);
        let limit = if filter.grep.is_some() {
            i64::MAX
        } else {
            filter
                .limit
                .map_or(i64::MAX, |n| n.saturating_add(skip) as i64)
        };
        let cache = if self.version >= 2 { "cache" } else { "NULL" };
        let columns = if self.version >= 3 {
            "tags, path, side"
        } else {
            "'', NULL, 0"
        };
        let cost = if self.version >= sqlite::COST_SINCE {
            "cost_microusd"
        } else {
            "NULL"
        };
        let seq = self.conn.dialect().seq();
        let sql = format!(
            "SELECT id, started_ms, conversation, model, provider, status, outcome, input_tokens,
               output_tokens, cache_read_tokens, cache_write_tokens, rules, meta, received, sent,
               response, message, {cache}, {seq}, {columns}, {cost}
             FROM records {clause} ORDER BY id DESC LIMIT {limit}"
        );
        let mut out = Vec::new();
        let mut unit_hits: HashMap<i64, bool> = HashMap::new();
        let wanted = filter.limit.unwrap_or(usize::MAX);
        let mut skipped = 0;
        let unsigned = |v: Option<i64>| v.map(|v| v as u64);
        self.conn.query_each(&sql, &args, &mut |mut r: SqlRow| {
            let row = Row {
                id: r.text(0)?,
                started_ms: r.int(1)? as u64,
                conversation: r.opt_text(2)?,
                model: r.opt_text(3)?,
                provider: r.opt_text(4)?,
                status: r.opt_int(5)?.and_then(|s| u16::try_from(s).ok()),
                outcome: r.text(6)?,
                input_tokens: unsigned(r.opt_int(7)?),
                output_tokens: unsigned(r.opt_int(8)?),
                cache_read_tokens: unsigned(r.opt_int(9)?),
                cache_write_tokens: unsigned(r.opt_int(10)?),
                rules: comma_list(&r.text(11)?),
                cache: r.opt_text(17)?,
                seq: r.int(18)?,
                tags: comma_list(&r.text(19)?),
                path: r.opt_text(20)?,
                side: r.bool(21)?,
                cost_usd: r.opt_int(22)?.map(|m| m as f64 / 1e6),
            };
            if let Some(needle) = &filter.grep {
                let meta = r.take_blob(12)?.unwrap_or_default();
                let layouts = layouts(&mut r, 13)?;
                if !self.contains(&row.id, needle, &meta, &layouts, &mut unit_hits)? {
                    return Ok(true);
                }
            }
            if skipped < skip {
                skipped += 1;
                return Ok(true);
            }
            out.push(row);
            Ok(out.len() < wanted)
        })?;
        out.reverse();
        Ok(out)
    }

    /// Whether `needle` occurs in a record's metadata or in any unit of its bodies.
    fn contains(
        &self,
        id: &str,
        needle: &str,
        meta: &[u8],
        layouts: &[Option<Vec<u8>>; 4],
        hits: &mut HashMap<i64, bool>,
    ) -> Result<bool, StoreError> {
        let found = |hay: &[u8]| memchr::memmem::find(hay, needle.as_bytes()).is_some();
        let json =
            meta::decode(meta).map_err(|e| StoreError::Corrupt(format!("record {id}: {e}")))?;
        if found(&json) {
            return Ok(true);
        }
        for layout in layouts.iter().flatten() {
            let (skeleton, units) = match read_layout(layout)? {
                layout::Stored::Units(skeleton, units) => (skeleton, units),
                layout::Stored::Inline(data) if found(&inflate_inline(data)?) => return Ok(true),
                layout::Stored::Inline(_) => continue,
            };
            for unit in std::iter::once(skeleton).chain(units.into_iter().map(|(_, u)| u)) {
                let hit = match hits.get(&unit) {
                    Some(h) => *h,
                    None => {
                        let h = found(&self.unit(unit)?);
                        hits.insert(unit, h);
                        h
                    }
                };
                if hit {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Records matching `filter`, loaded in full, oldest first; a damaged one is left
    /// out and named in `damaged`.
    pub fn records(
        &self,
        filter: &Filter,
        damaged: &mut Vec<Damaged>,
    ) -> Result<Vec<CaptureRecord>, StoreError> {
        let mut out = Vec::new();
        for row in self.list(filter)? {
            if let Some(record) = Damaged::sift(&row.id, self.load(&row.id), damaged)? {
                out.push(record);
            }
        }
        Ok(out)
    }

    /// One row per conversation among the records matching `filter`, by first time.
    pub fn conversations(&self, filter: &Filter) -> Result<Vec<ConversationRow>, StoreError> {
        let mut groups: Vec<ConversationRow> = Vec::new();
        let mut index: HashMap<Option<String>, usize> = HashMap::new();
        let limit = filter.limit;
        let all = Filter {
            limit: None,
            ..filter.clone()
        };
        for row in self.list(&all)? {
            let at = *index.entry(row.conversation.clone()).or_insert_with(|| {
                groups.push(ConversationRow {
                    conversation: row.conversation.clone(),
                    requests: 0,
                    models: Vec::new(),
                    input_tokens: 0,
                    output_tokens: 0,
                    cache_read_tokens: 0,
                    cache_write_tokens: 0,
                    cost_usd: None,
                    first_ms: row.started_ms,
                    last_ms: row.started_ms,
                });
                groups.len() - 1
            });
            let g = &mut groups[at];
            g.requests += 1;
            if let Some(m) = &row.model
                && !g.models.contains(m)
            {
                g.models.push(m.clone());
            }
            g.input_tokens += row.input_tokens.unwrap_or(0);
            g.output_tokens += row.output_tokens.unwrap_or(0);
            g.cache_read_tokens += row.cache_read_tokens.unwrap_or(0);
            g.cache_write_tokens += row.cache_write_tokens.unwrap_or(0);
            if let Some(c) = row.cost_usd {
                *g.cost_usd.get_or_insert(0.0) += c;
            }
            g.first_ms = g.first_ms.min(row.started_ms);
            g.last_ms = g.last_ms.max(row.started_ms);
        }
        if let Some(n) = limit {
            let skip = groups.len().saturating_sub(n);
            groups.drain(..skip);
        }
        Ok(groups)
    }

    /// Deletes records past the retention, then units no record uses any more. Both
    /// go in batches, so a writer (another replica's too) waits for one batch at most.
    pub fn prune(&mut self, retention: &Retention, now_ms: u64) -> Result<Pruned, StoreError> {
        let mut pruned = Pruned::default();
        if let Some(age) = retention.max_age {
            let cutoff = now_ms.saturating_sub(age.as_millis() as u64) as i64;
            pruned.records += self.delete_oldest(Some(cutoff), i64::MAX)?;
        }
        pruned.units += self.collect_garbage(now_ms)?;
        self.conn.execute(
            "DELETE FROM cache_prefixes WHERE started_ms < ?1",
            &[Value::Int(
                now_ms.saturating_sub(PREFIX_INDEX_KEEP_MS) as i64
            )],
        )?;
        if let Some(max) = retention.max_size {
            while self.conn.used_bytes()? > max {
                let count = self.stats()?.records as i64;
                if count == 0 {
                    break;
                }
                pruned.records += self.delete_oldest(None, (count / 10).max(1))?;
                pruned.units += self.collect_garbage(now_ms)?;
            }
        }
        Ok(pruned)
    }

    /// The ids of the newest `most` records of `conversation` that started at or
    /// after `since_ms` and before the record `before` (by id), oldest first.
    pub fn turns(
        &self,
        conversation: &str,
        since_ms: u64,
        before: &str,
        most: usize,
    ) -> Result<Vec<String>, StoreError> {
        let rows = self.conn.query(
            "SELECT id FROM records WHERE conversation = ?1 AND started_ms >= ?2 AND id < ?3
             ORDER BY id DESC LIMIT ?4",
            &[
                Value::from(conversation),
                Value::Int(since_ms as i64),
                Value::from(before),
                Value::Int(most as i64),
            ],
        )?;
        let mut ids = rows
            .into_iter()
            .map(|r| r.text(0))
            .collect::<Result<Vec<_>, _>>()?;
        ids.reverse();
        Ok(ids)
    }

    /// Who cached which of `prefixes` (as [`BreakpointView::prefix`] writes them) in
    /// `workspace`: `(prefix, conversation)` of the records that started at or after
    /// `since_ms` and before the record `before` (by id), newest first.
    ///
    /// [`BreakpointView::prefix`]: crate::cache::BreakpointView::prefix
    pub fn prefix_writers(
        &self,
        workspace: &str,
        prefixes: &[String],
        since_ms: u64,
        before: &str,
    ) -> Result<Vec<(String, String)>, StoreError> {
        if prefixes.is_empty() {
            return Ok(Vec::new());
        }
        let marks: Vec<String> = (4..4 + prefixes.len()).map(|i| format!("?{i}")).collect();
        let sql = format!(
            "SELECT p.prefix, r.conversation FROM cache_prefixes p JOIN records r ON r.id = p.record
             WHERE p.workspace = ?1 AND p.started_ms >= ?2 AND r.id < ?3
               AND r.conversation IS NOT NULL AND p.prefix IN ({})
             ORDER BY p.started_ms DESC LIMIT 64",
            marks.join(", ")
        );
        let mut args = vec![
            Value::from(workspace),
            Value::Int(since_ms as i64),
            Value::from(before),
        ];
        args.extend(prefixes.iter().map(|p| Value::from(p.as_str())));
        self.conn
            .query(&sql, &args)?
            .into_iter()
            .map(|r| Ok((r.text(0)?, r.text(1)?)))
            .collect()
    }

    /// The ids of the `n` oldest records, oldest first.
    pub fn oldest(&self, n: usize) -> Result<Vec<String>, StoreError> {
        let rows = self.conn.query(
            "SELECT id FROM records ORDER BY id LIMIT ?1",
            &[Value::Int(n as i64)],
        )?;
        rows.into_iter().map(|r| r.text(0)).collect()
    }

    /// Deletes the records `ids`; once no record is left, the units go too.
    pub fn remove(&mut self, ids: &[String]) -> Result<(), StoreError> {
        for batch in ids.chunks(DELETE_BATCH) {
            let marks: Vec<String> = (1..=batch.len()).map(|i| format!("?{i}")).collect();
            let args: Vec<Value> = batch.iter().map(|id| Value::from(id.as_str())).collect();
            let sql = format!("DELETE FROM records WHERE id IN ({})", marks.join(", "));
            self.conn.execute(&sql, &args)?;
        }
        if self.stats()?.records == 0 {
            self.conn.execute("DELETE FROM units", &[])?;
            self.units.forget();
            self.conn.reclaim()?;
        }
        Ok(())
    }

    /// Deletes up to `most` of the oldest records (those started before `before_ms`,
    /// when given), [`DELETE_BATCH`] per statement.
    fn delete_oldest(&self, before_ms: Option<i64>, most: i64) -> Result<u64, StoreError> {
        let mut deleted = 0u64;
        let cutoff = before_ms.unwrap_or(i64::MAX);
        while (deleted as i64) < most {
            let batch = (most - deleted as i64).min(DELETE_BATCH as i64);
            let n = self.conn.execute(
                "DELETE FROM records WHERE id IN
                   (SELECT id FROM records WHERE started_ms < ?1 ORDER BY id LIMIT ?2)",
                &[Value::Int(cutoff), Value::Int(batch)],
            )?;
            deleted += n;
            if n < batch as u64 {
                break;
            }
        }
        Ok(deleted)
    }

    /// Deletes units no record refers to, and gives their space back.
    /// Deletes the units no record uses and nobody marked used for
    /// [`UNTOUCHED_FOR`] before `now_ms` (the mark is checked again as each is
    /// deleted: another replica may have taken one up since).
    fn collect_garbage(&mut self, now_ms: u64) -> Result<u64, StoreError> {
        let idle_since = Value::Int(now_ms.saturating_sub(UNTOUCHED_FOR.as_millis() as u64) as i64);
        let mut used: HashSet<i64> = HashSet::new();
        self.conn.query_each(
            "SELECT received, sent, response, message FROM records",
            &[],
            &mut |mut r| {
                for layout in layouts(&mut r, 0)?.into_iter().flatten() {
                    // A body in its row uses no unit.
                    if let layout::Stored::Units(skeleton, units) = read_layout(&layout)? {
                        used.insert(skeleton);
                        used.extend(units.into_iter().map(|(_, u)| u));
                    }
                }
                Ok(true)
            },
        )?;
        let mut unused = Vec::new();
        self.conn.query_each(
            "SELECT id FROM units WHERE used_ms < ?1",
            std::slice::from_ref(&idle_since),
            &mut |r| {
                let id = r.int(0)?;
                if !used.contains(&id) {
                    unused.push(id);
                }
                Ok(true)
            },
        )?;
        let mut removed = 0;
        for batch in unused.chunks(DELETE_BATCH) {
            let list = batch
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(",");
            removed += self.conn.execute(
                &format!("DELETE FROM units WHERE id IN ({list}) AND used_ms < ?1"),
                std::slice::from_ref(&idle_since),
            )?;
        }
        if removed > 0 {
            self.units.forget();
            self.conn.reclaim()?;
        }
        Ok(removed)
    }

    /// Counts and sizes.
    pub fn stats(&self) -> Result<Stats, StoreError> {
        let count = |sql: &str| -> Result<SqlRow, StoreError> {
            self.conn
                .query_row(sql, &[])?
                .ok_or_else(|| StoreError::Corrupt("a count returned no row".into()))
        };
        let records = count("SELECT COUNT(*) FROM records")?.int(0)?;
        let units = count(
            "SELECT COUNT(*), CAST(COALESCE(SUM(size), 0) AS BIGINT),
               CAST(COALESCE(SUM(LENGTH(data)), 0) AS BIGINT) FROM units",
        )?;
        Ok(Stats {
            records: records as u64,
            units: units.int(0)? as u64,
            unit_bytes: units.int(1)? as u64,
            stored_unit_bytes: units.int(2)? as u64,
            used_bytes: self.conn.used_bytes()?,
        })
    }

    /// Makes what was written durable in the main file (on a clean close).
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        self.conn.checkpoint()
    }
}

/// The four body layouts of a row, from column `from` on (moved out of the row).
fn layouts(row: &mut SqlRow, from: usize) -> Result<[Option<Vec<u8>>; 4], StoreError> {
    Ok([
        row.take_blob(from)?,
        row.take_blob(from + 1)?,
        row.take_blob(from + 2)?,
        row.take_blob(from + 3)?,
    ])
}

/// A body column: units to put back together, or the body itself (a response).
fn read_layout(layout: &[u8]) -> Result<layout::Stored<'_>, StoreError> {
    layout::read(layout).ok_or_else(|| StoreError::Corrupt("bad layout".into()))
}

/// The bytes of a zstd frame that holds `size` of them. Never allocated from the
/// stored size: the bytes grow as the data really decompresses, and reading stops
/// one past the size.
fn inflate(data: &[u8], size: u64) -> Result<Vec<u8>, String> {
    let mut bytes = Vec::with_capacity(usize::try_from(size).map_or(0, |s| s.min(UNIT_PREALLOC)));
    let decoder = zstd::stream::read::Decoder::with_buffer(data).map_err(|e| e.to_string())?;
    std::io::Read::read_to_end(
        &mut std::io::Read::take(decoder, size.saturating_add(1)),
        &mut bytes,
    )
    .map_err(|e| e.to_string())?;
    if bytes.len() as u64 != size {
        return Err(format!(
            "its size says {size} bytes, its data holds {}{}",
            bytes.len(),
            if bytes.len() as u64 > size {
                " or more"
            } else {
                ""
            }
        ));
    }
    Ok(bytes)
}

/// A body stored in its row: its frame says its size (the writer's compressor
/// writes it), and the record's digest is checked after.
fn inflate_inline(data: &[u8]) -> Result<Vec<u8>, StoreError> {
    let damaged = |why: String| StoreError::Corrupt(format!("a body in its row: {why}"));
    let size = zstd::zstd_safe::get_frame_content_size(data)
        .ok()
        .flatten()
        .ok_or_else(|| damaged("its frame says no size".into()))?;
    inflate(data, size).map_err(damaged)
}

/// A record's metadata column: zstd JSON of the record without its bodies (`meta.rs`).
fn decode_meta(id: &str, meta: &[u8]) -> Result<CaptureRecord, StoreError> {
    let json = meta::decode(meta).map_err(|e| StoreError::Corrupt(format!("record {id}: {e}")))?;
    serde_json::from_slice(&json).map_err(|e| StoreError::Corrupt(format!("record {id}: {e}")))
}
/// A `rules` or `tags` column: names joined by commas.
fn comma_list(column: &str) -> Vec<String> {
    column
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A condition no row meets, in both dialects.
const NOTHING: &str = "1 = 0";

/// The SQL for `f`'s column filters on a store of schema `version`: a filter on a
/// column an older store lacks matches nothing (the side mark: everything).
fn where_clause(f: &Filter, version: i64, dialect: Dialect) -> (String, Vec<Value>) {
    let has_cache = version >= 2;
    let has_columns = version >= 3;
    let mut parts = Vec::new();
    let mut args: Vec<Value> = Vec::new();
    if let Some(since) = f.since_ms {
        args.push(Value::Int(since as i64));
        parts.push(format!("started_ms >= ?{}", args.len()));
    }
    if let Some(until) = f.until_ms {
        args.push(Value::Int(until as i64));
        parts.push(format!("started_ms < ?{}", args.len()));
    }
    if let Some(model) = &f.model {
        args.push(Value::Text(like_pattern(model, false)));
        parts.push(format!("model LIKE ?{} ESCAPE '\\'", args.len()));
    }
    if let Some(conversation) = &f.conversation {
        args.push(Value::Text(like_pattern(conversation, true)));
        parts.push(format!("conversation LIKE ?{} ESCAPE '\\'", args.len()));
    }
    if let Some(outcome) = &f.outcome {
        args.push(Value::Text(outcome.clone()));
        parts.push(format!("outcome = ?{}", args.len()));
    }
    if let Some(provider) = &f.provider {
        args.push(Value::Text(provider.to_ascii_lowercase()));
        parts.push(format!("provider = ?{}", args.len()));
    }
    if let Some(rule) = &f.rule {
        // `rules` is a comma-separated list of the names that fired.
        args.push(Value::Text(rule.clone()));
        parts.push(dialect.list_has("rules", args.len()));
    }
    if !has_columns && (f.tag.is_some() || f.path.is_some() || f.mode.is_some()) {
        parts.push(NOTHING.into());
    }
    if let Some(tag) = f.tag.as_ref().filter(|_| has_columns) {
        // `tags` is a comma-separated list, like `rules`.
        args.push(Value::Text(tag.clone()));
        parts.push(dialect.list_has("tags", args.len()));
    }
    if let Some(path) = f.path.as_ref().filter(|_| has_columns) {
        args.push(Value::Text(like_pattern(path, false)));
        let n = args.len();
        let query_at = dialect.position("path || '?'", "'?'");
        parts.push(format!(
            "(path LIKE ?{n} ESCAPE '\\' OR substr(path, 1, {query_at} - 1) LIKE ?{n} ESCAPE '\\')"
        ));
    }
    if let Some(mode) = f.mode.as_ref().filter(|_| has_columns) {
        args.push(Value::Text(mode.to_ascii_lowercase()));
        parts.push(format!("mode = ?{}", args.len()));
    }
    if let Some(seq) = f.after_seq {
        args.push(Value::Int(seq));
        parts.push(format!("{} > ?{}", dialect.seq(), args.len()));
    }
    if let Some(side) = f.side.filter(|_| has_columns) {
        args.push(Value::Bool(side));
        parts.push(format!("side = ?{}", args.len()));
    }
    match (&f.verdict, has_cache) {
        (Some(verdict), true) => {
            // The cache column starts with the verdict word: `hit`, `partial system[2]`.
            args.push(Value::Text(verdict.to_ascii_lowercase()));
            parts.push(dialect.verdict_is(args.len()));
        }
        (Some(_), false) => parts.push(NOTHING.into()),
        (None, _) => {}
    }
    let clause = if parts.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", parts.join(" AND "))
    };
    (clause, args)
}

/// A LIKE pattern: `*` matches anything, everything else literally; `prefix` adds a
/// trailing `%`.
fn like_pattern(text: &str, prefix: bool) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    for c in text.chars() {
        match c {
            '%' | '_' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            '*' => out.push('%'),
            c => out.push(c),
        }
    }
    if prefix {
        out.push('%');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, started_ms: u64, body: &str) -> CaptureRecord {
        let mut r = CaptureRecord {
            id: id.into(),
            outcome: "ok".into(),
            provider: Some("anthropic".into()),
            api: Some("messages".into()),
            captured: true,
            ..CaptureRecord::default()
        };
        r.times.started_ms = started_ms;
        r.request.body = BodyInfo::of(Bytes::from(body.to_owned()), None);
        r
    }

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pg-store-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn at(d: &Path) -> StoreLocation {
        StoreLocation::Dir(d.to_path_buf())
    }

    fn turn(n: usize) -> String {
        turn_of(0..n)
    }

    /// A turn of the messages `rounds` (one that dropped its oldest starts past 0).
    fn turn_of(rounds: std::ops::Range<usize>) -> String {
        let messages: Vec<String> = rounds
            .map(|i| {
                format!(
                    r#"{{"role":"user","content":"message {i} {}"}}"#,
                    "x".repeat(2000)
                )
            })
            .collect();
        format!(
            r#"{{"model":"m","messages":[{}],"max_tokens":5}}"#,
            messages.join(",")
        )
    }

    #[test]
    fn bodies_rebuild_exactly_and_units_are_shared() {
        let d = dir("share");
        let mut store = Store::open(&at(&d)).unwrap();
        store
            .insert(&[record("01A", 1, &turn(3)), record("01B", 2, &turn(4))])
            .unwrap();
        store.insert(&[record("01A", 1, &turn(3))]).unwrap();
        let stats = store.stats().unwrap();
        assert_eq!(stats.records, 2, "an id is stored once");
        assert_eq!(stats.units, 4 + 2, "4 distinct messages and 2 skeletons");
        assert_eq!(
            store.load("01b").unwrap().request.body.bytes,
            turn(4).as_bytes()
        );
        assert!(matches!(store.load("01"), Err(StoreError::Ambiguous(_, 2))));
        drop(store);
        let mut read = Store::open_read_only(&at(&d)).unwrap();
        assert_eq!(read.list(&Filter::default()).unwrap().len(), 2);
        assert!(read.insert(&[record("01C", 3, "{}")]).is_err(), "read-only");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_write_waits_for_another_connection_that_holds_the_write_lock() {
        let d = dir("locked");
        let mut store = Store::open(&at(&d)).unwrap();
        store.insert(&[record("01A", 1, &turn(2))]).unwrap();
        // Another process writing (a second promptgate, `captures gc`): a write
        // waits for it, up to the busy timeout, rather than failing at once.
        let blocker = rusqlite::Connection::open(d.join(DB_FILE)).unwrap();
        blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            blocker.execute_batch("ROLLBACK").unwrap();
        });
        let started = std::time::Instant::now();
        store.insert(&[record("01B", 2, &turn(3))]).unwrap();
        assert!(started.elapsed() >= std::time::Duration::from_millis(250));
        release.join().unwrap();
        assert_eq!(store.stats().unwrap().records, 2);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn retention_by_age_and_size_prunes_records_and_their_units() {
        let d = dir("prune");
        let mut store = Store::open(&at(&d)).unwrap();
        // A clock late enough that units marked at 0 have long been idle.
        const BASE: u64 = 1 << 40;
        for i in 0..40u64 {
            let body = format!(r#"{{"messages":[{{"n":{i},"t":"{}"}}]}}"#, ring_text(i));
            store
                .insert(&[record(&format!("01{i:03}"), BASE + i * 1000, &body)])
                .unwrap();
        }
        // Nobody has marked a unit used since (the clock here starts at 0).
        store
            .conn
            .execute("UPDATE units SET used_ms = 0", &[])
            .unwrap();
        let by_age = Retention {
            max_age: Some(Duration::from_secs(20)),
            max_size: None,
        };
        let pruned = store.prune(&by_age, BASE + 40_000).unwrap();
        assert_eq!(pruned.records, 20, "older than 20 s at t=40 s");
        assert_eq!(pruned.units, 20, "their own messages went with them");
        // Twenty left: enough unit pages that half the size keeps some of them
        // beside the schema's own pages.
        assert_eq!(store.stats().unwrap().records, 20);
        let size = store.stats().unwrap().used_bytes;
        let by_size = Retention {
            max_age: None,
            max_size: Some(size / 2),
        };
        store.prune(&by_size, BASE + 40_000).unwrap();
        let left = store.list(&Filter::default()).unwrap();
        assert!(!left.is_empty() && left.len() < 20, "{}", left.len());
        assert_eq!(left.last().unwrap().id, "01039", "the newest stay");
        assert!(store.stats().unwrap().used_bytes <= size / 2);
        for row in left {
            store.load(&row.id).unwrap();
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A body stored again with the parts stored for it (a resend) is laid out as
    /// it was, while its units are trusted; past that it is looked up again, and
    /// units collected meanwhile are stored anew.
    #[test]
    fn a_body_stored_again_takes_its_layout_while_its_units_are_trusted() {
        let d = dir("laid-out");
        let mut a = Store::open(&at(&d)).unwrap();
        let mut b = Store::open(&at(&d)).unwrap();
        let body = BodyInfo::of(Bytes::from(turn(3)), None);
        let parts = std::sync::Arc::new(
            UnitWriter::pieces(&body, Some(Format::AnthropicMessages)).into_owned(),
        );
        let resent = |id: &str, at: u64| {
            let mut r = record(id, at, &turn(3));
            r.request.body.parts = Some(parts.clone());
            r
        };
        let kept = |store: &Store| {
            store
                .units
                .laid_out
                .iter()
                .any(|l| std::sync::Arc::ptr_eq(&l.parts, &parts))
        };
        a.insert(&[resent("01A", 1)]).unwrap();
        assert!(kept(&a), "its layout is kept");
        // A batch whose records carry their answers: the answers, each new, do
        // not push the request's layout out.
        let answered = |id: &str, at: u64| {
            let mut r = resent(id, at);
            r.response.body = BodyInfo::of_response(Bytes::from(format!("answer {id}")));
            r
        };
        let batch: Vec<CaptureRecord> = (0..LAID_OUT + 2)
            .map(|i| answered(&format!("01A{i}"), 1))
            .collect();
        a.insert(&batch).unwrap();
        assert!(kept(&a), "its layout is kept beside a batch of answers");
        a.conn
            .execute("DELETE FROM records WHERE id > '01A'", &[])
            .unwrap();
        a.insert(&[resent("01B", 2)]).unwrap();
        let layouts: Vec<Vec<u8>> = a
            .conn
            .query("SELECT received FROM records ORDER BY id", &[])
            .unwrap()
            .into_iter()
            .map(|row| row.blob(0).unwrap())
            .collect();
        assert_eq!(layouts.len(), 2);
        assert_eq!(layouts[0], layouts[1]);
        assert_eq!(
            a.load("01B").unwrap().request.body.bytes,
            turn(3).as_bytes()
        );
        // Another replica drops the records and, long after, their units.
        b.conn.execute("DELETE FROM records", &[]).unwrap();
        let later = crate::capture::timestamp::now_ms() + UNTOUCHED_FOR.as_millis() as u64 + 1;
        assert!(b.prune(&Retention::default(), later).unwrap().units > 0);
        // A's trust has run out: the layout is not taken, the units are stored again.
        a.units.touch_every = Duration::ZERO;
        a.insert(&[resent("01C", 3)]).unwrap();
        assert_eq!(
            a.load("01C").unwrap().request.body.bytes,
            turn(3).as_bytes()
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A conversation's next turn takes its last turn's unit ids by place while they
    /// are trusted, and every turn reads back as it was sent; past the trust, after
    /// another replica collected the units, they are looked for and stored again.
    /// A response is stored in its record's row, not as a unit: distinct responses
    /// add no unit, and each reads back whole, also to a search. One stored as a
    /// unit (before schema 9) still reads, and garbage collection keeps its unit.
    #[test]
    fn responses_are_stored_in_their_rows_and_older_ones_as_units_still_read() {
        let d = dir("inline");
        let mut store = Store::open(&at(&d)).unwrap();
        let units = |s: &Store| {
            s.conn
                .query_row("SELECT COUNT(*) FROM units", &[])
                .unwrap()
                .unwrap()
                .int(0)
                .unwrap()
        };
        let answered = |id: &str, answer: &str| {
            let mut r = record(id, 1, &turn(1));
            r.response.body = BodyInfo::of(Bytes::from(answer.to_owned()), None);
            r
        };
        store
            .insert(&[answered("01A", "the first answer")])
            .unwrap();
        let after_one = units(&store);
        store
            .insert(&[answered("01B", "the second answer")])
            .unwrap();
        assert_eq!(units(&store), after_one, "the same request, another answer");
        for (id, answer) in [("01A", "the first answer"), ("01B", "the second answer")] {
            assert_eq!(
                store.load(id).unwrap().response.body.bytes,
                answer.as_bytes()
            );
        }
        let grep = |s: &Store, needle: &str| {
            let filter = Filter {
                grep: Some(needle.into()),
                ..Filter::default()
            };
            s.list(&filter)
                .unwrap()
                .into_iter()
                .map(|r| r.id)
                .collect::<Vec<_>>()
        };
        assert_eq!(grep(&store, "second answer"), ["01B"]);
        // A response stored the way schema 8 stored it: a unit, and its layout.
        let old = b"an answer from before";
        let data = zstd::bulk::compress(old, ZSTD_LEVEL).unwrap();
        let rows = store
            .conn
            .query(
                "INSERT INTO units (hash, size, data, used_ms) VALUES (?1, ?2, ?3, 0) RETURNING id",
                &[
                    Value::Blob(digest::content(old).to_vec()),
                    Value::Int(old.len() as i64),
                    Value::Blob(data),
                ],
            )
            .unwrap();
        let unit = rows[0].int(0).unwrap();
        let mut before = answered("01C", "x");
        before.response.body = BodyInfo::of(Bytes::from_static(old), None);
        store.insert(&[before]).unwrap();
        store
            .conn
            .execute(
                "UPDATE records SET response = ?1 WHERE id = '01C'",
                &[Value::Blob(layout::encode(unit, &[]))],
            )
            .unwrap();
        assert_eq!(store.load("01C").unwrap().response.body.bytes, &old[..]);
        assert_eq!(grep(&store, "from before"), ["01C"]);
        let later = crate::capture::timestamp::now_ms() + UNTOUCHED_FOR.as_millis() as u64 + 1;
        store.prune(&Retention::default(), later).unwrap();
        assert_eq!(store.load("01C").unwrap().response.body.bytes, &old[..]);
        // A damaged body in its row is an error for its record, not a panic.
        store
            .conn
            .execute(
                "UPDATE records SET response = ?1 WHERE id = '01B'",
                &[Value::Blob(layout::encode_inline(b"not zstd"))],
            )
            .unwrap();
        assert!(store.load("01B").is_err());
    }

    #[test]
    fn a_turn_takes_its_last_turn_s_unit_ids_by_place_while_they_are_trusted() {
        let d = dir("placed");
        let mut a = Store::open(&at(&d)).unwrap();
        let mut b = Store::open(&at(&d)).unwrap();
        let of = |id: &str, at: u64, n: usize| {
            let mut r = record(id, at, &turn(n));
            r.conversation = Some("c".into());
            r
        };
        let mut hits = Vec::new();
        for (i, n) in [3, 4, 5].into_iter().enumerate() {
            let id = format!("01A{i}");
            let before = a.units.placed_hits;
            a.insert(&[of(&id, i as u64, n)]).unwrap();
            hits.push(a.units.placed_hits - before);
            assert_eq!(a.load(&id).unwrap().request.body.bytes, turn(n).as_bytes());
        }
        // The first turn has none; each later one every message of the one before.
        assert_eq!(hits, [0, 3, 4]);
        // A turn that dropped more rounds than the by-place look reaches takes the
        // ones that stayed by place too.
        let mut dropped = record("01A9", 4, &turn_of(10..15));
        dropped.conversation = Some("c".into());
        let before = a.units.placed_hits;
        a.insert(&[of("01A8", 3, 14)]).unwrap();
        a.insert(std::slice::from_ref(&dropped)).unwrap();
        assert_eq!(a.units.placed_hits - before, 5 + 4);
        assert_eq!(
            a.load("01A9").unwrap().request.body.bytes,
            turn_of(10..15).as_bytes()
        );
        // Another conversation's turn does not take them.
        let before = a.units.placed_hits;
        let mut other = record("01B", 9, &turn(6));
        other.conversation = Some("other".into());
        a.insert(&[other]).unwrap();
        assert_eq!(a.units.placed_hits, before);
        // Another replica drops the records and, long after, their units; A's trust
        // has run out: no id is taken by place, and the turn reads back whole.
        b.conn.execute("DELETE FROM records", &[]).unwrap();
        let later = crate::capture::timestamp::now_ms() + UNTOUCHED_FOR.as_millis() as u64 + 1;
        assert!(b.prune(&Retention::default(), later).unwrap().units > 0);
        a.units.touch_every = Duration::ZERO;
        let before = a.units.placed_hits;
        a.insert(&[of("01C", 10, 6)]).unwrap();
        assert_eq!(a.units.placed_hits, before);
        assert_eq!(
            a.load("01C").unwrap().request.body.bytes,
            turn(6).as_bytes()
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Two writers on one store, as two replicas share one database: a unit one
    /// of them marked used lately survives the other's garbage collection though
    /// no record uses it; one untouched long enough goes, and a writer that no
    /// longer trusts its memory of it stores it again.
    #[test]
    fn garbage_collection_spares_units_a_writer_may_still_reference() {
        let d = dir("gc-race");
        let mut a = Store::open(&at(&d)).unwrap();
        let mut b = Store::open(&at(&d)).unwrap();
        a.insert(&[record("01A", 1, &turn(3))]).unwrap();
        let units = a.stats().unwrap().units;
        // B's retention removes the record; A still remembers its units.
        b.conn.execute("DELETE FROM records", &[]).unwrap();
        let now = crate::capture::timestamp::now_ms();
        assert_eq!(b.prune(&Retention::default(), now).unwrap().units, 0);
        assert_eq!(b.stats().unwrap().units, units, "marked used a moment ago");
        // Long after: nobody marked them, so they go.
        let later = now + UNTOUCHED_FOR.as_millis() as u64 + 1;
        assert_eq!(b.prune(&Retention::default(), later).unwrap().units, units);
        // A asks again (its trust has run out) and stores them anew: the record is whole.
        a.units.touch_every = Duration::ZERO;
        a.insert(&[record("01B", 2, &turn(3))]).unwrap();
        assert_eq!(
            a.load("01B").unwrap().request.body.bytes,
            turn(3).as_bytes()
        );
        assert_eq!(a.stats().unwrap().units, units);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_schema_1_store_reads_as_it_is_and_migrates_when_opened_for_writing() {
        let d = dir("migrate");
        std::fs::create_dir_all(&d).unwrap();
        {
            let mut conn = rusqlite::Connection::open(d.join(DB_FILE)).unwrap();
            let tx = conn.transaction().unwrap();
            sqlite::migrate_0_to_1(&tx).unwrap();
            tx.pragma_update(None, "user_version", 1).unwrap();
            let mut old = record("01A00", 1, "{}");
            old.tags = vec!["old-tag".into()];
            old.api = Some("count_tokens".into());
            let meta = serde_json::to_vec(&old).unwrap();
            tx.execute(
                "INSERT INTO records (id, started_ms, outcome, meta) VALUES ('01A00', 1, 'ok', ?1)",
                [zstd::bulk::compress(&meta, ZSTD_LEVEL).unwrap()],
            )
            .unwrap();
            tx.commit().unwrap();
        }
        let old = Store::open_read_only(&at(&d)).unwrap();
        let rows = old.list(&Filter::default()).unwrap();
        assert_eq!((rows.len(), rows[0].cache.clone()), (1, None));
        assert!(old.load("01A00").unwrap().cache.is_none());
        // Filters on columns the old schema lacks match nothing, and do not fail.
        let tagged = Filter {
            tag: Some("old-tag".into()),
            ..Filter::default()
        };
        assert!(old.list(&tagged).unwrap().is_empty());
        drop(old);
        let mut store = Store::open(&at(&d)).unwrap();
        let version: i64 = rusqlite::Connection::open(d.join(DB_FILE))
            .unwrap()
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(version, sqlite::SCHEMA_VERSION);
        // The migration filled the new columns from the stored metadata.
        assert_eq!(store.list(&tagged).unwrap().len(), 1);
        let side = Filter {
            side: Some(true),
            ..Filter::default()
        };
        assert_eq!(
            store.count(&side).unwrap(),
            1,
            "count_tokens is a side request"
        );
        let mut new = record("01B00", 2, "{}");
        new.cache = serde_json::from_value(serde_json::json!({
            "provider": "anthropic", "conversation": "cc:x", "model": "m", "started_ms": 2,
            "units": 1, "positions": 1, "breakpoints": [], "min_tokens": 512,
            "prediction": {"read_tokens": 0, "write_tokens": 0, "write_1h_tokens": 0, "exact": false},
            "actual": {"read": 0, "write": 0, "input": 9}, "verdict": "miss",
            "reason": {"kind": "ttl_expired", "unit": "system[1]", "idle_s": 400, "ttl_s": 300},
            "lost_tokens": 0, "estimate": {"tokens": 9, "actual": 9, "error_pct": 0.0}
        }))
        .unwrap();
        store.insert(&[new]).unwrap();
        let cells: Vec<Option<String>> = store
            .list(&Filter::default())
            .unwrap()
            .into_iter()
            .map(|r| r.cache)
            .collect();
        assert_eq!(cells, [None, Some("MISS ttl".to_owned())]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn text_stored_before_the_nul_escape_reads_back_as_it_was_given() {
        let d = dir("escape");
        let mut store = Store::open(&at(&d)).unwrap();
        store.insert(&[record("01A", 1, "{}")]).unwrap();
        drop(store);
        // As a schema-5 promptgate stored them: NUL and the escape character as given.
        let raw = rusqlite::Connection::open(d.join(DB_FILE)).unwrap();
        raw.execute(
            "UPDATE records SET model = ?1, conversation = ?2",
            ["a\0b", "c\u{1}0"],
        )
        .unwrap();
        raw.execute_batch("ALTER TABLE records DROP COLUMN cost_microusd")
            .unwrap();
        raw.pragma_update(None, "user_version", 5).unwrap();
        drop(raw);
        let store = Store::open(&at(&d)).unwrap();
        let rows = store.list(&Filter::default()).unwrap();
        assert_eq!(rows[0].model.as_deref(), Some("a\0b"));
        assert_eq!(rows[0].conversation.as_deref(), Some("c\u{1}0"));
        let by = |model: &str, conversation: &str| Filter {
            model: Some(model.into()),
            conversation: Some(conversation.into()),
            ..Filter::default()
        };
        assert_eq!(store.count(&by("a\0b", "c\u{1}0")).unwrap(), 1);
        assert_eq!(store.count(&by("a\0c", "c")).unwrap(), 0);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_record_stored_before_blake3_reads_and_is_checked_with_sha256() {
        let d = dir("sha256");
        let body = turn(2);
        let mut store = Store::open(&at(&d)).unwrap();
        store.insert(&[record("01A", 1, &body)]).unwrap();
        let set_meta = |store: &Store, meta: &serde_json::Value| {
            let meta = zstd::bulk::compress(&serde_json::to_vec(meta).unwrap(), ZSTD_LEVEL);
            let sql = "UPDATE records SET meta = ?1 WHERE id = '01A'";
            store.conn.execute(sql, &[meta.unwrap().into()]).unwrap();
        };
        // The meta as an older promptgate wrote it: SHA-256 digests, the old names.
        let sha = digest::hex(&digest::sha256(body.as_bytes()));
        let mut old = serde_json::to_value(record("01A", 1, &body)).unwrap();
        old.as_object_mut().unwrap().remove("digest");
        old.as_object_mut().unwrap().remove("received_digest");
        old["received_sha256"] = sha.clone().into();
        old["request"]["body"]
            .as_object_mut()
            .unwrap()
            .remove("digest");
        old["request"]["body"]["sha256"] = sha.into();
        set_meta(&store, &old);
        let loaded = store.load("01A").unwrap();
        assert_eq!(loaded.digest, digest::Algorithm::Sha256);
        assert_eq!(loaded.request.body.bytes, body.as_bytes());
        // A body that does not match its SHA-256 is refused, naming the algorithm.
        old["request"]["body"]["sha256"] = digest::content_hex(body.as_bytes()).into();
        set_meta(&store, &old);
        let e = store.load("01A").unwrap_err().to_string();
        assert!(e.contains("does not match its sha256"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Text that does not compress away: the size limit must see real bytes.
    fn ring_text(seed: u64) -> String {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..6000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (b'a' + (x % 26) as u8) as char
            })
            .collect()
    }
}
