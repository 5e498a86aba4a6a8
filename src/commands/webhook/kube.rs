//! The Services of a namespace, from the Kubernetes API, so that the pods the webhook injects
//! hand their late connections to their Service as those `lameduck inject` writes do
//! (docs/kubernetes.md, "Hand-off"). The webhook asks with its own ServiceAccount (the
//! manifests' ClusterRole lets it list Services, nothing more); the workload gets no permission.
//!
//! One `GET /api/v1/namespaces/NS/services` over HTTPS, the token read again at each call (the
//! kubelet rotates it), the answer kept for [`KEPT`] per namespace: a Deployment's pods come in
//! bursts. A review never waits longer than [`LIST_TIMEOUT`] for it; without an answer the pod
//! is injected without a hand-off (its late connections are refused, as before) and the log
//! says why.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

use crate::commands::inject::{self, Service};
use crate::sync::lock;

/// How long a namespace's Services are kept.
const KEPT: Duration = Duration::from_secs(10);
/// How long a review waits for the API.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest list read.
const MAX_LIST: usize = 16 * 1024 * 1024;
/// Where a pod finds its ServiceAccount's credentials.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The API server, and the Services it listed lately.
pub struct Api {
    host: String,
    port: u16,
    token: PathBuf,
    tls: Arc<rustls::ClientConfig>,
    kept: Mutex<HashMap<String, Listed>>,
}

/// A namespace's Services, and when the API listed them.
type Listed = (Instant, Arc<Vec<Service>>);

impl Api {
    /// The API server at `url` (`https://HOST:PORT`), else the one a pod is given
    /// (`KUBERNETES_SERVICE_HOST`, `KUBERNETES_SERVICE_PORT`); `None` when there is none (not in
    /// a pod): the webhook then injects without hand-offs.
    pub fn new(url: Option<&str>, token: PathBuf, ca: PathBuf) -> Result<Option<Api>, String> {
        let (host, port) = match url {
            Some(url) => {
                let rest = url
                    .strip_prefix("https://")
                    .ok_or_else(|| format!("{url}: the API server is spoken to over https://"))?;
                let rest = rest.trim_end_matches('/');
                let (host, port) = match rest.rsplit_once(':') {
                    Some((host, port)) if !host.ends_with(']') || host.starts_with('[') => (
                        host,
                        port.parse::<u16>()
                            .map_err(|_| format!("{url}: not https://HOST:PORT"))?,
                    ),
                    _ => (rest, 443),
                };
                (host.trim_matches(['[', ']']).to_string(), port)
            }
            None => {
                let host = std::env::var("KUBERNETES_SERVICE_HOST").ok();
                let port = std::env::var("KUBERNETES_SERVICE_PORT").ok();
                match (host, port.and_then(|port| port.parse().ok())) {
                    (Some(host), Some(port)) => (host, port),
                    _ => return Ok(None),
                }
            }
        };
        let pem = std::fs::read(&ca).map_err(|error| {
            format!("cannot read the API server's CA {}: {error}", ca.display())
        })?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert: CertificateDer<'static> =
                cert.map_err(|error| format!("{}: not PEM certificates: {error}", ca.display()))?;
            roots
                .add(cert)
                .map_err(|error| format!("{}: {error}", ca.display()))?;
        }
        if roots.is_empty() {
            return Err(format!("{}: no certificate in it", ca.display()));
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|error| error.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(Some(Api {
            host,
            port,
            token,
            tls: Arc::new(tls),
            kept: Mutex::new(HashMap::new()),
        }))
    }

    /// Where it is, for the log.
    pub fn address(&self) -> String {
        format!("https://{}:{}", self.host, self.port)
    }

