//! Opaque TCP forwarding: connect to the route's target, copy bytes both ways with half-closes
//! passed on, count them, end the stream when the close-spread window gives it its time, and
//! reset both sockets when the drain says terminate.
//!
//! In the close-spread window a stream is ended with a FIN each way (a WebSocket with a Close
//! frame first); a connection that is still open when the grace period runs out is reset
//! (SO_LINGER 0), and so is one whose other side failed: a peer must never mistake a broken stream for a complete
//! one. A clean FIN from one side becomes a FIN to the other, and the reverse direction keeps
//! flowing until it finishes too.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::net::TcpStream;
use tracing::{debug, warn};

use super::ProxyContext;
use super::handoff::Handoff;
use super::quiet::Quiet;
use super::websocket::{self, Frames};
use crate::close_spread;
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
    let conn = opened(&registration, &client, proxy);
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

    let watches = (&tokens.spread, &tokens.terminate);
    pipe(client, target, conn, watches, proxy, Framing::Bytes).await;
}

/// How many times a handed-off stream dials again when its connection came back to this pod:
/// each dial draws one of the Service's endpoints, this pod at most one draw in two while its
/// node still routes to it (a false failure one stream in a billion).
const HANDOFF_DIALS: u32 = 30;

/// How long a handed-off stream keeps the bytes it sent, for the case its connection turns out
/// to have come back to this pod: such a connection arrives as the dial completes, and the
/// refuser resets it as soon as it runs; a second is that with a wide margin.
const HANDOFF_PROBATION: Duration = Duration::from_secs(1);

/// The most a handed-off stream keeps for a dial again; beyond it the client waits for the
/// probation to end (a client that sends that much before its first answer is rare).
const HANDOFF_KEPT: usize = 64 * 1024;

/// Forwards a late connection to the pod's Service (src/proxy/handoff.rs): as [`forward`],
/// except that a connection the node's Service rules sent back to this pod, or one reset before
/// any byte came back, is dialled again, with what the client had sent on it.
pub async fn hand_off(
    client: TcpStream,
    registration: Registration,
    tokens: ConnTokens,
    target: &Target,
    handoff: &Handoff,
    proxy: &ProxyContext,
) {
    let conn = opened(&registration, &client, proxy);
    let mut kept = Kept::default();
    for _ in 0..HANDOFF_DIALS {
        let connected = tokio::select! {
            // The grace period ran out (or a second signal) while connecting.
            _ = tokens.terminate.cancelled() => break,
            connected = connect(target, proxy.connect_timeout, Some(&handoff.dial_ports)) => connected,
        };
        // Its port is recorded for the second after the dial only (`OwnPorts::dials_only`).
        let (upstream, _) = match connected {
            Ok(connected) => connected,
            // Refused (an endpoint gone), reset in the handshake (the dial came back here and
            // was reset before the connect returned), or its port still held by an earlier
            // connection to the same endpoint: nothing was sent, another draw.
            Err((_, error))
                if matches!(
                    error.kind(),
                    io::ErrorKind::ConnectionRefused
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::AddrNotAvailable
                ) =>
            {
                debug!(%error, "the hand-off's dial failed; dialling again");
                continue;
            }
            Err((failure, error)) => {
                proxy.metrics.connect_failed(conn.direction(), failure);
                warn!(%target, %error, "handing off to the Service failed; resetting the client connection");
                break;
            }
        };
        let port = upstream.local_addr().map_or(0, |local| local.port());
        let verdict = tokio::select! {
            _ = tokens.terminate.cancelled() => break,
            verdict = probation(&client, &upstream, &mut kept) => verdict,
        };
        match verdict {
            Probation::Unread => {
                debug!(
                    port,
                    "the hand-off came back to this pod, or was reset unread; dialling again"
                );
                continue;
            }
            Probation::Failed(error) => {
                debug!(%error, "the hand-off failed in its first second; resetting both sides");
                reset(&upstream);
                break;
            }
            Probation::Clear(first) => {
                let _ = upstream.set_nodelay(true);
                if let Ok(addr) = upstream.peer_addr() {
                    conn.set_target_addr(addr);
                }
                if !first.is_empty() && write_all(&client, &first).await.is_err() {
                    reset(&upstream);
                    break;
                }
                conn.bytes_to_peer
                    .fetch_add(first.len() as u64, Ordering::Relaxed);
                conn.bytes_from_peer
                    .fetch_add(kept.bytes.len() as u64, Ordering::Relaxed);
                conn.set_state(ConnState::Open);
                debug!("handed off");
                let watches = (&tokens.spread, &tokens.terminate);
                return pipe(client, upstream, conn, watches, proxy, Framing::Bytes).await;
            }
        }
    }
    proxy.metrics.handoff_failed(ConnProtocol::Tcp);
    reset(&client);
}

