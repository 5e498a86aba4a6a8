//! The admin server (docs/admin.md). It serves until the process exits, through the whole
//! shutdown, and is never part of the drain.
//!
//! | request | answer |
//! |---|---|
//! | `GET /live` | `200 live` while the process runs |
//! | `GET /ready` | `200 ready` while serving, `503 not ready` before and from the shutdown trigger on |
//! | `GET /metrics` | Prometheus (OpenMetrics) text |
//! | `POST /shutdown` | `200 shutdown`, then the shutdown starts; checks: method (405), loopback peer (403), `Origin`/`Host` (403), enabled (404) |
//! | `GET /connections` | loopback only: the open proxy connections as JSON |
//! | `GET /status` | loopback only: the phase, the inbound quiesce and the time left, as JSON (`lameduck status` prints it for people) |
//! | `GET /app-health/<container>/<probe>` | the app's own probe, run from inside the pod for the kubelet ([`probes`]) |
//!
//! "Loopback" is judged from the socket's peer address alone, never from headers. The query
//! string is ignored; paths match exactly (`/shutdown/` is 404).

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONNECTION, CONTENT_TYPE, HOST, HeaderValue, ORIGIN};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

mod probes;

pub use probes::Prober;

use crate::config::APP_HEALTH_PREFIX;
use crate::conns::Connections;
use crate::drain::{Drain, ShutdownReason};
use crate::lame_duck::LameDuck;
use crate::metrics::Metrics;
use crate::net::AcceptErrors;

/// How long a client may take to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
const FORBIDDEN: &str = "Requests are only permitted from localhost.\n";

#[derive(Debug)]
pub struct Admin {
    pub drain: Arc<Drain>,
    pub conns: Arc<Connections>,
    pub metrics: Arc<Metrics>,
    pub shutdown_endpoint: bool,
    pub grace_period: Duration,
    pub lame_duck: Arc<LameDuck>,
    /// The app's own probes, which the kubelet sends here.
    pub prober: Prober,
}

/// Serves admin connections until the process exits.
pub async fn serve(listener: TcpListener, admin: Arc<Admin>) {
    let listen = listener
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let mut errors = AcceptErrors::default();
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                errors.succeeded();
                tokio::spawn(serve_connection(stream, peer, admin.clone()));
            }
            Err(error) => errors.failed(&error, listen).await,
        }
    }
}

async fn serve_connection(stream: tokio::net::TcpStream, peer: SocketAddr, admin: Arc<Admin>) {
    // Set by the handler when this connection asked for the shutdown; acted on once the
    // response has been written and the connection closed, so the client always gets its 200.
    let shutdown_requested = Arc::new(AtomicBool::new(false));
    let service = {
        let admin = admin.clone();
        let requested = shutdown_requested.clone();
        hyper::service::service_fn(move |request: Request<Incoming>| {
            let (admin, requested) = (admin.clone(), requested.clone());
            async move {
                let response = match request.uri().path() {
                    path if path.starts_with(APP_HEALTH_PREFIX) => {
                        app_probe(&admin.prober, &request).await
                    }
                    _ => handle(&admin, peer, &request, &requested),
                };
                Ok::<_, Infallible>(response)
            }
        })
    };
    let result = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service)
        .await;
    if let Err(error) = result {
        debug!(%peer, %error, "admin connection failed");
    }
    if shutdown_requested.load(Ordering::Acquire)
        && admin.drain.trigger(ShutdownReason::AdminRequest)
    {
        info!(%peer, "shutdown requested on the admin server");
    }
}

