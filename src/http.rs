//! Serving one HTTP connection (HTTP/1 or HTTP/2 prior knowledge) and draining it.
//!
//! The drain, per CONTRACT section 3:
//! - lame duck (`go_away`): HTTP/1 responses carry `connection: close` (added by the proxy
//!   service); HTTP/2 connections get GOAWAY (for a connection opened during the lame-duck
//!   period, after its first request, so that it is served once);
//! - listeners closed (`draining`): an idle HTTP/1 keep-alive connection is closed at once; one
//!   with a request in flight, or with a request's bytes already waiting in the socket, is left
//!   to finish it, and its response carries `connection: close`;
//! - `terminate`: the socket is reset.
//!
//! A connection the proxy closes while the client's bytes still wait unread in the socket
//! (pipelined requests, HTTP/2 frames) gets a lingering close: FIN, then what the client sends
//! is read and discarded until it closes or [`LINGER`] passes, so that the kernel does not
//! answer unread bytes with an RST that would cut the last response short.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::conns::{ConnProtocol, ConnState, Connection, Registration};
use crate::drain::ConnTokens;
use crate::listener::{RouteHandle, Shared};
use crate::proxy;

/// How long a closing connection keeps reading (and discarding) after its FIN.
const LINGER: Duration = Duration::from_secs(2);

/// Which HTTP a connection speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HttpVersion {
    Http1,
    Http2,
}

/// What the proxy service of one connection needs.
pub struct ConnCtx {
    pub registration: Arc<Registration>,
    pub handle: Arc<RouteHandle>,
    pub shared: Arc<Shared>,
    pub version: HttpVersion,
    /// Cancelled when this connection must ask its client to go away.
    pub go_away: CancellationToken,
    /// Cancelled when the connection must be reset now; tunnels watch it too.
    pub terminate: CancellationToken,
    /// Set at the first request; HTTP/2 connections opened during the lame-duck period wait
    /// for it before sending GOAWAY.
    requests_seen: AtomicBool,
    first_request: Notify,
}

impl ConnCtx {
    pub fn conn(&self) -> &Arc<Connection> {
        self.registration.conn()
    }

    pub fn request_started(&self) {
        if !self.requests_seen.swap(true, Ordering::AcqRel) {
            self.first_request.notify_one();
        }
    }

    /// Whether responses must ask the client to go away (HTTP/1 `connection: close`).
    pub fn closing(&self) -> bool {
        self.go_away.is_cancelled()
    }
}

/// Serves `stream` as HTTP until the client or the drain closes it.
pub async fn serve(
    stream: TcpStream,
    version: HttpVersion,
    registration: Registration,
    tokens: ConnTokens,
    handle: Arc<RouteHandle>,
    shared: Arc<Shared>,
) {
    let conn = registration.conn().clone();
    let protocol = match version {
        HttpVersion::Http1 => ConnProtocol::Http1,
        HttpVersion::Http2 => ConnProtocol::Http2,
    };
    conn.set_protocol(protocol);
    conn.set_state(ConnState::Open);
    shared.metrics.connection_opened(conn.direction(), protocol);

    let fd = stream.as_raw_fd();
    let (home, came_home) = oneshot::channel();
    let io = TokioIo::new(ServerIo {
        stream: Some(stream),
        conn: conn.clone(),
        fin_sent: false,
        eof: false,
        home: Some(home),
    });
    let ctx = Arc::new(ConnCtx {
        registration: Arc::new(registration),
        handle,
        shared,
        version,
        go_away: tokens.go_away,
        terminate: tokens.terminate.clone(),
        requests_seen: AtomicBool::new(false),
        first_request: Notify::new(),
    });
    let terminated = match version {
        HttpVersion::Http1 => serve_http1(io, fd, ctx, &tokens.draining).await,
        HttpVersion::Http2 => serve_http2(io, fd, ctx, &tokens.draining).await,
    };
    if terminated {
        return;
    }
    if let Ok(stream) = came_home.await {
        linger(stream, &tokens.terminate).await;
    }
}

/// Serves HTTP/1; returns true when the drain terminated the connection.
async fn serve_http1(
    io: TokioIo<ServerIo>,
    fd: RawFd,
    ctx: Arc<ConnCtx>,
    draining: &CancellationToken,
) -> bool {
    let config = &ctx.shared.http;
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout)
        .max_buf_size(config.max_header_size);
    let service_ctx = ctx.clone();
    // Boxed: hyper keeps the slot for the request future for the connection's whole life, so
    // an idle keep-alive connection holds 16 bytes instead of the whole future (1.7 KiB).
    let service = hyper::service::service_fn(move |request| {
        Box::pin(proxy::handle(service_ctx.clone(), request))
    });
    let connection = builder.serve_connection(io, service).with_upgrades();
    tokio::pin!(connection);
    let mut closing = false;
    loop {
        tokio::select! {
            // The client closed, the last response went out, or the connection failed.
            served = connection.as_mut() => {
                if let Err(error) = served {
                    debug!(%error, "HTTP/1 connection ended with an error");
                }
                return false;
            }
            // The listeners closed: close this connection if it is idle.
            _ = draining.cancelled(), if !closing => {
                closing = true;
                let idle = ctx.conn().requests_in_flight.load(Ordering::Acquire) == 0 && unread_bytes(fd) == 0;
                if idle {
                    connection.as_mut().graceful_shutdown();
                }
            }
            // The grace period ran out, or a second signal.
            _ = ctx.terminate.cancelled() => {
                reset_fd(fd);
                return true;
            }
        }
    }
}

