//! The live rule set and its hot reload.
//!
//! Exchanges take a snapshot ([`LiveRules::snapshot`]) when they start, so one in
//! flight finishes with the set it began with. The watcher waits for the directory
//! to be quiet, compiles the whole directory, and swaps only a set that compiled;
//! on errors it logs every one and the last good set stays live. It survives the
//! directory being replaced, removed or created after start (see `watch`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::{RecursiveMode, Watcher};

use super::RuleSet;
use super::load::{self, DirSources};

/// How long the directory must be quiet before a reload (editors write in steps).
pub(crate) const DEBOUNCE: Duration = Duration::from_millis(250);

/// The rule set exchanges use now.
#[derive(Debug)]
pub(crate) struct LiveRules {
    current: ArcSwap<RuleSet>,
    reloaded: AtomicU64,
    failed: AtomicU64,
    /// The last reload's result: `None` before the first.
    last: Mutex<Option<LastReload>>,
}

/// Reloads counted since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Reloads {
    pub ok: u64,
    pub failed: u64,
}

/// What the last reload did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct LastReload {
    /// When, in ms since the Unix epoch.
    pub at_ms: u64,
    pub ok: bool,
    /// The first error, when it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Every error, when it failed (a broken directory often has several).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

impl LiveRules {
    pub(crate) fn new(set: RuleSet) -> Self {
        set.start_hooks();
        LiveRules {
            current: ArcSwap::from_pointee(set),
            reloaded: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            last: Mutex::new(None),
        }
    }