fn handle(
    admin: &Admin,
    peer: SocketAddr,
    request: &Request<Incoming>,
    shutdown_requested: &AtomicBool,
) -> Response<Full<Bytes>> {
    let method = request.method();
    let read_only = method == Method::GET || method == Method::HEAD;
    match request.uri().path() {
        "/live" if read_only => text(StatusCode::OK, "live\n"),
        "/ready" if read_only => match admin.drain.is_ready() {
            true => text(StatusCode::OK, "ready\n"),
            false => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        },
        "/metrics" if read_only => match admin.metrics.encode() {
            Ok(body) => {
                let mut response = text(StatusCode::OK, body);
                response.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static(
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    ),
                );
                response
            }
            Err(_) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                "metrics could not be encoded\n",
            ),
        },
        "/connections" if read_only => {
            if !is_local(peer, request) {
                return text(StatusCode::FORBIDDEN, FORBIDDEN);
            }
            let mut response = text(StatusCode::OK, admin.conns.to_json());
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            response
        }
        "/status" if read_only => {
            if !is_local(peer, request) {
                return text(StatusCode::FORBIDDEN, FORBIDDEN);
            }
            let mut response = text(StatusCode::OK, status_json(admin));
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            response
        }
        "/live" | "/ready" | "/metrics" | "/connections" | "/status" => not_allowed("GET, HEAD"),
        "/shutdown" => {
            if method != Method::POST {
                return not_allowed("POST");
            }
            if !is_local(peer, request) {
                warn!(%peer, "refused a shutdown request from a non-local client");
                return text(StatusCode::FORBIDDEN, FORBIDDEN);
            }
            if !admin.shutdown_endpoint {
                return text(StatusCode::NOT_FOUND, "shutdown endpoint is not enabled\n");
            }
            shutdown_requested.store(true, Ordering::Release);
            let mut response = text(StatusCode::OK, "shutdown\n");
            response
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
            response
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// `GET /app-health/...`: the app's own probe, run now; 404 where the app declared none.
async fn app_probe(prober: &Prober, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    let method = request.method();
    if method != Method::GET && method != Method::HEAD {
        return not_allowed("GET, HEAD");
    }
    let Some(probe) = prober.probe(request.uri().path()) else {
        return text(StatusCode::NOT_FOUND, "no such app probe\n");
    };
    let user_agent = request.headers().get(hyper::header::USER_AGENT);
    match prober.check(probe, user_agent).await {
        probes::Verdict::Pass => text(StatusCode::OK, "ok\n"),
        probes::Verdict::FailedWith(status) => {
            text(status, format!("the app answered {}\n", status.as_u16()))
        }
        probes::Verdict::Failed(why) => {
            debug!(path = request.uri().path(), %why, "an app probe failed");
            text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"))
        }
    }
}

/// The body of `GET /status`: where the shutdown and the inbound quiesce stand, with the time
/// each has left of the grace period.
fn status_json(admin: &Admin) -> String {
    let drain = &admin.drain;
    let ms = |duration: Duration| duration.as_millis() as u64;
    let timer = |since: std::time::Instant| {
        serde_json::json!({
            "elapsed_ms": ms(since.elapsed()),
            "grace_left_ms": ms(admin.grace_period.saturating_sub(since.elapsed())),
        })
    };
    let shutdown = match (drain.reason(), drain.started_at()) {
        (Some(reason), Some((started, _))) => {
            let mut timer = timer(started);
            timer["trigger"] = reason.to_string().into();
            timer
        }
        _ => serde_json::Value::Null,
    };
    let quiesce = drain
        .inbound_quiesced_at()
        .map_or(serde_json::Value::Null, timer);
    let (late, last_late) = drain.side(crate::config::Direction::Inbound).late();
    let (handed_off, loops) = drain.side(crate::config::Direction::Inbound).handoffs();
    let late_connections = serde_json::json!({
        "arrived": late,
        "refused": late - handed_off,
        "handed_off": handed_off,
        "handoff_loops": loops,
        "last": last_late.map(|(at, from)| serde_json::json!({
            "ms_ago": ms(at.elapsed()),
            "from": from.to_string(),
        })),
    });
    let status = serde_json::json!({
        "phase": drain.phase().as_str(),
        "ready": drain.is_ready(),
        "inbound": if drain.is_inbound_quiesced() { "quiesced" } else { "serving" },
        "shutdown": shutdown,
        "quiesce": quiesce,
        "grace_period_ms": ms(admin.grace_period),
        "lame_duck_period_ms": ms(admin.lame_duck.policy().longest()),
        "lame_duck": admin.lame_duck.status(),
        "late_connections": late_connections,
    });
    format!("{status}\n")
}

/// The checks of the state-changing and revealing endpoints, in the contract's order: the
/// socket's peer is loopback, then no `Origin` header (a browser's cross-site request) and a
/// `Host` naming loopback (DNS rebinding). A request without `Host` (HTTP/1.0) comes from no
/// browser and passes.
fn is_local(peer: SocketAddr, request: &Request<Incoming>) -> bool {
    let headers = request.headers();
    let host_ok = match headers.get(HOST) {
        None => true,
        Some(host) => host.to_str().is_ok_and(is_loopback_host),
    };
    is_loopback(peer.ip()) && !headers.contains_key(ORIGIN) && host_ok
}

/// 127.0.0.0/8, ::1 and IPv4-mapped 127.x (a dual-stack socket's view of an IPv4 client).
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// `localhost`, a loopback IPv4 address or `[::1]`, each with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((ip, "")) => ip,
            Some((ip, port)) if is_port(port.strip_prefix(':')) => ip,
            _ => return false,
        }
    } else {
        match host.split_once(':') {
            Some((name, port)) if is_port(Some(port)) => name,
            Some(_) => return false,
            None => host,
        }
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok_and(is_loopback)
}

fn is_port(port: Option<&str>) -> bool {
    port.is_some_and(|port| port.parse::<u16>().is_ok())
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

fn not_allowed(allow: &'static str) -> Response<Full<Bytes>> {
    let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    response
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_covers_mapped_ipv4() {
        for ip in ["127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"] {
            assert!(is_loopback(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["10.77.0.1", "::ffff:10.77.0.1", "0.0.0.0", "::"] {
            assert!(!is_loopback(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn only_loopback_hosts_pass() {
        for host in [
            "localhost",
            "LOCALHOST:4191",
            "127.0.0.1",
            "127.0.0.1:4191",
            "[::1]",
            "[::1]:4191",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "evil.example:4191",
            "127.0.0.1.nip.io",
            "[::1]x",
            "localhost:http",
            "10.0.0.1",
            "",
            "[::2]",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }
}
