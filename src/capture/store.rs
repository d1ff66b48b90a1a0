//! The capture store: SQLite (WAL) at `<captures dir>/promptgate.db`, schema version
//! in `PRAGMA user_version` (one `migrate_N_to_M` per step). Each distinct unit is
//! kept once, zstd-compressed, under its SHA-256; a record keeps its metadata and,
//! per body, the layout of its units. It stores what it is given: redaction is done.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use rusqlite::{Connection, OpenFlags, OptionalExtension, Transaction, params};

use super::layout;
use super::record::{BodyInfo, CaptureRecord};
use crate::digest;
use crate::prompt::{Format, Prompt};

/// The file name of the store inside the captures directory.
pub const DB_FILE: &str = "promptgate.db";

/// Bytes the store in `dir` takes on disk: the database, its write-ahead log and
/// shared-memory index (0 for what does not exist).
pub fn size_on_disk(dir: &Path) -> u64 {
    ["", "-wal", "-shm"]
        .iter()
        .filter_map(|suffix| std::fs::metadata(dir.join(format!("{DB_FILE}{suffix}"))).ok())
        .map(|m| m.len())
        .sum()
}
/// The schema this build writes.
const SCHEMA_VERSION: i64 = 3;
/// zstd level for units: fast, and most of the saving comes from storing each unit once.
const ZSTD_LEVEL: i32 = 3;
/// Unit hashes remembered in memory to skip a lookup (about 3 MB at most; the
/// lookup they save is one index probe).
const KNOWN_UNITS: usize = 50_000;

/// What can go wrong with the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "no captures in {0} (start promptgate with --captures DIR, or pass the same --captures here)"
    )]
    Missing(String),
    #[error(
        "{0}: written by a newer promptgate (schema {1}, this one reads up to {SCHEMA_VERSION})"
    )]
    Newer(String, i64),
    #[error("no capture {0:?}")]
    NotFound(String),
    #[error("{0:?} matches {1} captures; give more of the id")]
    Ambiguous(String, usize),
    #[error("capture store is damaged: {0}")]
    Corrupt(String),
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("zstd: {0}")]
    Zstd(std::io::Error),
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
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
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
}

/// One conversation: its requests and tokens.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ConversationRow {
    pub conversation: Option<String>,
    pub requests: u64,
    pub models: Vec<String>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
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
    conn: Connection,
    path: PathBuf,
    units: UnitWriter,
    /// The schema of the file (older than [`SCHEMA_VERSION`] only when read-only).
    version: i64,
}

/// Writes units: remembers the ids of units already stored (a lookup saved per unit)
/// and keeps one zstd context for every unit and record.
struct UnitWriter {
    known: HashMap<[u8; 32], i64>,
    zstd: zstd::bulk::Compressor<'static>,
}

impl UnitWriter {
    fn new() -> Result<UnitWriter, StoreError> {
        Ok(UnitWriter {
            known: HashMap::new(),
            zstd: zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(StoreError::Zstd)?,
        })
    }

    /// `bytes` compressed; the same output as `zstd::bulk::compress` at [`ZSTD_LEVEL`].
    fn compress(&mut self, bytes: &[u8]) -> Result<Vec<u8>, std::io::Error> {
        self.zstd.compress(bytes)
    }

