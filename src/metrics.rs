//! Prometheus metrics (docs/admin.md), served by `GET /metrics` in OpenMetrics text.
//!
//! Counters that change per event live in [`Metrics`]. What can be read off the connection
//! registry and the drain at scrape time (open connections, bytes, the shutdown phase) is
//! computed then by [`StateCollector`], so the data path pays nothing extra for it.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::config::Direction;
use crate::conns::{ConnProtocol, Connections};
use crate::drain::{Drain, Phase};
use crate::net::ConnectFailure;

type Labels = [(&'static str, &'static str); 2];

const DIRECTIONS: [Direction; 2] = [Direction::Inbound, Direction::Outbound];
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
/// Request duration buckets, in seconds: 1 ms to 30 s.
const DURATION_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
type DirectionLabel = [(&'static str, &'static str); 1];
type ProtocolLabel = [(&'static str, &'static str); 1];

/// Which bound closed a connection in which nothing moved.
#[derive(Clone, Copy, Debug)]
pub enum Timeout {
    /// HTTP/2: no first request within the header read timeout after accept.
    Http2FirstRequest,
    /// HTTP/2: no open stream for the idle timeout.
    Http2Idle,
    /// HTTP/2: a header block left unfinished for the header read timeout.
    Http2HeaderBlock,
    /// A request body with no byte moving for the body timeout.
    RequestBody,
    /// A response body with no byte moving for the body timeout.
    ResponseBody,
    /// TCP or tunnel: half-closed by one side, nothing from the other.
    TcpHalfClose,
    /// TCP or tunnel: no byte either way.
    TcpIdle,
}

impl Timeout {
    const ALL: [Timeout; 7] = [
        Timeout::Http2FirstRequest,
        Timeout::Http2Idle,
        Timeout::Http2HeaderBlock,
        Timeout::RequestBody,
        Timeout::ResponseBody,
        Timeout::TcpHalfClose,
        Timeout::TcpIdle,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Timeout::Http2FirstRequest => "http2_first_request",
            Timeout::Http2Idle => "http2_idle",
            Timeout::Http2HeaderBlock => "http2_header_block",
            Timeout::RequestBody => "request_body",
            Timeout::ResponseBody => "response_body",
            Timeout::TcpHalfClose => "tcp_half_close",
            Timeout::TcpIdle => "tcp_idle",
        }
    }
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    connections: Family<Labels, Counter>,
    connect_failures: Family<Labels, Counter>,
    accept_errors: Family<DirectionLabel, Counter>,
    refused: Family<Labels, Counter>,
    late: Family<Labels, Counter>,
    handoff_loops: Counter,
    handoffs: Family<ProtocolLabel, Counter>,
    handoff_failures: Family<ProtocolLabel, Counter>,
    force_closed: Counter,
    connection_limit: Gauge,
    limit_waits: Counter,
    /// By [`Timeout`], resolved once (every streamed body holds its counter), so that every
    /// series is there from the start.
    timeouts: [Counter; Timeout::ALL.len()],
    /// `[direction][status class 1xx..5xx]`, resolved once so a request only adds to a counter.
    requests: [[Counter; 5]; 2],
    request_durations: [Histogram; 2],
    /// How long the last lame duck lasted, in seconds.
    lame_duck_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Lame ducks ended, by why.
    lame_ducks: Family<[(&'static str, &'static str); 1], Counter>,
    /// HTTP/1 requests the fast lane forwarded (the rest of `requests` went through hyper).
    fast_lane_requests: Counter,
    /// Outbound requests sent again, or not for want of budget: by direction, reason, outcome.
    retries: Family<[(&'static str, &'static str); 3], Counter>,
    /// Connections the shutdown ended, by protocol and how (clean, reset).
    ended_at_shutdown: Family<[(&'static str, &'static str); 2], Counter>,
}

