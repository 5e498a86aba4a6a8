//! Serving one HTTP connection (HTTP/1 or HTTP/2 prior knowledge) and draining it.
//!
//! The drain (docs/lifecycle.md):
//! - lame duck (`go_away`): HTTP/1 responses carry `connection: close` (added by the proxy
//!   service); HTTP/2 connections get GOAWAY (for a connection opened during the lame-duck
//!   period, after its first request, so that it is served once);
//! - listeners closed (`listeners_closed`): an idle HTTP/1 keep-alive connection is closed at once; one
//!   with a request in flight, or with a request's bytes already waiting in the socket, is left
//!   to finish it, and its response carries `connection: close`;
//! - `terminate`: the socket is reset.
//!
//! A connection the proxy closes while the client's bytes still wait unread in the socket
//! (pipelined requests, HTTP/2 frames) gets a lingering close: FIN, then what the client sends
//! is read and discarded until it closes or [`LINGER`](super::io::LINGER) passes, so that the kernel does not
//! answer unread bytes with an RST that would cut the last response short.

use std::future::Future as _;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tracing::{Instrument as _, debug};

use super::client::Upstream;
use super::context::{ConnCtx, HttpVersion};
use super::fast::{self, Lane};
use super::io::{ServerIo, linger};
use super::service;
use crate::conns::{ConnProtocol, ConnState, Registration};
use crate::drain::{Cancelled, ConnTokens, Watch};
use crate::metrics::Timeout;
use crate::net;
use crate::proxy::ProxyContext;
use crate::proxy::quiet::Quiet;

/// After a timeout's GOAWAY, how long an HTTP/2 client has to acknowledge it (h2 closes once
/// its PING is answered) before the connection is reset: a stalled client never does.
const H2_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// Serves `stream` as HTTP until the client or the drain closes it.
pub async fn serve(
    stream: TcpStream,
    version: HttpVersion,
    registration: Registration,
    tokens: ConnTokens,
    upstream: Arc<Upstream>,
    proxy: Arc<ProxyContext>,
) {
    // Each write is a whole response or the part of a body at hand: sent at once, not held
    // back for the acknowledgement of the previous one (Nagle).
    let _ = stream.set_nodelay(true);
    let conn = registration.conn().clone();
    let protocol = match version {
        HttpVersion::Http1 => ConnProtocol::Http1,
        HttpVersion::Http2 => ConnProtocol::Http2,
    };
    conn.set_protocol(protocol);
    conn.set_state(ConnState::Open);
    proxy.metrics.connection_opened(conn.direction(), protocol);

    let ctx = Arc::new(ConnCtx::new(
        registration,
        upstream,
        proxy,
        version,
        &tokens,
    ));
    match version {
        HttpVersion::Http1 => serve_http1(stream, ctx, &tokens.listeners_closed).await,
        HttpVersion::Http2 => {
            let fd = stream.as_raw_fd();
            let (io, came_home) = ServerIo::for_http2(stream, ctx.clone());
            // Boxed: an HTTP/1 connection's future is not sized for HTTP/2's state.
            if Box::pin(serve_http2(
                TokioIo::new(io),
                fd,
                ctx,
                &tokens.listeners_closed,
            ))
            .await
            {
                return;
            }
            if let Ok(stream) = came_home.await {
                Box::pin(linger(stream, &tokens.terminate)).await;
            }
        }
    }
}

