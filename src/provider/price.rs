//! What a request costs and what caching saved, in dollars, by a price table in
//! config: a fact of each provider, read by the cache analysis, metrics, replay and
//! budgets.
//!
//! Prices are per million tokens; cache writes and reads are multipliers of the
//! input price (5m writes 1.25×, 1h writes 2×, reads 0.1× unless an entry says
//! otherwise; Anthropic's pricing page). Also the per-model minimum cacheable lengths (Anthropic's documented minimums):
//! both tables change with model releases, so both are config with defaults here.

use globset::{Glob, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Serialize};

use crate::provider::Usage;

/// One model's prices.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Dollars per million uncached input tokens.
    pub input: f64,
    /// Dollars per million output tokens.
    pub output: f64,
    /// Multiplier of `input` for 5-minute cache writes.
    #[serde(default = "write_5m")]
    pub cache_write_5m: f64,
    /// Multiplier of `input` for 1-hour cache writes.
    #[serde(default = "write_1h")]
    pub cache_write_1h: f64,
    /// Multiplier of `input` for cache reads (and refreshes).
    #[serde(default = "read")]
    pub cache_read: f64,
}

fn write_5m() -> f64 {
    1.25
}
fn write_1h() -> f64 {
    2.0
}
fn read() -> f64 {
    0.1
}

const fn price(input: f64, output: f64, cache_read: f64) -> Price {
    Price {
        input,
        output,
        cache_write_5m: 1.25,
        cache_write_1h: 2.0,
        cache_read,
    }
}

/// Default prices (Anthropic's pricing page, 2026-10). OpenAI models have none by
/// default: add them under `[cache.prices]`.
/// The most specific matching pattern wins (see [`Table::find`]).
const DEFAULT_PRICES: &[(&str, Price)] = &[
    ("claude-fable-5-1*", price(10.0, 50.0, 0.025)),
    ("claude-mythos-5-1*", price(10.0, 50.0, 0.025)),
    ("claude-fable-5*", price(10.0, 50.0, 0.1)),
    ("claude-mythos-5*", price(10.0, 50.0, 0.1)),
    ("claude-opus-5-5*", price(4.0, 20.0, 0.05)),
    ("claude-opus-5*", price(5.0, 25.0, 0.1)),
    ("claude-opus-4-5*", price(5.0, 25.0, 0.1)),
    ("claude-opus-4-6*", price(5.0, 25.0, 0.1)),
    ("claude-opus-4-7*", price(5.0, 25.0, 0.1)),
    ("claude-opus-4-8*", price(5.0, 25.0, 0.1)),
    ("claude-opus-4-1*", price(15.0, 75.0, 0.1)),
    ("claude-opus-4-2*", price(15.0, 75.0, 0.1)),
    ("claude-opus-4-0*", price(15.0, 75.0, 0.1)),
    ("claude-sonnet-5-5*", price(2.0, 10.0, 0.05)),
    ("claude-sonnet-5*", price(2.0, 10.0, 0.1)),
    ("claude-sonnet-4*", price(3.0, 15.0, 0.1)),
    ("claude-3-7-sonnet*", price(3.0, 15.0, 0.1)),
    ("claude-haiku-5-5*", price(0.10, 0.50, 0.1)),
    ("claude-haiku-4-5*", price(1.0, 5.0, 0.1)),
    ("claude-3-5-haiku*", price(0.80, 4.0, 0.1)),
    ("claude-3-haiku*", price(0.25, 1.25, 0.1)),
];

/// Default minimum cacheable prompt lengths in tokens (2026 snapshot; the 5.5
/// models are not in it and are given their family's number).
const DEFAULT_MIN_TOKENS: &[(&str, u64)] = &[
    ("claude-fable-5*", 512),
    ("claude-mythos-5*", 512),
    ("claude-opus-5*", 512),
    ("claude-opus-4-8*", 1024),
    ("claude-sonnet-5*", 1024),
    ("claude-sonnet-4*", 1024),
    ("claude-opus-4-1*", 1024),
    ("claude-opus-4-0*", 1024),
    ("claude-opus-4-2*", 1024),
    ("claude-3-7-sonnet*", 1024),
    ("claude-mythos-preview*", 2048),
    ("claude-opus-4-7*", 2048),
    ("claude-3-5-haiku*", 2048),
    ("claude-3-haiku*", 2048),
    ("claude-opus-4-6*", 4096),
    ("claude-opus-4-5*", 4096),
    ("claude-haiku-4-5*", 4096),
    ("claude-haiku-5*", 4096),
    ("gpt-*", 1024),
    ("o*", 1024),
];

