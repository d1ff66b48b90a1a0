//! Token usage, normalised across providers.

use std::borrow::Cow;
use std::marker::PhantomData;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
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
        AnthropicUsage::from_value(u).usage()
    }

    /// Merges an Anthropic `usage` object over this one, the SDK's way: present
    /// fields replace (message_delta usage is cumulative), absent ones stay.
    pub fn merge_anthropic(&mut self, u: &Value) {
        AnthropicUsage::from_value(u).merge_into(self);
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

/// An Anthropic `usage` object as read, straight from a body without a `Value` (on a
/// 20 KB exchange the `Value` was 12k of the answer's 23k instructions), as leniently
/// as `Value::as_u64` reads it: a count that is not a non-negative integer is absent,
/// a `usage` or `cache_creation` that is not an object is empty, and a repeated
/// key's last value wins.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AnthropicUsage {
    input: Option<u64>,
    output: Option<u64>,
    cache_read: Option<u64>,
    cache_write: Option<u64>,
    split: CacheSplit,
}

/// `cache_creation`: the cache writes by ttl, if it is an object.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct CacheSplit {
    object: bool,
    five_minutes: Option<u64>,
    one_hour: Option<u64>,
}

impl AnthropicUsage {
    /// Reads one from a `Value` (a stream event already parsed).
    pub(crate) fn from_value(v: &Value) -> AnthropicUsage {
        AnthropicUsage::deserialize(v).unwrap_or_default()
    }

    /// The counts it gives.
    pub(crate) fn usage(&self) -> Usage {
        let mut usage = Usage::default();
        self.merge_into(&mut usage);
        usage
    }

    /// Its counts over `usage`'s: present ones replace, absent ones stay.
    pub(crate) fn merge_into(&self, usage: &mut Usage) {
        let replace = |to: &mut u64, from: Option<u64>| {
            if let Some(n) = from {
                *to = n;
            }
        };
        replace(&mut usage.input_tokens, self.input);
        replace(&mut usage.output_tokens, self.output);
        replace(&mut usage.cache_read_tokens, self.cache_read);
        replace(&mut usage.cache_write_tokens, self.cache_write);
        if self.split.object {
            usage.cache_write_5m_tokens = self.split.five_minutes;
            usage.cache_write_1h_tokens = self.split.one_hour;
        }
    }
}

/// What a lenient read makes of a JSON value: a non-negative integer or an object
/// where it takes one; anything else is skipped and reads as the default.
trait Lenient: Default {
    fn unsigned(_n: u64) -> Self {
        Self::default()
    }

    fn object<'de, A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Self::default())
    }
}

/// Reads an object entry by entry.
trait FromEntries: Default {
    /// It was an object (even an empty one).
    fn opened(&mut self) {}
    fn entry<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error>;

    fn read_entries<'de, A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        let mut out = Self::default();
        out.opened();
        while let Some(key) = map.next_key::<Key<'de>>()? {
            out.entry(&key.0, &mut map)?;
        }
        Ok(out)
    }
}

impl<T: FromEntries> Lenient for T {
    fn object<'de, A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        Self::read_entries(map)
    }
}

impl FromEntries for AnthropicUsage {
    fn entry<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "input_tokens" => self.input = map.next_value::<Read<Count>>()?.0.0,
            "output_tokens" => self.output = map.next_value::<Read<Count>>()?.0.0,
            "cache_read_input_tokens" => self.cache_read = map.next_value::<Read<Count>>()?.0.0,
            "cache_creation_input_tokens" => {
                self.cache_write = map.next_value::<Read<Count>>()?.0.0
            }
            "cache_creation" => self.split = map.next_value::<Read<CacheSplit>>()?.0,
            _ => {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

impl FromEntries for CacheSplit {
    fn opened(&mut self) {
        self.object = true;
    }

    fn entry<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "ephemeral_5m_input_tokens" => self.five_minutes = map.next_value::<Read<Count>>()?.0.0,
            "ephemeral_1h_input_tokens" => self.one_hour = map.next_value::<Read<Count>>()?.0.0,
            _ => {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// A token count as `Value::as_u64` reads it.
#[derive(Default)]
struct Count(Option<u64>);

impl Lenient for Count {
    fn unsigned(n: u64) -> Self {
        Count(Some(n))
    }
}

impl<'de> Deserialize<'de> for AnthropicUsage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Read::<AnthropicUsage>::deserialize(d)?.0)
    }
}

/// A [`Lenient`] value read from any JSON value.
struct Read<T>(T);

impl<'de, T: Lenient> Deserialize<'de> for Read<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(LenientVisitor(PhantomData))
    }
}

