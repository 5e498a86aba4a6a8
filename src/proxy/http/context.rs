//! The per-connection context of HTTP: what the proxy service of one connection needs, and
//! what its serving loop and its socket wrapper tell each other (requests started, bodies
//! open, whether the connection may park).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use tokio::sync::Notify;

use super::body::BodyWatcher;
use super::client::Upstream;
use crate::conns::{Connection, Registration};
use crate::drain::{ConnTokens, Watch};
use crate::proxy::ProxyContext;

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
    /// Cancelled when the connection must be reset now; tunnels watch it too.
    pub terminate: Watch,
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
            terminate: tokens.terminate.clone(),
            requests_seen: AtomicBool::new(false),
            first_request: Notify::new(),
            requests_started: AtomicU64::new(0),
            bodies_open: AtomicU32::new(0),
            park_off: AtomicBool::new(false),
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

    /// Whether responses must ask the client to go away (HTTP/1 `connection: close`).
    pub fn closing(&self) -> bool {
        self.go_away.is_cancelled()
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
