//! One typed [`Config`] from three layers: defaults, `promptgate.toml` (`--config`),
//! and command-line flags, flags winning.
//!
//! Both outer layers arrive as the same raw [`ConfigLayer`] (strings as typed), so
//! every value is validated in one place and a bad one is reported the same way
//! whichever layer it came from — with `file:line:col` when it came from the file.

pub(crate) mod auth;
pub(crate) mod intercept;

pub(crate) use auth::ProxyCredentials;
pub(crate) use intercept::InterceptList;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::capture::{CaptureLayer, CaptureSettings};
use crate::conversation::KeySource;
use crate::logging::LogFormat;
use crate::setting::{BaseUrl, ConfigError, Scalar, line_col, nearest, parse_duration, parse_size};

/// Raw settings as written in the config file or given as flags.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigLayer {
    pub listen: Option<String>,
    pub upstream_anthropic: Option<String>,
    pub upstream_openai: Option<String>,
    pub upstream_ca: Option<Vec<PathBuf>>,
    pub max_body: Option<Scalar>,
    pub log_format: Option<String>,
    /// `"relay"` or `"refuse"`: what a WebSocket upgrade on an OpenAI route gets.
    pub websocket: Option<String>,
    pub connect_timeout: Option<Scalar>,
    pub upstream_timeout: Option<Scalar>,
    pub idle_timeout: Option<Scalar>,
    pub header_timeout: Option<Scalar>,
    pub body_timeout: Option<Scalar>,
    pub body_total_timeout: Option<Scalar>,
    pub max_connections: Option<usize>,
    pub max_connections_per_client: Option<usize>,
    pub shutdown_grace: Option<Scalar>,
    pub workers: Option<usize>,
    pub certs: Option<PathBuf>,
    pub intercept: Option<Vec<String>>,
    pub resolve: Option<Vec<String>>,
    pub intercept_only: Option<bool>,
    pub connect_ports: Option<Vec<u16>>,
    pub allow_remote: Option<bool>,
    /// `user:password`; from the file or `PROMPTGATE_PROXY_AUTH`, never a flag.
    pub proxy_auth: Option<String>,
    pub rules: Option<PathBuf>,
    /// `[cache]`: prompt-cache analysis (file only).
    pub cache: Option<crate::cache::CacheConfigLayer>,
    /// The admin API's address, or `"off"`.
    pub admin: Option<String>,
    /// More `Host` values the admin API answers to (its DNS name behind a proxy).
    pub admin_allowed_hosts: Option<Vec<String>>,
    /// `user:password` for the admin API; from the file or `PROMPTGATE_ADMIN_AUTH`.
    pub admin_auth: Option<String>,
    /// Connections the admin API holds open at once.
    pub admin_max_connections: Option<usize>,
    /// Viewers of the admin API's live feed at once.
    pub admin_live_max_viewers: Option<usize>,
    /// Bytes one live-feed viewer may have waiting before it is dropped.
    pub admin_live_backlog: Option<Scalar>,
    /// A request header naming the conversation (after Claude Code's own ids).
    pub conversation_header: Option<String>,
    /// A JSON pointer into the request body naming the conversation.
    pub conversation_pointer: Option<String>,
    pub capture: Option<CaptureLayer>,
    /// `[metrics]`: the Prometheus series.
    pub metrics: Option<crate::metrics::MetricsLayer>,
    /// `[traces]`: OTLP trace export.
    pub traces: Option<crate::traces::TracesLayer>,
    /// `[stream]`: the stall watchdog.
    pub stream: Option<crate::observer::stall::StreamLayer>,
}

