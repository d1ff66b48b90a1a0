//! Golden files: command output compared with `tests/golden/NAME.txt` after ids,
//! times, durations and ports are normalised. `PROMPTGATE_BLESS=1` rewrites them.

use std::path::PathBuf;

/// Replaces what changes from run to run: ULIDs (numbered in order of appearance),
/// timestamps, millisecond durations and loopback ports. Ids and times keep their
/// width so tables stay aligned.
pub fn normalise(text: &str) -> String {
    let ulid = regex::Regex::new(r"\b[0-7][0-9A-HJKMNP-TV-Z]{25}\b").unwrap();
    let mut ids: Vec<String> = Vec::new();
    let text = ulid.replace_all(text, |c: &regex::Captures<'_>| {
        let id = c[0].to_owned();
        let n = ids.iter().position(|i| *i == id).unwrap_or_else(|| {
            ids.push(id);
            ids.len() - 1
        });
        format!("{:<26}", format!("<ID{}>", n + 1))
    });
    let time = regex::Regex::new(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(\.\d{3}Z)?").unwrap();
    let text = time.replace_all(&text, |c: &regex::Captures<'_>| {
        format!("{:<w$}", "<TIME>", w = c[0].len())
    });
    let ms = regex::Regex::new(r"\d+\.\d ms").unwrap();
    let text = ms.replace_all(&text, "<MS>");
    let port = regex::Regex::new(r"127\.0\.0\.1:\d+").unwrap();
    port.replace_all(&text, "127.0.0.1:<PORT>").into_owned()
}

/// Compares `got` (normalised) with the golden file `name`; prints both on a mismatch.
pub fn check(name: &str, got: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.txt"));
    let got = normalise(got);
    if std::env::var_os("PROMPTGATE_BLESS").is_some() {
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    if expected != got {
        panic!(
            "{} differs (PROMPTGATE_BLESS=1 rewrites it)\nexpected:\n```\n{expected}```\ngot:\n```\n{got}```",
            path.display()
        );
    }
}
