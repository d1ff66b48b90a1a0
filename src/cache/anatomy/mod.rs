//! Prompt anatomy: each part of an agent's prompt named by where it came from, with
//! its estimated tokens, read off the cache units of one request.
//!
//! A unit is one part, except a text that carries several sections (Claude Code's
//! context reminder with its `# claudeMd`, `# gitStatus`, … keys and each memory
//! file in it; pi's system block with its project context, date and directory;
//! opencode's `<env>` and instructions; Codex's developer and context items): those
//! are split, each section's tokens its share of the unit's by bytes. The agent is
//! recognised by its prompt's own opening words ([`Agent`]); what cannot be named
//! is called by its kind (`tool X`, `system text`), never a guess.

mod agent;
#[cfg(test)]
mod fixtures;
mod name;

use serde::Serialize;

use crate::prompt::Prompt;
use crate::provider::Usage;
use crate::provider::price::Cost;
pub(crate) use agent::Agent;
pub(crate) use name::{Named, anatomy};

/// Where a part of the prompt came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Family {
    /// The system prompt: the base prompt, appended text, the billing header.
    System,
    /// Tool definitions: built-in, MCP (by server), custom, deferred.
    Tools,
    /// Memory files (CLAUDE.md and the like), by path and scope.
    Memory,
    /// Context the agent adds: environment, git status, date.
    Context,
    /// Runtime `<system-reminder>` blocks other than context and memory.
    Reminders,
    /// The conversation: user prompts, assistant text, thinking, tool calls and results.
    Conversation,
}

impl Family {
    /// Every family, in prompt order.
    pub(crate) const ALL: [Family; 6] = [
        Family::System,
        Family::Tools,
        Family::Memory,
        Family::Context,
        Family::Reminders,
        Family::Conversation,
    ];

    /// The name used in tables and JSON.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Family::System => "system",
            Family::Tools => "tools",
            Family::Memory => "memory",
            Family::Context => "context",
            Family::Reminders => "reminders",
            Family::Conversation => "conversation",
        }
    }
}

/// One named part of a prompt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Part {
    pub family: Family,
    /// What it is: `built-in Bash`, `MCP server github`, `/repo/CLAUDE.md (project)`,
    /// `git status`, `tool result of Read`, …
    pub name: String,
    /// The unit it is (or is in).
    pub unit: String,
    /// Where it starts in the unit's normalised bytes (a section's place in its
    /// text; 0 for a whole unit): a changed byte's offset finds its part.
    pub at: usize,
    pub bytes: usize,
    /// Estimated tokens (the analysis' estimator).
    pub tokens: u64,
}

/// Cuts `prompt` into its cache units and names their parts: how many parts (the
/// `prompt` bench times it; `None` for a body that is no prompt).
pub fn classify(prompt: &Prompt) -> Option<usize> {
    let segs =
        super::segment::segment(prompt, &[super::segment::IgnoreRule::billing_header()]).ok()?;
    Some(anatomy(prompt, &segs).parts.len())
}

/// Cuts `prompt` into its cache units once and gives the naming alone, to call
/// again and again (the `prompt` bench times it; `None` for a body that is no
/// prompt). The closure gives how many parts it named.
pub fn naming(prompt: &Prompt) -> Option<impl Fn() -> usize + '_> {
    let segs =
        super::segment::segment(prompt, &[super::segment::IgnoreRule::billing_header()]).ok()?;
    Some(move || anatomy(prompt, &segs).parts.len())
}

/// Tokens per family, in [`Family::ALL`] order.
pub(crate) fn by_family(parts: &[Part]) -> Vec<(Family, u64)> {
    Family::ALL
        .iter()
        .map(|&f| {
            (
                f,
                parts
                    .iter()
                    .filter(|p| p.family == f)
                    .map(|p| p.tokens)
                    .sum(),
            )
        })
        .filter(|(_, t)| *t > 0)
        .collect()
}

