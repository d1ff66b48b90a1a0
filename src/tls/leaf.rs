//! Leaf certificates for intercepted hosts, minted from the CA on first use and
//! cached per host as a ready TLS server configuration.
//!
//! A burst of connections to a new host mints one certificate: callers share a
//! per-host once-cell, and no map reference is held across an await.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use dashmap::DashMap;
use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose};
use rustls::ServerConfig;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use time::OffsetDateTime;
use tokio::sync::OnceCell;

use super::ca::CertificateAuthority;

/// The longest leaf lifetime browsers and Apple platforms accept (398 days, minus slack).
const LEAF_DAYS: i64 = 397;

/// A cached leaf this close to its end is minted again (a proxy that runs for a year).
const RENEW_BEFORE: time::Duration = time::Duration::days(1);

/// A minted leaf, ready to serve.
struct Leaf {
    config: Arc<ServerConfig>,
    not_after: OffsetDateTime,
}

/// Why a leaf could not be made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LeafError {
    #[error("minting a certificate for {host}: {source}")]
    Mint { host: String, source: rcgen::Error },
    #[error("TLS setup for {host}: {source}")]
    Tls { host: String, source: rustls::Error },
}

/// Per-host TLS server configurations, each holding a leaf signed by the CA.
pub(crate) struct LeafCache {
    ca: Arc<CertificateAuthority>,
    configs: DashMap<String, Arc<OnceCell<Leaf>>>,
    minted: AtomicU64,
}

impl std::fmt::Debug for LeafCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeafCache")
            .field("hosts", &self.configs.len())
            .field("minted", &self.minted())
            .finish()
    }
}

impl LeafCache {
    /// An empty cache whose leaves `ca` signs.
    pub(crate) fn new(ca: Arc<CertificateAuthority>) -> Self {
        LeafCache {
            ca,
            configs: DashMap::new(),
            minted: AtomicU64::new(0),
        }
    }

    /// The CA the leaves come from.
    pub(crate) fn ca(&self) -> &CertificateAuthority {
        &self.ca
    }

    /// The server configuration for `host` (ALPN h2 and http/1.1), minting its leaf
    /// the first time.
    pub(crate) async fn server_config(&self, host: &str) -> Result<Arc<ServerConfig>, LeafError> {
        let host = host.to_ascii_lowercase();
        loop {
            // Clone the cell out so the map's shard lock is released before awaiting.
            let cell = self.configs.entry(host.clone()).or_default().clone();
            let leaf = cell.get_or_try_init(|| async { self.mint(&host) }).await?;
            let renewable = leaf.not_after < self.ca.not_after();
            if !renewable || leaf.not_after - OffsetDateTime::now_utc() > RENEW_BEFORE {
                return Ok(leaf.config.clone());
            }
            // Only the caller that still sees this cell removes it; the next turn mints.
            self.configs
                .remove_if(&host, |_, current| Arc::ptr_eq(current, &cell));
        }
    }

    /// How many leaves were minted since start.
    pub(crate) fn minted(&self) -> u64 {
        self.minted.load(Ordering::Relaxed)
    }

