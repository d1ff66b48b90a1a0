//! The fleet's store: PostgreSQL, which every replica writes and any machine reads.
//! The schema version is the one row of `promptgate_schema`; a replica migrates an
//! older one under an advisory lock and refuses a newer one. Ids sort as text in the
//! "C" collation whatever the database's locale, so prefixes and `ORDER BY id` mean
//! what they mean in SQLite.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use bytes::BytesMut;
use tokio_postgres::Statement;
use tokio_postgres::types::{FromSql, IsNull, ToSql, Type, to_sql_checked};

use super::StoreError;
use super::pg_tls::PgTls;
use super::sql::{
    Connection, Dialect, SqlRow, Value, dollar_placeholders, escape_text, unescape_text,
};

/// The schema this build writes.
const SCHEMA_VERSION: i64 = 7;

/// The SQLite schema a PostgreSQL one has the columns of (the store's readers ask
/// the SQLite numbers): every column since the first, the cost from schema 5.
pub(super) fn as_sqlite_schema(version: i64) -> i64 {
    if version >= 5 {
        i64::MAX
    } else {
        super::sqlite::COST_SINCE - 1
    }
}
/// Idle read connections kept per process (the admin API and the live feed open a
/// store per request).
const IDLE_READERS: usize = 4;
/// How long a connection attempt may take before the store is called unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long data sent may go unacknowledged before the connection counts as lost
/// (a dropped route, a dead host): the kernel's TCP_USER_TIMEOUT.
const UNACKED_LIMIT: Duration = Duration::from_secs(15);
/// The longest one statement may run before the server cancels it and the store
/// counts as away (too slow to keep up, or locked): the writer spools meanwhile.
const STATEMENT_LIMIT_MS: u64 = 10_000;
/// How much longer than the statement limit the client waits for any answer
/// before it drops the connection (a paused server answers nothing, not even the
/// cancellation).
const ANSWER_MARGIN: Duration = Duration::from_secs(5);
/// Any advisory-lock key unlikely to clash with an application's: "prgate" in ASCII.
const MIGRATION_LOCK: i64 = 0x7072_6761_7465;

/// Read connections returned by closed read-only stores, by URL.
static IDLE: Mutex<Vec<(String, Client)>> = Mutex::new(Vec::new());

/// Why `url` cannot name the store, or `None` when it can.
pub(super) fn url_problem(url: &str) -> Option<String> {
    let (rest, ours) = split_ours(url);
    if let Some(name) = ["sslcert", "sslkey", "sslpassword"]
        .into_iter()
        .find(|n| ours.other.iter().any(|o| o == n))
    {
        return Some(format!(
            "{name}: client certificates are not supported yet (the server's certificate is \
             checked with sslmode and sslrootcert)"
        ));
    }
    if let Err(e) = PgTls::from_params(ours.sslmode.as_deref(), ours.sslrootcert.as_deref()) {
        return Some(e.to_string());
    }
    match tokio_postgres::Config::from_str(&rest) {
        Err(e) => Some(format!("{e}")),
        Ok(c) if c.get_password().is_some() => Some(
            "a password in the store URL would show in `ps` and in logs: leave it out and set \
             PGPASSWORD, or put it in a passfile (~/.pgpass, $PGPASSFILE, or ?passfile=PATH)"
                .into(),
        ),
        Ok(_) => None,
    }
}

/// The URL parameters promptgate reads itself (the client does not know them, or
/// not all their values).
#[derive(Debug, Default, PartialEq, Eq)]
struct OurParams {
    passfile: Option<String>,
    sslmode: Option<String>,
    sslrootcert: Option<String>,
    /// Other TLS parameters named, refused with a reason.
    other: Vec<String>,
}

