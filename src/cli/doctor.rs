//! `promptgate doctor`: checks, in order, that the proxy answers, the CA is usable,
//! this shell points clients at both, a CONNECT round trip verifies with the CA, and
//! the upstream answers through it. Each failure prints its fix; any failure exits 1.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::ca::{CertsPlace, absolute};
use super::env::client_address;
use super::{Colour, paint};
use crate::config::Config;
use crate::tls::{self, CertificateAuthority};

/// `promptgate doctor …`
#[derive(Debug, Args)]
pub(super) struct DoctorArgs {
    /// The address promptgate listens on [default: the config's, else 127.0.0.1:8787].
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// The address of its admin API, where the live rules are read [default: the config's, else 127.0.0.1:8788].
    #[arg(long, value_name = "ADDR")]
    admin: Option<std::net::SocketAddr>,
    #[command(flatten)]
    place: CertsPlace,
    /// Skip the check that the upstream answers through the proxy.
    #[arg(long)]
    offline: bool,
}

/// Time each network step of a check may take.
const STEP: Duration = Duration::from_secs(5);

/// The outcome of one check.
enum Check {
    Pass(String),
    Fail { problem: String, fix: String },
    Skip(String),
}

/// Runs the checks; `Ok(false)` when one failed.
pub(super) fn run(args: DoctorArgs) -> anyhow::Result<bool> {
    let mut config = args.place.load(args.listen.clone())?;
    if let Some(admin) = args.admin {
        config.admin = Some(admin);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut all_passed = true;
    let mut report = |name: &str, check: Check| match check {
        Check::Pass(detail) => println!("{}    {name}: {detail}", paint("ok", Colour::Green)),
        Check::Skip(detail) => println!("{}  {name}: {detail}", paint("skip", Colour::Yellow)),
        Check::Fail { problem, fix } => {
            all_passed = false;
            println!("{}  {name}: {problem}", paint("FAIL", Colour::Red));
            for line in fix.lines() {
                println!("      fix: {line}");
            }
        }
    };
    let address = client_address(config.listen);

    report("listener", runtime.block_on(listener(address, &config)));
    report("rules", runtime.block_on(live_rules(&config)));
    let ca = CertificateAuthority::load(&config.certs);
    report("ca", ca_check(&ca));
    let ca = ca.ok();
    report("environment", environment(address, ca.as_ref()));
    let host = config
        .intercept
        .patterns()
        .into_iter()
        .find(|p| !p.contains('*'));
    // Reverse mode: the upstream is probed through the proxy's own route, not through
    // a CONNECT to the public host.
    let reverse = reverse_mode(address);
    match (&ca, host) {
        (Some(ca), Some(host)) => {
            let (tunnel, upstream) = runtime.block_on(round_trip(
                address,
                &config,
                ca,
                &host,
                args.offline || reverse,
            ));
            report("connect", tunnel);
            if !reverse {
                report("upstream", upstream);
            }
        }
        (None, _) => {
            report("connect", Check::Skip("no usable CA".into()));
            if !reverse {
                report("upstream", Check::Skip("no usable CA".into()));
            }
        }
        (_, None) => {
            report(
                "connect",
                Check::Skip("no plain host on the intercept list".into()),
            );
            if !reverse {
                report(
                    "upstream",
                    Check::Skip("no plain host on the intercept list".into()),
                );
            }
        }
    }
    if reverse {
        let upstream = match args.offline {
            true => Check::Skip("--offline".into()),
            false => runtime.block_on(reverse_probe(address, &config)),
        };
        report("upstream", upstream);
    }
    Ok(all_passed)
}

/// The rules the running proxy enforces, from its admin API's `/healthz`.
async fn live_rules(config: &Config) -> Check {
    let Some(admin) = config.admin else {
        return Check::Skip(
            "the admin API is off (--admin off): the live rule count is unknown".into(),
        );
    };
    let admin = client_address(admin);
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n");
    let answer = match ask(admin, &request).await {
        Ok(answer) => answer,
        Err(why) => return Check::Skip(format!("the admin API: {why}")),
    };
    let text = String::from_utf8_lossy(&answer);
    let health = text
        .split_once("\r\n\r\n")
        .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(body).ok());
    // Informational: a proxy with no rules directory is not broken.
    match health.as_ref().and_then(|h| h["rules"]["state"].as_str()) {
        Some(state) => Check::Pass(state.to_owned()),
        None => Check::Skip(format!("the admin API on {admin} gave no rule count")),
    }
}

