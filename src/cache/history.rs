//! What each conversation has cached so far: the prefixes written and read, when,
//! with which ttl, and the last few requests to compare a new one with.
//!
//! Times are milliseconds on the analysis clock ([`Clock`]): a request's start plus a
//! test-only offset. A cache entry is keyed by its prefix hash (which already holds
//! the model and the tool set). It is usable from the moment the writer's response
//! began, and lives for its ttl from the start of the last request that wrote or read
//! it (the prefix in cache order). Nothing here predicts; `explain` asks.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::segment::{Hash, Segments};
use crate::id::ExchangeId;
use crate::prompt::Ttl;
use crate::provider::Usage;

pub(crate) use crate::runtime::{Clock, Millis};

/// One request that wrote or read an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Use {
    /// The request's start: the ttl runs from here.
    pub at: Millis,
    /// From when others could read it: the writer's response began; a refresh of a
    /// live entry is readable at once.
    pub available: Millis,
    pub ttl: Ttl,
    pub by: ExchangeId,
}

/// A cached prefix.
#[derive(Debug, Clone, Default)]
pub(crate) struct Entry {
    /// Tokens through the end of the prefix, from a provider's usage when known.
    pub tokens: Option<u64>,
    pub uses: Vec<Use>,
}

/// What an entry is for a reader starting at some time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryState {
    /// Readable; last written or read at `last`.
    Alive { last: Millis },
    /// Written by a request whose response had not begun when the reader started.
    Pending { by: ExchangeId, available: Millis },
    /// Its ttl ran out: idle since `last`.
    Expired { last: Millis, ttl: Ttl },
    /// Nobody wrote it before the reader started.
    Absent,
}

/// How many uses an entry keeps (the newest).
const USES_KEPT: usize = 16;

impl Entry {
    /// The entry as a request `reader` starting at `t` finds it (its own uses aside).
    pub(crate) fn state(&self, t: Millis, reader: ExchangeId) -> EntryState {
        let before = || self.uses.iter().filter(|u| u.by != reader && u.at <= t);
        let live = |u: &&Use| t < u.at + u.ttl.secs() * 1000;
        if let Some(last) = before()
            .filter(live)
            .filter(|u| u.available <= t)
            .map(|u| u.at)
            .max()
        {
            return EntryState::Alive { last };
        }
        if let Some(u) = before().filter(live).min_by_key(|u| u.available) {
            return EntryState::Pending {
                by: u.by,
                available: u.available,
            };
        }
        match before().max_by_key(|u| u.at) {
            Some(u) => EntryState::Expired {
                last: u.at,
                ttl: u.ttl,
            },
            None => EntryState::Absent,
        }
    }

    fn record(&mut self, u: Use) {
        self.uses.push(u);
        if self.uses.len() > USES_KEPT {
            self.uses.sort_by_key(|u| u.at);
            self.uses.remove(0);
        }
    }

    fn expired_at(&self, now: Millis) -> bool {
        now >= self.expiry()
    }

    /// When its last use runs out (0 with no use: expired from the start).
    fn expiry(&self) -> Millis {
        self.uses
            .iter()
            .map(|u| u.at + u.ttl.secs() * 1000)
            .max()
            .unwrap_or(0)
    }
}

/// One analysed (or in-flight) request of a conversation.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    pub id: ExchangeId,
    pub start: Millis,
    pub segments: Arc<Segments>,
    /// The provider's usage, once the record is emitted.
    pub usage: Option<Usage>,
    /// Breakpoint units whose prefixes this request wrote or refreshed.
    pub cached: Vec<usize>,
}

/// Everything remembered about one conversation.
#[derive(Debug, Default)]
pub(crate) struct Conversation {
    /// Keyed by a content digest already: a fast hasher is enough (SipHash cost ~10 % of a resend).
    /// Entries are added or given uses only through [`Conversation::cache`] and
    /// [`History::share`], which keep `next_expiry` true.
    pub entries: crate::digest::DigestMap<Entry>,
    /// No entry runs out before this (a lower bound; 0 is always true): a prune
    /// before it has nothing to drop and walks nothing.
    // 1 h entries pile up ~4 a turn; walking them all every turn was ~4 % of the
    // record pipeline at 200 KB (perf) and grows with the conversation.
    next_expiry: Millis,
    /// The newest few requests, oldest first by start.
    pub snapshots: VecDeque<Arc<Snapshot>>,
    /// Provider tokens per estimated token, from the last usage seen.
    pub calibration: Option<f64>,
    /// Whose cache it reads: a hash of the credential it was sent with (the nearest
    /// stand-in for the provider's workspace), never the credential.
    pub workspace: Option<String>,
    last_seen: Millis,
}

/// How many requests a conversation keeps for comparison (each holds its body).
const SNAPSHOTS_KEPT: usize = 3;