/// The URL without promptgate's own parameters, and their values.
fn split_ours(url: &str) -> (String, OurParams) {
    let mut ours = OurParams::default();
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), ours);
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = Some(value.to_owned());
            match name {
                "passfile" => ours.passfile = value,
                "sslmode" => ours.sslmode = value,
                "sslrootcert" => ours.sslrootcert = value,
                "sslcert" | "sslkey" | "sslpassword" | "sslcrl" => ours.other.push(name.to_owned()),
                _ => return !pair.is_empty(),
            }
            false
        })
        .collect();
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (url, ours)
}

/// The client configuration for `url`, with libpq's defaults: the user from
/// `PGUSER` or the login, the password from `PGPASSWORD` or the passfile.
fn config(url: &str) -> Result<(tokio_postgres::Config, PgTls), StoreError> {
    if let Some(problem) = url_problem(url) {
        return Err(StoreError::Url(problem));
    }
    let (rest, ours) = split_ours(url);
    let tls = PgTls::from_params(ours.sslmode.as_deref(), ours.sslrootcert.as_deref())
        .map_err(|e| StoreError::Url(e.to_string()))?;
    let passfile = ours.passfile;
    let mut config =
        tokio_postgres::Config::from_str(&rest).map_err(|e| StoreError::Url(e.to_string()))?;
    if config.get_user().is_none() {
        let user = std::env::var("PGUSER")
            .or_else(|_| std::env::var("USER"))
            .map_err(|_| {
                StoreError::Url("no user in the URL, and neither PGUSER nor USER is set".into())
            })?;
        config.user(&user);
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(UNACKED_LIMIT);
    }
    if config.get_options().is_none() {
        config.options(format!("-c statement_timeout={STATEMENT_LIMIT_MS}"));
    }
    config.application_name("promptgate");
    config.ssl_mode(tls.ssl_mode());
    if let Ok(password) = std::env::var("PGPASSWORD") {
        config.password(password);
    } else if let Some(password) = passfile_password(&config, passfile) {
        config.password(password);
    }
    Ok((config, tls))
}

/// The password for `config`'s host, port, database and user from a passfile
/// (`host:port:db:user:password`, `*` for any, `\` escaping `:`), as libpq reads it.
fn passfile_password(config: &tokio_postgres::Config, passfile: Option<String>) -> Option<String> {
    let path = passfile
        .or_else(|| std::env::var("PGPASSFILE").ok())
        .or_else(|| std::env::var("HOME").ok().map(|h| format!("{h}/.pgpass")))?;
    let text = std::fs::read_to_string(path).ok()?;
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "localhost".to_owned(),
    };
    let port = config
        .get_ports()
        .first()
        .copied()
        .unwrap_or(5432)
        .to_string();
    let user = config.get_user().unwrap_or_default().to_owned();
    let db = config.get_dbname().unwrap_or(&user).to_owned();
    let wanted = [host, port, db, user];
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|line| {
            let fields = passfile_fields(line);
            let matches = fields.len() == 5
                && fields[..4]
                    .iter()
                    .zip(&wanted)
                    .all(|(f, w)| f == "*" || f == w);
            matches.then(|| fields[4].clone())
        })
}

fn passfile_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => fields
                .last_mut()
                .into_iter()
                .for_each(|f| f.extend(chars.next())),
            ':' => fields.push(String::new()),
            c => fields.last_mut().into_iter().for_each(|f| f.push(c)),
        }
    }
    fields
}

/// Runs `f`, which blocks on the client's own runtime, where blocking is allowed:
/// as it is on a plain thread, or in place on a multi-thread runtime's worker.
fn blocking<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        Ok(_) => std::thread::scope(|s| {
            s.spawn(f)
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        }),
        Err(_) => f(),
    }
}

