//! Writes the benchmark's request bodies into a directory, built by the same code the
//! tests use (`tests/support/shapes.rs`): `20k` is a Claude Code first turn with only
//! its first tools (about 20 KB, the size of a subagent's request), for the fixed cost
//! per exchange; `50k` is a Claude Code first turn (3
//! system blocks, 12 tools, a `role:"system"` message); `200k` and `1m` are long
//! sessions grown by tool_use / tool_result rounds. Each comes as `NAME-stream.json`
//! (`"stream":true`) and `NAME-json.json` (`"stream":false`).
//!
//! Usage: `bench-payloads DIR`; prints one line per file: `name bytes path`.

#[path = "../tests/support/shapes.rs"]
mod shapes;

use std::path::PathBuf;

use anyhow::Context as _;
use serde_json::Value;

fn main() -> anyhow::Result<()> {
    let dir: PathBuf = std::env::args_os()
        .nth(1)
        .context("usage: bench-payloads DIR")?
        .into();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let first_turn = shapes::claude_code_body(0, shapes::CC_SESSION);
    let mut small_turn = first_turn.clone();
    while shapes::to_bytes(&small_turn).len() > 21_000 {
        let tools = small_turn["tools"]
            .as_array_mut()
            .context("the first turn has tools")?;
        if tools.pop().is_none() {
            break;
        }
    }
    let sessions = [
        ("20k", small_turn),
        ("50k", first_turn),
        ("200k", parse(&shapes::claude_code_body_of_size(200_000))?),
        ("1m", parse(&shapes::claude_code_body_of_size(1_000_000))?),
    ];
    for (name, mut body) in sessions {
        for stream in [true, false] {
            body["stream"] = Value::Bool(stream);
            let bytes = shapes::to_bytes(&body);
            let file = format!("{name}-{}.json", if stream { "stream" } else { "json" });
            let path = dir.join(&file);
            std::fs::write(&path, &bytes).with_context(|| format!("writing {}", path.display()))?;
            println!("{name} {} {}", bytes.len(), path.display());
        }
    }
    Ok(())
}

fn parse(bytes: &[u8]) -> anyhow::Result<Value> {
    serde_json::from_slice(bytes).context("re-reading a generated body")
}