/// Serves HTTP/1 until the client or the drain closes the connection.
///
/// A keep-alive connection between requests is *parked*: hyper's connection, with its read and
/// write buffers (8 KiB each, held for as long as it lives), is dropped and only the socket is
/// kept, waiting to become readable; the next request starts a new hyper connection on it. The
/// session parks when hyper asks for bytes that are not there while no request or request body
/// is in progress (a pretend EOF ends hyper's connection cleanly and without a FIN) and has
/// been for [`PARK_AFTER`]; bytes of a next request that hyper had already read are handed to
/// the next session first.
///
/// The first time the connection parks, it moves to a task of its own ([`keep_alive`]) that
/// holds a parked connection's few hundred bytes, and this task, sized for detecting the
/// protocol and serving the first session, ends.
async fn serve_http1(stream: TcpStream, ctx: Arc<ConnCtx>, listeners_closed: &Watch) {
    let sessions = Box::pin(http1_sessions(stream, &ctx, listeners_closed, false));
    if let Some(parked) = sessions.await {
        let side = ctx.proxy.drain.side(ctx.conn().direction());
        let parked = keep_alive(parked, ctx.clone(), listeners_closed.clone());
        side.spawn(parked.instrument(tracing::Span::current()));
    }
}

/// An HTTP/1 connection after it first parked: waits with only its socket for the next
/// request, serves it in new sessions until they park again, and so on until the connection
/// ends.
// Not an `async fn`: every parked connection holds this future (docs/architecture.md, "One
// note on `async fn`").
#[allow(clippy::manual_async_fn)]
fn keep_alive(
    mut stream: TcpStream,
    ctx: Arc<ConnCtx>,
    listeners_closed: Watch,
) -> impl Future<Output = ()> + Send {
    async move {
        loop {
            let fd = stream.as_raw_fd();
            let idle = tokio::time::sleep(ctx.proxy.http.header_read_timeout);
            let drain = listeners_closed.cancelled();
            tokio::pin!(idle, drain);
            let wake = std::future::poll_fn(|cx| {
                if drain.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Wake::ListenersClosed);
                }
                match stream.poll_read_ready(cx) {
                    Poll::Ready(Ok(())) => return Poll::Ready(Wake::Readable),
                    Poll::Ready(Err(_)) => return Poll::Ready(Wake::Closed),
                    Poll::Pending => {}
                }
                idle.as_mut().poll(cx).map(|()| Wake::Closed)
            });
            let closing = match wake.await {
                // The next request (or the client's FIN) is here.
                Wake::Readable => false,
                // The grace period ran out, or a second signal: `force_close` cancels
                // `listeners_closed` and `terminate` together.
                Wake::ListenersClosed if ctx.terminate.is_cancelled() => return reset_client(fd),
                // The listeners closed: a parked connection is idle, unless a request's
                // bytes have just arrived (then it is served, with `connection: close`).
                Wake::ListenersClosed if net::unread_bytes(fd) == 0 => return,
                Wake::ListenersClosed => true,
                // The client went away, or stayed idle for the header read timeout (hyper's
                // keep-alive timeout, which the parking keeps).
                Wake::Closed => return,
            };
            let sessions = Box::pin(http1_sessions(stream, &ctx, &listeners_closed, closing));
            match sessions.await {
                Some(parked) => stream = parked,
                None => return,
            }
        }
    }
}

/// Why a parked connection woke up.
enum Wake {
    /// The socket is readable: a request, or the client's FIN.
    Readable,
    /// The side's listeners closed (or the drain is terminating).
    ListenersClosed,
    /// The socket failed, or the idle timeout passed.
    Closed,
}

/// Serves requests on `stream` until the connection ends (`None`) or it parks with nothing of
/// a next request read (the socket): in the fast lane while the requests are the lane's, in a
/// hyper session for one that is not, which hands the connection back after it (with the bytes
/// of a next request it had read, if any).
async fn http1_sessions(
    mut stream: TcpStream,
    ctx: &Arc<ConnCtx>,
    listeners_closed: &Watch,
    closing: bool,
) -> Option<TcpStream> {
    let mut unparsed = Bytes::new();
    let lane = ctx.proxy.http.fast_lane;
    loop {
        let (socket, bytes) = match lane {
            true => match fast::serve(stream, unparsed, ctx, listeners_closed, closing).await {
                Lane::Done => return None,
                Lane::Parked(socket) => return Some(socket),
                Lane::Hyper(socket, bytes) => (socket, bytes),
            },
            // The lane turned off (`--http1-fast-lane=false`): hyper serves every request.
            false => (stream, unparsed),
        };
        match http1_session(socket, bytes, ctx, listeners_closed, closing).await {
            Session::Done => return None,
            Session::Parked(socket, rest) if !lane && rest.is_empty() => return Some(socket),
            Session::Parked(socket, rest) => (stream, unparsed) = (socket, rest),
        }
    }
}

