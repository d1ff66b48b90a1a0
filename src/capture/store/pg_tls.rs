//! TLS to a PostgreSQL store, as libpq's `sslmode` and `sslrootcert` ask for it:
//! `disable`; `prefer` (the default: encrypted when the server offers it);
//! `require` (encrypted; the certificate is checked against a root certificate
//! only when one is given, as libpq does); `verify-ca` (signed by a trusted root);
//! `verify-full` (that, and issued for the host named). Roots come from
//! `sslrootcert=FILE` (PEM), `sslrootcert=system` (the public roots compiled in),
//! `PGSSLROOTCERT`, or `~/.postgresql/root.crt`.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::SslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::StoreError;

/// How much the connection checks of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// An `sslmode` promptgate does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sslmode={0} is not one of disable, prefer, require, verify-ca, verify-full")]
pub(crate) struct UnknownSslMode(String);

/// Why the store's TLS settings cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PgTlsError {
    #[error(transparent)]
    Mode(#[from] UnknownSslMode),
    #[error(
        "sslmode={0} needs a root certificate to check the server's against: sslrootcert=FILE (PEM), sslrootcert=system for the public roots, or ~/.postgresql/root.crt"
    )]
    NoRoots(&'static str),
}

impl Mode {
    fn parse(value: &str) -> Result<Mode, UnknownSslMode> {
        Ok(match value {
            "disable" => Mode::Disable,
            "prefer" => Mode::Prefer,
            "require" => Mode::Require,
            "verify-ca" => Mode::VerifyCa,
            "verify-full" => Mode::VerifyFull,
            // libpq's `allow` tries plain text first: promptgate never prefers it.
            other => return Err(UnknownSslMode(other.to_owned())),
        })
    }
}

/// Where trusted roots come from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Roots {
    /// The public roots compiled in (`sslrootcert=system`).
    System,
    File(PathBuf),
}

/// The TLS a store URL asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PgTls {
    mode: Mode,
    roots: Option<Roots>,
}

impl PgTls {
    /// From the URL's `sslmode` and `sslrootcert` (taken out of it), else
    /// `PGSSLMODE` and `PGSSLROOTCERT`, else libpq's defaults.
    pub(super) fn from_params(
        sslmode: Option<&str>,
        sslrootcert: Option<&str>,
    ) -> Result<PgTls, PgTlsError> {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let mode = match sslmode.map(str::to_owned).or_else(|| env("PGSSLMODE")) {
            Some(m) => Mode::parse(&m)?,
            None => Mode::Prefer,
        };
        let named = sslrootcert
            .map(str::to_owned)
            .or_else(|| env("PGSSLROOTCERT"));
        let roots = match named.as_deref() {
            Some("system") => Some(Roots::System),
            Some(path) => Some(Roots::File(PathBuf::from(path))),
            None => std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".postgresql/root.crt"))
                .filter(|p| p.is_file())
                .map(Roots::File),
        };
        if matches!(mode, Mode::VerifyCa | Mode::VerifyFull) && roots.is_none() {
            let mode = if mode == Mode::VerifyCa {
                "verify-ca"
            } else {
                "verify-full"
            };
            return Err(PgTlsError::NoRoots(mode));
        }
        Ok(PgTls { mode, roots })
    }

    /// What the client asks of the server.
    pub(super) fn ssl_mode(&self) -> SslMode {
        match self.mode {
            Mode::Disable => SslMode::Disable,
            Mode::Prefer => SslMode::Prefer,
            Mode::Require | Mode::VerifyCa | Mode::VerifyFull => SslMode::Require,
        }
    }

    /// The connector: the server's certificate is checked as the mode says.
    pub(super) fn connector(&self) -> Result<MakeRustlsConnect, StoreError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = match &self.roots {
            None => None,
            Some(Roots::System) => Some(RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            }),
            Some(Roots::File(path)) => {
                let certs = crate::tls::read_pem_certs(path)
                    .map_err(|e| StoreError::Tls(format!("sslrootcert {}: {e}", path.display())))?;
                let mut store = RootCertStore::empty();
                for cert in certs {
                    store.add(cert).map_err(|e| {
                        StoreError::Tls(format!("sslrootcert {}: {e}", path.display()))
                    })?;
                }
                Some(store)
            }
        };
        let check = match (self.mode, roots) {
            // libpq checks nothing here unless it was given a root certificate.
            (Mode::Disable | Mode::Prefer | Mode::Require, None) => Check::Nothing,
            (Mode::VerifyFull, Some(roots)) => Check::ChainAndName(webpki(roots, &provider)?),
            (_, Some(roots)) => Check::Chain(webpki(roots, &provider)?),
            (Mode::VerifyCa | Mode::VerifyFull, None) => {
                return Err(StoreError::Tls("no root certificate to verify with".into()));
            }
        };
        let verifier = Arc::new(ServerCheck {
            check,
            provider: provider.clone(),
        });
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Tls(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(MakeRustlsConnect::new(config))
    }
}

fn webpki(
    roots: RootCertStore,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<WebPkiServerVerifier>, StoreError> {
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| StoreError::Tls(e.to_string()))
}

/// What is checked of the server's certificate.
#[derive(Debug)]
enum Check {
    /// `prefer` and `require` without a root certificate, as in libpq: encrypted,
    /// the certificate not checked (the handshake's signatures still are).
    Nothing,
    /// `verify-ca` (or `require` with a root certificate): the chain leads to a
    /// trusted root; the name in the certificate is not compared with the host.
    Chain(Arc<WebPkiServerVerifier>),
    /// `verify-full`.
    ChainAndName(Arc<WebPkiServerVerifier>),
}

#[derive(Debug)]
struct ServerCheck {
    check: Check,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ServerCheck {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let (webpki, name_matters) = match &self.check {
            Check::Nothing => return Ok(ServerCertVerified::assertion()),
            Check::Chain(w) => (w, false),
            Check::ChainAndName(w) => (w, true),
        };
        match webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !name_matters => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_as_libpq_spells_them() {
        let tls = |m: &str| PgTls::from_params(Some(m), Some("system"));
        assert_eq!(tls("disable").unwrap().ssl_mode(), SslMode::Disable);
        assert_eq!(tls("prefer").unwrap().ssl_mode(), SslMode::Prefer);
        assert_eq!(tls("verify-full").unwrap().ssl_mode(), SslMode::Require);
        let e = tls("allow").unwrap_err();
        assert!(e.to_string().contains("sslmode=allow"), "{e}");
        let e = PgTls::from_params(Some("verify-full"), None);
        // A home with ~/.postgresql/root.crt verifies against it; otherwise it says so.
        if let Err(e) = e {
            assert!(e.to_string().contains("sslrootcert=FILE"), "{e}");
        }
        assert!(tls("require").unwrap().connector().is_ok());
        let missing = PgTls::from_params(Some("verify-ca"), Some("/nonexistent/ca.pem")).unwrap();
        let e = missing.connector().err().unwrap().to_string();
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
    }
}
