//! Basic credentials: the proxy's (`Proxy-Authorization`), required on every request
//! when promptgate listens beyond loopback, and the admin API's (`Authorization`).
//!
//! The credentials come from the config file or `PROMPTGATE_PROXY_AUTH`; they are
//! compared in constant time and never printed, not even by `Debug`.

use base64::Engine as _;
use http::HeaderMap;

/// The one accepted `user:password` pair, kept as the header value it yields.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyCredentials {
    expected: Vec<u8>,
}

impl std::fmt::Debug for ProxyCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProxyCredentials(***)")
    }
}

/// Proxy credentials that are not `user:password`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("expected \"user:password\" with both parts non-empty")]
pub struct NotCredentials;

impl ProxyCredentials {
    /// Parses `user:password` (the password may contain colons).
    pub fn parse(text: &str) -> Result<ProxyCredentials, NotCredentials> {
        match text.split_once(':') {
            Some((user, password)) if !user.is_empty() && !password.is_empty() => {
                let encoded = base64::engine::general_purpose::STANDARD.encode(text);
                Ok(ProxyCredentials {
                    expected: format!("Basic {encoded}").into_bytes(),
                })
            }
            _ => Err(NotCredentials),
        }
    }

    /// Whether the request's `Proxy-Authorization` carries these credentials.
    pub fn accepts(&self, headers: &HeaderMap) -> bool {
        self.accepts_in(headers, http::header::PROXY_AUTHORIZATION)
    }

    /// Whether the `header` (`Authorization` for the admin API) carries them.
    pub fn accepts_in(&self, headers: &HeaderMap, header: http::HeaderName) -> bool {
        headers
            .get_all(header)
            .iter()
            .any(|v| same(v.as_bytes(), &self.expected))
    }
}

/// Equal without an early exit, so timing does not tell how much of a guess was right.
fn same(a: &[u8], b: &[u8]) -> bool {
    // The scheme name is case-insensitive (RFC 9110 §11.1); compare it as lowercase.
    let lower = |s: &[u8]| -> Vec<u8> {
        let mut v = s.to_vec();
        if let Some(space) = v.iter().position(|&c| c == b' ') {
            v[..space].make_ascii_lowercase();
        }
        v
    };
    let (a, b) = (lower(a), lower(b));
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(&b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_credentials() {
        let c = ProxyCredentials::parse("alice:s3cret:x").unwrap();
        let mut h = HeaderMap::new();
        assert!(!c.accepts(&h));
        h.insert(
            "proxy-authorization",
            "basic YWxpY2U6czNjcmV0Ong=".parse().unwrap(),
        );
        assert!(c.accepts(&h));
        h.insert(
            "proxy-authorization",
            "Basic YWxpY2U6d3Jvbmc=".parse().unwrap(),
        );
        assert!(!c.accepts(&h));
        assert!(ProxyCredentials::parse("nopassword").is_err());
        assert!(ProxyCredentials::parse(":x").is_err());
        assert_eq!(format!("{c:?}"), "ProxyCredentials(***)");
    }
}