    /// Stores a body's skeleton and units (cut here, as a request of `format`,
    /// unless the writer already did); returns its layout.
    fn store_body(
        &mut self,
        tx: &Transaction<'_>,
        body: &BodyInfo,
        format: Option<Format>,
    ) -> Result<Vec<u8>, StoreError> {
        if let Some(parts) = &body.parts {
            let (skeleton, hash) = &parts.skeleton;
            let skeleton = self.id(tx, skeleton, *hash)?;
            let units = parts
                .units
                .iter()
                .map(|(offset, unit, hash)| Ok((*offset, self.id(tx, unit, *hash)?)))
                .collect::<Result<Vec<_>, StoreError>>()?;
            return Ok(layout::encode(skeleton, &units));
        }
        let prompt = Prompt::read(body.bytes.clone(), format);
        let split = layout::split(&prompt);
        let skeleton = self.id(tx, &split.skeleton, digest::content(&split.skeleton))?;
        let units = split
            .units
            .iter()
            .map(|(offset, unit)| Ok((*offset, self.id(tx, unit, digest::content(unit))?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(layout::encode(skeleton, &units))
    }

    /// The id of the unit holding `bytes` (whose content digest is `hash`), storing it if new.
    fn id(
        &mut self,
        tx: &Transaction<'_>,
        bytes: &[u8],
        hash: [u8; 32],
    ) -> Result<i64, StoreError> {
        if let Some(id) = self.known.get(&hash) {
            return Ok(*id);
        }
        let found: Option<i64> = tx
            .prepare_cached("SELECT id FROM units WHERE hash = ?1")?
            .query_row([&hash[..]], |r| r.get(0))
            .optional()?;
        let id = match found {
            Some(id) => id,
            None => {
                let data = self
                    .compress(bytes)
                    .map_err(|e| StoreError::Corrupt(format!("compressing a unit: {e}")))?;
                tx.prepare_cached("INSERT INTO units (hash, size, data) VALUES (?1, ?2, ?3)")?
                    .execute(params![&hash[..], bytes.len() as i64, data])?;
                tx.last_insert_rowid()
            }
        };
        self.known.insert(hash, id);
        Ok(id)
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

impl Store {
    /// Opens (creating if needed) the store in `dir` for writing.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let path = dir.join(DB_FILE);
        let conn = Connection::open(&path)?;
        conn.busy_timeout(Duration::from_secs(10))?;
        // Set before the first table exists; a no-op afterwards.
        conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
        let mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Corrupt(format!(
                "could not switch to WAL (got {mode})"
            )));
        }
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        // Sorts and indexes stay in memory: nothing of the captures goes to a temp file.
        conn.pragma_update(None, "temp_store", "MEMORY")?;
        let mut store = Store {
            conn,
            path,
            units: UnitWriter::new()?,
            version: 0,
        };
        store.migrate()?;
        Ok(store)
    }

    /// Opens an existing store for reading only (the command line, the admin API).
    pub fn open_read_only(dir: &Path) -> Result<Store, StoreError> {
        let path = dir.join(DB_FILE);
        if !path.exists() {
            return Err(StoreError::Missing(dir.display().to_string()));
        }
        // Read-write flags (no create) so a WAL store opens while the proxy writes it;
        // `query_only` then refuses every write.
        let conn = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(Duration::from_secs(10))?;
        conn.pragma_update(None, "temp_store", "MEMORY")?;
        conn.pragma_update(None, "query_only", "ON")?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::Newer(path.display().to_string(), version));
        }
        if version == 0 {
            return Err(StoreError::Missing(dir.display().to_string()));
        }
        // An older schema is read as it is (what it lacks reads as absent); only a
        // writer migrates it.
        Ok(Store {
            conn,
            path,
            units: UnitWriter::new()?,
            version,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn migrate(&mut self) -> Result<(), StoreError> {
        let version: i64 = self
            .conn
            .pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::Newer(self.path.display().to_string(), version));
        }
        for step in version..SCHEMA_VERSION {
            let tx = self.conn.transaction()?;
            match step {
                0 => migrate_0_to_1(&tx)?,
                1 => migrate_1_to_2(&tx)?,
                2 => migrate_2_to_3(&tx)?,
                _ => unreachable!("one migration per schema step"),
            }
            tx.pragma_update(None, "user_version", step + 1)?;
            tx.commit()?;
        }
        self.version = SCHEMA_VERSION;
        Ok(())
    }

    /// Stores records (already redacted) in one transaction. A record whose id is
    /// already stored is skipped: each exchange is stored once.
    pub fn insert(&mut self, records: &[CaptureRecord]) -> Result<(), StoreError> {
        let result = self.insert_all(records);
        if result.is_err() {
            // Ids remembered inside a rolled-back transaction may not exist.
            self.units.known.clear();
        }
        result
    }

    fn insert_all(&mut self, records: &[CaptureRecord]) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        for record in records {
            let exists: Option<i64> = tx
                .query_row("SELECT 1 FROM records WHERE id = ?1", [&record.id], |r| {
                    r.get(0)
                })
                .optional()?;
            if exists.is_some() {
                continue;
            }
            let mut layouts: [Option<Vec<u8>>; 4] = Default::default();
            if record.captured {
                let bodies = [
                    Some(&record.request.body),
                    record.request.sent_body.as_ref(),
                    Some(&record.response.body),
                    record.response.message.as_ref(),
                ];
                let format = record.request_format();
                for (i, (slot, body)) in layouts.iter_mut().zip(bodies).enumerate() {
                    if let Some(body) = body.filter(|b| !b.bytes.is_empty()) {
                        // The request bodies are cut at their units; responses stay whole.
                        let format = format.filter(|_| i < 2);
                        *slot = Some(self.units.store_body(&tx, body, format)?);
                    }
                }
            }
            let meta = serde_json::to_vec(record)
                .map_err(|e| StoreError::Corrupt(format!("record {}: {e}", record.id)))?;
            let meta = self.units.compress(&meta).map_err(|e| {
                StoreError::Corrupt(format!("compressing record {}: {e}", record.id))
            })?;
            let usage = record.usage.as_ref();
            let [received, sent, response, message] = layouts;
            tx.execute(
                "INSERT INTO records (id, started_ms, conversation, model, provider, status, outcome,
                   input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, rules,
                   meta, received, sent, response, message, cache, tags, path, mode, side)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17,
                   ?18, ?19, ?20, ?21, ?22)",
                params![
                    record.id,
                    record.times.started_ms as i64,
                    record.conversation,
                    record.model,
                    record.provider,
                    record.response.status,
                    record.outcome,
                    usage.map(|u| u.input_tokens as i64),
                    usage.map(|u| u.output_tokens as i64),
                    usage.map(|u| u.cache_read_tokens as i64),
                    usage.map(|u| u.cache_write_tokens as i64),
                    record.rules_fired.join(","),
                    meta,
                    received,
                    sent,
                    response,
                    message,
                    record.cache.as_ref().map(|c| c.short()),
                    record.tags.join(","),
                    record.path,
                    record.mode,
                    record.side,
                ],
            )?;
        }
        tx.commit()?;
        if self.units.known.len() > KNOWN_UNITS {
            self.units.known.clear();
        }
        Ok(())
    }

    /// The full id of the one record whose id starts with `prefix` (case-insensitive),
    /// or of `last` (the newest) and `@-N` (the Nth before it).
    pub fn resolve(&self, prefix: &str) -> Result<String, StoreError> {
        // `last` is the newest record, `@-1` the one before it, `@-2` the one before that.
        let back = match prefix.trim() {
            "last" => Some(0),
            p => p.strip_prefix("@-").and_then(|n| n.parse::<i64>().ok()),
        };
        if let Some(back) = back {
            return self
                .conn
                .query_row(
                    "SELECT id FROM records ORDER BY id DESC LIMIT 1 OFFSET ?1",
                    [back],
                    |r| r.get(0),
                )
                .optional()?
                .ok_or_else(|| StoreError::NotFound(prefix.to_owned()));
        }
        let p = prefix.trim().to_ascii_uppercase();
        if p.is_empty() {
            return Err(StoreError::NotFound(prefix.to_owned()));
        }
        let mut stmt = self
            .conn
            .prepare("SELECT id FROM records WHERE id >= ?1 AND id < ?1 || '~' LIMIT 50")?;
        let ids: Vec<String> = stmt
            .query_map([&p], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        match ids.len() {
            0 => Err(StoreError::NotFound(prefix.to_owned())),
            1 => Ok(ids.into_iter().next().unwrap_or_default()),
            n => Err(StoreError::Ambiguous(prefix.to_owned(), n)),
        }
    }

    /// The record before `id` in its conversation, if it has one and is not the first.
    pub fn previous_in_conversation(&self, id: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .conn
            .query_row(
                "SELECT id FROM records WHERE id < ?1 AND conversation IS NOT NULL
                   AND conversation = (SELECT conversation FROM records WHERE id = ?1)
                 ORDER BY id DESC LIMIT 1",
                [id],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// A record with its bodies loaded and checked against their hashes.
    pub fn load(&self, id: &str) -> Result<CaptureRecord, StoreError> {
        let id = self.resolve(id)?;
        let (meta, layouts): (Vec<u8>, [Option<Vec<u8>>; 4]) = self.conn.query_row(
            "SELECT meta, received, sent, response, message FROM records WHERE id = ?1",
            [&id],
            |r| Ok((r.get(0)?, [r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?])),
        )?;
        let mut record = decode_meta(&id, &meta)?;
        let algorithm = record.digest;
        for (body, layout) in record.bodies_mut().into_iter().zip(layouts) {
            if let (Some(body), Some(layout)) = (body, layout) {
                self.fill(&id, body, &layout, algorithm)?;
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
        let (skeleton, units) =
            layout::decode(layout).ok_or_else(|| StoreError::Corrupt("bad layout".into()))?;
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
        let (size, data): (i64, Vec<u8>) = self
            .conn
            .prepare_cached("SELECT size, data FROM units WHERE id = ?1")?
            .query_row([id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?
            .ok_or_else(|| StoreError::Corrupt(format!("unit {id} is missing")))?;
        zstd::bulk::decompress(&data, size.max(0) as usize)
            .map_err(|e| StoreError::Corrupt(format!("unit {id}: {e}")))
    }

    /// Records matching `filter`, oldest first.
    /// How many records the column filters of `filter` select (no grep, no paging).
    pub fn count(&self, filter: &Filter) -> Result<u64, StoreError> {
        let (clause, args) = where_clause(filter, self.version);
        let n: i64 = self.conn.query_row(
            &format!("SELECT COUNT(*) FROM records {clause}"),
            rusqlite::params_from_iter(args.iter()),
            |r| r.get(0),
        )?;
        Ok(n as u64)
    }

    /// The [`Row::seq`] of the last record stored (0 for an empty store).
    pub fn last_seq(&self) -> Result<i64, StoreError> {
        let n: Option<i64> = self
            .conn
            .query_row("SELECT max(rowid) FROM records", [], |r| r.get(0))?;
        Ok(n.unwrap_or(0))
    }

    pub fn list(&self, filter: &Filter) -> Result<Vec<Row>, StoreError> {
        let (clause, args) = where_clause(filter, self.version);
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
        let sql = format!(
            "SELECT id, started_ms, conversation, model, provider, status, outcome, input_tokens,
               output_tokens, cache_read_tokens, cache_write_tokens, rules, meta, received, sent,
               response, message, {cache}, rowid, {columns}
             FROM records {clause} ORDER BY id DESC LIMIT {limit}"
        );
        let mut stmt = self.conn.prepare(&sql)?;
        let mut rows = stmt.query(rusqlite::params_from_iter(args.iter()))?;
        let mut out = Vec::new();
        let mut unit_hits: HashMap<i64, bool> = HashMap::new();
        let wanted = filter.limit.unwrap_or(usize::MAX);
        let mut skipped = 0;
        while let Some(r) = rows.next()? {
            let row = Row {
                id: r.get(0)?,
                started_ms: r.get::<_, i64>(1)? as u64,
                conversation: r.get(2)?,
                model: r.get(3)?,
                provider: r.get(4)?,
                status: r.get(5)?,
                outcome: r.get(6)?,
                input_tokens: r.get::<_, Option<i64>>(7)?.map(|v| v as u64),
                output_tokens: r.get::<_, Option<i64>>(8)?.map(|v| v as u64),
                cache_read_tokens: r.get::<_, Option<i64>>(9)?.map(|v| v as u64),
                cache_write_tokens: r.get::<_, Option<i64>>(10)?.map(|v| v as u64),
                rules: comma_list(&r.get::<_, String>(11)?),
                cache: r.get(17)?,
                seq: r.get(18)?,
                tags: comma_list(&r.get::<_, String>(19)?),
                path: r.get(20)?,
                side: r.get(21)?,
            };
            if let Some(needle) = &filter.grep {
                let meta: Vec<u8> = r.get(12)?;
                let layouts: [Option<Vec<u8>>; 4] =
                    [r.get(13)?, r.get(14)?, r.get(15)?, r.get(16)?];
                if !self.contains(&row.id, needle, &meta, &layouts, &mut unit_hits)? {
                    continue;
                }
            }
            if skipped < skip {
                skipped += 1;
                continue;
            }
            out.push(row);
            if out.len() >= wanted {
                break;
            }
        }
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
        let json = zstd::stream::decode_all(meta)
            .map_err(|e| StoreError::Corrupt(format!("record {id}: {e}")))?;
        if found(&json) {
            return Ok(true);
        }
        for layout in layouts.iter().flatten() {
            let (skeleton, units) =
                layout::decode(layout).ok_or_else(|| StoreError::Corrupt("bad layout".into()))?;
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

    /// Records matching `filter`, loaded in full, oldest first.
    pub fn records(&self, filter: &Filter) -> Result<Vec<CaptureRecord>, StoreError> {
        self.list(filter)?
            .into_iter()
            .map(|row| self.load(&row.id))
            .collect()
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
            g.first_ms = g.first_ms.min(row.started_ms);
            g.last_ms = g.last_ms.max(row.started_ms);
        }
        if let Some(n) = limit {
            let skip = groups.len().saturating_sub(n);
            groups.drain(..skip);
        }
        Ok(groups)
    }

    /// Deletes records past the retention, then units no record uses any more.
    pub fn prune(&mut self, retention: &Retention, now_ms: u64) -> Result<Pruned, StoreError> {
        let mut pruned = Pruned::default();
        if let Some(age) = retention.max_age {
            let cutoff = now_ms.saturating_sub(age.as_millis() as u64) as i64;
            pruned.records += self
                .conn
                .execute("DELETE FROM records WHERE started_ms < ?1", [cutoff])?
                as u64;
        }
        pruned.units += self.collect_garbage()?;
        if let Some(max) = retention.max_size {
            while self.stats()?.used_bytes > max {
                let count: i64 = self
                    .conn
                    .query_row("SELECT COUNT(*) FROM records", [], |r| r.get(0))?;
                if count == 0 {
                    break;
                }
                let batch = (count / 10).max(1);
                pruned.records += self.conn.execute(
                    "DELETE FROM records WHERE id IN (SELECT id FROM records ORDER BY id LIMIT ?1)",
                    [batch],
                )? as u64;
                pruned.units += self.collect_garbage()?;
            }
        }
        Ok(pruned)
    }

    /// Deletes units no record refers to, and gives their pages back to the file.
    fn collect_garbage(&mut self) -> Result<u64, StoreError> {
        let mut used: HashSet<i64> = HashSet::new();
        {
            let mut stmt = self
                .conn
                .prepare("SELECT received, sent, response, message FROM records")?;
            let mut rows = stmt.query([])?;
            while let Some(r) = rows.next()? {
                for i in 0..4 {
                    if let Some(layout) = r.get::<_, Option<Vec<u8>>>(i)? {
                        let (skeleton, units) = layout::decode(&layout)
                            .ok_or_else(|| StoreError::Corrupt("bad layout".into()))?;
                        used.insert(skeleton);
                        used.extend(units.into_iter().map(|(_, u)| u));
                    }
                }
            }
        }
        let all: Vec<i64> = self
            .conn
            .prepare("SELECT id FROM units")?
            .query_map([], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        let tx = self.conn.transaction()?;
        let mut removed = 0;
        for id in all.into_iter().filter(|id| !used.contains(id)) {
            removed += tx.execute("DELETE FROM units WHERE id = ?1", [id])? as u64;
        }
        tx.commit()?;
        if removed > 0 {
            self.units.known.clear();
            self.conn.execute_batch("PRAGMA incremental_vacuum;")?;
        }
        Ok(removed)
    }

    /// Counts and sizes.
    pub fn stats(&self) -> Result<Stats, StoreError> {
        let records: i64 = self
            .conn
            .query_row("SELECT COUNT(*) FROM records", [], |r| r.get(0))?;
        let (units, unit_bytes, stored): (i64, i64, i64) = self.conn.query_row(
            "SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(SUM(LENGTH(data)), 0) FROM units",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?;
        let pages: i64 = self
            .conn
            .pragma_query_value(None, "page_count", |r| r.get(0))?;
        let free: i64 = self
            .conn
            .pragma_query_value(None, "freelist_count", |r| r.get(0))?;
        let page: i64 = self
            .conn
            .pragma_query_value(None, "page_size", |r| r.get(0))?;
        Ok(Stats {
            records: records as u64,
            units: units as u64,
            unit_bytes: unit_bytes as u64,
            stored_unit_bytes: stored as u64,
            used_bytes: ((pages - free).max(0) * page) as u64,
        })
    }

    /// Moves the write-ahead log into the database file (on a clean close).
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        self.conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        Ok(())
    }
}

fn migrate_0_to_1(tx: &Transaction<'_>) -> Result<(), StoreError> {
    tx.execute_batch(
        "CREATE TABLE units (
           id   INTEGER PRIMARY KEY,
           hash BLOB NOT NULL UNIQUE,   -- digest of the uncompressed bytes: BLAKE3 (SHA-256 in older stores)
           size INTEGER NOT NULL,       -- uncompressed length
           data BLOB NOT NULL           -- zstd
         );
         CREATE TABLE records (
           id TEXT PRIMARY KEY,         -- ULID: sorts by time
           started_ms INTEGER NOT NULL,
           conversation TEXT,
           model TEXT,
           provider TEXT,
           status INTEGER,
           outcome TEXT NOT NULL,
           input_tokens INTEGER,
           output_tokens INTEGER,
           cache_read_tokens INTEGER,
           cache_write_tokens INTEGER,
           rules TEXT NOT NULL DEFAULT '',
           meta BLOB NOT NULL,          -- zstd JSON of the record without its bodies
           received BLOB,               -- layouts: skeleton + units, see layout.rs
           sent BLOB,
           response BLOB,
           message BLOB
         );
         CREATE INDEX records_started ON records (started_ms);
         CREATE INDEX records_conversation ON records (conversation, started_ms);",
    )?;
    Ok(())
}

/// Cache analysis: in the record's metadata; the verdict also in a column for listings.
fn migrate_1_to_2(tx: &Transaction<'_>) -> Result<(), StoreError> {
    tx.execute_batch("ALTER TABLE records ADD COLUMN cache TEXT;")?;
    Ok(())
}

/// A record's metadata column: zstd JSON of the record without its bodies.
fn decode_meta(id: &str, meta: &[u8]) -> Result<CaptureRecord, StoreError> {
    let json = zstd::stream::decode_all(meta)
        .map_err(|e| StoreError::Corrupt(format!("record {id}: {e}")))?;
    serde_json::from_slice(&json).map_err(|e| StoreError::Corrupt(format!("record {id}: {e}")))
}

/// Tags, path, mode and the side-request mark in columns, for the list filters;
/// filled in for the records already there from their metadata.
fn migrate_2_to_3(tx: &Transaction<'_>) -> Result<(), StoreError> {
    tx.execute_batch(
        "ALTER TABLE records ADD COLUMN tags TEXT NOT NULL DEFAULT '';
         ALTER TABLE records ADD COLUMN path TEXT;
         ALTER TABLE records ADD COLUMN mode TEXT;
         ALTER TABLE records ADD COLUMN side INTEGER NOT NULL DEFAULT 0;",
    )?;
    let rows: Vec<(String, Vec<u8>)> = {
        let mut stmt = tx.prepare("SELECT id, meta FROM records")?;
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?
    };
    let mut update =
        tx.prepare("UPDATE records SET tags = ?2, path = ?3, mode = ?4, side = ?5 WHERE id = ?1")?;
    for (id, meta) in rows {
        let r = decode_meta(&id, &meta)?;
        let method = http::Method::from_bytes(r.method.as_bytes()).unwrap_or(http::Method::GET);
        let api = r.api.as_deref().and_then(crate::provider::Api::from_name);
        let side = crate::provider::is_side_request(&method, api);
        update.execute(params![id, r.tags.join(","), r.path, r.mode, side])?;
    }
    Ok(())
}

/// The SQL for `f`'s column filters on a store of schema `version`: a filter on a
/// column an older store lacks matches nothing (the side mark: everything).
/// A `rules` or `tags` column: names joined by commas.
fn comma_list(column: &str) -> Vec<String> {
    column
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

fn where_clause(f: &Filter, version: i64) -> (String, Vec<rusqlite::types::Value>) {
    let has_cache = version >= 2;
    let has_columns = version >= 3;
    use rusqlite::types::Value;
    let mut parts = Vec::new();
    let mut args: Vec<Value> = Vec::new();
    if let Some(since) = f.since_ms {
        args.push(Value::Integer(since as i64));
        parts.push(format!("started_ms >= ?{}", args.len()));
    }
    if let Some(until) = f.until_ms {
        args.push(Value::Integer(until as i64));
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
        parts.push(format!(
            "instr(',' || rules || ',', ',' || ?{} || ',') > 0",
            args.len()
        ));
    }
    if !has_columns && (f.tag.is_some() || f.path.is_some() || f.mode.is_some()) {
        parts.push("0".into());
    }
    if let Some(tag) = f.tag.as_ref().filter(|_| has_columns) {
        // `tags` is a comma-separated list, like `rules`.
        args.push(Value::Text(tag.clone()));
        parts.push(format!(
            "instr(',' || tags || ',', ',' || ?{} || ',') > 0",
            args.len()
        ));
    }
    if let Some(path) = f.path.as_ref().filter(|_| has_columns) {
        args.push(Value::Text(like_pattern(path, false)));
        let n = args.len();
        parts.push(format!(
            "(path LIKE ?{n} ESCAPE '\\' OR substr(path, 1, instr(path || '?', '?') - 1) LIKE ?{n} ESCAPE '\\')"
        ));
    }
    if let Some(mode) = f.mode.as_ref().filter(|_| has_columns) {
        args.push(Value::Text(mode.to_ascii_lowercase()));
        parts.push(format!("mode = ?{}", args.len()));
    }
    if let Some(seq) = f.after_seq {
        args.push(Value::Integer(seq));
        parts.push(format!("rowid > ?{}", args.len()));
    }
    if let Some(side) = f.side.filter(|_| has_columns) {
        args.push(Value::Integer(i64::from(side)));
        parts.push(format!("side = ?{}", args.len()));
    }
    match (&f.verdict, has_cache) {
        (Some(verdict), true) => {
            // The cache column starts with the verdict word: `hit`, `partial system[2]`.
            args.push(Value::Text(verdict.to_ascii_lowercase()));
            let n = args.len();
            parts.push(format!(
                "(lower(cache) = ?{n} OR substr(lower(cache), 1, length(?{n}) + 1) = ?{n} || ' ')"
            ));
        }
        (Some(_), false) => parts.push("0".into()),
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

    fn turn(n: usize) -> String {
        let messages: Vec<String> = (0..n)
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
        let mut store = Store::open(&d).unwrap();
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
        let mut read = Store::open_read_only(&d).unwrap();
        assert_eq!(read.list(&Filter::default()).unwrap().len(), 2);
        assert!(read.insert(&[record("01C", 3, "{}")]).is_err(), "read-only");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn retention_by_age_and_size_prunes_records_and_their_units() {
        let d = dir("prune");
        let mut store = Store::open(&d).unwrap();
        for i in 0..40u64 {
            let body = format!(r#"{{"messages":[{{"n":{i},"t":"{}"}}]}}"#, ring_text(i));
            store
                .insert(&[record(&format!("01{i:03}"), i * 1000, &body)])
                .unwrap();
        }
        let by_age = Retention {
            max_age: Some(Duration::from_secs(10)),
            max_size: None,
        };
        let pruned = store.prune(&by_age, 40_000).unwrap();
        assert_eq!(pruned.records, 30, "older than 10 s at t=40 s");
        assert_eq!(pruned.units, 30, "their own messages went with them");
        assert_eq!(store.stats().unwrap().records, 10);
        let size = store.stats().unwrap().used_bytes;
        let by_size = Retention {
            max_age: None,
            max_size: Some(size / 2),
        };
        store.prune(&by_size, 40_000).unwrap();
        let left = store.list(&Filter::default()).unwrap();
        assert!(!left.is_empty() && left.len() < 10, "{}", left.len());
        assert_eq!(left.last().unwrap().id, "01039", "the newest stay");
        assert!(store.stats().unwrap().used_bytes <= size / 2);
        for row in left {
            store.load(&row.id).unwrap();
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_schema_1_store_reads_as_it_is_and_migrates_when_opened_for_writing() {
        let d = dir("migrate");
        std::fs::create_dir_all(&d).unwrap();
        {
            let mut conn = Connection::open(d.join(DB_FILE)).unwrap();
            let tx = conn.transaction().unwrap();
            migrate_0_to_1(&tx).unwrap();
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
        let old = Store::open_read_only(&d).unwrap();
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
        let mut store = Store::open(&d).unwrap();
        let version: i64 = store
            .conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
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
    fn a_record_stored_before_blake3_reads_and_is_checked_with_sha256() {
        let d = dir("sha256");
        let body = turn(2);
        let mut store = Store::open(&d).unwrap();
        store.insert(&[record("01A", 1, &body)]).unwrap();
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
        let meta = zstd::bulk::compress(&serde_json::to_vec(&old).unwrap(), ZSTD_LEVEL).unwrap();
        store
            .conn
            .execute("UPDATE records SET meta = ?1 WHERE id = '01A'", [meta])
            .unwrap();
        let loaded = store.load("01A").unwrap();
        assert_eq!(loaded.digest, digest::Algorithm::Sha256);
        assert_eq!(loaded.request.body.bytes, body.as_bytes());
        // A body that does not match its SHA-256 is refused, naming the algorithm.
        old["request"]["body"]["sha256"] = digest::content_hex(body.as_bytes()).into();
        let meta = zstd::bulk::compress(&serde_json::to_vec(&old).unwrap(), ZSTD_LEVEL).unwrap();
        store
            .conn
            .execute("UPDATE records SET meta = ?1 WHERE id = '01A'", [meta])
            .unwrap();
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
