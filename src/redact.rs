//! Redaction, in memory, before the store: one Aho-Corasick pass over the literal
//! starts of known secret shapes, their regexes only where one hits; each secret
//! becomes `[REDACTED:<kind>:<hash8>]` (JSON stays JSON; `hash8`, from its SHA-256,
//! correlates it across records). Credential headers keep a fingerprint only.
//! It does not decide what is stored.

use std::borrow::Cow;
use std::collections::BTreeMap;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use http::HeaderMap;
use regex::bytes::Regex;

mod pii;

/// Headers whose whole value is a credential, whatever it looks like (also what a
/// hook's event redacts unless the hook is declared with `secrets = true`).
pub(crate) const CREDENTIAL_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
    "cookie",
    "set-cookie",
    crate::runtime::PROBE_HEADER,
];

/// Counts of redactions per kind, for one record. Never holds a value.
pub type Summary = BTreeMap<String, u32>;

/// One known secret shape.
struct Shape {
    kind: &'static str,
    /// Literals (ASCII case-insensitive) where the secret, or its keyword, starts.
    triggers: &'static [&'static str],
    /// Anchored at the trigger. The secret is the group `s` when there is one.
    pattern: &'static str,
    /// The byte before the trigger must not be a letter or digit (`task-` is not `sk-`).
    word_start: bool,
    /// How far past the trigger the match may reach.
    window: usize,
}

/// Built in, in priority order: at one position the first shape that matches wins.
const SHAPES: &[Shape] = &[
    Shape {
        kind: "pem-private-key",
        triggers: &["-----BEGIN"],
        pattern: r"-----BEGIN[A-Z ]{0,40}PRIVATE KEY-----(?:[A-Za-z0-9+/=\s:,.-]|\\[nrt]|\\/)*?-----END[A-Z ]{0,40}PRIVATE KEY-----",
        word_start: false,
        window: 24_000,
    },
    Shape {
        // A key cut short (no END line): everything that can belong to its body.
        kind: "pem-private-key",
        triggers: &["-----BEGIN"],
        pattern: r"-----BEGIN[A-Z ]{0,40}PRIVATE KEY-----(?:[A-Za-z0-9+/=\s:,.-]|\\[nrt]|\\/)*",
        word_start: false,
        window: 24_000,
    },
    Shape {
        kind: "anthropic",
        triggers: &["sk-ant-"],
        pattern: r"sk-ant-[A-Za-z0-9_-]{16,}",
        word_start: true,
        window: 512,
    },
    Shape {
        kind: "openai",
        triggers: &["sk-"],
        pattern: r"sk-(?:(?:proj|svcacct|admin|None)-[A-Za-z0-9_-]{20,}|[A-Za-z0-9]{32,})",
        word_start: true,
        window: 512,
    },
    Shape {
        kind: "stripe",
        triggers: &["sk_live_", "sk_test_", "rk_live_", "rk_test_", "whsec_"],
        pattern: r"(?:[sr]k_(?:live|test)_|whsec_)[A-Za-z0-9]{16,}",
        word_start: true,
        window: 512,
    },
    Shape {
        kind: "aws-access-key",
        triggers: &["AKIA", "ASIA", "ABIA", "ACCA"],
        pattern: r"(?-i:A(?:KIA|SIA|BIA|CCA)[A-Z0-9]{16})(?:[^A-Za-z0-9]|$)",
        word_start: true,
        window: 21,
    },
    Shape {
        kind: "aws-secret-key",
        triggers: &[
            "aws_secret_access_key",
            "secret_access_key",
            "secretaccesskey",
        ],
        pattern: r#"(?i:(?:aws_)?secret_?access_?key)(?:\\?["'])?\s*[:=]\s*(?:\\?["'])?(?P<s>[A-Za-z0-9/+=]{40})"#,
        word_start: false,
        window: 128,
    },
    Shape {
        kind: "gcp-service-account",
        triggers: &["private_key_id"],
        pattern: r#"private_key_id(?:\\?")?\s*:\s*(?:\\?")?(?P<s>[0-9a-f]{40})"#,
        word_start: false,
        window: 128,
    },
    Shape {
        kind: "google-api-key",
        triggers: &["AIza"],
        pattern: r"(?-i:AIza[0-9A-Za-z_-]{35})",
        word_start: true,
        window: 64,
    },
    Shape {
        kind: "github",
        triggers: &["ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"],
        pattern: r"(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})",
        word_start: true,
        window: 512,
    },
    Shape {
        kind: "gitlab",
        triggers: &["glpat-", "gldt-", "glrt-", "glptt-", "glcbt-", "glsoat-"],
        pattern: r"gl(?:pat|dt|rt|ptt|cbt|soat)-[A-Za-z0-9_-]{20,}",
        word_start: true,
        window: 512,
    },
    Shape {
        kind: "slack",
        triggers: &[
            "xoxb-",
            "xoxa-",
            "xoxp-",
            "xoxr-",
            "xoxs-",
            "xoxe-",
            "hooks.slack.com/",
        ],
        pattern: r"(?:xox[baprse]-[A-Za-z0-9-]{10,}|hooks\.slack\.com/(?:services|workflows)/[A-Za-z0-9/_-]{20,})",
        word_start: true,
        window: 512,
    },
    Shape {
        kind: "npm-token",
        triggers: &["npm_"],
        pattern: r"(?-i:npm_[A-Za-z0-9]{36})",
        word_start: true,
        window: 64,
    },
    Shape {
        kind: "pypi-token",
        triggers: &["pypi-AgE"],
        pattern: r"(?-i:pypi-AgE[A-Za-z0-9_-]{50,})",
        word_start: true,
        window: 512,
    },
    Shape {
        // The password of a database URL: `postgres://app:s3cret@db/prod`.
        kind: "database-url",
        triggers: &[
            "postgres://",
            "postgresql://",
            "mysql://",
            "mariadb://",
            "mongodb://",
            "mongodb+srv://",
            "redis://",
            "rediss://",
            "amqp://",
            "amqps://",
            "mssql://",
            "sqlserver://",
            "clickhouse://",
        ],
        pattern: r#"[a-z+]{4,13}://[^\s:/@"'\\]{0,128}:(?P<s>[^\s@/"'\\]{3,256})@"#,
        word_start: true,
        window: 420,
    },
    Shape {
        kind: "jwt",
        triggers: &["eyJ"],
        pattern: r"(?-i:eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*)",
        word_start: true,
        window: 16_384,
    },
    Shape {
        kind: "bearer",
        triggers: &["bearer "],
        pattern: r"(?i:bearer)\s+(?P<s>[A-Za-z0-9._~+/-]{16,}=*)",
        word_start: true,
        window: 4096,
    },
    Shape {
        // `.env`-style assignments: `DB_PASSWORD=…`, `export GITHUB_TOKEN=…`, `?token=…`.
        kind: "env-secret",
        triggers: &[
            "password",
            "passwd",
            "secret",
            "token",
            "api_key",
            "apikey",
            "api-key",
            "access_key",
            "access-key",
            "accesskey",
            "private_key",
            "private-key",
            "privatekey",
            "credential",
        ],
        pattern: r#"(?i:password|passwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|credentials?)(?P<rest>[A-Za-z0-9_.-]{0,40})[ \t]*=[ \t]*(?:\\?["'])?(?P<s>[^\s"'\\,;&<>(){}\[\]]{3,})"#,
        word_start: false,
        window: 640,
    },
];

