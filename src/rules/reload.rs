//! The live rule set and its hot reload.
//!
//! Exchanges take a snapshot ([`LiveRules::snapshot`]) when they start, so one in
//! flight finishes with the set it began with. The watcher waits for the directory
//! to be quiet, compiles the whole directory, and swaps only a set that compiled;
//! on errors it logs every one and the last good set stays live.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::{RecursiveMode, Watcher};

use super::RuleSet;

/// How long the directory must be quiet before a reload (editors write in steps).
pub const DEBOUNCE: Duration = Duration::from_millis(250);

/// The rule set exchanges use now.
#[derive(Debug)]
pub struct LiveRules {
    current: ArcSwap<RuleSet>,
}

impl LiveRules {
    pub fn new(set: RuleSet) -> Self {
        LiveRules {
            current: ArcSwap::from_pointee(set),
        }
    }

    /// The set to use for one whole exchange.
    pub fn snapshot(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    /// Makes `set` live for exchanges that start from now on.
    pub fn replace(&self, set: RuleSet) {
        self.current.store(Arc::new(set));
    }

    /// Recompiles `dir`; swaps on success, logs every error and keeps the live set on failure.
    pub fn reload(&self, dir: &Path) -> bool {
        match RuleSet::load_dir(dir) {
            Ok(set) => {
                let (rules, files) = (set.rules().len(), set.files.len());
                self.replace(set);
                tracing::info!(target: "promptgate::rules", rules, files, dir = %dir.display(), "rules reloaded");
                true
            }
            Err(errors) => {
                for e in &errors {
                    tracing::error!(target: "promptgate::rules", "{e}");
                }
                tracing::warn!(
                    target: "promptgate::rules",
                    errors = errors.len(),
                    dir = %dir.display(),
                    "rules not reloaded; the last good set stays live"
                );
                false
            }
        }
    }
}

/// Watches `dir` and reloads `live` on every settled change, for the life of the
/// process (the watcher thread owns the watcher).
pub fn watch(live: Arc<LiveRules>, dir: PathBuf) -> notify::Result<()> {
    let (tx, rx) = mpsc::channel::<notify::Result<notify::Event>>();
    let mut watcher = notify::recommended_watcher(move |event| {
        let _ = tx.send(event);
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    std::thread::Builder::new()
        .name("promptgate-rules-watch".into())
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut relevant = is_relevant(&dir, &first);
                // Drain until the directory has been quiet for DEBOUNCE.
                loop {
                    match rx.recv_timeout(DEBOUNCE) {
                        Ok(event) => relevant |= is_relevant(&dir, &event),
                        Err(mpsc::RecvTimeoutError::Timeout) => break,
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                }
                if relevant {
                    live.reload(&dir);
                }
                // Editors may replace the directory entry; watch it again.
                let _ = watcher.watch(&dir, RecursiveMode::NonRecursive);
            }
        })
        .map_err(|e| notify::Error::generic(&format!("starting the watcher thread: {e}")))?;
    Ok(())
}

/// Whether an event concerns the rule files: a `*.toml` at the top of `dir`, or `dir` itself.
fn is_relevant(dir: &Path, event: &notify::Result<notify::Event>) -> bool {
    let Ok(event) = event else {
        return true; // a watcher error: re-read to be safe
    };
    if event.kind.is_access() {
        return false;
    }
    event.paths.iter().any(|p| {
        p == dir
            || (p.extension().is_some_and(|x| x == "toml")
                && p.parent().is_some_and(|d| same_dir(d, dir)))
    })
}

fn same_dir(a: &Path, b: &Path) -> bool {
    a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
}
