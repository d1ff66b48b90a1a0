//! The local certificate authority of forward-proxy mode: created once into the
//! certs directory (key mode 0600), loaded and checked on every start.
//!
//! It only issues leaf certificates ([`super::leaf`]); the private key never leaves
//! this type except into the key file.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use time::OffsetDateTime;

/// File name of the CA certificate (PEM) inside the certs directory.
pub(crate) const CERT_FILE: &str = "promptgate-ca.pem";
/// File name of the CA private key (PEM, PKCS#8, mode 0600).
pub(crate) const KEY_FILE: &str = "promptgate-ca-key.pem";

/// What can be wrong with the CA; read by people at startup or from `ca` verbs.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CaError {
    #[error("no CA in {dir} (create one with `promptgate ca init --certs {dir}`)")]
    Missing { dir: String },
    #[error(
        "{path} exists but {missing} is missing; remove the leftover or run `promptgate ca init --force`"
    )]
    Incomplete { path: String, missing: String },
    #[error("{path}: cannot read: {source}")]
    Unreadable {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a valid {what}: {message}")]
    Malformed {
        path: String,
        what: &'static str,
        message: String,
    },
    #[error(
        "{path}: the CA certificate expired on {on}; make a new one with `promptgate ca init --force` \
         (clients must then trust the new certificate)"
    )]
    Expired { path: String, on: String },
    #[error("{path}: the CA certificate is not valid before {from} (is the clock right?)")]
    NotYetValid { path: String, from: String },
    #[error("{key} does not belong to the certificate {cert}")]
    KeyMismatch { cert: String, key: String },
    #[error("a CA already exists in {dir}; `promptgate ca init --force` replaces it")]
    Exists { dir: String },
    #[error("writing {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("generating the CA: {0}")]
    Generate(#[from] rcgen::Error),
}

/// The loaded CA: its certificate, validity and signing key.
pub(crate) struct CertificateAuthority {
    cert_path: PathBuf,
    key_path: PathBuf,
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
}

impl std::fmt::Debug for CertificateAuthority {
    // The key stays out of every Debug output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .field("cert_path", &self.cert_path)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl CertificateAuthority {
    /// Creates a new CA in `dir`, valid for `days` from yesterday. Refuses to replace
    /// an existing one unless `replace`.
    pub(crate) fn create(dir: &Path, days: u32, replace: bool) -> Result<Self, CaError> {
        let (cert_path, key_path) = paths(dir);
        if !replace && (cert_path.exists() || key_path.exists()) {
            return Err(CaError::Exists {
                dir: dir.display().to_string(),
            });
        }
        std::fs::create_dir_all(dir).map_err(|source| CaError::Write {
            path: dir.display().to_string(),
            source,
        })?;
        let (cert_pem, key_pem) = generate(days)?;
        if replace {
            let _ = std::fs::remove_file(&key_path);
        }
        write_key(&key_path, &key_pem)?;
        write_atomically(&cert_path, cert_pem.as_bytes())?;
        Self::load(dir)
    }

    /// Loads the CA in `dir`, creating it when neither file exists. Returns whether it
    /// was created. Safe against several processes starting at once: the key file is
    /// created exclusively, and the certificate appears (by rename) only after it.
    pub(crate) fn load_or_create(dir: &Path, days: u32) -> Result<(Self, bool), CaError> {
        let (cert_path, key_path) = paths(dir);
        if cert_path.exists() || key_path.exists() {
            return Self::load_settled(dir).map(|ca| (ca, false));
        }
        std::fs::create_dir_all(dir).map_err(|source| CaError::Write {
            path: dir.display().to_string(),
            source,
        })?;
        let (cert_pem, key_pem) = generate(days)?;
        match write_key(&key_path, &key_pem) {
            Ok(()) => {}
            // Another process won the race: use its CA once its certificate is there.
            Err(CaError::Write { source, .. })
                if source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                return Self::load_settled(dir).map(|ca| (ca, false));
            }
            Err(e) => return Err(e),
        }
        write_atomically(&cert_path, cert_pem.as_bytes())?;
        Self::load(dir).map(|ca| (ca, true))
    }

    /// [`Self::load`], waiting briefly for a CA another process is writing right now.
    fn load_settled(dir: &Path) -> Result<Self, CaError> {
        let mut tries = 0;
        loop {
            match Self::load(dir) {
                Err(CaError::Incomplete { .. } | CaError::Malformed { .. }) if tries < 40 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }

    /// Loads and checks the CA in `dir`: both files readable, well-formed, matching,
    /// and the certificate valid now.
    pub(crate) fn load(dir: &Path) -> Result<Self, CaError> {
        let (cert_path, key_path) = paths(dir);
        let shown = |p: &Path| p.display().to_string();
        match (cert_path.exists(), key_path.exists()) {
            (false, false) => {
                return Err(CaError::Missing {
                    dir: dir.display().to_string(),
                });
            }
            (true, false) => {
                return Err(CaError::Incomplete {
                    path: shown(&cert_path),
                    missing: shown(&key_path),
                });
            }
            (false, true) => {
                return Err(CaError::Incomplete {
                    path: shown(&key_path),
                    missing: shown(&cert_path),
                });
            }
            (true, true) => {}
        }
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|source| CaError::Unreadable {
                path: shown(p),
                source,
            })
        };
        let cert_pem = read(&cert_path)?;
        let key_pem = read(&key_path)?;
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| {
            CaError::Malformed {
                path: shown(&cert_path),
                what: "PEM certificate",
                message: e.to_string(),
            }
        })?;
        let malformed_cert = |message: String| CaError::Malformed {
            path: shown(&cert_path),
            what: "CA certificate",
            message,
        };
        let (_, x509) = x509_parser::parse_x509_certificate(&cert_der)
            .map_err(|e| malformed_cert(e.to_string()))?;
        if !x509.is_ca() {
            return Err(malformed_cert("it is not a CA certificate".into()));
        }
        let not_before = x509.validity().not_before.to_datetime();
        let not_after = x509.validity().not_after.to_datetime();
        let key = KeyPair::from_pem(&key_pem).map_err(|e| CaError::Malformed {
            path: shown(&key_path),
            what: "PEM private key",
            message: e.to_string(),
        })?;
        if key.public_key_raw() != x509.public_key().subject_public_key.data.as_ref() {
            return Err(CaError::KeyMismatch {
                cert: shown(&cert_path),
                key: shown(&key_path),
            });
        }
        let now = OffsetDateTime::now_utc();
        if now >= not_after {
            return Err(CaError::Expired {
                path: shown(&cert_path),
                on: date(not_after),
            });
        }
        if now < not_before {
            return Err(CaError::NotYetValid {
                path: shown(&cert_path),
                from: date(not_before),
            });
        }
        let issuer =
            Issuer::from_ca_cert_der(&cert_der, key).map_err(|e| malformed_cert(e.to_string()))?;
        Ok(CertificateAuthority {
            cert_path,
            key_path,
            cert_pem,
            cert_der,
            issuer,
            not_before,
            not_after,
        })
    }

    /// Where the certificate is (what clients must trust).
    pub(crate) fn cert_path(&self) -> &Path {
        &self.cert_path
    }

    /// Where the private key is.
    pub(crate) fn key_path(&self) -> &Path {
        &self.key_path
    }

    /// The certificate as PEM text.
    pub(crate) fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The certificate as DER.
    pub(crate) fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// Start of the certificate's validity.
    pub(crate) fn not_before(&self) -> OffsetDateTime {
        self.not_before
    }

    /// End of the certificate's validity.
    pub(crate) fn not_after(&self) -> OffsetDateTime {
        self.not_after
    }

    /// SHA-256 of the certificate, as colon-separated uppercase hex (as `openssl x509
    /// -fingerprint -sha256` prints it).
    pub(crate) fn fingerprint(&self) -> String {
        fingerprint(&self.cert_der)
    }

    pub(super) fn issuer(&self) -> &Issuer<'static, KeyPair> {
        &self.issuer
    }
}