/// A connection to `url`; every call answered within `within`, when given, else
/// within the statement limit and a margin.
fn connect(url: &str, within: Option<Duration>) -> Result<Client, StoreError> {
    let (config, tls) = config(url)?;
    let connector = tls.connector()?;
    let limit = within.unwrap_or(statement_limit(config.get_options()) + ANSWER_MARGIN);
    let unreachable = |e: &dyn std::fmt::Display| StoreError::Unreachable(format!("{url}: {e}"));
    // Made and, on failure, dropped off any async worker: a runtime may not be.
    blocking(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| unreachable(&e))?;
        // connect_timeout bounds the socket's connect only; a paused server
        // accepts it and then says nothing: the whole start gets the same limit.
        let start_limit = config
            .get_connect_timeout()
            .copied()
            .unwrap_or(CONNECT_TIMEOUT);
        let start_limit = within.map_or(start_limit, |w| w.min(start_limit));
        let answered = runtime
            .block_on(async { tokio::time::timeout(start_limit, config.connect(connector)).await });
        let (client, connection) = answered
            .map_err(|_| unreachable(&"no answer to the connection's start"))?
            .map_err(|e| match tls_failure(&e) {
                Some(why) => StoreError::Tls(format!("{url}: {why}")),
                None if login_refused(&e) => StoreError::Login(format!("{url} ({})", describe(&e))),
                None => unreachable(&describe(&e)),
            })?;
        Ok(Client {
            runtime,
            client,
            connection: Mutex::new(Box::pin(connection)),
            limit,
            broken: std::sync::atomic::AtomicBool::new(false),
        })
    })
}

/// The statement limit `-c statement_timeout=…` in the options sets (milliseconds,
/// or with `ms`, `s` or `min`), else the default.
fn statement_limit(options: Option<&str>) -> Duration {
    let value = options
        .and_then(|o| o.split("statement_timeout=").nth(1))
        .and_then(|v| v.split_whitespace().next());
    let Some(value) = value else {
        return Duration::from_millis(STATEMENT_LIMIT_MS);
    };
    let digits = value.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let n: u64 = digits.parse().unwrap_or(STATEMENT_LIMIT_MS);
    match &value[digits.len()..] {
        "s" => Duration::from_secs(n),
        "min" => Duration::from_secs(n * 60),
        _ => Duration::from_millis(n),
    }
}

type PgConnection = tokio_postgres::Connection<
    tokio_postgres::Socket,
    <tokio_postgres_rustls::MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<
        tokio_postgres::Socket,
    >>::Stream,
>;

/// Why the connection's TLS failed (a certificate not trusted, a server that
/// offers no TLS when it must), when that is what failed.
/// Whether the server refused the login (28000, 28P01) or asked for a password
/// there was none of (tokio-postgres says so only in its text).
fn login_refused(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.code().is_some_and(|c| {
        *c == SqlState::INVALID_PASSWORD || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION
    }) || describe(e).contains("password missing")
}

fn tls_failure(e: &tokio_postgres::Error) -> Option<String> {
    // tokio-postgres says so only in its text: its error kinds are private.
    let text = e.to_string();
    text.starts_with("error performing TLS handshake")
        .then(|| describe(e))
}

/// A connection: tokio-postgres on a runtime of its own, every call bounded by
/// `limit`, after which the connection is given up (a server that is paused, or
/// whose host went quiet, answers nothing).
struct Client {
    runtime: tokio::runtime::Runtime,
    client: tokio_postgres::Client,
    /// Polled beside each call, in the same `block_on`, as the sync client does:
    /// no task to hand messages to and wake.
    connection: Mutex<std::pin::Pin<Box<PgConnection>>>,
    limit: Duration,
    /// A call ran out of time: the protocol is mid-message, so it is never reused.
    broken: std::sync::atomic::AtomicBool,
}

impl Client {
    fn is_closed(&self) -> bool {
        self.broken.load(std::sync::atomic::Ordering::Relaxed) || self.client.is_closed()
    }