/// How the provider billed one part's tokens in one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(crate) struct Billed {
    /// Its tokens by the provider's count: the estimate scaled so that the parts
    /// sum to the provider's whole input.
    pub tokens: u64,
    /// Of them, read from the cache, written to it, and sent uncached.
    pub read: u64,
    pub write: u64,
    pub uncached: u64,
    /// What they cost, at the rates the record was priced at (`None`: unpriced).
    pub usd: Option<f64>,
}

impl Billed {
    /// Whether the whole part was inside the cached prefix the provider read.
    pub(crate) fn cached(&self) -> bool {
        self.tokens > 0 && self.read == self.tokens
    }
}

/// How the provider billed each of `parts` (in cache order) given its `usage`: the
/// estimates scaled to its count (largest remainders, so they sum exactly), then,
/// walking the prompt in order, the first `cache_read_tokens` read, the next
/// `cache_write_tokens` written, the rest uncached (the cache is a prefix). `cost`,
/// the record's own pricing, gives each kind's rate.
pub(crate) fn bill(parts: &[Part], usage: &Usage, cost: Option<&Cost>) -> Vec<Billed> {
    let total: u64 = parts.iter().map(|p| p.tokens).sum();
    let input = usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens;
    let scaled = apportion(parts.iter().map(|p| p.tokens), total, input);
    let rate = |usd: f64, tokens: u64| {
        if tokens == 0 {
            0.0
        } else {
            usd / tokens as f64
        }
    };
    let rates = cost.map(|c| {
        (
            rate(c.read_usd, usage.cache_read_tokens),
            rate(c.write_usd, usage.cache_write_tokens),
            rate(c.input_usd - c.read_usd - c.write_usd, usage.input_tokens),
        )
    });
    let (mut read_left, mut write_left) = (usage.cache_read_tokens, usage.cache_write_tokens);
    scaled
        .into_iter()
        .map(|tokens| {
            let read = tokens.min(read_left);
            read_left -= read;
            let write = (tokens - read).min(write_left);
            write_left -= write;
            let uncached = tokens - read - write;
            Billed {
                tokens,
                read,
                write,
                uncached,
                usd: rates
                    .map(|(r, w, u)| r * read as f64 + w * write as f64 + u * uncached as f64),
            }
        })
        .collect()
}

