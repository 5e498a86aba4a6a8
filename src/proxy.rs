//! The data path: every proxy route's listeners, and the connections they accept.
//!
//! A connection goes through [`accept`] (the accept loop, under the connection limit), is told
//! apart by [`detect`] on `auto` and `http` routes, and is served as opaque TCP by [`tcp`] or
//! as HTTP by [`http`]. [`quiet`] is the bound on states in which nothing moves. What every
//! connection of the process shares is a [`ProxyContext`]; what one route's connections share
//! is its [`ProxyRoute`].

pub(crate) mod accept;
mod detect;
pub(crate) mod http;
mod quiet;
mod tcp;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::config::{HttpConfig, Route, TcpConfig};
use crate::conns::Connections;
use crate::drain::Drain;
use crate::metrics::Metrics;

pub(crate) use http::Upstream;

/// A route and what serving it needs.
pub struct ProxyRoute {
    pub route: Arc<Route>,
    /// Pooled clients towards the target, for HTTP.
    pub upstream: Upstream,
    /// The target as written in the route, for error responses (formatted once, not per request).
    pub target_name: String,
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
}