    /// Runs `call` to its end or to the limit. Blocks: run it through [`blocking`].
    fn call<'a, T, F>(
        &'a self,
        call: impl FnOnce(&'a tokio_postgres::Client) -> F,
    ) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, tokio_postgres::Error>> + 'a,
    {
        let limit = self.limit;
        let future = call(&self.client);
        let mut connection = self.connection.lock().unwrap_or_else(|p| p.into_inner());
        // The timer is made inside the runtime, whose clock it needs.
        let outcome = self.runtime.block_on(async {
            tokio::select! {
                biased;
                answer = tokio::time::timeout(limit, future) => Some(answer),
                _ = connection.as_mut() => None,
            }
        });
        match outcome {
            Some(Ok(result)) => Ok(result?),
            None => {
                self.broken
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                Err(StoreError::Unreachable(
                    "the server closed the connection".into(),
                ))
            }
            Some(Err(_)) => {
                self.broken
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                Err(StoreError::Unreachable(format!(
                    "no answer in {} s",
                    limit.as_secs()
                )))
            }
        }
    }
}

/// A client error with the server's own message where it sent one.
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{}: {}", db.severity(), db.message()),
        None => match e.source() {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        },
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> StoreError {
        // Connection exceptions (08), a server shutting down (57P), a statement
        // past its time (57014) and a socket error mean "away": what the spool is for.
        let away = e.code().is_some_and(|c| {
            let code = c.code();
            code.starts_with("08") || code.starts_with("57P") || code == "57014"
        }) || e.source().is_some_and(|s| s.is::<std::io::Error>());
        // Data exceptions (22), integrity constraints (23) and program limits (54, a
        // value too large) are one record's own: the store is well.
        let record = e.code().is_some_and(|c| {
            ["22", "23", "54"]
                .iter()
                .any(|class| c.code().starts_with(class))
        });
        if e.is_closed() || away {
            StoreError::Unreachable(format!(
                "the server closed the connection: {}",
                describe(&e)
            ))
        } else if record {
            StoreError::Rejected(describe(&e))
        } else {
            StoreError::Postgres(describe(&e))
        }
    }
}

struct Session {
    client: Option<Client>,
    /// Between BEGIN and COMMIT or ROLLBACK: a lost connection must not be replaced.
    in_transaction: bool,
    /// Prepared once per connection: the writer's unit lookup runs per unit.
    statements: HashMap<String, Statement>,
    /// Cursors open now: a `query_each` inside another's callback takes the next name.
    cursors: usize,
}

/// An open PostgreSQL store.
pub(super) struct Postgres {
    url: String,
    read_only: bool,
    /// A shorter limit for every call than the default (see [`connect`]).
    within: Option<Duration>,
    session: Mutex<Session>,
}

impl Postgres {
    /// Connects for writing, migrating an older schema.
    pub(super) fn open(url: &str) -> Result<Postgres, StoreError> {
        let store = Postgres::with(url, connect(url, None)?, false, None);
        store.migrate()?;
        Ok(store)
    }

    /// Connects for writing without migrating the captures' schema (the budgets'
    /// counters make their own tables), every call answered within `within`.
    pub(super) fn open_within(url: &str, within: Duration) -> Result<Postgres, StoreError> {
        Ok(Postgres::with(
            url,
            connect(url, Some(within))?,
            false,
            Some(within),
        ))
    }

