//! Listening sockets and the accept loop of every proxy route.
//!
//! [`bind`] opens a socket with the options the proxy wants (address reuse, a deep backlog).
//! [`accept_loop`] hands each accepted connection to the route's handler as a task tracked by
//! the side's [`TaskTracker`](tokio_util::task::TaskTracker). It accepts only while the
//! process is under its [`connection_limit`] (otherwise clients wait in the kernel's queue),
//! backs off instead of spinning when accepting fails for lack of file descriptors or memory,
//! and when its side's listeners close, accepts what the kernel already queued (those clients
//! completed their handshake) before closing the socket, so that later connection attempts are
//! refused at once. Each connection is then served by its route's protocol: opaque TCP, or
//! protocol detection followed by HTTP or TCP.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use socket2::{Domain, Socket, Type};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{Instrument, debug, info, warn};

use crate::config::{HttpConfig, Protocol, Route, TcpConfig};
use crate::conns::{ConnProtocol, Connections, Registration};
use crate::detect::{self, Detected};
use crate::drain::{ConnTokens, Drain, Side};
use crate::http::{self, HttpVersion};
use crate::metrics::Metrics;
use crate::tcp;
use crate::upstream::Upstream;

/// Queue length for connections whose handshake is done but which are not yet accepted.
const LISTEN_BACKLOG: i32 = 1024;
/// First and longest pause after an accept error caused by exhausted resources.
pub(crate) const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
pub(crate) const ACCEPT_BACKOFF_MAX: Duration = Duration::from_millis(100);
/// At most one log line per this interval about exhausted resources.
const ACCEPT_ERROR_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Binds a listening TCP socket on `addr`.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    TcpListener::from_std(socket.into())
}

/// A route and what serving it needs.
pub struct RouteHandle {
    pub route: Arc<Route>,
    /// Pooled clients towards the target, for HTTP.
    pub upstream: Upstream,
    /// The target as written in the route, for error responses (formatted once, not per request).
    pub target_name: String,
}

/// Everything a connection task needs, shared by all connections of the process.
#[derive(Debug)]
pub struct Shared {
    pub drain: Arc<Drain>,
    pub conns: Arc<Connections>,
    pub metrics: Arc<Metrics>,
    pub connect_timeout: Duration,
    pub http: HttpConfig,
    pub tcp: TcpConfig,
    /// One permit per open proxy connection, sized from the file-descriptor limit; the accept
    /// loops take a permit before accepting, and each connection's registration holds its own.
    pub limit: Arc<Semaphore>,
}

/// Accepts connections for `route` until `side`'s listeners close.
pub async fn accept_loop(
    listener: TcpListener,
    handle: Arc<RouteHandle>,
    shared: Arc<Shared>,
    side: Arc<Side>,
) {
    let route = &handle.route;
    let mut errors = AcceptErrors::default();
    let mut at_limit_logged: Option<Instant> = None;
    loop {
        let Some(permit) = room_for_one_more(&shared, &side, route, &mut at_limit_logged).await
        else {
            break;
        };
        let accepted = tokio::select! {
            // Closing wins over a ready connection so that a flood of connects cannot delay
            // the refusal promised after the shutdown.
            biased;
            // The shutdown sequence closed this side's listeners.
            _ = side.close_listeners.cancelled() => break,
            // A client connected, or accept failed.
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                errors.succeeded();
                spawn_connection(stream, peer, &handle, &shared, &side, Some(permit));
            }
            Err(error) => {
                shared.metrics.accept_failed(route.direction);
                tokio::select! {
                    // The shutdown sequence closed this side's listeners while backing off.
                    _ = side.close_listeners.cancelled() => break,
                    // The pause after the error (none for an error of one connection) is over.
                    _ = errors.failed(&error, route.listen) => {}
                }
            }
        }
    }
    accept_queued(listener, &handle, &shared, &side);
    info!(direction = %route.direction, listen = %route.listen, "listener closed");
}

