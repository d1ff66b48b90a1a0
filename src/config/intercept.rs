//! Which hosts forward-proxy mode intercepts, and which provider each one is.
//!
//! Entries are `PATTERN[=PROVIDER]`; `*` stands for one DNS label or part of one
//! (never a dot). A pattern must name at least a registrable-looking domain
//! (`*.openai.azure.com`, not `*.com` or `*`), so the list cannot be widened into
//! intercepting, and relaying, everything.

use crate::provider::Provider;

/// The hosts intercepted when none are configured: the two APIs, and the ChatGPT
/// backend a ChatGPT-login Codex sends its turns to (`/backend-api/codex/responses`).
pub(crate) const DEFAULT_INTERCEPT: &[&str] =
    &["api.anthropic.com", "api.openai.com", "chatgpt.com"];

/// One entry: a host pattern and the provider its traffic speaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InterceptRule {
    labels: Vec<String>,
    pub provider: Provider,
}

/// The ordered intercept list; the first matching entry wins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterceptList(Vec<InterceptRule>);

impl Default for InterceptList {
    fn default() -> Self {
        let entries: Vec<String> = DEFAULT_INTERCEPT.iter().map(|s| s.to_string()).collect();
        InterceptList::parse(&entries).expect("the default intercept list is valid")
    }
}

impl InterceptList {
    /// Parses `PATTERN[=anthropic|openai]` entries. The provider may be left out only
    /// for the providers' own API hosts.
    pub fn parse(entries: &[String]) -> Result<InterceptList, BadPattern> {
        entries
            .iter()
            .map(|e| InterceptRule::parse(e))
            .collect::<Result<_, _>>()
            .map(InterceptList)
    }

    /// The provider of `host` when it is intercepted.
    pub fn provider_for(&self, host: &str) -> Option<Provider> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let labels: Vec<&str> = host.split('.').collect();
        self.0
            .iter()
            .find(|rule| rule.matches(&labels))
            .map(|rule| rule.provider)
    }

    /// Whether nothing is intercepted.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The patterns, as written back (for messages and `env`).
    pub fn patterns(&self) -> Vec<String> {
        self.0.iter().map(|r| r.labels.join(".")).collect()
    }
}

/// Why an `--intercept` entry is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadPattern {
    #[error("{0:?}: unknown provider {1:?} (expected anthropic or openai)")]
    Provider(String, String),
    #[error("{0:?}: say which provider the host speaks, e.g. \"{1}=openai\"")]
    NoProvider(String, String),
    #[error(
        "{0:?} is not a host pattern (expected e.g. \"api.anthropic.com\" or \"*.openai.azure.com=openai\")"
    )]
    NotAHost(String),
    #[error(
        "{0:?} is too broad: a pattern must end in a fixed domain of at least two labels, e.g. \"*.example.com\""
    )]
    TooBroad(String),
}

impl InterceptRule {
    fn parse(entry: &str) -> Result<InterceptRule, BadPattern> {
        let (pattern, provider) = match entry.split_once('=') {
            Some((p, name)) => (p.trim(), Some(name.trim())),
            None => (entry.trim(), None),
        };
        let pattern = pattern.trim_end_matches('.').to_ascii_lowercase();
        let provider = match provider {
            Some("anthropic") => Provider::Anthropic,
            Some("openai") => Provider::OpenAi,
            Some(other) => {
                return Err(BadPattern::Provider(entry.to_owned(), other.to_owned()));
            }
            None => match pattern.as_str() {
                "api.anthropic.com" => Provider::Anthropic,
                "api.openai.com" | "chatgpt.com" => Provider::OpenAi,
                _ => {
                    return Err(BadPattern::NoProvider(entry.to_owned(), pattern));
                }
            },
        };
        let labels: Vec<String> = pattern.split('.').map(str::to_owned).collect();
        let valid_label = |l: &String| {
            !l.is_empty()
                && l.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '*')
        };
        if !labels.iter().all(valid_label) {
            return Err(BadPattern::NotAHost(entry.to_owned()));
        }
        let fixed_tail = labels.iter().rev().take_while(|l| !l.contains('*')).count();
        if fixed_tail < 2 {
            return Err(BadPattern::TooBroad(entry.to_owned()));
        }
        Ok(InterceptRule { labels, provider })
    }

    fn matches(&self, host: &[&str]) -> bool {
        host.len() == self.labels.len()
            && self
                .labels
                .iter()
                .zip(host)
                .all(|(pattern, label)| label_matches(pattern, label))
    }
}

/// `*` matches any run of characters inside one label.
fn label_matches(pattern: &str, label: &str) -> bool {
    let Some((head, rest)) = pattern.split_once('*') else {
        return pattern == label;
    };
    let Some(after) = label.strip_prefix(head) else {
        return false;
    };
    (0..=after.len())
        .filter(|&i| after.is_char_boundary(i))
        .any(|i| label_matches(rest, &after[i..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(entries: &[&str]) -> Result<InterceptList, BadPattern> {
        InterceptList::parse(&entries.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn hosts_match_by_label() {
        let l = list(&[
            "api.anthropic.com",
            "*.openai.azure.com=openai",
            "gw-*.corp.example=anthropic",
        ])
        .unwrap();
        assert_eq!(
            l.provider_for("API.Anthropic.com."),
            Some(Provider::Anthropic)
        );
        assert_eq!(
            l.provider_for("eastus.openai.azure.com"),
            Some(Provider::OpenAi)
        );
        assert_eq!(l.provider_for("a.b.openai.azure.com"), None);
        assert_eq!(
            l.provider_for("gw-7.corp.example"),
            Some(Provider::Anthropic)
        );
        assert_eq!(l.provider_for("gw.corp.example"), None);
        assert_eq!(l.provider_for("example.com"), None);
        assert_eq!(
            InterceptList::default().provider_for("api.openai.com"),
            Some(Provider::OpenAi)
        );
    }

    #[test]
    fn broad_or_unclear_patterns_are_refused() {
        for bad in [
            "*",
            "*.com",
            "api.*",
            "*.*",
            "x.example.com=gemini",
            "gw.example.com",
        ] {
            assert!(list(&[bad]).is_err(), "{bad} accepted");
        }
        let err = list(&["*.com=openai"]).unwrap_err();
        assert!(matches!(err, BadPattern::TooBroad(_)), "{err}");
    }
}