    /// How many reloads swapped a new set in, and how many were refused.
    pub(crate) fn reloads(&self) -> Reloads {
        Reloads {
            ok: self.reloaded.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }

    /// The last reload's result, if there was one.
    pub(crate) fn last_reload(&self) -> Option<LastReload> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn note_reload(&self, errors: Vec<String>) {
        let error = errors.first().cloned();
        let counter = if error.is_none() {
            &self.reloaded
        } else {
            &self.failed
        };
        counter.fetch_add(1, Ordering::Relaxed);
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(LastReload {
            at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            ok: error.is_none(),
            error,
            errors,
        });
    }

    /// The set to use for one whole exchange.
    pub(crate) fn snapshot(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    /// How many rules are live and where from, for the start line and `/healthz`:
    /// `3 rules live from ./rules (watched)`, or that `dir` is not there yet.
    pub(crate) fn state(&self, dir: &Path) -> String {
        let n = self.snapshot().rules().len();
        if dir.is_dir() {
            format!(
                "{n} rule{} live from {} (watched)",
                if n == 1 { "" } else { "s" },
                dir.display()
            )
        } else {
            format!(
                "{n} live; {} does not exist, and is loaded when it appears",
                dir.display()
            )
        }
    }

    /// Makes `set` live for exchanges that start from now on.
    pub(crate) fn replace(&self, set: RuleSet) {
        set.start_hooks();
        self.current.store(Arc::new(set));
    }

    /// Compiles what was read from `dir`; swaps on success, logs every error and keeps
    /// the live set on failure.
    pub(crate) fn reload(&self, dir: &Path, sources: &DirSources) -> bool {
        match sources.compile(dir, &|name| std::env::var(name).ok()) {
            Ok(set) => {
                let (rules, files) = (set.rules().len(), set.files.len());
                log_warnings(&set);
                self.replace(set);
                self.note_reload(Vec::new());
                tracing::info!(target: "promptgate::rules", rules, files, dir = %dir.display(), "rules reloaded");
                true
            }
            Err(errors) => {
                self.note_reload(errors.iter().map(ToString::to_string).collect());
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

/// Logs what compiled but is almost surely a mistake, once per load.
pub(crate) fn log_warnings(set: &RuleSet) {
    for w in &set.warnings {
        tracing::warn!(target: "promptgate::rules", "{w}");
    }
}

/// How often the directory is read even without a change event: a safety net for
/// filesystems and mounts that send none.
pub(crate) const POLL: Duration = Duration::from_secs(2);

/// Watches `dir` and reloads `live` whenever what it holds changes, for the life of
/// the process (the watcher thread owns the watcher). `loaded` is what the live set
/// was compiled from (`None`: the directory did not exist).
///
/// The directory entry itself may be replaced (`git checkout`, a rename swap, a
/// ConfigMap `..data` symlink swap), removed or created later: the parent is watched
/// too, the watch on `dir` is re-armed after every change, and a change counts only
/// when the files' names or texts differ from the last read.
pub(crate) fn watch(
    live: Arc<LiveRules>,
    dir: PathBuf,
    loaded: Option<DirSources>,
) -> notify::Result<()> {
    let dir = std::path::absolute(&dir).unwrap_or(dir);
    let parent = dir.parent().map(Path::to_path_buf);
    let (tx, rx) = mpsc::channel::<notify::Result<notify::Event>>();
    let mut watcher = notify::recommended_watcher(move |event| {
        let _ = tx.send(event);
    })?;
    let mut parent_watched = false;
    arm(&mut watcher, &dir, parent.as_deref(), &mut parent_watched);
    std::thread::Builder::new()
        .name("promptgate-rules-watch".into())
        .spawn(move || {
            let mut seen = loaded;
            loop {
                match rx.recv_timeout(POLL) {
                    Ok(first) => {
                        let mut relevant = is_relevant(&dir, &first);
                        // Drain until the directory has been quiet for DEBOUNCE.
                        loop {
                            match rx.recv_timeout(DEBOUNCE) {
                                Ok(event) => relevant |= is_relevant(&dir, &event),
                                Err(mpsc::RecvTimeoutError::Timeout) => break,
                                Err(mpsc::RecvTimeoutError::Disconnected) => return,
                            }
                        }
                        if !relevant {
                            continue;
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
                arm(&mut watcher, &dir, parent.as_deref(), &mut parent_watched);
                let now = dir.is_dir().then(|| load::read_dir(&dir));
                if now == seen {
                    continue;
                }
                match &now {
                    Some(sources) => {
                        live.reload(&dir, sources);
                    }
                    None => tracing::warn!(
                        target: "promptgate::rules",
                        dir = %dir.display(),
                        "the rules directory is gone; the last loaded set stays live until it is back"
                    ),
                }
                seen = now;
            }
        })
        .map_err(|e| notify::Error::generic(&format!("starting the watcher thread: {e}")))?;
    Ok(())
}

/// Watches the parent (until that has worked once: `parent_watched`) and `dir`
/// afresh: a replaced directory is a new inode, and a symlinked one may point
/// elsewhere now.
fn arm(watcher: &mut impl Watcher, dir: &Path, parent: Option<&Path>, parent_watched: &mut bool) {
    if let (false, Some(parent)) = (*parent_watched, parent) {
        *parent_watched = watcher.watch(parent, RecursiveMode::NonRecursive).is_ok();
    }
    let _ = watcher.unwatch(dir);
    if dir.is_dir() {
        let _ = watcher.watch(dir, RecursiveMode::NonRecursive);
    }
}

/// Whether an event may concern the rules: `dir` itself, anything in it (a toml file
/// or a ConfigMap's `..data` link), or a ConfigMap swap beside it.
fn is_relevant(dir: &Path, event: &notify::Result<notify::Event>) -> bool {
    let Ok(event) = event else {
        return true; // a watcher error: re-read to be safe
    };
    if event.kind.is_access() {
        return false;
    }
    let beside = dir.parent();
    event.paths.iter().any(|p| {
        p == dir
            || p.parent() == Some(dir)
            || (p.parent() == beside
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("..")))
    })
}
/// Each exchange runs the rule set live when it began.
impl crate::policy::PolicySource for LiveRules {
    fn current(&self) -> Vec<Arc<dyn crate::policy::Policy>> {
        self.snapshot().policies()
    }
}
