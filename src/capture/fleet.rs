//! The store the fleet shares (PostgreSQL): as the cache analysis reads it (the
//! turns other replicas took, opened for lookups when first needed), and as the
//! budgets keep their counters in it. The same lookups find a socket's earlier
//! turns after a restart, in either store.

use std::sync::Mutex;

use super::store::{Store, StoreLocation};
use crate::cache::{SHARED_STORE_WITHIN, SharedHistory, SharedHistoryError, SharedTurn};
use crate::exchange::{Credential, StoredTurn};
use crate::id::ExchangeId;
use crate::rules::budget::{Charge, Reservation, SharedLedger, SharedLedgerError, Spent, Sums};

/// The capture store opened for lookups when first asked: the fleet's history for
/// the cache analysis (PostgreSQL), and a socket's earlier turns (either store).
/// After a failure the connection is dropped and opened again on the next question.
pub(crate) struct StoreLookups {
    location: StoreLocation,
    store: Mutex<Option<Store>>,
}

impl StoreLookups {
    /// The store at `location`, not opened yet.
    pub(crate) fn new(location: StoreLocation) -> StoreLookups {
        StoreLookups {
            location,
            store: Mutex::new(None),
        }
    }

    /// Runs `ask` on the open store (opening it first when needed); a failure
    /// drops the connection, which may be what failed.
    fn ask<T>(
        &self,
        ask: impl FnOnce(&Store) -> Result<T, super::StoreError>,
    ) -> Result<T, SharedHistoryError> {
        let mut slot = self.store.lock().unwrap_or_else(|p| p.into_inner());
        let store = match slot.take() {
            Some(store) => store,
            None => Store::open_for_lookups(&self.location, SHARED_STORE_WITHIN)?,
        };
        let answer = ask(&store)?;
        *slot = Some(store);
        Ok(answer)
    }
}

/// How many of a conversation's newest stored turns a socket's turn looks through
/// for the response it continues.
const TURNS_LOOKED_AT: usize = 64;

impl crate::exchange::StoredTurns for StoreLookups {
    fn answered(
        &self,
        conversation: &str,
        credential: &Credential,
        response_id: &str,
    ) -> Option<StoredTurn> {
        let found = self.ask(|store| {
            let ids = store.turns(
                conversation,
                0,
                &ExchangeId::new().to_string(),
                TURNS_LOOKED_AT,
            )?;
            // Newest first: the turn continued is usually the last one.
            for id in ids.iter().rev() {
                // A record that cannot be read is skipped, not the end of the search.
                let Ok(r) = store.load(id) else {
                    continue;
                };
                let same_credential = r.sent_headers().get(credential.header).is_some_and(|v| {
                    crate::redact::credential_id(credential.header, v.as_bytes()) == credential.id
                });
                if r.response.response_id.as_deref() != Some(response_id) || !same_credential {
                    continue;
                }
                let Some(id) = ExchangeId::parse(id) else {
                    continue;
                };
                return Ok(Some(StoredTurn {
                    id,
                    prompt: r
                        .request
                        .sent_body
                        .as_ref()
                        .unwrap_or(&r.request.body)
                        .bytes
                        .clone(),
                    events: r.response.body.bytes.clone(),
                }));
            }
            Ok(None)
        });
        match found {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!("the store did not answer for a socket's earlier turn: {e}");
                None
            }
        }
    }
}

impl SharedHistory for StoreLookups {
    fn turns(
        &self,
        conversation: &str,
        since: u64,
        before: ExchangeId,
        most: usize,
        known: &dyn Fn(ExchangeId) -> bool,
    ) -> Result<Vec<SharedTurn>, SharedHistoryError> {
        self.ask(|store| {
            store
                .turns(conversation, since, &before.to_string(), most)?
                .iter()
                .filter_map(|id| ExchangeId::parse(id).filter(|&id| !known(id)))
                .map(|id| {
                    let r = store.load(&id.to_string())?;
                    let body = r.request.sent_body.as_ref().unwrap_or(&r.request.body);
                    Ok(SharedTurn {
                        id,
                        format: r.request_format(),
                        status: r.response.status,
                        usage: r.usage,
                        start: r.times.started_ms,
                        upstream_headers_ms: r.times.upstream_headers_ms,
                        headers: r.sent_headers(),
                        body: body.bytes.clone(),
                    })
                })
                .collect()
        })
    }

    fn prefix_writers(
        &self,
        workspace: &str,
        prefixes: &[String],
        since: u64,
        before: ExchangeId,
    ) -> Result<Vec<(String, String)>, SharedHistoryError> {
        self.ask(|store| store.prefix_writers(workspace, prefixes, since, &before.to_string()))
    }
}

/// How long one call to the budgets' counters may take: a check waits on it before
/// the request goes.
const BUDGET_STORE_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// The fleet's budget counters in the capture's PostgreSQL: connections opened
/// when needed and kept idle between calls (one per check in flight, at most).
pub(crate) struct FleetLedger {
    location: StoreLocation,
    idle: Mutex<Vec<Store>>,
}

impl FleetLedger {
    /// The counters in the store at `location`, not opened yet.
    pub(crate) fn new(location: StoreLocation) -> FleetLedger {
        FleetLedger {
            location,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Runs `call` on an idle connection (or a new one); a connection that failed is
    /// dropped, as it may be what failed.
    fn with<T>(
        &self,
        call: impl FnOnce(&Store) -> Result<T, super::StoreError>,
    ) -> Result<T, SharedLedgerError> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let store = match idle {
            Some(store) => store,
            None => Store::open_for_budgets(&self.location, BUDGET_STORE_WITHIN)?,
        };
        let answer = call(&store)?;
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(store);
        Ok(answer)
    }
}

impl SharedLedger for FleetLedger {
    fn reserve(
        &self,
        reservation: &Reservation<'_>,
        judge: &mut dyn FnMut(&[Sums]) -> bool,
    ) -> Result<bool, SharedLedgerError> {
        self.with(|store| store.budget_reserve(reservation, judge))
    }

    fn charge(&self, id: &str, charges: &[Charge]) -> Result<(), SharedLedgerError> {
        self.with(|store| store.budget_charge(id, charges))
    }

    fn forget_stale(&self, held_since: u64) -> Result<(), SharedLedgerError> {
        self.with(|store| store.budget_forget_stale(held_since))
    }

    fn scopes(
        &self,
        budget: &str,
        since: u64,
    ) -> Result<Vec<(String, Spent, u64)>, SharedLedgerError> {
        self.with(|store| store.budget_scopes(budget, since))
    }
}
