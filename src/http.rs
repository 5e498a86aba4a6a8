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

use std::future::Future as _;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug};

use crate::conns::{ConnProtocol, ConnState, Connection, Registration};
use crate::drain::{Cancelled, ConnTokens};
use crate::header_block::HeaderBlockWatch;
use crate::listener::{RouteHandle, Shared};
use crate::metrics::Timeout;
use crate::proxy;
use crate::quiet::Quiet;

/// How long a closing connection keeps reading (and discarding) after its FIN.
const LINGER: Duration = Duration::from_secs(2);
/// After a timeout's GOAWAY, how long an HTTP/2 client has to acknowledge it (h2 closes once
/// its PING is answered) before the connection is reset: a stalled client never does.
const H2_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// How long an HTTP/1 keep-alive connection waits for its next request before it is parked
/// (its hyper connection and buffers dropped; see [`serve_http1`]). A connection whose requests
/// come closer together never parks; one that does pays about 2 µs (some 9,000 instructions)
/// to set up the next request's hyper connection, at most 2 µs per 10 ms: 0.02 % of a CPU. The
/// shorter the wait, the fewer connections hold their buffers at once when many go idle.
const PARK_AFTER: Duration = Duration::from_millis(10);

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
    /// Requests started on this connection (HTTP/1 parking: a session parks only after one).
    requests_started: AtomicU64,
    /// Request bodies that hyper may still be reading from the client.
    bodies_open: AtomicU32,
    /// Set for good once hyper may read on its own between requests (a request body left
    /// unread, an upgrade): such a connection is never parked.
    park_off: AtomicBool,
}

impl ConnCtx {
    pub fn conn(&self) -> &Arc<Connection> {
        self.registration.conn()
    }

    pub fn request_started(&self) {
        self.requests_started.fetch_add(1, Ordering::AcqRel);
        if !self.requests_seen.swap(true, Ordering::AcqRel) {
            self.first_request.notify_one();
        }
    }

    /// A request body starts: the connection may not park until it has been read to its end.
    pub fn body_opened(&self) {
        self.bodies_open.fetch_add(1, Ordering::AcqRel);
    }

    /// A request body is done with: read to its end, or dropped before (then hyper drains or
    /// closes it by itself, reading between requests, and the connection never parks again).
    pub fn body_closed(&self, read_to_end: bool) {
        if !read_to_end {
            self.never_park();
        }
        self.bodies_open.fetch_sub(1, Ordering::AcqRel);
    }

    /// This connection must never be parked (see [`ConnCtx::park_off`]).
    pub fn never_park(&self) {
        self.park_off.store(true, Ordering::Release);
    }

