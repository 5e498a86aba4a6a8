//! How a response still streaming at its connection's time in the close-spread window ends
//! (src/close_spread.rs), as cleanly as its protocol allows:
//! - a gRPC response (`content-type: application/grpc...`, HTTP/2) ends after its last whole
//!   message with trailers `grpc-status: 14` (UNAVAILABLE), which a gRPC channel retries on
//!   another connection; one whose head has not come yet is answered with those trailers alone;
//! - a stream of server-sent events (`text/event-stream`, no length) ends there, cleanly
//!   (HTTP/2 `END_STREAM`, HTTP/1 the last chunk): an event cut short is never dispatched by
//!   an `EventSource`, which reconnects with its `Last-Event-ID`;
//! - any other response is cut, never ended as if it were whole: HTTP/2 `RST_STREAM(CANCEL)`,
//!   HTTP/1 its connection closed. HTTP/2 would let any body without a length end anywhere,
//!   but a download cut short would then look complete. An HTTP/2 stream whose head has not
//!   come yet is cancelled too.
//!
//! Either way the stream towards the app is dropped, which cancels it there
//! (`RST_STREAM(CANCEL)` from hyper's client on HTTP/2, the connection closed on HTTP/1). An
//! HTTP/2 connection sent GOAWAY at the start of the drain and closes once its last stream has
//! ended; an HTTP/1 response carries `connection: close` then.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::HeaderMap;
use hyper::body::Frame;
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::body::BodyError;

/// The status a gRPC client retries on another connection (UNAVAILABLE).
const GRPC_UNAVAILABLE: &str = "14";
const GRPC_MESSAGE: &str = "lameduck: the pod is shutting down";

/// Whether a request is a gRPC call.
pub(super) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"))
}

/// The trailers that end a gRPC call the proxy ends: `grpc-status: 14` and why.
pub(super) fn grpc_unavailable(headers: &mut HeaderMap) {
    headers.insert("grpc-status", HeaderValue::from_static(GRPC_UNAVAILABLE));
    headers.insert("grpc-message", HeaderValue::from_static(GRPC_MESSAGE));
}

/// The error that makes hyper reset a stream with `CANCEL`, a response body's or a
/// service's: hyper resets with the reason of an h2 error it finds among the causes.
pub(super) fn cancel() -> BodyError {
    Box::new(h2::Error::from(h2::Reason::CANCEL))
}

/// Whether a response is a stream of server-sent events without a length: it may end between
/// two frames.
pub(super) fn is_event_stream(headers: &HeaderMap) -> bool {
    !headers.contains_key(CONTENT_LENGTH)
        && headers
            .get(CONTENT_TYPE)
            .is_some_and(|value| value.as_bytes().starts_with(b"text/event-stream"))
}

/// How a response body ends when its connection's time comes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Kind {
    /// gRPC: after its last whole message, with `grpc-status: 14` trailers.
    Grpc(Messages),
    /// Server-sent events: a clean end between two frames.
    Events,
    /// Anything else: cut (`RST_STREAM(CANCEL)`, or the HTTP/1 connection closed).
    Cut,
}

/// Where a connection's time in the close-spread window is told to its response bodies.
pub(super) trait Signal {
    /// Whether the time has come.
    fn ending(&self) -> bool;
    /// HTTP/2: a token to wait on, since each stream's body is polled by a task of its own.
    /// HTTP/1 has none: its one body is polled by the connection's task, which polls it again
    /// when the time comes.
    fn token(&self) -> Option<&CancellationToken>;
}

/// A response body's watch on its connection's time in the close-spread window.
pub(super) struct Ending<S> {
    signal: S,
    /// Made at the first wait only: a body that never waits never registers.
    wait: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    kind: Kind,
    /// The time came, and the body ends at the next boundary.
    now: bool,
    /// The trailers have gone (gRPC) or the end was given: nothing more.
    done: bool,
}

/// What [`Ending::poll`] tells the body to do.
pub(super) enum Step {
    /// Pass this poll of the body on (its frames followed).
    Pass(Poll<Option<Result<Frame<Bytes>, BodyError>>>),
    /// End now with this: the body towards the app is to be dropped.
    End(Option<Result<Frame<Bytes>, BodyError>>),
}

impl<S: Signal> Ending<S> {
    pub(super) fn new(signal: S, kind: Kind) -> Ending<S> {
        Ending {
            signal,
            wait: None,
            kind,
            now: false,
            done: false,
        }
    }

