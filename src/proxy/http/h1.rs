//! HTTP/1 client connections: two engines under one policy (docs/http.md, "Two engines, one
//! policy").
//!
//! [`lane`] forwards the most common request (HTTP/1.1, no body, nothing that asks for more;
//! the predicate is [`wire::plan_request`]) with the proxy's own code, in the connection's task;
//! hyper (with [`service`](super::service)) serves every other request, and every request when
//! the lane is turned off (`--http1-fast-lane=false`). Both follow [`policy`](super::policy):
//! which headers are hop-by-hop, how a response is framed and which is refused, the proxy's own
//! answers, the deadlines and the replay rule. [`wire`] is the lane's byte-level half of it.
//!
//! This module moves a connection between them: the lane serves while the requests are its
//! own and hands the connection to a hyper session for one that is not; the session hands it
//! back once that request is done; an idle connection parks with only its socket.

mod lane;
mod wire;

use std::future::Future as _;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;

use bytes::Bytes;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tracing::{Instrument as _, debug};

use self::lane::Lane;
use super::context::ConnCtx;
use super::io::{ServerIo, linger};
use super::service;
use crate::close_spread;
use crate::conns::ConnProtocol;
use crate::drain::{Cancelled, Watch};
use crate::net;

/// Serves HTTP/1 until the client or the drain closes the connection.
///
/// A keep-alive connection between requests is *parked*: hyper's connection, with its read and
/// write buffers (8 KiB each, held for as long as it lives), is dropped and only the socket is
/// kept, waiting to become readable; the next request starts a new hyper connection on it. The
/// session parks when hyper asks for bytes that are not there while no request or request body
/// is in progress (a pretend EOF ends hyper's connection cleanly and without a FIN) and has
/// been for [`PARK_AFTER`](super::io::PARK_AFTER); bytes of a next request that hyper had already read are handed to
/// the next session first.
///
/// The first time the connection parks, it moves to a task of its own ([`keep_alive`]) that
/// holds a parked connection's few hundred bytes, and this task, sized for detecting the
/// protocol and serving the first session, ends.
pub(super) async fn serve(stream: TcpStream, ctx: Arc<ConnCtx>, listeners_closed: &Watch) {
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
                Wake::ListenersClosed
                    if net::unread_bytes(fd) == 0
                        && ctx.idle_close_at() <= tokio::time::Instant::now() =>
                {
                    return;
                }
                // Idle for less than the grace: it may still get a request, served with
                // `connection: close` (IDLE_CLOSE_GRACE).
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
    // A hand-off marks each request and reads its answer: hyper's path does.
    let lane = ctx.proxy.http.fast_lane && ctx.upstream.handoff_mark.is_none();
    loop {
        let (socket, bytes) = match lane {
            true => match lane::serve(stream, unparsed, ctx, listeners_closed, closing).await {
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
    let mut slot = pin!(close_spread::at_slot(&ctx.spread, ctx.conn()));
    let mut ending = false;
    // Once the listeners have closed: when the connection, if idle then, is closed.
    let mut idle_close: Option<tokio::time::Instant> = closing.then(|| ctx.idle_close_at());
    let idle =
        || ctx.conn().requests_in_flight.load(Ordering::Acquire) == 0 && net::unread_bytes(fd) == 0;
    let served = loop {
        tokio::select! {
            // In this order, the connection first, with no random start per poll; the two
            // tokens then cost an atomic load each (see `Cancelled`).
            biased;
            // The client closed, the last response went out, the session parked, or the
            // connection failed.
            served = &mut connection => break served,
            // The listeners closed: close this connection once it has been idle for the
            // grace (a request that comes first is served with `connection: close`).
            _ = &mut drain, if !closing => {
                closing = true;
                idle_close = Some(ctx.idle_close_at());
            }
            () = async { tokio::time::sleep_until(idle_close.expect("guarded")).await },
                if idle_close.is_some() => {
                idle_close = None;
                if idle() {
                    Pin::new(&mut connection).graceful_shutdown();
                }
            }
            // Its time in the close-spread window: a response still streaming (or awaited)
            // ends as its kind allows (ending.rs) when hyper polls it next, right after this,
            // and no request follows it: an idle connection closes now, a busy one once its
            // response has ended, whatever its head promised.
            () = &mut slot, if !ending => {
                ending = true;
                ctx.end_streams();
                Pin::new(&mut connection).graceful_shutdown();
            }
            // The grace period ran out, or a second signal.
            _ = &mut terminate => {
                reset_client(fd);
                return Session::Done;
            }
        }
    };
    if ending {
        debug!("close spread: HTTP/1 connection ended");
        ctx.proxy
            .metrics
            .ended_at_shutdown(ConnProtocol::Http1, true);
    }
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

/// Makes the client socket send an RST when hyper drops it.
fn reset_client(fd: RawFd) {
    // SAFETY: the caller still owns the socket (inside the hyper connection it is about to
    // drop), so `fd` is open for the duration of this call.
    net::reset(unsafe { BorrowedFd::borrow_raw(fd) });
}