    /// Whether hyper, asking for bytes that are not there, is between requests with nothing
    /// of the last one left to read: then the session may park. `since` is
    /// `requests_started` when the session began: it must have served a request of its own.
    fn may_park(&self, since: u64) -> bool {
        self.requests_started.load(Ordering::Acquire) > since
            && self.conn().requests_in_flight.load(Ordering::Acquire) == 0
            && self.bodies_open.load(Ordering::Acquire) == 0
            && !self.park_off.load(Ordering::Acquire)
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

    let ctx = Arc::new(ConnCtx {
        registration: Arc::new(registration),
        handle,
        shared,
        version,
        go_away: tokens.go_away,
        terminate: tokens.terminate.clone(),
        requests_seen: AtomicBool::new(false),
        first_request: Notify::new(),
        requests_started: AtomicU64::new(0),
        bodies_open: AtomicU32::new(0),
        park_off: AtomicBool::new(false),
    });
    match version {
        HttpVersion::Http1 => serve_http1(stream, ctx, &tokens.draining).await,
        HttpVersion::Http2 => {
            let fd = stream.as_raw_fd();
            let (mut io, came_home) = ServerIo::new(stream, ctx.clone(), Bytes::new(), None);
            io.header_block = Some(Box::new(HeaderBlockWatch::new(
                ctx.shared.http.header_read_timeout,
            )));
            // Boxed: an HTTP/1 connection's future is not sized for HTTP/2's state.
            if Box::pin(serve_http2(TokioIo::new(io), fd, ctx, &tokens.draining)).await {
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
async fn serve_http1(stream: TcpStream, ctx: Arc<ConnCtx>, draining: &CancellationToken) {
    let sessions = Box::pin(http1_sessions(stream, &ctx, draining, false));
    if let Some(parked) = sessions.await {
        let side = ctx.shared.drain.side(ctx.conn().direction());
        let parked = keep_alive(parked, ctx.clone(), draining.clone());
        side.tracker
            .spawn(parked.instrument(tracing::Span::current()));
    }
}

/// An HTTP/1 connection after it first parked: waits with only its socket for the next
/// request, serves it in new sessions until they park again, and so on until the connection
/// ends.
// Not an `async fn`: its future would hold each argument twice (rust-lang/rust#62958), 80 more
// bytes in every parked connection.
#[allow(clippy::manual_async_fn)]
fn keep_alive(
    mut stream: TcpStream,
    ctx: Arc<ConnCtx>,
    draining: CancellationToken,
) -> impl Future<Output = ()> + Send {
    async move {
        loop {
            let fd = stream.as_raw_fd();
            let idle = tokio::time::sleep(ctx.shared.http.header_read_timeout);
            let drain = draining.cancelled();
            tokio::pin!(idle, drain);
            let wake = std::future::poll_fn(|cx| {
                if drain.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Wake::Draining);
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
                // `draining` and `terminate` together.
                Wake::Draining if ctx.terminate.is_cancelled() => return reset_fd(fd),
                // The listeners closed: a parked connection is idle, unless a request's
                // bytes have just arrived (then it is served, with `connection: close`).
                Wake::Draining if unread_bytes(fd) == 0 => return,
                Wake::Draining => true,
                // The client went away, or stayed idle for the header read timeout (hyper's
                // keep-alive timeout, which the parking keeps).
                Wake::Closed => return,
            };
            let sessions = Box::pin(http1_sessions(stream, &ctx, &draining, closing));
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
    Draining,
    /// The socket failed, or the idle timeout passed.
    Closed,
}

/// Serves requests on `stream` in hyper sessions until the connection ends (`None`) or a
/// session parks with nothing of a next request read (the socket). A session that parked
/// having read part of the next request failed on it as "incomplete"; those bytes go first to
/// the next session, which starts at once.
async fn http1_sessions(
    mut stream: TcpStream,
    ctx: &Arc<ConnCtx>,
    draining: &CancellationToken,
    closing: bool,
) -> Option<TcpStream> {
    let mut unparsed = Bytes::new();
    loop {
        match http1_session(stream, unparsed, ctx, draining, closing).await {
            Session::Done => return None,
            Session::Parked(socket, rest) if rest.is_empty() => return Some(socket),
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

/// Serves requests on `stream` with one hyper connection until it ends or parks.
async fn http1_session(
    stream: TcpStream,
    prefix: Bytes,
    ctx: &Arc<ConnCtx>,
    draining: &CancellationToken,
    mut closing: bool,
) -> Session {
    let fd = stream.as_raw_fd();
    let config = &ctx.shared.http;
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout)
        .max_buf_size(config.max_header_size);
    // Once the listeners have closed, the session runs to its end (`connection: close`).
    let park_after = (!closing).then(|| ctx.requests_started.load(Ordering::Acquire));
    let (io, came_home) = ServerIo::new(stream, ctx.clone(), prefix, park_after);
    let service_ctx = ctx.clone();
    // Not boxed: hyper writes each request's future into a slot it allocated for the session
    // (about 1.7 KiB), so a box would only add an allocation per request; a parked connection
    // has no session, so idle connections do not hold it.
    let service =
        hyper::service::service_fn(move |request| proxy::handle(service_ctx.clone(), request));
    let mut connection = builder
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    let mut drain = pin!(Cancelled::new(draining));
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
                    && unread_bytes(fd) == 0;
                if idle {
                    Pin::new(&mut connection).graceful_shutdown();
                }
            }
            // The grace period ran out, or a second signal.
            _ = &mut terminate => {
                reset_fd(fd);
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
                ctx.shared.metrics.timed_out(Timeout::Http2FirstRequest);
                sent_go_away = true;
                connection.as_mut().graceful_shutdown();
                closed_by = Some(tokio::time::Instant::now() + H2_CLOSE_WAIT);
            }
            // No open stream for the idle timeout.
            () = async { idle.as_mut().expect("guarded").expired(started, busy).await },
                if idle.is_some() && !sent_go_away => {
                debug!("HTTP/2: idle for the idle timeout; GOAWAY");
                ctx.shared.metrics.timed_out(Timeout::Http2Idle);
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
                reset_fd(fd);
                return true;
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
/// the proxy sent its FIN, hands the socket back for a lingering close. For HTTP/1 it also
/// parks the session (see [`serve_http1`]).
pub struct ServerIo {
    stream: Option<TcpStream>,
    ctx: Arc<ConnCtx>,
    fin_sent: bool,
    eof: bool,
    home: Option<oneshot::Sender<TcpStream>>,
    /// Bytes read by an earlier session but not parsed by it: read before the socket.
    prefix: Bytes,
    /// `Some(n)`: this session may park once the connection's request count passes `n`.
    park_after: Option<u64>,
    /// The session parked: its EOF was pretended, and its shutdown must send no FIN.
    parked: bool,
    /// Since when hyper has been waiting for a next request that has not come.
    idle_since: Option<Instant>,
    /// Wakes the session when it has been idle for [`PARK_AFTER`].
    park_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// HTTP/2: the bound on a header block in progress.
    header_block: Option<Box<HeaderBlockWatch>>,
}

impl ServerIo {
    fn new(
        stream: TcpStream,
        ctx: Arc<ConnCtx>,
        prefix: Bytes,
        park_after: Option<u64>,
    ) -> (ServerIo, oneshot::Receiver<TcpStream>) {
        let (home, came_home) = oneshot::channel();
        let io = ServerIo {
            stream: Some(stream),
            ctx,
            fin_sent: false,
            eof: false,
            home: Some(home),
            prefix,
            park_after,
            parked: false,
            idle_since: None,
            park_timer: None,
            header_block: None,
        };
        (io, came_home)
    }

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

    fn count_read(&self, read: usize) {
        self.ctx
            .conn()
            .bytes_from_peer
            .fetch_add(read as u64, Ordering::Relaxed);
    }

    fn count_written(&self, written: usize) {
        self.ctx
            .conn()
            .bytes_to_peer
            .fetch_add(written as u64, Ordering::Relaxed);
    }

    /// hyper waits, between requests, for a next one that is not there: once that has lasted
    /// [`PARK_AFTER`], the read ends as an EOF and the session parks.
    fn poll_park(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let now = Instant::now();
        let deadline = *self.idle_since.get_or_insert(now) + PARK_AFTER;
        if now < deadline {
            let timer = self
                .park_timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline.into())));
            if timer.deadline() != deadline.into() {
                timer.as_mut().reset(deadline.into());
            }
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
        self.parked = true;
        Poll::Ready(Ok(()))
    }
}

impl Drop for ServerIo {
    fn drop(&mut self) {
        // Only bytes still unread in the kernel would turn the close into an RST; with none,
        // the close is a plain FIN and nothing needs to linger.
        if self.fin_sent
            && !self.eof
            && let Some(stream) = self
                .stream
                .take_if(|stream| unread_bytes(stream.as_raw_fd()) > 0)
            && let Some(home) = self.home.take()
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
        // Before the first request the first-request bound covers a header block too.
        let this = &mut *self;
        if let Some(watch) = &mut this.header_block
            && this.ctx.requests_seen.load(Ordering::Acquire)
            && let Poll::Ready(error) = watch.poll_expired(cx)
        {
            debug!(%error, "HTTP/2: closing");
            self.ctx.shared.metrics.timed_out(Timeout::Http2HeaderBlock);
            return Poll::Ready(Err(error));
        }
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(self.stream()?).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let read = buf.filled().len() - before;
                if read == 0 {
                    self.eof = true;
                }
                if let Some(watch) = &mut self.header_block {
                    watch.read(&buf.filled()[before..]);
                }
                self.idle_since = None;
                self.count_read(read);
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match self.park_after {
                Some(since) if self.ctx.may_park(since) => self.poll_park(cx),
                _ => Poll::Pending,
            },
            error => error,
        }
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
            self.count_written(written);
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
            self.count_written(written);
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
        if self.parked {
            // The session parked: the connection stays open.
            return Poll::Ready(Ok(()));
        }
        let poll = Pin::new(self.stream()?).poll_shutdown(cx);
        if poll.is_ready() {
            self.fin_sent = true;
        }
        poll
    }
}