/// A conversation idle this long has nothing alive left (the longest ttl is 1 h).
const IDLE_FORGOTTEN: Millis = 3_600_000 + 60_000;

impl Conversation {
    /// The newest request that started before `start` (other than `id`).
    ///
    /// The latest of `model` when one is kept: each model has a cache of its own, so
    /// a conversation that switches back compares with that model's last turn.
    pub(crate) fn baseline(
        &self,
        id: ExchangeId,
        start: Millis,
        model: &str,
    ) -> Option<Arc<Snapshot>> {
        self.snapshots
            .iter()
            .rev()
            .filter(|s| s.id != id && (s.start, s.id) < (start, id))
            .find(|s| s.segments.settings.model == model)
            .cloned()
            .or_else(|| self.previous(id, start))
    }

    /// The request just before `id` (started at `start`), whatever its model.
    pub(crate) fn previous(&self, id: ExchangeId, start: Millis) -> Option<Arc<Snapshot>> {
        self.snapshots
            .iter()
            .rev()
            .find(|s| s.id != id && (s.start, s.id) < (start, id))
            .cloned()
    }

    /// The snapshot of request `id`, if kept.
    pub(crate) fn snapshot(&self, id: ExchangeId) -> Option<Arc<Snapshot>> {
        self.snapshots.iter().find(|s| s.id == id).cloned()
    }

    /// Adds or replaces a request's snapshot, keeping start order.
    pub(crate) fn keep(&mut self, snapshot: Snapshot) {
        self.last_seen = self.last_seen.max(snapshot.start);
        self.snapshots.retain(|s| s.id != snapshot.id);
        let at = self
            .snapshots
            .iter()
            .position(|s| (s.start, s.id) > (snapshot.start, snapshot.id))
            .unwrap_or(self.snapshots.len());
        self.snapshots.insert(at, Arc::new(snapshot));
        while self.snapshots.len() > SNAPSHOTS_KEPT {
            self.snapshots.pop_front();
        }
    }

    /// Records that request `by`, started at `at`, whose response began at `began`,
    /// wrote or refreshed the prefix `hash`.
    pub(crate) fn cache(
        &mut self,
        hash: Hash,
        at: Millis,
        began: Millis,
        ttl: Ttl,
        by: ExchangeId,
    ) {
        let entry = self.entries.entry(hash).or_default();
        let available = match entry.state(at, by) {
            EntryState::Alive { .. } => at,
            _ => began,
        };
        entry.record(Use {
            at,
            available,
            ttl,
            by,
        });
        // Keeping the newest uses may drop one that ran out later.
        self.next_expiry = self.next_expiry.min(entry.expiry());
    }

    /// Forgets what request `by` was thought to cache (the provider says it cached nothing).
    pub(crate) fn uncache(&mut self, by: ExchangeId) {
        for entry in self.entries.values_mut() {
            entry.uses.retain(|u| u.by != by);
        }
        self.entries.retain(|_, e| !e.uses.is_empty());
        self.next_expiry = self.first_expiry();
    }

    /// Drops entries whose every use has expired by `now`.
    pub(crate) fn prune(&mut self, now: Millis) {
        if now < self.next_expiry {
            return;
        }
        self.entries.retain(|_, e| !e.expired_at(now));
        self.next_expiry = self.first_expiry();
    }

    /// When the first of its entries runs out.
    fn first_expiry(&self) -> Millis {
        self.entries
            .values()
            .map(Entry::expiry)
            .min()
            .unwrap_or(Millis::MAX)
    }
}

/// The conversations cache analysis remembers, by conversation key.
#[derive(Debug)]
pub(crate) struct History {
    conversations: HashMap<String, Conversation>,
    limit: usize,
    /// Conversations forgotten for room while their cache could still be alive
    /// (seen within [`ACTIVE_WITHIN`]): each one's next turn is analysed as a new
    /// conversation's, so its verdict cannot say what the provider did.
    forgotten_active: u64,
    /// The count last warned about ([`History::forgotten_warning`]).
    warned_at: u64,
}

/// A conversation seen this lately may still have a live cache entry (the shortest
/// ttl): forgetting it loses what the next turn's verdict needs.
const ACTIVE_WITHIN: Millis = 300_000;

