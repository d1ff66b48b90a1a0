//! The web viewer's files, built into the binary: plain ES modules and CSS, no
//! bundler and no network fetch, so the viewer works offline and the build needs
//! no JS toolchain. The page reads only the JSON API and the live feed.

use bytes::Bytes;
use http::StatusCode;

use super::{AdminResponse, typed};

/// The files, by the path the page asks for.
const FILES: [(&str, &str, &[u8]); 4] = [
    (
        "/",
        "text/html; charset=utf-8",
        include_bytes!("assets/index.html"),
    ),
    (
        "/assets/viewer.js",
        "text/javascript; charset=utf-8",
        include_bytes!("assets/viewer.js"),
    ),
    (
        "/assets/viewer.css",
        "text/css; charset=utf-8",
        include_bytes!("assets/viewer.css"),
    ),
    (
        "/assets/icon.svg",
        "image/svg+xml",
        include_bytes!("assets/icon.svg"),
    ),
];

/// The viewer file at `path`, if it is one.
pub(super) fn asset(path: &str) -> Option<AdminResponse> {
    let path = if path == "/index.html" { "/" } else { path };
    let (_, content_type, bytes) = FILES.iter().find(|(p, _, _)| *p == path)?;
    let mut response = typed(StatusCode::OK, content_type, Bytes::from_static(bytes));
    response.headers_mut().insert(
        http::header::CACHE_CONTROL,
        http::header::HeaderValue::from_static("no-cache"),
    );
    Some(response)
}
