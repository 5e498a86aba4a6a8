//! The fast lane: the most common HTTP/1 request forwarded by the proxy's own code, in the
//! client connection's task, on a connection to the target of its own (docs/http.md, "The fast
//! lane").
//!
//! It takes an HTTP/1.1 request with no body (`GET`, `HEAD`, `DELETE`, `OPTIONS`), an
//! origin-form target, exactly one plain `Host`, and no header that asks for anything else
//! (`Content-Length`, `Transfer-Encoding`, `Expect`, `Upgrade`, `TE`, a `Connection` naming
//! more than `close` or `keep-alive`). The decision is made on the request head alone, parsed
//! by the parser hyper uses (httparse) with no more lenience than hyper. Everything else, and a
//! head that does not parse or does not arrive at once, goes to hyper with the bytes read so
//! far: hyper serves it exactly as before (every framing rule, every error status) and hands
//! the connection back. So the lane never has to refuse anything itself.
//!
//! What it does is what the hyper path does for such a request: hop-by-hop headers removed
//! both ways, `connection: close` both ways while draining, the target's response framed again
//! (a length, or chunked for a chunked or close-delimited body), the keep-alive race replayed
//! once, 502/504 answered with the same bodies, `Date` added when the target sent none, the
//! client's EOF while waiting cancelling the request, and the same metrics and bounds.

use std::cell::RefCell;
use std::future::{Future, poll_fn};
use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tracing::debug;

use super::wire::{
    ChunkDecoder, Framing, Parsed, Planned, RequestPlan, ResponsePlan, plan_request, plan_response,
    push_chunk,
};
use crate::close_spread;
use crate::conns::ConnProtocol;
use crate::drain::{Cancelled, Watch};
use crate::metrics::Timeout;
use crate::net;
use crate::proxy::http::client::PlainConn;
use crate::proxy::http::context::ConnCtx;
use crate::proxy::http::io::{self as hyper_io, PARK_AFTER};
use crate::proxy::http::policy::{self, BadResponse, Synthetic, Unanswered};
use crate::proxy::http::service::InFlight;

/// The read buffers' size to start with (hyper's too).
const BUFFER: usize = 8192;

/// Room after the unused bytes `buf[*start..*end]`: they move to the front when they reach the
/// buffer's end, and the buffer grows up to `limit` when they fill it; false when it is full at
/// `limit`.
fn room_after(buf: &mut Vec<u8>, start: &mut usize, end: &mut usize, limit: usize) -> bool {
    if *start == *end {
        (*start, *end) = (0, 0);
    } else if *end == buf.len() && *start > 0 {
        buf.copy_within(*start..*end, 0);
        (*start, *end) = (0, *end - *start);
    }
    if *end == buf.len() {
        if buf.len() >= limit {
            return false;
        }
        let grown = (buf.len() * 2).min(limit);
        buf.resize(grown, 0);
    }
    true
}

/// Whether an outbound request that got no answer goes again: the policy's rule (every request
/// the lane takes is idempotent and bodiless), this request's share, and the budget's say.
fn retry(
    ctx: &ConnCtx,
    request: &RequestPlan,
    unanswered: Unanswered,
    tries: &mut policy::Tries,
) -> bool {
    let Some(retries) = &ctx.upstream.retries else {
        return false;
    };
    let allowed = tries.left(unanswered, false)
        && policy::may_retry(unanswered, request.method, false, true)
        && retries.withdraw(unanswered, &ctx.upstream.name);
    if allowed {
        tries.took(unanswered);
    }
    allowed
}

/// How the lane left the connection.
pub(super) enum Lane {
    /// Finished with: closed, cut or reset.
    Done,
    /// Idle for [`PARK_AFTER`] with nothing read: parks.
    Parked(TcpStream),
    /// A request the lane does not take: hyper serves the connection from these bytes on.
    Hyper(TcpStream, Bytes),
}

