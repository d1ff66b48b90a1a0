//! `promptgate ca init | show`: create the forward-proxy CA, or say where it is,
//! its SHA-256 fingerprint and when it expires. The key is never printed.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use crate::config::{Config, ConfigLayer};
use crate::tls::{self, CertificateAuthority};

/// `promptgate ca …`
#[derive(Debug, Args)]
pub(super) struct CaArgs {
    #[command(subcommand)]
    verb: CaVerb,
}

#[derive(Debug, Subcommand)]
enum CaVerb {
    /// Create the CA (certificate + private key, mode 0600) and the client bundle.
    Init {
        #[command(flatten)]
        place: CertsPlace,
        /// Replace an existing CA (clients must then trust the new one).
        #[arg(long)]
        force: bool,
        /// Validity in days.
        #[arg(long, default_value_t = tls::CA_DAYS)]
        days: u32,
    },
    /// Print the CA's path, SHA-256 fingerprint and expiry.
    Show {
        #[command(flatten)]
        place: CertsPlace,
    },
}

/// Where the CA lives: `--certs`, else the config file's `certs`, else `./certs`.
#[derive(Debug, Args, Clone, Default)]
pub(super) struct CertsPlace {
    /// Directory of the CA [default: the running serve's, else `certs` in the data directory].
    #[arg(long, value_name = "DIR")]
    certs: Option<PathBuf>,
    /// Config file (TOML) whose `certs` setting applies.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

impl CertsPlace {
    fn resolve(&self) -> anyhow::Result<PathBuf> {
        Ok(self.load(None)?.certs)
    }

    /// The configuration as a client-side verb sees it: the file, `--certs`, `listen`,
    /// and the proxy credentials from the environment.
    /// Without a config file, what is not given comes from the running `serve`
    /// (its runtime file), then from the shell's ANTHROPIC_BASE_URL / HTTPS_PROXY.
    pub(super) fn load(&self, listen: Option<String>) -> anyhow::Result<Config> {
        let running = self
            .config
            .is_none()
            .then(crate::runtime::Running::find)
            .flatten();
        let listen = listen
            .or_else(|| running.as_ref().map(|r| r.listen.to_string()))
            .or_else(|| self.config.is_none().then(listen_from_env).flatten());
        let certs = self
            .certs
            .clone()
            .or_else(|| running.as_ref().map(|r| r.certs.clone()));
        let remote = listen
            .as_deref()
            .and_then(|l| l.parse::<std::net::SocketAddr>().ok())
            .is_some_and(|a| !crate::config::is_default_loopback(a.ip()));
        let flags = ConfigLayer {
            certs,
            listen,
            allow_remote: remote.then_some(true),
            proxy_auth: std::env::var("PROMPTGATE_PROXY_AUTH")
                .ok()
                .filter(|v| !v.is_empty()),
            ..ConfigLayer::default()
        };
        let mut config = Config::load(self.config.as_deref(), flags)?;
        if let Some(r) = running {
            config.admin = r.admin;
        }
        Ok(config)
    }
}

/// The promptgate address the shell's clients are pointed at, when it is on this
/// machine: ANTHROPIC_BASE_URL (reverse mode), else HTTPS_PROXY (forward mode).
fn listen_from_env() -> Option<String> {
    ["ANTHROPIC_BASE_URL", "HTTPS_PROXY", "https_proxy"]
        .iter()
        .filter_map(|name| std::env::var(name).ok())
        .find_map(|url| {
            let addr = super::env::url_address(&url)?;
            addr.ip().is_loopback().then(|| addr.to_string())
        })
}

/// Runs `promptgate ca …`.
pub(super) fn run(args: CaArgs) -> anyhow::Result<()> {
    match args.verb {
        CaVerb::Init { place, force, days } => {
            let dir = place.resolve()?;
            let ca = CertificateAuthority::create(&dir, days, force)?;
            let bundle = tls::system_bundle().and_then(|s| tls::write_bundle(&ca, &s).ok());
            println!("created the promptgate CA");
            describe(&ca, bundle.as_deref());
            println!("next: eval \"$(promptgate env --mode forward)\" in the agent's shell");
        }
        CaVerb::Show { place } => {
            let dir = place.resolve()?;
            let ca = CertificateAuthority::load(&dir)?;
            let bundle = dir.join(tls::BUNDLE_FILE);
            let bundle = tls::file_trusts(&bundle, &ca).then_some(bundle);
            describe(&ca, bundle.as_deref());
        }
    }
    Ok(())
}

fn describe(ca: &CertificateAuthority, bundle: Option<&Path>) {
    let days_left = (ca.not_after() - time::OffsetDateTime::now_utc()).whole_days();
    println!("certificate  {}", absolute(ca.cert_path()).display());
    println!(
        "private key  {} (never share it)",
        absolute(ca.key_path()).display()
    );
    println!("sha256       {}", ca.fingerprint());
    println!(
        "expires      {} (in {days_left} days)",
        tls::ca::date(ca.not_after())
    );
    match bundle {
        Some(b) => println!(
            "bundle       {} (system roots + this CA)",
            absolute(b).display()
        ),
        None => println!("bundle       none (no system root bundle found)"),
    }
}

/// `path` made absolute, so it still works from another directory.
pub(super) fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}
