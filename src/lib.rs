//! lameduck: a service-mesh sidecar proxy that shuts down gracefully.
//!
//! The layers, from the bottom up (a module uses only those above it in this list, never one
//! below; docs/architecture.md draws the graph):
//! - [`config`]: flags, `LAMEDUCK_*` variables and defaults, parsed into a validated `Config`;
//!   [`logging`]: the `tracing` subscriber; [`sync`]: the lock helper;
//! - [`net`]: sockets: bind, close without resetting handshakes, the connection limit,
//!   connect, reset, back-off;
//! - [`drain`]: the one owner of the shutdown (phases, the tokens connections listen to, the
//!   trackers of their tasks), with verbs for the lifecycle to call;
//! - [`conns`]: the registry of open connections behind `/connections` and the metrics;
//!   [`metrics`]: Prometheus metrics; [`arrivals`]: the new connections of a lame duck by source,
//!   and the rule that says when they have stopped; [`lame_duck`]: how long listeners keep accepting once
//!   the shutdown or the inbound quiesce has started (fixed, or while connections arrive);
//!   [`close_spread`]: the last part of the grace period, in which the connections still open
//!   are ended one by one;
//! - [`proxy`]: the data path: the accept loop, protocol detection, opaque TCP, and
//!   [`proxy::http`] (serving HTTP/1 and HTTP/2, the proxy service, headers, bodies, the
//!   clients towards targets);
//! - [`admin`]: the admin server; [`quiesce`]: the inbound drain that the app containers'
//!   `preStop` hooks ask for, on a Unix socket; [`signals`]: SIGTERM/SIGINT/SIGHUP;
//! - [`app`]: `build()` binds every socket, `Bound::run()` is the lifecycle, top to bottom;
//! - [`commands`]: the other subcommands: `await`, `inject`, `prestop`/`poststart`, `status`.

mod admin;
pub mod app;
pub mod arrivals;
mod close_spread;
pub mod commands;
pub mod config;
mod conns;
mod drain;
mod lame_duck;
pub mod logging;
mod metrics;
mod net;
mod proxy;
mod quiesce;
pub mod signals;
mod sync;