/// Used for a model no entry matches.
pub(crate) const FALLBACK_MIN_TOKENS: u64 = 1024;

/// A table of model patterns (globs, as in rules: `*` matches any run of
/// characters): configured entries first, then the defaults.
#[derive(Debug, Clone)]
pub struct Table<T> {
    configured: Patterns<T>,
    defaults: Patterns<T>,
}

/// One list of a [`Table`]: its entries and their globs as one set, so a lookup is
/// one pass over the model name, not one regex per entry.
// Per pattern, a lookup was ~15 % of a hook's event at 200 KB (perf, c1).
#[derive(Debug, Clone)]
struct Patterns<T> {
    entries: Vec<(String, T)>,
    /// Indexes of `entries` by the set's glob order (a pattern that is no glob at
    /// all is left out: it matches nothing).
    index: Vec<usize>,
    set: GlobSet,
}

impl<T: Copy> Patterns<T> {
    fn new(entries: Vec<(String, T)>) -> Patterns<T> {
        let mut builder = GlobSetBuilder::new();
        let mut index = Vec::with_capacity(entries.len());
        for (i, (pattern, _)) in entries.iter().enumerate() {
            if let Some(glob) = glob(pattern) {
                builder.add(glob);
                index.push(i);
            }
        }
        // Each glob compiled on its own above, so the set does too; if not, it is empty.
        let set = builder.build().unwrap_or_else(|_| GlobSet::empty());
        Patterns {
            entries,
            index,
            set,
        }
    }

    /// The entry with the longest matching pattern.
    fn best(&self, model: &str) -> Option<(&str, T)> {
        self.set
            .matches(model)
            .into_iter()
            .filter_map(|m| self.index.get(m).and_then(|&i| self.entries.get(i)))
            .max_by_key(|(p, _)| p.len())
            .map(|(p, v)| (p.as_str(), *v))
    }
}

impl<T: Copy> Table<T> {
    /// The value for `model`: the configured entry with the longest matching pattern,
    /// else the default with the longest matching pattern.
    pub fn find(&self, model: &str) -> Option<(&str, T)> {
        self.configured
            .best(model)
            .or_else(|| self.defaults.best(model))
    }

    /// A table of `configured` entries over `defaults`.
    pub fn new(configured: Vec<(String, T)>, defaults: &[(&str, T)]) -> Table<T> {
        Table {
            configured: Patterns::new(configured),
            defaults: Patterns::new(
                defaults
                    .iter()
                    .map(|(p, v)| ((*p).to_owned(), *v))
                    .collect(),
            ),
        }
    }
}

/// The default price table with `configured` entries over it.
pub(crate) fn prices(configured: Vec<(String, Price)>) -> Table<Price> {
    Table::new(configured, DEFAULT_PRICES)
}

/// The default minimum-length table with `configured` entries over it.
pub(crate) fn min_tokens(configured: Vec<(String, u64)>) -> Table<u64> {
    Table::new(configured, DEFAULT_MIN_TOKENS)
}

/// A model pattern with the glob syntax rules use; a pattern that is no valid glob
/// matches itself only (its escaped form always compiles).
fn glob(pattern: &str) -> Option<Glob> {
    Glob::new(pattern)
        .or_else(|_| Glob::new(&globset::escape(pattern)))
        .ok()
}

/// Dollars of one exchange's input, by what caching did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    /// Spent on cache writes.
    pub write_usd: f64,
    /// Spent on cache reads.
    pub read_usd: f64,
    /// Saved by the reads, against sending those tokens uncached.
    pub saved_usd: f64,
    /// Lost to the miss reason: what the tokens that should have been read cost,
    /// minus what reading them would have cost.
    pub lost_usd: f64,
    /// Spent on the whole input (uncached, writes and reads).
    pub input_usd: f64,
    /// Spent on the answer's tokens.
    #[serde(default)]
    pub output_usd: f64,
    /// The exchange's whole cost: input and output.
    #[serde(default)]
    pub total_usd: f64,
}

