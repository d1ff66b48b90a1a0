//! Tests that drive a real agent run it inside a fresh loopback-only network
//! namespace (`unshare --net`, root needed, as in CI): the test re-runs itself
//! there, brings loopback up and checks nothing else is reachable.

use std::path::Path;
use std::process::Command;

/// Set in the re-run: the test is inside its namespace.
const INSIDE: &str = "PROMPTGATE_TEST_IN_NETNS";

/// What the isolated runs need and this machine lacks: `cli` (the agent, `name`
/// in messages), and a network namespace.
pub fn missing_parts(cli: &Path, name: &str) -> Option<String> {
    if !cli.exists() {
        return Some(format!("no {name} at {} — run tests/setup", cli.display()));
    }
    super::missing_command("unshare", &["--net", "true"])
        .map(|why| format!("no loopback-only network namespace: {why} (needs root)"))
}

/// Runs `body` inside a loopback-only namespace: outside it, re-runs `test` of this
/// binary there (or skips, saying why, when `cli` or the namespace is missing).
pub fn isolated<F: std::future::Future<Output = ()>>(
    test: &str,
    cli: &Path,
    name: &str,
    body: impl FnOnce() -> F,
) {
    if !inside_namespace() {
        if super::can_run(missing_parts(cli, name)) {
            run_isolated(test);
        }
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(body());
}

/// Re-runs `test` of this binary inside a fresh loopback-only network namespace.
fn run_isolated(test: &str) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("unshare")
        .args(["--net", "--"])
        .arg(exe)
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(INSIDE, "1")
        .output()
        .expect("unshare runs (util-linux)");
    // Through this test's own output (shown when it fails): the inner run's summary
    // line must not reach tests/run's tally, which would count the test twice.
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "{test} failed inside its network namespace ({})",
        out.status
    );
}

/// Inside the namespace: bring loopback up and check nothing else is there.
fn inside_namespace() -> bool {
    if std::env::var_os(INSIDE).is_none() {
        return false;
    }
    let up = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .unwrap();
    assert!(up.success());
    // /sys/class/net still shows the host's view; ask the namespace itself.
    let links = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    let interfaces: Vec<String> = String::from_utf8_lossy(&links.stdout)
        .lines()
        .filter_map(|l| l.split(':').nth(1))
        .map(|name| name.trim().to_owned())
        .collect();
    assert_eq!(interfaces, ["lo"], "the namespace has only loopback");
    true
}