/// What a detector's values are: a credential, or personal data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum DataKind {
    Secret,
    Pii,
}

impl DataKind {
    /// Its name in rule files, records and metrics.
    pub(crate) fn name(self) -> &'static str {
        match self {
            DataKind::Secret => "secret",
            DataKind::Pii => "pii",
        }
    }

    /// The kind a name in a rule file stands for.
    pub(crate) fn from_name(name: &str) -> Option<DataKind> {
        [DataKind::Secret, DataKind::Pii]
            .into_iter()
            .find(|k| k.name() == name)
    }
}

/// How sure a detector is that what it found is what it says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Confidence {
    Low,
    Medium,
    High,
}

impl Confidence {
    /// Its name in rule files and records.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Confidence::Low => "low",
            Confidence::Medium => "medium",
            Confidence::High => "high",
        }
    }

    /// The confidence a name in a rule file stands for.
    pub(crate) fn from_name(name: &str) -> Option<Confidence> {
        [Confidence::Low, Confidence::Medium, Confidence::High]
            .into_iter()
            .find(|c| c.name() == name)
    }
}

/// One built-in detector: the capture's redaction uses the `secret` ones, the
/// outgoing-secrets scanner all of them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Detector {
    /// The name findings, rules and metrics give it (a redaction marker's kind).
    pub name: &'static str,
    pub kind: DataKind,
    pub confidence: Confidence,
}

/// The built-in detectors, each once (the shapes above may give one several patterns).
pub(crate) const DETECTORS: &[Detector] = &[
    secret("pem-private-key", Confidence::High),
    secret("anthropic", Confidence::High),
    secret("openai", Confidence::High),
    secret("stripe", Confidence::High),
    secret("aws-access-key", Confidence::High),
    secret("aws-secret-key", Confidence::High),
    secret("gcp-service-account", Confidence::High),
    secret("google-api-key", Confidence::High),
    secret("github", Confidence::High),
    secret("gitlab", Confidence::High),
    secret("slack", Confidence::High),
    secret("npm-token", Confidence::High),
    secret("pypi-token", Confidence::High),
    secret("database-url", Confidence::Medium),
    secret("jwt", Confidence::Medium),
    secret("bearer", Confidence::Medium),
    secret("env-secret", Confidence::Low),
    pii("email", Confidence::High),
    pii("card", Confidence::High),
    pii("iban", Confidence::High),
    pii("us-ssn", Confidence::Medium),
    pii("phone", Confidence::Medium),
];

const fn secret(name: &'static str, confidence: Confidence) -> Detector {
    Detector {
        name,
        kind: DataKind::Secret,
        confidence,
    }
}

const fn pii(name: &'static str, confidence: Confidence) -> Detector {
    Detector {
        name,
        kind: DataKind::Pii,
        confidence,
    }
}

/// The built-in detector of a name.
pub(crate) fn detector(name: &str) -> Option<&'static Detector> {
    DETECTORS.iter().find(|d| d.name == name)
}

/// One value a built-in detector found: its byte range in the input and the detector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Found {
    pub start: usize,
    pub end: usize,
    pub detector: &'static str,
}

/// Every value the built-in detectors find in `input` (personal data too when
/// `pii`), in order, not overlapping: the outgoing-secrets scanner's one pass.
pub(crate) fn detect(input: &[u8], pii: bool, out: &mut Vec<Found>) {
    static BUILT_IN: std::sync::OnceLock<Redactor> = std::sync::OnceLock::new();
    let redactor =
        BUILT_IN.get_or_init(|| Redactor::new(&[], &[]).expect("built-in patterns compile"));
    let first = out.len();
    for (start, end, kind) in redactor.find(input, &[]) {
        if let Some(d) = detector(&kind) {
            out.push(Found {
                start,
                end,
                detector: d.name,
            });
        }
    }
    bare_aws_secrets(input, first, out);
    if pii {
        let mut hits = Vec::new();
        pii::find(input, &mut hits);
        pii::ibans(input, &mut hits);
        for (start, end, detector) in hits {
            if !out[first..].iter().any(|f| f.start < end && start < f.end) {
                out.push(Found {
                    start,
                    end,
                    detector,
                });
            }
        }
    }
    out[first..].sort_by_key(|f| f.start);
}

/// The mark of the outgoing-secrets scanner's placeholders: `MASKED` and ten hex
/// digits of a keyed hash.
const PLACEHOLDER_MARK: &[u8] = b"MASKED";

/// Whether `bytes` hold a placeholder the scanner put in place of a value: it is
/// not a secret (the capture shows it as the provider got it) and not scanned again.
pub(crate) fn is_mask_placeholder(bytes: &[u8]) -> bool {
    memchr::memmem::find_iter(bytes, PLACEHOLDER_MARK).any(|at| {
        let hex = &bytes[at + PLACEHOLDER_MARK.len()..];
        hex.len() >= 10 && hex[..10].iter().all(u8::is_ascii_hexdigit)
    })
}

/// How far from an AWS access key id a bare 40-character secret key is taken as its pair.
const AWS_PAIR_REACH: usize = 200;

/// A bare AWS secret key (40 base64 characters, no keyword before it) near an
/// access key id that `out[first..]` holds: the two are pasted together.
fn bare_aws_secrets(input: &[u8], first: usize, out: &mut Vec<Found>) {
    let ids: Vec<usize> = out[first..]
        .iter()
        .filter(|f| f.detector == "aws-access-key")
        .map(|f| f.end)
        .collect();
    for id_end in ids {
        let window = id_end..input.len().min(id_end + AWS_PAIR_REACH);
        let is_key = |b: u8| b.is_ascii_alphanumeric() || b == b'/' || b == b'+';
        let mut at = window.start;
        while at < window.end {
            if !is_key(input[at]) {
                at += 1;
                continue;
            }
            let run = input[at..].iter().take_while(|b| is_key(**b)).count();
            let token = &input[at..at + run];
            let mixed = token.iter().any(u8::is_ascii_lowercase)
                && token.iter().any(u8::is_ascii_uppercase)
                && token.iter().any(u8::is_ascii_digit);
            if run == 40
                && mixed
                && !out[first..]
                    .iter()
                    .any(|f| f.start < at + run && at < f.end)
            {
                out.push(Found {
                    start: at,
                    end: at + run,
                    detector: "aws-secret-key",
                });
                break;
            }
            at += run;
        }
    }
}