/// The `Proxy-Authorization` line this shell's credentials give, if any.
fn credentials_line(config: &Config) -> String {
    use base64::Engine as _;
    match (&config.proxy_auth, std::env::var("PROMPTGATE_PROXY_AUTH")) {
        (Some(_), Ok(pair)) => format!(
            "Proxy-Authorization: Basic {}\r\n",
            base64::engine::general_purpose::STANDARD.encode(pair)
        ),
        _ => String::new(),
    }
}

async fn listener(address: SocketAddr, config: &Config) -> Check {
    let fix = format!(
        "start it: promptgate serve --listen {address} (or pass doctor the --listen it uses)"
    );
    let request = format!(
        "GET /promptgate-doctor HTTP/1.1\r\nHost: {address}\r\n{}Connection: close\r\n\r\n",
        credentials_line(config)
    );
    match ask(address, &request).await {
        Ok(answer) if String::from_utf8_lossy(&answer).contains("promptgate") => {
            Check::Pass(format!("promptgate answers on {address}"))
        }
        Ok(_) => Check::Fail {
            problem: format!("something else answers on {address}"),
            fix,
        },
        Err(problem) => Check::Fail { problem, fix },
    }
}

/// Sends `request` on a new connection and reads the answer to its end, within
/// [`STEP`]; the error says what went wrong, naming the address.
async fn ask(address: SocketAddr, request: &str) -> Result<Vec<u8>, String> {
    let exchange = async {
        let mut stream = TcpStream::connect(address).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    match tokio::time::timeout(STEP, exchange).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(format!("nothing answers on {address}: {e}")),
        Err(_) => Err(format!(
            "{address} did not answer within {}s",
            STEP.as_secs()
        )),
    }
}

fn ca_check(ca: &Result<CertificateAuthority, tls::CaError>) -> Check {
    match ca {
        Ok(ca) => {
            let days = (ca.not_after() - time::OffsetDateTime::now_utc()).whole_days();
            let detail = format!(
                "{} (sha256 {}), expires {}",
                absolute(ca.cert_path()).display(),
                ca.fingerprint(),
                tls::ca::date(ca.not_after())
            );
            if days < 30 {
                Check::Fail {
                    problem: format!("{detail}: only {days} days left"),
                    fix: "promptgate ca init --force, then give clients the new certificate".into(),
                }
            } else {
                Check::Pass(detail)
            }
        }
        Err(e @ tls::CaError::Missing { .. }) => Check::Fail {
            problem: e.to_string(),
            fix: "promptgate ca init, or eval \"$(promptgate env --mode forward)\" (promptgate serve makes it on the first intercepted CONNECT)".into(),
        },
        Err(e) => Check::Fail {
            problem: e.to_string(),
            fix: "see the message; `promptgate ca init --force` makes a new CA".into(),
        },
    }
}

