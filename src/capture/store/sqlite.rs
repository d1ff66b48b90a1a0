//! The embedded store: SQLite (WAL) at `<captures dir>/promptgate.db`, its schema
//! version in `PRAGMA user_version`, one `migrate_N_to_M` per step.

use std::path::Path;
use std::time::Duration;

use rusqlite::types::{Value as Lite, ValueRef};
use rusqlite::{OpenFlags, Transaction, params};

use super::sql::{Connection, Dialect, SqlRow, Value, escape_text, unescape_text};
use super::{DB_FILE, StoreError, decode_meta};

/// The schema this build writes.
pub(super) const SCHEMA_VERSION: i64 = 9;

/// The first schema whose records carry their cost (`records.cost_microusd`).
pub(super) const COST_SINCE: i64 = 7;

/// An open SQLite store.
pub(super) struct Sqlite {
    conn: rusqlite::Connection,
}

impl Sqlite {
    /// Opens (creating and migrating if needed) the store in `dir` for writing.
    pub(super) fn open(dir: &Path) -> Result<Sqlite, StoreError> {
        let path = dir.join(DB_FILE);
        owners_only(dir, &path).map_err(|source| StoreError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let conn = rusqlite::Connection::open(&path)?;
        conn.busy_timeout(Duration::from_secs(10))?;
        conn.set_prepared_statement_cache_capacity(64);
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
        let mut store = Sqlite { conn };
        store.migrate(&path)?;
        Ok(store)
    }

    /// Opens an existing store for reading only; also its schema version.
    pub(super) fn open_read_only(dir: &Path) -> Result<(Sqlite, i64), StoreError> {
        let path = dir.join(DB_FILE);
        if !path.exists() {
            return Err(StoreError::Missing(dir.display().to_string()));
        }
        // Read-write flags (no create) so a WAL store opens while the proxy writes it;
        // `query_only` then refuses every write.
        let conn = rusqlite::Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(Duration::from_secs(10))?;
        conn.set_prepared_statement_cache_capacity(64);
        conn.pragma_update(None, "temp_store", "MEMORY")?;
        conn.pragma_update(None, "query_only", "ON")?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::Newer(
                path.display().to_string(),
                version,
                SCHEMA_VERSION,
            ));
        }
        if version == 0 {
            return Err(StoreError::Missing(dir.display().to_string()));
        }
        // An older schema is read as it is (what it lacks reads as absent); only a
        // writer migrates it.
        Ok((Sqlite { conn }, version))
    }

    fn migrate(&mut self, path: &Path) -> Result<(), StoreError> {
        let version: i64 = self
            .conn
            .pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::Newer(
                path.display().to_string(),
                version,
                SCHEMA_VERSION,
            ));
        }
        for step in version..SCHEMA_VERSION {
            let tx = self.conn.transaction()?;
            match step {
                0 => migrate_0_to_1(&tx)?,
                1 => migrate_1_to_2(&tx)?,
                2 => migrate_2_to_3(&tx)?,
                3 => migrate_3_to_4(&tx)?,
                4 => tx.execute_batch(super::sql::UNIT_USED)?,
                5 => migrate_5_to_6(&tx)?,
                6 => tx.execute_batch(super::sql::COST_COLUMN)?,
                // No table changes: from here records' metadata may be compressed
                // against the built-in dictionary (`meta.rs`), which an older
                // promptgate cannot read; the version makes it say so.
                7 => {}
                // No table changes: from here a response may be stored in its
                // record's row (`layout::encode_inline`), which an older promptgate
                // cannot read.
                8 => {}
                _ => unreachable!("one migration per schema step"),
            }
            tx.pragma_update(None, "user_version", step + 1)?;
            tx.commit()?;
        }
        Ok(())
    }
}

/// Makes the store's directory (0700) and database (0600) its owner's alone, also
/// when an older promptgate made them readable by all: they hold prompts and
/// answers. SQLite gives the `-wal` and `-shm` files the database's mode; ones left
/// by an older run are set too.
fn owners_only(dir: &Path, db: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(db)?;
        for suffix in ["", "-wal", "-shm"] {
            let file = db.with_file_name(format!("{DB_FILE}{suffix}"));
            match std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                other => other?,
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = db;
        std::fs::create_dir_all(dir)?;
    }
    Ok(())
}

fn bind(args: &[Value]) -> impl Iterator<Item = Lite> + '_ {
    args.iter().map(|v| match v {
        Value::Null => Lite::Null,
        Value::Int(i) => Lite::Integer(*i),
        Value::Bool(b) => Lite::Integer(i64::from(*b)),
        Value::Text(t) => Lite::Text(escape_text(t).into_owned()),
        Value::Blob(b) => Lite::Blob(b.clone()),
    })
}