    /// Connects (or takes an idle connection) for reading; also the schema version.
    /// With `within`, every call is answered within it, on a connection of its own.
    pub(super) fn open_read_only(
        url: &str,
        within: Option<Duration>,
    ) -> Result<(Postgres, i64), StoreError> {
        let idle = within.is_none().then(|| {
            let mut idle = IDLE.lock().unwrap_or_else(|p| p.into_inner());
            let at = idle.iter().position(|(u, c)| u == url && !c.is_closed());
            at.map(|i| idle.swap_remove(i).1)
        });
        let client = match idle.flatten() {
            Some(c) => c,
            None => connect(url, within)?,
        };
        let store = Postgres::with(url, client, true, within);
        let version = store.version()?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::Newer(url.to_owned(), version, SCHEMA_VERSION));
        }
        if version == 0 {
            return Err(StoreError::Missing(url.to_owned()));
        }
        Ok((store, version))
    }

    fn with(url: &str, client: Client, read_only: bool, within: Option<Duration>) -> Postgres {
        Postgres {
            url: url.to_owned(),
            read_only,
            within,
            session: Mutex::new(Session {
                client: Some(client),
                in_transaction: false,
                statements: HashMap::new(),
                cursors: 0,
            }),
        }
    }

    /// The schema version stored, 0 for a database promptgate never wrote.
    fn version(&self) -> Result<i64, StoreError> {
        let exists = self
            .query_row("SELECT to_regclass('promptgate_schema') IS NOT NULL", &[])?
            .map(|r| r.bool(0))
            .transpose()?
            .unwrap_or(false);
        if !exists {
            return Ok(0);
        }
        Ok(self
            .query_row("SELECT version FROM promptgate_schema", &[])?
            .map(|r| r.int(0))
            .transpose()?
            .unwrap_or(0))
    }

    fn migrate(&self) -> Result<(), StoreError> {
        self.begin()?;
        let result = (|| {
            // Replicas starting together migrate one at a time.
            self.execute(
                "SELECT pg_advisory_xact_lock(?1)",
                &[Value::Int(MIGRATION_LOCK)],
            )?;
            let version = self.version()?;
            if version > SCHEMA_VERSION {
                return Err(StoreError::Newer(self.url.clone(), version, SCHEMA_VERSION));
            }
            for step in version..SCHEMA_VERSION {
                match step {
                    0 => self.batch(SCHEMA_1)?,
                    1 => self.batch(super::sql::PREFIX_INDEX)?,
                    2 => self.batch(super::sql::UNIT_USED)?,
                    3 => self.batch(&escape_existing())?,
                    4 => self.batch(super::sql::COST_COLUMN)?,
                    // Metadata against the built-in dictionary (`meta.rs`), as
                    // SQLite's schema 8: no table changes.
                    5 => {}
                    // Responses in their records' rows, as SQLite's schema 9.
                    6 => {}
                    _ => unreachable!("one migration per schema step"),
                }
                self.execute(
                    "UPDATE promptgate_schema SET version = ?1",
                    &[Value::Int(step + 1)],
                )?;
            }
            Ok(())
        })();
        match result {
            Ok(()) => self.commit(),
            Err(e) => {
                let _ = self.rollback();
                Err(e)
            }
        }
    }

    /// The session, connected again first if its connection was lost, unless that
    /// happened inside a transaction: then the transaction failed, and says so.
    fn connected(&self) -> Result<MutexGuard<'_, Session>, StoreError> {
        let mut session = self.session.lock().unwrap_or_else(|p| p.into_inner());
        if session.client.as_ref().is_none_or(Client::is_closed) {
            if session.in_transaction {
                return Err(StoreError::Unreachable(format!(
                    "{}: the connection was lost inside a transaction",
                    self.url
                )));
            }
            session.statements.clear();
            if let Some(lost) = session.client.take() {
                // Its runtime must not be dropped on an async worker.
                blocking(move || drop(lost));
            }
            let client = connect(&self.url, self.within)?;
            if self.read_only {
                blocking(|| {
                    client.call(|c| {
                        c.batch_execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
                    })
                })?;
            }
            session.client = Some(client);
        }
        Ok(session)
    }

    /// Runs `f` with the connected client and its prepared statements.
    fn with_client<T: Send>(
        &self,
        f: impl FnOnce(&mut Client, &mut HashMap<String, Statement>) -> Result<T, StoreError> + Send,
    ) -> Result<T, StoreError> {
        let mut session = self.connected()?;
        let Session {
            client, statements, ..
        } = &mut *session;
        let client = client
            .as_mut()
            .ok_or_else(|| StoreError::Unreachable(self.url.clone()))?;
        blocking(|| f(client, statements))
    }

    fn mark(&self, in_transaction: bool) {
        self.session
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .in_transaction = in_transaction;
    }
}

