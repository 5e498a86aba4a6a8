//! The accept loop of every proxy route.
//!
//! [`accept_loop`] hands each accepted connection to the route's handler as a task tracked by
//! its [`Side`]. It accepts only while the process is under its connection limit
//! ([`net::connection_limit`]; otherwise clients wait in the kernel's queue),
//! backs off instead of spinning when accepting fails for lack of file descriptors or memory,
//! and when its side's listeners close, accepts what the kernel already queued (those clients
//! completed their handshake) before closing the socket, so that later connection attempts are
//! refused at once. Each connection is then served by its route's protocol: opaque TCP, or
//! protocol detection followed by HTTP or TCP.
//!
//! On a side that refuses late connections (the inbound side after an adaptive lame duck), the
//! listener is kept instead: [`refuse_late`] accepts what still arrives and resets it at once,
//! counted and logged, so that a client the cluster still sends here learns it in a round
//! trip rather than a connect timeout, and the proxy knows it came (docs/pod-lifecycle.md,
//! "Never a black hole").

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::Either;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{Instrument, debug, info, warn};

use super::detect::{self, Detected};
use super::http::{self, HttpVersion};
use super::tcp;
use super::{ProxyContext, ProxyRoute};
use crate::config::{Protocol, Route, Target};
use crate::conns::{ConnProtocol, Registration};
use crate::drain::{ConnTokens, Side, Watch};
use crate::logging::Throttle;
use crate::net::{self, AcceptErrors, OrigDstRefusal};
use crate::sync::lock;

/// At most one log line per this interval about the connection limit holding clients back.
const AT_LIMIT_LOG_INTERVAL: Duration = Duration::from_secs(1);
/// At most one log line per this interval about late connections after the first.
const LATE_LOG_INTERVAL: Duration = Duration::from_secs(5);

/// Accepts connections for `route` until `side`'s listeners close.
pub async fn accept_loop(
    listener: TcpListener,
    proxy_route: Arc<ProxyRoute>,
    proxy: Arc<ProxyContext>,
    side: Arc<Side>,
) {
    let route = &proxy_route.route;
    let mut errors = AcceptErrors::default();
    let mut at_limit_log = Throttle::new(AT_LIMIT_LOG_INTERVAL);
    loop {
        let Some(permit) = room_for_one_more(&proxy, &side, route, &mut at_limit_log).await else {
            break;
        };
        let accepted = tokio::select! {
            // Closing wins over a ready connection so that a flood of connects cannot delay
            // the refusal promised after the shutdown.
            biased;
            // The shutdown sequence closed this side's listeners.
            _ = side.stop_accepting() => break,
            // A client connected, or accept failed.
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                errors.succeeded();
                if proxy.counts_for_lame_duck(peer.ip()) {
                    side.arrived(peer.ip());
                }
                spawn_connection(stream, peer, &proxy_route, &proxy, &side, Some(permit));
            }
            Err(error) => {
                proxy.metrics.accept_failed(route.direction);
                tokio::select! {
                    // The shutdown sequence closed this side's listeners while backing off.
                    _ = side.stop_accepting() => break,
                    // The pause after the error (none for an error of one connection) is over.
                    _ = errors.failed(&error, route.listen) => {}
                }
            }
        }
    }
    let listener = match listener.into_std() {
        Ok(listener) => listener,
        Err(error) => {
            warn!(%error, "could not take the listener out of the runtime; queued connections are dropped");
            return;
        }
    };
    if !side.refuses_late() {
        // From here on the kernel drops new SYNs (their clients retry, and meet the closed
        // port): no connection completes its handshake between the last accept and the close,
        // where the close would reset it after its client had sent a request.
        if let Err(error) = net::refuse_new_handshakes(&listener) {
            debug!(%error, "could not filter new handshakes out before closing the listener");
        }
        accept_queued(&listener, &proxy_route, &proxy, &side);
        // Closing the socket makes the kernel refuse new connection attempts.
        drop(listener);
        info!(direction = %route.direction, listen = %route.listen, "listener closed");
        return;
    }
    // Those already queued came in time; what comes after is late.
    accept_queued(&listener, &proxy_route, &proxy, &side);
    side.refusing_from_now();
    match TcpListener::from_std(listener) {
        Ok(listener) => {
            info!(direction = %route.direction, listen = %route.listen, "listener closed to new clients: late connections are refused at once, or handed off to the pod's Service where it has one");
            side.clone()
                .spawn_refuser(refuse_late(listener, proxy_route, proxy, side));
        }
        Err(error) => {
            warn!(%error, "could not keep the listener to refuse late connections; it is closed")
        }
    }
}