/// Serves requests on `client` while they are the lane's, starting with `buffered`.
pub(super) async fn serve(
    client: TcpStream,
    buffered: Bytes,
    ctx: &Arc<ConnCtx>,
    listeners_closed: &Watch,
    mut closing: bool,
) -> Lane {
    let mut lane = FastLane::new(client, &buffered, ctx);
    let mut terminate = std::pin::pin!(Cancelled::new(&ctx.terminate));
    let mut drain = std::pin::pin!(Cancelled::new(listeners_closed));
    let max_head = ctx.proxy.http.max_header_size;
    let mut head_since: Option<Instant> = None;
    loop {
        let pending = &lane.buf.inbuf[lane.start..lane.end];
        let request = match plan_request(pending, ctx.closing(), &mut lane.buf.request_head) {
            Planned::Request(request) => request,
            Planned::Other => return lane.into_hyper(),
            Planned::Partial if lane.pending().len() >= max_head => return lane.into_hyper(),
            Planned::Partial => {
                let idle = lane.pending().is_empty();
                if idle {
                    head_since = None;
                }
                let since = *head_since.get_or_insert_with(Instant::now);
                let drain = (idle && !closing).then_some(&mut drain);
                // Once the listeners have closed, an idle connection is not parked: it waits
                // for a next request until its idle close (then a FIN).
                let deadline = match idle && closing {
                    true => ctx.idle_close_at(),
                    false => since + PARK_AFTER,
                };
                match lane
                    .read_client(&mut terminate, drain, deadline, max_head)
                    .await
                {
                    Waited::Ready(Ok(0)) => return Lane::Done,
                    Waited::Ready(Ok(_)) => continue,
                    Waited::Ready(Err(error)) => {
                        debug!(%error, "HTTP/1 client connection failed");
                        return Lane::Done;
                    }
                    // Nothing came: the connection parks, or a slow head goes to hyper, which
                    // bounds it with the header read timeout.
                    Waited::TimedOut if idle && closing => return Lane::Done,
                    Waited::TimedOut if idle => return Lane::Parked(lane.client),
                    Waited::TimedOut => return lane.into_hyper(),
                    Waited::Terminated => return lane.reset(),
                    // Idle: closed (a FIN) once idle for the grace, or served if a request
                    // comes first.
                    Waited::ListenersClosed => {
                        closing = true;
                        continue;
                    }
                }
            }
        };
        head_since = None;
        lane.start += request.head_len;
        match lane.forward(&request, &mut terminate, &mut drain).await {
            // Closed as the response said, never otherwise: a drain that began after its head
            // went out leaves the connection to the next response (or the idle close), and a
            // client that was told nothing finds its next request answered.
            Outcome::Sent { close: true } => {
                lane.close().await;
                return Lane::Done;
            }
            Outcome::Sent { close: false } => {}
            Outcome::Cut => return Lane::Done,
            Outcome::Terminated => return lane.reset(),
        }
    }
}

/// How one forwarded request ended.
enum Outcome {
    /// The response went out whole; `close`: it said `connection: close`.
    Sent { close: bool },
    /// The response could not be finished (the target or the client failed mid-way), or the
    /// client went away: the connection is dropped.
    Cut,
    /// The drain terminated the connection.
    Terminated,
}

/// How a wait ended.
enum Waited<T> {
    Ready(T),
    TimedOut,
    Terminated,
    ListenersClosed,
}

/// Polls `io` until it is ready, unless the drain terminates first, the listeners close (when
/// watched) or `deadline` passes. The timer is armed only once `io` has to wait.
async fn wait<T>(
    mut io: impl FnMut(&mut Context<'_>) -> Poll<T>,
    terminate: &mut Pin<&mut Cancelled<'_>>,
    mut listeners_closed: Option<&mut Pin<&mut Cancelled<'_>>>,
    timer: &mut Option<Pin<Box<Sleep>>>,
    deadline: Option<Instant>,
) -> Waited<T> {
    let mut armed = false;
    poll_fn(|cx| {
        if terminate.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Waited::Terminated);
        }
        if let Poll::Ready(value) = io(cx) {
            return Poll::Ready(Waited::Ready(value));
        }
        if let Some(drain) = listeners_closed.as_mut()
            && drain.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Waited::ListenersClosed);
        }
        if let Some(deadline) = deadline {
            let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
            if !armed {
                armed = true;
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
            }
            if timer.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Waited::TimedOut);
            }
        }
        Poll::Pending
    })
    .await
}