    /// The Services of `namespace` that select pods, from the last answer of the last
    /// [`KEPT`], else asked now.
    pub async fn services(&self, namespace: &str) -> Result<Arc<Vec<Service>>, String> {
        if !is_namespace(namespace) {
            return Err(format!("{namespace:?} is no namespace name"));
        }
        if let Some((at, services)) = lock(&self.kept).get(namespace)
            && at.elapsed() < KEPT
        {
            return Ok(services.clone());
        }
        let listed = tokio::time::timeout(LIST_TIMEOUT, self.list(namespace))
            .await
            .map_err(|_| {
                format!(
                    "no answer within {}",
                    humantime::format_duration(LIST_TIMEOUT)
                )
            })??;
        let services = Arc::new(listed);
        let mut kept = lock(&self.kept);
        kept.retain(|_, (at, _)| at.elapsed() < KEPT);
        kept.insert(namespace.to_string(), (Instant::now(), services.clone()));
        Ok(services)
    }

    async fn list(&self, namespace: &str) -> Result<Vec<Service>, String> {
        let token = std::fs::read_to_string(&self.token)
            .map_err(|error| format!("cannot read the token {}: {error}", self.token.display()))?;
        let stream = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|error| format!("cannot connect: {error}"))?;
        let name = match self.host.parse::<std::net::IpAddr>() {
            Ok(ip) => ServerName::IpAddress(ip.into()),
            Err(_) => ServerName::try_from(self.host.clone())
                .map_err(|error| format!("{}: {error}", self.host))?,
        };
        let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(name, stream)
            .await
            .map_err(|error| format!("TLS: {error}"))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|error| error.to_string())?;
        tokio::spawn(connection);
        let request = Request::get(format!("/api/v1/namespaces/{namespace}/services"))
            .header(hyper::header::HOST, format!("{}:{}", self.host, self.port))
            .header(
                hyper::header::AUTHORIZATION,
                format!("Bearer {}", token.trim()),
            )
            .header(hyper::header::ACCEPT, "application/json")
            .body(Empty::<Bytes>::new())
            .map_err(|error| error.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|error| error.to_string())?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_LIST)
            .collect()
            .await
            .map_err(|error| format!("reading the answer: {error}"))?
            .to_bytes();
        if status != StatusCode::OK {
            let said = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
            return Err(format!("the API server answered {status}: {said}"));
        }
        services_of(&body)
    }
}

/// The Services of a `ServiceList` in JSON.
fn services_of(body: &[u8]) -> Result<Vec<Service>, String> {
    let list: serde_json::Value =
        serde_json::from_slice(body).map_err(|error| format!("not a ServiceList: {error}"))?;
    let items = list["items"]
        .as_array()
        .ok_or("not a ServiceList: no items")?;
    let documents: Vec<serde_norway::Value> = items
        .iter()
        .map(|item| {
            let mut item = item.clone();
            // A list's items carry neither; the list says what they are.
            item["apiVersion"] = "v1".into();
            item["kind"] = "Service".into();
            serde_norway::to_value(item).map_err(|error| error.to_string())
        })
        .collect::<Result<_, _>>()?;
    Ok(inject::services_of(documents.iter()))
}

/// A namespace name (a DNS label): it goes into the request's path.
fn is_namespace(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_list_gives_the_services_that_select_pods() {
        let body = br#"{"kind":"ServiceList","apiVersion":"v1","items":[
            {"metadata":{"name":"web","namespace":"shop"},"spec":{"selector":{"app":"web"},"ports":[{"port":80,"targetPort":8080,"protocol":"TCP"}]}},
            {"metadata":{"name":"kubernetes","namespace":"shop"},"spec":{"ports":[{"port":443}]}}]}"#;
        let services = services_of(body).unwrap();
        assert_eq!(services.len(), 1);
        assert!(services_of(b"{}").unwrap_err().contains("no items"));
    }

    #[test]
    fn only_namespace_names_go_into_the_path() {
        assert!(is_namespace("shop-2"));
        for bad in ["", "Shop", "a/b", "../x", &"a".repeat(64)] {
            assert!(!is_namespace(bad), "{bad}");
        }
    }
}