/// The certificate and key paths inside a certs directory.
pub(crate) fn paths(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join(CERT_FILE), dir.join(KEY_FILE))
}

/// SHA-256 of DER bytes as `AB:CD:…`.
pub(crate) fn fingerprint(der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    let mut out = String::with_capacity(95);
    for (i, byte) in digest.as_ref().iter().enumerate() {
        if i > 0 {
            out.push(':');
        }
        let _ = write!(out, "{byte:02X}");
    }
    out
}

/// A date as `2026-11-29 12:00:00 UTC`.
pub(crate) fn date(t: OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// A fresh ECDSA P-256 CA: (certificate PEM, key PEM).
fn generate(days: u32) -> Result<(String, String), CaError> {
    let now = OffsetDateTime::now_utc();
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(
        DnType::CommonName,
        format!("promptgate local CA {}", &date(now)[..10]),
    );
    params
        .distinguished_name
        .push(DnType::OrganizationName, "promptgate");
    // It signs leaves only, never another CA.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    // A day of slack for clocks that are a little behind.
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(i64::from(days));
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Writes the key file exclusively (fails if it exists), readable by the owner only.
fn write_key(path: &Path, pem: &str) -> Result<(), CaError> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let wrote = options
        .open(path)
        .and_then(|mut f| f.write_all(pem.as_bytes()).and_then(|()| f.sync_all()));
    wrote.map_err(|source| CaError::Write {
        path: path.display().to_string(),
        source,
    })
}

/// Writes `bytes` to a temporary file beside `path`, then renames it into place, so
/// readers see the whole file or none.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), CaError> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let error = |source| CaError::Write {
        path: path.display().to_string(),
        source,
    };
    std::fs::write(&tmp, bytes).map_err(error)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        error(e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pg-ca-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn created_once_then_loaded() {
        let d = dir("once");
        let (ca, created) = CertificateAuthority::load_or_create(&d, 30).unwrap();
        assert!(created);
        let (again, created) = CertificateAuthority::load_or_create(&d, 30).unwrap();
        assert!(!created);
        assert_eq!(ca.fingerprint(), again.fingerprint());
        assert_eq!(ca.fingerprint().len(), 95);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(ca.key_path())
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert!(matches!(
            CertificateAuthority::create(&d, 30, false),
            Err(CaError::Exists { .. })
        ));
        let replaced = CertificateAuthority::create(&d, 30, true).unwrap();
        assert_ne!(replaced.fingerprint(), ca.fingerprint());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn broken_files_are_named() {
        let d = dir("broken");
        assert!(matches!(
            CertificateAuthority::load(&d),
            Err(CaError::Missing { .. })
        ));
        CertificateAuthority::create(&d, 30, false).unwrap();
        let (cert, key) = paths(&d);
        std::fs::write(&cert, "not a certificate").unwrap();
        let err = CertificateAuthority::load(&d).unwrap_err().to_string();
        assert!(
            err.contains("promptgate-ca.pem: not a valid PEM certificate"),
            "{err}"
        );
        std::fs::remove_file(&key).unwrap();
        let err = CertificateAuthority::load(&d).unwrap_err().to_string();
        assert!(err.contains("promptgate-ca-key.pem is missing"), "{err}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