/// A read into `buf`; tokio's own read, which notices a drained socket without a further call.
fn poll_read_into(
    stream: &mut TcpStream,
    buf: &mut [u8],
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    let mut read = ReadBuf::new(buf);
    match Pin::new(stream).poll_read(cx, &mut read) {
        Poll::Ready(Ok(())) => Poll::Ready(Ok(read.filled().len())),
        Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
        Poll::Pending => Poll::Pending,
    }
}

/// Why a write did not finish.
enum WriteFailed {
    Io(io::Error),
    Terminated,
}

impl From<WriteFailed> for Outcome {
    /// A response the client cannot get whole cuts its connection.
    fn from(failed: WriteFailed) -> Outcome {
        match failed {
            WriteFailed::Io(_) => Outcome::Cut,
            WriteFailed::Terminated => Outcome::Terminated,
        }
    }
}

async fn write_all(
    stream: &mut TcpStream,
    mut bytes: &[u8],
    terminate: &mut Pin<&mut Cancelled<'_>>,
    timer: &mut Option<Pin<Box<Sleep>>>,
) -> Result<(), WriteFailed> {
    while !bytes.is_empty() {
        let written = wait(
            |cx| Pin::new(&mut *stream).poll_write(cx, bytes),
            terminate,
            None,
            timer,
            None,
        )
        .await;
        match written {
            Waited::Ready(Ok(0)) => return Err(WriteFailed::Io(io::ErrorKind::WriteZero.into())),
            Waited::Ready(Ok(n)) => bytes = &bytes[n..],
            Waited::Ready(Err(error)) => return Err(WriteFailed::Io(error)),
            _ => return Err(WriteFailed::Terminated),
        }
    }
    Ok(())
}

/// The lane's state on one client connection: its buffers live while it serves, and go when
/// it parks.
struct FastLane<'a> {
    ctx: &'a Arc<ConnCtx>,
    client: TcpStream,
    buf: Buffers,
    /// `buf.inbuf[start..end]`: the client's bytes not used yet.
    start: usize,
    end: usize,
    /// `buf.upbuf[up_start..up_end]`: the target's bytes not used yet.
    up_start: usize,
    up_end: usize,
    timer: Option<Pin<Box<Sleep>>>,
    /// The client shut its sending side while its request was served: no more requests.
    half_closed: bool,
}

/// A lane's buffers. When the lane ends they go to the next lane on the same thread (a few are
/// kept): no allocation and no zeroing per lane, and the small allocations of a parked
/// connection do not land in freed buffers and split them.
#[derive(Default)]
struct Buffers {
    /// The client's bytes.
    inbuf: Vec<u8>,
    /// The target's bytes (allocated at the first request).
    upbuf: Vec<u8>,
    /// The request's head as the target gets it.
    request_head: Vec<u8>,
    /// What goes to the client next.
    out: Vec<u8>,
}

/// How many sets of buffers a thread keeps for its next lanes.
const SPARE_BUFFERS: usize = 8;

/// A set of buffers kept for a next lane: [`Buffers`]' vectors, without its `Drop`.
struct Spare(Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>);

thread_local! {
    static SPARE: RefCell<Vec<Spare>> = const { RefCell::new(Vec::new()) };
}