/// Whether this shell's variables send clients to promptgate, in either mode.
fn environment(address: SocketAddr, ca: Option<&CertificateAuthority>) -> Check {
    let var = |names: &[&str]| {
        names
            .iter()
            .find_map(|n| std::env::var(n).ok().filter(|v| !v.is_empty()))
    };
    let points_here = |url: &str| {
        super::env::url_address(url).is_some_and(|a| {
            a.port() == address.port() && (a.ip().is_loopback() || a.ip() == address.ip())
        })
    };
    let fix_forward = "eval \"$(promptgate env --mode forward)\", then restart the agent";
    if let Some(proxy) = var(&["HTTPS_PROXY", "https_proxy"]) {
        let mut missing = Vec::new();
        if !points_here(&proxy) {
            missing.push(format!(
                "HTTPS_PROXY is {proxy}, not promptgate at {address}"
            ));
        }
        let trusts = |name: &str| {
            let value = var(&[name])?;
            Some(ca.is_some_and(|ca| tls::file_trusts(Path::new(&value), ca)))
        };
        match trusts("NODE_EXTRA_CA_CERTS") {
            Some(true) => {}
            Some(false) => missing.push(
                "NODE_EXTRA_CA_CERTS does not contain promptgate's CA (Claude Code and Node will reject it)".into(),
            ),
            None => missing.push(
                "NODE_EXTRA_CA_CERTS is not set (Claude Code and Node will reject promptgate's certificate)".into(),
            ),
        }
        match trusts("SSL_CERT_FILE") {
            Some(true) => {}
            Some(false) => missing.push(
                "SSL_CERT_FILE does not contain promptgate's CA (the Python SDKs will reject it)"
                    .into(),
            ),
            None => missing.push(
                "SSL_CERT_FILE is not set (the Python SDKs will reject promptgate's certificate)"
                    .into(),
            ),
        }
        if let Some(no_proxy) = var(&["NO_PROXY", "no_proxy"]) {
            let bypassed = no_proxy
                .split([',', ' '])
                .map(str::trim)
                .any(|h| h == "*" || h.trim_start_matches('.').ends_with("anthropic.com"));
            if bypassed {
                missing.push(format!(
                    "NO_PROXY ({no_proxy}) sends api.anthropic.com around promptgate"
                ));
            }
        }
        if missing.is_empty() {
            Check::Pass(format!(
                "forward mode: HTTPS_PROXY={proxy}, the CA is trusted"
            ))
        } else {
            Check::Fail {
                problem: missing.join("; "),
                fix: fix_forward.into(),
            }
        }
    } else if let Some(base) = var(&["ANTHROPIC_BASE_URL"]) {
        if points_here(&base) {
            Check::Pass(format!("reverse mode: ANTHROPIC_BASE_URL={base}"))
        } else {
            Check::Fail {
                problem: format!("ANTHROPIC_BASE_URL is {base}, not promptgate at {address}"),
                fix: "eval \"$(promptgate env)\" (reverse mode) or use forward mode".into(),
            }
        }
    } else {
        Check::Fail {
            problem:
                "this shell points no client at promptgate (no HTTPS_PROXY, no ANTHROPIC_BASE_URL)"
                    .into(),
            fix: format!("{fix_forward}\nor: eval \"$(promptgate env)\" for reverse mode"),
        }
    }
}

/// Whether this shell sends Anthropic clients to the proxy at `address` as their base
/// URL (reverse mode).
fn reverse_mode(address: SocketAddr) -> bool {
    std::env::var("ANTHROPIC_BASE_URL").is_ok_and(|url| {
        super::env::url_address(&url).is_some_and(|a| {
            a.port() == address.port() && (a.ip().is_loopback() || a.ip() == address.ip())
        })
    })
}

/// `GET /v1/models` through the proxy's Anthropic route: the configured upstream
/// answers (any status of its own), or promptgate says why it could not reach it.
/// The probe carries the running proxy's token, so its record is marked as
/// doctor's, a side request.
async fn reverse_probe(address: SocketAddr, config: &Config) -> Check {
    let token = crate::runtime::Running::find()
        .filter(|r| r.listen.port() == address.port())
        .and_then(|r| r.probe_token)
        .map(|t| format!("{}: {t}\r\n", crate::runtime::PROBE_HEADER))
        .unwrap_or_default();
    let request = format!(
        "GET /v1/models HTTP/1.1\r\nHost: {address}\r\nanthropic-version: 2023-06-01\r\n{}{token}Connection: close\r\n\r\n",
        credentials_line(config)
    );
    let answer = match ask(address, &request).await {
        Ok(answer) => String::from_utf8_lossy(&answer).into_owned(),
        Err(problem) => {
            return Check::Fail {
                problem,
                fix: "start promptgate, or pass doctor the --listen it uses".into(),
            };
        }
    };
    let status = answer.lines().next().unwrap_or("").to_owned();
    if let Some(why) = own_failure(&answer) {
        return Check::Fail {
            problem: format!("the Anthropic upstream did not answer through promptgate: {why}"),
            fix: "check --upstream-anthropic, the network and --upstream-ca, or skip this check with --offline".into(),
        };
    }
    Check::Pass(format!(
        "the Anthropic upstream answered through promptgate's reverse route ({status})"
    ))
}

/// Why promptgate itself answered instead of the upstream, when it did: its own
/// failures carry a request id it made up (`req_promptgate_…`) and say why.
fn own_failure(answer: &str) -> Option<String> {
    if !answer.contains("req_promptgate_") {
        return None;
    }
    let status = answer.lines().next().unwrap_or("").to_owned();
    let why = answer
        .split_once("\r\n\r\n")
        .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(body).ok())
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or(status);
    Some(why)
}

