//! The data path: every proxy route's listeners, and the connections they accept.
//!
//! A connection goes through [`accept`] (the accept loop, under the connection limit), is told
//! apart by [`detect`] on `auto` and `http` routes, and is served as opaque TCP by [`tcp`] or
//! as HTTP by [`http`]. [`quiet`] is the bound on states in which nothing moves. What every
//! connection of the process shares is a [`ProxyContext`]; what one route's connections share
//! is its [`ProxyRoute`].

pub(crate) mod accept;
mod detect;
pub(crate) mod handoff;
pub(crate) mod http;
mod quiet;
mod tcp;
mod websocket;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::config::{Cidr, Direction, HttpConfig, RetryBudget, Route, Target, TcpConfig};
use crate::conns::Connections;
use crate::drain::Drain;
use crate::logging::Throttle;
use crate::metrics::Metrics;
use crate::net::OwnPorts;
use crate::sync::lock;

pub(crate) use handoff::Handoff;
pub(crate) use http::Upstream;

/// A route and what serving it needs.
pub struct ProxyRoute {
    pub route: Arc<Route>,
    /// Whether its IPv6 listener leaves IPv4 to another route on the same port
    /// ([`net::v6_only`](crate::net::v6_only)); kept to bind it again after a quiesce.
    pub v6_only: bool,
    upstreams: Upstreams,
    /// A hand-off's route (src/proxy/handoff.rs): its late connection goes to the Service.
    pub handoff: Option<Arc<Handoff>>,
}

/// The pooled clients towards a route's targets, for HTTP.
enum Upstreams {
    /// The route's one target.
    Fixed(Arc<Upstream>),
    /// One per original destination (an `orig-dst` route), made at its first connection.
    PerDestination {
        made: Mutex<HashMap<SocketAddr, Arc<Upstream>>>,
        connect_timeout: Duration,
        metrics: Arc<Metrics>,
        own_ports: Arc<OwnPorts>,
        retry_budget: Option<RetryBudget>,
    },
}

/// Destinations whose clients an `orig-dst` route keeps while nothing uses them; beyond it,
/// those are let go (their idle pooled connections close).
const KEPT_DESTINATIONS: usize = 1024;

impl ProxyRoute {
    pub fn new(
        route: Arc<Route>,
        v6_only: bool,
        connect_timeout: Duration,
        proxy: &ProxyContext,
    ) -> ProxyRoute {
        let metrics = proxy.metrics.clone();
        // Retries go to another pod only outbound (docs/http.md, "Retries").
        let retry_budget = proxy
            .http
            .retry_budget
            .filter(|_| route.direction == Direction::Outbound);
        let upstreams = match &route.target {
            Target::OrigDst => Upstreams::PerDestination {
                made: Mutex::new(HashMap::new()),
                connect_timeout,
                metrics,
                own_ports: proxy.own_ports.clone(),
                retry_budget,
            },
            target => Upstreams::Fixed(Arc::new(Upstream::new(
                target.clone(),
                route.direction,
                connect_timeout,
                metrics,
                None,
                retry_budget,
            ))),
        };
        ProxyRoute {
            route,
            v6_only,
            upstreams,
            handoff: None,
        }
    }

    /// The route of a late connection handed off to `route`'s target, a Service.
    pub fn handing_off(
        route: Arc<Route>,
        v6_only: bool,
        upstream: Arc<Upstream>,
        handoff: Arc<Handoff>,
    ) -> ProxyRoute {
        ProxyRoute {
            route,
            v6_only,
            upstreams: Upstreams::Fixed(upstream),
            handoff: Some(handoff),
        }
    }

    /// The pooled clients towards the route's target, or towards `destination` on an
    /// `orig-dst` route.
    pub fn upstream(&self, destination: Option<SocketAddr>) -> Arc<Upstream> {
        match (&self.upstreams, destination) {
            (Upstreams::Fixed(upstream), _) => upstream.clone(),
            (
                Upstreams::PerDestination {
                    made,
                    connect_timeout,
                    metrics,
                    own_ports,
                    retry_budget,
                },
                Some(destination),
            ) => {
                let mut made = lock(made);
                if made.len() >= KEPT_DESTINATIONS && !made.contains_key(&destination) {
                    made.retain(|_, upstream| Arc::strong_count(upstream) > 1);
                }
                made.entry(destination)
                    .or_insert_with(|| {
                        Arc::new(Upstream::new(
                            Target::Addr(destination),
                            self.route.direction,
                            *connect_timeout,
                            metrics.clone(),
                            Some(own_ports.clone()),
                            *retry_budget,
                        ))
                    })
                    .clone()
            }
            (Upstreams::PerDestination { .. }, None) => {
                unreachable!("a connection of an orig-dst route has its destination")
            }
        }
    }
}

/// Everything a connection task needs, shared by all connections of the process.
#[derive(Debug)]
pub struct ProxyContext {
    pub drain: Arc<Drain>,
    pub conns: Arc<Connections>,
    pub metrics: Arc<Metrics>,
    pub connect_timeout: Duration,
    pub http: HttpConfig,
    pub tcp: TcpConfig,
    /// One permit per open proxy connection, sized from the file-descriptor limit; the accept
    /// loops take a permit before accepting, and each connection's registration holds its own.
    pub limit: Arc<Semaphore>,
    /// Every address the proxy listens on (routes and admin): an `orig-dst` connection bound
    /// for one of them is refused, not forwarded to the proxy itself.
    pub listeners: Vec<SocketAddr>,
    /// The local ports of the proxy's own connections to original destinations: one that
    /// comes back to the proxy is refused, not forwarded again.
    pub own_ports: Arc<OwnPorts>,
    /// At most one log line a second about refused `orig-dst` connections.
    pub refusal_log: Mutex<Throttle>,
    /// For an adaptive lame duck, the peers whose new connections do not hold it open (the
    /// kubelet's probes come from the node's address); `None` when the lame duck is fixed and
    /// arrivals are not recorded at all.
    pub lame_duck_ignore_sources: Option<Vec<Cidr>>,
    /// Where late inbound connections go instead of being refused, if anywhere.
    pub handoff: Option<Arc<Handoff>>,
}

impl ProxyContext {
    /// Whether a new connection from `peer` tells an adaptive lame duck that peers still send
    /// here.
    pub fn counts_for_lame_duck(&self, peer: IpAddr) -> bool {
        self.lame_duck_ignore_sources
            .as_ref()
            .is_some_and(|ignored| !ignored.iter().any(|cidr| cidr.contains(peer)))
    }
}
