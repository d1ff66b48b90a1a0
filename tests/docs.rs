//! The documentation: README.md is the front door and the manual lives in docs/;
//! when the README was cut down, every paragraph of it moved (nothing lost: the old
//! text is kept in tests/fixtures/readme-before-split.md for this check), and every
//! relative link of the README, docs/ and CONTRIBUTING.md reaches a file that exists.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The documents a reader has now.
fn documents() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md"), root().join("CONTRIBUTING.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    out.extend(docs);
    out
}

/// A paragraph as compared: headings without their level, link targets dropped
/// (a moved paragraph's links point from docs/ now), whitespace collapsed.
fn normal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        out.push_str(&rest[..at + 2]);
        rest = &rest[at + 2..];
        match rest.find(')') {
            Some(end) => rest = &rest[end..],
            None => break,
        }
    }
    out.push_str(rest);
    out.split_whitespace()
        .map(|w| w.trim_start_matches('#'))
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Old lines rewritten on purpose since the move, each with why: the check holds
/// every other line of the old README to be somewhere now.
const REWRITTEN: &[(&str, &str)] = &[
    (
        "promptgate does not yet ask for the diagnosis itself: the client has to send",
        "a rule can ask for the diagnosis now (cache.diagnose): docs/cache-analysis.md",
    ),
    ("`diagnostics`.", "the same paragraph's end"),
    (
        "**Codex** speaks HTTP with a custom provider whose `base_url` is",
        "the README shows Codex's config.toml now, tested",
    ),
    (
        "`http://127.0.0.1:8787/openai/v1` and `wire_api = \"responses\"`. Its built-in",
        "the same paragraph, now the config.toml snippet",
    ),
    (
        "queue_bytes = \"16MiB\"            # body bytes waiting for the writer",
        "the capture queue's bound is on records waiting; a promised place takes no bytes (docs/capture.md)",
    ),
    (
        "`capture.queue_bytes` body bytes, default 16 MiB: what the queue may hold in",
        "the same change",
    ),
    (
        "the writer falls behind (a slow or stalled disk) and the queue is full, the",
        "the same change",
    ),
    (
        "proxy waits up to `capture.queue_wait` for room (backpressure: the request waits",
        "the same change",
    ),
    (
        "before it goes upstream; requests that wait do so in line, first come first",
        "the same change",
    ),
    (
        "served, so none starves while later ones find room; the room it finds is kept",
        "the same change",
    ),
    (
        "for its record, so exchanges admitted together do not overflow the queue when",
        "the same change",
    ),
    ("they end), then lets the", "the same change"),
    (
        "request through and, if the queue is still full when it ends, drops the record,",
        "the same change",
    ),
    (
        "counts it (`dropped`, by reason `dropped_queue_full` / `dropped_closed`, in `/healthz`;",
        "the same change",
    ),
    (
        "`/metrics`) and logs `capture queue full …; record dropped: raise",
        "the same change",
    ),
    (
        "The queue's size trades memory for slack: at 64 concurrent 200 KB requests with",
        "the same change",
    ),
    (
        "everything on, promptgate peaked at 92–94 MB with the default 4 MiB and at",
        "the same change",
    ),
    (
        "108–109 MB with 8 MiB, for the same CPU per request; a closed loop of 200 KB",
        "the same change",
    ),
    (
        "requests at c1, which keeps this 2-core machine busy, waited for the writer a",
        "the same change",
    ),
    (
        "little more often with 4 MiB (p99 3.0–6.0 against 2.6–3.2 ms). The default is",
        "the same change",
    ),
    (
        "16 MiB, for bursts of large requests: a burst of N uploads of S bytes that ends",
        "the same change",
    ),
    (
        "while the writer is busy needs N × S (16 × 1 MiB, or 80 Claude Code turns of",
        "the same change",
    ),
    (
        "200 KB, fit), and the queue holds at most twice its size while every promised",
        "the same change",
    ),
    (
        "place is kept (32 MiB); 200 concurrent 1 MiB uploads need `queue_bytes =",
        "the same change",
    ),
    (
        "\"200MiB\"` (or a longer `capture.queue_wait`), memory those bodies take anyway",
        "the same change",
    ),
    ("while their exchanges run.", "the same change"),
    (
        "| the capture queue | `capture.queue_bytes` (16 MiB); drops counted by reason | holds a burst of 16 × 1 MiB or 80 × 200 KB |",
        "the same change",
    ),
    (
        "on every read. A synthetic",
        "records' metadata compressed against a dictionary: a sentence on it comes between (docs/capture.md)",
    ),
    (
        "100-turn Claude Code conversation (28.7 MB of request bodies) takes 0.69 MB on",
        "the same change: 0.54 MB now",
    ),
    (
        "disk, 2.4 % (`cargo test --test capture -- --nocapture a_100`). The writer",
        "the same change: 1.9 % now",
    ),
    (
        "| memory freed after large answers | given back to the system: glibc's mmap threshold is pinned at 256 KiB; a copy with nothing to redact is shared, not duplicated | 8 concurrent 64 MB streams (16 MiB kept each) peak at 379 MB and fall back to 42 MB once recorded, where they stayed at 315 MB |",
        "the threshold is pinned at 4 MiB now: bodies of 256 KiB-4 MiB were faulted in each time (docs/security.md)",
    ),
    (
        "sent), the rest of the body (its \"skeleton\": keys, commas, message roles,",
        "responses are stored in their records' rows since schema 9, not as units (docs/capture.md)",
    ),
    (
        "`max_tokens`, metadata) and each response body. A record lists its units in",
        "the same change",
    ),
];

