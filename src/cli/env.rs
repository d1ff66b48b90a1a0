//! `promptgate env`: prints exactly what to set so agents use promptgate, for one
//! shell, as lines to `eval`. Forward mode makes sure the CA and the client bundle
//! exist first (each client's own documentation says which).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::ca::{CertsPlace, absolute};
use crate::config::Config;
use crate::tls::{self, CertificateAuthority};

/// `promptgate env …`
#[derive(Debug, Args)]
pub(super) struct EnvArgs {
    /// reverse: agents use promptgate as their base URL (no CA). forward: agents keep
    /// their real hosts and use promptgate as HTTPS_PROXY, trusting its CA.
    #[arg(long, value_enum, default_value_t = Mode::Reverse)]
    mode: Mode,
    /// The shell to print for.
    #[arg(long, value_enum, default_value_t = Shell::Bash)]
    shell: Shell,
    /// The address promptgate listens on [default: the config's, else 127.0.0.1:8787].
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    #[command(flatten)]
    place: CertsPlace,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum Mode {
    Reverse,
    Forward,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Shell {
    Bash,
    Fish,
    Powershell,
}

/// Collects lines for one shell.
struct Script {
    shell: Shell,
    lines: Vec<String>,
}

impl Script {
    fn comment(&mut self, text: &str) {
        self.lines.push(format!("# {text}"));
    }

    fn set(&mut self, name: &str, value: &str) {
        let quoted = format!("'{}'", value.replace('\'', "'\\''"));
        self.lines.push(match self.shell {
            Shell::Bash => format!("export {name}={quoted}"),
            Shell::Fish => format!("set -gx {name} {quoted}"),
            Shell::Powershell => format!("$env:{name} = '{}'", value.replace('\'', "''")),
        });
    }

    /// A proxy URL whose credentials come from PROMPTGATE_PROXY_AUTH at eval time,
    /// so they are never printed.
    fn set_with_credentials(&mut self, name: &str, address: &str) {
        self.lines.push(match self.shell {
            Shell::Bash => format!("export {name}=\"http://${{PROMPTGATE_PROXY_AUTH}}@{address}\""),
            Shell::Fish => format!("set -gx {name} \"http://$PROMPTGATE_PROXY_AUTH@{address}\""),
            Shell::Powershell => {
                format!("$env:{name} = \"http://$($env:PROMPTGATE_PROXY_AUTH)@{address}\"")
            }
        });
    }

    fn unset(&mut self, name: &str) {
        self.lines.push(match self.shell {
            Shell::Bash => format!("unset {name}"),
            Shell::Fish => format!("set -e {name}"),
            Shell::Powershell => format!("Remove-Item Env:{name} -ErrorAction SilentlyContinue"),
        });
    }
}

/// The IP address and port an `http://` URL names (`localhost` read as 127.0.0.1;
/// port 80 when none); `None` for a host name or no URL.
pub(super) fn url_address(url: &str) -> Option<SocketAddr> {
    let uri = url.parse::<http::Uri>().ok()?;
    let host = uri.host()?;
    let ip = match host {
        "localhost" => std::net::IpAddr::from([127, 0, 0, 1]),
        other => other.trim_matches(['[', ']']).parse().ok()?,
    };
    Some(SocketAddr::new(ip, uri.port_u16().unwrap_or(80)))
}

/// The address clients dial: the listen address, with a wildcard made loopback.
pub(super) fn client_address(listen: SocketAddr) -> SocketAddr {
    if listen.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], listen.port()))
    } else {
        listen
    }
}

/// Hosts every client should reach directly, never through the proxy.
const NO_PROXY: &str = "localhost,127.0.0.1,::1";

/// Runs `promptgate env`.
pub(super) fn run(args: EnvArgs) -> anyhow::Result<()> {
    let config = args.place.load(args.listen.clone())?;
    let mut script = Script {
        shell: args.shell,
        lines: Vec::new(),
    };
    match args.mode {
        Mode::Reverse => reverse(&config, &mut script),
        Mode::Forward => forward(&config, &mut script)?,
    }
    for line in script.lines {
        println!("{line}");
    }
    Ok(())
}

