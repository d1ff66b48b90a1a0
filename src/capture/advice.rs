//! Advice with numbers, read off a prompt's anatomy: a large memory file, an MCP
//! server whose tool schemas weigh on every request, a part that changes inside
//! the cached prefix (with what its misses lost), a tool result resent every turn.
//! Each names the part, its tokens, its share of the input and its dollars; none
//! is given without the numbers that call for it.

use serde::Serialize;

use super::anatomy::{Anatomy, BilledPart};
use crate::cache::anatomy::Family;
use crate::cache::explain::kilo;

/// A memory file is called large from this many tokens (about 8 KB of text), or
/// from [`LARGE_SHARE`] of the input: it is sent whole with every request.
const LARGE_MEMORY_TOKENS: u64 = 2_000;
/// An MCP server's tools are called heavy from this many tokens.
const HEAVY_MCP_TOKENS: u64 = 5_000;
/// Or from this share of the input (either part).
const LARGE_SHARE: f64 = 0.10;
/// A tool result is worth a word when it is this large and sent in this many
/// turns: each later turn pays for it again (as a cache read at best).
const RESENT_TOKENS: u64 = 2_000;
const RESENT_TURNS: u32 = 3;

/// One piece of advice.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Advice {
    /// `large_memory_file`, `heavy_mcp_server`, `changes_inside_prefix` or
    /// `resent_tool_result`.
    pub kind: &'static str,
    /// The part (or MCP server) it is about.
    pub part: String,
    /// Its tokens in one request (the latest), by the provider's count where given.
    pub tokens: u64,
    /// Its share of that request's input.
    pub share: f64,
    /// What it cost: in the request, or summed over a conversation's turns (for a
    /// change inside the prefix: what its misses lost).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usd: Option<f64>,
    /// Over a conversation: the turns it was in (or, for a change, changed in).
    pub turns: u32,
    /// The advice, with its numbers.
    pub text: String,
}

fn tokens(p: &BilledPart) -> u64 {
    p.billed.map_or(p.part.tokens, |b| b.tokens)
}

fn input(a: &Anatomy) -> u64 {
    a.provider_input_tokens.unwrap_or(a.estimated_tokens).max(1)
}

fn money(usd: Option<f64>) -> String {
    usd.map_or(String::new(), |u| format!(", ${u:.4}"))
}

/// Advice on one request: its large memory files and heavy MCP servers.
pub(crate) fn request(a: &Anatomy) -> Vec<Advice> {
    let total = input(a);
    let mut out = Vec::new();
    for p in &a.parts {
        // A file's part is `PATH (scope)`; the `memory files` heading is not one.
        let file = p.part.family == Family::Memory && p.part.name.ends_with(')');
        let t = tokens(p);
        let share = t as f64 / total as f64;
        if file && (t >= LARGE_MEMORY_TOKENS || share >= LARGE_SHARE) {
            let usd = p.billed.and_then(|b| b.usd);
            out.push(Advice {
                kind: "large_memory_file",
                part: p.part.name.clone(),
                tokens: t,
                share,
                usd,
                turns: 1,
                text: format!(
                    "{} is {} tokens ({:.0} % of the input{}), sent whole with every request: \
                     keep what every turn needs there and move the rest to files it names, read when needed",
                    p.part.name,
                    kilo(t),
                    share * 100.0,
                    money(usd)
                ),
            });
        }
    }
    // MCP servers: their tools summed (deferred ones are not loaded until searched).
    let mut servers: Vec<(String, u64, u32, Option<f64>)> = Vec::new();
    for p in &a.parts {
        let Some(server) = p.part.name.strip_prefix("MCP server ") else {
            continue;
        };
        if p.part.family != Family::Tools || server.ends_with("(deferred)") {
            continue;
        }
        let usd = p.billed.and_then(|b| b.usd);
        match servers.iter_mut().find(|s| s.0 == server) {
            Some(s) => {
                s.1 += tokens(p);
                s.2 += 1;
                s.3 = s.3.zip(usd).map(|(a, b)| a + b);
            }
            None => servers.push((server.to_owned(), tokens(p), 1, usd)),
        }
    }
    for (server, t, tools, usd) in servers {
        let share = t as f64 / total as f64;
        if t >= HEAVY_MCP_TOKENS || share >= LARGE_SHARE {
            out.push(Advice {
                kind: "heavy_mcp_server",
                part: format!("MCP server {server}"),
                tokens: t,
                share,
                usd,
                turns: 1,
                text: format!(
                    "MCP server {server}: {tools} tool(s), {} tokens of schemas ({:.0} % of the input{}) in every request: \
                     defer its tools (tool search) or leave the server out where it is not used",
                    kilo(t),
                    share * 100.0,
                    money(usd)
                ),
            });
        }
    }
    out
}