/// Accepts what still arrives on a closed side's listener and resets it at once: a late
/// connection, counted (and in the side's book of late arrivals, for the linger), never left to
/// time out; until the side stops refusing.
async fn refuse_late(
    listener: TcpListener,
    proxy_route: Arc<ProxyRoute>,
    proxy: Arc<ProxyContext>,
    side: Arc<Side>,
) {
    let route = &proxy_route.route;
    let mut errors = AcceptErrors::default();
    let mut log = Throttle::new(LATE_LOG_INTERVAL);
    loop {
        let accepted = tokio::select! {
            // The inbound side serves again (its app container restarted): the port is for
            // the new listeners.
            _ = side.refusing_stopped() => break,
            // A client that the cluster still sends here, or accept failed.
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                errors.succeeded();
                let handoff = proxy.handoff.as_ref();
                if handoff.is_some_and(|handoff| handoff.came_back(peer)) {
                    // The hand-off's own connection, sent back by the node's Service rules:
                    // reset unread, its sender dials again.
                    net::reset(&stream);
                    let first = side.came_back() == 1;
                    proxy.metrics.handoff_loop();
                    match first {
                        true => {
                            info!(%peer, "a hand-off came back to this pod (the node's Service rules still send here): reset unread, and dialled again; later ones are counted")
                        }
                        false => {
                            debug!(%peer, "a hand-off came back to this pod; reset, to be dialled again")
                        }
                    }
                    continue;
                }
                let handed = handoff.and_then(|handoff| handoff.route_for(&stream, &proxy_route));
                proxy
                    .metrics
                    .late_connection(route.direction, handed.is_some());
                let count = side.arrived_late(peer.ip(), proxy.counts_for_lame_duck(peer.ip()));
                let fate = match &handed {
                    Some(handed) => {
                        side.handed_off();
                        let to = handed.route.target.to_string();
                        spawn_connection(stream, peer, handed, &proxy, &side, None);
                        to
                    }
                    None => {
                        net::reset(&stream);
                        drop(stream);
                        "refused".to_string()
                    }
                };
                if count == 1 {
                    info!(direction = %route.direction, listen = %route.listen, %peer, to = %fate, "late connection: the lame duck is over, yet the cluster still sends new connections here; each is handed off to the pod's Service where it has one, else reset at once (never left to time out)");
                } else if let Some(suppressed) = log.due() {
                    let (handed_off, loops) = side.handoffs();
                    info!(direction = %route.direction, late_connections = count, handed_off, loops, last_from = %peer.ip(), last_to = %fate, suppressed, "late connections still arriving");
                }
            }
            Err(error) => {
                proxy.metrics.accept_failed(route.direction);
                tokio::select! {
                    // The side serves again while backing off.
                    _ = side.refusing_stopped() => break,
                    // The pause after the error is over.
                    _ = errors.failed(&error, route.listen) => {}
                }
            }
        }
    }
    info!(direction = %route.direction, listen = %route.listen, "listener closed");
}

