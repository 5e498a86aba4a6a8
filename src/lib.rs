//! lameduck: a service-mesh sidecar proxy that shuts down gracefully.
//!
//! Modules, in the order a connection meets them:
//! - [`config`]: flags, `LAMEDUCK_*` variables and defaults, parsed into a validated `Config`;
//! - [`signals`]: SIGTERM/SIGINT/SIGHUP, installed before anything else;
//! - [`app`]: `build()` binds every socket, `Bound::run()` is the lifecycle, top to bottom;
//! - [`drain`]: the one owner of the shutdown state (phases, tokens, trackers);
//! - [`listener`]: binding and the accept loop, with back-off on exhausted resources;
//! - [`detect`]: telling HTTP/1, HTTP/2 and opaque TCP apart by peeking;
//! - [`tcp`]: opaque TCP forwarding with half-close and byte counting;
//! - [`quiet`]: the bound on states in which nothing moves (idle HTTP/2, half-closed TCP);
//! - [`http`]: serving and draining HTTP/1 and HTTP/2 connections;
//! - [`proxy`]: the HTTP proxy service (hop-by-hop headers, errors, upgrades);
//! - [`upstream`]: pooled HTTP clients towards each route's target;
//! - [`conns`]: the registry of open connections behind `/connections` and the metrics;
//! - [`admin`]: the admin server (`/live`, `/ready`, `/metrics`, `/shutdown`, `/connections`);
//! - [`quiesce`]: the inbound quiesce that the app's `preStop` hook asks for, on a Unix socket;
//! - [`metrics`]: Prometheus metrics;
//! - [`logging`]: the `tracing` subscriber;
//! - [`hook`]: `lameduck prestop` / `poststart`, the app containers' hooks that ask for it;
//! - [`status`]: `lameduck status`, the proxy's state for people;
//! - [`wrapper`]: `lameduck await`, running an app under the proxy's lifecycle;
//! - [`inject`]: `lameduck inject`, the proxy added to Kubernetes workloads.

pub mod admin;
pub mod app;
pub mod config;
pub mod conns;
pub mod detect;
pub mod drain;
pub mod header_block;
pub mod hook;
pub mod http;
pub mod inject;
pub mod listener;
pub mod logging;
pub mod metrics;
pub mod proxy;
pub mod quiesce;
pub mod quiet;
pub mod signals;
pub mod status;
pub mod tcp;
pub mod upstream;
pub mod wrapper;