#[test]
fn nothing_the_readme_said_was_lost_when_it_moved_to_docs() {
    let before =
        std::fs::read_to_string(root().join("tests/fixtures/readme-before-split.md")).unwrap();
    let now: String = documents()
        .iter()
        .map(|p| normal(&std::fs::read_to_string(p).unwrap()))
        .collect::<Vec<_>>()
        .join(" ");
    // Line by line, so that a new entry in a list does not hide what is kept.
    let mut lost = Vec::new();
    for line in before.lines() {
        let l = normal(line);
        let rewritten = REWRITTEN.iter().any(|(old, _)| normal(old) == l);
        if l.len() >= 12 && !rewritten && !now.contains(&l) {
            lost.push(l);
        }
    }
    assert!(
        lost.is_empty(),
        "{} line(s) of the old README are nowhere now:\n{}",
        lost.len(),
        lost.join("\n")
    );
}

#[test]
fn the_readme_is_a_front_door() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines; the manual goes in docs/"
    );
    // CI runs the test command the README gives.
    assert!(
        readme.lines().any(|l| l.trim() == "tests/run"),
        "the test command"
    );
}

#[test]
fn every_relative_link_reaches_a_file() {
    let mut broken = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        let dir = doc.parent().unwrap();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            rest = &rest[end..];
            let path = target.split('#').next().unwrap_or("");
            if path.is_empty() || path.contains("://") || path.starts_with("mailto:") {
                continue;
            }
            if !Path::new(dir).join(path).exists() {
                broken.push(format!("{}: {target}", doc.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Every verb's `--help`, in the order the reference lists them.
const VERBS: &[&[&str]] = &[
    &[],
    &["captures", "list"],
    &["captures", "tail"],
    &["captures", "show"],
    &["captures", "diff"],
    &["captures", "anatomy"],
    &["captures", "export"],
    &["captures", "conversations"],
    &["cache", "report"],
    &["rules", "check"],
    &["rules", "test"],
    &["replay"],
    &["budgets"],
    &["ca", "init"],
    &["ca", "show"],
    &["env"],
    &["doctor"],
];

/// docs/reference/cli.md is the command line's own `--help` of each verb, so the
/// reference cannot drift from the flags: `PROMPTGATE_BLESS=1` writes it anew.
#[test]
fn the_cli_reference_is_the_clis_own_help() {
    let mut text = String::from(
        "# Command-line reference\n\nEach verb's `--help`, as the binary prints it (generated: \
         `PROMPTGATE_BLESS=1 cargo test --test docs` writes it anew; a test fails when it \
         drifts from the flags).\n",
    );
    for verb in VERBS {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
            .args(*verb)
            .arg("--help")
            .env("COLUMNS", "100")
            .output()
            .unwrap();
        assert!(out.status.success(), "{verb:?} --help");
        let name = if verb.is_empty() {
            "promptgate".to_owned()
        } else {
            format!("promptgate {}", verb.join(" "))
        };
        text.push_str(&format!(
            "\n## `{name}`\n\n```text\n{}```\n",
            String::from_utf8_lossy(&out.stdout)
        ));
    }
    let path = root().join("docs/reference/cli.md");
    if std::env::var_os("PROMPTGATE_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == text,
        "docs/reference/cli.md drifted from the flags: run PROMPTGATE_BLESS=1 cargo test --test docs"
    );
}

/// The README's setup snippets, run: the URLs it tells each client to use reach
/// promptgate (the port it shows, 8787, replaced by the test's), with the official
/// Python SDKs and with curl; pi's models.json snippet is the same base URL.
#[tokio::test(flavor = "multi_thread")]
async fn the_readmes_setup_snippets_work() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let fake = support::FakeProvider::start(support::fake_provider::like_providers).await;
    let proxy = support::Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-openai",
        &fake.url(),
    ]);
    let here = |text: &str| text.replace("http://127.0.0.1:8787", &proxy.url());
    let export = |var: &str| {
        readme
            .lines()
            .find_map(|l| l.trim().strip_prefix(&format!("export {var}=")))
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("the README exports {var}"))
    };
    let anthropic = export("ANTHROPIC_BASE_URL");
    let openai = export("OPENAI_BASE_URL");

    // pi's provider override names the same base URL as Claude Code's variable.
    let pi = readme
        .split("```json\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the README's models.json snippet");
    let pi: serde_json::Value = serde_json::from_str(pi).expect("the snippet is JSON");
    assert_eq!(pi["providers"]["anthropic"]["baseUrl"], anthropic.as_str());
    // opencode's SDK appends /messages: its baseURL is Claude Code's plus /v1.
    let opencode = readme
        .split("```json\n")
        .nth(2)
        .and_then(|rest| rest.split("```").next())
        .expect("the README's opencode snippet");
    let opencode: serde_json::Value = serde_json::from_str(opencode).expect("JSON");
    assert_eq!(
        opencode["provider"]["anthropic"]["options"]["baseURL"],
        format!("{anthropic}/v1")
    );
    // Codex's custom provider is the OpenAI base URL, over the Responses API.
    let codex = readme
        .split("```toml\n")
        .find(|block| block.contains("[model_providers.promptgate]"))
        .and_then(|block| block.split("```").next())
        .expect("the README's Codex snippet");
    let codex: toml::Table = codex.parse().expect("the Codex snippet is TOML");
    let provider = &codex["model_providers"]["promptgate"];
    assert_eq!(codex["model_provider"].as_str(), Some("promptgate"));
    assert_eq!(provider["base_url"].as_str(), Some(openai.as_str()));
    assert_eq!(provider["wire_api"].as_str(), Some("responses"));
    // The three commands point Claude Code where the export does.
    assert!(
        readme.contains(&format!("ANTHROPIC_BASE_URL={anthropic} claude")),
        "the quick start's base URL"
    );

    // curl, as written (its key from the environment).
    let curl = readme
        .split("```sh\n")
        .find(|block| block.starts_with("curl "))
        .and_then(|block| block.split("```").next())
        .expect("the README's curl snippet");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(here(curl))
        .env("ANTHROPIC_API_KEY", "sk-ant-api03-readme-snippet")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("event: message_stop"), "{text}");

    // The SDKs, with the variables as the README sets them.
    let mut exchanges = 1;
    if support::sdk::available() {
        exchanges += 2;
        let result = support::sdk::run(
            &["anthropic_plain", "openai_chat"],
            vec![
                ("ANTHROPIC_BASE_URL", here(&anthropic)),
                ("ANTHROPIC_API_KEY", "sk-ant-api03-readme-snippet".into()),
                ("OPENAI_BASE_URL", here(&openai)),
                ("OPENAI_API_KEY", "sk-proj-readme-snippet".into()),
            ],
        )
        .await;
        assert_eq!(result["anthropic_plain"]["text"], "Hello there", "{result}");
        assert_eq!(result["openai_chat"]["text"], "Hello there", "{result}");
    }
    let lines = proxy
        .wait_exchanges(exchanges, Duration::from_secs(15))
        .await;
    assert!(lines.iter().all(|l| l["status"] == 200), "{lines:?}");
}

