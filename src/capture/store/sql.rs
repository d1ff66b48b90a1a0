//! What the store says to either database: values, rows, and the few places where
//! SQLite's and PostgreSQL's SQL differ. Every statement is written once, with
//! `?N` placeholders; [`Dialect`] supplies the differing pieces.

use super::StoreError;

/// The escape that keeps NUL out of every text the store binds or reads: PostgreSQL's
/// `text` refuses U+0000 and SQLite's string functions stop at it. NUL is stored as
/// [`TEXT_ESCAPE`] `0` and the escape itself as [`TEXT_ESCAPE`] `1`; any other text is
/// stored as it is. Applied to every bound text and every text read, so filters,
/// joins and equality compare the same form (SQLite schema 6, PostgreSQL schema 4).
pub(crate) const TEXT_ESCAPE: char = '\u{1}';

/// `text` as stored: see [`TEXT_ESCAPE`]. Borrowed when it holds neither character.
pub(crate) fn escape_text(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains(['\0', TEXT_ESCAPE]) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 4);
    for c in text.chars() {
        match c {
            '\0' => out.extend([TEXT_ESCAPE, '0']),
            TEXT_ESCAPE => out.extend([TEXT_ESCAPE, '1']),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Stored text back as it was given: [`escape_text`] undone. An escape followed by
/// anything else (written by nobody) stays as it is.
pub(crate) fn unescape_text(stored: String) -> String {
    if !stored.contains(TEXT_ESCAPE) {
        return stored;
    }
    let mut out = String::with_capacity(stored.len());
    let mut chars = stored.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            (TEXT_ESCAPE, Some('0')) => {
                chars.next();
                out.push('\0');
            }
            (TEXT_ESCAPE, Some('1')) => {
                chars.next();
                out.push(TEXT_ESCAPE);
            }
            (c, _) => out.push(c),
        }
    }
    out
}

/// A value bound to, or read from, a statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    Null,
    Int(i64),
    Text(String),
    Blob(Vec<u8>),
    Bool(bool),
}

impl From<i64> for Value {
    fn from(v: i64) -> Value {
        Value::Int(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Value {
        Value::Bool(v)
    }
}
impl From<String> for Value {
    fn from(v: String) -> Value {
        Value::Text(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::Text(v.to_owned())
    }
}
impl From<Vec<u8>> for Value {
    fn from(v: Vec<u8>) -> Value {
        Value::Blob(v)
    }
}
impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Value {
        v.map_or(Value::Null, Into::into)
    }
}

/// One result row, its columns in select order.
#[derive(Debug, Default)]
pub(crate) struct SqlRow(pub(crate) Vec<Value>);

impl SqlRow {
    fn at(&self, i: usize) -> Result<&Value, StoreError> {
        self.0
            .get(i)
            .ok_or_else(|| StoreError::Corrupt(format!("a row has no column {i}")))
    }

    fn wrong(&self, i: usize, want: &str) -> StoreError {
        StoreError::Corrupt(format!("column {i} is {:?}, not {want}", self.0.get(i)))
    }

    pub(crate) fn opt_int(&self, i: usize) -> Result<Option<i64>, StoreError> {
        match self.at(i)? {
            Value::Null => Ok(None),
            Value::Int(v) => Ok(Some(*v)),
            Value::Bool(b) => Ok(Some(i64::from(*b))),
            _ => Err(self.wrong(i, "an integer")),
        }
    }

    pub(crate) fn int(&self, i: usize) -> Result<i64, StoreError> {
        self.opt_int(i)?.ok_or_else(|| self.wrong(i, "an integer"))
    }

    pub(crate) fn bool(&self, i: usize) -> Result<bool, StoreError> {
        Ok(self.int(i)? != 0)
    }

    pub(crate) fn opt_text(&self, i: usize) -> Result<Option<String>, StoreError> {
        match self.at(i)? {
            Value::Null => Ok(None),
            Value::Text(v) => Ok(Some(v.clone())),
            _ => Err(self.wrong(i, "text")),
        }
    }

    pub(crate) fn text(&self, i: usize) -> Result<String, StoreError> {
        self.opt_text(i)?.ok_or_else(|| self.wrong(i, "text"))
    }

    pub(crate) fn opt_blob(&self, i: usize) -> Result<Option<Vec<u8>>, StoreError> {
        match self.at(i)? {
            Value::Null => Ok(None),
            Value::Blob(v) => Ok(Some(v.clone())),
            _ => Err(self.wrong(i, "bytes")),
        }
    }

    pub(crate) fn blob(&self, i: usize) -> Result<Vec<u8>, StoreError> {
        self.opt_blob(i)?.ok_or_else(|| self.wrong(i, "bytes"))
    }

    /// Moves the bytes out of column `i` (a large body layout or meta is not copied).
    pub(crate) fn take_blob(&mut self, i: usize) -> Result<Option<Vec<u8>>, StoreError> {
        match self.0.get_mut(i) {
            Some(Value::Blob(v)) => Ok(Some(std::mem::take(v))),
            Some(Value::Null) => Ok(None),
            _ => Err(self.wrong(i, "bytes")),
        }
    }
}

/// The SQL that differs between the two databases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    Sqlite,
    Postgres,
}

impl Dialect {
    /// The column that numbers records in storing order.
    pub(crate) fn seq(self) -> &'static str {
        match self {
            Dialect::Sqlite => "rowid",
            Dialect::Postgres => "seq",
        }
    }

