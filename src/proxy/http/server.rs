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

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tracing::debug;

use super::client::Upstream;
use super::context::{ConnCtx, HttpVersion};
use super::h1;
use super::io::{ServerIo, linger};
use super::service;
use crate::close_spread;
use crate::conns::{ConnProtocol, ConnState, Registration};
use crate::drain::{ConnTokens, Watch};
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
        HttpVersion::Http1 => h1::serve(stream, ctx, &tokens.listeners_closed).await,
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
    let slot = close_spread::at_slot(&ctx.spread, ctx.conn());
    tokio::pin!(slot);
    let mut ending = false;
    loop {
        let first_seen = ctx.requests_seen.load(Ordering::Acquire);
        tokio::select! {
            // The client closed, every stream finished after GOAWAY, or the connection failed.
            served = connection.as_mut() => {
                if let Err(error) = served {
                    debug!(%error, "HTTP/2 connection ended with an error");
                }
                if ending {
                    debug!("close spread: HTTP/2 connection ended");
                    ctx.proxy.metrics.ended_at_shutdown(ConnProtocol::Http2, true);
                }
                return false;
            }
            // Its time in the close-spread window: every open stream ends as its kind allows
            // (ending.rs); GOAWAY went at the start of the drain, so h2 closes the connection
            // once the last stream has ended.
            () = &mut slot, if !ending => {
                ending = true;
                debug!("close spread: ending the HTTP/2 connection's streams");
                ctx.end_streams();
                if !sent_go_away {
                    sent_go_away = true;
                    connection.as_mut().graceful_shutdown();
                }
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