/// Waits for a permit under the connection limit, logging (at most once per
/// [`ACCEPT_ERROR_LOG_INTERVAL`]) when the limit holds new connections back. `None` when the
/// route's listeners close meanwhile.
async fn room_for_one_more(
    shared: &Shared,
    side: &Side,
    route: &Route,
    logged: &mut Option<Instant>,
) -> Option<OwnedSemaphorePermit> {
    if let Ok(permit) = shared.limit.clone().try_acquire_owned() {
        return Some(permit);
    }
    shared.metrics.limit_reached();
    if logged.is_none_or(|last| last.elapsed() >= ACCEPT_ERROR_LOG_INTERVAL) {
        warn!(
            listen = %route.listen,
            open = shared.conns.len(),
            "at the connection limit set by the file-descriptor limit; new connections wait in the listen queue"
        );
        *logged = Some(Instant::now());
    }
    tokio::select! {
        // The shutdown sequence closed this side's listeners.
        _ = side.close_listeners.cancelled() => None,
        // A connection closed and gave its permit back.
        permit = shared.limit.clone().acquire_owned() => permit.ok(),
    }
}

/// Accepts every connection already in the kernel's queue, then closes the listener.
fn accept_queued(
    listener: TcpListener,
    handle: &Arc<RouteHandle>,
    shared: &Arc<Shared>,
    side: &Side,
) {
    let route = &handle.route;
    let listener = match listener.into_std() {
        Ok(listener) => listener,
        Err(error) => {
            warn!(%error, "could not take the listener out of the runtime; queued connections are dropped");
            return;
        }
    };
    // From here on the kernel drops new SYNs (their clients retry, and meet the closed port):
    // no connection completes its handshake between the last accept and the close, where the
    // close would reset it after its client had sent a request.
    if let Err(error) = socket2::SockRef::from(&listener).attach_filter(&DROP_SYN) {
        debug!(%error, "could not filter new handshakes out before closing the listener");
    }
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
                        let permit = shared.limit.clone().try_acquire_owned().ok();
                        spawn_connection(stream, peer, handle, shared, side, permit);
                    }
                    Err(error) => debug!(%error, %peer, "could not register a queued connection"),
                }
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
            Err(error) if is_resource_exhaustion(&error) => {
                warn!(%error, "out of resources while accepting queued connections; the rest are reset");
                break;
            }
            Err(_) => continue,
        }
    }
    // Closing the socket makes the kernel refuse new connection attempts.
    drop(listener);
    if queued > 0 {
        info!(direction = %route.direction, listen = %route.listen, queued, "accepted queued connections while closing");
    }
}

/// A classic BPF socket filter that drops TCP segments with SYN set (the flags are byte 13 of
/// the TCP header, where a socket filter starts) and keeps the rest: the last segment of a
/// handshake already under way, and data, still come in.
const DROP_SYN: [libc::sock_filter; 4] = [
    bpf(libc::BPF_LD | libc::BPF_B | libc::BPF_ABS, 0, 0, 13),
    bpf(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, 0, 1, 0x02),
    bpf(libc::BPF_RET | libc::BPF_K, 0, 0, 0),
    bpf(libc::BPF_RET | libc::BPF_K, 0, 0, u32::MAX),
];

const fn bpf(code: u32, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    }
}

fn spawn_connection(
    stream: TcpStream,
    peer: SocketAddr,
    handle: &Arc<RouteHandle>,
    shared: &Arc<Shared>,
    side: &Side,
    permit: Option<OwnedSemaphorePermit>,
) {
    let route = &handle.route;
    let protocol = match route.protocol {
        Protocol::Tcp => ConnProtocol::Tcp,
        Protocol::Auto | Protocol::Http => ConnProtocol::Detecting,
    };
    let registration = shared.conns.register(route.clone(), peer, protocol, permit);
    let tokens = side.conn_tokens();
    let span = tracing::debug_span!("conn", id = registration.conn().id, direction = %route.direction, %peer, target = %route.target);
    let handle = handle.clone();
    let shared = shared.clone();
    side.tracker
        .spawn(serve(stream, registration, tokens, handle, shared).instrument(span));
}

