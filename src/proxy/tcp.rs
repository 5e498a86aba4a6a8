//! Opaque TCP forwarding: connect to the route's target, copy bytes both ways with half-closes
//! passed on, count them, and reset both sockets when the drain says terminate.
//!
//! A connection that is still open when the grace period runs out is reset (SO_LINGER 0), and
//! so is one whose other side failed: a peer must never mistake a broken stream for a complete
//! one. A clean FIN from one side becomes a FIN to the other, and the reverse direction keeps
//! flowing until it finishes too.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::net::TcpStream;
use tracing::{debug, warn};

use super::ProxyContext;
use super::quiet::Quiet;
use crate::config::Target;
use crate::conns::{ConnProtocol, ConnState, Connection, Registration};
use crate::drain::{ConnTokens, Watch};
use crate::metrics::Timeout;
use crate::net::{OwnPorts, connect, reset};

/// Forwards one accepted connection until both sides close, one fails, or the drain terminates it.
pub async fn forward(
    client: TcpStream,
    registration: Registration,
    tokens: ConnTokens,
    target: &Target,
    own_ports: Option<&Arc<OwnPorts>>,
    proxy: &ProxyContext,
) {
    let conn = registration.conn();
    conn.set_protocol(ConnProtocol::Tcp);
    proxy
        .metrics
        .connection_opened(conn.direction(), ConnProtocol::Tcp);
    let _ = client.set_nodelay(true);
    let connected = tokio::select! {
        // The grace period ran out (or a second signal) while connecting.
        _ = tokens.terminate.cancelled() => {
            reset(&client);
            return;
        }
        connected = connect(target, proxy.connect_timeout, own_ports) => connected,
    };
    // The port's record lives as long as the stream.
    let (target, _own_port) = match connected {
        Ok(connected) => connected,
        Err((failure, error)) => {
            proxy.metrics.connect_failed(conn.direction(), failure);
            warn!(%target, %error, "connecting to the target failed; resetting the client connection");
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

    pipe(client, target, conn, &tokens.terminate, proxy).await;
}

/// Copies between a client and a target until both finish, one fails (both are reset), a
/// bound of `shared.tcp` is met (both are reset: half-closed by one side with nothing from the
/// other, or idle), or `terminate` is cancelled (both are reset). Used for TCP routes and for
/// HTTP tunnels.
pub async fn pipe(
    client: TcpStream,
    target: TcpStream,
    conn: &Arc<Connection>,
    terminate: &Watch,
    proxy: &ProxyContext,
) {
    let upstream = copy_one_way(&client, &target, &conn.bytes_from_peer, || {
        conn.set_state(ConnState::PeerClosed)
    });
    let downstream = copy_one_way(&target, &client, &conn.bytes_to_peer, || {
        conn.set_state(ConnState::TargetClosed)
    });
    tokio::pin!(upstream, downstream);
    let (mut upstream_done, mut downstream_done) = (false, false);
    let from_peer = || conn.bytes_from_peer.load(Ordering::Relaxed);
    let to_peer = || conn.bytes_to_peer.load(Ordering::Relaxed);
    let moved = || from_peer() + to_peer();
    let mut idle = proxy
        .tcp
        .idle_timeout
        .map(|limit| Quiet::new(limit, moved()));
    // Once one direction has finished: the bound on the other, and its counter.
    let mut half_closed: Option<(Quiet, &AtomicU64)> = None;
    let outcome = loop {
        tokio::select! {
            // The grace period ran out, or a second signal asked to stop now.
            _ = terminate.cancelled() => break Err(io::Error::other("terminated by the shutdown")),
            // The client finished sending (FIN passed on), or failed.
            copied = &mut upstream, if !upstream_done => match copied {
                Err(error) => break Err(error),
                Ok(()) if downstream_done => break Ok(()),
                Ok(()) => {
                    upstream_done = true;
                    half_closed = proxy.tcp.half_close_timeout
                        .map(|limit| (Quiet::new(limit, to_peer()), &conn.bytes_to_peer));
                }
            },
            // The target finished sending (FIN passed on), or failed.
            copied = &mut downstream, if !downstream_done => match copied {
                Err(error) => break Err(error),
                Ok(()) if upstream_done => break Ok(()),
                Ok(()) => {
                    downstream_done = true;
                    half_closed = proxy.tcp.half_close_timeout
                        .map(|limit| (Quiet::new(limit, from_peer()), &conn.bytes_from_peer));
                }
            },
            // Half-closed, and the other side sent nothing for the bound.
            () = async {
                let (quiet, counter) = half_closed.as_mut().expect("guarded");
                quiet.expired(|| counter.load(Ordering::Relaxed), || false).await;
            }, if half_closed.is_some() => {
                proxy.metrics.timed_out(Timeout::TcpHalfClose);
                break Err(io::Error::new(io::ErrorKind::TimedOut, "half-closed, and nothing from the other side"));
            }
            // No byte either way for the bound.
            () = async {
                idle.as_mut().expect("guarded").expired(moved, || false).await;
            }, if idle.is_some() => {
                proxy.metrics.timed_out(Timeout::TcpIdle);
                break Err(io::Error::new(io::ErrorKind::TimedOut, "idle"));
            }
        }
    };
    match outcome {
        Ok(()) => debug!(
            bytes_from_peer = conn.bytes_from_peer.load(Ordering::Relaxed),
            bytes_to_peer = conn.bytes_to_peer.load(Ordering::Relaxed),
            "closed"
        ),
        Err(error) => {
            debug!(%error, "resetting both sides");
            reset(&client);
            reset(&target);
        }
    }
}

/// Bytes moved per read: large enough for bulk transfers to need few system calls.
const SCRATCH_SIZE: usize = 64 * 1024;

thread_local! {
    /// One read buffer per runtime thread, borrowed only inside a single poll: an idle
    /// connection holds no buffer at all.
    static SCRATCH: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0u8; SCRATCH_SIZE].into_boxed_slice());
}