/// How one hyper connection on an HTTP/1 client connection ended.
enum Session {
    /// The client connection is finished with (closed, upgraded or reset).
    Done,
    /// Parked: the socket, and the bytes of a next request that hyper had read but not parsed.
    Parked(TcpStream, Bytes),
}

/// Serves requests on `stream` with one hyper connection until it ends, or hands the connection
/// back to the fast lane once it has served a request of its own.
async fn http1_session(
    stream: TcpStream,
    prefix: Bytes,
    ctx: &Arc<ConnCtx>,
    listeners_closed: &Watch,
    mut closing: bool,
) -> Session {
    let fd = stream.as_raw_fd();
    let config = &ctx.proxy.http;
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout)
        .max_buf_size(config.max_header_size);
    // Once the listeners have closed, the session runs to its end (`connection: close`).
    let park_after = (!closing).then(|| ctx.requests_started.load(Ordering::Acquire));
    let (mut io, came_home) = ServerIo::new(stream, ctx.clone(), prefix, park_after);
    io.hand_back();
    let service_ctx = ctx.clone();
    // Not boxed: hyper writes each request's future into a slot it allocated for the session,
    // so a box would only add an allocation per request; a parked connection has no session,
    // so idle connections do not hold it.
    let service =
        hyper::service::service_fn(move |request| service::handle(service_ctx.clone(), request));
    let mut connection = builder
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    let mut drain = pin!(Cancelled::new(listeners_closed));
    let mut terminate = pin!(Cancelled::new(&ctx.terminate));
    let served = loop {
        tokio::select! {
            // In this order, the connection first, with no random start per poll; the two
            // tokens then cost an atomic load each (see `Cancelled`).
            biased;
            // The client closed, the last response went out, the session parked, or the
            // connection failed.
            served = &mut connection => break served,
            // The listeners closed: close this connection if it is idle.
            _ = &mut drain, if !closing => {
                closing = true;
                let idle = ctx.conn().requests_in_flight.load(Ordering::Acquire) == 0
                    && net::unread_bytes(fd) == 0;
                if idle {
                    Pin::new(&mut connection).graceful_shutdown();
                }
            }
            // The grace period ran out, or a second signal.
            _ = &mut terminate => {
                reset_client(fd);
                return Session::Done;
            }
        }
    };
    let Some(parts) = connection.into_parts() else {
        // Upgraded: the tunnel has the socket now.
        return Session::Done;
    };
    let mut io = parts.io.into_inner();
    if io.parked
        && let Some(socket) = io.stream.take()
    {
        // Copied: the bytes share hyper's whole 8 KiB read buffer, even when there are none.
        let unparsed = match parts.read_buf.is_empty() {
            true => Bytes::new(),
            false => Bytes::copy_from_slice(&parts.read_buf),
        };
        return Session::Parked(socket, unparsed);
    }
    if let Err(error) = served {
        debug!(%error, "HTTP/1 connection ended with an error");
    }
    drop(io);
    if let Ok(stream) = came_home.await {
        linger(stream, &ctx.terminate).await;
    }
    Session::Done
}