/// The validated configuration of `promptgate serve`.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the proxy listens.
    pub listen: SocketAddr,
    /// Where Anthropic routes are forwarded.
    pub upstream_anthropic: BaseUrl,
    /// Where OpenAI routes (`/openai/…`) are forwarded.
    pub upstream_openai: BaseUrl,
    /// Extra PEM roots trusted for upstream TLS.
    pub upstream_ca: Vec<PathBuf>,
    /// The largest request body accepted, in bytes.
    pub max_body: u64,
    pub log_format: LogFormat,
    /// What a WebSocket upgrade (Codex's Responses socket) gets.
    pub websocket: crate::exchange::WebSocket,
    /// Time allowed to open a TCP connection (and TLS) to the upstream.
    pub connect_timeout: Duration,
    /// Time allowed for the upstream's response head (non-streamed answers can take minutes).
    pub upstream_timeout: Duration,
    /// Longest silence allowed between response body chunks; a live stream is never cut.
    pub idle_timeout: Duration,
    /// Time a client connection gets to send a request head: the first one, and
    /// each next one on a kept-alive connection.
    pub header_timeout: Duration,
    /// Longest silence allowed while a request body arrives.
    pub body_timeout: Duration,
    /// Longest a whole request body may take to arrive, however steadily it trickles.
    pub body_total_timeout: Duration,
    /// Client connections open at once, in all; past it new ones get a 503.
    pub max_connections: usize,
    /// Client connections open at once from one address; 0 = no such cap (behind
    /// a load balancer every client shares its address).
    pub max_connections_per_client: usize,
    /// How long in-flight exchanges may take to finish after SIGINT/SIGTERM.
    pub shutdown_grace: Duration,
    /// Serving threads (each a single-threaded runtime); 0 means one per core.
    pub workers: usize,
    /// Where the forward-proxy CA lives.
    pub certs: PathBuf,
    /// Hosts whose CONNECT tunnels are intercepted, with their provider.
    pub intercept: InterceptList,
    /// Intercepted hosts sent to another upstream (`--resolve HOST=URL`), host lowercase.
    pub resolve: Vec<(String, BaseUrl)>,
    /// Refuse CONNECT to hosts that are not intercepted instead of tunnelling them.
    pub intercept_only: bool,
    /// Ports CONNECT may reach.
    pub connect_ports: Vec<u16>,
    /// Listening beyond loopback was asked for explicitly.
    pub allow_remote: bool,
    /// Credentials every request must carry (required with `allow_remote`).
    pub proxy_auth: Option<ProxyCredentials>,
    /// The hook rules directory.
    pub rules_dir: PathBuf,
    /// Whether `rules_dir` was given (a missing default directory just means no rules).
    pub rules_explicit: bool,
    /// Prompt-cache analysis: on/off, ignored units, minimum lengths, prices.
    pub cache: crate::cache::CacheSettings,
    /// Where the read-only admin API listens; `None` when it is off.
    pub admin: Option<SocketAddr>,
    /// Extra `Host` values the admin API answers to, beyond loopback's own names.
    pub admin_allowed_hosts: Vec<String>,
    /// Credentials the admin API asks for (`Authorization: Basic`).
    pub admin_auth: Option<ProxyCredentials>,
    /// Connections the admin API holds open at once (default 128: a few browser tabs
    /// and scrapers); past it a new one gets a 503 and is closed, so idle admin
    /// sockets cannot use up the file descriptors the proxy port needs.
    pub admin_max_connections: usize,
    /// Viewers of `/api/live` at once (default 32); past it a new one gets a 503.
    pub admin_live_max_viewers: usize,
    /// Bytes of events one live-feed viewer may have waiting (default 4 MiB); a
    /// viewer that takes none of them for a while is sent `reload` and dropped.
    pub admin_live_backlog: usize,
    /// Extra sources of conversation keys.
    pub conversation: KeySource,
    pub capture: CaptureSettings,
    pub metrics: crate::metrics::MetricsSettings,
    pub traces: crate::traces::TracesSettings,
    /// The stall watchdog of streamed answers.
    pub stream: crate::observer::stall::StallSettings,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
            upstream_anthropic: BaseUrl::parse("https://api.anthropic.com")
                .expect("the default Anthropic URL is valid"),
            upstream_openai: BaseUrl::parse("https://api.openai.com")
                .expect("the default OpenAI URL is valid"),
            upstream_ca: Vec::new(),
            max_body: 32 << 20,
            log_format: LogFormat::Text,
            websocket: crate::exchange::WebSocket::Relay,
            connect_timeout: Duration::from_secs(10),
            // The SDKs' own read timeout is 600 s; promptgate must not be the shorter one.
            upstream_timeout: Duration::from_secs(600),
            idle_timeout: Duration::from_secs(600),
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            // A --max-body (32 MiB) body over a slow 1 Mbit/s uplink takes ~270 s.
            body_total_timeout: Duration::from_secs(300),
            max_connections: 4096,
            max_connections_per_client: 512,
            shutdown_grace: Duration::from_secs(30),
            workers: 0,
            certs: crate::runtime::data_dir().join("certs"),
            intercept: InterceptList::default(),
            resolve: Vec::new(),
            intercept_only: false,
            connect_ports: vec![443],
            allow_remote: false,
            proxy_auth: None,
            rules_dir: PathBuf::from("rules"),
            rules_explicit: false,
            cache: crate::cache::CacheSettings::default(),
            admin: Some(SocketAddr::from(([127, 0, 0, 1], 8788))),
            admin_allowed_hosts: Vec::new(),
            admin_auth: None,
            admin_max_connections: 128,
            admin_live_max_viewers: 32,
            admin_live_backlog: 4 << 20,
            conversation: KeySource::default(),
            capture: CaptureSettings::default(),
            metrics: crate::metrics::MetricsSettings::default(),
            traces: crate::traces::TracesSettings::default(),
            stream: crate::observer::stall::StallSettings::default(),
        }
    }
}