impl Metrics {
    pub fn new(conns: Arc<Connections>, drain: Arc<Drain>) -> Metrics {
        let mut registry = Registry::with_prefix("lameduck");
        let connections = Family::<Labels, Counter>::default();
        registry.register(
            "connections",
            "Proxy connections accepted, by direction and protocol",
            connections.clone(),
        );
        let connect_failures = Family::<Labels, Counter>::default();
        registry.register(
            "upstream_connect_failures",
            "Failed connections to targets, by direction and reason",
            connect_failures.clone(),
        );
        let accept_errors = Family::<DirectionLabel, Counter>::default();
        registry.register(
            "accept_errors",
            "Errors accepting connections, by direction",
            accept_errors.clone(),
        );
        let refused = Family::<Labels, Counter>::default();
        registry.register(
            "connections_refused",
            "Connections on orig-dst routes refused, by direction and reason: not_redirected (sent to the proxy's port itself), to_proxy (bound for one of the proxy's own listeners), loop (one of the proxy's own connections, sent back to it)",
            refused.clone(),
        );
        let late = Family::<Labels, Counter>::default();
        registry.register(
            "late_connections",
            "Connections that arrived after the lame duck was over (the cluster still sent them here), by direction and fate: handed_off to the pod's Service, or refused at once (accepted and reset)",
            late.clone(),
        );
        let handoffs = Family::<ProtocolLabel, Counter>::default();
        registry.register(
            "handoffs",
            "Late connections handed off to the pod's Service, by the protocol they spoke (http1, http2, tcp)",
            handoffs.clone(),
        );
        let handoff_failures = Family::<ProtocolLabel, Counter>::default();
        registry.register(
            "handoff_failures",
            "Hand-offs that did not reach a pod of the Service, by protocol: an HTTP request answered by the proxy itself (502, 504), a TCP stream reset",
            handoff_failures.clone(),
        );
        let handoff_loops = Counter::default();
        registry.register(
            "handoff_loops",
            "Connections of the hand-off that the node's Service rules sent back to this pod, each reset and dialled again",
            handoff_loops.clone(),
        );
        let force_closed = Counter::default();
        registry.register(
            "connections_force_closed",
            "Connections reset because the grace period ran out or a second signal arrived",
            force_closed.clone(),
        );
        let connection_limit = Gauge::default();
        registry.register(
            "connection_limit",
            "Open proxy connections allowed at once (from the file-descriptor limit)",
            connection_limit.clone(),
        );
        let limit_waits = Counter::default();
        registry.register(
            "connection_limit_waits",
            "Times an accept loop found the connection limit reached and let new connections wait in the listen queue",
            limit_waits.clone(),
        );
        let timeout_family = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "timeouts",
            "Connections closed because nothing moved for a bound, by timeout",
            timeout_family.clone(),
        );
        let timeouts = Timeout::ALL.map(|timeout| {
            timeout_family
                .get_or_create(&[("timeout", timeout.as_str())])
                .clone()
        });
        let request_family = Family::<Labels, Counter>::default();
        registry.register(
            "requests",
            "HTTP requests answered, by direction and status class",
            request_family.clone(),
        );
        let requests = DIRECTIONS.map(|direction| {
            STATUS_CLASSES.map(|class| {
                request_family
                    .get_or_create(&[("direction", direction.as_str()), ("status_class", class)])
                    .clone()
            })
        });
        let duration_family = Family::<DirectionLabel, Histogram>::new_with_constructor(
            (|| Histogram::new(DURATION_BUCKETS.iter().copied())) as fn() -> Histogram,
        );
        registry.register(
            "request_duration_seconds",
            "Time from an HTTP request's head to the end of its response body, by direction",
            duration_family.clone(),
        );
        let request_durations = DIRECTIONS.map(|direction| {
            duration_family
                .get_or_create(&[("direction", direction.as_str())])
                .clone()
        });
        let lame_duck_seconds = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "lame_duck_seconds",
            "How long the last lame duck lasted (listeners still accepting after the shutdown or the inbound quiesce started)",
            lame_duck_seconds.clone(),
        );
        let lame_ducks = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "lame_ducks",
            "Lame ducks ended, by why: quiet (every source of new connections quiet for its window: docs/pod-lifecycle.md), max (new connections still arriving at the maximum), period (a fixed period over)",
            lame_ducks.clone(),
        );
        for why in ["quiet", "max", "period"] {
            let _ = lame_ducks.get_or_create(&[("ended", why)]);
        }
        let fast_lane_requests = Counter::default();
        registry.register(
            "http1_fast_lane_requests",
            "HTTP/1 requests forwarded by the fast lane; the others went through hyper (--http1-fast-lane)",
            fast_lane_requests.clone(),
        );
        let retries = Family::<[(&'static str, &'static str); 3], Counter>::default();
        registry.register(
            "http_retries",
            "Outbound HTTP requests that got no answer and were sent again (outcome=retried) or not, the retry budget being spent (outcome=budget_exhausted), by why: not_connected (the connect failed), not_sent (the target refused the stream, or the request never left), unread (the target reset the connection with the request unread), may_have_reached (the connection closed before a response; idempotent requests without a body only)",
            retries.clone(),
        );
        let ended_at_shutdown = Family::<[(&'static str, &'static str); 2], Counter>::default();
        registry.register(
            "connections_ended_at_shutdown",
            "Connections still open when the close-spread window opened that it ended (how=clean: a FIN each way, a WebSocket Close frame, gRPC status 14, an HTTP/2 stream ended or cancelled, and the peers closed too), and connections reset when the grace period ran out or a second signal arrived (how=reset), by protocol",
            ended_at_shutdown.clone(),
        );
        registry.register_collector(Box::new(StateCollector { conns, drain }));
        Metrics {
            ended_at_shutdown,
            retries,
            fast_lane_requests,
            lame_duck_seconds,
            lame_ducks,
            registry,
            connections,
            connect_failures,
            accept_errors,
            refused,
            late,
            handoff_loops,
            handoffs,
            handoff_failures,
            force_closed,
            connection_limit,
            limit_waits,
            timeouts,
            requests,
            request_durations,
        }
    }

    pub fn set_connection_limit(&self, limit: usize) {
        self.connection_limit
            .set(i64::try_from(limit).unwrap_or(i64::MAX));
    }

    /// An accept loop waits for a place under the connection limit.
    pub fn limit_reached(&self) {
        self.limit_waits.inc();
    }

    pub fn timed_out(&self, timeout: Timeout) {
        self.timeout_counter(timeout).inc();
    }

    /// The counter of `timeout`, for a bound that counts by itself when it fires.
    pub fn timeout_counter(&self, timeout: Timeout) -> &Counter {
        &self.timeouts[timeout as usize]
    }

    /// What `direction` has served so far: HTTP requests answered and opaque TCP connections
    /// (the traffic whose rate an adaptive lame duck expects to go on as new connections).
    pub fn served(&self, direction: Direction) -> u64 {
        let index = DIRECTIONS
            .iter()
            .position(|known| *known == direction)
            .unwrap_or_default();
        let requests: u64 = self.requests[index].iter().map(Counter::get).sum();
        let tcp = self
            .connections
            .get_or_create(&[
                ("direction", direction.as_str()),
                ("protocol", ConnProtocol::Tcp.as_str()),
            ])
            .get();
        requests + tcp
    }

    pub fn connection_opened(&self, direction: Direction, protocol: ConnProtocol) {
        self.connections
            .get_or_create(&[
                ("direction", direction.as_str()),
                ("protocol", protocol.as_str()),
            ])
            .inc();
    }

    pub fn connect_failed(&self, direction: Direction, failure: ConnectFailure) {
        self.connect_failures
            .get_or_create(&[
                ("direction", direction.as_str()),
                ("reason", failure.as_str()),
            ])
            .inc();
    }

    pub fn late_connection(&self, direction: Direction, handed_off: bool) {
        let fate = match handed_off {
            true => "handed_off",
            false => "refused",
        };
        self.late
            .get_or_create(&[("direction", direction.as_str()), ("fate", fate)])
            .inc();
    }

    pub fn handoff_loop(&self) {
        self.handoff_loops.inc();
    }

    pub fn handoff(&self, protocol: ConnProtocol) {
        self.handoffs
            .get_or_create(&[("protocol", protocol.as_str())])
            .inc();
    }

    pub fn handoff_failed(&self, protocol: ConnProtocol) {
        self.handoff_failures
            .get_or_create(&[("protocol", protocol.as_str())])
            .inc();
    }

    pub fn accept_failed(&self, direction: Direction) {
        self.accept_errors
            .get_or_create(&[("direction", direction.as_str())])
            .inc();
    }

    /// A connection on an `orig-dst` route had nowhere to go (`reason`).
    pub fn connection_refused(&self, direction: Direction, reason: &'static str) {
        self.refused
            .get_or_create(&[("direction", direction.as_str()), ("reason", reason)])
            .inc();
    }

    /// An HTTP response started with `status`.
    pub fn request_finished(&self, direction: Direction, status: u16) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.requests[direction as usize][class].inc();
    }

    /// The duration histogram of `direction`, for one request to observe when it ends.
    pub fn request_duration(&self, direction: Direction) -> Histogram {
        self.request_durations[direction as usize].clone()
    }

    /// The fast lane took an HTTP/1 request.
    pub fn fast_lane_request(&self) {
        self.fast_lane_requests.inc();
    }

    /// An unanswered request was sent again (`retried`) or not (`budget_exhausted`).
    pub fn retry(&self, direction: Direction, reason: &'static str, outcome: &'static str) {
        self.retries
            .get_or_create(&[
                ("direction", direction.as_str()),
                ("reason", reason),
                ("outcome", outcome),
            ])
            .inc();
    }

    /// A lame duck ended after `lasted`, for the reason `why` (`quiet`, `max`, `period`).
    pub fn lame_duck_ended(&self, lasted: Duration, why: &'static str) {
        self.lame_duck_seconds.set(lasted.as_secs_f64());
        self.lame_ducks.get_or_create(&[("ended", why)]).inc();
    }

    /// Connections reset when the grace period ran out or a second signal arrived, by protocol.
    pub fn force_closed(&self, protocols: impl Iterator<Item = ConnProtocol>) {
        for protocol in protocols {
            self.force_closed.inc();
            self.ended_at_shutdown(protocol, false);
        }
    }

    /// The close-spread window ended a connection: cleanly, or it was reset at the deadline.
    pub fn ended_at_shutdown(&self, protocol: ConnProtocol, clean: bool) {
        let how = if clean { "clean" } else { "reset" };
        self.ended_at_shutdown
            .get_or_create(&[("protocol", protocol.as_str()), ("how", how)])
            .inc();
    }

    /// The exposition served on `/metrics`.
    pub fn encode(&self) -> Result<String, fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Reads the registry and the drain at scrape time.