/// The metric families promptgate registers, read from the code that registers
/// them (src/metrics.rs: each family's name and help text stand together there):
/// (name, help), sorted.
fn metric_families() -> Vec<(String, String)> {
    let source = std::fs::read_to_string(root().join("src/metrics.rs")).unwrap();
    let literal =
        regex::Regex::new(r#""(promptgate_[a-z0-9_]+)",\s*"((?:[^"\\]|\\[\s\S])*)""#).unwrap();
    let continuation = regex::Regex::new(r"\\\n\s*").unwrap();
    let mut out: Vec<(String, String)> = literal
        .captures_iter(&source)
        .map(|c| {
            (
                c[1].to_owned(),
                continuation.replace_all(&c[2], "").into_owned(),
            )
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// docs/reference/metrics.md lists every family the code registers, with its help
/// text: `PROMPTGATE_BLESS=1` writes it anew; a family added or renamed without it
/// fails here.
#[test]
fn the_metrics_reference_is_what_the_code_registers() {
    let families = metric_families();
    assert!(families.len() >= 30, "{families:?}");
    let mut doc = String::from(
        "# Metrics reference\n\nEvery family `/metrics` serves, with its help text, as \
         src/metrics.rs registers them (generated: `PROMPTGATE_BLESS=1 cargo test --test \
         docs` writes it anew; a test fails when it drifts). Counters are served with \
         `_total`; the labels are in [../team.md](../team.md).\n\n| family | what |\n|---|---|\n",
    );
    for (name, help) in &families {
        doc.push_str(&format!("| `{name}` | {} |\n", help.replace('|', "\\|")));
    }
    let path = root().join("docs/reference/metrics.md");
    if std::env::var_os("PROMPTGATE_BLESS").is_some() {
        std::fs::write(&path, &doc).unwrap();
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == doc,
        "docs/reference/metrics.md drifted from src/metrics.rs: run PROMPTGATE_BLESS=1 cargo test --test docs"
    );
}

/// The fields of `struct NAME` in `source`: (field, type, its doc comment joined).
fn struct_fields(source: &str, name: &str) -> Vec<(String, String, String)> {
    let start = source
        .find(&format!("pub struct {name} {{"))
        .unwrap_or_else(|| panic!("struct {name}"));
    let body = &source[start..];
    let body = &body[body.find('{').unwrap() + 1..body.find("\n}").unwrap()];
    let mut out = Vec::new();
    let mut doc = Vec::new();
    for line in body.lines().map(str::trim) {
        if let Some(d) = line.strip_prefix("///") {
            doc.push(d.trim().to_owned());
        } else if let Some(field) = line.strip_prefix("pub ") {
            if let Some((f, ty)) = field.split_once(": ") {
                out.push((
                    f.to_owned(),
                    ty.trim_end_matches(',').to_owned(),
                    doc.join(" "),
                ));
            }
            doc.clear();
        }
    }
    out
}

/// docs/reference/record.md is the stored record's fields with their doc comments,
/// as src/capture/record.rs declares them (what `captures export` writes):
/// `PROMPTGATE_BLESS=1` writes it anew; a field added without it fails here.
#[test]
fn the_record_reference_is_what_the_code_declares() {
    let source = std::fs::read_to_string(root().join("src/capture/record.rs")).unwrap();
    let mut doc = String::from(
        "# Record reference\n\nThe fields of a stored exchange, as `captures export --format \
         jsonl` writes them and src/capture/record.rs declares them (generated: \
         `PROMPTGATE_BLESS=1 cargo test --test docs` writes it anew; a test fails when it \
         drifts). Optional fields that are empty are left out of a record.\n",
    );
    for (name, title) in [
        ("CaptureRecord", "The record"),
        ("Times", "`times`"),
        ("RequestPart", "`request`"),
        ("ResponsePart", "`response`"),
        (
            "BodyInfo",
            "A body (`request.body`, `request.sent_body`, `response.body`)",
        ),
    ] {
        doc.push_str(&format!(
            "\n## {title}\n\n| field | type | what |\n|---|---|---|\n"
        ));
        for (field, ty, what) in struct_fields(&source, name) {
            doc.push_str(&format!(
                "| `{field}` | `{}` | {} |\n",
                ty.replace('|', "\\|"),
                what.replace('|', "\\|")
            ));
        }
    }
    let path = root().join("docs/reference/record.md");
    if std::env::var_os("PROMPTGATE_BLESS").is_some() {
        std::fs::write(&path, &doc).unwrap();
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == doc,
        "docs/reference/record.md drifted from src/capture/record.rs: run PROMPTGATE_BLESS=1 cargo test --test docs"
    );
}
