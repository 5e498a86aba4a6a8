//! Hand-off: a late connection goes to another pod of the Service it came for, instead of
//! being refused (docs/pod-lifecycle.md, "Hand-off").
//!
//! Once an adaptive lame duck is over, the inbound listeners stay (src/proxy/accept.rs,
//! `refuse_late`). A connection that still arrives there, on a pod port with a hand-off
//! (`--handoff`), is served as any inbound connection is, towards the Service's address
//! instead of the app: HTTP request by request through hyper's path (each request marked with
//! `lameduck-handoff`, one hop at most: src/proxy/http/policy.rs), opaque TCP as a tunnel
//! (`tcp::hand_off`). Only late connections of inbound routes are handed off, and only to the
//! Services configured: the proxy is never a relay for anyone else.
//!
//! The hand-off goes through the node's Service rules, which may still send it back to this
//! very pod. Each of its connections leaves from a port recorded here before its first SYN; a
//! late connection from such a port is the hand-off's own, come back (the node's hairpin
//! masquerade changes its address, not its port): it is reset unread, and the hand-off dials
//! again (another draw of the Service's endpoints). A request that came back never reached an
//! app, so it goes again whatever its method; a TCP stream's first bytes are kept until it is
//! clear that its connection did not come back, and sent again on the next one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::header::HeaderValue;
use tokio::net::TcpStream;

use super::{ProxyRoute, Upstream};
use crate::config::{Direction, Handoffs, RetryBudget, Route, Target};
use crate::metrics::Metrics;
use crate::net::{self, OwnPorts};

/// The retries of handed-off requests: each of them never reached an app (a connect refused,
/// the hand-off's own connection come back, another leaving pod's refusal), and a loop may
/// strike one try in two when the pod's own node still routes to it: the budget must not be
/// what fails a hand-off. The number of tries per request stays bounded (`policy::Tries`).
const HANDOFF_RETRY_BUDGET: RetryBudget = RetryBudget {
    percent: 100,
    per_second: 100,
};

/// How long past its connect a hand-off's port stays recorded: a connection the node sends
/// back completes its handshake as the dial does, and the listener's task accepts it at once;
/// a second is that with a wide margin. The ports are not clients' ports (src/net.rs,
/// `DIAL_PORTS`); another pod's hand-off that arrives from a port this pod dialled from in that
/// second is taken for a loop and reset unread, and that pod dials again.
const DIAL_RECORDED: Duration = Duration::from_secs(1);

/// The hand-offs of the pod ports that have one, and what tells their loops apart.
pub struct Handoff {
    services: Vec<(u16, Target, Arc<Upstream>)>,
    /// The local ports of the hand-off's connections (HTTP and TCP), in the second after
    /// their dial.
    pub(super) dial_ports: Arc<OwnPorts>,
}

impl std::fmt::Debug for Handoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff")
            .field(
                "services",
                &self
                    .services
                    .iter()
                    .map(|(port, target, _)| format!("{port}={target}"))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Handoff {
    /// The hand-offs configured, if any; `mark` is what each handed-off request carries (the
    /// pod's address: the pod it came from, for whoever reads the marked request).
    pub fn new(
        handoffs: &Handoffs,
        mark: &str,
        connect_timeout: Duration,
        metrics: &Arc<Metrics>,
    ) -> Option<Handoff> {
        if handoffs.is_empty() {
            return None;
        }
        let mark = HeaderValue::from_str(mark).unwrap_or(HeaderValue::from_static("1"));
        let dial_ports = Arc::new(OwnPorts::dials_only(DIAL_RECORDED));
        let services = handoffs
            .iter()
            .map(|(port, target)| {
                let upstream = Upstream::new(
                    target.clone(),
                    Direction::Inbound,
                    connect_timeout,
                    metrics.clone(),
                    Some(dial_ports.clone()),
                    Some(HANDOFF_RETRY_BUDGET),
                )
                .handing_off(mark.clone());
                (*port, target.clone(), Arc::new(upstream))
            })
            .collect();
        Some(Handoff {
            services,
            dial_ports,
        })
    }

    /// Whether a late connection from `peer` is one of the hand-off's own, sent back here by
    /// the node's Service rules: reset unread, its dialler sees the reset and dials again.
    pub fn came_back(&self, peer: SocketAddr) -> bool {
        self.dial_ports.contains(peer.port())
    }

    /// The route that serves a late connection of `route` towards its pod port's Service, if
    /// that port has a hand-off: the port it addressed before the pod's NAT rules (an
    /// `orig-dst` route), or the listener's.
    pub fn route_for(
        self: &Arc<Self>,
        stream: &TcpStream,
        route: &ProxyRoute,
    ) -> Option<Arc<ProxyRoute>> {
        if route.route.direction != Direction::Inbound {
            return None;
        }
        let port = match route.route.target {
            Target::OrigDst => net::original_destination(stream).ok()?.port(),
            _ => route.route.listen.port(),
        };
        let (_, target, upstream) = self.services.iter().find(|(known, ..)| *known == port)?;
        let handed = Route {
            target: target.clone(),
            ..(*route.route).clone()
        };
        Some(Arc::new(ProxyRoute::handing_off(
            Arc::new(handed),
            route.v6_only,
            upstream.clone(),
            self.clone(),
        )))
    }
}
