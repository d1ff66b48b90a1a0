//! A setting's value as typed (a number, or text with a unit) and its parsers,
//! the error of a bad one, and the nearest known name to a misspelt one: the leaf
//! that `config` and each module's own settings (`capture`, `cache`, rules) share;
//! an upstream base URL, and where a byte offset sits in a file (line, column).

use std::fmt;
use std::time::Duration;

use http::Uri;
use http::uri::{Authority, PathAndQuery, Scheme};
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

/// Why a setting's value cannot be read: what it is not, and what it should look like.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    #[error("{0:?} is not a size (expected e.g. 33554432 or \"32MiB\")")]
    NotASize(String),
    #[error("{0:?}: unknown size unit {1:?} (use B, KB, KiB, MB, MiB, GB or GiB)")]
    SizeUnit(String, String),
    #[error("{0:?} is too large")]
    TooLarge(String),
    #[error("{0:?} is not a duration (expected e.g. 30 or \"10s\")")]
    NotADuration(String),
    #[error("{0:?}: unknown duration unit {1:?} (use ms, s, m, h or d)")]
    DurationUnit(String, String),
    /// An upstream URL (`shown` without its password: messages reach the terminal).
    #[error("{shown:?}{why}")]
    Url { shown: String, why: UrlProblem },
}

/// What is wrong with an upstream URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlProblem {
    #[error(" is not a URL: {0} (expected e.g. \"https://api.anthropic.com\")")]
    NotAUrl(String),
    #[error(" has no scheme (expected e.g. \"https://api.anthropic.com\")")]
    NoScheme,
    #[error(": the scheme must be http or https")]
    Scheme,
    #[error(" has no host")]
    NoHost,
    #[error(": credentials do not belong in the upstream URL")]
    Credentials,
    #[error(": an upstream URL takes no query string")]
    Query,
}

/// `1048576`, `"512KiB"`, `"32MiB"`, `"1GB"`: bytes.
pub(crate) fn parse_size(v: &Scalar) -> Result<u64, SettingError> {
    let text = match v {
        Scalar::Number(n) => return Ok(*n),
        Scalar::Text(t) => t.trim(),
    };
    let (number, unit) =
        number_and_unit(text).ok_or_else(|| SettingError::NotASize(text.to_owned()))?;
    let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        other => {
            return Err(SettingError::SizeUnit(text.to_owned(), other.to_owned()));
        }
    };
    number
        .checked_mul(factor)
        .ok_or_else(|| SettingError::TooLarge(text.to_owned()))
}

/// `30` (seconds), `"500ms"`, `"10s"`, `"5m"`, `"1h"`.
pub(crate) fn parse_duration(v: &Scalar) -> Result<Duration, SettingError> {
    let text = match v {
        Scalar::Number(n) => return Ok(Duration::from_secs(*n)),
        Scalar::Text(t) => t.trim(),
    };
    let (number, unit) =
        number_and_unit(text).ok_or_else(|| SettingError::NotADuration(text.to_owned()))?;
    Ok(match unit.trim() {
        "" | "s" => Duration::from_secs(number),
        "ms" => Duration::from_millis(number),
        "m" => Duration::from_secs(number * 60),
        "h" => Duration::from_secs(number * 3600),
        "d" => Duration::from_secs(number * 86_400),
        other => {
            return Err(SettingError::DurationUnit(
                text.to_owned(),
                other.to_owned(),
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

/// 1-based line and column (in characters) of a byte offset.
pub(crate) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// An upstream origin with an optional base path: `https://api.anthropic.com`,
/// `http://127.0.0.1:9000/prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    scheme: Scheme,
    authority: Authority,
    /// Without a trailing slash; empty for none.
    base_path: String,
}

impl BaseUrl {
    pub fn parse(text: &str) -> Result<BaseUrl, SettingError> {
        // Messages show the URL without its password: they reach the terminal and logs.
        let shown = crate::redact::url_without_password(text);
        let bad = |why| SettingError::Url {
            shown: shown.to_string(),
            why,
        };
        let uri: Uri = text
            .parse()
            .map_err(|e: http::uri::InvalidUri| bad(UrlProblem::NotAUrl(e.to_string())))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| bad(UrlProblem::NoScheme))?;
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(bad(UrlProblem::Scheme));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| bad(UrlProblem::NoHost))?;
        if authority.as_str().contains('@') {
            return Err(bad(UrlProblem::Credentials));
        }
        if uri.query().is_some() {
            return Err(bad(UrlProblem::Query));
        }
        Ok(BaseUrl {
            scheme,
            authority,
            base_path: uri.path().trim_end_matches('/').to_owned(),
        })
    }

    /// The upstream URI for a routed path and query.
    pub fn join(&self, path: &PathAndQuery) -> Result<Uri, http::Error> {
        let pq = if self.base_path.is_empty() {
            path.clone()
        } else {
            PathAndQuery::try_from(format!("{}{}", self.base_path, path.as_str()))?
        };
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
    }

    /// The host (and port, if given) requests go to.
    pub fn authority(&self) -> &str {
        self.authority.as_str()
    }

    /// The host and the port connections go to (the scheme's when none is given).
    pub fn host_port(&self) -> (&str, u16) {
        let default = if self.scheme == Scheme::HTTPS {
            443
        } else {
            80
        };
        (
            self.authority.host(),
            self.authority.port_u16().unwrap_or(default),
        )
    }
}

impl fmt::Display for BaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}{}", self.scheme, self.authority, self.base_path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_join_paths() {
        let b = BaseUrl::parse("http://127.0.0.1:9000/").unwrap();
        let p = PathAndQuery::from_static("/v1/messages?beta=true");
        assert_eq!(
            b.join(&p).unwrap().to_string(),
            "http://127.0.0.1:9000/v1/messages?beta=true"
        );
        let b = BaseUrl::parse("https://gw.example/anthropic").unwrap();
        assert_eq!(
            b.join(&p).unwrap().to_string(),
            "https://gw.example/anthropic/v1/messages?beta=true"
        );
        assert!(BaseUrl::parse("ftp://x").is_err());
        assert!(BaseUrl::parse("api.anthropic.com").is_err());
        assert!(BaseUrl::parse("https://user:pw@x").is_err());
    }
}