impl Buffers {
    fn take() -> Buffers {
        match SPARE.try_with(|spare| spare.borrow_mut().pop()) {
            Ok(Some(Spare(inbuf, upbuf, request_head, out))) => Buffers {
                inbuf,
                upbuf,
                request_head,
                out,
            },
            _ => Buffers {
                inbuf: vec![0; BUFFER],
                upbuf: Vec::new(),
                request_head: Vec::new(),
                out: Vec::new(),
            },
        }
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        // Only a set of the usual sizes is kept (one grown for a large head is not).
        let usual = self.inbuf.len() == BUFFER
            && matches!(self.upbuf.len(), 0 | BUFFER)
            && self.request_head.capacity() <= BUFFER
            && self.out.capacity() <= BUFFER;
        if !usual {
            return;
        }
        self.request_head.clear();
        self.out.clear();
        let set = Spare(
            std::mem::take(&mut self.inbuf),
            std::mem::take(&mut self.upbuf),
            std::mem::take(&mut self.request_head),
            std::mem::take(&mut self.out),
        );
        let _ = SPARE.try_with(|spare| {
            let mut spare = spare.borrow_mut();
            if spare.len() < SPARE_BUFFERS {
                spare.push(set);
            }
        });
    }
}

impl<'a> FastLane<'a> {
    fn new(client: TcpStream, buffered: &[u8], ctx: &'a Arc<ConnCtx>) -> FastLane<'a> {
        let mut buf = Buffers::take();
        if buf.inbuf.len() < buffered.len() {
            buf.inbuf.resize(buffered.len(), 0);
        }
        buf.inbuf[..buffered.len()].copy_from_slice(buffered);
        FastLane {
            ctx,
            client,
            buf,
            start: 0,
            end: buffered.len(),
            up_start: 0,
            up_end: 0,
            timer: None,
            half_closed: false,
        }
    }

    fn pending(&self) -> &[u8] {
        &self.buf.inbuf[self.start..self.end]
    }

    fn into_hyper(self) -> Lane {
        let rest = Bytes::copy_from_slice(self.pending());
        Lane::Hyper(self.client, rest)
    }

    fn reset(self) -> Lane {
        net::reset(&self.client);
        Lane::Done
    }

    fn count_from_client(&self, read: usize) {
        let conn = self.ctx.conn();
        conn.bytes_from_peer
            .fetch_add(read as u64, Ordering::Relaxed);
    }

    /// Room after the client's pending bytes (see [`room_after`]).
    fn make_room(&mut self, limit: usize) -> bool {
        room_after(&mut self.buf.inbuf, &mut self.start, &mut self.end, limit)
    }

    /// Room after the target's unused bytes (see [`room_after`]).
    fn make_target_room(&mut self, limit: usize) -> bool {
        room_after(
            &mut self.buf.upbuf,
            &mut self.up_start,
            &mut self.up_end,
            limit,
        )
    }

    /// Reads more of the client's bytes, until `deadline`.
    async fn read_client(
        &mut self,
        terminate: &mut Pin<&mut Cancelled<'_>>,
        drain: Option<&mut Pin<&mut Cancelled<'_>>>,
        deadline: Instant,
        limit: usize,
    ) -> Waited<io::Result<usize>> {
        self.make_room(limit);
        let (client, buf) = (&mut self.client, &mut self.buf.inbuf[self.end..]);
        let read = wait(
            |cx| poll_read_into(client, buf, cx),
            terminate,
            drain,
            &mut self.timer,
            Some(deadline),
        )
        .await;
        if let Waited::Ready(Ok(n)) = read {
            self.end += n;
            self.count_from_client(n);
        }
        read
    }

    /// Writes `out` to the client.
    async fn flush(&mut self, terminate: &mut Pin<&mut Cancelled<'_>>) -> Result<(), WriteFailed> {
        let written = write_all(&mut self.client, &self.buf.out, terminate, &mut self.timer).await;
        if written.is_ok() {
            self.ctx
                .conn()
                .bytes_to_peer
                .fetch_add(self.buf.out.len() as u64, Ordering::Relaxed);
        }
        self.buf.out.clear();
        written
    }

    /// Sends the FIN after the last response; a client still sending gets a lingering close.
    async fn close(mut self) {
        let _ = self.client.shutdown().await;
        if self.start != self.end || net::unread_bytes(self.client.as_raw_fd()) > 0 {
            hyper_io::linger(self.client, &self.ctx.terminate).await;
        }
    }

    /// Forwards the request whose head for the target is in `request_head`, and its response.
    async fn forward(
        &mut self,
        request: &RequestPlan,
        terminate: &mut Pin<&mut Cancelled<'_>>,
        listeners_closed: &mut Pin<&mut Cancelled<'_>>,
    ) -> Outcome {
        let ctx = self.ctx;
        ctx.request_started();
        let in_flight = InFlight::start(ctx);
        ctx.proxy.metrics.fast_lane_request();
        let pool = &ctx.upstream.http1;
        let target = &ctx.upstream.name;
        // The response timeout counts from here, the connect included (the policy's deadline).
        let deadline = policy::response_deadline(ctx.proxy.http.response_timeout);
        if let Some(retries) = &ctx.upstream.retries {
            retries.deposit();
        }
        let mut replayed = false;
        let mut tries = policy::Tries::default();
        let (mut conn, response) = loop {
            // A replay goes on a new connection: another idle one may be closing as well.
            let (mut conn, reused) = match (!replayed).then(|| pool.checkout_plain()).flatten() {
                Some(conn) => (conn, true),
                None => {
                    // Boxed: dialling is rare, and its future would make this one larger.
                    let mut dial = Box::pin(pool.dial_plain());
                    let dialled = wait(
                        |cx| dial.as_mut().poll(cx),
                        terminate,
                        None,
                        &mut self.timer,
                        deadline,
                    )
                    .await;
                    match dialled {
                        Waited::Ready(Ok(conn)) => (conn, false),
                        Waited::Ready(Err(error))
                            if retry(ctx, request, Unanswered::NotConnected, &mut tries) =>
                        {
                            debug!(%error, "cannot connect; sending the request again");
                            continue;
                        }
                        Waited::Ready(Err(error)) => {
                            debug!(%error, "forwarding failed");
                            let timed_out = error.kind() == io::ErrorKind::TimedOut;
                            let answer = Synthetic::cannot_connect(target, timed_out);
                            return self.answer(&answer, request, &in_flight, terminate).await;
                        }
                        Waited::TimedOut => {
                            let answer = Synthetic::no_response_in_time(target);
                            return self.answer(&answer, request, &in_flight, terminate).await;
                        }
                        _ => return Outcome::Terminated,
                    }
                }
            };
            let sent = write_all(
                &mut conn.stream,
                &self.buf.request_head,
                terminate,
                &mut self.timer,
            )
            .await;
            let head = match sent {
                Ok(()) => {
                    let watches = (&mut *terminate, &mut *listeners_closed);
                    self.read_response_head(&mut conn, request, deadline, watches)
                        .await
                }
                Err(WriteFailed::Terminated) => return Outcome::Terminated,
                Err(WriteFailed::Io(error)) => {
                    debug!(%error, "sending to the target failed");
                    HeadRead::ClosedBeforeResponse
                }
            };
            match head {
                HeadRead::Response(response) => break (conn, response),
                // The keep-alive race: the target closed the pooled connection as the request
                // went out. Replayed once (the policy's rule; every request here is bodiless).
                HeadRead::ClosedBeforeResponse
                    if !replayed && policy::may_replay(request.method, false, reused) =>
                {
                    debug!("the target closed a pooled connection before answering; retrying once");
                    replayed = true;
                }
                HeadRead::ClosedBeforeResponse
                    if retry(ctx, request, Unanswered::MayHaveReached, &mut tries) =>
                {
                    debug!("the target closed before answering; sending the request again");
                }
                HeadRead::ClosedBeforeResponse => {
                    let answer = Synthetic::bad_response(target, BadResponse::Unreadable);
                    return self.answer(&answer, request, &in_flight, terminate).await;
                }
                HeadRead::Bad(bad) => {
                    let answer = Synthetic::bad_response(target, bad);
                    return self.answer(&answer, request, &in_flight, terminate).await;
                }
                HeadRead::TimedOut => {
                    let answer = Synthetic::no_response_in_time(target);
                    return self.answer(&answer, request, &in_flight, terminate).await;
                }
                HeadRead::ClientGone => return Outcome::Cut,
                // Its time in the close-spread window with no response yet: the connection
                // closes (HTTP/1 has no way to cancel a request but closing).
                HeadRead::Ended => {
                    debug!("close spread: no response yet; closing the connection");
                    ctx.proxy
                        .metrics
                        .ended_at_shutdown(ConnProtocol::Http1, true);
                    return Outcome::Cut;
                }
                HeadRead::Terminated => return Outcome::Terminated,
            }
        };
        in_flight.record_code(ctx, response.code);
        match self
            .forward_body(&mut conn, &response, terminate, listeners_closed)
            .await
        {
            Ok(BodyEnd::Spread) => {
                // Server-sent events ended at the connection's time in the close-spread
                // window: the last chunk goes out, then the connection closes.
                debug!("close spread: the event stream ended");
                self.ctx
                    .proxy
                    .metrics
                    .ended_at_shutdown(ConnProtocol::Http1, true);
                match self.flush(terminate).await {
                    Ok(()) => Outcome::Sent { close: true },
                    Err(failed) => failed.into(),
                }
            }
            Ok(BodyEnd::Whole(clean)) => {
                // Back in the pool before the response's last bytes leave: once they have,
                // the client's next request, on this connection or another, finds it there.
                if clean && response.reusable && !ctx.closing() {
                    pool.put_plain(conn);
                } else {
                    drop(conn);
                }
                match self.flush(terminate).await {
                    Ok(()) => Outcome::Sent {
                        close: response.close,
                    },
                    Err(failed) => failed.into(),
                }
            }
            Err(outcome) => outcome,
        }
    }

    /// Answers the client with the proxy's own response.
    async fn answer(
        &mut self,
        answer: &Synthetic,
        request: &RequestPlan,
        in_flight: &InFlight,
        terminate: &mut Pin<&mut Cancelled<'_>>,
    ) -> Outcome {
        let close = request.close || self.ctx.closing();
        in_flight.record_code(self.ctx, answer.status.as_u16());
        answer.write_http1(&mut self.buf.out, close, request.is_head);
        match self.flush(terminate).await {
            Ok(()) => Outcome::Sent {
                close: close || answer.close,
            },
            Err(failed) => failed.into(),
        }
    }

    /// Reads the target's response head, forwarding interim (1xx) ones, and writes the
    /// client's head into `out`. Meanwhile a client's error (a reset) cancels the request; its
    /// EOF is a half-close, which still gets the response (the policy's rule, and hyper's with
    /// `half_close`).
    async fn read_response_head(
        &mut self,
        conn: &mut PlainConn,
        request: &RequestPlan,
        deadline: Option<Instant>,
        (terminate, listeners_closed): (&mut Pin<&mut Cancelled<'_>>, &mut Pin<&mut Cancelled<'_>>),
    ) -> HeadRead {
        let ctx = self.ctx;
        let mut slot = std::pin::pin!(None);
        if self.buf.upbuf.is_empty() {
            self.buf.upbuf = vec![0; BUFFER];
        }
        (self.up_start, self.up_end) = (0, 0);
        let mut read_any = false;
        loop {
            if self.up_end > self.up_start {
                self.buf.out.clear();
                // Asked as late as possible: a drain that began while the target worked closes
                // the connection after this response.
                let close = request.close || self.ctx.closing();
                let bytes = &self.buf.upbuf[self.up_start..self.up_end];
                match plan_response(bytes, request.is_head, close, &mut self.buf.out) {
                    Parsed::Response(response) => {
                        self.up_start += response.head_len;
                        return HeadRead::Response(response);
                    }
                    Parsed::Interim(len) => {
                        self.up_start += len;
                        if !self.buf.out.is_empty() {
                            match self.flush(terminate).await {
                                Ok(()) => {}
                                Err(WriteFailed::Io(_)) => return HeadRead::ClientGone,
                                Err(WriteFailed::Terminated) => return HeadRead::Terminated,
                            }
                        }
                        continue;
                    }
                    Parsed::Partial => {}
                    Parsed::Bad(bad) => return HeadRead::Bad(bad),
                }
            }
            if !self.make_target_room(policy::MAX_RESPONSE_HEAD) {
                return HeadRead::Bad(BadResponse::HeadTooLarge);
            }
            // The client is watched while nothing of a next request is buffered (as hyper
            // does): an error means it gave up on this request.
            let watch_client =
                !self.half_closed && self.start == self.end && self.make_room(BUFFER);
            let (client, inbuf) = (&mut self.client, &mut self.buf.inbuf[self.end..]);
            let (target, upbuf) = (&mut conn.stream, &mut self.buf.upbuf[self.up_end..]);
            let read = wait(
                |cx| {
                    if let Poll::Ready(read) = poll_read_into(target, upbuf, cx) {
                        return Poll::Ready(Some(Ok(read)));
                    }
                    if watch_client && let Poll::Ready(read) = poll_read_into(client, inbuf, cx) {
                        return Poll::Ready(Some(Err(read)));
                    }
                    let at_slot = || close_spread::at_slot(&ctx.spread, ctx.conn());
                    poll_slot(listeners_closed, &mut slot, at_slot, cx).map(|()| None)
                },
                terminate,
                None,
                &mut self.timer,
                deadline,
            )
            .await;
            match read {
                Waited::Ready(None) => return HeadRead::Ended,
                Waited::Ready(Some(Ok(Ok(0)) | Ok(Err(_)))) if !read_any => {
                    return HeadRead::ClosedBeforeResponse;
                }
                Waited::Ready(Some(Ok(Ok(0)) | Ok(Err(_)))) => {
                    return HeadRead::Bad(BadResponse::Unreadable);
                }
                Waited::Ready(Some(Ok(Ok(n)))) => {
                    read_any = true;
                    self.up_end += n;
                }
                Waited::Ready(Some(Err(Ok(0)))) => {
                    debug!("the client half-closed; its response still goes out");
                    self.half_closed = true;
                }
                Waited::Ready(Some(Err(Err(error)))) => {
                    debug!(%error, "the client went away before the response");
                    return HeadRead::ClientGone;
                }
                Waited::Ready(Some(Err(Ok(n)))) => {
                    self.end += n;
                    self.count_from_client(n);
                }
                Waited::TimedOut => return HeadRead::TimedOut,
                Waited::Terminated | Waited::ListenersClosed => return HeadRead::Terminated,
            }
        }
    }

    /// Sends the head in `out` and the body after it, all but what is left in `out` once the
    /// target's side is read to its end (the caller sends that). `Ok(true)`: the response
    /// ended where its framing said, with nothing after it, so the target's connection may
    /// serve again.
    async fn forward_body(
        &mut self,
        conn: &mut PlainConn,
        response: &ResponsePlan,
        terminate: &mut Pin<&mut Cancelled<'_>>,
        listeners_closed: &mut Pin<&mut Cancelled<'_>>,
    ) -> Result<BodyEnd, Outcome> {
        let framing = response.framing;
        let limit = self.ctx.proxy.http.body_timeout;
        let ctx = self.ctx;
        let mut slot = std::pin::pin!(None);
        let mut remaining = match framing {
            Framing::Length(length) => length,
            _ => 0,
        };
        let mut chunks = ChunkDecoder::default();
        loop {
            let available = &self.buf.upbuf[self.up_start..self.up_end];
            let finished = match framing {
                Framing::None => true,
                Framing::Length(_) => {
                    let take = available
                        .len()
                        .min(usize::try_from(remaining).unwrap_or(usize::MAX));
                    self.buf.out.extend_from_slice(&available[..take]);
                    self.up_start += take;
                    remaining -= take as u64;
                    remaining == 0
                }
                Framing::Chunked => match chunks.decode(available, &mut self.buf.out) {
                    Ok((used, done)) => {
                        self.up_start += used;
                        if done {
                            self.buf.out.extend_from_slice(b"0\r\n\r\n");
                        }
                        done
                    }
                    Err(why) => {
                        debug!(why, "the target's chunked body is malformed");
                        let _ = self.flush(terminate).await;
                        return Err(Outcome::Cut);
                    }
                },
                Framing::Close => {
                    if !available.is_empty() {
                        push_chunk(&mut self.buf.out, available);
                        self.up_start = self.up_end;
                    }
                    false
                }
            };
            if finished {
                return Ok(BodyEnd::Whole(self.up_start == self.up_end));
            }
            if !self.buf.out.is_empty()
                && let Err(failed) = self.flush(terminate).await
            {
                return Err(failed.into());
            }
            // More of the body: read from the target, the stall bounded.
            // Everything read so far was used: there is room (the limit is never reached).
            self.make_target_room(usize::MAX);
            let deadline = limit.map(|limit| Instant::now() + limit);
            let (target, upbuf) = (&mut conn.stream, &mut self.buf.upbuf[self.up_end..]);
            let read = wait(
                |cx| {
                    let at_slot = || close_spread::at_slot(&ctx.spread, ctx.conn());
                    if poll_slot(listeners_closed, &mut slot, at_slot, cx).is_ready() {
                        return Poll::Ready(None);
                    }
                    poll_read_into(target, upbuf, cx).map(Some)
                },
                terminate,
                None,
                &mut self.timer,
                deadline,
            )
            .await;
            match read {
                // Its time in the close-spread window: server-sent events end cleanly (every
                // chunk the client got is whole), anything else is cut (ending.rs).
                Waited::Ready(None) if response.events => {
                    self.buf.out.extend_from_slice(b"0\r\n\r\n");
                    return Ok(BodyEnd::Spread);
                }
                Waited::Ready(None) => {
                    debug!("close spread: the response is cut");
                    self.ctx
                        .proxy
                        .metrics
                        .ended_at_shutdown(ConnProtocol::Http1, true);
                    return Err(Outcome::Cut);
                }
                // The end of a close-delimited body: the last chunk, which the caller sends.
                Waited::Ready(Some(Ok(0))) if framing == Framing::Close => {
                    self.buf.out.extend_from_slice(b"0\r\n\r\n");
                    return Ok(BodyEnd::Whole(false));
                }
                Waited::Ready(Some(Ok(0))) | Waited::Ready(Some(Err(_))) => {
                    debug!("the target closed before the end of the response body");
                    return Err(Outcome::Cut);
                }
                Waited::Ready(Some(Ok(n))) => self.up_end += n,
                Waited::TimedOut => {
                    debug!("the response body stalled");
                    self.ctx.proxy.metrics.timed_out(Timeout::ResponseBody);
                    return Err(Outcome::Cut);
                }
                Waited::Terminated | Waited::ListenersClosed => return Err(Outcome::Terminated),
            }
        }
    }
}

/// How a response body ended, without a failure.
enum BodyEnd {
    /// Read whole; `true` when nothing past it was read (its connection may be reused).
    Whole(bool),
    /// Server-sent events ended at the connection's time in the close-spread window.
    Spread,
}

/// Polls the connection's time in the close-spread window (`slot`, made by `make`), watched
/// only once the listeners have closed, since the window opens after them: until then a wait
/// pays one atomic load for it, and no registration with the window's token.
fn poll_slot<F: Future<Output = ()>>(
    listeners_closed: &mut Pin<&mut Cancelled<'_>>,
    slot: &mut Pin<&mut Option<F>>,
    make: impl FnOnce() -> F,
    cx: &mut Context<'_>,
) -> Poll<()> {
    if slot.is_none() {
        if listeners_closed.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        slot.set(Some(make()));
    }
    match slot.as_mut().as_pin_mut() {
        Some(slot) => slot.poll(cx),
        None => Poll::Pending,
    }
}

/// How reading a response head ended.
enum HeadRead {
    Response(ResponsePlan),
    /// The connection ended (or failed) before a byte of a response.
    ClosedBeforeResponse,
    /// Not a response the policy forwards, or the connection ended within the head.
    Bad(BadResponse),
    /// No head within the response timeout.
    TimedOut,
    ClientGone,
    Terminated,
    /// The connection's time in the close-spread window came first.
    Ended,
}
