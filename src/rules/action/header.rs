//! `header.set` and `header.remove`: request headers in before_provider_headers,
//! response headers in after_provider_response. Values may come from the
//! environment (`${env:NAME}`, read at load); those are secrets, never logged.

use super::ActionError;
use http::{HeaderName, HeaderValue};
use toml::de::DeValue;

use super::Action;
use crate::rules::load::{Cx, Val};
use crate::rules::{Block, State};

/// Headers promptgate itself manages per connection or body: rules may not touch them.
const MANAGED: &[&str] = &[
    "host",
    "content-length",
    "content-encoding",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

fn header_name(cx: &mut Cx<'_>, text: &str, span: std::ops::Range<usize>) -> Option<HeaderName> {
    let Ok(name) = HeaderName::from_bytes(text.as_bytes()) else {
        cx.error(span, format!("invalid header name {text:?}"));
        return None;
    };
    if MANAGED.contains(&name.as_str()) {
        cx.error(
            span,
            format!(
                "header {text:?} is managed by promptgate and cannot be set or removed by a rule"
            ),
        );
        return None;
    }
    Some(name)
}

#[derive(Debug)]
struct Set(Vec<(HeaderName, HeaderValue, bool)>);

impl Action for Set {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        for (name, value, secret) in &self.0 {
            if st.headers.get(name) != Some(value) {
                st.header_changed(name);
            }
            st.headers.insert(name.clone(), value.clone());
            if *secret && !st.effects.secret_headers.contains(name) {
                st.effects.secret_headers.push(name.clone());
            }
        }
        Ok(None)
    }
}

pub(super) fn compile_set(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let DeValue::Table(t) = v.get_ref() else {
        cx.error(
            v.span(),
            "header.set is a table of name = value, e.g. { \"x-org\" = \"acme\" }",
        );
        return None;
    };
    let mut out = Vec::new();
    for (k, value) in t.iter() {
        let name = header_name(cx, k.get_ref(), k.span())?;
        let (text, secret) = cx.env_string(value, &format!("header {}", k.get_ref()))?;
        let Ok(mut value_h) = HeaderValue::from_str(&text) else {
            // Never echo a value that may be a secret.
            cx.error(
                value.span(),
                format!(
                    "the value of header {:?} is not a valid header value",
                    k.get_ref()
                ),
            );
            return None;
        };
        if secret {
            value_h.set_sensitive(true);
            if !cx.secret_headers.contains(&name) {
                cx.secret_headers.push(name.clone());
            }
        }
        out.push((name, value_h, secret));
    }
    Some(Box::new(Set(out)))
}

#[derive(Debug)]
struct Remove(Vec<HeaderName>);

impl Action for Remove {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        for name in &self.0 {
            if st.headers.remove(name).is_some() {
                st.header_changed(name);
            }
        }
        Ok(None)
    }
}

pub(super) fn compile_remove(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let mut out = Vec::new();
    for (text, span) in cx.strings(v, "header.remove")? {
        out.push(header_name(cx, &text, span)?);
    }
    Some(Box::new(Remove(out)))
}
