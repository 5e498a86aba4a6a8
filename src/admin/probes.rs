//! The app's own probes, run from inside the pod for the kubelet (docs/kubernetes.md, "Probes").
//!
//! `lameduck inject` points the app containers' `httpGet`, `tcpSocket` and `grpc` probes at
//! `GET /app-health/<container>/<readyz|livez|startupz>` on the admin port, and passes the
//! probes as they were in `--app-probes`. The kubelet's probes then never reach the inbound
//! routes, where they would count as traffic for the lame duck (they come from the node, whose
//! address on the pod network is the bridge's on most plugins, so the proxy cannot tell them
//! from clients by their source). Each request here runs the original check against the app,
//! as the kubelet would have, and answers with what the kubelet would have concluded:
//!
//! - `httpGet`: a GET to the pod's address (or the probe's `host`), HTTPS without verifying the
//!   certificate, the probe's headers and the kubelet's `User-Agent`; a status from 200 to 399
//!   passes, redirects to the same host are followed (at most 10), one to another host passes.
//! - `tcpSocket`: a connection that opens passes.
//! - `grpc`: `grpc.health.v1.Health/Check` over HTTP/2 without TLS; `SERVING` passes.
//!
//! A pass is `200`; a failure the app's own status when it answered one (so the kubelet's event
//! says what the app said), else `503` with the reason. Every check is bounded by the probe's
//! `timeoutSeconds`. This is no part of the data path: nothing here is counted as a connection.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bytes::{Buf, Bytes};
use http_body_util::{BodyExt, Empty, Full};
use hyper::header::{HOST, HeaderName, HeaderValue, LOCATION, USER_AGENT};
use hyper::{Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tracing::debug;

use crate::config::{AppProbe, AppProbes, Check};

/// The kubelet follows at most this many redirects to the same host.
const MAX_REDIRECTS: usize = 10;
/// What the checks send when the kubelet's request named no agent of its own.
const DEFAULT_USER_AGENT: &str = "kube-probe/lameduck";
/// `grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING`.
const GRPC_SERVING: u64 = 1;

/// The app's probes, and where they go.
#[derive(Debug)]
pub struct Prober {
    probes: AppProbes,
    pod_ip: IpAddr,
}

/// What one check concluded.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    /// The app answered, with this status (an HTTP check's only).
    FailedWith(StatusCode),
    /// No answer, or not a passing one: why.
    Failed(String),
}

impl Prober {
    pub fn new(probes: AppProbes, pod_ip: IpAddr) -> Prober {
        Prober { probes, pod_ip }
    }

    /// The probe at `path`, if the app declared one there.
    pub fn probe(&self, path: &str) -> Option<&AppProbe> {
        self.probes.get(path)
    }

    /// Runs `probe` against the app; `user_agent` is the kubelet's (`kube-probe/1.33`).
    pub async fn check(&self, probe: &AppProbe, user_agent: Option<&HeaderValue>) -> Verdict {
        let work = async {
            match &probe.check {
                Check::Http {
                    https,
                    host,
                    port,
                    path,
                    headers,
                } => {
                    let host = host.clone().unwrap_or_else(|| self.pod_ip.to_string());
                    let target = Target {
                        https: *https,
                        host,
                        port: *port,
                        path: path.clone(),
                    };
                    http_check(target, headers, user_agent).await
                }
                Check::Tcp { host, port } => {
                    let host = host.clone().unwrap_or_else(|| self.pod_ip.to_string());
                    match connect(&host, *port).await {
                        Ok(_) => Verdict::Pass,
                        Err(error) => Verdict::Failed(error),
                    }
                }
                Check::Grpc { port, service } => {
                    grpc_check(self.pod_ip, *port, service, user_agent).await
                }
            }
        };
        match tokio::time::timeout(probe.timeout, work).await {
            Ok(verdict) => verdict,
            Err(_) => Verdict::Failed(format!(
                "no answer within {}",
                humantime::format_duration(probe.timeout)
            )),
        }
    }
}

/// Where an HTTP check goes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Target {
    https: bool,
    host: String,
    port: u16,
    path: String,
}

