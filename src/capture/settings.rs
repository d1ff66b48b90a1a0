//! The `[capture]` settings: where records go, how long they stay, what else is
//! secret, and what happens when the store cannot keep up.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::store::{Retention, StoreLocation};
use crate::redact::Redactor;
use crate::setting::{ConfigError, Scalar, parse_duration, parse_size};

/// Raw `[capture]` settings, from the config file or flags.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaptureLayer {
    pub enabled: Option<bool>,
    pub dir: Option<PathBuf>,
    /// A PostgreSQL store instead of a directory (`postgres://user@host/db`).
    pub url: Option<String>,
    /// Where records wait while a PostgreSQL store is away (a SQLite store).
    pub spool_dir: Option<PathBuf>,
    pub spool_max_size: Option<Scalar>,
    pub required: Option<bool>,
    pub max_age: Option<Scalar>,
    pub max_size: Option<Scalar>,
    pub queue: Option<u64>,
    pub queue_bytes: Option<Scalar>,
    pub queue_wait: Option<Scalar>,
    pub max_response: Option<Scalar>,
    pub secret_headers: Option<Vec<String>>,
    pub redact: Option<Vec<RedactPattern>>,
}

/// An extra redaction pattern: a regex (kind `custom`), or `{ kind, pattern }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RedactPattern {
    Plain(String),
    Named { kind: String, pattern: String },
}

/// The validated capture settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureSettings {
    /// Off with `--no-capture` or `enabled = false`.
    pub enabled: bool,
    /// Where the store is: a directory (SQLite's `promptgate.db` in it) or a
    /// PostgreSQL URL.
    pub store: StoreLocation,
    /// With a PostgreSQL store: the local SQLite store records wait in while it is
    /// unreachable, and the most it may hold.
    pub spool_dir: PathBuf,
    pub spool_max_size: u64,
    /// Refuse requests (503) rather than let one go unrecorded.
    pub required: bool,
    pub retention: Retention,
    /// Records the queue to the store holds before the proxy waits.
    pub queue: usize,
    /// Body bytes the queue holds before the proxy waits.
    pub queue_bytes: u64,
    /// How long the proxy waits for room in a full queue before it drops (or refuses).
    pub queue_wait: Duration,
    /// The most of one response body kept (decoded) for the record; the rest is counted.
    pub max_response: u64,
    /// More header names whose values are credentials.
    pub secret_headers: Vec<String>,
    /// More redaction patterns: (kind, regex).
    pub redact: Vec<(String, String)>,
}

impl Default for CaptureSettings {
    fn default() -> Self {
        CaptureSettings {
            enabled: true,
            store: StoreLocation::Dir(crate::runtime::data_dir().join("captures")),
            spool_dir: crate::runtime::data_dir().join("spool"),
            spool_max_size: 1 << 30,
            required: false,
            retention: Retention {
                max_age: Some(Duration::from_secs(30 * 86_400)),
                max_size: Some(1 << 30),
            },
            queue: 1024,
            // Records waiting for the writer; exchanges admitted below it keep their
            // place past it. 200 KB at c64, everything on, VmHWM 115 MB at 16 MiB,
            // 102 at 8, 85 at 4, for the same req/s (bench/README, issue 45).
            queue_bytes: 4 << 20,
            queue_wait: Duration::from_secs(2),
            max_response: 16 << 20,
            secret_headers: Vec::new(),
            redact: Vec::new(),
        }
    }
}

impl CaptureSettings {
    /// The redactor these settings describe: the built-in shapes, the extra patterns
    /// and the extra secret headers. The process builds one, for captures and logs.
    pub fn redactor(&self) -> Result<Redactor, crate::redact::PatternError> {
        Redactor::new(&self.redact, &self.secret_headers)
    }