/// Waits for a permit under the connection limit, logging (at most once per
/// [`AT_LIMIT_LOG_INTERVAL`]) when the limit holds new connections back. `None` when the
/// route's listeners close meanwhile.
async fn room_for_one_more(
    proxy: &ProxyContext,
    side: &Side,
    route: &Route,
    log: &mut Throttle,
) -> Option<OwnedSemaphorePermit> {
    if let Ok(permit) = proxy.limit.clone().try_acquire_owned() {
        return Some(permit);
    }
    proxy.metrics.limit_reached();
    if let Some(suppressed) = log.due() {
        warn!(
            listen = %route.listen,
            open = proxy.conns.len(),
            suppressed,
            "at the connection limit set by the file-descriptor limit; new connections wait in the listen queue"
        );
    }
    tokio::select! {
        // The shutdown sequence closed this side's listeners.
        _ = side.stop_accepting() => None,
        // A connection closed and gave its permit back.
        permit = proxy.limit.clone().acquire_owned() => permit.ok(),
    }
}

/// Accepts every connection already in the kernel's queue (those clients completed their
/// handshake in time).
fn accept_queued(
    listener: &std::net::TcpListener,
    proxy_route: &Arc<ProxyRoute>,
    proxy: &Arc<ProxyContext>,
    side: &Side,
) {
    let route = &proxy_route.route;
    let mut queued = 0usize;
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                let stream = stream
                    .set_nonblocking(true)
                    .and_then(|()| TcpStream::from_std(stream));
                match stream {
                    Ok(stream) => {
                        queued += 1;
                        // Over the limit if need be: these clients were already accepted by the kernel.
                        let permit = proxy.limit.clone().try_acquire_owned().ok();
                        spawn_connection(stream, peer, proxy_route, proxy, side, permit);
                    }
                    Err(error) => debug!(%error, %peer, "could not register a queued connection"),
                }
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
            Err(error) if net::is_resource_exhaustion(&error) => {
                warn!(%error, "out of resources while accepting queued connections; the rest are reset");
                break;
            }
            Err(_) => continue,
        }
    }
    if queued > 0 {
        info!(direction = %route.direction, listen = %route.listen, queued, "accepted queued connections while closing");
    }
}

fn spawn_connection(
    stream: TcpStream,
    peer: SocketAddr,
    proxy_route: &Arc<ProxyRoute>,
    proxy: &Arc<ProxyContext>,
    side: &Side,
    permit: Option<OwnedSemaphorePermit>,
) {
    let route = &proxy_route.route;
    let protocol = match route.protocol {
        Protocol::Tcp => ConnProtocol::Tcp,
        Protocol::Auto | Protocol::Http => ConnProtocol::Detecting,
    };
    let registration = proxy.conns.register(route.clone(), peer, protocol, permit);
    let tokens = side.conn_tokens();
    let span = tracing::debug_span!("conn", id = registration.conn().id, direction = %route.direction, %peer, target = %route.target);
    let proxy_route = proxy_route.clone();
    let proxy = proxy.clone();
    side.spawn(serve(stream, registration, tokens, proxy_route, proxy).instrument(span));
}