/// Serves HTTP/2; returns true when the drain terminated the connection.
async fn serve_http2(
    io: TokioIo<ServerIo>,
    fd: RawFd,
    ctx: Arc<ConnCtx>,
    draining: &CancellationToken,
) -> bool {
    let config = &ctx.shared.http;
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(config.h2_max_concurrent_streams)
        .max_header_list_size(u32::try_from(config.max_header_size).unwrap_or(u32::MAX));
    let service_ctx = ctx.clone();
    // Boxed: each stream's task then moves a pointer, not the whole future.
    let service = hyper::service::service_fn(move |request| {
        Box::pin(proxy::handle(service_ctx.clone(), request))
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
                _ = draining.cancelled() => {}
            }
        }
    };
    tokio::pin!(go_away);
    let mut sent_go_away = false;
    loop {
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
            // The grace period ran out, or a second signal.
            _ = ctx.terminate.cancelled() => {
                reset_fd(fd);
                return true;
            }
        }
    }
}

/// Reads and discards what the client still sends after the proxy's FIN, until the client
/// closes, [`LINGER`] passes, or the drain terminates.
async fn linger(stream: TcpStream, terminate: &CancellationToken) {
    tokio::select! {
        // The client closed its side too (or failed).
        () = crate::tcp::discard(&stream) => {}
        // The client kept sending (or stayed silent) for too long.
        _ = tokio::time::sleep(LINGER) => {}
        // The grace period ran out, or a second signal.
        _ = terminate.cancelled() => {}
    }
}

/// Bytes waiting in the socket's receive queue.
fn unread_bytes(fd: RawFd) -> usize {
    let mut pending: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int; `fd` belongs to a socket that the caller keeps open.
    let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut pending) };
    if rc == 0 { pending.max(0) as usize } else { 0 }
}

/// Makes the socket send an RST when it is closed.
fn reset_fd(fd: RawFd) {
    // SAFETY: the caller still owns the socket (inside the hyper connection it is about to
    // drop), so `fd` is open for the duration of this call.
    let socket = unsafe { BorrowedFd::borrow_raw(fd) };
    let _ = socket2::SockRef::from(&socket).set_linger(Some(Duration::ZERO));
}

/// The client socket as hyper sees it: counts bytes both ways, and when hyper drops it after
/// the proxy sent its FIN, hands the socket back for a lingering close.
pub struct ServerIo {
    stream: Option<TcpStream>,
    conn: Arc<Connection>,
    fin_sent: bool,
    eof: bool,
    home: Option<oneshot::Sender<TcpStream>>,
}

impl ServerIo {
    /// The socket, taken out for a tunnel after an upgrade.
    pub fn into_stream(mut self) -> Option<TcpStream> {
        self.home = None;
        self.stream.take()
    }

    fn stream(&mut self) -> io::Result<&mut TcpStream> {
        self.stream
            .as_mut()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))
    }
}

impl Drop for ServerIo {
    fn drop(&mut self) {
        // Only bytes still unread in the kernel would turn the close into an RST; with none,
        // the close is a plain FIN and nothing needs to linger.
        let unread = self
            .stream
            .as_ref()
            .map_or(0, |stream| unread_bytes(stream.as_raw_fd()));
        if self.fin_sent
            && !self.eof
            && unread > 0
            && let (Some(stream), Some(home)) = (self.stream.take(), self.home.take())
        {
            let _ = home.send(stream);
        }
    }
}

impl AsyncRead for ServerIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(self.stream()?).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = poll {
            let read = buf.filled().len() - before;
            if read == 0 {
                self.eof = true;
            }
            self.conn
                .bytes_from_peer
                .fetch_add(read as u64, Ordering::Relaxed);
        }
        poll
    }
}

impl AsyncWrite for ServerIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(self.stream()?).poll_write(cx, buf);
        if let Poll::Ready(Ok(written)) = poll {
            self.conn
                .bytes_to_peer
                .fetch_add(written as u64, Ordering::Relaxed);
        }
        poll
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(self.stream()?).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(written)) = poll {
            self.conn
                .bytes_to_peer
                .fetch_add(written as u64, Ordering::Relaxed);
        }
        poll
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.stream()?).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(self.stream()?).poll_shutdown(cx);
        if poll.is_ready() {
            self.fin_sent = true;
        }
        poll
    }
}