/// The longest `.env`-style value taken as one secret; the rest is read again. As a
/// bound in the pattern it was 512 NFA states the backtracker cleared per match:
/// 25k of the 198k instructions of a 20 KB pass-through exchange (its log line's
/// `in_tokens=`).
const ENV_SECRET_MAX: usize = 512;

/// Whether the env-secret pattern may match at the start of `at` and pass the plural
/// check in `Redactor::find` (false: it cannot), read without the regex: its name (one of `names`) and
/// `rest` are the run of name bytes there, then `=`. Most triggers in a log line are
/// `in_tokens=…`, refused here: the line's redaction 15.5k → 8.9k instructions.
fn env_assignment_at(at: &[u8], names: &[&str]) -> bool {
    let Some(name) = names
        .iter()
        .filter(|n| at.len() >= n.len() && at[..n.len()].eq_ignore_ascii_case(n.as_bytes()))
        .map(|n| n.len())
        .max()
    else {
        return false;
    };
    // `credentials?`: the pattern takes the `s` into the name.
    let name = if at[..name].eq_ignore_ascii_case(b"credential")
        && at.get(name).is_some_and(|b| b.eq_ignore_ascii_case(&b's'))
    {
        name + 1
    } else {
        name
    };
    let after = &at[name..];
    let rest = after
        .iter()
        .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        .count();
    rest <= 40
        && !is_plural(&after[..rest])
        && after[rest..].iter().find(|b| !matches!(b, b' ' | b'\t')) == Some(&b'=')
}

/// An env-secret name's `rest` that makes it a count, not a credential:
/// `TOKENS=`, `max_tokens=`.
fn is_plural(rest: &[u8]) -> bool {
    rest.eq_ignore_ascii_case(b"s") || rest.ends_with(b"tokens")
}

/// Values after `=` that are placeholders, not secrets.
fn is_placeholder(value: &[u8]) -> bool {
    matches!(value.first(), Some(b'$' | b'%' | b'*'))
        || value.iter().all(|b| *b == b'x' || *b == b'X' || *b == b'*')
        || [
            &b"null"[..],
            b"none",
            b"true",
            b"false",
            b"undefined",
            b"changeme",
        ]
        .iter()
        .any(|p| value.eq_ignore_ascii_case(p))
}

/// The most bytes of a client-chosen name (a model, a conversation id, a host) that
/// is kept, logged, labelled or exported: real ones are under 100 (a Bedrock
/// inference-profile ARN is the longest seen), and 50 metrics labels of this size
/// are a few KiB per series.
pub(crate) const NAME_MAX: usize = 128;

/// The most bytes of a client-chosen text (a path, an error, a cache reason) put
/// into a log line or a span name.
pub(crate) const TEXT_MAX: usize = 2048;

/// How far past the kept bytes a value is scanned before it is cut: the widest
/// token shape's window, so a secret that starts in the kept bytes is seen whole
/// (a PEM key longer than that is caught by its cut-short shape).
const SCAN_PAST: usize = 512;

/// `text` whole when it fits in `max` bytes; else its first `max` bytes (at a
/// character boundary) and `…(cut, N bytes)`, N its whole length. The one way a
/// client-chosen string is bounded before it is kept, logged or labelled: cut
/// after redaction ([`Redactor::bounded`]), never before, so a cut cannot leave a
/// piece of a secret too short to recognise.
pub(crate) fn cut(text: &str, max: usize) -> Cow<'_, str> {
    cut_as(text, max, text.len())
}

/// [`cut`], saying `whole` bytes in its mark (the length before a prefix was taken).
fn cut_as(text: &str, max: usize, whole: usize) -> Cow<'_, str> {
    if text.len() <= max && whole <= max {
        return Cow::Borrowed(text);
    }
    let kept = prefix(text, max);
    let whole = whole.max(text.len());
    Cow::Owned(format!("{kept}…(cut, {whole} bytes)"))
}

/// The longest prefix of `text` of at most `max` bytes that ends at a character boundary.
fn prefix(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `text` (a URL as a user wrote it) with any password in its authority shown as
/// `***` (`http://user:***@host`); a user part without a password is hidden whole,
/// since a token is often passed there. For messages that refuse such a URL.
pub(crate) fn url_without_password(text: &str) -> Cow<'_, str> {
    let start = text.find("://").map_or(0, |i| i + 3);
    let end = text[start..]
        .find(['/', '?', '#'])
        .map_or(text.len(), |i| start + i);
    let Some(at) = text[start..end].rfind('@').map(|i| start + i) else {
        return Cow::Borrowed(text);
    };
    let user = match text[start..at].find(':') {
        Some(colon) => &text[start..start + colon + 1],
        None => "",
    };
    Cow::Owned(format!("{}{user}***{}", &text[..start], &text[at..]))
}

/// A compiled set of secret shapes plus the configured extra patterns.
pub struct Redactor {
    triggers: AhoCorasick,
    /// For each trigger literal, the shapes it starts, in priority order.
    trigger_shapes: Vec<Vec<usize>>,
    shapes: Vec<Regex>,
    /// Configured patterns: (kind, regex), run over the whole body.
    extra: Vec<(String, Regex)>,
    /// Extra header names whose values are credentials (lowercase).
    secret_headers: Vec<String>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redactor")
            .field("extra", &self.extra.len())
            .field("secret_headers", &self.secret_headers)
            .finish()
    }
}

/// A configured redaction pattern that does not compile.
#[derive(Debug, thiserror::Error)]
#[error("invalid regex {pattern:?}: {message}")]
pub struct PatternError {
    pub pattern: String,
    pub message: String,
}