/// What a handed-off stream has sent so far, to send again on the next dial.
#[derive(Default)]
struct Kept {
    bytes: Vec<u8>,
    /// The client sent its FIN.
    finished: bool,
}

/// How a handed-off stream's first second went.
enum Probation {
    /// Its connection came back to this pod, or the other end reset it before sending a byte
    /// (a proxy that took it for a loop or refused it late: unread, as HTTP's retry policy
    /// reads such a reset): dial again.
    Unread,
    /// Not come back: what the target sent first (maybe nothing), for the client.
    Clear(Vec<u8>),
    /// The client or the target failed otherwise.
    Failed(io::Error),
}

/// Sends what `kept` holds (a dial again), then copies the client's bytes to `upstream`,
/// keeping them, until the target sends its first bytes, [`HANDOFF_PROBATION`] passes, or the
/// connection fails: a reset before any byte came back is [`Probation::Unread`] (a connection
/// that came back here is reset so by the refuser).
async fn probation(client: &TcpStream, upstream: &TcpStream, kept: &mut Kept) -> Probation {
    let failed = |error: io::Error| match error.kind() {
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => Probation::Unread,
        _ => Probation::Failed(error),
    };
    if !kept.bytes.is_empty()
        && let Err(error) = write_all(upstream, &kept.bytes).await
    {
        return failed(error);
    }
    if kept.finished {
        let _ = socket2::SockRef::from(upstream).shutdown(std::net::Shutdown::Write);
    }
    let until = tokio::time::sleep(HANDOFF_PROBATION);
    tokio::pin!(until);
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            () = &mut until => return Probation::Clear(Vec::new()),
            readable = upstream.readable() => {
                if let Err(error) = readable {
                    return failed(error);
                }
                match upstream.try_read(&mut buf) {
                    Ok(read) => return Probation::Clear(buf[..read].to_vec()),
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                    Err(error) => return failed(error),
                }
            }
            readable = client.readable(), if !kept.finished && kept.bytes.len() < HANDOFF_KEPT => {
                if let Err(error) = readable {
                    return Probation::Failed(error);
                }
                match client.try_read(&mut buf) {
                    Ok(0) => {
                        kept.finished = true;
                        let _ = socket2::SockRef::from(upstream).shutdown(std::net::Shutdown::Write);
                    }
                    Ok(read) => {
                        kept.bytes.extend_from_slice(&buf[..read]);
                        if let Err(error) = write_all(upstream, &buf[..read]).await {
                            return failed(error);
                        }
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                    Err(error) => return Probation::Failed(error),
                }
            }
        }
    }
}

/// A TCP connection begins: registered and counted as such, its client's bytes sent on at once.
fn opened<'a>(
    registration: &'a Registration,
    client: &TcpStream,
    proxy: &ProxyContext,
) -> &'a Arc<Connection> {
    let conn = registration.conn();
    conn.set_protocol(ConnProtocol::Tcp);
    proxy
        .metrics
        .connection_opened(conn.direction(), ConnProtocol::Tcp);
    let _ = client.set_nodelay(true);
    conn
}

/// What a tunnel carries, as far as ending it goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// Bytes: a TCP stream, a CONNECT tunnel, an upgrade to another protocol.
    Bytes,
    /// WebSocket frames, followed as they go (src/proxy/websocket.rs).
    WebSocket,
}

