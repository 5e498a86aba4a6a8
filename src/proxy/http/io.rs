//! The client socket as hyper sees it ([`ServerIo`]): counts bytes both ways, parks an idle
//! HTTP/1 session, bounds an HTTP/2 header block in progress, and hands the socket back for a
//! lingering close.

use std::future::Future as _;
use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tracing::debug;

use super::context::ConnCtx;
use super::header_block::HeaderBlockWatch;
use crate::drain::Watch;
use crate::metrics::Timeout;
use crate::net::unread_bytes;
use crate::proxy::tcp;

/// How long an HTTP/1 keep-alive connection waits for its next request before it is parked
/// (its hyper connection and buffers dropped; see `server::serve_http1`). A connection whose
/// requests come closer together never parks; one that does pays the set-up of a new hyper
/// connection for its next request, once per wait at most, a cost too small to see against the
/// wait. The shorter the wait, the fewer connections hold their buffers at once when many go
/// idle.
pub(super) const PARK_AFTER: Duration = Duration::from_millis(10);

/// How long a closing connection keeps reading (and discarding) after its FIN.
pub(super) const LINGER: Duration = Duration::from_secs(2);

/// The client socket as hyper sees it: counts bytes both ways, and when hyper drops it after
/// the proxy sent its FIN, hands the socket back for a lingering close. For HTTP/1 it also
/// parks the session (see [`serve_http1`]).
pub struct ServerIo {
    pub(super) stream: Option<TcpStream>,
    ctx: Arc<ConnCtx>,
    fin_sent: bool,
    eof: bool,
    home: Option<oneshot::Sender<TcpStream>>,
    /// Bytes read by an earlier session but not parsed by it: read before the socket.
    prefix: Bytes,
    /// `Some(n)`: this session may park once the connection's request count passes `n`.
    park_after: Option<u64>,
    /// The session parked: its EOF was pretended, and its shutdown must send no FIN.
    pub(super) parked: bool,
    /// Since when hyper has been waiting for a next request that has not come.
    idle_since: Option<Instant>,
    /// Wakes the session when it has been idle for [`PARK_AFTER`].
    park_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// HTTP/2: the bound on a header block in progress.
    header_block: Option<Box<HeaderBlockWatch>>,
    /// HTTP/1: once it may park, the session ends at once instead of after [`PARK_AFTER`]
    /// (the fast lane takes the connection back).
    hand_back: bool,
    /// The client's FIN, held from hyper while its request is served (see
    /// [`ConnCtx::holds_half_close`]).
    half_closed: bool,
    /// hyper has nothing of its own buffered: it flushed, and has not written since.
    hyper_flushed: bool,
    /// Interim response heads being written (see [`Interim`](super::context::Interim)), and how
    /// much of them is out.
    interim: Vec<u8>,
    interim_written: usize,
}

impl ServerIo {
    pub fn new(
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
            hand_back: false,
            half_closed: false,
            hyper_flushed: true,
            interim: Vec::new(),
            interim_written: 0,
        };
        (io, came_home)
    }

    /// An HTTP/2 connection's socket: never parked, its header blocks bounded.
    pub fn for_http2(
        stream: TcpStream,
        ctx: Arc<ConnCtx>,
    ) -> (ServerIo, oneshot::Receiver<TcpStream>) {
        let limit = ctx.proxy.http.header_read_timeout;
        let (mut io, came_home) = ServerIo::new(stream, ctx, Bytes::new(), None);
        io.header_block = Some(Box::new(HeaderBlockWatch::new(limit)));
        (io, came_home)
    }

    /// Ends the session as soon as it may park: the first time hyper asks for bytes beyond
    /// those handed to it, once it has served a request of its own and finished it.
    pub fn hand_back(&mut self) {
        self.hand_back = true;
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

    /// Writes the interim response heads the service has put aside, if any. Only called
    /// while hyper has nothing buffered, so they go out between its responses.
    fn poll_interim(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(heads) = self.ctx.interim.take() {
            self.interim.extend_from_slice(&heads);
        }
        while self.interim_written < self.interim.len() {
            let Some(stream) = self.stream.as_mut() else {
                return Poll::Ready(Err(io::ErrorKind::NotConnected.into()));
            };
            match Pin::new(stream).poll_write(cx, &self.interim[self.interim_written..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(written)) => {
                    self.interim_written += written;
                    self.count_written(written);
                }
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            }
        }
        self.interim.clear();
        self.interim_written = 0;
        Poll::Ready(Ok(()))
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
            self.ctx.proxy.metrics.timed_out(Timeout::Http2HeaderBlock);
            return Poll::Ready(Err(error));
        }
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        if self.hand_back
            && let Some(since) = self.park_after
            && self.ctx.may_park(since)
        {
            self.parked = true;
            return Poll::Ready(Ok(()));
        }
        if self.half_closed {
            // hyper reads on while it waits for the service; the task is woken when the
            // response is ready, and once it is out the EOF is hyper's.
            if self.ctx.holds_half_close() {
                return Poll::Pending;
            }
            self.eof = true;
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(self.stream()?).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let read = buf.filled().len() - before;
                if read == 0 && self.ctx.holds_half_close() {
                    self.half_closed = true;
                    return Poll::Pending;
                }
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
        // The first write after a flush starts a response: interim heads go before it.
        if self.hyper_flushed {
            std::task::ready!(self.poll_interim(cx))?;
            self.hyper_flushed = false;
        }
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
        if self.hyper_flushed {
            std::task::ready!(self.poll_interim(cx))?;
            self.hyper_flushed = false;
        }
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
        // hyper flushes once its buffer is empty: the moment for interim heads that came while
        // it waited for the response.
        self.hyper_flushed = true;
        std::task::ready!(self.poll_interim(cx))?;
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

/// Reads and discards what the client still sends after the proxy's FIN, until the client
/// closes, [`LINGER`] passes, or the drain terminates.
pub(super) async fn linger(stream: TcpStream, terminate: &Watch) {
    tokio::select! {
        // The client closed its side too (or failed).
        () = tcp::discard(&stream) => {}
        // The client kept sending (or stayed silent) for too long.
        _ = tokio::time::sleep(LINGER) => {}
        // The grace period ran out, or a second signal.
        _ = terminate.cancelled() => {}
    }
}