impl Redactor {
    /// The built-in shapes plus `extra` patterns `(kind, regex)` and extra credential
    /// header names.
    pub fn new(
        extra: &[(String, String)],
        secret_headers: &[String],
    ) -> Result<Self, PatternError> {
        let mut literals: Vec<&str> = Vec::new();
        let mut shapes = Vec::with_capacity(SHAPES.len());
        for shape in SHAPES {
            let regex = Regex::new(&format!("^(?:{})", shape.pattern))
                .expect("built-in redaction patterns compile");
            shapes.push(regex);
            for t in shape.triggers {
                if !literals.iter().any(|l| l.eq_ignore_ascii_case(t)) {
                    literals.push(t);
                }
            }
        }
        // The search is leftmost-longest, so a literal stands for every shape whose
        // trigger it starts with (`sk-ant-` also tries the `sk-` shapes), in priority order.
        let trigger_shapes = literals
            .iter()
            .map(|l| {
                let l = l.to_ascii_lowercase();
                (0..SHAPES.len())
                    .filter(|&i| {
                        SHAPES[i]
                            .triggers
                            .iter()
                            .any(|t| l.starts_with(&t.to_ascii_lowercase()))
                    })
                    .collect()
            })
            .collect();
        // A full DFA: the automaton is small, and it is the one pass over every body.
        let triggers = AhoCorasickBuilder::new()
            .ascii_case_insensitive(true)
            .match_kind(MatchKind::LeftmostLongest)
            .kind(Some(aho_corasick::AhoCorasickKind::DFA))
            .build(&literals)
            .expect("built-in triggers build");
        let extra = extra
            .iter()
            .map(|(kind, pattern)| {
                Regex::new(pattern)
                    .map(|r| (kind.clone(), r))
                    .map_err(|e| PatternError {
                        pattern: pattern.clone(),
                        message: e.to_string(),
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Redactor {
            triggers,
            trigger_shapes,
            shapes,
            extra,
            secret_headers: secret_headers
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
        })
    }

    /// `input` with every secret replaced; counts go to `summary`. `per_record` are
    /// patterns rules added for this exchange (kind `rule`).
    pub fn redact<'a>(
        &self,
        input: &'a [u8],
        per_record: &[regex::Regex],
        summary: &mut Summary,
    ) -> Cow<'a, [u8]> {
        // Strings whose escapes hide a secret (`\u0073k-ant-…`) are rewritten whole.
        let rewritten = self.escaped_strings(input, per_record, summary);
        let mut spans = self.find(input, per_record);
        if !rewritten.is_empty() {
            spans.retain(|(start, end, _)| !rewritten.iter().any(|(s, e, _)| start < e && s < end));
        }
        if spans.is_empty() && rewritten.is_empty() {
            return Cow::Borrowed(input);
        }
        let mut edits: Vec<(usize, usize, Vec<u8>)> = rewritten;
        for (start, end, kind) in spans {
            let text = marker(&kind, None, &input[start..end]).into_bytes();
            *summary.entry(kind.into_owned()).or_default() += 1;
            edits.push((start, end, text));
        }
        edits.sort_by_key(|e| e.0);
        let mut out = Vec::with_capacity(input.len());
        let mut at = 0;
        for (start, end, text) in edits {
            out.extend_from_slice(&input[at..start]);
            out.extend_from_slice(&text);
            at = end;
        }
        out.extend_from_slice(&input[at..]);
        Cow::Owned(out)
    }

    /// The JSON strings in `input` that hold a secret only once their `\u` or `\/`
    /// escapes are read: (start, end, the string's content redacted and re-escaped).
    fn escaped_strings(
        &self,
        input: &[u8],
        per_record: &[regex::Regex],
        summary: &mut Summary,
    ) -> Vec<(usize, usize, Vec<u8>)> {
        let escaped = |b: &[u8]| {
            memchr::memmem::find(b, b"\\u").is_some() || memchr::memmem::find(b, b"\\/").is_some()
        };
        if !escaped(input) {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (start, end) in json_strings(input) {
            if !escaped(&input[start..end]) {
                continue;
            }
            let Ok(text) = serde_json::from_slice::<String>(&input[start - 1..end + 1]) else {
                continue;
            };
            let spans = self.find(text.as_bytes(), per_record);
            if spans.is_empty() {
                continue;
            }
            let bytes = text.as_bytes();
            let mut clean = Vec::with_capacity(bytes.len());
            let mut at = 0;
            for (a, b, kind) in spans {
                clean.extend_from_slice(&bytes[at..a]);
                clean.extend_from_slice(marker(&kind, None, &bytes[a..b]).as_bytes());
                *summary.entry(kind.into_owned()).or_default() += 1;
                at = b;
            }
            clean.extend_from_slice(&bytes[at..]);
            let quoted =
                serde_json::to_string(&String::from_utf8_lossy(&clean)).unwrap_or_default();
            let inner = quoted.as_bytes()[1..quoted.len().saturating_sub(1).max(1)].to_vec();
            out.push((start, end, inner));
        }
        out
    }

    /// `text` redacted, as text (lossy only for bytes that were not UTF-8 to begin with).
    pub fn redact_text(
        &self,
        text: &str,
        per_record: &[regex::Regex],
        summary: &mut Summary,
    ) -> String {
        match self.redact(text.as_bytes(), per_record, summary) {
            Cow::Borrowed(_) => text.to_owned(),
            Cow::Owned(v) => String::from_utf8(v)
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
        }
    }

    /// A client-chosen value on its way out of the process (a metrics label, a span
    /// attribute, a log field, a warned-once key): redacted, then [`cut`] to `max`
    /// bytes. Only the bytes that can show are scanned, so a huge value costs no
    /// more than a short one.
    pub fn bounded(&self, text: &str, per_record: &[regex::Regex], max: usize) -> String {
        let scanned = prefix(text, max.saturating_add(SCAN_PAST));
        let clean = self.redact_text(scanned, per_record, &mut Summary::new());
        match cut_as(&clean, max, text.len()) {
            Cow::Borrowed(_) => clean,
            Cow::Owned(c) => c,
        }
    }

    /// Where the secrets in `text` are, as byte ranges in order: to cut text where
    /// no secret is cut.
    pub(crate) fn spans(&self, text: &str, per_record: &[regex::Regex]) -> Vec<(usize, usize)> {
        self.find(text.as_bytes(), per_record)
            .into_iter()
            .map(|(start, end, _)| (start, end))
            .collect()
    }

    /// The secrets in `input`, as (kind, secret bytes), each once.
    pub fn secrets(&self, input: &[u8], per_record: &[regex::Regex]) -> Vec<(String, Vec<u8>)> {
        let mut out: Vec<(String, Vec<u8>)> = Vec::new();
        for (start, end, kind) in self.find(input, per_record) {
            let secret = input[start..end].to_vec();
            if !out.iter().any(|(_, s)| *s == secret) {
                out.push((kind.into_owned(), secret));
            }
        }
        out
    }

    /// Redacts the pieces of `secrets` that a stream split across events: in every JSON
    /// string of `body`, a whole secret, or a run of 3 or more bytes that is part of a
    /// secret and reaches the string's start or end (or is the whole string), is replaced.
    ///
    /// A model that echoes a key streams it in token-sized deltas, so no single event
    /// holds it whole; the reassembled message does, and tells which secrets to chase.
    pub fn scrub_fragments<'a>(
        &self,
        body: &'a [u8],
        secrets: &[(String, Vec<u8>)],
    ) -> Cow<'a, [u8]> {
        const MIN: usize = 3;
        let mut spans: Vec<(usize, usize, &str, &[u8])> = Vec::new();
        for (start, end) in json_strings(body) {
            let text = &body[start..end];
            for (kind, secret) in secrets {
                if secret.len() < 8 || text.len() < MIN {
                    continue;
                }
                let piece = if let Some(at) = memchr::memmem::find(text, secret) {
                    // The whole secret inside one string, among other text.
                    Some((start + at, start + at + secret.len()))
                } else if memchr::memmem::find(secret, text).is_some() {
                    // The string is a piece from the middle of the secret.
                    Some((start, end))
                } else {
                    let head = (MIN..=text.len().min(secret.len() - 1))
                        .rev()
                        .find(|&n| secret.ends_with(&text[..n]));
                    let tail = (MIN..=text.len().min(secret.len() - 1))
                        .rev()
                        .find(|&n| secret.starts_with(&text[text.len() - n..]));
                    match (head, tail) {
                        (Some(h), Some(t)) if t > h => Some((end - t, end)),
                        (Some(h), _) => Some((start, start + h)),
                        (None, Some(t)) => Some((end - t, end)),
                        (None, None) => None,
                    }
                };
                if let Some((a, b)) = piece {
                    spans.push((a, b, kind, secret));
                    break;
                }
            }
        }
        if spans.is_empty() {
            return Cow::Borrowed(body);
        }
        let mut out = Vec::with_capacity(body.len());
        let mut at = 0;
        for (a, b, kind, secret) in spans {
            out.extend_from_slice(&body[at..a]);
            out.extend_from_slice(marker(kind, None, secret).as_bytes());
            at = b;
        }
        out.extend_from_slice(&body[at..]);
        Cow::Owned(out)
    }