/// Serves one connection by its route's protocol, detecting it on `auto` and `http` routes.
async fn serve(
    stream: TcpStream,
    registration: Registration,
    tokens: ConnTokens,
    proxy_route: Arc<ProxyRoute>,
    proxy: Arc<ProxyContext>,
) {
    let route = &proxy_route.route;
    let destination = match route.target {
        Target::OrigDst => match original_destination(&stream, &proxy) {
            Ok(destination) => {
                registration.conn().set_target_addr(destination);
                Some(destination)
            }
            Err(refusal) => {
                proxy
                    .metrics
                    .connection_refused(route.direction, refusal.as_str());
                // A misconfigured pod refuses every connection: a line a second at most.
                if let Some(suppressed) = lock(&proxy.refusal_log).due() {
                    warn!(
                        reason = refusal.as_str(),
                        suppressed,
                        "refusing a connection on an orig-dst route that has no destination to forward to"
                    );
                }
                net::reset(&stream);
                return;
            }
        },
        _ => None,
    };
    let resolved;
    let (target, own_ports) = match destination {
        Some(destination) => {
            resolved = Target::Addr(destination);
            (&resolved, Some(&proxy.own_ports))
        }
        None => (&route.target, None),
    };
    let protocol = route.protocol;
    // The protocol's own future is boxed once it is known, so that a connection holds only
    // the state of the protocol it speaks (the task is sized for its largest variant).
    let as_tcp = |stream, registration, tokens| match &proxy_route.handoff {
        Some(handoff) => Either::Left(Box::pin(tcp::hand_off(
            stream,
            registration,
            tokens,
            target,
            handoff,
            &proxy,
        ))),
        None => Either::Right(Box::pin(tcp::forward(
            stream,
            registration,
            tokens,
            target,
            own_ports,
            &proxy,
        ))),
    };
    if protocol == Protocol::Tcp {
        if proxy_route.handoff.is_some() {
            proxy.metrics.handoff(ConnProtocol::Tcp);
        }
        return as_tcp(stream, registration, tokens).await;
    }
    // An `http` route waits for the first bytes only as long as for a request's headers.
    let http_only = protocol == Protocol::Http;
    let wait = match http_only {
        true => proxy.http.header_read_timeout,
        false => proxy.http.detect_timeout,
    };
    // A late connection came after its listeners closed: its client is waited for as on an
    // open listener (a server-speaks-first protocol is opaque TCP at the detection timeout).
    let never;
    let listeners_closed = match proxy_route.handoff {
        Some(_) => {
            never = Watch::never();
            &never
        }
        None => &tokens.listeners_closed,
    };
    let detected = tokio::select! {
        // The grace period ran out while the client was silent.
        _ = tokens.terminate.cancelled() => Detected::Closed,
        // Boxed, so that the connection's task is not sized for the detection's state.
        detected = Box::pin(detect::detect(&stream, http_only, wait, listeners_closed)) => detected,
    };
    let handing_off = proxy_route.handoff.is_some();
    let version = match detected {
        Detected::Http1 => HttpVersion::Http1,
        Detected::Http2 => HttpVersion::Http2,
        // Not HTTP, or a server-speaks-first protocol: opaque TCP.
        Detected::Tcp | Detected::Silent if !http_only => {
            if handing_off {
                proxy.metrics.handoff(ConnProtocol::Tcp);
            }
            return as_tcp(stream, registration, tokens).await;
        }
        Detected::Tcp | Detected::Silent | Detected::Closed => {
            debug!(?detected, "closing a connection that sent no request");
            return;
        }
    };
    if handing_off {
        proxy.metrics.handoff(match version {
            HttpVersion::Http1 => ConnProtocol::Http1,
            HttpVersion::Http2 => ConnProtocol::Http2,
        });
    }
    let upstream = proxy_route.upstream(destination);
    Box::pin(http::serve(
        stream,
        version,
        registration,
        tokens,
        upstream,
        proxy,
    ))
    .await;
}

/// Where an `orig-dst` connection goes: its destination before the NAT rules redirected it,
/// unless it has none or it is one of the proxy's own listeners.
fn original_destination(
    stream: &TcpStream,
    proxy: &ProxyContext,
) -> Result<SocketAddr, OrigDstRefusal> {
    // A connection from one of the proxy's own ports on one of the pod's addresses is one of
    // the proxy's own, sent back by NAT rules that do not exempt it.
    if let Ok(peer) = stream.peer_addr()
        && proxy.own_ports.contains(peer.port())
        && net::is_local_ip(peer.ip())
    {
        return Err(OrigDstRefusal::Loop);
    }
    let destination = net::original_destination(stream)?;
    let to_proxy = proxy.listeners.iter().any(|listener| {
        listener.port() == destination.port()
            && (listener.ip() == destination.ip()
                || (listener.ip().is_unspecified() && net::is_local_ip(destination.ip())))
    });
    match to_proxy {
        true => Err(OrigDstRefusal::ToProxy),
        false => Ok(destination),
    }
}
