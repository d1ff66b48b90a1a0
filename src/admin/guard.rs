//! Who may read the admin API, defined once: the JSON API, the live feed and the
//! viewer all go through [`AdminGuard::check`].

use std::net::SocketAddr;

use http::{StatusCode, header};

use crate::config::Config;
use crate::config::ProxyCredentials;

/// Who may read the admin API: every route (the API, and what else is served on
/// this listener) goes through [`AdminGuard::check`] first. It holds every
/// captured prompt, so it answers only requests addressed to one of its own
/// names — a page in the user's browser that rebinds a DNS name to 127.0.0.1
/// sends its own name as `Host` — and, when it has credentials, only with them.
#[derive(Debug, Clone)]
pub(crate) struct AdminGuard {
    /// Allowed `Host` values, lowercase, each with its port.
    hosts: Vec<String>,
    credentials: Option<ProxyCredentials>,
}

/// Why the guard refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub status: StatusCode,
    pub message: String,
}

impl AdminGuard {
    /// The guard of an admin API bound at `bound`: loopback's names with its port,
    /// `admin_allowed_hosts`, and credentials when it has any (required off loopback).
    pub(crate) fn new(config: &Config, bound: SocketAddr) -> AdminGuard {
        let port = bound.port();
        let mut hosts: Vec<String> = ["127.0.0.1", "localhost", "[::1]"]
            .iter()
            .map(|h| format!("{h}:{port}"))
            .collect();
        // A specific address it is bound to is its own name too: an address typed
        // as such cannot be a rebound DNS name.
        if !bound.ip().is_unspecified() && !bound.ip().is_loopback() {
            hosts.push(bound.to_string());
        }
        for extra in &config.admin_allowed_hosts {
            let extra = extra.trim().to_ascii_lowercase();
            // A name without a port means the admin port.
            hosts.push(match extra.matches(':').count() {
                _ if extra.starts_with('[') && extra.contains("]:") => extra,
                _ if extra.starts_with('[') => format!("{extra}:{port}"),
                0 => format!("{extra}:{port}"),
                1 => extra,
                _ => format!("[{extra}]:{port}"), // a bare IPv6 address
            });
        }
        let credentials = config.admin_auth.clone().or_else(|| {
            (!crate::config::is_default_loopback(bound.ip()))
                .then(|| config.proxy_auth.clone())
                .flatten()
        });
        AdminGuard { hosts, credentials }
    }

