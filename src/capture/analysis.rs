//! The cache analysis as a capture record keeps it: the whole [`CacheReport`] minus
//! prompt text. Excerpts are dropped, not redacted — a 48-byte window can cut a
//! secret so its shape no longer matches, so `captures show` and `cache report`
//! recompute them from the stored (already redacted) bodies. Keys, tool names and
//! setting values are redacted like any other text.

use crate::cache::CacheReport;
use crate::cache::explain::Reason;
use crate::redact::{Redactor, Summary};

/// `report` ready to store: excerpts dropped, free text redacted. Redactions here are
/// not counted in the record's summary: the same text is counted where it came from.
pub(crate) fn stored(
    report: &CacheReport,
    redactor: &Redactor,
    extra: &[regex::Regex],
) -> CacheReport {
    let mut uncounted = Summary::new();
    let mut text = |t: &str| redactor.redact_text(t, extra, &mut uncounted);
    let mut r = report.without_excerpts();
    r.conversation = text(&r.conversation);
    r.model = text(&r.model);
    r.reason = r.reason.map(|reason| {
        reason.map(&mut |reason| match reason {
            Reason::ToolsChanged {
                added,
                removed,
                changed,
            } => {
                let mut list = |v: Vec<String>| v.iter().map(|s| text(s)).collect();
                Reason::ToolsChanged {
                    added: list(added),
                    removed: list(removed),
                    changed: list(changed),
                }
            }
            Reason::ModelChanged { before, after } => Reason::ModelChanged {
                before: text(&before),
                after: text(&after),
            },
            Reason::SharedPrefix { conversation, by } => Reason::SharedPrefix {
                conversation: text(&conversation),
                by,
            },
            Reason::SettingChanged {
                setting,
                before,
                after,
            } => Reason::SettingChanged {
                setting,
                before: before.map(|b| text(&b)),
                after: after.map(|a| text(&a)),
            },
            other => other,
        })
    });
    if let Some(says) = &mut r.provider_says {
        says.reason = text(&says.reason);
        says.note = says.note.as_deref().map(&mut text);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::explain::{Prediction, Verdict};
    use crate::cache::{Actual, EstimateCheck};

    const SECRET: &str = "sk-ant-api03-ANALYSISSECRET0123456789";

    fn report(reason: Reason) -> CacheReport {
        CacheReport {
            provider: "anthropic".into(),
            conversation: format!("header:{SECRET}"),
            model: "claude-opus-5-5".into(),
            started_ms: 0,
            units: 3,
            positions: 3,
            breakpoints: Vec::new(),
            workspace: None,
            min_tokens: 512,
            prediction: Prediction::default(),
            actual: Actual {
                read: 0,
                write: 10,
                input: 5,
            },
            verdict: Verdict::Unexplained,
            reason: Some(reason),
            lost_tokens: 0,
            baseline: None,
            estimate: EstimateCheck {
                tokens: 15,
                actual: 15,
                error_pct: 0.0,
            },
            cost: None,
            stable: None,
            fix: None,
            respelled: Vec::new(),
            provider_says: None,
        }
    }

    #[test]
    fn excerpts_are_dropped_and_names_redacted_at_any_depth() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let changed = Reason::PrefixChanged {
            unit: "system[2]".into(),
            offset: 40,
            before: Some(format!("…key {SECRET} date 29…")),
            after: Some("…date 30…".into()),
            spelling_only: false,
            by: None,
        };
        let tools = Reason::ToolsChanged {
            added: vec![format!("tool_{SECRET}")],
            removed: Vec::new(),
            changed: Vec::new(),
        };
        for inner in [changed, tools] {
            let r = report(Reason::Unexplained {
                predicted_read: 1,
                actual_read: 0,
                predicted_write: 0,
                actual_write: 10,
                rules: Some(Box::new(inner)),
            });
            let json = serde_json::to_string(&stored(&r, &redactor, &[])).unwrap();
            assert!(!json.contains("ANALYSISSECRET"), "{json}");
            assert!(!json.contains("date"), "no excerpt: {json}");
            assert!(json.contains("[REDACTED:anthropic:"), "{json}");
            let back: CacheReport = serde_json::from_str(&json).unwrap();
            assert_eq!(back.verdict, Verdict::Unexplained, "it reads back");
        }
        let setting = report(Reason::SettingChanged {
            setting: "tool_choice".into(),
            before: Some(format!("{{\"name\":\"{SECRET}\"}}")),
            after: None,
        });
        let json = serde_json::to_string(&stored(&setting, &redactor, &[])).unwrap();
        assert!(!json.contains("ANALYSISSECRET"), "{json}");
    }
}