fn read(row: &rusqlite::Row<'_>, columns: usize) -> Result<SqlRow, StoreError> {
    (0..columns)
        .map(|i| {
            Ok(match row.get_ref(i)? {
                ValueRef::Null => Value::Null,
                ValueRef::Integer(v) => Value::Int(v),
                ValueRef::Real(v) => Value::Int(v as i64),
                ValueRef::Text(t) => {
                    Value::Text(unescape_text(String::from_utf8_lossy(t).into_owned()))
                }
                ValueRef::Blob(b) => Value::Blob(b.to_vec()),
            })
        })
        .collect::<Result<_, StoreError>>()
        .map(SqlRow)
}

impl Connection for Sqlite {
    fn dialect(&self) -> Dialect {
        Dialect::Sqlite
    }

    fn execute(&self, sql: &str, args: &[Value]) -> Result<u64, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql)?;
        Ok(stmt.execute(rusqlite::params_from_iter(bind(args)))? as u64)
    }

    fn query_each(
        &self,
        sql: &str,
        args: &[Value],
        each: &mut dyn FnMut(SqlRow) -> Result<bool, StoreError>,
    ) -> Result<(), StoreError> {
        let mut stmt = self.conn.prepare_cached(sql)?;
        let columns = stmt.column_count();
        let mut rows = stmt.query(rusqlite::params_from_iter(bind(args)))?;
        while let Some(row) = rows.next()? {
            if !each(read(row, columns)?)? {
                break;
            }
        }
        Ok(())
    }

    fn batch(&self, sql: &str) -> Result<(), StoreError> {
        Ok(self.conn.execute_batch(sql)?)
    }

    /// Takes the write lock first: a deferred transaction that has read gets
    /// SQLITE_BUSY at once, past the busy timeout, when another connection writes.
    fn begin(&self) -> Result<(), StoreError> {
        self.batch("BEGIN IMMEDIATE")
    }

    fn used_bytes(&self) -> Result<u64, StoreError> {
        let pragma = |name: &str| -> Result<i64, StoreError> {
            Ok(self.conn.pragma_query_value(None, name, |r| r.get(0))?)
        };
        let (pages, free, page) = (
            pragma("page_count")?,
            pragma("freelist_count")?,
            pragma("page_size")?,
        );
        Ok(((pages - free).max(0) * page) as u64)
    }

    fn reclaim(&self) -> Result<(), StoreError> {
        Ok(self.conn.execute_batch("PRAGMA incremental_vacuum;")?)
    }

    fn checkpoint(&self) -> Result<(), StoreError> {
        self.conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        Ok(())
    }
}

pub(super) fn migrate_0_to_1(tx: &Transaction<'_>) -> Result<(), StoreError> {
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

/// The index of the prefixes each request cached, by workspace, for the analysis
/// of conversations that read another one's prefix. Rows older than two hours go.
fn migrate_3_to_4(tx: &Transaction<'_>) -> Result<(), StoreError> {
    tx.execute_batch(super::sql::PREFIX_INDEX)?;
    Ok(())
}

/// Text stored before the NUL escape (`sql::TEXT_ESCAPE`), as it was given: the
/// values holding NUL or the escape are rewritten escaped, so that they read back
/// unchanged and filters compare the same form. Found as bytes: SQLite's string
/// functions stop at a NUL.
fn migrate_5_to_6(tx: &Transaction<'_>) -> Result<(), StoreError> {
    for (table, columns) in super::sql::ESCAPED_COLUMNS {
        let holds = columns
            .iter()
            .map(|c| {
                format!(
                    "instr(CAST({c} AS BLOB), x'00') > 0 OR instr(CAST({c} AS BLOB), x'01') > 0"
                )
            })
            .collect::<Vec<_>>()
            .join(" OR ");
        let rows: Vec<(i64, Vec<Option<String>>)> = {
            let mut stmt = tx.prepare(&format!(
                "SELECT rowid, {} FROM {table} WHERE {holds}",
                columns.join(", ")
            ))?;
            stmt.query_map([], |r| {
                let values = (1..=columns.len())
                    .map(|i| r.get::<_, Option<String>>(i))
                    .collect::<Result<_, _>>()?;
                Ok((r.get(0)?, values))
            })?
            .collect::<Result<_, _>>()?
        };
        let sets: Vec<String> = (0..columns.len())
            .map(|i| format!("{} = ?{}", columns[i], i + 2))
            .collect();
        let mut update = tx.prepare(&format!(
            "UPDATE {table} SET {} WHERE rowid = ?1",
            sets.join(", ")
        ))?;
        for (rowid, values) in rows {
            let mut args = vec![Lite::Integer(rowid)];
            args.extend(values.iter().map(|v| match v {
                Some(text) => Lite::Text(super::sql::escape_text(text).into_owned()),
                None => Lite::Null,
            }));
            update.execute(rusqlite::params_from_iter(args))?;
        }
    }
    Ok(())
}