/// Copies between a client and a target until both finish, one fails (both are reset), a
/// bound of `shared.tcp` is met (both are reset: half-closed by one side with nothing from the
/// other, or idle), the close-spread window gives the connection its time (see [`end`]), or
/// `terminate` is cancelled (both are reset). Used for TCP routes and for HTTP tunnels.
pub async fn pipe(
    client: TcpStream,
    target: TcpStream,
    conn: &Arc<Connection>,
    (spread, terminate): (&Watch, &Watch),
    proxy: &ProxyContext,
    framing: Framing,
) {
    let stop = AtomicBool::new(false);
    let frames = (framing == Framing::WebSocket).then(Frames::default);
    let upstream = copy_one_way(
        &client,
        &target,
        &conn.bytes_from_peer,
        &stop,
        frames,
        || conn.set_state(ConnState::PeerClosed),
    );
    let downstream = copy_one_way(&target, &client, &conn.bytes_to_peer, &stop, frames, || {
        conn.set_state(ConnState::TargetClosed)
    });
    tokio::pin!(upstream, downstream);
    let slot = close_spread::at_slot(spread, conn);
    tokio::pin!(slot);
    let (mut up, mut down): (Option<Copied>, Option<Copied>) = (None, None);
    let from_peer = || conn.bytes_from_peer.load(Ordering::Relaxed);
    let to_peer = || conn.bytes_to_peer.load(Ordering::Relaxed);
    let moved = || from_peer() + to_peer();
    let mut idle = proxy
        .tcp
        .idle_timeout
        .map(|limit| Quiet::new(limit, moved()));
    // Once one direction has finished: the bound on the other, and its counter.
    let mut half_closed: Option<(Quiet, &AtomicU64)> = None;
    let mut ending = false;
    let outcome = loop {
        if let (Some(_), Some(_)) = (&up, &down) {
            break Ok(());
        }
        tokio::select! {
            // The grace period ran out, or a second signal asked to stop now.
            _ = terminate.cancelled() => break Err(io::Error::other("terminated by the shutdown")),
            // Its time in the close-spread window: each direction stops at its next read (a
            // WebSocket's, at its next frame boundary).
            () = &mut slot, if !ending => {
                ending = true;
                stop.store(true, Ordering::Relaxed);
                debug!("close spread: ending the stream");
            }
            // The client finished sending (FIN passed on), stopped, or failed.
            copied = &mut upstream, if up.is_none() => match copied {
                Err(error) => break Err(error),
                Ok(copied) => {
                    if copied.eof && down.is_none() {
                        half_closed = proxy.tcp.half_close_timeout
                            .map(|limit| (Quiet::new(limit, to_peer()), &conn.bytes_to_peer));
                    }
                    up = Some(copied);
                }
            },
            // The target finished sending (FIN passed on), stopped, or failed.
            copied = &mut downstream, if down.is_none() => match copied {
                Err(error) => break Err(error),
                Ok(copied) => {
                    if copied.eof && up.is_none() {
                        half_closed = proxy.tcp.half_close_timeout
                            .map(|limit| (Quiet::new(limit, from_peer()), &conn.bytes_from_peer));
                    }
                    down = Some(copied);
                }
            },
            // Half-closed, and the other side sent nothing for the bound.
            () = async {
                let (quiet, counter) = half_closed.as_mut().expect("guarded");
                quiet.expired(|| counter.load(Ordering::Relaxed), || false).await;
            }, if half_closed.is_some() && !ending => {
                proxy.metrics.timed_out(Timeout::TcpHalfClose);
                break Err(io::Error::new(io::ErrorKind::TimedOut, "half-closed, and nothing from the other side"));
            }
            // No byte either way for the bound.
            () = async {
                idle.as_mut().expect("guarded").expired(moved, || false).await;
            }, if idle.is_some() && !ending => {
                proxy.metrics.timed_out(Timeout::TcpIdle);
                break Err(io::Error::new(io::ErrorKind::TimedOut, "idle"));
            }
        }
    };
    match (outcome, up, down) {
        (Ok(()), Some(up), Some(down)) if ending => {
            let ended = tokio::select! {
                _ = terminate.cancelled() => None,
                ended = end(&client, &target, up, down) => Some(ended),
            };
            let clean = ended == Some(true);
            debug!(clean, "close spread: stream ended");
            if clean {
                proxy.metrics.ended_at_shutdown(conn.protocol(), true);
            } else {
                reset(&client);
                reset(&target);
            }
        }
        (Ok(()), _, _) => debug!(
            bytes_from_peer = conn.bytes_from_peer.load(Ordering::Relaxed),
            bytes_to_peer = conn.bytes_to_peer.load(Ordering::Relaxed),
            "closed"
        ),
        (Err(error), _, _) => {
            debug!(%error, "resetting both sides");
            reset(&client);
            reset(&target);
        }
    }
}

/// Ends a stream both of whose directions have stopped for the close-spread window, each side
/// as its protocol allows: for a WebSocket, a Close frame (1001) to each side that has not had
/// one, then that side's own Close frame awaited; then a FIN to each side, and what it still
/// sends read and dropped until it closes too (a socket closed with bytes unread would send a
/// reset). Returns whether both sides closed cleanly.
async fn end(client: &TcpStream, target: &TcpStream, up: Copied, down: Copied) -> bool {
    // The client's side: what came from it is `up`, what went to it `down`.
    let (to_client, to_target) = ((down.eof, down.frames), (up.eof, up.frames));
    let client_side = end_side(client, to_client, up, websocket::close_frame_to_client);
    let target_side = end_side(target, to_target, down, websocket::close_frame_to_server);
    let (client_ended, target_ended) = tokio::join!(client_side, target_side);
    client_ended.is_ok() && target_ended.is_ok()
}