/// Copies `from` → `to` until `from` sends its FIN (passed on as a FIN to `to`) or either
/// fails. Bytes that `to` cannot take at once are the only ones kept per connection, until
/// they are written.
async fn copy_one_way(
    from: &TcpStream,
    to: &TcpStream,
    counter: &std::sync::atomic::AtomicU64,
    on_eof: impl Fn(),
) -> io::Result<()> {
    let mut backlog: Vec<u8> = Vec::new();
    loop {
        from.readable().await?;
        let read = SCRATCH.with(|scratch| -> io::Result<Option<usize>> {
            let mut scratch = scratch.borrow_mut();
            let n = match from.try_read(&mut scratch) {
                Ok(n) => n,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(error) => return Err(error),
            };
            let mut written = 0;
            while written < n {
                match to.try_write(&scratch[written..n]) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(w) => written += w,
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                    Err(error) => return Err(error),
                }
            }
            backlog.extend_from_slice(&scratch[written..n]);
            Ok(Some(n))
        })?;
        match read {
            None => continue,
            Some(0) => {
                socket2::SockRef::from(to).shutdown(std::net::Shutdown::Write)?;
                on_eof();
                return Ok(());
            }
            Some(n) => counter.fetch_add(n as u64, Ordering::Relaxed),
        };
        // The receiver is slow: finish this chunk before reading more (backpressure).
        let mut written = 0;
        while written < backlog.len() {
            to.writable().await?;
            match to.try_write(&backlog[written..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(w) => written += w,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => return Err(error),
            }
        }
        if !backlog.is_empty() {
            backlog = Vec::new();
        }
    }
}

/// Reads and discards what `from` sends until its FIN or an error, holding no buffer of its
/// own while it waits (a lingering close, say).
pub(crate) async fn discard(from: &TcpStream) {
    loop {
        if from.readable().await.is_err() {
            return;
        }
        let read = SCRATCH.with(|scratch| from.try_read(&mut scratch.borrow_mut()));
        match read {
            Ok(0) => return,
            Ok(_) => {}
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}