    /// Serves the request, or says why not: 400 for more than one `Host`, 403 for a
    /// wrong `Host` or `Origin`, 401 for missing or wrong credentials.
    pub(crate) fn check(&self, headers: &http::HeaderMap, uri: &http::Uri) -> Result<(), Refusal> {
        let forbidden = |message: String| Refusal {
            status: StatusCode::FORBIDDEN,
            message,
        };
        // Which of two a proxy in front would route by is anyone's guess (RFC 9112 §3.2).
        if headers.get_all(header::HOST).iter().nth(1).is_some() {
            return Err(Refusal {
                status: StatusCode::BAD_REQUEST,
                message: "the request has more than one Host header".into(),
            });
        }
        // HTTP/2 names the host in :authority, HTTP/1.1 in Host.
        let host = uri
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| headers.get(header::HOST)?.to_str().ok().map(str::to_owned));
        let Some(host) = host else {
            return Err(forbidden("the request names no host".into()));
        };
        if !self.allows(&host) {
            return Err(forbidden(format!(
                "the admin API does not answer to host {host:?} (allowed: {}; add one with \
                 --admin-allowed-host)",
                self.hosts.join(", ")
            )));
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let named = origin
                .to_str()
                .ok()
                .and_then(|o| o.parse::<http::Uri>().ok())
                .filter(|o| matches!(o.scheme_str(), Some("http" | "https")))
                .and_then(|o| {
                    let authority = o.authority()?;
                    let default = if o.scheme_str() == Some("https") {
                        443
                    } else {
                        80
                    };
                    Some(format!(
                        "{}:{}",
                        authority.host(),
                        authority.port_u16().unwrap_or(default)
                    ))
                });
            if !named.is_some_and(|n| self.allows(&n)) {
                return Err(forbidden(format!(
                    "the admin API does not answer pages from origin {:?}",
                    String::from_utf8_lossy(origin.as_bytes())
                )));
            }
        }
        if let Some(credentials) = &self.credentials
            && !credentials.accepts_in(headers, header::AUTHORIZATION)
        {
            return Err(Refusal {
                status: StatusCode::UNAUTHORIZED,
                message:
                    "the admin API needs credentials: Authorization: Basic (PROMPTGATE_ADMIN_AUTH)"
                        .into(),
            });
        }
        Ok(())
    }

    fn allows(&self, host: &str) -> bool {
        let host = host.trim().to_ascii_lowercase();
        self.hosts.contains(&host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    fn status(guard: &AdminGuard, pairs: &[(&'static str, &str)]) -> Option<u16> {
        let uri: http::Uri = "/api/captures".parse().unwrap();
        guard
            .check(&headers(pairs), &uri)
            .err()
            .map(|r| r.status.as_u16())
    }

    #[test]
    fn the_admin_guard_answers_its_own_names_only() {
        let config = Config {
            admin_allowed_hosts: vec!["pg.internal".into(), "pg.example:443".into()],
            ..Config::default()
        };
        let guard = AdminGuard::new(&config, "127.0.0.1:8788".parse().unwrap());
        for ok in [
            "127.0.0.1:8788",
            "LOCALHOST:8788",
            "[::1]:8788",
            "pg.internal:8788",
            "pg.example:443",
        ] {
            assert_eq!(status(&guard, &[("host", ok)]), None, "{ok}");
        }
        for bad in [
            "rebind.example",
            "rebind.example:8788",
            "127.0.0.1:9999",
            "127.0.0.1",
            "pg.internal:1",
        ] {
            assert_eq!(status(&guard, &[("host", bad)]), Some(403), "{bad}");
        }
        assert_eq!(status(&guard, &[]), Some(403), "no host at all");
        let own = ("host", "127.0.0.1:8788");
        let other = ("host", "rebind.example");
        assert_eq!(status(&guard, &[own, other]), Some(400), "two hosts");
        assert_eq!(status(&guard, &[other, own]), Some(400), "two hosts");
        assert_eq!(
            status(&guard, &[own, own]),
            Some(400),
            "the same host twice"
        );
        let host = ("host", "127.0.0.1:8788");
        assert_eq!(
            status(&guard, &[host, ("origin", "http://127.0.0.1:8788")]),
            None
        );
        assert_eq!(
            status(&guard, &[host, ("origin", "https://pg.example")]),
            None
        );
        for bad in [
            "http://evil.example",
            "null",
            "http://127.0.0.1:9999",
            "file://x",
        ] {
            assert_eq!(status(&guard, &[host, ("origin", bad)]), Some(403), "{bad}");
        }
    }

    #[test]
    fn off_loopback_the_admin_guard_asks_for_credentials() {
        let config = Config {
            proxy_auth: Some(ProxyCredentials::parse("alice:pw").unwrap()),
            admin_allowed_hosts: vec!["10.0.0.5".into()],
            ..Config::default()
        };
        // On loopback the proxy's credentials are not asked for.
        let local = AdminGuard::new(&config, "127.0.0.1:8788".parse().unwrap());
        assert_eq!(status(&local, &[("host", "127.0.0.1:8788")]), None);
        // Off loopback they are, unless the admin API has its own.
        let bound = AdminGuard::new(&config, "10.0.0.7:8788".parse().unwrap());
        assert_eq!(
            status(&bound, &[("host", "10.0.0.7:8788")]),
            Some(401),
            "its own address"
        );
        let remote = AdminGuard::new(&config, "0.0.0.0:8788".parse().unwrap());
        let host = ("host", "10.0.0.5:8788");
        assert_eq!(status(&remote, &[host]), Some(401));
        let wrong = ("authorization", "Basic YWxpY2U6d3Jvbmc=");
        assert_eq!(status(&remote, &[host, wrong]), Some(401));
        let right = ("authorization", "Basic YWxpY2U6cHc=");
        assert_eq!(status(&remote, &[host, right]), None);
        let own = Config {
            admin_auth: Some(ProxyCredentials::parse("ops:secret").unwrap()),
            ..config
        };
        let remote = AdminGuard::new(&own, "0.0.0.0:8788".parse().unwrap());
        assert_eq!(
            status(&remote, &[host, right]),
            Some(401),
            "the admin's own, not the proxy's"
        );
        let ops = ("authorization", "Basic b3BzOnNlY3JldA==");
        assert_eq!(status(&remote, &[host, ops]), None);
    }
}