#[derive(Debug)]
struct StateCollector {
    conns: Arc<Connections>,
    drain: Arc<Drain>,
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let mut open = [[0i64; ConnProtocol::ALL.len()]; 2];
        for conn in self.conns.snapshot() {
            open[conn.direction() as usize][conn.protocol() as usize] += 1;
        }
        let mut family = encoder.encode_descriptor(
            "connections_open",
            "Open proxy connections, by direction and protocol",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        for direction in DIRECTIONS {
            for protocol in ConnProtocol::ALL {
                let labels = [
                    ("direction", direction.as_str()),
                    ("protocol", protocol.as_str()),
                ];
                ConstGauge::new(open[direction as usize][protocol as usize])
                    .encode(family.encode_family(&labels)?)?;
            }
        }

        let mut in_flight = [0i64; 2];
        for conn in self.conns.snapshot() {
            in_flight[conn.direction() as usize] += i64::from(
                conn.requests_in_flight
                    .load(std::sync::atomic::Ordering::Relaxed),
            );
        }
        let mut family = encoder.encode_descriptor(
            "requests_in_flight",
            "HTTP requests whose response has not ended yet, by direction",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        for direction in DIRECTIONS {
            ConstGauge::new(in_flight[direction as usize])
                .encode(family.encode_family(&[("direction", direction.as_str())])?)?;
        }

        let totals = DIRECTIONS.map(|direction| self.conns.byte_totals(direction));
        for (name, help, pick) in [
            (
                "bytes_from_peer",
                "Bytes received from peers (clients of the proxy), by direction",
                (|t: &crate::conns::ByteTotals| t.from_peer)
                    as fn(&crate::conns::ByteTotals) -> u64,
            ),
            (
                "bytes_to_peer",
                "Bytes forwarded to peers from targets, by direction",
                |t| t.to_peer,
            ),
        ] {
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                ConstCounter::new(0u64).metric_type(),
            )?;
            for (direction, total) in DIRECTIONS.iter().zip(&totals) {
                ConstCounter::new(pick(total))
                    .encode(family.encode_family(&[("direction", direction.as_str())])?)?;
            }
        }

        let current = self.drain.phase();
        let mut family = encoder.encode_descriptor(
            "shutdown_phase",
            "1 for the current lifecycle phase, 0 for the others",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        for phase in Phase::ALL {
            ConstGauge::new(i64::from(phase == current))
                .encode(family.encode_family(&[("phase", phase.as_str())])?)?;
        }

        let started = self.drain.started_at().map_or(0.0, |(_, wall)| {
            wall.duration_since(UNIX_EPOCH)
                .map_or(0.0, |since| since.as_secs_f64())
        });
        ConstGauge::new(started).encode(encoder.encode_descriptor(
            "shutdown_started_timestamp_seconds",
            "Unix time at which the shutdown was triggered, 0 before",
            None,
            ConstGauge::new(0.0f64).metric_type(),
        )?)?;

        // The inbound quiesce of an app container's preStop hook (docs/pod-lifecycle.md).
        ConstGauge::new(i64::from(self.drain.is_inbound_quiesced())).encode(
            encoder.encode_descriptor(
                "inbound_quiesced",
                "1 while the inbound side is quiesced by an app container's preStop hook",
                None,
                ConstGauge::new(0i64).metric_type(),
            )?,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_timeout_has_its_own_counter() {
        for (index, timeout) in Timeout::ALL.into_iter().enumerate() {
            assert_eq!(timeout as usize, index, "{timeout:?}");
        }
    }
}
