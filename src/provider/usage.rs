//! Token usage, normalised across providers.

use serde::Serialize;
use serde_json::Value;

/// Token counts for one exchange.
///
/// `input_tokens` follows Anthropic's meaning — input neither read from nor written to
/// the cache — so the four input fields add up to the whole prompt for both providers
/// (OpenAI's `prompt_tokens` includes cached tokens; it is split here).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Usage {
    /// Input tokens neither read from nor written to the cache.
    pub input_tokens: u64,
    /// Output tokens (thinking/reasoning included).
    pub output_tokens: u64,
    /// Input tokens read from the prompt cache.
    pub cache_read_tokens: u64,
    /// Input tokens written to the prompt cache.
    pub cache_write_tokens: u64,
    /// Of the cache writes, those with a 5-minute ttl (Anthropic `cache_creation`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_write_5m_tokens: Option<u64>,
    /// Of the cache writes, those with a 1-hour ttl.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_write_1h_tokens: Option<u64>,
    /// Reasoning tokens, where the provider reports them separately.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
}

impl Usage {
    /// The whole prompt: uncached + cache read + cache write.
    pub fn total_input(&self) -> u64 {
        self.input_tokens + self.cache_read_tokens + self.cache_write_tokens
    }

    /// Reads an Anthropic `usage` object (message, message_start or message_delta).
    pub fn from_anthropic(u: &Value) -> Usage {
        let mut usage = Usage::default();
        usage.merge_anthropic(u);
        usage
    }

    /// Merges an Anthropic `usage` object over this one, the SDK's way: present
    /// fields replace (message_delta usage is cumulative), absent ones stay.
    pub fn merge_anthropic(&mut self, u: &Value) {
        if let Some(n) = count(u, "input_tokens") {
            self.input_tokens = n;
        }
        if let Some(n) = count(u, "output_tokens") {
            self.output_tokens = n;
        }
        if let Some(n) = count(u, "cache_read_input_tokens") {
            self.cache_read_tokens = n;
        }
        if let Some(n) = count(u, "cache_creation_input_tokens") {
            self.cache_write_tokens = n;
        }
        if let Some(split) = u.get("cache_creation").filter(|v| v.is_object()) {
            self.cache_write_5m_tokens = count(split, "ephemeral_5m_input_tokens");
            self.cache_write_1h_tokens = count(split, "ephemeral_1h_input_tokens");
        }
    }

    /// Reads an OpenAI Chat Completions `usage` object.
    pub fn from_openai_chat(u: &Value) -> Usage {
        Self::from_openai(u, "prompt", "completion")
    }

    /// Reads an OpenAI Responses `usage` object.
    pub fn from_openai_responses(u: &Value) -> Usage {
        Self::from_openai(u, "input", "output")
    }

    /// Both OpenAI shapes: `{input}_tokens`, `{input}_tokens_details`, and likewise
    /// output. OpenAI's prompt count includes the cached and written tokens.
    fn from_openai(u: &Value, input: &str, output: &str) -> Usage {
        let details = u.get(format!("{input}_tokens_details"));
        let cached = details.and_then(|d| count(d, "cached_tokens")).unwrap_or(0);
        let written = details
            .and_then(|d| count(d, "cache_write_tokens"))
            .unwrap_or(0);
        let prompt = count(u, &format!("{input}_tokens")).unwrap_or(0);
        Usage {
            input_tokens: prompt.saturating_sub(cached).saturating_sub(written),
            output_tokens: count(u, &format!("{output}_tokens")).unwrap_or(0),
            cache_read_tokens: cached,
            cache_write_tokens: written,
            cache_write_5m_tokens: None,
            cache_write_1h_tokens: None,
            reasoning_tokens: u
                .get(format!("{output}_tokens_details"))
                .and_then(|d| count(d, "reasoning_tokens")),
        }
    }
}

fn count(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn anthropic_usage_with_split() {
        let u = Usage::from_anthropic(&json!({
            "input_tokens": 21, "cache_creation_input_tokens": 188086, "cache_read_input_tokens": 0,
            "cache_creation": {"ephemeral_5m_input_tokens": 188086, "ephemeral_1h_input_tokens": 0},
            "output_tokens": 393, "service_tier": "standard"
        }));
        assert_eq!(u.input_tokens, 21);
        assert_eq!(u.cache_write_tokens, 188086);
        assert_eq!(u.cache_write_5m_tokens, Some(188086));
        assert_eq!(u.cache_write_1h_tokens, Some(0));
        assert_eq!(u.output_tokens, 393);
        assert_eq!(u.total_input(), 188107);
    }

    #[test]
    fn anthropic_delta_overwrites_only_present_fields() {
        let mut u = Usage::from_anthropic(&json!({
            "input_tokens": 472, "cache_read_input_tokens": 5120, "cache_creation_input_tokens": 0,
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
            "output_tokens": 2
        }));
        u.merge_anthropic(&json!({"output_tokens": 89}));
        assert_eq!(
            (u.input_tokens, u.cache_read_tokens, u.output_tokens),
            (472, 5120, 89)
        );
        u.merge_anthropic(&json!({"output_tokens": 90, "cache_read_input_tokens": null}));
        assert_eq!(u.cache_read_tokens, 5120);
    }

    #[test]
    fn openai_prompt_tokens_are_split() {
        let u = Usage::from_openai_chat(&json!({
            "prompt_tokens": 2048, "completion_tokens": 12, "total_tokens": 2060,
            "prompt_tokens_details": {"cached_tokens": 1920, "cache_write_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 4}
        }));
        assert_eq!(
            (
                u.input_tokens,
                u.cache_read_tokens,
                u.output_tokens,
                u.reasoning_tokens
            ),
            (128, 1920, 12, Some(4))
        );
        let r = Usage::from_openai_responses(&json!({
            "input_tokens": 100, "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 16},
            "output_tokens": 7, "total_tokens": 107
        }));
        assert_eq!(
            (r.input_tokens, r.cache_read_tokens, r.cache_write_tokens),
            (20, 64, 16)
        );
        assert_eq!(r.total_input(), 100);
    }
}