impl Config {
    /// Builds the configuration: defaults, then the file at `config_path` (if any),
    /// then `flags`.
    pub fn load(config_path: Option<&Path>, flags: ConfigLayer) -> Result<Config, ConfigError> {
        let mut config = Config::default();
        if let Some(path) = config_path {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.display().to_string(),
                source,
            })?;
            let mut file = parse_layer(&text, &path.display().to_string())?;
            // Relative CA paths in a file are relative to the file.
            if let (Some(cas), Some(dir)) = (file.upstream_ca.as_mut(), path.parent()) {
                for ca in cas.iter_mut().filter(|p| p.is_relative()) {
                    *ca = dir.join(&*ca);
                }
            }
            if let (Some(certs), Some(dir)) = (file.certs.as_mut(), path.parent())
                && certs.is_relative()
            {
                *certs = dir.join(&*certs);
            }
            if let (Some(rules), Some(dir)) = (file.rules.as_mut(), path.parent())
                && rules.is_relative()
            {
                *rules = dir.join(&*rules);
            }
            config.apply(file, path.parent())?;
        }
        config.apply(flags, None)?;
        config.check_forward()?;
        if config
            .admin
            .is_some_and(|a| a == config.listen && a.port() != 0)
        {
            return Err(ConfigError::Invalid {
                setting: "admin",
                message: format!(
                    "{} is the proxy's own address; the admin API needs its own (e.g. \"127.0.0.1:8788\") or \"off\"",
                    config.listen
                ),
            });
        }
        Ok(config)
    }

    /// Checks that only make sense on the merged layers.
    fn check_forward(&self) -> Result<(), ConfigError> {
        if !is_default_loopback(self.listen.ip()) && !self.allow_remote {
            return Err(ConfigError::Invalid {
                setting: "listen",
                message: format!(
                    "{} is not 127.0.0.1 or ::1; to accept other clients pass --allow-remote \
                     and set proxy credentials (PROMPTGATE_PROXY_AUTH=user:password)",
                    self.listen
                ),
            });
        }
        // The proxy port beyond loopback; an admin API beyond loopback is checked below.
        if self.allow_remote && !is_default_loopback(self.listen.ip()) && self.proxy_auth.is_none()
        {
            return Err(ConfigError::Invalid {
                setting: "allow-remote",
                message:
                    "remote clients must authenticate: set PROMPTGATE_PROXY_AUTH=user:password \
                          or proxy_auth in the config file"
                        .into(),
            });
        }
        if let Some(admin) = self.admin
            && !is_default_loopback(admin.ip())
        {
            if !self.allow_remote {
                return Err(ConfigError::Invalid {
                    setting: "admin",
                    message: format!(
                        "{admin} is not 127.0.0.1 or ::1, and the admin API serves every captured \
                         prompt; to serve it there pass --allow-remote and set credentials \
                         (PROMPTGATE_ADMIN_AUTH=user:password, or the proxy's)"
                    ),
                });
            }
            if self.admin_auth.is_none() && self.proxy_auth.is_none() {
                return Err(ConfigError::Invalid {
                    setting: "admin",
                    message: "an admin API beyond loopback needs credentials: set \
                              PROMPTGATE_ADMIN_AUTH=user:password (or admin_auth in the config \
                              file, or the proxy's PROMPTGATE_PROXY_AUTH)"
                        .into(),
                });
            }
        }
        for (host, _) in &self.resolve {
            if self.intercept.provider_for(host).is_none() {
                return Err(ConfigError::Invalid {
                    setting: "resolve",
                    message: format!(
                        "{host:?} is not intercepted (intercept list: {}), so it has nothing to resolve",
                        self.intercept.patterns().join(", ")
                    ),
                });
            }
        }
        Ok(())
    }

    /// Where an intercepted host's requests go: its `--resolve` URL, or the host itself.
    pub fn upstream_for(
        &self,
        host: &str,
        port: u16,
        scheme: &str,
    ) -> Result<BaseUrl, crate::setting::SettingError> {
        if let Some((_, url)) = self
            .resolve
            .iter()
            .find(|(h, _)| h.eq_ignore_ascii_case(host))
        {
            return Ok(url.clone());
        }
        let default_port = if scheme == "https" { 443 } else { 80 };
        if port == default_port {
            BaseUrl::parse(&format!("{scheme}://{host}"))
        } else {
            BaseUrl::parse(&format!("{scheme}://{host}:{port}"))
        }
    }

    // One `if let` per setting of the file and the flags, in their order: splitting it would scatter the table.
    #[allow(clippy::too_many_lines)]
    fn apply(&mut self, layer: ConfigLayer, base: Option<&Path>) -> Result<(), ConfigError> {
        if let Some(v) = layer.listen {
            self.listen = v.parse().map_err(|_| ConfigError::Invalid {
                setting: "listen",
                message: format!(
                    "{v:?} is not an address and port (expected e.g. \"127.0.0.1:8787\")"
                ),
            })?;
        }
        if let Some(v) = layer.upstream_anthropic {
            self.upstream_anthropic = BaseUrl::parse(&v).map_err(|e| ConfigError::Invalid {
                setting: "upstream-anthropic",
                message: e.to_string(),
            })?;
        }
        if let Some(v) = layer.upstream_openai {
            self.upstream_openai = BaseUrl::parse(&v).map_err(|e| ConfigError::Invalid {
                setting: "upstream-openai",
                message: e.to_string(),
            })?;
        }
        if let Some(v) = layer.rules {
            self.rules_dir = v;
            self.rules_explicit = true;
        }
        if let Some(v) = layer.upstream_ca {
            self.upstream_ca = v;
        }
        if let Some(v) = layer.max_body {
            self.max_body = parse_size(&v).map_err(|e| ConfigError::Invalid {
                setting: "max-body",
                message: e.to_string(),
            })?;
        }
        if let Some(v) = layer.log_format {
            self.log_format = match v.as_str() {
                "text" => LogFormat::Text,
                "json" => LogFormat::Json,
                _ => {
                    return Err(ConfigError::Invalid {
                        setting: "log-format",
                        message: format!(
                            "{v:?} is not a log format (expected \"text\" or \"json\")"
                        ),
                    });
                }
            };
        }
        if let Some(v) = layer.websocket {
            self.websocket = match v.as_str() {
                "relay" => crate::exchange::WebSocket::Relay,
                "refuse" => crate::exchange::WebSocket::Refuse,
                _ => {
                    return Err(ConfigError::Invalid {
                        setting: "websocket",
                        message: format!("{v:?} is not \"relay\" or \"refuse\""),
                    });
                }
            };
        }
        if let Some(v) = layer.certs {
            self.certs = v;
        }
        if let Some(v) = layer.intercept {
            self.intercept = InterceptList::parse(&v).map_err(|e| ConfigError::Invalid {
                setting: "intercept",
                message: e.to_string(),
            })?;
        }
        if let Some(v) = layer.resolve {
            self.resolve = v
                .iter()
                .map(|entry| parse_resolve(entry))
                .collect::<Result<_, _>>()
                .map_err(|e| ConfigError::Invalid {
                    setting: "resolve",
                    message: e.to_string(),
                })?;
        }
        if let Some(v) = layer.intercept_only {
            self.intercept_only = v;
        }
        if let Some(v) = layer.connect_ports {
            if v.is_empty() || v.contains(&0) {
                return Err(ConfigError::Invalid {
                    setting: "connect-ports",
                    message: "expected one or more ports from 1 to 65535, e.g. [443]".into(),
                });
            }
            self.connect_ports = v;
        }
        if let Some(v) = layer.allow_remote {
            self.allow_remote = v;
        }
        let credentials = |setting, v: Option<String>| {
            v.map(|v| {
                ProxyCredentials::parse(&v).map_err(|e| ConfigError::Invalid {
                    setting,
                    message: e.to_string(),
                })
            })
            .transpose()
        };
        if let Some(c) = credentials("proxy-auth", layer.proxy_auth)? {
            self.proxy_auth = Some(c);
        }
        if let Some(c) = credentials("admin-auth", layer.admin_auth)? {
            self.admin_auth = Some(c);
        }
        if let Some(v) = layer.admin {
            self.admin = if v.trim().eq_ignore_ascii_case("off") {
                None
            } else {
                Some(v.parse().map_err(|_| ConfigError::Invalid {
                    setting: "admin",
                    message: format!(
                        "{v:?} is not an address and port (expected e.g. \"127.0.0.1:8788\" or \"off\")"
                    ),
                })?)
            };
        }
        if let Some(v) = layer.admin_allowed_hosts {
            self.admin_allowed_hosts = v;
        }
        if let Some(v) = layer.conversation_header {
            self.conversation.header =
                Some(http::HeaderName::from_bytes(v.as_bytes()).map_err(|_| {
                    ConfigError::Invalid {
                        setting: "conversation-header",
                        message: format!(
                            "{v:?} is not a header name (expected e.g. \"x-session\")"
                        ),
                    }
                })?);
        }
        if let Some(v) = layer.conversation_pointer {
            if !v.is_empty() && !v.starts_with('/') {
                return Err(ConfigError::Invalid {
                    setting: "conversation-pointer",
                    message: format!(
                        "{v:?} is not a JSON pointer (expected e.g. \"/metadata/conversation\")"
                    ),
                });
            }
            self.conversation.pointer = Some(v);
        }
        if let Some(capture) = layer.capture {
            self.capture.apply(capture, base)?;
        }
        if let Some(v) = layer.workers {
            self.workers = v;
        }
        if let Some(v) = layer.max_connections {
            if v == 0 {
                return Err(ConfigError::Invalid {
                    setting: "max-connections",
                    message: "expected at least 1 (e.g. 4096)".into(),
                });
            }
            self.max_connections = v;
        }
        if let Some(v) = layer.max_connections_per_client {
            self.max_connections_per_client = v;
        }
        for (setting, value, slot) in [
            (
                "admin-max-connections",
                layer.admin_max_connections,
                &mut self.admin_max_connections,
            ),
            (
                "admin-live-max-viewers",
                layer.admin_live_max_viewers,
                &mut self.admin_live_max_viewers,
            ),
        ] {
            match value {
                Some(0) => {
                    return Err(ConfigError::Invalid {
                        setting,
                        message: "expected at least 1".into(),
                    });
                }
                Some(v) => *slot = v,
                None => {}
            }
        }
        if let Some(v) = layer.admin_live_backlog {
            let setting = "admin-live-backlog";
            let bytes = parse_size(&v).map_err(|e| ConfigError::Invalid {
                setting,
                message: e.to_string(),
            })?;
            // Below one progress event (64 KiB of text) a busy stream would drop every viewer.
            if bytes < 64 << 10 {
                return Err(ConfigError::Invalid {
                    setting,
                    message: format!("{bytes} bytes is below the least, 64KiB"),
                });
            }
            self.admin_live_backlog = usize::try_from(bytes).unwrap_or(usize::MAX);
        }
        for (setting, value, slot) in [
            (
                "connect-timeout",
                layer.connect_timeout,
                &mut self.connect_timeout,
            ),
            (
                "upstream-timeout",
                layer.upstream_timeout,
                &mut self.upstream_timeout,
            ),
            ("idle-timeout", layer.idle_timeout, &mut self.idle_timeout),
            (
                "header-timeout",
                layer.header_timeout,
                &mut self.header_timeout,
            ),
            ("body-timeout", layer.body_timeout, &mut self.body_timeout),
            (
                "body-total-timeout",
                layer.body_total_timeout,
                &mut self.body_total_timeout,
            ),
            (
                "shutdown-grace",
                layer.shutdown_grace,
                &mut self.shutdown_grace,
            ),
        ] {
            if let Some(v) = value {
                *slot = parse_duration(&v).map_err(|e| ConfigError::Invalid {
                    setting,
                    message: e.to_string(),
                })?;
            }
        }
        if let Some(stream) = layer.stream {
            self.stream
                .apply(stream)
                .map_err(|(setting, message)| ConfigError::Invalid { setting, message })?;
        }
        if let Some(metrics) = layer.metrics {
            self.metrics.apply(metrics);
        }
        if let Some(traces) = layer.traces {
            self.traces
                .apply(traces)
                .map_err(|e| ConfigError::Invalid {
                    setting: "traces",
                    message: e.to_string(),
                })?;
        }
        if let Some(cache) = layer.cache {
            self.cache.apply(cache).map_err(|e| ConfigError::Invalid {
                setting: "cache",
                message: e.to_string(),
            })?;
        }
        Ok(())
    }
}

