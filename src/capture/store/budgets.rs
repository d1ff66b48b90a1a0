//! The budgets' counters in the fleet's PostgreSQL, so that every replica enforces
//! one budget: a row per (budget, scope, bucket) of spend and a row per hold of an
//! exchange in flight. A check takes a transaction-scoped advisory lock on each of
//! its scopes, so replicas checking one scope go one after the other, and reads the
//! spend and the holds in one statement (one snapshot, after the lock).

use super::sql::{Dialect, Value};
use super::{Store, StoreError, StoreLocation};
use crate::rules::budget::{Charge, Reservation, Spent, Sums};
use crate::runtime::Millis;

/// Dollars are kept in millionths: whole numbers add exactly, in any order.
const MICRO: f64 = 1e6;

/// Made when first needed, under a lock, by whichever replica comes first.
const TABLES: &str = "
CREATE TABLE IF NOT EXISTS budget_spent (
  budget TEXT NOT NULL, scope TEXT NOT NULL, bucket BIGINT NOT NULL,
  microusd BIGINT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
  requests BIGINT NOT NULL, PRIMARY KEY (budget, scope, bucket));
CREATE TABLE IF NOT EXISTS budget_held (
  exchange TEXT NOT NULL, budget TEXT NOT NULL, scope TEXT NOT NULL, at BIGINT NOT NULL,
  microusd BIGINT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
  requests BIGINT NOT NULL);
CREATE INDEX IF NOT EXISTS budget_held_scope ON budget_held (budget, scope, at);
CREATE INDEX IF NOT EXISTS budget_held_exchange ON budget_held (exchange);
CREATE INDEX IF NOT EXISTS budget_held_at ON budget_held (at);";

/// The advisory lock the tables are made under ("pgbudget").
const TABLES_LOCK: i64 = 0x7067_6275_6467_6574;

