//! Claude Code's deferred tools (WebFetch, WebSearch): it leaves them out of the
//! request's `tools` and loads them on demand through ToolSearch, so a rule that
//! reads or edits the tools list never sees them. Such rules load with a warning
//! that says why and what works instead.

use globset::GlobSet;

/// The built-in tools Claude Code defers behind ToolSearch.
pub(crate) const DEFERRED_TOOLS: &[&str] = &["WebFetch", "WebSearch"];

/// What works on a deferred tool instead of the tools list.
const INSTEAD: &str = "match the call with `tool_name` in a provider_stream_event rule, \
     or deny the tool in Claude Code's settings (permissions.deny)";

/// "it" or "them".
fn them(names: &[&str]) -> &'static str {
    if names.len() == 1 { "it" } else { "them" }
}

/// The deferred tools `globs` matches.
fn named(globs: &GlobSet) -> Vec<&'static str> {
    DEFERRED_TOOLS
        .iter()
        .copied()
        .filter(|t| globs.is_match(t))
        .collect()
}

/// The load warning for `tools.remove` (`keep_matches` false) or `tools.allow`
/// (true) with these globs, when a deferred tool escapes it.
pub(crate) fn tools_edit_warning(globs: &GlobSet, keep_matches: bool) -> Option<String> {
    if keep_matches {
        let left_out: Vec<&str> = DEFERRED_TOOLS
            .iter()
            .copied()
            .filter(|t| !globs.is_match(t))
            .collect();
        (!left_out.is_empty()).then(|| {
            format!(
                "tools.allow cannot keep out {}: Claude Code defers {} behind ToolSearch, \
                 outside the request's tools; {INSTEAD}",
                left_out.join(", "),
                them(&left_out)
            )
        })
    } else {
        let names = named(globs);
        (!names.is_empty()).then(|| {
            format!(
                "tools.remove never removes {}: Claude Code defers {} behind ToolSearch, \
                 outside the request's tools; {INSTEAD}",
                names.join(", "),
                them(&names)
            )
        })
    }
}

/// The load warning for a `tool` matcher that names a deferred tool.
pub(crate) fn tool_matcher_warning(globs: &GlobSet) -> Option<String> {
    let names = named(globs);
    (!names.is_empty()).then(|| {
        format!(
            "`tool` never sees {}: Claude Code defers {} behind ToolSearch, outside the \
             request's tools; {INSTEAD}",
            names.join(", "),
            them(&names)
        )
    })
}