/// Serves one connection by its route's protocol, detecting it on `auto` and `http` routes.
async fn serve(
    stream: TcpStream,
    registration: Registration,
    tokens: ConnTokens,
    handle: Arc<RouteHandle>,
    shared: Arc<Shared>,
) {
    let protocol = handle.route.protocol;
    // The protocol's own future is boxed once it is known, so that a connection holds only
    // the state of the protocol it speaks (the task is sized for its largest variant).
    if protocol == Protocol::Tcp {
        return Box::pin(tcp::forward(stream, registration, tokens, &shared)).await;
    }
    // An `http` route waits for the first bytes only as long as for a request's headers.
    let http_only = protocol == Protocol::Http;
    let wait = match http_only {
        true => shared.http.header_read_timeout,
        false => shared.http.detect_timeout,
    };
    let detected = tokio::select! {
        // The grace period ran out while the client was silent.
        _ = tokens.terminate.cancelled() => Detected::Closed,
        // Boxed, so that the connection's task is not sized for the detection's state.
        detected = Box::pin(detect::detect(&stream, http_only, wait, &tokens.draining)) => detected,
    };
    let version = match detected {
        Detected::Http1 => HttpVersion::Http1,
        Detected::Http2 => HttpVersion::Http2,
        // Not HTTP, or a server-speaks-first protocol: opaque TCP.
        Detected::Tcp | Detected::Silent if !http_only => {
            return Box::pin(tcp::forward(stream, registration, tokens, &shared)).await;
        }
        Detected::Tcp | Detected::Silent | Detected::Closed => {
            debug!(?detected, "closing a connection that sent no request");
            return;
        }
    };
    Box::pin(http::serve(
        stream,
        version,
        registration,
        tokens,
        handle,
        shared,
    ))
    .await;
}

/// File descriptors kept for everything that is not a proxy connection: the runtime, the
/// listeners, admin connections, name resolution.
const RESERVED_FDS: u64 = 32;

/// How many proxy connections may be open at once: each holds two file descriptors (client
/// and target). Raises the soft file-descriptor limit to the hard one first, as servers do;
/// beyond the limit new connections wait in the kernel's listen queue instead of failing.
pub fn connection_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read or write the struct passed to them.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return Semaphore::MAX_PERMITS;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    if limit.rlim_cur == libc::RLIM_INFINITY {
        return Semaphore::MAX_PERMITS;
    }
    let pairs = limit.rlim_cur.saturating_sub(RESERVED_FDS) / 2;
    (pairs.max(1) as usize).min(Semaphore::MAX_PERMITS)
}

/// Errors that say the process ran out of something, not that one connection went bad.
pub(crate) fn is_resource_exhaustion(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// What an accept loop does after an error: skip a connection that died in the queue, back
/// off when the process ran out of resources (the error repeats at once until something is
/// freed, so retrying straight away would spin), and log the latter at most once per
/// [`ACCEPT_ERROR_LOG_INTERVAL`].
pub struct AcceptErrors {
    backoff: Duration,
    last_logged: Option<Instant>,
    suppressed: u64,
}

impl Default for AcceptErrors {
    fn default() -> Self {
        AcceptErrors {
            backoff: ACCEPT_BACKOFF_MIN,
            last_logged: None,
            suppressed: 0,
        }
    }
}

impl AcceptErrors {
    /// An accept succeeded: the next exhaustion starts with the shortest pause again.
    pub fn succeeded(&mut self) {
        self.backoff = ACCEPT_BACKOFF_MIN;
    }

    /// Handles one accept error; resolves when accepting may be tried again.
    pub async fn failed(&mut self, error: &io::Error, listen: SocketAddr) {
        if !is_resource_exhaustion(error) {
            // ECONNABORTED and friends: that connection is gone, the next one may be fine.
            debug!(%listen, %error, "accept failed for one connection");
            return;
        }
        let due = self
            .last_logged
            .is_none_or(|last| last.elapsed() >= ACCEPT_ERROR_LOG_INTERVAL);
        if due {
            warn!(%listen, %error, suppressed = self.suppressed, "accept failed: out of resources, backing off");
            self.last_logged = Some(Instant::now());
            self.suppressed = 0;
        } else {
            self.suppressed += 1;
        }
        tokio::time::sleep(self.backoff).await;
        self.backoff = (self.backoff * 2).min(ACCEPT_BACKOFF_MAX);
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    use super::DROP_SYN;

    /// Once the filter is on, a new connection attempt does not complete (its SYN is dropped),
    /// while a connection whose handshake was done already is accepted with its bytes.
    #[test]
    fn the_closing_filter_drops_new_handshakes_and_keeps_queued_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut queued = TcpStream::connect(addr).unwrap();
        socket2::SockRef::from(&listener)
            .attach_filter(&DROP_SYN)
            .unwrap();
        queued.write_all(b"request").unwrap();
        let late = TcpStream::connect_timeout(&addr, Duration::from_millis(300));
        assert!(late.is_err(), "a handshake completed after the filter");
        let (mut accepted, _) = listener.accept().unwrap();
        accepted
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut bytes = [0u8; 7];
        accepted.read_exact(&mut bytes).unwrap();
        assert_eq!(&bytes, b"request");
    }
}