    /// Secret spans in order, not overlapping: (start, end, kind).
    fn find<'k>(
        &'k self,
        input: &[u8],
        per_record: &[regex::Regex],
    ) -> Vec<(usize, usize, Cow<'k, str>)> {
        let mut spans: Vec<(usize, usize, Cow<'k, str>)> = Vec::new();
        let mut from = 0;
        while let Some(m) = self
            .triggers
            .find(aho_corasick::Input::new(input).range(from..))
        {
            let pos = m.start();
            // No shape here: look again from the next byte (a trigger may hold another).
            from = pos + 1;
            for &index in &self.trigger_shapes[m.pattern().as_usize()] {
                let shape = &SHAPES[index];
                if shape.word_start && !at_word_start(input, pos) {
                    continue;
                }
                if shape.kind == "env-secret" && !env_assignment_at(&input[pos..], shape.triggers) {
                    continue;
                }
                let window = &input[pos..input.len().min(pos + shape.window)];
                let Some(caps) = self.shapes[index].captures(window) else {
                    continue;
                };
                let whole = caps.get(0).expect("group 0 always matches");
                let secret = caps.name("s").unwrap_or(whole);
                if shape.kind == "env-secret" {
                    let rest = caps.name("rest").map_or(&b""[..], |r| r.as_bytes());
                    if is_plural(rest) || is_placeholder(secret.as_bytes()) {
                        continue;
                    }
                } else if shape.kind == "database-url" && is_placeholder(secret.as_bytes()) {
                    continue;
                }
                if is_mask_placeholder(&window[secret.start()..secret.end()]) {
                    continue;
                }
                let mut end = secret.end();
                let mut whole_end = whole.end();
                if shape.kind == "aws-access-key" {
                    end = 20; // the pattern also reads the byte after, to check the boundary
                } else if shape.kind == "env-secret" && secret.len() > ENV_SECRET_MAX {
                    end = secret.start() + ENV_SECRET_MAX;
                    whole_end = end;
                }
                spans.push((pos + secret.start(), pos + end, Cow::Borrowed(shape.kind)));
                from = pos + whole_end.max(end);
                break;
            }
            if from >= input.len() {
                break;
            }
        }
        let mut extra_spans = Vec::new();
        for (kind, regex) in &self.extra {
            for caps in regex.captures_iter(input) {
                if let Some(m) = caps.name("s").or_else(|| caps.get(0))
                    && !m.is_empty()
                {
                    extra_spans.push((m.start(), m.end(), Cow::Borrowed(kind.as_str())));
                }
            }
        }
        if !per_record.is_empty() {
            // Rule patterns are text regexes; bodies are bytes (mostly UTF-8).
            let text = String::from_utf8_lossy(input);
            if text.len() == input.len() {
                for regex in per_record {
                    for caps in regex.captures_iter(&text) {
                        if let Some(m) = caps.name("s").or_else(|| caps.get(0))
                            && !m.is_empty()
                        {
                            extra_spans.push((m.start(), m.end(), Cow::Borrowed("rule")));
                        }
                    }
                }
            }
        }
        if !extra_spans.is_empty() {
            spans.extend(extra_spans);
            spans.sort_by_key(|s| (s.0, std::cmp::Reverse(s.1)));
            let mut merged: Vec<(usize, usize, Cow<'k, str>)> = Vec::with_capacity(spans.len());
            for span in spans {
                match merged.last_mut() {
                    Some(last) if span.0 < last.1 => last.1 = last.1.max(span.1),
                    _ => merged.push(span),
                }
            }
            spans = merged;
        }
        spans
    }

    /// Headers as `(name, value)` pairs with every credential replaced by its fingerprint
    /// and every other value scanned like a body. `secret` names more credential headers.
    pub fn headers(
        &self,
        headers: &HeaderMap,
        secret: &[http::HeaderName],
        summary: &mut Summary,
    ) -> Vec<(String, String)> {
        headers
            .iter()
            .map(|(name, value)| {
                let lower = name.as_str();
                let credential = CREDENTIAL_HEADERS.contains(&lower)
                    || self.secret_headers.iter().any(|h| h == lower)
                    || secret.iter().any(|h| h == name);
                let text = String::from_utf8_lossy(value.as_bytes());
                let out = if credential {
                    self.fingerprint_header(lower, &text, summary)
                } else {
                    self.redact_text(&text, &[], summary)
                };
                (lower.to_owned(), out)
            })
            .collect()
    }

    /// A credential header value as its fingerprint; an auth scheme word is kept.
    fn fingerprint_header(&self, name: &str, value: &str, summary: &mut Summary) -> String {
        let (scheme, secret) = split_scheme(name, value);
        let kind = self.kind_of(secret.as_bytes()).unwrap_or(name);
        *summary.entry(kind.to_owned()).or_default() += 1;
        let fp = marker(kind, Some(secret), secret.as_bytes());
        match scheme {
            Some(s) => format!("{s} {fp}"),
            None => fp,
        }
    }

    /// The kind of a whole value when it is one known secret shape.
    fn kind_of(&self, value: &[u8]) -> Option<&'static str> {
        self.find(value, &[]).first().and_then(|(start, _, kind)| {
            let kind: &str = kind;
            (*start == 0)
                .then(|| SHAPES.iter().find(|s| s.kind == kind).map(|s| s.kind))
                .flatten()
        })
    }

    /// A path with the values of credential-like query parameters fingerprinted, and
    /// the rest scanned like a body.
    pub fn path(&self, path: &str, summary: &mut Summary) -> String {
        let Some((base, query)) = path.split_once('?') else {
            return self.redact_text(path, &[], summary);
        };
        let params: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, v)) if is_secret_name(k) && !v.is_empty() => {
                    *summary.entry("query-secret".into()).or_default() += 1;
                    format!("{k}={}", marker("query-secret", None, v.as_bytes()))
                }
                _ => self.redact_text(pair, &[], summary),
            })
            .collect();
        format!(
            "{}?{}",
            self.redact_text(base, &[], summary),
            params.join("&")
        )
    }
}

