//! The serving certificate, read from PEM files and read again when they change, so that a
//! rotated certificate (cert-manager, a renewed Secret) is served without a restart.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::crypto::ring::sign::any_supported_type;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tracing::{info, warn};

use crate::sync::lock;

/// How often, at most, the files are looked at again (at a handshake).
const RECHECK: Duration = Duration::from_secs(1);

/// Reads a certificate chain and its key from PEM files.
pub fn load(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, String> {
    let read = |path: &Path| {
        fs::read(path).map_err(|error| format!("cannot read {}: {error}", path.display()))
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read(cert)?)
        .collect::<Result<_, _>>()
        .map_err(|error| format!("{}: not PEM certificates: {error}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate in it", cert.display()));
    }
    let key: PrivateKeyDer<'static> =
        PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|error| match error {
            pem::Error::NoItemsFound => format!("{}: no private key in it", key.display()),
            error => format!("{}: not a PEM key: {error}", key.display()),
        })?;
    let signing =
        any_supported_type(&key).map_err(|error| format!("unsupported private key: {error}"))?;
    let certified = CertifiedKey::new(chain, signing);
    certified
        .keys_match()
        .map_err(|error| format!("the key does not match the certificate: {error}"))?;
    Ok(Arc::new(certified))
}

/// The certificate to serve, read again from its files when they have changed.
#[derive(Debug)]
pub struct Reloading {
    cert: PathBuf,
    key: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    current: Arc<CertifiedKey>,
    modified: (Option<SystemTime>, Option<SystemTime>),
    checked: Instant,
}

fn modified(path: &Path) -> Option<SystemTime> {
    fs::metadata(path).and_then(|meta| meta.modified()).ok()
}

impl Reloading {
    pub fn new(cert: &Path, key: &Path) -> Result<Reloading, String> {
        let current = load(cert, key)?;
        Ok(Reloading {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            state: Mutex::new(State {
                current,
                modified: (modified(cert), modified(key)),
                checked: Instant::now(),
            }),
        })
    }

    /// The certificate now: the files' if they changed and read well, else the last good one.
    fn current(&self) -> Arc<CertifiedKey> {
        let mut state = lock(&self.state);
        if state.checked.elapsed() >= RECHECK {
            state.checked = Instant::now();
            let now = (modified(&self.cert), modified(&self.key));
            if now != state.modified {
                match load(&self.cert, &self.key) {
                    Ok(fresh) => {
                        info!(cert = %self.cert.display(), "serving certificate reloaded");
                        state.current = fresh;
                        state.modified = now;
                    }
                    // Half-written files (the key before the certificate): try again later.
                    Err(error) => warn!(%error, "certificate files changed but cannot be used yet"),
                }
            }
        }
        state.current.clone()
    }
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A rustls server configuration that serves `certs`, HTTP/1.1 only.
pub fn server_config(certs: Arc<Reloading>) -> Arc<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_no_client_auth()
        .with_cert_resolver(certs);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}