/// `shares` (summing to `total`) scaled to sum to `to` exactly: each its floor, and
/// the units left over to the largest remainders.
fn apportion(shares: impl Iterator<Item = u64>, total: u64, to: u64) -> Vec<u64> {
    if total == 0 {
        return shares.map(|_| 0).collect();
    }
    let exact: Vec<(u64, u64)> = shares
        .map(|s| {
            let n = u128::from(s) * u128::from(to);
            let (q, r) = (n / u128::from(total), n % u128::from(total));
            (q as u64, r as u64)
        })
        .collect();
    let mut out: Vec<u64> = exact.iter().map(|(q, _)| *q).collect();
    let left = to.saturating_sub(out.iter().sum());
    let mut order: Vec<usize> = (0..exact.len()).collect();
    order.sort_by(|&a, &b| exact[b].1.cmp(&exact[a].1).then(a.cmp(&b)));
    for &i in order.iter().take(left as usize) {
        out[i] += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::segment::{IgnoreRule, segment};
    use crate::prompt::Format;

    fn parts(body: &str) -> Vec<Part> {
        let prompt = Prompt::read(
            bytes::Bytes::copy_from_slice(body.as_bytes()),
            Some(Format::AnthropicMessages),
        );
        let segs = segment(&prompt, &[IgnoreRule::billing_header()]).unwrap();
        let parts = anatomy(&prompt, &segs).parts;
        let total: u64 = segs.units.iter().map(|u| u64::from(u.tokens)).sum();
        assert_eq!(
            parts.iter().map(|p| p.tokens).sum::<u64>(),
            total,
            "the parts sum to the prompt"
        );
        parts
    }

    #[test]
    fn a_claude_code_prompt_is_named_part_by_part() {
        let reminder = "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n# claudeMd\nCodebase and user instructions are shown below.\n\nContents of /home/u/.claude/CLAUDE.md (user's private global instructions for all projects):\n\nBe brief.\n\nContents of /repo/CLAUDE.md (project instructions, checked into the codebase):\n\nUse tabs.\n\nContents of /repo/CLAUDE.local.md (user's private project instructions, not checked in):\n\nMy port is 3000.\n# currentDate\nToday's date is 2026-12-05.\n</system-reminder>\n";
        let body = serde_json::json!({
            "model": "claude-opus-5-5",
            "tools": [
                {"name": "Bash", "input_schema": {"type": "object"}},
                {"name": "mcp__github__create_issue", "input_schema": {"type": "object"}},
                {"name": "WebFetch", "defer_loading": true, "input_schema": {"type": "object"}},
                {"name": "deploy", "input_schema": {"type": "object"}}
            ],
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
                {"type": "text", "text": "You are Claude Code, Anthropic's official CLI."}
            ],
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": reminder},
                    {"type": "text", "text": "fix the build"}
                ]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "/repo/a.rs"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "fn main() {}"}
                ]}
            ]
        })
        .to_string();
        let parts = parts(&body);
        let names: Vec<(&str, &str)> = parts
            .iter()
            .map(|p| (p.family.name(), p.name.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                ("tools", "built-in Bash"),
                ("tools", "MCP server github"),
                ("tools", "built-in WebFetch (deferred)"),
                ("tools", "custom deploy"),
                ("system", "billing header"),
                ("system", "identity"),
                ("memory", "memory files"),
                ("memory", "/home/u/.claude/CLAUDE.md (user)"),
                ("memory", "/repo/CLAUDE.md (project)"),
                ("memory", "/repo/CLAUDE.local.md (local)"),
                ("context", "date"),
                ("conversation", "user prompt"),
                ("conversation", "thinking"),
                ("conversation", "tool call Read"),
                ("conversation", "tool result of Read"),
            ]
        );
        let families: Vec<&str> = by_family(&parts).iter().map(|(f, _)| f.name()).collect();
        assert_eq!(
            families,
            ["system", "tools", "memory", "context", "conversation"]
        );
    }

    #[test]
    fn parts_are_billed_in_cache_order_and_sum_to_the_providers_count() {
        let part = |tokens| Part {
            family: Family::System,
            name: String::new(),
            unit: String::new(),
            at: 0,
            bytes: 0,
            tokens,
        };
        let parts = [part(100), part(50), part(50)];
        // 300 by the provider's count: 150 read, 90 written, 60 uncached.
        let usage = Usage {
            input_tokens: 60,
            cache_read_tokens: 150,
            cache_write_tokens: 90,
            ..Usage::default()
        };
        let cost = Cost {
            read_usd: 0.15,
            write_usd: 0.9,
            input_usd: 0.15 + 0.9 + 0.6,
            ..Cost::default()
        };
        let billed = bill(&parts, &usage, Some(&cost));
        let tokens: Vec<u64> = billed.iter().map(|b| b.tokens).collect();
        assert_eq!(tokens, [150, 75, 75]);
        assert_eq!(
            (billed[0].read, billed[0].write, billed[0].uncached),
            (150, 0, 0)
        );
        assert!(billed[0].cached() && !billed[1].cached());
        assert_eq!(
            (billed[1].read, billed[1].write, billed[1].uncached),
            (0, 75, 0)
        );
        assert_eq!(
            (billed[2].read, billed[2].write, billed[2].uncached),
            (0, 15, 60)
        );
        let usd: f64 = billed.iter().filter_map(|b| b.usd).sum();
        assert!((usd - cost.input_usd).abs() < 1e-9, "{usd}");
        // Remainders go to the largest: 1/3 each of 100 sums to 100.
        assert_eq!(apportion([1, 1, 1].into_iter(), 3, 100), [34, 33, 33]);
        assert!(bill(&parts, &usage, None).iter().all(|b| b.usd.is_none()));
    }
}