/// Adds `new` to `out`, or folds it into the advice of the same kind and part
/// there: one more turn, dollars summed, the latest numbers and words.
fn fold(out: &mut Vec<Advice>, new: Advice) {
    match out
        .iter_mut()
        .find(|o| o.kind == new.kind && o.part == new.part)
    {
        Some(o) => {
            o.usd = o.usd.zip(new.usd).map(|(x, y)| x + y);
            o.turns += 1;
            (o.tokens, o.share, o.text) = (new.tokens, new.share, new.text);
        }
        None => out.push(new),
    }
}

/// One part's advice in one turn, its words given later.
fn of_part(kind: &'static str, a: &Anatomy, p: &BilledPart, usd: Option<f64>) -> Advice {
    Advice {
        kind,
        part: format!("{} ({})", p.part.name, p.part.unit),
        tokens: tokens(p),
        share: tokens(p) as f64 / input(a) as f64,
        usd,
        turns: 1,
        text: String::new(),
    }
}

/// Advice over a conversation's turns (their anatomies, oldest first, and each
/// turn's part whose change made it miss, with what the miss lost).
pub(crate) fn conversation(turns: &[(Anatomy, Option<(usize, f64)>)]) -> Vec<Advice> {
    let mut out: Vec<Advice> = Vec::new();
    // The per-request advice, once per part: the latest numbers, dollars summed.
    for (a, _) in turns {
        for advice in request(a) {
            fold(&mut out, advice);
        }
    }
    for o in &mut out {
        if o.turns > 1 {
            o.text = format!(
                "{} (in {} turns{})",
                o.text,
                o.turns,
                o.usd.map_or(String::new(), |u| format!(
                    ": ${u:.4} over the conversation"
                ))
            );
        }
    }
    out.extend(changes(turns));
    out.extend(resent(turns));
    out
}

/// Parts whose change inside the cached prefix made turns miss.
fn changes(turns: &[(Anatomy, Option<(usize, f64)>)]) -> Vec<Advice> {
    let mut out: Vec<Advice> = Vec::new();
    for (a, missed) in turns {
        let Some((at, lost)) = missed else { continue };
        if let Some(p) = a.parts.get(*at) {
            fold(
                &mut out,
                of_part("changes_inside_prefix", a, p, Some(*lost)),
            );
        }
    }
    for o in &mut out {
        // The date and the working directory have a shipped rule that moves them.
        let fix = if o.part.starts_with("date ") || o.part.starts_with("working directory ") {
            "move it after the last breakpoint: rules/examples/50-move-dates.toml does that"
        } else {
            "keep what changes after the last breakpoint (a rule can move it into the newest message)"
        };
        o.text = format!(
            "{} changed inside the cached prefix in {} turn(s), and the misses lost ${:.4}: {fix}",
            o.part,
            o.turns,
            o.usd.unwrap_or(0.0)
        );
    }
    out
}