/// A scope's lock: the first 8 bytes of the SHA-256 of its budget and scope.
fn scope_lock(budget: &str, scope: &str) -> i64 {
    let mut text = Vec::with_capacity(budget.len() + 1 + scope.len());
    text.extend_from_slice(budget.as_bytes());
    text.push(0);
    text.extend_from_slice(scope.as_bytes());
    let digest = crate::digest::sha256(&text);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

fn micro(usd: f64) -> i64 {
    (usd * MICRO).round() as i64
}

/// The sums a row of four counts holds from column `at` on.
fn spent_of(row: &super::sql::SqlRow, at: usize) -> Result<Spent, StoreError> {
    Ok(Spent {
        usd: row.int(at)? as f64 / MICRO,
        input_tokens: row.int(at + 1)? as u64,
        output_tokens: row.int(at + 2)? as u64,
        requests: row.int(at + 3)? as u64,
    })
}

fn counts(spent: &Spent) -> [Value; 4] {
    [
        Value::Int(micro(spent.usd)),
        Value::Int(spent.input_tokens as i64),
        Value::Int(spent.output_tokens as i64),
        Value::Int(spent.requests as i64),
    ]
}

impl Store {
    /// Opens the PostgreSQL store at `location` for the budgets' counters (their
    /// tables made if missing), every call answered within `within`.
    pub(crate) fn open_for_budgets(
        location: &StoreLocation,
        within: std::time::Duration,
    ) -> Result<Store, StoreError> {
        let StoreLocation::Postgres(url) = location else {
            return Err(StoreError::Postgres(
                "budgets share counters only in a PostgreSQL store".into(),
            ));
        };
        let store = Store {
            conn: Box::new(super::postgres::Postgres::open_within(url, within)?),
            location: location.clone(),
            units: super::UnitWriter::new()?,
            version: i64::MAX,
        };
        store.in_transaction(|s| {
            s.conn.execute(
                "SELECT pg_advisory_xact_lock(?1)",
                &[Value::Int(TABLES_LOCK)],
            )?;
            s.conn.batch(TABLES)
        })?;
        Ok(store)
    }

    /// Runs `f` in a transaction: committed when it succeeds, rolled back when not.
    fn in_transaction<T>(
        &self,
        f: impl FnOnce(&Store) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.conn.begin()?;
        match f(self) {
            Ok(v) => {
                self.conn.commit()?;
                Ok(v)
            }
            Err(e) => {
                let _ = self.conn.rollback();
                Err(e)
            }
        }
    }

    /// See [`crate::rules::budget::SharedLedger::reserve`]. Five round trips
    /// whatever the number of budgets: begin, the locks, the sums, the holds, commit.
    pub(crate) fn budget_reserve(
        &self,
        r: &Reservation<'_>,
        judge: &mut dyn FnMut(&[Sums]) -> bool,
    ) -> Result<bool, StoreError> {
        debug_assert_eq!(self.conn.dialect(), Dialect::Postgres);
        if r.asks.is_empty() {
            return Ok(judge(&[]));
        }
        self.in_transaction(|s| {
            // In one order, so that two checks of the same scopes never wait on each
            // other (a target list is evaluated left to right).
            let mut locks: Vec<i64> = r
                .asks
                .iter()
                .map(|a| scope_lock(&a.budget, &a.scope))
                .collect();
            locks.sort_unstable();
            locks.dedup();
            let calls: Vec<String> = (1..=locks.len())
                .map(|i| format!("pg_advisory_xact_lock(?{i})"))
                .collect();
            let args: Vec<Value> = locks.into_iter().map(Value::Int).collect();
            s.conn
                .execute(&format!("SELECT {}", calls.join(", ")), &args)?;
            // Every scope's sums in one statement, after the locks: one snapshot that
            // holds every other replica's committed holds and charges.
            let mut args = vec![Value::Int(r.held_since as i64)];
            let mut parts = Vec::with_capacity(r.asks.len());
            for (n, a) in r.asks.iter().enumerate() {
                let at = args.len();
                let (budget, scope, since) = (at + 1, at + 2, at + 3);
                parts.push(format!(
                    "SELECT {n} AS n, s.u, s.i, s.o, s.r, s.oldest, h.u, h.i, h.o, h.r FROM
                       (SELECT COALESCE(SUM(microusd), 0)::BIGINT AS u,
                               COALESCE(SUM(input_tokens), 0)::BIGINT AS i,
                               COALESCE(SUM(output_tokens), 0)::BIGINT AS o,
                               COALESCE(SUM(requests), 0)::BIGINT AS r, MIN(bucket) AS oldest
                        FROM budget_spent WHERE budget = ?{budget} AND scope = ?{scope}
                          AND bucket >= ?{since}) s,
                       (SELECT COALESCE(SUM(microusd), 0)::BIGINT AS u,
                               COALESCE(SUM(input_tokens), 0)::BIGINT AS i,
                               COALESCE(SUM(output_tokens), 0)::BIGINT AS o,
                               COALESCE(SUM(requests), 0)::BIGINT AS r
                        FROM budget_held WHERE budget = ?{budget} AND scope = ?{scope}
                          AND at >= ?1) h"
                ));
                args.extend([
                    Value::from(a.budget.as_str()),
                    Value::from(a.scope.as_str()),
                    Value::Int(a.since as i64),
                ]);
            }
            let sql = format!("{} ORDER BY n", parts.join(" UNION ALL "));
            let sums = s
                .conn
                .query(&sql, &args)?
                .iter()
                .map(|row| {
                    Ok(Sums {
                        spent: spent_of(row, 1)?,
                        oldest: row.opt_int(5)?.map_or(Millis::MAX, |b| b as Millis),
                        held: spent_of(row, 6)?,
                    })
                })
                .collect::<Result<Vec<Sums>, StoreError>>()?;
            if sums.len() != r.asks.len() {
                return Err(StoreError::Corrupt(
                    "budget sums: a scope is missing".into(),
                ));
            }
            let goes = judge(&sums);
            if goes {
                let mut rows = Vec::with_capacity(r.asks.len());
                let mut args = Vec::with_capacity(r.asks.len() * 8);
                for a in r.asks {
                    rows.push(format!("({})", super::placeholders(args.len() + 1, 8)));
                    args.extend([
                        Value::from(r.id),
                        Value::from(a.budget.as_str()),
                        Value::from(a.scope.as_str()),
                        Value::Int(r.at as i64),
                    ]);
                    args.extend(counts(&a.estimate));
                }
                s.conn.execute(
                    &format!(
                        "INSERT INTO budget_held (exchange, budget, scope, at, microusd,
                           input_tokens, output_tokens, requests) VALUES {}",
                        rows.join(", ")
                    ),
                    &args,
                )?;
            }
            Ok(goes)
        })
    }

    /// See [`crate::rules::budget::SharedLedger::charge`]: one statement, so the
    /// holds go and the charges come at once (a check sees both or neither). One
    /// exchange a statement: its shape stays the same, prepared once.
    pub(crate) fn budget_charge(&self, id: &str, charges: &[Charge]) -> Result<(), StoreError> {
        let mut args = vec![Value::from(id)];
        let delete = "DELETE FROM budget_held WHERE exchange = ?1";
        if charges.is_empty() {
            self.conn.execute(delete, &args)?;
            return Ok(());
        }
        let mut rows = Vec::with_capacity(charges.len());
        for c in charges {
            rows.push(format!("({})", super::placeholders(args.len() + 1, 7)));
            args.extend([
                Value::from(c.budget.as_str()),
                Value::from(c.scope.as_str()),
                Value::Int(c.bucket as i64),
            ]);
            args.extend(counts(&c.spent));
        }
        self.conn.execute(
            &format!(
                "WITH gone AS ({delete})
                 INSERT INTO budget_spent (budget, scope, bucket, microusd, input_tokens,
                   output_tokens, requests) VALUES {}
                 ON CONFLICT (budget, scope, bucket) DO UPDATE SET
                   microusd = budget_spent.microusd + excluded.microusd,
                   input_tokens = budget_spent.input_tokens + excluded.input_tokens,
                   output_tokens = budget_spent.output_tokens + excluded.output_tokens,
                   requests = budget_spent.requests + excluded.requests",
                rows.join(", ")
            ),
            &args,
        )?;
        Ok(())
    }

    /// See [`crate::rules::budget::SharedLedger::forget_stale`].
    pub(crate) fn budget_forget_stale(&self, held_since: Millis) -> Result<(), StoreError> {
        self.conn.execute(
            "DELETE FROM budget_held WHERE at < ?1",
            &[Value::Int(held_since as i64)],
        )?;
        Ok(())
    }

    /// See [`crate::rules::budget::SharedLedger::scopes`].
    pub(crate) fn budget_scopes(
        &self,
        budget: &str,
        since: Millis,
    ) -> Result<Vec<(String, Spent, Millis)>, StoreError> {
        self.conn
            .query(
                "SELECT scope, SUM(microusd)::BIGINT, SUM(input_tokens)::BIGINT,
                   SUM(output_tokens)::BIGINT, SUM(requests)::BIGINT, MIN(bucket)
                 FROM budget_spent WHERE budget = ?1 AND bucket >= ?2
                 GROUP BY scope ORDER BY 2 DESC, 5 DESC",
                &[Value::from(budget), Value::Int(since as i64)],
            )?
            .iter()
            .map(|row| Ok((row.text(0)?, spent_of(row, 1)?, row.int(5)? as Millis)))
            .collect()
    }
}
