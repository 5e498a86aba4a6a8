//! The registry of open proxy connections: what `GET /connections` lists, what the metrics
//! count, and who is named in the log when the grace period runs out.
//!
//! A connection is registered when it is accepted and removed when its [`Registration`] is
//! dropped, whatever way its task ends. Both cost one short lock and O(1) work; the per-byte
//! cost is one relaxed atomic add on the connection's own counters. Admin connections are not
//! proxy connections and are not registered here.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::OwnedSemaphorePermit;

use crate::config::{Direction, Route};

/// What a connection carries, as far as the proxy knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ConnProtocol {
    /// Waiting for the first bytes to tell which protocol it speaks.
    Detecting = 0,
    Tcp = 1,
    Http1 = 2,
    Http2 = 3,
    /// An upgraded HTTP connection (CONNECT, an upgrade to a protocol other than WebSocket)
    /// forwarded as bytes.
    Tunnel = 4,
    /// An HTTP connection upgraded to WebSocket, forwarded frame by frame.
    WebSocket = 5,
}

impl ConnProtocol {
    pub const ALL: [ConnProtocol; 6] = [
        ConnProtocol::Detecting,
        ConnProtocol::Tcp,
        ConnProtocol::Http1,
        ConnProtocol::Http2,
        ConnProtocol::Tunnel,
        ConnProtocol::WebSocket,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ConnProtocol::Detecting => "detecting",
            ConnProtocol::Tcp => "tcp",
            ConnProtocol::Http1 => "http1",
            ConnProtocol::Http2 => "http2",
            ConnProtocol::Tunnel => "tunnel",
            ConnProtocol::WebSocket => "websocket",
        }
    }

    fn from_u8(value: u8) -> ConnProtocol {
        ConnProtocol::ALL
            .get(value as usize)
            .copied()
            .unwrap_or(ConnProtocol::Tcp)
    }
}

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ConnState {
    /// Accepted; the proxy is connecting to the target.
    Connecting = 0,
    /// Forwarding both ways.
    Open = 1,
    /// The peer finished sending (FIN forwarded to the target); the target may still reply.
    PeerClosed = 2,
    /// The target finished sending (FIN forwarded to the peer); the peer may still send.
    TargetClosed = 3,
}

impl ConnState {
    pub fn as_str(self) -> &'static str {
        match self {
            ConnState::Connecting => "connecting",
            ConnState::Open => "open",
            ConnState::PeerClosed => "peer_closed",
            ConnState::TargetClosed => "target_closed",
        }
    }

    fn from_u8(value: u8) -> ConnState {
        match value {
            0 => ConnState::Connecting,
            2 => ConnState::PeerClosed,
            3 => ConnState::TargetClosed,
            _ => ConnState::Open,
        }
    }
}

/// One open proxy connection. Counters are updated by its task and read by the admin server.
#[derive(Debug)]
pub struct Connection {
    pub id: u64,
    pub route: Arc<Route>,
    pub peer: SocketAddr,
    pub opened_at: Instant,
    /// The address actually connected to, once known.
    target_addr: OnceLock<SocketAddr>,
    protocol: AtomicU8,
    state: AtomicU8,
    pub bytes_from_peer: AtomicU64,
    pub bytes_to_peer: AtomicU64,
    pub requests_in_flight: AtomicU32,
    /// When its last request ended (its response went out whole, or failed), in milliseconds
    /// after `opened_at`; 0 before the first. How long an HTTP/1 connection has been idle.
    last_request_done_ms: AtomicU64,
    /// When the close-spread window ends it, in microseconds after `opened_at`; 0 while it has
    /// no time (src/close_spread.rs).
    spread_at_us: AtomicU64,
}

impl Connection {
    pub fn direction(&self) -> Direction {
        self.route.direction
    }

    /// A request on it ended at `at`.
    pub fn request_done(&self, at: Instant) {
        let ms = at.saturating_duration_since(self.opened_at).as_millis();
        self.last_request_done_ms.store(
            u64::try_from(ms).unwrap_or(u64::MAX).max(1),
            Ordering::Relaxed,
        );
    }

    /// Gives it its time in the close-spread window.
    pub fn set_spread_at(&self, at: Instant) {
        let us = at.saturating_duration_since(self.opened_at).as_micros();
        self.spread_at_us.store(
            u64::try_from(us).unwrap_or(u64::MAX).max(1),
            Ordering::Relaxed,
        );
    }