/// Whether `ip` is the plain loopback address that needs no `--allow-remote`.
/// Other 127.x addresses count as remote too: they are easy to publish (container
/// port maps), and one rule is easier to trust than a subnet.
pub(crate) fn is_default_loopback(ip: std::net::IpAddr) -> bool {
    ip == std::net::Ipv4Addr::LOCALHOST || ip == std::net::Ipv6Addr::LOCALHOST
}

/// `HOST=URL`: an intercepted host and the upstream its requests go to instead.
fn parse_resolve(entry: &str) -> Result<(String, BaseUrl), BadResolve> {
    let (host, url) = entry
        .split_once('=')
        .ok_or_else(|| BadResolve::NotHostUrl(entry.to_owned()))?;
    let host = host.trim().trim_end_matches('.').to_ascii_lowercase();
    if host.is_empty() || host.contains(['/', ':', '*']) {
        return Err(BadResolve::NotAHost(entry.to_owned(), host));
    }
    Ok((host, BaseUrl::parse(url.trim())?))
}

/// Why a `--resolve HOST=URL` entry is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum BadResolve {
    #[error("{0:?} is not HOST=URL (expected e.g. \"api.anthropic.com=https://127.0.0.1:9443\")")]
    NotHostUrl(String),
    #[error("{0:?}: {1:?} is not a host name")]
    NotAHost(String, String),
    #[error(transparent)]
    Url(#[from] crate::setting::SettingError),
}