/// The statement for `sql`, prepared on first use.
fn prepared(
    client: &mut Client,
    statements: &mut HashMap<String, Statement>,
    sql: &str,
) -> Result<Statement, StoreError> {
    if let Some(s) = statements.get(sql) {
        return Ok(s.clone());
    }
    let text = dollar_placeholders(sql);
    let statement = client.call(|c| c.prepare(&text))?;
    // Listing SQL varies with its filters: a bounded cache is enough.
    if statements.len() >= 64 {
        statements.clear();
    }
    statements.insert(sql.to_owned(), statement.clone());
    Ok(statement)
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let session = self.session.get_mut().unwrap_or_else(|p| p.into_inner());
        let Some(client) = session.client.take() else {
            return;
        };
        if self.read_only && self.within.is_none() && !client.is_closed() {
            let mut idle = IDLE.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < IDLE_READERS {
                idle.push((self.url.clone(), client));
                return;
            }
        }
        // Dropping the client drops its runtime, which must not happen on a worker.
        blocking(move || drop(client));
    }
}

impl ToSql for Value {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn StdError + Sync + Send>> {
        match self {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(v) => match *ty {
                Type::INT2 => i16::try_from(*v)?.to_sql(ty, out),
                Type::INT4 => i32::try_from(*v)?.to_sql(ty, out),
                _ => v.to_sql(ty, out),
            },
            Value::Bool(b) => b.to_sql(ty, out),
            Value::Text(t) => escape_text(t).as_ref().to_sql(ty, out),
            Value::Blob(b) => b.to_sql(ty, out),
        }
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    to_sql_checked!();
}

/// Rows a cursor hands over per round trip.
const ROWS_PER_FETCH: usize = 256;

fn row_of(row: &tokio_postgres::Row) -> Result<SqlRow, StoreError> {
    let cells = (0..row.len())
        .map(|i| row.try_get::<_, Cell>(i).map(|c| c.0))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(SqlRow(cells))
}

/// One column as read.
struct Cell(Value);

impl<'a> FromSql<'a> for Cell {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> Result<Cell, Box<dyn StdError + Sync + Send>> {
        Ok(Cell(match *ty {
            Type::INT2 => Value::Int(i16::from_sql(ty, raw)?.into()),
            Type::INT4 => Value::Int(i32::from_sql(ty, raw)?.into()),
            Type::INT8 => Value::Int(i64::from_sql(ty, raw)?),
            Type::BOOL => Value::Bool(bool::from_sql(ty, raw)?),
            Type::BYTEA => Value::Blob(<Vec<u8>>::from_sql(ty, raw)?),
            _ => Value::Text(unescape_text(String::from_sql(ty, raw)?)),
        }))
    }

    fn from_sql_null(_: &Type) -> Result<Cell, Box<dyn StdError + Sync + Send>> {
        Ok(Cell(Value::Null))
    }

    fn accepts(ty: &Type) -> bool {
        matches!(
            *ty,
            Type::INT2 | Type::INT4 | Type::INT8 | Type::BOOL | Type::BYTEA
        ) || <String as FromSql>::accepts(ty)
    }
}

fn params(args: &[Value]) -> impl ExactSizeIterator<Item = &(dyn ToSql + Sync)> {
    args.iter().map(|a| a as &(dyn ToSql + Sync))
}

impl Connection for Postgres {
    fn dialect(&self) -> Dialect {
        Dialect::Postgres
    }

    fn execute(&self, sql: &str, args: &[Value]) -> Result<u64, StoreError> {
        if self.read_only && !sql.trim_start().starts_with("SELECT") {
            return Err(StoreError::ReadOnly);
        }
        self.with_client(|client, statements| {
            let statement = prepared(client, statements, sql)?;
            let args: Vec<&(dyn ToSql + Sync)> = params(args).collect();
            client.call(|c| c.execute(&statement, &args))
        })
    }