    /// Applies a layer over these settings. `base` is the config file's directory
    /// (relative `dir` values in a file are relative to it).
    pub fn apply(&mut self, layer: CaptureLayer, base: Option<&Path>) -> Result<(), ConfigError> {
        if let Some(v) = layer.enabled {
            self.enabled = v;
        }
        match (layer.dir, layer.url) {
            (Some(_), Some(_)) => {
                return Err(invalid::<&str>("capture.url")(
                    "capture.dir is given too; give one of them: a directory for SQLite, or a postgres:// URL",
                ));
            }
            (Some(dir), None) => self.store = StoreLocation::Dir(dir).relative_to(base),
            (None, Some(url)) => {
                self.store = match url.parse() {
                    Ok(StoreLocation::Postgres(url)) => StoreLocation::Postgres(url),
                    Ok(StoreLocation::Dir(_)) => {
                        return Err(invalid("capture.url")(format!(
                            "{url:?} is not a PostgreSQL URL (expected e.g. \"postgres://promptgate@db.internal/captures\"; a directory goes in capture.dir)"
                        )));
                    }
                    Err(e) => return Err(invalid("capture.url")(e.to_string())),
                };
            }
            (None, None) => {}
        }
        if let Some(dir) = layer.spool_dir {
            self.spool_dir = match base {
                Some(base) if dir.is_relative() => base.join(dir),
                _ => dir,
            };
        }
        if let Some(v) = layer.spool_max_size {
            self.spool_max_size = parse_size(&v).map_err(invalid("capture.spool_max_size"))?;
        }
        if let Some(v) = layer.required {
            self.required = v;
        }
        if let Some(v) = layer.max_age {
            self.retention.max_age =
                optional(&v, parse_duration).map_err(invalid("capture.max_age"))?;
        }
        if let Some(v) = layer.max_size {
            self.retention.max_size =
                optional(&v, parse_size).map_err(invalid("capture.max_size"))?;
        }
        if let Some(v) = layer.queue {
            if v == 0 {
                return Err(invalid::<&str>("capture.queue")("must be at least 1"));
            }
            self.queue = v as usize;
        }
        if let Some(v) = layer.queue_bytes {
            self.queue_bytes = parse_size(&v).map_err(invalid("capture.queue_bytes"))?;
        }
        if let Some(v) = layer.queue_wait {
            self.queue_wait = parse_duration(&v).map_err(invalid("capture.queue_wait"))?;
        }
        if let Some(v) = layer.max_response {
            self.max_response = parse_size(&v).map_err(invalid("capture.max_response"))?;
            if self.max_response == 0 {
                return Err(invalid::<&str>("capture.max_response")(
                    "must be at least 1 byte (expected e.g. \"16MiB\")",
                ));
            }
        }
        if let Some(names) = layer.secret_headers {
            for name in &names {
                if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                    return Err(invalid("capture.secret_headers")(format!(
                        "{name:?} is not a header name (expected e.g. \"x-gateway-token\")"
                    )));
                }
            }
            self.secret_headers
                .extend(names.into_iter().map(|n| n.to_ascii_lowercase()));
        }
        if let Some(patterns) = layer.redact {
            for p in patterns {
                let (kind, pattern) = match p {
                    RedactPattern::Plain(pattern) => ("custom".to_owned(), pattern),
                    RedactPattern::Named { kind, pattern } => (kind, pattern),
                };
                if kind.is_empty()
                    || !kind
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                {
                    return Err(invalid("capture.redact")(format!(
                        "kind {kind:?} must be letters, digits, '-' or '_' (expected e.g. \"acme-token\")"
                    )));
                }
                self.redact.push((kind, pattern));
            }
            Redactor::new(&self.redact, &[]).map_err(|e| {
                invalid("capture.redact")(format!("{e} (expected e.g. \"acme_[a-z0-9]{{32}}\")"))
            })?;
        }
        Ok(())
    }
}

/// The error of `setting`, whatever it was told.
fn invalid<E: std::fmt::Display>(setting: &'static str) -> impl Fn(E) -> ConfigError {
    move |e| ConfigError::Invalid {
        setting,
        message: e.to_string(),
    }
}

/// `"off"` or a value.
fn optional<T, E>(v: &Scalar, parse: fn(&Scalar) -> Result<T, E>) -> Result<Option<T>, E> {
    match v {
        Scalar::Text(t) if t.trim().eq_ignore_ascii_case("off") => Ok(None),
        v => parse(v).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_apply_and_validate() {
        let mut s = CaptureSettings::default();
        let layer: CaptureLayer = toml::from_str(
            r#"
            dir = "caps"
            required = true
            max_age = "7d"
            max_size = "off"
            max_response = "1MiB"
            secret_headers = ["X-Gateway-Token"]
            redact = ["acme_[0-9]{4}", { kind = "ticket", pattern = "T-[0-9]+" }]
            "#,
        )
        .unwrap();
        s.apply(layer, Some(Path::new("/etc/pg"))).unwrap();
        assert_eq!(s.store, StoreLocation::Dir("/etc/pg/caps".into()));
        assert!(s.required);
        assert_eq!(s.retention.max_age, Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(s.retention.max_size, None);
        assert_eq!(s.max_response, 1 << 20);
        assert_eq!(s.secret_headers, ["x-gateway-token"]);
        assert_eq!(s.redact[1], ("ticket".into(), "T-[0-9]+".into()));

        let both: CaptureLayer =
            toml::from_str("dir = \"caps\"\nurl = \"postgres://pg@db/caps\"").unwrap();
        let err = s.clone().apply(both, None).unwrap_err().to_string();
        assert!(err.contains("capture.dir is given too"), "{err}");
        let url: CaptureLayer = toml::from_str("url = \"postgres://pg@db/caps\"").unwrap();
        s.apply(url, None).unwrap();
        assert_eq!(
            s.store,
            StoreLocation::Postgres("postgres://pg@db/caps".into())
        );
        let secret: CaptureLayer =
            toml::from_str("url = \"postgres://pg:hunter2@db/caps\"").unwrap();
        let err = s.clone().apply(secret, None).unwrap_err().to_string();
        assert!(
            err.contains("PGPASSWORD") && !err.contains("hunter2"),
            "{err}"
        );

        let bad: CaptureLayer = toml::from_str(r#"redact = ["(unclosed"]"#).unwrap();
        let err = CaptureSettings::default()
            .apply(bad, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("capture.redact: invalid regex \"(unclosed\""),
            "{err}"
        );
    }
}