/// Large tool results sent again in many turns.
fn resent(turns: &[(Anatomy, Option<(usize, f64)>)]) -> Vec<Advice> {
    // By the unit they are: a conversation only appends, so a result keeps its place.
    let mut out: Vec<Advice> = Vec::new();
    for (a, _) in turns {
        for p in &a.parts {
            if p.part.name.starts_with("tool result of ") {
                let usd = p.billed.and_then(|b| b.usd);
                fold(&mut out, of_part("resent_tool_result", a, p, usd));
            }
        }
    }
    out.retain(|o| o.tokens >= RESENT_TOKENS && o.turns >= RESENT_TURNS);
    for o in &mut out {
        o.text = format!(
            "{} is {} tokens and was sent in {} turns ({} tokens in all{}): \
             a narrower read or a filtered command makes every later turn cheaper",
            o.part,
            kilo(o.tokens),
            o.turns,
            kilo(o.tokens * u64::from(o.turns)),
            o.usd.map_or(String::new(), |u| format!(
                ", ${u:.4} over the conversation"
            ))
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::anatomy::{Billed, Part};

    fn part(family: Family, name: &str, unit: &str, tokens: u64, usd: f64) -> BilledPart {
        BilledPart {
            part: Part {
                family,
                name: name.into(),
                unit: unit.into(),
                at: 0,
                bytes: 0,
                tokens,
            },
            billed: Some(Billed {
                tokens,
                uncached: tokens,
                usd: Some(usd),
                ..Billed::default()
            }),
            cached: false,
        }
    }

    fn anatomy(parts: Vec<BilledPart>) -> Anatomy {
        let total = parts.iter().map(|p| p.part.tokens).sum();
        Anatomy {
            id: "r".into(),
            agent: "Claude Code".into(),
            estimated_tokens: total,
            provider_input_tokens: Some(total),
            input_usd: None,
            families: Vec::new(),
            parts,
            advice: Vec::new(),
        }
    }

    #[test]
    fn large_memory_files_and_heavy_mcp_servers_are_named_with_their_numbers() {
        let a = anatomy(vec![
            part(Family::Tools, "MCP server github", "tools[0]", 3_000, 0.03),
            part(Family::Tools, "MCP server github", "tools[1]", 3_000, 0.03),
            part(
                Family::Tools,
                "MCP server jira (deferred)",
                "tools[2]",
                9_000,
                0.09,
            ),
            part(Family::Tools, "MCP server small", "tools[3]", 100, 0.001),
            part(
                Family::Memory,
                "memory files",
                "messages[0].content[0]",
                50,
                0.0,
            ),
            part(
                Family::Memory,
                "/repo/CLAUDE.md (project)",
                "messages[0].content[0]",
                2_500,
                0.025,
            ),
            part(
                Family::Memory,
                "/home/u/.claude/CLAUDE.md (user)",
                "messages[0].content[0]",
                300,
                0.003,
            ),
            part(
                Family::Conversation,
                "user prompt",
                "messages[0].content[1]",
                2_050,
                0.02,
            ),
        ]);
        let advice = request(&a);
        let kinds: Vec<(&str, &str)> = advice.iter().map(|a| (a.kind, a.part.as_str())).collect();
        assert_eq!(
            kinds,
            [
                ("large_memory_file", "/repo/CLAUDE.md (project)"),
                ("heavy_mcp_server", "MCP server github"),
            ]
        );
        let github = &advice[1];
        assert_eq!(github.tokens, 6_000);
        assert!((github.share - 0.3).abs() < 1e-9, "{}", github.share);
        assert!((github.usd.unwrap() - 0.06).abs() < 1e-9);
        assert!(
            github.text.contains("2 tool(s), 6.0k tokens"),
            "{}",
            github.text
        );
        assert!(github.text.contains("30 % of the input"), "{}", github.text);
    }

    #[test]
    fn over_a_conversation_changes_and_resent_results_are_counted() {
        let turn = |result_turns: usize| {
            let mut parts = vec![
                part(Family::System, "base prompt", "system[2]", 5_000, 0.01),
                part(Family::Context, "date", "system[2]", 20, 0.0),
            ];
            for i in 0..result_turns {
                parts.push(part(
                    Family::Conversation,
                    "tool result of Read",
                    &format!("messages[{}].content[0]", 2 * i + 1),
                    3_000,
                    0.003,
                ));
            }
            anatomy(parts)
        };
        // Three turns; the second and third missed on the date (index 1).
        let turns = vec![
            (turn(1), None),
            (turn(2), Some((1, 0.05))),
            (turn(3), Some((1, 0.07))),
        ];
        let advice = conversation(&turns);
        let change = advice
            .iter()
            .find(|a| a.kind == "changes_inside_prefix")
            .expect("the date's change");
        assert_eq!(change.part, "date (system[2])");
        assert_eq!(change.turns, 2);
        assert!((change.usd.unwrap() - 0.12).abs() < 1e-9);
        assert!(
            change.text.contains("50-move-dates.toml"),
            "{}",
            change.text
        );
        let resent: Vec<&Advice> = advice
            .iter()
            .filter(|a| a.kind == "resent_tool_result")
            .collect();
        // Only the first result was in three turns.
        assert_eq!(resent.len(), 1, "{advice:?}");
        assert_eq!(
            resent[0].part,
            "tool result of Read (messages[1].content[0])"
        );
        assert_eq!(resent[0].turns, 3);
        assert!(
            resent[0].text.contains("9.0k tokens in all"),
            "{}",
            resent[0].text
        );
    }
}