/// Ends one side of a stream: `to` is how what the proxy sent it stopped (the other side's
/// FIN went to it; the frames that went to it), `from` how what it sent stopped.
async fn end_side(
    socket: &TcpStream,
    (fin_sent, sent): (bool, Option<Frames>),
    from: Copied,
    close_frame: fn() -> Vec<u8>,
) -> io::Result<()> {
    let Copied {
        eof: mut closed,
        frames,
        leftover,
    } = from;
    if !fin_sent {
        if let (Some(sent), Some(mut received)) = (sent, frames) {
            if !sent.closed() {
                write_all(socket, &close_frame()).await?;
            }
            // Its Close frame answers, unless it sent one already or closed.
            received.follow(&leftover, false);
            while !received.closed() && !closed {
                match read_some(socket).await? {
                    None => closed = true,
                    Some(bytes) => {
                        received.follow(&bytes, false);
                    }
                }
            }
        }
        socket2::SockRef::from(socket).shutdown(std::net::Shutdown::Write)?;
    }
    if !closed {
        discard(socket).await;
    }
    Ok(())
}

/// How one direction of a stream stopped, without an error.
#[derive(Debug)]
struct Copied {
    /// The sender closed (its FIN went on).
    eof: bool,
    /// Where the sender's WebSocket frames stand, if it speaks WebSocket.
    frames: Option<Frames>,
    /// Bytes read from the sender past the frame boundary it stopped at, not passed on.
    leftover: Vec<u8>,
}

/// Bytes moved per read: large enough for bulk transfers to need few system calls.
const SCRATCH_SIZE: usize = 64 * 1024;

thread_local! {
    /// One read buffer per runtime thread, borrowed only inside a single poll: an idle
    /// connection holds no buffer at all.
    static SCRATCH: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0u8; SCRATCH_SIZE].into_boxed_slice());
}

/// Copies `from` → `to` until `from` sends its FIN (passed on as a FIN to `to`), `stop` is
/// set (checked before each read; a WebSocket stops at the first frame boundary after it), or
/// either fails. Bytes that `to` cannot take at once are the only ones kept per connection,
/// until they are written.
async fn copy_one_way(
    from: &TcpStream,
    to: &TcpStream,
    counter: &std::sync::atomic::AtomicU64,
    stop: &AtomicBool,
    mut frames: Option<Frames>,
    on_eof: impl Fn(),
) -> io::Result<Copied> {
    let mut backlog: Vec<u8> = Vec::new();
    let mut leftover = Vec::new();
    loop {
        // The task that polls this is woken when `stop` is set: it polls every branch again.
        let stopping = std::future::poll_fn(|cx| {
            let stopping = stop.load(Ordering::Relaxed);
            if stopping && frames.is_none_or(|frames| frames.at_boundary()) {
                return std::task::Poll::Ready(Ok(None));
            }
            from.poll_read_ready(cx).map_ok(|()| Some(stopping))
        })
        .await?;
        let Some(stopping) = stopping else {
            return Ok(Copied {
                eof: false,
                frames,
                leftover,
            });
        };
        let read = SCRATCH.with(|scratch| -> io::Result<Option<(usize, usize)>> {
            let mut scratch = scratch.borrow_mut();
            let n = match from.try_read(&mut scratch) {
                Ok(n) => n,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(error) => return Err(error),
            };
            // Stopping mid-frame: pass on the bytes up to the frame's end, keep the rest.
            let mut pass = n;
            if let Some(frames) = frames.as_mut() {
                pass = frames.follow(&scratch[..n], stopping);
                if stopping {
                    leftover.extend_from_slice(&scratch[pass..n]);
                }
            }
            let mut written = 0;
            while written < pass {
                match to.try_write(&scratch[written..pass]) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(w) => written += w,
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                    Err(error) => return Err(error),
                }
            }
            backlog.extend_from_slice(&scratch[written..pass]);
            Ok(Some((n, pass)))
        })?;
        match read {
            None => continue,
            Some((0, _)) => {
                socket2::SockRef::from(to).shutdown(std::net::Shutdown::Write)?;
                on_eof();
                return Ok(Copied {
                    eof: true,
                    frames,
                    leftover,
                });
            }
            Some((_, pass)) => counter.fetch_add(pass as u64, Ordering::Relaxed),
        };
        // The receiver is slow: finish this chunk before reading more (backpressure).
        write_all(to, &backlog).await?;
        if !backlog.is_empty() {
            backlog = Vec::new();
        }
    }
}

/// Writes all of `bytes`, waiting for the socket as long as it takes.
pub(crate) async fn write_all(stream: &TcpStream, bytes: &[u8]) -> io::Result<()> {
    let mut written = 0;
    while written < bytes.len() {
        stream.writable().await?;
        match stream.try_write(&bytes[written..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(w) => written += w,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// The next bytes `from` sends, or `None` at its FIN.
async fn read_some(from: &TcpStream) -> io::Result<Option<Vec<u8>>> {
    loop {
        from.readable().await?;
        let read = SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            from.try_read(&mut scratch)
                .map(|n| (n > 0).then(|| scratch[..n].to_vec()))
        });
        match read {
            Ok(bytes) => return Ok(bytes),
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error),
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
