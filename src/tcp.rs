//! Opaque TCP forwarding: connect to the route's target, copy bytes both ways with half-closes
//! passed on, count them, and reset both sockets when the drain says terminate.
//!
//! A connection that is still open when the grace period runs out is reset (SO_LINGER 0), and
//! so is one whose other side failed: a peer must never mistake a broken stream for a complete
//! one. A clean FIN from one side becomes a FIN to the other, and the reverse direction keeps
//! flowing until it finishes too.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::config::Target;
use crate::conns::{ConnProtocol, ConnState, Connection, Registration};
use crate::drain::ConnTokens;
use crate::listener::{ACCEPT_BACKOFF_MAX, ACCEPT_BACKOFF_MIN, Shared, is_resource_exhaustion};
use crate::metrics::ConnectFailure;

/// Forwards one accepted connection until both sides close, one fails, or the drain terminates it.
pub async fn forward(
    client: TcpStream,
    registration: Registration,
    tokens: ConnTokens,
    shared: &Shared,
) {
    let conn = registration.conn();
    conn.set_protocol(ConnProtocol::Tcp);
    shared
        .metrics
        .connection_opened(conn.direction(), ConnProtocol::Tcp);
    let _ = client.set_nodelay(true);
    let target = tokio::select! {
        // The grace period ran out (or a second signal) while connecting.
        _ = tokens.terminate.cancelled() => {
            reset(&client);
            return;
        }
        connected = connect(&conn.route.target, shared.connect_timeout) => connected,
    };
    let target = match target {
        Ok(target) => target,
        Err((failure, error)) => {
            shared.metrics.connect_failed(conn.direction(), failure);
            warn!(target = %conn.route.target, %error, "connecting to the target failed; resetting the client connection");
            reset(&client);
            return;
        }
    };
    let _ = target.set_nodelay(true);
    if let Ok(addr) = target.peer_addr() {
        conn.set_target_addr(addr);
    }
    conn.set_state(ConnState::Open);
    debug!("forwarding");

    pipe(client, target, conn, &tokens.terminate).await;
}

/// Copies between a client and a target until both finish, one fails (both are reset), or
/// `terminate` is cancelled (both are reset). Used for TCP routes and for HTTP tunnels.
pub async fn pipe(
    client: TcpStream,
    target: TcpStream,
    conn: &Arc<Connection>,
    terminate: &CancellationToken,
) {
    let mut client = Counted {
        stream: client,
        conn: conn.clone(),
        side: Side::Peer,
    };
    let mut target = Counted {
        stream: target,
        conn: conn.clone(),
        side: Side::Target,
    };
    let outcome = tokio::select! {
        // The grace period ran out, or a second signal asked to stop now.
        _ = terminate.cancelled() => Err(io::Error::other("terminated by the shutdown")),
        // Both directions finished, or one of them failed.
        copied = tokio::io::copy_bidirectional(&mut client, &mut target) => copied.map(|_| ()),
    };
    match outcome {
        Ok(()) => debug!(
            bytes_from_peer = conn.bytes_from_peer.load(Ordering::Relaxed),
            bytes_to_peer = conn.bytes_to_peer.load(Ordering::Relaxed),
            "closed"
        ),
        Err(error) => {
            debug!(%error, "resetting both sides");
            reset(&client.stream);
            reset(&target.stream);
        }
    }
}

/// Connects to `target`, resolving a host name now, within `timeout`. When the process is out
/// of file descriptors or memory, connecting is retried with back-off until the timeout: the
/// client keeps its place instead of being reset for the proxy's own shortage.
pub(crate) async fn connect(
    target: &Target,
    timeout: Duration,
) -> Result<TcpStream, (ConnectFailure, io::Error)> {
    let attempt = async {
        let mut backoff = ACCEPT_BACKOFF_MIN;
        loop {
            match connect_once(target).await {
                Err((_, error)) if is_resource_exhaustion(&error) => {
                    debug!(%error, "no resources to connect to the target yet; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                }
                result => return result,
            }
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err((
            ConnectFailure::Timeout,
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no connection within {}",
                    humantime::format_duration(timeout)
                ),
            ),
        )),
    }
}

/// One try at every address `target` resolves to.
async fn connect_once(target: &Target) -> Result<TcpStream, (ConnectFailure, io::Error)> {
    let addrs: Vec<SocketAddr> = match target {
        Target::Addr(addr) => vec![*addr],
        Target::Host { host, port } => tokio::net::lookup_host((host.as_str(), *port))
            .await
            .map_err(|error| (ConnectFailure::Resolve, error))?
            .collect(),
    };
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        format!("{target} resolved to no address"),
    );
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(stream) => return Ok(stream),
            Err(error) => last = error,
        }
    }
    let failure = match last.kind() {
        io::ErrorKind::ConnectionRefused => ConnectFailure::Refused,
        io::ErrorKind::NotFound => ConnectFailure::Resolve,
        _ => ConnectFailure::Other,
    };
    Err((failure, last))
}

/// Closes with RST instead of FIN when the socket is dropped.
pub fn reset(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

#[derive(Clone, Copy)]
enum Side {
    Peer,
    Target,
}

/// A stream that counts the bytes read from it into its connection, and records half-closes.
struct Counted {
    stream: TcpStream,
    conn: Arc<Connection>,
    side: Side,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.stream).poll_read(cx, buf);
        let read = (buf.filled().len() - before) as u64;
        if read > 0 {
            let counter = match self.side {
                Side::Peer => &self.conn.bytes_from_peer,
                Side::Target => &self.conn.bytes_to_peer,
            };
            counter.fetch_add(read, Ordering::Relaxed);
        }
        poll
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_shutdown(cx);
        if poll.is_ready() {
            // Shutting down the write half of one side means the other side sent its FIN.
            self.conn.set_state(match self.side {
                Side::Target => ConnState::PeerClosed,
                Side::Peer => ConnState::TargetClosed,
            });
        }
        poll
    }
}