/// Parses TOML text into a layer, reporting errors as `name:line:col: message`.
pub(crate) fn parse_layer(text: &str, name: &str) -> Result<ConfigLayer, ConfigError> {
    toml::from_str(text).map_err(|e| {
        let (line, col) = e
            .span()
            .map(|span| line_col(text, span.start))
            .unwrap_or((1, 1));
        let message = e.message().trim_end();
        ConfigError::Parse {
            location: format!("{name}:{line}:{col}"),
            message: unknown_key(message).unwrap_or_else(|| message.to_owned()),
        }
    })
}

/// serde's "unknown field `x`, expected one of `a`, `b`" as the rules say it:
/// `unknown key "x"; did you mean "a"? (known: a, b)`.
fn unknown_key(message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let known: Vec<&str> = rest.split('`').skip(1).step_by(2).collect();
    let mut out = format!("unknown key {key:?}");
    if let Some(near) = nearest(key, &known) {
        out.push_str(&format!("; did you mean {near:?}?"));
    }
    out.push_str(&format!(" (known: {})", known.join(", ")));
    Some(out)
}

impl Config {
    /// What an exchange needs of the configuration.
    pub fn exchange_settings(&self) -> crate::exchange::Settings {
        crate::exchange::Settings {
            max_body: self.max_body,
            body_timeout: self.body_timeout,
            body_total_timeout: self.body_total_timeout,
            upstream_timeout: self.upstream_timeout,
            idle_timeout: self.idle_timeout,
            stream: self.stream,
            max_response: self.capture.max_response,
            websocket: self.websocket,
            upstream_anthropic: self.upstream_anthropic.clone(),
            upstream_openai: self.upstream_openai.clone(),
            conversation: self.conversation.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size(&Scalar::Number(5)), Ok(5));
        assert_eq!(parse_size(&"32MiB".to_owned().into()), Ok(32 << 20));
        assert_eq!(parse_size(&"1 KB".to_owned().into()), Ok(1000));
        assert!(parse_size(&"12 parsecs".to_owned().into()).is_err());
        assert_eq!(
            parse_duration(&"250ms".to_owned().into()),
            Ok(Duration::from_millis(250))
        );
        assert_eq!(
            parse_duration(&"5m".to_owned().into()),
            Ok(Duration::from_secs(300))
        );
        assert_eq!(
            parse_duration(&Scalar::Number(7)),
            Ok(Duration::from_secs(7))
        );
        assert!(parse_duration(&"soon".to_owned().into()).is_err());
    }