/// The byte ranges of the contents of the JSON strings in `body` (escapes left as
/// they are), outside strings anything goes: SSE framing, other text.
fn json_strings(body: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(open) = memchr::memchr(b'"', &body[i..]) {
        let start = i + open + 1;
        let mut j = start;
        loop {
            match memchr::memchr2(b'"', b'\\', &body[j..]) {
                Some(k) if body[j + k] == b'\\' => j += k + 2,
                Some(k) => {
                    out.push((start, j + k));
                    i = j + k + 1;
                    break;
                }
                None => return out,
            }
            if j >= body.len() {
                return out;
            }
        }
    }
    out
}

/// The byte before `pos` is not a letter or digit (a JSON escape such as `\n` counts
/// as a separator).
fn at_word_start(input: &[u8], pos: usize) -> bool {
    match pos.checked_sub(1).map(|i| input[i]) {
        None => true,
        Some(b) if b.is_ascii_alphanumeric() => pos >= 2 && input[pos - 2] == b'\\',
        Some(_) => true,
    }
}

/// Whether a query parameter's name says its value is a credential (some gateways
/// take `?key=`).
fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "key",
        "token",
        "secret",
        "password",
        "auth",
        "sig",
        "credential",
    ]
    .iter()
    .any(|s| n.contains(s))
}

/// The first 8 hex digits of the secret's SHA-256.
pub(crate) fn hash8(secret: &[u8]) -> String {
    crate::digest::hex(&crate::digest::sha256(secret)[..4])
}

/// A credential header's value as its auth scheme word (of `authorization` headers)
/// and the secret after it.
fn split_scheme<'a>(name: &str, value: &'a str) -> (Option<&'a str>, &'a str) {
    match value.split_once(' ') {
        Some((s, rest))
            if (name == "authorization" || name == "proxy-authorization")
                && !s.is_empty()
                && s.bytes().all(|b| b.is_ascii_alphabetic()) =>
        {
            (Some(s), rest.trim())
        }
        _ => (None, value.trim()),
    }
}

/// Which credential the value of credential header `name` is: the `hash8` its
/// fingerprint shows. A stored fingerprint gives the same id as the live value it
/// replaced, so every replica, and a replay of the store, groups requests by
/// credential alike without keeping the credential.
pub(crate) fn credential_id(name: &str, value: &[u8]) -> String {
    let text = String::from_utf8_lossy(value);
    let (_, secret) = split_scheme(name, &text);
    let stored = secret
        .strip_prefix("[REDACTED:")
        .and_then(|s| s.strip_suffix(']'))
        .and_then(|s| s.rsplit_once(':'))
        .map(|(_, hash)| hash)
        .filter(|h| h.len() == 8 && h.bytes().all(|b| b.is_ascii_hexdigit()));
    match stored {
        Some(hash) => hash.to_owned(),
        None => hash8(secret.as_bytes()),
    }
}

