//! A setting's value as typed (a number, or text with a unit) and its parsers,
//! the error of a bad one, and the nearest known name to a misspelt one: the leaf
//! that `config` and each module's own settings (`capture`, `cache`, rules) share.

use std::time::Duration;

use serde::Deserialize;

/// Errors in the configuration: read by people, never on the request path.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{location}: {message}")]
    Parse { location: String, message: String },
    #[error("{setting}: {message}")]
    Invalid {
        setting: &'static str,
        message: String,
    },
}

/// A size or duration: a bare number or text with a unit (`"32MiB"`, `"10s"`).
#[derive(Debug, Clone)]
pub enum Scalar {
    Number(u64),
    Text(String),
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Expect;
        impl serde::de::Visitor<'_> for Expect {
            type Value = Scalar;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "a size such as \"64MiB\", a duration such as \"30s\", or a whole number",
                )
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar::Number(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Scalar, E> {
                u64::try_from(v)
                    .map(Scalar::Number)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar::Text(v.to_owned()))
            }
        }
        d.deserialize_any(Expect)
    }
}

impl From<String> for Scalar {
    fn from(s: String) -> Self {
        Scalar::Text(s)
    }
}

/// `"32MiB"` → (32, "MiB"): the leading digits and what follows them.
fn number_and_unit(text: &str) -> Option<(u64, &str)> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    Some((number.parse().ok()?, unit))
}

/// `1048576`, `"512KiB"`, `"32MiB"`, `"1GB"`: bytes.
pub fn parse_size(v: &Scalar) -> Result<u64, String> {
    let text = match v {
        Scalar::Number(n) => return Ok(*n),
        Scalar::Text(t) => t.trim(),
    };
    let (number, unit) = number_and_unit(text)
        .ok_or_else(|| format!("{text:?} is not a size (expected e.g. 33554432 or \"32MiB\")"))?;
    let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "{text:?}: unknown size unit {other:?} (use B, KB, KiB, MB, MiB, GB or GiB)"
            ));
        }
    };
    number
        .checked_mul(factor)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// `30` (seconds), `"500ms"`, `"10s"`, `"5m"`, `"1h"`.
pub fn parse_duration(v: &Scalar) -> Result<Duration, String> {
    let text = match v {
        Scalar::Number(n) => return Ok(Duration::from_secs(*n)),
        Scalar::Text(t) => t.trim(),
    };
    let (number, unit) = number_and_unit(text)
        .ok_or_else(|| format!("{text:?} is not a duration (expected e.g. 30 or \"10s\")"))?;
    Ok(match unit.trim() {
        "" | "s" => Duration::from_secs(number),
        "ms" => Duration::from_millis(number),
        "m" => Duration::from_secs(number * 60),
        "h" => Duration::from_secs(number * 3600),
        "d" => Duration::from_secs(number * 86_400),
        other => {
            return Err(format!(
                "{text:?}: unknown duration unit {other:?} (use ms, s, m, h or d)"
            ));
        }
    })
}

/// The known name closest to `name`, if it is close enough to be a likely typo.
pub(crate) fn nearest<'k>(name: &str, known: &[&'k str]) -> Option<&'k str> {
    known
        .iter()
        .map(|k| (distance(name, k), *k))
        .filter(|(d, k)| *d <= (k.len().max(name.len()) / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// Levenshtein distance over chars.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}
