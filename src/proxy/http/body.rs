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
    Held(HeldBody),
}

/// The most of a request body kept to send it again (an outbound retry after the target reset
/// the connection without reading it); a larger body is not kept, and its request not retried.
pub const HELD_BODY_LIMIT: usize = 64 * 1024;

/// A request body that may go again: its bytes, kept as they go to the target up to
/// [`HELD_BODY_LIMIT`] (the frames' own buffers, shared: no copy), and what is still to come
/// from the client. Shared between the request's tries: a try that fails before the body has
/// all gone out (the target reset the connection between its head and its body) leaves the rest
/// here, and the next try sends the kept bytes, then the rest as it comes.
pub struct Held {
    /// The client's body from where the kept bytes end; none once it has ended.
    rest: Option<Box<Payload>>,
    chunks: Vec<Bytes>,
    len: usize,
    /// The body ended, and every byte of it is in `chunks`.
    whole: bool,
    /// Over the limit, or trailers: not kept.
    given_up: bool,
    /// The try whose body reads on: an earlier try's connection, failed, may still hold its
    /// body, which must not take the next try's bytes.
    try_number: u32,
}

impl Held {
    /// Keeps `body` as it goes: the shared record, and the body of the first try.
    pub fn keep(body: Payload) -> (Arc<Mutex<Held>>, Payload) {
        let held = Arc::new(Mutex::new(Held {
            rest: Some(Box::new(body)),
            chunks: Vec::new(),
            len: 0,
            whole: false,
            given_up: false,
            try_number: 0,
        }));
        let first = Payload::Held(HeldBody {
            held: held.clone(),
            try_number: 0,
            next: 0,
        });
        (held, first)
    }

    /// Whether the body can go again whole: every byte that went out was kept, and the rest is
    /// still to come (or there is none).
    pub fn can_go_again(&self) -> bool {
        !self.given_up && (self.whole || self.rest.is_some())
    }

    /// The body of the next try (when [`Held::can_go_again`]): the kept bytes, then the rest.
    /// The earlier tries' bodies read no further.
    pub fn again(held: &Arc<Mutex<Held>>) -> Payload {
        let mut state = crate::sync::lock(held);
        state.try_number += 1;
        Payload::Held(HeldBody {
            held: held.clone(),
            try_number: state.try_number,
            next: 0,
        })
    }
}

/// One try's view of a [`Held`] body: which kept chunk it sends next.
pub struct HeldBody {
    held: Arc<Mutex<Held>>,
    try_number: u32,
    next: usize,
}

impl HeldBody {
    fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut held = crate::sync::lock(&self.held);
        if held.try_number != self.try_number {
            return Poll::Ready(Some(Err(
                "the request went again on another connection".into()
            )));
        }
        if let Some(chunk) = held.chunks.get(self.next) {
            self.next += 1;
            return Poll::Ready(Some(Ok(Frame::data(chunk.clone()))));
        }
        let held = &mut *held;
        let Some(rest) = held.rest.as_mut() else {
            return Poll::Ready(None);
        };
        let poll = Pin::new(&mut **rest).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &poll {
            match frame.data_ref() {
                Some(data) if !held.given_up && held.len + data.len() <= HELD_BODY_LIMIT => {
                    held.len += data.len();
                    held.chunks.push(data.clone());
                    self.next += 1;
                }
                _ => {
                    held.given_up = true;
                    held.chunks = Vec::new();
                }
            }
        }
        if reached_end(&poll, &**rest) {
            held.whole = true;
            // The client's body ends here: its guard tells its connection now, not when the
            // request's last try is over.
            held.rest = None;
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        let held = crate::sync::lock(&self.held);
        held.try_number != self.try_number
            || (self.next >= held.chunks.len()
                && held.rest.as_ref().is_none_or(|rest| rest.is_end_stream()))
    }

    fn size_hint(&self) -> SizeHint {
        let held = crate::sync::lock(&self.held);
        let kept: usize = held.chunks.iter().skip(self.next).map(Bytes::len).sum();
        let Some(rest) = held.rest.as_ref() else {
            return SizeHint::with_exact(kept as u64);
        };
        let rest = rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + kept as u64);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + kept as u64);
        }
        hint
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
            Payload::Held(body) => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Payload::Stream(body, _) | Payload::Request(body, _, _) => body.is_end_stream(),
            Payload::Bytes(bytes) => bytes.is_none(),
            Payload::Held(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Payload::Stream(body, _) | Payload::Request(body, _, _) => body.size_hint(),
            Payload::Bytes(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Payload::Held(body) => body.size_hint(),
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
