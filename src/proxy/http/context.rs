//! The per-connection context of HTTP: what the proxy service of one connection needs, and
//! what its serving loop and its socket wrapper tell each other (requests started, bodies
//! open, whether the connection may park, interim responses on their way).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::Duration;

use futures_util::task::AtomicWaker;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::body::BodyWatcher;
use super::client::Upstream;
use super::ending::Signal;
use crate::conns::{Connection, Registration};
use crate::drain::{ConnTokens, Watch};
use crate::proxy::ProxyContext;
use crate::sync::lock;

/// How long, once the listeners have closed, an idle HTTP/1 connection is still waited for
/// after its last request: a client that reuses its connection under load sends its next
/// request within it, and closing the connection before that request arrives would answer it
/// with an EOF or a reset instead of a response. Served, that request gets `connection:
/// close`; a connection idle for longer is closed at once.
pub(super) const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Which HTTP a connection speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HttpVersion {
    Http1,
    Http2,
}

/// What the proxy service of one connection needs.
pub struct ConnCtx {
    pub registration: Arc<Registration>,
    /// The pooled clients towards this connection's target.
    pub upstream: Arc<Upstream>,
    pub proxy: Arc<ProxyContext>,
    pub version: HttpVersion,
    /// Cancelled when this connection must ask its client to go away.
    pub go_away: Watch,
    /// Cancelled when the close-spread window opens; tunnels watch it too.
    pub spread: Watch,
    /// Cancelled when the connection must be reset now; tunnels watch it too.
    pub terminate: Watch,
    /// Set at the connection's time in the close-spread window: its responses still streaming
    /// end (src/proxy/http/ending.rs).
    streams_ending: AtomicBool,
    /// HTTP/2: cancelled with it, for the streams' tasks to wake.
    pub(super) ending: Option<CancellationToken>,
    /// Set at the first request; HTTP/2 connections opened during the lame-duck period wait
    /// for it before sending GOAWAY.
    pub(super) requests_seen: AtomicBool,
    pub(super) first_request: Notify,
    /// Requests started on this connection (HTTP/1 parking: a session parks only after one).
    pub(super) requests_started: AtomicU64,
    /// Request bodies that hyper may still be reading from the client.
    bodies_open: AtomicU32,
    /// Set for good once hyper may read on its own between requests (a request body left
    /// unread, an upgrade): such a connection is never parked.
    park_off: AtomicBool,
    /// HTTP/1 interim responses from the target, for hyper's side to write.
    pub(super) interim: Interim,
}

/// Interim (`1xx`) response heads on their way to an HTTP/1 client that hyper serves: hyper's
/// server cannot write one, so the target's (heard by hyper's client, on the target
/// connection's task) are put here, the client connection's task is woken, and its socket
/// ([`ServerIo`](super::io::ServerIo)) writes them between hyper's writes, when hyper has
/// nothing of its own buffered (before the final response's head).
#[derive(Default)]
pub(super) struct Interim {
    pending: Mutex<Vec<u8>>,
    any: AtomicBool,
    /// The client connection's task, registered by the request's service future.
    task: AtomicWaker,
}

impl Interim {
    /// Heads to write, from the target connection's task.
    pub(super) fn push(&self, head: &[u8]) {
        lock(&self.pending).extend_from_slice(head);
        self.any.store(true, Ordering::Release);
        self.task.wake();
    }

    /// The client connection's task is the one to wake.
    pub(super) fn register(&self, waker: &Waker) {
        self.task.register(waker);
    }

    /// What is there to write, if anything: one atomic load when nothing is.
    pub(super) fn take(&self) -> Option<Vec<u8>> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        let mut pending = lock(&self.pending);
        self.any.store(false, Ordering::Release);
        Some(std::mem::take(&mut *pending))
    }
}

impl ConnCtx {
    pub fn new(
        registration: Registration,
        upstream: Arc<Upstream>,
        proxy: Arc<ProxyContext>,
        version: HttpVersion,
        tokens: &ConnTokens,
    ) -> ConnCtx {
        ConnCtx {
            registration: Arc::new(registration),
            upstream,
            proxy,
            version,
            go_away: tokens.go_away.clone(),
            spread: tokens.spread.clone(),
            terminate: tokens.terminate.clone(),
            streams_ending: AtomicBool::new(false),
            ending: (version == HttpVersion::Http2).then(CancellationToken::new),
            requests_seen: AtomicBool::new(false),
            first_request: Notify::new(),
            requests_started: AtomicU64::new(0),
            bodies_open: AtomicU32::new(0),
            park_off: AtomicBool::new(false),
            interim: Interim::default(),
        }
    }

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

    /// This connection must never be parked (see [`ConnCtx::park_off`]).
    pub fn never_park(&self) {
        self.park_off.store(true, Ordering::Release);
    }

    /// Whether hyper, asking for bytes that are not there, is between requests with nothing
    /// of the last one left to read: then the session may park. `since` is
    /// `requests_started` when the session began: it must have served a request of its own.
    pub(super) fn may_park(&self, since: u64) -> bool {
        self.requests_started.load(Ordering::Acquire) > since
            && self.conn().requests_in_flight.load(Ordering::Acquire) == 0
            && self.bodies_open.load(Ordering::Acquire) == 0
            && !self.park_off.load(Ordering::Acquire)
    }

    /// Whether a client's FIN is held from hyper: an HTTP/1 client that shut its sending side
    /// after sending a whole request still gets the response (the policy's rule, and the
    /// lane's; hyper's own `half_close` would stop it from noticing a client's reset too).
    pub(super) fn holds_half_close(&self) -> bool {
        self.version == HttpVersion::Http1
            && self.conn().requests_in_flight.load(Ordering::Acquire) > 0
            && self.bodies_open.load(Ordering::Acquire) == 0
    }

    /// When this connection, idle once the listeners have closed, is closed (see
    /// [`IDLE_CLOSE_GRACE`]).
    pub(super) fn idle_close_at(&self) -> tokio::time::Instant {
        (self.conn().idle_since() + IDLE_CLOSE_GRACE).into()
    }

    /// The connection's time in the close-spread window has come: its responses still
    /// streaming end as their kind allows.
    pub(super) fn end_streams(&self) {
        self.streams_ending.store(true, Ordering::Release);
        if let Some(token) = &self.ending {
            token.cancel();
        }
    }

    /// Whether responses must ask the client to go away (HTTP/1 `connection: close`).
    pub fn closing(&self) -> bool {
        self.go_away.is_cancelled()
    }
}

impl ConnCtx {
    /// Whether the connection's time in the close-spread window has come.
    pub(super) fn streams_ending(&self) -> bool {
        self.streams_ending.load(Ordering::Acquire)
    }
}

impl Signal for Arc<ConnCtx> {
    fn ending(&self) -> bool {
        self.streams_ending()
    }

    fn token(&self) -> Option<&CancellationToken> {
        self.ending.as_ref()
    }
}

impl BodyWatcher for ConnCtx {
    /// A request body is done with: read to its end, or dropped before (then hyper drains or
    /// closes it by itself, reading between requests, and the connection never parks again).
    fn body_closed(&self, read_to_end: bool) {
        if !read_to_end {
            self.never_park();
        }
        self.bodies_open.fetch_sub(1, Ordering::AcqRel);
    }
}