fn reverse(config: &Config, s: &mut Script) {
    let base = format!("http://{}", client_address(config.listen));
    s.comment(&format!(
        "promptgate reverse-proxy mode: agents send their API calls to {base} (no CA needed)."
    ));
    s.comment("Claude Code, the Anthropic SDKs:");
    s.set("ANTHROPIC_BASE_URL", &base);
    // pi ignores ANTHROPIC_BASE_URL: it reads its providers from models.json.
    s.comment(&format!(
        "pi ignores ANTHROPIC_BASE_URL: in ~/.pi/agent/models.json set {{\"providers\": {{\"anthropic\": {{\"baseUrl\": \"{base}\"}}}}}}"
    ));
    s.comment("OpenAI SDKs and tools:");
    s.set("OPENAI_BASE_URL", &format!("{base}/openai/v1"));
    s.comment("If this shell also has an HTTP(S) proxy, promptgate itself must bypass it:");
    s.set("NO_PROXY", NO_PROXY);
    s.set("no_proxy", NO_PROXY);
    s.comment(&format!(
        "curl: curl {base}/v1/messages -H \"x-api-key: $ANTHROPIC_API_KEY\" ..."
    ));
}

fn forward(config: &Config, s: &mut Script) -> anyhow::Result<()> {
    let (ca, created) = CertificateAuthority::load_or_create(&config.certs, tls::CA_DAYS)?;
    if created {
        eprintln!(
            "promptgate: created the CA {} (sha256 {})",
            absolute(ca.cert_path()).display(),
            ca.fingerprint()
        );
    }
    let cert = absolute(ca.cert_path()).display().to_string();
    let bundle = ensure_bundle(&ca);
    let address = client_address(config.listen).to_string();
    let proxy = format!("http://{address}");

    s.comment(&format!(
        "promptgate forward-proxy mode: agents keep their real hosts and go through {proxy};"
    ));
    s.comment(&format!(
        "promptgate intercepts {} with certificates from its CA:",
        config.intercept.patterns().join(", ")
    ));
    s.comment(&format!("  {cert} (sha256 {})", ca.fingerprint()));
    // Not HTTP_PROXY: plain http:// to other hosts would be refused, not relayed.
    for name in ["HTTPS_PROXY", "https_proxy"] {
        if config.proxy_auth.is_some() {
            s.set_with_credentials(name, &address);
        } else {
            s.set(name, &proxy);
        }
    }
    if config.proxy_auth.is_some() {
        s.comment("(PROMPTGATE_PROXY_AUTH=user:password must be set, URL-encoded, when this is evaluated)");
    }
    s.comment("Local traffic stays off the proxy; add hosts you do not want to go through it.");
    s.set("NO_PROXY", NO_PROXY);
    s.set("no_proxy", NO_PROXY);
    s.comment("The agents must talk to their real hosts, not a base URL:");
    s.unset("ANTHROPIC_BASE_URL");
    s.unset("OPENAI_BASE_URL");
    s.comment("Claude Code and other Node/Bun programs add this CA to their own roots");
    s.comment("(read once at start: restart the agent after setting it):");
    s.set("NODE_EXTRA_CA_CERTS", &cert);
    s.comment("Node's built-in fetch follows HTTPS_PROXY only with this (Node 24+):");
    s.set("NODE_USE_ENV_PROXY", "1");
    match &bundle {
        Some(bundle) => {
            let bundle = absolute(bundle).display().to_string();
            s.comment(
                "Python httpx (Anthropic and OpenAI SDKs) and requests REPLACE their roots with",
            );
            s.comment("these files, so they get a bundle of the system roots plus the CA:");
            s.set("SSL_CERT_FILE", &bundle);
            s.set("REQUESTS_CA_BUNDLE", &bundle);
            s.comment(&format!(
                "curl: curl --cacert {cert} https://api.anthropic.com/v1/messages ... (or CURL_CA_BUNDLE={bundle})"
            ));
        }
        None => {
            s.comment("No system root bundle was found, so no combined bundle was written. For");
            s.comment("Python build one and point SSL_CERT_FILE and REQUESTS_CA_BUNDLE at it:");
            s.comment(&format!(
                "  cat /path/to/system-roots.pem {cert} > bundle.pem"
            ));
            s.comment(&format!(
                "curl: curl --cacert {cert} https://api.anthropic.com/v1/messages ..."
            ));
        }
    }
    Ok(())
}

/// The combined bundle beside the CA, (re)written when missing or made for another CA.
fn ensure_bundle(ca: &CertificateAuthority) -> Option<PathBuf> {
    let path = ca.cert_path().parent()?.join(tls::BUNDLE_FILE);
    if tls::file_trusts(&path, ca) {
        return Some(path);
    }
    let system = tls::system_bundle()?;
    match tls::write_bundle(ca, &system) {
        Ok(path) => {
            eprintln!(
                "promptgate: wrote {} ({} + the CA)",
                absolute(&path).display(),
                system.display()
            );
            Some(path)
        }
        Err(e) => {
            eprintln!("promptgate: could not write the client bundle: {e}");
            None
        }
    }
}