/// `[REDACTED:<kind>:<hash8>]`, or with the first 4 characters of a long enough
/// header credential: `[REDACTED:<kind>:<first4>...:<hash8>]`.
fn marker(kind: &str, shown: Option<&str>, secret: &[u8]) -> String {
    let hash = hash8(secret);
    match shown {
        Some(s) if s.chars().count() >= 16 => {
            let first4: String = s.chars().take(4).collect();
            format!("[REDACTED:{kind}:{first4}...:{hash}]")
        }
        _ => format!("[REDACTED:{kind}:{hash}]"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_shown_without_their_password() {
        for (url, shown) in [
            (
                "http://user:pw@host:4318/v1",
                "http://user:***@host:4318/v1",
            ),
            ("https://tok@host", "https://***@host"),
            ("http://a:b@c@host/p@q", "http://a:***@host/p@q"),
            ("user:pw@host", "user:***@host"),
            ("http://host:4318/x@y", "http://host:4318/x@y"),
            ("c:4318", "c:4318"),
        ] {
            assert_eq!(url_without_password(url), shown, "{url}");
        }
    }

    fn redactor() -> Redactor {
        Redactor::new(
            &[("acme".into(), r"acme_[a-z0-9]{12}".into())],
            &["x-gateway-token".into()],
        )
        .unwrap()
    }

    #[test]
    fn bounded_values_are_redacted_before_they_are_cut() {
        let r = redactor();
        assert_eq!(cut("claude-opus-5-5", NAME_MAX), "claude-opus-5-5");
        // At a character boundary, with the whole length.
        let long = format!("{}é{}", "a".repeat(NAME_MAX - 1), "b".repeat(1000));
        let short = cut(&long, NAME_MAX);
        assert_eq!(
            short,
            format!("{}…(cut, {} bytes)", "a".repeat(NAME_MAX - 1), long.len())
        );
        // A key straddling the cut is a marker, never a piece too short to recognise.
        let key = "sk-ant-api03-CANARYcut0123456789abcdefABCDEF0123456789";
        let value = format!(
            "{} {key} {}",
            "m".repeat(NAME_MAX - 20),
            "z".repeat(1 << 20)
        );
        let out = r.bounded(&value, &[], NAME_MAX);
        assert!(!out.contains("CANARY"), "{out}");
        assert!(out.contains("[REDACTED:anthro"), "{out}");
        assert!(
            out.ends_with(&format!("…(cut, {} bytes)", value.len())),
            "{out}"
        );
        assert_eq!(
            r.bounded(key, &[], NAME_MAX),
            marker("anthropic", None, key.as_bytes())
        );
    }

    /// The env-secret shape's verdict at the start of `text`, read with its regex:
    /// a match there that the plural check keeps.
    fn env_regex_at(text: &[u8]) -> bool {
        let shape = SHAPES.iter().find(|s| s.kind == "env-secret").unwrap();
        let regex = Regex::new(&format!("^(?:{})", shape.pattern)).unwrap();
        regex.captures(text).is_some_and(|caps| {
            let rest = caps.name("rest").map_or(&b""[..], |r| r.as_bytes());
            !is_plural(rest)
        })
    }

    #[test]
    fn the_env_assignment_check_agrees_with_the_pattern() {
        let names = SHAPES
            .iter()
            .find(|s| s.kind == "env-secret")
            .unwrap()
            .triggers;
        let fixed = [
            "tokens=48000",
            "token=abc123",
            "TOKEN = 'abc123'",
            "token\t=\\\"abcdef\\\"",
            "credentials=hunter22",
            "credential=hunter22",
            "credentialS=hunter22",
            "secret_tokens=123456",
            "secretokens=123456",
            "password_for_the_very_long_name_of_a_database_user=abcdef",
            "password_for_the_very_long_name_of_a_database_use=abcdef",
            "passwd:abcdef",
            "api-key=abc",
            "apikey  =  xyz123",
            "accesskey=abc",
            "private-key=abc",
            "token",
            "tokenizer=bpe",
            "tokens_limit=500",
            "secret=ab",
        ];
        // The check may let through what the pattern refuses (it reads no value),
        // never the other way round.
        for text in fixed {
            if env_regex_at(text.as_bytes()) {
                assert!(env_assignment_at(text.as_bytes(), names), "{text}");
            }
        }
        for refused in ["tokens=48000", "out_tokens=180", "token", "token: abc"] {
            assert!(!env_assignment_at(refused.as_bytes(), names), "{refused}");
        }
        use proptest::prelude::*;
        let name = proptest::sample::select(names.to_vec());
        let rest = "[A-Za-z0-9_.-]{0,44}|s|S|tokens|_tokens|S";
        let tail = "[ \\t]{0,2}[=:]?[ \\t]{0,2}[\"'a-z0-9 ]{0,6}";
        proptest!(ProptestConfig::with_cases(2_000), |(n in name, r in rest, t in tail, upper in any::<bool>())| {
            let n = if upper { n.to_ascii_uppercase() } else { n.to_string() };
            let text = format!("{n}{r}{t}");
            prop_assert!(
                !env_regex_at(text.as_bytes()) || env_assignment_at(text.as_bytes(), names),
                "{}", text
            );
        });
    }

    fn run(text: &str) -> (String, Summary) {
        let mut summary = Summary::new();
        let out = redactor().redact(text.as_bytes(), &[], &mut summary);
        (String::from_utf8(out.into_owned()).unwrap(), summary)
    }

    #[test]
    fn each_known_shape_is_replaced() {
        let cases = [
            (
                "key sk-ant-api03-AbCdEfGhIjKlMnOpQrStUvWx-yz_0123 end",
                "anthropic",
            ),
            ("sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", "openai"),
            ("legacy sk-AbCdEfGhIjKlMnOpQrStUvWxYz01234567 x", "openai"),
            ("AKIAIOSFODNN7EXAMPLE", "aws-access-key"),
            ("id: AKIAIOSFODNN7EXAMPLE, next", "aws-access-key"),
            (
                "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                "aws-secret-key",
            ),
            (
                r#"{\"private_key_id\": \"0123456789abcdef0123456789abcdef01234567\"}"#,
                "gcp-service-account",
            ),
            ("ghp_0123456789abcdefghijABCDEFGHIJ012345", "github"),
            (
                "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz",
                "github",
            ),
            ("glpat-abcdefghij0123456789", "gitlab"),
            ("xoxb-1234567890-abcdefghijkl", "slack"),
            ("sk_live_0123456789abcdefABCDEF", "stripe"),
            (
                "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
                "jwt",
            ),
            (
                "-----BEGIN RSA PRIVATE KEY-----\\nMIIEowIBAAKCAQEA7\\nabc+/=\\n-----END RSA PRIVATE KEY-----",
                "pem-private-key",
            ),
            ("DB_PASSWORD=hunter2hunter2", "env-secret"),
            ("export GITHUB_TOKEN=abc123def456", "env-secret"),
            ("Authorization: Bearer abcdefghijklmnop0123456789", "bearer"),
            ("acme_0123456789ab", "acme"),
        ];
        for (text, kind) in cases {
            let (out, summary) = run(text);
            assert_eq!(summary.get(kind), Some(&1), "{text} -> {out} {summary:?}");
            assert!(out.contains(&format!("[REDACTED:{kind}:")), "{out}");
        }
    }

    #[test]
    fn text_around_a_secret_is_kept() {
        let (out, _) =
            run("id: AKIAIOSFODNN7EXAMPLE, next ghp_0123456789abcdefghijABCDEFGHIJ012345 end");
        let h1 = hash8(b"AKIAIOSFODNN7EXAMPLE");
        let h2 = hash8(b"ghp_0123456789abcdefghijABCDEFGHIJ012345");
        assert_eq!(
            out,
            format!("id: [REDACTED:aws-access-key:{h1}], next [REDACTED:github:{h2}] end")
        );
    }

    #[test]
    fn prose_is_left_alone() {
        for text in [
            "max_tokens=128000 and the task-list",
            "tokens are counted; password reset flows; secret sauce",
            "token=${TOKEN} password=*** secret=xxxxxx",
            "the ask-question tool",
            "AKIAIOSFODNN7EXAMPLEX is too long",
        ] {
            let (out, summary) = run(text);
            assert!(summary.is_empty(), "{text} -> {out}");
            assert_eq!(out, text);
        }
    }

    #[test]
    fn json_stays_valid_and_secrets_correlate() {
        let body = br#"{"system":[{"type":"text","text":"use sk-ant-api03-SECRETSECRETSECRET01\nand DB_PASSWORD=s3cr3t-pw\n"}],"messages":[{"role":"user","content":"again sk-ant-api03-SECRETSECRETSECRET01"}]}"#;
        let mut summary = Summary::new();
        let out = redactor().redact(body, &[], &mut summary);
        let text = std::str::from_utf8(&out).unwrap();
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        assert!(!text.contains("SECRETSECRET") && !text.contains("s3cr3t"));
        let h = hash8(b"sk-ant-api03-SECRETSECRETSECRET01");
        assert_eq!(
            text.matches(&format!("[REDACTED:anthropic:{h}]")).count(),
            2
        );
        assert_eq!(summary["anthropic"], 2);
        assert_eq!(summary["env-secret"], 1);
        assert!(
            v["system"][0]["text"]
                .as_str()
                .unwrap()
                .contains("DB_PASSWORD=[REDACTED:env-secret:")
        );
    }

    #[test]
    fn a_credential_and_its_stored_fingerprint_have_one_id() {
        let r = redactor();
        for (name, value) in [
            (
                "x-api-key",
                "sk-ant-api03-abcdefghijklmnopqrstuvwxyz0123456789",
            ),
            (
                "authorization",
                "Bearer sk-ant-oat01-abcdefghijklmnopqrstuvwxyz01",
            ),
            ("authorization", "short"),
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(name, value.parse().unwrap());
            let stored = r.headers(&headers, &[], &mut Summary::new());
            let id = credential_id(name, value.as_bytes());
            assert_eq!(id.len(), 8);
            assert_eq!(
                credential_id(name, stored[0].1.as_bytes()),
                id,
                "{stored:?}"
            );
            assert!(value.len() < 16 || !stored[0].1.contains(&value[value.len() - 8..]));
        }
        assert_ne!(
            credential_id("x-api-key", b"sk-ant-api03-one"),
            credential_id("x-api-key", b"sk-ant-api03-two")
        );
    }

    #[test]
    fn credential_headers_keep_a_fingerprint() {
        let mut h = HeaderMap::new();
        h.insert(
            "x-api-key",
            "sk-ant-api03-HEADERSECRET0123456789".parse().unwrap(),
        );
        h.insert(
            "authorization",
            "Bearer tok_0123456789abcdefXYZ".parse().unwrap(),
        );
        h.insert("x-gateway-token", "gw-secret-value".parse().unwrap());
        h.insert("cookie", "sid=abc".parse().unwrap());
        h.insert(
            "x-note",
            "carries glpat-abcdefghij0123456789".parse().unwrap(),
        );
        h.insert("anthropic-version", "2023-06-01".parse().unwrap());
        let mut summary = Summary::new();
        let out = redactor().headers(&h, &[], &mut summary);
        let get = |n: &str| out.iter().find(|(k, _)| k == n).unwrap().1.clone();
        let hash = hash8(b"sk-ant-api03-HEADERSECRET0123456789");
        assert_eq!(
            get("x-api-key"),
            format!("[REDACTED:anthropic:sk-a...:{hash}]")
        );
        assert!(get("authorization").starts_with("Bearer [REDACTED:authorization:tok_...:"));
        assert!(get("x-gateway-token").starts_with("[REDACTED:x-gateway-token:"));
        assert!(
            !get("x-gateway-token").contains("gw-s"),
            "short values show no prefix"
        );
        assert!(get("cookie").starts_with("[REDACTED:cookie:"));
        assert!(get("x-note").starts_with("carries [REDACTED:gitlab:"));
        assert_eq!(get("anthropic-version"), "2023-06-01");
        assert_eq!(summary.values().sum::<u32>(), 5);
    }

    #[test]
    fn query_secrets_and_rule_patterns() {
        let r = redactor();
        let mut summary = Summary::new();
        let p = r.path("/v1/messages?beta=true&api_key=abc123", &mut summary);
        assert!(
            p.starts_with("/v1/messages?beta=true&api_key=[REDACTED:query-secret:"),
            "{p}"
        );
        let rule = regex::Regex::new(r"internal-\d{4}").unwrap();
        let out = r.redact(b"ticket internal-1234 ok", &[rule], &mut summary);
        assert!(
            std::str::from_utf8(&out)
                .unwrap()
                .starts_with("ticket [REDACTED:rule:")
        );
        assert_eq!(summary["rule"], 1);
    }

    #[test]
    fn secrets_split_across_stream_events_are_scrubbed() {
        let secret = b"sk_live_0123456789abcdefSPLIT";
        let r = redactor();
        let found = r.secrets(br#"{"text":"key: sk_live_0123456789abcdefSPLIT ok"}"#, &[]);
        assert_eq!(found, [("stripe".to_owned(), secret.to_vec())]);
        let events = b"data: {\"delta\":{\"text\":\"key: sk_li\"}}\n\ndata: {\"delta\":{\"text\":\"ve_0123\"}}\n\ndata: {\"delta\":{\"text\":\"456789abcdefSP\"}}\n\ndata: {\"delta\":{\"text\":\"LIT ok\"}}\n\n";
        let out = r.scrub_fragments(events, &found);
        let text = std::str::from_utf8(&out).unwrap();
        for fragment in ["sk_li", "ve_0123", "456789", "LIT"] {
            assert!(!text.contains(fragment), "{fragment} left in {text}");
        }
        assert!(text.contains("\"key: [REDACTED:stripe:"), "{text}");
        assert!(
            text.contains("\"text\":\"[REDACTED:stripe:") && text.contains("] ok\""),
            "{text}"
        );
        assert!(text.contains("\"delta\""), "keys are not secrets");
    }

    #[test]
    fn non_utf8_bodies_are_scanned_too() {
        let mut body = vec![0xff, 0xfe, b' '];
        body.extend_from_slice(b"ghp_0123456789abcdefghijABCDEFGHIJ012345");
        let mut summary = Summary::new();
        let out = redactor().redact(&body, &[], &mut summary);
        assert!(!out.windows(10).any(|w| w == b"0123456789"));
    }

    #[test]
    fn keys_written_with_json_escapes_are_found() {
        let r = redactor();
        let key = "sk-ant-api03-AbCdEfGhIjKlMnOpQrStUv";
        for escaped in [
            r#"\u0073k-ant-api03-AbCdEfGhIjKlMnOpQrStUv"#.to_owned(),
            r#"sk\u002dant\u002dapi03-AbCdEfGhIjKlMnOpQrStUv"#.to_owned(),
            key.chars()
                .map(|c| format!("\\u{:04x}", c as u32))
                .collect::<String>(),
        ] {
            let body = format!(
                r#"{{"model":"x","messages":[{{"role":"user","content":"key: {escaped} ok ☃ \u2603"}}]}}"#
            );
            let mut summary = Summary::new();
            let out = r.redact(body.as_bytes(), &[], &mut summary);
            let v: serde_json::Value = serde_json::from_slice(&out).expect("still JSON");
            let text = v["messages"][0]["content"].as_str().unwrap();
            assert!(!text.contains(key), "{escaped}: {text}");
            assert!(
                text.starts_with("key: [REDACTED:anthropic:") && text.ends_with(" ok ☃ ☃"),
                "{text}"
            );
            assert_eq!(summary.get("anthropic"), Some(&1), "{escaped}");
        }
        // Escapes with no secret behind them are left byte for byte.
        let plain = br#"{"a":"caf\u00e9 \/ x","b":"sk-ant-api03-AbCdEfGhIjKlMnOpQrStUv"}"#;
        let out = r.redact(plain, &[], &mut Summary::new());
        assert!(
            out.starts_with(br#"{"a":"caf\u00e9 \/ x","b":"[REDACTED:anthropic:"#),
            "{}",
            String::from_utf8_lossy(&out)
        );
    }
}
