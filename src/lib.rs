//! lameduck: a service-mesh sidecar proxy that shuts down gracefully.
//!
//! Modules, in the order a connection meets them:
//! - [`config`]: flags, `LAMEDUCK_*` variables and defaults, parsed into a validated `Config`;
//! - [`signals`]: SIGTERM/SIGINT/SIGHUP, installed before anything else;
//! - [`app`]: `build()` binds every socket, `Bound::run()` is the lifecycle, top to bottom;
//! - [`drain`]: the one owner of the shutdown state (phases, tokens, trackers);
//! - [`listener`]: binding and the accept loop, with back-off on exhausted resources;
//! - [`tcp`]: opaque TCP forwarding with half-close and byte counting;
//! - [`conns`]: the registry of open connections behind `/connections` and the metrics;
//! - [`admin`]: the admin server (`/live`, `/ready`, `/metrics`, `/shutdown`, `/connections`);
//! - [`metrics`]: Prometheus metrics;
//! - [`logging`]: the `tracing` subscriber.

pub mod admin;
pub mod app;
pub mod config;
pub mod conns;
pub mod drain;
pub mod listener;
pub mod logging;
pub mod metrics;
pub mod signals;
pub mod tcp;