/// Serves HTTP/2; returns true when the drain terminated the connection.
async fn serve_http2(
    io: TokioIo<ServerIo>,
    fd: RawFd,
    ctx: Arc<ConnCtx>,
    listeners_closed: &Watch,
) -> bool {
    let config = &ctx.proxy.http;
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(config.h2_max_concurrent_streams)
        .max_header_list_size(u32::try_from(config.max_header_size).unwrap_or(u32::MAX));
    let service_ctx = ctx.clone();
    // Boxed: each stream's task then moves a pointer, not the whole future.
    let service = hyper::service::service_fn(move |request| {
        Box::pin(service::handle(service_ctx.clone(), request))
    });
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    let go_away = async {
        ctx.go_away.cancelled().await;
        if !ctx.requests_seen.load(Ordering::Acquire) {
            tokio::select! {
                // Opened during the lame-duck period: serve its first request first.
                _ = ctx.first_request.notified() => {}
                // Unless the listeners close before it makes one.
                _ = listeners_closed.cancelled() => {}
            }
        }
    };
    tokio::pin!(go_away);
    let mut sent_go_away = false;
    // The bounds on a connection in which nothing moves (docs/timeouts.md): the first request
    // must come within the header read timeout of the accept (preface, SETTINGS, a complete
    // header block); later the connection may stay without an open stream for the idle
    // timeout. Either way it is asked to go away, and reset if it has not closed
    // H2_CLOSE_WAIT later.
    let first_request_by =
        tokio::time::Instant::from_std(ctx.conn().opened_at) + config.header_read_timeout;
    let started = || ctx.requests_started.load(Ordering::Acquire);
    let busy = || ctx.conn().requests_in_flight.load(Ordering::Acquire) > 0;
    let mut idle = config
        .h2_idle_timeout
        .map(|limit| Quiet::new(limit, started()));
    let mut closed_by: Option<tokio::time::Instant> = None;
    loop {
        let first_seen = ctx.requests_seen.load(Ordering::Acquire);
        tokio::select! {
            // The client closed, every stream finished after GOAWAY, or the connection failed.
            served = connection.as_mut() => {
                if let Err(error) = served {
                    debug!(%error, "HTTP/2 connection ended with an error");
                }
                return false;
            }
            // The shutdown asks this connection to go away: GOAWAY, then streams finish.
            () = &mut go_away, if !sent_go_away => {
                sent_go_away = true;
                connection.as_mut().graceful_shutdown();
            }
            // No first request in time: a client stalled in the preface, its SETTINGS or its
            // first header block.
            () = tokio::time::sleep_until(first_request_by), if !first_seen && !sent_go_away => {
                if ctx.requests_seen.load(Ordering::Acquire) {
                    // It came after this loop last looked.
                    continue;
                }
                debug!("HTTP/2: no first request within the header read timeout; closing");
                ctx.proxy.metrics.timed_out(Timeout::Http2FirstRequest);
                sent_go_away = true;
                connection.as_mut().graceful_shutdown();
                closed_by = Some(tokio::time::Instant::now() + H2_CLOSE_WAIT);
            }
            // No open stream for the idle timeout.
            () = async { idle.as_mut().expect("guarded").expired(started, busy).await },
                if idle.is_some() && !sent_go_away => {
                debug!("HTTP/2: idle for the idle timeout; GOAWAY");
                ctx.proxy.metrics.timed_out(Timeout::Http2Idle);
                sent_go_away = true;
                connection.as_mut().graceful_shutdown();
                closed_by = Some(tokio::time::Instant::now() + H2_CLOSE_WAIT);
            }
            // Asked to go away for a timeout, and still not closed: stalled, unless a stream
            // that came in with the GOAWAY is being served (it finishes, then h2 closes).
            () = async { tokio::time::sleep_until(closed_by.expect("guarded")).await },
                if closed_by.is_some() => {
                if busy() {
                    closed_by = None;
                    continue;
                }
                reset_client(fd);
                return true;
            }
            // The grace period ran out, or a second signal.
            _ = ctx.terminate.cancelled() => {
                reset_client(fd);
                return true;
            }
        }
    }
}

/// Makes the client socket send an RST when hyper drops it.
fn reset_client(fd: RawFd) {
    // SAFETY: the caller still owns the socket (inside the hyper connection it is about to
    // drop), so `fd` is open for the duration of this call.
    net::reset(unsafe { BorrowedFd::borrow_raw(fd) });
}