    /// The 1-based place of `needle` in `hay`, 0 when absent.
    pub(crate) fn position(self, hay: &str, needle: &str) -> String {
        match self {
            Dialect::Sqlite => format!("instr({hay}, {needle})"),
            Dialect::Postgres => format!("strpos({hay}, {needle})"),
        }
    }

    /// Whether the comma-separated list in `column` holds the text bound at `?n`.
    pub(crate) fn list_has(self, column: &str, n: usize) -> String {
        match self {
            Dialect::Sqlite => format!("instr(',' || {column} || ',', ',' || ?{n} || ',') > 0"),
            // The form its GIN index on string_to_array(column, ',') answers.
            Dialect::Postgres => format!("string_to_array({column}, ',') @> ARRAY[?{n}::text]"),
        }
    }

    /// Whether the cache column's first word is the (lower-case) verdict at `?n`.
    pub(crate) fn verdict_is(self, n: usize) -> String {
        match self {
            Dialect::Sqlite => format!(
                "(lower(cache) = ?{n} OR substr(lower(cache), 1, length(?{n}) + 1) = ?{n} || ' ')"
            ),
            // The expression its index holds.
            Dialect::Postgres => format!("split_part(lower(cache), ' ', 1) = ?{n}"),
        }
    }
}

/// A connection to either database. Statements use `?N` placeholders.
pub(crate) trait Connection: Send {
    fn dialect(&self) -> Dialect;
    /// Runs one statement; the number of rows it changed.
    fn execute(&self, sql: &str, args: &[Value]) -> Result<u64, StoreError>;
    /// Calls `each` on every row until it returns `false`.
    fn query_each(
        &self,
        sql: &str,
        args: &[Value],
        each: &mut dyn FnMut(SqlRow) -> Result<bool, StoreError>,
    ) -> Result<(), StoreError>;
    /// Runs statements without arguments (DDL).
    fn batch(&self, sql: &str) -> Result<(), StoreError>;
    fn begin(&self) -> Result<(), StoreError> {
        self.batch("BEGIN")
    }
    fn commit(&self) -> Result<(), StoreError> {
        self.batch("COMMIT")
    }
    fn rollback(&self) -> Result<(), StoreError> {
        self.batch("ROLLBACK")
    }
    /// Bytes the captures take in the database (the size limit counts these).
    fn used_bytes(&self) -> Result<u64, StoreError>;
    /// Gives freed space back after units were deleted.
    fn reclaim(&self) -> Result<(), StoreError>;
    /// Makes what was written durable in the main file (a clean close).
    fn checkpoint(&self) -> Result<(), StoreError>;

