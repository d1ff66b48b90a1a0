//! TLS for forward-proxy mode: the local CA ([`ca`]), the leaf certificates minted
//! from it per intercepted host ([`leaf`]), and the combined trust bundle that
//! clients which replace their roots (Python's `SSL_CERT_FILE`) need.
//!
//! The upstream side of TLS lives in [`crate::upstream`].

pub(crate) mod ca;
pub(crate) mod leaf;

use std::path::{Path, PathBuf};

pub(crate) use ca::{CaError, CertificateAuthority};
pub(crate) use leaf::LeafCache;

/// The leaf cache for intercepted CONNECTs. A CA that exists is loaded at start
/// (a broken one stops the start); a missing one is created on the first CONNECT
/// that needs it, or by `promptgate ca init`, not on every start.
#[derive(Debug)]
pub(crate) struct Interception {
    certs: PathBuf,
    cache: tokio::sync::OnceCell<Option<std::sync::Arc<LeafCache>>>,
}

impl Interception {
    /// Loads the CA in `certs` now if it is there; else leaves it for the first CONNECT.
    pub(crate) fn start(certs: &Path) -> Result<Interception, CaError> {
        let cache = tokio::sync::OnceCell::new();
        match CertificateAuthority::load(certs) {
            Ok(ca) => {
                let _ = cache.set(Some(std::sync::Arc::new(LeafCache::new(
                    std::sync::Arc::new(ca),
                ))));
            }
            Err(CaError::Missing { .. }) => {}
            Err(e) => return Err(e),
        }
        Ok(Interception {
            certs: certs.to_owned(),
            cache,
        })
    }

    /// The leaf cache, creating the CA first if this is the first CONNECT. `None`
    /// when the CA cannot be created (logged once): interception is then off.
    pub(crate) async fn leaves(&self) -> Option<std::sync::Arc<LeafCache>> {
        self.cache
            .get_or_init(|| async {
                let certs = self.certs.clone();
                tokio::task::spawn_blocking(move || create(&certs))
                    .await
                    .ok()
                    .flatten()
            })
            .await
            .clone()
    }

    /// Leaves minted so far (0 before the CA exists).
    pub(crate) fn minted(&self) -> u64 {
        self.cache
            .get()
            .and_then(Option::as_ref)
            .map_or(0, |l| l.minted())
    }
}

/// Creates (or, if another process just did, loads) the CA for interception.
fn create(certs: &Path) -> Option<std::sync::Arc<LeafCache>> {
    match CertificateAuthority::load_or_create(certs, CA_DAYS) {
        Ok((ca, created)) => {
            if created {
                tracing::info!(
                    cert = %ca.cert_path().display(),
                    fingerprint = %ca.fingerprint(),
                    "created the forward-proxy CA for the first intercepted CONNECT; clients \
                     must trust the cert file (see `promptgate env --mode forward`)"
                );
                if let Some(system) = system_bundle() {
                    let _ = write_bundle(&ca, &system);
                }
            }
            Some(std::sync::Arc::new(LeafCache::new(std::sync::Arc::new(ca))))
        }
        Err(e) => {
            tracing::warn!(
                "forward-proxy interception is off: {e}; pass --certs DIR to put the CA elsewhere"
            );
            None
        }
    }
}

/// File name of the combined bundle (system roots + the CA) inside the certs directory.
pub(crate) const BUNDLE_FILE: &str = "promptgate-bundle.pem";

/// Default lifetime of a new CA, in days.
pub(crate) const CA_DAYS: u32 = 3650;

/// Where common systems keep their PEM bundle of trusted roots.
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt", // Debian, Ubuntu, Arch
    "/etc/pki/tls/certs/ca-bundle.crt",   // Fedora, RHEL
    "/etc/ssl/ca-bundle.pem",             // openSUSE
    "/etc/ssl/cert.pem",                  // macOS, Alpine
];

/// The system's PEM bundle of trusted roots, if one of the usual files exists.
pub(crate) fn system_bundle() -> Option<PathBuf> {
    SYSTEM_BUNDLES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// Writes `<certs>/promptgate-bundle.pem`: the roots in `system` followed by the CA,
/// for clients whose CA setting replaces their default roots instead of adding to them.
pub(crate) fn write_bundle(ca: &CertificateAuthority, system: &Path) -> Result<PathBuf, CaError> {
    let roots = std::fs::read(system).map_err(|source| CaError::Unreadable {
        path: system.display().to_string(),
        source,
    })?;
    let path = ca
        .cert_path()
        .parent()
        .map_or_else(|| PathBuf::from(BUNDLE_FILE), |d| d.join(BUNDLE_FILE));
    let mut bytes = roots;
    if !bytes.ends_with(b"\n") {
        bytes.push(b'\n');
    }
    bytes.extend_from_slice(b"# promptgate local CA\n");
    bytes.extend_from_slice(ca.cert_pem().as_bytes());
    ca::write_atomically(&path, &bytes)?;
    Ok(path)
}

/// Whether the PEM file at `path` contains the CA's certificate.
pub(crate) fn file_trusts(path: &Path, ca: &CertificateAuthority) -> bool {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let Ok(certs) = CertificateDer::pem_file_iter(path) else {
        return false;
    };
    certs.flatten().any(|c| c == *ca.cert_der())
}

/// Why the client TLS setup failed (read by people at startup).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientTlsError {
    #[error("upstream-ca {path}: {message}")]
    Ca { path: PathBuf, message: String },
    #[error("TLS setup: {0}")]
    Tls(#[from] rustls::Error),
}

/// The client TLS configuration promptgate dials out with (to the providers and to
/// HTTP hooks): the public web roots plus the PEM files in `extra_roots`
/// (`--upstream-ca`).
pub(crate) fn client_config(
    extra_roots: &[PathBuf],
) -> Result<rustls::ClientConfig, ClientTlsError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    for path in extra_roots {
        let ca_error = |message: String| ClientTlsError::Ca {
            path: path.clone(),
            message,
        };
        for cert in read_pem_certs(path).map_err(|e| ca_error(e.to_string()))? {
            roots.add(cert).map_err(|e| ca_error(e.to_string()))?;
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// What is wrong with a PEM file of certificates.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PemError {
    /// Unreadable, or not PEM.
    #[error("{0}")]
    Pem(rustls_pki_types::pem::Error),
    #[error("no PEM certificate in the file")]
    NoCertificate,
}

/// The certificates in the PEM file at `path`; an error says what is wrong with it
/// (unreadable, not PEM, or no certificate in it).
pub(crate) fn read_pem_certs(
    path: &Path,
) -> Result<Vec<rustls_pki_types::CertificateDer<'static>>, PemError> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(PemError::Pem)?
        .collect::<Result<_, _>>()
        .map_err(PemError::Pem)?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate);
    }
    Ok(certs)
}