    fn mint(&self, host: &str) -> Result<Leaf, LeafError> {
        let started = Instant::now();
        let mint_error = |source| LeafError::Mint {
            host: host.to_owned(),
            source,
        };
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::new(vec![host.to_owned()]).map_err(mint_error)?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, host);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        // Inside the CA's own lifetime, and no longer than clients accept for a leaf.
        params.not_before = (now - time::Duration::days(1)).max(self.ca.not_before());
        params.not_after = (now + time::Duration::days(LEAF_DAYS)).min(self.ca.not_after());
        let not_after = params.not_after;
        let key = KeyPair::generate().map_err(mint_error)?;
        let leaf = params
            .signed_by(&key, self.ca.issuer())
            .map_err(mint_error)?;
        let chain: Vec<CertificateDer<'static>> = vec![leaf.der().clone()];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let tls_error = |source| LeafError::Tls {
            host: host.to_owned(),
            source,
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(tls_error)?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(tls_error)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let total = self.minted.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(
            host,
            mint_us = started.elapsed().as_micros() as u64,
            minted_total = total,
            "minted leaf certificate"
        );
        Ok(Leaf {
            config: Arc::new(config),
            not_after,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_mints_once_per_host() {
        let dir = std::env::temp_dir().join(format!("pg-leaf-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = CertificateAuthority::create(&dir, 30, false).unwrap();
        let cache = Arc::new(LeafCache::new(Arc::new(ca)));
        let tasks: Vec<_> = (0..100)
            .map(|i| {
                let cache = cache.clone();
                let host = if i % 2 == 0 {
                    "api.anthropic.com"
                } else {
                    "API.openai.com"
                };
                tokio::spawn(async move { cache.server_config(host).await.unwrap() })
            })
            .collect();
        let mut configs = Vec::new();
        for t in tasks {
            configs.push(t.await.unwrap());
        }
        assert_eq!(cache.minted(), 2);
        assert!(Arc::ptr_eq(&configs[0], &configs[98]));
        assert!(!Arc::ptr_eq(&configs[0], &configs[1]));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The leaf a client gets for `host`, through a real handshake that trusts only the CA.
    async fn handshake_leaf(cache: &LeafCache, host: &str) -> Vec<u8> {
        let (client_io, server_io) = tokio::io::duplex(64 << 10);
        let config = cache.server_config(host).await.unwrap();
        let server = tokio::spawn(async move {
            tokio_rustls::TlsAcceptor::from(config)
                .accept(server_io)
                .await
                .map(|_| ())
        });
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cache.ca().cert_der().clone()).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let name = rustls_pki_types::ServerName::try_from(host.to_owned()).unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(client))
            .connect(name, client_io)
            .await
            .expect("the leaf verifies with the CA");
        server.await.unwrap().unwrap();
        tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
    }

    #[tokio::test]
    async fn leaves_are_short_lived_server_certificates_inside_the_ca() {
        let dir = std::env::temp_dir().join(format!("pg-leaf-validity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let long = LeafCache::new(Arc::new(
            CertificateAuthority::create(&dir, 3650, false).unwrap(),
        ));
        let der = handshake_leaf(&long, "api.anthropic.com").await;
        let (_, leaf) = x509_parser::parse_x509_certificate(&der).unwrap();
        let now = OffsetDateTime::now_utc();
        let (from, to) = (
            leaf.validity().not_before.to_datetime(),
            leaf.validity().not_after.to_datetime(),
        );
        assert!(from <= now - time::Duration::hours(23) && from >= now - time::Duration::days(2));
        assert!(
            to <= now + time::Duration::days(LEAF_DAYS) && to > now + time::Duration::days(396)
        );
        let san = leaf.subject_alternative_name().unwrap().unwrap();
        assert_eq!(
            format!("{:?}", san.value.general_names),
            "[DNSName(\"api.anthropic.com\")]"
        );
        let eku = leaf.extended_key_usage().unwrap().unwrap();
        assert!(eku.value.server_auth);
        let aki = leaf.extensions().iter().any(|e| {
            matches!(
                e.parsed_extension(),
                x509_parser::extensions::ParsedExtension::AuthorityKeyIdentifier(_)
            )
        });
        assert!(aki, "the leaf names its issuer's key");
        assert!(!leaf.is_ca());

        // A CA with a day left: the leaf ends with it, and is served (not re-minted forever).
        let short = LeafCache::new(Arc::new(
            CertificateAuthority::create(&dir, 1, true).unwrap(),
        ));
        let der = handshake_leaf(&short, "api.openai.com").await;
        let (_, leaf) = x509_parser::parse_x509_certificate(&der).unwrap();
        assert_eq!(
            leaf.validity().not_after.to_datetime(),
            short.ca().not_after()
        );
        handshake_leaf(&short, "api.openai.com").await;
        assert_eq!(short.minted(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