    /// Its time in the close-spread window, once it has one.
    pub fn spread_at(&self) -> Option<Instant> {
        match self.spread_at_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(self.opened_at + Duration::from_micros(us)),
        }
    }

    /// Since when it has had no request: the end of its last one, or its opening.
    pub fn idle_since(&self) -> Instant {
        let ms = self.last_request_done_ms.load(Ordering::Relaxed);
        self.opened_at + std::time::Duration::from_millis(ms)
    }

    pub fn protocol(&self) -> ConnProtocol {
        ConnProtocol::from_u8(self.protocol.load(Ordering::Relaxed))
    }

    pub fn set_protocol(&self, protocol: ConnProtocol) {
        self.protocol.store(protocol as u8, Ordering::Relaxed);
    }

    pub fn state(&self) -> ConnState {
        ConnState::from_u8(self.state.load(Ordering::Relaxed))
    }

    pub fn set_state(&self, state: ConnState) {
        self.state.store(state as u8, Ordering::Relaxed);
    }

    pub fn set_target_addr(&self, addr: SocketAddr) {
        let _ = self.target_addr.set(addr);
    }

    /// The connected target address, or the route's target while still connecting.
    pub fn target(&self) -> String {
        match self.target_addr.get() {
            Some(addr) => addr.to_string(),
            None => self.route.target.to_string(),
        }
    }

    pub fn age(&self) -> Duration {
        self.opened_at.elapsed()
    }

    /// One line for the log: peer, target, protocol, age and bytes.
    pub fn describe(&self) -> String {
        format!(
            "id={} {} peer={} target={} protocol={} state={} age={}ms bytes_from_peer={} bytes_to_peer={}",
            self.id,
            self.direction(),
            self.peer,
            self.target(),
            self.protocol().as_str(),
            self.state().as_str(),
            self.age().as_millis(),
            self.bytes_from_peer.load(Ordering::Relaxed),
            self.bytes_to_peer.load(Ordering::Relaxed),
        )
    }
}

/// Byte totals of one direction: the sum over closed connections (open ones are added at read time).
#[derive(Debug, Default)]
struct ClosedBytes {
    from_peer: AtomicU64,
    to_peer: AtomicU64,
}

/// Every open proxy connection, by id.
#[derive(Debug, Default)]
pub struct Connections {
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Connection>>>,
    closed_inbound: ClosedBytes,
    closed_outbound: ClosedBytes,
}

/// Keeps a connection in the registry, and its place under the connection limit; dropping it
/// removes the connection and gives the place back.
pub struct Registration {
    registry: Arc<Connections>,
    conn: Arc<Connection>,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Registration {
    pub fn conn(&self) -> &Arc<Connection> {
        &self.conn
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.remove(&self.conn);
    }
}

/// Byte totals of one direction, open and closed connections together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTotals {
    pub from_peer: u64,
    pub to_peer: u64,
}

impl Connections {
    pub fn register(
        self: &Arc<Self>,
        route: Arc<Route>,
        peer: SocketAddr,
        protocol: ConnProtocol,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let conn = Arc::new(Connection {
            id,
            route,
            peer,
            opened_at: Instant::now(),
            target_addr: OnceLock::new(),
            protocol: AtomicU8::new(protocol as u8),
            state: AtomicU8::new(ConnState::Connecting as u8),
            bytes_from_peer: AtomicU64::new(0),
            bytes_to_peer: AtomicU64::new(0),
            requests_in_flight: AtomicU32::new(0),
            last_request_done_ms: AtomicU64::new(0),
            spread_at_us: AtomicU64::new(0),
        });
        self.lock().insert(id, conn.clone());
        Registration {
            registry: self.clone(),
            conn,
            _permit: permit,
        }
    }

    fn remove(&self, conn: &Connection) {
        self.lock().remove(&conn.id);
        let closed = self.closed(conn.direction());
        closed.from_peer.fetch_add(
            conn.bytes_from_peer.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        closed.to_peer.fetch_add(
            conn.bytes_to_peer.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
    }

    fn closed(&self, direction: Direction) -> &ClosedBytes {
        match direction {
            Direction::Inbound => &self.closed_inbound,
            Direction::Outbound => &self.closed_outbound,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Connection>>> {
        // Every critical section is a single insert, remove or clone.
        crate::sync::lock(&self.open)
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// The open connections, oldest first.
    pub fn snapshot(&self) -> Vec<Arc<Connection>> {
        let mut conns: Vec<_> = self.lock().values().cloned().collect();
        conns.sort_by_key(|conn| conn.id);
        conns
    }

    /// Bytes forwarded in one direction since start, open connections included.
    pub fn byte_totals(&self, direction: Direction) -> ByteTotals {
        let closed = self.closed(direction);
        // Read the closed totals under the lock so a connection moving from open to closed is
        // counted exactly once.
        let open = self.lock();
        let mut totals = ByteTotals {
            from_peer: closed.from_peer.load(Ordering::Relaxed),
            to_peer: closed.to_peer.load(Ordering::Relaxed),
        };
        for conn in open.values().filter(|conn| conn.direction() == direction) {
            totals.from_peer += conn.bytes_from_peer.load(Ordering::Relaxed);
            totals.to_peer += conn.bytes_to_peer.load(Ordering::Relaxed);
        }
        totals
    }

    /// The body of `GET /connections`.
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\"connections\": [");
        for (i, conn) in self.snapshot().iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(
                out,
                "\n  {{\"id\": {}, \"direction\": \"{}\", \"protocol\": \"{}\", \"peer\": {}, \"target\": {}, \
                 \"age_ms\": {}, \"bytes_from_peer\": {}, \"bytes_to_peer\": {}, \"requests_in_flight\": {}, \"state\": \"{}\"}}",
                conn.id,
                conn.direction(),
                conn.protocol().as_str(),
                serde_json::Value::String(conn.peer.to_string()),
                serde_json::Value::String(conn.target()),
                conn.age().as_millis(),
                conn.bytes_from_peer.load(Ordering::Relaxed),
                conn.bytes_to_peer.load(Ordering::Relaxed),
                conn.requests_in_flight.load(Ordering::Relaxed),
                conn.state().as_str(),
            );
        }
        out.push_str("\n]}\n");
        out
    }
}