impl History {
    /// Remembers at most `limit` conversations (the least recently active are forgotten).
    pub(crate) fn new(limit: usize) -> History {
        History {
            conversations: HashMap::new(),
            limit: limit.max(1),
            forgotten_active: 0,
            warned_at: 0,
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<&Conversation> {
        self.conversations.get(key)
    }

    /// The conversation `key`, made if new.
    pub(crate) fn conversation(&mut self, key: &str, now: Millis) -> &mut Conversation {
        if !self.conversations.contains_key(key) {
            self.conversations
                .retain(|_, c| c.last_seen + IDLE_FORGOTTEN > now);
        }
        if !self.conversations.contains_key(key) && self.conversations.len() >= self.limit {
            let oldest = self
                .conversations
                .iter()
                .min_by_key(|(_, c)| c.last_seen)
                .map(|(k, c)| (k.clone(), c.last_seen));
            if let Some((k, last_seen)) = oldest {
                self.conversations.remove(&k);
                if now.saturating_sub(last_seen) < ACTIVE_WITHIN {
                    self.forgotten_active += 1;
                }
            }
        }
        let c = self.conversations.entry(key.to_owned()).or_default();
        c.last_seen = c.last_seen.max(now);
        c
    }

    /// How many conversations were forgotten while active, when that count has
    /// reached the next power of ten since the last warning (1, 10, 100, …): a
    /// warning a decade, not one a turn, when more run at once than are remembered.
    pub(crate) fn forgotten_warning(&mut self) -> Option<(u64, usize)> {
        let due = self.forgotten_active > 0
            && (self.warned_at == 0 || self.forgotten_active >= self.warned_at * 10);
        if !due {
            return None;
        }
        self.warned_at = self.forgotten_active;
        Some((self.forgotten_active, self.limit))
    }

    /// The provider's cache belongs to the workspace, not to one conversation: when
    /// conversation `key` has no live entry for one of `prefixes` (breakpoint
    /// prefixes, deepest first) that another conversation of `workspace` has, that
    /// entry is copied in, and the conversation whose request wrote it is returned
    /// with the writer's id.
    pub(crate) fn share(
        &mut self,
        key: &str,
        workspace: &str,
        prefixes: &[Hash],
        now: Millis,
        reader: ExchangeId,
    ) -> Option<(String, ExchangeId)> {
        let own = self.conversations.get(key)?;
        let alive = |e: &Entry| matches!(e.state(now, reader), EntryState::Alive { .. });
        for prefix in prefixes {
            if own.entries.get(prefix).is_some_and(alive) {
                // Its own cache reaches this deep: nothing to borrow.
                return None;
            }
            let found = self
                .conversations
                .iter()
                .filter(|(k, c)| k.as_str() != key && c.workspace.as_deref() == Some(workspace))
                .find_map(|(k, c)| {
                    let entry = c.entries.get(prefix).filter(|e| alive(e))?;
                    let by = entry.uses.iter().max_by_key(|u| u.at)?.by;
                    Some((k.clone(), entry.clone(), by))
                });
            if let Some((other, entry, by)) = found {
                let own = self.conversations.get_mut(key)?;
                own.next_expiry = own.next_expiry.min(entry.expiry());
                own.entries.insert(*prefix, entry);
                return Some((other, by));
            }
        }
        None
    }

    /// How many of `prefixes` (deepest first) come before the first that
    /// conversation `key`'s own cache holds alive: the ones another conversation
    /// could have lent it.
    pub(crate) fn unreached(
        &self,
        key: &str,
        prefixes: &[Hash],
        now: Millis,
        reader: ExchangeId,
    ) -> usize {
        let Some(own) = self.conversations.get(key) else {
            return prefixes.len();
        };
        prefixes
            .iter()
            .take_while(|p| {
                !own.entries
                    .get(*p)
                    .is_some_and(|e| matches!(e.state(now, reader), EntryState::Alive { .. }))
            })
            .count()
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.conversations.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::UNIX_EPOCH;

    use super::*;

    #[test]
    fn entries_live_for_their_ttl_from_the_last_use() {
        let (a, b, c) = (ExchangeId::new(), ExchangeId::new(), ExchangeId::new());
        let mut conv = Conversation::default();
        let h = [7u8; 32];
        conv.cache(h, 1_000, 1_400, Ttl::FiveMinutes, a);
        let e = &conv.entries[&h];
        assert_eq!(
            e.state(1_200, b),
            EntryState::Pending {
                by: a,
                available: 1_400
            },
            "not readable before the writer's response began"
        );
        assert_eq!(e.state(1_400, b), EntryState::Alive { last: 1_000 });
        assert_eq!(
            e.state(500, b),
            EntryState::Absent,
            "written after the reader started"
        );
        assert_eq!(
            e.state(1_500, a),
            EntryState::Absent,
            "a request never reads itself"
        );
        assert_eq!(
            e.state(301_000, b),
            EntryState::Expired {
                last: 1_000,
                ttl: Ttl::FiveMinutes
            }
        );
        // A read at 250 s refreshes it: alive until 550 s, readable at once.
        conv.cache(h, 250_000, 250_900, Ttl::FiveMinutes, b);
        let e = &conv.entries[&h];
        assert_eq!(e.uses[1].available, 250_000);
        assert_eq!(e.state(540_000, c), EntryState::Alive { last: 250_000 });
        assert!(matches!(
            e.state(551_000, c),
            EntryState::Expired { last: 250_000, .. }
        ));
        conv.prune(549_000);
        assert_eq!(conv.entries.len(), 1);
        conv.prune(551_000);
        assert!(conv.entries.is_empty());
    }

    #[test]
    fn a_prune_drops_what_ran_out_however_its_entries_changed() {
        let (a, b) = (ExchangeId::new(), ExchangeId::new());
        let mut conv = Conversation::default();
        let h = [3u8; 32];
        conv.cache(h, 0, 0, Ttl::OneHour, a);
        conv.prune(1);
        // Sixteen newer 5-minute uses push the hour-long one out: the entry now runs
        // out at 16 s + 5 min, not at 1 h.
        for i in 1..=16 {
            conv.cache(h, i * 1_000, i * 1_000, Ttl::FiveMinutes, ExchangeId::new());
        }
        conv.prune(315_999);
        assert_eq!(conv.entries.len(), 1);
        conv.prune(316_000);
        assert!(conv.entries.is_empty(), "ran out at 316 s");
        // Forgetting a writer can also bring an entry's end nearer.
        conv.cache(h, 0, 0, Ttl::OneHour, a);
        conv.cache(h, 0, 0, Ttl::FiveMinutes, b);
        conv.prune(1);
        conv.uncache(a);
        conv.prune(300_000);
        assert!(conv.entries.is_empty(), "only the 5-minute use was left");
    }

    #[test]
    fn an_entry_borrowed_from_another_conversation_is_pruned_when_it_runs_out() {
        let mut h = History::new(4);
        let h1 = [9u8; 32];
        for key in ["a", "b"] {
            h.conversation(key, 0).workspace = Some("w".into());
        }
        h.conversation("b", 0)
            .cache(h1, 0, 0, Ttl::FiveMinutes, ExchangeId::new());
        h.conversation("a", 0).prune(1);
        assert!(h.share("a", "w", &[h1], 10, ExchangeId::new()).is_some());
        let a = h.conversation("a", 20);
        a.prune(299_999);
        assert_eq!(a.entries.len(), 1);
        a.prune(300_000);
        assert!(a.entries.is_empty());
    }

    #[test]
    fn uncache_forgets_one_writer() {
        let (a, b) = (ExchangeId::new(), ExchangeId::new());
        let mut conv = Conversation::default();
        conv.cache([1; 32], 0, 10, Ttl::OneHour, a);
        conv.cache([2; 32], 0, 10, Ttl::OneHour, b);
        conv.uncache(a);
        assert!(!conv.entries.contains_key(&[1; 32]) && conv.entries.contains_key(&[2; 32]));
    }

    #[test]
    fn history_forgets_the_least_recent_conversation() {
        let mut h = History::new(2);
        h.conversation("a", 1);
        h.conversation("b", 2);
        h.conversation("a", 3);
        h.conversation("c", 4);
        assert_eq!(h.len(), 2);
        assert!(h.get("a").is_some() && h.get("b").is_none());
        // Idle past the longest ttl: forgotten when another conversation starts.
        h.conversation("d", 3 + IDLE_FORGOTTEN);
        assert!(h.get("a").is_none() && h.get("c").is_some() && h.get("d").is_some());
    }

    /// More conversations active at once than are remembered: each one forgotten
    /// while its cache could be alive is counted, and warned about once a decade; one
    /// forgotten after going quiet is not.
    #[test]
    fn conversations_forgotten_while_active_are_counted_and_warned_about_a_decade_at_once() {
        let mut h = History::new(2);
        h.conversation("a", 0);
        h.conversation("b", ACTIVE_WITHIN);
        h.conversation("c", ACTIVE_WITHIN + 1);
        assert_eq!(
            (h.forgotten_active, h.forgotten_warning()),
            (0, None),
            "a was quiet"
        );
        let mut warnings = Vec::new();
        for turn in 0..25u64 {
            // Three conversations in turn through room for two: each forgets one.
            h.conversation(
                ["a", "b", "c"][(turn % 3) as usize],
                ACTIVE_WITHIN + 2 + turn,
            );
            warnings.extend(h.forgotten_warning());
        }
        assert_eq!(h.forgotten_active, 25);
        assert_eq!(warnings, [(1, 2), (10, 2)]);
    }

    #[test]
    fn a_clock_moves_by_its_offset() {
        let offset = Arc::new(AtomicU64::new(0));
        let clock = Clock::offset_by(offset.clone());
        let t = UNIX_EPOCH + std::time::Duration::from_secs(100);
        assert_eq!(clock.at(t), 100_000);
        offset.store(360_500, Ordering::Relaxed);
        assert_eq!(clock.at(t), 460_500);
        assert_eq!(Clock::system().at(t), 100_000);
    }
}