    /// Polls the body through `inner`, ending it as its kind says once its time has come.
    pub(super) fn poll(
        &mut self,
        cx: &mut Context<'_>,
        inner: impl FnOnce(&mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>>,
    ) -> Step {
        if self.done {
            return Step::End(None);
        }
        if !self.now {
            self.now = self.signal.ending();
        }
        if self.now {
            match &mut self.kind {
                Kind::Grpc(messages) if messages.at_boundary() => return self.grpc_trailers(),
                Kind::Grpc(_) => {}
                Kind::Events => {
                    self.done = true;
                    return Step::End(None);
                }
                Kind::Cut => {
                    self.done = true;
                    return Step::End(Some(Err(cancel())));
                }
            }
        }
        let poll = inner(cx);
        match (poll, &mut self.kind) {
            (Poll::Ready(Some(Ok(frame))), Kind::Grpc(messages)) => {
                let mut data = match frame.into_data() {
                    Ok(data) => data,
                    // Trailers: the app ended the call itself.
                    Err(frame) => return Step::Pass(Poll::Ready(Some(Ok(frame)))),
                };
                let whole = messages.follow(&data, self.now);
                if whole < data.len() {
                    // The time came mid-message: the rest of this frame is not sent.
                    data.truncate(whole);
                }
                Step::Pass(Poll::Ready(Some(Ok(Frame::data(data)))))
            }
            (Poll::Pending, _) if !self.now => {
                if let Some(token) = self.signal.token() {
                    let wait = self
                        .wait
                        .get_or_insert_with(|| Box::pin(token.clone().cancelled_owned()));
                    if wait.as_mut().poll(cx).is_ready() {
                        // Its time came while the body waited: poll again to end it.
                        cx.waker().wake_by_ref();
                    }
                }
                Step::Pass(Poll::Pending)
            }
            (poll, _) => Step::Pass(poll),
        }
    }

    fn grpc_trailers(&mut self) -> Step {
        self.done = true;
        let mut trailers = HeaderMap::new();
        grpc_unavailable(&mut trailers);
        Step::End(Some(Ok(Frame::trailers(trailers))))
    }
}

/// gRPC's length-prefixed messages in a response body (a flag byte and a 4-byte length each),
/// followed so that a call is ended between two messages, never inside one.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Messages {
    prefix_seen: u8,
    length: [u8; 4],
    left: u64,
}

impl Messages {
    pub(super) fn at_boundary(&self) -> bool {
        self.prefix_seen == 0 && self.left == 0
    }

    /// Follows `bytes`; with `to_boundary`, stops at the first message end after at least one
    /// byte. Returns how many bytes were followed.
    pub(super) fn follow(&mut self, bytes: &[u8], to_boundary: bool) -> usize {
        let mut at = 0;
        while at < bytes.len() {
            if self.left > 0 {
                let take = usize::try_from(self.left)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len() - at);
                at += take;
                self.left -= take as u64;
                if self.left == 0 && to_boundary {
                    return at;
                }
                continue;
            }
            if self.prefix_seen > 0 {
                self.length[usize::from(self.prefix_seen - 1)] = bytes[at];
            }
            self.prefix_seen += 1;
            at += 1;
            if self.prefix_seen == 5 {
                self.prefix_seen = 0;
                self.left = u64::from(u32::from_be_bytes(self.length));
                if self.left == 0 && to_boundary {
                    return at;
                }
            }
        }
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn messages_end_where_their_prefixes_say_whatever_the_frames_cut() {
        let mut stream = message(b"first");
        stream.extend(message(b""));
        stream.extend(message(&[9; 1000]));
        let ends = [10, 15, stream.len()];
        for chunk in [1, 2, 6, 64, stream.len()] {
            let mut messages = Messages::default();
            let mut seen = Vec::new();
            for (i, piece) in stream.chunks(chunk).enumerate() {
                let mut at = 0;
                while at < piece.len() {
                    at += messages.follow(&piece[at..], true);
                    if messages.at_boundary() {
                        seen.push(i * chunk + at);
                    }
                }
            }
            seen.dedup();
            assert_eq!(seen, ends, "frames of {chunk} bytes");
        }
    }

    #[test]
    fn grpc_calls_are_told_apart_by_their_content_type() {
        let mut headers = HeaderMap::new();
        assert!(!is_grpc(&headers));
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/grpc+proto"),
        );
        assert!(is_grpc(&headers));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        assert!(!is_grpc(&headers));
    }
}
