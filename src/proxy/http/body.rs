//! Bodies on their way through: streamed from a peer or the proxy's own, bounded when they
//! stall, and the guard that tells an HTTP/1 connection when its request body has ended.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use prometheus_client::metrics::counter::Counter;

/// A body: one streamed from a peer, or a few bytes of the proxy's own (or none). Request
/// bodies towards the target (a replay has none) and response bodies are both this.
pub enum Payload {
    Stream(Incoming, Stall),
    /// A client's HTTP/1 request body on its way to the target, watched to its end.
    Request(Incoming, RequestBodyGuard, Stall),
    Bytes(Option<Bytes>),
    /// A request body whose bytes are kept as they go out (see [`Held`]).
    Held(Box<Payload>, Arc<Mutex<Held>>),
}

/// The most of a request body kept to send it again (an outbound retry after the target reset
/// the connection without reading it); a larger body is not kept, and its request not retried.
pub const HELD_BODY_LIMIT: usize = 64 * 1024;

/// A request body's bytes, kept as they go to the target up to [`HELD_BODY_LIMIT`]: the
/// frames' own buffers, shared (no copy unless the body is sent again).
#[derive(Default)]
pub struct Held {
    chunks: Vec<Bytes>,
    len: usize,
    /// The body ended, and every byte of it is in `bytes`.
    whole: bool,
    /// Over the limit, or trailers: not kept.
    given_up: bool,
}

impl Held {
    /// The whole body, if it was read to its end and kept.
    pub fn whole(&self) -> Option<Bytes> {
        (self.whole && !self.given_up).then(|| Bytes::from(self.chunks.concat()))
    }
}

/// What a body's poll may fail with: the peer's error, or [`BodyStalled`].
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// A streamed body whose bytes stopped coming for `--http-body-timeout`.
#[derive(Debug)]
pub struct BodyStalled(Duration);

impl std::fmt::Display for BodyStalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "no byte of the body for {}",
            humantime::format_duration(self.0)
        )
    }
}

impl std::error::Error for BodyStalled {}

/// The bound on a streamed body whose bytes stop coming. A body that is ready when polled
/// costs nothing; the timer is made at the first wait and re-armed only after progress.
pub struct Stall {
    /// The limit, and the counter of bodies it failed.
    limit: Option<(Duration, Counter)>,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    moved: bool,
}

impl Stall {
    pub fn new(limit: Option<Duration>, timeouts: &Counter) -> Stall {
        Stall {
            limit: limit.map(|limit| (limit, timeouts.clone())),
            timer: None,
            moved: false,
        }
    }

    /// Passes a ready poll on; turns a wait longer than the limit into [`BodyStalled`].
    pub(super) fn watch(
        &mut self,
        poll: Poll<Option<Result<Frame<Bytes>, BodyError>>>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let Some((limit, timeouts)) = &self.limit else {
            return poll;
        };
        let limit = *limit;
        if poll.is_ready() {
            self.moved = true;
            return poll;
        }
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if std::mem::take(&mut self.moved) {
            timer.as_mut().reset(tokio::time::Instant::now() + limit);
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                timeouts.inc();
                Poll::Ready(Some(Err(Box::new(BodyStalled(limit)))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// What a request body's guard reports to: the connection the body came on.
pub(super) trait BodyWatcher: Send + Sync {
    /// The body was read to its end (`true`) or dropped before it.
    fn body_closed(&self, read_to_end: bool);
}

/// Tells an HTTP/1 connection when a request body has been read to its end (or dropped before
/// it), so that the connection is parked only between requests.
pub struct RequestBodyGuard {
    watcher: Arc<dyn BodyWatcher>,
    ended: bool,
}

impl RequestBodyGuard {
    /// A guard for a body whose opening `watcher` has been told of.
    pub(super) fn new(watcher: Arc<dyn BodyWatcher>) -> RequestBodyGuard {
        RequestBodyGuard {
            watcher,
            ended: false,
        }
    }
}

impl Drop for RequestBodyGuard {
    fn drop(&mut self) {
        self.watcher.body_closed(self.ended);
    }
}

impl Body for Payload {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            Payload::Stream(body, stall) => {
                let poll = Pin::new(body).poll_frame(cx).map_err(Into::into);
                stall.watch(poll, cx)
            }
            Payload::Request(body, watch, stall) => {
                let poll = Pin::new(&mut *body).poll_frame(cx).map_err(Into::into);
                if reached_end(&poll, &*body) {
                    watch.ended = true;
                }
                stall.watch(poll, cx)
            }
            Payload::Bytes(bytes) => Poll::Ready(bytes.take().map(|bytes| Ok(Frame::data(bytes)))),
            Payload::Held(body, held) => {
                let poll = Pin::new(&mut **body).poll_frame(cx);
                let mut held = crate::sync::lock(held);
                if let Poll::Ready(Some(Ok(frame))) = &poll {
                    match frame.data_ref() {
                        Some(data) if held.len + data.len() <= HELD_BODY_LIMIT => {
                            held.len += data.len();
                            held.chunks.push(data.clone());
                        }
                        _ => held.given_up = true,
                    }
                }
                if reached_end(&poll, &**body) {
                    held.whole = true;
                }
                poll
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Payload::Stream(body, _) | Payload::Request(body, _, _) => body.is_end_stream(),
            Payload::Bytes(bytes) => bytes.is_none(),
            Payload::Held(body, _) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Payload::Stream(body, _) | Payload::Request(body, _, _) => body.size_hint(),
            Payload::Bytes(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Payload::Held(body, _) => body.size_hint(),
        }
    }
}

/// Whether `body`, having answered `poll`, has been read to its end: no more frames, or the
/// last one (hyper may never poll a body again once it says it is at its end).
pub(super) fn reached_end<B: Body, E>(
    poll: &Poll<Option<Result<Frame<Bytes>, E>>>,
    body: &B,
) -> bool {
    match poll {
        Poll::Ready(None) => true,
        // Trailers are a body's last frame; hyper's server may not ask for more after them.
        Poll::Ready(Some(Ok(frame))) => frame.is_trailers() || body.is_end_stream(),
        _ => false,
    }
}