/// Prices a usage. `lost_tokens` are tokens the rules say could have been read;
/// `one_hour` is the share of writes at the 1h price when the usage has no split.
pub(crate) fn cost(price: &Price, usage: &Usage, lost_tokens: u64, one_hour_hint: bool) -> Cost {
    let per = price.input / 1e6;
    let (w5, w1) = match (usage.cache_write_5m_tokens, usage.cache_write_1h_tokens) {
        (Some(a), Some(b)) if a + b == usage.cache_write_tokens => (a, b),
        _ if one_hour_hint => (0, usage.cache_write_tokens),
        _ => (usage.cache_write_tokens, 0),
    };
    let write_usd = per * (price.cache_write_5m * w5 as f64 + price.cache_write_1h * w1 as f64);
    let read_usd = per * price.cache_read * usage.cache_read_tokens as f64;
    let saved_usd = per * (1.0 - price.cache_read) * usage.cache_read_tokens as f64;
    // The lost tokens were paid as writes first (they were written again), then as input.
    let from_writes = lost_tokens.min(usage.cache_write_tokens);
    let from_input = (lost_tokens - from_writes).min(usage.input_tokens);
    let write_mult = if usage.cache_write_tokens == 0 {
        price.cache_write_5m
    } else {
        (price.cache_write_5m * w5 as f64 + price.cache_write_1h * w1 as f64)
            / usage.cache_write_tokens as f64
    };
    let paid = from_writes as f64 * write_mult + from_input as f64;
    let lost_usd = (per * (paid - price.cache_read * (from_writes + from_input) as f64)).max(0.0);
    let input_usd = per * usage.input_tokens as f64 + write_usd + read_usd;
    let output_usd = price.output / 1e6 * usage.output_tokens as f64;
    Cost {
        write_usd,
        read_usd,
        saved_usd,
        lost_usd,
        input_usd,
        output_usd,
        total_usd: input_usd + output_usd,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn glob(pattern: &str, text: &str) -> bool {
        super::glob(pattern).is_some_and(|g| g.compile_matcher().is_match(text))
    }

    #[test]
    fn globs() {
        assert!(glob("claude-opus-5*", "claude-opus-5-5"));
        assert!(glob("claude-opus-5*", "claude-opus-5"));
        assert!(!glob("claude-opus-5*", "claude-opus-4-5"));
        assert!(glob("gpt-*-mini", "gpt-5.6-mini"));
        assert!(!glob("gpt-*-mini", "gpt-5.6"));
        assert!(glob("exact", "exact") && !glob("exact", "exactly"));
        assert!(glob("*", "anything"));
    }

    #[test]
    fn most_specific_pattern_wins_and_config_comes_first() {
        let t = prices(Vec::new());
        assert_eq!(t.find("claude-opus-5-5").unwrap().1.input, 4.0);
        assert_eq!(t.find("claude-opus-5").unwrap().1.input, 5.0);
        assert_eq!(t.find("claude-fable-5-1").unwrap().1.cache_read, 0.025);
        assert!(t.find("llama").is_none());
        let mine = prices(vec![("claude-*".into(), price(1.0, 2.0, 0.1))]);
        assert_eq!(
            mine.find("claude-opus-5-5").unwrap(),
            ("claude-*", price(1.0, 2.0, 0.1))
        );
        let m = min_tokens(Vec::new());
        assert_eq!(m.find("claude-opus-4-6").unwrap().1, 4096);
        assert_eq!(m.find("claude-sonnet-4-5-20250929").unwrap().1, 1024);
        assert_eq!(m.find("claude-opus-5-5").unwrap().1, 512);
    }

    #[test]
    fn write_read_saved_and_lost() {
        let p = price(4.0, 20.0, 0.1);
        // 48k written at 5m, 2k read, 100 uncached.
        let u = Usage {
            input_tokens: 100,
            cache_write_tokens: 48_000,
            cache_read_tokens: 2_000,
            cache_write_5m_tokens: Some(48_000),
            cache_write_1h_tokens: Some(0),
            ..Usage::default()
        };
        let c = cost(&p, &u, 40_000, false);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(c.write_usd, 4.0 * 1.25 * 0.048), "{c:?}");
        assert!(close(c.read_usd, 4.0 * 0.1 * 0.002));
        assert!(close(c.saved_usd, 4.0 * 0.9 * 0.002));
        // 40k tokens rewritten at 1.25 instead of read at 0.1.
        assert!(
            close(c.lost_usd, 4.0 * (1.25 - 0.1) * 0.04),
            "{}",
            c.lost_usd
        );
        // No split given, but the request used 1h markers.
        let u1 = Usage {
            cache_write_tokens: 1_000_000,
            ..Usage::default()
        };
        assert!(close(cost(&p, &u1, 0, true).write_usd, 8.0));
        assert!(close(cost(&p, &u1, 0, false).write_usd, 5.0));
    }
}