struct LenientVisitor<T>(PhantomData<T>);

impl<'de, T: Lenient> Visitor<'de> for LenientVisitor<T> {
    type Value = Read<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_u64<E>(self, n: u64) -> Result<Read<T>, E> {
        Ok(Read(T::unsigned(n)))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Read<T>, E> {
        Ok(Read(u64::try_from(n).map(T::unsigned).unwrap_or_default()))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Read<T>, E> {
        Ok(Read(T::default()))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Read<T>, E> {
        Ok(Read(T::default()))
    }

    fn visit_str<E>(self, _: &str) -> Result<Read<T>, E> {
        Ok(Read(T::default()))
    }

    fn visit_unit<E>(self) -> Result<Read<T>, E> {
        Ok(Read(T::default()))
    }

    fn visit_none<E>(self) -> Result<Read<T>, E> {
        Ok(Read(T::default()))
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Read<T>, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Read<T>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Read(T::default()))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Read<T>, A::Error> {
        T::object(map).map(Read)
    }
}

/// An object key, borrowed from the body unless it had escapes.
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a key")
            }

            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(s)))
            }

            fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// How usage was read before [`AnthropicUsage`]: from a `Value`, with `as_u64`.
    fn merged_from_value(mut usage: Usage, u: &Value) -> Usage {
        if let Some(n) = count(u, "input_tokens") {
            usage.input_tokens = n;
        }
        if let Some(n) = count(u, "output_tokens") {
            usage.output_tokens = n;
        }
        if let Some(n) = count(u, "cache_read_input_tokens") {
            usage.cache_read_tokens = n;
        }
        if let Some(n) = count(u, "cache_creation_input_tokens") {
            usage.cache_write_tokens = n;
        }
        if let Some(split) = u.get("cache_creation").filter(|v| v.is_object()) {
            usage.cache_write_5m_tokens = count(split, "ephemeral_5m_input_tokens");
            usage.cache_write_1h_tokens = count(split, "ephemeral_1h_input_tokens");
        }
        usage
    }

    #[test]
    fn usage_read_from_the_body_is_what_a_value_gives() {
        let before = Usage {
            input_tokens: 1,
            output_tokens: 2,
            cache_read_tokens: 3,
            cache_write_tokens: 4,
            cache_write_5m_tokens: Some(5),
            cache_write_1h_tokens: Some(6),
            reasoning_tokens: None,
        };
        let cases = [
            r#"{"input_tokens":21,"cache_creation_input_tokens":188086,"cache_read_input_tokens":0,"cache_creation":{"ephemeral_5m_input_tokens":188086,"ephemeral_1h_input_tokens":0},"output_tokens":393,"service_tier":"standard","server_tool_use":{"web_search_requests":1}}"#,
            r#"{"output_tokens":89}"#,
            r#"{}"#,
            r#"{"input_tokens":-3,"output_tokens":1.5,"cache_read_input_tokens":"7","cache_creation_input_tokens":null}"#,
            r#"{"input_tokens":18446744073709551615,"output_tokens":18446744073709551616}"#,
            r#"{"input_tokens":[1],"output_tokens":{"n":2},"cache_creation":[]}"#,
            r#"{"cache_creation":{}}"#,
            r#"{"cache_creation":null}"#,
            r#"{"cache_creation":{"ephemeral_5m_input_tokens":true,"other":{"x":[1,2]}}}"#,
            r#"{"input_tokens":1,"input_tokens":2,"cache_creation":{"ephemeral_1h_input_tokens":9},"cache_creation":7}"#,
            r#"{"in\u0070ut_tokens":44,"output_tokens":0}"#,
            r#"5"#,
            r#""text""#,
            r#"[{"input_tokens":1}]"#,
            r#"null"#,
        ];
        for case in cases {
            let value: Value = serde_json::from_str(case).unwrap();
            let expected = merged_from_value(before, &value);
            let read: AnthropicUsage = serde_json::from_str(case).unwrap();
            let mut from_body = before;
            read.merge_into(&mut from_body);
            assert_eq!(from_body, expected, "{case}");
            let mut from_value = before;
            from_value.merge_anthropic(&value);
            assert_eq!(from_value, expected, "{case}");
        }
    }

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
