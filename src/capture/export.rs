//! Exports of stored records: JSONL (one whole record per line, bodies byte-exact)
//! and HAR 1.2 (what browser developer tools and HAR viewers import).

use std::io::{self, Write};

use serde_json::{Value, json};

use super::record::{BodyInfo, CaptureRecord};

/// Writes one JSON line per record, bodies included (see [`BodyInfo::with_content`]).
pub(crate) fn jsonl(records: Vec<CaptureRecord>, out: &mut dyn Write) -> io::Result<()> {
    for mut record in records {
        record.with_contents();
        serde_json::to_writer(&mut *out, &record)?;
        out.write_all(b"\n")?;
    }
    Ok(())
}

/// A HAR 1.2 document of the records: the request as sent upstream, the response
/// as the client got it; promptgate's own fields under `_promptgate`.
pub(crate) fn har(records: &[CaptureRecord]) -> Value {
    let entries: Vec<Value> = records.iter().map(har_entry).collect();
    json!({
        "log": {
            "version": "1.2",
            "creator": {"name": "promptgate", "version": env!("CARGO_PKG_VERSION")},
            "pages": [],
            "entries": entries,
        }
    })
}

fn har_entry(r: &CaptureRecord) -> Value {
    let url = r.upstream_url.clone().unwrap_or_else(|| {
        format!(
            "http://{}{}",
            r.host.as_deref().unwrap_or("localhost"),
            r.path
        )
    });
    let query: Vec<Value> = url
        .split_once('?')
        .map(|(_, q)| {
            q.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    json!({"name": k, "value": v})
                })
                .collect()
        })
        .unwrap_or_default();
    let sent = r.sent();
    let mut request = json!({
        "method": r.method,
        "url": url,
        "httpVersion": "HTTP/1.1",
        "cookies": [],
        "headers": har_headers(&r.request.sent_headers),
        "queryString": query,
        "headersSize": -1,
        "bodySize": sent.size,
    });
    if sent.size > 0 || !sent.bytes.is_empty() {
        let (text, _) = har_text(sent);
        request["postData"] = json!({
            "mimeType": header(&r.request.sent_headers, "content-type").unwrap_or("application/json"),
            "text": text,
        });
    }
    let (text, encoding) = har_text(&r.response.body);
    let mut content = json!({
        "size": r.response.body.size,
        "mimeType": header(&r.response.headers, "content-type").unwrap_or("x-unknown"),
        "text": text,
    });
    if let Some(e) = encoding {
        content["encoding"] = json!(e);
    }
    let status = r.response.status.unwrap_or(0);
    let total = r.times.total_ms.max(0.0);
    let wait = r
        .times
        .upstream_headers_ms
        .unwrap_or(total)
        .clamp(0.0, total);
    json!({
        "startedDateTime": r.started_at,
        "time": total,
        "request": request,
        "response": {
            "status": status,
            "statusText": http::StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or(""),
            "httpVersion": "HTTP/1.1",
            "cookies": [],
            "headers": har_headers(&r.response.headers),
            "content": content,
            "redirectURL": "",
            "headersSize": -1,
            "bodySize": r.bytes_out,
        },
        "cache": {},
        "timings": {"blocked": -1, "dns": -1, "connect": -1, "ssl": -1, "send": 0, "wait": wait, "receive": total - wait},
        "comment": format!("promptgate {} {}", r.id, r.outcome),
        "_promptgate": {
            "id": r.id,
            "outcome": r.outcome,
            "error": r.error,
            "conversation": r.conversation,
            "model": r.model,
            "usage": r.usage,
            "cache": r.cache,
            "rules_fired": r.rules_fired,
            "tags": r.tags,
            "redactions": r.redactions,
            "digest": r.digest,
            "received_digest": r.received_digest,
            "sent_digest": r.sent_digest,
            "body_sent_differs": r.request.sent_body.is_some(),
        },
    })
}

fn har_headers(headers: &[(String, String)]) -> Vec<Value> {
    headers
        .iter()
        .map(|(k, v)| json!({"name": k, "value": v}))
        .collect()
}

fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// A body as HAR text: UTF-8 as is, anything else base64 (with its encoding name).
fn har_text(body: &BodyInfo) -> (String, Option<&'static str>) {
    match std::str::from_utf8(&body.bytes) {
        Ok(t) => (t.to_owned(), None),
        Err(_) => {
            let mut b = body.clone();
            b.with_content();
            let text = b
                .content
                .and_then(|c| serde_json::from_str::<String>(c.get()).ok())
                .unwrap_or_default();
            (text, Some("base64"))
        }
    }
}