    /// Walks the rows through a cursor, [`ROWS_PER_FETCH`] at a time, with the
    /// connection free between fetches: a callback may query again (a listing
    /// reads units while it walks records), which an open result would block.
    fn query_each(
        &self,
        sql: &str,
        args: &[Value],
        each: &mut dyn FnMut(SqlRow) -> Result<bool, StoreError>,
    ) -> Result<(), StoreError> {
        let began = !self.connected()?.in_transaction;
        if began {
            self.begin()?;
        }
        let cursor = {
            let mut session = self.connected()?;
            session.cursors += 1;
            format!("promptgate_rows_{}", session.cursors)
        };
        let walked = (|| {
            let declare = format!("DECLARE {cursor} NO SCROLL CURSOR FOR {sql}");
            self.with_client(|client, statements| {
                let statement = prepared(client, statements, &declare)?;
                let args: Vec<&(dyn ToSql + Sync)> = params(args).collect();
                client.call(|c| c.execute(&statement, &args))
            })?;
            let fetch = format!("FETCH {ROWS_PER_FETCH} FROM {cursor}");
            loop {
                let rows = self.with_client(|client, _| client.call(|c| c.query(&fetch, &[])))?;
                for row in &rows {
                    if !each(row_of(row)?)? {
                        return Ok(());
                    }
                }
                if rows.len() < ROWS_PER_FETCH {
                    return Ok(());
                }
            }
        })();
        let closed = self.batch(&format!("CLOSE {cursor}"));
        self.session
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cursors -= 1;
        match (walked.and(closed), began) {
            (Ok(()), true) => self.commit(),
            (Ok(()), false) => Ok(()),
            (Err(e), true) => {
                let _ = self.rollback();
                Err(e)
            }
            (Err(e), false) => Err(e),
        }
    }

    /// One round trip, no cursor: the writer's per-unit lookups take this path.
    fn query(&self, sql: &str, args: &[Value]) -> Result<Vec<SqlRow>, StoreError> {
        let rows = self.with_client(|client, statements| {
            let statement = prepared(client, statements, sql)?;
            let args: Vec<&(dyn ToSql + Sync)> = params(args).collect();
            client.call(|c| c.query(&statement, &args))
        })?;
        rows.iter().map(row_of).collect()
    }

    fn query_row(&self, sql: &str, args: &[Value]) -> Result<Option<SqlRow>, StoreError> {
        Ok(self.query(sql, args)?.into_iter().next())
    }

    fn batch(&self, sql: &str) -> Result<(), StoreError> {
        self.with_client(|client, _| client.call(|c| c.batch_execute(sql)))
    }

    fn begin(&self) -> Result<(), StoreError> {
        self.batch("BEGIN")?;
        self.mark(true);
        Ok(())
    }

    fn commit(&self) -> Result<(), StoreError> {
        let result = self.batch("COMMIT");
        self.mark(false);
        result
    }

    fn rollback(&self) -> Result<(), StoreError> {
        self.mark(false);
        let lost = self
            .session
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .client
            .as_ref()
            .is_none_or(Client::is_closed);
        // A lost connection took its transaction with it.
        if lost { Ok(()) } else { self.batch("ROLLBACK") }
    }

    fn used_bytes(&self) -> Result<u64, StoreError> {
        let row = self.query_row(
            "SELECT pg_total_relation_size('records') + pg_total_relation_size('units')",
            &[],
        )?;
        Ok(row.map(|r| r.int(0)).transpose()?.unwrap_or(0).max(0) as u64)
    }

    fn reclaim(&self) -> Result<(), StoreError> {
        // Autovacuum gives the space of deleted rows back to new ones.
        Ok(())
    }