    /// Every row.
    fn query(&self, sql: &str, args: &[Value]) -> Result<Vec<SqlRow>, StoreError> {
        let mut rows = Vec::new();
        self.query_each(sql, args, &mut |row| {
            rows.push(row);
            Ok(true)
        })?;
        Ok(rows)
    }

    /// The first row, if there is one.
    fn query_row(&self, sql: &str, args: &[Value]) -> Result<Option<SqlRow>, StoreError> {
        let mut first = None;
        self.query_each(sql, args, &mut |row| {
            first = Some(row);
            Ok(false)
        })?;
        Ok(first)
    }
}

/// `sql` with `?N` placeholders as PostgreSQL's `$N` (a `?` inside a quoted
/// literal, or not followed by a digit, stays).
pub(crate) fn dollar_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut quoted = false;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                quoted = !quoted;
                out.push(c);
            }
            '?' if !quoted && chars.peek().is_some_and(char::is_ascii_digit) => out.push('$'),
            c => out.push(c),
        }
    }
    out
}

/// The text columns whose values come from outside (a model, a conversation key, a
/// tag, a path): those stored before [`TEXT_ESCAPE`] that hold NUL or the escape are
/// rewritten in the escaped form by SQLite's schema 6 and PostgreSQL's schema 4.
pub(super) const ESCAPED_COLUMNS: [(&str, &[&str]); 2] = [
    (
        "records",
        &[
            "conversation",
            "model",
            "provider",
            "outcome",
            "rules",
            "cache",
            "tags",
            "path",
            "mode",
        ],
    ),
    ("cache_prefixes", &["prefix", "workspace"]),
];

/// When a unit was last marked used by a writer, which garbage collection reads:
/// SQLite's schema 5 and PostgreSQL's schema 3. Units stored before have 0.
pub(super) const UNIT_USED: &str =
    "ALTER TABLE units ADD COLUMN used_ms BIGINT NOT NULL DEFAULT 0;";

/// Each record's whole cost at the provider's prices (input, cache writes and
/// reads, output), in millionths of a dollar, when the cache analysis priced it:
/// SQLite's schema 7 and PostgreSQL's schema 5. Records stored before have none.
pub(super) const COST_COLUMN: &str = "ALTER TABLE records ADD COLUMN cost_microusd BIGINT;";

/// The index of cached prefixes: SQLite's schema 4 and PostgreSQL's schema 2.
pub(super) const PREFIX_INDEX: &str = "
CREATE TABLE cache_prefixes (
  record TEXT NOT NULL,        -- records.id
  prefix TEXT NOT NULL,        -- BreakpointView::prefix
  workspace TEXT NOT NULL,
  started_ms BIGINT NOT NULL,
  PRIMARY KEY (record, prefix)
);
CREATE INDEX cache_prefixes_lookup ON cache_prefixes (workspace, prefix, started_ms);
CREATE INDEX cache_prefixes_started ON cache_prefixes (started_ms);
";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_turn_into_dollars_outside_literals_only() {
        assert_eq!(
            dollar_placeholders("a = ?1 AND strpos(p || '?1', '?') > ?12"),
            "a = $1 AND strpos(p || '?1', '?') > $12"
        );
    }

    #[test]
    fn text_with_nul_or_the_escape_round_trips_and_other_text_is_kept_as_it_is() {
        for text in [
            "",
            "claude-x",
            "claude-\0x",
            "\0",
            "\u{1}",
            "\u{1}0",
            "a\u{1}1\0\0b\u{1}",
        ] {
            let stored = escape_text(text);
            assert!(!stored.contains('\0'), "{stored:?}");
            assert_eq!(unescape_text(stored.into_owned()), text);
        }
        assert!(matches!(
            escape_text("claude-x"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(escape_text("a\0b"), "a\u{1}0b");
    }
}