    #[test]
    fn the_admin_listener_bounds_have_defaults_and_a_floor() {
        let c = Config::load(None, ConfigLayer::default()).unwrap();
        assert_eq!(
            (
                c.admin_max_connections,
                c.admin_live_max_viewers,
                c.admin_live_backlog
            ),
            (128, 32, 4 << 20)
        );
        let layer = parse_layer(
            "admin_max_connections = 8\nadmin_live_max_viewers = 2\nadmin_live_backlog = \"1MiB\"\n",
            "p.toml",
        )
        .unwrap();
        let c = Config::load(None, layer).unwrap();
        assert_eq!(
            (
                c.admin_max_connections,
                c.admin_live_max_viewers,
                c.admin_live_backlog
            ),
            (8, 2, 1 << 20)
        );
        for bad in [
            "admin_max_connections = 0\n",
            "admin_live_max_viewers = 0\n",
            "admin_live_backlog = \"1KiB\"\n",
        ] {
            let layer = parse_layer(bad, "p.toml").unwrap();
            assert!(Config::load(None, layer).is_err(), "{bad}");
        }
    }

    #[test]
    fn file_errors_point_at_line_and_column() {
        let err = parse_layer("listen = \"127.0.0.1:1\"\nmax_bdy = 5\n", "p.toml").unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with(
                "p.toml:2:1: unknown key \"max_bdy\"; did you mean \"max_body\"? (known: listen, "
            ),
            "{text}"
        );
        let err = parse_layer("[capture]\nmax_sise = \"1GiB\"\n", "p.toml").unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown key \"max_sise\"; did you mean \"max_size\"?"),
            "{err}"
        );
        let err = parse_layer("max_body = [\"64MiB\"]\n", "p.toml").unwrap_err();
        assert_eq!(
            err.to_string(),
            "p.toml:1:12: invalid type: sequence, expected a size such as \"64MiB\", a duration such as \"30s\", or a whole number"
        );
        let err = parse_layer("listen = [\n", "p.toml").unwrap_err();
        assert!(err.to_string().starts_with("p.toml:"), "{err}");
    }

    #[test]
    fn flags_win_over_file() {
        let dir = std::env::temp_dir().join(format!("pg-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("promptgate.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:9001\"\nmax_body = \"1MiB\"\nupstream_ca = [\"ca.pem\"]\nlog_format = \"json\"\n",
        )
        .unwrap();
        let flags = ConfigLayer {
            listen: Some("127.0.0.1:9002".into()),
            ..ConfigLayer::default()
        };
        let c = Config::load(Some(&path), flags).unwrap();
        assert_eq!(c.listen.port(), 9002);
        assert_eq!(c.max_body, 1 << 20);
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(c.upstream_ca, vec![dir.join("ca.pem")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_admin_api_needs_its_own_address() {
        let flags = ConfigLayer {
            listen: Some("127.0.0.1:9100".into()),
            admin: Some("127.0.0.1:9100".into()),
            ..ConfigLayer::default()
        };
        let err = Config::load(None, flags).unwrap_err().to_string();
        assert!(
            err.starts_with("admin: 127.0.0.1:9100 is the proxy's own address"),
            "{err}"
        );
        let off = ConfigLayer {
            admin: Some("off".into()),
            ..ConfigLayer::default()
        };
        assert_eq!(Config::load(None, off).unwrap().admin, None);
    }

    #[test]
    fn bad_values_name_the_setting() {
        let flags = ConfigLayer {
            log_format: Some("xml".into()),
            ..ConfigLayer::default()
        };
        let err = Config::load(None, flags).unwrap_err().to_string();
        assert!(err.starts_with("log-format: \"xml\""), "{err}");
    }

    #[test]
    fn forward_settings_from_the_file() {
        let dir = std::env::temp_dir().join(format!("pg-config-fwd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("promptgate.toml");
        std::fs::write(
            &path,
            "listen = \"0.0.0.0:8787\"\ncerts = \"ca\"\nintercept = [\"api.anthropic.com\", \"*.openai.azure.com=openai\"]\n\
             resolve = [\"api.anthropic.com=https://127.0.0.1:9443\"]\nintercept_only = true\n\
             connect_ports = [443, 8443]\nallow_remote = true\nproxy_auth = \"u:p\"\n",
        )
        .unwrap();
        let c = Config::load(Some(&path), ConfigLayer::default()).unwrap();
        assert_eq!(c.certs, dir.join("ca"));
        assert_eq!(
            c.intercept.provider_for("east.openai.azure.com"),
            Some(crate::provider::Provider::OpenAi)
        );
        assert_eq!(c.intercept.provider_for("api.openai.com"), None);
        assert_eq!(
            c.upstream_for("api.anthropic.com", 443, "https")
                .unwrap()
                .to_string(),
            "https://127.0.0.1:9443"
        );
        assert_eq!(
            c.upstream_for("east.openai.azure.com", 443, "https")
                .unwrap()
                .to_string(),
            "https://east.openai.azure.com"
        );
        assert!(c.intercept_only && c.allow_remote && c.proxy_auth.is_some());
        assert_eq!(c.connect_ports, [443, 8443]);
        assert!(
            !format!("{c:?}").contains("u:p"),
            "credentials stay out of Debug"
        );

        // Remote without credentials, and resolving a host that is not intercepted.
        std::fs::write(&path, "listen = \"0.0.0.0:8787\"\nallow_remote = true\n").unwrap();
        let err = Config::load(Some(&path), ConfigLayer::default()).unwrap_err();
        assert!(err.to_string().contains("PROMPTGATE_PROXY_AUTH"), "{err}");
        std::fs::write(&path, "resolve = [\"example.com=http://127.0.0.1:1\"]\n").unwrap();
        let err = Config::load(Some(&path), ConfigLayer::default()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("resolve: \"example.com\" is not intercepted"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