impl Target {
    /// `host:port` as a `Host` header or a URL's authority writes it.
    fn authority(&self) -> String {
        match self.host.parse::<IpAddr>() {
            Ok(IpAddr::V6(v6)) => format!("[{v6}]:{}", self.port),
            _ => format!("{}:{}", self.host, self.port),
        }
    }

    /// Where a redirect from here leads: `None` for another host (the kubelet stops there
    /// and counts it a pass) or a `Location` it cannot read.
    fn redirect(&self, location: &str) -> Option<Target> {
        let (https, rest) = if let Some(rest) = location.strip_prefix("http://") {
            (false, rest)
        } else if let Some(rest) = location.strip_prefix("https://") {
            (true, rest)
        } else if location.starts_with('/') {
            return Some(Target {
                path: location.to_string(),
                ..self.clone()
            });
        } else {
            let base = self.path.rsplit_once('/').map_or("", |(dir, _)| dir);
            return Some(Target {
                path: format!("{base}/{location}"),
                ..self.clone()
            });
        };
        let (authority, path) = match rest.find('/') {
            Some(at) => (&rest[..at], &rest[at..]),
            None => (rest, "/"),
        };
        let default = if https { 443 } else { 80 };
        let (host, port) = match authority.rsplit_once(':') {
            // `host:port`, `[v6]:port`; not the colons of a bracketed address alone.
            Some((host, port))
                if !host.contains(':') || (host.starts_with('[') && host.ends_with(']')) =>
            {
                (host, port.parse::<u16>().ok()?)
            }
            _ => (authority, default),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if !host.eq_ignore_ascii_case(&self.host) {
            return None;
        }
        Some(Target {
            https,
            host: host.to_string(),
            port,
            path: path.to_string(),
        })
    }
}

async fn connect(host: &str, port: u16) -> Result<TcpStream, String> {
    let stream = match host.parse::<IpAddr>() {
        Ok(ip) => TcpStream::connect(SocketAddr::new(ip, port)).await,
        Err(_) => TcpStream::connect((host, port)).await,
    };
    stream.map_err(|error| format!("cannot connect to {host}:{port}: {error}"))
}

/// `httpGet`: GET the target, following redirects to the same host.
async fn http_check(
    mut target: Target,
    headers: &[(String, String)],
    user_agent: Option<&HeaderValue>,
) -> Verdict {
    for _ in 0..=MAX_REDIRECTS {
        let status = match get(&target, headers, user_agent).await {
            Ok(answer) => answer,
            Err(why) => return Verdict::Failed(why),
        };
        let (status, location) = status;
        if !status.is_redirection() {
            return match status.as_u16() {
                200..=399 => Verdict::Pass,
                _ => Verdict::FailedWith(status),
            };
        }
        match location
            .as_deref()
            .and_then(|location| target.redirect(location))
        {
            Some(next) => target = next,
            // Another host, or nowhere the kubelet could follow: it counts as a pass.
            None => return Verdict::Pass,
        }
    }
    Verdict::Failed(format!("stopped after {MAX_REDIRECTS} redirects"))
}

/// One GET: the response's status and `Location`.
async fn get(
    target: &Target,
    headers: &[(String, String)],
    user_agent: Option<&HeaderValue>,
) -> Result<(StatusCode, Option<String>), String> {
    let mut request = Request::get(target.path.as_str())
        .body(Empty::<Bytes>::new())
        .map_err(|error| format!("cannot ask for {:?}: {error}", target.path))?;
    let authority = target.authority();
    let fields = request.headers_mut();
    let value = |text: &str| HeaderValue::from_str(text).map_err(|error| error.to_string());
    fields.insert(HOST, value(&authority)?);
    fields.insert(
        USER_AGENT,
        user_agent
            .cloned()
            .unwrap_or(HeaderValue::from_static(DEFAULT_USER_AGENT)),
    );
    fields.insert("accept", HeaderValue::from_static("*/*"));
    fields.insert("connection", HeaderValue::from_static("close"));
    for (name, text) in headers {
        let name = HeaderName::from_bytes(name.as_bytes()).map_err(|error| error.to_string())?;
        fields.insert(name, value(text)?);
    }
    let stream = connect(&target.host, target.port).await?;
    let response = match target.https {
        false => send_http1(stream, request).await,
        true => {
            let name = ServerName::try_from(target.host.clone())
                .map_err(|error| format!("{}: {error}", target.host))?;
            let tls = tokio_rustls::TlsConnector::from(unverified_tls())
                .connect(name, stream)
                .await
                .map_err(|error| format!("TLS with {authority}: {error}"))?;
            send_http1(tls, request).await
        }
    }
    .map_err(|error| format!("GET {} on {authority}: {error}", target.path))?;
    let location = response
        .headers()
        .get(LOCATION)
        .and_then(|location| location.to_str().ok())
        .map(str::to_string);
    Ok((response.status(), location))
}

async fn send_http1<S>(
    io: S,
    request: Request<Empty<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, hyper::Error>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(ended(connection));
    sender.send_request(request).await
}

/// A client connection's own task: it ends with its request (or with the check's timeout,
/// which drops the sender).
async fn ended<F: Future<Output = Result<(), hyper::Error>>>(connection: F) {
    if let Err(error) = connection.await {
        debug!(%error, "a probe's connection to the app ended with an error");
    }
}

/// `grpc`: `grpc.health.v1.Health/Check` for `service` (empty: the whole server).
async fn grpc_check(
    pod_ip: IpAddr,
    port: u16,
    service: &str,
    user_agent: Option<&HeaderValue>,
) -> Verdict {
    let host = pod_ip.to_string();
    let stream = match connect(&host, port).await {
        Ok(stream) => stream,
        Err(why) => return Verdict::Failed(why),
    };
    let target = Target {
        https: false,
        host,
        port,
        path: String::new(),
    };
    let answer = async {
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .map_err(|error| error.to_string())?;
        tokio::spawn(ended(connection));
        let request = Request::post(format!(
            "http://{}/grpc.health.v1.Health/Check",
            target.authority()
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header(
            USER_AGENT,
            user_agent
                .cloned()
                .unwrap_or(HeaderValue::from_static(DEFAULT_USER_AGENT)),
        )
        .body(Full::new(grpc_request(service)))
        .map_err(|error| error.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|error| error.to_string())?;
        if response.status() != StatusCode::OK {
            return Err(format!("HTTP status {}", response.status()));
        }
        let mut headers = response.headers().clone();
        let collected = response
            .into_body()
            .collect()
            .await
            .map_err(|error| error.to_string())?;
        if let Some(trailers) = collected.trailers() {
            headers.extend(trailers.clone());
        }
        let grpc_status = headers
            .get("grpc-status")
            .and_then(|status| status.to_str().ok())
            .unwrap_or("");
        if grpc_status != "0" {
            let message = headers
                .get("grpc-message")
                .and_then(|message| message.to_str().ok())
                .unwrap_or("");
            return Err(format!("gRPC status {grpc_status:?} {message}"));
        }
        let status =
            grpc_serving_status(collected.to_bytes()).ok_or("an unreadable HealthCheckResponse")?;
        Ok::<_, String>(status)
    };
    match answer.await {
        Ok(GRPC_SERVING) => Verdict::Pass,
        Ok(status) => Verdict::Failed(format!("the service is not serving (status {status})")),
        Err(why) => Verdict::Failed(format!(
            "gRPC health check on {}: {why}",
            target.authority()
        )),
    }
}

/// A `HealthCheckRequest { service }` in a gRPC message frame (uncompressed, length-prefixed).
fn grpc_request(service: &str) -> Bytes {
    let mut message = Vec::new();
    if !service.is_empty() {
        // Field 1, length-delimited.
        message.push(0x0a);
        varint(&mut message, service.len() as u64);
        message.extend_from_slice(service.as_bytes());
    }
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(&message);
    Bytes::from(frame)
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// The `status` of a `HealthCheckResponse` in one gRPC message frame (0, `UNKNOWN`, when the
/// field is absent, as protobuf reads it).
fn grpc_serving_status(mut frame: Bytes) -> Option<u64> {
    if frame.len() < 5 || frame[0] != 0 {
        return None;
    }
    frame.advance(1);
    let length = frame.get_u32() as usize;
    let message = frame.get(..length)?;
    let mut at = 0;
    let mut status = 0;
    let read_varint = |at: &mut usize| -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *message.get(*at)?;
            *at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    };
    while at < message.len() {
        let key = read_varint(&mut at)?;
        match (key >> 3, key & 7) {
            (1, 0) => status = read_varint(&mut at)?,
            (_, 0) => {
                read_varint(&mut at)?;
            }
            (_, 2) => {
                let skip = read_varint(&mut at)? as usize;
                at = at.checked_add(skip).filter(|end| *end <= message.len())?;
            }
            (_, 1) => at += 8,
            (_, 5) => at += 4,
            _ => return None,
        }
    }
    Some(status)
}

/// TLS that accepts any certificate: the kubelet does not verify the app's either.
fn unverified_tls() -> Arc<rustls::ClientConfig> {
    static CONFIG: std::sync::OnceLock<Arc<rustls::ClientConfig>> = std::sync::OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .expect("ring supports the default protocol versions")
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth();
            Arc::new(config)
        })
        .clone()
}

/// Trusts whatever certificate the app shows, but checks that the handshake is signed with it.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How long a check may wait for its answer here.
    const TEST_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