/// CONNECT to `host`, TLS trusting only the CA, then (unless offline) one request.
async fn round_trip(
    address: SocketAddr,
    config: &Config,
    ca: &CertificateAuthority,
    host: &str,
    offline: bool,
) -> (Check, Check) {
    let mut tls = match open_tunnel(address, config, ca, host).await {
        Ok(tls) => tls,
        Err((problem, fix)) => {
            let skipped = Check::Skip("the CONNECT check failed".into());
            return (Check::Fail { problem, fix }, skipped);
        }
    };
    let tunnel = Check::Pass(format!("CONNECT {host}:443 → TLS verified with the CA"));
    if offline {
        return (tunnel, Check::Skip("--offline".into()));
    }
    let request = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let exchange = async {
        tls.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        // Enough for promptgate's own error; a real page may be longer and is not needed.
        let mut buf = [0u8; 4096];
        while answer.len() < 64 << 10 {
            let n = tls.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&answer).into_owned())
    };
    let upstream = match tokio::time::timeout(STEP * 3, exchange).await {
        Ok(Ok(answer)) => {
            let status = answer.lines().next().unwrap_or("").to_owned();
            if let Some(why) = own_failure(&answer) {
                Check::Fail {
                    problem: format!("{host} did not answer through promptgate: {why}"),
                    fix: "check the network, --resolve and --upstream-ca, or skip this check with --offline".into(),
                }
            } else {
                Check::Pass(format!("{host} answered through promptgate ({status})"))
            }
        }
        _ => Check::Fail {
            problem: format!("no answer from {host} through promptgate"),
            fix: "check the network; use --offline to skip this check".into(),
        },
    };
    (tunnel, upstream)
}

/// What went wrong opening the tunnel: the problem and its fix.
type Failure = (String, String);

/// CONNECT through promptgate and a TLS handshake that trusts only the CA.
async fn open_tunnel(
    address: SocketAddr,
    config: &Config,
    ca: &CertificateAuthority,
    host: &str,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, Failure> {
    let mut stream = match tokio::time::timeout(STEP, TcpStream::connect(address)).await {
        Ok(Ok(s)) => s,
        _ => {
            return Err((
                format!("cannot connect to {address}"),
                "start promptgate (see the listener check)".into(),
            ));
        }
    };
    let _ = stream.set_nodelay(true);
    let connect = format!(
        "CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n{}\r\n",
        credentials_line(config)
    );
    let head = async {
        stream.write_all(connect.as_bytes()).await?;
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8; 1];
            if stream.read(&mut byte).await? == 0 {
                break;
            }
            head.push(byte[0]);
        }
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&head).into_owned())
    };
    let head = match tokio::time::timeout(STEP, head).await {
        Ok(Ok(h)) => h,
        _ => {
            return Err((
                format!("no answer to CONNECT {host}:443"),
                "check the promptgate log".into(),
            ));
        }
    };
    let status = head.lines().next().unwrap_or("").to_owned();
    if !status.contains(" 200") {
        return Err((
            format!("CONNECT {host}:443 answered {status:?}"),
            "407: set PROMPTGATE_PROXY_AUTH; 403: check --intercept and --connect-port".into(),
        ));
    }
    let mut roots = rustls::RootCertStore::empty();
    let _ = roots.add(ca.cert_der().clone());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls_config = match rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
    {
        Ok(b) => b.with_root_certificates(roots).with_no_client_auth(),
        Err(e) => {
            return Err((e.to_string(), "report this as a bug".into()));
        }
    };
    let Ok(name) = ServerName::try_from(host.to_owned()) else {
        return Err((
            format!("{host} is not a server name"),
            "use plain host names in --intercept".into(),
        ));
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls_config));
    match tokio::time::timeout(STEP, connector.connect(name, stream)).await {
        Ok(Ok(tls)) => Ok(tls),
        Ok(Err(e)) => Err((
            format!("TLS inside the tunnel to {host} does not verify with the CA: {e}"),
            format!(
                "the running promptgate uses another CA: start it with --certs {}",
                absolute(&config.certs).display()
            ),
        )),
        Err(_) => Err((
            "TLS handshake inside the tunnel timed out".into(),
            "check the promptgate log".into(),
        )),
    }
}