    fn checkpoint(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Schema 4: text stored before the NUL escape (`sql::TEXT_ESCAPE`) that holds the
/// escape character is rewritten escaped (PostgreSQL never took a NUL), so that it
/// reads back unchanged.
fn escape_existing() -> String {
    super::sql::ESCAPED_COLUMNS
        .iter()
        .map(|(table, columns)| {
            let sets: Vec<String> = columns
                .iter()
                .map(|c| format!("{c} = replace({c}, chr(1), chr(1) || '1')"))
                .collect();
            let holds: Vec<String> = columns
                .iter()
                .map(|c| format!("strpos({c}, chr(1)) > 0"))
                .collect();
            format!(
                "UPDATE {table} SET {} WHERE {};",
                sets.join(", "),
                holds.join(" OR ")
            )
        })
        .collect()
}

/// Schema 1: the tables of SQLite's schema 3, with the fleet's indexes.
const SCHEMA_1: &str = r#"
CREATE TABLE promptgate_schema (version BIGINT NOT NULL);
INSERT INTO promptgate_schema VALUES (0);
CREATE TABLE units (
  id   BIGSERIAL PRIMARY KEY,
  hash BYTEA NOT NULL UNIQUE,   -- digest of the uncompressed bytes (BLAKE3)
  size BIGINT NOT NULL,         -- uncompressed length
  data BYTEA NOT NULL           -- zstd; a later schema may add where a large unit lives instead
);
CREATE TABLE records (
  id TEXT COLLATE "C" PRIMARY KEY,  -- ULID: sorts by time
  seq BIGSERIAL UNIQUE,             -- storing order, for followers
  started_ms BIGINT NOT NULL,
  conversation TEXT COLLATE "C",
  model TEXT,
  provider TEXT,
  status BIGINT,
  outcome TEXT NOT NULL,
  input_tokens BIGINT,
  output_tokens BIGINT,
  cache_read_tokens BIGINT,
  cache_write_tokens BIGINT,
  rules TEXT NOT NULL DEFAULT '',
  meta BYTEA NOT NULL,              -- zstd JSON of the record without its bodies
  received BYTEA,                   -- layouts: skeleton + units, see layout.rs
  sent BYTEA,
  response BYTEA,
  message BYTEA,
  cache TEXT,
  tags TEXT NOT NULL DEFAULT '',
  path TEXT,
  mode TEXT,
  side BOOLEAN NOT NULL DEFAULT false
);
CREATE INDEX records_started ON records (started_ms);
CREATE INDEX records_conversation ON records (conversation, started_ms);
CREATE INDEX records_model ON records (model);
CREATE INDEX records_outcome ON records (outcome);
CREATE INDEX records_verdict ON records (split_part(lower(cache), ' ', 1));
CREATE INDEX records_tags ON records USING GIN (string_to_array(tags, ','));
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_in_the_url_is_refused_and_passfile_is_ours() {
        let problem = url_problem("postgres://pg:secret@127.0.0.1/db").unwrap();
        assert!(problem.contains("PGPASSWORD"), "{problem}");
        assert!(url_problem("postgres://pg@127.0.0.1/db?password=x").is_some());
        assert_eq!(url_problem("postgres://pg@127.0.0.1:5433/db"), None);
        let (rest, ours) = split_ours(
            "postgres://pg@h/db?passfile=/p&sslmode=verify-ca&connect_timeout=3&sslrootcert=/ca.pem",
        );
        assert_eq!(rest, "postgres://pg@h/db?connect_timeout=3");
        assert_eq!(
            ours,
            OurParams {
                passfile: Some("/p".into()),
                sslmode: Some("verify-ca".into()),
                sslrootcert: Some("/ca.pem".into()),
                other: Vec::new(),
            }
        );
        let problem = url_problem("postgres://pg@h/db?sslmode=require&sslcert=/c.pem").unwrap();
        assert!(problem.contains("client certificates"), "{problem}");
        let problem = url_problem("postgres://pg@h/db?sslmode=allow").unwrap();
        assert!(problem.contains("sslmode=allow"), "{problem}");
    }

    #[test]
    fn passfile_lines_match_like_libpq() {
        let dir = std::env::temp_dir().join(format!("pg-pass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pgpass");
        std::fs::write(
            &file,
            "# comment\nother:5432:*:pg:no\n127.0.0.1:*:fleet:pg:s\\:cret\n",
        )
        .unwrap();
        let config =
            tokio_postgres::Config::from_str("postgres://pg@127.0.0.1:6000/fleet").unwrap();
        let found = passfile_password(&config, Some(file.display().to_string()));
        assert_eq!(found.as_deref(), Some("s:cret"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