    #[test]
    fn a_redirect_is_followed_only_on_the_same_host() {
        let here = Target {
            https: false,
            host: "10.0.0.7".into(),
            port: 8080,
            path: "/a/b".into(),
        };
        assert_eq!(here.redirect("/c").unwrap().path, "/c");
        assert_eq!(here.redirect("c").unwrap().path, "/a/c");
        let absolute = here.redirect("https://10.0.0.7:8443/d").unwrap();
        assert_eq!(
            (absolute.https, absolute.port, absolute.path.as_str()),
            (true, 8443, "/d")
        );
        assert_eq!(here.redirect("http://10.0.0.7").unwrap().port, 80);
        assert_eq!(here.redirect("http://elsewhere:8080/"), None);
        let v6 = Target {
            host: "fd00::7".into(),
            ..here.clone()
        };
        assert_eq!(v6.authority(), "[fd00::7]:8080");
        assert_eq!(v6.redirect("http://[fd00::7]:9/x").unwrap().port, 9);
    }

    #[test]
    fn grpc_messages_are_framed_and_read() {
        assert_eq!(&grpc_request("")[..], &[0, 0, 0, 0, 0]);
        assert_eq!(
            &grpc_request("ab")[..],
            &[0, 0, 0, 0, 4, 0x0a, 2, b'a', b'b']
        );
        let serving = Bytes::from_static(&[0, 0, 0, 0, 2, 0x08, 1]);
        assert_eq!(grpc_serving_status(serving), Some(GRPC_SERVING));
        // An unknown field before the status, and an empty message (UNKNOWN).
        let skipped = Bytes::from_static(&[0, 0, 0, 0, 5, 0x12, 1, b'x', 0x08, 2]);
        assert_eq!(grpc_serving_status(skipped), Some(2));
        assert_eq!(
            grpc_serving_status(Bytes::from_static(&[0, 0, 0, 0, 0])),
            Some(0)
        );
        // Compressed, cut short, or a length beyond the message.
        for bad in [&[1, 0, 0, 0, 0][..], &[0, 0, 0], &[0, 0, 0, 0, 3, 0x08]] {
            assert_eq!(grpc_serving_status(Bytes::copy_from_slice(bad)), None);
        }
    }

    #[tokio::test]
    async fn a_tcp_check_passes_when_the_port_opens_and_fails_when_it_does_not() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let prober = Prober::new(AppProbes::default(), IpAddr::from([127, 0, 0, 1]));
        let probe = |port| AppProbe {
            check: Check::Tcp { host: None, port },
            timeout: TEST_PATIENCE,
        };
        assert_eq!(prober.check(&probe(port), None).await, Verdict::Pass);
        drop(listener);
        assert!(matches!(
            prober.check(&probe(port), None).await,
            Verdict::Failed(why) if why.contains("cannot connect")
        ));
    }
}
